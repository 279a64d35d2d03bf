"""Tasks from any source (rollout/tasks/sources.py): reasoning-gym datasets by name with their options,
local JSONL / Parquet / CSV files and saved datasets, python task objects; the prompt fields; reward
functions by import path (rollout/tasks/rewards.py); bad input refused by field and value before the
model loads; one GRPO step of the tiny model on a JSONL task with a custom reward."""

import json
import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")   # nothing here may reach the hub


import numpy as np
import pytest

from branch_replay_jax.algorithms import grpo, runs
from branch_replay_jax.rollout.tasks import DEFAULT_INSTRUCTION, make_task
from branch_replay_jax.rollout.tasks import rewards as builtin
from branch_replay_jax.rollout.tasks.rewards import RewardError
from branch_replay_jax.rollout.tasks.sources import make_task_from_fields
from conftest import experiment_config, no_model_load
from experiments import grpo_smollm2_arith

ROWS = [{"question": f"What is {a} + {b}?", "answer": str(a + b), "level": a % 3} for a, b in
        [(1, 2), (3, 4), (5, 6), (7, 8), (9, 10), (11, 12), (13, 14), (15, 16), (17, 18), (19, 20)]]


def write_jsonl(path, rows):
  with open(path, "w") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")
  return str(path)


def task_section(**fields):
  """The default experiment's task section with `fields` set."""
  t = grpo_smollm2_arith.get_config("smoke").task
  for k, v in fields.items():
    t[k] = v
  return t


def file_section(tmp_path, **fields):
  return task_section(source=write_jsonl(tmp_path / "train.jsonl", ROWS), prompt_column="question", **fields)


def test_reading_libraries_load_only_when_a_file_or_math_task_is_built():
  # datasets (~1 s) and math_verify (sympy, antlr) load on demand: the config check and a
  # reasoning-gym run never import them.
  import subprocess
  import sys
  code = ("import sys, branch_replay_jax.rollout.tasks.sources, branch_replay_jax.algorithms.grpo; "
          "print('datasets' in sys.modules, 'math_verify' in sys.modules)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "False False"


# ---- the default experiment's task is unchanged ---------------------------------------------------------

@pytest.mark.parametrize("variant", ["", "learn"])
def test_default_experiment_task_has_the_same_prompts_and_rewards(variant):
  # The experiments' task built through the new sources equals make_task called as before the change
  # (name, seed, size, format_bonus, strict_answer, few-shot, options): the first 20 items' messages,
  # answers, and the scores of a right, a wrong and an untagged completion are the same. The message
  # text is also spelled out: one user turn "{question}\n{instruction}" after the few-shot turns.
  t = grpo_smollm2_arith.get_config(variant).task
  new = make_task_from_fields(t, seed=t.seed, size=t.size)
  old = make_task(t.name, seed=t.seed, size=t.size, format_bonus=t.format_bonus, strict_answer=t.strict_answer,
                  few_shot=t.few_shot, few_shot_seed=t.few_shot_seed)
  for i in range(20):
    a, b = new[i], old[i]
    assert (a.question, a.answer) == (b.question, b.answer)
    assert new.messages(a) == old.messages(b)
    assert new.messages(a)[-1] == {"role": "user", "content": f"{b.question}\n{DEFAULT_INSTRUCTION}"}
    assert len(new.messages(a)) == 2 * t.few_shot + 1
    for text in (f"<answer>{b.answer}</answer>", f"<answer>{b.answer}1</answer>", f"so {b.answer}"):
      assert new.score(text, a) == old.score(text, b)


# ---- reasoning-gym by name, options from the command line -----------------------------------------------

def test_any_reasoning_gym_dataset_by_source_with_options_from_the_command_line():
  # --config.task.options takes a dict literal (config_flags parses it): chain_sum with 1-digit terms,
  # so every number in the question has one digit; the true answer in tags scores 1.0 (chain_sum's
  # own score_answer, the default reward).
  from absl import flags
  from ml_collections import config_flags
  argv = ["prog", "--config=experiments/grpo_smollm2_arith.py:smoke", "--config.task.source=reasoning_gym:chain_sum",
          '--config.task.options={"min_digits": 1, "max_digits": 1, "min_terms": 2, "max_terms": 3}']
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=values, sys_argv=argv)   # as main.py's flag, on argv
  values(argv)
  config = values.config
  task = runs.make_task_from(config)
  assert task.name == "chain_sum" and task.options["max_digits"] == 1
  for i in range(10):
    p = task[i]
    numbers = [w for w in p.question.replace("=", " ").split() if w.isdigit()]
    assert numbers and all(len(n) == 1 for n in numbers), p.question
    assert task.score(f"<answer>{p.answer}</answer>", p).correct
  assert runs.fingerprint(config)["task_source"] == "reasoning_gym:chain_sum"


