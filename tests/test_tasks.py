"""Tests for branch_replay_jax.rollout.tasks: determinism, extraction rules, rewards, hostile completions.

Expected scores come from reasoning-gym's own scorers (version 0.1.25): the base
ProceduralDataset.score_answer for basic_arithmetic (exact match 1.0, partial credit when the
true answer is a substring) and GSMSymbolicDataset.score_answer (first number: 1.0 equal,
0.01 wrong, 0.0 none).
"""

import math
import subprocess
import sys
import time

import pytest

from branch_replay_jax.rollout import tasks
from branch_replay_jax.rollout.tasks import DEFAULT_INSTRUCTION, TASKS, extract_answer, format_messages, make_task
from branch_replay_jax.algorithms import runs
from conftest import experiment_config
from experiments import grpo_smollm2_arith


@pytest.fixture(scope="module")
def arith():
  return make_task("basic_arithmetic", seed=0, size=100)


@pytest.fixture(scope="module")
def gsm():
  return make_task("gsm_symbolic", seed=0, size=100)


def test_import_is_lazy():
  # reasoning_gym takes ~1 s to import (sympy, matplotlib); importing the module must not pay it.
  code = "import sys, branch_replay_jax.rollout.tasks; print('reasoning_gym' in sys.modules)"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name", sorted(TASKS))
def test_same_seed_same_problems(name):
  # The trainer resumes from a data position: item i must be a function of (seed, i) only.
  a, b = make_task(name, seed=7, size=50), make_task(name, seed=7, size=50)
  for i in (0, 13, 49):
    assert (a[i].question, a[i].answer) == (b[i].question, b[i].answer)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_different_seeds_differ(name):
  # Ten problems at the same positions under seeds 0 and 1: equal lists would mean the seed is ignored.
  a, b = make_task(name, seed=0, size=10), make_task(name, seed=1, size=10)
  assert [p.question for p in a] != [p.question for p in b]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_item_does_not_depend_on_size(name):
  # gsm_symbolic draws its template list with Random(seed).choices(k=size), whose prefix is size-independent.
  small, large = make_task(name, seed=3, size=5), make_task(name, seed=3, size=200)
  assert [p.question for p in small] == [large[i].question for i in range(5)]


def test_nearby_seeds_overlap_for_basic_arithmetic():
  # reasoning-gym seeds item i with Random(seed + i): item i + 1 of seed 0 is item i of seed 1 (documented quirk).
  a, b = make_task("basic_arithmetic", seed=0, size=10), make_task("basic_arithmetic", seed=1, size=10)
  assert [a[i + 1].question for i in range(9)] == [b[i].question for i in range(9)]


def test_basic_arithmetic_defaults(arith):
  # Defaults: "Calculate A op B." with A, B in [0, 100] and op in {+, -}, so answers lie in [-100, 200].
  for p in arith:
    words = p.question.removeprefix("Calculate ").removesuffix(".").split(" ")
    assert len(words) == 3 and words[1] in "+-", p.question
    a, b = int(words[0]), int(words[2])
    assert 0 <= a <= 100 and 0 <= b <= 100
    assert p.answer == str(a + b if words[1] == "+" else a - b)


def test_index_bounds(arith):
  # Positions are [0, len): negative indices are not Python-style aliases (reasoning-gym would seed them anew).
  assert len(arith) == 100
  with pytest.raises(IndexError):
    arith[100]
  with pytest.raises(IndexError):
    arith[-1]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_true_answer_in_tags_scores_one(name):
  task = make_task(name, seed=0, size=20)
  for p in task:
    s = task.score(f"Let me think. <answer>{p.answer}</answer>", p)
    assert s == tasks.Score(reward=1.0, correct=True, extracted=p.answer, formatted=True)


def test_wrong_answer_basic_arithmetic(arith):
  # Base scorer: 0.0 when the true answer is not a substring of the extracted text.
  p = arith[1]
  wrong = str(int(p.answer) + 1)
  assert p.answer not in wrong
  s = arith.score(f"<answer>{wrong}</answer>", p)
  assert (s.reward, s.correct, s.extracted) == (0.0, False, wrong)


def test_partial_credit_basic_arithmetic(arith):
  # Base scorer quirk: the true answer inside a longer string gets len(true) / len(extracted), not 0.
  p = arith[1]
  s = arith.score(f"<answer>1{p.answer}</answer>", p)
  assert s.reward == pytest.approx(len(p.answer) / (len(p.answer) + 1))
  assert not s.correct


def test_wrong_answer_gsm_symbolic(gsm):
  # gsm_symbolic gives 0.01 for any wrong number and 0.0 when the extracted text has no number.
  p = gsm[0]
  wrong = str(int(float(p.answer)) + 1)
  assert gsm.score(f"<answer>{wrong}</answer>", p).reward == 0.01
  assert gsm.score("<answer>a lot</answer>", p).reward == 0.0
  assert not gsm.score(f"<answer>{wrong}</answer>", p).correct


