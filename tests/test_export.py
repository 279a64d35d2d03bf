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
from branch_replay_jax.models.loading import load, load_tokenizer

TOKENS = np.array([[1, 17, 300, 42, 9, 2048, 5, 77]])


def _logits(model):
  out = model(jnp.asarray(TOKENS), 0)
  return np.asarray(model.logits(out.hidden_btd))


@pytest.fixture(scope="module")
def tokenizer():
  return load_tokenizer("smollm2-135m-instruct")


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
