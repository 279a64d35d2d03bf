"""Qwen3-MoE's decoder (models/llama.py `moe_mlp`): parity with transformers on the fixture
tools/make_qwen3_moe_reference.py wrote, the experts as grouped matmuls against a dense reference, and branch
replay exact against naive rows with the router's gradient included."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import max_rel_err, random_group
from families import (SMOLLM2_VOCAB, arrays_of, export_round_trip, fsdp_step_equals_naive, greedy_reproduces,
                      grpo_on_exported, objective, reference_error, refused_before_loading,
                      sampler_routes, step, tree_and_rows)
from flax import nnx

from branch_replay_jax import losses as obj
from branch_replay_jax.data.batches import trajectory_group_arrays, tree_arrays
from branch_replay_jax.data.trees import pad_tree, tree_from_trajectories
from branch_replay_jax.models import Llama
from branch_replay_jax.models.config import tiny_config
from branch_replay_jax.models.llama import moe_mlp
from branch_replay_jax.models.loading import build_model
from branch_replay_jax.rollout.sampler import sample_group

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "qwen3_moe_tiny")


def test_config_reads_the_experts(model):
  c = model.config
  assert c.arch == "qwen3_moe" and c.qk_norm and not c.tie_embeddings
  assert (c.num_experts, c.experts_per_token, c.expert_ffn_dim, c.norm_topk_prob) == (8, 2, 24, True)


def test_logprobs_match_transformers_float32(model, reference):
  # Same weights through transformers' Qwen3MoeForCausalLM (eager, float32) and our decoder: within 1e-5
  # (the fixture is rounded to 1e-6; measured 1.3e-6).
  for item in reference["inputs"]:
    assert reference_error(model, item) <= 1e-5


def test_greedy_sampling_reproduces_transformers(model, reference):
  # 16 argmax steps of transformers' full forwards against our sampler at temperature 0 (the prompt's bucket,
  # the K/V cache, one token at a time through the router). Smallest top-1/top-2 gap 0.028.
  greedy_reproduces(model, reference, min_gap=1e-2)


def test_grouped_experts_equal_every_expert_on_every_token_float64(model, x64):
  # The grouped matmuls against the definition: every expert run on every token, weighted by the token's
  # renormalised top-2 probabilities (zero for the other experts). Also: the tokens spread over the experts.
  c = model.config
  p = jax.tree_util.tree_map(lambda a: jnp.asarray(a[0], jnp.float64),
                             nnx.to_pure_dict(nnx.state(model.layers, nnx.Param)))
  h = jnp.asarray(np.random.default_rng(0).normal(size=(2, 9, c.d_model)))
  probs = jax.nn.softmax(h @ p["w_router"], axis=-1)
  top, idx = jax.lax.top_k(probs, c.experts_per_token)
  dense_w = jnp.zeros_like(probs).at[jnp.arange(2)[:, None, None], jnp.arange(9)[None, :, None], idx].set(
      top / top.sum(-1, keepdims=True))
  experts = jnp.einsum("btef,efd->bted", jax.nn.silu(jnp.einsum("btd,edf->btef", h, p["w_gate"]))
                       * jnp.einsum("btd,edf->btef", h, p["w_up"]), p["w_down"])
  want = jnp.einsum("bted,bte->btd", experts, dense_w)
  assert float(jnp.abs(moe_mlp(c, p, h)[0] - want).max()) <= 1e-12
  assert len(set(np.asarray(idx).ravel().tolist())) >= 6


def test_export_round_trip_gives_the_same_tensors_as_transformers_wrote(model, tmp_path):
  export_round_trip(model, FIXTURE, tmp_path)


def test_group_replay_equals_naive_float64_with_the_routers_gradient(model64, x64):
  # The prompt's tokens are routed once in replay and once per row in naive; the routing is a function of the
  # hidden state, so both pick the same experts (no near-tie at float64 rounding with these random weights) and
  # the gradients, the router's included, agree to float64 rounding.
  graphdef, params = model64
  arrays = arrays_of(random_group([3, 6, 9, 2], prompt_len=7, seed=4, vocab=96), np.float64)
  ln, _, gn = step(graphdef, params, arrays, objective, layout="naive")
  lr, _, gr = step(graphdef, params, arrays, objective, micro_batch=1, fused=False)
  assert abs(float(lr) - float(ln)) <= 1e-12 * max(1.0, abs(float(ln)))
  assert max_rel_err(gr, gn) <= 1e-10
  assert float(jnp.abs(gn["layers"]["w_router"][...]).max()) > 1e-6   # the router learns through its weights


def test_tree_replay_equals_naive_float64(model64, x64):
  # Depth 2 (prompt 5, nodes of 2-4 then 1-3 tokens), the level schedule: every node routed once.
  graphdef, params = model64
  rng = np.random.default_rng(7)
  seg = lambda first, n: [first] + list(rng.integers(3, 96, n - 1))
  one = {a: seg(10 + a, 2 + 2 * a) for a in range(2)}
  trajectories = [one[a] + seg(20 + b, 1 + 2 * b) for a in range(2) for b in range(2)]
  nodes, rows, _ = tree_and_rows(tree_from_trajectories(list(rng.integers(3, 96, 5)), trajectories), rng)
  ln, _, gn = step(graphdef, params, rows, objective, layout="naive")
  lt, _, gt = step(graphdef, params, nodes, objective, schedule="level", micro_batch=None)
  assert abs(float(lt) - float(ln)) <= 1e-12 * max(1.0, abs(float(ln)))
  assert max_rel_err(gt, gn) <= 1e-10


def test_moe_fields_are_checked_by_name():
  with pytest.raises(ValueError, match=r"num_experts is a mixture of experts' \(arch='qwen3_moe', "
                                       r"'qwen3_5_moe_text', or 'gemma4_text' with num_experts\); arch='llama' has "
                                       r"none"):
    tiny_config(num_experts=4)
  with pytest.raises(ValueError, match="experts_per_token=5 exceeds num_experts=4"):
    tiny_config(arch="qwen3_moe", num_experts=4, experts_per_token=5, expert_ffn_dim=8, qk_norm=True)
  with pytest.raises(ValueError, match="expert_ffn_dim must be a positive int"):
    tiny_config(arch="qwen3_moe", num_experts=4, experts_per_token=2, qk_norm=True)


# heavy (16 s; 36 s in CI at stop 61): CI covers its pieces with cheaper tests: LoRA with routing replay against
# naive rows (test_lora_replays_as_naive_rows_with_routing_replay_float64[attention]), the loop's routing
# replay and routing_mismatch (test_grpo_trains_moe_episodes_with_routing_replay), the load-balancing loss
# (test_group_replay_with_the_load_balancing_loss_equals_naive_float64) and the tiled experts
# (test_tiled_expert_matmuls_equal_ragged_dot_and_replay_stays_exact_float64[tiled]).
@pytest.mark.heavy
def test_grpo_trains_lora_adapters_of_a_moe_directory_with_routing_replay_and_the_load_balancing_loss(
    tmp_path, monkeypatch):
  # A random Qwen3-MoE (2 layers, 4 experts, 2 per token) over SmolLM2's tokenizer, exported as a Hugging Face
  # directory and trained by the GRPO LoRA smoke experiment (its default targets: adapters on the attention and
  # on each expert; the router frozen; the fused replay: a group's 4 completions in one step) with
  # loss.router_aux_coef = 0.01 and
  # model.routing_replay: the sampler records each token's experts, the update runs them. The run-time exactness
  # check (replay's adapter gradient against naive rows', both replaying the routes, the load-balancing loss in
  # both) to float32 rounding; the logged router_aux is the mean over the step's groups of
  # their trajectories' mean loss: between 1 and E = 4 for top-2 routing (2 where uniform); routing_mismatch, the
  # share of recorded (layer, token) pairs the trainer's router would route otherwise: the sampler and the trainer
  # run the same float32 model here, so few if any (below 5%). The experts run in tiles (model.expert_matmul =
  # "tiled", kernels.grouped_matmul): sampler, update and check alike.
  cfg = tiny_config(vocab_size=SMOLLM2_VOCAB, arch="qwen3_moe", qk_norm=True, num_experts=4, experts_per_token=2,
                    expert_ffn_dim=16, max_positions=2048, tie_embeddings=False)
  record = grpo_on_exported(Llama(cfg, rngs=nnx.Rngs(0)), tmp_path, monkeypatch, variant="lora_smoke",
                            **{"train.micro_batch": 4, "loss.router_aux_coef": 0.01, "model.routing_replay": True,
                               "model.expert_matmul": "tiled"})
  assert record["exactness_ok"] is True and 0 < record["exactness_grad_rel_err"] <= 1e-4
  assert np.isfinite(record["loss"]) and record["grad_norm"] > 0 and record["reward_std"] > 0
  assert 1.0 < record["router_aux"] < 4.0 and 0.0 <= record["routing_mismatch"] < 0.05


# heavy (16 s; 31 s in CI at stop 61): CI covers its pieces: the tree sampler's routes
# (test_the_tree_sampler_records_each_nodes_routes_the_trainer_computes_float64), the tree step replaying them
# (test_tree_routing_replay_equals_naive_float64_and_logs_the_mismatch) and the loop handing a depth-first
# tree step its samplers' routes (test_grpo_trains_moe_episodes_with_routing_replay).
@pytest.mark.heavy
def test_grpo_trains_a_moe_tree_with_routing_replay(tmp_path, monkeypatch):
  # The tree smoke experiment's trees (fan-outs 2, 2, segments of 4) on a random Qwen3-MoE directory with model.routing_replay: the
  # tree sampler records each node's experts once, the tree step (depth-first, the default) replays them, and the
  # run-time exactness check compares it with the naive rows replaying each path's routes, to float32 rounding.
  # Sampler and trainer run the same float32 model, so few if any recorded pairs are routed otherwise (< 5%).
  cfg = tiny_config(vocab_size=SMOLLM2_VOCAB, arch="qwen3_moe", qk_norm=True, num_experts=4, experts_per_token=2,
                    expert_ffn_dim=16, max_positions=2048, tie_embeddings=False)
  from experiments import grpo_tree_smollm2_arith
  record = grpo_on_exported(Llama(cfg, rngs=nnx.Rngs(1)), tmp_path, monkeypatch, grpo_tree_smollm2_arith,
                            **{"model.routing_replay": True})
  assert record["exactness_ok"] is True and 0 < record["exactness_grad_rel_err"] <= 1e-4
  assert np.isfinite(record["loss"]) and record["grad_norm"] > 0
  assert 0.0 <= record["routing_mismatch"] < 0.05


@pytest.mark.parametrize("variant,overrides,message", [
    ("smoke", {"loss.router_aux_coef": 0.01, "train.tree_schedule": "packed", "rollout.tree_fanouts": (2, 2)},
     "train.tree_schedule='packed': the load-balancing loss is built for trees by level"),
    ("smoke", {"model.routing_replay": True, "train.tree_schedule": "packed", "rollout.tree_fanouts": (2, 2)},
     "train.tree_schedule='packed': routing replay is built for trees by level"),
])
def test_a_moe_model_refuses_what_it_does_not_take_before_loading(tmp_path, variant, overrides, message):
  refused_before_loading(tmp_path, FIXTURE, variant, overrides, f"is a mixture of experts: {message}")
  # Where nothing is packed (groups; trees under the naive gradient) the schedule is inert and not refused.
  from conftest import experiment_config
  from experiments import grpo_smollm2_arith, grpo_tree_smollm2_arith
  from branch_replay_jax.algorithms import grpo
  moe = {k: v for k, v in overrides.items() if k != "rollout.tree_fanouts"}
  grpo.validate(experiment_config(grpo_smollm2_arith, variant, tmp_path / "groups", **{"model.name": FIXTURE, **moe}))
  grpo.validate(experiment_config(grpo_tree_smollm2_arith, variant, tmp_path / "naive", **{
      "model.name": FIXTURE, **moe, "train.gradient": "naive"}))


def test_lora_on_a_moe_models_experts_passes_the_checks(tmp_path):
  # The LoRA smoke experiment adapts every projection by default: on a mixture of experts the MLP targets are its
  # experts (one adapter pair per expert), which the checks accept; a rank above one expert's width is refused.
  from conftest import experiment_config
  from experiments import grpo_smollm2_arith
  from branch_replay_jax.algorithms import grpo
  grpo.validate(experiment_config(grpo_smollm2_arith, "lora_smoke", tmp_path / "run", **{"model.name": FIXTURE}))
  refused_before_loading(tmp_path, FIXTURE, "lora_smoke", {"lora.rank": 25},
                         r"lora.rank=25 is larger than projection w_gate's dimensions \(fan-in 48, fan-out 24\)")


def test_the_pallas_expert_matmul_is_refused_on_a_mesh(tmp_path):
  # The Pallas grouped matmul runs on one device (inside the mesh step's shard_map its outputs state no varying
  # mesh axes): refused by name before loading, and by the memory model, which compiles the mesh step.
  from branch_replay_jax.benchmarks import sharded_memory
  refused_before_loading(tmp_path, FIXTURE, "smoke", {"model.expert_matmul": "pallas", "mesh.data": 2,
                                                      "mesh.branch": 2, "mesh.seq": 2},
                         r"model.expert_matmul='pallas' on a mesh of 2 x 2 x 2: .* use 'tiled'")
  with pytest.raises(ValueError, match="config.expert_matmul='pallas': the Pallas grouped matmul runs on one device"):
    sharded_memory._architecture("tiny", "pallas")


# heavy (42 s in CI under load at stop 63): CI covers its pieces: the mesh step with the experts split, exact
# (test_mesh_step_with_routing_replay_equals_naive_float64[branch-replicated-2]), and the loop
# placing the experts by mesh.expert and training on that mesh
# (tests/test_qwen3_5_moe.py::test_grpo_trains_a_qwen3_5_moe_directory_on_a_mesh_with_its_experts_split).
@pytest.mark.heavy
def test_grpo_trains_a_moe_with_its_experts_split_over_branch(tmp_path, monkeypatch):
  # The smoke experiment on a 2 x 2 x 2 mesh, FSDP, its 4 experts split over branch (2 per device) with the
  # load-balancing loss: the loop places the experts by mesh.expert, the step sends the tokens to them, and the
  # run-time exactness check (one device: replay against naive rows) holds to float32 rounding. The update's own
  # exactness on the mesh: test_mesh_step_with_routing_replay_equals_naive_float64.
  cfg = tiny_config(vocab_size=SMOLLM2_VOCAB, arch="qwen3_moe", qk_norm=True, num_experts=4, experts_per_token=2,
                    expert_ffn_dim=16, max_positions=2048, tie_embeddings=False)
  record = grpo_on_exported(Llama(cfg, rngs=nnx.Rngs(2)), tmp_path, monkeypatch, **{
      "mesh.data": 2, "mesh.branch": 2, "mesh.seq": 2, "mesh.params": "fsdp", "mesh.expert": "branch",
      "train.micro_batch": 1, "loss.router_aux_coef": 0.01})
  assert record["exactness_ok"] is True and 0 < record["exactness_grad_rel_err"] <= 1e-4
  assert np.isfinite(record["loss"]) and record["grad_norm"] > 0 and 1.0 < record["router_aux"] < 4.0


def test_the_expert_axis_is_checked_by_name_before_loading(tmp_path):
  # mesh.expert names the axis the experts are split over: data or branch (seq holds one prompt's chunks), and
  # only for a model with experts. Each refused by name before the model loads.
  from conftest import experiment_config
  from experiments import grpo_smollm2_arith
  from branch_replay_jax.algorithms import grpo
  mesh = {"mesh.data": 2, "mesh.branch": 2, "mesh.seq": 2}
  refused_before_loading(tmp_path, FIXTURE, "smoke", {**mesh, "mesh.expert": "seq"},
                         r"mesh.expert='seq' is not one of \('data', 'branch'\)")
  with pytest.raises(ValueError, match=r"mesh.expert='data': model.name='tiny' has no experts"):
    grpo.validate(experiment_config(grpo_smollm2_arith, "smoke", tmp_path / "tiny", **mesh, **{"mesh.expert": "data"}))
  grpo.validate(experiment_config(grpo_smollm2_arith, "smoke", tmp_path / "ok", **mesh, **{
      "model.name": FIXTURE, "mesh.expert": "branch", "mesh.params": "fsdp"}))
  # An axis of size 1 would leave every device all the experts: refused rather than accepted and ignored.
  refused_before_loading(tmp_path, FIXTURE, "smoke", {"mesh.data": 2, "mesh.branch": 1, "mesh.seq": 1,
                                                      "mesh.expert": "branch"},
                         r"mesh.expert='branch': mesh.branch=1 splits nothing")
  # DPO on pairs from a file (no rollout section) gets the same model checks as every algorithm: the fixture's
  # 8 experts do not split over 3 devices, and the Pallas grouped matmul takes no mesh.
  from branch_replay_jax.algorithms import dpo
  from experiments import dpo_smollm2_arith
  for overrides, match in [({"mesh.data": 1, "mesh.branch": 3, "mesh.seq": 1, "mesh.expert": "branch"},
                            r"mesh.expert='branch': mesh.branch=3 must divide the model's 8 experts"),
                           ({**mesh, "model.expert_matmul": "pallas"}, r"model.expert_matmul='pallas' on a mesh")]:
    with pytest.raises(ValueError, match=match):
      dpo.validate(experiment_config(dpo_smollm2_arith, "jsonl_smoke", tmp_path / "dpo", **{"model.name": FIXTURE,
                                                                                           **overrides}))


def test_a_directory_without_its_expert_counts_is_refused_naming_the_key(tmp_path):
  # The fixture's config.json without num_experts_per_tok, or with a fractional expert count: a ValueError naming
  # the file and the key (not a KeyError, nor 8.7 experts read as 8).
  import json
  import shutil

  from branch_replay_jax.models.hf_loader import read_config
  for key, value, match in [("num_experts_per_tok", None, "no num_experts_per_tok"),
                            ("num_experts", 8.7, "num_experts=8.7 must be an int")]:
    directory = tmp_path / key
    shutil.copytree(FIXTURE, directory)
    with open(directory / "config.json") as f:
      cfg = json.load(f)
    if value is None:
      del cfg[key]
    else:
      cfg[key] = value
    with open(directory / "config.json", "w") as f:
      json.dump(cfg, f)
    with pytest.raises(ValueError, match=rf"config.json: {match}"):
      read_config(str(directory))


def test_a_moe_model_takes_the_prompt_split_over_seq(tmp_path):
  # The seq split is exact with experts (test_mesh_step_with_routing_replay_equals_naive_float64[-fsdp-2]), so
  # a MoE experiment on a data x branch x seq mesh with the load-balancing loss and routing replay passes the
  # model checks (it was refused before the split carried the routes).
  from conftest import experiment_config
  from experiments import grpo_smollm2_arith
  config = experiment_config(grpo_smollm2_arith, "smoke", tmp_path / "run", **{
      "model.name": FIXTURE, "mesh.data": 2, "mesh.branch": 2, "mesh.seq": 2, "loss.router_aux_coef": 0.01, "model.routing_replay": True})
  from branch_replay_jax.algorithms import grpo
  grpo.validate(config)


def test_fsdp_mesh_step_equals_naive_float64(model64):
  # Two groups over data x branch = 2 x 2 with FSDP parameters (the router and the experts split and gathered
  # layer by layer like every weight; no expert axis): the summed gradient equals the two naive groups'.
  with jax.enable_x64(True):
    groups = [arrays_of(random_group([2, 5, 9, 4], prompt_len=6 + 3 * s, seed=s, vocab=96), np.float64, seed=s)
              for s in range(2)]
    fsdp_step_equals_naive(*model64, groups)


@pytest.mark.parametrize("expert, mode, seq", [
    ("", "fsdp", 2),
    # heavy (~20 s): the same dispatch over another axis is CI's [branch-replicated-2], FSDP with experts its [-fsdp-2]
    pytest.param("data", "fsdp", 1, marks=pytest.mark.heavy),
    ("branch", "replicated", 2)])
def test_mesh_step_with_routing_replay_equals_naive_float64(model64, expert, mode, seq, monkeypatch):
  # Two groups over data x branch (x seq = 2: the prompt and its routes, padded to the stacked P_pad with -1,
  # split over seq, each chunk's routing sums added over seq; a wrong or missing sum moves the auxiliary loss),
  # each with recorded routes (30% of the pairs otherwise than the router would choose, 20% of the completion
  # tokens unrecorded), replayed with the load-balancing loss. With mesh.expert the fixture's 8 experts are split
  # over that axis (4 per device), the tokens sent to them by all-gather and their partial sums reduce-scattered
  # back (models.llama._dispatched_expert_sum): over data, the two groups' tokens meet on each device; over
  # branch, a group's completions do, while the prompt, the same on every branch device, is not sent: each
  # device runs its experts on its own copy and the partial sums are all-reduced (`llama.replicated_over`; its
  # cotangent was averaged over branch, the psum's transpose sums it back). The loss and summed gradient equal
  # the naive groups' (a missing or doubled sum of the experts' gradients over the expert axis, or of the
  # router's, would move them); over branch the trace shows the prompt's layers took the replicated dispatch and
  # the completions' the gathered one.
  from branch_replay_jax.gradients.heads import Policy
  from branch_replay_jax.models import llama
  dispatched, real = [], llama._dispatched_expert_sum
  def recording(config, p, x, *args, **kwargs):
    dispatched.append(llama._REPLICATED_OVER.get())
    return real(config, p, x, *args, **kwargs)
  monkeypatch.setattr(llama, "_dispatched_expert_sum", recording)
  graphdef, params = model64
  with jax.enable_x64(True):
    groups = []
    for s in range(2):
      arrays = arrays_of(random_group([2, 5, 9, 4], prompt_len=6 + 3 * s, seed=s, vocab=96), np.float64, seed=s)
      prompt_routes, routes, _, _ = sampler_routes(graphdef, params, arrays, np.random.default_rng(s), flip=0.3,
                                                     unrecorded=0.2)
      groups.append(arrays.replace(prompt_routes=prompt_routes, levels=(arrays.branches.replace(routes=routes),)))
    fsdp_step_equals_naive(graphdef, params, groups, head=Policy(router_aux_coef=0.5, routing_replay=True), seq=seq,
                           mode=mode, expert=expert)
  assert set(dispatched) == ({("branch",), ()} if expert else set())


def _transformers_load_balancing_loss(logits_lte, top_k, mask_t):
  # transformers' `load_balancing_loss_func` (modeling_qwen3_moe) transcribed in numpy for one sequence: every
  # layer's router logits concatenated, top-k one-hot [N, k, E], means over the attention mask's tokens.
  num_layers, _, e = logits_lte.shape
  logits = logits_lte.reshape(-1, e)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  selected = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
  expert_mask = np.eye(e)[selected]                                                  # [N, k, E]
  m = np.tile(mask_t, num_layers).astype(float)
  tokens_per_expert = (expert_mask * m[:, None, None]).sum(0) / m.sum()              # [k, E]
  router_prob_per_expert = (probs * m[:, None]).sum(0) / m.sum()                     # [E]
  return float(np.sum(tokens_per_expert * router_prob_per_expert[None])) * e


def test_load_balancing_loss_equals_transformers_formula():
  # Three layers' logits over 7 tokens, two of them padding, 6 experts, top 2: our sums-based formula against
  # transformers' means over [N, k, E] one-hots; and 2 (= k) for uniform routing, where f_e = k/E, P_e = 1/E.
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 7, 6)) * 2.0
  mask = np.array([1, 1, 1, 1, 1, 0, 0], bool)
  probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  top = np.argsort(-probs, axis=-1, kind="stable")[..., :2]
  counts = (np.eye(6)[top].sum(-2) * mask[None, :, None]).sum((0, 1))
  sums = (probs * mask[None, :, None]).sum((0, 1))
  got = float(obj.load_balancing_loss(jnp.asarray(counts), jnp.asarray(sums), jnp.asarray(3 * 5)))
  assert abs(got - _transformers_load_balancing_loss(logits, 2, mask)) <= 1e-6
  uniform = obj.load_balancing_loss(jnp.full((6,), 2 * 30 / 6), jnp.full((6,), 30 / 6), jnp.asarray(30))
  assert abs(float(uniform) - 2.0) <= 1e-6


def test_group_replay_with_the_load_balancing_loss_equals_naive_float64(model64, x64):
  # router_aux_coef = 0.5: the group's loss gains 0.5 · the mean over its 4 trajectories of their load-balancing
  # loss (prompt and completion, every layer). In naive rows each row routes its copy of the prompt; in replay the
  # prompt is routed once and its router-probability sums take a cotangent from every completion. The unfused
  # replay (a completion per micro-batch) and the fused one equal naive rows to float64 rounding, and the added
  # loss equals the rows' own load-balancing losses, each computed from one full-sequence forward.
  from branch_replay_jax.gradients.heads import Policy
  from branch_replay_jax.gradients.step import naive_batch, value_and_grad
  graphdef, params = model64
  arrays = arrays_of(random_group([3, 6, 9, 2], prompt_len=7, seed=4, vocab=96), np.float64)
  head = Policy(router_aux_coef=0.5)
  run = jax.jit(lambda p, b, layout, m, fused: value_and_grad(head, graphdef, p, b, objective, layout=layout,
                                                                micro_batch=m, fused=fused), static_argnums=(2, 3, 4))
  ln, _, gn = run(params, arrays, "naive", None, None)
  l0, _, g0 = step(graphdef, params, arrays, objective, layout="naive")
  tokens, valid, offset = naive_batch(arrays)
  model = nnx.merge(graphdef, params)
  rows = model(tokens, offset, valid_bt=valid).router
  per_row = obj.load_balancing_loss(rows.counts, rows.probs, model.config.num_layers * valid.sum(1))
  assert abs(float(ln) - float(l0) - 0.5 * float(per_row.mean())) <= 1e-12
  assert 1.5 < float(per_row.min()) and float(per_row.max()) < 8.0   # k = 2 uniform, E = 8 the worst
  router = lambda g: g["layers"]["w_router"][...]
  assert float(jnp.abs(router(gn) - router(g0)).max()) > 1e-4       # the loss moves the router
  for m, fused in ((1, False), (None, True)):
    lr, _, gr = run(params, arrays, "replay", m, fused)
    assert abs(float(lr) - float(ln)) <= 1e-12 * max(1.0, abs(float(ln)))
    assert max_rel_err(gr, gn) <= 1e-10



def test_fsdp_mesh_step_with_the_load_balancing_loss_equals_naive_float64(model64):
  # The same two groups as the FSDP test above, router_aux_coef = 0.5: a group's 4 completions are split over
  # branch = 2, so each device holds 2 of them; the mean is over the group's 4 trajectories (not a device's 2),
  # and the prompt's router-probability cotangent is summed over branch with its K/V's.
  from branch_replay_jax.gradients.heads import Policy
  with jax.enable_x64(True):
    groups = [arrays_of(random_group([2, 5, 9, 4], prompt_len=6 + 3 * s, seed=s, vocab=96), np.float64, seed=s)
              for s in range(2)]
    fsdp_step_equals_naive(*model64, groups, head=Policy(router_aux_coef=0.5))


@pytest.mark.parametrize("schedule", ["depth_first", "level"])
def test_tree_replay_with_the_load_balancing_loss_equals_naive_float64(model64, x64, schedule):
  # Depth 2 with 5 trajectories: one ends inside the tree (at a level-1 node that two others continue) and two
  # are the same completion (one leaf ends both). Each node's path routing is its ancestors' plus its own; a node
  # weighs its path's loss by the share of trajectories ending at it (1/5, 2/5), so the tree's added loss is the
  # mean over the 5 naive rows' own, and its gradient reaches every ancestor's router-probability sums.
  from branch_replay_jax.gradients.heads import Policy
  from branch_replay_jax.gradients.step import value_and_grad
  graphdef, params = model64
  rng = np.random.default_rng(3)
  seg = lambda first, n: [first] + list(rng.integers(3, 96, n - 1))
  one = {a: seg(10 + a, 3 + 2 * a) for a in range(2)}
  tails = [seg(20 + b, 2 + 2 * b) for b in range(2)]
  trajectories = [one[0] + tails[0], one[0] + tails[1], one[0], one[1] + tails[0], one[1] + tails[0]]
  tree = tree_from_trajectories(list(rng.integers(3, 96, 6)), trajectories)
  assert sorted(np.bincount(tree.ends).tolist())[-1] == 2 and len(set(tree.ends)) == 4
  adv = rng.normal(size=len(trajectories))
  old = [(-4.5 + 0.3 * rng.normal(size=len(s))) for s in tree.segments]
  w = obj.trajectory_weights(tree.completion_lengths(), mode="sequence_mean", max_length=16)
  rows = trajectory_group_arrays(tree, {"old_logp": old, "ref_logp": old}, w, vocab_size=96, max_positions=128,
                                 completion_bucket=16, advantage=adv)
  per_node = {"weights": list(tree.node_weights(w)), "old_logp": old, "ref_logp": old, "end_share": tree.end_shares()}
  nodes = tree_arrays(pad_tree(tree), per_node, advantage=adv)
  head = Policy(router_aux_coef=0.5)
  run = jax.jit(lambda p, b, layout: value_and_grad(head, graphdef, p, b, objective, layout=layout,
                                                      schedule=schedule, micro_batch=1), static_argnums=2)
  ln, an, gn = run(params, rows, "naive")
  l0, _, g0 = step(graphdef, params, rows, objective, layout="naive")
  lt, at, gt = run(params, nodes, "replay")
  assert abs(float(ln) - float(l0)) > 0.1                              # the loss is there (k = 2: about 0.5 · 2)
  assert abs(float(lt) - float(ln)) <= 1e-12 * max(1.0, abs(float(ln)))
  assert max_rel_err(gt, gn) <= 1e-10
  # The logged metric (Σ router_aux: the trajectories' mean) is the naive rows' and the loss it added / 0.5.
  tree_metric, naive_metric = (float(obj.grpo_aux_sums(a)[2]["router_aux"]) for a in (at, an))
  assert abs(tree_metric - naive_metric) <= 1e-12 and abs(naive_metric - (float(ln) - float(l0)) / 0.5) <= 1e-12


def test_the_load_balancing_loss_is_refused_where_it_cannot_apply(tmp_path):
  # A dense model has no routers: refused by name before loading. A negative coefficient: refused by grpo.validate.
  refused_before_loading(tmp_path, "smollm2-135m-instruct", "smoke", {"loss.router_aux_coef": 0.01},
                         "loss.router_aux_coef=0.01: model.name=.* has no experts")
  for coef in (-1.0, float("inf")):   # an infinite coefficient made the first step's loss inf, then NaN parameters
    refused_before_loading(tmp_path, FIXTURE, "smoke", {"loss.router_aux_coef": coef},
                           rf"loss.router_aux_coef={coef} must be a finite number >= 0")
  refused_before_loading(tmp_path, "smollm2-135m-instruct", "smoke", {"model.routing_replay": True},
                         "model.routing_replay=True: model.name=.* has no experts")
  refused_before_loading(tmp_path, "smollm2-135m-instruct", "smoke", {"model.expert_matmul": "tiled"},
                         "model.expert_matmul='tiled': model.name=.* has no experts")
  refused_before_loading(tmp_path, FIXTURE, "smoke", {"model.expert_matmul": "dense"},
                         r"model.expert_matmul='dense' is not one of \('ragged_dot', 'tiled', 'pallas'\)")
  from conftest import experiment_config
  from experiments import grpo_smollm2_calc, ppo_smollm2_arith
  from branch_replay_jax.algorithms import grpo, ppo
  with pytest.raises(ValueError, match="model.routing_replay"):
    ppo.train(experiment_config(ppo_smollm2_arith, "smoke", tmp_path / "ppo", **{"model.name": FIXTURE,
                                                                                  "model.routing_replay": True}))
  with pytest.raises(ValueError, match="rollout.episodes.history='template': model.routing_replay replays the "
                                       "routes of the ids the sampler fed"):
    grpo.train(experiment_config(grpo_smollm2_calc, "smoke", tmp_path / "calc", **{
        "model.name": FIXTURE, "model.routing_replay": True, "rollout.episodes.history": "template",
        "train.tree_schedule": "depth_first"}))


@pytest.mark.parametrize("router_aux_coef", [
    0.0,
    # heavy (30 s): CI replays a group's routes with the load-balancing loss in
    # test_mesh_step_with_routing_replay_equals_naive_float64[-fsdp-2], a tree's in the ("level", 0.5) tree case.
    pytest.param(0.5, marks=pytest.mark.heavy)])
def test_routing_replay_equals_naive_float64_and_logs_the_mismatch(model64, x64, router_aux_coef):
  # The sampler's routes replayed: 30% of the (layer, token) pairs recorded with another expert (the prompt's
  # too: replay runs them once, naive rows once per row), 20% of the completion tokens unrecorded (they route
  # themselves). Replay (fused and one completion per micro-batch) equals naive rows to float64 rounding, with
  # and without the load-balancing loss; both log the same routing_mismatch, the mean over trajectories of
  # their flipped share of recorded pairs; and replaying differs from not replaying (the loss moves).
  group_routing_replay_equals_naive(*model64, router_aux_coef)


def group_routing_replay_equals_naive(graphdef, params, router_aux_coef: float) -> None:
  """The body of test_routing_replay_equals_naive_float64_and_logs_the_mismatch for a float64 model of 96 ids
  (tests/test_gemma4_moe.py runs it on Gemma 4's experts)."""
  from branch_replay_jax.gradients.heads import Policy
  from branch_replay_jax.gradients.step import value_and_grad
  arrays = arrays_of(random_group([3, 6, 9, 2], prompt_len=7, seed=4, vocab=96), np.float64)
  prompt_routes, routes, flipped, recorded = sampler_routes(graphdef, params, arrays, np.random.default_rng(0),
                                                              flip=0.3, unrecorded=0.2)
  batch = arrays.replace(prompt_routes=prompt_routes, levels=(arrays.branches.replace(routes=routes),))
  layers = nnx.merge(graphdef, params).config.num_layers
  want = np.mean(flipped.sum((1, 2)) / (layers * recorded.sum(1)))
  for replay in (True, False):
    head = Policy(router_aux_coef=router_aux_coef, routing_replay=replay)
    run = jax.jit(lambda p, b, layout, m, fused: value_and_grad(head, graphdef, p, b, objective, layout=layout,
                                                                  micro_batch=m, fused=fused), static_argnums=(2, 3, 4))
    ln, an, gn = run(params, batch, "naive", None, None)
    mismatch = float(an["routing_mismatch"].sum())
    if not replay:   # the router's own choice is the unreplayed forward's: the flipped share exactly (replaying
      assert abs(mismatch - want) <= 1e-12   # moves later tokens' hidden states, so their own choice may move too)
    for m, fused in ((1, False), (None, True)):
      lr, ar, gr = run(params, batch, "replay", m, fused)
      assert abs(float(lr) - float(ln)) <= 1e-12 * max(1.0, abs(float(ln)))
      assert max_rel_err(gr, gn) <= 1e-10
      assert abs(float(ar["routing_mismatch"].sum()) - mismatch) <= 1e-12
    if replay:
      replayed = (float(ln), gn)
  # Replaying other experts moves the loss (here by 1.3e-4, float64 rounding is 1e-16) and the gradient.
  assert abs(replayed[0] - float(ln)) > 1e-5 and max_rel_err(replayed[1], gn) > 1e-3


def test_routing_replay_of_the_routers_own_choice_changes_nothing_float64(model64, x64):
  # Routes equal to the router's own top 2 (nothing flipped, nothing unrecorded): replaying them gives the loss
  # and the gradient of not replaying, to float64 rounding: the gating weights are the current router's
  # probabilities of the same experts, renormalised, and the router's gradient flows through them alike.
  from branch_replay_jax.gradients.heads import Policy
  from branch_replay_jax.gradients.step import value_and_grad
  graphdef, params = model64
  arrays = arrays_of(random_group([3, 6, 9, 2], prompt_len=7, seed=4, vocab=96), np.float64)
  prompt_routes, routes, _, _ = sampler_routes(graphdef, params, arrays, np.random.default_rng(0), flip=0.0,
                                                 unrecorded=0.0)
  batch = arrays.replace(prompt_routes=prompt_routes, levels=(arrays.branches.replace(routes=routes),))
  l0, _, g0 = step(graphdef, params, arrays, objective, micro_batch=1, fused=False)
  l1, a1, g1 = jax.jit(lambda p, b: value_and_grad(Policy(routing_replay=True), graphdef, p, b, objective,
                                                   micro_batch=1, fused=False))(params, batch)
  assert abs(float(l1) - float(l0)) <= 1e-12 and max_rel_err(g1, g0) <= 1e-10
  assert float(a1["routing_mismatch"].sum()) == 0.0


def test_the_sampler_records_the_routes_the_trainer_computes_float64(model64, x64):
  # sample_group's prefill records the prompt's experts once, each decode step the fed token's; in float64 they
  # are the experts the trainer's forward of the same sequences picks. A sample's last token may be drawn but never
  # fed (the budget's last, or a stop token drawn as the last sample ends): -1, none recorded, as every position
  # after a sample's end.
  sampler_records_the_trainers_routes(nnx.merge(*model64))


def sampler_records_the_trainers_routes(model) -> None:
  """The body of test_the_sampler_records_the_routes_the_trainer_computes_float64 for a float64 model of 96 ids
  (tests/test_gemma4_moe.py runs it on Gemma 4's experts)."""
  prompt = np.random.default_rng(1).integers(3, 96, 9)
  out = sample_group(model, prompt, num_samples=3, max_new_tokens=6, key=jax.random.key(2), temperature=1.0)
  c = model.config
  assert out.prompt_routes.shape == (9, c.num_layers, c.experts_per_token)
  assert out.routes.shape == (3, 6, c.num_layers, c.experts_per_token)
  for g in range(3):
    n = int(out.lengths[g])
    seq = np.concatenate([prompt, np.asarray(out.tokens[g, :n])])
    own = np.asarray(model(jnp.asarray(seq)[None], 0).experts[0])                 # [P + n, L, k]
    fed = int((np.asarray(out.routes[g, :, 0, 0]) >= 0).sum())                   # the tokens fed to the model
    assert fed >= n - 1 and (np.asarray(out.routes[g, :fed]) >= 0).all()
    np.testing.assert_array_equal(np.sort(out.prompt_routes, -1), np.sort(own[:9], -1))
    np.testing.assert_array_equal(np.sort(out.routes[g, :fed], -1), np.sort(own[9:9 + fed], -1))
    assert (np.asarray(out.routes[g, fed:]) == -1).all()


def _own_node_routes(model, tree) -> list:
  """Per node of `tree` [L_n, layers, k]: the experts the model's forward of the node's path picks for its tokens
  (node 0: the prompt's), sorted within k."""
  out = []
  for n in range(tree.num_nodes):
    seq = np.concatenate([np.asarray(tree.segments[m]) for m in tree.path(n)])
    own = np.sort(np.asarray(model(jnp.asarray(seq)[None], 0).experts[0]), -1)
    out.append(own[len(seq) - len(tree.segments[n]):])
  return out


def test_the_tree_sampler_records_each_nodes_routes_the_trainer_computes_float64(model64, x64):
  # sample_tree's prefill records the prompt's experts, each node's decode loop its fed tokens', and the extra
  # step that feeds an inner node's last token (before its children are drawn) that token's; in float64 they are
  # the experts the trainer's forward of the node's path picks. A leaf's last token is drawn, never fed: -1.
  from branch_replay_jax.rollout.tree_sampler import sample_tree
  graphdef, params = model64
  model = nnx.merge(graphdef, params)
  prompt = np.random.default_rng(5).integers(3, 96, 7)
  out = sample_tree(model, prompt, fanouts=[2, 2], segment_length=3, key=jax.random.key(1), temperature=1.0)
  tree, c = out.tree, model.config
  assert len(out.routes) == tree.num_nodes == 7
  for n, (recorded, own) in enumerate(zip(out.routes, _own_node_routes(model, tree))):
    assert recorded.shape == (len(tree.segments[n]), c.num_layers, c.experts_per_token)
    leaf = not tree.children(n) and n > 0
    np.testing.assert_array_equal(np.sort(recorded[:len(recorded) - leaf], -1), own[:len(own) - leaf])
    if leaf:
      assert (recorded[-1] == -1).all()


def _tree_with_recorded_routes(model, rng, flip: float, unrecorded: float):
  """A depth-2 tree (5 trajectories: one ends at an inner node, two share one leaf) with per-node recorded
  routes: each node's own experts (`_own_node_routes`), a `flip` fraction of its (token, layer) pairs recorded
  with another expert and an `unrecorded` fraction of its completion tokens -1. Returns (tree, node routes,
  the mismatch the naive rows log without replaying: the mean over trajectories of their paths' flipped share of
  recorded (layer, token) pairs; replaying them changes later tokens' hidden states, so their own choice too)."""
  seg = lambda first, n: [first] + list(rng.integers(3, 96, n - 1))
  one = {a: seg(10 + a, 3 + 2 * a) for a in range(2)}
  tails = [seg(20 + b, 2 + 2 * b) for b in range(2)]
  trajectories = [one[0] + tails[0], one[0] + tails[1], one[0], one[1] + tails[0], one[1] + tails[0]]
  tree = tree_from_trajectories(list(rng.integers(3, 96, 6)), trajectories)
  e = model.config.num_experts
  routes, flipped, recorded = [], [], []
  for n, own in enumerate(_own_node_routes(model, tree)):
    r = own.copy()
    f = rng.random(own.shape[:2]) < flip
    for t, layer in zip(*np.nonzero(f)):
      r[t, layer] = [own[t, layer, 0], min(x for x in range(e) if x not in own[t, layer])]
    skip = (rng.random(own.shape[0]) < unrecorded) if n else np.zeros(own.shape[0], bool)
    r[skip] = -1
    routes.append(r)
    flipped.append((f & ~skip[:, None]).sum())
    recorded.append((~skip).sum())
  layers = model.config.num_layers
  want = np.mean([sum(flipped[m] for m in tree.path(end)) / (layers * sum(recorded[m] for m in tree.path(end)))
                  for end in tree.ends])
  return tree, routes, want


@pytest.mark.parametrize("schedule,router_aux_coef", [
    # heavy (16 s): CI replays recorded routes on a depth-first episode tree against naive rows in float64
    # (test_episode_trees_replay_the_routes_their_samplers_recorded_float64) and runs the level case here.
    pytest.param("depth_first", 0.0, marks=pytest.mark.heavy),
    ("level", 0.5)])
def test_tree_routing_replay_equals_naive_float64_and_logs_the_mismatch(model64, x64, schedule, router_aux_coef):
  # Each node's recorded routes (30% of its pairs flipped, 20% of its tokens unrecorded) replayed once on its
  # ancestors' K/V, against the naive rows that replay each path's routes: loss and gradient to float64 rounding,
  # the same routing_mismatch (each node's path mismatch weighed by the share of trajectories ending at it), with
  # and without the load-balancing loss; and replaying moves the loss (so the routes are read).
  tree_routing_replay_equals_naive(*model64, schedule, router_aux_coef)


def tree_routing_replay_equals_naive(graphdef, params, schedule: str, router_aux_coef: float) -> None:
  """The body of test_tree_routing_replay_equals_naive_float64_and_logs_the_mismatch for a float64 model of 96
  ids (tests/test_gemma4_moe.py runs it on Gemma 4's experts)."""
  from branch_replay_jax.data.batches import recorded_routes, recorded_tree_routes
  from branch_replay_jax.gradients.heads import Policy
  from branch_replay_jax.gradients.step import value_and_grad
  rng = np.random.default_rng(11)
  tree, routes, want = _tree_with_recorded_routes(nnx.merge(graphdef, params), rng, flip=0.3, unrecorded=0.2)
  adv = rng.normal(size=len(tree.ends))
  old = [(-4.5 + 0.3 * rng.normal(size=len(s))) for s in tree.segments]
  w = obj.trajectory_weights(tree.completion_lengths(), mode="sequence_mean", max_length=16)
  rows = trajectory_group_arrays(tree, {"old_logp": old, "ref_logp": old}, w, vocab_size=96, max_positions=128,
                                 completion_bucket=16, advantage=adv)
  rows = recorded_routes(rows, routes[0], [np.concatenate([routes[m] for m in tree.path(e)[1:]]) for e in tree.ends])
  padded = pad_tree(tree)
  per_node = {"weights": list(tree.node_weights(w)), "old_logp": old, "ref_logp": old, "end_share": tree.end_shares()}
  nodes = recorded_tree_routes(tree_arrays(padded, per_node, advantage=adv), padded, routes)
  assert (np.asarray(nodes.levels[1].routes)[~np.asarray(nodes.levels[1].mask)] == -1).all()
  losses = {}
  for replay in (True, False):
    head = Policy(router_aux_coef=router_aux_coef, routing_replay=replay)
    run = jax.jit(lambda p, b, layout: value_and_grad(head, graphdef, p, b, objective, layout=layout,
                                                        schedule=schedule, micro_batch=1), static_argnums=2)
    ln, an, gn = run(params, rows, "naive")
    lt, at, gt = run(params, nodes, "replay")
    assert abs(float(lt) - float(ln)) <= 1e-12 * max(1.0, abs(float(ln)))
    assert max_rel_err(gt, gn) <= 1e-10
    naive_metric, tree_metric = (float(obj.grpo_aux_sums(a)[2]["routing_mismatch"]) for a in (an, at))
    assert abs(tree_metric - naive_metric) <= 1e-12
    if not replay:   # the router's own choice is the unreplayed forward's: the flipped share exactly
      assert abs(naive_metric - want) <= 1e-12
    losses[replay] = float(ln)
  assert want > 0.05 and abs(losses[True] - losses[False]) > 1e-6


def _padded_tree_cases(model, rng):
  """(a tree's RolloutBatch with recorded routes (`_tree_with_recorded_routes`), a layout builder: fan-outs and a
  segment length -> another tree's RolloutBatch with routes, the layout the first is padded to)."""
  from branch_replay_jax.data.batches import recorded_tree_routes
  tree, routes, _ = _tree_with_recorded_routes(model, rng, flip=0.3, unrecorded=0.2)
  w = obj.trajectory_weights(tree.completion_lengths(), mode="sequence_mean", max_length=16)
  old = [np.zeros(len(s)) for s in tree.segments]
  padded = pad_tree(tree)
  per_node = {"weights": list(tree.node_weights(w)), "old_logp": old, "ref_logp": old, "end_share": tree.end_shares()}
  nodes = recorded_tree_routes(tree_arrays(padded, per_node, advantage=rng.normal(size=len(tree.ends))), padded,
                               routes)
  seg = lambda first, n: [first] + list(rng.integers(3, 96, n - 1))

  def layout(fanouts, length):
    paths = [[]]
    for d, f in enumerate(fanouts):
      paths = [p + seg(30 + 10 * d + a, length) for p in paths for a in range(f)]
    big = tree_from_trajectories(list(rng.integers(3, 96, 9)), paths)
    big_padded, g = pad_tree(big), len(big.ends)
    fields = {k: [np.zeros(len(s)) for s in big.segments] for k in per_node if k != "weights"}
    arrays = tree_arrays(big_padded, {**fields, "weights": list(big.node_weights(np.ones(g)))}, advantage=np.zeros(g))
    shape = (model.config.num_layers, model.config.experts_per_token)
    return recorded_tree_routes(arrays, big_padded, [np.zeros((len(s),) + shape, np.int32) for s in big.segments])
  return nodes, layout


def test_pad_trees_keeps_a_trees_routes_and_records_none_on_the_padding(model):
  # pad_trees (a mesh step's and the one-device stacked step's level layout) keeps the tree's own routes in their
  # slots and gives every new slot, position and level -1 (none recorded): a padded token is never fed, so a
  # route there would count in no mismatch and replay nothing.
  from branch_replay_jax.data.batches import pad_trees
  nodes, layout = _padded_tree_cases(model, np.random.default_rng(12))
  deep = pad_trees([nodes, layout((3, 2, 2), 9)])[0]          # one level more
  assert [lvl.routes.shape[:-2] for lvl in deep.levels] == [lvl.tokens.shape for lvl in deep.levels]
  assert (np.asarray(deep.levels[2].routes) == -1).all()
  wide = pad_trees([nodes, layout((3, 2), 11)])[0]            # more slots and longer segments at each level
  for own, lvl in zip(nodes.levels, wide.levels):
    got, mine = np.array(lvl.routes), np.asarray(own.routes)
    assert got.shape[:-2] == lvl.tokens.shape and got.shape != mine.shape
    inside = tuple(slice(n) for n in mine.shape)
    np.testing.assert_array_equal(got[inside], mine)
    got[inside] = -1
    assert (got == -1).all()


# heavy (15 s alone, 35 s in CI: two level-schedule compiles): CI runs the padded layout against naive rows with
# recorded routes in test_grpo_trains_a_moe_tree_with_routing_replay (the loop stacks its trees with pad_trees and
# its exactness check compares them with the naive rows), and the padding itself in the test above.
@pytest.mark.heavy
def test_padded_trees_replay_as_the_unpadded_tree_float64(model64, x64):
  # The tree padded onto a wider layout (3 first-level nodes, longer segments) replays its routes as unpadded:
  # loss, gradient and routing_mismatch equal.
  from branch_replay_jax.data.batches import pad_trees
  from branch_replay_jax.gradients.heads import Policy
  from branch_replay_jax.gradients.step import value_and_grad
  graphdef, params = model64
  nodes, layout = _padded_tree_cases(nnx.merge(graphdef, params), np.random.default_rng(12))
  out = pad_trees([nodes, layout((3, 2), 11)])[0]
  run = jax.jit(lambda p, b: value_and_grad(Policy(routing_replay=True), graphdef, p, b, objective,
                                             schedule="level", micro_batch=None))
  (l0, a0, g0), (l1, a1, g1) = run(params, nodes), run(params, out)
  assert abs(float(l1) - float(l0)) <= 1e-12 * max(1.0, abs(float(l0))) and max_rel_err(g1, g0) <= 1e-10
  m0, m1 = (float(obj.grpo_aux_sums(a)[2]["routing_mismatch"]) for a in (a0, a1))
  assert m0 > 0.05 and abs(m1 - m0) <= 1e-12


def _group_with_own_routes(model64, dtype):
  """The float64 model's own routes of a group (`_recorded_routes`, nothing flipped or unrecorded) on the group's
  arrays in `dtype`, and the float64 gradient of the naive rows replaying them (the exact reference)."""
  from branch_replay_jax.gradients.heads import Policy
  from branch_replay_jax.gradients.step import value_and_grad
  graphdef, params = model64
  with jax.enable_x64(True):
    arrays = arrays_of(random_group([3, 6, 9, 2], prompt_len=7, seed=4, vocab=96), np.float64)
    prompt_routes, routes, _, _ = sampler_routes(graphdef, params, arrays, np.random.default_rng(0), flip=0.0,
                                                   unrecorded=0.0)
    batch = arrays.replace(prompt_routes=prompt_routes, levels=(arrays.branches.replace(routes=routes),))
    exact = jax.tree_util.tree_map(np.asarray, value_and_grad(Policy(routing_replay=True), graphdef, params, batch,
                                                              objective, layout="naive")[2])
  low = arrays_of(random_group([3, 6, 9, 2], prompt_len=7, seed=4, vocab=96), dtype)
  return low.replace(prompt_routes=prompt_routes, levels=(low.branches.replace(routes=routes),)), exact


def _low_precision_errors(model, batch, exact, dtype):
  """(naive's, replay's fused, replay's one completion per micro-batch) max relative gradient error against
  `exact`, the model computing in `dtype` (float32 parameters), the recorded routes replayed."""
  from branch_replay_jax.gradients.heads import Policy
  from branch_replay_jax.gradients.step import value_and_grad
  m = build_model(model.config, nnx.to_pure_dict(nnx.state(model, nnx.Param)), dtype=dtype)
  graphdef, params = nnx.split(m)
  params = jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), params)
  run = jax.jit(lambda p, b, layout, mb, fused: value_and_grad(Policy(routing_replay=True), graphdef, p, b, objective,
                                                               layout=layout, micro_batch=mb, fused=fused),
                static_argnums=(2, 3, 4))
  return tuple(max_rel_err(run(params, batch, *how)[2], exact)
               for how in (("naive", None, None), ("replay", None, True), ("replay", 1, False)))


