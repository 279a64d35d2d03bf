"""Held-out evaluation (rollout/evaluate.py, algorithms/evaluation.py's Evaluation), TensorBoard logs and the plots' new
curves: the statistics on hand-computed cases, held-out problems disjoint from training, the smoke
run's eval.jsonl and event files, a resume that cuts both back, and bad eval settings refused."""

import json
import os
import shutil

import pytest

from branch_replay_jax.algorithms import grpo as train
from branch_replay_jax.algorithms import loop, runs
from branch_replay_jax.algorithms.evaluation import EVAL_STREAM, Evaluation
from branch_replay_jax.outputs import plots
from branch_replay_jax.rollout import evaluate as held_out
from branch_replay_jax.rollout.tasks import Task, make_task
from branch_replay_jax.rollout.tasks.prompts import Problem
from conftest import grpo_smoke, length_score

# The fields every eval.jsonl row has (rollout.evaluate.summarize with pass_k, and algorithms.evaluation.Evaluation).
EVAL_FIELDS = {"step", "wall_s", "eval_s", "problems", "dropped_overlaps", "accuracy", "accuracy_lo", "accuracy_hi",
               "reward_mean", "format_rate", "completion_len_mean", "truncated_frac", "pass_k", "pass_at_k",
               "sampled_accuracy"}


def lines(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


def scalars(run_dir) -> dict:
  """{tag: [(step, value)]} as TensorBoard shows the run directory (its own event reader, with
  its purge of orphaned steps)."""
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
  acc.Reload()
  return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_wilson_interval_hand_computed():
  # 8 of 10, z = 1.959964 (z^2 = 3.841459): p = 0.8, z^2/n = 0.3841459; centre = (0.8 + 0.1920729) /
  # 1.3841459 = 0.7167402, half = 1.959964 / 1.3841459 * sqrt(0.016 + 0.0096036) = 0.2265777
  # -> (0.4901625, 0.9433178) (tables give 0.4902, 0.9433 for 8/10).
  lo, hi = held_out.wilson_interval(8, 10)
  assert lo == pytest.approx(0.4901625, abs=1e-7) and hi == pytest.approx(0.9433178, abs=1e-7)
  # 0 of n: the lower bound is 0 and the upper z^2 / (n + z^2) = 3.841459 / 13.841459 = 0.2775328.
  lo, hi = held_out.wilson_interval(0, 10)
  assert lo == 0.0 and hi == pytest.approx(0.2775328, abs=1e-7)
  # n of n mirrors it.
  lo, hi = held_out.wilson_interval(10, 10)
  assert lo == pytest.approx(1 - 0.2775328, abs=1e-7) and hi == 1.0
  for bad in [(0, 0), (3, 2), (-1, 5)]:
    with pytest.raises(ValueError, match="wilson_interval"):
      held_out.wilson_interval(*bad)


def test_pass_at_k_hand_computed():
  # Chen et al. eq. 1: 1 - C(n - c, k) / C(n, k).
  assert held_out.pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10, abs=1e-12)      # C(3,2)=3, C(5,2)=10
  assert held_out.pass_at_k(10, 3, 4) == pytest.approx(1 - 35 / 210, abs=1e-12)   # C(7,4)=35, C(10,4)=210
  assert held_out.pass_at_k(10, 3, 1) == pytest.approx(0.3, abs=1e-12)            # pass@1 = c / n
  # n = k (what the evaluation draws): 1 if any sample is correct, else 0.
  assert held_out.pass_at_k(4, 0, 4) == 0.0 and held_out.pass_at_k(4, 1, 4) == 1.0
  for n, c, k in [(5, 2, 6), (5, 6, 2), (5, 1, 0)]:
    with pytest.raises(ValueError, match="pass_at_k"):
      held_out.pass_at_k(n, c, k)


def test_summarize_hand_computed():
  results = [{"correct": True, "reward": 1.1, "formatted": True, "length": 10, "truncated": False, "sampled_correct": 2},
             {"correct": False, "reward": 0.0, "formatted": False, "length": 32, "truncated": True, "sampled_correct": 0},
             {"correct": True, "reward": 1.0, "formatted": False, "length": 6, "truncated": False, "sampled_correct": 4}]
  row = held_out.summarize(results, pass_k=4)
  assert row["problems"] == 3 and row["accuracy"] == pytest.approx(2 / 3)
  assert (row["accuracy_lo"], row["accuracy_hi"]) == held_out.wilson_interval(2, 3)
  assert row["reward_mean"] == pytest.approx(2.1 / 3) and row["format_rate"] == pytest.approx(1 / 3)
  assert row["completion_len_mean"] == pytest.approx(16.0)
  assert row["truncated_frac"] == pytest.approx(1 / 3)      # the 32-token answer ran to the budget
  assert row["pass_at_k"] == pytest.approx(2 / 3)           # problems 1 and 3 have a correct sample
  assert row["sampled_accuracy"] == pytest.approx(6 / 12)   # 2 + 0 + 4 correct of 3 x 4 samples
  assert "pass_at_k" not in held_out.summarize(results, pass_k=0)


