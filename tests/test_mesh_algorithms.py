"""PPO (policy and critic) and DPO on the device mesh: the sharded actor-critic functions equal the
single-device ones, ragged DPO groups pad to the mesh without changing anything, and 2-step smoke
runs on 8 fake devices train to the one-device run's parameters and log its metrics."""

import functools
import importlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import experiment_config, length_score, max_rel_err, random_group
from jax.sharding import PartitionSpec as P
from test_ppo import KW, _random_fields, actor_critic
from conftest import final_params, max_rel

from branch_replay_jax import losses as obj
from branch_replay_jax import main as entry
from branch_replay_jax.data.batches import group_arrays
from branch_replay_jax.distributed.mesh import (make_mesh, pad_groups, pad_prompts, shard_batch, shard_params, stack_groups)
from branch_replay_jax.rollout.tasks import Task
from experiments import dpo_smollm2_arith, ppo_smollm2_arith
from branch_replay_jax.gradients.heads import ACTOR_CRITIC
from branch_replay_jax.gradients.step import forward, value_and_grad

needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
# 2x2x2 FSDP splits all three axes and the parameters; 2x4x1 (replicated parameters; DPO's groups
# of 2 completions padded to 4, one per branch device) adds ~40 s per algorithm: `heavy`.
MESHES = [pytest.param((2, 2, 2), "fsdp", 2, id="2x2x2-fsdp"),
          pytest.param((2, 4, 1), "replicated", 1, id="2x4x1", marks=pytest.mark.heavy)]


def _ppo_group(seed, prompt_len):
  group = random_group([3, 7, 1, 5], seed=seed, prompt_len=prompt_len, prompt_bucket=16, completion_bucket=8)
  rng = np.random.default_rng(seed)
  shape = group.completion_ids.shape
  w = obj.token_weights(group.lengths, shape[1], mode="group_token_mean").astype(np.float32)
  return group_arrays(group, weights=w, advantage=rng.normal(size=shape).astype(np.float32),
                      returns=rng.normal(size=shape).astype(np.float32), **_random_fields(rng, shape, np.float32))


@needs_8
def test_sharded_actor_critic_equals_single_device():
  # Two groups (prompts of 11 and 14 tokens in a 16-token bucket) on a 2x2x2 FSDP mesh: groups over data,
  # completions over branch, the prompt over seq for BOTH trunks of a separate critic, every
  # parameter (the value head included) split over the 8 devices. Loss, the policy's, critic's and
  # head's gradients, the per-completion value loss and the forward pass (old log-probs, values,
  # next values) equal the single-device replay summed over the groups up to float32 rounding
  # order (~1e-7 measured; a prompt cotangent dropped or counted twice would be O(1)).
  objective = functools.partial(obj.ppo_objective, **KW)
  graphdef, params = actor_critic("separate", jnp.float32)
  groups = [_ppo_group(0, 11), _ppo_group(1, 14)]
  step = jax.jit(functools.partial(value_and_grad, ACTOR_CRITIC), static_argnums=(0, 3))
  outs = [step(graphdef, params, a, objective) for a in groups]
  want = jax.tree_util.tree_map(lambda *g: sum(g), *[o[2] for o in outs])
  fwd = [jax.jit(functools.partial(forward, ACTOR_CRITIC), static_argnums=0)(graphdef, params, a) for a in groups]
  mesh = make_mesh(2, 2, 2)
  with jax.set_mesh(mesh):
    batch = shard_batch(stack_groups(pad_prompts(groups, 2)), mesh)
    placed = shard_params(params, mesh, "fsdp")
    assert jax.typeof(placed["value_w"][...]).sharding.spec == P(("data", "branch", "seq"))
    loss, aux, grads = jax.jit(lambda p, b: value_and_grad(ACTOR_CRITIC, graphdef, p, b, objective, mesh=mesh))(
        placed, batch)
    out = jax.jit(lambda p, b: forward(ACTOR_CRITIC, graphdef, p, b, mesh=mesh))(placed, batch)
  assert float(loss) == pytest.approx(sum(float(o[0]) for o in outs), rel=1e-6)
  assert max_rel_err(grads, want) <= 1e-5
  assert max_rel_err(np.asarray(aux["value"]), np.stack([o[1]["value"] for o in outs])) <= 1e-5
  assert np.asarray(out.next_value).shape == (2, 4)
  for i, want_fwd in enumerate(fwd):
    assert max_rel_err(jax.tree_util.tree_map(lambda x: np.asarray(x)[i], out), want_fwd) <= 1e-5


