"""Fused replay (the prompt and a group's completions in one layer scan, `Llama.prompt_and_rows`)
computes the same loss and gradient as naive and as `core.replay.replay_vjp`: only where the prompt's
K/V cotangent is summed and pulled back changes (per layer, inside the scan's backward pass)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import max_rel_err, random_group, tiny_model
from test_ppo import _objective, _random_fields, actor_critic
from test_replay import LENGTHS, grpo_arrays, grpo_objective

from branch_replay_jax import losses as obj
from branch_replay_jax.data.batches import group_arrays
from branch_replay_jax.gradients.heads import ACTOR_CRITIC, POLICY
from branch_replay_jax.gradients.step import value_and_grad
from branch_replay_jax.kernels import reference

_step = jax.jit(functools.partial(value_and_grad, POLICY), static_argnums=(0, 3),
                static_argnames=("micro_batch", "fused", "layout"))


def _case(dtype, remat="none", lengths=LENGTHS[7]):
  graphdef, params = tiny_model(dtype, dtype, remat=remat)
  return graphdef, params, grpo_arrays(random_group(lengths), dtype)


# CI runs save_kv (the default of long-context runs); "none" and "full" (~1 min each on loaded cores) are heavy.
@pytest.mark.parametrize("remat", [pytest.param("none", marks=pytest.mark.heavy), "save_kv",
                                   pytest.param("full", marks=pytest.mark.heavy)])
def test_float64_fused_replay_equals_naive_and_unfused_replay(x64, remat):
  # The same function of the parameters, summed in another order: float64 rounding, ~1e-15. The
  # remat policy changes what the backward pass keeps, never the gradient.
  graphdef, params, arrays = _case(jnp.float64, remat)
  lf, af, gf = _step(graphdef, params, arrays, grpo_objective, fused=True)
  ln, an, gn = _step(graphdef, params, arrays, grpo_objective, layout="naive")
  lr, _, gr = _step(graphdef, params, arrays, grpo_objective, micro_batch=7, fused=False)
  assert max_rel_err(gf, gn) <= 1e-10 and max_rel_err(gf, gr) <= 1e-10
  assert abs(float(lf) - float(ln)) <= 1e-12 * max(1.0, abs(float(ln))) and abs(float(lf) - float(lr)) <= 1e-12
  np.testing.assert_allclose(af["logp"], an["logp"], atol=1e-12)
  assert int(np.sum(af["clipped"])) > 0, "the case must exercise the clipped branch of the surrogate"


def test_float64_fused_replay_equals_naive_with_the_tiled_attention(x64, monkeypatch):
  # Query chunks of 4 and key tiles of 4: the 11-token prompt's own attention runs 3 chunks and the
  # completions score it in 3 key tiles (the long-prompt path), in fused, unfused and naive alike.
  monkeypatch.setattr(reference, "QUERY_CHUNK", 4)
  monkeypatch.setattr(reference, "KEY_BLOCK", 4)
  graphdef, params, arrays = _case(jnp.float64, "save_kv", LENGTHS[2])
  step = jax.jit(functools.partial(value_and_grad, POLICY), static_argnums=(0, 3), static_argnames=("fused", "layout"))
  _, _, gf = step(graphdef, params, arrays, grpo_objective, fused=True)
  _, _, gn = step(graphdef, params, arrays, grpo_objective, layout="naive")
  assert max_rel_err(gf, gn) <= 1e-10


def test_float32_fused_replay_equals_naive():
  graphdef, params, arrays = _case(jnp.float32, lengths=LENGTHS[2])
  lf, _, gf = _step(graphdef, params, arrays, grpo_objective, fused=True)
  ln, _, gn = _step(graphdef, params, arrays, grpo_objective, layout="naive")
  assert max_rel_err(gf, gn) <= 1e-4
  assert abs(float(lf) - float(ln)) <= 1e-5 * max(1.0, abs(float(ln)))


def test_bfloat16_fused_replay_error_at_most_twice_naive_error():
  # flash-attention's rule: against a float64 reference, the new path's bfloat16 error is at most
  # 2x the established (naive) path's.
  group = random_group(LENGTHS[7])
  with jax.enable_x64(True):
    gd64, p64 = tiny_model(jnp.float64, jnp.float64)
    _, _, g_ref = _step(gd64, p64, grpo_arrays(group, np.float64), grpo_objective, layout="naive")
    g_ref = jax.tree_util.tree_map(np.asarray, g_ref)
  graphdef, params = tiny_model(jnp.bfloat16)
  arrays = grpo_arrays(group, np.float32)
  _, _, g_fused = _step(graphdef, params, arrays, grpo_objective, fused=True)
  _, _, g_naive = _step(graphdef, params, arrays, grpo_objective, layout="naive")
  err_fused, err_naive = max_rel_err(g_fused, g_ref), max_rel_err(g_naive, g_ref)
  assert err_naive > 1e-4, "bfloat16 must actually round (else this test checks nothing)"
  assert err_fused <= 2 * err_naive, (err_fused, err_naive)


def test_float64_fused_replay_equals_naive_for_a_policy_and_a_separate_critic(x64):
  # Two trunks, each its own fused scan; the value loss reaches the critic trunk's prompt too.
  graphdef, params = actor_critic("separate", jnp.float64)
  group = random_group([3, 7, 1, 5])
  rng = np.random.default_rng(0)
  shape = group.completion_ids.shape
  arrays = group_arrays(group, weights=obj.token_weights(group.lengths, shape[1], mode="group_token_mean"),
                        advantage=rng.normal(size=shape), returns=rng.normal(size=shape),
                        **_random_fields(rng, shape, np.float64))
  step = jax.jit(functools.partial(value_and_grad, ACTOR_CRITIC), static_argnums=(0, 3),
                 static_argnames=("fused", "layout"))
  lf, af, gf = step(graphdef, params, arrays, _objective, fused=True)
  ln, an, gn = step(graphdef, params, arrays, _objective, layout="naive")
  assert max_rel_err(gf, gn) <= 1e-10 and abs(float(lf) - float(ln)) <= 1e-12 * max(1.0, abs(float(ln)))
  assert max_rel_err(af["value"], an["value"]) <= 1e-10
  assert np.abs(np.asarray(gn["critic"]["embed"][...])).max() > 0


def test_fused_true_is_refused_where_it_does_not_apply():
  # It needs all G completions in one step on one device: micro_batch 1 of 7 and the naive layout
  # are refused before any compute.
  graphdef, params, arrays = _case(jnp.float32)
  with pytest.raises(ValueError, match="fused=True needs"):
    value_and_grad(POLICY, graphdef, params, arrays, grpo_objective, micro_batch=1, fused=True)
  with pytest.raises(ValueError, match="fused=True needs"):
    value_and_grad(POLICY, graphdef, params, arrays, grpo_objective, layout="naive", fused=True)
