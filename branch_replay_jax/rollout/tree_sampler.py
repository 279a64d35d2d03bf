"""Tree rollouts: one prompt prefill, then fixed-length segments that branch (TreePO, arXiv 2508.17445).

With fanouts [F_1, ..., F_D] and segment length S, the prompt is run once (batch 1); F_1 child
segments of S tokens are sampled on top of it; each child that did not hit EOS gets F_2 children
sampled on top of [prompt ; child], and so on. A segment that hits EOS ends there (it keeps the
EOS token) and is a leaf: its descendants are never sampled. So does one that completes a stop
string (rollout/stop_strings.py; each child starts from its parent's automaton state, so the
string may span segments).

    fanouts [2, 2], S = 3, no EOS (node ids in preorder, `.` = bucket padding):

      node 0: prompt p0..p6 . . .          ancestors of node 2's decode:
        ├─ node 1: a0 a1 a2                  [ prompt, batch 1 | node 1's block, batch 1 | own cache, batch 2 ]
        │    ├─ node 2: b0 b1 b2             positions 7..9 for node 1, 10..12 for nodes 2 and 3
        │    └─ node 3: c0 c1 c2
        └─ node 4: d0 d1 d2
             ├─ node 5 ...
             └─ node 6 ...

Every ancestor is a K/V block with batch 1, broadcast by the suffix attention, never tiled per
child. The children of one node are decoded together (batch F_d) with `sampling.decode_from`.

K/V reuse, no extra segment forward: the decode cache of a segment holds the K/V of the tokens it
fed, i.e. all but the last. For segments that get children, the sampler runs ONE more decode step
that feeds the last token; it writes the last cache slot and yields the logits that start the
children. The added cost is one decode step (batch F_d) per internal node, instead of a full
forward over the segment. The children then attend to the parent's cache row as their ancestor
block, exactly the K/V a full-sequence forward would compute (up to float rounding).

Compiles: one prefill per prompt bucket, and one decode program per depth (its ancestors' shapes
are fixed per depth: prompt bucket, then d - 1 blocks of S tokens). Temperature, top-p's value,
the key, the EOS ids (up to 8), the stop strings (within a table's row count) and the prompt within
its bucket do not recompile.

Host work: one jitted call per internal node (depth-first), each followed by a device-to-host copy
of its children's tokens and EOS flags, which decides which children are expanded next.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from branch_replay_jax.kernels import KVBlock
from branch_replay_jax.models.llama import Llama
from branch_replay_jax.rollout.sampler import (bucketed_prompt_and_eos, check_sampling_inputs, decode_from, decode_step,
                                        prefill, stop_next_for, stop_reasons)
from branch_replay_jax.data.trees import RolloutTree

class TreeRollout(NamedTuple):
  """A sampled rollout tree (G trajectories, N nodes).

  tree: the RolloutTree. segments[0] is the prompt; every other segment is S sampled tokens
    (`last_segment_length` at depth D), or fewer when it ends with an EOS id. Node ids are in
    preorder (a node, then the subtrees of its children in sampling order), so `tree.ends`, the
    leaves, are in lexicographic order of their child-index paths: with fanouts [2, 2] and no EOS,
    trajectory g = 2 * i_1 + i_2 is child i_2 of child i_1.
  logprobs: per node, [L_n] float32 (float64 for a float64 model under jax_enable_x64) log π(token |
    context) under the untruncated model distribution at `logprob_temperature` (1 by default:
    UNTEMPERED), as in `sampler.Rollouts`; an
    empty array for the prompt (node 0).
  finished: [G] bool: trajectory g hit an EOS id or a stop string (False: it reached full depth
    without one); the stop reason, also as `truncated` = ~finished.
  stop_string: [G] bool, True where a stop string (not an EOS id) ended trajectory g; None from code
    that builds a TreeRollout without it (read as all False).
  routes: a Qwen3-MoE model's recorded experts per node, [L_n, layers, k] int32: node 0's the prompt's (from
    its one prefill), every other node's from the decode steps that fed its tokens (-1 where a token was
    drawn but never fed: a leaf's last token); None for a model without experts (`sampler.Rollouts.routes`).
  """

  tree: RolloutTree
  logprobs: list
  finished: np.ndarray
  stop_string: np.ndarray | None = None
  routes: list | None = None

  def stop_reasons(self) -> np.ndarray:
    """[G] str, per trajectory "eos", "stop_string" or "length" (`sampler.stop_reasons`)."""
    return stop_reasons(self.finished, self.stop_string)

  @property
  def truncated(self) -> np.ndarray:
    """[G] bool, the stop reason: True where trajectory g reached full depth without an EOS id or
    a stop string (cut by the token budget (D - 1) S + S_last), False where it ended with one (also on the
    budget's last token). GAE bootstraps the truncated ones (`objectives.gae`'s truncated_b)."""
    return ~self.finished

  def completion_logprobs(self, g: int) -> np.ndarray:
    """[len(tree.completion(g))] float32 log-probs of trajectory g's completion."""
    return np.concatenate([self.logprobs[n] for n in self.tree.path(self.tree.ends[g])[1:]])


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _prefill(graphdef, state, prompt_1t, prompt_len):
  return prefill(nnx.merge(graphdef, state), prompt_1t, prompt_len, with_routes=True)


