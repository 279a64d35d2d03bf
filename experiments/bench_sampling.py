"""Benchmark: sampler throughput, greedy G=1 and sampled G=8 (branch_replay_jax/benchmarks/sampling.py).

  python -m branch_replay_jax.benchmarks.sampling --config=experiments/bench_sampling.py
  python -m branch_replay_jax.benchmarks.sampling --config=experiments/bench_sampling.py --config.model=smollm2-135m-instruct
"""

import ml_collections


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.model = "random-smollm2-shape"          # random-smollm2-shape (random weights) or smollm2-135m-instruct
  c.dtype = "float32"                       # float32 or bfloat16
  c.prompt_len = 60                         # prompt tokens
  c.new_tokens = 64                         # tokens generated per sample
  c.repeats = 3                             # timed calls after the compiling one
  c.top_p = 1.0                             # nucleus mass of the sampling case
  if arg not in (None, ""):
    raise ValueError(f"experiments/bench_sampling.py: unknown variant {arg!r}; use ''")
  return c
