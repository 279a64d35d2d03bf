"""bfloat16 logits of the tiny fixtures run eagerly and under `nnx.jit`, each against the float32 model, and the
E2B fixture's eager forward with only the per-layer inputs' projection jitted. Run from the repository root:

    python docs/results/gemma4-small-cpu/bf16_eager_jit.py
"""

import jax.numpy as jnp
from flax import nnx

from branch_replay_jax.models import gemma4
from branch_replay_jax.models.loading import load_hf_model

FIXTURES = ("tests/fixtures/gemma4_e2b_tiny", "tests/fixtures/gemma4_tiny", "tests/fixtures/gemma3_tiny")
logits = lambda model, ids: model.logits(model(ids, 0).hidden_btd)
gap = lambda a, b: float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max())

for fixture in FIXTURES:
  model, model32 = load_hf_model(fixture, dtype=jnp.bfloat16), load_hf_model(fixture)
  ids = (jnp.arange(3, 40)[None] * 7) % model.config.vocab_size
  eager, jitted, exact = logits(model, ids), nnx.jit(logits)(model, ids), logits(model32, ids)
  print(f"{fixture}: eager-jit {gap(eager, jitted):.4f}  eager-float32 {gap(eager, exact):.4f}  "
        f"jit-float32 {gap(jitted, exact):.4f}")

model = load_hf_model(FIXTURES[0], dtype=jnp.bfloat16)
ids = (jnp.arange(3, 40)[None] * 7) % model.config.vocab_size
jitted = nnx.jit(logits)(model, ids)
gemma4.Gemma4._per_layer_inputs = nnx.jit(gemma4.Gemma4._per_layer_inputs)
print(f"E2B eager, per-layer projection jitted, against jit: {gap(logits(model, ids), jitted):.4f}")
