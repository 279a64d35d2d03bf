"""P9 field faults (round 2), the items of objectives, samplers, tasks and the GGUF reader.

Each test states the right value and why; the issue's inputs are used verbatim.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from branch_replay_jax import losses as obj

# ---- 1. constant-reward groups: exactly 0 advantage --------------------------------------------

# The issue's inputs: sixteen 1.1 (a correct answer plus the format bonus), four 0.1 and three 0.1
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


# ---- 2. GAE bootstraps a completion cut by its token budget -------------------------------------

from flax import nnx  # noqa: E402

from branch_replay_jax.models import Llama, tiny_config  # noqa: E402
from branch_replay_jax.rollout.sampler import sample_group  # noqa: E402
from branch_replay_jax.rollout.tree_sampler import sample_tree  # noqa: E402

PROMPT = [3, 17, 42, 8, 9, 60, 1]


@pytest.fixture(scope="module")
def model():
  return Llama(tiny_config(), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("lam,truncated,terminated", [
    # gamma 1, rewards 0, V = (0.3, 0.5, 0.7), V(after the last token) = 0.9.
    # Truncated, lambda 1: A_t = V_next_last - V_t = 0.9 - V_t = (0.6, 0.4, 0.2).
    # Truncated, lambda 0.9: deltas (0.2, 0.2, 0.2); A_2 = 0.2, A_1 = 0.2 + 0.9*0.2 = 0.38,
    #   A_0 = 0.2 + 0.9*0.38 = 0.542.
    # Terminated (V = 0 after the end), lambda 1: A_t = -V_t; lambda 0.9: deltas (0.2, 0.2, -0.7),
    #   A_1 = 0.2 - 0.63 = -0.43, A_0 = 0.2 - 0.387 = -0.187.
    (1.0, [0.6, 0.4, 0.2], [-0.3, -0.5, -0.7]),
    (0.9, [0.542, 0.38, 0.2], [-0.187, -0.43, -0.7]),
])
def test_gae_bootstraps_a_truncated_completion(lam, truncated, terminated):
  # Row 0 truncated, row 1 the same trajectory terminated (EOS on its last token), row 2 truncated
  # after 2 tokens with garbage on its padding: the bootstrap goes to the last REAL token.
  rewards = np.zeros((3, 4))
  values = np.array([[0.3, 0.5, 0.7, 5.0], [0.3, 0.5, 0.7, 5.0], [0.5, 0.7, 5.0, 5.0]])
  mask = np.array([[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 0, 0]], bool)
  adv, ret = obj.gae(rewards, values, mask, gamma=1.0, lam=lam, truncated_b=np.array([True, False, True]),
                     next_values_b=np.array([0.9, 0.9, 0.9]))
  np.testing.assert_allclose(adv[0], truncated + [0.0], atol=1e-6)
  np.testing.assert_allclose(adv[1], terminated + [0.0], atol=1e-6)
  np.testing.assert_allclose(adv[2], truncated[1:] + [0.0, 0.0], atol=1e-6)
  # Value targets R = A + V: with lambda 1 and a bootstrap, R_t = 0.9 for every token.
  np.testing.assert_allclose(ret[0, :3], np.array(truncated) + [0.3, 0.5, 0.7], atol=1e-6)
  # Without flags every row is terminated: today's values, unchanged.
  adv_default, _ = obj.gae(rewards, values, mask, gamma=1.0, lam=lam)
  np.testing.assert_allclose(adv_default[0], terminated + [0.0], atol=1e-6)
  np.testing.assert_array_equal(adv_default[1], adv[1])
  with pytest.raises(ValueError, match="next_values_b"):
    obj.gae(rewards, values, mask, gamma=1.0, lam=lam, truncated_b=np.array([True, False, True]))


def _key_with_new_last_token(sample, n_last):
  """The first key in 0..99 whose sample's last token does not occur before it (so an EOS equal to
  it stops the sample exactly on the budget's last token)."""
  for seed in range(100):
    toks = sample(jax.random.key(seed))
    if toks[n_last] not in toks[:n_last]:
      return seed, toks
  raise AssertionError("no key found")


