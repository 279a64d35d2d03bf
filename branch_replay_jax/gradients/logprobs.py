"""A Llama policy's log-probs and objective gradients on a rollout group or tree: replay and naive.

Both paths compute the same function of the parameters,

    loss(θ) = Σ_g objective(logp_g(θ), branch_g),   logp_g[i] = log π_θ(o_g,i | prompt, o_g,<i),

where `objective(logp [T], branch) -> (scalar, aux)` is token-local with padding weighted 0
(see losses.py), and `branch` holds that completion's arrays: "tokens" [T], "mask" [T] and
whatever the objective reads ("weights", "advantage", "old_logp", "ref_logp", ...).

- replay: the prompt runs once (`replay_vjp`); each completion runs on top of its K/V at
  positions P..P+T-1; completion token 0 is scored from the prompt's last hidden state.
- tree replay: every node of a padded rollout tree runs once on its ancestors' K/V
  (`nested_replay_vjp`); the objective sees one node's tokens (`tree_replay_value_and_grad`).
- naive: each completion is appended to a copy of the prompt and the batch of G full sequences
  runs forward and backward (the "[B] -> [B*G]" of today's pipelines), scoring only completion
  positions (the strongest naive: no [P, V] logits), in micro-batches of sequences.

The model enters through `nnx.split`: `graphdef, params = nnx.split(model)`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from branch_replay_jax.models.llama import token_logprobs
from branch_replay_jax.core.replay import replay_map, replay_vjp
from branch_replay_jax.data.groups import RolloutGroup, make_group
from branch_replay_jax.data.trees import PaddedTree, RolloutTree
from branch_replay_jax.core.tree_replay import nested_replay_map, nested_replay_vjp

Objective = Callable[[jax.Array, dict], tuple[jax.Array, Any]]


def group_arrays(group: RolloutGroup, **extras) -> dict:
  """The group as a dict of device arrays: prompt, completions and per-branch extras [G, ...]."""
  g = group.num_completions
  for name, value in extras.items():
    if np.shape(value)[:1] != (g,):
      raise ValueError(f"group_arrays: extra {name!r} has shape {np.shape(value)}; needs a leading axis G={g}")
  return {
      "prompt_ids": jnp.asarray(group.prompt_ids),
      "prompt_len": jnp.asarray(group.prompt_len, jnp.int32),
      "branches": {"tokens": jnp.asarray(group.completion_ids), "mask": jnp.asarray(group.completion_mask),
                   **{k: jnp.asarray(v) for k, v in extras.items()}},
  }


def _prefix_fn(graphdef, arrays):
  def prefix_fn(params):
    model = nnx.merge(graphdef, params)
    p_pad = arrays["prompt_ids"].shape[0]
    valid = jnp.arange(p_pad) < arrays["prompt_len"]
    out = model(arrays["prompt_ids"][None], 0, valid_bt=valid[None])
    last_hidden = jax.lax.dynamic_index_in_dim(out.hidden_btd[0], arrays["prompt_len"] - 1, keepdims=False)
    return out.kv, last_hidden
  return prefix_fn


def _segment(model, segment: dict, offset, ancestors: list, parent_last_hidden, chunk, attention=None):
  """Forward of one segment on its ancestors' K/V and the log-probs of its tokens.

  Token 0 is scored from the parent's last hidden state, token i > 0 from the segment's own
  position i - 1. `attention` overrides the model's (context parallelism). Returns
  (SegmentOutput, logp [T] with 0 on padding).
  """
  out = model(segment["tokens"][None], offset, ancestors=ancestors, valid_bt=segment["mask"][None],
              attention=attention)
  hidden = jnp.concatenate([parent_last_hidden[None].astype(out.hidden_btd.dtype), out.hidden_btd[0, :-1]], axis=0)
  logp = token_logprobs(hidden[None], model.unembedding(), segment["tokens"][None], chunk=chunk)[0]
  return out, jnp.where(segment["mask"], logp, 0.0)


def branch_logprobs(graphdef, params, prefix_out, branch, prompt_len, chunk, attention=None):
  kv, last_hidden = prefix_out
  return _segment(nnx.merge(graphdef, params), branch, prompt_len, [kv], last_hidden, chunk, attention)[1]


def replay_value_and_grad(graphdef, params, arrays: dict, objective: Objective, *, micro_batch: int = 1,
                          logprob_chunk: int = 256, reduce_prefix_cotangent=None):
  """(loss, aux [G, ...], grads) of Σ_g objective by branch replay. See the module docstring and
  `replay_vjp` for `reduce_prefix_cotangent`."""
  def branch_fn(p, prefix_out, branch):
    logp = branch_logprobs(graphdef, p, prefix_out, branch, arrays["prompt_len"], logprob_chunk)
    return objective(logp, branch)
  return replay_vjp(_prefix_fn(graphdef, arrays), branch_fn, params, arrays["branches"], micro_batch=micro_batch,
                    reduce_prefix_cotangent=reduce_prefix_cotangent)


def replay_logprobs(graphdef, params, arrays: dict, *, micro_batch: int = 1, logprob_chunk: int = 256) -> jax.Array:
  """[G, T] float32 log-probs of every completion token (0 on padding), forward-only replay."""
  def branch_fn(p, prefix_out, branch):
    return branch_logprobs(graphdef, p, prefix_out, branch, arrays["prompt_len"], logprob_chunk)
  return replay_map(_prefix_fn(graphdef, arrays), branch_fn, params, arrays["branches"], micro_batch=micro_batch)


def naive_batch(arrays):
  """Full sequences [G, P_pad + T], LEFT-padded so every completion starts at the same column."""
  prompt, p_len = arrays["prompt_ids"], arrays["prompt_len"]
  p_pad = prompt.shape[0]
  shift = p_pad - p_len
  prompt_left = jnp.roll(prompt, shift)  # real tokens move to the end; pads wrap to the front
  prompt_valid = jnp.arange(p_pad) >= shift
  br = arrays["branches"]
  g = br["tokens"].shape[0]
  tokens = jnp.concatenate([jnp.broadcast_to(prompt_left, (g, p_pad)), br["tokens"]], axis=1)
  valid = jnp.concatenate([jnp.broadcast_to(prompt_valid, (g, p_pad)), br["mask"]], axis=1)
  return tokens, valid, -shift  # offset: the first real prompt token sits at position 0


def _naive_logprobs(graphdef, params, tokens, valid, offset, p_pad, chunk):
  model = nnx.merge(graphdef, params)
  out = model(tokens, offset, valid_bt=valid)
  t = tokens.shape[1] - p_pad
  hidden = out.hidden_btd[:, p_pad - 1:p_pad - 1 + t]
  logp = token_logprobs(hidden, model.unembedding(), tokens[:, p_pad:], chunk=chunk)
  return jnp.where(valid[:, p_pad:], logp, 0.0)


def naive_value_and_grad(graphdef, params, arrays: dict, objective: Objective, *, micro_batch: int | None = None,
                         logprob_chunk: int = 256):
  """(loss, aux [G, ...], grads) of Σ_g objective with the prompt repeated per completion.

  micro_batch: sequences per forward+backward (must divide G; default G, one batch); the
  gradients of the micro-batches are summed in a `lax.scan`.
  """
  tokens, valid, offset = naive_batch(arrays)
  p_pad = arrays["prompt_ids"].shape[0]
  g = tokens.shape[0]
  m = g if micro_batch is None else micro_batch
  if m < 1 or g % m:
    raise ValueError(f"naive_value_and_grad: micro_batch={micro_batch!r} must be a positive divisor of G={g}")
  split = lambda x: x.reshape((g // m, m) + x.shape[1:])
  batches = jax.tree_util.tree_map(split, (tokens, valid, arrays["branches"]))

  def loss_fn(p, mb):
    tok, val, branches = mb
    logp = _naive_logprobs(graphdef, p, tok, val, offset, p_pad, logprob_chunk)
    losses, aux = jax.vmap(objective)(logp, branches)
    return jnp.sum(losses), aux

  def step(carry, mb):
    loss_acc, grads_acc = carry
    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, mb)
    return (loss_acc + loss, jax.tree_util.tree_map(jnp.add, grads_acc, grads)), aux

  first = jax.tree_util.tree_map(lambda x: x[0], batches)
  loss0 = jnp.zeros((), jax.eval_shape(loss_fn, params, first)[0].dtype)
  (loss, grads), aux = jax.lax.scan(step, (loss0, jax.tree_util.tree_map(jnp.zeros_like, params)), batches)
  return loss, jax.tree_util.tree_map(lambda x: x.reshape((g,) + x.shape[2:]), aux), grads


def naive_logprobs(graphdef, params, arrays: dict, *, logprob_chunk: int = 256) -> jax.Array:
  """[G, T] completion log-probs from full sequences (the reference for `replay_logprobs`)."""
  tokens, valid, offset = naive_batch(arrays)
  return _naive_logprobs(graphdef, params, tokens, valid, offset, arrays["prompt_ids"].shape[0], logprob_chunk)


def tree_arrays(padded: PaddedTree, per_node: dict[str, Sequence], **shared) -> dict:
  """Device arrays of a padded tree: per level "tokens", "mask" and each per-node field.

  per_node: name -> list indexed by node id of arrays [L_n, ...] (e.g. "weights" [L_n, G],
    "old_logp" [L_n]); scattered into the level slots with `PaddedTree.place` (0 on padding).
  shared: name -> array given to every node unchanged (e.g. "advantage" [G]).
  """
  levels = []
  for d in range(1, len(padded.tokens) + 1):
    slots = padded.node_ids[d - 1].shape
    level = {"tokens": jnp.asarray(padded.tokens[d - 1]), "mask": jnp.asarray(padded.mask[d - 1])}
    level.update({k: jnp.asarray(padded.place(v, d)) for k, v in per_node.items()})
    level.update({k: jnp.broadcast_to(jnp.asarray(v), slots + np.shape(v)) for k, v in shared.items()})
    levels.append(level)
  return {"prompt_ids": jnp.asarray(padded.prompt_ids), "prompt_len": jnp.asarray(padded.prompt_len, jnp.int32),
          "levels": levels}


def tree_root_fn(graphdef, arrays):
  prefix = _prefix_fn(graphdef, arrays)

  def root_fn(params):
    kv, last_hidden = prefix(params)
    return {"kv": kv, "last_hidden": last_hidden, "end": arrays["prompt_len"]}
  return root_fn


def _tree_segment(graphdef, params, ancestors, node, chunk, attention=None):
  """(the node's output for its children, logp [T_d]) of one tree node on its ancestors' outputs."""
  parent = ancestors[-1]
  out, logp = _segment(nnx.merge(graphdef, params), node, parent["end"], [a["kv"] for a in ancestors],
                       parent["last_hidden"], chunk, attention)
  n = jnp.sum(node["mask"].astype(jnp.int32))
  last = jax.lax.dynamic_index_in_dim(out.hidden_btd[0], jnp.maximum(n - 1, 0), keepdims=False)
  return {"kv": out.kv, "last_hidden": last, "end": parent["end"] + n}, logp


def tree_node_fn(graphdef, objective, chunk, attention=None):
  def node_fn(params, ancestors, node):
    out, logp = _tree_segment(graphdef, params, ancestors, node, chunk, attention)
    loss, aux = objective(logp, node)
    return out, loss, {"logp": logp, "aux": aux}
  return node_fn


def tree_replay_value_and_grad(graphdef, params, arrays: dict, objective: Objective, *, micro_batch: int = 1,
                               logprob_chunk: int = 256, schedule: str = "depth_first"):
  """(loss, aux per level, grads) of Σ over tree nodes of objective(logp_node, node), by nested replay.

  arrays: from `tree_arrays`. The objective sees one node: "tokens" [T_d], "mask" [T_d] and the
  per-node/shared fields (for GRPO on trees, `losses.grpo_tree_objective`). aux[d] holds
  {"logp": [F_1..F_d, T_d], "aux": objective aux} per slot. schedule: "depth_first" (least
  memory) or "level" (batched levels, faster); see core/tree_replay.py.
  """
  node_fn = tree_node_fn(graphdef, objective, logprob_chunk)
  return nested_replay_vjp(tree_root_fn(graphdef, arrays), [node_fn] * len(arrays["levels"]), params,
                           arrays["levels"], micro_batch=micro_batch, schedule=schedule)


def tree_replay_logprobs(graphdef, params, arrays: dict, *, micro_batch: int = 1, logprob_chunk: int = 256) -> list:
  """Per level d (d = 1..D): [F_1..F_d, T_d] float32 log-probs of every node's tokens (0 on padding).

  Forward-only nested replay (`core.tree_replay.nested_replay_map`): each node runs once, level by
  level, on its ancestors' K/V. A node's log-probs are those of every trajectory through it (same
  context), so they are the reference / old log-probs of the tree objective. arrays: from
  `tree_arrays`; micro_batch: leaf siblings per scan step (divides the last fan-out).
  """
  node_fn = lambda p, ancestors, node: _tree_segment(graphdef, p, ancestors, node, logprob_chunk)
  return nested_replay_map(tree_root_fn(graphdef, arrays), [node_fn] * len(arrays["levels"]), params,
                           arrays["levels"], micro_batch=micro_batch)


def trajectory_group_arrays(tree: RolloutTree, per_node: dict[str, Sequence], trajectory_weights, *,
                            vocab_size: int, max_positions: int, completion_bucket: int | None = None,
                            **shared) -> dict:
  """The naive counterpart of `tree_arrays`: every trajectory of `tree` as a completion of one group.

  Per-node fields [L_n] are concatenated along each trajectory's path; "weights" is
  trajectory_weights[g] on its tokens (the tree's per-(token, trajectory) weights, unshared), so
  `naive_value_and_grad` with a group objective computes the same loss as tree replay with the
  tree objective.
  """
  g = len(tree.ends)
  comps = [tree.completion(k) for k in range(g)]
  group = make_group(tree.segments[0], comps, vocab_size=vocab_size, max_positions=max_positions,
                     completion_bucket=completion_bucket)
  t = group.completion_ids.shape[1]

  def along(values):
    rows = [np.concatenate([np.asarray(values[m]) for m in tree.path(tree.ends[k])[1:]]) for k in range(g)]
    return np.stack([np.pad(r, (0, t - len(r))) for r in rows])
  extras = {k: along(v) for k, v in per_node.items()}
  extras["weights"] = (group.completion_mask * np.asarray(trajectory_weights)[:, None]).astype(
      np.result_type(np.asarray(trajectory_weights).dtype, np.float32))
  return group_arrays(group, **extras, **shared)
