"""The grouped matmul of a mixture of experts as Pallas kernels: `grouped_matmul`'s tiles, one program each.

    forward  y = x w[g]:      grid (tiles, f / bn); a program multiplies its tile's `tile` rows [tile, d]
                              by its group's matrix w[g_i] [d, bn] (its rows of other groups zeroed;
                              d in blocks of bk, accumulated in float32, float64 for float64 inputs)
                              into its own output block [tile, bn];
                              each row's output is then read from its tile's (`rows_of_tiles`).
    backward dx = dy w[g]^T:  the same kernel on w transposed [E, f, d];
             dw[g] = Σ x^T dy: grid (E, d / bd, f / bn); a program loops over its group's tiles, their rows
                              of other groups zeroed in x and dy (an inf or NaN there stays out),
                              and accumulates x_tile^T dy_tile [bd, bn].

The tiles are `kernels.grouped_matmul.tile_plan`'s: each group's rows cut into tiles of `tile` rows, at most
ceil(M / tile) + E of them. No program writes where another does (each owns an output block), so the kernels
need no masked or atomic stores. Work as the tiled scan's, (M + E · tile) · d · f, in one launch per product.

Targets: NVIDIA GPUs through the Triton lowering (blocks are powers of two; d and f need a power-of-two
divisor >= 16 for Triton's dots, which every released MoE's widths have), the CPU through the Pallas
interpreter (tests). Not inside a mesh step's `shard_map` (its outputs state no varying mesh axes; the config
check refuses `model.expert_matmul = "pallas"` on a mesh). No accelerator was lent to this project's sessions,
so the Triton lowering is untested and unmeasured here (docs/design.md, "Mixture of experts").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from branch_replay_jax.kernels.grouped_matmul import own_rows, rows_of_tiles, tile_plan

MAX_BLOCK = 128   # columns (and d's rows) per program's block


def _block(n: int) -> int:
  """The largest power of two <= MAX_BLOCK dividing n (1 for odd n: interpreter shapes only)."""
  b = MAX_BLOCK
  while n % b:
    b //= 2
  return b


def _acc(dtype) -> jnp.dtype:
  return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def _gmm_kernel(owner_ref, row0_ref, rows_ref, x_ref, w_ref, y_ref, *, tile: int, bk: int):
  i, j = pl.program_id(0), pl.program_id(1)
  g, r = owner_ref[i], row0_ref[i]
  n, bn = rows_ref[i], y_ref.shape[-1]
  acc = _acc(x_ref.dtype)

  def body(k, total):
    xs = own_rows(x_ref[pl.ds(r, tile), pl.ds(k * bk, bk)], n)        # the next group's rows: 0
    ws = w_ref[g, pl.ds(k * bk, bk), pl.ds(j * bn, bn)]
    return total + jnp.dot(xs, ws, preferred_element_type=acc)
  total = jax.lax.fori_loop(0, x_ref.shape[1] // bk, body, jnp.zeros((tile, bn), acc))
  y_ref[...] = total.astype(y_ref.dtype)


def _gmm(x_pad, w, plan, tile: int, interpret: bool):
  """[n, tile, f]: each tile's rows of x_pad [M + tile, d] times its group's w [E, d, f]."""
  n, (d, f) = plan.owner.shape[0], w.shape[1:]
  bn, bk = _block(f), _block(d)
  return pl.pallas_call(
      functools.partial(_gmm_kernel, tile=tile, bk=bk), grid=(n, f // bn),
      in_specs=[pl.no_block_spec] * 5,
      out_specs=pl.BlockSpec((None, tile, bn), lambda i, j: (i, 0, j)),
      out_shape=jax.ShapeDtypeStruct((n, tile, f), jnp.result_type(x_pad.dtype, w.dtype)),
      interpret=interpret)(plan.owner, plan.row0, plan.rows, x_pad, w)


def _tgmm_kernel(first_ref, count_ref, row0_ref, rows_ref, x_ref, dy_ref, dw_ref, *, tile: int):
  e, a, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  bd, bn = dw_ref.shape
  acc = _acc(x_ref.dtype)

  def body(t, total):
    r = row0_ref[t]
    xs = own_rows(x_ref[pl.ds(r, tile), pl.ds(a * bd, bd)], rows_ref[t])   # other groups' rows: 0
    ds = own_rows(dy_ref[pl.ds(r, tile), pl.ds(b * bn, bn)], rows_ref[t])
    return total + jax.lax.dot_general(xs, ds, (((0,), (0,)), ((), ())), preferred_element_type=acc)
  lo = first_ref[e]
  total = jax.lax.fori_loop(lo, lo + count_ref[e], body, jnp.zeros((bd, bn), acc))
  dw_ref[...] = total.astype(dw_ref.dtype)


def _tgmm(x_pad, dy_pad, plan, e: int, tile: int, interpret: bool, dtype):
  """[E, d, f]: per group, its rows of x_pad [M + tile, d] transposed times theirs of dy_pad [M + tile, f]."""
  d, f = x_pad.shape[1], dy_pad.shape[1]
  bd, bn = _block(d), _block(f)
  return pl.pallas_call(
      functools.partial(_tgmm_kernel, tile=tile), grid=(e, d // bd, f // bn),
      in_specs=[pl.no_block_spec] * 6,
      out_specs=pl.BlockSpec((None, bd, bn), lambda g, a, b: (g, a, b)),
      out_shape=jax.ShapeDtypeStruct((e, d, f), dtype),
      interpret=interpret)(plan.first_tile, plan.count, plan.row0, plan.rows, x_pad, dy_pad)


def _pad(a, tile: int):
  return jnp.pad(a, ((0, tile), (0, 0)))   # every tile's rows in bounds


def _forward(x, w, plan, tile, interpret):
  return rows_of_tiles(_gmm(_pad(x, tile), w, plan, tile, interpret), plan, x.shape[0], tile)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grouped(x, w, group_sizes, tile, interpret):
  return _forward(x, w, tile_plan(group_sizes, x.shape[0], tile), tile, interpret)


def _grouped_fwd(x, w, group_sizes, tile, interpret):
  plan = tile_plan(group_sizes, x.shape[0], tile)
  return _forward(x, w, plan, tile, interpret), (x, w, plan)   # the plan saved for the backward


def _grouped_bwd(tile, interpret, saved, dy):
  x, w, plan = saved
  dy = dy.astype(x.dtype)
  dx = _forward(dy, jnp.swapaxes(w, 1, 2), plan, tile, interpret)
  dw = _tgmm(_pad(x, tile), _pad(dy, tile), plan, w.shape[0], tile, interpret, w.dtype)
  return dx, dw, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_matmul_pallas(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, tile: int = 128,
                          interpret: bool | None = None) -> jax.Array:
  """Row r of group g times w[g] (`jax.lax.ragged_dot(x, w, group_sizes)`) by the Pallas kernels of the module
  docstring, differentiable in x and w.

  Args:
    x: [M, d] rows sorted by group (group g's rows contiguous, in group order).
    w: [E, d, f] one matrix per group, x's dtype.
    group_sizes: [E] int32 rows per group, summing to M (traced).
    tile: rows per tile (static): a power of two >= 16 for the Triton lowering.
    interpret: run the kernels in the Pallas interpreter; None: on the CPU backend.

  Returns:
    [M, f] in x's dtype, accumulated in float32 (float64 for float64 inputs).

  Raises:
    ValueError: x not [M, d], w not [E, d, f] with x's d and dtype, group_sizes not [E], tile not a power of
      two >= 1.
  """
  if x.ndim != 2 or w.ndim != 3 or w.shape[1] != x.shape[1] or group_sizes.shape != (w.shape[0],):
    raise ValueError(f"grouped_matmul_pallas: needs x [M, d], w [E, d, f], group_sizes [E]; got x {x.shape}, "
                     f"w {w.shape}, group_sizes {group_sizes.shape}")
  if x.dtype != w.dtype:
    raise ValueError(f"grouped_matmul_pallas: x is {x.dtype}, w {w.dtype}; cast w to x's dtype")
  if isinstance(tile, bool) or not isinstance(tile, (int, np.integer)) or tile < 1 or tile & (tile - 1):
    raise ValueError(f"grouped_matmul_pallas: tile={tile!r} must be a power of two >= 1")
  tile = int(tile)
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  return _grouped(x, w, group_sizes, tile, interpret)
