"""PPO's policy + critic on a rollout group or tree: replay and naive gradients, forward-only passes.

The model is an `ActorCritic` (models/critic.py) entering through `nnx.split`. Both paths compute

    loss(θ) = Σ_g objective(logp_g(θ), values_g(θ), branch_g)

where logp_g[i] = log π_θ(o_g,i | prompt, o_g,<i) and values_g[i] = V_θ(prompt, o_g,<i): token i's
value is read from the hidden state that predicts token i (for i = 0, the prompt's last one).
The objective is `losses.ppo_objective` (groups) or `losses.ppo_tree_objective` (one tree
node; per (token, trajectory) pair).

- replay: the prompt runs once through the policy AND, with a separate critic, through the
  critic's trunk; every completion (group) or tree node runs once on its ancestors' K/V of each
  trunk, so the prompt is computed once for values too (`replay_vjp`, `nested_replay_vjp`).
- naive: every completion is appended to a copy of the prompt (logprobs.naive_batch's left-padded batch)
  and the G full sequences run forward and backward through both trunks, in micro-batches.

Forward-only replay (`replay_map`, `nested_replay_map`) gives the old log-probs and old values.
Per-segment state passed from a node to its descendants ("ancestor"): {"kv": the policy's K/V,
"last": its last real hidden state [d], "end": position after the node} plus "critic_kv",
"critic_last" for a separate critic.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx, struct

from branch_replay_jax.data.batches import GroupBatch, Segments, TreeBatch
from branch_replay_jax.core.accumulate import merge_micro_batches, scan_value_and_grad, split_micro_batches
from branch_replay_jax.core.replay import replay_map, replay_vjp
from branch_replay_jax.core.tree_replay import nested_replay_map, nested_replay_vjp
from branch_replay_jax.gradients.logprobs import NodeOutputs, naive_batch
from branch_replay_jax.models.critic import ActorCritic
from branch_replay_jax.models.llama import token_logprobs

PPOObjective = Callable[[jax.Array, jax.Array, Segments], tuple[jax.Array, Any]]


@struct.dataclass
class LogprobsValues:
  """A forward-only pass of the actor-critic over segments with leading axes L ([G] for a group's
  completions, [F_1..F_d] for tree level d):

  logp: [L, T] float32 log-probs of the segment's tokens (nats; 0 on padding).
  values: [L, T] float32 V of the state each token is sampled from (0 on padding).
  next_value: [L] float32 V of the state after the segment's last real token (GAE bootstraps a
    trajectory cut by the token budget from it, `losses.gae`'s next_values_b); garbage for an
    empty tree slot.
  """
  logp: jax.Array
  values: jax.Array
  next_value: jax.Array


def _trunks(ac: ActorCritic) -> list[tuple[str, Any]]:
  return [("", ac.policy)] + ([("critic_", ac.critic)] if ac.critic is not None else [])


def _forward(ac: ActorCritic, tokens_t, valid_t, offset, ancestors, attention=None) -> dict:
  """One segment through each trunk on its ancestors' K/V: {"kv", "hidden" [T, d]} (+ "critic_*").
  `attention` overrides the trunks' own (context parallelism)."""
  out = {}
  for pre, trunk in _trunks(ac):
    o = trunk(tokens_t[None], offset, ancestors=[a[pre + "kv"] for a in ancestors], valid_bt=valid_t[None],
              attention=attention)
    out[pre + "kv"], out[pre + "hidden"] = o.kv, o.hidden_btd[0]
  return out


def _state(ac: ActorCritic, fwd: dict, n) -> dict:
  """What descendants need of a segment with n >= 1 real tokens: each trunk's K/V and last hidden state."""
  out = {}
  for pre, _ in _trunks(ac):
    out[pre + "kv"] = fwd[pre + "kv"]
    out[pre + "last"] = jax.lax.dynamic_index_in_dim(fwd[pre + "hidden"], n - 1, keepdims=False)
  return out


def _score(ac: ActorCritic, fwd: dict, parent: dict, tokens_t, mask_t, chunk):
  """(logp [T], values [T]) of a segment's tokens, 0 on padding; token 0 from the parent's last state."""
  def shifted(pre):
    h = fwd[pre + "hidden"]
    return jnp.concatenate([parent[pre + "last"][None].astype(h.dtype), h[:-1]], axis=0)
  w, vocab_axis = ac.policy.output_weights()
  logp = token_logprobs(shifted("")[None], w, tokens_t[None], chunk=chunk, vocab_axis=vocab_axis)[0]
  values = ac.value(shifted("critic_" if ac.critic is not None else ""))
  return jnp.where(mask_t, logp, 0.0), jnp.where(mask_t, values, 0.0)


