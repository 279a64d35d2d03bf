"""Rollout groups: a prompt and G ragged completions, bucketed to fixed shapes, and their counts.

Layout of a group (P prompt tokens, G completions padded to T = bucket(max length)):

    prompt_ids   [P_pad]   p0 p1 p2 p3 .  .          (P = 4 real tokens, padded to P_pad)
    completion_ids [G, T]  a0 a1 a2 .  .  .          ('.' = pad_id, completion_mask False)
                           b0 .  .  .  .  .
                           c0 c1 c2 c3 c4 c5

The completion's token i sits at absolute position P + i; its log-prob comes from the hidden
state at position P + i - 1, i.e. the prompt's LAST real position for i = 0.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:  # counts only read attributes; tree.py stays below models/ in the import order
  from branch_replay_jax.models.config import ModelConfig


def bucket_length(n: int, *, minimum: int = 16) -> int:
  """Smallest power of two >= max(n, minimum): few distinct shapes, so few XLA compiles."""
  b = minimum
  while b < n:
    b *= 2
  return b


@dataclasses.dataclass(frozen=True)
class RolloutGroup:
  """One prompt and its G completions as padded host arrays.

  prompt_ids: [P_pad] int32, the prompt right-padded with pad_id.
  prompt_len: P, real prompt tokens (>= 1).
  completion_ids: [G, T] int32, right-padded with pad_id.
  completion_mask: [G, T] bool, True on real completion tokens.
  lengths: [G] int32 completion lengths (tokens).
  """

  prompt_ids: np.ndarray
  prompt_len: int
  completion_ids: np.ndarray
  completion_mask: np.ndarray
  lengths: np.ndarray

  @property
  def num_completions(self) -> int:
    return self.completion_ids.shape[0]

  @property
  def prompt_mask(self) -> np.ndarray:
    return np.arange(self.prompt_ids.shape[0]) < self.prompt_len


def make_group(prompt_ids: Sequence[int], completions: Sequence[Sequence[int]], *, vocab_size: int,
               max_positions: int, pad_id: int = 0, prompt_bucket: int | None = None,
               completion_bucket: int | None = None) -> RolloutGroup:
  """Validate and pad a prompt and its completions into a `RolloutGroup`.

  Args:
    prompt_ids: the prompt's token ids (>= 1 token).
    completions: G >= 1 completions, each a sequence of >= 1 token ids.
    vocab_size, max_positions: the model's vocabulary size and context length (tokens).
    pad_id: filler id for padding (any valid id; padding is masked everywhere).
    prompt_bucket / completion_bucket: padded lengths; default `bucket_length` of the longest.

  Raises:
    ValueError: naming the offending field: no completions, an empty prompt or completion, an id
      outside [0, vocab_size), a sequence longer than max_positions, a bucket shorter than the data.
  """
  prompt = np.asarray(prompt_ids)
  if prompt.ndim != 1 or prompt.size == 0:
    raise ValueError(f"make_group: prompt_ids must be a non-empty 1-D sequence, got shape {prompt.shape}")
  if len(completions) == 0:
    raise ValueError("make_group: completions is empty; a group needs at least one completion")
  comps = [np.asarray(c) for c in completions]
  for i, c in enumerate(comps):
    if c.ndim != 1 or c.size == 0:
      raise ValueError(f"make_group: completions[{i}] must be a non-empty 1-D sequence, got shape {c.shape}")
  for name, arr in [("prompt_ids", prompt)] + [(f"completions[{i}]", c) for i, c in enumerate(comps)]:
    if not np.issubdtype(arr.dtype, np.integer):
      raise ValueError(f"make_group: {name} must hold integer token ids, got dtype {arr.dtype}")
    bad = arr[(arr < 0) | (arr >= vocab_size)]
    if bad.size:
      raise ValueError(f"make_group: {name} holds token id {int(bad[0])} outside [0, {vocab_size})")
  lengths = np.array([c.size for c in comps], dtype=np.int32)
  p = prompt.size
  if p + lengths.max() > max_positions:
    i = int(lengths.argmax())
    raise ValueError(f"make_group: prompt ({p} tokens) + completions[{i}] ({lengths[i]} tokens) exceeds the "
                     f"model's max_positions={max_positions}")
  p_pad = prompt_bucket if prompt_bucket is not None else bucket_length(p)
  t_pad = completion_bucket if completion_bucket is not None else bucket_length(int(lengths.max()), minimum=8)
  if p_pad < p:
    raise ValueError(f"make_group: prompt_bucket={p_pad} is shorter than the prompt ({p} tokens)")
  if t_pad < lengths.max():
    raise ValueError(f"make_group: completion_bucket={t_pad} is shorter than the longest completion "
                     f"({lengths.max()} tokens)")
  ids = np.full((len(comps), t_pad), pad_id, dtype=np.int32)
  for i, c in enumerate(comps):
    ids[i, :c.size] = c
  mask = np.arange(t_pad)[None, :] < lengths[:, None]
  prompt_pad = np.full((p_pad,), pad_id, dtype=np.int32)
  prompt_pad[:p] = prompt
  return RolloutGroup(prompt_pad, p, ids, mask, lengths)


def group_counts(prompt_len: int, lengths: Sequence[int], config: "ModelConfig | None" = None) -> dict:
  """Token-position and FLOP counts of one group, naive versus replay (real tokens, no padding).

  token_positions_naive = Σ_g (P + T_g): positions the naive step computes (prompt repeated).
  token_positions_computed = P + Σ_g T_g: positions replay computes (each unique one once).

  With a model config, `ideal_flop_ratio` = naive FLOPs / replay FLOPs, counting per position
  2·N_lin multiply-adds of the dense layers (N_lin: `params_per_token_linear` without the output
  head) plus 4·L·Hq·D per visible (query, key) pair for QKᵀ and PV, plus the output head at the
  Σ T_g scored positions (the same in both: the strongest naive scores only completions).
  A sequence of n tokens has n(n+1)/2 causal pairs; a completion of T_g tokens on a P-token
  prompt has T_g·P + T_g(T_g+1)/2. Forward and backward both scale with these counts, so the
  ratio is that of a training step too.
  """
  lengths = np.asarray(lengths, dtype=np.int64)
  p = int(prompt_len)
  out = {
      "token_positions_naive": int(np.sum(p + lengths)),
      "token_positions_computed": int(p + lengths.sum()),
  }
  if config is not None:
    lin = 2 * (config.params_per_token_linear - config.d_model * config.vocab_size)
    pair = 4 * config.num_layers * config.num_heads * config.head_dim
    head = 2 * config.d_model * config.vocab_size * int(lengths.sum())
    tri = lambda n: n * (n + 1) // 2
    naive = float(np.sum(lin * (p + lengths) + pair * tri(p + lengths))) + head
    replay = float(lin * (p + lengths.sum()) + pair * (tri(p) + np.sum(lengths * p + tri(lengths)))) + head
    out["ideal_flop_ratio"] = naive / replay
  return out


def group_from_padded(prompt_ids: Sequence[int], completion_ids, lengths, **kwargs) -> RolloutGroup:
  """`make_group` from padded sampler output: completion_ids [G, T] and lengths [G].

  Raises:
    ValueError: mismatched G between completion_ids and lengths, a negative length or one
      longer than T, plus everything `make_group` raises.
  """
  ids = np.asarray(completion_ids)
  lengths = np.asarray(lengths)
  if ids.ndim != 2:
    raise ValueError(f"group_from_padded: completion_ids must be [G, T], got shape {ids.shape}")
  if lengths.shape != (ids.shape[0],):
    raise ValueError(f"group_from_padded: lengths has shape {lengths.shape}, completion_ids has G={ids.shape[0]}")
  if np.any(lengths < 0) or np.any(lengths > ids.shape[1]):
    raise ValueError(f"group_from_padded: lengths {lengths.tolist()} must lie in [0, T={ids.shape[1]}]")
  return make_group(prompt_ids, [row[:n] for row, n in zip(ids, lengths)], **kwargs)


# ----------------------------------------------------------------------------------------------
# Rollout trees of any depth.
#
#   node 0 (prompt, o=0, L=5) ── node 1 (o=5, L=3) ── node 3 (o=8, L=2)   trajectory 0 ends at node 3
#                              │                    └─ node 4 (o=8, L=4)   trajectory 1 ends at node 4
#                              └─ node 2 (o=5, L=6)                        trajectory 2 ends at node 2
#
# A trajectory is the path from the root to the node where it ends (usually a leaf; a node may
# end one trajectory and continue others). Its completion is the path without the root.


@dataclasses.dataclass(frozen=True)
class RolloutTree:
  """Segments of token ids with parents; trajectories end at given nodes.

  segments: tuple of 1-D int32 arrays; segments[0] is the prompt; every segment has >= 1 token.
  parents: tuple of ints, parents[0] == -1 and parents[n] < n otherwise.
  ends: tuple of node ids, one per trajectory (G = len(ends)); rewards align with it.
  """

  segments: tuple
  parents: tuple
  ends: tuple

  def __post_init__(self):
    if not self.segments or self.parents[0] != -1 or len(self.parents) != len(self.segments):
      raise ValueError("RolloutTree: segments and parents must have equal length with parents[0] == -1")
    for n, (seg, p) in enumerate(zip(self.segments, self.parents)):
      if n and not 0 <= p < n:
        raise ValueError(f"RolloutTree: parents[{n}]={p} must be an earlier node")
      if np.asarray(seg).ndim != 1 or len(seg) == 0:
        raise ValueError(f"RolloutTree: segment {n} must be a non-empty 1-D array of token ids")
    if not self.ends or any(not 0 < e < len(self.segments) for e in self.ends):
      raise ValueError(f"RolloutTree: ends={self.ends} must name non-root nodes; a tree needs a trajectory")

  @property
  def num_nodes(self) -> int:
    return len(self.segments)

  def children(self, n: int) -> list[int]:
    return [c for c, p in enumerate(self.parents) if p == n]

  def path(self, n: int) -> list[int]:
    """Nodes from the root to n."""
    out = [n]
    while self.parents[out[-1]] >= 0:
      out.append(self.parents[out[-1]])
    return out[::-1]

  def depth(self, n: int) -> int:
    return len(self.path(n)) - 1

  def offsets(self) -> list[int]:
    """o_n = o_parent + L_parent: absolute position of each segment's first token."""
    out = [0] * self.num_nodes
    for n in range(1, self.num_nodes):
      p = self.parents[n]
      out[n] = out[p] + len(self.segments[p])
    return out

  def completion_lengths(self) -> np.ndarray:
    """[G] tokens of each trajectory after the prompt."""
    return np.array([sum(len(self.segments[m]) for m in self.path(e)[1:]) for e in self.ends], np.int64)

  def completion(self, g: int) -> np.ndarray:
    return np.concatenate([np.asarray(self.segments[m]) for m in self.path(self.ends[g])[1:]])

  def membership(self) -> np.ndarray:
    """[N, G] bool: node n lies on trajectory g's path."""
    out = np.zeros((self.num_nodes, len(self.ends)), bool)
    for g, e in enumerate(self.ends):
      out[self.path(e), g] = True
    return out

  def node_weights(self, trajectory_weights_g) -> list[np.ndarray]:
    """Per node [L_n, G]: w_g on every token of node n for each trajectory g through n, else 0.

    With `objectives.trajectory_weights` this gives the per-(token, trajectory) weights of the
    tree loss Σ_t Σ_g w[t, g] ℓ(t, g) (DESIGN.md, "Losses on trees")."""
    w = np.asarray(trajectory_weights_g)
    member = self.membership()
    return [np.broadcast_to(member[n] * w, (len(seg), w.size)) for n, seg in enumerate(self.segments)]


