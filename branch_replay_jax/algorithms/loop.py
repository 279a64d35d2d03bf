"""The one training loop of every algorithm (GRPO / RLOO, PPO, DPO) and the bookkeeping it owns.

    start_run ─► setup ─► [eval] ─► for step: collect (sample, score) ─► update ─► log ─► [eval] ─► checkpoint
                                                                                              ─► plots

An algorithm plugs in as an `Algorithm` (algorithms/grpo.py, ppo.py, dpo.py): it supplies its
batch (`collect`), its update (`update`, built on the one jitted optimizer step `make_update`) and
its metrics record (`log`); the loop owns run setup, resume, timing, the held-out evaluation
(`Evaluation`, config.eval), checkpoints and plots. Everything a run writes goes to RUN_DIR:
metrics.jsonl, samples.jsonl, eval.jsonl, TensorBoard event files (events.out.tfevents.*, one
scalar per metric: train/NAME for metrics.jsonl, eval/NAME for eval.jsonl), plots, experiment.json
and checkpoints/ (orbax).

Wall-clock: each metrics record's `wall_s` is the run's training seconds so far: from the start of
the first step to the end of this step's update, evaluations left out, continued across a resume
(the resumed run starts from the checkpointed step's wall_s in metrics.jsonl). Start-up (model
load, the step-0 evaluation) is not counted; compiles inside steps are. Each eval.jsonl row
carries the wall_s of its step, so held-out accuracy plots against training time alike in replay
and naive mode whatever the evaluation costs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from branch_replay_jax import losses as obj
from branch_replay_jax.core.tree_replay import SCHEDULES as TREE_SCHEDULES
from branch_replay_jax.distributed import hosts
from branch_replay_jax.distributed.mesh import (PARAM_MODES, make_mesh, pad_prompts, shard_batch, shard_params,
                                                stack_groups)
from branch_replay_jax.models import Llama, lora, tiny_config
from branch_replay_jax.outputs import plots
from branch_replay_jax.outputs.checkpoints import (RunCheckpoints, check_run_dir, check_run_dir_path, config_changes,
                                                  open_run_dir, write_run_record)
from branch_replay_jax.outputs.tensorboard import ScalarWriter
from branch_replay_jax.rollout import evaluate as held_out
from branch_replay_jax.rollout.collect import Group, completion_budget, rollout
from branch_replay_jax.rollout.tasks import make_task

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
  top_p) and a completion budget longer than the model's context (read from the model's metadata,
  models.loading.context_length)."""
  from branch_replay_jax.kernels import ATTENTION_IMPLS
  from branch_replay_jax.models.llama import REMAT_POLICIES
  from branch_replay_jax.models.loading import context_length
  from branch_replay_jax.rollout.tasks import TASKS
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
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
      raise ValueError(f"{name}={value!r} must be an int >= 0")
  for name in ("resume", "overwrite"):
    if not isinstance(config[name], bool):
      raise ValueError(f"{name}={config[name]!r} must be a bool")
  if config.resume and config.overwrite:
    raise ValueError("resume=True and overwrite=True: continue the run in run_dir or delete it, not both")
  check_run_dir_path(config.run_dir)
  if "task" in config:
    k = config.task
    if k.name not in TASKS:
      raise ValueError(f"task.name={k.name!r} is not one of {sorted(TASKS)}")
    for name, value in [("task.size", k.size), ("task.seed", k.seed), ("task.few_shot", k.few_shot),
                        ("task.few_shot_seed", k.few_shot_seed)]:
      if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "task.size" else 0):
        raise ValueError(f"{name}={value!r} must be an int >= {1 if name == 'task.size' else 0}")
    check_number("task.format_bonus", k.format_bonus, lambda v: 0 <= v < float("inf"), "a finite number >= 0")
    if not isinstance(k.strict_answer, bool):
      raise ValueError(f"task.strict_answer={k.strict_answer!r} must be a bool")
  if "eval" in config:
    validate_eval(config)
  if "rollout" in config:
    r = config.rollout
    # 0 would be greedy decoding: G identical completions, equal rewards, no advantage.
    check_number("rollout.temperature", r.temperature, lambda v: 0 < v < float("inf"), "a finite number > 0")
    check_number("rollout.top_p", r.top_p, lambda v: 0 < v <= 1, "in (0, 1]")
    budget = r.segment_length * len(r.tree_fanouts) if r.get("tree_fanouts") else r.max_new_tokens
    context = TINY_MAX_POSITIONS if m.name == "tiny" else context_length(m.name)
    if isinstance(budget, int) and budget >= context:
      field = (f"rollout.segment_length={r.segment_length} x depth len(rollout.tree_fanouts)={len(r.tree_fanouts)}"
               f" = {budget} completion tokens" if r.get("tree_fanouts") else f"rollout.max_new_tokens={budget}")
      raise ValueError(f"{field} leaves no room for a prompt in model {m.name!r}'s context of {context} tokens; "
                       f"it must be < {context}")
  validate_lora(config)


