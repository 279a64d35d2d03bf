"""Dense jnp suffix attention: the oracle for the Pallas kernels and the CPU implementation.

A segment's queries attend to a list of key/value blocks: the K/V of its ancestors (prompt,
shared response segments, an already generated KV cache) and its own K/V. Ancestor keys are
visible to every query, subject to their validity mask; own keys are bottom-right causal:

    keys:      [ ancestor block 0 | ancestor block 1 | own 0 1 2 3 ]
    query 0      x x x x . x x x .    x . . .
    query 1      x x x x . x x x .    x x . .
    query 2      x x x x . x x x .    x x x .
    query 3      x x x x . x x x .    x x x x      ('.' in an ancestor: a padded key)

The blocks are not concatenated: a block whose batch is 1 (a prompt shared by B samples) is
used as is, never tiled B times.

Two paths, the same function. A short segment (T <= QUERY_CHUNK queries, every ancestor block
<= KEY_BLOCK keys: a completion over a short prompt) is one dense step over whole blocks. A longer
one is tiled: its queries in chunks of QUERY_CHUNK, visited one after another by `lax.fori_loop`,
each scoring its keys a tile at a time with the online softmax, so that at most one tile's
scores [Hkv, B, QUERY_CHUNK, G, KEY_BLOCK] (or [.., QUERY_CHUNK] for own keys) are live:

    keys:     [ ancestor: tile 0 | tile 1 | tail ]  [ own: tile 0 | tile 1 | tile 2 ]
    chunk 0     loop over tiles    ...      static    diagonal
    chunk 1     loop over tiles    ...      static    loop       diagonal
    chunk 2     loop over tiles    ...      static    loop       loop     diagonal
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


class KVBlock(NamedTuple):
  """Keys/values of one segment for one layer (or, stacked, for all layers).

  k, v: [B or 1, S, Hkv, D] (with a leading layer axis [L, ...] when stacked).
  valid: [B or 1, S] bool: False marks padded keys.
  """

  k: jax.Array
  v: jax.Array
  valid: jax.Array


def accum_dtype(dtype):
  """Accumulation dtype: float32 for bfloat16/float16/float32 inputs, float64 for float64."""
  return jnp.promote_types(dtype, jnp.float32)


QUERY_CHUNK = 256
"""Queries per chunk of `suffix_attention`, and keys per tile of the segment's own keys. Chunk c
(queries [cC, (c+1)C)) attends to own tiles 0..c-1, visible subject to their valid mask, and to
tile c, its causal diagonal; own keys after the chunk are never scored. A segment of T tokens thus
computes about (1 + T / C) / 2 of its T x T own-block scores (62.5% at T = 1024). A segment of
<= QUERY_CHUNK tokens is one chunk; a longer one is split into n = ceil(T / QUERY_CHUNK) chunks
of C = ceil(T / n) <= QUERY_CHUNK queries, padded by fewer than n (dropped queries, masked keys)."""

KEY_BLOCK = 512
"""Ancestor keys per tile of the online softmax. An ancestor block of more than KEY_BLOCK keys is
scored KEY_BLOCK keys at a time in a `lax.fori_loop`, its last S mod KEY_BLOCK keys as one more
tile; a block of <= KEY_BLOCK keys is one tile. With QUERY_CHUNK, this bounds the live scores at
[Hkv, B, QUERY_CHUNK, G, KEY_BLOCK] (B x 4.7 MB of float32 for SmolLM2-135M, Hkv = G = 3)."""


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


# The dense step's `_scores` and `_mix` take K/V as [B or 1, S, Hkv, D] and transpose them inside the
# vjp'd function. Written as `_scores_t(q, _kv_t(k))` they are the same math, but XLA:CPU then picked
# other dot layouts for the gradient and the P = 256 fwd+bwd of benchmarks/attention_memory.py took
# 8% more CPU time; so they stay as they were.


def _scores(q_kbtgd, k_bskd):
  """[Hkv, B, T, G, S] scores of queries [Hkv, B, T, G, D] against keys [B or 1, S, Hkv, D]."""
  acc = accum_dtype(q_kbtgd.dtype)
  hkv, b, t, g, d = q_kbtgd.shape
  s = k_bskd.shape[1]
  if k_bskd.shape[0] == 1:   # one block shared by the B rows: the rows join the queries
    k_ksd = jnp.transpose(k_bskd[0], (1, 0, 2))
    scores = jnp.einsum("knd,ksd->kns", q_kbtgd.reshape(hkv, b * t * g, d), k_ksd, preferred_element_type=acc)
  else:
    k_kbsd = jnp.transpose(k_bskd, (2, 0, 1, 3))
    scores = jnp.einsum("kbqd,kbsd->kbqs", q_kbtgd.reshape(hkv, b, t * g, d), k_kbsd, preferred_element_type=acc)
  return scores.reshape(hkv, b, t, g, s)


def _mix(p_kbtgs, v_bskd):
  """[Hkv, B, T, G, D] = probabilities [Hkv, B, T, G, S] times values [B or 1, S, Hkv, D]."""
  acc = accum_dtype(v_bskd.dtype)
  hkv, b, t, g, s = p_kbtgs.shape
  d = v_bskd.shape[-1]
  if v_bskd.shape[0] == 1:
    v_ksd = jnp.transpose(v_bskd[0], (1, 0, 2))
    out = jnp.einsum("kns,ksd->knd", p_kbtgs.reshape(hkv, b * t * g, s), v_ksd, preferred_element_type=acc)
  else:
    v_kbsd = jnp.transpose(v_bskd, (2, 0, 1, 3))
    out = jnp.einsum("kbqs,kbsd->kbqd", p_kbtgs.reshape(hkv, b, t * g, s), v_kbsd, preferred_element_type=acc)
  return out.reshape(hkv, b, t, g, d)


def suffix_attention(q_bthd: jax.Array, ancestors: Sequence[KVBlock], own: KVBlock,
                     *, scale: float | None = None) -> tuple[jax.Array, jax.Array]:
  """Softmax attention of a segment's queries over [ancestors ; own], own bottom-right causal.

  FlashAttention's algorithm written in jnp. Forward: the online softmax (Dao et al. 2022, arXiv
  2205.14135, Algorithm 1, lines 9-12; Milakov & Gimelshein 2018, arXiv 1805.02867): per query
  row a running max m, sum l and unnormalised output o, and per key tile with scores S_j,
  m' = max(m, rowmax S_j), l' = e^(m - m') l + rowsum e^(S_j - m'), o' = e^(m - m') o + e^(S_j - m') V_j;
  out = o / l, lse = m + log l. Backward (Dao 2023, arXiv 2307.08691, Algorithm 2): only the
  inputs, out and lse are kept; each tile's probabilities are recomputed, P_j = exp(S_j - lse),
  and dV_j = P_j^T dO, dS_j = P_j * (dO V_j^T - rowsum(dO * O) + d lse), dQ += dS_j K_j,
  dK_j = dS_j^T Q (d lse / dS = P adds the lse cotangent). So no score-sized array is saved
  between the passes (a layer scan would stack one per layer: 30 of them for SmolLM2).

  Short segments (T <= QUERY_CHUNK and every ancestor block <= KEY_BLOCK keys) take one step over
  whole blocks; longer ones loop over query chunks and key tiles (the module docstring), holding
  O(QUERY_CHUNK x KEY_BLOCK) scores at a time, forward and backward, and accumulating dQ, dK and
  dV across tiles in the accumulation dtype.

  Args:
    q_bthd: [B, T, Hq, D] queries; Hq must be a multiple of every block's Hkv (GQA).
    ancestors: blocks with k, v [B or 1, S_i, Hkv, D] and valid [B or 1, S_i].
    own: the segment's block, k, v [B, T, Hkv, D], valid [B, T].
    scale: logit scale, default 1/sqrt(D).

  Returns:
    out_bthd: [B, T, Hq, D] in q's dtype. A query with no visible key gets zeros.
    lse_bth: [B, T, Hq] float32 (float64 for float64 q) log-sum-exp of the scaled scores (-inf where no key is visible).
    Both are differentiable (the context-parallel merge differentiates through lse).

  Raises:
    ValueError: if Hq is not a multiple of Hkv or head dims differ.
  """
  b, t, hq, d = q_bthd.shape
  hkv = own.k.shape[-2]
  if hq % hkv or own.k.shape[-1] != d:
    raise ValueError(f"suffix_attention: q has {hq} heads of dim {d}, own K has {hkv} heads of dim "
                     f"{own.k.shape[-1]}; need Hq % Hkv == 0 and equal head dims")
  scale = d ** -0.5 if scale is None else scale
  if t == 0:
    return jnp.zeros(q_bthd.shape, q_bthd.dtype), jnp.zeros((b, 0, hq), accum_dtype(q_bthd.dtype))
  q = jnp.transpose((q_bthd * scale).reshape(b, t, hkv, hq // hkv, d), (2, 0, 1, 3, 4))   # [Hkv, B, T, G, D]
  ancestors = [blk for blk in ancestors if blk.k.shape[1]]   # an empty block adds no key (and max() needs one)
  # Read at call time, so that tests can shrink them (monkeypatch) to exercise the tiling.
  chunk, key_block = QUERY_CHUNK, KEY_BLOCK
  if t <= chunk and all(blk.k.shape[1] <= key_block for blk in ancestors):
    kvs = [(blk.k, blk.v) for blk in ancestors] + [(own.k, own.v)]
    out, lse = _attend(q, kvs, _masks(ancestors, own.valid, 0))
  else:
    out, lse = _tiled(q, ancestors, own, chunk, key_block)
  lse_bth = jnp.transpose(lse, (1, 2, 0, 3)).reshape(b, t, hq)
  out_bthd = jnp.transpose(out, (1, 2, 0, 3, 4)).reshape(b, t, hq, d)
  return out_bthd.astype(q_bthd.dtype), lse_bth


# ------------------------------------------------------------------------------------------------
# The dense step: one chunk of queries against whole blocks.


def _masks(ancestors: Sequence[KVBlock], own_valid, start: int) -> list:
  """Visibility of each block's keys to the queries start..start+C-1 of the segment, broadcastable to
  their scores [Hkv, B, C, G, S]: ancestor keys by their valid mask; own keys 0..E-1 (own_valid
  [B, E], E = start + C) bottom-right causal (query start + i sees own keys <= start + i) and valid."""
  end = own_valid.shape[1]
  causal = jnp.arange(end)[None, :] <= jnp.arange(start, end)[:, None]   # [C, E]
  masks = [blk.valid[None, :, None, None, :] for blk in ancestors]
  return masks + [causal[None, None, :, None, :] & own_valid[None, :, None, None, :]]


def _block_probs(q, k, mask, lse):
  """exp(S - lse) on visible keys, 0 elsewhere: [Hkv, B, T, G, S] accum dtype, and S's pullback (`_scores`)."""
  scores, pullback = jax.vjp(_scores, q, k)
  finite = jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]   # rows with no visible key: all masked
  return jnp.where(mask, jnp.exp(scores - finite), 0.0), pullback


