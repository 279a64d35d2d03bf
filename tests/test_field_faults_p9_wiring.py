import functools
"""P9 field faults (round 2), the wiring into the training loop: config fields reach the pure
functions (DPO label smoothing, task.strict_answer, GAE truncation), every config field's domain is
checked before anything loads, resumed runs cut every log back, truncated safetensors are named.

Each test states the right value and why.
"""

import json
import os
import re

import jax
import numpy as np
import pytest

from branch_replay_jax import losses as obj
from branch_replay_jax.algorithms import dpo, grpo, loop, ppo
from branch_replay_jax.data.batches import GroupBatch, Segments, tree_arrays
from branch_replay_jax.models import hf_loader
from branch_replay_jax.rollout.tasks import Score, Task
from conftest import experiment_config
from experiments import dpo_smollm2_arith, grpo_smollm2_arith, grpo_tree_smollm2_arith, ppo_smollm2_arith
from branch_replay_jax.gradients.heads import ACTOR_CRITIC, LogprobsValues
from branch_replay_jax.gradients.step import forward


def _no_model_load(monkeypatch):
  """Any model or tokenizer load fails loudly: a check that runs first never reaches it."""
  def refuse(*args, **kwargs):
    raise AssertionError("the model loaded before the config was checked")
  monkeypatch.setattr(loop, "build_model", refuse)
  from branch_replay_jax.models import loading
  monkeypatch.setattr(loading, "load", refuse)
  monkeypatch.setattr(loading, "load_tokenizer", refuse)


# ---- 11. every field's domain, checked before anything loads --------------------------------------

# (experiment, variant, field, bad value, text the error must contain: the field and the value)
BAD_FIELDS = [
    (grpo_smollm2_arith, "", "train.learning_rate", -1.0, "train.learning_rate=-1.0"),
    (grpo_smollm2_arith, "", "train.learning_rate", 0.0, "train.learning_rate=0.0"),
    (grpo_smollm2_arith, "", "model.dtype", "float16", "model.dtype='float16'"),
    (grpo_smollm2_arith, "", "model.remat", "some", "model.remat='some'"),
    (grpo_smollm2_arith, "", "model.attention_impl", "cuda", "model.attention_impl='cuda'"),
    (grpo_smollm2_arith, "", "rollout.temperature", -0.5, "rollout.temperature=-0.5"),
    (grpo_smollm2_arith, "", "rollout.temperature", 0.0, "rollout.temperature=0.0"),
    (grpo_smollm2_arith, "", "rollout.top_p", 0.0, "rollout.top_p=0.0"),
    (grpo_smollm2_arith, "", "rollout.top_p", 1.5, "rollout.top_p=1.5"),
    # SmolLM2-135M's context is 8192 tokens (its GGUF header): a budget of 8192 leaves no prompt.
    (grpo_smollm2_arith, "", "rollout.max_new_tokens", 8192, "rollout.max_new_tokens=8192"),
    (grpo_smollm2_arith, "smoke", "rollout.max_new_tokens", 4096, "rollout.max_new_tokens=4096"),
    (grpo_tree_smollm2_arith, "", "rollout.segment_length", 5000, "rollout.segment_length=5000 x depth"),
    (grpo_smollm2_arith, "", "loss.kl_coef", -0.1, "loss.kl_coef=-0.1"),
    (grpo_smollm2_arith, "", "train.weight_decay", -0.01, "train.weight_decay=-0.01"),
    (grpo_smollm2_arith, "", "train.max_grad_norm", 0.0, "train.max_grad_norm=0.0"),
    (grpo_smollm2_arith, "", "train.warmup_steps", -1, "train.warmup_steps=-1"),
    (grpo_smollm2_arith, "", "task.size", 0, "task.size=0"),
    (grpo_smollm2_arith, "", "task.name", "chess", "task.name='chess'"),
    (grpo_smollm2_arith, "", "seed", -3, "seed=-3"),
    (ppo_smollm2_arith, "", "train.learning_rate", -1.0, "train.learning_rate=-1.0"),
    (ppo_smollm2_arith, "", "rollout.top_p", 2.0, "rollout.top_p=2.0"),
    (dpo_smollm2_arith, "", "model.dtype", "float16", "model.dtype='float16'"),
    (dpo_smollm2_arith, "", "train.learning_rate", -1e-6, "train.learning_rate=-1e-06"),
    (dpo_smollm2_arith, "", "rollout.temperature", -1.0, "rollout.temperature=-1.0"),
    (dpo_smollm2_arith, "", "dpo.label_smoothing", 0.5, "dpo.label_smoothing=0.5"),
    (dpo_smollm2_arith, "jsonl", "train.learning_rate", -1.0, "train.learning_rate=-1.0"),
]
TRAINERS = {"grpo": grpo.GRPO, "ppo": ppo.PPO, "dpo": dpo.DPO}