def validate_eval(config) -> None:
  """Raise ValueError (naming the field and value) for a config.eval block that cannot run: sizes
  that are not ints (eval.size >= 0, 0 disables the evaluation; eval.every >= 1; eval.pass_k >= 0,
  0 skips the sampled pass@k), a task seed that is not an int >= 0 or equals task.seed (the
  evaluation would draw the training problems), or no config.task to draw problems from."""
  e = config.eval
  for name, value, low in [("eval.size", e.size, 0), ("eval.every", e.every, 1), ("eval.pass_k", e.pass_k, 0),
                           ("eval.task_seed", e.task_seed, 0)]:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
      raise ValueError(f"{name}={value!r} must be an int >= {low}")
  if "task" not in config:
    raise ValueError("eval: the held-out evaluation draws problems from config.task, which this config has not; "
                     "remove the eval block")
  if e.task_seed == config.task.seed:
    raise ValueError(f"eval.task_seed={e.task_seed!r} equals task.seed: the evaluation would draw the training "
                     "problems; choose another (rollout/tasks: item i of seed s is item i - 1 of seed s + 1, "
                     "so seeds at least task.size apart share no items)")


def validate(config) -> None:
  """Raise ValueError (naming the field and value) for rollout, update, loss-weight and mesh settings
  that cannot run, or that would be silently ignored, before any compute. Shared by GRPO and PPO;
  each adds its own loss fields, the clip range among them (grpo.validate, ppo.validate)."""
  validate_common(config)
  r, t, l = config.rollout, config.train, config.loss
  for name, value in [("rollout.prompts_per_step", r.prompts_per_step), ("train.steps", t.steps),
                      ("train.micro_batch", t.micro_batch), ("train.inner_epochs", t.inner_epochs),
                      ("checkpoint_every", config.checkpoint_every)]:
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"{name}={value!r} must be a positive int")
  if r.tree_fanouts:
    validate_tree_rollout(config)
  else:
    if r.segment_length:
      raise ValueError(f"rollout.segment_length={r.segment_length!r} applies to tree rollouts only and "
                       "rollout.tree_fanouts is empty; set it to 0")
    if not isinstance(r.max_new_tokens, int) or r.max_new_tokens < 1:
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
  if l.normalisation not in obj.NORMALISATIONS:
    raise ValueError(f"loss.normalisation={l.normalisation!r} is not one of {obj.NORMALISATIONS}")
  if t.tree_schedule not in TREE_SCHEDULES:
    raise ValueError(f"train.tree_schedule={t.tree_schedule!r} is not one of {TREE_SCHEDULES}")
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
  if any(not isinstance(f, int) or f < 1 for f in r.tree_fanouts) or r.segment_length < 1:
    raise ValueError(f"rollout.tree_fanouts={tuple(r.tree_fanouts)} needs ints >= 1 and rollout.segment_length="
                     f"{r.segment_length} >= 1")
  if r.tree_fanouts[-1] % t.micro_batch:
    raise ValueError(f"train.micro_batch={t.micro_batch} must divide the last fan-out rollout.tree_fanouts[-1]="
                     f"{r.tree_fanouts[-1]} (leaf siblings per scan step)")


