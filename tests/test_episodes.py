"""Agentic episodes (data/episodes.py): the episode tree, its replay layout equal to the naive
one-row-per-episode layout in loss, gradient and logged metrics, and observation tokens that are
attended but never trained."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import max_rel_err, tiny_model

from branch_replay_jax import losses as obj
from branch_replay_jax.core.tree_replay import SCHEDULES
from branch_replay_jax.data.batches import is_tree, segments
from branch_replay_jax.data.trees import pad_tree
from branch_replay_jax.data.episodes import (MODEL, OBSERVATION, Episode, episode_group_arrays, episode_tree,
                                             episode_tree_arrays, limit_depth, merge_short, prompt_only_tree)
from branch_replay_jax.gradients.heads import POLICY
from branch_replay_jax.gradients.step import fused_applies, value_and_grad

L_MAX = 16   # more than any episode's model tokens (the "constant" weighting's L_max)
# The weightings a group sets by itself (step_token_mean's weights are 1 until the step scales them).
GROUP_WEIGHTINGS = tuple(m for m in obj.WEIGHTINGS if m != "step_token_mean")
M, O = MODEL, OBSERVATION


def _episodes():
  """Five episodes of one problem (prompt of 6 tokens), model tokens from ids 0..31 and observation
  tokens from 32..63 (so no two differ only by role):
    e0: a(4) x(5) b(3) y(4) c(2)     e1: a x b'(5)               e2: a x b y'(3) c'(3)
    e3: d(6) z(4) e(3)               e4: d'(2)
  e0..e2 share turn 1 and its observation (a x), e0 and e2 also turn 2 (b) and branch at the
  environment's second observation (y, y'); e1 branches at turn 2; e3 and e4 branch at turn 1."""
  rng = np.random.default_rng(7)
  tok = lambda n, obs=False: rng.integers(32 if obs else 0, 64 if obs else 32, n).astype(np.int32)
  prompt = rng.integers(0, 64, 6).astype(np.int32)
  a, x, b, y, c = tok(4), tok(5, True), tok(3), tok(4, True), tok(2)
  b1, y2, c2 = tok(5), tok(3, True), tok(3)
  d, z, e, d2 = tok(6), tok(4, True), tok(3), tok(2)
  b1[0], y2[0], d[0], d2[0] = (b[0] + 1) % 32, 32 + (y[0] + 1) % 32, (a[0] + 1) % 32, (a[0] + 2) % 32   # branch points
  return [Episode(prompt, (a, x, b, y, c), (M, O, M, O, M)), Episode(prompt, (a, x, b1), (M, O, M)),
          Episode(prompt, (a, x, b, y2, c2), (M, O, M, O, M)), Episode(prompt, (d, z, e), (M, O, M)),
          Episode(prompt, (d2,), (M,))]


def test_episode_tree_shares_earlier_turns_and_observations():
  episodes = _episodes()
  etree = episode_tree(episodes)
  tree = etree.tree
  # Nodes: prompt, a+x (shared by e0..e2), b (e0, e2), y+c, y'+c', b', d+z+e, d': 8 nodes, depth 3.
  assert tree.num_nodes == 8 and max(tree.depth(n) for n in range(8)) == 3
  assert sorted(len(s) for s in tree.segments[1:]) == sorted([9, 3, 6, 6, 5, 13, 2])
  # Computed once: 6 + 9 + 3 + 6 + 6 + 5 + 13 + 2 = 50 positions for 5 episodes of 24 + 20 + 24 + 19 + 8 = 95.
  assert sum(len(s) for s in tree.segments) == 50
  assert [int(m.sum()) for m in etree.model_mask] == [int(((s < 32) * (n > 0)).sum())
                                                    for n, s in enumerate(tree.segments)]   # model ids are < 32
  assert etree.model_lengths().tolist() == [9, 9, 10, 9, 2] == [e.num_model_tokens for e in episodes]
  assert etree.loss_tokens == 39
  for g, e in enumerate(episodes):   # the tree holds each episode, its roles included
    back = etree.episode(g)
    assert back.roles == e.roles and all(np.array_equal(s, t) for s, t in zip(back.segments, e.segments))
  # Per (token, episode): w_g on model tokens of the episodes through a node; exactly 0 on observations.
  w = etree.per_token(np.arange(1.0, 6.0))
  for n, (m, values) in enumerate(zip(etree.model_mask, w)):
    assert not values[~m].any()
    assert np.array_equal(values[m], np.broadcast_to(tree.membership()[n] * np.arange(1.0, 6.0), values[m].shape))


def test_a_token_of_the_model_and_the_same_token_of_the_environment_are_not_one_node():
  # Two episodes with the same ids after the prompt, [5, 6, 7], but 6 sampled in one and inserted by
  # the environment in the other: they share the node [5] only (a merge on ids alone would share all
  # three tokens, and the weight of one of them would be wrong for one episode).
  p = np.array([1, 2], np.int32)
  one = Episode(p, (np.array([5, 6, 7]),), (M,))
  two = Episode(p, (np.array([5]), np.array([6]), np.array([7])), (M, O, M))
  etree = episode_tree([one, two])
  assert [s.tolist() for s in etree.tree.segments] == [[1, 2], [5], [6, 7], [6, 7]]
  assert [m.tolist() for m in etree.model_mask] == [[False, False], [True], [True, True], [False, True]]


def test_bad_episodes_are_refused():
  p = np.array([1, 2], np.int32)
  with pytest.raises(ValueError, match=r"segments\[1\]\) is an observation"):
    Episode(p, (np.array([3]), np.array([4])), (M, O))
  with pytest.raises(ValueError, match=r"roles\[0\]='tool'"):
    Episode(p, (np.array([3]),), ("tool",))
  with pytest.raises(ValueError, match="no model segment"):
    Episode(p, (), ())
  with pytest.raises(ValueError, match=r"segments\[0\] must hold token ids"):
    Episode(p, (np.array([3, -1]),), (M,))
  with pytest.raises(ValueError, match=r"episodes\[1\].prompt differs"):
    episode_tree([Episode(p, (np.array([3]),), (M,)), Episode(p + 1, (np.array([3]),), (M,))])
  etree = episode_tree([Episode(p, (np.array([3]),), (M,)), Episode(p, (np.array([4]),), (M,))])
  with pytest.raises(ValueError, match=r"advantage_g has shape \(3,\)"):
    episode_tree_arrays(etree, np.zeros(3), np.ones(2), vocab_size=64, max_positions=256)


@pytest.mark.parametrize("ids,vocab,positions,message", [
    ([3, 64], 64, 256, r"episodes\[0\] holds token id 64 outside \[0, 64\)"),
    ([3, 4, 6], 64, 4, r"prompt \(2 tokens\) \+ episodes\[0\] \(3 tokens\) exceeds the model's max_positions=4")])
def test_every_layout_refuses_an_id_past_the_vocabulary_or_an_episode_past_the_context(ids, vocab, positions, message):
  # The naive rows refused both (make_group); the replay layout returned a NaN loss (an embedding
  # lookup past the table). Now both raise the same ValueError before any compute.
  M = MODEL
  p = np.array([1, 2], np.int32)
  episodes = [Episode(p, (np.array(ids, np.int32),), (M,)), Episode(p, (np.array([5], np.int32),), (M,))]
  etree = episode_tree(episodes)
  with pytest.raises(ValueError, match=message.replace("episodes", "(episodes|completions)")):
    episode_group_arrays(episodes, np.zeros(2), np.ones(2), vocab_size=vocab, max_positions=positions)
  with pytest.raises(ValueError, match=message):
    episode_tree_arrays(etree, np.zeros(2), np.ones(2), vocab_size=vocab, max_positions=positions)


_tree_step = jax.jit(functools.partial(value_and_grad, POLICY), static_argnums=(0, 3),
                     static_argnames=("micro_batch", "schedule", "fused"))
_naive_step = jax.jit(functools.partial(value_and_grad, POLICY, layout="naive"), static_argnums=(0, 3))
_group_replay_step = jax.jit(functools.partial(value_and_grad, POLICY, layout="replay"), static_argnums=(0, 3))
# One objective for a tree node and for a completion of the naive layout (losses.*_objective take both).
_objective = functools.partial(obj.grpo_objective, clip_eps=0.2, kl_coef=0.05, on_policy=False)


def _layouts(mode, dtype, advantage="grpo", seed=0, shape=lambda etree: etree):
  """(EpisodeTree, replay RolloutBatch, naive RolloutBatch) of `_episodes()` with outcome rewards -> GRPO or
  RLOO advantages [G], `mode`'s weights over each episode's model tokens, and old / reference log-probs
  per node (near a random model's -ln 64; the naive rows read the same values along each path).
  shape: applied to the episode tree first (e.g. `merge_short`)."""
  rng = np.random.default_rng(seed)
  episodes = _episodes()
  etree = shape(episode_tree(episodes))
  rewards = jnp.asarray(rng.normal(size=len(episodes)), jnp.float64 if dtype == np.float64 else jnp.float32)
  adv = np.asarray(obj.group_advantages(rewards) if advantage == "grpo" else obj.rloo_advantages(rewards)).astype(dtype)
  w = obj.trajectory_weights(etree.model_lengths(), mode=mode, max_length=L_MAX).astype(dtype)
  per_node = {k: [(-4.0 + 0.3 * rng.normal(size=len(s))).astype(dtype) for s in etree.tree.segments]
              for k in ("old_logp", "ref_logp")}
  replay = episode_tree_arrays(etree, adv, w, per_node=per_node, vocab_size=64, max_positions=256)
  naive = episode_group_arrays(episodes, adv, w, per_episode={k: etree.along(v) for k, v in per_node.items()},
                               vocab_size=64, max_positions=256, completion_bucket=32)
  return etree, replay, naive


def _pairs(batch) -> int:
  """(token, episode) pairs the loss weighs, read off a layout's arrays: the logged KL's and clip
  fraction's denominator (algorithms/grpo.py divides by it)."""
  if is_tree(batch):
    return sum(int(np.sum((np.asarray(s.weights) > 0) & np.asarray(s.mask)[..., None])) for s in batch.levels)
  return int(np.sum((np.asarray(batch.branches.weights) > 0) & np.asarray(batch.branches.mask)))


def _logged(out, batch) -> dict:
  """What the GRPO loop logs from one unit's step (algorithms/grpo.py, update_on_batch): loss, grad
  norm, KL and clip fraction per (token, episode) pair."""
  loss, aux, grads = out
  kl, clipped, _ = obj.grpo_aux_sums(aux)
  pairs = _pairs(batch)
  return {"loss": float(loss), "grad_norm": float(optax.tree.norm(grads)), "kl": float(kl) / pairs,
          "clip_frac": float(clipped) / pairs, "clipped": int(clipped), "pairs": pairs}


def _replay_step(graphdef, params, batch, schedule="level"):
  """Tree replay of an episode RolloutBatch: the level schedule with all leaf siblings in one step, or
  depth-first one leaf at a time."""
  f = batch.levels[-1].tokens.shape[-2]
  return _tree_step(graphdef, params, batch, _objective, schedule=schedule,
                    micro_batch=f if schedule == "level" else 1)


def _both(graphdef, params, mode, dtype, advantage="grpo", schedules=SCHEDULES):
  """({schedule: replay's (loss, aux, grads)}, naive's, replay RolloutBatch, naive RolloutBatch)."""
  _, replay, naive = _layouts(mode, dtype, advantage)
  tree = {s: _replay_step(graphdef, params, replay, s) for s in schedules}
  return tree, _naive_step(graphdef, params, naive, _objective), replay, naive


# rloo is heavy: grpo runs the same layouts, weights and logged figures in CI; only the per-episode
# advantage estimator differs (its values: tests/test_objectives.py).
@pytest.mark.parametrize("advantage", [a if a == "grpo" else pytest.param(a, marks=pytest.mark.heavy)
                                       for a in obj.ADVANTAGES])
def test_episode_replay_equals_naive_rows_float64_with_every_logged_metric(x64, advantage):
  # Same (token, episode) terms, so the same function of the parameters: float64 rounding only
  # (loss <= 1e-12, gradient <= 1e-10 relative), and every figure the loop logs from the step
  # (loss, grad norm, KL and clip fraction per pair) equal; the clip count and the pair count exactly
  # (39 model tokens: observation tokens are in neither layout's count).
  graphdef, params = tiny_model(jnp.float64, jnp.float64)
  for mode in GROUP_WEIGHTINGS:
    tree, naive, replay_arrays, naive_arrays = _both(graphdef, params, mode, np.float64, advantage)
    want = _logged(naive, naive_arrays)
    assert want["pairs"] == 39 and want["kl"] > 0 and want["clipped"] > 0 and abs(want["loss"]) > 1e-3, mode
    for schedule, out in tree.items():
      got = _logged(out, replay_arrays)
      assert got["pairs"] == want["pairs"] and got["clipped"] == want["clipped"], (mode, schedule)
      for k in ("loss", "grad_norm", "kl", "clip_frac"):
        assert abs(got[k] - want[k]) <= 1e-12 * max(1.0, abs(want[k])), (mode, schedule, k, got[k], want[k])
      assert max_rel_err(out[2], naive[2]) <= 1e-10, (mode, schedule)


def test_unsharing_short_nodes_keeps_every_episode_and_the_gradient_float64(x64):
  # min_tokens 8: turn 2's b (3 tokens, shared by e0 and e2) is unshared, its tokens open y+c and y'+c'
  # (9 tokens each); a+x (9 tokens, e0..e2) stays shared. 7 nodes of depth 2 instead of 8 of depth 3,
  # 6 more positions computed (b twice), every episode's tokens and roles as they were.
  episodes = _episodes()
  merged = merge_short(episode_tree(episodes), 8)
  tree = merged.tree
  assert tree.num_nodes == 7 and max(tree.depth(n) for n in range(7)) == 2
  assert sorted(len(s) for s in tree.segments[1:]) == sorted([9, 9, 9, 5, 13, 2])
  assert sum(len(s) for s in tree.segments) == 50 + 3
  for g, e in enumerate(episodes):
    back = merged.episode(g)
    assert back.roles == e.roles and all(np.array_equal(s, t) for s, t in zip(back.segments, e.segments))
  assert merge_short(episode_tree(episodes), 1).tree.num_nodes == 8   # 1: every common token stays shared
  with pytest.raises(ValueError, match="min_tokens=0"):
    merge_short(merged, 0)
  # Sharing less changes no (token, episode) term: float64 rounding only against the naive rows.
  graphdef, params = tiny_model(jnp.float64, jnp.float64)
  _, replay, naive = _layouts("sequence_mean", np.float64, shape=lambda etree: merge_short(etree, 8))
  out, want = _replay_step(graphdef, params, replay), _naive_step(graphdef, params, naive, _objective)
  got, expected = _logged(out, replay), _logged(want, naive)
  assert got["pairs"] == expected["pairs"] == 39 and got["clipped"] == expected["clipped"]
  for k in ("loss", "grad_norm", "kl", "clip_frac"):
    assert abs(got[k] - expected[k]) <= 1e-12 * max(1.0, abs(expected[k])), (k, got[k], expected[k])
  assert max_rel_err(out[2], want[2]) <= 1e-10


def test_episode_rows_by_the_group_replay_step_equal_naive_rows_float64(x64):
  # rollout.episodes.share = "prompt": the naive rows through the group replay step (the prompt
  # computed once, each episode one row with its observations at weight 0) are the same function of
  # the parameters: float64 rounding only, and every logged figure equal. It computes the prompt once
  # and every episode's turns and observations: 6 + 65 positions (prompt_only_tree: 18 + 14 + 18 + 13
  # + 2), against 6 x 5 + 65 naive and the episode tree's 6 + 44 (a x shared by e0..e2, b by e0, e2).
  graphdef, params = tiny_model(jnp.float64, jnp.float64)
  episodes = _episodes()
  only = prompt_only_tree(episodes)
  assert [len(s) for s in only.tree.segments] == [6] + [len(e.tokens()) for e in episodes]
  assert sum(len(s) for s in only.tree.segments) == 6 + 65 and only.model_lengths().tolist() == \
         episode_tree(episodes).model_lengths().tolist()
  assert sum(len(s) for s in episode_tree(episodes).tree.segments) == 6 + 44
  _, _, naive_arrays = _layouts("group_token_mean", np.float64)
  want_out = _naive_step(graphdef, params, naive_arrays, _objective)
  got_out = _group_replay_step(graphdef, params, naive_arrays, _objective)
  want, got = _logged(want_out, naive_arrays), _logged(got_out, naive_arrays)
  assert want["pairs"] == 39 and want["clipped"] == got["clipped"] > 0
  for k in ("loss", "grad_norm", "kl", "clip_frac"):
    assert abs(got[k] - want[k]) <= 1e-12 * max(1.0, abs(want[k])), (k, got[k], want[k])
  assert max_rel_err(got_out[2], want_out[2]) <= 1e-10


def test_a_one_level_episode_tree_runs_as_the_fused_group_and_logs_what_the_naive_rows_log_float64(x64):
  # limit_depth(., 1): the five episodes as five nodes under the prompt, a group whose completions are
  # the nodes. With every node in one micro-batch the step takes the fused group replay (one layer scan
  # of the prompt and the rows, `fused_applies`), with fused=False the tree replay: the same terms, so
  # float64 rounding only against each other and against the naive rows, and the tree's aux per level.
  graphdef, params = tiny_model(jnp.float64, jnp.float64)
  _, replay, naive = _layouts("sequence_mean", np.float64, shape=lambda etree: limit_depth(etree, 1))
  assert len(replay.levels) == 1 and replay.levels[0].tokens.shape[0] == 5
  assert fused_applies(replay, micro_batch=5) and not fused_applies(replay, micro_batch=1)
  fused = _tree_step(graphdef, params, replay, _objective, micro_batch=5)
  tree = _tree_step(graphdef, params, replay, _objective, micro_batch=5, fused=False)
  want_out = _naive_step(graphdef, params, naive, _objective)
  want = _logged(want_out, naive)
  assert want["pairs"] == 39 and want["clipped"] > 0
  for out in (fused, tree):
    got = _logged(out, replay)
    assert got["pairs"] == want["pairs"] and got["clipped"] == want["clipped"]
    for k in ("loss", "grad_norm", "kl", "clip_frac"):
      assert abs(got[k] - want[k]) <= 1e-12 * max(1.0, abs(want[k])), (k, got[k], want[k])
    assert max_rel_err(out[2], want_out[2]) <= 1e-10
  np.testing.assert_allclose(fused[1][0].logp, tree[1][0].logp, atol=1e-12)


def test_episode_replay_equals_naive_rows_float32():
  # The level schedule (float64 above runs both; one compile per schedule costs minutes on loaded cores).
  graphdef, params = tiny_model()
  for mode in GROUP_WEIGHTINGS:
    tree, (ln, _, gn), _, _ = _both(graphdef, params, mode, np.float32, schedules=("level",))
    for schedule, (lt, _, gt) in tree.items():
      assert abs(float(lt) - float(ln)) <= 1e-5 * max(1.0, abs(float(ln))), (mode, schedule)
      assert max_rel_err(gt, gn) <= 1e-4, (mode, schedule)


def test_episode_replay_bfloat16_error_at_most_twice_the_naive_rows_error():
  # bfloat16 compute: replay's gradient error against the float64 naive gradient is at most 2x the
  # naive layout's own error (flash-attention's rule, as tests/test_replay.py). Depth-first here, the
  # level schedule in float32.
  with jax.enable_x64(True):
    gd64, p64 = tiny_model(jnp.float64, jnp.float64)
    _, (_, _, g_ref), _, _ = _both(gd64, p64, "sequence_mean", np.float64, schedules=())
    g_ref = jax.tree_util.tree_map(np.asarray, g_ref)
  graphdef, params = tiny_model(jnp.bfloat16)
  tree, (_, _, g_naive), _, _ = _both(graphdef, params, "sequence_mean", np.float32, schedules=("depth_first",))
  err_naive = max_rel_err(g_naive, g_ref)
  assert err_naive > 1e-4, "bfloat16 must actually round (else this test checks nothing)"
  for schedule, (_, _, g_replay) in tree.items():
    assert max_rel_err(g_replay, g_ref) <= 2 * err_naive, schedule


def _observation_positions(etree, replay, naive):
  """(per level [F.., T_d] bool, naive [G, T] bool): where each layout holds observation tokens."""
  padded = pad_tree(etree.tree)
  levels = [np.asarray(level.mask) & ~padded.place([m.astype(np.int8) for m in etree.model_mask], d).astype(bool)
            for d, level in enumerate(replay.levels, start=1)]
  g, t = naive.branches.tokens.shape
  model = np.zeros((g, t), bool)
  for k in range(g):
    m = etree.episode(k).model_mask()
    model[k, :len(m)] = m
  return levels, np.asarray(naive.branches.mask) & ~model


def test_an_observation_token_has_weight_zero_and_its_advantage_and_ref_logp_do_not_move_the_loss(x64):
  # Observation tokens are attended, never trained: their loss weight (and laid-out advantage) is
  # exactly 0 in both layouts, and setting their advantage, old and reference log-probs to other
  # values leaves the loss, the logged KL and clip sums and the gradient bitwise unchanged (0 times a
  # finite value). The same change with the observation weights set to w_g (the leak this guards
  # against) does move the loss: the test can fail.
  graphdef, params = tiny_model(jnp.float64, jnp.float64)
  etree, replay, naive = _layouts("group_token_mean", np.float64)
  obs_levels, obs_naive = _observation_positions(etree, replay, naive)
  # Observations x(5), y(4), y'(3), z(4): 16 tokens in the tree, 9 + 5 + 8 + 4 + 0 = 26 in the episode rows.
  assert sum(int(o.sum()) for o in obs_levels) == 16 and obs_naive.sum() == 26
  assert not np.asarray(naive.branches.weights)[obs_naive].any()
  assert not np.asarray(naive.branches.advantage)[obs_naive].any()
  for level, obs in zip(replay.levels, obs_levels):
    assert not np.asarray(level.weights)[obs].any() and not np.asarray(level.advantage)[obs].any()

  def perturb(segments, obs, leak=False):
    at = lambda x, v: jnp.where(jnp.asarray(obs).reshape(obs.shape + (1,) * (x.ndim - obs.ndim)), v, x)
    out = segments.replace(advantage=at(segments.advantage, 7.5), old_logp=at(segments.old_logp, -1.0),
                           ref_logp=at(segments.ref_logp, -9.0))
    if leak:
      out = out.replace(weights=at(out.weights, jnp.max(out.weights)))
    return out

  cases = [(replay, lambda b, leak=False: b.replace(levels=tuple(perturb(s, o, leak) for s, o in zip(b.levels, obs_levels))),
            lambda b: _replay_step(graphdef, params, b)),
           (naive, lambda b, leak=False: b.replace(levels=(perturb(b.branches, obs_naive, leak),)),
            lambda b: _naive_step(graphdef, params, b, _objective))]
  for batch, change, step in cases:
    loss, aux, grads = step(batch)
    loss2, aux2, grads2 = step(change(batch))
    assert float(loss2) == float(loss)
    assert [float(x) for x in obj.grpo_aux_sums(aux2)[:2]] == [float(x) for x in obj.grpo_aux_sums(aux)[:2]]
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(grads2), jax.tree_util.tree_leaves(grads)))
    leaked, _, _ = step(change(batch, leak=True))
    assert abs(float(leaked) - float(loss)) > 1e-3   # a leaking mask would be caught


