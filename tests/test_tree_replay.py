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
from branch_replay_jax.core.tree_replay import SCHEDULES
from branch_replay_jax.data.batches import trajectory_group_arrays, tree_arrays
from branch_replay_jax.data.counts import tree_counts
from branch_replay_jax.data.trees import RolloutTree, pad_tree, tree_from_trajectories
from branch_replay_jax.gradients.logprobs import (naive_logprobs, naive_value_and_grad, tree_replay_logprobs,
                                                  tree_replay_value_and_grad)
from branch_replay_jax.models import tiny_config

MODES = obj.NORMALISATIONS
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


_tree_step = jax.jit(tree_replay_value_and_grad, static_argnums=(0, 3), static_argnames=("micro_batch", "schedule"))
_naive_step = jax.jit(naive_value_and_grad, static_argnums=(0, 3))
_tree_objective = functools.partial(obj.grpo_tree_objective, clip_eps=0.2, kl_coef=0.05, on_policy=False)
_group_objective = functools.partial(obj.grpo_objective, clip_eps=0.2, kl_coef=0.05, on_policy=False)


def _both(tree, graphdef, params, mode, dtype, seed=0):
  """Tree replay under each schedule and the naive group of the tree's trajectories, with the same
  per-token values: ({schedule: (loss, aux, grads)}, naive (loss, aux, grads)). The level schedule
  runs all leaf siblings in one step (micro_batch = last fan-out), depth-first one at a time."""
  rng = np.random.default_rng(seed)
  g = len(tree.ends)
  adv = rng.normal(size=g).astype(dtype)
  old = [(-4.0 + 0.3 * rng.normal(size=len(s))).astype(dtype) for s in tree.segments]
  ref = [(-4.0 + 0.3 * rng.normal(size=len(s))).astype(dtype) for s in tree.segments]
  w = obj.trajectory_weights(tree.completion_lengths(), mode=mode, max_length=L_MAX)
  per_node = {"weights": [x.astype(dtype) for x in tree.node_weights(w)], "old_logp": old, "ref_logp": ref}
  padded = pad_tree(tree)
  tree_arrs = tree_arrays(padded, per_node, advantage=adv)
  last_fanout = padded.node_ids[-1].shape[-1]
  tree_out = {s: _tree_step(graphdef, params, tree_arrs, _tree_objective, schedule=s,
                            micro_batch=last_fanout if s == "level" else 1) for s in SCHEDULES}

  arrays = trajectory_group_arrays(tree, {"old_logp": old, "ref_logp": ref}, w.astype(dtype), vocab_size=64,
                                   max_positions=256, completion_bucket=L_MAX, advantage=adv)
  return tree_out, _naive_step(graphdef, params, arrays, _group_objective)


@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(tree=random_trees())
def test_tree_replay_equals_naive_float64(tree):
  jax.clear_caches()   # every example compiles new shapes: keep XLA's mapped executables few (conftest)
  with jax.enable_x64(True):
    graphdef, params = tiny_model(jnp.float64, jnp.float64)
    for mode in MODES:
      replay, (ln, _, gn) = _both(tree, graphdef, params, mode, np.float64)
      for schedule, (lt, _, gt) in replay.items():
        assert abs(float(lt) - float(ln)) <= 1e-12 * max(1.0, abs(float(ln))), (mode, schedule)
        assert max_rel_err(gt, gn) <= 1e-10, (mode, schedule)


@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(tree=random_trees())
def test_tree_replay_equals_naive_float32(tree):
  jax.clear_caches()
  graphdef, params = tiny_model()
  for mode in MODES:
    replay, (ln, _, gn) = _both(tree, graphdef, params, mode, np.float32)
    for schedule, (lt, _, gt) in replay.items():
      assert abs(float(lt) - float(ln)) <= 1e-5 * max(1.0, abs(float(ln))), (mode, schedule)
      assert max_rel_err(gt, gn) <= 1e-4, (mode, schedule)


def test_c01_normalisations_on_a_tree():
  # C01 with the three 50-token completions sharing their first 20 tokens (a tree: prompt ->
  # shared 20 -> three 30-token tails; plus a 3-token completion). On-policy with beta = 0 the
  # per-(token, trajectory) loss is -A_g, so the tree loss must equal the hand values:
  # per-sequence mean 0, token mean 70.5/153, Dr. GRPO (L_max = 50) 70.5/200.
  rng = np.random.default_rng(0)
  shared = list(rng.integers(0, 64, 20))
  comps = [list(rng.integers(0, 64, 3))] + [shared + list(rng.integers(0, 64, 30)) for _ in range(3)]
  tree = tree_from_trajectories([1, 2, 3], comps)
  assert len(tree.segments) == 6 and tree_counts(tree)["token_positions_computed"] == 3 + 3 + 20 + 90
  adv = np.array([1.5, -0.5, -0.5, -0.5])
  graphdef, params = tiny_model()
  objective = functools.partial(obj.grpo_tree_objective, clip_eps=0.2, kl_coef=0.0, on_policy=True)
  for mode, want in [("sequence_mean", 0.0), ("token_mean", 70.5 / 153), ("constant", 70.5 / 200)]:
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
  got = tree_replay_logprobs(graphdef, params, tree_arrays(padded, {}), micro_batch=2)
  assert [x.shape for x in got] == [t.shape for t in padded.tokens]
  arrays = trajectory_group_arrays(tree, {}, np.ones(4), vocab_size=64, max_positions=256, completion_bucket=16)
  want = np.asarray(naive_logprobs(graphdef, params, arrays))
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
    tree_replay_value_and_grad(graphdef, params, arrays, _tree_objective, schedule="breadth")
  with pytest.raises(ValueError, match="micro_batch=3"):   # the last fan-out is 2
    tree_replay_value_and_grad(graphdef, params, arrays, _tree_objective, micro_batch=3)
