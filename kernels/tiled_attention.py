"""The tiled path of the jnp reference attention (`reference.suffix_attention`).

A segment's queries in chunks, visited one after another by `lax.fori_loop`; each chunk folds its
key tiles into the online softmax one after another (Dao et al. 2022, arXiv 2205.14135,
Algorithm 1), and the backward pass recomputes each tile's probabilities from the saved
log-sum-exp (Dao 2023, arXiv 2307.08691, Algorithm 2). At most one tile's scores
[Hkv, B, chunk, G, key_block] are live, forward and backward; dQ, dK and dV accumulate across
tiles in the accumulation dtype. The chunk and tile sizes come from the caller
(`reference.QUERY_CHUNK`, `reference.KEY_BLOCK`).

Its score/mix helpers take K/V as [Hkv, B or 1, S, D] (suffix _t); `SoftmaxState` and `finish_softmax` are
shared with the dense step, `accum_dtype` with everything (re-exported by `reference`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def accum_dtype(dtype):
  """Accumulation dtype: float32 for bfloat16/float16/float32 inputs, float64 for float64."""
  return jnp.promote_types(dtype, jnp.float32)


# Scores are laid out [Hkv, B, T, G, S] (query head h = kv head * G + g): every dot of the forward and
# of its gradient then contracts exactly one axis (D for the scores, S for the mix, the flattened
# (B,) T, G queries for the K and V gradients), with the batch axes leading. With the scores as
# [B, Hkv, G, T, S] the K gradient contracted (T, G), which XLA:CPU canonicalised by a transposed
# copy of the score-sized cotangent (docs/design.md, "Step profile (CPU)"); now only q-, K- and
# V-sized arrays are transposed. The helpers with a _t suffix take K/V already as [Hkv, B or 1, S, D].


def _scores_t(q_kbtgd, k_kbsd):
  """[Hkv, B, T, G, S] scores of queries [Hkv, B, T, G, D] against keys [Hkv, B or 1, S, D].

  In the accumulation dtype of the two inputs' common dtype. A key batch of 1 (one block shared
  by the B rows) joins the B rows to the queries instead of being broadcast."""
  acc = accum_dtype(jnp.result_type(q_kbtgd, k_kbsd))
  hkv, b, t, g, d = q_kbtgd.shape
  s = k_kbsd.shape[2]
  if k_kbsd.shape[1] == 1:
    scores = jnp.einsum("knd,ksd->kns", q_kbtgd.reshape(hkv, b * t * g, d), k_kbsd.reshape(hkv, s, d),
                        preferred_element_type=acc)
  else:
    scores = jnp.einsum("kbqd,kbsd->kbqs", q_kbtgd.reshape(hkv, b, t * g, d), k_kbsd, preferred_element_type=acc)
  return scores.reshape(hkv, b, t, g, s)


def _mix_t(p_kbtgs, v_kbsd):
  """[Hkv, B, T, G, D] = weights [Hkv, B, T, G, S] times values [Hkv, B or 1, S, D], accumulation dtype."""
  acc = accum_dtype(jnp.result_type(p_kbtgs, v_kbsd))
  hkv, b, t, g, s = p_kbtgs.shape
  d = v_kbsd.shape[-1]
  if v_kbsd.shape[1] == 1:
    out = jnp.einsum("kns,ksd->knd", p_kbtgs.reshape(hkv, b * t * g, s), v_kbsd.reshape(hkv, s, d),
                     preferred_element_type=acc)
  else:
    out = jnp.einsum("kbqs,kbsd->kbqd", p_kbtgs.reshape(hkv, b, t * g, s), v_kbsd, preferred_element_type=acc)
  return out.reshape(hkv, b, t, g, d)


def _outer_t(x_kbtgs, y_kbtgd, key_batch: int):
  """[Hkv, key_batch, S, D] = x^T y summed over the queries ((B,) T, G): a K or V gradient.

  x: [Hkv, B, T, G, S] (probabilities or dS), y: [Hkv, B, T, G, D] (dO or q); key_batch 1 also
  sums over B (the gradient of a block shared by the B rows), else key_batch must be B."""
  acc = accum_dtype(jnp.result_type(x_kbtgs, y_kbtgd))
  hkv, b, t, g, s = x_kbtgs.shape
  d = y_kbtgd.shape[-1]
  if key_batch == 1:
    return jnp.einsum("kns,knd->ksd", x_kbtgs.reshape(hkv, b * t * g, s), y_kbtgd.reshape(hkv, b * t * g, d),
                      preferred_element_type=acc).reshape(hkv, 1, s, d)
  return jnp.einsum("kbqs,kbqd->kbsd", x_kbtgs.reshape(hkv, b, t * g, s), y_kbtgd.reshape(hkv, b, t * g, d),
                    preferred_element_type=acc)


def _kv_t(x_bskd):
  """[B, S, Hkv, D] -> [Hkv, B, S, D]."""
  return jnp.transpose(x_bskd, (2, 0, 1, 3))


class SoftmaxState(NamedTuple):
  """Online-softmax statistics of a query chunk: running row max m and sum l [Hkv, B, C, G], and the
  unnormalised output o [Hkv, B, C, G, D] (Dao et al. 2022, Algorithm 1: m_i, l_i, O_i before dividing)."""

  m: jax.Array
  l: jax.Array
  o: jax.Array


def finish_softmax(state: SoftmaxState):
  """(out = o / l, lse = m + log l); rows with no visible key (l = 0) get out 0 and lse -inf."""
  visible = state.l > 0
  out = state.o / jnp.where(visible, state.l, 1.0)[..., None]      # normalise the output, not the probabilities
  lse = jnp.where(visible, state.m + jnp.log(jnp.where(visible, state.l, 1.0)), -jnp.inf)
  return out, lse


def _online_step(q, tiles, state: SoftmaxState) -> SoftmaxState:
  """Folds key tiles [(k [Hkv, B or 1, S, D], v, mask)] into `state` (Algorithm 1, lines 9-12).

  The tiles of one call share one row max, as the dense step's blocks do. The fill of masked
  scores is finite (not -inf), so m stays finite, m - m' is never inf - inf and exp() never NaN."""
  acc = accum_dtype(q.dtype)
  scores = [jnp.where(m, _scores_t(q, k), jnp.finfo(acc).min) for k, _, m in tiles]
  row_max = functools.reduce(jnp.maximum, [jnp.max(s, axis=-1) for s in scores], state.m)
  exps = [jnp.where(m, jnp.exp(s - row_max[..., None]), 0.0) for s, (_, _, m) in zip(scores, tiles)]
  rescale = jnp.exp(state.m - row_max)                  # <= 1; 0 while m was the fill
  total = rescale * state.l + sum(jnp.sum(e, axis=-1) for e in exps)
  out = rescale[..., None] * state.o + sum(_mix_t(e.astype(v.dtype), v) for e, (_, v, _) in zip(exps, tiles))
  return SoftmaxState(row_max, total, out)


