"""A reward with a remote judge's latency, for the staleness measurement (README.md beside this file):
the task's exact match, returned after LATENCY_S of waiting per prompt, as an LLM judge's HTTP call
or a sandbox's execution would keep the host waiting while the device has nothing to do.

  --config.task.rewards='("docs/results/staleness-cpu/remote_judge.py:exact_match_after_latency",)'
"""

import asyncio

from branch_replay_jax.rollout.tasks.rewards import exact_match

LATENCY_S = 3.0


async def exact_match_after_latency(prompts, completions, answer, **columns):
  await asyncio.sleep(LATENCY_S)
  return exact_match(prompts, completions, answer, **columns)
