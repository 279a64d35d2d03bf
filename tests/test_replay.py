"""replay_vjp: replay gradients equal the naive per-completion gradients (the product's promise)."""

import functools
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from conftest import max_rel_err, random_group, tiny_model

from branch_replay_jax import losses as obj
from branch_replay_jax.core.replay import replay_vjp
from branch_replay_jax.data.batches import group_arrays
from branch_replay_jax.models.llama import REMAT_POLICIES, token_logprobs
from branch_replay_jax.gradients.heads import POLICY
from branch_replay_jax.gradients.step import forward, value_and_grad

LENGTHS = {1: [6], 2: [1, 9], 7: [1, 5, 9, 3, 7, 1, 8]}


def grpo_objective(logp, br):
  """GRPO clipped surrogate + KL, off-policy (old_logp != logp) so clipping is active."""
  loss, metrics = obj.grpo_token_loss(logp, br.old_logp, br.ref_logp, br.advantage, clip_eps=0.2,
                                      kl_coef=0.05)
  return jnp.sum(br.weights * loss), {"logp": logp, "clipped": jnp.sum(metrics["clipped"] & br.mask)}


def logprob_objective(logp, br):
  return obj.weighted_logprob_loss(logp, br.weights), logp


def grpo_arrays(group, dtype, seed=1, mode="sequence_mean"):
  rng = np.random.default_rng(seed)
  g, t = group.completion_ids.shape
  rewards = rng.normal(size=g)
  adv = np.asarray(obj.group_advantages(jnp.asarray(rewards, jnp.float64 if dtype == jnp.float64 else jnp.float32),
                                        ddof=0)) if g > 1 else np.ones(1)
  return group_arrays(group,
                      weights=obj.token_weights(group.lengths, t, mode=mode).astype(dtype),
                      advantage=adv.astype(dtype),
                      old_logp=(-4.2 + 0.3 * rng.normal(size=(g, 64))[:, :t]).astype(dtype),
                      ref_logp=(-4.2 + 0.3 * rng.normal(size=(g, 64))[:, :t]).astype(dtype))


# Module-level jits: tests that share shapes share compiles (graphdef and objective are static).
_replay = jax.jit(functools.partial(value_and_grad, POLICY), static_argnums=(0, 3), static_argnames=("micro_batch",))
_naive = jax.jit(functools.partial(value_and_grad, POLICY, layout="naive"), static_argnums=(0, 3))


def both(graphdef, params, arrays, objective=grpo_objective, micro_batch=1):
  return (_replay(graphdef, params, arrays, objective, micro_batch=micro_batch),
          _naive(graphdef, params, arrays, objective))


# g = 2 is heavy in float64, g = 1 and 7 in float32: CI runs each G in one dtype (~1 min each on loaded cores).
@pytest.mark.parametrize("g", [1, pytest.param(2, marks=pytest.mark.heavy), 7])
def test_float64_replay_equals_naive(x64, g):
  # Same function of the parameters, only the summation order differs: float64 rounding ~1e-15.
  graphdef, params = tiny_model(jnp.float64, jnp.float64)
  arrays = grpo_arrays(random_group(LENGTHS[g]), jnp.float64)
  (lr, ar, gr), (ln, an, gn) = both(graphdef, params, arrays)
  assert max_rel_err(gr, gn) <= 1e-10
  assert abs(float(lr) - float(ln)) <= 1e-12 * max(1.0, abs(float(ln)))
  np.testing.assert_allclose(ar["logp"], an["logp"], atol=1e-12)
  np.testing.assert_array_equal(ar["clipped"], an["clipped"])
  assert int(np.sum(ar["clipped"])) > 0, "the case must exercise the clipped branch of the surrogate"


@pytest.mark.parametrize("g", [pytest.param(1, marks=pytest.mark.heavy), 2, pytest.param(7, marks=pytest.mark.heavy)])
def test_float32_replay_equals_naive(g):
  graphdef, params = tiny_model()
  arrays = grpo_arrays(random_group(LENGTHS[g]), np.float32)
  (lr, _, gr), (ln, _, gn) = both(graphdef, params, arrays)
  assert max_rel_err(gr, gn) <= 1e-4
  assert abs(float(lr) - float(ln)) <= 1e-5 * max(1.0, abs(float(ln)))


