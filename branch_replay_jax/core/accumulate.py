"""Micro-batching shared by every replay and naive path: split a batch axis into scan steps.

`fit_micro_batch` picks a micro-batch that divides a count that varies step to step (a tree's
leaf siblings, a DPO batch's pairs).
"""

from __future__ import annotations


def fit_micro_batch(requested: int, n: int) -> int:
  """The largest divisor of n that is <= requested (>= 1): n items then split into n / m equal steps."""
  return max(m for m in range(1, min(requested, n) + 1) if n % m == 0)
