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

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# accum_dtype is defined there (the tiled path needs it, and importing it from here would be circular)
# and re-exported: context_parallel and the kernels import it from this module.
from branch_replay_jax.kernels.tiled_attention import SoftmaxState, accum_dtype, finish_softmax, tiled_attention


class KVBlock(NamedTuple):
  """Keys/values of one segment for one layer (or, stacked, for all layers).

  k, v: [B or 1, S, Hkv, D] (with a leading layer axis [L, ...] when stacked).
  valid: [B or 1, S] bool: False marks padded keys. A segment's own block may instead carry int32
    key ends (a packed tree, `data.batches.PackedBatch`): own key j is visible to the queries i with
    j <= i < valid[j] (0 for a padded key); only `suffix_attention` (the jnp paths) reads them.
  """

  k: jax.Array
  v: jax.Array
  valid: jax.Array


class PositionedKV(NamedTuple):
  """A `KVBlock` whose keys carry their positions instead of taking them from their order: a sampler's
  sliding-window ring cache (`rollout.sampler.init_cache`), whose slot s holds the latest generated token
  t = s (mod W - 1). Read by `windowed_suffix_attention` only, as an ancestor.

  k, v: [B or 1, S, Hkv, D]; valid: [B or 1, S] bool; positions: [B or 1, S] int32, each key's position (RoPE's),
  any value on an invalid slot.
  """

  k: jax.Array
  v: jax.Array
  valid: jax.Array
  positions: jax.Array


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


# Scores are laid out [Hkv, B, T, G, S] (tiled_attention.py says why). The dense step's `_scores` and
# `_mix` take K/V as [B or 1, S, Hkv, D] and transpose them inside the vjp'd function. Written with
# tiled_attention's `_scores_t` on pre-transposed K/V they are the same math, but XLA:CPU then picked
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


