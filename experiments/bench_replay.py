"""Benchmark: one GRPO gradient step on a prompt group, naive versus branch replay.

  python -m branch_replay_jax.benchmarks.replay --config=experiments/bench_replay.py          # SmolLM2-135M
  python -m branch_replay_jax.benchmarks.replay --config=experiments/bench_replay.py:smoke    # tiny, seconds
"""

import ml_collections


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  # a name or path for models.load, "tiny" (random 2-layer model) or "random:NAME" (an architecture of
  # models.config.ARCHITECTURE_SHAPES with random weights, e.g. "random:smollm2-135m")
  c.model = "smollm2-135m-instruct"
  c.dtype = "float32"                 # compute dtype: float32 or bfloat16
  c.attention_impl = "xla"            # suffix attention of both steps: xla, pallas, splash or auto (models.Llama)
  c.timing_lock = ""                  # file locked around each worker's timed runs (workers sharing one device)
  # (P prompt tokens, T completion tokens, G[, remat]): at P = 2048 neither mode fits 24 GiB without remat
  c.cases = ((1024, 128, 8), (2048, 128, 8, "save_kv"), (512, 64, 16))
  c.repeats = 3                       # timed runs after the compile; the median is reported
  c.naive_micro_batches = "1,2,G"     # candidates for the naive step's micro-batch; the fastest is reported
  # (P, segment tokens, fan-outs per level[, remat]): full trees. The level schedule holds a whole
  # level's residuals: at P = 1024 with [4,2,2] and remat none the replay step was killed for memory.
  c.tree_cases = ((1024, 64, "4,2,2", "save_kv"), (256, 32, "2,2,2,2"))
  c.replay_micro_batches = "4,G"      # candidates for branches per replay scan step; the fastest is reported
  c.tree_replay_micro_batches = "1,2"  # candidates for leaf siblings vmapped per scan step (tree replay)
  c.ppo_cases = ((512, 64, 8),)       # (P, T, G): PPO step, policy + critic (gradients/step.py, ActorCritic head), naive vs replay
  c.ppo_critic = "value_head"         # critic of the PPO cases: value_head or separate (models/critic.py)
  c.tree_schedule = "level"           # tree replay schedule: level (batched levels, fastest) or depth_first (least memory)
  c.remat = "none"                    # rematerialisation of both modes unless a case names one: none, full, save_kv
  c.logprob_chunk = 128               # positions per log-prob chunk (no [T, V] logits in either mode)
  c.fused = "auto"                    # replay: auto (value_and_grad's default: fused wherever it applies), on, off (replay_vjp)
  c.prompt_attention = "model"        # replay's blocks with no ancestors (the prompt): model (attention_impl), xla or
                                      # cudnn (jax.nn.dot_product_attention, causal; benchmarks/prompt_attention.py)
  # The card's peak for MFU, TFLOP/s: NVIDIA H200 SXM, BF16 Tensor Core 1,979 TFLOPS "with sparsity"
  # (NVIDIA H200 Tensor Core GPU datasheet, nvidia.com/en-us/data-center/h200), so 989 dense.
  c.peak_tflops = 989.0
  c.seed = 0                          # token ids, old/ref log-probs and rewards are drawn from it
  c.output = ""                       # also append the JSON lines to this file when set
  if arg == "smoke":
    c.model = "tiny"
    c.cases = ((24, 6, 4),)
    c.tree_cases = ((16, 4, "2,2"),)
    c.ppo_cases = ((24, 6, 4),)
    c.repeats = 2
    c.naive_micro_batches = "1,G"   # one fresh process per candidate: keep the smoke run short
    c.replay_micro_batches = "1"
    c.tree_replay_micro_batches = "1"
  elif arg not in (None, ""):
    raise ValueError(f"experiments/bench_replay.py: unknown variant {arg!r}; use '' or 'smoke'")
  return c
