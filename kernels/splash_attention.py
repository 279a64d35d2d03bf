"""Suffix attention on TPUs: JAX's splash attention kernels behind `suffix_attention`'s signature.

Splash attention (jax.experimental.pallas.ops.tpu.splash_attention, the Mosaic TPU FlashAttention
that MaxText uses) takes one key sequence per head and a static block-sparse mask. The segment's
keys are laid out as one sequence, [ancestor blocks ; own ; padding], and the suffix mask is the
static `CausalMask` with offset S_anc (query i sees key j iff j <= S_anc + i) AND segment ids
(query id 1, key id 1 where valid, 0 where padded):

    keys      [ anc 0 . . anc S_anc-1 | own 0 1 2 | pad to 128 ]   query rows padded to 128
    query 0     x x x . x x x x         x . .       . . .
    query 1     x x x . x x x x         x x .       . . .          ('.' in an ancestor: a padded
    query 2     x x x . x x x x         x x x       . . .           key, segment id 0)

Key blocks above the diagonal are skipped by the mask's block sparsity, so the own part costs
T^2/2, not T * (S_anc + T). Heads: the MHA kernel maps query head h to KV head h // (Hq/Hkv),
which is the GQA grouping of the reference; dK/dV come out summed over each group. The batch is a
`jax.vmap` of the kernels. A block of batch 1 (a shared prompt) is broadcast to B: the
concatenation copies every ancestor block once per call (unlike the Triton kernel, which reads
blocks in place).

Differences from the public `make_splash_mha` path, each for a reason:
- Our own `custom_vjp` around splash's forward and its dQ / dK,dV kernels (private functions of the
  installed JAX, 0.10.x), because the public kernel's log-sum-exp is not differentiable
  (save_residuals=True raises under AD). The lse cotangent enters as D_i - dlse_i, the same fold
  as in `pallas_attention._flash_bwd`.
- Rows that see no valid key: splash's softmax has no such rows (its docstring forbids them; its
  output there is an average of masked values). They are detected from the masks here and given
  out = 0, lse = -inf; the `jnp.where` also zeroes their cotangents, so they add nothing to dK/dV.

Precision: splash rounds O to q's dtype before D = rowsum(dO * O) and dS to q's dtype before
dQ = dS K and dK = dS^T Q, both of which FlashAttention-2 also does; `pallas_attention` avoids both
for bfloat16. tests/test_kernels.py measures the effect against the 2x rule.

Not inside the mesh step's `shard_map(check_vma=True)`: splash's pallas_calls (JAX's) state no
varying mesh axes for their outputs, which check_vma refuses; the loop refuses splash on a mesh.

Targets: TPUs (Mosaic). On the CPU, `interpret=True` runs the same kernels in the Pallas
interpreter (the tests). Not for GPUs: use `suffix_attention_pallas` there.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

from branch_replay_jax.kernels.reference import KVBlock

LANES = 128
"""Query rows and keys are padded to multiples of this: splash's masked kernels need tiles of 128
(its dK/dV kernel tiles the queries along lanes when segment ids are given)."""

SPLASH_HEAD_DIMS = (64, 128, 256)
"""Head dims taken: splash's tiles hold the whole head dim, and Mosaic lays a row out in 128
lanes; 64 (SmolLM2) and 128 (Llama) are the common ones."""

SPLASH_DTYPES = (jnp.bfloat16, jnp.float32)
_TILES = (512, 256, 128)        # largest that divides the padded length (MaxText's default is 512)


@dataclasses.dataclass(frozen=True)
class _SplashPlan:
  """Static description of one call (hashable: it keys the cached mask and the custom_vjp)."""

  hq: int
  t_pad: int                    # query rows, multiple of LANES
  l_pad: int                    # keys, multiple of LANES
  offset: int                   # S_anc: own key j sits at S_anc + j
  block_q: int
  block_kv: int
  interpret: bool


def _tile(length: int, requested: int | None, name: str) -> int:
  if requested is not None:
    if requested % LANES or length % requested:
      raise ValueError(f"suffix_attention_splash: {name}={requested} must be a multiple of {LANES} "
                       f"dividing the padded length {length}")
    return requested
  return next(b for b in _TILES if length % b == 0)


@functools.lru_cache(maxsize=64)
def _kernel(plan: _SplashPlan) -> splash.SplashAttentionKernel:
  """Splash kernel for the plan: block-sparse mask info for fwd, dQ and dK/dV, and the mask function."""
  sizes = splash.BlockSizes(block_q=plan.block_q, block_kv=plan.block_kv, block_kv_compute=plan.block_kv,
                            block_q_dkv=plan.block_q, block_kv_dkv=plan.block_kv,
                            block_kv_dkv_compute=plan.block_kv, block_q_dq=plan.block_q,
                            block_kv_dq=plan.block_kv)
  mask = mask_lib.MultiHeadMask([mask_lib.CausalMask((plan.t_pad, plan.l_pad), offset=plan.offset)] * plan.hq)
  with jax.ensure_compile_time_eval():
    return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                  interpret=plan.interpret)


def _collapse(info):
  # What `splash._splash_attention` does before its custom_vjp: partial blocks as [n, bq, bkv].
  if info is None or info.partial_mask_blocks is None:
    return info
  return info._replace(partial_mask_blocks=info.partial_mask_blocks.reshape(-1, *info.partial_mask_blocks.shape[-2:]))


def _common(kern):
  kw = kern.kwargs
  return dict(mask_value=kw["mask_value"], attn_logits_soft_cap=None, mask_function=kw["mask_function"],
              interpret=kw["interpret"])


def _forward(plan: _SplashPlan, q, k, v, kv_ids):
  """q [B, Hq, Tp, D], k/v [B, Hkv, Lp, D], kv_ids [B, Lp] -> out [B, Hq, Tp, D], lse [B, Hq, Tp] f32."""
  kern = _kernel(plan)
  q_ids = jnp.ones((plan.t_pad,), jnp.int32)

  def one(q, k, v, kv_ids):
    out, (lse,) = splash._splash_attention_forward(
        _collapse(kern.fwd_mask_info), q, k, v, splash.SegmentIds(q_ids, kv_ids), None, is_mqa=False,
        block_sizes=kern.kwargs["block_sizes"], residual_checkpoint_name=None, save_residuals=True, **_common(kern))
    return out, lse.astype(jnp.float32)

  return jax.vmap(one)(q, k, v, kv_ids)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _splash(plan: _SplashPlan, q, k, v, kv_ids):
  return _forward(plan, q, k, v, kv_ids)


def _splash_fwd(plan, q, k, v, kv_ids):
  out, lse = _forward(plan, q, k, v, kv_ids)
  return (out, lse), (q, k, v, kv_ids, out, lse)


def _splash_bwd(plan, res, cts):
  q, k, v, kv_ids, out, lse = res
  do, dlse = cts
  kern = _kernel(plan)
  sizes = kern.kwargs["block_sizes"]
  q_ids = jnp.ones((plan.t_pad,), jnp.int32)
  # D_i = rowsum(dO * O) (FlashAttention-2, Alg. 2 line 4); an lse cotangent adds dlse_i * P_ij to
  # dS_ij, which is the same as subtracting it from D_i.
  di = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1) - dlse
  do = do.astype(q.dtype)

  def one(q, k, v, kv_ids, lse, do, di):
    seg = splash.SegmentIds(q_ids, kv_ids)
    _, dk, dv = splash._splash_attention_bwd_dkv(
        q, k, v, seg, None, lse, do, di, bq=plan.block_q, bkv=plan.block_kv, bkv_compute=plan.block_kv,
        is_mqa=False, mask_info=_collapse(kern.dkv_mask_info), use_fused_bwd_kernel=False,
        q_layout=sizes.q_layout, k_layout=sizes.k_layout, v_layout=sizes.v_layout, **_common(kern))
    dq = splash._splash_attention_bwd_dq(
        q, k, v, seg, None, lse, do, di, bq=plan.block_q, bkv=plan.block_kv, is_mqa=False,
        mask_info=_collapse(kern.dq_mask_info), q_layout=sizes.q_layout, k_layout=sizes.k_layout,
        v_layout=sizes.v_layout, **_common(kern))
    return dq, dk, dv

  dq, dk, dv = jax.vmap(one)(q, k, v, kv_ids, lse, do, di)
  return dq, dk, dv, None


_splash.defvjp(_splash_fwd, _splash_bwd)


def _check(q, blocks: Sequence[KVBlock], t: int):
  b, _, hq, d = q.shape
  hkv = blocks[-1].k.shape[2]
  if jnp.dtype(q.dtype) not in [jnp.dtype(x) for x in SPLASH_DTYPES]:
    raise ValueError(f"suffix_attention_splash: dtype {q.dtype} not supported; use one of "
                     f"{[jnp.dtype(x).name for x in SPLASH_DTYPES]} (or the reference)")
  if d not in SPLASH_HEAD_DIMS:
    raise ValueError(f"suffix_attention_splash: head dim {d} not supported; supported: {SPLASH_HEAD_DIMS}. "
                     f"Use attention_impl='xla' for this model.")
  if hq % hkv:
    raise ValueError(f"suffix_attention_splash: Hq={hq} is not a multiple of Hkv={hkv}")
  if blocks[-1].k.shape[1] != t:
    raise ValueError(f"suffix_attention_splash: own keys have length {blocks[-1].k.shape[1]}, queries {t}")
  for blk in blocks:
    kb, s = blk.k.shape[:2]
    if blk.k.shape[2:] != (hkv, d) or blk.v.shape != blk.k.shape:
      raise ValueError(f"suffix_attention_splash: K {blk.k.shape} / V {blk.v.shape} do not match "
                       f"[B or 1, S, Hkv={hkv}, D={d}]")
    if blk.k.dtype != q.dtype or blk.v.dtype != q.dtype:
      raise ValueError(f"suffix_attention_splash: q is {q.dtype} but K/V are {blk.k.dtype}/{blk.v.dtype}")
    if kb not in (1, b) or blk.valid.shape[0] not in (1, b) or blk.valid.shape[1:] != (s,):
      raise ValueError(f"suffix_attention_splash: K batch {kb}, valid {blk.valid.shape} vs query batch {b}")


def _pad(x, axis: int, size: int):
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths)


def suffix_attention_splash(q_bthd: jax.Array, ancestors: Sequence[KVBlock], own: KVBlock, *,
                            scale: float | None = None, block_q: int | None = None, block_kv: int | None = None,
                            interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
  """Splash-attention suffix attention with the semantics of `reference.suffix_attention`.

  Args:
    q_bthd: [B, T, Hq, D] queries, bfloat16 or float32; D in `SPLASH_HEAD_DIMS`.
    ancestors: blocks with k, v [B or 1, S_i, Hkv, D] (q's dtype) and valid [B or 1, S_i] bool.
    own: the segment's block, k, v [B, T, Hkv, D], valid [B, T]; bottom-right causal.
    scale: logit scale, default 1/sqrt(D); applied to q in q's dtype, as the reference does.
    block_q, block_kv: query rows / keys per tile, multiples of 128 dividing the padded lengths
      (T and S_anc + T rounded up to 128); default the largest of 512, 256, 128 that divides.
    interpret: run the Pallas interpreter; default True when JAX's default backend is the CPU.

  Returns:
    out_bthd: [B, T, Hq, D] in q's dtype; zeros for a query that sees no valid key.
    lse_bth: [B, T, Hq] float32 log-sum-exp of the scaled scores; -inf where no key is visible.
    Gradients flow to q and every block's k and v (also through lse); none to the masks.

  Raises:
    ValueError: for a dtype outside `SPLASH_DTYPES`, a head dim outside `SPLASH_HEAD_DIMS`,
      Hq % Hkv != 0, own keys whose length is not T, mismatched K/V shapes or dtypes, or a bad tile.
  """
  b, t, hq, d = q_bthd.shape
  blocks = [blk for blk in ancestors if blk.k.shape[1] > 0] + [own]
  _check(q_bthd, blocks, t)
  s_anc = sum(blk.k.shape[1] for blk in blocks[:-1])
  t_pad, l_pad = -(-t // LANES) * LANES, -(-(s_anc + t) // LANES) * LANES
  plan = _SplashPlan(hq=hq, t_pad=t_pad, l_pad=l_pad, offset=s_anc, block_q=_tile(t_pad, block_q, "block_q"),
                     block_kv=_tile(l_pad, block_kv, "block_kv"),
                     interpret=jax.default_backend() == "cpu" if interpret is None else bool(interpret))

  scale = d ** -0.5 if scale is None else scale
  q = _pad((q_bthd * scale).astype(q_bthd.dtype).transpose(0, 2, 1, 3), 2, t_pad)      # [B, Hq, Tp, D]
  wide = lambda x: jnp.broadcast_to(x, (b, *x.shape[1:]))
  k = _pad(jnp.concatenate([wide(blk.k) for blk in blocks], axis=1).transpose(0, 2, 1, 3), 2, l_pad)
  v = _pad(jnp.concatenate([wide(blk.v) for blk in blocks], axis=1).transpose(0, 2, 1, 3), 2, l_pad)
  valid = [wide(blk.valid) for blk in blocks]
  kv_ids = _pad(jnp.concatenate(valid, axis=1).astype(jnp.int32), 1, l_pad)          # [B, Lp]

  out, lse = _splash(plan, q, k, v, kv_ids)
  out, lse = out[:, :, :t].transpose(0, 2, 1, 3), lse[:, :, :t].transpose(0, 2, 1)
  # Query i sees a valid key iff some ancestor key is valid or some own key j <= i is.
  seen = jnp.zeros((b, t), bool)
  for m in valid[:-1]:
    seen = seen | m.any(axis=1, keepdims=True)
  seen = (seen | (jnp.cumsum(valid[-1].astype(jnp.int32), axis=1) > 0))[:, :, None]
  return jnp.where(seen[..., None], out, 0).astype(q_bthd.dtype), jnp.where(seen, lse, -jnp.inf)
