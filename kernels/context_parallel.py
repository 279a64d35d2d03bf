"""Attention over a prompt whose tokens are split over a mesh axis (context parallelism, inside `shard_map`).

A prompt of P_pad tokens is split over the S devices of a mesh axis (default "seq"): shard i holds
positions [i*C, (i+1)*C), C = P_pad / S. Two attention functions, both with `suffix_attention`'s
signature `(q, ancestors, own) -> (out, lse)`, wrap a base implementation (the dense reference or
the Pallas kernels):

`prompt_chunk_attention` -- the prompt's own forward. Each layer all-gathers the chunks' K/V over
the axis and a chunk's queries attend to every valid key of the earlier chunks plus their own chunk
(bottom-right causal):

    keys (all-gathered):   [ chunk 0 | chunk 1 | chunk 2 | chunk 3 ]
    queries of chunk 2        x x x     x x x     causal    . . .      ('.': a later chunk, masked)

  Chosen over ring attention (`ppermute` of K/V blocks) for simplicity: one collective per layer
  and the base kernel unchanged. Cost per device and layer: the gathered K/V, 2 x P_pad x Hkv x D
  values (the prompt's whole K/V, as without sharding; the residual kept for the backward pass
  unless the layer is rematerialised), scores [C, P_pad] per head (1/S of the unsharded [P, P]),
  and about 2x the causal attention FLOPs (later chunks are computed and masked). The transpose
  of `all_gather` is a reduce-scatter, so dK/dV return to the chunk that owns them.

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

from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from branch_replay_jax.kernels.reference import KVBlock, accum_dtype

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


def _partial_attention(q_bthd, block: KVBlock, scale: float):
  """Softmax attention over one block, no causal mask: (out [B, T, Hq, D] accum dtype, lse [B, T, Hq])."""
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


def over_sharded_prompt(base: AttentionFn, axis: str = "seq") -> AttentionFn:
  """`suffix_attention`-compatible attention for a segment whose ancestors[0] is a prompt sharded over `axis`.

  The returned function takes q [B, T, Hq, D], ancestors (ancestors[0]: this device's prompt
  chunk, k, v [B or 1, C, Hkv, D], valid [B or 1, C]; the rest unsharded) and own [B, T, ...];
  returns (out [B, T, Hq, D] in q's dtype, lse [B, T, Hq] accumulation dtype), equal on every
  device of `axis`. The prompt chunk uses dense attention; the rest uses `base`.

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
