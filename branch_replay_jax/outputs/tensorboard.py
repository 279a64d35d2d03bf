"""TensorBoard event files beside metrics.jsonl: one scalar per metric, through tensorboardX.

    writer = ScalarWriter(run_dir, start=step_the_run_continues_from)   # process 0 only
    writer.write("train", record)    # every number of a metrics.jsonl record -> train/NAME at record["step"]
    writer.write("eval", row)        # an eval.jsonl row -> eval/NAME
    writer.close()

`tensorboard --logdir runs/` then shows every run directory as a run. Resume: a run continuing
from step s > 0 opens its writer with tensorboardX's `purge_step = s + 1`, which TensorBoard reads
as "discard every event of this run with step >= s + 1 written before": the steps the interrupted
run logged after its checkpoint vanish and the resumed run's take their place, so no curve folds
back on itself (no zigzag). A fresh run (s = 0) starts from an empty record: `plots.cut_logs_back`
removes the directory's old event files.
"""

from __future__ import annotations

import math
import numbers


class ScalarWriter:
  """A tensorboardX `SummaryWriter` on `run_dir` (module docstring).

  Args:
    run_dir: the run directory; event files events.out.tfevents.* go directly into it.
    start: the step the run continues from (0 for a fresh run); > 0 sets purge_step = start + 1.
  """

  def __init__(self, run_dir: str, *, start: int):
    from tensorboardX import SummaryWriter   # imported on use: only process 0 writes
    self.writer = SummaryWriter(run_dir, purge_step=start + 1 if start else None, flush_secs=30)

  def write(self, prefix: str, record: dict) -> None:
    """prefix/NAME = value at global step record["step"] for every real number of `record` other
    than "step" (bools as 0/1); None, strings, lists and non-finite values are left out."""
    step = int(record["step"])
    for name, value in record.items():
      if name == "step" or not isinstance(value, numbers.Real) or not math.isfinite(value):
        continue
      self.writer.add_scalar(f"{prefix}/{name}", float(value), step)

  def close(self) -> None:
    """Flush every pending event to disk and close the file."""
    self.writer.close()
