"""Benchmark: memory of one GRPO replay step versus G, and the longest prompt one step fits.

  python -m branch_replay_jax.benchmarks.memory --config=experiments/bench_memory.py          # SmolLM2-135M, hours
  python -m branch_replay_jax.benchmarks.memory --config=experiments/bench_memory.py:smoke    # tiny model, minutes
  python -m branch_replay_jax.benchmarks.memory --config=experiments/bench_memory.py \\
      --config.studies=longest_context --config.policies=save_kv --config.longest_context.max_p=16384
  python -m branch_replay_jax.benchmarks.memory --config=experiments/bench_memory.py \\
      --config.studies=longest_context --config.longest_context.compile_only=True   # memory bound only
"""

import ml_collections


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.model = "smollm2-135m-instruct"   # a name or path for models.load, "tiny", or "random:NAME" (bench_replay.py)
  c.dtype = "float32"                 # compute dtype: float32 or bfloat16
  c.attention_impl = "xla"            # suffix attention: xla, pallas, splash or auto (models.Llama)
  c.studies = "memory_vs_g,longest_context"  # comma-separated: which studies to run, in this order
  c.policies = "none,full,save_kv,offload_kv"  # remat policies of the replay step (longest_context)
  c.naive_policies = "none,save_kv"   # remat policies of the naive step (longest_context)
  c.logprob_chunk = 128               # positions per log-prob chunk (no [T, V] logits in either mode)
  c.seed = 0                          # token ids and rewards are drawn from it
  c.attempt_timeout_s = 900.0         # wall seconds per attempt (load + compile + one step), then killed
  c.rss_limit_bytes = 0               # kill an attempt whose resident set exceeds this (0: the OS decides)
  c.output = ""                       # also append the JSON lines to this file when set
  c.memory_budget_bytes = 24 * 2**30  # compile-only attempts above this estimated peak fail with bound "memory"

  c.memory_vs_g = ml_collections.ConfigDict()
  c.memory_vs_g.P = 2048              # prompt tokens
  c.memory_vs_g.T = 128               # completion tokens per branch
  c.memory_vs_g.groups = (2, 4, 8, 16, 32)  # G values
  c.memory_vs_g.remat = "save_kv"     # remat policy of both steps ("none" needs ~20 GB of XLA temp at P=2048)
  c.memory_vs_g.replay_micro_batch = 1  # branches per replay scan step: 1 keeps peak memory flat in G
  c.memory_vs_g.naive_micro_batches = "1,2"  # naive candidates; the one with the lowest peak is reported
  c.memory_vs_g.naive = True          # measure naive alongside replay
  # Modes ("replay", "naive", comma-separated) whose attempts only compile and report the estimated
  # peak (resident set after compile + XLA temp + output bytes) instead of running the step.
  c.memory_vs_g.compile_only_modes = ""

  c.longest_context = ml_collections.ConfigDict()
  c.longest_context.G = 16            # completions per group
  c.longest_context.T = 256           # completion tokens per branch
  c.longest_context.start_p = 1024    # first P tried; doubled until an attempt fails
  c.longest_context.granularity = 256  # then bisected to this many tokens
  c.longest_context.max_p = 131072    # never try a larger P (the search reports stopped_by="max_p")
  c.longest_context.replay_micro_batch = 1
  c.longest_context.naive_micro_batches = "1,2"  # tried in this order until one completes
  # Compile only: each attempt compiles the step and compares XLA's buffer sizes plus the resident
  # set after compile (`estimated_peak_bytes`) with memory_budget_bytes; nothing runs. The memory
  # bound alone, in minutes, where running each step would hit the time bound first.
  c.longest_context.compile_only = False
  if arg == "smoke":
    c.model = "tiny"
    c.policies = "offload_kv"
    c.naive_policies = "none"
    c.attempt_timeout_s = 300.0
    c.memory_vs_g.P, c.memory_vs_g.T, c.memory_vs_g.groups = 64, 8, (2, 8)
    c.memory_vs_g.naive_micro_batches = "1"
    c.longest_context.G, c.longest_context.T = 4, 8
    c.longest_context.start_p, c.longest_context.granularity, c.longest_context.max_p = 64, 32, 128
  elif arg not in (None, ""):
    raise ValueError(f"experiments/bench_memory.py: unknown variant {arg!r}; use '' or 'smoke'")
  return c
