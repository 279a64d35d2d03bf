"""The one training loop of every algorithm (GRPO / RLOO, PPO, DPO) and the bookkeeping it owns.

    start_run ─► setup ─► [eval] ─► for step: collect (sample, score) ─► update ─► log ─► [eval] ─► checkpoint
                                                                                              ─► plots

With train.max_staleness = k > 0, collect runs ahead in a producer thread (algorithms/producer.py; with several
processes in this thread, right after each update is dispatched): step t's batch is sampled by the parameters
after max(start, t - k) steps while earlier updates run.

An algorithm plugs in as an `Algorithm` (algorithms/base.py; algorithms/grpo.py, ppo.py, dpo.py): it supplies its
batch (`collect`), its update (`update`: one jitted program per optimizer step,
`gradients.step.make_train_step` for GRPO and PPO, `gradients.preference.make_preference_step` for DPO)
and its metrics record (`log`); the loop owns the order of the steps, timing (`Stopwatch`), the
step's rollouts (`sample_groups`), its records (`log_step`, `step_record`), checkpoints
(`save_if_due`) and plots, and drives run setup and resume (algorithms/runs.py, `start_run`) and
the held-out evaluation (algorithms/evaluation.py, `Evaluation`, config.eval). Everything a run writes goes to RUN_DIR:
metrics.jsonl, samples.jsonl, eval.jsonl, TensorBoard event files (events.out.tfevents.*, one
scalar per metric: train/NAME for metrics.jsonl, eval/NAME for eval.jsonl), plots, experiment.json
and checkpoints/ (orbax).

Wall-clock: each metrics record's `wall_s` is the run's training seconds so far: from the start of
the first step to the end of this step's update, evaluations left out, continued across a resume
(the resumed run starts from the checkpointed step's wall_s in metrics.jsonl). Start-up (model
load, the step-0 evaluation) is not counted; compiles inside steps are. A record's step_s is the
seconds the loop waited for the step's batch (with a producer ahead, what its sampling did not overlap;
with several processes also the later steps it sampled right after this update) plus its update; sample_s and score_s are the sampling's own seconds. Each eval.jsonl row
carries the wall_s of its step, so held-out accuracy plots against training time alike in replay
and naive mode whatever the evaluation costs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time

import jax
import numpy as np

from branch_replay_jax import losses as obj
from branch_replay_jax.algorithms import producer, runs
from branch_replay_jax.algorithms.base import Algorithm
from branch_replay_jax.algorithms.evaluation import Evaluation
from branch_replay_jax.algorithms.groups import Group, rollout_group
from branch_replay_jax.distributed import hosts
from branch_replay_jax.outputs import plots
from branch_replay_jax.outputs.checkpoints import RunCheckpoints
from branch_replay_jax.outputs.tensorboard import ScalarWriter
from branch_replay_jax.rollout.environments import STATUSES
from branch_replay_jax.rollout.tasks.rewards import take_math_verify_timeouts


MATH_VERIFY_TIMEOUTS = "math_verify_timeouts"   # the stats key `train` passes the step's count under


def train(config, algorithm: Algorithm) -> list[dict]:
  """Run `algorithm` for config.train.steps steps (resuming when config.resume); returns this run's records.
  With several processes (distributed/hosts.py) every process calls it; process 0 writes the logs.
  With config.eval.size > 0 it evaluates on held-out problems (`Evaluation`) at step 0, every
  eval.every steps and at the end."""
  runs.check_processes(config)
  evaluation = Evaluation(config, algorithm) if config.get("eval") and config.eval.size else None
  run = runs.start_run(config, algorithm.fingerprint(), optimizer_fn=lambda _: algorithm.make_optimizer(),
                       wrap=algorithm.wrap, keep_initial=algorithm.keep_initial)
  params, opt_state = algorithm.setup(run)
  history = []
  writer = ScalarWriter(config.run_dir, start=run.start) if hosts.is_primary() else None
  clock = Stopwatch(resumed_wall_s(config.run_dir, run.start))
  bar = run.progress(config, algorithm.name)
  def collect(p, step, pos):
    # The step's own math-verify timeouts: counted from its collect's start to its end (the evaluation,
    # which also scores, never runs meanwhile: `Producer.held`), not at log time, when a producer
    # running ahead may be scoring a later step.
    take_math_verify_timeouts()
    batch, pos = algorithm.collect(run, p, step, pos)
    return (batch, take_math_verify_timeouts()), pos

  rollouts = producer.Producer(collect, start=run.start,
                               steps=config.train.steps, data_pos=run.data_pos,
                               max_staleness=producer.max_staleness(config), inline=producer.inline(config))
  try:
    if evaluation is not None and run.start == 0:
      # A resumed run evaluated its checkpointed step before saving it (below).
      with clock.paused():
        evaluation.run(algorithm, run, params, 0, clock.seconds(), writer)
    rollouts.publish(run.start, params)
    for step in bar:
      produced = rollouts.take(step)   # sampled by version max(start, step - train.max_staleness)
      (batch, timeouts), data_pos = produced.batch, produced.data_pos
      t1 = time.perf_counter()
      params, opt_state, stats = algorithm.update(params, opt_state, batch, step)
      t2 = time.perf_counter()
      rollouts.publish(step + 1, params)   # several processes: samples here the steps that version `step` samples
      stats = {**stats, **produced.metrics(step), MATH_VERIFY_TIMEOUTS: timeouts}
      rollout_s = produced.wait_s + time.perf_counter() - t2
      record = algorithm.log(bar, step, batch, stats, rollout_s=rollout_s, update_s=t2 - t1,
                             wall_s=clock.seconds())
      history.append(record)
      if writer is not None:
        writer.write("train", record)
      if evaluation is not None and evaluation.due(step + 1):
        with rollouts.held(), clock.paused():   # the producer's batch in flight counts as training time
          evaluation.run(algorithm, run, params, step + 1, clock.seconds(), writer)
      save_if_due(config, run.ckpt, step, params, opt_state, run.key, data_pos)
  finally:
    try:
      rollouts.close()   # waits for the batch in flight (an interrupt here must not skip the saves below)
    finally:
      run.ckpt.close()   # the last asynchronous save lands on disk, also when a step raised
      if writer is not None:
        writer.close()
      for holder in (evaluation, algorithm):   # environments' threads, subprocesses, connections
        if holder is not None:
          holder.close()
  if hosts.is_primary():
    algorithm.write_plots()
  return history


class Stopwatch:
  """The run's training wall-clock (module docstring): seconds since construction plus `offset`,
  less the spans inside `paused()` (evaluations)."""

  def __init__(self, offset: float = 0.0):
    self.start, self.offset, self.left_out = time.perf_counter(), offset, 0.0

  def seconds(self) -> float:
    return self.offset + time.perf_counter() - self.start - self.left_out

  @contextlib.contextmanager
  def paused(self):
    t = time.perf_counter()
    try:
      yield
    finally:
      self.left_out += time.perf_counter() - t


def resumed_wall_s(run_dir: str, start: int) -> float:
  """wall_s of metrics.jsonl's record of step `start` (0.0 for a fresh run, or a record without
  one), read by process 0 and shared with every process (a collective)."""
  value = 0.0
  if hosts.is_primary() and start:
    value = next((r.get("wall_s", 0.0) for r in plots.read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
                  if r["step"] == start), 0.0)
  return float(hosts.allgather_objects(value)[0])


def sample_groups(config, policy, tokenizer, task, key, step: int, data_pos: int, *,
                  devices=None, whole: bool = False, env=None, layout=None) -> tuple[list[Group], int]:
  """The step's rollouts, one per prompt: group i from task item data_pos + i with the key
  (seed, step, i) folded, so a resumed run, and a run on a mesh, sample the same.

  Args:
    policy: the model, or with `devices` {device: the model on it} for this process's devices.
    devices: None (sample every group here, one after another), or [prompts_per_step] the device
      of each group (`hosts.sampling_devices`): each of this process's devices samples its groups
      in its own thread, all at once; the groups of other processes' devices come back as
      summaries (`Group.batch` None: rewards, lengths, timings, sample, tree for the logs) through
      `hosts.allgather_objects`, a collective every process joins.
    whole: with several processes, the other processes' groups come back with their arrays too
      (`Group.batch` on the host, numpy), so that every process holds the whole step in the same
      order (PPO's minibatch shuffle and whitening, the padded shape of GRPO's trees see every
      group). One process: no effect.
    env: the run's environment with rollout.episodes (`groups.rollout_group`: G episodes per
      problem, one device), else None.
    layout: the run's `schema.Layout` (default: resolved from config by `groups.rollout_group`).

  Returns: ([prompts_per_step] groups in order, the next data position).
  """
  n = config.rollout.prompts_per_step
  one = lambda device, pos, k: rollout_group(config, policy if device is None else policy[device], tokenizer, task,
                                             pos, k, env=env, layout=layout)
  shared = lambda g: dataclasses.replace(g, batch=jax.device_get(g.batch) if whole else None,
                                         naive_batch=jax.device_get(g.naive_batch))
  return sample_each(n, key, step, data_pos, one, devices=devices, summary=shared), data_pos + n


def sample_each(n: int, key, step: int, data_pos: int, sample, *, devices=None, summary=None) -> list:
  """The step's n prompts, prompt i from task item data_pos + i with the key (seed, step, i) folded, so
  a resumed run, and a run on a mesh, sample the same: [sample(device, data_pos + i, key_i)], every
  algorithm's sampling (`sample_groups`; DPO's `dpo.sample_pairs`).

  devices: None (device None passed: every prompt here, one after another), or [n] the device of each
    prompt: each of this process's devices samples its prompts in its own thread, all at once, and
    with several processes the others' items come back as summary(item) (`hosts.gather_items`, a
    collective every process joins; summary None: the items themselves).
  """
  keys = [jax.random.fold_in(jax.random.fold_in(key, step), i) for i in range(n)]
  if devices is None:
    return [sample(None, data_pos + i, keys[i]) for i in range(n)]
  local = hosts.run_on_devices(lambda i, device: sample(device, data_pos + i, jax.device_put(keys[i], device)), devices)
  if jax.process_count() > 1:
    summaries = hosts.gather_items({i: item if summary is None else summary(item) for i, item in local.items()})
  else:
    summaries = local
  return [local.get(i, summaries[i]) for i in range(n)]


def log_step(config, bar, step: int, groups: list[Group], stats: dict, *, rollout_s: float, update_s: float,
             wall_s: float) -> dict:
  """Append the step's record (`step_record` and wall_s) to metrics.jsonl, a sample to
  samples.jsonl, draw a tree; returns the record."""
  record = {**step_record(step, groups, stats, rollout_s=rollout_s, update_s=update_s), "wall_s": wall_s}
  bar.set_postfix(reward=f"{record['reward_mean']:.3f}", step_s=f"{record['step_s']:.1f}")
  if not hosts.is_primary():   # every process computes the record; process 0 writes it
    return record
  plots.append_jsonl(os.path.join(config.run_dir, "metrics.jsonl"), record)
  plots.append_jsonl(os.path.join(config.run_dir, "samples.jsonl"), {"step": step + 1, **groups[0].sample})
  if groups[0].tree is not None:
    os.makedirs(os.path.join(config.run_dir, "trees"), exist_ok=True)
    plots.draw_tree(groups[0].tree, groups[0].rewards, os.path.join(config.run_dir, "trees", f"step_{step + 1}.png"),
                    title=f"step {step + 1}: {groups[0].sample['question']}")
  return record


def save_if_due(config, ckpt: RunCheckpoints, step: int, params, opt_state, key, data_pos: int) -> None:
  if (step + 1) % config.checkpoint_every == 0 or step + 1 == config.train.steps:
    ckpt.save(step + 1, {"params": params, "opt_state": opt_state, "rng": np.asarray(jax.random.key_data(key))},
              {"step": step + 1, "data_pos": data_pos})


def step_record(step: int, groups: list[Group], stats: dict, *, rollout_s: float, update_s: float) -> dict:
  stats = dict(stats)
  timeouts = stats.pop(MATH_VERIFY_TIMEOUTS, 0)
  rewards = np.concatenate([g.rewards for g in groups])
  lengths = np.concatenate([g.lengths for g in groups])
  counts = {k: sum(g.counts[k] for g in groups) for k in ("token_positions_naive", "token_positions_computed")}
  return {"step": step + 1, "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
          "accuracy": float(np.concatenate([g.correct for g in groups]).mean()), **stats,
          "completion_len_mean": float(lengths.mean()),
          "truncated_frac": float(np.concatenate([g.truncated for g in groups]).mean()), **stop_fracs(groups),
          "zero_variance_groups": int(sum(bool(obj.constant_groups(g.rewards)) for g in groups)), **counts,
          "ideal_flop_ratio": float(np.mean([g.counts["ideal_flop_ratio"] for g in groups])),
          "padding_fraction": float(np.mean([g.counts["padding_fraction"] for g in groups])),
          "sample_s": sum(g.sample_s for g in groups), "score_s": sum(g.score_s for g in groups),
          "update_s": update_s, "step_s": rollout_s + update_s, **reward_means(groups, timeouts),
          **episode_means(groups)}


def episode_means(groups: list[Group]) -> dict:
  """The step's episode metrics (rollout.episodes; `Group.episode_stats`), {} for groups and trees:
  tool_calls_per_episode and turns_per_episode (means over the step's episodes), format_rate (the
  share of model turns that are a parseable tool call or a tagged answer) and episodes_STATUS, the
  count of episodes that ended with each status of `rollout.environments.STATUSES` (done, cut by a
  budget, a malformed tool call, a tool error)."""
  stats = [g.episode_stats for g in groups if g.episode_stats is not None]
  if not stats:
    return {}
  status = [s for st in stats for s in st["status"]]
  cat = lambda k: np.concatenate([st[k] for st in stats])
  turns = cat("turns")
  return {"tool_calls_per_episode": float(cat("tool_calls").mean()), "turns_per_episode": float(turns.mean()),
          "format_rate": float(cat("formatted_turns").sum() / max(int(turns.sum()), 1)),
          **{f"episodes_{name}": int(sum(s == name for s in status)) for name in STATUSES}}


def stop_fracs(groups: list[Group]) -> dict:
  """{"stop_eos_frac", "stop_string_frac"}: the fractions of the step's completions that a stop id
  and a stop string (rollout.stop_strings) ended (with truncated_frac, cut by the budget, they sum to
  1); {} when a group carries no stop reasons."""
  if any(g.stop_reasons is None for g in groups):
    return {}
  return stop_reason_fracs(np.concatenate([g.stop_reasons for g in groups]))


def stop_reason_fracs(reasons: np.ndarray) -> dict:
  """{"stop_eos_frac", "stop_string_frac"} of a step's [N] stop reasons ("eos", "stop_string" or "length")."""
  return {"stop_eos_frac": float(np.mean(reasons == "eos")), "stop_string_frac": float(np.mean(reasons == "stop_string"))}


