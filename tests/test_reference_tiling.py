"""The tiled path of the jnp reference attention (kernels/tiled_attention.py) against naive attention.

`suffix_attention` loops over query chunks (QUERY_CHUNK) and key tiles (KEY_BLOCK) with the
online softmax once a segment has more than QUERY_CHUNK queries or an ancestor block more than
KEY_BLOCK keys. These tests shrink the two constants to 8 and 16 (monkeypatch; they are read at
call time) so that shapes of a few dozen tokens run many chunks and tiles, and compare out, lse
and every gradient (with cotangents on out and lse) with `textbook_attention` (one concatenated
softmax, differentiated by autodiff), in float64 to rounding (<= 1e-12 relative, the bound of the
dense path's test) and in float32 against float64 (<= 1e-5: ~100 float32 ulps of the output scale).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import jaxpr_shapes
from test_kernels import FLOOR, Case, make_inputs, rel_err, run, textbook_attention

from branch_replay_jax.kernels import KVBlock, reference, suffix_attention

CHUNK, KEY_BLOCK = 8, 16

# (with CHUNK = 8, KEY_BLOCK = 16)
TILED = {
    # 4 chunks, the last one 5 of 8 queries (T padded to 32); ancestors of 3 full tiles + 2 keys
    # (shared by the 3 rows), exactly one tile, and empty; random padded keys and ragged rows.
    "chunks-and-tiles-shared-ragged": Case(jnp.float64, b=3, t=29, s_anc=(50, 16, 0), hq=4, hkv=2, d=16,
                                           pad_keys=True, pad_queries=True, shared=True),
    # one chunk (a completion) over a prompt of 4 tiles + 6 keys: only the keys are tiled
    "one-chunk-long-ancestor": Case(jnp.float64, b=2, t=5, s_anc=(70,), hq=6, hkv=2, d=8, pad_keys=True,
                                    shared=True),
    # a prompt's own forward: 5 chunks of own keys (causal diagonal tiles + earlier tiles), no ancestor
    "prompt-own-keys-only": Case(jnp.float64, b=1, t=37, s_anc=(), hq=3, hkv=1, d=8, pad_queries=True),
    # T and S exact multiples: no padded queries, no remainder tile; ancestor with batch B
    "exact-multiples-batched-ancestor": Case(jnp.float64, b=2, t=32, s_anc=(48,), hq=2, hkv=2, d=8,
                                             pad_keys=True),
}


@pytest.fixture
def small_tiles(monkeypatch):
  monkeypatch.setattr(reference, "QUERY_CHUNK", CHUNK)
  monkeypatch.setattr(reference, "KEY_BLOCK", KEY_BLOCK)


def _assert_close(got, want, bound):
  for i, (x, y) in enumerate(zip(got, want)):
    assert x.shape == y.shape, (i, x.shape, y.shape)
    assert rel_err(x, y) <= bound, (i, rel_err(x, y))


def _rounded(inputs, dtype):
  """The inputs rounded to `dtype` and back to float64 (masks untouched): the exact value of a
  `dtype` computation is the float64 one on these."""
  return jax.tree_util.tree_map(lambda x: np.asarray(jnp.asarray(x, dtype), np.float64) if x.dtype != bool else x,
                                inputs)


@pytest.mark.parametrize("name", list(TILED))
def test_tiled_float64_equals_textbook_attention(x64, small_tiles, name):
  # Same function as the dense step, so the same bound: out, lse, dQ, dK/dV of every block within
  # 1e-12 of autodiff through one softmax over the concatenated keys.
  inputs = make_inputs(TILED[name], seed=1)
  _assert_close(run(suffix_attention, jnp.float64, inputs), run(textbook_attention, jnp.float64, inputs), 1e-12)


@pytest.mark.parametrize("name", list(TILED))
def test_tiled_float32_within_1e5_of_float64(small_tiles, name):
  inputs = make_inputs(TILED[name], seed=2)
  got = run(suffix_attention, jnp.float32, inputs)
  with jax.enable_x64(True):
    want = run(textbook_attention, jnp.float64, _rounded(inputs, jnp.float32))
  _assert_close(got, want, 1e-5)


def test_tiled_default_constants_float32(x64):
  # The shipped QUERY_CHUNK = 256, KEY_BLOCK = 512: T = 301 is two chunks of 151 queries (one padded),
  # S = 600 one full tile and a remainder of 88 keys. float32 within 1e-5 of float64.
  assert (reference.QUERY_CHUNK, reference.KEY_BLOCK) == (256, 512)
  inputs = make_inputs(Case(jnp.float32, b=1, t=301, s_anc=(600,), hq=2, hkv=1, d=8, pad_keys=True), seed=3)
  with jax.enable_x64(False):
    got = run(suffix_attention, jnp.float32, inputs)
  _assert_close(got, run(textbook_attention, jnp.float64, _rounded(inputs, jnp.float32)), 1e-5)


def _masked_tile_inputs(seed):
  """b=2, T=12 (2 chunks), ancestors of 48 and 20 keys. Ancestor 0's keys 16..31 (its whole tile 1)
  are padding in both rows; ancestor 1 (a tile and a 4-key remainder) is all padding."""
  q, k, v, valid, ko, vo, own_valid, do, dlse = make_inputs(
      Case(jnp.float64, b=2, t=12, s_anc=(48, 20), hq=2, hkv=1, d=8), seed=seed)
  valid[0][:, 16:32] = False
  valid[1][:] = False
  return [q, k, v, valid, ko, vo, own_valid, do, dlse]


def test_fully_masked_ancestor_tile_float64_equals_textbook(x64, small_tiles):
  # A tile with no valid key contributes exp(fill - m) = 0 to every sum and must not move the
  # running max; every row still sees keys, so textbook autodiff is finite everywhere.
  inputs = _masked_tile_inputs(seed=4)
  got = run(suffix_attention, jnp.float64, inputs)
  _assert_close(got, run(textbook_attention, jnp.float64, inputs), 1e-12)
  dk0, dk1, dv0, dv1 = got[3:7]
  assert np.all(dk0[:, 16:32] == 0.0) and np.all(dv0[:, 16:32] == 0.0), "padded keys get no gradient"
  assert np.all(dk1 == 0.0) and np.all(dv1 == 0.0)


def test_rows_without_any_key_give_zeros_and_no_nan(x64, monkeypatch):
  # Row 1 also loses all of ancestor 0 and its own key 0, so its query 0 sees no key at all: out 0,
  # lse -inf (the dense path's contract), no NaN anywhere. Autodiff of the textbook softmax is NaN
  # on such a row, so the tiled path is compared with the dense step (QUERY_CHUNK, KEY_BLOCK large),
  # itself equal to the textbook where finite (tests/test_kernels.py), to <= 1e-12.
  inputs = _masked_tile_inputs(seed=5)
  inputs[3][0][1] = False
  inputs[6][1, 0] = False
  monkeypatch.setattr(reference, "QUERY_CHUNK", 1 << 20)
  monkeypatch.setattr(reference, "KEY_BLOCK", 1 << 20)
  dense = run(suffix_attention, jnp.float64, inputs)
  monkeypatch.setattr(reference, "QUERY_CHUNK", CHUNK)
  monkeypatch.setattr(reference, "KEY_BLOCK", KEY_BLOCK)
  tiled = run(suffix_attention, jnp.float64, inputs)
  out, lse = tiled[:2]
  assert np.all(out[1, 0] == 0.0) and np.all(lse[1, 0] == -np.inf)
  assert np.isfinite(lse[0]).all() and np.isfinite(lse[1, 1:]).all()
  assert not any(np.isnan(x).any() for x in tiled)
  _assert_close(tiled, dense, 1e-12)


def test_tiled_bfloat16_error_at_most_twice_the_dense_step(monkeypatch):
  # bfloat16 inputs: the tiled path's error against float64 (on the same rounded inputs) is at most
  # 2x the dense step's (+ FLOOR, for the outputs both compute at float32 noise), the rule
  # tests/test_kernels.py applies to the Pallas kernels. Tiling adds rescalings, never a rounding
  # to bfloat16 that the dense step does not do.
  case = TILED["chunks-and-tiles-shared-ragged"]
  inputs = make_inputs(case, seed=6)
  with jax.enable_x64(True):
    exact = run(textbook_attention, jnp.float64, _rounded(inputs, jnp.bfloat16))
  monkeypatch.setattr(reference, "QUERY_CHUNK", 1 << 20)
  monkeypatch.setattr(reference, "KEY_BLOCK", 1 << 20)
  dense = run(suffix_attention, jnp.bfloat16, inputs)
  monkeypatch.setattr(reference, "QUERY_CHUNK", CHUNK)
  monkeypatch.setattr(reference, "KEY_BLOCK", KEY_BLOCK)
  tiled = run(suffix_attention, jnp.bfloat16, inputs)
  for i, (got, ref, want) in enumerate(zip(tiled, dense, exact)):
    assert rel_err(got, want) <= 2 * rel_err(ref, want) + FLOOR, (i, rel_err(got, want), rel_err(ref, want))
  assert rel_err(dense[0], exact[0]) > 1e-4, "bfloat16 must actually round (else the rule checks nothing)"


def test_tiled_under_vmap_equals_per_example(x64, small_tiles):
  # replay vmaps the attention over micro-batch members: the loops must batch (their trip counts do
  # not depend on the data). Two independent inputs, vmapped vs one call each: equal to 1e-12.
  case = TILED["chunks-and-tiles-shared-ragged"]
  stacks = [make_inputs(case, seed=s) for s in (7, 8)]

  def f(q, k0, v0, k1, v1, ko, vo, m0, m1, mo):
    out, lse = suffix_attention(q, [KVBlock(k0, v0, m0), KVBlock(k1, v1, m1)], KVBlock(ko, vo, mo))
    return jnp.sum(out ** 2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

  def args(x):
    q, k, v, valid, ko, vo, own_valid, _, _ = x
    return q, k[0], v[0], k[1], v[1], ko, vo, valid[0], valid[1], own_valid

  grad = jax.grad(f, argnums=tuple(range(7)))
  batched = jax.jit(jax.vmap(grad))(*[np.stack(z) for z in zip(*(args(x) for x in stacks))])
  for i, x in enumerate(stacks):
    for got, want in zip(batched, jax.jit(grad)(*args(x))):
      assert rel_err(np.asarray(got[i]), np.asarray(want)) <= 1e-12


def test_tiled_intermediates_are_at_most_input_sized(small_tiles):
  # The issue: all of a segment's scores were live at once. Every intermediate of the forward and
  # backward (loop bodies included) must now be at most as large as q or an ancestor's K
  # (2 x 64 x 2 x 8 = 2 x 128 x 8 = 2048 elements), while one chunk's scores over all its keys
  # would be 2 x 8 x 2 x 192 = 6144 elements and the segment's 2 x 64 x 2 x 192 = 49152.
  b, t, s, hq, hkv, d = 2, 64, 128, 2, 1, 8
  sds = jax.ShapeDtypeStruct
  q, kv_anc, kv_own = sds((b, t, hq, d), jnp.float32), sds((b, s, hkv, d), jnp.float32), sds((b, t, hkv, d),
                                                                                              jnp.float32)

  def loss(q, ka, va, ko, vo):
    out, lse = suffix_attention(q, [KVBlock(ka, va, jnp.ones((b, s), bool))], KVBlock(ko, vo, jnp.ones((b, t), bool)))
    return jnp.sum(out) + jnp.sum(lse)

  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=range(5)))(q, kv_anc, kv_anc, kv_own, kv_own).jaxpr
  sizes = [int(np.prod(shape)) for shape in jaxpr_shapes(jaxpr)]
  assert max(sizes) <= 2048, sorted(sizes)[-5:]


def test_tiled_inside_shard_map_equals_unsharded_and_the_dense_step(x64, monkeypatch):
  # The mesh (distributed/mesh.py) runs the reference inside shard_map(check_vma=True), where a loop
  # carry must vary over the mesh axes its body's output varies over (a fresh jnp.zeros varies over
  # none: a TypeError at trace time) and a custom_vjp cotangent must vary exactly as its primal.
  # Here q and the own block are split over the 2 rows, the shared prompt block is replicated, so
  # its gradient is the psum of the devices' parts (JAX's rule for a replicated input, which the
  # dense step gets from jax.vjp): the whole gradient. Tiled (chunk 8, tile 16) and dense (one
  # step) results inside shard_map both equal the unsharded call to 1e-12.
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P
  mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2])
  case = Case(jnp.float64, b=2, t=29, s_anc=(50,), hq=4, hkv=2, d=8, pad_keys=True, pad_queries=True, shared=True)
  q, k, v, valid, ko, vo, own_valid, do, dlse = make_inputs(case, seed=9)

  def fwd_bwd(q, ka, va, ma, ko, vo, mo, do, dlse):
    f = lambda q, ka, va, ko, vo: suffix_attention(q, [KVBlock(ka, va, ma)], KVBlock(ko, vo, mo))
    (out, lse), pullback = jax.vjp(f, q, ka, va, ko, vo)
    return (out, lse, *pullback((do, dlse)))

  rows, rep = P("x"), P()
  args = [(q, rows), (k[0], rep), (v[0], rep), (valid[0], rep), (ko, rows), (vo, rows), (own_valid, rows), (do, rows),
          (dlse, rows)]
  placed = [jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec)) for x, spec in args]
  sharded = jax.shard_map(fwd_bwd, mesh=mesh, in_specs=tuple(spec for _, spec in args),
                          out_specs=(rows, rows, rows, rep, rep, rows, rows), check_vma=True)
  for chunk, key_block in [(CHUNK, KEY_BLOCK), (1 << 20, 1 << 20)]:
    monkeypatch.setattr(reference, "QUERY_CHUNK", chunk)
    monkeypatch.setattr(reference, "KEY_BLOCK", key_block)
    want = jax.jit(fwd_bwd)(*[jnp.asarray(x) for x, _ in args])
    _assert_close([np.asarray(x) for x in jax.jit(sharded)(*placed)], [np.asarray(x) for x in want], 1e-12)


def test_compiled_temporaries_grow_linearly_with_the_prompt():
  # XLA's buffer assignment (compile only) for one layer's prompt + completions attention, fwd + bwd,
  # at SmolLM2-135M shapes (benchmarks/attention_memory.py). With the shipped constants doubling P
  # must less than double the temporaries (linear plus a constant; docs/results/attention-memory-cpu
  # measured 1.51x from 2048 to 4096); with all scores live at once, as the dense step holds them
  # (constants raised above P), it is ~4x (quadratic), which shows the measure can tell them apart.
  from branch_replay_jax.benchmarks.attention_memory import memory_row
  temp = lambda p: memory_row("current", reference, p, 8, 32, jnp.float32)["temp_bytes"]
  assert temp(2048) < 2 * temp(1024)
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(reference, "QUERY_CHUNK", 1 << 20)
    mp.setattr(reference, "KEY_BLOCK", 1 << 20)
    assert temp(2048) > 3.5 * temp(1024)


@pytest.mark.parametrize("window", [1, 10, 1 << 30])
def test_windowed_tiled_float64_equals_the_windowed_dense_step(x64, monkeypatch, window):
  # Sliding-window attention (Gemma 3's local layers) through query chunks of 8 and key tiles of 16
  # against the dense step over whole blocks: out, lse and every gradient equal to float64 rounding
  # (<= 1e-12). Positions count valid keys across the blocks (reference.key_positions); with window 10
  # most of the 50-key prompt's tiles are out of every chunk's reach and skipped, window 1 leaves each
  # query its own key only, 2^30 is global attention (then equal to suffix_attention itself).
  from branch_replay_jax.kernels import windowed_suffix_attention
  inputs = make_inputs(TILED["chunks-and-tiles-shared-ragged"], seed=6)
  valid = inputs[3]
  before = sum(np.broadcast_to(m, (3, m.shape[1])).sum(-1) for m in valid)   # valid ancestor keys per row
  positions = jnp.asarray(before[:, None] + np.arange(29)[None], jnp.int32)
  fn = lambda q, a, o: windowed_suffix_attention(q, a, o, window=window, query_positions=positions)
  monkeypatch.setattr(reference, "QUERY_CHUNK", 1 << 20)
  monkeypatch.setattr(reference, "KEY_BLOCK", 1 << 20)
  dense = run(fn, jnp.float64, inputs)
  monkeypatch.setattr(reference, "QUERY_CHUNK", CHUNK)
  monkeypatch.setattr(reference, "KEY_BLOCK", KEY_BLOCK)
  _assert_close(run(fn, jnp.float64, inputs), dense, 1e-12)
  if window == 1 << 30:
    _assert_close(run(suffix_attention, jnp.float64, inputs), dense, 1e-12)


@pytest.mark.parametrize("tiles", [False, True])
def test_positioned_ring_block_equals_its_keys_in_order_float64(x64, monkeypatch, tiles):
  # A decode step's query at position 40 (sliding window 12) over a 20-key prompt and a ring of the last 11
  # generated keys (positions 29..39) stored rotated by 5 slots (slot s holds position 29 + (s + 5) mod 11),
  # each key's position given (reference.PositionedKV): out and lse equal the same keys in order as a plain
  # block, dense and through tiles of 4 keys (the prompt is beyond the window: its tiles skipped). Giving the
  # ring no positions (its keys then counted 20..30) moves the result by far more than rounding.
  from branch_replay_jax.kernels import windowed_suffix_attention
  from branch_replay_jax.kernels.reference import PositionedKV
  if tiles:
    monkeypatch.setattr(reference, "KEY_BLOCK", 4)
  rng = np.random.default_rng(0)
  kv = lambda n: jnp.asarray(rng.normal(size=(2, n, 1, 8)))
  q, prompt_k, prompt_v, ring_k, ring_v, own_k, own_v = (kv(1), kv(20), kv(20), kv(11), kv(11), kv(1), kv(1))
  q = jnp.concatenate([q, q], axis=2)   # 2 query heads on 1 K/V head
  prompt = KVBlock(prompt_k, prompt_v, jnp.ones((2, 20), bool))
  # ordered: the prompt (positions 0..19), a gap of 9 keys no window reaches (20..28), the ring in order
  gap = KVBlock(jnp.zeros((2, 9, 1, 8)), jnp.zeros((2, 9, 1, 8)), jnp.ones((2, 9), bool))
  held = (np.arange(11) + 5) % 11                          # ring slot s holds the key at position 29 + held[s]
  rotated = PositionedKV(ring_k[:, held], ring_v[:, held], jnp.ones((2, 11), bool),
                         jnp.asarray(np.broadcast_to(29 + held, (2, 11)), jnp.int32))
  own = KVBlock(own_k, own_v, jnp.ones((2, 1), bool))
  positions = jnp.full((2, 1), 40, jnp.int32)
  fn = lambda ancestors: windowed_suffix_attention(q, ancestors, own, window=12, query_positions=positions)
  want = fn([prompt, gap, KVBlock(ring_k, ring_v, jnp.ones((2, 11), bool))])
  got = fn([prompt, rotated])
  for x, y in zip(got, want):
    assert float(jnp.max(jnp.abs(x - y))) <= 1e-12
  unpositioned = fn([prompt, KVBlock(*rotated[:3])])
  assert float(jnp.max(jnp.abs(unpositioned[0] - want[0]))) > 1e-2
