"""Tokens per second of `sample_group`: greedy G=1 and sampling G=8, compile time reported apart.

    python -m branch_replay_jax.benchmarks.sampling --config=experiments/bench_sampling.py
    python -m branch_replay_jax.benchmarks.sampling --config=experiments/bench_sampling.py \\
        --config.model=smollm2-135m-instruct --config.dtype=bfloat16

Prints one JSON line per case. No EOS is set, so every sample decodes all `config.new_tokens` tokens
and `generated_tokens` = G * new_tokens. `compile_seconds` sums JAX's compile events of the
first call (`/jax/core/compile/*`: tracing, lowering to MLIR, XLA backend compile); `step_seconds` is the median of
`config.repeats` later calls with fresh keys, each ended by `block_until_ready`, and covers the
prefill plus new_tokens - 1 decode steps.
"""

from __future__ import annotations

import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx
from ml_collections import config_flags

from branch_replay_jax.models import Llama
from branch_replay_jax.models.config import architecture_shape
from branch_replay_jax.rollout.sampler import sample_group

SMOLLM2_135M_SHAPE = architecture_shape("smollm2-135m")   # random weights of the embedded model's shape
CASES = (("greedy", 1, 0.0), ("sample", 8, 1.0))   # (name, G, temperature)

_compile_seconds = [0.0]


def _on_event(name, seconds, **_):
  if name.startswith("/jax/core/compile/"):
    _compile_seconds[0] += seconds


def make_model(name: str, dtype):
  """(model, prompt ids of about `prompt_len` tokens as a function of the length)."""
  if name == "random-smollm2-shape":
    return Llama(SMOLLM2_135M_SHAPE, dtype=dtype, rngs=nnx.Rngs(0)), None
  try:
    from branch_replay_jax.models import load
  except ImportError as err:
    raise SystemExit(f"config.model={name!r} needs branch_replay_jax.models.load, which is not importable: {err}")
  return load(name, dtype=dtype)


def prompt_ids(tokenizer, vocab_size: int, prompt_len: int) -> list[int]:
  """Random ids without a tokenizer; else the longest chat prompt of at most prompt_len tokens whose user
  message is a prefix (in words) of a fixed question."""
  if tokenizer is None:
    return np.random.default_rng(0).integers(0, vocab_size, prompt_len).tolist()
  from branch_replay_jax.models import encode_chat
  words = ("Explain step by step why the sum of two odd numbers is always even, then give three examples "
           "with numbers larger than one hundred and check each of them by long addition. " * 8).split()
  best = []
  for k in range(1, len(words) + 1):
    ids = encode_chat(tokenizer, [{"role": "user", "content": " ".join(words[:k])}])
    if len(ids) > prompt_len:
      break
    best = ids
  return best


def run_case(model, tokenizer, prompt, *, case, num_samples, temperature, new_tokens, repeats, top_p):
  kw = dict(num_samples=num_samples, max_new_tokens=new_tokens, temperature=temperature, top_p=top_p)
  _compile_seconds[0] = 0.0
  start = time.perf_counter()
  out = sample_group(model, prompt, key=jax.random.key(0), **kw)
  jax.block_until_ready(out)
  first_call = time.perf_counter() - start
  compile_seconds = _compile_seconds[0]
  times = []
  for i in range(repeats):
    start = time.perf_counter()
    out = sample_group(model, prompt, key=jax.random.key(i + 1), **kw)
    jax.block_until_ready(out)
    times.append(time.perf_counter() - start)
  step = statistics.median(times)
  generated = int(np.asarray(out.lengths).sum())
  row = dict(case=case, num_samples=num_samples, temperature=temperature, top_p=top_p, prompt_tokens=len(prompt),
             new_tokens=new_tokens, generated_tokens=generated, compile_seconds=round(compile_seconds, 3),
             first_call_seconds=round(first_call, 3), step_seconds=round(step, 4),
             tokens_per_second=round(generated / step, 1), recompiled_after_first=_compile_seconds[0] > compile_seconds)
  if tokenizer is not None:
    row["sample_0"] = tokenizer.decode(np.asarray(out.tokens[0, :int(out.lengths[0])]).tolist())
  return row


def main(argv):
  del argv
  args = flags.FLAGS.config
  if args.model not in ("random-smollm2-shape", "smollm2-135m-instruct"):
    raise ValueError(f"config.model={args.model!r} is not one of ('random-smollm2-shape', 'smollm2-135m-instruct')")
  jax.monitoring.register_event_duration_secs_listener(_on_event)
  model, tokenizer = make_model(args.model, jnp.dtype(args.dtype))
  prompt = prompt_ids(tokenizer, model.config.vocab_size, args.prompt_len)
  for case, g, temperature in CASES:
    row = run_case(model, tokenizer, prompt, case=case, num_samples=g, temperature=temperature,
                   new_tokens=args.new_tokens, repeats=args.repeats, top_p=args.top_p if temperature else 1.0)
    row.update(model=args.model, dtype=args.dtype, device=str(jax.devices()[0].device_kind))
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
  # Flags are defined only when run as a program, so that the benchmarks can be imported together.
  config_flags.DEFINE_config_file("config", "experiments/bench_sampling.py", "Benchmark config.")
  app.run(main)
