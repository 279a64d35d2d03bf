"""XLA CPU backend options, side by side: the replay and naive GRPO steps under each XLA_FLAGS variant.

  python -m branch_replay_jax.benchmarks.backend --config=experiments/bench_backend.py          # SmolLM2-135M
  python -m branch_replay_jax.benchmarks.backend --config=experiments/bench_backend.py:smoke    # tiny, seconds
"""

import ml_collections

# (name, XLA_FLAGS appended to the environment's): the first is the reference of the ratios and the
# gradients. A variant measuring XLA's own default names each flag that branch_replay_jax sets by
# default (branch_replay_jax.CPU_XLA_FLAGS) with XLA's value, so the package default does not apply.
VARIANTS = (
    ("xla_default", "--xla_cpu_experimental_ynn_fusion_type=individual_dot --xla_cpu_enable_fast_min_max=false"),
    ("eigen_dots", "--xla_cpu_experimental_ynn_fusion_type= --xla_cpu_enable_fast_min_max=false"),
    ("ynn_all", "--xla_cpu_experimental_ynn_fusion_type=individual_dot,dot,eltwise,reduce "
                "--xla_cpu_enable_fast_min_max=false"),
    ("fast_min_max", "--xla_cpu_experimental_ynn_fusion_type=individual_dot --xla_cpu_enable_fast_min_max=true"),
    ("onednn", "--xla_cpu_experimental_ynn_fusion_type= --xla_cpu_use_onednn=true "
               "--xla_cpu_experimental_onednn_custom_call=true --xla_cpu_enable_fast_min_max=false"),
)


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.model = "smollm2-135m-instruct"   # as in bench_replay.py: a name or path for models.load, "tiny" or "random:NAME"
  c.dtype = "float32"
  c.attention_impl = "xla"
  c.cases = ((512, 64, 16),)          # (P, T, G[, remat])
  c.tree_cases = ()                   # must stay empty (read by parse_case)
  c.ppo_cases = ()                    # must stay empty (read by parse_case)
  c.remat = "none"
  c.variants = VARIANTS
  c.modes = ("replay", "naive")
  c.rounds = 2                        # each round runs every variant and mode once, in order
  c.repeats = 2                       # timed runs per worker after its warm-up (median)
  c.naive_micro_batch = 2
  c.replay_micro_batch = 1
  c.logprob_chunk = 128
  c.timing_lock = ""                  # read by the worker (bench_replay.py's meaning)
  c.seed = 0
  c.output = ""
  if arg == "smoke":
    c.model = "tiny"
    c.cases = ((24, 6, 4),)
    c.variants = VARIANTS[:2]
    c.rounds = 1
    c.repeats = 1
  elif arg not in (None, ""):
    raise ValueError(f"experiments/bench_backend.py: unknown variant {arg!r}; use '' or 'smoke'")
  return c
