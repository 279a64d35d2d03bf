"""Benchmark: agent-shaped episodes, replay over the episode tree (nested, and packed into one row)
versus the naive flat rows and prompt-only sharing, and the sampler with and without the KV cache kept
across turns
(branch_replay_jax/benchmarks/episodes.py).

  python -m branch_replay_jax.benchmarks.episodes --config=experiments/bench_episodes.py          # SmolLM2-135M shapes
  python -m branch_replay_jax.benchmarks.episodes --config=experiments/bench_episodes.py:smoke    # tiny, seconds
"""

import ml_collections


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  # "tiny" (random 2-layer model), "random:NAME" (an architecture of models.config.ARCHITECTURE_SHAPES with
  # random weights) or a name or path for models.load
  c.model = "random:smollm2-135m"
  c.dtype = "float32"                 # compute dtype: float32 or bfloat16
  c.attention_impl = "xla"            # suffix attention (models.Llama)
  c.remat = "none"                    # rematerialisation of every mode: none, full, save_kv
  # (P prompt tokens, T tokens per model turn, O tokens per observation, fan-outs per turn): 3 turns,
  # G = 8 branching at the first turn; and the same G with a branch at every turn boundary.
  c.cases = ((256, 64, 256, "8,1,1"), (256, 64, 256, "2,2,2"))
  c.repeats = 3                       # timed steps after the compile and one warm-up; the median is reported
  c.naive_micro_batch = 0             # episodes per naive scan step; 0: all G
  c.tree_micro_batch = 0              # leaf siblings per tree-replay scan step; 0: all of them
  c.tree_schedule = "level"           # tree replay schedule: level or depth_first (core/tree_replay.py)
  c.logprob_chunk = 128               # positions per log-prob chunk
  c.sampler = True                    # also time the sampler per episode, KV cache kept vs re-prefilled
  c.temperature = 1.0                 # the sampler's temperature
  c.seed = 0                          # token ids, rewards and sampling keys are drawn from it
  c.output = ""                       # also append the JSON lines to this file when set
  if arg == "smoke":
    c.model = "tiny"
    c.cases = ((16, 4, 6, "2,2"),)   # one case: each mode's compile takes tens of seconds on loaded cores
    c.repeats = 2
  elif arg not in (None, ""):
    raise ValueError(f"experiments/bench_episodes.py: unknown variant {arg!r}; use '' or 'smoke'")
  return c
