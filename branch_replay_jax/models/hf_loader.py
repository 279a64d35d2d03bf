"""Read a Hugging Face checkpoint directory (config.json + *.safetensors) with numpy, without torch."""

from __future__ import annotations

import glob
import json
import os

import numpy as np
from safetensors import safe_open

from branch_replay_jax.models.config import ARCHITECTURES, Llama3RopeScaling, ModelConfig

GLOBAL_NAMES = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm", "lm_head.weight": "lm_head"}
LAYER_PREFIX = "model.layers.{}."
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "mlp_norm",
    "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v",
    "self_attn.o_proj.weight": "o",
    "mlp.gate_proj.weight": "gate",
    "mlp.up_proj.weight": "up",
    "mlp.down_proj.weight": "down",
    "self_attn.q_proj.bias": "bq",
    "self_attn.k_proj.bias": "bk",
    "self_attn.v_proj.bias": "bv",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
}


def _rope(cfg: dict, path: str) -> tuple[float, Llama3RopeScaling | None]:
  """(theta, scaling) from transformers-5 `rope_parameters` or the older `rope_theta` + `rope_scaling`."""
  params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
  theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type == "default":
    return theta, None
  if rope_type == "llama3":
    return theta, Llama3RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )
  raise ValueError(f"{path}: rope_type {rope_type!r} is not supported; expected 'default' or 'llama3'")


def read_config(directory: str) -> ModelConfig:
  """The `ModelConfig` of `directory/config.json`.

  Raises:
    ValueError: a model_type other than llama/qwen2/qwen3, or an option our model does not
      implement (attention/MLP bias on Llama, sliding-window attention, a non-SiLU MLP,
      RoPE types other than default/llama3).
  """
  path = os.path.join(directory, "config.json")
  with open(path) as f:
    cfg = json.load(f)
  arch = cfg.get("model_type")
  if arch not in ARCHITECTURES:
    raise ValueError(f"{path}: model_type {arch!r} is not supported; expected one of {ARCHITECTURES}")
  unsupported = {
      "attention_bias": arch != "qwen2" and cfg.get("attention_bias", False),
      "mlp_bias": cfg.get("mlp_bias", False),
      "use_sliding_window": cfg.get("use_sliding_window", False),
      "hidden_act != silu": cfg.get("hidden_act", "silu") != "silu",
  }
  for option, present in unsupported.items():
    if present:
      raise ValueError(f"{path}: {option} is not supported by our {arch} decoder")
  theta, scaling = _rope(cfg, path)
  heads = int(cfg["num_attention_heads"])
  return ModelConfig(
      arch=arch,
      vocab_size=int(cfg["vocab_size"]),
      num_layers=int(cfg["num_hidden_layers"]),
      d_model=int(cfg["hidden_size"]),
      num_heads=heads,
      num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
      head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
      ffn_dim=int(cfg["intermediate_size"]),
      rope_theta=theta,
      rope_scaling=scaling,
      norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
      qkv_bias=arch == "qwen2",
      qk_norm=arch == "qwen3",
      max_positions=int(cfg.get("max_position_embeddings", 8192)),
  )


def read_tensors(directory: str) -> dict[str, np.ndarray]:
  """Every tensor of `directory/*.safetensors` as float32 numpy arrays (bf16/f16 upcast exactly).

  Raises:
    ValueError: no safetensors file, or a tensor name present in two files.
  """
  files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
  if not files:
    raise ValueError(f"{directory}: no *.safetensors file")
  tensors = {}
  for file in files:
    with safe_open(file, framework="np") as f:
      for name in f.keys():
        if name in tensors:
          raise ValueError(f"{file}: tensor {name!r} also appears in another safetensors file")
        tensors[name] = np.asarray(f.get_tensor(name), dtype=np.float32)
  return tensors


def load_tokenizer(directory: str):
  """`AutoTokenizer.from_pretrained(directory)` from local files only.

  Raises:
    ValueError: the directory holds no tokenizer files.
  """
  from transformers import AutoTokenizer

  if not any(os.path.exists(os.path.join(directory, f)) for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
    raise ValueError(f"{directory}: no tokenizer.json, tokenizer.model or vocab.json")
  return AutoTokenizer.from_pretrained(directory, local_files_only=True)
