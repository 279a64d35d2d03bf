"""One process of tests/test_multihost.py's two-process runs: main's entry point with the tests'
scoring stand-in (conftest.length_score). Nothing may touch a JAX device before main joins the
processes (distributed.hosts.initialize), so this imports no test module."""

from absl import app

from branch_replay_jax import main
from branch_replay_jax.rollout.tasks import Task
from conftest import length_score

if __name__ == "__main__":
  Task.score = length_score
  app.run(main.main)