def validate_mesh(config) -> None:
  """Raise ValueError for a config.mesh the loop cannot run: `validate_mesh_shape`'s (sizes, device
  count, naive updates or Pallas attention on a mesh), and groups (trees), completions (first-level
  subtrees) or micro-batches that do not split evenly."""
  m, r, t = config.mesh, config.rollout, config.train
  if not validate_mesh_shape(config):
    return
  if r.prompts_per_step % m.data:
    raise ValueError(f"mesh.data={m.data} must divide rollout.prompts_per_step={r.prompts_per_step}")
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
  sizes that are not positive ints or whose product (when > 1) is not the device count, an unknown
  mesh.params, naive gradients or Pallas attention on a mesh. Every algorithm's check (GRPO and PPO
  through `validate_mesh`; DPO, whose ragged groups are padded to the mesh, directly)."""
  m, t = config.mesh, config.train
  for name in ("data", "branch", "seq"):
    if not isinstance(m[name], int) or m[name] < 1:
      raise ValueError(f"mesh.{name}={m[name]!r} must be a positive int")
  if m.params not in PARAM_MODES:
    raise ValueError(f"mesh.params={m.params!r} is not one of {PARAM_MODES}")
  n = m.data * m.branch * m.seq
  if n == 1:
    return False
  if n != jax.device_count():
    raise ValueError(f"mesh.data x mesh.branch x mesh.seq = {m.data} x {m.branch} x {m.seq} = {n} must equal the "
                     f"device count {jax.device_count()} (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count={n})")
  if t.gradient != "replay":
    raise ValueError(f"train.gradient={t.gradient!r}: the mesh step is replay only; use 'replay' or a 1x1x1 mesh")
  impl = config.model.attention_impl
  if impl in ("pallas", "splash") or (impl == "auto" and jax.default_backend() != "cpu"):
    raise ValueError(f"model.attention_impl={impl!r}: the Pallas kernels do not compile inside the mesh step's "
                     "shard_map (check_vma); use 'xla' or a 1x1x1 mesh")
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
  alpha, targets against the model's shapes; dropout must be 0) and the option LoRA cannot honour
  here: a device mesh (the mesh step differentiates and shards the whole tree). Another algorithm
  than GRPO / RLOO (PPO's critic and DPO's steps differentiate the whole parameter tree) is refused
  by `schema.parse` (lora is a field of the grpo schema only)."""
  if config.get("lora") is None:
    return
  m = config.mesh
  if m.data * m.branch * m.seq != 1:
    raise ValueError(f"lora is set with mesh.data x mesh.branch x mesh.seq = {m.data} x {m.branch} x {m.seq}: the "
                     "mesh step differentiates the whole parameter tree; LoRA runs on a 1 x 1 x 1 mesh")
  d = config.lora.dropout
  if d != 0:
    raise ValueError(f"lora.dropout={d!r}: only 0 is supported (replay, the naive step and the reference pass must "
                     "compute one deterministic function of the adapters)")
  lora_spec(config)


def mesh_from(config):
  """The ("data", "branch", "seq") mesh of config.mesh, or None for 1 x 1 x 1 (one device).

  Raises:
    ValueError: with several processes, a `data` row spanning processes (hosts.check_rows_local).
  """
  m = config.mesh
  if m.data * m.branch * m.seq == 1:
    return None
  mesh = make_mesh(m.data, m.branch, m.seq)
  if jax.process_count() > 1:
    hosts.check_rows_local(mesh)
  return mesh


# Where an algorithm's update runs: one device (mesh None) or config.mesh's mesh (`mesh_from`).

def place(tree, mesh, mode: str):
  """Parameters or optimizer state onto `mesh` in layout `mode` (mesh.params: distributed.mesh.shard_params);
  unchanged without a mesh."""
  return tree if mesh is None else shard_params(tree, mesh, mode)


def sampling_devices(mesh, num_groups: int):
  """None without a mesh (every group samples on this process's default device), else [num_groups]
  the device that samples each of a step's groups (`hosts.sampling_devices`: on its `data` row)."""
  return None if mesh is None else hosts.sampling_devices(mesh, num_groups)


def spread_devices(mesh, num_items: int):
  """None without a mesh, else [num_items] the device of each of independent items (held-out
  problems, DPO's prompts): `hosts.spread_devices`, every device of the mesh, the processes in turn."""
  return None if mesh is None else hosts.spread_devices(mesh, num_items)


def sampling_policy(graphdef, params, mesh, devices, select=None):
  """The policy the sampler runs, from `params` as the update holds them (cast by the caller):
  without `devices`, the model nnx.merge(graphdef, params) where the parameters lie; with
  `devices` ([n] from `sampling_devices` or `eval_devices`, on `mesh`), {device: the model on a
  full copy of the parameters on that device} for this process's devices (`hosts.device_copies`:
  FSDP parameters all-gathered once, a collective every process joins). `select` picks the module
  that samples out of the merged one (PPO: the actor-critic's `.policy`); default the model itself."""
  select = select or (lambda model: model)
  if devices is None:
    return select(nnx.merge(graphdef, params))
  mine = [d for d in devices if d.process_index == jax.process_index()]
  with jax.set_mesh(mesh):
    copies = hosts.device_copies(params, mesh, mine)
  return {d: select(nnx.merge(graphdef, p)) for d, p in copies.items()}


def on_mesh(batches: list, mesh):
  """Group batches of one completion shape as one batch on `mesh`: prompts padded to one length
  (a multiple of mesh.seq: distributed.mesh.pad_prompts), stacked [B, ...] and placed (shard_batch).
  With several processes every process passes the same, whole batch and places its own rows."""
  return shard_batch(stack_groups(pad_prompts(batches, mesh.shape["seq"])), mesh)


