"""The one training loop of every algorithm (GRPO / RLOO, PPO, DPO) and the bookkeeping it owns.

    start_run ─► setup ─► for step: collect (sample, score) ─► update ─► log ─► checkpoint ─► plots

An algorithm plugs in as an `Algorithm` (algorithms/grpo.py, ppo.py, dpo.py): it supplies its
batch (`collect`), its update (`update`, built on the one jitted optimizer step `make_update`) and
its metrics record (`log`); the loop owns run setup, resume, timing, checkpoints and plots.
Everything a run writes goes to RUN_DIR: metrics.jsonl, samples.jsonl, plots, experiment.json and
checkpoints/ (orbax).
"""

from __future__ import annotations

import dataclasses
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
from branch_replay_jax.distributed.mesh import PARAM_MODES, make_mesh
from branch_replay_jax.models import Llama, tiny_config
from branch_replay_jax.outputs import plots
from branch_replay_jax.outputs.checkpoints import RunCheckpoints, check_run_dir
from branch_replay_jax.rollout.collect import Group, rollout
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
  clipping), seed and resume, task, sampling (temperature, top_p) and a completion budget longer
  than the model's context (read from the model's metadata, models.loading.context_length)."""
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
  if not isinstance(config.resume, bool):
    raise ValueError(f"resume={config.resume!r} must be a bool")
  if "task" in config:
    k = config.task
    if k.name not in TASKS:
      raise ValueError(f"task.name={k.name!r} is not one of {sorted(TASKS)}")
    for name, value in [("task.size", k.size), ("task.seed", k.seed)]:
      if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "task.size" else 0):
        raise ValueError(f"{name}={value!r} must be an int >= {1 if name == 'task.size' else 0}")
    check_number("task.format_bonus", k.format_bonus, lambda v: 0 <= v < float("inf"), "a finite number >= 0")
    if not isinstance(k.strict_answer, bool):
      raise ValueError(f"task.strict_answer={k.strict_answer!r} must be a bool")
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
  """Raise ValueError for a config.mesh the loop cannot run: sizes that are not positive ints or
  whose product (when > 1) is not the device count, naive or tree updates on a mesh, and groups,
  completions or micro-batches that do not split evenly."""
  m, r, t = config.mesh, config.rollout, config.train
  for name in ("data", "branch", "seq"):
    if not isinstance(m[name], int) or m[name] < 1:
      raise ValueError(f"mesh.{name}={m[name]!r} must be a positive int")
  if m.params not in PARAM_MODES:
    raise ValueError(f"mesh.params={m.params!r} is not one of {PARAM_MODES}")
  n = m.data * m.branch * m.seq
  if n == 1:
    return
  if n != jax.device_count():
    raise ValueError(f"mesh.data x mesh.branch x mesh.seq = {m.data} x {m.branch} x {m.seq} = {n} must equal the "
                     f"device count {jax.device_count()} (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count={n})")
  if t.gradient != "replay":
    raise ValueError(f"train.gradient={t.gradient!r}: the mesh step is replay only; use 'replay' or a 1x1x1 mesh")
  impl = config.model.attention_impl
  if impl in ("pallas", "splash") or (impl == "auto" and jax.default_backend() != "cpu"):
    raise ValueError(f"model.attention_impl={impl!r}: the Pallas kernels do not compile inside the mesh step's "
                     "shard_map (check_vma); use 'xla' or a 1x1x1 mesh")
  if r.tree_fanouts:
    raise ValueError(f"rollout.tree_fanouts={tuple(r.tree_fanouts)}: the training loop runs trees on one device "
                     "(sampled trees differ in shape step to step); use a 1x1x1 mesh")
  if r.prompts_per_step % m.data:
    raise ValueError(f"mesh.data={m.data} must divide rollout.prompts_per_step={r.prompts_per_step}")
  if r.group_size % m.branch:
    raise ValueError(f"mesh.branch={m.branch} must divide rollout.group_size={r.group_size}")
  if (r.group_size // m.branch) % t.micro_batch:
    raise ValueError(f"train.micro_batch={t.micro_batch} must divide the completions per device, rollout.group_size "
                     f"/ mesh.branch = {r.group_size} / {m.branch}")


def mesh_from(config):
  """The ("data", "branch", "seq") mesh of config.mesh, or None for 1 x 1 x 1 (one device)."""
  m = config.mesh
  return None if m.data * m.branch * m.seq == 1 else make_mesh(m.data, m.branch, m.seq)


def build_model(config):
  """(model, tokenizer). "tiny" is a random 2-layer model over SmolLM2's real tokenizer."""
  from branch_replay_jax.models.loading import load, load_tokenizer
  dtype = jnp.dtype(config.model.dtype)
  if config.model.name == "tiny":
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    cfg = tiny_config(vocab_size=len(tokenizer), max_positions=TINY_MAX_POSITIONS)
    return Llama(cfg, dtype=dtype, remat=config.model.remat, attention_impl=config.model.attention_impl,
                 rngs=nnx.Rngs(config.seed)), tokenizer
  return load(config.model.name, dtype=dtype, remat=config.model.remat, attention_impl=config.model.attention_impl)


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
  return {"model": config.model.name, "task": config.task.name, "task_seed": config.task.seed, **shape,
          "prompts_per_step": r.prompts_per_step, "seed": config.seed}


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
  policy), and override the methods below; `validate` runs in the constructor."""

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

  def log(self, bar, step: int, batch, stats: dict, *, rollout_s: float, update_s: float) -> dict:
    """Write the step's record (metrics.jsonl, samples.jsonl) and return it."""
    raise NotImplementedError

  def write_plots(self) -> None:
    plots.write_plots(self.config.run_dir)


