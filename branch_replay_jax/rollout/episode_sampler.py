"""Sampling across an episode's turns with its KV cache kept between them (docs/design.md, "Episodes").

`EpisodeSampler` is the `sample_turn` of `rollout.environments.run_episode`, backed by the KV-cache
sampler (`rollout.sampler.decode_from`). It keeps the K/V of every token it has seen as a list of
blocks; a turn prefills only the ids it has not seen (the observation, with the previous turn's
last sampled token, whose K/V the decode loop never computes) on top of them, then decodes:

    turn 0:  [ prompt block ]                                  prefill P ids, decode turn 0
    turn 1:  [ prompt | turn 0 cache | y_last + observation ]  prefill |obs| + 1 ids, decode turn 1
    turn 2:  [ ...                   | y_last + observation ]  ...

A block is right-padded to a bucket (`data.groups.bucket_length`) with its padding masked invalid,
and the decode cache is valid on the slots it fed, so every key is at its true position (RoPE is in
the cached K) and the attention sees exactly the episode's tokens. With keep_cache=False each turn
re-prefills the whole history instead (the reference: same tokens from the same key, more compute).

With history="template" (`rollout.chat.ChatTokens`: a template that rewrites earlier turns) a turn's
ids may not extend the ids seen before. The sampler then keeps the leading blocks that lie within
their common prefix (the prompt's, as a rule) and prefills the rest of the new ids on top of them;
`reprefills` counts such turns.

G episodes of one problem branch at the first turn: `EpisodeSampler.branches` prefills the prompt
once (batch 1) and hands every branch that block, as `sample_group` and `sample_tree` share theirs.
Each branch then decodes its own turns (batch 1; the episodes of a problem run one by one).

Keys: branch g of `branches(key=k)` has key fold_in(k, g); turn i of a sampler with key k draws
token t with fold_in(fold_in(k, i), t), whether the cache is kept or not.

    samplers = EpisodeSampler.branches(model, chat.ids, 8, key=key, eos_ids=stop_ids(tokenizer))
    results = [run_episode(env, problem, i, tokenizer, s, max_turns=3, ...) for s in samplers]
    samplers[g].logprobs      # per turn [n_i] log pi(token | history) at its logprob_temperature
                              # (1: untempered; `Rollouts.logprobs`)
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from branch_replay_jax.data.groups import bucket_length
from branch_replay_jax.kernels import KVBlock
from branch_replay_jax.models.llama import Llama
from branch_replay_jax.rollout.chat import HISTORIES
from branch_replay_jax.rollout.sampler import check_sampling_inputs, decode_from


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _extend(graphdef, state, blocks, new_1t, new_len, offset):
  """K/V of `new_len` right-padded ids at `offset` on top of `blocks`, the logits [1, V] at the last, and for a
  Qwen3-MoE model the experts each id ran [1, T, layers, k] int32 (else None)."""
  model = nnx.merge(graphdef, state)
  valid = jnp.arange(new_1t.shape[1])[None] < new_len
  out = model(new_1t, offset, ancestors=blocks, valid_bt=valid, hidden_at=new_len - 1)   # (its last hidden state)
  return out.kv, model.logits(out.hidden_btd)[:, 0], out.experts


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "greedy", "use_top_p"))
def _decode(graphdef, state, blocks, logits_1v, offset, key, temperature, top_p, eos_ids, pad_id, logprob_temperature,
            *, max_new_tokens, greedy, use_top_p):
  model = nnx.merge(graphdef, state)
  # No stop strings in an episode's turns (its turns end at the model's stop ids): the stop-string flags and
  # automaton states are all False / 0. The last output: a Qwen3-MoE model's routes of the fed tokens (else None).
  out = decode_from(model, blocks, logits_1v, offset, key[None], temperature=temperature,
                    top_p=top_p if use_top_p else None, eos_ids=eos_ids, pad_id=pad_id,
                    max_new_tokens=max_new_tokens, greedy=greedy, logprob_temperature=logprob_temperature)
  return (*out[:5], out[7])


class EpisodeSampler:
  """One episode's `sample_turn(ids, budget) -> sampled ids` (see the module docstring).

  Args:
    model: the decoder (any compute dtype).
    key: PRNG key of this episode.
    temperature: >= 0; 0 is greedy. top_p: nucleus mass in (0, 1] (1: no filter).
    eos_ids: ids that end a turn (kept as its last token; `models.loading.stop_ids`), up to 8 per compile.
    pad_id: id in [0, V) used inside the decode loop.
    keep_cache: keep the K/V between turns (True) or re-prefill the whole history each turn (False).
    logprob_temperature: tau_lp > 0, the temperature of the recorded log-probs (1: untempered;
      `sampler.Rollouts.logprobs`).
    history: "tokens" (ids of a turn extend those of the previous one, else ValueError) or "template"
      (they may not: the K/V past their common prefix is recomputed).

  Attributes:
    logprobs: list per turn of [n_i] float32 (float64 for a float64 model) log-probs at logprob_temperature.
    finished: list per turn of bool, the turn ended with an eos id.
    prefilled: tokens run through a prefill so far (the cost the kept cache saves).
    reprefills: turns whose ids did not extend the ids seen before (history "template").
    routes: a Qwen3-MoE model's recorded experts of the ids it has seen (`seen`: the prompt, every turn but its
      last token, the observations), [len(seen), layers, k] int32, each from the prefill or decode step that
      fed it (`sampler.Rollouts.routes`); None for a model without experts.

  Raises:
    ValueError: a history not in `rollout.chat.HISTORIES`, and on a call: ids not extending the ids of
      the previous turn (with keep_cache and history "tokens", naming both lengths),
      a budget < 1, len(ids) + budget > model.config.max_positions, an id outside [0, V).
  """

  def __init__(self, model: Llama, *, key: jax.Array, temperature: float = 1.0, top_p: float = 1.0,
               eos_ids: Sequence[int] = (), pad_id: int = 0, keep_cache: bool = True, logprob_temperature: float = 1.0,
               history: str = "tokens"):
    if history not in HISTORIES:
      raise ValueError(f"EpisodeSampler: history={history!r} is not one of {HISTORIES}")
    eos = np.asarray(list(eos_ids), np.int64).reshape(-1)
    check_sampling_inputs("EpisodeSampler", model.config, np.zeros(1, np.int32), eos, temperature=temperature,
                          top_p=top_p, pad_id=pad_id, logprob_temperature=logprob_temperature)
    if eos.size > 8:
      raise ValueError(f"EpisodeSampler: eos_ids has {eos.size} ids; at most 8")
    self.config = model.config
    self.graphdef, self.state = nnx.split(model)
    self.key, self.keep_cache = key, keep_cache
    self.greedy = temperature == 0
    self.scalars = dict(temperature=jnp.float32(1.0 if self.greedy else temperature), top_p=jnp.float32(top_p),
                        eos_ids=jnp.asarray(np.pad(eos, (0, 8 - eos.size), constant_values=-1), jnp.int32),
                        pad_id=jnp.int32(pad_id), logprob_temperature=jnp.float32(logprob_temperature))
    self.use_top_p = top_p < 1 and not self.greedy
    self.history = history
    self.blocks: list[KVBlock] = []   # K/V of self.seen
    self.block_routes: list = []      # per block, its ids' recorded experts [n, layers, k] (a mixture of experts')
    self.ends: list[int] = []         # len(self.seen) after each block
    self.seen: list[int] = []
    self.logits = None                # [1, V] after the last id of self.seen, when it was just prefilled
    self.turn, self.prefilled, self.reprefills = 0, 0, 0
    self.logprobs: list[np.ndarray] = []
    self.finished: list[bool] = []

  @classmethod
  def branches(cls, model: Llama, prompt_ids, num_branches: int, *, key: jax.Array, **kwargs) -> list:
    """G samplers whose episodes start from `prompt_ids`, its K/V prefilled once and shared (batch 1).

    Branch g has key fold_in(key, g); kwargs as the constructor (with keep_cache=False no K/V is
    shared: each branch prefills its own history, the reference).

    Raises:
      ValueError: num_branches < 1, an empty prompt or an id outside [0, V); the constructor's.
    """
    if num_branches < 1:
      raise ValueError(f"EpisodeSampler.branches: num_branches={num_branches!r} must be >= 1")
    samplers = [cls(model, key=jax.random.fold_in(key, g), **kwargs) for g in range(num_branches)]
    if samplers[0].keep_cache:
      first = samplers[0]
      first._prefill(list(np.asarray(prompt_ids).tolist()))
      for s in samplers[1:]:
        s.blocks, s.ends, s.seen, s.logits = list(first.blocks), list(first.ends), list(first.seen), first.logits
        s.block_routes = list(first.block_routes)
    return samplers

  @property
  def routes(self) -> np.ndarray | None:
    if not self.config.moe:
      return None
    empty = np.zeros((0, self.config.num_layers, self.config.experts_per_token), np.int32)
    return np.concatenate([empty, *self.block_routes])

  def _prefill(self, ids: list[int]) -> None:
    new = ids[len(self.seen):]
    if not new:
      raise ValueError("EpisodeSampler: ids is empty")
    prompt = np.asarray(new)
    if prompt.min() < 0 or prompt.max() >= self.config.vocab_size:
      raise ValueError(f"EpisodeSampler: ids must lie in [0, {self.config.vocab_size}), got {sorted(set(new))[:8]}")
    padded = np.zeros((1, bucket_length(len(new))), np.int32)
    padded[0, :len(new)] = new
    kv, self.logits, experts = _extend(self.graphdef, self.state, self.blocks, jnp.asarray(padded),
                                       jnp.int32(len(new)), jnp.int32(len(self.seen)))
    self.blocks.append(kv)
    self.block_routes.append(None if experts is None else np.asarray(experts[0, :len(new)], np.int32))
    self.seen = list(ids)
    self.ends.append(len(ids))
    self.prefilled += len(new)

  def _rewind(self, ids: list[int]) -> None:
    """Keep the blocks within the common prefix of `ids` and the ids seen (history "template")."""
    common = next((i for i, (a, b) in enumerate(zip(ids, self.seen)) if a != b), min(len(ids), len(self.seen)))
    keep = sum(end <= common for end in self.ends)   # ends increase: the leading blocks within the prefix
    keep -= bool(keep) and self.ends[keep - 1] == len(ids)   # a prefill needs >= 1 new id (for the logits)
    self.blocks, self.ends, self.block_routes = self.blocks[:keep], self.ends[:keep], self.block_routes[:keep]
    self.seen, self.logits = self.seen[:self.ends[-1] if keep else 0], None
    self.reprefills += 1

  def __call__(self, ids: Sequence[int], budget: int) -> list[int]:
    """Sample one turn continuing `ids` (the episode's ids so far: prompt, turns, observations).

    Returns:
      The turn's ids, 1..budget of them, ending with an eos id unless the budget cut them.
    """
    ids = [int(i) for i in ids]
    if not isinstance(budget, (int, np.integer)) or budget < 1:
      raise ValueError(f"EpisodeSampler: budget={budget!r} must be an int >= 1")
    if len(ids) + budget > self.config.max_positions:
      raise ValueError(f"EpisodeSampler: {len(ids)} ids + budget {budget} exceed model.config.max_positions="
                       f"{self.config.max_positions}")
    if not self.keep_cache:
      self.blocks, self.ends, self.seen, self.logits, self.block_routes = [], [], [], None, []
    elif ids[:len(self.seen)] != self.seen:
      if self.history != "template":
        raise ValueError(f"EpisodeSampler: ids ({len(ids)} tokens) do not extend the {len(self.seen)} ids of the "
                         "previous turns; an episode's history is never re-tokenized (rollout.chat.ChatTokens)")
      self._rewind(ids)
    if len(ids) > len(self.seen) or self.logits is None:
      self._prefill(ids)
    turn_key = jax.random.fold_in(self.key, self.turn)
    tokens, logprobs, lengths, done, cache, experts = _decode(
        self.graphdef, self.state, self.blocks, self.logits, jnp.int32(len(ids)), turn_key, **self.scalars,
        max_new_tokens=int(budget), greedy=self.greedy, use_top_p=self.use_top_p)
    n = int(lengths[0])
    sampled = np.asarray(tokens[0, :n]).tolist()
    # The decode cache holds the K/V of the tokens it fed: all but the last sampled one (slots < n - 1).
    self.blocks.append(cache)
    self.block_routes.append(None if experts is None else np.asarray(experts[0, :n - 1], np.int32))
    self.seen = ids + sampled[:-1]
    self.ends.append(len(self.seen))
    self.logits = None
    self.turn += 1
    self.logprobs.append(np.asarray(logprobs[0, :n]))
    self.finished.append(bool(done[0]))
    return sampled
