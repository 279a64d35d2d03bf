"""Config checks shared by the algorithms, run before anything loads: each raises ValueError naming
the field and its value. `validate_common` (model, optimizer, seed, run directory, task, sampling,
evaluation, LoRA) is every algorithm's; `validate` adds the rollout, update, loss and mesh checks
of GRPO and PPO; `validate_mesh_shape` is DPO's mesh check. Each algorithm adds its own fields'
checks (grpo.validate, ppo.validate, dpo.validate); the schema (algorithms/schema.py) has already
refused unknown fields and wrong types (a bool is no int), so the checks here are of ranges and
combinations."""

from __future__ import annotations

import jax

from branch_replay_jax import losses as obj
from branch_replay_jax.algorithms import placement, schema
from branch_replay_jax.correction import Correction
from branch_replay_jax.distributed import hosts
from branch_replay_jax.distributed.mesh import PARAM_MODES
from branch_replay_jax.distributed.sharding import EXPERT_AXES
from branch_replay_jax.gradients.step import PACKED, TREE_SCHEDULES
from branch_replay_jax.models import lora, tiny_config
from branch_replay_jax.models.config import EXPERT_MATMULS, GATED_DELTA_SCANS
from branch_replay_jax.outputs.checkpoints import check_run_dir_path
from branch_replay_jax.rollout.chat import HISTORIES
from branch_replay_jax.rollout.environments import environment_kind

GRADIENTS = ("replay", "naive")
SCHEDULES = ("constant", "cosine")
DTYPES = ("float32", "bfloat16")   # float16 is refused: no loss scaling, its 5-bit exponent overflows
TINY_MAX_POSITIONS = 2048          # context of model.name = "tiny" (build_model)


def check_number(name: str, value, ok, domain: str) -> None:
  """Raise ValueError "{name}={value!r} must be {domain}" unless value is a number (not a bool) with ok(value)."""
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
    raise ValueError(f"{name}={value!r} must be {domain}")


