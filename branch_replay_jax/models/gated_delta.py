"""The Gated DeltaNet recurrence (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks", arXiv 2412.06464,
eq. 10) and its short causal convolution, as Qwen3.5's linear-attention layers run them (transformers'
`modeling_qwen3_5`: `torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`, `causal_conv1d_fn`).

Per value head, with state S [Dk, Dv], decay g_t <= 0 (log space) and write strength β_t in (0, 1):

    S_t = exp(g_t) S_{t-1} + k_t (β_t (v_t - (exp(g_t) S_{t-1})ᵀ k_t))ᵀ,      o_t = S_tᵀ q_t

`recurrent` runs it token by token (decoding, and the reference the tests hold `chunked` to); `chunked`
runs C tokens at a time (the WY/UT form of DeltaNet, Yang et al. 2024, arXiv 2406.06484, section 3.2):
inside a chunk one unit lower-triangular solve and a few matmuls, across chunks a scan of the state.
Both take an initial state and return the final one, which is all a branch needs from its prefix: the
state after the prefix's last token (docs/design.md, "Linear attention (Qwen3.5)").

A padded position (valid False) is a no-op on the state: its decay is 0 and its write strength 0, so a
right-padded row's final state is the state after its last real token, and a left-padded row starts from
the zero state. The computation is in float32 (float64 for float64 inputs), as transformers does it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from branch_replay_jax.kernels.gated_delta_pallas import chunk_scan_pallas
from branch_replay_jax.kernels.reference import accum_dtype
from branch_replay_jax.kernels.vma import to_common_varying
from branch_replay_jax.models.config import GATED_DELTA_SCANS


def l2_normalize(x, eps: float = 1e-6):
  """x / sqrt(Σ x² + eps) over the last axis (transformers' `l2norm`, FLA's form)."""
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def causal_conv(x_btc, state_bkc, w_kc, valid_bt):
  """Depthwise causal convolution of K taps with SiLU, continuing from the K-1 inputs before it.

  out[t, c] = silu(Σ_j w[j, c] · x[t - (K-1) + j, c]), x before the segment read from `state_bkc`.
  Padded inputs are zeroed first (transformers' `apply_mask_to_padding_states`).

  Args:
    x_btc: [B, T, C] inputs (the q, k, v projections' channels).
    state_bkc: [B or 1, K-1, C] the K-1 inputs before the segment (zeros at a sequence's start).
    w_kc: [K, C] taps (transformers' conv1d.weight [C, 1, K], transposed).
    valid_bt: [B, T] bool.

  Returns:
    (out [B, T, C] in x's dtype, the K-1 inputs before the position after each row's last real token
    [B, K-1, C]: the state a continuation starts from).
  """
  b, t, c = x_btc.shape
  k = w_kc.shape[0]
  x = jnp.where(valid_bt[..., None], x_btc, 0).astype(x_btc.dtype)
  full = jnp.concatenate([jnp.broadcast_to(state_bkc.astype(x.dtype), (b, k - 1, c)), x], axis=1)   # [B, K-1+T, C]
  acc = accum_dtype(x.dtype)
  out = sum(full[:, j:j + t].astype(acc) * w_kc[j].astype(acc) for j in range(k))
  end = jnp.max(jnp.where(valid_bt, jnp.arange(1, t + 1), 0), axis=1)        # after each row's last real token
  idx = end[:, None] + jnp.arange(k - 1)[None]                                # rows of `full` ending there
  final = jnp.take_along_axis(full, idx[..., None], axis=1)
  return jax.nn.silu(out).astype(x_btc.dtype), final


def _heads_first(x):
  return jnp.moveaxis(x, 2, 1)   # [B, T, H, ...] -> [B, H, T, ...]


def recurrent(q, k, v, g, beta, state):
  """The recurrence token by token (transformers' `torch_recurrent_gated_delta_rule`).

  Args:
    q, k: [B, T, H, Dk] (l2-normalised; q scaled by Dk^-0.5), v: [B, T, H, Dv], g, beta: [B, T, H], all in
      the accumulation dtype; state: [B, H, Dk, Dv].

  Returns:
    (out [B, T, H, Dv], final state [B, H, Dk, Dv]).

  Inside `shard_map` every input is first cast to vary over the mesh axes any of them varies over
  (`kernels.vma.to_common_varying`), so a zero initial state can be the scan's carry.
  """
  (q, k, v, g, beta, state), _ = to_common_varying(q, k, v, g, beta, state)

  def step(s, xs):
    q_t, k_t, v_t, g_t, b_t = xs                                   # [B, H, ...]
    s = s * jnp.exp(g_t)[..., None, None]
    delta = (v_t - jnp.einsum("bhkv,bhk->bhv", s, k_t)) * b_t[..., None]
    s = s + k_t[..., :, None] * delta[..., None, :]
    return s, jnp.einsum("bhkv,bhk->bhv", s, q_t)

  xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))    # [T, B, H, ...]
  state, out = jax.lax.scan(step, state, xs)
  return jnp.moveaxis(out, 0, 1), state


def chunk_scan(u, w, a, q, k, d, state):
  """The scan of the state over the chunks by `jax.lax.scan` (`chunked`'s scan="xla"): per chunk c,
  V' = U_c - W_c S, O_c = Q_c S + A_c V', S <- d_c S + K_cᵀ V'. Args and returns as
  `kernels.gated_delta_pallas.chunk_scan_pallas`: u [B, H, n, C, Dv], w, q, k [B, H, n, C, Dk], a [B, H, n, C, C],
  d [B, H, n], state [B, H, Dk, Dv] -> (out [B, H, n, C, Dv], final state [B, H, Dk, Dv])."""
  def step(s, xs):
    u_c, w_c, a_c, q_c, k_c, d_c = xs
    v_new = u_c - jnp.einsum("bhik,bhkv->bhiv", w_c, s)
    out = jnp.einsum("bhik,bhkv->bhiv", q_c, s) + jnp.einsum("bhij,bhjv->bhiv", a_c, v_new)
    return s * d_c[..., None, None] + jnp.einsum("bhik,bhiv->bhkv", k_c, v_new), out

  state, out = jax.lax.scan(step, state, tuple(jnp.moveaxis(x, 2, 0) for x in (u, w, a, q, k, d)))   # [n, B, H, ...]
  return jnp.moveaxis(out, 0, 2), state


def chunked(q, k, v, g, beta, state, chunk: int = 64, scan: str = "xla"):
  """The recurrence C = `chunk` tokens at a time (transformers' `torch_chunk_gated_delta_rule`).

  Inside chunk c, with γ_i = Σ_{j<=i} g_j (cumulative log decay), Γ_ij = exp(γ_i - γ_j) for j <= i:
  A = I + strictly_lower((β k) kᵀ ⊙ Γ); U = A⁻¹ (β v), W = A⁻¹ (β k ⊙ exp γ); then, from the state S
  at the chunk's start, v' = U - W S, out = (q ⊙ exp γ) S + ((q kᵀ) ⊙ Γ, lower with diagonal) v',
  S ← exp(γ_C) S + (k ⊙ exp(γ_C - γ))ᵀ v'. The sequence is zero-padded to a multiple of C (no-ops).

  Args and returns: as `recurrent`; chunk: tokens per chunk (transformers uses 64); scan: the scan of the state
  over the chunks, "xla" (`jax.lax.scan`) or "pallas" (`kernels.gated_delta_pallas`: one program per row and
  head; the same function, held equal in float64 by the tests).

  Raises:
    ValueError: scan not in GATED_DELTA_SCANS.
  """
  if scan not in GATED_DELTA_SCANS:
    raise ValueError(f"gated_delta.chunked: scan={scan!r} is not one of {GATED_DELTA_SCANS}")
  (q, k, v, g, beta, state), _ = to_common_varying(q, k, v, g, beta, state)
  b, t, h, dk = k.shape
  pad = (-t) % chunk
  padded = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  q, k, v, g, beta = (_heads_first(padded(x)) for x in (q, k, v, g, beta))   # [B, H, T', ...]
  n = (t + pad) // chunk
  split = lambda x: x.reshape(b, h, n, chunk, *x.shape[3:])
  q, k, v, g, beta = (split(x) for x in (q, k, v, g, beta))
  gamma = jnp.cumsum(g, axis=-1)                                               # [B, H, n, C]
  lower = jnp.tril(jnp.ones((chunk, chunk), bool))
  diff = gamma[..., :, None] - gamma[..., None, :]
  decay = jnp.where(lower, jnp.exp(jnp.where(lower, diff, 0)), 0)             # Γ, zero above the diagonal
  k_beta = k * beta[..., None]
  a = jnp.einsum("bhnik,bhnjk->bhnij", k_beta, k) * decay
  a = jnp.where(jnp.tril(jnp.ones((chunk, chunk), bool), -1), a, 0) + jnp.eye(chunk, dtype=a.dtype)
  solve = lambda rhs: jax.lax.linalg.triangular_solve(a, rhs, left_side=True, lower=True, unit_diagonal=True)
  u = solve(v * beta[..., None])                                               # [B, H, n, C, Dv]
  w = solve(k_beta * jnp.exp(gamma)[..., None])                                # [B, H, n, C, Dk]
  attn = jnp.einsum("bhnik,bhnjk->bhnij", q, k) * decay
  q_decayed = q * jnp.exp(gamma)[..., None]
  k_decayed = k * jnp.exp(gamma[..., -1:] - gamma)[..., None]
  chunk_decay = jnp.exp(gamma[..., -1])                                        # [B, H, n]

  scan_fn = chunk_scan_pallas if scan == "pallas" else chunk_scan
  out, state = scan_fn(u, w, attn, q_decayed, k_decayed, chunk_decay, state)
  out = out.reshape(b, h, n * chunk, -1)[:, :, :t]
  return jnp.moveaxis(out, 1, 2), state
