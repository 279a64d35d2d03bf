"""The config schema (algorithms/schema.py; docs/design.md, "Config schema"): every shipped experiment
and variant parses into its algorithm's typed frozen config; a typo, a wrong type, another
algorithm's field and a config without `algorithm` are refused by name before anything loads.
Parse only: no model, tokenizer or GGUF header is read."""

import dataclasses
import importlib
import re

import ml_collections
import pytest

from branch_replay_jax import main as entry
from branch_replay_jax.algorithms import dpo, grpo, ppo, schema
from conftest import experiment_config, no_model_load
from experiments import dpo_smollm2_arith, grpo_smollm2_arith, ppo_smollm2_arith

EXPERIMENTS = ("grpo_smollm2_arith", "grpo_tree_smollm2_arith", "rloo_smollm2_arith", "ppo_smollm2_arith",
               "dpo_smollm2_arith", "grpo_smollm2_calc")


def documented_variants(name: str) -> list[str]:
  """The variants experiments/NAME.py's docstring lists ("--config=experiments/NAME.py:VARIANT"; none: '')."""
  doc = importlib.import_module(f"experiments.{name}").__doc__
  return [v for v in re.findall(rf"--config=experiments/{name}\.py(?::(\w+))?", doc)]


def test_the_docstrings_list_every_variant():
  # The enumeration below follows the docstrings; this pins what they list.
  assert {n: documented_variants(n) for n in EXPERIMENTS} == {
      "grpo_smollm2_arith": ["", "long", "smoke", "eval200", "learn", "lora", "lora_smoke"],
      "grpo_tree_smollm2_arith": ["", "smoke"],
      "rloo_smollm2_arith": ["", "smoke"],
      "ppo_smollm2_arith": ["", "tree", "smoke", "tree_smoke"],
      "dpo_smollm2_arith": ["", "jsonl", "smoke", "jsonl_smoke"],
      "grpo_smollm2_calc": ["", "smoke", "guess", "vf_arith"],
  }


@pytest.mark.parametrize("name,variant", [(n, v) for n in EXPERIMENTS for v in documented_variants(n)])
def test_every_shipped_experiment_and_variant_parses(name, variant):
  config = importlib.import_module(f"experiments.{name}").get_config(variant)
  typed = schema.parse(config)
  want = {"grpo": schema.GRPOExperiment, "ppo": schema.PPOExperiment, "dpo": schema.DPOExperiment}
  assert type(typed) is want[config.algorithm]
  assert config.algorithm == ("ppo" if name.startswith("ppo") else "dpo" if name.startswith("dpo") else "grpo")
  assert typed.seed == 0 and typed.run_dir == config.run_dir and typed.train.steps == config.train.steps


def test_parsed_values_are_typed_and_absent_fields_read_none():
  rloo = schema.parse(importlib.import_module("experiments.rloo_smollm2_arith").get_config())
  assert (rloo.loss.advantage, rloo.loss.advantage_eps) == ("rloo", None)   # RLOO removes advantage_eps
  tree = schema.parse(importlib.import_module("experiments.grpo_tree_smollm2_arith").get_config())
  assert (tree.rollout.group_size, tree.rollout.max_new_tokens, tree.rollout.tree_fanouts) == (None, None, (4, 2, 2))
  typed = schema.parse(grpo_smollm2_arith.get_config())
  assert typed.rollout.max_prompt_draws is None and typed.distributed.num_processes is None   # placeholders
  assert typed.lora is None and typed.task.options == {} and typed.loss.kl_coef == 0.04
  assert schema.parse(grpo_smollm2_arith.get_config("lora")).lora.targets[0] == "wq"
  jsonl = schema.parse(dpo_smollm2_arith.get_config("jsonl"))
  assert (jsonl.task, jsonl.rollout, jsonl.data.pairs_per_step) == (None, None, 4)
  with pytest.raises(dataclasses.FrozenInstanceError):
    typed.train.steps = 3


def test_an_int_where_a_float_is_expected_is_a_float():
  config = grpo_smollm2_arith.get_config()
  del config.train.learning_rate
  config.train.learning_rate = 1   # a new field: ml_collections keeps the int
  assert schema.parse(config).train.learning_rate == 1.0
  assert isinstance(schema.parse(config).train.learning_rate, float)


