"""`replay_vjp`: exact gradients of a group of branches that share one prefix.

A rollout group is a prefix (the prompt) and G branches (completions). The naive step runs
the prefix G times, forward and backward. Replay runs it once:

    params ──► prefix_fn ──► prefix_out = (per-layer K/V, last-position hidden)   [jax.vjp, residuals kept]
                                │
          ┌─────────────────────┼──────────────────────┐   lax.scan over G / micro_batch steps,
          ▼                     ▼                      ▼   each step vmaps branch_fn over micro_batch
    branch_fn(params,     branch_fn(params,      branch_fn(params,
      prefix_out, b_0)      prefix_out, b_1)       prefix_out, b_G-1)
          │ dparams_0, dprefix_0 │                      │
          └──────────── summed in the scan carry ───────┘
                                │ dprefix = Σ_g dprefix_g
                                ▼
                       prefix pullback, once ──► dparams_prefix
    grad = Σ_g dparams_g + dparams_prefix

Because the loss is a sum over branches and every branch sees the same prefix outputs, the
chain rule gives d(Σ_g L_g)/dθ = Σ_g ∂L_g/∂θ + (∂prefix/∂θ)ᵀ Σ_g ∂L_g/∂prefix_out: the gradient
equals the naive one up to float rounding order. The prefix's last-position output belongs in
prefix_out: it predicts each branch's first token, and dropping its cotangent leaves the
prompt-to-completion transition unsupervised.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


def _num_branches(branches: PyTree) -> int:
  leaves = jax.tree_util.tree_leaves(branches)
  if not leaves:
    raise ValueError("replay: `branches` has no arrays; a group needs at least one branch")
  sizes = {leaf.shape[0] if leaf.ndim else None for leaf in leaves}
  if len(sizes) != 1 or None in sizes:
    raise ValueError(f"replay: every leaf of `branches` needs the same leading branch axis, got sizes {sorted(map(str, sizes))}")
  return sizes.pop()


def _micro_batches(branches: PyTree, micro_batch: int) -> tuple[PyTree, int]:
  g = _num_branches(branches)
  if not isinstance(micro_batch, int) or micro_batch < 1 or g % micro_batch:
    raise ValueError(f"replay: micro_batch={micro_batch!r} must be a positive divisor of the number of branches G={g}")
  return jax.tree_util.tree_map(lambda x: x.reshape((g // micro_batch, micro_batch) + x.shape[1:]), branches), g


def _unstack(tree: PyTree, g: int) -> PyTree:
  return jax.tree_util.tree_map(lambda x: x.reshape((g,) + x.shape[2:]), tree)


def replay_vjp(prefix_fn: Callable[[PyTree], PyTree],
               branch_fn: Callable[[PyTree, PyTree, PyTree], tuple[jax.Array, PyTree]],
               params: PyTree, branches: PyTree, *, micro_batch: int = 1,
               reduce_prefix_cotangent: Callable[[PyTree], PyTree] | None = None) -> tuple[jax.Array, PyTree, PyTree]:
  """Loss, aux and parameter gradient of Σ_g branch_fn(params, prefix_fn(params), branch_g).

  Args:
    prefix_fn: params -> prefix_out, a pytree of arrays (for a decoder: the prompt's per-layer
      K/V and its last-position hidden state). Runs once, under `jax.vjp`.
    branch_fn: (params, prefix_out, branch) -> (loss, aux) for ONE branch: `branch` is a slice
      of `branches` without the leading axis; loss is a float scalar; aux a pytree of arrays.
    params: the differentiated pytree (an `nnx.State` of parameters works).
    branches: pytree whose leaves all have the leading branch axis G.
    micro_batch: branches vmapped together inside each `lax.scan` step; must divide G. Peak
      memory grows with micro_batch, not with G.
    reduce_prefix_cotangent: applied to the summed prefix cotangent (a list of float arrays)
      before the single pullback; under `shard_map` this is where the branch shards' cotangents
      are all-reduced (see sharding.py).

  Returns:
    loss: scalar, the sum of the branch losses.
    aux: branch_fn's aux stacked on a leading axis [G, ...].
    grads: pytree like params, d loss / d params.

  Raises:
    ValueError: if `branches` is empty or ragged on its leading axis, or micro_batch does not
      divide G.
  """
  batches, g = _micro_batches(branches, micro_batch)
  prefix_out, prefix_pullback = jax.vjp(prefix_fn, params)
  # Only floating leaves of prefix_out take cotangents; masks and ids ride along as constants.
  leaves, treedef = jax.tree_util.tree_flatten(prefix_out)
  is_float = [jnp.issubdtype(x.dtype, jnp.inexact) for x in leaves]
  float_leaves = [x for x, f in zip(leaves, is_float) if f]

  def rebuild(floats):
    it = iter(floats)
    return jax.tree_util.tree_unflatten(treedef, [next(it) if f else x for x, f in zip(leaves, is_float)])

  def step_loss(p, floats, mb):
    losses, aux = jax.vmap(branch_fn, in_axes=(None, None, 0))(p, rebuild(floats), mb)
    return jnp.sum(losses), aux

  grad_fn = jax.value_and_grad(step_loss, argnums=(0, 1), has_aux=True)
  add = lambda a, b: jax.tree_util.tree_map(jnp.add, a, b)

  def step(carry, mb):
    loss_acc, d_params, d_floats = carry
    (loss, aux), (dp, dfl) = grad_fn(params, float_leaves, mb)
    return (loss_acc + loss, add(d_params, dp), add(d_floats, dfl)), aux

  zeros = lambda tree: jax.tree_util.tree_map(jnp.zeros_like, tree)
  first = jax.tree_util.tree_map(lambda x: x[0], batches)
  # zeros_like of a prefix output keeps its sharding type (varying under shard_map) for the carry.
  loss0 = jnp.zeros_like(float_leaves[0], shape=(),
                         dtype=jax.eval_shape(step_loss, params, float_leaves, first)[0].dtype)
  (loss, d_params, d_floats), aux = jax.lax.scan(step, (loss0, zeros(params), zeros(float_leaves)), batches)
  if reduce_prefix_cotangent is not None:
    d_floats = reduce_prefix_cotangent(d_floats)
  it = iter(d_floats)
  d_prefix = jax.tree_util.tree_unflatten(
      treedef, [next(it) if f else np.zeros(x.shape, jax.dtypes.float0) for x, f in zip(leaves, is_float)])
  (d_params_prefix,) = prefix_pullback(d_prefix)
  grads = jax.tree_util.tree_map(jnp.add, d_params, d_params_prefix)
  return loss, _unstack(aux, g), grads


def replay_map(prefix_fn: Callable[[PyTree], PyTree], branch_fn: Callable[[PyTree, PyTree, PyTree], PyTree],
               params: PyTree, branches: PyTree, *, micro_batch: int = 1) -> PyTree:
  """Forward-only replay: branch_fn(params, prefix_fn(params), branch_g) for every branch.

  Used for old-policy and reference log-probs. Same arguments as `replay_vjp`, except that
  branch_fn may return any pytree of arrays; returns it stacked on a leading axis [G, ...].
  """
  batches, g = _micro_batches(branches, micro_batch)
  prefix_out = prefix_fn(params)

  def step(_, mb):
    return None, jax.vmap(branch_fn, in_axes=(None, None, 0))(params, prefix_out, mb)

  _, out = jax.lax.scan(step, None, batches)
  return _unstack(out, g)


def _partition(tree: PyTree):
  """(float leaves, rebuild(floats) -> tree): only floating leaves take cotangents."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  is_float = [jnp.issubdtype(x.dtype, jnp.inexact) for x in leaves]

  def rebuild(floats):
    it = iter(floats)
    return jax.tree_util.tree_unflatten(treedef, [next(it) if f else x for x, f in zip(leaves, is_float)])
  return [x for x, f in zip(leaves, is_float) if f], rebuild


