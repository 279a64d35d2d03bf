"""Benchmark: per-device bytes of the sharded replay step for 1B-8B shapes, compile only.

  python -m branch_replay_jax.benchmarks.sharded_memory --config=experiments/bench_sharded_memory.py
  python -m branch_replay_jax.benchmarks.sharded_memory --config=experiments/bench_sharded_memory.py:smoke
"""

import ml_collections


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.models = "llama-3.2-1b,qwen2.5-1.5b,llama-3.1-8b"  # models.config.ARCHITECTURE_SHAPES names, or "tiny"
  c.layouts = "replicated,fsdp"       # parameter layouts (distributed.mesh.PARAM_MODES)
  c.remats = "save_kv"                # remat policies of the layer scan (models.llama.REMAT_POLICIES)
  c.dtype = "bfloat16"                # compute dtype; parameters and AdamW state are float32
  c.attention_impl = "xla"            # xla (dense [P, P] scores) or pallas (FlashAttention-2 blocks, interpreted on CPU)
  c.expert_matmul = "ragged_dot"      # a mixture of experts' grouped matmuls (models.config.EXPERT_MATMULS): ragged_dot
  #                                   # (dense over every expert on XLA:CPU) or tiled (kernels.grouped_matmul)
  c.expert = ""                       # a mixture of experts' expert-parallel axis (mesh.expert): "", data or branch
  c.lora_rank = 0                     # > 0: train LoRA adapters of this rank (every target) on a frozen base
  c.base_dtype = "bfloat16"           # the frozen base's dtype with lora_rank > 0 (model.param_dtype)
  c.mesh = (1, 8, 1)                  # data, branch, seq over 8 fake CPU devices: one group, G over 8
  c.G = 16                            # completions per group
  c.T = 1024                          # completion tokens
  c.prompt_lengths = (8192, 32768, 131072)  # P compiled for the table
  c.micro_batch = 1                   # completions per scan step on each device
  c.logprob_chunk = 256               # positions per log-prob chunk
  c.search_remats = "save_kv"         # remat policies whose largest P under each budget is bisected ("" for none)
  c.search_layouts = "fsdp"           # parameter layouts searched likewise
  c.budgets_gib = (96, 141)           # per-device memory: H20, H200
  c.search_min_p = 1024
  c.search_max_p = 65536
  c.granularity = 4096                # bisection stops at this many prompt tokens
  c.naive = True                      # also the naive step on one device (prompt repeated)
  if arg == "smoke":
    c.models, c.remats, c.G, c.T, c.prompt_lengths = "tiny", "save_kv", 8, 16, (64,)
    c.search_min_p, c.search_max_p, c.granularity, c.budgets_gib = 64, 512, 64, (0.001,)
  elif arg not in (None, ""):
    raise ValueError(f"experiments/bench_sharded_memory.py: unknown variant {arg!r}; use '' or 'smoke'")
  return c
