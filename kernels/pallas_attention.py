"""Pallas suffix attention: FlashAttention-2 forward and backward with the reference's semantics.

Same contract as `reference.suffix_attention`: a segment's queries attend to every valid key of
its ancestor blocks and, bottom-right causally, to its own keys. The forward is Algorithm 1 and
the backward Algorithm 2 of FlashAttention-2 (Dao 2023, arXiv 2307.08691): online softmax with
float32 statistics and accumulators, the log-sum-exp saved for the backward, which recomputes
the probabilities block by block and never holds a [T, S] matrix in memory.

GQA packing. The G = Hq / Hkv query heads that share a KV head are packed into the rows of one
matrix, row r = t * G + g (query position t = r // G), so a KV tile is loaded once for the whole
group and dK/dV come out already summed over the group's heads:

    q [B, T, Hkv*G, D]  ->  rows [B, Hkv, T*G (padded to a multiple of block_q), D]

    rows      ancestor block(s), every valid key    own keys, key j visible iff j <= r // G
    r=0 t=0   x x x . x x x x                       x . .
    r=1 t=0   x x x . x x x x                       x . .        (G = 2; '.' in an ancestor:
    r=2 t=1   x x x . x x x x                       x x .         a padded key; padded own
    r=3 t=1   x x x . x x x x                       x x .         keys are masked the same way)

Each KV block (every ancestor and the own block) keeps its own length, batch and mask: nothing
is concatenated. A block whose batch is 1 is shared by the B queries (a prompt shared by B
samples) and is read in place; its dK/dV are summed over B inside the kernel. Sequence lengths
are padded (keys with valid = False, rows with zeros) to multiples of the tile sizes, because
the Triton lowering needs power-of-two tiles; the padding is sliced off again.

Grids: forward and dQ run one program per (batch, KV head, row tile) and loop over key tiles;
dK/dV run one program per (key batch, KV head, key tile) of each block and loop over row tiles.

Precision, where this departs from FA2 (both found by tests/test_kernels.py, whose rule is an
error at most 2x the dense reference's in the same dtype): D = rowsum(dO * O) uses the float32 O
(kept as the residual; the returned O is rounded to q's dtype), and dS enters dQ = dS K and
dK = dS^T Q as two 16-bit operands hi + lo rather than one rounded dS (two extra dots per tile
pair in the backward). float32 inputs use exact float32 dots, never TF32.

Inside `shard_map(check_vma=True)` (the mesh step): the operands are cast to one manual-axis type
before the custom_vjp and every kernel output states it (kernels/vma.py); the interpreter runs each
device's call from gathered operands (`vma.interpret_per_device`). docs/design.md, "Attention kernels
inside the mesh step".

Targets: NVIDIA GPUs through the Triton lowering; the CPU through the Pallas interpreter (tests).
On TPUs, attention_impl="pallas" resolves to splash attention (`splash_attention.py`) instead:
these kernels were written for Triton (its compiler params, a whole K/V block per program, 1-D
row statistics) and are not ported to Mosaic.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from branch_replay_jax.kernels.reference import KVBlock
from branch_replay_jax.kernels.vma import interpret_per_device, out_struct, to_common_varying

HEAD_DIMS = (16, 32, 64, 128, 256)
"""Head dims the kernel takes: Triton tiles are powers of two and its dots need K >= 16."""

DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
DEFAULT_BLOCK = 64      # rows and keys per tile for head rows of <= 256 bytes (D=128 bf16); 32 above
MIN_BLOCK = 16          # Triton's dot needs M, N, K >= 16.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)   # finite: exp(mask - m) stays 0, never NaN


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Everything static about one call (hashable: a `custom_vjp` non-differentiable argument)."""

  scale: float
  group: int                   # G = Hq // Hkv query heads per KV head
  rows: int                    # T * G real packed rows
  block_q: int
  block_k: tuple[int, ...]     # per KV block
  causal: tuple[bool, ...]     # per KV block: True for the own block
  shared: tuple[bool, ...]     # per KV block: batch 1 read by all B queries
  num_warps: int
  num_stages: int
  interpret: bool
  varying: frozenset = frozenset()   # manual mesh axes of every input and output (kernels/vma.py)


