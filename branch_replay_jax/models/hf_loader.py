"""Read a Hugging Face checkpoint directory (config.json + *.safetensors) with numpy, without torch."""

from __future__ import annotations

import glob
import json
import logging
import os

import numpy as np
from safetensors import safe_open

from branch_replay_jax.models.config import ARCHITECTURES, Llama3RopeScaling, ModelConfig, default_rope_theta

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


def _rope(cfg: dict, arch: str, path: str) -> tuple[float, Llama3RopeScaling | None]:
  """(theta, scaling) from transformers-5 `rope_parameters` or the older `rope_theta` + `rope_scaling`;
  without rope_theta the family's documented default, logged, or a ValueError (`config.default_rope_theta`)."""
  params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
  theta = params.get("rope_theta", cfg.get("rope_theta"))
  theta = float(default_rope_theta(arch, "rope_theta", path) if theta is None else theta)
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
      RoPE types other than default/llama3), or no rope_theta in a qwen2/qwen3 config
      (`config.default_rope_theta`; llama takes 10000 with a warning).
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
  theta, scaling = _rope(cfg, arch, path)
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


def check_safetensors(file: str) -> None:
  """Refuse a truncated or corrupt safetensors file before reading it, naming the file, the first
  tensor that does not fit and the bytes expected and found.

  The format (https://github.com/huggingface/safetensors, "Format"): an 8-byte little-endian
  header length N, N bytes of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}}, then
  the data; offsets count from byte 8 + N.

  Raises:
    ValueError: e.g. "x.safetensors: truncated or corrupt safetensors file (1000000 bytes): tensor
      'model.layers.0.mlp.up_proj.weight' expects 884736 bytes at offset 700000, found 300000
      (12 more tensors lie beyond the end)"; or a header longer than the file or not JSON.
  """
  size = os.path.getsize(file)
  with open(file, "rb") as f:
    head = f.read(8)
    if len(head) < 8:
      raise ValueError(f"{file}: truncated or corrupt safetensors file ({size} bytes): the header length expects "
                       f"8 bytes at offset 0, found {len(head)}")
    n = int.from_bytes(head, "little")
    if 8 + n > size:
      raise ValueError(f"{file}: truncated or corrupt safetensors file ({size} bytes): the header expects {n} bytes "
                       f"at offset 8, found {size - 8}")
    try:
      header = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise ValueError(f"{file}: corrupt safetensors file ({size} bytes): its {n}-byte header is not JSON ({e})") from e
  try:
    spans = sorted((int(v["data_offsets"][0]), int(v["data_offsets"][1]), name) for name, v in header.items()
                   if name != "__metadata__" and isinstance(v, dict) and "data_offsets" in v)
  except (AttributeError, IndexError, TypeError, ValueError) as e:   # a header of another shape
    raise ValueError(f"{file}: corrupt safetensors file ({size} bytes): its header is not "
                     f"{{name: {{dtype, shape, data_offsets: [begin, end]}}}} ({e!r})") from None
  short = [(b, e, name) for b, e, name in spans if 8 + n + e > size]
  if short:
    begin, end, name = short[0]
    more = f" ({len(short) - 1} more tensors lie beyond the end)" if len(short) > 1 else ""
    raise ValueError(f"{file}: truncated or corrupt safetensors file ({size} bytes): tensor {name!r} expects "
                     f"{end - begin} bytes at offset {8 + n + begin}, found {max(0, size - 8 - n - begin)}{more}")


INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"


