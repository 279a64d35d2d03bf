"""Every metric a tree step logs equals the same metric of the same trajectories laid out
naive (prompt repeated), on random trees, for GRPO and PPO.

The step divides its metric sums (k3 KL, clipped count; PPO also the w-weighted policy and value
terms) by the (token, trajectory) pairs, Σ_g |o_g|, in both layouts (algorithms/grpo.py and
ppo.py `update_on_batch`); so the sums themselves must agree. A token shared by k trajectories
counts k times, as the loss weighs it. Before the fix the GRPO tree KL summed k3 once per unique
token: on a tree with shared tokens it was smaller than the naive one by the shared tokens' k3.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from conftest import tiny_model
from hypothesis import HealthCheck, given, settings
from test_ppo import T_MAX, actor_critic
from test_tree_replay import random_trees

from branch_replay_jax import losses as obj
from branch_replay_jax.algorithms import loop, ppo
from branch_replay_jax.data.batches import trajectory_group_arrays, tree_arrays
from branch_replay_jax.data.trees import pad_tree
from branch_replay_jax.gradients.heads import ACTOR_CRITIC, POLICY
from branch_replay_jax.gradients.step import value_and_grad

_grpo_tree = jax.jit(functools.partial(value_and_grad, POLICY), static_argnums=(0, 3))
_grpo_naive = jax.jit(functools.partial(value_and_grad, POLICY, layout="naive"), static_argnums=(0, 3))
_ppo_tree = jax.jit(functools.partial(value_and_grad, ACTOR_CRITIC), static_argnums=(0, 3))
_ppo_naive = jax.jit(functools.partial(value_and_grad, ACTOR_CRITIC, layout="naive"), static_argnums=(0, 3))
GRPO_KW = dict(clip_eps=0.2, kl_coef=0.05, on_policy=False)
PPO_KW = dict(clip_eps=0.2, vf_coef=0.5, value_clip=0.2)


def _shared_pairs(tree) -> int:
  """(token, trajectory) pairs minus unique completion tokens: > 0 when some token is shared."""
  return int(tree.completion_lengths().sum()) - sum(len(s) for s in tree.segments[1:])


def _check_grpo(tree):
  graphdef, params = tiny_model(jnp.float64, jnp.float64)
  rng = np.random.default_rng(0)
  g = len(tree.ends)
  adv = rng.normal(size=g)
  # old and ref log-probs away from the model's (~log 1/64): ratios clip, k3 is far from 0.
  old = [-4.0 + 0.3 * rng.normal(size=len(s)) for s in tree.segments]
  ref = [-4.0 + 0.3 * rng.normal(size=len(s)) for s in tree.segments]
  w = obj.trajectory_weights(tree.completion_lengths(), mode="sequence_mean")
  tree_arr = tree_arrays(pad_tree(tree), {"weights": tree.node_weights(w), "old_logp": old, "ref_logp": ref},
                         advantage=adv)
  naive_arr = trajectory_group_arrays(tree, {"old_logp": old, "ref_logp": ref}, w, vocab_size=64, max_positions=256,
                                      completion_bucket=T_MAX, advantage=adv)
  _, aux_t, _ = _grpo_tree(graphdef, params, tree_arr, functools.partial(obj.grpo_objective, **GRPO_KW))
  _, aux_n, _ = _grpo_naive(graphdef, params, naive_arr, functools.partial(obj.grpo_objective, **GRPO_KW))
  kl_t, clip_t = (float(x) for x in obj.grpo_aux_sums(aux_t)[:2])
  kl_n, clip_n = (float(x) for x in obj.grpo_aux_sums(aux_n)[:2])
  assert kl_n > 0 and abs(kl_t - kl_n) <= 1e-10 * kl_n, (kl_t, kl_n, _shared_pairs(tree))
  assert clip_t == clip_n


def _check_ppo(tree):
  graphdef, params = actor_critic("value_head", jnp.float64)
  rng = np.random.default_rng(1)
  g = len(tree.ends)
  per_node = {"old_logp": [-4.0 + 0.3 * rng.normal(size=len(s)) for s in tree.segments],
              "old_values": [rng.normal(size=len(s)) for s in tree.segments]}
  mask = np.arange(T_MAX)[None] < tree.completion_lengths()[:, None]
  rows = {k: np.where(mask, rng.normal(size=(g, T_MAX)), 0.0) for k in ("advantage", "returns")}
  w = obj.trajectory_weights(tree.completion_lengths(), mode="group_token_mean", max_length=T_MAX)
  nodes = {**per_node, "weights": tree.node_weights(w), **{k: tree.columns(v) for k, v in rows.items()}}
  tree_arr = tree_arrays(pad_tree(tree), nodes)
  naive_arr = trajectory_group_arrays(tree, per_node, w, vocab_size=64, max_positions=256, completion_bucket=T_MAX,
                                      **rows)
  _, aux_t, _ = _ppo_tree(graphdef, params, tree_arr, functools.partial(obj.ppo_objective, **PPO_KW))
  _, aux_n, _ = _ppo_naive(graphdef, params, naive_arr, functools.partial(obj.ppo_objective, **PPO_KW))
  sums_t, sums_n = ppo._aux_sums("tree", aux_t), ppo._aux_sums("group", aux_n)
  for k in ("policy", "value", "kl"):
    assert abs(sums_t[k] - sums_n[k]) <= 1e-10 * max(1.0, abs(sums_n[k])), (k, sums_t[k], sums_n[k])
  assert sums_t["clipped"] == sums_n["clipped"]
  assert sums_n["kl"] > 0


@settings(max_examples=2, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(tree=random_trees())
def test_tree_step_metrics_equal_the_naive_layouts(tree):
  jax.clear_caches()
  with jax.enable_x64(True):
    _check_grpo(tree)
    _check_ppo(tree)


def test_a_shared_token_counts_once_per_trajectory_in_the_kl():
  # Prompt -> node 1 (3 tokens, shared by 2 trajectories) -> leaves of 1 and 2 tokens: 3 + 3 + 1 + 2
  # = 9 (token, trajectory) pairs, 6 unique tokens. The naive KL sums k3 over the 9 pairs; so must
  # the tree (before the fix it summed over the 6 unique tokens, a smaller number).
  from branch_replay_jax.data.trees import RolloutTree
  tree = RolloutTree((np.array([1, 2, 3, 4]), np.array([5, 6, 7]), np.array([8]), np.array([9, 10])), (-1, 0, 1, 1),
                     (2, 3))
  assert _shared_pairs(tree) == 3
  with jax.enable_x64(True):
    _check_grpo(tree)
    _check_ppo(tree)


def test_step_record_lengths_are_per_trajectory():
  # completion_len_mean averages over trajectories in both layouts (a tree's Group.lengths are its
  # completion lengths, tree.completion_lengths()), never over unique segments.
  from branch_replay_jax.data.trees import RolloutTree
  from branch_replay_jax.algorithms.groups import Group
  tree = RolloutTree((np.array([1, 2]), np.array([5, 6, 7]), np.array([8]), np.array([9, 10])), (-1, 0, 1, 1), (2, 3))
  counts = {"token_positions_naive": 1, "token_positions_computed": 1, "ideal_flop_ratio": 1.0, "padding_fraction": 0.0}
  group = Group("tree", {}, np.zeros(2), np.zeros(2, bool), tree.completion_lengths(), counts, {}, 0.0, 0.0,
                truncated=np.zeros(2, bool), tree=tree)
  assert loop.step_record(0, [group], {}, rollout_s=0.0, update_s=0.0)["completion_len_mean"] == 4.5


def test_zero_variance_groups_counts_the_groups_whose_advantages_are_zero():
  # Sixteen float32 1.1 rewards: np.std is ~1e-7, not 0, yet the group is constant; the metric and
  # the advantages (exactly 0 for it) both use losses.constant_groups.
  from branch_replay_jax.algorithms.groups import Group
  rewards = [np.full(16, 1.1, np.float32), np.array([0.0, 1.1] * 8, np.float32)]
  groups = [Group("group", {}, r, r > 1, np.full(16, 3), {"token_positions_naive": 1, "token_positions_computed": 1,
                                                          "ideal_flop_ratio": 1.0, "padding_fraction": 0.0},
                  {}, 0.0, 0.0, truncated=np.zeros(16, bool)) for r in rewards]
  record = loop.step_record(0, groups, {}, rollout_s=0.0, update_s=0.0)
  zeroed = [bool(np.all(np.asarray(obj.group_advantages(r)) == 0)) for r in rewards]
  assert record["zero_variance_groups"] == sum(zeroed) == 1
