"""Qwen3.5's decoder (models/qwen3_5.py, models/gated_delta.py): parity with transformers on the fixture
tools/make_qwen3_5_reference.py wrote, the chunked rule against the token-by-token one, a segment continued
from its parent's state, and branch replay through the recurrent state exact against naive rows."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import max_rel_err, random_group
from families import (SMOLLM2_VOCAB, adapted64, arrays_of, fsdp_step_equals_naive, grpo_on_exported,
                      lora_fsdp_step_equals_naive, lora_step, objective, reference_error,
                      refused_before_loading, step, tree_and_rows)
from flax import nnx

from branch_replay_jax.data.batches import pack_trees
from branch_replay_jax.data.trees import tree_from_trajectories
from branch_replay_jax.export import export_model
from branch_replay_jax.gradients.heads import POLICY
from branch_replay_jax.gradients.step import value_and_grad
from branch_replay_jax.models import gated_delta, lora
from branch_replay_jax.models.config import FULL, LINEAR, GatedDeltaNetShape, tiny_config
from branch_replay_jax.models.loading import build_model, load_hf_model
from branch_replay_jax.models.qwen3_5 import Qwen35
from branch_replay_jax.rollout.sampler import sample_group
from branch_replay_jax.rollout.tree_sampler import sample_tree

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "qwen3_5_tiny")
CHUNK = 3   # the replay tests' chunk of the chunked rule: segments span several chunks, some nodes are shorter


def test_config_reads_the_layer_pattern_the_linear_shape_and_partial_rope(model):
  c = model.config
  assert c.arch == "qwen3_5_text" and c.layer_types == (LINEAR, LINEAR, FULL) * 2
  assert c.linear_attention == GatedDeltaNetShape(2, 4, 8, 12, 4)
  assert (c.head_dim, c.rotary_dim, c.rope_theta, c.tie_embeddings) == (16, 4, 1e7, False)


def test_logprobs_match_transformers_float32(model, reference):
  # Same weights through transformers' Qwen3_5ForCausalLM (eager attention, its torch chunked rule at chunk 64,
  # float32) and our decoder at chunk 64 and at chunk 5 (the 150-token input crosses chunks either way).
  # The fixture is rounded to 1e-6; float32 reassociation adds ~1e-6 (measured 4.3e-6).
  for chunk in (64, 5):
    model.chunk = chunk
    for item in reference["inputs"]:
      assert reference_error(model, item) <= 1e-5, (chunk, len(item["input_ids"]))
  model.chunk = 64


def test_greedy_sampling_through_the_recurrent_state_reproduces_transformers(model, reference):
  # transformers: 16 argmax steps of full forwards. Ours: sample_group at temperature 0, the prompt padded to
  # its bucket (the padding leaves the state as the last real token left it) and every token decoded by the
  # token-by-token rule on the cache's running state and K/V. The smallest top-1/top-2 gap is far above our
  # logit error.
  g = reference["greedy"]
  assert min(g["top1_minus_top2"]) > 1e-3
  out = sample_group(model, np.asarray(g["prompt_ids"]), num_samples=2, max_new_tokens=len(g["ids"]),
                     key=jax.random.key(0), temperature=0.0)
  assert np.asarray(out.tokens).tolist() == [g["ids"]] * 2


def test_tree_sampling_hands_each_child_its_parents_state(model, reference):
  # sample_tree at temperature 0, fan-outs (2, 2), segments of 8: every child decodes from its parent row's
  # final state and K/V (`tree_sampler._row`), so each root-to-leaf path is transformers' 16 greedy ids.
  g = reference["greedy"]
  out = sample_tree(model, np.asarray(g["prompt_ids"]), fanouts=[2, 2], segment_length=8, key=jax.random.key(0),
                    temperature=0.0)
  nodes = [list(map(int, s)) for s in out.tree.segments[1:]]   # depth first: a first-level node, its two children
  assert nodes == [g["ids"][:8], g["ids"][8:], g["ids"][8:]] * 2


def test_the_full_layers_take_the_pallas_kernels(model):
  # attention_impl="pallas" (interpreted on the CPU) runs the full layers' suffix attention through the
  # FlashAttention kernels of kernels/; the hidden states equal the jnp attention's to float32 rounding,
  # relative to their size (|h| up to ~4 here): the kernels sum the keys in tiles, another order than the
  # jnp softmax, and XLA:CPU's order differs by machine (1.25e-5 absolute on a CPU without AVX-512).
  pallas = build_model(model.config, nnx.to_pure_dict(nnx.state(model, nnx.Param)), attention_impl="pallas")
  ids = jnp.asarray(np.random.default_rng(0).integers(3, 96, (2, 40)))
  assert pallas.attention_impl == "pallas"
  want = np.asarray(model(ids, 0).hidden_btd)
  np.testing.assert_allclose(np.asarray(pallas(ids, 0).hidden_btd), want, rtol=1e-5, atol=1e-5)


def _random_rule_inputs(rng, b, t, h, dk, dv):
  q = gated_delta.l2_normalize(jnp.asarray(rng.normal(size=(b, t, h, dk)))) * dk ** -0.5
  k = gated_delta.l2_normalize(jnp.asarray(rng.normal(size=(b, t, h, dk))))
  v = jnp.asarray(rng.normal(size=(b, t, h, dv)))
  g = -jnp.asarray(rng.uniform(0.01, 1.5, size=(b, t, h)))
  beta = jnp.asarray(rng.uniform(0.05, 0.95, size=(b, t, h)))
  state = jnp.asarray(rng.normal(size=(b, h, dk, dv)))
  return q, k, v, g, beta, state


def test_chunked_rule_equals_the_token_by_token_recurrence_float64(x64):
  # From a random initial state, over 13 tokens: chunks of 1, 4 (a partial last chunk) and 64 (one padded chunk)
  # give the recurrence's outputs and final state to float64 rounding.
  q, k, v, g, beta, state = _random_rule_inputs(np.random.default_rng(0), 2, 13, 3, 5, 7)
  want_out, want_state = gated_delta.recurrent(q, k, v, g, beta, state)
  for chunk in (1, 4, 64):
    out, final = gated_delta.chunked(q, k, v, g, beta, state, chunk=chunk)
    assert float(jnp.abs(out - want_out).max()) <= 1e-12 and float(jnp.abs(final - want_state).max()) <= 1e-12


def _model64(model, chunk=CHUNK):
  m = build_model(model.config, nnx.to_pure_dict(nnx.state(model, nnx.Param)), dtype=jnp.float64)
  m.chunk = chunk
  return m


def _sharp(m):
  """m with its mixers' projections x8 and embeddings x10: at the init's std 0.02 attention is near uniform
  and the delta rule writes little, so an ancestor's state or K/V read wrongly would move the loss by little."""
  for kind in (m.layers.full, m.layers.linear):
    for name in ("wq", "wk", "wv", "wo"):
      getattr(kind, name)[...] = getattr(kind, name)[...] * 8.0
  m.embed[...] = m.embed[...] * 10.0
  return m


