"""Seconds per mesh step for each algorithm (GRPO, PPO, DPO) and data x branch x seq mesh, on 8 fake CPU devices.

    nice -n 15 python -m branch_replay_jax.benchmarks.mesh --config=experiments/bench_mesh.py      # tiny random model
    nice -n 15 python -m branch_replay_jax.benchmarks.mesh --config=experiments/bench_mesh.py \\
        --config.model=random-smollm2-shape --config.prompt_len=128

A functional check, not a speed-up: the 8 fake devices share the host's cores. Prints one JSON
line per algorithm and mesh (the first mesh, "1x1x1", is one device): `compile_seconds` sums JAX's
compile events of the first call (`/jax/core/compile/*`), `step_seconds` is the median of
`config.repeats` later calls (each ended by `block_until_ready`), `max_rel_grad_err` is max over
parameter leaves of max|g - g_1x1x1| / max|g_1x1x1| against the one-device mesh. Each step is
one update's gradient work on `config.groups` groups of G = `config.group_size` random completions
of `config.completion_len` tokens on a random `config.prompt_len`-token prompt:

  grpo: the GRPO gradient (`gradients.step.value_and_grad`, the Policy head);
  ppo:  the PPO gradient of policy and value head (the ActorCritic head, an
        `ActorCritic` with a value head), random GAE advantages and returns per token;
  dpo:  the G / 2 pairs (2i, 2i + 1) of each group, completions of `completion_len` / 2 to
        `completion_len` tokens, the policy as its own reference, through `gradients.preference.ReplaySteps` on the mesh:
        layout (`pad_groups`), reference sums, policy sums and the surrogate gradient (three
        jitted calls and host-side padding: its step includes host work).

`token_positions_naive` = groups x G x (P + T).

The model's compute dtype, remat policy and attention (`config.dtype`, `config.remat`,
`config.attention_impl`: on a GPU "pallas" runs the Triton kernels inside the step's shard_map)
are the config's. With `config.one_device` (grpo and ppo), the first row is the one-device step
(`mesh` "one_device": `value_and_grad` without a mesh, the groups summed in one jitted call, the fused
replay wherever it applies: `one_device_fused`) and every mesh row's `max_rel_grad_err` and
`loss_rel_diff` are against it: the mesh code path on one GPU (mesh "1x1x1") against the step a
single device runs. `config.output` also appends the lines to a file.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import functools  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402
from flax import nnx  # noqa: E402

import jax.numpy as jnp  # noqa: E402

from branch_replay_jax import losses as obj  # noqa: E402
from branch_replay_jax.benchmarks.replay import emitter, timing_lock  # noqa: E402
from branch_replay_jax.data.batches import RolloutBatch, group_arrays  # noqa: E402
from branch_replay_jax.data.groups import make_group  # noqa: E402
from branch_replay_jax.distributed.mesh import make_mesh, shard_batch, shard_params, stack_groups  # noqa: E402
from branch_replay_jax.gradients import preference as pref  # noqa: E402
from branch_replay_jax.gradients.heads import ACTOR_CRITIC, POLICY  # noqa: E402
from branch_replay_jax.gradients.step import fused_applies, value_and_grad  # noqa: E402
from branch_replay_jax.models import Llama, ModelConfig, tiny_config  # noqa: E402
from branch_replay_jax.models.config import architecture_shape  # noqa: E402
from branch_replay_jax.models.critic import ActorCritic  # noqa: E402

SMOLLM2_135M_SHAPE = architecture_shape("smollm2-135m")   # random weights of the embedded model's shape
MESHES = "1x1x1,8x1x1,1x8x1,1x1x8,2x2x2,4x2x1"
ALGORITHMS = ("grpo", "ppo", "dpo")
OBJECTIVE = functools.partial(obj.grpo_objective, clip_eps=0.2, kl_coef=0.05, on_policy=False)
PPO_OBJECTIVE = functools.partial(obj.ppo_objective, clip_eps=0.2, vf_coef=0.5, value_clip=0.2)

_compile_seconds = [0.0]


def _on_event(name, seconds, **_):
  if name.startswith("/jax/core/compile/"):
    _compile_seconds[0] += seconds


def random_groups(config: ModelConfig, groups: int, g: int, p: int, t: int, rng):
  """`groups` rollout groups of random tokens (prompt p tokens, g completions of t tokens), made one
  at a time as the caller iterates: its own draws from `rng` for a group come before the next one's."""
  for _ in range(groups):
    yield make_group(rng.integers(0, config.vocab_size, p), [rng.integers(0, config.vocab_size, t) for _ in range(g)],
                     vocab_size=config.vocab_size, max_positions=config.max_positions, prompt_bucket=p,
                     completion_bucket=t)


