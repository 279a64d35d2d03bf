"""Export to a Hugging Face directory (branch_replay_jax/export.py): read back by our HF loader, same logits."""

import copy
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from branch_replay_jax import export
from branch_replay_jax.models import Llama, tiny_config
from branch_replay_jax.models.config import Llama3RopeScaling
from branch_replay_jax.models.loading import load

TOKENS = np.array([[1, 17, 300, 42, 9, 2048, 5, 77]])


def _logits(model):
  out = model(jnp.asarray(TOKENS), 0)
  return np.asarray(model.logits(out.hidden_btd))


@pytest.mark.parametrize("arch,overrides", [
    ("llama", dict(tie_embeddings=True)),
    ("llama", dict(tie_embeddings=False, rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 64))),
    ("qwen2", dict(qkv_bias=True, tie_embeddings=False)),
    ("qwen3", dict(qk_norm=True)),
], ids=["llama-tied", "llama3-rope-untied", "qwen2-bias", "qwen3-qk-norm"])
def test_export_round_trip_gives_the_same_parameters_and_logits(tmp_path, tokenizer, arch, overrides):
  # A random model over SmolLM2's tokenizer (the loader checks the tokenizer fits the embedding),
  # exported in float32 and read back by models.load: every parameter bit-equal, so the logits
  # equal to float32 rounding of the same program (<= 1e-6 relative, the bound).
  cfg = tiny_config(vocab_size=len(tokenizer), arch=arch, **overrides)
  model = Llama(cfg, rngs=nnx.Rngs(3))
  for name in ("q_norm", "k_norm", "attn_norm"):   # norms are ones at init: make them informative
    if hasattr(model.layers, name):
      v = getattr(model.layers, name)
      v[...] = 1.0 + 0.1 * jax.random.normal(jax.random.key(7), v.shape)
  out = export.export_model(model, tokenizer, str(tmp_path / "hf"))
  assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
  with open(os.path.join(out, "config.json")) as f:
    assert json.load(f)["architectures"] == [export.HF_CLASSES[arch]]
  loaded, tok = load(out)
  assert loaded.config == cfg
  same = jax.tree_util.tree_map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))),
                                nnx.to_pure_dict(nnx.state(model, nnx.Param)), nnx.to_pure_dict(nnx.state(loaded, nnx.Param)))
  assert all(jax.tree_util.tree_leaves(same))
  want, got = _logits(model), _logits(loaded)
  assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()
  assert tok.encode("2 + 3 = 5") == tokenizer.encode("2 + 3 = 5")


def test_export_refuses_a_non_empty_directory_and_an_unknown_dtype(tmp_path, tokenizer):
  model = Llama(tiny_config(vocab_size=len(tokenizer)), rngs=nnx.Rngs(0))
  (tmp_path / "taken").mkdir()
  (tmp_path / "taken" / "x").write_text("keep me")
  with pytest.raises(ValueError, match="exists and is not empty"):
    export.export_model(model, tokenizer, str(tmp_path / "taken"))
  with pytest.raises(ValueError, match="dtype='float16'"):
    export.export_model(model, tokenizer, str(tmp_path / "new"), dtype="float16")
  assert (tmp_path / "taken" / "x").read_text() == "keep me" and not (tmp_path / "new").exists()


@pytest.mark.slow   # loads the 135M GGUF and writes 540 MB
# heavy: ~45 s (the real model's load, export and reload). CI runs the same export_model -> load path on
# tiny llama / qwen2 / qwen3 models in test_export_round_trip_gives_the_same_parameters_and_logits.
@pytest.mark.heavy
def test_exported_smollm2_reads_back_with_the_same_logits(tmp_path):
  model, tokenizer = load("smollm2-135m-instruct")
  out = export.export_model(model, tokenizer, str(tmp_path / "smollm2"))
  loaded, _ = load(out)
  want, got = _logits(model), _logits(loaded)
  assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("qwen2", dict(qkv_bias=True)), ("qwen3", dict(qk_norm=True))])
def test_export_says_how_to_stop(tmp_path, tokenizer, arch, overrides):
  # transformers reads the export's token ids: SmolLM2's tokenizer ends a turn with <|im_end|> = 2 and opens one
  # with <|im_start|> = 1 (its GGUF's tokenizer.ggml.eos/bos_token_id). Without them in config.json AutoConfig
  # gives None, and with no generation_config.json generate() falls back to per-family class defaults.
  from transformers import AutoConfig, GenerationConfig
  model = Llama(tiny_config(vocab_size=len(tokenizer), arch=arch, **overrides), rngs=nnx.Rngs(0))
  out = export.export_model(model, tokenizer, str(tmp_path / arch))
  config = AutoConfig.from_pretrained(out)
  assert (config.eos_token_id, config.bos_token_id) == (2, 1)
  generation = GenerationConfig.from_pretrained(out)
  assert (generation.eos_token_id, generation.bos_token_id) == (2, 1)   # the source GGUF's one stop id, 2


