"""GRPO (and RLOO) for the training loop (algorithms/loop.py): reference log-probs, the replay gradient, AdamW.

One step, for each of `prompts_per_step` prompts of a reasoning-gym task:
  1. chat-format the problem and sample G completions sharing one prefill (rollout/sampler.py);
  2. score them with the task's verifier (rollout/tasks/);
  3. group-normalised advantages (losses.group_advantages), or RLOO's leave-one-out ones
     (losses.rloo_advantages) with loss.advantage = "rloo";
  4. reference log-probs of the frozen initial policy by forward-only replay, for the k3 KL;
  5. the GRPO gradient of each group by replay (or naive, for comparison); gradients are averaged
     over the step's groups, clipped by global norm and applied with optax AdamW.
Steps 1-2 are rollout/collect.py (raw trajectories), 3 and the loss weights are algorithms/groups.py
(loop.sample_groups; groups.step_groups adds DAPO's dynamic sampling and the step's token mean);
4-5 are `update_on_batch`: the step's groups stacked into one batch (prompts padded to the longest
bucket, `placement.stack_on_device`), step 4 one forward program, step 5 one jitted program per
optimizer step (`gradients.step.make_train_step`: a scan over the groups' gradients, their mean and
the update, params and optimizer state donated), its metrics fetched once per step. The loss
options of today's GRPO practice (clip-higher, GSPO's sequence ratio, log-probs at the sampling
temperature, overlong shaping and masking, the loss weighting) are config fields checked by
`validate` (docs/design.md, "GRPO options").
With a device mesh (config.mesh: data x branch x seq > 1, distributed/mesh.py), steps 4-5 run on
the same stacked batch (prompts padded to a multiple of `seq`) under `shard_map`: groups
over `data`, completions over `branch`, prompt tokens over `seq`; parameters and optimizer state
replicated or FSDP-sharded (mesh.params). Tree rollouts (rollout.tree_fanouts) run there too: EOS
makes the step's sampled trees differ in depth, segment buckets and trajectory count, so they are
first padded to one level layout (data.batches.pad_trees; the padding adds exact zeros), then
stacked: trees over `data`, first-level subtrees over `branch`, prompt over `seq`. Sampling (1) is
data-parallel on the mesh: each group samples on a device of its `data` row from a copy of the
parameters gathered there, all devices at once (distributed/hosts.py), with the same tokens as on
one device. The loop also runs as several processes (distributed.num_processes;
distributed/hosts.py): each process samples and places the groups of its own devices; trees are
first shared with every process (their padded shape is the step's largest over all processes),
then each places its own rows.
Episodes (rollout.episodes; docs/design.md, "Episodes"): step 1 runs G multi-turn episodes per
problem in the run's environment (rollout.collect.rollout_episodes), 2 is the environment's outcome
reward, 3 is per episode (groups.build_episodes), and 4-5 train the episode tree with the tree
objective (or its rows with train.gradient = "naive"), on one device.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from branch_replay_jax import losses as obj
from branch_replay_jax.correction import correct, has_sampler_logprobs
from branch_replay_jax.algorithms import base, checks, loop, placement, runs, schema
from branch_replay_jax.algorithms.exactness import ExactnessCheck
from branch_replay_jax.algorithms.placement import mesh_from
from branch_replay_jax.algorithms.producer import max_staleness
from branch_replay_jax.core.accumulate import fit_micro_batch
from branch_replay_jax.data.batches import RolloutBatch, TreeLayouts, pack_trees, pad_trees, with_logprobs
from branch_replay_jax.distributed import hosts
from branch_replay_jax.distributed.mesh import pad_prompts, shard_batch, stack_groups
from branch_replay_jax.gradients.heads import Policy
from branch_replay_jax.gradients.step import PACKED, batch_forward, compiled_programs, leaf_siblings, make_train_step
from branch_replay_jax.models.lora import WithBase, adapters_off
from branch_replay_jax.algorithms.groups import Group, logprob_temperature, step_groups
from branch_replay_jax.rollout.collect import completion_budget
from branch_replay_jax.rollout.environments import close_environment

LOGPROB_TEMPERATURES = ("one", "sampling")


def clip_range(loss_config) -> tuple[float, float]:
  """(ε_low, ε_high) of the ratio clip [1 - ε_low, 1 + ε_high]: loss.clip_eps_low and loss.clip_eps_high
  (equal: PPO's symmetric clip; ε_high > ε_low: DAPO's clip-higher, arXiv 2503.14476 eq. 10).

  A loss.clip_eps field (PPO's) is refused by `schema.parse`, which every caller runs first.

  Raises:
    ValueError: ε_low outside (0, 1), ε_high not a finite number > 0, ε_low > ε_high (clip-higher
      reversed).
  """
  low, high = loss_config.clip_eps_low, loss_config.clip_eps_high
  checks.check_number("loss.clip_eps_low", low, lambda v: 0 < v < 1, "in (0, 1)")
  checks.check_number("loss.clip_eps_high", high, lambda v: 0 < v < float("inf"), "a finite number > 0")
  if low > high:
    raise ValueError(f"loss.clip_eps_low={low!r} > loss.clip_eps_high={high!r}: clip-higher reversed (DAPO raises "
                     "the upper bound, e.g. low 0.2, high 0.28); swap them or set them equal")
  return float(low), float(high)


def validate_options(config) -> None:
  """Raise ValueError (naming the field and value) for the GRPO options (docs/design.md, "GRPO
  options"): clip range, importance ratio, log-prob temperature, the loss weighting, overlong
  shaping and dynamic sampling. `schema.parse` has checked the types (bools, ints, numbers)."""
  l, r, t = config.loss, config.rollout, config.train
  clip_range(l)
  if l.importance_ratio not in obj.IMPORTANCE_RATIOS:
    raise ValueError(f"loss.importance_ratio={l.importance_ratio!r} is not one of {obj.IMPORTANCE_RATIOS}")
  if l.importance_ratio == "sequence" and r.get("episodes") is not None and t.inner_epochs > 1:
    raise ValueError(f"loss.importance_ratio='sequence' with rollout.episodes and train.inner_epochs={t.inner_epochs}: "
                     "episodes train as a tree, whose node loss does not see GSPO's per-episode ratio off-policy; "
                     "use train.inner_epochs=1 or loss.importance_ratio='token'")
  if l.importance_ratio == "sequence" and r.tree_fanouts and t.inner_epochs > 1:
    raise ValueError(f"loss.importance_ratio='sequence' with rollout.tree_fanouts={tuple(r.tree_fanouts)} and "
                     f"train.inner_epochs={t.inner_epochs}: GSPO's ratio is a mean over a whole trajectory, which a "
                     "tree node's loss does not see off-policy (on-policy it is 1, the token ratio's GRPO); use "
                     "train.inner_epochs=1, group rollouts or loss.importance_ratio='token'")
  if l.importance_ratio == "sequence" and l.weighting != "sequence_mean":
    raise ValueError(f"loss.importance_ratio='sequence' with loss.weighting={l.weighting!r}: GSPO weighs each "
                     "completion once (1 / (G |y_i|), arXiv 2507.18071 eq. 5), a token mean weighs it by its length; "
                     "set loss.weighting='sequence_mean' or use loss.importance_ratio='token'")
  if l.logprob_temperature not in LOGPROB_TEMPERATURES:
    raise ValueError(f"loss.logprob_temperature={l.logprob_temperature!r} is not one of {LOGPROB_TEMPERATURES}")
  budget = completion_budget(r)
  if not 0 <= l.overlong_buffer <= budget:
    raise ValueError(f"loss.overlong_buffer={l.overlong_buffer!r} must be an int in [0, {budget}] (the completion "
                     "budget; 0 disables the overlong penalty)")
  checks.check_number("loss.overlong_penalty", l.overlong_penalty, lambda v: 0 <= v < float("inf"),
                    "a finite number >= 0")
  cap, quota = r.max_prompt_draws, r.prompts_per_step
  if not r.dynamic_sampling:
    if cap is not None:
      raise ValueError(f"rollout.max_prompt_draws={cap!r} applies to rollout.dynamic_sampling=True only; "
                       "set it to None")
    return
  if cap is None or cap < quota or cap % quota:
    raise ValueError(f"rollout.max_prompt_draws={cap!r} must be a multiple of rollout.prompts_per_step={quota} "
                     "(prompts are drawn in rounds of a step's quota), at least one round")
  if jax.process_count() > 1:
    raise ValueError(f"rollout.dynamic_sampling=True on {jax.process_count()} processes: the kept groups may lie on "
                     "other processes than their data rows; use one process")


def validate(config, experiment=None):
  """Raise ValueError (naming the field and value) for GRPO / RLOO settings that cannot run or would
  be ignored: the schema's fields and types (`schema.parse`, unless `experiment` is its result
  already), the advantage estimator's fields and the KL coefficient, `checks.validate`, then
  `validate_options`. Returns the parsed experiment (`schema.GRPOExperiment`)."""
  experiment = experiment or schema.parse(config, expect="grpo")
  l = config.loss
  if l.advantage not in obj.ADVANTAGES:
    raise ValueError(f"loss.advantage={l.advantage!r} is not one of {obj.ADVANTAGES}")
  if l.advantage == "rloo" and "advantage_eps" in l:
    raise ValueError(f"loss.advantage_eps={l.advantage_eps!r} applies to loss.advantage='grpo' only (RLOO divides "
                     "by no standard deviation); remove the field")
  if l.advantage == "grpo" and not l.advantage_eps >= 0:
    raise ValueError(f"loss.advantage_eps={l.advantage_eps!r} must be >= 0")
  if l.kl_coef < 0:
    raise ValueError(f"loss.kl_coef={l.kl_coef} must be >= 0")
  checks.check_number("loss.router_aux_coef", l.get("router_aux_coef", 0.0), lambda v: 0 <= v < float("inf"),
                      "a finite number >= 0")
  k = config.train.exactness_check_every
  if k < 0:
    raise ValueError(f"train.exactness_check_every={k!r} must be an int >= 0 (0: off)")
  checks.validate(config)
  validate_options(config)
  checks.validate_correction(config)
  return experiment


def objective(config, tree: bool):
  """The step's objective (losses.grpo_objective, for a group's completions and a tree's nodes alike)
  with the config's clip range (`clip_range`), importance ratio, KL coefficient and on-policy setting.
  A tree takes the token ratio: `validate_options` allows GSPO's sequence ratio on trees only
  on-policy, where it equals the token ratio in value and gradient."""
  l, t = config.loss, config.train
  low, high = clip_range(l)
  return functools.partial(obj.grpo_objective, clip_eps=low, clip_eps_high=high, kl_coef=l.kl_coef,
                           on_policy=t.inner_epochs == 1, importance_ratio="token" if tree else l.importance_ratio)


class GRPOFunctions:
  """The jitted pieces of a step; the graphdef and the objective are static (compiled per shape).

  Every piece takes the step's one update unit (`units`): its groups (or trees) stacked [B, ...]
  (on one device, `placement.stack_on_device`; with a mesh, sharded). train_step is the step itself,
  `gradients.step.make_train_step`: every group's gradient, their mean and the optimizer update in
  one program with donated params and opt_state, called as train_step(params, opt_state, unit,
  len(groups), frozen, keep), metrics {"loss", "aux": (Σ k3 KL, Σ clipped), "grad_norm"} (per group
  [B] on one device, summed on a mesh). logprobs returns the per-token
  log-probs laid out like the unit's tokens (`gradients.step.batch_forward`).
  With LoRA (config.lora), `frozen` is the base model's state: both then take the adapters as
  params and the model is `models.lora.WithBase(graphdef, frozen)`, so only adapters are
  differentiated; the reference is logprobs(models.lora.adapters_off(adapters), unit).
  """

  def __init__(self, config, graphdef, frozen=None, optimizer=None, layout: schema.Layout | None = None):
    t = config.train
    # Trees and episode trees (data/episodes.py; rollout.episodes.share = "tree") take the token ratio;
    # groups, and every layout's rows, loss.importance_ratio (`objective`, `schema.Layout.tree`).
    layout = layout or schema.layout_of(schema.parse(config, expect="grpo"))
    # loss.rollout_correction (correction.py): its factors and metrics from the batch's old and sampler log-probs.
    self.correction = correction = checks.rollout_correction(config)
    self.correct = jax.jit(functools.partial(correct, correction=correction))
    naive = layout.gradient == "naive"
    self.mesh, self.param_mode = mesh_from(config), placement.param_layout(config)
    self.objective = objective(config, layout.tree)
    # The level layouts the step compiled: a later step's trees pad onto one that holds them. With
    # train.tree_schedule = "packed" each tree is one row instead (data.batches.pack_trees, one device).
    self.tree_layouts = TreeLayouts()
    self.packed = layout.tree and t.tree_schedule == PACKED
    tau = logprob_temperature(config)
    cast, upcast = runs.param_casts(config)
    # LoRA's base on the mesh: placed like the parameters (mesh.params: FSDP or replicated) and
    # passed into the step's shard_map (gradients.step), never differentiated. The run-time check
    # runs on one device: on a mesh it takes a device copy of the base for the check (`exactness`).
    self.cast, self.frozen = cast, placement.place(frozen, self.mesh, self.param_mode)
    # The policy head: log-probs at τ and, for a mixture of experts, the load-balancing loss (loss.router_aux_coef).
    head = Policy(temperature=tau, router_aux_coef=config.loss.get("router_aux_coef", 0.0),
                  routing_replay=config.model.get("routing_replay", False))
    self.check = ExactnessCheck(config, graphdef, {"group": objective(config, False), "tree": objective(config, True)},
                                cast, upcast, frozen if self.mesh is None else None, head=head,
                                correction=correction)
    mesh, layout = self.mesh, "naive" if naive else "replay"
    # With trees, EOS changes how many trajectories (naive) or leaf siblings (replay) there are: each
    # compiled shape uses the largest divisor of that count (per device) not above train.micro_batch.
    mb = lambda b: fit_micro_batch(t.micro_batch, leaf_siblings(b, mesh))
    logprobs = lambda g, p, b: batch_forward(head, g, p, b, layout=layout, mesh=mesh, micro_batch=mb(b))
    # The model of a step: the graphdef, or with LoRA the graphdef bound to the (traced) base state.
    model = lambda f: graphdef if f is None else WithBase(graphdef, f)
    logprobs_jit = jax.jit(lambda p, f, b: logprobs(model(f), cast(p), b))
    self.logprobs = lambda p, b: logprobs_jit(p, self.frozen, b)
    # One program per optimizer step, on one device and on the mesh alike (the step
    # benchmarks/sharded_memory.py compiles): every group's gradient, their mean, the update.
    self.train_step = None if optimizer is None else make_train_step(
        head, graphdef, optimizer, self.objective, mesh=mesh, layout=layout, micro_batch=t.micro_batch,
        schedule=t.tree_schedule, reduce_aux=obj.grpo_aux_sums, cast=cast, upcast=upcast)

  def units(self, groups: list[Group]) -> list[tuple[str, RolloutBatch]]:
    """[(kind, arrays)]: the step's one update unit, its groups (trees) as one stacked batch. One
    device: `placement.stack_on_device`, or with train.tree_schedule = "packed" each tree one row
    (`pack_trees`: one row length and trajectory count for the step). A mesh: trees padded to one level layout by `pad_trees`,
    whose padding adds exact zeros to loss, gradient and metrics; prompts to one length by
    `pad_prompts`; with several processes, each passes its own groups, those with a batch, as its
    part of it, and for trees, which every process holds, the whole batch."""
    kind, local = groups[0].kind, [g.batch for g in groups if g.batch is not None]
    if self.packed and kind == "tree":
      return [(kind, stack_groups(pack_trees(local)))]
    if self.mesh is None:
      return [(kind, placement.stack_on_device(local, self.tree_layouts))]
    if kind == "tree":
      # Every process holds every tree (`collect`: whole), so all pad them to one shape, the
      # step's largest, and each places its own rows of the whole batch.
      branch = self.mesh.shape["branch"]   # an episode tree's first fan-out is padded to a multiple of it
      return [(kind, placement.on_mesh(pad_trees(local, self.tree_layouts, branch=branch), self.mesh))]
    longest = hosts.global_max(max(b.prompt_ids.shape[0] for b in local))
    batch = stack_groups(pad_prompts(local, self.mesh.shape["seq"], longest=longest))
    return [(kind, shard_batch(batch, self.mesh, num_groups=len(groups)))]

  def place(self, tree):
    """Parameters or optimizer state onto the mesh in config.mesh.params's layout (`placement.place`)."""
    return placement.place(tree, self.mesh, self.param_mode)

  def for_sampling(self, graphdef, params, devices):
    """The policy the sampler runs (`placement.sampling_policy`): the model on one device, or {device:
    the model on a full copy of the parameters on it} for this process's sampling `devices`."""
    params = self.cast(params)   # the policy the step trains: model.param_dtype's rounding of the master
    if devices is None and self.frozen is not None:
      return nnx.merge(graphdef, params, self.frozen)   # LoRA on one device: adapters + base
    return placement.sampling_policy(graphdef, params, self.mesh, devices, frozen=self.frozen)


def update_on_batch(config, fns: GRPOFunctions, params, ref_params, opt_state, groups: list[Group],
                    keep: int | None = None):
  """Reference (and old) log-probs, then inner_epochs updates on the step's groups, each one jitted
  program (`GRPOFunctions.train_step`), its metrics fetched once at the step's end. Old log-probs are
  computed with train.inner_epochs > 1, a loss.rollout_correction or train.max_staleness > 0 (so a stale
  batch's mismatch is logged even uncorrected); with them, where the batch has
  the sampler's log-probs, the correction's factors and metrics (`correction.correct`). Returns (params,
  opt_state, stats, kept): `kept` is group `keep`'s (loss, Σ k3 KL, gradient) of the first epoch,
  at the given params (the run-time exactness check's step side, one device), or None."""
  (_, batch), = fns.units(groups)
  if config.loss.kl_coef:
    batch = with_logprobs(batch, "ref_logp", fns.logprobs(ref_params, batch))
  correction = {}
  if config.train.inner_epochs > 1 or fns.correction.active or max_staleness(config):
    batch = with_logprobs(batch, "old_logp", fns.logprobs(params, batch))
    if has_sampler_logprobs(batch):   # the sampler's mismatch, logged whenever old log-probs are computed
      batch, correction = fns.correct(batch)
    elif fns.correction.active:
      raise ValueError(f"loss.rollout_correction={fns.correction.mode!r}: this step's rollouts carry no sampler "
                       "log-probs (a sampler that records none); use loss.rollout_correction='none'")
  kept = None
  for epoch in range(config.train.inner_epochs):
    index = None if keep is None or epoch else jnp.int32(keep)
    params, opt_state, out = fns.train_step(params, opt_state, batch, len(groups), fns.frozen, index)
    if index is not None:
      kept = out.pop("kept_grads")
    if epoch == 0:
      first = out
  # One host sync per step: each sum in group order, in Python floats (a mesh step's are its batch sums).
  (losses, (kls, clips, routing)), grad_norm, own, correction = jax.device_get((
      (out["loss"], out["aux"]), out["grad_norm"], None if kept is None else (first["loss"], first["aux"]), correction))
  loss, kl, clipped = (sum(float(x) for x in np.atleast_1d(v)) for v in (losses, kls, clips))
  if kept is not None:
    kept = (own[0][keep], own[1][0][keep], kept)
  pairs = max(sum(g.loss_tokens for g in groups), 1)   # (token, trajectory) pairs in the loss
  stats = {"loss": loss / len(groups), "grad_norm": float(grad_norm), "kl": kl / pairs, "clip_frac": clipped / pairs,
           "step_compiles": compiled_programs(fns.train_step), **{k: float(v) for k, v in correction.items()}}
  # A mixture of experts' routing (`losses.grpo_aux_sums`): each the mean over groups of their trajectories' mean,
  # the last epoch's; router_aux with loss.router_aux_coef > 0, routing_mismatch where the sampler recorded routes.
  stats.update({k: sum(float(x) for x in np.atleast_1d(v)) / len(groups) for k, v in routing.items()})
  return params, opt_state, stats, kept


class GRPO(base.Algorithm):
  """GRPO / RLOO: groups or trees sampled by the current policy, reference log-probs of the initial one
  (with LoRA: of the base model, the adapters set to zero, `models.lora.adapters_off`)."""

  name = "grpo"
  keep_initial = True

  def __init__(self, config, experiment=None):
    self.layout = schema.layout_of(validate(config, experiment))   # resolved once, passed on
    super().__init__(config)
    self.task = runs.make_task_from(config)
    self.env = runs.make_episode_environment(config, self.task)   # None without rollout.episodes
    self.draw_metrics = {}   # step -> dynamic sampling's metrics, from collect (a producer thread's) to log
    self.rollout = placement.rollout_devices(config)   # the rollout sub-mesh (mesh.rollout_devices), or []

  def close(self) -> None:
    close_environment(self.env)   # the protocol's optional close (rollout/environments.py)

  def setup(self, run):
    self.run = run
    self.fns = GRPOFunctions(self.config, run.graphdef, run.frozen, run.optimizer, layout=self.layout)
    self.ref_params = (self.fns.place(run.initial_params) if run.frozen is None else
                       self.fns.place(adapters_off(run.params)))   # LoRA: the base model, no second copy of it
    return self.fns.place(run.params), self.fns.place(run.opt_state)

  def collect(self, run, params, step, data_pos):
    """The step's groups (groups.step_groups over loop.sample_groups); keeps the draw's metrics
    (dynamic sampling: prompts_drawn, dropped_groups) for this step's `log`. On a mesh every round
    of dynamic sampling samples data-parallel on the same devices; with mesh.rollout_devices, on the
    rollout sub-mesh, group i on its device i mod r, from a copy of `params` sent there. Trees: with several processes
    every process receives every tree's arrays (`whole`), as the padded shape of the step's trees is
    that of the largest over all processes."""
    if self.env is not None and (self.fns.mesh is not None or self.rollout):   # episodes: one environment, one sampler
      policy, devices = self.one_device_policy(run, params), None
    else:
      devices = placement.sampling_devices(self.fns.mesh, self.config.rollout.prompts_per_step, self.rollout)
      policy = self.fns.for_sampling(run.graphdef, params, devices)
    whole = bool(self.config.rollout.tree_fanouts)
    draw = lambda key, pos: loop.sample_groups(self.config, policy, run.tokenizer, self.task, key, step, pos,
                                               devices=devices, whole=whole, env=self.env, layout=self.layout)
    groups, data_pos, self.draw_metrics[step] = step_groups(self.config, draw, run.key, data_pos)
    return groups, data_pos

  def update(self, params, opt_state, groups, step):
    """One step's update; with the run-time exactness check due, the check too (algorithms/exactness.py):
    on one device the layout the step does not compute for the checked group, before the update
    donates `params`, compared with the step's own; on a mesh both layouts by the check (`exactness`)."""
    check, fns, index = {}, self.fns, None
    if fns.check.due(step) and fns.mesh is not None:
      check = self.exactness(params, groups)
    elif fns.check.pending:   # (due on one device)
      t0 = time.perf_counter()
      index = fns.check.pick(groups)
      fns.check.pending = index is None   # no group with unequal rewards: check at the next step
      if index is not None:
        layout = "replay" if self.layout.gradient == "naive" else "naive"
        other = jax.block_until_ready(fns.check.compute(layout, params, self.ref_params, groups[index]))
        seconds = time.perf_counter() - t0
    with placement.mesh_context(fns.mesh):
      params, opt_state, stats, own = update_on_batch(self.config, fns, params, self.ref_params, opt_state, groups,
                                                      keep=index)
    if index is not None:
      replay, naive = (other, own) if layout == "replay" else (own, other)
      check = fns.check.compare(groups[index], replay, naive, seconds)
    return params, opt_state, {**stats, **check}

  def exactness(self, params, groups) -> dict:
    """The run-time exactness check of a mesh step (algorithms/exactness.py), both layouts on a full
    copy of the parameters on process 0's first device, its figures shared with every process."""
    device = jax.local_devices()[0]
    with jax.set_mesh(self.fns.mesh):
      p, ref = (hosts.device_copies(x, self.fns.mesh, [device])[device] for x in (params, self.ref_params))
      if self.fns.frozen is not None:   # LoRA: the base on the check's device, for the check only
        self.fns.check.frozen = hosts.device_copies(self.fns.frozen, self.fns.mesh, [device])[device]
    out = hosts.allgather_objects(self.fns.check(p, ref, groups) if hosts.is_primary() else None)[0]
    self.fns.check.frozen = None
    self.fns.check.pending = out is None   # no group with unequal rewards: check at the next step
    return out or {}

  def eval_policy(self, run, params, num_problems):
    """The policy `collect` samples with; on a mesh the problems spread over every device (episodes:
    `one_device_policy`)."""
    if self.env is not None and self.fns.mesh is not None:
      return self.one_device_policy(run, params), None
    devices = placement.spread_devices(self.fns.mesh, num_problems)
    return self.fns.for_sampling(run.graphdef, params, devices), devices

  def one_device_policy(self, run, params):
    """Episodes on a mesh sample one after another on this process's first device (its first of the rollout
    sub-mesh, with mesh.rollout_devices), from a full copy of
    the parameters: the run has one environment object, which an episode's reset and steps change
    (and TextArena and GEM swap the global `random` state around each call), so the threads that
    sample groups on every device at once would interleave its episodes. Same keys as one device."""
    mine = [d for d in self.rollout if d.process_index == jax.process_index()]
    device = (mine or jax.local_devices())[0]   # this process's first device of the rollout sub-mesh, if any
    return self.fns.for_sampling(run.graphdef, params, [device])[device]

  def log(self, bar, step, groups, stats, *, rollout_s, update_s, wall_s):
    return loop.log_step(self.config, bar, step, groups, {**stats, **self.draw_metrics.pop(step)}, rollout_s=rollout_s,
                         update_s=update_s, wall_s=wall_s)


def train(config, experiment=None) -> list[dict]:
  """Run the experiment in `config` (see experiments/grpo_smollm2_arith.py); returns the metrics of this run."""
  return loop.train(config, GRPO(config, experiment))
