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
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp


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


def _scores(q_btkgd, k_bskd):
  acc = accum_dtype(q_btkgd.dtype)
  if k_bskd.shape[0] == 1 and q_btkgd.shape[0] != 1:
    return jnp.einsum("btkgd,skd->bkgts", q_btkgd, k_bskd[0], preferred_element_type=acc)
  return jnp.einsum("btkgd,bskd->bkgts", q_btkgd, k_bskd, preferred_element_type=acc)


def _mix(p_bkgts, v_bskd):
  acc = accum_dtype(v_bskd.dtype)
  if v_bskd.shape[0] == 1 and p_bkgts.shape[0] != 1:
    return jnp.einsum("bkgts,skd->btkgd", p_bkgts, v_bskd[0], preferred_element_type=acc)
  return jnp.einsum("bkgts,bskd->btkgd", p_bkgts, v_bskd, preferred_element_type=acc)


def suffix_attention(q_bthd: jax.Array, ancestors: Sequence[KVBlock], own: KVBlock,
                     *, scale: float | None = None) -> tuple[jax.Array, jax.Array]:
  """Softmax attention of a segment's queries over [ancestors ; own], own bottom-right causal.

  Args:
    q_bthd: [B, T, Hq, D] queries; Hq must be a multiple of every block's Hkv (GQA).
    ancestors: blocks with k, v [B or 1, S_i, Hkv, D] and valid [B or 1, S_i].
    own: the segment's block, k, v [B, T, Hkv, D], valid [B, T].
    scale: logit scale, default 1/sqrt(D).

  Returns:
    out_bthd: [B, T, Hq, D] in q's dtype. A query with no visible key gets zeros.
    lse_bth: [B, T, Hq] float32 (float64 for float64 q) log-sum-exp of the scaled scores (-inf where no key is visible).

  Raises:
    ValueError: if Hq is not a multiple of Hkv or head dims differ.
  """
  b, t, hq, d = q_bthd.shape
  hkv = own.k.shape[-2]
  if hq % hkv or own.k.shape[-1] != d:
    raise ValueError(f"suffix_attention: q has {hq} heads of dim {d}, own K has {hkv} heads of dim "
                     f"{own.k.shape[-1]}; need Hq % Hkv == 0 and equal head dims")
  scale = d ** -0.5 if scale is None else scale
  q = (q_bthd * scale).reshape(b, t, hkv, hq // hkv, d)

  causal_ts = jnp.tril(jnp.ones((t, t), dtype=bool))
  blocks = list(ancestors) + [own]
  masks = [blk.valid[:, None, None, None, :] for blk in ancestors]
  masks.append(causal_ts[None, None, None] & own.valid[:, None, None, None, :])
  scores = jnp.concatenate([_scores(q, blk.k) for blk in blocks], axis=-1)
  mask = jnp.concatenate([jnp.broadcast_to(m, (b, 1, 1, t, blk.k.shape[1])) for m, blk in zip(masks, blocks)],
                         axis=-1)
  # A finite fill (not -inf) keeps the backward pass NaN-free for rows with no visible key.
  scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
  lse = jax.nn.logsumexp(scores, axis=-1)                  # [B, Hkv, G, T]
  probs = jnp.where(mask, jnp.exp(scores - lse[..., None]), 0.0)
  lse = jnp.where(mask.any(axis=-1), lse, -jnp.inf)

  out = jnp.zeros((b, t, hkv, hq // hkv, d), accum_dtype(q_bthd.dtype))
  start = 0
  for blk in blocks:
    s = blk.k.shape[1]
    out = out + _mix(probs[..., start:start + s].astype(blk.v.dtype), blk.v)
    start += s
  lse_bth = jnp.transpose(lse, (0, 3, 1, 2)).reshape(b, t, hq)
  return out.reshape(b, t, hq, d).astype(q_bthd.dtype), lse_bth
