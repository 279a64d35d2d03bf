"""A grouped matmul in tiles: each row times its own group's matrix, computed for its group only.

A mixture of experts sorts its (token, slot) rows by expert and multiplies each expert's rows by that
expert's weights: `jax.lax.ragged_dot(x, w, group_sizes)`. XLA:TPU lowers `ragged_dot` to a grouped
matmul (megablox); XLA:CPU (and, at the JAX versions checked here, the compile-only memory model) lowers
it densely, every row times every expert's matrix masked, so its buffers grow with E times the rows
(docs/results/moe-memory-cpu). `grouped_matmul` computes the same product in fixed tiles of `tile` rows:

    rows sorted by group:  | group 0: 300 rows       | group 1: 40 | group 3: 200 ...
    tiles of 128 rows:     | t0 | t1 | t2 (44 real) | t3 (40)     | t4 | t5 (72) ...

Each group's rows are cut into ceil(size / tile) tiles (at most ceil(M / tile) + E tiles in all, a static
bound); a `lax.scan` multiplies tile i's rows by its group's matrix w[g_i] (rows of the next group that a
group's last tile overlaps are computed and dropped); each row is then read from its tile. The scan body is
rematerialised (`jax.checkpoint`), so the backward saves the tile indices only, never a per-tile copy of
w[g_i]: its transpose accumulates dx and dw (each tile's row block and group matrix) as carries. Work:
(M + E · tile) · d · f multiply-adds against ragged_dot's E · M · d · f on a dense lowering; buffers:
the tiles' outputs, (M + E · tile) · f. Exact: every row's output is the product of its row and its
group's matrix, and a tile's rows of the next group are zeroed before its product, so neither they nor their
cotangents touch this group's (equal to `ragged_dot` to float rounding; tests/test_kernels.py, tests/test_moe.py).

`kernels.grouped_matmul_pallas` runs the same tiles (`tile_plan`) as Pallas kernels, one program per tile and
column block (Triton on GPU, the interpreter on the CPU); this lowering is what any backend compiles, the one
the memory model measures.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class TilePlan(NamedTuple):
  """The tiles of M rows sorted into E groups (`tile_plan`); n = ceil(M / tile) + E tiles, int32.

  owner: [n] each tile's group (the last group for the unused tiles at the end).
  row0: [n] each tile's first row, in [0, M] (unused tiles: past their group's rows).
  rows: [n] the tile's rows that are its group's, in [0, tile] (0 for unused tiles); the rest of its rows
    belong to the next groups or are padding.
  first_tile: [E] each group's first tile; count: [E] its tiles, ceil(size / tile).
  starts: [E] each group's first row; ends: [E] the row after its last.
  """
  owner: jax.Array
  row0: jax.Array
  rows: jax.Array
  first_tile: jax.Array
  count: jax.Array
  starts: jax.Array
  ends: jax.Array


def tile_plan(group_sizes: jax.Array, m: int, tile: int) -> TilePlan:
  """Each group's rows cut into tiles of `tile` rows (module docstring), computed on device from the traced
  group_sizes [E] (summing to M); their number is the static bound ceil(M / tile) + E."""
  e = group_sizes.shape[0]
  sizes = group_sizes.astype(jnp.int32)
  ends = jnp.cumsum(sizes)
  starts = ends - sizes                                     # [E] each group's first row
  count = (sizes + tile - 1) // tile                        # [E]
  tile_ends = jnp.cumsum(count)
  first_tile = tile_ends - count                            # [E] each group's first tile
  i = jnp.arange(-(-m // tile) + e, dtype=jnp.int32)        # the static bound on the tile count
  owner = jnp.minimum(jnp.searchsorted(tile_ends, i, side="right"), e - 1).astype(jnp.int32)
  row0 = jnp.clip(starts[owner] + (i - first_tile[owner]) * tile, 0, m)   # unused tiles read the zero padding
  rows = jnp.clip(starts[owner] + sizes[owner] - row0, 0, tile)
  return TilePlan(owner, row0.astype(jnp.int32), rows.astype(jnp.int32), first_tile, count, starts, ends)


def rows_of_tiles(ys: jax.Array, plan: TilePlan, m: int, tile: int) -> jax.Array:
  """[M, ...]: each of the M sorted rows' output read from its tile's, ys [n, tile, ...] (`tile_plan`'s tiles);
  the rows a tile computed for the next group are never read. Rows past the groups' total (group_sizes summing
  to less than M) are 0, as `ragged_dot` gives them."""
  r = jnp.arange(m, dtype=jnp.int32)
  g = jnp.minimum(jnp.searchsorted(plan.ends, r, side="right"), plan.ends.shape[0] - 1)   # each row's group
  j = r - plan.starts[g]
  out = ys[plan.first_tile[g] + j // tile, j % tile]
  return jnp.where((r < plan.ends[-1]).reshape((m,) + (1,) * (out.ndim - 1)), out, jnp.zeros((), out.dtype))


def own_rows(x_tile: jax.Array, rows) -> jax.Array:
  """x_tile [tile, ...] with its rows from `rows` on (another group's, or padding) zeroed: they take no part in
  the tile's product, so an inf or NaN there never reaches this group's gradient."""
  keep = jnp.arange(x_tile.shape[0]).reshape((-1,) + (1,) * (x_tile.ndim - 1)) < rows
  return jnp.where(keep, x_tile, jnp.zeros((), x_tile.dtype))


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, tile: int = 128) -> jax.Array:
  """Row r of group g times w[g]: `jax.lax.ragged_dot(x, w, group_sizes)` in tiles (module docstring).

  Args:
    x: [M, d] rows sorted by group (group g's rows contiguous, in group order).
    w: [E, d, f] one matrix per group.
    group_sizes: [E] int32 rows per group, summing to M (traced: the tiles' groups and starts are
      computed on device; their count is the static bound ceil(M / tile) + E).
    tile: rows per tile (static, >= 1): larger tiles waste more rows at each group's end (at most
      tile - 1 per group), smaller ones run more scan steps.

  Returns:
    [M, f] in the dtype of x @ w.

  Raises:
    ValueError: x not [M, d], w not [E, d, f] with x's d, group_sizes not [E], tile < 1.
  """
  if x.ndim != 2 or w.ndim != 3 or w.shape[1] != x.shape[1] or group_sizes.shape != (w.shape[0],):
    raise ValueError(f"grouped_matmul: needs x [M, d], w [E, d, f], group_sizes [E]; got x {x.shape}, w {w.shape}, "
                     f"group_sizes {group_sizes.shape}")
  if isinstance(tile, bool) or not isinstance(tile, (int, np.integer)) or tile < 1:
    raise ValueError(f"grouped_matmul: tile={tile!r} must be an int >= 1")
  tile = int(tile)
  m = x.shape[0]
  plan = tile_plan(group_sizes, m, tile)
  x_pad = jnp.pad(x, ((0, tile), (0, 0)))

  def body(_, t):
    g, r, n = t
    return None, own_rows(jax.lax.dynamic_slice_in_dim(x_pad, r, tile, axis=0), n) @ w[g]

  _, ys = jax.lax.scan(jax.checkpoint(body), None, (plan.owner, plan.row0, plan.rows))   # [tiles, tile, f]
  return rows_of_tiles(ys, plan, m, tile)
