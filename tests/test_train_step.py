"""The one-device train step (gradients.step.make_train_step, mesh=None): a step's groups stacked
(algorithms.placement.stack_on_device, prompts padded to the longest bucket) and run as ONE jitted
program: a scan over the groups' gradients, their mean and the optax update. Expected values: each
group's own `value_and_grad` (its own prompt bucket, no padding), summed; the padding and the scan
only reorder float sums, so float64 agrees to <= 1e-10 relative (docs/design.md, "Testing")."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import max_rel_err, random_group, tiny_model
from test_replay import grpo_arrays

from branch_replay_jax import losses as obj
from branch_replay_jax.algorithms.placement import stack_on_device
from branch_replay_jax.gradients.heads import POLICY
from branch_replay_jax.gradients.step import compiled_programs, make_train_step, value_and_grad

LENGTHS = [1, 5, 9, 3]
# Off-policy (old_logp != logp), so the clip and the KL both act: the losses' GRPO objective.
OBJECTIVE = functools.partial(obj.grpo_objective, clip_eps=0.2, kl_coef=0.05, on_policy=False)


def groups64(prompts):
  """float64 GRPO groups, one per (prompt_len, prompt_bucket), completions bucketed to 16."""
  return [grpo_arrays(random_group(LENGTHS, seed=s, prompt_len=p, prompt_bucket=b, completion_bucket=16),
                      np.float64, seed=s) for s, (p, b) in enumerate(prompts)]


def test_one_device_step_equals_the_sum_of_per_group_gradients(x64):
  # Three groups with prompts of 11, 21 and 5 tokens in buckets 16, 32 and 16: stacked, every
  # prompt is padded to 32. SGD with momentum 0.9, one step: the momentum trace is the applied
  # gradient, which must be the mean of the per-group gradients taken on the unpadded groups; the
  # per-group losses and KL sums must be theirs; keep=1 returns group 1's own gradient.
  graphdef, params = tiny_model(jnp.float64, jnp.float64)
  groups = groups64([(11, 16), (21, 32), (5, 16)])
  grad = jax.jit(lambda p, a: value_and_grad(POLICY, graphdef, p, a, OBJECTIVE))
  own = [grad(params, a) for a in groups]
  want = jax.tree_util.tree_map(lambda *g: sum(g) / len(g), *[o[2] for o in own])
  assert min(float(jnp.abs(g).max()) for g in jax.tree_util.tree_leaves(want)) > 0   # not vacuous
  tx = optax.sgd(0.1, momentum=0.9)
  step = make_train_step(POLICY, graphdef, tx, OBJECTIVE, reduce_aux=obj.grpo_aux_sums)
  batch = stack_on_device(groups)
  assert batch.prompt_ids.shape == (3, 32)
  _, state, metrics = step(jax.tree_util.tree_map(jnp.copy, params), tx.init(params), batch, len(groups),
                           None, jnp.int32(1))
  assert max_rel_err(state[0].trace, want) <= 1e-10
  assert max_rel_err(metrics["kept_grads"], own[1][2]) <= 1e-10
  np.testing.assert_allclose(metrics["loss"], [float(o[0]) for o in own], rtol=1e-10, atol=1e-12)
  for i in range(2):   # Σ k3 KL (> 0) and Σ clipped per group
    np.testing.assert_allclose(metrics["aux"][i], [float(obj.grpo_aux_sums(o[1])[i]) for o in own], rtol=1e-10)
  assert min(metrics["aux"][0]) > 0
  assert float(metrics["grad_norm"]) == pytest.approx(float(optax.tree.norm(want)), rel=1e-10)


def test_one_program_per_stacked_shape(x64):
  # The step's program depends on the stacked shape only: groups bucketed (16, 16) and (16, 16)
  # again with other tokens and another group count share one program; (16, 32) and (32, 16)
  # both stack to prompts of 32 and share a second. Four steps, two programs (the jit's cache, which
  # the loop logs as step_compiles).
  graphdef, params = tiny_model(jnp.float64, jnp.float64)
  tx = optax.sgd(0.1)
  step = make_train_step(POLICY, graphdef, tx, OBJECTIVE, reduce_aux=obj.grpo_aux_sums)
  state = tx.init(params)
  for prompts, num_groups in [([(11, 16), (9, 16)], 2), ([(5, 16), (13, 16)], 3),
                              ([(11, 16), (21, 32)], 2), ([(30, 32), (7, 16)], 2)]:
    params, state, _ = step(params, state, stack_on_device(groups64(prompts)), num_groups)
  assert compiled_programs(step) == 2
