"""The run-time exactness check (algorithms/exactness.py): its figures in the metrics, on groups,
trees and a mesh, and its loud warning when replay and naive disagree."""

import json
import os

import jax
import pytest

from branch_replay_jax.algorithms import exactness
from branch_replay_jax.algorithms import grpo as train
from branch_replay_jax.gradients import step
from branch_replay_jax.rollout.tasks import Task
from conftest import experiment_config, length_score, offset_sampler_logprobs
from experiments import grpo_smollm2_arith, grpo_tree_smollm2_arith

FIELDS = ("exactness_grad_rel_err", "exactness_loss_rel_err", "exactness_kl_rel_err")


@pytest.fixture(autouse=True, scope="module")
def varied_rewards():
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(Task, "score", length_score)   # non-zero advantages: the gradient is not only the KL term's
    yield


def records(run_dir):
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.mark.parametrize("module,overrides", [
    # heavy (~40 s): test_grpo_options.py::test_options_run_replay_equals_naive runs the check on groups
    # at every step in CI; the tree case below stays.
    pytest.param(grpo_smollm2_arith, {}, marks=pytest.mark.heavy),
    # reference and old log-probs from each layout; heavy (~1 min): test_grpo_options checks with inner epochs
    pytest.param(grpo_smollm2_arith, {"train.inner_epochs": 2}, marks=pytest.mark.heavy),
    # heavy (~45 s): the check on a tree-kind group runs in CI through
    # tests/test_episode_loop.py::test_the_run_time_exactness_check_compares_an_episode_tree_with_its_rows.
    pytest.param(grpo_tree_smollm2_arith, {}, marks=pytest.mark.heavy),
    # heavy (~1.5 min): the mesh step equals one device in CI (test_train, test_mesh), the check runs the same code
    pytest.param(grpo_smollm2_arith, {"mesh.data": 2, "mesh.branch": 2, "mesh.seq": 2, "mesh.params": "fsdp"},
                 marks=pytest.mark.heavy),
    # The GRPO options trees take (tests/test_grpo_options.py): the step-level token mean rescales the tree's
    # weights and its naive layout (Group.naive_batch) alike, the log-probs are at the sampling temperature on
    # both sides, old log-probs (inner epochs 2) let clip-higher act, the rewards carry the overlong penalty.
    # heavy (~1.5 min on 2 loaded cores): CI pins the naive layout's rescaling in
    # test_grpo_options.py::test_step_token_mean_rescales_tree_batches and the check with every group option
    # in test_grpo_options.py::test_options_run_replay_equals_naive.
    pytest.param(grpo_tree_smollm2_arith, {"train.inner_epochs": 2, "loss.clip_eps_high": 0.28,
                                           "loss.logprob_temperature": "sampling", "rollout.temperature": 0.7,
                                           "loss.weighting": "step_token_mean",
                                           "loss.overlong_buffer": 4}, marks=pytest.mark.heavy),
], ids=["group", "group-inner-epochs", "tree", "mesh-fsdp", "tree-options"])
def test_check_logs_replay_against_naive_every_k_steps(tmp_path, module, overrides):
  # every = 2 over 2 steps: step 2 carries the figures, step 1 none. float32 run: the relative
  # errors are rounding (<= 1e-4, the float32 exactness bound) yet not all exactly 0 on the
  # gradient (replay and naive sum in different orders) - a check that compared a gradient with
  # itself would log 0.0.
  if "mesh.data" in overrides and jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  train.train(experiment_config(module, "smoke", tmp_path, **{"train.exactness_check_every": 2, **overrides}))
  first, second = records(tmp_path)
  assert not any(name in first for name in FIELDS)
  assert all(0 <= second[name] <= 1e-4 for name in FIELDS), second
  assert second["exactness_grad_rel_err"] > 0
  assert second["exactness_ok"] is True


