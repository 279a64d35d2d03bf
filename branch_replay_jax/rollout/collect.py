"""One prompt's rollouts for the GRPO loop: sample (a group or a tree), score, build update arrays.

`rollout` samples G completions sharing one prefill (rollout.sampler.sample_group) and returns the
arrays of a rollout group; with `rollout.tree_fanouts` set it samples a tree (TreePO-style
fixed-length segments, rollout.tree_sampler.sample_tree) whose trajectories are the completions.
Either way the trajectories get GRPO (or, with `loss.advantage = "rloo"`, leave-one-out RLOO)
advantages from the task's rewards (plus DAPO's soft overlong penalty with `loss.overlong_buffer`),
and the arrays are laid out for replay (group or tree) or, with `train.gradient = "naive"`, for the
naive step over the same trajectories.

A step's groups: `step_groups` draws them through the loop's drawing function, with DAPO's dynamic
sampling (`rollout.dynamic_sampling`: groups of equal rewards dropped, more prompts drawn) and the
step-level token mean (`loss.aggregation = "step_token_mean"`) applied on top.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from branch_replay_jax import losses as obj
from branch_replay_jax.data.batches import GroupBatch, TreeBatch, group_arrays, trajectory_group_arrays, tree_arrays
from branch_replay_jax.data.counts import group_counts, tree_counts
from branch_replay_jax.data.groups import bucket_length, group_from_padded
from branch_replay_jax.data.trees import RolloutTree, pad_tree
from branch_replay_jax.models.loading import encode_chat, stop_ids
from branch_replay_jax.rollout.sampler import sample_group
from branch_replay_jax.rollout.tasks.protocol import reward_terms, score_group
from branch_replay_jax.rollout.tree_sampler import sample_tree


@dataclasses.dataclass
class Group:
  """One prompt's rollouts after scoring: arrays for the update, figures and texts for the logs.

  kind: "group" (batch: a `GroupBatch` from `group_arrays`, also a tree's trajectories laid out
    naive) or "tree" (a `TreeBatch` from `tree_arrays`).
  truncated: [G] bool per trajectory (tree: in `tree.ends` order), the sampler's stop reason: True
    where the token budget cut it without EOS (`Rollouts.truncated`, `TreeRollout.truncated`), False
    where it ended with EOS (also on the budget's last token). PPO's GAE bootstraps the truncated ones.
  rewards: [G] float32, the task's rewards plus the overlong penalty (`loss.overlong_buffer`): what
    the advantages are computed from.
  in_loss: [G] bool, the trajectories the loss weighs (all but the truncated ones with
    `loss.mask_truncated`), or None (all).
  naive_batch: a tree's trajectories laid out as a group (`trajectory_group_arrays`, the naive
    step's layout) when kind is "tree", for the run-time exactness check (algorithms/exactness.py);
    None for a group, whose `batch` serves both. Its weights are the tree's (`step_token_mean`
    rescales both).
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
  in_loss: np.ndarray | None = None
  reward_terms: dict | None = None   # {name: [G] float64} per reward function of task.rewards (NaN: None), or None

  @property
  def loss_tokens(self) -> int:
    """(token, trajectory) pairs the loss weighs: Σ |o_g| over the trajectories in the loss (a
    shared tree token counts once per trajectory through it, as in the naive layout)."""
    kept = self.lengths if self.in_loss is None else self.lengths[self.in_loss]
    return int(kept.sum())


def completion_budget(config) -> int:
  """Most tokens one trajectory can generate (tokens)."""
  r = config.rollout
  return r.segment_length * len(r.tree_fanouts) if r.get("tree_fanouts") else r.max_new_tokens


def trajectory_advantages(loss_config, rewards: np.ndarray, *, group_relative: bool) -> np.ndarray | None:
  """[G] float32 advantages of a group's (or tree's) trajectories from their rewards [G]. With
  `group_relative` (the caller's algorithm is GRPO / RLOO) GRPO's group-normalised ones
  (loss.advantage = "grpo", eps loss.advantage_eps) or RLOO's leave-one-out ones ("rloo");
  without (PPO: GAE from the critic, later) None. The caller says which: no field's presence
  decides the algorithm (algorithms/schema.py checks the fields of config.algorithm's schema)."""
  if not group_relative:
    return None
  if loss_config.advantage == "rloo":
    return np.asarray(obj.rloo_advantages(jnp.asarray(rewards)), np.float32)
  return np.asarray(obj.group_advantages(jnp.asarray(rewards), eps=loss_config.advantage_eps), np.float32)