def _grad_tile(q, d_out, lse, delta, k, v, mask):
  """One key tile of Algorithm 2 (Dao 2023, lines 11-16): (dQ part, dK, dV), accumulation dtype.

  q [Hkv, B, C, G, D] pre-scaled, d_out like q (accumulation dtype), lse [Hkv, B, C, G] with 0
  where -inf, delta [Hkv, B, C, G, 1] = rowsum(dO * O) - d lse; k, v [Hkv, B or 1, S, D]. dS
  stays in the accumulation dtype for dQ and dK (rounding it to bfloat16, as FA2 does, costs ~2.5x
  accuracy: kernels/pallas_attention.py)."""
  probs = jnp.where(mask, jnp.exp(_scores_t(q, k) - lse[..., None]), 0.0)
  d_v = _outer_t(probs, d_out, v.shape[1])
  d_scores = probs * (_scores_t(d_out, v) - delta)
  return _mix_t(d_scores, k), _outer_t(d_scores, q, k.shape[1]), d_v


def _take(x, start, size: int, axis: int):
  """x[start:start + size] along `axis`; a static slice when start is a Python int."""
  if isinstance(start, int):
    return lax.slice_in_dim(x, start, start + size, axis=axis)
  return lax.dynamic_slice_in_dim(x, start, size, axis)