def _tile(requested: int | None, default: int, length: int, name: str) -> int:
  """Power-of-two tile in [16, requested]: no larger than the length needs."""
  want = default if requested is None else requested
  if want < MIN_BLOCK or want & (want - 1):
    raise ValueError(f"suffix_attention_pallas: {name}={want} must be a power of two >= {MIN_BLOCK}")
  return max(MIN_BLOCK, min(want, pl.next_power_of_2(max(length, 1))))


def _pad_axis(x, axis: int, size: int):
  extra = size - x.shape[axis]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths)


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


# ------------------------------------------------------------------------------------------------
# Kernel bodies. Shapes in comments are per program: bq row tile, bk key tile, D head dim.

def _dot(a, b, contract):
  # HIGHEST: the Triton lowering turns DEFAULT precision into TF32 for float32 operands; float32
  # inputs get exact float32 dots. 16-bit operands are unaffected (tensor cores, float32 accumulation).
  return lax.dot_general(a, b, (contract, ((), ())), precision=lax.Precision.HIGHEST,
                         preferred_element_type=jnp.float32)


def _dot_nt(a, b):
  """a [m, d] . b [n, d]^T -> [m, n] float32."""
  return _dot(a, b, ((1,), (1,)))


def _dot_nn(a, b):
  """a [m, k] . b [k, n] -> [m, n] float32."""
  return _dot(a, b, ((1,), (0,)))


def _dot_tn(a, b):
  """a [k, m]^T . b [k, n] -> [m, n] float32."""
  return _dot(a, b, ((0,), (0,)))


def _dot_split(a32, b, dot):
  """dot(a, b) for a float32 `a` and a 16-bit `b`, as two 16-bit dots on a = hi + lo.

  FlashAttention-2 rounds dS to the input dtype before dQ = dS K and dK = dS^T Q. In bfloat16
  that rounding alone made dQ/dK up to ~2.5x less accurate than the dense reference (whose dS
  stays float32); hi + lo keeps ~16 bits of dS for one extra tensor-core dot.
  """
  if b.dtype == jnp.float32:
    return dot(a32, b)
  hi = a32.astype(b.dtype)
  return dot(hi, b) + dot((a32 - hi.astype(jnp.float32)).astype(b.dtype), b)


def _tile_mask(plan: _Plan, r0, c0, bk: int, key_valid, causal: bool):
  """[bq, bk] bool: which (row, key) pairs of this tile take part in the softmax."""
  rows = r0 + lax.iota(jnp.int32, plan.block_q)
  mask = (rows < plan.rows)[:, None] & key_valid[None, :]
  if causal:
    t_row = lax.div(rows, jnp.int32(plan.group))
    mask = mask & ((c0 + lax.iota(jnp.int32, bk))[None, :] <= t_row[:, None])
  return mask


def _key_tiles(plan: _Plan, r0, n_tiles: int, bk: int, causal: bool):
  """Key tiles a row tile starting at r0 must visit (own keys past its last query are skipped)."""
  if not causal:
    return n_tiles
  last_t = lax.div(r0 + plan.block_q - 1, jnp.int32(plan.group))
  return jnp.minimum(lax.div(last_t, jnp.int32(bk)) + 1, n_tiles)