@jax.custom_vjp
def _attend(q, kvs, masks):
  """(out [Hkv, B, T, G, D] accum dtype, lse [Hkv, B, T, G]) of pre-scaled q over blocks kvs [(k, v), ...]."""
  return _attend_fwd(q, kvs, masks)[0]


def _attend_fwd(q, kvs, masks):
  acc = accum_dtype(q.dtype)
  # A finite fill (not -inf) keeps exp() NaN-free for rows with no visible key.
  scores = [jnp.where(m, _scores(q, k), jnp.finfo(acc).min) for (k, _), m in zip(kvs, masks)]
  row_max = jnp.max(jnp.stack([jnp.max(s, axis=-1) for s in scores]), axis=0)         # [Hkv, B, T, G]
  exps = [jnp.where(m, jnp.exp(s - row_max[..., None]), 0.0) for s, m in zip(scores, masks)]
  total = sum(jnp.sum(e, axis=-1) for e in exps)
  out = sum(_mix(e.astype(v.dtype), v) for e, (_, v) in zip(exps, kvs))
  out, lse = _finish(_State(row_max, total, out))
  return (out, lse), (q, kvs, masks, out, lse)


def _attend_bwd(residuals, cotangents):
  q, kvs, masks, out, lse = residuals
  d_out, d_lse = cotangents
  # dS = P (dP - rowsum(dO * O)) + P d lse (as d lse / dS = P) = P (dP - delta)
  delta = (jnp.sum(d_out * out, axis=-1) - jnp.where(jnp.isfinite(lse), d_lse, 0.0))[..., None]
  d_q = jnp.zeros(q.shape, out.dtype)
  d_kvs = []
  for (k, v), m in zip(kvs, masks):
    probs, scores_pullback = _block_probs(q, k, m, lse)
    _, mix_pullback = jax.vjp(_mix, probs.astype(v.dtype), v)
    d_probs, d_v = mix_pullback(d_out.astype(out.dtype))
    d_scores = probs * (d_probs.astype(probs.dtype) - delta)
    dq_block, d_k = scores_pullback(d_scores)
    d_q = d_q + dq_block.astype(d_q.dtype)
    d_kvs.append((d_k, d_v))
  masks_ct = jax.tree_util.tree_map(lambda x: np.zeros(x.shape, jax.dtypes.float0), masks)
  return d_q.astype(q.dtype), d_kvs, masks_ct


