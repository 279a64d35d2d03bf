"""A sliding-window model's segment K/V as replay hands it to the descendants: only the keys a window still reaches.

Gemma 3's sliding layers (`ModelConfig.layer_types`, window W) let a query at position q see the keys at
positions q - W < k <= q. A segment (the prompt, a tree node, an episode's turn) of n real tokens is attended
to by its descendants only, all at positions >= its end, so on a sliding layer none of them reaches its keys
before its n - W + 1st: of its K/V, a sliding layer hands on its last W - 1 real keys, a global layer all of
them. `trim` cuts a segment's stacked K/V [L, B, T, ...] to that (`WindowedPrompt`), so what replay keeps for
the descendants and the cotangent it sums for the segment's pullback (core/replay.py: prefix_out and its
cotangent; core/tree_replay.py's node states) take

    Lg x T + L x (W - 1)   key/value positions per row instead of   L x T

(Lg global layers of L). `ancestor_blocks` rebuilds one layer's ancestor blocks from it inside the layer scan
(`Llama.__call__`) with the positions the window needs (`kernels.key_positions`: the number of valid keys
before a key):
- a global layer: the whole segment (`full`, its slot among the global layers), and the tail masked out;
- a sliding layer: a head block whose first `start` slots count as valid keys, so the tail's keys get
  their positions start, start + 1, ..., but that no window reaches (its keys are another layer's; their
  probabilities are exactly 0 and the tiled attention skips their tiles, `tiled_attention`'s reach), then
  the tail.
Either way the keys before the next block number n, so a descendant's positions are unchanged. The values it
computes equal those on the untrimmed K/V up to the order of the softmax's sums (docs/design.md, "Sliding
windows (Gemma 3)"). A segment's valid keys must be a prefix of its slots (`valid = arange(T) < n`, how every
prompt and node is padded here).

The group sampler's decode cache takes the same cut as it decodes (`RingCache`): its sliding layers keep the last
W - 1 generated tokens in a ring, each key with its position (`kernels.reference.PositionedKV`).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from branch_replay_jax.kernels import KVBlock
from branch_replay_jax.kernels.reference import PositionedKV
from branch_replay_jax.models.config import FULL, SLIDING


class WindowedPrompt(NamedTuple):
  """A segment's K/V trimmed to what a window reaches (module docstring; the prompt's first, hence the name).

  full: the global layers' K/V of the whole segment, k, v [Lg, B, P, Hkv, D], valid [B, P] bool.
  tail: every layer's K/V of the W - 1 slots from `start`, k, v [L, B, W - 1, Hkv, D], valid [B, W - 1].
  start: [B] int32, the position of each row's first tail key: max(n - (W - 1), 0), n its real keys.
  """

  full: KVBlock
  tail: KVBlock
  start: jax.Array


class RingCache(NamedTuple):
  """A sliding-window model's decode cache (the group sampler's, `rollout.sampler.init_cache`): the global
  layers' K/V of every generated token, the sliding layers' of the last W - 1 only. A token at position p sees
  keys at p - W < k < p before its own, at most W - 1 of them, so ring slot s holds the latest token t with
  t = s (mod W - 1), its position in `positions`; the attention reads each key's position from there
  (`kernels.reference.PositionedKV`), not from the order of the slots.

  full: the global layers' cache, k, v [Lg, B, N, Hg, Dg], valid [B, N] (slot t: token t).
  ring: k, v [Lr, B, W - 1, Hkv, D], valid [B, W - 1]: the sliding layers' (Gemma 4: Lr = its sliding layers;
    Gemma 3, whose layers scan as one stack: Lr = L, a global layer's slots unread).
  positions: [B, W - 1] int32, the position of each ring slot's token (any value on an invalid slot).
  """

  full: KVBlock
  ring: KVBlock
  positions: jax.Array


def ring_cache(full: KVBlock, ring: KVBlock) -> RingCache:
  """An empty `RingCache` of the zero blocks full ([Lg, B, N, ...]) and ring ([Lr, B, W - 1, ...])."""
  return RingCache(full, ring, jnp.zeros(ring.valid.shape, jnp.int32))


def ring_write(cache: RingCache, full_kv, ring_kv, step, positions_b) -> RingCache:
  """`cache` with one decoded token per row written: full_kv = (k, v) [Lg, B, 1, ...] at slot `step` of
  `full`, ring_kv = (k, v) [Lr, B, 1, ...] at slot step mod (W - 1) of `ring`, its position positions_b [B]
  int32 (the token's) in `positions`; both slots valid. step: int scalar (may be traced), the token's index
  among the generated ones."""
  zero = jnp.zeros((), jnp.int32)
  step = jnp.asarray(step, jnp.int32)
  slot = step % cache.ring.valid.shape[-1]

  def put(blk: KVBlock, kv, at) -> KVBlock:
    start = (zero, zero, at, zero, zero)
    k, v = (jax.lax.dynamic_update_slice(old, new.astype(old.dtype), start) for old, new in zip(blk[:2], kv))
    ones = jnp.ones((blk.valid.shape[0], 1), bool)
    return KVBlock(k, v, jax.lax.dynamic_update_slice(blk.valid, ones, (zero, at)))

  at = jnp.asarray(positions_b, jnp.int32).reshape(-1, 1)
  positions = jax.lax.dynamic_update_slice(cache.positions, jnp.broadcast_to(at, (cache.positions.shape[0], 1)),
                                           (zero, slot))
  return RingCache(put(cache.full, full_kv, step), put(cache.ring, ring_kv, slot), positions)


def layer_slots(layer_types: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
  """(global [L] bool: a layer is FULL; slot [L] int32: a global layer's index among the global layers, 0 for a
  sliding one), scanned with the layers."""
  is_global = np.asarray([kind == FULL for kind in layer_types], bool)
  return is_global, np.maximum(np.cumsum(is_global) - 1, 0).astype(np.int32)


def trim(kv: KVBlock, layer_types: Sequence[str] | None, window: int | None) -> KVBlock | WindowedPrompt:
  """A segment's stacked K/V (k, v [L, B, P, Hkv, D], valid [B, P] a prefix of real keys per row) as replay hands
  it on: a `WindowedPrompt` where the model has both sliding and global layers and P > W - 1, else kv itself
  (nothing to cut: no sliding layer, a prompt shorter than the window, or no global layer to keep it whole)."""
  if not layer_types or SLIDING not in layer_types or FULL not in layer_types:
    return kv
  if kv.k.shape[2] <= window - 1:
    return kv
  return WindowedPrompt(global_layers(kv, layer_types), *last_keys(kv, window))


def global_layers(kv: KVBlock, layer_types: Sequence[str]) -> KVBlock:
  """The global (FULL) layers' K/V of stacked K/V k, v [L, B, T, ...]: [Lg, B, T, ...], valid unchanged."""
  index = np.flatnonzero(layer_slots(layer_types)[0])
  return KVBlock(jnp.take(kv.k, index, axis=0), jnp.take(kv.v, index, axis=0), kv.valid)


def last_keys(kv: KVBlock, window: int) -> tuple[KVBlock, jax.Array]:
  """(the W - 1 slots of stacked K/V [L, B, P, ...] from each row's `start`, start [B] int32 = max(n - (W - 1),
  0), n its real keys): what a window of W still reaches of a segment (P > W - 1), `WindowedPrompt`'s tail."""
  keep = window - 1
  start = jnp.maximum(jnp.sum(kv.valid.astype(jnp.int32), axis=-1) - keep, 0)            # [B]; <= P - keep
  rows = lambda x: jax.vmap(lambda xb, s: jax.lax.dynamic_slice_in_dim(xb, s, keep, axis=1),
                            in_axes=(1, 0), out_axes=1)(x, start)                       # [L, B, keep, ...]
  valid = jax.vmap(lambda vb, s: jax.lax.dynamic_slice_in_dim(vb, s, keep))(kv.valid, start)
  return KVBlock(rows(kv.k), rows(kv.v), valid), start


def ancestor_blocks(ancestors: Sequence[KVBlock | WindowedPrompt | RingCache], dtype,
                    layer_types: Sequence[str] | None):
  """(xs, blocks) for a layer scan over a segment's ancestors, oldest first, each a `KVBlock` (k, v [L, B or 1, S,
  Hkv, D]), a `WindowedPrompt` or a `RingCache` (scanned as a windowed one, its ring for the tail): xs, scanned
  with the layers, holds their per-layer K/V in `dtype` (a windowed one's tail) and, where one is windowed,
  `layer_slots`; blocks(xs_l) is one layer's ancestor blocks in order (a windowed one's two, `layer_blocks`, its
  `full` K/V read at the layer's slot)."""
  cast = lambda x: x.astype(dtype)
  windowed = [isinstance(a, (WindowedPrompt, RingCache)) for a in ancestors]
  scanned = lambda a: a.tail if isinstance(a, WindowedPrompt) else a.ring if isinstance(a, RingCache) else a
  kvs = [(cast(scanned(a).k), cast(scanned(a).v)) for a in ancestors]
  fulls = [(cast(a.full.k), cast(a.full.v)) if w else None for a, w in zip(ancestors, windowed)]
  slots = tuple(map(jnp.asarray, layer_slots(layer_types))) if any(windowed) else None

  def blocks(xs_l) -> list[KVBlock]:
    layer_kvs, slot = xs_l
    out = []
    for a, (k, v), full in zip(ancestors, layer_kvs, fulls):
      out += [KVBlock(k, v, a.valid)] if full is None else layer_blocks(a, *full, (k, v, *slot))
    return out
  return (kvs, slots), blocks


def layer_blocks(prompt: WindowedPrompt | RingCache, full_k, full_v, layer_xs) -> list[KVBlock]:
  """One layer's two ancestor blocks of a trimmed segment (module docstring) or of a decode `RingCache` (a
  global layer: its full cache, the ring masked; a sliding layer: the full cache masked, the ring with its
  positions): full_k, full_v its `full` K/V in the compute dtype [Lg, B, P, Hkv, D] (read at the layer's slot);
  layer_xs = (tail or ring k, v [B, W - 1, Hkv, D] in the compute dtype, global [] bool, slot [] int32), the
  layer's entries of the scanned (k, v, `layer_slots`)."""
  tail_k, tail_v, is_global, slot = layer_xs
  k = jax.lax.dynamic_index_in_dim(full_k, slot, keepdims=False)
  v = jax.lax.dynamic_index_in_dim(full_v, slot, keepdims=False)
  if isinstance(prompt, RingCache):   # a global layer reads its whole cache, a sliding layer the ring
    return [KVBlock(k, v, prompt.full.valid & is_global),
            PositionedKV(tail_k, tail_v, prompt.ring.valid & ~is_global, prompt.positions)]
  before_tail = jnp.arange(prompt.full.valid.shape[-1])[None] < prompt.start[:, None]   # [B, P]
  head_valid = jnp.where(is_global, prompt.full.valid, before_tail)
  return [KVBlock(k, v, head_valid), KVBlock(tail_k, tail_v, prompt.tail.valid & ~is_global)]