def test_routing_replay_float32_replay_within_rounding_of_naive(model, model64):
  # Replaying recorded routes removes the one step in a mixture of experts that rounding can move discontinuously
  # (a near-tie between the k-th and (k+1)-th expert), so replay's error against the float64 gradient is rounding
  # alone, as for a dense model: in float32 below 1e-4 and within 1e-5 of naive's (measured: naive 2.4e-6, replay
  # fused 2.6e-6, one completion per micro-batch 2.7e-6).
  batch, exact = _group_with_own_routes(model64, np.float32)
  naive, fused, micro = _low_precision_errors(model, batch, exact, jnp.float32)
  assert max(naive, fused, micro) <= 1e-4 and max(fused, micro) <= naive + 1e-5, (naive, fused, micro)


# heavy: three bfloat16 compiles (~20 s). CI covers the same code in float32 (above) and float64
# (test_routing_replay_equals_naive_float64_and_logs_the_mismatch).
@pytest.mark.heavy
def test_routing_replay_bfloat16_error_at_most_twice_naive(model, model64):
  # bfloat16 compute, the recorded routes replayed: replay's gradient error against float64 at most twice naive's,
  # the bound tests/test_replay.py sets for Llama (measured: naive 0.071, replay fused 0.067, micro-batched 0.062).
  batch, exact = _group_with_own_routes(model64, np.float32)
  naive, fused, micro = _low_precision_errors(model, batch, exact, jnp.bfloat16)
  assert 0 < naive and max(fused, micro) <= 2 * naive, (naive, fused, micro)


