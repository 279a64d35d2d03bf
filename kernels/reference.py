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


# Scores are laid out [Hkv, B, T, G, S] (query head h = kv head * G + g): every dot of the forward and
# of its gradient then contracts exactly one axis (D for the scores, S for the mix, the flattened
# (B,) T, G queries for the K and V gradients), with the batch axes leading. With the scores as
# [B, Hkv, G, T, S] the K gradient contracted (T, G), which XLA:CPU canonicalised by a transposed
# copy of the score-sized cotangent (docs/design.md, "Step profile (CPU)"); now only q-, K- and
# V-sized arrays are transposed.


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
  g = hq // hkv
  q = jnp.transpose((q_bthd * scale).reshape(b, t, hkv, g, d), (2, 0, 1, 3, 4))   # [Hkv, B, T, G, D]

  causal_ts = jnp.tril(jnp.ones((t, t), dtype=bool))
  blocks = list(ancestors) + [own]
  masks = [blk.valid[None, :, None, None, :] for blk in ancestors]
  masks.append(causal_ts[None, None, :, None, :] & own.valid[None, :, None, None, :])
  scores = jnp.concatenate([_scores(q, blk.k) for blk in blocks], axis=-1)   # [Hkv, B, T, G, S]
  mask = jnp.concatenate([jnp.broadcast_to(m, (1, b, t, 1, blk.k.shape[1])) for m, blk in zip(masks, blocks)],
                         axis=-1)
  # A finite fill (not -inf) keeps the backward pass NaN-free for rows with no visible key.
  scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
  lse = jax.nn.logsumexp(scores, axis=-1)                  # [Hkv, B, T, G]
  probs = jnp.where(mask, jnp.exp(scores - lse[..., None]), 0.0)
  lse = jnp.where(mask.any(axis=-1), lse, -jnp.inf)

  out = jnp.zeros((hkv, b, t, g, d), accum_dtype(q_bthd.dtype))
  start = 0
  for blk in blocks:
    s = blk.k.shape[1]
    out = out + _mix(probs[..., start:start + s].astype(blk.v.dtype), blk.v)
    start += s
  lse_bth = jnp.transpose(lse, (1, 2, 0, 3)).reshape(b, t, hq)
  out_bthd = jnp.transpose(out, (1, 2, 0, 3, 4)).reshape(b, t, hq, d)
  return out_bthd.astype(q_bthd.dtype), lse_bth
