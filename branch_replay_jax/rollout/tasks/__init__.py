"""Prompts and verifiable rewards for GRPO on reasoning-gym tasks.

Problems come from reasoning-gym (https://github.com/open-thought/reasoning-gym), which
generates them offline and deterministically from ``(seed, index)``. Rewards are rule-based
as in DeepSeekMath (GRPO, arXiv 2402.03300) and DeepSeek-R1 (arXiv 2501.12948 §2.2.2): an
accuracy reward from the dataset's own ``score_answer`` plus an optional format reward.

  task = make_task("basic_arithmetic", seed=0, size=10_000)   # strict_answer=False: forgiving
  problem = task[i]                      # i is the data position the trainer checkpoints
  messages = task.messages(problem)      # chat messages (with the task's few-shot examples, if any)
  score = task.score(completion_text, problem)

Answer extraction (``extract_answer``) has two modes, chosen by ``make_task(strict_answer=...)``
(config field ``task.strict_answer``, passed by ``algorithms.runs.make_task_from``):

1. Tagged (both modes): the content of the LAST ``<answer>...</answer>`` pair (tags matched
   case-insensitively) whose content is not blank, stripped of surrounding whitespace.
   ``formatted=True``. Nested tags resolve to the innermost pair: the content may not contain
   another ``<answer>``. Blank pairs and an unclosed ``<answer>`` do not count.
2. Fallback, forgiving mode only (``strict_answer=False``, the default): the last number in the
   text (regex ``_NUMBER``: optional minus sign not preceded by a letter or digit, ASCII
   digits, optional ``,ddd`` thousands groups and decimals), ``formatted=False``. So an
   untagged "... so 12" and an answer cut off by the token budget, "<answer>-12", are read as
   12 and -12 and can score as correct. This gives a weak model that ignores the tags an
   accuracy signal from its first step; ``format_bonus`` then rewards the tags.
3. Otherwise ``extracted=None`` (reward 0: no accuracy, no format bonus).

Strict mode (``strict_answer=True``) stops after step 1: only a closed, non-blank tag counts,
as in rule-based rewards that require the answer in a specified format (DeepSeek-R1, arXiv
2501.12948 §2.2.2). Use it to measure or train the format itself, or with a model that already
emits the tags; it gives a weak model no signal until it does.

The training experiments in ``experiments/`` (the ``*_smollm2_arith`` files) use the forgiving
default (``task.strict_answer = False``), with ``format_bonus = 0.1`` rewarding the tags on top of
the accuracy, except ``grpo_smollm2_arith.py:learn``: its few-shot examples (``make_task(few_shot=)``)
teach the tags, so it counts tagged answers only.

The extracted text is always a verbatim substring of the completion: no normalisation, so
correctness is exactly what the dataset's scorer says about what the model wrote.

Reward: ``score_answer(extracted, entry)`` (0.0 when ``extracted`` is None) plus
``format_bonus`` when ``formatted``. ``correct`` means ``score_answer == 1.0``. Scorer quirks
(reasoning-gym 0.1.25) that the trainer sees as partial credit:

- ``basic_arithmetic`` uses the base ``ProceduralDataset.score_answer``: 1.0 on exact string
  equality, else ``len(answer) / len(extracted)`` when the true answer is a substring of the
  extracted text ("15" or "-5" for "5" score 0.5), else 0.0.
- ``gsm_symbolic`` parses the FIRST number in the extracted text: 1.0 if equal as floats, else
  0.01 for any wrong number, 0.0 when there is no number. Its regex cannot read a leading
  minus sign or thousands commas ("28,080" reads as 28).

Seeds: reasoning-gym builds item ``i`` from ``Random(seed + i)``, so for ``basic_arithmetic``
item ``i`` of seed ``s`` equals item ``i - 1`` of seed ``s + 1``. Seeds of a training and
an evaluation task must be at least the training size apart to keep the sets disjoint.
"""

import dataclasses
import math
import operator
import re
from collections.abc import Sequence
from typing import Any

DEFAULT_INSTRUCTION = "Give only the final answer, inside <answer></answer> tags."

