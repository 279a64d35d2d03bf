"""A Llama policy's log-probs and objective gradients on a rollout group or tree: replay and naive.

Both paths compute the same function of the parameters,

    loss(θ) = Σ_g objective(logp_g(θ), branch_g),   logp_g[i] = log π_θ(o_g,i | prompt, o_g,<i),

where `objective(logp [T], branch) -> (scalar, aux)` is token-local with padding weighted 0
(see losses.py), and `branch` is that completion's row of `data.batches.Segments`: tokens [T],
mask [T] and whatever the objective reads (weights, advantage, old_logp, ref_logp, ...).

- replay: the prompt runs once (`replay_vjp`); each completion runs on top of its K/V at
  positions P..P+T-1; completion token 0 is scored from the prompt's last hidden state.
- tree replay: every node of a padded rollout tree runs once on its ancestors' K/V
  (`nested_replay_vjp`); the objective sees one node's tokens (`tree_replay_value_and_grad`).
- naive: each completion is appended to a copy of the prompt and the batch of G full sequences
  runs forward and backward (the "[B] -> [B*G]" of today's pipelines), scoring only completion
  positions (the strongest naive: no [P, V] logits), in micro-batches of sequences.

The model enters through `nnx.split`: `graphdef, params = nnx.split(model)`. With LoRA adapters
(models/lora.py) `graphdef` is a `models.lora.WithBase` (the graphdef and the frozen base state) and
`params` the adapters: every function below then differentiates the adapters only.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import struct

from branch_replay_jax.data.batches import GroupBatch, Segments, TreeBatch
from branch_replay_jax.core.accumulate import merge_micro_batches, scan_value_and_grad, split_micro_batches
from branch_replay_jax.core.replay import replay_map, replay_vjp
from branch_replay_jax.core.tree_replay import nested_replay_map, nested_replay_vjp
from branch_replay_jax.models.llama import token_logprobs
from branch_replay_jax.models.lora import merge

Objective = Callable[[jax.Array, Segments], tuple[jax.Array, Any]]


@struct.dataclass
class NodeOutputs:
  """What tree replay returns per level d for its slots [F_1..F_d]: logp [F_1..F_d, T_d] float32
  (nats, 0 on padding), aux: the objective's aux per slot, values [F_1..F_d, T_d] float32 (the
  critic's, `actor_critic`'s tree step; None for a policy alone)."""
  logp: jax.Array
  aux: Any
  values: jax.Array | None = None


def prompt_prefix_fn(graphdef, batch):
  """params -> (the prompt's per-layer K/V, its last real position's hidden state [d]): replay's prefix."""
  def prefix_fn(params):
    model = merge(graphdef, params)
    p_pad = batch.prompt_ids.shape[0]
    valid = jnp.arange(p_pad) < batch.prompt_len
    out = model(batch.prompt_ids[None], 0, valid_bt=valid[None])
    last_hidden = jax.lax.dynamic_index_in_dim(out.hidden_btd[0], batch.prompt_len - 1, keepdims=False)
    return out.kv, last_hidden
  return prefix_fn


def _segment(model, tokens_bt, mask_bt, offset, ancestors: list, parent_last_hidden, chunk, attention=None,
             temperature: float = 1.0):
  """Forward of B sibling segments (rows) on their shared ancestors' K/V and the log-probs of their tokens.

  tokens_bt, mask_bt: [B, T]. parent_last_hidden: [d], the parent's last hidden state, which scores
  token 0 of every row; token i > 0 is scored from the row's own position i - 1. The rows run as
  one batch (not vmapped), so each weight-gradient dot contracts one (row·position) axis.
  `attention` overrides the model's (context parallelism); `temperature` divides the logits
  (`token_logprobs`). Returns (SegmentOutput, logp [B, T] with 0 on padding).
  """
  out = model(tokens_bt, offset, ancestors=ancestors, valid_bt=mask_bt, attention=attention)
  b, _, d = out.hidden_btd.shape
  first = jnp.broadcast_to(parent_last_hidden.astype(out.hidden_btd.dtype), (b, 1, d))
  hidden = jnp.concatenate([first, out.hidden_btd[:, :-1]], axis=1)
  w, vocab_axis = model.output_weights()
  logp = token_logprobs(hidden, w, tokens_bt, chunk=chunk, vocab_axis=vocab_axis, temperature=temperature)
  return out, jnp.where(mask_bt, logp, 0.0)


def _branch_logprobs(graphdef, params, prefix_out, branches, prompt_len, chunk, attention=None, temperature=1.0):
  """[m, T] log-probs of a micro-batch of completions (branches: Segments with a leading axis m)."""
  kv, last_hidden = prefix_out
  return _segment(merge(graphdef, params), branches.tokens, branches.mask, prompt_len, [kv], last_hidden, chunk,
                  attention, temperature)[1]


