"""The GRPO options of today's practice, each against hand-computed values and exact under replay.

Options (experiments/grpo_smollm2_arith.py, docs/design.md "GRPO options"): DAPO's clip-higher
(loss.clip_eps_low / clip_eps_high), GSPO's sequence ratio (loss.importance_ratio), log-probs at the
sampling temperature (loss.logprob_temperature), the step-level token mean (loss.weighting),
masking truncated completions (loss.mask_truncated), DAPO's soft overlong penalty
(loss.overlong_buffer / overlong_penalty) and dynamic sampling (rollout.dynamic_sampling /
max_prompt_draws).

Exactness: replay (groups; nested replay for trees) equals the naive step over the same
trajectories, float64 <= 1e-10 and float32 <= 1e-4 relative in the gradient, as tests/test_replay.py
and tests/test_tree_replay.py hold the default loss; the logged metric sums (k3 KL, clipped count)
agree too. The exactness cases turn every option on at once; each option's effect is pinned by its
hand-computed case, so an option the loop silently ignored would fail there or in the loop tests below.

One file of ~560 lines: each option has a hand case, a refusal and a replay-equals-naive case, and
the cases share one set of builders.
"""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (experiment_config, final_params, grpo_smoke, length_score, max_rel, max_rel_err, random_group,
                      tiny_model)

from branch_replay_jax import losses as obj
from branch_replay_jax.algorithms import grpo as train
from branch_replay_jax.algorithms import ppo
from branch_replay_jax.data.batches import group_arrays, trajectory_group_arrays, tree_arrays
from branch_replay_jax.data.trees import RolloutTree, pad_tree
from branch_replay_jax.models import tiny_config
from branch_replay_jax.models.llama import token_logprobs
from branch_replay_jax.algorithms import groups
from branch_replay_jax.algorithms.schema import layout_of, parse
from branch_replay_jax.algorithms.groups import Group, dynamic_sampling, step_token_mean
from branch_replay_jax.rollout import collect
from branch_replay_jax.rollout.collect import Trajectories
from branch_replay_jax.rollout.tasks import Task
from experiments import grpo_tree_smollm2_arith
from branch_replay_jax.gradients.heads import Policy
from branch_replay_jax.gradients.step import value_and_grad

# ---------------------------------------------------------------------------------------------
# Hand-computed values.


def test_clip_higher_hand_case():
  # old_logp = 0, so r = exp(logp). ε_low = 0.2, ε_high = 0.28 clip r to [0.8, 1.28]:
  #   r = 1.3, A = +1: min(1.3, 1.28) = 1.28 -> ℓ = -1.28, clipped, zero gradient
  #   r = 1.3, A = -1: min(-1.3, -1.28) = -1.3 -> ℓ = 1.3, dℓ/dlogp = -A r = 1.3
  #   r = 0.7, A = +1: min(0.7, 0.8) = 0.7 -> ℓ = -0.7, dℓ/dlogp = -0.7
  #   r = 0.7, A = -1: min(-0.7, -0.8) = -0.8 -> ℓ = 0.8, clipped, zero gradient
  # The symmetric clip (0.2) gives -1.2 on the first: clip-higher lets a positive-advantage token grow further.
  logp = jnp.log(jnp.array([1.3, 1.3, 0.7, 0.7]))
  adv = jnp.array([1.0, -1.0, 1.0, -1.0])
  f = lambda lp, **kw: obj.grpo_token_loss(lp, jnp.zeros(4), jnp.zeros(4), adv, clip_eps=0.2, **kw)
  loss, m = f(logp, clip_eps_high=0.28)
  np.testing.assert_allclose(loss, [-1.28, 1.3, -0.7, 0.8], rtol=1e-6)
  np.testing.assert_array_equal(m["clipped"], [True, False, False, True])
  grad = jax.grad(lambda lp: jnp.sum(f(lp, clip_eps_high=0.28)[0]))(logp)
  np.testing.assert_allclose(grad, [0.0, 1.3, -0.7, 0.0], rtol=1e-6)
  np.testing.assert_allclose(f(logp)[0][0], -1.2, rtol=1e-6)


