"""A policy and its critic as one Flax NNX module, for PPO.

`ActorCritic` owns the `Llama` policy unchanged and adds a critic, one of CRITICS:

    value_head:  V(s_t) = h_t · w + b on the policy's own final hidden states (a shared trunk;
                 the value loss also trains the trunk).
    separate:    a second Llama, initialised as a copy of the policy's trunk, with its own head
                 w, b: the critic's gradient never reaches the policy's parameters.

Parameters (`nnx.split`): policy/... (the Llama's), critic/... (separate only), value_w [d], value_b
[], with logical axis names (embed) and () (models/llama.py). The head starts at zero, so the first
values are 0 and the first advantages are the discounted rewards themselves rather than a random
critic's noise.

V(s_t) is the value of the context before token t: it is read from the same hidden state that
predicts token t (the previous position; for a segment's first token, its parent's last one).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from branch_replay_jax.kernels.reference import accum_dtype
from branch_replay_jax.models.llama import Llama, annotated, param_value

CRITICS = ("value_head", "separate")


class ActorCritic(nnx.Module):
  """The policy (`self.policy`, a Llama) plus a scalar value head, on its trunk or on a copy of it.

  Args:
    policy: the policy model (kept as is; `self.policy` samples and scores tokens).
    critic: one of CRITICS (see the module docstring).

  Raises:
    ValueError: critic not in CRITICS.
  """

  def __init__(self, policy: Llama, *, critic: str):
    if critic not in CRITICS:
      raise ValueError(f"ActorCritic: critic={critic!r} is not one of {CRITICS}")
    self.policy = policy
    self.critic = nnx.clone(policy) if critic == "separate" else None
    self.value_w = annotated(jnp.zeros((policy.config.d_model,), jnp.float32), ("embed",))
    self.value_b = annotated(jnp.zeros((), jnp.float32), ())

  def value(self, hidden_d: jax.Array) -> jax.Array:
    """[...] float32 (float64 for float64 hidden) values h · w + b of hidden states [..., d]."""
    acc = accum_dtype(hidden_d.dtype)
    # Read through `param_value`: on an FSDP mesh the head is sharded and gathered here (distributed/mesh.py).
    w, b = param_value(self.value_w), param_value(self.value_b)
    return jnp.einsum("...d,d->...", hidden_d, w.astype(hidden_d.dtype), preferred_element_type=acc) + b.astype(acc)
