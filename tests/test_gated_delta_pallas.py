"""The Gated DeltaNet chunk scan as Pallas kernels (kernels/gated_delta_pallas.py), in the Pallas interpreter:
`gated_delta.chunked(..., scan="pallas")` is `chunked(..., scan="xla")` (jax.lax.scan over the chunks), values and
every gradient, and `model.gated_delta_scan` reaches the model or is refused by name. Replay through the kernels
against naive rows: test_qwen3_5.py's depth-3 tree test and FSDP mesh test, parametrized by the scan."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from families import refused_before_loading

from branch_replay_jax.kernels.gated_delta_pallas import chunk_scan_pallas
from branch_replay_jax.models import gated_delta
from branch_replay_jax.models.loading import load_hf_model

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
QWEN3_5 = os.path.join(FIXTURES, "qwen3_5_tiny")


def _inputs(dtype, b=2, t=11, h=3, dk=4, dv=5, seed=0):
  """q, k, v, g, beta, state as `_linear_layer` makes them; row 1 right-padded after 6 tokens (g, beta, k zero)."""
  ks = jax.random.split(jax.random.key(seed), 6)
  valid = jnp.arange(t)[None] < jnp.asarray([[t], [6]])
  q = gated_delta.l2_normalize(jax.random.normal(ks[0], (b, t, h, dk), dtype)) * dk ** -0.5
  k = jnp.where(valid[..., None, None], gated_delta.l2_normalize(jax.random.normal(ks[1], (b, t, h, dk), dtype)), 0)
  v = jax.random.normal(ks[2], (b, t, h, dv), dtype)
  g = jnp.where(valid[..., None], -jax.nn.softplus(jax.random.normal(ks[3], (b, t, h), dtype)), 0)
  beta = jnp.where(valid[..., None], jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h), dtype)), 0)
  return q, k, v, g, beta, jax.random.normal(ks[5], (b, h, dk, dv), dtype)


def _value_and_vjp(scan, args, chunk=4):
  """(out, final state) of `chunked` and the cotangents of its six inputs under fixed random output cotangents."""
  (out, state), pull = jax.vjp(lambda *a: gated_delta.chunked(*a, chunk=chunk, scan=scan), *args)
  cts = (jax.random.normal(jax.random.key(8), out.shape, out.dtype),
         jax.random.normal(jax.random.key(9), state.shape, state.dtype))
  return (out, state), pull(cts)


@pytest.mark.parametrize("chunk", [4, 16])
def test_the_pallas_scan_equals_the_lax_scan_values_and_gradients_float64(x64, chunk):
  # 11 tokens in chunks of 4 (three chunks, the last one partial) or of 16 (one chunk, mostly padding), from a
  # random initial state, one row padded after 6 tokens: only the scan over the chunks differs, so the
  # outputs, the final state and the cotangents of q, k, v, g, beta and the initial state agree to float64
  # rounding (<= 1e-12 relative).
  args = _inputs(jnp.float64)
  (want, want_grads), (got, got_grads) = (_value_and_vjp(s, args, chunk) for s in ("xla", "pallas"))
  for name, w, x in zip(("out", "state", "dq", "dk", "dv", "dg", "dbeta", "dstate"), (*want, *want_grads),
                        (*got, *got_grads)):
    assert float(jnp.max(jnp.abs(x - w))) <= 1e-12 * max(1.0, float(jnp.max(jnp.abs(w)))), name


@pytest.mark.parametrize("block_v", [1, 4, 8])
def test_each_block_of_state_columns_scans_on_its_own_float64(x64, block_v):
  # The kernels split the state's Dv = 8 columns into blocks of block_v, one program each (the columns evolve
  # independently; the cotangents of W, A, Q, K and d sum over the blocks after the call): the scan's outputs and
  # all seven cotangents equal gated_delta.chunk_scan's (jax.lax.scan) to float64 rounding for every split.
  ks = jax.random.split(jax.random.key(3), 9)
  b, h, n, c, dk, dv = 2, 3, 4, 5, 6, 8
  u, w, a, q, k = (jax.random.normal(key, shape, jnp.float64) for key, shape in zip(
      ks, [(b, h, n, c, dv), (b, h, n, c, dk), (b, h, n, c, c), (b, h, n, c, dk), (b, h, n, c, dk)]))
  a = jnp.tril(a) * 0.3
  d = jax.random.uniform(ks[5], (b, h, n), jnp.float64)
  s0 = jax.random.normal(ks[6], (b, h, dk, dv), jnp.float64)
  cts = (jax.random.normal(ks[7], u.shape, jnp.float64), jax.random.normal(ks[8], s0.shape, jnp.float64))
  want, want_pull = jax.vjp(gated_delta.chunk_scan, u, w, a, q, k, d, s0)
  got, got_pull = jax.vjp(lambda *x: chunk_scan_pallas(*x, block_v=block_v), u, w, a, q, k, d, s0)
  for name, x, y in zip(("out", "state", "du", "dw", "da", "dq", "dk", "dd", "dstate"), (*got, *got_pull(cts)),
                        (*want, *want_pull(cts))):
    assert float(jnp.max(jnp.abs(x - y))) <= 1e-12 * max(1.0, float(jnp.max(jnp.abs(y)))), name
  with pytest.raises(ValueError, match=r"chunk_scan_pallas: block_v=3 must be a positive divisor of Dv=8"):
    chunk_scan_pallas(u, w, a, q, k, d, s0, block_v=3)


def test_the_pallas_scan_follows_the_token_by_token_recurrence_float64(x64):
  # The recurrence token by token (`recurrent`, transformers' decoding form) is the independent reference.
  args = _inputs(jnp.float64)
  for got, want in zip(gated_delta.chunked(*args, chunk=4, scan="pallas"), gated_delta.recurrent(*args)):
    assert float(jnp.max(jnp.abs(got - want))) <= 1e-12


def test_float32_pallas_scan_error_at_most_twice_the_lax_scans():
  # float32 against the float64 recurrence: the kernel's error is rounding, at most twice the lax.scan form's
  # (both use exact float32 dots; the bound fails if the kernel dropped a term or rounded through 16 bits).
  with jax.enable_x64(True):
    args64 = _inputs(jnp.float64, t=40, dk=16, dv=16)
    want = gated_delta.recurrent(*args64)
  args = tuple(a.astype(jnp.float32) for a in args64)
  for scan_out, xla_out, w in zip(gated_delta.chunked(*args, chunk=8, scan="pallas"),
                                  gated_delta.chunked(*args, chunk=8, scan="xla"), want):
    err = lambda x: float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(w))))
    assert err(scan_out) <= 2 * err(xla_out) + 1e-6


def test_mismatched_shapes_and_unknown_scans_are_refused():
  u = jnp.zeros((1, 2, 3, 4, 5))
  w, a, q, k, d, s = (jnp.zeros(x) for x in ((1, 2, 3, 4, 6), (1, 2, 3, 4, 4), (1, 2, 3, 4, 6), (1, 2, 3, 4, 6),
                                             (1, 2, 3), (1, 2, 6, 5)))
  chunk_scan_pallas(u, w, a, q, k, d, s)   # consistent: runs
  with pytest.raises(ValueError, match=r"chunk_scan_pallas: state is float32\[1, 2, 6, 4\], expected float32"
                                       r"\[1, 2, 6, 5\]"):
    chunk_scan_pallas(u, w, a, q, k, d, jnp.zeros((1, 2, 6, 4)))
  with pytest.raises(ValueError, match=r"chunk_scan_pallas: d is float16"):
    chunk_scan_pallas(u, w, a, q, k, d.astype(jnp.float16), s)
  with pytest.raises(ValueError, match=r"gated_delta.chunked: scan='triton' is not one of \('xla', 'pallas'\)"):
    gated_delta.chunked(*_inputs(jnp.float32), scan="triton")


def test_the_loader_sets_the_scan_and_the_expert_matmul_on_the_models_that_have_them():
  # load_hf_model sets ModelConfig.gated_delta_scan on a model with linear layers, and expert_matmul on each
  # family with experts (Gemma 4's included, whose loader path dropped it before this test).
  assert load_hf_model(QWEN3_5, gated_delta_scan="pallas").config.gated_delta_scan == "pallas"
  assert load_hf_model(os.path.join(FIXTURES, "gemma4_moe_tiny"), expert_matmul="tiled").config.expert_matmul == "tiled"
  gemma3 = load_hf_model(os.path.join(FIXTURES, "gemma3_tiny"), gated_delta_scan="pallas")
  assert gemma3.config.gated_delta_scan == "xla"   # no linear layers: the field stays at its default


@pytest.mark.parametrize("name,overrides,message", [
    (QWEN3_5, {"model.gated_delta_scan": "triton"},
     r"model.gated_delta_scan='triton' is not one of \('xla', 'pallas'\)"),
    ("smollm2-135m-instruct", {"model.gated_delta_scan": "pallas"},
     r"model.gated_delta_scan='pallas': model.name='smollm2-135m-instruct' has no linear-attention layers"),
])
def test_the_scan_field_is_refused_by_name_before_loading(tmp_path, name, overrides, message):
  refused_before_loading(tmp_path, name, "smoke", overrides, message)


def test_the_benchmark_row_times_both_scans_and_finds_them_equal():
  # benchmarks/gated_delta.py (scripts/gpu_bench.sh's gated_delta stage) at a smoke shape: both scans timed
  # (positive, finite) and, on the same float32 inputs, outputs that agree to float32 rounding (<= 1e-5).
  import math

  from branch_replay_jax.benchmarks.gated_delta import bench_length
  row = bench_length(20, b=1, h=2, dk=16, dv=16, chunk=8, repeats=1, impls=("xla", "pallas"))
  assert row["baseline"] == "xla" and row["xla"]["max_abs_diff"] == 0.0
  assert row["pallas"]["max_abs_diff"] <= 1e-5
  for scan in ("xla", "pallas"):
    assert all(math.isfinite(row[scan][k]) and row[scan][k] > 0 for k in ("fwd_ms", "fwd_bwd_ms", "compile_s"))
