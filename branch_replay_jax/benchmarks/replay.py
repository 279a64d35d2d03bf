"""Benchmark a GRPO gradient step on prompt groups: the strongest naive step versus branch replay.

  python -m branch_replay_jax.benchmarks.replay --config=experiments/bench_replay.py

Prints one JSON object per case (and per failed naive candidate) with: case, P, T, G,
naive_s, replay_s, speedup, ideal_flop_ratio, token_positions_naive, token_positions_computed,
max_rel_grad_err, naive_peak_bytes, replay_peak_bytes, memory_measure, compile seconds and the
naive micro-batch that won.

Method:
- Both steps are jitted; each is timed `repeats` times after its compile and one untimed warm-up
  run (median reported; compile seconds reported separately). With `timing_lock` set, workers
  sharing one device compile side by side but time their runs one at a time.
- The naive baseline is the strongest naive: one jitted step with log-probs only at completion
  positions, at its fastest micro-batch among the configured candidates (each candidate is
  compiled and timed once in its own process; the winner is timed `repeats - 1` more times in a
  fresh process and its median is over all `repeats` runs).
- Memory: on CPU there are no device memory stats, so each mode runs in a fresh subprocess and
  reports its peak resident set size (`ru_maxrss`, bytes; it includes the parameters and the
  runtime); on accelerators, `peak_bytes_in_use` from the device's memory stats.
- CPU seconds (user + system, all threads of the worker process) are reported beside wall
  seconds as naive_cpu_s / replay_cpu_s / cpu_speedup: the work each step did, which other jobs
  sharing the cores do not inflate the way they inflate wall time.
- Replay's micro-batch is chosen like naive's: each candidate timed once, the fastest kept.
- PPO cases (config.ppo_cases): the PPO step of gradients/step.py with the ActorCritic head, policy + critic (a value head,
  config.ppo_critic), instead of GRPO's; same columns.
- max_rel_grad_err: max over parameter leaves of max|g_replay - g_naive| / max|g_naive|.
- Replay variants: config.fused ("auto": `value_and_grad`'s default, the fused replay wherever it
  applies; "on"; "off": `core.replay.replay_vjp`) and config.prompt_attention ("model": the model's
  attention_impl; "xla" / "cudnn": blocks with no ancestors, the prompt's own causal block, through
  `jax.nn.dot_product_attention`, `kernels.causal_block_attention`; the naive step keeps the model's).
- MFU (model FLOPs utilisation, Chowdhery et al. 2022, PaLM, arXiv 2204.02311, appendix B): model
  FLOPs of a step = 3 x its forward FLOPs by `data.counts.forward_flops` (the same model as
  ideal_flop_ratio; rematerialisation not counted), over its median seconds, over config.peak_tflops:
  replay_mfu, naive_mfu, with replay_tflops / naive_tflops the achieved TFLOP/s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import app, flags
from flax import nnx
from ml_collections import config_flags

from branch_replay_jax import losses as obj
from branch_replay_jax.data.batches import RolloutBatch, group_arrays, trajectory_group_arrays, tree_arrays
from branch_replay_jax.data.counts import group_counts, tree_counts
from branch_replay_jax.data.groups import make_group
from branch_replay_jax.data.trees import RolloutTree, pad_tree
from branch_replay_jax.models import Llama, tiny_config
from branch_replay_jax.models.config import architecture_shape
from branch_replay_jax.models.critic import ActorCritic
from branch_replay_jax.gradients.heads import ACTOR_CRITIC, POLICY
from branch_replay_jax.gradients.step import forward, value_and_grad


# The on-policy GRPO step (ratio 1, beta 0, as in Dr. GRPO / DAPO): random old/ref log-probs far
# from the model's own would make the clipped and KL terms meaningless (exp of large gaps).
GRPO_OBJECTIVE = functools.partial(obj.grpo_objective, clip_eps=0.2, kl_coef=0.0, on_policy=True)
PPO_OBJECTIVE = functools.partial(obj.ppo_objective, clip_eps=0.2, vf_coef=0.5, value_clip=0.2)


RANDOM_PREFIX = "random:"   # config.model = "random:NAME": the architecture NAME with random weights


def load_model(config, remat: str = "none"):
  """The benchmarked model: "tiny", "random:NAME" (models.config.ARCHITECTURE_SHAPES, random weights:
  the step's cost does not depend on the weights, and no checkpoint has to reach the machine) or a
  name or path for models.load."""
  dtype, impl = jnp.dtype(config.dtype), config.attention_impl
  if config.model == "tiny" or config.model.startswith(RANDOM_PREFIX):
    return Llama(architecture_of(config), dtype=dtype, remat=remat, attention_impl=impl, rngs=nnx.Rngs(config.seed))
  from branch_replay_jax.models import load
  return load(config.model, dtype=dtype, remat=remat, attention_impl=impl)[0]


@contextlib.contextmanager
def timing_lock(path: str):
  """Hold an exclusive file lock (fcntl) on `path` for the block; no-op when `path` is empty.

  Benchmark workers that run side by side on one accelerator compile concurrently (host CPU work)
  but take this lock around their timed runs, so no two timed steps share the device.
  """
  if not path:
    yield
    return
  with open(path, "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def parse_case(config, index: int) -> dict:
  """Case `index` over config.cases (prompt groups) then config.tree_cases (full trees)."""
  if index < len(config.cases):
    p, t, g, *remat = config.cases[index]   # an optional 4th entry overrides config.remat for the case
    return {"kind": "group", "P": int(p), "T": int(t), "G": int(g), "remat": remat[0] if remat else config.remat}
  if index >= len(config.cases) + len(config.tree_cases):   # PPO step (policy + critic) on a prompt group
    p, t, g = (int(x) for x in config.ppo_cases[index - len(config.cases) - len(config.tree_cases)])
    return {"kind": "ppo", "P": p, "T": t, "G": g, "remat": config.remat}
  p, s, fanouts, *remat = config.tree_cases[index - len(config.cases)]   # optional 4th entry: remat
  fanouts = [int(f) for f in str(fanouts).split(",")]
  return {"kind": "tree", "P": int(p), "T": int(s), "fanouts": fanouts, "G": int(np.prod(fanouts)),
          "remat": remat[0] if remat else config.remat}


def _full_tree(case, vocab, rng) -> RolloutTree:
  segments, parents, frontier = [rng.integers(0, vocab, case["P"])], [-1], [0]
  for fanout in case["fanouts"]:
    nxt = []
    for node in frontier:
      for _ in range(fanout):
        segments.append(rng.integers(0, vocab, case["T"]))
        parents.append(node)
        nxt.append(len(segments) - 1)
    frontier = nxt
  return RolloutTree(tuple(segments), tuple(parents), tuple(frontier))


def case_inputs(config, case: dict, model_config) -> tuple[RolloutBatch, RolloutBatch, dict]:
  """(naive batch, replay batch, counts) of one case: random tokens and advantages."""
  rng = np.random.default_rng(config.seed)
  v, g = model_config.vocab_size, case["G"]
  adv = np.asarray(obj.group_advantages(jnp.asarray(rng.normal(size=g))))
  if case["kind"] in ("group", "ppo"):
    p, t = case["P"], case["T"]
    group = make_group(rng.integers(0, v, p), [rng.integers(0, v, t) for _ in range(g)], vocab_size=v,
                       max_positions=model_config.max_positions, prompt_bucket=p, completion_bucket=t)
    arrays = group_arrays(group, weights=obj.token_weights(group.lengths, t, mode="sequence_mean").astype(np.float32),
                          advantage=adv)
    return arrays, arrays, {**group_counts(p, [t] * g, model_config), "padding_fraction": 0.0}
  tree = _full_tree(case, v, rng)
  w = obj.trajectory_weights(tree.completion_lengths(), mode="sequence_mean").astype(np.float32)
  padded = pad_tree(tree, prompt_bucket=case["P"])
  naive = trajectory_group_arrays(tree, {}, w, vocab_size=v, max_positions=model_config.max_positions,
                                  completion_bucket=case["T"] * len(case["fanouts"]), advantage=adv)
  replay = tree_arrays(padded, {"weights": tree.node_weights(w)}, advantage=adv)
  return naive, replay, {**tree_counts(tree, model_config), "padding_fraction": padded.padding_fraction}


def _ppo_step(config, graphdef, params, arrays: RolloutBatch, mode: str, options: dict):
  """(graphdef, params, fn, objective, arrays) of a PPO step (gradients/step.py, the ActorCritic head) on a group.

  The model is wrapped in an ActorCritic (critic config.ppo_critic) whose value head is random
  (a zero head would contribute no value gradient to the trunk); old log-probs and old values
  come from a forward-only replay, as in the loop's first minibatch; advantages and returns are
  random per token. Naive and replay workers build identical inputs from config.seed.
  """
  ac = ActorCritic(nnx.merge(graphdef, params), critic=config.ppo_critic)
  ac.value_w[...] = 0.02 * jax.random.normal(jax.random.key(config.seed), ac.value_w.shape)
  graphdef, params = nnx.split(ac)
  rng = np.random.default_rng(config.seed + 1)
  branches = arrays.branches
  old = jax.jit(lambda p, a: forward(ACTOR_CRITIC, graphdef, p, a, logprob_chunk=config.logprob_chunk))(
      params, arrays)
  random = lambda: jnp.asarray(rng.normal(size=branches.tokens.shape), jnp.float32) * branches.mask
  branches = branches.replace(old_logp=old.logp, old_values=old.values, advantage=random(), returns=random())
  fn = (functools.partial(value_and_grad, ACTOR_CRITIC, layout="naive") if mode == "naive"
        else functools.partial(value_and_grad, ACTOR_CRITIC, **options))   # options: `replay_options`
  return graphdef, params, fn, PPO_OBJECTIVE, arrays.replace(levels=(branches,))


FUSED = {"auto": None, "on": True, "off": False}   # config.fused -> value_and_grad(fused=...)
PROMPT_ATTENTION = ("model", "xla", "cudnn")        # config.prompt_attention


def model_flops_utilisation(forward_flops: int, seconds: float, peak_tflops: float) -> tuple[float, float]:
  """(achieved TFLOP/s, MFU) of a training step of `forward_flops` forward FLOPs (`data.counts.forward_flops`)
  taking `seconds`: model FLOPs are 3x the forward's (forward + a backward of twice its cost; PaLM,
  arXiv 2204.02311, appendix B), MFU = model FLOPs / seconds / (peak_tflops 1e12)."""
  tflops = 3 * forward_flops / seconds / 1e12
  return tflops, tflops / peak_tflops


def replay_options(config, case: dict, attention_impl: str) -> dict:
  """value_and_grad keywords of the replay step for config.fused and config.prompt_attention
  (`attention_impl`: the model's resolved one, for the blocks with ancestors). Configs without
  these fields (the workers of benchmarks/backend.py and peer.py) get "auto" and "model".

  Raises:
    ValueError: an unknown config.fused or config.prompt_attention, before any compute.
  """
  fused, prompt = config.get("fused", "auto"), config.get("prompt_attention", "model")   # other benchmarks' workers
  if fused not in FUSED:
    raise ValueError(f"config.fused={fused!r}; expected one of {tuple(FUSED)}")
  if prompt not in PROMPT_ATTENTION:
    raise ValueError(f"config.prompt_attention={prompt!r}; expected one of {PROMPT_ATTENTION}")
  options = {} if case["kind"] == "tree" else {"fused": FUSED[fused]}
  if prompt != "model":
    from branch_replay_jax.kernels import attention_fn, causal_block_attention
    options["attention"] = causal_block_attention(prompt, attention_fn(attention_impl))
  return options


def peak_bytes() -> tuple[int, str]:
  stats = jax.devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    return int(stats["peak_bytes_in_use"]), "device_peak_bytes_in_use"
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process_peak_rss"


def cpu_seconds() -> float:
  """User + system CPU seconds of this process, all threads: the work done, robust to other jobs
  sharing the cores (wall time is not)."""
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def _worker(job: dict) -> dict:
  """One mode of one case at one micro-batch, timed; saves (naive) or compares (replay) grads."""
  config = ml_collections.ConfigDict(job["config"])
  case = parse_case(config, job["case"])
  model = load_model(config, remat=case["remat"])   # both modes of a case use the same remat policy
  model_config, attention_impl = model.config, model.attention_impl
  graphdef, params = nnx.split(model)
  del model
  naive_arrays, replay_arrays, _ = case_inputs(config, case, model_config)
  if case["kind"] == "ppo":
    graphdef, params, fn, objective, arrays = _ppo_step(config, graphdef, params, naive_arrays, job["mode"],
                                                           replay_options(config, case, attention_impl))
  elif job["mode"] == "naive":
    fn, objective, arrays = functools.partial(value_and_grad, POLICY, layout="naive"), GRPO_OBJECTIVE, naive_arrays
  elif case["kind"] == "tree":
    fn, objective, arrays = (functools.partial(value_and_grad, POLICY, schedule=config.tree_schedule,
                                               **replay_options(config, case, attention_impl)),
                             GRPO_OBJECTIVE, replay_arrays)
  else:
    fn, objective, arrays = (functools.partial(value_and_grad, POLICY, **replay_options(config, case, attention_impl)),
                             GRPO_OBJECTIVE, replay_arrays)
  step = jax.jit(lambda p, a: fn(graphdef, p, a, objective, micro_batch=job["micro_batch"],
                                 logprob_chunk=config.logprob_chunk))
  t0 = time.perf_counter()
  compiled = step.lower(params, arrays).compile()
  compile_s = time.perf_counter() - t0
  stats = compiled.memory_analysis()   # XLA's buffer assignment for this backend (bytes)
  times, cpu_times = [], []
  with timing_lock(config.timing_lock):
    jax.block_until_ready(compiled(params, arrays))   # warm-up: first-run allocation and autotuning, untimed
    for _ in range(job["repeats"]):
      t0, c0 = time.perf_counter(), cpu_seconds()
      out = jax.block_until_ready(compiled(params, arrays))
      times.append(time.perf_counter() - t0)
      cpu_times.append(cpu_seconds() - c0)
  peak, measure = peak_bytes()  # before any comparison array is loaded
  leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(out[2])]
  result = {"mode": job["mode"], "micro_batch": job["micro_batch"], "seconds": statistics.median(times),
            "times": times, "cpu_times": cpu_times, "compile_s": compile_s, "peak_bytes": peak, "memory_measure": measure,
            "temp_bytes": getattr(stats, "temp_size_in_bytes", None), "loss": float(out[0])}
  if job.get("save_grads"):
    np.savez(job["save_grads"], *leaves)
  if job.get("compare_grads"):
    with np.load(job["compare_grads"]) as ref:
      want = [ref[f"arr_{i}"] for i in range(len(leaves))]
    finite = all(np.isfinite(x).all() for x in leaves + want)
    # NaN would compare False in max(): report non-finite gradients as NaN, never as 0.
    result["max_rel_grad_err"] = max(float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
                                     for a, b in zip(leaves, want)) if finite else float("nan")
    result["grad_abs_max"] = max(float(np.abs(b).max()) for b in want)
  return result


def rss_bytes(pid: int) -> int:
  """Resident set of a live process (bytes); 0 once it has exited (no /proc entry or no VmRSS line)."""
  try:
    with open(f"/proc/{pid}/status") as f:
      return next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
  except OSError:
    return 0


def run_worker(job: dict, module: str = "branch_replay_jax.benchmarks.replay", timeout_s: float | None = None,
                rss_limit_bytes: int | None = None, env: dict | None = None) -> dict:
  """Run `python -m module --worker=JOB` in a fresh process and return its BENCH_RESULT record.

  env: the worker's environment (default: this process's), e.g. another XLA_FLAGS.

  The worker is killed after `timeout_s` seconds of wall time (error "timeout") or as soon as
  its resident set exceeds `rss_limit_bytes` (error "rss_limit"; polled every 0.2 s, Linux
  /proc); a failed worker returns {"error", "stderr_tail"}.
  """
  cmd = [sys.executable, "-m", module, f"--worker={json.dumps(job)}"]
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
  start, status = time.monotonic(), None
  while True:
    try:
      out, err = proc.communicate(timeout=0.2)
      break
    except subprocess.TimeoutExpired:
      if timeout_s is not None and time.monotonic() - start > timeout_s:
        status = "timeout"
      elif rss_limit_bytes and proc.poll() is None and rss_bytes(proc.pid) > rss_limit_bytes:
        status = "rss_limit"
      if status:
        proc.kill()
        out, err = proc.communicate()
        break
  for line in out.splitlines():
    if line.startswith("BENCH_RESULT "):
      return json.loads(line[len("BENCH_RESULT "):])
  if status is None:
    status = "killed by the OS (out of memory?)" if proc.returncode < 0 else f"exit code {proc.returncode}"
  return {"error": status, "stderr_tail": err[-1500:]}


def candidates(spec: str, g: int) -> list[int]:
  out = []
  for item in str(spec).split(","):
    m = g if item.strip() == "G" else int(item)
    if m < 1:
      raise ValueError(f"micro_batches: {item!r} in {spec!r} is not a positive int or 'G'")
    if g % m == 0 and m not in out:
      out.append(m)
  return out


def run_case(config, index: int, emit) -> dict:
  """Measure one case; `emit` receives every JSON record (failed candidates too)."""
  case = parse_case(config, index)
  p, t, g = case["P"], case["T"], case["G"]
  shape = {"case": index, "kind": case["kind"], "P": p, "T": t, "G": g, "fanouts": case.get("fanouts")}
  base = {"config": config.to_dict(), "case": index}
  with tempfile.TemporaryDirectory() as tmp:
    grads = os.path.join(tmp, "naive_grads.npz")
    naive_cands = candidates(config.naive_micro_batches, g)
    # One candidate needs no trial: its one run is the measurement (all repeats, gradients saved).
    trial = {"repeats": 1} if len(naive_cands) > 1 else {"repeats": config.repeats, "save_grads": grads}
    trials = {}
    for m in naive_cands:
      trials[m] = run_worker({**base, "mode": "naive", "micro_batch": m, **trial})
      if "error" in trials[m]:
        emit({**shape, "naive_micro_batch": m, **trials[m]})
    ok = {m: r for m, r in trials.items() if "error" not in r}
    replay_spec = config.replay_micro_batches if case["kind"] != "tree" else config.tree_replay_micro_batches
    replay_trials = {}
    replay_cands = candidates(replay_spec, g if case["kind"] != "tree" else max(case["fanouts"]))
    if len(replay_cands) > 1:   # same rule as naive: each candidate timed once, the fastest wins
      for m in replay_cands:
        replay_trials[m] = run_worker({**base, "mode": "replay", "micro_batch": m, "repeats": 1})
        if "error" in replay_trials[m]:
          emit({**shape, "replay_micro_batch": m, **replay_trials[m]})
      fine = {m: r for m, r in replay_trials.items() if "error" not in r}
      replay_m = min(fine, key=lambda m: fine[m]["seconds"]) if fine else replay_cands[0]
    else:
      replay_m = replay_cands[0]
    if not ok:   # naive does not fit this machine at any micro-batch: measure replay alone
      replay = run_worker({**base, "mode": "replay", "micro_batch": replay_m, "repeats": config.repeats})
      record = {**shape, "naive_s": None, "naive_error": "every naive micro-batch failed (see rows above)",
                **{k: replay.get(k) for k in ("seconds", "times", "compile_s", "peak_bytes", "memory_measure",
                                              "error")},
                **case_inputs(config, case, architecture_of(config))[2]}
      record["replay_s"] = replay.get("seconds")
      record.update(mfu_fields(config, record))
      emit(record)
      return record
    best_m = min(ok, key=lambda m: ok[m]["seconds"])
    if len(naive_cands) > 1:
      # The winner's trial run counts as its first timed run: repeats - 1 more in a fresh process.
      naive = run_worker({**base, "mode": "naive", "micro_batch": best_m, "repeats": max(config.repeats - 1, 1),
                           "save_grads": grads})
    else:
      naive, ok = ok[best_m], {best_m: {"times": [], "cpu_times": [], "peak_bytes": 0}}
    replay = run_worker({**base, "mode": "replay", "micro_batch": replay_m,
                          "repeats": config.repeats, "compare_grads": grads})
  for name, r in (("naive", naive), ("replay", replay)):
    if "error" in r:
      emit({**shape, "mode": name, "error": r["error"], "stderr_tail": r["stderr_tail"][-600:],
            "attention_impl": config.attention_impl, "fused": config.fused, "prompt_attention": config.prompt_attention})
      raise RuntimeError(f"bench: the {name} step failed for case {(p, t, g)}: {r['error']}\n{r['stderr_tail']}")
  naive["times"] = ok[best_m]["times"] + naive["times"]
  naive["cpu_times"] = ok[best_m]["cpu_times"] + naive["cpu_times"]
  naive["seconds"] = statistics.median(naive["times"])
  naive["peak_bytes"] = max(naive["peak_bytes"], ok[best_m]["peak_bytes"])
  counts = case_inputs(config, case, architecture_of(config))[2]
  record = {**shape, "naive_s": naive["seconds"], "replay_s": replay["seconds"],
            "speedup": naive["seconds"] / replay["seconds"], **counts,
            "naive_cpu_s": statistics.median(naive["cpu_times"]), "replay_cpu_s": statistics.median(replay["cpu_times"]),
            "cpu_speedup": statistics.median(naive["cpu_times"]) / statistics.median(replay["cpu_times"]),
            "max_rel_grad_err": replay["max_rel_grad_err"], "grad_abs_max": replay["grad_abs_max"],
            "naive_peak_bytes": naive["peak_bytes"], "replay_peak_bytes": replay["peak_bytes"],
            "naive_temp_bytes": naive.get("temp_bytes"), "replay_temp_bytes": replay.get("temp_bytes"),
            "attention_impl": config.attention_impl,
            "memory_measure": replay["memory_measure"], "naive_micro_batch": best_m,
            "replay_micro_batch": replay_m,
            "replay_micro_batch_trials": {m: r.get("seconds") for m, r in replay_trials.items()},
            "naive_compile_s": naive["compile_s"],
            "replay_compile_s": replay["compile_s"], "naive_times": naive["times"], "replay_times": replay["times"],
            "model": config.model, "dtype": config.dtype, "remat": case["remat"], "backend": jax.default_backend()}
  if case["kind"] == "tree":
    record["tree_schedule"] = config.tree_schedule
  record["speedup_over_ideal"] = record["speedup"] / record["ideal_flop_ratio"]
  record.update(mfu_fields(config, record))
  emit(record)
  return record


def mfu_fields(config, record: dict) -> dict:
  """The record's replay variant (fused, prompt_attention), the peak it is judged against and the
  achieved TFLOP/s and MFU of each step present (`model_flops_utilisation`; a None step time gives None)."""
  out = {"fused": config.fused, "prompt_attention": config.prompt_attention, "peak_tflops": config.peak_tflops}
  for mode in ("naive", "replay"):
    seconds = record.get(f"{mode}_s")
    tflops, mfu = (model_flops_utilisation(record[f"{mode}_forward_flops"], seconds, config.peak_tflops)
                   if seconds else (None, None))
    out[f"{mode}_tflops"], out[f"{mode}_mfu"] = tflops, mfu
  return out


def emitter(output: str):
  """A function that prints a record as one JSON line and, when `output` is set, appends it there."""
  def emit(record):
    line = json.dumps(record)
    print(line, flush=True)
    if output:
      with open(output, "a") as f:
        f.write(line + "\n")
  return emit


def architecture_of(config):
  if config.model == "tiny":
    return tiny_config(vocab_size=256, max_positions=4096)
  if config.model.startswith(RANDOM_PREFIX):
    # Random weights have no trained context: lift max_positions so long cases run (their cost is real).
    return dataclasses.replace(architecture_shape(config.model[len(RANDOM_PREFIX):]), max_positions=1 << 24)
  return load_model(config).config


def serve_worker(worker) -> bool:
  """In a worker process (flag --worker=JSON job, see run_worker): print `worker(job)` as the
  BENCH_RESULT line and return True; otherwise return False."""
  if not flags.FLAGS.worker:
    return False
  print("BENCH_RESULT " + json.dumps(worker(json.loads(flags.FLAGS.worker))), flush=True)
  return True


def main(argv):
  del argv
  if serve_worker(_worker):
    return
  config = flags.FLAGS.config
  emit = emitter(config.output)
  for i in range(len(config.cases) + len(config.tree_cases) + len(config.ppo_cases)):
    run_case(config, i, emit)


if __name__ == "__main__":
  # Flags are defined only when run as a program, so that other benchmarks can import this module.
  config_flags.DEFINE_config_file("config", "experiments/bench_replay.py", "Benchmark config.")
  flags.DEFINE_string("worker", "", "Internal: JSON job for one measurement in a fresh process.")
  app.run(main)
