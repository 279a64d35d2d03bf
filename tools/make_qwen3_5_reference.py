"""Write tests/fixtures/qwen3_5_tiny/: a tiny random Qwen3.5 text decoder saved by transformers
(config.json + model.safetensors) and reference.json, its outputs from transformers + torch.

The fixture is the independent reference for our Qwen3.5 decoder (tests/test_qwen3_5.py): the same
weights through transformers' `Qwen3_5ForCausalLM` and through our loader and model must give the same
next-token log-probs and greedy ids. The configuration exercises what differs from Llama: two linear
(Gated DeltaNet) layers then one full layer, twice; more value heads than key heads (repeated) and a
value width other than the key width; partial RoPE (a quarter of each head); an input longer than
transformers' 64-token chunk (so the chunked rule carries its state across chunks); and every norm weight,
A_log and dt_bias random (transformers' init of ones and zeros would hide a missing (1 + w) offset).

It needs torch, which the project does not depend on, so run it in a separate environment:

    python -m venv /tmp/torchenv
    /tmp/torchenv/bin/pip install torch==2.13.0 transformers==5.25.0 safetensors numpy
    /tmp/torchenv/bin/python tools/make_qwen3_5_reference.py

The shared half (seed, save, reference.json) is tools/tiny_fixture.py.
"""

from __future__ import annotations

import torch
import tiny_fixture
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

CONFIG = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
              layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
              rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
              max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=0,
              bos_token_id=2, eos_token_id=1, initializer_range=0.1)
SEED, LENGTHS, GREEDY_PROMPT, GREEDY_TOKENS = 0, (23, 150), 9, 16


def build():
  config = Qwen3_5TextConfig(**CONFIG)
  config._attn_implementation = "eager"
  model = Qwen3_5ForCausalLM(config).eval().float()
  with torch.no_grad():   # random norm weights, decays and biases: (1 + w) and the gates must be read as such
    for name, p in model.named_parameters():
      if "norm" in name or name.endswith(("dt_bias", "A_log")):
        p.copy_(0.3 * torch.randn_like(p))
  return model


if __name__ == "__main__":
  tiny_fixture.main(__doc__, "qwen3_5_tiny", build, CONFIG, seed=SEED, lengths=LENGTHS, greedy_prompt=GREEDY_PROMPT,
                    greedy_tokens=GREEDY_TOKENS)
