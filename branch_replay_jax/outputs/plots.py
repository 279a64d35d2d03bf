"""Run logs (JSON lines), the end-of-run plots (reward.png, eval.png, throughput.png) and rollout-tree drawings."""

from __future__ import annotations

import json
import os
from typing import Sequence

import numpy as np


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


def cut_logs_back(run_dir: str, step: int) -> list[str]:
  """Cut everything a run appends to back to `step` (the restored checkpoint's; 0 for a fresh run):
  every RUN_DIR/*.jsonl keeps its records with step <= `step` (metrics.jsonl, samples.jsonl,
  eval.jsonl and any other per-step log), and trees/step_N.png with N > `step` are removed. A
  resumed run then re-logs each later step once (the evaluation of step `step` itself ran before
  its checkpoint was saved, so its row stays). Step 0, a fresh run, empties every log, the old
  run's step-0 evaluation included, and removes the TensorBoard event files (events.out.tfevents.*);
  a resumed run hides its later events instead (outputs/tensorboard.py, purge_step). Returns the
  paths it changed or removed."""
  changed = []
  if not os.path.isdir(run_dir):
    return changed
  for name in sorted(os.listdir(run_dir)):
    if name.endswith(".jsonl"):
      truncate_jsonl(os.path.join(run_dir, name), keep_below_step=step if step > 0 else -1)
      changed.append(os.path.join(run_dir, name))
    elif step == 0 and name.startswith("events.out.tfevents."):
      os.remove(os.path.join(run_dir, name))
      changed.append(os.path.join(run_dir, name))
  trees = os.path.join(run_dir, "trees")
  for name in sorted(os.listdir(trees)) if os.path.isdir(trees) else []:
    stem = name.removeprefix("step_").removesuffix(".png")
    if stem.isdigit() and int(stem) > step:
      os.remove(os.path.join(trees, name))
      changed.append(os.path.join(trees, name))
  return changed


# Steps in the reward plot's trailing moving average.
REWARD_WINDOW = 5


def moving_average(values: Sequence[float], window: int) -> np.ndarray:
  """[n] float64 trailing means: entry i is the mean of values[max(0, i - window + 1) .. i] (the
  first window - 1 entries average the values so far). [1, 2, 3, 4], window 2 -> [1, 1.5, 2.5, 3.5].

  Raises:
    ValueError: window < 1.
  """
  if window < 1:
    raise ValueError(f"moving_average: window must be >= 1, got {window}")
  x = np.asarray(values, np.float64)
  sums = np.cumsum(np.concatenate([[0.0], x]))
  i = np.arange(1, x.size + 1)
  lo = np.maximum(i - window, 0)
  return (sums[i] - sums[lo]) / (i - lo)


def write_plots(run_dir: str) -> None:
  """RUN_DIR/reward.png (reward per step with its trailing moving average over REWARD_WINDOW steps,
  and accuracy), RUN_DIR/eval.png (held-out greedy accuracy with its 95% Wilson band, and pass@k,
  against step and against training wall-clock seconds; only when eval.jsonl has rows) and
  RUN_DIR/throughput.png (token positions per second of update time: naive-equivalent and
  actually computed)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
  if not records:
    return
  steps = [r["step"] for r in records]
  rewards = [r["reward_mean"] for r in records]
  fig, ax = plt.subplots(figsize=(6, 3.5))
  ax.plot(steps, rewards, marker="o", alpha=0.45, label="reward (mean)")
  ax.plot(steps, moving_average(rewards, REWARD_WINDOW), lw=2.2, label=f"reward, moving average ({REWARD_WINDOW} steps)")
  ax.plot(steps, [r["accuracy"] for r in records], marker="s", alpha=0.45, label="accuracy")
  ax.set_xlabel("step")
  ax.set_title("GRPO reward per step")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(run_dir, "reward.png"), dpi=100)
  plt.close(fig)
  _eval_plot(run_dir, read_jsonl(os.path.join(run_dir, "eval.jsonl")))
  _throughput_plot(run_dir, records)


def _eval_plot(run_dir: str, rows: list[dict]) -> None:
  """eval.png: two panels, x = step and x = wall_s (training seconds)."""
  if not rows:
    return
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
  for ax, x, label in ((axes[0], "step", "step"), (axes[1], "wall_s", "training wall-clock (s)")):
    xs = [r[x] for r in rows]
    ax.fill_between(xs, [r["accuracy_lo"] for r in rows], [r["accuracy_hi"] for r in rows], alpha=0.25,
                    label="95% Wilson interval")
    ax.plot(xs, [r["accuracy"] for r in rows], marker="o", label="greedy accuracy")
    if "pass_at_k" in rows[-1]:
      ax.plot(xs, [r.get("pass_at_k", np.nan) for r in rows], marker="^", ls="--", label=f"pass@{rows[-1]['pass_k']}")
    ax.set_xlabel(label)
    ax.set_ylim(-0.02, 1.02)
  axes[0].set_ylabel("held-out accuracy")
  axes[0].legend(fontsize=8)
  fig.suptitle(f"Held-out evaluation ({rows[-1]['problems']} problems)")
  fig.tight_layout()
  fig.savefig(os.path.join(run_dir, "eval.png"), dpi=100)
  plt.close(fig)


def write_preference_plots(run_dir: str) -> None:
  """The DPO loop's plots: RUN_DIR/preference.png (loss, implicit-reward accuracy and margin per
  step; steps without pairs are left out) and RUN_DIR/throughput.png (as `write_plots`)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
  if not records:
    return
  done = [r for r in records if r["loss"] is not None]
  steps = [r["step"] for r in done]
  fig, ax = plt.subplots(figsize=(6, 3.5))
  for key, marker in (("loss", "o"), ("reward_accuracy", "s"), ("reward_margin", "^")):
    ax.plot(steps, [r[key] for r in done], marker=marker, label=key)
  ax.set_xlabel("step")
  ax.set_title("Preference loss and implicit reward per step")
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(run_dir, "preference.png"), dpi=100)
  plt.close(fig)
  _throughput_plot(run_dir, records)


