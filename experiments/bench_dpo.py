"""Benchmark: one DPO gradient step, naive versus two-pass replay (branch_replay_jax/benchmarks/dpo.py).

  python -m branch_replay_jax.benchmarks.dpo --config=experiments/bench_dpo.py          # SmolLM2-135M, P=512, T=128
  python -m branch_replay_jax.benchmarks.dpo --config=experiments/bench_dpo.py:smoke    # tiny, seconds
"""

import ml_collections


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.model = "smollm2-135m-instruct"         # models.load name/path, or tiny (random 2 layers)
  c.prompt = 512                            # prompt tokens P
  c.completion = 128                        # tokens of each of the two completions T
  c.repeats = 3                             # timed runs after the compile; the median is reported
  c.replay_micro_batch = 2                  # completions vmapped per replay scan step
  c.loss = "sigmoid"                        # sigmoid (DPO) or ipo
  c.logprob_chunk = 128                     # positions per log-prob chunk (both modes)
  c.remat = "none"                          # rematerialisation policy (both modes): none, full, save_kv
  if arg == "smoke":
    c.model = "tiny"
    c.prompt = 24
    c.completion = 6
    c.repeats = 2
  elif arg not in (None, ""):
    raise ValueError(f"experiments/bench_dpo.py: unknown variant {arg!r}; use '' or 'smoke'")
  return c
