"""PPO for the training loop (algorithms/loop.py): old log-probs and values, GAE, epochs of minibatches.

One step, for `prompts_per_step` prompts of a reasoning-gym task:
  1. sample and score G completions per prompt, or a tree (rollout/collect.py, as the GRPO loop),
     and lay them out with loss.weighting's weights (algorithms/groups.py);
  2. old log-probs and old values of the sampling-time policy and critic by forward-only replay
     (gradients/step.py with the ActorCritic head; the prompt is computed once for both);
  3. the task's reward on each trajectory's last token, GAE along every trajectory
     (losses.gae; on a tree, one advantage and return per (token, trajectory) pair),
     optionally whitened over the step's (token, trajectory) pairs;
  4. `ppo.epochs` passes over the step's groups/trees, shuffled and split into `ppo.minibatches`
     minibatches; each minibatch's mean gradient of the clipped policy loss plus the value loss
     (losses.ppo_objective; policy and critic) is applied with AdamW
     (runs.make_optimizer; the critic's parameters at `ppo.critic_lr_scale` times the rate).
Runs in the training loop (algorithms/loop.py), which writes RUN_DIR/metrics.jsonl, samples.jsonl, plots, checkpoints.
With a device mesh (config.mesh: data x branch x seq > 1, distributed/mesh.py; group rollouts,
replay gradients), step 2 runs on the step's groups stacked into one batch and each minibatch's
gradient (4) on its groups stacked into one batch, under `shard_map`: groups over `data`,
completions over `branch`, prompt tokens over `seq`, for the policy and the critic alike;
parameters and optimizer state replicated or FSDP-sharded (mesh.params). Trees run there too
(mesh.seq = 1): the step's trees (a minibatch's) padded to one level layout
(data.batches.pad_trees, exact zeros), trees over `data`, first-level subtrees over `branch`.
Sampling (1) is data-parallel on the mesh as GRPO's (each group on a device of its `data` row, from a copy of
the parameters gathered there; the same tokens as on one device). As several processes
(distributed.num_processes) each process samples its devices' groups, then every process
receives every group's arrays (loop.sample_groups, whole=True), so all compute the same GAE,
whitening and minibatch order over the whole step and place only their own rows of each batch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from branch_replay_jax import losses as obj
from branch_replay_jax.algorithms import base, checks, loop, placement, producer, runs, schema
from branch_replay_jax.algorithms.groups import Group
from branch_replay_jax.core.accumulate import fit_micro_batch
from branch_replay_jax.correction import correct, has_sampler_logprobs
from branch_replay_jax.data.batches import RolloutBatch, pad_trees
from branch_replay_jax.data.trees import pad_tree
from branch_replay_jax.gradients.heads import ActorCritic as ActorCriticHead
from branch_replay_jax.gradients.step import forward as step_forward
from branch_replay_jax.gradients.step import compiled_programs, leaf_siblings, make_train_step
from branch_replay_jax.models.critic import CRITICS, ActorCritic


def validate(config, experiment=None):
  """Raise ValueError (naming the field and value) for PPO settings that cannot run, then `checks.validate`.
  `schema.parse` first: the fields and types of PPO's schema; the GRPO experiment's fields that PPO
  configs derived from it delete (GRPO's options, loss.advantage) are refused there, naming GRPO.
  Returns the parsed experiment (`schema.PPOExperiment`; `experiment` when given, parsed already)."""
  experiment = experiment or schema.parse(config, expect="ppo")
  p = config.ppo
  checks.validate_correction(config)
  # (k < 0 is producer.validate's to refuse, by its own message)
  if producer.max_staleness(config) > 0 and not checks.rollout_correction(config).active:
    raise ValueError(f"{producer.FIELD}={producer.max_staleness(config)} with PPO and loss.rollout_correction='none': "
                     "its old log-probs and values come from the update's own forward at the current parameters, so "
                     "a stale batch would train as on-policy; set loss.rollout_correction (tis, mis or icepop: the "
                     "ratio π_old / π_sampler then weighs each term, AReaL's decoupled PPO)")
  if p.critic not in CRITICS:
    raise ValueError(f"ppo.critic={p.critic!r} is not one of {CRITICS}")
  for name, value in [("ppo.epochs", p.epochs), ("ppo.minibatches", p.minibatches)]:
    if value < 1:
      raise ValueError(f"{name}={value!r} must be a positive int")
  if config.rollout.prompts_per_step % p.minibatches:
    raise ValueError(f"ppo.minibatches={p.minibatches} must divide rollout.prompts_per_step="
                     f"{config.rollout.prompts_per_step} (minibatches of whole groups or trees)")
  if not (0 <= p.gamma <= 1 and 0 <= p.lam <= 1):
    raise ValueError(f"ppo.gamma={p.gamma} and ppo.lam={p.lam} must lie in [0, 1]")
  if p.vf_coef < 0 or p.value_clip < 0 or p.critic_lr_scale <= 0:
    raise ValueError(f"ppo.vf_coef={p.vf_coef} and ppo.value_clip={p.value_clip} must be >= 0, "
                     f"ppo.critic_lr_scale={p.critic_lr_scale} > 0")
  if config.loss.kl_coef:
    raise ValueError(f"loss.kl_coef={config.loss.kl_coef}: this PPO loss has no KL term; set it to 0")
  if config.train.get("exactness_check_every"):
    raise ValueError(f"train.exactness_check_every={config.train.exactness_check_every}: the run-time exactness check "
                     "is GRPO / RLOO's (PPO's replay == naive is held by tests/test_ppo.py); set it to 0")
  checks.check_number("loss.clip_eps", config.loss.clip_eps, lambda v: 0 < v < 1, "in (0, 1)")
  if config.loss.weighting == "step_token_mean":
    raise ValueError("loss.weighting='step_token_mean': PPO averages each minibatch's groups, so a step-level token "
                     f"mean does not apply; use one of {tuple(w for w in obj.WEIGHTINGS if w != 'step_token_mean')}")
  if config.train.inner_epochs != 1:
    raise ValueError(f"train.inner_epochs={config.train.inner_epochs}: PPO repeats updates with ppo.epochs; "
                     "set it to 1")
  checks.validate(config)
  m = config.mesh
  if m.data * m.branch * m.seq > 1:
    if config.rollout.tree_fanouts and m.seq > 1:
      raise ValueError(f"mesh.seq={m.seq} with rollout.tree_fanouts={tuple(config.rollout.tree_fanouts)}: PPO's "
                       "tree replay does not split the prompt over seq; use mesh.seq=1 (trees over data, "
                       "first-level subtrees over branch)")
    per_minibatch = config.rollout.prompts_per_step // p.minibatches
    if per_minibatch % m.data:
      raise ValueError(f"mesh.data={m.data} must divide the groups per minibatch, rollout.prompts_per_step / "
                       f"ppo.minibatches = {config.rollout.prompts_per_step} / {p.minibatches} = {per_minibatch} "
                       "(each minibatch is one batch on the mesh)")
  return experiment


def make_optimizer(config) -> optax.GradientTransformation:
  """`runs.make_optimizer` for the policy; the critic's parameters (value head, separate trunk) get
  its updates scaled by ppo.critic_lr_scale (a larger step for a head that starts at zero)."""
  base = runs.make_optimizer(config)
  critic = optax.chain(base, optax.scale(config.ppo.critic_lr_scale))
  labels = lambda params: jax.tree_util.tree_map_with_path(
      lambda path, _: "policy" if path[0].key == "policy" else "critic", params)
  return optax.multi_transform({"policy": base, "critic": critic}, labels)


def fingerprint(config) -> dict:
  return {**runs.fingerprint(config), "algorithm": "ppo", "critic": config.ppo.critic}


HEAD = ActorCriticHead()   # PPO's log-probs at τ = 1


class PPOFunctions:
  """The jitted pieces of a PPO step (compiled per shape): gradient and forward-only pass.

  train_step takes a minibatch's update unit (`units`): its groups (trees) stacked [B, ...] (one
  device: `placement.stack_on_device`; a mesh: sharded), and runs every group's gradient, their mean
  and the AdamW update as one program (`gradients.step.make_train_step`), metrics {"loss", "aux"
  (summed per group [B] on one device, over the batch on a mesh), "grad_norm"}. forward takes one
  group's or tree's arrays on one device, or the step's groups stacked and sharded on a mesh, and
  returns the `gradients.heads.LogprobsValues` laid out like its tokens.
  """

  def __init__(self, config, graphdef, optimizer=None, layout: schema.Layout | None = None):
    t, p = config.train, config.ppo
    layout = layout or schema.layout_of(schema.parse(config, expect="ppo"))
    self.naive = layout.gradient == "naive"
    self.mesh, self.param_mode = placement.mesh_from(config), placement.param_layout(config)
    objective = functools.partial(obj.ppo_objective, clip_eps=config.loss.clip_eps, vf_coef=p.vf_coef,
                                  value_clip=p.value_clip)
    cast, upcast = runs.param_casts(config)
    mesh, layout = self.mesh, "naive" if self.naive else "replay"
    # Every compiled shape (a step's trees may stop early: EOS) uses the largest divisor of its leaf
    # siblings per device not above train.micro_batch.
    mb = lambda a: fit_micro_batch(t.micro_batch, leaf_siblings(a, mesh))
    forward = lambda prm, a: step_forward(HEAD, graphdef, prm, a, layout=layout, mesh=mesh, micro_batch=mb(a))
    if mesh is not None:
      mesh_forward = forward
      # the forward pass gathered: replicated, so that every process reads it whole (with several
      # processes the [B, ...] arrays span processes).
      forward = lambda prm, b: jax.tree_util.tree_map(lambda x: jax.sharding.reshard(x, P()), mesh_forward(prm, b))
    # One program per minibatch update, on one device and on the mesh alike: every group's gradient
    # of the minibatch stacked [B, ...], their mean and the update (gradients.step.make_train_step).
    self.train_step = None if optimizer is None else make_train_step(
        HEAD, graphdef, optimizer, objective, mesh=mesh, layout=layout, micro_batch=t.micro_batch,
        schedule=t.tree_schedule, reduce_aux=lambda aux: jax.tree_util.tree_map(jnp.sum, aux), cast=cast,
        upcast=upcast)
    self.forward = jax.jit(lambda prm, a: forward(cast(prm), a))
    self.cast = cast
    # loss.rollout_correction (correction.py): factors and metrics from old log-probs and the sampler's.
    self.correction = checks.rollout_correction(config)
    self.correct = jax.jit(functools.partial(correct, correction=self.correction))

  def units(self, groups: list[Group]) -> list[tuple[str, RolloutBatch]]:
    """[(kind, arrays)]: the groups (trees) as one stacked update unit (one device:
    `placement.stack_on_device`), on the mesh sharded, trees first padded to one level layout (`data.batches.pad_trees`: empty
    slots, weights, advantages and returns 0, so loss, gradient and metric sums are unchanged)."""
    kind, batches = groups[0].kind, [g.batch for g in groups]
    if self.mesh is None:
      return [(kind, placement.stack_on_device(batches))]
    return [(kind, placement.on_mesh(pad_trees(batches) if kind == "tree" else batches, self.mesh))]

  def forward_groups(self, params, groups: list[Group]) -> list:
    """`forward` of every group (its `LogprobsValues`, a tree's per-level list): group by group on one
    device; on the mesh, all groups as one stacked batch, split back per group on the host."""
    if self.mesh is None:
      return [self.forward(params, g.batch) for g in groups]
    out = jax.device_get(self.forward(params, self.units(groups)[0][1]))   # [B, ...] on the host, split per group
    # (a tree's levels keep the step's padded layout; its own slots come first on every axis)
    return [jax.tree_util.tree_map(lambda x: x[i], out) for i in range(len(groups))]


def _old_rows(out, group: Group):
  """(old logp, old values, mask) [G, T] per trajectory, next values [G] (V after each trajectory's
  last token: the state a truncated one bootstraps from) from the group's forward pass `out`
  (`PPOFunctions.forward_groups`); trees also return their per-node lists."""
  if group.kind == "group":
    return (np.asarray(out.logp), np.asarray(out.values), np.asarray(group.batch.branches.mask),
            np.asarray(out.next_value), None)
  tree, width = group.tree, int(group.lengths.max())
  padded = pad_tree(tree)
  nodes = {k: padded.unplace([getattr(lvl, k) for lvl in out]) for k in ("logp", "values")}
  mask = np.arange(width)[None] < group.lengths[:, None]
  next_values = padded.slot_values([lvl.next_value for lvl in out])[list(tree.ends)]
  return tree.rows(nodes["logp"], width), tree.rows(nodes["values"], width), mask, next_values, nodes


def prepare(config, fns: PPOFunctions, params, groups: list[Group]) -> dict:
  """Old log-probs/values, GAE advantages and returns into each group's arrays; returns value stats."""
  p = config.ppo
  olds, adv, ret = [], [], []
  for g, out in zip(groups, fns.forward_groups(params, groups)):
    logp, values, mask, next_values, nodes = _old_rows(out, g)
    rewards = np.zeros(values.shape, np.float32)
    rewards[np.arange(len(g.lengths)), g.lengths - 1] = g.rewards
    # The sampler's stop reason, never "the row fills the padded width": an EOS on the budget's
    # last token terminates; a budget cut bootstraps from V after the last token (losses.gae).
    a, r = (np.asarray(x) for x in obj.gae(rewards, values, mask, gamma=p.gamma, lam=p.lam,
                                           truncated_b=g.truncated, next_values_b=next_values))
    olds.append((logp, values, mask, nodes))
    adv.append(a)
    ret.append(r)
  masks = [m for *_, m, _ in olds]
  if p.whiten_advantages:
    # One mean and std over the step's (token, trajectory) pairs; exactly 0 when they are all equal.
    widths = [a.shape[1] for a in adv]
    flat = np.concatenate([np.pad(a, ((0, 0), (0, max(widths) - a.shape[1]))) for a in adv])
    flat_mask = np.concatenate([np.pad(m, ((0, 0), (0, max(widths) - m.shape[1]))) for m in masks])
    white = np.asarray(obj.whiten(flat, flat_mask))
    rows = np.cumsum([0] + [a.shape[0] for a in adv])
    adv = [white[rows[i]:rows[i + 1], :widths[i]] for i in range(len(adv))]
  returns = np.concatenate([r[m] for r, m in zip(ret, masks)])
  predicted = np.concatenate([v[m] for (_, v, m, _) in olds])
  for g, a, r, (logp, values, mask, nodes) in zip(groups, adv, ret, olds):
    if g.kind == "group":
      g.batch = g.batch.replace(levels=(g.batch.branches.replace(
          old_logp=jnp.asarray(logp), old_values=jnp.asarray(values), advantage=jnp.asarray(a, jnp.float32),
          returns=jnp.asarray(r, jnp.float32)),))
      continue
    padded = pad_tree(g.tree)
    fields = {"old_logp": nodes["logp"], "old_values": nodes["values"],
              "advantage": g.tree.columns(a.astype(np.float32)), "returns": g.tree.columns(r)}
    g.batch = g.batch.replace(levels=tuple(
        level.replace(**{k: jnp.asarray(padded.place(v, d)) for k, v in fields.items()})
        for d, level in enumerate(g.batch.levels, start=1)))
  return {"value_mean": float(np.mean(predicted)), "return_mean": float(returns.mean()),
          # 1 - Var[R - V_old] / Var[R]; None when every return is equal (undefined).
          "explained_variance": obj.explained_variance(returns, predicted)}


def _aux_sums(kind: str, aux) -> dict:
  parts = [aux] if kind == "group" else [level.aux for level in aux]
  # per group [B] (one device) or the batch's sums (a mesh): added in Python floats
  return {k: sum(float(x) for part in parts for x in np.ravel(part[k])) for k in ("policy", "value", "clipped", "kl")}


def update_on_batch(config, fns: PPOFunctions, params, opt_state, groups: list[Group], step: int):
  """ppo.epochs x ppo.minibatches AdamW updates over the step's groups, each one jitted program
  (`PPOFunctions.train_step`); metrics of the last epoch, fetched once at the step's end. The old
  log-probs (`prepare`) are the proximal policy's: where the batch carries the sampler's log-probs,
  the sampler mismatch is logged every step (`correction.METRICS` over the step's groups), and with
  loss.rollout_correction each minibatch's policy terms are weighed by its factors (AReaL's
  decoupled PPO objective, Fu et al. 2025, arXiv 2505.24298: the clip on π / π_old, the weight
  π_old / π_sampler on top)."""
  p = config.ppo
  correction = {}
  if has_sampler_logprobs(groups[0].batch):
    (_, whole), = fns.units(groups)
    _, correction = fns.correct(whole)
  elif fns.correction.active:
    raise ValueError(f"loss.rollout_correction={fns.correction.mode!r}: this step's rollouts carry no sampler "
                     "log-probs (a sampler that records none); use loss.rollout_correction='none'")
  for epoch in range(p.epochs):
    order = np.random.default_rng((config.seed, step, epoch)).permutation(len(groups))
    results = []   # (kind, loss, aux) per minibatch, on the device until the step's end
    for minibatch in np.array_split(order, p.minibatches):
      (kind, arrays), = fns.units([groups[i] for i in minibatch])
      if fns.correction.active:
        arrays, _ = fns.correct(arrays)
      params, opt_state, out = fns.train_step(params, opt_state, arrays, len(minibatch))
      results.append((kind, out["loss"], out["aux"]))
      grad_norm = out["grad_norm"]
  # One host sync per step; the last epoch's sums, minibatch by minibatch, in Python floats.
  results, grad_norm, correction = jax.device_get((results, grad_norm, correction))
  sums, loss_sum = {"policy": 0.0, "value": 0.0, "clipped": 0.0, "kl": 0.0}, 0.0
  for kind, loss, aux in results:
    loss_sum += sum(float(x) for x in np.atleast_1d(loss))
    part = _aux_sums(kind, aux)
    sums = {k: sums[k] + part[k] for k in sums}
  pairs = sum(int(g.lengths.sum()) for g in groups)   # (token, trajectory) pairs
  stats = {"loss": loss_sum / len(groups), "policy_loss": sums["policy"] / len(groups),
           "value_loss": sums["value"] / len(groups), "grad_norm": float(grad_norm),
           "kl": sums["kl"] / pairs, "clip_frac": sums["clipped"] / pairs,
           "step_compiles": compiled_programs(fns.train_step), **{k: float(v) for k, v in correction.items()}}
  return params, opt_state, stats


class PPO(base.Algorithm):
  """PPO with a critic (value head or separate trunk) and GAE, on groups or trees."""

  name = "ppo"

  def __init__(self, config, experiment=None):
    self.layout = schema.layout_of(validate(config, experiment))   # resolved once, passed on
    super().__init__(config)
    self.task = runs.make_task_from(config)

  def fingerprint(self):
    return fingerprint(self.config)

  def make_optimizer(self):
    return make_optimizer(self.config)

  def wrap(self, model):
    return ActorCritic(model, critic=self.config.ppo.critic)

  def setup(self, run):
    self.run, self.fns = run, PPOFunctions(self.config, run.graphdef, run.optimizer, layout=self.layout)
    return (placement.place(run.params, self.fns.mesh, self.fns.param_mode),
            placement.place(run.opt_state, self.fns.mesh, self.fns.param_mode))

  def policy(self, run, params, devices):
    """The policy the step trains, the actor-critic's policy at model.param_dtype's rounding: on one
    device, or on a mesh {device: it on a full copy of the parameters} (`placement.sampling_policy`)."""
    return placement.sampling_policy(run.graphdef, self.fns.cast(params), self.fns.mesh, devices,
                                select=lambda actor_critic: actor_critic.policy)

  def collect(self, run, params, step, data_pos):
    """The step's groups, sampled data-parallel on a mesh as GRPO's (`placement.sampling_devices`); with
    several processes every process receives every group's arrays (`whole`): the minibatch
    shuffle, whitening and GAE see the whole step, the same on every process."""
    devices = placement.sampling_devices(self.fns.mesh, self.config.rollout.prompts_per_step)
    return loop.sample_groups(self.config, self.policy(run, params, devices), run.tokenizer, self.task, run.key, step,
                              data_pos, devices=devices, whole=True, layout=self.layout)

  def eval_policy(self, run, params, num_problems):
    devices = placement.spread_devices(self.fns.mesh, num_problems)
    return self.policy(run, params, devices), devices

  def update(self, params, opt_state, groups, step):
    with placement.mesh_context(self.fns.mesh):
      value_stats = prepare(self.config, self.fns, params, groups)
      params, opt_state, stats = update_on_batch(self.config, self.fns, params, opt_state, groups, step)
    return params, opt_state, {**stats, **value_stats}

  def log(self, bar, step, groups, stats, *, rollout_s, update_s, wall_s):
    return loop.log_step(self.config, bar, step, groups, stats, rollout_s=rollout_s, update_s=update_s, wall_s=wall_s)


def train(config, experiment=None) -> list[dict]:
  """Run the PPO experiment in `config` (see experiments/ppo_smollm2_arith.py); returns this run's metrics."""
  return loop.train(config, PPO(config, experiment))