def _with_scan(graphdef, params, scan: str):
  """graphdef of the same model with `ModelConfig.gated_delta_scan = scan`."""
  m = nnx.merge(graphdef, params)
  m.config = dataclasses.replace(m.config, gated_delta_scan=scan)
  return nnx.split(m)[0]


@pytest.fixture(scope="module")
def small64():
  """(graphdef, float64 params) of a random 4-layer Qwen3.5, (linear, full) twice, vocabulary 96, chunks of
  CHUNK: the replay tests' model (the fixture's 6 layers compile a third slower and test nothing more here)."""
  cfg = tiny_config(vocab_size=96, num_layers=4, arch="qwen3_5_text", layer_types=(LINEAR, FULL) * 2, qk_norm=True,
                    rotary_dim=4, linear_attention=GatedDeltaNetShape(2, 4, 8, 12), tie_embeddings=False)
  with jax.enable_x64(True):
    m = _sharp(Qwen35(cfg, dtype=jnp.float64, chunk=CHUNK, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(m)
    return graphdef, jax.tree_util.tree_map(lambda x: x.astype(jnp.float64), params)


@pytest.mark.parametrize("split", [2, 7])
def test_a_segment_continued_from_its_parents_state_equals_the_whole_sequence_float64(model, x64, split):
  # A sequence of 12 cut after 2 tokens (inside the first convolution window of K - 1 = 3 inputs) or 7, the
  # parent right-padded to 9: the child on the parent's state gives the whole sequence's hidden states and the
  # same final state. Padding leaves the state as the last real token left it.
  m = _model64(model)
  ids = jnp.asarray(np.random.default_rng(2).integers(3, 96, (1, 12)))
  whole = m(ids, 0)
  parent_ids = jnp.pad(ids[:, :split], ((0, 0), (0, 9 - split)), constant_values=5)
  parent = m(parent_ids, 0, valid_bt=jnp.arange(9)[None] < split)
  child = m(ids[:, split:], split, ancestors=[parent.kv])
  assert float(jnp.abs(child.hidden_btd - whole.hidden_btd[:, split:]).max()) <= 1e-12
  assert float(jnp.abs(parent.hidden_btd[:, :split] - whole.hidden_btd[:, :split]).max()) <= 1e-12
  for got, want in ((child.kv.conv, whole.kv.conv), (child.kv.recurrent, whole.kv.recurrent)):
    assert float(jnp.abs(got - want).max()) <= 1e-12


def _group():
  # Prompt of 7 (three chunks of 3, the last partial), completions of 1 (shorter than the convolution
  # window and the chunk), 2, 5 and 9 tokens.
  return random_group([1, 2, 5, 9], prompt_len=7, seed=3, vocab=96)


def test_group_replay_equals_naive_float64_through_the_recurrent_state(small64, x64):
  # Replay (the prompt once, each completion from its final state and K/V, one completion per scan step) and
  # naive rows (prompt + completion as one left-padded sequence) are the same function. (The loop's default,
  # all completions in one step through `prompt_and_rows`, is checked in float32 by the GRPO test below.)
  graphdef, params = small64
  arrays = arrays_of(_group(), np.float64)
  ln, _, gn = step(graphdef, params, arrays, objective, layout="naive")
  lr, _, gr = step(graphdef, params, arrays, objective, micro_batch=1, fused=False)
  assert abs(float(lr) - float(ln)) <= 1e-12 * max(1.0, abs(float(ln)))
  assert max_rel_err(gr, gn) <= 1e-10


# heavy: two float32 compiles (~25 s cold). CI checks the same in float32 through the GRPO test's run-time exactness
# check (replay against naive rows of the same group, <= 1e-4) and the same code in float64 (above).
@pytest.mark.heavy
def test_group_replay_float32_within_rounding_of_naive(model):
  # float32: replay against naive within 1e-4 relative (rounding order only).
  model.chunk = CHUNK
  graphdef, params = nnx.split(model)
  model.chunk = 64
  arrays = arrays_of(_group(), np.float32)
  _, _, gn = step(graphdef, params, arrays, objective, layout="naive")
  _, _, gr = step(graphdef, params, arrays, objective, micro_batch=1, fused=False)
  assert max_rel_err(gr, gn) <= 1e-4


# heavy: three compiles (~40 s cold: the float64 reference, bfloat16 naive and replay). CI covers the same code
# in float64 (test_group_replay_equals_naive_float64_through_the_recurrent_state) and float32 (the GRPO test).
@pytest.mark.heavy
def test_group_replay_bfloat16_error_at_most_twice_naive(model):
  # bfloat16 compute (the recurrence itself in float32, as transformers runs it): replay's gradient error against
  # the float64 gradient at most twice the naive rows' error, as for Llama (tests/test_replay.py).
  with jax.enable_x64(True):
    graphdef64, params64 = nnx.split(_model64(model))
    params64 = jax.tree_util.tree_map(lambda x: x.astype(jnp.float64), params64)
    exact = jax.tree_util.tree_map(np.asarray, step(graphdef64, params64, arrays_of(_group(), np.float64),
                                                     objective, layout="naive")[2])
  bf16 = build_model(model.config, nnx.to_pure_dict(nnx.state(model, nnx.Param)), dtype=jnp.bfloat16)
  bf16.chunk = CHUNK
  graphdef, params = nnx.split(bf16)
  arrays = arrays_of(_group(), np.float32)
  naive_err = max_rel_err(step(graphdef, params, arrays, objective, layout="naive")[2], exact)
  replay_err = max_rel_err(step(graphdef, params, arrays, objective, micro_batch=1, fused=False)[2], exact)
  assert replay_err <= 2 * naive_err, (replay_err, naive_err)


# The pallas case is heavy (~20-37 s): CI covers it by tests/test_gated_delta_pallas.py (the kernels equal the
# lax.scan form in float64, values and gradients, each column split), the xla case here (replay through that
# form) and test_grpo_trains_a_qwen3_5_directory_... (replay through the kernels checked against naive rows).
@pytest.mark.parametrize("scan", ["xla", pytest.param("pallas", marks=pytest.mark.heavy)])
def test_tree_replay_equals_naive_float64_each_node_from_its_parents_state(small64, x64, scan):
  # Depth 3: prompt 5, nodes of 1-5 tokens (a node of 1 or 2 starts and ends inside its parent's convolution
  # window; most are shorter than a chunk of 3 or cross one). Each node continues from its parent's final
  # state, which holds its grandparents'; the cotangents of a node's state from its children are summed. The
  # level schedule: each level's nodes as rows, each on its own parent's state (`_row_ancestor`). With
  # scan="pallas" the tree's linear layers scan their chunks by the Pallas kernels (kernels/gated_delta_pallas.py,
  # interpreted) and the naive rows by jax.lax.scan: the same function, so the same bounds.
  graphdef, params = small64
  tree_graphdef = graphdef if scan == "xla" else _with_scan(graphdef, params, scan)
  rng = np.random.default_rng(7)
  seg = lambda first, n: [first] + list(rng.integers(3, 96, n - 1))
  one = {a: seg(10 + a, 1 + 2 * a) for a in range(2)}
  two = {(a, b): seg(20 + b, 1 + b) for a in range(2) for b in range(2)}
  trajectories = [one[a] + two[a, b] + seg(30 + c, 2 + 3 * c) for a in range(2) for b in range(2) for c in range(2)]
  tree = tree_from_trajectories(list(rng.integers(3, 96, 5)), trajectories)
  tree_batch, rows, _ = tree_and_rows(tree, rng)   # the same draws, in the same order, as every family
  ln, _, gn = step(graphdef, params, rows, objective, layout="naive")
  lt, _, gt = step(tree_graphdef, params, tree_batch, objective, schedule="level", micro_batch=None)
  assert abs(float(lt) - float(ln)) <= 1e-12 * max(1.0, abs(float(ln)))
  assert max_rel_err(gt, gn) <= 1e-10
  with pytest.raises(ValueError, match="packed tree"):   # a packed row has no per-token recurrence
    value_and_grad(POLICY, graphdef, params, pack_trees([tree_batch])[0], objective)


def test_export_writes_what_our_loader_reads_back(model, tmp_path):
  # Exported config.json + model.safetensors: the same tensor names and shapes as transformers wrote, the same
  # parameters read back.
  export_model(model, None, str(tmp_path / "out"))
  back = load_hf_model(str(tmp_path / "out"))
  assert back.config == model.config
  want, got = nnx.to_pure_dict(nnx.state(model, nnx.Param)), nnx.to_pure_dict(nnx.state(back, nnx.Param))
  assert jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, got, want))
  from safetensors import safe_open
  shapes = lambda path: {k: f.get_slice(k).get_shape() for f in [safe_open(path, "np")] for k in f.keys()}
  assert shapes(str(tmp_path / "out" / "model.safetensors")) == shapes(os.path.join(FIXTURE, "model.safetensors"))