def test_task_name_may_be_any_reasoning_gym_dataset():
  # Without task.source the name is the dataset (before: only the two presets were accepted).
  task = make_task_from_fields(task_section(name="chain_sum", options={}), seed=0, size=5)
  assert len(task) == 5 and task.dataset.__class__.__name__ == "ChainSumDataset"


# ---- files ---------------------------------------------------------------------------------------------

def test_jsonl_task_rows_columns_order_and_default_reward(tmp_path):
  # 10 rows shuffled by task.seed, capped at task.size = 64 (all 10); the same seed gives the same
  # order, another seed another; the default reward is the exact match of the extracted answer + bonus.
  t = file_section(tmp_path, format_bonus=0.5)
  a, b = make_task_from_fields(t, seed=0, size=64), make_task_from_fields(t, seed=0, size=64)
  other = make_task_from_fields(t, seed=1, size=64)
  assert len(a) == 10 and sorted(p.question for p in a) == sorted(r["question"] for r in ROWS)
  assert [p.question for p in a] == [p.question for p in b] != [p.question for p in other]
  p = a[0]
  assert a.messages(p) == [{"role": "user", "content": f"{p.question}\n{DEFAULT_INSTRUCTION}"}]
  assert a.score(f"<answer>{p.answer}</answer>", p).reward == 1.5
  assert a.score(f"it is {p.answer}", p).reward == 1.0
  assert a.score(f"<answer>{p.answer}0</answer>", p).reward == 0.5
  assert len(make_task_from_fields(t, seed=0, size=3)) == 3


def test_held_out_split_is_disjoint_and_eval_file_is_read(tmp_path):
  # eval_split 0.3 of 10 rows: 3 held out, 7 train, no question in both; an eval file is read instead.
  t = file_section(tmp_path, eval_split=0.3)
  train, held = make_task_from_fields(t, seed=0, size=64), make_task_from_fields(t, seed=5, size=64, split="eval")
  assert (len(train), len(held)) == (7, 3)
  assert not {p.question for p in train} & {p.question for p in held}
  extra = [{"question": "What is 100 + 1?", "answer": "101", "level": 0}]
  t = file_section(tmp_path, eval_source=write_jsonl(tmp_path / "eval.jsonl", extra))
  assert [p.question for p in make_task_from_fields(t, seed=5, size=64, split="eval")] == ["What is 100 + 1?"]
  assert len(make_task_from_fields(t, seed=0, size=64)) == 10


@pytest.mark.parametrize("kind", ["parquet", "csv", "disk"])
def test_parquet_csv_and_saved_dataset_read_like_jsonl(tmp_path, kind):
  import datasets
  ds = datasets.Dataset.from_list(ROWS)
  path = str(tmp_path / ("saved" if kind == "disk" else f"rows.{kind}"))
  {"parquet": ds.to_parquet, "csv": ds.to_csv, "disk": ds.save_to_disk}[kind](path)
  jsonl = make_task_from_fields(file_section(tmp_path), seed=0, size=64)
  other = make_task_from_fields(task_section(source=path, prompt_column="question"), seed=0, size=64)
  assert [(p.question, p.answer) for p in other] == [(p.question, p.answer) for p in jsonl]


def test_blank_cells_are_empty_and_answers_are_read_as_written(tmp_path):
  # unsloth #10813, pandas #28335: a CSV integer column with one blank cell read as float made the
  # answer "4" the text "4.0" (a correct "<answer>4</answer>" scored 0), and "007" became 7; a blank
  # cell reached the prompt as "None", and a row without an answer paid exact_match 1.0 for "None".
  # Read as text: "4" and "007" as written, blank cells "", a missing answer never scores.
  (tmp_path / "rows.csv").write_text("question,answer,hint\nWhat is 2+2?,4,\nSeven?,007,x\nNo answer?,,\n")
  task = make_task_from_fields(task_section(source=str(tmp_path / "rows.csv"), prompt_column="question",
                                            prompt_template="{question} {hint}"), seed=0, size=64)
  by_question = {p.question: p for p in task}
  assert {q: p.answer for q, p in by_question.items()} == {"What is 2+2?": "4", "Seven?": "007", "No answer?": ""}
  four, blank = by_question["What is 2+2?"], by_question["No answer?"]
  assert task.score("<answer>4</answer>", four).correct and not task.score("<answer></answer>", blank).correct
  assert task.messages(four)[-1]["content"] == "What is 2+2? "   # the blank hint is "", not "None"
  assert builtin.exact_match(["q"] * 3, ["<answer>None</answer>", "None", "<answer></answer>"],
                             [None, None, ""]) == [0.0, 0.0, 0.0]
  # A JSONL null answer is no answer too, and a null in a column the template names is "".
  rows = [{"question": "Q?", "answer": None, "hint": None}]
  task = make_task_from_fields(task_section(source=write_jsonl(tmp_path / "n.jsonl", rows), prompt_column="question",
                                            prompt_template="{question}{hint}"), seed=0, size=64)
  assert (task[0].answer, task.messages(task[0])[-1]["content"]) == ("", "Q?")


