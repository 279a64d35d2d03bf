"""Advantages, loss normalisation and per-token objectives (pure functions on arrays).

Every function here takes arrays and keyword arguments, never a config, and is exact under
replay because it is token-local: a token's term depends only on that token's log-prob and
on per-branch constants (advantage, weights). See DESIGN.md, "Losses on trees".

Shapes: G branches (completions) of a group, T padded completion length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

NORMALISATIONS = ("sequence_mean", "token_mean", "constant")


def group_advantages(rewards_g: jax.Array, *, eps: float = 1e-6, ddof: int = 1) -> jax.Array:
  """GRPO group-normalised advantages A_i = (r_i - mean(r)) / (std(r) + eps).

  DeepSeekMath (Shao et al. 2024, arXiv 2402.03300), section 4.1.2 ("outcome supervision").

  Args:
    rewards_g: [..., G] rewards of one group (or a batch of groups on leading axes).
    eps: added to the std so that a group of equal rewards gives A = 0, not NaN.
    ddof: 1 for the unbiased std (as `torch.std`, used by TRL), 0 for the population std.

  Returns:
    [..., G] advantages, float32 (or float64 for float64 input).

  Raises:
    ValueError: if G <= ddof (the std is undefined).
  """
  rewards_g = jnp.asarray(rewards_g)
  if not jnp.issubdtype(rewards_g.dtype, jnp.floating):
    rewards_g = rewards_g.astype(jnp.float32)
  g = rewards_g.shape[-1]
  if g <= ddof:
    raise ValueError(f"group_advantages: a group of G={g} rewards has no std with ddof={ddof}; GRPO needs G >= 2")
  mean = rewards_g.mean(axis=-1, keepdims=True)
  std = rewards_g.std(axis=-1, keepdims=True, ddof=ddof)
  return (rewards_g - mean) / (std + eps)


def trajectory_weights(lengths_g, *, mode: str, max_length: int | None = None) -> np.ndarray:
  """[G] per-token loss weight of each trajectory (the same for all its tokens) for one normalisation.

  The group loss is Σ_g w_g Σ_{t in o_g} ℓ[g, t]. Modes:
    sequence_mean: w_g = 1 / (G |o_g|)   -- mean over each completion, then over the group
                   (GRPO, arXiv 2402.03300 eq. 3).
    token_mean:    w_g = 1 / Σ_g |o_g|   -- mean over all tokens of the group
                   (DAPO, arXiv 2503.14476 eq. 8).
    constant:      w_g = 1 / (G L_max)   -- a constant that does not depend on lengths
                   (Dr. GRPO, arXiv 2503.20783 section 3.1); L_max = max_length.
  On a tree, a token shared by several trajectories carries one term per trajectory.

  Args:
    lengths_g: [G] completion lengths |o_g| (tokens), >= 0.
    mode: one of NORMALISATIONS.
    max_length: L_max, required for mode="constant".

  Raises:
    ValueError: unknown mode, a negative length, an all-empty group, constant without max_length.
  """
  lengths = np.asarray(lengths_g, dtype=np.int64)
  if mode not in NORMALISATIONS:
    raise ValueError(f"token_weights: mode={mode!r} is not one of {NORMALISATIONS}")
  if lengths.ndim != 1 or np.any(lengths < 0):
    raise ValueError(f"token_weights: lengths {lengths.tolist()} must be a 1-D array of lengths >= 0")
  if lengths.sum() == 0:
    raise ValueError("token_weights: every completion in the group is empty")
  g = lengths.shape[0]
  if mode == "sequence_mean":
    return np.where(lengths > 0, 1.0 / (g * np.maximum(lengths, 1)), 0.0)
  if mode == "token_mean":
    return np.full(g, 1.0 / lengths.sum())
  if not max_length:
    raise ValueError("token_weights: mode='constant' needs max_length (L_max)")
  return np.full(g, 1.0 / (g * max_length))


def token_weights(lengths_g, num_tokens: int, *, mode: str, max_length: int | None = None) -> np.ndarray:
  """[G, T] float64 weights w[g, t] = `trajectory_weights`[g] on real tokens, 0 on padding.

  Args:
    lengths_g: [G] completion lengths in [0, num_tokens].
    num_tokens: T, the padded completion length; also L_max for mode="constant" by default.

  Raises:
    ValueError: as `trajectory_weights`, or a length outside [0, T].
  """
  lengths = np.asarray(lengths_g, dtype=np.int64)
  if lengths.ndim != 1 or np.any(lengths < 0) or np.any(lengths > num_tokens):
    raise ValueError(f"token_weights: lengths {lengths.tolist()} must be a 1-D array in [0, {num_tokens}]")
  w = trajectory_weights(lengths, mode=mode, max_length=max_length or num_tokens)
  return np.where(np.arange(num_tokens)[None, :] < lengths[:, None], w[:, None], 0.0)


def k3_kl(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
  """Per-token KL(π || π_ref) estimator k3 = exp(q - p) - (q - p) - 1, with p = logp, q = ref_logp.

  Unbiased and non-negative; J. Schulman, "Approximating KL Divergence" (2020), the "k3" estimator;
  used by GRPO (arXiv 2402.03300 eq. 4).
  """
  d = ref_logp - logp
  return jnp.exp(d) - d - 1.0


def grpo_token_loss(logp: jax.Array, old_logp: jax.Array, ref_logp: jax.Array, advantages: jax.Array, *,
                    clip_eps: float = 0.2, kl_coef: float = 0.0) -> tuple[jax.Array, dict]:
  """Per-token GRPO loss ℓ_t = -min(r_t A, clip(r_t, 1-ε, 1+ε) A) + β k3_t, r_t = exp(logp - old_logp).

  PPO clipped surrogate (Schulman et al. 2017, arXiv 1707.06347 eq. 7) with the GRPO KL term
  (arXiv 2402.03300 eq. 3). Token-local: exact under replay for any tree.

  Args:
    logp, old_logp, ref_logp: [..., T] float log-probs of the sampled tokens under the current,
      sampling and reference policies (old/ref are constants).
    advantages: broadcastable to logp, e.g. [..., 1].
    clip_eps: ε.
    kl_coef: β (0 disables the KL term; ref_logp is then unused).

  Returns:
    loss [..., T] and a dict of per-token metrics {"clipped": bool [..., T], "kl": [..., T]}.
  """
  old_logp = jax.lax.stop_gradient(old_logp)
  ref_logp = jax.lax.stop_gradient(ref_logp)
  ratio = jnp.exp(logp - old_logp)
  unclipped = ratio * advantages
  clipped = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
  kl = k3_kl(logp, ref_logp)
  loss = -jnp.minimum(unclipped, clipped) + kl_coef * kl
  return loss, {"clipped": clipped < unclipped, "kl": kl}


def weighted_logprob_loss(logp: jax.Array, weights: jax.Array) -> jax.Array:
  """-Σ_t w_t logp_t: the policy-gradient / SFT objective with per-token weights (e.g. w = A/|o|)."""
  return -jnp.sum(weights * logp)


def grpo_objective(logp: jax.Array, branch: dict, *, clip_eps: float, kl_coef: float,
                   on_policy: bool) -> tuple[jax.Array, dict]:
  """One completion's GRPO loss Σ_t w_t ℓ_t (see `grpo_token_loss`) and its metric sums.

  Args:
    logp: [T] log-probs of the completion's tokens under the current parameters (0 on padding).
    branch: arrays of that completion: "mask" [T] bool, "weights" [T] (`token_weights`, 0 on
      padding), "advantage" [], "old_logp" [T] (read unless on_policy), "ref_logp" [T] (read when
      kl_coef > 0).
    on_policy: the sampling policy is the current one (one update per batch): old_logp is
      stop_gradient(logp), so the ratio is exactly 1 and its gradient is ∇logp.

  Returns:
    (loss, {"clipped": clipped token count, "kl": Σ_t k3 over real tokens}).
  """
  old = jax.lax.stop_gradient(logp) if on_policy else branch["old_logp"]
  ref = branch["ref_logp"] if kl_coef else jax.lax.stop_gradient(logp)
  loss, metrics = grpo_token_loss(logp, old, ref, branch["advantage"], clip_eps=clip_eps, kl_coef=kl_coef)
  mask = branch["mask"]
  return jnp.sum(branch["weights"] * loss), {"clipped": jnp.sum(metrics["clipped"] & mask),
                                             "kl": jnp.sum(jnp.where(mask, metrics["kl"], 0.0))}


def grpo_tree_objective(logp: jax.Array, node: dict, *, clip_eps: float, kl_coef: float,
                        on_policy: bool) -> tuple[jax.Array, dict]:
  """GRPO loss of one tree node's tokens: Σ_t Σ_g w[t, g] ℓ(logp_t, A_g) (DESIGN.md, "Losses on trees").

  A token shared by several trajectories has one log-prob but one term per trajectory g below it:
  the surrogate is evaluated per (token, trajectory) pair, which keeps PPO-clip exact although it
  is non-linear in the advantage.

  Args:
    logp: [T] log-probs of the node's tokens (0 on padding).
    node: "weights" [T, G] (`trajectory_weights`[g] where trajectory g passes the token, else 0),
      "advantage" [G], "mask" [T], "old_logp" [T] (unless on_policy), "ref_logp" [T] (if kl_coef).

  Returns:
    (loss, {"clipped": clipped (token, trajectory) pairs, "kl": Σ_t k3 over real tokens}).
  """
  old = jax.lax.stop_gradient(logp) if on_policy else node["old_logp"]
  ref = node["ref_logp"] if kl_coef else jax.lax.stop_gradient(logp)
  loss, metrics = grpo_token_loss(logp[:, None], old[:, None], ref[:, None], node["advantage"][None, :],
                                  clip_eps=clip_eps, kl_coef=kl_coef)
  w = node["weights"]
  return jnp.sum(w * loss), {"clipped": jnp.sum(metrics["clipped"] & (w > 0)),
                             "kl": jnp.sum(jnp.where(node["mask"], metrics["kl"][:, 0], 0.0))}
