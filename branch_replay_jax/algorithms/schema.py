"""The config schema of each algorithm: typed frozen dataclasses, and `parse`, which checks an
experiment's `ml_collections.ConfigDict` against them before anything loads (docs/design.md,
"Config schema").

`config.algorithm` ("grpo", which covers RLOO through loss.advantage; "ppo"; "dpo") picks the
schema. `parse` refuses, naming the dotted field: a field the schema does not define (with a "did
you mean" hint, or, for another algorithm's field, which algorithm reads it), a value of the wrong
type (a bool is not an int; an int is a float), None where the field is no placeholder, and a
missing field that has no default. A field whose default is None may be left out (it reads None);
it may be set to None only when its type is Optional (the ml_collections placeholders). Ranges and
combinations stay in the algorithms' `validate` (checks.py, grpo.py, ppo.py, dpo.py), which call
`parse` first and keep reading the ConfigDict. A field renamed or merged (loss.normalisation and
loss.aggregation into loss.weighting) is refused with the value to write instead (`RENAMED`).

Each field says which rollout layouts it applies to (`layouts`): groups, trees, episodes (GRPO's
rollout.episodes: multi-turn episodes with an environment, docs/design.md, "Episodes"), or all
three (the default). A group-only field in a tree config is refused (checks.validate_tree_rollout),
and so is a tree-only one set to act on groups (rollout.segment_length > 0); train.tree_schedule,
which every shipped experiment sets, is read by trees and episodes and inert on groups. An episode
config refuses every field that does not apply to episodes unless it holds its inert value
(`INERT`: e.g. rollout.tree_fanouts=()), and refuses fields without one
(rollout.max_new_tokens) outright (checks.validate_episode_rollout).

`parse` reads the config's storage (`ConfigDict.items(preserve_field_references=True)`), not its
`__getitem__`, so tests/test_config_fields.py's record of the fields a run reads still shows the
fields the code reads; only `algorithm` is read the ordinary way (it decides the schema).

Why one file of over 500 lines: most of it is declarations, one dataclass per section of three
algorithms, each field with its doc; one place for every field's type and meaning.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Optional

import ml_collections

from branch_replay_jax.losses import WEIGHTINGS
from branch_replay_jax.rollout.tasks.prompts import DEFAULT_INSTRUCTION, DEFAULT_TEMPLATE

ALGORITHMS = ("grpo", "ppo", "dpo")
MODULES = {"grpo": "algorithms/grpo.py", "ppo": "algorithms/ppo.py", "dpo": "algorithms/dpo.py"}


LAYOUTS = ("group", "tree", "episode")   # the rollout layouts a field can apply to
GROUPS_AND_TREES = ("group", "tree")
# Fields that do not apply to every layout, at the value that leaves them inert: an episode config
# may hold them at that value (the shipped experiments list every field); any other is refused.
INERT = {"rollout.segment_length": 0, "rollout.tree_fanouts": (), "loss.overlong_buffer": 0,
         "rollout.stop_strings": ()}
SHARES = ("tree", "prompt")     # rollout.episodes.share: what a replay step computes once (docs/design.md, "Episodes")


def _f(doc: str, default=dataclasses.MISSING, *, layouts: tuple[str, ...] = LAYOUTS):
  """A schema field: its one-line doc (meaning, unit), the rollout layouts it applies to (groups,
  trees, episodes, or all; `layouts`); a default makes it optional."""
  return dataclasses.field(default=default, metadata={"doc": doc, "layouts": layouts})


_frozen = dataclasses.dataclass(frozen=True, kw_only=True)


@_frozen
class ModelConfig:
  name: str = _f("models.load name or path; 'tiny': a random 2-layer model (smoke tests)")
  dtype: str = _f("compute dtype: float32 or bfloat16")
  param_dtype: str = _f("parameter dtype the steps see: float32, or bfloat16 (float32 master; grpo, ppo)")
  remat: str = _f("rematerialisation: none, full, save_kv or offload_kv")
  attention_impl: str = _f("suffix attention: xla, pallas, splash or auto (pallas on GPU, splash on TPU)")
  expert_matmul: str = _f("a mixture of experts' grouped matmuls: ragged_dot (jax.lax.ragged_dot: dense over every "
                          "expert on XLA:CPU), tiled (kernels.grouped_matmul: tiles of one expert's rows) or pallas "
                          "(kernels.grouped_matmul_pallas: those tiles as Pallas kernels; one device)",
                          "ragged_dot")
  gated_delta_scan: str = _f("linear-attention layers' chunk scan (Qwen3.5): xla (jax.lax.scan) or pallas "
                             "(kernels.gated_delta_pallas: one program per row and head)", "xla")


@_frozen
class GRPOModelConfig(ModelConfig):
  routing_replay: bool = _f("a mixture of experts' update runs the experts the sampler chose (R3) instead of the "
                            "router's own top k; groups, sampled trees and episodes (history 'tokens'), not packed trees", False)


@_frozen
class TaskConfig:
  """The task (rollout/tasks/sources.py; README, "Train on your own task")."""
  name: str = _f("the task's name; without task.source also its data: a preset (basic_arithmetic, gsm_symbolic) "
                 "or any reasoning-gym dataset")
  size: int = _f("problems in the training task (a file: at most; the data position wraps around)")
  seed: int = _f("reasoning-gym generator seed; a file: the seed of its row shuffle (and held-out split)")
  options: dict = _f("generator options overriding the task's defaults (free-form, the generator checks them); "
                     "command line: --config.task.options='{\"max_digits\": 3}'")
  format_bonus: float = _f("reward added when the answer is inside <answer></answer> tags (0 with task.rewards)")
  strict_answer: bool = _f("True: only a closed <answer> tag counts; False: also an unclosed tag or the last number")
  few_shot: int = _f("solved examples (chat turns) shown before each question, in training and evaluation; "
                     "reasoning-gym sources only; must be 0 with episodes (rollout.episodes.few_shot)")
  few_shot_seed: int = _f("generator seed of the few-shot examples")
  source: Optional[str] = _f("None (task.name), 'reasoning_gym:NAME', a .jsonl/.json/.parquet/.csv file or a "
                             "save_to_disk directory, or 'python:module:name' (a task object or factory)", None)
  prompt_column: str = _f("file sources: the column of the prompt text (or of a message list)", "prompt")
  answer_column: str = _f("file sources: the column of the reference answer ('' for none)", "answer")
  messages_column: str = _f("file sources: a column of chat messages used as the prompt ('' for none)", "")
  eval_source: Optional[str] = _f("file sources: the evaluation's file (same columns); None: task.eval_split", None)
  eval_split: float = _f("file sources: the fraction of rows held out for the evaluation (shuffled by task.seed)",
                         0.0)
  system_prompt: Optional[str] = _f("the system message; None: none written, the chat template adds its default "
                                    "(SmolLM2: 'You are a helpful AI assistant named SmolLM, ...')", None)
  instruction: str = _f("the answer instruction, the prompt template's {instruction}",
                        DEFAULT_INSTRUCTION)
  prompt_template: str = _f("the user turn: {question}, {instruction} and a file row's columns", DEFAULT_TEMPLATE)
  rewards: tuple[str, ...] = _f("reward functions 'module:function' (TRL's batch signature), replacing the task's "
                                "reward (rollout/tasks/rewards.py)", ())
  reward_weights: tuple[float, ...] = _f("a weight per task.rewards function; (): all 1", ())


@_frozen
class SamplingConfig:
  """DPO's rollout section (data.source = 'task'): the candidates of each pair."""
  prompts_per_step: int = _f("prompts (groups) per optimizer step")
  group_size: int = _f("G: completions sampled per prompt, one shared prefill")
  max_new_tokens: int = _f("tokens generated per completion at most")
  temperature: float = _f("sampling temperature (> 0)")
  top_p: float = _f("nucleus mass in (0, 1] (1 disables the filter)")
  stop_strings: tuple[str, ...] = _f("non-empty strings that end a completion when its decoded text contains one, "
                                     "e.g. ('</answer>',); () none (rollout/stop_strings.py)", ())


