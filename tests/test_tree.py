"""Rollout groups: validation, padding and counts (checked by brute force)."""

import numpy as np
import pytest

from branch_replay_jax.data.counts import group_counts
from branch_replay_jax.data.groups import bucket_length, group_from_padded, make_group
from branch_replay_jax.models import tiny_config

KW = dict(vocab_size=64, max_positions=64)


def test_make_group_pads_and_masks():
  g = make_group([5, 6, 7], [[1], [2, 3, 4]], **KW, pad_id=9)
  assert g.prompt_len == 3 and g.prompt_ids.shape == (16,)
  np.testing.assert_array_equal(g.lengths, [1, 3])
  assert g.completion_ids.shape == (2, 8)
  np.testing.assert_array_equal(g.completion_ids[1, :4], [2, 3, 4, 9])
  np.testing.assert_array_equal(g.completion_mask.sum(1), [1, 3])
  np.testing.assert_array_equal(g.prompt_mask[:4], [True, True, True, False])


@pytest.mark.parametrize("prompt,completions,match", [
    ([1, 2], [], "completions is empty"),
    ([], [[1]], "prompt_ids must be a non-empty"),
    ([1, 2], [[1], []], r"completions\[1\] must be a non-empty"),
    ([1, 2], [[1, 64]], r"completions\[0\] holds token id 64 outside \[0, 64\)"),
    ([-1, 2], [[1]], "prompt_ids holds token id -1"),
    ([1] * 40, [[1] * 30], "exceeds the model's max_positions=64"),
    ([1.5, 2.0], [[1]], "integer token ids"),
])
def test_make_group_rejects_bad_input(prompt, completions, match):
  with pytest.raises(ValueError, match=match):
    make_group(prompt, completions, **KW)


def test_group_from_padded_validation():
  ids = np.ones((3, 5), dtype=np.int32)
  assert group_from_padded([1], ids, [1, 5, 2], **KW).lengths.tolist() == [1, 5, 2]
  with pytest.raises(ValueError, match="lengths has shape"):
    group_from_padded([1], ids, [1, 2], **KW)
  with pytest.raises(ValueError, match="must lie in"):
    group_from_padded([1], ids, [1, -2, 1], **KW)
  with pytest.raises(ValueError, match="must lie in"):
    group_from_padded([1], ids, [1, 6, 1], **KW)
  with pytest.raises(ValueError, match="completion_bucket=2"):
    make_group([1], [[1, 2, 3]], **KW, completion_bucket=2)


def test_bucket_length_is_a_power_of_two_at_least_the_length():
  assert [bucket_length(n) for n in (1, 16, 17, 100)] == [16, 16, 32, 128]


def test_segment_buckets_step_by_an_eighth_of_the_octave_and_at_least_8_tokens():
  # Between 512 and 1024 the buckets are multiples of 64 (704 is one, 705 pads to 768: < 1/8
  # padding against 1024's 31%); below 64 the step is 8 tokens (9 -> 16, 17 -> 24), so there are
  # at most 8 buckets per doubling; powers of two stay buckets.
  got = [bucket_length(n, minimum=8, per_octave=8) for n in (1, 8, 9, 17, 64, 65, 100, 704, 705, 1024, 1025)]
  assert got == [8, 8, 16, 24, 64, 72, 104, 704, 768, 1024, 1152]
  assert len({bucket_length(n, minimum=8, per_octave=8) for n in range(513, 1025)}) == 8


def test_counts_against_brute_force():
  cfg = tiny_config()
  p, lengths = 7, [1, 4, 2]
  # Brute force: enumerate every (sequence, position) and every causal (query, key) pair.
  naive_positions = sum(p + t for t in lengths)
  naive_pairs = sum(sum(i + 1 for i in range(p + t)) for t in lengths)
  replay_pairs = sum(i + 1 for i in range(p)) + sum(sum(p + i + 1 for i in range(t)) for t in lengths)
  counts = group_counts(p, lengths, cfg)
  assert counts["token_positions_naive"] == naive_positions == 28
  assert counts["token_positions_computed"] == p + sum(lengths) == 14
  lin = 2 * (cfg.params_per_token_linear - cfg.d_model * cfg.vocab_size)
  pair = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim
  head = 2 * cfg.d_model * cfg.vocab_size * sum(lengths)
  want = (lin * naive_positions + pair * naive_pairs + head) / (lin * 14 + pair * replay_pairs + head)
  assert counts["ideal_flop_ratio"] == pytest.approx(want, rel=1e-12)
  # G=1 shares nothing: the ratio is exactly 1.
  assert group_counts(p, [5], cfg)["ideal_flop_ratio"] == pytest.approx(1.0)