@needs_8
def test_sharded_actor_critic_trees_equal_single_device():
  # Two PPO trees of different shapes (a two-level tree of 4 trajectories, prompt 5 tokens; a
  # one-level tree of 2, as EOS leaves one, prompt 7), padded to one layout (pad_trees, whose
  # padding adds exact zeros: tests/test_tree_replay.py) and stacked on a 2 x 2 x 1 FSDP mesh of 4
  # devices (trees over data, first-level subtrees over branch; every parameter, the value head
  # included, split). Loss and gradients equal the single-device tree replay of the same padded
  # trees summed over them up to float32 rounding order, and the forward pass, read back per tree
  # from the stacked layout (PaddedTree.unplace, PaddedTree.slot_values: the one-level tree's slots inside
  # two padded levels), equals the single-device one (~1e-7; a wrong slot would be O(1) off).
  from test_ppo import T_MAX, _objective, _tree_case

  from branch_replay_jax.data.batches import pad_trees
  from branch_replay_jax.data.trees import RolloutTree
  rng = np.random.default_rng(0)
  seg = lambda n: rng.integers(0, 64, n)
  trees = [RolloutTree((seg(5), seg(3), seg(2), seg(2), seg(1), seg(3), seg(2)), (-1, 0, 0, 1, 1, 2, 2), (3, 4, 5, 6)),
           RolloutTree((seg(7), seg(4), seg(1)), (-1, 0, 0), (1, 2))]
  graphdef, params = actor_critic("value_head", jnp.float32)
  cases = [_tree_case(t, graphdef, params, jnp.float32, seed=i) for i, t in enumerate(trees)]
  units = pad_prompts(pad_trees([arr for _, arr, _ in cases]))   # one shape: one compile per function below
  step = jax.jit(functools.partial(value_and_grad, ACTOR_CRITIC), static_argnums=(0, 3))
  outs = [step(graphdef, params, arr, _objective) for arr in units]
  want = jax.tree_util.tree_map(lambda *g: sum(g), *[o[2] for o in outs])
  mesh = make_mesh(2, 2, 1, devices=jax.devices()[:4])
  with jax.set_mesh(mesh):
    batch = shard_batch(stack_groups(units), mesh)
    placed = shard_params(params, mesh, "fsdp")
    loss, _, grads = jax.jit(lambda p, b: value_and_grad(ACTOR_CRITIC, graphdef, p, b, _objective, mesh=mesh, micro_batch=2))(placed, batch)
    levels = jax.device_get(jax.jit(lambda p, b: forward(ACTOR_CRITIC, graphdef, p, b, mesh=mesh))(
        placed, batch))
  assert float(loss) == pytest.approx(sum(float(o[0]) for o in outs), rel=1e-5)
  assert max_rel_err(grads, want) <= 1e-5
  tree_forward = jax.jit(functools.partial(forward, ACTOR_CRITIC), static_argnums=0)
  for i, (tree, (padded, _, _)) in enumerate(zip(trees, cases)):
    own = tree_forward(graphdef, params, units[i])
    mine = [jax.tree_util.tree_map(lambda x: x[i], lvl) for lvl in levels]
    for k in ("logp", "values"):
      got = tree.rows(padded.unplace([getattr(v, k) for v in mine]), T_MAX)
      ref = tree.rows(padded.unplace([getattr(v, k) for v in own]), T_MAX)
      assert max_rel_err(got, ref) <= 1e-5 and np.abs(ref).max() > 0, k
    got = padded.slot_values([v.next_value for v in mine])[list(tree.ends)]
    assert max_rel_err(got, padded.slot_values([v.next_value for v in own])[list(tree.ends)]) <= 1e-5


