"""GRPO on multi-turn calculator episodes: SmolLM2-135M-Instruct calls a calculator tool (JSON tool
calls, rollout/tools.py) on reasoning-gym's basic_arithmetic with 3- and 4-digit numbers, then
answers; the episodes of a problem share their prefix in training (docs/design.md, "Episodes").

  python -m branch_replay_jax.main --config=experiments/grpo_smollm2_calc.py
  python -m branch_replay_jax.main --config=experiments/grpo_smollm2_calc.py:smoke   # tiny model, 2 steps
  python -m branch_replay_jax.main --config=experiments/grpo_smollm2_calc.py:guess   # GEM's GuessTheNumber
  PYTHONPATH=experiments/tasksets python -m branch_replay_jax.main \
      --config=experiments/grpo_smollm2_calc.py:vf_arith   # a verifiers taskset with a second attempt

RLOO: --config.loss.advantage=rloo (and remove loss.advantage_eps: `del` it in a variant).
"""

import ml_collections

from experiments import grpo_smollm2_arith


def get_config(arg=None):
  c = grpo_smollm2_arith.get_config("smoke" if arg == "smoke" else None)
  c.algorithm = "grpo"                    # the GRPO loop (RLOO: loss.advantage = "rloo")
  del c.rollout.max_new_tokens            # an episode's turns have rollout.episodes.max_turn_tokens
  c.task.name = "basic_arithmetic"
  c.task.options = ml_collections.ConfigDict({"min_digits": 3, "max_digits": 4})   # worth a calculator
  c.task.strict_answer = True             # the examples teach the tags: only a tagged answer counts
  c.task.format_bonus = 0.1
  c.task.instruction = ("Use the calculator tool, then give only the final answer, inside <answer></answer> "
                        "tags.")
  c.rollout.group_size = 8                # G: episodes per problem, branching at the first turn
  c.rollout.episodes = ml_collections.ConfigDict()
  c.rollout.episodes.environment = "calculator"   # rollout/environments.py: ToolEnv with the calculator; or
  #                                       # textarena:GAME-ID, gem:ENV-ID, verifiers:TASKSET-ID,
  #                                       # openenv:package.module:NAME, FILE.py:NAME, python:package.module:NAME
  c.rollout.episodes.env_options = ml_collections.ConfigDict()   # keyword arguments of those (none here)
  c.rollout.episodes.max_turns = 3        # model turns per episode: call, (call,) answer
  c.rollout.episodes.max_turn_tokens = 48  # tokens per model turn
  c.rollout.episodes.max_episode_tokens = ml_collections.config_dict.placeholder(int)  # None: 3 x 48
  c.rollout.episodes.max_context = 1024   # tokens of a whole episode, prompt and observations included
  c.rollout.episodes.max_tool_calls = 2   # calls per episode; more end it as max_tool_calls
  c.rollout.episodes.few_shot = 2         # tool-using solved examples before each question (task.few_shot_seed)
  c.rollout.episodes.min_shared_tokens = 32   # a shared node shorter than this is not shared (fewer, fuller levels)
  c.rollout.episodes.max_tree_depth = 4   # levels of an episode tree; deeper nodes are not shared (XLA:CPU dot rank)
  c.rollout.episodes.share = "tree"       # replay computes once: tree (every common turn) or prompt (the prompt only,
  #                                       # one row per episode: docs/results/episodes-cpu)
  c.rollout.episodes.history = "tokens"   # the model is given its sampled ids (token-in, token-out), or
  #                                       # "template": the chat template's rendering (Qwen3 drops <think>)
  c.train.micro_batch = 8                 # leaf siblings (episode branches) per scan step (nested schedules)
  c.train.tree_schedule = "packed"        # each episode tree one row: one program per row-length bucket (figures:
  #                                       # docs/results/episodes-cpu); on a mesh set depth_first
  c.train.exactness_check_every = 5
  c.eval.pass_k = 0                       # greedy episodes only
  c.run_dir = "runs/grpo_smollm2_calc"
  if arg == "smoke":
    c.rollout.group_size = 4
    c.rollout.episodes.max_turns = 2
    c.rollout.episodes.max_turn_tokens = 6
    c.rollout.episodes.max_context = 512
    c.rollout.episodes.few_shot = 1
    c.train.micro_batch = 2
    c.train.exactness_check_every = 0     # tests/test_episode_loop.py turns it on
    c.eval.size = 2
    c.eval.every = 2                      # step 0 and the end
    c.run_dir = "runs/grpo_calc_smoke"
  elif arg == "guess":   # an environment that is not ours: GEM's GuessTheNumber (1..10, 4 guesses, hints)
    c.rollout.episodes.environment = "gem:game:GuessTheNumber-v0-easy"   # a task problem is a seeded game
    c.rollout.episodes.few_shot = 0       # the calculator's examples do not apply
    c.rollout.episodes.max_turns = 4      # the game's own limit
    c.rollout.episodes.max_turn_tokens = 32
    c.run_dir = "runs/grpo_smollm2_guess"
  elif arg == "vf_arith":   # learning on a verifiers environment (docs/results/verifiers-arith)
    # experiments/tasksets/vf_arith.py: the `:learn` experiment's few-shot arithmetic prompt (the untrained
    # model copies the examples' numbers), a wrong answer gets a second turn; reward 1, 0.5 at the second.
    c.rollout.episodes.environment = "verifiers:vf_arith"
    c.rollout.episodes.env_options = ml_collections.ConfigDict({"num_tasks": 20_000})
    c.rollout.episodes.few_shot = 0       # the taskset's prompt has its own examples
    c.rollout.episodes.max_turns = 2      # the taskset's own limit
    c.rollout.episodes.max_turn_tokens = 16   # "<answer>-123</answer>" + EOS is ~9 tokens
    c.rollout.prompts_per_step = 4        # ~3 in 4 problems have all-wrong first answers at step 0
    c.loss.kl_coef = 0.0                  # no reference forward (DAPO), as `:learn`
    c.train.steps = 40
    c.train.learning_rate = 5e-6
    c.eval.size = 100
    c.eval.every = 20
    c.train.exactness_check_every = 10
    c.checkpoint_every = 20
    c.run_dir = "runs/grpo_smollm2_vf_arith"
  elif arg not in (None, ""):
    raise ValueError(f"experiments/grpo_smollm2_calc.py: unknown variant {arg!r}; use '', 'smoke', 'guess' or "
                     "'vf_arith'")
  return c
