"""Our replay and naive GRPO steps side by side with PyTorch's naive step and PrefixGrouper (optional peer, not CI).

  pip install -e .[peer]        # torch, prefix-grouper
  python -m branch_replay_jax.benchmarks.peer --config=experiments/bench_peer.py
"""

import ml_collections


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.model = "smollm2-135m-instruct"   # the GGUF both frameworks load (or a .gguf path)
  c.dtype = "float32"
  c.attention_impl = "xla"            # our steps' attention (models.Llama)
  c.cases = ((512, 64, 16), (1024, 128, 8))   # (P, T, G)
  c.tree_cases = ()                   # must stay empty (read by parse_case)
  c.ppo_cases = ()                    # must stay empty (read by parse_case)
  c.remat = "none"
  c.modes = ("replay", "naive", "torch_naive", "prefix_grouper")   # run in this order every round
  c.rounds = 2
  c.repeats = 2                       # timed steps per worker after one warm-up (median)
  c.replay_micro_batch = 8            # ours: branches per replay scan step (rows of one batch)
  c.naive_micro_batch = 2             # ours: sequences per naive forward+backward
  c.torch_micro_batches = (1, 2, 4)   # PyTorch naive: candidates, each timed once in round 0, the fastest kept
  c.logprob_chunk = 128
  c.timing_lock = ""                  # read by our worker (bench_replay.py's meaning)
  c.seed = 0
  c.output = ""
  if arg == "smoke":
    c.cases = ((32, 8, 4),)
    c.rounds = 1
    c.repeats = 1
    c.torch_micro_batches = (2,)
    c.replay_micro_batch = 4
  elif arg not in (None, ""):
    raise ValueError(f"experiments/bench_peer.py: unknown variant {arg!r}; use '' or 'smoke'")
  return c
