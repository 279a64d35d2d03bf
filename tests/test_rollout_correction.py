"""Importance correction against the sampler (loss.rollout_correction, branch_replay_jax/correction.py):
the factors of TIS, MIS and IcePop by hand; the corrected loss and gradient against a float64 hand
computation of the off-policy objective; a tree, its packed row and its naive rows give the same loss,
gradient and correction metrics; the config's refusals."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import max_rel_err, tiny_model

from branch_replay_jax import losses as obj
from branch_replay_jax.algorithms import grpo
from branch_replay_jax.correction import Correction, correct, factor
from branch_replay_jax.data.batches import pack_trees, trajectory_group_arrays, tree_arrays
from branch_replay_jax.data.episodes import Episode, episode_group_arrays, episode_tree, episode_tree_arrays, merge_short
from branch_replay_jax.data.trees import pad_tree, tree_from_trajectories
from branch_replay_jax.gradients.heads import POLICY
from branch_replay_jax.gradients.step import forward, value_and_grad

# Off-policy, a KL term and a clip that binds: every term of the objective is live.
BETA, EPS = 0.05, 0.2
_objective = functools.partial(obj.grpo_objective, clip_eps=EPS, kl_coef=BETA, on_policy=False)
_step = {layout: jax.jit(functools.partial(value_and_grad, POLICY, layout=layout), static_argnums=(0, 3))
         for layout in ("replay", "naive")}
CORRECTIONS = [Correction("tis", cap=1.5), Correction("tis", "sequence", cap=1.5), Correction("mis", cap=1.5),
               Correction("mis", "sequence", cap=1.2), Correction("icepop", cap=1.5, floor=0.7)]
_id = lambda c: f"{c.mode}-{c.level}"


def test_factors_of_each_mode_on_hand_ratios():
  # rho = 0.4, 0.8, 1, 1.5, 3 and an overflowed sequence ratio (inf). C = 2: TIS truncates at 2; MIS keeps
  # [1/2, 2], so 0.4, 3 and inf are masked to 0; IcePop with floor 0.3 keeps 0.4 too.
  rho = np.array([0.4, 0.8, 1.0, 1.5, 3.0, np.inf])
  lr = jnp.asarray(np.log(rho))
  c, masked = factor(lr, Correction("tis", cap=2.0))
  np.testing.assert_allclose(c, [0.4, 0.8, 1.0, 1.5, 2.0, 2.0], rtol=1e-6)
  assert not np.asarray(masked).any()
  c, masked = factor(lr, Correction("mis", cap=2.0))
  np.testing.assert_allclose(c, [0.0, 0.8, 1.0, 1.5, 0.0, 0.0], rtol=1e-6)
  assert np.asarray(masked).tolist() == [True, False, False, False, True, True]
  c, masked = factor(lr, Correction("icepop", cap=2.0, floor=0.3))
  np.testing.assert_allclose(c, [0.4, 0.8, 1.0, 1.5, 0.0, 0.0], rtol=1e-6)
  assert np.asarray(masked).tolist() == [False, False, False, False, True, True]


# Three levels, a middle node shared by two trajectories, a trajectory ending at depth 1, one of four
# trajectories left out of the loss (weight 0: loss.mask_truncated's case).
TREE = tree_from_trajectories([5, 6, 7, 8], [[1, 2, 3, 4], [1, 2, 9], [1, 2, 9, 10, 11], [12, 13]])
IN_LOSS = np.array([True, True, True, False])


def _inputs(dtype):
  """Per node: the trainer's old log-probs, the sampler's (off by up to ±0.6 nats, so ratios fall on both
  sides of every window), the reference's; per trajectory: advantages and constant-weighting weights."""
  rng = np.random.default_rng(3)
  old = [(-4.0 + 0.3 * rng.normal(size=len(s))).astype(dtype) for s in TREE.segments]
  sampler = [(o + rng.uniform(-0.6, 0.6, size=len(o))).astype(dtype) for o in old]
  ref = [(-4.0 + 0.3 * rng.normal(size=len(s))).astype(dtype) for s in TREE.segments]
  adv = rng.normal(size=len(TREE.ends)).astype(dtype)
  w = obj.trajectory_weights(TREE.completion_lengths(), mode="constant", max_length=8, in_loss=IN_LOSS).astype(dtype)
  return old, sampler, ref, adv, w


