"""A verifiers environment behind our protocol: `VerifiersEnv` (docs/design.md, "Episodes"; README,
"Bring an environment").

verifiers 0.4.0 (https://github.com/PrimeIntellect-ai/verifiers, the `verifiers.v1` API; the
optional extra `envs`, `pip install verifiers==0.4.0`) inverts control: its `Env` runs an episode
of a taskset's task, and the agent's program (a harness, here verifiers' own `null` chat loop, run
as a local subprocess, never a cloud sandbox) calls the model through a `verifiers.v1.Client`. The
adapter's client is our episode sampler: each model call of the harness becomes one turn of
`rollout.environments.run_episode`, whose sampler writes the turn's token ids (kept verbatim by
`rollout.chat.ChatTokens`, never re-tokenized). Its response to each call carries that turn's
token ids and log-probs (verifiers' `TurnTokens`, from `run_episode`'s `turn_tokens` hook), so
verifiers' own trace holds the ids we sampled and train. verifiers' episode runs on an event loop in
a thread of the adapter's own; `reset` and `step` hand the turns across.

    env = VerifiersEnv("my_taskset", num_tasks=64)     # a verifiers taskset id (an importable module)
    result = run_episode(env, problem, 0, tokenizer, sampler, max_turns=4, max_turn_tokens=64, max_context=2048)
    env.close()

In the training loop: `rollout.episodes.environment = "verifiers:TASKSET-ID"`, keyword arguments in
`rollout.episodes.env_options`.

What maps to what:

    reset(problem) -> verifiers runs task `tasks[game_seed(problem) % len(tasks)]` (its Env's `run`,
                      its harness); the harness's first model call's messages (system, prompt)
                      are the episode's first messages
    step(message)  -> `message` is the model call's reply (an assistant message, finish reason
                      "stop"); then either the harness's next model call, whose messages after
                      the history so far are the observation (reward 0, not done), or the
                      episode's end: (None, the sum of its traces' rewards, done)
    a model call whose history is not the episode's so far (a harness that rewrote or compacted
    it), a call with tools, an episode that records an error (a reward function that raised, a
    harness that failed), no model call within `timeout` seconds
                   -> ValueError / RuntimeError: run_episode stops the step, naming the problem

The sampling settings of the harness's calls (temperature, max_tokens) are not used: the loop's
sampler and its budgets rule. A taskset with toolsets is refused when the adapter is built: the
model's text would have to be parsed into the call's JSON for the harness, which this adapter does
not do yet. An episode the loop ends early (a token budget) is ended at the next reset or close:
its pending model call is answered with an error, so the harness exits and verifiers tears the
episode down its own way (cancelled only if that takes longer than `timeout`). A closed adapter
refuses reset at once.

Offline: the `null` harness is a PEP 723 script that verifiers prepares with `uv` (downloading its
packages). Its packages are verifiers' own requirements, so by default (`uv=False`) the adapter
runs it with this Python instead, by entering the script in verifiers' subprocess runtime's cache
of prepared scripts (`SubprocessRuntime._interpreters`, verifiers 0.4.0). Another harness runs only
with `uv=True` (verifiers' own preparation, which downloads uv and the harness's packages).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import importlib.util
import itertools
import json
import queue
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

from branch_replay_jax.rollout.adapters import game_seed, import_optional

VERSION = "0.4.0"
INSTALL = f"pip install verifiers=={VERSION}"
ROLES = ("system", "user", "assistant", "tool")


def _text(content, where: str) -> str:
  if isinstance(content, str):
    return content
  if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
    return "".join(p.get("text", "") for p in content)
  raise ValueError(f"VerifiersEnv: {where} has content {str(content)[:80]!r}; only text messages run")


def chat_messages(body: dict) -> list[dict[str, str]]:
  """The {"role", "content"} messages of an OpenAI chat-completions request body.

  Raises:
    ValueError: a request with tools, no messages, a role not in ROLES, or content that is not text.
  """
  if body.get("tools"):
    names = [t.get("function", {}).get("name") for t in body["tools"] if isinstance(t, dict)]
    raise ValueError(f"VerifiersEnv: the harness offers tools {names}; tool calls through verifiers are not "
                     "supported by this adapter (use a taskset without toolsets)")
  messages = body.get("messages")
  if not isinstance(messages, list) or not messages:
    raise ValueError(f"VerifiersEnv: the model call has no messages ({str(body)[:120]!r})")
  out = []
  for i, m in enumerate(messages):
    role = m.get("role") if isinstance(m, dict) else None
    if role == "developer":
      role = "system"
    if role not in ROLES:
      raise ValueError(f"VerifiersEnv: message {i} of the model call has role {role!r}, not one of {ROLES}")
    out.append({"role": role, "content": _text(m.get("content") or "", f"message {i} of the model call")})
  return out


def _run_chat_program_with_this_python() -> bool:
  """Enter verifiers' `null` chat program in its subprocess runtime's cache of prepared scripts with
  this interpreter (module docstring), when every package the script lists imports here. Returns
  whether it did (False: only uv could prepare it, which downloads; VerifiersEnv then refuses)."""
  from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
  from verifiers.v1.runtimes.subprocess import SubprocessRuntime
  listed = re.search(r"^# dependencies = (\[.*\])$", CHAT_PROGRAM_SOURCE, re.M)
  cache = getattr(SubprocessRuntime, "_interpreters", None)
  if listed is None or not isinstance(cache, dict):
    return False
  names = [re.split(r"[<>=!~ \[]", d, maxsplit=1)[0].replace("-", "_") for d in json.loads(listed.group(1))]
  if any(importlib.util.find_spec(n) is None for n in names):
    return False
  data = CHAT_PROGRAM_SOURCE.encode()
  path = Path(SubprocessRuntime.scripts_dir) / f"{hashlib.sha256(data).hexdigest()}.py"
  path.parent.mkdir(parents=True, exist_ok=True)
  if not path.exists() or path.read_bytes() != data:
    path.write_bytes(data)
  cache[str(path)] = sys.executable
  return True


class VerifiersEnv:
  """A verifiers 0.4.0 taskset's episodes as an `Environment` (see the module docstring).

  Args:
    taskset: a verifiers taskset id (a module that exports its Taskset subclass, and its Env
      subclass if it has one, in `__all__`; verifiers' own or an installed / importable one).
    num_tasks: the tasks of the taskset a problem picks from (its first num_tasks); None: all of a
      bounded taskset (required for an infinite one).
    taskset_options: fields of the taskset's config (e.g. {"game": "Wordle-v0"}; not "id").
    harness: the harness id for every seat; only verifiers' `null` chat loop runs offline (uv=False).
    timeout: seconds to wait for verifiers' servers to start, the harness's next model call or the
      episode's end, and a cancelled episode's teardown.
    uv: let verifiers prepare the harness's script with uv (downloads uv and the script's packages)
      instead of running it with this Python.

  Attributes:
    env: the verifiers Env. tasks: the tasks problems pick from. task: the current episode's task
      (None before the first reset). last_episode: the verifiers Episode of the last episode that
      ended (its traces, rewards, errors). offline: whether the harness runs with this Python.

  Raises:
    ImportError: verifiers is not installed (naming the command that installs it).
    ValueError: a taskset that does not import or is not a taskset, options its config refuses,
      num_tasks < 1 or None for an infinite taskset, an empty taskset, a taskset with toolsets, an
      Env with more than one agent seat, a harness other than "null" (or a `null` harness whose
      packages do not import here) without uv, timeout not a number of seconds in (0, 1e6).
    RuntimeError: verifiers' servers (its Env's `start`) raised or did not start within timeout.
  """

  def __init__(self, taskset: str, *, num_tasks: int | None = None, taskset_options: dict | None = None,
               harness: str = "null", timeout: float = 300.0, uv: bool = False):
    vf = import_optional("verifiers.v1", INSTALL)
    from verifiers.v1.clients import ModelContext
    from verifiers.v1.configs.client import TrainClientConfig
    from verifiers.v1.interception.server import InterceptionServerConfig
    from verifiers.v1.runtimes.subprocess import SubprocessConfig
    from verifiers.v1.utils import loaders
    if num_tasks is not None and (not isinstance(num_tasks, int) or isinstance(num_tasks, bool) or num_tasks < 1):
      raise ValueError(f"VerifiersEnv: num_tasks={num_tasks!r} must be an int >= 1 or None")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < 1e6:
      raise ValueError(f"VerifiersEnv: timeout={timeout!r} must be a number of seconds in (0, 1e6)")
    if harness != "null" and not uv:
      raise ValueError(f"VerifiersEnv: harness={harness!r} runs only through uv (downloads); pass uv=True, or use "
                       "harness='null', which runs offline with this Python")
    options = dict(taskset_options or {})
    if "id" in options:
      raise ValueError(f"VerifiersEnv: taskset_options names an id ({options['id']!r}); the taskset is `taskset`")
    if not isinstance(taskset, str) or not taskset:
      raise ValueError(f"VerifiersEnv: taskset={taskset!r} must be a verifiers taskset id (a module name)")
    try:
      vf.import_taskset(taskset)
      env_cls, config_cls = vf.environment_class(taskset), vf.env_config_type(taskset)
      loaders.taskset_class(taskset)
    except (ImportError, TypeError, AttributeError, ValueError) as e:
      raise ValueError(f"VerifiersEnv: taskset={taskset!r} is not a verifiers taskset: {e}") from e
    seats = [n for n, f in config_cls.model_fields.items() if isinstance(f.default, vf.AgentConfig)]
    if len(seats) != 1:
      raise ValueError(f"VerifiersEnv: {env_cls.__name__} has agent seats {seats}; only single-agent environments run")
    seat = {"harness": {"id": harness}, "runtime": SubprocessConfig().model_dump()}
    try:
      config = config_cls.model_validate({"taskset": {"id": taskset, **options}, seats[0]: seat,
                                          "interception": InterceptionServerConfig().model_dump()})
    except ValueError as e:   # pydantic's ValidationError
      raise ValueError(f"VerifiersEnv: taskset_options={options!r} for {taskset!r}: {e}") from e
    self.env = env_cls(config)
    taskset_obj = self.env.taskset
    tools = [*type(taskset_obj).toolsets(taskset_obj.config),
             *type(taskset_obj).task_type().toolsets(taskset_obj.config.task)]
    if tools:
      raise ValueError(f"VerifiersEnv: taskset={taskset!r} has toolsets ({len(tools)}); tool calls through verifiers "
                       "are not supported by this adapter")
    if num_tasks is None and getattr(taskset_obj, "INFINITE", False):
      raise ValueError(f"VerifiersEnv: taskset={taskset!r} is infinite; set num_tasks")
    self.tasks = list(itertools.islice(taskset_obj, num_tasks))
    if not self.tasks:
      raise ValueError(f"VerifiersEnv: taskset={taskset!r} has no tasks")
    self.taskset, self.timeout, self.task, self.last_episode = taskset, float(timeout), None, None
    self.offline = not uv and _run_chat_program_with_this_python()
    if not uv and not self.offline:
      raise ValueError("VerifiersEnv: the `null` harness's packages do not all import with this Python, so it would "
                       f"run only through uv (downloads); reinstall with `{INSTALL}`, or pass uv=True")
    # The endpoint is never called: the interception server's client for it is ours (_serve).
    self._ctx = ModelContext(model="policy", client=TrainClientConfig(base_url="http://127.0.0.1:9/v1"))
    self._events: queue.Queue = queue.Queue()
    self._episode, self._n, self._pending, self._history, self._closed = None, 0, None, [], False
    self._tokens = None   # the next step's (prompt ids, completion ids, log-probs), `turn_tokens`
    self._task = None   # the asyncio task of the episode in flight (set on the loop's thread, `_run`)
    self._loop = asyncio.new_event_loop()
    self._thread = threading.Thread(target=self._loop.run_forever, name="verifiers", daemon=True)
    self._thread.start()
    self._started, self._up = threading.Event(), False
    self._serving = asyncio.run_coroutine_threadsafe(self._serve(), self._loop)
    self._serving.add_done_callback(lambda f: self._started.set())   # a start that raised wakes the wait too
    error = None
    if not self._started.wait(self.timeout):
      error = RuntimeError(f"VerifiersEnv: verifiers' servers for {taskset!r} did not start within {self.timeout:g} s")
    elif self._serving.done():   # _serve ended before serving: its start raised
      cause = self._serving.exception()
      error = RuntimeError(f"VerifiersEnv: starting verifiers' servers for {taskset!r} raised {cause!r}")
      error.__cause__ = cause
    if error is not None:
      self.close()
      raise error

  async def _serve(self):
    from verifiers.v1.clients import Client
    from verifiers.v1.clients.train import serialize_completion
    from verifiers.v1.dialects import ChatDialect
    from verifiers.v1.types import AssistantMessage, Response, TurnTokens, Usage

    owner = self

    class SamplerClient(Client):
      """The harness's model: each call waits for the episode sampler's turn (VerifiersEnv.step)."""

      async def get_response(self, dialect, body, sampling, session_id=None, turn=None, headers=None):
        if not isinstance(dialect, ChatDialect):
          raise ValueError(f"VerifiersEnv: the harness calls the {type(dialect).__name__}; only chat completions run")
        reply = asyncio.get_running_loop().create_future()
        owner._events.put(("call", owner._n, (body, reply)))
        content, tokens = await reply
        usage = None if tokens is None else Usage(prompt_tokens=len(tokens[0]), completion_tokens=len(tokens[1]))
        response = Response(id=f"turn-{len(owner._history)}", created=0, model=owner._ctx.model,
                            message=AssistantMessage(content=content), finish_reason="stop", usage=usage,
                            tokens=None if tokens is None else TurnTokens(
                                prompt_ids=tokens[0], completion_ids=tokens[1], completion_logprobs=tokens[2]))
        response.raw = serialize_completion(response, owner._ctx.model)
        return response

    self._stop = asyncio.Event()
    async with self.env.serving():
      self.env._interception.clients[self._ctx.client.model_dump_json()] = SamplerClient()
      self._up = True
      self._started.set()
      await self._stop.wait()

  async def _run(self, task):
    self._task = asyncio.current_task()
    return await self.env.run_episode(task, self._ctx)

  async def _cancel_episode(self):
    task, self._task = self._task, None
    if task is not None and not task.done():
      task.cancel()
      await asyncio.gather(task, return_exceptions=True)

  def _next(self, what: str):
    while True:
      try:
        kind, n, payload = self._events.get(timeout=self.timeout)
      except queue.Empty:
        raise RuntimeError(f"VerifiersEnv: no model call and no end of the episode within {self.timeout:g} s "
                           f"({what}; taskset {self.taskset!r})") from None
      if n == self._n:
        return kind, payload
      if kind == "call":   # a model call of an abandoned episode: answered with an error, as `_abandon` does
        self._loop.call_soon_threadsafe(_fail, payload[1])

  def _abandon(self):
    """End the episode in flight, if any: its model calls are answered with an error, so the harness
    exits and verifiers tears the episode down its own way (the harness subprocess, the runtime's
    directory); cancelled only if it has not ended within timeout."""
    if self._episode is None:
      return
    if self._pending is not None:
      self._loop.call_soon_threadsafe(_fail, self._pending)
    self._pending, self._tokens, deadline = None, None, time.monotonic() + self.timeout
    while not self._episode.done():
      try:
        kind, _, payload = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
      except queue.Empty:
        break
      if kind == "call":
        self._loop.call_soon_threadsafe(_fail, payload[1])
    if not self._episode.done():
      asyncio.run_coroutine_threadsafe(self._cancel_episode(), self._loop).result(self.timeout)
    self._episode = None

  def reset(self, problem: Any) -> list[dict[str, str]]:
    """Start the episode of the problem's task; returns the messages of the harness's first model call."""
    if self._closed:
      raise RuntimeError("VerifiersEnv.reset: the environment is closed")
    self._abandon()
    task = self.task = self.tasks[game_seed(problem, "VerifiersEnv") % len(self.tasks)]
    self._n += 1
    n = self._n
    self._episode = asyncio.run_coroutine_threadsafe(self._run(task), self._loop)
    self._episode.add_done_callback(lambda f: self._events.put(("end", n, f)))
    kind, payload = self._next("the first model call")
    if kind == "end":
      episode = self._ended(payload)
      raise RuntimeError(f"VerifiersEnv: the episode of task {task.data.idx} ended before any model call "
                         f"(traces {len(episode.traces)})")
    body, self._pending = payload
    self._history = chat_messages(body)
    return [dict(m) for m in self._history]

  def _ended(self, future):
    try:
      episode = self.last_episode = future.result()
    except (asyncio.CancelledError, concurrent.futures.CancelledError) as e:
      raise RuntimeError(f"VerifiersEnv: the episode of taskset {self.taskset!r} was cancelled") from e
    errors = list(episode.errors) + [e for t in episode.traces for e in (t.errors or [])]
    if errors:
      raise RuntimeError(f"VerifiersEnv: the episode recorded {len(errors)} error(s); the first: "
                         f"{errors[0].type}: {errors[0].message}")
    return episode

  def step(self, assistant_message: str):
    """The model's turn as the pending call's reply; returns (observation, 0.0, False) at the next model
    call, or (None, the episode's reward, True) at its end.

    Raises:
      TypeError: a message that is not a str. RuntimeError: no call is waiting (before reset, after the
        episode's end, after close); see the module docstring for the rest.
    """
    if not isinstance(assistant_message, str):
      raise TypeError(f"VerifiersEnv.step: assistant_message is a {type(assistant_message).__name__}, not a str")
    if self._pending is None or self._closed:
      raise RuntimeError("VerifiersEnv.step: no model call is waiting; call reset first")
    self._loop.call_soon_threadsafe(_reply, self._pending, (assistant_message, self._tokens))
    self._pending, self._tokens = None, None
    self._history.append({"role": "assistant", "content": assistant_message})
    kind, payload = self._next(f"after turn {sum(m['role'] == 'assistant' for m in self._history)}")
    if kind == "end":
      episode = self._ended(payload)
      self._episode = None
      return None, float(sum(t.reward for t in episode.traces)), True
    body, self._pending = payload
    messages = chat_messages(body)
    k = len(self._history)
    if messages[:k] != self._history or len(messages) == k:
      raise ValueError(f"VerifiersEnv: the harness's model call does not extend the episode's {k} messages (a "
                       "harness that rewrites or compacts its history cannot train token-in, token-out)")
    self._history = messages
    return [dict(m) for m in messages[k:]], 0.0, False

  def turn_tokens(self, prompt_ids, completion_ids, completion_logprobs):
    """The next step's turn as sampled (`run_episode` calls it before `step`): the response to the
    harness's call carries them (verifiers' `TurnTokens`: prompt ids, completion ids with the stop id,
    their log-probs; `Usage` counts), so verifiers' trace holds the ids we sampled and train, never a
    re-tokenization. A step without it answers with the text alone."""
    self._tokens = ([int(i) for i in prompt_ids], [int(i) for i in completion_ids],
                    [float(x) for x in completion_logprobs])

  def close(self):
    """End an episode in flight and wait for its teardown (`_abandon`), stop verifiers' servers, the
    adapter's thread and its event loop (idempotent; reset raises afterwards)."""
    if self._closed:
      return
    self._closed = True
    if self._thread.is_alive():
      try:
        self._abandon()
        if self._up:
          self._loop.call_soon_threadsafe(self._stop.set)
          self._serving.result(timeout=self.timeout)
        else:   # a start that hangs: cancelled
          self._serving.cancel()
      except BaseException:   # noqa: BLE001 - shutting down; what failed was reported where it happened
        pass
      self._loop.call_soon_threadsafe(self._loop.stop)
      self._thread.join(timeout=self.timeout)
    if not self._thread.is_alive():
      self._loop.run_until_complete(self._loop.shutdown_default_executor())
      self._loop.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _reply(future, content):
  if not future.done():
    future.set_result(content)


def _fail(future):
  if not future.done():
    future.set_exception(RuntimeError("VerifiersEnv: the trainer ended this episode (a token budget or a reset)"))
