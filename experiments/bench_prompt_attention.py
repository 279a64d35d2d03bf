"""Benchmark: a prompt's own causal attention, our kernel against cuDNN (branch_replay_jax/benchmarks/prompt_attention.py).

  python -m branch_replay_jax.benchmarks.prompt_attention --config=experiments/bench_prompt_attention.py          # GPU
  python -m branch_replay_jax.benchmarks.prompt_attention --config=experiments/bench_prompt_attention.py:smoke    # CPU, seconds
"""

import ml_collections


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.prompt_lens = "32768"              # prompt lengths P, comma-separated (causal self-attention of one block)
  c.repeats = 5                        # timed calls after one warm-up call; the median is reported
  c.batch = 1                          # batch size B
  c.heads = "32:8"                     # Hq:Hkv (P15's attention table used the same)
  c.head_dim = 128                     # D
  c.dtype = "bfloat16"                 # inputs' dtype (cuDNN's flash attention takes bf16 / fp16)
  # pallas, reference, dpa_xla, dpa_cudnn; dpa_xla and the unrolled jnp reference are left out at 32k
  # (dpa_xla materialises [B, Hq, P, P] scores: 128 GiB in float32)
  c.impls = "pallas,dpa_cudnn"
  c.output = ""                        # also append the JSON lines to this file when set
  if arg == "smoke":
    c.prompt_lens = "64"
    c.repeats = 1
    c.heads = "4:2"
    c.head_dim = 16                    # the smallest head dim the Triton kernels take (interpreted on the CPU)
    c.impls = "pallas,reference,dpa_xla,dpa_cudnn"
  elif arg not in (None, ""):
    raise ValueError(f"experiments/bench_prompt_attention.py: unknown variant {arg!r}; use '' or 'smoke'")
  return c