def test_pad_groups_pads_with_masked_branches():
  # DPO's ragged groups: 3 completions of 8 tokens, 2 of 16 (prompt 16), 1 of 8 (prompt 32). On a
  # 2 x 2 x 2 mesh: G' = 3 rounded up to 4, T' = 16, prompts 32, and 3 groups + 1 filler (data = 2).
  # Real completions keep their tokens and masks; every added branch, token and filler row is
  # masked out. flat_index maps completion i of the concatenation to j * G' + g.
  mesh = make_mesh(2, 2, 2)
  raw = [random_group([3, 5, 2], seed=0), random_group([9, 12], seed=1),
         random_group([4], seed=2, prompt_len=21, prompt_bucket=32)]
  groups = [group_arrays(g) for g in raw]
  padded, index = pad_groups(groups, mesh)
  stacked = stack_groups(padded)
  assert stacked.branches.tokens.shape == (4, 4, 16) and stacked.prompt_ids.shape == (4, 32)
  assert index.tolist() == [0, 1, 2, 4, 5, 8]
  mask = np.asarray(stacked.branches.mask)
  assert mask.sum() == sum(int(g.lengths.sum()) for g in raw)
  assert not mask[3].any() and not mask[0, 3].any() and not mask[2, 1:].any()
  for j, g in enumerate(groups):
    n, t = g.branches.tokens.shape
    np.testing.assert_array_equal(np.asarray(stacked.branches.tokens)[j, :n, :t], np.asarray(g.branches.tokens))
  with pytest.raises(ValueError, match="at least one group"):
    pad_groups([], mesh)


@pytest.fixture(autouse=True, scope="module")
def varied_rewards():
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(Task, "score", length_score)   # see test_train: non-zero advantages for a random model
    yield


def _run(module, variant, run_dir, **overrides):
  config = experiment_config(module, variant, run_dir, **overrides)
  return importlib.import_module(entry.TRAINERS[config.algorithm]).train(config)