def test_the_episode_sampler_records_the_routes_of_every_id_it_feeds_float64(model64, x64):
  # Three episodes of three turns from one prompt (prefilled once), a 5-id observation after each turn but the
  # last: EpisodeSampler.routes covers the ids it fed (prompt, turns but their last token, which the next prefill
  # feeds with the observation), and in float64 they are the experts the trainer's forward of the episode picks.
  from branch_replay_jax.rollout.episode_sampler import EpisodeSampler
  graphdef, params = model64
  model = nnx.merge(graphdef, params)
  rng = np.random.default_rng(2)
  prompt, observations = rng.integers(3, 96, 9).tolist(), [rng.integers(3, 96, 5).tolist() for _ in range(2)]
  samplers = EpisodeSampler.branches(model, prompt, 3, key=jax.random.key(4), temperature=1.0, eos_ids=[2])
  for s in samplers:
    ids = list(prompt)
    for t in range(3):
      ids += s(ids, 4) + (observations[t] if t < 2 else [])
    own = np.sort(np.asarray(model(jnp.asarray(ids)[None], 0).experts[0]), -1)
    assert s.routes.shape == (len(s.seen), model.config.num_layers, model.config.experts_per_token)
    assert len(ids) - 1 == len(s.seen) and s.seen == ids[:-1]
    np.testing.assert_array_equal(np.sort(s.routes, -1), own[:-1])


