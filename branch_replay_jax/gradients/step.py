"""One step builder for every cell of head x layout x mesh: the loss, aux and gradient of an objective
over a rollout group or tree, and its forward-only twin.

    value_and_grad(head, graphdef, params, batch, objective, layout=..., mesh=...) -> (loss, aux, grads)
    forward(head, graphdef, params, batch, layout=..., mesh=...)                 -> per-token outputs

  head    gradients/heads.py: Policy (log-probs) or ActorCritic (log-probs and values; PPO).
  layout  "replay": the batch's own shape (`data.batches.RolloutBatch`): a group's rows (prompt once,
            `core.replay.replay_vjp`, a micro-batch of completions as rows of one batch; with all G in
            one batch on one device, the fused replay: the prompt and the completions in one layer
            scan, `fused` below) or a tree's levels (every node once, `core.tree_replay.nested_replay_vjp`;
            a one-level tree is a group whose completions are its nodes and takes the fused replay
            where a group would);
          "naive": each completion appended to a copy of the prompt (the "[B] -> [B*G]" of today's
            pipelines, the reference), a group's rows only (a tree's trajectories as a group:
            `algorithms.groups.Group.naive_batch`).
  mesh    None: one group or tree on this device. A ("data", "branch", "seq") mesh
          (distributed/mesh.py): a batch of them stacked [B, ...], placed by `shard_batch`, under
          one `shard_map`, the prompt split over `seq` when seq > 1 (distributed/seq_parallel.py).

Both layouts compute the same function of the parameters,

    loss(θ) = Σ_g objective(outputs_g(θ), branch_g),   logp_g[i] = log π_θ(o_g,i | prompt, o_g,<i) / τ-tempered,

with the objective token-local and padding weighted 0 (losses.py), so replay's gradient equals
naive's up to float rounding (docs/design.md, "The math"). The model enters through `nnx.split`
(`graphdef, params = nnx.split(model)`); with LoRA `graphdef` is a `models.lora.WithBase` and
`params` the adapters, which are then the only leaves differentiated.

A segment's state for its descendants: {"kv": {trunk: K/V}, "last": {trunk: last real hidden state
[d]}, "end": the position after it}. Its first token is scored from its parent's "last" (the
prompt's, for a completion), which takes a cotangent from every child.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct

from branch_replay_jax.core.accumulate import (fit_micro_batch, merge_micro_batches, scan_value_and_grad,
                                              split_micro_batches)
from branch_replay_jax.core.replay import replay_map, replay_vjp
from branch_replay_jax.core.tree_replay import SCHEDULES, nested_replay_map, nested_replay_vjp
from branch_replay_jax.data.batches import PackedBatch, RolloutBatch, describe, is_group, is_tree, num_branches
from branch_replay_jax.distributed import mesh as meshes
from branch_replay_jax.distributed.seq_parallel import check_prompt_split, prompt_split
from branch_replay_jax.gradients.heads import Policy, SegmentOutputs
from branch_replay_jax.losses import load_balancing_loss
from branch_replay_jax.models.llama import replicated_over
from branch_replay_jax.models.lora import WithBase, merge

LAYOUTS = ("replay", "naive")
# How a tree step computes its tree (train.tree_schedule): core.tree_replay's schedules over a tree's levels,
# or "packed": each tree one row (`data.batches.pack_trees`, packed on the host before the step).
TREE_SCHEDULES = SCHEDULES + ("packed",)
PACKED = "packed"
Objective = Callable[..., tuple[jax.Array, Any]]


@struct.dataclass
class NodeOutputs:
  """What tree replay returns per level d for its slots [F_1..F_d]: logp [F_1..F_d, T_d] float32
  (nats, 0 on padding), aux: the objective's aux per slot, values [F_1..F_d, T_d] float32 (an
  ActorCritic's; None for a Policy)."""
  logp: jax.Array
  aux: Any
  values: jax.Array | None = None


def _tracks_routes(head, batch) -> bool:
  """Whether the step follows the policy's routing along each path: for the load-balancing loss (the head's
  router_aux_coef > 0) or for routes the sampler recorded (the batch's prompt_routes). Each segment's state then
  carries its path's `RouterStats` ("router"), and each row's outputs its trajectory's loss and route mismatch."""
  return getattr(head, "router_aux_coef", 0.0) > 0 or getattr(batch, "prompt_routes", None) is not None


def _routes_kw(head, name: str, routes) -> dict:
  """A trunk's keyword arguments for the sampler's recorded routes: the policy's, where the batch carries them,
  run in their place with the head's routing_replay (`models.llama.moe_mlp`), else only compared."""
  if name != "policy" or routes is None:
    return {}
  return {"routes": routes, "replay_routes": bool(getattr(head, "routing_replay", False))}


def _with_routing(head, model, outputs: SegmentOutputs, route, end, recorded: bool) -> SegmentOutputs:
  """outputs with the routing of the trajectories the rows end, from their paths' `RouterStats` [B, E] (root to
  row, every layer) over L · end [B] (layer, token) pairs: router_aux [B] (`losses.load_balancing_loss`, with
  router_aux_coef > 0) and, with recorded routes, routing_mismatch [B] (the fraction of the recorded (layer,
  token) pairs whose own top k differs from the sampler's)."""
  policy = head.trunks(model)["policy"]
  if route is None:
    raise ValueError(f"value_and_grad: router_aux_coef={getattr(head, 'router_aux_coef', 0.0)} or recorded routes "
                     f"need a mixture-of-experts policy (arch='qwen3_moe'), got arch={policy.config.arch!r}")
  aux = (load_balancing_loss(route.counts, route.probs, policy.config.num_layers * end)
         if getattr(head, "router_aux_coef", 0.0) > 0 else None)
  mismatch = (route.mismatch / jnp.maximum(route.recorded, 1)).astype(route.probs.dtype) if recorded else None
  return outputs.replace(router_aux=aux, routing_mismatch=mismatch)


