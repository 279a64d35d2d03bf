"""Nested replay on rollout trees of any depth: every node's forward and backward run once.

A padded tree (data.trees.PaddedTree) is a root (the prompt) and D uniform levels: levels[d] holds the
nodes at depth d + 1 in slots [F_1, ..., F_{d+1}] (PaddedTree's level d + 1, same slot indexing);
slot (i_1, ..., i_{d+1}) is child i_{d+1} of slot (i_1, ..., i_d). A node's forward needs the
outputs of its ancestors (their K/V and the parent's last hidden state); the loss is a sum over
nodes, so by the chain rule

    dθ = Σ_n ∂L_n/∂θ + Σ_n (∂out_n/∂θ)ᵀ · Σ_{c below n} ∂L_c/∂out_n

and each node pulls back once with the cotangents of all its descendants summed (docs/design.md,
"The replay math"). Two schedules compute this same gradient; they differ in what is alive at once:

  "depth_first": a `lax.scan` over the sibling slots of each level, recursing into each child's
      subtree before its siblings' pullback; siblings run m at a time as the rows of one batch (m the
      largest divisor of the level's fan-out not above micro_batch), leaves in micro-batches of m.

        root ─vjp─► children 0..m-1 ─► (child 0's subtree ... child m-1's subtree) ─► their pullback ─► ...

      Residuals alive: one root-to-leaf path of sibling micro-batches (m nodes per level), so peak
      memory does not grow with the number of leaves. One gradient accumulator (threaded through
      the nested scans' carries) and one ancestor-cotangent accumulator. Small matmuls (m
      segments of T_d tokens per step) and a parameter-sized pullback per step: at m = 1 slow
      where the hardware wants big batches; a larger m trades memory for fewer, bigger steps.

  "level": level-synchronous. Level d's nodes run forward together as one batch of rows (the slots
      [F_1..F_{d+1}] flattened; an ancestor's output repeated to its descendants' rows, the root's
      shared) under one `jax.vjp`; the last level runs value_and_grad in micro-batches of its last
      slot axis (m siblings of every parent per step); then the levels pull back from the deepest
      up. The repeat's transpose sums the children's cotangents into their parent (the segment-sum
      over the parent index). A one-level tree (a group) is exactly the rows of
      `core.replay.replay_vjp`.

        root ─vjp─► level 0 (F_1 nodes) ─vjp─► level 1 (F_1 F_2 nodes) ─► ... ─grad─► leaves
             ◄─pullback─           ◄─pullback─                 ◄──────────────────

      Residuals alive: all internal levels at once (memory grows with the number of internal
      nodes) plus one leaf micro-batch across all parents; big matmuls (F_1...F_{d+1} segments per
      call), so much faster on CPUs and accelerators when it fits.

Both are exact: they evaluate the same sum, only the float summation order differs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from branch_replay_jax.core.accumulate import (fit_micro_batch, merge_micro_batches, scan_value_and_grad,
                                              split_micro_batches)
from branch_replay_jax.core.replay import reduce_in_backward

PyTree = Any
SCHEDULES = ("depth_first", "level")


def _is_float(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.inexact)


def _partition(tree: PyTree):
  """(float leaves, rebuild(floats) -> tree): only floating leaves take cotangents."""
  floats, others, spec = _split(tree)
  return floats, lambda fl: _join(fl, others, spec)


def _split(tree: PyTree):
  """(float leaves, the other leaves, spec): the other leaves (int positions) travel beside the floats
  (per row in depth-first's sibling scan) and `_join` puts them back."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  is_float = tuple(_is_float(x) for x in leaves)
  return ([x for x, f in zip(leaves, is_float) if f], [x for x, f in zip(leaves, is_float) if not f],
          _Spec(treedef, is_float))


@dataclasses.dataclass(frozen=True)
class _Spec:
  """Where `_split` took a tree's float leaves from (static: vjp's aux carries it as no leaf)."""
  treedef: Any
  is_float: tuple


jax.tree_util.register_static(_Spec)


def _join(floats, others, spec: _Spec):
  fl, ot = iter(floats), iter(others)
  return jax.tree_util.tree_unflatten(spec.treedef, [next(fl) if f else next(ot) for f in spec.is_float])


def _with_float0(tree, float_cotangents):
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  it = iter(float_cotangents)
  return jax.tree_util.tree_unflatten(treedef, [next(it) if _is_float(x) else np.zeros(x.shape, jax.dtypes.float0)
                                                for x in leaves])


def _add(a, b):
  return jax.tree_util.tree_map(jnp.add, a, b)


def _zeros(tree):
  return jax.tree_util.tree_map(jnp.zeros_like, tree)


def _check(fn_name, node_fns, levels, micro_batch, schedule=SCHEDULES[0]):
  depth = len(levels)
  if depth == 0 or len(node_fns) != depth:
    raise ValueError(f"{fn_name}: need one node_fn per level, got {len(node_fns)} for {depth} levels")
  if schedule not in SCHEDULES:
    raise ValueError(f"{fn_name}: schedule={schedule!r} is not one of {SCHEDULES}")
  last = {x.shape[depth - 1] for x in jax.tree_util.tree_leaves(levels[-1])}
  if len(last) != 1:
    raise ValueError(f"{fn_name}: the last level's leaves disagree on the last slot axis: {sorted(last)}")
  f = last.pop()
  if not isinstance(micro_batch, int) or micro_batch < 1 or f % micro_batch:
    raise ValueError(f"{fn_name}: micro_batch={micro_batch!r} must be a positive divisor of the last fan-out {f}")


def nested_replay_vjp(prefix_fn: Callable[[PyTree], PyTree], node_fns: list[Callable], params: PyTree,
                      levels: list[PyTree], *, micro_batch: int = 1, schedule: str = "depth_first",
                      reduce_prefix_cotangent: Callable[[PyTree], PyTree] | None = None) -> tuple[jax.Array, list, PyTree]:
  """Loss, aux and gradient of Σ over tree nodes of node loss, by nested replay (see the module docstring).

  Args:
    prefix_fn: params -> root output pytree (for a decoder: the prompt's K/V and last hidden state).
    node_fns: one per level d = 0..D-1 (level 0 = children of the root):
      node_fns[d](params, ancestors, nodes) -> (out, loss, aux) for m nodes as rows of one batch:
      nodes has leading axis [m]; ancestors is the tuple of outputs from the root down to the
      parents. The root's output is always shared by the m rows; a deeper ancestor's is either one
      node's, shared by the m rows (depth_first: m siblings of one parent, or one node) or carries
      a leading row axis [m] (level: every row its own parent's; its leaves gained that axis in
      front of the node's own). out: the nodes' output pytree with leading axis [m] (ignored at
      the last level), loss [m] float, aux leading [m].
    params: the differentiated pytree.
    levels: levels[d] is a pytree whose leaves have leading axes [F_1, ..., F_{d+1}] (fan-outs).
    micro_batch: leaf slots per sibling group run together per `lax.scan` step at the last level
      (must divide F_D). depth_first: m leaves of one parent per step, and at an internal level
      the largest divisor of its fan-out not above m siblings of one parent per step; level: m
      leaves of EVERY parent per step (F_1...F_{D-1} m leaves).
    schedule: "depth_first" (least memory) or "level" (fastest); same gradient.
    reduce_prefix_cotangent: applied to the root output's summed cotangent (a list of float
      arrays) before its pullback, as in `core.replay.replay_vjp` (under `shard_map`: the all-reduce
      over the devices holding its children).

  Returns:
    (loss summed over all nodes, aux: list over levels of node_fn's aux stacked on the level's
    slot axes [F_1..F_{d+1}, ...], grads like params).

  Raises:
    ValueError: no levels or not one node_fn per level, an unknown schedule, a micro_batch that
      does not divide the last fan-out.
  """
  _check("nested_replay_vjp", node_fns, levels, micro_batch, schedule)
  last_fanout = jax.tree_util.tree_leaves(levels[-1])[0].shape[len(levels) - 1]
  if schedule == "level" and micro_batch == last_fanout:
    return _one_pass(prefix_fn, node_fns, params, levels, reduce_prefix_cotangent)
  root_out, root_pullback = jax.vjp(prefix_fn, params)
  root = _partition(root_out)
  if schedule == "depth_first":
    # zeros_like of a root output keeps its sharding type (varying under shard_map) for the scan carry.
    loss0 = jnp.zeros_like(root[0][0], shape=(), dtype=_loss_dtype(node_fns[0], params, [root], levels[0], 0))
    loss, aux, d_params, d_anc = _subtree(node_fns, params, [root], levels, micro_batch,
                                          (loss0, _zeros(params), [_zeros(root[0])]))
  else:
    loss, aux, d_params, d_anc = _level_schedule(node_fns, params, root, levels, micro_batch)
  d_root_floats = d_anc[0] if reduce_prefix_cotangent is None else reduce_prefix_cotangent(d_anc[0])
  (d_root,) = root_pullback(_with_float0(root_out, d_root_floats))
  return loss, aux, _add(d_params, d_root)


def _one_pass(prefix_fn, node_fns, params, levels, reduce_prefix_cotangent):
  """The level schedule when the leaves fit one micro-batch: its leaf scan would have one step, so the
  whole tree is one `jax.value_and_grad` of Σ_n node losses, the root and every level forward as rows
  (`_as_rows`), as `core.replay.replay_vjp` does for a group at micro_batch = G. Autodiff sums each
  ancestor's cotangents over its descendants (the transpose of the repeat) and the parameter
  gradients of all levels, with no zero-initialised accumulator, no scan carry and no pullback per
  level adding a parameter-sized gradient to another. Same residuals as the level schedule."""
  def total(p):
    root = prefix_fn(p)
    if reduce_prefix_cotangent is not None:
      root = reduce_in_backward(reduce_prefix_cotangent, root)
    ancestors, loss, auxes = [root], 0.0, []
    for d, fn in enumerate(node_fns):
      out, node_loss, aux = _as_rows(fn, d)(p, tuple(ancestors), levels[d])
      ancestors.append(out)
      loss = loss + jnp.sum(node_loss)
      auxes.append(aux)
    return loss, auxes

  (loss, aux), grads = jax.value_and_grad(total, has_aux=True)(params)
  return loss, aux, grads


def _loss_dtype(fn, params, ancestors, level, d):
  node = jax.tree_util.tree_map(lambda x: x[(0,) * d], level)
  anc = tuple(rb(f) for f, rb in ancestors)
  return jax.eval_shape(lambda p: fn(p, anc, node)[1], params).dtype


def _subtree(node_fns, params, ancestors, levels, micro_batch, acc):
  """Depth-first: all children (one slot axis of levels[0]) of the node whose ancestors are given.

  ancestors: list of (float leaves, rebuild) from the root down. acc = (loss, d_params, d_anc):
  the running sums, d_anc the cotangents of every ancestor's float leaves. Returns
  (loss, aux, d_params, d_anc) with this subtree's contributions added to acc, so the whole
  recursion holds one gradient accumulator.
  """
  d = len(node_fns) - len(levels)
  anc_floats = [f for f, _ in ancestors]
  rebuild = lambda floats: tuple(rb(f) for f, (_, rb) in zip(floats, ancestors))
  fn = node_fns[d]
  f = jax.tree_util.tree_leaves(levels[0])[0].shape[0]   # this node's children

  if len(levels) == 1:   # leaves: value_and_grad of a micro-batch of sibling rows, as in replay_vjp
    def step_loss(primals, mb):
      p, floats = primals
      _, losses, aux = fn(p, rebuild(floats), mb)
      return jnp.sum(losses), aux
    (loss, (d_params, d_anc)), aux = scan_value_and_grad(step_loss, (params, anc_floats),
                                                         split_micro_batches(levels[0], micro_batch),
                                                         (acc[0], (acc[1], acc[2])))
    return loss, [merge_micro_batches(aux, f)], d_params, d_anc

  k = fit_micro_batch(micro_batch, f)   # siblings run forward (and pull back) together, as rows of one batch

  def siblings_step(carry, children):   # k internal siblings, then each one's whole subtree
    loss_acc, d_params, d_anc = carry

    def nodes(p, floats):
      out, loss, aux = fn(p, rebuild(floats), children[0])
      out_floats, others, spec = _split(out)
      return (out_floats, jnp.sum(loss)), (aux, others, spec)
    (out_floats, loss), pullback, (aux, others, spec) = jax.vjp(nodes, params, anc_floats, has_aux=True)

    def child_step(carry, child):   # one of the k siblings: its floats, its other outputs, its subtree
      loss_acc, d_params, d_anc = carry
      floats, other, sub_levels = child
      sub = (loss_acc, d_params, d_anc + [_zeros(floats)])
      row = lambda fl, other=other: _join(fl, other, spec)
      loss_acc, aux_c, d_params, d_sub = _subtree(node_fns, params, ancestors + [(floats, row)], sub_levels,
                                                  micro_batch, sub)
      return (loss_acc, d_params, d_sub[:-1]), (d_sub[-1], aux_c)
    (loss_acc, d_params, d_anc), (d_out, aux_c) = jax.lax.scan(child_step, (loss_acc + loss, d_params, d_anc),
                                                               (out_floats, others, children[1:]))
    dp, da = pullback((d_out, jnp.ones_like(loss)))
    return (loss_acc, _add(d_params, dp), _add(d_anc, da)), [aux] + aux_c

  (loss, d_params, d_anc), aux = jax.lax.scan(siblings_step, acc, split_micro_batches(levels, k))
  return loss, merge_micro_batches(aux, f), d_params, d_anc



def _as_rows(fn, d):
  """fn over the slots [F_1..F_{d+1}] of level d as ONE batch of N = F_1...F_{d+1} rows: the slots
  flattened, and each ancestor output of level e < d (slot axes [F_1..F_{e+1}]) repeated to its
  descendants' rows (a broadcast, whose transpose sums the rows' cotangents back into the ancestor:
  the segment-sum over the parent index). The root's output is shared, not repeated. fn's outputs
  [N, ...] come back on the slot axes [F_1..F_{d+1}, ...]. One batch for the whole level keeps every
  weight-gradient dot contracting one (row·position) axis, which a vmap over the parent slots does
  not (docs/design.md, "Step profile (CPU)")."""
  def rows(params, ancestors, level):
    slots = jax.tree_util.tree_leaves(level)[0].shape[:d + 1]
    n = int(np.prod(slots))
    flat = lambda x, k: x.reshape((n,) + x.shape[k:])

    def repeat(x, e):   # [F_1..F_{e+1}, ...] -> [N, ...]
      x = x.reshape(x.shape[:e + 1] + (1,) * (d - e) + x.shape[e + 1:])
      return flat(jnp.broadcast_to(x, slots + x.shape[d + 1:]), d + 1)
    repeated = tuple(jax.tree_util.tree_map(lambda x, e=e: repeat(x, e), a) for e, a in enumerate(ancestors[1:]))
    out = fn(params, (ancestors[0],) + repeated, jax.tree_util.tree_map(lambda x: flat(x, d + 1), level))
    return jax.tree_util.tree_map(lambda x: x.reshape(slots + x.shape[1:]), out)
  return rows


def _split_last(level, d, m):
  """Slots [F_1..F_{d+1}] -> scan steps [F_{d+1} / m, F_1..F_d, m] (m leaf siblings of every parent per step)."""
  def split(x):
    s = x.shape
    x = x.reshape(s[:d] + (s[d] // m, m) + s[d + 1:])
    return jnp.moveaxis(x, d, 0)
  return jax.tree_util.tree_map(split, level)


def _merge_last(tree, d):
  """Inverse of `_split_last` for scan outputs [F_{d+1} / m, F_1..F_d, m, ...]."""
  def merge(x):
    x = jnp.moveaxis(x, 0, d)
    return x.reshape(x.shape[:d] + (x.shape[d] * x.shape[d + 1],) + x.shape[d + 2:])
  return jax.tree_util.tree_map(merge, tree)


def _level_schedule(node_fns, params, root, levels, micro_batch):
  """Level-synchronous forward (internal levels under jax.vjp), batched leaves, pullbacks deepest first."""
  depth = len(levels)
  ancestors, pullbacks, losses, auxes = [root], [], [], []
  for d in range(depth - 1):
    fn, spec = _as_rows(node_fns[d], d), {}

    def level_fn(p, floats, fn=fn, spec=spec, anc=tuple(ancestors), level=levels[d]):
      out, loss, aux = fn(p, tuple(rb(f) for f, (_, rb) in zip(floats, anc)), level)
      out_floats, spec["rebuild"] = _partition(out)
      return (out_floats, jnp.sum(loss)), aux
    (out_floats, loss), pullback, aux = jax.vjp(level_fn, params, [f for f, _ in ancestors], has_aux=True)
    ancestors.append((out_floats, spec["rebuild"]))
    pullbacks.append((pullback, loss))
    losses.append(loss)
    auxes.append(aux)

  last = depth - 1
  fn = _as_rows(node_fns[last], last)
  anc_floats = [f for f, _ in ancestors]

  def step_loss(primals, mb):
    p, floats = primals
    _, loss, aux = fn(p, tuple(rb(f) for f, (_, rb) in zip(floats, ancestors)), mb)
    return jnp.sum(loss), aux
  primals = (params, anc_floats)
  batches = _split_last(levels[last], last, micro_batch)
  first = jax.tree_util.tree_map(lambda x: x[0], batches)
  loss0 = jnp.zeros_like(anc_floats[0][0], shape=(), dtype=jax.eval_shape(step_loss, primals, first)[0].dtype)
  (loss, (d_params, d_anc)), leaf_aux = scan_value_and_grad(step_loss, primals, batches, (loss0, _zeros(primals)))

  for d in reversed(range(depth - 1)):   # level d's outputs are ancestor d + 1
    pullback, level_loss = pullbacks[d]
    dp, da = pullback((d_anc[d + 1], jnp.ones_like(level_loss)))
    d_params = _add(d_params, dp)
    d_anc = _add(d_anc[:d + 1], da)
  return sum(losses, loss), auxes + [_merge_last(leaf_aux, last)], d_params, d_anc


def nested_replay_map(prefix_fn: Callable[[PyTree], PyTree], node_fns: list[Callable], params: PyTree,
                      levels: list[PyTree], *, micro_batch: int = 1) -> list:
  """Forward-only nested replay (old-policy and reference log-probs on trees), level by level.

  Args:
    prefix_fn: params -> root output pytree.
    node_fns: one per level: node_fns[d](params, ancestors, nodes) -> (out, value), as in
      `nested_replay_vjp` (m sibling rows) but with any pytree of arrays `value` (leading [m]) in
      place of (loss, aux).
    params, levels: as in `nested_replay_vjp`.
    micro_batch: leaf siblings (of every parent) per `lax.scan` step at the last level; must
      divide F_D. Nothing is kept for a backward pass, so memory is the outputs of all
      internal nodes (their K/V) plus one level's activations.

  Returns:
    list over levels d of node_fns[d]'s value stacked on the slot axes [F_1..F_{d+1}, ...].

  Raises:
    ValueError: as `nested_replay_vjp`.
  """
  _check("nested_replay_map", node_fns, levels, micro_batch)
  ancestors, values = [prefix_fn(params)], []
  for d in range(len(levels) - 1):
    out, value = _as_rows(node_fns[d], d)(params, tuple(ancestors), levels[d])
    ancestors.append(out)
    values.append(value)
  last = len(levels) - 1
  fn = _as_rows(node_fns[last], last)

  def step(_, mb):
    return None, fn(params, tuple(ancestors), mb)[1]
  _, leaf = jax.lax.scan(step, None, _split_last(levels[last], last, micro_batch))
  return values + [_merge_last(leaf, last)]