@pytest.mark.parametrize("module,variant,field,value,message", BAD_FIELDS,
                         ids=[f"{m.__name__.split('.')[-1]}:{v}:{f}={x!r}" for m, v, f, x, _ in BAD_FIELDS])
def test_bad_field_is_refused_by_name_before_the_model_loads(monkeypatch, tmp_path, module, variant, field, value,
                                                             message):
  # Before the fix, train.learning_rate=-1 trained (gradient ascent) and model.dtype=float16 ran;
  # a negative temperature or an over-long budget failed only after the model had loaded.
  _no_model_load(monkeypatch)
  config = experiment_config(module, variant, tmp_path, **{field: value})
  algorithm = TRAINERS[config.get("algorithm", "grpo")]
  with pytest.raises(ValueError, match=re.escape(message)):
    loop.train(config, algorithm(config))


def test_label_smoothing_with_ipo_is_refused_before_any_compute(monkeypatch, tmp_path):
  # Conservative DPO's label noise model is the sigmoid loss's; IPO has none (losses.dpo_loss).
  _no_model_load(monkeypatch)
  for loss in ("ipo", "ipo_sum"):
    config = experiment_config(dpo_smollm2_arith, "", tmp_path, **{"dpo.loss": loss, "dpo.label_smoothing": 0.1})
    with pytest.raises(ValueError, match=rf"dpo.label_smoothing=0.1 applies to dpo.loss='sigmoid' only.*{loss}"):
      dpo.DPO(config)


def test_every_experiment_default_validates_without_loading(monkeypatch, tmp_path):
  # The checks read the model's context from its GGUF header, not its weights.
  _no_model_load(monkeypatch)
  for module, variant, algorithm in [(grpo_smollm2_arith, "", grpo), (grpo_tree_smollm2_arith, "", grpo),
                                     (ppo_smollm2_arith, "", ppo), (ppo_smollm2_arith, "tree", ppo),
                                     (dpo_smollm2_arith, "", dpo), (dpo_smollm2_arith, "jsonl", dpo)]:
    algorithm.validate(experiment_config(module, variant, tmp_path))


def test_context_length_reads_only_metadata():
  from branch_replay_jax.models.loading import context_length
  assert context_length("smollm2-135m-instruct") == 8192   # llama.context_length in the GGUF header


# ---- 11. a truncated safetensors file names the file, the tensor and the bytes --------------------

def _safetensors(tmp_path):
  from safetensors.numpy import save_file
  path = os.path.join(tmp_path, "model.safetensors")
  save_file({"a": np.zeros((4, 4), np.float32), "b": np.ones((8,), np.float32), "c": np.ones((2,), np.float32)}, path)
  return path


def test_truncated_safetensors_names_the_file_the_tensor_and_the_bytes(tmp_path):
  path = _safetensors(tmp_path)
  size = os.path.getsize(path)
  header = 8 + int.from_bytes(open(path, "rb").read(8), "little")
  # Data order is a (64 bytes), b (32 bytes), c (8 bytes) by offset; cut 10 bytes into b.
  with open(path, "r+b") as f:
    f.truncate(header + 64 + 10)
  offsets = {k: v["data_offsets"] for k, v in json.loads(open(path, "rb").read(header)[8:]).items()
             if k != "__metadata__"}
  first_short = min((k for k in offsets if header + offsets[k][1] > header + 74), key=lambda k: offsets[k][0])
  begin, end = offsets[first_short]
  want = (f"{path}: truncated or corrupt safetensors file ({header + 74} bytes): tensor '{first_short}' expects "
          f"{end - begin} bytes at offset {header + begin}, found {74 - begin}")
  with pytest.raises(ValueError) as e:
    hf_loader.read_tensors(str(tmp_path))
  assert str(e.value).startswith(want), (str(e.value), want)
  assert size > header + 74