def _losses(head, objective, out: SegmentOutputs, rows, trajectories: int):
  """(losses [B], aux [B, ...]) of B rows (completions, naive rows or tree nodes): the objective's, plus, where
  the outputs carry the load-balancing losses of the trajectories the rows end, router_aux_coef · their mean
  over the group's trajectories: each row's weighs 1 / trajectories, a tree node's its `Segments.end_share`.
  The routing metrics join the objective's aux dict weighted alike, so a group's rows sum to its trajectories'
  mean (`losses.grpo_aux_sums`)."""
  losses, aux = jax.vmap(lambda o, b: head.loss(objective, o, b))(out, rows)
  if out.router_aux is None and out.routing_mismatch is None:
    return losses, aux
  share = 1.0 / trajectories if rows.end_share is None else jnp.sum(rows.end_share, axis=-1)
  if out.router_aux is not None:
    losses = losses + head.router_aux_coef * share * out.router_aux
  metrics = {k: share * v for k, v in (("router_aux", out.router_aux), ("routing_mismatch", out.routing_mismatch))
             if v is not None}
  if metrics and isinstance(aux, dict):
    aux = {**aux, **metrics}
  return losses, aux


def _prompt_state(head, model, batch, prompt_fn=None, prompt_over=()) -> dict:
  """The prompt's state for its children. prompt_fn(trunk, **routes) -> (K/V, last real hidden state [d],
  `RouterStats` [1, E] or None) replaces each trunk's whole-prompt forward (context parallelism:
  `seq_parallel.prompt_split`, batch.prompt_ids and prompt_routes this device's chunk). prompt_over: the mesh
  axes every device of which computes this same prompt (the mesh step's ("branch",): `llama.replicated_over`).
  Following the routing (`_tracks_routes`), "router": the prompt's `RouterStats` [E]."""
  kv, last, state = {}, {}, {}
  routes = getattr(batch, "prompt_routes", None)
  for name, trunk in head.trunks(model).items():
    kw = _routes_kw(head, name, None if routes is None else routes[None])
    p_pad = batch.prompt_ids.shape[0]   # (a sliding window's K/V: only the keys it reaches, `branch_kv`)
    with replicated_over(prompt_over):
      kv[name], last[name], router = (prompt_fn(trunk, **kw) if prompt_fn is not None else trunk.prompt_forward(
          batch.prompt_ids[None], (jnp.arange(p_pad) < batch.prompt_len)[None], batch.prompt_len - 1, **kw))
    if name == "policy" and _tracks_routes(head, batch):
      state["router"] = None if router is None else jax.tree_util.tree_map(lambda x: x[0], router)
  return {"kv": kv, "last": last, "end": batch.prompt_len, **state}


def _segment(head, model, ancestors, rows, chunk, attention=None):
  """Forward of B sibling segments (rows: `Segments` [B, T]) on their shared ancestors' states: (each row's
  state for its descendants, `SegmentOutputs` [B, ...]). The rows run as one batch (not vmapped), so each
  weight-gradient dot contracts one (row·position) axis. `attention` overrides the trunks' own. Where the
  root follows the routing ("router" in its state), so does each segment: its path's sums, its outputs'
  routing (`_with_routing`)."""
  parent = ancestors[-1]
  tokens_bt, mask_bt = rows.tokens, rows.mask
  shifted, last, kv, routes = {}, {}, {}, {}
  n = jnp.sum(mask_bt.astype(jnp.int32), axis=1)                                   # [B] real tokens
  for name, trunk in head.trunks(model).items():
    out = trunk(tokens_bt, parent["end"], ancestors=[a["kv"][name] for a in ancestors], valid_bt=mask_bt,
                attention=attention, **_routes_kw(head, name, rows.routes))
    shifted[name], last[name] = _shift(parent["last"][name], out.hidden_btd, n)
    kv[name], routes[name] = trunk.branch_kv(out.kv), out.router   # a sliding window's: only the keys it reaches
  outputs = head.outputs(model, shifted, tokens_bt, mask_bt, chunk, last)
  state = {"kv": kv, "last": last, "end": parent["end"] + n}
  if "router" in ancestors[0]:   # the path's routing: the parent's (its own path's) plus the rows' own
    own, up = routes["policy"], parent.get("router")
    route = None if own is None or up is None else jax.tree_util.tree_map(jnp.add, up, own)
    state["router"] = route
    outputs = _with_routing(head, model, outputs, route, state["end"], rows.routes is not None)
  return state, outputs


def _shift(parent_last, h_btd, n_b):
  """(the hidden states that predict each token [B, T, d]: the parent's last real one ([d] shared, or
  [B, d] one per row), then positions 0..T-2; each row's last real hidden state [B, d]) of B rows with
  n_b real tokens."""
  b, _, d = h_btd.shape
  first = jnp.broadcast_to(parent_last.astype(h_btd.dtype).reshape(-1, 1, d), (b, 1, d))
  last = jnp.take_along_axis(h_btd, jnp.maximum(n_b - 1, 0)[:, None, None], axis=1)[:, 0]
  return jnp.concatenate([first, h_btd[:, :-1]], axis=1), last