def test_gspo_sequence_ratio_hand_case():
  # One completion of 3 tokens (+1 padding), log-ratios logp - old = (0.3, -0.1, 0.4): GSPO's
  # s = exp(mean) = exp(0.2) = 1.221403, the same for every token; sequence_mean weights 1/3.
  # A = +1, ε = 0.2: min(1.2214, 1.2) = 1.2 on every token -> loss -1.2, clipped, gradient 0.
  # A = -1: min(-1.2214, -1.2) = -1.2214 -> loss 1.221403, dℓ/dlogp_t = (1/3) s = 0.407134 (GSPO eq. 11:
  # A ∇s with ∇s = s (1/|y|) Σ ∇logp_t). The token ratio instead gives the mean of max(r_t, clip(r_t))
  # = (e^0.3 + e^-0.1 + 1.2) / 3 (e^0.4 clips to 1.2 and stays as max(1.4918, 1.2)) -> 1.248842.
  old = jnp.array([-2.0, -1.0, -3.0, 0.0])
  logp = old + jnp.array([0.3, -0.1, 0.4, 0.0])
  mask = jnp.array([True, True, True, False])

  def run(adv, ratio):
    from branch_replay_jax.data.batches import Segments
    seg = Segments(jnp.zeros(4, jnp.int32), mask, weights=jnp.where(mask, 1 / 3, 0.0), advantage=jnp.asarray(adv),
                   old_logp=old)
    f = lambda lp: obj.grpo_objective(lp, seg, clip_eps=0.2, kl_coef=0.0, on_policy=False, importance_ratio=ratio)
    (loss, aux), grad = jax.value_and_grad(f, has_aux=True)(logp)
    return float(loss), int(aux["clipped"]), np.asarray(grad)

  loss, clipped, grad = run(1.0, "sequence")
  assert loss == pytest.approx(-1.2, rel=1e-6) and clipped == 3
  np.testing.assert_array_equal(grad, 0.0)
  loss, clipped, grad = run(-1.0, "sequence")
  assert loss == pytest.approx(np.exp(0.2), rel=1e-6) and clipped == 0
  np.testing.assert_allclose(grad, [np.exp(0.2) / 3] * 3 + [0.0], rtol=1e-6)
  loss, _, _ = run(-1.0, "token")
  assert loss == pytest.approx((np.exp(0.3) + np.exp(-0.1) + np.exp(0.4)) / 3, rel=1e-6)
  with pytest.raises(ValueError, match="importance_ratio='seq'"):
    run(1.0, "seq")


def test_gspo_on_policy_equals_the_token_ratio():
  # On-policy old = sg(logp): s_i = 1 and ∇s_i = (1/|y|) Σ ∇logp_t, the token ratio's values and gradients.
  from branch_replay_jax.data.batches import Segments
  logp = jnp.array([[-1.0, -2.0, -0.5], [-3.0, -0.1, 0.0]])
  mask = jnp.array([[True, True, True], [True, True, False]])
  seg = Segments(jnp.zeros((2, 3), jnp.int32), mask, weights=jnp.where(mask, 0.25, 0.0),
                 advantage=jnp.array([0.7, -1.3]))
  total = lambda ratio: lambda lp: jnp.sum(jax.vmap(functools.partial(
      obj.grpo_objective, clip_eps=0.2, kl_coef=0.0, on_policy=True, importance_ratio=ratio))(lp, seg)[0])
  for f in (jax.value_and_grad(total("sequence")), jax.value_and_grad(total("token"))):
    loss, grad = f(logp)
    assert float(loss) == pytest.approx(-0.25 * (3 * 0.7 - 2 * 1.3), rel=1e-6)
    np.testing.assert_allclose(grad, np.where(mask, -0.25 * np.array([[0.7], [-1.3]]), 0.0), rtol=1e-6)


def test_overlong_penalty_hand_case():
  # DAPO eq. 13, L_max 32, L_cache 8: no penalty up to 24 tokens, then (24 - |y|) / 8 down to -1 at 32.
  np.testing.assert_allclose(obj.overlong_penalty([10, 24, 25, 28, 32], max_length=32, buffer=8),
                             [0.0, 0.0, -1 / 8, -1 / 2, -1.0])
  np.testing.assert_allclose(obj.overlong_penalty([28], max_length=32, buffer=8, penalty=0.5), [-0.25])
  with pytest.raises(ValueError, match="buffer=33"):
    obj.overlong_penalty([1], max_length=32, buffer=33)


def test_trajectory_weights_leave_out_truncated_hand_case():
  # lengths (3, 5, 8), the 5-token one truncated and masked: the group is normalised over the other two.
  lengths, keep = [3, 5, 8], [True, False, True]
  np.testing.assert_allclose(obj.trajectory_weights(lengths, mode="group_token_mean", in_loss=keep), [1 / 11, 0, 1 / 11])
  np.testing.assert_allclose(obj.trajectory_weights(lengths, mode="sequence_mean", in_loss=keep), [1 / 6, 0, 1 / 16])
  np.testing.assert_allclose(obj.trajectory_weights(lengths, mode="constant", max_length=8, in_loss=keep),
                             [1 / 16, 0, 1 / 16])
  np.testing.assert_array_equal(obj.trajectory_weights(lengths, mode="group_token_mean", in_loss=[False] * 3), 0.0)
  with pytest.raises(ValueError, match="in_loss shape"):
    obj.trajectory_weights(lengths, mode="group_token_mean", in_loss=[True])