def test_gspo_sequence_ratio_of_an_episode_averages_its_model_tokens_only(x64):
  # GSPO's s_i = exp(mean over |y_i| of log(pi / pi_old)): on an episode row |y_i| counts model
  # tokens, so an observation token's old log-prob must not move the loss (it did when the mean ran
  # over every real token of the row).
  _, _, naive = _layouts("sequence_mean", np.float64)
  rng = np.random.default_rng(3)
  logp = jnp.asarray(-4.0 + 0.3 * rng.normal(size=naive.branches.tokens.shape)) * naive.branches.mask
  objective = functools.partial(obj.grpo_objective, clip_eps=0.2, kl_coef=0.0, on_policy=False,
                                importance_ratio="sequence")
  loss = lambda br: float(jnp.sum(jax.vmap(objective)(logp, br)[0]))
  row = naive.branches
  obs = np.asarray(row.mask) & (np.asarray(row.weights) == 0)
  moved = row.replace(old_logp=jnp.where(obs, row.old_logp - 2.0, row.old_logp))
  assert loss(moved) == loss(row) and loss(row) != 0.0


def test_ppo_value_and_policy_terms_of_a_weight_zero_token_are_zero():
  # PPO's per-(token, trajectory) objective weighs its value term too: a token with weight 0 (an
  # observation) has no value target, however far its return and advantage are from the critic.
  rng = np.random.default_rng(0)
  t = 6
  w = np.array([0.5, 0.5, 0.0, 0.0, 0.5, 0.0])   # tokens 2, 3 observations, 5 padding
  base = dict(weights=w, advantage=rng.normal(size=t), returns=rng.normal(size=t), old_logp=-4 + rng.normal(size=t),
              old_values=rng.normal(size=t))
  br = segments(np.arange(t), np.arange(t) < 5, **base)
  moved = segments(np.arange(t), np.arange(t) < 5, **{**base, "advantage": np.where(w > 0, base["advantage"], 30.0),
                                                       "returns": np.where(w > 0, base["returns"], -50.0)})
  logp, values = jnp.asarray(-4 + rng.normal(size=t)), jnp.asarray(rng.normal(size=t))
  ppo = functools.partial(obj.ppo_objective, clip_eps=0.2, vf_coef=0.5, value_clip=0.2)
  (l1, m1), (l2, m2) = ppo(logp, values, br), ppo(logp, values, moved)
  assert float(l1) == float(l2) and float(m1["value"]) == float(m2["value"]) and float(m1["value"]) > 0
