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

from branch_replay_jax.core.accumulate import merge_micro_batches, scan_value_and_grad, split_micro_batches

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
  return split_micro_batches(branches, micro_batch), g


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
      are all-reduced (see distributed/mesh.py).

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

  def step_loss(primals, mb):
    p, floats = primals
    losses, aux = jax.vmap(branch_fn, in_axes=(None, None, 0))(p, rebuild(floats), mb)
    return jnp.sum(losses), aux

  primals = (params, float_leaves)
  first = jax.tree_util.tree_map(lambda x: x[0], batches)
  # zeros_like of a prefix output keeps its sharding type (varying under shard_map) for the carry.
  loss0 = jnp.zeros_like(float_leaves[0], shape=(), dtype=jax.eval_shape(step_loss, primals, first)[0].dtype)
  carry = (loss0, jax.tree_util.tree_map(jnp.zeros_like, primals))
  (loss, (d_params, d_floats)), aux = scan_value_and_grad(step_loss, primals, batches, carry)
  if reduce_prefix_cotangent is not None:
    d_floats = reduce_prefix_cotangent(d_floats)
  it = iter(d_floats)
  d_prefix = jax.tree_util.tree_unflatten(
      treedef, [next(it) if f else np.zeros(x.shape, jax.dtypes.float0) for x, f in zip(leaves, is_float)])
  (d_params_prefix,) = prefix_pullback(d_prefix)
  grads = jax.tree_util.tree_map(jnp.add, d_params, d_params_prefix)
  return loss, merge_micro_batches(aux, g), grads


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
  return merge_micro_batches(out, g)
