"""Per-device memory of the sharded replay step for 1B-8B models, from the compiler (nothing runs).

    python -m branch_replay_jax.benchmarks.sharded_memory --config=experiments/bench_sharded_memory.py
    python -m branch_replay_jax.benchmarks.sharded_memory --config=experiments/bench_sharded_memory.py:smoke

For each architecture in `config.models` (models.config.ARCHITECTURE_SHAPES: abstract parameters
from `nnx.eval_shape`, no weights anywhere), each parameter layout ("replicated", "fsdp"), remat
policy and prompt length P, the whole optimizer step (the loop's own `grpo.GRPOFunctions.train_step`: sharded
replay value-and-grad + AdamW) on `config.mesh` over 8 fake CPU devices is lowered and compiled,
never run, and `compiled.memory_analysis()` gives per-device bytes: arguments (this device's
parameters, optimizer state and batch shard), outputs (new parameters and state), temporaries
(activations, residuals, gathered weights, gradients). One JSON line per compile:

    state_bytes           this device's parameters + AdamW state (mu, nu) from their shardings;
    grad_bytes            this device's gradient = its parameter shard (gradients keep the layout);
    state_target_bytes    (parameters + gradient + AdamW state) / devices + one layer's gathered
                          weights (the issue's FSDP target: state_bytes + grad_bytes within 1.25x);
    peak_estimate_bytes   argument + output + temp - alias bytes: the step's device footprint.

With config.lora_rank > 0 the step trains LoRA adapters (models/lora.py: rank config.lora_rank, alpha 2r, every
target) on a frozen base held in config.base_dtype and placed like the parameters (the loop's `frozen`): state_bytes
then counts the adapters, their AdamW state and the base shard; the search, the table and the naive step are
otherwise the same (the naive step compiles full fine-tuning).

Then, per (model, layout, remat), the largest P whose peak estimate fits each budget in
`config.budgets_gib` (96 GiB: H20; 141 GiB: H200), by bisection over compiles, and the token
positions G (P + T) one group of that P gives. The naive step (prompt repeated per completion,
`gradients.step.value_and_grad(..., layout="naive")` of one completion per scan step) is compiled on one device
for the same (P, T) with one completion (its memory per completion does not depend on G), its
state added as replicated.

Caveat: these are the CPU backend's buffer assignments with the jnp reference attention, which
holds one [query chunk, key tile] block of scores at a time (kernels/reference.py; before that
change the prompt's [P, P] scores per head were live at once, docs/results/attention-memory-cpu);
a GPU or TPU runs the Pallas kernels (kernels/) instead, with their own tiling.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from branch_replay_jax import losses as obj  # noqa: E402
from branch_replay_jax.data.batches import RolloutBatch, Segments, group_batch  # noqa: E402
from branch_replay_jax.distributed.mesh import batch_specs, param_specs  # noqa: E402
from branch_replay_jax.models import lora  # noqa: E402
from branch_replay_jax.models.loading import decoder_class  # noqa: E402
from branch_replay_jax.models.config import architecture_shape, tiny_config  # noqa: E402
from branch_replay_jax.gradients.heads import POLICY  # noqa: E402
from branch_replay_jax.gradients.step import value_and_grad  # noqa: E402
from branch_replay_jax.algorithms import grpo, runs  # noqa: E402

OBJECTIVE = functools.partial(obj.grpo_objective, clip_eps=0.2, kl_coef=0.05, on_policy=False)
GIB = 2 ** 30


def _architecture(name: str, expert_matmul: str = "ragged_dot"):
  """The named shapes (any P compiles); a mixture of experts' with the given `ModelConfig.expert_matmul`.
  Raises ValueError for 'pallas' (its kernels run on one device; this model compiles the mesh step)."""
  if expert_matmul == "pallas":
    raise ValueError("config.expert_matmul='pallas': the Pallas grouped matmul runs on one device, and the memory "
                     "model compiles the mesh step; use 'tiled' or 'ragged_dot'")
  cfg = tiny_config(vocab_size=256) if name == "tiny" else architecture_shape(name)
  return dataclasses.replace(cfg, max_positions=1 << 24, **({"expert_matmul": expert_matmul} if cfg.moe else {}))


def _abstract_model(cfg, dtype: str, remat: str, attention_impl: str, lora_rank: int = 0,
                    base_dtype: str = "bfloat16"):
  """(graphdef, abstract params) of the architecture; with lora_rank > 0 (graphdef, adapters, base in
  base_dtype): every target adapted at that rank, alpha 2 r."""
  def build():
    model = decoder_class(cfg)(cfg, dtype=jnp.dtype(dtype), remat=remat, attention_impl=attention_impl,
                               rngs=nnx.Rngs(0))
    if lora_rank:
      lora.add_adapters(model, lora.check_spec(lora_rank, 2.0 * lora_rank, lora.TARGETS, cfg, field="config.lora"),
                        rngs=nnx.Rngs(1))
    return model
  model = nnx.eval_shape(build)
  if not lora_rank:
    return nnx.split(model)
  graphdef, adapters, base = lora.split(model)
  return graphdef, adapters, jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.dtype(base_dtype)),
                                                    base)


def _placed(tree, specs, mesh):
  return jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
                                tree, specs)


def _total_bytes(tree) -> int:
  """Bytes of every leaf of an abstract pytree, whole (all devices together)."""
  return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))


def _local_bytes(tree) -> int:
  """Bytes of this device's shard of every leaf of an abstract, placed pytree."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
             for x in jax.tree_util.tree_leaves(tree))


