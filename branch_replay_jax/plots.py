"""Run logs (JSON lines) and the end-of-run plots: reward.png and throughput.png."""

from __future__ import annotations

import json
import os


def append_jsonl(path: str, record: dict) -> None:
  with open(path, "a") as f:
    f.write(json.dumps(record) + "\n")


def read_jsonl(path: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def truncate_jsonl(path: str, *, keep_below_step: int) -> None:
  """Keep records with step <= keep_below_step: a resumed run re-logs the steps after its checkpoint."""
  records = [r for r in read_jsonl(path) if r["step"] <= keep_below_step]
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)


def write_plots(run_dir: str) -> None:
  """RUN_DIR/reward.png (reward and accuracy per step) and RUN_DIR/throughput.png (token positions
  per second of update time: naive-equivalent and actually computed)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
  if not records:
    return
  steps = [r["step"] for r in records]
  fig, ax = plt.subplots(figsize=(6, 3.5))
  ax.plot(steps, [r["reward_mean"] for r in records], marker="o", label="reward (mean)")
  ax.plot(steps, [r["accuracy"] for r in records], marker="s", label="accuracy")
  ax.set_xlabel("step")
  ax.set_title("GRPO reward per step")
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(run_dir, "reward.png"), dpi=100)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(6, 3.5))
  ax.plot(steps, [r["token_positions_naive"] / r["update_s"] for r in records], marker="o",
          label="naive-equivalent positions / s")
  ax.plot(steps, [r["token_positions_computed"] / r["update_s"] for r in records], marker="s",
          label="computed positions / s")
  ax.set_xlabel("step")
  ax.set_ylabel("token positions per second (update)")
  ax.set_title("Update throughput")
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(run_dir, "throughput.png"), dpi=100)
  plt.close(fig)