def test_grpo_trains_moe_episodes_with_routing_replay(tmp_path, monkeypatch):
  # The calculator smoke experiment's episodes (the episode tree, depth-first: the packed row, the experiment's
  # default, routes itself and is refused with routing replay) on a random Qwen3-MoE directory with
  # model.routing_replay: the loop hands the episode samplers' routes to the step, which replays them. The random
  # model never closes a turn, so every episode is one turn, every reward 0 and no exactness check runs
  # (test_episode_trees_replay_the_routes_their_samplers_recorded_float64 checks several turns and
  # observations against naive rows). The routing_mismatch is below 5%: sampler and trainer run the same float32
  # model, so routes misplaced by even one position would show as a mismatch near 1/2 (measured 0.45 in float64).
  from experiments import grpo_smollm2_calc
  cfg = tiny_config(vocab_size=SMOLLM2_VOCAB, arch="qwen3_moe", qk_norm=True, num_experts=4, experts_per_token=2,
                    expert_ffn_dim=16, max_positions=2048, tie_embeddings=False)
  record = grpo_on_exported(Llama(cfg, rngs=nnx.Rngs(2)), tmp_path, monkeypatch, grpo_smollm2_calc,
                            **{"model.routing_replay": True, "train.tree_schedule": "depth_first"})
  assert np.isfinite(record["loss"]) and 0.0 <= record["routing_mismatch"] < 0.05


