"""Benchmark: compiled memory of a tree step per schedule (branch_replay_jax/benchmarks/tree_memory.py).

  python -m branch_replay_jax.benchmarks.tree_memory --config=experiments/bench_tree_memory.py         # SmolLM2-135M
  python -m branch_replay_jax.benchmarks.tree_memory --config=experiments/bench_tree_memory.py:smoke   # tiny
"""

import ml_collections


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.model = "smollm2-135m-instruct"         # models.load name, or tiny (random 2-layer model)
  c.dtype = "float32"                       # compute dtype
  c.prompt_len = 64                         # prompt tokens P
  c.segment_len = 16                        # tokens per response segment
  c.fanouts = "2,2:2,2,2:2,2,2,2:4,4"       # trees, ':'-separated; each the fan-outs per level
  c.modes = "naive_G,naive_1,depth_first,level"   # modes to compile (benchmarks/tree_memory.py's docstring)
  if arg == "smoke":
    c.model = "tiny"
    c.fanouts = "2,2:4,4"
  elif arg not in (None, ""):
    raise ValueError(f"experiments/bench_tree_memory.py: unknown variant {arg!r}; use '' or 'smoke'")
  return c