def validate_common(config) -> None:
  """Raise ValueError (naming the field and value) for the fields every algorithm shares, before
  anything loads: model (dtype, remat, attention), optimizer (learning rate, warmup, decay,
  clipping), seed, the run directory (resume, overwrite: not both; a run_dir that is a file or cannot
  be created or written, outputs.checkpoints.check_run_dir_path), task, sampling (temperature,
  top_p, stop_strings) and a completion budget longer than the model's context (read from the model's metadata,
  models.loading.context_length)."""
  from branch_replay_jax.kernels import ATTENTION_IMPLS
  from branch_replay_jax.models.llama import REMAT_POLICIES
  from branch_replay_jax.rollout.stop_strings import check_stop_strings
  from branch_replay_jax.rollout.tasks import TASKS, reasoning_gym_names
  m, t = config.model, config.train
  if m.dtype not in DTYPES:
    raise ValueError(f"model.dtype={m.dtype!r} is not one of {DTYPES} (float16 has no loss scaling here)")
  if m.param_dtype not in DTYPES:
    raise ValueError(f"model.param_dtype={m.param_dtype!r} is not one of {DTYPES}")
  if m.remat not in REMAT_POLICIES:
    raise ValueError(f"model.remat={m.remat!r} is not one of {REMAT_POLICIES}")
  if m.attention_impl not in ATTENTION_IMPLS:
    raise ValueError(f"model.attention_impl={m.attention_impl!r} is not one of {ATTENTION_IMPLS}")
  check_number("train.learning_rate", t.learning_rate, lambda v: 0 < v < float("inf"), "a finite number > 0")
  check_number("train.weight_decay", t.weight_decay, lambda v: 0 <= v < float("inf"), "a finite number >= 0")
  check_number("train.max_grad_norm", t.max_grad_norm, lambda v: 0 < v < float("inf"), "a finite number > 0")
  for name, value in [("train.warmup_steps", t.warmup_steps), ("seed", config.seed)]:
    if value < 0:
      raise ValueError(f"{name}={value!r} must be an int >= 0")
  if config.resume and config.overwrite:
    raise ValueError("resume=True and overwrite=True: continue the run in run_dir or delete it, not both")
  check_run_dir_path(config.run_dir)
  if "task" in config:
    k = config.task
    if not isinstance(k.name, str):
      raise ValueError(f"task.name={k.name!r} must be a str")
    # Without task.source the name is the reasoning-gym dataset (rollout/tasks/sources.py); with it, a label.
    if k.get("source") is None and k.name not in TASKS and k.name not in reasoning_gym_names():
      raise ValueError(f"task.name={k.name!r} is neither a preset {sorted(TASKS)} nor a reasoning-gym dataset "
                       "(rollout.tasks.reasoning_gym_names()); or set task.source (a file, 'python:module:name')")
    for name, value in [("task.size", k.size), ("task.seed", k.seed), ("task.few_shot", k.few_shot),
                        ("task.few_shot_seed", k.few_shot_seed)]:
      if value < (1 if name == "task.size" else 0):
        raise ValueError(f"{name}={value!r} must be an int >= {1 if name == 'task.size' else 0}")
    check_number("task.format_bonus", k.format_bonus, lambda v: 0 <= v < float("inf"), "a finite number >= 0")
  if "eval" in config:
    validate_eval(config)
  validate_layer_kinds(config)   # every algorithm and data source (DPO's pairs from a file have no rollout)
  if "rollout" in config:
    r = config.rollout
    # 0 would be greedy decoding: G identical completions, equal rewards, no advantage.
    check_number("rollout.temperature", r.temperature, lambda v: 0 < v < float("inf"), "a finite number > 0")
    check_number("rollout.top_p", r.top_p, lambda v: 0 < v <= 1, "in (0, 1]")
    check_stop_strings(r.get("stop_strings", ()))
    context = TINY_MAX_POSITIONS if m.name == "tiny" else model_context(m.name)
    episodes = r.get("episodes")
    if episodes is not None:   # an episode's budget is its whole context, prompt and observations included
      if isinstance(episodes.max_context, int) and episodes.max_context > context:
        raise ValueError(f"rollout.episodes.max_context={episodes.max_context} is longer than model {m.name!r}'s "
                         f"context of {context} tokens; it must be <= {context}")
      budget = None
    else:
      budget = r.segment_length * len(r.tree_fanouts) if r.get("tree_fanouts") else r.max_new_tokens
    if isinstance(budget, int) and budget >= context:
      field = (f"rollout.segment_length={r.segment_length} x depth len(rollout.tree_fanouts)={len(r.tree_fanouts)}"
               f" = {budget} completion tokens" if r.get("tree_fanouts") else f"rollout.max_new_tokens={budget}")
      raise ValueError(f"{field} leaves no room for a prompt in model {m.name!r}'s context of {context} tokens; "
                       f"it must be < {context}")
  validate_lora(config)