def _raw_group(task_rewards, lengths, truncated, budget=4):
  """Raw trajectories as rollout.collect.rollout returns them (no model): prompt [1, 2, 3], token 5 repeated."""
  lengths = np.asarray(lengths)
  tokens = np.where(np.arange(budget)[None] < lengths[:, None], 5, 0)
  return Trajectories([1, 2, 3], tokens, np.full(tokens.shape, -1.0, np.float32), lengths, np.asarray(truncated),
                      np.asarray(task_rewards, np.float64), np.asarray(task_rewards) > 0, budget, None,
                      {"data_pos": 0, "question": "q", "answer": "a", "completion": "c"}, 0.0, 0.0)


def test_the_algorithm_layer_builds_rewards_advantages_and_weights_from_raw_trajectories(tmp_path):
  # Lengths (3, 4, 1) of a budget of 4, the 4-token one truncated; task rewards (1, 1, 0).
  # GRPO with overlong_buffer 2 (penalty 1): shaping (-(3 - 2) / 2, -1, 0) -> rewards (0.5, 0, 0);
  # advantages (r - 1/6) / std(ddof 1) = (1/3, -1/6, -1/6) / sqrt(1/12) = (1.1547, -0.5774, -0.5774);
  # mask_truncated leaves trajectory 1 out and group_token_mean weighs the other 3 + 1 tokens 1/4 each.
  raw = _raw_group([1.0, 1.0, 0.0], [3, 4, 1], [False, True, False])
  config = grpo_smoke(tmp_path, **{"loss.overlong_buffer": 2, "loss.mask_truncated": True,
                                   "loss.weighting": "group_token_mean"})
  g = groups.build(config, raw, tiny_config(), 0, layout_of(parse(config)))
  np.testing.assert_allclose(g.rewards, [0.5, 0.0, 0.0])
  np.testing.assert_allclose(np.asarray(g.batch.branches.advantage), [1.1547005, -0.5773503, -0.5773503], rtol=1e-5)
  w = np.asarray(g.batch.branches.weights)
  np.testing.assert_array_equal(w[:, :4], [[0.25, 0.25, 0.25, 0], [0, 0, 0, 0], [0.25, 0, 0, 0]])
  assert g.loss_tokens == 4 and g.sample["reward"] == 0.5 and g.kind == "group"
  # PPO: the task's rewards unshaped, no group-relative advantage (GAE comes from the critic), every
  # trajectory in the loss: 1 / (3 + 4 + 1) per token.
  from experiments import ppo_smollm2_arith
  config = experiment_config(ppo_smollm2_arith, "smoke", tmp_path)
  g = groups.build(config, raw, tiny_config(), 0, layout_of(parse(config)))
  np.testing.assert_allclose(g.rewards, [1.0, 1.0, 0.0])
  assert g.batch.branches.advantage is None and g.in_loss is None
  np.testing.assert_allclose(np.asarray(g.batch.branches.weights)[1, :4], [1 / 8] * 4)


def test_token_logprobs_at_a_temperature_hand_case():
  # d = 1, h = 1, W = (0, 2 ln 2): logits (0, 2 ln 2). τ = 1: softmax (1/5, 4/5); τ = 2: logits / 2 =
  # (0, ln 2), softmax (1/3, 2/3). Token 1's log-prob: ln 0.8 and ln(2/3).
  h, w, y = jnp.ones((1, 1, 1)), jnp.array([[0.0, 2 * np.log(2.0)]]), jnp.array([[1]])
  assert float(token_logprobs(h, w, y)[0, 0]) == pytest.approx(np.log(0.8), rel=1e-6)
  assert float(token_logprobs(h, w, y, temperature=2.0)[0, 0]) == pytest.approx(np.log(2 / 3), rel=1e-6)


def _group(batch, lengths, rewards=None, in_loss=None, tree=None, naive_batch=None) -> Group:
  """A Group around `batch` with the fields the step-level functions read (others are placeholders)."""
  lengths = np.asarray(lengths)
  rewards = np.zeros(len(lengths), np.float32) if rewards is None else np.asarray(rewards, np.float32)
  return Group("group" if tree is None else "tree", batch, rewards, rewards > 0, lengths, {}, {}, 0.0, 0.0,
               np.zeros(len(lengths), bool), tree, naive_batch=naive_batch, in_loss=in_loss)