def mesh_context(mesh):
  """`jax.set_mesh(mesh)` (the mesh's Explicit axes need it around its steps), or a no-op context without a mesh."""
  return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def build_model(config):
  """(model, tokenizer). "tiny" is a random 2-layer model over SmolLM2's real tokenizer. With
  config.lora the model carries LoRA adapters (models.lora.add_adapters: B = 0, so it computes the
  loaded model until trained; A drawn from config.seed)."""
  from branch_replay_jax.models.loading import load, load_tokenizer
  dtype = jnp.dtype(config.model.dtype)
  if config.model.name == "tiny":
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    cfg = tiny_config(vocab_size=len(tokenizer), max_positions=TINY_MAX_POSITIONS)
    model = Llama(cfg, dtype=dtype, remat=config.model.remat, attention_impl=config.model.attention_impl,
                  rngs=nnx.Rngs(config.seed))
  else:
    model, tokenizer = load(config.model.name, dtype=dtype, remat=config.model.remat,
                            attention_impl=config.model.attention_impl)
  if config.get("lora") is not None:
    rngs = nnx.Rngs(params=jax.random.fold_in(jax.random.key(config.seed), 1))
    lora.add_adapters(model, lora_spec(config, model.config), rngs=rngs)
  return model, tokenizer


def param_casts(config):
  """(cast, upcast) for model.param_dtype's mixed-precision scheme (docs/design.md, "Parameter dtype").

  The loop's parameters and optimizer state stay float32 (the master copy, Micikevicius et al.
  2018, arXiv 1710.03740, section 3.1); every gradient or log-prob step sees cast(params), the
  parameters rounded to model.param_dtype, so on a mesh the FSDP all-gathers and gradient
  reduce-scatters move that dtype; upcast(grads) returns the gradients to float32 for the update.
  Identities for "float32".
  """
  dtype = jnp.dtype(config.model.param_dtype)
  if dtype == jnp.float32:
    return (lambda p: p), (lambda g: g)
  cast = lambda tree, d: jax.tree_util.tree_map(lambda x: x.astype(d) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                                                tree)
  return (lambda p: cast(p, dtype)), (lambda g: cast(g, jnp.float32))


def make_optimizer(config) -> optax.GradientTransformation:
  t = config.train
  if t.lr_schedule == "cosine":
    lr = optax.warmup_cosine_decay_schedule(0.0, t.learning_rate, max(t.warmup_steps, 1), max(t.steps, 2),
                                            end_value=0.1 * t.learning_rate)
  else:
    lr = optax.join_schedules([optax.linear_schedule(0.0, t.learning_rate, t.warmup_steps),
                               optax.constant_schedule(t.learning_rate)], [t.warmup_steps])
  return optax.chain(optax.clip_by_global_norm(t.max_grad_norm), optax.adamw(lr, weight_decay=t.weight_decay))


def fingerprint(config) -> dict:
  """Fields that define an experiment: a run dir's checkpoints must belong to the same ones."""
  r = config.rollout
  shape = ({"tree_fanouts": list(r.tree_fanouts), "segment_length": r.segment_length} if r.tree_fanouts else
           {"group_size": r.group_size})
  adapters = {} if config.get("lora") is None else {"lora": {"rank": config.lora.rank, "alpha": config.lora.alpha,
                                                             "targets": list(config.lora.targets)}}
  return {"model": config.model.name, "task": config.task.name, "task_seed": config.task.seed, **shape,
          "prompts_per_step": r.prompts_per_step, "seed": config.seed, **adapters}


def make_update(optimizer: optax.GradientTransformation):
  """The one optimizer step of every algorithm: jitted (params, opt_state, grads) -> (params,
  opt_state, global gradient norm). It donates params and opt_state (their buffers are reused
  for the new ones): the caller must not read the arrays it passed in afterwards; grads are not
  donated (the caller may still hold them)."""
  def update(params, opt_state, grads):
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, optax.tree.norm(grads)
  return jax.jit(update, donate_argnums=(0, 1))


class Algorithm:
  """What an algorithm plugs into `train`. Subclasses set `name` (the progress bar's label) and
  `keep_initial` (a frozen copy of the initial parameters as `run.initial_params`: the reference
  policy; not made with LoRA, whose reference is the base: adapters off), and override the methods below; `validate` runs in the constructor."""

  name = "algorithm"
  keep_initial = False

  def __init__(self, config):
    self.config = config

  def fingerprint(self) -> dict:
    """Fields that define the experiment (outputs.checkpoints.check_run_dir)."""
    return fingerprint(self.config)

  def make_optimizer(self) -> optax.GradientTransformation:
    return make_optimizer(self.config)

  def wrap(self, model):
    """The module whose parameters train (default: the model itself; PPO: an actor-critic)."""
    return model

  def setup(self, run: "Run") -> tuple[Any, Any]:
    """(params, opt_state) to start from, placed where the update runs; builds the jitted steps."""
    return run.params, run.opt_state

  def collect(self, run: "Run", params, step: int, data_pos: int) -> tuple[Any, int]:
    """(the step's batch: rollouts or pairs, the next data position)."""
    raise NotImplementedError

  def update(self, params, opt_state, batch, step: int) -> tuple[Any, Any, dict]:
    """(params, opt_state, stats) after the step's optimizer updates on `batch`."""
    raise NotImplementedError

  def log(self, bar, step: int, batch, stats: dict, *, rollout_s: float, update_s: float, wall_s: float) -> dict:
    """Write the step's record (metrics.jsonl, samples.jsonl) with `wall_s` (the run's training
    seconds so far, module docstring) and return it."""
    raise NotImplementedError

  def training_items(self) -> int:
    """How many data positions the run can draw, 0 .. training_items() - 1 (the held-out
    evaluation excludes their questions): train.steps x rollout.prompts_per_step. An algorithm
    that draws more prompts per step than that must say so here."""
    return self.config.train.steps * self.config.rollout.prompts_per_step

  def eval_policy(self, run: "Run", params, num_problems: int) -> tuple[Any, list | None]:
    """(policy, devices) the held-out evaluation samples with: the model of `params` and None (every
    problem on this process's default device), or {device: model} and [num_problems] the device of
    each problem (rollout.evaluate.evaluate)."""
    return nnx.merge(run.graphdef, params), None

  def write_plots(self) -> None:
    plots.write_plots(self.config.run_dir)