def _fused_outputs(head, model, batch: RolloutBatch, chunk, attention=None) -> SegmentOutputs:
  """`SegmentOutputs` [G, ...] of a group's completions, the prompt and the completions in one layer scan
  per trunk (`Llama.prompt_and_rows`): replay's values, with the prompt's K/V cotangent summed per layer."""
  p_pad = batch.prompt_ids.shape[0]
  br = batch.branches
  prompt_valid = (jnp.arange(p_pad) < batch.prompt_len)[None]
  n = jnp.sum(br.mask.astype(jnp.int32), axis=1)
  shifted, last, routes = {}, {}, {}
  recorded = None if batch.prompt_routes is None else (batch.prompt_routes[None], br.routes)
  for name, trunk in head.trunks(model).items():
    prompt_last, h_rows, routes[name] = trunk.prompt_and_rows(batch.prompt_ids[None], prompt_valid,
                                                              batch.prompt_len - 1, br.tokens, batch.prompt_len,
                                                              br.mask, attention=attention,
                                                              **_routes_kw(head, name, recorded))
    shifted[name], last[name] = _shift(prompt_last, h_rows, n)
  outputs = head.outputs(model, shifted, br.tokens, br.mask, chunk, last)
  if not _tracks_routes(head, batch):
    return outputs
  prompt_route, rows_route = routes["policy"]
  route = None if rows_route is None else jax.tree_util.tree_map(jnp.add, prompt_route, rows_route)  # [1, E] + [G, E]
  return _with_routing(head, model, outputs, route, batch.prompt_len + n, recorded is not None)


def fused_applies(batch, layout: str = "replay", mesh=None, micro_batch: int | None = None) -> bool:
  """Whether `value_and_grad` runs the fused replay (its `fused` argument): a group, or a one-level
  tree (a group whose completions are the tree's nodes, `_one_level_group`), in the replay layout on
  one device (on a mesh the prompt may be split over `seq` and its cotangent is reduced across devices),
  micro_batch covering all G completions (F_1 nodes)."""
  return (layout == "replay" and mesh is None and isinstance(batch, RolloutBatch) and len(batch.levels) == 1
          and _micro_batch(micro_batch, batch) == num_branches(batch))


def _one_level_group(batch: RolloutBatch) -> RolloutBatch:
  """A one-level tree as the group whose completions are its F_1 nodes: the same rows on the same prompt.
  A node's fields keep their trajectory axis (advantage, weights [F_1, T, G]), which the objective reads
  as it does in the tree step (`losses.grpo_objective` takes both), so the lowering changes no value."""
  return batch.replace(rows=True)


def _tree_node_fn(head, graphdef, chunk, objective=None, attention=None):
  """(params, ancestors, nodes [m, T_d]) -> (states, losses [m], NodeOutputs [m, ...]), or forward only
  (no objective) -> (states, the head's forward result [m, ...]): m tree nodes as rows of one batch
  (`_segment`) on their ancestors' states, each shared by the rows or one per row (`_row_ancestor`).
  Each node's state for its children is laid out per node (leading [m]: K/V [m, L, 1, T_d, ...],
  last [m, d], end [m]), the slot layout `core.tree_replay` stores."""
  def node_fn(params, ancestors, nodes):
    ancestors = [ancestors[0]] + [_row_ancestor(a) for a in ancestors[1:]]
    state, out = _segment(head, merge(graphdef, params), ancestors, nodes, chunk, attention)
    per_node = lambda x: jnp.expand_dims(jnp.moveaxis(x, 1, 0), 2)   # [L, m, ...] -> [m, L, 1, ...]
    state["kv"] = {name: _relayout(b, per_node, lambda m: m[:, None]) for name, b in state["kv"].items()}
    if objective is None:
      return state, head.forward_result(out)
    losses, aux = _losses(head, objective, out, nodes, None)   # a node's trajectory share: its end_share
    return state, losses, NodeOutputs(out.logp, aux, out.values)
  return node_fn


def _relayout(block, layered, valid):
  """A segment's state block (a `KVBlock`, Qwen3.5's `HybridState` with its linear layers' state, or Gemma 3's
  `WindowedPrompt`, whose blocks are relaid in turn) with `layered` applied to every field that leads with the
  layer axis and `valid` to its valid mask and a windowed block's per-row `start`."""
  def one(field, x):
    if hasattr(x, "_asdict"):
      return _relayout(x, layered, valid)
    return valid(x) if field in ("valid", "start") else layered(x)
  return type(block)(**{f: one(f, x) for f, x in block._asdict().items()})


def _row_ancestor(state: dict) -> dict:
  """A tree node's state for its descendants as `_segment`'s ancestor: one node's (K/V [L, 1, T, ...],
  shared by the rows) as it is, or with a leading row axis [m] (the level schedule's rows, each its own
  parent's: K/V [m, L, 1, T, ...]) as a batch-m block, K/V [L, m, T, ...], last [m, d], end [m]."""
  if jnp.ndim(state["end"]) == 0:
    return state
  rows = lambda x: jnp.moveaxis(x[:, :, 0], 0, 1)   # [m, L, 1, T, ...] -> [L, m, T, ...]
  kv = {name: _relayout(b, rows, lambda m: m[:, 0]) for name, b in state["kv"].items()}
  return {**state, "kv": kv}