def test_a_typo_in_an_experiment_field_is_refused_with_did_you_mean(monkeypatch):
  no_model_load(monkeypatch)
  config = grpo_smollm2_arith.get_config()
  config.train.stpes = 10
  message = "train.stpes is not a field of the grpo config; did you mean train.steps?"
  with pytest.raises(ValueError, match=re.escape(message)):
    schema.parse(config)
  with pytest.raises(ValueError, match=re.escape(message)):   # every run goes through it
    grpo.GRPO(config)
  config = grpo_smollm2_arith.get_config()
  config.trian = ml_collections.ConfigDict({"steps": 3})
  with pytest.raises(ValueError, match=re.escape("trian is not a field of the grpo config; did you mean train?")):
    schema.parse(config)
  config = grpo_smollm2_arith.get_config()
  config.train.zzz = 1   # nothing close: the section's fields are listed
  with pytest.raises(ValueError, match=re.escape("train.zzz is not a field of the grpo config; the train fields are "
                                                 "steps, learning_rate,")):
    schema.parse(config)


@pytest.mark.parametrize("field,value,message", [
    ("train.steps", True, "train.steps=True must be an int, not bool"),   # ml_collections lets a bool into an int
    ("train.micro_batch", None, "train.micro_batch=None: the field is no placeholder; set an int"),
    ("rollout.temperature", None, "rollout.temperature=None: the field is no placeholder"),
    ("rollout.group_size", None, "rollout.group_size=None: the field is no placeholder; set an int or remove it"),
    ("loss.mask_truncated", None, "loss.mask_truncated=None"),
])
def test_a_wrong_type_is_refused_by_name(field, value, message):
  config = experiment_config(grpo_smollm2_arith, "", "runs/unused", **{field: value})
  with pytest.raises(ValueError, match=re.escape(message)):
    schema.parse(config)


@pytest.mark.parametrize("field,value,message", [
    ("train.steps", "10", "train.steps='10' must be an int, not str"),
    ("rollout.dynamic_sampling", 1, "rollout.dynamic_sampling=1 must be a bool, not int"),
    ("loss.kl_coef", "0.04", "loss.kl_coef='0.04' must be a number (int or float), not str"),
    ("rollout.tree_fanouts", (2, "2"), "rollout.tree_fanouts[1]='2' must be an int, not str"),
    ("model", "tiny", "model='tiny' must be a section (ConfigDict), not str"),
])
def test_a_field_written_with_the_wrong_type_is_refused_by_name(field, value, message):
  # As an experiment file that writes the field itself (no earlier value whose type ml_collections locks).
  config = grpo_smollm2_arith.get_config()
  section, _, name = field.rpartition(".")
  node = config[section] if section else config
  del node[name]
  node[name] = value
  with pytest.raises(ValueError, match=re.escape(message)):
    schema.parse(config)


def test_a_placeholder_takes_none_or_its_type():
  config = grpo_smollm2_arith.get_config()
  config.rollout.max_prompt_draws = 8
  assert schema.parse(config).rollout.max_prompt_draws == 8
  config.distributed.coordinator_address = "localhost:1234"
  assert schema.parse(config).distributed.coordinator_address == "localhost:1234"


@pytest.mark.parametrize("field,value", [("loss.mask_truncated", True), ("rollout.dynamic_sampling", False),
                                         ("loss.clip_eps_high", 0.28), ("rollout.max_prompt_draws", 4)])
def test_a_grpo_only_field_in_a_ppo_config_is_refused_naming_grpo(monkeypatch, field, value):
  no_model_load(monkeypatch)
  config = ppo_smollm2_arith.get_config()
  section, _, name = field.rpartition(".")
  config[section][name] = value
  message = (f"{field}={value!r} is a GRPO option (algorithms/grpo.py) that the PPO loop does not read; "
             "remove the field")
  with pytest.raises(ValueError, match=re.escape(message)):
    schema.parse(config)
  with pytest.raises(ValueError, match=re.escape(message)):
    ppo.validate(config)


