"""Tasks from local files: JSON lines, JSON, Parquet or CSV files read with Hugging Face ``datasets``
(``load_dataset("json" | "parquet" | "csv", data_files=...)``), or a directory written by
``Dataset.save_to_disk`` (``load_from_disk``). Nothing is downloaded: the packaged readers work
offline (``HF_DATASETS_OFFLINE=1`` changes nothing here).

Columns (config ``task.prompt_column``, ``task.answer_column``, ``task.messages_column``):

- the prompt: ``prompt_column``'s text fills the user turn's template ({question}, rollout/tasks/
  prompts.py); a list of {"role", "content"} messages there (verl's parquet layout) is the chat
  itself. Or ``messages_column``: a conversation in chat format, used as it is (the system prompt,
  when set, replaces or precedes its first message); the problem's ``question`` is then the text
  of its last user message.
- the reference answer: ``answer_column`` (``""``: none; then only reward functions,
  ``task.rewards``, can score).
- a column may be a field of a struct column, by a dotted path: verl's parquet keeps the answer in
  ``reward_model = {"ground_truth": ..., "style": "rule"}``, so ``task.answer_column =
  "reward_model.ground_truth"`` (verl #758). A struct named as a text column (the prompt or the
  answer) is refused, naming its fields: its dict's text would be the answer, silently.
- every column is in the problem's ``entry``: reward functions receive each as a keyword argument
  (rollout/tasks/rewards.py), and the template may name any of them. With a dotted answer column the
  entry's ``answer`` is that field's text (when the file has no ``answer`` column of its own).

Blank cells: a CSV is read with every column as text, exactly as written ("007" stays "007"; an
integer column with one blank cell does not turn "4" into "4.0"), and a blank cell is "" (not
NaN, not "None"); a JSON null is None. A JSON answer is read as written too where the reader keeps
it (`answer_text`: 4 in a column mixing 4 and 4.5 is "4", true is "true"; an integer past 2^53 in
such a column has lost its digits to the float already). A row whose prompt (or messages) is
blank, a list that is not chat messages, or a conversation without a non-blank user message is
refused when the task is built, naming the column and the rows: a blank question would train on a
prompt with nothing to answer. A blank or missing answer is "", and the default reward, like
``rewards.exact_match``, never scores a completion against it.

Default reward (without ``task.rewards``): 1 when the extracted answer (``extract_answer``, with
``task.strict_answer``) equals the answer column's text stripped of surrounding whitespace, else 0;
plus ``format_bonus`` for a non-blank ``<answer>`` tag. An exact string match: for math answers
("1/2" against "0.5") use the math-verify reward (rewards.math_verify).

Order and splits: the rows are shuffled once by a seed (`numpy.random.default_rng(seed)
.permutation`); the training task is the first ``size`` of them (fewer when the file has fewer).
The evaluation's rows come from their own file (``task.eval_source``), or from a held-out split
(``task.eval_split``, a fraction of the rows): the last ``round(eval_split x rows)`` rows of the
training seed's shuffle, which the training task then excludes.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from branch_replay_jax.rollout.tasks.prompts import (DEFAULT_INSTRUCTION, DEFAULT_TEMPLATE, Problem, Score,
                                                     extract_answer, format_messages, with_system_prompt)

# file name ending -> the `datasets` packaged reader
READERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def is_file_source(source: str) -> bool:
  """Whether ``source`` names a local file by its ending (READERS) or an existing directory."""
  return source.lower().endswith(tuple(READERS)) or os.path.isdir(source)


def load_rows(path: str, field: str = "task.source"):
  """The rows of ``path`` as a ``datasets.Dataset`` (module docstring), read offline.

  Raises:
    ValueError: naming ``field`` and the path: no such file or directory, an ending that is not one
      of READERS, a file ``datasets`` cannot read, a saved DatasetDict without a "train" split, or
      no rows.
  """
  import datasets   # ~1 s to import: only when a file task is built
  if not os.path.exists(path):
    raise ValueError(f"{field}={path!r}: no such file or directory")
  try:
    if os.path.isdir(path):
      rows = datasets.load_from_disk(path)
      if isinstance(rows, datasets.DatasetDict):
        if "train" not in rows:
          raise ValueError(f"{field}={path!r} holds the splits {sorted(rows)}: name one split's directory")
        rows = rows["train"]
    else:
      ending = os.path.splitext(path)[1].lower()
      if ending not in READERS:
        raise ValueError(f"{field}={path!r}: a file ending in one of {sorted(READERS)} (or a directory written "
                         "by Dataset.save_to_disk)")
      if os.path.getsize(path) == 0:
        raise ValueError(f"{field}={path!r} is empty: no rows")
      text = {}
      if ending == ".csv":   # every column as the text written, a blank cell "" (module docstring)
        with open(path, newline="", encoding="utf-8-sig") as f:   # -sig: Excel's byte-order mark
          header = next(csv.reader(f), [])
        if len(set(header)) != len(header):
          raise ValueError(f"{field}={path!r}: its header names a column twice: {header}")
        # index_col=False: a row with a cell more than the header (a trailing comma) must not turn
        # the first column into pandas' index and shift every other one.
        text = {"features": datasets.Features({c: datasets.Value("string") for c in header}),
                "keep_default_na": False, "index_col": False, "encoding": "utf-8-sig"}
      rows = datasets.load_dataset(READERS[ending], data_files=path, split="train", **text)
  except ValueError as e:
    if str(e).startswith(field):   # ours, naming the field
      raise
    raise ValueError(f"{field}={path!r} could not be read by datasets: {e!r}") from e
  except Exception as e:   # the readers raise their own types (DatasetGenerationError, ArrowInvalid, ...)
    raise ValueError(f"{field}={path!r} could not be read by datasets: {e!r}") from e
  if len(rows) == 0:
    raise ValueError(f"{field}={path!r} is empty: no rows")
  return rows


def column_value(row: dict, column: str):
  """``row``'s value of ``column``: a column name (also one with a dot in it), or a dotted path into
  struct columns ("reward_model.ground_truth"); None where a struct lacks the field or holds null."""
  if column in row:
    return row[column]
  value = row
  for part in column.split("."):
    value = value.get(part) if isinstance(value, dict) else None
  return value


def answer_text(value) -> str:
  """A reference answer as the file wrote it: "" for none (None); JSON's true / false; an integral
  float as an integer ("4", not "4.0": a JSON column mixing 4 and 4.5 reads as floats); else str."""
  if value is None:
    return ""
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, float) and value.is_integer():
    return str(int(value))
  return str(value)


def _feature(rows, column: str):
  """The `datasets` feature at ``column`` (a column name, or a dotted path into structs), or None."""
  if column in rows.features:
    return rows.features[column]
  feature = rows.features
  for part in column.split("."):
    if not isinstance(feature, dict) or part not in feature:
      return None
    feature = feature[part]
  return feature


def _prompt_problem(value) -> str | None:
  """What is wrong with a prompt (or messages) cell, or None: blank text; a list that is not
  {"role", "content"} messages; a conversation without a non-blank user message."""
  if value is None or (isinstance(value, str) and not value.strip()):
    return "blank"
  if isinstance(value, list):
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value):
      return "not a list of {\"role\", \"content\"} messages"
    if not any(m["role"] == "user" and isinstance(m.get("content"), str) and m["content"].strip() for m in value):
      return "a conversation without a non-blank user message"
  return None


def check_columns(rows, path: str, *, prompt_column: str, answer_column: str, messages_column: str) -> None:
  """ValueError naming the field (task.prompt_column, task.answer_column, task.messages_column) and
  its value: a column (or dotted path into a struct) not in ``rows`` (lists the file's columns); a
  struct named as the prompt or the answer (lists its fields); a prompt (or messages) cell that is
  blank in some row (names the rows, 0-based, in file order)."""
  wanted = [("task.messages_column", messages_column)] if messages_column else [("task.prompt_column", prompt_column)]
  if answer_column:
    wanted.append(("task.answer_column", answer_column))
  for field, column in wanted:
    feature = _feature(rows, column)
    if feature is None:
      hint = " (set task.answer_column='' for a file without answers)" if field == "task.answer_column" else ""
      raise ValueError(f"{field}={column!r}: no such column in {path!r}; its columns are {rows.column_names}{hint}")
    if isinstance(feature, dict) and field != "task.messages_column":
      example = f"{column}.{next(iter(feature))}" if feature else column
      raise ValueError(f"{field}={column!r} in {path!r} is a struct with the fields {sorted(feature)}, not text; "
                       f"name one field with a dotted path, e.g. {field}={example!r}")
  column = messages_column or prompt_column
  top = column if column in rows.column_names else column.split(".")[0]
  problems = {}
  for i, cell in enumerate(rows[top]):
    problem = _prompt_problem(column_value({top: cell}, column))
    if problem:
      problems.setdefault(problem, []).append(i)
  for problem, where in problems.items():
    field = "task.messages_column" if messages_column else "task.prompt_column"
    raise ValueError(f"{field}={column!r}: {len(where)} rows of {path!r} are {problem} there (rows {where[:10]}"
                     f"{' ...' if len(where) > 10 else ''}, 0-based); a problem needs a prompt: remove or fix them")


class RecordsTask(Sequence):
  """A task over the rows of a file (module docstring; the task protocol, rollout/tasks/protocol.py).

  Args:
    rows: a ``datasets.Dataset`` (`load_rows`).
    order: [n] int row indices, item i is row order[i].
    name: the task's name in logs.
    prompt_column, answer_column, messages_column: the columns (module docstring; "" for none).
    format_bonus, strict_answer: the default reward's (module docstring).
    system_prompt, instruction, template: the prompt (rollout/tasks/prompts.py).
  """

  examples: tuple[Problem, ...] = ()   # no few-shot examples (task.few_shot must be 0 for a file)

  def __init__(self, rows, order: np.ndarray, *, name: str, prompt_column: str = "prompt",
               answer_column: str = "answer", messages_column: str = "", format_bonus: float = 0.0,
               strict_answer: bool = False, system_prompt: str | None = None,
               instruction: str = DEFAULT_INSTRUCTION, template: str = DEFAULT_TEMPLATE):
    self.rows, self.order, self.name = rows, np.asarray(order, np.int64), name
    self.prompt_column, self.answer_column, self.messages_column = prompt_column, answer_column, messages_column
    self.format_bonus, self.strict_answer = float(format_bonus), strict_answer
    self.system_prompt, self.instruction, self.template = system_prompt, instruction, template

  def __len__(self) -> int:
    return len(self.order)

  def __getitem__(self, i: int) -> Problem:
    """Problem at data position ``i`` in ``[0, len)``; raises ``IndexError`` outside it."""
    i = int(i)
    if not 0 <= i < len(self):
      raise IndexError(f"index {i} out of range for task {self.name!r} of size {len(self)}")
    row: dict[str, Any] = dict(self.rows[int(self.order[i])])
    chat = column_value(row, self.messages_column or self.prompt_column)
    if isinstance(chat, list):
      users = [m.get("content", "") for m in chat if isinstance(m, dict) and m.get("role") == "user"]
      question = str(users[-1]) if users else ""
    else:
      question = str(chat)
    answer = answer_text(column_value(row, self.answer_column) if self.answer_column else None)
    if self.answer_column in row:
      row[self.answer_column] = answer   # reward functions see the answer as written too
    elif self.answer_column and "answer" not in row:
      row["answer"] = answer   # a dotted path: reward functions' `answer` (module docstring)
    return Problem(question=question, answer=answer, entry=row)

  def messages(self, problem: Problem) -> list[dict[str, str]]:
    """The prompt's chat messages: the row's conversation (module docstring) or `format_messages`."""
    chat = column_value(problem.entry, self.messages_column or self.prompt_column)
    if isinstance(chat, list):
      return with_system_prompt(chat, self.system_prompt)
    return format_messages(problem, self.instruction, system_prompt=self.system_prompt, template=self.template)

  def score(self, completion_text: str, problem: Problem) -> Score:
    """The default reward (module docstring); never raises on text."""
    extracted, formatted = extract_answer(completion_text, strict=self.strict_answer)
    answer = problem.answer.strip()   # a blank answer never scores (module docstring)
    correct = bool(answer) and extracted is not None and extracted == answer
    return Score(reward=float(correct) + (self.format_bonus if formatted else 0.0), correct=correct,
                 extracted=extracted, formatted=formatted)


def shuffled(n: int, seed: int) -> np.ndarray:
  """[n] a permutation of the row indices by ``seed`` (numpy's default generator)."""
  return np.random.default_rng(seed).permutation(n)


def held_out_count(n: int, fraction: float) -> int:
  """Rows the held-out split takes of ``n``: round(fraction x n), at least 1 and at most n - 1 when fraction > 0."""
  return 0 if fraction <= 0 else min(max(int(round(fraction * n)), 1), n - 1)


def source_is_same(a: str, b: str) -> bool:
  """Whether two paths name the same file or directory."""
  return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)