def check_processes(config) -> None:
  """Raise ValueError when the processes this one belongs to differ from config.distributed's
  (`hosts.settings`: a run of several processes starts through `hosts.initialize`, as main.py
  does)."""
  n = hosts.settings(config)["num_processes"]
  if n != jax.process_count():
    raise ValueError(f"distributed.num_processes={n} but this is one of {jax.process_count()} processes: start the run "
                     "through branch_replay_jax.main (it calls distributed.hosts.initialize(config) first)")


def train(config, algorithm: Algorithm) -> list[dict]:
  """Run `algorithm` for config.train.steps steps (resuming when config.resume); returns this run's records.
  With several processes (distributed/hosts.py) every process calls it; process 0 writes the logs.
  With config.eval.size > 0 it evaluates on held-out problems (`Evaluation`) at step 0, every
  eval.every steps and at the end."""
  check_processes(config)
  evaluation = Evaluation(config, algorithm) if config.get("eval") and config.eval.size else None
  run = start_run(config, algorithm.fingerprint(), optimizer_fn=lambda _: algorithm.make_optimizer(),
                  wrap=algorithm.wrap, keep_initial=algorithm.keep_initial)
  params, opt_state = algorithm.setup(run)
  data_pos, history = run.data_pos, []
  writer = ScalarWriter(config.run_dir, start=run.start) if hosts.is_primary() else None
  clock = Stopwatch(resumed_wall_s(config.run_dir, run.start))
  bar = run.progress(config, algorithm.name)
  try:
    if evaluation is not None and run.start == 0:
      # A resumed run evaluated its checkpointed step before saving it (below).
      with clock.paused():
        evaluation.run(algorithm, run, params, 0, clock.seconds(), writer)
    for step in bar:
      t0 = time.perf_counter()
      batch, data_pos = algorithm.collect(run, params, step, data_pos)
      t1 = time.perf_counter()
      params, opt_state, stats = algorithm.update(params, opt_state, batch, step)
      t2 = time.perf_counter()
      record = algorithm.log(bar, step, batch, stats, rollout_s=t1 - t0, update_s=t2 - t1, wall_s=clock.seconds())
      history.append(record)
      if writer is not None:
        writer.write("train", record)
      if evaluation is not None and evaluation.due(step + 1):
        with clock.paused():
          evaluation.run(algorithm, run, params, step + 1, clock.seconds(), writer)
      save_if_due(config, run.ckpt, step, params, opt_state, run.key, data_pos)
  finally:
    run.ckpt.close()   # the last asynchronous save lands on disk, also when a step raised
    if writer is not None:
      writer.close()
  if hosts.is_primary():
    algorithm.write_plots()
  return history


class Stopwatch:
  """The run's training wall-clock (module docstring): seconds since construction plus `offset`,
  less the spans inside `paused()` (evaluations)."""

  def __init__(self, offset: float = 0.0):
    self.start, self.offset, self.left_out = time.perf_counter(), offset, 0.0

  def seconds(self) -> float:
    return self.offset + time.perf_counter() - self.start - self.left_out

  @contextlib.contextmanager
  def paused(self):
    t = time.perf_counter()
    try:
      yield
    finally:
      self.left_out += time.perf_counter() - t


def resumed_wall_s(run_dir: str, start: int) -> float:
  """wall_s of metrics.jsonl's record of step `start` (0.0 for a fresh run, or a record without
  one), read by process 0 and shared with every process (a collective)."""
  value = 0.0
  if hosts.is_primary() and start:
    value = next((r.get("wall_s", 0.0) for r in plots.read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
                  if r["step"] == start), 0.0)
  return float(hosts.allgather_objects(value)[0])


# fold_in tag of the evaluation's keys ("eval" in ASCII): training keys fold in the step first, and
# no run reaches step 1.7e9, so the two streams never share a key.
EVAL_STREAM = 0x6576616C


