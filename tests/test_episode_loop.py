"""Episodes in the GRPO loop (rollout.episodes; docs/design.md, "Episodes"): the calculator
experiment's smoke variant trains end to end, the episode step logs the same metrics in the replay
and the naive layout on the same episodes, the run-time exactness check runs on episodes, and the
config refuses the fields that do not apply to episodes."""

import json
import math
import os
import re

import jax
import numpy as np
import pytest
from conftest import ScriptedSampler, experiment_config
from flax import nnx

from branch_replay_jax.algorithms import grpo, loop, runs
from branch_replay_jax.algorithms.groups import rollout_group
from branch_replay_jax.models.loading import stop_ids
from branch_replay_jax.rollout import collect
from branch_replay_jax.rollout.environments import STATUSES, calculator_examples
from branch_replay_jax.rollout.tools import turn_format, tool_table, CALCULATOR
from experiments import grpo_smollm2_calc

EPISODE_METRICS = ("tool_calls_per_episode", "turns_per_episode", "format_rate",
                   *(f"episodes_{s}" for s in STATUSES))


def calc_smoke(run_dir, **overrides):
  return experiment_config(grpo_smollm2_calc, "smoke", run_dir, **overrides)


def test_the_calculator_smoke_experiment_trains_and_logs_episode_metrics(tmp_path):
  # The tiny random model never closes a turn (1 stop id in 49k), so each of the 2 x 4 episodes of a
  # step is one turn cut at max_turn_tokens = 6: turns_per_episode 1, no tool call, format rate 0,
  # 8 episodes "max_turn_tokens"; every logged value is a finite number. With TIS against the episode
  # sampler's log-probs (correction.py): the sampler (KV cache, one token at a time) and the trainer (the
  # episode tree's forward) compute the same float32 log-probs two ways, so they differ by rounding only:
  # mean |difference| below 1e-3 nats (a turn's log-probs put on another turn's tokens would be ~1 nat off).
  history = grpo.train(calc_smoke(tmp_path, **{"loss.rollout_correction": "tis"}))
  assert [r["step"] for r in history] == [1, 2]
  with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  for r in records:
    assert set(EPISODE_METRICS) | {"loss", "grad_norm", "kl", "reward_mean", "accuracy"} <= set(r)
    assert all(math.isfinite(v) for v in r.values() if isinstance(v, (int, float))), r
    assert r["turns_per_episode"] == 1.0 and r["tool_calls_per_episode"] == 0.0 and r["format_rate"] == 0.0
    assert r["episodes_max_turn_tokens"] == 8 and sum(r[f"episodes_{s}"] for s in STATUSES) == 8
    assert r["completion_len_mean"] == 6.0   # model tokens per episode
    assert r["token_positions_computed"] < r["token_positions_naive"]   # the prompt once per problem
    assert 0 < r["sampler_logp_diff_mean"] < 1e-3 and r["is_masked_frac"] == 0.0, r
  with open(os.path.join(tmp_path, "eval.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  assert [r["step"] for r in rows] == [0, 2] and all(0 <= r["accuracy"] <= 1 for r in rows)
  assert {"tool_calls_per_episode", "format_rate", "turns_per_episode"} <= set(rows[0])


class ScriptedTurns:
  """A stand-in for `EpisodeSampler` (monkeypatched into rollout/collect.py): branch g of a problem
  plays SCRIPT[g] turn by turn, each the text's ids and a stop id, so the episodes have real tool
  calls, observations and statuses (a random model writes none). Branches 0 and 1 share their first
  turn and its observation (one tree node), then answer differently."""

  tokenizer = None
  answer, expression = "", ""

  def __init__(self, g):
    self.g, self.turn = g, 0

  @classmethod
  def branches(cls, model, ids, n, *, key, **kwargs):
    return [cls(g) for g in range(n)]

  def script(self):
    call = lambda e: f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{e}"}}}}</tool_call>'
    return [[call(self.expression), f"<answer>{self.answer}</answer>"],      # done, correct
            [call(self.expression), "<answer>7</answer>"],                   # done, wrong
            ['<tool_call>{"name": "abacus", "arguments": {}}</tool_call>'],  # malformed_tool_call
            [call("1 / 0")],                                                  # tool_error
            [f"<answer>{self.answer}</answer>"],                             # done in one turn
            [call(self.expression), call(self.expression)]][self.g]          # max_turns (2 turns)

  def __call__(self, ids, budget):
    ids = self.tokenizer.encode(self.script()[self.turn], add_special_tokens=False)
    self.turn += 1
    assert len(ids) < budget
    return ids + [stop_ids(self.tokenizer)[0]]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
  """(config, model, tokenizer, the step's groups in each layout) for 2 problems of 6 scripted
  episodes each, at max_turns 2 and max_turn_tokens 40."""
  run_dir = tmp_path_factory.mktemp("scripted")
  config = calc_smoke(run_dir, **{"rollout.group_size": 6, "rollout.episodes.max_turn_tokens": 40,
                                  "rollout.episodes.max_context": 1024, "rollout.episodes.few_shot": 0,
                                  "loss.weighting": "group_token_mean"})
  model, tokenizer = runs.build_model(config)
  algorithm = grpo.GRPO(config)
  ScriptedTurns.tokenizer = tokenizer
  groups = {}
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(collect, "EpisodeSampler", ScriptedTurns)
    # (train.gradient, rollout.episodes.share): "replay" and "naive" share the tree (the experiment's
    # default), "prompt" and "naive_prompt" the prompt only.
    for layout, (gradient, share) in {"replay": ("replay", "tree"), "naive": ("naive", "tree"),
                                      "prompt": ("replay", "prompt"), "naive_prompt": ("naive", "prompt")}.items():
      cfg = calc_smoke(run_dir, **{"rollout.group_size": 6, "rollout.episodes.max_turn_tokens": 40,
                                   "rollout.episodes.max_context": 1024, "rollout.episodes.few_shot": 0,
                                   "loss.weighting": "group_token_mean", "train.gradient": gradient,
                                   "rollout.episodes.share": share})
      groups[layout] = []
      for pos in range(2):
        problem = algorithm.task[pos]
        ScriptedTurns.answer, ScriptedTurns.expression = problem.answer, problem.entry["metadata"]["expression"]
        groups[layout].append(rollout_group(cfg, model, tokenizer, algorithm.task, pos, jax.random.key(pos),
                                            env=algorithm.env))
  return config, model, groups


def test_scripted_episodes_are_scored_and_counted_by_status(scripted):
  # Per problem: rewards 1.1 (correct + format bonus 0.1), 0.1 (tagged, wrong), 0, 0, 1.1, 0
  # (max_turns: the second call has no turn left to answer); 2 tool calls in branches 0, 1 and 5
  # (5: two), none in 2 (malformed) and 3 (the tool errored); of the 9 turns per problem all but the
  # malformed call are a tool call or a tagged answer.
  _, _, groups = scripted
  g = groups["replay"][0]
  assert g.kind == "tree" and groups["naive"][0].kind == "group"
  assert g.rewards.tolist() == pytest.approx([1.1, 0.1, 0.0, 0.0, 1.1, 0.0])
  assert g.correct.tolist() == [True, False, False, False, True, False]
  assert g.episode_stats["status"] == ["done", "done", "malformed_tool_call", "tool_error", "done", "max_turns"]
  assert g.episode_stats["tool_calls"].tolist() == [1, 1, 0, 0, 0, 2]
  assert g.episode_stats["turns"].tolist() == [2, 2, 1, 1, 1, 2]
  record = loop.step_record(0, groups["replay"], {}, rollout_s=0.0, update_s=0.0)
  assert record["tool_calls_per_episode"] == pytest.approx(8 / 12)
  assert record["format_rate"] == pytest.approx(16 / 18)   # all turns but the malformed call
  assert record["turns_per_episode"] == pytest.approx(18 / 12)
  assert (record["episodes_done"], record["episodes_malformed_tool_call"], record["episodes_tool_error"],
          record["episodes_max_turns"]) == (6, 2, 2, 2)
  # Branches 0, 1 and 5 share the first turn and its observation: computed once in the tree; with
  # rollout.episodes.share = "prompt" only the prompt is (the rows by the group replay step).
  prompt_only = groups["prompt"][0]
  assert prompt_only.kind == "group" and prompt_only.naive_batch is None
  assert g.counts["token_positions_computed"] < prompt_only.counts["token_positions_computed"] < \
         g.counts["token_positions_naive"] == prompt_only.counts["token_positions_naive"]


@pytest.mark.parametrize("share, schedule", [("tree", "depth_first"), ("tree", "packed"), ("prompt", "depth_first")])
def test_the_episode_step_logs_the_same_metrics_in_the_replay_and_naive_layouts(scripted, share, schedule):
  # Same episodes, same parameters: loss, gradient norm and KL per (token, episode) pair agree to
  # float32 rounding (<= 1e-4 relative, the project's float32 bound); the KL is positive (reference
  # = another random model) and nothing is clipped on-policy (clip_frac exactly 0 in both). Every
  # other logged figure of the step (rewards, episode metrics, token counts) is equal exactly. Replay
  # over the episode tree (share tree; nested replay, or each tree packed into one row) and the rows by
  # the group replay step (share prompt).
  config, model, groups = scripted
  graphdef, params = nnx.split(model)
  _, ref_params = nnx.split(runs.build_model(calc_smoke("/tmp/unused", seed=1))[0])
  stats = {}
  layouts = {"replay": "replay" if share == "tree" else "prompt", "naive": "naive" if share == "tree" else "naive_prompt"}
  for layout, key in layouts.items():
    cfg = calc_smoke(config.run_dir, **{"train.gradient": layout, "rollout.group_size": 6,
                                        "rollout.episodes.share": share, "train.tree_schedule": schedule})
    optimizer = runs.make_optimizer(cfg)
    fns = grpo.GRPOFunctions(cfg, graphdef, None, optimizer)
    p = jax.tree_util.tree_map(lambda x: x.copy(), params)
    _, _, out, _ = grpo.update_on_batch(cfg, fns, p, ref_params, optimizer.init(p), groups[key])
    record = loop.step_record(0, groups[key], out, rollout_s=0.0, update_s=0.0)
    stats[layout] = {k: v for k, v in record.items() if not k.endswith("_s")}
  replay, naive = stats["replay"], stats["naive"]
  assert naive["kl"] > 0 and abs(naive["loss"]) > 0 and naive["grad_norm"] > 0
  assert replay["clip_frac"] == naive["clip_frac"] == 0.0
  for k in ("loss", "grad_norm", "kl"):
    assert abs(replay[k] - naive[k]) <= 1e-4 * abs(naive[k]), (k, replay[k], naive[k])
  assert {k: v for k, v in replay.items() if k not in ("loss", "grad_norm", "kl")} == \
         {k: v for k, v in naive.items() if k not in ("loss", "grad_norm", "kl")}


@pytest.mark.parametrize("schedule", ["depth_first", "packed"])
def test_the_run_time_exactness_check_compares_an_episode_tree_with_its_rows(scripted, schedule):
  # The check (algorithms/exactness.py) takes the first group with unequal rewards, the episode tree
  # by replay (as the step computes it: nested, or packed into one row) against its one-row-per-episode
  # layout (Group.naive_batch): within float32's bound.
  config, model, groups = scripted
  graphdef, params = nnx.split(model)
  _, ref_params = nnx.split(runs.build_model(calc_smoke("/tmp/unused", seed=1))[0])
  cfg = calc_smoke(config.run_dir, **{"train.exactness_check_every": 1, "train.tree_schedule": schedule})
  fns = grpo.GRPOFunctions(cfg, graphdef)
  out = fns.check(params, ref_params, groups["replay"])
  assert out["exactness_ok"] and out["exactness_grad_rel_err"] <= 1e-4, out
  assert out["exactness_loss_rel_err"] <= 1e-4 and out["exactness_kl_rel_err"] <= 1e-4


@pytest.mark.parametrize("field, value, message", [
    ("rollout.max_new_tokens", 16, "rollout.max_new_tokens=16 does not apply to episodes"),
    ("rollout.tree_fanouts", (2, 2), "rollout.tree_fanouts=(2, 2) does not apply to episodes"),
    ("loss.overlong_buffer", 2, "loss.overlong_buffer=2 does not apply to episodes"),
    ("rollout.stop_strings", ("</answer>",), "rollout.stop_strings=('</answer>',) does not apply to episodes"),
    ("task.few_shot", 2, "task.few_shot=2: its examples answer without tools"),
    ("rollout.episodes.environment", "chess", "rollout.episodes.environment='chess' is not one of"),
    ("rollout.episodes.max_turns", 0, "rollout.episodes.max_turns=0 must be an int >= 1"),
    ("rollout.episodes.share", "turns", "rollout.episodes.share='turns' is not one of ('tree', 'prompt')"),
    ("rollout.episodes.max_context", 6, "rollout.episodes.max_context=6 leaves no room"),
    ("rollout.episodes.max_context", 4096, "rollout.episodes.max_context=4096 is longer than model 'tiny'"),
    ("rollout.group_size", 1, "rollout.group_size=1: a group-relative advantage"),
    ("eval.pass_k", 4, "eval.pass_k=4 with rollout.episodes"),
])
def test_a_field_that_does_not_apply_to_episodes_or_a_bad_budget_is_refused(tmp_path, field, value, message):
  # Each is refused by grpo.validate, naming the field and value, before any model loads.
  config = calc_smoke(tmp_path, **{field: value})
  with pytest.raises(ValueError, match=re.escape(message)):
    grpo.validate(config)


def test_the_calculator_examples_call_the_tool_and_answer_in_the_format_turn_format_accepts():
  # One example: the user turn, a call on the problem's own expression, the tool's value (= the answer
  # for basic_arithmetic) and the tagged answer; both assistant turns are in a format the format
  # rate counts, and a turn with neither, or a call that does not parse, is not.
  from branch_replay_jax.rollout.tasks import make_task
  task = make_task("basic_arithmetic", seed=0, size=4, min_digits=3, max_digits=4)
  messages = calculator_examples(task, [task[0]])
  assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
  assert messages[2]["content"] == task[0].answer
  tools = tool_table([CALCULATOR])
  assert [turn_format(m["content"], tools) for m in messages if m["role"] == "assistant"] == ["tool_call", "answer"]
  assert turn_format("the answer is 12", tools) == "no_format"
  assert turn_format('<tool_call>{"name": 3}</tool_call>', tools) == "malformed_tool_call"


def test_limit_depth_stops_sharing_below_the_deepest_level_and_keeps_every_episode():
  # Three episodes whose trie is 3 levels deep: a shared call prefix [1, 2] (all three), then
  # [3, 5] (e0, e1: a model token and an observation in one node) or [4] (e2), then [6] / [7]. At
  # max_depth 2 nothing below level 1 is shared: e0 and e1 each continue from [1, 2] as their own
  # leaf [3, 5, 6] / [3, 5, 7], so the tree has depth 2 and 5 nodes, and every episode's tokens,
  # roles and model-token count are unchanged.
  from branch_replay_jax.data.episodes import MODEL, OBSERVATION, Episode, episode_tree, limit_depth
  p = np.array([9, 9], np.int32)
  seg = lambda *ids: np.array(ids, np.int32)
  episodes = [Episode(p, (seg(1, 2, 3), seg(5), seg(6)), (MODEL, OBSERVATION, MODEL)),
              Episode(p, (seg(1, 2, 3), seg(5), seg(7)), (MODEL, OBSERVATION, MODEL)),
              Episode(p, (seg(1, 2, 4),), (MODEL,))]
  full = episode_tree(episodes)
  assert max(full.tree.depth(n) for n in range(full.tree.num_nodes)) == 3
  cut = limit_depth(full, 2)
  assert [s.tolist() for s in cut.tree.segments] == [[9, 9], [1, 2], [3, 5, 6], [3, 5, 7], [4]]
  assert max(cut.tree.depth(n) for n in range(cut.tree.num_nodes)) == 2
  for g, e in enumerate(episodes):
    back = cut.episode(g)
    assert back.roles == e.roles and all(np.array_equal(a, b) for a, b in zip(back.segments, e.segments))
  assert cut.model_lengths().tolist() == full.model_lengths().tolist() == [4, 4, 3]
  assert limit_depth(full, 3) is full
  with pytest.raises(ValueError, match="max_depth=0"):
    limit_depth(full, 0)


# ---- your environment by import path (rollout.episodes.environment, env_options) -------------------

ECHO_ENV = '''
import os

class EchoEnv:
  """Asks the task's question; any answer ends the episode with reward `bonus` (env_options). While
  the file `fail_flag` exists, every step after the first 8 raises (a bug in the environment)."""
  def __init__(self, task, bonus=0.0, fail_flag=None):
    self.task, self.bonus, self.fail_flag, self.resets, self.steps, self.closes = task, bonus, fail_flag, 0, 0, 0
  def close(self):
    self.closes += 1
  def reset(self, problem):
    self.resets += 1
    return list(self.task.messages(problem))
  def step(self, assistant_message):
    self.steps += 1
    if self.fail_flag and os.path.exists(self.fail_flag) and self.steps > 8:
      raise ValueError("broken")
    return None, self.bonus, True

class NoStep:
  def reset(self, problem):
    return [{"role": "user", "content": "hi"}]

class TwoArgStep(NoStep):
  def step(self, message, extra):
    return None, 0.0, True

def broken(**options):
  raise KeyError("no such level")

class HalfEnv:
  """Problems in the order they are played: every episode of problem 0, 2, 4, ... pays 0 (equal rewards);
  those of problem 1, 3, 5, ... pay 1 at every other reset (unequal rewards). Answers end the episode."""
  def __init__(self, task):
    self.task, self.question, self.problems, self.resets = task, None, -1, 0
  def reset(self, problem):
    if problem.question != self.question:
      self.question, self.problems, self.resets = problem.question, self.problems + 1, 0
    self.resets += 1
    return list(self.task.messages(problem))
  def step(self, assistant_message):
    return None, float(self.problems % 2 == 1 and self.resets % 2 == 0), True
'''


def _env_config(tmp_path, environment, options=None):
  path = tmp_path / "my_env.py"
  path.write_text(ECHO_ENV)
  overrides = {"rollout.episodes.environment": environment.replace("FILE", str(path)), "rollout.episodes.few_shot": 0}
  config = calc_smoke(tmp_path / "run", **overrides)
  if options is not None:
    config.rollout.episodes.env_options = options
  return config


class Answers(ScriptedSampler):
  """Every turn answers, so every episode reaches the environment's step."""

  def text(self):
    return "<answer>1</answer>"


def test_an_environment_by_file_path_trains_with_its_options_and_resumes_once_fixed(tmp_path, monkeypatch):
  # FILE.py:EchoEnv built with the task (it takes `task`) and env_options {"bonus": 0.25, "fail_flag"}.
  # Step 1 trains: its 2 problems x 4 episodes each start with a reset and end at their first step,
  # paying 0.25 (reward_mean 0.25). At step 2 the environment raises: the run stops before the
  # update, naming the class, the problem and the turn, with step 1's checkpoint and log intact.
  # Once the environment is fixed (the flag removed), resume=True trains step 2 and the log holds
  # each step once.
  from branch_replay_jax.models.loading import load_tokenizer
  Answers.tokenizer = load_tokenizer("smollm2-135m-instruct")
  monkeypatch.setattr(collect, "EpisodeSampler", Answers)
  flag = tmp_path / "broken"
  flag.write_text("")
  config = _env_config(tmp_path, "FILE:EchoEnv", {"bonus": 0.25, "fail_flag": str(flag)})
  config.checkpoint_every, config.eval.size = 1, 0
  algorithm = grpo.GRPO(config)
  assert type(algorithm.env).__name__ == "EchoEnv" and algorithm.env.bonus == 0.25
  with pytest.raises(RuntimeError, match=r"problem 2: the environment EchoEnv's step at turn 1 raised "
                                         r"ValueError\('broken'\)"):
    loop.train(config, algorithm)
  r = config.rollout
  assert algorithm.env.resets >= r.prompts_per_step * r.group_size
  assert algorithm.env.closes == 1   # the protocol's close: once, also when the run stopped on a raise
  with open(os.path.join(config.run_dir, "metrics.jsonl")) as f:
    assert [json.loads(line)["step"] for line in f] == [1]
  flag.unlink()
  config.resume = True
  algorithm = grpo.GRPO(config)
  history = loop.train(config, algorithm)
  assert [rec["step"] for rec in history] == [2]
  assert algorithm.env.closes == 1   # and once when the run ends normally
  with open(os.path.join(config.run_dir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  assert [rec["step"] for rec in records] == [1, 2]
  assert all(rec["reward_mean"] == pytest.approx(0.25) and rec["episodes_done"] == 8 for rec in records)


def test_dynamic_sampling_drops_problems_whose_episodes_all_earn_the_same_reward(tmp_path, monkeypatch):
  # rollout.dynamic_sampling with episodes: a problem's G = 4 episodes are its group. HalfEnv pays every
  # episode of the 1st, 3rd, ... problem played 0 (dropped) and those of the 2nd, 4th, ... 0 and 1 in turn.
  # A step keeps 2 problems: round 0 plays problems 0 and 1 (one kept), round 1 problems 2 and 3 (the second
  # kept): 4 prompts drawn, 2 groups dropped, reward_mean 0.5 over the 8 kept episodes; step 2 plays 4-7 alike.
  from branch_replay_jax.models.loading import load_tokenizer
  Answers.tokenizer = load_tokenizer("smollm2-135m-instruct")
  monkeypatch.setattr(collect, "EpisodeSampler", Answers)
  config = _env_config(tmp_path, "FILE:HalfEnv")
  config.rollout.dynamic_sampling, config.rollout.max_prompt_draws = True, 6
  config.checkpoint_every, config.eval.size = 2, 0
  algorithm = grpo.GRPO(config)
  history = loop.train(config, algorithm)
  assert algorithm.env.problems == 7   # problems 0..7 played, each once
  for record in history:
    assert (record["prompts_drawn"], record["dropped_groups"]) == (4, 2), record
    assert record["reward_mean"] == pytest.approx(0.5) and record["episodes_done"] == 8
    assert record["zero_variance_groups"] == 0 and np.isfinite(record["loss"])


@pytest.mark.parametrize("environment, options, message", [
    ("FILE:NoStep", None, "NoStep has no step() method"),
    ("FILE:TwoArgStep", None, "TwoArgStep.step cannot be called with one argument"),
    ("FILE:broken", {"level": 3}, "env_options={'level': 3} raised KeyError('no such level')"),
    ("FILE:Missing", None, "has no attribute 'Missing'"),
    ("nowhere.py:EchoEnv", None, "cannot be imported"),
    ("python:no_such_package.envs:Env", None, "cannot be imported"),
    ("calculator", {"bonus": 1}, "rollout.episodes.env_options={'bonus': 1}: rollout.episodes.environment="
                                 "'calculator' takes none"),
])
def test_an_environment_that_does_not_resolve_or_follow_the_protocol_is_refused_before_the_model_loads(
    tmp_path, environment, options, message):
  config = _env_config(tmp_path, environment, options)
  grpo.validate(config)   # the form is fine; building the algorithm resolves it (no model loaded yet)
  with pytest.raises(ValueError, match=re.escape(message)):
    grpo.GRPO(config)


def test_few_shot_calculator_conversations_are_refused_with_another_environment(tmp_path):
  config = _env_config(tmp_path, "FILE:EchoEnv")
  config.rollout.episodes.few_shot = 1
  with pytest.raises(ValueError, match=re.escape("rollout.episodes.few_shot=1 shows calculator conversations")):
    grpo.validate(config)
