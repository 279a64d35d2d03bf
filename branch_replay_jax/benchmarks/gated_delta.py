"""The chunked gated delta rule (Qwen3.5's linear layers) with its chunk scan by `jax.lax.scan` or by the Pallas
kernels (`model.gated_delta_scan`, kernels/gated_delta_pallas.py).

    python -m branch_replay_jax.benchmarks.gated_delta --config=experiments/bench_gated_delta.py
    python -m branch_replay_jax.benchmarks.gated_delta --config=experiments/bench_gated_delta.py:smoke

Per sequence length T (config.seq_lens), on the same float32 inputs q, k [B, T, H, Dk] (l2-normalised), v
[B, T, H, Dv], g, beta [B, T, H] and a random initial state, one JSON line with, per implementation:
compile_s (lower + compile of forward+backward), fwd_ms and fwd_bwd_ms (median of config.repeats timed calls
after a warm-up; `attention.timed`, under BENCH_TIMING_LOCK), and max_abs_diff of the output against the first
implementation that ran (`baseline`). On the CPU the Pallas kernels run in the interpreter, whose times say
nothing about a GPU's: the smoke variant checks that the benchmark runs and that the two agree.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from absl import app, flags
from ml_collections import config_flags

from branch_replay_jax.benchmarks.attention import timed
from branch_replay_jax.benchmarks.replay import emitter
from branch_replay_jax.models import gated_delta
from branch_replay_jax.models.config import GATED_DELTA_SCANS


def inputs(b: int, t: int, h: int, dk: int, dv: int, seed: int = 0):
  """(q, k, v, g, beta, state) in float32, as a Qwen3.5 linear layer hands them to the rule."""
  ks = jax.random.split(jax.random.key(seed), 6)
  q = gated_delta.l2_normalize(jax.random.normal(ks[0], (b, t, h, dk))) * dk ** -0.5
  k = gated_delta.l2_normalize(jax.random.normal(ks[1], (b, t, h, dk)))
  v = jax.random.normal(ks[2], (b, t, h, dv))
  g = -jax.nn.softplus(jax.random.normal(ks[3], (b, t, h)))
  beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h)))
  return q, k, v, g, beta, jax.random.normal(ks[5], (b, h, dk, dv))


def bench_length(t: int, *, b: int, h: int, dk: int, dv: int, chunk: int, repeats: int, impls) -> dict:
  """One row: every scan in `impls` on the same inputs (see the module docstring)."""
  args = inputs(b, t, h, dk, dv)
  row = {"kind": "gated_delta", "T": t, "b": b, "h": h, "dk": dk, "dv": dv, "chunk": chunk,
         "device": str(jax.devices()[0]), "backend": jax.default_backend()}
  baseline, base_out = None, None
  for scan in impls:
    rule = lambda *a, scan=scan: gated_delta.chunked(*a, chunk=chunk, scan=scan)
    loss = lambda *a, rule=rule: sum(jnp.sum(jnp.sin(x)) for x in rule(*a))
    t0 = time.perf_counter()
    fwd_bwd = jax.jit(jax.grad(loss, argnums=tuple(range(6)))).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    fwd = jax.jit(rule)
    out = fwd(*args)[0]
    fwd_ms, _ = timed(fwd, args, repeats)
    fwd_bwd_ms, all_ms = timed(fwd_bwd, args, repeats)
    if base_out is None:
      baseline, base_out = scan, out
    row[scan] = {"compile_s": round(compile_s, 3), "fwd_ms": round(fwd_ms, 4), "fwd_bwd_ms": round(fwd_bwd_ms, 4),
                 "fwd_bwd_ms_all": [round(x, 4) for x in all_ms],
                 "max_abs_diff": float(jnp.max(jnp.abs(out - base_out)))}
  row["baseline"] = baseline
  if "xla" in row and "pallas" in row:
    row["pallas_over_xla_fwd"] = row["pallas"]["fwd_ms"] / row["xla"]["fwd_ms"]
    row["pallas_over_xla_fwd_bwd"] = row["pallas"]["fwd_bwd_ms"] / row["xla"]["fwd_bwd_ms"]
  return row


def main(argv):
  del argv
  c = flags.FLAGS.config
  impls = [s for s in c.impls.split(",") if s]
  if not impls or set(impls) - set(GATED_DELTA_SCANS):
    raise ValueError(f"config.impls={c.impls!r}: choose from {GATED_DELTA_SCANS}")
  emit = emitter(c.output)
  for t in (int(s) for s in str(c.seq_lens).split(",")):
    emit(bench_length(t, b=c.batch, h=c.heads, dk=c.key_dim, dv=c.value_dim, chunk=c.chunk, repeats=c.repeats,
                      impls=impls))


if __name__ == "__main__":
  # Flags are defined only when run as a program, so that the benchmarks can be imported together.
  config_flags.DEFINE_config_file("config", "experiments/bench_gated_delta.py", "Benchmark config.")
  app.run(main)