def test_episode_trees_replay_the_routes_their_samplers_recorded_float64(model64, x64, tmp_path):
  # Four 3-turn episodes sampled by EpisodeSampler in float64: episodes 0 and 1 share a key, so they draw the same
  # first turn, then see different observations (the episode tree shares that turn once); 2 and 3 branch at the
  # first turn. `groups.build_episodes` gives the tree's nodes and the naive rows the samplers' routes: routed in
  # float64 exactly as the trainer routes them (routing_mismatch 0 in both layouts: a route placed on another
  # position would mismatch), replayed, the tree's loss and gradient equal the naive rows' to float64 rounding.
  from conftest import experiment_config
  from experiments import grpo_smollm2_calc
  from branch_replay_jax.algorithms import groups as grouping
  from branch_replay_jax.algorithms.schema import layout_of, parse
  from branch_replay_jax.data.episodes import Episode
  from branch_replay_jax.gradients.heads import Policy
  from branch_replay_jax.gradients.step import value_and_grad
  from branch_replay_jax.rollout.collect import EpisodeTrajectories
  from branch_replay_jax.rollout.environments import EpisodeResult
  from branch_replay_jax.rollout.episode_sampler import EpisodeSampler
  graphdef, params = model64
  model = nnx.merge(graphdef, params)
  rng = np.random.default_rng(6)
  prompt = rng.integers(3, 96, 8).tolist()
  results, logprobs, routes = [], [], []
  for g, key in enumerate([1, 1, 2, 3]):
    s = EpisodeSampler(model, key=jax.random.key(key), temperature=1.0, eos_ids=[2])
    ids, segments, roles = list(prompt), [], []
    for t in range(3):
      turn = s(ids, 4)
      observation = [] if t == 2 else rng.integers(3, 96, 3 + g).tolist()
      segments += [np.asarray(turn)] + ([np.asarray(observation)] if observation else [])
      roles += ["model"] + (["observation"] if observation else [])
      ids += turn + observation
    results.append(EpisodeResult((Episode(np.asarray(prompt), tuple(segments), tuple(roles)),), float(g % 2),
                                 "max_turns", 3, 0))
    logprobs.append(s.logprobs)
    routes.append(s.routes)
  raw = EpisodeTrajectories(prompt, results, np.array([g % 2 == 1 for g in range(4)]), [["none"] * 3] * 4, 12, {},
                            0.0, logprobs=logprobs, routes=routes)
  config = experiment_config(grpo_smollm2_calc, "smoke", tmp_path, **{"rollout.episodes.min_shared_tokens": 1})
  # the loop's on-policy objective (the batch has no old log-probs); the advantages come from rewards 0, 1, 0, 1
  on_policy = lambda logp, br: obj.grpo_objective(logp, br, clip_eps=0.2, kl_coef=0.0, on_policy=True)
  group = grouping.build_episodes(config, raw, model.config, 0, layout_of(parse(config)))
  assert group.kind == "tree" and len(group.batch.levels) == 2   # episodes 0 and 1 share their first turn
  assert group.batch.prompt_routes is not None and group.naive_batch.prompt_routes is not None
  for replay in (False, True):
    run = jax.jit(lambda p, b, layout: value_and_grad(Policy(routing_replay=replay), graphdef, p, b, on_policy,
                                                        layout=layout, micro_batch=1), static_argnums=2)
    lt, at, gt = run(params, group.batch, "replay")
    ln, an, gn = run(params, group.naive_batch, "naive")
    assert abs(float(lt) - float(ln)) <= 1e-12 * max(1.0, abs(float(ln))) and max_rel_err(gt, gn) <= 1e-10
    for aux in (at, an):
      assert float(obj.grpo_aux_sums(aux)[2]["routing_mismatch"]) == 0.0


