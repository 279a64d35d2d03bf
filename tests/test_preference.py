"""DPO/IPO on shared prompts: layout, two-pass replay gradient == naive gradient, the DPO loop end to end."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import experiment_config, length_score, max_rel_err, tiny_model

from branch_replay_jax.gradients import preference as pref
from branch_replay_jax import losses as obj


def _pairs(seed=0, vocab=64):
  """Four pairs on two prompts, ragged: prompt A (11 tokens) has 3 pairs sharing one rejected
  completion between two of them; prompt B (5 tokens) has 1 pair."""
  rng = np.random.default_rng(seed)
  ids = lambda n: rng.integers(0, vocab, n)
  a, b = ids(11), ids(5)
  shared = ids(4)
  return [pref.PreferencePair(a, ids(7), shared), pref.PreferencePair(b, ids(2), ids(9)),
          pref.PreferencePair(a, ids(1), shared), pref.PreferencePair(a, ids(5), ids(3))]


def test_make_batch_groups_by_prompt_and_dedupes_completions():
  batch = pref.make_batch(_pairs(), vocab_size=64, max_positions=256)
  # Prompt A: distinct completions y_w0 (7), shared (4), y_w2 (1), y_w3 (5), y_l3 (3) -> G = 5;
  # prompt B: y_w1 (2), y_l1 (9) -> G = 2. Flat branch ids: A's 0..4, then B's 5, 6.
  assert [a.branches.tokens.shape[0] for a in batch.groups] == [5, 2]
  np.testing.assert_array_equal(batch.chosen, [0, 5, 2, 3])
  np.testing.assert_array_equal(batch.rejected, [1, 6, 1, 4])
  # Naive: Σ_k 2 P_k + |y_w| + |y_l| = (22+7+4) + (10+2+9) + (22+1+4) + (22+5+3) = 111.
  # Replay: prompt A once + its 5 distinct completions (11 + 7+4+1+5+3 = 31), B: 5 + 2 + 9 = 16.
  assert batch.counts == {"token_positions_naive": 111, "token_positions_computed": 47}
  assert batch.naive.branches.tokens.shape == (4, 2, 16)   # T bucket of the longest (9) -> 16
  with pytest.raises(ValueError, match=r"pairs\[1\] has identical"):
    pref.make_batch([_pairs()[0], pref.PreferencePair([1, 2], [3], [3])], vocab_size=64, max_positions=256)


_naive = jax.jit(pref.naive_value_and_grad, static_argnums=(0,), static_argnames=("beta", "loss_type", "micro_batch"))
_naive_ref = jax.jit(pref.naive_ref_sums, static_argnums=(0,))
_setups = {}


def _setup(dtype):
  """Models, batch, replay steps and both layouts' reference sums, once per dtype (shared compiles)."""
  if dtype not in _setups:
    graphdef, params = tiny_model(dtype, dtype)
    _, ref_params = tiny_model(dtype, dtype, seed=1)   # a reference unlike the policy: margins far from 0
    batch = pref.make_batch(_pairs(), vocab_size=64, max_positions=256)
    steps = pref.ReplaySteps(graphdef, micro_batch=2)
    layout = steps.layout(batch)
    ref = steps.flat_sums(ref_params, layout)
    naive_ref = _naive_ref(graphdef, ref_params, batch.naive)
    # The two layouts' reference sums agree (the same sequences, scored by replay and by full sequences).
    np.testing.assert_allclose(np.stack([ref[batch.chosen], ref[batch.rejected]], 1), naive_ref,
                               rtol=1e-10 if dtype == jnp.float64 else 1e-5)
    _setups[dtype] = graphdef, params, batch, steps, ref, naive_ref
  return _setups[dtype]


def _both(dtype, loss_type, beta=0.1):
  graphdef, params, batch, steps, ref, naive_ref = _setup(dtype)
  replay = steps.value_and_grad(params, steps.layout(batch), ref, beta=beta, loss_type=loss_type)
  return replay, _naive(graphdef, params, batch.naive, naive_ref, beta=beta, loss_type=loss_type, micro_batch=2)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_float64_two_pass_replay_equals_naive(x64, loss_type):
  # The surrogate Σ_i c_i S_i has exactly the DPO loss's gradient (chain rule); only float
  # rounding order differs from differentiating the loss on full sequences: ~1e-15 in float64.
  (lr, mr, gr), (ln, mn, gn) = _both(jnp.float64, loss_type)
  assert max_rel_err(gr, gn) <= 1e-10
  assert abs(float(lr) - float(ln)) <= 1e-12 * max(1.0, abs(float(ln)))
  np.testing.assert_allclose(mr["margin"], mn["margin"], rtol=1e-10)
  # Not vacuous: the gradient is far from 0 and the pairs disagree in sign of the margin or not,
  # but the loss is the true DPO/IPO loss (> 0), not the surrogate's value.
  assert max(float(jnp.abs(x).max()) for x in jax.tree_util.tree_leaves(gn)) > 1e-3
  assert float(lr) > 0


