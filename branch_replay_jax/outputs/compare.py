"""Runs side by side: held-out accuracy against step and against training wall-clock, and a phase table.

  python -m branch_replay_jax.outputs.compare --runs=replay=runs/learn_replay,naive=runs/learn_naive \
      --out=docs/learning.png

Reads each run's metrics.jsonl and eval.jsonl (algorithms/loop.py) and writes one figure: greedy
held-out accuracy with its 95% Wilson band per run, against step (left: replay and naive compute the
same gradients, so their curves overlay) and against training wall-clock seconds (right: evaluations
excluded, loop.Stopwatch). Prints one JSON object per run (`summary`) and a Markdown table.

Per-step phases are medians over steps 2.. (step 1 compiles): `rollout_s` (the step's sampling of every
prompt drawn, dropped groups included, and scoring: step_s - update_s), `sample_s` and `score_s` (of the
groups kept), `update_s` (reference and old log-probs when used, the gradient, the optimizer, and the
run-time exactness check on its steps), `step_s`. "Time to reach" is the training wall-clock of the
first evaluation whose accuracy is at least `target` (by default the lowest final accuracy of the runs,
an accuracy every run reached: a naive run stopped earlier for lack of time is compared where it
ended); None when the run never reached it.
"""

from __future__ import annotations

import json
import os
import statistics

from absl import app, flags

from branch_replay_jax.outputs.plots import read_jsonl

PHASES = ("rollout_s", "sample_s", "score_s", "update_s", "step_s")


def parse_runs(spec: str) -> dict[str, str]:
  """"label=dir,label=dir" -> {label: dir}, in order.

  Raises:
    ValueError: an item without "=", an empty label or directory, a repeated label, a directory
      without metrics.jsonl.
  """
  runs = {}
  for item in filter(None, (s.strip() for s in spec.split(","))):
    label, sep, path = item.partition("=")
    if not sep or not label or not path:
      raise ValueError(f"--runs: {item!r} is not LABEL=RUN_DIR")
    if label in runs:
      raise ValueError(f"--runs: label {label!r} given twice")
    if not os.path.exists(os.path.join(path, "metrics.jsonl")):
      raise ValueError(f"--runs: {path!r} has no metrics.jsonl")
    runs[label] = path
  if not runs:
    raise ValueError("--runs: no runs given")
  return runs


def summary(metrics: list[dict], evals: list[dict], target: float | None) -> dict:
  """One run's figures: steps, median per-step phases (seconds, steps after the first), the first and
  last evaluation (step, wall_s, accuracy and its interval), and `reach_wall_s` / `reach_step`, the
  first evaluation with accuracy >= target (None if none, or target None)."""
  timed = metrics[1:] or metrics
  out = {"steps": len(metrics), "wall_s": metrics[-1]["wall_s"] if metrics else 0.0}
  for phase in PHASES:
    values = [r["step_s"] - r["update_s"] if phase == "rollout_s" else r[phase] for r in timed]
    out[phase] = statistics.median(values) if values else None
  keys = ("step", "wall_s", "accuracy", "accuracy_lo", "accuracy_hi", "problems")
  out["eval_first"] = {k: evals[0][k] for k in keys} if evals else None
  out["eval_last"] = {k: evals[-1][k] for k in keys} if evals else None
  reached = next((r for r in evals if target is not None and r["accuracy"] >= target), None)
  out["target"] = target
  out["reach_step"] = reached["step"] if reached else None
  out["reach_wall_s"] = reached["wall_s"] if reached else None
  return out


def compare(runs: dict[str, str], out: str | None = None, target: float | None = None) -> dict[str, dict]:
  """{label: summary} of each run (target: the lowest final accuracy of the runs unless given); with
  `out`, writes the figure there."""
  logs = {label: (read_jsonl(os.path.join(d, "metrics.jsonl")), read_jsonl(os.path.join(d, "eval.jsonl")))
          for label, d in runs.items()}
  first_evals = next(iter(logs.values()))[1]
  finals = [evals[-1]["accuracy"] for _, evals in logs.values() if evals]
  if target is None and finals:
    target = min(finals)
  if out:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for ax, x, xlabel in ((axes[0], "step", "step"), (axes[1], "wall_s", "training wall-clock (s)")):
      for label, (_, evals) in logs.items():
        xs = [r[x] for r in evals]
        line, = ax.plot(xs, [r["accuracy"] for r in evals], marker="o", label=label)
        ax.fill_between(xs, [r["accuracy_lo"] for r in evals], [r["accuracy_hi"] for r in evals],
                        color=line.get_color(), alpha=0.2)
      ax.set_xlabel(xlabel)
    axes[0].set_ylabel("held-out greedy accuracy (95% band)")
    axes[0].legend(fontsize=8)
    problems = first_evals[-1]["problems"] if first_evals else 0
    fig.suptitle(f"Held-out accuracy ({problems} problems)")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
  return {label: summary(metrics, evals, target) for label, (metrics, evals) in logs.items()}


def table(results: dict[str, dict]) -> str:
  """A Markdown table of `compare`'s results, with each run's ratio to the first run."""
  def fmt(v, spec=".2f"):
    return "—" if v is None else format(v, spec)
  base = next(iter(results.values()))
  lines = ["| run | steps | rollout s/step | score s/step | update s/step | step s | accuracy first -> last | "
           "wall-clock to reach the target | vs first run |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for label, s in results.items():
    first, last = s["eval_first"] or {}, s["eval_last"] or {}
    ratio = (s["reach_wall_s"] / base["reach_wall_s"] if s["reach_wall_s"] and base["reach_wall_s"] else None)
    lines.append(f"| {label} | {s['steps']} | {fmt(s['rollout_s'])} | {fmt(s['score_s'], '.3f')} | "
                 f"{fmt(s['update_s'])} | {fmt(s['step_s'])} | "
                 f"{fmt(first.get('accuracy'), '.3f')} -> {fmt(last.get('accuracy'), '.3f')} "
                 f"[{fmt(last.get('accuracy_lo'), '.3f')}, {fmt(last.get('accuracy_hi'), '.3f')}] | "
                 f"{fmt(s['reach_wall_s'], '.0f')} s (step {s['reach_step']}) | {fmt(ratio)}x |")
  return "\n".join(lines)


FLAGS = flags.FLAGS
flags.DEFINE_string("runs", None, "LABEL=RUN_DIR,LABEL=RUN_DIR,...", required=True)
flags.DEFINE_string("out", None, "path of the figure (PNG); none: no figure")
flags.DEFINE_float("target", None, "accuracy to reach; default: the lowest final accuracy of the runs")


def main(argv):
  del argv
  results = compare(parse_runs(FLAGS.runs), FLAGS.out, FLAGS.target)
  for label, s in results.items():
    print(json.dumps({"run": label, **s}))
  print(table(results))


if __name__ == "__main__":
  app.run(main)
