"""What a model outputs per token, for the step builder (gradients/step.py): a policy, or a policy and its critic.

A head names the model's trunks (Llama decoders whose K/V a segment's descendants attend to) and
turns each trunk's hidden states into the per-token outputs the objective reads:

    Policy        trunks {"policy": the Llama}                    -> logp
    ActorCritic   trunks {"policy"} (+ {"critic"}: separate)      -> logp, values, next_value

Token i of a segment is scored from the hidden state that predicts it: position i - 1 of the segment,
or for i = 0 the parent segment's last real position (`shifted` below). A value V(s_i) is read from
the same hidden state (models/critic.py). Log-probs are those of softmax(logits / τ), τ = the head's
`temperature` (docs/design.md, "Log-prob temperature").
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from branch_replay_jax.models.llama import token_logprobs


@struct.dataclass
class SegmentOutputs:
  """Per-token outputs of B segments (rows) of T tokens, 0 on padding:

  logp: [B, T] float32 log-probs of the tokens (nats).
  values: [B, T] float32 V of the state each token is sampled from (ActorCritic; None for a Policy).
  next_value: [B] float32 V after each row's last real token (ActorCritic; GAE bootstraps a trajectory
    cut by the token budget from it, `losses.gae`'s next_values_b); None for a Policy.
  router_aux: [B] the load-balancing loss (`losses.load_balancing_loss`) of the trajectory each row ends (its
    prompt and completion, every layer): a Qwen3-MoE policy's where the head's router_aux_coef > 0, else None.
  routing_mismatch: [B] of that trajectory's (layer, token) pairs with routes the sampler recorded, the fraction
    whose own top k (the trainer's routing now) is another set of experts; None without recorded routes.
  """
  logp: jax.Array
  values: jax.Array | None = None
  next_value: jax.Array | None = None
  router_aux: jax.Array | None = None
  routing_mismatch: jax.Array | None = None


@struct.dataclass
class LogprobsValues:
  """An ActorCritic's forward-only outputs over segments with leading axes L ([G] for a group's
  completions, [F_1..F_d] for tree level d): logp, values [L, T] and next_value [L] float32, as in
  `SegmentOutputs` (PPO's old log-probs and values)."""
  logp: jax.Array
  values: jax.Array
  next_value: jax.Array


def _logp(policy, shifted_btd, tokens_bt, mask_bt, chunk: int, temperature: float):
  w, vocab_axis = policy.output_weights()
  logp = token_logprobs(shifted_btd, w, tokens_bt, chunk=chunk, vocab_axis=vocab_axis, temperature=temperature,
                        softcap=policy.logit_softcap)
  return jnp.where(mask_bt, logp, 0.0)


@dataclasses.dataclass(frozen=True)
class Policy:
  """A Llama policy (the model is a `models.llama.Llama`, or one with LoRA adapters).

  The objective is `objective(logp [T], branch) -> (loss, aux)` (losses.grpo_objective, ...);
  forward-only passes return logp arrays. router_aux_coef > 0 (a Qwen3-MoE policy, a group's layouts on one
  device) adds router_aux_coef · the mean over the group's trajectories of their load-balancing loss
  (`gradients.step`; docs/design.md, "The load-balancing loss under replay"). routing_replay: a batch's
  recorded routes (the sampler's experts per token and layer) are run in place of the router's own top k,
  gating weights from the current router (`models.llama.moe_mlp`; docs/design.md, "Routing replay").
  """
  temperature: float = 1.0
  router_aux_coef: float = 0.0
  routing_replay: bool = False

  def trunks(self, model) -> dict[str, Any]:
    return {"policy": model}

  def attention_impl(self, model) -> str:
    return model.attention_impl

  def outputs(self, model, shifted: dict, tokens_bt, mask_bt, chunk: int, last: dict) -> SegmentOutputs:
    """`SegmentOutputs` from each trunk's shifted hidden states [B, T, d] and last real ones [B, d]."""
    del last
    return SegmentOutputs(_logp(model, shifted["policy"], tokens_bt, mask_bt, chunk, self.temperature))

  def loss(self, objective, out: SegmentOutputs, branch):
    return objective(out.logp, branch)

  def forward_result(self, out: SegmentOutputs):
    return out.logp


@dataclasses.dataclass(frozen=True)
class ActorCritic:
  """A `models.critic.ActorCritic`: the policy plus a value head on its trunk, or on a separate critic
  trunk (whose K/V and hidden states are carried beside the policy's).

  The objective is `objective(logp [T], values [T], branch) -> (loss, aux)` (losses.ppo_objective,
  a completion's or a tree node's); forward-only passes return `LogprobsValues`.
  """
  temperature: float = 1.0

  def trunks(self, model) -> dict[str, Any]:
    return {"policy": model.policy, **({"critic": model.critic} if model.critic is not None else {})}

  def attention_impl(self, model) -> str:
    return model.policy.attention_impl

  def outputs(self, model, shifted: dict, tokens_bt, mask_bt, chunk: int, last: dict) -> SegmentOutputs:
    value_trunk = "critic" if model.critic is not None else "policy"
    logp = _logp(model.policy, shifted["policy"], tokens_bt, mask_bt, chunk, self.temperature)
    values = jnp.where(mask_bt, model.value(shifted[value_trunk]), 0.0)
    return SegmentOutputs(logp, values, model.value(last[value_trunk]))

  def loss(self, objective, out: SegmentOutputs, branch):
    return objective(out.logp, out.values, branch)

  def forward_result(self, out: SegmentOutputs) -> LogprobsValues:
    return LogprobsValues(out.logp, out.values, out.next_value)


HEADS = {"policy": Policy, "actor_critic": ActorCritic}
POLICY = Policy()              # τ = 1
ACTOR_CRITIC = ActorCritic()   # τ = 1
