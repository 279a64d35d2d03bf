"""Agentic episodes: token segments that alternate model turns and environment observations, the
episodes of one problem as a tree, and their two layouts (docs/design.md, "Episodes").

    prompt  │ model turn 1 │ observation 1 │ model turn 2 │ observation 2 │ model turn 3
    (reset) │  sampled     │  tool output, │  sampled     │               │  sampled
            │  loss        │  chat glue:   │  loss        │  attended     │  loss
            │              │  attended     │              │               │

Every token is attended (it is in the K/V of the tokens after it); only the tokens the model sampled
carry loss. An observation token (everything the environment or the chat template inserted, up to
and including the next turn's generation prompt) has weight 0 and advantage 0, so it adds nothing
to the loss, its KL term, its clip count or a value target (`losses.grpo_objective`, `losses.ppo_objective`
weighs every per-token term and counts only tokens with weight > 0).

    rebase(rows)                                             -> [Episode] (rows with other prompts: one prompt)
    episode_tree(episodes)                                   -> EpisodeTree (the trie of the episodes)
    prompt_only_tree(episodes)                               -> EpisodeTree (the prompt shared, nothing else)
    merge_short(tree, min_tokens)                            -> EpisodeTree (shared nodes < min_tokens unshared)
    limit_depth(tree, max_depth)                             -> EpisodeTree (sharing below max_depth dropped)
    episode_tree_arrays(tree, advantage_g, weights_g, ...)   -> RolloutBatch, a tree (replay: every node once)
    episode_group_arrays(episodes, advantage_g, weights_g, ...) -> RolloutBatch, a group's rows (naive: one row
                                                                per episode, the layout verl and TRL train)

Advantages are per episode (outcome reward; GRPO or RLOO over the G episodes of one problem,
`losses.group_advantages`, `losses.rloo_advantages`) and laid out per token: A_g on episode g's
model tokens, 0 on its observation tokens (and on padding).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from branch_replay_jax.data.batches import RolloutBatch, group_arrays, tree_arrays
from branch_replay_jax.data.groups import check_token_ids, make_group
from branch_replay_jax.data.trees import RolloutTree, pad_tree, tree_from_trajectories

MODEL, OBSERVATION = "model", "observation"
ROLES = (MODEL, OBSERVATION)


@dataclasses.dataclass(frozen=True)
class Episode:
  """One episode's token ids: the prompt, then segments of model turns and observations.

  prompt: [P] int32, the environment's first messages templated, ending with the generation prompt
    of the first assistant turn (`rollout.chat.ChatTokens`).
  segments: tuple of 1-D int32 arrays, each >= 1 token, in order after the prompt.
  roles: tuple of "model" (sampled by the policy: trained) or "observation" (inserted by the
    environment or the chat template: attended, never trained), one per segment.

  Raises:
    ValueError: an empty prompt or segment, ids that are not integers >= 0, a role not in ROLES,
      segments and roles of different lengths, no model segment, or a last segment that is an observation (no model token attends
      to it, so it would be computed for nothing: drop it).
  """

  prompt: np.ndarray
  segments: tuple
  roles: tuple

  def __post_init__(self):
    if np.asarray(self.prompt).ndim != 1 or np.asarray(self.prompt).size == 0:
      raise ValueError(f"Episode: prompt must be a non-empty 1-D array of token ids, got shape {np.shape(self.prompt)}")
    if len(self.segments) != len(self.roles):
      raise ValueError(f"Episode: {len(self.segments)} segments but {len(self.roles)} roles")
    for i, (seg, role) in enumerate(zip(self.segments, self.roles)):
      if role not in ROLES:
        raise ValueError(f"Episode: roles[{i}]={role!r} is not one of {ROLES}")
      if np.asarray(seg).ndim != 1 or np.asarray(seg).size == 0:
        raise ValueError(f"Episode: segments[{i}] ({role}) must be a non-empty 1-D array of token ids")
    for name, ids in [("prompt", self.prompt)] + [(f"segments[{i}]", s) for i, s in enumerate(self.segments)]:
      ids = np.asarray(ids)
      if not np.issubdtype(ids.dtype, np.integer) or (ids < 0).any():
        raise ValueError(f"Episode: {name} must hold token ids (integers >= 0), got {ids.dtype} {ids[:8].tolist()}")
    if MODEL not in self.roles:
      raise ValueError("Episode: no model segment; an episode needs a sampled token to train")
    if self.roles[-1] != MODEL:
      raise ValueError(f"Episode: the last segment (segments[{len(self.roles) - 1}]) is an observation; no model "
                       "token attends to it: end the episode with the model's turn")

  def tokens(self) -> np.ndarray:
    """[N] int32, every token after the prompt (model turns and observations)."""
    return np.concatenate([np.asarray(s, np.int32) for s in self.segments])

  def model_mask(self) -> np.ndarray:
    """[N] bool, True on the model's (trained) tokens, False on observation tokens."""
    return np.concatenate([np.full(len(s), r == MODEL) for s, r in zip(self.segments, self.roles)])

  @property
  def num_model_tokens(self) -> int:
    return int(sum(len(s) for s, r in zip(self.segments, self.roles) if r == MODEL))

  def model_values(self, turns: Sequence) -> np.ndarray:
    """[N] float32: turns[i] (one value per token of model turn i, e.g. the sampler's log-probs,
    `EpisodeSampler.logprobs`) on model segment i's tokens, 0 on observation tokens.

    Raises:
      ValueError: a number of turns other than the model segments', or a turn of another length.
    """
    model = [s for s, r in zip(self.segments, self.roles) if r == MODEL]
    if len(turns) != len(model):
      raise ValueError(f"Episode.model_values: {len(turns)} turns of values for {len(model)} model segments")
    out, turns = [], iter(turns)
    for k, (seg, role) in enumerate(zip(self.segments, self.roles)):
      if role == MODEL:
        v = np.asarray(next(turns), np.float32)
        if v.shape != (len(seg),):
          raise ValueError(f"Episode.model_values: segment {k} has {len(seg)} model tokens, its values shape {v.shape}")
        out.append(v)
      else:
        out.append(np.zeros(len(seg), np.float32))
    return np.concatenate(out)


