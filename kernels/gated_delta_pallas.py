"""The Gated DeltaNet chunk scan as Pallas kernels: the sequential part of `models.gated_delta.chunked`.

`chunked` computes, for each chunk c of C tokens and in parallel over the chunks, U_c, W_c, the masked
decayed scores A_c = (q kᵀ ⊙ Γ) (lower, with diagonal), Q_c = q ⊙ exp γ, K_c = k ⊙ exp(γ_C - γ) and the
chunk's decay d_c = exp(γ_C) (Yang et al. 2024, arXiv 2406.06484, section 3.2; the notation of that
docstring). What is left is a scan of the state S [Dk, Dv] over the chunks:

    V'_c = U_c - W_c S,    O_c = Q_c S + A_c V'_c,    S <- d_c S + K_cᵀ V'_c

With `jax.lax.scan` each of the n chunks is a loop iteration of several small matmuls, each its own kernel on a
GPU. Here one program per (row, value head) runs the whole scan with S in registers:

    forward   grid (B, H): for c = 0 .. n-1, saves S_c (the state at chunk c's start) for the backward,
              writes O_c, and returns the final state.
    backward  grid (B, H): for c = n-1 .. 0, from dS (the cotangent of the state after chunk c), S_c and
              V'_c = U_c - W_c S_c recomputed:
                dV'_c = A_cᵀ dO_c + K_c dS          dU_c = dV'_c        dW_c = -dV'_c S_cᵀ
                dA_c = dO_c V'_cᵀ                   dQ_c = dO_c S_cᵀ    dK_c = V'_c dSᵀ
                dd_c = Σ S_c ⊙ dS                   dS <- Q_cᵀ dO_c + d_c dS - W_cᵀ dV'_c
              and returns the initial state's cotangent dS.
The rest of `chunked` (the triangular solves, the decays) stays in jnp and is differentiated by JAX, so
`chunked(..., scan="pallas")` and `chunked(..., scan="xla")` compute the same function: the tests hold them
equal in float64 (tests/test_gated_delta_pallas.py). Memory is the scan's: the n saved states
[B, H, n, Dk, Dv], as `jax.lax.scan`'s autodiff saves its carries.

Accumulation in float32 (float64 for float64 inputs, in the interpreter); float32 dots at HIGHEST precision
(never TF32). Targets: NVIDIA GPUs through the Triton lowering (C, Dk and Dv powers of two >= 16, as Qwen3.5's
64, 128, 128), the CPU through the Pallas interpreter (tests). Inside the mesh step's `shard_map(check_vma=True)`
the operands are cast to one manual-axis type and the outputs state it (kernels/vma.py), as the attention
kernels do; interpreted there, each device runs all devices' rows and keeps its own (`_call`). No accelerator
was lent to the session that wrote this, so the Triton lowering is untested and unmeasured here
(docs/design.md, "Linear attention (Qwen3.5)").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from branch_replay_jax.kernels.vma import out_struct, to_common_varying

_HIGHEST = jax.lax.Precision.HIGHEST


def _dot(a, b, contract=((1,), (0,))):
  return jax.lax.dot_general(a, b, (contract, ((), ())), precision=_HIGHEST, preferred_element_type=a.dtype)


def _forward_kernel(u_ref, w_ref, a_ref, q_ref, k_ref, d_ref, s0_ref, o_ref, states_ref, final_ref):
  b, h = pl.program_id(0), pl.program_id(1)

  def body(c, s):
    states_ref[b, h, c] = s
    v_new = u_ref[b, h, c] - _dot(w_ref[b, h, c], s)
    o_ref[b, h, c] = _dot(q_ref[b, h, c], s) + _dot(a_ref[b, h, c], v_new)
    return s * d_ref[b, h, c] + _dot(k_ref[b, h, c], v_new, ((0,), (0,)))
  final_ref[b, h] = jax.lax.fori_loop(0, u_ref.shape[2], body, s0_ref[b, h])


def _backward_kernel(u_ref, w_ref, a_ref, q_ref, k_ref, d_ref, states_ref, do_ref, dfinal_ref,
                     du_ref, dw_ref, da_ref, dq_ref, dk_ref, dd_ref, ds0_ref):
  b, h = pl.program_id(0), pl.program_id(1)
  n = u_ref.shape[2]

  def body(i, ds):
    c = n - 1 - i
    s, w, q, k, do = states_ref[b, h, c], w_ref[b, h, c], q_ref[b, h, c], k_ref[b, h, c], do_ref[b, h, c]
    v_new = u_ref[b, h, c] - _dot(w, s)
    dv_new = _dot(a_ref[b, h, c], do, ((0,), (0,))) + _dot(k, ds, ((1,), (0,)))
    du_ref[b, h, c] = dv_new
    dw_ref[b, h, c] = -_dot(dv_new, s, ((1,), (1,)))
    da_ref[b, h, c] = _dot(do, v_new, ((1,), (1,)))
    dq_ref[b, h, c] = _dot(do, s, ((1,), (1,)))
    dk_ref[b, h, c] = _dot(v_new, ds, ((1,), (1,)))
    dd_ref[b, h, c] = jnp.sum(s * ds)
    return _dot(q, do, ((0,), (0,))) + d_ref[b, h, c] * ds - _dot(w, dv_new, ((0,), (0,)))
  ds0_ref[b, h] = jax.lax.fori_loop(0, n, body, dfinal_ref[b, h])


def _call(kernel, outs, interpret: bool, varying: frozenset, *args):
  """`kernel` over the grid (B, H) of args[0] [B, H, ...]: outputs `outs` (shapes and dtypes), typed to vary over
  the manual mesh axes `varying` (kernels/vma.py).

  Interpreted inside `shard_map` (tests on the CPU), the interpreter cannot run on operands that vary over mesh
  axes (kernels/pallas_attention.py, `_interpret_per_device`): every device then gathers all devices' operands
  (invariant), runs their rows as one batch of B x devices rows, and keeps its own; programs are independent
  per (row, head), so the values are those of one call per device."""
  def call(args, varying):
    b, h = args[0].shape[:2]
    return pl.pallas_call(kernel, grid=(b, h), in_specs=[pl.no_block_spec] * len(args),
                          out_specs=[pl.no_block_spec] * len(outs), interpret=interpret,
                          out_shape=[out_struct((b, *o.shape[1:]), o.dtype, varying) for o in outs])(*args)
  if not (interpret and varying):
    return call(args, varying)
  axes = tuple(sorted(varying))
  gathered = [jax.lax.all_gather(x, axes, to="invarying") for x in args]            # [devices, B, ...]
  devices = gathered[0].shape[0]
  outs_all = call([x.reshape(devices * x.shape[1], *x.shape[2:]) for x in gathered], frozenset())
  me = jax.lax.axis_index(axes)
  return [o.reshape(devices, -1, *o.shape[1:])[me] for o in outs_all]


def _forward(u, w, a, q, k, d, s0, interpret, varying):
  bsz, h, n, _, dv = u.shape
  dk = w.shape[-1]
  struct = lambda *shape: jax.ShapeDtypeStruct(shape, u.dtype)
  return _call(_forward_kernel, [struct(*u.shape), struct(bsz, h, n, dk, dv), struct(bsz, h, dk, dv)],
               interpret, varying, u, w, a, q, k, d, s0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _scan(u, w, a, q, k, d, s0, interpret, varying):
  out, _, final = _forward(u, w, a, q, k, d, s0, interpret, varying)
  return out, final


def _scan_fwd(u, w, a, q, k, d, s0, interpret, varying):
  out, states, final = _forward(u, w, a, q, k, d, s0, interpret, varying)
  return (out, final), (u, w, a, q, k, d, states)


def _scan_bwd(interpret, varying, saved, cotangents):
  u, w, a, q, k, d, states = saved
  do, dfinal = (x.astype(u.dtype) for x in cotangents)
  outs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (u, w, a, q, k, d, dfinal)]
  return tuple(_call(_backward_kernel, outs, interpret, varying, u, w, a, q, k, d, states, do, dfinal))


_scan.defvjp(_scan_fwd, _scan_bwd)


def chunk_scan_pallas(u, w, a, q, k, d, state, *, interpret: bool | None = None):
  """The state scan of the module docstring, differentiable in every input.

  Args (all one float dtype, float32 or float64):
    u: [B, H, n, C, Dv] U_c = A⁻¹ (β v) per chunk.
    w: [B, H, n, C, Dk] W_c = A⁻¹ (β k ⊙ exp γ).
    a: [B, H, n, C, C] the decayed scores (q kᵀ ⊙ Γ), zero above the diagonal.
    q: [B, H, n, C, Dk] q ⊙ exp γ.
    k: [B, H, n, C, Dk] k ⊙ exp(γ_C - γ).
    d: [B, H, n] exp(γ_C), the chunk's decay.
    state: [B, H, Dk, Dv] the state before the first chunk.
    interpret: run the kernels in the Pallas interpreter; None: on the CPU backend.

  Returns:
    (out [B, H, n, C, Dv], the state after the last chunk [B, H, Dk, Dv]).

  Raises:
    ValueError: shapes that disagree, or mixed dtypes.
  """
  bsz, h, n, c, dv = u.shape
  dk = w.shape[-1]
  want = {"w": (bsz, h, n, c, dk), "a": (bsz, h, n, c, c), "q": (bsz, h, n, c, dk), "k": (bsz, h, n, c, dk),
          "d": (bsz, h, n), "state": (bsz, h, dk, dv)}
  got = {"w": w, "a": a, "q": q, "k": k, "d": d, "state": state}
  for name, x in got.items():
    if x.shape != want[name] or x.dtype != u.dtype:
      raise ValueError(f"chunk_scan_pallas: {name} is {x.dtype}{list(x.shape)}, expected {u.dtype}"
                       f"{list(want[name])} for u {list(u.shape)} and w's Dk={dk}")
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  args, varying = to_common_varying(u, w, a, q, k, d, state)
  return _scan(*args, bool(interpret), varying)
