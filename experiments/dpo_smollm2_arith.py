"""DPO (or IPO) with two-pass branch replay on SmolLM2-135M-Instruct.

Default: preference pairs built on the fly from reasoning-gym's basic_arithmetic (G completions
sampled per prompt and scored; the best-reward one is chosen, the worst rejected).

  python -m branch_replay_jax.main --config=experiments/dpo_smollm2_arith.py
  python -m branch_replay_jax.main --config=experiments/dpo_smollm2_arith.py:jsonl        # pairs from a file
  python -m branch_replay_jax.main --config=experiments/dpo_smollm2_arith.py:smoke        # tiny model, 2 steps
  python -m branch_replay_jax.main --config=experiments/dpo_smollm2_arith.py:jsonl_smoke  # the file, tiny model
"""

import os

import ml_collections

from experiments import grpo_smollm2_arith

VARIANTS = ("", "jsonl", "smoke", "jsonl_smoke")


def get_config(arg=None):
  arg = arg or ""
  if arg not in VARIANTS:
    raise ValueError(f"experiments/dpo_smollm2_arith.py: unknown variant {arg!r}; use one of {VARIANTS}")
  c = ml_collections.ConfigDict()
  c.algorithm = "dpo"                     # main.py runs branch_replay_jax.algorithms.dpo.train
  c.model = ml_collections.ConfigDict()
  c.model.name = "smollm2-135m-instruct"  # models.load name or path; "tiny" = random 2-layer model (smoke tests)
  c.model.dtype = "float32"               # compute dtype: float32 or bfloat16
  c.model.param_dtype = "float32"         # float32, or bfloat16 (steps see bfloat16 parameters; float32 master)
  c.model.remat = "none"                  # rematerialisation: none, full (keep layer inputs), save_kv (inputs + K/V)
  #                                       # or offload_kv (save_kv with the saved arrays in host memory)
  c.model.attention_impl = "auto"         # suffix attention: xla (jnp reference), pallas, splash, auto (pallas on GPU, splash on TPU)
  c.model.expert_matmul = "ragged_dot"    # a mixture of experts' grouped matmuls: ragged_dot, tiled (kernels.grouped_matmul) or pallas
  c.model.gated_delta_scan = "xla"        # linear-attention layers' chunk scan (Qwen3.5): xla or pallas

  jsonl, smoke = "jsonl" in arg, "smoke" in arg
  c.data = ml_collections.ConfigDict()
  c.data.source = "jsonl" if jsonl else "task"   # task (pairs sampled and scored on the fly) or jsonl (a file)
  if jsonl:
    c.data.path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "arith_pairs.jsonl")
    #                                     # JSON lines {"prompt", "chosen", "rejected"}
    c.data.pairs_per_step = 4             # pairs per optimizer step (wraps around the file)
  else:
    c.task = ml_collections.ConfigDict()
    c.task.name = "basic_arithmetic"      # a name in branch_replay_jax.rollout.tasks.TASKS
    c.task.size = 64 if smoke else 100_000   # problems in the generated dataset (the data position wraps around)
    c.task.seed = 0                       # reasoning-gym generator seed
    c.task.options = ml_collections.ConfigDict()  # generator options overriding the task's defaults
    c.task.format_bonus = 0.1             # reward added when the answer is inside <answer></answer> tags
    c.task.strict_answer = False          # True: only a closed <answer></answer> tag counts; False: also an
    #                                     # unclosed tag or the last number (rollout/tasks, "Answer extraction")
    c.task.few_shot = 0                   # solved examples shown before each question (chat turns; the same
    c.task.few_shot_seed = 2_000_000      # in training and evaluation), drawn from this generator seed
    grpo_smollm2_arith.add_task_fields(c.task)   # data source, prompt and reward fields
    c.rollout = ml_collections.ConfigDict()  # sampling of the candidates
    c.rollout.prompts_per_step = 2 if smoke else 4   # prompts per step; each gives at most one pair
    c.rollout.group_size = 4 if smoke else 8         # G completions sampled per prompt (one shared prefill)
    c.rollout.max_new_tokens = 8 if smoke else 32    # tokens generated per completion at most
    c.rollout.temperature = 1.0           # sampling temperature
    c.rollout.top_p = 1.0                 # nucleus mass (1 disables the filter)
    c.rollout.stop_strings = ()           # text that ends a completion besides the model's stop ids, matched on the
    #                                     # decoded text as tokens arrive, e.g. ("</answer>",)

  c.dpo = ml_collections.ConfigDict()
  c.dpo.loss = "sigmoid"                  # sigmoid (DPO, arXiv 2305.18290 eq. 7); ipo (arXiv 2310.12036 eq. 17 on
  #                                       # mean per-token log-probs, the default IPO form: its target margin
  #                                       # 1/(2 beta) does not depend on completion lengths); ipo_sum (eq. 17 on sums)
  c.dpo.beta = 0.1                        # DPO beta (IPO: tau)
  c.dpo.label_smoothing = 0.0             # conservative DPO's epsilon in [0, 0.5) (sigmoid only; 0 = plain DPO)

  c.train = ml_collections.ConfigDict()
  c.train.steps = 20                      # optimizer steps
  c.train.learning_rate = 1e-6            # peak AdamW learning rate
  c.train.lr_schedule = "constant"        # constant or cosine (decay to 10% over the run, after warmup)
  c.train.warmup_steps = 0                # linear warmup steps
  c.train.weight_decay = 0.0              # AdamW decoupled weight decay
  c.train.max_grad_norm = 1.0             # global-norm gradient clipping
  c.train.gradient = "replay"             # replay (two-pass, prompt once) or naive (prompt repeated per sequence)
  c.train.max_staleness = 0               # k > 0: step t's pairs sampled by the policy of step t - k, ahead of the update
  c.train.micro_batch = 2                 # replay: completions per scan step; naive: PAIRS per scan step. At most:
  #                                       # each group's completions and the step's pairs vary, and each uses the
  #                                       # largest divisor of its count not above it

  c.mesh = ml_collections.ConfigDict()    # device mesh of the update (distributed/mesh.py); 1 x 1 x 1 = one device
  c.mesh.data = 1                         # the step's groups (one per distinct prompt) split over devices
  c.mesh.branch = 1                       # each group's completions split over devices
  c.mesh.seq = 1                          # each prompt's tokens split over devices (context parallelism)
  c.mesh.params = "replicated"            # replicated, or fsdp (parameters and optimizer state sharded at rest)
  c.mesh.expert = ""                      # a mixture of experts: the axis its experts are split over (data or branch)
  c.mesh.rollout_devices = 0              # a rollout sub-mesh samples for GRPO only
  #                                       # groups are padded to the mesh: padding completions have zero weight

  c.seed = 0                              # sampling and initialisation seed
  c.run_dir = "runs/dpo_smollm2_arith"    # metrics.jsonl, plots, checkpoints
  c.checkpoint_every = 5                  # steps between checkpoints (also saved at the end)
  c.resume = False                        # continue from the latest checkpoint in run_dir (a run_dir holding
  #                                       # a run is refused unless resume or overwrite is True)
  c.overwrite = False                     # True: delete everything in run_dir (checkpoints included) before a
  #                                       # fresh run; not with resume

  if jsonl:
    c.train.steps = 10
    c.run_dir = "runs/dpo_smollm2_jsonl"
  if smoke:
    c.model.name = "tiny"
    c.train.steps = 2
    c.train.learning_rate = 1e-5
    c.checkpoint_every = 1
    c.run_dir = "runs/dpo_jsonl_smoke" if jsonl else "runs/dpo_smoke"
  return c
