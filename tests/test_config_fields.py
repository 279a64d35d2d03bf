"""Every config field is read or refused: each experiment's variants validate, and one training step
of each smoke variant (through main's dispatch) reads every leaf field of the config.

A field that nothing reads would be silently ignored (a user sets it and nothing changes), so an
unread field fails here with its dotted name. Reads are recorded by wrapping
`ml_collections.ConfigDict.__getitem__` (attribute access, `[]` and `.get` all go through it).
"""

import contextlib
import importlib
import re

import ml_collections
import pytest

from branch_replay_jax import main as entry
from branch_replay_jax.algorithms import dpo, grpo, loop, ppo, schema
from conftest import experiment_config, no_model_load
from experiments import dpo_smollm2_arith, grpo_smollm2_arith, grpo_tree_smollm2_arith, ppo_smollm2_arith

# experiment module -> its variants; each non-smoke variant maps to the smoke variant whose run
# covers it (the same fields, and the same values of the fields that select a code path).
VARIANTS = {
    "grpo_smollm2_arith": {"": "smoke", "long": "smoke", "eval200": "smoke", "learn": "smoke", "smoke": "smoke", "lora": "lora_smoke",
                           "lora_smoke": "lora_smoke"},
    "grpo_tree_smollm2_arith": {"": "smoke", "smoke": "smoke"},
    "rloo_smollm2_arith": {"": "smoke", "smoke": "smoke"},
    "ppo_smollm2_arith": {"": "smoke", "smoke": "smoke", "tree": "tree_smoke", "tree_smoke": "tree_smoke"},
    "dpo_smollm2_arith": {"": "smoke", "smoke": "smoke", "jsonl": "jsonl_smoke", "jsonl_smoke": "jsonl_smoke"},
    "grpo_smollm2_calc": {"": "smoke", "smoke": "smoke"},
}
# Fields whose value selects a code path: a variant and the smoke variant covering it must agree.
PATH_SELECTORS = ("algorithm", "rollout.tree_fanouts", "data.source", "loss.advantage", "train.gradient")


def leaf_fields(config, prefix="") -> dict:
  """Dotted name -> value of every leaf (a value that is not a ConfigDict, or an empty ConfigDict)."""
  out = {}
  for key, value in config.items(preserve_field_references=True):
    if isinstance(value, ml_collections.ConfigDict) and value.keys():
      out.update(leaf_fields(value, f"{prefix}{key}."))
    else:
      out[prefix + key] = value
  return out


@contextlib.contextmanager
def recorded_reads(config):
  """Yields the set of dotted field names of `config` read inside the block."""
  owners, reads = {}, set()

  def walk(node, prefix):
    owners[id(node)] = prefix
    for key, value in node.items(preserve_field_references=True):
      if isinstance(value, ml_collections.ConfigDict):
        walk(value, f"{prefix}{key}.")
  walk(config, "")
  original = ml_collections.ConfigDict.__getitem__

  def getitem(self, key):
    value = original(self, key)
    if id(self) in owners and isinstance(key, str):
      reads.add(owners[id(self)] + key)
    return value
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(ml_collections.ConfigDict, "__getitem__", getitem)
    yield reads


@pytest.mark.parametrize("name,variant", [(n, v) for n, vs in VARIANTS.items() for v in vs])
def test_every_variant_validates_and_is_covered_by_a_smoke_run(name, variant):
  module = importlib.import_module(f"experiments.{name}")
  config, smoke = module.get_config(variant), module.get_config(VARIANTS[name][variant])
  trainer = importlib.import_module(entry.TRAINERS[config.algorithm])
  trainer.validate(config)
  fields, covered = leaf_fields(config), leaf_fields(smoke)
  assert set(fields) == set(covered), sorted(set(fields) ^ set(covered))
  for selector in PATH_SELECTORS:
    assert bool(fields.get(selector)) == bool(covered.get(selector)), selector
    if isinstance(fields.get(selector), str):
      assert fields[selector] == covered[selector], selector


def test_schema_parse_reads_only_the_algorithm():
  # schema.parse checks every field without `__getitem__`, so the record below shows what the run
  # itself reads: a field only the schema looked at would still fail as unread.
  for name in VARIANTS:
    config = importlib.import_module(f"experiments.{name}").get_config("smoke")
    with recorded_reads(config) as reads:
      schema.parse(config)
    assert reads == {"algorithm"}, name


def _smoke_variants():
  """Every smoke variant; all but the default experiment's are `heavy` (about 1-2 minutes each on 2
  cores, mostly compiling): CI runs the default's, `make test-all` all of them."""
  for name, variant in sorted({(n, s) for n, vs in VARIANTS.items() for s in vs.values()}):
    heavy = () if name == "grpo_smollm2_arith" else (pytest.mark.heavy,)
    yield pytest.param(name, variant, marks=heavy, id=f"{name}:{variant}")


@pytest.mark.slow
@pytest.mark.parametrize("name,variant", list(_smoke_variants()))
def test_one_smoke_step_reads_every_field(tmp_path, name, variant):
  config = experiment_config(importlib.import_module(f"experiments.{name}"), variant, tmp_path,
                             **{"train.steps": 1})
  with recorded_reads(config) as reads:
    importlib.import_module(entry.TRAINERS[config.algorithm]).train(config)
  unread = sorted(set(leaf_fields(config)) - reads)
  assert not unread, f"experiments/{name}.py:{variant}: fields nothing reads: {unread}"


# ---- every field's domain, checked before anything loads ----------------------------------------------

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
  no_model_load(monkeypatch)
  config = experiment_config(module, variant, tmp_path, **{field: value})
  algorithm = TRAINERS[config.algorithm]
  with pytest.raises(ValueError, match=re.escape(message)):
    loop.train(config, algorithm(config))


def test_label_smoothing_with_ipo_is_refused_before_any_compute(monkeypatch, tmp_path):
  # Conservative DPO's label noise model is the sigmoid loss's; IPO has none (losses.dpo_loss).
  no_model_load(monkeypatch)
  for loss in ("ipo", "ipo_sum"):
    config = experiment_config(dpo_smollm2_arith, "", tmp_path, **{"dpo.loss": loss, "dpo.label_smoothing": 0.1})
    with pytest.raises(ValueError, match=rf"dpo.label_smoothing=0.1 applies to dpo.loss='sigmoid' only.*{loss}"):
      dpo.DPO(config)


def test_every_experiment_default_validates_without_loading(monkeypatch, tmp_path):
  # The checks read the model's context from its GGUF header, not its weights.
  no_model_load(monkeypatch)
  for module, variant, algorithm in [(grpo_smollm2_arith, "", grpo), (grpo_tree_smollm2_arith, "", grpo),
                                     (ppo_smollm2_arith, "", ppo), (ppo_smollm2_arith, "tree", ppo),
                                     (dpo_smollm2_arith, "", dpo), (dpo_smollm2_arith, "jsonl", dpo)]:
    algorithm.validate(experiment_config(module, variant, tmp_path))