# sigmoid is heavy (~1.5 min on loaded cores): its float64 test runs in CI, and ipo in float32.
@pytest.mark.parametrize("loss_type", [pytest.param("sigmoid", marks=pytest.mark.heavy), "ipo"])
def test_float32_two_pass_replay_equals_naive(loss_type):
  (lr, _, gr), (ln, _, gn) = _both(jnp.float32, loss_type)
  assert max_rel_err(gr, gn) <= 1e-4
  assert abs(float(lr) - float(ln)) <= 1e-5 * max(1.0, abs(float(ln)))
  assert max(float(jnp.abs(x).max()) for x in jax.tree_util.tree_leaves(gn)) > 1e-3


def test_one_program_dpo_step_updates_as_the_two_pass_gradient_and_the_naive_step(x64):
  # make_preference_step runs the reference sums, the gradient and the update in ONE program. With
  # plain SGD (lr 0.5) the new parameters are params - 0.5 dL/dθ, so the replay step's and the naive
  # step's must equal params - 0.5 x the two-pass gradient of `_both` to float64 rounding (<= 1e-10
  # relative on the change), with the same loss; two steps of one shape compile one program.
  from branch_replay_jax.gradients.step import compiled_programs
  graphdef, params, batch, steps, ref, _ = _setup(jnp.float64)
  _, ref_params = tiny_model(jnp.float64, jnp.float64, seed=1)
  (want_loss, _, grads), _ = _both(jnp.float64, "sigmoid")
  want = jax.tree_util.tree_map(lambda p, g: p - 0.5 * g, params, grads)
  tx = optax.sgd(0.5)
  copy = lambda t: jax.tree_util.tree_map(jnp.array, t)   # the step donates params and opt_state
  for layout in ("replay", "naive"):
    step = pref.make_preference_step(graphdef, tx, beta=0.1, layout=layout, micro_batch=2)
    new, state, out = step(copy(params), ref_params, tx.init(params), batch)
    change = jax.tree_util.tree_map(jnp.subtract, new, params)
    assert max_rel_err(change, jax.tree_util.tree_map(jnp.subtract, want, params)) <= 1e-10, layout
    assert float(out["loss"]) == pytest.approx(float(want_loss), rel=1e-12), layout
    assert float(out["grad_norm"]) == pytest.approx(float(optax.tree.norm(grads)), rel=1e-10), layout
    step(new, ref_params, state, batch)
    assert compiled_programs(step.program) == 1, layout
  with pytest.raises(ValueError, match="layout='naive' runs on one device"):
    pref.make_preference_step(graphdef, tx, beta=0.1, layout="naive", mesh=object())


# ---- IPO on means and conservative DPO: exact under the two-pass replay -------------------------------

_naive_pref = jax.jit(pref.naive_value_and_grad, static_argnums=(0,),
                      static_argnames=("beta", "loss_type", "label_smoothing", "micro_batch"))


@pytest.mark.parametrize("loss_type,label_smoothing", [
    # ipo and sigmoid are heavy (~25 s and ~1.5 min on loaded cores): IPO's mean is exact in CI through
    # test_float32_two_pass_replay_equals_naive[ipo], the sigmoid loss through
    # test_float64_two_pass_replay_equals_naive[sigmoid].
    pytest.param("ipo", 0.0, marks=pytest.mark.heavy), ("ipo_sum", 0.0),
    pytest.param("sigmoid", 0.1, marks=pytest.mark.heavy)])
def test_ipo_mean_and_label_smoothing_are_exact_under_two_pass_replay(x64, loss_type, label_smoothing):
  # The two-pass replay (sums, then the linear surrogate with c_i = dL/dS_i) and differentiating
  # the loss on full sequences must agree to float64 rounding (~1e-15): IPO's mean is a sum over a
  # constant length, label smoothing a function of the same sums.
  graphdef, params = tiny_model(jnp.float64, jnp.float64)
  _, ref_params = tiny_model(jnp.float64, jnp.float64, seed=1)
  batch = pref.make_batch(_pairs(), vocab_size=64, max_positions=256)
  steps = pref.ReplaySteps(graphdef, micro_batch=2)
  layout = steps.layout(batch)
  ref = steps.flat_sums(ref_params, layout)
  naive_ref = pref.naive_ref_sums(graphdef, ref_params, batch.naive)
  kw = dict(beta=0.1, loss_type=loss_type, label_smoothing=label_smoothing)
  lr, mr, gr = steps.value_and_grad(params, layout, ref, **kw)
  ln, mn, gn = _naive_pref(graphdef, params, batch.naive, naive_ref, micro_batch=2, **kw)
  assert max_rel_err(gr, gn) <= 1e-10
  assert abs(float(lr) - float(ln)) <= 1e-12 * max(1.0, abs(float(ln)))
  assert max(float(jnp.abs(x).max()) for x in jax.tree_util.tree_leaves(gn)) > 1e-3
  # The loss is the one the formula gives on the pairs' sums and lengths (not the surrogate's value).
  sums = steps.flat_sums(params, layout)
  lengths = np.concatenate([np.asarray(a.branches.mask).sum(-1) for a in batch.groups])
  c, r = batch.chosen, batch.rejected
  want = obj.dpo_loss(sums[c], sums[r], ref[c], ref[r], chosen_lengths=lengths[c], rejected_lengths=lengths[r],
                      **kw)[0].mean()
  assert float(lr) == pytest.approx(float(want), rel=1e-12)