def _packed_outputs(head, model, batch: PackedBatch, chunk) -> SegmentOutputs:
  """`SegmentOutputs` [1, T, ...] of a packed tree's row (`data.batches.PackedBatch`): one forward of the
  row with each token's position and its node's key end (a token sees exactly its trajectory's earlier
  tokens), each token scored from its predictor's hidden state. A Policy head only: an ActorCritic's
  next value is a node's, which one row does not have."""
  if not isinstance(head, Policy):
    raise ValueError("value_and_grad: a PackedBatch trains a Policy head (GRPO / RLOO); PPO's critic takes the "
                     "level layout (train.tree_layout = 'levels')")
  row = batch.row
  h = model(row.tokens[None], batch.positions[None], valid_bt=batch.key_ends[None]).hidden_btd
  shifted = jnp.take(h, batch.predictor, axis=1)
  return head.outputs(model, {"policy": shifted}, row.tokens[None], row.mask[None], chunk, {"policy": h[:, -1]})


def _packed_value_and_grad(head, graphdef, params, batch: PackedBatch, objective, chunk):
  """(loss, aux, grads) of a packed tree: one `jax.value_and_grad` of the objective over its one row, a
  tree node of T tokens and G trajectories (`losses.grpo_objective`); aux as a tree's, one level of one
  slot ([NodeOutputs [1, ...]])."""
  def total(p):
    out = _packed_outputs(head, merge(graphdef, p), batch, chunk)
    loss, aux = head.loss(objective, jax.tree_util.tree_map(lambda x: x[0], out), batch.row)
    return loss, [NodeOutputs(out.logp, jax.tree_util.tree_map(lambda x: x[None], aux), out.values)]

  (loss, aux), grads = jax.value_and_grad(total, has_aux=True)(params)
  return loss, aux, grads


def naive_batch(batch: RolloutBatch):
  """(tokens [G, P_pad + T], valid [G, P_pad + T], offset): full sequences, LEFT-padded so every
  completion starts at column P_pad; offset -(P_pad - prompt_len) puts the first real prompt token
  at position 0."""
  prompt, p_len = batch.prompt_ids, batch.prompt_len
  p_pad = prompt.shape[0]
  shift = p_pad - p_len
  prompt_left = jnp.roll(prompt, shift)  # real tokens move to the end; pads wrap to the front
  prompt_valid = jnp.arange(p_pad) >= shift
  br = batch.branches
  g = br.tokens.shape[0]
  tokens = jnp.concatenate([jnp.broadcast_to(prompt_left, (g, p_pad)), br.tokens], axis=1)
  valid = jnp.concatenate([jnp.broadcast_to(prompt_valid, (g, p_pad)), br.mask], axis=1)
  return tokens, valid, -shift


def _naive_routes(batch: RolloutBatch, completion_routes):
  """The recorded routes of naive rows [B, P_pad + T, L, k]: the prompt's, left-padded as `naive_batch` lays it out
  (-1 on padding), then each row's completion's [B, T, L, k]; None where the batch carries none."""
  if batch.prompt_routes is None:
    return None
  p_pad = batch.prompt_ids.shape[0]
  shift = p_pad - batch.prompt_len
  prompt = jnp.where((jnp.arange(p_pad) >= shift)[:, None, None], jnp.roll(batch.prompt_routes, shift, axis=0), -1)
  b = completion_routes.shape[0]
  return jnp.concatenate([jnp.broadcast_to(prompt, (b,) + prompt.shape), completion_routes], axis=1)


def _naive_outputs(head, model, tokens, valid, offset, p_pad, chunk, routes=None) -> SegmentOutputs:
  """`SegmentOutputs` of the completion part of full left-padded sequences [B, P_pad + T] (recorded routes
  [B, P_pad + T, L, k] or None, `_naive_routes`)."""
  t = tokens.shape[1] - p_pad
  mask = valid[:, p_pad:]
  end = p_pad - 1 + jnp.sum(mask.astype(jnp.int32), axis=1)   # each row's last real column
  shifted, last, routes, recorded = {}, {}, {}, routes
  for name, trunk in head.trunks(model).items():
    out = trunk(tokens, offset, valid_bt=valid, **_routes_kw(head, name, recorded))
    h, routes[name] = out.hidden_btd, out.router
    shifted[name] = h[:, p_pad - 1:p_pad - 1 + t]              # position P+i-1 predicts token i
    last[name] = jnp.take_along_axis(h, end[:, None, None], axis=1)[:, 0]
  outputs = head.outputs(model, shifted, tokens[:, p_pad:], mask, chunk, last)
  if not (getattr(head, "router_aux_coef", 0.0) > 0 or recorded is not None):   # `_tracks_routes`
    return outputs
  return _with_routing(head, model, outputs, routes["policy"], jnp.sum(valid.astype(jnp.int32), axis=1),
                       recorded is not None)


