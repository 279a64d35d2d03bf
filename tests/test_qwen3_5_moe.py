"""Qwen3.5-MoE's decoder (models/qwen3_5.py with `llama.moe_mlp` and a shared expert): parity with transformers on
the fixture tools/make_qwen3_5_moe_reference.py wrote, export, and branch replay exact against naive rows through
the linear layers' recurrent state and the experts, with the router's gradient, the load-balancing loss and
routing replay."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import max_rel_err, random_group
from families import (SMOLLM2_VOCAB, arrays_of, export_round_trip, fsdp_step_equals_naive, greedy_reproduces,
                      grpo_on_exported, objective, reference_error, sampler_routes,
                      tree_and_rows)
from flax import nnx

from branch_replay_jax.data.trees import tree_from_trajectories
from branch_replay_jax.gradients.heads import Policy
from branch_replay_jax.gradients.step import value_and_grad
from branch_replay_jax.models.config import GatedDeltaNetShape, tiny_config
from branch_replay_jax.models.qwen3_5 import Qwen35

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "qwen3_5_moe_tiny")


def run(head, graphdef, params, batch, **kw):
  """(loss, aux, grads) of `objective` through `head`, jitted."""
  return jax.jit(lambda p, b: value_and_grad(head, graphdef, p, b, objective, **kw))(params, batch)


def test_config_reads_the_experts_and_the_shared_expert(model):
  c = model.config
  assert c.arch == "qwen3_5_moe_text" and c.moe and c.hybrid and c.shared_expert and isinstance(model, Qwen35)
  # ffn_dim is the shared expert's width (shared_expert_intermediate_size); the routed experts' is expert_ffn_dim.
  assert (c.num_experts, c.experts_per_token, c.expert_ffn_dim, c.ffn_dim, c.norm_topk_prob) == (8, 2, 24, 40, True)
  assert c.layer_types == ("linear_attention", "linear_attention", "full_attention") * 2


def test_logprobs_match_transformers_float32(model, reference):
  # Same weights through transformers' Qwen3_5MoeForCausalLM (eager, its torch chunked rule, float32) and our
  # decoder at chunk 64 and 5. Bound 5e-5: on the 150-token input our own float32 forward differs from our float64
  # one by 2.0e-5 (measured), so the float32 reference carries that much rounding (measured against it:
  # 4.5e-6 on 23 tokens, 1.9e-5 on 150; our float64 forward 1.6e-5 from it).
  for chunk in (64, 5):
    model.chunk = chunk
    for item in reference["inputs"]:
      assert reference_error(model, item) <= 5e-5, (chunk, len(item["input_ids"]))
  model.chunk = 64


def test_greedy_sampling_reproduces_transformers(model, reference):
  # 16 argmax steps of transformers' full forwards against our sampler at temperature 0 (the recurrent state and
  # the full layers' K/V carried token by token, each token routed through its experts). Smallest top-1/top-2
  # gap 0.047.
  greedy_reproduces(model, reference, min_gap=1e-2)


def test_export_round_trip_gives_the_same_tensors_as_transformers_wrote(model, tmp_path):
  export_round_trip(model, FIXTURE, tmp_path)


def test_group_replay_with_routing_replay_and_the_load_balancing_loss_equals_naive_float64(model64, x64):
  # A 12-token prompt shared by 4 completions, the sampler's routes replayed (30% of the (layer, token) pairs
  # recorded with another expert, 20% of the completions' tokens unrecorded) with router_aux_coef = 0.5: replay
  # hands each completion the prompt's recurrent state, runs the prompt's routes once and sums the completions'
  # cotangents; each trajectory's load-balancing loss counts the prompt's routing. Loss, every gradient (the
  # router's, the experts', the shared expert's and its gate's) and the logged routing mismatch equal naive
  # rows', unfused (one completion per step) and fused.
  graphdef, params = model64
  arrays = arrays_of(random_group([3, 6, 9, 2], prompt_len=12, seed=4, vocab=96), np.float64)
  prompt_routes, routes, flipped, _ = sampler_routes(graphdef, params, arrays, np.random.default_rng(0), flip=0.3,
                                                     unrecorded=0.2)
  assert flipped.any()
  batch = arrays.replace(prompt_routes=prompt_routes, levels=(arrays.branches.replace(routes=routes),))
  head = Policy(router_aux_coef=0.5, routing_replay=True)
  ln, an, gn = run(head, graphdef, params, batch, layout="naive")
  for kw in ({"micro_batch": 1, "fused": False}, {}):
    lr, ar, gr = run(head, graphdef, params, batch, **kw)
    assert abs(float(lr) - float(ln)) <= 1e-12 * max(1.0, abs(float(ln))), kw
    assert max_rel_err(gr, gn) <= 1e-10, kw
    assert abs(float(ar["routing_mismatch"].sum()) - float(an["routing_mismatch"].sum())) <= 1e-12, kw
  assert float(an["routing_mismatch"].sum()) > 0   # the flipped pairs are counted
  for name in ("w_router", "ws_scale", "ws_gate", "w_gate"):   # each part of the MLP learns
    assert float(jnp.abs(gn["layers"][name][...]).max()) > 1e-6, name


# heavy (36 s in CI under load at stop 63): CI covers its pieces: Qwen3.5-MoE's segments on their ancestors'
# states with routing sums (the unfused group case of
# test_group_replay_with_routing_replay_and_the_load_balancing_loss_equals_naive_float64 runs the same `_segment`),
# a tree's nodes with the load-balancing loss (tests/test_moe.py::
# test_tree_replay_with_the_load_balancing_loss_equals_naive_float64) and Qwen3.5's trees (tests/test_qwen3_5.py::
# test_tree_replay_equals_naive_float64_each_node_from_its_parents_state).
@pytest.mark.heavy
def test_tree_replay_with_the_load_balancing_loss_equals_naive_float64(model64, x64):
  # Depth 2 (prompt 5, nodes of 2-4 then 1-3 tokens: shorter than the convolution window), the level schedule,
  # router_aux_coef = 0.5: each node hands its children its recurrent state and its path's routing sums.
  graphdef, params = model64
  rng = np.random.default_rng(7)
  seg = lambda first, n: [first] + list(rng.integers(3, 96, n - 1))
  one = {a: seg(10 + a, 2 + 2 * a) for a in range(2)}
  trajectories = [one[a] + seg(20 + b, 1 + 2 * b) for a in range(2) for b in range(2)]
  nodes, rows, _ = tree_and_rows(tree_from_trajectories(list(rng.integers(3, 96, 5)), trajectories), rng,
                                 end_share=True)
  head = Policy(router_aux_coef=0.5)
  ln, _, gn = run(head, graphdef, params, rows, layout="naive")
  lt, _, gt = run(head, graphdef, params, nodes, schedule="level")
  assert abs(float(lt) - float(ln)) <= 1e-12 * max(1.0, abs(float(ln)))
  assert max_rel_err(gt, gn) <= 1e-10


# heavy (36 s in CI at stop 63): CI covers its pieces: the dispatch's exactness on the mesh
# (tests/test_moe.py::test_mesh_step_with_routing_replay_equals_naive_float64[branch-replicated-2]) and Qwen3.5-MoE's
# layer scan handing the expert axis to it in a mesh step
# (test_grpo_trains_a_qwen3_5_moe_directory_on_a_mesh_with_its_experts_split).
@pytest.mark.heavy
def test_expert_parallel_fsdp_mesh_step_equals_naive_float64(model64):
  # Two groups over data x branch = 2 x 2, FSDP, the 8 experts split over branch (the shared expert and the linear
  # layers FSDP-gathered): the hybrid layers' scan hands the expert axis to `moe_mlp` as Llama's does.
  graphdef, params = model64
  with jax.enable_x64(True):
    groups = [arrays_of(random_group([2, 5, 9, 4], prompt_len=6 + 3 * s, seed=s, vocab=96), np.float64, seed=s)
              for s in range(2)]
    fsdp_step_equals_naive(graphdef, params, groups, head=Policy(router_aux_coef=0.5), expert="branch")


def test_grpo_trains_a_qwen3_5_moe_directory_on_a_mesh_with_its_experts_split(tmp_path, monkeypatch):
  # A random Qwen3.5-MoE over SmolLM2's tokenizer, exported as a Hugging Face directory and trained one GRPO smoke
  # step on a 2 x 4 x 1 mesh (FSDP, its 4 experts split over branch: one per device) with routing replay and the
  # load-balancing loss: the sampler records each token's experts through the hybrid cache, the mesh step
  # replays them with the tokens sent to their experts, and the run-time exactness check (one device: replay
  # against naive rows, both replaying the routes) holds to float32 rounding. One device's fused step:
  # test_group_replay_with_routing_replay_and_the_load_balancing_loss_equals_naive_float64.
  la = GatedDeltaNetShape(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=8, conv_kernel=4)
  cfg = tiny_config(vocab_size=SMOLLM2_VOCAB, arch="qwen3_5_moe_text", num_layers=2, qk_norm=True,
                    layer_types=("linear_attention", "full_attention"), linear_attention=la, rotary_dim=4,
                    num_experts=4, experts_per_token=2, expert_ffn_dim=16, norm_topk_prob=True, max_positions=2048,
                    tie_embeddings=False)
  record = grpo_on_exported(Qwen35(cfg, rngs=nnx.Rngs(0)), tmp_path, monkeypatch, **{
      "mesh.data": 2, "mesh.branch": 4, "mesh.params": "fsdp", "mesh.expert": "branch", "train.micro_batch": 1,
      "loss.router_aux_coef": 0.01, "model.routing_replay": True})
  assert record["exactness_ok"] is True and 0 < record["exactness_grad_rel_err"] <= 1e-4
  assert np.isfinite(record["loss"]) and record["grad_norm"] > 0 and 1.0 < record["router_aux"] < 4.0
  assert 0.0 <= record["routing_mismatch"] < 0.05
