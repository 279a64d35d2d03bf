"""The task of a config's ``task`` section (`make_task_from_fields`): where the problems come from
(``task.source``), the prompt fields, and the reward functions (README, "Train on your own task").

``task.source``:

- unset (None): ``task.name`` is a reasoning-gym dataset (a preset of ``TASKS`` or any other of its
  datasets; rollout/tasks/__init__.py);
- ``"reasoning_gym:NAME"``: the same for dataset NAME (``task.name`` is then only the task's name in
  the logs);
- a local file (``.jsonl``, ``.json``, ``.parquet``, ``.csv``) or a directory written by
  ``Dataset.save_to_disk`` (rollout/tasks/files.py; ``task.prompt_column``, ``task.answer_column``,
  ``task.messages_column``, and for the evaluation ``task.eval_source`` or ``task.eval_split``);
- ``"python:package.module:name"``: a task object (the task protocol, rollout/tasks/protocol.py),
  or a factory called as ``name(seed=, size=, split=, **task.options)`` (split: "train" or "eval")
  that returns one.

``task.options`` are the generator's options (reasoning-gym) or the factory's keyword arguments;
from the command line: ``--config.task.options='{"max_digits": 3}'`` (a dict literal).
``task.rewards`` replaces the task's reward by reward functions (rollout/tasks/rewards.py).

Every error is a ValueError naming the config field and its value, raised while the task is built,
before the model loads (the algorithms build their task in their constructor).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

from branch_replay_jax.rollout.tasks import files
from branch_replay_jax.rollout.tasks.prompts import DEFAULT_INSTRUCTION, DEFAULT_TEMPLATE
from branch_replay_jax.rollout.tasks.protocol import check_task
from branch_replay_jax.rollout.tasks.rewards import RewardTask, check_signature, columns_of, resolve

GYM, PYTHON = "reasoning_gym:", "python:"
SPLITS = ("train", "eval")
# task.FIELD -> its default when the config leaves it out (algorithms/schema.py's TaskConfig says the same)
FILE_FIELDS = {"prompt_column": "prompt", "answer_column": "answer", "messages_column": "", "eval_source": None,
               "eval_split": 0.0}
PROMPT_FIELDS = {"system_prompt": None, "instruction": DEFAULT_INSTRUCTION, "prompt_template": DEFAULT_TEMPLATE}


def source_kind(source: str | None) -> str:
  """"gym", "file" or "python" for a ``task.source`` value.

  Raises:
    ValueError: a value that is none of the forms in the module docstring.
  """
  if source is None or source.startswith(GYM):
    return "gym"
  if source.startswith(PYTHON):
    return "python"
  if files.is_file_source(source):
    return "file"
  raise ValueError(f"task.source={source!r} is not a source: use 'reasoning_gym:NAME', a file ending in one of "
                   f"{sorted(files.READERS)} (or a directory written by Dataset.save_to_disk), or "
                   "'python:package.module:name' (rollout/tasks/sources.py)")


def make_task_from_fields(t, *, seed: int, size: int, split: str = "train"):
  """The task of the config section ``t`` (config.task; module docstring), ``size`` problems at
  ``seed`` (the training's task.seed and task.size, or the evaluation's eval.task_seed and size).

  Args:
    t: the ``task`` section (a ConfigDict or a mapping); fields it leaves out take their defaults.
    split: "train", or "eval" (the held-out evaluation's task: a file source reads
      task.eval_source or the held-out split, rollout/tasks/files.py).

  Raises:
    ValueError: naming the field and value (module docstring; files.load_rows, files.check_columns,
      rewards.resolve, rewards.check_signature), also a field that does not apply to the source.
  """
  if split not in SPLITS:
    raise ValueError(f"split={split!r} is not one of {SPLITS}")
  get = lambda name, default=None: t.get(name, default) if hasattr(t, "get") else default
  source = get("source")
  if source is not None and not isinstance(source, str):
    raise ValueError(f"task.source={source!r} must be a str or None")
  kind = source_kind(source)
  options = get("options", {}) or {}
  options = options.to_dict() if hasattr(options, "to_dict") else dict(options)
  prompt = {k: get(k, v) for k, v in PROMPT_FIELDS.items()}
  for k, v in prompt.items():
    if not (isinstance(v, str) or (k == "system_prompt" and v is None)):
      raise ValueError(f"task.{k}={v!r} must be a str{' or None' if k == 'system_prompt' else ''}")
  prompt_kwargs = dict(system_prompt=prompt["system_prompt"], instruction=prompt["instruction"],
                       template=prompt["prompt_template"])
  if kind != "file":   # the experiments list every field at its default, so only another value is refused
    for k, default in FILE_FIELDS.items():
      if get(k, default) != default:
        raise ValueError(f"task.{k}={get(k)!r} applies to a file source only (task.source={source!r}); leave it "
                         f"at {default!r}")
  few_shot = get("few_shot", 0)
  if kind == "gym":
    from branch_replay_jax.rollout.tasks import make_task
    name = t.name if source is None else source[len(GYM):]
    field = "task.name" if source is None else "task.source"
    try:
      task = make_task(name, seed=seed, size=size, format_bonus=get("format_bonus", 0.0),
                       strict_answer=get("strict_answer", False), few_shot=few_shot,
                       few_shot_seed=get("few_shot_seed", 2_000_000), **prompt_kwargs, **options)
    except ValueError as e:
      raise ValueError(f"task ({field}={name if source is None else source!r}, task.options={options}): {e}") from e
    prompt_columns = ("question",)
  else:
    if few_shot:
      raise ValueError(f"task.few_shot={few_shot!r}: few-shot examples come from a reasoning-gym generator; with "
                       f"task.source={source!r} set task.few_shot=0 (or write the examples into the prompt template)")
    if kind == "file":
      if options:
        raise ValueError(f"task.options={options} apply to reasoning-gym and python sources; a file has none "
                         f"(task.source={source!r}); remove them")
      task, prompt_columns = file_task(t, get, source, seed=seed, size=size, split=split, **prompt_kwargs)
    else:
      for k, default in PROMPT_FIELDS.items():
        if prompt[k] != default:
          raise ValueError(f"task.{k}={prompt[k]!r}: a python task (task.source={source!r}) makes its own messages; "
                           f"leave it at {default!r}")
      if get("format_bonus", 0.0):
        raise ValueError(f"task.format_bonus={get('format_bonus')!r}: a python task (task.source={source!r}) scores "
                         "with its own score (or task.rewards); set task.format_bonus=0")
      task, prompt_columns = python_task(source, seed=seed, size=size, split=split, options=options), ("prompt",)
  return with_rewards(task, get, prompt_columns, kind)


def file_task(t, get, source: str, *, seed: int, size: int, split: str, **prompt):
  """(RecordsTask, the prompt's columns) for a file source (rollout/tasks/files.py, "Order and splits")."""
  columns = {k: get(k, FILE_FIELDS[k]) for k in ("prompt_column", "answer_column", "messages_column")}
  for k, v in columns.items():
    if not isinstance(v, str):
      raise ValueError(f"task.{k}={v!r} must be a str ('' for none)")
  eval_source, fraction = get("eval_source"), get("eval_split", 0.0)
  if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction < 1:
    raise ValueError(f"task.eval_split={fraction!r} must be a number in [0, 1) (the held-out fraction of the rows)")
  if eval_source is not None and fraction:
    raise ValueError(f"task.eval_split={fraction!r} with task.eval_source={eval_source!r}: the evaluation reads one "
                     "of them; set task.eval_split=0 or remove task.eval_source")
  rows = files.load_rows(source, "task.source")
  files.check_columns(rows, source, **columns)
  train_seed = seed if split == "train" else get("seed", seed)   # the held-out split is task.seed's
  if split == "eval" and eval_source is not None:
    if files.source_is_same(eval_source, source):
      raise ValueError(f"task.eval_source={eval_source!r} is task.source: the evaluation would draw the training "
                       "problems; use another file or task.eval_split")
    rows = files.load_rows(eval_source, "task.eval_source")
    files.check_columns(rows, eval_source, **columns)
    order = files.shuffled(len(rows), seed)
  else:
    n = len(rows)
    held = files.held_out_count(n, fraction) if eval_source is None else 0
    if held == 0 and split == "eval":
      raise ValueError(f"eval: task.source={source!r} is a file; the evaluation needs task.eval_source (a file) or "
                       "task.eval_split > 0 (a held-out fraction of its rows)")
    everything = files.shuffled(n, train_seed)
    order = everything[:n - held] if split == "train" else everything[n - held:][files.shuffled(held, seed)]
  name = t.name if "name" in t else os.path.basename(source)
  task = files.RecordsTask(rows, order[:size], name=name, format_bonus=get("format_bonus", 0.0),
                           strict_answer=get("strict_answer", False), **columns, **prompt)
  task.messages(task[0])   # a template naming a missing column fails here
  return task, ((columns["messages_column"] or columns["prompt_column"]).split(".")[0],)


def python_task(source: str, *, seed: int, size: int, split: str, options: Mapping[str, Any]):
  """The task ``"python:module:name"`` names: the object, or what the factory returns."""
  if source.count(":") != 2:
    raise ValueError(f"task.source={source!r} is not 'python:package.module:name'")
  try:
    obj = resolve(source[len(PYTHON):], "import path")
  except ValueError as e:
    raise ValueError(f"task.source={source!r}: {e}") from e
  if not all(hasattr(obj, m) for m in ("__len__", "__getitem__", "messages", "score")):
    try:
      obj = obj(seed=seed, size=size, split=split, **options)
    except TypeError as e:
      raise ValueError(f"task.source={source!r}: the factory cannot be called as f(seed=, size=, split=, "
                       f"**task.options={dict(options)}): {e}") from e
  return check_task(obj, f"task.source={source!r}")


def with_rewards(task, get, prompt_columns, kind: str):
  """``task`` with task.rewards (a `RewardTask`), or ``task`` itself when there are none."""
  paths, weights = tuple(get("rewards", ()) or ()), tuple(get("reward_weights", ()) or ())
  if not paths:
    if weights:
      raise ValueError(f"task.reward_weights={weights} without task.rewards: remove them or name the functions")
    if kind == "file" and not task.answer_column:
      raise ValueError("task.answer_column='' and no task.rewards: nothing scores the completions; name an answer "
                       "column or reward functions (task.rewards)")
    return task
  if not weights:
    weights = (1.0,) * len(paths)
  if len(weights) != len(paths):
    raise ValueError(f"task.reward_weights={weights} has {len(weights)} weights for {len(paths)} task.rewards")
  for k, w in enumerate(weights):
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
      raise ValueError(f"task.reward_weights[{k}]={w!r} must be a finite number")
  bonus = get("format_bonus", 0.0)
  if bonus:
    raise ValueError(f"task.format_bonus={bonus!r} with task.rewards: the bonus belongs to the task's own reward, "
                     "which task.rewards replaces; set task.format_bonus=0 and add "
                     "'branch_replay_jax.rollout.tasks.rewards:format_tags' to task.rewards with a weight")
  columns = columns_of(task[0], prompt_columns)
  functions = []
  for k, path in enumerate(paths):
    fn = resolve(path, f"task.rewards[{k}]")
    check_signature(fn, columns, f"task.rewards[{k}]", path)
    functions.append(fn)
  return RewardTask(task, functions, paths, weights, prompt_columns)
