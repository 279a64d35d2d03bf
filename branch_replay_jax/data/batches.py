"""Typed device batches of rollout groups, trees and their completions: what every step consumes.

    Segments      one completion per row (a group's branches, [G, T]) or one tree node per slot
                  (a tree level, [F_1..F_d, T_d]): tokens, mask and the fields a loss reads.
    RolloutBatch  prompt_ids [P_pad], prompt_len [], levels: tuple of Segments, level d = 1..D
                  with leading slot axes [F_1..F_d] (docs/design.md, "Trees: slots and levels"); a
                  group is its one-level form whose rows are trajectories (`RolloutBatch.rows`).
    PackedBatch   a tree packed into one row (train.tree_schedule = "packed").

All three are `flax.struct` dataclasses, so they are pytrees: `jax.jit`, `jax.vmap`, `lax.scan`
and `jax.tree_util.tree_map` (micro-batch splits, stacking on the mesh) see their arrays, and a
field left `None` is no leaf. Builders:

    group_arrays(group, **fields)              -> a group's RolloutBatch (rows)
    tree_arrays(padded, per_node, **shared)    -> a tree's RolloutBatch (levels)
    trajectory_group_arrays(tree, ...)         -> the tree's trajectories as a group's rows (the naive layout)
    pad_trees(trees)                           -> trees of one shape (a mesh step stacks them)
    pack_trees(trees)                          -> PackedBatches of one shape: each tree as one row
                                                  (train.tree_layout = "packed")

One name per quantity: "advantage" is GRPO/RLOO's per-trajectory advantage and PPO's per-token
GAE advantage alike; its shape (below) says which.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from branch_replay_jax.data.groups import RolloutGroup, bucket_length, make_group
from branch_replay_jax.data.trees import PaddedTree, RolloutTree


@struct.dataclass
class Segments:
  """Token segments and the per-token / per-trajectory fields a loss reads, on leading axes L.

  L is [G] for a group's completions and [F_1..F_d] for the slots of tree level d; T is the
  segment's padded length. A tree node's token is shared by every trajectory g below it, so its
  per-trajectory fields carry a trailing axis G (all trajectories of the tree; 0 weight where g
  does not pass). Fields a loss does not read stay None.

  tokens: [L, T] int32 token ids (pad id on padding).
  mask: [L, T] bool, True on real tokens.
  weights: float32 loss weights, 0 on padding: [L, T] per completion token (group), or [L, T, G]
    per (token, trajectory) pair (tree node); `losses.token_weights`, `losses.trajectory_weights`.
  advantage: float32. GRPO/RLOO: [L] per completion (group) or [L, G] per trajectory (tree node,
    the same G values in every slot); PPO (GAE, per token): [L, T] (group) or [L, T, G] (tree node);
    an episode's GRPO/RLOO advantage per token, A_g on model tokens and 0 on observations
    (data/episodes.py): [L, T] (group) or [L, T, G] (tree node).
  old_logp: [L, T] float32 log-probs under the sampling policy (nats; 0 on padding).
  ref_logp: [L, T] float32 log-probs under the reference policy (nats; 0 on padding).
  old_values: [L, T] float32 the critic's values at sampling time (PPO).
  returns: float32 value targets (PPO): [L, T] (group) or [L, T, G] (tree node).
  sampler_logp: [L, T] float32 log-probs the sampler drew the tokens with (nats; 0 on padding and
    on an episode's observation tokens): `Rollouts.logprobs`, a tree node's from the one sample that
    drew it.
  rollout_is: float32, weights' shape: each (token, trajectory) pair's importance correction against
    the sampler (`correction.correct`), a constant on its policy-gradient term; None: 1.
  end_share: [L, T] float32, a tree node's only (`data.trees.RolloutTree.end_shares`): at its first token
    the share of the tree's trajectories that end at it, 0 elsewhere; what a mean over trajectories weighs
    the node's path by (the load-balancing loss, `gradients.step`). None: each row ends one of the group's
    trajectories (a completion, a naive row).
  routes: [L, T, layers, k] int32, a Qwen3-MoE sampler's recorded experts per token and layer (-1: none, e.g.
    a full-length completion's last token, drawn but never fed); `RolloutBatch.prompt_routes` the prompt's.
  """
  tokens: jax.Array
  mask: jax.Array
  weights: jax.Array | None = None
  advantage: jax.Array | None = None
  old_logp: jax.Array | None = None
  ref_logp: jax.Array | None = None
  old_values: jax.Array | None = None
  returns: jax.Array | None = None
  sampler_logp: jax.Array | None = None
  rollout_is: jax.Array | None = None
  end_share: jax.Array | None = None
  routes: jax.Array | None = None


FIELDS = tuple(f.name for f in dataclasses.fields(Segments))
LOSS_FIELDS = FIELDS[2:]
# Fields that carry a trailing trajectory axis G in a tree node (per (token, trajectory) or per
# trajectory); the others are per token, [L, T].
TRAJECTORY_FIELDS = ("weights", "advantage", "returns", "rollout_is")


@struct.dataclass
class RolloutBatch:
  """One prompt and what was sampled from it, the one batch type of every step: a group is a tree of depth one.

  prompt_ids: [P_pad] int32, real tokens first (P_pad: bucketed, `data.groups.bucket_length`).
  prompt_len: [] int32, the prompt's real length P.
  levels: tuple of D Segments; level d has L = [F_1..F_d] (slot (i_1..i_d) is child i_d of slot
    (i_1..i_{d-1})) and T = T_d, its segment length; empty slots are all padding.
  prompt_routes: [P_pad, layers, k] int32, a Qwen3-MoE sampler's recorded experts of the prompt's tokens (-1 on
    padding), with the segments' `Segments.routes`; None: none recorded.
  rows: static (part of the pytree's structure, not a leaf). True: a group (`group_batch`, `group_arrays`):
    one level of G rows, each row one trajectory (a completion, or a tree's or episodes' trajectory laid out
    naive), its fields per row (weights [G, T], GRPO's advantage [G]); the step's aux is per row. False: a
    tree (`tree_arrays`): every node once, its per-trajectory fields with a trailing axis G, a node's
    tokens shared by the trajectories below it; the step's aux is a list over levels of `NodeOutputs`.
  A stack of B batches (`distributed.mesh.stack_groups`, `PreferenceBatch.naive`) adds a leading [B].
  """
  prompt_ids: jax.Array
  prompt_len: jax.Array
  levels: tuple
  prompt_routes: jax.Array | None = None
  rows: bool = struct.field(pytree_node=False, default=False)

  @property
  def branches(self) -> Segments:
    """A group's rows, its one level: L = [G] ([B, G] stacked)."""
    return self.levels[0]


def group_batch(prompt_ids, prompt_len, branches: Segments, prompt_routes=None) -> RolloutBatch:
  """A group as a `RolloutBatch`: the prompt and its rows (`Segments` [G, T], each row one trajectory)."""
  return RolloutBatch(prompt_ids, prompt_len, (branches,), prompt_routes, rows=True)


def is_group(batch) -> bool:
  """Whether `batch` is a group's rows (`RolloutBatch.rows`)."""
  return isinstance(batch, RolloutBatch) and batch.rows


def is_tree(batch) -> bool:
  """Whether `batch` is a tree's levels (a `RolloutBatch` whose fields carry the trajectory axis)."""
  return isinstance(batch, RolloutBatch) and not batch.rows


def describe(batch) -> str:
  """What `batch` is, for error messages: "a group", "a tree of D levels", "a packed row" or its type."""
  if is_group(batch):
    return "a group"
  if is_tree(batch):
    return f"a tree of {len(batch.levels)} levels"
  return "a packed row" if isinstance(batch, PackedBatch) else type(batch).__name__


@struct.dataclass
class PackedBatch:
  """A rollout tree packed into one row: every node once, depth-first (a node, then its subtrees), the
  prompt first (what AReaL's tree training and TRL #7328 pack). The row's shape is its length alone,
  not the tree's fan-outs, depths and level lengths, so a run whose trees change every step compiles
  one program per length bucket it meets (`pack_trees`).

  row: Segments with L = [] (one row) and T the row's padded length: tokens [T] int32; mask [T] bool,
    True on the tokens the loss scores (every real token but the prompt's); weights [T, G]; advantage
    [G] (per trajectory) or [T, G] (per token and trajectory: episodes); old_logp, ref_logp [T]: a
    tree node's fields (`RolloutBatch`), its tokens' rows.
  positions: [T] int32 each token's position in its trajectories (its node's offset + i).
  key_ends: [T] int32 the row after the last of the token's node's subtree: token j is a key of the
    tokens i with j <= i < key_ends[j] (its node's later tokens and its descendants'); 0 on padding.
    Exactly the visibility of the naive rows, where a token sees the tokens of its trajectory's path.
  predictor: [T] int32 the row whose hidden state predicts the token: the row before it, or for a
    node's first token the last row of its parent (0 for the prompt and padding, which score nothing).
  """
  row: Segments
  positions: jax.Array
  key_ends: jax.Array
  predictor: jax.Array


def segments(tokens, mask, **fields) -> Segments:
  """`Segments(tokens, mask, **fields)` as device arrays.

  Raises:
    ValueError: a field name that Segments lacks (naming it and the fields it has).
  """
  unknown = sorted(set(fields) - set(LOSS_FIELDS))
  if unknown:
    raise ValueError(f"Segments has no field {unknown[0]!r}; its fields are {', '.join(LOSS_FIELDS)}")
  return Segments(jnp.asarray(tokens), jnp.asarray(mask), **{k: jnp.asarray(v) for k, v in fields.items()})


def num_branches(batch: RolloutBatch | PackedBatch) -> int:
  """Siblings of the last level: G for a group, F_D (the last fan-out) for a tree, 1 for a packed row."""
  if isinstance(batch, PackedBatch):
    return 1
  return batch.levels[-1].tokens.shape[-2]


def with_logprobs(batch: RolloutBatch | PackedBatch, name: str, logp) -> RolloutBatch | PackedBatch:
  """The batch with per-token log-probs in field `name` ("ref_logp" or "old_logp"): logp [(B,) G, T]
  for a group's branches, a tree's per-level list [F_1..F_d, T_d], or a packed row's [(B,) T]."""
  if isinstance(batch, PackedBatch):
    return batch.replace(row=batch.row.replace(**{name: logp}))
  if is_tree(batch):
    return batch.replace(levels=tuple(level.replace(**{name: lp}) for level, lp in zip(batch.levels, logp)))
  return batch.replace(levels=(batch.branches.replace(**{name: logp}),))


def group_arrays(group: RolloutGroup, **fields) -> RolloutBatch:
  """The group as device arrays: prompt, completions and per-completion loss fields [G, ...].

  fields: `Segments` fields (weights, advantage, old_logp, ...), each with leading axis G.

  Raises:
    ValueError: a field without leading axis G, or one Segments lacks.
  """
  g = group.num_completions
  for name, value in fields.items():
    if np.shape(value)[:1] != (g,):
      raise ValueError(f"group_arrays: field {name!r} has shape {np.shape(value)}; needs a leading axis G={g}")
  return group_batch(jnp.asarray(group.prompt_ids), jnp.asarray(group.prompt_len, jnp.int32),
                    segments(group.completion_ids, group.completion_mask, **fields))


def pad_routes(routes: np.ndarray, n: int) -> np.ndarray:
  """Recorded routes [N, layers, k] cut or padded to [n, layers, k] with -1 (none recorded)."""
  return np.concatenate([routes[:n], np.full((max(n - routes.shape[0], 0),) + routes.shape[1:], -1, np.int32)])


def recorded_routes(batch: RolloutBatch, prompt_routes, routes) -> RolloutBatch:
  """`batch` with a sampler's recorded experts (`rollout.sampler.Rollouts`): prompt_routes [P, layers, k] padded
  to the batch's P_pad and routes, per completion [N_g, layers, k] (an array [G, N, layers, k] or a list of
  G), cut or padded to its T, both with -1 (none recorded).

  Raises:
    ValueError: prompt_routes longer than P_pad or G other than the batch's.
  """
  p_pad, (g, t) = batch.prompt_ids.shape[0], batch.branches.tokens.shape
  prompt, rows = np.asarray(prompt_routes, np.int32), [np.asarray(r, np.int32) for r in routes]
  if prompt.shape[0] > p_pad or len(rows) != g:
    raise ValueError(f"recorded_routes: prompt_routes {prompt.shape} and routes of {len(rows)} completions do not "
                     f"fit a group of P_pad={p_pad}, G={g}")
  return batch.replace(prompt_routes=jnp.asarray(pad_routes(prompt, p_pad)),
                       levels=(batch.branches.replace(routes=jnp.asarray(np.stack([pad_routes(r, t) for r in rows]))),))


def recorded_tree_routes(batch: RolloutBatch, padded: PaddedTree, node_routes: Sequence) -> RolloutBatch:
  """`batch` (`tree_arrays(padded, ...)`) with a tree sampler's recorded experts (`TreeRollout.routes`): per node
  [L_n, layers, k] int32, node 0's the prompt's, padded to P_pad and placed in each level's slots [F.., T_d,
  layers, k], -1 (none recorded) on padding.

  Raises:
    ValueError: a node count other than the padded tree's, or a prompt longer than P_pad.
  """
  nodes = [np.asarray(r, np.int32) for r in node_routes]
  count = 1 + max(int(ids.max()) for ids in padded.node_ids)
  if len(nodes) != count or nodes[0].shape[0] > batch.prompt_ids.shape[0]:
    raise ValueError(f"recorded_tree_routes: {len(nodes)} nodes' routes (the prompt's {nodes[0].shape[0]} tokens) "
                     f"do not fit a tree of {count} nodes and P_pad={batch.prompt_ids.shape[0]}")
  levels = tuple(level.replace(routes=jnp.asarray(padded.place(nodes, d + 1, fill=-1)))
                 for d, level in enumerate(batch.levels))
  return batch.replace(prompt_routes=jnp.asarray(pad_routes(nodes[0], batch.prompt_ids.shape[0])), levels=levels)


def tree_arrays(padded: PaddedTree, per_node: dict[str, Sequence], **shared) -> RolloutBatch:
  """Device arrays of a padded tree: per level the tokens, mask and each per-node / shared field.

  per_node: field name -> list indexed by node id of arrays [L_n, ...] (e.g. "weights" [L_n, G],
    "old_logp" [L_n]); scattered into the level slots with `PaddedTree.place` (0 on padding).
  shared: field name -> array given to every node unchanged (e.g. "advantage" [G]).

  Raises:
    ValueError: a field name Segments lacks.
  """
  levels = []
  for d in range(1, len(padded.tokens) + 1):
    slots = padded.node_ids[d - 1].shape
    fields = {k: padded.place(v, d) for k, v in per_node.items()}
    fields.update({k: jnp.broadcast_to(jnp.asarray(v), slots + np.shape(v)) for k, v in shared.items()})
    levels.append(segments(padded.tokens[d - 1], padded.mask[d - 1], **fields))
  return RolloutBatch(jnp.asarray(padded.prompt_ids), jnp.asarray(padded.prompt_len, jnp.int32), tuple(levels))


def trajectory_group_arrays(tree: RolloutTree, per_node: dict[str, Sequence], trajectory_weights, *,
                            vocab_size: int, max_positions: int, completion_bucket: int | None = None,
                            **shared) -> RolloutBatch:
  """The naive counterpart of `tree_arrays`: every trajectory of `tree` as a completion of one group.

  Per-node fields [L_n] are concatenated along each trajectory's path; "weights" is
  trajectory_weights[g] on its tokens (the tree's per-(token, trajectory) weights, unshared), so
  `naive_value_and_grad` with a group objective computes the same loss as tree replay with the
  tree objective.
  """
  if "end_share" in per_node:
    raise ValueError("trajectory_group_arrays: per_node['end_share'] is a tree node's field; each naive row ends "
                     "one trajectory")
  g = len(tree.ends)
  comps = [tree.completion(k) for k in range(g)]
  group = make_group(tree.segments[0], comps, vocab_size=vocab_size, max_positions=max_positions,
                     completion_bucket=completion_bucket)
  extras = {k: tree.rows(v, group.completion_ids.shape[1]) for k, v in per_node.items()}
  extras["weights"] = (group.completion_mask * np.asarray(trajectory_weights)[:, None]).astype(
      np.result_type(np.asarray(trajectory_weights).dtype, np.float32))
  return group_arrays(group, **extras, **shared)


def _node_layout(name: str, ndim: int, depth: int) -> tuple[bool, bool]:
  """(has a T axis, has a trailing G axis) of field `name` of a tree level with `depth` slot axes."""
  if name not in TRAJECTORY_FIELDS:
    return True, False
  return ndim == depth + 2, True   # [L, T, G] (weights, PPO's advantage, returns) or [L, G] (GRPO's advantage)


def _power_of_two(n: int) -> int:
  return 1 << (n - 1).bit_length()


class TreeLayouts:
  """The level layouts a run's step has compiled, so that a step whose trees fit one of them pads
  onto it instead of compiling another program (`pad_trees`' `layouts`).

  A layout is (fan-outs (F_1..F_D), lengths (T_1..T_D), trajectories G); its cost is the token
  positions its levels compute, Σ_d F_1···F_d · T_d. `choose(layout)` returns the cheapest layout met
  before that holds it (depth, every fan-out, every length and G at least as large) if that costs at
  most `max_cost` times the layout's own; else the largest union (elementwise largest) of the layout
  with one met before that costs at most `max_cost` times its own, remembered, so that later steps
  shaped like either fit it; else the layout itself, remembered. So a run compiles at most one
  program per layout it meets, and fewer: once the trees' shapes have been met, later steps reuse
  the programs. Padding onto a larger layout adds exact zeros (`pad_trees`). The set lives in the
  process: a resumed run starts empty, so its steps may run on other layouts than the uninterrupted
  run's, with the same values up to the float rounding order of the padded sums.

  Raises:
    ValueError: max_cost < 1.
  """

  def __init__(self, max_cost: float = 2.0):
    if not max_cost >= 1:
      raise ValueError(f"TreeLayouts: max_cost={max_cost!r} must be >= 1")
    self.max_cost, self.seen = max_cost, []

  @staticmethod
  def cost(layout) -> int:
    fanouts, lengths = layout[:2]
    return int(sum(np.prod(fanouts[:d + 1]) * t for d, t in enumerate(lengths)))

  @staticmethod
  def holds(big, small) -> bool:
    pairs = list(zip(big[0], small[0])) + list(zip(big[1], small[1]))   # zip stops at the shallower's depth
    return len(big[0]) >= len(small[0]) and big[2] >= small[2] and all(b >= s for b, s in pairs)

  @staticmethod
  def union(a, b):
    """The smallest layout that holds both a and b."""
    deeper, other = (a, b) if len(a[0]) >= len(b[0]) else (b, a)
    grow = lambda xs, ys: tuple(max(x, y) for x, y in zip(xs, ys)) + tuple(xs[len(ys):])
    return grow(deeper[0], other[0]), grow(deeper[1], other[1]), max(a[2], b[2])

  def choose(self, layout):
    budget = self.max_cost * self.cost(layout)
    fits = [s for s in self.seen if self.holds(s, layout) and self.cost(s) <= budget]
    if fits:
      return min(fits, key=self.cost)
    unions = [u for u in (self.union(s, layout) for s in self.seen) if self.cost(u) <= budget]
    chosen = max(unions, key=self.cost, default=layout)   # the most headroom within the budget
    self.seen.append(chosen)
    return chosen


def _tree_fields(where: str, trees) -> tuple:
  """The Segments fields every level of `trees` sets (one set for all), or ValueError naming `where`:
  no trees, something other than a tree (a group's rows, a packed row), or levels that set different fields."""
  if not trees or not all(is_tree(t) for t in trees):
    raise ValueError(f"{where}: needs one or more trees (tree_arrays), got {[describe(t) for t in trees]}")
  names = {tuple(f for f in FIELDS if getattr(level, f) is not None) for t in trees for level in t.levels}
  if len(names) != 1:
    raise ValueError(f"{where}: the trees' levels set different Segments fields: {sorted(names)}")
  return names.pop()


def pad_trees(trees: Sequence[RolloutBatch], layouts: TreeLayouts | None = None, *,
              branch: int = 1) -> list[RolloutBatch]:
  """Pad rollout trees to one level layout, so that `distributed.mesh.stack_groups` can stack them.

  Trees sampled with one config differ in shape (`rollout.tree_sampler.sample_tree`, `data.trees.pad_tree`):
  a segment that ends with EOS is a leaf, so a tree may have fewer levels D than its fan-outs
  (every path stopped early) and fewer trajectories G than their product; a level's T_d is the
  bucket of its longest segment, so EOS can shrink it too; F_d is the largest fan-out into level d.
  (Prompts differ in P_pad as well: `distributed.mesh.pad_prompts` pads those.) Every tree is
  padded to the largest D, each level's largest F_1..F_d rounded up to a power of two, its largest
  T_d rounded up to a power of two (>= 8), and the largest G: new slots, token positions and whole
  levels are empty (token 0, mask False, recorded routes -1, every other field 0) and new trajectories get weights,
  advantage and returns 0. The powers of two bound the step's programs: the step compiles once per
  layout (`gradients.step.compiled_programs`), and a run whose trees change every step meets few
  layouts (a level's T_d takes log2 values, not `SEGMENT_BUCKETS_PER_OCTAVE` per doubling; the
  price is at most 2x the positions of a level; docs/design.md, "Trees: slots and levels").

  The padding contributes exactly zero to the loss, its gradient and every metric sum, for any
  objective that weighs its (token, trajectory) terms by `weights` (`losses.grpo_objective`,
  `losses.ppo_objective`): a masked token is never a visible key (no real token's
  activations change), its log-prob is 0 (`jnp.where(mask, ...)`, whose gradient there is 0),
  its terms are multiplied by weights 0 (0 times a finite value, whose gradient is 0 too), and the
  metric sums (KL, clipped) count only pairs with weights > 0 on real tokens. An empty slot's
  queries see its real ancestors' keys (at least the prompt's), so its values stay finite; a real
  leaf with new empty children gets a zero cotangent from them. The real terms are unchanged; only
  the order of float sums may differ (tests/test_tree_replay.py: <= 1e-10 relative in float64).

  Args:
    trees: trees (`tree_arrays`, unstacked: prompt_ids [P_pad], levels [F_1..F_d, T_d, ...]),
      each with the same Segments fields set. Per-trajectory fields (`TRAJECTORY_FIELDS`) carry
      their trailing axis G: weights [.., T_d, G], advantage [.., G] or [.., T_d, G], returns [.., T_d, G].
    layouts: the run's `TreeLayouts`: the trees then go onto the layout it chooses (one compiled
      before, when one holds them at most max_cost times their own cost); None: their own.
    branch: the mesh's branch size: F_1 is rounded up to a multiple of it (first-level subtrees are
      split over `branch`; an episode tree whose G episodes share their first turn has F_1 = 1).

  Returns:
    The trees in order, each with levels of one shape (prompt_ids unchanged); for PPO's trees as
    for GRPO's (the padding is generic over the fields).

  Raises:
    ValueError: no trees, something other than a tree, or trees whose levels set different fields.
  """
  names = _tree_fields("pad_trees", trees)
  own = max(len(t.levels) for t in trees)
  present = lambda d: [t.levels[d] for t in trees if len(t.levels) > d]   # level d + 1 of the trees that have it
  fanouts = tuple(_power_of_two(max(level.tokens.shape[d] for level in present(d))) for d in range(own))
  fanouts = (-(-fanouts[0] // branch) * branch,) + fanouts[1:]
  lengths = tuple(bucket_length(max(level.tokens.shape[-1] for level in present(d)), minimum=8) for d in range(own))
  g = max((getattr(level, f).shape[-1] for t in trees for level in t.levels for f in names if f in TRAJECTORY_FIELDS),
          default=0)
  if layouts is not None:
    fanouts, lengths, g = layouts.choose((fanouts, lengths, g))
  depth = len(fanouts)
  ref = next(t for t in trees if len(t.levels) == own).levels[-1]   # dtypes of the levels no tree has

  def target(name, ndim, d):   # level d + 1's shape of field `name`
    if name == "routes":   # [.., T_d, layers, k]
      return tuple(fanouts[:d + 1]) + (lengths[d],) + ref.routes.shape[-2:]
    has_t, has_g = _node_layout(name, ndim, d + 1)
    return tuple(fanouts[:d + 1]) + ((lengths[d],) if has_t else ()) + ((g,) if has_g else ())

  fill = lambda f: -1 if f == "routes" else 0   # recorded routes: -1, none recorded

  def pad(t):
    levels = []
    for d in range(depth):
      if d < len(t.levels):
        fields = {f: jnp.pad(x, [(0, n - s) for s, n in zip(x.shape, target(f, x.ndim, d))], constant_values=fill(f))
                  for f in names for x in [getattr(t.levels[d], f)]}
      else:   # a level this tree lacks: all padding, dtypes and field ranks from a tree's deepest level
        fields = {f: jnp.full(target(f, getattr(ref, f).ndim - own + d + 1, d), fill(f), getattr(ref, f).dtype)
                  for f in names}
      levels.append(Segments(**fields))
    return t.replace(levels=tuple(levels))
  return [pad(t) for t in trees]


PACKED_BUCKETS_PER_OCTAVE = 4
"""Lengths per doubling of a packed row (`pack_trees`, `data.groups.bucket_length`): at most 4 programs per
doubling of the trees' size, padding under 1/4 of the row (a 2,688-token tree takes 3,072 rows)."""


def _pack_one(tree: RolloutBatch):
  """(per-row lists: tokens, positions, key_ends, predictor, scored; per-row field values {name: [rows]};
  the per-trajectory advantage [G] or None) of one unstacked tree, depth-first over its slots."""
  t = jax.tree_util.tree_map(np.asarray, tree)
  p = int(t.prompt_len)
  names = [f for f in LOSS_FIELDS if getattr(t.levels[0], f) is not None]
  per_trajectory = {f for f in names if f == "advantage" and getattr(t.levels[0], f).ndim == 2}   # [F_1, G]
  tokens, positions, predictor = list(t.prompt_ids[:p]), list(range(p)), [0] * p
  key_ends, scored = [0] * p, [False] * p
  fields = {f: [] for f in names if f not in per_trajectory}
  shared = [None]

  def visit(d, slot, parent_last, offset):
    level = t.levels[d]
    n = int(level.mask[slot].sum())
    if n == 0:   # an empty slot: no node here, nor below
      return
    first = len(tokens)
    tokens.extend(level.tokens[slot][:n])
    positions.extend(range(offset, offset + n))
    predictor.extend([parent_last] + list(range(first, first + n - 1)))
    scored.extend([True] * n)
    key_ends.extend([0] * n)
    for f in fields:   # per-token fields: [T_d] or [T_d, G] in a slot
      fields[f].extend(getattr(level, f)[slot][:n])
    if per_trajectory and shared[0] is None:
      shared[0] = level.advantage[slot]
    if d + 1 < len(t.levels):
      for i in range(t.levels[d + 1].tokens.shape[d + 1]):
        visit(d + 1, slot + (i,), first + n - 1, offset + n)
    key_ends[first:first + n] = [len(tokens)] * n

  for i in range(t.levels[0].tokens.shape[0]):
    visit(0, (i,), p - 1, p)
  key_ends[:p] = [len(tokens)] * p
  return tokens, positions, key_ends, predictor, scored, fields, shared[0]


def pack_trees(trees: Sequence[RolloutBatch], *, length: int | None = None) -> list[PackedBatch]:
  """Each rollout tree as one row (`PackedBatch`), all padded to one length and one trajectory count.

  The row holds the prompt's real tokens (not its bucket's padding), then every node's real tokens
  depth-first, each node's fields (weights, advantage, old_logp, ref_logp) on its tokens' rows. The
  rows are padded to `length` or, by default, the longest row's bucket (`bucket_length` with
  PACKED_BUCKETS_PER_OCTAVE lengths per doubling, >= 64), and the trailing trajectory axis G to the
  trees' largest; padding rows and trajectories have token 0, mask False, key end 0 and fields 0.

  Exact: a token sees the keys its naive row sees (its trajectory's earlier tokens, at the same
  positions) and is scored from the same hidden state, so the loss and gradient equal the naive
  layout's and the level layout's up to float summation order (tests/test_packed.py). The padding adds
  exact zeros (never a key; weights 0).

  Args:
    trees: unstacked trees (`tree_arrays`, `data.episodes.episode_tree_arrays`), each with the
      same Segments fields set.
    length: the rows' padded length, or None (the bucket of the longest).

  Returns:
    The PackedBatches in order, of one shape.

  Raises:
    ValueError: no trees, something other than a tree, trees that set different fields, or a
      length shorter than a tree's row.

  A sampler's recorded routes (`recorded_tree_routes`) are left out: the packed row routes itself and logs no
  routing_mismatch (model.routing_replay with train.tree_schedule = "packed" is refused by the config check).
  """
  names = tuple(f for f in _tree_fields("pack_trees", trees) if f != "routes")
  trees = [t.replace(prompt_routes=None, levels=tuple(level.replace(routes=None) for level in t.levels))
           for t in trees]
  packed = [_pack_one(t) for t in trees]
  longest = max(len(p[0]) for p in packed)
  if length is None:
    length = bucket_length(longest, minimum=64, per_octave=PACKED_BUCKETS_PER_OCTAVE)
  if length < longest:
    raise ValueError(f"pack_trees: length={length} is shorter than a packed tree ({longest} tokens)")
  g = max((getattr(level, f).shape[-1] for t in trees for level in t.levels for f in names if f in TRAJECTORY_FIELDS),
          default=0)   # the trailing trajectory axis, as `pad_trees` reads it
  ref = trees[0].levels[0]

  def pad(values, dtype, trailing=(), start=0):   # values on rows start.., the rest 0
    out = np.zeros((length,) + trailing, dtype)
    if len(values):
      v = np.asarray(values, dtype)
      out[start:start + len(v)][(slice(None),) + tuple(slice(0, n) for n in v.shape[1:])] = v
    return out

  out = []
  for tokens, positions, key_ends, predictor, scored, fields, shared in packed:
    row, prompt = {}, len(tokens) - sum(scored)   # node fields start after the prompt's rows
    for f, values in fields.items():
      has_g = f in TRAJECTORY_FIELDS
      row[f] = jnp.asarray(pad(values, getattr(ref, f).dtype, (g,) if has_g else (), start=prompt))
    if shared is not None:
      row["advantage"] = jnp.asarray(np.pad(shared, (0, g - len(shared))))
    out.append(PackedBatch(segments(pad(tokens, np.int32), pad(scored, bool), **row), jnp.asarray(pad(positions, np.int32)),
                           jnp.asarray(pad(key_ends, np.int32)), jnp.asarray(pad(predictor, np.int32))))
  return out
