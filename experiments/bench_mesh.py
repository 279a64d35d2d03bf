"""Benchmark: seconds per mesh step per algorithm and data x branch x seq mesh (branch_replay_jax/benchmarks/mesh.py).

  python -m branch_replay_jax.benchmarks.mesh --config=experiments/bench_mesh.py      # 8 fake CPU devices
  python -m branch_replay_jax.benchmarks.mesh --config=experiments/bench_mesh.py:smoke   # 1x1x1 vs one device, seconds
"""

import ml_collections


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.model = "tiny"                          # tiny or random-smollm2-shape (random weights, SmolLM2-135M's shape)
  c.algorithms = "grpo,ppo,dpo"             # whose step to time, comma-separated: grpo, ppo (policy + value head), dpo
  c.meshes = "1x1x1,8x1x1,1x8x1,1x1x8,2x2x2,4x2x1"   # data x branch x seq shapes, comma-separated
  c.groups = 8                              # rollout groups per step
  c.group_size = 8                          # G completions per group
  c.prompt_len = 64                         # prompt tokens; a multiple of every seq size
  c.completion_len = 16                     # tokens per completion
  c.micro_batch = 1                         # completions per scan step on each device
  c.repeats = 3                             # timed steps after the compiling one; the median is reported
  c.dtype = "float32"                       # compute dtype: float32 or bfloat16 (parameters stay float32)
  c.remat = "none"                          # none, full, save_kv (models.Llama)
  c.attention_impl = "xla"                  # xla or pallas (the Triton kernels inside the step's shard_map on a GPU)
  c.one_device = False                      # also the one-device step (no mesh), the rows' baseline (grpo, ppo)
  c.output = ""                             # also append the JSON lines to this file when set
  if arg == "smoke":   # the mesh code path on one device against the one-device step, tiny, seconds
    c.algorithms = "grpo"
    c.meshes = "1x1x1"
    c.groups = 1
    c.group_size = 4
    c.prompt_len = 16
    c.completion_len = 8
    c.micro_batch = 4
    c.repeats = 1
    c.one_device = True
  elif arg not in (None, ""):
    raise ValueError(f"experiments/bench_mesh.py: unknown variant {arg!r}; use '' or 'smoke'")
  return c
