"""outputs/compare.py: the side-by-side summary of two runs, on hand-written logs."""

import json
import os

import pytest

from branch_replay_jax.outputs import compare


def write_run(path, step_times, update_times, evals):
  os.makedirs(path)
  wall = 0.0
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    for i, (s, u) in enumerate(zip(step_times, update_times)):
      wall += s
      f.write(json.dumps({"step": i + 1, "step_s": s, "update_s": u, "sample_s": 0.5, "score_s": 0.01,
                          "wall_s": wall}) + "\n")
  with open(os.path.join(path, "eval.jsonl"), "w") as f:
    for step, wall_s, acc in evals:
      f.write(json.dumps({"step": step, "wall_s": wall_s, "accuracy": acc, "accuracy_lo": acc - 0.05,
                          "accuracy_hi": acc + 0.05, "problems": 200}) + "\n")
  return str(path)


def test_summary_medians_reach_and_ratio(tmp_path):
  # replay: steps of 10 s (update 4 s) after a 100 s first step (compile, left out of the medians);
  # naive: 30 s steps (update 24 s). Replay ends at accuracy 0.30, naive at 0.31: the target is the
  # lower, 0.30 (an accuracy both reached). Replay reaches it at its
  # step-20 evaluation (290 s of training), naive at its step-20 evaluation (600 s): ratio 600 / 290 = 2.07.
  replay = write_run(tmp_path / "r", [100.0] + [10.0] * 19, [90.0] + [4.0] * 19,
                     [(0, 0.0, 0.10), (10, 190.0, 0.2), (20, 290.0, 0.30)])
  naive = write_run(tmp_path / "n", [30.0] * 20, [24.0] * 20, [(0, 0.0, 0.10), (10, 300.0, 0.25), (20, 600.0, 0.31)])
  results = compare.compare(compare.parse_runs(f"replay={replay},naive={naive}"), str(tmp_path / "fig.png"))
  r, n = results["replay"], results["naive"]
  assert r["target"] == n["target"] == 0.30
  assert (r["step_s"], r["update_s"], r["rollout_s"]) == (10.0, 4.0, 6.0)
  assert (n["step_s"], n["update_s"], n["rollout_s"]) == (30.0, 24.0, 6.0)
  assert (r["reach_step"], r["reach_wall_s"]) == (20, 290.0) and (n["reach_step"], n["reach_wall_s"]) == (20, 600.0)
  assert r["eval_first"]["accuracy"] == 0.10 and n["eval_last"]["accuracy"] == 0.31
  assert os.path.getsize(tmp_path / "fig.png") > 1000
  text = compare.table(results)
  assert "| naive | 20 | 6.00 | 0.010 | 24.00 | 30.00 | 0.100 -> 0.310 [0.260, 0.360] | 600 s (step 20) | 2.07x |" in text
  # A target no evaluation reaches: None, shown as a dash.
  missed = compare.compare({"naive": naive}, target=0.9)["naive"]
  assert missed["reach_step"] is None and missed["reach_wall_s"] is None


@pytest.mark.parametrize("spec, match", [
    ("replay", "not LABEL=RUN_DIR"), ("=x", "not LABEL=RUN_DIR"), ("", "no runs"),
    ("a=/nonexistent", "has no metrics.jsonl"),
])
def test_bad_runs_are_refused(spec, match):
  with pytest.raises(ValueError, match=match):
    compare.parse_runs(spec)


def test_a_label_given_twice_is_refused(tmp_path):
  d = write_run(tmp_path / "r", [1.0], [0.5], [])
  with pytest.raises(ValueError, match="label 'a' given twice"):
    compare.parse_runs(f"a={d},a={d}")
