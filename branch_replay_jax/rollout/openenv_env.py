"""An OpenEnv environment behind our protocol: `OpenEnvEnv` (docs/design.md, "Episodes"; README,
"Bring an environment").

OpenEnv (https://github.com/meta-pytorch/OpenEnv, `openenv-core` 0.3.0; `make install` puts it in
with `--no-deps`, see the Makefile) serves an environment over HTTP / WebSocket from a Docker
container, but the environment itself is an in-process class: a subclass of
`openenv.core.env_server.interfaces.Environment` with `reset(seed=None, episode_id=None, **kwargs)`
and `step(action)`, each returning an `Observation` (a pydantic model with `done`, `reward`,
`metadata` and the environment's own fields), and a `state` property. The adapter runs that class in
this process, offline: no server, no container, no client. openenv-core 0.3.0 ships no concrete
environment (its environments, echo_env, textarena_env, ..., are separate packages in the OpenEnv
repository; the package has only the base classes and a template of the echo environment), so the
adapter takes yours (or one of those, installed): an instance, a subclass, or a factory that
returns one. tests/oe_guess.py is a small one (a number-guessing game) that the tests play.

    env = OpenEnvEnv(GuessNumberEnvironment(high=10))            # an instance
    env = OpenEnvEnv("my_envs.guess:GuessNumberEnvironment", high=10, system="Play well.")
    result = run_episode(env, seed, 0, tokenizer, sampler, max_turns=4, max_turn_tokens=32, max_context=2048)

In the training loop: `rollout.episodes.environment = "openenv:package.module:NAME"` (or
`"openenv:FILE.py:NAME"`), NAME an `Environment` subclass or a factory, built with
`rollout.episodes.env_options` as keyword arguments (the adapter's own options below taken out).

An environment that runs elsewhere, served by OpenEnv's own server (a Docker container, a Hugging
Face Space, `uvicorn` on a host), is rollout/openenv_served.py's `ServedOpenEnv`, in the loop
`rollout.episodes.environment = "openenv:http://HOST:PORT"`: the mapping below, read on the server's dicts.

What maps to what:

    reset(problem) -> env.reset(seed=game_seed(problem)) (with no seed when the environment's reset
                      takes none); [system?, user: the observation's text]; an observation that is
                      already done is refused (ValueError)
    step(message)  -> env.step(Action built from the model's text) -> observation: not done:
                      ([user: its text], its reward, False); done: (None, its reward, True).
                      OpenEnv's reward is the last action's (None counts 0); the episode's reward
                      is their sum (run_episode), the environment's own values.
    the model's text that the Action class refuses (pydantic's validation: a field's length,
    pattern, ...; or a factory's ValidationError)
                   -> `EpisodeEnd("invalid_action", the validation error)`: marked, reward 0 (a
                      factory may raise `EpisodeEnd` itself for text it cannot parse)
    anything the environment raises
                   -> run_episode stops with a RuntimeError naming the problem's index

Tools (MCP, OpenEnv's RFC 003): an environment whose step takes `CallToolAction` (an `MCPEnvironment`, or
one whose step annotates a Union with it) exposes tools; the adapter then plays the model's tool calls
(rollout/tools.py's JSON format) as OpenEnv's actions:

    reset(problem) -> as above, the system message listing the tools' schemas (`ListToolsAction`, once per
                      reset; `tools_system_prompt`'s text) before `system`
    step(message)  -> each tool call: env.step(CallToolAction(name, arguments)) -> a "tool" message with the
                      result's text; the turn's reward the sum of the calls' (None counts 0); a call whose
                      observation is done ends the episode (None, reward, True)
                      no tool call (a final answer): the environment's own Action, built from the text as
                      below (inferred from step's Union or `_step_impl`), else the episode ends: (None, 0, True)
    a call that does not parse or names no listed tool
                   -> `EpisodeEnd("malformed_tool_call")`; a call whose observation has an error (OpenEnv's
                      `ToolError`, or a result marked is_error) -> `EpisodeEnd("tool_error")`, as `ToolEnv`'s

Served (`ServedOpenEnv`), a server hosting an MCP environment takes tool calls only: a final answer ends the episode.

The Action: `action` names it, an `Action` subclass (or its import path) whose `action_field` (a
str field; None: the class's one field annotated `str`, `metadata` aside) receives the model's
decoded turn, or a factory text -> Action; None: the class the environment's `step` annotates its
action with, else the first argument of its `Environment[ActT, ObsT, StateT]` base. The text: the
observation's `observation_field` (None: its class's one field annotated `str`, `metadata` aside),
or a function observation -> str. A class with several str fields is refused, naming them and the
option that picks one.

Seeds: a problem is `game_seed(problem)` (an int as itself; in the loop the task entry's "seed", else
the CRC-32 of its question), passed as reset's `seed` when the environment's reset takes one (a
`seed` parameter or **kwargs): then a game is as reproducible as the environment makes its seed.
One whose reset takes no seed is reset without one and plays whatever it draws (`seeded` says
which). The environment's draws from Python's `random` and NumPy's global generator use states of
the adapter's own, swapped in around each call (as TextArena's and GEM's adapters do), so they depend
only on the seed and the actions, and other code's use of the global generators neither moves nor is
moved by them.
"""