@dataclasses.dataclass(frozen=True)
class EpisodeTree:
  """The G episodes of one problem as a rollout tree: a node is a run of tokens shared by the
  episodes through it (their prompt, earlier turns and observations), so nested replay computes it once.

  tree: the `RolloutTree` (segment 0 the prompt; trajectory g is episode g).
  model_mask: per node [L_n] bool, True on model tokens (node 0, the prompt: all False).
  """

  tree: RolloutTree
  model_mask: tuple

  @property
  def num_episodes(self) -> int:
    return len(self.tree.ends)

  def model_lengths(self) -> np.ndarray:
    """[G] int64, model (trained) tokens of each episode: the |o_g| of `losses.trajectory_weights`."""
    return np.array([sum(int(self.model_mask[n].sum()) for n in self.tree.path(e)[1:]) for e in self.tree.ends],
                    np.int64)

  @property
  def loss_tokens(self) -> int:
    """(token, episode) pairs the loss weighs: Σ_g model tokens of episode g (a shared token once per
    episode through it, as in the naive layout)."""
    return int(self.model_lengths().sum())

  def per_token(self, values_g) -> list[np.ndarray]:
    """Per node [L_n, G]: values_g[g] on node n's model tokens for each episode g through n, 0 on its
    observation tokens and for the episodes not through it (the tree's per-(token, episode) weights
    and advantages; `RolloutTree.node_weights` with the model mask). Keeps values_g's dtype."""
    values = np.asarray(values_g)
    member = self.tree.membership()
    return [np.where(m[:, None] & member[n][None, :], values[None, :], np.zeros((), values.dtype))
            for n, m in enumerate(self.model_mask)]

  def along(self, per_node: Sequence) -> list[np.ndarray]:
    """Per episode g, per-node arrays [L_n, ...] concatenated along its path (prompt excluded): [N_g, ...]."""
    return self.tree.along(per_node)

  def node_values(self, per_episode: Sequence) -> list[np.ndarray]:
    """Per node [L_n]: the values of its tokens in the first episode through it, from per_episode[g]
    [N_g] (values along episode g's tokens after the prompt, e.g. `Episode.model_values`); node 0, the
    prompt, zeros. The inverse of `along` for values the episodes through a node agree on (a shared
    node's sampler log-probs: those of the one sample that drew it, docs/design.md "Rollout correction")."""
    offsets, prompt = self.tree.offsets(), len(self.tree.segments[0])
    first = self.tree.membership().argmax(axis=1)   # the first episode through each node
    out = [np.zeros(prompt, np.asarray(per_episode[0]).dtype)]
    for n in range(1, self.tree.num_nodes):
      start = offsets[n] - prompt
      out.append(np.asarray(per_episode[first[n]])[start:start + len(self.tree.segments[n])])
    return out

  def episode(self, g: int) -> Episode:
    """Episode g back, with its segments cut where its role changes."""
    tokens = self.tree.completion(g)
    model = np.concatenate([self.model_mask[n] for n in self.tree.path(self.tree.ends[g])[1:]])
    cuts = np.flatnonzero(np.diff(model.astype(np.int8))) + 1
    segs = np.split(tokens, cuts)
    roles = tuple(MODEL if part[0] else OBSERVATION for part in np.split(model, cuts))
    return Episode(np.asarray(self.tree.segments[0]), tuple(segs), roles)