@_frozen
class PPORolloutConfig(SamplingConfig):
  group_size: int = _f("G: completions sampled per prompt; groups only (a tree config removes it)", None,
                       layouts=("group",))
  max_new_tokens: int = _f("tokens generated per completion at most; groups only (a tree config removes it)", None,
                           layouts=("group",))
  tree_fanouts: tuple[int, ...] = _f("fan-out per tree level, e.g. (4, 2, 2); () samples groups (it picks the layout; "
                                     "() with episodes)", layouts=GROUPS_AND_TREES)
  segment_length: int = _f("tokens per tree segment; trees only (must be 0 with groups)", layouts=("tree",))
  stop_strings: tuple[str, ...] = _f("non-empty strings that end a completion when its decoded text contains one, "
                                     "e.g. ('</answer>',); () none (rollout/stop_strings.py); groups and trees (an "
                                     "episode's turns end at the model's stop ids)", (), layouts=GROUPS_AND_TREES)


@_frozen
class EpisodesConfig:
  """GRPO's rollout.episodes: multi-turn episodes in an environment (docs/design.md, "Episodes")."""
  environment: str = _f("the environment over the task's problems: calculator (JSON tool calls to a restricted-ast "
                        "calculator, answer scored by the task), textarena:GAME-ID (a TextArena game), gem:ENV-ID (a GEM "
                        "environment; a problem of the task is one seeded game), verifiers:TASKSET-ID (a verifiers 0.4.0 "
                        "taskset; a problem picks one of its tasks), openenv:package.module:NAME (an OpenEnv "
                        "Environment subclass or factory, in process; a problem is its reset's seed), or your own "
                        "class or factory by import path, FILE.py:NAME or python:package.module:NAME "
                        "(rollout/environments.py's protocol)", layouts=("episode",))
  env_options: Optional[dict] = _f("keyword arguments of the environment's class or factory (textarena:, gem:, "
                                   "verifiers:, openenv:, FILE.py:, python: environments; None or {} for the "
                                   "calculator); command line: "
                                   "--config.rollout.episodes.env_options='{\"size\": 4}'", None,
                                   layouts=("episode",))
  max_turns: int = _f("model turns per episode at most", layouts=("episode",))
  max_turn_tokens: int = _f("tokens one model turn generates at most", layouts=("episode",))
  max_episode_tokens: Optional[int] = _f("model tokens of a whole episode at most (its turns summed); None: "
                                         "max_turns x max_turn_tokens", None, layouts=("episode",))
  max_context: int = _f("tokens of a whole episode at most, prompt and observations included", layouts=("episode",))
  max_tool_calls: int = _f("tool calls per episode at most (more end it as max_turns)", layouts=("episode",))
  few_shot: int = _f("solved tool-using conversations shown before each question (task.few_shot_seed's problems)",
                     layouts=("episode",))
  max_tree_depth: int = _f("levels of a problem's episode tree at most; deeper nodes are not shared "
                           "(data.episodes.limit_depth: XLA:CPU's dots take rank < 8; depth 6 aborts)", 4, layouts=("episode",))
  min_shared_tokens: int = _f("a node the episodes share (the prompt aside) shorter than this is not shared: "
                              "its tokens open each child instead (data.episodes.merge_short: fewer, fuller tree "
                              "levels); 1 shares every common token", 32, layouts=("episode",))
  share: str = _f("what train.gradient=replay computes once: tree (the episode tree: the prompt and every common "
                  "turn and observation) or prompt (the prompt only, each episode one row: the group replay step)",
                  "tree", layouts=("episode",))
  history: str = _f("what the model is given at each turn: tokens (the ids sampled so far, never re-rendered: "
                    "token-in, token-out) or template (the chat template's rendering of the whole conversation: "
                    "where it rewrites an earlier turn, e.g. Qwen3 dropping <think>, the episode goes on as a new "
                    "row whose context the model is given; the rows of a problem share one trie; "
                    "docs/design.md, \"Episodes\")", "tokens", layouts=("episode",))


