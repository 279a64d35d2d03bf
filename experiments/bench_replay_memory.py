"""Benchmark: compile-only memory of one GRPO group's gradient on one device, naive vs replay vs fused replay.

  python -m branch_replay_jax.benchmarks.replay_memory --config=experiments/bench_replay_memory.py
  python -m branch_replay_jax.benchmarks.replay_memory --config=experiments/bench_replay_memory.py:smoke   # tiny model
"""

import ml_collections


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.models = "smollm2-135m,llama-3.2-1b"   # models.config.ARCHITECTURE_SHAPES names (or "tiny"), comma-separated
  c.prompts = (8192, 32768, 131072)        # prompt lengths P; the two largest fit the linear growth
  c.G = 8                                  # completions per group
  c.T = 128                                # tokens per completion
  c.modes = "naive:1,replay:1,replay:8,fused"  # naive:M, replay:M (M per scan step, dividing G), fused
  c.remat = "save_kv"                      # models.llama.REMAT_POLICIES
  c.dtype = "bfloat16"                     # compute dtype
  c.param_dtype = "bfloat16"               # parameter (and gradient) dtype
  c.attention_impl = "xla"                 # the jnp attention (tiled for long prompts), as on the CPU
  c.logprob_chunk = 128                    # positions per log-prob chunk
  c.budgets_gib = (96, 141)                # device memory budgets for the extrapolated largest P
  c.seed = 0
  c.output = ""                            # also append the JSON lines to this file when set
  if arg == "smoke":
    c.models, c.prompts, c.G, c.T, c.modes = "tiny", (256, 512), 4, 16, "naive:1,replay:4,fused"
  elif arg not in (None, ""):
    raise ValueError(f"experiments/bench_replay_memory.py: unknown variant {arg!r}; use '' or 'smoke'")
  return c
