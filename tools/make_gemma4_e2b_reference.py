"""Write tests/fixtures/gemma4_e2b_tiny/: a tiny random Gemma 4 text decoder with the E2B/E4B layout (per-layer
embeddings, K/V shared across the last layers, their MLP double-wide) saved by transformers (config.json +
model.safetensors) and reference.json, its outputs from transformers + torch.

The fixture is the independent reference for our Gemma 4 small-model layers (models/gemma4.py,
tests/test_gemma4_e2b.py). It is make_gemma4_reference.py's configuration (both layer shapes, k_eq_v, the window of
4, proportional RoPE, the cap, random norms and layer scalars) with nine layers (sliding, sliding, global three
times), per-layer embeddings of width 8, the last three layers reading the K/V of layers 5 (global) and 4
(sliding), and those three layers' MLP 2 x 40 wide. Every norm is random, the per-layer embeddings' included.

It needs torch, which the project does not depend on, so run it in a separate environment:

    python -m venv /tmp/torchenv
    /tmp/torchenv/bin/pip install torch==2.14.1 transformers==5.25.0 safetensors numpy
    /tmp/torchenv/bin/python tools/make_gemma4_e2b_reference.py

The shared half (seed, save, reference.json) is tools/tiny_fixture.py.
"""

from __future__ import annotations

import tiny_fixture
from make_gemma4_reference import CONFIG as DENSE
from make_gemma4_reference import FULL, GREEDY_PROMPT, GREEDY_TOKENS, LENGTHS, SLIDING, build

CONFIG = {**DENSE, "num_hidden_layers": 9, "layer_types": [SLIDING, SLIDING, FULL] * 3, "intermediate_size": 40,
          "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": DENSE["vocab_size"],
          "num_kv_shared_layers": 3, "use_double_wide_mlp": True}


if __name__ == "__main__":
  tiny_fixture.main(__doc__, "gemma4_e2b_tiny", lambda: build(CONFIG), CONFIG, seed=1, lengths=LENGTHS,
                    greedy_prompt=GREEDY_PROMPT, greedy_tokens=GREEDY_TOKENS)
