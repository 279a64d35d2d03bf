"""The GRPO loop on the smoke config: runs end to end, resumes exactly, replay == naive, bad input."""

import json
import os

import jax
import numpy as np
import pytest

from flax import nnx

from branch_replay_jax.algorithms import grpo as train
from branch_replay_jax.algorithms import runs
from branch_replay_jax.outputs.checkpoints import RunCheckpoints
from branch_replay_jax.rollout.tasks import Task
from conftest import cut_by_eos, experiment_config, final_params, grpo_smoke, length_score, max_rel, same_eval_rows

REQUIRED = {"step", "reward_mean", "reward_std", "accuracy", "kl", "clip_frac", "completion_len_mean", "truncated_frac",
            "zero_variance_groups", "token_positions_naive", "token_positions_computed", "ideal_flop_ratio",
            "sample_s", "score_s", "update_s", "step_s"}


@pytest.fixture(autouse=True, scope="module")
def varied_rewards():
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(Task, "score", length_score)
    yield


@pytest.fixture(scope="module")
def replay_run(tmp_path_factory):
  run_dir = tmp_path_factory.mktemp("replay")
  history = train.train(grpo_smoke(run_dir))
  return run_dir, history


def test_smoke_run_writes_metrics_plots_and_checkpoints(replay_run):
  run_dir, history = replay_run
  assert [r["step"] for r in history] == [1, 2]
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  assert len(records) == 2 and REQUIRED <= set(records[0])
  # 2 prompts x G=4 completions: naive counts each prompt 4 times, replay once.
  r = records[0]
  assert r["token_positions_naive"] - r["token_positions_computed"] > 0
  assert r["ideal_flop_ratio"] > 1.0
  for name in ("reward.png", "throughput.png", "samples.jsonl", "experiment.json"):
    assert os.path.exists(os.path.join(run_dir, name)), name
  params, meta = final_params(run_dir)
  assert meta == {"step": 2, "data_pos": 4}
  # The update really moved the parameters: Adam's first steps move every element with a non-zero
  # gradient by about the learning rate (1e-5), so the largest move over two steps is >= 1e-5.
  assert any(r["zero_variance_groups"] < 2 for r in records)
  _, init = nnx.split(runs.build_model(grpo_smoke(run_dir))[0])
  moved = jax.tree_util.tree_map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()), params,
                                 nnx.to_pure_dict(init))
  assert max(jax.tree_util.tree_leaves(moved)) >= 1e-5


def test_resumed_run_equals_uninterrupted(replay_run, tmp_path):
  # Sampling keys derive from (seed, step) and the data position is checkpointed, so stopping
  # after step 1 and resuming must reproduce the uninterrupted run's parameters.
  run_dir, _ = replay_run
  train.train(grpo_smoke(tmp_path, **{"train.steps": 1}))
  history = train.train(grpo_smoke(tmp_path, resume=True))
  assert [r["step"] for r in history] == [2]
  got, _ = final_params(tmp_path)
  want, _ = final_params(run_dir)
  assert max_rel(got, want) <= 1e-6
  with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
    assert [json.loads(line)["step"] for line in f] == [1, 2]


def test_naive_gradient_mode_trains_to_the_same_parameters(replay_run, tmp_path):
  # Same seed, same samples, exact gradients in both modes: equal parameters after two steps.
  # Adam divides by sqrt(v): float32 rounding noise on near-zero gradient elements moves them by
  # a fraction of lr (1e-5), i.e. < 1e-6 of the largest parameter (~0.08); a dropped or doubled
  # prefix cotangent changes whole gradient leaves and moves elements by ~lr (> 1e-4 relative).
  run_dir, _ = replay_run
  train.train(grpo_smoke(tmp_path, **{"train.gradient": "naive"}))
  got, _ = final_params(tmp_path)
  want, _ = final_params(run_dir)
  assert max_rel(got, want) <= 1e-5