# Registry: task name -> (reasoning-gym dataset name, default generator options). Field names
# are those of the dataset's config dataclass (e.g. reasoning_gym.arithmetic.basic_arithmetic
# .BasicArithmeticDatasetConfig); make_task's keyword options override them.
TASKS: dict[str, tuple[str, dict[str, Any]]] = {
  # Easy enough for a 135M model: "Calculate 5 - 33." Two non-negative terms of 1 or 2 digits
  # (the digit count is drawn per problem; reasoning-gym draws each term in [0, 10**digits]),
  # + and - only, no parentheses (allow_parentheses=False selects reasoning-gym's linear
  # generator, which also makes allow_negation moot). Answers lie in [-100, 200].
  "basic_arithmetic": ("basic_arithmetic", dict(
    min_terms=2, max_terms=2, min_digits=1, max_digits=2, operators=("+", "-"),
    allow_parentheses=False, allow_negation=False, format_style="simple", whitespace="single")),
  # GSM8K-style templated word problems; reasoning-gym supports only difficulty=1.0.
  "gsm_symbolic": ("gsm_symbolic", dict()),
}

_ANSWER_TAG = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.IGNORECASE | re.DOTALL)
_NUMBER = re.compile(r"(?<![A-Za-z0-9])-?[0-9]+(?:,[0-9]{3})*(?:\.[0-9]+)?")


@dataclasses.dataclass(frozen=True)
class Problem:
  """One generated problem: ``question`` and ``answer`` text and reasoning-gym's ``entry`` dict."""
  question: str
  answer: str
  entry: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Score:
  """Reward of one completion (see the module docstring for every field's rule)."""
  reward: float
  correct: bool
  extracted: str | None
  formatted: bool


def extract_answer(text: str, strict: bool = False) -> tuple[str | None, bool]:
  """Returns ``(extracted, formatted)`` by the rules in the module docstring; ``strict``: only a
  closed, non-blank ``<answer>`` tag counts (no last-number fallback)."""
  tagged = [m.strip() for m in _ANSWER_TAG.findall(text) if m.strip()]
  if tagged:
    return tagged[-1], True
  if strict:
    return None, False
  numbers = _NUMBER.findall(text)
  return (numbers[-1] if numbers else None), False


def format_messages(problem: Problem, instruction: str = DEFAULT_INSTRUCTION,
                    examples: Sequence[Problem] = ()) -> list[dict[str, str]]:
  """Chat messages for one problem: one user turn, the question then the instruction, after
  ``examples`` solved in the answer format (few-shot prompting, Brown et al. 2020, arXiv
  2005.14165): per example a user turn as above and an assistant turn
  ``<answer>{example.answer}</answer>``.

  The instruction comes last, nearest to the generation, where a small model such as
  SmolLM2-135M-Instruct is likeliest to follow it. No system message: the model's chat
  template adds its default one.
  """
  messages = []
  for ex in examples:
    messages += [{"role": "user", "content": f"{ex.question}\n{instruction}"},
                 {"role": "assistant", "content": f"<answer>{ex.answer}</answer>"}]
  return messages + [{"role": "user", "content": f"{problem.question}\n{instruction}"}]


class Task(Sequence):
  """A fixed-size, deterministic sequence of problems and their scorer. Build with ``make_task``.

  Attributes: ``name`` (registry key), ``options`` (the generator options used, defaults
  merged with overrides), ``format_bonus``, ``strict_answer`` (the extraction mode, see the
  module docstring), ``dataset`` (the reasoning-gym dataset), ``examples`` (the few-shot
  problems every prompt shows solved, ``format_messages``; empty by default).
  """

  def __init__(self, name: str, dataset: Any, options: dict[str, Any], format_bonus: float,
               strict_answer: bool = False, examples: Sequence[Problem] = ()):
    self.name = name
    self.dataset = dataset
    self.options = options
    self.format_bonus = format_bonus
    self.strict_answer = strict_answer
    self.examples = tuple(examples)

  def messages(self, problem: Problem) -> list[dict[str, str]]:
    """The chat messages of ``problem``'s prompt: ``format_messages`` with this task's examples."""
    return format_messages(problem, examples=self.examples)

  def __len__(self) -> int:
    return self.dataset.size

  def __getitem__(self, i: int) -> Problem:
    """Problem at data position ``i`` in ``[0, len)``; raises ``IndexError`` outside it."""
    i = operator.index(i)  # numpy ints too; reasoning-gym seeds Random(seed + i), which wants an int.
    if not 0 <= i < len(self):
      raise IndexError(f"index {i} out of range for task {self.name!r} of size {len(self)}")
    entry = self.dataset[i]
    return Problem(question=entry["question"], answer=entry["answer"], entry=entry)

  def score(self, completion_text: str, problem: Problem) -> Score:
    """Scores a completion (the generated text only, without the prompt); never raises on text."""
    extracted, formatted = extract_answer(completion_text, strict=self.strict_answer)
    accuracy = 0.0 if extracted is None else float(self.dataset.score_answer(extracted, problem.entry))
    reward = accuracy + (self.format_bonus if formatted else 0.0)
    return Score(reward=reward, correct=accuracy == 1.0, extracted=extracted, formatted=formatted)