_attend.defvjp(_attend_fwd, _attend_bwd)


# ------------------------------------------------------------------------------------------------
# The tiled path: query chunks one after another, key tiles one after another, online softmax.


class _State(NamedTuple):
  """Online-softmax statistics of a query chunk: running row max m and sum l [Hkv, B, C, G], and the
  unnormalised output o [Hkv, B, C, G, D] (Dao et al. 2022, Algorithm 1: m_i, l_i, O_i before dividing)."""

  m: jax.Array
  l: jax.Array
  o: jax.Array


def _finish(state: _State):
  """(out = o / l, lse = m + log l); rows with no visible key (l = 0) get out 0 and lse -inf."""
  visible = state.l > 0
  out = state.o / jnp.where(visible, state.l, 1.0)[..., None]      # normalise the output, not the probabilities
  lse = jnp.where(visible, state.m + jnp.log(jnp.where(visible, state.l, 1.0)), -jnp.inf)
  return out, lse


def _online_step(q, tiles, state: _State) -> _State:
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
  return _State(row_max, total, out)


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


def _loop(n, body, init):
  """lax.fori_loop(0, n, body, init), without a loop for a static n of 0 or 1."""
  if isinstance(n, int) and n <= 1:
    return body(0, init) if n else init
  return lax.fori_loop(0, n, body, init)


