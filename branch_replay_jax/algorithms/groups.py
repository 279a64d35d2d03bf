"""A step's groups: the update arrays GRPO / RLOO and PPO train on, built from raw rollouts.

    rollout.collect.rollout ─► Trajectories ─► `build` ─► Group ─► `step_groups` ─► the step's groups
      (sample, score)            (raw)        (shaping, advantages,    (dynamic sampling,
                                               weights, layout)         the step's token mean)

The sampling layer (rollout/collect.py) returns raw trajectories and reads only config.rollout;
everything the loss needs is built here, from the algorithm's fields (algorithms/schema.py):
  - GRPO / RLOO: DAPO's soft overlong penalty added to the task's rewards (loss.overlong_buffer,
    loss.overlong_penalty), group-relative advantages (loss.advantage, loss.advantage_eps), the
    truncated trajectories left out of the loss (loss.mask_truncated);
  - both: the per-(token, trajectory) loss weights of loss.weighting (losses.trajectory_weights;
    docs/design.md, "Loss weightings"), and the layout: replay (a `RolloutBatch`: a group's rows or a tree's
    levels) or, with train.gradient = "naive", the prompt repeated per trajectory;
  - GRPO / RLOO's step: dynamic sampling (rollout.dynamic_sampling) and, with loss.weighting =
    "step_token_mean", the step's scale B / N on every weight (losses.step_token_scale).
PPO's advantages are GAE from its critic (algorithms/ppo.py, `prepare`), not built here.

Episodes (rollout.episodes; `build_episodes`, docs/design.md, "Episodes"): the G episodes of one
problem get GRPO / RLOO advantages from their outcome rewards (one per episode), loss.weighting's
weights over each episode's model tokens, and the episode tree's replay layout
(`data.episodes.episode_tree_arrays`, a tree's RolloutBatch) or, with train.gradient = "naive", one row per
episode (`episode_group_arrays`); observation tokens have weight 0 and advantage 0 in both.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from branch_replay_jax import losses as obj
from branch_replay_jax.data.batches import (RolloutBatch, group_arrays, pad_routes, recorded_routes,
                                            recorded_tree_routes, trajectory_group_arrays, tree_arrays)
from branch_replay_jax.data.counts import group_counts, tree_counts
from branch_replay_jax.data.episodes import (MODEL, episode_group_arrays, episode_tree, episode_tree_arrays,
                                             limit_depth, merge_short, prompt_only_tree, rebase)
from branch_replay_jax.data.groups import SEGMENT_BUCKETS_PER_OCTAVE, bucket_length, group_from_padded
from branch_replay_jax.data.trees import RolloutTree, pad_tree
from branch_replay_jax.algorithms.schema import Layout, layout_of, parse
from branch_replay_jax.rollout.collect import EpisodeTrajectories, Trajectories, rollout, rollout_episodes


@dataclasses.dataclass
class Group:
  """One prompt's rollouts after scoring: arrays for the update, figures and texts for the logs.

  kind: "group" (batch: a group's rows, `group_arrays`, also a tree's trajectories laid out naive) or
    "tree" (a tree's levels, `tree_arrays`); both a `data.batches.RolloutBatch`.
  truncated: [G] bool per trajectory (tree: in `tree.ends` order), the sampler's stop reason: True
    where the token budget cut it without EOS or a stop string (`Rollouts.truncated`,
    `TreeRollout.truncated`), False where it ended with one (also on the budget's last token). PPO's GAE bootstraps the truncated ones.
  rewards: [G] float32, the task's rewards plus the overlong penalty (`loss.overlong_buffer`): what
    the advantages are computed from.
  in_loss: [G] bool, the trajectories the loss weighs (all but the truncated ones with
    `loss.mask_truncated`), or None (all).
  naive_batch: a tree's trajectories laid out as a group (`trajectory_group_arrays`, the naive
    step's layout) when kind is "tree", for the run-time exactness check (algorithms/exactness.py);
    None for a group, whose `batch` serves both. Its weights are the tree's (`step_token_mean`
    scales both).
  reward_terms: {name: [G] float64} per reward function of task.rewards (`Trajectories.reward_terms`;
    logged as rewards/NAME), or None.
  stop_reasons: [G] str "eos", "stop_string" or "length" (`Trajectories.stop_reasons`; logged as
    stop_eos_frac, stop_string_frac and truncated_frac), or None.
  episode_stats: episodes only (`build_episodes`), else None: {"status": [G] str (one of
    `rollout.environments.STATUSES`), "tool_calls": [G] int, "turns": [G] int, "formatted_turns":
    [G] int (turns that are a parseable tool call or a tagged answer, `rollout.tools.turn_format`)}.
    An episode's `lengths` entry is its model tokens (the loss's |o_g|), observations left out.
  """
  kind: str
  batch: RolloutBatch
  rewards: np.ndarray
  correct: np.ndarray
  lengths: np.ndarray
  counts: dict
  sample: dict
  sample_s: float
  score_s: float
  truncated: np.ndarray
  tree: RolloutTree | None = None
  naive_batch: RolloutBatch | None = None
  in_loss: np.ndarray | None = None
  reward_terms: dict | None = None
  stop_reasons: np.ndarray | None = None
  episode_stats: dict | None = None

  @property
  def loss_tokens(self) -> int:
    """(token, trajectory) pairs the loss weighs: Σ |o_g| over the trajectories in the loss (a
    shared tree token counts once per trajectory through it, as in the naive layout)."""
    kept = self.lengths if self.in_loss is None else self.lengths[self.in_loss]
    return int(kept.sum())


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


def build(config, raw: Trajectories, model_config, pad_id: int, layout: Layout) -> Group:
  """The update arrays of one prompt's raw rollouts `raw` for config.algorithm ("grpo": shaped
  rewards, group-relative advantages, truncation masking; "ppo": neither, GAE comes later) with
  loss.weighting's weights, laid out for replay (group or tree) or, with train.gradient = "naive",
  for the naive step over the same trajectories.

  Args:
    model_config: the policy's `ModelConfig` (vocab_size, max_positions, and the counts' sizes).
    pad_id: the tokenizer's pad id (the padding of a tree's segments).
    layout: the run's `schema.Layout` (its gradient: replay or naive).
  """
  grpo = config.algorithm == "grpo"
  budget, lengths, truncated = raw.budget, raw.lengths, raw.truncated
  buffer = config.loss.overlong_buffer if grpo else 0
  shaping = (obj.overlong_penalty(lengths, max_length=budget, buffer=buffer, penalty=config.loss.overlong_penalty)
             if buffer else 0.0)
  rewards = (raw.task_rewards + shaping).astype(np.float32)
  advantages = trajectory_advantages(config.loss, rewards, group_relative=grpo)
  advantage = {} if advantages is None else {"advantage": advantages}
  in_loss = ~truncated if grpo and config.loss.mask_truncated else None
  w = obj.trajectory_weights(lengths, mode=config.loss.weighting, max_length=budget,
                             in_loss=in_loss).astype(np.float32)
  bucket = bucket_length(budget, minimum=8)
  naive = layout.gradient == "naive"
  cfg, tree = model_config, raw.tree
  if tree is not None:
    per_node = {"sampler_logp": raw.logprobs}   # each node's from the one sample that drew it
    padded = pad_tree(tree, pad_id=pad_id)
    naive_arrays = trajectory_group_arrays(tree, per_node, w, vocab_size=cfg.vocab_size,
                                           max_positions=cfg.max_positions, completion_bucket=bucket, **advantage)
    if raw.routes is not None:   # a Qwen3-MoE sampler's experts per node (node 0: the prompt's), along each path
      naive_arrays = recorded_routes(naive_arrays, raw.prompt_routes, tree.along(raw.routes))
    arrays = naive_arrays if naive else tree_arrays(padded, {**per_node, "weights": tree.node_weights(w),
                                                                "end_share": tree.end_shares()}, **advantage)
    if raw.routes is not None and not naive:
      arrays = recorded_tree_routes(arrays, padded, raw.routes)
    counts = {**tree_counts(tree, cfg), "padding_fraction": padded.padding_fraction}
  else:
    group = group_from_padded(raw.prompt_ids, raw.tokens, lengths, vocab_size=cfg.vocab_size,
                              max_positions=cfg.max_positions, pad_id=pad_id, completion_bucket=bucket)
    sampler = np.zeros(group.completion_ids.shape, np.float32)
    sampler[:, :raw.logprobs.shape[1]] = raw.logprobs
    arrays = group_arrays(group, weights=(group.completion_mask * w[:, None]).astype(np.float32),
                          **advantage, sampler_logp=sampler, ref_logp=np.zeros_like(sampler))
    if raw.routes is not None:   # a Qwen3-MoE sampler's experts per token and layer, -1 on padding
      arrays = recorded_routes(arrays, raw.prompt_routes, raw.routes)
    computed = group.prompt_ids.size + group.completion_ids.size
    counts = {**group_counts(group.prompt_len, group.lengths, cfg),
              "padding_fraction": 1.0 - (group.prompt_len + group.lengths.sum()) / computed}
  kind = "tree" if tree is not None and not naive else "group"
  return Group(kind, arrays, rewards, raw.correct, lengths, counts, {**raw.sample, "reward": float(rewards[0])},
               raw.sample_s, raw.score_s, truncated, tree, naive_arrays if kind == "tree" else None, in_loss,
               raw.reward_terms, raw.stop_reasons)


def build_episodes(config, raw: EpisodeTrajectories, model_config, pad_id: int, layout: Layout) -> Group:
  """The update arrays of one problem's G episodes `raw` (GRPO / RLOO; docs/design.md, "Episodes"):
  advantages from the episodes' outcome rewards (`trajectory_advantages`: loss.advantage), the
  truncated episodes (cut by a budget) left out with loss.mask_truncated, loss.weighting's weights
  over each episode's model tokens (`losses.trajectory_weights` of `EpisodeTree.model_lengths`, the
  "constant" weighting over the episode's model-token budget), laid out as the episode tree
  (`episode_tree_arrays` of `limit_depth(merge_short(..., rollout.episodes.min_shared_tokens),
  rollout.episodes.max_tree_depth)`, kind "tree", with its
  one-row-per-episode layout as `naive_batch` for the run-time exactness check) or one row per
  episode (`episode_group_arrays`, kind "group"), trained naive (train.gradient = "naive") or, with
  rollout.episodes.share = "prompt", by the group replay step (the prompt computed once). The sampler's
  log-probs on model tokens (0 on observations) as sampler_logp, a shared node's from its first episode
  (`EpisodeTree.node_values`); no old log-probs: on-policy the objective never reads them, and with
  train.inner_epochs > 1 or a loss.rollout_correction the step computes them (`grpo.update_on_batch`).

  With rollout.episodes.history = "template" an episode is several rows (`EpisodeResult.rows`: a new
  row where the template rewrote the history); every row above is such a row (`data.episodes.rebase`
  gives them one prompt), each with its episode's advantage and weight (|o_g| summed over its rows),
  so the loss is the sum over the per-turn rows, each sampled token once. `Group`'s per-episode fields
  (rewards, lengths, truncated) stay per episode.

  A Qwen3-MoE sampler's recorded experts (history "tokens") go with the arrays (`_episode_routes`: per tree
  node, and along each episode's path for its row), so the step replays them (model.routing_replay) or logs
  routing_mismatch.

  Args:
    model_config: the policy's `ModelConfig` (vocab_size, max_positions, the counts' sizes).
    pad_id: the tokenizer's pad id (padding of the tree's segments and of the rows).
    layout: the run's `schema.Layout` (an "episode" one: share, min_shared_tokens, max_tree_depth, gradient).
  """
  # One row per episode, or with rollout.episodes.history = "template" one per rendering (EpisodeResult.rows);
  # `rebase` gives the rows one prompt, and each row takes its episode's advantage and weight.
  rows_of = [r.rows for r in raw.results]
  owner = np.repeat(np.arange(len(rows_of)), [len(rows) for rows in rows_of])
  episodes = rebase([row for rows in rows_of for row in rows])
  rewards = np.array([r.reward for r in raw.results], np.float32)
  truncated = np.array([r.truncated for r in raw.results], bool)
  advantages = trajectory_advantages(config.loss, rewards, group_relative=True)[owner]
  in_loss = ~truncated if config.loss.mask_truncated else None
  share = layout.share
  etree = (prompt_only_tree(episodes) if share == "prompt" else
           limit_depth(merge_short(episode_tree(episodes), layout.min_shared_tokens), layout.max_tree_depth))
  lengths = np.array([r.model_tokens for r in raw.results], np.int64)   # |o_g|: over an episode's rows
  w = obj.trajectory_weights(lengths, mode=config.loss.weighting, max_length=raw.budget,
                             in_loss=in_loss).astype(np.float32)[owner]
  cfg = model_config
  longest = max(len(e.tokens()) for e in episodes)
  # The sampler's log-probs on each episode's model tokens (0 on observations), for loss.rollout_correction.
  row_turns = [(g, sum(r.roles.count(MODEL) for r in rows[:k]), row.roles.count(MODEL))   # episode g's turns k..
               for g, rows in enumerate(rows_of) for k, row in enumerate(rows)]
  sampler = (None if raw.logprobs is None else
             [e.model_values(raw.logprobs[g][k:k + n]) for e, (g, k, n) in zip(episodes, row_turns)])
  naive_arrays = episode_group_arrays(episodes, advantages, w, vocab_size=cfg.vocab_size,
                                      per_episode=None if sampler is None else {"sampler_logp": sampler},
                                      max_positions=cfg.max_positions, pad_id=pad_id,
                                      completion_bucket=bucket_length(longest, minimum=8,
                                                                        per_octave=SEGMENT_BUCKETS_PER_OCTAVE))
  routes = _episode_routes(raw, episodes, etree) if layout.history == "tokens" else None
  if routes is not None:   # the naive rows replay each episode's path of the tree's node routes
    naive_arrays = recorded_routes(naive_arrays, routes[0], etree.along(routes))
  rows = not layout.tree   # the rows: trained naive, or by the group replay step (prompt once)
  arrays = naive_arrays if rows else episode_tree_arrays(
      etree, advantages, w, vocab_size=cfg.vocab_size, max_positions=cfg.max_positions, pad_id=pad_id,
      per_node=None if sampler is None else {"sampler_logp": etree.node_values(sampler)})
  if routes is not None and not rows:
    arrays = recorded_tree_routes(arrays, pad_tree(etree.tree, pad_id=pad_id), routes)
  if share == "prompt":   # the counts are those of the replay layout `share` selects, trained naive or not
    real = episodes[0].prompt.size + sum(e.tokens().size for e in episodes)
    padding = 1.0 - real / (naive_arrays.prompt_ids.size + naive_arrays.branches.tokens.size)
  else:
    padding = pad_tree(etree.tree, pad_id=pad_id).padding_fraction
  counts = {**tree_counts(etree.tree, cfg), "padding_fraction": padding}
  stats = {"status": [r.status for r in raw.results], "tool_calls": np.array([r.tool_calls for r in raw.results]),
           "turns": np.array([r.turns for r in raw.results]),
           "formatted_turns": np.array([sum(f in ("tool_call", "answer") for f in turns) for turns in raw.turn_formats])}
  return Group("group" if rows else "tree", arrays, rewards, raw.correct, lengths, counts,
               {**raw.sample, "reward": float(rewards[0])}, raw.sample_s, raw.score_s, truncated, None,
               None if rows else naive_arrays, in_loss, None, episode_stats=stats)


def _episode_routes(raw: EpisodeTrajectories, episodes, etree) -> list | None:
  """Per node of the episode tree [L_n, layers, k] int32 (node 0: the prompt's), a Qwen3-MoE sampler's recorded
  experts (`EpisodeSampler.routes`, along the ids each episode's sampler fed: the prompt, then the episode's tokens
  but its last, which no step fed: -1), a shared node's from the first episode through it (as its sampler
  log-probs); None without recorded routes. History "tokens" only: one row per episode, the sampler's ids."""
  if raw.routes is None:
    return None
  p = len(raw.prompt_ids)
  after = [pad_routes(np.asarray(r, np.int32)[p:], len(e.tokens())) for e, r in zip(episodes, raw.routes)]
  return [np.asarray(raw.routes[0], np.int32)[:p]] + etree.node_values(after)[1:]


