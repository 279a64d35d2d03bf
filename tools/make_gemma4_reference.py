"""Write tests/fixtures/gemma4_tiny/: a tiny random Gemma 4 text decoder saved by transformers
(config.json + model.safetensors) and reference.json, its outputs from transformers + torch.

The fixture is the independent reference for our Gemma 4 decoder (models/gemma4.py, tests/test_gemma4.py):
the same weights through transformers' `Gemma4ForCausalLM` and through our loader and model must give the
same next-token log-probs and greedy ids. The configuration exercises what Gemma 4 adds to Gemma 3: global
layers of another head width (global_head_dim) and fewer K/V heads whose values are their keys
(attention_k_eq_v), the value RMSNorm without a scale, attention without a 1/sqrt(d) logit scale, the
proportional RoPE of the global layers (a quarter of each head rotated), a per-layer output scalar, and a
final logit soft-cap small enough to bend these logits. The sliding window (4 tokens) is shorter than every
input. Every RMSNorm weight and layer scalar is random (transformers' ones would hide a misread one). Per-layer
embeddings, K/V sharing and the mixture-of-experts block are off: our loader refuses them by name.

It needs torch, which the project does not depend on, so run it in a separate environment:

    python -m venv /tmp/torchenv
    /tmp/torchenv/bin/pip install torch==2.14.1 transformers==5.25.0 safetensors numpy
    /tmp/torchenv/bin/python tools/make_gemma4_reference.py

The shared half (seed, save, reference.json) is tools/tiny_fixture.py.
"""

from __future__ import annotations

import torch
import tiny_fixture
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

SLIDING, FULL = "sliding_attention", "full_attention"
CONFIG = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
              attention_k_eq_v=True, sliding_window=4, layer_types=[SLIDING, SLIDING, FULL] * 2,
              rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                               FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                      "rope_theta": 1000000.0}},
              final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh", hidden_size_per_layer_input=0,
              vocab_size_per_layer_input=96, num_kv_shared_layers=0, enable_moe_block=False,
              max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=True, pad_token_id=0,
              bos_token_id=2, eos_token_id=1, initializer_range=0.1)
SEED, LENGTHS, GREEDY_PROMPT, GREEDY_TOKENS = 0, (23, 40), 9, 16


def build(fields: dict = CONFIG):
  """A float32 eval-mode Gemma4ForCausalLM of `fields` (a Gemma4TextConfig's) with random norms and layer
  scalars."""
  config = Gemma4TextConfig(**fields)
  config._attn_implementation = "eager"
  model = Gemma4ForCausalLM(config).eval().float()
  with torch.no_grad():   # random norm weights and layer scalars: a misread one must show
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.3 * torch.randn_like(p))
    for layer in model.model.layers:
      layer.layer_scalar.copy_(0.5 + torch.rand_like(layer.layer_scalar))
  return model


if __name__ == "__main__":
  tiny_fixture.main(__doc__, "gemma4_tiny", build, CONFIG, seed=SEED, lengths=LENGTHS, greedy_prompt=GREEDY_PROMPT,
                    greedy_tokens=GREEDY_TOKENS)