def test_step_token_mean_hand_case():
  # Group 1: completions of 1 and 1 tokens (2 in the loss); group 2: 2 and 4 tokens (6). Per-token losses
  # all 1 except 5 on group 1's second token. The loop averages group losses over B = 2 groups:
  #   group_token_mean (1 / the group's tokens):      ((1 + 5)/2 + 6/6) / 2 = 2
  #   step_token_mean (1 per pair, scaled by B/N = 2/8): (1 + 5 + 6) / 8 = 1.5
  g1, g2 = random_group([1, 1]), random_group([2, 4])
  arrays = lambda g, mode, **kw: group_arrays(g, weights=(
      g.completion_mask * obj.trajectory_weights(g.lengths, mode=mode, **kw)[:, None]).astype(np.float32))
  losses = [np.where(g1.completion_mask, [[1.0], [5.0]], 0.0), np.where(g2.completion_mask, 1.0, 0.0)]
  mean = lambda bs: sum(float(np.sum(np.asarray(b.branches.weights) * l)) for b, l in zip(bs, losses)) / 2
  assert mean([arrays(g, "group_token_mean") for g in (g1, g2)]) == pytest.approx(2.0, rel=1e-6)
  batches = [arrays(g, "step_token_mean") for g in (g1, g2)]
  groups = step_token_mean([_group(b, g.lengths) for b, g in zip(batches, (g1, g2))])
  assert mean([g.batch for g in groups]) == pytest.approx(1.5, rel=1e-6)
  np.testing.assert_array_equal(np.asarray(groups[1].batch.branches.weights), np.where(g2.completion_mask, 0.25, 0.0))
  # A trajectory out of the loss keeps weight 0 and its tokens leave N: group 2's 4-token one masked, N = 4.
  masked = step_token_mean([_group(batches[0], g1.lengths),
                            _group(arrays(g2, "step_token_mean", in_loss=[True, False]), g2.lengths,
                                   in_loss=[True, False])])
  assert masked[1].batch.branches.weights.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(masked[0].batch.branches.weights), np.where(g1.completion_mask, 0.5, 0.0))


def test_dynamic_sampling_hand_case():
  # quota 2, rounds of 2 prompts, at most 6 draws. Round 0 (data_pos 10, 11): rewards (1, 1) and (0, 1):
  # one kept. Round 1 (12, 13): (0, 1) and (0, 0): two kept, quota met. 4 prompts drawn, 2 dropped;
  # the step trains on draws 1 and 2 (data_pos 11, 12), in draw order; data_pos advances to 14.
  rewards = {10: [1, 1], 11: [0, 1], 12: [0, 1], 13: [0, 0], 14: [1, 0], 15: [0, 1]}
  calls = []

  def draw(key, pos):
    calls.append((key, pos))
    return [_group(None, [3, 3], rewards[p]) for p in (pos, pos + 1)], pos + 2

  key = jax.random.key(0)
  groups, pos, metrics = dynamic_sampling(draw, key, 10, quota=2, max_draws=6)
  assert [g.rewards.tolist() for g in groups] == [[0, 1], [0, 1]] and pos == 14
  assert metrics == {"prompts_drawn": 4, "dropped_groups": 2}
  assert calls[0][0] is key and [p for _, p in calls] == [10, 12]   # round 0 draws as without dynamic sampling
  assert not np.array_equal(jax.random.key_data(calls[1][0]), jax.random.key_data(key))
  # The cap reached first: one draw round of (1, 1) and (0, 0) with max_draws 2 -> the step is filled with the
  # dropped groups in draw order (advantages 0: only the KL term acts); nothing counts as trained-and-dropped.
  rewards.update({20: [1, 1], 21: [0, 0]})
  groups, pos, metrics = dynamic_sampling(draw, key, 20, quota=2, max_draws=2)
  assert [g.rewards.tolist() for g in groups] == [[1, 1], [0, 0]] and pos == 22
  assert metrics == {"prompts_drawn": 2, "dropped_groups": 0}


# ---------------------------------------------------------------------------------------------
# Exact under replay, every option at once (one compile per layout and dtype: each compile of the tiny
# model's replay and naive steps costs seconds on 2 cores). The loss's options act through the objective
# (clip-higher, GSPO's sequence ratio), the log-probs (temperature) and the arrays (weights from
# mask_truncated and step_token_mean, advantages from overlong-shaped rewards).

LENGTHS = [1, 5, 9, 3, 7, 1, 8]    # G = 7, ragged; budget 16 (the bucket); "truncated": the 8- and 9-token ones
TAU = 0.7
GROUP_OBJECTIVE = functools.partial(obj.grpo_objective, clip_eps=0.05, clip_eps_high=0.08, kl_coef=0.05,
                                    on_policy=False, importance_ratio="sequence")
# One objective for a tree's nodes and for its trajectories laid out naive (losses.grpo_objective takes both).
TREE_OBJECTIVE = functools.partial(obj.grpo_objective, clip_eps=0.2, clip_eps_high=0.28, kl_coef=0.05,
                                   on_policy=False)
_HEAD = Policy(temperature=TAU)   # log-probs at the sampling temperature
_replay = jax.jit(functools.partial(value_and_grad, _HEAD), static_argnums=(0, 3), static_argnames=("micro_batch",))
_naive = jax.jit(functools.partial(value_and_grad, _HEAD, layout="naive"), static_argnums=(0, 3))
_tree = jax.jit(functools.partial(value_and_grad, _HEAD), static_argnums=(0, 3))


