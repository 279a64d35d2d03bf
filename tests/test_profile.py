"""The step profile's attribution (benchmarks/profile.py), the backend-options and peer configs, and the
log-prob head's stored-orientation unembedding (no [d, V] transpose in the replay scan)."""

import gzip
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from branch_replay_jax.benchmarks import backend, peer, profile
from branch_replay_jax.benchmarks import replay as bench
from branch_replay_jax.models import token_logprobs
from experiments import bench_backend, bench_peer, bench_profile
from branch_replay_jax.gradients.heads import POLICY
from branch_replay_jax.gradients.step import value_and_grad


def tiny_step_hlo(mode: str):
  """(compiled HLO text, model config, case) of the tiny replay or naive (micro-batch 2) step of
  bench_profile.py:smoke."""
  config = bench_profile.get_config("smoke")
  case = bench.parse_case(config, 0)
  model = bench.load_model(config)
  graphdef, params = nnx.split(model)
  naive_arrays, replay_arrays, _ = bench.case_inputs(config, case, model.config)
  if mode == "replay":
    step, arrays = (lambda p, a: value_and_grad(POLICY, graphdef, p, a, bench.GRPO_OBJECTIVE, logprob_chunk=8),
                    replay_arrays)
  else:
    step, arrays = (lambda p, a: value_and_grad(POLICY, graphdef, p, a, bench.GRPO_OBJECTIVE, micro_batch=2,
                                                      logprob_chunk=8, layout="naive"), naive_arrays)
  return jax.jit(step).lower(params, arrays).compile().as_text(), model.config, case


@pytest.fixture(scope="module")
def tiny_replay_hlo():
  """(compiled HLO text, model config) of the tiny replay step, compiled once."""
  return tiny_step_hlo("replay")[:2]


def test_every_matmul_of_the_replay_step_is_attributed_to_a_named_part(tiny_replay_hlo):
  # Each executed (unfused) dot of the compiled tiny replay step that keeps XLA metadata must land in a
  # part of PART_RULES by its stack frames (none in "no source"), forward and backward (op_name
  # "transpose(") both present, and the model's four projections and the log-prob head all found.
  # (XLA drops the metadata of some batched dots, the attention einsums' at this size: those are
  # the profile's "no source" matmuls, and carry no op_name here.)
  text, _ = tiny_replay_hlo
  instrs = profile.parse_hlo(text)
  matmuls = {name: ins for name, ins in instrs.items()
             if profile.kind_of(name, ins) == "matmul" and not ins["fused"] and ins["op_name"]}
  assert len(matmuls) > 20
  parts = {profile.part_of(ins) for ins in matmuls.values()}
  assert "no source (XLA copies, loop plumbing)" not in parts, sorted(parts)
  assert {"qkv projections", "output projection", "MLP gate+up", "MLP down", "log-prob head"} <= parts, sorted(parts)
  assert any("transpose(" in ins["op_name"] for ins in matmuls.values())
  assert any("transpose(" not in ins["op_name"] for ins in matmuls.values())


def test_naive_step_copies_no_mlp_or_score_sized_array_into_a_new_layout():
  # The dots of the projections and the log-prob head (2-D, one contracted axis: models/llama.py
  # `_matmul_2d`, `token_logprobs`) and of the attention ([Hkv, B, T, G, S] scores:
  # kernels/reference.py) and their gradients take their operands as laid out. Before, XLA:CPU copied
  # the SwiGLU cotangent [B, T, F] into [F, B, T] (here [48, 2, 30], twice) and the log-prob head's
  # [B, chunk, V] cotangent into [V, B, chunk] for the weight-gradient dots (and, at SmolLM2's shapes,
  # the [B, Hkv, G, T, S] scores for the K gradient). Now every copy that reorders data in the
  # compiled tiny naive step is at most q-sized (B * T * Hq * D elements: q, K, V into the attention
  # layout and back), and none has the MLP width F or the vocabulary V in its shape.
  text, cfg, case = tiny_step_hlo("naive")
  b, t = 2, case["P"] + case["T"]
  q_size = b * t * cfg.num_heads * cfg.head_dim
  others = (cfg.d_model, t, case["T"], cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim)
  assert cfg.ffn_dim not in others and cfg.vocab_size not in others
  moved = profile.moving_transposes(text)
  assert moved   # q, K, V still change layout
  big = [(name, dims) for name, dims in moved
         if cfg.ffn_dim in dims or cfg.vocab_size in dims or np.prod(dims) > q_size]
  assert not big, big