def _batch(groups: int, g: int, p: int, t: int, dtype=jnp.float32) -> RolloutBatch:
  f = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)
  i = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  return group_batch(i(groups, p), i(groups), Segments(i(groups, g, t), jax.ShapeDtypeStruct((groups, g, t), bool),
                                                      weights=f(groups, g, t), advantage=f(groups, g),
                                                      old_logp=f(groups, g, t), ref_logp=f(groups, g, t)))


def _memory(compiled) -> dict:
  m = compiled.memory_analysis()
  return {"argument_bytes": m.argument_size_in_bytes, "output_bytes": m.output_size_in_bytes,
          "temp_bytes": m.temp_size_in_bytes, "alias_bytes": m.alias_size_in_bytes,
          "peak_estimate_bytes": (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                                  - m.alias_size_in_bytes)}


def loop_config(c, layout: str):
  """The GRPO experiment's config with this study's mesh, parameter layout, micro-batch and an off-policy
  objective (train.inner_epochs = 2: the importance ratio and old log-probs are live, as with PPO-style
  epochs; k3 KL at 0.05): what `grpo.GRPOFunctions` builds the loop's step from."""
  from experiments import grpo_smollm2_arith
  run = grpo_smollm2_arith.get_config()
  run.mesh.data, run.mesh.branch, run.mesh.seq = c.mesh
  run.mesh.params, run.mesh.expert = layout, c.expert
  run.train.micro_batch, run.train.inner_epochs, run.loss.kl_coef = c.micro_batch, 2, 0.05
  run.rollout.group_size = c.G
  return run


def replay_case(c, name: str, layout: str, remat: str, p: int) -> dict:
  """Compile the training loop's own mesh step (`grpo.GRPOFunctions.train_step`: the GRPO gradient by
  replay and the clipped AdamW update in one program) once; per-device bytes and the state accounting."""
  cfg = _architecture(name, c.expert_matmul)
  run = loop_config(c, layout)
  graphdef, params, *frozen = _abstract_model(cfg, c.dtype, remat, c.attention_impl, c.lora_rank, c.base_dtype)
  tx = runs.make_optimizer(run)
  fns = grpo.GRPOFunctions(run, graphdef, optimizer=tx)
  mesh = fns.mesh
  with jax.set_mesh(mesh):
    place = lambda tree: _placed(tree, param_specs(tree, mesh, layout, expert=c.expert), mesh)
    frozen = place(frozen[0]) if frozen else None   # LoRA: the base, placed as the loop places it
    params = place(params)
    opt_state = place(jax.eval_shape(tx.init, params))
    batch = _batch(mesh.shape["data"], c.G, p, c.T)
    batch = _placed(batch, batch_specs(batch, mesh), mesh)
    t0 = time.perf_counter()
    compiled = fns.train_step.lower(params, opt_state, batch, mesh.shape["data"], frozen).compile()
    compile_s = time.perf_counter() - t0
  total_params, frozen_bytes = _total_bytes((params, frozen)), _total_bytes(frozen)
  layer = sum(math.prod(x.shape[1:]) * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(
      nnx.state((nnx.merge(graphdef, params) if frozen is None else nnx.merge(graphdef, params, frozen)).layers)))
  state, grad = _local_bytes((params, opt_state, frozen)), _local_bytes(params)
  n = mesh.size
  # trained params + gradient + AdamW mu, nu (4 copies) and the frozen base (LoRA), split n ways
  target = (4 * (total_params - frozen_bytes) + frozen_bytes) / n + layer
  return {"study": "replay", "model": name, "params": layout, "expert": c.expert, "remat": remat,
          **({"lora_rank": c.lora_rank, "base_dtype": c.base_dtype} if c.lora_rank else {}),
          "mesh": "x".join(map(str, c.mesh)),
          "P": p, "T": c.T, "G": c.G, "dtype": c.dtype, "attention_impl": c.attention_impl,
          **({"expert_matmul": cfg.expert_matmul} if cfg.moe else {}), **_memory(compiled),
          "state_bytes": state, "grad_bytes": grad, "state_target_bytes": target, "state_ratio": (state + grad) / target,
          "parameter_bytes_total": total_params, "layer_bytes": layer,
          "token_positions_naive": mesh.shape["data"] * c.G * (p + c.T),
          "token_positions_computed": mesh.shape["data"] * (p + c.G * c.T), "compile_s": compile_s,
          "backend": jax.default_backend()}