def test_files_as_people_write_them(tmp_path):
  # Each of these read wrong before: a trailing comma on every row (pandas made the first column its
  # index and shifted the rest: question "4", answer ""), Excel's byte-order mark, a column whose
  # name holds a dot, and JSON answers in a column mixing ints and floats (4 read as "4.0").
  rows = lambda path, **f: [(p.question, p.answer) for p in make_task_from_fields(
      task_section(source=str(path), **f), seed=0, size=64)]
  (tmp_path / "trailing.csv").write_text("question,answer\nWhat is 2+2?,4,\n")
  assert rows(tmp_path / "trailing.csv", prompt_column="question") == [("What is 2+2?", "4")]
  (tmp_path / "bom.csv").write_bytes("\ufeffquestion,answer\nWhat is 2+2?,4\n".encode("utf-8"))
  assert rows(tmp_path / "bom.csv", prompt_column="question") == [("What is 2+2?", "4")]
  (tmp_path / "dotted.csv").write_text("question,reward_model.ground_truth\nWhat is 2+2?,4\n")
  assert rows(tmp_path / "dotted.csv", prompt_column="question",
              answer_column="reward_model.ground_truth") == [("What is 2+2?", "4")]
  mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"q": "a", "answer": 4}, {"q": "b", "answer": 4.5},
                                                  {"q": "c", "answer": True}])
  task = make_task_from_fields(task_section(source=mixed, prompt_column="q"), seed=0, size=64)
  assert sorted((p.question, p.answer, p.entry["answer"]) for p in task) == [
      ("a", "4", "4"), ("b", "4.5", "4.5"), ("c", "true", "true")]
  # A header with no rows, and a header naming a column twice, are refused by field.
  (tmp_path / "header.csv").write_text("question,answer\n")
  (tmp_path / "twice.csv").write_text("question,answer,answer\nq,1,2\n")
  with pytest.raises(ValueError, match=r"task.source='.*header.csv' could not be read by datasets"):
    rows(tmp_path / "header.csv", prompt_column="question")
  with pytest.raises(ValueError, match=r"task.source='.*twice.csv': its header names a column twice"):
    rows(tmp_path / "twice.csv", prompt_column="question")


@pytest.mark.parametrize("cell,problem", [
    (["What is 2+2?", "and 3+3?"], r"not a list of \{\"role\", \"content\"\} messages"),
    ([{"role": "system", "content": "Be brief."}], "a conversation without a non-blank user message"),
    ([{"role": "user", "content": "  "}], "a conversation without a non-blank user message")])
def test_a_prompt_that_is_not_a_question_or_a_chat_is_refused_naming_the_rows(tmp_path, cell, problem):
  source = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": [{"role": "user", "content": "Q?"}], "answer": "1"},
                                                 {"prompt": cell, "answer": "2"}])
  with pytest.raises(ValueError, match=rf"task.prompt_column='prompt': 1 rows of .* are {problem} there \(rows \[1\]"):
    make_task_from_fields(task_section(source=source, prompt_column="prompt"), seed=0, size=64)


@pytest.mark.parametrize("kind", ["csv", "jsonl"])
def test_a_blank_question_is_refused_naming_the_rows(tmp_path, kind):
  # A blank question used to become the question "None" (JSONL null) or "" (CSV): refused when the
  # task is built, naming the column and the rows (0-based, file order), before any model loads.
  if kind == "csv":
    (tmp_path / "rows.csv").write_text("question,answer\nWhat is 2+2?,4\n,5\n  ,6\n")
    source = str(tmp_path / "rows.csv")
  else:
    source = write_jsonl(tmp_path / "rows.jsonl", [{"question": "Q?", "answer": "1"}, {"question": None, "answer": "2"},
                                                   {"question": " ", "answer": "3"}])
  with pytest.raises(ValueError, match=r"task.prompt_column='question': 2 rows of .* are blank there \(rows \[1, 2\]"):
    make_task_from_fields(task_section(source=source, prompt_column="question"), seed=0, size=64)


