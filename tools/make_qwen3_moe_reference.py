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

The shared half (seed, save, reference.json) is tools/tiny_fixture.py.
"""

from __future__ import annotations

import torch
import tiny_fixture
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

CONFIG = dict(vocab_size=96, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
              norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1000000.0,
              max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=0,
              bos_token_id=2, eos_token_id=1, initializer_range=0.1)
SEED, LENGTHS, GREEDY_PROMPT, GREEDY_TOKENS = 0, (23, 40), 9, 16


def build():
  config = Qwen3MoeConfig(**CONFIG)
  config._attn_implementation = "eager"
  model = Qwen3MoeForCausalLM(config).eval().float()
  with torch.no_grad():   # random norm weights; a router sharp enough that tokens pick different experts
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.3 * torch.randn_like(p))
      if name.endswith("mlp.gate.weight"):
        p.copy_(torch.randn_like(p))
  return model


if __name__ == "__main__":
  tiny_fixture.main(__doc__, "qwen3_moe_tiny", build, CONFIG, seed=SEED, lengths=LENGTHS, greedy_prompt=GREEDY_PROMPT,
                    greedy_tokens=GREEDY_TOKENS)
