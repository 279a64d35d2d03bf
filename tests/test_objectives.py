"""Advantages, loss normalisation and the GRPO token loss against hand-computed values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from branch_replay_jax import losses as obj


def c01_case():
  # G=4, lengths 3, 50, 50, 50, rewards 1, 0, 0, 0. Unbiased std of (1,0,0,0) is 0.5, mean 0.25,
  # so A = (+1.5, -0.5, -0.5, -0.5) (eps=0 to keep the hand values exact).
  lengths = np.array([3, 50, 50, 50])
  adv = np.asarray(obj.group_advantages(jnp.array([1.0, 0.0, 0.0, 0.0]), eps=0.0))
  return lengths, adv


def test_group_advantages_unbiased_std():
  _, adv = c01_case()
  np.testing.assert_allclose(adv, [1.5, -0.5, -0.5, -0.5], rtol=1e-6)
  # Equal rewards: the eps keeps A at exactly 0 (no NaN) -- a zero-variance group gives no gradient.
  np.testing.assert_array_equal(obj.group_advantages(jnp.ones(4)), np.zeros(4))
  with pytest.raises(ValueError, match="G=1"):
    obj.group_advantages(jnp.ones(1))


@pytest.mark.parametrize("mode,loss,short_w,long_w", [
    # Per-sequence mean: Σ_g (1/G)(1/|o_g|) Σ_t (-A_g) = -(1/G) Σ_g A_g = 0.
    ("sequence_mean", 0.0, -1.5 / (4 * 3), 0.5 / (4 * 50)),
    # Token mean: -(3*1.5 - 150*0.5) / 153 = 70.5 / 153 = 0.46078.
    ("token_mean", 70.5 / 153, -1.5 / 153, 0.5 / 153),
    # Dr. GRPO with L_max = 50: 70.5 / (4 * 50) = 0.3525.
    ("constant", 70.5 / 200, -1.5 / 200, 0.5 / 200),
])
def test_c01_loss_normalisation(mode, loss, short_w, long_w):
  # On-policy (ratio 1), beta = 0: the per-token loss is -A, its gradient w.r.t. logp is -A * w.
  lengths, adv = c01_case()
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
    obj.token_weights([1, 5], 4, mode="token_mean")
  with pytest.raises(ValueError, match=r"\[0, 4\]"):
    obj.token_weights([-1, 2], 4, mode="token_mean")
  with pytest.raises(ValueError, match="empty"):
    obj.token_weights([0, 0], 4, mode="token_mean")


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
  # IPO on sums (loss_type "ipo_sum"; "ipo" is the length-normalised form, tests/test_field_faults_p9.py):
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