def _layouts(dtype):
  old, sampler, ref, adv, w = _inputs(dtype)
  per_node = {"old_logp": old, "sampler_logp": sampler, "ref_logp": ref}
  tree = tree_arrays(pad_tree(TREE), {**per_node, "weights": [x.astype(dtype) for x in TREE.node_weights(w)]},
                     advantage=adv)
  naive = trajectory_group_arrays(TREE, per_node, w, vocab_size=64, max_positions=256, completion_bucket=8,
                                  advantage=adv)
  return {"tree": tree, "packed": pack_trees([tree])[0], "naive": naive}


def _hand(correction, logp_rows, dtype):
  """The corrected objective by hand from each trajectory's path: its loss and the correction's metrics,
  numpy float64, the step's formula written out (losses.grpo_token_loss, correction.py's table)."""
  old, sampler, ref, adv, w = _inputs(dtype)
  loss, pairs, ratios, masked, diffs = 0.0, 0, [], 0, 0.0
  for g in range(len(TREE.ends)):
    path = TREE.path(TREE.ends[g])[1:]   # nodes below the prompt
    o, s, r = (np.concatenate([x[n] for n in path]).astype(np.float64) for x in (old, sampler, ref))
    if not IN_LOSS[g]:
      continue
    lp = logp_rows[g, :len(o)]
    d = o - s
    rho = np.exp(d) if correction.level == "token" else np.full(len(o), np.exp(d.sum()))
    if correction.mode == "tis":
      c, out = np.minimum(rho, correction.cap), np.zeros(len(o), bool)
    else:
      low = 1 / correction.cap if correction.mode == "mis" else correction.floor
      out = (rho < low) | (rho > correction.cap)
      c = np.where(out, 0.0, rho)
    ratio = np.exp(lp - o)
    surrogate = np.minimum(ratio * adv[g], np.clip(ratio, 1 - EPS, 1 + EPS) * adv[g])
    k3 = np.exp(r - lp) - (r - lp) - 1
    loss += float(w[g]) * np.sum(-c * surrogate + BETA * k3)
    pairs, masked, diffs = pairs + len(o), masked + out.sum(), diffs + np.abs(d).sum()
    ratios.extend(rho)
  return loss, {"is_ratio_mean": np.mean(ratios), "is_ratio_max": np.max(ratios), "is_masked_frac": masked / pairs,
                "sampler_logp_diff_mean": diffs / pairs}


@pytest.mark.parametrize("correction", CORRECTIONS, ids=_id)
def test_a_corrected_tree_packed_row_and_naive_rows_equal_the_hand_objective_float64(correction, x64):
  # float64: loss and correction metrics within 1e-12 of the hand computation in every layout, and the
  # gradients of the three layouts within 1e-10 of each other (the order of float sums).
  graphdef, params = tiny_model(jnp.float64, jnp.float64)
  batches = _layouts(np.float64)
  logp_rows = np.asarray(jax.jit(lambda p, b: forward(POLICY, graphdef, p, b, layout="naive"))(params, batches["naive"]))
  want_loss, want_metrics = _hand(correction, logp_rows, np.float64)
  grads = {}
  for name, batch in batches.items():
    corrected, metrics = jax.jit(functools.partial(correct, correction=correction))(batch)
    for k, v in want_metrics.items():
      assert float(metrics[k]) == pytest.approx(v, rel=1e-12), (name, k)
    loss, _, grads[name] = _step["naive" if name == "naive" else "replay"](graphdef, params, corrected, _objective)
    assert float(loss) == pytest.approx(want_loss, rel=1e-12), name
  assert max_rel_err(grads["tree"], grads["naive"]) <= 1e-10 and max_rel_err(grads["packed"], grads["naive"]) <= 1e-10
  # The window binds: some pair truncated or masked (the hand inputs span both sides of each window).
  assert want_metrics["is_ratio_max"] > correction.cap or want_metrics["is_masked_frac"] > 0


