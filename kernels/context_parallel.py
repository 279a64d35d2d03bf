"""Attention over a prompt whose tokens are split over a mesh axis (context parallelism, inside `shard_map`).

A prompt of P_pad tokens is split over the S devices of a mesh axis (default "seq"): shard i holds
positions [i*C, (i+1)*C), C = P_pad / S. Attention functions with `suffix_attention`'s signature
`(q, ancestors, own) -> (out, lse)`:

`ring_prompt_attention` -- the prompt's own forward by ring attention over the tiled jnp attention
(the "xla" implementation; docs/design.md, "Mesh and sharding"). A chunk's queries attend to their
own chunk (bottom-right causal), then to each earlier chunk as it passes around the ring:

    step 0 (own):          device 2 holds chunk 2      causal
    step s = 1, 2, 3:      device 2 receives chunk (2 - s) mod 4: 1, 0 (folded in), 3 (later: skipped)

  Cost per device and layer: two K/V chunks at a time ([C] keys each; dK/dV accumulators beside
  them in the backward), the tiled attention's tile of scores, S - 1 `ppermute`s forward and S backward
  (K/V with their dK/dV; the last one dK/dV only), and only the causal half of the FLOPs (later chunks are not visited). Residuals: the
  local q, K/V, out and lse.

`prompt_chunk_attention` -- the same contract for a base kernel (the Pallas kernels): each layer
all-gathers the chunks' K/V over the axis and a chunk's queries attend to every valid key of the
earlier chunks plus their own chunk (bottom-right causal):

    keys (all-gathered):   [ chunk 0 | chunk 1 | chunk 2 | chunk 3 ]
    queries of chunk 2        x x x     x x x     causal    . . .      ('.': a later chunk, masked)

  One collective per layer and the base kernel unchanged. Cost per device and layer: the gathered
  K/V, 2 x P_pad x Hkv x D values (the prompt's whole K/V, as without sharding; the residual kept
  for the backward pass unless the layer is rematerialised), scores [C, P_pad] per head (1/S of the
  unsharded [P, P]), and about 2x the causal attention FLOPs (later chunks are computed and
  masked). The transpose of `all_gather` is a reduce-scatter, so dK/dV return to the chunk that
  owns them.

`over_sharded_prompt` -- a later segment (a completion, a tree node), replicated over the axis,
whose first ancestor is the sharded prompt. Each device attends to its local prompt chunk (a
partial softmax, with its log-sum-exp), the partials are merged across the axis, and the
segment's other ancestors and own keys (bottom-right causal) are counted once, locally:

    m = max(pmax_i lse_i, lse_rest)        (stop_gradient: the result does not depend on m)
    w_i = exp(lse_i - m),  w_rest = exp(lse_rest - m)
    out = (psum_i w_i out_i + w_rest out_rest) / (psum_i w_i + w_rest)

  This is the blockwise softmax of Milakov & Gimelshein 2018 (arXiv 1805.02867, "online
  normaliser", eq. 4) and of ring attention (Liu et al. 2023, arXiv 2310.01889), across devices.

Under `shard_map(check_vma=True)` the segment's computation is replicated over the axis and varies
with it only through the local prompt chunk: each device's loss is the whole loss, so gradients
summed over the axis are S times the gradient (see branch_replay_jax/distributed/mesh.py, which divides by S).
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from branch_replay_jax.kernels import reference
from branch_replay_jax.kernels.reference import KVBlock, accum_dtype
from branch_replay_jax.kernels.tiled_attention import query_chunks, tiled_backward, tiled_forward, while_range
from branch_replay_jax.kernels.vma import to_common_varying

AttentionFn = Callable[..., tuple[jax.Array, jax.Array]]


def prompt_chunk_attention(base: AttentionFn, axis: str = "seq") -> AttentionFn:
  """`suffix_attention`-compatible attention for one chunk of a prompt sharded over `axis`.

  The returned function takes q [B, C, Hq, D], no ancestors, and own (the chunk's K/V [B, C, Hkv,
  D], valid [B, C]) and returns (out [B, C, Hq, D], lse [B, C, Hq]) for the chunk's queries over
  the whole prompt's keys at positions <= theirs. Call it inside `shard_map` over `axis`.

  Raises:
    ValueError: if ancestors are given (a sharded prompt is the root of its rollout tree).
  """
  def attention(q_bthd, ancestors: Sequence[KVBlock], own: KVBlock, *, scale: float | None = None):
    if ancestors:
      raise ValueError(f"prompt_chunk_attention: got {len(ancestors)} ancestor blocks; a sharded prompt has none")
    gather = lambda x: jax.lax.all_gather(x, axis, axis=1, tiled=True)
    k, v, valid = gather(own.k), gather(own.v), gather(own.valid)
    c = own.k.shape[1]
    before = jnp.arange(k.shape[1]) < jax.lax.axis_index(axis) * c
    earlier = KVBlock(k, v, valid & before[None])
    return base(q_bthd, [earlier], own, scale=scale)
  return attention


def ring_prompt_attention(axis: str = "seq") -> AttentionFn:
  """`prompt_chunk_attention`'s contract by ring attention over the tiled jnp attention (no all-gather).

  The returned function takes q [B, C, Hq, D], no ancestors, and own (the chunk's K/V [B, C, Hkv,
  D], valid [B, C]) and returns (out [B, C, Hq, D] in q's dtype, lse [B, C, Hq] accumulation dtype)
  of the chunk's queries over the whole prompt's valid keys at positions <= theirs; a query with no
  visible key gets out 0 and lse -inf. Call it inside `shard_map` over `axis`.

  Ring attention (Liu et al. 2023, arXiv 2310.01889, Algorithm 1): device i first attends to its own
  chunk (causal), then S - 1 `ppermute` steps pass the K/V chunks around the ring (device i receives
  chunk (i - s) mod S at step s) and each visiting chunk from an earlier position (s <= i) is folded
  into (out, lse) by the blockwise softmax merge; a later chunk is skipped (`lax.cond`, no compute).
  Each block is scored by `tiled_attention.tiled_forward` (FlashAttention's online softmax, query
  chunks of `reference.QUERY_CHUNK`, key tiles of `reference.KEY_BLOCK`). The backward pass keeps
  only the local q, K/V, out and lse; it passes each K/V chunk around the ring again with its dK/dV
  accumulator, adds every visited chunk's share (`tiled_backward`: the probabilities recomputed
  from the saved lse, Dao 2023, arXiv 2307.08691, Algorithm 2), and a last `ppermute` returns each
  accumulator to the chunk's owner. Per device and layer: at most two K/V chunks and their
  accumulators ([C] keys each), no [P_pad] K/V, forward or backward.

  Raises:
    ValueError: if ancestors are given, or Hq is not a multiple of Hkv or head dims differ.
  """
  def attention(q_bthd, ancestors: Sequence[KVBlock], own: KVBlock, *, scale: float | None = None):
    if ancestors:
      raise ValueError(f"ring_prompt_attention: got {len(ancestors)} ancestor blocks; a sharded prompt has none")
    t = q_bthd.shape[1]
    chunk, pad = query_chunks(t, reference.QUERY_CHUNK)     # read at call time (tests shrink them)
    q, _ = reference.grouped_queries(q_bthd, own.k, scale, "ring_prompt_attention", pad)
    rows = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    kv_t = lambda x: jnp.transpose(rows(x), (2, 0, 1, 3))  # [Hkv, B, C_pad, D]
    # one varying type for every input (kernels/vma.py): the ring's loops carry them together
    (q, own_t), _ = to_common_varying(q, (kv_t(own.k), kv_t(own.v), rows(own.valid)))
    out_bthd, lse_bth = reference.ungrouped(*_ring(q, own_t, axis, chunk, reference.KEY_BLOCK), t)
    return out_bthd.astype(q_bthd.dtype), lse_bth
  return attention


def _merge(out_a, lse_a, out_b, lse_b):
  """The softmax over the union of two disjoint key sets from each one's (out, lse) (Milakov &
  Gimelshein 2018, eq. 4): weights exp(lse - max); a row with no visible key in either stays (0, -inf)."""
  m = jnp.maximum(lse_a, lse_b)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  w_a, w_b = jnp.exp(lse_a - m), jnp.exp(lse_b - m)
  den = w_a + w_b
  safe = jnp.where(den > 0, den, 1.0)
  out = (w_a[..., None] * out_a + w_b[..., None] * out_b) / safe[..., None]
  return out, jnp.where(den > 0, m + jnp.log(safe), -jnp.inf)


def _ring_permutation(axis: str):
  n = lax.axis_size(axis)
  return n, lax.axis_index(axis), [(j, (j + 1) % n) for j in range(n)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _ring(q, own, axis: str, chunk: int, key_block: int):
  """(out [Hkv, B, C, G, D], lse [Hkv, B, C, G]) accumulation dtype, of pre-scaled q [Hkv, B, C, G, D]
  over the prompt's chunks before it and own = (k, v [Hkv, B, C, D], valid [B, C]), C a multiple of `chunk`."""
  return _ring_fwd(q, own, axis, chunk, key_block)[0]


