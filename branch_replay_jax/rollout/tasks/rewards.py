"""Reward functions by import path (config ``task.rewards`` and ``task.reward_weights``) and the
reward functions this package ships.

A reward function has TRL's batch signature (``GRPOTrainer(reward_funcs=...)``):

    def my_reward(prompts: list[str], completions: list[str], **columns) -> list[float | None]

called once per prompt with its G completions: ``prompts`` [G] the problem's question text
repeated, ``completions`` [G] the generated texts (prompt excluded, special tokens dropped), and
each other field of the problem's entry (a file row's columns other than the prompt's; a
reasoning-gym entry's ``answer`` and ``metadata``) as a keyword argument, a list of G equal values.
It returns G rewards: a finite float each, or None where the reward does not apply (it then adds
nothing and is left out of its metric's mean, as TRL does). An ``async def`` function, or an object
whose ``__call__`` is async (an LLM judge), is awaited: the async functions of one prompt run
concurrently in one event loop (TRL PR #4567), in a thread of their own when the caller already runs
one.

The training reward of a completion is the weighted sum sum_k w_k r_k over the functions that
returned a number (weights ``task.reward_weights``; empty: all 1). Each function is logged as its
own metric, ``rewards/NAME`` in metrics.jsonl (NAME: the function's ``__name__``, made unique).
``correct`` (the accuracy metrics), ``extracted`` and ``formatted`` stay those of the task's own
scorer. ``task.format_bonus`` must then be 0 (add ``format_tags`` with a weight instead).

A function that raises, returns something other than G values, or a value that is neither None
nor a finite number, stops the step with a `RewardError` (a ValueError) naming the function, the
problem's data position and the value, before any gradient: the run's checkpoints stay as they
were, and ``resume=True`` continues from the last one once the function is fixed.

Import paths: ``"package.module:function"`` (also ``"module:Class.method"``), or
``"path/to/file.py:function"`` for a file outside any package (verl's reward-function file).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import sys
import threading
from collections.abc import Callable, Sequence

from branch_replay_jax.rollout.tasks.prompts import Problem, Score, extract_answer
from branch_replay_jax.rollout.tasks.protocol import score_group

# Entry fields a reward function does not receive as keyword arguments: the prompt's own field
# (the `prompts` argument), and names that would collide with the two positional arguments.
NOT_COLUMNS = ("question", "prompts", "completions")


class RewardError(ValueError):
  """A reward function failed on a step's completions (module docstring)."""


def resolve(path: str, field: str) -> Callable:
  """The object ``path`` ("module:attribute" or "file.py:attribute", module docstring) names.

  Raises:
    ValueError: naming ``field`` and ``path``: no ":" in it, a module that cannot be imported (with
      its error), an attribute it does not have, or an object that is not callable.
  """
  if not isinstance(path, str) or path.count(":") != 1 or not all(path.split(":")):
    raise ValueError(f"{field}={path!r} is not an import path 'package.module:name' (or 'file.py:name')")
  module_name, attribute = path.split(":")
  try:
    if module_name.endswith(".py"):
      if not os.path.isfile(module_name):
        raise ImportError(f"no such file {module_name!r}")
      name = "branch_replay_jax_user_" + os.path.splitext(os.path.basename(module_name))[0]
      spec = importlib.util.spec_from_file_location(name, module_name)
      module = importlib.util.module_from_spec(spec)
      sys.modules[name] = module
      spec.loader.exec_module(module)
    else:
      module = importlib.import_module(module_name)
  except Exception as e:   # ImportError, or whatever the module raises while it loads
    raise ValueError(f"{field}={path!r}: module {module_name!r} cannot be imported: {e!r}") from e
  obj = module
  for part in attribute.split("."):
    if not hasattr(obj, part):
      raise ValueError(f"{field}={path!r}: {module_name!r} has no attribute {attribute!r}")
    obj = getattr(obj, part)
  if not callable(obj):
    raise ValueError(f"{field}={path!r} is a {type(obj).__name__}, not a function")
  return obj


def check_signature(fn: Callable, columns: Sequence[str], field: str, path: str) -> None:
  """ValueError naming ``field`` and ``path`` unless ``fn(prompts, completions, **columns)`` binds
  (two positional arguments, then the task's columns as keywords, or ``**kwargs``)."""
  try:
    signature = inspect.signature(fn)
  except (TypeError, ValueError):
    return   # a builtin without a signature: its call shows
  try:
    signature.bind([], [], **{c: [] for c in columns})
  except TypeError as e:
    raise ValueError(f"{field}={path!r}: {getattr(fn, '__name__', fn)}{signature} cannot be called as "
                     f"fn(prompts, completions, **columns) with this task's columns {list(columns)} ({e}); "
                     "take the columns you need by name and **kwargs for the rest") from e


def columns_of(problem: Problem, prompt_columns: Sequence[str] = ()) -> list[str]:
  """The entry fields a reward function receives as keyword arguments (module docstring)."""
  return [k for k in problem.entry if isinstance(k, str) and k not in NOT_COLUMNS and k not in prompt_columns]