def tree_from_trajectories(prompt_ids: Sequence[int], completions: Sequence[Sequence[int]]) -> RolloutTree:
  """Merge completions of one prompt on their common token prefixes (a radix trie).

  A segment is cut where completions diverge and where one of them ends, so identical
  prefixes are stored, and computed, once. Trajectory g ends at the node holding its last token.

  Raises:
    ValueError: empty prompt, no completions, or an empty completion.
  """
  prompt = np.asarray(prompt_ids, np.int32)
  if prompt.ndim != 1 or prompt.size == 0:
    raise ValueError("tree_from_trajectories: prompt_ids must be a non-empty 1-D sequence")
  if not completions or any(len(c) == 0 for c in completions):
    raise ValueError("tree_from_trajectories: needs at least one completion, each with >= 1 token")
  comps = [tuple(int(t) for t in c) for c in completions]
  segments, parents, ends = [prompt], [-1], [0] * len(comps)

  def build(members: list[int], start: int, parent: int):
    # Group the completions that continue past `start` by their next token.
    by_token: dict[int, list[int]] = {}
    for g in members:
      if len(comps[g]) > start:
        by_token.setdefault(comps[g][start], []).append(g)
    for group in by_token.values():
      stop = start + 1   # extend while all agree and none ends
      while all(len(comps[g]) > stop for g in group) and len({comps[g][stop] for g in group}) == 1:
        stop += 1
      segments.append(np.asarray(comps[group[0]][start:stop], np.int32))
      parents.append(parent)
      node = len(segments) - 1
      for g in group:
        if len(comps[g]) == stop:
          ends[g] = node
      build(group, stop, node)

  build(list(range(len(comps))), 0, 0)
  return RolloutTree(tuple(segments), tuple(parents), tuple(ends))


