"""GRPO with branch replay on SmolLM2-135M-Instruct and reasoning-gym's basic_arithmetic.

  python -m branch_replay_jax.main --config=experiments/grpo_smollm2_arith.py            # default, <10 min CPU
  python -m branch_replay_jax.main --config=experiments/grpo_smollm2_arith.py:long       # longer run
  python -m branch_replay_jax.main --config=experiments/grpo_smollm2_arith.py:smoke      # tiny model, 2 steps
  python -m branch_replay_jax.main --config=experiments/grpo_smollm2_arith.py:eval200    # default, 200 held-out problems
  python -m branch_replay_jax.main --config=experiments/grpo_smollm2_arith.py:learn      # learning experiment (README)
  python -m branch_replay_jax.main --config=experiments/grpo_smollm2_arith.py:lora       # LoRA adapters, base frozen
  python -m branch_replay_jax.main --config=experiments/grpo_smollm2_arith.py:lora_smoke # LoRA, tiny model, 2 steps
"""

import ml_collections

from branch_replay_jax.rollout.tasks.prompts import DEFAULT_INSTRUCTION, DEFAULT_TEMPLATE


def add_task_fields(task):
  """The task's source, prompt and reward fields at their defaults (rollout/tasks/sources.py; README,
  "Train on your own task"), so that each can be set from the command line."""
  placeholder = ml_collections.config_dict.placeholder
  task.source = placeholder(str)          # None: task.name; or "reasoning_gym:NAME", a .jsonl/.json/.parquet/.csv
  #                                       # file or save_to_disk directory, "python:module:name" (a task or factory)
  task.prompt_column = "prompt"           # file sources: the prompt's column (text, or a list of chat messages)
  task.answer_column = "answer"           # file sources: the reference answer's column ("" for none)
  task.messages_column = ""               # file sources: a column of chat messages used as the prompt ("" for none)
  task.eval_source = placeholder(str)     # file sources: the evaluation's file; None: the held-out split below
  task.eval_split = 0.0                   # file sources: fraction of the rows held out for eval (shuffled by task.seed)
  task.system_prompt = placeholder(str)   # None: no system message, so SmolLM2's template writes its default
  #                                       # "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
  task.instruction = DEFAULT_INSTRUCTION  # the answer instruction, {instruction} in the template
  task.prompt_template = DEFAULT_TEMPLATE  # the user turn: {question}, {instruction} and a file row's columns
  task.rewards = ()                       # reward functions "module:function" (TRL's batch signature) replacing the
  #                                       # task's reward, e.g. ("branch_replay_jax.rollout.tasks.rewards:math_verify",)
  task.reward_weights = ()                # a weight per function; (): all 1


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.algorithm = "grpo"                    # main.py runs branch_replay_jax.algorithms.grpo (RLOO: loss.advantage)
  c.model = ml_collections.ConfigDict()
  c.model.name = "smollm2-135m-instruct"  # models.load name or path; "tiny" = random 2-layer model (smoke tests)
  c.model.dtype = "float32"               # compute dtype: float32 or bfloat16
  c.model.param_dtype = "float32"         # float32, or bfloat16 (steps see bfloat16 parameters; float32 master)
  c.model.remat = "none"                  # rematerialisation: none, full (keep layer inputs), save_kv (inputs + K/V)
  #                                       # or offload_kv (save_kv with the saved arrays in host memory)
  c.model.routing_replay = False          # a mixture of experts' update runs the sampler's recorded experts (R3): groups,
  #                                       # trees, episodes (history "tokens"); not packed trees
  c.model.attention_impl = "auto"         # suffix attention: xla (jnp reference), pallas, splash, auto (pallas on GPU, splash on TPU)
  c.model.expert_matmul = "ragged_dot"    # a mixture of experts' grouped matmuls: ragged_dot, tiled
  #                                       # (kernels.grouped_matmul: tiles of one expert's rows; any backend)
  #                                       # or pallas (those tiles as Pallas kernels; one device)
  c.model.gated_delta_scan = "xla"        # linear-attention layers' chunk scan (Qwen3.5): xla (lax.scan) or pallas
  #                                       # (kernels.gated_delta_pallas)

  c.task = ml_collections.ConfigDict()
  c.task.name = "basic_arithmetic"        # a name in branch_replay_jax.rollout.tasks.TASKS (also gsm_symbolic)
  c.task.size = 100_000                   # problems in the generated dataset (the data position wraps around)
  c.task.seed = 0                         # reasoning-gym generator seed
  c.task.options = ml_collections.ConfigDict()  # generator options overriding the task's defaults
  c.task.format_bonus = 0.1               # reward added when the answer is inside <answer></answer> tags
  c.task.strict_answer = False            # True: only a closed <answer></answer> tag counts; False: also an
  #                                       # unclosed tag or the last number (rollout/tasks, "Answer extraction")
  c.task.few_shot = 0                     # solved examples shown before each question (chat turns; the same
  c.task.few_shot_seed = 2_000_000        # in training and evaluation), drawn from this generator seed
  add_task_fields(c.task)                 # data source, prompt and reward fields (below)

  c.rollout = ml_collections.ConfigDict()
  c.rollout.prompts_per_step = 2          # groups per optimizer step
  c.rollout.group_size = 8                # G: completions sampled per prompt (one shared prefill); groups only
  c.rollout.max_new_tokens = 32           # tokens generated per completion at most; groups only
  c.rollout.temperature = 1.0             # sampling temperature
  c.rollout.top_p = 1.0                   # nucleus mass (1 disables the filter)
  c.rollout.stop_strings = ()             # text that ends a completion besides the model's stop ids, matched on the
  #                                       # decoded text as tokens arrive, e.g. ("</answer>",) or a tool tag ("</calc>",)
  c.rollout.tree_fanouts = ()             # e.g. (4, 2, 2): sample a tree (TreePO) instead of G independent samples;
  #                                       # a tree config removes group_size and max_new_tokens (see grpo_tree_*)
  c.rollout.segment_length = 0            # tokens per tree segment with tree_fanouts; must be 0 without
  c.rollout.dynamic_sampling = False      # DAPO: drop groups whose rewards are all equal, draw more prompts until
  #                                       # prompts_per_step groups remain (logs prompts_drawn, dropped_groups)
  c.rollout.max_prompt_draws = ml_collections.config_dict.placeholder(int)  # with dynamic_sampling: the most
  #                                       # prompts drawn per step, a multiple of prompts_per_step (None without)

  c.loss = ml_collections.ConfigDict()
  c.loss.clip_eps_low = 0.2               # ratio clip [1 - clip_eps_low, 1 + clip_eps_high]; equal: PPO's symmetric
  c.loss.clip_eps_high = 0.2              # clip, high > low: DAPO's clip-higher (e.g. 0.28); low > high is refused.
  #                                       # APPLY ONLY WITH train.inner_epochs > 1: at 1 GRPO is on-policy (ratio 1,
  #                                       # its gradient is that of the ratio) and nothing is clipped
  c.loss.importance_ratio = "token"       # token (PPO/GRPO ratio per token) or sequence (GSPO, arXiv 2507.18071:
  #                                       # (pi/pi_old)^(1/|y|) per completion; needs weighting sequence_mean).
  #                                       # Differs from token only with train.inner_epochs > 1 (on-policy: equal)
  c.loss.logprob_temperature = "one"      # trainer log-probs of softmax(logits / tau): one (tau = 1) or sampling
  #                                       # (tau = rollout.temperature, the distribution the tokens came from)
  c.loss.weighting = "sequence_mean"      # per-(token, trajectory) loss weights: sequence_mean (GRPO: mean over each
  #                                       # completion, then the group), group_token_mean (DAPO's token mean per
  #                                       # group), step_token_mean (DAPO's token mean over the whole step) or
  #                                       # constant (Dr. GRPO: 1 / (G x budget)); groups averaged over the step
  c.loss.mask_truncated = False           # True: completions cut by the token budget get no loss (weights 0, the
  #                                       # group normalised over the others)
  c.loss.overlong_buffer = 0              # DAPO's soft overlong punishment: the last N tokens of the budget cost
  c.loss.overlong_penalty = 1.0           # up to overlong_penalty reward, linearly (0 disables)
  c.loss.kl_coef = 0.04                   # beta of the k3 KL penalty to the initial policy (0 disables it)
  c.loss.router_aux_coef = 0.0            # a mixture of experts' load-balancing loss per trajectory (0: none; RL recipes run 0)
  c.loss.advantage = "grpo"               # grpo (group-normalised) or rloo (leave-one-out baseline, arXiv 2402.14740)
  c.loss.advantage_eps = 1e-6             # epsilon added to the group reward std (grpo; an rloo config removes it)
  c.loss.rollout_correction = "none"      # importance correction against the sampler's log-probs, rho =
  #                                       # pi_old / pi_sampler on each policy-gradient term: none, tis (min(rho, C)),
  #                                       # mis (rho, 0 outside [1/C, C]) or icepop (rho, 0 outside [floor, C]);
  #                                       # any but none costs one forward a step (docs/design.md, "Rollout correction")
  c.loss.rollout_correction_level = "token"  # rho per token or per sequence (a trajectory's product; not icepop)
  c.loss.rollout_is_cap = 2.0             # C
  c.loss.rollout_is_floor = 0.5           # icepop's lower bound

  c.train = ml_collections.ConfigDict()
  c.train.steps = 30                      # optimizer steps
  c.train.learning_rate = 2e-6            # peak AdamW learning rate
  c.train.lr_schedule = "constant"        # constant or cosine (decay to 10% over the run, after warmup)
  c.train.warmup_steps = 0                # linear warmup steps
  c.train.weight_decay = 0.0              # AdamW decoupled weight decay
  c.train.max_grad_norm = 1.0             # global-norm gradient clipping
  c.train.inner_epochs = 1                # updates per sampled batch; > 1 replays old log-probs first
  c.train.gradient = "replay"             # replay (shared prompt once) or naive (prompt repeated per completion)
  c.train.max_staleness = 0               # k > 0: step t samples with the policy of step t - k, ahead of the update
  #                                       # in a producer thread (pair it with loss.rollout_correction)
  c.train.micro_batch = 8                 # completions per scan step, replay or naive; must divide G (8 = G: one
  #                                       # batch, no scan: the fastest; smaller lowers peak memory). Trees: leaf
  #                                       # siblings per step, must divide the last fan-out (levels EOS cut short and
  #                                       # naive trajectories use the largest divisor of their count not above it)
  c.train.tree_schedule = "depth_first"   # trees: depth_first (least memory), level (batched levels) or packed (one row)
  c.train.exactness_check_every = 25      # every k steps one group's gradient by replay and naive, compared and
  #                                       # logged (exactness_* in metrics.jsonl; a loud warning above the bound); 0: off

  c.eval = ml_collections.ConfigDict()    # held-out evaluation (algorithms/evaluation.py; RUN_DIR/eval.jsonl)
  c.eval.size = 20                        # held-out problems N (0 disables the evaluation); its cost per
  #                                       # evaluation: docs/results/default-run
  c.eval.task_seed = 1_000_000            # their task seed; must differ from task.seed (problems whose question a
  #                                       # training item asks are dropped as well)
  c.eval.every = 15                       # steps between evaluations; also at step 0 and at the end
  c.eval.pass_k = 8                       # samples per problem for pass@k at rollout.temperature (0: greedy only)

  c.mesh = ml_collections.ConfigDict()    # device mesh of the update (distributed/mesh.py); 1 x 1 x 1 = one device
  c.mesh.data = 1                         # groups split over devices; must divide rollout.prompts_per_step
  c.mesh.branch = 1                       # each group's completions (a tree's first-level subtrees) split over devices;
  #                                       # must divide group_size (tree_fanouts[0])
  c.mesh.seq = 1                          # each prompt's tokens split over devices (context parallelism)
  c.mesh.params = "replicated"            # replicated, or fsdp (parameters and optimizer state sharded at rest)
  c.mesh.expert = ""                      # a mixture of experts: the axis its experts are split over (data or
  #                                       # branch; the tokens are sent to them); "": none
  c.mesh.rollout_devices = 0              # devices beside the mesh that only sample (a rollout sub-mesh; with
  #                                       # train.max_staleness > 0 they sample while the mesh updates)

  c.distributed = ml_collections.ConfigDict()  # several processes (distributed/hosts.py; README, "Several processes and hosts")
  c.distributed.coordinator_address = ml_collections.config_dict.placeholder(str)  # process 0's "host:port";
  #                                       # None: environment variable JAX_COORDINATOR_ADDRESS
  c.distributed.num_processes = ml_collections.config_dict.placeholder(int)  # None: JAX_NUM_PROCESSES, else 1
  c.distributed.process_id = ml_collections.config_dict.placeholder(int)     # None: JAX_PROCESS_ID, else 0

  c.seed = 0                              # sampling and initialisation seed
  c.run_dir = "runs/grpo_smollm2_arith"   # metrics.jsonl, plots, checkpoints
  c.checkpoint_every = 5                  # steps between checkpoints (also saved at the end)
  c.resume = False                        # continue from the latest checkpoint in run_dir (a run_dir holding
  #                                       # a run is refused unless resume or overwrite is True)
  c.overwrite = False                     # True: delete everything in run_dir (checkpoints included) before a
  #                                       # fresh run; not with resume

  if arg in ("lora", "lora_smoke"):
    # LoRA (models/lora.py): only the adapters train; the KL reference is the base model (adapters off).
    c.lora = ml_collections.ConfigDict()
    c.lora.rank = 16                      # r: adapter rank, at most every target's fan-in and fan-out
    c.lora.alpha = 32.0                   # the adapters' output is scaled by alpha / r
    c.lora.dropout = 0.0                  # only 0 (replay needs one deterministic function of the adapters)
    c.lora.targets = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # adapted projections (models.lora.TARGETS)
    c.train.learning_rate = 5e-5          # adapters start at B = 0 and take a larger step than full weights
    c.run_dir = "runs/grpo_smollm2_arith_lora"

  if arg == "long":
    c.train.steps = 40
    c.run_dir = "runs/grpo_smollm2_arith_long"
  elif arg == "eval200":
    c.eval.size = 200                     # a 95% interval of about +-0.07 at accuracy 0.5
    c.eval.every = 30                     # step 0 and the end only: about 9 min per evaluation on 2 CPU cores
    c.run_dir = "runs/grpo_smollm2_arith_eval200"
  elif arg == "learn":
    # The learning experiment (README, "Learning on held-out problems"): 4 solved examples before each
    # question teach the <answer> format at once (format rate 1.0 at step 0) but the untrained model
    # then copies the examples' numbers (greedy accuracy 0.035 on the 200 held-out problems, against
    # ~0.3 without examples in a 40-problem probe): a behaviour RL can unlearn, and a 220-token shared
    # prompt against ~9-token completions (ideal_flop_ratio ~6), where replay matters.
    c.task.few_shot = 4
    c.task.strict_answer = True           # the examples teach the tags: only a tagged answer counts
    c.rollout.max_new_tokens = 16         # "<answer>-123</answer>" + EOS is ~9 tokens
    c.rollout.dynamic_sampling = True     # ~3 in 4 groups are all wrong at step 0 (zero advantage):
    c.rollout.max_prompt_draws = 16       # draw up to 8 prompts per kept group
    c.loss.kl_coef = 0.0                  # no reference forward (DAPO, arXiv 2503.14476 §2.3)
    c.train.steps = 120                   # 34 min in all on 2 idle CPU cores (4 evaluations included)
    c.train.learning_rate = 5e-6
    c.eval.size = 200                     # a 95% interval of about +-0.05 at accuracy 0.15
    c.eval.every = 40
    c.eval.pass_k = 0                     # greedy only: 132-139 s per 200 problems on 2 CPU cores
    c.checkpoint_every = 40
    c.run_dir = "runs/grpo_smollm2_arith_learn"
  elif arg in ("smoke", "lora_smoke"):
    c.model.name = "tiny"
    c.task.size = 64
    c.rollout.prompts_per_step = 2
    c.rollout.group_size = 4
    c.rollout.max_new_tokens = 8
    c.train.steps = 2
    c.train.learning_rate = 1e-5
    c.train.micro_batch = 2
    c.train.exactness_check_every = 0     # tests/test_exactness_check.py turns it on
    c.checkpoint_every = 1
    c.eval.size = 2
    c.eval.every = 2                      # step 0 and the end
    c.eval.pass_k = 4                     # = group_size: the eval's sampling reuses the training sampler's compile
    c.run_dir = "runs/grpo_smoke"
    if arg == "lora_smoke":
      c.lora.rank = 4                     # the tiny model's k/v projections have fan-out 16
      c.train.learning_rate = 1e-3
      c.run_dir = "runs/grpo_lora_smoke"
  elif arg not in (None, "", "lora"):
    raise ValueError(f"experiments/grpo_smollm2_arith.py: unknown variant {arg!r}; use '', 'long', 'eval200', "
                     "'learn', 'smoke', 'lora' or 'lora_smoke'")
  return c