@functools.partial(jax.jit, static_argnames=("graphdef", "num_children", "segment_length", "greedy", "use_top_p",
                                             "feed_last"))
def _expand(graphdef, state, ancestors, logits_1v, offset, node_key, temperature, top_p, eos_ids, pad_id, stop_next=None,
            stop_state=0, logprob_temperature=1.0, *, num_children, segment_length, greedy, use_top_p, feed_last):
  """Samples the children of one node. Child i's key is fold_in(fold_in(node_key, 1), i); its tokens are
  drawn with fold_in(child_key, 0) (then the step is folded in), so token draws and the keys handed to
  grandchildren never share a key. With `feed_last`, also returns the children's K/V [L, F, S, Hkv, D]
  with every slot written, and their next-token logits [F, V]. Every child starts from the node's stop-string
  automaton state `stop_state` (int32 scalar) and returns its own [F] (with the tokens, lengths,
  done and by_string flags). A Qwen3-MoE model also returns the experts each fed token ran [F, S, layers, k]
  (the last token's from the `feed_last` step; -1 where none was fed), else None."""
  model = nnx.merge(graphdef, state)
  child_keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.fold_in(node_key, 1), i))(jnp.arange(num_children))
  draw_keys = jax.vmap(lambda k: jax.random.fold_in(k, 0))(child_keys)
  tokens, logprobs, lengths, done, cache, by_string, stop_states, routes = decode_from(
      model, ancestors, logits_1v, offset, draw_keys, temperature=temperature, top_p=top_p if use_top_p else None,
      eos_ids=eos_ids, pad_id=pad_id, max_new_tokens=segment_length, greedy=greedy, stop_next=stop_next,
      stop_state=jnp.broadcast_to(stop_state, (num_children,)), logprob_temperature=logprob_temperature)
  flags = (done, by_string, stop_states)
  if not feed_last:
    return tokens, logprobs, lengths, flags, child_keys, None, None, routes
  # Rows that stopped early are leaves: their slot and logits here are garbage and never used.
  last = segment_length - 1
  logits, cache, experts = decode_step(model, tokens[:, last], offset + last, ancestors, cache, last)
  if routes is not None:   # the last token's experts, where it is the row's (a full segment that gets children)
    routes = routes.at[:, last].set(jnp.where((lengths > last)[:, None, None], experts.astype(jnp.int32), -1))
  return tokens, logprobs, lengths, flags, child_keys, cache, logits, routes


def _row(kv: KVBlock, i: int) -> KVBlock:
  """Child i's own block, batch 1: k, v [L, 1, S, Hkv, D], valid [1, S] (Qwen3.5's `HybridState`: and its
  linear layers' state after its last token, [L_linear, 1, ...])."""
  return type(kv)(**{f: x[i:i + 1] if f == "valid" else x[:, i:i + 1] for f, x in kv._asdict().items()})


def _validate(cfg, prompt, eos, *, fanouts, segment_length, last_segment_length, temperature, top_p, pad_id,
              logprob_temperature):
  if len(fanouts) == 0:
    raise ValueError("sample_tree: fanouts is empty; give at least one level, e.g. fanouts=[4]")
  for d, f in enumerate(fanouts):
    if int(f) != f or f < 1:
      raise ValueError(f"sample_tree: fanouts[{d}] must be an integer >= 1, got {f!r}")
  if segment_length < 1:
    raise ValueError(f"sample_tree: segment_length must be >= 1, got {segment_length}")
  if last_segment_length < 1:
    raise ValueError(f"sample_tree: last_segment_length must be >= 1, got {last_segment_length}")
  check_sampling_inputs("sample_tree", cfg, prompt, eos, temperature=temperature, top_p=top_p, pad_id=pad_id,
                        logprob_temperature=logprob_temperature)
  total = prompt.size + (len(fanouts) - 1) * segment_length + last_segment_length
  if total > cfg.max_positions:
    raise ValueError(f"sample_tree: prompt length {prompt.size} + {len(fanouts) - 1} x segment_length "
                     f"{segment_length} + last_segment_length {last_segment_length} = {total} exceeds "
                     f"model.config.max_positions={cfg.max_positions}")