def validate_layer_kinds(config) -> None:
  """Raise ValueError, naming the field, where a model whose layers are not the Llama block's (read from its
  metadata) meets what those layers do not take. Sliding-window layers (Gemma 3): a Pallas kernel
  (model.attention_impl), the prompt split over mesh.seq (ring attention has no window), packed trees
  (`packs_trees`: their key ends take no window). Linear-attention layers (Qwen3.5): the
  prompt split over mesh.seq (the recurrent state would have to pass between seq devices), packed trees (the
  recurrence runs along a row). Mixtures of
  experts (Qwen3-MoE, Qwen3.5-MoE): with loss.router_aux_coef > 0 or model.routing_replay packed trees (both
  are built for trees by level), with model.routing_replay episodes whose history is "template" (a rewritten
  history is not what the sampler fed). A model without
  experts refuses loss.router_aux_coef > 0, model.routing_replay and model.expert_matmul other than
  'ragged_dot'; model.expert_matmul = 'pallas' is refused on a mesh. model.gated_delta_scan: one of
  GATED_DELTA_SCANS, other than 'xla' only for linear-attention layers. mesh.expert:
  one of the EXPERT_AXES, a model with experts, an axis of size > 1 that divides their count. Runs for every
  algorithm and data source."""
  m = config.model
  aux = config.loss.get("router_aux_coef", 0.0) if "loss" in config else 0.0   # GRPO's (DPO has no loss section)
  matmul = m.get("expert_matmul", "ragged_dot")
  if matmul not in EXPERT_MATMULS:
    raise ValueError(f"model.expert_matmul={matmul!r} is not one of {EXPERT_MATMULS}")
  arch = None if m.name == "tiny" else model_architecture(m.name)   # its metadata, read once
  moe = arch is not None and arch.moe
  if matmul != "ragged_dot" and not moe:
    raise ValueError(f"model.expert_matmul={matmul!r}: model.name={m.name!r} has no experts; leave it 'ragged_dot'")
  mesh = config.get("mesh")
  if matmul == "pallas" and mesh is not None and mesh.data * mesh.branch * mesh.seq > 1:
    raise ValueError(f"model.expert_matmul='pallas' on a mesh of {mesh.data} x {mesh.branch} x {mesh.seq}: the Pallas "
                     "grouped matmul runs on one device (not inside the mesh step's shard_map); use 'tiled'")
  scan = m.get("gated_delta_scan", "xla")
  if scan not in GATED_DELTA_SCANS:
    raise ValueError(f"model.gated_delta_scan={scan!r} is not one of {GATED_DELTA_SCANS}")
  if scan != "xla" and not (arch is not None and arch.hybrid):
    raise ValueError(f"model.gated_delta_scan={scan!r}: model.name={m.name!r} has no linear-attention layers; leave "
                     "it 'xla'")
  expert = placement.expert_axis(config)
  if expert:
    if expert not in EXPERT_AXES:
      raise ValueError(f"mesh.expert={expert!r} is not one of {EXPERT_AXES} (or '' for none)")
    if not moe:
      raise ValueError(f"mesh.expert={expert!r}: model.name={m.name!r} has no experts; leave it ''")
    n, e = mesh[expert], arch.num_experts
    if n == 1:
      raise ValueError(f"mesh.expert={expert!r}: mesh.{expert}=1 splits nothing (the experts would stay whole on "
                       f"every device); make mesh.{expert} > 1 or leave mesh.expert ''")
    if e % n:
      raise ValueError(f"mesh.expert={expert!r}: mesh.{expert}={n} must divide the model's {e} experts")
  if m.name == "tiny" and config.model.get("routing_replay", False):
    raise ValueError("model.routing_replay=True: model.name='tiny' has no experts; set it to False")
  if aux and not moe:
    raise ValueError(f"loss.router_aux_coef={aux}: model.name={m.name!r} has no experts (the load-balancing loss is "
                     "a mixture of experts'); set it to 0")
  if arch is None:
    return
  seq = config.get("mesh") is not None and config.mesh.seq > 1
  packed = packs_trees(config)
  replay = config.model.get("routing_replay", False)
  if replay and not arch.moe:
    raise ValueError(f"model.routing_replay=True: model.name={m.name!r} has no experts (routing replay replays a "
                     "mixture of experts' routes); set it to False")
  if arch.moe:
    episodes = config.rollout.get("episodes") if "rollout" in config else None
    why = ("rollout.episodes.history='template': model.routing_replay replays the routes of the ids the sampler "
           "fed, which a rewritten history no longer holds; use history='tokens'" if replay and episodes is not None
           and episodes.get("history", "tokens") == "template" else
           f"train.tree_schedule='packed': {'the load-balancing loss' if aux else 'routing replay'} is built for trees "
           "by level; use 'depth_first' or 'level'" if (aux or replay) and packed else None)
    if why:
      raise ValueError(f"model.name={m.name!r} is a mixture of experts: {why}")
  if arch.hybrid:
    why = (f"mesh.seq={config.mesh.seq}: the prompt split over seq would have to pass the recurrent state from "
           "device to device, which is not built; use mesh.data and mesh.branch" if seq else
           "train.tree_schedule='packed': the recurrence runs along a row; use 'depth_first' or 'level'"
           if packed else None)
    if why:
      raise ValueError(f"model.name={m.name!r} has linear-attention layers (Qwen3.5): {why}")
  if not arch.sliding:
    return
  family = "Gemma 4" if arch.gemma4 else "Gemma 3"
  why = (f"model.attention_impl={m.attention_impl!r}: no Pallas kernel takes a window yet; use 'xla'"
         if m.attention_impl not in ("xla", "auto") else
         f"mesh.seq={config.mesh.seq}: the prompt split over seq (ring attention) takes no window; use mesh.data and "
         "mesh.branch" if seq else
         "train.tree_schedule='packed': a packed row's key ends take no window; use 'depth_first' or 'level'"
         if packed else None)
  if why:
    raise ValueError(f"model.name={m.name!r} has sliding-window layers ({family}): {why}")