def test_other_algorithms_fields_and_sections_are_refused_naming_who_reads_them():
  config = ppo_smollm2_arith.get_config()
  config.loss.advantage = "grpo"
  with pytest.raises(ValueError, match=re.escape("loss.advantage='grpo' is a GRPO option (algorithms/grpo.py) that "
                                                 "the PPO loop does not read (GAE advantages from the critic")):
    schema.parse(config)
  config = ppo_smollm2_arith.get_config()
  config.lora = grpo_smollm2_arith.get_config("lora").lora
  with pytest.raises(ValueError, match=re.escape("lora is set with algorithm='ppo': LoRA adapters train with GRPO / "
                                                 "RLOO only (algorithm 'grpo'); remove the lora block")):
    schema.parse(config)
  config = grpo_smollm2_arith.get_config()
  config.ppo = ppo_smollm2_arith.get_config().ppo
  with pytest.raises(ValueError, match=re.escape("ppo is a PPO section (algorithms/ppo.py) that the GRPO loop does "
                                                 "not read; remove the block")):
    schema.parse(config)
  config = dpo_smollm2_arith.get_config()
  config.rollout.tree_fanouts = (2, 2)
  with pytest.raises(ValueError, match=re.escape("rollout.tree_fanouts=(2, 2) is a GRPO and PPO option "
                                                 "(algorithms/grpo.py, algorithms/ppo.py) that the DPO loop")):
    dpo.validate(config)


def test_a_config_without_algorithm_is_refused(monkeypatch):
  no_model_load(monkeypatch)
  for module, trainer in [(grpo_smollm2_arith, grpo), (ppo_smollm2_arith, ppo), (dpo_smollm2_arith, dpo)]:
    config = module.get_config()
    del config.algorithm
    with pytest.raises(ValueError, match=re.escape("config.algorithm is missing: every experiment states its "
                                                   "algorithm, one of ('grpo', 'ppo', 'dpo')")):
      trainer.validate(config)
  config = grpo_smollm2_arith.get_config()
  config.algorithm = "rloo"
  with pytest.raises(ValueError, match=re.escape("algorithm='rloo' is not one of ('grpo', 'ppo', 'dpo') (RLOO is "
                                                 "'grpo' with loss.advantage='rloo')")):
    schema.parse(config)


def test_a_config_given_to_another_algorithms_trainer_is_refused():
  with pytest.raises(ValueError, match=re.escape("algorithm='ppo' given to the grpo trainer (algorithms/grpo.py); "
                                                 "algorithms/ppo.py runs it")):
    grpo.validate(ppo_smollm2_arith.get_config())


def test_a_missing_field_is_refused_with_its_type_and_doc():
  config = grpo_smollm2_arith.get_config()
  del config.train.steps
  with pytest.raises(ValueError, match=re.escape("train.steps is missing from the grpo config (an int: optimizer "
                                                 "steps); set it in the experiment file")):
    schema.parse(config)


def test_the_schemas_are_main_s_algorithms_and_every_field_has_a_doc():
  assert set(schema.ALGORITHMS) == set(entry.TRAINERS) == set(schema.SCHEMAS)
  for algorithm in schema.ALGORITHMS:
    for name, type_name, doc in schema.fields(algorithm):
      assert doc and type_name, name


def leaves(config, prefix=""):
  out = set()
  for key, value in config.items():
    # task.options and rollout.episodes.env_options are free-form (the generator, the environment read them)
    if isinstance(value, ml_collections.ConfigDict) and key not in ("options", "env_options"):
      out |= leaves(value, f"{prefix}{key}.")
    else:
      out.add(prefix + key)
  return out


def test_every_schema_field_is_in_a_shipped_experiment():
  # No phantom fields: each schema's leaves are those its experiments' variants use, except DPO's
  # optional eval and distributed sections (the loop runs them; no DPO experiment sets them).
  used = {a: set() for a in schema.ALGORITHMS}
  for name in EXPERIMENTS:
    for variant in documented_variants(name):
      config = importlib.import_module(f"experiments.{name}").get_config(variant)
      used[config.algorithm] |= leaves(config)
  for algorithm in schema.ALGORITHMS:
    defined = {name for name, _, _ in schema.fields(algorithm)}
    extra = {n for n in defined if n.split(".")[0] in ("eval", "distributed")} if algorithm == "dpo" else set()
    assert defined - extra == used[algorithm], (algorithm, sorted(defined ^ used[algorithm]))