def _adapters(graphdef, params, targets):
  """(graphdef, adapters, base) of the float64 model with LoRA adapters (rank 3, scale 2) on `targets`, their
  B random (not the zero init), so they change every projection; adapters cast to float64 (add_adapters makes
  float32)."""
  from branch_replay_jax.models import lora
  model = nnx.merge(graphdef, params)
  spec = lora.LoraSpec(rank=3, alpha=6.0, targets=targets)
  lora.add_adapters(model, spec, rngs=nnx.Rngs(1))
  for i, t in enumerate(spec.targets):
    b = getattr(model.layers, t + "_lora_b")
    b[...] = 0.2 * jax.random.normal(jax.random.key(100 + i), b.shape, b.dtype)
  lgraph, adapters, base = lora.split(model)
  return lgraph, jax.tree_util.tree_map(lambda x: x.astype(jnp.float64), adapters), base


# "attention" is heavy (9 s): a mixture of experts' attention adapters run the dense families' attention code
# (tests/test_lora.py's float64 replay tests); CI runs "experts", the same routes, router gradient and
# load-balancing loss with the adapters inside the experts' grouped matmul.
@pytest.mark.parametrize("targets", [pytest.param("attention", marks=pytest.mark.heavy), "experts"])
def test_lora_replays_as_naive_rows_with_routing_replay_float64(model64, x64, targets):
  # LoRA adapters (rank 3, random B so they change every projection) on a mixture of experts' attention, or on
  # its experts (one pair per expert, [L, E, ...], run in the experts' grouped matmul on the rows routed to each),
  # the rest frozen in the base: a group with recorded routes (30% flipped, 20% unrecorded) replayed with the
  # load-balancing loss. Replay (fused and one completion per micro-batch) equals naive rows to float64
  # rounding; only the adapters are differentiated, and each of them gets a gradient (the load-balancing loss's
  # reaches the attention through the router probabilities of the layers above; every expert's adapters get
  # the tokens routed to it).
  from branch_replay_jax.gradients.heads import Policy
  from branch_replay_jax.gradients.step import value_and_grad
  from branch_replay_jax.models import lora
  graphdef, params = model64
  lgraph, adapters, base = _adapters(graphdef, params, {"attention": lora.ATTENTION_TARGETS,
                                                        "experts": lora.EXPERT_TARGETS}[targets])
  arrays = arrays_of(random_group([3, 6, 9, 2], prompt_len=7, seed=4, vocab=96), np.float64)
  prompt_routes, routes, _, _ = sampler_routes(graphdef, params, arrays, np.random.default_rng(0), flip=0.3,
                                                 unrecorded=0.2)
  batch = arrays.replace(prompt_routes=prompt_routes, levels=(arrays.branches.replace(routes=routes),))
  head = Policy(router_aux_coef=0.5, routing_replay=True)
  run = jax.jit(lambda a, b, bt, layout, m, fused: value_and_grad(head, lora.WithBase(lgraph, b), a, bt, objective,
                                                                    layout=layout, micro_batch=m, fused=fused),
                static_argnums=(3, 4, 5))
  ln, _, gn = run(adapters, base, batch, "naive", None, None)
  assert jax.tree_util.tree_structure(gn) == jax.tree_util.tree_structure(adapters)
  assert min(float(jnp.abs(x).max()) for x in jax.tree_util.tree_leaves(gn)) > 1e-8
  if targets == "experts":   # one adapter pair per expert; an expert learns from the tokens routed to it (here all
    # but one of the 24 (layer, expert) pairs get some; the one that gets none has exactly 0)
    a = np.abs(np.asarray(gn["layers"]["w_gate_lora_a"][...])).max(axis=(2, 3))
    assert a.shape == (3, 8) and (a > 1e-10).sum() >= 20 and np.all((a == 0) | (a > 1e-10))
    # export merges each expert's W_e + (alpha / r) A_e B_e (lora.merged): the same function
    adapted = lora.merge(lora.WithBase(lgraph, base), adapters)
    tokens = jnp.asarray(np.random.default_rng(1).integers(3, 96, (2, 11)))
    want, got = adapted(tokens, 0).hidden_btd, lora.merged(adapted)(tokens, 0).hidden_btd
    assert float(jnp.abs(got - want).max()) <= 1e-12 * float(jnp.abs(want).max())
  for m, fused in ((1, False), (None, True)):
    lr, _, gr = run(adapters, base, batch, "replay", m, fused)
    assert abs(float(lr) - float(ln)) <= 1e-12 * max(1.0, abs(float(ln)))
    assert max_rel_err(gr, gn) <= 1e-10


