"""Typed batches (data/batches.py): fields by name, None fields are no leaves, bad fields refused."""

import jax
import numpy as np
import pytest

from branch_replay_jax.data.batches import (Segments, TreeLayouts, group_arrays, is_group, is_tree,
                                            num_branches, pad_trees, tree_arrays)
from branch_replay_jax.data.trees import RolloutTree, pad_tree, tree_from_trajectories
from conftest import random_group


def test_group_batch_holds_the_group_and_only_the_fields_given():
  group = random_group([3, 5, 2])            # prompt 11 tokens -> bucket 16; completions -> bucket 8
  batch = group_arrays(group, advantage=np.array([1.0, -1.0, 0.0], np.float32))
  assert is_group(batch) and isinstance(batch.branches, Segments)
  assert batch.prompt_ids.shape == (16,) and int(batch.prompt_len) == 11
  assert batch.branches.tokens.shape == (3, 8) and batch.branches.mask.sum() == 10
  assert batch.branches.weights is None and batch.branches.old_logp is None
  # prompt_ids, prompt_len, tokens, mask, advantage: a None field adds no leaf, so jit, scan and
  # micro-batch splits see only the arrays a step was given.
  assert len(jax.tree_util.tree_leaves(batch)) == 5
  assert num_branches(batch) == 3


def test_a_group_is_a_one_level_rollout_batch_whose_rows_are_trajectories():
  # One batch type: a group and a tree are both RolloutBatch; the group's rows are its one level, and
  # `rows` (static, in the pytree's structure, never a leaf) says where the trajectory axis lives.
  group = group_arrays(random_group([3, 5]), advantage=np.array([1.0, -1.0], np.float32))
  tree = RolloutTree((np.array([1, 2, 3]), np.array([4, 5]), np.array([6])), (-1, 0, 0), (1, 2))
  one_level = tree_arrays(pad_tree(tree), {}, advantage=np.array([0.5, -0.5], np.float32))
  assert type(group) is type(one_level) and group.levels == (group.branches,)
  assert (group.rows, one_level.rows) == (True, False)
  assert (is_group(group), is_tree(group), is_group(one_level), is_tree(one_level)) == (True, False, False, True)
  # rows is structure: same leaves, another treedef, so a jitted step specialises on it as on a shape.
  flipped = one_level.replace(rows=True)
  assert len(jax.tree_util.tree_leaves(flipped)) == len(jax.tree_util.tree_leaves(one_level))
  assert jax.tree_util.tree_structure(flipped) != jax.tree_util.tree_structure(one_level)
  # A tree-only operation names what it got instead.
  with pytest.raises(ValueError, match=r"needs one or more trees \(tree_arrays\), got \['a group'\]"):
    pad_trees([group])


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
  assert is_tree(batch) and len(batch.levels) == 2
  assert batch.levels[0].tokens.shape[:-1] == (1,) and batch.levels[1].tokens.shape[:-1] == (1, 2)
  assert batch.levels[1].advantage.shape == (1, 2, 2)           # [F_1, F_2, G]: the same G values per slot
  np.testing.assert_array_equal(batch.levels[1].advantage[0, 1], [0.5, -0.5])
  assert num_branches(batch) == 2
  # Stacking two batches (the mesh's stack_groups) is a tree_map: dataclass fields keep their names.
  stacked = jax.tree_util.tree_map(lambda a, b: np.stack([a, b]), batch, batch)
  assert stacked.levels[1].tokens.shape[:3] == (2, 1, 2)


