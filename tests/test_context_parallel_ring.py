"""Ring attention over the seq axis (kernels/context_parallel.ring_prompt_attention) against the unsharded attention.

A prompt split over seq = 2, 4 or 8 fake CPU devices (the data axis takes the rest of the 8); each
device runs the ring for its chunk inside `shard_map(check_vma=True)`. Expected: `suffix_attention`
on the whole prompt on one device (itself checked against textbook attention in test_kernels.py and
test_reference_tiling.py): out, lse and the gradients of a loss with cotangents on both (so the lse
cotangent's path is checked too) w.r.t. q, k and v. Float64 to rounding (<= 1e-10 relative: the
ring only regroups the softmax's sums), float32 to <= 1e-5 (~100 float32 ulps of the output scale).
QUERY_CHUNK and KEY_BLOCK are shrunk (monkeypatch) so that each chunk's own block and each visiting
block loop over several query chunks and key tiles.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import max_rel_err
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from branch_replay_jax.distributed.mesh import make_mesh
from branch_replay_jax.kernels import reference
from branch_replay_jax.kernels.context_parallel import over_sharded_prompt, prompt_chunk_attention, ring_prompt_attention
from branch_replay_jax.kernels.reference import KVBlock, suffix_attention

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")


def _inputs(dtype, tokens: int, first: int, end: int, seed: int = 0):
  """q [1, tokens, 4, 8], k, v [1, tokens, 2, 8] (GQA, 2 query heads per KV head), valid keys at
  positions [first, end), and random cotangents for out and lse."""
  rng = np.random.default_rng(seed)
  n = lambda *s: jnp.asarray(rng.normal(size=s), dtype)
  pos = jnp.arange(tokens)[None]
  return (n(1, tokens, 4, 8), n(1, tokens, 2, 8), n(1, tokens, 2, 8), (pos >= first) & (pos < end),
          n(1, tokens, 4, 8), n(1, tokens, 4))


def _loss(attention, q, k, v, valid, d_out, d_lse):
  out, lse = attention(q, [], KVBlock(k, v, valid))
  return jnp.sum(out * d_out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * d_lse), (out, lse)


def _sharded(attention, seq: int, inputs):
  """(loss, (out, lse), (dq, dk, dv)) with the prompt split over seq inside shard_map."""
  mesh = make_mesh(8 // seq, 1, seq)

  def per_device(*args):
    (val, aux), grads = jax.value_and_grad(functools.partial(_loss, attention), argnums=(0, 1, 2), has_aux=True)(*args)
    return jax.lax.psum(val, "seq"), aux, grads

  spec = P(None, "seq")
  with jax.set_mesh(mesh):
    args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in inputs]
    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(spec,) * 6,
                                 out_specs=(P(), (spec, spec), (spec,) * 3), check_vma=True))(*args)


def _unsharded(inputs):
  return jax.value_and_grad(functools.partial(_loss, suffix_attention), argnums=(0, 1, 2), has_aux=True)(*inputs)


def _compare(got, want):
  """max relative error of out, lse (finite entries; the -inf pattern must match) and the gradients."""
  (_, (out, lse), grads), ((_, (w_out, w_lse)), w_grads) = got, want
  assert np.array_equal(np.isinf(lse), np.isinf(w_lse))
  finite = lambda x: jnp.where(jnp.isfinite(x), x, 0.0)
  return max(max_rel_err(out, w_out), max_rel_err(finite(lse), finite(w_lse)), max_rel_err(grads, w_grads))


# (seq, prompt tokens, first valid, end of valid): C = tokens / seq tokens per device
CASES = {
    # 2 tokens per device; chunk 0 all padding (its queries see no key: out 0, lse -inf), chunks 6
    # and 7 all padding (their queries see the valid keys before them)
    "seq8-padded-chunks": (8, 16, 2, 11),
    # 10 tokens per device: 2 query chunks of 5 (QUERY_CHUNK 8), visiting blocks of 3 tiles of 3 keys
    # + 1 (KEY_BLOCK 3); the padding starts and ends inside chunks
    "seq4-tiled-chunks": (4, 40, 3, 33),
    # 20 tokens per device, every key valid, 3 query chunks of 7 (one padded query per device)
    "seq2-no-padding": (2, 40, 0, 40),
}


@pytest.mark.parametrize("name", list(CASES))
def test_ring_attention_equals_unsharded_attention_float64(x64, monkeypatch, name):
  # Float64: the ring regroups the same softmax sums (own chunk, then earlier chunks merged by
  # log-sum-exp), so out, lse and dq, dk, dv equal the one-device attention to rounding (<= 1e-10).
  monkeypatch.setattr(reference, "QUERY_CHUNK", 8)
  monkeypatch.setattr(reference, "KEY_BLOCK", 3)
  seq, tokens, first, end = CASES[name]
  inputs = _inputs(jnp.float64, tokens, first, end)
  got, want = _sharded(ring_prompt_attention(), seq, inputs), _unsharded(inputs)
  assert float(jnp.abs(want[1][0]).max()) > 0                      # not vacuous: nonzero gradients
  assert _compare(got, want) <= 1e-10


def test_ring_attention_equals_unsharded_attention_float32(monkeypatch):
  # Float32 against the one-device float32 attention: <= 1e-5 (~100 ulps of the output scale), the
  # bound of the other float32 mesh tests.
  monkeypatch.setattr(reference, "QUERY_CHUNK", 8)
  monkeypatch.setattr(reference, "KEY_BLOCK", 3)
  inputs = _inputs(jnp.float32, 40, 3, 33, seed=1)
  assert _compare(_sharded(ring_prompt_attention(), 4, inputs), _unsharded(inputs)) <= 1e-5


def test_branches_over_the_sharded_prompt_equal_unsharded_attention_float64(x64, monkeypatch):
  # Two 13-token branches (2 query chunks of 7) over a 40-token prompt split 10 keys per device over
  # seq = 4 (3 key tiles of 3 + 1; keys 0..2 and 33..39 padding, so the last device's chunk is all
  # padding): each device attends to its chunk by the tiled attention (over_sharded_prompt's partial
  # softmax), merged across seq by log-sum-exp; the prompt is the whole model's (ring). Expected: the
  # one-device attention, loss Σ prompt out·w + Σ branch (out·w + lse·w'), gradients w.r.t. the
  # prompt's q, k, v and the branches' q, k, v, to rounding (<= 1e-10). Each device holds its
  # chunk's prompt term and 1/4 of the (replicated) branch term.
  monkeypatch.setattr(reference, "QUERY_CHUNK", 8)
  monkeypatch.setattr(reference, "KEY_BLOCK", 3)
  qp, kp, vp, pvalid, wp, _ = _inputs(jnp.float64, 40, 3, 33, seed=2)
  rng = np.random.default_rng(3)
  n = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float64)
  qb, kb, vb, wb, wl = n(2, 13, 4, 8), n(2, 13, 2, 8), n(2, 13, 2, 8), n(2, 13, 4, 8), n(2, 13, 4)
  bvalid = jnp.arange(13)[None] < jnp.array([[13], [9]])

  def loss(attn_prompt, attn_branch, share, qp, kp, vp, pvalid, wp, qb, kb, vb):
    out_p, _ = attn_prompt(qp, [], KVBlock(kp, vp, pvalid))
    out_b, lse_b = attn_branch(qb, [KVBlock(kp, vp, pvalid)], KVBlock(kb, vb, bvalid))
    return jnp.sum(out_p * wp) + share * (jnp.sum(out_b * wb) + jnp.sum(lse_b * wl))
  want, want_grads = jax.value_and_grad(functools.partial(loss, suffix_attention, suffix_attention, 1.0),
                                        argnums=(0, 1, 2, 5, 6, 7))(qp, kp, vp, pvalid, wp, qb, kb, vb)

  def per_device(qp, kp, vp, pvalid, wp, qb, kb, vb):
    f = functools.partial(loss, ring_prompt_attention(), over_sharded_prompt(suffix_attention), 1 / 4)
    val, grads = jax.value_and_grad(f, argnums=(0, 1, 2, 5, 6, 7))(qp, kp, vp, pvalid, wp, qb, kb, vb)
    return jax.lax.psum(val, "seq"), grads      # qb, kb, vb enter invariant: their grads come back summed

  mesh, spec = make_mesh(2, 1, 4), P(None, "seq")
  with jax.set_mesh(mesh):
    args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (qp, kp, vp, pvalid, wp)]
    args += [jax.device_put(x, NamedSharding(mesh, P())) for x in (qb, kb, vb)]
    val, grads = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(spec,) * 5 + (P(),) * 3,
                                       out_specs=(P(), (spec,) * 3 + (P(),) * 3), check_vma=True))(*args)
  assert abs(float(val) - float(want)) <= 1e-10 * abs(float(want))
  assert max_rel_err(grads, want_grads) <= 1e-10


def _collectives(attention):
  """Names of the collectives in the compiled fwd+bwd HLO of a 64-token prompt over seq = 8."""
  inputs = _inputs(jnp.float32, 64, 0, 64)
  mesh = make_mesh(1, 1, 8)
  spec = P(None, "seq")
  grad = lambda *a: jax.grad(lambda *b: _loss(attention, *b)[0], argnums=(0, 1, 2))(*a)
  with jax.set_mesh(mesh):
    f = jax.jit(jax.shard_map(grad, mesh=mesh, in_specs=(spec,) * 6, out_specs=(spec,) * 3, check_vma=True))
    hlo = f.lower(*[jax.device_put(x, NamedSharding(mesh, spec)) for x in inputs]).compile().as_text()
  return {name for name in ("all-gather", "collective-permute", "reduce-scatter", "all-reduce") if name + "(" in hlo
          or name + "-start(" in hlo}


def test_ring_attention_moves_k_v_by_permutes_not_gathers():
  # The point of the ring: no device gathers the whole prompt's K/V. Its compiled forward and
  # backward exchange chunks by collective-permutes only; the all-gather wrapper, compiled the same
  # way, all-gathers (and so it is the check's counter-example: the check can fail).
  assert _collectives(ring_prompt_attention()) == {"collective-permute"}
  assert "all-gather" in _collectives(prompt_chunk_attention(suffix_attention))


def test_ring_attention_refuses_ancestors():
  # A sharded prompt is the root of its rollout tree: an ancestor block is a caller's mistake.
  q, k, v, valid, _, _ = _inputs(jnp.float32, 4, 0, 4)
  with pytest.raises(ValueError, match="ring_prompt_attention: got 1 ancestor blocks"):
    ring_prompt_attention()(q, [KVBlock(k, v, valid)], KVBlock(k, v, valid))