def test_safetensors_cut_inside_its_header(tmp_path):
  path = _safetensors(tmp_path)
  n = int.from_bytes(open(path, "rb").read(8), "little")
  with open(path, "r+b") as f:
    f.truncate(20)
  with pytest.raises(ValueError, match=rf"safetensors file \(20 bytes\): the header expects {n} bytes at offset 8, "
                                       "found 12"):
    hf_loader.read_tensors(str(tmp_path))


# ---- A. config fields reach the functions -------------------------------------------------------

def test_dpo_label_smoothing_reaches_the_replay_and_the_naive_step(tmp_path):
  # One pair, a reference unlike the policy and β = 50 (margin m = β h far from 0). Conservative DPO with ε:
  # loss = -(1 - ε) log σ(m) - ε log σ(-m) (losses.dpo_loss); both layouts must compute it with
  # the configured ε = 0.1, not plain DPO's -log σ(m).
  from conftest import tiny_model
  from branch_replay_jax.gradients import preference as pref
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
    fns = dpo.DPOFunctions(config, graphdef, lambda p, o, g: (p, o, 0.0))
    _, _, stats = fns.step(params, ref_params, None, batch)
    m = stats["reward_margin"]
    assert abs(m) > 0.02
    want = -(0.9 * np.log(jax.nn.sigmoid(m)) + 0.1 * np.log(jax.nn.sigmoid(-m)))
    np.testing.assert_allclose(stats["loss"], want, rtol=1e-5, err_msg=gradient)
    assert abs(stats["loss"] + np.log(jax.nn.sigmoid(m))) > 1e-3   # differs from plain DPO by ε m


def test_task_strict_answer_reaches_the_task(tmp_path):
  # "<answer>-12" (cut off by the budget) scores as -12 in the forgiving default, not in strict mode.
  for strict in (False, True):
    config = experiment_config(grpo_smollm2_arith, "smoke", tmp_path, **{"task.strict_answer": strict})
    task = loop.make_task_from(config)
    assert task.strict_answer is strict
    problem = task[0]
    score = task.score(f"<answer>{problem.answer}", problem)
    assert score.correct is (not strict)


def test_zero_variance_groups_counts_the_groups_whose_advantages_are_zero():
  # Sixteen float32 1.1 rewards: np.std is ~1e-7, not 0, yet the group is constant; the metric and
  # the advantages (exactly 0 for it) both use losses.constant_groups.
  from branch_replay_jax.rollout.collect import Group
  rewards = [np.full(16, 1.1, np.float32), np.array([0.0, 1.1] * 8, np.float32)]
  groups = [Group("group", {}, r, r > 1, np.full(16, 3), {"token_positions_naive": 1, "token_positions_computed": 1,
                                                          "ideal_flop_ratio": 1.0, "padding_fraction": 0.0},
                  {}, 0.0, 0.0, truncated=np.zeros(16, bool)) for r in rewards]
  record = loop.step_record(0, groups, {}, rollout_s=0.0, update_s=0.0)
  zeroed = [bool(np.all(np.asarray(obj.group_advantages(r)) == 0)) for r in rewards]
  assert record["zero_variance_groups"] == sum(zeroed) == 1


# ---- 7. a resumed run cuts every log back to the restored step -----------------------------------

def _length_score(self, completion_text, problem):
  return Score(reward=float(len(completion_text) % 3), correct=False, extracted=None, formatted=False)