from __future__ import annotations

import inspect
import json
import typing
from typing import Any, Callable

from branch_replay_jax.rollout.adapters import OwnRandom, first_messages, game_seed, import_optional
from branch_replay_jax.rollout.environments import EpisodeEnd
from branch_replay_jax.rollout.tasks.rewards import resolve
from branch_replay_jax.rollout.tools import ToolCallError, parse_tool_calls, schemas_system_prompt

VERSION = "0.3.0"
INSTALL = (f"pip install --no-deps openenv-core=={VERSION} && pip install 'fastapi>=0.104' 'fastmcp>=3' "
           "(make install does)")
BASE_FIELDS = ("done", "reward", "metadata")


def step_outcome(reward, done: bool, text: Callable[[], str]):
  """`Environment.step`'s (observation, reward, done) of an OpenEnv step: OpenEnv's reward (None counts 0);
  not done: [user: text()], done: None (the module docstring's mapping, in process and served)."""
  reward = 0.0 if reward is None else float(reward)
  return (None, reward, True) if done else ([{"role": "user", "content": text()}], reward, False)


def _str_fields(cls, skip=BASE_FIELDS) -> list[str]:
  """The fields of pydantic model `cls` annotated `str` (those of OpenEnv's base classes left out)."""
  return [name for name, f in getattr(cls, "model_fields", {}).items() if name not in skip and f.annotation is str]


def _action_hints(env, method: str) -> tuple:
  """The classes `type(env).<method>` annotates its action with (a Union's members), or ()."""
  fn = getattr(type(env), method, None)
  try:
    hint = typing.get_type_hints(fn).get("action") if fn is not None else None
  except Exception:   # an annotation that does not resolve (a forward reference, a name not imported)
    hint = None
  return typing.get_args(hint) or (hint,)


def _takes_tool_calls(env) -> bool:
  """Whether env plays MCP tool calls: an `MCPEnvironment`, or a step that annotates `CallToolAction`."""
  from openenv.core.env_server.mcp_environment import MCPEnvironment
  from openenv.core.env_server.mcp_types import CallToolAction
  return isinstance(env, MCPEnvironment) or CallToolAction in _action_hints(env, "step")


def _action_class(env, Action):
  """The environment's own Action subclass (not OpenEnv's base nor its MCP actions): the one `type(env).step`
  annotates (or a member of its Union), then `_step_impl`'s (an MCPEnvironment's), else the first argument of
  its Environment[...] base; None when there is none."""
  from openenv.core.env_server.mcp_types import CallToolAction, ListToolsAction
  own = lambda cls: (isinstance(cls, type) and issubclass(cls, Action) and cls is not Action
                     and not issubclass(cls, (CallToolAction, ListToolsAction)))
  for method in ("step", "_step_impl"):
    for cls in _action_hints(env, method):
      if own(cls):
        return cls
  for cls in type(env).__mro__:
    for base in getattr(cls, "__orig_bases__", ()):
      args = typing.get_args(base)
      if args and own(args[0]):
        return args[0]
  return None