def _throughput_plot(run_dir: str, records: list[dict]) -> None:
  import matplotlib.pyplot as plt
  steps = [r["step"] for r in records]
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


def draw_tree(tree, rewards: Sequence[float], path: str, title: str = "") -> None:
  """Draw a rollout tree to `path` (PNG): one box per segment, labelled with its token count.

  Depth runs left to right (the prompt at depth 0), edges join parent and child, and each node
  where trajectories end is coloured by their reward (the mean when several end there) on a
  viridis scale with a colorbar; other nodes are grey. Leaves get one row each, in node-id order.

  Args:
    tree: a `tree.RolloutTree` with G = len(tree.ends) trajectories.
    rewards: [G] rewards, aligned with tree.ends.
    path: output file; its extension picks the format.
    title: figure title.

  Raises:
    ValueError: len(rewards) != G.
  """
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rewards = np.asarray(rewards, np.float64).reshape(-1)
  if rewards.size != len(tree.ends):
    raise ValueError(f"draw_tree: rewards has {rewards.size} values, the tree has {len(tree.ends)} trajectories")
  children = [tree.children(n) for n in range(tree.num_nodes)]
  depth = [0] * tree.num_nodes
  for n in range(1, tree.num_nodes):   # parents precede children
    depth[n] = depth[tree.parents[n]] + 1
  row, next_row = [0.0] * tree.num_nodes, [0]

  def place(n):
    for c in children[n]:
      place(c)
    if children[n]:
      row[n] = float(np.mean([row[c] for c in children[n]]))
    else:
      row[n] = next_row[0]
      next_row[0] += 1

  place(0)
  ended = {}
  for g, e in enumerate(tree.ends):
    ended.setdefault(e, []).append(rewards[g])
  lo, hi = float(rewards.min()), float(rewards.max())
  norm = matplotlib.colors.Normalize(lo - 0.5, hi + 0.5) if lo == hi else matplotlib.colors.Normalize(lo, hi)
  cmap = matplotlib.colormaps["viridis"]

  fig, ax = plt.subplots(figsize=(2.5 + 1.6 * (max(depth) + 1), max(2.5, 0.45 * next_row[0] + 1.2)))
  for n in range(1, tree.num_nodes):
    p = tree.parents[n]
    ax.plot([depth[p], depth[n]], [row[p], row[n]], color="0.55", lw=1, zorder=1)
  for n in range(tree.num_nodes):
    length = len(tree.segments[n])
    label = f"prompt\n{length} tok" if n == 0 else f"{length} tok"
    face = cmap(norm(np.mean(ended[n]))) if n in ended else "0.9"
    text = "white" if n in ended and norm(np.mean(ended[n])) < 0.6 else "black"
    ax.text(depth[n], row[n], label, ha="center", va="center", fontsize=8, color=text, zorder=2,
            bbox=dict(boxstyle="round,pad=0.35", facecolor=face, edgecolor="0.3"))
  ax.set_xlim(-0.6, max(depth) + 0.6)
  ax.set_ylim(next_row[0] - 0.4, -0.6)
  ax.set_xticks(range(max(depth) + 1), [f"depth {d}" for d in range(max(depth) + 1)])
  ax.set_yticks([])
  for side in ("left", "right", "top"):
    ax.spines[side].set_visible(False)
  fig.colorbar(matplotlib.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, label="reward (trajectory end)")
  ax.set_title(title or f"rollout tree: {tree.num_nodes} segments, {len(tree.ends)} trajectories")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
