"""Benchmark one DPO gradient step on a preference pair: naive (prompt repeated) versus two-pass replay.

  nice -n 15 python -m branch_replay_jax.benchmarks.dpo --config=experiments/bench_dpo.py        # SmolLM2-135M, P=512, T=128
  python -m branch_replay_jax.benchmarks.dpo --config=experiments/bench_dpo.py:smoke             # tiny, seconds

Prints one JSON line with the columns of branch_replay_jax.benchmarks.replay where they apply: case, P, T, G
(completions: 2 per pair), pairs, naive_s, replay_s, speedup, naive_cpu_s, replay_cpu_s,
cpu_speedup, compile seconds, token_positions_naive/computed, max_rel_grad_err, peak_rss_bytes
(the whole process, both modes), plus ref_naive_s / ref_replay_s (the frozen reference's
forward-only log-prob sums, computed once per batch in both modes and not part of *_s).

- naive: `gradients.preference.naive_value_and_grad`, the pair's two full sequences [2, P + T] in one
  forward + backward (the loss differentiated directly, as TRL does).
- replay: `gradients.preference.ReplaySteps.value_and_grad`: pass 1 forward-only replay (prompt once, both
  completions on its K/V) for the log-prob sums, pass 2 replay forward + backward of the linear
  surrogate with the closed-form coefficients; the gradient equals naive's.
Each step is compiled first (compile seconds = first call minus the median), then timed `repeats`
times; the median is reported. Token ids are random (seeded); the reference is the policy itself.
"""

from __future__ import annotations

import json
import resource
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx
from ml_collections import config_flags

from branch_replay_jax.gradients import preference as pref


def _cpu_s() -> float:
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def _timed(fn, repeats):
  """(first-call seconds, median wall seconds, median CPU seconds, last output)."""
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn())
  first = time.perf_counter() - t0
  walls, cpus = [], []
  for _ in range(repeats):
    t0, c0 = time.perf_counter(), _cpu_s()
    out = jax.block_until_ready(fn())
    walls.append(time.perf_counter() - t0)
    cpus.append(_cpu_s() - c0)
  return first, statistics.median(walls), statistics.median(cpus), out


def main(argv):
  c = flags.FLAGS.config
  del argv
  if c.model == "tiny":
    from branch_replay_jax.models import Llama, tiny_config
    model = Llama(tiny_config(vocab_size=256, max_positions=4096), remat=c.remat, rngs=nnx.Rngs(0))
  else:
    from branch_replay_jax.models.loading import load
    model = load(c.model, remat=c.remat)[0]
  graphdef, params = nnx.split(model)
  cfg = model.config
  rng = np.random.default_rng(0)
  ids = lambda n: rng.integers(0, cfg.vocab_size, n)
  pair = pref.PreferencePair(ids(c.prompt), ids(c.completion), ids(c.completion))
  batch = pref.make_batch([pair], vocab_size=cfg.vocab_size, max_positions=cfg.max_positions)
  beta, loss_type, chunk = 0.1, c.loss, c.logprob_chunk

  steps = pref.ReplaySteps(graphdef, micro_batch=c.replay_micro_batch, logprob_chunk=chunk)
  naive_ref_fn = jax.jit(lambda p, n: pref.naive_ref_sums(graphdef, p, n, logprob_chunk=chunk))
  naive_fn = jax.jit(lambda p, n, r: pref.naive_value_and_grad(graphdef, p, n, r, beta=beta, loss_type=loss_type,
                                                               logprob_chunk=chunk))
  layout = steps.layout(batch)
  _, ref_replay_s, _, ref = _timed(lambda: steps.flat_sums(params, layout), c.repeats)
  _, ref_naive_s, _, naive_ref = _timed(lambda: naive_ref_fn(params, batch.naive), c.repeats)
  r_first, replay_s, replay_cpu, (r_loss, _, r_grads) = _timed(
      lambda: steps.value_and_grad(params, layout, ref, beta=beta, loss_type=loss_type), c.repeats)
  n_first, naive_s, naive_cpu, (n_loss, _, n_grads) = _timed(lambda: naive_fn(params, batch.naive, naive_ref),
                                                             c.repeats)
  leaf = lambda a, b: float(jnp.abs(a - b).max() / jnp.maximum(jnp.abs(b).max(), 1e-30))
  err = max(jax.tree_util.tree_leaves(jax.tree_util.tree_map(leaf, r_grads, n_grads)))
  print(json.dumps({
      "case": f"dpo_{c.prompt}x{c.completion}x2", "model": c.model, "P": c.prompt, "T": c.completion, "G": 2, "pairs": 1,
      "loss": loss_type, "naive_s": naive_s, "replay_s": replay_s, "speedup": naive_s / replay_s,
      "naive_cpu_s": naive_cpu, "replay_cpu_s": replay_cpu, "cpu_speedup": naive_cpu / replay_cpu,
      "naive_compile_s": n_first - naive_s, "replay_compile_s": r_first - replay_s,
      "ref_naive_s": ref_naive_s, "ref_replay_s": ref_replay_s, **batch.counts,
      "max_rel_grad_err": err, "loss_naive": float(n_loss), "loss_replay": float(r_loss),
      "replay_micro_batch": c.replay_micro_batch, "logprob_chunk": chunk, "remat": c.remat,
      "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}), flush=True)


if __name__ == "__main__":
  # Flags are defined only when run as a program, so that the benchmarks can be imported together.
  config_flags.DEFINE_config_file("config", "experiments/bench_dpo.py", "Benchmark config.")
  app.run(main)