def _add_at(x, y, start, axis: int):
  """x with y added at [start:start + len(y)] along `axis` (in place inside a loop)."""
  return lax.dynamic_update_slice_in_dim(x, _take(x, start, y.shape[axis], axis) + y, start, axis)


def _varying_axes(x) -> frozenset:
  """The manual mesh axes an array varies over inside `shard_map` (empty outside)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)      # jax >= 0.9: ManualAxisType.varying; before: aval.vma
  return mat.varying if mat is not None else getattr(aval, "vma", frozenset())


def _varying_like(*trees):
  """f(x) -> x marked varying over every manual mesh axis that any array of `trees` varies over.

  Inside `shard_map(check_vma=True)` a loop's carry must have the type of its body's output; a
  body output mixing q with K/V varies over their axes, a fresh jnp.zeros over none. So every
  loop carry starts as zeros cast to the union of the inputs' axes (outside shard_map: none)."""
  axes = frozenset().union(*(_varying_axes(x) for x in jax.tree_util.tree_leaves(trees)))
  if not axes:
    return lambda x: x
  return lambda x: lax.pcast(x, tuple(sorted(axes)), to="varying")


def _reduce_like(ct, primal):
  """ct summed over the mesh axes it varies over and `primal` does not: a cotangent must have its
  primal's type. This is the transpose of the implicit broadcast (pcast to varying) of a replicated
  input that meets a varying one, which `jax.vjp` of the dense step applies itself."""
  extra = _varying_axes(ct) - _varying_axes(primal)
  return lax.psum(ct, tuple(sorted(extra))) if extra else ct


def while_range(start, stop, body, init):
  """body(i, carry) for i = start .. stop - 1, as a `lax.while_loop` even for static bounds.

  `lax.fori_loop` with static bounds is a `scan`, and inside `jax.checkpoint` (the layer scan's
  remat policy) JAX's partial evaluation splits a scan into a forward and a recomputed part joined
  by per-iteration residuals stacked over the iterations ([steps, ...] score tiles and masks),
  even inside a `custom_vjp`'s forward; a while loop is never split, so it keeps no more than its
  carry. The loops here are never differentiated (their functions have custom backward passes)."""
  return lax.while_loop(lambda c: c[0] < stop, lambda c: (c[0] + 1, body(c[0], c[1])), (start, init))[1]


def _loop(n, body, init):
  """lax.fori_loop(0, n, body, init), without a loop for a static n of 0 or 1."""
  if isinstance(n, int) and n <= 1:
    return body(0, init) if n else init
  return lax.fori_loop(0, n, body, init)


def _tiles(c, sizes: Sequence[int], chunk: int, key_block: int, own: bool = True):
  """Key tiles seen by query chunk c: (looped [(block, start, size, count)], single [(block, start, size, causal)]).

  `sizes` are the ancestor blocks' key counts; block index len(sizes) is the own block. Looped
  entries are `count` tiles of `size` keys from `start`: an ancestor's full KEY_BLOCK tiles, and
  own tiles 0..c-1 (all before the chunk's first query). Single tiles: an ancestor's remainder (or
  the whole of a short one) and own tile c, the causal diagonal. Without an own block (own False)
  only the ancestors' tiles."""
  looped, single = [], []
  for i, s in enumerate(sizes):
    n = s // key_block if s > key_block else 0
    if n:
      looped.append((i, 0, key_block, n))
    if s > n * key_block:
      single.append((i, n * key_block, s - n * key_block, False))
  if own:
    looped.append((len(sizes), 0, chunk, c))
    single.append((len(sizes), c * chunk, chunk, True))
  return looped, single