def train(config, algorithm: Algorithm) -> list[dict]:
  """Run `algorithm` for config.train.steps steps (resuming when config.resume); returns this run's records."""
  run = start_run(config, algorithm.fingerprint(), optimizer_fn=lambda _: algorithm.make_optimizer(),
                  wrap=algorithm.wrap, keep_initial=algorithm.keep_initial)
  params, opt_state = algorithm.setup(run)
  data_pos, history = run.data_pos, []
  bar = run.progress(config, algorithm.name)
  try:
    for step in bar:
      t0 = time.perf_counter()
      batch, data_pos = algorithm.collect(run, params, step, data_pos)
      t1 = time.perf_counter()
      params, opt_state, stats = algorithm.update(params, opt_state, batch, step)
      t2 = time.perf_counter()
      history.append(algorithm.log(bar, step, batch, stats, rollout_s=t1 - t0, update_s=t2 - t1))
      save_if_due(config, run.ckpt, step, params, opt_state, run.key, data_pos)
  finally:
    run.ckpt.close()   # the last asynchronous save lands on disk, also when a step raised
  algorithm.write_plots()
  return history


def make_task_from(config):
  """The reasoning-gym task named in config.task (tasks.make_task)."""
  t = config.task
  try:
    return make_task(t.name, seed=t.seed, size=t.size, format_bonus=t.format_bonus, strict_answer=t.strict_answer,
                     **t.options.to_dict())
  except ValueError as e:
    raise ValueError(f"task (task.name={t.name!r}, task.options={t.options.to_dict()}): {e}") from e


@dataclasses.dataclass
class Run:
  """What a training loop starts from (start_run). `start` and `data_pos` are the step and data
  position to continue from; `initial_params` is a copy of the parameters before any update (the
  frozen reference policy; also after a resume), or None. `params` and `opt_state` belong to the
  loop: the first `make_update` step donates them (read the loop's returned state, not these)."""
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

  def progress(self, config, desc: str):
    """The steps still to run, start .. config.train.steps - 1, as a tqdm progress bar."""
    return tqdm(range(self.start, config.train.steps), initial=self.start, total=config.train.steps, desc=desc,
                unit="step")