def make_batch(config: ModelConfig, groups: int, g: int, p: int, t: int) -> list[RolloutBatch]:
  """`groups` GRPO groups of random tokens: prompt p tokens, g completions of t tokens."""
  rng = np.random.default_rng(0)
  out = []
  for group in random_groups(config, groups, g, p, t, rng):
    out.append(group_arrays(group, weights=obj.token_weights(group.lengths, t, mode="sequence_mean"),
                            advantage=rng.normal(size=g).astype(np.float32),
                            old_logp=(-4.0 + 0.3 * rng.normal(size=(g, t))).astype(np.float32),
                            ref_logp=(-4.0 + 0.3 * rng.normal(size=(g, t))).astype(np.float32)))
  return out


def ppo_batch(config: ModelConfig, groups: int, g: int, p: int, t: int) -> list[RolloutBatch]:
  """`groups` PPO groups of random tokens: per-token weights, GAE advantages, returns, old log-probs and values."""
  rng = np.random.default_rng(1)
  out = []
  for group in random_groups(config, groups, g, p, t, rng):
    out.append(group_arrays(group, weights=obj.token_weights(group.lengths, t, mode="group_token_mean"),
                            **{k: (rng.normal(size=(g, t)) + (-4.0 if k == "old_logp" else 0.0)).astype(np.float32)
                               for k in ("advantage", "returns", "old_logp", "old_values")}))
  return out


