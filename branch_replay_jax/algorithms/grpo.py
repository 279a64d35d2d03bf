"""The GRPO loop (orchestration only): sample, score, advantages, reference log-probs, gradient, AdamW.

One step, for each of `prompts_per_step` prompts of a reasoning-gym task:
  1. chat-format the problem and sample G completions sharing one prefill (rollout/sampler.py);
  2. score them with the task's verifier (tasks/);
  3. group-normalised advantages (losses.group_advantages), or RLOO's leave-one-out ones
     (losses.rloo_advantages) with loss.advantage = "rloo";
  4. reference log-probs of the frozen initial policy by forward-only replay, for the k3 KL;
  5. the GRPO gradient of the group by replay (or naive, for comparison); gradients are averaged
     over the step's groups, clipped by global norm and applied with optax AdamW.
With a device mesh (config.mesh: data x branch x seq > 1, distributed/mesh.py), steps 4-5 run on the
step's groups stacked into one batch (prompts padded to one length) under `shard_map`: groups
over `data`, completions over `branch`, prompt tokens over `seq`; parameters and optimizer state
replicated or FSDP-sharded (mesh.params). Sampling (1) runs on the first device, on a copy of the
parameters gathered there.
Everything a run writes goes to RUN_DIR: metrics.jsonl, samples.jsonl, reward.png,
throughput.png, experiment.json and checkpoints/ (orbax).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
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
from branch_replay_jax.outputs import plots
from branch_replay_jax.outputs.checkpoints import RunCheckpoints, check_run_dir
from branch_replay_jax.models import Llama, tiny_config
from branch_replay_jax.gradients.logprobs import (naive_logprobs, naive_value_and_grad, replay_logprobs, replay_value_and_grad,
                                      tree_replay_logprobs, tree_replay_value_and_grad)
from branch_replay_jax.rollout.collect import Group, rollout
from branch_replay_jax.distributed.mesh import (PARAM_MODES, make_mesh, pad_prompts, shard_batch, shard_params,
                                        sharded_replay_logprobs, sharded_replay_value_and_grad, stack_groups)
from branch_replay_jax.rollout.tasks import make_task
from branch_replay_jax.core.accumulate import fit_micro_batch
from branch_replay_jax.core.tree_replay import SCHEDULES as TREE_SCHEDULES

GRADIENTS = ("replay", "naive")
SCHEDULES = ("constant", "cosine")


def validate(config) -> None:
  """Raise ValueError (naming the field and value) for settings that cannot run, before any compute."""
  r, t, l = config.rollout, config.train, config.loss
  if r.group_size < 2:
    raise ValueError(f"rollout.group_size={r.group_size}: GRPO's group-normalised advantage needs G >= 2")
  for name, value in [("rollout.prompts_per_step", r.prompts_per_step), ("rollout.max_new_tokens", r.max_new_tokens),
                      ("train.steps", t.steps), ("train.micro_batch", t.micro_batch),
                      ("train.inner_epochs", t.inner_epochs), ("checkpoint_every", config.checkpoint_every)]:
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"{name}={value!r} must be a positive int")
  if not r.tree_fanouts and r.group_size % t.micro_batch:
    # Groups have a fixed G; a micro-batch that does not divide it is a configuration mistake.
    raise ValueError(f"train.micro_batch={t.micro_batch} must divide rollout.group_size={r.group_size}")
  if t.gradient not in GRADIENTS:
    raise ValueError(f"train.gradient={t.gradient!r} is not one of {GRADIENTS}")
  if t.lr_schedule not in SCHEDULES:
    raise ValueError(f"train.lr_schedule={t.lr_schedule!r} is not one of {SCHEDULES}")
  if l.advantage not in obj.ADVANTAGES:
    raise ValueError(f"loss.advantage={l.advantage!r} is not one of {obj.ADVANTAGES}")
  if l.normalisation not in obj.NORMALISATIONS:
    raise ValueError(f"loss.normalisation={l.normalisation!r} is not one of {obj.NORMALISATIONS}")
  if not 0 < l.clip_eps < 1 or l.kl_coef < 0:
    raise ValueError(f"loss.clip_eps={l.clip_eps} must lie in (0, 1) and loss.kl_coef={l.kl_coef} be >= 0")
  if r.tree_fanouts:
    if any(not isinstance(f, int) or f < 1 for f in r.tree_fanouts) or r.segment_length < 1:
      raise ValueError(f"rollout.tree_fanouts={tuple(r.tree_fanouts)} needs ints >= 1 and rollout.segment_length="
                       f"{r.segment_length} >= 1")
  if t.tree_schedule not in TREE_SCHEDULES:
    raise ValueError(f"train.tree_schedule={t.tree_schedule!r} is not one of {TREE_SCHEDULES}")
  validate_mesh(config)


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
    cfg = tiny_config(vocab_size=len(tokenizer), max_positions=2048)
    return Llama(cfg, dtype=dtype, remat=config.model.remat, attention_impl=config.model.attention_impl,
                 rngs=nnx.Rngs(config.seed)), tokenizer
  return load(config.model.name, dtype=dtype, remat=config.model.remat, attention_impl=config.model.attention_impl)


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
  return {"model": config.model.name, "task": config.task.name, "task_seed": config.task.seed,
          "group_size": config.rollout.group_size, "prompts_per_step": config.rollout.prompts_per_step,
          "seed": config.seed}


def siblings(arrays: dict) -> int:
  """Completions of a group, or leaf slots under one parent of a padded tree."""
  if "branches" in arrays:
    return arrays["branches"]["tokens"].shape[0]
  return arrays["levels"][-1]["tokens"].shape[-2]


class StepFunctions:
  """The jitted pieces of a step; the graphdef and the objective are static (compiled per shape).

  grad and logprobs take one update unit (`units`): a group's or tree's arrays on one device, or,
  with a mesh, the step's groups stacked [B, ...] and sharded. grad returns (loss, aux, grads)
  summed over the unit's completions; logprobs the per-token log-probs laid out like its tokens.
  """

  def __init__(self, config, graphdef, optimizer):
    t, l = config.train, config.loss
    naive = t.gradient == "naive"
    tree = bool(config.rollout.tree_fanouts) and not naive
    self.mesh, self.param_mode = mesh_from(config), config.mesh.params
    self.objective = functools.partial(obj.grpo_tree_objective if tree else obj.grpo_objective, clip_eps=l.clip_eps,
                                       kl_coef=l.kl_coef, on_policy=t.inner_epochs == 1)
    if self.mesh is not None:
      mesh, m = self.mesh, t.micro_batch
      self.grad = jax.jit(lambda p, b: sharded_replay_value_and_grad(graphdef, p, b, self.objective, mesh, micro_batch=m))
      self.logprobs = jax.jit(lambda p, b: sharded_replay_logprobs(graphdef, p, b, mesh, micro_batch=m))
    else:
      grad_fn = (naive_value_and_grad if naive else replay_value_and_grad if not tree else
                 functools.partial(tree_replay_value_and_grad, schedule=t.tree_schedule))
      lp_fn = naive_logprobs if naive else tree_replay_logprobs if tree else replay_logprobs
      # With trees, EOS changes how many trajectories (naive) or leaf siblings (replay) there are:
      # each compiled shape uses the largest divisor of that count not above train.micro_batch.
      self.grad = jax.jit(lambda p, a: grad_fn(graphdef, p, a, self.objective,
                                               micro_batch=fit_micro_batch(t.micro_batch, siblings(a))))
      self.logprobs = jax.jit(lambda p, a: lp_fn(graphdef, p, a) if naive else
                              lp_fn(graphdef, p, a, micro_batch=fit_micro_batch(t.micro_batch, siblings(a))))

    def update(params, opt_state, grads):
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, optax.tree.norm(grads)
    self.update = jax.jit(update, donate_argnums=(0, 1))

  def units(self, groups: list[Group]) -> list[tuple[str, dict]]:
    """(kind, arrays) per update unit: each group or tree, or one stacked batch on the mesh."""
    if self.mesh is None:
      return [(g.kind, g.arrays) for g in groups]
    batch = stack_groups(pad_prompts([g.arrays for g in groups], self.mesh.shape["seq"]))
    return [("group", shard_batch(batch, self.mesh))]

  def place(self, tree):
    """Parameters or optimizer state onto the mesh in config.mesh.params's layout
    (distributed.mesh.shard_params); unchanged without a mesh."""
    return tree if self.mesh is None else shard_params(tree, self.mesh, self.param_mode)

  def for_sampling(self, params):
    """The parameters the sampler reads: on the mesh, a copy gathered onto the first device."""
    # A SingleDeviceSharding, not a bare device: device_put(x, device) keeps an FSDP array's
    # sharded type (JAX 0.10), and the sampler's gathers would then ask for an out_sharding.
    return params if self.mesh is None else jax.device_put(params, jax.sharding.SingleDeviceSharding(jax.devices()[0]))


def _aux_sums(kind: str, aux) -> tuple[float, float]:
  """(Σ k3 KL, Σ clipped) from a group's aux {"kl", "clipped"} or a tree's per-level [{"aux": {...}}]."""
  parts = [aux] if kind == "group" else [level["aux"] for level in aux]
  return sum(float(np.sum(p["kl"])) for p in parts), sum(float(np.sum(p["clipped"])) for p in parts)


def _store_logprobs(kind: str, arrays: dict, name: str, logp) -> None:
  """Per-token log-probs into a unit's arrays: [(B,) G, T] per branch, or a tree's per-level [F_1..F_d, T_d]."""
  if kind == "tree":
    for level, lp in zip(arrays["levels"], logp):
      level[name] = lp
  else:
    arrays["branches"][name] = logp


def update_on_batch(config, fns: StepFunctions, params, ref_params, opt_state, groups: list[Group]):
  """Reference (and old) log-probs, then inner_epochs updates on the step's groups."""
  units = fns.units(groups)
  for kind, arrays in units:
    if config.loss.kl_coef:
      _store_logprobs(kind, arrays, "ref_logp", fns.logprobs(ref_params, arrays))
    if config.train.inner_epochs > 1:
      _store_logprobs(kind, arrays, "old_logp", fns.logprobs(params, arrays))
  for _ in range(config.train.inner_epochs):
    total, loss, aux = None, 0.0, []
    for _, arrays in units:
      unit_loss, unit_aux, grads = fns.grad(params, arrays)
      total = grads if total is None else jax.tree_util.tree_map(jnp.add, total, grads)
      loss, aux = loss + float(unit_loss), aux + [unit_aux]
    mean = jax.tree_util.tree_map(lambda x: x / len(groups), total)
    params, opt_state, grad_norm = fns.update(params, opt_state, mean)
  pairs = sum(int(g.lengths.sum()) for g in groups)   # completion tokens, one per (token, trajectory) pair
  sums = [_aux_sums(kind, a) for (kind, _), a in zip(units, aux)]
  stats = {"loss": loss / len(groups), "grad_norm": float(grad_norm),
           "kl": sum(k for k, _ in sums) / pairs, "clip_frac": sum(c for _, c in sums) / pairs}
  return params, opt_state, stats