def _tiles(c, sizes: Sequence[int], chunk: int, key_block: int):
  """Key tiles seen by query chunk c: (looped [(block, start, size, count)], single [(block, start, size, causal)]).

  `sizes` are the ancestor blocks' key counts; block index len(sizes) is the own block. Looped
  entries are `count` tiles of `size` keys from `start`: an ancestor's full KEY_BLOCK tiles, and
  own tiles 0..c-1 (all before the chunk's first query). Single tiles: an ancestor's remainder (or
  the whole of a short one) and own tile c, the causal diagonal."""
  looped, single = [], []
  for i, s in enumerate(sizes):
    n = s // key_block if s > key_block else 0
    if n:
      looped.append((i, 0, key_block, n))
    if s > n * key_block:
      single.append((i, n * key_block, s - n * key_block, False))
  looped.append((len(sizes), 0, chunk, c))
  single.append((len(sizes), c * chunk, chunk, True))
  return looped, single


def _tile(blocks, block: int, start, size: int, causal: bool):
  """(k, v [Hkv, B or 1, size, D], mask broadcastable to [Hkv, B, C, G, size]) of one tile."""
  k, v, valid = blocks[block]
  mask = _take(valid, start, size, 1)[None, :, None, None, :]
  if causal:   # the diagonal tile: query i of the chunk sees its keys 0..i
    mask = mask & jnp.tril(jnp.ones((size, size), bool))[None, None, :, None, :]
  return _take(k, start, size, 2), _take(v, start, size, 2), mask