def test_verl_struct_answer_column_by_dotted_path(tmp_path):
  # verl #758: the answer sits in reward_model = {"ground_truth", "style"} and the prompt is a chat.
  # Naming the struct made its dict text the answer (every reward 0, silently): refused, naming its
  # fields; the dotted path reads the field, and reward functions get it as `answer`.
  import datasets
  rows = [{"prompt": [{"role": "user", "content": f"What is {a} + {a}?"}], "data_source": "arith",
           "reward_model": {"ground_truth": str(2 * a), "style": "rule"}} for a in range(1, 5)]
  path = str(tmp_path / "verl.parquet")
  datasets.Dataset.from_list(rows).to_parquet(path)
  with pytest.raises(ValueError, match=r"task.answer_column='reward_model' .* is a struct with the fields "
                                       r"\['ground_truth', 'style'\], not text; .*'reward_model.ground_truth'"):
    make_task_from_fields(task_section(source=path, prompt_column="prompt", answer_column="reward_model"),
                          seed=0, size=64)
  with pytest.raises(ValueError, match=r"task.answer_column='reward_model.truth': no such column"):
    make_task_from_fields(task_section(source=path, prompt_column="prompt", answer_column="reward_model.truth"),
                          seed=0, size=64)
  task = make_task_from_fields(task_section(source=path, prompt_column="prompt", answer_column="reward_model.ground_truth",
                                            rewards=("branch_replay_jax.rollout.tasks.rewards:exact_match",),
                                            format_bonus=0.0), seed=0, size=64)
  p = task[0]
  assert p.answer == str(2 * int(p.question.split()[2]))
  assert task.messages(p) == [{"role": "user", "content": p.question}]
  assert task.score(f"<answer>{p.answer}</answer>", p).reward == 1.0