def weight_files(directory: str) -> dict[str, list[str] | None]:
  """{file: the tensor names to read from it (None: all)}, the files transformers' loader reads:
  with `model.safetensors.index.json`, the shards its weight_map names, each for the tensors the
  index puts in it; else `model.safetensors`; else every `*.safetensors`. Other safetensors files
  (a stray consolidated file beside shards, a PEFT adapter, vLLM PR #54230) are ignored, with a
  warning naming them.

  Raises:
    ValueError: no safetensors file; an index that is not JSON or has no weight_map of
      {tensor: file}; a shard the index names that is not in the directory (naming it and one of
      its tensors).
  """
  every = sorted(os.path.normpath(f) for f in glob.glob(os.path.join(glob.escape(directory), "*.safetensors")))
  index = os.path.join(directory, INDEX)
  if os.path.isfile(index):
    try:
      with open(index, encoding="utf-8") as f:
        weight_map = json.load(f).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
      raise ValueError(f"{index}: not a safetensors index ({e})") from None
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
      raise ValueError(f"{index}: no weight_map of {{tensor: file}} (an empty one names no tensor)")
    plan: dict[str, list[str] | None] = {}
    for name, file in weight_map.items():
      plan.setdefault(os.path.normpath(os.path.join(directory, file)), []).append(name)
    for file, names in plan.items():
      if not os.path.isfile(file):
        raise ValueError(f"{directory}: {INDEX} puts {len(names)} tensors (e.g. {names[0]!r}) in the shard "
                         f"{os.path.basename(file)!r}, which is not in the directory")
  elif os.path.isfile(os.path.join(directory, SINGLE)):
    plan = {os.path.normpath(os.path.join(directory, SINGLE)): None}
  elif every:
    plan = {file: None for file in every}
  else:
    raise ValueError(f"{directory}: no *.safetensors file")
  ignored = [os.path.basename(f) for f in every if f not in plan]
  if ignored:
    logging.getLogger(__name__).warning("%s: ignoring %s: not named by %s", directory, ignored,
                                        INDEX if os.path.isfile(index) else SINGLE)
  return plan


def read_tensors(directory: str) -> dict[str, np.ndarray]:
  """The checkpoint's tensors (`weight_files`: what the index, or model.safetensors, names) as
  float32 numpy arrays (bf16/f16 upcast exactly).

  Raises:
    ValueError: `weight_files`'; a truncated or corrupt file (`check_safetensors`: the file, the
      tensor and the bytes expected and found); a tensor the index puts in a shard that lacks it; a
      tensor name in two files (without an index).
  """
  tensors = {}
  for file, names in weight_files(directory).items():
    check_safetensors(file)
    with safe_open(file, framework="np") as f:
      keys = set(f.keys())
      for name in names if names is not None else sorted(keys):
        if name not in keys:
          raise ValueError(f"{file}: {INDEX} puts tensor {name!r} in this shard, but it is not there")
        if name in tensors:
          raise ValueError(f"{file}: tensor {name!r} also appears in another safetensors file")
        tensors[name] = np.asarray(f.get_tensor(name), dtype=np.float32)
  return tensors


GENERATION_FIELDS = ("eos_token_id", "bos_token_id", "pad_token_id")


def generation_config(directory: str) -> dict:
  """The checkpoint's generation settings: `directory/generation_config.json` as written, or without
  one the token ids of config.json (`GENERATION_FIELDS`, as transformers' GenerationConfig.from_model_config
  takes them); {} when neither names any. eos_token_id may be an int or a list of ints."""
  path = os.path.join(directory, "generation_config.json")
  if os.path.isfile(path):
    with open(path) as f:
      return json.load(f)
  with open(os.path.join(directory, "config.json")) as f:
    cfg = json.load(f)
  return {k: cfg[k] for k in GENERATION_FIELDS if cfg.get(k) is not None}


def load_tokenizer(directory: str):
  """`AutoTokenizer.from_pretrained(directory)` from local files only.

  Raises:
    ValueError: the directory holds no tokenizer files.
  """
  from transformers import AutoTokenizer

  if not any(os.path.exists(os.path.join(directory, f)) for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
    raise ValueError(f"{directory}: no tokenizer.json, tokenizer.model or vocab.json")
  return AutoTokenizer.from_pretrained(directory, local_files_only=True)