def test_bfloat16_replay_error_at_most_twice_naive_error():
  # flash-attention's rule: the new path's low-precision error against a float64 reference is at
  # most 2x the low-precision error of the established path.
  group = random_group(LENGTHS[7])
  with jax.enable_x64(True):
    gd64, p64 = tiny_model(jnp.float64, jnp.float64)
    _, (_, _, g_ref) = both(gd64, p64, grpo_arrays(group, np.float64))
    g_ref = jax.tree_util.tree_map(np.asarray, g_ref)
  graphdef, params = tiny_model(jnp.bfloat16)
  (_, _, g_replay), (_, _, g_naive) = both(graphdef, params, grpo_arrays(group, np.float32))
  err_replay, err_naive = max_rel_err(g_replay, g_ref), max_rel_err(g_naive, g_ref)
  assert err_naive > 1e-4, "bfloat16 must actually round (else this test checks nothing)"
  assert err_replay <= 2 * err_naive, (err_replay, err_naive)


def test_micro_batch_and_prompt_bucket_do_not_change_the_gradient(x64):
  graphdef, params = tiny_model(jnp.float64, jnp.float64)
  arrays = grpo_arrays(random_group(LENGTHS[7]), jnp.float64)
  wide = grpo_arrays(random_group(LENGTHS[7], prompt_bucket=64, completion_bucket=32), jnp.float64)
  (_, _, g1), (_, _, gn) = both(graphdef, params, arrays, micro_batch=1)
  (_, _, g7), _ = both(graphdef, params, arrays, micro_batch=7)
  (_, _, gw), _ = both(graphdef, params, wide, micro_batch=7)
  assert max_rel_err(g7, g1) <= 1e-12
  assert max_rel_err(gw, gn) <= 1e-10


def test_forward_only_replay_logprobs_equal_naive(x64):
  graphdef, params = tiny_model(jnp.float64, jnp.float64)
  arrays = grpo_arrays(random_group(LENGTHS[7]), jnp.float64)
  lp_replay = forward(POLICY, graphdef, params, arrays, micro_batch=7)
  lp_naive = forward(POLICY, graphdef, params, arrays, layout="naive")
  np.testing.assert_allclose(lp_replay, lp_naive, atol=1e-12)
  assert np.all(np.asarray(lp_replay)[~np.asarray(arrays.branches.mask)] == 0.0)


def test_first_completion_token_loss_reaches_the_prompt(x64):
  # A loss on completion token 0 only: its log-prob comes from the prompt's LAST hidden state, so
  # the embedding rows of prompt-only tokens get a non-zero gradient, through the prefix alone.
  # Prompt ids come from [0, 32), completion ids from [32, 64): the two sets of rows are disjoint.
  graphdef, params = tiny_model(jnp.float64, jnp.float64)
  rng = np.random.default_rng(3)
  from branch_replay_jax.data.groups import make_group
  group = make_group(rng.integers(0, 32, 9), [rng.integers(32, 64, n) for n in (4, 2, 6)], vocab_size=64,
                     max_positions=256)
  first_only = np.zeros(group.completion_ids.shape)
  first_only[:, 0] = 1.0
  arrays = group_arrays(group, weights=first_only)
  (_, _, gr), (_, _, gn) = both(graphdef, params, arrays, logprob_objective)
  prompt_rows = np.unique(group.prompt_ids[:group.prompt_len])
  embed_replay = np.asarray(gr["embed"][...])[prompt_rows]
  embed_naive = np.asarray(gn["embed"][...])[prompt_rows]
  assert np.abs(embed_naive).max() > 1e-6
  np.testing.assert_allclose(embed_replay, embed_naive, rtol=1e-10, atol=1e-14)


def _toy():
  """prefix(θ) = θ_a * x (a vector); branch_g(θ, h) = (θ_b · h + c_g)^2. Hand-differentiable."""
  x = jnp.array([1.0, 2.0])
  prefix_fn = lambda p: p["a"] * x
  branch_fn = lambda p, h, c: ((p["b"] @ h + c) ** 2, p["b"] @ h + c)
  params = {"a": jnp.array(3.0), "b": jnp.array([0.5, -1.0])}
  return prefix_fn, branch_fn, params, x