def test_the_correction_moves_the_gradient_and_float32_holds_the_tree_bound():
  # float32 packed tree against naive rows (1e-5 loss, 1e-4 gradient: the tree tests' bounds), and TIS changes
  # the gradient by more than that bound: a correction the step ignored would fail here.
  graphdef, params = tiny_model()
  batches = _layouts(np.float32)
  tis = jax.jit(functools.partial(correct, correction=Correction("tis", "sequence", cap=1.5)))
  (lt, _, gt), (ln, _, gn) = (_step[layout](graphdef, params, tis(batches[name])[0], _objective)
                              for name, layout in (("packed", "replay"), ("naive", "naive")))
  assert abs(float(lt) - float(ln)) <= 1e-5 * max(1.0, abs(float(ln)))
  assert max_rel_err(gt, gn, floor=1e-5) <= 1e-4
  _, _, plain = _step["naive"](graphdef, params, batches["naive"], _objective)
  assert max_rel_err(gn, plain) > 1e-2


def test_the_metrics_alone_leave_the_loss_untouched():
  # Mode "none" (what train.inner_epochs > 1 logs): the metrics are computed, rollout_is stays None, so the
  # step's loss is the uncorrected one bit for bit.
  batch = _layouts(np.float32)["naive"]
  corrected, metrics = correct(batch, Correction("none"))
  assert corrected.branches.rollout_is is None and float(metrics["is_masked_frac"]) == 0.0
  assert float(metrics["sampler_logp_diff_mean"]) > 0.1
  with pytest.raises(ValueError, match="needs old_logp"):
    correct(batch.replace(levels=(batch.branches.replace(sampler_logp=None),)), Correction("tis"))


@pytest.mark.parametrize("overrides, match", [
    ({"loss.rollout_correction": "is"}, "loss.rollout_correction='is' is not one of"),
    ({"loss.rollout_correction": "tis", "loss.rollout_correction_level": "trajectory"},
     "loss.rollout_correction_level='trajectory'"),
    ({"loss.rollout_correction": "tis", "loss.rollout_is_cap": 1.0}, r"loss.rollout_is_cap=1.0 must be a finite float > 1"),
    ({"loss.rollout_correction": "icepop", "loss.rollout_is_floor": 1.5}, r"loss.rollout_is_floor=1.5 must be"),
    ({"loss.rollout_correction": "icepop", "loss.rollout_correction_level": "sequence"}, "IcePop masks tokens"),
    # A field the mode does not read is refused, not ignored.
    ({"loss.rollout_is_cap": 3.0}, "loss.rollout_is_cap=3.0 is not read with loss.rollout_correction='none'"),
    ({"loss.rollout_correction": "tis", "loss.rollout_is_floor": 0.2}, "loss.rollout_is_floor=0.2 is not read"),
])
def test_a_bad_correction_is_refused_by_name(overrides, match):
  from experiments import grpo_smollm2_arith
  config = grpo_smollm2_arith.get_config("smoke")
  for dotted, value in overrides.items():
    section, name = dotted.split(".")
    config[section][name] = value
  with pytest.raises(ValueError, match=match):
    grpo.validate(config)


def test_an_episode_tree_takes_each_turns_sampler_logprobs_and_logs_as_its_rows(x64):
  # Three episodes of one prompt: two share their first turn and its observation (the same sampled ids),
  # then part; observations weigh 0. The sampler's log-probs of each model turn go on its tokens
  # (Episode.model_values); a shared node takes the first episode's (EpisodeTree.node_values). TIS at
  # sequence level: the episode tree and its rows give the same correction figures and loss (float64).
  prompt = np.array([1, 2, 3])
  turn, obs = np.array([4, 5, 6]), np.array([7, 8])
  episodes = [Episode(prompt, (turn, obs, np.array([9, 10])), ("model", "observation", "model")),
              Episode(prompt, (turn, obs, np.array([11])), ("model", "observation", "model")),
              Episode(prompt, (np.array([12, 13]),), ("model",))]
  rng = np.random.default_rng(0)
  first = -4.0 + 0.3 * rng.normal(size=3)
  turns = [[first, -4.0 + 0.3 * rng.normal(size=2)], [first, -4.0 + 0.3 * rng.normal(size=1)],
           [-4.0 + 0.3 * rng.normal(size=2)]]
  sampler = [e.model_values(t) for e, t in zip(episodes, turns)]
  assert sampler[0].tolist()[3:5] == [0.0, 0.0] and sampler[0][:3].tolist() == list(np.float32(first))
  tree = merge_short(episode_tree(episodes), 1)
  sampler_nodes = tree.node_values([x.astype(np.float64) for x in sampler])
  # The trainer's old log-probs, off the sampler's: one per token of the tree (a shared token has one).
  old_nodes = [x + rng.uniform(-0.5, 0.5, size=x.shape) * (x != 0) for x in sampler_nodes]
  adv, w = np.array([1.0, -0.5, -0.5]), np.full(3, 0.25)
  kw = dict(vocab_size=64, max_positions=64)
  per_node = {"sampler_logp": sampler_nodes, "old_logp": old_nodes, "ref_logp": sampler_nodes}
  rows = episode_group_arrays(episodes, adv, w, per_episode={k: tree.along(v) for k, v in per_node.items()}, **kw)
  nodes = episode_tree_arrays(tree, adv, w, per_node=per_node, **kw)
  np.testing.assert_array_equal(np.concatenate(tree.along(sampler_nodes)), np.concatenate(sampler))
  shared = [n for n in range(1, tree.tree.num_nodes) if tree.tree.membership()[n].sum() == 2]
  assert shared, "the first turn and its observation are one node of two episodes"
  correction = Correction("tis", "sequence", cap=1.2)
  (rows_c, rows_m), (nodes_c, nodes_m) = correct(rows, correction), correct(nodes, correction)
  for k in rows_m:
    assert float(nodes_m[k]) == pytest.approx(float(rows_m[k]), rel=1e-12), k
  graphdef, params = tiny_model(jnp.float64, jnp.float64)
  ln, _, gn = _step["naive"](graphdef, params, rows_c, _objective)
  lt, _, gt = _step["replay"](graphdef, params, nodes_c, _objective)
  assert float(lt) == pytest.approx(float(ln), rel=1e-12) and max_rel_err(gt, gn) <= 1e-10
  with pytest.raises(ValueError, match="2 turns of values for 1 model segments"):
    episodes[2].model_values(turns[0])


