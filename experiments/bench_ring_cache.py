"""Benchmark: the group sampler's whole decode cache against the sliding layers' ring
(branch_replay_jax/benchmarks/ring_cache.py).

  python -m branch_replay_jax.benchmarks.ring_cache --config=experiments/bench_ring_cache.py
  python -m branch_replay_jax.benchmarks.ring_cache --config=experiments/bench_ring_cache.py \
      --config.models=gemma-4-e2b --config.time_model=
"""

import ml_collections


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.models = ("gemma-4-e4b", "gemma-3-12b")   # architectures whose compiled memory is reported (compile only)
  # compute dtype of the memory cases. float32: on CPU, XLA writes a bfloat16 cache's new slot through float32
  # (dynamic-update-slice is not done in bfloat16 here), copying the whole cache k and v each step, so a
  # bfloat16 sampler's compiled temporaries there hold about three caches; a float32 cache is updated in place.
  c.dtype = "float32"
  c.samples = 16                              # G, samples of one prompt
  c.prompt = 1024                             # prompt tokens
  c.new_tokens = (2048, 8192, 32768)          # N, tokens decoded per sample
  # the timed case: a random model of time_model's layer kinds with time_shape's fields replaced ('' skips it)
  c.time_model = "gemma-4-e2b"
  c.time_shape = (("vocab_size", 4096), ("d_model", 256), ("num_layers", 10), ("ffn_dim", 512),
                  ("num_heads", 4), ("head_dim", 64), ("global_head_dim", 128), ("per_layer_input_dim", 32),
                  ("kv_shared_layers", 5), ("layer_types", ("sliding_attention",) * 4 + ("full_attention",)
                                           + ("sliding_attention",) * 4 + ("full_attention",)),
                  ("sliding_window", 128))
  c.time_samples = 8
  c.time_prompt = 256
  c.time_new_tokens = 1024
  c.repeats = 3
  if arg == "smoke":   # the timed case only: a small Gemma 3, 2 samples of 12 tokens past a window of 4
    c.models, c.time_samples, c.time_prompt, c.time_new_tokens, c.repeats = (), 2, 16, 12, 1
    c.time_model = "gemma-3-12b"
    c.time_shape = (("vocab_size", 256), ("d_model", 64), ("num_layers", 6), ("ffn_dim", 128), ("num_heads", 2),
                    ("num_kv_heads", 1), ("head_dim", 32), ("query_pre_attn_scalar", 32.0), ("sliding_window", 4),
                    ("layer_types", ("sliding_attention",) * 5 + ("full_attention",)))
  elif arg not in (None, ""):
    raise ValueError(f"experiments/bench_ring_cache.py: unknown variant {arg!r}; use '' or 'smoke'")
  return c
