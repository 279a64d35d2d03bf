"""Advantages, loss weightings and per-token objectives (pure functions on arrays).

Every function here takes arrays and keyword arguments, never a config, and is exact under
replay because it is token-local: a token's term depends only on that token's log-prob and
on per-branch constants (advantage, weights). See docs/design.md, "Losses on trees".

Shapes: G branches (completions) of a group, T padded completion length.

Why one module of ~650 lines: every algorithm's objective rests on the same token-local contract
(weights per (token, trajectory), 0 on padding and observations, per-branch constants), and the
tests of each objective read the others' helpers; split by algorithm, that contract would be
restated in each part.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from branch_replay_jax.data.batches import Segments

# The loss weightings (config field loss.weighting; docs/design.md, "Loss weightings"):
# `trajectory_weights` gives each one's per-(token, trajectory) weight within a group; step_token_mean's
# step-level scale B / N is `step_token_scale`, applied once the step's groups are known.
WEIGHTINGS = ("sequence_mean", "group_token_mean", "step_token_mean", "constant")


def _as_float(x) -> jax.Array:
  """x as an array of at least float32 (bfloat16 and integer rewards are widened; float64 stays)."""
  x = jnp.asarray(x)
  return x.astype(jnp.result_type(x.dtype, jnp.float32))


def constant_groups(rewards_g: jax.Array) -> jax.Array:
  """[...] bool, True for a group whose G rewards are all equal (max == min, exactly).

  Such a group carries no learning signal: every advantage estimator here returns exactly 0 for
  all its members, whatever the dtype, eps or ddof. This is the same test as the training
  loop's `zero_variance_groups` metric and DPO's skipped prompts use, so the metric counts exactly the
  groups whose advantages were zeroed.

  Args:
    rewards_g: [..., G] rewards.
  """
  r = jnp.asarray(rewards_g)
  return r.max(axis=-1) == r.min(axis=-1)


def group_advantages(rewards_g: jax.Array, *, eps: float = 1e-6, ddof: int = 1) -> jax.Array:
  """GRPO group-normalised advantages A_i = (r_i - mean(r)) / (std(r) + eps).

  DeepSeekMath (Shao et al. 2024, arXiv 2402.03300), section 4.1.2 ("outcome supervision").

  A group of equal rewards (`constant_groups`) gets A = 0 exactly. Computing the formula would
  not give it: in float32 the mean of sixteen 1.1 is not 1.1, the std of the residue (~1e-7)
  passes eps = 1e-6 and every A comes out as -0.1061; with eps = 0 the formula is 0/0 (NaN) or a
  residue over a residue (-0.8165 for three 0.1). A group whose std + eps rounds to 0 although
  its rewards differ (eps = 0 and differences that underflow when squared) also gets 0, never NaN.

  Args:
    rewards_g: [..., G] rewards of one group (or a batch of groups on leading axes).
    eps: >= 0, added to the std (0 is allowed: constant groups are handled exactly, not by eps).
    ddof: 1 for the unbiased std (as `torch.std`, used by TRL), 0 for the population std.

  Returns:
    [..., G] advantages, float32 (float64 for float64 input; bfloat16 and integer rewards are
    computed and returned in float32).

  Raises:
    ValueError: if G <= ddof (the std is undefined) or eps < 0.
  """
  rewards_g = _as_float(rewards_g)
  g = rewards_g.shape[-1]
  if g <= ddof:
    raise ValueError(f"group_advantages: a group of G={g} rewards has no std with ddof={ddof}; GRPO needs G >= 2")
  if not eps >= 0:
    raise ValueError(f"group_advantages: eps={eps!r} must be >= 0")
  mean = rewards_g.mean(axis=-1, keepdims=True)
  denom = rewards_g.std(axis=-1, keepdims=True, ddof=ddof) + eps
  zero = constant_groups(rewards_g)[..., None] | (denom == 0)
  return jnp.where(zero, 0.0, (rewards_g - mean) / jnp.where(zero, 1.0, denom))


def whiten(values: jax.Array, mask: jax.Array | None = None, *, eps: float = 1e-8) -> jax.Array:
  """(x - mean) / (std + eps) over the entries where `mask` (all when None), 0 elsewhere.

  PPO's advantage whitening over a step's (token, trajectory) pairs (OpenAI baselines ppo2;
  "advantage normalization" in Andrychowicz et al. 2020, arXiv 2006.05990, section 3.5). The
  mean and the population std (ddof 0) are taken over the masked entries only. When those
  entries are all equal (including a single entry) the result is exactly 0: computing the
  formula on 1234 copies of float32 0.1 instead gives -0.598 on every entry (the residue of the
  inexact mean divided by its own ~1e-8 std). No entries: all 0.

  Args:
    values: any shape, float.
    mask: bool of the same shape, or None.
    eps: >= 0, added to the std.

  Returns:
    Same shape, float32 (float64 for float64 input).

  Raises:
    ValueError: eps < 0 or a mask of another shape.
  """
  x = _as_float(values)
  m = jnp.ones(x.shape, bool) if mask is None else jnp.asarray(mask, bool)
  if m.shape != x.shape:
    raise ValueError(f"whiten: mask shape {m.shape} differs from values shape {x.shape}")
  if not eps >= 0:
    raise ValueError(f"whiten: eps={eps!r} must be >= 0")
  n = jnp.maximum(m.sum(), 1)
  mean = jnp.where(m, x, 0.0).sum() / n
  denom = jnp.sqrt(jnp.where(m, jnp.square(x - mean), 0.0).sum() / n) + eps
  constant = jnp.where(m, x, jnp.inf).min() >= jnp.where(m, x, -jnp.inf).max()   # also True with no entries
  zero = constant | (denom == 0)
  return jnp.where(m & ~zero, (x - mean) / jnp.where(zero, 1.0, denom), 0.0)


def explained_variance(returns, predicted) -> float | None:
  """1 - Var[R - V] / Var[R] over the given entries (host-side metric, float64), or None when every
  return is equal (exactly): the ratio is then undefined, and a float32 variance of equal values
  is not 0 but ~1e-15, which would turn the metric into an arbitrary large negative number.

  Args:
    returns, predicted: [N] value targets R and the critic's predictions V (any float dtype).
  """
  r, v = np.asarray(returns, np.float64), np.asarray(predicted, np.float64)
  if r.size == 0 or r.max() == r.min():
    return None
  return float(1.0 - np.var(r - v) / np.var(r))


def trajectory_weights(lengths_g, *, mode: str, max_length: int | None = None, in_loss=None) -> np.ndarray:
  """[G] per-token loss weight of each trajectory (the same for all its tokens) for one weighting.

  The group loss is Σ_g w_g Σ_{t in o_g} ℓ[g, t]. Weightings (`WEIGHTINGS`), over the K
  trajectories in the loss (K = G unless `in_loss` leaves some out):
    sequence_mean:    w_g = 1 / (K |o_g|)  -- mean over each completion, then over the group
                      (GRPO, arXiv 2402.03300 eq. 3).
    group_token_mean: w_g = 1 / Σ_j |o_j|  -- mean over all tokens of the group, j in the loss
                      (DAPO's token mean, arXiv 2503.14476 eq. 8, taken per group).
    step_token_mean:  w_g = 1              -- the sum over the group's tokens; the step scales every
                      weight by B / N (`step_token_scale`: B groups, N (token, trajectory) pairs in
                      the step's loss), which makes the loop's mean over groups the token mean over
                      the whole step (DAPO eq. 8 over the batch).
    constant:         w_g = 1 / (K L_max)  -- a constant that does not depend on lengths
                      (Dr. GRPO, arXiv 2503.20783 section 3.1); L_max = max_length.
  On a tree, a token shared by several trajectories carries one term per trajectory.

  Example (group_token_mean, lengths [3, 5, 8], in_loss [True, False, True]): w = [1/11, 0, 1/11];
  the group is normalised as if it held the two trajectories in the loss (`loss.mask_truncated`).

  Args:
    lengths_g: [G] completion lengths |o_g| (tokens), >= 0.
    mode: one of WEIGHTINGS.
    max_length: L_max, required for mode="constant".
    in_loss: [G] bool, the trajectories the loss keeps (w = 0 for the others), or None (all).
      None of them kept: every weight is 0 (the group adds nothing to the loss).

  Returns:
    [G] float64.

  Raises:
    ValueError: unknown mode, a negative length, an in_loss of another shape, kept trajectories
      that are all empty, constant without max_length.
  """
  lengths = np.asarray(lengths_g, dtype=np.int64)
  if mode not in WEIGHTINGS:
    raise ValueError(f"token_weights: mode={mode!r} is not one of {WEIGHTINGS}")
  if lengths.ndim != 1 or np.any(lengths < 0):
    raise ValueError(f"token_weights: lengths {lengths.tolist()} must be a 1-D array of lengths >= 0")
  keep = np.ones(lengths.shape, bool) if in_loss is None else np.asarray(in_loss, bool)
  if keep.shape != lengths.shape:
    raise ValueError(f"token_weights: in_loss shape {keep.shape} differs from lengths shape {lengths.shape}")
  if not keep.any():
    return np.zeros(lengths.shape)
  if lengths[keep].sum() == 0:
    raise ValueError("token_weights: every completion in the group is empty")
  k = int(keep.sum())
  if mode == "sequence_mean":
    w = np.where(lengths > 0, 1.0 / (k * np.maximum(lengths, 1)), 0.0)
  elif mode == "group_token_mean":
    w = np.full(lengths.shape, 1.0 / lengths[keep].sum())
  elif mode == "step_token_mean":
    w = np.ones(lengths.shape)
  elif not max_length:
    raise ValueError("token_weights: mode='constant' needs max_length (L_max)")
  else:
    w = np.full(lengths.shape, 1.0 / (k * max_length))
  return np.where(keep, w, 0.0)


def step_token_scale(num_groups: int, num_pairs: int) -> float:
  """B / N: the factor on step_token_mean's weights (`trajectory_weights`, 1 per (token,
  trajectory) pair in the loss) that makes the loop's mean over a step's B groups, (1/B) Σ_k Σ w ℓ,
  the token mean over the step, (1/N) Σ ℓ over its N (token, trajectory) pairs in the loss (DAPO,
  arXiv 2503.14476 eq. 8; verl's loss_agg_mode "token-mean", TRL's loss_type "dapo"). N = 0 (no
  token in the loss): 0.

  Example: two groups with 2 and 6 pairs in the loss: B / N = 2 / 8.

  Raises:
    ValueError: num_groups < 1 or num_pairs < 0.
  """
  if num_groups < 1 or num_pairs < 0:
    raise ValueError(f"step_token_scale: num_groups={num_groups} must be >= 1 and num_pairs={num_pairs} >= 0")
  return num_groups / num_pairs if num_pairs else 0.0


def overlong_penalty(lengths_g, *, max_length: int, buffer: int, penalty: float = 1.0) -> np.ndarray:
  """[G] float64 soft overlong punishment, added to each trajectory's reward: 0 up to the last
  `buffer` tokens of the budget, then falling linearly to -penalty at the budget.

  DAPO (arXiv 2503.14476) eq. 13 with L_max = max_length, L_cache = buffer, scaled by `penalty`:
      R(y) = 0                                        |y| <= L_max - L_cache
             penalty ((L_max - L_cache) - |y|) / L_cache   L_max - L_cache < |y| <= L_max
             -penalty                                 |y| > L_max
  Example (L_max 32, L_cache 8, penalty 1): lengths [10, 24, 25, 28, 32] -> [0, 0, -1/8, -1/2, -1].

  Args:
    lengths_g: [G] completion lengths |y| (tokens, EOS included).
    max_length: L_max >= 1, the completion budget.
    buffer: L_cache in [1, L_max].
    penalty: >= 0, the reward taken from a completion that fills the budget.

  Raises:
    ValueError: buffer outside [1, max_length] or penalty < 0.
  """
  if not 1 <= buffer <= max_length:
    raise ValueError(f"overlong_penalty: buffer={buffer!r} must lie in [1, max_length={max_length}]")
  if not penalty >= 0:
    raise ValueError(f"overlong_penalty: penalty={penalty!r} must be >= 0")
  lengths = np.asarray(lengths_g, np.float64)
  return -penalty * np.clip((lengths - (max_length - buffer)) / buffer, 0.0, 1.0)


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
                    clip_eps: float = 0.2, clip_eps_high: float | None = None, kl_coef: float = 0.0,
                    log_ratio: jax.Array | None = None, is_weight: jax.Array | None = None) -> tuple[jax.Array, dict]:
  """Per-token GRPO loss ℓ_t = -c_t min(r_t A, clip(r_t, 1-ε_low, 1+ε_high) A) + β k3_t, r_t = exp(logp - old_logp).

  PPO clipped surrogate (Schulman et al. 2017, arXiv 1707.06347 eq. 7) with the GRPO KL term
  (arXiv 2402.03300 eq. 3) and DAPO's decoupled clip range ("clip-higher", arXiv 2503.14476
  eq. 10: ε_high > ε_low lets low-probability tokens grow). Token-local: exact under replay for any
  tree. Example: r = 1.3, A = +1, ε = (0.2, 0.28): ℓ = -1.28 (clipped); r = 0.7, A = -1: ℓ = 0.8.

  Args:
    logp, old_logp, ref_logp: [..., T] float log-probs of the sampled tokens under the current,
      sampling and reference policies (old/ref are constants).
    advantages: broadcastable to logp, e.g. [..., 1].
    clip_eps: ε_low (and ε_high when clip_eps_high is None: the symmetric PPO clip).
    clip_eps_high: ε_high, or None.
    kl_coef: β (0 disables the KL term; ref_logp is then unused).
    log_ratio: log r_t in place of logp - old_logp (GSPO's `sequence_log_ratio`), or None.
    is_weight: c_t, the importance correction against the sampler (`correction.correct`: TIS, MIS,
      IcePop), a constant broadcastable to logp on the policy-gradient term only, or None (1).

  Returns:
    loss [..., T] and a dict of per-token metrics {"clipped": bool [..., T], "kl": [..., T]}.
  """
  old_logp = jax.lax.stop_gradient(old_logp)
  ref_logp = jax.lax.stop_gradient(ref_logp)
  high = clip_eps if clip_eps_high is None else clip_eps_high
  ratio = jnp.exp(logp - old_logp if log_ratio is None else log_ratio)
  unclipped = ratio * advantages
  clipped = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + high) * advantages
  kl = k3_kl(logp, ref_logp)
  surrogate = jnp.minimum(unclipped, clipped)
  if is_weight is not None:
    surrogate = jax.lax.stop_gradient(is_weight) * surrogate
  loss = -surrogate + kl_coef * kl
  return loss, {"clipped": clipped < unclipped, "kl": kl}


IMPORTANCE_RATIOS = ("token", "sequence")


def sequence_log_ratio(logp: jax.Array, old_logp: jax.Array, mask: jax.Array) -> jax.Array:
  """[..., T] log of GSPO's token-form ratio s_{i,t} = sg[s_i] π(y_t) / sg[π(y_t)], s_i = (π/π_old)^(1/|y_i|).

  GSPO (Zheng et al. 2025, arXiv 2507.18071) eq. 7 (s_i = exp((1/|y_i|) Σ_t log(π_t / π_old,t)))
  in the token form of its eq. 13 (GSPO-token): every token of completion i has the value log s_i
  and the gradient ∇logp_t, so s_i A_i (1/|y_i|) summed over the tokens has gradient A_i ∇s_i
  (eq. 11). Weighted by `trajectory_weights`' sequence_mean (1/(G |y_i|)) it is GSPO's objective;
  on-policy (old = sg(logp)) s_i = 1 and it equals the token ratio's GRPO in value and gradient.
  Couples a completion's tokens: the objective must see the whole completion (groups; a tree node
  sees a segment, so trees take it only on-policy, where it is the token ratio).

  Args:
    logp, old_logp: [..., T] log-probs (old is a constant); mask: [..., T] bool, the real tokens
      (|y_i| = their count; an empty completion gets log s = 0).
  """
  mask = jnp.asarray(mask, bool)
  d = jnp.where(mask, logp - jax.lax.stop_gradient(old_logp), 0.0)
  n = jnp.maximum(jnp.sum(mask, axis=-1, keepdims=True), 1).astype(d.dtype)
  seq = jnp.sum(d, axis=-1, keepdims=True) / n
  return jax.lax.stop_gradient(seq) + logp - jax.lax.stop_gradient(logp)


def weighted_logprob_loss(logp: jax.Array, weights: jax.Array) -> jax.Array:
  """-Σ_t w_t logp_t: the policy-gradient / SFT objective with per-token weights (e.g. w = A/|o|)."""
  return -jnp.sum(weights * logp)


def grpo_objective(logp: jax.Array, segment: Segments, *, clip_eps: float, kl_coef: float, on_policy: bool,
                   clip_eps_high: float | None = None, importance_ratio: str = "token") -> tuple[jax.Array, dict]:
  """GRPO loss of one segment's tokens, Σ_t Σ_g w[t, g] ℓ(logp_t, A_g) (`grpo_token_loss`), and its metric sums:
  a group's completion and a tree node alike (docs/design.md, "Losses on trees").

  A completion is a node with one trajectory. A tree node's token is shared by every trajectory g
  below it: it has one log-prob but one term per trajectory, so the surrogate is evaluated per
  (token, trajectory) pair, which keeps PPO-clip exact although it is non-linear in the advantage.

  Args:
    logp: [T] log-probs of the segment's tokens under the current parameters (0 on padding).
    segment: its `data.batches.Segments` row or slot: mask [T] bool; weights [T] (a completion:
      `token_weights`, 0 on padding) or [T, G] (a tree node: `trajectory_weights`[g] where trajectory g
      passes the token, else 0), an episode's also 0 on observation tokens (`data.episodes`);
      advantage [] or [T] (a completion; an episode's: A_g on model tokens, 0 on observations), [G] or
      [T, G] (a node); old_logp [T] (read unless on_policy); ref_logp [T] (read when kl_coef > 0);
      rollout_is (weights' shape) the sampler correction of each pair's policy-gradient term, or None.
    on_policy: the sampling policy is the current one (one update per batch): old_logp is
      stop_gradient(logp), so the ratio is exactly 1 and its gradient is ∇logp.
    clip_eps, clip_eps_high: ε_low, ε_high (`grpo_token_loss`).
    importance_ratio: "token" (PPO/GRPO's r_t) or "sequence" (GSPO's s_i, `sequence_log_ratio`; a
      completion's only: a tree node sees a segment of its trajectories).

  Returns:
    (loss, {"clipped": clipped (token, trajectory) pairs, "kl": Σ k3 over them}), both over the pairs
    the loss weighs (real tokens with weight > 0: a trajectory left out of the loss,
    `loss.mask_truncated`, adds to neither). A shared token counts once per trajectory through it, as
    the same trajectories laid out naive (prompt repeated) count it, so a tree step's metrics equal the
    naive step's; the loop divides both by the (token, trajectory) pairs.

  Raises:
    ValueError: an unknown importance_ratio, or "sequence" for a tree node.
  """
  if importance_ratio not in IMPORTANCE_RATIOS:
    raise ValueError(f"grpo_objective: importance_ratio={importance_ratio!r} is not one of {IMPORTANCE_RATIOS}")
  node = segment.weights.ndim == 2
  if node and importance_ratio == "sequence":
    raise ValueError("grpo_objective: importance_ratio='sequence' needs whole completions (weights [T]); a tree "
                     "node's weights [T, G] cover a segment of its trajectories")
  old = jax.lax.stop_gradient(logp) if on_policy else segment.old_logp
  ref = segment.ref_logp if kl_coef else jax.lax.stop_gradient(logp)
  w = segment.weights if node else segment.weights[:, None]                    # [T, G] or [T, 1]
  adv = segment.advantage
  adv = adv if adv.ndim == 2 else adv[None, :] if node else jnp.reshape(adv, (-1, 1))   # [T or 1, G or 1]
  on = (w > 0) & segment.mask[:, None]   # (token, trajectory) pairs: trajectory g passes real token t
  # GSPO's |y_i| and mean run over the tokens the loss weighs (an episode's model tokens, not its observations).
  log_ratio = sequence_log_ratio(logp, old, on[:, 0])[:, None] if importance_ratio == "sequence" else None
  c = segment.rollout_is
  c = c if c is None or node else c[:, None]
  loss, metrics = grpo_token_loss(logp[:, None], old[:, None], ref[:, None], adv, clip_eps=clip_eps,
                                  clip_eps_high=clip_eps_high, kl_coef=kl_coef, log_ratio=log_ratio, is_weight=c)
  return jnp.sum(w * loss), {"clipped": jnp.sum(metrics["clipped"] & on),
                             "kl": jnp.sum(jnp.where(on, metrics["kl"], 0.0))}


ROUTING_METRICS = ("router_aux", "routing_mismatch")


def grpo_aux_sums(aux) -> tuple[jax.Array, jax.Array, dict]:
  """(Σ k3 KL, Σ clipped, {name: Σ}) scalars (float32, float64 under x64) of a GRPO gradient's aux: a group's
  {"kl", "clipped"} from `grpo_objective` (also a stacked batch's), or a tree's per-level outputs whose `.aux` are
  `grpo_objective`'s (gradients.step.NodeOutputs). The dict holds the mixture-of-experts routing metrics the aux
  carries (ROUTING_METRICS: "router_aux", the load-balancing loss; "routing_mismatch", the share of recorded
  routes the router would not choose), each row's weighted by its share of its group's trajectories
  (`gradients.step`): summed, each group's mean over its trajectories, summed over groups. Traceable: the
  training step reduces inside its jit, so a multi-process run reads replicated scalars."""
  parts = [aux] if isinstance(aux, dict) else [level.aux for level in aux]
  total = lambda x: jnp.sum(x, dtype=jnp.promote_types(x.dtype, jnp.float32))   # float64 stays float64
  routing = {k: sum(total(p[k]) for p in parts) for k in ROUTING_METRICS if any(k in p for p in parts)}
  return sum(total(p["kl"]) for p in parts), sum(total(p["clipped"]) for p in parts), routing


ADVANTAGES = ("grpo", "rloo")


def load_balancing_loss(counts: jax.Array, probs: jax.Array, positions: jax.Array) -> jax.Array:
  """The mixture-of-experts auxiliary load-balancing loss of one sequence, E Σ_e f_e P_e (Fedus et al. 2021,
  "Switch Transformers", arXiv 2101.03961, eq. 4 with top-k routing; transformers' `load_balancing_loss_func`
  of Qwen3-MoE on the sequence alone, its attention mask, every layer's router logits concatenated):

      f_e = counts_e / positions   the fraction of (layer, token) pairs whose top k holds expert e,
      P_e = probs_e / positions    the mean router probability of e over them.

  Args:
    counts: [..., E] (layer, token) pairs choosing e (`models.llama.RouterStats.counts`, no gradient).
    probs: [..., E] sums of the router probabilities of e (`RouterStats.probs`; the gradient flows here).
    positions: [...] L · the sequence's real tokens (prompt and completion).

  Returns:
    [...] the loss in probs' dtype: k where routing is uniform (f_e = k/E, P_e = 1/E), up to E where every pair
    picks the same experts with all its probability on one of them.
  """
  n = jnp.maximum(positions, 1).astype(probs.dtype)[..., None]
  e = probs.shape[-1]
  return e * jnp.sum(jax.lax.stop_gradient(counts.astype(probs.dtype)) / n * (probs / n), axis=-1)


def rloo_advantages(rewards_g: jax.Array) -> jax.Array:
  """REINFORCE leave-one-out advantages A_i = r_i - (1/(G-1)) Σ_{j≠i} r_j = (G r_i - Σ_j r_j) / (G - 1).

  Ahmadian et al. 2024 ("Back to Basics", arXiv 2402.14740), section 3.2, the RLOO estimator
  (Kool et al. 2019): each sample's baseline is the mean reward of the other G - 1 samples of the
  same prompt. On a tree, the G trajectories (root-to-leaf paths) are the samples.

  Args:
    rewards_g: [..., G] rewards of one group (or a batch of groups on leading axes).

  Returns:
    [..., G] advantages, float32 (or float64 for float64 input); they sum to 0 over G, and are
    exactly 0 for a group of equal rewards (`constant_groups`; computed, G r_i - Σ_j r_j is a
    rounding residue: -1.27e-7 for sixteen float32 1.1).

  Raises:
    ValueError: if G < 2 (no other sample to form the baseline).
  """
  rewards_g = _as_float(rewards_g)
  g = rewards_g.shape[-1]
  if g < 2:
    raise ValueError(f"rloo_advantages: a group of G={g} rewards has no leave-one-out baseline; RLOO needs G >= 2")
  adv = (g * rewards_g - rewards_g.sum(axis=-1, keepdims=True)) / (g - 1)
  return jnp.where(constant_groups(rewards_g)[..., None], 0.0, adv)


PREFERENCE_LOSSES = ("sigmoid", "ipo", "ipo_sum")


def _positive_lengths(name: str, lengths) -> jax.Array:
  if lengths is None:
    raise ValueError(f"dpo_loss: loss_type='ipo' averages log-probs over tokens and needs {name} "
                     "(completion lengths in tokens); pass them, or use loss_type='ipo_sum'")
  if not isinstance(lengths, jax.core.Tracer) and np.any(np.asarray(lengths) < 1):
    raise ValueError(f"dpo_loss: {name}={np.asarray(lengths).tolist()} must all be >= 1 token")
  return jnp.asarray(lengths)


def dpo_loss(policy_chosen: jax.Array, policy_rejected: jax.Array, ref_chosen: jax.Array, ref_rejected: jax.Array, *,
             beta: float, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
             chosen_lengths: jax.Array | None = None,
             rejected_lengths: jax.Array | None = None) -> tuple[jax.Array, dict]:
  """Per-pair preference loss from per-sequence log-prob sums (log π(y|x) = Σ_t logp_t).

  With the log-ratio Δ(y) = log π(y|x) - log π_ref(y|x), h = Δ(y_w) - Δ(y_l), ε = label_smoothing
  and the per-token mean m(y) = Δ(y) / |y|:
    sigmoid: ℓ = (1 - ε) (-log σ(β h)) + ε (-log σ(-β h))
             DPO, Rafailov et al. 2023 (arXiv 2305.18290) eq. 7; with ε > 0 the conservative DPO
             of Mitchell 2023 ("A note on DPO with noisy preferences"), as TRL's label_smoothing:
             the label is taken to be flipped with probability ε.
    ipo:     ℓ = (m(y_w) - m(y_l) - 1/(2β))^2, on MEAN log-probs (the default IPO form).
    ipo_sum: ℓ = (h - 1/(2β))^2, on SUMS: Azar et al. 2023 (arXiv 2310.12036) eq. 17, τ = β.
  Why mean is the default IPO: the regression target 1/(2β) is a fixed number, but a sum-form h
  grows with the completions' lengths, so the same target asks for a large per-token change on
  short pairs and a negligible one on long pairs. TRL (loss_type="ipo" divides the log-probs by
  the completion length) and torchtune (IPOLoss expects average log-probs) settled on the mean.

  Example (beta 0.1): chosen 4 tokens, policy -1 and reference -1.5 per token (Δ = 2, m = 0.5);
  rejected 2 tokens, policy -2 and reference -1.5 (Δ = -1, m = -0.5): h = 3. sigmoid gives
  softplus(-0.3) = 0.554355, with ε = 0.1 0.9 * 0.554355 + 0.1 * softplus(0.3) = 0.584355; ipo
  (h_mean = 1) gives (1 - 5)^2 = 16 with dℓ/dh_mean = -8; ipo_sum gives (3 - 5)^2 = 4.

  The loss couples a sequence's tokens only through its sum (the mean is the sum over a constant
  length), so dℓ/dlogp_t = dℓ/dsum for every token t of that sequence: the exact two-pass replay
  gradient of preference.py holds for every loss_type.

  Args:
    policy_chosen, policy_rejected: [K] log-prob sums of the chosen (y_w) and rejected (y_l)
      completions of K pairs under the policy (differentiable).
    ref_chosen, ref_rejected: [K] the same under the frozen reference (constants).
    beta: β > 0 (DPO's KL strength; IPO's τ).
    loss_type: one of PREFERENCE_LOSSES.
    label_smoothing: ε in [0, 0.5), sigmoid only (conservative DPO); 0 is plain DPO.
    chosen_lengths, rejected_lengths: [K] completion lengths |y_w|, |y_l| in tokens (>= 1);
      required by "ipo", ignored otherwise.

  Returns:
    (loss [K], metrics) with metrics "chosen_reward" = β (log π(y_w) - log π_ref(y_w)) [K],
    "rejected_reward" [K] likewise, "margin" = their difference [K] (= β h) and "correct" =
    margin > 0 [K] bool (the implicit reward ranks the pair right), all without gradient and on
    sums for every loss_type.

  Raises:
    ValueError: unknown loss_type, beta <= 0, label_smoothing outside [0, 0.5) or non-zero with an
      IPO loss, "ipo" without (or with non-positive) lengths.
  """
  if loss_type not in PREFERENCE_LOSSES:
    raise ValueError(f"dpo_loss: loss_type={loss_type!r} is not one of {PREFERENCE_LOSSES}")
  if not beta > 0:
    raise ValueError(f"dpo_loss: beta={beta!r} must be > 0")
  if not 0 <= label_smoothing < 0.5:
    raise ValueError(f"dpo_loss: label_smoothing={label_smoothing!r} must lie in [0, 0.5)")
  if label_smoothing and loss_type != "sigmoid":
    raise ValueError(f"dpo_loss: label_smoothing={label_smoothing!r} applies to loss_type='sigmoid' only "
                     f"(conservative DPO), not {loss_type!r}; IPO has no label-noise form")
  ref_chosen, ref_rejected = jax.lax.stop_gradient(ref_chosen), jax.lax.stop_gradient(ref_rejected)
  chosen = policy_chosen - ref_chosen
  rejected = policy_rejected - ref_rejected
  h = chosen - rejected
  if loss_type == "sigmoid":
    loss = jax.nn.softplus(-beta * h)
    if label_smoothing:
      loss = (1.0 - label_smoothing) * loss + label_smoothing * jax.nn.softplus(beta * h)
  elif loss_type == "ipo":
    h_mean = (chosen / _positive_lengths("chosen_lengths", chosen_lengths)
              - rejected / _positive_lengths("rejected_lengths", rejected_lengths))
    loss = (h_mean - 1.0 / (2.0 * beta)) ** 2
  else:
    loss = (h - 1.0 / (2.0 * beta)) ** 2
  margin = jax.lax.stop_gradient(beta * h)
  return loss, {"chosen_reward": jax.lax.stop_gradient(beta * chosen),
                "rejected_reward": jax.lax.stop_gradient(beta * rejected), "margin": margin, "correct": margin > 0}


def gae(rewards_bt: jax.Array, values_bt: jax.Array, mask_bt: jax.Array, *, gamma: float, lam: float,
        truncated_b: jax.Array | None = None, next_values_b: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Generalized advantage estimates and value targets of trajectories, token by token.

  Schulman et al. 2015 (arXiv 1506.02438) eq. 16: δ_t = r_t + γ V(s_{t+1}) - V(s_t) and
  A_t = Σ_{l>=0} (γλ)^l δ_{t+l}, computed backwards as A_t = δ_t + γλ A_{t+1}; the value target is
  R_t = A_t + V(s_t). Token t is action t; V(s_t) is the value of the context before it.

  After a trajectory's last token (row b's last real position t_b):
    terminated (ended by EOS, the default): that state is terminal, V(s_{t_b+1}) = 0;
    truncated (cut by the token budget, `truncated_b[b]`): the episode did not end there, so the
      last δ bootstraps from the critic, V(s_{t_b+1}) = next_values_b[b] (the value of the
      context that includes the last token). Pardo et al. 2018 ("Time limits in reinforcement
      learning", arXiv 1712.00378), section 3, "partial-episode bootstrapping".
  A = 0 beyond the last token. Example (gamma 1, rewards 0, values [0.3, 0.5, 0.7], next value
  0.9): truncated gives A = [0.6, 0.4, 0.2] at λ = 1 and [0.542, 0.38, 0.2] at λ = 0.9;
  terminated gives [-0.3, -0.5, -0.7] and [-0.187, -0.43, -0.7]. A completion whose last token is
  EOS is terminated even when that EOS is the budget's last token: the flag must come from the
  sampler's stop reason (`sampling.Rollouts.truncated`, `tree_sampling.TreeRollout.truncated`),
  never from "the row fills the padded width".

  Args:
    rewards_bt: [B, T] per-token rewards (e.g. the task's reward on each trajectory's last token).
    values_bt: [B, T] V(s_t) predicted for every token.
    mask_bt: [B, T] bool, True on the real tokens; each row's real tokens are a prefix.
    gamma: γ in [0, 1], the discount per token.
    lam: λ in [0, 1] (λ = 1: Monte-Carlo returns minus V; λ = 0: one-step TD errors).
    truncated_b: [B] bool, True where the trajectory was cut by its token budget (not EOS), or
      None (every trajectory terminated).
    next_values_b: [B] V(s_{t_b+1}), the critic's value after each row's last token; read only
      on truncated rows; required with truncated_b.

  Returns:
    (advantages [B, T], returns [B, T]), float32 (float64 for float64 input), 0 on padding.

  Raises:
    ValueError: gamma or lam outside [0, 1], mismatched shapes, truncated_b without
      next_values_b (or the reverse).
  """
  if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
    raise ValueError(f"gae: gamma={gamma!r} and lam={lam!r} must lie in [0, 1]")
  rewards, values, mask = jnp.asarray(rewards_bt), jnp.asarray(values_bt), jnp.asarray(mask_bt, bool)
  if not rewards.shape == values.shape == mask.shape or rewards.ndim != 2:
    raise ValueError(f"gae: rewards {rewards.shape}, values {values.shape} and mask {mask.shape} must be equal [B, T]")
  if (truncated_b is None) != (next_values_b is None):
    raise ValueError("gae: truncated_b and next_values_b go together (a truncated row bootstraps from its next value)")
  b = rewards.shape[0]
  if truncated_b is None:
    truncated, boot = jnp.zeros(b, bool), jnp.zeros(b, values.dtype)
  else:
    truncated, boot = jnp.asarray(truncated_b, bool), jnp.asarray(next_values_b)
    if truncated.shape != (b,) or boot.shape != (b,):
      raise ValueError(f"gae: truncated_b {truncated.shape} and next_values_b {boot.shape} must be [B] = ({b},)")
  dtype = jnp.result_type(rewards.dtype, values.dtype, boot.dtype, jnp.float32)
  rewards, values, boot = rewards.astype(dtype), values.astype(dtype), boot.astype(dtype)
  next_mask = jnp.pad(mask[:, 1:], ((0, 0), (0, 1)))
  last = mask & ~next_mask
  next_values = jnp.pad(values[:, 1:], ((0, 0), (0, 1)))
  next_values = jnp.where(next_mask, next_values, jnp.where(last & truncated[:, None], boot[:, None], 0.0))
  deltas = jnp.where(mask, rewards + gamma * next_values - values, 0.0)

  def step(next_adv, xs):   # A_{t+1}, 0 past a trajectory's end
    delta, m = xs
    adv = jnp.where(m, delta + gamma * lam * next_adv, 0.0)
    return adv, adv

  _, adv = jax.lax.scan(step, jnp.zeros(b, dtype), (deltas.T, mask.T), reverse=True)
  adv = adv.T
  return adv, jnp.where(mask, adv + values, 0.0)


def ppo_token_loss(logp, old_logp, values, old_values, advantages, returns, *, clip_eps: float, vf_coef: float,
                   value_clip: float, is_weight: jax.Array | None = None) -> tuple[jax.Array, dict]:
  """Per-(token, trajectory) PPO actor-critic loss ℓ = ℓ_clip + c_v ℓ_V (arrays broadcast together).

  ℓ_clip = -min(r A, clip(r, 1-ε, 1+ε) A), r = exp(logp - old_logp)  (arXiv 1707.06347 eq. 7);
  ℓ_V = ½ (V - R)^2, or with value clipping ½ max((V - R)^2, (V_old + clip(V - V_old, -ε_V, ε_V) - R)^2)
  (the clipped value loss of OpenAI baselines' ppo2, as analysed by Engstrom et al. 2020, arXiv
  2005.12729 eq. 4); eq. 9 of 1707.06347 combines the two with c_v = vf_coef.

  Args:
    logp, values: current log-probs and values (differentiated).
    old_logp, old_values, advantages, returns: constants from the sampling-time policy and critic.
    clip_eps: ε; vf_coef: c_v >= 0; value_clip: ε_V (0 disables value clipping).
    is_weight: c_t, the importance correction against the sampler (`correction.correct`), a constant
      multiplying ℓ_clip only (the value loss regresses on returns, whatever policy drew them), as
      in `grpo_token_loss`; None: 1.

  Returns:
    loss and {"policy": c ℓ_clip, "value": ℓ_V, "clipped": bool (ratio clipped), "kl": k3(old || new)}.
  """
  old_logp, old_values, advantages, returns = (jax.lax.stop_gradient(x) for x in
                                               (old_logp, old_values, advantages, returns))
  ratio = jnp.exp(logp - old_logp)
  unclipped = ratio * advantages
  clipped = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
  policy = -jnp.minimum(unclipped, clipped)
  if is_weight is not None:
    policy = jax.lax.stop_gradient(is_weight) * policy
  value = jnp.square(values - returns)
  if value_clip:
    clipped_values = old_values + jnp.clip(values - old_values, -value_clip, value_clip)
    value = jnp.maximum(value, jnp.square(clipped_values - returns))
  value = 0.5 * value
  return policy + vf_coef * value, {"policy": policy, "value": value, "clipped": clipped < unclipped,
                                    "kl": k3_kl(old_logp, logp)}


def ppo_objective(logp: jax.Array, values: jax.Array, segment: Segments, *, clip_eps: float, vf_coef: float,
                  value_clip: float) -> tuple[jax.Array, dict]:
  """PPO loss of one segment's tokens, Σ_t Σ_g w[t, g] ℓ(logp_t, V_t, A[t, g], R[t, g]) (`ppo_token_loss`): a
  group's completion and a tree node alike.

  A completion is a node with one trajectory. A shared tree token has one log-prob and one value (one
  context) but, below it, one advantage and one return per trajectory g (GAE runs along each
  trajectory): the loss sums per (token, trajectory) pair (docs/design.md, "Losses on trees"), which
  is exact although ℓ is non-linear in A, R.

  Args:
    logp, values: [T] current log-probs and values of the segment's tokens (0 on padding).
    segment: its `data.batches.Segments` row or slot: mask [T], old_logp [T], old_values [T]; weights,
      advantage, returns [T] (a completion) or [T, G] (a node: `trajectory_weights`[g] where
      trajectory g passes, else 0); rollout_is (weights' shape) the sampler correction of each pair's
      policy term (loss.rollout_correction), or None.

  Returns:
    (loss, sums over pairs with w > 0: {"policy": Σ w ℓ_clip, "value": Σ w ℓ_V, "clipped": count,
    "kl": Σ k3(old || new)}).
  """
  if segment.weights.ndim == 1:   # a completion: one trajectory
    per_pair = ("weights", "advantage", "returns") + (() if segment.rollout_is is None else ("rollout_is",))
    segment = segment.replace(**{k: getattr(segment, k)[:, None] for k in per_pair})
  loss, m = ppo_token_loss(logp[:, None], segment.old_logp[:, None], values[:, None], segment.old_values[:, None],
                           segment.advantage, segment.returns, clip_eps=clip_eps, vf_coef=vf_coef,
                           value_clip=value_clip, is_weight=segment.rollout_is)
  w = segment.weights
  on = (w > 0) & segment.mask[:, None]
  return jnp.sum(w * loss), {"policy": jnp.sum(w * m["policy"]), "value": jnp.sum(w * m["value"]),
                             "clipped": jnp.sum(m["clipped"] & on), "kl": jnp.sum(jnp.where(on, m["kl"], 0.0))}
