"""LoRA adapters (models/lora.py): replay with adapters equals naive, the adapters' gradients follow
the chain rule of the merged weight, the reference (adapters off) is the base model, and bad
settings are refused by name before anything loads."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from conftest import experiment_config, max_rel_err, no_model_load, random_group

from branch_replay_jax import losses as obj
from branch_replay_jax.algorithms import grpo, runs
from branch_replay_jax.data.batches import group_arrays, trajectory_group_arrays, tree_arrays
from branch_replay_jax.data.trees import RolloutTree, pad_tree
from branch_replay_jax.models import Llama, lora, tiny_config
from branch_replay_jax.outputs.checkpoints import RunCheckpoints
from experiments import grpo_smollm2_arith, ppo_smollm2_arith
from branch_replay_jax.gradients.heads import POLICY
from branch_replay_jax.gradients.step import forward, value_and_grad

SPEC = lora.LoraSpec(rank=3, alpha=6.0)      # every projection adapted; scale 2
LENGTHS = [1, 5, 9, 3, 7, 1, 8]


def adapted_model(dtype=jnp.float32, spec=SPEC, seed=0):
  """(graphdef, adapters, base) of the tiny model with adapters whose B is random (not the zero init):
  the adapters then change every projection, so a wrong layout or scale shows in the outputs."""
  model = Llama(tiny_config(), dtype=dtype, rngs=nnx.Rngs(seed))
  lora.add_adapters(model, spec, rngs=nnx.Rngs(seed + 1))
  for i, t in enumerate(spec.targets):
    b = getattr(model.layers, t + "_lora_b")
    b[...] = 0.2 * jax.random.normal(jax.random.key(100 + i), b.shape, b.dtype)
  graphdef, adapters, base = lora.split(model)
  cast = lambda tree: jax.tree_util.tree_map(lambda x: x.astype(dtype), tree)
  return graphdef, cast(adapters), cast(base)


def grpo_objective(logp, br):
  loss, metrics = obj.grpo_token_loss(logp, br.old_logp, br.ref_logp, br.advantage, clip_eps=0.2, kl_coef=0.05)
  return jnp.sum(br.weights * loss), {"clipped": jnp.sum(metrics["clipped"] & br.mask)}


def logprob_objective(logp, br):
  return obj.weighted_logprob_loss(logp, br.weights), logp


def grpo_arrays(group, dtype, seed=1):
  rng = np.random.default_rng(seed)
  g, t = group.completion_ids.shape
  return group_arrays(group, weights=obj.token_weights(group.lengths, t, mode="sequence_mean").astype(dtype),
                      advantage=rng.normal(size=g).astype(dtype),
                      old_logp=(-4.2 + 0.3 * rng.normal(size=(g, t))).astype(dtype),
                      ref_logp=(-4.2 + 0.3 * rng.normal(size=(g, t))).astype(dtype))


# The base enters as a traced argument bound by WithBase (as GRPOFunctions does), adapters differentiated.
@functools.partial(jax.jit, static_argnums=(0, 4), static_argnames=("micro_batch",))
def _replay(graphdef, adapters, base, batch, objective, micro_batch=1):
  return value_and_grad(POLICY, lora.WithBase(graphdef, base), adapters, batch, objective, micro_batch=micro_batch)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _naive(graphdef, adapters, base, batch, objective):
  return value_and_grad(POLICY, lora.WithBase(graphdef, base), adapters, batch, objective, layout="naive")


def _adapter_grads_from_merged_weights(graphdef, adapters, base, batch, objective):
  """The adapters' gradient by the chain rule from a model without adapters: W' = W + s A B gives
  dL/dA = s G B^T and dL/dB = s A^T G with G = dL/dW' (flattened [L, in, out]); G from the naive
  step on `lora.merged` (full fine-tuning's gradient), independent of the adapter code path."""
  model = lora.merged(nnx.merge(graphdef, adapters, base))
  plain_graph, params = nnx.split(model)
  _, _, g_full = jax.jit(functools.partial(value_and_grad, POLICY, layout="naive"), static_argnums=(0, 3))(plain_graph, params, batch, objective)
  s, r, want = SPEC.scale, SPEC.rank, {}
  for t in SPEC.targets:
    a, b = (np.asarray(adapters["layers"][t + x][...]) for x in ("_lora_a", "_lora_b"))
    gw = np.asarray(g_full["layers"][t][...])
    n = gw.shape[0]
    a2, b2 = a.reshape(n, -1, r), b.reshape(n, r, -1)
    g2 = gw.reshape(n, a2.shape[1], b2.shape[2])
    want[t + "_lora_a"] = (s * np.einsum("lio,lro->lir", g2, b2)).reshape(a.shape)
    want[t + "_lora_b"] = (s * np.einsum("lir,lio->lro", a2, g2)).reshape(b.shape)
  return want


def test_float64_lora_replay_equals_naive_and_the_chain_rule(x64):
  # Replay and naive compute the same function of the adapters: float64 rounding (~1e-15) only.
  # The chain rule through the merged weight is a third, independent computation of the same
  # gradient (a different summation order: still float64 rounding).
  graphdef, adapters, base = adapted_model(jnp.float64)
  batch = grpo_arrays(random_group(LENGTHS), np.float64)
  (lr, ar, gr), (ln, an, gn) = (_replay(graphdef, adapters, base, batch, grpo_objective),
                                _naive(graphdef, adapters, base, batch, grpo_objective))
  assert jax.tree_util.tree_structure(gr) == jax.tree_util.tree_structure(adapters), "only adapters differentiated"
  assert max_rel_err(gr, gn) <= 1e-10
  assert abs(float(lr) - float(ln)) <= 1e-12 * max(1.0, abs(float(ln)))
  assert int(np.sum(ar["clipped"])) > 0, "the case must exercise the clipped branch of the surrogate"
  want = _adapter_grads_from_merged_weights(graphdef, adapters, base, batch, grpo_objective)
  got = {k: np.asarray(v[...]) for k, v in gr["layers"].items()}
  assert set(got) == set(want)
  assert max_rel_err(got, want) <= 1e-10
  assert min(np.abs(v).max() for v in want.values()) > 1e-8, "every adapter must get a gradient"


@pytest.mark.heavy   # ~2 min on loaded cores; LoRA float32 in CI: the float32 depth-first tree case
def test_float32_lora_replay_equals_naive():
  graphdef, adapters, base = adapted_model()
  batch = grpo_arrays(random_group(LENGTHS), np.float32)
  (lr, _, gr), (ln, _, gn) = (_replay(graphdef, adapters, base, batch, grpo_objective, micro_batch=7),
                              _naive(graphdef, adapters, base, batch, grpo_objective))
  assert max_rel_err(gr, gn) <= 1e-4
  assert abs(float(lr) - float(ln)) <= 1e-5 * max(1.0, abs(float(ln)))


def test_prompt_cotangent_reaches_every_layers_adapters(x64):
  # A loss on completion token 0 only: its log-prob comes from the prompt's last hidden state, so
  # the adapters' whole gradient flows through the prompt's forward (replay's single prefix
  # pullback), into every layer's A and B; it must equal naive's.
  graphdef, adapters, base = adapted_model(jnp.float64)
  group = random_group([4, 2, 6], prompt_len=9, seed=3)
  first_only = np.zeros(group.completion_ids.shape)
  first_only[:, 0] = 1.0
  batch = group_arrays(group, weights=first_only)
  (_, _, gr), (_, _, gn) = (_replay(graphdef, adapters, base, batch, logprob_objective),
                            _naive(graphdef, adapters, base, batch, logprob_objective))
  assert max_rel_err(gr, gn) <= 1e-10
  for name, g in gr["layers"].items():
    g = np.asarray(g[...])
    per_layer = np.abs(g).reshape(g.shape[0], -1).max(axis=1)
    assert np.all(per_layer > 1e-8), (name, per_layer)


# A ragged depth-3 tree: an early end (trajectory 1 stops at depth 1) and a one-token leaf.
TREE = RolloutTree(tuple(np.random.default_rng(3).integers(0, 64, n) for n in (5, 3, 2, 4, 1, 3, 2, 2)),
                   (-1, 0, 1, 1, 0, 3, 3, 2), (7, 4, 5, 6))


def _tree_and_naive(graphdef, adapters, base, dtype, schedule):
  rng = np.random.default_rng(0)
  g = len(TREE.ends)
  adv = rng.normal(size=g).astype(dtype)
  old = [(-4.0 + 0.3 * rng.normal(size=len(s))).astype(dtype) for s in TREE.segments]
  ref = [(-4.0 + 0.3 * rng.normal(size=len(s))).astype(dtype) for s in TREE.segments]
  w = obj.trajectory_weights(TREE.completion_lengths(), mode="group_token_mean", max_length=16)
  padded = pad_tree(TREE)
  arrays = tree_arrays(padded, {"weights": [x.astype(dtype) for x in TREE.node_weights(w)], "old_logp": old,
                                "ref_logp": ref}, advantage=adv)
  tree_obj = functools.partial(obj.grpo_objective, clip_eps=0.2, kl_coef=0.05, on_policy=False)
  group_obj = functools.partial(obj.grpo_objective, clip_eps=0.2, kl_coef=0.05, on_policy=False)
  micro = padded.node_ids[-1].shape[-1] if schedule == "level" else 1
  tree_step = jax.jit(lambda a, b, x: value_and_grad(POLICY, lora.WithBase(graphdef, b), a, x, tree_obj,
                                                                  schedule=schedule, micro_batch=micro))
  group = trajectory_group_arrays(TREE, {"old_logp": old, "ref_logp": ref}, w.astype(dtype), vocab_size=64,
                                  max_positions=256, completion_bucket=16, advantage=adv)
  return tree_step(adapters, base, arrays), _naive(graphdef, adapters, base, group, group_obj)


@pytest.mark.parametrize("dtype,schedule", [
    # float32 is heavy (~35 s): LoRA trees run in float64 in CI, and LoRA's float32 bound on the FSDP
    # mesh (test_lora_on_the_fsdp_mesh_equals_naive).
    (np.float64, "level"), pytest.param(np.float32, "depth_first", marks=pytest.mark.heavy),
    pytest.param(np.float64, "depth_first", marks=pytest.mark.heavy)], ids=["float64-level", "float32-depth_first",
                                                                          "float64-depth_first"])
def test_lora_tree_replay_equals_naive(dtype, schedule):
  # float64: rounding only (<= 1e-10 relative); float32: <= 1e-4 (the bounds).
  with jax.enable_x64(dtype == np.float64):
    graphdef, adapters, base = adapted_model(jnp.dtype(dtype))
    (lt, _, gt), (ln, _, gn) = _tree_and_naive(graphdef, adapters, base, dtype, schedule)
    tight = dtype == np.float64
    assert abs(float(lt) - float(ln)) <= (1e-12 if tight else 1e-5) * max(1.0, abs(float(ln)))
    assert max_rel_err(gt, gn) <= (1e-10 if tight else 1e-4)


def test_adapters_off_is_the_base_model_and_merging_keeps_the_function():
  # Zero adapters add (x 0) 0 * scale = 0 to every projection: the reference log-probs equal the
  # model without adapters (the same base einsums; adding +0.0 is exact) to within one float32 ulp: the two
  # are different programs, and XLA:CPU may fuse and order their reductions differently (seen: 1 of 112
  # log-probs 1 ulp apart on one machine, bit-equal on another). A missed adapter-off would move them by
  # the adapters' effect, > 1e-2 below. The trained
  # adapters really change the policy (else the first check is empty), and `merged` (W + s A B,
  # for export) computes the adapted policy up to float32 rounding.
  graphdef, adapters, base = adapted_model()
  batch = grpo_arrays(random_group(LENGTHS), np.float32)
  logprobs = jax.jit(lambda a, b, x: forward(POLICY, lora.WithBase(graphdef, b), a, x, micro_batch=7))
  reference = logprobs(lora.adapters_off(adapters), base, batch)
  plain_graph, plain = nnx.split(Llama(tiny_config(), rngs=nnx.Rngs(0)))
  np.testing.assert_allclose(reference, jax.jit(lambda p, x: forward(POLICY, plain_graph, p, x, micro_batch=7))(
      plain, batch), rtol=2.5e-7, atol=0)
  adapted = logprobs(adapters, base, batch)
  assert np.abs(np.asarray(adapted) - np.asarray(reference)).max() > 1e-2
  merged_graph, merged = nnx.split(lora.merged(nnx.merge(graphdef, adapters, base)))
  np.testing.assert_allclose(forward(POLICY, merged_graph, merged, batch, micro_batch=7), adapted, atol=1e-5)


@pytest.mark.slow   # reads SmolLM2's GGUF (tokenizer or header)
def test_export_writes_the_adapted_policy_merged(tmp_path):
  # export_model merges the adapters (W + s A B): the directory read back by our HF loader, a
  # model without adapters, gives the adapted model's logits up to float32 rounding of the merge.
  from branch_replay_jax import export
  from branch_replay_jax.models.loading import load, load_tokenizer
  tokenizer = load_tokenizer("smollm2-135m-instruct")
  model = lora.add_adapters(Llama(tiny_config(vocab_size=len(tokenizer)), rngs=nnx.Rngs(0)), SPEC, rngs=nnx.Rngs(1))
  model.layers.w_up_lora_b[...] = 0.2 * jax.random.normal(jax.random.key(5), model.layers.w_up_lora_b.shape)
  model.layers.wq_lora_b[...] = 0.2 * jax.random.normal(jax.random.key(6), model.layers.wq_lora_b.shape)
  tokens = jnp.asarray([[1, 17, 300, 42, 9, 2048, 5, 77]])
  logits = lambda m: np.asarray(m.logits(m(tokens, 0).hidden_btd))
  loaded, _ = load(export.export_model(model, tokenizer, str(tmp_path / "hf")))
  assert loaded.lora is None
  want, got = logits(model), logits(loaded)
  base = logits(Llama(tiny_config(vocab_size=len(tokenizer)), rngs=nnx.Rngs(0)))
  assert np.abs(want - base).max() > 1e-3 * np.abs(want).max(), "the adapters must change the policy"
  assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.slow   # reads SmolLM2's GGUF (tokenizer or header)
def test_grpo_setup_keeps_no_second_copy_and_optimises_adapters_only(tmp_path):
  # With LoRA the loop trains, optimises and would checkpoint the adapters alone; the reference is
  # the adapters set to zero (adapter-sized), not a copy of the model.
  config = experiment_config(grpo_smollm2_arith, "lora_smoke", tmp_path)
  algorithm = grpo.GRPO(config)
  run = runs.start_run(config, algorithm.fingerprint(), optimizer_fn=lambda _: algorithm.make_optimizer(),
                       keep_initial=algorithm.keep_initial)
  params, opt_state = algorithm.setup(run)
  nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))
  cfg, r = run.model_config, config.lora.rank
  per_layer = sum(r * (np.prod(i) + np.prod(o)) for i, o in lora.projection_shapes(cfg).values())
  assert nbytes(params) == 4 * cfg.num_layers * per_layer        # float32 adapters of all 7 projections
  assert run.initial_params is None
  assert nbytes(algorithm.ref_params) == nbytes(params)
  assert all(not np.any(np.asarray(x)) for x in jax.tree_util.tree_leaves(algorithm.ref_params))
  assert {type(v) for v in jax.tree_util.tree_leaves(run.params, is_leaf=lambda x: isinstance(x, nnx.Variable))} \
      == {nnx.LoRAParam}
  # AdamW's mu and nu of the adapters, plus its int32 step count.
  assert 2 * nbytes(params) <= nbytes(opt_state) <= 2 * nbytes(params) + 16
  assert nbytes(run.frozen) > 10 * nbytes(params)
  run.ckpt.close()