def test_prefix_cotangent_is_summed_once_over_branches():
  # h = a x = (3, 6); u_g = b.h + c_g = -4.5 + c_g. L = Σ u_g^2.
  # dL/da = Σ 2 u_g (b.x) = Σ 2 u_g (-1.5);  dL/db = Σ 2 u_g h.
  # c = (1, 2, 3): u = (-3.5, -2.5, -1.5), Σu = -7.5 -> dL/da = 22.5, dL/db = -15 * (3, 6) = (-45, -90).
  # Dropping the prefix cotangent gives dL/da = 0; counting it twice gives 45.
  prefix_fn, branch_fn, params, _ = _toy()
  loss, aux, grads = replay_vjp(prefix_fn, branch_fn, params, jnp.array([1.0, 2.0, 3.0]), micro_batch=1)
  np.testing.assert_allclose(aux, [-3.5, -2.5, -1.5])
  np.testing.assert_allclose(loss, 3.5**2 + 2.5**2 + 1.5**2)
  np.testing.assert_allclose(grads["a"], 22.5)
  np.testing.assert_allclose(grads["b"], [-45.0, -90.0])


def test_g_copies_of_a_branch_give_g_times_its_gradient():
  # G identical branches -> every gradient is exactly G times one branch's.
  prefix_fn, branch_fn, params, _ = _toy()
  _, _, one = replay_vjp(prefix_fn, branch_fn, params, jnp.array([2.0]))
  _, _, five = replay_vjp(prefix_fn, branch_fn, params, jnp.full((5,), 2.0), micro_batch=5)
  np.testing.assert_allclose(five["a"], 5 * one["a"], rtol=1e-6)
  np.testing.assert_allclose(five["b"], 5 * one["b"], rtol=1e-6)


@pytest.mark.parametrize("micro_batch", [1, 3])
def test_vectorized_branch_fn_gives_the_same_gradient(micro_batch):
  # The toy's branch_fn written for a micro-batch (c [m] -> losses [m]) and called as is: the values of
  # test_prefix_cotangent_is_summed_once_over_branches, through the scan (m = 1) and the one-step path (m = G).
  prefix_fn, branch_fn, params, _ = _toy()
  loss, aux, grads = replay_vjp(prefix_fn, branch_fn, params, jnp.array([1.0, 2.0, 3.0]), micro_batch=micro_batch,
                                vectorized=True)
  np.testing.assert_allclose(aux, [-3.5, -2.5, -1.5])
  np.testing.assert_allclose(grads["a"], 22.5)
  np.testing.assert_allclose(grads["b"], [-45.0, -90.0])


@pytest.mark.parametrize("micro_batch", [1, 3])
def test_prefix_cotangent_reduction_is_applied_once(micro_batch):
  # reduce_prefix_cotangent triples the summed prefix cotangent: the prefix's share of the gradient
  # (all of dL/da = 22.5 above) becomes 67.5 on both paths (the scan at m = 1, the single step at
  # m = G = 3); dL/db comes from the branches alone and stays (-45, -90). Applying it per branch or
  # not at all on one path would give 22.5 or 202.5.
  prefix_fn, branch_fn, params, _ = _toy()
  _, _, grads = replay_vjp(prefix_fn, branch_fn, params, jnp.array([1.0, 2.0, 3.0]), micro_batch=micro_batch,
                           reduce_prefix_cotangent=lambda c: [3 * x for x in c])
  np.testing.assert_allclose(grads["a"], 67.5)
  np.testing.assert_allclose(grads["b"], [-45.0, -90.0])


def test_one_logprob_chunk_equals_several(x64):
  # token_logprobs recomputes its chunks in the backward pass only when there are several: one chunk
  # of 6 positions and three of 2 give the same log-probs and gradients up to float64 rounding.
  rng = np.random.default_rng(3)
  h, w = jnp.asarray(rng.normal(size=(2, 6, 5))), jnp.asarray(rng.normal(size=(5, 11)))
  y = jnp.asarray(rng.integers(0, 11, size=(2, 6)))
  f = lambda chunk: jax.value_and_grad(lambda h, w: jnp.sum(jnp.sin(token_logprobs(h, w, y, chunk=chunk))),
                                       argnums=(0, 1))(h, w)
  (one, g_one), (three, g_three) = f(6), f(2)
  np.testing.assert_allclose(one, three, rtol=1e-12)
  assert max_rel_err(g_one, g_three) <= 1e-12


