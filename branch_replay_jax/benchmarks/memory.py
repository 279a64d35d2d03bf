"""Long-context memory benchmarks of one GRPO step: peak memory versus G, and the longest prompt.

  python -m branch_replay_jax.benchmarks.memory --config=experiments/bench_memory.py

Two studies (config.studies), every attempt in a fresh process (`bench.run_worker`), one JSON
object per attempt and one summary object per study, mode and remat policy:

1. memory_vs_g: one replay step (micro-batch 1) for each G in config.memory_vs_g.groups at fixed
   P and T, and the naive step alongside at each naive micro-batch candidate (the lowest peak
   is the summary's). Modes named in memory_vs_g.compile_only_modes only compile and report the
   estimated peak (below) instead of a measured one. The summary gives peak_ratio = peak(G_max) / peak(G_min) and the same
   ratio of the compiled program's temp bytes (target: replay within 1.2x).
2. longest_context: for each remat policy, the largest P for which one step with G, T completes:
   P = start_p, 2 start_p, ... until an attempt fails, then bisection to `granularity` tokens.
   Naive likewise at its first micro-batch candidate that completes (a larger micro-batch is tried
   only after a time failure: it needs more memory, never less). `stopped_by` names the bound
   met at failed_P: "memory" (killed by the OS or by config.rss_limit_bytes, or an allocator
   error), "time" (config.attempt_timeout_s of wall time, load and compile included), "max_p"
   (never failed), or "error" (anything else; see stderr_tail). The search assumes both bounds
   are monotone in P. token_positions_naive = G (P + T) at the largest P. With
   longest_context.compile_only, attempts only compile: an attempt fails with "memory" when its
   estimated_peak_bytes (resident set after compile + XLA's temp and output bytes on the CPU;
   argument + temp + output bytes on an accelerator) exceeds
   config.memory_budget_bytes. That is the memory bound alone, where running would meet time first.

Memory, per attempt: peak_bytes is the process peak resident set on CPU (`ru_maxrss`: parameters,
runtime and the compiler included; rss_after_compile_bytes is the resident set just before the
step) or the device's peak_bytes_in_use on accelerators; temp_bytes, argument_bytes and
output_bytes come from the compiled executable's `memory_analysis()` (XLA's buffer assignment:
device-independent, no compiler or runtime overhead). host_temp_bytes is the part XLA places in
host memory; on the CPU backend "offload_kv" moves nothing (JAX lowers a transfer to host memory
to a no-op there: host and device memory are the same RAM), so there it measures as "save_kv".
Positions beyond the model's trained context (max_positions) are computed like any other: the
cost is the real one, the log-probs are meaningless and unused.
"""

from __future__ import annotations

import functools

import dataclasses
import os
import time

import jax
import ml_collections
from absl import app, flags
from flax import nnx
from ml_collections import config_flags

from branch_replay_jax.benchmarks import replay as bench
from branch_replay_jax.data.counts import group_counts
from branch_replay_jax.models.llama import REMAT_POLICIES
from branch_replay_jax.gradients.heads import POLICY
from branch_replay_jax.gradients.step import value_and_grad

_MEMORY_ERRORS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "MemoryError", "bad_alloc")


