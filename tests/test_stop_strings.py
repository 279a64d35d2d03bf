"""Stop strings (rollout.stop_strings): matched exactly on the decoded text inside the jitted decode
loop of the group and tree samplers, with the stop reason recorded ("eos", "stop_string", "length")."""

import re

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import grpo_smoke

from branch_replay_jax.algorithms import groups, schema
from branch_replay_jax.algorithms.checks import validate_common
from branch_replay_jax.algorithms.schema import layout_of, parse
from branch_replay_jax.models import Llama, tiny_config
from branch_replay_jax.rollout.collect import Trajectories
from branch_replay_jax.rollout.sampler import sample_group
from branch_replay_jax.rollout.stop_strings import MATCHED, build_stop_table, stop_table, token_bytes
from branch_replay_jax.rollout.tree_sampler import sample_tree

PROMPT = [3, 17, 42, 8, 9, 60, 1]
# A 64-token vocabulary whose token t decodes to "t|" ("17|", "4|"): tokens of 2 and 3 bytes, so a
# stop string can start and end inside a token and span several.
VOCAB = [f"{t}|".encode() for t in range(64)]


@pytest.fixture(scope="module")
def model():
  return Llama(tiny_config(), rngs=nnx.Rngs(0))


def text_of(ids) -> bytes:
  return b"".join(VOCAB[int(t)] for t in ids)


def first_stop(ids, stop: str, eos=()) -> tuple[int, str]:
  """The naive reference: decode after every token; (length, reason) of the first token that is an
  EOS id or after which the decoded text contains `stop`; (len(ids), "length") when none does."""
  for i, t in enumerate(ids):
    if int(t) in eos:
      return i + 1, "eos"
    if stop.encode() in text_of(ids[:i + 1]):
      return i + 1, "stop_string"
  return len(ids), "length"


def test_table_follows_the_decoded_text_across_tokens():
  # "</answer>" in the tokenizations "</" "answer" ">" and "</answ" "er>\n": the state after "</" is
  # the 2-byte prefix (state 2 of the prefixes "", "<", "</", ..., ordered by length); "answer" from
  # there reaches "</answer" (state 8); ">" then completes it (MATCHED), and so does "er>\n" from
  # "</answ" (state 6) although its last byte lies past the match. "x" resets to the empty prefix.
  vocab = [b"</", b"answer", b">", b"er>\n", b"x", b""]
  t = build_stop_table(["</answer>"], vocab)
  assert t.num_states == 9 and t.next_state.shape == (16, 6)
  assert t.next_state[0, 0] == 2 and t.next_state[2, 1] == 8 and t.next_state[8, 2] == MATCHED
  assert t.next_state[6, 3] == MATCHED and t.next_state[8, 4] == 0 and t.next_state[5, 5] == 5
  assert t.next_state[0, 3] == 0   # "er>\n" alone: no prefix of "</answer>" ends it


def test_token_bytes_concatenate_to_the_decoded_text():
  # SmolLM2's byte-level BPE: the bytes of the tokens of a text with multi-byte characters and
  # special tokens join to tokenizer.decode(..., skip_special_tokens=True) exactly (its specials add "").
  from branch_replay_jax.models.loading import load_tokenizer
  tok = load_tokenizer("smollm2-135m-instruct")
  vb = token_bytes(tok)
  assert len(vb) == len(tok) and vb[tok.eos_token_id] == b""
  text = "Résumé: 3 + 4 = 7 <answer>7</answer>\n日本 ok"
  ids = [1] + tok.encode(text, add_special_tokens=False) + [2]
  assert b"".join(vb[i] for i in ids).decode("utf-8") == tok.decode(ids, skip_special_tokens=True) == text
  # The table on the real vocabulary: the automaton ends on the token holding "</answer>"'s last ">".
  table = stop_table(tok, ("</answer>",))
  state, end = 0, None
  for i, t in enumerate(ids):
    state = table.next_state[state, t]
    if state == MATCHED:
      end = i + 1
      break
  assert tok.decode(ids[:end], skip_special_tokens=True).endswith("</answer>")
  assert "</answer>" not in tok.decode(ids[:end - 1], skip_special_tokens=True)


def test_group_sampler_stops_on_eos_stop_string_or_length(model):
  # 8 samples of 10 tokens from the near-uniform tiny model. The stop string is sample 0's text from
  # inside its token 2 to inside its token 4 ("7|42|8" of "17|", "42|", "8|"); EOS is sample 1's token 3.
  # With both, each sample ends where the naive reference (decode after every token) says, with its
  # reason; the tokens before are the free run's (the same keys), the rest pad with logprob 0.
  n, key = 10, jax.random.key(3)
  free = np.asarray(sample_group(model, PROMPT, num_samples=8, max_new_tokens=n, key=key).tokens)
  text0 = text_of(free[0]).decode()
  start, end = len(text_of(free[0, :2])) + 1, len(text_of(free[0, :5])) - 1
  stop, eos = text0[start:end], (int(free[1, 3]),)
  r = sample_group(model, PROMPT, num_samples=8, max_new_tokens=n, key=key, eos_ids=eos, pad_id=63,
                   stop_table=build_stop_table([stop], VOCAB))
  reasons = r.stop_reasons()
  for g in range(8):
    length, reason = first_stop(free[g], stop, eos)
    assert (int(r.lengths[g]), reasons[g]) == (length, reason), g
    np.testing.assert_array_equal(np.asarray(r.tokens[g, :length]), free[g, :length])
    np.testing.assert_array_equal(np.asarray(r.tokens[g, length:]), 63)
    np.testing.assert_array_equal(np.asarray(r.logprobs[g, length:]), 0.0)
    assert bool(r.truncated[g]) == (reason == "length")
  # The draw covers each reason: sample 0 stops on the string at its token 4, sample 1 on EOS.
  assert reasons[0] == "stop_string" and int(r.lengths[0]) <= 5 and reasons[1] == "eos"
  assert "length" in reasons.tolist()


