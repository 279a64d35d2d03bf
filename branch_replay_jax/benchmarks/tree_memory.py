"""Compiled memory of one GRPO gradient step on full rollout trees: naive versus nested replay.

  python -m branch_replay_jax.benchmarks.tree_memory --config=experiments/bench_tree_memory.py         # SmolLM2-135M
  python -m branch_replay_jax.benchmarks.tree_memory --config=experiments/bench_tree_memory.py:smoke   # tiny, 2,2:4,4

For each tree (fan-outs per level, e.g. "2,2,2" = 8 trajectories) and each mode, the step is
jitted, lowered and compiled (never run), and the executable's `memory_analysis()` is printed as
one JSON line: temp_bytes (XLA's scratch buffers: activations, residuals, accumulators; the part
that depends on the schedule), argument_bytes (parameters + inputs), output_bytes, alias_bytes and
peak_bytes (XLA's own peak estimate where the backend reports it). These come from XLA's buffer
assignment, so they are the same on a loaded or an idle machine and need no device memory stats
(CPU has none).

Modes: naive at micro-batch G (all trajectories in one batch, the fastest naive) and at
micro-batch 1 (one trajectory per scan step, the least memory); replay with schedule
"depth_first" and "level" (core/tree_replay.py), both at micro-batch 1.
"""

from __future__ import annotations

import functools
import json

import jax
import ml_collections
from absl import app, flags
from flax import nnx
from ml_collections import config_flags

from branch_replay_jax.benchmarks.replay import case_inputs, load_model, GRPO_OBJECTIVE
from branch_replay_jax.gradients.heads import POLICY
from branch_replay_jax.gradients.step import value_and_grad


def _memory(compiled) -> dict:
  m = compiled.memory_analysis()
  out = {"temp_bytes": m.temp_size_in_bytes, "argument_bytes": m.argument_size_in_bytes,
         "output_bytes": m.output_size_in_bytes, "alias_bytes": m.alias_size_in_bytes}
  if hasattr(m, "peak_memory_in_bytes"):
    out["peak_bytes"] = m.peak_memory_in_bytes
  return out


def main(argv):
  del argv
  c = flags.FLAGS.config
  config = ml_collections.ConfigDict({"model": c.model, "dtype": c.dtype, "seed": 0})
  model = load_model(config)
  graphdef, params = nnx.split(model)
  model_config = model.config
  del model
  for spec in c.fanouts.split(":"):
    fanouts = [int(f) for f in spec.split(",")]
    g = 1
    for f in fanouts:
      g *= f
    case = {"kind": "tree", "P": c.prompt_len, "T": c.segment_len, "fanouts": fanouts, "G": g}
    naive_arrays, replay_arrays, counts = case_inputs(config, case, model_config)
    steps = {
        "naive_G": (functools.partial(functools.partial(value_and_grad, POLICY, layout="naive"), micro_batch=g), GRPO_OBJECTIVE, naive_arrays),
        "naive_1": (functools.partial(functools.partial(value_and_grad, POLICY, layout="naive"), micro_batch=1), GRPO_OBJECTIVE, naive_arrays),
        "depth_first": (functools.partial(functools.partial(value_and_grad, POLICY), schedule="depth_first"), GRPO_OBJECTIVE,
                        replay_arrays),
        "level": (functools.partial(functools.partial(value_and_grad, POLICY), schedule="level"), GRPO_OBJECTIVE, replay_arrays),
    }
    for mode in c.modes.split(","):
      fn, objective, arrays = steps[mode]
      step = jax.jit(lambda p, a, fn=fn, objective=objective: fn(graphdef, p, a, objective))
      compiled = step.lower(params, arrays).compile()
      print(json.dumps({"model": config.model, "dtype": config.dtype, "P": case["P"], "segment": case["T"],
                        "fanouts": fanouts, "G": g, "mode": mode, **_memory(compiled),
                        "token_positions_naive": counts["token_positions_naive"],
                        "token_positions_computed": counts["token_positions_computed"],
                        "backend": jax.default_backend()}), flush=True)


if __name__ == "__main__":
  # Flags are defined only when run as a program, so that the benchmarks can be imported together.
  config_flags.DEFINE_config_file("config", "experiments/bench_tree_memory.py", "Benchmark config.")
  app.run(main)
