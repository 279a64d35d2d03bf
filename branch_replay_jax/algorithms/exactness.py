"""Exactness at run time: every `train.exactness_check_every` steps, one group's gradient by replay
and the naive way, compared (docs/design.md, "Exactness at run time").

The check takes the step's first group with unequal rewards, with the parameters the step's
gradient is taken at, and compares on one device:
  replay: the group's (or tree's) loss, KL and clip sums and gradient by replay;
  naive:  the same from the prompt repeated per completion (a tree's trajectories laid out as a
          group, `Group.naive_batch`), its reference and old log-probs from the naive forward too.
On one device one side is the step's own: the step's scan computes every group's loss and
gradient and, on a check step, returns the checked group's too (`gradients.step.make_train_step`,
keep; `grpo.update_on_batch`), so the check keeps it and computes only the other layout
(`compute`): the naive one in a replay run, replay in a naive run. What is checked is then the
gradient the optimizer applies, and the check costs one layout, not two. On a mesh the
step's gradient is the step's groups' sum, sharded: the check computes both sides on one device
(`__call__`; the sharded step is checked against replay by tests/test_mesh.py, tests/test_train.py).
It logs, in the step's metrics record:
  exactness_grad_rel_err = ||g_replay - g_naive||_2 / ||g_naive||_2 over all parameters (the
      absolute norm ||g_replay||_2 when g_naive is exactly 0);
  exactness_loss_rel_err, exactness_kl_rel_err: |replay - naive| / max(|naive|, 1) of the
      group's loss and Σ k3 KL (the logged metrics' inputs): relative above 1, absolute below, as a
      loss of cancelling advantages can be ~0 where a relative error means nothing;
  exactness_ok: all three within `BOUNDS[dtype]`;
  exactness_s: the check's own wall seconds (part of the step's update_s): the layout the step did
      not compute, and the comparison.
Above the bound the run warns loudly (`ExactnessWarning`, once per failing check) and records it.
A due check waits for the next step with such a group when every group's rewards are equal: the
gradient is then the KL term's alone, near 0 around the reference policy, and its relative error
is float rounding over a vanishing norm (0.57 on a smoke step whose gradient norm was 3e-8),
which would be a false alarm.
"""

from __future__ import annotations

import time
import warnings

import jax
import jax.numpy as jnp

from branch_replay_jax import losses as obj
from branch_replay_jax.correction import Correction, correct
from branch_replay_jax.core.accumulate import fit_micro_batch
from branch_replay_jax.data.batches import is_group, is_tree, num_branches, pack_trees, with_logprobs
from branch_replay_jax.gradients.heads import Policy
from branch_replay_jax.gradients.step import PACKED, forward, value_and_grad
from branch_replay_jax.models.lora import WithBase

# Relative error allowed between replay and naive, by the step's lowest precision: the exactness
# tests' bounds for float64 and float32 (docs/design.md, "Testing"); bfloat16 rounds each value to
# 2^-8 relative, and a sum of G completions' gradients in another order differs by a few of those.
BOUNDS = {"float64": 1e-10, "float32": 1e-4, "bfloat16": 3e-2}


class ExactnessWarning(UserWarning):
  """Replay's gradient or metrics left the bound of the run's dtype against the naive ones."""


def bound(config) -> float:
  """The relative-error bound for config.model.dtype and param_dtype (the lower precision of the two)."""
  if "bfloat16" in (config.model.dtype, config.model.param_dtype):
    return BOUNDS["bfloat16"]
  return BOUNDS["float64"] if jax.config.jax_enable_x64 else BOUNDS["float32"]


def _rel(a, b) -> float:
  a, b = float(a), float(b)
  return abs(a - b) / max(abs(b), 1.0)


