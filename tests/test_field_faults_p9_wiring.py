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
from branch_replay_jax.models import hf_loader
from branch_replay_jax.rollout.tasks import Score, Task
from conftest import experiment_config
from experiments import dpo_smollm2_arith, grpo_smollm2_arith, grpo_tree_smollm2_arith, ppo_smollm2_arith


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
                  {}, 0.0, 0.0) for r in rewards]
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
  # (eval.jsonl here) is cut back as well.
  import shutil
  monkeypatch.setattr(Task, "score", _length_score)
  config = experiment_config(grpo_smollm2_arith, "smoke", tmp_path, **{"train.steps": 3})
  grpo.train(config)
  shutil.rmtree(os.path.join(tmp_path, "checkpoints", "3"))
  with open(os.path.join(tmp_path, "eval.jsonl"), "w") as f:
    f.writelines(json.dumps({"step": s}) + "\n" for s in (1, 2, 3))
  history = grpo.train(experiment_config(grpo_smollm2_arith, "smoke", tmp_path, **{"train.steps": 3, "resume": True}))
  assert [r["step"] for r in history] == [3]
  for name in ("samples.jsonl", "metrics.jsonl", "eval.jsonl"):
    with open(os.path.join(tmp_path, name)) as f:
      steps = [json.loads(line)["step"] for line in f]
    assert steps == ([1, 2] if name == "eval.jsonl" else [1, 2, 3]), name
