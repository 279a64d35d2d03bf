"""What one turn through a verifiers environment costs (`rollout.verifiers_env.VerifiersEnv`), without a
model: scripted turns, so the figures are the adapter's and verifiers' own (its harness subprocess,
the interception server, the hand-off between threads).

    PYTHONPATH=tests python -m branch_replay_jax.benchmarks.verifiers_turns --taskset=vf_guess \\
        --episodes=8 --turns=1,8,4,6

Prints one JSON line: episodes, turns, init_s (building the adapter), wall_s and wall_per_turn_s (the
episodes, one after another), cpu_self_s and cpu_children_s (CPU seconds of this process and of the
harness subprocesses it waited for: `resource.getrusage`).
"""

from __future__ import annotations

import json
import resource
import time

from absl import app, flags

from branch_replay_jax.models.loading import load_tokenizer, stop_ids
from branch_replay_jax.rollout.environments import run_episode
from branch_replay_jax.rollout.verifiers_env import VerifiersEnv

flags.DEFINE_string("taskset", "vf_guess", "a verifiers taskset id (tests/vf_guess.py with PYTHONPATH=tests)")
flags.DEFINE_integer("episodes", 8, "episodes, problems 0..episodes-1")
flags.DEFINE_integer("num_tasks", 4, "VerifiersEnv's num_tasks")
flags.DEFINE_list("turns", ["1", "8", "4", "6"], "the scripted model turns of every episode, in order")
FLAGS = flags.FLAGS


def _cpu() -> tuple[float, float]:
  own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
  return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def main(_):
  tokenizer = load_tokenizer("smollm2-135m-instruct")
  stop = stop_ids(tokenizer)[0]
  t0 = time.perf_counter()
  env = VerifiersEnv(FLAGS.taskset, num_tasks=FLAGS.num_tasks)
  init_s = time.perf_counter() - t0
  turns, (own0, children0), t0 = 0, _cpu(), time.perf_counter()
  for i in range(FLAGS.episodes):
    texts = iter(FLAGS.turns)
    result = run_episode(env, i, i, tokenizer,
                         lambda ids, budget: tokenizer.encode(next(texts), add_special_tokens=False) + [stop],
                         max_turns=len(FLAGS.turns), max_turn_tokens=16, max_context=2048)
    turns += result.turns
  wall, (own1, children1) = time.perf_counter() - t0, _cpu()
  env.close()
  print(json.dumps({"taskset": FLAGS.taskset, "episodes": FLAGS.episodes, "turns": turns, "offline": env.offline,
                    "init_s": round(init_s, 2), "wall_s": round(wall, 2), "wall_per_turn_s": round(wall / turns, 3),
                    "cpu_self_s": round(own1 - own0, 2), "cpu_children_s": round(children1 - children0, 2)}))


if __name__ == "__main__":
  app.run(main)
