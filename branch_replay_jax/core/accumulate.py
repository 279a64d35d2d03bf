"""Micro-batching shared by every replay and naive path: split a batch axis into `lax.scan` steps
and sum the steps' losses and gradients in the scan carry.

    batch [N, ...] ──split──► [N / m, m, ...] ──lax.scan──► step k: (loss_k, aux_k), grads_k = value_and_grad(mb_k)
                                                             carry: (Σ loss_k, Σ grads_k); aux stacked [N / m, m, ...]

Peak memory grows with the micro-batch m, not with N. Replay (core/replay.py, core/tree_replay.py)
differentiates each step w.r.t. (params, prefix outputs); the naive paths (gradients/) w.r.t. params.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

PyTree = Any


def fit_micro_batch(requested: int, n: int) -> int:
  """The largest divisor of n that is <= requested (>= 1): n items then split into n / m equal steps.

  For counts that vary step to step (a sampled tree's leaf siblings, a DPO batch's pairs)."""
  return max(m for m in range(1, min(requested, n) + 1) if n % m == 0)


def split_micro_batches(tree: PyTree, micro_batch: int) -> PyTree:
  """Leaves [N, ...] -> [N / m, m, ...] (m = micro_batch, a divisor of N; callers validate it)."""
  return jax.tree_util.tree_map(lambda x: x.reshape((x.shape[0] // micro_batch, micro_batch) + x.shape[1:]), tree)


def merge_micro_batches(tree: PyTree, n: int) -> PyTree:
  """Inverse of `split_micro_batches` for scan outputs [N / m, m, ...] -> [N, ...]."""
  return jax.tree_util.tree_map(lambda x: x.reshape((n,) + x.shape[2:]), tree)


def scan_value_and_grad(loss_fn: Callable[[PyTree, PyTree], tuple[jax.Array, PyTree]], primals: PyTree,
                        batches: PyTree, carry: tuple[jax.Array, PyTree] | None = None):
  """Σ_k of `jax.value_and_grad(loss_fn, has_aux=True)(primals, batches[k])` over the leading axis of batches.

  Args:
    loss_fn: (primals, micro_batch) -> (scalar loss, aux).
    primals: the differentiated pytree (params, or a tuple such as (params, prefix outputs)).
    batches: pytree whose leaves have the scan axis first (`split_micro_batches`).
    carry: (loss, grads like primals) to add to; default zeros (loss in loss_fn's dtype). Replay
      passes its own so that the sums keep the prefix outputs' sharding type under `shard_map`,
      or to thread one accumulator through nested scans (depth-first tree replay).

  Returns:
    ((loss sum, grads sum like primals), aux stacked on the scan axis).
  """
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def step(acc, mb):
    (loss, aux), grads = grad_fn(primals, mb)
    return (acc[0] + loss, jax.tree_util.tree_map(jnp.add, acc[1], grads)), aux

  if carry is None:
    first = jax.tree_util.tree_map(lambda x: x[0], batches)
    loss0 = jnp.zeros((), jax.eval_shape(loss_fn, primals, first)[0].dtype)
    carry = (loss0, jax.tree_util.tree_map(jnp.zeros_like, primals))
  return jax.lax.scan(step, carry, batches)