def _root_fn(graphdef, batch, prompt_fn=None):
  """params -> the prompt's state for its children. prompt_fn(trunk) -> (K/V, last real hidden
  state [d]) replaces each trunk's whole-prompt forward (context parallelism:
  distributed/seq_parallel.py's `actor_critic_prompt_split`)."""
  def root_fn(params):
    ac = nnx.merge(graphdef, params)
    prompt, p_len = batch.prompt_ids, batch.prompt_len
    if prompt_fn is None:
      return {**_state(ac, _forward(ac, prompt, jnp.arange(prompt.shape[0]) < p_len, 0, []), p_len), "end": p_len}
    state = {"end": p_len}
    for pre, trunk in _trunks(ac):
      state[pre + "kv"], state[pre + "last"] = prompt_fn(trunk)
    return state
  return root_fn


def _node_fn(graphdef, chunk, objective=None, attention=None):
  """(params, ancestors, node) -> (state, loss, NodeOutputs), or without an objective
  (forward only) -> (state, LogprobsValues of the node)."""
  def node_fn(params, ancestors, node):
    ac = nnx.merge(graphdef, params)
    parent = ancestors[-1]
    fwd = _forward(ac, node.tokens, node.mask, parent["end"], ancestors, attention)
    logp, values = _score(ac, fwd, parent, node.tokens, node.mask, chunk)
    n = jnp.sum(node.mask.astype(jnp.int32))
    state = {**_state(ac, fwd, jnp.maximum(n, 1)), "end": parent["end"] + n}
    if objective is None:
      # V of the state after the node's last token (the hidden state at its last real position):
      # GAE bootstraps a trajectory cut by the token budget from it (losses.gae's next_values_b).
      next_value = ac.value(state["critic_last" if ac.critic is not None else "last"])
      return state, LogprobsValues(logp, values, next_value)
    loss, aux = objective(logp, values, node)
    return state, loss, NodeOutputs(logp, aux, values)
  return node_fn


def replay_value_and_grad(graphdef, params, batch: GroupBatch, objective: PPOObjective, *, micro_batch: int = 1,
                          logprob_chunk: int = 256, reduce_prefix_cotangent=None, prompt_fn=None, attention=None):
  """(loss, aux [G, ...], grads for policy AND critic) of Σ_g objective over a group, by branch replay.

  batch: `data.batches.group_arrays` with the objective's fields per completion. aux holds the
  objective's aux per completion. reduce_prefix_cotangent: as in `core.replay.replay_vjp` (the
  prompt's float state: each trunk's K/V and last hidden state; the mesh's all-reduce over
  `branch`). prompt_fn, attention: replace each trunk's whole-prompt forward and the completions'
  attention (context parallelism: distributed/seq_parallel.py's `actor_critic_prompt_split`);
  default: the whole prompt on this device and the trunks' own attention.
  """
  node_fn = _node_fn(graphdef, logprob_chunk, objective, attention)
  branch_fn = lambda p, root, branch: node_fn(p, (root,), branch)[1:]
  loss, aux, grads = replay_vjp(_root_fn(graphdef, batch, prompt_fn), branch_fn, params, batch.branches,
                                micro_batch=micro_batch, reduce_prefix_cotangent=reduce_prefix_cotangent)
  return loss, aux.aux, grads


def replay_logprobs_values(graphdef, params, batch: GroupBatch, *, micro_batch: int = 1,
                           logprob_chunk: int = 256, prompt_fn=None, attention=None) -> LogprobsValues:
  """`LogprobsValues` of a group's completions (L = [G]), by forward-only replay. prompt_fn,
  attention: as in `replay_value_and_grad`."""
  node_fn = _node_fn(graphdef, logprob_chunk, attention=attention)
  return replay_map(_root_fn(graphdef, batch, prompt_fn), lambda p, root, branch: node_fn(p, (root,), branch)[1],
                    params, batch.branches, micro_batch=micro_batch)