def rebase(rows: Sequence[Episode]) -> list[Episode]:
  """Rows whose prompts differ (history "template", `rollout.chat.ChatTokens.rows`: each row's prompt is
  the context the template rendered for it) re-cut at the longest common prefix of their prompts: that
  prefix becomes every row's prompt, and the rest of a row's prompt an observation segment (attended,
  never trained) before its own segments. Rows with one prompt come back unchanged. Every token keeps
  its position and role, so the rows' loss is unchanged and `episode_tree` can share what they share.

  Raises:
    ValueError: no rows, or prompts without a common first token (naming the row).
  """
  if not rows:
    raise ValueError("rebase: needs at least one row")
  prompts = [np.asarray(r.prompt) for r in rows]
  n = min(p.size for p in prompts)
  for k, p in enumerate(prompts[1:], 1):
    differ = np.flatnonzero(p[:n] != prompts[0][:n])
    n = int(differ[0]) if differ.size else n
    if n == 0:
      raise ValueError(f"rebase: rows[{k}].prompt and rows[0].prompt differ at their first token; the rows of one "
                       "problem start from the rendering of its first messages")
  out = []
  for r, p in zip(rows, prompts):
    head = ((p[n:].astype(np.int32),), (OBSERVATION,)) if p.size > n else ((), ())
    out.append(Episode(p[:n], head[0] + tuple(r.segments), head[1] + tuple(r.roles)))
  return out