def test_export_keeps_the_source_models_stop_list(tmp_path, tokenizer):
  # A source whose generation config lists two stop ids (as Qwen2.5-Instruct's <|im_end|> and <|endoftext|>)
  # exports both, and the export loads back with the same stop set.
  from transformers import GenerationConfig
  from branch_replay_jax.models.loading import stop_ids, with_generation_config
  source = with_generation_config(copy.copy(tokenizer), {"eos_token_id": [2, 0], "temperature": 0.7})
  model = Llama(tiny_config(vocab_size=len(source)), rngs=nnx.Rngs(0))
  out = export.export_model(model, source, str(tmp_path / "m"))
  generation = GenerationConfig.from_pretrained(out)
  assert generation.eos_token_id == [2, 0] and generation.temperature == 0.7
  assert stop_ids(load(out)[1]) == (2, 0)


# ---------------------------------------------------------------------------------------------
# Exporting a run: the run's model, tokenizer and chat template.

def _run_with_a_checkpoint(run_dir, **overrides):
  """A :lora_smoke run directory as the loop starts it (experiment.json) with its step-1 checkpoint: the
  untrained adapters (B = 0), so the export must equal the tiny base model. No step runs."""
  from branch_replay_jax.algorithms import grpo, runs
  from conftest import experiment_config
  from experiments import grpo_smollm2_arith
  config = experiment_config(grpo_smollm2_arith, "lora_smoke", run_dir, **overrides)
  run = runs.start_run(config, grpo.GRPO(config).fingerprint())
  run.ckpt.save(1, {"params": run.params, "opt_state": run.opt_state, "rng": jax.random.key_data(run.key)},
                {"step": 1, "data_pos": 2})
  run.ckpt.close()
  return config


@pytest.mark.slow   # reads SmolLM2's GGUF tokenizer twice (run start and export)
def test_export_reads_the_runs_config_and_chat_template_and_logs_no_info(tmp_path, caplog):
  # The run trained rank-2 adapters; the experiment file now says rank 4. The export restores the run's rank
  # (with the file's rank the restore would fail on the adapter shapes), writes the chat template the run
  # recorded, and orbax's INFO lines (one per restore phase) stay off the console.
  import logging
  from experiments import grpo_smollm2_arith
  from conftest import experiment_config
  _run_with_a_checkpoint(tmp_path / "run", **{"lora.rank": 2})
  record = json.loads((tmp_path / "run" / "experiment.json").read_text())
  assert record["config"]["lora"]["rank"] == 2
  record["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
  (tmp_path / "run" / "experiment.json").write_text(json.dumps(record))
  config = experiment_config(grpo_smollm2_arith, "lora_smoke", tmp_path / "run")
  with caplog.at_level(logging.INFO):
    out = export.export_run(config, str(tmp_path / "hf"))
  assert not [r for r in caplog.records if r.name == "absl" and r.levelno < logging.WARNING]
  _, tok = load(out)
  assert tok.chat_template == record["chat_template"]


def test_export_refuses_another_model_and_a_missing_run_by_name(tmp_path):
  # Both before anything loads: the run dir's experiment.json is all that is read.
  from experiments import grpo_smollm2_arith
  from conftest import experiment_config
  from branch_replay_jax.outputs.checkpoints import write_run_record
  (tmp_path / "run").mkdir()
  write_run_record(str(tmp_path / "run"), {"model": "tiny"}, None, None)
  config = experiment_config(grpo_smollm2_arith, "", tmp_path / "run")   # model.name smollm2-135m-instruct
  with pytest.raises(ValueError, match=r"export: model.name='smollm2-135m-instruct' but run_dir=.* trained "
                                       r"model.name='tiny'"):
    export.export_run(config, str(tmp_path / "hf"))
  with pytest.raises(ValueError, match=r"run_dir='.*/nothing' holds no run \(no experiment.json\); train there "
                                       r"first, or export the base model with --base"):
    export.export_run(experiment_config(grpo_smollm2_arith, "", tmp_path / "nothing"), str(tmp_path / "hf"))
  assert not (tmp_path / "nothing").exists() and not (tmp_path / "hf").exists()


def test_export_base_writes_the_model_before_training(tmp_path):
  # --base: no run directory; the tiny model of seed 0 is the one a run of seed 0 starts from.
  from branch_replay_jax.algorithms import runs
  from experiments import grpo_smollm2_arith
  from conftest import experiment_config
  config = experiment_config(grpo_smollm2_arith, "smoke", tmp_path / "never")
  out = export.export_base(config, str(tmp_path / "hf"))
  loaded, _ = load(out)
  want = nnx.to_pure_dict(nnx.state(runs.build_model(config)[0], nnx.Param))
  got = nnx.to_pure_dict(nnx.state(loaded, nnx.Param))
  assert all(jax.tree_util.tree_leaves(jax.tree_util.tree_map(lambda a, b: bool(np.array_equal(a, b)), got, want)))
  assert not (tmp_path / "never").exists()
