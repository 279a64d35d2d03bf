"""Episodes on the device mesh (rollout.episodes with config.mesh; docs/design.md, "Episodes"): the
same scripted episodes train on a 2x2x2 FSDP mesh as on one device. Its own file so that the test
workers (pytest-xdist, --dist loadfile) can run it beside tests/test_episode_loop.py."""

import jax
import pytest
from conftest import ScriptedSampler, experiment_config

from branch_replay_jax.algorithms import grpo
from branch_replay_jax.rollout import collect
from branch_replay_jax.rollout.environments import STATUSES
from experiments import grpo_smollm2_calc


def calc_smoke(run_dir, **overrides):
  return experiment_config(grpo_smollm2_calc, "smoke", run_dir, **overrides)


class SharedFirstTurn(ScriptedSampler):
  """Every branch calls the calculator on "2 + 3" first (so the G episodes of a problem share their
  first turn and its observation: the tree's first fan-out is 1), then branch 0 answers 5, branch 1
  answers 7, branch 2 calls again (cut by max_turns) and branch 3 writes no format: unequal rewards,
  so the step has a gradient."""

  def text(self):
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>'
    return call if self.turn == 0 else ["<answer>5</answer>", "<answer>7</answer>", call, "no"][self.g % 4]


def _scripted_calc_run(run_dir, monkeypatch, **overrides):
  from branch_replay_jax.models.loading import load_tokenizer
  SharedFirstTurn.tokenizer = load_tokenizer("smollm2-135m-instruct")
  monkeypatch.setattr(collect, "EpisodeSampler", SharedFirstTurn)
  config = calc_smoke(run_dir, **{"rollout.episodes.few_shot": 0, "rollout.episodes.max_turns": 2,
                                  "rollout.episodes.max_turn_tokens": 40, "rollout.episodes.max_context": 1024,
                                  "eval.size": 0, **overrides})
  return grpo.train(config)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
def test_episodes_on_a_mesh_train_as_on_one_device(tmp_path, monkeypatch):
  # The same scripted episodes (2 problems x 4 episodes a step, 2 steps) on one device (the experiment's
  # packed rows) and on a 2x2x2 FSDP mesh (nested replay, depth-first): problems over data,
  # first-level subtrees over branch, the prompt over seq. Every episode tree has first fan-out 1
  # (all 4 share the first call), padded to 2 for the branch axis (data.batches.pad_trees(branch=))
  # with exact zeros. The sharded step sums the same
  # terms in another order: parameters equal to Adam's rounding bound (1e-5, as the tree mesh test),
  # the logged metrics to float32 rounding, the episode counts exactly. (The run-time exactness
  # check stays off, as the smoke variant has it: on a mesh it runs the one-device check on a
  # parameter copy, the code test_the_run_time_exactness_check_compares_an_episode_tree_with_its_rows
  # covers; turned on here it would add ~40 s.)
  from conftest import final_params, max_rel
  one = _scripted_calc_run(tmp_path / "one", monkeypatch)
  mesh = _scripted_calc_run(tmp_path / "mesh", monkeypatch, **{"mesh.data": 2, "mesh.branch": 2, "mesh.seq": 2,
                                                                "mesh.params": "fsdp", "train.tree_schedule": "depth_first"})
  assert max_rel(final_params(tmp_path / "mesh")[0], final_params(tmp_path / "one")[0]) <= 1e-5
  for got, want in zip(mesh, one):
    for name in ("reward_mean", "token_positions_naive", "token_positions_computed", "tool_calls_per_episode",
                 *(f"episodes_{s}" for s in STATUSES)):
      assert got[name] == want[name], name
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-7)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
  # Not vacuous: per problem branches 0, 1 and 3 end "done" (3 x 2 problems), branch 2 at max_turns;
  # 0.1 format bonus for the two tagged answers (neither is the problem's answer): reward_mean 0.05.
  assert (one[0]["episodes_done"], one[0]["episodes_max_turns"]) == (6, 2)
  assert one[0]["reward_mean"] == pytest.approx(0.05) and min(r["grad_norm"] for r in one) > 0.01