def _tiled(q, ancestors: Sequence[KVBlock], own: KVBlock, chunk: int, key_block: int):
  """(out [Hkv, B, T, G, D] accum dtype, lse [Hkv, B, T, G]) of pre-scaled q [Hkv, B, T, G, D], tiled.

  The T queries are split into n = ceil(T / chunk) equal chunks of ceil(T / n) <= chunk, T padded
  to n of them (fewer than n padded queries: padding T = 300 to two chunks of 256 doubled the
  own-key work). Padded queries see valid keys and are sliced off, their zero cotangents add
  nothing; padded own keys are invalid. K/V are transposed to [Hkv, B, S, D] once."""
  t = q.shape[2]
  n_chunks = -(-t // chunk)
  chunk = -(-t // n_chunks)
  pad = n_chunks * chunk - t
  q = jnp.pad(q, [(0, 0), (0, 0), (0, pad), (0, 0), (0, 0)])
  pad_kv = lambda x: jnp.pad(_kv_t(x), [(0, 0), (0, 0), (0, pad), (0, 0)])
  own_t = (pad_kv(own.k), pad_kv(own.v), jnp.pad(own.valid, [(0, 0), (0, pad)]))
  ancestors_t = tuple((_kv_t(blk.k), _kv_t(blk.v), blk.valid) for blk in ancestors)
  out, lse = _attend_tiled(q, ancestors_t, own_t, chunk, key_block)
  return out[:, :, :t], lse[:, :, :t]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _attend_tiled(q, ancestors, own, chunk: int, key_block: int):
  """`_attend` over ancestors ((k, v [Hkv, B or 1, S_i, D], valid [B or 1, S_i]), ...) and own
  (k, v [Hkv, B, T, D], valid [B, T]), T a multiple of `chunk`, a tile at a time."""
  return _attend_tiled_fwd(q, ancestors, own, chunk, key_block)[0]


def _attend_tiled_fwd(q, ancestors, own, chunk, key_block):
  acc = accum_dtype(q.dtype)
  blocks = ancestors + (own,)
  sizes = [k.shape[2] for k, _, _ in ancestors]
  vary = _varying_like(q, blocks)

  def chunk_body(c, outs):
    q_c = _take(q, c * chunk, chunk, 2)
    looped, single = _tiles(c, sizes, chunk, key_block)
    state = _State(vary(jnp.full(q_c.shape[:-1], jnp.finfo(acc).min, acc)), vary(jnp.zeros(q_c.shape[:-1], acc)),
                   vary(jnp.zeros(q_c.shape, acc)))
    for block, start, size, count in looped:
      step = lambda j, st, block=block, start=start, size=size: _online_step(
          q_c, [_tile(blocks, block, start + j * size, size, False)], st)
      state = _loop(count, step, state)
    out_c, lse_c = _finish(_online_step(q_c, [_tile(blocks, *tile) for tile in single], state))
    put = lambda buf, x: lax.dynamic_update_slice_in_dim(buf, x, c * chunk, 2)
    return put(outs[0], out_c), put(outs[1], lse_c)

  out, lse = _loop(q.shape[2] // chunk, chunk_body, (vary(jnp.zeros(q.shape, acc)), vary(jnp.zeros(q.shape[:-1], acc))))
  return (out, lse), (q, ancestors, own, out, lse)


def _attend_tiled_bwd(chunk, key_block, residuals, cotangents):
  q, ancestors, own, out, lse = residuals
  d_out, d_lse = cotangents
  acc = out.dtype
  blocks = ancestors + (own,)
  sizes = [k.shape[2] for k, _, _ in ancestors]
  vary = _varying_like(residuals, cotangents)
  d_out = d_out.astype(acc)
  # dS = P (dP - rowsum(dO * O)) + P d lse (as d lse / dS = P) = P (dP - delta)
  delta = (jnp.sum(d_out * out, axis=-1) - jnp.where(jnp.isfinite(lse), d_lse, 0.0))[..., None]
  lse = jnp.where(jnp.isfinite(lse), lse, 0.0)       # rows with no visible key: all masked, P = 0

  def chunk_body(c, carry):
    d_q, d_blocks = carry
    rows = lambda x: _take(x, c * chunk, chunk, 2)
    q_c, d_out_c, lse_c, delta_c = rows(q), rows(d_out), rows(lse), rows(delta)
    looped, single = _tiles(c, sizes, chunk, key_block)

    def visit(tile, carry):
      dq_c, d_blocks = carry
      block, start, size, _ = tile
      dq_tile, dk_tile, dv_tile = _grad_tile(q_c, d_out_c, lse_c, delta_c, *_tile(blocks, *tile))
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

  zeros = tuple((vary(jnp.zeros(k.shape, acc)), vary(jnp.zeros(v.shape, acc))) for k, v, _ in blocks)
  d_q, d_blocks = _loop(q.shape[2] // chunk, chunk_body, (vary(jnp.zeros(q.shape, acc)), zeros))
  cast = lambda ct, x: _reduce_like(ct, x).astype(x.dtype)
  d_kvs = [(cast(dk, k), cast(dv, v), np.zeros(valid.shape, jax.dtypes.float0))
           for (dk, dv), (k, v, valid) in zip(d_blocks, blocks)]
  return cast(d_q, q), tuple(d_kvs[:-1]), d_kvs[-1]


_attend_tiled.defvjp(_attend_tiled_fwd, _attend_tiled_bwd)