# ---- the experiments through main's dispatch ------------------------------------------------------

import importlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402

from conftest import final_params, max_rel  # noqa: E402

from branch_replay_jax import main as entry  # noqa: E402
from branch_replay_jax.algorithms import dpo  # noqa: E402
from branch_replay_jax.rollout.tasks import Task  # noqa: E402
from experiments import dpo_smollm2_arith, rloo_smollm2_arith  # noqa: E402

DPO_KEYS = {"step", "pairs", "skipped_prompts", "loss", "chosen_reward", "rejected_reward", "reward_margin",
            "reward_accuracy", "grad_norm", "token_positions_naive", "token_positions_computed", "update_s", "step_s"}


@pytest.fixture(autouse=True, scope="module")
def varied_rewards():
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(Task, "score", length_score)   # see test_train: a random model's rewards would all be equal
    yield


_config = experiment_config


def _run(config):
  return importlib.import_module(entry.TRAINERS[config.get("algorithm", "grpo")]).train(config)


@pytest.mark.slow
def test_dpo_smoke_pairs_sampled_from_the_task(tmp_path):
  history = _run(_config(dpo_smollm2_arith, "smoke", tmp_path))
  assert entry.TRAINERS["dpo"] == "branch_replay_jax.algorithms.dpo"
  assert [r["step"] for r in history] == [1, 2]
  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert len(records) == 2 and DPO_KEYS | {"reward_mean", "accuracy"} <= set(records[0])
  # 2 prompts per step: each gives a pair unless its G = 4 rewards are all equal (then skipped).
  assert all(r["pairs"] + r["skipped_prompts"] == 2 for r in records) and sum(r["pairs"] for r in records) > 0
  # Step 1: policy == reference, so every margin is 0 and the sigmoid loss is -log σ(0) = log 2.
  first = next(r for r in records if r["pairs"])
  if first["step"] == 1:
    assert abs(first["loss"] - np.log(2)) < 1e-6 and first["reward_margin"] == 0.0
  assert first["token_positions_naive"] > first["token_positions_computed"]   # each prompt once, not twice
  _, meta = final_params(tmp_path)
  assert meta == {"step": 2, "data_pos": 4}
  for name in ("preference.png", "throughput.png", "samples.jsonl", "experiment.json"):
    assert os.path.exists(tmp_path / name), name


@pytest.mark.slow
@pytest.mark.heavy   # minutes on 2 cores; `make test-all` runs it, CI does not
def test_dpo_jsonl_smoke_replay_equals_resumed_naive(tmp_path):
  # The example file through the loop: 4 pairs per step, two of them sharing a prompt in step 1
  # (lines 2 and 3). Replay and naive compute the same gradient, and a run stopped after step 1 and
  # resumed continues from the checkpointed data position, so replay for 2 steps and naive for
  # 1 + 1 resumed step reach the same parameters up to float32 noise through Adam (test_train's bound).
  history = _run(_config(dpo_smollm2_arith, "jsonl_smoke", tmp_path / "replay"))
  assert [r["pairs"] for r in history] == [4, 4]
  assert history[0]["loss"] == pytest.approx(np.log(2), abs=1e-6)   # policy == reference: -log σ(0)
  assert history[1]["reward_margin"] != 0.0                          # the policy moved away from the reference
  naive = _config(dpo_smollm2_arith, "jsonl_smoke", tmp_path / "naive", **{"train.gradient": "naive"})
  naive.train.steps = 1
  _run(naive)
  naive.train.steps, naive.resume = 2, True
  assert [r["step"] for r in _run(naive)] == [2]
  (want, meta), (got, _) = final_params(tmp_path / "replay"), final_params(tmp_path / "naive")
  assert meta == {"step": 2, "data_pos": 8}
  assert max_rel(got, want) <= 1e-5