def test_sample_group_reports_the_stop_reason(model):
  # Cut by the budget -> truncated; the same sample with EOS = its last token -> not truncated
  # although its length equals the budget (the reason is the EOS, not the width).
  n = 6
  draw = lambda key: np.asarray(sample_group(model, PROMPT, num_samples=1, max_new_tokens=n, key=key).tokens[0])
  seed, toks = _key_with_new_last_token(draw, n - 1)
  free = sample_group(model, PROMPT, num_samples=1, max_new_tokens=n, key=jax.random.key(seed))
  assert free.truncated.tolist() == [True] and int(free.lengths[0]) == n
  stopped = sample_group(model, PROMPT, num_samples=1, max_new_tokens=n, key=jax.random.key(seed),
                         eos_ids=[int(toks[-1])])
  np.testing.assert_array_equal(np.asarray(stopped.tokens[0]), toks)
  assert stopped.truncated.tolist() == [False] and int(stopped.lengths[0]) == n
  # GAE with the sampler's flag: the EOS row is exactly the terminated default.
  values = np.linspace(0.1, 0.6, n)[None]
  rewards, mask = np.zeros((1, n)), np.ones((1, n), bool)
  a_stop, _ = obj.gae(rewards, values, mask, gamma=1.0, lam=0.95, truncated_b=np.asarray(stopped.truncated),
                      next_values_b=np.array([0.9]))
  np.testing.assert_array_equal(a_stop, obj.gae(rewards, values, mask, gamma=1.0, lam=0.95)[0])
  a_cut, _ = obj.gae(rewards, values, mask, gamma=1.0, lam=1.0, truncated_b=np.asarray(free.truncated),
                     next_values_b=np.array([0.9]))
  np.testing.assert_allclose(a_cut[0], 0.9 - values[0], atol=1e-6)


def test_sample_tree_reports_the_stop_reason(model):
  # fanouts [2, 2], S = 3: budget 6 tokens per trajectory. EOS = trajectory 0's 6th token, absent
  # elsewhere in the tree: trajectory 0 ends there (finished on the budget's last token, not
  # truncated), the other three are cut by the budget (truncated).
  kw = dict(fanouts=[2, 2], segment_length=3)
  for seed in range(100):
    free = sample_tree(model, PROMPT, key=jax.random.key(seed), **kw)
    tree = free.tree
    eos = int(tree.completion(0)[-1])
    others = [int(t) for n in range(1, len(tree.segments)) if n != tree.ends[0] for t in tree.segments[n]]
    if eos not in others and eos not in tree.segments[tree.ends[0]][:-1].tolist():
      break
  else:
    raise AssertionError("no key found")
  assert free.truncated.tolist() == [True] * 4
  stopped = sample_tree(model, PROMPT, key=jax.random.key(seed), eos_ids=[eos], **kw)
  assert stopped.tree.parents == tree.parents
  assert len(stopped.tree.completion(0)) == 6
  assert stopped.truncated.tolist() == [False, True, True, True]


# ---- 3. top-p at its boundary --------------------------------------------------------------------

from conftest import forward_logits  # noqa: E402

from branch_replay_jax.rollout import sampler as sampling  # noqa: E402


def kept_ids(logits, top_p):
  return np.flatnonzero(np.isfinite(np.asarray(sampling.top_p_filter(jnp.asarray(logits)[None], top_p))[0]))


def test_top_p_keeps_the_smallest_set_that_reaches_p():
  # [0.3, 0.1, 0.1, 0.5], top_p 0.8: {3, 0} has mass exactly 0.8, which reaches p; the old filter
  # (mass before a token computed as cumsum - p, rounded below p) kept all four.
  np.testing.assert_array_equal(kept_ids(jnp.log(jnp.array([0.3, 0.1, 0.1, 0.5])), 0.8), [0, 3])
  # Traced top_p (as inside the sampler's jit): the same set.
  jitted = jax.jit(sampling.top_p_filter)(jnp.log(jnp.array([[0.3, 0.1, 0.1, 0.5]])), jnp.float32(0.8))
  np.testing.assert_array_equal(np.flatnonzero(np.isfinite(np.asarray(jitted)[0])), [0, 3])
  # 64 equal logits, top_p 0.1: 6 tokens have 0.094 < 0.1, 7 have 0.109 >= 0.1 -> 7 tokens, the
  # lowest ids (ties broken by lower token id first). The old filter kept all 64.
  np.testing.assert_array_equal(kept_ids(jnp.zeros(64), 0.1), np.arange(7))
  # Exactly 7/64 also needs 7 tokens; a hair above needs 8.
  np.testing.assert_array_equal(kept_ids(jnp.zeros(64), 7 / 64), np.arange(7))
  np.testing.assert_array_equal(kept_ids(jnp.zeros(64), 7 / 64 + 1e-4), np.arange(8))


