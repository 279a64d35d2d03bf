"""The cost of following a mixture of experts' routing in the replay step, and its exactness, on CPU.

A random Qwen3-MoE (4 layers, d 256, 8 experts of width 256, 2 per token) in float32, one group of G = 8
completions of T = 128 tokens on a prompt of P = 256 tokens. The fused replay step (`gradients.step.value_and_grad`,
GRPO's objective) timed three ways in one process: plain; with the load-balancing loss (Policy(router_aux_coef));
with recorded routes replayed (routing_replay, the routes the model's own forward picks, 30% of the pairs changed).
Then the same step against naive rows in float64 for each (max relative gradient error).

    taskset -c 0 python docs/results/moe-routing-cpu/routing_bench.py > docs/results/moe-routing-cpu/results.jsonl
"""

import json
import resource
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from branch_replay_jax import losses as obj
from branch_replay_jax.data.batches import group_arrays
from branch_replay_jax.data.groups import make_group
from branch_replay_jax.gradients.heads import Policy
from branch_replay_jax.gradients.step import naive_batch, value_and_grad
from branch_replay_jax.models import Llama
from branch_replay_jax.models.config import tiny_config

G, T, P, VOCAB = 8, 128, 256, 512


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


def with_routes(graphdef, params, batch, flip=0.3):
  """The batch with the routes the model's own naive forward picks, `flip` of the pairs changed."""
  tokens, valid, offset = naive_batch(batch)
  own = np.asarray(nnx.merge(graphdef, params)(tokens, offset, valid_bt=valid).experts)
  e = nnx.merge(graphdef, params).config.num_experts
  rng = np.random.default_rng(1)
  routes = own.copy()
  change = rng.random(own.shape[:3]) < flip
  change[:, :P] = change[:1, :P]
  for g, t, layer in zip(*np.nonzero(change)):
    s = list(own[g, t, layer])
    routes[g, t, layer] = [s[0], min(x for x in range(e) if x not in s)]
  return batch.replace(prompt_routes=jnp.asarray(routes[0, :P]),
                       branches=batch.branches.replace(routes=jnp.asarray(routes[:, P:])))


def model(dtype):
  cfg = tiny_config(vocab_size=VOCAB, arch="qwen3_moe", qk_norm=True, num_experts=8, experts_per_token=2,
                    expert_ffn_dim=256, num_layers=4, d_model=256, num_heads=4, num_kv_heads=2, head_dim=64,
                    max_positions=1024)
  m = Llama(cfg, dtype=dtype, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(m)
  return graphdef, jax.tree_util.tree_map(lambda x: x.astype(dtype), params)


CASES = {"plain": Policy(), "load_balancing": Policy(router_aux_coef=0.01), "routing_replay": Policy(routing_replay=True),
         "both": Policy(router_aux_coef=0.01, routing_replay=True)}


def timed(fn, *args, reps=5):
  jax.block_until_ready(fn(*args))
  out = []
  for _ in range(reps):
    c0, t0 = time.process_time(), time.perf_counter()
    jax.block_until_ready(fn(*args))
    out.append((time.perf_counter() - t0, time.process_time() - c0))
  return float(np.median([w for w, _ in out])), float(np.median([c for _, c in out]))


def main():
  graphdef, params = model(jnp.float32)
  plain = batch_of(np.float32)
  routed = with_routes(graphdef, params, plain)
  base = None
  for name, head in CASES.items():
    b = plain if name in ("plain", "load_balancing") else routed
    step = jax.jit(lambda p, b, head=head: value_and_grad(head, graphdef, p, b, objective)[::2])
    wall, cpu = timed(step, params, b)
    base = base or wall
    print(json.dumps({"case": name, "layout": "replay (fused)", "dtype": "float32", "G": G, "T": T, "P": P,
                      "wall_s": round(wall, 4), "cpu_s": round(cpu, 4), "vs_plain": round(wall / base, 3)}), flush=True)
  with jax.enable_x64(True):
    graphdef, params = model(jnp.float64)
    plain = batch_of(np.float64)
    routed = with_routes(graphdef, params, plain)
    for name, head in CASES.items():
      b = plain if name in ("plain", "load_balancing") else routed
      run = jax.jit(lambda p, b, layout, m, head=head: value_and_grad(head, graphdef, p, b, objective, layout=layout,
                                                                      micro_batch=m), static_argnums=(2, 3))
      ln, _, gn = run(params, b, "naive", None)
      for m in (None, 1):
        lr, _, gr = run(params, b, "replay", m)
        err = max(float(jnp.max(jnp.abs(x - y)) / jnp.maximum(jnp.max(jnp.abs(y)), 1e-30))
                  for x, y in zip(jax.tree_util.tree_leaves(gr), jax.tree_util.tree_leaves(gn)))
        print(json.dumps({"case": name, "layout": "replay fused" if m is None else "replay micro_batch=1",
                          "dtype": "float64", "vs": "naive rows", "max_rel_grad_err": err,
                          "loss_abs_err": abs(float(lr) - float(ln))}), flush=True)
  print(json.dumps({"peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}))


if __name__ == "__main__":
  main()