def test_resume_from_checkpoint_2_of_3_leaves_each_step_once_in_every_log(monkeypatch, tmp_path):
  # A 3-step smoke run killed after logging step 3 but before its checkpoint landed: checkpoint 2
  # is the latest. Resuming re-runs step 3, so each log must end [1, 2, 3] (before: samples.jsonl
  # kept the killed run's step 3 and got [1, 2, 3, 3]); a log we do not write ourselves
  # (extra.jsonl here) is cut back as well. The held-out evaluation (smoke: eval.every 2) logged
  # steps 0, 2 and 3 (the end): its step-3 row goes and the re-run step 3 writes it once.
  import shutil
  monkeypatch.setattr(Task, "score", _length_score)
  config = experiment_config(grpo_smollm2_arith, "smoke", tmp_path, **{"train.steps": 3})
  grpo.train(config)
  shutil.rmtree(os.path.join(tmp_path, "checkpoints", "3"))
  with open(os.path.join(tmp_path, "extra.jsonl"), "w") as f:
    f.writelines(json.dumps({"step": s}) + "\n" for s in (1, 2, 3))
  history = grpo.train(experiment_config(grpo_smollm2_arith, "smoke", tmp_path, **{"train.steps": 3, "resume": True}))
  assert [r["step"] for r in history] == [3]
  want = {"samples.jsonl": [1, 2, 3], "metrics.jsonl": [1, 2, 3], "extra.jsonl": [1, 2], "eval.jsonl": [0, 2, 3]}
  for name, steps in want.items():
    with open(os.path.join(tmp_path, name)) as f:
      assert [json.loads(line)["step"] for line in f] == steps, name


# ---- 2. PPO's GAE gets the sampler's stop reason and V after the last token -----------------------

class _FakeForward:
  """PPOFunctions with a forward that returns fixed old log-probs, values and next values."""
  naive = False

  def __init__(self, out):
    self.forward = lambda params, arrays: out

  def forward_groups(self, params, groups):   # one device: forward of each group (PPOFunctions.forward_groups)
    return [self.forward(params, g.batch) for g in groups]


def _ppo_config(tmp_path, **overrides):
  return experiment_config(ppo_smollm2_arith, "smoke", tmp_path, **{"ppo.gamma": 1.0, "ppo.lam": 0.9,
                                                                     "ppo.whiten_advantages": False, **overrides})


# The numbers: rewards 0, values [0.3, 0.5, 0.7], V after the last token 0.9, gamma 1, lam 0.9.
TRUNCATED_ADV = [0.542, 0.38, 0.2]
TERMINATED_ADV = [-0.187, -0.43, -0.7]


def test_ppo_group_advantages_bootstrap_only_the_truncated_completion(tmp_path):
  # Two completions of 3 tokens with equal values: the first cut by the budget, the second ended by
  # EOS on the budget's last token (same padded width: only the stop reason tells them apart).
  from branch_replay_jax.rollout.collect import Group
  values = np.zeros((2, 8), np.float32)
  values[:, :3] = [0.3, 0.5, 0.7]
  mask = np.arange(8)[None] < 3
  arrays = GroupBatch(np.zeros(4, np.int32), np.int32(2), Segments(np.ones((2, 8), np.int32),
                                                                    np.broadcast_to(mask, (2, 8))))
  out = LogprobsValues(np.zeros((2, 8), np.float32), values, np.array([0.9, 0.9], np.float32))
  group = Group("group", arrays, np.zeros(2, np.float32), np.zeros(2, bool), np.array([3, 3]), {}, {}, 0.0, 0.0,
                truncated=np.array([True, False]))
  ppo.prepare(_ppo_config(tmp_path), _FakeForward(out), None, [group])
  adv = np.asarray(group.batch.branches.advantage)
  np.testing.assert_allclose(adv[0, :3], TRUNCATED_ADV, atol=1e-6)
  np.testing.assert_allclose(adv[1, :3], TERMINATED_ADV, atol=1e-6)
  np.testing.assert_array_equal(adv[:, 3:], 0.0)