def model_architecture(name: str):
  """model.name's `models.loading.architecture` (its layer kinds and expert count, from its metadata alone).

  Raises:
    ValueError: naming model.name and its value, as `model_context`.
  """
  from branch_replay_jax.models.loading import architecture
  try:
    return architecture(name)
  except ValueError as e:
    raise ValueError(f"model.name={name!r}: {e}") from e


def model_context(name: str) -> int:
  """The context length (tokens) of model.name from its metadata alone (models.loading.context_length:
  the GGUF header, or a Hugging Face directory's config.json), no tensor read.

  Raises:
    ValueError: naming model.name and its value: an unknown name, a missing file, a directory
      without config.json, or an architecture (model_type) or option the decoder does not support.
  """
  from branch_replay_jax.models.loading import context_length
  try:
    return context_length(name)
  except ValueError as e:
    raise ValueError(f"model.name={name!r}: {e}") from e


def validate_eval(config) -> None:
  """Raise ValueError (naming the field and value) for a config.eval block that cannot run: sizes
  that are not ints (eval.size >= 0, 0 disables the evaluation; eval.every >= 1; eval.pass_k >= 0,
  0 skips the sampled pass@k), a task seed that is not an int >= 0 or equals task.seed (the
  evaluation would draw the training problems), or no config.task to draw problems from."""
  e = config.eval
  for name, value, low in [("eval.size", e.size, 0), ("eval.every", e.every, 1), ("eval.pass_k", e.pass_k, 0),
                           ("eval.task_seed", e.task_seed, 0)]:
    if value < low:
      raise ValueError(f"{name}={value!r} must be an int >= {low}")
  if "task" not in config:
    raise ValueError("eval: the held-out evaluation draws problems from config.task, which this config has not; "
                     "remove the eval block")
  if e.task_seed == config.task.seed:
    raise ValueError(f"eval.task_seed={e.task_seed!r} equals task.seed: the evaluation would draw the training "
                     "problems; choose another (rollout/tasks: item i of seed s is item i - 1 of seed s + 1, "
                     "so seeds at least task.size apart share no items)")


def packs_trees(config) -> bool:
  """Whether the run packs trees into rows (train.tree_schedule = 'packed' with the replay gradient on trees:
  rollout.tree_fanouts, or episodes shared as a tree); on groups, naive rows or DPO's pairs the field is inert."""
  t, r = config.train, config.get("rollout")
  if t.get("tree_schedule") != PACKED or t.get("gradient", "replay") != "replay" or r is None:
    return False
  episodes = r.get("episodes")
  return bool(r.get("tree_fanouts")) or (episodes is not None and _episodes_field(episodes, "share") == "tree")


def _episodes_field(episodes, name: str):
  """rollout.episodes.NAME, or the schema's default where the config leaves it out (not written again here)."""
  return episodes.get(name, schema.defaults(schema.EpisodesConfig)[name])