def train(config) -> list[dict]:
  """Run the experiment in `config` (see experiments/grpo_smollm2_arith.py); returns the metrics of this run."""
  validate(config)
  task = make_task_from(config)
  run = start_run(config, fingerprint(config), keep_initial=True)
  fns = StepFunctions(config, run.graphdef, run.optimizer)
  params, opt_state, ref_params = fns.place(run.params), fns.place(run.opt_state), fns.place(run.initial_params)
  data_pos, history = run.data_pos, []
  bar = run.progress(config, "grpo")
  for step in bar:
    t0 = time.perf_counter()
    groups, data_pos = sample_groups(config, nnx.merge(run.graphdef, fns.for_sampling(params)), run.tokenizer, task,
                                     run.key, step, data_pos)
    t1 = time.perf_counter()
    with contextlib.nullcontext() if fns.mesh is None else jax.set_mesh(fns.mesh):
      params, opt_state, stats = update_on_batch(config, fns, params, ref_params, opt_state, groups)
    t2 = time.perf_counter()
    history.append(log_step(config, bar, step, groups, stats, rollout_s=t1 - t0, update_s=t2 - t1))
    save_if_due(config, run.ckpt, step, params, opt_state, run.key, data_pos)
  run.ckpt.close()
  plots.write_plots(config.run_dir)
  return history