def rollout(config, model, tokenizer, task, data_pos: int, key) -> Group:
  """Sample, score and lay out one prompt (task item `data_pos`)."""
  problem = task[data_pos % len(task)]
  ids = encode_chat(tokenizer, task.messages(problem))
  r, cfg = config.rollout, model.config
  budget = completion_budget(config)
  if len(ids) + budget > cfg.max_positions:
    raise ValueError(f"task item {data_pos}: prompt of {len(ids)} tokens + {budget} completion tokens "
                     f"exceeds the model's max_positions={cfg.max_positions}")
  pad, stops = tokenizer.pad_token_id or 0, stop_ids(tokenizer)
  t0 = time.perf_counter()
  if r.tree_fanouts:
    sampled = sample_tree(model, ids, fanouts=list(r.tree_fanouts), segment_length=r.segment_length, key=key,
                          temperature=r.temperature, top_p=r.top_p, eos_ids=stops, pad_id=pad)
    tree = sampled.tree
    completions = [tree.completion(g) for g in range(len(tree.ends))]
    truncated = np.asarray(sampled.truncated, bool)
  else:
    ro = sample_group(model, ids, num_samples=r.group_size, max_new_tokens=r.max_new_tokens, key=key,
                      temperature=r.temperature, top_p=r.top_p, eos_ids=stops, pad_id=pad)
    tokens, lengths, logprobs = np.asarray(ro.tokens), np.asarray(ro.lengths), np.asarray(ro.logprobs)
    completions = [row[:n] for row, n in zip(tokens, lengths)]
    truncated = np.asarray(ro.truncated, bool)
  t1 = time.perf_counter()
  texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
  scores = score_group(task, texts, problem, index=data_pos)   # a failing reward function raises here
  lengths = np.array([len(c) for c in completions])
  # GRPO / RLOO (config.algorithm "grpo"): group-relative advantages and GRPO's options (overlong
  # shaping, truncation masking); PPO: neither (its schema has no such fields; GAE from the critic).
  grpo = config.algorithm == "grpo"
  buffer = config.loss.overlong_buffer if grpo else 0
  shaping = (obj.overlong_penalty(lengths, max_length=budget, buffer=buffer, penalty=config.loss.overlong_penalty)
             if buffer else 0.0)
  rewards = (np.array([s.reward for s in scores], np.float64) + shaping).astype(np.float32)
  t2 = time.perf_counter()

  advantages = trajectory_advantages(config.loss, rewards, group_relative=grpo)
  advantage = {} if advantages is None else {"advantage": advantages}
  in_loss = ~truncated if grpo and config.loss.mask_truncated else None
  w = obj.trajectory_weights(lengths, mode=config.loss.normalisation, max_length=budget,
                             in_loss=in_loss).astype(np.float32)
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
               t2 - t1, truncated, tree if r.tree_fanouts else None, naive_arrays if kind == "tree" else None,
               in_loss, reward_terms(scores) or None)


