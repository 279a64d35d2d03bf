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
group's matrix, the dropped rows' cotangents are zero (equal to `ragged_dot` to float rounding;
tests/test_moe.py).

A Pallas kernel (megablox's gmm on TPU, a Triton grouped GEMM on GPU) would fuse the tiles into one
launch; this lowering is what any backend compiles, the one the memory model measures.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
  if not isinstance(tile, int) or tile < 1:
    raise ValueError(f"grouped_matmul: tile={tile!r} must be an int >= 1")
  m, e = x.shape[0], w.shape[0]
  sizes = group_sizes.astype(jnp.int32)
  starts = jnp.cumsum(sizes) - sizes                        # [E] each group's first row
  tiles_per = (sizes + tile - 1) // tile                    # [E]
  tile_ends = jnp.cumsum(tiles_per)
  first_tile = tile_ends - tiles_per                        # [E] each group's first tile
  i = jnp.arange(-(-m // tile) + e, dtype=jnp.int32)        # the static bound on the tile count
  owner = jnp.minimum(jnp.searchsorted(tile_ends, i, side="right"), e - 1).astype(jnp.int32)
  row0 = jnp.clip(starts[owner] + (i - first_tile[owner]) * tile, 0, m)   # unused tiles read the zero padding
  x_pad = jnp.pad(x, ((0, tile), (0, 0)))

  def body(_, t):
    g, r = t
    return None, jax.lax.dynamic_slice_in_dim(x_pad, r, tile, axis=0) @ w[g]

  _, ys = jax.lax.scan(jax.checkpoint(body), None, (owner, row0))     # [tiles, tile, f]
  r = jnp.arange(m, dtype=jnp.int32)
  g = jnp.searchsorted(jnp.cumsum(sizes), r, side="right")            # each row's group
  j = r - starts[g]
  return ys[first_tile[g] + j // tile, j % tile]
