"""What an algorithm plugs into the training loop (algorithms/loop.py, `train`) and the held-out evaluation
(algorithms/evaluation.py): `Algorithm`, subclassed by GRPO / RLOO, PPO and DPO. Its own module so that the loop
and the evaluation both import it and neither imports the other's module for a type."""

from __future__ import annotations

from typing import Any

import optax
from flax import nnx

from branch_replay_jax.algorithms import producer, runs
from branch_replay_jax.outputs import plots


class Algorithm:
  """What an algorithm plugs into `train`. Subclasses set `name` (the progress bar's label) and
  `keep_initial` (a frozen copy of the initial parameters as `run.initial_params`: the reference
  policy; not made with LoRA, whose reference is the base: adapters off), and override the methods below; `validate` runs in the constructor."""

  name = "algorithm"
  keep_initial = False

  def __init__(self, config):
    producer.validate(config)
    self.config = config

  def fingerprint(self) -> dict:
    """Fields that define the experiment (outputs.checkpoints.check_run_dir)."""
    return runs.fingerprint(self.config)

  def make_optimizer(self) -> optax.GradientTransformation:
    return runs.make_optimizer(self.config)

  def wrap(self, model):
    """The module whose parameters train (default: the model itself; PPO: an actor-critic)."""
    return model

  def setup(self, run: runs.Run) -> tuple[Any, Any]:
    """(params, opt_state) to start from, placed where the update runs; builds the jitted steps."""
    return run.params, run.opt_state

  def collect(self, run: runs.Run, params, step: int, data_pos: int) -> tuple[Any, int]:
    """(the step's batch: rollouts or pairs, the next data position)."""
    raise NotImplementedError

  def update(self, params, opt_state, batch, step: int) -> tuple[Any, Any, dict]:
    """(params, opt_state, stats) after the step's optimizer updates on `batch`."""
    raise NotImplementedError

  def log(self, bar, step: int, batch, stats: dict, *, rollout_s: float, update_s: float, wall_s: float) -> dict:
    """Write the step's record (metrics.jsonl, samples.jsonl) with `wall_s` (the run's training
    seconds so far, module docstring) and return it."""
    raise NotImplementedError

  def training_items(self) -> int:
    """How many data positions the run can draw, 0 .. training_items() - 1 (the held-out
    evaluation excludes their questions): train.steps x rollout.prompts_per_step. An algorithm
    that draws more prompts per step than that must say so here."""
    return self.config.train.steps * self.config.rollout.prompts_per_step

  def eval_policy(self, run: runs.Run, params, num_problems: int) -> tuple[Any, list | None]:
    """(policy, devices) the held-out evaluation samples with: the model of `params` and None (every
    problem on this process's default device), or {device: model} and [num_problems] the device of
    each problem (rollout.evaluate.evaluate)."""
    return nnx.merge(run.graphdef, params), None

  def close(self) -> None:
    """Release what the algorithm holds for the run (an environment's thread, subprocess or connection);
    `train` calls it once the run ends, however it ends. Default: nothing."""

  def write_plots(self) -> None:
    plots.write_plots(self.config.run_dir)
