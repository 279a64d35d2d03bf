"""The shared half of tools/make_gemma3_reference.py, make_qwen3_5_reference.py and
make_qwen3_moe_reference.py: build a tiny random transformers model under a fixed seed, save it
(config.json + model.safetensors) and write reference.json, its outputs from transformers + torch.

Written per input: the token ids and the log-prob of each next token (position t predicts id t+1),
rounded to 1e-6; plus a greedy continuation of the first input's first tokens (argmax of full forwards)
with the top-1 minus top-2 logit gap at each step. Runs in float32 on CPU, in the separate torch
environment each script's docstring names (torch is not a dependency of the project).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch
import transformers


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


def main(doc: str, name: str, build, config: dict, *, seed: int, lengths, greedy_prompt: int, greedy_tokens: int):
  """Parse --out (default tests/fixtures/NAME), seed torch, `build()` the model (eval, float32), save it and
  its reference.json."""
  parser = argparse.ArgumentParser(description=doc.splitlines()[0])
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", name))
  args = parser.parse_args()
  torch.manual_seed(seed)
  model = build()
  model.save_pretrained(args.out, safe_serialization=True)
  rng = np.random.default_rng(seed)
  inputs = [rng.integers(3, config["vocab_size"], n).tolist() for n in lengths]
  prompt = inputs[0][:greedy_prompt]
  greedy_ids, gaps = greedy(model, prompt, greedy_tokens)
  fixture = {"source": {"transformers": transformers.__version__, "torch": torch.__version__, "config": config,
                        "seed": seed},
             "inputs": [{"input_ids": ids, "next_token_logprobs": next_logprobs(model, ids)} for ids in inputs],
             "greedy": {"prompt_ids": prompt, "ids": greedy_ids, "top1_minus_top2": gaps}}
  with open(os.path.join(args.out, "reference.json"), "w") as f:
    json.dump(fixture, f, indent=1)
  print(f"wrote {args.out}: {sum(p.numel() for p in model.parameters())} parameters, greedy {greedy_ids}")