def test_top_p_ties_break_by_lower_token_id():
  # probs [0.2, 0.4, 0.2, 0.2], top_p 0.5: ranking 1, 0, 2, 3 (the three 0.2 by id); 0.4 < 0.5,
  # 0.6 >= 0.5 -> {1, 0}. The old filter kept every token tied with the last kept one: all four.
  np.testing.assert_array_equal(kept_ids(jnp.log(jnp.array([0.2, 0.4, 0.2, 0.2])), 0.5), [0, 1])
  # The most likely token is always kept, even for a tiny top_p; top_p 1 keeps everything.
  np.testing.assert_array_equal(kept_ids(jnp.log(jnp.array([0.2, 0.4, 0.2, 0.2])), 1e-9), [1])
  np.testing.assert_array_equal(kept_ids(jnp.array([0.0, -30.0, -60.0, -90.0]), 1.0), [0, 1, 2, 3])


def reference_nucleus(logits, top_p):
  """The documented rule in float64 numpy: stable ranking, keep while the mass before < top_p - tol."""
  p = np.exp(logits - logits.max())
  p /= p.sum()
  order = np.argsort(-p, kind="stable")
  before = np.concatenate([[0.0], np.cumsum(p[order])[:-1]])
  return set(order[(before < top_p - sampling.TOP_P_TOLERANCE) | (np.arange(p.size) == 0)].tolist())


@pytest.mark.parametrize("top_p", [0.3, 0.8])
def test_sampled_tokens_lie_in_the_nucleus_and_logprobs_stay_untempered(model, top_p):
  # Every drawn token is in the nucleus of softmax(logits / T) computed from a full forward, and its
  # returned log-prob is log_softmax(logits) untempered and unfiltered (the documented convention,
  # what the trainer's token_logprobs computes): filtering changes what is drawn, not how it is scored.
  temperature = 0.7
  r = sample_group(model, PROMPT, num_samples=4, max_new_tokens=8, key=jax.random.key(5), temperature=temperature,
                   top_p=top_p)
  for g in range(4):
    n = int(r.lengths[g])
    seq = PROMPT + np.asarray(r.tokens[g, :n]).tolist()
    logits = np.asarray(forward_logits(model, jnp.asarray([seq], jnp.int32)), np.float64)
    for i in range(n):
      pos = len(PROMPT) - 1 + i
      assert seq[pos + 1] in reference_nucleus(logits[pos] / temperature, top_p)
      logp = logits[pos] - logits[pos].max() - np.log(np.exp(logits[pos] - logits[pos].max()).sum())
      assert abs(float(r.logprobs[g, i]) - logp[seq[pos + 1]]) < 1e-5


def test_both_samplers_apply_the_same_filter(model):
  # A top_p below every token's probability keeps only the most likely token: sampling at
  # temperature 1 must then equal greedy decoding, in sample_group and in sample_tree alike (both
  # draw through sampling.sample_token -> top_p_filter).
  key = jax.random.key(6)
  group = sample_group(model, PROMPT, num_samples=3, max_new_tokens=6, key=key, top_p=1e-6)
  greedy = sample_group(model, PROMPT, num_samples=3, max_new_tokens=6, key=key, temperature=0.0)
  np.testing.assert_array_equal(np.asarray(group.tokens), np.asarray(greedy.tokens))
  tree = sample_tree(model, PROMPT, fanouts=[2, 2], segment_length=3, key=key, top_p=1e-6)
  for g in range(4):
    np.testing.assert_array_equal(tree.tree.completion(g), np.asarray(greedy.tokens[0]))


# ---- 5. both samplers under jax_enable_x64 -------------------------------------------------------

