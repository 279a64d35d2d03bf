"""Benchmark: bytes of a GRPO step with LoRA adapters against full fine-tuning, 135M-8B shapes, compile only.

  python -m branch_replay_jax.benchmarks.lora_memory --config=experiments/bench_lora_memory.py
  python -m branch_replay_jax.benchmarks.lora_memory --config=experiments/bench_lora_memory.py:smoke
"""

import ml_collections


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.models = "smollm2-135m,llama-3.2-1b,qwen2.5-1.5b,llama-3.1-8b"  # models.config.ARCHITECTURE_SHAPES names, or "tiny"
  c.rank = 16                         # LoRA rank r
  c.alpha = 32.0                      # LoRA alpha (the adapters' output is scaled by alpha / r)
  c.targets = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")   # adapted projections (models.lora.TARGETS)
  c.base_dtypes = "float32,bfloat16"  # dtypes the frozen base is held in (model.param_dtype), one LoRA row each
  c.dtype = "bfloat16"                # compute dtype; trained parameters and AdamW state are float32
  c.remat = "save_kv"                 # remat policy of the layer scan (models.llama.REMAT_POLICIES)
  c.G = 8                             # completions per group
  c.P = 512                           # prompt tokens
  c.T = 256                           # completion tokens
  c.micro_batch = 1                   # completions per scan step
  c.logprob_chunk = 256               # positions per log-prob chunk
  if arg == "smoke":
    c.models, c.rank, c.G, c.P, c.T, c.logprob_chunk = "tiny", 4, 4, 32, 8, 8
  elif arg not in (None, ""):
    raise ValueError(f"experiments/bench_lora_memory.py: unknown variant {arg!r}; use '' or 'smoke'")
  return c