def test_qwen3_5_fields_are_checked_by_name():
  shape = GatedDeltaNetShape(2, 4, 8, 8)
  with pytest.raises(ValueError, match="rotary_dim must be an even int"):
    tiny_config(arch="qwen3_5_text", layer_types=(LINEAR, FULL), linear_attention=shape, rotary_dim=3)
  with pytest.raises(ValueError, match="linear_attention is Qwen3.5's"):
    tiny_config(linear_attention=shape)
  with pytest.raises(ValueError, match="num_value_heads=3 is not a multiple"):
    GatedDeltaNetShape(2, 3, 8, 8)
  with pytest.raises(ValueError, match="remat='offload_kv'"):
    Qwen35(tiny_config(arch="qwen3_5_text", layer_types=(LINEAR, FULL), linear_attention=shape, rotary_dim=4,
                       qk_norm=True), remat="offload_kv")


def test_grpo_trains_a_qwen3_5_directory_by_replay_and_checks_it_against_naive_rows(tmp_path, monkeypatch):
  # A random Qwen3.5 (a linear layer then a full one) over SmolLM2's tokenizer, exported as a Hugging Face
  # directory and trained by the GRPO smoke experiment: sampled through the recurrent state, trained by replay
  # from the prompt's final state (the prompt and the 4 completions of a group in one step, the fused replay,
  # `Qwen35.prompt_and_rows`). The run-time exactness check computes one group's gradient by replay and by naive
  # rows: equal to float32 rounding (exactness_ok, the bound of algorithms/exactness.py). The linear layers scan
  # their chunks by the Pallas kernels (model.gated_delta_scan, through the loader; the sampler's prefill and the
  # update both trace them); the lax.scan default trains in the LoRA GRPO test below.
  cfg = tiny_config(vocab_size=SMOLLM2_VOCAB, arch="qwen3_5_text", layer_types=(LINEAR, FULL), qk_norm=True,
                    linear_attention=GatedDeltaNetShape(2, 4, 8, 8), rotary_dim=4, max_positions=2048,
                    tie_embeddings=False)
  traced = []
  kernel = gated_delta.chunk_scan_pallas
  monkeypatch.setattr(gated_delta, "chunk_scan_pallas", lambda *a, **kw: traced.append(1) or kernel(*a, **kw))
  record = grpo_on_exported(Qwen35(cfg, rngs=nnx.Rngs(0)), tmp_path, monkeypatch,
                            **{"train.micro_batch": 4, "model.gated_delta_scan": "pallas"})
  assert len(traced) >= 2
  assert record["exactness_ok"] is True and 0 < record["exactness_grad_rel_err"] <= 1e-4
  assert np.isfinite(record["loss"]) and record["grad_norm"] > 0 and record["reward_std"] > 0


