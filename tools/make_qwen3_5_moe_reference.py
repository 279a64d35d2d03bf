"""Write tests/fixtures/qwen3_5_moe_tiny/: a tiny random Qwen3.5-MoE text decoder saved by transformers
(config.json + model.safetensors) and reference.json, its outputs from transformers + torch.

The fixture is the independent reference for our Qwen3.5-MoE decoder (tests/test_qwen3_5_moe.py): the same
weights through transformers' `Qwen3_5MoeForCausalLM` and through our loader and model must give the same
next-token log-probs and greedy ids. The configuration exercises what Qwen3.5-MoE adds to Qwen3.5: every
layer's MLP a mixture of 8 experts, 2 per token (top-k probabilities renormalised), an expert width other than
the model width, and a shared expert whose output is scaled by sigmoid(x w_shared_gate); its attention is
Qwen3.5's (two linear layers then one full, twice). Norm weights, A_log, dt_bias and the router are random at a
scale where tokens pick different experts.

It needs torch, which the project does not depend on, so run it in a separate environment:

    python -m venv /tmp/torchenv
    /tmp/torchenv/bin/pip install torch==2.13.0 transformers==5.25.0 safetensors numpy
    /tmp/torchenv/bin/python tools/make_qwen3_5_moe_reference.py

The shared half (seed, save, reference.json) is tools/tiny_fixture.py.
"""

from __future__ import annotations

import torch
import tiny_fixture
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

CONFIG = dict(vocab_size=96, hidden_size=48, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
              layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
              moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=8, num_experts_per_tok=2,
              rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
              max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=0,
              bos_token_id=2, eos_token_id=1, initializer_range=0.1)
SEED, LENGTHS, GREEDY_PROMPT, GREEDY_TOKENS = 0, (23, 150), 9, 16


def build():
  config = Qwen3_5MoeTextConfig(**CONFIG)
  config._attn_implementation = "eager"
  model = Qwen3_5MoeForCausalLM(config).eval().float()
  with torch.no_grad():   # random norms, decays and biases ((1 + w) and the gates read as such); a sharp router
    for name, p in model.named_parameters():
      if "norm" in name or name.endswith(("dt_bias", "A_log")):
        p.copy_(0.3 * torch.randn_like(p))
      if name.endswith("mlp.gate.weight"):
        p.copy_(torch.randn_like(p))
      if name.endswith(("experts.gate_up_proj", "experts.down_proj")):   # transformers leaves these unset
        p.copy_(0.1 * torch.randn_like(p))
  return model


if __name__ == "__main__":
  tiny_fixture.main(__doc__, "qwen3_5_moe_tiny", build, CONFIG, seed=SEED, lengths=LENGTHS,
                    greedy_prompt=GREEDY_PROMPT, greedy_tokens=GREEDY_TOKENS)