def test_moving_transposes_lists_layout_changing_copies_only():
  # XLA writes a layout change as a transpose whose result layout undoes it (a bitcast) then a copy
  # into the default layout: the copy is listed; a copy between equal physical orders is not, and
  # size-1 axes do not count.
  text = """
  %mul.1 = f32[2,3,5]{2,1,0} multiply(%a, %b)
  %transpose.1 = f32[5,2,3]{0,2,1} transpose(%mul.1), dimensions={2,0,1}
  %copy.1 = f32[5,2,3]{2,1,0} copy(%transpose.1)
  %copy.2 = f32[2,3,5]{2,1,0} copy(%mul.1)
  %x.1 = f32[1,4,7]{2,1,0} parameter(0)
  %copy.3 = f32[1,4,7]{2,0,1} copy(%x.1)
  %transpose.2 = f32[7,4]{1,0} transpose(%y), dimensions={1,0}
  %y = f32[4,7]{1,0} parameter(1)
"""
  assert profile.moving_transposes(text) == [("copy.1", (5, 2, 3)), ("transpose.2", (7, 4))]


def test_trace_self_time_subtracts_nested_events_per_thread(tmp_path):
  # A while thunk of 10 us enclosing two body thunks of 3 and 4 us on the same thread keeps 3 us of
  # self time; an event of another module or without hlo_op is ignored; another thread's event of the
  # same instruction adds its own 5 us.
  ev = lambda name, ts, dur, tid, module="jit_step": {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 1,
                                                      "tid": tid, "args": {"hlo_module": module, "hlo_op": name}}
  events = [ev("while.1", 0, 10, 1), ev("dot.2", 1, 3, 1), ev("fusion.3", 5, 4, 1), ev("dot.2", 0, 5, 2),
            ev("fusion.9", 0, 50, 1, module="other"), {"ph": "X", "name": "x", "ts": 0, "dur": 99, "tid": 1}]
  (tmp_path / "run").mkdir()
  with gzip.open(tmp_path / "run" / "perfetto_trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)
  got = profile.read_trace(str(tmp_path), "jit_step")
  assert got == pytest.approx({"while.1": 3e-6, "dot.2": 8e-6, "fusion.3": 4e-6})


@pytest.mark.parametrize("module,field,value", [(profile, "modes", ("replay", "sideways")),
                                                (profile, "repeats", 0),
                                                (backend, "rounds", 0),
                                                (backend, "variants", (("a", ""), ("a", "--x"))),
                                                (peer, "modes", ("replay", "jax_naive")),
                                                (peer, "torch_micro_batches", (0,))])
def test_benchmark_configs_refuse_bad_fields(module, field, value):
  config = {profile: bench_profile, backend: bench_backend, peer: bench_peer}[module].get_config("smoke")
  config[field] = value
  with pytest.raises(ValueError, match=field):
    module.check_config(config)


def test_token_logprobs_take_the_tied_embedding_as_stored():
  # [V, d] with vocab_axis 0 is the same function as its transpose [d, V] with vocab_axis 1: the same
  # products summed in the same order, so equal to float32 rounding (1e-6 relative on log-probs of ~5).
  rng = np.random.default_rng(0)
  h = jnp.asarray(rng.normal(size=(2, 7, 16)), jnp.float32)
  w_vd = jnp.asarray(rng.normal(size=(50, 16)) * 0.3, jnp.float32)
  y = jnp.asarray(rng.integers(0, 50, size=(2, 7)))
  stored = token_logprobs(h, w_vd, y, chunk=3, vocab_axis=0)
  transposed = token_logprobs(h, w_vd.T, y, chunk=3)
  np.testing.assert_allclose(stored, transposed, rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match="vocab_axis"):
    token_logprobs(h, w_vd, y, vocab_axis=2)


def test_replay_step_copies_no_transposed_unembedding(tiny_replay_hlo):
  # With tied embeddings the log-prob head contracts the embedding [V, d] as stored: the compiled tiny
  # replay step holds no [d, V] array at all (before, a transpose copy of it ran in every scan step).
  text, cfg = tiny_replay_hlo
  assert cfg.tie_embeddings
  d, v = cfg.d_model, cfg.vocab_size
  assert f"f32[{d},{v}]" not in text
  assert f"f32[{v},{d}]" in text


def test_cpu_xla_flags_are_appended_only_where_the_user_named_none(monkeypatch):
  # The package's CPU defaults never override a flag the environment's XLA_FLAGS names (any value,
  # "--" or "-" spelling), and keep the user's own flags in order before its own.
  import branch_replay_jax
  monkeypatch.setattr(branch_replay_jax, "CPU_XLA_FLAGS", {"xla_cpu_a": "1", "xla_cpu_b": "x"})
  assert branch_replay_jax.with_cpu_xla_flags("--xla_cpu_a=0 --other=2") == "--xla_cpu_a=0 --other=2 --xla_cpu_b=x"
  assert branch_replay_jax.with_cpu_xla_flags("-xla_cpu_b=") == "-xla_cpu_b= --xla_cpu_a=1"
  assert branch_replay_jax.with_cpu_xla_flags("") == "--xla_cpu_a=1 --xla_cpu_b=x"
