"""Gemma 4's mixture-of-experts block (the 26B-A4B layout: a dense GeGLU MLP beside GeGLU experts routed by
Gemma 4's router): parity with transformers on a tiny random checkpoint (tests/fixtures/gemma4_moe_tiny,
written by tools/make_gemma4_moe_reference.py), and branch replay exact with routing replay and the
load-balancing loss on sliding and global layers (models/gemma4.py, `llama.moe_mlp`). The dense Gemma 4 is
tests/test_gemma4.py; the routing-replay checks are tests/test_moe.py's, run here on this model."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import max_rel_err, random_group
from families import (SMOLLM2_VOCAB, arrays_of, export_round_trip, fsdp_step_equals_naive, greedy_reproduces,
                      grpo_on_exported, objective, reference_error, sampler_routes, step,
                      window_tree_equals_naive)
from flax import nnx
from test_moe import (group_routing_replay_equals_naive, sampler_records_the_trainers_routes,
                      tree_routing_replay_equals_naive)

from branch_replay_jax.gradients.heads import Policy
from branch_replay_jax.models import tiny_config
from branch_replay_jax.models.config import ARCHITECTURE_SHAPES, FULL, SLIDING
from branch_replay_jax.models.gemma4 import Gemma4
from branch_replay_jax.models.loading import build_model, load_hf_model

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "gemma4_moe_tiny")


def test_config_reads_the_experts_beside_the_dense_mlp(model):
  c = model.config
  assert c.gemma4 and c.moe and not c.shared_expert
  assert (c.num_experts, c.experts_per_token, c.expert_ffn_dim, c.norm_topk_prob, c.ffn_dim) == (4, 2, 24, True, 80)
  lay = model.layers
  assert lay.w_gate.shape == (6, 48, 80) and lay.e_gate.shape == lay.e_up.shape == (6, 4, 48, 24)
  assert lay.e_down.shape == (6, 4, 24, 48) and lay.w_router.shape == (6, 48, 4)
  assert lay.router_scale.shape == (6, 48) and lay.expert_scale.shape == (6, 4)


def test_logprobs_match_transformers_float32(model, reference):
  # Same weights through transformers' Gemma4ForCausalLM (eager attention and experts, float32) and our decoder.
  # Measured 9.5e-6 and 1.2e-5 on the two inputs; transformers' own float32 result differs from its float64 one
  # by 2.0e-5 on this fixture (tools/make_gemma4_moe_reference.py's model run in both), so the bound is that.
  for item in reference["inputs"]:
    assert reference_error(model, item) <= 2.5e-5


@pytest.mark.parametrize("part", ["router_scale", "expert_scale", "e_down", "mlp_out_norm", "experts_out_norm"])
def test_each_part_of_the_block_is_what_the_parity_measures(model, reference, part):
  # The same weights with the router's scale, the per-expert scale or a norm of the block set to ones, or the
  # experts silenced (e_down zero), differ from transformers by far more than the parity bound: each is read.
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  w = params["layers"][part]
  params["layers"][part] = np.zeros_like(w) if part == "e_down" else np.ones_like(w)
  other = build_model(model.config, params)
  item = reference["inputs"][1]
  assert reference_error(other, item) > 1e-3


def test_greedy_sampling_reproduces_transformers(model, reference):
  # 16 argmax steps; the smallest top-1/top-2 gap, 0.023, is ~1e3 times our logit error.
  greedy_reproduces(model, reference, min_gap=2e-2)


def test_export_writes_what_transformers_and_our_loader_read(model, tmp_path):
  # The experts' fused gate_up_proj [E, 2 F_e, d] and down_proj [E, d, F_e], the router's proj, scale and
  # per_expert_scale and the three norms written back with transformers' names and shapes.
  export_round_trip(model, FIXTURE, tmp_path)


def test_group_replay_equals_naive_float64_with_the_routers_gradient(model64, x64):
  # The prompt's tokens are routed once in replay and once per row in naive, through windows of 4 across the
  # prompt; the gradients, the router's, its scales' and the experts' included, agree to float64 rounding.
  graphdef, params = model64
  arrays = arrays_of(random_group([3, 6, 9, 2], prompt_len=7, seed=4, vocab=96), np.float64)
  ln, _, gn = step(graphdef, params, arrays, objective, layout="naive")
  lr, _, gr = step(graphdef, params, arrays, objective, micro_batch=1, fused=False)
  assert abs(float(lr) - float(ln)) <= 1e-12 * max(1.0, abs(float(ln)))
  assert max_rel_err(gr, gn) <= 1e-10
  for name in ("w_router", "router_scale", "expert_scale", "e_gate"):   # each learns
    assert float(jnp.abs(gn["layers"][name][...]).max()) > 1e-6, name


# heavy (58-88 s): CI replays this model's recorded routes with the load-balancing loss on the mesh, float64, in
# test_mesh_step_with_experts_split_over_branch_equals_naive_float64 (the same routes, flips and unrecorded tokens),
# and this helper on one device with Qwen3-MoE in tests/test_moe.py.
@pytest.mark.heavy
def test_routing_replay_equals_naive_float64_with_the_load_balancing_loss(model64, x64):
  # tests/test_moe.py's check: 30% of the pairs recorded with another expert, 20% of the completion tokens
  # unrecorded, replayed with the load-balancing loss; replay equals naive rows, both log the same mismatch, and
  # replaying moves the loss. The gating weights of replayed routes carry Gemma 4's per-expert scale.
  group_routing_replay_equals_naive(*model64, router_aux_coef=0.5)


# heavy (25 s): CI replays Gemma 4's experts in a tree (depth first, windows cut) in
# test_tree_replay_equals_naive_float64_where_a_node_sees_part_of_its_ancestors, recorded routes with this model in
# test_mesh_step_with_experts_split_over_branch_equals_naive_float64, and a tree's recorded routes with
# tests/test_moe.py's ("level", 0.5) case: the same helper on Qwen3-MoE.
@pytest.mark.heavy
def test_tree_routing_replay_equals_naive_float64(model64, x64):
  # tests/test_moe.py's depth-2 tree with per-node recorded routes, the depth-first schedule: a node's tokens
  # see part of their ancestors on the sliding layers (window 4) and all of them on the global ones.
  tree_routing_replay_equals_naive(*model64, "depth_first", 0.5)


# heavy (43 s): the experts in Gemma 4's layer scan run in CI by
# test_group_replay_equals_naive_float64_with_the_routers_gradient, Gemma 4's depth-3 window tree by
# tests/test_gemma4.py's tree test, and experts in trees by tests/test_moe.py's tree routing-replay tests.
@pytest.mark.heavy
def test_tree_replay_equals_naive_float64_where_a_node_sees_part_of_its_ancestors(model64, x64):
  # tests/test_gemma4.py's depth-3 tree, each node routed once on its trimmed ancestors' K/V.
  window_tree_equals_naive(*model64)


# heavy (25 s): the float32 replay runs the code test_group_replay_equals_naive_float64_with_the_routers_gradient
# checks in float64 (CI); tests/test_gemma4.py's float32 test runs Gemma 4's scans in float32 in CI.
@pytest.mark.heavy
def test_group_replay_float32_within_rounding_of_naive(model):
  arrays = arrays_of(random_group([2, 5, 9], prompt_len=6, seed=3, vocab=96), np.float32)
  graphdef, params = nnx.split(model)
  _, _, gn = step(graphdef, params, arrays, objective, layout="naive")
  _, _, gr = step(graphdef, params, arrays, objective, micro_batch=1, fused=False)
  assert max_rel_err(gr, gn) <= 1e-4


def test_mesh_step_with_experts_split_over_branch_equals_naive_float64(model64):
  # Two groups over data x branch = 2 x 2, the fixture's 4 experts split over branch (2 per device, dispatched
  # to: models.llama._dispatched_expert_sum) and the rest replicated, with recorded routes replayed and the
  # load-balancing loss: the loss and summed gradient equal the naive groups' (float64).
  graphdef, params = model64
  with jax.enable_x64(True):
    groups = []
    for s in range(2):
      arrays = arrays_of(random_group([2, 5, 9, 4], prompt_len=6 + 3 * s, seed=s, vocab=96), np.float64, seed=s)
      prompt_routes, routes, _, _ = sampler_routes(graphdef, params, arrays, np.random.default_rng(s), flip=0.3,
                                                     unrecorded=0.2)
      groups.append(arrays.replace(prompt_routes=prompt_routes, levels=(arrays.branches.replace(routes=routes),)))
    fsdp_step_equals_naive(graphdef, params, groups, head=Policy(router_aux_coef=0.5, routing_replay=True),
                           mode="replicated", expert="branch")


def test_the_sampler_records_the_routes_the_trainer_computes_float64(model64, x64):
  # tests/test_moe.py's check through Gemma 4's two K/V caches: the prompt's experts from its prefill, each fed
  # token's from its decode step, equal to a full forward's.
  sampler_records_the_trainers_routes(nnx.merge(*model64))


def _tiny_gemma4_moe(**overrides):
  base = dict(arch="gemma4_text", layer_types=(SLIDING, FULL), sliding_window=8, rope_local_theta=1e4,
              global_head_dim=16, global_kv_heads=1, k_eq_v=True, global_rope_fraction=0.25,
              final_logit_softcap=30.0, num_experts=4, experts_per_token=2, expert_ffn_dim=16)
  return tiny_config(**{**base, **overrides})


def test_gemma4_expert_fields_are_checked_by_name():
  with pytest.raises(ValueError, match="norm_topk_prob=False: Gemma 4's router always renormalises"):
    _tiny_gemma4_moe(norm_topk_prob=False)
  with pytest.raises(ValueError, match="expert_ffn_dim is a mixture of experts'.* has none without num_experts"):
    _tiny_gemma4_moe(num_experts=None, experts_per_token=None)
  with pytest.raises(ValueError, match="routes= is a mixture of experts'"):
    dense = Gemma4(_tiny_gemma4_moe(num_experts=None, experts_per_token=None, expert_ffn_dim=None),
                   rngs=nnx.Rngs(0))
    dense(jnp.arange(3)[None], 0, routes=jnp.zeros((1, 3, 2, 2), jnp.int32))


@pytest.mark.parametrize("edit,message", [
    ({"top_k_experts": 5}, "top_k_experts=5 must be in 1..num_experts=4"),
    ({"num_experts": None}, "no num_experts; our decoder needs it"),
    ({"moe_intermediate_size": 24.0}, "moe_intermediate_size=24.0 must be an int"),
])
def test_a_bad_expert_field_is_refused_naming_the_file_and_the_key(tmp_path, edit, message):
  import json
  import shutil
  directory = tmp_path / "g4"
  shutil.copytree(FIXTURE, directory)
  cfg = json.load(open(directory / "config.json"))
  json.dump({**cfg, **edit}, open(directory / "config.json", "w"))
  with pytest.raises(ValueError, match=f"config.json: {message}"):
    load_hf_model(str(directory))


def test_the_26b_a4b_shapes_hold_its_published_parameter_counts():
  # Google's model card: 25.2B parameters, 3.8B active per token. Ours by jax.eval_shape (no weights): 25.23B in
  # all; active (dense layers, the router, 8 of 128 experts, the tied embedding as the output projection) 3.82B.
  c = ARCHITECTURE_SHAPES["gemma-4-26b-a4b"]
  shapes = jax.eval_shape(lambda: nnx.state(Gemma4(c, rngs=nnx.Rngs(0)), nnx.Param))
  assert round(sum(x.size for x in jax.tree_util.tree_leaves(shapes)) / 1e9, 1) == 25.2
  assert round(c.params_per_token_linear / 1e9, 1) == 3.8


def test_grpo_trains_a_gemma4_moe_directory_with_routing_replay(tmp_path, monkeypatch):
  # A random two-layer Gemma 4 with 4 experts (2 per token) over SmolLM2's tokenizer, exported and trained by
  # the GRPO smoke experiment with routing replay and the load-balancing loss; the run-time exactness check
  # computes one group's gradient by replay and by naive rows: equal to float32 rounding.
  cfg = _tiny_gemma4_moe(vocab_size=SMOLLM2_VOCAB, max_positions=2048)
  record = grpo_on_exported(Gemma4(cfg, rngs=nnx.Rngs(0)), tmp_path, monkeypatch,
                            **{"model.routing_replay": True, "loss.router_aux_coef": 0.01})
  assert record["exactness_ok"] is True and 0 < record["exactness_grad_rel_err"] <= 1e-4
  assert np.isfinite(record["loss"]) and record["grad_norm"] > 0 and 0.0 <= record["routing_mismatch"] < 0.05