@_frozen
class GRPORolloutConfig(PPORolloutConfig):
  group_size: int = _f("G: completions (episodes: branching at the first turn) sampled per prompt; groups and "
                       "episodes (a tree config removes it)", None, layouts=("group", "episode"))
  dynamic_sampling: bool = _f("DAPO: drop groups (episodes: a problem's G episodes) of equal rewards, draw more "
                              "prompts")
  max_prompt_draws: Optional[int] = _f("prompts drawn per step at most, a multiple of prompts_per_step; "
                                       "only with dynamic_sampling (None without)")
  episodes: Optional[EpisodesConfig] = _f("multi-turn episodes in an environment (the episode layout); absent: "
                                          "groups or trees", None, layouts=("episode",))


@_frozen
class CorrectionConfig:
  """The rollout correction's fields, shared by GRPO's and PPO's loss sections (correction.py)."""
  rollout_correction: str = _f("importance correction of each policy-gradient term against the sampler's log-probs: "
                               "none, tis, mis or icepop (correction.py)", "none")
  rollout_correction_level: str = _f("the correction's ratio per token or per sequence (icepop: token)", "token")
  rollout_is_cap: float = _f("C: tis truncates the ratio at C, mis masks it outside [1/C, C], icepop above C", 2.0)
  rollout_is_floor: float = _f("icepop masks a ratio below this floor, in (0, 1)", 0.5)


