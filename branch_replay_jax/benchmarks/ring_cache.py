"""The group sampler's decode cache of a sliding-window model, whole against a ring of W - 1 slots for the sliding
layers (`window_kv.RingCache`, `rollout.sampler.init_cache`): compiled memory of `sample_group`'s program for the
named architectures (compile only: no weights, `nnx.eval_shape`), and the seconds of one call on a small random
model of the same layer kinds.

    python -m branch_replay_jax.benchmarks.ring_cache --config=experiments/bench_ring_cache.py

Prints one JSON line per (case, cache). Memory: XLA's `memory_analysis` of the compiled program on this host's
backend; `temp_gib` holds the decode cache (the while loop's carry), `argument_gib` the parameters. Time: the
median of `config.repeats` calls after the compiling one, wall and process CPU seconds, every sample decoding all
N tokens (no EOS).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx
from ml_collections import config_flags

from branch_replay_jax.models.config import architecture_shape
from branch_replay_jax.models.loading import decoder_class
from branch_replay_jax.rollout.sampler import bucketed_prompt_and_eos, generate_program

GIB = 1 << 30


def _arguments(config, dtype, g: int, p: int, abstract: bool):
  """(graphdef, state, the rest of `generate_program`'s arguments) for G samples of a prompt of P tokens."""
  build = lambda: decoder_class(config)(config, dtype=dtype, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(nnx.eval_shape(build) if abstract else build())
  padded, eos = bucketed_prompt_and_eos("ring_cache", np.arange(p) % config.vocab_size, p, np.zeros(0, np.int64))
  rest = (jnp.asarray(padded), jnp.int32(p), jax.random.split(jax.random.key(0), g), jnp.float32(1.0),
          jnp.float32(1.0), jnp.asarray(eos, jnp.int32), jnp.int32(0), None, jnp.float32(1.0))
  return graphdef, state, rest


def memory_row(name: str, dtype, g: int, p: int, n: int, ring: bool) -> dict:
  config = architecture_shape(name)
  graphdef, state, rest = _arguments(config, dtype, g, p, abstract=True)
  compiled = generate_program.lower(graphdef, state, *rest, max_new_tokens=n, greedy=False, use_top_p=False,
                                    ring=ring).compile()
  mem = compiled.memory_analysis()
  return dict(case="memory", model=name, ring=ring, samples=g, prompt=p, new_tokens=n,
              window=config.sliding_window, temp_gib=round(mem.temp_size_in_bytes / GIB, 3),
              argument_gib=round(mem.argument_size_in_bytes / GIB, 3),
              output_gib=round(mem.output_size_in_bytes / GIB, 3))


def time_row(args, ring: bool) -> dict:
  config = dataclasses.replace(architecture_shape(args.time_model), **dict(args.time_shape))
  graphdef, state, rest = _arguments(config, jnp.float32, args.time_samples, args.time_prompt, abstract=False)
  call = lambda key: generate_program(graphdef, state, rest[0], rest[1], jax.random.split(key, args.time_samples),
                                      *rest[3:], max_new_tokens=args.time_new_tokens, greedy=False, use_top_p=False,
                                      ring=ring)
  jax.block_until_ready(call(jax.random.key(0)))
  wall, cpu = [], []
  for i in range(args.repeats):
    w, c = time.perf_counter(), time.process_time()
    out = jax.block_until_ready(call(jax.random.key(i + 1)))
    wall.append(time.perf_counter() - w)
    cpu.append(time.process_time() - c)
  return dict(case="time", model=f"random {args.time_model} shape {dict(args.time_shape)}", ring=ring,
              samples=args.time_samples, prompt=args.time_prompt, new_tokens=args.time_new_tokens,
              window=config.sliding_window, wall_seconds=round(statistics.median(wall), 3),
              cpu_seconds=round(statistics.median(cpu), 3), generated=int(np.asarray(out[2]).sum()))


def main(argv):
  del argv
  args = flags.FLAGS.config
  dtype = jnp.dtype(args.dtype)
  for name in args.models:
    for n in args.new_tokens:
      for ring in (False, True):
        print(json.dumps(memory_row(name, dtype, args.samples, args.prompt, n, ring)), flush=True)
  if args.time_model:
    for ring in (False, True):
      print(json.dumps(time_row(args, ring)), flush=True)


if __name__ == "__main__":
  config_flags.DEFINE_config_file("config", "experiments/bench_ring_cache.py", "Benchmark config.")
  app.run(main)
