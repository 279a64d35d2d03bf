"""Benchmark: the chunked gated delta rule's chunk scan, jax.lax.scan against the Pallas kernels
(branch_replay_jax/benchmarks/gated_delta.py).

  python -m branch_replay_jax.benchmarks.gated_delta --config=experiments/bench_gated_delta.py          # GPU
  python -m branch_replay_jax.benchmarks.gated_delta --config=experiments/bench_gated_delta.py:smoke    # CPU, seconds
"""

import ml_collections


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.seq_lens = "8192,32768"            # tokens T per row, comma-separated
  c.batch = 1                          # rows B
  c.heads = 32                         # value heads H (Qwen3.5-9B's 32 linear value heads)
  c.key_dim = 128                      # Dk
  c.value_dim = 128                    # Dv
  c.chunk = 64                         # tokens per chunk (transformers' chunk_size)
  c.repeats = 5                        # timed calls after one warm-up call; the median is reported
  c.impls = "xla,pallas"               # xla: jax.lax.scan over the chunks; pallas: kernels.gated_delta_pallas
  c.output = ""                        # also append the JSON lines to this file when set
  if arg == "smoke":
    c.seq_lens = "40"
    c.heads = 2
    c.key_dim = 16
    c.value_dim = 16
    c.chunk = 16
    c.repeats = 1
  elif arg not in (None, ""):
    raise ValueError(f"experiments/bench_gated_delta.py: unknown variant {arg!r}; use '' or 'smoke'")
  return c
