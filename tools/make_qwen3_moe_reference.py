"""Write tests/fixtures/qwen3_moe_tiny/: a tiny random Qwen3-MoE decoder saved by transformers
(config.json + model.safetensors) and reference.json, its outputs from transformers + torch.

The fixture is the independent reference for our Qwen3-MoE decoder (tests/test_moe.py): the same
weights through transformers' `Qwen3MoeForCausalLM` and through our loader and model must give the same
next-token log-probs and greedy ids. The configuration exercises the mixture of experts: 8 experts, 2 per
token with the top-k probabilities renormalised (norm_topk_prob), an expert width other than the model
width, and a router initialised at a scale where the top-2 choices differ from token to token.

It needs torch, which the project does not depend on, so run it in a separate environment:

    python -m venv /tmp/torchenv
    /tmp/torchenv/bin/pip install torch==2.13.0 transformers==5.25.0 safetensors numpy
    /tmp/torchenv/bin/python tools/make_qwen3_moe_reference.py

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
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

CONFIG = dict(vocab_size=96, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
              norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1000000.0,
              max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=0,
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
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "qwen3_moe_tiny"))
  args = parser.parse_args()
  torch.manual_seed(SEED)
  config = Qwen3MoeConfig(**CONFIG)
  config._attn_implementation = "eager"
  model = Qwen3MoeForCausalLM(config).eval().float()
  with torch.no_grad():   # random norm weights; a router sharp enough that tokens pick different experts
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.3 * torch.randn_like(p))
      if name.endswith("mlp.gate.weight"):
        p.copy_(torch.randn_like(p))
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