def test_bfloat16_parameters_keep_a_float32_master(replay_run, tmp_path):
  # model.param_dtype = bfloat16: every step sees the parameters rounded to bfloat16 (sampling,
  # log-probs, gradients), the optimizer updates a float32 master, which the checkpoint holds.
  # With lr 1e-5 each Adam step moves a parameter by ~1e-5, far below bfloat16's resolution of a
  # weight ~0.02 (2**-8 relative): a bfloat16 master would leave most weights unchanged; the float32
  # master moves them, and stays within 2 x 1e-5 per step of the float32 run's parameters.
  run_dir, _ = replay_run
  history = train.train(grpo_smoke(tmp_path, **{"model.param_dtype": "bfloat16"}))
  got, _ = final_params(tmp_path)
  want, _ = final_params(run_dir)
  start = jax.tree_util.tree_map(np.asarray, nnx.to_pure_dict(nnx.split(runs.build_model(
      grpo_smoke(tmp_path / "init"))[0])[1]))
  assert all(np.asarray(x).dtype == np.float32 for x in jax.tree_util.tree_leaves(got))
  moved = [np.abs(np.asarray(g) - np.asarray(s)).max() for g, s in
           zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(start))]
  assert min(moved) > 0 and all(0 < m <= 2 * 1e-5 * len(history) * 1.01 for m in moved), moved
  diff = [np.abs(np.asarray(g) - np.asarray(w)).max() for g, w in
          zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want))]
  assert max(diff) <= 2 * 2 * 1e-5 * len(history)
  assert all(np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"]) for r in history)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
# 2x2x2-fsdp is heavy (~35 s): the group run on a mesh stays in CI as 2x4x1, and an FSDP 2x2x2 run as
# test_mesh_tree_run_trains_to_the_same_parameters[2x2x2-fsdp].
@pytest.mark.parametrize("mesh,params,micro_batch", [pytest.param((2, 2, 2), "fsdp", 2, marks=pytest.mark.heavy),
                                                     ((2, 4, 1), "replicated", 1)], ids=["2x2x2-fsdp", "2x4x1"])
def test_mesh_run_trains_to_the_same_parameters(replay_run, tmp_path, mesh, params, micro_batch):
  # The smoke run's 2 groups x G=4 on 8 fake devices: groups over data, completions over branch,
  # prompt tokens over seq (prompts padded to one length), parameters FSDP-sharded or replicated.
  # The sharded step sums the same gradients in another order, so the parameters equal the
  # one-device run's to the Adam rounding bound of the replay-vs-naive test (1e-5), the gradient
  # norms to float32 rounding, and the rewards and the aux metrics (KL, clip fraction) match.
  # (On-policy with lr 1e-5 the KL and clip fraction are 0 in both runs; test_mesh.py checks the
  # sharded aux and log-probs with non-zero values.)
  run_dir, history = replay_run
  data, branch, seq = mesh
  got_history = train.train(grpo_smoke(tmp_path, **{"mesh.data": data, "mesh.branch": branch, "mesh.seq": seq,
                                               "mesh.params": params, "train.micro_batch": micro_batch}))
  got, _ = final_params(tmp_path)
  want, _ = final_params(run_dir)
  assert max_rel(got, want) <= 1e-5
  # Sampling is data-parallel on the mesh (each group on a device of its data row) and draws the
  # same completions as the one device.
  samples = [open(os.path.join(d, "samples.jsonl")).read() for d in (tmp_path, run_dir)]
  assert samples[0] == samples[1]
  for got_r, want_r in zip(got_history, history):
    assert got_r["reward_mean"] == want_r["reward_mean"]
    assert got_r["clip_frac"] == want_r["clip_frac"]
    assert got_r["kl"] == pytest.approx(want_r["kl"], rel=1e-4, abs=1e-9)
    assert got_r["loss"] == pytest.approx(want_r["loss"], rel=1e-4, abs=1e-7)
    assert got_r["grad_norm"] == pytest.approx(want_r["grad_norm"], rel=1e-5)
  assert min(r["grad_norm"] for r in history) > 0.1   # the smoke run's gradients are not vacuous
  # The held-out evaluation spreads its problems over the mesh's devices (hosts.spread_devices) with
  # the keys of one device: the same figures as the one-device run.
  assert same_eval_rows(tmp_path, run_dir)


@pytest.mark.parametrize("field,value,match", [
    ("mesh.data", 3, r"mesh.data x mesh.branch x mesh.seq = 3 x 1 x 1 = 3 must equal the device count"),
    ("mesh.branch", 0, "mesh.branch=0"),
    ("mesh.params", "zero3", "mesh.params='zero3'"),
    ("mesh.branch", 8, "mesh.branch=8 must divide rollout.group_size=4"),
    ("rollout.group_size", 1, "rollout.group_size=1"),
    ("task.name", "sudoku_of_doom", "sudoku_of_doom"),
    ("train.gradient", "magic", "train.gradient='magic'"),
    ("train.micro_batch", 3, "train.micro_batch=3"),
    ("loss.normalisation", "mean", "loss.normalisation='mean'"),
])
def test_bad_config_fails_before_any_compute(tmp_path, field, value, match):
  with pytest.raises(ValueError, match=match):
    train.train(grpo_smoke(tmp_path, **{field: value}))
  assert not os.path.exists(os.path.join(tmp_path, "checkpoints"))


@pytest.mark.skipif(jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
@pytest.mark.parametrize("impl", ["splash"])
def test_splash_attention_on_a_mesh_is_refused(tmp_path, impl):
  # JAX's splash kernels build their pallas_call outputs with no mesh-varying type, so they fail
  # inside shard_map(check_vma): refused by validation, naming the field, before the model loads.
  # (The Triton kernels, "pallas", run there: tests/test_mesh_kernels.py.)
  with pytest.raises(ValueError, match=f"model.attention_impl='{impl}'"):
    train.train(grpo_smoke(tmp_path, **{"mesh.data": 2, "mesh.branch": 4, "model.attention_impl": impl}))
  assert not os.path.exists(os.path.join(tmp_path, "checkpoints"))


@pytest.mark.skipif(jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
@pytest.mark.parametrize("overrides,match", [
    ({"mesh.branch": 4, "mesh.seq": 2}, r"mesh.branch=4 must divide the first fan-out rollout.tree_fanouts\[0\] of "
                                        r"rollout.tree_fanouts=\(2, 2\)"),
    ({"mesh.data": 4, "mesh.seq": 2}, r"mesh.data=4 must divide rollout.prompts_per_step=2"),
    ({"mesh.branch": 2, "mesh.seq": 4, "rollout.tree_fanouts": (4,), "train.micro_batch": 4},
     r"train.micro_batch=4 must divide the leaf siblings per device, rollout.tree_fanouts\[0\] / mesh.branch = 4 / 2"),
], ids=["branch", "data", "micro_batch"])
def test_tree_mesh_that_does_not_split_is_refused(tmp_path, overrides, match):
  # Trees run on the mesh with first-level subtrees over mesh.branch, trees over mesh.data: a split
  # that is not even is refused by validation, naming the fields, before the model loads.
  with pytest.raises(ValueError, match=match):
    train.train(tree_smoke(tmp_path, **overrides))
  assert not os.path.exists(os.path.join(tmp_path, "checkpoints"))


def test_run_dir_of_another_experiment_is_refused(replay_run):
  run_dir, _ = replay_run
  with pytest.raises(ValueError, match="different experiment"):
    train.train(grpo_smoke(run_dir, seed=123, resume=True))


def test_prompt_longer_than_context_is_refused(tmp_path):
  # The tiny model's context is 2048 tokens. A budget of 4000 can never fit: refused by validation,
  # before the model loads. A budget of 2040 leaves 8 tokens, fewer than any chat-formatted prompt:
  # refused when the first prompt is laid out, naming the model's limit.
  with pytest.raises(ValueError, match=r"rollout.max_new_tokens=4000 leaves no room for a prompt .* it must be < 2048"):
    train.train(grpo_smoke(tmp_path / "a", **{"rollout.max_new_tokens": 4000}))
  # (rollout's own check, or the sampler's when the step-0 evaluation samples first)
  with pytest.raises(ValueError, match="exceeds (the model's|model.config.)max_positions"):
    train.train(grpo_smoke(tmp_path / "b", **{"rollout.max_new_tokens": 2040}))


def tree_smoke(run_dir, **overrides):
  from experiments import grpo_tree_smollm2_arith
  return experiment_config(grpo_tree_smollm2_arith, "smoke", run_dir, **overrides)


@pytest.fixture(scope="module")
def tree_run(tmp_path_factory):
  """The tree smoke run on one device (fan-outs (2, 2), 4-token segments, 2 trees a step), some
  trees cut short by EOS (`_cut_by_eos`): (run_dir, history, trajectories per tree in sampling order)."""
  from branch_replay_jax.rollout import collect
  run_dir, shapes = tmp_path_factory.mktemp("tree"), []
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(collect, "sample_tree", cut_by_eos(shapes))
    history = train.train(tree_smoke(run_dir))
  return run_dir, history, shapes


def test_tree_rollouts_replay_equals_naive(tree_run, tmp_path, monkeypatch):
  # The tree experiment's smoke variant, full trees and trees cut short by EOS: nested replay and the
  # naive step over the same trajectories must train to the same parameters, and a tree is drawn
  # per step.
  from branch_replay_jax.rollout import collect
  run_dir, history, shapes = tree_run
  assert sorted(set(shapes)) == [2, 4]   # both shapes occur
  monkeypatch.setattr(collect, "sample_tree", cut_by_eos([]))
  train.train(tree_smoke(tmp_path, **{"train.gradient": "naive"}))
  assert history[0]["token_positions_naive"] > history[0]["token_positions_computed"]
  assert os.path.getsize(run_dir / "trees" / "step_2.png") > 0
  assert max_rel(final_params(run_dir)[0], final_params(tmp_path)[0]) <= 1e-5


@pytest.mark.heavy   # ~1 min; packed trees in CI: tests/test_packed.py (one program for three layouts), the episode
#                     loop's packed step metrics and exactness check (tests/test_episode_loop.py), the mesh episode test
def test_a_packed_tree_run_trains_as_the_nested_one_in_one_program(tree_run, tmp_path, monkeypatch):
  # train.tree_schedule = "packed": each step's trees as rows of one length (data.batches.pack_trees).
  # The same trees (full and cut by EOS) must train to the nested replay run's parameters (<= 1e-5,
  # the Adam rounding bound of the replay-vs-naive test) with the same logged figures (float32
  # rounding for loss, KL and gradient norm), in one program (tests/test_packed.py: trees of three
  # level layouts, one packed program).
  from branch_replay_jax.rollout import collect
  run_dir, history, shapes = tree_run
  monkeypatch.setattr(collect, "sample_tree", cut_by_eos([]))
  got = train.train(tree_smoke(tmp_path, **{"train.tree_schedule": "packed"}))
  assert max_rel(final_params(tmp_path)[0], final_params(run_dir)[0]) <= 1e-5
  for got_r, want_r in zip(got, history):
    for name in ("reward_mean", "clip_frac", "token_positions_naive", "token_positions_computed", "completion_len_mean"):
      assert got_r[name] == want_r[name], name
    assert got_r["loss"] == pytest.approx(want_r["loss"], rel=1e-4, abs=1e-7)   # on-policy: ~0 (float32 noise)
    for name in ("kl", "grad_norm"):
      assert got_r[name] == pytest.approx(want_r[name], rel=1e-4, abs=1e-9), name
  assert [r["step_compiles"] for r in got] == [1] * len(got)   # both steps' rows: one 64-row bucket


@pytest.mark.skipif(jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
@pytest.mark.parametrize("mesh,params,schedule", [
    pytest.param((2, 2, 2), "fsdp", "depth_first", id="2x2x2-fsdp"),
    pytest.param((1, 2, 4), "replicated", "level", id="1x2x4-level", marks=pytest.mark.heavy)])
def test_mesh_tree_run_trains_to_the_same_parameters(tree_run, tmp_path, monkeypatch, mesh, params, schedule):
  # The tree smoke run on 8 fake devices: trees over data, first-level subtrees over branch, prompt
  # tokens over seq. Each step's two trees differ in shape (a one-level tree with 2 trajectories
  # beside a two-level one with 4, and prompts of different lengths), so the step pads them to one
  # layout (data.batches.pad_trees, pad_prompts), whose padding adds exact zeros. The sharded step
  # sums the same terms in another order: the parameters equal the one-device run's to the Adam
  # rounding bound of the replay-vs-naive test (1e-5), the metrics to float32 rounding. The KL is
  # live (kl_coef 0.04, sharded reference log-probs) from step 2 on; on-policy nothing clips.
  from branch_replay_jax.rollout import collect
  run_dir, history, shapes = tree_run
  assert any(a != b for a, b in zip(shapes[0::2], shapes[1::2]))   # some step pads one tree to the other
  monkeypatch.setattr(collect, "sample_tree", cut_by_eos([]))
  data, branch, seq = mesh
  got_history = train.train(tree_smoke(tmp_path, **{"mesh.data": data, "mesh.branch": branch, "mesh.seq": seq,
                                                    "mesh.params": params, "train.tree_schedule": schedule}))
  assert max_rel(final_params(tmp_path)[0], final_params(run_dir)[0]) <= 1e-5
  for got_r, want_r in zip(got_history, history):
    for name in ("reward_mean", "clip_frac", "token_positions_naive", "token_positions_computed",
                 "completion_len_mean", "padding_fraction"):
      assert got_r[name] == want_r[name], name
    assert got_r["kl"] == pytest.approx(want_r["kl"], rel=1e-4, abs=1e-9)   # step 2: ~2e-8 (lr 1e-5)
    assert got_r["loss"] == pytest.approx(want_r["loss"], rel=1e-4, abs=1e-7)
    assert got_r["grad_norm"] == pytest.approx(want_r["grad_norm"], rel=1e-5)
  assert history[1]["kl"] > 0 and min(r["grad_norm"] for r in history) > 0.1   # not vacuous


@pytest.mark.heavy   # ~3 min on loaded cores; trees replay == naive in CI: test_tree_rollouts_replay_equals_naive, the exactness check's tree case
def test_tree_rollouts_with_kl_and_inner_epochs_replay_equals_naive(tmp_path):
  # Reference log-probs (kl_coef > 0) and old log-probs (inner_epochs = 2) come from forward-only
  # tree replay in replay mode and from the naive per-trajectory forward in naive mode; the two
  # runs (replay on the level schedule) must train to the same parameters, as above. A wrong
  # ref/old log-prob (e.g. a node's log-probs placed in another slot) changes the KL and ratio
  # terms of whole trajectories and moves parameters by ~lr (> 1e-4 relative).
  from experiments import grpo_tree_smollm2_arith
  runs = {}
  for mode in ("replay", "naive"):
    config = grpo_tree_smollm2_arith.get_config("smoke")
    config.run_dir = str(tmp_path / mode)
    config.train.gradient = mode
    config.train.tree_schedule = "level"
    config.loss.kl_coef = 0.1
    config.train.inner_epochs = 2
    train.train(config)
    runs[mode], _ = final_params(tmp_path / mode)
  assert max_rel(runs["replay"], runs["naive"]) <= 1e-5


def test_checkpoint_killed_mid_save_leaves_the_previous_one_usable(replay_run, tmp_path):
  # orbax writes step N into "N.orbax-checkpoint-tmp-*" and renames it when complete. A run killed
  # mid-save leaves such a directory behind (here: a copy of the run with a half-written step 3);
  # resuming must see step 2 as the latest and restore it intact.
  import shutil
  run_dir, _ = replay_run
  copy = tmp_path / "run"
  shutil.copytree(run_dir, copy)
  partial = copy / "checkpoints" / "3.orbax-checkpoint-tmp-1764400000000000"
  partial.mkdir()
  (partial / "state").mkdir()
  (partial / "state" / "garbage").write_bytes(b"\x00" * 100)
  ckpt = RunCheckpoints(str(copy))
  assert ckpt.latest_step() == 2
  ckpt.close()
  got, meta = final_params(copy)
  want, _ = final_params(run_dir)
  assert meta["step"] == 2 and max_rel(got, want) == 0.0


# ---------------------------------------------------------------------------------------------
# Run directories: never a mix of two runs.

def _used_copy(replay_run, tmp_path):
  import shutil
  copy = tmp_path / "run"
  shutil.copytree(replay_run[0], copy)
  return copy


def _no_model(cfg):
  raise AssertionError("the model loaded before the run directory was checked")


def test_a_new_run_in_a_used_run_dir_is_refused_before_the_model_loads(replay_run, tmp_path, monkeypatch):
  # The fault: a second run without resume rewrote metrics.jsonl but kept checkpoints 1 and 2, so a later
  # resume=True restored the first run's step 2 and metrics.jsonl read steps 1, then 3, ... of two runs.
  # Refused by name, offering both ways out, and nothing in the directory changes.
  copy = _used_copy(replay_run, tmp_path)
  before = sorted(os.listdir(copy)), (copy / "metrics.jsonl").read_text()
  monkeypatch.setattr(runs, "build_model", _no_model)
  with pytest.raises(ValueError, match=rf"run_dir='{copy}' is not empty .*pass resume=True to continue it, "
                                       r"overwrite=True to delete everything in it first"):
    train.train(grpo_smoke(copy))
  assert (sorted(os.listdir(copy)), (copy / "metrics.jsonl").read_text()) == before
  with pytest.raises(ValueError, match="resume=True and overwrite=True"):
    train.train(grpo_smoke(copy, resume=True, overwrite=True))


def test_overwrite_deletes_the_old_run_checkpoints_included(replay_run, tmp_path, capsys):
  # overwrite=True empties the directory before the run: no old checkpoint is left to resume from, and
  # nothing is reported as a changed field (it is a new run, not a resumption).
  copy = _used_copy(replay_run, tmp_path)
  config = grpo_smoke(copy, overwrite=True)
  assert "checkpoints" in os.listdir(copy)
  runs.prepare_run_dir(config, train.GRPO(config).fingerprint())
  assert os.listdir(copy) == [] and "differ" not in capsys.readouterr().out
  # A directory no run wrote (no experiment.json) is not deleted, even with overwrite.
  (tmp_path / "notes").mkdir()
  (tmp_path / "notes" / "todo.txt").write_text("keep")
  with pytest.raises(ValueError, match="holds files no run wrote"):
    runs.prepare_run_dir(grpo_smoke(tmp_path / "notes", overwrite=True), train.GRPO(config).fingerprint())
  assert (tmp_path / "notes" / "todo.txt").read_text() == "keep"


def test_resume_prints_changed_fields_and_refuses_a_changed_data_order(replay_run, tmp_path, capsys):
  # The smoke run trained at learning rate 1e-5, constant: resuming at 3e-5, cosine lists both changes.
  # The seed is part of the fingerprint (it fixes every sampling key): still refused.
  copy = _used_copy(replay_run, tmp_path)
  config = grpo_smoke(copy, resume=True, **{"train.learning_rate": 3e-5, "train.lr_schedule": "cosine"})
  runs.prepare_run_dir(config, train.GRPO(config).fingerprint())
  out = capsys.readouterr().out
  assert "resume: 2 config fields differ" in out
  assert "train.learning_rate: 1e-05 -> 3e-05" in out and "train.lr_schedule: 'constant' -> 'cosine'" in out
  config = grpo_smoke(copy, resume=True, seed=1)
  with pytest.raises(ValueError, match=r"holds checkpoints of a different experiment \(fields \['seed'\] differ"):
    runs.prepare_run_dir(config, train.GRPO(config).fingerprint())


def test_a_run_dir_that_cannot_hold_a_run_is_refused_before_the_model_loads(tmp_path, monkeypatch):
  monkeypatch.setattr(runs, "build_model", _no_model)
  (tmp_path / "file").write_text("")
  with pytest.raises(ValueError, match=rf"run_dir='{tmp_path}/file' is a file, not a directory"):
    train.train(grpo_smoke(tmp_path / "file"))
  with pytest.raises(ValueError, match=rf"run_dir='{tmp_path}/file/run' cannot be created: {tmp_path}/file is a file"):
    train.train(grpo_smoke(tmp_path / "file" / "run"))