def start_run(config, run_fingerprint: dict, *, optimizer_fn=make_optimizer, wrap=None,
              keep_initial: bool = False) -> Run:
  """Checks RUN_DIR against `run_fingerprint` (outputs.checkpoints.check_run_dir), builds the model
  (`wrap(model)` when given, e.g. an actor-critic), the optimizer `optimizer_fn(config)` and its
  state, restores the latest checkpoint when config.resume, and cuts every log the run appends to
  (RUN_DIR/*.jsonl, tree drawings) back to the step it continues from (plots.cut_logs_back).

  Raises:
    ValueError: RUN_DIR holds another experiment's checkpoints (check_run_dir).
  """
  check_run_dir(config.run_dir, run_fingerprint)
  model, tokenizer = build_model(config)
  model_config = model.config
  graphdef, params = nnx.split(model if wrap is None else wrap(model))
  initial = jax.tree_util.tree_map(jnp.copy, params) if keep_initial else None
  optimizer = optimizer_fn(config)
  opt_state = optimizer.init(params)
  ckpt = RunCheckpoints(config.run_dir)
  key, start, data_pos = jax.random.key(config.seed), 0, 0
  if config.resume and ckpt.latest_step() is not None:
    abstract = {"params": params, "opt_state": opt_state, "rng": jax.random.key_data(key)}
    state, meta = ckpt.restore(ckpt.latest_step(), abstract)
    params, opt_state, key = state["params"], state["opt_state"], jax.random.wrap_key_data(state["rng"])
    start, data_pos = meta["step"], meta["data_pos"]
  plots.cut_logs_back(config.run_dir, start)
  return Run(tokenizer, model_config, graphdef, params, initial, optimizer, opt_state, ckpt, key, start, data_pos)


def sample_groups(config, policy, tokenizer, task, key, step: int, data_pos: int) -> tuple[list[Group], int]:
  """The step's rollouts, one per prompt (keys from (seed, step, i): a resumed run samples the same)."""
  groups = [rollout(config, policy, tokenizer, task, data_pos + i, jax.random.fold_in(jax.random.fold_in(key, step), i))
            for i in range(config.rollout.prompts_per_step)]
  return groups, data_pos + len(groups)


def log_step(config, bar, step: int, groups: list[Group], stats: dict, *, rollout_s: float, update_s: float) -> dict:
  """Append the step's record to metrics.jsonl, a sample to samples.jsonl, draw a tree; returns the record."""
  record = step_record(step, groups, stats, rollout_s=rollout_s, update_s=update_s)
  plots.append_jsonl(os.path.join(config.run_dir, "metrics.jsonl"), record)
  plots.append_jsonl(os.path.join(config.run_dir, "samples.jsonl"), {"step": step + 1, **groups[0].sample})
  if groups[0].tree is not None:
    os.makedirs(os.path.join(config.run_dir, "trees"), exist_ok=True)
    plots.draw_tree(groups[0].tree, groups[0].rewards, os.path.join(config.run_dir, "trees", f"step_{step + 1}.png"),
                    title=f"step {step + 1}: {groups[0].sample['question']}")
  bar.set_postfix(reward=f"{record['reward_mean']:.3f}", step_s=f"{record['step_s']:.1f}")
  return record


def save_if_due(config, ckpt: RunCheckpoints, step: int, params, opt_state, key, data_pos: int) -> None:
  if (step + 1) % config.checkpoint_every == 0 or step + 1 == config.train.steps:
    ckpt.save(step + 1, {"params": params, "opt_state": opt_state, "rng": jax.random.key_data(key)},
              {"step": step + 1, "data_pos": data_pos})


def step_record(step: int, groups: list[Group], stats: dict, *, rollout_s: float, update_s: float) -> dict:
  rewards = np.concatenate([g.rewards for g in groups])
  lengths = np.concatenate([g.lengths for g in groups])
  counts = {k: sum(g.counts[k] for g in groups) for k in ("token_positions_naive", "token_positions_computed")}
  return {"step": step + 1, "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
          "accuracy": float(np.concatenate([g.correct for g in groups]).mean()), **stats,
          "completion_len_mean": float(lengths.mean()),
          "zero_variance_groups": int(sum(bool(obj.constant_groups(g.rewards)) for g in groups)), **counts,
          "ideal_flop_ratio": float(np.mean([g.counts["ideal_flop_ratio"] for g in groups])),
          "padding_fraction": float(np.mean([g.counts["padding_fraction"] for g in groups])),
          "sample_s": sum(g.sample_s for g in groups), "score_s": sum(g.score_s for g in groups),
          "update_s": update_s, "step_s": rollout_s + update_s}
