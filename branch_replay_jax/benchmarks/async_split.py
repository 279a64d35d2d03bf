"""A model of the rollout / training split on D devices: steps per hour against the staleness bound k
and the rollout sub-mesh's size r (`mesh.rollout_devices`), from measured per-step sampling and update
seconds, and the parameter bytes a step sends to the rollout devices for the 1B and 8B shapes.

    python -m branch_replay_jax.benchmarks.async_split \\
        --metrics=docs/results/episodes-cpu/calc10_metrics_packed_e6cfd61.jsonl --devices=8

This is a simulation, not a run: no machine here has devices that do not share their cores.

The schedule is the producer's (algorithms/producer.py), replayed on the measured durations: step t
samples with version v(t) = max(0, t - k), which exists once update v(t) - 1 has ended; the producer
samples the steps in order, one at a time; update t starts when update t - 1 has ended and batch t is
sampled. Per step, S_t = sample_s + score_s and U_t = update_s of the metrics file, measured on one
device. The update scales as perfectly data-parallel work; sampling as its G groups (one device
samples a group, `placement.sampling_devices`), so it takes S_t x ceil(G / n) / G on n devices:
- shared (r = 0, the producer on the training devices): sampling and the update take turns on all D
  devices, S_t ceil(G / D) / G + U_t / D a step, whatever k (they contend for the same devices);
- split (r >= 1): sampling on r devices, S_t ceil(G / r) / G plus the transfer of the parameters to
  them (r x bytes / link bandwidth, from one training device), and the update on D - r devices,
  U_t / (D - r), overlapping as the schedule allows.
With G >= D and perfect scaling the shared loop keeps every device busy and no split beats it; the
split pays where sampling cannot use every device (G < D: few groups a step, decode latency).

Prints one JSON line per (r, k) with steps_per_hour, the ratio to the shared synchronous loop, the
update devices' idle fraction and the mean staleness; then one line per architecture with its
parameter count and the bytes a step sends (bfloat16 and float32 copies, per rollout device), and
the seconds that takes at --link_gbps.
"""

from __future__ import annotations

import json

import jax
import numpy as np
from absl import app, flags
from flax import nnx

from branch_replay_jax.models.config import architecture_shape
from branch_replay_jax.models.llama import Llama

flags.DEFINE_string("metrics", "docs/results/episodes-cpu/calc10_metrics_packed_e6cfd61.jsonl",
                    "a run's metrics.jsonl: each step's sample_s, score_s and update_s (one device)")
flags.DEFINE_integer("devices", 8, "D, devices in all")
flags.DEFINE_integer("groups", 2, "G, groups sampled per step (the calculator experiment's rollout.prompts_per_step)")
flags.DEFINE_list("staleness", ["0", "1", "2", "4"], "k values")
flags.DEFINE_list("architectures", ["llama-3.2-1b", "llama-3.1-8b"], "shapes whose parameter bytes are reported")
flags.DEFINE_string("sampled_architecture", "smollm2-135m", "the metrics' model, for the transfer term of the schedule")
flags.DEFINE_float("link_gbps", 100.0, "device-to-device bandwidth in GB/s for the transfer seconds")
flags.DEFINE_integer("repeat", 10, "the measured steps are replayed this many times in a row (a longer run)")
FLAGS = flags.FLAGS


def parameter_count(name: str) -> int:
  """Parameters of a named architecture (`models.config.ARCHITECTURE_SHAPES`), by `nnx.eval_shape`: no weights."""
  model = nnx.eval_shape(lambda: Llama(architecture_shape(name), rngs=nnx.Rngs(0)))
  return int(sum(np.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param))))


def schedule(sample_s, update_s, k: int) -> dict:
  """End times of the producer's schedule (module docstring) for durations [N] each; returns the run's
  seconds, the update's idle seconds and the mean staleness."""
  n = len(sample_s)
  end_sample, end_update = np.zeros(n), np.zeros(n)
  published = lambda v: 0.0 if v == 0 else end_update[v - 1]   # version v: after update v - 1
  for t in range(n):
    v = max(0, t - k)
    start = max(end_sample[t - 1] if t else 0.0, published(v))
    end_sample[t] = start + sample_s[t]
    end_update[t] = max(end_update[t - 1] if t else 0.0, end_sample[t]) + update_s[t]
  total = end_update[-1]
  return {"seconds": total, "update_idle": 1.0 - float(np.sum(update_s)) / total,
          "staleness_mean": float(np.mean([t - max(0, t - k) for t in range(n)]))}


def main(_):
  with open(FLAGS.metrics) as f:
    records = [json.loads(line) for line in f]
  s = np.tile([r["sample_s"] + r.get("score_s", 0.0) for r in records], FLAGS.repeat)
  u = np.tile([r["update_s"] for r in records], FLAGS.repeat)
  d, g = FLAGS.devices, FLAGS.groups
  on = lambda n: s * np.ceil(g / n) / g   # sampling seconds on n devices: one group per device at a time
  sampled_bytes = 4 * parameter_count(FLAGS.sampled_architecture)   # float32 copies, as the run sends them
  shared = schedule(on(d) + u / d, np.zeros_like(u), 0)   # r = 0: sampling and the update take turns
  shared["update_idle"] = float(np.sum(on(d))) / shared["seconds"]
  base = shared["seconds"]
  common = {"metrics": FLAGS.metrics, "steps": len(s), "devices": d, "groups": g, "sample_s_mean": float(s.mean()),
            "update_s_mean": float(u.mean())}
  for r in range(0, d):
    for k in ([0] if r == 0 else [int(x) for x in FLAGS.staleness]):   # shared: k changes nothing (module docstring)
      transfer = r * sampled_bytes / (FLAGS.link_gbps * 1e9)
      out = shared if r == 0 else schedule(on(r) + transfer, u / (d - r), k)
      print(json.dumps({**common, "rollout_devices": r, "max_staleness": k,
                        "steps_per_hour": round(3600 * len(s) / out["seconds"], 2),
                        "vs_shared_sync": round(base / out["seconds"], 3),
                        "update_idle_frac": round(out["update_idle"], 3),
                        "staleness_mean": round(out["staleness_mean"], 3)}))
  for name in FLAGS.architectures:
    n = parameter_count(name)
    print(json.dumps({"architecture": name, "parameters": n, "bytes_bf16": 2 * n, "bytes_fp32": 4 * n,
                      "per_step_bytes_bf16_per_rollout_device": 2 * n,
                      "transfer_s_bf16_per_rollout_device": round(2 * n / (FLAGS.link_gbps * 1e9), 4),
                      "link_gbps": FLAGS.link_gbps}))


if __name__ == "__main__":
  app.run(main)