def test_tree_sampler_stops_on_a_string_that_spans_segments(model):
  # Fan-outs (2, 2), segments of 3 tokens. The stop string is the free tree's first trajectory from
  # inside its token 1 to inside its token 4: it spans the boundary of its two segments, so only a
  # child that starts from its parent's automaton state can see it. Every trajectory of the stopped
  # tree is a prefix of a free one (same keys); it ends where the naive reference says, with its reason.
  kw = dict(fanouts=[2, 2], segment_length=3, key=jax.random.key(0))
  free = sample_tree(model, PROMPT, **kw)
  first = free.tree.completion(0)
  text0 = text_of(first).decode()
  stop = text0[len(text_of(first[:1])) + 1:len(text_of(first[:5])) - 1]
  r = sample_tree(model, PROMPT, stop_table=build_stop_table([stop], VOCAB), **kw)
  free_paths = [np.asarray(free.tree.completion(g)) for g in range(len(free.tree.ends))]
  reasons = r.stop_reasons()
  for g in range(len(r.tree.ends)):
    path = np.asarray(r.tree.completion(g))
    source = next(p for p in free_paths if np.array_equal(p[:len(path)], path))
    assert (len(path), reasons[g]) == first_stop(source, stop), g
    assert bool(r.truncated[g]) == (reasons[g] == "length")
  assert reasons[0] == "stop_string" and 3 < len(r.tree.completion(0)) <= 5
  assert "length" in reasons.tolist()


def test_a_stop_string_stop_is_not_truncated_for_mask_truncated(tmp_path, model):
  # loss.mask_truncated leaves out the completions the budget cut; one a stop string ended is in the
  # loss (weight > 0 on its tokens), like one EOS ended: the sampler's truncated flag is False for it.
  n, key = 10, jax.random.key(3)
  free = np.asarray(sample_group(model, PROMPT, num_samples=4, max_new_tokens=n, key=key).tokens)
  stop = text_of(free[0, 2:4]).decode()
  ro = sample_group(model, PROMPT, num_samples=4, max_new_tokens=n, key=key,
                    stop_table=build_stop_table([stop], VOCAB))
  reasons, lengths = ro.stop_reasons(), np.asarray(ro.lengths)
  assert reasons[0] == "stop_string" and "length" in reasons.tolist()
  raw = Trajectories(PROMPT, np.asarray(ro.tokens), np.asarray(ro.logprobs), lengths, np.asarray(ro.truncated),
                     np.arange(4, dtype=np.float64), np.zeros(4, bool), n, None,
                     {"data_pos": 0, "question": "q", "answer": "a", "completion": "c"}, 0.0, 0.0, None, reasons)
  config = grpo_smoke(tmp_path, **{"loss.mask_truncated": True, "rollout.max_new_tokens": n})
  g = groups.build(config, raw, tiny_config(), 0, layout_of(parse(config)))
  np.testing.assert_array_equal(g.in_loss, reasons != "length")
  w = np.asarray(g.batch.branches.weights)
  assert (w[0, :lengths[0]] > 0).all() and (w[~g.in_loss] == 0).all()
  np.testing.assert_array_equal(g.stop_reasons, reasons)


@pytest.mark.parametrize("value,message", [
    ("</answer>", "rollout.stop_strings='</answer>' must be a tuple of strs, not str"),
    (("</answer>", ""), "rollout.stop_strings=('</answer>', '') must be a tuple of non-empty str"),
    ((3,), "rollout.stop_strings[0]=3 must be a str, not int"),
    (None, "rollout.stop_strings=None: the field is no placeholder"),
])
def test_bad_stop_strings_are_refused(tmp_path, value, message):
  # A bare string (not a tuple), an empty string (it would match before any text), a non-str, None:
  # a ValueError naming the field and the value, before anything loads.
  config = grpo_smoke(tmp_path)
  del config.rollout.stop_strings
  config.rollout.stop_strings = value   # as an experiment file writes it (ml_collections locks no earlier type)
  with pytest.raises(ValueError, match=re.escape(message)):
    schema.parse(config)
    validate_common(config)


def test_stop_strings_are_typed_in_every_sampling_schema():
  # GRPO, PPO and DPO (data.source = "task") all sample: each has the field, a tuple of str, default ().
  for algorithm in ("grpo", "ppo", "dpo"):
    assert ("rollout.stop_strings" in {name for name, _, _ in schema.fields(algorithm)}), algorithm


def test_stop_reason_rates_are_logged_per_step():
  # Two groups, reasons (eos, stop_string, length, length) and (stop_string, stop_string): over the 6
  # completions eos 1/6, stop_string 3/6 (truncated_frac, logged beside them, is the other 2/6).
  from types import SimpleNamespace
  from branch_replay_jax.algorithms import loop
  groups_ = [SimpleNamespace(stop_reasons=np.array(["eos", "stop_string", "length", "length"])),
             SimpleNamespace(stop_reasons=np.array(["stop_string", "stop_string"]))]
  assert loop.stop_fracs(groups_) == {"stop_eos_frac": pytest.approx(1 / 6), "stop_string_frac": pytest.approx(0.5)}
  assert loop.stop_fracs([SimpleNamespace(stop_reasons=None)]) == {}
