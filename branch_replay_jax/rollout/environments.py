"""Environments an agent acts in, and the loop that runs one episode (docs/design.md, "Episodes").

The protocol (ours; duck-typed):

    messages = env.reset(problem)                                 # the first chat messages
    observation, reward, done = env.step(assistant_message)       # messages or None, float, bool

Optional: `env.turn_tokens(prompt_ids, completion_ids, completion_logprobs)`, called by `run_episode`
before each step with the turn's context ids, its sampled ids (stop id included) and their log-probs
(the sampler's `logprobs`, `EpisodeSampler.logprobs`; [] for a sampler that records none), for an
environment that keeps the tokens (`VerifiersEnv` hands them to verifiers' trace). Optional:
`env.end_episode()`, called once the episode is over for any reason (done, `EpisodeEnd`, a budget, an
error), for an environment that holds something per episode (`ServedOpenEnv` its server session). Optional:
`env.close()`, called once when the training run that made the environment ends, however it ends
(`algorithms.loop.train`, `close_environment`), for an environment that holds a thread, a subprocess or a
connection (`VerifiersEnv`, the OpenEnv adapters).

An environment ends an episode early, marked, by raising `EpisodeEnd(status, detail)` from step
(a tool call that does not parse, a tool that errors); `run_episode` records the status and the
episode keeps the tokens it has. Anything else an environment raises, or a malformed observation,
stops the run with an error naming the problem's index: the loss mask is never silently wrong.

    env = CalculatorEnv(task)                    # reasoning-gym task + the calculator tool
    env = make_environment("calculator", task, max_tool_calls=2, examples=calculator_examples(task, problems))
    result = run_episode(env, problem, index, tokenizer, sample_turn, max_turns=4, max_turn_tokens=64,
                         max_context=1024)
    result.rows, result.reward, result.status, result.tool_calls   # result.episode: the one row (history "tokens")
    episode_counts(results)                      # per-status counts, tool calls per episode
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import numbers
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from branch_replay_jax.data.episodes import Episode
from branch_replay_jax.models.loading import stop_ids
from branch_replay_jax.rollout.chat import ChatTokens
from branch_replay_jax.rollout.tools import (CALCULATOR, Tool, ToolCallError, ToolError, call_tool, parse_tool_calls,
                                             tool_table, tools_system_prompt)

# How an episode ended: "done" (the environment said so), "malformed_tool_call", "tool_error",
# "max_tool_calls" (more calls than the environment allows), "invalid_action" (a game's move it
# refused and ended on, rollout/adapters.py; text an OpenEnv Action refuses, rollout/openenv_env.py)
# (marked by the environment, `EpisodeEnd`), "max_turns" (the model used every turn without
# finishing), or cut by a token budget (truncated): "max_turn_tokens" (a model turn reached its token
# budget without a stop id), "max_episode_tokens" (the episode's model tokens reached theirs),
# "max_context" (the next turn has no room). Only the
# token cuts are truncated (`loss.mask_truncated` drops them, as TRL PR #4976 masks only what the
# token budget cut): an episode the policy ended by its own actions (too many calls or turns) stays
# in the loss with reward 0, so over-calling is penalised.
STATUSES = ("done", "malformed_tool_call", "tool_error", "max_tool_calls", "invalid_action", "max_turns",
            "max_turn_tokens", "max_episode_tokens", "max_context")
TRUNCATED = ("max_turn_tokens", "max_episode_tokens", "max_context")


class Environment(Protocol):
  def reset(self, problem: Any) -> list[dict[str, str]]: ...

  def step(self, assistant_message: str) -> tuple[list[dict[str, str]] | None, float, bool]: ...


class EpisodeEnd(Exception):
  """Raised by `Environment.step` to end the episode early; status one of STATUSES (not "done")."""

  def __init__(self, status: str, detail: str):
    if status not in STATUSES or status == "done":
      raise ValueError(f"EpisodeEnd: status={status!r} is not one of {STATUSES[1:]}")
    super().__init__(f"{status}: {detail}")
    self.status, self.detail = status, detail


class ToolEnv:
  """Tools in JSON calls (rollout/tools.py) over a task's problems (`rollout.tasks.Task`: `messages`,
  `score`): reset gives the tools' system prompt and the task's messages; a turn with tool calls gets
  one "tool" message per call (reward 0); a turn without one is the final answer, scored by the task.

  A call that does not parse ends the episode as "malformed_tool_call", a tool that errors as
  "tool_error", more than `max_tool_calls` calls as "max_tool_calls" (`EpisodeEnd`); reward 0 then.
  `tool_calls` counts the calls of the current episode; `correct` is the task's verdict on its
  final answer (False until one is scored).

  examples: messages shown after the system prompt and before the problem's (few-shot
  conversations that use the tools, e.g. `calculator_examples`). A system message the task writes
  (task.system_prompt) is appended to the tools' system prompt: one system message.
  """

  def __init__(self, task, tools: Sequence[Tool], *, max_tool_calls: int = 4,
               examples: Sequence[dict[str, str]] = ()):
    if max_tool_calls < 1:
      raise ValueError(f"ToolEnv: max_tool_calls={max_tool_calls!r} must be >= 1")
    self.task, self.tools, self.max_tool_calls = task, tool_table(tools), max_tool_calls
    self.system = tools_system_prompt(list(tools))
    self.examples = [dict(m) for m in examples]
    self.problem, self.tool_calls, self.correct = None, 0, False

  def reset(self, problem) -> list[dict[str, str]]:
    self.problem, self.tool_calls, self.correct = problem, 0, False
    messages, system = list(self.task.messages(problem)), self.system
    if messages and messages[0].get("role") == "system":
      system, messages = f"{system}\n\n{messages[0]['content']}", messages[1:]
    return [{"role": "system", "content": system}] + self.examples + messages

  def step(self, assistant_message: str):
    try:
      calls = parse_tool_calls(assistant_message, self.tools)
    except ToolCallError as e:
      raise EpisodeEnd("malformed_tool_call", str(e)) from None
    if not calls:
      score = self.task.score(assistant_message, self.problem)
      self.correct = bool(score.correct)
      return None, float(score.reward), True
    if self.tool_calls + len(calls) > self.max_tool_calls:
      raise EpisodeEnd("max_tool_calls", f"{self.tool_calls + len(calls)} tool calls, more than {self.max_tool_calls}")
    out = []
    for call in calls:
      try:
        out.append({"role": "tool", "content": call_tool(self.tools[call.name], call)})
      except ToolCallError as e:
        raise EpisodeEnd("malformed_tool_call", str(e)) from None
      except ToolError as e:
        raise EpisodeEnd("tool_error", f"{call.name}: {e}") from None
      self.tool_calls += 1
    return out, 0.0, False


def CalculatorEnv(task, *, max_tool_calls: int = 4, examples: Sequence[dict[str, str]] = ()) -> ToolEnv:
  """A `ToolEnv` with the calculator (`rollout.tools.calculate`, a restricted ast evaluator)."""
  return ToolEnv(task, [CALCULATOR], max_tool_calls=max_tool_calls, examples=examples)


def calculator_examples(task, problems: Sequence) -> list[dict[str, str]]:
  """Few-shot conversations that teach the calculator's call format (Brown et al. 2020, arXiv
  2005.14165): per problem the task's user turn, an assistant turn calling the calculator on the
  problem's expression, the tool's result, and an assistant turn with the answer in <answer> tags.

  Args:
    task: the task whose messages render each problem (its system message, if any, is left out).
    problems: `rollout.tasks.Problem`s whose entry has metadata["expression"] (reasoning-gym's
      arithmetic datasets: basic_arithmetic, chain_sum, ...).

  Raises:
    ValueError: a problem without metadata["expression"] (naming its question).
  """
  out = []
  for p in problems:
    expression = (p.entry.get("metadata") or {}).get("expression") if isinstance(p.entry, dict) else None
    if not isinstance(expression, str):
      raise ValueError(f"calculator_examples: the problem {p.question!r} has no metadata['expression'] to show a "
                       "calculator call with; use an arithmetic task of reasoning-gym or no examples")
    call = json.dumps({"name": CALCULATOR.name, "arguments": {"expression": expression}})
    out += [m for m in task.messages(p) if m["role"] != "system"]
    out += [{"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
            {"role": "tool", "content": CALCULATOR.fn(expression)},
            {"role": "assistant", "content": f"<answer>{p.answer}</answer>"}]
  return out


ENVIRONMENTS = {"calculator": CalculatorEnv}
FIELD = "rollout.episodes.environment"
# rollout.episodes.environment's forms besides a name of ENVIRONMENTS (`make_environment`): a library's
# id after its prefix (the adapter's module in rollout/ and class), or an import path.
ADAPTERS = {"textarena:": ("adapters", "TextArenaEnv"), "gem:": ("adapters", "GemEnv"),
            "verifiers:": ("verifiers_env", "VerifiersEnv"), "openenv:": ("openenv_served", "openenv_environment")}
PYTHON = "python:"


def environment_kind(spec) -> str:
  """"builtin" (a name of ENVIRONMENTS), "adapter" ("textarena:GAME-ID", "gem:ENV-ID",
  "verifiers:TASKSET-ID", "openenv:MODULE:NAME") or "import" ("FILE.py:NAME", "python:MODULE:NAME"):
  the form of rollout.episodes.environment, checked without importing anything.

  Raises:
    ValueError: naming the field and the value, for anything else.
  """
  if spec in ENVIRONMENTS:
    return "builtin"
  if isinstance(spec, str) and any(spec.startswith(p) and len(spec) > len(p) for p in ADAPTERS):
    return "adapter"
  path = spec[len(PYTHON):] if isinstance(spec, str) and spec.startswith(PYTHON) else spec
  if isinstance(path, str) and path.count(":") == 1 and all(path.split(":")) and (
      spec.startswith(PYTHON) or path.split(":")[0].endswith(".py")):
    return "import"
  raise ValueError(f"{FIELD}={spec!r} is not one of {sorted(ENVIRONMENTS)}, 'textarena:GAME-ID', 'gem:ENV-ID', "
                   "'verifiers:TASKSET-ID', 'openenv:package.module:NAME', 'openenv:http://HOST:PORT', "
                   "'FILE.py:NAME' or "
                   "'python:package.module:NAME' (a class or factory of the protocol in rollout/environments.py)")


def close_environment(env) -> None:
  """env.close() where env has one (the protocol's optional hook, module docstring); nothing for None or an
  environment without it."""
  close = getattr(env, "close", None)
  if callable(close):
    close()


def make_environment(spec: str, task, *, max_tool_calls: int, examples: Sequence[dict[str, str]] = (),
                     options: dict | None = None):
  """The environment rollout.episodes.environment = `spec` names, over `task`:

    "calculator"           `CalculatorEnv(task, max_tool_calls=, examples=)` (options must be empty);
    "textarena:GAME-ID"    `rollout.adapters.TextArenaEnv(GAME-ID, **options)` (textarena installed);
    "gem:ENV-ID"           `rollout.adapters.GemEnv(ENV-ID, **options)` (gem-llm installed); with
                           either, a problem of `task` is one seeded game (`adapters.game_seed`);
    "verifiers:TASKSET-ID" `rollout.verifiers_env.VerifiersEnv(TASKSET-ID, **options)` (verifiers
                           0.4.0 installed); a problem picks one of the taskset's tasks by its seed;
    "openenv:package.module:NAME", "openenv:FILE.py:NAME"
                           `rollout.openenv_env.OpenEnvEnv("package.module:NAME", **options)`
                           (openenv-core 0.3.0 installed): NAME an OpenEnv Environment subclass or
                           factory, run in process; a problem is the seed of its reset;
    "openenv:http://HOST:PORT" (or https, ws, wss)
                           `rollout.openenv_served.ServedOpenEnv(URL, **options)`: an environment
                           served by OpenEnv's server;
    "FILE.py:NAME", "python:package.module:NAME"
                           NAME(**options), NAME a class or factory (`rollout.tasks.rewards.resolve`'s
                           import rules), given `task=task` too when it takes a parameter named task.

  options: rollout.episodes.env_options (keyword arguments), or None. The result must follow the
  protocol (module docstring): callable reset(problem) and step(assistant_message).

  Raises:
    ValueError: naming the field and the value, before any model loads: a spec of no known form, a
      path that does not resolve, a factory that raises, a result without callable reset / step or
      whose reset / step does not take one positional argument, options for the calculator;
      max_tool_calls < 1.
  """
  kind, options = environment_kind(spec), dict(options or {})
  if kind == "builtin":
    if options:
      raise ValueError(f"rollout.episodes.env_options={options!r}: {FIELD}={spec!r} takes none (max_tool_calls and "
                       "few_shot configure it)")
    return ENVIRONMENTS[spec](task, max_tool_calls=max_tool_calls, examples=examples)
  if kind == "adapter":
    prefix = next(p for p in ADAPTERS if spec.startswith(p))
    module, cls = ADAPTERS[prefix]   # the adapters import this module: imported here, when one is made
    factory = getattr(importlib.import_module(f"branch_replay_jax.rollout.{module}"), cls)
    name = spec[len(prefix):]
    make = lambda: factory(name, **options)
  else:
    from branch_replay_jax.rollout.tasks.rewards import resolve
    factory = resolve(spec[len(PYTHON):] if spec.startswith(PYTHON) else spec, FIELD)
    takes_task = "task" in _parameters(factory)
    make = lambda: factory(**options, **({"task": task} if takes_task else {}))
  try:
    env = make()
  except (ImportError, ValueError) as e:
    raise ValueError(f"{FIELD}={spec!r}: {e}") from e
  except Exception as e:   # whatever the user's factory raises, with env_options named
    raise ValueError(f"{FIELD}={spec!r} with rollout.episodes.env_options={options!r} raised {e!r}") from e
  check_environment(env, spec)
  return env


def _parameters(fn) -> tuple[str, ...]:
  try:
    return tuple(inspect.signature(fn).parameters)
  except (TypeError, ValueError):   # a builtin without a signature
    return ()


def check_environment(env, spec: str = "") -> None:
  """Raise ValueError (naming rollout.episodes.environment) unless `env` has callable reset and step
  that each take one positional argument (the problem; the assistant message)."""
  for method in ("reset", "step"):
    fn = getattr(env, method, None)
    if not callable(fn):
      raise ValueError(f"{FIELD}={spec!r}: {type(env).__name__} has no {method}() method; an environment follows "
                       "reset(problem) -> messages and step(assistant_message) -> (observation, reward, done)")
    try:
      inspect.signature(fn).bind(None)
    except TypeError as e:
      raise ValueError(f"{FIELD}={spec!r}: {type(env).__name__}.{method} cannot be called with one argument "
                       f"({e}); the protocol is reset(problem) and step(assistant_message)") from None
    except ValueError:   # no signature to check (a builtin)
      pass


@dataclasses.dataclass
class EpisodeResult:
  """One episode run by `run_episode`.

  rows: its tokens as `data.episodes.Episode` rows (`rollout.chat.ChatTokens.rows`; a last observation,
    attended by nothing, left out): one row with history "tokens", one per rendering the template
    rewrote with history "template".
  reward: the sum of the environment's step rewards (0 for an episode ended by `EpisodeEnd`).
  status: one of STATUSES; truncated: status in TRUNCATED.
  turns: model turns; tool_calls: "tool" messages the environment returned.
  """
  rows: tuple
  reward: float
  status: str
  turns: int
  tool_calls: int

  @property
  def truncated(self) -> bool:
    return self.status in TRUNCATED

  @property
  def episode(self) -> Episode:
    """The episode's one row (history "tokens").

    Raises:
      ValueError: the episode has several rows (history "template" after a rewrite): use `rows`.
    """
    if len(self.rows) != 1:
      raise ValueError(f"EpisodeResult.episode: the episode has {len(self.rows)} rows (the template rewrote its "
                       "history); read EpisodeResult.rows")
    return self.rows[0]

  @property
  def model_tokens(self) -> int:
    """Tokens the model sampled in the episode, over its rows."""
    return sum(r.num_model_tokens for r in self.rows)


def _check_messages(messages, index: int, where: str):
  ok = isinstance(messages, (list, tuple)) and messages and all(
      isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages)
  if not ok:
    raise ValueError(f"problem {index}: the environment's {where} returned {str(messages)[:120]!r}; it must be a "
                     "non-empty list of {\"role\": str, \"content\": str} messages")


def run_episode(env: Environment, problem, index: int, tokenizer, sample_turn: Callable[[list[int], int], Sequence[int]],
                *, max_turns: int, max_turn_tokens: int, max_context: int, max_episode_tokens: int | None = None,
                chat_template: str | None = None, history: str = "tokens") -> EpisodeResult:
  """Run one episode: reset, then model turns and observations until done, an `EpisodeEnd` or a budget.

  Args:
    env: an `Environment`.
    problem, index: the problem and its index (named in errors).
    tokenizer: the model's tokenizer (its chat template renders the messages, `rollout.chat.ChatTokens`).
    sample_turn: (ids so far, token budget) -> the sampled ids of one turn (at most the budget; ending
      with a stop id unless the budget cut it), e.g. `rollout.episode_sampler.EpisodeSampler`.
    max_turns: model turns per episode; max_turn_tokens: tokens per model turn; max_context: tokens
      of the whole episode (prompt included); max_episode_tokens: model tokens of the whole episode
      (its turns summed; None: no such budget). A turn's budget is the smallest of what each leaves;
      the one that cuts a turn names its status.
    chat_template, history: as `ChatTokens` (history "template": a turn whose rendered context does not
      extend the ids so far starts a new row; `sample_turn` is then called with ids that do not extend
      the previous call's, which `EpisodeSampler(history="template")` accepts).

  Returns:
    An `EpisodeResult`.

  Raises:
    ValueError: a budget < 1; a prompt with no room for a turn; sample_turn returned no ids, more than
      the budget, or fewer without a stop id; the environment's reset or step returned malformed
      messages or a reward that is not a finite number (each naming the problem's index).
    RuntimeError: the environment raised something other than `EpisodeEnd` (naming the problem's index).
  """
  budgets = (("max_turns", max_turns), ("max_turn_tokens", max_turn_tokens), ("max_context", max_context)) + (
      (("max_episode_tokens", max_episode_tokens),) if max_episode_tokens is not None else ())
  for name, value in budgets:
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"run_episode: {name}={value!r} must be an int >= 1")
  end_episode = getattr(env, "end_episode", None)
  try:
    return _play(env, problem, index, tokenizer, sample_turn, max_turns=max_turns, max_turn_tokens=max_turn_tokens,
                 max_context=max_context, max_episode_tokens=max_episode_tokens, chat_template=chat_template,
                 history=history)
  finally:
    if callable(end_episode):
      end_episode()


def _play(env, problem, index, tokenizer, sample_turn, *, max_turns, max_turn_tokens, max_context, max_episode_tokens,
          chat_template, history) -> EpisodeResult:
  """`run_episode`'s episode, its budgets checked."""
  try:
    messages = env.reset(problem)
  except Exception as e:
    raise RuntimeError(f"problem {index}: the environment {type(env).__name__}'s reset raised {e!r}") from e
  _check_messages(messages, index, "reset")
  chat = ChatTokens(tokenizer, messages, chat_template=chat_template, history=history)
  if len(chat.ids) >= max_context:
    raise ValueError(f"problem {index}: the prompt has {len(chat.ids)} tokens, no room in max_context={max_context}")
  stops = set(stop_ids(tokenizer))
  reward, status, turns, tool_calls, sampled_tokens = 0.0, "max_turns", 0, 0, 0
  while turns < max_turns:
    left = {"max_turn_tokens": max_turn_tokens, "max_context": max_context - len(chat.ids)}
    if max_episode_tokens is not None:
      left["max_episode_tokens"] = max_episode_tokens - sampled_tokens
    binding = min(left, key=left.get)   # ties: the turn's own budget, then the context's
    budget = left[binding]
    if budget < 1:
      status = binding
      break
    context = list(chat.ids)
    sampled = [int(i) for i in sample_turn(context, budget)]
    if not 1 <= len(sampled) <= budget:
      raise ValueError(f"problem {index}: sample_turn returned {len(sampled)} ids for a budget of {budget}")
    content = chat.add_model_turn(sampled)
    turns += 1
    sampled_tokens += len(sampled)
    if sampled[-1] not in stops:   # cut by a budget: the turn's own, or the context's when that is smaller
      if len(sampled) != budget:
        raise ValueError(f"problem {index}: sample_turn returned {len(sampled)} ids without a stop id, under the "
                         f"turn's budget of {budget}")
      status = binding
      break
    if callable(getattr(env, "turn_tokens", None)):   # an environment that records the tokens (VerifiersEnv)
      logprobs = getattr(sample_turn, "logprobs", None)
      env.turn_tokens(context, sampled, [float(x) for x in logprobs[-1]] if logprobs else [])
    try:
      observation, r, done = env.step(content)
    except EpisodeEnd as e:
      reward, status = 0.0, e.status
      break
    except Exception as e:
      raise RuntimeError(f"problem {index}: the environment {type(env).__name__}'s step at turn {turns} raised "
                         f"{e!r}") from e
    try:
      finite = isinstance(r, numbers.Real) and bool(np.isfinite(float(r)))
    except OverflowError:   # an int beyond float's range
      finite = False
    if not finite:
      raise ValueError(f"problem {index}: the environment {type(env).__name__}'s step at turn {turns} returned the "
                       f"reward {r!r}; a reward is a finite number")
    reward += float(r)
    if done:
      status = "done"
      break
    _check_messages(observation, index, f"step {turns - 1}")
    try:
      chat.add_observation(observation)
    except ValueError as e:
      raise ValueError(f"problem {index}: {e}") from e
    tool_calls += sum(m["role"] == "tool" for m in observation)
  return EpisodeResult(chat.rows(), reward, status, turns, tool_calls)


def episode_counts(results: Sequence[EpisodeResult]) -> dict[str, float]:
  """The metrics of a batch of episodes: "episodes", one "episodes_<status>" count per status (0 included),
  "truncated", and the means "tool_calls_per_episode", "turns_per_episode" and "reward"."""
  n = len(results)
  out: dict[str, float] = {"episodes": n}
  for s in STATUSES:
    out[f"episodes_{s}"] = sum(r.status == s for r in results)
  out["truncated"] = sum(r.truncated for r in results)
  for name, values in (("tool_calls_per_episode", [r.tool_calls for r in results]),
                       ("turns_per_episode", [r.turns for r in results]), ("reward", [r.reward for r in results])):
    out[name] = float(np.mean(values)) if n else 0.0
  return out