def _tree_add(a, b):
  return jax.tree_util.tree_map(jnp.add, a, b)


def nested_replay_vjp(prefix_fn: Callable[[PyTree], PyTree], node_fns: list[Callable], params: PyTree,
                      levels: list[PyTree], *, micro_batch: int = 1) -> tuple[jax.Array, list, PyTree]:
  """`replay_vjp` for trees of any depth laid out on uniform levels (see tree.PaddedTree).

  Every node runs forward once given its ancestors' outputs; its children are processed by a
  `lax.scan` over the sibling slots, their cotangents for the node's (and its ancestors') outputs
  are summed, and the node pulls back once. Only one root-to-leaf path of residuals is alive at
  a time, plus one micro-batch of leaves.

      root ── vjp ──► scan over level-1 slots ── vjp ──► scan over level-2 slots ... ► leaves
           ◄─ pullback(Σ cotangents) ◄──────────────── pullback(Σ cotangents) ◄────── value_and_grad

  Args:
    prefix_fn: params -> root output pytree.
    node_fns: one per level d = 0..D-1 (level 0 = children of the root):
      node_fns[d](params, ancestors, node) -> (out, loss, aux) where ancestors is the tuple of
      outputs from the root down to the parent, node a slot of levels[d] without its leading axes,
      out the node's output pytree (ignored at the last level), loss a scalar.
    levels: levels[d] is a pytree whose leaves have leading axes [F_0, ..., F_d] (fan-outs).
    micro_batch: leaf slots vmapped per scan step at the last level (must divide F_{D-1});
      internal nodes run one at a time.

  Returns:
    (loss summed over all nodes, aux per level stacked on the levels' leading axes, grads).
  """
  depth = len(levels)
  if depth == 0 or len(node_fns) != depth:
    raise ValueError(f"nested_replay_vjp: need one node_fn per level, got {len(node_fns)} for {depth} levels")
  root_out, root_pullback = jax.vjp(prefix_fn, params)
  root_floats, root_rebuild = _partition(root_out)
  loss, aux, d_params, d_anc = _subtree(node_fns, params, [(root_floats, root_rebuild)], levels, micro_batch)
  (d_root,) = root_pullback(_with_float0(root_out, d_anc[0]))
  return loss, aux, _tree_add(d_params, d_root)


