"""Profile: where one GRPO gradient step's time goes (jax.profiler trace, summed by part), replay and naive.

  python -m branch_replay_jax.benchmarks.profile --config=experiments/bench_profile.py          # SmolLM2-135M
  python -m branch_replay_jax.benchmarks.profile --config=experiments/bench_profile.py:smoke    # tiny, seconds
"""

import ml_collections


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.model = "smollm2-135m-instruct"   # as in bench_replay.py: a name or path for models.load, "tiny" or "random:NAME"
  c.dtype = "float32"                 # compute dtype
  c.attention_impl = "xla"            # suffix attention of both steps (models.Llama)
  c.cases = ((512, 64, 16), (1024, 128, 8))   # (P prompt tokens, T completion tokens, G[, remat])
  c.tree_cases = ()                   # must stay empty: the profile covers prompt groups (read by parse_case)
  c.ppo_cases = ()                    # must stay empty (read by parse_case)
  c.remat = "none"                    # remat of both modes unless a case names one
  c.modes = ("replay", "naive")       # steps profiled, in this order, per case
  c.replay_micro_batch = 8            # branches per replay scan step (rows of one batch); must divide G
  c.naive_micro_batch = 2             # sequences per naive forward+backward
  c.logprob_chunk = 128               # positions per log-prob chunk
  c.repeats = 2                       # timed runs before the traced one (median reported)
  c.top = 15                          # instructions listed by time in each record
  c.trace_dir = "/tmp/branch_replay_profile"   # Perfetto traces land here, one folder per (case, mode)
  c.seed = 0
  c.output = ""                       # also append the JSON lines to this file when set
  if arg == "smoke":
    c.model = "tiny"
    c.cases = ((24, 6, 4),)
    c.repeats = 1
    c.top = 5
    c.replay_micro_batch = 4
  elif arg not in (None, ""):
    raise ValueError(f"experiments/bench_profile.py: unknown variant {arg!r}; use '' or 'smoke'")
  return c
