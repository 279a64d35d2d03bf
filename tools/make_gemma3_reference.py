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

The shared half (seed, save, reference.json) is tools/tiny_fixture.py.
"""

from __future__ import annotations

import torch
import tiny_fixture
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

CONFIG = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, sliding_window=4, query_pre_attn_scalar=12,
              layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
              max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=True, pad_token_id=0,
              bos_token_id=2, eos_token_id=1, initializer_range=0.1)
SEED, LENGTHS, GREEDY_PROMPT, GREEDY_TOKENS = 0, (23, 40), 9, 16


def build():
  config = Gemma3TextConfig(**CONFIG)
  config._attn_implementation = "eager"
  model = Gemma3ForCausalLM(config).eval().float()
  with torch.no_grad():   # random norm weights: Gemma's (1 + w) must be read as such
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(0.3 * torch.randn_like(p))
  return model


if __name__ == "__main__":
  tiny_fixture.main(__doc__, "gemma3_tiny", build, CONFIG, seed=SEED, lengths=LENGTHS, greedy_prompt=GREEDY_PROMPT,
                    greedy_tokens=GREEDY_TOKENS)