def _tree_batch(tree, ppo=False):
  """A tree's RolloutBatch with every kind of field: per token (old_logp), per (token, trajectory)
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
def test_pad_trees_pads_every_level_to_the_power_of_two_bucket_of_the_largest_shape(ppo):
  # Small: prompt -> [1, 2] (leaves [3], [4, 5]) and [7]: depth 2, F = (2, 2), T = (8, 8), G = 3.
  # Big: a 3-level tree with 3 first-level children, a 10-token segment (T_2 = 16) and G = 5.
  small = tree_from_trajectories([9, 9, 9], [[1, 2, 3], [1, 2, 4, 5], [7]])
  big = tree_from_trajectories([9] * 20, [[1, 2], [3] + [4] * 10 + [5], [3] + [4] * 10 + [6, 7], [3, 8], [11]])
  a, b = _tree_batch(small, ppo=ppo), _tree_batch(big, ppo=ppo)
  assert [x.tokens.shape for x in b.levels] == [(3, 8), (3, 2, 16), (3, 2, 2, 8)]
  pa, pb = pad_trees([a, b])
  # Fan-outs round up to powers of two (3 -> 4), lengths to powers of two >= 8 (8, 16 stay): the
  # step's layouts come from a bounded set (docs/design.md, "Trees: slots and levels").
  want = {"tokens": [(4, 8), (4, 2, 16), (4, 2, 2, 8)]}
  want["weights"] = [s + (5,) for s in want["tokens"]]
  want["advantage"] = want["weights"] if ppo else [s[:-1] + (5,) for s in want["tokens"]]
  for padded in (pa, pb):
    for name, shapes in want.items():
      assert [getattr(x, name).shape for x in padded.levels] == shapes, name
    np.testing.assert_array_equal(padded.prompt_ids, a.prompt_ids if padded is pa else b.prompt_ids)
  # Each tree keeps its values in the leading corner; everything added is padding: mask False,
  # token 0, weights / advantage / old_logp 0 (the small tree's whole third level).
  for (padded, orig_tree) in ((pa, a), (pb, b)):
    for d in range(3):
      got = padded.levels[d]
      for name in ("tokens", "mask", "old_logp", "weights", "advantage") + (("returns",) if ppo else ()):
        x = np.asarray(getattr(got, name))
        if d < len(orig_tree.levels):
          orig = np.asarray(getattr(orig_tree.levels[d], name))
          corner = tuple(slice(0, n) for n in orig.shape)
          np.testing.assert_array_equal(x[corner], orig)
          x = x.copy()
          x[corner] = 0
        assert not x.any(), (d, name)   # all padding beyond the original
  assert pa.levels[2].tokens.dtype == np.int32 and pa.levels[2].mask.dtype == bool
  with pytest.raises(ValueError, match="one or more trees"):
    pad_trees([])
  with pytest.raises(ValueError, match="different Segments fields"):
    pad_trees([a, b.replace(levels=tuple(x.replace(old_logp=None) for x in b.levels))])


def test_sampled_trees_of_different_shapes_share_one_padded_layout():
  # Episode trees of a calculator run differ in fan-out (6, 7 or 8 distinct first turns of G = 8)
  # and longest turn (41..64 tokens): pad_trees gives them all the layout F_1 = 8, T_1 = 64, so
  # the step compiles one program for them (a compile per layout: docs/design.md).
  rng = np.random.default_rng(0)
  layouts = set()
  for fanout, longest in ((6, 41), (7, 56), (8, 64), (5, 50)):
    comps = [[int(b)] + [7] * int(rng.integers(10, longest)) for b in range(fanout)]
    comps[0] = [0] + [7] * (longest - 1)
    (padded,) = pad_trees([_tree_batch(tree_from_trajectories([9] * 5, comps), ppo=False)])
    layouts.add(tuple(x.tokens.shape for x in padded.levels))
  assert layouts == {((8, 64),)}


def test_a_step_pads_onto_a_layout_compiled_before_when_it_costs_at_most_twice_its_own():
  # Layouts ((F_1, ..), (T_1, ..), G) and their cost Σ_d F_1..F_d T_d: ((8, 2), (64, 32)) = 512 + 512 = 1024.
  layouts = TreeLayouts()
  big = ((8, 2), (64, 32), 8)
  assert TreeLayouts.cost(big) == 1024 and layouts.choose(big) == big
  # A one-level tree (cost 512) fits under it at 2x: the same program. A shallower level-2 length too.
  assert layouts.choose(((8,), (64,), 8)) == big and layouts.choose(((8, 2), (64, 16), 8)) == big
  # A tree of 4 branches of 64 (cost 256) would pay 4x: its own layout, remembered from then on.
  assert layouts.choose(((4,), (64,), 8)) == ((4,), (64,), 8) and layouts.choose(((2,), (64,), 8)) == ((4,), (64,), 8)
  # Longer than anything met (cost 1024): the largest union within 2x, with big: ((8, 2), (128, 32))
  # at 1536 <= 2048, so that later trees shaped like either fit it.
  union = ((8, 2), (128, 32), 8)
  assert layouts.choose(((8,), (128,), 8)) == union and layouts.choose(((8, 1), (128, 32), 8)) == union
  # A much larger level (cost 8192): the largest union within 2x, with big (8192 + 512).
  assert layouts.choose(((8,), (1024,), 8)) == ((8, 2), (1024, 32), 8)
  # Deeper and longer than everything (cost 2^20): no union within 2x of it: its own.
  deep = ((8, 8, 8), (1024, 1024, 1024), 8)
  assert layouts.choose(deep) == deep
  assert layouts.seen == [big, ((4,), (64,), 8), union, ((8, 2), (1024, 32), 8), deep]
  # More trajectories than any layout met (G = 16: tree sampling's EOS changes G): none holds it;
  # the largest union within 2x is big's with G = 16.
  assert layouts.choose(((8,), (64,), 16)) == ((8, 2), (64, 32), 16)
  with pytest.raises(ValueError, match="max_cost"):
    TreeLayouts(0.5)


def test_pad_trees_onto_a_deeper_remembered_layout_adds_only_padding():
  # A 2-level tree first (its layout remembered), then a 1-level tree of the same fan-out: the second
  # goes onto the first's layout (cost 8*8 + 8*2*8 = 192 against its own 64: max_cost 4 allows it),
  # G = 16 as the first's: a whole empty second level and 8 empty trajectories, its own values in
  # the leading corner.
  layouts = TreeLayouts(max_cost=4.0)
  deep = tree_from_trajectories([9, 9], [[b, 5, 6] for b in range(8)] + [[b, 5, 7] for b in range(8)])
  flat = tree_from_trajectories([9, 9], [[b, 1] for b in range(8)])
  (a,) = pad_trees([_tree_batch(deep)], layouts)
  (b,) = pad_trees([_tree_batch(flat)], layouts)
  assert [x.tokens.shape for x in a.levels] == [x.tokens.shape for x in b.levels] == [(8, 8), (8, 2, 8)]
  own = _tree_batch(flat)
  np.testing.assert_array_equal(b.levels[0].tokens, own.levels[0].tokens)
  np.testing.assert_array_equal(b.levels[0].weights[..., :len(flat.ends)], own.levels[0].weights)
  for name in ("tokens", "mask", "old_logp", "weights", "advantage"):
    assert not np.asarray(getattr(b.levels[1], name)).any(), name
  assert b.levels[1].weights.shape == (8, 2, 8, 16) and b.levels[1].advantage.shape == (8, 2, 16)
