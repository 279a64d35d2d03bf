"""Typed batches (data/batches.py): fields by name, None fields are no leaves, bad fields refused."""

import jax
import numpy as np
import pytest

from branch_replay_jax.data.batches import (GroupBatch, Segments, TreeBatch, group_arrays, num_branches,
                                            tree_arrays)
from branch_replay_jax.data.trees import RolloutTree, pad_tree
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