def _forward_kernel(q_ref, *refs, plan: _Plan):
  n_blocks = len(plan.block_k)
  o_ref, lse_ref = refs[3 * n_blocks:]
  bq = plan.block_q
  r0 = pl.program_id(2) * bq
  q = q_ref[...]                                                   # [bq, D]

  def body(j, carry, k_ref, v_ref, valid_ref, bk, causal):
    m, l, acc = carry
    c0 = j * bk
    k = k_ref[pl.ds(c0, bk), :]                                    # [bk, D]
    v = v_ref[pl.ds(c0, bk), :]
    mask = _tile_mask(plan, r0, c0, bk, valid_ref[pl.ds(c0, bk)] != 0, causal)
    s = jnp.where(mask, _dot_nt(q, k) * plan.scale, _MASK_VALUE)  # [bq, bk] float32
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
    alpha = jnp.exp(m - m_new)
    return m_new, alpha * l + jnp.sum(p, axis=1), alpha[:, None] * acc + _dot_nn(p.astype(v.dtype), v)

  carry = (jnp.full((bq,), _MASK_VALUE, jnp.float32), jnp.zeros((bq,), jnp.float32),
           jnp.zeros((bq, q.shape[-1]), jnp.float32))
  for i in range(n_blocks):
    k_ref, v_ref, valid_ref = refs[3 * i:3 * i + 3]
    bk, causal = plan.block_k[i], plan.causal[i]
    n_tiles = _key_tiles(plan, r0, k_ref.shape[0] // bk, bk, causal)
    carry = lax.fori_loop(0, n_tiles, functools.partial(body, k_ref=k_ref, v_ref=v_ref, valid_ref=valid_ref,
                                                         bk=bk, causal=causal), carry)
  m, l, acc = carry
  seen = l > 0.0                   # l >= 1 once a row has seen any key: the max term is exp(0)
  l_safe = jnp.where(seen, l, 1.0)
  o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(seen, m + jnp.log(l_safe), -jnp.inf)


def _probs(plan, q, k, lse, mask):
  """Recomputed softmax tile P = exp(S - lse) (0 where masked, also on rows with lse = -inf)."""
  return jnp.where(mask, jnp.exp(_dot_nt(q, k) * plan.scale - lse[:, None]), 0.0)


def _dq_kernel(q_ref, do_ref, lse_ref, delta_ref, *refs, plan: _Plan):
  n_blocks = len(plan.block_k)
  dq_ref = refs[3 * n_blocks]
  r0 = pl.program_id(2) * plan.block_q
  q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]

  def body(j, dq, k_ref, v_ref, valid_ref, bk, causal):
    c0 = j * bk
    k = k_ref[pl.ds(c0, bk), :]
    v = v_ref[pl.ds(c0, bk), :]
    p = _probs(plan, q, k, lse, _tile_mask(plan, r0, c0, bk, valid_ref[pl.ds(c0, bk)] != 0, causal))
    ds = p * (_dot_nt(do, v) - delta[:, None])                    # dL/dS, FA2 Alg. 2 line 11
    return dq + _dot_split(ds, k, _dot_nn)

  dq = jnp.zeros(q.shape, jnp.float32)
  for i in range(n_blocks):
    k_ref, v_ref, valid_ref = refs[3 * i:3 * i + 3]
    bk, causal = plan.block_k[i], plan.causal[i]
    n_tiles = _key_tiles(plan, r0, k_ref.shape[0] // bk, bk, causal)
    dq = lax.fori_loop(0, n_tiles, functools.partial(body, k_ref=k_ref, v_ref=v_ref, valid_ref=valid_ref,
                                                     bk=bk, causal=causal), dq)
  dq_ref[...] = (dq * plan.scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, valid_ref, dk_ref, dv_ref, *, plan: _Plan,
                bk: int, causal: bool):
  bq = plan.block_q
  c0 = pl.program_id(2) * bk
  k, v = k_ref[...], v_ref[...]                                    # [bk, D]
  key_valid = valid_ref[...] != 0
  n_row_tiles = q_ref.shape[1] // bq
  # Rows before the first query that can see key c0 (t = c0, row c0 * G) contribute nothing.
  first = lax.div(c0 * plan.group, jnp.int32(bq)) if causal else 0

  def row_tile(rt, carry, b):
    dk, dv = carry
    r0 = rt * bq
    q = q_ref[b, pl.ds(r0, bq), :]
    do = do_ref[b, pl.ds(r0, bq), :]
    p = _probs(plan, q, k, lse_ref[b, pl.ds(r0, bq)], _tile_mask(plan, r0, c0, bk, key_valid, causal))
    dv = dv + _dot_tn(p.astype(do.dtype), do)
    ds = p * (_dot_nt(do, v) - delta_ref[b, pl.ds(r0, bq)][:, None])
    return dk + _dot_split(ds, q, _dot_tn), dv

  def batch(b, carry):             # one pass unless the block is shared by the B queries
    return lax.fori_loop(first, n_row_tiles, functools.partial(row_tile, b=b), carry)

  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = lax.fori_loop(0, q_ref.shape[0], batch, (zeros, zeros))
  dk_ref[...] = (dk * plan.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


# ------------------------------------------------------------------------------------------------
# pallas_calls on packed arrays: q, o, do [B, Hkv, R, D]; lse, delta [B, Hkv, R]; per KV block
# k, v [Bk, S, Hkv, D] and valid [Bk, S] int32, with R and S multiples of their tiles.

def _kv_specs(plan: _Plan, ks, valids):
  specs = []
  for k, shared in zip(ks, plan.shared):
    s, d = k.shape[1], k.shape[3]
    kv_map = (lambda b, h, r: (0, 0, h, 0)) if shared else (lambda b, h, r: (b, 0, h, 0))
    valid_map = (lambda b, h, r: (0, 0)) if shared else (lambda b, h, r: (b, 0))
    specs += [pl.BlockSpec((None, s, None, d), kv_map), pl.BlockSpec((None, s, None, d), kv_map),
              pl.BlockSpec((None, s), valid_map)]
  return specs


def _interleave(ks, vs, valids):
  return [x for kvm in zip(ks, vs, valids) for x in kvm]


def _call(plan: _Plan, kernel, **kwargs):
  if plan.interpret and plan.varying:
    return _interpret_per_device(plan, kernel, **kwargs)
  return pl.pallas_call(kernel, interpret=plan.interpret,
                        compiler_params=plgpu.CompilerParams(num_warps=plan.num_warps, num_stages=plan.num_stages),
                        **kwargs)


def _interpret_per_device(plan: _Plan, kernel, *, out_shape, **kwargs):
  """The interpreted kernel inside shard_map(check_vma=True) on the CPU (tests), as one device's call
  (`vma.interpret_per_device`)."""
  invariant = jax.tree_util.tree_map(lambda s: out_struct(s.shape, s.dtype, frozenset()), out_shape)
  inner = pl.pallas_call(kernel, interpret=True, out_shape=invariant, **kwargs)
  return lambda *args: interpret_per_device(inner, plan.varying, *args)


def _forward(plan: _Plan, q, ks, vs, valids):
  b, hkv, r, d = q.shape
  bq = plan.block_q
  row_spec = pl.BlockSpec((None, None, bq, d), lambda b, h, r: (b, h, r, 0))
  stat_spec = pl.BlockSpec((None, None, bq), lambda b, h, r: (b, h, r))
  return _call(plan, functools.partial(_forward_kernel, plan=plan), name="suffix_attention_fwd",
               grid=(b, hkv, r // bq), in_specs=[row_spec, *_kv_specs(plan, ks, valids)],
               out_specs=[row_spec, stat_spec],
               out_shape=[out_struct(q.shape, jnp.float32, plan.varying),
                          out_struct((b, hkv, r), jnp.float32, plan.varying)],
               )(q, *_interleave(ks, vs, valids))


def _dq(plan: _Plan, q, do, lse, delta, ks, vs, valids):
  b, hkv, r, d = q.shape
  bq = plan.block_q
  row_spec = pl.BlockSpec((None, None, bq, d), lambda b, h, r: (b, h, r, 0))
  stat_spec = pl.BlockSpec((None, None, bq), lambda b, h, r: (b, h, r))
  return _call(plan, functools.partial(_dq_kernel, plan=plan), name="suffix_attention_dq",
               grid=(b, hkv, r // bq), in_specs=[row_spec, row_spec, stat_spec, stat_spec,
                                                  *_kv_specs(plan, ks, valids)],
               out_specs=row_spec, out_shape=out_struct(q.shape, q.dtype, plan.varying),
               )(q, do, lse, delta, *_interleave(ks, vs, valids))


def _dkv(plan: _Plan, i: int, q, do, lse, delta, k, v, valid):
  """dK, dV [Bk, S, Hkv, D] of KV block i; a shared block (Bk = 1) sums over the B queries."""
  b, hkv, r, d = q.shape
  bk, shared = plan.block_k[i], plan.shared[i]
  nb = b if shared else 1          # query batches each program visits
  row_spec = pl.BlockSpec((nb, None, r, d), lambda b, h, j: (b, h, 0, 0))
  stat_spec = pl.BlockSpec((nb, None, r), lambda b, h, j: (b, h, 0))
  key_spec = pl.BlockSpec((None, bk, None, d), lambda b, h, j: (b, j, h, 0))
  valid_spec = pl.BlockSpec((None, bk), lambda b, h, j: (b, j))
  kernel = functools.partial(_dkv_kernel, plan=plan, bk=bk, causal=plan.causal[i])
  return _call(plan, kernel, name="suffix_attention_dkv",
               grid=(k.shape[0], hkv, k.shape[1] // bk),
               in_specs=[row_spec, row_spec, stat_spec, stat_spec, key_spec, key_spec, valid_spec],
               out_specs=[key_spec, key_spec],
               out_shape=[out_struct(k.shape, k.dtype, plan.varying), out_struct(v.shape, v.dtype, plan.varying)],
               )(q, do, lse, delta, k, v, valid)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(plan: _Plan, q, ks, vs, valids):
  return tuple(_forward(plan, q, ks, vs, valids))


def _flash_fwd(plan, q, ks, vs, valids):
  o, lse = _forward(plan, q, ks, vs, valids)
  return (o, lse), (q, ks, vs, valids, o, lse)


def _flash_bwd(plan, res, cts):
  q, ks, vs, valids, o, lse = res
  do, dlse = cts
  # D_i = rowsum(dO * O) (FA2 Alg. 2 line 4), from the float32 O: with O rounded to bfloat16
  # (as FA2 does) dK/dQ were up to ~2.5x less accurate than the reference. A cotangent on lse adds
  # dlse_i * P_ij to dS_ij, the same as subtracting it from D_i. Rows without keys have P = 0.
  delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)
  delta = delta - jnp.where(jnp.isfinite(lse), dlse, 0.0)
  do = do.astype(q.dtype)
  dq = _dq(plan, q, do, lse, delta, ks, vs, valids)
  dkv = [_dkv(plan, i, q, do, lse, delta, k, v, m) for i, (k, v, m) in enumerate(zip(ks, vs, valids))]
  return dq, tuple(dk for dk, _ in dkv), tuple(dv for _, dv in dkv), tuple(None for _ in valids)


_flash.defvjp(_flash_fwd, _flash_bwd)


# ------------------------------------------------------------------------------------------------

def _check(q, blocks: Sequence[KVBlock], t: int):
  b, _, hq, d = q.shape
  hkv = blocks[-1].k.shape[2]
  if jnp.dtype(q.dtype) not in [jnp.dtype(x) for x in DTYPES]:
    raise ValueError(f"suffix_attention_pallas: dtype {q.dtype} not supported; use one of "
                     f"{[jnp.dtype(x).name for x in DTYPES]} (or the reference)")
  if d not in HEAD_DIMS:
    raise ValueError(f"suffix_attention_pallas: head dim {d} not supported (Triton tiles are powers of two "
                     f"and dots need >= 16); supported: {HEAD_DIMS}. Use attention_impl='xla' for this model.")
  if hq % hkv:
    raise ValueError(f"suffix_attention_pallas: Hq={hq} is not a multiple of Hkv={hkv}")
  if blocks[-1].k.shape[1] != t:
    raise ValueError(f"suffix_attention_pallas: own keys have length {blocks[-1].k.shape[1]}, queries {t}")
  for blk in blocks:
    kb, s = blk.k.shape[:2]
    if blk.k.shape[2:] != (hkv, d) or blk.v.shape != blk.k.shape:
      raise ValueError(f"suffix_attention_pallas: K {blk.k.shape} / V {blk.v.shape} do not match "
                       f"[B or 1, S, Hkv={hkv}, D={d}]")
    if blk.k.dtype != q.dtype or blk.v.dtype != q.dtype:
      raise ValueError(f"suffix_attention_pallas: q is {q.dtype} but K/V are {blk.k.dtype}/{blk.v.dtype}")
    if kb not in (1, b) or blk.valid.shape[0] not in (1, b) or blk.valid.shape[1:] != (s,):
      raise ValueError(f"suffix_attention_pallas: K batch {kb}, valid {blk.valid.shape} vs query batch {b}")


def suffix_attention_pallas(q_bthd: jax.Array, ancestors: Sequence[KVBlock], own: KVBlock, *,
                            scale: float | None = None, block_q: int | None = None, block_k: int | None = None,
                            interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
  """Pallas suffix attention with the semantics of `reference.suffix_attention`; differentiable.

  Args:
    q_bthd: [B, T, Hq, D] queries, bfloat16, float16 or float32.
    ancestors: any number of blocks with k, v [B or 1, S_i, Hkv, D] (q's dtype) and valid
      [B or 1, S_i] bool; S_i may be 0. A block of batch 1 is shared by the B queries without
      copies; a block whose K has batch 1 but whose mask has batch B is tiled to B first.
    own: the segment's block, k, v [B, T, Hkv, D], valid [B, T]; bottom-right causal.
    scale: logit scale, default 1/sqrt(D).
    block_q: packed query rows (T * Hq/Hkv) per tile, a power of two >= 16. Default 64, or 32
      when a head row exceeds 256 bytes (D=256, or D=128 in float32) to fit shared memory;
      lowered to what the rows need (16 for T = 1 with G <= 16).
    block_k: keys per tile, a power of two >= 16; same default, lowered for short blocks.
    interpret: run the Pallas interpreter; default True when JAX's default backend is the CPU.

  Returns:
    out_bthd: [B, T, Hq, D] in q's dtype; zeros for a query that sees no key.
    lse_bth: [B, T, Hq] float32 log-sum-exp of the scaled scores; -inf where no key is visible.
    Gradients flow to q and every block's k and v (dK/dV summed over each KV group's heads and,
    for a shared block, over the batch); none to the masks.

  Raises:
    ValueError: for a dtype outside `DTYPES`, a head dim outside `HEAD_DIMS`, Hq % Hkv != 0,
      own keys whose length is not T, mismatched K/V shapes or dtypes, or a bad tile size.
  """
  b, t, hq, d = q_bthd.shape
  blocks = [blk for blk in ancestors if blk.k.shape[1] > 0] + [own]
  _check(q_bthd, blocks, t)
  hkv = own.k.shape[2]
  g = hq // hkv
  rows = t * g
  default = DEFAULT_BLOCK if d * jnp.dtype(q_bthd.dtype).itemsize <= 256 else DEFAULT_BLOCK // 2
  bq = _tile(block_q, default, rows, "block_q")
  q = q_bthd.reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, rows, d)
  q = _pad_axis(q, 2, _round_up(rows, bq))

  ks, vs, valids, tiles, shared = [], [], [], [], []
  for blk in blocks:
    k, v, valid = blk.k, blk.v, blk.valid
    if k.shape[0] == 1 and valid.shape[0] == b and b > 1:      # per-sample mask on shared keys
      k, v = (jnp.broadcast_to(x, (b, *x.shape[1:])) for x in (k, v))
    valid = jnp.broadcast_to(valid, (k.shape[0], k.shape[1])).astype(jnp.int32)
    bk = _tile(block_k, default, k.shape[1], "block_k")
    s_pad = _round_up(k.shape[1], bk)
    ks.append(_pad_axis(k, 1, s_pad))
    vs.append(_pad_axis(v, 1, s_pad))
    valids.append(_pad_axis(valid, 1, s_pad))
    tiles.append(bk)
    shared.append(k.shape[0] == 1 and b > 1)

  plan = _Plan(scale=float(d ** -0.5 if scale is None else scale), group=g, rows=rows, block_q=bq,
               block_k=tuple(tiles), causal=(False,) * (len(blocks) - 1) + (True,), shared=tuple(shared),
               num_warps=4 if d <= 64 or bq <= 32 else 8, num_stages=2,
               interpret=jax.default_backend() == "cpu" if interpret is None else bool(interpret))
  # Inside shard_map(check_vma=True): one manual-axis type for every operand, stated on every
  # kernel output (kernels/vma.py); outside, an empty set and no cast.
  (q, ks, vs, valids), varying = to_common_varying(q, tuple(ks), tuple(vs), tuple(valids))
  plan = dataclasses.replace(plan, varying=varying)
  o, lse = _flash(plan, q, ks, vs, valids)
  out = o[:, :, :rows].astype(q_bthd.dtype).reshape(b, hkv, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, hq, d)
  lse = lse[:, :, :rows].reshape(b, hkv, t, g).transpose(0, 2, 1, 3).reshape(b, t, hq)
  return out, lse
