"""Write tests/fixtures/gemma4_moe_tiny/: a tiny random Gemma 4 text decoder with the mixture-of-experts block
(the 26B-A4B layout) saved by transformers (config.json + model.safetensors) and reference.json, its outputs
from transformers + torch.

The fixture is the independent reference for our Gemma 4 experts (models/gemma4.py, `llama.moe_mlp`;
tests/test_gemma4_moe.py). It is make_gemma4_reference.py's configuration (both layer shapes, k_eq_v, the
window of 4, proportional RoPE, the cap, random norms and layer scalars) with enable_moe_block: each layer runs
its dense GeGLU MLP and, beside it, 4 GeGLU experts of width 24 (2 per token) routed by Gemma 4's router. The
router's scale and per-expert scale are random (transformers' ones would hide a misread one) and its projection
is ten times transformers' initialisation, so the router's logits are of order one and no top-2 choice is a
near tie that float rounding could flip between torch and XLA.

It needs torch, which the project does not depend on, so run it in a separate environment:

    python -m venv /tmp/torchenv
    /tmp/torchenv/bin/pip install torch==2.14.1 transformers==5.25.0 safetensors numpy
    /tmp/torchenv/bin/python tools/make_gemma4_moe_reference.py

The shared half (seed, save, reference.json) is tools/tiny_fixture.py.
"""

from __future__ import annotations

import torch
import tiny_fixture
from make_gemma4_reference import CONFIG as DENSE
from make_gemma4_reference import GREEDY_PROMPT, GREEDY_TOKENS, LENGTHS, SEED
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

CONFIG = {**DENSE, "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 24}


def build():
  config = Gemma4TextConfig(**CONFIG)
  config._attn_implementation = "eager"
  config._experts_implementation = "eager"
  model = Gemma4ForCausalLM(config).eval().float()
  with torch.no_grad():   # random norm weights, router scales and layer scalars: a misread one must show
    for name, p in model.named_parameters():
      if "norm" in name or name.endswith("router.scale"):
        p.copy_(1.0 + 0.3 * torch.randn_like(p))
      elif name.endswith("per_expert_scale"):
        p.copy_(0.5 + torch.rand_like(p))
      elif name.endswith("router.proj.weight"):
        p.mul_(10.0)
    for layer in model.model.layers:
      layer.layer_scalar.copy_(0.5 + torch.rand_like(layer.layer_scalar))
  return model


if __name__ == "__main__":
  tiny_fixture.main(__doc__, "gemma4_moe_tiny", build, CONFIG, seed=SEED, lengths=LENGTHS,
                    greedy_prompt=GREEDY_PROMPT, greedy_tokens=GREEDY_TOKENS)