def reward_means(groups: list[Group], math_verify_timeouts: int = 0) -> dict:
  """{"rewards/NAME": mean} of each reward function of task.rewards over the step's completions
  (rollout/tasks/rewards.py; completions it returned None for left out; a function that returned
  None for all of them is left out), {} without task.rewards; `reward_term_means`."""
  return reward_term_means([g.reward_terms for g in groups], math_verify_timeouts)


def reward_term_means(terms: list[dict | None], math_verify_timeouts: int = 0) -> dict:
  """{"rewards/NAME": mean} over the {name: [G] float64} reward terms of a step's prompts
  (`rollout.tasks.protocol.reward_terms`; NaN, a function's None, left out; a function that returned
  None for all of them is left out; None or {} entries: prompts without task.rewards), and with the
  math-verify reward among them "math_verify_timeouts": the step's comparisons that ran out of time
  (scored 0, `rollout.tasks.rewards.math_verify`; counted around the step's collect by `train`, which
  passes them in the stats as MATH_VERIFY_TIMEOUTS)."""
  terms = [t for t in terms if t]
  if not terms:
    return {}
  out = {}
  for name in terms[0]:
    values = np.concatenate([t[name] for t in terms])
    if not np.isnan(values).all():
      out[f"rewards/{name}"] = float(np.nanmean(values))
  if any(name.startswith("math_verify") for name in terms[0]):
    out["math_verify_timeouts"] = math_verify_timeouts
  return out