@pytest.mark.parametrize("algorithm,old,message", [
    # Every pair that ran before maps to the weighting it computed.
    ("grpo", {"normalisation": "sequence_mean", "aggregation": "group_mean"}, "write loss.weighting='sequence_mean'"),
    ("grpo", {"normalisation": "token_mean", "aggregation": "group_mean"}, "write loss.weighting='group_token_mean'"),
    ("grpo", {"normalisation": "constant", "aggregation": "group_mean"}, "write loss.weighting='constant'"),
    ("grpo", {"normalisation": "token_mean", "aggregation": "step_token_mean"},
     "write loss.weighting='step_token_mean'"),
    ("grpo", {"normalisation": "token_mean"}, "write loss.weighting='group_token_mean' and remove loss.normalisation"),
    ("ppo", {"normalisation": "token_mean"}, "write loss.weighting='group_token_mean' and remove loss.normalisation"),
    ("ppo", {"normalisation": "constant"}, "write loss.weighting='constant'"),
    # A pair that was refused before is refused with the new field's values.
    ("grpo", {"normalisation": "sequence_mean", "aggregation": "step_token_mean"}, "never ran"),
    ("grpo", {"normalisation": "mean"}, "loss.normalisation='mean' never ran"),
])
def test_the_old_normalisation_and_aggregation_are_refused_with_the_weighting_to_write(algorithm, old, message):
  # loss.normalisation + loss.aggregation merged into loss.weighting: an old config runs the same weighting
  # once rewritten, and the message says exactly which value that is (schema.OLD_WEIGHTINGS).
  config = (grpo_smollm2_arith if algorithm == "grpo" else ppo_smollm2_arith).get_config()
  del config.loss.weighting
  for name, value in old.items():
    config.loss[name] = value
  with pytest.raises(ValueError, match=re.escape(message)):
    schema.parse(config)
  given = " with ".join(f"loss.{k}={v!r}" for k, v in old.items())
  with pytest.raises(ValueError, match=re.escape(given)):
    (grpo if algorithm == "grpo" else ppo).validate(config)


def test_a_step_token_mean_ppo_config_is_refused(monkeypatch):
  # PPO averages each minibatch's groups, so a token mean over the whole step has no place in its update.
  no_model_load(monkeypatch)
  config = ppo_smollm2_arith.get_config()
  config.loss.weighting = "step_token_mean"
  with pytest.raises(ValueError, match=re.escape("loss.weighting='step_token_mean': PPO averages each minibatch's")):
    ppo.validate(config)


def test_the_schema_says_which_fields_apply_to_groups_trees_or_episodes_only():
  # Each field applies to every layout unless the schema says otherwise: the group's size and budget
  # (a tree config removes them; GRPO's episodes take G from rollout.group_size), the tree's segment
  # length, its replay order (trees and GRPO's episode trees), tree_fanouts (it picks group or tree),
  # GRPO's overlong shaping (groups and trees), stop strings (groups and trees: an
  # episode's turns end at the model's stop ids), and GRPO's rollout.episodes.
  episodes = {f"rollout.episodes.{n}" for n in ("environment", "max_turns", "max_turn_tokens", "max_episode_tokens",
                                                "max_context", "max_tool_calls", "few_shot", "max_tree_depth",
                                                "min_shared_tokens", "share", "env_options", "history")}
  want = {"grpo": {("group",): {"rollout.max_new_tokens"}, ("group", "episode"): {"rollout.group_size"},
                   ("tree",): {"rollout.segment_length"}, ("tree", "episode"): {"train.tree_schedule"},
                   ("group", "tree"): {"rollout.tree_fanouts", "loss.overlong_buffer", "rollout.stop_strings"},
                   ("episode",): episodes},
          "ppo": {("group",): {"rollout.group_size", "rollout.max_new_tokens"}, ("tree",): {"rollout.segment_length"},
                  ("tree", "episode"): {"train.tree_schedule"},
                  ("group", "tree"): {"rollout.tree_fanouts", "rollout.stop_strings"}}}
  for algorithm in ("grpo", "ppo"):
    got = {}
    for name, layouts in schema.layouts(algorithm).items():
      got.setdefault(layouts, set()).add(name)
    assert got == want[algorithm], algorithm
  assert set(schema.layouts("dpo")) == set()