def _ring_fwd(q, own, axis, chunk, key_block):
  n, i, perm = _ring_permutation(axis)
  out, lse = tiled_forward(q, (), own, chunk, key_block)

  def step(s, carry):
    kv, out, lse = carry
    kv = lax.ppermute(kv, axis, perm)                       # chunk (i - s) mod n
    visit = lambda: _merge(out, lse, *tiled_forward(q, (kv,), None, chunk, key_block))
    out, lse = lax.cond(s <= i, visit, lambda: (out, lse))  # (i - s) mod n < i iff s <= i
    return kv, out, lse

  _, out, lse = while_range(1, n, step, (own, out, lse))
  return (out, lse), (q, own, out, lse)


def _ring_bwd(axis, chunk, key_block, residuals, cotangents):
  q, own, out, lse = residuals
  d_out, d_lse = cotangents
  n, i, perm = _ring_permutation(axis)
  d_q, _, d_own = tiled_backward(q, (), own, out, lse, d_out, d_lse, chunk, key_block)

  def step(s, carry):
    kv, d_kv, d_q = carry
    kv, d_kv = lax.ppermute((kv, d_kv), axis, perm)         # chunk (i - s) mod n and its dK/dV so far

    def visit():
      dq_b, ((dk_b, dv_b),), _ = tiled_backward(q, (kv,), None, out, lse, d_out, d_lse, chunk, key_block)
      return d_q + dq_b, (d_kv[0] + dk_b, d_kv[1] + dv_b)
    d_q, d_kv = lax.cond(s <= i, visit, lambda: (d_q, d_kv))
    return kv, d_kv, d_q

  d_kv = (jnp.zeros_like(d_own[0]), jnp.zeros_like(d_own[1]))
  _, d_kv, d_q = while_range(1, n, step, (own, d_kv, d_q))
  d_kv = lax.ppermute(d_kv, axis, perm)                     # device i held chunk (i + 1) mod n's: home
  k, v, valid = own
  d_k, d_v = (d_own[0] + d_kv[0]).astype(k.dtype), (d_own[1] + d_kv[1]).astype(v.dtype)
  return d_q.astype(q.dtype), (d_k, d_v, np.zeros(valid.shape, jax.dtypes.float0))