def _loss_fields(lengths, dtype, *, budget, seed=1):
  """(advantages [G], trajectory weights [G], in_loss [G]) as algorithms/groups.py builds them with the
  options on: rewards shaped by the overlong penalty (buffer 12 of the budget), the trajectories of
  >= 8 tokens left out (mask_truncated), step_token_mean's weights scaled by B / N (B = 2, another
  group of 20 tokens in the loss)."""
  rng = np.random.default_rng(seed)
  lengths = np.asarray(lengths)
  rewards = rng.normal(size=len(lengths)) + obj.overlong_penalty(lengths, max_length=budget, buffer=12)
  adv = np.asarray(obj.group_advantages(jnp.asarray(rewards)), np.float64)
  in_loss = lengths < 8
  w = obj.trajectory_weights(lengths, mode="step_token_mean", max_length=budget, in_loss=in_loss)
  w = w * obj.step_token_scale(2, int(lengths[in_loss].sum()) + 20)
  return adv.astype(dtype), w.astype(dtype), in_loss


def _check(replay, naive, tol_grad, tol_loss):
  """Gradients, losses and metric sums (k3 KL, clipped count; a tree's summed over its levels) agree."""
  (lr, ar, gr), (ln, an, gn) = replay, naive
  parts = [ar] if isinstance(ar, dict) else [level.aux for level in ar]
  kl, clipped = sum(float(np.sum(p["kl"])) for p in parts), sum(int(np.sum(p["clipped"])) for p in parts)
  assert max_rel_err(gr, gn) <= tol_grad
  assert abs(float(lr) - float(ln)) <= tol_loss * max(1.0, abs(float(ln)))
  assert clipped == int(np.sum(an["clipped"])) and clipped > 0, "the case must exercise the clipped branch"
  assert abs(kl - float(np.sum(an["kl"]))) <= tol_loss * float(np.sum(an["kl"]))
  return an


def _group_case(dtype):
  graphdef, params = tiny_model(dtype, dtype)
  group = random_group(LENGTHS, completion_bucket=16)
  adv, w, in_loss = _loss_fields(group.lengths, dtype, budget=16)
  rng = np.random.default_rng(2)
  g, t = group.completion_ids.shape
  arrays = group_arrays(group, weights=(group.completion_mask * w[:, None]).astype(dtype), advantage=adv,
                        old_logp=(-4.2 + 0.3 * rng.normal(size=(g, t))).astype(dtype),
                        ref_logp=(-4.2 + 0.3 * rng.normal(size=(g, t))).astype(dtype))
  return (_replay(graphdef, params, arrays, GROUP_OBJECTIVE, micro_batch=7),
          _naive(graphdef, params, arrays, GROUP_OBJECTIVE), in_loss)


@pytest.mark.slow   # two compiles: replay and naive
def test_group_options_replay_equals_naive_float64(x64):
  replay, naive, in_loss = _group_case(np.float64)
  aux = _check(replay, naive, 1e-10, 1e-12)
  # The truncated completions' tokens are out of the loss and of its metrics.
  assert np.all(np.asarray(aux["kl"])[~in_loss] == 0.0) and np.all(np.asarray(aux["kl"])[in_loss] > 0)


@pytest.mark.slow   # two compiles: replay and naive
def test_group_options_replay_equals_naive_float32():
  replay, naive, _ = _group_case(np.float32)
  _check(replay, naive, 1e-4, 1e-5)


# A ragged depth-3 tree: trajectory 1 stops at depth 1 after one token; lengths (7, 1, 10, 9), budget 12.
_SEGMENTS = (5, 3, 2, 4, 1, 3, 2, 2)
TREE = RolloutTree(tuple(np.random.default_rng(3).integers(0, 64, n) for n in _SEGMENTS), (-1, 0, 1, 1, 0, 3, 3, 2),
                   (7, 4, 5, 6))


def _tree_case(dtype):
  # Trees take every option but GSPO's ratio off-policy (refused; on-policy it is the token ratio,
  # test_gspo_on_policy_equals_the_token_ratio): nested replay against the naive step over the trajectories.
  graphdef, params = tiny_model(dtype, dtype)
  adv, w, _ = _loss_fields(TREE.completion_lengths(), dtype, budget=12)
  rng = np.random.default_rng(4)
  old = [(-4.0 + 0.3 * rng.normal(size=len(s))).astype(dtype) for s in TREE.segments]
  ref = [(-4.0 + 0.3 * rng.normal(size=len(s))).astype(dtype) for s in TREE.segments]
  per_node = {"weights": [x.astype(dtype) for x in TREE.node_weights(w)], "old_logp": old, "ref_logp": ref}
  tree_arrs = tree_arrays(pad_tree(TREE), per_node, advantage=adv)
  naive_arrs = trajectory_group_arrays(TREE, {"old_logp": old, "ref_logp": ref}, w, vocab_size=64, max_positions=256,
                                       completion_bucket=16, advantage=adv)
  return (_tree(graphdef, params, tree_arrs, TREE_OBJECTIVE),
          _naive(graphdef, params, naive_arrs, TREE_OBJECTIVE))


