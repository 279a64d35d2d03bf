"""Compiler temporaries and CPU time of the jnp reference attention, forward + backward; JSON lines.

    python -m branch_replay_jax.benchmarks.attention_memory --mode=memory \\
        --prompts=2048,4096,8192,16384,32768 --baseline=/tmp/reference_c60fde0.py
    taskset -c 1 python -m branch_replay_jax.benchmarks.attention_memory --mode=time \\
        --prompts=100,150,200 --baseline=/tmp/reference_c60fde0.py

The program is one layer's attention of a GRPO group in replay, at SmolLM2-135M's shapes (Hq 9,
Hkv 3, D 64, float32 as on the CPU): the prompt's own causal attention (B 1, T = P, no ancestor)
and the G completions' attention (B G, T tokens each) over the prompt shared as one batch-1
block. Its loss sums both outputs times fixed random cotangents and both lse; the gradient is
taken w.r.t. every q, K and V.

Implementations: "current" (`branch_replay_jax.kernels.reference`, as installed) and, with
--baseline, "baseline": `suffix_attention` of another copy of kernels/reference.py loaded from a
file (`git show <commit>:kernels/reference.py > FILE`; it must be self-contained, as that file is).

memory: `jax.jit(grad).lower(abstract arguments).compile().memory_analysis()` only (nothing runs,
nothing is allocated): temp_size_in_bytes is XLA's buffer assignment for the temporaries, the
quantity the issue measured (4.79 of 5.56 GiB at P = 8192 were score-sized buffers).

time: per implementation, a compiled call warmed up once, then `repeats` rounds, the
implementations interleaved within each round (so drifts of a shared machine hit both); wall ms
is the median, cpu_s the process CPU time (all threads) per call, median. Pin the process to one
core (taskset) for comparable figures.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from branch_replay_jax.kernels import reference

SHAPES = dict(hq=9, hkv=3, d=64)
"""SmolLM2-135M's attention: 9 query heads, 3 KV heads (GQA 3), head dim 64."""


def load_baseline(path: str):
  """The module in a file holding another version of kernels/reference.py (KVBlock, suffix_attention)."""
  spec = importlib.util.spec_from_file_location("reference_baseline", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def step_fn(module, p: int, g: int, t: int, dtype):
  """(grad function, abstract args) of the prompt + completions attention of one layer (module docstring)."""
  hq, hkv, d = SHAPES["hq"], SHAPES["hkv"], SHAPES["d"]
  rng = np.random.default_rng(0)
  # Constants in the program (not arguments), as the masks and cotangents of a real step are data.
  prompt_valid = jnp.asarray(np.arange(p) < p - 3)[None]          # a few padded prompt keys
  comp_valid = jnp.asarray(np.arange(t)[None] < rng.integers(t // 2, t + 1, size=(g, 1)))   # ragged completions
  ct_p = jnp.asarray(rng.normal(size=(1, p, hq, d)), dtype)
  ct_c = jnp.asarray(rng.normal(size=(g, t, hq, d)), dtype)
  Block = module.KVBlock

  def loss(q_p, k_p, v_p, q_c, k_c, v_c):
    out_p, lse_p = module.suffix_attention(q_p, [], Block(k_p, v_p, prompt_valid))
    out_c, lse_c = module.suffix_attention(q_c, [Block(k_p, v_p, prompt_valid)], Block(k_c, v_c, comp_valid))
    finite = lambda x: jnp.sum(jnp.where(jnp.isfinite(x), x, 0.0))
    return jnp.sum(out_p * ct_p) + jnp.sum(out_c * ct_c) + finite(lse_p) + finite(lse_c)

  sds = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)
  args = (sds(1, p, hq, d), sds(1, p, hkv, d), sds(1, p, hkv, d), sds(g, t, hq, d), sds(g, t, hkv, d),
          sds(g, t, hkv, d))
  return jax.grad(loss, argnums=tuple(range(6))), args


def memory_row(name, module, p, g, t, dtype) -> dict:
  fn, args = step_fn(module, p, g, t, dtype)
  t0 = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  mem = compiled.memory_analysis()
  return {"impl": name, "P": p, "G": g, "T": t, "dtype": jnp.dtype(dtype).name, **SHAPES,
          "query_chunk": getattr(module, "QUERY_CHUNK", None), "key_block": getattr(module, "KEY_BLOCK", None),
          "compile_s": round(time.perf_counter() - t0, 2), "temp_bytes": int(mem.temp_size_in_bytes),
          "argument_bytes": int(mem.argument_size_in_bytes), "output_bytes": int(mem.output_size_in_bytes),
          "temp_gib": round(mem.temp_size_in_bytes / 2 ** 30, 4)}


def time_rows(impls: dict, p, g, t, dtype, repeats: int) -> list[dict]:
  rng = np.random.default_rng(1)
  compiled, args = {}, None
  for name, module in impls.items():
    fn, shapes = step_fn(module, p, g, t, dtype)
    args = [jnp.asarray(rng.normal(size=s.shape), dtype) for s in shapes] if args is None else args
    compiled[name] = jax.jit(fn).lower(*args).compile()
    jax.block_until_ready(compiled[name](*args))                   # warm-up
  wall, cpu = {n: [] for n in impls}, {n: [] for n in impls}
  for _ in range(repeats):
    for name, fn in compiled.items():
      w0, c0 = time.perf_counter(), time.process_time()
      jax.block_until_ready(fn(*args))
      wall[name].append((time.perf_counter() - w0) * 1e3)
      cpu[name].append(time.process_time() - c0)
  return [{"impl": n, "P": p, "G": g, "T": t, "dtype": jnp.dtype(dtype).name, **SHAPES, "repeats": repeats,
           "wall_ms": round(statistics.median(wall[n]), 3), "cpu_s": round(statistics.median(cpu[n]), 4),
           "wall_ms_all": [round(x, 3) for x in wall[n]]} for n in impls]


def main(argv):
  del argv
  f = flags.FLAGS
  impls = {"current": reference}
  if f.baseline:
    impls["baseline"] = load_baseline(f.baseline)
  dtype = jnp.dtype(f.dtype)
  for p in map(int, f.prompts):
    if f.mode == "memory":
      rows = [memory_row(name, module, p, f.g, f.t, dtype) for name, module in impls.items()]
    else:
      rows = time_rows(impls, p, f.g, f.t, dtype, f.repeats)
    for row in rows:
      print(json.dumps(row), flush=True)


if __name__ == "__main__":
  flags.DEFINE_enum("mode", "memory", ["memory", "time"], "memory: compile only; time: run and time.")
  flags.DEFINE_list("prompts", ["2048", "4096", "8192", "16384", "32768"], "Prompt lengths P.")
  flags.DEFINE_integer("g", 8, "Completions per group (the completions' batch).")
  flags.DEFINE_integer("t", 32, "Tokens per completion.")
  flags.DEFINE_string("dtype", "float32", "Compute dtype.")
  flags.DEFINE_string("baseline", "", "A file with another version of kernels/reference.py, compared as 'baseline'.")
  flags.DEFINE_integer("repeats", 20, "Timed rounds (mode=time).")
  app.run(main)
