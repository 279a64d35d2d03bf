"""Times suffix attention forward and forward+backward on the default device; one JSON line per case.

Implementations, all on the same inputs (bf16, batch 1, Hq=32, Hkv=8, D=128 by default):
  pallas       `suffix_attention_pallas` (interpreted only if the default backend is the CPU)
  splash       `suffix_attention_splash`: JAX's TPU splash kernels behind our signature (with lse)
  splash_public  `make_splash_mha` as shipped, on the concatenated keys with CausalMask(offset=S_anc)
               and segment ids for padded keys, no lse: the wrapper's overhead is splash - splash_public
  reference    the dense jnp `suffix_attention` (XLA)
  dpa_xla      `jax.nn.dot_product_attention(implementation="xla")` over [ancestors ; own] keys with
               the explicit [B, 1, T, S+T] suffix mask
  dpa_cudnn    the same with implementation="cudnn" (an "error" entry where cuDNN refuses the mask)

Per implementation: compile_s (lower + compile, seconds, forward+backward program), fwd_ms and
fwd_bwd_ms (median of config.repeats timed calls after one warm-up call, milliseconds; the backward
takes gradients w.r.t. q and every K/V), plus each one's max |out - reference out|.

    python -m branch_replay_jax.benchmarks.attention --config=experiments/bench_attention.py \\
        [--config.cases=1024:128,8192:256,32768:512] [--config.repeats=5] [--config.impls=pallas,reference]
"""

from __future__ import annotations

import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from branch_replay_jax.benchmarks.replay import emitter, timing_lock
from branch_replay_jax.kernels import KVBlock, suffix_attention, suffix_attention_pallas, suffix_attention_splash


def suffix_mask(anc_valid_bs, own_valid_bt):
  """[B, 1, T, S+T] bool: every valid ancestor key, own keys bottom-right causal and valid."""
  t = own_valid_bt.shape[1]
  own = jnp.tril(jnp.ones((t, t), bool))[None] & own_valid_bt[:, None, :]
  anc = jnp.broadcast_to(anc_valid_bs[:, None, :], (own.shape[0], t, anc_valid_bs.shape[1]))
  return jnp.concatenate([anc, own], axis=-1)[:, None]


def make_impls():
  def kernel(fn):
    return lambda q, ka, va, ko, vo, ma, mo: fn(q, [KVBlock(ka, va, ma)], KVBlock(ko, vo, mo))[0]

  def dpa(implementation):
    def f(q, ka, va, ko, vo, ma, mo):
      k, v = jnp.concatenate([ka, ko], axis=1), jnp.concatenate([va, vo], axis=1)
      return jax.nn.dot_product_attention(q, k, v, mask=suffix_mask(ma, mo), implementation=implementation)
    return f

  def splash_public(q, ka, va, ko, vo, ma, mo):
    from jax.experimental.pallas.ops.tpu import splash_attention as sa
    (b, t, hq, d), s = q.shape, ka.shape[1]
    t_pad, l_pad = -(-t // 128) * 128, -(-(s + t) // 128) * 128
    tile = lambda n: next(x for x in (512, 256, 128) if n % x == 0)   # suffix_attention_splash's rule
    bq, bkv = tile(t_pad), tile(l_pad)
    sizes = sa.BlockSizes(block_q=bq, block_kv=bkv, block_q_dkv=bq, block_kv_dkv=bkv, block_q_dq=bq, block_kv_dq=bkv)
    mask = sa.MultiHeadMask([sa.CausalMask((t_pad, l_pad), offset=s)] * hq)
    kern = sa.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                              interpret=jax.default_backend() == "cpu")
    pad = lambda x, n: jnp.pad(x, [(0, 0), (0, 0), (0, n - x.shape[2]), (0, 0)])
    qh = pad((q * d ** -0.5).astype(q.dtype).transpose(0, 2, 1, 3), t_pad)
    kh = pad(jnp.concatenate([ka, ko], axis=1).transpose(0, 2, 1, 3), l_pad)
    vh = pad(jnp.concatenate([va, vo], axis=1).transpose(0, 2, 1, 3), l_pad)
    ids = jnp.pad(jnp.concatenate([ma, mo], axis=1).astype(jnp.int32), [(0, 0), (0, l_pad - s - t)])
    one = lambda q, k, v, i: kern(q, k, v, segment_ids=sa.SegmentIds(jnp.ones((t_pad,), jnp.int32), i))
    return jax.vmap(one)(qh, kh, vh, ids)[:, :, :t].transpose(0, 2, 1, 3)

  return {"pallas": kernel(suffix_attention_pallas), "splash": kernel(suffix_attention_splash),
          "splash_public": splash_public, "reference": kernel(suffix_attention),
          "dpa_xla": dpa("xla"), "dpa_cudnn": dpa("cudnn")}


