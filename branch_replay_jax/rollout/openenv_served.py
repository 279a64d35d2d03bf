"""An OpenEnv environment served by OpenEnv's own server, behind our protocol: `ServedOpenEnv`
(docs/design.md, "Episodes"), and `openenv_environment`, what `rollout.episodes.environment = "openenv:..."`
makes (rollout/environments.py): a URL -> `ServedOpenEnv`, anything else -> the in-process
`rollout.openenv_env.OpenEnvEnv`.

OpenEnv (openenv-core 0.3.0) serves an environment class with `openenv.core.env_server.create_app` (its
Docker images, a Hugging Face Space, `uvicorn` on a host): a WebSocket endpoint (/ws) that keeps one
environment per session, and GET /schema with the JSON schemas of its Action and Observation. The adapter
talks through OpenEnv's own `GenericEnvClient` (the protocol, its message types and error codes are
OpenEnv's and move with its releases) and chooses its fields from the schemas by `OpenEnvEnv`'s rules.

    env = ServedOpenEnv("http://localhost:8000", system="Play well.")
    result = run_episode(env, seed, 0, tokenizer, sampler, max_turns=4, max_turn_tokens=32, max_context=2048)
"""

from __future__ import annotations

import functools
import http.client
import json
import numbers
import re
import urllib.parse
import urllib.request
from typing import Any, Callable

from branch_replay_jax.rollout.adapters import first_messages, game_seed, import_optional
from branch_replay_jax.rollout.environments import EpisodeEnd
from branch_replay_jax.rollout.openenv_env import (BASE_FIELDS, INSTALL, OpenEnvEnv, step_outcome, tool_schemas,
                                                   tool_turn, tools_first_messages)

URL_SCHEMES = ("http://", "https://", "ws://", "wss://")
# A server whose Action is one of these hosts an MCP environment (`create_app(env, Action, ...)`): OpenEnv's server
# then takes {"type": "list_tools"} and {"type": "call_tool", ...} as steps (its `deserialize_action`), nothing else.
MCP_ACTIONS = ("Action", "CallToolAction", "ListToolsAction")


def openenv_environment(target, **options):
  """rollout.episodes.environment = "openenv:TARGET": a URL (`URL_SCHEMES`, any case) ->
  `ServedOpenEnv(TARGET, **options)`, anything else -> `OpenEnvEnv(TARGET, **options)`."""
  if isinstance(target, str) and target.lower().startswith(URL_SCHEMES):
    return ServedOpenEnv(target, **options)
  return OpenEnvEnv(target, **options)


def _is_str(schema: dict) -> bool:
  """A JSON-schema property that holds text: type string, or anyOf with a string (Optional[str])."""
  return schema.get("type") == "string" or any(s.get("type") == "string" for s in schema.get("anyOf", ()))


class ServerError(Exception):
  """An error response of OpenEnv's server: its `code` (WSErrorCode: VALIDATION_ERROR, EXECUTION_ERROR,
  CAPACITY_REACHED, ...), `message` and, for a validation error, pydantic's `errors` (each with a `loc`)."""

  def __init__(self, data: dict):
    self.code, self.message, self.errors = data.get("code", "UNKNOWN"), data.get("message", ""), data.get("errors", [])
    details = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}" for e in self.errors)
    super().__init__(f"{self.message} (code: {self.code}{'; ' + details if details else ''})")


@functools.cache
def _client_class():
  """`GenericEnvClient` whose error responses raise `ServerError` with the server's code and errors (the stock
  client raises a RuntimeError with the message alone, dropping the errors that tell an Action's refusal of
  the text from the environment's own validation error). Overrides `_send_and_receive`, openenv-core 0.3.0's
  one place that reads a response (the version INSTALL pins)."""
  from openenv.core.generic_client import GenericEnvClient

  class Client(GenericEnvClient):
    async def _send_and_receive(self, message):
      await self._send(message)
      response = await self._receive()
      if response.get("type") == "error":
        raise ServerError(response.get("data", {}))
      return response

  return Client