@_frozen
class GRPOLossConfig(CorrectionConfig):
  clip_eps_low: float = _f("ratio clip 1 - eps_low (only off-policy: train.inner_epochs > 1); groups and trees")
  clip_eps_high: float = _f("ratio clip 1 + eps_high; > eps_low is DAPO's clip-higher; groups and trees")
  importance_ratio: str = _f("token (per token) or sequence (GSPO, per completion; needs weighting sequence_mean; "
                             "trees on-policy only)")
  logprob_temperature: str = _f("trainer log-probs at tau = 1 ('one') or rollout.temperature ('sampling')")
  weighting: str = _f("per-(token, trajectory) loss weights: sequence_mean (GRPO), group_token_mean (DAPO's token "
                      "mean per group), step_token_mean (DAPO's token mean over the step) or constant (Dr. GRPO)")
  mask_truncated: bool = _f("True: completions cut by the token budget get weight 0; groups and trees")
  overlong_buffer: int = _f("DAPO's soft overlong penalty over the budget's last N tokens (tokens; 0 disables)",
                            layouts=GROUPS_AND_TREES)
  overlong_penalty: float = _f("reward the overlong penalty costs at most (with overlong_buffer > 0)")
  kl_coef: float = _f("beta of the k3 KL penalty to the initial policy (0: no reference forward)")
  router_aux_coef: float = _f("a mixture-of-experts policy's load-balancing loss coefficient (transformers' "
                              "router_aux_loss_coef): the mean over a group's trajectories of their loss; 0: none",
                              0.0)
  advantage: str = _f("grpo (group-normalised) or rloo (leave-one-out baseline)")
  advantage_eps: float = _f("epsilon added to the group reward std; loss.advantage='grpo' only (RLOO removes it)",
                            None)


@_frozen
class PPOLossConfig(CorrectionConfig):
  clip_eps: float = _f("PPO's symmetric ratio clip epsilon in (0, 1)")
  kl_coef: float = _f("must be 0: the PPO loss has no KL term")
  weighting: str = _f("per-(token, trajectory) loss weights: sequence_mean, group_token_mean or constant")


@_frozen
class TrainConfig:
  """DPO's train section; the base of GRPO's and PPO's."""
  steps: int = _f("optimizer steps")
  learning_rate: float = _f("peak AdamW learning rate")
  lr_schedule: str = _f("constant or cosine (decay to 10% over the run, after warmup)")
  warmup_steps: int = _f("linear warmup steps")
  weight_decay: float = _f("AdamW decoupled weight decay")
  max_grad_norm: float = _f("global-norm gradient clipping")
  gradient: str = _f("replay (shared prefix once) or naive (prompt repeated per completion)")
  micro_batch: int = _f("completions per scan step (groups: divides G; trees: leaf siblings, divides the last "
                        "fan-out; DPO naive: pairs)")
  max_staleness: int = _f("k: step t samples with the parameters after max(start, t - k) steps, in a producer "
                          "thread ahead of the update (0: the synchronous loop; one process)", 0)


@_frozen
class PolicyTrainConfig(TrainConfig):
  inner_epochs: int = _f("updates per sampled batch; > 1 replays old log-probs first (PPO: must be 1)")
  tree_schedule: str = _f("how a tree step computes its trees: depth_first (nested replay, least memory), level "
                          "(nested replay, batched levels) or packed (each tree one row with the tree as its "
                          "attention mask: one program per row-length bucket; GRPO / RLOO, one device, jnp "
                          "attention); trees and episodes (inert on groups)", layouts=("tree", "episode"))
  exactness_check_every: int = _f("steps between run-time replay vs naive checks (0: off); GRPO / RLOO only")


@_frozen
class PPOTrainConfig(PolicyTrainConfig):
  exactness_check_every: int = _f("must be 0: the run-time exactness check is GRPO / RLOO's", 0)


@_frozen
class EvalConfig:
  size: int = _f("held-out problems (0 disables the evaluation)")
  task_seed: int = _f("task seed of the held-out problems; must differ from task.seed")
  every: int = _f("steps between evaluations (also at step 0 and at the end)")
  pass_k: int = _f("samples per problem for pass@k at rollout.temperature (0: greedy only)")


@_frozen
class MeshConfig:
  data: int = _f("devices the step's groups (trees) are split over; groups and trees")
  branch: int = _f("devices each group's completions (a tree's first-level subtrees) are split over")
  seq: int = _f("devices each prompt's tokens are split over (context parallelism)")
  params: str = _f("replicated, or fsdp (parameters and optimizer state sharded at rest)")
  expert: str = _f("a mixture of experts' expert parallelism: the axis its experts are split over, 'data' or "
                   "'branch' (the tokens are sent to them; docs/design.md, \"Expert parallelism\"); '': none", "")
  rollout_devices: int = _f("GRPO: devices beside the training mesh that sample (the rollout sub-mesh): the sampler "
                            "takes the last rollout_devices / (process count) devices of each process, the mesh the "
                            "others, each sampling device with a full copy of the parameters sent device to device "
                            "from a training device of its process before each step's sampling; a multiple of the "
                            "process count; 0: the sampler runs on the training devices (docs/design.md, "
                            "\"Bounded staleness\")", 0)


