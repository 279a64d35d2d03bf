"""Seconds per replay gradient step for each data x branch x seq mesh, on 8 fake CPU devices.

    nice -n 15 python -m branch_replay_jax.benchmarks.mesh --config=experiments/bench_mesh.py      # tiny random model
    nice -n 15 python -m branch_replay_jax.benchmarks.mesh --config=experiments/bench_mesh.py \\
        --config.model=random-smollm2-shape --config.prompt_len=128

A functional check, not a speed-up: the 8 fake devices share the host's cores. Prints one JSON
line per mesh (the first, "1x1x1", is one device): `compile_seconds` sums JAX's compile events
of the first call (`/jax/core/compile/*`), `step_seconds` is the median of `config.repeats` later
calls (each ended by `block_until_ready`), `max_rel_grad_err` is max over parameter leaves of
max|g - g_1x1x1| / max|g_1x1x1| against the one-device mesh. One GRPO step on `config.groups` groups
of G = `config.group_size` random completions of `config.completion_len` tokens on a random
`config.prompt_len`-token prompt; `token_positions_naive` = groups x G x (P + T).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import functools  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402
from flax import nnx  # noqa: E402

from branch_replay_jax import losses as obj  # noqa: E402
from branch_replay_jax.data.batches import GroupBatch, group_arrays  # noqa: E402
from branch_replay_jax.data.groups import make_group  # noqa: E402
from branch_replay_jax.distributed.mesh import (make_mesh, shard_batch, shard_params, sharded_replay_value_and_grad,  # noqa: E402
                                        stack_groups)
from branch_replay_jax.models import Llama, ModelConfig, tiny_config  # noqa: E402
from branch_replay_jax.models.config import architecture_shape  # noqa: E402

SMOLLM2_135M_SHAPE = architecture_shape("smollm2-135m")   # random weights of the embedded model's shape
MESHES = "1x1x1,8x1x1,1x8x1,1x1x8,2x2x2,4x2x1"
OBJECTIVE = functools.partial(obj.grpo_objective, clip_eps=0.2, kl_coef=0.05, on_policy=False)

_compile_seconds = [0.0]


def _on_event(name, seconds, **_):
  if name.startswith("/jax/core/compile/"):
    _compile_seconds[0] += seconds


def make_batch(config: ModelConfig, groups: int, g: int, p: int, t: int) -> list[GroupBatch]:
  """`groups` GRPO groups of random tokens: prompt p tokens, g completions of t tokens."""
  rng = np.random.default_rng(0)
  out = []
  for _ in range(groups):
    group = make_group(rng.integers(0, config.vocab_size, p), [rng.integers(0, config.vocab_size, t) for _ in range(g)],
                       vocab_size=config.vocab_size, max_positions=config.max_positions, prompt_bucket=p,
                       completion_bucket=t)
    out.append(group_arrays(group, weights=obj.token_weights(group.lengths, t, mode="sequence_mean"),
                            advantage=rng.normal(size=g).astype(np.float32),
                            old_logp=(-4.0 + 0.3 * rng.normal(size=(g, t))).astype(np.float32),
                            ref_logp=(-4.0 + 0.3 * rng.normal(size=(g, t))).astype(np.float32)))
  return out


def run_mesh(graphdef, params, groups, shape, repeats: int, micro_batch: int):
  """(compile_seconds, step_seconds, loss, grads) of one mesh shape."""
  mesh = make_mesh(*shape, devices=jax.devices()[:int(np.prod(shape))])
  with jax.set_mesh(mesh):
    batch = shard_batch(stack_groups(groups), mesh)
    placed = shard_params(params, mesh)
    step = jax.jit(lambda p, b: sharded_replay_value_and_grad(graphdef, p, b, OBJECTIVE, mesh, micro_batch=micro_batch))
    _compile_seconds[0] = 0.0
    loss, _, grads = jax.block_until_ready(step(placed, batch))
    compile_s = _compile_seconds[0]
    times = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(step(placed, batch))
      times.append(time.perf_counter() - t0)
  return compile_s, statistics.median(times), float(loss), jax.device_get(grads)


def main(argv):
  del argv
  args = flags.FLAGS.config
  if args.model not in ("tiny", "random-smollm2-shape"):
    raise ValueError(f"config.model={args.model!r} is not one of ('tiny', 'random-smollm2-shape')")
  jax.monitoring.register_event_duration_secs_listener(_on_event)

  config = tiny_config() if args.model == "tiny" else SMOLLM2_135M_SHAPE
  graphdef, params = nnx.split(Llama(config, rngs=nnx.Rngs(0)))
  groups = make_batch(config, args.groups, args.group_size, args.prompt_len, args.completion_len)
  base = None
  for text in args.meshes.split(","):
    shape = tuple(int(x) for x in text.split("x"))
    compile_s, step_s, loss, grads = run_mesh(graphdef, params, groups, shape, args.repeats, args.micro_batch)
    base = grads if base is None else base
    err = max(float(np.abs(g - b).max() / max(np.abs(b).max(), 1e-30))
              for g, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(base)))
    print(json.dumps({"mesh": text, "data": shape[0], "branch": shape[1], "seq": shape[2], "model": args.model,
                      "groups": args.groups, "group_size": args.group_size, "prompt_len": args.prompt_len,
                      "completion_len": args.completion_len, "micro_batch": args.micro_batch,
                      "token_positions_naive": args.groups * args.group_size * (args.prompt_len + args.completion_len),
                      "compile_seconds": round(compile_s, 2), "step_seconds": round(step_s, 4), "loss": loss,
                      "max_rel_grad_err": err, "devices": jax.device_count(), "backend": jax.default_backend()}),
          flush=True)


if __name__ == "__main__":
  # Flags are defined only when run as a program, so that the benchmarks can be imported together.
  config_flags.DEFINE_config_file("config", "experiments/bench_mesh.py", "Benchmark config.")
  app.run(main)
