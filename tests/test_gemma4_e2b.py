"""Gemma 4's small-model layers (the E2B/E4B layout: per-layer embeddings, the last layers reading an earlier
layer's K/V, their MLP double-wide): parity with transformers on a tiny random checkpoint
(tests/fixtures/gemma4_e2b_tiny, written by tools/make_gemma4_e2b_reference.py), and branch replay exact where
the K/V-sharing layers attend to the ancestors' K/V of the layer they read (models/gemma4.py). The fixture has
nine layers, (sliding, sliding, global) three times; the last three compute no K/V and read layers 4 and 5's."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import max_rel_err, random_group
from families import (SMOLLM2_VOCAB, adapted64, arrays_of, export_round_trip, fsdp_step_equals_naive,
                      greedy_reproduces, grpo_on_exported, lora_step, objective, reference_error,
                      ring_cache_equals_full_cache, step, window_tree_equals_naive)
from flax import nnx

from branch_replay_jax.models import tiny_config
from branch_replay_jax.models.config import FULL, SLIDING
from branch_replay_jax.models.gemma4 import Gemma4
from branch_replay_jax.models.loading import build_model, load_hf_model

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "gemma4_e2b_tiny")


def test_config_reads_the_per_layer_embeddings_and_the_kv_sharing_layers(model):
  c = model.config
  assert (c.per_layer_input_dim, c.kv_shared_layers, c.double_wide_mlp) == (8, 3, True)
  assert c.kv_layer_types == (SLIDING, SLIDING, FULL) * 2
  assert model.per_layer_projection.shape == (48, 9, 8)
  lay, reuse = model.layers, model.layers.reuse
  assert lay.w_gate.shape == (6, 48, 40) and reuse.w_gate.shape == (3, 48, 80)      # the double-wide MLP
  assert lay.ple_table.shape == (6, 96, 8) and reuse.ple_table.shape == (3, 96, 8)   # each layer's table [V, Dp]
  assert lay.ple_gate.shape == (6, 48, 8) and reuse.ple_proj.shape == (3, 8, 48)
  assert set(nnx.to_pure_dict(nnx.state(reuse.sliding))) == {"wq", "wo", "q_norm"}   # no K/V of their own
  assert set(nnx.to_pure_dict(nnx.state(reuse.full))) == {"wq", "wo", "q_norm"}


def test_logprobs_match_transformers_float32(model, reference):
  # Same weights through transformers' Gemma4ForCausalLM (eager, float32) and our decoder: measured 4.3e-6 and
  # 1.1e-5 on the two inputs, the dense Gemma 4's order (tests/test_gemma4.py holds 1e-5 on its fixture).
  for item in reference["inputs"]:
    assert reference_error(model, item) <= 2e-5


@pytest.mark.parametrize("path,value", [
    (("layers", "reuse", "ple_table"), 0.0), (("per_layer_projection",), 0.0), (("per_layer_projection_norm",), 1.0),
    (("layers", "ple_norm"), 1.0), (("layers", "reuse", "sliding", "q_norm"), 1.0),
])
def test_each_part_of_the_small_model_layout_is_what_the_parity_measures(model, reference, path, value):
  # The same weights with the K/V-sharing layers' per-layer tables or the projection silenced, a per-layer norm set to ones, or the
  # K/V-sharing layers' query norm set to ones, differ from transformers by far more than the parity bound.
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  leaf = params
  for key in path[:-1]:
    leaf = leaf[key]
  leaf[path[-1]] = np.full_like(leaf[path[-1]], value)
  assert reference_error(build_model(model.config, params), reference["inputs"][1]) > 1e-3


def test_a_segment_hands_on_only_the_kv_its_computing_layers_made(model):
  out = model(jnp.arange(3, 10)[None], 0)
  assert out.kv.k.shape == (4, 1, 7, 2, 16) and out.kv.gk.shape == (2, 1, 7, 1, 32)   # layers 0-5's, not 6-8's


def test_greedy_sampling_reproduces_transformers(model, reference):
  # 16 argmax steps on the K/V caches of the six computing layers (the last three read layers 4 and 5's); the
  # smallest top-1/top-2 gap, 0.10, is ~1e4 times our logit error.
  greedy_reproduces(model, reference, min_gap=0.1)


def test_group_sampler_ring_cache_equals_the_whole_cache_float64(model):
  # E2B: the K/V-sharing layers read their donor's ring; the sampler's tokens and log-probs as with the whole
  # cache (families.ring_cache_equals_full_cache).
  ring_cache_equals_full_cache(model)


def test_export_writes_what_transformers_and_our_loader_read(model, tmp_path):
  # The per-layer embedding table [V, L·Dp] (ours per layer, [V, Dp] each) and projection [L·Dp, d], each layer's
  # gate, projection and norm, the K/V-sharing layers without k_proj / v_proj / k_norm and with their [2F, d] MLP:
  # transformers' names and shapes.
  export_round_trip(model, FIXTURE, tmp_path)


def test_a_kv_sharing_layers_projections_in_a_file_are_not_read(model, tmp_path):
  # transformers ignores a K/V-sharing layer's k_proj, v_proj, k_norm (`_keys_to_ignore_on_load_unexpected`);
  # so do we: the same model loads from a file that holds them.
  from safetensors.numpy import load_file, save_file
  directory = tmp_path / "e2b"
  shutil.copytree(FIXTURE, directory)
  tensors = load_file(str(directory / "model.safetensors"))
  tensors["model.layers.7.self_attn.k_proj.weight"] = np.ones((32, 48), np.float32)
  tensors["model.layers.7.self_attn.k_norm.weight"] = np.ones((16,), np.float32)
  save_file(tensors, str(directory / "model.safetensors"))
  back = load_hf_model(str(directory))
  same = jax.tree_util.tree_map(np.array_equal, nnx.to_pure_dict(nnx.state(back, nnx.Param)),
                                nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  assert jax.tree_util.tree_all(same)


def test_group_replay_equals_naive_float64_with_the_shared_kv_across_the_prompt(model64, x64):
  # Prompt of 7, completions of 3, 6, 9 and 2 tokens, window 4: the K/V-sharing layers attend to the prompt's K/V
  # of layers 4 and 5 in replay and recompute it per row in naive; the gradients agree to float64 rounding, and
  # the per-layer embeddings and the K/V-sharing layers' weights learn.
  graphdef, params = model64
  arrays = arrays_of(random_group([3, 6, 9, 2], prompt_len=7, seed=4, vocab=96), np.float64)
  ln, _, gn = step(graphdef, params, arrays, objective, layout="naive")
  lr, _, gr = step(graphdef, params, arrays, objective, micro_batch=None, fused=True)
  assert abs(float(lr) - float(ln)) <= 1e-12 * max(1.0, abs(float(ln)))
  assert max_rel_err(gr, gn) <= 1e-10
  lay = gn["layers"]
  for leaf in (lay["ple_table"], lay["reuse"]["ple_table"], gn["per_layer_projection"], lay["reuse"]["full"]["wq"],
               lay["reuse"]["w_down"], lay["full"]["wk"]):
    assert float(jnp.abs(leaf[...]).max()) > 1e-8


# heavy (57 s): the K/V-sharing layers reading their ancestors' K/V run the same `_layers` code for one ancestor
# (test_group_replay_equals_naive_float64_with_the_shared_kv_across_the_prompt, CI) as for a tree's several, and
# tests/test_gemma4.py's tree test runs Gemma 4's depth-3 window tree in CI.
@pytest.mark.heavy
def test_tree_replay_equals_naive_float64_where_a_node_sees_part_of_its_ancestors(model64, x64):
  # tests/test_gemma4.py's depth-3 tree: each node's K/V-sharing layers read its trimmed ancestors' K/V of the
  # layers they share with.
  window_tree_equals_naive(*model64)


# heavy (21 s): the float32 replay runs the code test_group_replay_equals_naive_float64_with_the_shared_kv_across_the_prompt
# checks in float64 (CI), and tests/test_gemma4.py's float32 test runs the same scans in CI without K/V sharing.
@pytest.mark.heavy
def test_group_replay_float32_within_rounding_of_naive(model):
  arrays = arrays_of(random_group([2, 5, 9], prompt_len=6, seed=3, vocab=96), np.float32)
  graphdef, params = nnx.split(model)
  _, _, gn = step(graphdef, params, arrays, objective, layout="naive")
  _, _, gr = step(graphdef, params, arrays, objective, micro_batch=1, fused=False)
  assert max_rel_err(gr, gn) <= 1e-4


def test_fsdp_mesh_step_equals_naive_float64(model64):
  # Two groups over data x branch = 2 x 2 with FSDP parameters (both groups of layers gathered one layer at a time,
  # the per-layer table split over vocab): the summed gradient equals the naive groups' (<= 1e-10).
  with jax.enable_x64(True):
    groups = [arrays_of(random_group([2, 5, 9, 4], prompt_len=6 + 3 * s, seed=s, vocab=96), np.float64, seed=s)
              for s in range(2)]
    fsdp_step_equals_naive(*model64, groups)


def test_lora_replay_equals_naive_float64_on_both_groups_of_layers_and_merging_keeps_the_function(model64, x64):
  # Adapters (rank 2, random B) on every target: the computing layers' sliding wq, wk, wv, wo and global wq, wk, wo,
  # the K/V-sharing layers' wq and wo of both kinds, and both groups' MLP: 17 stacks of two, each with a gradient.
  from branch_replay_jax.models import lora
  graphdef, adapters, base = adapted64(*model64, lora.LoraSpec(rank=2, alpha=4.0))
  arrays = arrays_of(random_group([2, 5, 9], prompt_len=6, seed=3, vocab=96), np.float64)
  ln, _, gn = lora_step(graphdef, adapters, base, arrays, layout="naive")
  lr, _, gr = lora_step(graphdef, adapters, base, arrays, micro_batch=1, fused=False)
  assert abs(float(lr) - float(ln)) <= 1e-12 * max(1.0, abs(float(ln)))
  assert max_rel_err(gr, gn) <= 1e-10
  flat = {jax.tree_util.keystr(k): np.abs(np.asarray(v)).max() for k, v in jax.tree_util.tree_leaves_with_path(gr)}
  assert len(flat) == 34 and min(flat.values()) > 1e-8, flat
  assert sum("'reuse'" in k for k in flat) == 14
  adapted = nnx.merge(graphdef, adapters, base)   # merged (W + s A B in both groups, for export): the same function
  ids = jnp.arange(3, 20)[None]
  want = adapted(ids, 0).hidden_btd
  got = lora.merged(adapted)(ids, 0).hidden_btd
  assert float(jnp.abs(got - want).max()) <= 1e-12 * float(jnp.abs(want).max())


# heavy (21 s): CI decodes on this model's kept K/V caches in test_greedy_sampling_reproduces_transformers, and keeps
# Gemma 4's caches across episode turns in tests/test_gemma4.py's episode test (the same sampler code).
@pytest.mark.heavy
def test_episode_turns_on_the_kept_kv_sample_what_a_full_reprefill_samples(model):
  # tests/test_gemma4.py's check: three branches of three turns on the kept K/V caches (the computing layers'
  # only) draw what re-prefilling the whole history every turn draws; log-probs to float32 rounding.
  from test_episode_sampler import kept_equals_reprefill
  kept_equals_reprefill(model)


def _tiny_e2b(**overrides):
  base = dict(arch="gemma4_text", num_layers=4, layer_types=(SLIDING, FULL) * 2, sliding_window=8,
              rope_local_theta=1e4, global_head_dim=16, global_kv_heads=1, k_eq_v=True, global_rope_fraction=0.25,
              final_logit_softcap=30.0, per_layer_input_dim=4, kv_shared_layers=2, double_wide_mlp=True)
  return tiny_config(**{**base, **overrides})


def test_small_model_fields_are_refused_by_name():
  with pytest.raises(ValueError, match="per_layer_input_dim is Gemma 4's"):
    tiny_config(per_layer_input_dim=4)
  with pytest.raises(ValueError, match="kv_shared_layers must be an int in \\[0, num_layers=4\\), got 4"):
    _tiny_e2b(kv_shared_layers=4)
  with pytest.raises(ValueError, match="the first 3 layers are not whole repetitions of the layer pattern \\(2"):
    _tiny_e2b(kv_shared_layers=1, double_wide_mlp=False)
  with pytest.raises(ValueError, match="double_wide_mlp=True widens the K/V-sharing layers' MLP; kv_shared_layers=0"):
    _tiny_e2b(kv_shared_layers=0)
  with pytest.raises(ValueError, match="kv_shared_layers=2 with num_experts=4: no Gemma 4 has both"):
    _tiny_e2b(num_experts=4, experts_per_token=2, expert_ffn_dim=8)
  with pytest.raises(ValueError, match="per_layer_input_dim must be None or a positive int, got 0"):
    _tiny_e2b(per_layer_input_dim=0)
  with pytest.raises(ValueError, match="double_wide_mlp must be a bool, got 'no'"):
    _tiny_e2b(double_wide_mlp="no")


@pytest.mark.parametrize("edit,message", [
    ({"vocab_size_per_layer_input": 50}, "vocab_size_per_layer_input=50 != vocab_size=96"),
    ({"vocab_size_per_layer_input": None}, "vocab_size_per_layer_input=None != vocab_size=96"),
    ({"use_double_wide_mlp": "false"}, "use_double_wide_mlp='false' must be true or false"),
    ({"num_kv_shared_layers": 4}, "ModelConfig.kv_shared_layers=4: the first 5 layers are not whole repetitions"),
    ({"num_kv_shared_layers": 9}, "ModelConfig.kv_shared_layers must be an int in \\[0, num_layers=9\\), got 9"),
])
def test_a_bad_small_model_field_is_refused_naming_the_file(tmp_path, edit, message):
  # Before any weight is read: the field and its value, and the config.json that holds it.
  directory = tmp_path / "e2b"
  shutil.copytree(FIXTURE, directory)
  cfg = json.load(open(directory / "config.json"))
  json.dump({**cfg, **edit}, open(directory / "config.json", "w"))
  with pytest.raises(ValueError, match=f"config.json: {message}"):
    load_hf_model(str(directory))


def test_a_prompts_kv_sharing_layers_run_its_last_position_alone_float64(model64, x64):
  # prompt_forward (replay's root prompt): the K/V-sharing layers see one query, the segment's donor K/V up to it
  # as an ancestor block; its hidden state at the last real position and its K/V equal a full forward's (float64),
  # with the prompt alone and on a trimmed ancestor (7 tokens, window 4).
  m = nnx.merge(*model64)
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(3, 96, (1, 13)))
  valid = jnp.arange(13)[None] < 10
  full = m(ids, 0, valid_bt=valid)
  kv, last, _ = m.prompt_forward(ids, valid, jnp.int32(9))
  assert float(jnp.abs(last - full.hidden_btd[0, 9]).max()) <= 1e-12
  assert float(jnp.abs(kv.tail.k - m.branch_kv(full.kv).tail.k).max()) == 0.0
  whole = m(ids, 0)
  one = m(ids[:, 7:], 7, ancestors=[m.branch_kv(m(ids[:, :7], 0).kv)], hidden_at=jnp.int32(4))
  assert one.hidden_btd.shape == (1, 1, 48)
  assert float(jnp.abs(one.hidden_btd[0, 0] - whole.hidden_btd[0, 11]).max()) <= 1e-12


# heavy (31 s): CI covers the model code by this file's float64 replay tests and export round trip, and the loop on
# an exported Gemma 4 directory by tests/test_gemma4.py's LoRA run and tests/test_gemma4_moe.py's routing-replay run.
@pytest.mark.heavy
def test_grpo_trains_an_e2b_layout_directory_by_replay(tmp_path, monkeypatch):
  # A random four-layer model of this layout over SmolLM2's tokenizer, exported and trained by the GRPO smoke
  # experiment; the run-time exactness check computes one group's gradient by replay and by naive rows: equal to
  # float32 rounding.
  cfg = _tiny_e2b(vocab_size=SMOLLM2_VOCAB, max_positions=2048)
  record = grpo_on_exported(Gemma4(cfg, rngs=nnx.Rngs(0)), tmp_path, monkeypatch)
  assert record["exactness_ok"] is True and 0 < record["exactness_grad_rel_err"] <= 1e-4
  assert np.isfinite(record["loss"]) and record["grad_norm"] > 0


# The text_config of google/gemma-4-E2B's and google/gemma-4-E4B's config.json (the published files' fields; the
# vision and audio configs left out: our loader reads only the language model).
_PUBLISHED = {
    "gemma-4-e2b": dict(hidden_size=1536, num_hidden_layers=35, intermediate_size=6144, num_attention_heads=8,
                        num_key_value_heads=1, head_dim=256, global_head_dim=512, num_global_key_value_heads=None,
                        attention_k_eq_v=False, use_double_wide_mlp=True, num_kv_shared_layers=20,
                        layer_types=([SLIDING] * 4 + [FULL]) * 7),
    "gemma-4-e4b": dict(hidden_size=2560, num_hidden_layers=42, intermediate_size=10240, num_attention_heads=8,
                        num_key_value_heads=2, head_dim=256, global_head_dim=512, num_global_key_value_heads=None,
                        attention_k_eq_v=False, use_double_wide_mlp=False, num_kv_shared_layers=18,
                        layer_types=([SLIDING] * 5 + [FULL]) * 7),
}
_COMMON = dict(model_type="gemma4_text", vocab_size=262144, vocab_size_per_layer_input=262144,
               hidden_size_per_layer_input=256, sliding_window=512, max_position_embeddings=131072, rms_norm_eps=1e-6,
               hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=30.0, tie_word_embeddings=True,
               enable_moe_block=False,
               rope_parameters={FULL: {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                       "rope_type": "proportional"},
                                SLIDING: {"rope_theta": 10000.0, "rope_type": "default"}})


@pytest.mark.parametrize("name", sorted(_PUBLISHED))
def test_the_e2b_and_e4b_shapes_are_what_the_loader_reads_from_their_config(tmp_path, name):
  # ARCHITECTURE_SHAPES (the compile-only memory model's shapes) equal what models.hf_loader reads from the
  # multimodal config.json the checkpoints ship (model_type gemma4, the decoder in text_config).
  from branch_replay_jax.models.config import ARCHITECTURE_SHAPES
  from branch_replay_jax.models.hf_loader import read_config
  json.dump({"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
             "text_config": {**_COMMON, **_PUBLISHED[name]}}, open(tmp_path / "config.json", "w"))
  assert read_config(str(tmp_path)) == ARCHITECTURE_SHAPES[name]


def test_the_e2b_shapes_hold_its_published_effective_parameter_count():
  # Google's model card: E2B has 2.3B effective parameters (the decoder without its per-layer embedding table).
  # Ours by jax.eval_shape (no weights): 4.63B in the text decoder, of which the table [262144, 35, 256] is 2.35B,
  # leaving 2.28B; E4B 7.46B and 4.64B (docs/results/gemma4-memory-cpu).
  from branch_replay_jax.models.config import ARCHITECTURE_SHAPES
  c = ARCHITECTURE_SHAPES["gemma-4-e2b"]
  shapes = nnx.to_pure_dict(jax.eval_shape(lambda: nnx.state(Gemma4(c, rngs=nnx.Rngs(0)), nnx.Param)))
  total = sum(x.size for x in jax.tree_util.tree_leaves(shapes))
  tables = shapes["layers"]["ple_table"].size + shapes["layers"]["reuse"]["ple_table"].size
  assert round((total - tables) / 1e9, 1) == 2.3