def validate(config) -> None:
  """Raise ValueError (naming the field and value) for rollout, update, loss-weight and mesh settings
  that cannot run, or that would be silently ignored, before any compute. Shared by GRPO and PPO;
  each adds its own loss fields, the clip range among them (grpo.validate, ppo.validate)."""
  validate_common(config)
  r, t, l = config.rollout, config.train, config.loss
  for name, value in [("rollout.prompts_per_step", r.prompts_per_step), ("train.steps", t.steps),
                      ("train.micro_batch", t.micro_batch), ("train.inner_epochs", t.inner_epochs),
                      ("checkpoint_every", config.checkpoint_every)]:
    if value < 1:
      raise ValueError(f"{name}={value!r} must be a positive int")
  if r.get("episodes") is not None:
    validate_episode_rollout(config)
  elif r.tree_fanouts:
    validate_tree_rollout(config)
  else:
    if r.segment_length:
      raise ValueError(f"rollout.segment_length={r.segment_length!r} applies to tree rollouts only and "
                       "rollout.tree_fanouts is empty; set it to 0")
    if r.max_new_tokens is None or r.max_new_tokens < 1:
      raise ValueError(f"rollout.max_new_tokens={r.max_new_tokens!r} must be a positive int")
    if r.group_size < 2:
      raise ValueError(f"rollout.group_size={r.group_size}: a group-relative advantage or baseline needs G >= 2")
    if r.group_size % t.micro_batch:
      # Groups have a fixed G; a micro-batch that does not divide it is a configuration mistake.
      raise ValueError(f"train.micro_batch={t.micro_batch} must divide rollout.group_size={r.group_size}")
  if t.gradient not in GRADIENTS:
    raise ValueError(f"train.gradient={t.gradient!r} is not one of {GRADIENTS}")
  if t.lr_schedule not in SCHEDULES:
    raise ValueError(f"train.lr_schedule={t.lr_schedule!r} is not one of {SCHEDULES}")
  if l.weighting not in obj.WEIGHTINGS:
    raise ValueError(f"loss.weighting={l.weighting!r} is not one of {obj.WEIGHTINGS}")
  if t.tree_schedule not in TREE_SCHEDULES:
    raise ValueError(f"train.tree_schedule={t.tree_schedule!r} is not one of {TREE_SCHEDULES}")
  if packs_trees(config):   # each tree one row with the tree as its attention mask (pack_trees)
    impl = config.model.attention_impl   # "auto" is the jnp attention on a CPU, kernels elsewhere
    why = ("PPO's critic needs a value per tree node" if config.algorithm == "ppo" else
           f"model.attention_impl={impl!r}: its kernels take no tree mask; use 'xla'"
           if impl not in ("xla", "auto") or (impl == "auto" and jax.default_backend() != "cpu") else
           "a mesh: packed rows run on one device" if validate_mesh_shape(config) else None)
    if why:
      raise ValueError(f"train.tree_schedule='packed' does not run here ({why}); use 'depth_first' or 'level'")
  validate_mesh(config)


def validate_tree_rollout(config) -> None:
  """Tree rollouts (rollout.tree_fanouts set): fan-outs and segment length, no group fields (a tree's
  trajectories are its leaves, its completions at most segment_length x depth tokens), and a
  train.micro_batch that divides the last fan-out (levels that EOS cut short, and the naive step's
  trajectories, use the largest divisor of their count not above it)."""
  r, t = config.rollout, config.train
  for name in ("group_size", "max_new_tokens"):
    if name in r:
      raise ValueError(f"rollout.{name}={r[name]!r} does not apply to tree rollouts (rollout.tree_fanouts="
                       f"{tuple(r.tree_fanouts)}): the tree's leaves are the group and rollout.segment_length x "
                       "depth bounds a completion; remove the field")
  if any(f < 1 for f in r.tree_fanouts) or r.segment_length < 1:
    raise ValueError(f"rollout.tree_fanouts={tuple(r.tree_fanouts)} needs ints >= 1 and rollout.segment_length="
                     f"{r.segment_length} >= 1")
  if r.tree_fanouts[-1] % t.micro_batch:
    raise ValueError(f"train.micro_batch={t.micro_batch} must divide the last fan-out rollout.tree_fanouts[-1]="
                     f"{r.tree_fanouts[-1]} (leaf siblings per scan step)")


def _lookup(config, dotted: str):
  """(present, value) of a dotted field of `config` (absent: a section or the field is missing)."""
  node = config
  for part in dotted.split("."):
    if node is None or part not in node:
      return False, None
    node = node[part]
  return True, node


