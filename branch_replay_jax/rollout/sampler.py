"""KV-cache sampler for RL rollouts: one shared prefill, G samples decoded on top of it.

The prompt is run ONCE with batch 1. Its K/V block (batch 1) is an ancestor of every decode
step, and the suffix attention broadcasts a batch-1 block, so the prompt is never tiled G times.
Generated tokens go to a preallocated cache, k/v [L, G, N, Hkv, D]:

    ancestors of decode step t (sample g, query = token t at position P + t):

      prompt block, batch 1       generated cache, batch G       own
      [ p0 p1 ... pP-1 . . . ]    [ y0 y1 ... yt-1 . . . . ]    [ yt ]
        '.' = bucket padding        '.' = not yet written
        (masked invalid)            (valid = positions < t)

The prompt is right-padded to a bucket length (a power of two >= 16 by default) so that
prompts of similar length reuse one compiled program; positions continue from the real
length P, not the bucket length. The decode loop is a `jax.lax.while_loop` that exits once
every sample has stopped.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from branch_replay_jax.data.groups import bucket_length
from branch_replay_jax.kernels import KVBlock
from branch_replay_jax.models.config import FULL, SLIDING
from branch_replay_jax.models.gemma4 import Gemma4KV
from branch_replay_jax.models.llama import Llama
from branch_replay_jax.models.qwen3_5 import HybridState
from branch_replay_jax.models.window_kv import RingCache, global_layers, ring_cache, ring_write


class Rollouts(NamedTuple):
  """One group of G samples for one prompt (N = max_new_tokens).

  prompt_ids: [P] int32, the prompt without bucket padding.
  tokens: [G, N] int32 generated ids; positions >= lengths[g] hold the `pad_id` passed to
    `sample_group` (0 by default).
  logprobs: [G, N] float32 (float64 for a float64 model under jax_enable_x64) log pi(token_t |
    prompt, tokens_<t) under the untruncated model distribution log_softmax(logits / tau_lp) at the
    sampler's `logprob_temperature` tau_lp (1 by default: UNTEMPERED), whatever temperature/top-p drew
    the token: the trainer's `token_logprobs` at temperature tau_lp computes the same, so a rollout
    correction compares like with like (the loop passes the trainer's tau, `grpo.logprob_temperature`).
    0.0 at positions >= lengths[g].
  lengths: [G] int32 generated tokens, counting the EOS/stop token when one was hit (for a stop
    string, the token that completed it).
  finished: [G] bool, True when the sample hit an EOS/stop id or a stop string (False: cut at N
    tokens); the stop reason, also as `truncated` = ~finished.
  stop_string: [G] bool, True when a stop string (not an EOS id) ended the sample
    (rollout/stop_strings.py); None from code that builds Rollouts without it (read as all False).
  routes: a Qwen3-MoE model's [G, N, layers, k] int32 experts each generated token ran (recorded when the
    token is fed: -1 for a token drawn but never fed, the last of a full-length sample or a stop token drawn
    as the last other sample ended, and after the end);
    prompt_routes: [P, layers, k] the prompt's, from its one prefill. None for a model without experts.
  """

  prompt_ids: jax.Array
  tokens: jax.Array
  logprobs: jax.Array
  lengths: jax.Array
  finished: jax.Array
  stop_string: jax.Array | None = None
  routes: jax.Array | None = None
  prompt_routes: jax.Array | None = None

  @property
  def truncated(self) -> jax.Array:
    """[G] bool, the stop reason: True where the sample was cut by the token budget N without an
    EOS/stop id or stop string, False where it ended with one (also when that token is its N-th).
    GAE bootstraps the truncated ones (`objectives.gae`'s truncated_b)."""
    return ~self.finished

  def stop_reasons(self) -> np.ndarray:
    """[G] str, per sample "eos", "stop_string" or "length" (`stop_reasons`)."""
    return stop_reasons(self.finished, self.stop_string)

  def completion_mask(self) -> jax.Array:
    """[G, N] bool, True on generated (non-padding) positions."""
    return jnp.arange(self.tokens.shape[1])[None, :] < self.lengths[:, None]


def stop_reasons(finished, stop_string=None) -> np.ndarray:
  """[G] str from [G] bool `finished` (an EOS id or a stop string ended the sample) and [G] bool
  `stop_string` (a stop string did; None: none did): "stop_string", else "eos" where finished, else
  "length" (cut by the token budget)."""
  finished = np.asarray(finished, bool)
  by_string = np.zeros_like(finished) if stop_string is None else np.asarray(stop_string, bool)
  return np.where(by_string, "stop_string", np.where(finished, "eos", "length"))


def init_cache(model: Llama, batch: int, length: int, context=None,
               ring: bool = False) -> KVBlock | HybridState | Gemma4KV | RingCache:
  """An empty generated-token cache: k, v [L, batch, length, Hkv, D] zeros in the model's compute
  dtype, valid [batch, length] all False. Qwen3.5's (`models.qwen3_5.HybridState`) holds its full layers'
  K/V so and its linear layers' running state beside them, starting from `context`'s (the last ancestor:
  the state after the context's last token, broadcast to the batch). Gemma 4's (`models.gemma4.Gemma4KV`) its
  sliding and its global layers' K/V side by side.

  ring: a model with sliding layers of W >= 2 beside global ones (Gemma 3, Gemma 4) whose length > W - 1 gets a
  `window_kv.RingCache`: its sliding layers keep W - 1 slots, not `length` (the group sampler's, whose cache no
  later segment reads). Any other model (W = 1, a Gemma 3 of sliding or of global layers only) its whole cache."""
  cfg = model.config
  if ring and _rings(cfg, length):
    return _ring_cache(model, batch, length)
  if cfg.gemma4:
    return model.initial_state(batch, length)
  if cfg.hybrid:
    empty = model.initial_state(batch)
    shape = (empty.k.shape[0], batch, length, cfg.num_kv_heads, cfg.head_dim)
    state = context if context is not None else empty
    grow = lambda x, like: jnp.broadcast_to(x, like.shape).astype(like.dtype)
    return HybridState(jnp.zeros(shape, model.dtype), jnp.zeros(shape, model.dtype), jnp.zeros((batch, length), bool),
                       grow(state.conv, empty.conv), grow(state.recurrent, empty.recurrent))
  shape = (cfg.num_layers, batch, length, cfg.num_kv_heads, cfg.head_dim)
  return KVBlock(jnp.zeros(shape, model.dtype), jnp.zeros(shape, model.dtype), jnp.zeros((batch, length), bool))


def _rings(cfg, length: int) -> bool:
  """Whether `init_cache(ring=True)` makes a `RingCache`: sliding layers of W >= 2 beside global ones (of those
  that compute K/V) and more than W - 1 slots to decode."""
  types, w = cfg.kv_layer_types or (), cfg.sliding_window
  return cfg.sliding and w is not None and 2 <= w <= length and SLIDING in types and FULL in types


def _ring_cache(model: Llama, batch: int, length: int) -> RingCache:
  """An empty `RingCache` of `length` global slots and W - 1 ring slots (`init_cache`)."""
  cfg = model.config
  r = cfg.sliding_window - 1
  if cfg.gemma4:
    full, ring = model.initial_state(batch, length), model.initial_state(batch, r)
    return ring_cache(KVBlock(full.gk, full.gv, full.valid), KVBlock(ring.k, ring.v, ring.valid))
  zeros = lambda layers, n: jnp.zeros((layers, batch, n, cfg.num_kv_heads, cfg.head_dim), model.dtype)
  empty = lambda layers, n: KVBlock(zeros(layers, n), zeros(layers, n), jnp.zeros((batch, n), bool))
  return ring_cache(empty(cfg.layer_types.count(FULL), length), empty(cfg.num_layers, r))


def _write_ring(model: Llama, cache: RingCache, kv, step, positions) -> RingCache:
  """`cache` with the decoded tokens' K/V `kv` (their segment's: a `Gemma4KV`, or a `KVBlock` [L, B, 1, ...])
  written (`window_kv.ring_write`): the global layers' at slot `step`, the sliding layers' in the ring."""
  full = (kv.gk, kv.gv) if isinstance(kv, Gemma4KV) else global_layers(kv, model.config.layer_types)[:2]
  return ring_write(cache, full, (kv.k, kv.v), step, positions)


def prefill(model: Llama, prompt_bt: jax.Array, prompt_len, *, with_routes: bool = False) -> tuple:
  """Forward of a right-padded prompt; returns its K/V block and the next-token logits.

  Args:
    model: the decoder.
    prompt_bt: [B, T] int token ids (B is 1 for a shared prompt), right-padded to a bucket T.
    prompt_len: int scalar (may be traced), real length P <= T; keys at positions >= P are invalid.

  Returns:
    kv: k, v [L, B, T, Hkv, D], valid [B, T] (False on the padding).
    logits_bv: [B, V] float32 logits at position P - 1 (they predict the first generated token).
    with_routes: also the experts each prompt token ran, [B, T, layers, k] int32 (None without experts).
  """
  b, t = prompt_bt.shape
  valid_bt = jnp.broadcast_to(jnp.arange(t) < prompt_len, (b, t))
  out = model(prompt_bt, 0, valid_bt=valid_bt, hidden_at=prompt_len - 1)   # (only its last hidden state is read)
  if with_routes:
    return out.kv, model.logits(out.hidden_btd)[:, 0], out.experts
  return out.kv, model.logits(out.hidden_btd)[:, 0]


def decode_step(model: Llama, tokens_b: jax.Array, offset, ancestors: Sequence[KVBlock], cache: KVBlock,
                step) -> tuple:
  """Runs one token per sample on top of `ancestors` and the cache; writes its K/V at `step`.

  Args:
    model: the decoder.
    tokens_b: [B] int ids of the tokens being fed (generated token `step` of each sample).
    offset: int scalar or [B]: their absolute position (prompt length + step).
    ancestors: K/V blocks before the cache, k, v [L, B or 1, S, Hkv, D]; the shared prompt is
      passed with batch 1 and broadcast by the attention, not copied.
    cache: k, v [L, B, N, Hkv, D], valid [B, N]; entries valid before the call are attended to. Or a
      `window_kv.RingCache` (`init_cache`'s ring): the sliding layers' K/V then goes to slot step mod (W - 1).
    step: int scalar (may be traced), cache slot of this token, 0 <= step < N.

  Returns:
    logits_bv: [B, V] float32 next-token logits.
    cache: the cache with this token's K/V at slot `step` and valid[:, step] = True (Qwen3.5's: and the
      linear layers' state after this token, every row's; a finished row's is not read).
    experts: a Qwen3-MoE model's experts the fed tokens ran, [B, layers, k] int32; None without experts.
  """
  out = model(tokens_b[:, None], offset, ancestors=[*ancestors, cache])
  experts = None if out.experts is None else out.experts[:, 0]
  if isinstance(cache, RingCache):
    positions = jnp.broadcast_to(jnp.asarray(offset, jnp.int32), tokens_b.shape)
    return model.logits(out.hidden_btd)[:, 0], _write_ring(model, cache, out.kv, step, positions), experts
  zero = jnp.zeros((), jnp.int32)
  start = (zero, zero, jnp.asarray(step, jnp.int32), zero, zero)
  write = lambda name: jax.lax.dynamic_update_slice(getattr(cache, name),
                                                    getattr(out.kv, name).astype(getattr(cache, name).dtype), start)
  keyed = [f for f in ("k", "v", "gk", "gv") if f in cache._fields]   # Gemma 4: its global layers' too
  valid = jax.lax.dynamic_update_slice(cache.valid, jnp.ones((tokens_b.shape[0], 1), bool), start[1:3])
  cache = cache._replace(valid=valid, **{f: write(f) for f in keyed})
  if isinstance(cache, HybridState):   # the linear layers' running state: this token's
    cache = cache._replace(conv=out.kv.conv, recurrent=out.kv.recurrent)
  return model.logits(out.hidden_btd)[:, 0], cache, experts


# Probability mass (float32) by which a cumulative mass may fall short of top_p and still count as
# reaching it: softmax and cumsum round, so a nucleus whose exact mass is top_p can sum to
# top_p - 1 ulp and would otherwise take one more token. 1e-6 is ~8 ulp of float32 at 1.0.
TOP_P_TOLERANCE = 1e-6


def top_p_filter(logits_bv: jax.Array, top_p) -> jax.Array:
  """Nucleus filter: logits outside the smallest set whose probability mass reaches top_p become -inf.

  Holtzman et al. 2019 (arXiv 1904.09751), Sec. 3.1, eq. 3. Tokens are ranked by probability,
  ties broken by LOWER TOKEN ID FIRST (a stable sort); the nucleus is the shortest prefix of that
  ranking whose mass is >= top_p - TOP_P_TOLERANCE, so a token is kept iff the mass ranked
  strictly before it is below that. The most likely token is always kept; top_p >= 1 keeps all.

    probs [0.3, 0.1, 0.1, 0.5], top_p 0.8: ranking 3, 0, 1, 2; masses before 0, 0.5, 0.8, 0.9
      -> keeps {3, 0} (their mass is exactly 0.8).
    64 equal logits, top_p 0.1: ranking 0, 1, ..., 63; 7 tokens reach 7/64 = 0.109 -> keeps ids 0..6.

  Args:
    logits_bv: [B, V] float logits (already divided by the temperature).
    top_p: float scalar in (0, 1].

  Returns:
    [B, V] logits of the same dtype with -inf outside the nucleus.
  """
  probs = jax.nn.softmax(logits_bv.astype(jnp.result_type(logits_bv.dtype, jnp.float32)), axis=-1)
  order = jnp.argsort(-probs, axis=-1, stable=True)
  mass = jnp.cumsum(jnp.take_along_axis(probs, order, axis=-1), axis=-1)
  mass_before = jnp.pad(mass[:, :-1], ((0, 0), (1, 0)))
  kept_ranked = (mass_before < top_p - TOP_P_TOLERANCE) | (top_p >= 1)
  kept_ranked = kept_ranked.at[:, 0].set(True)
  rows = jnp.arange(probs.shape[0])[:, None]
  kept = jnp.zeros(probs.shape, bool).at[rows, order].set(kept_ranked)
  return jnp.where(kept, logits_bv, -jnp.inf)


def sample_token(logits_bv: jax.Array, keys_b: jax.Array, step, *, temperature, top_p, greedy: bool) -> jax.Array:
  """Draws one token per row: argmax if `greedy`, else softmax(logits / temperature) after top-p.

  Args:
    logits_bv: [B, V] float32 logits.
    keys_b: [B] PRNG keys, one per sample; row b uses fold_in(keys_b[b], step).
    step: int scalar: the index of the token being drawn, so each step gets fresh randomness.
    temperature: float scalar > 0 (ignored when greedy).
    top_p: float scalar in (0, 1], or None for no nucleus filter (ignored when greedy).
    greedy: static bool.

  Returns:
    [B] int32 token ids.
  """
  if greedy:
    return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
  scaled = logits_bv / temperature
  if top_p is not None:
    scaled = top_p_filter(scaled, top_p)
  draw = lambda key, row: jax.random.categorical(jax.random.fold_in(key, step), row)
  return jax.vmap(draw)(keys_b, scaled).astype(jnp.int32)


def _picked_logprob(logits_bv, tokens_b, temperature):
  """log_softmax(logits / temperature)[token] per row (x / 1 is exact: untempered at 1)."""
  return jnp.take_along_axis(jax.nn.log_softmax(logits_bv / temperature, axis=-1), tokens_b[:, None], axis=-1)[:, 0]


def decode_from(model: Llama, ancestors: Sequence[KVBlock], logits_1v: jax.Array, offset, keys_g: jax.Array, *,
                temperature, top_p, eos_ids: jax.Array, pad_id, max_new_tokens: int,
                greedy: bool, stop_next: jax.Array | None = None, stop_state: jax.Array | None = None,
                logprob_temperature=1.0, ring: bool = False):
  """Samples G continuations of one context whose K/V are `ancestors` and next-token logits `logits_1v`.

  Token 0 is drawn from `logits_1v`; token t + 1 from the decode step that feeds token t. The loop
  (`jax.lax.while_loop`) exits once every sample has hit a stop id or N - 1 steps ran, so the LAST
  token of a full-length sample is drawn but never fed: cache slot N - 1 stays empty.

  Args:
    model: the decoder.
    ancestors: K/V blocks of the context, k, v [L, 1 (or G), S_i, Hkv, D]; batch-1 blocks are broadcast.
    logits_1v: [1, V] float32 logits at the context's last position.
    offset: int scalar (may be traced): absolute position of token 0 (the context length).
    keys_g: [G] PRNG keys; sample g draws token t with fold_in(keys_g[g], t).
    temperature, top_p, greedy: as in `sample_token` (top_p None: no nucleus filter).
    eos_ids: [S] int32 ids that end a sample (-1 never matches).
    pad_id: int32 id written after a sample's end.
    max_new_tokens: N, static.
    stop_next: [Q, V] int32 `StopTable.next_state` of the stop strings (rollout/stop_strings.py), or
      None for none: a sample ends on the token whose entry from its state is MATCHED (-1).
    stop_state: [G] int32 each sample's automaton state before token 0 (a tree child's: its
      parent's final state); None: 0 (no text yet).
    logprob_temperature: tau_lp > 0 (may be traced): the recorded log-probs are
      log_softmax(logits / tau_lp)[token] (`Rollouts.logprobs`); 1 records them untempered.
    ring: static; a sliding-window model decodes into a `window_kv.RingCache` (`init_cache`), and the cache
      returned is that ring, which no later segment can take as an ancestor (the group sampler's).

  Returns:
    tokens [G, N] int32, logprobs [G, N] in the logits' dtype (float32; float64 for a float64
    model; at logprob_temperature, 0 after the end), lengths [G] int32,
    finished [G] bool (hit a stop id or a stop string), the cache (k, v [L, G, N, Hkv, D]; with ring, the
    `RingCache` where `init_cache` makes one) of the fed tokens, by_string [G] bool (a stop string, not a
    stop id, ended it), the final automaton states [G] int32 (0 without stop strings) and, for a Qwen3-MoE
    model, the experts each fed token ran [G, N, layers, k] int32 (-1 where no token was fed;
    `Rollouts.routes`), else None.
  """
  g, n = keys_g.shape[0], max_new_tokens
  sample = functools.partial(sample_token, keys_b=keys_g, temperature=temperature, top_p=top_p, greedy=greedy)
  logits_gv = jnp.broadcast_to(logits_1v, (g, logits_1v.shape[-1]))
  tok = sample(logits_gv, step=0)
  tokens = jnp.full((g, n), pad_id, jnp.int32).at[:, 0].set(tok)
  tau_lp = jnp.asarray(logprob_temperature, logits_1v.dtype)
  logprobs = jnp.zeros((g, n), logits_1v.dtype).at[:, 0].set(_picked_logprob(logits_gv, tok, tau_lp))

  def advance(state, tok, done):
    """(hit a stop id, completed a stop string, next state) of the fed tokens of unfinished samples."""
    eos = jnp.isin(tok, eos_ids) & ~done
    if stop_next is None:
      return eos, jnp.zeros_like(eos), state
    nxt = stop_next[state, tok]
    hit = (nxt < 0) & ~done & ~eos
    return eos, hit, jnp.where(done, state, jnp.maximum(nxt, 0))

  state0 = jnp.zeros((g,), jnp.int32) if stop_state is None else jnp.asarray(stop_state, jnp.int32)
  eos, by_string, state = advance(state0, tok, jnp.zeros((g,), bool))
  done = eos | by_string
  cfg = model.config
  routes = (jnp.full((g, n, cfg.num_layers, cfg.experts_per_token), -1, jnp.int32) if cfg.moe else None)
  cache = init_cache(model, g, n, ancestors[-1], ring)
  carry = (jnp.int32(0), tok, done, jnp.ones((g,), jnp.int32), cache, tokens, logprobs, by_string, state, routes)

  def cond(c):
    t, _, done, *_ = c
    return (t < n - 1) & ~jnp.all(done)

  def body(c):
    t, tok, done, lengths, cache, tokens, logprobs, by_string, state, routes = c
    logits, cache, experts = decode_step(model, tok, offset + t, ancestors, cache, t)
    if routes is not None:   # token t's routes (-1 where it is padding after the row's end)
      experts = jnp.where((t >= lengths)[:, None, None], -1, experts)
      routes = jax.lax.dynamic_update_slice(routes, experts[:, None].astype(jnp.int32), (jnp.int32(0), t, jnp.int32(0),
                                                                                          jnp.int32(0)))
    new = sample(logits, step=t + 1)
    lp = _picked_logprob(logits, new, tau_lp)
    new, lp = jnp.where(done, pad_id, new), jnp.where(done, 0.0, lp)
    # int32 indices throughout: a Python 0 would become int64 under jax_enable_x64 and
    # dynamic_update_slice refuses mixed index types.
    start = (jnp.int32(0), t + 1)
    tokens = jax.lax.dynamic_update_slice(tokens, new[:, None], start)
    logprobs = jax.lax.dynamic_update_slice(logprobs, lp[:, None], start)
    lengths = lengths + (~done).astype(jnp.int32)
    eos, hit, state = advance(state, new, done)
    return t + 1, new, done | eos | hit, lengths, cache, tokens, logprobs, by_string | hit, state, routes

  _, _, done, lengths, cache, tokens, logprobs, by_string, state, routes = jax.lax.while_loop(cond, body, carry)
  return tokens, logprobs, lengths, done, cache, by_string, state, routes


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "greedy", "use_top_p", "ring"))
def generate_program(graphdef, state, prompt_1t, prompt_len, keys_g, temperature, top_p, eos_ids, pad_id,
                     stop_next=None, logprob_temperature=1.0, *, max_new_tokens, greedy, use_top_p, ring: bool = True):
  """`sample_group`'s jitted program: prefill, then `decode_from` (a sliding-window model into a ring cache,
  `ring`; False: the whole cache, the reference the ring is tested against). Public for compile-only memory
  analysis (`benchmarks.ring_cache`: `generate_program.lower(...)`); `sample_group` checks and prepares its
  arguments and is the entry point."""
  model = nnx.merge(graphdef, state)
  prompt_kv, logits_1v, prompt_routes = prefill(model, prompt_1t, prompt_len, with_routes=True)
  tokens, logprobs, lengths, done, _, by_string, _, routes = decode_from(
      model, [prompt_kv], logits_1v, prompt_len, keys_g, temperature=temperature, top_p=top_p if use_top_p else None,
      eos_ids=eos_ids, pad_id=pad_id, max_new_tokens=max_new_tokens, greedy=greedy, stop_next=stop_next,
      logprob_temperature=logprob_temperature, ring=ring)
  return tokens, logprobs, lengths, done, by_string, routes, None if prompt_routes is None else prompt_routes[0]