@pytest.mark.slow   # two compiles: replay and naive
def test_tree_options_replay_equals_naive_float64(x64):
  _check(*_tree_case(np.float64), 1e-10, 1e-12)


@pytest.mark.heavy   # ~30 s; in CI: the same tree options in float64 (test_tree_options_replay_equals_naive_float64) and the group options in float32
def test_tree_options_replay_equals_naive_float32():
  _check(*_tree_case(np.float32), 1e-4, 1e-5)


def test_step_token_mean_rescales_tree_batches():
  # groups.step_token_mean on a tree's RolloutBatch: every (token, trajectory) pair in the loss gets B / N.
  # Tree lengths (7, 1, 10, 9) = 27 pairs, a second group of 4 pairs: B / N = 2 / 31. The tree's naive
  # layout (Group.naive_batch, the run-time exactness check's) gets the same weights: its 27 real
  # (token, trajectory) pairs weigh 2 / 31 each, so naive and replay losses stay equal.
  w = obj.trajectory_weights(TREE.completion_lengths(), mode="step_token_mean")
  batch = tree_arrays(pad_tree(TREE), {"weights": [x.astype(np.float32) for x in TREE.node_weights(w)]},
                      advantage=np.zeros(4, np.float32))
  naive = trajectory_group_arrays(TREE, {}, w.astype(np.float32), vocab_size=64, max_positions=256,
                                  completion_bucket=16, advantage=np.zeros(4, np.float32))
  other = group_arrays(random_group([4]), weights=np.ones((1, 8), np.float32))
  out = step_token_mean([_group(batch, TREE.completion_lengths(), tree=TREE, naive_batch=naive), _group(other, [4])])
  for before, after in zip(batch.levels, out[0].batch.levels):
    np.testing.assert_array_equal(np.asarray(after.weights),
                                  np.where(np.asarray(before.weights) > 0, np.float32(2 / 31), 0.0))
  weights = np.asarray(out[0].naive_batch.branches.weights)
  assert weights.dtype == np.float32 and np.count_nonzero(weights) == 27
  np.testing.assert_array_equal(weights[weights > 0], np.float32(2 / 31))
  assert out[1].naive_batch is None


# ---------------------------------------------------------------------------------------------
# Validation.

def test_an_old_grpo_config_with_clip_eps_names_the_new_fields(tmp_path):
  # A config written before the options: loss.clip_eps and none of the new fields. The schema refuses
  # it first, naming the two fields that replace it.
  config = grpo_smoke(tmp_path)
  for name in ("clip_eps_low", "clip_eps_high", "importance_ratio", "logprob_temperature",
               "mask_truncated", "overlong_buffer", "overlong_penalty"):
    del config.loss[name]
  del config.rollout.dynamic_sampling, config.rollout.max_prompt_draws
  config.loss.clip_eps = 0.2
  with pytest.raises(ValueError, match=r"loss.clip_eps=0.2: GRPO's clip range is loss.clip_eps_low and "
                                       r"loss.clip_eps_high \(set both equal for the symmetric clip\)"):
    train.validate(config)


@pytest.mark.parametrize("overrides,match", [
    ({"loss.clip_eps": 0.3}, r"loss.clip_eps=0.3: GRPO's clip range is loss.clip_eps_low and loss.clip_eps_high"),
    ({"loss.clip_eps_low": 1.0}, r"loss.clip_eps_low=1.0 must be in \(0, 1\)"),
    ({"loss.clip_eps_high": 0.0}, r"loss.clip_eps_high=0.0 must be a finite number > 0"),
    ({"loss.importance_ratio": "seq"}, "loss.importance_ratio='seq'"),
    # GSPO (arXiv 2507.18071) weighs each completion once; a token mean weighs it by its length: not GSPO.
    ({"loss.importance_ratio": "sequence", "loss.weighting": "group_token_mean"},
     "loss.importance_ratio='sequence' with loss.weighting='group_token_mean': GSPO weighs each completion once"),
    ({"loss.importance_ratio": "sequence", "loss.weighting": "step_token_mean"},
     "loss.importance_ratio='sequence' with loss.weighting='step_token_mean'"),
    # DAPO's clip-higher raises the upper bound; low 0.28 > high 0.2 is the reverse of what was meant.
    ({"loss.clip_eps_low": 0.28, "loss.clip_eps_high": 0.2},
     r"loss.clip_eps_low=0.28 > loss.clip_eps_high=0.2: clip-higher reversed"),
    ({"loss.logprob_temperature": "tempered"}, "loss.logprob_temperature='tempered'"),
    ({"loss.weighting": "token"}, "loss.weighting='token'"),
    ({"loss.overlong_buffer": 9}, r"loss.overlong_buffer=9 must be an int in \[0, 8\]"),
    ({"loss.overlong_penalty": -1.0}, "loss.overlong_penalty=-1.0"),
    ({"rollout.max_prompt_draws": 4}, "rollout.max_prompt_draws=4 applies to rollout.dynamic_sampling=True only"),
    ({"rollout.dynamic_sampling": True}, "rollout.max_prompt_draws=None must be a multiple"),
    ({"rollout.dynamic_sampling": True, "rollout.max_prompt_draws": 3},
     "rollout.max_prompt_draws=3 must be a multiple"),
])
def test_bad_option_fails_before_any_compute(tmp_path, overrides, match):
  with pytest.raises(ValueError, match=match):
    train.train(grpo_smoke(tmp_path, **overrides))
  assert not os.path.exists(os.path.join(tmp_path, "checkpoints"))


