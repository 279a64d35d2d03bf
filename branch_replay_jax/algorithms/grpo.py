"""GRPO (and RLOO) for the training loop (algorithms/loop.py): reference log-probs, the replay gradient, AdamW.

One step, for each of `prompts_per_step` prompts of a reasoning-gym task:
  1. chat-format the problem and sample G completions sharing one prefill (rollout/sampler.py);
  2. score them with the task's verifier (rollout/tasks/);
  3. group-normalised advantages (losses.group_advantages), or RLOO's leave-one-out ones
     (losses.rloo_advantages) with loss.advantage = "rloo";
  4. reference log-probs of the frozen initial policy by forward-only replay, for the k3 KL;
  5. the GRPO gradient of the group by replay (or naive, for comparison); gradients are averaged
     over the step's groups, clipped by global norm and applied with optax AdamW.
Steps 1-3 are rollout/collect.py (loop.sample_groups; collect.step_groups adds DAPO's dynamic
sampling and the step-level token mean); 4-5 are `update_on_batch`. The loss options of today's
GRPO practice (clip-higher, GSPO's sequence ratio, log-probs at the sampling temperature, overlong
shaping and masking, the aggregation) are config fields checked by `validate` (docs/design.md,
"GRPO options").
With a device mesh (config.mesh: data x branch x seq > 1, distributed/mesh.py), steps 4-5 run on
the step's groups stacked into one batch (prompts padded to one length) under `shard_map`: groups
over `data`, completions over `branch`, prompt tokens over `seq`; parameters and optimizer state
replicated or FSDP-sharded (mesh.params). Sampling (1) runs on the first device, on a copy of the
parameters gathered there.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from branch_replay_jax import losses as obj
from branch_replay_jax.algorithms import loop
from branch_replay_jax.algorithms.loop import mesh_from
from branch_replay_jax.core.accumulate import fit_micro_batch
from branch_replay_jax.data.batches import GroupBatch, TreeBatch, num_branches
from branch_replay_jax.distributed.mesh import (pad_prompts, shard_batch, shard_params, sharded_replay_logprobs,
                                                sharded_replay_value_and_grad, stack_groups)
from branch_replay_jax.gradients.logprobs import (naive_logprobs, naive_value_and_grad, replay_logprobs,
                                                  replay_value_and_grad, tree_replay_logprobs,
                                                  tree_replay_value_and_grad)
from branch_replay_jax.rollout import collect as rollouts
from branch_replay_jax.rollout.collect import Group

LOGPROB_TEMPERATURES = ("one", "sampling")
AGGREGATIONS = ("group_mean", "step_token_mean")


def clip_range(loss_config) -> tuple[float, float]:
  """(ε_low, ε_high) of the ratio clip [1 - ε_low, 1 + ε_high]: loss.clip_eps_low and loss.clip_eps_high
  (equal: PPO's symmetric clip; ε_high > ε_low: DAPO's clip-higher, arXiv 2503.14476 eq. 10).

  Raises:
    ValueError: a loss.clip_eps field (GRPO's clip range is the two fields; one name, one meaning),
      ε_low outside (0, 1), ε_high not a finite number > 0.
  """
  if "clip_eps" in loss_config:
    raise ValueError(f"loss.clip_eps={loss_config.clip_eps!r}: GRPO's clip range is loss.clip_eps_low and "
                     "loss.clip_eps_high (set both equal for the symmetric clip); remove loss.clip_eps")
  low, high = loss_config.clip_eps_low, loss_config.clip_eps_high
  loop.check_number("loss.clip_eps_low", low, lambda v: 0 < v < 1, "in (0, 1)")
  loop.check_number("loss.clip_eps_high", high, lambda v: 0 < v < float("inf"), "a finite number > 0")
  return float(low), float(high)


def logprob_temperature(config) -> float:
  """τ of the trainer's log-probs: rollout.temperature with loss.logprob_temperature = "sampling"
  (the distribution the sampler drew from), 1 with "one" (docs/design.md, "Log-prob temperature")."""
  return float(config.rollout.temperature) if config.loss.logprob_temperature == "sampling" else 1.0


def validate_options(config) -> None:
  """Raise ValueError (naming the field and value) for the GRPO options (docs/design.md, "GRPO
  options"): clip range, importance ratio, log-prob temperature, aggregation, truncation masking,
  overlong shaping and dynamic sampling."""
  l, r, t = config.loss, config.rollout, config.train
  clip_range(l)
  if l.importance_ratio not in obj.IMPORTANCE_RATIOS:
    raise ValueError(f"loss.importance_ratio={l.importance_ratio!r} is not one of {obj.IMPORTANCE_RATIOS}")
  if l.importance_ratio == "sequence" and r.tree_fanouts and t.inner_epochs > 1:
    raise ValueError(f"loss.importance_ratio='sequence' with rollout.tree_fanouts={tuple(r.tree_fanouts)} and "
                     f"train.inner_epochs={t.inner_epochs}: GSPO's ratio is a mean over a whole trajectory, which a "
                     "tree node's loss does not see off-policy (on-policy it is 1, the token ratio's GRPO); use "
                     "train.inner_epochs=1, group rollouts or loss.importance_ratio='token'")
  if l.logprob_temperature not in LOGPROB_TEMPERATURES:
    raise ValueError(f"loss.logprob_temperature={l.logprob_temperature!r} is not one of {LOGPROB_TEMPERATURES}")
  if l.aggregation not in AGGREGATIONS:
    raise ValueError(f"loss.aggregation={l.aggregation!r} is not one of {AGGREGATIONS}")
  if l.aggregation == "step_token_mean" and l.normalisation != "token_mean":
    raise ValueError(f"loss.aggregation='step_token_mean' is the token mean over the whole step and replaces "
                     f"loss.normalisation={l.normalisation!r}; set loss.normalisation='token_mean'")
  if not isinstance(l.mask_truncated, bool):
    raise ValueError(f"loss.mask_truncated={l.mask_truncated!r} must be a bool")
  budget = rollouts.completion_budget(config)
  if isinstance(l.overlong_buffer, bool) or not isinstance(l.overlong_buffer, int) or \
     not 0 <= l.overlong_buffer <= budget:
    raise ValueError(f"loss.overlong_buffer={l.overlong_buffer!r} must be an int in [0, {budget}] (the completion "
                     "budget; 0 disables the overlong penalty)")
  loop.check_number("loss.overlong_penalty", l.overlong_penalty, lambda v: 0 <= v < float("inf"),
                    "a finite number >= 0")
  if not isinstance(r.dynamic_sampling, bool):
    raise ValueError(f"rollout.dynamic_sampling={r.dynamic_sampling!r} must be a bool")
  cap, quota = r.max_prompt_draws, r.prompts_per_step
  if not r.dynamic_sampling:
    if cap is not None:
      raise ValueError(f"rollout.max_prompt_draws={cap!r} applies to rollout.dynamic_sampling=True only; "
                       "set it to None")
    return
  if isinstance(cap, bool) or not isinstance(cap, int) or cap < quota or cap % quota:
    raise ValueError(f"rollout.max_prompt_draws={cap!r} must be a multiple of rollout.prompts_per_step={quota} "
                     "(prompts are drawn in rounds of a step's quota), at least one round")
  if jax.process_count() > 1:
    raise ValueError(f"rollout.dynamic_sampling=True on {jax.process_count()} processes: the kept groups may lie on "
                     "other processes than their data rows; use one process")


def validate(config) -> None:
  """Raise ValueError (naming the field and value) for GRPO / RLOO settings that cannot run or would
  be ignored: the advantage estimator's fields and the KL coefficient, `loop.validate`, then
  `validate_options`."""
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
  loop.validate(config)
  validate_options(config)


class GRPOFunctions:
  """The jitted pieces of a step; the graphdef and the objective are static (compiled per shape).

  grad and logprobs take one update unit (`units`): a group's or tree's arrays on one device, or,
  with a mesh, the step's groups stacked [B, ...] and sharded. grad returns (loss, aux, grads)
  summed over the unit's completions; logprobs the per-token log-probs laid out like its tokens.
  """

  def __init__(self, config, graphdef):
    t, l = config.train, config.loss
    naive = t.gradient == "naive"
    tree = bool(config.rollout.tree_fanouts) and not naive
    self.mesh, self.param_mode = mesh_from(config), config.mesh.params
    low, high = clip_range(l)
    ratio = {} if tree else {"importance_ratio": l.importance_ratio}   # trees: token ratio, on-policy (validate)
    self.objective = functools.partial(obj.grpo_tree_objective if tree else obj.grpo_objective, clip_eps=low,
                                       clip_eps_high=high, kl_coef=l.kl_coef, on_policy=t.inner_epochs == 1, **ratio)
    tau = logprob_temperature(config)
    cast, upcast = loop.param_casts(config)
    self.cast = cast
    if self.mesh is not None:
      mesh, m = self.mesh, t.micro_batch
      grad = lambda p, b: sharded_replay_value_and_grad(graphdef, p, b, self.objective, mesh, micro_batch=m,
                                                        temperature=tau)
      logprobs = lambda p, b: sharded_replay_logprobs(graphdef, p, b, mesh, micro_batch=m, temperature=tau)
    else:
      grad_fn = (naive_value_and_grad if naive else replay_value_and_grad if not tree else
                 functools.partial(tree_replay_value_and_grad, schedule=t.tree_schedule))
      lp_fn = naive_logprobs if naive else tree_replay_logprobs if tree else replay_logprobs
      # With trees, EOS changes how many trajectories (naive) or leaf siblings (replay) there are:
      # each compiled shape uses the largest divisor of that count not above train.micro_batch.
      grad = lambda p, a: grad_fn(graphdef, p, a, self.objective,
                                  micro_batch=fit_micro_batch(t.micro_batch, num_branches(a)), temperature=tau)
      logprobs = lambda p, a: (lp_fn(graphdef, p, a, temperature=tau) if naive else
                               lp_fn(graphdef, p, a, micro_batch=fit_micro_batch(t.micro_batch, num_branches(a)),
                                     temperature=tau))

    def grad_step(p, b):
      loss, aux, grads = grad(cast(p), b)
      return loss, aux, upcast(grads)
    self.grad = jax.jit(grad_step)
    self.logprobs = jax.jit(lambda p, b: logprobs(cast(p), b))

  def units(self, groups: list[Group]) -> list[tuple[str, GroupBatch | TreeBatch]]:
    """(kind, arrays) per update unit: each group or tree, or one stacked batch on the mesh."""
    if self.mesh is None:
      return [(g.kind, g.batch) for g in groups]
    batch = stack_groups(pad_prompts([g.batch for g in groups], self.mesh.shape["seq"]))
    return [("group", shard_batch(batch, self.mesh))]

  def place(self, tree):
    """Parameters or optimizer state onto the mesh in config.mesh.params's layout
    (distributed.mesh.shard_params); unchanged without a mesh."""
    return tree if self.mesh is None else shard_params(tree, self.mesh, self.param_mode)

  def for_sampling(self, params):
    """The parameters the sampler reads: on the mesh, a copy gathered onto the first device."""
    # A SingleDeviceSharding, not a bare device: device_put(x, device) keeps an FSDP array's
    # sharded type (JAX 0.10), and the sampler's gathers would then ask for an out_sharding.
    params = self.cast(params)   # the policy the step trains: model.param_dtype's rounding of the master
    return params if self.mesh is None else jax.device_put(params, jax.sharding.SingleDeviceSharding(jax.devices()[0]))


def _aux_sums(kind: str, aux) -> tuple[float, float]:
  """(Σ k3 KL, Σ clipped) from a group's aux {"kl", "clipped"} or a tree's per-level NodeOutputs."""
  parts = [aux] if kind == "group" else [level.aux for level in aux]
  return sum(float(np.sum(p["kl"])) for p in parts), sum(float(np.sum(p["clipped"])) for p in parts)


def _with_logprobs(batch: GroupBatch | TreeBatch, name: str, logp) -> GroupBatch | TreeBatch:
  """The unit with per-token log-probs in field `name` ("ref_logp" or "old_logp"): [(B,) G, T] per
  branch, or a tree's per-level [F_1..F_d, T_d]."""
  if isinstance(batch, TreeBatch):
    return batch.replace(levels=tuple(level.replace(**{name: lp}) for level, lp in zip(batch.levels, logp)))
  return batch.replace(branches=batch.branches.replace(**{name: logp}))


def update_on_batch(config, fns: GRPOFunctions, update, params, ref_params, opt_state, groups: list[Group]):
  """Reference (and old) log-probs, then inner_epochs updates on the step's groups."""
  units = []
  for kind, batch in fns.units(groups):
    if config.loss.kl_coef:
      batch = _with_logprobs(batch, "ref_logp", fns.logprobs(ref_params, batch))
    if config.train.inner_epochs > 1:
      batch = _with_logprobs(batch, "old_logp", fns.logprobs(params, batch))
    units.append((kind, batch))
  for _ in range(config.train.inner_epochs):
    total, loss, aux = None, 0.0, []
    for _, arrays in units:
      unit_loss, unit_aux, grads = fns.grad(params, arrays)
      total = grads if total is None else jax.tree_util.tree_map(jnp.add, total, grads)
      loss, aux = loss + float(unit_loss), aux + [unit_aux]
    mean = jax.tree_util.tree_map(lambda x: x / len(groups), total)
    params, opt_state, grad_norm = update(params, opt_state, mean)
  pairs = max(sum(g.loss_tokens for g in groups), 1)   # (token, trajectory) pairs in the loss
  sums = [_aux_sums(kind, a) for (kind, _), a in zip(units, aux)]
  stats = {"loss": loss / len(groups), "grad_norm": float(grad_norm),
           "kl": sum(k for k, _ in sums) / pairs, "clip_frac": sum(c for _, c in sums) / pairs}
  return params, opt_state, stats


class GRPO(loop.Algorithm):
  """GRPO / RLOO: groups or trees sampled by the current policy, reference log-probs of the initial one."""

  name = "grpo"
  keep_initial = True

  def __init__(self, config):
    validate(config)
    super().__init__(config)
    self.task = loop.make_task_from(config)

  def setup(self, run):
    self.run, self.fns, self.update_fn = run, GRPOFunctions(self.config, run.graphdef), loop.make_update(run.optimizer)
    self.ref_params = self.fns.place(run.initial_params)
    return self.fns.place(run.params), self.fns.place(run.opt_state)

  def collect(self, run, params, step, data_pos):
    """The step's groups (collect.step_groups over loop.sample_groups); keeps the draw's metrics
    (dynamic sampling: prompts_drawn, dropped_groups) for this step's `log`."""
    policy = nnx.merge(run.graphdef, self.fns.for_sampling(params))
    draw = lambda key, pos: loop.sample_groups(self.config, policy, run.tokenizer, self.task, key, step, pos)
    groups, data_pos, self.draw_metrics = rollouts.step_groups(self.config, draw, run.key, data_pos)
    return groups, data_pos

  def update(self, params, opt_state, groups, step):
    with contextlib.nullcontext() if self.fns.mesh is None else jax.set_mesh(self.fns.mesh):
      return update_on_batch(self.config, self.fns, self.update_fn, params, self.ref_params, opt_state, groups)

  def log(self, bar, step, groups, stats, *, rollout_s, update_s):
    return loop.log_step(self.config, bar, step, groups, {**stats, **self.draw_metrics}, rollout_s=rollout_s,
                         update_s=update_s)


def train(config) -> list[dict]:
  """Run the experiment in `config` (see experiments/grpo_smollm2_arith.py); returns the metrics of this run."""
  return loop.train(config, GRPO(config))