def test_ppo_tree_advantages_bootstrap_from_the_leaf_each_trajectory_ends_at(tmp_path):
  # Prompt -> node 1 (2 tokens) -> leaves 2 and 3 (1 token each): trajectory 0 ends at node 2 (cut
  # by the budget), trajectory 1 at node 3 (EOS). Each path's values are [0.3, 0.5, 0.7]; V after
  # node 2 and node 3 is 0.9, after node 1 it is 5.0 (a bootstrap from the wrong node would show).
  from branch_replay_jax.data.trees import RolloutTree
  from branch_replay_jax.rollout.collect import Group
  tree = RolloutTree((np.array([1, 2, 3]), np.array([4, 5]), np.array([6]), np.array([7])), (-1, 0, 1, 1), (2, 3))
  padded = ppo.pad_tree(tree)
  node_values = {1: [0.3, 0.5], 2: [0.7], 3: [0.7]}
  node_next = {1: 5.0, 2: 0.9, 3: 0.9}
  out = []
  for d, ids in enumerate(padded.node_ids, start=1):
    t = padded.tokens[d - 1].shape[-1]
    vals, nxt = np.zeros(ids.shape + (t,), np.float32), np.zeros(ids.shape, np.float32)
    for slot in zip(*np.nonzero(ids >= 0)):
      vals[slot][:len(node_values[ids[slot]])] = node_values[ids[slot]]
      nxt[slot] = node_next[ids[slot]]
    out.append(LogprobsValues(np.zeros_like(vals), vals, nxt))
  arrays = tree_arrays(padded, {})
  group = Group("tree", arrays, np.zeros(2, np.float32), np.zeros(2, bool), np.array([3, 3]), {}, {}, 0.0, 0.0,
                truncated=np.array([True, False]), tree=tree)
  ppo.prepare(_ppo_config(tmp_path), _FakeForward(out), None, [group])
  # Per (token, trajectory) advantages [T_d, G] of node 1 (level 1, slot 0) and nodes 2, 3 (level 2).
  lvl1, lvl2 = (np.asarray(level.advantage) for level in group.batch.levels)
  np.testing.assert_allclose(lvl1[0, :2, 0], TRUNCATED_ADV[:2], atol=1e-6)
  np.testing.assert_allclose(lvl1[0, :2, 1], TERMINATED_ADV[:2], atol=1e-6)
  np.testing.assert_allclose(lvl2[0, 0, 0, 0], TRUNCATED_ADV[2], atol=1e-6)
  np.testing.assert_allclose(lvl2[0, 1, 0, 1], TERMINATED_ADV[2], atol=1e-6)


def test_ppo_whitening_of_a_constant_advantage_is_zero(tmp_path):
  # Every completion terminated with reward 0 and values 0: every advantage is 0 exactly; whitening
  # over the step must keep them 0 (the formula gave -0.598 on float32 constants).
  from branch_replay_jax.rollout.collect import Group
  mask = np.arange(8)[None] < 3
  values = np.where(mask, 0.1, 0.0).astype(np.float32).repeat(4, 0)
  arrays = GroupBatch(np.zeros(4, np.int32), np.int32(2), Segments(np.ones((4, 8), np.int32),
                                                                    np.broadcast_to(mask, (4, 8))))
  out = LogprobsValues(np.zeros((4, 8), np.float32), values, np.zeros(4, np.float32))
  rewards = np.full(4, 0.1, np.float32)   # reward 0.1 on the last token against V = 0.1 throughout
  group = Group("group", arrays, rewards, np.zeros(4, bool), np.array([3] * 4), {}, {}, 0.0, 0.0,
                truncated=np.zeros(4, bool))
  stats = ppo.prepare(_ppo_config(tmp_path, **{"ppo.whiten_advantages": True}), _FakeForward(out), None, [group])
  np.testing.assert_array_equal(np.asarray(group.batch.branches.advantage), 0.0)
  assert stats["explained_variance"] is None or np.isfinite(stats["explained_variance"])