@pytest.mark.slow
def test_rloo_smoke_run(tmp_path):
  config = _config(rloo_smollm2_arith, "smoke", tmp_path)
  assert config.loss.advantage == "rloo"
  history = _run(config)
  assert [r["step"] for r in history] == [1, 2] and all(np.isfinite(r["loss"]) for r in history)
  assert final_params(tmp_path)[1] == {"step": 2, "data_pos": 4}


@pytest.mark.parametrize("module,variant,field,value,match", [
    (dpo_smollm2_arith, "smoke", "dpo.loss", "hinge", "dpo.loss='hinge'"),
    (dpo_smollm2_arith, "smoke", "dpo.beta", 0.0, "dpo.beta=0.0"),
    (dpo_smollm2_arith, "smoke", "data.source", "hub", "data.source='hub'"),
    (dpo_smollm2_arith, "smoke", "rollout.group_size", 1, "rollout.group_size=1"),
    (dpo_smollm2_arith, "jsonl_smoke", "data.pairs_per_step", 0, "data.pairs_per_step=0"),
    (dpo_smollm2_arith, "jsonl_smoke", "data.path", "/nonexistent.jsonl", "/nonexistent.jsonl"),
    (rloo_smollm2_arith, "smoke", "loss.advantage", "vanilla", "loss.advantage='vanilla'"),
])
def test_bad_config_fails_before_any_compute(tmp_path, module, variant, field, value, match):
  with pytest.raises(ValueError, match=match):
    _run(_config(module, variant, tmp_path, **{field: value}))
  assert not os.path.exists(tmp_path / "checkpoints")


@pytest.mark.parametrize("line,match", [
    ('{"prompt": "q", "chosen": "a"}', "line 2: field 'rejected' must be a non-empty string"),
    ('{"prompt": "", "chosen": "a", "rejected": "b"}', "line 2: field 'prompt'"),
    ('{"prompt": "q", "chosen": 3, "rejected": "b"}', "line 2: field 'chosen'"),
    ('{"prompt": "q", "chosen": "a", "rejected": "a"}', "line 2: field 'rejected' equals"),
    ('["q", "a", "b"]', "line 2: expected a JSON object"),
    ('{"prompt": "q",', "line 2: not valid JSON"),
])
def test_jsonl_lines_are_validated(tmp_path, line, match):
  path = tmp_path / "pairs.jsonl"
  path.write_text('{"prompt": "q", "chosen": "a", "rejected": "b"}\n' + line + "\n")
  with pytest.raises(ValueError, match=match):
    dpo.read_pairs_jsonl(str(path))


def test_example_jsonl_file_is_valid():
  # The shipped example: 8 pairs, every chosen answer right and every rejected one wrong.
  records = dpo.read_pairs_jsonl(dpo_smollm2_arith.get_config("jsonl").data.path)
  assert len(records) == 8
  assert records[1]["prompt"] == records[2]["prompt"]   # a prompt shared by two pairs


def test_dpo_label_smoothing_reaches_the_replay_and_the_naive_step(tmp_path):
  # One pair, a reference unlike the policy and β = 50 (margin m = β h far from 0). Conservative DPO with ε:
  # loss = -(1 - ε) log σ(m) - ε log σ(-m) (losses.dpo_loss); both layouts must compute it with
  # the configured ε = 0.1, not plain DPO's -log σ(m).
  graphdef, params = tiny_model()
  _, ref_params = tiny_model(seed=1)
  rng = np.random.default_rng(0)
  batch = pref.make_batch([pref.PreferencePair(rng.integers(0, 64, 9), rng.integers(0, 64, 5),
                                               rng.integers(0, 64, 3))], vocab_size=64, max_positions=256)
  for gradient in ("replay", "naive"):
    config = experiment_config(dpo_smollm2_arith, "jsonl_smoke", tmp_path,
                               **{"dpo.label_smoothing": 0.1, "dpo.beta": 50.0, "train.gradient": gradient,
                                  "train.micro_batch": 1})
    dpo.validate(config)
    tx = optax.sgd(0.0)
    fns = dpo.DPOFunctions(config, graphdef, tx)
    _, _, stats = fns.step(jax.tree_util.tree_map(jnp.array, params), ref_params, tx.init(params), batch)
    m = stats["reward_margin"]
    assert abs(m) > 0.02
    want = -(0.9 * np.log(jax.nn.sigmoid(m)) + 0.1 * np.log(jax.nn.sigmoid(-m)))
    np.testing.assert_allclose(stats["loss"], want, rtol=1e-5, err_msg=gradient)
    assert abs(stats["loss"] + np.log(jax.nn.sigmoid(m))) > 1e-3   # differs from plain DPO by ε m