def tree_counts(tree: RolloutTree, config: "ModelConfig | None" = None) -> dict:
  """`group_counts` for a tree: every distinct token position computed once.

  token_positions_naive = Σ_g |path(g)| (each trajectory from scratch); token_positions_computed =
  Σ_n L_n. Attention pairs: naive Σ_g |path(g)|(|path(g)|+1)/2, tree Σ_n L_n o_n + L_n(L_n+1)/2.
  FLOPs as in `group_counts` (dense layers per position, 4·L·Hq·D per pair, the output head at
  the scored positions: naive Σ_g |o_g|, tree Σ_{n>0} L_n).
  """
  lens = np.array([len(s) for s in tree.segments], np.int64)
  offsets = np.array(tree.offsets(), np.int64)
  paths = np.array([int(lens[0]) + int(c) for c in tree.completion_lengths()], np.int64)
  out = {"token_positions_naive": int(paths.sum()), "token_positions_computed": int(lens.sum())}
  if config is not None:
    lin = 2 * (config.params_per_token_linear - config.d_model * config.vocab_size)
    pair = 4 * config.num_layers * config.num_heads * config.head_dim
    head = 2 * config.d_model * config.vocab_size
    tri = lambda n: n * (n + 1) // 2
    naive = lin * paths.sum() + pair * tri(paths).sum() + head * (paths - lens[0]).sum()
    tree_flops = lin * lens.sum() + pair * (lens * offsets + tri(lens)).sum() + head * lens[1:].sum()
    out["ideal_flop_ratio"] = float(naive) / float(tree_flops)
  return out


