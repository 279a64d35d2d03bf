"""Held-out evaluation: greedy accuracy with its 95% Wilson interval, reward, format rate, length, pass@k.

    problems, dropped = heldout_problems(train_task, eval_task, size=200, training_items=60)
    results = evaluate(policy, tokenizer, eval_task, problems, key, max_new_tokens=32, temperature=1.0,
                       top_p=1.0, pass_k=8)
    row = summarize(list(results.values()), pass_k=8)   # {"accuracy", "accuracy_lo", "accuracy_hi", ...}

Each problem is answered twice from one prompt:
  - greedily (`sample_group` with temperature 0, one sample): the accuracy, mean reward, format
    rate (the task's `Score.formatted`: an <answer> tag) and mean completion length are those of
    the greedy completions;
  - `pass_k` samples at the run's sampling temperature and top-p in ONE `sample_group` call (the
    sampler's shared prefill): pass@k by the unbiased estimator of Chen et al. 2021 (`pass_at_k`)
    with n = k, and the mean correctness of the samples ("sampled_accuracy", pass@1 estimated from
    the same k samples).

Held out: evaluation problems come from their own task seed, and `heldout_problems` drops every
one whose question equals the question of a training item the run can draw (data positions
0 .. training_items - 1), so no evaluation prompt ever appears in training. reasoning-gym's small
question spaces make this necessary: basic_arithmetic's questions repeat (2 000 items of seed 0
hold 1 212 distinct questions, the one-digit ones most often), so a different seed alone does
not keep the sets apart. What the check costs: the evaluation set leans away from the questions
training saw (with many training items, more of the common one-digit questions are dropped);
`dropped` reports how many.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import numpy as np

from branch_replay_jax.distributed import hosts
from branch_replay_jax.models.loading import encode_chat, stop_ids
from branch_replay_jax.rollout.collect import turn_formats
from branch_replay_jax.rollout.environments import run_episode
from branch_replay_jax.rollout.episode_sampler import EpisodeSampler
from branch_replay_jax.rollout.sampler import sample_group
from branch_replay_jax.rollout.stop_strings import stop_table
from branch_replay_jax.rollout.tasks import Problem, Task

# The standard normal's 0.975 quantile: the z of a two-sided 95% interval.
Z_95 = 1.959963984540054


def wilson_interval(successes: int, n: int, z: float = Z_95) -> tuple[float, float]:
  """(lower, upper) bounds of the Wilson score interval for a binomial proportion.

  Wilson, E. B. (1927), "Probable inference, the law of succession, and statistical inference",
  Journal of the American Statistical Association 22(158), 209-212: with p = successes / n,

      centre = (p + z^2 / 2n) / (1 + z^2 / n)
      half   = z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / 4n^2)

  the interval is centre -/+ half (exactly 0 at 0 successes and 1 at n, clipped into [0, 1] against
  float rounding). Unlike the normal
  approximation p -/+ z sqrt(p (1 - p) / n) it never leaves [0, 1] and is not empty at p = 0 or 1.
  z = Z_95 gives the 95% interval; 8 of 10 gives (0.4902, 0.9433).

  Args:
    successes: int in [0, n].
    n: int trials >= 1.
    z: float > 0, the normal quantile of the confidence level.

  Raises:
    ValueError: n < 1 or successes outside [0, n].
  """
  if n < 1 or not 0 <= successes <= n:
    raise ValueError(f"wilson_interval: need n >= 1 and 0 <= successes <= n, got successes={successes}, n={n}")
  p, z2 = successes / n, z * z
  denominator = 1.0 + z2 / n
  centre = (p + z2 / (2 * n)) / denominator
  half = z / denominator * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
  # At 0 (n) successes the lower (upper) bound is exactly 0 (1); float rounding would leave ~1e-16.
  return (0.0 if successes == 0 else max(0.0, centre - half)), (1.0 if successes == n else min(1.0, centre + half))


def pass_at_k(n: int, c: int, k: int) -> float:
  """The unbiased pass@k estimate of one problem from n samples of which c are correct.

  Chen et al. 2021, "Evaluating Large Language Models Trained on Code" (arXiv 2107.03374), eq. 1:
  pass@k = 1 - C(n - c, k) / C(n, k), the probability that k of the n samples drawn without
  replacement include a correct one; computed as 1 - prod_{i = n-c+1}^{n} (1 - k / i), the paper's
  numerically stable form. With n = k (what `evaluate` draws) it is 1 when any sample is correct,
  else 0. n = 5, c = 2, k = 2: 1 - C(3, 2) / C(5, 2) = 1 - 3/10 = 0.7.

  Raises:
    ValueError: k < 1, n < k, or c outside [0, n].
  """
  if k < 1 or n < k or not 0 <= c <= n:
    raise ValueError(f"pass_at_k: need 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
  if n - c < k:
    return 1.0
  return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def normalized_question(question: str) -> str:
  """`question` with every run of whitespace one space, no surrounding whitespace, and Unicode case
  folding: the key two questions are the same by in the held-out split."""
  return " ".join(question.split()).casefold()


def heldout_problems(train_task: Task, eval_task: Task, *, size: int,
                     training_items: int) -> tuple[list[int], int]:
  """([size] indices into `eval_task` of problems no training item equals, how many were dropped).

  Walks eval_task's items 0, 1, ... and keeps the first `size` whose question differs from the
  question of every training item the run can draw, compared after whitespace and letter-case
  normalisation (`normalized_question`: a spacing or case variant of a training question is the same
  question, OpenRLHF #1089): train_task items 0 .. min(training_items,
  len(train_task)) - 1 (data position p draws item p mod len(train_task)), and from the question of
  every few-shot example (`eval_task.examples`: each prompt shows those solved).

  Raises:
    ValueError: eval_task runs out of items before `size` are kept (its seed's problems repeat the
      training questions, or the task's question space is too small for both sets).
  """
  seen = {normalized_question(train_task[i].question) for i in range(min(training_items, len(train_task)))}
  seen |= {normalized_question(ex.question) for ex in eval_task.examples}  # an example shows its answer
  kept, dropped = [], 0
  for j in range(len(eval_task)):
    if len(kept) == size:
      break
    if normalized_question(eval_task[j].question) in seen:
      dropped += 1
    else:
      kept.append(j)
  if len(kept) < size:
    raise ValueError(f"eval.size={size}: only {len(kept)} of the first {len(eval_task)} problems of the evaluation "
                     f"seed differ from the {len(seen)} distinct training questions; lower eval.size or choose "
                     "another task")
  return kept, dropped


def evaluate_problem(model, tokenizer, task: Task, problem: Problem, key, *, max_new_tokens: int,
                     temperature: float, top_p: float, pass_k: int,
                     stop_strings: tuple[str, ...] = ()) -> dict[str, Any]:
  """One problem's greedy answer and `pass_k` samples (none when 0), scored by the task. A completion
  ends at one of the model's stop ids, at one of `stop_strings` (rollout.stop_strings, matched on the
  decoded text: rollout/stop_strings.py) or at max_new_tokens.

  Returns:
    {"correct": bool, "reward": float, "formatted": bool, "length": int, "truncated": bool} of the
    greedy completion (length in tokens, counting its stop id; truncated: cut by max_new_tokens
    without one of the model's stop ids, `models.loading.stop_ids`, or a stop string), and
    "sampled_correct": int, how many of the pass_k samples
    are correct (0 when pass_k is 0).

  Raises:
    ValueError: prompt + max_new_tokens longer than the model's context (`sample_group`).
  """
  ids = encode_chat(tokenizer, task.messages(problem))
  common = dict(max_new_tokens=max_new_tokens, eos_ids=stop_ids(tokenizer), pad_id=tokenizer.pad_token_id or 0,
                stop_table=stop_table(tokenizer, tuple(stop_strings)))
  greedy = sample_group(model, ids, num_samples=1, key=key, temperature=0.0, **common)
  length = int(np.asarray(greedy.lengths)[0])
  text = tokenizer.decode(np.asarray(greedy.tokens)[0, :length], skip_special_tokens=True)
  score = task.score(text, problem)
  sampled_correct = 0
  if pass_k:
    ro = sample_group(model, ids, num_samples=pass_k, key=key, temperature=temperature, top_p=top_p, **common)
    tokens, lengths = np.asarray(ro.tokens), np.asarray(ro.lengths)
    texts = tokenizer.batch_decode([row[:n] for row, n in zip(tokens, lengths)], skip_special_tokens=True)
    sampled_correct = sum(task.score(t, problem).correct for t in texts)
  return {"correct": bool(score.correct), "reward": float(score.reward), "formatted": bool(score.formatted),
          "length": length, "truncated": bool(np.asarray(greedy.truncated)[0]), "sampled_correct": int(sampled_correct)}


def evaluate(policy, tokenizer, task: Task, problems: Sequence[int], key, *, max_new_tokens: int,
             temperature: float, top_p: float, pass_k: int, stop_strings: tuple[str, ...] = (),
             devices=None) -> dict[int, dict]:
  """{j: evaluate_problem(...)} for every j < len(problems) (task item problems[j]), on every process.

  Problem j draws its samples with fold_in(key, j), whatever device answers it, so the results
  do not depend on the layout.

  Args:
    policy: the model, or with `devices` {device: the model on it} for this process's devices.
    devices: None (every problem here, one after another), or [len(problems)] the device of each
      (`hosts.spread_devices`): this process's devices answer their problems in parallel
      (`hosts.run_on_devices`) and every process's results are gathered (`hosts.gather_items`, a
      collective every process joins).
  """
  settings = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, pass_k=pass_k,
                  stop_strings=tuple(stop_strings))
  keys = [jax.random.fold_in(key, j) for j in range(len(problems))]
  if devices is None:
    return {j: evaluate_problem(policy, tokenizer, task, task[p], keys[j], **settings) for j, p in enumerate(problems)}
  local = hosts.run_on_devices(lambda j, device: evaluate_problem(
      policy[device], tokenizer, task, task[problems[j]], jax.device_put(keys[j], device), **settings), devices)
  return hosts.gather_items(local)


def evaluate_episodes(model, tokenizer, task, env, problems: Sequence[int], key, *, episodes,
                      history: str = "tokens") -> dict[int, dict]:
  """{j: result} of one greedy episode (temperature 0, `EpisodeSampler`) per problem, task item
  problems[j], in `env` (rollout/environments.py) with the budgets of `episodes` (config
  rollout.episodes) and history (rollout.episodes.history, as training samples them), one after another on
  this process's device; problem j's key is fold_in(key, j).

  Each result has `summarize`'s keys (pass_k 0): "correct" (the environment's verdict, `ToolEnv.correct`;
  an environment without one: reward > 0), "reward", "formatted" (the share of the episode's model
  turns that are a parseable tool call or a tagged answer, `rollout.tools.turn_format`), "length"
  (model tokens), "truncated" (cut by a budget), and the episode's "tool_calls" and "turns".
  """
  out, stops = {}, stop_ids(tokenizer)
  for j, p in enumerate(problems):
    sampler = EpisodeSampler(model, key=jax.random.fold_in(key, j), temperature=0.0, eos_ids=stops,
                             pad_id=tokenizer.pad_token_id or 0, history=history)
    result = run_episode(env, task[p], p, tokenizer, sampler, max_turns=episodes.max_turns,
                         max_turn_tokens=episodes.max_turn_tokens, max_context=episodes.max_context,
                         max_episode_tokens=episodes.get("max_episode_tokens"), history=history)
    formats = turn_formats(result, tokenizer, getattr(env, "tools", {}))
    out[j] = {"correct": bool(getattr(env, "correct", result.reward > 0)), "reward": float(result.reward),
              "formatted": sum(f in ("tool_call", "answer") for f in formats) / len(formats),
              "length": result.model_tokens, "truncated": result.truncated,
              "tool_calls": result.tool_calls, "turns": result.turns}
  return out


def summarize(results: Sequence[dict], *, pass_k: int) -> dict[str, float | int]:
  """The evaluation's figures from `evaluate_problem` results (one per problem, any order).

  Returns:
    problems (n), accuracy (greedy, correct / n) with accuracy_lo / accuracy_hi (its 95% Wilson
    interval), reward_mean, format_rate, completion_len_mean (tokens) and truncated_frac (the
    fraction cut by the token budget without a stop id) of the greedy completions; for episodes
    (`evaluate_episodes`) format_rate is the mean of each episode's share of well-formatted turns,
    and tool_calls_per_episode and turns_per_episode are added;
    with pass_k >= 1 also pass_k, pass_at_k (the mean over problems of `pass_at_k(pass_k, c, pass_k)`)
    and sampled_accuracy (correct samples / (n pass_k)).

  Raises:
    ValueError: no results.
  """
  n = len(results)
  if n == 0:
    raise ValueError("summarize: no evaluation results")
  correct = sum(r["correct"] for r in results)
  lo, hi = wilson_interval(correct, n)
  row = {"problems": n, "accuracy": correct / n, "accuracy_lo": lo, "accuracy_hi": hi,
         "reward_mean": float(np.mean([r["reward"] for r in results])),
         "format_rate": float(np.mean([r["formatted"] for r in results])),
         "completion_len_mean": float(np.mean([r["length"] for r in results])),
         "truncated_frac": float(np.mean([r["truncated"] for r in results]))}
  if "tool_calls" in results[0]:   # episodes (`evaluate_episodes`)
    row.update(tool_calls_per_episode=float(np.mean([r["tool_calls"] for r in results])),
               turns_per_episode=float(np.mean([r["turns"] for r in results])))
  if pass_k:
    row.update(pass_k=pass_k, pass_at_k=float(np.mean([pass_at_k(pass_k, r["sampled_correct"], pass_k)
                                                         for r in results])),
               sampled_accuracy=sum(r["sampled_correct"] for r in results) / (n * pass_k))
  return row