@_frozen
class DistributedConfig:
  coordinator_address: Optional[str] = _f("process 0's host:port; None: JAX_COORDINATOR_ADDRESS", None)
  num_processes: Optional[int] = _f("processes of the run; None: JAX_NUM_PROCESSES, else 1", None)
  process_id: Optional[int] = _f("this process's index; None: JAX_PROCESS_ID, else 0", None)


@_frozen
class LoraConfig:
  rank: int = _f("r: adapter rank, at most every target's fan-in and fan-out")
  alpha: float = _f("the adapters' output is scaled by alpha / r")
  dropout: float = _f("adapter dropout; only 0 (replay needs one deterministic function)")
  targets: tuple[str, ...] = _f("adapted projections (models.lora.TARGETS)")


@_frozen
class PPOConfig:
  critic: str = _f("value_head (scalar head on the policy's trunk) or separate (own trunk)")
  epochs: int = _f("passes over each step's groups")
  minibatches: int = _f("optimizer updates per pass; divides rollout.prompts_per_step")
  gamma: float = _f("GAE discount per token, in [0, 1]")
  lam: float = _f("GAE lambda, in [0, 1]")
  vf_coef: float = _f("weight of the value loss")
  value_clip: float = _f("clip V - V_old to +-value_clip in the value loss (0 disables)")
  whiten_advantages: bool = _f("normalise advantages over the step's (token, trajectory) pairs")
  critic_lr_scale: float = _f("critic parameters' learning rate / train.learning_rate")


@_frozen
class DPOConfig:
  loss: str = _f("sigmoid (DPO), ipo (on mean per-token log-probs) or ipo_sum (on sums)")
  beta: float = _f("DPO beta (IPO: tau), > 0")
  label_smoothing: float = _f("conservative DPO's epsilon in [0, 0.5); sigmoid only")


@_frozen
class DataConfig:
  source: str = _f("task (pairs sampled and scored on the fly) or jsonl (pairs from a file)")
  path: str = _f("JSON lines {prompt, chosen, rejected}; data.source='jsonl' only", None)
  pairs_per_step: int = _f("pairs per optimizer step (wraps around the file); data.source='jsonl' only", None)


@_frozen
class RunConfig:
  algorithm: str = _f("grpo (GRPO, RLOO with loss.advantage='rloo'), ppo or dpo: the trainer main.py runs")
  seed: int = _f("sampling and initialisation seed")
  run_dir: str = _f("directory of metrics.jsonl, plots and checkpoints")
  checkpoint_every: int = _f("steps between checkpoints (also saved at the end)")
  resume: bool = _f("continue from the latest checkpoint in run_dir")
  overwrite: bool = _f("delete everything in run_dir (checkpoints included) before a new run; refused with resume")


@_frozen
class GRPOExperiment(RunConfig):
  model: GRPOModelConfig = _f("the policy")
  task: TaskConfig = _f("the reasoning-gym task the prompts come from")
  rollout: GRPORolloutConfig = _f("sampling: groups, or trees with rollout.tree_fanouts")
  loss: GRPOLossConfig = _f("the GRPO / RLOO objective")
  train: PolicyTrainConfig = _f("optimizer and gradient layout")
  eval: EvalConfig = _f("held-out evaluation; absent: none", None)
  mesh: MeshConfig = _f("device mesh of the update; 1 x 1 x 1: one device")
  distributed: Optional[DistributedConfig] = _f("several processes; absent: the environment variables", None)
  lora: Optional[LoraConfig] = _f("LoRA adapters, base frozen; absent: full fine-tuning", None)


@_frozen
class PPOExperiment(RunConfig):
  model: ModelConfig = _f("the policy (and, with ppo.critic='separate', the critic's trunk)")
  task: TaskConfig = _f("the reasoning-gym task the prompts come from")
  rollout: PPORolloutConfig = _f("sampling: groups, or trees with rollout.tree_fanouts")
  loss: PPOLossConfig = _f("the clipped policy loss")
  train: PPOTrainConfig = _f("optimizer and gradient layout")
  eval: EvalConfig = _f("held-out evaluation; absent: none", None)
  mesh: MeshConfig = _f("device mesh of the update; 1 x 1 x 1: one device")
  distributed: Optional[DistributedConfig] = _f("several processes; absent: the environment variables", None)
  ppo: PPOConfig = _f("critic, GAE and epochs")