class ExactnessCheck:
  """Replay against naive on one group (module docstring). `objectives` maps "group" and "tree" to
  the step's objective for each layout; `cast` / `upcast` are runs.param_casts's; `frozen`, with
  LoRA, the base state the adapters (params, ref_params) merge with (`models.lora.WithBase`);
  `head`, the step's `Policy` (its τ, `grpo.logprob_temperature`, and load-balancing coefficient), used by both sides;
  `correction`, the step's loss.rollout_correction, applied by both sides from their own old log-probs."""

  def __init__(self, config, graphdef, objectives: dict, cast, upcast, frozen=None, *, head: Policy = Policy(),
               correction: Correction | None = None):
    t = config.train
    self.every, self.bound = t.exactness_check_every, bound(config)
    self.correction = correction if correction is not None and correction.active else None
    self.kl, self.old = bool(config.loss.kl_coef), t.inner_epochs > 1 or self.correction is not None
    mb = lambda b: fit_micro_batch(t.micro_batch, num_branches(b))
    self.frozen = frozen

    def side(layout):
      """(params, frozen, ref_params, batch) -> (loss, Σ k3 KL, gradient) of one layout, its reference and
      old log-probs from the same layout."""
      def fn(p, f, ref, b):
        graph = graphdef if f is None else WithBase(graphdef, f)
        p, ref = cast(p), cast(ref)
        kw = {"layout": layout, "micro_batch": mb(b)}
        if self.kl:
          b = with_logprobs(b, "ref_logp", forward(head, graph, ref, b, **kw))
        if self.old:
          b = with_logprobs(b, "old_logp", forward(head, graph, p, b, **kw))
        if self.correction is not None:
          b = correct(b, self.correction)[0]
        objective = objectives["group" if is_group(b) else "tree"]
        loss, aux, g = value_and_grad(head, graph, p, b, objective, schedule=t.tree_schedule, **kw)
        return loss, obj.grpo_aux_sums(aux)[0], upcast(g)
      return jax.jit(fn)
    self.replay, self.naive = side("replay"), side("naive")
    self.packed = t.tree_schedule == PACKED   # a tree's replay side runs as the step runs it: one packed row
    self.pending = False   # a check came due and found no group with unequal rewards yet

  def due(self, step: int) -> bool:
    """Whether to check at `step` (0-based): every k steps, or a check still pending; the caller
    sets `pending` to whether the check found no group to run on."""
    self.pending = self.pending or (self.every > 0 and (step + 1) % self.every == 0)
    return self.pending

  def pick(self, groups) -> int | None:
    """Index in `groups` of the first with a batch (this process's) and unequal rewards; None if none."""
    return next((i for i, g in enumerate(groups)
                 if g.batch is not None and not bool(obj.constant_groups(g.rewards))), None)

  def compute(self, layout: str, params, ref_params, group) -> tuple:
    """(loss, Σ k3 KL, gradient) of `group` in `layout` ("replay": `group.batch`; "naive": its naive
    layout), at `params` on one device, reference and old log-probs from the same layout."""
    if layout == "replay":
      batch = pack_trees([group.batch])[0] if self.packed and is_tree(group.batch) else group.batch
      return self.replay(params, self.frozen, ref_params, batch)
    naive_batch = group.naive_batch if group.naive_batch is not None else group.batch
    return self.naive(params, self.frozen, ref_params, naive_batch)

  def compare(self, group, replay: tuple, naive: tuple, seconds: float) -> dict:
    """The check's metrics (module docstring) from each layout's (loss, Σ k3 KL, gradient) of
    `group`; warns with `ExactnessWarning` above the bound. `seconds`: the check's time so far."""
    t0 = time.perf_counter()
    (lr, kr, gr), (ln, kn, gn) = replay, naive
    diff = jnp.sqrt(sum(jnp.sum(jnp.square(a.astype(jnp.float32) - b.astype(jnp.float32)))
                        for a, b in zip(jax.tree_util.tree_leaves(gr), jax.tree_util.tree_leaves(gn))))
    norm = float(jnp.sqrt(sum(jnp.sum(jnp.square(b.astype(jnp.float32))) for b in jax.tree_util.tree_leaves(gn))))
    out = {"exactness_grad_rel_err": float(diff) / norm if norm > 0 else float(diff),
           "exactness_loss_rel_err": _rel(lr, ln), "exactness_kl_rel_err": _rel(kr, kn)}
    out["exactness_ok"] = bool(max(out.values()) <= self.bound)
    out["exactness_s"] = seconds + time.perf_counter() - t0
    if not out["exactness_ok"]:
      warnings.warn(f"EXACTNESS CHECK FAILED: replay vs naive on group data_pos={group.sample['data_pos']}: "
                    f"{ {k: out[k] for k in ('exactness_grad_rel_err', 'exactness_loss_rel_err', 'exactness_kl_rel_err')} } above the bound {self.bound:g} "
                    "for this dtype; the replay gradient is not the naive one (please report it)",
                    ExactnessWarning, stacklevel=2)
    return out

  def __call__(self, params, ref_params, groups) -> dict | None:
    """Both layouts computed by the check (the mesh step's case, module docstring) on one of `groups`,
    with `params` and `ref_params` on one device; None when no group has unequal rewards."""
    t0 = time.perf_counter()
    index = self.pick(groups)
    if index is None:
      return None
    group = groups[index]
    replay, naive = (self.compute(layout, params, ref_params, group) for layout in ("replay", "naive"))
    return self.compare(group, replay, naive, time.perf_counter() - t0)