def _tile(blocks, block: int, start, size: int, causal: bool, rows=None, reach=None):
  """(k, v [Hkv, B or 1, size, D], mask broadcastable to [Hkv, B, C, G, size]) of one tile; rows [C]:
  the chunk's query indices, read by an own block's int32 key ends (`reference.KVBlock`); reach: None,
  or (the chunk's query positions [B, C], window): a key at position q is visible to a query at p only
  while p - q < window (the block then carries its keys' positions [B or 1, S] as a 4th entry)."""
  k, v, valid = blocks[block][:3]
  valid = _take(valid, start, size, 1)
  if jnp.issubdtype(valid.dtype, jnp.integer):   # key ends: query i sees key j while i < ends[j]
    mask = (rows[None, :, None] < valid[:, None, :])[None, :, :, None, :]
  else:
    mask = valid[None, :, None, None, :]
  if causal:   # the diagonal tile: query i of the chunk sees its keys 0..i
    mask = mask & jnp.tril(jnp.ones((size, size), bool))[None, None, :, None, :]
  if reach is not None:
    positions, window = reach
    keys = _take(blocks[block][3], start, size, 1)
    mask = mask & (positions[:, :, None] - keys[:, None, :] < window)[None, :, :, None, :]
  return _take(k, start, size, 2), _take(v, start, size, 2), mask


def _unless_masked(block: int, blocks, mask, fn, carry, skipped=lambda c: c, windowed: bool = False):
  """fn(carry), or skipped(carry) (default: carry unchanged) where the tile hides every key from every
  query of the chunk: an own tile of int32 key ends (a packed tree's row, `reference.KVBlock`) whose
  keys are a sibling subtree that ended before the chunk, or (windowed) keys a sliding window no longer
  reaches. Such a tile adds exactly nothing (its probabilities are 0), so the skip changes no value; it
  saves the tile's score and gradient work. Other tiles always run fn."""
  packed = block == len(blocks) - 1 and jnp.issubdtype(blocks[block][2].dtype, jnp.integer)
  if not (packed or windowed):
    return fn(carry)
  return lax.cond(jnp.any(mask), fn, skipped, carry)