def _get(x, name: str):
  """x's field `name`: a dict's key (a served environment's observation) or an object's attribute (in process)."""
  return x.get(name) if isinstance(x, dict) else getattr(x, name, None)


def result_text(result) -> str:
  """A tool result as the "tool" message's text: a str as is, fastmcp's `CallToolResult` (or its dict, served) the
  text of its content items (one per line), None "", anything else its JSON."""
  if isinstance(result, str):
    return result
  content = _get(result, "content") if result is not None else None
  if isinstance(content, list):
    return "\n".join(_get(item, "text") or str(item) for item in content)
  return "" if result is None else json.dumps(result, default=str)


def tool_schemas(tools) -> dict[str, dict]:
  """{name: schema in `Tool.schema`'s format} of a `ListToolsObservation`'s tools (objects or, served, dicts)."""
  return {_get(t, "name"): {"type": "function", "function": {
      "name": _get(t, "name"), "description": _get(t, "description"), "parameters": _get(t, "input_schema")}}
      for t in tools}


def tools_first_messages(tools: dict, system: str | None, text: str) -> list[dict[str, str]]:
  """An MCP environment's reset messages (the module docstring's mapping, in process and served): the system
  message listing `tools`' schemas (`tool_schemas`), then `system` if given, then the observation's text."""
  listed = schemas_system_prompt(list(tools.values()))
  return first_messages(f"{listed}\n\n{system}" if system else listed, text)


def tool_turn(env_id: str, text: str, tools: dict, call_tool: Callable, final_answer: Callable | None):
  """`Environment.step`'s (observation, reward, done) of a turn on an environment's MCP tools (the module
  docstring's mapping, in process and served): call_tool(name, arguments) -> the call's observation's (result,
  error, reward, done); final_answer(text) plays a turn without a call, None ends the episode (reward 0)."""
  try:
    calls = parse_tool_calls(text, tools)
  except ToolCallError as e:
    raise EpisodeEnd("malformed_tool_call", f"{env_id}: {e}") from None
  if not calls:
    return (None, 0.0, True) if final_answer is None else final_answer(text)
  out, reward = [], 0.0
  for call in calls:
    result, error, call_reward, done = call_tool(call.name, call.arguments)
    if error is not None or (result is not None and _get(result, "is_error")):
      why = _get(error, "message") if error is not None else result_text(result)
      raise EpisodeEnd("tool_error", f"{env_id}: {call.name}: {why}")
    reward += 0.0 if call_reward is None else float(call_reward)
    if done:
      return None, reward, True
    out.append({"role": "tool", "content": result_text(result)})
  return out, reward, False


