"""Tree sampler: tree shape, KV reuse (log-probs == full forwards), EOS leaves, keys, compiles, replay, drawing."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import forward_logits, jaxpr_shapes

from branch_replay_jax import losses as obj
from branch_replay_jax.rollout import tree_sampler as tree_sampling
from branch_replay_jax.kernels import KVBlock
from branch_replay_jax.models import Llama, tiny_config
from branch_replay_jax.outputs.plots import draw_tree
from branch_replay_jax.data.batches import tree_arrays
from branch_replay_jax.rollout.sampler import sample_group
from branch_replay_jax.data.counts import tree_counts
from branch_replay_jax.data.trees import pad_tree
from branch_replay_jax.rollout.tree_sampler import TreeRollout, sample_tree
from branch_replay_jax.gradients.heads import POLICY
from branch_replay_jax.gradients.step import value_and_grad

PROMPT = [3, 17, 42, 8, 9, 60, 1]
P = len(PROMPT)


@pytest.fixture(scope="module")
def model():
  return Llama(tiny_config(), rngs=nnx.Rngs(0))


def full_logprobs(model, prompt, completion):
  """log_softmax of ONE forward over prompt + completion (no cache, no blocks) at the positions that predict the
  completion (position P - 1 + i predicts token i). Right-padded to 32 tokens to compile once; causal attention
  keeps the padding out of earlier positions."""
  seq = list(prompt) + list(completion)
  assert len(seq) <= 32
  logits = forward_logits(model, jnp.asarray([seq + [0] * (32 - len(seq))], jnp.int32))
  logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
  return logp[len(prompt) - 1 + np.arange(len(completion)), np.asarray(completion)]


@pytest.mark.parametrize("fanouts, parents", [
    ([2, 2], (-1, 0, 1, 1, 0, 4, 4)),
    ([4, 2, 2], None),
])
def test_shape_without_eos(model, fanouts, parents):
  # No EOS: every node at depth < D has F_d children, so 1 + F_1 + F_1 F_2 + ... nodes and prod(fanouts) leaves,
  # each segment S tokens; computed positions P + S * (nodes - 1), naive G (P + D S). For [2, 2] in preorder:
  # node 1 = child 0 of the root with children 2, 3; node 4 = child 1 with children 5, 6.
  s = 4
  r = sample_tree(model, PROMPT, fanouts=fanouts, segment_length=s, key=jax.random.key(0))
  tree = r.tree
  sizes = np.cumprod(fanouts)
  g, d = int(sizes[-1]), len(fanouts)
  assert isinstance(r, TreeRollout)
  assert tree.num_nodes == 1 + sizes.sum() and len(tree.ends) == g
  if parents is not None:
    assert tree.parents == parents and tree.ends == (2, 3, 5, 6)
  assert all(not tree.children(e) for e in tree.ends) and sorted(tree.ends) == list(tree.ends)
  np.testing.assert_array_equal(tree.segments[0], PROMPT)
  assert all(len(seg) == s for seg in tree.segments[1:])
  np.testing.assert_array_equal(tree.completion_lengths(), [d * s] * g)
  assert r.logprobs[0].shape == (0,) and all(lp.shape == (s,) for lp in r.logprobs[1:])
  assert r.finished.shape == (g,) and not r.finished.any()
  counts = tree_counts(tree)
  assert counts["token_positions_computed"] == P + s * int(sizes.sum())
  assert counts["token_positions_naive"] == g * (P + d * s)


def test_last_segment_length(model):
  # [2, 2] with S = 4 and S_last = 3: depth-1 nodes hold 4 tokens, leaves 3; completions 7; computed 7 + 2*4 + 4*3.
  r = sample_tree(model, PROMPT, fanouts=[2, 2], segment_length=4, last_segment_length=3, key=jax.random.key(0))
  assert [len(seg) for seg in r.tree.segments[1:]] == [4, 3, 3, 4, 3, 3]
  assert tree_counts(r.tree)["token_positions_computed"] == 27


def test_logprobs_match_full_forward(model):
  # Every node is decoded on batch-1 ancestor blocks (prompt bucket with padding, then each parent's decode
  # cache row) at offsets P, P + S. If a block, offset or mask were wrong, the log-probs would differ from those
  # of one full forward over prompt + path; with them right only float32 reassociation remains (~1e-6).
  r = sample_tree(model, PROMPT, fanouts=[2, 2], segment_length=5, key=jax.random.key(1), temperature=0.8,
                  top_p=0.9)
  for g in range(4):
    completion = r.tree.completion(g)
    assert completion.size == 10
    np.testing.assert_allclose(r.completion_logprobs(g), full_logprobs(model, PROMPT, completion), atol=1e-5, rtol=0)


def test_greedy_tree_equals_greedy_sample_group(peaked_model):
  # Temperature 0 is argmax decoding, so every trajectory is the greedy continuation of the prompt: the 8 tokens
  # sample_group draws greedily (one cache, no segments). Scaled logits make near-ties impossible.
  r = sample_tree(peaked_model, PROMPT, fanouts=[2, 2], segment_length=4, key=jax.random.key(0), temperature=0.0)
  want = sample_group(peaked_model, PROMPT, num_samples=1, max_new_tokens=8, key=jax.random.key(0), temperature=0.0)
  for g in range(4):
    np.testing.assert_array_equal(r.tree.completion(g), np.asarray(want.tokens[0]))
    np.testing.assert_allclose(r.completion_logprobs(g), np.asarray(want.logprobs[0]), atol=1e-5, rtol=0)


def test_eos_makes_a_leaf_and_other_paths_continue(model):
  # Keys follow the child-index path, so adding an EOS id changes nothing before it. With eos = the 3rd token of
  # node 1 (child 0 of the root), absent from its first two tokens and from node 4's subtree (nodes 4, 5, 6), the
  # tree becomes: prompt, node 1 cut to 3 tokens (a finished leaf, its children never sampled), node 4 and its
  # children unchanged -> 5 nodes, parents (-1, 0, 0, 2, 2), ends (1, 3, 4), finished (True, False, False).
  kw = dict(fanouts=[2, 2], segment_length=4, key=jax.random.key(2))
  free = sample_tree(model, PROMPT, **kw)
  seg = [s.tolist() for s in free.tree.segments]
  eos = seg[1][2]
  assert eos not in seg[1][:2] and all(eos not in seg[n] for n in (4, 5, 6))
  r = sample_tree(model, PROMPT, eos_ids=[eos], pad_id=63, **kw)
  assert r.tree.parents == (-1, 0, 0, 2, 2) and r.tree.ends == (1, 3, 4)
  np.testing.assert_array_equal(r.finished, [True, False, False])
  assert [s.tolist() for s in r.tree.segments] == [PROMPT, seg[1][:3], seg[4], seg[5], seg[6]]
  for n, m in zip(range(1, 5), (1, 4, 5, 6)):
    np.testing.assert_allclose(r.logprobs[n], free.logprobs[m][:len(r.tree.segments[n])], atol=1e-6, rtol=0)


def test_same_key_same_tree_other_key_differs(model):
  # The sampler is a pure function of the key. Two keys agree on the 24 drawn tokens of a near-uniform 64-token
  # model with probability ~64**-24, i.e. never.
  kw = dict(fanouts=[2, 2], segment_length=4, eos_ids=[5])
  a, b, c = (sample_tree(model, PROMPT, key=jax.random.key(k), **kw) for k in (7, 7, 8))
  assert a.tree.parents == b.tree.parents and a.tree.ends == b.tree.ends
  for x, y, lx, ly in zip(a.tree.segments, b.tree.segments, a.logprobs, b.logprobs):
    np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(lx, ly)
  np.testing.assert_array_equal(a.finished, b.finished)
  assert [s.tolist() for s in a.tree.segments] != [s.tolist() for s in c.tree.segments]


def test_second_tree_does_not_recompile(model):
  # Programs are keyed by shapes: the prompt bucket (5 and 11 tokens both pad to 16) and per depth the ancestors'
  # shapes. Key, temperature, top_p's value and EOS ids are traced values, so a second tree compiles nothing.
  kw = dict(fanouts=[2, 2], segment_length=5, temperature=0.8, top_p=0.9)
  sample_tree(model, PROMPT[:5], key=jax.random.key(3), **kw)
  before = (tree_sampling._prefill._cache_size(), tree_sampling._expand._cache_size())
  sample_tree(model, (PROMPT * 2)[:11], key=jax.random.key(4), **{**kw, "temperature": 1.3, "top_p": 0.5},
              eos_ids=[1, 2])
  assert (tree_sampling._prefill._cache_size(), tree_sampling._expand._cache_size()) == before


def test_ancestors_are_never_tiled(model):
  # A depth-2 decode of F = 3 children of 3 tokens on top of the prompt block [L, 1, 16, Hkv, D] and the parent's
  # block [L, 1, 4, Hkv, D]: no intermediate anywhere (decode loop, attention) has a [3, 16 or 4, Hkv, D] copy.
  cfg, f = model.config, 3
  graphdef, state = nnx.split(model)
  hd = (cfg.num_kv_heads, cfg.head_dim)
  block = lambda s: KVBlock(jnp.zeros((cfg.num_layers, 1, s, *hd)), jnp.zeros((cfg.num_layers, 1, s, *hd)),
                           jnp.ones((1, s), bool))

  def run(state):
    return tree_sampling._expand(graphdef, state, [block(16), block(4)], jnp.zeros((1, cfg.vocab_size)), jnp.int32(11),
                                 jax.random.key(0), jnp.float32(1), jnp.float32(0.9), jnp.full((8,), -1, jnp.int32),
                                 jnp.int32(0), num_children=f, segment_length=3, greedy=False, use_top_p=True,
                                 feed_last=False)

  shapes = [tuple(s) for s in jaxpr_shapes(jax.make_jaxpr(run)(state).jaxpr)]
  assert (cfg.num_layers, f, 3, *hd) in shapes                    # the children's own cache
  assert not [s for s in shapes if s[-4:] in ((f, 16, *hd), (f, 4, *hd))]


@pytest.mark.parametrize("override, field", [
    (dict(fanouts=[]), "fanouts"),
    (dict(fanouts=[2, 0]), r"fanouts\[1\]"),
    (dict(segment_length=0), "segment_length"),
    (dict(last_segment_length=0), "last_segment_length"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(prompt_ids=[]), "prompt_ids"),
    (dict(prompt_ids=[1, 64]), "prompt_ids"),
    (dict(eos_ids=[-1]), "eos_ids"),
    (dict(pad_id=64), "pad_id"),
    (dict(fanouts=[2, 2, 2], segment_length=84), "max_positions"),
    (dict(fanouts=[2, 2, 2], segment_length=83, last_segment_length=84), "max_positions"),
    (dict(prompt_bucket=4), "prompt_bucket"),
])
def test_bad_input_raises(model, override, field):
  # tiny_config: vocab 64, max_positions 256. A 7-token prompt and depth 3: 7 + 3 * 83 = 256 fits, but
  # 7 + 3 * 84 = 259 and 7 + 2 * 83 + 84 = 257 do not. The prompt bucket 4 is shorter than the 7-token prompt.
  kw = dict(prompt_ids=PROMPT, fanouts=[2], segment_length=4, key=jax.random.key(0))
  kw.update(override)
  with pytest.raises(ValueError, match=field):
    sample_tree(model, kw.pop("prompt_ids"), **kw)


_tree_step = jax.jit(functools.partial(value_and_grad, POLICY), static_argnums=(0, 3))


def test_sampled_tree_replays(model):
  # The sampled tree goes through pad_tree and nested replay. Replay recomputes each node's log-probs from the
  # parameters; they equal the sampler's (1e-5). With old_logp = those log-probs the PPO ratio is 1, so with
  # beta = 0 each (token, trajectory) loss is -A_g and the sequence-mean loss is -sum(A) / G = -10 / 4 = -2.5.
  r = sample_tree(model, PROMPT, fanouts=[2, 2], segment_length=5, key=jax.random.key(1), temperature=0.8,
                  top_p=0.9)
  tree, padded = r.tree, pad_tree(r.tree)
  adv = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
  w = obj.trajectory_weights(tree.completion_lengths(), mode="sequence_mean")
  per_node = {"weights": [x.astype(np.float32) for x in tree.node_weights(w)], "old_logp": r.logprobs}
  objective = functools.partial(obj.grpo_objective, clip_eps=0.2, kl_coef=0.0, on_policy=False)
  graphdef, params = nnx.split(model)
  loss, aux, grads = _tree_step(graphdef, params, tree_arrays(padded, per_node, advantage=adv), objective)
  assert float(loss) == pytest.approx(-2.5, abs=1e-5)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(grads))
  for d in (1, 2):
    np.testing.assert_allclose(np.asarray(aux[d - 1].logp), padded.place(r.logprobs, d), atol=1e-5, rtol=0)


def test_draw_tree(model, tmp_path):
  # An EOS-cut tree (ragged depths) with one reward per trajectory draws a non-empty PNG; a reward count that
  # does not match the trajectories is refused.
  r = sample_tree(model, PROMPT, fanouts=[2, 2], segment_length=4, key=jax.random.key(2), eos_ids=[32])
  rewards = np.linspace(0.0, 1.0, len(r.tree.ends))
  path = os.path.join(tmp_path, "tree.png")
  draw_tree(r.tree, rewards, path, title="fanouts [2, 2], S = 4")
  assert os.path.getsize(path) > 1000
  with pytest.raises(ValueError, match="rewards"):
    draw_tree(r.tree, rewards[:-1], path)


def test_sample_tree_reports_the_stop_reason(model):
  # fanouts [2, 2], S = 3: budget 6 tokens per trajectory. EOS = trajectory 0's 6th token, absent
  # elsewhere in the tree: trajectory 0 ends there (finished on the budget's last token, not
  # truncated), the other three are cut by the budget (truncated).
  kw = dict(fanouts=[2, 2], segment_length=3)
  for seed in range(100):
    free = sample_tree(model, PROMPT, key=jax.random.key(seed), **kw)
    tree = free.tree
    eos = int(tree.completion(0)[-1])
    others = [int(t) for n in range(1, len(tree.segments)) if n != tree.ends[0] for t in tree.segments[n]]
    if eos not in others and eos not in tree.segments[tree.ends[0]][:-1].tolist():
      break
  else:
    raise AssertionError("no key found")
  assert free.truncated.tolist() == [True] * 4
  stopped = sample_tree(model, PROMPT, key=jax.random.key(seed), eos_ids=[eos], **kw)
  assert stopped.tree.parents == tree.parents
  assert len(stopped.tree.completion(0)) == 6
  assert stopped.truncated.tolist() == [False, True, True, True]
