"""The Gated DeltaNet chunk scan as Pallas kernels: the sequential part of `models.gated_delta.chunked`.

`chunked` computes, for each chunk c of C tokens and in parallel over the chunks, U_c, W_c, the masked
decayed scores A_c = (q kᵀ ⊙ Γ) (lower, with diagonal), Q_c = q ⊙ exp γ, K_c = k ⊙ exp(γ_C - γ) and the
chunk's decay d_c = exp(γ_C) (Yang et al. 2024, arXiv 2406.06484, section 3.2; the notation of that
docstring). What is left is a scan of the state S [Dk, Dv] over the chunks:

    V'_c = U_c - W_c S,    O_c = Q_c S + A_c V'_c,    S <- d_c S + K_cᵀ V'_c

With `jax.lax.scan` each of the n chunks is a loop iteration of several small matmuls, each its own kernel on a
GPU. Here one program runs the whole scan with its part of S in registers. The columns of S evolve on their own
(every product above acts on S's rows), so a program owns a block of `block_v` columns: the grid is
(B, H, Dv / block_v), more programs than rows x heads and a smaller state per program (FLA's kernels split Dv
the same way).

    forward   for c = 0 .. n-1, saves S_c (the state at chunk c's start) for the backward, writes O_c, and
              returns the final state (each its block of columns).
    backward  for c = n-1 .. 0, from dS (the cotangent of the state after chunk c), S_c and
              V'_c = U_c - W_c S_c recomputed (each its block of columns):
                dV'_c = A_cᵀ dO_c + K_c dS          dU_c = dV'_c        dW_c = -dV'_c S_cᵀ
                dA_c = dO_c V'_cᵀ                   dQ_c = dO_c S_cᵀ    dK_c = V'_c dSᵀ
                dd_c = Σ S_c ⊙ dS                   dS <- Q_cᵀ dO_c + d_c dS - W_cᵀ dV'_c
              and returns the initial state's cotangent dS. dW, dA, dQ, dK and dd sum over all of Dv: each
              block writes its part and the parts are summed after the call.
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

from branch_replay_jax.kernels.vma import interpret_per_device, out_struct, to_common_varying

_HIGHEST = jax.lax.Precision.HIGHEST
BLOCK_V = 64   # the state's columns per program at most (Dv = 128: two programs per row and head)


def _dot(a, b, contract=((1,), (0,))):
  return jax.lax.dot_general(a, b, (contract, ((), ())), precision=_HIGHEST, preferred_element_type=a.dtype)


def _forward_kernel(u_ref, w_ref, a_ref, q_ref, k_ref, d_ref, s0_ref, o_ref, states_ref, final_ref):
  b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  cols = pl.ds(j * s0_ref.shape[-1] // pl.num_programs(2), s0_ref.shape[-1] // pl.num_programs(2))

  def body(c, s):
    states_ref[b, h, c, :, cols] = s
    v_new = u_ref[b, h, c, :, cols] - _dot(w_ref[b, h, c], s)
    o_ref[b, h, c, :, cols] = _dot(q_ref[b, h, c], s) + _dot(a_ref[b, h, c], v_new)
    return s * d_ref[b, h, c] + _dot(k_ref[b, h, c], v_new, ((0,), (0,)))
  final_ref[b, h, :, cols] = jax.lax.fori_loop(0, u_ref.shape[2], body, s0_ref[b, h, :, cols])


def _backward_kernel(u_ref, w_ref, a_ref, q_ref, k_ref, d_ref, states_ref, do_ref, dfinal_ref,
                     du_ref, dw_ref, da_ref, dq_ref, dk_ref, dd_ref, ds0_ref):
  b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  cols = pl.ds(j * ds0_ref.shape[-1] // pl.num_programs(2), ds0_ref.shape[-1] // pl.num_programs(2))
  n = u_ref.shape[2]

  def body(i, ds):
    c = n - 1 - i
    s, w, q, k = states_ref[b, h, c, :, cols], w_ref[b, h, c], q_ref[b, h, c], k_ref[b, h, c]
    do = do_ref[b, h, c, :, cols]
    v_new = u_ref[b, h, c, :, cols] - _dot(w, s)
    dv_new = _dot(a_ref[b, h, c], do, ((0,), (0,))) + _dot(k, ds, ((1,), (0,)))
    du_ref[b, h, c, :, cols] = dv_new
    # The terms below sum over Dv: each column block writes its part, summed after the call.
    dw_ref[b, h, j, c] = -_dot(dv_new, s, ((1,), (1,)))
    da_ref[b, h, j, c] = _dot(do, v_new, ((1,), (1,)))
    dq_ref[b, h, j, c] = _dot(do, s, ((1,), (1,)))
    dk_ref[b, h, j, c] = _dot(v_new, ds, ((1,), (1,)))
    dd_ref[b, h, j, c] = jnp.sum(s * ds)
    return _dot(q, do, ((0,), (0,))) + d_ref[b, h, c] * ds - _dot(w, dv_new, ((0,), (0,)))
  ds0_ref[b, h, :, cols] = jax.lax.fori_loop(0, n, body, dfinal_ref[b, h, :, cols])


def _call(kernel, outs, blocks: int, interpret: bool, varying: frozenset, *args):
  """`kernel` over the grid (B, H, blocks) of args[0] [B, H, ...]: outputs `outs` (shapes and dtypes), typed to
  vary over the manual mesh axes `varying` (kernels/vma.py).

  Interpreted inside `shard_map` (tests on the CPU), the interpreter cannot run on operands that vary over mesh
  axes: every device runs all devices' calls and keeps its own (`vma.interpret_per_device`)."""
  def call(args, varying):
    b, h = args[0].shape[:2]
    return pl.pallas_call(kernel, grid=(b, h, blocks), in_specs=[pl.no_block_spec] * len(args),
                          out_specs=[pl.no_block_spec] * len(outs), interpret=interpret,
                          out_shape=[out_struct((b, *o.shape[1:]), o.dtype, varying) for o in outs])(*args)
  if not (interpret and varying):
    return call(args, varying)
  return interpret_per_device(lambda *a: call(a, frozenset()), varying, *args)


