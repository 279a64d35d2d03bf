"""Stop strings (`rollout.stop_strings`): text that ends a completion, matched exactly inside the jitted decode loop.

A stop string such as "</answer>" or a tool tag "</calc>" can arrive in many tokenizations ("</",
"answer", ">" or "</answer>" or "er>\\n" ending it), and can end in the middle of a token. Matching
token-id suffixes misses some of them; decoding on the host at every token leaves the jitted loop.
This module makes the match exact and cheap with the method of HF transformers' `StopStringCriteria`
(precomputed per-token tables, checked on device), in the form of a string-matching automaton:

  1. `token_bytes`: the UTF-8 bytes each token id adds to the decoded text, so that the completion's
     text is the concatenation of its tokens' bytes (byte-level BPE: SmolLM2, Llama 3, Qwen2/3;
     special tokens that `skip_special_tokens` drops add none).
  2. `StopTable`: the Aho-Corasick automaton of the stop strings over bytes (Aho & Corasick 1975,
     "Efficient string matching", CACM 18(6), Algorithms 2-3: state = the longest suffix of the text
     read so far that is a prefix of some stop string), lifted from bytes to tokens: for every state q
     and token t, `next[q, t]` is the state after reading t's bytes from q, or MATCHED (-1) when a stop
     string ends anywhere inside those bytes. Built once per (tokenizer, stop strings) with numpy,
     [Q, V] int32 (Q = states rounded up to a multiple of 8, V = vocabulary: 2 MB for "</answer>"
     and a 49k vocabulary).
  3. In the decode loop each sample carries its state; one gather per token, `next[state, token]`,
     advances it. The sample stops on the token whose bytes complete a stop string: that token is its
     last (whatever it holds after the string: a token is never split), later positions are padding,
     and its stop reason is "stop_string".

Exactness: the stop string is found iff it occurs in the concatenated bytes of the completion, which
is `tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)` encoded
to UTF-8; UTF-8 is self-synchronising, so a byte match of the (valid UTF-8) stop string is a match
in the decoded text, also when a character spans two tokens. The tree sampler passes each
segment's final state to its children, so a stop string may span segments.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

MATCHED = -1   # next-state value of a token that completes a stop string


def check_stop_strings(stop_strings, field: str = "rollout.stop_strings") -> tuple[str, ...]:
  """`stop_strings` as a tuple of non-empty str.

  Raises:
    ValueError: not a tuple or list of non-empty str, naming `field` and the value.
  """
  if not isinstance(stop_strings, (tuple, list)) or not all(isinstance(s, str) and s for s in stop_strings):
    raise ValueError(f"{field}={stop_strings!r} must be a tuple of non-empty str, e.g. ('</answer>',)")
  return tuple(stop_strings)


def _byte_decoder() -> dict[str, int]:
  """GPT-2's byte-level alphabet inverted: the printable character standing for each byte -> the byte
  (Radford et al. 2019, the `bytes_to_unicode` table of openai/gpt-2 encoder.py, used by every
  byte-level BPE tokenizer)."""
  printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
      list(range(ord("®"), ord("ÿ") + 1))
  chars, n = list(printable), 0
  for b in range(256):
    if b not in printable:
      printable.append(b)
      chars.append(256 + n)
      n += 1
  return {chr(c): b for b, c in zip(printable, chars)}


def token_bytes(tokenizer) -> list[bytes]:
  """[V] the UTF-8 bytes each token id adds to `tokenizer.decode(..., skip_special_tokens=True,
  clean_up_tokenization_spaces=False)`: a byte-level BPE token's characters mapped back to bytes; an
  added token's content, or b"" when skip_special_tokens drops it.

  Raises:
    ValueError: the tokenizer's decoder is not byte-level (a SentencePiece decoder strips and
      replaces characters, so the text is not a concatenation of per-token strings), naming
      rollout.stop_strings.
  """
  decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
  if decoder is None or "ByteLevel" not in repr(decoder):
    raise ValueError(f"rollout.stop_strings needs a byte-level BPE tokenizer (SmolLM2, Llama 3, Qwen2/3); this "
                     f"tokenizer's decoder is {decoder!r}, whose text is not the concatenation of its tokens")
  table, vocab = _byte_decoder(), len(tokenizer)
  added = {int(i): t for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
  out = []
  for i, piece in enumerate(tokenizer.convert_ids_to_tokens(list(range(vocab)))):
    if i in added:
      out.append(tokenizer.decode([i], skip_special_tokens=True).encode("utf-8"))
    else:
      out.append(bytes(table[c] for c in piece))
  return out


class StopTable(NamedTuple):
  """The token-level automaton of a set of stop strings (module docstring).

  next_state: [Q, V] int32, the state after reading token t from state q, MATCHED (-1) when a stop
    string ends inside t's bytes; rows >= num_states are never reached (padding to a multiple of 8
    keeps the compile of up to 8 states, then 16, ...).
  num_states: the automaton's states (1 + the distinct non-empty prefixes of the stop strings).
  stop_strings: the strings it matches.
  """
  next_state: np.ndarray
  num_states: int
  stop_strings: tuple[str, ...]


def byte_automaton(stop_strings: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
  """The Aho-Corasick automaton of `stop_strings` over bytes (its goto and failure functions folded
  into one transition table): (delta [Q, 256] int32, hit [Q, 256] bool), state 0 the empty prefix,
  state q the q-th distinct prefix in order of length; hit[q, c]: reading byte c in state q ends a
  stop string."""
  patterns = [s.encode("utf-8") for s in stop_strings]
  prefixes = sorted({p[:k] for p in patterns for k in range(len(p))}, key=lambda u: (len(u), u))
  index = {u: q for q, u in enumerate(prefixes)}
  delta = np.zeros((len(prefixes), 256), np.int32)
  hit = np.zeros((len(prefixes), 256), bool)
  for q, u in enumerate(prefixes):
    for c in range(256):
      text = u + bytes([c])
      hit[q, c] = any(text.endswith(p) for p in patterns)
      delta[q, c] = next(index[text[k:]] for k in range(len(text) + 1) if text[k:] in index)
  return delta, hit


def build_stop_table(stop_strings: Sequence[str], vocab_bytes: Sequence[bytes]) -> StopTable:
  """The token-level table of `stop_strings` for a vocabulary whose token t adds `vocab_bytes[t]`.

  Runs every token's bytes through the byte automaton from every state at once (numpy, one pass per
  byte position: max token length passes over [Q, V]).

  Raises:
    ValueError: stop_strings not a tuple/list of non-empty str (rollout.stop_strings).
  """
  stop_strings = check_stop_strings(stop_strings)
  delta, hit = byte_automaton(stop_strings)
  q, v = delta.shape[0], len(vocab_bytes)
  width = max([len(b) for b in vocab_bytes] + [1])
  lengths = np.array([len(b) for b in vocab_bytes])
  padded = np.zeros((v, width), np.uint8)
  for t, b in enumerate(vocab_bytes):
    padded[t, :len(b)] = np.frombuffer(b, np.uint8)
  state = np.broadcast_to(np.arange(q, dtype=np.int32)[:, None], (q, v)).copy()
  matched = np.zeros((q, v), bool)
  for j in range(width):
    active = (j < lengths)[None, :] & ~matched
    byte = padded[:, j][None, :]
    matched |= active & hit[state, byte]
    state = np.where(active, delta[state, byte], state)
  rows = max(8, -(-q // 8) * 8)
  table = np.zeros((rows, v), np.int32)
  table[:q] = np.where(matched, MATCHED, state)
  return StopTable(table, q, stop_strings)


# (id(tokenizer), stop strings) -> (the tokenizer, its table); the tokenizer is held so its id is not reused.
_TABLES: dict[tuple[int, tuple[str, ...]], tuple[object, StopTable]] = {}


def stop_table(tokenizer, stop_strings: Sequence[str]) -> StopTable | None:
  """`build_stop_table` for `tokenizer`'s vocabulary (`token_bytes`), built once per (tokenizer,
  stop strings) and cached (up to 8); None for no stop strings. Raises as `token_bytes` and
  `build_stop_table`."""
  stop_strings = tuple(stop_strings)
  if not stop_strings:
    return None
  key = (id(tokenizer), stop_strings)
  if key not in _TABLES:
    if len(_TABLES) >= 8:
      _TABLES.pop(next(iter(_TABLES)))
    _TABLES[key] = (tokenizer, build_stop_table(stop_strings, token_bytes(tokenizer)))
  return _TABLES[key][1]