@pytest.mark.heavy   # two smoke runs, ~2 min on 2 cores. CI covers the pieces: `correct` on every layout above
#                      (the mesh step jits the same function on the sharded batch) and the loop's correction
#                      in tests/test_exactness_check.py::test_a_naive_run_with_a_sampler_correction_checks_against_replay.
@pytest.mark.skipif(jax.device_count() < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
def test_a_corrected_run_on_a_mesh_trains_and_logs_as_one_device(tmp_path, monkeypatch):
  # TIS at sequence level against a sampler off by δ = 0.25 (token % 5 - 2) nats, on a 2x2x2 FSDP mesh and
  # on one device: the same correction figures and loss (float32 sums in another order) and parameters.
  import json
  import os
  from conftest import final_params, grpo_smoke, max_rel, offset_sampler_logprobs
  offset_sampler_logprobs(monkeypatch)
  options = {"loss.rollout_correction": "tis", "loss.rollout_correction_level": "sequence", "loss.rollout_is_cap": 1.5}
  mesh = {"mesh.data": 2, "mesh.branch": 2, "mesh.seq": 2, "mesh.params": "fsdp"}
  grpo.train(grpo_smoke(tmp_path / "one", **options))
  grpo.train(grpo_smoke(tmp_path / "mesh", **options, **mesh))
  records = {}
  for name in ("one", "mesh"):
    with open(os.path.join(tmp_path, name, "metrics.jsonl")) as f:
      records[name] = [json.loads(line) for line in f]
  for got, want in zip(records["mesh"], records["one"]):
    assert got["is_ratio_max"] > 1.0 and got["sampler_logp_diff_mean"] > 0.05
    for k in ("is_ratio_mean", "is_ratio_max", "is_masked_frac", "sampler_logp_diff_mean", "loss"):
      assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-7), k
  # Parameters: Adam's normalised step moves an entry whose gradient is rounding noise by up to lr = 1e-5
  # either way per step, so two steps can part such an entry of a norm scale (~1) by 4e-5 (measured 1.9e-5).
  assert max_rel(final_params(tmp_path / "mesh")[0], final_params(tmp_path / "one")[0]) <= 4e-5