@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_samplers_run_under_x64_and_draw_the_same_tokens(model, top_p):
  # The issue's call raised "index arguments to dynamic_update_slice must be integers of the same
  # type, got int64, int32" (a Python 0 index becomes int64 under x64). A float32 model must draw
  # exactly the same tokens with or without x64: the flag changes index types, not the math.
  kw = dict(num_samples=2, max_new_tokens=5, key=jax.random.key(0), top_p=top_p)
  tree_kw = dict(fanouts=[2, 2], segment_length=2, key=jax.random.key(0), top_p=top_p)
  want_group = sample_group(model, [1, 2, 3], **kw)
  want_tree = sample_tree(model, [1, 2, 3], **tree_kw)
  with jax.enable_x64(True):
    issue = sample_group(Llama(tiny_config()), [1, 2, 3], num_samples=1, max_new_tokens=2, key=jax.random.key(0))
    assert issue.tokens.shape == (1, 2)
    group = sample_group(model, [1, 2, 3], **kw)
    tree = sample_tree(model, [1, 2, 3], **tree_kw)
  np.testing.assert_array_equal(np.asarray(group.tokens), np.asarray(want_group.tokens))
  np.testing.assert_allclose(np.asarray(group.logprobs), np.asarray(want_group.logprobs), atol=1e-6)
  assert group.logprobs.dtype == jnp.float32
  assert tree.tree.parents == want_tree.tree.parents
  for a, b in zip(tree.tree.segments, want_tree.tree.segments):
    np.testing.assert_array_equal(a, b)


def test_float64_model_samples_with_float64_logprobs(model):
  # A float64 model (how the exactness tests run) under x64: the returned log-probs are float64
  # and equal log_softmax of a full float64 forward to ~1e-12 (float32 would be ~1e-6).
  with jax.enable_x64(True):
    graphdef, state = nnx.split(Llama(tiny_config(), dtype=jnp.float64, rngs=nnx.Rngs(0)))
    m64 = nnx.merge(graphdef, jax.tree_util.tree_map(lambda x: x.astype(jnp.float64), state))
    r = sample_group(m64, PROMPT, num_samples=2, max_new_tokens=5, key=jax.random.key(3), eos_ids=[5])
    assert r.logprobs.dtype == jnp.float64
    for g in range(2):
      n = int(r.lengths[g])
      seq = PROMPT + np.asarray(r.tokens[g, :n]).tolist()
      logp = jax.nn.log_softmax(forward_logits(m64, jnp.asarray([seq], jnp.int32)), axis=-1)
      want = np.asarray(logp)[len(PROMPT) - 1 + np.arange(n), seq[len(PROMPT):]]
      np.testing.assert_allclose(np.asarray(r.logprobs[g, :n]), want, atol=1e-12, rtol=0)
    tree = sample_tree(m64, PROMPT, fanouts=[2], segment_length=3, key=jax.random.key(3))
    assert tree.logprobs[1].dtype == np.float64


# ---- 6. preference losses: length-normalised IPO and conservative DPO ---------------------------

from branch_replay_jax.gradients import preference as pref  # noqa: E402

# The issue's pair: chosen 4 tokens, policy -1 / reference -1.5 per token (sums -4 / -6, Δ_w = 2,
# mean 0.5); rejected 2 tokens, policy -2 / reference -1.5 (sums -4 / -3, Δ_l = -1, mean -0.5).
PAIR = dict(policy_chosen=jnp.array([-4.0]), policy_rejected=jnp.array([-4.0]), ref_chosen=jnp.array([-6.0]),
            ref_rejected=jnp.array([-3.0]))
LENGTHS = dict(chosen_lengths=jnp.array([4]), rejected_lengths=jnp.array([2]))


def _loss(**kw):
  return float(obj.dpo_loss(**PAIR, beta=0.1, **kw)[0][0])


def test_preference_losses_on_the_issue_pair():
  # sum-form h = 2 - (-1) = 3, beta h = 0.3.
  # DPO: -log sigmoid(0.3) = softplus(-0.3) = 0.554355.
  assert _loss() == pytest.approx(0.554355, abs=1e-6)
  # Conservative DPO, eps = 0.1: 0.9 softplus(-0.3) + 0.1 softplus(0.3) = 0.498920 + 0.085436 = 0.584355.
  assert _loss(label_smoothing=0.1) == pytest.approx(0.584355, abs=1e-6)
  # IPO on mean log-probs: h = 0.5 - (-0.5) = 1, (1 - 1/(2*0.1))^2 = (1 - 5)^2 = 16.
  assert _loss(loss_type="ipo", **LENGTHS) == pytest.approx(16.0, abs=1e-5)
  # IPO on sums (Azar et al. eq. 17 on sequence log-probs): (3 - 5)^2 = 4 (what "ipo" computed before).
  assert _loss(loss_type="ipo_sum") == pytest.approx(4.0, abs=1e-5)