def replay_value_and_grad(graphdef, params, batch: GroupBatch, objective: Objective, *, micro_batch: int = 1,
                          logprob_chunk: int = 256, reduce_prefix_cotangent=None, prefix_fn=None, attention=None,
                          temperature: float = 1.0):
  """(loss, aux [G, ...], grads) of Σ_g objective by branch replay. See the module docstring and
  `replay_vjp` for `reduce_prefix_cotangent`.

  prefix_fn, attention: replace `prompt_prefix_fn(graphdef, batch)` and the completions' attention
  (context parallelism: distributed/seq_parallel.py's `prompt_split`); default: the whole prompt
  on this device and the model's own attention.
  temperature: τ, a Python float: log-probs of softmax(logits / τ) (`models.llama.token_logprobs`;
  docs/design.md, "Log-prob temperature"); every function of this module takes it.
  """
  def branch_fn(p, prefix_out, branches):
    logp = _branch_logprobs(graphdef, p, prefix_out, branches, batch.prompt_len, logprob_chunk, attention,
                            temperature)
    return jax.vmap(objective)(logp, branches)
  prefix_fn = prompt_prefix_fn(graphdef, batch) if prefix_fn is None else prefix_fn
  return replay_vjp(prefix_fn, branch_fn, params, batch.branches, micro_batch=micro_batch,
                    reduce_prefix_cotangent=reduce_prefix_cotangent, vectorized=True)


def replay_logprobs(graphdef, params, batch: GroupBatch, *, micro_batch: int = 1, logprob_chunk: int = 256,
                    prefix_fn=None, attention=None, temperature: float = 1.0) -> jax.Array:
  """[G, T] float32 log-probs of every completion token (0 on padding), forward-only replay.
  prefix_fn, attention, temperature: as in `replay_value_and_grad`."""
  def branch_fn(p, prefix_out, branches):
    return _branch_logprobs(graphdef, p, prefix_out, branches, batch.prompt_len, logprob_chunk, attention, temperature)
  prefix_fn = prompt_prefix_fn(graphdef, batch) if prefix_fn is None else prefix_fn
  return replay_map(prefix_fn, branch_fn, params, batch.branches, micro_batch=micro_batch, vectorized=True)


def naive_batch(batch):
  """Full sequences [G, P_pad + T], LEFT-padded so every completion starts at the same column."""
  prompt, p_len = batch.prompt_ids, batch.prompt_len
  p_pad = prompt.shape[0]
  shift = p_pad - p_len
  prompt_left = jnp.roll(prompt, shift)  # real tokens move to the end; pads wrap to the front
  prompt_valid = jnp.arange(p_pad) >= shift
  br = batch.branches
  g = br.tokens.shape[0]
  tokens = jnp.concatenate([jnp.broadcast_to(prompt_left, (g, p_pad)), br.tokens], axis=1)
  valid = jnp.concatenate([jnp.broadcast_to(prompt_valid, (g, p_pad)), br.mask], axis=1)
  return tokens, valid, -shift  # offset: the first real prompt token sits at position 0


def _naive_logprobs(graphdef, params, tokens, valid, offset, p_pad, chunk, temperature=1.0):
  model = merge(graphdef, params)
  out = model(tokens, offset, valid_bt=valid)
  t = tokens.shape[1] - p_pad
  hidden = out.hidden_btd[:, p_pad - 1:p_pad - 1 + t]
  w, vocab_axis = model.output_weights()
  logp = token_logprobs(hidden, w, tokens[:, p_pad:], chunk=chunk, vocab_axis=vocab_axis, temperature=temperature)
  return jnp.where(valid[:, p_pad:], logp, 0.0)


def naive_value_and_grad(graphdef, params, batch: GroupBatch, objective: Objective, *, micro_batch: int | None = None,
                         logprob_chunk: int = 256, temperature: float = 1.0):
  """(loss, aux [G, ...], grads) of Σ_g objective with the prompt repeated per completion.

  micro_batch: sequences per forward+backward (must divide G; default G, one batch); the
  gradients of the micro-batches are summed in a `lax.scan`. temperature: as in `replay_value_and_grad`.
  """
  tokens, valid, offset = naive_batch(batch)
  p_pad = batch.prompt_ids.shape[0]
  g = tokens.shape[0]
  m = g if micro_batch is None else micro_batch
  if m < 1 or g % m:
    raise ValueError(f"naive_value_and_grad: micro_batch={micro_batch!r} must be a positive divisor of G={g}")

  def loss_fn(p, mb):
    tok, val, branches = mb
    logp = _naive_logprobs(graphdef, p, tok, val, offset, p_pad, logprob_chunk, temperature)
    losses, aux = jax.vmap(objective)(logp, branches)
    return jnp.sum(losses), aux

  (loss, grads), aux = scan_value_and_grad(loss_fn, params, split_micro_batches((tokens, valid, batch.branches), m))
  return loss, merge_micro_batches(aux, g), grads


