"""Text-decoder parameters of Gemma 4 E2B / E4B by `nnx.eval_shape` (no weights), split into the per-layer
embedding tables and the rest ("effective", the model card's term). Run from the repository root:

    python docs/results/gemma4-small-cpu/count_parameters.py
"""

import jax
import numpy as np
from flax import nnx

from branch_replay_jax.models.config import architecture_shape
from branch_replay_jax.models.loading import decoder_class

for name in ("gemma-4-e2b", "gemma-4-e4b"):
  config = architecture_shape(name)
  model = nnx.eval_shape(lambda: decoder_class(config)(config, rngs=nnx.Rngs(0)))
  leaves = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  total = sum(int(np.prod(x.shape)) for _, x in leaves)
  tables = sum(int(np.prod(x.shape)) for path, x in leaves if "ple_table" in jax.tree_util.keystr(path))
  print(f"{name}: parameters {total / 1e9:.2f}B, per-layer tables {tables / 1e9:.2f}B, "
        f"the rest {(total - tables) / 1e9:.2f}B")