def _check(layout, batch, mesh, head=None):
  if layout not in LAYOUTS:
    raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
  if head is not None and getattr(head, "routing_replay", False) and getattr(batch, "prompt_routes", None) is None:
    raise ValueError(f"routing_replay: the step replays the sampler's recorded routes; {describe(batch)} "
                     "carries none (a RolloutBatch's prompt_routes and its segments' routes: "
                     "`data.batches.recorded_routes`, `recorded_tree_routes`)")
  if head is not None and _tracks_routes(head, batch):
    levels = batch.levels if is_tree(batch) else ()
    what = (f"router_aux_coef={head.router_aux_coef}" if getattr(head, "router_aux_coef", 0.0) > 0 else
            "recorded routes")
    if isinstance(batch, PackedBatch):
      raise ValueError(f"{what}: the routing is followed for groups and trees by level, on one device or a mesh; "
                       "got a PackedBatch")
    if any(level.end_share is None for level in levels):
      raise ValueError(f"{what}: a tree's nodes need end_share (the share of "
                       "trajectories ending at each node): tree_arrays(padded, {..., 'end_share': "
                       "tree.end_shares()})")
  if isinstance(batch, PackedBatch) and (layout != "replay" or mesh is not None):
    raise ValueError(f"a PackedBatch runs in layout='replay' on one device (got layout={layout!r}, "
                     f"mesh={'set' if mesh is not None else None})")
  if layout == "naive" and not is_group(batch):
    raise ValueError("layout='naive' takes a group's rows (a tree's trajectories as a group: Group.naive_batch), "
                     f"got {describe(batch)}")
  if layout == "naive" and mesh is not None:
    raise ValueError("layout='naive' runs on one device; the mesh step is replay's")


def _micro_batch(micro_batch, batch):
  return num_branches(batch) if micro_batch is None else micro_batch


def leaf_siblings(batch: RolloutBatch, mesh=None) -> int:
  """The count a micro_batch must divide on one device: a group's completions G, a tree's last fan-out
  F_D; on a mesh, of a stacked batch, G / branch, and F_1 / branch for a one-level tree (F_1 is split
  over `branch`, a deeper tree's last fan-out is not)."""
  branch = 1 if mesh is None else mesh.shape["branch"]
  if isinstance(batch, PackedBatch):
    return 1
  f = batch.levels[-1].tokens.shape[-2]   # a group is one level: G
  return f // branch if len(batch.levels) == 1 else f


def _unbind(graphdef):
  """(graphdef, None), or for LoRA's `WithBase` (its graphdef, its base): on a mesh the base enters
  the shard_map as an argument, placed as the caller placed it (replicated or FSDP, gathered per
  use like the parameters), never as a closed-over constant (which would be replicated whole)."""
  return (graphdef.graphdef, graphdef.base) if isinstance(graphdef, WithBase) else (graphdef, None)


def _mesh_kwargs(head, graphdef, local, batch, mesh) -> dict:
  """The replay functions' mesh arguments: the prompt the same on every branch device (`_prompt_state`'s
  prompt_over), and on several `seq` devices `seq_parallel.prompt_split` for this device's prompt chunk."""
  split = {} if mesh.shape["seq"] == 1 else prompt_split(head.attention_impl(merge(graphdef, local)), batch)
  return {"prompt_over": ("branch",), **split}


def value_and_grad(head, graphdef, params, batch: RolloutBatch, objective: Objective, *,
                   layout: str = "replay", mesh=None, micro_batch: int | None = None,
                   schedule: str = "depth_first", logprob_chunk: int = 256, attention=None,
                   fused: bool | None = None):
  """(loss, aux, grads) of Σ objective over a group's completions or a tree's nodes (module docstring).

  Args:
    head: `heads.Policy` or `heads.ActorCritic` (its temperature τ divides the logits).
    batch: a group's `RolloutBatch` (`data.batches.group_arrays`) or a tree's (`tree_arrays`) with the
      objective's fields; with a mesh, a stack of them [B, ...] placed by `mesh.shard_batch`.
    objective: the head's objective (`heads.Policy.loss`): one completion's or one tree node's
      (`losses.grpo_objective`, `losses.ppo_objective` take both).
    micro_batch: completions (a tree's leaf siblings; naive: sequences) per scan step, a divisor of
      their count on this device; None: all of them in one step (no scan; the fastest).
    schedule: tree replay's "depth_first" (least memory) or "level" (batched levels), core/tree_replay.py.
    attention: one device only, a `suffix_attention`-compatible function replacing the model's own
      (the mesh passes its own per device: the prompt's all-reduced cotangent over `branch` and the seq
      split go through `_replay_value_and_grad` inside the mesh wrapper, never through this signature).
    fused: a group's replay as ONE layer scan of the prompt and its completions (`Llama.prompt_and_rows`)
      differentiated by `jax.value_and_grad`, so the prompt's K/V cotangent is summed and pulled back
      layer by layer (no [L, P] K/V cotangent; docs/design.md, "Memory and remat"). None: wherever it
      applies (`fused_applies`: a group or one-level tree on one device, micro_batch covering
      G); True: required (ValueError where it does not apply); False: never (`core.replay.replay_vjp`:
      the prompt's forward, the completions, then one pullback; a tree's nested replay).

  Returns:
    loss: scalar, the sum over completions (nodes) and, with a mesh, groups (replicated).
    aux: group: the objective's aux per completion [G, ...] ([B, G, ...] on a mesh, sharded
      P("data", "branch")); tree: a list over levels of `NodeOutputs` [F_1..F_d, ...].
    grads: like params (on a mesh with params' shardings), d loss / d params.

  Raises:
    ValueError: an unknown layout, naive on a tree or a mesh, a micro_batch that does not divide the
      count, on a mesh B, G (F_1) or P_pad not divisible by the data, branch or seq size, fused=True
      where the fused replay does not apply.
  """
  _check(layout, batch, mesh, head)
  applies = fused_applies(batch, layout, mesh, micro_batch)
  if fused and not applies:
    raise ValueError(f"value_and_grad: fused=True needs layout='replay' (got {layout!r}), a group or a "
                     f"one-level tree (got {describe(batch)}), no mesh, and micro_batch covering every "
                     f"completion (got {micro_batch!r})")
  if applies and fused is not False:
    if is_tree(batch):   # a tree of depth one is a group: its fastest lowering, the tree's aux
      loss, aux, grads, out = _fused_value_and_grad(head, graphdef, params, _one_level_group(batch), objective,
                                                    logprob_chunk, attention)
      return loss, [NodeOutputs(out.logp, aux, out.values)], grads
    return _fused_value_and_grad(head, graphdef, params, batch, objective, logprob_chunk, attention)[:3]
  if mesh is not None:
    check_prompt_split(batch.prompt_ids.shape[1], mesh.shape["seq"])
    graph, frozen = _unbind(graphdef)
    branch = mesh.shape["branch"]   # a group's completions are split over it: its trajectories, all devices'

    def per_group(local, one, reduce, frozen=None):   # one group on this device's shard (mesh.py)
      g = graph if frozen is None else WithBase(graph, frozen)
      return _replay_value_and_grad(head, g, local, one, objective, _micro_batch(micro_batch, one), schedule,
                                    logprob_chunk, reduce=reduce, trajectories=leaf_siblings(one) * branch,
                                    **_mesh_kwargs(head, g, local, one, mesh))
    return meshes.mesh_value_and_grad(per_group, params, batch, mesh, frozen=frozen)
  if isinstance(batch, PackedBatch):
    return _packed_value_and_grad(head, graphdef, params, batch, objective, logprob_chunk)
  m = _micro_batch(micro_batch, batch)
  if layout == "naive":
    return _naive_value_and_grad(head, graphdef, params, batch, objective, m, logprob_chunk)
  return _replay_value_and_grad(head, graphdef, params, batch, objective, m, schedule, logprob_chunk,
                                attention=attention)