@dataclasses.dataclass(frozen=True)
class PaddedTree:
  """A tree on uniform per-level shapes, for nested replay (siblings share one compiled body).

  Level d (d = 1..D) holds every node at depth d in a slot (i_1, ..., i_d): the node is child
  i_d of the node in slot (i_1, ..., i_{d-1}). F_d is the largest fan-out into level d and T_d
  the bucketed longest segment of level d; empty slots are padding (mask False).

  prompt_ids: [P_pad] int32, prompt_len: P.
  tokens[d-1]: [F_1, ..., F_d, T_d] int32;  mask[d-1]: same shape, bool.
  node_ids[d-1]: [F_1, ..., F_d] int32, the tree node in each slot or -1.
  padding_fraction: padded / all token positions computed (prompt bucket included).
  """

  prompt_ids: np.ndarray
  prompt_len: int
  tokens: tuple
  mask: tuple
  node_ids: tuple
  padding_fraction: float

  def place(self, per_node: Sequence[np.ndarray], level: int, fill=0.0) -> np.ndarray:
    """Scatter per-node arrays [L_n, ...] (indexed by node id) into level `level`'s slots [F.., T_d, ...]."""
    ids = self.node_ids[level - 1]
    t = self.tokens[level - 1].shape[-1]
    trailing = next(np.shape(per_node[n])[1:] for n in ids.reshape(-1) if n >= 0)
    out = np.full(ids.shape + (t,) + trailing, fill, dtype=np.result_type(per_node[int(ids.max())]))
    for slot in zip(*np.nonzero(ids >= 0)):
      value = np.asarray(per_node[ids[slot]])
      out[slot][:len(value)] = value
    return out


def pad_tree(tree: RolloutTree, *, pad_id: int = 0, prompt_bucket: int | None = None) -> PaddedTree:
  """Lay `tree` out level by level (see `PaddedTree`); segment lengths bucket to powers of two >= 8."""
  depth = max(tree.depth(n) for n in range(tree.num_nodes))
  slots = {0: ()}
  for n in range(1, tree.num_nodes):   # parents precede children
    siblings = tree.children(tree.parents[n])
    slots[n] = slots[tree.parents[n]] + (siblings.index(n),)
  fanouts = [1 + max(slots[n][d - 1] for n in slots if len(slots[n]) == d) for d in range(1, depth + 1)]
  tokens, mask, node_ids = [], [], []
  for d in range(1, depth + 1):
    members = [n for n in slots if len(slots[n]) == d]
    t = bucket_length(max(len(tree.segments[n]) for n in members), minimum=8)
    ids = np.full(tuple(fanouts[:d]), -1, np.int32)
    tok = np.full(tuple(fanouts[:d]) + (t,), pad_id, np.int32)
    for n in members:
      ids[slots[n]] = n
      tok[slots[n]][:len(tree.segments[n])] = tree.segments[n]
    tokens.append(tok)
    node_ids.append(ids)
    mask.append(np.arange(t) < np.array([0] + [len(s) for s in tree.segments])[ids + 1][..., None])
  prompt = np.asarray(tree.segments[0], np.int32)
  p_pad = prompt_bucket if prompt_bucket is not None else bucket_length(prompt.size)
  if p_pad < prompt.size:
    raise ValueError(f"pad_tree: prompt_bucket={p_pad} is shorter than the prompt ({prompt.size} tokens)")
  prompt_pad = np.full((p_pad,), pad_id, np.int32)
  prompt_pad[:prompt.size] = prompt
  computed = p_pad + sum(t.size for t in tokens)
  real = sum(len(s) for s in tree.segments)
  return PaddedTree(prompt_pad, int(prompt.size), tuple(tokens), tuple(mask), tuple(node_ids),
                    (computed - real) / computed)
