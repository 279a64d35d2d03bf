"""The GRPO loop as two processes (jax.distributed, CPU collectives over gloo) of 4 devices each,
against one process of 8 devices: same samples, metrics and parameters, and a resume across the
two layouts (docs/design.md, "Several processes"); the stale loop with each process's sampler on devices of its
own (a rollout sub-mesh); PPO and DPO the same way (heavy); data-parallel
sampling on one process's mesh (GRPO's groups, DPO's pairs) equal to one device's.

Each two-process run starts tests/multihost_worker.py twice (process 0 and 1, XLA_FLAGS giving each 4
CPU devices), which joins through `distributed.hosts.initialize` and runs main's entry point on
the smoke config with the same scoring stand-in as the in-process runs (conftest.length_score).
"""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from branch_replay_jax.algorithms import grpo as train
from branch_replay_jax.rollout.tasks import Task
from conftest import experiment_config, length_score
from experiments import grpo_smollm2_arith

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The smoke config's 2 held-out problems: as two processes, problem 1 is answered on process 1's
# first device (hosts.spread_devices), so the evaluation's results cross processes (hosts.gather_items).
MESH = {"mesh.data": 2, "mesh.branch": 4, "train.micro_batch": 1, "model.attention_impl": "xla"}


def flags(overrides: dict) -> list[str]:
  return [f"--config.{k}={v}" for k, v in overrides.items()]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def two_processes(run_dir, config="experiments/grpo_smollm2_arith.py:smoke", env=None, **overrides) -> None:
  """The smoke run (`config`) on a 2 x 4 x 1 mesh (or as `overrides` say) as 2 processes x 4 CPU
  devices, with `env` added to their environment; raises if either fails."""
  env = {**os.environ, **(env or {}), "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
         "JAX_COORDINATOR_ADDRESS": f"localhost:{free_port()}", "JAX_NUM_PROCESSES": "2",
         "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
  argv = [sys.executable, os.path.join(ROOT, "tests", "multihost_worker.py"), f"--config={config}",
          f"--config.run_dir={run_dir}", *flags({**MESH, **overrides})]
  procs = [subprocess.Popen(argv, cwd=ROOT, env={**env, "JAX_PROCESS_ID": str(i)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  outs = [p.communicate(timeout=600)[0] for p in procs]
  for i, (p, out) in enumerate(zip(procs, outs)):
    assert p.returncode == 0, f"process {i} exited {p.returncode}:\n{out[-4000:]}"


def lines(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
  """The same mesh in this process (8 fake devices, conftest), two steps."""
  run_dir = tmp_path_factory.mktemp("one_process")
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(Task, "score", length_score)
    train.train(experiment_config(grpo_smollm2_arith, "smoke", run_dir, **MESH))
  return run_dir


def same_run(got_dir, want_dir):
  """Equal samples and rewards (same keys, same per-group programs), metrics to float32 rounding,
  parameters to 1e-5 relative: the processes' collectives sum the gradient in another order than
  one process's all-reduce, and Adam's division by sqrt(v) amplifies that rounding on near-zero
  elements to a fraction of the learning rate (1e-5), < 1e-5 of the largest parameter; a group
  lost or counted twice moves whole leaves by ~lr (test_train.py, same bound)."""
  from conftest import final_params, max_rel, same_eval_rows
  assert lines(os.path.join(got_dir, "samples.jsonl")) == lines(os.path.join(want_dir, "samples.jsonl"))
  assert same_eval_rows(got_dir, want_dir)
  got, want = lines(os.path.join(got_dir, "metrics.jsonl")), lines(os.path.join(want_dir, "metrics.jsonl"))
  assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2]
  for g, w in zip(got, want):
    for name in ("reward_mean", "accuracy", "completion_len_mean", "token_positions_computed", "zero_variance_groups"):
      assert g[name] == w[name], name
    for name in ("loss", "kl", "grad_norm"):
      assert g[name] == pytest.approx(w[name], rel=1e-4, abs=1e-9), name
  assert min(r["grad_norm"] for r in want) > 0.1   # the runs really update (varied rewards)
  got_params, got_meta = final_params(got_dir)
  want_params, want_meta = final_params(want_dir)
  assert got_meta == want_meta == {"step": 2, "data_pos": 4}
  assert max_rel(got_params, want_params) <= 1e-5


STALE = {"train.max_staleness": 1}


@pytest.fixture(scope="module")
def stale_one_process(tmp_path_factory):
  """`one_process` at train.max_staleness = 1: both steps sampled by version 0, the second off-policy."""
  run_dir = tmp_path_factory.mktemp("stale_one_process")
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(Task, "score", length_score)
    train.train(experiment_config(grpo_smollm2_arith, "smoke", run_dir, **MESH, **STALE))
  return run_dir


@pytest.mark.slow
# heavy: ~60 s; CI runs the rollout sub-mesh test below: the same two-process loop, its gathers and collectives
@pytest.mark.heavy
@pytest.mark.skipif(jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
def test_two_processes_train_as_one(one_process, tmp_path):
  two_processes(tmp_path)
  same_run(tmp_path, one_process)
  # process 0 alone wrote the logs: one record per step, not one per process
  assert len(lines(os.path.join(tmp_path, "metrics.jsonl"))) == 2


# heavy: ~60 s. CI runs test_two_processes_sample_on_a_rollout_sub_mesh_of_their_own_devices below: the same stale
# two-process loop (inline producer, gathers, collectives) against the same one-process run, whose held-out
# evaluation samples on the training mesh's devices across both processes.
@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.skipif(jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
def test_two_processes_with_stale_rollouts_train_as_one_process(stale_one_process, tmp_path):
  # train.max_staleness = 1 as two processes: each samples in its loop's thread (producer.inline), one process
  # in a producer thread; the versions are a function of the step, so the samples, metrics and parameters
  # are the one process's (same_run's bounds), and both steps were sampled by version 0.
  two_processes(tmp_path, **STALE)
  same_run(tmp_path, stale_one_process)
  got = lines(os.path.join(tmp_path, "metrics.jsonl"))
  assert [r["policy_version"] for r in got] == [0, 0] and [r["staleness_max"] for r in got] == [0, 1]


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
def test_two_processes_sample_on_a_rollout_sub_mesh_of_their_own_devices(stale_one_process, tmp_path):
  # mesh.rollout_devices = 4 as two processes of 4 devices: each keeps its last 2 for the sampler (2, 3 and 6, 7) and
  # trains on a 2 x 2 x 1 mesh of the others (rows 0, 1 and 4, 5), each rollout device's parameters copied from its
  # own process's training devices. At k = 1 both steps sample with version 0, which no mesh changes, so the
  # samples equal one process's on a 2 x 4 x 1 mesh with no sub-mesh; metrics and parameters within same_run's
  # rounding bounds (the gradients are reduced over other devices, in another order).
  two_processes(tmp_path, **STALE, **{"mesh.branch": 2, "mesh.rollout_devices": 4})
  same_run(tmp_path, stale_one_process)
  got = lines(os.path.join(tmp_path, "metrics.jsonl"))
  assert [r["policy_version"] for r in got] == [0, 0] and [r["staleness_max"] for r in got] == [0, 1]


def test_a_rollout_sub_mesh_takes_an_equal_share_of_each_processs_devices(monkeypatch):
  # 2 processes x 4 devices (faked: the process index of device i is i // 4), mesh.rollout_devices = 4: the sampler
  # takes devices 2, 3, 6, 7 and the 2 x 2 x 1 training mesh 0, 1, 4, 5 (each data row in one process); 3 does not
  # split over 2 processes and is refused naming the field.
  from branch_replay_jax.algorithms import checks, placement
  from conftest import experiment_config

  class Device:
    def __init__(self, i):
      self.id, self.process_index = i, i // 4

    def __repr__(self):
      return f"d{self.id}"
  devices = [Device(i) for i in range(8)]
  monkeypatch.setattr(jax, "devices", lambda: devices)
  config = experiment_config(grpo_smollm2_arith, "smoke", "/tmp/unused", **{"mesh.data": 2, "mesh.branch": 2,
                                                                              "mesh.rollout_devices": 4})
  rollout = placement.rollout_devices(config)
  assert [d.id for d in rollout] == [2, 3, 6, 7]
  # each process samples the groups its training rows hold: 4 groups over data rows 0, 0, 1, 1 (processes 0, 0,
  # 1, 1) sample on devices 2, 3, 6, 7; 2 groups (one per row) on 2 and 6.
  rows = np.asarray([devices[i] for i in (0, 1, 4, 5)], object).reshape(2, 2, 1)
  mesh = type("Mesh", (), {"devices": rows, "shape": {"data": 2}})()
  assert [d.id for d in placement.sampling_devices(mesh, 4, rollout)] == [2, 3, 6, 7]
  assert [d.id for d in placement.sampling_devices(mesh, 2, rollout)] == [2, 6]
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  config.mesh.rollout_devices = 3
  with pytest.raises(ValueError, match=r"mesh.rollout_devices=3 with 2 processes: .* use a multiple of 2"):
    checks.validate_mesh_shape(config)


@pytest.mark.slow
@pytest.mark.heavy   # ~70 s on 2 idle cores; CI runs the two-process test above (same checkpoints code, one layout)
@pytest.mark.skipif(jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
def test_resume_across_layouts(one_process, tmp_path):
  # Step 1 in one process of 8 devices, step 2 resumed from its checkpoint as 2 processes of 4:
  # the checkpoint holds whole arrays (orbax), so either layout restores it.
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(Task, "score", length_score)
    train.train(experiment_config(grpo_smollm2_arith, "smoke", tmp_path, **{**MESH, "train.steps": 1}))
  two_processes(tmp_path, resume=True)
  same_run(tmp_path, one_process)


@pytest.mark.parametrize("env,overrides,message", [
    ({"JAX_NUM_PROCESSES": "2"}, {}, "distributed.coordinator_address=None: 2 processes need a coordinator address"),
    ({}, {"distributed.num_processes": 0}, "distributed.num_processes=0 must be an int >= 1"),
    ({}, {"distributed.num_processes": 2, "distributed.process_id": 2, "distributed.coordinator_address": "h:1"},
     r"distributed.process_id=2 must be an int in \[0, num_processes=2\)"),
    ({"JAX_NUM_PROCESSES": "two"}, {}, "environment variable JAX_NUM_PROCESSES='two' must be an int"),
])
def test_bad_distributed_settings(monkeypatch, tmp_path, env, overrides, message):
  from branch_replay_jax.distributed import hosts
  for var in hosts.ENVIRONMENT.values():
    monkeypatch.delenv(var, raising=False)
  for var, value in env.items():
    monkeypatch.setenv(var, value)
  with pytest.raises(ValueError, match=message):
    hosts.settings(experiment_config(grpo_smollm2_arith, "smoke", tmp_path, **overrides))


def test_settings_not_joined_are_refused(tmp_path):
  # A config asking for 2 processes run in one that never joined them (train.train called
  # directly, not through main) fails before loading anything.
  config = experiment_config(grpo_smollm2_arith, "smoke", tmp_path, **{
      "distributed.num_processes": 2, "distributed.process_id": 0, "distributed.coordinator_address": "localhost:1"})
  with pytest.raises(ValueError, match="distributed.num_processes=2 but this is one of 1 processes"):
    train.train(config)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
def test_data_parallel_sampling_draws_the_same_groups(tmp_path):
  # 4 groups on a 2 x 2 x 2 mesh: each samples on its own device (data row i // 2, device i mod 2
  # of the row), all at once, from gathered FSDP parameters; group i's key is (seed, step, i) as on
  # one device and its program the same, so every array of every group equals the one-device
  # sampling's bit for bit.
  from flax import nnx

  from branch_replay_jax.algorithms import loop, placement, runs
  from branch_replay_jax.distributed import hosts
  from branch_replay_jax.distributed.mesh import make_mesh, shard_params
  config = experiment_config(grpo_smollm2_arith, "smoke", tmp_path, **{"rollout.prompts_per_step": 4})
  model, tokenizer = runs.build_model(config)
  graphdef, params = nnx.split(model)
  task, key = runs.make_task_from(config), jax.random.key(0)
  want, _ = loop.sample_groups(config, model, tokenizer, task, key, 3, 5)
  mesh = make_mesh(2, 2, 2)
  devices = hosts.sampling_devices(mesh, 4)
  assert devices == [mesh.devices[i // 2].reshape(-1)[i % 2] for i in range(4)] and len(set(devices)) == 4
  # hosts.device_copies
  policy = placement.sampling_policy(graphdef, shard_params(params, mesh, "fsdp"), mesh, devices)
  got, pos = loop.sample_groups(config, policy, tokenizer, task, key, 3, 5, devices=devices)
  assert pos == 9
  for g, w in zip(got, want):
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)),
                                                         g.batch, w.batch))
    assert np.array_equal(g.rewards, w.rewards) and g.sample == w.sample


@pytest.mark.skipif(jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
def test_dpo_data_parallel_sampling_draws_the_same_pairs(tmp_path, monkeypatch):
  # DPO's 3 prompts (no divisibility asked: its groups are padded to the mesh) spread over a 2 x 2 x 2
  # FSDP mesh (hosts.spread_devices: the mesh's first three devices), each sampling from gathered
  # parameters with the key (seed, step, i) of one device: the same pairs, token for token, the same
  # rewards, skipped prompts and logged sample as sampling them one after another on one device.
  from flax import nnx

  from branch_replay_jax.algorithms import dpo, placement, runs
  from branch_replay_jax.distributed.mesh import make_mesh, shard_params
  from experiments import dpo_smollm2_arith
  monkeypatch.setattr(Task, "score", length_score)   # varied rewards: pairs to compare
  config = experiment_config(dpo_smollm2_arith, "smoke", tmp_path, **{"rollout.prompts_per_step": 3})
  model, tokenizer = runs.build_model(config)
  graphdef, params = nnx.split(model)
  task, key = runs.make_task_from(config), jax.random.key(0)
  want_pairs, want_info = dpo.sample_pairs(config, model, tokenizer, task, key, 3, 5)
  mesh = make_mesh(2, 2, 2)
  devices = placement.spread_devices(mesh, 3)
  assert devices == list(mesh.devices.flat)[:3]
  policy = placement.sampling_policy(graphdef, shard_params(params, mesh, "fsdp"), mesh, devices)
  got_pairs, got_info = dpo.sample_pairs(config, policy, tokenizer, task, key, 3, 5, devices=devices)
  assert len(want_pairs) >= 2   # not vacuous: several prompts gave a pair
  assert len(got_pairs) == len(want_pairs)
  for g, w in zip(got_pairs, want_pairs):
    for field in ("prompt_ids", "chosen_ids", "rejected_ids"):
      assert np.array_equal(getattr(g, field), getattr(w, field)), field
  assert np.array_equal(got_info["rewards"], want_info["rewards"])
  assert np.array_equal(got_info["correct"], want_info["correct"])
  assert got_info["skipped_prompts"] == want_info["skipped_prompts"]
  assert got_info["sample"] == want_info["sample"]


# PPO, DPO and GRPO's trees as 2 processes x 4 devices against 1 process x 8. Each process samples
# its devices' groups (PPO, trees: on their data rows; DPO: its prompts spread over the devices),
# then every process receives the whole step (loop.sample_groups whole=True; dpo.sample_pairs), so
# PPO's GAE, whitening and minibatch shuffle, DPO's pair layout and the trees' padded shape are
# computed alike everywhere and each process places its rows. Per case: the smoke config (DPO:
# prompts sampled from the task), the overrides both runs take (PPO: one minibatch of both groups,
# as mesh.data = 2 asks; trees: fan-outs (2, 2) split over branch = 2, FSDP), the metrics that must
# be equal (counts, rewards) and those equal to float32 rounding (a gradient summed over the
# processes in another order: rel 1e-4; DPO's implicit rewards beta (S - S_ref) difference sums of
# a few hundred nats, float32 spacing ~3e-5 times beta: abs 1e-5, as tests/test_mesh_algorithms.py),
# and whether each step's first tree is cut short (conftest.cut_by_eos): it samples on process 0,
# the full tree on process 1, so the processes' own trees differ in shape and the step pads to the
# largest over both.
ALGORITHMS = {
    "ppo": ("experiments/ppo_smollm2_arith.py:smoke", {"ppo.minibatches": 1},
            ("reward_mean", "accuracy", "completion_len_mean", "token_positions_computed", "zero_variance_groups"),
            ("loss", "policy_loss", "value_loss", "kl", "clip_frac", "grad_norm", "value_mean", "return_mean"), False),
    "dpo": ("experiments/dpo_smollm2_arith.py:smoke", {},
            ("pairs", "skipped_prompts", "reward_mean", "accuracy", "reward_accuracy", "token_positions_computed"),
            ("loss", "grad_norm"), False),
    "grpo_tree": ("experiments/grpo_tree_smollm2_arith.py:smoke",
                  {"mesh.branch": 2, "mesh.seq": 2, "mesh.params": "fsdp"},
                  ("reward_mean", "clip_frac", "token_positions_naive", "token_positions_computed",
                   "completion_len_mean", "padding_fraction"), ("loss", "kl", "grad_norm"), True),
}


# Measured on 2 shared CPU cores: PPO 213 s, DPO 165 s, trees 312 s (one-process reference included;
# the samplers and steps compile in each process): `heavy`; the GRPO two-process test above runs in CI.
@pytest.mark.heavy
@pytest.mark.skipif(jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_two_processes_train_as_one_process(name, tmp_path):
  import importlib

  from branch_replay_jax import main as entry
  from branch_replay_jax.rollout import collect
  from conftest import cut_by_eos
  from conftest import final_params, max_rel, same_eval_rows
  config_arg, overrides, exact, close, cut = ALGORITHMS[name]
  path, variant = config_arg.split(":")
  module = importlib.import_module(path.replace("/", ".").removesuffix(".py"))
  want_dir, got_dir, shapes = tmp_path / "one", tmp_path / "two", []
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(Task, "score", length_score)
    if cut:
      mp.setattr(collect, "sample_tree", cut_by_eos(shapes))
    config = experiment_config(module, variant, want_dir, **{**MESH, **overrides})
    importlib.import_module(entry.TRAINERS[config.get("algorithm", "grpo")]).train(config)
  if cut:
    assert sorted(set(shapes)) == [2, 4]   # a one-level tree of 2 trajectories beside full ones of 4
  two_processes(got_dir, config_arg, env={"MULTIHOST_CUT_TREES": "1"} if cut else None, **overrides)
  assert lines(got_dir / "samples.jsonl") == lines(want_dir / "samples.jsonl")
  if (want_dir / "eval.jsonl").exists():   # the GRPO-derived smoke configs evaluate (steps 0 and 2)
    assert same_eval_rows(got_dir, want_dir)
  got, want = lines(got_dir / "metrics.jsonl"), lines(want_dir / "metrics.jsonl")
  assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2]   # process 0 alone wrote
  for g, w in zip(got, want):
    for metric in exact:
      assert g[metric] == w[metric], metric
    for metric in close:
      assert g[metric] == pytest.approx(w[metric], rel=1e-4, abs=1e-9), metric
    for metric in ("chosen_reward", "rejected_reward", "reward_margin"):
      if metric in w:
        assert g[metric] == pytest.approx(w[metric], abs=1e-5), metric
  assert min(r["grad_norm"] for r in want) > 0   # the runs really update (pairs, varied rewards)
  got_params, got_meta = final_params(got_dir)
  want_params, want_meta = final_params(want_dir)
  assert got_meta == want_meta and got_meta["step"] == 2
  assert max_rel(got_params, want_params) <= 1e-5