def naive_case(c, name: str, remat: str, p: int) -> dict:
  """One device, one completion of T tokens on a P-token prompt (the naive step's per-scan-step
  footprint), parameters and AdamW state replicated (4 copies of the parameters)."""
  cfg = _architecture(name, c.expert_matmul)
  graphdef, params = _abstract_model(cfg, c.dtype, remat, c.attention_impl)
  batch = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), _batch(1, 1, p, c.T))
  step = jax.jit(lambda prm, b: value_and_grad(POLICY, graphdef, prm, b, OBJECTIVE, micro_batch=1,
                                                     logprob_chunk=c.logprob_chunk, layout="naive"))
  compiled = step.lower(params, batch).compile()
  mem = _memory(compiled)
  total_params = _total_bytes(params)
  return {"study": "naive", "model": name, "remat": remat, "P": p, "T": c.T, "dtype": c.dtype,
          "attention_impl": c.attention_impl, **({"expert_matmul": cfg.expert_matmul} if cfg.moe else {}), **mem,
          "peak_estimate_bytes": mem["peak_estimate_bytes"] + 2 * total_params,   # + AdamW mu, nu
          "backend": jax.default_backend()}


def largest_p(fits, lo: int, hi: int, granularity: int) -> int | None:
  """Largest P in [lo, hi] (a multiple of granularity) with fits(P), assuming fits is monotone;
  None when even lo does not fit, hi when hi fits."""
  if not fits(lo):
    return None
  if fits(hi):
    return hi
  while hi - lo > granularity:
    mid = (lo + hi) // 2 // granularity * granularity
    lo, hi = (mid, hi) if fits(mid) else (lo, mid)
  return lo


def sweep(c, emit, compile_case, search: bool, summary: dict, positions) -> None:
  """Compile `compile_case(P)` for each P of the table, then, when `search`, bisect the largest P
  whose peak estimate fits each budget; every compile is emitted once (a P the table and the
  search share is not compiled again), then one `summary` record per budget with largest_P and
  the token positions `positions(largest_P)` it gives."""
  cache = {}

  def run(p):
    if p not in cache:
      cache[p] = compile_case(p)
      emit(cache[p])
    return cache[p]
  for p in c.prompt_lengths:
    run(p)
  for budget in c.budgets_gib if search else ():
    best = largest_p(lambda p: run(p)["peak_estimate_bytes"] <= budget * GIB, c.search_min_p, c.search_max_p,
                     c.granularity)
    emit({**summary, "budget_gib": budget, "largest_P": best,
          "token_positions_naive": None if best is None else positions(best)})


def main(argv):
  del argv
  c = flags.FLAGS.config
  if len(c.mesh) != 3 or math.prod(c.mesh) != len(jax.devices()):
    raise ValueError(f"config.mesh={tuple(c.mesh)} must be data, branch, seq with product {len(jax.devices())}")
  emit = lambda r: print(json.dumps(r), flush=True)
  mesh = "x".join(map(str, c.mesh))
  for name in c.models.split(","):
    for remat in c.remats.split(","):
      searched = remat in c.search_remats.split(",")
      for layout in c.layouts.split(","):
        sweep(c, emit, lambda p: replay_case(c, name, layout, remat, p),
              searched and layout in c.search_layouts.split(","),
              {"study": "replay_largest_P", "model": name, "params": layout, "remat": remat, "G": c.G, "T": c.T,
               "mesh": mesh},
              lambda p: c.mesh[0] * c.G * (p + c.T))
      if c.naive:
        # naive data parallelism: each device holds whole sequences, one group's G over the devices
        sweep(c, emit, lambda p: naive_case(c, name, remat, p), searched,
              {"study": "naive_largest_P", "model": name, "remat": remat, "T": c.T, "devices": len(jax.devices())},
              lambda p: c.G * (p + c.T))


if __name__ == "__main__":
  config_flags.DEFINE_config_file("config", "experiments/bench_sharded_memory.py", "Benchmark config.")
  app.run(main)
