"""XLA CPU backend options measured side by side: the replay and naive steps under each XLA_FLAGS variant.

  python -m branch_replay_jax.benchmarks.backend --config=experiments/bench_backend.py          # SmolLM2-135M
  python -m branch_replay_jax.benchmarks.backend --config=experiments/bench_backend.py:smoke    # tiny, seconds

Every (variant, mode) runs in a fresh worker process (`replay._worker`, its timing and gradient
comparison) whose XLA_FLAGS is the variant's; the variants take turns, round after round, so load
from other jobs falls on all of them alike. The first run's gradients (first variant, first mode) are the reference of
every other run's max_rel_grad_err. `branch_replay_jax/__init__.py` appends its own CPU defaults
(`CPU_XLA_FLAGS`) only for flags a variant does not name, so a variant that measures XLA's own
default names the flag with XLA's default value.

Prints one JSON object per run (variant, mode, round, seconds, cpu_s, max_rel_grad_err) and, per
case, a summary: per variant and mode the median wall and CPU seconds over the rounds and their
ratios to the first variant's, with the load average before and after.
"""

from __future__ import annotations

import os
import statistics
import tempfile

from absl import app, flags
from ml_collections import config_flags

from branch_replay_jax.benchmarks.replay import emitter, parse_case, run_worker


def check_config(config) -> None:
  """ValueError naming the field for a bad config, before any compute."""
  names = [name for name, _ in config.variants]
  if not names or len(set(names)) != len(names):
    raise ValueError(f"bench_backend: variants must be non-empty (name, XLA_FLAGS) pairs with unique names, got {names}")
  for field in ("rounds", "repeats", "naive_micro_batch", "replay_micro_batch"):
    if not isinstance(config[field], int) or config[field] < 1:
      raise ValueError(f"bench_backend: {field}={config[field]!r} must be a positive int")
  for mode in config.modes:
    if mode not in ("naive", "replay"):
      raise ValueError(f"bench_backend: modes entry {mode!r} is not 'naive' or 'replay'")
  if config.tree_cases or config.ppo_cases:
    raise ValueError("bench_backend: tree_cases and ppo_cases must be empty (prompt groups only)")


def run_case(config, index: int, emit) -> dict:
  case = parse_case(config, index)
  base = {"config": config.to_dict(), "case": index}
  shape = {"P": case["P"], "T": case["T"], "G": case["G"]}
  runs = {}
  load0 = os.getloadavg()
  with tempfile.TemporaryDirectory() as tmp:
    ref = os.path.join(tmp, "reference_grads.npz")
    for r in range(config.rounds):
      for name, xla_flags in config.variants:
        for mode in config.modes:
          job = {**base, "mode": mode, "repeats": config.repeats,
                 "micro_batch": config.naive_micro_batch if mode == "naive" else config.replay_micro_batch}
          if not os.path.exists(ref):
            job["save_grads"] = ref
          else:
            job["compare_grads"] = ref
          env = {**os.environ, "XLA_FLAGS": " ".join(x for x in (os.environ.get("XLA_FLAGS", ""), xla_flags) if x)}
          out = run_worker(job, env=env)
          if "error" in out:
            raise RuntimeError(f"bench_backend: variant {name!r} mode {mode} failed: {out['error']}\n{out['stderr_tail']}")
          row = {**shape, "variant": name, "mode": mode, "round": r, "seconds": out["seconds"],
                 "cpu_s": statistics.median(out["cpu_times"]), "max_rel_grad_err": out.get("max_rel_grad_err"),
                 "load_avg": os.getloadavg()[0]}
          emit(row)
          runs.setdefault((name, mode), []).append(row)
  first = config.variants[0][0]
  summary = {**shape, "summary": True, "load_avg_before": load0[0], "load_avg_after": os.getloadavg()[0],
             "variants": {}}
  for name, xla_flags in config.variants:
    entry = {"xla_flags": xla_flags}
    for mode in config.modes:
      rows, base_rows = runs[(name, mode)], runs[(first, mode)]
      wall, cpu = (statistics.median(r[k] for r in rows) for k in ("seconds", "cpu_s"))
      entry[mode] = {"s": wall, "cpu_s": cpu,
                     "s_ratio": wall / statistics.median(r["seconds"] for r in base_rows),
                     "cpu_ratio": cpu / statistics.median(r["cpu_s"] for r in base_rows),
                     "max_rel_grad_err": max((r["max_rel_grad_err"] or 0.0) for r in rows)}
    summary["variants"][name] = entry
  emit(summary)
  return summary


def main(argv):
  del argv
  config = flags.FLAGS.config
  check_config(config)
  emit = emitter(config.output)
  for i in range(len(config.cases)):
    run_case(config, i, emit)


if __name__ == "__main__":
  config_flags.DEFINE_config_file("config", "experiments/bench_backend.py", "Backend options config.")
  app.run(main)
