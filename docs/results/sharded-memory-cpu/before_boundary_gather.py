"""Compile the OLD (boundary-gathered) FSDP step for Llama-3.2-1B at P=8192 on 1x8x1: per-device bytes.

Run with the package of commit 5bc3985 (before FSDP inside the step, dict batches) installed:
`git worktree add /tmp/old 5bc3985 && cd /tmp/old && make install && .venv/bin/python THIS_FILE`.
Same case as benchmarks/sharded_memory.py's replay rows; output: before_boundary_gather.jsonl."""
import os
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import dataclasses, functools, json, math
import jax, jax.numpy as jnp, optax
from flax import nnx
from jax.sharding import NamedSharding
from branch_replay_jax import losses as obj
from branch_replay_jax.data.batches import group_arrays  # noqa (old dict batches)
from branch_replay_jax.distributed.mesh import batch_specs, make_mesh, make_train_step, param_specs
from branch_replay_jax.models import Llama
from branch_replay_jax.models.config import ModelConfig, Llama3RopeScaling
cfg = ModelConfig(vocab_size=128256, num_layers=16, d_model=2048, num_heads=32, num_kv_heads=8, head_dim=64, ffn_dim=8192,
                  rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=True, rope_scaling=Llama3RopeScaling(32.0, 1.0, 4.0, 8192),
                  max_positions=1 << 24)
OBJ = functools.partial(obj.grpo_objective, clip_eps=0.2, kl_coef=0.05, on_policy=False)
mesh = make_mesh(1, 8, 1)
graphdef, params = nnx.split(nnx.eval_shape(lambda: Llama(cfg, dtype=jnp.bfloat16, remat="save_kv", rngs=nnx.Rngs(0))))
placed = lambda t, s: jax.tree_util.tree_map(lambda x, sp: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, sp)), t, s)
tx = optax.adamw(1e-6)
G, T, P = 16, 1024, 8192
f = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32); i = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
batch = {"prompt_ids": i(1, P), "prompt_len": i(1), "branches": {"tokens": i(1, G, T), "mask": jax.ShapeDtypeStruct((1, G, T), bool),
         "weights": f(1, G, T), "advantage": f(1, G), "old_logp": f(1, G, T), "ref_logp": f(1, G, T)}}
for layout in ("replicated", "fsdp"):
  with jax.set_mesh(mesh):
    p = placed(params, param_specs(params, mesh, layout))
    o = jax.eval_shape(tx.init, p)
    o = placed(o, param_specs(o, mesh, layout))
    b = placed(batch, batch_specs(batch, mesh))
    m = make_train_step(graphdef, tx, OBJ, mesh, micro_batch=1, logprob_chunk=256).lower(p, o, b).compile().memory_analysis()
  print(json.dumps({"code": "before (5bc3985: gathered at the shard_map boundary)", "params": layout, "P": P,
                    "argument_bytes": m.argument_size_in_bytes, "output_bytes": m.output_size_in_bytes,
                    "temp_bytes": m.temp_size_in_bytes, "peak_estimate_bytes": m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes}), flush=True)