def _replay_value_and_grad(head, graphdef, params, batch, objective, m, schedule, chunk, *, attention=None,
                           reduce=None, prompt_fn=None, prompt_over=(), trajectories=None):
  """Replay's (loss, aux, grads) of one group or tree on one device (`value_and_grad`'s unfused path);
  in the mesh wrapper, of one device's shard: `reduce` all-reduces the prompt's summed cotangent over
  `branch` (`core.replay.replay_vjp`'s reduce_prefix_cotangent), `prompt_fn` is the seq split's
  prompt forward and `prompt_over` the axes the prompt is the same over (`_prompt_state`), `trajectories` the
  group's completions on all devices (the load-balancing loss's mean; default: this batch's)."""
  root_fn = lambda p: _prompt_state(head, merge(graphdef, p), batch, prompt_fn, prompt_over)
  if is_tree(batch):
    node_fn = _tree_node_fn(head, graphdef, chunk, objective, attention)
    return nested_replay_vjp(root_fn, [node_fn] * len(batch.levels), params, batch.levels, micro_batch=m,
                             schedule=schedule, reduce_prefix_cotangent=reduce)

  trajectories = trajectories or batch.branches.tokens.shape[0]

  def branch_fn(p, root, branches):
    _, out = _segment(head, merge(graphdef, p), [root], branches, chunk, attention)
    return _losses(head, objective, out, branches, trajectories)
  return replay_vjp(root_fn, branch_fn, params, batch.branches, micro_batch=m,
                    reduce_prefix_cotangent=reduce, vectorized=True)


def _fused_value_and_grad(head, graphdef, params, batch, objective, chunk, attention):
  """(loss, aux per completion, grads, the completions' `SegmentOutputs`) of the fused replay."""
  def total(p):
    out = _fused_outputs(head, merge(graphdef, p), batch, chunk, attention)
    losses, aux = _losses(head, objective, out, batch.branches, batch.branches.tokens.shape[0])
    return jnp.sum(losses), (aux, out)

  (loss, (aux, out)), grads = jax.value_and_grad(total, has_aux=True)(params)
  return loss, aux, grads, out


def _naive_value_and_grad(head, graphdef, params, batch, objective, m, chunk):
  tokens, valid, offset = naive_batch(batch)
  p_pad, g = batch.prompt_ids.shape[0], tokens.shape[0]
  if not isinstance(m, int) or m < 1 or g % m:
    raise ValueError(f"value_and_grad: micro_batch={m!r} must be a positive divisor of G={g}")

  def loss_fn(p, mb):
    tok, val, branches = mb
    out = _naive_outputs(head, merge(graphdef, p), tok, val, offset, p_pad, chunk, _naive_routes(batch, branches.routes))
    losses, aux = _losses(head, objective, out, branches, g)
    return jnp.sum(losses), aux

  (loss, grads), aux = scan_value_and_grad(loss_fn, params, split_micro_batches((tokens, valid, batch.branches), m))
  return loss, merge_micro_batches(aux, g), grads


