"""One prompt's rollouts for the GRPO loop: sample (a group or a tree), score, build update arrays.

`rollout` samples G completions sharing one prefill (rollout.sampler.sample_group) and returns the
arrays of a rollout group; with `rollout.tree_fanouts` set it samples a tree (TreePO-style
fixed-length segments, rollout.tree_sampler.sample_tree) whose trajectories are the completions.
Either way the trajectories get GRPO (or, with `loss.advantage = "rloo"`, leave-one-out RLOO)
advantages from the task's rewards, and the arrays are laid out for replay (group or tree) or,
with `train.gradient = "naive"`, for the naive step over the same trajectories.
"""

from __future__ import annotations

import dataclasses
import time

import jax.numpy as jnp
import numpy as np

from branch_replay_jax import losses as obj
from branch_replay_jax.data.batches import GroupBatch, TreeBatch, group_arrays, trajectory_group_arrays, tree_arrays
from branch_replay_jax.data.counts import group_counts, tree_counts
from branch_replay_jax.data.groups import bucket_length, group_from_padded
from branch_replay_jax.data.trees import RolloutTree, pad_tree
from branch_replay_jax.models.loading import encode_chat
from branch_replay_jax.rollout.sampler import sample_group
from branch_replay_jax.rollout.tasks import format_messages
from branch_replay_jax.rollout.tree_sampler import sample_tree


@dataclasses.dataclass
class Group:
  """One prompt's rollouts after scoring: arrays for the update, figures and texts for the logs.

  kind: "group" (batch: a `GroupBatch` from `group_arrays`, also a tree's trajectories laid out
    naive) or "tree" (a `TreeBatch` from `tree_arrays`).
  truncated: [G] bool per trajectory (tree: in `tree.ends` order), the sampler's stop reason: True
    where the token budget cut it without EOS (`Rollouts.truncated`, `TreeRollout.truncated`), False
    where it ended with EOS (also on the budget's last token). PPO's GAE bootstraps the truncated ones.
  naive_batch: a tree's trajectories laid out as a group (`trajectory_group_arrays`, the naive
    step's layout) when kind is "tree", for the run-time exactness check (algorithms/exactness.py);
    None for a group, whose `batch` serves both.
  """
  kind: str
  batch: GroupBatch | TreeBatch
  rewards: np.ndarray
  correct: np.ndarray
  lengths: np.ndarray
  counts: dict
  sample: dict
  sample_s: float
  score_s: float
  truncated: np.ndarray
  tree: RolloutTree | None = None
  naive_batch: GroupBatch | None = None


def completion_budget(config) -> int:
  """Most tokens one trajectory can generate (tokens)."""
  r = config.rollout
  return r.segment_length * len(r.tree_fanouts) if r.get("tree_fanouts") else r.max_new_tokens


def trajectory_advantages(loss_config, rewards: np.ndarray) -> np.ndarray | None:
  """[G] float32 advantages of a group's (or tree's) trajectories from their rewards [G]: GRPO's
  group-normalised ones (loss.advantage = "grpo", eps loss.advantage_eps) or RLOO's leave-one-out
  ones ("rloo"); None when the config has no loss.advantage (PPO: GAE from the critic, later)."""
  kind = loss_config.get("advantage")
  if kind is None:
    return None
  if kind == "rloo":
    return np.asarray(obj.rloo_advantages(jnp.asarray(rewards)), np.float32)
  return np.asarray(obj.group_advantages(jnp.asarray(rewards), eps=loss_config.advantage_eps), np.float32)


def rollout(config, model, tokenizer, task, data_pos: int, key) -> Group:
  """Sample, score and lay out one prompt (task item `data_pos`)."""
  problem = task[data_pos % len(task)]
  ids = encode_chat(tokenizer, format_messages(problem))
  r, cfg = config.rollout, model.config
  budget = completion_budget(config)
  if len(ids) + budget > cfg.max_positions:
    raise ValueError(f"task item {data_pos}: prompt of {len(ids)} tokens + {budget} completion tokens "
                     f"exceeds the model's max_positions={cfg.max_positions}")
  pad = tokenizer.pad_token_id or 0
  t0 = time.perf_counter()
  if r.tree_fanouts:
    sampled = sample_tree(model, ids, fanouts=list(r.tree_fanouts), segment_length=r.segment_length, key=key,
                          temperature=r.temperature, top_p=r.top_p, eos_ids=[tokenizer.eos_token_id], pad_id=pad)
    tree = sampled.tree
    completions = [tree.completion(g) for g in range(len(tree.ends))]
    truncated = np.asarray(sampled.truncated, bool)
  else:
    ro = sample_group(model, ids, num_samples=r.group_size, max_new_tokens=r.max_new_tokens, key=key,
                      temperature=r.temperature, top_p=r.top_p, eos_ids=[tokenizer.eos_token_id], pad_id=pad)
    tokens, lengths, logprobs = np.asarray(ro.tokens), np.asarray(ro.lengths), np.asarray(ro.logprobs)
    completions = [row[:n] for row, n in zip(tokens, lengths)]
    truncated = np.asarray(ro.truncated, bool)
  t1 = time.perf_counter()
  texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
  scores = [task.score(text, problem) for text in texts]
  rewards = np.array([s.reward for s in scores], np.float32)
  t2 = time.perf_counter()

  lengths = np.array([len(c) for c in completions])
  advantages = trajectory_advantages(config.loss, rewards)
  advantage = {} if advantages is None else {"advantage": advantages}
  w = obj.trajectory_weights(lengths, mode=config.loss.normalisation, max_length=budget).astype(np.float32)
  bucket = bucket_length(budget, minimum=8)
  naive = config.train.gradient == "naive"
  if r.tree_fanouts:
    per_node = {"old_logp": sampled.logprobs}
    padded = pad_tree(tree, pad_id=pad)
    naive_arrays = trajectory_group_arrays(tree, per_node, w, vocab_size=cfg.vocab_size,
                                           max_positions=cfg.max_positions, completion_bucket=bucket, **advantage)
    arrays = naive_arrays if naive else tree_arrays(padded, {**per_node, "weights": tree.node_weights(w)}, **advantage)
    counts = {**tree_counts(tree, cfg), "padding_fraction": padded.padding_fraction}
  else:
    group = group_from_padded(ids, tokens, lengths, vocab_size=cfg.vocab_size, max_positions=cfg.max_positions,
                              pad_id=pad, completion_bucket=bucket)
    old = np.zeros(group.completion_ids.shape, np.float32)
    old[:, :logprobs.shape[1]] = logprobs
    arrays = group_arrays(group, weights=(group.completion_mask * w[:, None]).astype(np.float32),
                          **advantage, old_logp=old, ref_logp=np.zeros_like(old))
    computed = group.prompt_ids.size + group.completion_ids.size
    counts = {**group_counts(group.prompt_len, group.lengths, cfg),
              "padding_fraction": 1.0 - (group.prompt_len + group.lengths.sum()) / computed}
  sample = {"data_pos": data_pos, "question": problem.question, "answer": problem.answer, "completion": texts[0],
            "reward": float(rewards[0])}
  kind = "tree" if r.tree_fanouts and not naive else "group"
  return Group(kind, arrays, rewards, np.array([s.correct for s in scores]), lengths, counts, sample, t1 - t0,
               t2 - t1, truncated, tree if r.tree_fanouts else None, naive_arrays if kind == "tree" else None)
