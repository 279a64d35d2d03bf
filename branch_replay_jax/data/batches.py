"""Device-array layouts of rollout groups and trees: what the gradient and log-prob steps consume.

    group_arrays(group, **extras)  ->  {"prompt_ids": [P_pad] int32, "prompt_len": int32 scalar,
                                        "branches": {"tokens": [G, T] int32, "mask": [G, T] bool,
                                                     **extras: [G, ...] (e.g. "weights" [G, T],
                                                     "advantage" [G], "old_logp" [G, T], "ref_logp" [G, T])}}
    tree_arrays(padded, per_node, **shared)  ->  {"prompt_ids", "prompt_len",
                                                  "levels": [per level d = 1..D: {"tokens" [F_1..F_d, T_d] int32,
                                                  "mask" [F_1..F_d, T_d] bool, per-node fields [F_1..F_d, T_d, ...],
                                                  shared fields [F_1..F_d, ...]}]}
    trajectory_group_arrays(tree, ...)  ->  group_arrays of the tree's trajectories (the naive layout)

The branch and node dicts are what the objectives (losses.py) read by field name.
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np

from branch_replay_jax.data.groups import RolloutGroup, make_group
from branch_replay_jax.data.trees import PaddedTree, RolloutTree


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
