"""Every config field is read or refused: each experiment's variants validate, and one training step
of each smoke variant (through main's dispatch) reads every leaf field of the config.

A field that nothing reads would be silently ignored (a user sets it and nothing changes), so an
unread field fails here with its dotted name. Reads are recorded by wrapping
`ml_collections.ConfigDict.__getitem__` (attribute access, `[]` and `.get` all go through it).
"""

import contextlib
import importlib

import ml_collections
import pytest

from branch_replay_jax import main as entry
from conftest import experiment_config

# experiment module -> its variants; each non-smoke variant maps to the smoke variant whose run
# covers it (the same fields, and the same values of the fields that select a code path).
VARIANTS = {
    "grpo_smollm2_arith": {"": "smoke", "long": "smoke", "eval200": "smoke", "learn": "smoke", "smoke": "smoke", "lora": "lora_smoke",
                           "lora_smoke": "lora_smoke"},
    "grpo_tree_smollm2_arith": {"": "smoke", "smoke": "smoke"},
    "rloo_smollm2_arith": {"": "smoke", "smoke": "smoke"},
    "ppo_smollm2_arith": {"": "smoke", "smoke": "smoke", "tree": "tree_smoke", "tree_smoke": "tree_smoke"},
    "dpo_smollm2_arith": {"": "smoke", "smoke": "smoke", "jsonl": "jsonl_smoke", "jsonl_smoke": "jsonl_smoke"},
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
  trainer = importlib.import_module(entry.TRAINERS[config.get("algorithm", "grpo")])
  trainer.validate(config)
  fields, covered = leaf_fields(config), leaf_fields(smoke)
  assert set(fields) == set(covered), sorted(set(fields) ^ set(covered))
  for selector in PATH_SELECTORS:
    assert bool(fields.get(selector)) == bool(covered.get(selector)), selector
    if isinstance(fields.get(selector), str):
      assert fields[selector] == covered[selector], selector


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
    importlib.import_module(entry.TRAINERS[config.get("algorithm", "grpo")]).train(config)
  unread = sorted(set(leaf_fields(config)) - reads)
  assert not unread, f"experiments/{name}.py:{variant}: fields nothing reads: {unread}"
