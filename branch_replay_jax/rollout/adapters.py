"""Environments of other libraries behind our protocol (docs/design.md, "Episodes"; README, "Bring an environment").

`TextArenaEnv` runs a single-player game of TextArena (https://github.com/LeonGuertler/TextArena,
`pip install textarena`, the optional extra `envs`), `GemEnv` an environment of GEM
(https://github.com/axon-rl/gem, `pip install --no-deps gem-llm==0.1.0`, see `GemEnv`), each as an
`rollout.environments.Environment`:

    env = TextArenaEnv("FrozenLake-v0")          # a registered id, or a textarena.Env you built
    env = GemEnv("game:GuessTheNumber-v0-easy")  # a registered id, or a gem.Env you built
    results = [run_episode(env, seed, i, tokenizer, sampler, max_turns=8, max_turn_tokens=32, max_context=2048)
               for i, seed in enumerate(range(16))]   # a problem is the game's seed

In the training loop (`rollout.episodes.environment = "textarena:GAME-ID"` or `"gem:ENV-ID"`) a
problem is one of the task's `Problem`s: its game's seed is `game_seed(problem)` (the entry's
"seed" when it has one, else a CRC-32 of its question), so each problem of the task is one seeded
game, a resumed run replays the same games, and the held-out problems are other games.

What maps to what in TextArena (GEM: `GemEnv`):

    reset(seed)    -> env.reset(num_players=1, seed=seed); the game's first messages (its prompt,
                      its board) as one "user" message, after `system` when given
    step(message)  -> env.step(message); while the game goes on: the game's messages since the
                      action (its echo of the action left out: the action is the model's turn,
                      already in the episode) as one "user" message, reward 0, not done;
                      when it ends: None, the game's reward for player 0 (env.close()), done
    an invalid move the game lets the player retry (textarena's error allowance, one by default)
                   -> an observation like any other ("You attempted an invalid move ...")
    an invalid move that ends the game
                   -> `EpisodeEnd("invalid_action", the game's reason)`: status "invalid_action",
                      reward 0 like every marked end (the game's own reward for it is not used)
    anything the game raises
                   -> run_episode stops with a RuntimeError naming the problem's index

The messages of one observation are joined by a newline, each as the game wrote it. The library's
observation wrappers (which put the whole history into every observation, for a stateless LLM
call) are removed: the episode holds the history itself, token-in, token-out.

TextArena and GEM draw from Python's global `random` (GEM from NumPy's global generator too), seeded
by `reset`; each adapter keeps the generators' state of its own and swaps it in around each call into
the game, so a game's draws depend only on its seed and its actions, and other code's use of the
global generators neither moves nor is moved by them.
"""

from __future__ import annotations

import importlib
import random
import zlib
from typing import Any

import numpy as np

from branch_replay_jax.rollout.environments import EpisodeEnd


def import_optional(package: str, install: str = "pip install 'branch_replay_jax[envs]'"):
  """The module `package`, or an ImportError naming it and the command that installs it."""
  try:
    return importlib.import_module(package)
  except ImportError as e:
    raise ImportError(f"this environment needs the `{package}` package: {install}") from e


def game_seed(problem: Any, where: str = "game_seed") -> int:
  """A game's seed from a problem: an int as itself; a `rollout.tasks.Problem` (the loop's) by its
  entry's int "seed" when it has one, else the CRC-32 of its question (stable across processes,
  unlike `hash`).

  Raises:
    ValueError: a negative int, a bool, or anything else (naming `where` and the value).
  """
  if isinstance(problem, int) and not isinstance(problem, bool) and problem >= 0:
    return problem
  entry, question = getattr(problem, "entry", None), getattr(problem, "question", None)
  seed = entry.get("seed") if isinstance(entry, dict) else None
  if isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0:
    return seed
  if isinstance(question, str):
    return zlib.crc32(question.encode())
  raise ValueError(f"{where}: problem={problem!r} must be an int >= 0 (the game's seed) or a task's Problem")


