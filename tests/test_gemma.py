"""Gemma 3's text decoder: parity with transformers on a tiny random checkpoint (tests/fixtures/gemma3_tiny,
written by tools/make_gemma3_reference.py), and branch replay exact where the sliding window cuts across
segment boundaries."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import max_rel_err, random_group
from families import (SMOLLM2_VOCAB, arrays_of, fsdp_step_equals_naive, grpo_on_exported, objective, reference_error,
                      refused_before_loading, ring_cache_equals_full_cache, step, tree_and_rows, window_tree)
from flax import nnx

from branch_replay_jax.data.batches import pack_trees
from branch_replay_jax.export import export_model
from branch_replay_jax.gradients.heads import POLICY
from branch_replay_jax.gradients.step import fused_applies, value_and_grad
from branch_replay_jax.models import Llama, tiny_config
from branch_replay_jax.models.config import FULL, SLIDING
from branch_replay_jax.models.loading import build_model, load_hf_model
from branch_replay_jax.models.window_kv import WindowedPrompt
from branch_replay_jax.rollout.sampler import sample_group

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "gemma3_tiny")
WINDOW = 4   # the fixture's sliding_window: shorter than every input and segment path below


def test_config_reads_the_window_layer_types_and_both_ropes(model):
  c = model.config
  assert c.arch == "gemma3_text" and c.sliding_window == WINDOW
  assert c.layer_types == (SLIDING, SLIDING, FULL, SLIDING)
  assert (c.rope_theta, c.rope_scaling.factor, c.rope_local_theta) == (1e6, 8.0, 1e4)
  assert c.query_pre_attn_scalar == 12.0 and c.qk_norm and c.tie_embeddings


def test_logprobs_match_transformers_float32(model, reference):
  # Same weights through transformers' Gemma3ForCausalLM (eager attention, float32) and our decoder.
  # Inputs of 23 and 40 tokens against a window of 4: most keys of the sliding layers are cut.
  # The fixture is rounded to 1e-6; float32 reassociation adds ~1e-6.
  for item in reference["inputs"]:
    assert reference_error(model, item) <= 1e-5


def test_the_window_is_what_the_parity_measures(model, reference):
  # The same weights with a window longer than the input differ from transformers by far more than the
  # parity bound: the window (and its off-by-one, q - k < W) is what test_logprobs_match_... checks.
  c = model.config
  wide = build_model(dataclasses.replace(c, sliding_window=1000), nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  item = reference["inputs"][1]
  assert reference_error(wide, item) > 1e-2
  narrow = build_model(dataclasses.replace(c, sliding_window=WINDOW - 1), nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  assert reference_error(narrow, item) > 1e-3


def test_greedy_sampling_through_the_kv_cache_reproduces_transformers(model, reference):
  # transformers: 16 argmax steps of full forwards. Ours: sample_group at temperature 0, the prompt padded
  # to its bucket and every token decoded on the K/V cache, so each sliding layer's window crosses from the
  # cache into the prompt block. The smallest top-1/top-2 gap, 0.0093, is ~1e4 times our logit error.
  g = reference["greedy"]
  assert min(g["top1_minus_top2"]) > 5e-3
  out = sample_group(model, np.asarray(g["prompt_ids"]), num_samples=2, max_new_tokens=len(g["ids"]),
                     key=jax.random.key(0), temperature=0.0)
  assert np.asarray(out.tokens).tolist() == [g["ids"]] * 2


def test_group_sampler_ring_cache_equals_the_whole_cache_float64(model):
  # Gemma 3: its sliding layers' ring [L, ...] beside the global layers' whole cache [Lg, ...], one layer stack;
  # the sampler's tokens and log-probs as with the whole cache (families.ring_cache_equals_full_cache).
  ring_cache_equals_full_cache(model)


@pytest.mark.parametrize("override", [dict(sliding_window=1), dict(layer_types=(SLIDING,) * 4),
                                      dict(layer_types=(FULL,) * 4, sliding_window=None)],
                         ids=["window-1", "no-global-layer", "no-sliding-layer"])
def test_the_sampler_keeps_the_whole_cache_where_a_ring_has_nothing_to_cut(model, override):
  # W = 1 (a ring of 0 slots), a Gemma 3 of sliding layers only (fewer layers than its sliding_window_pattern)
  # or of global ones: the sampler decodes them into the whole cache, as before the ring (a helper found all
  # three crashing sample_group), and samples 6 tokens.
  from branch_replay_jax.models.window_kv import RingCache
  from branch_replay_jax.rollout.sampler import init_cache
  edge = build_model(dataclasses.replace(model.config, **override), nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  assert not isinstance(init_cache(edge, 2, 6, ring=True), RingCache)
  out = sample_group(edge, np.arange(5, 12), num_samples=2, max_new_tokens=6, key=jax.random.key(0))
  assert np.asarray(out.lengths).tolist() == [6, 6]


def test_export_writes_what_transformers_and_our_loader_read(model, tmp_path, reference):
  # Exported config.json + model.safetensors load back into the same parameters and log-probs.
  export_model(model, None, str(tmp_path / "out"))
  back = load_hf_model(str(tmp_path / "out"))
  assert back.config == model.config
  want, got = nnx.to_pure_dict(nnx.state(model, nnx.Param)), nnx.to_pure_dict(nnx.state(back, nnx.Param))
  assert jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, got, want))
  with open(tmp_path / "out" / "config.json") as f:
    written = json.load(f)
  with open(os.path.join(FIXTURE, "config.json")) as f:
    source = json.load(f)
  for key in ("layer_types", "sliding_window", "query_pre_attn_scalar", "rope_parameters", "hidden_activation"):
    assert written[key] == source[key] and type(written[key]) is type(source[key]), key   # transformers checks types


def _params(model, dtype):
  graphdef, params = nnx.split(model)
  return graphdef, jax.tree_util.tree_map(lambda x: x.astype(dtype), params)


def test_group_replay_equals_naive_float64_with_the_window_across_the_prompt(model, x64):
  # Prompt of 6, completions of 2, 5 and 9 tokens, window 4: a completion's first tokens see the last
  # prompt keys only, later ones none. Replay (the prompt once, the completions on its K/V, unfused and
  # fused) and naive rows (prompt + completion as one sequence) are the same function: float64 rounding.
  m64 = build_model(model.config, nnx.to_pure_dict(nnx.state(model, nnx.Param)), dtype=jnp.float64)
  graphdef, params = _params(m64, jnp.float64)
  arrays = arrays_of(_window_group(), np.float64)
  assert fused_applies(arrays, micro_batch=None)
  ln, an, gn = step(graphdef, params, arrays, objective, layout="naive")
  for kw in (dict(micro_batch=1, fused=False), dict(micro_batch=None, fused=True)):
    lr, ar, gr = step(graphdef, params, arrays, objective, **kw)
    assert abs(float(lr) - float(ln)) <= 1e-12 * max(1.0, abs(float(ln))), kw
    assert max_rel_err(gr, gn) <= 1e-10, kw


def _float64_gradient(model, arrays64):
  with jax.enable_x64(True):
    m64 = build_model(model.config, nnx.to_pure_dict(nnx.state(model, nnx.Param)), dtype=jnp.float64)
    g64, p64 = _params(m64, jnp.float64)
    return jax.tree_util.tree_map(np.asarray, step(g64, p64, arrays64, objective, layout="naive")[2])


def _window_group():
  return random_group([2, 5, 9], prompt_len=6, seed=3)


def test_group_replay_float32_within_rounding_of_naive(model):
  # float32: replay against naive within 1e-4 relative (rounding order only; measured ~1e-6).
  arrays = arrays_of(_window_group(), np.float32)
  graphdef, params = _params(model, jnp.float32)
  _, _, gn = step(graphdef, params, arrays, objective, layout="naive")
  _, _, gr = step(graphdef, params, arrays, objective, micro_batch=1, fused=False)
  assert max_rel_err(gr, gn) <= 1e-4


# heavy: ~25 s of compiles (float64 reference, bfloat16 naive and replay). CI covers the same code in
# float64 (test_group_replay_equals_naive_float64_with_the_window_across_the_prompt) and float32 (above).
@pytest.mark.heavy
def test_group_replay_bfloat16_error_at_most_twice_naive(model):
  # bfloat16 compute: replay's error against the float64 gradient at most twice naive's, as for Llama
  # (tests/test_replay.py).
  with jax.enable_x64(True):
    arrays64 = arrays_of(_window_group(), np.float64)
  exact = _float64_gradient(model, arrays64)
  arrays = arrays_of(_window_group(), np.float32)
  mbf = build_model(model.config, nnx.to_pure_dict(nnx.state(model, nnx.Param)), dtype=jnp.bfloat16)
  graphdef, params = _params(mbf, jnp.float32)
  naive_err = max_rel_err(step(graphdef, params, arrays, objective, layout="naive")[2], exact)
  replay_err = max_rel_err(step(graphdef, params, arrays, objective, micro_batch=1, fused=False)[2], exact)
  assert replay_err <= 2 * naive_err, (replay_err, naive_err)


@pytest.mark.parametrize("prompt_len", [6, 2])
def test_replay_hands_the_branches_only_the_prompt_keys_a_window_reaches(model, x64, prompt_len):
  # A prompt of prompt_len real tokens in a bucket of 8, window 4: no branch token (positions >= prompt_len)
  # reaches a sliding layer's prompt key before prompt_len - 3, so replay keeps the one global layer's 8 keys
  # and every layer's last 3 (4 x 8 = 32 -> 1 x 8 + 4 x 3 = 20 key slots per row); with prompt_len 2 the tail
  # starts at 0 and holds the 2 real keys and a padded one. Branches on the trimmed K/V compute the same
  # hidden states as on the whole prompt's (float64: the softmax's sums in another order, <= 1e-12).
  m64 = build_model(model.config, nnx.to_pure_dict(nnx.state(model, nnx.Param)), dtype=jnp.float64)
  rng = np.random.default_rng(5)
  prompt = jnp.asarray(rng.integers(3, 96, (1, 8)), jnp.int32)
  kv = m64(prompt, 0, valid_bt=(jnp.arange(8) < prompt_len)[None]).kv
  trimmed = m64.branch_kv(kv)
  assert isinstance(trimmed, WindowedPrompt)
  assert trimmed.full.k.shape[:3] == (1, 1, 8) and trimmed.tail.k.shape[:3] == (4, 1, 3)
  start = max(prompt_len - 3, 0)
  assert int(trimmed.start[0]) == start
  np.testing.assert_array_equal(trimmed.tail.k, kv.k[:, :, start:start + 3])
  np.testing.assert_array_equal(trimmed.full.v[0], kv.v[2])   # layer 2 is the global one
  rows = jnp.asarray(rng.integers(3, 96, (3, 7)), jnp.int32)
  valid = jnp.arange(7)[None] < jnp.asarray([[7], [4], [1]])
  whole = m64(rows, prompt_len, ancestors=[kv], valid_bt=valid).hidden_btd
  cut = m64(rows, prompt_len, ancestors=[trimmed], valid_bt=valid).hidden_btd
  assert float(jnp.max(jnp.abs(jnp.where(valid[..., None], cut - whole, 0.0)))) <= 1e-12
  # a prompt no longer than the window keeps its K/V as it is (nothing to cut)
  assert m64.branch_kv(jax.tree_util.tree_map(lambda x: x[:, :, :3] if x.ndim == 5 else x[:, :3], kv)).k.shape[2] == 3


def test_tree_replay_equals_naive_float64_where_a_node_sees_part_of_its_ancestors(model, x64):
  # Depth 3: prompt 5, then nodes of 2-4 tokens. With window 4 a level-3 token sees part of its parent
  # and none of its grandparent or the prompt; the window is measured in positions across the segments. The
  # prompt's bucket (16) and the level nodes' (8) exceed the window's 3 reachable keys, so each hands its
  # descendants trimmed K/V (models/window_kv.py).
  m64 = build_model(model.config, nnx.to_pure_dict(nnx.state(model, nnx.Param)), dtype=jnp.float64)
  graphdef, params = _params(m64, jnp.float64)
  rng = np.random.default_rng(7)
  tree = window_tree(rng)
  tree_batch, rows, _ = tree_and_rows(tree, rng)   # the same draws, in the same order, as every family
  ln, _, gn = step(graphdef, params, rows, objective, layout="naive")
  # depth-first, two leaf siblings per step (the schedules differ only above the model: tests/test_tree_replay.py)
  lt, _, gt = step(graphdef, params, tree_batch, objective, schedule="depth_first", micro_batch=2)
  assert abs(float(lt) - float(ln)) <= 1e-12 * max(1.0, abs(float(ln)))
  assert max_rel_err(gt, gn) <= 1e-10
  with pytest.raises(ValueError, match="packed tree"):   # the packed row's key ends take no window
    value_and_grad(POLICY, graphdef, params, pack_trees([tree_batch])[0], objective)


def test_sliding_window_options_are_refused_by_name():
  with pytest.raises(ValueError, match="attention_impl='pallas'"):
    Llama(tiny_config(arch="gemma3_text", layer_types=(SLIDING, FULL), sliding_window=4, rope_local_theta=1e4,
                      qk_norm=True), attention_impl="pallas")
  with pytest.raises(ValueError, match="sliding_window is Gemma 3's"):
    tiny_config(sliding_window=4)
  with pytest.raises(ValueError, match="layer_types must be a tuple of 2"):
    tiny_config(arch="gemma3_text", layer_types=(SLIDING,), sliding_window=4, rope_local_theta=1e4)
  with pytest.raises(ValueError, match="rope_local_theta"):
    tiny_config(arch="gemma3_text", layer_types=(SLIDING, FULL), sliding_window=4)


# heavy (~26 s in CI): CI covers its parts: the step (the float64 group, tree and FSDP tests, float32 above),
# sampling through the window (test_greedy_sampling_through_the_kv_cache_reproduces_transformers), the directory
# (the export test) and the loop on an exported directory (test_qwen3_5.py's GRPO test).
@pytest.mark.heavy
def test_grpo_trains_a_gemma_directory_by_replay_and_checks_it_against_naive_rows(tmp_path, monkeypatch):
  # A random two-layer Gemma 3 (one sliding layer of window 8, one global) over SmolLM2's tokenizer, exported
  # as a Hugging Face directory and trained by the GRPO smoke experiment: every prompt (~40 tokens) is longer
  # than the window. The step's run-time exactness check computes one group's gradient by replay and by naive
  # rows: equal to float32 rounding (exactness_ok, the bound of algorithms/exactness.py).
  cfg = tiny_config(vocab_size=SMOLLM2_VOCAB, arch="gemma3_text", layer_types=(SLIDING, FULL), sliding_window=8,
                    rope_local_theta=1e4, query_pre_attn_scalar=8.0, qk_norm=True, max_positions=2048)
  record = grpo_on_exported(Llama(cfg, rngs=nnx.Rngs(0)), tmp_path, monkeypatch)
  assert record["exactness_ok"] is True and 0 < record["exactness_grad_rel_err"] <= 1e-4
  assert np.isfinite(record["loss"]) and record["grad_norm"] > 0 and record["reward_std"] > 0


@pytest.mark.parametrize("field,value,message", [
    ("model.attention_impl", "pallas", "no Pallas kernel takes a window"),
    ("mesh.seq", 8, "ring attention\\) takes no window"),
])
def test_a_sliding_window_model_refuses_what_its_attention_does_not_take_before_loading(tmp_path, field, value,
                                                                                        message):
  overrides = {field: value, **({"rollout.prompts_per_step": 1} if field == "mesh.seq" else {})}
  refused_before_loading(tmp_path, FIXTURE, "smoke", overrides, f"has sliding-window layers \\(Gemma 3\\): .*{message}")


def test_fsdp_mesh_step_equals_naive_float64():
  # Two groups over data x branch = 2 x 2 with FSDP parameters (every Gemma weight, the post norms included,
  # split and gathered layer by layer inside the scan, each layer's window and RoPE scanned beside it): the
  # summed gradient equals the two naive groups' to float64 rounding (<= 1e-10).
  with jax.enable_x64(True):
    model = load_hf_model(FIXTURE)
    m64 = build_model(model.config, nnx.to_pure_dict(nnx.state(model, nnx.Param)), dtype=jnp.float64)
    groups = [arrays_of(random_group([2, 5, 9, 4], prompt_len=6 + 3 * s, seed=s), np.float64) for s in range(2)]
    fsdp_step_equals_naive(*_params(m64, jnp.float64), groups)


def test_episode_turns_on_the_kept_kv_sample_what_a_full_reprefill_samples(model):
  # Three branches of three turns (tests/test_episode_sampler.py's setting: a 9-id prompt, turns of up to 6
  # tokens, observations of 5) against a window of 4, so a turn's window ends inside earlier blocks. Same key,
  # same draws as re-prefilling the whole history every turn; log-probs to float32 rounding.
  from test_episode_sampler import kept_equals_reprefill
  kept_equals_reprefill(model)