def test_moving_average_hand_computed():
  assert plots.moving_average([1, 2, 3, 4], 2).tolist() == [1.0, 1.5, 2.5, 3.5]
  assert plots.moving_average([3, 0, 0, 6], 3).tolist() == [3.0, 1.5, 1.0, 2.0]
  with pytest.raises(ValueError, match="window"):
    plots.moving_average([1.0], 0)


def test_stopwatch_leaves_paused_spans_out(monkeypatch):
  # A clock at 100 s: 3 s of steps, a 7 s evaluation (paused), 1 s more -> 5 (resumed) + 3 + 1 = 9.
  now = [100.0]
  monkeypatch.setattr(loop.time, "perf_counter", lambda: now[0])
  clock = loop.Stopwatch(5.0)
  now[0] = 103.0
  assert clock.seconds() == 8.0
  with clock.paused():
    now[0] = 110.0
  assert clock.seconds() == 8.0
  now[0] = 111.0
  assert clock.seconds() == 9.0


def test_heldout_problems_never_repeat_a_training_question():
  # reasoning-gym builds item i from Random(seed + i): eval seed 1's items 0..8 ARE training seed
  # 0's items 1..9, so at least those 9 must be dropped; no kept question may be a training one.
  train_task = make_task("basic_arithmetic", seed=0, size=1000)
  eval_task = make_task("basic_arithmetic", seed=1, size=1000)
  kept, dropped = held_out.heldout_problems(train_task, eval_task, size=50, training_items=10)
  training = {train_task[i].question for i in range(10)}
  assert len(kept) == 50 and dropped >= 9 and not any(j < 9 for j in kept)
  assert not {eval_task[j].question for j in kept} & training
  # A question space of 242 one-digit problems that 3000 training items cover: nothing is left.
  tiny = dict(min_digits=1, max_digits=1)
  with pytest.raises(ValueError, match="eval.size=20: only"):
    held_out.heldout_problems(make_task("basic_arithmetic", seed=0, size=3000, **tiny),
                              make_task("basic_arithmetic", seed=5000, size=300, **tiny), size=20,
                              training_items=3000)


def test_heldout_problems_drop_spacing_and_case_variants_of_training_questions():
  # OpenRLHF #1089: exact matching kept "what is  2+2 ?" beside the training "What is 2+2 ?". Both
  # variants (double space, capitals, a trailing newline) are dropped and counted; a question that
  # differs in a character is kept.
  class Questions(list):
    examples = ()
  ask = lambda qs: Questions(Problem(q, "", {}) for q in qs)
  train = ask(["What is 2+2 ?", "Name  the capital."])
  evaluation = ask(["what is  2+2 ?", "NAME THE CAPITAL.\n", "What is 2+3 ?"])
  assert held_out.heldout_problems(train, evaluation, size=1, training_items=2) == ([2], 2)


def test_heldout_problems_drop_the_few_shot_examples():
  # An evaluation problem equal to a few-shot example would be answered in its own prompt. With the
  # examples drawn from the evaluation's own seed, eval items 0 and 1 ARE the two examples: dropped.
  train_task = make_task("basic_arithmetic", seed=0, size=10)
  eval_task = make_task("basic_arithmetic", seed=5000, size=100, few_shot=2, few_shot_seed=5000)
  examples = {e.question for e in eval_task.examples}
  assert {eval_task[0].question, eval_task[1].question} == examples
  kept, dropped = held_out.heldout_problems(train_task, eval_task, size=20, training_items=10)
  assert 0 not in kept and 1 not in kept and dropped >= 2
  assert not {eval_task[j].question for j in kept} & examples


def test_few_shot_prompts_in_training_and_evaluation(tmp_path):
  # task.few_shot = 2: training and evaluation tasks show the same 2 examples, and a sampled group's
  # prompt is exactly the chat template of the examples' 4 turns + the question (not the question alone).
  import jax
  from branch_replay_jax.models.loading import encode_chat, load_tokenizer
  from branch_replay_jax.algorithms.groups import rollout_group
  config = grpo_smoke(tmp_path, **{"task.few_shot": 2})
  train_task = runs.make_task_from(config)
  eval_task = runs.make_task_from(config, seed=config.eval.task_seed, size=50)
  assert len(train_task.examples) == 2 and train_task.examples == eval_task.examples
  tokenizer = load_tokenizer("smollm2-135m-instruct")
  model, _ = runs.build_model(config)
  group = rollout_group(config, model, tokenizer, train_task, 3, jax.random.key(0))
  want = encode_chat(tokenizer, train_task.messages(train_task[3]))
  assert int(group.batch.prompt_len) == len(want) > len(encode_chat(tokenizer, train_task.messages(train_task[3])[-1:])) + 20
  assert list(map(int, group.batch.prompt_ids[:len(want)])) == list(want)