def test_off_policy_sequence_ratio_on_trees_and_grpo_options_in_ppo_are_refused(tmp_path):
  config = grpo_tree_smollm2_arith.get_config("smoke")
  config.run_dir = str(tmp_path)
  config.loss.importance_ratio = "sequence"
  config.train.inner_epochs = 2
  with pytest.raises(ValueError, match="loss.importance_ratio='sequence' with rollout.tree_fanouts=\\(2, 2\\) and "
                                       "train.inner_epochs=2"):
    train.train(config)
  config.train.inner_epochs = 1
  train.validate(config)   # on-policy: the token ratio's GRPO, exactly
  from experiments import ppo_smollm2_arith
  config = ppo_smollm2_arith.get_config("smoke")
  config.loss.mask_truncated = True
  with pytest.raises(ValueError, match="loss.mask_truncated=True is a GRPO option"):
    ppo.validate(config)


# ---------------------------------------------------------------------------------------------
# The loop with every option on: replay == naive, a resumed run == the uninterrupted one, the mesh.

# GSPO's sequence ratio is not among them: it weighs completions, not the token means below (refused together;
# its off-policy replay == naive is held at the objective level, GROUP_OBJECTIVE).
ALL_OPTIONS = {"loss.clip_eps_high": 0.28, "train.inner_epochs": 2,
               "loss.logprob_temperature": "sampling", "rollout.temperature": 0.7,
               "loss.mask_truncated": True, "loss.overlong_buffer": 4,
               "loss.weighting": "step_token_mean",
               "rollout.dynamic_sampling": True, "rollout.max_prompt_draws": 6}


def _sample_with_stops(*args, **kwargs):
  """The sampler, with what a random tiny model never produces (deterministic in the prompt and tokens):
  stops: a sample whose first token is even 'hits EOS' after 3 + first % 5 tokens, the others are cut by
  the budget; equal groups: for a prompt whose ids sum to a multiple of 3 every sample repeats the first,
  so the group's (shaped) rewards are all equal and dynamic sampling drops it."""
  ro = _SAMPLE_GROUP(*args, **kwargs)
  tokens, logprobs = np.asarray(ro.tokens), np.asarray(ro.logprobs)
  if int(np.sum(np.asarray(ro.prompt_ids))) % 3 == 0:
    tokens, logprobs = np.broadcast_to(tokens[:1], tokens.shape), np.broadcast_to(logprobs[:1], logprobs.shape)
  first = tokens[:, 0]
  finished = first % 2 == 0
  lengths = np.where(finished, 3 + first % 5, np.asarray(ro.lengths))
  return ro._replace(tokens=jnp.asarray(tokens), logprobs=jnp.asarray(logprobs),
                     lengths=jnp.asarray(lengths, jnp.int32), finished=jnp.asarray(finished))


_SAMPLE_GROUP = collect.sample_group


@pytest.fixture(scope="module")
def patched():
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(Task, "score", length_score)
    mp.setattr(collect, "sample_group", _sample_with_stops)
    yield


# The run-time exactness check (algorithms/exactness.py) at every step of the options runs: the step's
# groups after dynamic sampling and step_token_mean, log-probs at the sampling temperature on both sides.
CHECKED = {"train.exactness_check_every": 1}


def _checked(records):
  """Every step ran the check (its groups have unequal rewards) and replay matched naive to float32's bound."""
  for r in records:
    assert r["exactness_ok"] is True, r
    assert all(0 <= r[k] <= 1e-4 for k in ("exactness_grad_rel_err", "exactness_loss_rel_err",
                                            "exactness_kl_rel_err")), r


@pytest.fixture(scope="module")
def options_run(patched, tmp_path_factory):
  run_dir = tmp_path_factory.mktemp("options")
  return run_dir, train.train(grpo_smoke(run_dir, **ALL_OPTIONS, **CHECKED))


