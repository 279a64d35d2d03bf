"""Packed trees (train.tree_layout = "packed"): every node of a rollout or episode tree once, in one row
whose attention mask is the tree (data.batches.pack_trees, gradients.step's packed path). A packed tree
must train exactly as its trajectories laid out naive: loss, gradient, metric sums and log-probs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import max_rel_err, tiny_model
from hypothesis import HealthCheck, given, settings
from test_tree_replay import L_MAX, MODES, _grpo_inputs, _grpo_tree_arrays, random_trees

from branch_replay_jax import losses as obj
from branch_replay_jax.data.batches import PackedBatch, pack_trees, trajectory_group_arrays
from branch_replay_jax.data.trees import tree_from_trajectories
from branch_replay_jax.gradients.heads import ACTOR_CRITIC, POLICY
from branch_replay_jax.gradients.step import forward, make_train_step, value_and_grad, compiled_programs
from branch_replay_jax.kernels import reference

# Off-policy with a KL term: every term of the objective is live (clip, ratio, k3).
_objective = functools.partial(obj.grpo_objective, clip_eps=0.2, kl_coef=0.05, on_policy=False)
_packed_step = jax.jit(functools.partial(value_and_grad, POLICY), static_argnums=(0, 3))
_naive_step = jax.jit(functools.partial(value_and_grad, POLICY, layout="naive"), static_argnums=(0, 3))
_sums = lambda aux: [float(sum(np.sum(level.aux[k]) for level in aux) if isinstance(aux, list) else np.sum(aux[k]))
                     for k in ("kl", "clipped")]


def _naive_arrays(tree, mode, dtype, seed=0):
  adv, old, ref, w = _grpo_inputs(tree, mode, dtype, seed)
  return trajectory_group_arrays(tree, {"old_logp": old, "ref_logp": ref}, w.astype(dtype), vocab_size=64,
                                 max_positions=256, completion_bucket=L_MAX, advantage=adv)


def _check_equal(tree, graphdef, params, mode, dtype, loss_tol, grad_tol, length=None, seed=0, floor=None):
  (packed,) = pack_trees([_grpo_tree_arrays(tree, mode, dtype, seed)], length=length)
  naive = _naive_arrays(tree, mode, dtype, seed)
  lp, ap, gp = _packed_step(graphdef, params, packed, _objective)
  ln, an, gn = _naive_step(graphdef, params, naive, _objective)
  assert abs(float(lp) - float(ln)) <= loss_tol * max(1.0, abs(float(ln))), mode
  floor = (1e-5 if dtype == np.float32 else 0.0) if floor is None else floor
  assert max_rel_err(gp, gn, floor=floor) <= grad_tol, mode
  (kl_p, clip_p), (kl_n, clip_n) = _sums(ap), _sums(an)
  assert clip_p == clip_n and abs(kl_p - kl_n) <= loss_tol * max(kl_n, 1e-30), mode   # what the step logs
  return packed, naive


@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(tree=random_trees())
def test_a_packed_tree_trains_as_its_naive_rows_float64(tree):
  # Random depths 1-4, ragged fan-outs and lengths, trajectories ending at any depth; float64, so the
  # two layouts may differ by the order of float sums only (1e-10 relative on the gradient). Each leaf's
  # scale is at least 1e-6 of the largest gradient entry (as in tests/test_tree_replay.py): a one-token
  # prompt under a one-token node gives wq and wk a true gradient of 0 (a softmax over one key), which
  # either layout may compute as rounding noise (measured at XLA:CPU's optimisation level 0: 5.6e-20,
  # against the largest entry's 0.15); every other leaf keeps its own 1e-10 bound.
  jax.clear_caches()
  with jax.enable_x64(True):
    graphdef, params = tiny_model(jnp.float64, jnp.float64)
    for mode in MODES:
      packed, naive = _check_equal(tree, graphdef, params, mode, np.float64, 1e-12, 1e-10, floor=1e-6)
    # Per-token log-probs: each packed row's token equals the same token of each trajectory through it.
    got = np.asarray(jax.jit(lambda p, b: forward(POLICY, graphdef, p, b))(params, packed))
    want = np.asarray(jax.jit(lambda p, b: forward(POLICY, graphdef, p, b, layout="naive"))(params, naive))
    rows = np.flatnonzero(np.asarray(packed.row.mask))
    assert len(rows) == sum(len(s) for s in tree.segments[1:])
    weights = np.asarray(packed.row.weights)
    for g in range(len(tree.ends)):   # trajectory g's tokens are the packed rows where it has weight, in order
      mine = rows[weights[rows, g] != 0]
      if len(mine) == len(tree.completion(g)):   # (weights 0 where the mode drops it)
        np.testing.assert_allclose(got[mine], want[g, :len(mine)], rtol=1e-12)


def test_a_packed_tree_in_float32_and_padded_to_a_longer_row_keeps_its_values():
  # A 3-level tree with a shared middle node; float32 against the naive rows (1e-5 loss, 1e-4 gradient
  # relative to its largest entry, the tree tests' bounds), and the same tree padded to 128 rows:
  # padding rows are never keys and weigh 0, so the loss is the unpadded one up to float rounding.
  tree = tree_from_trajectories([5, 6, 7, 8], [[1, 2, 3, 4], [1, 2, 9], [1, 2, 9, 10, 11], [12, 13]])
  graphdef, params = tiny_model()
  packed, _ = _check_equal(tree, graphdef, params, "group_token_mean", np.float32, 1e-5, 1e-4)
  assert packed.row.tokens.shape == (64,)   # 4 + 11 real rows, bucketed to the minimum 64
  longer, _ = _check_equal(tree, graphdef, params, "group_token_mean", np.float32, 1e-5, 1e-4, length=128)
  assert longer.row.tokens.shape == (128,)
  a, b = _packed_step(graphdef, params, packed, _objective)[0], _packed_step(graphdef, params, longer, _objective)[0]
  assert abs(float(a) - float(b)) <= 1e-6 * abs(float(a))


def test_a_packed_row_longer_than_the_query_chunk_takes_the_tiled_attention(monkeypatch, x64):
  # With QUERY_CHUNK = KEY_BLOCK = 8 a 30-row packed tree runs the tiled online-softmax path (its own
  # keys in tiles, the key ends read per tile), forward and backward; it must still equal naive.
  monkeypatch.setattr(reference, "QUERY_CHUNK", 8)
  monkeypatch.setattr(reference, "KEY_BLOCK", 8)
  jax.clear_caches()
  tree = tree_from_trajectories(list(range(1, 9)), [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8, 9, 10], [11, 12, 13, 14],
                                                    [11, 12, 15], [16]])
  graphdef, params = tiny_model(jnp.float64, jnp.float64)
  _check_equal(tree, graphdef, params, "sequence_mean", np.float64, 1e-12, 1e-10)
  jax.clear_caches()


def test_trees_of_other_shapes_share_one_packed_program():
  # Three trees of different depths, fan-outs and level lengths (three level layouts, three programs in
  # the level layout) pack to one row shape (their longest row's bucket, G the largest), so the step
  # compiles once: what bounds a run's compiles while its trees change (P21, `step_compiles`).
  trees = [tree_from_trajectories([1, 2, 3], [[4, 5], [6]]),
           tree_from_trajectories([1, 2, 3, 4], [[5, 6, 7], [5, 6, 8, 9], [10]]),
           tree_from_trajectories([7], [[1], [2, 3], [2, 4], [2, 5, 6, 7, 8]])]
  arrays = [_grpo_tree_arrays(t, "sequence_mean", np.float32, seed=i) for i, t in enumerate(trees)]
  assert len({tuple(x.tokens.shape for x in a.levels) for a in arrays}) == 3
  packed = pack_trees(arrays)
  assert {p.row.tokens.shape for p in packed} == {(64,)} and {p.row.weights.shape for p in packed} == {(64, 4)}
  graphdef, params = tiny_model()
  import optax
  step = make_train_step(POLICY, graphdef, optax.sgd(0.0), _objective, reduce_aux=obj.grpo_aux_sums)
  stacked = jax.tree_util.tree_map(lambda *x: jnp.stack(x), *packed)
  opt_state = optax.sgd(0.0).init(params)
  for batch in (stacked, jax.tree_util.tree_map(lambda x: x[::-1], stacked), stacked):
    params, opt_state, _ = step(params, opt_state, batch, 3)
  assert compiled_programs(step) == 1


def test_packed_rows_are_refused_where_they_do_not_run():
  tree = tree_from_trajectories([1, 2, 3], [[4, 5], [6]])
  (packed,) = pack_trees([_grpo_tree_arrays(tree, "sequence_mean", np.float32)])
  assert isinstance(packed, PackedBatch)
  graphdef, params = tiny_model()
  with pytest.raises(ValueError, match="a PackedBatch runs in layout='replay' on one device"):
    value_and_grad(POLICY, graphdef, params, packed, _objective, layout="naive")
  with pytest.raises(ValueError, match="a PackedBatch trains a Policy head"):
    value_and_grad(ACTOR_CRITIC, graphdef, params, packed, _objective)
  with pytest.raises(ValueError, match="length=4 is shorter than a packed tree"):
    pack_trees([_grpo_tree_arrays(tree, "sequence_mean", np.float32)], length=4)
  with pytest.raises(ValueError, match="needs one or more trees"):
    pack_trees([packed])


def test_a_tree_without_weights_packs_its_trajectory_fields():
  # A forward-only tree (advantage and old log-probs, no weights) still has a trajectory axis G = 3
  # (3 prompt rows, then the 6 tokens of nodes [1, 2], [3], [9, 4], [8]):
  # pack_trees reads it from any per-trajectory field, as pad_trees does.
  from branch_replay_jax.data.batches import tree_arrays
  from branch_replay_jax.data.trees import pad_tree
  tree = tree_from_trajectories([5, 6, 7], [[1, 2, 3], [1, 2, 9, 4], [8]])
  old = [np.full(len(s), -1.0, np.float32) for s in tree.segments]
  (packed,) = pack_trees([tree_arrays(pad_tree(tree), {"old_logp": old}, advantage=np.arange(3.0, dtype=np.float32))])
  assert packed.row.weights is None and packed.row.advantage.tolist() == [0.0, 1.0, 2.0]
  assert np.asarray(packed.row.old_logp)[3:9].tolist() == [-1.0] * 6 and not np.asarray(packed.row.old_logp)[9:].any()


@pytest.mark.parametrize("overrides, refused", [
    ({"model.attention_impl": "pallas"}, True),                          # a tree rollout: its kernels take no key ends
    ({"model.attention_impl": "pallas", "train.gradient": "naive"}, False),   # naive rows: packed is inert
])
def test_packed_is_refused_only_where_a_tree_would_run_packed(tmp_path, overrides, refused):
  from conftest import experiment_config
  from branch_replay_jax.algorithms import grpo
  from experiments import grpo_tree_smollm2_arith
  config = experiment_config(grpo_tree_smollm2_arith, "smoke", tmp_path,
                             **{"train.tree_schedule": "packed", **overrides})
  if refused:
    with pytest.raises(ValueError, match="train.tree_schedule='packed' does not run here .model.attention_impl='pallas'"):
      grpo.validate(config)
  else:
    grpo.validate(config)