def test_lora_replay_equals_naive_float64_and_merging_keeps_the_function(small64, x64):
  # Adapters on every layer's MLP and on the full-attention layers' wq, wk, wv, wo (the Gated DeltaNet layers take
  # none): replay through the recurrent state and naive rows are the same function of the adapters (float64
  # rounding), every adapter gets a gradient, and the merged model (W + s A B, for export) computes the adapted
  # model's hidden states to float64 rounding.
  spec = lora.LoraSpec(rank=2, alpha=4.0)
  graphdef, adapters, base = adapted64(*small64, spec)
  arrays = arrays_of(_group(), np.float64)
  ln, _, gn = lora_step(graphdef, adapters, base, arrays, layout="naive")
  lr, _, gr = lora_step(graphdef, adapters, base, arrays, micro_batch=1, fused=False)
  assert abs(float(lr) - float(ln)) <= 1e-12 * max(1.0, abs(float(ln)))
  assert max_rel_err(gr, gn) <= 1e-10
  flat = {"/".join(map(str, k)): np.abs(np.asarray(v)).max() for k, v in jax.tree_util.tree_leaves_with_path(gr)}
  assert len(flat) == 2 * len(spec.targets) and min(flat.values()) > 1e-8, flat
  assert all("full" in k for k in flat if any(f"'{t}_lora" in k for t in lora.ATTENTION_TARGETS))
  adapted = nnx.merge(graphdef, adapters, base)
  ids = jnp.asarray(_group().completion_ids[-1:])
  want = adapted(ids, 0).hidden_btd
  got = lora.merged(adapted)(ids, 0).hidden_btd
  assert float(jnp.abs(got - want).max()) <= 1e-12 * float(jnp.abs(want).max())