def forward(head, graphdef, params, batch: RolloutBatch, *, layout: str = "replay", mesh=None,
            micro_batch: int | None = None, logprob_chunk: int = 256, attention=None):
  """The head's per-token outputs by a forward-only pass (reference and old log-probs, old values).

  Policy: log-probs [G, T] float32 (0 on padding) of a group's completions, or per level d a tree's
  [F_1..F_d, T_d]; ActorCritic: `heads.LogprobsValues` laid out alike. With a mesh, stacked [B, ...]
  and sharded P("data", "branch"). A tree node's outputs are those of every trajectory through it
  (same context). Args and raises as `value_and_grad`.
  """
  _check(layout, batch, mesh, head)
  if mesh is not None:
    check_prompt_split(batch.prompt_ids.shape[1], mesh.shape["seq"])
    graph, frozen = _unbind(graphdef)

    def per_group(local, one, frozen=None):
      g = graph if frozen is None else WithBase(graph, frozen)
      return _replay_forward(head, g, local, one, _micro_batch(micro_batch, one), logprob_chunk,
                             **_mesh_kwargs(head, g, local, one, mesh))
    return meshes.mesh_map(per_group, params, batch, mesh, frozen=frozen)
  if isinstance(batch, PackedBatch):
    return head.forward_result(_packed_outputs(head, merge(graphdef, params), batch, logprob_chunk))[0]
  if layout == "naive":
    tokens, valid, offset = naive_batch(batch)
    return head.forward_result(_naive_outputs(head, merge(graphdef, params), tokens, valid, offset,
                                              batch.prompt_ids.shape[0], logprob_chunk,
                                              _naive_routes(batch, batch.branches.routes)))
  return _replay_forward(head, graphdef, params, batch, _micro_batch(micro_batch, batch), logprob_chunk,
                         attention=attention)


def _replay_forward(head, graphdef, params, batch, m, logprob_chunk, *, attention=None, prompt_fn=None,
                    prompt_over=()):
  """Replay's forward-only outputs of one group or tree on one device (or one device's shard in the
  mesh wrapper, `prompt_fn` the seq split's prompt forward, `prompt_over` as `_prompt_state`'s)."""
  root_fn = lambda p: _prompt_state(head, merge(graphdef, p), batch, prompt_fn, prompt_over)
  if is_tree(batch):
    node_fn = _tree_node_fn(head, graphdef, logprob_chunk, attention=attention)
    return nested_replay_map(root_fn, [node_fn] * len(batch.levels), params, batch.levels, micro_batch=m)

  def branch_fn(p, root, branches):
    _, out = _segment(head, merge(graphdef, p), [root], branches, logprob_chunk, attention)
    return head.forward_result(out)
  return replay_map(root_fn, branch_fn, params, batch.branches, micro_batch=m, vectorized=True)


def batch_value_and_grad(head, graphdef, params, batch: RolloutBatch, objective: Objective, *,
                         layout: str = "replay", mesh=None, micro_batch: int | None = None,
                         schedule: str = "depth_first", logprob_chunk: int = 256, reduce_aux=None, upcast=None,
                         keep=None):
  """(losses, aux, grads, kept) of a batch of groups (or trees) stacked [B, ...]: the step's gradient.

  One device: a `lax.scan` over the B groups, each `value_and_grad` of its own (prompts padded to one
  length, `distributed.mesh.pad_prompts`, leave each group's loss and gradient unchanged), the
  gradients upcast (`upcast`, default identity) and summed in the carry in group order; losses [B] and
  aux (reduce_aux(aux) per group, or the aux itself) stacked per group. A mesh: `value_and_grad`
  with the mesh (its shard_map, module docstring), losses the batch's sum (a scalar, replicated) and
  aux reduce_aux of the batch's aux. Summing losses gives the batch's loss either way.

  keep: one device only, None or a traced int32 index b: kept is then group b's own gradient (upcast,
  the run-time exactness check's step side, algorithms/exactness.py), else None. A different
  `keep`-ness is another program (None is no pytree leaf).

  Raises:
    ValueError: keep with a mesh, and as `value_and_grad`.
  """
  upcast = upcast or (lambda x: x)
  reduce = reduce_aux or (lambda aux: aux)
  if mesh is not None:
    if keep is not None:
      raise ValueError("batch_value_and_grad: keep (one group's own gradient) is for one device; on a mesh the "
                       "exactness check computes its group apart (algorithms/exactness.py)")
    loss, aux, grads = value_and_grad(head, graphdef, params, batch, objective, layout=layout, mesh=mesh,
                                      micro_batch=micro_batch, schedule=schedule, logprob_chunk=logprob_chunk)
    return loss, reduce(aux), upcast(grads), None

  def one_group(carry, xs):
    index, group = xs
    total, kept = carry
    loss, aux, grads = value_and_grad(head, graphdef, params, group, objective, layout=layout,
                                      micro_batch=micro_batch, schedule=schedule, logprob_chunk=logprob_chunk)
    grads = upcast(grads)
    total = jax.tree_util.tree_map(jnp.add, total, grads)
    if keep is not None:
      kept = jax.tree_util.tree_map(lambda k, g: jnp.where(index == keep, g, k), kept, grads)
    return (total, kept), (loss, reduce(aux))

  zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(upcast, params))
  count = jax.tree_util.tree_leaves(batch)[0].shape[0]
  (grads, kept), (losses, aux) = jax.lax.scan(one_group, (zeros, None if keep is None else zeros),
                                              (jnp.arange(count), batch))
  return losses, aux, grads, kept


