"""Exactness figures of this record (docs/results/moe-seq-lora-cpu): a mixture of experts (the Qwen3-MoE fixture,
float64) with recorded routes (30% flipped, 20% unrecorded) and the load-balancing loss (0.5),
  1. on a 2 x 2 x 2 FSDP mesh with the prompt split over seq, against the naive rows of the same two groups;
  2. with LoRA adapters on its attention (rank 3, random B), replay (fused; micro-batched) against naive rows.
Prints one JSON line per case: the loss's relative difference and the gradient's largest relative error.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_ENABLE_X64=1 \
    python docs/results/moe-seq-lora-cpu/exactness.py
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests"))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from conftest import max_rel_err, random_group  # noqa: E402
from families import arrays_of, objective  # noqa: E402
from flax import nnx  # noqa: E402
from test_moe import FIXTURE, _attention_adapters, _recorded_routes  # noqa: E402

from branch_replay_jax.distributed.mesh import make_mesh, pad_prompts, shard_batch, shard_params, stack_groups  # noqa: E402
from branch_replay_jax.gradients.heads import Policy  # noqa: E402
from branch_replay_jax.gradients.step import value_and_grad  # noqa: E402
from branch_replay_jax.models import lora  # noqa: E402
from branch_replay_jax.models.loading import build_model, load_hf_model  # noqa: E402

model = load_hf_model(FIXTURE)
m64 = build_model(model.config, nnx.to_pure_dict(nnx.state(model, nnx.Param)), dtype=jnp.float64)
graphdef, params = nnx.split(m64)
params = jax.tree_util.tree_map(lambda x: x.astype(jnp.float64), params)
head = Policy(router_aux_coef=0.5, routing_replay=True)


def with_routes(arrays, seed):
  prompt_routes, routes, _, _ = _recorded_routes(graphdef, params, arrays, np.random.default_rng(seed), flip=0.3,
                                                 unrecorded=0.2)
  return arrays.replace(prompt_routes=prompt_routes, branches=arrays.branches.replace(routes=routes))


def report(case, loss, want_loss, grads, want_grads):
  print(json.dumps({"case": case, "loss_rel_diff": abs(float(loss) - float(want_loss)) / abs(float(want_loss)),
                    "grad_max_rel_err": float(max_rel_err(grads, want_grads))}))


# 1. the seq split
groups = [with_routes(arrays_of(random_group([2, 5, 9, 4], prompt_len=6 + 3 * s, seed=s, vocab=96), np.float64,
                                seed=s), s) for s in range(2)]
naive = jax.jit(lambda p, b: value_and_grad(head, graphdef, p, b, objective, layout="naive"))
outs = [naive(params, a) for a in groups]
mesh = make_mesh(2, 2, 2)
with jax.set_mesh(mesh):
  batch = shard_batch(stack_groups(pad_prompts(groups, 2)), mesh)
  loss, _, grads = jax.jit(lambda p, b: value_and_grad(head, graphdef, p, b, objective, mesh=mesh, micro_batch=1))(
      shard_params(params, mesh, "fsdp"), batch)
report("seq_mesh_2x2x2_fsdp", loss, sum(o[0] for o in outs), grads,
       jax.tree_util.tree_map(lambda *g: sum(g), *[o[2] for o in outs]))

# 2. LoRA on the attention
lgraph, adapters, base = _attention_adapters(graphdef, params)
batch = with_routes(arrays_of(random_group([3, 6, 9, 2], prompt_len=7, seed=4, vocab=96), np.float64), 0)
run = jax.jit(lambda a, b, bt, layout, mb, fused: value_and_grad(head, lora.WithBase(lgraph, b), a, bt, objective,
                                                                   layout=layout, micro_batch=mb, fused=fused),
              static_argnums=(3, 4, 5))
ln, _, gn = run(adapters, base, batch, "naive", None, None)
for name, mb, fused in (("lora_attention_micro_batch_1", 1, False), ("lora_attention_fused", None, True)):
  lr, _, gr = run(adapters, base, batch, "replay", mb, fused)
  report(name, lr, ln, gr, gn)
