"""Gemma 4's text decoder: parity with transformers on a tiny random checkpoint (tests/fixtures/gemma4_tiny,
written by tools/make_gemma4_reference.py), and branch replay exact with sliding and global layers of
different shapes (models/gemma4.py)."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import max_rel_err, random_group
from families import (SMOLLM2_VOCAB, adapted64, arrays_of, export_round_trip, fsdp_step_equals_naive,
                      greedy_reproduces, grpo_on_exported, lora_fsdp_step_equals_naive, lora_step, next_logprobs,
                      objective, params64, reference_error, refused_before_loading, ring_cache_equals_full_cache,
                      step, tree_and_rows, window_tree)
from flax import nnx

from branch_replay_jax.data.batches import pack_trees
from branch_replay_jax.gradients.heads import POLICY
from branch_replay_jax.gradients.step import value_and_grad
from branch_replay_jax.models import tiny_config
from branch_replay_jax.models.config import FULL, SLIDING
from branch_replay_jax.models.gemma4 import Gemma4, Gemma4KV, global_inv_freq
from branch_replay_jax.models.loading import build_model, load_hf_model

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "gemma4_tiny")
WINDOW = 4   # the fixture's sliding_window: shorter than every input and segment path below


def test_config_reads_both_layer_shapes_the_proportional_rope_the_cap_and_the_layer_scalars(model):
  c = model.config
  assert c.arch == "gemma4_text" and c.sliding_window == WINDOW and c.layer_types == (SLIDING, SLIDING, FULL) * 2
  assert (c.num_kv_heads, c.head_dim, c.global_kv_heads, c.global_head_dim, c.k_eq_v) == (2, 16, 1, 32, True)
  assert (c.rope_theta, c.rope_local_theta, c.global_rope_fraction, c.final_logit_softcap) == (1e6, 1e4, 0.25, 3.0)
  # the fixture's random scalars in [0.5, 1.5), read from the checkpoint's layer_scalar buffers
  assert len(c.layer_scalars) == 6 and all(0.5 <= s < 1.5 for s in c.layer_scalars)
  assert len(set(c.layer_scalars)) == 6
  # proportional RoPE: 16 frequency pairs of which int(0.25 * 32 / 2) = 4 turn, at base^(-2i/32)
  inv = np.asarray(global_inv_freq(c))
  np.testing.assert_allclose(inv[:4], 1e6 ** (-np.arange(0, 8, 2) / 32), rtol=1e-6)
  assert inv.shape == (16,) and not inv[4:].any()
  # no v_proj in the global layers (values are the key projection); one per sliding layer
  assert "wv" not in model.layers.full.__dict__ and model.layers.sliding.wv.shape == (4, 48, 2, 16)


def test_logprobs_match_transformers_float32(model, reference):
  # Same weights through transformers' Gemma4ForCausalLM (eager attention, float32) and our decoder, the
  # logits soft-capped at 3. Inputs of 23 and 40 tokens against a window of 4. The fixture is rounded to 1e-6;
  # float32 reassociation adds ~1e-6 (measured 6.9e-6).
  for item in reference["inputs"]:
    assert reference_error(model, item) <= 1e-5


@pytest.mark.parametrize("change", [
    dict(final_logit_softcap=None), dict(layer_scalars=None), dict(global_rope_fraction=1.0),
    dict(sliding_window=1000),
])
def test_each_gemma4_part_is_what_the_parity_measures(model, reference, change):
  # The same weights without the cap, the layer scalars, the proportional RoPE's unturned pairs or the window
  # differ from transformers by far more than the parity bound (1e-5): each is what the test above checks.
  other = build_model(dataclasses.replace(model.config, **change), nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  item = reference["inputs"][1]
  assert reference_error(other, item) > 1e-3


def test_greedy_sampling_through_both_kv_caches_reproduces_transformers(model, reference):
  # transformers: 16 argmax steps of full forwards. Ours: sample_group at temperature 0, each token decoded on
  # the sliding layers' and the global layers' K/V caches (`Gemma4KV`). The smallest top-1/top-2 gap, 0.0044,
  # is ~1e3 times our logit error.
  greedy_reproduces(model, reference, min_gap=4e-3)


def test_group_sampler_ring_cache_equals_the_whole_cache_float64(model):
  # Gemma 4: the sliding layers' K/V (their own shape) in the ring, the global layers' whole; the sampler's
  # tokens and log-probs as with the whole cache (families.ring_cache_equals_full_cache).
  ring_cache_equals_full_cache(model)


def test_export_writes_what_transformers_and_our_loader_read(model, tmp_path):
  # config.json + model.safetensors load back into the same config (the layer scalars included) and parameters,
  # with transformers' tensor names and shapes (the fixture's: no v_proj in a global layer).
  export_round_trip(model, FIXTURE, tmp_path)


def test_group_replay_equals_naive_float64_with_the_window_across_the_prompt(model, x64):
  # Prompt of 6, completions of 2, 5 and 9 tokens, window 4; replay (the prompt once, the completions on its
  # sliding and global K/V; the two-scan prompt_and_rows) and naive rows: float64 rounding.
  graphdef, params = params64(model)
  arrays = arrays_of(random_group([2, 5, 9], prompt_len=6, seed=3), np.float64)
  ln, _, gn = step(graphdef, params, arrays, objective, layout="naive")
  for kw in (dict(micro_batch=1, fused=False), dict(micro_batch=None, fused=True)):
    lr, _, gr = step(graphdef, params, arrays, objective, **kw)
    assert abs(float(lr) - float(ln)) <= 1e-12 * max(1.0, abs(float(ln))), kw
    assert max_rel_err(gr, gn) <= 1e-10, kw


def test_group_replay_float32_within_rounding_of_naive(model):
  # float32: replay against naive within 1e-4 relative (rounding order only).
  arrays = arrays_of(random_group([2, 5, 9], prompt_len=6, seed=3), np.float32)
  graphdef, params = nnx.split(model)
  _, _, gn = step(graphdef, params, arrays, objective, layout="naive")
  _, _, gr = step(graphdef, params, arrays, objective, micro_batch=1, fused=False)
  assert max_rel_err(gr, gn) <= 1e-4


@pytest.mark.parametrize("prompt_len", [6, 2])
def test_replay_hands_the_branches_only_the_keys_a_window_reaches(model, x64, prompt_len):
  # A prompt of prompt_len real tokens in a bucket of 8, window 4: no branch token (positions >= prompt_len)
  # reaches a sliding layer's prompt key before prompt_len - 3, so replay keeps the 2 global layers' 8 keys
  # (1 head of 32) and the 4 sliding layers' last 3 (2 heads of 16): 4 x 8 x 32 + 2 x 8 x 32 = 1536 -> 4 x 3 x 32
  # + 2 x 8 x 32 = 896 K values per row. Branches on the trimmed K/V compute the same hidden states as on the
  # whole prompt's (float64: the softmax's sums in another order, <= 1e-12).
  m64 = build_model(model.config, nnx.to_pure_dict(nnx.state(model, nnx.Param)), dtype=jnp.float64)
  rng = np.random.default_rng(5)
  prompt = jnp.asarray(rng.integers(3, 96, (1, 8)), jnp.int32)
  kv = m64(prompt, 0, valid_bt=(jnp.arange(8) < prompt_len)[None]).kv
  trimmed = m64.branch_kv(kv)
  assert trimmed.full.k.shape == (2, 1, 8, 1, 32) and trimmed.tail.k.shape == (4, 1, 3, 2, 16)
  start = max(prompt_len - 3, 0)
  assert int(trimmed.start[0]) == start
  np.testing.assert_array_equal(trimmed.tail.k, kv.k[:, :, start:start + 3])
  np.testing.assert_array_equal(trimmed.full.v, kv.gv)
  rows = jnp.asarray(rng.integers(3, 96, (3, 7)), jnp.int32)
  valid = jnp.arange(7)[None] < jnp.asarray([[7], [4], [1]])
  whole = m64(rows, prompt_len, ancestors=[kv], valid_bt=valid)
  cut = m64(rows, prompt_len, ancestors=[trimmed], valid_bt=valid)
  assert float(jnp.max(jnp.abs(jnp.where(valid[..., None], cut.hidden_btd - whole.hidden_btd, 0.0)))) <= 1e-12
  # a row's own K/V (what its descendants see next) are the same too; a trimmed block then a whole one
  assert float(jnp.max(jnp.abs(jnp.where(valid[None, ..., None, None], cut.kv.k - whole.kv.k, 0.0)))) <= 1e-12
  after = jnp.asarray(rng.integers(3, 96, (3, 2)), jnp.int32)
  both = lambda first: m64(after, prompt_len + 7, ancestors=[first, whole.kv]).hidden_btd
  assert float(jnp.max(jnp.abs(both(trimmed) - both(kv)))) <= 1e-12
  # a prompt no longer than the window keeps its K/V as it is (nothing to cut)
  short = jax.tree_util.tree_map(lambda x: x[:, :, :3] if x.ndim == 5 else x[:, :3], kv)
  assert isinstance(m64.branch_kv(short), Gemma4KV)


# heavy: ~25 s of compiles (a float64 reference, bfloat16 naive and replay). CI covers the same code in float64
# (test_group_replay_equals_naive_float64_with_the_window_across_the_prompt) and float32 (above).
@pytest.mark.heavy
def test_group_replay_bfloat16_error_at_most_twice_naive(model):
  # bfloat16 compute: replay's error against the float64 gradient at most twice naive's, as for Llama
  # (tests/test_replay.py) and Gemma 3.
  group = random_group([2, 5, 9], prompt_len=6, seed=3)
  with jax.enable_x64(True):
    graph64, params64 = params64(model)
    exact = jax.tree_util.tree_map(np.asarray, step(graph64, params64, arrays_of(group, np.float64), objective,
                                                    layout="naive")[2])
  arrays = arrays_of(group, np.float32)
  graphdef, params = nnx.split(build_model(model.config, nnx.to_pure_dict(nnx.state(model, nnx.Param)),
                                           dtype=jnp.bfloat16))
  naive_err = max_rel_err(step(graphdef, params, arrays, objective, layout="naive")[2], exact)
  replay_err = max_rel_err(step(graphdef, params, arrays, objective, micro_batch=1, fused=False)[2], exact)
  assert replay_err <= 2 * naive_err, (replay_err, naive_err)


def test_tree_replay_equals_naive_float64_where_a_node_sees_part_of_its_ancestors(model, x64):
  # Depth 3 (prompt 5, nodes of 2-4 tokens), window 4: a level-3 token sees part of its parent on the sliding
  # layers and every ancestor on the global ones. Depth-first replay equals the naive rows (float64).
  graphdef, params = params64(model)
  rng = np.random.default_rng(7)
  tree = window_tree(rng)
  tree_batch, rows, _ = tree_and_rows(tree, rng)
  ln, _, gn = step(graphdef, params, rows, objective, layout="naive")
  lt, _, gt = step(graphdef, params, tree_batch, objective, schedule="depth_first", micro_batch=2)
  assert abs(float(lt) - float(ln)) <= 1e-12 * max(1.0, abs(float(ln)))
  assert max_rel_err(gt, gn) <= 1e-10
  with pytest.raises(ValueError, match="packed tree"):   # the packed row's key ends take no window
    value_and_grad(POLICY, graphdef, params, pack_trees([tree_batch])[0], objective)


def test_a_segment_hands_on_the_sliding_and_the_global_layers_kv_in_their_own_shapes(model):
  out = model(jnp.arange(3, 10)[None], 0)
  assert isinstance(out.kv, Gemma4KV)
  assert out.kv.k.shape == out.kv.v.shape == (4, 1, 7, 2, 16)       # 4 sliding layers, 2 heads of 16
  assert out.kv.gk.shape == out.kv.gv.shape == (2, 1, 7, 1, 32)     # 2 global layers, 1 head of 32


def test_fsdp_mesh_step_equals_naive_float64():
  # Two groups over data x branch = 2 x 2 with FSDP parameters (the sliding and global layers' weights split and
  # gathered per repetition of the layer pattern): the summed gradient equals the naive groups' (<= 1e-10).
  with jax.enable_x64(True):
    graphdef, params = params64(load_hf_model(FIXTURE))
    groups = [arrays_of(random_group([2, 5, 9, 4], prompt_len=6 + 3 * s, seed=s), np.float64) for s in range(2)]
    fsdp_step_equals_naive(graphdef, params, groups)


def _tiny_gemma4(**overrides):
  base = dict(arch="gemma4_text", layer_types=(SLIDING, FULL), sliding_window=8, rope_local_theta=1e4,
              global_head_dim=16, global_kv_heads=1, k_eq_v=True, global_rope_fraction=0.25,
              final_logit_softcap=30.0, layer_scalars=(0.9, 1.1))
  return tiny_config(**{**base, **overrides})


def test_gemma4_config_fields_are_refused_by_name():
  with pytest.raises(ValueError, match="global_head_dim is Gemma 4's"):
    tiny_config(global_head_dim=16)
  with pytest.raises(ValueError, match="global_kv_heads must be a positive int"):
    _tiny_gemma4(global_kv_heads=None)
  with pytest.raises(ValueError, match="num_heads=4 is not a multiple of global_kv_heads=3"):
    _tiny_gemma4(global_kv_heads=3)
  with pytest.raises(ValueError, match="layer_scalars must be None or a tuple of 2"):
    _tiny_gemma4(layer_scalars=(1.0,))
  with pytest.raises(ValueError, match="attention_impl='pallas'"):
    Gemma4(_tiny_gemma4(), attention_impl="pallas")


@pytest.mark.parametrize("field,value,message", [
    ("attention_bias", True, "attention_bias"), ("hidden_activation", "silu", "hidden_activation != gelu_pytorch_tanh"),
])
def test_what_our_gemma4_does_not_build_is_refused_by_name_before_loading(tmp_path, field, value, message):
  import json
  import shutil
  directory = tmp_path / "g4"
  shutil.copytree(FIXTURE, directory)
  cfg = json.load(open(directory / "config.json"))
  json.dump({**cfg, field: value}, open(directory / "config.json", "w"))
  refused_before_loading(tmp_path, str(directory), "smoke", {}, f"{message} is not supported")


# heavy (26 s): tests/test_gemma4_e2b.py's LoRA test runs the same code in CI (adapters on both attention kinds and
# the MLP of Gemma 4's layer scan, replay against naive in float64, merging), on both of its groups of layers.
@pytest.mark.heavy
def test_lora_replay_equals_naive_float64_and_merging_keeps_the_function(model, x64):
  # Adapters (rank 2, random B) on the dense MLP and on both attention kinds: the sliding layers' wq, wk, wv, wo
  # and the global layers' wq, wk, wo (no wv: their values are their keys' projection), 10 stacks of two.
  # Replay (trimmed windows) and naive rows are the same function of the adapters (float64 rounding), every
  # adapter gets a gradient, and the merged model (W + s A B, for export) computes the adapted model's hidden
  # states to float64 rounding.
  from branch_replay_jax.models import lora
  spec = lora.LoraSpec(rank=2, alpha=4.0)
  graphdef, adapters, base = adapted64(*params64(model), spec)
  arrays = arrays_of(random_group([2, 5, 9], prompt_len=6, seed=3), np.float64)
  ln, _, gn = lora_step(graphdef, adapters, base, arrays, layout="naive")
  lr, _, gr = lora_step(graphdef, adapters, base, arrays, micro_batch=1, fused=False)
  assert abs(float(lr) - float(ln)) <= 1e-12 * max(1.0, abs(float(ln)))
  assert max_rel_err(gr, gn) <= 1e-10
  flat = {jax.tree_util.keystr(k): np.abs(np.asarray(v)).max() for k, v in jax.tree_util.tree_leaves_with_path(gr)}
  assert len(flat) == 20 and min(flat.values()) > 1e-8, flat
  assert not any("'full']['wv_lora" in k for k in flat)
  adapted = nnx.merge(graphdef, adapters, base)
  ids = jnp.arange(3, 20)[None]   # 17 tokens: past the window of 4
  want = adapted(ids, 0).hidden_btd
  got = lora.merged(adapted)(ids, 0).hidden_btd
  assert float(jnp.abs(got - want).max()) <= 1e-12 * float(jnp.abs(want).max())


def test_lora_on_the_fsdp_mesh_equals_naive_float64(model):
  # tests/test_qwen3_5.py's check on Gemma 4: two groups over data x branch = 2 x 2, the adapters of both attention
  # stacks and the MLP and the frozen base FSDP-sharded, gathered layer by layer inside the pattern's scan.
  from branch_replay_jax.models import lora
  with jax.enable_x64(True):
    groups = [arrays_of(random_group([2, 5, 9, 4], prompt_len=6 + 3 * s, seed=s), np.float64) for s in range(2)]
    lora_fsdp_step_equals_naive(*adapted64(*params64(model), lora.LoraSpec(rank=2, alpha=4.0)), groups)


def test_lora_rank_is_bounded_by_the_global_layers_shapes_too():
  # The global layers' wk maps d = 32 to 1 head of 16 (fan-out 16): rank 20 fits the sliding layers' wq (fan-out
  # 32) but not it, and is refused naming the projection.
  from branch_replay_jax.models import lora
  cfg = _tiny_gemma4(d_model=32)
  with pytest.raises(ValueError, match="lora.rank=20 is larger than projection wk's dimensions"):
    lora.check_spec(20, 8.0, ("wq", "wk"), cfg)
  assert lora.check_spec(16, 8.0, ("wq", "wk"), cfg).rank == 16


# heavy (~30 s): CI runs the loop on Gemma 4 with full parameters in
# tests/test_gemma4_moe.py::test_grpo_trains_a_gemma4_moe_directory_with_routing_replay (the same layers, experts
# beside the MLP) and on this model's adapters in test_grpo_trains_lora_adapters_of_a_gemma4_directory.
@pytest.mark.heavy
def test_grpo_trains_a_gemma4_directory_by_replay_and_checks_it_against_naive_rows(tmp_path, monkeypatch):
  # A random two-layer Gemma 4 (a sliding layer of window 8, a global layer of another head width whose values
  # are its keys, logits capped at 30) over SmolLM2's tokenizer, exported as a Hugging Face directory and
  # trained by the GRPO smoke experiment: every prompt (~40 tokens) is longer than the window. The step's
  # run-time exactness check computes one group's gradient by replay and by naive rows: equal to float32
  # rounding (exactness_ok, the bound of algorithms/exactness.py).
  cfg = _tiny_gemma4(vocab_size=SMOLLM2_VOCAB, max_positions=2048)
  record = grpo_on_exported(Gemma4(cfg, rngs=nnx.Rngs(0)), tmp_path, monkeypatch)
  assert record["exactness_ok"] is True and 0 < record["exactness_grad_rel_err"] <= 1e-4
  assert np.isfinite(record["loss"]) and record["grad_norm"] > 0 and record["reward_std"] > 0


def test_grpo_trains_lora_adapters_of_a_gemma4_directory(tmp_path, monkeypatch):
  # The same directory trained by the LoRA smoke experiment (adapters on the attention of both kinds and the MLP):
  # the run-time exactness check holds replay's adapter gradient to naive rows' (float32 rounding).
  cfg = _tiny_gemma4(vocab_size=SMOLLM2_VOCAB, max_positions=2048)
  record = grpo_on_exported(Gemma4(cfg, rngs=nnx.Rngs(0)), tmp_path, monkeypatch, variant="lora_smoke")
  assert record["exactness_ok"] is True and 0 < record["exactness_grad_rel_err"] <= 1e-4
  assert np.isfinite(record["loss"]) and record["grad_norm"] > 0


def test_episode_turns_on_the_kept_kv_sample_what_a_full_reprefill_samples(model):
  # The fixture over the 64-id setting of tests/test_episode_sampler.py: three branches of three turns, the
  # prompt's K/V shared, each turn decoded on both kinds of K/V cache and the observations prefilled on them;
  # turns of up to 6 tokens against a window of 4. Same key, same draws as re-prefilling the whole history every
  # turn; log-probs to float32 rounding.
  from test_episode_sampler import kept_equals_reprefill
  kept_equals_reprefill(model)


def test_the_samplers_logprobs_are_the_trainers_of_the_capped_logits(model):
  # Sampled at temperature 1 on the K/V caches, each token's recorded log-prob is log softmax(cap(z)) of a full
  # forward (what the loss takes: token_logprobs with the model's softcap) to float32 rounding; without the cap
  # on either side they would differ by ~0.2 (the parity test's change0).
  from branch_replay_jax.rollout.sampler import sample_group
  prompt = np.arange(5, 14)
  out = sample_group(model, prompt, num_samples=3, max_new_tokens=12, key=jax.random.key(3), temperature=1.0)
  for tokens, logprobs in zip(np.asarray(out.tokens), np.asarray(out.logprobs)):
    full = next_logprobs(model, prompt.tolist() + tokens.tolist())[len(prompt) - 1:]
    assert np.abs(full - logprobs).max() <= 2e-5


def test_a_gemma4_model_refuses_the_seq_axis_before_loading(tmp_path):
  refused_before_loading(tmp_path, FIXTURE, "smoke", {"mesh.seq": 8, "rollout.prompts_per_step": 1},
                         "has sliding-window layers \\(Gemma 4\\): .*ring attention\\) takes no window")


@pytest.mark.parametrize("edit,expected", [
    # the released files' fields in place of per_layer_config: the same model
    (lambda c: {**{k: v for k, v in c.items() if k != "per_layer_config"}, "global_head_dim": 32,
                "num_global_key_value_heads": 1}, None),
    # transformers gives a layer per_layer_config leaves out the common shape: layer 5 then differs from layer 2
    (lambda c: {**c, "per_layer_config": {"2": c["per_layer_config"]["2"]}}, "gives layer 5 \\(full_attention\\)"),
    (lambda c: {**c, "per_layer_config": {**c["per_layer_config"], "0": {"head_dim": 32}}},
     "gives layer 0 \\(sliding_attention\\)"),
])
def test_the_global_layers_shape_is_read_as_transformers_reads_it(tmp_path, model, edit, expected):
  import json
  import shutil
  directory = tmp_path / "g4"
  shutil.copytree(FIXTURE, directory)
  cfg = json.load(open(directory / "config.json"))
  json.dump(edit(cfg), open(directory / "config.json", "w"))
  if expected is None:
    assert load_hf_model(str(directory)).config == model.config
  else:
    with pytest.raises(ValueError, match=expected):
      load_hf_model(str(directory))


def test_a_null_window_and_a_nan_layer_scalar_are_refused_by_name(tmp_path):
  import json
  import shutil
  from safetensors.numpy import load_file, save_file
  directory = tmp_path / "g4"
  shutil.copytree(FIXTURE, directory)
  cfg = json.load(open(directory / "config.json"))
  json.dump({**cfg, "sliding_window": None}, open(directory / "config.json", "w"))
  with pytest.raises(ValueError, match="sliding_window=null"):
    load_hf_model(str(directory))
  json.dump(cfg, open(directory / "config.json", "w"))
  tensors = load_file(str(directory / "model.safetensors"))
  tensors["model.layers.3.layer_scalar"] = np.asarray([np.nan], np.float32)
  save_file(tensors, str(directory / "model.safetensors"))
  with pytest.raises(ValueError, match="model.layers.3.layer_scalar is nan; a layer scalar must be finite"):
    load_hf_model(str(directory))


def test_global_kv_heads_of_their_own_need_k_eq_v():
  # transformers' Gemma4TextConfig reads num_global_key_value_heads only with attention_k_eq_v: a config with
  # other global K/V heads and k_eq_v False would export a checkpoint no one reads back
  with pytest.raises(ValueError, match="global_kv_heads=1 differs from num_kv_heads=2 with k_eq_v=False"):
    _tiny_gemma4(k_eq_v=False)
  assert _tiny_gemma4(k_eq_v=False, global_kv_heads=2).global_kv_heads == 2