def test_lora_on_the_fsdp_mesh_equals_naive_float64(small64):
  # Two groups over data x branch = 2 x 2, the frozen base and the adapters both FSDP-sharded (the base's
  # linear-attention and full-attention stacks split and gathered inside the scan, never differentiated):
  # the loss and the adapters' summed gradient equal the two naive groups' to float64 rounding (<= 1e-10),
  # and the gradient holds the adapters alone.
  with jax.enable_x64(True):
    groups = [arrays_of(random_group([2, 5, 9, 4], prompt_len=6 + 3 * s, seed=s, vocab=96), np.float64)
              for s in range(2)]
    lora_fsdp_step_equals_naive(*adapted64(*small64, lora.LoraSpec(rank=2, alpha=4.0)), groups)


# heavy (~45 s on one core): CI covers its parts by the float64 test above (Qwen3.5's adapter code) and
# tests/test_lora.py's LoRA smoke run (the loop's adapter split, base record and merged export, family-independent).
@pytest.mark.heavy
def test_grpo_trains_lora_adapters_on_a_qwen3_5_directory_and_checks_them_against_naive_rows(tmp_path, monkeypatch):
  # The LoRA smoke run on an exported Qwen3.5: the adapters alone train, by replay, and the run-time exactness
  # check (replay against naive rows of the same group, float32) passes.
  cfg = tiny_config(vocab_size=SMOLLM2_VOCAB, arch="qwen3_5_text", layer_types=(LINEAR, FULL), qk_norm=True,
                    linear_attention=GatedDeltaNetShape(2, 4, 8, 8), rotary_dim=4, max_positions=2048,
                    tie_embeddings=False)
  record = grpo_on_exported(Qwen35(cfg, rngs=nnx.Rngs(0)), tmp_path, monkeypatch, variant="lora_smoke",
                            **{"train.micro_batch": 4, "lora.rank": 4})
  assert record["exactness_ok"] is True and 0 < record["exactness_grad_rel_err"] <= 1e-4
  assert np.isfinite(record["loss"]) and record["grad_norm"] > 0


