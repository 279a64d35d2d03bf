"""Environments of other libraries behind our protocol (docs/design.md, "Episodes"; README, "Bring an environment").

`TextArenaEnv` runs a single-player game of TextArena (https://github.com/LeonGuertler/TextArena,
`pip install textarena`, the optional extra `envs`) as an `rollout.environments.Environment`:

    env = TextArenaEnv("FrozenLake-v0")          # a registered id, or a textarena.Env you built
    results = [run_episode(env, seed, i, tokenizer, sampler, max_turns=8, max_turn_tokens=32, max_context=2048)
               for i, seed in enumerate(range(16))]   # a problem is the game's seed

What maps to what:

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

TextArena draws from Python's global `random` (seeded by `reset`); the adapter keeps a generator
state of its own per environment and swaps it in around each call into the game, so a game's draws
depend only on its seed and its actions, and other code's use of `random` neither moves nor is
moved by them.
"""

from __future__ import annotations

import importlib
import random
from typing import Any

from branch_replay_jax.rollout.environments import EpisodeEnd


def import_optional(package: str, extra: str = "envs"):
  """The module `package`, or an ImportError naming it and the extra that installs it."""
  try:
    return importlib.import_module(package)
  except ImportError as e:
    raise ImportError(f"this environment needs the `{package}` package: pip install 'branch_replay_jax[{extra}]' "
                      f"(or pip install {package})") from e


class TextArenaEnv:
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
    self.env, self.system, self.game_info = env, system, None
    self._player_action = ta.ObservationType.PLAYER_ACTION
    self._random = random.Random(0).getstate()

  def _call(self, fn, *args, **kwargs):
    """fn(...) with this environment's `random` state swapped into the global generator."""
    outer = random.getstate()
    random.setstate(self._random)
    try:
      return fn(*args, **kwargs)
    finally:
      self._random = random.getstate()
      random.setstate(outer)

  def _observation(self) -> str:
    player, messages = self._call(self.env.get_observation)
    if player != 0:
      raise ValueError(f"TextArenaEnv: {self.game_id} asks player {player} to act; only single-player games run")
    texts = [text for sender, text, kind in messages if not (kind == self._player_action and sender == 0)]
    if not texts:
      raise ValueError(f"TextArenaEnv: {self.game_id} returned no message for the player")
    return "\n".join(texts)

  def reset(self, problem: Any) -> list[dict[str, str]]:
    """Start the game with seed `problem` (an int); returns [system?, user: the game's first messages]."""
    if isinstance(problem, bool) or not isinstance(problem, int):
      raise ValueError(f"TextArenaEnv: problem={problem!r} must be an int, the game's seed")
    self.game_info = None
    try:
      self._call(self.env.reset, num_players=1, seed=problem)
    except AssertionError as e:   # textarena's states assert their number of players
      raise ValueError(f"TextArenaEnv: {self.game_id} did not start with one player: {e}") from e
    system = [{"role": "system", "content": self.system}] if self.system is not None else []
    return system + [{"role": "user", "content": self._observation()}]

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
