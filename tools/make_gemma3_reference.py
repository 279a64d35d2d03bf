"""Write tests/fixtures/gemma3_tiny/: a tiny random Gemma 3 text decoder saved by transformers
(config.json + model.safetensors) and reference.json, its outputs from transformers + torch.

The fixture is the independent reference for our Gemma 3 decoder (tests/test_gemma.py): the same
weights through transformers' `Gemma3ForCausalLM` and through our loader and model must give the same
next-token log-probs and greedy ids. The configuration is chosen to exercise what differs from Llama:
a sliding window of 4 tokens (shorter than every input, so the window cuts), sliding and full layers
interleaved, a query_pre_attn_scalar other than head_dim, linear RoPE scaling on the full layers and
another base on the sliding ones, and every RMSNorm weight random (Gemma scales by 1 + w, so
transformers' zero init would hide a missing offset).

It needs torch, which the project does not depend on, so run it in a separate environment:

    python -m venv /tmp/torchenv
    /tmp/torchenv/bin/pip install torch==2.14.1 transformers==5.25.0 safetensors numpy
    /tmp/torchenv/bin/python tools/make_gemma3_reference.py

The model runs in float32 on CPU. Written per input: the token ids and the log-prob of each next token
(position t predicts id t+1); plus a greedy 16-token continuation (argmax of full forwards) with the
top-1 minus top-2 logit gap at each step.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch
import transformers
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

CONFIG = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, sliding_window=4, query_pre_attn_scalar=12,
              layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
              max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=True, pad_token_id=0,
              bos_token_id=2, eos_token_id=1, initializer_range=0.1)
SEED, LENGTHS, GREEDY_PROMPT, GREEDY_TOKENS = 0, (23, 40), 9, 16


def _r(x, digits=6):
  return [round(float(v), digits) for v in x]


@torch.no_grad()
def next_logprobs(model, ids: list[int]) -> list[float]:
  logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
  return _r(logprobs[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0])


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
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "gemma3_tiny"))
  args = parser.parse_args()
  torch.manual_seed(SEED)
  config = Gemma3TextConfig(**CONFIG)
  config._attn_implementation = "eager"
  model = Gemma3ForCausalLM(config).eval().float()
  with torch.no_grad():   # random norm weights: Gemma's (1 + w) must be read as such
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(0.3 * torch.randn_like(p))
  model.save_pretrained(args.out, safe_serialization=True)

  rng = np.random.default_rng(SEED)
  inputs = [rng.integers(3, CONFIG["vocab_size"], n).tolist() for n in LENGTHS]
  prompt = inputs[0][:GREEDY_PROMPT]
  greedy_ids, gaps = greedy(model, prompt, GREEDY_TOKENS)
  fixture = {"source": {"transformers": transformers.__version__, "torch": torch.__version__, "config": CONFIG,
                        "seed": SEED},
             "inputs": [{"input_ids": ids, "next_token_logprobs": next_logprobs(model, ids)} for ids in inputs],
             "greedy": {"prompt_ids": prompt, "ids": greedy_ids, "top1_minus_top2": gaps}}
  with open(os.path.join(args.out, "reference.json"), "w") as f:
    json.dump(fixture, f, indent=1)
  print(f"wrote {args.out}: {sum(p.numel() for p in model.parameters())} parameters, greedy {greedy_ids}")


if __name__ == "__main__":
  main()
