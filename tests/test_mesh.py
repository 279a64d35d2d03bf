"""Replay under shard_map on 8 fake CPU devices: sharded == single-device replay == naive."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import max_rel_err, random_group, tiny_model
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_replay import grpo_arrays, grpo_objective

from branch_replay_jax.policy import naive_value_and_grad, replay_value_and_grad
from branch_replay_jax.replay import replay_vjp
from branch_replay_jax.sharding import make_mesh, shard_batch, sharded_replay_value_and_grad, stack_groups

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")


def test_c15_no_double_psum():
  # loss(w) = Σ_i (w^2 + 1) d_i with d = arange(8) over 8 devices, w = 1 replicated:
  # loss = 2 * 28 = 56 and dL/dw = 2 w Σ d = 56 -- unsharded, sharded and replayed.
  # A gradient of 448 (8 x 56) would be the double psum of jax-ml/jax #3970.
  mesh = make_mesh(8, 1)
  d = jnp.arange(8.0)
  loss = lambda w, d: jnp.sum((w ** 2 + 1) * d)
  assert float(loss(1.0, d)) == 56.0 and float(jax.grad(loss)(1.0, d)) == 56.0

  def per_device(w, d):
    local = jax.lax.pcast(w, ("data", "branch"), to="varying")   # as sharding.py does
    return jax.lax.psum(jax.grad(loss)(local, d), ("data", "branch"))

  with jax.set_mesh(mesh):
    d_sharded = jax.device_put(d, NamedSharding(mesh, P("data")))
    sharded = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), check_vma=True)
    assert float(sharded(jnp.float32(1.0), d_sharded)) == 56.0

  replayed_loss, _, grads = replay_vjp(lambda w: w ** 2 + 1, lambda w, h, di: (h * di, None), jnp.float32(1.0), d)
  assert float(replayed_loss) == 56.0 and float(grads) == 56.0


@pytest.fixture(scope="module")
def reference():
  graphdef, params = tiny_model()
  groups = [grpo_arrays(random_group([1, 5, 9, 3, 7, 1, 8, 4], seed=s, prompt_bucket=16, completion_bucket=16),
                        np.float32, seed=s) for s in range(4)]
  naive = jax.jit(lambda p, a: naive_value_and_grad(graphdef, p, a, grpo_objective))
  replay = jax.jit(lambda p, a: replay_value_and_grad(graphdef, p, a, grpo_objective))
  add = lambda a, b: jax.tree_util.tree_map(jnp.add, a, b)
  naive_out = [naive(params, a) for a in groups]
  replay_out = [replay(params, a) for a in groups]
  n_grads = naive_out[0][2]
  r_grads = replay_out[0][2]
  for out in naive_out[1:]:
    n_grads = add(n_grads, out[2])
  for out in replay_out[1:]:
    r_grads = add(r_grads, out[2])
  return graphdef, params, groups, sum(float(o[0]) for o in naive_out), n_grads, r_grads


@pytest.mark.parametrize("data,branch", [(8, 1), (1, 8), (2, 4), (4, 2)])
def test_sharded_replay_equals_single_device_and_naive(reference, data, branch):
  graphdef, params, groups, naive_loss, naive_grads, replay_grads = reference
  assert max_rel_err(replay_grads, naive_grads) <= 1e-5
  mesh = make_mesh(data, branch)
  with jax.set_mesh(mesh):
    batch = shard_batch(stack_groups(groups * (2 if data == 8 else 1)), mesh)
    loss, grads = jax.jit(lambda p, b: sharded_replay_value_and_grad(graphdef, p, b, grpo_objective, mesh))(
        params, batch)
  scale = 2 if data == 8 else 1   # 8 data shards need 8 groups: the 4 groups twice
  assert float(loss) == pytest.approx(scale * naive_loss, rel=1e-5, abs=1e-6)
  assert max_rel_err(jax.tree_util.tree_map(lambda g: g / scale, grads), naive_grads) <= 1e-5


def test_make_mesh_rejects_bad_shapes():
  with pytest.raises(ValueError, match="must equal the device count 8"):
    make_mesh(2, 2)
  with pytest.raises(ValueError, match="seq=2"):
    make_mesh(2, 2, 2)
  with pytest.raises(ValueError, match="branch=0"):
    make_mesh(8, 0)
  with pytest.raises(ValueError, match="different shapes"):
    stack_groups([grpo_arrays(random_group([2, 3]), np.float32), grpo_arrays(random_group([2, 30]), np.float32)])