def test_first_completion_token_is_predicted_by_the_prompts_last_position():
  # Vocab of 4, logits at a position = E @ E[token there]. Prompt [0, 1], completion [2, 3].
  # logp(2 | pos 1) = 0 - logsumexp(E @ E[1]) = -log(1 + e + 1 + 1/e) = -1.62652, likewise
  # logp(3 | pos 2), so the completion's log-prob sum is -3.25305 (not -1.25305, which is the
  # same-position misalignment, nor -1.62652, which drops the first completion token).
  e = jnp.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]])
  prompt, completion = jnp.array([0, 1]), jnp.array([2, 3])
  logp = lambda h, tok: jax.nn.log_softmax(e @ h)[tok]

  def prefix_fn(params):                 # the prompt's last-position output predicts token 0
    return params["emb"][prompt[-1]]

  def branch_fn(params, last_h, comp):
    hs = jnp.concatenate([last_h[None], params["emb"][comp[:-1]]])
    return jnp.sum(jax.vmap(logp)(hs, comp)), None

  params = {"emb": e}
  loss, _, grads = replay_vjp(prefix_fn, branch_fn, params, completion[None])
  np.testing.assert_allclose(loss, -3.25305, atol=1e-5)
  full = jnp.concatenate([prompt, completion])
  naive = lambda p: sum(jax.nn.log_softmax(e @ p["emb"][full[t - 1]])[full[t]] for t in (2, 3))
  np.testing.assert_allclose(loss, naive(params), atol=1e-6)
  np.testing.assert_allclose(grads["emb"], jax.grad(naive)(params)["emb"], atol=1e-6)
  # Row 1 (the prompt's last token) is reached only through the prefix output: non-zero.
  assert np.abs(np.asarray(grads["emb"][1])).max() > 0.1


def test_replay_rejects_bad_micro_batch_and_ragged_branches():
  prefix_fn, branch_fn, params, _ = _toy()
  with pytest.raises(ValueError, match="micro_batch=2"):
    replay_vjp(prefix_fn, branch_fn, params, jnp.ones(3), micro_batch=2)
  with pytest.raises(ValueError, match="same leading branch axis"):
    replay_vjp(prefix_fn, lambda p, h, b: (b["x"].sum(), None), params, {"x": jnp.ones(3), "y": jnp.ones(4)})


# heavy (~30 s on one core): remat in CI through tests/test_fused_replay.py (save_kv, float64) and
# tests/test_mesh.py::test_every_remat_policy_on_a_sequence_sharded_mesh (full, save_kv).
@pytest.mark.heavy
def test_every_remat_policy_gives_the_same_gradient(x64):
  # Rematerialisation recomputes (or moves to host and back) the same float64 values: same gradient.
  arrays = grpo_arrays(random_group(LENGTHS[2]), jnp.float64)
  grads = {}
  for policy in REMAT_POLICIES:
    graphdef, params = tiny_model(jnp.float64, jnp.float64, remat=policy)
    (_, _, grads[policy]), _ = both(graphdef, params, arrays)
  for policy in REMAT_POLICIES:
    assert max_rel_err(grads[policy], grads["none"]) <= 1e-12, policy
  with pytest.raises(ValueError, match="remat=True"):
    tiny_model(remat=True)


def _host_puts(jaxpr):
  """Outputs of device_put equations that land in host memory, recursing into sub-jaxprs."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "device_put":
      yield from (v.aval.shape for v in eqn.outvars if v.aval.memory_space == jax.memory.Space.Host)
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          yield from _host_puts(sub)


def test_offload_kv_moves_layer_inputs_and_kv_to_host_and_needs_a_host_memory(monkeypatch):
  # One segment of T=5 tokens through the 2-layer tiny model (d=32, Hkv=2, D=8): the pullback's
  # residuals per layer are its input [1, 5, 32] and its K and V [1, 5, 2, 8]; "offload_kv" puts
  # exactly those three in host memory, "save_kv" none.
  tokens = jnp.arange(5)[None]
  for policy, want in (("offload_kv", [(1, 5, 2, 8), (1, 5, 2, 8), (1, 5, 32)]), ("save_kv", [])):
    graphdef, params = tiny_model(remat=policy)
    loss = lambda p: jnp.sum(nnx.merge(graphdef, p)(tokens, 0).hidden_btd ** 2)
    assert sorted(_host_puts(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)) == want, policy

  class NoHostMemory:   # a backend with one memory space (no "pinned_host")
    def addressable_memories(self):
      return [type("Memory", (), {"kind": "device"})()]
  monkeypatch.setattr(jax, "devices", lambda *a: [NoHostMemory()])
  with pytest.raises(ValueError, match="remat='offload_kv' needs a 'pinned_host'"):
    tiny_model(remat="offload_kv")
