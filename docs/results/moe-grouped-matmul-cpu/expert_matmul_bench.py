"""The experts' grouped matmuls two ways on CPU: `jax.lax.ragged_dot` (XLA:CPU lowers it densely, every row times
every expert) against `kernels.grouped_matmul` (model.expert_matmul = "tiled": tiles of 128 rows of one expert).

A random Qwen3-MoE (4 layers, d 256, experts of width 128) in float32, one group of G = 8 completions of T = 128
tokens on a prompt of P = 256, the fused replay step (`gradients.step.value_and_grad`, GRPO's objective), for
E = 8 experts (2 per token) and E = 128 (8 per token, Qwen3-30B-A3B's routing). Per case and lowering: the step's
compile-time memory (XLA's temporaries), its median wall and CPU seconds over REPS runs after one warm-up, both
lowerings in one process, alternated; and in float64 the two lowerings' loss and gradient against each other.

    taskset -c 1 python docs/results/moe-grouped-matmul-cpu/expert_matmul_bench.py \
        > docs/results/moe-grouped-matmul-cpu/results.jsonl
"""

import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from branch_replay_jax import losses as obj
from branch_replay_jax.data.batches import group_arrays
from branch_replay_jax.data.groups import make_group
from branch_replay_jax.gradients.heads import POLICY
from branch_replay_jax.gradients.step import value_and_grad
from branch_replay_jax.models import Llama
from branch_replay_jax.models.config import tiny_config

G, T, P, VOCAB, REPS = 8, 128, 256, 512, 5


def objective(logp, br):
  return obj.grpo_objective(logp, br, clip_eps=0.2, kl_coef=0.05, on_policy=False)


def batch_of(dtype):
  rng = np.random.default_rng(0)
  group = make_group(rng.integers(3, VOCAB, P), [rng.integers(3, VOCAB, T - (g % 3)) for g in range(G)],
                     vocab_size=VOCAB, max_positions=1024, completion_bucket=T)
  t = group.completion_ids.shape[1]
  return group_arrays(group, weights=obj.token_weights(group.lengths, t, mode="sequence_mean").astype(dtype),
                      advantage=rng.normal(size=G).astype(dtype),
                      old_logp=(-6.0 + 0.3 * rng.normal(size=(G, t))).astype(dtype),
                      ref_logp=(-6.0 + 0.3 * rng.normal(size=(G, t))).astype(dtype))


def model_of(experts: int, k: int, matmul: str, dtype):
  cfg = tiny_config(vocab_size=VOCAB, arch="qwen3_moe", qk_norm=True, num_layers=4, d_model=256, num_heads=4,
                    num_kv_heads=2, head_dim=64, num_experts=experts, experts_per_token=k, expert_ffn_dim=128,
                    max_positions=1024, tie_embeddings=False)
  graphdef, params = nnx.split(Llama(dataclasses.replace(cfg, expert_matmul=matmul), dtype=dtype, rngs=nnx.Rngs(0)))
  return graphdef, jax.tree_util.tree_map(lambda x: x.astype(dtype), params)


def step_fn(graphdef):
  return jax.jit(lambda p, b: value_and_grad(POLICY, graphdef, p, b, objective))


def timed(fn, *args):
  t0, c0 = time.perf_counter(), time.process_time()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - t0, time.process_time() - c0


def main():
  batch = batch_of(np.float32)
  for experts, k in ((8, 2), (128, 8)):
    built = {m: model_of(experts, k, m, jnp.float32) for m in ("ragged_dot", "tiled")}
    fns = {m: step_fn(g) for m, (g, _) in built.items()}
    temp = {m: fns[m].lower(built[m][1], batch).compile().memory_analysis().temp_size_in_bytes for m in fns}
    for m in fns:
      timed(fns[m], built[m][1], batch)   # compile and warm up
    runs = {m: [] for m in fns}
    for _ in range(REPS):
      for m in fns:   # alternated, so both see the same machine
        runs[m].append(timed(fns[m], built[m][1], batch))
    with jax.enable_x64(True):
      b64 = batch_of(np.float64)
      out = {m: step_fn(model_of(experts, k, m, jnp.float64)[0])(model_of(experts, k, m, jnp.float64)[1], b64)
             for m in fns}
      (l0, _, g0), (l1, _, g1) = out["ragged_dot"], out["tiled"]
      err = max(float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(a)), 1e-30))
                for a, b in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g0)))
    for m in fns:
      wall, cpu = (float(np.median([r[i] for r in runs[m]])) for i in (0, 1))
      print(json.dumps({"experts": experts, "experts_per_token": k, "expert_matmul": m, "G": G, "T": T, "P": P,
                        "wall_s": round(wall, 4), "cpu_s": round(cpu, 4), "temp_bytes": int(temp[m]),
                        "reps": REPS, "backend": jax.default_backend()}), flush=True)
    print(json.dumps({"experts": experts, "tiled_over_ragged_wall":
                      round(float(np.median([r[0] for r in runs["tiled"]]) /
                                  np.median([r[0] for r in runs["ragged_dot"]])), 3),
                      "float64_loss_rel_diff": abs(float(l1) - float(l0)) / abs(float(l0)),
                      "float64_grad_max_rel_diff": err}), flush=True)


if __name__ == "__main__":
  main()
