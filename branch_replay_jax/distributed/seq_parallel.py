"""The prompt of a group or tree split over a mesh axis (context parallelism), for replay inside `shard_map`.

    prompt_ids [P_pad]  ──split over "seq"──►  device i: positions [i*C, (i+1)*C),  C = P_pad / S

    prefix forward : chunk i runs on device i; each layer passes the K/V chunks around the "seq" ring
                     (the xla attention; the Pallas kernels all-gather them) and the chunk's queries
                     see the valid keys before them (kernels/context_parallel.py);
    prefix output  : the local chunk's per-layer K/V [L, 1, C, Hkv, D] (stays sharded) and the
                     prompt's last hidden state [d] (psum over "seq" from its owner: every device);
    branches       : replicated over "seq"; their queries attend to the local chunk and the partial
                     results are merged across "seq" by log-sum-exp (`over_sharded_prompt`).

Every "seq" device thus computes the whole loss; distributed/mesh.py divides the gradients summed over
the mesh by S. The prompt's K/V cotangent stays on the device that owns the chunk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from branch_replay_jax.data.batches import RolloutBatch
from branch_replay_jax.kernels import attention_fn
from branch_replay_jax.kernels.context_parallel import over_sharded_prompt, prompt_chunk_attention, ring_prompt_attention


def check_prompt_split(p_pad: int, seq: int) -> int:
  """C = P_pad / seq, the prompt tokens per "seq" device.

  Raises:
    ValueError: if seq does not divide P_pad (choose a prompt bucket that is a multiple of seq).
  """
  if p_pad % seq:
    raise ValueError(f"prompt_ids: padded prompt length P_pad={p_pad} is not divisible by seq={seq}; "
                     f"use a prompt bucket that is a multiple of {seq}")
  return p_pad // seq


def prompt_attention(attention_impl: str, axis: str = "seq"):
  """The prompt chunk's own attention over `axis` for a resolved `attention_impl` (docs/design.md,
  "Context parallelism"): "xla", the tiled jnp attention, passes the K/V chunks around the ring
  (`ring_prompt_attention`: no layer holds the whole prompt's K/V); the Pallas kernels ("pallas",
  "splash") all-gather them (`prompt_chunk_attention`), whose kernels take whole blocks."""
  if attention_impl == "xla":
    return ring_prompt_attention(axis)
  return prompt_chunk_attention(attention_fn(attention_impl), axis)


def chunk_prompt_forward(model, batch: RolloutBatch, axis: str = "seq", **routes):
  """(the local chunk's KVBlock, last hidden [d] of the prompt, the prompt's `RouterStats` [1, E] or None), the
  last two on every device of `axis`: one model's (a Llama's) forward of this device's prompt chunk
  batch.prompt_ids [C]. `routes` (a mixture of experts': routes [1, C, layers, k], this chunk's recorded
  experts, and replay_routes) go to the model; its per-row routing sums are summed over `axis`, so every
  device holds the whole prompt's (a token routes alone: the chunks' sums add up to the whole prompt's)."""
  chunk = batch.prompt_ids                      # this device's [C] tokens
  c = chunk.shape[0]
  start = jax.lax.axis_index(axis) * c
  valid = start + jnp.arange(c) < batch.prompt_len
  attention = prompt_attention(model.attention_impl, axis)
  out = model(chunk[None], start, valid_bt=valid[None], attention=attention, **routes)
  local = batch.prompt_len - 1 - start          # the last prompt token's index in this chunk
  owner = (local >= 0) & (local < c)
  last = jax.lax.dynamic_index_in_dim(out.hidden_btd[0], jnp.clip(local, 0, c - 1), keepdims=False)
  router = None if out.router is None else jax.tree_util.tree_map(lambda x: jax.lax.psum(x, axis), out.router)
  return out.kv, jax.lax.psum(jnp.where(owner, last, jnp.zeros_like(last)), axis), router


def prompt_split(attention_impl: str, batch: RolloutBatch, *, axis: str = "seq") -> dict:
  """{"prompt_fn", "attention"} for `gradients.step`'s replay when batch.prompt_ids is this device's
  prompt chunk [C] over `axis`: prompt_fn(trunk, **routes) is each trunk's `chunk_prompt_forward`, and the
  completions' (tree nodes') attention runs over the sharded prompt K/V, merged by log-sum-exp
  (`over_sharded_prompt` of the `attention_impl` kernel).

  Call inside `shard_map` over `axis` with the prompt split as P(..., axis) and the completions (tree
  nodes) replicated over `axis`. Replay then returns (loss, aux, grads) as on one device, except
  that the grads are this device's share: summed over `axis` they give S x d loss / d params (every
  device computes the whole loss).
  """
  attention = over_sharded_prompt(attention_fn(attention_impl), axis)
  return {"prompt_fn": lambda trunk, **routes: chunk_prompt_forward(trunk, batch, axis, **routes),
          "attention": attention}