# "naive" is heavy (11 s): CI runs the failure path in a replay run here, and a naive run's check against
# replay in test_a_naive_run_with_a_sampler_correction_checks_against_replay (the same comparison, passing).
@pytest.mark.parametrize("gradient,expected", [("replay", 0.5), pytest.param("naive", 1.0, marks=pytest.mark.heavy)])
def test_a_step_that_drops_half_its_gradient_fails_loudly(tmp_path, monkeypatch, gradient, expected):
  # Break the step's own gradient on purpose: it counts only half the group's loss (as a lost
  # branch or a dropped prefix cotangent would). Only the train step's per-group gradient is patched
  # (gradients.step's, which make_train_step's scan calls), not the check's (exactness.py binds its
  # own import): on one device the check compares the step's own gradient of the
  # checked group with the other layout's, so it must catch it. Replay run, the step's replay
  # gradient halved: ||g/2 - g|| / ||g|| = 0.5; naive run, the step's naive gradient halved:
  # ||g - g/2|| / ||g/2|| = 1.0; both >> 1e-4: ExactnessWarning and exactness_ok = False.
  real = step.value_and_grad   # the step builder as grpo's train step calls it, in either layout

  def half(*args, **kwargs):
    loss, aux, grads = real(*args, **kwargs)
    return loss * 0.5, aux, jax.tree_util.tree_map(lambda g: g * 0.5, grads)
  monkeypatch.setattr(step, "value_and_grad", half)
  with pytest.warns(exactness.ExactnessWarning, match="EXACTNESS CHECK FAILED"):
    train.train(experiment_config(grpo_smollm2_arith, "smoke", tmp_path, **{"train.exactness_check_every": 1,
                                                                             "train.steps": 1,
                                                                             "train.gradient": gradient}))
  (record,) = records(tmp_path)
  assert record["exactness_ok"] is False
  assert record["exactness_grad_rel_err"] == pytest.approx(expected, rel=1e-3)
  # (The loss itself is 0 here: on-policy, equal lengths and advantages that sum to 0, so half of it
  # is still 0; the gradient is what the check catches.)


def test_a_naive_run_with_a_sampler_correction_checks_against_replay(tmp_path, monkeypatch):
  # gradient = naive: the step's naive gradient of the checked group against the check's replay one,
  # within the float32 bound and not identically 0 (the two sum in different orders). With MIS at C = 1.5
  # (loss.rollout_correction, correction.py) against a sampler whose log-probs are off by
  # δ = 0.25 (token % 5 - 2) nats: each side corrects from its own old log-probs, the step logs the
  # correction's figures at every step: |δ| <= 0.5, so the mean |log π_old - log π_sampler| is at most 0.5
  # and ρ = exp(δ) at most exp(0.5) = 1.65 (beyond C: masked); δ = 0 for a fifth of the tokens, so not
  # every pair is masked.
  offset_sampler_logprobs(monkeypatch)
  train.train(experiment_config(grpo_smollm2_arith, "smoke", tmp_path, **{
      "train.exactness_check_every": 2, "train.gradient": "naive", "loss.rollout_correction": "mis",
      "loss.rollout_is_cap": 1.5}))
  first, second = records(tmp_path)
  assert not any(name in first for name in FIELDS)
  assert all(0 <= second[name] <= 1e-4 for name in FIELDS), second
  assert second["exactness_grad_rel_err"] > 0 and second["exactness_ok"] is True
  for r in (first, second):
    assert 0.05 <= r["sampler_logp_diff_mean"] <= 0.5 + 1e-4 and 0 < r["is_masked_frac"] < 1, r
    assert 1.0 < r["is_ratio_max"] <= 1.6488 + 1e-3, r


# -1: the range check (grpo.validate); True: the schema's type check, which runs first (a bool is not
# an int there); ml_collections itself refuses a float for this int field.
@pytest.mark.parametrize("value,message", [(-1, "must be an int >= 0"), (True, "must be an int, not bool")])
def test_bad_cadence_is_refused(tmp_path, value, message):
  with pytest.raises(ValueError, match=f"train.exactness_check_every={value!r} {message}"):
    train.train(experiment_config(grpo_smollm2_arith, "smoke", tmp_path, **{"train.exactness_check_every": value}))


def test_a_due_check_waits_for_a_group_with_unequal_rewards(tmp_path, monkeypatch):
  # All rewards 0 at step 1 (the gradient is then the KL term's alone, ~0: a relative error there
  # is rounding noise, 0.57 on a real smoke step): the check due at step 1 runs at step 2 instead,
  # the first step whose groups have unequal rewards.
  calls = {"n": 0}

  def zero_then_varied(self, completion_text, problem):
    calls["n"] += 1
    return length_score(self, completion_text, problem) if calls["n"] > 8 else length_score(self, "", problem)
  monkeypatch.setattr(Task, "score", zero_then_varied)
  train.train(experiment_config(grpo_smollm2_arith, "smoke", tmp_path, **{"train.exactness_check_every": 1,
                                                                           "eval.size": 0}))   # (eval scores too)
  first, second = records(tmp_path)
  assert first["zero_variance_groups"] == 2 and not any(name in first for name in FIELDS)
  assert second["zero_variance_groups"] < 2 and second["exactness_ok"] is True