def _forward(u, w, a, q, k, d, s0, blocks, interpret, varying):
  bsz, h, n, _, dv = u.shape
  dk = w.shape[-1]
  struct = lambda *shape: jax.ShapeDtypeStruct(shape, u.dtype)
  return _call(_forward_kernel, [struct(*u.shape), struct(bsz, h, n, dk, dv), struct(bsz, h, dk, dv)],
               blocks, interpret, varying, u, w, a, q, k, d, s0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _scan(u, w, a, q, k, d, s0, blocks, interpret, varying):
  out, _, final = _forward(u, w, a, q, k, d, s0, blocks, interpret, varying)
  return out, final


def _scan_fwd(u, w, a, q, k, d, s0, blocks, interpret, varying):
  out, states, final = _forward(u, w, a, q, k, d, s0, blocks, interpret, varying)
  return (out, final), (u, w, a, q, k, d, states)


def _scan_bwd(blocks, interpret, varying, saved, cotangents):
  u, w, a, q, k, d, states = saved
  do, dfinal = (x.astype(u.dtype) for x in cotangents)
  per_block = lambda x: jax.ShapeDtypeStruct((*x.shape[:2], blocks, *x.shape[2:]), x.dtype)
  outs = [jax.ShapeDtypeStruct(u.shape, u.dtype), *(per_block(x) for x in (w, a, q, k, d)),
          jax.ShapeDtypeStruct(dfinal.shape, dfinal.dtype)]
  du, *partial, ds0 = _call(_backward_kernel, outs, blocks, interpret, varying, u, w, a, q, k, d, states, do, dfinal)
  return (du, *(x.sum(axis=2) for x in partial), ds0)


_scan.defvjp(_scan_fwd, _scan_bwd)


def chunk_scan_pallas(u, w, a, q, k, d, state, *, block_v: int | None = None, interpret: bool | None = None):
  """The state scan of the module docstring, differentiable in every input.

  Args (all one float dtype, float32 or float64):
    u: [B, H, n, C, Dv] U_c = A⁻¹ (β v) per chunk.
    w: [B, H, n, C, Dk] W_c = A⁻¹ (β k ⊙ exp γ).
    a: [B, H, n, C, C] the decayed scores (q kᵀ ⊙ Γ), zero above the diagonal.
    q: [B, H, n, C, Dk] q ⊙ exp γ.
    k: [B, H, n, C, Dk] k ⊙ exp(γ_C - γ).
    d: [B, H, n] exp(γ_C), the chunk's decay.
    state: [B, H, Dk, Dv] the state before the first chunk.
    block_v: the state's columns per program (a divisor of Dv; the columns of S evolve independently); None:
      the largest power of two <= BLOCK_V dividing Dv (Dv itself where that is 1).
    interpret: run the kernels in the Pallas interpreter; None: on the CPU backend.

  Returns:
    (out [B, H, n, C, Dv], the state after the last chunk [B, H, Dk, Dv]).

  Raises:
    ValueError: shapes that disagree, mixed dtypes, or a block_v that does not divide Dv.
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
  if block_v is None:
    block_v = next(p for p in (BLOCK_V >> i for i in range(BLOCK_V.bit_length())) if dv % p == 0)
    block_v = dv if block_v == 1 else block_v   # odd Dv (interpreter shapes only): one block
  if isinstance(block_v, bool) or not isinstance(block_v, int) or block_v < 1 or dv % block_v:
    raise ValueError(f"chunk_scan_pallas: block_v={block_v!r} must be a positive divisor of Dv={dv}")
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  args, varying = to_common_varying(u, w, a, q, k, d, state)
  return _scan(*args, dv // block_v, bool(interpret), varying)