def _worker(job: dict) -> dict:
  """One step of `job["mode"]` ("replay" or "naive") at (P, T, G), micro-batch and remat: memory and seconds."""
  config = ml_collections.ConfigDict(job["config"])
  model = bench.load_model(config, remat=job["remat"])
  p, t, g = job["P"], job["T"], job["G"]
  # Lift the context check: the benchmark measures cost at P + T beyond the trained context too.
  model_config = dataclasses.replace(model.config, max_positions=max(model.config.max_positions, p + t))
  graphdef, params = nnx.split(model)
  del model
  arrays = bench.case_inputs(config, {"kind": "group", "P": p, "T": t, "G": g}, model_config)[0]
  fn = functools.partial(value_and_grad, POLICY) if job["mode"] == "replay" else functools.partial(value_and_grad, POLICY, layout="naive")
  step = jax.jit(lambda prm, a: fn(graphdef, prm, a, bench.GRPO_OBJECTIVE, micro_batch=job["micro_batch"],
                                   logprob_chunk=config.logprob_chunk))
  t0 = time.perf_counter()
  compiled = step.lower(params, arrays).compile()
  compile_s = time.perf_counter() - t0
  stats = compiled.memory_analysis()
  rss_after_compile = bench.rss_bytes(os.getpid())
  sizes = {f"{k}_bytes": getattr(stats, f"{k}_size_in_bytes", None) if stats is not None else None
           for k in ("temp", "argument", "output", "host_temp")}
  if job.get("compile_only"):
    # On the CPU the resident set after compile already holds the arguments (parameters, inputs)
    # and the runtime, and the step adds XLA's temp and output buffers. On an accelerator the
    # device holds the arguments, temp and output buffers (the host's resident set is not device memory).
    base = rss_after_compile if jax.default_backend() == "cpu" else (sizes["argument_bytes"] or 0)
    return {"compile_s": compile_s, "rss_after_compile_bytes": rss_after_compile, **sizes,
            "estimated_peak_bytes": base + (sizes["temp_bytes"] or 0) + (sizes["output_bytes"] or 0),
            "memory_measure": "compiled_estimate", "backend": jax.default_backend()}
  t0, c0 = time.perf_counter(), bench.cpu_seconds()
  loss = jax.block_until_ready(compiled(params, arrays))[0]
  step_s, step_cpu_s = time.perf_counter() - t0, bench.cpu_seconds() - c0
  peak, measure = bench.peak_bytes()
  return {"compile_s": compile_s, "step_s": step_s, "step_cpu_s": step_cpu_s, "peak_bytes": peak,
          "memory_measure": measure, "rss_after_compile_bytes": rss_after_compile, **sizes,
          "loss": float(loss), "backend": jax.default_backend()}


def _bound(result: dict, memory_budget_bytes: float = 0) -> str | None:
  """None when the attempt completed, else the bound it met: "time", "memory" or "error". A
  compile-only attempt meets "memory" when its estimated peak exceeds memory_budget_bytes."""
  if "error" not in result:
    return "memory" if result.get("estimated_peak_bytes", 0) > (memory_budget_bytes or float("inf")) else None
  if result["error"] == "timeout":
    return "time"
  if result["error"] in ("rss_limit", "killed by the OS (out of memory?)") or any(
      s in result.get("stderr_tail", "") for s in _MEMORY_ERRORS):
    return "memory"
  return "error"


def _attempt(config, emit, study: str, **job) -> dict:
  """Run one attempt in a fresh process and emit its record (with `bound` and the token counts)."""
  result = bench.run_worker({"config": config.to_dict(), **job}, module="branch_replay_jax.benchmarks.memory",
                             timeout_s=config.attempt_timeout_s, rss_limit_bytes=config.rss_limit_bytes or None)
  counts = group_counts(job["P"], [job["T"]] * job["G"])
  record = {"study": study, **job, **counts, **result, "bound": _bound(result, config.memory_budget_bytes),
            "model": config.model,
            "dtype": config.dtype}
  emit(record)
  return record