def test_next_value_is_the_value_of_the_state_after_the_last_token():
  # V after a completion's k-th token is the value the critic gives token k of any longer
  # completion with the same first k tokens (the same context): replay and naive agree with it.
  from conftest import random_group
  from branch_replay_jax.data.batches import group_arrays
  from branch_replay_jax.models import Llama, tiny_config
  from branch_replay_jax.models.critic import ActorCritic
  from flax import nnx
  ac = ActorCritic(Llama(tiny_config(), rngs=nnx.Rngs(0)), critic="value_head")
  ac.value_w[...] = jax.random.normal(jax.random.key(1), ac.value_w.shape) * 0.1
  graphdef, params = nnx.split(ac)
  from branch_replay_jax.data.groups import make_group
  group = random_group([6])
  comp = np.asarray(group.completion_ids[0, :6])
  both = make_group(group.prompt_ids[:group.prompt_len], [comp[:3], comp], vocab_size=64, max_positions=256)
  arrays = group_arrays(both)
  for fwd in (functools.partial(forward, ACTOR_CRITIC), functools.partial(forward, ACTOR_CRITIC, layout="naive")):
    out = jax.jit(fwd, static_argnums=0)(graphdef, params, arrays)
    np.testing.assert_allclose(out.next_value[0], out.values[1, 3], rtol=1e-5)
    assert abs(float(out.next_value[0])) > 1e-4


def test_rollouts_carry_the_samplers_stop_reason(tmp_path):
  # Group.truncated is ~finished of the sampler: True exactly where the completion's last token is
  # not EOS (the tiny random model rarely emits EOS; both cases are checked where they occur).
  from branch_replay_jax.models.loading import load_tokenizer
  from branch_replay_jax.rollout.collect import rollout
  tokenizer = load_tokenizer("smollm2-135m-instruct")
  for module, variant in [(ppo_smollm2_arith, "smoke"), (ppo_smollm2_arith, "tree_smoke")]:
    config = experiment_config(module, variant, tmp_path)
    model, _ = loop.build_model(config)
    task = loop.make_task_from(config)
    g = rollout(config, model, tokenizer, task, 0, jax.random.key(0))
    comps = ([g.tree.completion(i) for i in range(len(g.tree.ends))] if g.tree is not None else
             [np.asarray(g.batch.branches.tokens[i, :n]) for i, n in enumerate(g.lengths)])
    assert g.truncated.shape == (len(comps),)
    np.testing.assert_array_equal(g.truncated, [c[-1] != tokenizer.eos_token_id for c in comps])


# ---- 10. a quiet console and checkpoints that do not stall a step --------------------------------

def test_importing_transformers_through_the_package_prints_no_pytorch_notice():
  # transformers (no torch installed) warns "PyTorch was not found. Models won't be available..."
  # on import; the package drops exactly that record at transformers' logger. A fresh interpreter,
  # since this one has imported transformers already.
  import subprocess
  import sys
  code = "import branch_replay_jax, transformers, logging; logging.getLogger('transformers').warning('still here')"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert "PyTorch was not found" not in out.stderr + out.stdout
  assert "still here" in out.stderr   # the logger's other warnings still print


def test_orbax_wait_warning_is_dropped_at_the_absl_logger(caplog):
  import logging
  import branch_replay_jax  # noqa: F401  (installs the filters)
  with caplog.at_level(logging.WARNING, logger="absl"):
    logging.getLogger("absl").warning("Waiting for previous save to complete took %f seconds. If this ...", 5.0)
    logging.getLogger("absl").warning("another absl warning")
  assert [r.getMessage() for r in caplog.records] == ["another absl warning"]


def test_checkpoint_save_returns_before_the_write_and_restores_exactly(tmp_path):
  # save() copies to host and returns; the caller may overwrite (donate) its arrays at once; the
  # restored state equals what was passed, bit for bit.
  from branch_replay_jax.outputs.checkpoints import RunCheckpoints
  import jax.numpy as jnp
  ckpt = RunCheckpoints(str(tmp_path))
  state = {"w": jnp.arange(1 << 20, dtype=jnp.float32), "rng": jax.random.key_data(jax.random.key(3))}
  want = jax.tree_util.tree_map(np.asarray, state)
  blocked = ckpt.save(1, state, {"step": 1, "data_pos": 2})
  assert blocked >= 0.0
  state["w"].delete()   # as a donating update would
  got, meta = ckpt.restore(1, {"w": jnp.zeros(1 << 20, jnp.float32), "rng": jnp.zeros_like(want["rng"])})
  ckpt.close()
  assert meta == {"step": 1, "data_pos": 2}
  np.testing.assert_array_equal(np.asarray(got["w"]), want["w"])
  np.testing.assert_array_equal(np.asarray(got["rng"]), want["rng"])
