"""Wall and CPU seconds of one Gemma-3-shaped replay step (the unfused group replay, `gradients.step.value_and_grad`
with micro_batch=1: the path that hands the prompt's K/V to the branches), and the K/V it hands on.

  taskset -c 0 python docs/results/gemma-memory-cpu/step_time.py [repeats]

Prints one JSON line. A random 6-layer Gemma 3 (5 sliding layers of window 256, 1 global; d 256, 4 query / 2 KV
heads of 64), a 2,048-token prompt, G = 8 completions of 64 tokens, float32. Runs on any commit that has
`gradients.step.value_and_grad`, so two commits can be timed side by side on separate cores.
"""

import functools
import json
import sys
import time

import jax
import numpy as np
from flax import nnx

from branch_replay_jax import losses as obj
from branch_replay_jax.data.batches import group_arrays
from branch_replay_jax.data.groups import make_group
from branch_replay_jax.gradients.heads import POLICY
from branch_replay_jax.gradients.step import _prompt_state, value_and_grad
from branch_replay_jax.models import Llama, tiny_config
from branch_replay_jax.models.config import FULL, SLIDING

P, G, T, WINDOW, VOCAB = 2048, 8, 64, 256, 512


def main(repeats: int) -> None:
  cfg = tiny_config(arch="gemma3_text", vocab_size=VOCAB, d_model=256, num_layers=6, num_heads=4, num_kv_heads=2,
                    head_dim=64, ffn_dim=512, layer_types=(SLIDING,) * 5 + (FULL,), sliding_window=WINDOW,
                    rope_local_theta=1e4, query_pre_attn_scalar=64, max_positions=4096)
  model = Llama(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  rng = np.random.default_rng(0)
  group = make_group(rng.integers(1, VOCAB, P), [rng.integers(1, VOCAB, T) for _ in range(G)], vocab_size=VOCAB,
                     max_positions=4096)
  batch = group_arrays(group, weights=obj.token_weights(group.lengths, T, mode="sequence_mean"),
                       advantage=rng.normal(size=G).astype(np.float32),
                       old_logp=(-6.0 + 0.3 * rng.normal(size=(G, T))).astype(np.float32),
                       ref_logp=(-6.0 + 0.3 * rng.normal(size=(G, T))).astype(np.float32))
  objective = lambda logp, br: obj.grpo_objective(logp, br, clip_eps=0.2, kl_coef=0.05, on_policy=False)
  step = jax.jit(functools.partial(value_and_grad, POLICY, graphdef, objective=objective, micro_batch=1, fused=False))
  handed = jax.eval_shape(lambda p: _prompt_state(POLICY, nnx.merge(graphdef, p), batch)["kv"], params)
  kv_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(handed) if x.ndim >= 4)
  t0, c0 = time.perf_counter(), time.process_time()
  jax.block_until_ready(step(params, batch))
  first = (time.perf_counter() - t0, time.process_time() - c0)
  walls, cpus = [], []
  for _ in range(repeats):
    t0, c0 = time.perf_counter(), time.process_time()
    jax.block_until_ready(step(params, batch))
    walls.append(time.perf_counter() - t0)
    cpus.append(time.process_time() - c0)
  print(json.dumps({"P": P, "G": G, "T": T, "window": WINDOW, "layers": "5 sliding + 1 global",
                    "handed_kv_bytes": kv_bytes, "compile_and_first_s": round(first[0], 2),
                    "step_wall_s_median": round(float(np.median(walls)), 3),
                    "step_cpu_s_median": round(float(np.median(cpus)), 3), "repeats": repeats,
                    "backend": jax.default_backend()}))


if __name__ == "__main__":
  main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