class Evaluation:
  """A run's held-out evaluation (config.eval; rollout/evaluate.py): eval.size problems of the task
  at seed eval.task_seed, none of whose questions a training item asks (`heldout_problems` against
  the algorithm's `training_items()`), chosen once when the run starts. `run` answers every one
  greedily and with eval.pass_k samples (the run's temperature, top-p and completion budget) and
  appends a row to RUN_DIR/eval.jsonl:

    {"step", "wall_s", "eval_s", "problems", "dropped_overlaps", "accuracy", "accuracy_lo",
     "accuracy_hi", "reward_mean", "format_rate", "completion_len_mean"
     [, "pass_k", "pass_at_k", "sampled_accuracy"]}   (rollout.evaluate.summarize)

  Every evaluation uses the same keys (common random numbers: the pass@k of two steps differ by
  the policy, not by fresh sampling noise), and none of the training's, so a run with evaluation
  trains exactly as one without. On a mesh the problems spread over every device
  (`hosts.spread_devices`) and the results are gathered, so every process logs the same row.

  Raises (constructor):
    ValueError: fewer than eval.size held-out problems among the first 10 x eval.size +
      training_items() of the evaluation seed.
  """

  def __init__(self, config, algorithm: Algorithm):
    e = config.eval
    self.config, self.every, self.pass_k = config, e.every, e.pass_k
    items = algorithm.training_items()
    self.task = make_task_from(config, seed=e.task_seed, size=10 * e.size + items)
    self.problems, self.dropped = held_out.heldout_problems(algorithm.task, self.task, size=e.size,
                                                            training_items=items)

  def due(self, step: int) -> bool:
    """True at step 0, every eval.every steps and at train.steps (steps counted as in metrics.jsonl)."""
    return step == 0 or step % self.every == 0 or step == self.config.train.steps

  def run(self, algorithm: Algorithm, run: "Run", params, step: int, wall_s: float, writer=None) -> dict:
    """Evaluate `params` (after `step` updates); process 0 appends the row to eval.jsonl and
    `writer` (TensorBoard, eval/NAME). Returns the row (the same on every process)."""
    t0 = time.perf_counter()
    r = self.config.rollout
    policy, devices = algorithm.eval_policy(run, params, len(self.problems))
    results = held_out.evaluate(policy, run.tokenizer, self.task, self.problems,
                                jax.random.fold_in(run.key, EVAL_STREAM), max_new_tokens=completion_budget(self.config),
                                temperature=r.temperature, top_p=r.top_p, pass_k=self.pass_k, devices=devices)
    summary = held_out.summarize([results[j] for j in range(len(self.problems))], pass_k=self.pass_k)
    row = {"step": step, "wall_s": wall_s, "eval_s": time.perf_counter() - t0, **summary,
           "dropped_overlaps": self.dropped}
    if hosts.is_primary():
      plots.append_jsonl(os.path.join(self.config.run_dir, "eval.jsonl"), row)
      if writer is not None:
        writer.write("eval", row)
      passed = f", pass@{self.pass_k} {row['pass_at_k']:.3f}" if self.pass_k else ""
      tqdm.write(f"eval step {step}: accuracy {row['accuracy']:.3f} [{row['accuracy_lo']:.3f}, "
                 f"{row['accuracy_hi']:.3f}]{passed} ({row['problems']} problems, {row['eval_s']:.1f} s)")
    return row


def make_task_from(config, *, seed: int | None = None, size: int | None = None):
  """The reasoning-gym task named in config.task (tasks.make_task); `seed` and `size` replace
  task.seed and task.size when given (the held-out evaluation's task)."""
  t = config.task
  seed, size = t.seed if seed is None else seed, t.size if size is None else size
  try:
    return make_task(t.name, seed=seed, size=size, format_bonus=t.format_bonus, strict_answer=t.strict_answer,
                     few_shot=t.few_shot, few_shot_seed=t.few_shot_seed,
                     **t.options.to_dict())
  except ValueError as e:
    raise ValueError(f"task (task.name={t.name!r}, task.options={t.options.to_dict()}): {e}") from e


@dataclasses.dataclass
class Run:
  """What a training loop starts from (start_run). `start` and `data_pos` are the step and data
  position to continue from; `initial_params` is a copy of the parameters before any update (the
  frozen reference policy; also after a resume), or None. `params` and `opt_state` belong to the
  loop: the first `make_update` step donates them (read the loop's returned state, not these).
  With config.lora, `params` are the LoRA adapters alone (what is differentiated, optimised and
  checkpointed), `frozen` the base model's parameters (cast to model.param_dtype) and graphdef
  merges both (`nnx.merge(graphdef, params, frozen)`); `frozen` is None otherwise."""
  tokenizer: Any
  model_config: Any
  graphdef: Any
  params: Any
  initial_params: Any
  optimizer: optax.GradientTransformation
  opt_state: Any
  ckpt: RunCheckpoints
  key: jax.Array
  start: int
  data_pos: int
  frozen: Any = None

  def progress(self, config, desc: str):
    """The steps still to run, start .. config.train.steps - 1, as a tqdm progress bar."""
    return tqdm(range(self.start, config.train.steps), initial=self.start, total=config.train.steps, desc=desc,
                unit="step", disable=not hosts.is_primary())


