"""The task protocol: what the training loop, the held-out evaluation and DPO's sampled pairs need of
a task, so that any object with these members trains (``task.source = "python:my_pkg.tasks:make"``,
rollout/tasks/sources.py).

    len(task)                        # problems; the data position p draws item p % len(task)
    problem = task[i]                # a `Problem` (question, answer, entry) for i in [0, len); IndexError outside
    task.messages(problem)           # the prompt as chat messages [{"role", "content"}], rendered by the
                                     # model tokenizer's chat template (models.loading.encode_chat)
    task.score(completion, problem)  # a `Score` (reward, correct, extracted, formatted[, terms]) of the
                                     # generated text (the prompt excluded); must not raise on any text
    task.examples                    # the few-shot problems every prompt shows solved (() if none): the
                                     # held-out evaluation drops problems asking their questions

Optional: ``task.score_group(completions, problem) -> list[Score]`` scores one prompt's completions
at once (the loop calls it when present, e.g. for batch reward functions, rollout/tasks/rewards.py);
without it the loop calls ``score`` once per completion.

Item ``i`` must depend on ``i`` only (not on the step or on which items were drawn before): a
resumed run draws the same problems from the checkpointed data position.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from branch_replay_jax.rollout.tasks.prompts import Problem, Score

MEMBERS = ("__len__", "__getitem__", "messages", "score", "examples")


@runtime_checkable
class TaskProtocol(Protocol):
  """The members every task has (module docstring). `check_task` checks an object against it."""

  examples: Sequence[Problem]

  def __len__(self) -> int: ...

  def __getitem__(self, i: int) -> Problem: ...

  def messages(self, problem: Problem) -> list[dict[str, str]]: ...

  def score(self, completion_text: str, problem: Problem) -> Score: ...


def check_task(task, where: str):
  """``task`` when it has every member of the protocol and at least one problem; ValueError naming
  ``where`` (the config field and value) and the missing members otherwise."""
  missing = [m for m in MEMBERS if not hasattr(task, m)]
  if missing:
    raise ValueError(f"{where}: {type(task).__name__} is not a task: it lacks {missing} (the task protocol, "
                     "rollout/tasks/protocol.py)")
  if len(task) < 1:
    raise ValueError(f"{where}: the task has no problems (len 0)")
  return task


def score_group(task, completions: Sequence[str], problem: Problem, index: int | None = None) -> list[Score]:
  """The scores of one prompt's completions: ``task.score_group`` when the task has it (given
  ``index``, the problem's data position, when it takes an ``index`` argument, for its errors), else
  ``task.score`` per completion."""
  group = getattr(task, "score_group", None)
  if group is None:
    return [task.score(text, problem) for text in completions]
  takes_index = "index" in inspect.signature(group).parameters
  return list(group(list(completions), problem, index=index) if takes_index else group(list(completions), problem))


def reward_terms(scores: Sequence[Score]) -> dict[str, np.ndarray]:
  """{name: [G] float64} each reward function's values over the scores (`Score.terms`; NaN where a
  function returned None); {} for a task's own scorer."""
  names = scores[0].terms if scores else {}
  return {name: np.array([np.nan if s.terms[name] is None else s.terms[name] for s in scores], np.float64)
          for name in names}