def make_task(name: str = "basic_arithmetic", *, seed: int, size: int, format_bonus: float = 0.0,
              strict_answer: bool = False, few_shot: int = 0, few_shot_seed: int = 2_000_000,
              **options: Any) -> Task:
  """Builds the task ``name`` of ``size`` problems from ``seed``.

  Args:
    name: a key of ``TASKS``.
    seed: non-negative int (Python's ``Random`` seeds by absolute value, so ``-s`` would
      silently equal ``s``). See the module docstring on overlap between nearby seeds.
    size: number of problems, ``len(task)``. Item ``i`` does not depend on ``size``.
    format_bonus: reward added when the completion has a non-blank ``<answer>`` tag.
    strict_answer: only a closed ``<answer>...</answer>`` tag counts as an answer; False (the
      default) also reads the last number of an untagged or unclosed answer (module docstring).
    few_shot: how many solved examples every prompt shows before its question (``Task.messages``):
      items 0 .. few_shot - 1 of the same generator at ``few_shot_seed``, so a training task and
      its evaluation task (other seeds) show the same examples. 0: none.
    few_shot_seed: the examples' generator seed (non-negative; keep it at least ``size`` away
      from the training and evaluation seeds, module docstring "Seeds").
    **options: overrides of the task's reasoning-gym generator options.

  Raises:
    ValueError: unknown ``name`` (lists the known ones), an option the dataset's config does
      not have (names it), a value the config rejects, or a bad seed, size, format_bonus or
      strict_answer (not a bool), few_shot (not an int >= 0) or few_shot_seed.
  """
  if name not in TASKS:
    raise ValueError(f"unknown task {name!r}; known tasks: {sorted(TASKS)}")
  if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
    raise ValueError(f"seed must be a non-negative int, got {seed!r}")
  if isinstance(size, bool) or not isinstance(size, int) or size < 1:
    raise ValueError(f"size must be a positive int, got {size!r}")
  if not isinstance(format_bonus, (int, float)) or not math.isfinite(format_bonus):
    raise ValueError(f"format_bonus must be a finite number, got {format_bonus!r}")
  if not isinstance(strict_answer, bool):
    raise ValueError(f"strict_answer must be a bool, got {strict_answer!r}")
  if isinstance(few_shot, bool) or not isinstance(few_shot, int) or few_shot < 0:
    raise ValueError(f"few_shot must be an int >= 0, got {few_shot!r}")
  if isinstance(few_shot_seed, bool) or not isinstance(few_shot_seed, int) or few_shot_seed < 0:
    raise ValueError(f"few_shot_seed must be a non-negative int, got {few_shot_seed!r}")

  import reasoning_gym  # ~1 s to import (sympy, matplotlib): only when a task is built.
  from reasoning_gym.factory import DATASETS
  dataset_name, defaults = TASKS[name]
  _, config_cls = DATASETS[dataset_name]
  allowed = {f.name for f in dataclasses.fields(config_cls)} - {"seed", "size"}
  for key in options:
    if key not in allowed:
      raise ValueError(f"unknown option {key!r} for task {name!r}; options: {sorted(allowed)}")
  merged = {**defaults, **options}
  try:
    dataset = reasoning_gym.create_dataset(dataset_name, seed=seed, size=size, **merged)
  except (AssertionError, TypeError, ValueError) as e:  # reasoning-gym validates with assert.
    raise ValueError(f"invalid options {options} for task {name!r} (with defaults {defaults}): {e!r}") from e
  examples = ()
  if few_shot:
    shots = reasoning_gym.create_dataset(dataset_name, seed=few_shot_seed, size=few_shot, **merged)
    examples = tuple(Problem(question=e["question"], answer=e["answer"], entry=e) for e in shots)
  return Task(name, dataset, merged, float(format_bonus), strict_answer, examples)