@pytest.mark.parametrize("field,value,match", [
    ("task.few_shot", -1, "task.few_shot=-1 must be an int >= 0"),
    ("task.few_shot_seed", -5, "task.few_shot_seed=-5 must be an int >= 0"),
    ("eval.size", -1, "eval.size=-1 must be an int >= 0"),
    ("eval.every", 0, "eval.every=0 must be an int >= 1"),
    ("eval.pass_k", -2, "eval.pass_k=-2 must be an int >= 0"),
    ("eval.task_seed", -1, "eval.task_seed=-1 must be an int >= 0"),
    ("eval.task_seed", 0, "eval.task_seed=0 equals task.seed"),
])
def test_bad_eval_config_is_refused_before_any_compute(tmp_path, field, value, match):
  with pytest.raises(ValueError, match=match):
    train.train(grpo_smoke(tmp_path, **{field: value}))
  assert not os.path.exists(os.path.join(tmp_path, "checkpoints"))


@pytest.fixture(scope="module")
def eval_run(tmp_path_factory):
  """The smoke run (tiny model, 2 steps, 2 held-out problems x pass@4, eval every step) with the
  length-based scorer of conftest, so that rewards and correctness vary."""
  run_dir = tmp_path_factory.mktemp("eval_run")
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(Task, "score", length_score)
    history = train.train(grpo_smoke(run_dir, **{"eval.every": 1}))
  return run_dir, history


def test_eval_rows_at_step_0_every_step_and_the_end(eval_run):
  run_dir, _ = eval_run
  rows = lines(os.path.join(run_dir, "eval.jsonl"))
  assert [r["step"] for r in rows] == [0, 1, 2]
  for r in rows:
    assert set(r) == EVAL_FIELDS
    assert r["problems"] == 2 and r["pass_k"] == 4
    assert r["accuracy_lo"] <= r["accuracy"] <= r["accuracy_hi"]
    assert r["pass_at_k"] >= r["sampled_accuracy"] - 1e-12   # any-of-4 correct >= mean correctness
  # Each row carries the training seconds of its step: step 0's come before step 1's record, step
  # 1's between the records of steps 1 and 2 (the evaluation is left out of wall_s).
  metrics = lines(os.path.join(run_dir, "metrics.jsonl"))
  assert rows[0]["wall_s"] <= metrics[0]["wall_s"] <= rows[1]["wall_s"] <= metrics[1]["wall_s"] <= rows[2]["wall_s"]
  for name in ("eval.png", "reward.png"):
    assert os.path.getsize(os.path.join(run_dir, name)) > 0, name


def test_step_0_row_is_the_initial_models_evaluation(eval_run):
  # The loop evaluates the initial parameters with the problems and keys it names: recomputing the
  # same evaluation outside the loop gives the same row (greedy decoding and fixed keys).
  run_dir, _ = eval_run
  config = grpo_smoke(run_dir)
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(Task, "score", length_score)
    evaluation = Evaluation(config, train.GRPO(config))
    model, tokenizer = runs.build_model(config)
    import jax
    results = held_out.evaluate(model, tokenizer, evaluation.task, evaluation.problems,
                                jax.random.fold_in(jax.random.key(config.seed), EVAL_STREAM), max_new_tokens=8,
                                temperature=1.0, top_p=1.0, pass_k=4)
  want = held_out.summarize([results[j] for j in range(2)], pass_k=4)
  got = lines(os.path.join(run_dir, "eval.jsonl"))[0]
  assert {k: got[k] for k in want} == want


def test_tensorboard_has_one_scalar_per_metric(eval_run):
  run_dir, _ = eval_run
  tags = scalars(run_dir)
  metrics = lines(os.path.join(run_dir, "metrics.jsonl"))
  rows = lines(os.path.join(run_dir, "eval.jsonl"))
  want = {f"train/{k}" for k, v in metrics[0].items() if k != "step" and isinstance(v, (int, float))}
  want |= {f"eval/{k}" for k in EVAL_FIELDS - {"step"}}
  assert set(tags) == want
  # Each metric once per step, with the logged value (TensorBoard stores float32).
  assert [s for s, _ in tags["train/reward_mean"]] == [1, 2]
  for record in metrics:
    for k in ("reward_mean", "loss", "wall_s", "token_positions_computed"):
      assert dict(tags[f"train/{k}"])[record["step"]] == pytest.approx(record[k], rel=1e-6, abs=1e-30), k
  assert [s for s, _ in tags["eval/accuracy_hi"]] == [0, 1, 2]
  assert [v for _, v in tags["eval/accuracy_hi"]] == pytest.approx([r["accuracy_hi"] for r in rows], rel=1e-6)