def test_prompt_fields_system_prompt_template_and_messages_column(tmp_path):
  # A system prompt comes first; the template may name a column; "" is an empty system turn (the
  # nearest to none SmolLM2's template allows: without one it writes its own default).
  t = file_section(tmp_path, system_prompt="Be brief.", instruction="Answer:", prompt_template="[{level}] {question} {instruction}")
  task = make_task_from_fields(t, seed=0, size=64)
  p = task[0]
  assert task.messages(p) == [{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": f"[{p.entry['level']}] {p.question} Answer:"}]
  chats = [{"messages": [{"role": "system", "content": "old"}, {"role": "user", "content": r["question"]}],
            "answer": r["answer"]} for r in ROWS]
  t = task_section(source=write_jsonl(tmp_path / "chat.jsonl", chats), messages_column="messages", system_prompt="")
  task = make_task_from_fields(t, seed=0, size=64)
  p = task[0]
  assert task.messages(p) == [{"role": "system", "content": ""}, {"role": "user", "content": p.question}]


def test_python_task_by_import_path(tmp_path):
  # A factory in a file, called with seed, size, split and task.options.
  (tmp_path / "mytask.py").write_text(
      "from branch_replay_jax.rollout.tasks import Problem, Score\n"
      "class Squares:\n"
      "  examples = ()\n"
      "  def __init__(self, seed, size, split, offset=0):\n"
      "    self.n, self.base = size, seed + offset\n"
      "  def __len__(self): return self.n\n"
      "  def __getitem__(self, i):\n"
      "    if not 0 <= i < self.n: raise IndexError(i)\n"
      "    k = self.base + i\n"
      "    return Problem(question=f'{k}^2?', answer=str(k * k), entry={'k': k})\n"
      "  def messages(self, p): return [{'role': 'user', 'content': p.question}]\n"
      "  def score(self, text, p):\n"
      "    ok = text.strip() == p.answer\n"
      "    return Score(reward=float(ok), correct=ok, extracted=text, formatted=False)\n"
      "def make(seed, size, split, **options): return Squares(seed, size, split, **options)\n")
  t = task_section(source=f"python:{tmp_path / 'mytask.py'}:make", options={"offset": 10}, format_bonus=0.0)
  task = make_task_from_fields(t, seed=2, size=4)
  assert len(task) == 4 and task[1].question == "13^2?" and task.score("169", task[1]).correct


# ---- rewards by import path ------------------------------------------------------------------------------

def rewards_file(tmp_path):
  (tmp_path / "my_rewards.py").write_text(
      "import math\n"
      "def longer(prompts, completions, **columns): return [float(len(c)) for c in completions]\n"
      "def level_only(prompts, completions, level, **columns): return [None if l == 0 else 1.0 for l in level]\n"
      "def boom(prompts, completions, **columns): raise RuntimeError('boom')\n"
      "def nan(prompts, completions, **columns): return [math.nan] * len(completions)\n"
      "def short(prompts, completions, **columns): return [1.0]\n"
      "def two_args(prompts): return []\n"
      "def needs_grade(prompts, completions, grade): return [0.0] * len(completions)\n"
      "import asyncio, sys, types\n"   # each reward path loads its own copy of this file: share the set
      "running = sys.modules.setdefault('judges_running', types.SimpleNamespace(names=set())).names\n"
      "async def both_running(name):\n"   # returns once the other judge runs too; raises after 5 s
      "  running.add(name)\n"
      "  for _ in range(500):\n"
      "    if len(running) == 2: return\n"
      "    await asyncio.sleep(0.01)\n"
      "  raise TimeoutError(f'{name} ran alone: the judges were not awaited concurrently')\n"
      "async def judged(prompts, completions, **columns):\n"
      "  await both_running('judged')\n"
      "  return [float(len(c)) for c in completions]\n"
      "class Judge:\n"
      "  async def __call__(self, prompts, completions, **columns):\n"
      "    await both_running('judge')\n"
      "    return [1.0 for c in completions]\n"
      "judge = Judge()\n"
      "async def async_boom(prompts, completions, **columns): raise RuntimeError('async boom')\n")
  return str(tmp_path / "my_rewards.py")


def test_reward_functions_weighted_sum_terms_and_columns(tmp_path):
  # reward = 2 x len(c) + 0.5 x level_only, level_only None (no contribution) where level == 0; the
  # columns (answer, level) arrive as keyword lists of G equal values; correct stays the task's own.
  path = rewards_file(tmp_path)
  t = file_section(tmp_path, format_bonus=0.0, rewards=(f"{path}:longer", f"{path}:level_only"),
                   reward_weights=(2.0, 0.5))
  task = make_task_from_fields(t, seed=0, size=64)
  for i in range(len(task)):
    p = task[i]
    texts = [f"<answer>{p.answer}</answer>", "no"]
    scores = task.score_group(texts, p, index=i)
    bonus = 0.0 if p.entry["level"] == 0 else 0.5
    assert [s.reward for s in scores] == [2.0 * len(texts[0]) + bonus, 2.0 * 2 + bonus]
    assert [s.correct for s in scores] == [True, False]
    assert scores[0].terms == {"longer": float(len(texts[0])), "level_only": None if bonus == 0 else 1.0}


def test_async_reward_functions_are_awaited_together(tmp_path):
  # TRL PR #4567: an async def reward, or an object whose __call__ is async (an LLM judge), returned
  # a coroutine and stopped the step. Both are awaited, concurrently: each judge returns only once
  # the other has started (awaited one after the other, the first would raise after 5 s), and their
  # sum is the reward: len(c) + 1.
  path = rewards_file(tmp_path)
  task = make_task_from_fields(file_section(tmp_path, format_bonus=0.0, rewards=(f"{path}:judged", f"{path}:judge")),
                               seed=0, size=64)
  scores = task.score_group(["abc", "de"], task[0], index=0)
  assert [s.reward for s in scores] == [4.0, 3.0] and scores[0].terms == {"judged": 3.0, "Judge": 1.0}


@pytest.mark.parametrize("name,message", [
    ("boom", r"task.rewards\[0\]='.*:boom' raised RuntimeError\('boom'\) on the completions of data position 7"),
    ("async_boom", r"task.rewards\[0\]='.*:async_boom' raised RuntimeError\('async boom'\) on the completions of "
                   r"data position 7"),
    ("nan", r"task.rewards\[0\]='.*:nan' returned nan for completion 0 of data position 7"),
    ("short", r"task.rewards\[0\]='.*:short' returned 1 values on the 2 completions of data position 7: \[1.0\]"),
])
def test_a_failing_reward_names_the_function_the_position_and_the_value(tmp_path, name, message):
  t = file_section(tmp_path, format_bonus=0.0, rewards=(f"{rewards_file(tmp_path)}:{name}",))
  task = make_task_from_fields(t, seed=0, size=64)
  with pytest.raises(RewardError, match=message):
    task.score_group(["a", "b"], task[7], index=7)


def test_each_reward_function_is_its_own_metric_over_the_completions_it_scored():
  # Two groups: "a" scored 1, None, 3, None -> mean 2 over the two it scored; "b" returned None
  # everywhere -> no metric; a group without reward functions (None) adds nothing.
  from types import SimpleNamespace
  from branch_replay_jax.algorithms import loop
  groups = [SimpleNamespace(reward_terms={"a": np.array([1.0, np.nan]), "b": np.array([np.nan, np.nan])}),
            SimpleNamespace(reward_terms={"a": np.array([3.0, np.nan]), "b": np.array([np.nan, np.nan])})]
  assert loop.reward_means(groups) == {"rewards/a": 2.0}
  assert loop.reward_means([SimpleNamespace(reward_terms=None)]) == {}


def test_math_verify_reward_compares_values_not_strings():
  # 1/2 = 0.5 = \frac{1}{2}; 0.4 is wrong; no answer at all scores 0.
  texts = ["<answer>\\frac{1}{2}</answer>", "<answer>1/2</answer>", "<answer>0.4</answer>", "no idea",
           "so the result is $\\boxed{0.5}$"]
  assert builtin.math_verify([""] * 5, texts, answer=["0.5"] * 5) == [1.0, 1.0, 0.0, 0.0, 1.0]
  assert builtin.format_tags([""] * 2, ["<answer>3</answer>", "3"]) == [1.0, 0.0]
  assert builtin.exact_match([""] * 2, ["<answer>3</answer>", "<answer>3.0</answer>"], answer=["3", "3"]) == [1.0, 0.0]


def test_math_verify_reads_bare_latex_gold_answers():
  # open-r1 #628: a gold answer written as bare LaTeX did not parse, so correct completions scored 0.
  # "\dfrac{3}{4}" against <answer>3/4</answer> and "\sqrt{2}" against \boxed{\sqrt{2}} score 1;
  # a wrong value 0; a missing gold answer never scores.
  texts = ["<answer>3/4</answer>", "so it is $\\boxed{\\sqrt{2}}$", "<answer>2/3</answer>", "<answer>1</answer>"]
  assert builtin.math_verify([""] * 4, texts, answer=["\\dfrac{3}{4}", "\\sqrt{2}", "\\dfrac{3}{4}", None]) == [
      1.0, 1.0, 0.0, 0.0]


def test_a_math_verify_call_that_hangs_is_bounded_off_the_main_thread(monkeypatch):
  # Math-Verify #65: "\boxed{9^{9^{9^{9}}}}" hangs sympy, and off the main thread math-verify's signal
  # timeouts do nothing (the step hung for good). Called from a worker thread with a 3 s bound, the
  # hanging comparison scores 0 and is counted once; the worker is replaced, so the next completion
  # of the same call is still verified (1.0).
  import threading
  monkeypatch.setattr(builtin, "MATH_VERIFY_SECONDS", 3.0)
  builtin.take_math_verify_timeouts()
  out = []
  worker = threading.Thread(target=lambda: out.append(builtin.math_verify(
      [""] * 2, ["<answer>\\boxed{9^{9^{9^{9}}}}</answer>", "<answer>1</answer>"], answer=["1", "1"])))
  worker.start()
  worker.join(60)
  assert not worker.is_alive() and out == [[0.0, 1.0]]
  assert builtin.take_math_verify_timeouts() == 1 and builtin.take_math_verify_timeouts() == 0


def test_a_math_verify_worker_that_dies_mid_call_scores_0_and_is_replaced():
  # An out-of-memory kill of the worker during a comparison raised EOFError and stopped the step. It
  # now scores 0, is counted with the timeouts, and the next comparison runs in a new worker.
  import threading
  builtin.math_verify([""], ["<answer>1</answer>"], answer=["1"])   # the worker is up
  builtin.take_math_verify_timeouts()
  killer = threading.Timer(1.0, lambda: builtin._math_worker["process"].kill())
  killer.start()
  assert builtin.math_verify([""] * 2, ["<answer>\\boxed{9^{9^{9^{9}}}}</answer>", "<answer>1/2</answer>"],
                             answer=["1", "0.5"]) == [0.0, 1.0]
  assert builtin.take_math_verify_timeouts() == 1


# ---- bad input: a ValueError naming the field and the value, before the model loads -----------------------

def bad_cases(tmp_path):
  good = write_jsonl(tmp_path / "train.jsonl", ROWS)
  empty = tmp_path / "empty.jsonl"
  empty.write_text("")
  path = rewards_file(tmp_path)
  return [
      (dict(source=good, prompt_column="prompt"), "task.prompt_column='prompt': no such column"),
      (dict(source=good, prompt_column="question", answer_column="solution"), "task.answer_column='solution'"),
      (dict(source=str(empty)), "task.source='.*empty.jsonl' is empty"),
      (dict(source=str(tmp_path / "missing.jsonl")), "task.source='.*missing.jsonl': no such file"),
      (dict(source="hub:gsm8k"), "task.source='hub:gsm8k' is not a source"),
      (dict(source="reasoning_gym:chain_summ"), "chain_summ.*e.g. \\['chain_sum'"),
      (dict(name="chess"), "task.name='chess' is neither a preset"),
      (dict(source="python:no_such_module_xyz:make", format_bonus=0.0),
       "task.source='python:no_such_module_xyz:make'.*cannot be imported"),
      (dict(source="python:branch_replay_jax.rollout.tasks:make_task"), "task.format_bonus=0.1: a python task"),
      (dict(source=good, prompt_column="question", format_bonus=0.0, rewards=("no_such_module_xyz:f",)),
       r"task.rewards\[0\]='no_such_module_xyz:f': module 'no_such_module_xyz' cannot be imported"),
      (dict(source=good, prompt_column="question", format_bonus=0.0, rewards=(f"{path}:missing",)),
       r"task.rewards\[0\]='.*:missing': .* has no attribute 'missing'"),
      (dict(source=good, prompt_column="question", format_bonus=0.0, rewards=("exact_match",)),
       r"task.rewards\[0\]='exact_match' is not an import path"),
      (dict(source=good, prompt_column="question", format_bonus=0.0, rewards=(f"{path}:two_args",)),
       r"task.rewards\[0\]='.*:two_args': two_args\(prompts\) cannot be called"),
      (dict(source=good, prompt_column="question", format_bonus=0.0, rewards=(f"{path}:needs_grade",)),
       r"task.rewards\[0\]='.*:needs_grade'.*columns \['answer', 'level'\]"),
      (dict(source=good, prompt_column="question", rewards=(f"{path}:longer",)), "task.format_bonus=0.1 with task.rewards"),
      (dict(source=good, prompt_column="question", format_bonus=0.0, rewards=(f"{path}:longer",), reward_weights=(1.0, 2.0)),
       r"task.reward_weights=\(1.0, 2.0\) has 2 weights for 1 task.rewards"),
      (dict(source=good, prompt_column="question", few_shot=2), "task.few_shot=2"),
      (dict(source=good, prompt_column="question", options={"max_digits": 3}), "task.options=\\{'max_digits': 3\\}"),
      (dict(prompt_column="question"), "task.prompt_column='question' applies to a file source only"),
      (dict(source=good, prompt_column="question", eval_split=1.5), "task.eval_split=1.5"),
      (dict(source=good, prompt_column="question", prompt_template="{question} {grade}"), "task.prompt_template="),
  ]


def test_bad_task_input_is_refused_by_field_before_the_model_loads(monkeypatch, tmp_path):
  no_model_load(monkeypatch)
  for fields, message in bad_cases(tmp_path):
    config = experiment_config(grpo_smollm2_arith, "smoke", tmp_path / "run", **{f"task.{k}": v for k, v in fields.items()})
    with pytest.raises(ValueError, match=message):
      grpo.GRPO(config)


def test_eval_of_a_file_task_needs_an_eval_file_or_a_split(monkeypatch, tmp_path):
  no_model_load(monkeypatch)
  config = experiment_config(grpo_smollm2_arith, "smoke", tmp_path / "run", **{
      "task.source": write_jsonl(tmp_path / "train.jsonl", ROWS), "task.prompt_column": "question"})
  algorithm = grpo.GRPO(config)
  from branch_replay_jax.algorithms.evaluation import Evaluation
  with pytest.raises(ValueError, match="needs task.eval_source .* or task.eval_split > 0"):
    Evaluation(config, algorithm)


# ---- Hugging Face model directories --------------------------------------------------------------------

def test_bad_model_directory_is_refused_by_field_before_the_model_loads(monkeypatch, tmp_path):
  # A directory without config.json, and one whose config.json names an architecture our decoder
  # does not implement (gpt2), fail the config check with model.name and the value in the message.
  no_model_load(monkeypatch)
  empty = tmp_path / "empty"
  empty.mkdir()
  gpt2 = tmp_path / "gpt2"
  gpt2.mkdir()
  (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
  for directory, message in [(empty, "directory has no config.json"), (gpt2, "model_type 'gpt2' is not supported")]:
    config = experiment_config(grpo_smollm2_arith, "smoke", tmp_path / "run", **{"model.name": str(directory)})
    with pytest.raises(ValueError, match=f"model.name='{directory}': .*{message}"):
      grpo.GRPO(config)


# ---- end to end -----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_grpo_trains_an_hf_directory_on_a_jsonl_task_with_a_reward_by_import_path_and_stops_on_a_failing_one(
    tmp_path):
  # One step of the tiny model (from its Hugging Face directory) on a JSONL task rewarded by `longer` (the completion's length: varied
  # rewards, so the update is not vacuous) logs rewards/longer = the step's mean reward (its weight is
  # 1 and it is the only function); a second step with a raising function stops before the update
  # with the function and the data position (2: prompts_per_step 2 per step) in the error, and leaves
  # checkpoint 1 as it was, from which a resume with a working function finishes step 2.
  # The model: the tiny model exported as a Hugging Face directory (branch_replay_jax.export), the
  # format a user's own model comes in.
  from branch_replay_jax import export
  model_dir = export.export_base(experiment_config(grpo_smollm2_arith, "smoke", tmp_path / "never"),
                                 str(tmp_path / "hf"))
  path = rewards_file(tmp_path)
  overrides = {"model.name": model_dir, "task.source": write_jsonl(tmp_path / "train.jsonl", ROWS), "task.prompt_column": "question",
               "task.eval_split": 0.2, "task.format_bonus": 0.0, "task.rewards": (f"{path}:longer",),
               "train.steps": 1, "eval.size": 1}
  run_dir = tmp_path / "run"
  history = grpo.train(experiment_config(grpo_smollm2_arith, "smoke", run_dir, **overrides))
  record = history[0]
  assert record["rewards/longer"] == pytest.approx(record["reward_mean"]) and record["reward_std"] > 0
  from conftest import final_params
  before, meta = final_params(run_dir)
  assert meta == {"step": 1, "data_pos": 2}
  overrides["eval.size"] = 0   # the resumed runs: no evaluation (its compile is the test's largest cost)
  failing = experiment_config(grpo_smollm2_arith, "smoke", run_dir, **{**overrides, "train.steps": 2, "resume": True,
                                                                       "task.rewards": (f"{path}:boom",)})
  with pytest.raises(RewardError, match=r"task.rewards\[0\]='.*:boom' raised .* data position 2"):
    grpo.train(failing)
  after, meta = final_params(run_dir)
  assert meta == {"step": 1, "data_pos": 2}
  from conftest import max_rel
  assert max_rel(after, before) == 0.0
  fixed = experiment_config(grpo_smollm2_arith, "smoke", run_dir, **{**overrides, "train.steps": 2, "resume": True})
  assert [r["step"] for r in grpo.train(fixed)] == [2]


def test_dpo_scores_its_sampled_candidates_with_each_reward_function_and_logs_each(tmp_path):
  # DPO with data.source = "task" samples G candidates per prompt and pairs them by the task's reward:
  # with task.rewards that is the weighted sum of the functions, each returned per prompt (NaN where a
  # function returned None) and logged as rewards/NAME over the step (`loop.reward_term_means`).
  # longer = the completion's length in characters; level_only = None on level 0, else 1.
  import jax
  from flax import nnx
  from branch_replay_jax.algorithms import dpo, loop
  from branch_replay_jax.models import Llama, tiny_config
  from branch_replay_jax.models.loading import load_tokenizer
  from experiments import dpo_smollm2_arith
  path = rewards_file(tmp_path)
  config = experiment_config(dpo_smollm2_arith, "smoke", tmp_path / "run", **{
      "task.source": write_jsonl(tmp_path / "train.jsonl", ROWS), "task.prompt_column": "question",
      "task.format_bonus": 0.0, "task.rewards": (f"{path}:longer", f"{path}:level_only")})
  task = runs.make_task_from(config)
  tokenizer = load_tokenizer("smollm2-135m-instruct")
  model = Llama(tiny_config(vocab_size=len(tokenizer), max_positions=256), rngs=nnx.Rngs(0))
  out = dpo.sample_prompt(config, model, tokenizer, task, jax.random.key(0), 0)
  terms = out["reward_terms"]
  assert set(terms) == {"longer", "level_only"} and len(out["stop_reasons"]) == config.rollout.group_size
  np.testing.assert_allclose(out["rewards"], terms["longer"] + np.nan_to_num(terms["level_only"]), rtol=1e-6)
  assert (terms["longer"] > 0).all()
  assert loop.reward_term_means([terms, {"longer": np.array([1.0]), "level_only": np.array([np.nan])}]) == {
      "rewards/longer": pytest.approx((terms["longer"].sum() + 1) / (len(terms["longer"]) + 1)),
      **({} if np.isnan(terms["level_only"]).all() else {"rewards/level_only": 1.0})}