def test_expert_adapters_are_split_and_dispatched_with_their_experts(model):
  # Under expert parallelism over branch (FSDP for the rest) the experts' adapters [L, E, ..., r] are split on E
  # with their experts and dispatched to (never gathered), the router gathered over branch; the attention's
  # adapters follow the FSDP rules. Placement only: nothing is compiled.
  from branch_replay_jax.distributed.mesh import gathers, make_mesh, shard_params
  from branch_replay_jax.models import lora
  m = nnx.merge(*nnx.split(model))
  lora.add_adapters(m, lora.LoraSpec(rank=2, alpha=2.0, targets=("wq",) + lora.EXPERT_TARGETS), rngs=nnx.Rngs(0))
  mesh = make_mesh(2, 2, 1, devices=jax.devices()[:4])
  placed = shard_params(nnx.state(m, nnx.Param), mesh, "fsdp", expert="branch")
  flat = jax.tree_util.tree_flatten_with_path(placed, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
  by_name = {jax.tree_util.keystr(p).split("'")[-2]: g for (p, _), g in zip(flat, gathers(placed))}
  for name in ("w_gate", "w_gate_lora_a", "w_gate_lora_b", "w_down_lora_b"):
    assert by_name[name].axes == ("branch",) and by_name[name].dispatch and by_name[name].dim == 1, name
  assert by_name["w_router"].axes == ("branch",) and not by_name["w_router"].dispatch
  assert by_name["wq_lora_a"].axes == ("data", "branch", "seq")


@pytest.mark.parametrize("expert_matmul", [
    "tiled",
    # heavy (~80 s of interpreter compiles under load): CI holds the Pallas kernels to ragged_dot, forward and
    # gradients, in tests/test_kernels.py, and the model's dispatch to them is the one "tiled" runs here.
    pytest.param("pallas", marks=pytest.mark.heavy)])
def test_tiled_expert_matmuls_equal_ragged_dot_and_replay_stays_exact_float64(model64, x64, expert_matmul):
  # config.expert_matmul = "tiled" (kernels.grouped_matmul, tiles of 128 rows of one expert) and "pallas" (those
  # tiles as Pallas kernels, interpreted on the CPU) are the same function as ragged_dot: the naive rows' loss and
  # gradient within float64 rounding; replay against naive rows with it to 1e-10, the router's gradient included.
  # (build_model takes the config's expert_matmul: until this stop its default "ragged_dot" replaced it here.)
  import dataclasses
  graphdef, params = model64
  m = nnx.merge(graphdef, params)
  tiled = build_model(dataclasses.replace(m.config, expert_matmul=expert_matmul),
                      nnx.to_pure_dict(nnx.state(m, nnx.Param)), dtype=jnp.float64)
  tg, tp = nnx.split(tiled)
  arrays = arrays_of(random_group([3, 6, 9, 2], prompt_len=7, seed=4, vocab=96), np.float64)
  l0, _, g0 = step(graphdef, params, arrays, objective, layout="naive")
  ln, _, gn = step(tg, tp, arrays, objective, layout="naive")
  lr, _, gr = step(tg, tp, arrays, objective, micro_batch=1, fused=False)
  assert abs(float(ln) - float(l0)) <= 1e-12 * max(1.0, abs(float(l0))) and max_rel_err(gn, g0) <= 1e-10
  assert abs(float(lr) - float(ln)) <= 1e-12 * max(1.0, abs(float(ln))) and max_rel_err(gr, gn) <= 1e-10
  with pytest.raises(ValueError, match="ModelConfig.expert_matmul='dense' is not one of"):
    dataclasses.replace(m.config, expert_matmul="dense")