class OpenEnvEnv(OwnRandom):
  """An in-process OpenEnv environment as an `Environment` (see the module docstring for the mapping).

  Args:
    env: an `openenv.core.env_server.interfaces.Environment` instance; a subclass of it, or a factory
      returning an instance, built with `env_kwargs`; or the import path of either ("package.module:NAME",
      "FILE.py:NAME"; `rollout.tasks.rewards.resolve`'s rules).
    action: the environment's Action subclass (or its import path), or a factory text -> Action; None:
      inferred from the environment (module docstring).
    action_field: the str field of the Action class that receives the model's text; None: the class's
      one field annotated `str` (not with a factory).
    observation_field: the str field of the observations that is the text given to the model, or a
      function observation -> str; None: the observation class's one field annotated `str`.
    system: a system message before the first observation, or None.
    env_kwargs: keyword arguments of the class or factory (not with an instance).

  Attributes:
    env: the OpenEnv environment. env_id: its class name. action_class: its Action class (None with a
    factory, or for a tools-only environment). seeded: whether its reset takes the seed. mcp: whether it
    takes tool calls; tools: {name: schema} of its tools as the last reset listed them. observation: the last
    observation (OpenEnv's object, its fields and `metadata` for inspection; `env.state` is the environment's),
    or None.

  Raises:
    ImportError: openenv-core is not installed (naming the package and the install commands).
    ValueError: a path that does not resolve; `env` or what it builds not an OpenEnv Environment; no
      Action class to build (none inferred), an action_field not on it or not a str field, a class
      with several (or no) str fields and no action_field, other fields of it that need values;
      env_kwargs with an instance. (On reset) a problem that is not a seed (`game_seed`), an
      observation with no text field to show (or several), an observation already done.
  """

  def __init__(self, env, *, action=None, action_field: str | None = None,
               observation_field: str | Callable[[Any], str] | None = None, system: str | None = None,
               **env_kwargs):
    import_optional("openenv.core", INSTALL)   # imports its server's fastapi and fastmcp too
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action
    super().__init__()
    if isinstance(env, str):
      env = resolve(env, "OpenEnvEnv: env")
    if isinstance(env, Environment):
      if env_kwargs:
        raise ValueError(f"OpenEnvEnv: env_kwargs {sorted(env_kwargs)} are for a class or factory, not an instance")
    elif isinstance(env, type) and not issubclass(env, Environment):
      raise ValueError(f"OpenEnvEnv: env={env.__name__} is a class but not a subclass of OpenEnv's Environment "
                       "(openenv.core.env_server.interfaces.Environment)")
    elif callable(env):
      made = self._call(env, **env_kwargs)   # an environment may draw when it is built
      if not isinstance(made, Environment):
        raise ValueError(f"OpenEnvEnv: env={getattr(env, '__name__', env)!r} returned a {type(made).__name__}, "
                         "not an OpenEnv Environment")
      env = made
    else:
      raise ValueError(f"OpenEnvEnv: env={env!r} must be an OpenEnv Environment, a subclass of it, a factory or "
                       "an import path of one")
    self.env, self.env_id, self.system, self.observation = env, type(env).__name__, system, None
    self._observation_field = observation_field
    if isinstance(action, str):
      action = resolve(action, "OpenEnvEnv: action")
    self.mcp, self.tools = _takes_tool_calls(env), {}
    if action is None:
      action = _action_class(env, Action)
      if action is None and not self.mcp:
        raise ValueError(f"OpenEnvEnv: cannot tell {self.env_id}'s Action class (its step() does not annotate "
                         "one, nor its Environment[...] base); pass action= the class or a factory text -> Action")
    if action is None:   # tools only: a final answer ends the episode (module docstring)
      if action_field is not None:
        raise ValueError(f"OpenEnvEnv: action_field={action_field!r}: {self.env_id} has no Action of its own to "
                         "fill (its tools take the model's calls); pass action= too")
      self.action_class, self._make_action = None, None
    elif isinstance(action, type) and issubclass(action, Action):
      self.action_class, self._make_action = action, self._action_maker(action, action_field)
    elif isinstance(action, type) or not callable(action):
      raise ValueError(f"OpenEnvEnv: action={action!r} must be an OpenEnv Action subclass or a factory text -> "
                       "Action")
    elif action_field is not None:
      raise ValueError(f"OpenEnvEnv: action_field={action_field!r} is for an Action class, not a factory")
    else:
      self.action_class, self._make_action = None, action
    try:
      parameters = inspect.signature(env.reset).parameters.values()
    except (TypeError, ValueError):
      parameters = ()
    self.seeded = any(p.name == "seed" or p.kind == p.VAR_KEYWORD for p in parameters)

  def _action_maker(self, cls, field):
    fields = cls.model_fields
    if field is None:
      candidates = _str_fields(cls, ("metadata",))
      if len(candidates) != 1:
        raise ValueError(f"OpenEnvEnv: {cls.__name__} has the str fields {candidates}; name the one the model's "
                         "text goes into with action_field=")
      field = candidates[0]
    elif field not in fields or fields[field].annotation is not str:
      raise ValueError(f"OpenEnvEnv: action_field={field!r} is not a str field of {cls.__name__} "
                       f"(its fields: {sorted(fields)})")
    others = sorted(n for n, f in fields.items() if n != field and f.is_required())
    if others:
      raise ValueError(f"OpenEnvEnv: {cls.__name__} also needs {others}, which the model's text does not fill; pass "
                       "action= a factory text -> Action")
    return lambda text: cls(**{field: text})

  def _checked(self, observation, where: str):
    from openenv.core.env_server.types import Observation
    if not isinstance(observation, Observation):
      raise ValueError(f"OpenEnvEnv: {self.env_id}'s {where} returned a {type(observation).__name__}, not an OpenEnv "
                       "Observation")
    self.observation = observation
    return observation

  def _text(self, observation) -> str:
    field = self._observation_field
    if callable(field):
      text = field(observation)
      if not isinstance(text, str):
        raise ValueError(f"OpenEnvEnv: observation_field={field!r} returned a {type(text).__name__}, not text")
      return text
    if field is None:
      candidates = _str_fields(type(observation))
      if len(candidates) != 1:
        raise ValueError(f"OpenEnvEnv: {type(observation).__name__} has the str fields {candidates}; name the text "
                         "for the model with observation_field= (a field or a function observation -> str)")
      field = candidates[0]
    text = getattr(observation, field, None)
    if not isinstance(text, str):
      raise ValueError(f"OpenEnvEnv: observation_field={field!r}: {type(observation).__name__}.{field} is "
                       f"{str(text)[:80]!r}, not text")
    return text

  def reset(self, problem: Any) -> list[dict[str, str]]:
    """Reset the environment with seed `game_seed(problem)`; see the module docstring."""
    seed = game_seed(problem, "OpenEnvEnv")
    observation = self._checked(self._call(self.env.reset, **({"seed": seed} if self.seeded else {})), "reset")
    text = self._text(observation)
    if observation.done:
      raise ValueError(f"OpenEnvEnv: {self.env_id}'s reset returned an observation that is already done")
    if not self.mcp:
      return first_messages(self.system, text)
    self.tools = self._list_tools()
    return tools_first_messages(self.tools, self.system, text)

  def _list_tools(self) -> dict[str, dict]:
    """{name: schema} of the environment's MCP tools (`ListToolsAction`), in `Tool.schema`'s format."""
    from openenv.core.env_server.mcp_types import ListToolsAction
    listed = self._checked(self._call(self.env.step, ListToolsAction()), "step(ListToolsAction())")
    error = (listed.metadata or {}).get("error")
    if error or not getattr(listed, "tools", None):
      raise ValueError(f"OpenEnvEnv: {self.env_id} lists no tools ({error or 'an empty list'}); an environment "
                       "that takes tool calls needs at least one")
    return tool_schemas(listed.tools)

  def step(self, assistant_message: str):
    """Play the model's message (its tool calls, or it as the action); see the module docstring."""
    if not self.mcp:
      return self._play(assistant_message)
    from openenv.core.env_server.mcp_types import CallToolAction

    def call_tool(name, arguments):
      observation = self._checked(self._call(self.env.step, CallToolAction(tool_name=name, arguments=arguments)),
                                  "step")
      return (getattr(observation, "result", None), getattr(observation, "error", None), observation.reward,
              observation.done)
    return tool_turn(self.env_id, assistant_message, self.tools, call_tool,
                     None if self._make_action is None else self._play)

  def _play(self, assistant_message: str):
    """The model's message as the environment's own Action (the module docstring's mapping)."""
    from pydantic import ValidationError
    try:
      action = self._make_action(assistant_message)
    except ValidationError as e:   # the text does not fit the Action's fields
      why = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
      raise EpisodeEnd("invalid_action", f"{self.env_id}: {e.title} refused the text ({why})") from None
    observation = self._checked(self._call(self.env.step, action), "step")
    return step_outcome(observation.reward, observation.done, lambda: self._text(observation))

  def close(self) -> None:
    """The environment's close() (its resources; the adapter holds none of its own)."""
    self.env.close()
