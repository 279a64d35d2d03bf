"""Rollout trees of any depth: segments with parents, the trie merge of trajectories, and the
level-by-level padded layout of nested replay.

  node 0 (prompt, o=0, L=5) ── node 1 (o=5, L=3) ── node 3 (o=8, L=2)   trajectory 0 ends at node 3
                             │                    └─ node 4 (o=8, L=4)   trajectory 1 ends at node 4
                             └─ node 2 (o=5, L=6)                        trajectory 2 ends at node 2

A trajectory is the path from the root to the node where it ends (usually a leaf; a node may
end one trajectory and continue others). Its completion is the path without the root.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from branch_replay_jax.data.groups import SEGMENT_BUCKETS_PER_OCTAVE, bucket_length


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

  def along(self, per_node: Sequence) -> list[np.ndarray]:
    """Per trajectory g, per-node arrays [L_n, ...] concatenated along its path (prompt excluded): [N_g, ...]."""
    return [np.concatenate([np.asarray(per_node[n]) for n in self.path(e)[1:]]) for e in self.ends]

  def rows(self, per_node: Sequence, width: int) -> np.ndarray:
    """[G, width, ...]: `along`, each trajectory's values 0-padded to `width` (the naive rows' layout).

    Raises:
      ValueError: a trajectory longer than `width`.
    """
    self._check_per_node(per_node, "RolloutTree.rows")
    paths = self.along(per_node)
    longest = max(len(r) for r in paths)
    if longest > width:
      raise ValueError(f"RolloutTree.rows: width={width} is shorter than the longest trajectory ({longest} tokens)")
    out = np.zeros((len(paths), width) + paths[0].shape[1:], np.result_type(*paths))
    for g, r in enumerate(paths):
      out[g, :len(r)] = r
    return out

  def _check_per_node(self, per_node: Sequence, where: str) -> None:
    """Raise ValueError unless per_node holds one entry per node, each below the root (which no row reads) an
    array whose first axis is the node's length."""
    if len(per_node) != self.num_nodes:
      raise ValueError(f"{where}: per_node has {len(per_node)} entries; the tree has {self.num_nodes} nodes")
    bad = [n for n, (v, seg) in enumerate(zip(per_node, self.segments))
           if n > 0 and np.shape(v)[:1] != (len(seg),)]
    if bad:
      n = bad[0]
      raise ValueError(f"{where}: per_node[{n}] has shape {np.shape(per_node[n])}; node {n} has "
                       f"{len(self.segments[n])} tokens")

  def columns(self, rows) -> list[np.ndarray]:
    """Inverse of `rows` per trajectory: per node [L_n, G, ...], row g's values at node n's positions of
    trajectory g's path where g passes n, else 0 (the root's is 0). rows: [G, width, ...].

    Raises:
      ValueError: rows not [G, width, ...] with this tree's G and width >= its longest trajectory.
    """
    rows = np.asarray(rows)
    longest = int(self.completion_lengths().max())
    if rows.ndim < 2 or rows.shape[0] != len(self.ends) or rows.shape[1] < longest:
      raise ValueError(f"RolloutTree.columns: rows of shape {rows.shape}; expected [G={len(self.ends)}, width >= "
                       f"{longest}, ...]")
    out = [np.zeros((len(s), len(self.ends)) + rows.shape[2:], rows.dtype) for s in self.segments]
    for g, end in enumerate(self.ends):
      pos = 0
      for m in self.path(end)[1:]:
        out[m][:, g] = rows[g, pos:pos + len(self.segments[m])]
        pos += len(self.segments[m])
    return out

  def membership(self) -> np.ndarray:
    """[N, G] bool: node n lies on trajectory g's path."""
    out = np.zeros((self.num_nodes, len(self.ends)), bool)
    for g, e in enumerate(self.ends):
      out[self.path(e), g] = True
    return out

  def end_shares(self) -> list[np.ndarray]:
    """Per node [L_n] float64 (float32 on a device without x64): at its first token the share of the G
    trajectories that end at it (count / G), 0 elsewhere (`Segments.end_share`: a tree node's weight in a mean
    over trajectories)."""
    counts = np.bincount(np.asarray(self.ends), minlength=self.num_nodes) / len(self.ends)
    return [np.concatenate([[counts[n]], np.zeros(len(seg) - 1)]) for n, seg in enumerate(self.segments)]

  def node_weights(self, trajectory_weights_g) -> list[np.ndarray]:
    """Per node [L_n, G]: w_g on every token of node n for each trajectory g through n, else 0.

    With `losses.trajectory_weights` this gives the per-(token, trajectory) weights of the
    tree loss Σ_t Σ_g w[t, g] ℓ(t, g) (docs/design.md, "Losses on trees")."""
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
  if len(completions) == 0 or any(len(c) == 0 for c in completions):
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
    out = np.full(ids.shape + (t,) + trailing, fill,
                  dtype=np.result_type(*[np.asarray(per_node[n]) for n in ids.reshape(-1) if n >= 0]))
    for slot in zip(*np.nonzero(ids >= 0)):
      value = np.asarray(per_node[ids[slot]])
      out[slot][:len(value)] = value
    return out

  def unplace(self, levels: Sequence) -> list[np.ndarray]:
    """Inverse of `place` over every level: per node [L_n] (the root: zeros [prompt_len]) from per-level
    slot arrays [F_1..F_d, T_d] (a step's per-level outputs), or from a larger layout padded at the end of
    each axis (`data.batches.pad_trees`, as on a mesh): this tree's slots come first on every axis. Trailing
    axes after T_d are kept (the root's zeros have them too); one dtype for all, copies of the input.

    Raises:
      ValueError: fewer levels than this layout's, or a level smaller than its slots and length.
    """
    levels = self._check_levels(levels, "PaddedTree.unplace", with_t=True)
    dtype = np.result_type(*[v.dtype for v in levels])
    trailing = levels[0].shape[self.node_ids[0].ndim + 1:]
    out = [np.zeros((self.prompt_len,) + trailing, dtype)] + [None] * max(int(ids.max()) for ids in self.node_ids)
    for ids, mask, values in zip(self.node_ids, self.mask, levels):
      for slot in zip(*np.nonzero(ids >= 0)):
        out[ids[slot]] = values[slot][:int(mask[slot].sum())].astype(dtype, copy=True)
    return out

  def _check_levels(self, levels: Sequence, where: str, with_t: bool) -> list[np.ndarray]:
    """This layout's levels of `levels` (a larger layout may have more), as arrays; ValueError for fewer levels
    or a level smaller than this layout's."""
    levels = [np.asarray(v) for v in levels]
    if len(levels) < len(self.node_ids):
      raise ValueError(f"{where}: {len(levels)} levels; the layout has {len(self.node_ids)}")
    levels = levels[:len(self.node_ids)]
    for d, (ids, tokens, v) in enumerate(zip(self.node_ids, self.tokens, levels), start=1):
      need = tokens.shape if with_t else ids.shape
      if v.ndim < len(need) or any(a < b for a, b in zip(v.shape, need)):
        raise ValueError(f"{where}: level {d} has shape {v.shape}; the layout's slots need at least {need}")
    return levels

  def slot_values(self, levels: Sequence) -> np.ndarray:
    """[N]: per node the value of its slot (the root: 0) from per-level slot arrays [F_1..F_d] (a value per
    node, such as the critic's value after its last token), or a larger layout padded at the end of each axis."""
    levels = self._check_levels(levels, "PaddedTree.slot_values", with_t=False)
    out = np.zeros(1 + max(int(ids.max()) for ids in self.node_ids), np.result_type(*[v.dtype for v in levels]))
    for ids, values in zip(self.node_ids, levels):
      values = values[tuple(slice(n) for n in ids.shape)]
      out[ids[ids >= 0]] = values[ids >= 0]
    return out


def pad_tree(tree: RolloutTree, *, pad_id: int = 0, prompt_bucket: int | None = None) -> PaddedTree:
  """Lay `tree` out level by level (see `PaddedTree`); a level's length T_d buckets its longest segment
  (`bucket_length` with SEGMENT_BUCKETS_PER_OCTAVE buckets per doubling, >= 8), the prompt to a power of two."""
  depth = max(tree.depth(n) for n in range(tree.num_nodes))
  slots = {0: ()}
  for n in range(1, tree.num_nodes):   # parents precede children
    siblings = tree.children(tree.parents[n])
    slots[n] = slots[tree.parents[n]] + (siblings.index(n),)
  fanouts = [1 + max(slots[n][d - 1] for n in slots if len(slots[n]) == d) for d in range(1, depth + 1)]
  tokens, mask, node_ids = [], [], []
  for d in range(1, depth + 1):
    members = [n for n in slots if len(slots[n]) == d]
    t = bucket_length(max(len(tree.segments[n]) for n in members), minimum=8, per_octave=SEGMENT_BUCKETS_PER_OCTAVE)
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