def test_resume_cuts_eval_log_and_tensorboard_back(eval_run, tmp_path):
  # A copy of the 2-step run whose step-2 checkpoint is lost (a crash after step 2's logs, before
  # its save landed): resuming from step 1 re-runs step 2. eval.jsonl and metrics.jsonl must hold
  # each step once, and TensorBoard must show each step once (purge_step: without it the old and
  # the new step 2 would both appear, a zigzag).
  run_dir, _ = eval_run
  copy = tmp_path / "run"
  shutil.copytree(run_dir, copy)
  shutil.rmtree(copy / "checkpoints" / "2")
  first = lines(copy / "eval.jsonl")
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(Task, "score", length_score)
    history = train.train(grpo_smoke(copy, resume=True, **{"eval.every": 1}))
  assert [r["step"] for r in history] == [2]
  rows = lines(copy / "eval.jsonl")
  assert [r["step"] for r in rows] == [0, 1, 2]
  # Same seed, same keys: the re-run step 2 evaluates to the same figures.
  assert rows[2]["accuracy"] == first[2]["accuracy"] and rows[2]["pass_at_k"] == first[2]["pass_at_k"]
  metrics = lines(copy / "metrics.jsonl")
  assert [r["step"] for r in metrics] == [1, 2]
  # wall_s continues from step 1's: the resumed step adds its own seconds to it.
  assert metrics[1]["wall_s"] > metrics[0]["wall_s"]
  tags = scalars(copy)
  assert [s for s, _ in tags["train/reward_mean"]] == [1, 2]
  assert [s for s, _ in tags["eval/accuracy"]] == [0, 1, 2]
  assert dict(tags["train/wall_s"])[2] == pytest.approx(metrics[1]["wall_s"], rel=1e-6)
  assert len([f for f in os.listdir(copy) if f.startswith("events.out.tfevents.")]) == 2


def test_fresh_run_in_a_used_directory_starts_new_event_files(eval_run, tmp_path):
  # resume=False over an old run: cut_logs_back(step 0) empties the logs and removes the old event
  # files, so TensorBoard does not show two runs on top of each other.
  run_dir, _ = eval_run
  copy = tmp_path / "run"
  shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("checkpoints"))
  assert plots.cut_logs_back(str(copy), 0)
  assert not [f for f in os.listdir(copy) if f.startswith("events.out.tfevents.")]
  assert lines(copy / "eval.jsonl") == [] and lines(copy / "metrics.jsonl") == []


def test_disabled_eval_writes_no_eval_log_and_trains_the_same(eval_run, tmp_path):
  # eval.size = 0 turns the evaluation off: no eval.jsonl, no eval.png, no eval/ scalars. And the
  # evaluation never draws a training key or data position: the same run without it samples the
  # same completions (equal rewards) and ends at the same parameters, to the resume test's 1e-6
  # (other samples would move whole leaves by ~lr = 1e-5, ~1e-4 of the largest parameter).
  from conftest import final_params, max_rel
  run_dir, history = eval_run
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(Task, "score", length_score)
    got = train.train(grpo_smoke(tmp_path, **{"eval.size": 0}))
  assert not os.path.exists(tmp_path / "eval.jsonl") and not os.path.exists(tmp_path / "eval.png")
  assert not any(t.startswith("eval/") for t in scalars(tmp_path))
  assert [r["reward_mean"] for r in got] == [r["reward_mean"] for r in history]
  assert max_rel(final_params(tmp_path)[0], final_params(run_dir)[0]) <= 1e-6


def test_spread_devices_takes_each_process_in_turn():
  # 2 processes x 4 devices (ids 0-3 on process 0, 4-7 on process 1): items go 0, 4, 1, 5, ... so
  # even 2 problems reach both processes; the 9th wraps around to device 0.
  from types import SimpleNamespace

  import numpy as np

  from branch_replay_jax.distributed import hosts
  devices = np.array([SimpleNamespace(id=i, process_index=i // 4) for i in range(8)], dtype=object).reshape(2, 4, 1)
  got = hosts.spread_devices(SimpleNamespace(devices=devices), 9)
  assert [d.id for d in got] == [0, 4, 1, 5, 2, 6, 3, 7, 0]