class RewardTask:
  """``task`` (any task, rollout/tasks/protocol.py) with its reward replaced by the weighted sum of
  reward functions (module docstring). Items, messages and examples are ``task``'s.

  Args:
    task: the task whose problems and prompts are used; its own `score` still gives ``correct``,
      ``extracted`` and ``formatted``.
    functions: [K] the reward functions; ``paths`` [K] their import paths (for errors);
      ``weights`` [K] floats.
    prompt_columns: entry fields the prompt comes from (not passed as columns).
  """

  def __init__(self, task, functions: Sequence[Callable], paths: Sequence[str], weights: Sequence[float],
               prompt_columns: Sequence[str] = ()):
    self.task, self.functions, self.paths = task, tuple(functions), tuple(paths)
    self.weights, self.prompt_columns = tuple(float(w) for w in weights), tuple(prompt_columns)
    self.names = metric_names(self.functions)
    self.examples = task.examples

  def __len__(self) -> int:
    return len(self.task)

  def __getitem__(self, i: int) -> Problem:
    return self.task[i]

  def messages(self, problem: Problem) -> list[dict[str, str]]:
    return self.task.messages(problem)

  def score(self, completion_text: str, problem: Problem) -> Score:
    """One completion's score (`score_group` of one)."""
    return self.score_group([completion_text], problem)[0]

  def score_group(self, completions: Sequence[str], problem: Problem, index: int | None = None) -> list[Score]:
    """The scores of one prompt's completions; ``index``: the problem's data position (for errors).

    Raises:
      RewardError: a function raised, returned other than len(completions) values, or a value that
        is neither None nor a finite number (names the function, the problem and the value).
    """
    completions = list(completions)
    n, where = len(completions), (f"data position {index}" if index is not None else f"problem {problem.question!r}")
    base = score_group(self.task, completions, problem)
    columns = {c: [problem.entry[c]] * n for c in columns_of(problem, self.prompt_columns)}
    outs, pending = [], {}
    for k, fn in enumerate(self.functions):
      try:
        outs.append(fn([problem.question] * n, completions, **columns))
      except Exception as e:
        for pending_call in pending.values():   # the async rewards called before it: never awaited
          getattr(pending_call, "close", lambda: None)()
        raise RewardError(f"task.rewards[{k}]={self.paths[k]!r} raised {e!r} on the completions of {where}") from e
      if inspect.isawaitable(outs[-1]):
        pending[k] = outs[-1]
    for k, out in zip(pending, _await_all(list(pending.values()))):
      outs[k] = out
    values = []
    for k, (out, path) in enumerate(zip(outs, self.paths)):
      name = f"task.rewards[{k}]={path!r}"
      if isinstance(out, BaseException):
        raise RewardError(f"{name} raised {out!r} on the completions of {where}") from out
      try:
        out = list(out)
      except TypeError:
        raise RewardError(f"{name} returned {out!r} on {where}: a list of {n} rewards expected") from None
      if len(out) != n:
        raise RewardError(f"{name} returned {len(out)} values on the {n} completions of {where}: {_short(out)}")
      for g, v in enumerate(out):
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v)):
          raise RewardError(f"{name} returned {v!r} for completion {g} of {where} (a finite number or None "
                            f"expected); completion: {completions[g][:200]!r}")
      values.append([None if v is None else float(v) for v in out])
    scores = []
    for g, s in enumerate(base):
      terms = {name: values[k][g] for k, name in enumerate(self.names)}
      reward = sum(w * values[k][g] for k, w in enumerate(self.weights) if values[k][g] is not None)
      scores.append(Score(reward=float(reward), correct=s.correct, extracted=s.extracted, formatted=s.formatted,
                          terms=terms))
    return scores


def _await_all(awaitables: list) -> list:
  """The results of `awaitables`, run concurrently in one event loop (an exception is returned in its
  place); in a worker thread when this thread already runs a loop (asyncio.run cannot nest)."""
  if not awaitables:
    return []

  async def gather():
    return await asyncio.gather(*awaitables, return_exceptions=True)
  try:
    asyncio.get_running_loop()
  except RuntimeError:
    return asyncio.run(gather())
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    return pool.submit(asyncio.run, gather()).result()


def metric_names(functions: Sequence[Callable]) -> tuple[str, ...]:
  """Each function's ``__name__`` (its class name for a callable object), ``_2``, ``_3``, ... appended to repeats."""
  names, seen = [], {}
  for fn in functions:
    base = getattr(fn, "__name__", type(fn).__name__)
    seen[base] = seen.get(base, 0) + 1
    names.append(base if seen[base] == 1 else f"{base}_{seen[base]}")
  return tuple(names)


def _short(value, limit: int = 200) -> str:
  text = repr(value)
  return text if len(text) <= limit else text[:limit] + "..."


# ---- reward functions shipped here --------------------------------------------------------------------

def format_tags(prompts, completions, **columns) -> list[float]:
  """1.0 for a completion with a closed, non-blank ``<answer>...</answer>`` tag, else 0.0 (the
  format reward of DeepSeek-R1, arXiv 2501.12948 §2.2.2)."""
  return [float(extract_answer(c, strict=True)[1]) for c in completions]