def dynamic_sampling(draw, key, data_pos: int, *, quota: int, max_draws: int) -> tuple[list[Group], int, dict]:
  """DAPO's dynamic sampling (arXiv 2503.14476, section 3.2, Algorithm 1 line 6): draw rounds of
  groups, drop those whose rewards are all equal (`losses.constant_groups`: zero advantage, no
  policy gradient), until `quota` groups remain or `max_draws` prompts were drawn.

  Round k draws with `key` (k = 0) or `fold_in(key, k)` at data position data_pos + (prompts drawn
  so far), so round 0 is the draw without dynamic sampling and a resumed run draws the same. When
  the cap ends the drawing first, the step is filled up to `quota` with dropped groups in draw
  order (their advantages are 0: only the KL term acts on them), so every step has `quota` groups
  (a mesh's data axis must divide it). The step keeps the groups in draw order.

  Example (quota 2, rounds of 2, max_draws 6): round 0 draws rewards (1, 1) and (0, 1): one kept;
  round 1 draws (0, 1) and (0, 0): two kept, the quota is met; 4 prompts drawn, 2 groups dropped
  ((1, 1) and (0, 0)); data_pos advances by 4.

  Args:
    draw: (key, data_pos) -> (groups of one round, next data position), e.g. `loop.sample_groups`
      with the policy bound (its devices too, on a mesh: every round samples data-parallel).
    quota: groups the step trains on (rollout.prompts_per_step).
    max_draws: the most prompts drawn (rollout.max_prompt_draws).

  Returns:
    (quota groups, the data position after every drawn prompt, {"prompts_drawn": prompts drawn,
    "dropped_groups": drawn groups the step does not train on}).
  """
  drawn: list[Group] = []
  pos, rounds = data_pos, 0
  while sum(not _constant(g) for g in drawn) < quota and pos - data_pos < max_draws:
    groups, pos = draw(key if rounds == 0 else jax.random.fold_in(key, rounds), pos)
    drawn, rounds = drawn + groups, rounds + 1
  kept = [i for i, g in enumerate(drawn) if not _constant(g)][:quota]
  kept = sorted(kept + [i for i, g in enumerate(drawn) if _constant(g)][:quota - len(kept)])
  return [drawn[i] for i in kept], pos, {"prompts_drawn": pos - data_pos, "dropped_groups": len(drawn) - len(kept)}


def _constant(group: Group) -> bool:
  return bool(obj.constant_groups(group.rewards))


def step_token_mean(groups: list[Group]) -> list[Group]:
  """The groups with weights that make the loop's mean over groups the token mean over the step.

  The loop averages the groups' losses (and gradients): (1/B) Σ_k Σ w ℓ. With every weight in the
  loss set to B / N, N the step's (token, trajectory) pairs in the loss (Σ_k `Group.loss_tokens`),
  that is (1/N) Σ over the step's tokens: each token counts the same wherever it lies (verl's
  loss_agg_mode "token-mean", TRL's loss_type "dapo"). Weights outside the loss stay 0. A tree's
  `naive_batch` (the exactness check's layout) is rescaled the same way, so replay and naive stay
  equal. Groups without a batch (another process's, summarised) pass through unchanged.

  Example: two groups, 2 and 6 tokens in the loss, all per-token losses 1 except one of 5 in the
  first group: group_mean (token_mean weights) gives ((1 + 5) / 2 + 6 / 6) / 2 = 2;
  step_token_mean gives (1 + 5 + 6) / 8 = 1.5.
  """
  n, b = sum(g.loss_tokens for g in groups), len(groups)
  if n == 0:
    return groups
  scale = lambda w: jnp.where(w > 0, jnp.asarray(b / n, w.dtype), jnp.zeros((), w.dtype))
  def rescaled(batch):
    if isinstance(batch, TreeBatch):
      return batch.replace(levels=tuple(level.replace(weights=scale(level.weights)) for level in batch.levels))
    return batch.replace(branches=batch.branches.replace(weights=scale(batch.branches.weights)))
  return [g if g.batch is None else
          dataclasses.replace(g, batch=rescaled(g.batch),
                              naive_batch=None if g.naive_batch is None else rescaled(g.naive_batch))
          for g in groups]


def step_groups(config, draw, key, data_pos: int) -> tuple[list[Group], int, dict]:
  """The step's groups from `draw` ((key, data_pos) -> (rollout.prompts_per_step groups, next data
  position)): one draw, or `dynamic_sampling` with rollout.dynamic_sampling; then `step_token_mean`
  with loss.aggregation = "step_token_mean".

  Returns (groups, next data position, the draw's metrics: {} without dynamic sampling).
  """
  r = config.rollout
  if r.dynamic_sampling:
    groups, data_pos, metrics = dynamic_sampling(draw, key, data_pos, quota=r.prompts_per_step,
                                                 max_draws=r.max_prompt_draws)
  else:
    (groups, data_pos), metrics = draw(key, data_pos), {}
  if config.loss.aggregation == "step_token_mean":
    groups = step_token_mean(groups)
  return groups, data_pos, metrics