# The loop's bookkeeping, shared with the PPO (ppo.py) and DPO (dpo.py) loops.

def make_task_from(config):
  """The reasoning-gym task named in config.task (tasks.make_task)."""
  t = config.task
  return make_task(t.name, seed=t.seed, size=t.size, format_bonus=t.format_bonus, **t.options.to_dict())


@dataclasses.dataclass
class Run:
  """What a training loop starts from (start_run). `start` and `data_pos` are the step and data
  position to continue from; `initial_params` is a copy of the parameters before any update (the
  frozen reference policy; also after a resume), or None."""
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
  state, restores the latest checkpoint when config.resume, and drops metrics.jsonl lines at or
  after the step it continues from.

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
  plots.truncate_jsonl(os.path.join(config.run_dir, "metrics.jsonl"), keep_below_step=start)
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
          "zero_variance_groups": int(sum(np.ptp(g.rewards) == 0 for g in groups)), **counts,
          "ideal_flop_ratio": float(np.mean([g.counts["ideal_flop_ratio"] for g in groups])),
          "padding_fraction": float(np.mean([g.counts["padding_fraction"] for g in groups])),
          "sample_s": sum(g.sample_s for g in groups), "score_s": sum(g.score_s for g in groups),
          "update_s": update_s, "step_s": rollout_s + update_s}