def exact_match(prompts, completions, answer, **columns) -> list[float]:
  """1.0 when the extracted answer (rollout/tasks/__init__.py, "Answer extraction", forgiving mode:
  the last ``<answer>`` tag, else the last number) equals ``answer`` stripped, else 0.0; 0.0 where
  the answer is missing or blank (None is no answer, never the text "None")."""
  gold = ["" if a is None else str(a).strip() for a in answer]
  return [float(bool(a) and extract_answer(c)[0] == a) for c, a in zip(completions, gold)]


# math-verify's own timeouts are signal alarms: off the main thread (a mesh samples in threads) they
# do nothing, and a pathological completion ("\\boxed{9^{9^{9^{9}}}}") then hangs sympy for good
# (Math-Verify #65, verl PR #5839, TRL PR #5281). Every call therefore runs in a worker process of
# its own (spawned, so JAX's threads are not forked), whose main thread keeps math-verify's alarms;
# the caller waits MATH_VERIFY_SECONDS per completion (the clock starts once the worker has
# imported math-verify, within WORKER_START_SECONDS) and, past that, kills the worker (a new one
# starts for the next call), scores the completion 0 and counts a timeout; a worker that dies
# mid-call (killed, out of memory) is counted and replaced alike.
MATH_VERIFY_SECONDS = 10.0
WORKER_START_SECONDS = 300.0
_math_worker = {"process": None, "conn": None, "timeouts": 0}
_math_lock = threading.Lock()


def _math_verify_server(conn) -> None:
  """The worker process: "ready" once math-verify is imported, then (gold, text) in, 1.0 or 0.0 out,
  until the pipe closes."""
  from math_verify import parse, verify
  conn.send("ready")
  while True:
    try:
      gold, text = conn.recv()
    except EOFError:
      return
    try:
      # A gold answer written as bare LaTeX ("\\dfrac{3}{4}", "\\sqrt{2}") parses only inside $...$
      # (open-r1 #628, PR #566); plain ones ("3/4", "42") parse either way.
      g = parse(gold) or parse(f"${gold}$")
      t = parse(text)
      conn.send(float(bool(g) and bool(t) and verify(g, t)))
    except Exception:   # math-verify's own timeout, or a parse it raises on: no match
      conn.send(0.0)


def _math_verify_call(gold: str, text: str) -> float | None:
  """One comparison in the worker process; None when it took longer than MATH_VERIFY_SECONDS or the
  worker died (it is killed and counted; the next call starts another). Callers hold _math_lock.

  Raises:
    RuntimeError: a new worker did not start within WORKER_START_SECONDS.
  """
  import multiprocessing
  w = _math_worker
  if w["process"] is not None and not w["process"].is_alive():   # died while idle: start another
    _stop_math_worker()
  if w["process"] is None:
    ctx = multiprocessing.get_context("spawn")
    w["conn"], child = ctx.Pipe()
    w["process"] = ctx.Process(target=_math_verify_server, args=(child,), daemon=True)
    w["process"].start()
    child.close()
    if not w["conn"].poll(WORKER_START_SECONDS) or w["conn"].recv() != "ready":
      _stop_math_worker()
      raise RuntimeError(f"the math-verify worker did not start within {WORKER_START_SECONDS:g} s")
  try:
    w["conn"].send((gold, text))
    if w["conn"].poll(MATH_VERIFY_SECONDS):
      return w["conn"].recv()
  except (EOFError, OSError):   # the worker died mid-call (killed, out of memory): as a timeout
    pass
  _stop_math_worker()
  w["timeouts"] += 1
  return None


def _stop_math_worker() -> None:
  w = _math_worker
  w["process"].kill()
  w["process"].join()
  w["process"] = None


def take_math_verify_timeouts() -> int:
  """The math-verify comparisons of this process that timed out (or whose worker died) since the last
  call (and reset): the step's `math_verify_timeouts` metric (algorithms/loop.py)."""
  with _math_lock:
    n, _math_worker["timeouts"] = _math_worker["timeouts"], 0
  return n


def math_verify(prompts, completions, answer, **columns) -> list[float]:
  """1.0 when the completion's answer is mathematically equal to ``answer``, by Hugging Face's
  math-verify (https://github.com/huggingface/Math-Verify: LaTeX and plain expressions parsed to
  sympy and compared, e.g. "\\frac{1}{2}" = "0.5" = "1/2"), else 0.0. The completion's answer is the
  content of its last ``<answer>`` tag when it has one, else the whole text (math-verify then finds
  a \\boxed{} or the last expression). A gold answer in bare LaTeX ("\\dfrac{3}{4}") is read as
  math-verify reads $...$. Each comparison is bounded by MATH_VERIFY_SECONDS wherever it runs (a
  worker process, above); one that runs out scores 0.0 and is counted (`take_math_verify_timeouts`).
  A missing or blank answer scores 0.0."""
  out = []
  with _math_lock:
    for c, a in zip(completions, answer):
      gold = "" if a is None else str(a).strip()
      tagged, formatted = extract_answer(c, strict=True)
      out.append(0.0 if not gold else _math_verify_call(gold, tagged if formatted else c) or 0.0)
  return out