def logprob_temperature(config) -> float:
  """τ of the trainer's log-probs (its head's temperature): rollout.temperature with GRPO's
  loss.logprob_temperature = "sampling" (the distribution the sampler drew from), else 1 ("one"; PPO
  and DPO, which have no such field) (docs/design.md, "Log-prob temperature"). The sampler records
  its log-probs at the same τ (`rollout_group`), so the rollout correction's ratio and
  `sampler_logp_diff_mean` compare like with like."""
  return float(config.rollout.temperature) if config.loss.get("logprob_temperature") == "sampling" else 1.0


def rollout_group(config, model, tokenizer, task, data_pos: int, key, env=None, layout: Layout | None = None) -> Group:
  """`build` of `rollout.collect.rollout` (config.rollout's sampling) for task item `data_pos`; with
  `env` (rollout.episodes set: the run's environment), `build_episodes` of `rollout_episodes`.
  layout: the run's `schema.Layout`; default: resolved from config (`schema.layout_of`). The sampler
  records its log-probs at the trainer's τ (`logprob_temperature`)."""
  layout = layout or layout_of(parse(config))
  tau = logprob_temperature(config)
  if env is not None:
    raw = rollout_episodes(config.rollout, model, tokenizer, task, env, data_pos, key, logprob_temperature=tau,
                           history=layout.history)
    return build_episodes(config, raw, model.config, tokenizer.pad_token_id or 0, layout)
  raw = rollout(config.rollout, model, tokenizer, task, data_pos, key, logprob_temperature=tau)
  return build(config, raw, model.config, tokenizer.pad_token_id or 0, layout)


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
  """The groups with every loss weight scaled by B / N (`losses.step_token_scale`: B groups, N the
  step's (token, trajectory) pairs in the loss, Σ_k `Group.loss_tokens`), for loss.weighting =
  "step_token_mean", whose per-group weights are 1 per pair in the loss (`losses.trajectory_weights`).

  The loop averages the groups' losses (and gradients): (1/B) Σ_k Σ w ℓ; with w = B / N that is
  (1/N) Σ over the step's pairs: each token counts the same wherever it lies (verl's loss_agg_mode
  "token-mean", TRL's loss_type "dapo"). Weights outside the loss stay 0. A tree's `naive_batch`
  (the exactness check's layout) is scaled the same way, so replay and naive stay equal. Groups
  without a batch (another process's, summarised) pass through unchanged.

  Example: two groups, 2 and 6 tokens in the loss, all per-token losses 1 except one of 5 in the
  first group: group_token_mean gives ((1 + 5) / 2 + 6 / 6) / 2 = 2; step_token_mean gives
  (1 + 5 + 6) / 8 = 1.5.
  """
  n, b = sum(g.loss_tokens for g in groups), len(groups)
  if n == 0:
    return groups
  scale = obj.step_token_scale(b, n)
  scaled = lambda w: w * jnp.asarray(scale, w.dtype)
  def rescaled(batch):   # a group's rows are its one level
    return batch.replace(levels=tuple(level.replace(weights=scaled(level.weights)) for level in batch.levels))
  return [g if g.batch is None else
          dataclasses.replace(g, batch=rescaled(g.batch),
                              naive_batch=None if g.naive_batch is None else rescaled(g.naive_batch))
          for g in groups]


def step_groups(config, draw, key, data_pos: int) -> tuple[list[Group], int, dict]:
  """GRPO / RLOO's step: the groups from `draw` ((key, data_pos) -> (rollout.prompts_per_step
  groups, next data position)): one draw, or `dynamic_sampling` with rollout.dynamic_sampling;
  then `step_token_mean` with loss.weighting = "step_token_mean".

  Returns (groups, next data position, the draw's metrics: {} without dynamic sampling).
  """
  r = config.rollout
  if r.dynamic_sampling:
    groups, data_pos, metrics = dynamic_sampling(draw, key, data_pos, quota=r.prompts_per_step,
                                                 max_draws=r.max_prompt_draws)
  else:
    (groups, data_pos), metrics = draw(key, data_pos), {}
  if config.loss.weighting == "step_token_mean":
    groups = step_token_mean(groups)
  return groups, data_pos, metrics