def test_ipo_mean_gradient():
  # dL/dh = 2 (h - 5) = -8 at h = 1; h = S_w/4 - S_l/2 + const, so dL/dS_w = -8/4 = -2 and
  # dL/dS_l = +8/2 = +4: each sequence's gradient is the mean's divided by its length.
  def loss(pc, pr):
    return obj.dpo_loss(pc, pr, PAIR["ref_chosen"], PAIR["ref_rejected"], beta=0.1, loss_type="ipo", **LENGTHS)[0][0]
  d_chosen, d_rejected = jax.grad(loss, argnums=(0, 1))(PAIR["policy_chosen"], PAIR["policy_rejected"])
  assert float(d_chosen[0]) == pytest.approx(-2.0, abs=1e-5)
  assert float(d_rejected[0]) == pytest.approx(4.0, abs=1e-5)
  h = jnp.array(1.0)
  assert float(jax.grad(lambda h: (h - 1 / (2 * 0.1)) ** 2)(h)) == pytest.approx(-8.0)


def test_preference_loss_argument_errors():
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


def _pref_pairs(seed=0, vocab=64):
  # Two prompts, ragged completions (lengths 1..9), a rejected completion shared by two pairs.
  rng = np.random.default_rng(seed)
  ids = lambda n: rng.integers(0, vocab, n)
  a, b, shared = ids(11), ids(5), ids(4)
  return [pref.PreferencePair(a, ids(7), shared), pref.PreferencePair(b, ids(2), ids(9)),
          pref.PreferencePair(a, ids(1), shared), pref.PreferencePair(a, ids(5), ids(3))]


_naive_pref = jax.jit(pref.naive_value_and_grad, static_argnums=(0,),
                      static_argnames=("beta", "loss_type", "label_smoothing", "micro_batch"))


@pytest.mark.parametrize("loss_type,label_smoothing", [
    # ipo and sigmoid are heavy (~25 s and ~1.5 min on loaded cores): IPO's mean is exact in CI through
    # test_preference's float32 ipo test, the sigmoid loss through its float64 test.
    pytest.param("ipo", 0.0, marks=pytest.mark.heavy), ("ipo_sum", 0.0),
    pytest.param("sigmoid", 0.1, marks=pytest.mark.heavy)])
def test_new_preference_losses_are_exact_under_two_pass_replay(x64, loss_type, label_smoothing):
  # The two-pass replay (sums, then the linear surrogate with c_i = dL/dS_i) and differentiating
  # the loss on full sequences must agree to float64 rounding (~1e-15): IPO's mean is a sum over a
  # constant length, label smoothing a function of the same sums.
  from conftest import max_rel_err, tiny_model
  graphdef, params = tiny_model(jnp.float64, jnp.float64)
  _, ref_params = tiny_model(jnp.float64, jnp.float64, seed=1)
  batch = pref.make_batch(_pref_pairs(), vocab_size=64, max_positions=256)
  steps = pref.ReplaySteps(graphdef, micro_batch=2)
  ref = steps.flat_sums(ref_params, batch)
  naive_ref = pref.naive_ref_sums(graphdef, ref_params, batch.naive)
  kw = dict(beta=0.1, loss_type=loss_type, label_smoothing=label_smoothing)
  lr, mr, gr = steps.value_and_grad(params, batch, ref, **kw)
  ln, mn, gn = _naive_pref(graphdef, params, batch.naive, naive_ref, micro_batch=2, **kw)
  assert max_rel_err(gr, gn) <= 1e-10
  assert abs(float(lr) - float(ln)) <= 1e-12 * max(1.0, abs(float(ln)))
  assert max(float(jnp.abs(x).max()) for x in jax.tree_util.tree_leaves(gn)) > 1e-3
  # The loss is the one the formula gives on the pairs' sums and lengths (not the surrogate's value).
  sums = steps.flat_sums(params, batch)
  lengths = np.concatenate([np.asarray(a.branches.mask).sum(-1) for a in batch.groups])
  c, r = batch.chosen, batch.rejected
  want = obj.dpo_loss(sums[c], sums[r], ref[c], ref[r], chosen_lengths=lengths[c], rejected_lengths=lengths[r],
                      **kw)[0].mean()
  assert float(lr) == pytest.approx(float(want), rel=1e-12)


# ---- 8. strict answer extraction -----------------------------------------------------------------

from branch_replay_jax.rollout.tasks import extract_answer, make_task  # noqa: E402