@_frozen
class DPOExperiment(RunConfig):
  model: ModelConfig = _f("the policy")
  data: DataConfig = _f("where the preference pairs come from")
  task: TaskConfig = _f("the task prompts are drawn from; data.source='task' only", None)
  rollout: SamplingConfig = _f("sampling of the candidates; data.source='task' only", None)
  dpo: DPOConfig = _f("the preference loss")
  train: TrainConfig = _f("optimizer and gradient layout")
  eval: EvalConfig = _f("held-out evaluation (data.source='task'); absent: none", None)
  mesh: MeshConfig = _f("device mesh of the update; 1 x 1 x 1: one device")
  distributed: Optional[DistributedConfig] = _f("several processes; absent: the environment variables", None)


SCHEMAS = {"grpo": GRPOExperiment, "ppo": PPOExperiment, "dpo": DPOExperiment}


@dataclasses.dataclass(frozen=True)
class Layout:
  """A run's layout, resolved once from its typed config (`layout_of`) and passed on to everything
  that lays out a step: what a step's rollouts are and how its update computes them.

  rollout: one of LAYOUTS: "group" (G completions of a prompt), "tree" (rollout.tree_fanouts: a
    sampled tree) or "episode" (rollout.episodes: G multi-turn episodes of a problem).
  gradient: "replay" or "naive" (train.gradient), `gradients.step`'s layout.
  share: episodes only, rollout.episodes.share (`SHARES`): what replay computes once; "tree" for a
    sampled tree, "prompt" for a group (what their replay computes once).
  min_shared_tokens, max_tree_depth, history: episodes only, rollout.episodes' (0 and "tokens" otherwise).
  """
  rollout: str
  gradient: str
  share: str
  min_shared_tokens: int = 0
  max_tree_depth: int = 0
  history: str = "tokens"

  @property
  def tree(self) -> bool:
    """Whether a step trains trees (replay of a sampled tree or of an episode tree: trees' levels, or
    packed rows with train.tree_schedule = "packed"); otherwise groups' rows (a group, or any rollout's rows)."""
    return self.gradient == "replay" and self.share == "tree"


def layout_of(experiment) -> Layout:
  """The `Layout` of a parsed experiment (`parse`'s GRPOExperiment or PPOExperiment)."""
  r, gradient = experiment.rollout, experiment.train.gradient
  episodes = getattr(r, "episodes", None)
  if episodes is not None:
    return Layout("episode", gradient, episodes.share, episodes.min_shared_tokens, episodes.max_tree_depth,
                  episodes.history)
  return Layout("tree", gradient, "tree") if r.tree_fanouts else Layout("group", gradient, "prompt")

# Another algorithm's field in this algorithm's config: messages that say more than "remove it".
_FOREIGN = {
    ("grpo", "loss.clip_eps"): "loss.clip_eps={value}: GRPO's clip range is loss.clip_eps_low and loss.clip_eps_high "
                               "(set both equal for the symmetric clip); remove loss.clip_eps (a PPO option, "
                               "algorithms/ppo.py)",
    **{(a, "lora"): "lora is set with algorithm={algorithm!r}: LoRA adapters train with GRPO / RLOO only (algorithm "
                    "'grpo'); remove the lora block" for a in ("ppo", "dpo")},
}
_NOTES = {("ppo", f"loss.{n}"): " (GAE advantages from the critic: ppo.gamma, ppo.lam, ppo.whiten_advantages)"
          for n in ("advantage", "advantage_eps")}


# Fields that were merged or renamed: refused with what to write instead (`_renamed`).
# (loss.normalisation, loss.aggregation) -> loss.weighting; a PPO config had no aggregation (group_mean).
OLD_WEIGHTINGS = {("sequence_mean", "group_mean"): "sequence_mean", ("token_mean", "group_mean"): "group_token_mean",
                  ("constant", "group_mean"): "constant", ("token_mean", "step_token_mean"): "step_token_mean"}
RENAMED = ("loss.normalisation", "loss.aggregation")


def _renamed(loss: dict, algorithm: str) -> str:
  """The message refusing loss.normalisation / loss.aggregation (the fields of `loss`, a loss
  section's raw values): the loss.weighting value the pair meant, or that the pair never ran."""
  old = (loss.get("normalisation", "sequence_mean"), loss.get("aggregation", "group_mean"))
  given = " with ".join(f"loss.{k}={loss[k]!r}" for k in ("normalisation", "aggregation") if k in loss)
  remove = " and ".join(f"loss.{k}" for k in ("normalisation", "aggregation") if k in loss)
  new = OLD_WEIGHTINGS.get(old)
  if new is not None and not (algorithm == "ppo" and new == "step_token_mean"):
    return (f"{given}: the loss weighting is one field now, loss.weighting; write loss.weighting={new!r} and remove "
            f"{remove} (docs/design.md, \"Loss weightings\")")
  return (f"{given} never ran (step_token_mean needed normalisation token_mean; the normalisations were "
          f"sequence_mean, token_mean and constant); the loss weighting is one field now, loss.weighting, one of "
          f"{_weightings(algorithm)}: remove {remove} and set loss.weighting (docs/design.md, \"Loss weightings\")")