class ServedOpenEnv:
  """An OpenEnv environment served by OpenEnv's own server, as an `Environment`, one WebSocket session
  per episode: opened by reset, closed by `end_episode` (which `run_episode` calls however the episode
  ended). An object so holds at most one of the server's sessions, and only while an episode plays: a
  run's training and held-out evaluation environments (two objects) take turns on a server that allows
  one session (OpenEnv's default). The server builds its environment per session, so a slow constructor
  is paid per episode. `OpenEnvEnv`'s mapping (rollout/openenv_env.py), read on the server's dicts:

    reset(problem) -> reset(seed=game_seed(problem)); [system?, user: observation[observation_field]]. The
                      server passes `seed` on only when the environment's reset takes it, and cannot say
                      whether it did: a game is as reproducible as the environment makes its seed.
    step(message)  -> step({action_field: message}): not done: ([user: its text], its reward, False);
                      done: (None, its reward, True); a reward of None counts 0
    text the server's Action refuses (VALIDATION_ERROR whose every error is at action_field)
                   -> `EpisodeEnd("invalid_action", the errors)`, reward 0
    any other error (the environment raised, its own validation error, a timeout, a lost connection)
                   -> RuntimeError naming the URL and the server's message and code; run_episode stops
                      the step naming the problem
    a server that hosts an MCP environment (its Action OpenEnv's base, `MCP_ACTIONS`): `OpenEnvEnv`'s tools
                      mapping (`tool_turn`): the tools listed at reset ({"type": "list_tools"}), each tool call
                      a {"type": "call_tool"} step; a turn without a call ends the episode (reward 0): such a
                      server takes no Action of the environment's own

  Args:
    url: the server's base URL, http(s):// or ws(s)://, without a query (a trailing /ws is the client's
      own endpoint and taken off).
    action_field: the Action's str field that receives the model's text; None: its one str field
      (`metadata` aside).
    observation_field: the observation's str field shown to the model, or a function observation (dict)
      -> str; None: its one str field (`done`, `reward`, `metadata` aside).
    system: a system message before the first observation, or None.
    connect_timeout_s: seconds for GET /schema's connection and each read, and the WebSocket's opening.
    message_timeout_s: seconds for a reply to reset or step.

  Attributes:
    env_id: the URL. action_field, observation_field: the fields chosen (action_field None for an MCP server).
    mcp: whether the server takes tool calls; tools: {name: schema} as the last reset listed them. observation:
    the last observation (the server's dict, without `metadata`, which OpenEnv's server does not send), or None.
    client: the episode's session (OpenEnv's sync client), None between episodes.

  Raises:
    ImportError: openenv-core is not installed (naming the package and the install commands).
    ValueError: at construction, before any model loads, naming the URL: a URL of another scheme or with
      a query; a timeout that is not a number > 0; no OpenEnv server answering GET /schema; an
      action_field or observation_field that is not a str field of the server's Action or Observation
      (or several candidates and none named); an Action with other required fields. (On reset) a problem
      that is not a seed, an observation already done (its session closed).
  """

  def __init__(self, url: str, *, action_field: str | None = None,
               observation_field: str | Callable[[dict], str] | None = None, system: str | None = None,
               connect_timeout_s: float = 10.0, message_timeout_s: float = 60.0):
    import_optional("openenv.core", INSTALL)
    if not (isinstance(url, str) and url.lower().startswith(URL_SCHEMES)):
      raise ValueError(f"ServedOpenEnv: url={url!r} must start with one of {URL_SCHEMES}")
    parts = urllib.parse.urlsplit(url)
    if parts.query or parts.fragment:
      raise ValueError(f"ServedOpenEnv: url={url!r} has a query or fragment; give the server's base URL")
    for name, value in (("connect_timeout_s", connect_timeout_s), ("message_timeout_s", message_timeout_s)):
      if not (isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0):
        raise ValueError(f"ServedOpenEnv({url!r}): {name}={value!r} must be a number of seconds > 0")
    self.env_id, self.system, self.observation, self.client = url, system, None, None
    self._base = re.sub(r"/ws/?$", "", url.rstrip("/"))
    self._timeouts = (float(connect_timeout_s), float(message_timeout_s))
    schemas = self._schemas()
    action, observation = schemas.get("action", {}), schemas.get("observation", {})
    self.mcp, self.tools = action.get("title") in MCP_ACTIONS, {}
    if self.mcp and action_field is not None:
      raise ValueError(f"ServedOpenEnv({url!r}): action_field={action_field!r}: the server takes tool calls only "
                       f"(its Action is {action.get('title')})")
    self.action_field = None if self.mcp else self._field(action, action_field, ("metadata",), "action_field",
                                                          "Action")
    others = [] if self.mcp else sorted(set(action.get("required", ())) - {self.action_field})
    if others:
      raise ValueError(f"ServedOpenEnv({url!r}): the server's Action ({action.get('title')}) also needs {others}, "
                       "which the model's text does not fill")
    self.observation_field = (observation_field if callable(observation_field) else
                              self._field(observation, observation_field, BASE_FIELDS, "observation_field",
                                          "Observation"))
    self._Client = _client_class()

  def _schemas(self) -> dict:
    """The server's GET /schema: {"action": JSON schema, "observation": ..., "state": ...}."""
    scheme, rest = self._base.split("://", 1)
    plain = {"ws": "http", "wss": "https"}.get(scheme.lower(), scheme.lower())
    where = f"{plain}://{rest}/schema"
    try:
      with urllib.request.urlopen(where, timeout=self._timeouts[0]) as response:
        schemas = json.load(response)
    except (OSError, ValueError, http.client.HTTPException) as e:   # URLError, HTTPError, timeouts, a cut reply
      raise ValueError(f"ServedOpenEnv: no OpenEnv server answers at {self.env_id!r} (GET {where}: "
                       f"{type(e).__name__}: {e})") from None
    if not isinstance(schemas, dict):
      raise ValueError(f"ServedOpenEnv: GET {where} returned {str(schemas)[:80]!r}, not OpenEnv's schemas")
    return schemas

  def _field(self, schema: dict, name: str | None, skip, option: str, what: str) -> str:
    """`name`, checked to be a str property of the JSON `schema`, or its one str property outside `skip`."""
    properties = schema.get("properties", {})
    strings = [n for n, p in properties.items() if _is_str(p)]
    if name is None:
      candidates = [n for n in strings if n not in skip]
      if len(candidates) != 1:
        raise ValueError(f"ServedOpenEnv({self.env_id!r}): the server's {what} ({schema.get('title')}) has the str "
                         f"fields {candidates}; name one with {option}=")
      return candidates[0]
    if name not in strings:
      raise ValueError(f"ServedOpenEnv({self.env_id!r}): {option}={name!r} is not a str field of the server's {what} "
                       f"({schema.get('title')}; its fields: {sorted(properties)})")
    return name

  def _call(self, what: str, *args, **kwargs):
    from websockets.exceptions import WebSocketException
    try:
      result = getattr(self.client, what)(*args, **kwargs)   # connects on its first message
    except ServerError as e:
      if (what == "step" and e.code == "VALIDATION_ERROR" and e.errors and
          all(tuple(err.get("loc", ()))[:1] == (self.action_field,) for err in e.errors)):
        raise EpisodeEnd("invalid_action", f"{self.env_id}: the server's Action refused the text ({e})") from None
      raise RuntimeError(f"ServedOpenEnv({self.env_id!r}): {what} failed: {e}") from None
    except TimeoutError:
      self.end_episode()   # a late reply would answer the next message of this session
      raise RuntimeError(f"ServedOpenEnv({self.env_id!r}): {what} got no reply within message_timeout_s="
                         f"{self._timeouts[1]:g}") from None
    except (ConnectionError, OSError, WebSocketException) as e:
      self.end_episode()
      raise RuntimeError(f"ServedOpenEnv({self.env_id!r}): {what} failed: {type(e).__name__}: {e}") from e
    self.observation = result.observation
    return result

  def _text(self, observation: dict) -> str:
    field = self.observation_field
    text = field(observation) if callable(field) else observation.get(field)
    if not isinstance(text, str):
      raise ValueError(f"ServedOpenEnv({self.env_id!r}): observation_field={field!r} gave {str(text)[:80]!r} for "
                       f"the observation (fields {sorted(observation)}), not text")
    return text

  def reset(self, problem: Any) -> list[dict[str, str]]:
    """A new episode on the server, in a new session, with seed `game_seed(problem)`; see the class docstring."""
    seed = game_seed(problem, "ServedOpenEnv")
    self.end_episode()
    self.client = self._Client(base_url=self._base, connect_timeout_s=self._timeouts[0],
                               message_timeout_s=self._timeouts[1]).sync()
    result = self._call("reset", seed=seed)
    text = self._text(result.observation)
    if result.done:
      self.end_episode()
      raise ValueError(f"ServedOpenEnv({self.env_id!r}): reset returned an observation that is already done")
    if not self.mcp:
      return first_messages(self.system, text)
    listed = self._call("step", {"type": "list_tools"}).observation.get("tools")
    if not listed:
      self.end_episode()
      raise ValueError(f"ServedOpenEnv({self.env_id!r}): the server lists no tools; an environment that takes tool "
                       "calls needs at least one")
    self.tools = tool_schemas(listed)
    return tools_first_messages(self.tools, self.system, text)

  def step(self, assistant_message: str):
    """Play the model's message as the action (or its tool calls); see the class docstring for what comes back."""
    if self.client is None:
      raise RuntimeError(f"ServedOpenEnv({self.env_id!r}): step before reset (or after end_episode)")
    if self.mcp:
      def call_tool(name, arguments):
        result = self._call("step", {"type": "call_tool", "tool_name": name, "arguments": arguments})
        return result.observation.get("result"), result.observation.get("error"), result.reward, result.done
      return tool_turn(self.env_id, assistant_message, self.tools, call_tool, None)
    result = self._call("step", {self.action_field: assistant_message})
    return step_outcome(result.reward, result.done, lambda: self._text(result.observation))

  def end_episode(self) -> None:
    """Close the episode's session, if one is open (the server drops its environment); idempotent."""
    from websockets.exceptions import WebSocketException
    client, self.client = self.client, None
    if client is not None:
      try:
        client.close()
      except (ServerError, RuntimeError, OSError, TimeoutError, WebSocketException):   # a session already ended
        pass

  def close(self) -> None:
    """`end_episode`: the object holds nothing else."""
    self.end_episode()
