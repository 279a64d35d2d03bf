"""Typed batches (data/batches.py): fields by name, None fields are no leaves, bad fields refused."""

import jax
import numpy as np
import pytest

from branch_replay_jax.data.batches import (GroupBatch, Segments, TreeBatch, group_arrays, num_branches,
                                            pad_trees, tree_arrays)
from branch_replay_jax.data.trees import RolloutTree, pad_tree, tree_from_trajectories
from conftest import random_group


def test_group_batch_holds_the_group_and_only_the_fields_given():
  group = random_group([3, 5, 2])            # prompt 11 tokens -> bucket 16; completions -> bucket 8
  batch = group_arrays(group, advantage=np.array([1.0, -1.0, 0.0], np.float32))
  assert isinstance(batch, GroupBatch) and isinstance(batch.branches, Segments)
  assert batch.prompt_ids.shape == (16,) and int(batch.prompt_len) == 11
  assert batch.branches.tokens.shape == (3, 8) and batch.branches.mask.sum() == 10
  assert batch.branches.weights is None and batch.branches.old_logp is None
  # prompt_ids, prompt_len, tokens, mask, advantage: a None field adds no leaf, so jit, scan and
  # micro-batch splits see only the arrays a step was given.
  assert len(jax.tree_util.tree_leaves(batch)) == 5
  assert num_branches(batch) == 3


def test_a_field_batches_lack_is_refused_by_name():
  group = random_group([3, 5])
  # PPO's per-token advantage is `advantage` too (one name per quantity): "advantages" is a typo.
  with pytest.raises(ValueError, match="no field 'advantages'"):
    group_arrays(group, advantages=np.zeros((2, 8), np.float32))
  with pytest.raises(ValueError, match="field 'weights' has shape \\(3, 8\\); needs a leading axis G=2"):
    group_arrays(group, weights=np.zeros((3, 8), np.float32))


def test_tree_batch_levels_have_slot_axes_and_shared_fields_broadcast():
  # prompt -> node 1 (2 tokens) -> leaves 2, 3 (1 token each): level 1 has slots [1], level 2 [1, 2].
  tree = RolloutTree((np.array([1, 2, 3]), np.array([4, 5]), np.array([6]), np.array([7])), (-1, 0, 1, 1), (2, 3))
  batch = tree_arrays(pad_tree(tree), {}, advantage=np.array([0.5, -0.5], np.float32))
  assert isinstance(batch, TreeBatch) and len(batch.levels) == 2
  assert batch.levels[0].tokens.shape[:-1] == (1,) and batch.levels[1].tokens.shape[:-1] == (1, 2)
  assert batch.levels[1].advantage.shape == (1, 2, 2)           # [F_1, F_2, G]: the same G values per slot
  np.testing.assert_array_equal(batch.levels[1].advantage[0, 1], [0.5, -0.5])
  assert num_branches(batch) == 2
  # Stacking two batches (the mesh's stack_groups) is a tree_map: dataclass fields keep their names.
  stacked = jax.tree_util.tree_map(lambda a, b: np.stack([a, b]), batch, batch)
  assert stacked.levels[1].tokens.shape[:3] == (2, 1, 2)


def _tree_batch(tree, ppo=False):
  """A tree's TreeBatch with every kind of field: per token (old_logp), per (token, trajectory)
  (weights; PPO's advantage, returns) and per trajectory (GRPO's advantage [G])."""
  g = len(tree.ends)
  rng = np.random.default_rng(len(tree.segments))
  per_node = {"old_logp": [rng.normal(size=len(s)).astype(np.float32) for s in tree.segments],
              "weights": [x.astype(np.float32) for x in tree.node_weights(np.ones(g))]}
  shared = {"advantage": rng.normal(size=g).astype(np.float32)}
  if ppo:
    per_node["advantage"] = per_node["returns"] = [rng.normal(size=(len(s), g)).astype(np.float32)
                                                   for s in tree.segments]
    shared = {}
  return tree_arrays(pad_tree(tree), per_node, **shared)


@pytest.mark.parametrize("ppo", [False, True], ids=["grpo", "ppo"])
def test_pad_trees_pads_every_level_to_the_largest_shape(ppo):
  # Small: prompt -> [1, 2] (leaves [3], [4, 5]) and [7]: depth 2, F = (2, 2), T = (8, 8), G = 3.
  # Big: a 3-level tree with 3 first-level children, a 10-token segment (T_2 = 16) and G = 5.
  small = tree_from_trajectories([9, 9, 9], [[1, 2, 3], [1, 2, 4, 5], [7]])
  big = tree_from_trajectories([9] * 20, [[1, 2], [3] + [4] * 10 + [5], [3] + [4] * 10 + [6, 7], [3, 8], [11]])
  a, b = _tree_batch(small, ppo=ppo), _tree_batch(big, ppo=ppo)
  assert [x.tokens.shape for x in b.levels] == [(3, 8), (3, 2, 16), (3, 2, 2, 8)]
  pa, pb = pad_trees([a, b])
  want = {"tokens": [(3, 8), (3, 2, 16), (3, 2, 2, 8)]}
  want["weights"] = [s + (5,) for s in want["tokens"]]
  want["advantage"] = want["weights"] if ppo else [s[:-1] + (5,) for s in want["tokens"]]
  for padded in (pa, pb):
    for name, shapes in want.items():
      assert [getattr(x, name).shape for x in padded.levels] == shapes, name
    np.testing.assert_array_equal(padded.prompt_ids, a.prompt_ids if padded is pa else b.prompt_ids)
  # The big tree already had the largest shape: unchanged. The small one keeps its values in the
  # leading corner; everything added is padding: mask False, token 0, weights / advantage / old_logp 0.
  for x, y in zip(jax.tree_util.tree_leaves(pb), jax.tree_util.tree_leaves(b)):
    np.testing.assert_array_equal(x, y)
  for d in range(3):
    got = pa.levels[d]
    for name in ("tokens", "mask", "old_logp", "weights", "advantage") + (("returns",) if ppo else ()):
      x = np.asarray(getattr(got, name))
      if d < 2:
        orig = np.asarray(getattr(a.levels[d], name))
        corner = tuple(slice(0, n) for n in orig.shape)
        np.testing.assert_array_equal(x[corner], orig)
        x = x.copy()
        x[corner] = 0
      assert not x.any(), (d, name)   # all padding beyond the original (the whole third level)
  assert pa.levels[2].tokens.dtype == np.int32 and pa.levels[2].mask.dtype == bool
  with pytest.raises(ValueError, match="one or more TreeBatches"):
    pad_trees([])
  with pytest.raises(ValueError, match="different Segments fields"):
    pad_trees([a, b.replace(levels=tuple(x.replace(old_logp=None) for x in b.levels))])
