"""One process of tests/test_multihost.py's two-process runs: main's entry point with the tests'
scoring stand-in (conftest.length_score) and, with MULTIHOST_CUT_TREES=1 in the environment, the
tree sampler that cuts each step's first tree short (conftest.cut_by_eos). Nothing may touch a
JAX device before main joins the processes (distributed.hosts.initialize), so this imports no
test module."""

import os

from absl import app

from branch_replay_jax import main
from branch_replay_jax.rollout import collect
from branch_replay_jax.rollout.tasks import Task
from conftest import cut_by_eos, length_score

if __name__ == "__main__":
  Task.score = length_score
  if os.environ.get("MULTIHOST_CUT_TREES") == "1":
    collect.sample_tree = cut_by_eos([])
  app.run(main.main)
