"""Importance correction against the sampler's log-probs: TIS, MIS and IcePop (loss.rollout_correction;
docs/design.md, "Rollout correction").

The sampler that drew a batch and the trainer that scores it give the same tokens different
log-probs: another dtype (a bfloat16 sampler, a float32 trainer), another engine or batch shape,
and with staleness another policy version. The policy gradient then samples from π_sampler where
it assumes π_old, the trainer's policy at the sampling step. The correction weighs each
(token, trajectory) pair's policy-gradient term by a constant c(ρ) of the ratio

    ρ = π_old(y) / π_sampler(y),

on top of PPO/GRPO's clip of π/π_old, which is unchanged; the KL term is not weighed (TRL's
GRPOTrainer and verl apply the factor to the policy-gradient loss only):

    tis     c = min(ρ, C)                 truncated IS: Yao et al. 2025, "Your Efficient RL Framework
                                          Secretly Brings You Off-Policy RL Training"; TRL #4530
    mis     c = ρ · 1[1/C <= ρ <= C]      masked IS: Liu, Li et al. 2025, "When Speed Kills Stability:
                                          Demystifying RL Collapse from the Training-Inference Mismatch"
    icepop  c = ρ · 1[α <= ρ <= C]        IcePop: Ling Team 2025, "Every Step Evolves" (Ring-1T,
                                          arXiv 2510.18855), section 3.1; token level only

C is loss.rollout_is_cap, α loss.rollout_is_floor. Level "token": ρ_t = exp(old_t - sampler_t), one
per token. Level "sequence": ρ_g = exp(Σ_t (old_t - sampler_t)) over trajectory g's loss tokens, the
same on each of them. On a tree a shared token has one sampler log-prob (the one sample that drew
it) and one trainer log-prob, so its token ratio is every trajectory's through it, and a
trajectory's sequence ratio sums its path's nodes: the factors, like the metrics, are those of the
same trajectories laid out as naive rows.

`correct` computes the factors in a batch's own layout (group rows, tree levels, packed rows) into
`Segments.rollout_is`, which `losses.grpo_objective` reads; the caller supplies the trainer's
`old_logp` (one forward, `grpo.update_on_batch`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from branch_replay_jax.data.batches import PackedBatch, RolloutBatch, Segments, is_group

CORRECTIONS = ("none", "tis", "mis", "icepop")
LEVELS = ("token", "sequence")
# The metrics `correct` returns (and the loop logs), each over the (token, trajectory) pairs of the loss.
METRICS = ("is_ratio_mean", "is_ratio_max", "is_masked_frac", "sampler_logp_diff_mean")


@dataclasses.dataclass(frozen=True)
class Correction:
  """loss.rollout_correction's settings: mode (one of CORRECTIONS), level (one of LEVELS), cap C > 1,
  floor α in (0, 1) (IcePop's lower bound)."""
  mode: str
  level: str = "token"
  cap: float = 2.0
  floor: float = 0.5

  def __post_init__(self):
    if self.mode not in CORRECTIONS:
      raise ValueError(f"loss.rollout_correction={self.mode!r} is not one of {CORRECTIONS}")
    if self.level not in LEVELS:
      raise ValueError(f"loss.rollout_correction_level={self.level!r} is not one of {LEVELS}")
    if not 1.0 < self.cap < float("inf"):
      raise ValueError(f"loss.rollout_is_cap={self.cap!r} must be a finite float > 1 (the ratio's upper bound C)")
    if not 0.0 < self.floor < 1.0:
      raise ValueError(f"loss.rollout_is_floor={self.floor!r} must be a float in (0, 1) (IcePop's lower bound)")
    if self.mode == "icepop" and self.level == "sequence":
      raise ValueError("loss.rollout_correction='icepop' with loss.rollout_correction_level='sequence': IcePop "
                       "masks tokens (arXiv 2510.18855); use level 'token', or 'mis' for sequences")

  @property
  def active(self) -> bool:
    return self.mode != "none"


def factor(log_ratio: jax.Array, correction: Correction) -> tuple[jax.Array, jax.Array]:
  """(c(ρ), masked) of log ρ elementwise (module docstring): float like log_ratio, and bool, True where
  MIS / IcePop mask the ratio out (never for TIS). ρ = exp(log_ratio) may overflow to inf at sequence
  level: TIS then gives C and MIS masks it."""
  ratio = jnp.exp(log_ratio)
  if correction.mode == "tis":
    return jnp.minimum(ratio, correction.cap), jnp.zeros(ratio.shape, bool)
  low = 1.0 / correction.cap if correction.mode == "mis" else correction.floor
  keep = (ratio >= low) & (ratio <= correction.cap)
  return jnp.where(keep, ratio, 0.0), ~keep


def _parts(batch) -> list[tuple[Segments, int | None]]:
  """Each Segments of `batch` and, for those whose fields carry a trajectory axis G, how many axes before
  G belong to one tree (a level d's slots F_1..F_d and T; a packed row's T); None for group rows."""
  if is_group(batch):
    return [(batch.branches, None)]
  if isinstance(batch, PackedBatch):
    return [(batch.row, 1)]
  return [(level, d + 1) for d, level in enumerate(batch.levels, start=1)]


def has_sampler_logprobs(batch) -> bool:
  """Whether every segment of `batch` carries the sampler's log-probs (groups, trees and episodes do)."""
  return all(seg.sampler_logp is not None for seg, _ in _parts(batch))


def _with(batch, parts: list[Segments]):
  """`batch` with `_parts`' segments replaced (a group's one level is its rows)."""
  if isinstance(batch, PackedBatch):
    return batch.replace(row=parts[0])
  return batch.replace(levels=tuple(parts))


def correct(batch: RolloutBatch | PackedBatch, correction: Correction):
  """The batch with `rollout_is` set to each (token, trajectory) pair's factor c(ρ) (0 off the loss),
  and the metrics {METRICS: scalar} over the pairs the loss weighs (weight > 0 on a real token): the
  mean and max of ρ at the correction's level, the fraction of pairs masked out, and the mean
  |log π_old - log π_sampler| per token. Every figure counts a shared token once per trajectory
  through it, so a tree's equal its naive rows'. Traceable (jit it on a mesh).

  Args:
    batch: any layout with weights, old_logp (the trainer's, at the sampling step's parameters) and
      sampler_logp (the sampler's) set on every segment; a stack of B problems on leading axes.
    correction: the settings (mode "none" computes the metrics and leaves rollout_is None).

  Raises:
    ValueError: a segment without old_logp or sampler_logp.
  """
  parts = _parts(batch)
  for seg, _ in parts:
    if seg.old_logp is None or seg.sampler_logp is None:
      raise ValueError("correct: the batch needs old_logp (the trainer's log-probs) and sampler_logp (the "
                       "sampler's) on every segment")
  pairs, diffs = [], []
  for seg, axes in parts:
    d = seg.old_logp - seg.sampler_logp                              # [..., T] per token
    node = axes is not None
    on = (seg.weights > 0) & (seg.mask[..., None] if node else seg.mask)
    pairs.append(on)
    diffs.append(jnp.broadcast_to(d[..., None], on.shape) if node else d)
  if correction.level == "sequence":
    sums = []                                                        # each trajectory's Σ_t log ρ_t over its loss tokens
    for (seg, axes), on, d in zip(parts, pairs, diffs):
      masked = jnp.where(on, d, 0.0)
      sums.append(jnp.sum(masked, axis=-1) if axes is None else
                  jnp.sum(masked, axis=tuple(range(-axes - 1, -1))))    # [..., L] rows; [..., G] trees
    total = sum(sums[1:], sums[0])
    log_ratios = [jnp.broadcast_to(total[..., None] if axes is None else
                                   jnp.reshape(total, total.shape[:-1] + (1,) * axes + total.shape[-1:]), on.shape)
                  for (_, axes), on in zip(parts, pairs)]
  else:
    log_ratios = diffs
  count = sum(jnp.sum(on) for on in pairs)
  n = jnp.maximum(count, 1).astype(diffs[0].dtype)
  new, ratio_sum, ratio_max, masked_sum, diff_sum = [], 0.0, 0.0, 0.0, 0.0
  for (seg, _), on, d, lr in zip(parts, pairs, diffs, log_ratios):
    if correction.active:
      c, masked = factor(lr, correction)
      seg = seg.replace(rollout_is=jax.lax.stop_gradient(jnp.where(on, c, 0.0).astype(seg.weights.dtype)))
    else:   # the metrics alone: no factor, the loss as without a correction bit for bit
      masked = jnp.zeros(lr.shape, bool)
    new.append(seg)
    ratio = jnp.where(on, jnp.exp(lr), 0.0)
    ratio_sum, ratio_max = ratio_sum + jnp.sum(ratio), jnp.maximum(ratio_max, jnp.max(ratio, initial=0.0))
    masked_sum = masked_sum + jnp.sum(on & masked)
    diff_sum = diff_sum + jnp.sum(jnp.where(on, jnp.abs(d), 0.0))
  return _with(batch, new), dict(zip(METRICS, (ratio_sum / n, ratio_max, masked_sum / n, diff_sum / n)))