def test_gsm_symbolic_scorer_quirks(gsm):
  # Its regex reads the FIRST number, drops a leading minus and stops at commas: all three score 0.01.
  p = gsm[0]
  assert gsm.score(f"<answer>{p.answer} or 7</answer>", p).reward == 1.0
  assert gsm.score(f"<answer>7 or {p.answer}</answer>", p).reward == 0.01
  negative = tasks.Problem(question="", answer="-5", entry={**p.entry, "answer": "-5"})
  assert gsm.score("<answer>-5</answer>", negative).reward == 0.01
  thousands = tasks.Problem(question="", answer="28080", entry={**p.entry, "answer": "28080"})
  assert gsm.score("<answer>28,080</answer>", thousands).reward == 0.01


@pytest.mark.parametrize("text, expected", [
  ("<answer>1</answer> then <answer>2</answer>", ("2", True)),  # last tag wins
  ("<ANSWER> 3 </Answer>", ("3", True)),  # case-insensitive tags, content stripped
  ("<answer><answer>4</answer></answer>", ("4", True)),  # nested: innermost pair
  ("<answer>5</answer><answer> </answer>", ("5", True)),  # blank pairs do not count
  ("<answer>6</answer> and <answer>7", ("6", True)),  # unclosed last tag does not count
  ("<answer>8 so 9", ("9", False)),  # only an unclosed tag: fall back to the last number
  ("12 + 3 = 15.", ("15", False)),  # last number, sentence period excluded
  ("it is -4", ("-4", False)),  # minus sign kept
  ("from 3-5", ("5", False)),  # hyphen after a digit is not a sign
  ("about 28,080.5 dollars", ("28,080.5", False)),  # thousands and decimals verbatim
  ("x12 and H2O", (None, False)),  # digits glued to letters are not numbers
  ("no idea", (None, False)),
  ("", (None, False)),
])
def test_extract_answer(text, expected):
  assert extract_answer(text) == expected


def test_no_answer_scores_zero(arith):
  s = arith.score("I do not know.", arith[0])
  assert s == tasks.Score(reward=0.0, correct=False, extracted=None, formatted=False)


def test_untagged_true_answer_scores_without_format(arith):
  # The fallback number is scored by the dataset like a tagged one; only `formatted` differs.
  p = arith[0]
  s = arith.score(f"The result is {p.answer}.", p)
  assert (s.reward, s.correct, s.extracted, s.formatted) == (1.0, True, p.answer, False)


def test_format_bonus():
  # Reward = score_answer + 0.25 when a non-blank tag is present (DeepSeek-R1 accuracy + format reward).
  task = make_task("basic_arithmetic", seed=0, size=5, format_bonus=0.25)
  p = task[1]
  wrong = str(int(p.answer) + 1)
  assert task.score(f"<answer>{p.answer}</answer>", p).reward == 1.25
  assert task.score(f"<answer>{wrong}</answer>", p).reward == 0.25
  assert task.score(f"{p.answer}", p).reward == 1.0
  assert task.score("<answer> </answer>", p).reward == 0.0


def test_format_messages(arith):
  p = arith[0]
  assert format_messages(p) == [{"role": "user", "content": f"{p.question}\n{DEFAULT_INSTRUCTION}"}]
  assert format_messages(p, instruction="Answer.")[0]["content"].endswith("\nAnswer.")


def test_few_shot_examples_come_before_the_question(arith):
  # Two solved examples, each a user turn (question + instruction) and an assistant turn with the
  # answer in tags, then the question: 2 * 2 + 1 = 5 messages, in that order.
  p, a, b = arith[0], arith[1], arith[2]
  q = lambda x: {"role": "user", "content": f"{x.question}\n{DEFAULT_INSTRUCTION}"}
  assert format_messages(p, examples=(a, b)) == [
      q(a), {"role": "assistant", "content": f"<answer>{a.answer}</answer>"},
      q(b), {"role": "assistant", "content": f"<answer>{b.answer}</answer>"}, q(p)]


def test_few_shot_examples_are_the_same_for_every_seed_of_the_task():
  # The examples are items 0 .. k-1 of the generator at few_shot_seed, whatever the task's own seed,
  # so training (seed 0) and evaluation (seed 1_000_000) prompts show the same ones.
  train_task = make_task("basic_arithmetic", seed=0, size=10, few_shot=3, few_shot_seed=77)
  eval_task = make_task("basic_arithmetic", seed=1_000_000, size=10, few_shot=3, few_shot_seed=77)
  shots = make_task("basic_arithmetic", seed=77, size=3)
  assert [e.question for e in train_task.examples] == [shots[i].question for i in range(3)]
  assert train_task.examples == eval_task.examples
  assert train_task.messages(train_task[4]) == format_messages(train_task[4], examples=train_task.examples)
  assert len(train_task.messages(train_task[4])) == 7
  assert make_task("basic_arithmetic", seed=0, size=10).messages(train_task[4]) == format_messages(train_task[4])


@pytest.mark.parametrize("kwargs, match", [
  (dict(few_shot=-1), "few_shot must be an int >= 0, got -1"),
  (dict(few_shot=True), "few_shot must be an int >= 0, got True"),
  (dict(few_shot=2, few_shot_seed=-3), "few_shot_seed must be a non-negative int, got -3"),
])
def test_bad_few_shot_is_refused(kwargs, match):
  with pytest.raises(ValueError, match=match):
    make_task("basic_arithmetic", seed=0, size=4, **kwargs)