def largest_passing(attempt, start: int, granularity: int, max_p: int) -> tuple[int | None, int | None, str]:
  """(largest P that passed, smallest P that failed, bound met there) of a monotone search.

  attempt(P) -> None when P passes, else the bound's name. P doubles from `start` until a failure
  or `max_p` (then bound "max_p", failed P None), then bisects between the last pass and the first
  failure down to `granularity` tokens (P stays a multiple of it when `start` is).
  Raises ValueError for start < 1, granularity < 1 or max_p < start.
  """
  if start < 1 or granularity < 1 or max_p < start:
    raise ValueError(f"largest_passing: need 1 <= start <= max_p and granularity >= 1, got start={start}, "
                     f"granularity={granularity}, max_p={max_p}")
  lo, p = None, start
  while True:
    bound = attempt(p)
    if bound is not None:
      hi, hi_bound = p, bound
      break
    lo = p
    if p == max_p:
      return lo, None, "max_p"
    p = min(2 * p, max_p)
  if lo is None:
    return None, hi, hi_bound
  while hi - lo > granularity:
    mid = lo + max((hi - lo) // 2 // granularity, 1) * granularity
    bound = attempt(mid)
    if bound is None:
      lo = mid
    else:
      hi, hi_bound = mid, bound
  return lo, hi, hi_bound


def _peak(record: dict) -> int | None:
  """The measured peak of a run attempt, or the estimated peak of a compile-only one."""
  return record.get("peak_bytes", record.get("estimated_peak_bytes"))


def memory_vs_g(config, emit) -> None:
  c = config.memory_vs_g
  common = {"P": c.P, "T": c.T, "remat": c.remat}
  compile_only = set(_names(c.compile_only_modes))
  if not compile_only <= {"replay", "naive"}:
    raise ValueError(f"bench_memory: config.memory_vs_g.compile_only_modes={c.compile_only_modes!r}; "
                     "expected a comma-separated subset of 'replay,naive'")
  best = {"replay": {}, "naive": {}}
  for g in c.groups:
    r = _attempt(config, emit, "memory_vs_g", mode="replay", G=g, micro_batch=c.replay_micro_batch,
                 compile_only="replay" in compile_only, **common)
    best["replay"][g] = r
    if not c.naive:
      continue
    for m in bench.candidates(c.naive_micro_batches, g):
      r = _attempt(config, emit, "memory_vs_g", mode="naive", G=g, micro_batch=m,
                   compile_only="naive" in compile_only, **common)
      if r["bound"] is None and (g not in best["naive"] or _peak(r) < _peak(best["naive"][g])):
        best["naive"][g] = r
  for mode, rows in best.items():
    if not c.naive and mode == "naive":
      continue
    ok = {g: r for g, r in rows.items() if r.get("bound", "missing") is None}
    lo, hi = min(c.groups), max(c.groups)
    peaks, temps = {g: _peak(r) for g, r in ok.items()}, {g: r["temp_bytes"] for g, r in ok.items()}
    ratio = lambda by_g: by_g[hi] / by_g[lo] if lo in by_g and hi in by_g and by_g[lo] else None
    emit({"study": "memory_vs_g", "summary": True, "mode": mode, **common,
          "memory_measure": "compiled_estimate" if mode in compile_only else "measured",
          "peak_bytes": peaks, "temp_bytes": temps,
          "micro_batch": {g: r["micro_batch"] for g, r in ok.items()},
          "failed_G": [g for g in c.groups if g not in ok],
          f"peak_ratio_G{hi}_over_G{lo}": ratio(peaks), f"temp_ratio_G{hi}_over_G{lo}": ratio(temps)})


def longest_context(config, emit) -> None:
  c = config.longest_context
  runs = [("replay", r) for r in _names(config.policies)] + [("naive", r) for r in _names(config.naive_policies)]
  for mode, remat in runs:
    tries, winners = [], {}

    def attempt(p):
      micro = [c.replay_micro_batch] if mode == "replay" else bench.candidates(c.naive_micro_batches, c.G)
      for m in micro:
        tries.append(_attempt(config, emit, "longest_context", mode=mode, remat=remat, P=p, T=c.T, G=c.G,
                              micro_batch=m, compile_only=c.compile_only))
        if tries[-1]["bound"] is None:
          winners[p] = m
          return None
        if tries[-1]["bound"] != "time":   # a larger micro-batch needs more memory, never less
          return tries[-1]["bound"]
      return tries[-1]["bound"]

    largest, failed, bound = largest_passing(attempt, c.start_p, c.granularity, c.max_p)
    emit({"study": "longest_context", "summary": True, "mode": mode, "remat": remat, "G": c.G, "T": c.T,
          "largest_P": largest, "failed_P": failed, "stopped_by": bound,
          "micro_batch": winners.get(largest), "attempts": len(tries),
          "token_positions_naive": c.G * (largest + c.T) if largest else None,
          "token_positions_computed": largest + c.G * c.T if largest else None,
          "model": config.model, "dtype": config.dtype, "attempt_timeout_s": config.attempt_timeout_s,
          "compile_only": c.compile_only})


def _names(spec: str) -> list[str]:
  return [s.strip() for s in str(spec).split(",") if s.strip()]


STUDIES = {"memory_vs_g": memory_vs_g, "longest_context": longest_context}


def main(argv):
  del argv
  if bench.serve_worker(_worker):
    return
  config = flags.FLAGS.config
  studies = _names(config.studies)
  for name in studies:
    if name not in STUDIES:
      raise ValueError(f"bench_memory: config.studies names {name!r}; expected some of {tuple(STUDIES)}")
  for field, spec in (("policies", config.policies), ("naive_policies", config.naive_policies),
                      ("memory_vs_g.remat", config.memory_vs_g.remat)):
    for name in _names(spec):
      if name not in REMAT_POLICIES:
        raise ValueError(f"bench_memory: config.{field} names {name!r}; expected some of {REMAT_POLICIES}")
  emit = bench.emitter(config.output)
  for name in studies:
    STUDIES[name](config, emit)


if __name__ == "__main__":
  # Flags are defined only when run as a program, so that other benchmarks can import this module.
  config_flags.DEFINE_config_file("config", "experiments/bench_memory.py", "Benchmark config.")
  flags.DEFINE_string("worker", "", "Internal: JSON job for one attempt in a fresh process.")
  app.run(main)