def first_messages(system: str | None, text: str) -> list[dict[str, str]]:
  """An environment's reset messages: [system?, user: text] (the system message when `system` is not None)."""
  return ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": text}]


class OwnRandom:
  """Calls into a library that draws from the global `random` and `numpy.random`, with generator
  states of this object's own swapped in around each call."""

  def __init__(self):
    self._random, self._numpy = random.Random(0).getstate(), np.random.RandomState(0).get_state()

  def _call(self, fn, *args, **kwargs):
    outer, outer_numpy = random.getstate(), np.random.get_state()
    random.setstate(self._random)
    np.random.set_state(self._numpy)
    try:
      return fn(*args, **kwargs)
    finally:
      self._random, self._numpy = random.getstate(), np.random.get_state()
      random.setstate(outer)
      np.random.set_state(outer_numpy)


class TextArenaEnv(OwnRandom):
  """A single-player TextArena game as an `Environment` (see the module docstring for the mapping).

  Args:
    game: a registered TextArena id (e.g. "FrozenLake-v0", "GuessTheNumber-v0", "TowerOfHanoi-v0";
      `textarena.envs.registration.ENV_REGISTRY`), or a `textarena.Env` instance (wrapped or not).
    system: a system message put before the game's first message, or None (the chat template's own
      default, if it has one).
    make_kwargs: keyword arguments of `textarena.make` (with an id only).

  Attributes:
    env: the unwrapped textarena game. game_id: its id (or class name).
    game_info: the game's info for player 0 after an episode ended (`env.close()`), else None.

  Raises:
    ImportError: textarena is not installed (naming the package and the extra).
    ValueError: an id textarena does not know, or `game` neither a str nor a textarena.Env.
    (On reset) ValueError: a problem that is not an int seed; a game that is not single-player.
  """

  def __init__(self, game, *, system: str | None = None, **make_kwargs):
    ta = import_optional("textarena")
    if isinstance(game, str):
      if game not in ta.envs.registration.ENV_REGISTRY:
        raise ValueError(f"TextArenaEnv: game={game!r} is not a registered textarena id")
      env, self.game_id = ta.make(game, **make_kwargs), game
    elif isinstance(game, ta.Env):
      if make_kwargs:
        raise ValueError(f"TextArenaEnv: make_kwargs {sorted(make_kwargs)} are for a game id, not an instance")
      env, self.game_id = game, getattr(game, "env_id", type(game).__name__)
    else:
      raise ValueError(f"TextArenaEnv: game={game!r} must be a textarena id or a textarena.Env")
    while isinstance(env, ta.Wrapper):
      env = env.env
    super().__init__()
    self.env, self.system, self.game_info = env, system, None
    self._player_action = ta.ObservationType.PLAYER_ACTION

  def _observation(self) -> str:
    player, messages = self._call(self.env.get_observation)
    if player != 0:
      raise ValueError(f"TextArenaEnv: {self.game_id} asks player {player} to act; only single-player games run")
    texts = [text for sender, text, kind in messages if not (kind == self._player_action and sender == 0)]
    if not texts:
      raise ValueError(f"TextArenaEnv: {self.game_id} returned no message for the player")
    return "\n".join(texts)

  def reset(self, problem: Any) -> list[dict[str, str]]:
    """Start the game with seed `game_seed(problem)`; returns [system?, user: the game's first messages]."""
    seed = game_seed(problem, "TextArenaEnv")
    self.game_info = None
    try:
      self._call(self.env.reset, num_players=1, seed=seed)
    except AssertionError as e:   # textarena's states assert their number of players
      raise ValueError(f"TextArenaEnv: {self.game_id} did not start with one player: {e}") from e
    return first_messages(self.system, self._observation())

  def step(self, assistant_message: str):
    """Play the model's message as the action; see the module docstring for what comes back."""
    done, _ = self._call(self.env.step, assistant_message)
    if not done:
      return [{"role": "user", "content": self._observation()}], 0.0, False
    rewards, info = self._call(self.env.close)
    self.game_info = dict(info.get(0, {}))
    if self.game_info.get("invalid_move"):
      raise EpisodeEnd("invalid_action", str(self.game_info.get("reason", "")))
    return None, float(rewards[0]), True