def _records(run_dir):
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _same_metrics(got, want):
  """A step's loss and metric sums in two layouts: float32 sums in another order. The loss cancels terms of
  ~0.1 down to ~1e-3 (advantages sum to ~0): absolute 1e-6. The KL (~1e-6 after one inner update) is a
  mean of k3 = exp(d) - d - 1 at |d| ~ 1e-3, each within ~1e-7 (float32's resolution of exp(d) ~ 1):
  absolute 1e-7. The clip fraction is a count over the same pairs: equal unless a ratio sits on the bound."""
  assert got["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-6)
  assert got["kl"] == pytest.approx(want["kl"], rel=1e-4, abs=1e-7)
  assert got["clip_frac"] == want["clip_frac"]


@pytest.mark.slow   # two smoke runs (2 steps each)
def test_options_run_replay_equals_naive(options_run, tmp_path):
  run_dir, history = options_run
  drawn = sum(r["prompts_drawn"] for r in history)
  params, meta = final_params(run_dir)
  assert meta["data_pos"] == drawn and all(r["prompts_drawn"] - r["dropped_groups"] == 2 for r in history)
  assert sum(r["dropped_groups"] for r in history) > 0, "the run must exercise dynamic sampling's drops"
  _checked(history)
  train.train(grpo_smoke(tmp_path, **ALL_OPTIONS, **{"train.gradient": "naive"}))
  naive_params, _ = final_params(tmp_path)
  assert max_rel(naive_params, params) <= 1e-5
  for got, want in zip(_records(tmp_path), _records(run_dir)):
    for name in ("prompts_drawn", "dropped_groups", "zero_variance_groups", "reward_mean"):
      assert got[name] == want[name], name
    _same_metrics(got, want)


@pytest.mark.heavy   # two smoke runs, ~1.5 min on 2 loaded cores (test_train.py resumes the default run in CI)
def test_options_run_resumes_exactly(options_run, tmp_path):
  # Dynamic sampling advances the data position over every drawn prompt, which the checkpoint keeps.
  run_dir, _ = options_run
  train.train(grpo_smoke(tmp_path, **ALL_OPTIONS, **{"train.steps": 1}))
  train.train(grpo_smoke(tmp_path, **ALL_OPTIONS, resume=True))
  (got, got_meta), (want, want_meta) = final_params(tmp_path), final_params(run_dir)
  assert got_meta == want_meta and max_rel(got, want) <= 1e-6
  assert [r["prompts_drawn"] for r in _records(tmp_path)] == [r["prompts_drawn"] for r in _records(run_dir)]


@pytest.mark.heavy   # ~2 min on 2 loaded cores: a mesh smoke run with FSDP and the check at every step
@pytest.mark.skipif(jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
def test_options_run_on_a_mesh_equals_one_device(options_run, tmp_path):
  run_dir, _ = options_run
  # Dynamic sampling on the mesh: every round samples data-parallel (loop.sample_groups with the mesh's
  # sampling devices), the same tokens as on one device, so the same groups are kept.
  train.train(grpo_smoke(tmp_path, **ALL_OPTIONS, **CHECKED, **{"mesh.data": 2, "mesh.branch": 2, "mesh.seq": 2,
                                                           "mesh.params": "fsdp"}))
  assert max_rel(final_params(tmp_path)[0], final_params(run_dir)[0]) <= 1e-5
  _checked(_records(tmp_path))
  for got, want in zip(_records(tmp_path), _records(run_dir)):
    for name in ("prompts_drawn", "dropped_groups", "reward_mean"):
      assert got[name] == want[name], name
    _same_metrics(got, want)


@pytest.mark.heavy   # two tree runs, ~1-2 min on 2 cores: covered by test_tree_options_replay_equals_naive_* and
#                     test_train.py's tree runs (the default options)
def test_tree_options_run_replay_equals_naive(patched, tmp_path):
  # The tree experiment's smoke variant with the options trees take (GSPO's ratio only on-policy, where it is
  # the token ratio: inner_epochs 2 here exercises old log-probs at the sampling temperature instead); the
  # sampler patch above is for groups, so no trajectory stops early and none is masked.
  options = {k: v for k, v in ALL_OPTIONS.items() if k not in ("loss.importance_ratio", "loss.mask_truncated")}
  runs, records = {}, {}
  for mode in ("replay", "naive"):
    config = grpo_tree_smollm2_arith.get_config("smoke")
    config.run_dir = str(tmp_path / mode)
    for dotted, value in {**options, "train.gradient": mode}.items():
      section, name = dotted.split(".")
      config[section][name] = value
    train.train(config)
    runs[mode], records[mode] = final_params(tmp_path / mode)[0], _records(tmp_path / mode)
  assert max_rel(runs["replay"], runs["naive"]) <= 1e-5
  for got, want in zip(records["replay"], records["naive"]):
    for name in ("prompts_drawn", "dropped_groups", "reward_mean"):
      assert got[name] == want[name], name
    _same_metrics(got, want)
