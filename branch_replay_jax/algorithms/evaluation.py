"""A run's held-out evaluation (config.eval): `Evaluation` chooses the problems once when the run
starts, evaluates the policy when `loop.train` asks (`due`) and appends each row to
RUN_DIR/eval.jsonl. The scoring itself is rollout/evaluate.py's."""

from __future__ import annotations

import os
import time

import jax
from tqdm import tqdm

from branch_replay_jax.algorithms.base import Algorithm
from branch_replay_jax.algorithms.runs import Run, make_episode_environment, make_task_from
from branch_replay_jax.distributed import hosts
from branch_replay_jax.outputs import plots
from branch_replay_jax.rollout import evaluate as held_out
from branch_replay_jax.rollout.collect import completion_budget
from branch_replay_jax.rollout.environments import close_environment

# fold_in tag of the evaluation's keys ("eval" in ASCII): training keys fold in the step first, and
# no run reaches step 1.7e9, so the two streams never share a key.
EVAL_STREAM = 0x6576616C


class Evaluation:
  """A run's held-out evaluation (config.eval; rollout/evaluate.py): eval.size problems of the task
  at seed eval.task_seed, none of whose questions a training item asks (`heldout_problems` against
  the algorithm's `training_items()`), chosen once when the run starts. `run` answers every one
  greedily and with eval.pass_k samples (the run's temperature, top-p, stop strings and completion budget) and
  appends a row to RUN_DIR/eval.jsonl (with rollout.episodes: one greedy episode per problem in the
  environment over the held-out task, `rollout.evaluate.evaluate_episodes`, on one device):

    {"step", "wall_s", "eval_s", "problems", "dropped_overlaps", "accuracy", "accuracy_lo",
     "accuracy_hi", "reward_mean", "format_rate", "completion_len_mean"
     [, "pass_k", "pass_at_k", "sampled_accuracy"]}   (rollout.evaluate.summarize)

  Every evaluation uses the same keys (common random numbers: the pass@k of two steps differ by
  the policy, not by fresh sampling noise), and none of the training's, so a run with evaluation
  trains exactly as one without. On a mesh the problems spread over every device
  (`hosts.spread_devices`) and the results are gathered, so every process logs the same row.

  Raises (constructor):
    ValueError: fewer than eval.size held-out problems among the first 10 x eval.size +
      training_items() of the evaluation seed.
  """

  def __init__(self, config, algorithm: Algorithm):
    e = config.eval
    self.config, self.every, self.pass_k = config, e.every, e.pass_k
    items = algorithm.training_items()
    self.task = make_task_from(config, seed=e.task_seed, size=10 * e.size + items, split="eval")
    self.problems, self.dropped = held_out.heldout_problems(algorithm.task, self.task, size=e.size,
                                                            training_items=items)
    # Episodes (rollout.episodes): the environment over the held-out task, greedy episodes only.
    self.env = make_episode_environment(config, self.task)

  def close(self) -> None:
    """Close the held-out environment (the protocol's optional close, rollout/environments.py)."""
    close_environment(self.env)

  def due(self, step: int) -> bool:
    """True at step 0, every eval.every steps and at train.steps (steps counted as in metrics.jsonl)."""
    return step == 0 or step % self.every == 0 or step == self.config.train.steps

  def run(self, algorithm: Algorithm, run: Run, params, step: int, wall_s: float, writer=None) -> dict:
    """Evaluate `params` (after `step` updates); process 0 appends the row to eval.jsonl and
    `writer` (TensorBoard, eval/NAME). Returns the row (the same on every process)."""
    t0 = time.perf_counter()
    r = self.config.rollout
    policy, devices = algorithm.eval_policy(run, params, len(self.problems))
    if self.env is not None:
      results = held_out.evaluate_episodes(policy, run.tokenizer, self.task, self.env, self.problems,
                                           jax.random.fold_in(run.key, EVAL_STREAM), episodes=r.episodes,
                                           history=algorithm.layout.history)
    else:
      results = held_out.evaluate(policy, run.tokenizer, self.task, self.problems,
                                  jax.random.fold_in(run.key, EVAL_STREAM),
                                  max_new_tokens=completion_budget(self.config.rollout),
                                  temperature=r.temperature, top_p=r.top_p, pass_k=self.pass_k,
                                  stop_strings=tuple(r.get("stop_strings", ())), devices=devices)
    summary = held_out.summarize([results[j] for j in range(len(self.problems))], pass_k=self.pass_k)
    row = {"step": step, "wall_s": wall_s, "eval_s": time.perf_counter() - t0, **summary,
           "dropped_overlaps": self.dropped}
    if hosts.is_primary():
      plots.append_jsonl(os.path.join(self.config.run_dir, "eval.jsonl"), row)
      if writer is not None:
        writer.write("eval", row)
      passed = f", pass@{self.pass_k} {row['pass_at_k']:.3f}" if self.pass_k else ""
      tqdm.write(f"eval step {step}: accuracy {row['accuracy']:.3f} [{row['accuracy_lo']:.3f}, "
                 f"{row['accuracy_hi']:.3f}]{passed} ({row['problems']} problems, {row['eval_s']:.1f} s)")
    return row