def batch_forward(head, graphdef, params, batch: RolloutBatch, *, layout: str = "replay", mesh=None,
                  micro_batch: int | None = None, logprob_chunk: int = 256):
  """`forward` of a batch of groups (trees) stacked [B, ...]: outputs stacked [B, ...]; on one device a
  `lax.map` over the groups, on a mesh `forward` with the mesh. Raises as `forward`."""
  if mesh is not None:
    return forward(head, graphdef, params, batch, layout=layout, mesh=mesh, micro_batch=micro_batch,
                   logprob_chunk=logprob_chunk)
  return jax.lax.map(lambda one: forward(head, graphdef, params, one, layout=layout, micro_batch=micro_batch,
                                         logprob_chunk=logprob_chunk), batch)


def make_train_step(head, graphdef, tx, objective: Objective, *, mesh=None, layout: str = "replay",
                    micro_batch: int | None = None, schedule: str = "depth_first", logprob_chunk: int = 256,
                    reduce_aux=None, cast=None, upcast=None):
  """One jitted optimizer step: the gradient of a stacked batch of groups and the optax update `tx`, in
  one program, on one device or a mesh (the step the training loop runs and benchmarks compile).

      train_step(params, opt_state, batch, num_groups=1, frozen=None, keep=None) -> (params, opt_state, metrics)

  batch: groups (or trees) of one shape stacked [B, ...] (`distributed.mesh.pad_prompts`,
  `stack_groups`; trees `data.batches.pad_trees` first); on a mesh placed by `shard_batch`.
  grads = Σ_b upcast(d loss_b / d cast(params)) / num_groups, the mean over the step's groups
  (`batch_value_and_grad`); metrics is {"loss": per-group losses [B] (one device) or their sum
  (a mesh), "aux": reduce_aux per group [B, ...] (one device) or of the batch (a mesh), or the aux
  itself without reduce_aux, "grad_norm": ||grads||_2}, plus "kept_grads" (group `keep`'s own
  gradient, one device) when keep is an index. params and opt_state are donated (the caller must not
  read the arrays it passed in). layout: "replay" or, on one device, "naive". micro_batch: the largest
  divisor of each batch's leaf siblings per device (`leaf_siblings`) not above it; None: all in
  one. cast, upcast: the parameter dtype's casts (algorithms.runs.param_casts; identities by
  default). frozen: with LoRA the base model's state (`graphdef` is then bound to it by
  `models.lora.WithBase`; params are the adapters). num_groups and keep are traced, so a step with
  another group count or kept group compiles nothing new; each stacked shape is one program.

  On a mesh the parameters keep their shardings (replicated or FSDP, `distributed.mesh.shard_params`),
  and so does the optimizer state. The mesh's axes are Explicit (`make_mesh`): create the state from
  the placed parameters INSIDE `jax.set_mesh(mesh)`, or place an unsharded state as the training loop
  does (`tx.init` on the unplaced parameters, then `shard_params`):

      with jax.set_mesh(mesh):
        params = shard_params(params, mesh, "fsdp")
        opt_state = jax.jit(tx.init)(params)                  # or: shard_params(tx.init(host_params), mesh, "fsdp")
        step = make_train_step(POLICY, graphdef, tx, objective, mesh=mesh)
        params, opt_state, metrics = step(params, opt_state, shard_batch(batch, mesh))

  `jax.jit(tx.init)(params)` outside `jax.set_mesh` fails on this mesh with a ValueError ("Length
  of device assignment 1 is not equal to the size of the mesh ... via `jax.set_mesh`"; JAX 0.10;
  tests/test_mesh.py::test_documented_optimizer_state_creation). Call the step inside it too.
  """
  cast = cast or (lambda x: x)
  upcast = upcast or (lambda x: x)

  def train_step(params, opt_state, batch, num_groups=1, frozen=None, keep=None):
    graph = graphdef if frozen is None else WithBase(graphdef, frozen)
    m = None if micro_batch is None else fit_micro_batch(micro_batch, leaf_siblings(batch, mesh))
    loss, aux, grads, kept = batch_value_and_grad(head, graph, cast(params), batch, objective, layout=layout,
                                                  mesh=mesh, micro_batch=m, schedule=schedule,
                                                  logprob_chunk=logprob_chunk, reduce_aux=reduce_aux, upcast=upcast,
                                                  keep=keep)
    grads = jax.tree_util.tree_map(lambda g: g / num_groups, grads)
    params, opt_state, grad_norm = apply_update(tx, params, opt_state, grads)
    metrics = {"loss": loss, "aux": aux, "grad_norm": grad_norm}
    if kept is not None:
      metrics["kept_grads"] = kept
    return params, opt_state, metrics
  return jax.jit(train_step, donate_argnums=(0, 1))


def apply_update(tx, params, opt_state, grads):
  """(params, opt_state, ||grads||_2) after the optax update `tx` on grads (clipping, if any, is part
  of tx): the tail of every train step (`make_train_step`, and DPO's
  `gradients.preference.make_preference_step`), traced inside the caller's one program."""
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, optax.tree.norm(grads)


def compiled_programs(train_step) -> int:
  """How many programs `train_step` (a `make_train_step` result, a `jax.jit` function) has compiled so
  far in this process: one per stacked batch shape (and `keep`-ness) it met. The loop logs it as
  `step_compiles`; a step's trees pad onto bucketed level layouts (`data.batches.pad_trees`,
  `TreeLayouts`), or packed, onto row-length buckets (`data.batches.pack_trees`), so a run whose trees
  change every step meets few shapes."""
  return train_step._cache_size()
