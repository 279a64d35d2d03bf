"""Advantages, loss weightings and the GRPO token loss against hand-computed values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from branch_replay_jax import losses as obj


def short_and_long_case():
  # G=4, lengths 3, 50, 50, 50, rewards 1, 0, 0, 0. Unbiased std of (1,0,0,0) is 0.5, mean 0.25,
  # so A = (+1.5, -0.5, -0.5, -0.5) (eps=0 to keep the hand values exact).
  lengths = np.array([3, 50, 50, 50])
  adv = np.asarray(obj.group_advantages(jnp.array([1.0, 0.0, 0.0, 0.0]), eps=0.0))
  return lengths, adv


def test_group_advantages_unbiased_std():
  _, adv = short_and_long_case()
  np.testing.assert_allclose(adv, [1.5, -0.5, -0.5, -0.5], rtol=1e-6)
  # Equal rewards: the eps keeps A at exactly 0 (no NaN) -- a zero-variance group gives no gradient.
  np.testing.assert_array_equal(obj.group_advantages(jnp.ones(4)), np.zeros(4))
  with pytest.raises(ValueError, match="G=1"):
    obj.group_advantages(jnp.ones(1))


@pytest.mark.parametrize("mode,loss,short_w,long_w", [
    # Per-sequence mean: Σ_g (1/G)(1/|o_g|) Σ_t (-A_g) = -(1/G) Σ_g A_g = 0.
    ("sequence_mean", 0.0, -1.5 / (4 * 3), 0.5 / (4 * 50)),
    # Token mean: -(3*1.5 - 150*0.5) / 153 = 70.5 / 153 = 0.46078.
    ("group_token_mean", 70.5 / 153, -1.5 / 153, 0.5 / 153),
    # The step's token mean before the step's scale B / N: the sum, -(3*1.5 - 150*0.5) = 70.5.
    ("step_token_mean", 70.5, -1.5, 0.5),
    # Dr. GRPO with L_max = 50: 70.5 / (4 * 50) = 0.3525.
    ("constant", 70.5 / 200, -1.5 / 200, 0.5 / 200),
])
def test_loss_weightings_give_the_hand_values(mode, loss, short_w, long_w):
  # On-policy (ratio 1), beta = 0: the per-token loss is -A, its gradient w.r.t. logp is -A * w.
  lengths, adv = short_and_long_case()
  w = obj.token_weights(lengths, 50, mode=mode, max_length=50)
  logp = jnp.full((4, 50), -1.0)

  def total(logp):
    per_token, _ = obj.grpo_token_loss(logp, jax.lax.stop_gradient(logp), logp, jnp.asarray(adv)[:, None])
    return jnp.sum(jnp.asarray(w) * per_token)

  value, grad = jax.value_and_grad(total)(logp)
  np.testing.assert_allclose(value, loss, atol=1e-6)
  np.testing.assert_allclose(grad[0, 0], short_w, rtol=1e-5)
  np.testing.assert_allclose(grad[1, 0], long_w, rtol=1e-5)
  assert float(grad[0, 3]) == 0.0, "padding beyond the short completion carries no weight"


def test_token_weights_rejects_bad_input():
  with pytest.raises(ValueError, match="mode='mean'"):
    obj.token_weights([1, 2], 4, mode="mean")
  with pytest.raises(ValueError, match=r"\[0, 4\]"):
    obj.token_weights([1, 5], 4, mode="group_token_mean")
  with pytest.raises(ValueError, match=r"\[0, 4\]"):
    obj.token_weights([-1, 2], 4, mode="group_token_mean")
  with pytest.raises(ValueError, match="empty"):
    obj.token_weights([0, 0], 4, mode="group_token_mean")


def test_k3_kl_values():
  # k3(p, q) = exp(q - p) - (q - p) - 1: 0 when equal; exp(1) - 2 = 0.71828 for q - p = 1.
  np.testing.assert_allclose(obj.k3_kl(jnp.array([-2.0, -2.0]), jnp.array([-2.0, -1.0])), [0.0, np.e - 2], rtol=1e-6)


def test_grpo_clip_hand_case():
  # old_logp = 0, logp = log(1.5): ratio 1.5. With A = +1 and eps = 0.2 the clipped term 1.2 wins
  # (min(1.5, 1.2)), loss -1.2, zero gradient (clipped). With A = -1: min(-1.5, -1.2) = -1.5,
  # loss +1.5, d loss / d logp = +ratio = +1.5, not clipped.
  logp = jnp.log(jnp.array([1.5, 1.5]))
  adv = jnp.array([1.0, -1.0])
  f = lambda lp: obj.grpo_token_loss(lp, jnp.zeros(2), jnp.zeros(2), adv, clip_eps=0.2)
  (loss, metrics) = f(logp)
  np.testing.assert_allclose(loss, [-1.2, 1.5], rtol=1e-6)
  np.testing.assert_array_equal(metrics["clipped"], [True, False])
  grad = jax.grad(lambda lp: jnp.sum(f(lp)[0]))(logp)
  np.testing.assert_allclose(grad, [0.0, 1.5], rtol=1e-6)


def test_rloo_advantages_hand_case():
  # Rewards (1, 0, 0, 1), G = 4, total 2. Leave-one-out baselines: for r=1 the others are (0, 0, 1),
  # mean 1/3, so A = 1 - 1/3 = 2/3; for r=0 the others are (1, 0, 1), mean 2/3, so A = 0 - 2/3 = -2/3.
  np.testing.assert_allclose(obj.rloo_advantages(jnp.array([1.0, 0.0, 0.0, 1.0])), [2 / 3, -2 / 3, -2 / 3, 2 / 3],
                             rtol=1e-6)
  # G = 2: each baseline is the other reward: (3, 1) -> (3 - 1, 1 - 3) = (2, -2). Leading axes are batches.
  np.testing.assert_allclose(obj.rloo_advantages(jnp.array([[3.0, 1.0], [0.5, 0.5]])), [[2.0, -2.0], [0.0, 0.0]])
  with pytest.raises(ValueError, match="G=1"):
    obj.rloo_advantages(jnp.ones(1))


def test_rloo_is_a_rescaled_mean_baseline():
  # A_i = r_i - (S - r_i)/(G-1) = G/(G-1) (r_i - mean r): the group-mean baseline scaled by G/(G-1).
  r = jnp.array([0.3, 1.7, -0.4, 2.2, 0.0])
  np.testing.assert_allclose(obj.rloo_advantages(r), 5 / 4 * (r - r.mean()), rtol=1e-5, atol=1e-6)


def test_dpo_sigmoid_and_ipo_hand_case():
  # Log-prob sums: policy chosen -10, rejected -12; reference chosen -11, rejected -11.
  # h = (-10 - -11) - (-12 - -11) = 1 - (-1) = 2. beta = 0.1: beta*h = 0.2.
  # sigmoid: -log sigmoid(0.2) = log(1 + exp(-0.2)) = 0.598139; d/dh = -beta * sigmoid(-0.2) = -0.045017.
  # IPO on sums (loss_type "ipo_sum"; "ipo" is the length-normalised form, test_preference_losses_by_hand_on_one_pair):
  # (tau = beta = 0.1): (h - 1/(2*0.1))^2 = (2 - 5)^2 = 9; d/dh = 2 (h - 5) = -6.
  pc, pr, rc, rr = (jnp.array([x]) for x in (-10.0, -12.0, -11.0, -11.0))
  loss, m = obj.dpo_loss(pc, pr, rc, rr, beta=0.1)
  np.testing.assert_allclose(loss, [np.log1p(np.exp(-0.2))], rtol=1e-6)
  np.testing.assert_allclose(loss, [0.598139], rtol=1e-5)
  np.testing.assert_allclose(m["chosen_reward"], [0.1], rtol=1e-5)      # 0.1 * (-10 + 11)
  np.testing.assert_allclose(m["rejected_reward"], [-0.1], rtol=1e-5)   # 0.1 * (-12 + 11)
  np.testing.assert_allclose(m["margin"], [0.2], rtol=1e-5)
  assert bool(m["correct"][0])
  grad = jax.grad(lambda c, r: obj.dpo_loss(c, r, rc, rr, beta=0.1)[0].sum(), argnums=(0, 1))(pc, pr)
  np.testing.assert_allclose(grad[0], [-0.1 / (1 + np.exp(0.2))], rtol=1e-5)   # -0.045017
  np.testing.assert_allclose(grad[1], [+0.1 / (1 + np.exp(0.2))], rtol=1e-5)
  loss, _ = obj.dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type="ipo_sum")
  np.testing.assert_allclose(loss, [9.0], rtol=1e-6)
  grad = jax.grad(lambda c: obj.dpo_loss(c, pr, rc, rr, beta=0.1, loss_type="ipo_sum")[0].sum())(pc)
  np.testing.assert_allclose(grad, [-6.0], rtol=1e-6)
  with pytest.raises(ValueError, match="loss_type='hinge'"):
    obj.dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type="hinge")
  with pytest.raises(ValueError, match="beta=0"):
    obj.dpo_loss(pc, pr, rc, rr, beta=0)


# ---- constant-reward groups: exactly 0 advantage; whitening; explained variance -----------------------

# The reported inputs: sixteen 1.1 (a correct answer plus the format bonus), four 0.1 and three 0.1
# with eps = 0. Before the fix, float32 gave -0.1061 (16 x 1.1), NaN (4 x 0.1, eps 0) and -0.8165
# (3 x 0.1, eps 0) for every member: the residue of an inexact mean over its own std.
CONSTANT_GROUPS = [(16, 1.1, 1e-6), (4, 0.1, 0.0), (3, 0.1, 0.0)]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float64]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("g,value,eps", CONSTANT_GROUPS)
def test_constant_group_has_exactly_zero_advantage(x64, dtype, g, value, eps):
  # A group of equal rewards says nothing about which completion is better: every estimator must
  # give exactly 0 (not a rounding residue that pushes every correct answer down), never NaN.
  rewards = jnp.full((g,), value, dtype)
  for ddof in (0, 1):
    for e in (eps, 0.0, 1e-6, 1.0):
      adv = np.asarray(obj.group_advantages(rewards, eps=e, ddof=ddof))
      np.testing.assert_array_equal(adv, np.zeros(g))
  np.testing.assert_array_equal(np.asarray(obj.rloo_advantages(rewards)), np.zeros(g))
  assert bool(obj.constant_groups(rewards))


def test_constant_rows_are_zeroed_and_other_rows_keep_the_formula():
  # A batch of groups: only the constant row is special-cased; the other keeps (r - mean) / std
  # (unbiased std of (1, 0, 0, 0) is 0.5, mean 0.25 -> 1.5, -0.5, -0.5, -0.5) and RLOO's
  # G/(G-1) (r - mean) = 4/3 * (0.75, -0.25, -0.25, -0.25).
  rewards = jnp.array([[1.1, 1.1, 1.1, 1.1], [1.0, 0.0, 0.0, 0.0]], jnp.float32)
  np.testing.assert_array_equal(obj.group_advantages(rewards, eps=0.0)[0], np.zeros(4))
  np.testing.assert_allclose(obj.group_advantages(rewards, eps=0.0)[1], [1.5, -0.5, -0.5, -0.5], rtol=1e-6)
  np.testing.assert_array_equal(obj.rloo_advantages(rewards)[0], np.zeros(4))
  np.testing.assert_allclose(obj.rloo_advantages(rewards)[1], [1.0, -1 / 3, -1 / 3, -1 / 3], rtol=1e-6)
  np.testing.assert_array_equal(obj.constant_groups(rewards), [True, False])
  with pytest.raises(ValueError, match="eps=-1"):
    obj.group_advantages(rewards, eps=-1.0)


def test_zero_std_without_equal_rewards_gives_zero_not_nan():
  # eps = 0 and rewards that differ by less than the square root of the smallest float32: the
  # squares underflow, the std is 0 although the group is not constant. 0, not inf or NaN.
  rewards = jnp.array([0.0, 1e-30, 0.0], jnp.float32)
  adv = np.asarray(obj.group_advantages(rewards, eps=0.0))
  assert np.isfinite(adv).all()


def test_zero_variance_metric_agrees_with_the_advantages():
  # train.step_record counts zero_variance_groups as np.ptp(rewards) == 0; constant_groups is the
  # same test, so the metric counts exactly the groups whose advantages are 0.
  rng = np.random.default_rng(0)
  groups = [np.full(8, 1.1, np.float32), rng.integers(0, 2, 8).astype(np.float32), np.full(8, 0.0, np.float32),
            np.array([0.1] * 7 + [0.1 + 1e-7], np.float32)]
  for r in groups:
    adv = np.asarray(obj.group_advantages(jnp.asarray(r)))
    assert (np.ptp(r) == 0) == bool(obj.constant_groups(jnp.asarray(r))) == (not adv.any())


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("value", [0.1, 0.5, 1.1, 0.123])
def test_whitening_a_constant_advantage_gives_zero(x64, dtype, value):
  # PPO whitens GAE advantages over the step's (token, trajectory) pairs. All equal -> exactly 0
  # on every pair (numpy's (a - mean) / (std + 1e-8) gave -0.598 for 1234 copies of 0.1).
  adv = jnp.full((1234,), value, dtype)
  np.testing.assert_array_equal(np.asarray(obj.whiten(adv)), np.zeros(1234))
  # Masked: the padding is ignored in the statistics and is 0 in the output.
  padded = jnp.concatenate([adv, jnp.full((10,), 7.0, dtype)])
  mask = np.arange(1244) < 1234
  np.testing.assert_array_equal(np.asarray(obj.whiten(padded, mask)), np.zeros(1244))
  np.testing.assert_array_equal(np.asarray(obj.whiten(adv[:1], eps=0.0)), [0.0])   # one entry: 0, not NaN


def test_whitening_matches_the_formula_on_real_entries():
  # Non-constant: (x - mean) / (std + eps) with population std over the masked entries only.
  x = np.array([[1.0, 2.0, 3.0, 99.0], [4.0, 5.0, 99.0, 99.0]], np.float32)
  mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], bool)
  real = x[mask]
  expected = np.where(mask, (x - real.mean()) / (real.std() + 1e-8), 0.0)
  np.testing.assert_allclose(obj.whiten(x, mask), expected, rtol=1e-6, atol=1e-7)


def test_explained_variance_is_undefined_for_equal_returns():
  # float32 np.var of 1234 copies of 0.1 is 2.2e-16, not 0: dividing by it made an arbitrary
  # huge negative metric. Equal returns -> None; otherwise 1 - Var[R - V] / Var[R].
  assert obj.explained_variance(np.full(1234, 0.1, np.float32), np.zeros(1234)) is None
  r, v = np.array([1.0, 2.0, 3.0]), np.array([1.0, 2.0, 2.0])
  assert obj.explained_variance(r, v) == pytest.approx(1 - np.var(r - v) / np.var(r))


# ---- preference losses: length-normalised IPO and conservative DPO ------------------------------------

# One pair: chosen 4 tokens, policy -1 / reference -1.5 per token (sums -4 / -6, Δ_w = 2,
# mean 0.5); rejected 2 tokens, policy -2 / reference -1.5 (sums -4 / -3, Δ_l = -1, mean -0.5).
PAIR = dict(policy_chosen=jnp.array([-4.0]), policy_rejected=jnp.array([-4.0]), ref_chosen=jnp.array([-6.0]),
            ref_rejected=jnp.array([-3.0]))
LENGTHS = dict(chosen_lengths=jnp.array([4]), rejected_lengths=jnp.array([2]))


def _loss(**kw):
  return float(obj.dpo_loss(**PAIR, beta=0.1, **kw)[0][0])


def test_preference_losses_by_hand_on_one_pair():
  # sum-form h = 2 - (-1) = 3, beta h = 0.3.
  # DPO: -log sigmoid(0.3) = softplus(-0.3) = 0.554355.
  assert _loss() == pytest.approx(0.554355, abs=1e-6)
  # Conservative DPO, eps = 0.1: 0.9 softplus(-0.3) + 0.1 softplus(0.3) = 0.498920 + 0.085436 = 0.584355.
  assert _loss(label_smoothing=0.1) == pytest.approx(0.584355, abs=1e-6)
  # IPO on mean log-probs: h = 0.5 - (-0.5) = 1, (1 - 1/(2*0.1))^2 = (1 - 5)^2 = 16.
  assert _loss(loss_type="ipo", **LENGTHS) == pytest.approx(16.0, abs=1e-5)
  # IPO on sums (Azar et al. eq. 17 on sequence log-probs): (3 - 5)^2 = 4 (what "ipo" computed before).
  assert _loss(loss_type="ipo_sum") == pytest.approx(4.0, abs=1e-5)


def test_ipo_mean_gradient_is_the_mean_gradient_over_each_length():
  # dL/dh = 2 (h - 5) = -8 at h = 1; h = S_w/4 - S_l/2 + const, so dL/dS_w = -8/4 = -2 and
  # dL/dS_l = +8/2 = +4: each sequence's gradient is the mean's divided by its length.
  def loss(pc, pr):
    return obj.dpo_loss(pc, pr, PAIR["ref_chosen"], PAIR["ref_rejected"], beta=0.1, loss_type="ipo", **LENGTHS)[0][0]
  d_chosen, d_rejected = jax.grad(loss, argnums=(0, 1))(PAIR["policy_chosen"], PAIR["policy_rejected"])
  assert float(d_chosen[0]) == pytest.approx(-2.0, abs=1e-5)
  assert float(d_rejected[0]) == pytest.approx(4.0, abs=1e-5)
  h = jnp.array(1.0)
  assert float(jax.grad(lambda h: (h - 1 / (2 * 0.1)) ** 2)(h)) == pytest.approx(-8.0)


def test_preference_loss_refuses_bad_arguments():
  with pytest.raises(ValueError, match="label_smoothing=0.1"):
    obj.dpo_loss(**PAIR, beta=0.1, loss_type="ipo", label_smoothing=0.1, **LENGTHS)
  with pytest.raises(ValueError, match="label_smoothing=0.1"):
    obj.dpo_loss(**PAIR, beta=0.1, loss_type="ipo_sum", label_smoothing=0.1)
  with pytest.raises(ValueError, match="label_smoothing=0.5"):
    obj.dpo_loss(**PAIR, beta=0.1, label_smoothing=0.5)
  with pytest.raises(ValueError, match="chosen_lengths"):
    obj.dpo_loss(**PAIR, beta=0.1, loss_type="ipo")
  with pytest.raises(ValueError, match="rejected_lengths"):
    obj.dpo_loss(**PAIR, beta=0.1, loss_type="ipo", chosen_lengths=jnp.array([4]), rejected_lengths=jnp.array([0]))


def test_a_completion_is_a_tree_node_with_one_trajectory(x64):
  """One objective per algorithm (P21): grpo_objective / ppo_objective take a completion (weights [T])
  and a tree node (weights [T, G]). A completion's loss, metric sums and gradient must equal those of
  the same tokens as a node with G = 1, and a node's must be the sum over its trajectories of each
  one's completion loss (the loss is a sum of (token, trajectory) terms). Hand data, float64, clipped
  and unclipped tokens both present (ratios 0.5..1.8 against the clip 0.8..1.28)."""
  from branch_replay_jax.data.batches import Segments
  logp = jnp.log(jnp.array([0.5, 0.2, 0.9, 0.3]))
  old = jnp.log(jnp.array([0.3, 0.4, 0.5, 0.3]))
  ref = jnp.log(jnp.array([0.4, 0.2, 0.8, 0.5]))
  mask = jnp.array([True, True, True, False])
  w = jnp.array([[0.25, 0.1], [0.25, 0.1], [0.0, 0.1], [0.0, 0.0]])   # trajectory 0 leaves the loss at token 2
  adv = jnp.array([1.0, -0.5])
  kw = dict(clip_eps=0.2, clip_eps_high=0.28, kl_coef=0.05, on_policy=False)
  node = Segments(jnp.zeros(4, jnp.int32), mask, weights=w, advantage=adv, old_logp=old, ref_logp=ref)
  rows = [Segments(jnp.zeros(4, jnp.int32), mask, weights=w[:, g], advantage=adv[g], old_logp=old, ref_logp=ref)
          for g in range(2)]
  grad = lambda seg: jax.grad(lambda lp: obj.grpo_objective(lp, seg, **kw)[0])(logp)
  node_loss, node_aux = obj.grpo_objective(logp, node, **kw)
  row_out = [obj.grpo_objective(logp, r, **kw) for r in rows]
  np.testing.assert_allclose(node_loss, sum(l for l, _ in row_out), rtol=1e-14)
  for k in ("kl", "clipped"):
    np.testing.assert_allclose(node_aux[k], sum(a[k] for _, a in row_out), rtol=1e-14)
  np.testing.assert_allclose(grad(node), grad(rows[0]) + grad(rows[1]), rtol=1e-13)
  assert float(node_aux["clipped"]) > 0 and float(node_aux["clipped"]) < 4   # both cases exercised
  one = rows[0].replace(weights=rows[0].weights[:, None], advantage=rows[0].advantage[None])
  np.testing.assert_array_equal(obj.grpo_objective(logp, one, **kw)[0], row_out[0][0])
  with pytest.raises(ValueError, match="importance_ratio='sequence' needs whole completions"):
    obj.grpo_objective(logp, node, **kw, importance_ratio="sequence")
  ppo_kw = dict(clip_eps=0.2, vf_coef=0.5, value_clip=0.2)
  values, old_values = jnp.array([0.1, 0.4, -0.2, 0.0]), jnp.array([0.0, 0.5, 0.1, 0.0])
  ppo_node = node.replace(advantage=jnp.stack([adv] * 4), returns=jnp.full((4, 2), 0.3), old_values=old_values)
  ppo_rows = [ppo_node.replace(weights=w[:, g], advantage=ppo_node.advantage[:, g], returns=ppo_node.returns[:, g])
              for g in range(2)]
  np.testing.assert_allclose(obj.ppo_objective(logp, values, ppo_node, **ppo_kw)[0],
                             sum(obj.ppo_objective(logp, values, r, **ppo_kw)[0] for r in ppo_rows), rtol=1e-14)
