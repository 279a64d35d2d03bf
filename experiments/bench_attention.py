"""Benchmark: suffix attention kernels, forward and forward+backward (branch_replay_jax/benchmarks/attention.py).

  python -m branch_replay_jax.benchmarks.attention --config=experiments/bench_attention.py
  python -m branch_replay_jax.benchmarks.attention --config=experiments/bench_attention.py:smoke   # CPU, seconds
"""

import ml_collections


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.cases = "1024:128,8192:256,32768:512"   # S_anc:T pairs (ancestor keys : suffix queries), comma-separated
  c.repeats = 5                             # timed calls after one warm-up call; the median is reported
  c.batch = 1                               # batch size B
  c.heads = "32:8"                          # Hq:Hkv
  c.head_dim = 128                          # D
  c.dtype = "bfloat16"                      # inputs' dtype
  c.impls = ""                              # comma-separated subset of the implementations ("": all)
  c.output = ""                             # also append the JSON lines to this file when set
  if arg == "smoke":
    c.cases = "64:16"
    c.repeats = 1
    c.heads = "4:2"
    c.head_dim = 64
    c.impls = "reference,dpa_xla"
  elif arg not in (None, ""):
    raise ValueError(f"experiments/bench_attention.py: unknown variant {arg!r}; use '' or 'smoke'")
  return c
