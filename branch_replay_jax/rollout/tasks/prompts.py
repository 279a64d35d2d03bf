"""What every task shares: the problem and score records (`Problem`, `Score`), the answer extraction
rules (`extract_answer`, documented in rollout/tasks/__init__.py, "Answer extraction") and the chat
messages of a prompt (`format_messages`: system prompt, few-shot examples, the user turn from a
template string)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

DEFAULT_INSTRUCTION = "Give only the final answer, inside <answer></answer> tags."
# The user turn of a prompt: {question} is the problem's text, {instruction} the answer instruction;
# a file task's template may also name any column of the row, e.g. "{context}\n\n{question}".
DEFAULT_TEMPLATE = "{question}\n{instruction}"

_ANSWER_TAG = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.IGNORECASE | re.DOTALL)
_NUMBER = re.compile(r"(?<![A-Za-z0-9])-?[0-9]+(?:,[0-9]{3})*(?:\.[0-9]+)?")


@dataclasses.dataclass(frozen=True)
class Problem:
  """One problem: ``question`` (the prompt's text) and ``answer`` text (``""`` when the task has no
  reference answer) and ``entry``, the whole record (reasoning-gym's entry dict, or a file row's
  columns: what a reward function receives as keyword arguments, rollout/tasks/rewards.py)."""
  question: str
  answer: str
  entry: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Score:
  """Reward of one completion (rollout/tasks/__init__.py gives every field's rule). ``terms``: the
  value of each reward function of ``task.rewards`` by its metric name (rollout/tasks/rewards.py;
  None where the function returned None), empty for a task's own scorer."""
  reward: float
  correct: bool
  extracted: str | None
  formatted: bool
  terms: dict[str, float | None] = dataclasses.field(default_factory=dict)


def extract_answer(text: str, strict: bool = False) -> tuple[str | None, bool]:
  """Returns ``(extracted, formatted)`` by the rules in rollout/tasks/__init__.py ("Answer
  extraction"); ``strict``: only a closed, non-blank ``<answer>`` tag counts (no last-number fallback)."""
  tagged = [m.strip() for m in _ANSWER_TAG.findall(text) if m.strip()]
  if tagged:
    return tagged[-1], True
  if strict:
    return None, False
  numbers = _NUMBER.findall(text)
  return (numbers[-1] if numbers else None), False


def user_turn(problem: Problem, instruction: str = DEFAULT_INSTRUCTION, template: str = DEFAULT_TEMPLATE) -> str:
  """The user turn's text: ``template`` with {question}, {instruction} and the problem's other
  entry fields (a file row's columns) filled in; a null field (a blank JSON cell) is "", never "None".

  Raises:
    ValueError: the template names a field the problem does not have (names it and the fields).
  """
  fields = {**{k: "" if v is None else v for k, v in problem.entry.items() if isinstance(k, str)},
            "question": problem.question,
            "instruction": instruction}
  try:
    return template.format_map(fields)
  except (KeyError, IndexError, ValueError) as e:
    raise ValueError(f"task.prompt_template={template!r} cannot be filled ({e!r}); its fields are "
                     f"{sorted(fields)}") from e


def format_messages(problem: Problem, instruction: str = DEFAULT_INSTRUCTION,
                    examples: Sequence[Problem] = (), *, system_prompt: str | None = None,
                    template: str = DEFAULT_TEMPLATE) -> list[dict[str, str]]:
  """Chat messages for one problem: one user turn (`user_turn`: by default the question then the
  instruction), after ``examples`` solved in the answer format (few-shot prompting, Brown et al.
  2020, arXiv 2005.14165): per example a user turn as above and an assistant turn
  ``<answer>{example.answer}</answer>``.

  The instruction comes last, nearest to the generation, where a small model such as
  SmolLM2-135M-Instruct is likeliest to follow it.

  System prompt: None (the default) writes no system message, so the model's chat template adds
  its own default, if it has one: SmolLM2's writes "You are a helpful AI assistant named SmolLM,
  trained by Hugging Face" whenever the first message is not a system message. A string (also
  ``""``, an empty system turn: the nearest to none such a template allows) is the first message.
  """
  messages = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
  for ex in examples:
    messages += [{"role": "user", "content": user_turn(ex, instruction, template)},
                 {"role": "assistant", "content": f"<answer>{ex.answer}</answer>"}]
  return messages + [{"role": "user", "content": user_turn(problem, instruction, template)}]


def with_system_prompt(messages: Sequence[Mapping[str, str]], system_prompt: str | None) -> list[dict[str, str]]:
  """``messages`` (a conversation from a file's messages column) with ``system_prompt`` first: None
  leaves them as they are; a string replaces a leading system message or is put before the first."""
  messages = [dict(m) for m in messages]
  if system_prompt is None:
    return messages
  if messages and messages[0].get("role") == "system":
    messages = messages[1:]
  return [{"role": "system", "content": system_prompt}, *messages]