def validate_episode_rollout(config) -> None:
  """Episode rollouts (rollout.episodes set; docs/design.md, "Episodes"): its budgets and environment,
  and no field that does not apply to episodes (`schema.layouts`): such a field is refused unless it
  holds its inert value (`schema.INERT`: segment_length 0, tree_fanouts (), overlong_buffer 0,
  stop_strings ()), and one without an inert value (rollout.max_new_tokens:
  an episode's turns have rollout.episodes.max_turn_tokens) must be absent. Also refused: task.few_shot
  (its examples answer without tools; rollout.episodes.few_shot shows tool calls), a mesh (episodes
  train on one device) and G < 2."""
  r, e = config.rollout, config.rollout.episodes
  for dotted, layouts in schema.layouts(config.algorithm).items():
    if "episode" in layouts:
      continue
    present, value = _lookup(config, dotted)
    value = tuple(value) if isinstance(value, list) else value
    if not present or (dotted in schema.INERT and value == schema.INERT[dotted]):
      continue
    fix = (f"set it to {schema.INERT[dotted]!r}" if dotted in schema.INERT else "remove the field")
    raise ValueError(f"{dotted}={value!r} does not apply to episodes (rollout.episodes is set; it applies to "
                     f"{' and '.join(layouts)} rollouts); {fix}")
  kind = environment_kind(e.environment)   # its form; the path resolves when the run builds it
  if kind != "builtin" and e.few_shot:
    raise ValueError(f"rollout.episodes.few_shot={e.few_shot!r} shows calculator conversations; with "
                     f"rollout.episodes.environment={e.environment!r} set it to 0")
  for name in ("max_turns", "max_turn_tokens", "max_context", "max_tool_calls"):
    if e[name] < 1:
      raise ValueError(f"rollout.episodes.{name}={e[name]!r} must be an int >= 1")
  if e.get("max_episode_tokens") is not None and e.max_episode_tokens < 1:
    raise ValueError(f"rollout.episodes.max_episode_tokens={e.max_episode_tokens!r} must be an int >= 1 or None")
  share, min_shared, depth = (_episodes_field(e, name) for name in ("share", "min_shared_tokens", "max_tree_depth"))
  if share not in schema.SHARES:
    raise ValueError(f"rollout.episodes.share={share!r} is not one of {schema.SHARES}")
  history = _episodes_field(e, "history")
  if history not in HISTORIES:
    raise ValueError(f"rollout.episodes.history={history!r} is not one of {HISTORIES}")
  if min_shared < 1:
    raise ValueError(f"rollout.episodes.min_shared_tokens={min_shared!r} must be an int >= 1")
  if depth < 1:
    raise ValueError(f"rollout.episodes.max_tree_depth={depth!r} must be an int >= 1")
  if e.few_shot < 0:
    raise ValueError(f"rollout.episodes.few_shot={e.few_shot!r} must be an int >= 0")
  if e.max_context <= e.max_turn_tokens:
    raise ValueError(f"rollout.episodes.max_context={e.max_context} leaves no room for a prompt beside one turn of "
                     f"rollout.episodes.max_turn_tokens={e.max_turn_tokens}; it must be larger")
  if config.task.few_shot:
    raise ValueError(f"task.few_shot={config.task.few_shot!r}: its examples answer without tools; with episodes set "
                     "task.few_shot=0 and rollout.episodes.few_shot (tool-using examples)")
  if r.group_size is None or r.group_size < 2:
    raise ValueError(f"rollout.group_size={r.group_size!r}: a group-relative advantage or baseline needs G >= 2 "
                     "episodes per problem")
  if config.get("eval") is not None and config.eval.size and config.eval.pass_k:
    raise ValueError(f"eval.pass_k={config.eval.pass_k!r} with rollout.episodes: the held-out evaluation runs one "
                     "greedy episode per problem; set eval.pass_k=0")
  processes = hosts.settings(config)["num_processes"]
  if processes != 1:
    raise ValueError(f"distributed.num_processes={processes!r} with rollout.episodes: episodes sample in one "
                     "process (one environment object); use one process, on a mesh of its devices if need be")