@pytest.mark.parametrize("variant,overrides,message", [
    ("smoke", {"mesh.seq": 8, "rollout.prompts_per_step": 1}, "mesh.seq=8: the prompt split over seq"),
])
def test_a_linear_attention_model_refuses_what_it_does_not_take_before_loading(tmp_path, variant, overrides,
                                                                               message):
  refused_before_loading(tmp_path, FIXTURE, variant, overrides,
                         f"has linear-attention layers \\(Qwen3.5\\): {message}")


@pytest.mark.parametrize("scan", ["xla", "pallas"])
def test_fsdp_mesh_step_equals_naive_float64(small64, scan):
  # Two groups over data x branch = 2 x 2 with FSDP parameters (every weight, the linear layers' included, split
  # and gathered one layer-pattern repetition at a time inside the scan; the prompt's final recurrent state
  # handed to the completions on each device, its cotangent all-reduced over branch): the summed gradient
  # equals the two naive groups' to float64 rounding (<= 1e-10). scan="pallas": the linear layers' chunk scan
  # by the Pallas kernels inside the mesh step's shard_map, the naive groups' by jax.lax.scan on one device.
  graphdef, params = small64
  with jax.enable_x64(True):
    groups = [arrays_of(random_group([2, 5, 9, 4], prompt_len=6 + 3 * s, seed=s, vocab=96), np.float64)
              for s in range(2)]
    fsdp_step_equals_naive(graphdef, params, groups, mesh_graphdef=_with_scan(graphdef, params, scan))


def test_episode_turns_on_the_kept_state_sample_what_a_full_reprefill_samples():
  # A random Qwen3.5 (linear, full) with sharp projections over the 64-id vocabulary of
  # tests/test_episode_sampler.py: three branches of three turns, the prompt's state shared, each turn decoded
  # on the running state and observations prefilled on the last block's. Same key, same draws as re-prefilling
  # the whole history every turn; log-probs to float32 rounding.
  from test_episode_sampler import kept_equals_reprefill
  m = _sharp(Qwen35(tiny_config(arch="qwen3_5_text", layer_types=(LINEAR, FULL), qk_norm=True, rotary_dim=4,
                                linear_attention=GatedDeltaNetShape(2, 4, 8, 8)), rngs=nnx.Rngs(0)))
  kept, full = kept_equals_reprefill(m)
  assert {len(t) for t in kept[1]} > {6}   # some turns stopped early: their state is the stop token's
