"""A custom reward for experiments/data/gcd_*.jsonl with TRL's batch signature (README, "Train on your
own task"; rollout/tasks/rewards.py): the dataset's columns ``a`` and ``b`` arrive as keyword
arguments, one value per completion.

  --config.task.rewards='("experiments/rewards/gcd.py:divisor_credit",)'
"""

import math

from branch_replay_jax.rollout.tasks import extract_answer


def divisor_credit(prompts, completions, a, b, **columns):
  """1.0 for the greatest common divisor, 0.25 for another common divisor above 1 (partial credit:
  a number that divides both is closer than one that does not), 0.0 otherwise or for no answer."""
  out = []
  for text, x, y in zip(completions, a, b):
    answer, _ = extract_answer(text, strict=False)
    try:
      d = int(answer)
    except (TypeError, ValueError):
      out.append(0.0)
      continue
    out.append(1.0 if d == math.gcd(x, y) else 0.25 if d > 1 and x % d == 0 and y % d == 0 else 0.0)
  return out
