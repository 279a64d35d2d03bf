"""A prompt's own causal attention: our suffix-attention kernel against cuDNN's flash attention.

    python -m branch_replay_jax.benchmarks.prompt_attention --config=experiments/bench_prompt_attention.py
    python -m branch_replay_jax.benchmarks.prompt_attention --config=experiments/bench_prompt_attention.py:smoke

The block replay computes once per group (the prompt, no ancestors, causal) is the largest
attention of a long-prompt step. Per prompt length P (config.prompt_lens), on the same bf16
inputs q [B, P, Hq, D], k, v [B, P, Hkv, D] (every key valid), one JSON line with, per
implementation:

  pallas     `suffix_attention_pallas(q, [], own)`: our Triton kernel (interpreted on the CPU)
  reference  the jnp `suffix_attention(q, [], own)` (XLA)
  dpa_xla    `jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")`
             (materialises [B, Hq, P, P] scores: 128 GiB in float32 at P = 32k, Hq = 32, so skip it there)
  dpa_cudnn  the same with implementation="cudnn" (GPU only: on another backend its entry is
             {"skipped": reason}; a shape cuDNN refuses gives {"error": ...})

compile_s (lower + compile of forward+backward, seconds), fwd_ms and fwd_bwd_ms (median of
config.repeats timed calls after one warm-up call; `attention.timed`, under BENCH_TIMING_LOCK),
fwd_tflops and fwd_bwd_tflops by the causal count: forward 4 B Hq D P(P+1)/2 FLOPs (QKᵀ and PV
over the visible pairs, `data.counts.forward_flops`'s pair term), forward+backward 3.5x that
(FlashAttention-2's count, Dao 2023, arXiv 2307.08691, section 4.1: the backward recomputes
QKᵀ, 2.5x the forward), and max_abs_diff vs the first implementation that ran (`baseline`).

`kernels.causal_block_attention` is the same choice inside a training step: a `suffix_attention`-compatible
function that sends blocks with no ancestors (the prompt; a naive sequence) to
`jax.nn.dot_product_attention` and everything else to the model's kernel (benchmarks/replay.py's
config.prompt_attention, passed as `value_and_grad(..., attention=...)`).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from branch_replay_jax.benchmarks.attention import timed
from branch_replay_jax.benchmarks.replay import emitter
from branch_replay_jax.kernels import KVBlock, suffix_attention, suffix_attention_pallas

IMPLS = ("pallas", "reference", "dpa_xla", "dpa_cudnn")


def make_impls():
  """name -> f(q, k, v) -> out [B, P, Hq, D], the prompt's causal self-attention."""
  own = lambda k, v: KVBlock(k, v, jnp.ones(k.shape[:2], bool))
  dpa = lambda impl: lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
  return {"pallas": lambda q, k, v: suffix_attention_pallas(q, [], own(k, v))[0],
          "reference": lambda q, k, v: suffix_attention(q, [], own(k, v))[0],
          "dpa_xla": dpa("xla"), "dpa_cudnn": dpa("cudnn")}


def causal_flops(b: int, p: int, hq: int, d: int) -> int:
  """Forward FLOPs of causal attention over one P-token block: 4 D per (query, key) pair and head."""
  return 4 * b * hq * d * p * (p + 1) // 2


def bench_prompt(p: int, *, b: int, hq: int, hkv: int, d: int, dtype, repeats: int, impls) -> dict:
  """One row: every implementation in `impls` on the same random inputs (see the module docstring)."""
  rng = np.random.default_rng(0)
  x = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
  q, k, v, cot = x(b, p, hq, d), x(b, p, hkv, d), x(b, p, hkv, d), x(b, p, hq, d)
  flops = causal_flops(b, p, hq, d)
  row = {"kind": "prompt_attention", "P": p, "b": b, "hq": hq, "hkv": hkv, "d": d, "dtype": jnp.dtype(dtype).name,
         "fwd_gflop": round(flops / 1e9, 3), "fwd_bwd_gflop": round(3.5 * flops / 1e9, 3),
         "device": str(jax.devices()[0]), "backend": jax.default_backend()}
  baseline, base_out = None, None
  fns = make_impls()
  for name in impls:
    if name == "dpa_cudnn" and jax.default_backend() != "gpu":
      row[name] = {"skipped": f"cuDNN needs a GPU; the backend is {jax.default_backend()}"}
      continue
    fn = fns[name]
    try:
      loss = lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32) * cot)
      t0 = time.perf_counter()
      fwd_bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
      compile_s = time.perf_counter() - t0
      fwd = jax.jit(fn)
      out = fwd(q, k, v)
      fwd_ms, _ = timed(fwd, (q, k, v), repeats)
      fwd_bwd_ms, all_ms = timed(fwd_bwd, (q, k, v), repeats)
      entry = {"compile_s": round(compile_s, 3), "fwd_ms": round(fwd_ms, 4), "fwd_bwd_ms": round(fwd_bwd_ms, 4),
               "fwd_bwd_ms_all": [round(t, 4) for t in all_ms],
               "fwd_tflops": flops / (fwd_ms * 1e-3) / 1e12, "fwd_bwd_tflops": 3.5 * flops / (fwd_bwd_ms * 1e-3) / 1e12}
      if base_out is None:
        baseline, base_out = name, out.astype(jnp.float32)
      entry["max_abs_diff"] = float(jnp.max(jnp.abs(out.astype(jnp.float32) - base_out)))
    except Exception as e:  # noqa: BLE001 - a refused implementation is a result, not a crash
      entry = {"error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"}
    row[name] = entry
  row["baseline"] = baseline
  if "fwd_bwd_ms" in row.get("pallas", {}) and "fwd_bwd_ms" in row.get("dpa_cudnn", {}):
    row["pallas_over_cudnn_fwd"] = row["pallas"]["fwd_ms"] / row["dpa_cudnn"]["fwd_ms"]
    row["pallas_over_cudnn_fwd_bwd"] = row["pallas"]["fwd_bwd_ms"] / row["dpa_cudnn"]["fwd_bwd_ms"]
  return row


def main(argv):
  del argv
  c = flags.FLAGS.config
  impls = [s for s in c.impls.split(",") if s] or list(IMPLS)
  if unknown := set(impls) - set(IMPLS):
    raise ValueError(f"config.impls={c.impls!r}: unknown {sorted(unknown)}; choose from {IMPLS}")
  hq, hkv = map(int, c.heads.split(":"))
  emit = emitter(c.output)
  for p in (int(s) for s in str(c.prompt_lens).split(",")):
    emit(bench_prompt(p, b=c.batch, hq=hq, hkv=hkv, d=c.head_dim, dtype=jnp.dtype(c.dtype), repeats=c.repeats,
                      impls=impls))


if __name__ == "__main__":
  # Flags are defined only when run as a program, so that the benchmarks can be imported together.
  config_flags.DEFINE_config_file("config", "experiments/bench_prompt_attention.py", "Benchmark config.")
  app.run(main)