def start_run(config, run_fingerprint: dict, *, optimizer_fn=make_optimizer, wrap=None,
              keep_initial: bool = False) -> Run:
  """Checks RUN_DIR against `run_fingerprint` (outputs.checkpoints.check_run_dir), builds the model
  (`wrap(model)` when given, e.g. an actor-critic), the optimizer `optimizer_fn(config)` and its
  state, restores the latest checkpoint when config.resume, and cuts every log the run appends to
  (RUN_DIR/*.jsonl, tree drawings) back to the step it continues from (plots.cut_logs_back).

  With config.lora only the adapters train (`models.lora.split`: params = adapters, frozen =
  base); each checkpoint records the base ({"model": model.name, "sha256": models.lora.base_hash})
  and a resume checks it before restoring.

  Before the model loads, RUN_DIR is opened (outputs.checkpoints.open_run_dir: a fresh run needs it
  empty, config.overwrite empties it first, config.resume continues it) and, resuming, every config
  field that differs from the run's experiment.json is printed; experiment.json then records this
  run's fingerprint, config and chat template (what the export reads).

  Raises:
    ValueError: RUN_DIR is not empty without resume or overwrite (open_run_dir), holds another
      experiment's checkpoints (check_run_dir), or, with config.lora, adapters trained on another
      base model (models.lora.check_base).
  """
  saved = prepare_run_dir(config, run_fingerprint)
  model, tokenizer = build_model(config)
  if hosts.is_primary():
    write_run_record(config.run_dir, run_fingerprint, saved, tokenizer.chat_template)
  model_config = model.config
  frozen, meta = None, {}
  if model.lora is None:
    graphdef, params = nnx.split(model if wrap is None else wrap(model))
  else:
    graphdef, params, frozen = lora.split(model)
    meta = {"lora_base": {"model": config.model.name, "sha256": lora.base_hash(frozen)}}
    frozen = param_casts(config)[0](frozen)   # the base never updates: held in model.param_dtype
  initial = jax.tree_util.tree_map(jnp.copy, params) if keep_initial and frozen is None else None
  optimizer = optimizer_fn(config)
  opt_state = optimizer.init(params)
  ckpt = RunCheckpoints(config.run_dir, meta=meta)
  key, start, data_pos = jax.random.key(config.seed), 0, 0
  if config.resume and ckpt.latest_step() is not None:
    if frozen is not None:
      lora.check_base(ckpt.meta(ckpt.latest_step()).get("lora_base"), meta["lora_base"],
                      f"run_dir={config.run_dir!r} checkpoint {ckpt.latest_step()}")
    abstract = {"params": params, "opt_state": opt_state, "rng": jax.random.key_data(key)}
    state, meta = ckpt.restore(ckpt.latest_step(), abstract)
    params, opt_state, key = state["params"], state["opt_state"], jax.random.wrap_key_data(state["rng"])
    start, data_pos = meta["step"], meta["data_pos"]
  if hosts.is_primary():
    plots.cut_logs_back(config.run_dir, start)
  return Run(tokenizer, model_config, graphdef, params, initial, optimizer, opt_state, ckpt, key, start, data_pos,
             frozen)


def prepare_run_dir(config, run_fingerprint: dict) -> dict:
  """Open config.run_dir on process 0 (`open_run_dir`; its verdict shared, so every process raises
  alike, and they continue once it is done), refuse another experiment's checkpoints on every
  process (`check_run_dir`), print the config fields a resume changes; returns this run's config
  as JSON (what experiment.json records)."""
  error = None
  if hosts.is_primary():
    try:
      open_run_dir(config.run_dir, resume=config.resume, overwrite=config.overwrite)
      os.makedirs(config.run_dir, exist_ok=True)
    except ValueError as e:
      error = str(e)
  error = hosts.allgather_objects(error)[0]   # also the barrier: overwrite's removal is done
  if error is not None:
    raise ValueError(error)
  # to_json_best_effort, not to_dict: it reads no field through ConfigDict.__getitem__, so
  # tests/test_config_fields.py still sees which fields the run itself reads.
  now = json.loads(config.to_json_best_effort())
  changes = config_changes(check_run_dir(config.run_dir, run_fingerprint), now)
  if changes and hosts.is_primary():
    print(f"resume: {len(changes)} config fields differ from run_dir={config.run_dir!r}'s experiment.json:\n" +
          "\n".join(f"  {k}: {a!r} -> {b!r}" for k, (a, b) in changes.items()), flush=True)
  return now


