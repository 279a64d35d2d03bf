"""One prompt's rollouts: sample (a group, a tree or G episodes) and score; raw trajectories, no loss arrays.

`rollout` samples G completions sharing one prefill (rollout.sampler.sample_group), or with
`rollout.tree_fanouts` set a tree (TreePO-style fixed-length segments, rollout.tree_sampler.sample_tree)
whose trajectories are the completions, scores them with the task and returns them raw
(`Trajectories`: prompt, tokens, lengths, stop reasons, sampler log-probs, the task's rewards). It
reads only the rollout section of the config. With `rollout.episodes` set, `rollout_episodes` runs G
multi-turn episodes of one problem in an environment instead (rollout/environments.py, `run_episode`;
docs/design.md, "Episodes"): one `EpisodeSampler` per episode, the prompt's K/V prefilled once and
shared, each episode's K/V kept across its turns; it returns them raw (`EpisodeTrajectories`). What
an algorithm trains on (reward shaping,
advantages, loss weights, the replay or naive layout) is built from them above this layer
(algorithms/groups.py), so sampling knows no loss.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from branch_replay_jax.data.trees import RolloutTree
from branch_replay_jax.models.loading import encode_chat, stop_ids
from branch_replay_jax.rollout.environments import EpisodeResult, run_episode
from branch_replay_jax.rollout.episode_sampler import EpisodeSampler
from branch_replay_jax.rollout.tools import turn_format
from branch_replay_jax.rollout.sampler import sample_group
from branch_replay_jax.rollout.stop_strings import stop_table
from branch_replay_jax.rollout.tasks.protocol import reward_terms, score_group
from branch_replay_jax.rollout.tree_sampler import sample_tree


@dataclasses.dataclass
class Trajectories:
  """One prompt's sampled and scored trajectories, as the sampler and the task give them.

  prompt_ids: [P] int, the chat-formatted prompt.
  tokens: [G, N] int sampled ids of a group (positions >= lengths[g] hold the pad id), N =
    rollout.max_new_tokens; None for a tree (its tokens are `tree`'s segments).
  logprobs: the sampler's log-probs (nats, at `rollout`'s logprob_temperature; `Rollouts.logprobs`): [G, N]
    float32 for a group, or a tree's per-node list ([L_n] each, root empty; `TreeRollout.logprobs`).
  lengths: [G] int completion lengths (tokens, the stop token included); a tree's in `tree.ends` order.
  truncated: [G] bool, the sampler's stop reason: True where the token budget cut the trajectory
    without a stop id or stop string, False where it ended with one (also on the budget's last token).
  task_rewards: [G] float64, the task's rewards (no shaping).
  correct: [G] bool, the task's verdicts.
  budget: the most tokens one trajectory could generate (`completion_budget`).
  tree: the sampled `RolloutTree` (trees), else None.
  sample: {"data_pos", "question", "answer", "completion"}: the first trajectory, for samples.jsonl.
  sample_s, score_s: seconds spent sampling and scoring.
  reward_terms: {name: [G] float64} per reward function of task.rewards (None where one returned
    None), or None without task.rewards.
  stop_reasons: [G] str, "eos" (a stop id), "stop_string" (rollout.stop_strings) or "length" (the
    token budget: truncated), `sampler.stop_reasons`; None from code that builds Trajectories without.
  routes, prompt_routes: a Qwen3-MoE sampler's recorded experts (-1: none), prompt_routes [P, layers, k] int32
    and routes a group's [G, N, layers, k] (`Rollouts.routes`) or a tree's per-node list [L_n, layers, k]
    (node 0's the prompt's, `TreeRollout.routes`); None for a model without experts.
  """
  prompt_ids: list
  tokens: np.ndarray | None
  logprobs: np.ndarray | list
  lengths: np.ndarray
  truncated: np.ndarray
  task_rewards: np.ndarray
  correct: np.ndarray
  budget: int
  tree: RolloutTree | None
  sample: dict
  sample_s: float
  score_s: float
  reward_terms: dict | None = None   # {name: [G] float64} per reward function of task.rewards (NaN: None), or None
  stop_reasons: np.ndarray | None = None
  routes: np.ndarray | list | None = None
  prompt_routes: np.ndarray | None = None


def completion_budget(rollout_config) -> int:
  """Most tokens one trajectory can generate (tokens): rollout.max_new_tokens, or a tree's
  rollout.segment_length x depth, or an episode's model tokens (rollout.episodes.max_episode_tokens,
  else max_turns x max_turn_tokens; its observations are not generated)."""
  r = rollout_config
  e = r.get("episodes")
  if e is not None:
    return e.max_episode_tokens if e.get("max_episode_tokens") is not None else e.max_turns * e.max_turn_tokens
  return r.segment_length * len(r.tree_fanouts) if r.get("tree_fanouts") else r.max_new_tokens


def rollout(rollout_config, model, tokenizer, task, data_pos: int, key, *,
            logprob_temperature: float = 1.0) -> Trajectories:
  """Sample and score one prompt (task item `data_pos`, wrapping around the task) with the rollout
  settings `rollout_config` (the config's rollout section). Completions end at one of the model's
  stop ids (`stop_ids`), at a stop string of rollout.stop_strings (rollout/stop_strings.py: matched
  on the decoded text as tokens arrive), or at the token budget. The sampler records each token's
  log-prob at `logprob_temperature` (the trainer's tau: a rollout correction compares like with like).

  Raises:
    ValueError: the prompt and the completion budget exceed the model's max_positions; stop strings
      with a tokenizer that is not byte-level (`stop_strings.token_bytes`).
  """
  problem = task[data_pos % len(task)]
  ids = encode_chat(tokenizer, task.messages(problem))
  r, cfg = rollout_config, model.config
  budget = completion_budget(r)
  if len(ids) + budget > cfg.max_positions:
    raise ValueError(f"task item {data_pos}: prompt of {len(ids)} tokens + {budget} completion tokens "
                     f"exceeds the model's max_positions={cfg.max_positions}")
  pad, stops = tokenizer.pad_token_id or 0, stop_ids(tokenizer)
  table = stop_table(tokenizer, tuple(r.get("stop_strings", ())))
  t0 = time.perf_counter()
  if r.get("tree_fanouts"):   # DPO's rollout section has none: groups
    sampled = sample_tree(model, ids, fanouts=list(r.tree_fanouts), segment_length=r.segment_length, key=key,
                          temperature=r.temperature, top_p=r.top_p, eos_ids=stops, pad_id=pad,
                          stop_table=table, logprob_temperature=logprob_temperature)
    tree, tokens, logprobs = sampled.tree, None, sampled.logprobs
    routes = None if sampled.routes is None else (sampled.routes, sampled.routes[0])
    completions = [tree.completion(g) for g in range(len(tree.ends))]
    truncated, reasons = np.asarray(sampled.truncated, bool), sampled.stop_reasons()
  else:
    ro = sample_group(model, ids, num_samples=r.group_size, max_new_tokens=r.max_new_tokens, key=key,
                      temperature=r.temperature, top_p=r.top_p, eos_ids=stops, pad_id=pad, stop_table=table,
                      logprob_temperature=logprob_temperature)
    tree, tokens, lengths, logprobs = None, np.asarray(ro.tokens), np.asarray(ro.lengths), np.asarray(ro.logprobs)
    routes = None if ro.routes is None else (np.asarray(ro.routes), np.asarray(ro.prompt_routes))
    completions = [row[:n] for row, n in zip(tokens, lengths)]
    truncated, reasons = np.asarray(ro.truncated, bool), ro.stop_reasons()
  t1 = time.perf_counter()
  texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
  scores = score_group(task, texts, problem, index=data_pos)   # a failing reward function raises here
  t2 = time.perf_counter()
  sample = {"data_pos": data_pos, "question": problem.question, "answer": problem.answer, "completion": texts[0]}
  return Trajectories(ids, tokens, logprobs, np.array([len(c) for c in completions]), truncated,
                      np.array([s.reward for s in scores], np.float64), np.array([s.correct for s in scores]),
                      budget, tree, sample, t1 - t0, t2 - t1, reward_terms(scores) or None, reasons,
                      *(routes or (None, None)))


@dataclasses.dataclass
class EpisodeTrajectories:
  """One problem's G episodes, run in the environment and scored by it (`rollout_episodes`).

  prompt_ids: [P] int, the environment's first messages chat-formatted (every episode's prompt).
  results: [G] `rollout.environments.EpisodeResult` (episode tokens, reward, status, turns, tool calls).
  correct: [G] bool, the environment's verdict on each episode's final answer (its `correct`
    attribute after the episode, `ToolEnv.correct`; an environment without one: reward > 0).
  turn_formats: [G] lists, per model turn, of `rollout.tools.turn_format` of its text (decoded
    without its stop id: what the environment read) against the environment's `tools` (an
    environment without a `tools` table: none, so any call counts as malformed).
  budget: the most model tokens one episode can generate (`completion_budget`).
  sample: {"data_pos", "question", "answer", "completion", "status"}: episode 0 (its model turns and
    observations decoded, special tokens kept), for samples.jsonl.
  sample_s: seconds of sampling and stepping the environment (the two interleave; score_s is 0).
  logprobs: [G] lists, per model turn, of [n_i] float32 log-probs the sampler drew the turn's tokens
    with (`EpisodeSampler.logprobs`, at `rollout_episodes`' logprob_temperature), or None.
  routes: a Qwen3-MoE sampler's recorded experts per episode, [N_g, layers, k] int32 along the ids it last fed
    (the prompt, then the episode's tokens but its last: `EpisodeSampler.routes`), or None.
  """
  prompt_ids: list
  results: list
  correct: np.ndarray
  turn_formats: list
  budget: int
  sample: dict
  sample_s: float
  score_s: float = 0.0
  logprobs: list | None = None
  routes: list | None = None


def turn_formats(result: EpisodeResult, tokenizer, tools) -> list[str]:
  """`rollout.tools.turn_format` of each model turn of `result`'s episode, its text decoded without its
  stop id (special tokens kept: what the environment read), against the `tools` table."""
  stops = set(stop_ids(tokenizer))
  return [turn_format(tokenizer.decode([int(i) for i in (seg[:-1] if int(seg[-1]) in stops else seg)],
                                       skip_special_tokens=False), tools)
          for row in result.rows for seg, role in zip(row.segments, row.roles) if role == "model"]


def rollout_episodes(rollout_config, model, tokenizer, task, env, data_pos: int, key, *,
                     logprob_temperature: float = 1.0, history: str = "tokens") -> EpisodeTrajectories:
  """Run G = rollout.group_size episodes of task item `data_pos` (wrapping around) in `env`
  (rollout/environments.py protocol) with rollout.episodes' budgets, one after another; they branch
  at the first turn (`EpisodeSampler.branches`: the prompt prefilled once, branch g's key
  fold_in(key, g)) at rollout.temperature and top_p, each token's log-prob recorded at
  `logprob_temperature` (as `rollout`). history: rollout.episodes.history (`rollout.chat.ChatTokens`;
  "template": an episode's rows, `EpisodeResult.rows`).

  Raises:
    ValueError: rollout.episodes.max_context longer than the model's max_positions; `run_episode`'s
      (naming the problem's index); RuntimeError: the environment raised (`run_episode`).
  """
  r, e = rollout_config, rollout_config.episodes
  if e.max_context > model.config.max_positions:
    raise ValueError(f"rollout.episodes.max_context={e.max_context} exceeds the model's max_positions="
                     f"{model.config.max_positions}")
  problem = task[data_pos % len(task)]
  t0 = time.perf_counter()
  ids = encode_chat(tokenizer, env.reset(problem))   # the prompt run_episode's reset renders (ChatTokens)
  if callable(getattr(env, "end_episode", None)):
    env.end_episode()   # this reset plays no turn (rollout/environments.py: the optional hook)
  stops = stop_ids(tokenizer)
  samplers = EpisodeSampler.branches(model, ids, r.group_size, key=key, temperature=r.temperature, top_p=r.top_p,
                                     eos_ids=stops, pad_id=tokenizer.pad_token_id or 0,
                                     logprob_temperature=logprob_temperature, history=history)
  results, correct, formats, logprobs, routes = [], [], [], [], []
  tools = getattr(env, "tools", {})
  for sampler in samplers:
    result: EpisodeResult = run_episode(env, problem, data_pos, tokenizer, sampler, max_turns=e.max_turns,
                                        max_turn_tokens=e.max_turn_tokens, max_context=e.max_context,
                                        max_episode_tokens=e.get("max_episode_tokens"), history=history)
    if list(result.rows[0].prompt) != list(ids):
      raise ValueError(f"problem {data_pos}: the environment's reset gave another prompt on a second call; an "
                       "environment's reset must be a function of the problem")
    results.append(result)
    correct.append(bool(getattr(env, "correct", result.reward > 0)))
    formats.append(turn_formats(result, tokenizer, tools))
    logprobs.append(getattr(sampler, "logprobs", None))   # (a stand-in sampler may record none)
    routes.append(getattr(sampler, "routes", None))
  first, last = results[0], results[0].rows[-1]   # the first episode's last row: its whole conversation
  shown = list(last.prompt) + last.tokens().tolist()
  shown = shown[len(ids):] if shown[:len(ids)] == list(ids) else shown
  sample = {"data_pos": data_pos, "question": problem.question, "answer": problem.answer,
            "completion": tokenizer.decode(shown, skip_special_tokens=False), "status": first.status}
  return EpisodeTrajectories(list(ids), results, np.array(correct, bool), formats, completion_budget(r), sample,
                             time.perf_counter() - t0,
                             logprobs=None if any(lp is None for lp in logprobs) else [list(lp) for lp in logprobs],
                             routes=None if any(r is None for r in routes) else routes)
