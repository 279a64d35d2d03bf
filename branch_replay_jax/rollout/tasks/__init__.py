"""Tasks: the problems a run trains on, their prompts and their rewards (README, "Train on your own task").

A task is data + prompt + reward, each replaceable (config section ``task``; `make_task_from_fields`
in rollout/tasks/sources.py builds one from it):

- data: a reasoning-gym dataset (this module, `make_task`: the presets of ``TASKS`` or any other of
  its datasets by name), local files read with Hugging Face ``datasets`` (rollout/tasks/files.py),
  or any object with the task protocol named by import path (rollout/tasks/protocol.py);
- prompt: chat messages (rollout/tasks/prompts.py: system prompt, answer instruction, few-shot
  examples, a template string for the user turn), rendered by the model tokenizer's chat template;
- reward: the dataset's own scorer (below), or reward functions by import path with TRL's batch
  signature (rollout/tasks/rewards.py).

The rest of this docstring is the reasoning-gym tasks'. Problems come from reasoning-gym (https://github.com/open-thought/reasoning-gym), which
generates them offline and deterministically from ``(seed, index)``. Rewards are rule-based
as in DeepSeekMath (GRPO, arXiv 2402.03300) and DeepSeek-R1 (arXiv 2501.12948 §2.2.2): an
accuracy reward from the dataset's own ``score_answer`` plus an optional format reward.

  task = make_task("basic_arithmetic", seed=0, size=10_000)   # strict_answer=False: forgiving
  task = make_task("chain_sum", seed=0, size=10_000, max_digits=3)   # any reasoning-gym dataset, its options
  problem = task[i]                      # i is the data position the trainer checkpoints
  messages = task.messages(problem)      # chat messages (with the task's few-shot examples, if any)
  score = task.score(completion_text, problem)

Answer extraction (``extract_answer``, rollout/tasks/prompts.py) has two modes, chosen by ``make_task(strict_answer=...)``
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
import difflib
import math
import operator
from collections.abc import Sequence
from typing import Any

from branch_replay_jax.rollout.tasks.prompts import (DEFAULT_INSTRUCTION, DEFAULT_TEMPLATE, Problem, Score,
                                                     extract_answer, format_messages)
from branch_replay_jax.rollout.tasks.protocol import TaskProtocol, score_group

__all__ = ["DEFAULT_INSTRUCTION", "DEFAULT_TEMPLATE", "TASKS", "Problem", "Score", "Task", "TaskProtocol",
           "extract_answer", "format_messages", "make_task", "reasoning_gym_names", "score_group"]

# Presets: task name -> (reasoning-gym dataset name, default generator options). Field names
# are those of the dataset's config dataclass (e.g. reasoning_gym.arithmetic.basic_arithmetic
# .BasicArithmeticDatasetConfig); make_task's keyword options override them. Any other dataset of
# reasoning-gym (`reasoning_gym_names`) is a task too, with reasoning-gym's own default options.
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


def reasoning_gym_names() -> list[str]:
  """Every reasoning-gym dataset name (106 in reasoning-gym 0.1.25), sorted; imports reasoning-gym (~1 s)."""
  from reasoning_gym.factory import DATASETS
  return sorted(DATASETS)


class Task(Sequence):
  """A fixed-size, deterministic sequence of reasoning-gym problems and their scorer (the task
  protocol, rollout/tasks/protocol.py). Build with ``make_task``.

  Attributes: ``name`` (the preset or reasoning-gym dataset name), ``options`` (the generator
  options used, defaults merged with overrides), ``format_bonus``, ``strict_answer`` (the
  extraction mode, see the module docstring), ``dataset`` (the reasoning-gym dataset), ``examples``
  (the few-shot problems every prompt shows solved, ``format_messages``; empty by default), and the
  prompt's ``system_prompt``, ``instruction`` and ``template`` (rollout/tasks/prompts.py).
  """

  def __init__(self, name: str, dataset: Any, options: dict[str, Any], format_bonus: float,
               strict_answer: bool = False, examples: Sequence[Problem] = (), *, system_prompt: str | None = None,
               instruction: str = DEFAULT_INSTRUCTION, template: str = DEFAULT_TEMPLATE):
    self.name = name
    self.dataset = dataset
    self.options = options
    self.format_bonus = format_bonus
    self.strict_answer = strict_answer
    self.examples = tuple(examples)
    self.system_prompt, self.instruction, self.template = system_prompt, instruction, template

  def messages(self, problem: Problem) -> list[dict[str, str]]:
    """The chat messages of ``problem``'s prompt: ``format_messages`` with this task's examples and prompt fields."""
    return format_messages(problem, self.instruction, self.examples, system_prompt=self.system_prompt,
                           template=self.template)

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
              system_prompt: str | None = None, instruction: str = DEFAULT_INSTRUCTION,
              template: str = DEFAULT_TEMPLATE, **options: Any) -> Task:
  """Builds the task ``name`` of ``size`` problems from ``seed``.

  Args:
    name: a key of ``TASKS`` (a preset: its default options), or any reasoning-gym dataset name
      (``reasoning_gym_names``; reasoning-gym's own default options).
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
    system_prompt, instruction, template: the prompt (rollout/tasks/prompts.py, `format_messages`).
    **options: overrides of the task's reasoning-gym generator options.

  Raises:
    ValueError: unknown ``name`` (lists the presets; reasoning_gym_names() lists every dataset), an option the dataset's config does
      not have (names it), a value the config rejects, or a bad seed, size, format_bonus or
      strict_answer (not a bool), few_shot (not an int >= 0) or few_shot_seed.
  """
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
  if name not in TASKS and name not in DATASETS:
    close = difflib.get_close_matches(name, list(DATASETS), n=3)
    raise ValueError(f"unknown task {name!r}; presets: {sorted(TASKS)}; or any of reasoning-gym's {len(DATASETS)} "
                     f"datasets (rollout.tasks.reasoning_gym_names()){f', e.g. {close}' if close else ''}")
  dataset_name, defaults = TASKS.get(name, (name, {}))
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
  for field, value in [("system_prompt", system_prompt), ("instruction", instruction), ("template", template)]:
    if not (isinstance(value, str) or (field == "system_prompt" and value is None)):
      raise ValueError(f"{field} must be a str{' or None' if field == 'system_prompt' else ''}, got {value!r}")
  task = Task(name, dataset, merged, float(format_bonus), strict_answer, examples, system_prompt=system_prompt,
              instruction=instruction, template=template)
  task.messages(task[0])   # a template naming a field the problems lack fails here (ValueError), not mid-run
  return task