def episode_tree(episodes: Sequence[Episode]) -> EpisodeTree:
  """Merge one problem's episodes on their common prefixes of (token, role) pairs (a radix trie,
  `data.trees.tree_from_trajectories`): G episodes sampled from the prompt branch at the first turn;
  episodes continued from a common turn share it and its observation. The merge keys on the role too,
  so a token the model sampled and the same token inserted by the environment are never one node.

  Returns:
    An `EpisodeTree` whose trajectory g is episodes[g].

  Raises:
    ValueError: no episodes, or an episode whose prompt differs from episode 0's (naming its index).
  """
  if not episodes:
    raise ValueError("episode_tree: needs at least one episode")
  prompt = np.asarray(episodes[0].prompt, np.int64)
  for g, e in enumerate(episodes):
    if not np.array_equal(np.asarray(e.prompt, np.int64), prompt):
      raise ValueError(f"episode_tree: episodes[{g}].prompt differs from episodes[0].prompt; the episodes of one "
                       "problem start from the same reset (one prompt)")
  keys = [2 * e.tokens().astype(np.int64) + e.model_mask() for e in episodes]   # (token, role) as one key
  merged = tree_from_trajectories(2 * prompt, keys)
  segments = tuple((np.asarray(s) // 2).astype(np.int32) for s in merged.segments)
  model = tuple((np.asarray(s) % 2).astype(bool) for s in merged.segments)
  return EpisodeTree(RolloutTree(segments, merged.parents, merged.ends), model)


def prompt_only_tree(episodes: Sequence[Episode]) -> EpisodeTree:
  """The episodes sharing their prompt only: the prompt as the root and each episode's segments (turns
  and observations, roles kept) as one leaf, in the order of `episodes`. What a group replay step
  computes (`episode_group_arrays` with the replay layout) and what prompt-only stacks such as
  PrefixGrouper share; `tree_counts` of it counts the positions that step computes.

  Raises:
    ValueError: as `episode_tree` (no episodes, or prompts that differ).
  """
  if not episodes:
    raise ValueError("prompt_only_tree: needs at least one episode")
  prompt = np.asarray(episodes[0].prompt, np.int32)
  for g, e in enumerate(episodes):
    if not np.array_equal(np.asarray(e.prompt, np.int64), prompt.astype(np.int64)):
      raise ValueError(f"prompt_only_tree: episodes[{g}].prompt differs from episodes[0].prompt; the episodes of one "
                       "problem start from the same reset (one prompt)")
  g = len(episodes)
  tree = RolloutTree((prompt, *[e.tokens() for e in episodes]), (-1,) + (0,) * g, tuple(range(1, g + 1)))
  return EpisodeTree(tree, (np.zeros(prompt.size, bool), *[e.model_mask() for e in episodes]))


def limit_depth(tree: EpisodeTree, max_depth: int) -> EpisodeTree:
  """The episode tree with at most `max_depth` levels below the prompt: nodes deeper than that are
  not shared; each episode through a node at depth max_depth continues from it as its own leaf (the
  rest of its path concatenated, roles kept). Sharing less computes more tokens, never other values
  (every (token, episode) term is the same), so replay stays exact.

  Why: the token-level trie of a problem's episodes can be deep (tool-call boilerplate shared token
  for token, then divergent arguments, then shared answer tags), and a level d of the padded tree
  holds arrays [F_1..F_d, T_d, ...]: XLA:CPU's YNNPACK dots take operands of rank < 8 (in jaxlib
  0.10.2 the GRPO step of a stack of depth-6 episode trees aborts with "b_rank < YNN_MAX_TENSOR_RANK";
  depth 5 runs), and every level is compiled code.

  Raises:
    ValueError: max_depth < 1.
  """
  if max_depth < 1:
    raise ValueError(f"limit_depth: max_depth={max_depth!r} must be >= 1")
  t = tree.tree
  depth = [t.depth(n) for n in range(t.num_nodes)]
  if max(depth) <= max_depth:
    return tree
  keep = [n for n in range(t.num_nodes) if depth[n] <= max_depth - 1]
  index = {n: i for i, n in enumerate(keep)}
  segments = [t.segments[n] for n in keep]
  parents = [-1 if t.parents[n] < 0 else index[t.parents[n]] for n in keep]
  model = [tree.model_mask[n] for n in keep]
  ends = []
  for end in t.ends:
    path = t.path(end)   # root first
    if depth[end] <= max_depth - 1:
      ends.append(index[end])
      continue
    rest = path[max_depth:]   # the nodes at depth >= max_depth
    segments.append(np.concatenate([np.asarray(t.segments[n]) for n in rest]).astype(np.int32))
    model.append(np.concatenate([np.asarray(tree.model_mask[n]) for n in rest]))
    parents.append(index[path[max_depth - 1]])
    ends.append(len(segments) - 1)
  return EpisodeTree(RolloutTree(tuple(segments), tuple(parents), tuple(ends)), tuple(model))


def merge_short(tree: EpisodeTree, min_tokens: int) -> EpisodeTree:
  """The episode tree with every shared node shorter than `min_tokens` unshared: such a node (not the
  prompt, not where an episode ends) is removed and its tokens (roles kept) open each of its children
  instead, which hang from its parent. Runs of short nodes merge until they reach min_tokens. Like
  `limit_depth`, sharing less computes more tokens, never other values, so replay stays exact.

  Why: the token trie of sampled episodes is cut wherever two episodes diverge, so a few tokens of
  tool-call boilerplate common to some episodes become a node, and each such node a level of the
  padded tree (`data.trees.pad_tree`: a level's slots are the product of the fan-outs above it, its
  length that of its longest node). Sharing a node of L tokens by k episodes saves (k - 1) L
  positions; a level costs the padding of its slots and a program shape. Unsharing the short
  nodes keeps what pays (the prompt, long common turns and observations) in fewer, fuller levels.

  Example (min_tokens 32): prompt -> "<tool_call>" (3 tokens, 5 episodes) -> 5 different calls
  becomes prompt -> 5 leaves each starting with the 3 tokens: one level instead of two.

  Raises:
    ValueError: min_tokens < 1.
  """
  if min_tokens < 1:
    raise ValueError(f"merge_short: min_tokens={min_tokens!r} must be >= 1")
  t = tree.tree
  parents_with_children, ends = {p for p in t.parents if p >= 0}, set(t.ends)
  index, carried = {0: 0}, {}   # old id -> new id (kept nodes); removed node -> (tokens, model mask) it hands down
  segments, parents, model = [np.asarray(t.segments[0])], [-1], [tree.model_mask[0]]
  for n in range(1, t.num_nodes):   # parents precede children
    p = t.parents[n]
    head_tokens, head_mask = carried.get(p, (np.zeros(0, np.int32), np.zeros(0, bool)))
    tokens = np.concatenate([head_tokens, np.asarray(t.segments[n], np.int32)])
    mask = np.concatenate([head_mask, np.asarray(tree.model_mask[n], bool)])
    if n in parents_with_children and n not in ends and len(tokens) < min_tokens:
      carried[n] = (tokens, mask)
      continue
    kept = p
    while kept not in index:
      kept = t.parents[kept]
    index[n] = len(segments)
    segments.append(tokens)
    parents.append(index[kept])
    model.append(mask)
  return EpisodeTree(RolloutTree(tuple(segments), tuple(parents), tuple(index[e] for e in t.ends)), tuple(model))


def _per_episode(name, values, g):
  values = np.asarray(values)
  if values.shape != (g,):
    raise ValueError(f"{name} has shape {values.shape}; needs one value per episode, ({g},)")
  return values


def episode_tree_arrays(tree: EpisodeTree, advantage_g, weights_g, *, vocab_size: int, max_positions: int,
                        per_node: dict | None = None, prompt_bucket: int | None = None,
                        pad_id: int = 0) -> RolloutBatch:
  """The replay layout: the episode tree's padded levels (`data.trees.pad_tree`) as a RolloutBatch.

  Args:
    advantage_g: [G] per-episode advantages; laid out per (token, episode) as advantage [.., T_d, G]
      (A_g on model tokens of the episodes through a node, 0 elsewhere, `EpisodeTree.per_token`).
    weights_g: [G] per-episode token weights (`losses.trajectory_weights` of `model_lengths()`), laid
      out the same way as weights [.., T_d, G].
    vocab_size, max_positions: the model's; every episode's ids are checked as the naive layout's
      (`data.groups.check_token_ids`).
    per_node: other per-token fields, name -> per node [L_n] (e.g. "old_logp", "ref_logp").
    prompt_bucket, pad_id: as `pad_tree`.

  Raises:
    ValueError: advantage_g or weights_g not of shape [G]; a field Segments lacks; an id outside
      [0, vocab_size) or an episode longer than max_positions (naming the episode), as the naive layout.
  """
  g = tree.num_episodes
  episodes = [tree.episode(k) for k in range(g)]
  check_token_ids(np.asarray(episodes[0].prompt), [np.asarray(e.tokens()) for e in episodes], vocab_size=vocab_size,
                  max_positions=max_positions, where="episode_tree_arrays", name="episodes")
  fields = {"weights": tree.per_token(_per_episode("weights_g", weights_g, g)),
            "advantage": tree.per_token(_per_episode("advantage_g", advantage_g, g)),
            "end_share": tree.tree.end_shares(), **(per_node or {})}
  return tree_arrays(pad_tree(tree.tree, pad_id=pad_id, prompt_bucket=prompt_bucket), fields)


def episode_group_arrays(episodes: Sequence[Episode], advantage_g, weights_g, *, per_episode: dict | None = None,
                         vocab_size: int, max_positions: int, pad_id: int = 0, prompt_bucket: int | None = None,
                         completion_bucket: int | None = None) -> RolloutBatch:
  """The naive layout: every episode as its own row (prompt repeated by the naive step), with a loss
  mask: weights [G, T] = w_g on model tokens, 0 on observations and padding; advantage [G, T] = A_g
  on model tokens, 0 elsewhere.

  Args:
    episodes: G episodes of one problem (one prompt).
    advantage_g, weights_g: [G], as `episode_tree_arrays`.
    per_episode: other per-token fields, name -> per episode [N_g] (`EpisodeTree.along` of per-node ones).
    vocab_size, max_positions, pad_id, prompt_bucket, completion_bucket: as `data.groups.make_group`.

  Raises:
    ValueError: episodes with different prompts (naming the index), advantage_g or weights_g not of
      shape [G], a per-episode field whose length differs from its episode's tokens, and `make_group`'s.
  """
  g = len(episodes)
  for k, e in enumerate(episodes):
    if not np.array_equal(np.asarray(e.prompt), np.asarray(episodes[0].prompt)):
      raise ValueError(f"episode_group_arrays: episodes[{k}].prompt differs from episodes[0].prompt")
  adv, w = _per_episode("advantage_g", advantage_g, g), _per_episode("weights_g", weights_g, g)
  group = make_group(episodes[0].prompt, [e.tokens() for e in episodes], vocab_size=vocab_size,
                     max_positions=max_positions, pad_id=pad_id, prompt_bucket=prompt_bucket,
                     completion_bucket=completion_bucket)
  t = group.completion_ids.shape[1]
  model = np.stack([np.pad(e.model_mask(), (0, t - len(e.tokens()))) for e in episodes])
  zero = lambda x: np.zeros((), x.dtype)
  fields = {"weights": np.where(model, w[:, None], zero(w)), "advantage": np.where(model, adv[:, None], zero(adv))}
  for name, values in (per_episode or {}).items():
    rows = []
    for k, (e, v) in enumerate(zip(episodes, values)):
      v = np.asarray(v)
      if v.shape[:1] != (len(e.tokens()),):
        raise ValueError(f"episode_group_arrays: {name}[{k}] has {v.shape[:1]} tokens; episode {k} has {len(e.tokens())}")
      rows.append(np.pad(v, [(0, t - len(v))] + [(0, 0)] * (v.ndim - 1)))
    fields[name] = np.stack(rows)
  return group_arrays(group, **fields)