def test_at_a_sampling_temperature_the_sampler_and_trainer_logprobs_agree_on_policy(tmp_path):
  # rollout.temperature 0.7 with loss.logprob_temperature = "sampling": the trainer scores softmax(logits / 0.7),
  # and the loop has the sampler record its log-probs at the same τ (groups.logprob_temperature). On policy
  # (max_staleness 0, inner_epochs 1) the two then differ by float32 rounding of two programs (KV-cache decode
  # against the replay step): |Δ| well under 1e-3 nats, ratios within 1e-3 of 1. A sampler recording untempered
  # log-probs here gives a mean |Δ| of 0.045 nats (measured by passing τ = 1 to the sampler), and its ratios
  # move on-policy tokens.
  import json
  from conftest import grpo_smoke
  grpo.train(grpo_smoke(tmp_path, **{"rollout.temperature": 0.7, "loss.logprob_temperature": "sampling",
                                     "loss.rollout_correction": "tis", "loss.rollout_is_cap": 2.0}))
  with open(tmp_path / "metrics.jsonl") as f:
    records = [json.loads(line) for line in f]
  assert len(records) >= 1
  for r in records:
    assert r["sampler_logp_diff_mean"] < 1e-3, r["sampler_logp_diff_mean"]
    assert abs(r["is_ratio_max"] - 1.0) < 1e-3 and r["is_masked_frac"] == 0.0


def test_ppo_weighs_its_clipped_policy_term_by_the_correction_and_leaves_the_value_loss(x64):
  # loss.rollout_correction in PPO (AReaL's decoupled PPO): ℓ = c_t ℓ_clip + c_v ℓ_V. Hand data in float64,
  # a tree node [T, G = 2] and its two trajectories as completions, clipped and unclipped tokens: the node's
  # loss and gradient (in logp and in the values) equal the rows' sums; the policy part equals c times the
  # uncorrected one token by token, and the value part (regression on returns, whatever policy sampled)
  # does not move. A factor applied to the value loss, dropped, or broadcast across the wrong axis fails it.
  from branch_replay_jax.data.batches import Segments
  logp = jnp.log(jnp.array([0.5, 0.2, 0.9, 0.3]))
  old = jnp.log(jnp.array([0.3, 0.4, 0.5, 0.3]))
  mask = jnp.array([True, True, True, False])
  w = jnp.array([[0.25, 0.1], [0.25, 0.1], [0.0, 0.1], [0.0, 0.0]])
  adv = jnp.array([[1.0, -0.5], [0.5, -1.0], [2.0, 0.3], [0.0, 0.0]])
  ret = jnp.array([[0.3, -0.2], [0.1, 0.4], [0.0, 0.5], [0.0, 0.0]])
  c = jnp.array([[0.5, 1.5], [1.0, 2.0], [0.0, 0.7], [0.0, 0.0]])   # per (token, trajectory) pair
  values, old_values = jnp.array([0.1, 0.4, -0.2, 0.0]), jnp.array([0.0, 0.5, 0.1, 0.0])
  kw = dict(clip_eps=0.2, vf_coef=0.5, value_clip=0.2)
  node = Segments(jnp.zeros(4, jnp.int32), mask, weights=w, advantage=adv, returns=ret, old_logp=old,
                  old_values=old_values, rollout_is=c)
  rows = [node.replace(weights=w[:, g], advantage=adv[:, g], returns=ret[:, g], rollout_is=c[:, g]) for g in range(2)]
  grads = lambda seg: jax.grad(lambda lp, v: obj.ppo_objective(lp, v, seg, **kw)[0], argnums=(0, 1))(logp, values)
  node_loss, node_aux = obj.ppo_objective(logp, values, node, **kw)
  row_out = [obj.ppo_objective(logp, values, r, **kw) for r in rows]
  np.testing.assert_allclose(node_loss, sum(l for l, _ in row_out), rtol=1e-14)
  for got, want in zip(grads(node), map(sum, zip(*(grads(r) for r in rows)))):
    np.testing.assert_allclose(got, want, rtol=1e-13)
  plain = node.replace(rollout_is=None)
  ratio = np.exp(np.asarray(logp - old))[:, None]
  a = np.asarray(adv)
  want_policy = -np.minimum(ratio * a, np.clip(ratio, 0.8, 1.2) * a)   # arXiv 1707.06347 eq. 7, by hand
  assert 0 < int(obj.ppo_objective(logp, values, plain, **kw)[1]["clipped"]) < 6   # both cases present
  np.testing.assert_allclose(node_aux["policy"], np.sum(np.asarray(w) * np.asarray(c) * want_policy), rtol=1e-13)
  np.testing.assert_allclose(node_aux["value"], obj.ppo_objective(logp, values, plain, **kw)[1]["value"], rtol=1e-14)
  assert abs(float(node_aux["policy"]) - float(obj.ppo_objective(logp, values, plain, **kw)[1]["policy"])) > 1e-3