class GemEnv(OwnRandom):
  """An environment of GEM (gem-llm, https://github.com/axon-rl/gem) as an `Environment`.

  GEM pins older nltk and reasoning-gym than this package uses; its games import neither, so install
  it without its requirements: `pip install --no-deps gem-llm==0.1.0` (what `make install` does).

    reset(problem) -> env.reset(seed=game_seed(problem)); [system?, user: the first observation and
                      the info's "suffix" (e.g. "Enter your next guess.") on a line of its own]
    step(message)  -> env.step(message) = (observation, reward, terminated, truncated, info);
                      not ended: (user: observation + suffix, reward, False); ended (terminated or
                      truncated): (None, reward, True). The episode's reward is the sum of GEM's step
                      rewards (run_episode), GEM's own values: success 1, a malformed action -0.1
                      (`gem.utils.constants.LanguageGameReward`), its end status "done".

  Args:
    env: a registered GEM id (e.g. "game:GuessTheNumber-v0-easy", "game:Mastermind-v0-easy";
      `gem.envs.registration.ENV_REGISTRY`), or a `gem.Env` instance.
    system: a system message before the first observation, or None.
    make_kwargs: keyword arguments of `gem.make` (with an id only).

  Raises:
    ImportError: gem is not installed (naming the package). ValueError: an id GEM does not know, or
    `env` neither a str nor a gem.Env; (on reset) a problem with no seed (`game_seed`).
  """

  def __init__(self, env, *, system: str | None = None, **make_kwargs):
    gem = import_optional("gem", "pip install --no-deps gem-llm==0.1.0 (make install does)")
    from gem.envs.registration import ENV_REGISTRY
    if isinstance(env, str):
      if env not in ENV_REGISTRY:
        raise ValueError(f"GemEnv: env={env!r} is not a registered GEM id (e.g. 'game:GuessTheNumber-v0-easy')")
      self.env_id = env
      super().__init__()
      env = self._call(gem.make, env, **make_kwargs)   # GEM's games reset (and draw) when built
    elif isinstance(env, gem.Env):
      if make_kwargs:
        raise ValueError(f"GemEnv: make_kwargs {sorted(make_kwargs)} are for a GEM id, not an instance")
      self.env_id = type(env).__name__
      super().__init__()
    else:
      raise ValueError(f"GemEnv: env={env!r} must be a GEM id or a gem.Env")
    self.env, self.system = env, system

  @staticmethod
  def _text(observation, info) -> str:
    if not isinstance(observation, str):
      raise ValueError(f"GemEnv: the observation is a {type(observation).__name__}, not text; only text "
                       "environments run")
    suffix = info.get("suffix") if isinstance(info, dict) else None
    if not suffix:
      return observation
    return observation + ("" if observation.endswith("\n") else "\n") + suffix

  def reset(self, problem: Any) -> list[dict[str, str]]:
    """Start the environment with seed `game_seed(problem)`; see the class docstring."""
    seed = game_seed(problem, "GemEnv")
    observation, info = self._call(self.env.reset, seed=seed)
    return first_messages(self.system, self._text(observation, info))

  def step(self, assistant_message: str):
    """Play the model's message as the action; see the class docstring for what comes back."""
    observation, reward, terminated, truncated, info = self._call(self.env.step, assistant_message)
    if terminated or truncated:
      return None, float(reward), True
    return [{"role": "user", "content": self._text(observation, info)}], float(reward), False
