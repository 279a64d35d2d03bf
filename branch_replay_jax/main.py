"""Entry point: `python -m branch_replay_jax.main --config=experiments/grpo_smollm2_arith.py [--config.x=y ...]`."""

import json
import os

from absl import app, logging
from ml_collections import config_flags

import importlib

from branch_replay_jax.algorithms import schema
from branch_replay_jax.distributed import hosts

# config.algorithm (required: algorithms/schema.py) -> the module whose train(config) runs it (imported on
# demand). RLOO is the GRPO loop with loss.advantage = "rloo".
TRAINERS = {"grpo": "branch_replay_jax.algorithms.grpo", "ppo": "branch_replay_jax.algorithms.ppo", "dpo": "branch_replay_jax.algorithms.dpo"}

_CONFIG = config_flags.DEFINE_config_file("config", "experiments/grpo_smollm2_arith.py", "Experiment config file.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; settings go through --config.FIELD=VALUE")
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint phase at INFO
  config = _CONFIG.value
  experiment = schema.parse(config)   # fields and types of its algorithm's schema, before anything starts
  hosts.initialize(config)   # several processes: join them before anything touches a device
  primary = hosts.is_primary()
  run_dir = os.path.abspath(config.run_dir)
  if primary:
    print(f"run dir: {run_dir}", flush=True)
  history = importlib.import_module(TRAINERS[config.algorithm]).train(config, experiment)   # parsed once
  if not primary:
    return
  if history:
    last = history[-1]
    keys = ("step", "reward_mean", "accuracy", "kl", "loss", "reward_accuracy", "step_s")
    print(json.dumps({k: last[k] for k in keys if k in last}))
    samples = os.path.join(run_dir, "samples.jsonl")
    sample = json.loads(open(samples).readlines()[-1]) if os.path.exists(samples) else {}
    if "completion" in sample:
      print(f"last sampled completion (step {sample['step']}):\n  Q: {sample['question']}\n"
            f"  A: {sample['completion']!r}\n  reward {sample['reward']} (answer {sample['answer']})")
    elif "chosen" in sample:   # a preference pair (dpo)
      print(f"last pair (step {sample['step']}):\n  Q: {sample['prompt']}\n  chosen: {sample['chosen']!r}\n"
            f"  rejected: {sample['rejected']!r}")
  print(f"metrics, plots and checkpoints in {run_dir}")


if __name__ == "__main__":
  app.run(main)