@pytest.mark.parametrize("text,forgiving,strict", [
    # Cut off by the token budget: forgiving reads the number after the unclosed tag, strict nothing.
    ("Let me compute. <answer>-12", ("-12", False), (None, False)),
    # Untagged last number: the forgiving fallback; strict: nothing.
    ("5 - 17 is -12, so -12", ("-12", False), (None, False)),
    # A closed tag counts in both modes (the last non-blank one).
    ("<answer>3</answer> no wait <answer> -12 </answer>", ("-12", True), ("-12", True)),
    # A closed pair followed by an unclosed one: the closed one in both modes.
    ("<answer>7</answer> then <answer>8", ("7", True), ("7", True)),
    ("<answer> </answer> 4", ("4", False), (None, False)),
])
def test_extract_answer_modes(text, forgiving, strict):
  assert extract_answer(text) == forgiving
  assert extract_answer(text, strict=True) == strict


def test_task_strict_mode_scores_only_closed_tags():
  # The same completions scored by the forgiving default and by a strict task: an unclosed or
  # missing tag with the right number is correct (reward 1.0) only when forgiving; with strict it
  # is 0. A closed tag scores 1.0 + format_bonus 0.1 in both.
  forgiving = make_task("basic_arithmetic", seed=0, size=4, format_bonus=0.1)
  strict = make_task("basic_arithmetic", seed=0, size=4, format_bonus=0.1, strict_answer=True)
  assert not forgiving.strict_answer and strict.strict_answer
  problem = forgiving[0]
  for text in (f"<answer>{problem.answer}", f"The answer is {problem.answer}"):
    assert forgiving.score(text, problem).correct and forgiving.score(text, problem).reward == 1.0
    s = strict.score(text, problem)
    assert (s.reward, s.correct, s.extracted, s.formatted) == (0.0, False, None, False)
  closed = f"<answer>{problem.answer}</answer>"
  for task in (forgiving, strict):
    assert task.score(closed, problem).reward == pytest.approx(1.1)
  with pytest.raises(ValueError, match="strict_answer must be a bool"):
    make_task("basic_arithmetic", seed=0, size=4, strict_answer="yes")


# ---- 11 (part). a truncated or corrupt GGUF file ------------------------------------------------

import re  # noqa: E402

import gguf  # noqa: E402

from branch_replay_jax.models import gguf_loader, loading  # noqa: E402


def test_gguf_first_megabyte_names_the_file_and_the_byte_counts(tmp_path):
  # The issue's file: the first 1 MB of SmolLM2-135M-Instruct.Q4_1.gguf. Its tokenizer metadata
  # (49152 tokens) is longer than 1 MB, so the cut falls in the metadata: the last string needs 7
  # bytes at offset 1048575 and 1 is there. Before: numpy's "When changing to a larger dtype..."
  # or an IndexError, naming neither the file nor what was cut.
  path = tmp_path / "cut.gguf"
  with open(loading.smollm2_gguf_path(), "rb") as f:
    path.write_bytes(f.read(1 << 20))
  with pytest.raises(ValueError, match=re.escape(f"{path}: truncated or corrupt GGUF file (1048576 bytes): "
                                                 "the header/metadata expects 7 bytes at offset 1048575, found 1")):
    loading.load(str(path))


def test_gguf_cut_inside_a_tensor_names_the_tensor(tmp_path):
  # Cut the file half way into the tensor that starts first in the data section: the error names
  # that tensor, its size in bytes (expected) and the bytes left (found), and counts the others.
  full = gguf.GGUFReader(loading.smollm2_gguf_path())
  first = min(full.tensors, key=lambda t: t.data_offset)
  found = int(first.n_bytes) // 2
  path = tmp_path / "cut.gguf"
  with open(loading.smollm2_gguf_path(), "rb") as f:
    path.write_bytes(f.read(int(first.data_offset) + found))
  others = len(full.tensors) - 1
  with pytest.raises(ValueError, match=re.escape(
      f"{path}: truncated or corrupt GGUF file ({int(first.data_offset) + found} bytes): tensor {first.name!r} "
      f"expects {int(first.n_bytes)} bytes at offset {int(first.data_offset)}, found {found} "
      f"({others} more tensors lie beyond the end)")):
    gguf_loader.read_gguf(path)


def test_gguf_not_a_gguf_file(tmp_path):
  empty, garbage = tmp_path / "empty.gguf", tmp_path / "garbage.gguf"
  empty.write_bytes(b"")
  garbage.write_bytes(b"not a gguf file at all")
  for path in (empty, garbage):
    with pytest.raises(ValueError, match=re.escape(f"{path}: not a readable GGUF file")):
      gguf_loader.read_gguf(path)