def naive_logprobs(graphdef, params, batch: GroupBatch, *, logprob_chunk: int = 256,
                   temperature: float = 1.0) -> jax.Array:
  """[G, T] completion log-probs from full sequences (the reference for `replay_logprobs`)."""
  tokens, valid, offset = naive_batch(batch)
  return _naive_logprobs(graphdef, params, tokens, valid, offset, batch.prompt_ids.shape[0], logprob_chunk,
                         temperature)


def _tree_root_fn(graphdef, batch, prefix_fn=None):
  prefix = prompt_prefix_fn(graphdef, batch) if prefix_fn is None else prefix_fn

  def root_fn(params):
    kv, last_hidden = prefix(params)
    return {"kv": kv, "last_hidden": last_hidden, "end": batch.prompt_len}
  return root_fn


def _tree_segment(graphdef, params, ancestors, node, chunk, attention=None, temperature=1.0):
  """(the node's output for its children, logp [T_d]) of one tree node on its ancestors' outputs."""
  parent = ancestors[-1]
  out, logp = _segment(merge(graphdef, params), node.tokens[None], node.mask[None], parent["end"],
                       [a["kv"] for a in ancestors], parent["last_hidden"], chunk, attention, temperature)
  logp = logp[0]
  n = jnp.sum(node.mask.astype(jnp.int32))
  last = jax.lax.dynamic_index_in_dim(out.hidden_btd[0], jnp.maximum(n - 1, 0), keepdims=False)
  return {"kv": out.kv, "last_hidden": last, "end": parent["end"] + n}, logp


def _tree_node_fn(graphdef, objective, chunk, attention=None, temperature=1.0):
  def node_fn(params, ancestors, node):
    out, logp = _tree_segment(graphdef, params, ancestors, node, chunk, attention, temperature)
    loss, aux = objective(logp, node)
    return out, loss, NodeOutputs(logp, aux)
  return node_fn


def tree_replay_value_and_grad(graphdef, params, batch: TreeBatch, objective: Objective, *, micro_batch: int = 1,
                               logprob_chunk: int = 256, schedule: str = "depth_first", reduce_prefix_cotangent=None,
                               prefix_fn=None, attention=None, temperature: float = 1.0):
  """(loss, aux per level, grads) of Σ over tree nodes of objective(logp_node, node), by nested replay.

  batch: from `data.batches.tree_arrays`. The objective sees one node's Segments slot: tokens
  [T_d], mask [T_d] and the per-node/shared fields (for GRPO on trees, `losses.grpo_tree_objective`). aux[d - 1] is level
  d's `NodeOutputs`. schedule: "depth_first" (least
  memory) or "level" (batched levels, faster); see core/tree_replay.py. reduce_prefix_cotangent,
  prefix_fn, attention, temperature: as in `replay_value_and_grad` (the prompt is the tree's root).
  """
  node_fn = _tree_node_fn(graphdef, objective, logprob_chunk, attention, temperature)
  return nested_replay_vjp(_tree_root_fn(graphdef, batch, prefix_fn), [node_fn] * len(batch.levels), params,
                           batch.levels, micro_batch=micro_batch, schedule=schedule,
                           reduce_prefix_cotangent=reduce_prefix_cotangent)


def tree_replay_logprobs(graphdef, params, batch: TreeBatch, *, micro_batch: int = 1, logprob_chunk: int = 256,
                         prefix_fn=None, attention=None, temperature: float = 1.0) -> list:
  """Per level d (d = 1..D): [F_1..F_d, T_d] float32 log-probs of every node's tokens (0 on padding).

  Forward-only nested replay (`core.tree_replay.nested_replay_map`): each node runs once, level by
  level, on its ancestors' K/V. A node's log-probs are those of every trajectory through it (same
  context), so they are the reference / old log-probs of the tree objective. batch: from
  `data.batches.tree_arrays`; micro_batch: leaf siblings per scan step (divides the last fan-out).
  prefix_fn, attention, temperature: as in `replay_value_and_grad` (the prompt is the tree's root).
  """
  node_fn = lambda p, ancestors, node: _tree_segment(graphdef, p, ancestors, node, logprob_chunk, attention,
                                                     temperature)
  return nested_replay_map(_tree_root_fn(graphdef, batch, prefix_fn), [node_fn] * len(batch.levels), params,
                           batch.levels, micro_batch=micro_batch)