def dpo_batch(config: ModelConfig, groups: int, g: int, p: int, t: int) -> pref.PreferenceBatch:
  """Pairs (2i, 2i + 1) of g random completions of t / 2 .. t tokens on each of `groups` random prompts."""
  rng = np.random.default_rng(2)
  pairs = []
  for _ in range(groups):
    prompt = rng.integers(0, config.vocab_size, p)
    comps = [rng.integers(0, config.vocab_size, rng.integers(max(t // 2, 1), t + 1)) for _ in range(g)]
    pairs += [pref.PreferencePair(prompt, comps[i], comps[i + 1]) for i in range(0, g - 1, 2)]
  return pref.make_batch(pairs, vocab_size=config.vocab_size, max_positions=config.max_positions)


def mesh_step(algorithm: str, graphdef, params, batch, mesh, micro_batch: int):
  """A zero-argument call of one step of `algorithm` on `mesh` -> (loss, grads); placement done here, once."""
  placed = shard_params(params, mesh)
  if algorithm == "dpo":
    steps = pref.ReplaySteps(graphdef, mesh=mesh, micro_batch=micro_batch)

    def dpo():
      layout = steps.layout(batch)
      loss, _, grads = steps.value_and_grad(placed, layout, steps.flat_sums(placed, layout), beta=0.1)
      return loss, grads
    return dpo
  head, objective = (ACTOR_CRITIC, PPO_OBJECTIVE) if algorithm == "ppo" else (POLICY, OBJECTIVE)
  stacked = shard_batch(stack_groups(batch), mesh)
  step = jax.jit(lambda p, b: value_and_grad(head, graphdef, p, b, objective, mesh=mesh, micro_batch=micro_batch))

  def grad_step():
    loss, _, grads = step(placed, stacked)
    return loss, grads
  return grad_step


def one_device_step(algorithm: str, graphdef, params, batch: list[RolloutBatch], micro_batch: int):
  """A zero-argument call of the one-device step of `algorithm` (grpo or ppo) on the groups ->
  (loss, grads): `value_and_grad` without a mesh per group, summed, in one jitted call (the mesh
  step's loss and gradients are these sums)."""
  head, objective = (ACTOR_CRITIC, PPO_OBJECTIVE) if algorithm == "ppo" else (POLICY, OBJECTIVE)

  def total(p, groups):
    out = [value_and_grad(head, graphdef, p, g, objective, micro_batch=micro_batch) for g in groups]
    grads = jax.tree_util.tree_map(lambda *x: sum(x[1:], x[0]), *[o[2] for o in out])
    return sum(o[0] for o in out[1:]) + out[0][0], grads
  step = jax.jit(total)
  placed = jax.device_put((params, batch), jax.devices()[0])
  return lambda: step(*placed)


def time_step(step, repeats: int):
  """(compile_seconds, step_seconds, loss, grads) of a zero-argument step: the first call compiles."""
  _compile_seconds[0] = 0.0
  loss, grads = jax.block_until_ready(step())
  compile_s = _compile_seconds[0]
  times = []
  with timing_lock(os.environ.get("BENCH_TIMING_LOCK", "")):   # processes sharing one device time one at a time
    for _ in range(repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(step())
      times.append(time.perf_counter() - t0)
  return compile_s, statistics.median(times), float(loss), jax.device_get(grads)


def run_mesh(algorithm: str, graphdef, params, batch, shape, repeats: int, micro_batch: int):
  """(compile_seconds, step_seconds, loss, grads) of one algorithm's step on one mesh shape."""
  mesh = make_mesh(*shape, devices=jax.devices()[:int(np.prod(shape))])
  with jax.set_mesh(mesh):
    return time_step(mesh_step(algorithm, graphdef, params, batch, mesh, micro_batch), repeats)


def case(algorithm: str, config: ModelConfig, args):
  """(graphdef, params, batch) of one algorithm: the model (an actor-critic with a random value
  head for PPO) and its step's groups (DPO: a PreferenceBatch)."""
  model = Llama(config, dtype=jnp.dtype(args.dtype), remat=args.remat, attention_impl=args.attention_impl,
                rngs=nnx.Rngs(0))
  shape = (args.groups, args.group_size, args.prompt_len, args.completion_len)
  if algorithm == "ppo":
    model = ActorCritic(model, critic="value_head")
    model.value_w[...] = 0.1 * jax.random.normal(jax.random.key(1), model.value_w.shape)   # non-zero value gradients
    graphdef, params = nnx.split(model)
    return graphdef, params, ppo_batch(config, *shape)
  graphdef, params = nnx.split(model)
  return graphdef, params, dpo_batch(config, *shape) if algorithm == "dpo" else make_batch(config, *shape)


def main(argv):
  del argv
  args = flags.FLAGS.config
  if args.model not in ("tiny", "random-smollm2-shape"):
    raise ValueError(f"config.model={args.model!r} is not one of ('tiny', 'random-smollm2-shape')")
  jax.monitoring.register_event_duration_secs_listener(_on_event)

  algorithms = args.algorithms.split(",")
  if any(a not in ALGORITHMS for a in algorithms):
    raise ValueError(f"config.algorithms={args.algorithms!r}: each must be one of {ALGORITHMS}")
  if args.one_device and "dpo" in algorithms:
    raise ValueError(f"config.one_device=True with config.algorithms={args.algorithms!r}: the one-device baseline "
                     "is grpo's and ppo's (value_and_grad); leave dpo out")
  config = tiny_config() if args.model == "tiny" else SMOLLM2_135M_SHAPE
  emit = emitter(args.output)
  for algorithm in algorithms:
    graphdef, params, batch = case(algorithm, config, args)
    runs = [("one_device", None)] if args.one_device else []
    runs += [(text, tuple(int(x) for x in text.split("x"))) for text in args.meshes.split(",")]
    base = None
    for text, shape in runs:
      if shape is None:
        compile_s, step_s, loss, grads = time_step(
            one_device_step(algorithm, graphdef, params, batch, args.micro_batch), args.repeats)
      else:
        compile_s, step_s, loss, grads = run_mesh(algorithm, graphdef, params, batch, shape, args.repeats,
                                                  args.micro_batch)
      base = (text, loss, grads) if base is None else base
      err = max(float(np.abs(np.asarray(g, np.float64) - b).max() / max(np.abs(np.asarray(b, np.float64)).max(), 1e-30))
                for g, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(base[2])))
      row = {"kind": "mesh", "algorithm": algorithm, "mesh": text, "data": shape and shape[0],
             "branch": shape and shape[1], "seq": shape and shape[2],
             "model": args.model, "dtype": args.dtype, "remat": args.remat, "attention_impl": args.attention_impl,
             "groups": args.groups, "group_size": args.group_size,
             "prompt_len": args.prompt_len, "completion_len": args.completion_len, "micro_batch": args.micro_batch,
             "token_positions_naive": args.groups * args.group_size * (args.prompt_len + args.completion_len),
             "compile_seconds": round(compile_s, 2), "step_seconds": step_s, "loss": loss,
             "baseline": base[0], "max_rel_grad_err": err,
             "loss_rel_diff": abs(loss - base[1]) / max(abs(base[1]), 1e-30),
             "devices": jax.device_count(), "backend": jax.default_backend()}
      if shape is None:
        row["one_device_fused"] = fused_applies(batch[0], micro_batch=args.micro_batch)
      emit(row)


if __name__ == "__main__":
  # Flags are defined only when run as a program, so that the benchmarks can be imported together.
  config_flags.DEFINE_config_file("config", "experiments/bench_mesh.py", "Benchmark config.")
  app.run(main)
