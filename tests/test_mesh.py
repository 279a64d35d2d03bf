"""Replay under shard_map on 8 fake CPU devices: sharded == single-device replay == naive.

Meshes are data x branch x seq. Expected values: the naive single-device gradient (the prompt
repeated per completion, no sharding), to float32 rounding (<= 1e-5 relative, the issue's bound);
sharding only reorders float sums.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import max_rel_err, random_group, tiny_model
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_replay import grpo_arrays, grpo_objective

from branch_replay_jax import losses as obj
from branch_replay_jax.core.replay import replay_vjp
from branch_replay_jax.data.batches import pad_trees, trajectory_group_arrays, tree_arrays
from branch_replay_jax.data.trees import pad_tree, tree_from_trajectories
from branch_replay_jax.distributed.mesh import (make_mesh, pad_prompts, param_specs, shard_batch, shard_params, stack_groups)
from branch_replay_jax.kernels.context_parallel import over_sharded_prompt, prompt_chunk_attention
from branch_replay_jax.kernels.reference import KVBlock, suffix_attention
from branch_replay_jax.models.llama import REMAT_POLICIES
from branch_replay_jax.gradients.heads import POLICY, Policy
from branch_replay_jax.gradients.step import forward, make_train_step, value_and_grad

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")

MESHES = [(8, 1, 1), (1, 8, 1), (1, 1, 8), (2, 2, 2), (4, 2, 1)]


def test_replicated_weights_gradient_is_summed_once_across_devices():
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


def test_context_parallel_attention_equals_unsharded():
  # A 16-key prompt split 2 keys per device over 8 devices (positions 11..15 padding, so the last
  # chunks have no valid key), then a 4-token branch on top. Expected: suffix_attention on the
  # whole prompt: the loss Σ prompt out² + Σ branch out² and its gradients w.r.t. the prompt's
  # q, k, v. Each device holds its chunk's prompt term and 1/8 of the (replicated) branch term.
  rng = np.random.default_rng(0)
  mesh = make_mesh(1, 1, 8)
  n = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  qp, kp, vp, qb, kb, vb = n(1, 16, 4, 8), n(1, 16, 2, 8), n(1, 16, 2, 8), n(1, 4, 4, 8), n(1, 4, 2, 8), n(1, 4, 2, 8)
  pvalid, bvalid = jnp.arange(16)[None] < 11, jnp.ones((1, 4), bool)

  def loss(attn_prompt, attn_branch, branch_share, qp, kp, vp, pvalid):
    out_p, _ = attn_prompt(qp, [], KVBlock(kp, vp, pvalid))
    out_b, _ = attn_branch(qb, [KVBlock(kp, vp, pvalid)], KVBlock(kb, vb, bvalid))
    return jnp.sum(jnp.where(pvalid[..., None, None], out_p, 0.0) ** 2) + branch_share * jnp.sum(out_b ** 2)
  want, want_grads = jax.value_and_grad(functools.partial(loss, suffix_attention, suffix_attention, 1.0),
                                        argnums=(0, 1, 2))(qp, kp, vp, pvalid)

  def per_device(qp, kp, vp, pvalid):
    f = functools.partial(loss, prompt_chunk_attention(suffix_attention), over_sharded_prompt(suffix_attention), 1 / 8)
    val, grads = jax.value_and_grad(f, argnums=(0, 1, 2))(qp, kp, vp, pvalid)
    return jax.lax.psum(val, "seq"), grads

  spec = P(None, "seq")
  with jax.set_mesh(mesh):
    args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (qp, kp, vp, pvalid)]
    val, grads = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(spec,) * 4, out_specs=(P(), (spec,) * 3),
                                       check_vma=True))(*args)
  assert float(val) == pytest.approx(float(want), rel=1e-6)
  assert max_rel_err(grads, want_grads) <= 1e-5


@pytest.fixture(scope="module")
def reference():
  # Group 3's 21-token prompt is bucketed to 32 tokens, the others' 11 tokens to 16: the mesh
  # step pads every prompt to 32 (pad_prompts), which must leave each group's gradient unchanged.
  graphdef, params = tiny_model()
  groups = [grpo_arrays(random_group([1, 5, 9, 3, 7, 1, 8, 4], seed=s, prompt_len=11 if s < 3 else 21,
                                     prompt_bucket=16 if s < 3 else 32, completion_bucket=16),
                        np.float32, seed=s) for s in range(4)]
  naive = jax.jit(lambda p, a: value_and_grad(POLICY, graphdef, p, a, grpo_objective, layout="naive"))
  replay = jax.jit(lambda p, a: value_and_grad(POLICY, graphdef, p, a, grpo_objective))
  add = lambda a, b: jax.tree_util.tree_map(jnp.add, a, b)
  naive_out = [naive(params, a) for a in groups]
  replay_out = [replay(params, a) for a in groups]
  n_grads = functools.reduce(add, [o[2] for o in naive_out])
  r_grads = functools.reduce(add, [o[2] for o in replay_out])
  assert min(float(jnp.abs(g).max()) for g in jax.tree_util.tree_leaves(n_grads)) > 0   # not vacuous
  naive_aux = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *[o[1] for o in naive_out])   # [4, G] each
  return graphdef, params, groups, sum(float(o[0]) for o in naive_out), n_grads, r_grads, naive_aux


def _sharded(graphdef, params, groups, mesh, mode="replicated", micro_batch=1):
  """(loss / scale, aux of the first 4 groups, grads / scale) on `mesh`; 8 data shards need 8
  groups: the 4 groups twice (scale 2). Prompts are padded to one length first."""
  scale = 2 if mesh.shape["data"] == 8 else 1
  with jax.set_mesh(mesh):
    batch = shard_batch(stack_groups(pad_prompts(groups * scale, mesh.shape["seq"])), mesh)
    loss, aux, grads = jax.jit(lambda p, b: value_and_grad(POLICY, graphdef, p, b, grpo_objective, mesh=mesh,
                                                                          micro_batch=micro_batch))(
        shard_params(params, mesh, mode), batch)
  aux = jax.tree_util.tree_map(lambda x: np.asarray(x)[:len(groups)], aux)
  return float(loss) / scale, aux, jax.tree_util.tree_map(lambda g: g / scale, grads)


# 1x8x1, 4x2x1 and 8x1x1 are heavy (~40-70 s each on one core): CI keeps 1x1x8 (seq) and 2x2x2 (every
# axis, data included).
@pytest.mark.parametrize("shape", [pytest.param(s, marks=pytest.mark.heavy) if s in ((1, 8, 1), (4, 2, 1), (8, 1, 1))
                                   else s
                                   for s in MESHES], ids=["x".join(map(str, s)) for s in MESHES])
def test_sharded_replay_equals_single_device_and_naive(reference, shape):
  graphdef, params, groups, naive_loss, naive_grads, replay_grads, naive_aux = reference
  assert max_rel_err(replay_grads, naive_grads) <= 1e-5
  loss, aux, grads = _sharded(graphdef, params, groups, make_mesh(*shape))
  assert loss == pytest.approx(naive_loss, rel=1e-5, abs=1e-6)
  assert max_rel_err(grads, naive_grads) <= 1e-5
  assert max_rel_err(grads, replay_grads) <= 1e-5
  # The per-completion aux comes back [B, G, ...] in group order: the clipped-token counts
  # exactly, the log-probs [B, G, T] to float32 rounding.
  np.testing.assert_array_equal(aux["clipped"], naive_aux["clipped"])
  np.testing.assert_allclose(aux["logp"], naive_aux["logp"], rtol=1e-5, atol=1e-5)
  assert naive_aux["clipped"].max() > 0   # not vacuous


def test_sharded_replay_with_one_micro_batch_per_device_equals_naive(reference):
  # On 2x2x2 each device holds G / 2 = 4 completions of its group; micro_batch 4 takes replay_vjp's
  # one-step path (no scan), where the all-reduce of the prompt's cotangent over `branch` runs inside
  # the backward pass (a custom_vjp identity, which must type-check under check_vma) and the prompt
  # is split over `seq`. Same bounds as the scan path above: loss, gradient and per-completion aux
  # equal naive's to float32 rounding (1e-5). (The mesh's reduction, psum / n_branch, is idempotent
  # and the final psum is linear, so this cannot count how often it is applied:
  # tests/test_replay.py::test_prefix_cotangent_reduction_is_applied_once does.)
  graphdef, params, groups, naive_loss, naive_grads, _, naive_aux = reference
  loss, aux, grads = _sharded(graphdef, params, groups, make_mesh(2, 2, 2), micro_batch=4)
  assert loss == pytest.approx(naive_loss, rel=1e-5, abs=1e-6)
  assert max_rel_err(grads, naive_grads) <= 1e-5
  np.testing.assert_array_equal(aux["clipped"], naive_aux["clipped"])
  np.testing.assert_allclose(aux["logp"], naive_aux["logp"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 1, 8), (2, 4, 1)], ids=["2x2x2", "1x1x8", "2x4x1"])
def test_sharded_logprobs_equal_single_device(reference, shape):
  # Forward-only replay on the mesh (the training loop's reference and old log-probs): each group's
  # [G, T] log-probs equal policy.replay_logprobs to float32 rounding, 0 on padding.
  graphdef, params, groups = reference[:3]
  want = np.stack([np.asarray(jax.jit(lambda p, a: forward(POLICY, graphdef, p, a))(params, a)) for a in groups])
  mesh = make_mesh(*shape)
  with jax.set_mesh(mesh):
    batch = shard_batch(stack_groups(pad_prompts(groups, mesh.shape["seq"])), mesh)
    got = jax.jit(lambda p, b: forward(POLICY, graphdef, p, b, mesh=mesh))(shard_params(params, mesh), batch)
  assert got.sharding.spec == P("data", "branch", None)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(got)[~np.stack([np.asarray(a.branches.mask) for a in groups])] == 0)


def test_sharded_replay_at_the_sampling_temperature_equals_naive(reference):
  # loss.logprob_temperature = "sampling" on the mesh (algorithms/grpo.py passes τ to every sharded
  # function): log-probs of softmax(logits / τ), τ = 0.7. The sharded gradient equals the naive one at
  # the same τ (float32, <= 1e-5 as above), the sharded forward-only log-probs the naive ones (the
  # objective's aux); and τ acts: they differ from τ = 1's (the reference's aux) by far more than rounding.
  graphdef, params, groups, _, _, _, at_one = reference
  tau = 0.7
  naive = jax.jit(lambda p, a: value_and_grad(Policy(temperature=tau), graphdef, p, a, grpo_objective, layout="naive"))
  outs = [naive(params, a) for a in groups]
  want_loss = sum(float(o[0]) for o in outs)
  want_grads = functools.reduce(lambda a, b: jax.tree_util.tree_map(jnp.add, a, b), [o[2] for o in outs])
  want_lp = np.stack([np.asarray(o[1]["logp"]) for o in outs])
  mesh = make_mesh(2, 2, 2)
  with jax.set_mesh(mesh):
    batch = shard_batch(stack_groups(pad_prompts(groups, mesh.shape["seq"])), mesh)
    sharded = shard_params(params, mesh)
    loss, _, grads = jax.jit(lambda p, b: value_and_grad(Policy(temperature=tau), graphdef, p, b, grpo_objective, mesh=mesh))(sharded, batch)
    lp = jax.jit(lambda p, b: forward(Policy(temperature=tau), graphdef, p, b, mesh=mesh))(sharded, batch)
  assert float(loss) == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
  assert max_rel_err(grads, want_grads) <= 1e-5
  np.testing.assert_allclose(np.asarray(lp), want_lp, rtol=1e-5, atol=1e-5)
  assert np.max(np.abs(want_lp - at_one["logp"])) > 0.1


# offload_kv is heavy: on CPU it is save_kv (host transfers lower as no-ops), which CI runs.
@pytest.mark.parametrize("remat", [pytest.param(r, marks=pytest.mark.heavy) if r == "offload_kv" else r
                                   for r in REMAT_POLICIES if r != "none"])
def test_every_remat_policy_on_a_sequence_sharded_mesh(reference, remat):
  # Rematerialisation recomputes the same operations (collectives included): the naive gradient.
  _, params, groups, naive_loss, naive_grads, _, _ = reference
  graphdef, _ = tiny_model(remat=remat)
  loss, _, grads = _sharded(graphdef, params, groups, make_mesh(2, 2, 2))
  assert loss == pytest.approx(naive_loss, rel=1e-5, abs=1e-6)
  assert max_rel_err(grads, naive_grads) <= 1e-5


def test_fsdp_step_equals_replicated_gradient(reference):
  # SGD with momentum 0.9, one step: the momentum trace equals the gradient and the new parameters
  # are params - 0.1 * gradient, both in the FSDP layout of the parameters.
  graphdef, params, groups, naive_loss, naive_grads, _, _ = reference
  mesh = make_mesh(2, 2, 2)
  tx = optax.sgd(0.1, momentum=0.9)
  with jax.set_mesh(mesh):
    sharded = shard_params(params, mesh, "fsdp")
    opt_state = jax.jit(tx.init)(sharded)
    step = make_train_step(POLICY, graphdef, tx, grpo_objective, mesh=mesh)
    new_params, new_state, metrics = step(sharded, opt_state, shard_batch(stack_groups(pad_prompts(groups)), mesh))
  loss = metrics["loss"]
  specs = param_specs(params, mesh, "fsdp")
  assert jax.tree_util.tree_leaves(specs)[0] == P(("data", "branch", "seq"))   # embed [64, 32]: rows split
  for tree in (new_params, new_state[0].trace):
    same = jax.tree_util.tree_map(lambda x, s: x.sharding.is_equivalent_to(NamedSharding(mesh, s), x.ndim), tree, specs)
    assert all(jax.tree_util.tree_leaves(same))
  assert float(loss) == pytest.approx(naive_loss, rel=1e-5, abs=1e-6)
  assert max_rel_err(new_state[0].trace, naive_grads) <= 1e-5
  want = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, naive_grads)
  assert max_rel_err(new_params, want) <= 1e-6


FSDP_MESHES = [(8, 1, 1), (2, 2, 2), (1, 2, 4)]


# 8x1x1 and 1x2x4 are heavy (~45 s each on loaded cores): CI runs FSDP on 2x2x2, and in float64 on its own test.
@pytest.mark.parametrize("shape", [s if s == (2, 2, 2) else pytest.param(s, marks=pytest.mark.heavy)
                                   for s in FSDP_MESHES], ids=["x".join(map(str, s)) for s in FSDP_MESHES])
def test_fsdp_inside_the_step_equals_naive(reference, shape):
  # FSDP parameters enter the shard_map as shards and are all-gathered layer by layer inside the
  # scan (each shard marked with its models.llama.Gather); their gradients leave reduce-scattered, already in the FSDP
  # layout. Expected: the naive gradient to float32 rounding (<= 1e-5), on a data-only mesh, a
  # 2x2x2 mesh and a sequence-sharded one (seq = 4).
  graphdef, params, groups, naive_loss, naive_grads, _, naive_aux = reference
  mesh = make_mesh(*shape)
  loss, aux, grads = _sharded(graphdef, params, groups, mesh, mode="fsdp")
  assert loss == pytest.approx(naive_loss, rel=1e-5, abs=1e-6)
  assert max_rel_err(grads, naive_grads) <= 1e-5
  np.testing.assert_array_equal(aux["clipped"], naive_aux["clipped"])
  specs = param_specs(params, mesh, "fsdp")
  assert all(s != P() for s in jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P)))  # all split
  same = jax.tree_util.tree_map(lambda g, s: g.sharding.is_equivalent_to(NamedSharding(mesh, s), g.ndim), grads, specs)
  assert all(jax.tree_util.tree_leaves(same))


def test_fsdp_inside_the_step_float64():
  # The same step in float64 on 2x2x2: equal to the naive gradient to 1e-10 (float64 rounding
  # over reordered sums), so the gather / reduce-scatter adds nothing beyond the order of sums.
  with jax.enable_x64(True):
    graphdef, params = tiny_model(jnp.float64, jnp.float64)
    groups = [grpo_arrays(random_group([3, 5, 2, 7], seed=s, prompt_bucket=16, completion_bucket=8), np.float64,
                          seed=s) for s in range(2)]
    naive = jax.jit(lambda p, a: value_and_grad(POLICY, graphdef, p, a, grpo_objective, layout="naive"))
    outs = [naive(params, a) for a in groups]
    naive_grads = jax.tree_util.tree_map(jnp.add, outs[0][2], outs[1][2])
    loss, _, grads = _sharded(graphdef, params, groups, make_mesh(2, 2, 2), mode="fsdp")
    assert loss == pytest.approx(float(outs[0][0] + outs[1][0]), rel=1e-10)
    assert max_rel_err(grads, naive_grads) <= 1e-10
    assert jax.tree_util.tree_leaves(grads)[0].dtype == jnp.float64


@pytest.mark.heavy   # ~2.5 min on loaded cores; bfloat16 parameters in CI: test_train's float32 master test, test_replay's bfloat16 bound
def test_bfloat16_parameters_on_the_fsdp_mesh_error_at_most_twice_naive_error(reference):
  # model.param_dtype = bfloat16: the FSDP step gathers bfloat16 shards and reduce-scatters bfloat16
  # gradients. Reference: the float64 naive gradient at the same (bfloat16-rounded) parameters.
  # flash-attention's rule: the new path's low-precision error is at most 2x the established
  # path's (the one-device naive step on the same bfloat16 parameters and compute dtype).
  _, _, groups, *_ = reference
  graphdef, params = tiny_model(jnp.bfloat16, jnp.bfloat16)
  with jax.enable_x64(True):
    gd64, _ = tiny_model(jnp.float64, jnp.float64)
    p64 = jax.tree_util.tree_map(lambda x: x.astype(jnp.float64), params)
    naive64 = jax.jit(lambda p, a: value_and_grad(POLICY, gd64, p, a, grpo_objective, layout="naive"))
    ref = functools.reduce(lambda a, b: jax.tree_util.tree_map(jnp.add, a, b),
                           [naive64(p64, jax.tree_util.tree_map(lambda x: x.astype(jnp.float64)
                                                                if x.dtype == jnp.float32 else x, a))[2]
                            for a in groups])
    ref = jax.tree_util.tree_map(np.asarray, ref)
  naive = jax.jit(lambda p, a: value_and_grad(POLICY, graphdef, p, a, grpo_objective, layout="naive"))
  g_naive = functools.reduce(lambda a, b: jax.tree_util.tree_map(jnp.add, a, b),
                             [naive(params, a)[2] for a in groups])
  _, _, g_fsdp = _sharded(graphdef, params, groups, make_mesh(2, 2, 2), mode="fsdp")
  assert jax.tree_util.tree_leaves(g_fsdp)[0].dtype == jnp.bfloat16
  err_naive, err_fsdp = max_rel_err(g_naive, ref), max_rel_err(g_fsdp, ref)
  assert err_naive > 1e-3, "bfloat16 must actually round (else this test checks nothing)"
  assert err_fsdp <= 2 * err_naive, (err_fsdp, err_naive)


def test_fsdp_gather_no_double_psum():
  # The over-count trap on the FSDP path: w = ones(8) split over 8 devices, each all-gathers it and
  # computes Σ_j w_j^2 d_i with its own d_i = i. dL/dw_j = 2 w_j Σ_i d_i = 56 for every j, and the
  # all-gather's transpose (a reduce-scatter) already sums over the devices; a psum on top gives
  # 8 x 56 = 448, which is what mesh.py's step must not do for gathered parameters.
  mesh = make_mesh(8, 1)
  axes = ("data", "branch", "seq")

  def per_device(w_local, d_local, extra_psum):
    loss = lambda w: jnp.sum(jax.lax.all_gather(w, axes, axis=0, tiled=True) ** 2) * d_local[0]
    g = jax.grad(loss)(w_local)
    return jax.lax.psum(g, axes) if extra_psum else g

  with jax.set_mesh(mesh):
    w = jax.device_put(jnp.ones(8), NamedSharding(mesh, P(axes)))
    d = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P(axes)))
    for extra, want in ((False, 56.0), (True, 448.0)):
      out_spec = P() if extra else P(axes)
      f = jax.shard_map(functools.partial(per_device, extra_psum=extra), mesh=mesh, in_specs=(P(axes), P(axes)),
                        out_specs=out_spec, check_vma=True)
      got = np.asarray(f(w, d))
      np.testing.assert_array_equal(got, np.full(got.shape, want))


def test_mesh_step_refuses_a_layout_it_cannot_gather(reference):
  # A parameter split over one mesh axis only cannot be gathered by the step: ValueError naming
  # the parameter and its spec, before any compute.
  graphdef, params, groups, *_ = reference
  mesh = make_mesh(2, 2, 2)
  with jax.set_mesh(mesh):
    odd = jax.tree_util.tree_map(lambda x: jax.device_put(x, NamedSharding(mesh, P())), params)
    odd["embed"].set_value(jax.device_put(params["embed"][...], NamedSharding(mesh, P("data"))))
    batch = shard_batch(stack_groups(pad_prompts(groups[:2], 2)), mesh)
    with pytest.raises(ValueError, match="parameter 'embed' has spec"):
      value_and_grad(POLICY, graphdef, odd, batch, grpo_objective, mesh=mesh)


def _random_tree(seed):
  """A prompt of 11 tokens, 4 first-level segments of 3 tokens, each with 2 children of 2-5 tokens."""
  rng = np.random.default_rng(seed)
  heads = [list(rng.integers(0, 64, 3)) for _ in range(4)]
  comps = [h + list(rng.integers(0, 64, 2 + (i + j) % 4)) for i, h in enumerate(heads) for j in range(2)]
  return tree_from_trajectories(list(rng.integers(0, 64, 11)), comps)


def _cut_tree(seed):
  """A tree as EOS leaves it: a prompt of 20 tokens (bucket 32), 3 first-level segments, of which
  two end there (1-2 tokens) and one has 2 children of 9 and 2 tokens (T_2 = 16); G = 4."""
  rng = np.random.default_rng(seed)
  head = list(rng.integers(0, 64, 3))
  comps = [head + list(rng.integers(0, 64, 9)), head + list(rng.integers(0, 64, 2)), [5, 6], [7]]
  return tree_from_trajectories(list(rng.integers(0, 64, 20)), comps)


# heavy (~75 s on one core, four compiles): trees on the mesh stay in CI through
# tests/test_mesh_algorithms.py::test_sharded_actor_critic_trees_equal_single_device (the tree step sharded)
# and tests/test_train.py::test_mesh_tree_run_trains_to_the_same_parameters[2x2x2-fsdp] (the loop).
@pytest.mark.slow
@pytest.mark.heavy
def test_sharded_tree_replay_equals_naive():
  # Two trees of different shapes, a full one (fan-outs 4 x 2, T = (8, 8), G = 8, P_pad = 16) and
  # one cut short by EOS (fan-outs 3 x 2, T = (8, 16), G = 4, P_pad = 32), padded to one layout
  # (pad_trees, pad_prompts), on data=2 x branch=2 (first-level subtrees) x seq=2 (prompt): the
  # naive gradient of all their trajectories, and single-device tree replay. The sharded
  # forward-only log-probs equal single-device tree replay's tree by tree, 0 on the padding. All at
  # the log-prob temperature τ = 0.7 (loss.logprob_temperature = "sampling"), which every sharded
  # tree function passes down (τ = 1 skips the division: the loop's tree runs, tests/test_train.py).
  graphdef, params = tiny_model()
  tau = 0.7
  tree_obj = functools.partial(obj.grpo_objective, clip_eps=0.2, kl_coef=0.05, on_policy=False)
  group_obj = functools.partial(obj.grpo_objective, clip_eps=0.2, kl_coef=0.05, on_policy=False)
  trees, naive_loss, naive_grads, replay_grads = [], 0.0, None, None
  add = lambda a, b: b if a is None else jax.tree_util.tree_map(jnp.add, a, b)
  for seed, tree in enumerate([_random_tree(0), _cut_tree(1)]):
    rng = np.random.default_rng(seed)
    adv = rng.normal(size=len(tree.ends)).astype(np.float32)
    old = [(-4.0 + 0.3 * rng.normal(size=len(s))).astype(np.float32) for s in tree.segments]
    w = obj.trajectory_weights(tree.completion_lengths(), mode="group_token_mean", max_length=16)
    per_node = {"weights": [x.astype(np.float32) for x in tree.node_weights(w)], "old_logp": old, "ref_logp": old}
    trees.append(tree_arrays(pad_tree(tree), per_node, advantage=adv))
    naive = trajectory_group_arrays(tree, {"old_logp": old, "ref_logp": old}, w.astype(np.float32), vocab_size=64,
                                    max_positions=256, completion_bucket=16, advantage=adv)
    loss, _, grads = jax.jit(lambda p, a: value_and_grad(Policy(temperature=tau), graphdef, p, a, group_obj, layout="naive"))(
        params, naive)
    naive_loss, naive_grads = naive_loss + float(loss), add(naive_grads, grads)
    replay_grads = add(replay_grads, jax.jit(lambda p, a: value_and_grad(Policy(temperature=tau), graphdef, p, a, tree_obj))(params, trees[-1])[2])
  assert max_rel_err(replay_grads, naive_grads) <= 1e-5
  padded = pad_trees(trees)
  assert [x.tokens.shape for x in padded[1].levels] == [(4, 8), (4, 2, 16)]
  mesh = make_mesh(2, 2, 2)
  with jax.set_mesh(mesh):
    batch = shard_batch(stack_groups(pad_prompts(padded, mesh.shape["seq"])), mesh)
    sharded = shard_params(params, mesh)
    loss, _, grads = jax.jit(lambda p, b: value_and_grad(Policy(temperature=tau), graphdef, p, b, tree_obj, mesh=mesh))(sharded, batch)
    logprobs = jax.jit(lambda p, b: forward(Policy(temperature=tau), graphdef, p, b, mesh=mesh, micro_batch=2))(sharded, batch)
  assert float(loss) == pytest.approx(naive_loss, rel=1e-5, abs=1e-6)
  assert max_rel_err(grads, naive_grads) <= 1e-5
  for b, tree in enumerate(trees):
    want = jax.jit(lambda p, a: forward(Policy(temperature=tau), graphdef, p, a))(params, tree)
    for got, level in zip(logprobs, want):
      got = np.array(got)[b]
      corner = tuple(slice(0, n) for n in level.shape)
      assert max_rel_err(got[corner], level) <= 1e-5, b
      got[corner] = 0.0
      assert not got.any(), b   # padding log-probs are 0


def test_make_mesh_and_placement_reject_bad_shapes():
  with pytest.raises(ValueError, match="must equal the device count 8"):
    make_mesh(2, 2)
  with pytest.raises(ValueError, match="branch=0"):
    make_mesh(8, 0)
  with pytest.raises(ValueError, match="different shapes"):
    stack_groups([grpo_arrays(random_group([2, 3]), np.float32), grpo_arrays(random_group([2, 30]), np.float32)])
  odd_prompt = stack_groups([grpo_arrays(random_group([2, 3], prompt_bucket=12), np.float32)])
  with pytest.raises(ValueError, match=r"batch.prompt_ids: axis 1 has size 12, not divisible by seq=8"):
    shard_batch(odd_prompt, make_mesh(1, 1, 8))
  with pytest.raises(ValueError, match=r"batch.branches: axis 1 has size 2, not divisible by branch=8"):
    shard_batch(odd_prompt, make_mesh(1, 8, 1))
  # pad_prompts rounds the 12-token bucket up to seq's multiple, 16; it refuses an empty list.
  padded = stack_groups(pad_prompts([grpo_arrays(random_group([2, 3], prompt_bucket=12), np.float32)], 8))
  assert padded.prompt_ids.shape == (1, 16)
  with pytest.raises(ValueError, match="0 groups"):
    pad_prompts([])
  with pytest.raises(ValueError, match="mode='zero3'"):
    param_specs({"w": jnp.zeros(8)}, make_mesh(8, 1), "zero3")


def test_documented_optimizer_state_creation(reference):
  # make_train_step's docstring: on the Explicit-axis mesh the optimizer state comes from
  # jax.jit(tx.init) inside jax.set_mesh, or from shard_params of an unsharded init (the loop's
  # way). Both give the parameters' FSDP shardings and the same step: SGD with momentum 0.9, one
  # step, so the momentum trace equals the naive gradient (as test_fsdp_step_equals_replicated_gradient).
  graphdef, params, groups, _, naive_grads, _, _ = reference
  mesh = make_mesh(2, 2, 2)
  tx = optax.sgd(0.1, momentum=0.9)
  specs = param_specs(params, mesh, "fsdp")
  with jax.set_mesh(mesh):
    sharded = shard_params(params, mesh, "fsdp")
    states = {"jit inside set_mesh": jax.jit(tx.init)(sharded),
              "sharded init (loop)": shard_params(tx.init(params), mesh, "fsdp")}
    step = make_train_step(POLICY, graphdef, tx, grpo_objective, mesh=mesh)
    batch = shard_batch(stack_groups(pad_prompts(groups)), mesh)
    for name, opt_state in states.items():
      same = jax.tree_util.tree_map(lambda x, s: x.sharding.is_equivalent_to(NamedSharding(mesh, s), x.ndim),
                                    opt_state[0].trace, specs)
      assert all(jax.tree_util.tree_leaves(same)), name
      _, new_state, _ = step(shard_params(params, mesh, "fsdp"), opt_state, batch)   # the step donates its params
      assert max_rel_err(new_state[0].trace, naive_grads) <= 1e-5, name
  # What the docstring warns about: the same call without a current mesh (JAX 0.10: "Length of
  # device assignment 1 is not equal to the size of the mesh 8 ... enter your `jit` into a mesh
  # context via `jax.set_mesh`").
  with pytest.raises(ValueError, match="jax.set_mesh"):
    jax.jit(tx.init)(shard_params(params, mesh, "fsdp"))
