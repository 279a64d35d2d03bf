"""Compile-only memory of one GRPO group's gradient on ONE device: naive, replay and fused replay; JSON lines.

  python -m branch_replay_jax.benchmarks.replay_memory --config=experiments/bench_replay_memory.py
  python -m branch_replay_jax.benchmarks.replay_memory --config=experiments/bench_replay_memory.py:smoke

For each architecture in config.models (models.config.ARCHITECTURE_SHAPES; abstract parameters from
`nnx.eval_shape`, cast to config.param_dtype: no weights anywhere), each prompt length P in
config.prompts and each mode in config.modes, the jitted `gradients.step.value_and_grad` of one group
(G completions of T tokens, the GRPO objective) is lowered and compiled, never run:

  naive:M    layout "naive", M sequences of P + T tokens per scan step;
  replay:M   `core.replay.replay_vjp` (fused=False), M completions per scan step (M = G: no scan);
  fused      the prompt and the G completions in one layer scan (fused=True; docs/design.md, "Memory and remat").

A row's bytes are XLA's buffer assignment of the compiled program (`memory_analysis()`): argument +
temp + output bytes, what a device holds while the step runs (parameters, batch, temporaries,
gradients); device-independent, no runtime or allocator overhead. Then, per (model, mode), one summary row: the
growth per prompt token between the two largest P (bytes_per_token), and the largest P whose
extrapolated bytes fit each budget in config.budgets_gib (largest_P[budget], rounded down to 1024),
on the assumption, visible in the rows, that bytes grow linearly in P once P dominates.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx
from ml_collections import config_flags

from branch_replay_jax import losses as obj
from branch_replay_jax.benchmarks.replay import GRPO_OBJECTIVE, emitter
from branch_replay_jax.data.batches import group_arrays
from branch_replay_jax.data.groups import make_group
from branch_replay_jax.gradients.heads import POLICY
from branch_replay_jax.gradients.step import value_and_grad
from branch_replay_jax.models.config import architecture_shape, tiny_config
from branch_replay_jax.models.llama import Llama


def parse_mode(mode: str, g: int) -> dict:
  """value_and_grad's keyword arguments of a mode name ("naive:M", "replay:M", "fused"); ValueError
  naming the mode when it is none of these or M does not divide G."""
  name, _, m = mode.partition(":")
  if name == "fused" and not m:
    return {"fused": True}
  if name in ("naive", "replay") and m.isdigit() and int(m) >= 1 and g % int(m) == 0:
    return {"layout": name, "micro_batch": int(m), **({"fused": False} if name == "replay" else {})}
  raise ValueError(f"bench_replay_memory: mode {mode!r} is not 'naive:M', 'replay:M' or 'fused' with M dividing G={g}")


def _abstract_params(cfg, config):
  model = nnx.eval_shape(lambda: Llama(cfg, dtype=jnp.dtype(config.dtype), remat=config.remat,
                                       attention_impl=config.attention_impl, rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(model)
  dtype = jnp.dtype(config.param_dtype)
  return graphdef, jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), params)


def _group(cfg, p: int, t: int, g: int, seed: int):
  rng = np.random.default_rng(seed)
  group = make_group(rng.integers(0, cfg.vocab_size, p), [rng.integers(0, cfg.vocab_size, t) for _ in range(g)],
                     vocab_size=cfg.vocab_size, max_positions=cfg.max_positions, prompt_bucket=p, completion_bucket=t)
  adv = np.asarray(obj.group_advantages(jnp.asarray(rng.normal(size=g))))
  weights = obj.token_weights(group.lengths, t, mode="sequence_mean").astype(np.float32)
  return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
                                group_arrays(group, weights=weights, advantage=adv))


def measure(config, model: str, p: int, mode: str) -> dict:
  """One compile: the row described in the module docstring."""
  cfg = tiny_config(vocab_size=256) if model == "tiny" else architecture_shape(model)
  cfg = dataclasses.replace(cfg, max_positions=max(cfg.max_positions, p + config.T))   # shapes only: any P compiles
  kwargs = parse_mode(mode, config.G)
  graphdef, params = _abstract_params(cfg, config)
  arrays = _group(cfg, p, config.T, config.G, config.seed)
  step = jax.jit(functools.partial(value_and_grad, POLICY, graphdef, objective=GRPO_OBJECTIVE,
                                   logprob_chunk=config.logprob_chunk, **kwargs))
  t0 = time.perf_counter()
  mem = step.lower(params, arrays).compile().memory_analysis()
  sizes = {f"{k}_bytes": int(getattr(mem, f"{k}_size_in_bytes")) for k in ("argument", "temp", "output")}
  return {"model": model, "mode": mode, "P": p, "G": config.G, "T": config.T, "remat": config.remat,
          "dtype": config.dtype, "param_dtype": config.param_dtype, "attention_impl": config.attention_impl,
          **sizes, "total_bytes": sum(sizes.values()), "total_gib": round(sum(sizes.values()) / 2 ** 30, 3),
          "compile_s": round(time.perf_counter() - t0, 1), "backend": jax.default_backend()}


def summary(rows: list[dict], budgets_gib) -> dict:
  """Linear growth between the two largest P of one (model, mode), and the largest P per budget."""
  rows = sorted(rows, key=lambda r: r["P"])
  lo, hi = rows[-2], rows[-1]
  per_token = (hi["total_bytes"] - lo["total_bytes"]) / (hi["P"] - lo["P"])
  largest = {str(b): int((b * 2 ** 30 - hi["total_bytes"]) / per_token + hi["P"]) // 1024 * 1024
             for b in budgets_gib}
  return {"summary": True, "model": hi["model"], "mode": hi["mode"], "G": hi["G"], "T": hi["T"],
          "remat": hi["remat"], "fit_P": [lo["P"], hi["P"]], "bytes_per_token": round(per_token, 1),
          "largest_P_by_budget_gib": largest, "extrapolated": True}


def main(argv):
  del argv
  config = flags.FLAGS.config
  emit = emitter(config.output)
  modes = [m.strip() for m in config.modes.split(",") if m.strip()]
  for mode in modes:
    parse_mode(mode, config.G)   # refuse a bad mode before any compile
  if len(config.prompts) < 2:
    raise ValueError(f"bench_replay_memory: config.prompts={config.prompts!r} needs two lengths or more (the fit)")
  for model in [m.strip() for m in config.models.split(",") if m.strip()]:
    for mode in modes:
      rows = []
      for p in sorted(config.prompts):
        rows.append(measure(config, model, p, mode))
        emit(rows[-1])
        jax.clear_caches()
      emit(summary(rows, config.budgets_gib))


if __name__ == "__main__":
  config_flags.DEFINE_config_file("config", "experiments/bench_replay_memory.py", "Benchmark config.")
  app.run(main)