def _with_float0(tree, float_cotangents):
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  it = iter(float_cotangents)
  return jax.tree_util.tree_unflatten(treedef, [next(it) if jnp.issubdtype(x.dtype, jnp.inexact)
                                                else np.zeros(x.shape, jax.dtypes.float0) for x in leaves])


def _subtree(node_fns, params, ancestors, levels, micro_batch):
  """All children (one slot axis of levels[0]) of the node whose ancestors' outputs are given.

  ancestors: list of (float leaves, rebuild) from the root down. Returns (loss, aux, d_params,
  d_anc) with d_anc the summed cotangents of every ancestor's float leaves.
  """
  d = len(node_fns) - len(levels)
  anc_floats = [f for f, _ in ancestors]
  rebuild = lambda floats: tuple(rb(f) for f, (_, rb) in zip(floats, ancestors))
  zeros = lambda tree: jax.tree_util.tree_map(jnp.zeros_like, tree)
  fn = node_fns[d]

  if len(levels) == 1:   # leaves: value_and_grad of a vmapped micro-batch, as in replay_vjp
    def step_loss(p, floats, mb):
      _, losses, aux = jax.vmap(fn, in_axes=(None, None, 0))(p, rebuild(floats), mb)
      return jnp.sum(losses), aux
    batches, f = _micro_batches(levels[0], micro_batch)
    grad_fn = jax.value_and_grad(step_loss, argnums=(0, 1), has_aux=True)

    def leaf_step(carry, mb):
      (loss, aux), (dp, da) = grad_fn(params, anc_floats, mb)
      return (carry[0] + loss, _tree_add(carry[1], dp), _tree_add(carry[2], da)), aux
    first = jax.tree_util.tree_map(lambda x: x[0], batches)
    loss0 = jnp.zeros((), jax.eval_shape(step_loss, params, anc_floats, first)[0].dtype)
    (loss, d_params, d_anc), aux = jax.lax.scan(leaf_step, (loss0, zeros(params), zeros(anc_floats)), batches)
    return loss, [_unstack(aux, f)], d_params, d_anc

  def child_step(carry, child):   # one internal node and its whole subtree
    out_rebuild = {}

    def node(p, floats):
      out, loss, aux = fn(p, rebuild(floats), child[0])
      out_floats, out_rebuild["fn"] = _partition(out)
      return (out_floats, loss), aux
    (out_floats, loss), pullback, aux = jax.vjp(node, params, anc_floats, has_aux=True)
    loss_c, aux_c, dp_c, da_c = _subtree(node_fns, params, ancestors + [(out_floats, out_rebuild["fn"])],
                                         child[1:], micro_batch)
    dp, da = pullback((da_c[-1], jnp.ones_like(loss)))
    da = _tree_add(da, da_c[:-1])
    new = (carry[0] + loss + loss_c, _tree_add(carry[1], _tree_add(dp, dp_c)), _tree_add(carry[2], da))
    return new, [aux] + aux_c

  first = [jax.tree_util.tree_map(lambda x: x[0], lvl) for lvl in levels]
  loss_dtype = jax.eval_shape(lambda p, fl: fn(p, rebuild(fl), first[0])[1], params, anc_floats).dtype
  init = (jnp.zeros((), loss_dtype), zeros(params), zeros(anc_floats))
  (loss, d_params, d_anc), aux = jax.lax.scan(child_step, init, levels)
  return loss, aux, d_params, d_anc