def _weightings(algorithm: str) -> tuple[str, ...]:
  return WEIGHTINGS if algorithm == "grpo" else tuple(w for w in WEIGHTINGS if w != "step_token_mean")


def _hints(cls) -> dict:
  return typing.get_type_hints(cls)


def _is_section(tp) -> bool:
  return dataclasses.is_dataclass(_unoptional(tp))


def _unoptional(tp):
  args = typing.get_args(tp)
  return next(a for a in args if a is not type(None)) if typing.get_origin(tp) is typing.Union else tp


def defaults(cls) -> dict:
  """{field: default} of a schema section's fields that have one (an experiment may leave them out;
  code that reads the config reads them here, never writing a default again)."""
  return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


def _names(cls, prefix: str = "") -> dict[str, bool]:
  """Dotted name -> whether it is a section, for every field of schema `cls`."""
  out = {}
  for name, tp in _hints(cls).items():
    out[prefix + name] = _is_section(tp)
    if _is_section(tp):
      out.update(_names(_unoptional(tp), f"{prefix}{name}."))
  return out


NAMES = {algorithm: _names(cls) for algorithm, cls in SCHEMAS.items()}


def fields(algorithm: str) -> list[tuple[str, str, str]]:
  """(dotted name, type, doc) of every leaf field of `algorithm`'s schema, in schema order."""
  def walk(cls, prefix):
    for f in dataclasses.fields(cls):
      tp = _hints(cls)[f.name]
      if _is_section(tp):
        yield from walk(_unoptional(tp), f"{prefix}{f.name}.")
      else:
        yield prefix + f.name, _type_name(tp), f.metadata["doc"]
  return list(walk(SCHEMAS[algorithm], ""))


def layouts(algorithm: str) -> dict[str, tuple[str, ...]]:
  """{dotted name: the rollout layouts it applies to ("group", "tree", "episode")} of every leaf field
  of `algorithm`'s schema that does not apply to every layout."""
  def walk(cls, prefix):
    for f in dataclasses.fields(cls):
      tp = _hints(cls)[f.name]
      if _is_section(tp):
        yield from walk(_unoptional(tp), f"{prefix}{f.name}.")
      elif f.metadata["layouts"] != LAYOUTS:
        yield prefix + f.name, f.metadata["layouts"]
  return dict(walk(SCHEMAS[algorithm], ""))


def algorithm_of(config: ml_collections.ConfigDict) -> str:
  """config.algorithm, which every experiment states; ValueError when it is missing or unknown."""
  if "algorithm" not in config:
    raise ValueError(f"config.algorithm is missing: every experiment states its algorithm, one of {ALGORITHMS} "
                     "(RLOO is 'grpo' with loss.advantage='rloo'); add e.g. c.algorithm = 'grpo' to the experiment's "
                     "get_config")
  algorithm = config.algorithm
  if algorithm not in ALGORITHMS:
    raise ValueError(f"algorithm={algorithm!r} is not one of {ALGORITHMS} (RLOO is 'grpo' with loss.advantage='rloo')")
  return algorithm


def parse(config: ml_collections.ConfigDict, expect: str | None = None):
  """The typed, frozen config of `config.algorithm` (GRPOExperiment, PPOExperiment or DPOExperiment).

  Args:
    expect: the algorithm the caller trains (its `validate`); another config.algorithm is refused.

  Raises:
    ValueError: naming the dotted field: config.algorithm missing or unknown (or not `expect`); a
      field the schema does not define (did you mean ...?) or another algorithm's (which one reads
      it); a value of the wrong type, or None where the field is no placeholder; a missing field
      without a default.
  """
  algorithm = algorithm_of(config)
  if expect is not None and algorithm != expect:
    raise ValueError(f"algorithm={algorithm!r} given to the {expect} trainer ({MODULES[expect]}); "
                     f"{MODULES[algorithm]} runs it (python -m branch_replay_jax.main dispatches on config.algorithm)")
  cls = SCHEMAS[algorithm]
  _refuse_unknown(cls, config, "", algorithm)   # first, everywhere: an old field's message before a missing one's
  return _build(cls, config, "", algorithm)


def _raw(node: ml_collections.ConfigDict) -> dict:
  """The node's fields, FieldReferences (placeholders) resolved, without `__getitem__` (see the module doc)."""
  out = {}
  for key, value in node.items(preserve_field_references=True):
    out[key] = value.get() if isinstance(value, ml_collections.FieldReference) else value
  return out