def test_unknown_task_name():
  with pytest.raises(ValueError, match="basic_arithmetic.*gsm_symbolic"):
    make_task("nope", seed=0, size=1)


@pytest.mark.parametrize("kwargs, match", [
  (dict(name="basic_arithmetic", max_term=3), "max_term"),  # typo of max_terms
  (dict(name="basic_arithmetic", min_terms=0), "min_terms"),  # reasoning-gym's assert, re-raised
  (dict(name="basic_arithmetic", max_terms="3"), "max_terms"),  # wrong type
  (dict(name="gsm_symbolic", difficulty=2.0), "difficulty"),  # only 1.0 is supported
  (dict(name="gsm_symbolic", seed=-1), "seed"),
  (dict(name="gsm_symbolic", size=0), "size"),
  (dict(name="gsm_symbolic", format_bonus=float("nan")), "format_bonus"),
])
def test_bad_options(kwargs, match):
  kwargs = {"seed": 0, "size": 1, **kwargs}
  with pytest.raises(ValueError, match=match):
    make_task(**kwargs)


HOSTILE = [
  "", " ", "\x00", "\ud800", "🙂" * 1000, "<answer>", "</answer>", "</answer>5<answer>",
  "<answer><answer>5</answer>", "<answer>5", "<answer>٣</answer>", "<answer>５</answer>",
  "<answer>nan</answer>", "<answer>inf</answer>", "1e999", "<answer>-</answer>", "<answer>1/0</answer>",
  "9" * 1_000_000, "<answer>" * 100_000, "<answer>1</answer>" * 100_000, "<answer>" + "x" * 1_000_000,
  "-" * 1_000_000, "1," * 500_000,
]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_hostile_completions_do_not_raise(name):
  # Every registered task: a reward in [0, 1 + bonus], extracted None or a substring of the text, in < 5 s.
  task = make_task(name, seed=0, size=1, format_bonus=0.5)
  p = task[0]
  start = time.perf_counter()
  for text in HOSTILE:
    s = task.score(text, p)
    assert math.isfinite(s.reward) and 0.0 <= s.reward <= 1.5, (text[:40], s)
    assert s.extracted is None or s.extracted in text
  assert time.perf_counter() - start < 5.0


# ---- strict answer extraction -------------------------------------------------------------------------

@pytest.mark.parametrize("text,forgiving,strict", [
    # Cut off by the token budget: forgiving reads the number after the unclosed tag, strict nothing.
    ("Let me compute. <answer>-12", ("-12", False), (None, False)),
    # Untagged last number: the forgiving fallback; strict: nothing.
    ("5 - 17 is -12, so -12", ("-12", False), (None, False)),
    # A closed tag counts in both modes (the last non-blank one).
    ("<answer>3</answer> no wait <answer> -12 </answer>", ("-12", True), ("-12", True)),
    # A closed pair followed by an unclosed one: the closed one in both modes.
    ("<answer>7</answer> then <answer>8", ("7", True), ("7", True)),
    ("<answer> </answer> 4", ("4", False), (None, False)),
])
def test_extract_answer_forgiving_and_strict_modes(text, forgiving, strict):
  assert extract_answer(text) == forgiving
  assert extract_answer(text, strict=True) == strict


def test_task_strict_mode_scores_only_closed_tags():
  # The same completions scored by the forgiving default and by a strict task: an unclosed or
  # missing tag with the right number is correct (reward 1.0) only when forgiving; with strict it
  # is 0. A closed tag scores 1.0 + format_bonus 0.1 in both.
  forgiving = make_task("basic_arithmetic", seed=0, size=4, format_bonus=0.1)
  strict = make_task("basic_arithmetic", seed=0, size=4, format_bonus=0.1, strict_answer=True)
  assert not forgiving.strict_answer and strict.strict_answer
  problem = forgiving[0]
  for text in (f"<answer>{problem.answer}", f"The answer is {problem.answer}"):
    assert forgiving.score(text, problem).correct and forgiving.score(text, problem).reward == 1.0
    s = strict.score(text, problem)
    assert (s.reward, s.correct, s.extracted, s.formatted) == (0.0, False, None, False)
  closed = f"<answer>{problem.answer}</answer>"
  for task in (forgiving, strict):
    assert task.score(closed, problem).reward == pytest.approx(1.1)
  with pytest.raises(ValueError, match="strict_answer must be a bool"):
    make_task("basic_arithmetic", seed=0, size=4, strict_answer="yes")


def test_task_strict_answer_reaches_the_task(tmp_path):
  # "<answer>-12" (cut off by the budget) scores as -12 in the forgiving default, not in strict mode.
  for strict in (False, True):
    config = experiment_config(grpo_smollm2_arith, "smoke", tmp_path, **{"task.strict_answer": strict})
    task = runs.make_task_from(config)
    assert task.strict_answer is strict
    problem = task[0]
    score = task.score(f"<answer>{problem.answer}", problem)
    assert score.correct is (not strict)
