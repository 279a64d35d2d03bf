"""Checkpoints and resume: a save returns before its write and restores bit for bit; a resumed run
cuts every log back to the restored step."""

import json
import os

import jax
import numpy as np

from branch_replay_jax.algorithms import grpo
from branch_replay_jax.rollout.tasks import Score, Task
from conftest import experiment_config
from experiments import grpo_smollm2_arith


def _length_score(self, completion_text, problem):
  return Score(reward=float(len(completion_text) % 3), correct=False, extracted=None, formatted=False)


def test_resume_from_checkpoint_2_of_3_leaves_each_step_once_in_every_log(monkeypatch, tmp_path):
  # A 3-step smoke run killed after logging step 3 but before its checkpoint landed: checkpoint 2
  # is the latest. Resuming re-runs step 3, so each log must end [1, 2, 3] (before: samples.jsonl
  # kept the killed run's step 3 and got [1, 2, 3, 3]); a log we do not write ourselves
  # (extra.jsonl here) is cut back as well. The held-out evaluation (smoke: eval.every 2) logged
  # steps 0, 2 and 3 (the end): its step-3 row goes and the re-run step 3 writes it once.
  import shutil
  monkeypatch.setattr(Task, "score", _length_score)
  config = experiment_config(grpo_smollm2_arith, "smoke", tmp_path, **{"train.steps": 3})
  grpo.train(config)
  shutil.rmtree(os.path.join(tmp_path, "checkpoints", "3"))
  with open(os.path.join(tmp_path, "extra.jsonl"), "w") as f:
    f.writelines(json.dumps({"step": s}) + "\n" for s in (1, 2, 3))
  history = grpo.train(experiment_config(grpo_smollm2_arith, "smoke", tmp_path, **{"train.steps": 3, "resume": True}))
  assert [r["step"] for r in history] == [3]
  want = {"samples.jsonl": [1, 2, 3], "metrics.jsonl": [1, 2, 3], "extra.jsonl": [1, 2], "eval.jsonl": [0, 2, 3]}
  for name, steps in want.items():
    with open(os.path.join(tmp_path, name)) as f:
      assert [json.loads(line)["step"] for line in f] == steps, name


def test_checkpoint_save_returns_before_the_write_and_restores_exactly(tmp_path):
  # save() copies to host and returns; the caller may overwrite (donate) its arrays at once; the
  # restored state equals what was passed, bit for bit.
  from branch_replay_jax.outputs.checkpoints import RunCheckpoints
  import jax.numpy as jnp
  ckpt = RunCheckpoints(str(tmp_path))
  state = {"w": jnp.arange(1 << 20, dtype=jnp.float32), "rng": jax.random.key_data(jax.random.key(3))}
  want = jax.tree_util.tree_map(np.asarray, state)
  blocked = ckpt.save(1, state, {"step": 1, "data_pos": 2})
  assert blocked >= 0.0
  state["w"].delete()   # as a donating update would
  got, meta = ckpt.restore(1, {"w": jnp.zeros(1 << 20, jnp.float32), "rng": jnp.zeros_like(want["rng"])})
  ckpt.close()
  assert meta == {"step": 1, "data_pos": 2}
  np.testing.assert_array_equal(np.asarray(got["w"]), want["w"])
  np.testing.assert_array_equal(np.asarray(got["rng"]), want["rng"])