def grouped_queries(q_bthd: jax.Array, own_k: jax.Array, scale: float | None, name: str, pad: int = 0):
  """(q [Hkv, B, T + pad, G, D] scaled, the scale) of queries q_bthd [B, T, Hq, D] against K with Hkv
  heads (own_k [..., Hkv, D]): the layout every jnp attention path scores in (query head h = kv head x
  G + g), the last `pad` query rows zeros; scale None: 1/sqrt(D).

  Raises:
    ValueError: naming `name`, if Hq is not a multiple of Hkv or the head dims differ.
  """
  b, t, hq, d = q_bthd.shape
  hkv = own_k.shape[-2]
  if hq % hkv or own_k.shape[-1] != d:
    raise ValueError(f"{name}: q has {hq} heads of dim {d}, own K has {hkv} heads of dim "
                     f"{own_k.shape[-1]}; need Hq % Hkv == 0 and equal head dims")
  scale = d ** -0.5 if scale is None else scale
  q = jnp.pad((q_bthd * scale).reshape(b, t, hkv, hq // hkv, d), [(0, 0), (0, pad), (0, 0), (0, 0), (0, 0)])
  return jnp.transpose(q, (2, 0, 1, 3, 4)), scale


def ungrouped(out, lse, t: int) -> tuple[jax.Array, jax.Array]:
  """`grouped_queries`' layout back: out [Hkv, B, T', G, D] and lse [Hkv, B, T', G] (T' >= t) to
  out [B, t, Hq, D] and lse [B, t, Hq], the first t query rows."""
  hkv, b, _, g, d = out.shape
  return (jnp.transpose(out[:, :, :t], (1, 2, 0, 3, 4)).reshape(b, t, hkv * g, d),
          jnp.transpose(lse[:, :, :t], (1, 2, 0, 3)).reshape(b, t, hkv * g))


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
  b, t, hq, _ = q_bthd.shape
  q, scale = grouped_queries(q_bthd, own.k, scale, "suffix_attention")   # [Hkv, B, T, G, D]
  if t == 0:
    return jnp.zeros(q_bthd.shape, q_bthd.dtype), jnp.zeros((b, 0, hq), accum_dtype(q_bthd.dtype))
  ancestors = [blk for blk in ancestors if blk.k.shape[1]]   # an empty block adds no key (and max() needs one)
  # Read at call time, so that tests can shrink them (monkeypatch) to exercise the tiling.
  chunk, key_block = QUERY_CHUNK, KEY_BLOCK
  if t <= chunk and all(blk.k.shape[1] <= key_block for blk in ancestors):
    kvs = [(blk.k, blk.v) for blk in ancestors] + [(own.k, own.v)]
    out, lse = _attend(q, kvs, _masks(ancestors, own.valid, 0))
  else:
    out, lse = tiled_attention(q, ancestors, own, chunk, key_block)
  out_bthd, lse_bth = ungrouped(out, lse, t)
  return out_bthd.astype(q_bthd.dtype), lse_bth


GLOBAL_WINDOW = 2 ** 30
"""A window no position difference reaches: `windowed_suffix_attention` with it is global attention."""


def key_positions(ancestors: Sequence[KVBlock | PositionedKV]) -> list[jax.Array]:
  """Each ancestor key's position in its sequence, [B or 1, S_i] int32 per block: the number of valid keys
  before it, over the blocks in order (the prompt, then each segment, then a decode cache). This is the
  position RoPE gave the key wherever the blocks are the ancestors of a segment (module docstring); a
  padded key's value is never read. A `PositionedKV`'s keys take their own positions, and the blocks after
  it continue from its last valid key's position + 1."""
  out, start = [], 0
  for blk in ancestors:
    valid = blk.valid.astype(jnp.int32)
    if isinstance(blk, PositionedKV):
      out.append(jnp.asarray(blk.positions, jnp.int32))
      last = jnp.max(jnp.where(blk.valid, out[-1], -1), axis=-1, keepdims=True)
      start = jnp.maximum(start, last + 1)
      continue
    out.append(start + jnp.cumsum(valid, axis=-1) - valid)
    start = start + jnp.sum(valid, axis=-1, keepdims=True)
  return out


def windowed_suffix_attention(q_bthd: jax.Array, ancestors: Sequence[KVBlock], own: KVBlock, *, window,
                              query_positions: jax.Array, scale: float | None = None) -> tuple[jax.Array, jax.Array]:
  """`suffix_attention` where a query at position p sees only the keys at positions p - window < q <= p
  (sliding-window attention: Beltagy et al. 2020, arXiv 2004.05150; Gemma 3's local layers, transformers'
  `sliding_window_overlay`: kv_idx > q_idx - sliding_window). The window crosses block boundaries: an
  ancestor key's position is `key_positions`', an own key's its query position.

  The two paths of `suffix_attention`, the window a mask on each: one dense step for a short segment,
  else query chunks and key tiles (`tiled_attention` with `reach`), where a tile that no query of its
  chunk can reach is skipped (forward and backward), so a long segment's work grows with T x W rather
  than T x S. No Pallas kernel takes a window yet.

  Args:
    q_bthd, ancestors, own, scale: as `suffix_attention` (own.valid bool; a packed tree's int key ends
      are refused).
    window: int or [] int32 (traced: a scanned layer's), W >= 1; `GLOBAL_WINDOW` for a global layer.
    query_positions: [B, T] int32, the positions of the segment's tokens (RoPE's).

  Returns and raises as `suffix_attention`, and ValueError for int key ends.
  """
  if jnp.issubdtype(own.valid.dtype, jnp.integer):
    raise ValueError("windowed_suffix_attention: a packed tree's key ends (int32 own.valid) take no window; "
                     "run sliding-window models with tree_schedule 'depth_first' or 'level'")
  b, t, hq, _ = q_bthd.shape
  q, scale = grouped_queries(q_bthd, own.k, scale, "windowed_suffix_attention")
  if t == 0:
    return jnp.zeros(q_bthd.shape, q_bthd.dtype), jnp.zeros((b, 0, hq), accum_dtype(q_bthd.dtype))
  ancestors = [blk for blk in ancestors if blk.k.shape[1]]
  qp = jnp.asarray(query_positions, jnp.int32)
  positions = key_positions(ancestors)
  if t > QUERY_CHUNK or any(blk.k.shape[1] > KEY_BLOCK for blk in ancestors):
    out, lse = tiled_attention(q, ancestors, own, QUERY_CHUNK, KEY_BLOCK, reach=(window, qp, positions))
  else:
    reach = lambda kp: (qp[:, :, None] - kp[:, None, :] < window)[None, :, :, None, :]   # [1, B, T, 1, S]
    masks = [m & reach(kp) for m, kp in zip(_masks(ancestors, own.valid, 0), positions + [qp])]
    out, lse = _attend(q, [(blk.k, blk.v) for blk in ancestors] + [(own.k, own.v)], masks)
  out_bthd, lse_bth = ungrouped(out, lse, t)
  return out_bthd.astype(q_bthd.dtype), lse_bth


# ------------------------------------------------------------------------------------------------
# The dense step: one chunk of queries against whole blocks.


def own_key_mask(own_valid, rows):
  """Visibility of a segment's own keys (their valid [B, S]) to its query rows `rows` [C], broadcastable to
  scores [Hkv, B, C, G, S], causal not included: bool valid, or int32 key ends (`KVBlock`: query i
  sees key j while i < ends[j], the packed tree's subtree end)."""
  if jnp.issubdtype(own_valid.dtype, jnp.integer):
    return (rows[None, :, None] < own_valid[:, None, :])[None, :, :, None, :]
  return own_valid[None, :, None, None, :]


def _masks(ancestors: Sequence[KVBlock], own_valid, start: int) -> list:
  """Visibility of each block's keys to the queries start..start+C-1 of the segment, broadcastable to
  their scores [Hkv, B, C, G, S]: ancestor keys by their valid mask; own keys 0..E-1 (own_valid
  [B, E], E = start + C) bottom-right causal (query start + i sees own keys <= start + i) and valid
  (`own_key_mask`)."""
  end = own_valid.shape[1]
  rows = jnp.arange(start, end)
  causal = jnp.arange(end)[None, :] <= rows[:, None]   # [C, E]
  masks = [blk.valid[None, :, None, None, :] for blk in ancestors]
  return masks + [causal[None, None, :, None, :] & own_key_mask(own_valid, rows)]


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
  out, lse = finish_softmax(SoftmaxState(row_max, total, out))
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
