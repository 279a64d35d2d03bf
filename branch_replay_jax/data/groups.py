"""Rollout groups: a prompt and G ragged completions, bucketed to fixed shapes.

Layout of a group (P prompt tokens, G completions padded to T = bucket(max length)):

    prompt_ids   [P_pad]   p0 p1 p2 p3 .  .          (P = 4 real tokens, padded to P_pad)
    completion_ids [G, T]  a0 a1 a2 .  .  .          ('.' = pad_id, completion_mask False)
                           b0 .  .  .  .  .
                           c0 c1 c2 c3 c4 c5

The completion's token i sits at absolute position P + i; its log-prob comes from the hidden
state at position P + i - 1, i.e. the prompt's LAST real position for i = 0.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


SEGMENT_BUCKETS_PER_OCTAVE = 8
"""Buckets per doubling of a tree level's (and an episode row's) length: less than 1/8 of a segment's
positions (or 8 tokens) are padding, against up to 1/2 with powers of two, for at most 8 lengths per
doubling."""


def bucket_length(n: int, *, minimum: int = 16, per_octave: int = 1) -> int:
  """The smallest bucket >= max(n, minimum): few distinct shapes, so few XLA compiles.

  per_octave = 1: powers of two (minimum times 2^k). per_octave = k > 1: between two consecutive
  powers of two b/2 < n <= b, the multiples of max((b/2) / k, 8) as well (at most k buckets per
  doubling, steps of at least 8 tokens), so the padding is below 1/k of the bucket or 8 tokens
  (`SEGMENT_BUCKETS_PER_OCTAVE` for tree levels and episode rows).
  Example: n = 704, minimum 8: 1024 with per_octave 1, 704 with per_octave 8.
  """
  b = minimum
  while b < n:
    b *= 2
  low = b // 2
  if per_octave == 1 or low < minimum:
    return b
  step = max(8, low // per_octave)
  return min(b, low + -(-(n - low) // step) * step)


@dataclasses.dataclass(frozen=True)
class RolloutGroup:
  """One prompt and its G completions as padded host arrays.

  prompt_ids: [P_pad] int32, the prompt right-padded with pad_id.
  prompt_len: P, real prompt tokens (>= 1).
  completion_ids: [G, T] int32, right-padded with pad_id.
  completion_mask: [G, T] bool, True on real completion tokens.
  lengths: [G] int32 completion lengths (tokens).
  """

  prompt_ids: np.ndarray
  prompt_len: int
  completion_ids: np.ndarray
  completion_mask: np.ndarray
  lengths: np.ndarray

  @property
  def num_completions(self) -> int:
    return self.completion_ids.shape[0]

  @property
  def prompt_mask(self) -> np.ndarray:
    return np.arange(self.prompt_ids.shape[0]) < self.prompt_len


def check_token_ids(prompt: np.ndarray, completions: Sequence[np.ndarray], *, vocab_size: int, max_positions: int,
                    where: str, name: str = "completions") -> None:
  """ValueError (naming `where` and the sequence) unless every id of the prompt and completions is an
  integer in [0, vocab_size) and the prompt plus each completion fits max_positions: what every
  layout checks before an id reaches the embedding (an id past the table, or a position past the
  model's, gives NaN or garbage instead of an error)."""
  for label, arr in [("prompt_ids", prompt)] + [(f"{name}[{i}]", c) for i, c in enumerate(completions)]:
    if not np.issubdtype(arr.dtype, np.integer):
      raise ValueError(f"{where}: {label} must hold integer token ids, got dtype {arr.dtype}")
    bad = arr[(arr < 0) | (arr >= vocab_size)]
    if bad.size:
      raise ValueError(f"{where}: {label} holds token id {int(bad[0])} outside [0, {vocab_size})")
  lengths = [c.size for c in completions]
  if prompt.size + max(lengths) > max_positions:
    i = int(np.argmax(lengths))
    raise ValueError(f"{where}: prompt ({prompt.size} tokens) + {name}[{i}] ({lengths[i]} tokens) exceeds the "
                     f"model's max_positions={max_positions}")


def make_group(prompt_ids: Sequence[int], completions: Sequence[Sequence[int]], *, vocab_size: int,
               max_positions: int, pad_id: int = 0, prompt_bucket: int | None = None,
               completion_bucket: int | None = None) -> RolloutGroup:
  """Validate and pad a prompt and its completions into a `RolloutGroup`.

  Args:
    prompt_ids: the prompt's token ids (>= 1 token).
    completions: G >= 1 completions, each a sequence of >= 1 token ids.
    vocab_size, max_positions: the model's vocabulary size and context length (tokens).
    pad_id: filler id for padding (any valid id; padding is masked everywhere).
    prompt_bucket / completion_bucket: padded lengths; default `bucket_length` of the longest.

  Raises:
    ValueError: naming the offending field: no completions, an empty prompt or completion, an id
      outside [0, vocab_size), a sequence longer than max_positions, a bucket shorter than the data.
  """
  prompt = np.asarray(prompt_ids)
  if prompt.ndim != 1 or prompt.size == 0:
    raise ValueError(f"make_group: prompt_ids must be a non-empty 1-D sequence, got shape {prompt.shape}")
  if len(completions) == 0:
    raise ValueError("make_group: completions is empty; a group needs at least one completion")
  comps = [np.asarray(c) for c in completions]
  for i, c in enumerate(comps):
    if c.ndim != 1 or c.size == 0:
      raise ValueError(f"make_group: completions[{i}] must be a non-empty 1-D sequence, got shape {c.shape}")
  check_token_ids(prompt, comps, vocab_size=vocab_size, max_positions=max_positions, where="make_group")
  lengths = np.array([c.size for c in comps], dtype=np.int32)
  p = prompt.size
  p_pad = prompt_bucket if prompt_bucket is not None else bucket_length(p)
  t_pad = completion_bucket if completion_bucket is not None else bucket_length(int(lengths.max()), minimum=8)
  if p_pad < p:
    raise ValueError(f"make_group: prompt_bucket={p_pad} is shorter than the prompt ({p} tokens)")
  if t_pad < lengths.max():
    raise ValueError(f"make_group: completion_bucket={t_pad} is shorter than the longest completion "
                     f"({lengths.max()} tokens)")
  ids = np.full((len(comps), t_pad), pad_id, dtype=np.int32)
  for i, c in enumerate(comps):
    ids[i, :c.size] = c
  mask = np.arange(t_pad)[None, :] < lengths[:, None]
  prompt_pad = np.full((p_pad,), pad_id, dtype=np.int32)
  prompt_pad[:p] = prompt
  return RolloutGroup(prompt_pad, p, ids, mask, lengths)


def group_from_padded(prompt_ids: Sequence[int], completion_ids, lengths, **kwargs) -> RolloutGroup:
  """`make_group` from padded sampler output: completion_ids [G, T] and lengths [G].

  Raises:
    ValueError: mismatched G between completion_ids and lengths, a negative length or one
      longer than T, plus everything `make_group` raises.
  """
  ids = np.asarray(completion_ids)
  lengths = np.asarray(lengths)
  if ids.ndim != 2:
    raise ValueError(f"group_from_padded: completion_ids must be [G, T], got shape {ids.shape}")
  if lengths.shape != (ids.shape[0],):
    raise ValueError(f"group_from_padded: lengths has shape {lengths.shape}, completion_ids has G={ids.shape[0]}")
  if np.any(lengths < 0) or np.any(lengths > ids.shape[1]):
    raise ValueError(f"group_from_padded: lengths {lengths.tolist()} must lie in [0, T={ids.shape[1]}]")
  return make_group(prompt_ids, [row[:n] for row, n in zip(ids, lengths)], **kwargs)