def timed(compiled, args, repeats):
  # BENCH_TIMING_LOCK: a file that benchmark processes sharing one device lock around their timed
  # runs (branch_replay_jax.benchmarks.replay.timing_lock), so compiles overlap but timings never do.
  with timing_lock(os.environ.get("BENCH_TIMING_LOCK", "")):
    jax.block_until_ready(compiled(*args))           # warm-up
    times = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(compiled(*args))
      times.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(times), times


def bench_case(s_anc, t, *, b, hq, hkv, d, dtype, repeats, impls=None):
  rng = np.random.default_rng(0)
  x = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
  q, ka, va, ko, vo = x(b, t, hq, d), x(b, s_anc, hkv, d), x(b, s_anc, hkv, d), x(b, t, hkv, d), x(b, t, hkv, d)
  ma = jnp.asarray(rng.random((b, s_anc)) > 0.05)  # a few padded prefix keys
  mo = jnp.ones((b, t), bool)
  cot = x(b, t, hq, d)
  args = (q, ka, va, ko, vo, ma, mo)
  # Nominal FLOPs of the unmasked suffix attention: 4 T Hq D (S + (T+1)/2) forward, 2.5x that backward.
  fwd_flops = 4 * b * t * hq * d * (s_anc + (t + 1) / 2)
  row = {"s_anc": s_anc, "t": t, "b": b, "hq": hq, "hkv": hkv, "d": d, "dtype": jnp.dtype(dtype).name,
         "fwd_bwd_gflop": round(3.5 * fwd_flops / 1e9, 2), "device": str(jax.devices()[0])}
  ref_out = None
  chosen = {name: fn for name, fn in make_impls().items() if impls is None or name in impls}
  for name, fn in chosen.items():
    try:
      fwd = jax.jit(fn)
      loss = lambda q, ka, va, ko, vo, ma, mo: jnp.sum(fn(q, ka, va, ko, vo, ma, mo).astype(jnp.float32) * cot)
      t0 = time.perf_counter()
      fwd_bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(*args).compile()
      compile_s = time.perf_counter() - t0
      out = fwd(*args)
      fwd_ms, _ = timed(fwd, args, repeats)
      fwd_bwd_ms, all_ms = timed(fwd_bwd, args, repeats)
      ref_out = out if name == "reference" else ref_out
      entry = {"compile_s": round(compile_s, 2), "fwd_ms": round(fwd_ms, 3), "fwd_bwd_ms": round(fwd_bwd_ms, 3),
               "fwd_bwd_ms_all": [round(v, 3) for v in all_ms],
               "fwd_bwd_tflops": round(3.5 * fwd_flops / (fwd_bwd_ms * 1e-3) / 1e12, 1), "_out": out}
    except Exception as e:  # noqa: BLE001 - a refused implementation is a result, not a crash
      # First line only (some errors, e.g. a bare AssertionError, have no message at all).
      entry = {"error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"}
    row[name] = entry
  for name in chosen:
    out = row[name].pop("_out", None)
    if out is not None and ref_out is not None:
      row[name]["max_abs_diff_vs_reference"] = float(jnp.max(jnp.abs(out.astype(jnp.float32) -
                                                                   ref_out.astype(jnp.float32))))
  return row


def main(argv):
  del argv
  a = flags.FLAGS.config
  impls = set(a.impls.split(",")) if a.impls else None
  if impls is not None and (unknown := impls - set(make_impls())):
    raise ValueError(f"config.impls: unknown {sorted(unknown)}; choose from {list(make_impls())}")
  hq, hkv = map(int, a.heads.split(":"))
  emit = emitter(a.output)
  for case in a.cases.split(","):
    s_anc, t = map(int, case.split(":"))
    row = bench_case(s_anc, t, b=a.batch, hq=hq, hkv=hkv, d=a.head_dim, dtype=jnp.dtype(a.dtype),
                     repeats=a.repeats, impls=impls)
    emit(row)


if __name__ == "__main__":
  # Flags are defined only when run as a program, so that the benchmarks can be imported together.
  config_flags.DEFINE_config_file("config", "experiments/bench_attention.py", "Benchmark config.")
  app.run(main)
