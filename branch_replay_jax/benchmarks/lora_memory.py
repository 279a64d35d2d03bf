"""Memory of a GRPO step with LoRA adapters against full fine-tuning, from the compiler (nothing runs).

    python -m branch_replay_jax.benchmarks.lora_memory --config=experiments/bench_lora_memory.py
    python -m branch_replay_jax.benchmarks.lora_memory --config=experiments/bench_lora_memory.py:smoke

For each architecture in `config.models` (models.config.ARCHITECTURE_SHAPES: abstract parameters
from `nnx.eval_shape`, no weights anywhere) and each mode, one device holds what the training
loop holds and runs one GRPO update on one group, lowered and compiled, never run:

    full   trained = every parameter; reference = a second copy of them (today's
           `run.initial_params`); AdamW state (mu, nu) of every parameter.
    lora   trained = the adapters (config.rank, alpha, targets; models/lora.py); frozen = the
           base parameters, in each of config.base_dtypes (model.param_dtype: the loop holds the
           frozen base in it, while full fine-tuning keeps a float32 master); reference = the adapters set to zero (`models.lora.adapters_off`), the
           base model through the same program; AdamW state of the adapters only.

The step: reference log-probs by forward-only replay (`replay_logprobs`), the GRPO gradient by
replay (`replay_value_and_grad`) and the clipped AdamW update of the trained parameters (donated,
as `gradients.step.make_train_step` does). One JSON line per compile:

    trained_bytes, frozen_bytes, reference_bytes, opt_state_bytes   from the shapes (exact);
    state_bytes        their sum: what the loop holds between steps;
    grad_bytes         the gradient (= trained_bytes), live during the update;
    argument_bytes, output_bytes, temp_bytes, alias_bytes, peak_estimate_bytes
                       `compiled.memory_analysis()` (peak = argument + output + temp - alias).

Caveat: the CPU backend's buffer assignment with dense XLA attention (see
benchmarks/sharded_memory.py); the state bytes do not depend on the backend.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time

import jax
import jax.numpy as jnp
import optax
from absl import app, flags
from flax import nnx
from ml_collections import config_flags

from branch_replay_jax import losses as obj
from branch_replay_jax.data.batches import RolloutBatch, Segments, group_batch
from branch_replay_jax.models import Llama, lora
from branch_replay_jax.models.config import architecture_shape, tiny_config
from branch_replay_jax.gradients.heads import POLICY
from branch_replay_jax.gradients.step import forward, value_and_grad

OBJECTIVE = functools.partial(obj.grpo_objective, clip_eps=0.2, kl_coef=0.04, on_policy=True)
MODES = ("full", "lora")


def _architecture(name: str):
  cfg = tiny_config(vocab_size=256) if name == "tiny" else architecture_shape(name)
  return dataclasses.replace(cfg, max_positions=1 << 24)   # shapes only: any P compiles


def _bytes(tree) -> int:
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))


def _batch(g: int, p: int, t: int) -> RolloutBatch:
  f = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  i = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  return group_batch(i(p), i(), Segments(i(g, t), jax.ShapeDtypeStruct((g, t), bool), weights=f(g, t),
                                        advantage=f(g)))


def case(c, name: str, mode: str, base_dtype: str = "float32") -> dict:
  """Compile one GRPO update of `mode` ("full" or "lora", whose frozen base is held in
  `base_dtype`) for architecture `name`; its byte accounting (see the module docstring)."""
  if mode not in MODES:
    raise ValueError(f"lora_memory: mode={mode!r} is not one of {MODES}")
  cfg = _architecture(name)
  spec = lora.check_spec(c.rank, c.alpha, tuple(c.targets), cfg, field="config")

  def build():
    model = Llama(cfg, dtype=jnp.dtype(c.dtype), remat=c.remat, rngs=nnx.Rngs(0))
    return lora.add_adapters(model, spec, rngs=nnx.Rngs(1)) if mode == "lora" else model
  model = nnx.eval_shape(build)
  if mode == "lora":
    graphdef, trained, frozen = lora.split(model)
    frozen = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.dtype(base_dtype)), frozen)
    reference = trained                       # adapters_off(trained): zeros of the adapters' shapes
  else:
    graphdef, trained = nnx.split(model)
    frozen, reference = None, trained         # a full copy of the initial parameters
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-5))
  opt_state = jax.eval_shape(tx.init, trained)
  bind = lambda f: graphdef if f is None else lora.WithBase(graphdef, f)

  def step(trained, frozen, reference, opt_state, batch):
    ref = forward(POLICY, bind(frozen), reference, batch, micro_batch=c.micro_batch, logprob_chunk=c.logprob_chunk)
    batch = batch.replace(levels=(batch.branches.replace(ref_logp=ref),))
    loss, _, grads = value_and_grad(POLICY, bind(frozen), trained, batch, OBJECTIVE, micro_batch=c.micro_batch,
                                           logprob_chunk=c.logprob_chunk)
    updates, opt_state = tx.update(grads, opt_state, trained)
    return optax.apply_updates(trained, updates), opt_state, loss

  t0 = time.perf_counter()
  compiled = jax.jit(step, donate_argnums=(0, 3)).lower(trained, frozen, reference, opt_state,
                                                         _batch(c.G, c.P, c.T)).compile()
  compile_s = time.perf_counter() - t0
  m = compiled.memory_analysis()
  sizes = {"trained_bytes": _bytes(trained), "frozen_bytes": _bytes(frozen), "reference_bytes": _bytes(reference),
           "opt_state_bytes": _bytes(opt_state)}
  return {"model": name, "mode": mode, **({"rank": spec.rank, "targets": list(spec.targets)} if mode == "lora" else {}),
          "dtype": c.dtype, "base_dtype": base_dtype if mode == "lora" else None, "remat": c.remat,
          "P": c.P, "T": c.T, "G": c.G, **sizes, "state_bytes": sum(sizes.values()), "grad_bytes": _bytes(trained),
          "argument_bytes": m.argument_size_in_bytes, "output_bytes": m.output_size_in_bytes,
          "temp_bytes": m.temp_size_in_bytes, "alias_bytes": m.alias_size_in_bytes,
          "peak_estimate_bytes": (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                                  - m.alias_size_in_bytes),
          "compile_s": compile_s, "backend": jax.default_backend()}


def main(argv):
  del argv
  c = flags.FLAGS.config
  for name in c.models.split(","):
    full = case(c, name, "full")
    print(json.dumps(full), flush=True)
    for base_dtype in c.base_dtypes.split(","):
      low = case(c, name, "lora", base_dtype)
      print(json.dumps(low), flush=True)
      print(json.dumps({"model": name, "summary": "lora_vs_full", "base_dtype": base_dtype,
                        "state_saved_bytes": full["state_bytes"] - low["state_bytes"],
                        "state_ratio": low["state_bytes"] / full["state_bytes"],
                        "peak_saved_bytes": full["peak_estimate_bytes"] - low["peak_estimate_bytes"],
                        "peak_ratio": low["peak_estimate_bytes"] / full["peak_estimate_bytes"]}), flush=True)


if __name__ == "__main__":
  config_flags.DEFINE_config_file("config", "experiments/bench_lora_memory.py", "Benchmark config.")
  app.run(main)