def _lines(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


def _mesh(shape, params, micro_batch):
  return {"mesh.data": shape[0], "mesh.branch": shape[1], "mesh.seq": shape[2], "mesh.params": params,
          "train.micro_batch": micro_batch}


# PPO: one minibatch of both groups per epoch, so that a minibatch splits over mesh.data = 2.
PPO = {"ppo.minibatches": 1}


@pytest.fixture(scope="module")
def ppo_reference(tmp_path_factory):
  run_dir = tmp_path_factory.mktemp("ppo_one_device")
  return run_dir, _run(ppo_smollm2_arith, "smoke", run_dir, **PPO)


@needs_8
# heavy (~65 s on one core): PPO's sharded step stays in CI (test_sharded_actor_critic_equals_single_device and
# its trees), and the mesh loop through GRPO's runs (tests/test_train.py); `make test-all` runs PPO's.
@pytest.mark.parametrize("shape,params,micro_batch", [pytest.param(*p.values, marks=pytest.mark.heavy, id=p.id)
                                                      for p in MESHES])
def test_ppo_mesh_run_trains_to_the_same_parameters(ppo_reference, tmp_path, shape, params, micro_batch):
  # The PPO smoke run (2 groups x G = 4, value head, 2 epochs) on 8 fake devices: old log-probs and
  # values, then each epoch's minibatch, as one stacked batch on the mesh, for policy and critic.
  # The same gradients summed in another order: parameters within the Adam rounding bound of
  # test_train (1e-5), the logged losses, KL, clip fraction, value statistics and gradient norm
  # within float32 rounding, and the same samples (rewards).
  # Sampling is data-parallel (each group on a device of its data row, placement.sampling_devices) with
  # the one-device keys: the same samples.jsonl, line for line.
  run_dir, want_history = ppo_reference
  history = _run(ppo_smollm2_arith, "smoke", tmp_path, **PPO, **_mesh(shape, params, micro_batch))
  assert _lines(tmp_path / "samples.jsonl") == _lines(run_dir / "samples.jsonl")
  got, _ = final_params(tmp_path)
  want, _ = final_params(run_dir)
  assert max_rel(got, want) <= 1e-5
  for got_r, want_r in zip(history, want_history, strict=True):
    assert got_r["reward_mean"] == want_r["reward_mean"]
    for name in ("loss", "policy_loss", "value_loss", "kl", "clip_frac", "value_mean", "return_mean"):
      assert got_r[name] == pytest.approx(want_r[name], rel=1e-4, abs=1e-7), name
    assert got_r["grad_norm"] == pytest.approx(want_r["grad_norm"], rel=1e-5)
  # Not vacuous: the critic fits non-zero returns, the second epoch's ratios move off 1.
  assert min(r["grad_norm"] for r in want_history) > 0.1 and max(r["value_loss"] for r in want_history) > 0
  assert max(r["kl"] for r in want_history) > 0


@needs_8
@pytest.mark.heavy   # 213 s on 2 shared cores; test_sharded_actor_critic_trees_equal_single_device runs in CI
def test_ppo_tree_mesh_run_trains_to_the_same_parameters(tmp_path, monkeypatch):
  # The PPO tree smoke run with fan-outs (4, 2) (8 trajectories a tree), one minibatch of both trees,
  # on a 2 x 4 x 1 FSDP mesh: trees over data, first-level subtrees over branch, for policy and
  # critic. Each step's first tree is cut short as EOS would (conftest.cut_by_eos: a one-level tree
  # of 2 trajectories beside a full one of 8), so the step's old log-probs/values pass and each
  # minibatch pad the trees to one layout (pad_trees: exact zeros), and the old values map back
  # from the padded layout to each tree's nodes for GAE. The same terms summed in another order:
  # parameters within the Adam rounding bound (1e-5), metrics to float32 rounding, equal samples.
  from conftest import cut_by_eos

  from branch_replay_jax.rollout import collect
  tree = {"rollout.tree_fanouts": (4, 2), "ppo.minibatches": 1}
  shapes = []
  monkeypatch.setattr(collect, "sample_tree", cut_by_eos(shapes))
  want_history = _run(ppo_smollm2_arith, "tree_smoke", tmp_path / "one", **tree)
  assert sorted(set(shapes)) == [2, 8]   # both shapes occur
  history = _run(ppo_smollm2_arith, "tree_smoke", tmp_path / "mesh", **tree, **_mesh((2, 4, 1), "fsdp", 2))
  assert _lines(tmp_path / "mesh" / "samples.jsonl") == _lines(tmp_path / "one" / "samples.jsonl")
  got, _ = final_params(tmp_path / "mesh")
  want, _ = final_params(tmp_path / "one")
  assert max_rel(got, want) <= 1e-5
  for got_r, want_r in zip(history, want_history, strict=True):
    for name in ("reward_mean", "token_positions_computed", "completion_len_mean"):
      assert got_r[name] == want_r[name], name
    for name in ("loss", "policy_loss", "value_loss", "kl", "clip_frac", "value_mean", "return_mean"):
      assert got_r[name] == pytest.approx(want_r[name], rel=1e-4, abs=1e-7), name
    assert got_r["grad_norm"] == pytest.approx(want_r["grad_norm"], rel=1e-5)
  assert min(r["grad_norm"] for r in want_history) > 0.1 and max(r["value_loss"] for r in want_history) > 0


@pytest.fixture(scope="module")
def dpo_reference(tmp_path_factory):
  run_dir = tmp_path_factory.mktemp("dpo_one_device")
  return run_dir, _run(dpo_smollm2_arith, "jsonl_smoke", run_dir)


@needs_8
@pytest.mark.parametrize("shape,params,micro_batch", MESHES)
def test_dpo_mesh_run_trains_to_the_same_parameters(dpo_reference, tmp_path, shape, params, micro_batch):
  # The example file's 4 pairs per step: step 1 has 3 distinct prompts (lines 2 and 3 share one:
  # a group of 4 completions, two of 2), so the groups are ragged in G, T and prompt length and
  # padded to the mesh (pad_groups: 4 groups of 4 completions, one a filler group). Reference
  # sums, policy sums and the surrogate gradient all run on the mesh; the padding has zero weight,
  # so the parameters equal the one-device run's within the Adam rounding bound (1e-5) and the
  # logged loss, accuracy and gradient norm within float32 rounding. The implicit rewards
  # beta (S - S_ref) difference log-prob sums |S| of a few hundred nats, whose float32 spacing is
  # 2^-15 ~ 3e-5: either run's rewards carry ~beta x 3e-5 = 3e-6 of rounding (measured: 1.5e-6 on
  # step 2's ~3e-4), hence 1e-5 absolute; a dropped or misindexed completion moves them by O(1e-4).
  run_dir, want_history = dpo_reference
  history = _run(dpo_smollm2_arith, "jsonl_smoke", tmp_path, **_mesh(shape, params, micro_batch))
  got, _ = final_params(tmp_path)
  want, _ = final_params(run_dir)
  assert max_rel(got, want) <= 1e-5
  for got_r, want_r in zip(history, want_history, strict=True):
    assert got_r["pairs"] == want_r["pairs"] == 4
    assert got_r["loss"] == pytest.approx(want_r["loss"], rel=1e-5)
    for name in ("chosen_reward", "rejected_reward", "reward_margin"):
      assert got_r[name] == pytest.approx(want_r[name], abs=1e-5), name
    assert got_r["reward_accuracy"] == want_r["reward_accuracy"]
    assert got_r["grad_norm"] == pytest.approx(want_r["grad_norm"], rel=1e-5)
  assert want_history[1]["reward_margin"] != 0.0 and min(r["grad_norm"] for r in want_history) > 0


@needs_8
@pytest.mark.parametrize("module,variant,overrides,match", [
    (ppo_smollm2_arith, "smoke", {"mesh.data": 2, "mesh.branch": 2, "mesh.seq": 2},
     r"mesh.data=2 must divide the groups per minibatch, rollout.prompts_per_step / ppo.minibatches = 2 / 2 = 1"),
    (ppo_smollm2_arith, "tree_smoke", {"mesh.branch": 2, "mesh.seq": 4},
     r"mesh.seq=4 with rollout.tree_fanouts=\(2, 2\): PPO's tree replay does not split the prompt over seq"),
    (ppo_smollm2_arith, "smoke", {"mesh.branch": 4, "mesh.seq": 2, "train.gradient": "naive"},
     "train.gradient='naive'"),
    (dpo_smollm2_arith, "jsonl_smoke", {"mesh.data": 2, "mesh.branch": 4, "train.gradient": "naive"},
     "train.gradient='naive'"),
    (dpo_smollm2_arith, "jsonl_smoke", {"mesh.data": 3}, "mesh.data x mesh.branch x mesh.seq = 3 x 1 x 1"),
    (dpo_smollm2_arith, "jsonl_smoke", {"mesh.data": 8, "mesh.params": "zero3"}, "mesh.params='zero3'"),
])
def test_what_cannot_run_on_the_mesh_is_refused(tmp_path, module, variant, overrides, match):
  with pytest.raises(ValueError, match=match):
    _run(module, variant, tmp_path, **overrides)
  assert not (tmp_path / "checkpoints").exists()
