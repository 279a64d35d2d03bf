"""Token-position and FLOP counts of a rollout group or tree: what the naive step computes versus replay.

All counts are over real tokens (padding excluded). The FLOP model (`ideal_flop_ratio`) is one
formula for groups and trees: a group is a tree of depth 1 (the prompt and G leaves).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from branch_replay_jax.data.trees import RolloutTree


def forward_flops(config, path_lengths, segment_lengths, segment_offsets) -> tuple[int, int]:
  """(naive, replay) forward FLOPs of one rollout tree (a group: the prompt and G one-segment leaves).

  Per position, 2·N_lin FLOPs of the dense layers (N_lin multiply-adds: `params_per_token_linear`
  without the output head); 4·L·Hq·D per visible (query, key) pair for QKᵀ and PV; the output
  head (2·d·V) at every scored (completion) position. A sequence of n tokens has n(n+1)/2 causal pairs.

    naive : each trajectory from scratch: Σ_g [lin·|path_g| + pair·|path_g|(|path_g|+1)/2 + head·|o_g|]
    replay: each segment once on its ancestors: Σ_n [lin·L_n + pair·(L_n o_n + L_n(L_n+1)/2)] + head·Σ_{n>0} L_n

  A training step's model FLOPs are 3x these (the backward pass costs twice the forward: Kaplan et
  al. 2020, arXiv 2001.08361, section 2.1, C ≈ 6N per token; Chowdhery et al. 2022, PaLM, arXiv
  2204.02311, appendix B, which defines MFU by them), not counting rematerialisation.

  Args:
    config: the model's dimensions (a models.ModelConfig; data/ does not import models/).
    path_lengths: [G] tokens of each trajectory including the prompt, |path_g| = P + |o_g|.
    segment_lengths: [N] tokens of each segment, the prompt first (L_0 = P).
    segment_offsets: [N] absolute position of each segment's first token (o_0 = 0).

  Returns:
    (naive, replay): Python ints, FLOPs of one forward pass (multiply and add counted apart).
  """
  paths = np.asarray(path_lengths, np.int64)
  lens = np.asarray(segment_lengths, np.int64)
  offsets = np.asarray(segment_offsets, np.int64)
  lin = 2 * (config.params_per_token_linear - config.d_model * config.vocab_size)
  pair = 4 * config.num_layers * config.num_heads * config.head_dim
  head = 2 * config.d_model * config.vocab_size
  tri = lambda n: n * (n + 1) // 2
  naive = lin * paths.sum() + pair * tri(paths).sum() + head * (paths - lens[0]).sum()
  replay = lin * lens.sum() + pair * (lens * offsets + tri(lens)).sum() + head * lens[1:].sum()
  return int(naive), int(replay)


def ideal_flop_ratio(config, path_lengths, segment_lengths, segment_offsets) -> float:
  """Naive FLOPs / replay FLOPs of one rollout tree, by `forward_flops`'s model (its arguments).

  Forward and backward both scale with these counts, so the ratio is that of a training step too.
  """
  naive, replay = forward_flops(config, path_lengths, segment_lengths, segment_offsets)
  return float(naive) / float(replay)


def group_counts(prompt_len: int, lengths: Sequence[int], config=None) -> dict:
  """Token-position and FLOP counts of one group, naive versus replay (real tokens, no padding).

  token_positions_naive = Σ_g (P + T_g): positions the naive step computes (prompt repeated).
  token_positions_computed = P + Σ_g T_g: positions replay computes (each unique one once).
  ideal_flop_ratio, naive_forward_flops, replay_forward_flops (with a model config): `forward_flops`
  of the depth-1 tree and their ratio; a completion of T_g tokens on a P-token prompt has
  T_g·P + T_g(T_g+1)/2 attention pairs.
  """
  lengths = np.asarray(lengths, dtype=np.int64)
  p = int(prompt_len)
  out = {
      "token_positions_naive": int(np.sum(p + lengths)),
      "token_positions_computed": int(p + lengths.sum()),
  }
  if config is not None:
    out.update(_flop_counts(config, p + lengths, np.concatenate([[p], lengths]),
                            np.concatenate([[0], np.full(lengths.shape, p)])))
  return out


def tree_counts(tree: RolloutTree, config=None) -> dict:
  """`group_counts` for a tree: every distinct token position computed once.

  token_positions_naive = Σ_g |path(g)| (each trajectory from scratch); token_positions_computed =
  Σ_n L_n. Attention pairs: naive Σ_g |path(g)|(|path(g)|+1)/2, tree Σ_n L_n o_n + L_n(L_n+1)/2.
  """
  lens = np.array([len(s) for s in tree.segments], np.int64)
  paths = np.array([int(lens[0]) + int(c) for c in tree.completion_lengths()], np.int64)
  out = {"token_positions_naive": int(paths.sum()), "token_positions_computed": int(lens.sum())}
  if config is not None:
    out.update(_flop_counts(config, paths, lens, tree.offsets()))
  return out


def _flop_counts(config, paths, lens, offsets) -> dict:
  naive, replay = forward_flops(config, paths, lens, offsets)
  return {"ideal_flop_ratio": ideal_flop_ratio(config, paths, lens, offsets), "naive_forward_flops": naive,
          "replay_forward_flops": replay}
