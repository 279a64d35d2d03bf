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

With micro_batch = G the scan has one step and is dropped (`_one_micro_batch`): one
`jax.value_and_grad` of the composed function, the prefix still computed once and pulled back once.
A decoder's branch_fn is `vectorized`: the micro-batch's branches run as rows of one batch on the
prefix's K/V (docs/design.md, "Step profile (CPU)").

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


def _float_leaves(tree: PyTree):
  """(the floating leaves of tree, rebuild): only they take cotangents; masks and ids ride along as
  constants. rebuild(floats) puts floats back in their places; rebuild(floats, float0) fills the
  others with float0 zeros (the cotangent of a non-float leaf)."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  is_float = [jnp.issubdtype(x.dtype, jnp.inexact) for x in leaves]

  def rebuild(floats, other_dtype=None):
    it = iter(floats)
    others = leaves if other_dtype is None else [np.zeros(x.shape, other_dtype) for x in leaves]
    return jax.tree_util.tree_unflatten(treedef, [next(it) if f else o for o, f in zip(others, is_float)])
  return [x for x, f in zip(leaves, is_float) if f], rebuild


def reduce_in_backward(reduce: Callable[[list], list], prefix_out: PyTree) -> PyTree:
  """prefix_out unchanged, except that in the backward pass the cotangent of its float leaves (a list)
  passes through `reduce` (replay_vjp's reduce_prefix_cotangent) on its way to the prefix."""
  floats, rebuild = _float_leaves(prefix_out)

  @jax.custom_vjp
  def identity(xs):
    return xs

  identity.defvjp(lambda xs: (xs, None), lambda _, cotangent: (list(reduce(list(cotangent))),))
  return rebuild(identity(floats))


def _one_micro_batch(prefix_fn, batched_fn, params, branches, reduce_prefix_cotangent):
  """replay_vjp when micro_batch == G: the scan would have one step, so it is dropped, and with it the
  zero-initialised carry and the two parameter-sized additions (carry + step, branches + prefix):
  one `jax.value_and_grad` of Σ batched_fn(params, prefix_fn(params), branches). The prefix still
  runs once and its pullback runs once, on the summed cotangent of all G branches (the transpose of
  their shared use of prefix_out); autodiff adds the prefix's and the branches' parameter gradients."""
  def total(p):
    prefix_out = prefix_fn(p)
    if reduce_prefix_cotangent is not None:
      prefix_out = reduce_in_backward(reduce_prefix_cotangent, prefix_out)
    losses, aux = batched_fn(p, prefix_out, branches)
    return jnp.sum(losses), aux

  (loss, aux), grads = jax.value_and_grad(total, has_aux=True)(params)
  return loss, aux, grads


def replay_vjp(prefix_fn: Callable[[PyTree], PyTree],
               branch_fn: Callable[[PyTree, PyTree, PyTree], tuple[jax.Array, PyTree]],
               params: PyTree, branches: PyTree, *, micro_batch: int = 1,
               reduce_prefix_cotangent: Callable[[PyTree], PyTree] | None = None,
               vectorized: bool = False) -> tuple[jax.Array, PyTree, PyTree]:
  """Loss, aux and parameter gradient of Σ_g branch_fn(params, prefix_fn(params), branch_g).

  Args:
    prefix_fn: params -> prefix_out, a pytree of arrays (for a decoder: the prompt's per-layer
      K/V and its last-position hidden state). Runs once, under `jax.vjp`.
    branch_fn: (params, prefix_out, branch) -> (loss, aux) for ONE branch: `branch` is a slice
      of `branches` without the leading axis; loss is a float scalar; aux a pytree of arrays.
      With vectorized=True it takes a micro-batch instead: `branches` [m, ...] -> (losses [m], aux
      [m, ...]), and is called as is rather than under `jax.vmap`.
    params: the differentiated pytree (an `nnx.State` of parameters works).
    branches: pytree whose leaves all have the leading branch axis G.
    micro_batch: branches computed together inside each `lax.scan` step; must divide G. Peak
      memory grows with micro_batch, not with G.
    vectorized: branch_fn maps over the micro-batch itself. A decoder then runs the m branches as
      m rows of one batch, so every weight-gradient dot contracts one (row·position) axis; under
      `jax.vmap` it contracts (branch, position), which XLA:CPU canonicalises by a transposed copy
      of each activation (docs/design.md, "Step profile (CPU)").
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
  batched_fn = branch_fn if vectorized else jax.vmap(branch_fn, in_axes=(None, None, 0))
  if micro_batch == g:
    return _one_micro_batch(prefix_fn, batched_fn, params, branches, reduce_prefix_cotangent)
  prefix_out, prefix_pullback = jax.vjp(prefix_fn, params)
  float_leaves, rebuild = _float_leaves(prefix_out)

  def step_loss(primals, mb):
    p, floats = primals
    losses, aux = batched_fn(p, rebuild(floats), mb)
    return jnp.sum(losses), aux

  primals = (params, float_leaves)
  first = jax.tree_util.tree_map(lambda x: x[0], batches)
  # zeros_like of a prefix output keeps its sharding type (varying under shard_map) for the carry.
  loss0 = jnp.zeros_like(float_leaves[0], shape=(), dtype=jax.eval_shape(step_loss, primals, first)[0].dtype)
  carry = (loss0, jax.tree_util.tree_map(jnp.zeros_like, primals))
  (loss, (d_params, d_floats)), aux = scan_value_and_grad(step_loss, primals, batches, carry)
  if reduce_prefix_cotangent is not None:
    d_floats = reduce_prefix_cotangent(d_floats)
  (d_params_prefix,) = prefix_pullback(rebuild(d_floats, jax.dtypes.float0))
  grads = jax.tree_util.tree_map(jnp.add, d_params, d_params_prefix)
  return loss, merge_micro_batches(aux, g), grads


def replay_map(prefix_fn: Callable[[PyTree], PyTree], branch_fn: Callable[[PyTree, PyTree, PyTree], PyTree],
               params: PyTree, branches: PyTree, *, micro_batch: int = 1, vectorized: bool = False) -> PyTree:
  """Forward-only replay: branch_fn(params, prefix_fn(params), branch_g) for every branch.

  Used for old-policy and reference log-probs. Same arguments as `replay_vjp`, except that
  branch_fn may return any pytree of arrays; returns it stacked on a leading axis [G, ...].
  """
  batches, g = _micro_batches(branches, micro_batch)
  prefix_out = prefix_fn(params)
  batched_fn = branch_fn if vectorized else jax.vmap(branch_fn, in_axes=(None, None, 0))

  def step(_, mb):
    return None, batched_fn(params, prefix_out, mb)

  _, out = jax.lax.scan(step, None, batches)
  return merge_micro_batches(out, g)