def check_sampling_inputs(caller: str, cfg, prompt: np.ndarray, eos: np.ndarray, *, temperature, top_p,
                          pad_id, logprob_temperature=1.0) -> None:
  """ValueErrors (prefixed with `caller`) for the inputs every sampler shares."""
  if not temperature >= 0:
    raise ValueError(f"{caller}: temperature must be >= 0, got {temperature}")
  if not 0 < logprob_temperature < float("inf"):
    raise ValueError(f"{caller}: logprob_temperature must be a finite number > 0, got {logprob_temperature}")
  if not 0 < top_p <= 1:
    raise ValueError(f"{caller}: top_p must be in (0, 1], got {top_p}")
  if prompt.ndim != 1 or prompt.size == 0 or not np.issubdtype(prompt.dtype, np.integer):
    raise ValueError(f"{caller}: prompt_ids must be a non-empty 1-D int sequence, got shape {prompt.shape} "
                     f"dtype {prompt.dtype}")
  for name, ids in [("prompt_ids", prompt), ("eos_ids", eos), ("pad_id", np.asarray([pad_id]))]:
    if ids.size and (ids.min() < 0 or ids.max() >= cfg.vocab_size):
      raise ValueError(f"{caller}: {name} must lie in [0, {cfg.vocab_size}), got {ids.tolist()}")