def _plain(node: ml_collections.ConfigDict) -> dict:
  """A free-form section (task.options) as a dict, read like `_raw` (not through `__getitem__`)."""
  return {k: _plain(v) if isinstance(v, ml_collections.ConfigDict) else v for k, v in _raw(node).items()}


def _refuse_unknown(cls, node, prefix: str, algorithm: str) -> None:
  hints = _hints(cls)
  for key, value in _raw(node).items():
    dotted = prefix + key
    if dotted in RENAMED and algorithm in ("grpo", "ppo"):
      raise ValueError(_renamed(_raw(node), algorithm))
    if key in hints:
      tp = _unoptional(hints[key])
      if dataclasses.is_dataclass(tp) and isinstance(value, ml_collections.ConfigDict):
        _refuse_unknown(tp, value, dotted + ".", algorithm)
      continue
    owners = [a for a in ALGORITHMS if a != algorithm and dotted in NAMES[a]]
    if owners:
      section = any(NAMES[a][dotted] for a in owners)
      template = _FOREIGN.get((algorithm, dotted))
      if template:
        raise ValueError(template.format(value=repr(value), algorithm=algorithm))
      shown = dotted if section else f"{dotted}={value!r}"
      raise ValueError(f"{shown} is a {' and '.join(a.upper() for a in owners)} {'section' if section else 'option'} "
                       f"({', '.join(MODULES[a] for a in owners)}) that the {algorithm.upper()} loop does not read"
                       f"{_NOTES.get((algorithm, dotted), '')}; remove the {'block' if section else 'field'}")
    where = f"the {prefix[:-1]} fields" if prefix else "the top-level fields and sections"
    close = difflib.get_close_matches(key, list(hints), n=1)
    hint = f"did you mean {prefix}{close[0]}?" if close else f"{where} are {', '.join(hints)}"
    raise ValueError(f"{dotted} is not a field of the {algorithm} config; {hint}")


def _build(cls, node, prefix: str, algorithm: str):
  raw, values = _raw(node), {}
  for f in dataclasses.fields(cls):
    dotted, tp = prefix + f.name, _hints(cls)[f.name]
    if f.name not in raw:
      if f.default is dataclasses.MISSING:
        raise ValueError(f"{dotted} is missing from the {algorithm} config ({_type_name(tp)}: "
                         f"{f.metadata['doc']}); set it in the experiment file")
      values[f.name] = f.default
      continue
    values[f.name] = _value(tp, raw[f.name], dotted, algorithm, f.default is not dataclasses.MISSING)
  return cls(**values)


def _value(tp, value, dotted: str, algorithm: str, optional: bool = False):
  """`value` checked against type `tp` (and converted: ConfigDict -> dataclass or dict, list -> tuple, int -> float)."""
  if typing.get_origin(tp) is typing.Union:   # Optional[X]: a placeholder
    return None if value is None else _value(_unoptional(tp), value, dotted, algorithm)
  if value is None:
    leave = " or remove it" if optional else ""
    raise ValueError(f"{dotted}=None: the field is no placeholder; set {_type_name(tp)}{leave}")
  ok = {bool: lambda v: isinstance(v, bool), int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), str: lambda v: isinstance(v, str),
        dict: lambda v: isinstance(v, (ml_collections.ConfigDict, dict))}
  origin = typing.get_origin(tp)
  if dataclasses.is_dataclass(tp):
    good = isinstance(value, ml_collections.ConfigDict)
  elif origin is tuple:
    good = isinstance(value, (tuple, list))
  else:
    good = ok[tp](value)
  if not good:
    raise ValueError(f"{dotted}={value!r} must be {_type_name(tp)}, not {type(value).__name__}")
  if dataclasses.is_dataclass(tp):
    return _build(tp, value, dotted + ".", algorithm)
  if origin is tuple:
    return tuple(_value(typing.get_args(tp)[0], v, f"{dotted}[{i}]", algorithm) for i, v in enumerate(value))
  if tp is dict:
    return _plain(value) if isinstance(value, ml_collections.ConfigDict) else dict(value)
  return float(value) if tp is float else value


def _type_name(tp) -> str:
  if typing.get_origin(tp) is typing.Union:
    return f"{_type_name(_unoptional(tp))} or None"
  if typing.get_origin(tp) is tuple:
    return f"a tuple of {_type_name(typing.get_args(tp)[0]).split(' ', 1)[1]}s"
  if dataclasses.is_dataclass(tp):
    return "a section (ConfigDict)"
  return {bool: "a bool", int: "an int", float: "a number (int or float)", str: "a str", dict: "a ConfigDict"}[tp]
