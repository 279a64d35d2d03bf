"""Rollout trees: trie building, counts, padding, and nested replay == naive per-trajectory gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import max_rel_err, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from branch_replay_jax import losses as obj
from branch_replay_jax.data.batches import pad_trees, trajectory_group_arrays, tree_arrays
from branch_replay_jax.data.counts import tree_counts
from branch_replay_jax.data.trees import RolloutTree, pad_tree, tree_from_trajectories
from branch_replay_jax.models import tiny_config
from branch_replay_jax.gradients.heads import POLICY
from branch_replay_jax.gradients.step import forward, value_and_grad

MODES = ("sequence_mean", "group_token_mean", "constant")   # step_token_mean: the sum (1s), scaled by the step
L_MAX = 16


def test_trie_merges_common_prefixes():
  tree = tree_from_trajectories([9, 9, 9], [[1, 2, 3], [1, 2, 4, 5], [1, 2], [7], [1, 2, 3]])
  # [1, 2] is shared by four trajectories and ends one of them; [1, 2, 3] appears twice.
  assert [s.tolist() for s in tree.segments] == [[9, 9, 9], [1, 2], [3], [4, 5], [7]]
  assert tree.parents == (-1, 0, 1, 1, 0)
  assert tree.ends == (2, 3, 1, 4, 2)
  assert [tree.completion(g).tolist() for g in range(5)] == [[1, 2, 3], [1, 2, 4, 5], [1, 2], [7], [1, 2, 3]]
  assert tree.offsets() == [0, 3, 5, 5, 3]
  with pytest.raises(ValueError, match="at least one completion"):
    tree_from_trajectories([1], [[2], []])


def test_tree_counts_against_brute_force():
  cfg = tiny_config()
  tree = tree_from_trajectories([9, 9, 9], [[1, 2, 3], [1, 2, 4, 5], [7]])
  paths = [3 + len(tree.completion(g)) for g in range(3)]     # 6, 7, 4
  counts = tree_counts(tree, cfg)
  assert counts["token_positions_naive"] == sum(paths) == 17
  assert counts["token_positions_computed"] == 3 + 2 + 1 + 2 + 1 == 9
  # Brute force over (query, key) pairs: naive per path, tree per distinct (position, context).
  naive_pairs = sum(sum(i + 1 for i in range(n)) for n in paths)
  tree_pairs = sum(o + i + 1 for seg, o in zip(tree.segments, tree.offsets()) for i in range(len(seg)))
  lin = 2 * (cfg.params_per_token_linear - cfg.d_model * cfg.vocab_size)
  pair = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim
  head = 2 * cfg.d_model * cfg.vocab_size
  want = (lin * 17 + pair * naive_pairs + head * 8) / (lin * 9 + pair * tree_pairs + head * 6)
  assert counts["ideal_flop_ratio"] == pytest.approx(want, rel=1e-12)


def test_pad_tree_layout():
  tree = tree_from_trajectories([9, 9, 9], [[1, 2, 3], [1, 2, 4, 5], [7]])
  pt = pad_tree(tree)
  assert [ids.tolist() for ids in pt.node_ids] == [[1, 4], [[2, 3], [-1, -1]]]
  assert pt.tokens[1].shape == (2, 2, 8)
  assert pt.mask[1][0, 1].sum() == 2 and pt.mask[1][1].sum() == 0
  # Computed: prompt bucket 16 + level 1 (2 x 8) + level 2 (4 x 8) = 64 positions, 9 real.
  assert pt.padding_fraction == pytest.approx((64 - 9) / 64)


@st.composite
def random_trees(draw):
  """Depth 1-4, fan-outs 1-4, segment lengths 1-4 (ragged), trajectories ending at any depth
  (a path that hit EOS early has no descendants), single-leaf trees, one-token leaves."""
  rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
  max_depth = draw(st.integers(1, 4))
  segments, parents = [rng.integers(0, 64, draw(st.integers(1, 6)))], [-1]
  frontier = [(0, 0)]
  while frontier:
    node, depth = frontier.pop(0)
    fanout = draw(st.integers(1 if node == 0 else 0, 4 if depth < 2 else 2)) if depth < max_depth else 0
    for _ in range(fanout):
      segments.append(rng.integers(0, 64, draw(st.integers(1, 4))))
      parents.append(node)
      frontier.append((len(segments) - 1, depth + 1))
  leaves = [n for n in range(1, len(segments)) if n not in parents]
  return RolloutTree(tuple(segments), tuple(parents), tuple(leaves))


_tree_step = jax.jit(functools.partial(value_and_grad, POLICY), static_argnums=(0, 3), static_argnames=("micro_batch", "schedule"))
_naive_step = jax.jit(functools.partial(value_and_grad, POLICY, layout="naive"), static_argnums=(0, 3))
# One objective for a tree node and for a completion of the naive layout (losses.*_objective take both).
_objective = functools.partial(obj.grpo_objective, clip_eps=0.2, kl_coef=0.05, on_policy=False)


def _grpo_inputs(tree, mode, dtype, seed=0):
  """Random advantages [G], old and reference log-probs per node (near a random model's -ln 64), and
  the trajectory weights [G] of `mode`: (adv, old, ref, w)."""
  rng = np.random.default_rng(seed)
  adv = rng.normal(size=len(tree.ends)).astype(dtype)
  old = [(-4.0 + 0.3 * rng.normal(size=len(s))).astype(dtype) for s in tree.segments]
  ref = [(-4.0 + 0.3 * rng.normal(size=len(s))).astype(dtype) for s in tree.segments]
  return adv, old, ref, obj.trajectory_weights(tree.completion_lengths(), mode=mode, max_length=L_MAX)


def _grpo_tree_arrays(tree, mode, dtype, seed=0):
  adv, old, ref, w = _grpo_inputs(tree, mode, dtype, seed)
  per_node = {"weights": [x.astype(dtype) for x in tree.node_weights(w)], "old_logp": old, "ref_logp": ref}
  return tree_arrays(pad_tree(tree), per_node, advantage=adv)


def _both(tree, graphdef, params, mode, dtype, seed=0, level_scan=False):
  """Tree replay under each schedule and the naive group of the tree's trajectories, with the same
  per-token values: ({schedule: (loss, aux, grads)}, naive (loss, aux, grads)). The level schedule
  runs all leaf siblings in one step (micro_batch = last fan-out: the one-pass value_and_grad) and,
  with level_scan, as "level/1", one leaf sibling per scan step (its per-level pullbacks);
  depth-first one at a time."""
  adv, old, ref, w = _grpo_inputs(tree, mode, dtype, seed)
  tree_arrs = _grpo_tree_arrays(tree, mode, dtype, seed)
  last_fanout = tree_arrs.levels[-1].tokens.shape[-2]
  runs = {"depth_first": ("depth_first", 1), "level": ("level", last_fanout)}
  if level_scan and last_fanout > 1:
    runs["level/1"] = ("level", 1)
  tree_out = {name: _tree_step(graphdef, params, tree_arrs, _objective, schedule=s, micro_batch=m)
              for name, (s, m) in runs.items()}

  arrays = trajectory_group_arrays(tree, {"old_logp": old, "ref_logp": ref}, w.astype(dtype), vocab_size=64,
                                   max_positions=256, completion_bucket=L_MAX, advantage=adv)
  return tree_out, _naive_step(graphdef, params, arrays, _objective)


@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(tree=random_trees())
def test_tree_replay_equals_naive_float64(tree):
  jax.clear_caches()   # every example compiles new shapes: keep XLA's mapped executables few (conftest)
  with jax.enable_x64(True):
    graphdef, params = tiny_model(jnp.float64, jnp.float64)
    for mode in MODES:   # the level schedule's scan path ("level/1") once per tree: its compile is the cost
      replay, (ln, _, gn) = _both(tree, graphdef, params, mode, np.float64, level_scan=mode == MODES[0])
      for schedule, (lt, _, gt) in replay.items():
        assert abs(float(lt) - float(ln)) <= 1e-12 * max(1.0, abs(float(ln))), (mode, schedule)
        # floor: a one-token prompt under a one-token completion scores only the prompt's hidden state,
        # which attends to itself alone, so wq's and wk's true gradient is 0 and both sides hold rounding
        # noise (~1e-19 against the largest leaf's 0.2); every other leaf keeps its own 1e-10 bound.
        assert max_rel_err(gt, gn, floor=1e-6) <= 1e-10, (mode, schedule)


def test_depth_first_runs_internal_siblings_as_rows_exactly(x64):
  # Fan-outs 3 then 2 then 2, ragged lengths: at micro_batch=2 the depth-first schedule runs level 1
  # one node per step (2 does not divide 3), levels 2 and 3 two siblings per step as rows of one
  # batch (one pullback for both). The gradient is the naive one's up to float64 rounding (<= 1e-10),
  # and so is the loss; a sibling's cotangent routed to the wrong row or dropped fails it.
  rng = np.random.default_rng(5)
  seg = lambda first, n: [first] + list(rng.integers(0, 64, n))   # siblings differ at their first token
  one = {a: seg(a, 1 + a) for a in range(3)}
  two = {(a, b): seg(10 + b, 2 + b) for a in range(3) for b in range(2)}
  trajectories = [one[a] + two[a, b] + seg(20 + c, 1 + c) for a in range(3) for b in range(2) for c in range(2)]
  tree = tree_from_trajectories(list(rng.integers(0, 64, 5)), trajectories)
  graphdef, params = tiny_model(jnp.float64, jnp.float64)
  assert [ids.shape for ids in pad_tree(tree).node_ids] == [(3,), (3, 2), (3, 2, 2)]   # F_1, F_2, F_3
  adv, old, ref, w = _grpo_inputs(tree, MODES[0], np.float64)
  lt, _, gt = _tree_step(graphdef, params, _grpo_tree_arrays(tree, MODES[0], np.float64), _objective,
                         schedule="depth_first", micro_batch=2)
  rows = trajectory_group_arrays(tree, {"old_logp": old, "ref_logp": ref}, w.astype(np.float64), vocab_size=64,
                                 max_positions=256, completion_bucket=L_MAX, advantage=adv)
  ln, _, gn = _naive_step(graphdef, params, rows, _objective)
  assert abs(float(lt) - float(ln)) <= 1e-12 * max(1.0, abs(float(ln)))
  assert max_rel_err(gt, gn) <= 1e-10


@pytest.mark.heavy   # ~4 min on loaded cores; float32 trees in CI: test_lora tree float32, test_train tree runs, test_mesh trees
@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(tree=random_trees())
def test_tree_replay_equals_naive_float32(tree):
  jax.clear_caches()
  graphdef, params = tiny_model()
  for mode in MODES:
    replay, (ln, _, gn) = _both(tree, graphdef, params, mode, np.float32)
    for schedule, (lt, _, gt) in replay.items():
      assert abs(float(lt) - float(ln)) <= 1e-5 * max(1.0, abs(float(ln))), (mode, schedule)
      # A one-token prompt under a one-token completion: every scored position attends one key, so
      # the q and k gradients are exactly 0 and both layouts hold float32 noise there (~1e-11, rel.
      # error 1.0 against each other): leaves are measured against 1e-5 of the largest gradient entry.
      assert max_rel_err(gt, gn, floor=1e-5) <= 1e-4, (mode, schedule)


def test_pad_trees_leaves_replay_loss_gradient_and_logprobs_unchanged(x64):
  # The mesh step pads a step's sampled trees to one layout (data.batches.pad_trees). A one-level
  # tree (fan-out 2, T = 8, G = 2: both completions stopped at depth 1, as with EOS) padded to a
  # bigger one's layout (fan-outs (3, 2), rounded up to (4, 2), T = (16, 16), G = 4) gains empty slots, positions, a
  # whole level under its leaves and 2 empty trajectories, which must add exact zeros: its loss,
  # KL and clip counts, gradient and per-node log-probs stay those of the unpadded tree up to the
  # order of float64 sums (<= 1e-10 relative; a padded term that leaked, e.g. a weight not zeroed,
  # changes them by O(1)). Off-policy with a KL term, so every term of the objective is live.
  small = tree_from_trajectories([9, 9, 9], [[1, 2, 3], [7]])
  big = tree_from_trajectories([9] * 20, [[1] * 10, [3] + [4] * 10 + [5], [3, 8], [11]])
  graphdef, params = tiny_model(jnp.float64, jnp.float64)
  arrays = _grpo_tree_arrays(small, "group_token_mean", np.float64, seed=5)   # seed 5: 2 of its 4 pairs clip
  padded = pad_trees([arrays, _grpo_tree_arrays(big, "group_token_mean", np.float64, seed=1)])[0]
  assert [x.tokens.shape for x in padded.levels] == [(4, 16), (4, 2, 16)]
  assert [x.weights.shape[-1] for x in padded.levels] == [4, 4]
  want_loss, want_aux, want_grads = _tree_step(graphdef, params, arrays, _objective)
  got_loss, got_aux, got_grads = _tree_step(graphdef, params, padded, _objective)
  sums = lambda aux: [sum(float(np.sum(level.aux[k])) for level in aux) for k in ("kl", "clipped")]
  (want_kl, want_clipped), (got_kl, got_clipped) = sums(want_aux), sums(got_aux)
  assert want_kl > 0 and want_clipped > 0 and abs(float(want_loss)) > 1e-3   # not vacuous
  assert abs(float(got_loss) - float(want_loss)) <= 1e-10 * abs(float(want_loss))
  assert abs(got_kl - want_kl) <= 1e-10 * want_kl and got_clipped == want_clipped
  assert max_rel_err(got_grads, want_grads) <= 1e-10
  logprobs = jax.jit(lambda p, a: forward(POLICY, graphdef, p, a))
  want, got = logprobs(params, arrays), logprobs(params, padded)
  corner = tuple(slice(0, n) for n in want[0].shape)
  assert np.abs(np.asarray(got[0])[corner] - want[0]).max() <= 1e-10 * np.abs(want[0]).max()
  rest = np.array(got[0])
  rest[corner] = 0.0
  assert not rest.any() and not np.asarray(got[1]).any()   # padding log-probs are 0


def test_loss_weightings_give_the_hand_values_on_a_tree():
  # test_objectives.py's weighting hand case with the three 50-token completions sharing their
  # first 20 tokens (a tree: prompt -> shared 20 -> three 30-token tails; plus a 3-token completion). On-policy with beta = 0 the
  # per-(token, trajectory) loss is -A_g, so the tree loss must equal the hand values:
  # per-sequence mean 0, token mean 70.5/153, Dr. GRPO (L_max = 50) 70.5/200.
  rng = np.random.default_rng(0)
  shared = list(rng.integers(0, 64, 20))
  comps = [list(rng.integers(0, 64, 3))] + [shared + list(rng.integers(0, 64, 30)) for _ in range(3)]
  tree = tree_from_trajectories([1, 2, 3], comps)
  assert len(tree.segments) == 6 and tree_counts(tree)["token_positions_computed"] == 3 + 3 + 20 + 90
  adv = np.array([1.5, -0.5, -0.5, -0.5])
  graphdef, params = tiny_model()
  objective = functools.partial(obj.grpo_objective, clip_eps=0.2, kl_coef=0.0, on_policy=True)
  for mode, want in [("sequence_mean", 0.0), ("group_token_mean", 70.5 / 153), ("constant", 70.5 / 200)]:
    w = obj.trajectory_weights(tree.completion_lengths(), mode=mode, max_length=50)
    arrays = tree_arrays(pad_tree(tree), {"weights": tree.node_weights(w)}, advantage=adv)
    loss, _, _ = _tree_step(graphdef, params, arrays, objective)
    assert float(loss) == pytest.approx(want, abs=1e-6), mode


def test_forward_only_tree_logprobs_equal_naive(x64):
  # Ragged depth-3 tree with an early end (trajectory 1 stops at depth 1) and a one-token leaf.
  # Each node's log-probs, read along a trajectory's path, must equal that trajectory's naive
  # per-token log-probs (same context, same tokens): float64 rounding only.
  rng = np.random.default_rng(3)
  segs = [rng.integers(0, 64, n) for n in (5, 3, 2, 4, 1, 3, 2, 2)]
  tree = RolloutTree(tuple(segs), (-1, 0, 1, 1, 0, 3, 3, 2), (7, 4, 5, 6))
  graphdef, params = tiny_model(jnp.float64, jnp.float64)
  padded = pad_tree(tree)
  got = forward(POLICY, graphdef, params, tree_arrays(padded, {}), micro_batch=2)
  assert [x.shape for x in got] == [t.shape for t in padded.tokens]
  arrays = trajectory_group_arrays(tree, {}, np.ones(4), vocab_size=64, max_positions=256, completion_bucket=16)
  want = np.asarray(forward(POLICY, graphdef, params, arrays, layout="naive"))
  for g, end in enumerate(tree.ends):
    row = []
    for n in tree.path(end)[1:]:
      level = tree.depth(n)
      slot = tuple(np.argwhere(padded.node_ids[level - 1] == n)[0])
      row.append(np.asarray(got[level - 1][slot])[:len(tree.segments[n])])
    row = np.concatenate(row)
    assert np.all(row < 0) and np.abs(row - want[g, :len(row)]).max() <= 1e-10, g
  # Padding slots and positions hold exactly 0.
  for level, mask in zip(got, padded.mask):
    assert np.all(np.asarray(level)[~mask] == 0.0)


def test_bad_schedule_and_micro_batch_raise():
  tree = tree_from_trajectories([9, 9, 9], [[1, 2, 3], [1, 2, 4, 5], [7]])
  graphdef, params = tiny_model()
  arrays = tree_arrays(pad_tree(tree), {"weights": tree.node_weights(np.ones(3))}, advantage=np.zeros(3))
  with pytest.raises(ValueError, match="schedule='breadth'"):
    value_and_grad(POLICY, graphdef, params, arrays, _objective, schedule="breadth")
  with pytest.raises(ValueError, match="micro_batch=3"):   # the last fan-out is 2
    value_and_grad(POLICY, graphdef, params, arrays, _objective, micro_batch=3)
