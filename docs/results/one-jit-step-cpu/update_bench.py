"""The default experiment's update in isolation: the old one-device path (a gradient program per
group, the gradients summed on the device, a separate update program) against the one jitted step
(gradients.step.make_train_step over the stacked groups), alternating, at the default experiment's
shapes (SmolLM2-135M, 2 groups of G = 8 completions of <= 32 tokens, 52-token prompts in the
64-token bucket, k3 KL on). Prints one JSON line per timed call: path, repeat, wall_s, cpu_s.

  python docs/results/one-jit-step-cpu/update_bench.py [REPEATS]
"""
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from branch_replay_jax import losses as obj
from branch_replay_jax.algorithms import grpo, runs
from branch_replay_jax.algorithms.placement import stack_on_device
from branch_replay_jax.core.accumulate import fit_micro_batch
from branch_replay_jax.data.batches import group_arrays
from branch_replay_jax.data.groups import make_group
from branch_replay_jax.gradients.heads import Policy
from branch_replay_jax.gradients.step import make_train_step, value_and_grad
from experiments import grpo_smollm2_arith

repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 3
config = grpo_smollm2_arith.get_config()
model, _ = runs.build_model(config)
graphdef, params = nnx.split(model)
tx = runs.make_optimizer(config)
objective, head = grpo.objective(config, False), Policy(temperature=1.0)
rng = np.random.default_rng(0)
vocab = model.config.vocab_size


def group(seed):
  r = np.random.default_rng(seed)
  lengths = r.integers(5, 33, 8)
  g = make_group(r.integers(0, vocab, 52), [r.integers(0, vocab, n) for n in lengths], vocab_size=vocab,
                 max_positions=model.config.max_positions, prompt_bucket=64, completion_bucket=32)
  adv = obj.group_advantages(jnp.asarray(r.normal(size=8), jnp.float32), ddof=0)
  return group_arrays(g, weights=obj.token_weights(g.lengths, 32, mode="sequence_mean"), advantage=adv,
                      ref_logp=(-4.0 + 0.3 * r.normal(size=(8, 32))).astype(np.float32))


groups = [group(s) for s in range(2)]
mb = fit_micro_batch(config.train.micro_batch, 8)
grad_jit = jax.jit(lambda p, b: (lambda l, a, g: (l, obj.grpo_aux_sums(a), g))(
    *value_and_grad(head, graphdef, p, b, objective, micro_batch=mb)))
update = runs.make_update(tx)
step = make_train_step(head, graphdef, tx, objective, micro_batch=config.train.micro_batch,
                       reduce_aux=obj.grpo_aux_sums)
stacked = stack_on_device(groups)


def old(p, o):
  total, sums = None, []
  for b in groups:
    loss, aux, g = grad_jit(p, b)
    total = g if total is None else jax.tree_util.tree_map(jnp.add, total, g)
    sums.append((loss, *aux))
  p, o, norm = update(p, o, jax.tree_util.tree_map(lambda x: x / len(groups), total))
  jax.device_get((sums, norm))
  return p, o


def new(p, o):
  p, o, out = step(p, o, stacked, len(groups))
  jax.device_get((out["loss"], out["aux"], out["grad_norm"]))
  return p, o


state = {"old": (params, tx.init(params)), "new": (jax.tree_util.tree_map(jnp.copy, params), tx.init(params))}
fns = {"old": old, "new": new}
for r in range(repeats + 1):   # repeat 0: the compiles
  for name in ("old", "new"):
    t, c = time.perf_counter(), time.process_time()
    state[name] = fns[name](*state[name])
    jax.block_until_ready(state[name])
    print(json.dumps({"path": name, "repeat": r, "compile": r == 0, "wall_s": round(time.perf_counter() - t, 3),
                      "cpu_s": round(time.process_time() - c, 3)}), flush=True)
