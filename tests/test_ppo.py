"""PPO: GAE and the loss by hand, replay == naive gradients for policy AND critic (groups, random
trees), forward-only replay == naive, and the experiment's smoke run through main (with resume)."""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import experiment_config, length_score, max_rel_err, random_group
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from conftest import final_params, max_rel
from test_tree_replay import random_trees

from branch_replay_jax import losses as obj
from branch_replay_jax import main as entry
from branch_replay_jax.algorithms import ppo
from branch_replay_jax.data.batches import Segments, group_arrays, group_batch, trajectory_group_arrays, tree_arrays
from branch_replay_jax.algorithms import runs
from branch_replay_jax.data.trees import pad_tree
from branch_replay_jax.models import Llama, tiny_config
from branch_replay_jax.models.critic import ActorCritic
from branch_replay_jax.rollout.tasks import Task
from experiments import ppo_smollm2_arith
from branch_replay_jax.gradients.heads import ACTOR_CRITIC, LogprobsValues
from branch_replay_jax.gradients.step import forward, value_and_grad

KW = dict(clip_eps=0.2, vf_coef=0.5, value_clip=0.2)
T_MAX = 16


def test_gae_three_tokens_by_hand():
  # V = (0.5, 0.2, -0.1), reward 1 on the last token, gamma 0.9, lambda 0.8, V = 0 after the end:
  #   delta_2 = 1 + 0.9*0 - (-0.1) = 1.1        A_2 = 1.1
  #   delta_1 = 0 + 0.9*(-0.1) - 0.2 = -0.29    A_1 = -0.29 + 0.72*1.1   = 0.502
  #   delta_0 = 0 + 0.9*0.2 - 0.5 = -0.32       A_0 = -0.32 + 0.72*0.502 = 0.04144
  # returns R_t = A_t + V_t = (0.54144, 0.702, 1.0). Row 2 is the same trajectory cut to 2 tokens
  # (reward on token 1) with a garbage value on the padding, which must not leak in:
  #   A_1 = 1 - 0.2 = 0.8, A_0 = 0.9*0.2 - 0.5 + 0.72*0.8 = 0.256.
  rewards = np.array([[0.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
  values = np.array([[0.5, 0.2, -0.1, 7.0], [0.5, 0.2, 9.0, 9.0]])
  mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], bool)
  adv, ret = obj.gae(rewards, values, mask, gamma=0.9, lam=0.8)
  np.testing.assert_allclose(adv, [[0.04144, 0.502, 1.1, 0.0], [0.256, 0.8, 0.0, 0.0]], atol=1e-6)
  np.testing.assert_allclose(ret, [[0.54144, 0.702, 1.0, 0.0], [0.756, 1.0, 0.0, 0.0]], atol=1e-6)
  with pytest.raises(ValueError, match="lam=1.5"):
    obj.gae(rewards, values, mask, gamma=0.9, lam=1.5)


def test_ppo_token_loss_by_hand():
  # ratio 1.5 with A = 2: clipped to 1.2, policy term -min(3, 2.4) = -2.4. V = 1, V_old = 0.5,
  # R = 2: unclipped (1 - 2)^2 = 1; V clipped to 0.5 + 0.2 = 0.7 gives (0.7 - 2)^2 = 1.69, the max;
  # value term 0.5 * 1.69 = 0.845; total -2.4 + 0.5 * 0.845 = -1.9775.
  loss, m = obj.ppo_token_loss(jnp.log(1.5), 0.0, 1.0, 0.5, 2.0, 2.0, **KW)
  assert float(loss) == pytest.approx(-1.9775, abs=1e-6)
  assert float(m["value"]) == pytest.approx(0.845, abs=1e-6) and bool(m["clipped"])
  # Without value clipping the value term is 0.5 * 1 = 0.5: total -2.4 + 0.25.
  loss, _ = obj.ppo_token_loss(jnp.log(1.5), 0.0, 1.0, 0.5, 2.0, 2.0, **{**KW, "value_clip": 0.0})
  assert float(loss) == pytest.approx(-2.15, abs=1e-6)


def actor_critic(critic, dtype, seed=0):
  """(graphdef, params) of the tiny model with a RANDOM value head (the real one starts at zero,
  which would make the value loss's gradient into the trunk vanish and the test vacuous)."""
  ac = ActorCritic(Llama(tiny_config(), dtype=dtype, rngs=nnx.Rngs(seed)), critic=critic)
  ac.value_w[...] = 0.5 * jax.random.normal(jax.random.key(seed + 1), ac.value_w.shape, ac.value_w.dtype)
  ac.value_b[...] = jnp.asarray(0.3)
  graphdef, params = nnx.split(ac)
  return graphdef, jax.tree_util.tree_map(lambda x: x.astype(dtype), params)


def _random_fields(rng, shape, dtype):
  """old_logp near the tiny model's (log 1/64 ~ -4.2), old values, advantages and returns."""
  return {"old_logp": (-4.0 + 0.3 * rng.normal(size=shape)).astype(dtype),
          "old_values": rng.normal(size=shape).astype(dtype)}


def _assert_nonzero_grads(grads, critic):
  g = nnx.to_pure_dict(grads)
  assert np.abs(np.asarray(g["value_w"])).max() > 0 and abs(float(g["value_b"])) > 0
  assert np.abs(np.asarray(g["policy"]["layers"]["w_down"])).max() > 0
  if critic == "separate":
    assert np.abs(np.asarray(g["critic"]["layers"]["w_down"])).max() > 0


_group_step = jax.jit(functools.partial(value_and_grad, ACTOR_CRITIC), static_argnums=(0, 3), static_argnames=("micro_batch",))
_naive_step = jax.jit(functools.partial(value_and_grad, ACTOR_CRITIC, layout="naive"), static_argnums=(0, 3))
# One objective for a tree node and for a completion of the naive layout (losses.*_objective take both).
_objective = functools.partial(obj.ppo_objective, **KW)


# CI runs float64 with the value head and float32 with the separate critic; the other two are heavy
# (~1-1.5 min each on loaded cores).
@pytest.mark.parametrize("critic,dtype,tol", [
    ("value_head", jnp.float64, 1e-10), pytest.param("separate", jnp.float64, 1e-10, marks=pytest.mark.heavy),
    pytest.param("value_head", jnp.float32, 1e-4, marks=pytest.mark.heavy), ("separate", jnp.float32, 1e-4)])
def test_group_replay_equals_naive_for_policy_and_critic(critic, dtype, tol):
  with jax.enable_x64(dtype == jnp.float64):
    graphdef, params = actor_critic(critic, dtype)
    group = random_group([3, 7, 1, 5])
    rng = np.random.default_rng(0)
    shape = group.completion_ids.shape
    w = obj.token_weights(group.lengths, shape[1], mode="group_token_mean").astype(dtype)
    arrays = group_arrays(group, weights=w, advantage=rng.normal(size=shape).astype(dtype),
                          returns=rng.normal(size=shape).astype(dtype), **_random_fields(rng, shape, dtype))
    lr, aux_r, gr = _group_step(graphdef, params, arrays, _objective, micro_batch=2)
    ln, aux_n, gn = _naive_step(graphdef, params, arrays, _objective)
    assert abs(float(lr) - float(ln)) <= tol * max(1.0, abs(float(ln)))
    assert max_rel_err(gr, gn) <= tol
    assert max_rel_err(aux_r["value"], aux_n["value"]) <= tol
    _assert_nonzero_grads(gn, critic)
    fwd_r = jax.jit(functools.partial(forward, ACTOR_CRITIC), static_argnums=0)(graphdef, params, arrays)
    fwd_n = jax.jit(functools.partial(forward, ACTOR_CRITIC, layout="naive"), static_argnums=0)(graphdef, params, arrays)
    assert max_rel_err(fwd_r, fwd_n) <= tol and np.abs(np.asarray(fwd_n.values)).max() > 0


def _tree_case(tree, graphdef, params, dtype, seed=0):
  """Tree replay and the naive group of the tree's trajectories with the same per-(token,
  trajectory) advantages/returns (random rows laid out per node by `RolloutTree.columns`)."""
  rng = np.random.default_rng(seed)
  g = len(tree.ends)
  per_node = {k: [(-4.0 + 0.3 * rng.normal(size=len(s))) if k == "old_logp" else rng.normal(size=len(s))
                  for s in tree.segments] for k in ("old_logp", "old_values")}
  per_node = {k: [x.astype(dtype) for x in v] for k, v in per_node.items()}
  mask = np.arange(T_MAX)[None] < tree.completion_lengths()[:, None]
  rows = {k: np.where(mask, rng.normal(size=(g, T_MAX)), 0.0).astype(dtype) for k in ("advantage", "returns")}
  w = obj.trajectory_weights(tree.completion_lengths(), mode="sequence_mean").astype(dtype)
  nodes = {**per_node, "weights": [x.astype(dtype) for x in tree.node_weights(w)],
           **{k: tree.columns(v) for k, v in rows.items()}}
  padded = pad_tree(tree)
  tree_arr = tree_arrays(padded, nodes)
  naive_arr = trajectory_group_arrays(tree, per_node, w, vocab_size=64, max_positions=256, completion_bucket=T_MAX,
                                      **rows)
  return padded, tree_arr, naive_arr


_tree_step = jax.jit(functools.partial(value_and_grad, ACTOR_CRITIC), static_argnums=(0, 3), static_argnames=("micro_batch",))
_tree_fwd = jax.jit(functools.partial(forward, ACTOR_CRITIC), static_argnums=0)
_naive_fwd = jax.jit(functools.partial(forward, ACTOR_CRITIC, layout="naive"), static_argnums=0)


def _check_tree(tree, critic, dtype, tol):
  graphdef, params = actor_critic(critic, dtype)
  padded, tree_arr, naive_arr = _tree_case(tree, graphdef, params, dtype)
  lt, _, gt = _tree_step(graphdef, params, tree_arr, _objective)
  ln, _, gn = _naive_step(graphdef, params, naive_arr, _objective)
  assert abs(float(lt) - float(ln)) <= tol * max(1.0, abs(float(ln)))
  # floor: in a one-token prompt's tree the scored hidden state attends to itself alone, so wq's and wk's
  # true gradient is 0 and both sides hold rounding noise (~eps x the largest leaf); a leaf above the
  # floor keeps its own bound.
  assert max_rel_err(gt, gn, floor=1e-6 if dtype == jnp.float64 else 1e-2) <= tol
  _assert_nonzero_grads(gn, critic)
  # Forward-only nested replay, laid out per trajectory, equals the naive forward.
  levels = _tree_fwd(graphdef, params, tree_arr)
  naive = _naive_fwd(graphdef, params, naive_arr)
  for k in ("logp", "values"):
    nodes = padded.unplace([getattr(lvl, k) for lvl in levels])
    assert max_rel_err(tree.rows(nodes, T_MAX), getattr(naive, k)) <= tol, k
  # V after each trajectory's last token, read at the node it ends at, equals the naive one.
  leaf = padded.slot_values([lvl.next_value for lvl in levels])[list(tree.ends)]
  assert max_rel_err(leaf, naive.next_value) <= tol


@settings(max_examples=2, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(tree=random_trees(), critic=st.sampled_from(["value_head", "separate"]))
def test_tree_replay_equals_naive_float64(tree, critic):
  with jax.enable_x64(True):
    _check_tree(tree, critic, jnp.float64, 1e-10)


@pytest.mark.heavy   # ~2.5 min on loaded cores; PPO trees in CI: the float64 test above
@settings(max_examples=2, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(tree=random_trees(), critic=st.sampled_from(["value_head", "separate"]))
def test_tree_replay_equals_naive_float32(tree, critic):
  _check_tree(tree, critic, jnp.float32, 1e-4)


def test_tree_columns_invert_its_rows():
  # Trajectories [1, 2, 3] and [1, 2, 4, 5] share node [1, 2]: its column 0 holds row 0's first two
  # values, column 1 row 1's; node [3] only row 0's third value.
  from branch_replay_jax.data.trees import tree_from_trajectories
  tree = tree_from_trajectories([9], [[1, 2, 3], [1, 2, 4, 5]])
  rows = np.array([[10.0, 11.0, 12.0, 0.0], [20.0, 21.0, 22.0, 23.0]])
  cols = tree.columns(rows)
  assert [c.tolist() for c in cols[1:]] == [[[10.0, 20.0], [11.0, 21.0]], [[12.0, 0.0]], [[0.0, 22.0], [0.0, 23.0]]]
  per_node = [np.zeros(1), np.array([1.0, 2.0]), np.array([3.0]), np.array([4.0, 5.0])]
  assert tree.rows(per_node, 4).tolist() == [[1, 2, 3, 0], [1, 2, 4, 5]]
  with pytest.raises(ValueError, match="width=3"):   # trajectory 1 has 4 tokens
    tree.rows(per_node, 3)


def test_tree_rows_columns_and_unplace_refuse_what_does_not_fit_the_tree():
  # Per-node values that do not match the tree's nodes, rows of another shape, levels of another layout: a
  # ValueError naming what and the tree's own size, never a misaligned result. Trailing axes round-trip.
  from branch_replay_jax.data.trees import pad_tree, tree_from_trajectories
  tree = tree_from_trajectories(np.array([7, 8, 9]), np.array([[1, 2], [1, 3]]))   # a 2-D array of completions
  per_node = [np.ones((len(s), 3)) for s in tree.segments]
  back = tree.columns(tree.rows(per_node, 2))
  assert [b.shape for b in back] == [(3, 2, 3), (1, 2, 3), (1, 2, 3), (1, 2, 3)]
  with pytest.raises(ValueError, match=r"per_node\[1\] has shape \(5,\); node 1 has 1 tokens"):
    tree.rows([np.zeros(3), np.zeros(5), np.zeros(1), np.zeros(1)], 8)
  with pytest.raises(ValueError, match="per_node has 3 entries; the tree has 4 nodes"):
    tree.rows(per_node[:3], 8)
  with pytest.raises(ValueError, match=r"rows of shape \(1, 2\); expected \[G=2, width >= 2"):
    tree.columns(np.zeros((1, 2)))
  padded = pad_tree(tree)
  levels = [padded.place([np.arange(len(s), dtype=np.float32) for s in tree.segments], d) for d in (1, 2)]
  with pytest.raises(ValueError, match="1 levels; the layout has 2"):
    padded.unplace(levels[:1])
  with pytest.raises(ValueError, match=r"level 2 has shape \(1, 2, 1\); the layout's slots need at least"):
    padded.unplace([levels[0], levels[1][..., :1]])
  assert [b.tolist() for b in padded.unplace(levels)] == [[0.0, 0.0, 0.0], [0.0], [0.0], [0.0]]


def test_padded_tree_unplace_inverts_place_and_reads_a_larger_layout():
  # place() scatters per-node values into level slots; unplace() reads them back per node (the root: zeros of
  # the prompt's length), also from the same levels padded at the end of every axis (a mesh's layout);
  # slot_values reads one value per slot ([N], root 0).
  from branch_replay_jax.data.trees import pad_tree, tree_from_trajectories
  tree = tree_from_trajectories([9, 8], [[1, 2, 3], [1, 2, 4, 5], [6]])
  padded = pad_tree(tree)
  per_node = [np.arange(len(s), dtype=np.float32) + 10 * n for n, s in enumerate(tree.segments)]
  levels = [padded.place(per_node, d) for d in range(1, len(padded.tokens) + 1)]
  back = padded.unplace(levels)
  assert [b.tolist() for b in back] == [[0.0, 0.0]] + [v.tolist() for v in per_node[1:]]
  larger = [np.pad(v, [(0, 2)] * v.ndim, constant_values=-7) for v in levels]
  assert [b.tolist() for b in padded.unplace(larger)] == [b.tolist() for b in back]
  firsts = [v[..., 0] for v in larger]                  # each slot's first value: 10 n for node n
  assert padded.slot_values(firsts).tolist() == [0.0] + [10.0 * n for n in range(1, tree.num_nodes)]


# ---- the experiment through main's dispatch -------------------------------------------------------

@pytest.fixture(autouse=True, scope="module")
def varied_rewards():
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(Task, "score", length_score)   # see test_train: non-zero advantages for a random model
    yield


def _run(run_dir, variant="smoke", **overrides):
  config = experiment_config(ppo_smollm2_arith, variant, run_dir, **overrides)
  return importlib.import_module(entry.TRAINERS[config.algorithm]).train(config)


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
  run_dir = tmp_path_factory.mktemp("ppo")
  return run_dir, _run(run_dir)


def test_smoke_run_trains_policy_and_critic(smoke_run):
  run_dir, history = smoke_run
  assert entry.TRAINERS["ppo"] == "branch_replay_jax.algorithms.ppo"
  assert [r["step"] for r in history] == [1, 2]
  # The length reward varies inside groups, so the (zero-initialised) critic has returns to fit:
  # its value loss is > 0 and the head moves from zero.
  assert any(r["value_loss"] > 0 for r in history) and all(np.isfinite(r["loss"]) for r in history)
  params, meta = final_params(run_dir)
  assert meta == {"step": 2, "data_pos": 4}
  assert np.abs(np.asarray(params["value_w"])).max() > 0


@pytest.mark.heavy   # ~2.5 min on loaded cores; the loop's resume (shared by every algorithm) is tested in CI by test_train
def test_resumed_run_equals_uninterrupted(smoke_run, tmp_path):
  run_dir, _ = smoke_run
  _run(tmp_path, **{"train.steps": 1})
  history = _run(tmp_path, resume=True)
  assert [r["step"] for r in history] == [2]
  got, _ = final_params(tmp_path)
  want, _ = final_params(run_dir)
  assert max_rel(got, want) <= 1e-6


@pytest.mark.slow
@pytest.mark.heavy   # minutes on 2 cores; `make test-all` runs it, CI does not
def test_tree_smoke_replay_equals_naive(tmp_path):
  # Tree rollouts (fan-outs (2, 2)): nested replay and the naive step over the same trajectories
  # (old values, GAE, 2 epochs x 2 minibatches) must train to the same parameters (float32 noise
  # through Adam: see test_train's bound).
  for mode in ("replay", "naive"):
    history = _run(tmp_path / mode, "tree_smoke", **{"train.gradient": mode})
    assert history[0]["token_positions_naive"] > history[0]["token_positions_computed"]
  got, _ = final_params(tmp_path / "replay")
  want, _ = final_params(tmp_path / "naive")
  assert max_rel(got, want) <= 1e-5


@pytest.mark.parametrize("field,value,match", [
    ("ppo.critic", "oracle", "ppo.critic='oracle'"),
    ("ppo.minibatches", 3, "ppo.minibatches=3"),
    ("ppo.lam", 1.5, "ppo.lam=1.5"),
    ("loss.kl_coef", 0.1, "loss.kl_coef=0.1"),
    # What PPO cannot run on a mesh (trees, minibatches that do not split over mesh.data):
    # tests/test_mesh_algorithms.py::test_what_cannot_run_on_the_mesh_is_refused.
    ("mesh.data", 3, r"mesh.data x mesh.branch x mesh.seq = 3 x 1 x 1 = 3 must equal the device count"),
])
def test_bad_config_fails_before_any_compute(tmp_path, field, value, match):
  with pytest.raises(ValueError, match=match):
    _run(tmp_path, **{field: value})


# ---- GAE bootstraps a completion cut by its token budget ----------------------------------------------

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


# ---- PPO's GAE gets the sampler's stop reason and V after the last token ------------------------------

class _FakeForward:
  """PPOFunctions with a forward that returns fixed old log-probs, values and next values."""
  naive = False

  def __init__(self, out):
    self.forward = lambda params, arrays: out

  def forward_groups(self, params, groups):   # one device: forward of each group (PPOFunctions.forward_groups)
    return [self.forward(params, g.batch) for g in groups]


def _ppo_config(tmp_path, **overrides):
  return experiment_config(ppo_smollm2_arith, "smoke", tmp_path, **{"ppo.gamma": 1.0, "ppo.lam": 0.9,
                                                                     "ppo.whiten_advantages": False, **overrides})


# The numbers of the GAE hand case above: rewards 0, values [0.3, 0.5, 0.7], V after the last token 0.9, gamma 1, lam 0.9.
TRUNCATED_ADV = [0.542, 0.38, 0.2]
TERMINATED_ADV = [-0.187, -0.43, -0.7]


def test_ppo_group_advantages_bootstrap_only_the_truncated_completion(tmp_path):
  # Two completions of 3 tokens with equal values: the first cut by the budget, the second ended by
  # EOS on the budget's last token (same padded width: only the stop reason tells them apart).
  from branch_replay_jax.algorithms.groups import Group
  values = np.zeros((2, 8), np.float32)
  values[:, :3] = [0.3, 0.5, 0.7]
  mask = np.arange(8)[None] < 3
  arrays = group_batch(np.zeros(4, np.int32), np.int32(2), Segments(np.ones((2, 8), np.int32),
                                                                    np.broadcast_to(mask, (2, 8))))
  out = LogprobsValues(np.zeros((2, 8), np.float32), values, np.array([0.9, 0.9], np.float32))
  group = Group("group", arrays, np.zeros(2, np.float32), np.zeros(2, bool), np.array([3, 3]), {}, {}, 0.0, 0.0,
                truncated=np.array([True, False]))
  ppo.prepare(_ppo_config(tmp_path), _FakeForward(out), None, [group])
  adv = np.asarray(group.batch.branches.advantage)
  np.testing.assert_allclose(adv[0, :3], TRUNCATED_ADV, atol=1e-6)
  np.testing.assert_allclose(adv[1, :3], TERMINATED_ADV, atol=1e-6)
  np.testing.assert_array_equal(adv[:, 3:], 0.0)


def test_ppo_tree_advantages_bootstrap_from_the_leaf_each_trajectory_ends_at(tmp_path):
  # Prompt -> node 1 (2 tokens) -> leaves 2 and 3 (1 token each): trajectory 0 ends at node 2 (cut
  # by the budget), trajectory 1 at node 3 (EOS). Each path's values are [0.3, 0.5, 0.7]; V after
  # node 2 and node 3 is 0.9, after node 1 it is 5.0 (a bootstrap from the wrong node would show).
  from branch_replay_jax.data.trees import RolloutTree
  from branch_replay_jax.algorithms.groups import Group
  tree = RolloutTree((np.array([1, 2, 3]), np.array([4, 5]), np.array([6]), np.array([7])), (-1, 0, 1, 1), (2, 3))
  padded = ppo.pad_tree(tree)
  node_values = {1: [0.3, 0.5], 2: [0.7], 3: [0.7]}
  node_next = {1: 5.0, 2: 0.9, 3: 0.9}
  out = []
  for d, ids in enumerate(padded.node_ids, start=1):
    t = padded.tokens[d - 1].shape[-1]
    vals, nxt = np.zeros(ids.shape + (t,), np.float32), np.zeros(ids.shape, np.float32)
    for slot in zip(*np.nonzero(ids >= 0)):
      vals[slot][:len(node_values[ids[slot]])] = node_values[ids[slot]]
      nxt[slot] = node_next[ids[slot]]
    out.append(LogprobsValues(np.zeros_like(vals), vals, nxt))
  arrays = tree_arrays(padded, {})
  group = Group("tree", arrays, np.zeros(2, np.float32), np.zeros(2, bool), np.array([3, 3]), {}, {}, 0.0, 0.0,
                truncated=np.array([True, False]), tree=tree)
  ppo.prepare(_ppo_config(tmp_path), _FakeForward(out), None, [group])
  # Per (token, trajectory) advantages [T_d, G] of node 1 (level 1, slot 0) and nodes 2, 3 (level 2).
  lvl1, lvl2 = (np.asarray(level.advantage) for level in group.batch.levels)
  np.testing.assert_allclose(lvl1[0, :2, 0], TRUNCATED_ADV[:2], atol=1e-6)
  np.testing.assert_allclose(lvl1[0, :2, 1], TERMINATED_ADV[:2], atol=1e-6)
  np.testing.assert_allclose(lvl2[0, 0, 0, 0], TRUNCATED_ADV[2], atol=1e-6)
  np.testing.assert_allclose(lvl2[0, 1, 0, 1], TERMINATED_ADV[2], atol=1e-6)


def test_ppo_whitening_of_a_constant_advantage_is_zero(tmp_path):
  # Every completion terminated with reward 0 and values 0: every advantage is 0 exactly; whitening
  # over the step must keep them 0 (the formula gave -0.598 on float32 constants).
  from branch_replay_jax.algorithms.groups import Group
  mask = np.arange(8)[None] < 3
  values = np.where(mask, 0.1, 0.0).astype(np.float32).repeat(4, 0)
  arrays = group_batch(np.zeros(4, np.int32), np.int32(2), Segments(np.ones((4, 8), np.int32),
                                                                    np.broadcast_to(mask, (4, 8))))
  out = LogprobsValues(np.zeros((4, 8), np.float32), values, np.zeros(4, np.float32))
  rewards = np.full(4, 0.1, np.float32)   # reward 0.1 on the last token against V = 0.1 throughout
  group = Group("group", arrays, rewards, np.zeros(4, bool), np.array([3] * 4), {}, {}, 0.0, 0.0,
                truncated=np.zeros(4, bool))
  stats = ppo.prepare(_ppo_config(tmp_path, **{"ppo.whiten_advantages": True}), _FakeForward(out), None, [group])
  np.testing.assert_array_equal(np.asarray(group.batch.branches.advantage), 0.0)
  assert stats["explained_variance"] is None or np.isfinite(stats["explained_variance"])


def test_next_value_is_the_value_of_the_state_after_the_last_token():
  # V after a completion's k-th token is the value the critic gives token k of any longer
  # completion with the same first k tokens (the same context): replay and naive agree with it.
  from conftest import random_group
  from branch_replay_jax.data.batches import group_arrays
  from branch_replay_jax.models import Llama, tiny_config
  from branch_replay_jax.models.critic import ActorCritic
  from flax import nnx
  ac = ActorCritic(Llama(tiny_config(), rngs=nnx.Rngs(0)), critic="value_head")
  ac.value_w[...] = jax.random.normal(jax.random.key(1), ac.value_w.shape) * 0.1
  graphdef, params = nnx.split(ac)
  from branch_replay_jax.data.groups import make_group
  group = random_group([6])
  comp = np.asarray(group.completion_ids[0, :6])
  both = make_group(group.prompt_ids[:group.prompt_len], [comp[:3], comp], vocab_size=64, max_positions=256)
  arrays = group_arrays(both)
  for fwd in (functools.partial(forward, ACTOR_CRITIC), functools.partial(forward, ACTOR_CRITIC, layout="naive")):
    out = jax.jit(fwd, static_argnums=0)(graphdef, params, arrays)
    np.testing.assert_allclose(out.next_value[0], out.values[1, 3], rtol=1e-5)
    assert abs(float(out.next_value[0])) > 1e-4


def test_rollouts_carry_the_samplers_stop_reason(tmp_path):
  # Group.truncated is ~finished of the sampler: True exactly where the completion's last token is
  # not EOS (the tiny random model rarely emits EOS; both cases are checked where they occur).
  from branch_replay_jax.models.loading import load_tokenizer
  from branch_replay_jax.algorithms.groups import rollout_group
  tokenizer = load_tokenizer("smollm2-135m-instruct")
  for module, variant in [(ppo_smollm2_arith, "smoke"), (ppo_smollm2_arith, "tree_smoke")]:
    config = experiment_config(module, variant, tmp_path)
    model, _ = runs.build_model(config)
    task = runs.make_task_from(config)
    g = rollout_group(config, model, tokenizer, task, 0, jax.random.key(0))
    comps = ([g.tree.completion(i) for i in range(len(g.tree.ends))] if g.tree is not None else
             [np.asarray(g.batch.branches.tokens[i, :n]) for i, n in enumerate(g.lengths)])
    assert g.truncated.shape == (len(comps),)
    np.testing.assert_array_equal(g.truncated, [c[-1] != tokenizer.eos_token_id for c in comps])