def sample_tree(model: Llama, prompt_ids, *, fanouts: Sequence[int], segment_length: int, key: jax.Array,
                temperature: float = 1.0, top_p: float = 1.0, eos_ids: Sequence[int] = (), pad_id: int = 0,
                last_segment_length: int | None = None,
                prompt_bucket: int | None = None, stop_table=None, logprob_temperature: float = 1.0) -> TreeRollout:
  """Samples a tree of fixed-length segments on one shared prompt prefill (see the module docstring).

  Without EOS the tree has prod(fanouts) trajectories, each of (D - 1) * S + S_last tokens, and
  1 + F_1 + F_1 F_2 + ... nodes. Node n's segment is sampled with one decode loop per parent, on
  top of the batch-1 K/V blocks of its ancestors.

  Args:
    model: the decoder.
    prompt_ids: [P] int token ids, P >= 1.
    fanouts: [F_1, ..., F_D], children per node at each depth, each >= 1 (D = len(fanouts) >= 1).
    segment_length: S >= 1, tokens per segment at depths 1..D-1 (and at D unless overridden).
    key: PRNG key. Node keys follow the child-index path (child i of a node with key k has key
      fold_in(fold_in(k, 1), i), the root has `key`), so the same key gives the same tree, and a
      path's tokens do not depend on whether another branch stopped.
    temperature: >= 0; 0 means greedy (then every sibling equals the others).
    top_p: nucleus mass in (0, 1]; 1 disables the filter. Applied after the temperature.
    eos_ids: ids that end a path (kept as the segment's last token); up to 8 share one compile.
    pad_id: id in [0, V) used for padding inside the sampler (never in the returned segments).
    last_segment_length: S_last >= 1, tokens of the depth-D segments; default S.
    prompt_bucket: padded prompt length (>= P); default `data.groups.bucket_length(P)`.
    stop_table: a `rollout.stop_strings.StopTable`, or None: a path ends on the token that completes
      one of its stop strings in its decoded text, also one that spans segments (each child starts
      from its parent's automaton state); the segment keeps that token as its last and is a leaf.
    logprob_temperature: tau_lp > 0, the temperature of the recorded log-probs (`TreeRollout.logprobs`).

  Returns:
    TreeRollout (see its docstring for the node order and log-prob convention).

  Raises:
    ValueError: empty fanouts, a fanout < 1, segment_length or
      last_segment_length < 1, temperature < 0, logprob_temperature not a finite number > 0, top_p
      outside (0, 1], an empty or non-1-D prompt, an id
      outside [0, V), P + (D - 1) S + S_last > max_positions, prompt_bucket < P, a stop table wider
      than the vocabulary.
  """
  prompt = np.asarray(prompt_ids)
  eos = np.asarray(list(eos_ids), np.int64).reshape(-1)
  fanouts = list(fanouts)
  s_last = segment_length if last_segment_length is None else last_segment_length
  _validate(model.config, prompt, eos, fanouts=fanouts, segment_length=segment_length, last_segment_length=s_last,
            temperature=temperature, top_p=top_p, pad_id=pad_id, logprob_temperature=logprob_temperature)
  stop_next = stop_next_for("sample_tree", model.config, stop_table)
  fanouts = [int(f) for f in fanouts]
  p = prompt.size
  padded, eos = bucketed_prompt_and_eos("sample_tree", prompt, prompt_bucket, eos)
  eos = jnp.asarray(eos, jnp.int32)
  graphdef, state = nnx.split(model)
  greedy = temperature == 0
  scalars = dict(temperature=jnp.float32(1.0 if greedy else temperature), top_p=jnp.float32(top_p), eos_ids=eos,
                 pad_id=jnp.int32(pad_id), stop_next=stop_next, logprob_temperature=jnp.float32(logprob_temperature))
  static = dict(greedy=greedy, use_top_p=top_p < 1 and not greedy)

  segments, parents, logprobs = [prompt.astype(np.int32)], [-1], [np.zeros((0,), np.float32)]
  ends, finished, by_strings = [], [], []
  prompt_kv, logits_1v, prompt_routes = _prefill(graphdef, state, jnp.asarray(padded), jnp.int32(p))
  routes = None if prompt_routes is None else [np.asarray(prompt_routes[0, :p], np.int32)]

  def visit(node, depth, ancestors, logits_1v, node_key, offset, stop_state):
    last_level = depth + 1 == len(fanouts)
    seg_len = s_last if last_level else segment_length
    tokens, lps, lengths, flags, child_keys, kv, next_logits, node_routes = _expand(
        graphdef, state, ancestors, logits_1v, jnp.int32(offset), node_key, **scalars, stop_state=stop_state,
        **static, num_children=fanouts[depth], segment_length=seg_len, feed_last=not last_level)
    tokens, lps, lengths, done, by_string = (np.asarray(x) for x in (tokens, lps, lengths, *flags[:2]))
    node_routes = None if node_routes is None else np.asarray(node_routes)
    for i in range(fanouts[depth]):
      child = len(segments)
      segments.append(tokens[i, :lengths[i]])
      parents.append(node)
      logprobs.append(lps[i, :lengths[i]])
      if routes is not None:
        routes.append(node_routes[i, :lengths[i]])
      if done[i] or last_level:
        ends.append(child)
        finished.append(bool(done[i]))
        by_strings.append(bool(by_string[i]))
      else:
        visit(child, depth + 1, [*ancestors, _row(kv, i)], next_logits[i:i + 1], child_keys[i], offset + seg_len,
              flags[2][i])

  visit(0, 0, [prompt_kv], logits_1v, key, p, jnp.int32(0))
  tree = RolloutTree(tuple(segments), tuple(parents), tuple(ends))
  return TreeRollout(tree, logprobs, np.asarray(finished, bool), np.asarray(by_strings, bool), routes)