def query_chunks(t: int, chunk: int) -> tuple[int, int]:
  """(queries per chunk, padded queries) for T = t queries in chunks of at most `chunk`: n =
  ceil(t / chunk) equal chunks of ceil(t / n), the last padded by fewer than n queries."""
  n_chunks = -(-t // chunk)
  size = -(-t // n_chunks)
  return size, n_chunks * size - t


def tiled_attention(q, ancestors: Sequence, own, chunk: int, key_block: int, reach=None):
  """(out [Hkv, B, T, G, D] accum dtype, lse [Hkv, B, T, G]) of pre-scaled q [Hkv, B, T, G, D], tiled.

  ancestors: `KVBlock`s (k, v [B or 1, S_i, Hkv, D], valid [B or 1, S_i]), none empty; own: k, v
  [B, T, Hkv, D], valid [B, T]; chunk: the most queries per chunk; key_block: ancestor keys per tile.
  reach: None, or a sliding window (window, query positions [B, T], [ancestor key positions [B or 1,
  S_i]]) (`reference.windowed_suffix_attention`): a key is visible only while the query's position
  minus its own is below the window, and a tile no query of its chunk can reach is skipped.

  The T queries are split into n = ceil(T / chunk) equal chunks of ceil(T / n) <= chunk, T padded
  to n of them (fewer than n padded queries: padding T = 300 to two chunks of 256 doubled the
  own-key work). Padded queries see valid keys and are sliced off, their zero cotangents add
  nothing; padded own keys are invalid. K/V are transposed to [Hkv, B, S, D] once."""
  t = q.shape[2]
  chunk, pad = query_chunks(t, chunk)
  q = jnp.pad(q, [(0, 0), (0, 0), (0, pad), (0, 0), (0, 0)])
  pad_kv = lambda x: jnp.pad(_kv_t(x), [(0, 0), (0, 0), (0, pad), (0, 0)])
  if reach is None:
    own_t = (pad_kv(own.k), pad_kv(own.v), jnp.pad(own.valid, [(0, 0), (0, pad)]))
    ancestors_t = tuple((_kv_t(blk.k), _kv_t(blk.v), blk.valid) for blk in ancestors)
  else:
    window, positions, key_positions = reach
    positions = jnp.pad(jnp.asarray(positions, jnp.int32), [(0, 0), (0, pad)])
    own_t = (pad_kv(own.k), pad_kv(own.v), jnp.pad(own.valid, [(0, 0), (0, pad)]), positions)
    ancestors_t = tuple((_kv_t(blk.k), _kv_t(blk.v), blk.valid, p) for blk, p in zip(ancestors, key_positions))
    reach = (positions, jnp.asarray(window, jnp.int32))
  out, lse = _attend_tiled(q, ancestors_t, own_t, reach, chunk, key_block)
  return out[:, :, :t], lse[:, :, :t]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attend_tiled(q, ancestors, own, reach, chunk: int, key_block: int):
  """`_attend` over ancestors ((k, v [Hkv, B or 1, S_i, D], valid [B or 1, S_i][, positions]), ...) and
  own (k, v [Hkv, B, T, D], valid [B, T][, positions]), T a multiple of `chunk`, a tile at a time; reach
  None or (query positions [B, T], window) (`tiled_forward`)."""
  return _attend_tiled_fwd(q, ancestors, own, reach, chunk, key_block)[0]


def _attend_tiled_fwd(q, ancestors, own, reach, chunk, key_block):
  out, lse = tiled_forward(q, ancestors, own, chunk, key_block, reach)
  return (out, lse), (q, ancestors, own, reach, out, lse)


def tiled_forward(q, ancestors: tuple, own, chunk: int, key_block: int, reach=None):
  """(out [Hkv, B, T, G, D], lse [Hkv, B, T, G]), accumulation dtype, of pre-scaled q [Hkv, B, T, G, D]
  over ancestors ((k, v [Hkv, B or 1, S_i, D], valid [B or 1, S_i]), ...) and own (k, v [Hkv, B, T,
  D], valid [B, T], bottom-right causal; or None: ancestors only), T a multiple of `chunk`. reach:
  None, or (query positions [B, T] int32, window) with every block carrying its keys' positions
  [B or 1, S] as a 4th entry: the sliding window of `_tile`, whose unreachable tiles are skipped.

  The forward of `tiled_attention` without its custom_vjp (Dao et al. 2022, Algorithm 1), for a caller
  that defines its own backward (ring attention, kernels/context_parallel.py) with `tiled_backward`."""
  acc = accum_dtype(q.dtype)
  blocks = ancestors + ((own,) if own is not None else ())
  sizes = [blk[0].shape[2] for blk in ancestors]
  vary = _varying_like(q, blocks)

  def chunk_body(c, outs):
    q_c = _take(q, c * chunk, chunk, 2)
    looped, single = _tiles(c, sizes, chunk, key_block, own is not None)
    state = SoftmaxState(vary(jnp.full(q_c.shape[:-1], jnp.finfo(acc).min, acc)), vary(jnp.zeros(q_c.shape[:-1], acc)),
                   vary(jnp.zeros(q_c.shape, acc)))
    rows = c * chunk + jnp.arange(chunk)
    reach_c = None if reach is None else (_take(reach[0], c * chunk, chunk, 1), reach[1])
    for block, start, size, count in looped:
      def step(j, st, block=block, start=start, size=size):
        tile = _tile(blocks, block, start + j * size, size, False, rows, reach_c)
        return _unless_masked(block, blocks, tile[2], lambda s: _online_step(q_c, [tile], s), st,
                              windowed=reach is not None)
      state = _loop(count, step, state)
    if single:
      state = _online_step(q_c, [_tile(blocks, *tile, rows, reach_c) for tile in single], state)
    out_c, lse_c = finish_softmax(state)
    put = lambda buf, x: lax.dynamic_update_slice_in_dim(buf, x, c * chunk, 2)
    return put(outs[0], out_c), put(outs[1], lse_c)

  return _loop(q.shape[2] // chunk, chunk_body, (vary(jnp.zeros(q.shape, acc)), vary(jnp.zeros(q.shape[:-1], acc))))


def _attend_tiled_bwd(chunk, key_block, residuals, cotangents):
  q, ancestors, own, reach, out, lse = residuals
  d_q, d_ancestors, d_own = tiled_backward(q, ancestors, own, out, lse, *cotangents, chunk, key_block, reach)
  cast = lambda ct, x: _reduce_like(ct, x).astype(x.dtype)
  none = lambda x: np.zeros(x.shape, jax.dtypes.float0)   # masks and positions take no cotangent
  d_kvs = [(cast(dk, blk[0]), cast(dv, blk[1]), *map(none, blk[2:]))
           for (dk, dv), blk in zip(d_ancestors + (d_own,), ancestors + (own,))]
  return cast(d_q, q), tuple(d_kvs[:-1]), d_kvs[-1], jax.tree_util.tree_map(none, reach)


def tiled_backward(q, ancestors: tuple, own, out, lse, d_out, d_lse, chunk: int, key_block: int, reach=None):
  """(dq, ((dk, dv) per ancestor), (dk, dv) of own or None), accumulation dtype, not summed over mesh axes.

  The backward of `tiled_forward` (Dao 2023, Algorithm 2) over the blocks given, with out [Hkv, B, T,
  G, D] and lse [Hkv, B, T, G] those of the whole softmax, which may span more keys than these
  blocks: the probabilities exp(S - lse) and dS = P (dP - rowsum(dO * O) + d lse) of these keys are
  then their share of the whole softmax's, so summing the results over a partition of the keys
  gives the whole gradient (ring attention's backward, kernels/context_parallel.py). Arguments as
  in `tiled_forward`; d_out like out, d_lse like lse."""
  acc = out.dtype
  blocks = ancestors + ((own,) if own is not None else ())
  sizes = [blk[0].shape[2] for blk in ancestors]
  vary = _varying_like((q, blocks, out, lse), (d_out, d_lse))
  d_out = d_out.astype(acc)
  # dS = P (dP - rowsum(dO * O)) + P d lse (as d lse / dS = P) = P (dP - delta)
  delta = (jnp.sum(d_out * out, axis=-1) - jnp.where(jnp.isfinite(lse), d_lse, 0.0))[..., None]
  lse = jnp.where(jnp.isfinite(lse), lse, 0.0)       # rows with no visible key: all masked, P = 0

  def chunk_body(c, carry):
    d_q, d_blocks = carry
    rows = lambda x: _take(x, c * chunk, chunk, 2)
    q_c, d_out_c, lse_c, delta_c = rows(q), rows(d_out), rows(lse), rows(delta)
    looped, single = _tiles(c, sizes, chunk, key_block, own is not None)
    rows_c = c * chunk + jnp.arange(chunk)
    reach_c = None if reach is None else (_take(reach[0], c * chunk, chunk, 1), reach[1])

    def visit(tile, carry):
      dq_c, d_blocks = carry
      block, start, size, _ = tile
      k, v, mask = _tile(blocks, *tile, rows_c, reach_c)
      grads = lambda _: _grad_tile(q_c, d_out_c, lse_c, delta_c, k, v, mask)
      # Only the tile's own gradients go through the skip's cond, not the carry: a cond returning the
      # whole dK/dV buffers would copy them at every tile.
      dq_tile, dk_tile, dv_tile = _unless_masked(block, blocks, mask, grads, None,
                                                 skipped=lambda _: jax.tree_util.tree_map(
                                                     jnp.zeros_like, jax.eval_shape(grads, None)),
                                                 windowed=reach is not None)
      dk, dv = d_blocks[block]
      d_kv = (_add_at(dk, dk_tile, start, 2), _add_at(dv, dv_tile, start, 2))
      return dq_c + dq_tile, d_blocks[:block] + (d_kv,) + d_blocks[block + 1:]

    carry = (vary(jnp.zeros(q_c.shape, acc)), d_blocks)
    for block, start, size, count in looped:
      step = lambda j, cr, block=block, start=start, size=size: visit((block, start + j * size, size, False), cr)
      carry = _loop(count, step, carry)
    for tile in single:
      carry = visit(tile, carry)
    dq_c, d_blocks = carry
    return lax.dynamic_update_slice_in_dim(d_q, dq_c, c * chunk, 2), d_blocks

  zeros = tuple((vary(jnp.zeros(blk[0].shape, acc)), vary(jnp.zeros(blk[1].shape, acc))) for blk in blocks)
  d_q, d_blocks = _loop(q.shape[2] // chunk, chunk_body, (vary(jnp.zeros(q.shape, acc)), zeros))
  if own is None:
    return d_q, tuple(d_blocks), None
  return d_q, tuple(d_blocks[:-1]), d_blocks[-1]


_attend_tiled.defvjp(_attend_tiled_fwd, _attend_tiled_bwd)