def validate_mesh(config) -> None:
  """Raise ValueError for a config.mesh the loop cannot run: `validate_mesh_shape`'s (sizes, device
  count, naive updates or splash attention on a mesh), and groups (trees), completions (first-level
  subtrees) or micro-batches that do not split evenly."""
  m, r, t = config.mesh, config.rollout, config.train
  if not validate_mesh_shape(config):
    return
  if r.prompts_per_step % m.data:
    raise ValueError(f"mesh.data={m.data} must divide rollout.prompts_per_step={r.prompts_per_step}")
  if r.get("episodes") is not None and r.episodes.share == "tree":
    return   # episode trees: the step pads each first fan-out to a multiple of mesh.branch (`pad_trees`)
  if r.get("episodes") is not None and _episodes_field(r.episodes, "history") == "template":
    raise ValueError("rollout.episodes.history='template' with rollout.episodes.share='prompt' on a mesh: a problem's "
                     "rows vary in number with the template's rewrites, and the mesh's group step splits equal groups "
                     "over mesh.branch; use rollout.episodes.share='tree' (the step pads each tree) or one device")
  if r.tree_fanouts:   # trees: first-level subtrees over `branch` (the step pads the sampled trees to one shape)
    f = tuple(r.tree_fanouts)
    if f[0] % m.branch:
      raise ValueError(f"mesh.branch={m.branch} must divide the first fan-out rollout.tree_fanouts[0] of "
                       f"rollout.tree_fanouts={f} (first-level subtrees are split over mesh.branch)")
    if len(f) == 1 and (f[0] // m.branch) % t.micro_batch:
      raise ValueError(f"train.micro_batch={t.micro_batch} must divide the leaf siblings per device, "
                       f"rollout.tree_fanouts[0] / mesh.branch = {f[0]} / {m.branch}")
    return
  if r.group_size % m.branch:
    raise ValueError(f"mesh.branch={m.branch} must divide rollout.group_size={r.group_size}")
  if (r.group_size // m.branch) % t.micro_batch:
    raise ValueError(f"train.micro_batch={t.micro_batch} must divide the completions per device, rollout.group_size "
                     f"/ mesh.branch = {r.group_size} / {m.branch}")


def validate_mesh_shape(config) -> bool:
  """Whether config.mesh is a mesh (data x branch x seq > 1); raise ValueError, naming the field, for
  sizes that are not positive ints or whose product (when > 1) is not the device count (with
  mesh.rollout_devices r > 0: the product + r, r a multiple of the process count; GRPO only), an unknown
  mesh.params, naive gradients or splash attention (TPU) on a mesh. Every algorithm's check (GRPO and PPO
  through `validate_mesh`; DPO, whose ragged groups are padded to the mesh, directly)."""
  m, t = config.mesh, config.train
  for name in ("data", "branch", "seq"):
    if m[name] < 1:
      raise ValueError(f"mesh.{name}={m[name]!r} must be a positive int")
  if m.params not in PARAM_MODES:
    raise ValueError(f"mesh.params={m.params!r} is not one of {PARAM_MODES}")
  n, r = m.data * m.branch * m.seq, placement.rollout_device_count(config)
  if isinstance(r, bool) or not isinstance(r, int) or r < 0:
    raise ValueError(f"mesh.rollout_devices={r!r} must be an int >= 0 (0: the sampler runs on the training devices)")
  if r:
    if config.algorithm != "grpo":
      raise ValueError(f"mesh.rollout_devices={r} with algorithm={config.algorithm!r}: a rollout sub-mesh samples "
                       "for GRPO only; set mesh.rollout_devices=0")
    processes = max(hosts.settings(config)["num_processes"], jax.process_count())
    if r % processes:
      raise ValueError(f"mesh.rollout_devices={r} with {processes} processes: each process keeps an equal share of its "
                       f"devices for the sampler; use a multiple of {processes}")
    if n + r != jax.device_count():
      raise ValueError(f"mesh.data x mesh.branch x mesh.seq + mesh.rollout_devices = {n} + {r} must equal the device "
                       f"count {jax.device_count()} (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count={n + r})")
  if n == 1:
    return False
  if not r and n != jax.device_count():
    raise ValueError(f"mesh.data x mesh.branch x mesh.seq = {m.data} x {m.branch} x {m.seq} = {n} must equal the "
                     f"device count {jax.device_count()} (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count={n})")
  if t.gradient != "replay":
    raise ValueError(f"train.gradient={t.gradient!r}: the mesh step is replay only; use 'replay' or a 1x1x1 mesh")
  impl = config.model.attention_impl
  if impl == "splash" or (impl in ("pallas", "auto") and jax.default_backend() == "tpu"):
    # The Triton kernels state their outputs' mesh-varying types (kernels/vma.py) and run inside the
    # step's shard_map; JAX's splash kernels (TPU) build theirs without, which check_vma refuses.
    raise ValueError(f"model.attention_impl={impl!r}: splash attention (the TPU kernels, from JAX) does not trace "
                     "inside the mesh step's shard_map (check_vma: its pallas_call outputs state no varying mesh "
                     "axes); use 'xla' or a 1x1x1 mesh")
  return True


def lora_spec(config, model_config=None) -> lora.LoraSpec:
  """config.lora's `models.lora.LoraSpec`, checked against the model's shapes (`model_config`, or
  read from the model's metadata: models.loading.architecture; "tiny": tiny_config).

  Raises:
    ValueError: a bad lora.rank, lora.alpha or lora.targets (models.lora.check_spec).
  """
  from branch_replay_jax.models.loading import architecture
  if model_config is None:
    model_config = tiny_config() if config.model.name == "tiny" else architecture(config.model.name)
  c = config.lora
  return lora.check_spec(c.rank, c.alpha, c.targets, model_config)


def validate_lora(config) -> None:
  """Raise ValueError (naming the field and value) for a config.lora block (LoRA adapters,
  models/lora.py; absent: full fine-tuning) that cannot run: its fields (`lora_spec`: rank,
  alpha, targets against the model's shapes; dropout must be 0). On a mesh the base is placed like
  the parameters (mesh.params) and the adapters alone are differentiated. Another algorithm
  than GRPO / RLOO (PPO's critic and DPO's steps differentiate the whole parameter tree) is refused
  by `schema.parse` (lora is a field of the grpo schema only)."""
  if config.get("lora") is None:
    return
  d = config.lora.dropout
  if d != 0:
    raise ValueError(f"lora.dropout={d!r}: only 0 is supported (replay, the naive step and the reference pass must "
                     "compute one deterministic function of the adapters)")
  lora_spec(config)


CORRECTION_FIELDS = ("rollout_correction", "rollout_correction_level", "rollout_is_cap", "rollout_is_floor")


def correction_fields(config) -> dict:
  """{field: (value, schema default)} of loss.rollout_correction's fields, a field left out at its default."""
  defaults = schema.defaults(schema.CorrectionConfig)
  return {name: (config.loss.get(name, defaults[name]), defaults[name]) for name in CORRECTION_FIELDS}


def rollout_correction(config) -> Correction:
  """loss.rollout_correction's settings (`Correction` checks them): GRPO's and PPO's."""
  return Correction(*(value for value, _ in correction_fields(config).values()))


def validate_correction(config) -> None:
  """Raise ValueError (naming the field and value) for loss.rollout_correction's fields (`Correction`), a
  field the mode does not read set away from its default (the cap and level without a correction, the
  floor but for icepop). The sampler records its log-probs at the trainer's τ (`groups.logprob_temperature`),
  so a correction compares like with like at any loss.logprob_temperature."""
  c, fields = rollout_correction(config), correction_fields(config)
  unread = (CORRECTION_FIELDS[1:] if not c.active else () if c.mode == "icepop" else ("rollout_is_floor",))
  for name in unread:
    value, default = fields[name]
    if value != default:
      raise ValueError(f"loss.{name}={value!r} is not read with loss.rollout_correction={c.mode!r}; remove it or "
                       f"set it to {default!r}")