_ring.defvjp(_ring_fwd, _ring_bwd)


def _partial_attention(q_bthd, block: KVBlock, scale: float):
  """Softmax attention over one block, no causal mask: (out [B, T, Hq, D] accum dtype, lse [B, T, Hq]).

  As `reference.suffix_attention` does: T <= QUERY_CHUNK queries over C <= KEY_BLOCK keys take one
  dense step (`_dense_partial`, the same program as before tiling); longer ones the tiled jnp
  attention over the block as an ancestor (`tiled_forward` with no own block; its backward
  `tiled_backward`), so that at most one tile of scores [Hkv, B, QUERY_CHUNK, G, KEY_BLOCK] is live
  and none is kept for the backward pass: a completion's T queries against a prompt chunk of C
  keys never form [T, C] scores. A row with no valid key gets out 0 and lse -inf."""
  t = q_bthd.shape[1]
  if t <= reference.QUERY_CHUNK and block.k.shape[1] <= reference.KEY_BLOCK:
    return _dense_partial(q_bthd, block, scale)
  chunk, pad = query_chunks(t, reference.QUERY_CHUNK)
  q, _ = reference.grouped_queries(q_bthd, block.k, scale, "over_sharded_prompt", pad)
  kv_t = lambda x: jnp.transpose(x, (2, 0, 1, 3))              # [Hkv, B or 1, C, D]
  (q, blk), _ = to_common_varying(q, (kv_t(block.k), kv_t(block.v), block.valid))
  return reference.ungrouped(*_tiled_partial(q, blk, chunk, reference.KEY_BLOCK), t)