def tree_replay_value_and_grad(graphdef, params, batch: TreeBatch, objective: PPOObjective, *, micro_batch: int = 1,
                               logprob_chunk: int = 256, schedule: str = "depth_first", reduce_prefix_cotangent=None):
  """(loss, aux per level, grads) of Σ over tree nodes of objective(logp, values, node), by nested replay.

  batch: `data.batches.tree_arrays`; aux[d - 1] is level d's `NodeOutputs` (with values).
  schedule: "depth_first" (least memory) or "level" (batched levels), as in core/tree_replay.py.
  reduce_prefix_cotangent: as in `replay_value_and_grad` (the root's state).
  """
  node_fn = _node_fn(graphdef, logprob_chunk, objective)
  return nested_replay_vjp(_root_fn(graphdef, batch), [node_fn] * len(batch.levels), params, batch.levels,
                           micro_batch=micro_batch, schedule=schedule, reduce_prefix_cotangent=reduce_prefix_cotangent)


def tree_logprobs_values(graphdef, params, batch: TreeBatch, *, micro_batch: int = 1, logprob_chunk: int = 256) -> list:
  """Per level d, `LogprobsValues` of its slots (L = [F_1..F_d]), by forward-only nested replay."""
  node_fn = _node_fn(graphdef, logprob_chunk)
  return nested_replay_map(_root_fn(graphdef, batch), [node_fn] * len(batch.levels), params, batch.levels,
                           micro_batch=micro_batch)


def _naive_forward(graphdef, params, tokens, valid, offset, p_pad, chunk):
  """(logp, values) [B, T] of the completion part of full left-padded sequences (0 on padding), and
  next_values [B], V after each completion's last real token (column p_pad + T_b - 1)."""
  ac = nnx.merge(graphdef, params)
  t = tokens.shape[1] - p_pad
  scored = lambda out: out.hidden_btd[:, p_pad - 1:p_pad - 1 + t]   # position P+i-1 predicts token i
  out = ac.policy(tokens, offset, valid_bt=valid)
  w, vocab_axis = ac.policy.output_weights()
  logp = token_logprobs(scored(out), w, tokens[:, p_pad:], chunk=chunk, vocab_axis=vocab_axis)
  if ac.critic is not None:
    out = ac.critic(tokens, offset, valid_bt=valid)
  values = ac.value(scored(out))
  mask = valid[:, p_pad:]
  last = p_pad - 1 + jnp.sum(mask.astype(jnp.int32), axis=1)
  next_values = ac.value(jnp.take_along_axis(out.hidden_btd, last[:, None, None], axis=1)[:, 0])
  return jnp.where(mask, logp, 0.0), jnp.where(mask, values, 0.0), next_values


def naive_value_and_grad(graphdef, params, batch: GroupBatch, objective: PPOObjective, *, micro_batch: int | None = None,
                         logprob_chunk: int = 256):
  """(loss, aux [G, ...], grads) of Σ_g objective with the prompt repeated per completion (the reference).

  micro_batch: sequences per forward+backward (a positive divisor of G; default G); the
  micro-batches' gradients are summed in a `lax.scan`.
  """
  tokens, valid, offset = naive_batch(batch)
  p_pad, g = batch.prompt_ids.shape[0], tokens.shape[0]
  m = g if micro_batch is None else micro_batch
  if m < 1 or g % m:
    raise ValueError(f"naive_value_and_grad: micro_batch={micro_batch!r} must be a positive divisor of G={g}")

  def loss_fn(p, mb):
    tok, val, branches = mb
    logp, values, _ = _naive_forward(graphdef, p, tok, val, offset, p_pad, logprob_chunk)
    losses, aux = jax.vmap(objective)(logp, values, branches)
    return jnp.sum(losses), aux

  (loss, grads), aux = scan_value_and_grad(loss_fn, params, split_micro_batches((tokens, valid, batch.branches), m))
  return loss, merge_micro_batches(aux, g), grads


def naive_logprobs_values(graphdef, params, batch: GroupBatch, *, logprob_chunk: int = 256) -> LogprobsValues:
  """`LogprobsValues` of a group's completions from full sequences (the reference for
  `replay_logprobs_values`)."""
  tokens, valid, offset = naive_batch(batch)
  logp, values, next_values = _naive_forward(graphdef, params, tokens, valid, offset, batch.prompt_ids.shape[0],
                                             logprob_chunk)
  return LogprobsValues(logp, values, next_values)
