"""OpenEnv environments for tests/test_openenv.py (openenv-core 0.3.0 ships none): real subclasses of
`openenv.core.env_server.interfaces.Environment`, run in process. Importable as "oe_guess" (tests/
is on sys.path), so `rollout.episodes.environment = "openenv:oe_guess:GuessNumberEnvironment"`.

`GuessNumberEnvironment`: the number is `random.randint(low, high)` after `random.seed(seed)` (the
global generator, as simple environments do, so the adapter's generator swap is exercised): for
seed s it is `random.Random(s).randint(low, high)`. A step reads the last integer of the message:
the number ends the game with reward 1; another number gets "Higher." / "Lower." (reward 0); a
message with no number gets "Answer with a number." and reward -0.1; the last of `max_guesses`
guesses without the number ends it (with that guess's reward). A step after the end raises RuntimeError.

`HintedGuessEnvironment`: the game with MCP tools (an `MCPEnvironment`, OpenEnv's RFC 003): `compare(number)`
answers "higher" / "lower" / "equal", `fail()` always raises; the final answer is a GuessAction
(`_step_impl`): the number ends the game with reward 1, another with 0. For seed s the number is
`random.Random(s).randint(1, high)`. `SubmitGuessEnvironment`: tools only (no Action of its own):
`submit(number)` ends the game with reward 1 for the number, else 0.
"""

import random
import re
from typing import Any, Optional

from fastmcp import FastMCP
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

PROMPT = "I picked a number from {low} to {high}. You have {n} guesses: answer with a number."


class GuessAction(Action):
  message: str = Field(..., max_length=64, description="the player's guess, in words or digits")


class GuessObservation(Observation):
  prompt: str = Field(default="", description="what the game says to the player")
  guesses_left: int = Field(default=0)


class GuessNumberEnvironment(Environment[GuessAction, GuessObservation, State]):
  """Guess a number in [low, high] in at most max_guesses guesses (module docstring)."""

  def __init__(self, low: int = 1, high: int = 10, max_guesses: int = 3):
    super().__init__()
    if not low <= high:
      raise ValueError(f"GuessNumberEnvironment: low={low} > high={high}")
    self.low, self.high, self.max_guesses = low, high, max_guesses
    self.number, self.guesses_left, self.over = None, 0, True
    self._state = State()

  def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> GuessObservation:
    if seed is not None:
      random.seed(seed)
    self.number, self.guesses_left, self.over = random.randint(self.low, self.high), self.max_guesses, False
    self._state = State(episode_id=episode_id, step_count=0)
    return GuessObservation(prompt=PROMPT.format(low=self.low, high=self.high, n=self.max_guesses),
                            guesses_left=self.guesses_left, done=False, reward=None)

  def step(self, action: GuessAction, timeout_s: Optional[float] = None, **kwargs: Any) -> GuessObservation:
    if self.over:
      raise RuntimeError("GuessNumberEnvironment: the game is over; reset it")
    self._state.step_count += 1
    self.guesses_left -= 1
    found = re.findall(r"-?\d+", action.message)
    if not found:
      text, reward, done = "Answer with a number.", -0.1, False
    elif int(found[-1]) == self.number:
      text, reward, done = "Correct!", 1.0, True
    else:
      text, reward, done = ("Higher." if int(found[-1]) < self.number else "Lower."), 0.0, False
    if not done and self.guesses_left == 0:
      text, done = f"Out of guesses; it was {self.number}.", True
    self.over = done
    return GuessObservation(prompt=text, guesses_left=self.guesses_left, done=done, reward=reward,
                            metadata={"number": self.number} if done else {})

  @property
  def state(self) -> State:
    return self._state


class EchoAction(Action):
  text: str = ""
  shout: bool = False


class EchoObservation(Observation):
  echoed: str = ""
  note: str = ""


class EchoEnvironment(Environment):
  """OpenEnv's template environment in small: reset takes no seed (as the template's does), step echoes
  the text; its Action and Observation are known only from step's annotation (no Environment[...]
  arguments), and its observation has two str fields, so the adapter needs observation_field."""

  def reset(self) -> EchoObservation:
    return EchoObservation(echoed="ready", note="echo")

  def step(self, action: EchoAction) -> EchoObservation:
    return EchoObservation(echoed=action.text.upper() if action.shout else action.text, note="echo", reward=0.5)

  @property
  def state(self) -> State:
    return State()


def make_guess(high: int = 10) -> GuessNumberEnvironment:
  """A factory (not a class) of GuessNumberEnvironment."""
  return GuessNumberEnvironment(high=high)


def not_an_environment():
  return object()


HINT_PROMPT = "I picked a number from 1 to {high}. Ask compare for hints, then answer with the number."


class HintedGuessEnvironment(MCPEnvironment):
  """The number game with MCP tools (module docstring)."""

  def __init__(self, high: int = 10):
    mcp = FastMCP("hints")

    @mcp.tool()
    def compare(number: int) -> str:
      """Whether the hidden number is higher than, lower than or equal to `number`."""
      return "equal" if number == self.number else ("higher" if number < self.number else "lower")

    @mcp.tool()
    def fail() -> str:
      """Always fails."""
      raise RuntimeError("the hint service is down")

    self.high, self.number, self._state = high, None, State()
    super().__init__(mcp)

  def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> GuessObservation:
    self.number, self._state = random.Random(seed).randint(1, self.high), State(episode_id=episode_id, step_count=0)
    return GuessObservation(prompt=HINT_PROMPT.format(high=self.high), done=False, reward=None)

  def _step_impl(self, action: GuessAction, timeout_s: Optional[float] = None, **kwargs: Any) -> GuessObservation:
    found = re.findall(r"-?\d+", action.message)
    won = bool(found) and int(found[-1]) == self.number
    return GuessObservation(prompt="Correct!" if won else f"It was {self.number}.", done=True,
                            reward=1.0 if won else 0.0)

  @property
  def state(self) -> State:
    return self._state


class SubmitGuessEnvironment(HintedGuessEnvironment):
  """Tools only: HintedGuessEnvironment's tools and `submit(number)`, which ends the game (module docstring)."""

  def __init__(self, high: int = 10):
    super().__init__(high)

    @self.tool()
    def submit(number: int) -> str:
      """Your final answer."""
      return "submitted"

  def _scored(self, action: Action, observation: Observation) -> Observation:
    if isinstance(action, CallToolAction) and action.tool_name == "submit" and observation.error is None:
      observation.done = True
      observation.reward = 1.0 if action.arguments.get("number") == self.number else 0.0
    return observation

  def step(self, action: Action, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:
    return self._scored(action, super().step(action, timeout_s=timeout_s, **kwargs))

  async def step_async(self, action: Action, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:
    # OpenEnv's server steps an MCPEnvironment through step_async
    return self._scored(action, await super().step_async(action, timeout_s=timeout_s, **kwargs))

  def _step_impl(self, action: Action, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:
    raise RuntimeError("SubmitGuessEnvironment takes tool calls only")