def _lora_config(tmp_path, **overrides):
  """The LoRA smoke config (the tiny model: its shapes need no file read) with dotted overrides."""
  return experiment_config(grpo_smollm2_arith, "lora_smoke", tmp_path, **overrides)


# (override, text the error must name): the tiny model's k/v projections have fan-out 2 x 8 = 16.
BAD = [
    ({"lora.targets": ("wq", "attn_out")}, "lora.targets=('wq', 'attn_out')"),
    ({"lora.targets": ()}, "lora.targets=()"),
    ({"lora.targets": ("wq", "wq")}, "lora.targets=('wq', 'wq')"),
    ({"lora.rank": 0}, "lora.rank=0"),
    ({"lora.rank": -2}, "lora.rank=-2"),
    ({"lora.rank": 17}, "lora.rank=17 is larger than projection wk's dimensions (fan-in 32, fan-out 16)"),
    ({"lora.alpha": 0.0}, "lora.alpha=0.0"),
    ({"lora.dropout": 0.1}, "lora.dropout=0.1"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[m.split(" ")[0] for _, m in BAD])
def test_bad_lora_settings_are_refused_by_name_before_the_model_loads(monkeypatch, tmp_path, overrides, message):
  no_model_load(monkeypatch)
  with pytest.raises(ValueError, match=re.escape(message)):
    grpo.GRPO(_lora_config(tmp_path, **overrides))


@pytest.mark.slow   # reads SmolLM2's GGUF (tokenizer or header)
def test_rank_is_checked_against_the_real_model_before_it_loads_and_ppo_is_refused(monkeypatch, tmp_path):
  # SmolLM2-135M's shapes come from its GGUF header (no tensor read): k/v fan-out 3 x 64 = 192.
  no_model_load(monkeypatch)
  real = lambda rank: experiment_config(grpo_smollm2_arith, "lora", tmp_path, **{"lora.rank": rank})
  with pytest.raises(ValueError, match=re.escape("lora.rank=193 is larger than projection wk's dimensions "
                                                 "(fan-in 576, fan-out 192)")):
    grpo.validate(real(193))
  grpo.validate(real(192))   # = the smallest fan-out: a full-rank update of wk and wv
  grpo.validate(_lora_config(tmp_path, **{"lora.rank": 16}))
  from branch_replay_jax.algorithms import ppo
  config = experiment_config(ppo_smollm2_arith, "smoke", tmp_path)
  config.lora = grpo_smollm2_arith.get_config("lora").lora
  with pytest.raises(ValueError, match=re.escape("lora is set with algorithm='ppo'")):
    ppo.validate(config)


@pytest.mark.slow   # reads SmolLM2's GGUF (tokenizer or header)
def test_resume_refuses_adapters_of_another_base_model(monkeypatch, tmp_path):
  # A checkpoint records the base's hash; resuming the same run dir onto different base weights
  # (same name and shapes, so the fingerprint and the restore would not notice) is refused, the
  # same base resumes.
  config = experiment_config(grpo_smollm2_arith, "lora_smoke", tmp_path)
  fingerprint = grpo.GRPO(config).fingerprint()
  run = runs.start_run(config, fingerprint)
  run.ckpt.save(1, {"params": run.params, "opt_state": run.opt_state, "rng": jax.random.key_data(run.key)},
                {"step": 1, "data_pos": 2})
  run.ckpt.close()
  ckpt = RunCheckpoints(config.run_dir)
  assert ckpt.meta(1)["lora_base"] == {"model": "tiny", "sha256": lora.base_hash(lora.split(
      runs.build_model(config)[0])[2])}
  ckpt.close()
  config.resume = True
  resumed = runs.start_run(config, fingerprint)
  assert (resumed.start, resumed.data_pos) == (1, 2)
  resumed.ckpt.close()

  build = runs.build_model

  def other_base(cfg):
    model, tokenizer = build(cfg)
    model.layers.wq[...] = model.layers.wq[...] + 1e-3
    return model, tokenizer
  monkeypatch.setattr(runs, "build_model", other_base)
  with pytest.raises(ValueError, match=r"adapters were trained on base model.name='tiny' \(weights sha256 [0-9a-f]{64}"):
    runs.start_run(config, fingerprint)


@pytest.mark.heavy   # two training steps (45 s); CI runs :lora_smoke through test_config_fields already
def test_lora_smoke_run_trains_adapters_only_and_passes_the_exactness_check(tmp_path, monkeypatch):
  # Two steps of :lora_smoke with rewards that vary (conftest.length_score), the run-time
  # exactness check at step 2: replay against naive with the adapters differentiated, within the
  # float32 bound (1e-4) and not identically 0. The checkpoint holds the adapters alone, B moved
  # off its zero init, and the base model is the one build_model loads (its hash in the meta).
  import json
  import os
  from conftest import length_score
  from branch_replay_jax.outputs.checkpoints import pure_params
  from branch_replay_jax.rollout.tasks import Task
  monkeypatch.setattr(Task, "score", length_score)
  config = experiment_config(grpo_smollm2_arith, "lora_smoke", tmp_path, **{"train.exactness_check_every": 2})
  grpo.train(config)
  with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
    second = [json.loads(line) for line in f][1]
  errors = [second[k] for k in ("exactness_grad_rel_err", "exactness_loss_rel_err", "exactness_kl_rel_err")]
  assert all(0 <= e <= 1e-4 for e in errors) and second["exactness_grad_rel_err"] > 0, second
  ckpt = RunCheckpoints(config.run_dir)
  state, meta = ckpt.restore(2)
  ckpt.close()
  layers = pure_params(state["params"])
  assert set(layers) == {"layers"} and set(layers["layers"]) == {t + s for t in lora.TARGETS
                                                                 for s in ("_lora_a", "_lora_b")}
  assert all(np.abs(layers["layers"][t + "_lora_b"]).max() > 0 for t in lora.TARGETS)
  model = runs.build_model(config)[0]
  assert meta["lora_base"]["sha256"] == lora.base_hash(lora.split(model)[2])


@pytest.mark.skipif(jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
# float64 is heavy (~40 s of CPU, 2-3 min on loaded cores: four compiles); CI runs float32, the same
# code path with the adapters FSDP-sharded too.
@pytest.mark.parametrize("dtype, tol, adapters_mode", [
    pytest.param(jnp.float64, 1e-10, "replicated", marks=pytest.mark.heavy), (jnp.float32, 1e-5, "fsdp")])
def test_lora_on_the_fsdp_mesh_equals_naive(dtype, tol, adapters_mode):
  # Two groups (prompts of 11 and 6 tokens, bucket 16) on 2 x 2 x 2: the frozen base FSDP-sharded
  # (each leaf split over the 8 devices, gathered per use inside the step, never differentiated),
  # the adapters replicated (float64) or FSDP-sharded too (float32). Expected: the one-device naive
  # step summed over the groups, to float64 rounding (1e-10) or float32's (1e-5, the mesh bound);
  # only the order of sums differs. The forward-only log-probs equal one device's, and the
  # gradient is the adapters' alone, laid out as they were placed.
  from branch_replay_jax.distributed.mesh import (make_mesh, pad_prompts, param_specs, shard_batch, shard_params,
                                                  stack_groups)
  from jax.sharding import NamedSharding
  with jax.enable_x64(dtype == jnp.float64):
    graphdef, adapters, base = adapted_model(dtype)
    groups = [grpo_arrays(random_group([3, 5, 2, 7], seed=s, prompt_len=n, prompt_bucket=16, completion_bucket=8),
                          np.dtype(dtype), seed=s) for s, n in enumerate((11, 6))]
    outs = [_naive(graphdef, adapters, base, g, grpo_objective) for g in groups]
    want_grads = jax.tree_util.tree_map(jnp.add, outs[0][2], outs[1][2])
    logprobs = jax.jit(lambda a, b, x: forward(POLICY, lora.WithBase(graphdef, b), a, x))
    want_logp = [np.asarray(logprobs(adapters, base, g)) for g in groups]
    mesh = make_mesh(2, 2, 2)
    with jax.set_mesh(mesh):
      batch = shard_batch(stack_groups(pad_prompts(groups, 2)), mesh)
      placed_base, placed = shard_params(base, mesh, "fsdp"), shard_params(adapters, mesh, adapters_mode)
      assert jax.typeof(placed_base["layers"]["wq"][...]).sharding.spec != P()   # the base is split
      loss, _, grads = jax.jit(lambda a, b, x: value_and_grad(POLICY, lora.WithBase(graphdef, b), a, x, grpo_objective,
                                                              mesh=mesh))(placed, placed_base, batch)
      logp = jax.jit(lambda a, b, x: forward(POLICY, lora.WithBase(graphdef, b), a, x, mesh=mesh))(
          placed, placed_base, batch)
    assert float(loss) == pytest.approx(float(outs[0][0] + outs[1][0]), rel=tol)
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(adapters), "only adapters differentiated"
    assert max_rel_err(grads, want_grads) <= tol
    same = jax.tree_util.tree_map(lambda g, s: g.sharding.is_equivalent_to(NamedSharding(mesh, s), g.ndim), grads,
                                  param_specs(adapters, mesh, adapters_mode))
    assert all(jax.tree_util.tree_leaves(same))
    for i, want in enumerate(want_logp):
      assert max_rel_err(np.asarray(logp)[i], want) <= tol


@pytest.mark.heavy   # two 2-step runs (~3 min on loaded cores); CI: test_lora_on_the_fsdp_mesh_equals_naive[float32]
@pytest.mark.skipif(jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
def test_lora_mesh_run_trains_the_adapters_of_the_one_device_run(tmp_path, monkeypatch):
  # :lora_smoke (2 groups x G=4, 2 steps, rewards that vary) on one device and on 2 x 2 x 2 with the
  # base and the adapters FSDP-sharded, the run-time exactness check at step 2 (on a device copy
  # of the base): the same adapters to the mesh-run bound (1e-5 relative; only the order of sums
  # differs), the same rewards, and both checks pass.
  from conftest import final_params, length_score, max_rel
  from branch_replay_jax.rollout.tasks import Task
  monkeypatch.setattr(Task, "score", length_score)
  runs_ = {}
  for name, mesh in (("one", {}), ("mesh", {"mesh.data": 2, "mesh.branch": 2, "mesh.seq": 2, "mesh.params": "fsdp",
                                             "train.micro_batch": 2})):
    config = experiment_config(grpo_smollm2_arith, "lora_smoke", tmp_path / name,
                               **{"train.exactness_check_every": 2, **mesh})
    runs_[name] = (grpo.train(config), final_params(tmp_path / name)[0])
  (h1, p1), (h2, p2) = runs_["one"], runs_["mesh"]
  assert max_rel(p2, p1) <= 1e-5
  assert [r["reward_mean"] for r in h2] == [r["reward_mean"] for r in h1]
  assert h1[-1]["exactness_ok"] and h2[-1]["exactness_ok"]
