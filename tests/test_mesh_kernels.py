"""The Pallas (Triton) suffix-attention kernels inside the mesh step's `shard_map(check_vma=True)`.

On the 8 fake CPU devices the kernels run in the Pallas interpreter (inside shard_map each device
interprets its own call from gathered operands: kernels/pallas_attention.py, `_interpret_per_device`);
on a GPU the same pallas_calls lower to Triton with their outputs' mesh-varying types stated
(kernels/vma.py). Expected values: the same computation with the jnp attention (the reference, or
attention_impl="xla" in the same mesh step on the same parameters and batch), to float32 rounding
(<= 1e-5 relative, the issue's bound): the two attentions differ only in the order of their sums.
A kernel output typed invariant when it varies would have its cotangent summed over the mesh (an
O(1) error), and a missing type does not trace at all (the error JAX raises since 0.10).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import grpo_smoke, max_rel_err, random_group
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_replay import grpo_arrays, grpo_objective

from branch_replay_jax import losses as obj
from branch_replay_jax.algorithms import checks
from branch_replay_jax.data.batches import group_arrays, tree_arrays
from branch_replay_jax.data.trees import pad_tree, tree_from_trajectories
from branch_replay_jax.distributed.mesh import make_mesh, pad_prompts, shard_batch, shard_params, stack_groups
from branch_replay_jax.gradients.heads import ACTOR_CRITIC, POLICY
from branch_replay_jax.gradients.step import value_and_grad
from branch_replay_jax.kernels import KVBlock, suffix_attention, suffix_attention_pallas
from branch_replay_jax.kernels.context_parallel import over_sharded_prompt, prompt_chunk_attention
from branch_replay_jax.models import Llama, tiny_config
from branch_replay_jax.models.critic import ActorCritic

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")

HEAD_DIM = 16   # the smallest head dim the Triton kernels take (pallas_attention.HEAD_DIMS)


def test_kernels_lower_to_triton_inside_the_mesh_shard_map():
  # The gradient of the kernel inside shard_map(check_vma=True) over a 2 x 2 x 2 mesh, lowered for
  # CUDA (the Pallas Triton lowering runs here; only Triton's compile to PTX needs a GPU): forward,
  # dQ and one dK/dV per KV block, 4 Triton calls. The queries vary over data and branch, the shared
  # ancestor block is invariant (cast inside, its gradient summed over the mesh by the cast's transpose).
  mesh = make_mesh(2, 2, 2)
  sds = lambda shape, spec: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))
  rows, shared = P(("data", "branch")), P()

  def loss(q, ka, va, ko, vo):
    out, lse = suffix_attention_pallas(q, [KVBlock(ka, va, jnp.ones((1, ka.shape[1]), bool))],
                                       KVBlock(ko, vo, jnp.ones(ko.shape[:2], bool)), interpret=False)
    return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)

  def per_device(*args):
    val, grads = jax.value_and_grad(loss, argnums=range(5))(*args)
    return jax.lax.psum(val, ("data", "branch")), grads

  specs = (rows, shared, shared, rows, rows)
  f = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=specs, out_specs=(P(), specs), check_vma=True))
  q, ka, ko = sds((8, 1, 8, 64), rows), sds((1, 40, 1, 64), shared), sds((8, 1, 1, 64), rows)
  lowered = f.trace(q, ka, ka, ko, ko).lower(lowering_platforms=("cuda",))
  assert lowered.as_text().count("custom_call @__gpu$xla.gpu.triton") == 4


def test_context_parallel_kernels_equal_the_reference_unsharded():
  # A 16-key prompt split 2 keys per device over seq = 8 (positions 11..15 padding, so the last
  # chunks have no valid key), two 4-token branches on top (replicated over seq). The prompt's
  # forward is prompt_chunk_attention, the branches' over_sharded_prompt, both around the Pallas
  # kernel. Expected: the jnp reference on the whole prompt, unsharded: the loss Σ prompt out² +
  # Σ branch out² and its gradients w.r.t. the prompt's q, k, v and the branches' q. Each device
  # holds its chunk's prompt term and 1/8 of the branch term.
  rng = np.random.default_rng(0)
  mesh = make_mesh(1, 1, 8)
  n = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  qp, kp, vp = n(1, 16, 4, HEAD_DIM), n(1, 16, 2, HEAD_DIM), n(1, 16, 2, HEAD_DIM)
  qb, kb, vb = n(2, 4, 4, HEAD_DIM), n(2, 4, 2, HEAD_DIM), n(2, 4, 2, HEAD_DIM)
  pvalid, bvalid = jnp.arange(16)[None] < 11, jnp.ones((2, 4), bool)

  def loss(attn_prompt, attn_branch, branch_share, qp, kp, vp, pvalid, qb):
    out_p, _ = attn_prompt(qp, [], KVBlock(kp, vp, pvalid))
    out_b, _ = attn_branch(qb, [KVBlock(kp, vp, pvalid)], KVBlock(kb, vb, bvalid))
    return jnp.sum(jnp.where(pvalid[..., None, None], out_p, 0.0) ** 2) + branch_share * jnp.sum(out_b ** 2)
  want, want_grads = jax.value_and_grad(functools.partial(loss, suffix_attention, suffix_attention, 1.0),
                                        argnums=(0, 1, 2, 4))(qp, kp, vp, pvalid, qb)

  def per_device(qp, kp, vp, pvalid, qb):
    f = functools.partial(loss, prompt_chunk_attention(suffix_attention_pallas),
                          over_sharded_prompt(suffix_attention_pallas), 1 / 8)
    # qb enters invariant (P()): its gradient comes back summed over seq already (the implicit
    # psum of check_vma; docs/design.md, "Pitfalls").
    val, grads = jax.value_and_grad(f, argnums=(0, 1, 2, 4))(qp, kp, vp, pvalid, qb)
    return jax.lax.psum(val, "seq"), grads

  spec = P(None, "seq")
  with jax.set_mesh(mesh):
    args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (qp, kp, vp, pvalid)]
    qb_placed = jax.device_put(qb, NamedSharding(mesh, P()))
    val, grads = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(spec,) * 4 + (P(),),
                                       out_specs=(P(), (spec,) * 3 + (P(),)), check_vma=True))(*args, qb_placed)
  assert float(val) == pytest.approx(float(want), rel=1e-5)
  assert max_rel_err(grads, want_grads) <= 1e-5


def _policy(impl, seed=0):
  """(graphdef, params) of the tiny model (head dim 16) with suffix attention `impl`."""
  return nnx.split(Llama(tiny_config(head_dim=HEAD_DIM), attention_impl=impl, rngs=nnx.Rngs(seed)))


def _actor_critic(impl, seed=0):
  """(graphdef, params) of the tiny actor-critic (value head on the policy's trunk) with a random
  value head (the real one starts at zero, and the value loss would not reach the trunk)."""
  ac = ActorCritic(Llama(tiny_config(head_dim=HEAD_DIM), attention_impl=impl, rngs=nnx.Rngs(seed)),
                   critic="value_head")
  ac.value_w[...] = 0.5 * jax.random.normal(jax.random.key(seed + 1), ac.value_w.shape, ac.value_w.dtype)
  ac.value_b[...] = jnp.asarray(0.3)
  return nnx.split(ac)


def _both(build, head, units, objective, shape, mode, micro_batch=None):
  """The mesh step's (loss, aux, grads) with attention_impl "xla" and "pallas", same parameters."""
  (gd_xla, params), (gd_pallas, params_pallas) = build("xla"), build("pallas")
  assert max_rel_err(params_pallas, params) == 0.0
  mesh = make_mesh(*shape, devices=jax.devices()[:int(np.prod(shape))])
  out = []
  with jax.set_mesh(mesh):
    batch = shard_batch(stack_groups(pad_prompts(units, mesh.shape["seq"])), mesh)
    placed = shard_params(params, mesh, mode)
    for graphdef in (gd_xla, gd_pallas):
      step = jax.jit(lambda p, b: value_and_grad(head, graphdef, p, b, objective, mesh=mesh, micro_batch=micro_batch))
      out.append(jax.device_get(step(placed, batch)))
  return out


def _assert_equal(got, want):
  assert float(got[0]) == pytest.approx(float(want[0]), rel=1e-5)
  assert max_rel_err(got[2], want[2]) <= 1e-5
  assert min(float(np.abs(g).max()) for g in jax.tree_util.tree_leaves(want[2])) > 0   # no vacuous zeros


# The three mesh-step cases are heavy (each ~35 s of CPU, 2-3 min on 2 loaded cores: two compiles
# of the whole step, one with the interpreted kernels, whatever the mesh size). CI covers the same
# kernel code inside shard_map, forward and backward, through the seq wrappers:
# test_context_parallel_kernels_equal_the_reference_unsharded, and the Triton lowering there:
# test_kernels_lower_to_triton_inside_the_mesh_shard_map.
@pytest.mark.heavy
def test_group_mesh_step_with_pallas_equals_xla():
  # Two GRPO groups of 4 completions (prompts of 11 and 6 tokens, bucket 16) on 2 x 2 x 2 FSDP:
  # groups over data, completions over branch, the prompt over seq (its chunks' forward through
  # prompt_chunk_attention, the completions' through over_sharded_prompt, both around the kernel),
  # FSDP's layer scan under jax.checkpoint. Log-probs per completion too.
  groups = [grpo_arrays(random_group([3, 7, 1, 5], seed=s, prompt_len=n, prompt_bucket=16, completion_bucket=8),
                        np.float32, seed=s) for s, n in enumerate((11, 6))]
  want, got = _both(_policy, POLICY, groups, grpo_objective, (2, 2, 2), "fsdp")
  _assert_equal(got, want)
  np.testing.assert_allclose(got[1]["logp"], want[1]["logp"], rtol=1e-5, atol=1e-5)


@pytest.mark.heavy   # see test_group_mesh_step_with_pallas_equals_xla
def test_tree_mesh_step_with_pallas_equals_xla():
  # A GRPO tree (prompt 11 tokens, 4 first-level segments of 3 tokens, each with 2 children of 2-5
  # tokens) on 1 x 2 x 2 replicated: first-level subtrees over branch, the prompt over seq; the
  # kernel runs with ancestors of every depth (prompt chunk, first-level segment, own).
  rng = np.random.default_rng(0)
  heads = [list(rng.integers(0, 64, 3)) for _ in range(4)]
  tree = tree_from_trajectories(list(rng.integers(0, 64, 11)),
                                [h + list(rng.integers(0, 64, 2 + (i + j) % 4)) for i, h in enumerate(heads) for j in range(2)])
  adv = rng.normal(size=len(tree.ends)).astype(np.float32)
  old = [(-4.0 + 0.3 * rng.normal(size=len(s))).astype(np.float32) for s in tree.segments]
  w = obj.trajectory_weights(tree.completion_lengths(), mode="group_token_mean", max_length=16)
  per_node = {"weights": [x.astype(np.float32) for x in tree.node_weights(w)], "old_logp": old, "ref_logp": old}
  units = [tree_arrays(pad_tree(tree), per_node, advantage=adv)]
  objective = functools.partial(obj.grpo_objective, clip_eps=0.2, kl_coef=0.05, on_policy=False)
  want, got = _both(_policy, POLICY, units, objective, (1, 2, 2), "replicated")
  _assert_equal(got, want)


@pytest.mark.heavy   # see test_group_mesh_step_with_pallas_equals_xla
def test_actor_critic_mesh_step_with_pallas_equals_xla():
  # PPO's ActorCritic head (log-probs and values from one trunk) on two groups of 4 completions,
  # 2 x 2 x 2 FSDP, prompt over seq: the policy and value losses' gradients, value head included.
  def group(seed, prompt_len):
    g = random_group([3, 7, 1, 5], seed=seed, prompt_len=prompt_len, prompt_bucket=16, completion_bucket=8)
    rng = np.random.default_rng(seed)
    shape = g.completion_ids.shape
    normal = lambda: rng.normal(size=shape).astype(np.float32)
    return group_arrays(g, weights=obj.token_weights(g.lengths, shape[1], mode="group_token_mean").astype(np.float32),
                        advantage=normal(), returns=normal(), old_values=normal(),
                        old_logp=(-4.0 + 0.3 * normal()).astype(np.float32))
  objective = functools.partial(obj.ppo_objective, clip_eps=0.2, vf_coef=0.5, value_clip=0.2)
  want, got = _both(_actor_critic, ACTOR_CRITIC, [group(0, 11), group(1, 14)], objective, (2, 2, 2), "fsdp")
  _assert_equal(got, want)
  np.testing.assert_allclose(got[1]["value"], want[1]["value"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl, backend, refused", [("pallas", "cpu", False), ("pallas", "gpu", False),
                                                    ("auto", "gpu", False), ("xla", "tpu", False),
                                                    ("splash", "cpu", True), ("pallas", "tpu", True),
                                                    ("auto", "tpu", True)])
def test_the_mesh_takes_the_triton_kernels_and_refuses_splash(tmp_path, monkeypatch, impl, backend, refused):
  # A 2 x 4 x 1 mesh config: attention_impl "pallas" (and "auto", which picks them on a GPU) resolves
  # to the Triton kernels and validates; anything that resolves to splash (TPU) is refused, naming
  # the field, because JAX's splash kernels do not trace inside shard_map(check_vma).
  monkeypatch.setattr(jax, "default_backend", lambda: backend)
  config = grpo_smoke(tmp_path, **{"mesh.data": 2, "mesh.branch": 4, "model.attention_impl": impl})
  if refused:
    with pytest.raises(ValueError, match=f"model.attention_impl='{impl}': splash attention"):
      checks.validate_mesh_shape(config)
  else:
    assert checks.validate_mesh_shape(config) is True