def sample_groups(config, policy, tokenizer, task, key, step: int, data_pos: int, *,
                  devices=None, whole: bool = False) -> tuple[list[Group], int]:
  """The step's rollouts, one per prompt: group i from task item data_pos + i with the key
  (seed, step, i) folded, so a resumed run, and a run on a mesh, sample the same.

  Args:
    policy: the model, or with `devices` {device: the model on it} for this process's devices.
    devices: None (sample every group here, one after another), or [prompts_per_step] the device
      of each group (`hosts.sampling_devices`): each of this process's devices samples its groups
      in its own thread, all at once; the groups of other processes' devices come back as
      summaries (`Group.batch` None: rewards, lengths, timings, sample, tree for the logs) through
      `hosts.allgather_objects`, a collective every process joins.
    whole: with several processes, the other processes' groups come back with their arrays too
      (`Group.batch` on the host, numpy), so that every process holds the whole step in the same
      order (PPO's minibatch shuffle and whitening, the padded shape of GRPO's trees see every
      group). One process: no effect.

  Returns: ([prompts_per_step] groups in order, the next data position).
  """
  n = config.rollout.prompts_per_step
  keys = [jax.random.fold_in(jax.random.fold_in(key, step), i) for i in range(n)]
  if devices is None:
    return [rollout(config, policy, tokenizer, task, data_pos + i, keys[i]) for i in range(n)], data_pos + n
  local = hosts.run_on_devices(lambda i, device: rollout(config, policy[device], tokenizer, task, data_pos + i,
                                                         jax.device_put(keys[i], device)), devices)
  shared = lambda g: dataclasses.replace(g, batch=jax.device_get(g.batch) if whole else None,
                                         naive_batch=jax.device_get(g.naive_batch))
  summaries = hosts.gather_items({i: shared(g) for i, g in local.items()}) if jax.process_count() > 1 else local
  return [local.get(i, summaries[i]) for i in range(n)], data_pos + n


def log_step(config, bar, step: int, groups: list[Group], stats: dict, *, rollout_s: float, update_s: float,
             wall_s: float) -> dict:
  """Append the step's record (`step_record` and wall_s) to metrics.jsonl, a sample to
  samples.jsonl, draw a tree; returns the record."""
  record = {**step_record(step, groups, stats, rollout_s=rollout_s, update_s=update_s), "wall_s": wall_s}
  bar.set_postfix(reward=f"{record['reward_mean']:.3f}", step_s=f"{record['step_s']:.1f}")
  if not hosts.is_primary():   # every process computes the record; process 0 writes it
    return record
  plots.append_jsonl(os.path.join(config.run_dir, "metrics.jsonl"), record)
  plots.append_jsonl(os.path.join(config.run_dir, "samples.jsonl"), {"step": step + 1, **groups[0].sample})
  if groups[0].tree is not None:
    os.makedirs(os.path.join(config.run_dir, "trees"), exist_ok=True)
    plots.draw_tree(groups[0].tree, groups[0].rewards, os.path.join(config.run_dir, "trees", f"step_{step + 1}.png"),
                    title=f"step {step + 1}: {groups[0].sample['question']}")
  return record


def save_if_due(config, ckpt: RunCheckpoints, step: int, params, opt_state, key, data_pos: int) -> None:
  if (step + 1) % config.checkpoint_every == 0 or step + 1 == config.train.steps:
    ckpt.save(step + 1, {"params": params, "opt_state": opt_state, "rng": np.asarray(jax.random.key_data(key))},
              {"step": step + 1, "data_pos": data_pos})


def step_record(step: int, groups: list[Group], stats: dict, *, rollout_s: float, update_s: float) -> dict:
  rewards = np.concatenate([g.rewards for g in groups])
  lengths = np.concatenate([g.lengths for g in groups])
  counts = {k: sum(g.counts[k] for g in groups) for k in ("token_positions_naive", "token_positions_computed")}
  return {"step": step + 1, "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
          "accuracy": float(np.concatenate([g.correct for g in groups]).mean()), **stats,
          "completion_len_mean": float(lengths.mean()),
          "truncated_frac": float(np.concatenate([g.truncated for g in groups]).mean()),
          "zero_variance_groups": int(sum(bool(obj.constant_groups(g.rewards)) for g in groups)), **counts,
          "ideal_flop_ratio": float(np.mean([g.counts["ideal_flop_ratio"] for g in groups])),
          "padding_fraction": float(np.mean([g.counts["padding_fraction"] for g in groups])),
          "sample_s": sum(g.sample_s for g in groups), "score_s": sum(g.score_s for g in groups),
          "update_s": update_s, "step_s": rollout_s + update_s}