def bucketed_prompt_and_eos(caller: str, prompt: np.ndarray, prompt_bucket: int | None,
                            eos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """The prompt right-padded to its bucket [1, bucket] and the EOS ids padded with -1 to a
  multiple of 8 (-1 never matches a token): both shapes, hence the compile, stay stable."""
  p = prompt.size
  bucket = bucket_length(p) if prompt_bucket is None else prompt_bucket
  if bucket < p:
    raise ValueError(f"{caller}: prompt_bucket={bucket} is shorter than the prompt ({p} tokens)")
  padded = np.zeros((1, bucket), np.int32)
  padded[0, :p] = prompt
  return padded, np.pad(eos, (0, max(8, -(-eos.size // 8) * 8) - eos.size), constant_values=-1)


def stop_next_for(caller: str, cfg, stop_table) -> jax.Array | None:
  """`stop_table.next_state` [Q, V] as a device array whose V is the model's vocabulary: ids beyond
  the tokenizer's (a vocabulary padded for the matmul) add no text, so they keep the state; None for
  no table.

  Raises:
    ValueError: the table covers more ids than the model's vocabulary.
  """
  if stop_table is None:
    return None
  table = np.asarray(stop_table.next_state, np.int32)
  if table.shape[1] > cfg.vocab_size:
    raise ValueError(f"{caller}: stop_table covers {table.shape[1]} token ids but the model's vocab_size is "
                     f"{cfg.vocab_size}")
  extra = np.broadcast_to(np.arange(table.shape[0], dtype=np.int32)[:, None], (table.shape[0], cfg.vocab_size -
                                                                               table.shape[1]))
  return jnp.asarray(np.concatenate([table, extra], axis=1))


def _validate(cfg, prompt, eos, *, num_samples, max_new_tokens, temperature, top_p, pad_id, logprob_temperature):
  if num_samples < 1:
    raise ValueError(f"sample_group: num_samples must be >= 1, got {num_samples}")
  if max_new_tokens < 1:
    raise ValueError(f"sample_group: max_new_tokens must be >= 1, got {max_new_tokens}")
  check_sampling_inputs("sample_group", cfg, prompt, eos, temperature=temperature, top_p=top_p, pad_id=pad_id,
                        logprob_temperature=logprob_temperature)
  if prompt.size + max_new_tokens > cfg.max_positions:
    raise ValueError(f"sample_group: prompt length {prompt.size} + max_new_tokens {max_new_tokens} exceeds "
                     f"model.config.max_positions={cfg.max_positions}")


def sample_group(model: Llama, prompt_ids, *, num_samples: int, max_new_tokens: int, key: jax.Array,
                 temperature: float = 1.0, top_p: float = 1.0, eos_ids: Sequence[int] = (), pad_id: int = 0,
                 prompt_bucket: int | None = None, stop_table=None, logprob_temperature: float = 1.0) -> Rollouts:
  """Samples G = num_samples completions of one prompt with one shared prefill and a KV cache.

  Compiles once per (prompt bucket, G, N, temperature == 0, top_p < 1, stop table rows, model
  structure); temperature, top_p's value, up to 8 EOS ids, the stop strings (within a table's row
  count), the key and the prompt within its bucket do not recompile.

  Args:
    model: the decoder (any compute dtype).
    prompt_ids: [P] int token ids, 1 <= P.
    num_samples: G >= 1.
    max_new_tokens: N >= 1, tokens generated per sample at most; P + N <= model.config.max_positions.
    key: PRNG key; sample g draws token t with fold_in(split(key, G)[g], t): reproducible for a key.
    temperature: >= 0; 0 means greedy (argmax: every sample then equals the others).
    top_p: nucleus mass in (0, 1]; 1 disables the filter. Applied after the temperature.
    eos_ids: ids that end a sample (kept as its last token).
    pad_id: id written after a sample's end, in [0, V).
    prompt_bucket: padded prompt length (>= P); default `data.groups.bucket_length(P)` (a power of two >= 16).
    stop_table: a `rollout.stop_strings.StopTable` (`stop_table(tokenizer, strings)`), or None: a
      sample ends on the token that completes one of its stop strings in the decoded text (kept as
      its last token; `Rollouts.stop_string` True).
    logprob_temperature: tau_lp > 0, the temperature of the recorded log-probs (`Rollouts.logprobs`);
      its value does not recompile.

  Returns:
    Rollouts (see its docstring for shapes and the padding/log-prob conventions).

  Raises:
    ValueError: num_samples < 1, max_new_tokens < 1, temperature < 0, logprob_temperature not a finite
      number > 0, top_p outside (0, 1], empty
      or non-1-D prompt, any id outside [0, V), P + max_new_tokens > max_positions, prompt_bucket < P,
      a stop table wider than the vocabulary.
  """
  prompt = np.asarray(prompt_ids)
  eos = np.asarray(list(eos_ids), np.int64).reshape(-1)
  _validate(model.config, prompt, eos, num_samples=num_samples, max_new_tokens=max_new_tokens,
            temperature=temperature, top_p=top_p, pad_id=pad_id, logprob_temperature=logprob_temperature)
  stop_next = stop_next_for("sample_group", model.config, stop_table)
  p = prompt.size
  padded, eos = bucketed_prompt_and_eos("sample_group", prompt, prompt_bucket, eos)
  graphdef, state = nnx.split(model)
  greedy = temperature == 0
  tokens, logprobs, lengths, finished, by_string, routes, prompt_routes = generate_program(
      graphdef, state, jnp.asarray(padded), jnp.int32(p), jax.random.split(key, num_samples),
      jnp.float32(temperature if not greedy else 1.0), jnp.float32(top_p), jnp.asarray(eos, jnp.int32),
      jnp.int32(pad_id), stop_next, jnp.float32(logprob_temperature), max_new_tokens=max_new_tokens, greedy=greedy,
      use_top_p=top_p < 1 and not greedy)
  return Rollouts(jnp.asarray(prompt, jnp.int32), tokens, logprobs, lengths, finished, by_string, routes,
                  None if prompt_routes is None else prompt_routes[:p])