def _dense_partial(q_bthd, block: KVBlock, scale: float):
  """`_partial_attention` in one step over the whole block (short segments), by autodiff."""
  b, t, hq, d = q_bthd.shape
  hkv = block.k.shape[-2]
  acc = accum_dtype(q_bthd.dtype)
  q = (q_bthd * scale).reshape(b, t, hkv, hq // hkv, d)
  kb = jnp.broadcast_to(block.k, (b,) + block.k.shape[1:])
  vb = jnp.broadcast_to(block.v, (b,) + block.v.shape[1:])
  mask = jnp.broadcast_to(block.valid, (b, block.valid.shape[1]))[:, None, None, None, :]
  scores = jnp.einsum("btkgd,bskd->bkgts", q, kb, preferred_element_type=acc)
  scores = jnp.where(mask, scores, jnp.finfo(acc).min)     # finite fill: a NaN-free backward
  lse = jax.nn.logsumexp(scores, axis=-1)
  probs = jnp.where(mask, jnp.exp(scores - lse[..., None]), 0.0)
  out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(vb.dtype), vb, preferred_element_type=acc)
  lse = jnp.where(mask.any(axis=-1), lse, -jnp.inf)
  return out.reshape(b, t, hq, d), jnp.transpose(lse, (0, 3, 1, 2)).reshape(b, t, hq)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _tiled_partial(q, block, chunk: int, key_block: int):
  """(out, lse) accumulation dtype of pre-scaled q [Hkv, B, T, G, D] over block (k, v [Hkv, B or 1, C, D], valid)."""
  return tiled_forward(q, (block,), None, chunk, key_block)


def _tiled_partial_fwd(q, block, chunk, key_block):
  out, lse = tiled_forward(q, (block,), None, chunk, key_block)
  return (out, lse), (q, block, out, lse)


def _tiled_partial_bwd(chunk, key_block, residuals, cotangents):
  q, block, out, lse = residuals
  d_q, ((d_k, d_v),), _ = tiled_backward(q, (block,), None, out, lse, *cotangents, chunk, key_block)
  k, v, valid = block
  return d_q.astype(q.dtype), (d_k.astype(k.dtype), d_v.astype(v.dtype), np.zeros(valid.shape, jax.dtypes.float0))


_tiled_partial.defvjp(_tiled_partial_fwd, _tiled_partial_bwd)


def over_sharded_prompt(base: AttentionFn, axis: str = "seq") -> AttentionFn:
  """`suffix_attention`-compatible attention for a segment whose ancestors[0] is a prompt sharded over `axis`.

  The returned function takes q [B, T, Hq, D], ancestors (ancestors[0]: this device's prompt
  chunk, k, v [B or 1, C, Hkv, D], valid [B or 1, C]; the rest unsharded) and own [B, T, ...];
  returns (out [B, T, Hq, D] in q's dtype, lse [B, T, Hq] accumulation dtype), equal on every
  device of `axis`. The prompt chunk uses the tiled jnp attention (`_partial_attention`); the rest uses `base`.

  Raises:
    ValueError: if there are no ancestors.
  """
  def attention(q_bthd, ancestors: Sequence[KVBlock], own: KVBlock, *, scale: float | None = None):
    if not ancestors:
      raise ValueError("over_sharded_prompt: ancestors is empty; ancestors[0] must be the sharded prompt")
    scale = q_bthd.shape[-1] ** -0.5 if scale is None else scale
    out_p, lse_p = _partial_attention(q_bthd, ancestors[0], scale)
    out_r, lse_r = base(q_bthd, list(ancestors[1:]), own, scale=scale)
    acc = out_p.dtype
    lse_r = lse_r.astype(acc)
    m = jnp.maximum(jax.lax.pmax(jax.lax.stop_gradient(lse_p), axis), jax.lax.stop_gradient(lse_r))
    m = jnp.where(jnp.isfinite(m), m, 0.0)                 # rows with no visible key anywhere
    w_p, w_r = jnp.exp(lse_p - m), jnp.exp(lse_r - m)
    num = jax.lax.psum(w_p[..., None] * out_p, axis) + w_r[..., None] * out_r.astype(acc)
    den = jax.lax.psum(w_p, axis) + w_r
    out = num / jnp.where(den > 0, den, 1.0)[..., None]
    return out.astype(q_bthd.dtype), jnp.where(den > 0, m + jnp.log(jnp.where(den > 0, den, 1.0)), -jnp.inf)
  return attention
