"""Read a Hugging Face checkpoint directory (config.json + *.safetensors) with numpy, without torch."""

from __future__ import annotations

import glob
import json
import logging
import os

import numpy as np
from safetensors import safe_open

from branch_replay_jax.models.config import (ARCHITECTURES, FULL, LINEAR, SLIDING, GatedDeltaNetShape, LinearRopeScaling,
                                             Llama3RopeScaling, ModelConfig, default_rope_theta)

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
# Gemma 3 norms before and after attention and MLP: its post_attention_layernorm is the norm after
# attention, not Llama's norm before the MLP (that is pre_feedforward_layernorm).
GEMMA_LAYER_NAMES = {**LAYER_NAMES, "post_attention_layernorm.weight": "post_attn_norm",
                     "pre_feedforward_layernorm.weight": "mlp_norm",
                     "post_feedforward_layernorm.weight": "post_mlp_norm"}


ROUTER_TENSOR = "mlp.gate.weight"   # a mixture of experts' router [E, d] (Qwen3-MoE, Qwen3.5-MoE)


def expert_tensor(e: int, proj: str) -> str:
  """The layer-relative name of expert e's projection `proj` ("gate", "up" or "down") in a mixture of experts'
  checkpoint (Qwen3-MoE's and Qwen3.5-MoE's, as transformers writes them)."""
  return f"mlp.experts.{e}.{proj}_proj.weight"


def layer_names(arch: str, num_experts: int | None = None) -> dict[str, str]:
  """{HF layer tensor suffix: canonical name} of a family (`ModelConfig.arch`); Qwen3-MoE's MLP is its router
  ("mlp.gate", canonical "router") and each expert e's projections (canonical "gate.e", "up.e", "down.e")."""
  if arch == "qwen3_moe":
    names = {k: v for k, v in LAYER_NAMES.items() if not k.startswith("mlp.")}
    names[ROUTER_TENSOR] = "router"
    for e in range(num_experts):
      names.update({expert_tensor(e, kind): f"{kind}.{e}" for kind in ("gate", "up", "down")})
    return names
  return GEMMA_LAYER_NAMES if arch == "gemma3_text" else LAYER_NAMES


def _rope(cfg: dict, arch: str, path: str, params: dict | None = None) -> tuple[float, Llama3RopeScaling | None]:
  """(theta, scaling) from transformers-5 `rope_parameters` (or `params`, one layer type's) or the older
  `rope_theta` + `rope_scaling`; without rope_theta the family's documented default, logged, or a
  ValueError (`config.default_rope_theta`)."""
  params = dict(params or cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
  theta = params.get("rope_theta", cfg.get("rope_theta"))
  theta = float(default_rope_theta(arch, "rope_theta", path) if theta is None else theta)
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type == "default":
    return theta, None
  if rope_type == "linear":
    return theta, LinearRopeScaling(float(params["factor"]))
  if rope_type == "llama3":
    return theta, Llama3RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )
  raise ValueError(f"{path}: rope_type {rope_type!r} is not supported; expected 'default', 'linear' or 'llama3'")


def _gemma_fields(cfg: dict, path: str) -> dict:
  """ModelConfig fields of a Gemma 3 text config (`Gemma3TextConfig`): layer_types (written, or from the
  older sliding_window_pattern: every n-th layer full), the window, each layer type's RoPE, the query
  scale. Refuses what our decoder does not implement, naming it."""
  refused = {"attn_logit_softcapping": cfg.get("attn_logit_softcapping") is not None,
             "final_logit_softcapping": cfg.get("final_logit_softcapping") is not None,
             "use_bidirectional_attention": bool(cfg.get("use_bidirectional_attention")),
             "hidden_activation != gelu_pytorch_tanh":
                 cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh"}
  for option, present in refused.items():
    if present:
      raise ValueError(f"{path}: {option} is not supported by our gemma3_text decoder")
  layers = int(cfg["num_hidden_layers"])
  types = cfg.get("layer_types")
  if types is None:
    n = int(cfg.get("sliding_window_pattern", 6))
    types = [FULL if (i + 1) % n == 0 else SLIDING for i in range(layers)]
  rope = cfg.get("rope_parameters") or {}
  if not all(kind in rope for kind in (FULL, SLIDING)):   # transformers-4 keys
    rope = {FULL: {"rope_theta": cfg.get("rope_theta", 1000000.0), **(cfg.get("rope_scaling") or {})},
            SLIDING: {"rope_theta": cfg.get("rope_local_base_freq", 10000.0), "rope_type": "default"}}
  theta, scaling = _rope(cfg, "gemma3_text", path, rope[FULL])
  local_theta, local_scaling = _rope(cfg, "gemma3_text", path, rope[SLIDING])
  if local_scaling is not None:
    raise ValueError(f"{path}: RoPE scaling on sliding_attention layers is not supported")
  return dict(layer_types=tuple(types), sliding_window=int(cfg.get("sliding_window") or 4096),
              rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta,
              query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)), qk_norm=True,
              tie_embeddings=bool(cfg.get("tie_word_embeddings", True)))


def _gemma4_fields(cfg: dict, path: str) -> dict:
  """ModelConfig fields of a Gemma 4 text config (`Gemma4TextConfig`, models/gemma4.py): the sliding layers'
  shape (the common fields) and the global layers' (global_head_dim and num_global_key_value_heads, or the
  per_layer_config transformers 5 writes of them; the K/V heads are the global ones only with
  attention_k_eq_v, as in transformers), each layer type's RoPE, the logit cap, with enable_moe_block the
  experts' count, top k and width (26B-A4B), and E2B/E4B's per-layer embedding width, K/V-sharing layers and
  double-wide MLP. Refuses what our decoder does not implement, naming it."""
  ple = cfg.get("hidden_size_per_layer_input") or None
  table = cfg.get("vocab_size_per_layer_input", cfg["vocab_size"])
  refused = {f"vocab_size_per_layer_input={table!r} != vocab_size={cfg['vocab_size']!r} (a per-layer embedding "
             "table of another vocabulary)": ple is not None and table != cfg["vocab_size"],
             "use_bidirectional_attention": bool(cfg.get("use_bidirectional_attention")),
             "attention_bias": bool(cfg.get("attention_bias")),
             "hidden_activation != gelu_pytorch_tanh":
                 cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh",
             "tie_word_embeddings=false": not cfg.get("tie_word_embeddings", True)}
  for option, present in refused.items():
    if present:
      raise ValueError(f"{path}: {option} is not supported by our gemma4_text decoder")
  if "sliding_window" in cfg and cfg["sliding_window"] is None:   # transformers refuses it too
    raise ValueError(f"{path}: sliding_window=null; Gemma 4's sliding layers need a window (an int)")
  layers = int(cfg["num_hidden_layers"])
  types = list(cfg.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(layers)])
  types[-1] = FULL   # transformers forces the last layer global
  k_eq_v = _flag(cfg, path, "attention_k_eq_v")
  head_dim = _int(cfg, path, "head_dim", default=256)
  kv_heads = _int(cfg, path, "num_key_value_heads")
  common = {"head_dim": head_dim, "num_key_value_heads": kv_heads}
  if "per_layer_config" in cfg:   # as transformers 5 writes it: a layer it leaves out has the common shape
    overrides = {int(k): v for k, v in (cfg["per_layer_config"] or {}).items()}
  else:   # the released files' global_head_dim / num_global_key_value_heads, as transformers' __post_init__ reads them
    glob = {"head_dim": _int(cfg, path, "global_head_dim", default=512)}
    if k_eq_v and cfg.get("num_global_key_value_heads") is not None:
      glob["num_key_value_heads"] = _int(cfg, path, "num_global_key_value_heads")
    overrides = {i: glob for i, kind in enumerate(types) if kind == FULL}
  shape = lambda i: {**common, **{k: v for k, v in overrides.get(i, {}).items() if k in common}}
  first_global = types.index(FULL)
  for i, kind in enumerate(types):   # every global layer the same shape, every sliding one the common one
    want, whose = (shape(first_global), f"layer {first_global}'s") if kind == FULL else (common, "the common one")
    if shape(i) != want:
      raise ValueError(f"{path}: per_layer_config gives layer {i} ({kind}) the shape {shape(i)}, not {whose} {want}; "
                       "our gemma4_text decoder takes one shape per layer type")
  global_head_dim, global_kv = shape(first_global)["head_dim"], shape(first_global)["num_key_value_heads"]
  rope = cfg.get("rope_parameters") or {}
  full = dict(rope.get(FULL) or {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6})
  local = dict(rope.get(SLIDING) or {"rope_type": "default", "rope_theta": 10000.0})
  if full.get("rope_type") != "proportional" or local.get("rope_type", "default") != "default":
    raise ValueError(f"{path}: rope_parameters {rope}: our gemma4_text decoder takes 'proportional' on "
                     "full_attention and 'default' on sliding_attention layers")
  factor = float(full.get("factor", 1.0))
  cap = cfg.get("final_logit_softcapping")
  moe = {}
  if _flag(cfg, path, "enable_moe_block"):   # 26B-A4B: experts beside every layer's MLP; the router always renormalises
    moe = dict(num_experts=_int(cfg, path, "num_experts"), experts_per_token=_int(cfg, path, "top_k_experts"),
               expert_ffn_dim=_int(cfg, path, "moe_intermediate_size"), norm_topk_prob=True)
    if not 0 < moe["experts_per_token"] <= moe["num_experts"]:
      raise ValueError(f"{path}: top_k_experts={moe['experts_per_token']} must be in 1..num_experts="
                       f"{moe['num_experts']}")
  shared = _int(cfg, path, "num_kv_shared_layers", default=0)
  small = dict(per_layer_input_dim=None if ple is None else _int(cfg, path, "hidden_size_per_layer_input"),
               kv_shared_layers=shared, double_wide_mlp=_flag(cfg, path, "use_double_wide_mlp") and shared > 0)
  return dict(layer_types=tuple(types), sliding_window=_int(cfg, path, "sliding_window", default=512),
              rope_theta=float(full.get("rope_theta", 1e6)),
              rope_scaling=None if factor == 1.0 else LinearRopeScaling(factor),
              rope_local_theta=float(local.get("rope_theta", 10000.0)), head_dim=head_dim, num_kv_heads=kv_heads,
              global_head_dim=int(global_head_dim), global_kv_heads=int(global_kv), k_eq_v=k_eq_v,
              global_rope_fraction=float(full.get("partial_rotary_factor", 1.0)),
              final_logit_softcap=None if cap is None else float(cap), tie_embeddings=True, **moe, **small)


def _qwen3_5_fields(cfg: dict, path: str) -> dict:
  """`ModelConfig` fields of a transformers `Qwen3_5TextConfig` (config.json), beside the common ones
  `read_config` reads; refuses what the decoder does not implement, naming it.

  Raises:
    ValueError: attention_bias, a hidden_act other than silu, a rope_type other than default, or
      layer_types with a value other than linear_attention / full_attention.
  """
  for option, present in {"attention_bias": bool(cfg.get("attention_bias")),
                          "hidden_act != silu": cfg.get("hidden_act", "silu") != "silu"}.items():
    if present:
      raise ValueError(f"{path}: {option} is not supported by our qwen3_5_text decoder")
  rope = dict(cfg.get("rope_parameters") or {})
  if rope.get("rope_type", "default") != "default":
    raise ValueError(f"{path}: rope_type {rope.get('rope_type')!r} is not supported by our qwen3_5_text decoder")
  layers = int(cfg["num_hidden_layers"])
  types = cfg.get("layer_types")
  if types is None:
    every = int(cfg.get("full_attention_interval", 4))
    types = [FULL if (i + 1) % every == 0 else LINEAR for i in range(layers)]
  head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
  shape = GatedDeltaNetShape(int(cfg.get("linear_num_key_heads", 16)), int(cfg.get("linear_num_value_heads", 32)),
                             int(cfg.get("linear_key_head_dim", 128)), int(cfg.get("linear_value_head_dim", 128)),
                             int(cfg.get("linear_conv_kernel_dim", 4)))
  return dict(layer_types=tuple(types), linear_attention=shape, qk_norm=True,
              rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000000.0))),
              rotary_dim=int(head_dim * float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))),
              tie_embeddings=bool(cfg.get("tie_word_embeddings", False)))


# Multimodal checkpoints whose language model we train: {model_type: its text model's model_type}. The released
# Qwen3.5 checkpoints and Gemma 3 from 4B up are these (transformers' Qwen3_5ForConditionalGeneration,
# Gemma3ForConditionalGeneration); only their language model is read (`language_model_tensor`).
MULTIMODAL = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text", "gemma3": "gemma3_text",
              "gemma4": "gemma4_text"}
# A multimodal checkpoint's language-model tensors, named as the text model's: transformers 5 writes
# model.language_model.*, Gemma 3's released files language_model.model.* and language_model.lm_head.*
# (transformers' conversion_mapping.py renames them the same way).
LANGUAGE_MODEL_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                           ("language_model.lm_head.", "lm_head."))
# What the text model does not hold: the vision tower and its projector (Gemma 4's embed_vision), Gemma 4's audio
# tower and its embed_audio, and Qwen3.5's multi-token-prediction layers (transformers' Qwen3_5ForCausalLM
# ignores ^mtp.* and ^model.visual.* alike).
SKIPPED_PREFIXES = ("model.visual.", "model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
                    "multi_modal_projector.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.", "mtp.")


def language_model_tensor(name: str, multimodal: bool) -> str | None:
  """The text model's name of a checkpoint tensor: a multimodal checkpoint's language-model tensor renamed
  (`LANGUAGE_MODEL_PREFIXES`), None for a tensor the text model does not hold (`SKIPPED_PREFIXES`; in a text
  checkpoint only Qwen3.5's mtp.*), else the name itself (a tensor of neither kind is then refused by
  `check_tensors` as unexpected)."""
  if name.startswith(SKIPPED_PREFIXES if multimodal else ("mtp.",)):
    return None
  if multimodal:
    for prefix, text in LANGUAGE_MODEL_PREFIXES:
      if name.startswith(prefix):
        return text + name[len(prefix):]
  return name


def text_config(directory: str) -> tuple[dict, bool]:
  """(the text model's config.json fields, whether the checkpoint is multimodal): config.json as written, or
  for a multimodal model_type (`MULTIMODAL`) its text_config with transformers' defaults filled in (released
  files write only the fields that differ: `AutoConfig`, local files only, no torch) and the checkpoint's own
  tie_word_embeddings (the multimodal model ties its lm_head to the language model's embeddings)."""
  path = os.path.join(directory, "config.json")
  with open(path) as f:
    cfg = json.load(f)
  if cfg.get("model_type") not in MULTIMODAL:
    return cfg, False
  written = (cfg.get("text_config") or {}).get("model_type", MULTIMODAL[cfg["model_type"]])
  if written != MULTIMODAL[cfg["model_type"]]:   # AutoConfig would read it as the expected family's regardless
    raise ValueError(f"{path}: model_type {cfg['model_type']!r} with a text_config of model_type {written!r}; "
                     f"expected {MULTIMODAL[cfg['model_type']]!r}")
  from transformers import AutoConfig

  text = AutoConfig.from_pretrained(directory, local_files_only=True).get_text_config().to_dict()
  if "tie_word_embeddings" in cfg:
    text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
  return text, True


def _int(cfg: dict, path: str, key: str, *fallbacks: str, default=None) -> int:
  """config.json's int field `key` (else the first of `fallbacks` present; a null counts as absent), or `default`.

  Raises:
    ValueError: naming the file and the key: absent with no default, or not an int (a bool, 8.7, "8")."""
  value = next((cfg[k] for k in (key, *fallbacks) if cfg.get(k) is not None), default)
  if value is None:
    raise ValueError(f"{path}: no {' or '.join((key, *fallbacks))}; our decoder needs it")
  if isinstance(value, bool) or not isinstance(value, int):
    raise ValueError(f"{path}: {key}={value!r} must be an int")
  return value


def _flag(cfg: dict, path: str, key: str) -> bool:
  """config.json's bool field `key` (absent or null: False).

  Raises:
    ValueError: naming the file and the key, for a value that is not a JSON bool ("false" is a string)."""
  value = cfg.get(key)
  if value is not None and not isinstance(value, bool):
    raise ValueError(f"{path}: {key}={value!r} must be true or false")
  return bool(value)


def read_config(directory: str) -> ModelConfig:
  """The `ModelConfig` of `directory/config.json` (of its language model for a multimodal qwen3_5 or gemma3
  checkpoint: `text_config`).

  Raises:
    ValueError: a model_type other than llama/qwen2/qwen3/gemma3_text/qwen3_5_text/qwen3_moe and the multimodal
      gemma3/qwen3_5, or an option our model does not
      implement (attention/MLP bias on Llama, Qwen's sliding-window attention, a non-SiLU MLP,
      RoPE types other than default/linear/llama3; Gemma's soft-capping, bidirectional attention),
      or no rope_theta in a qwen2/qwen3 config (`config.default_rope_theta`; llama takes 10000
      with a warning).
  """
  path = os.path.join(directory, "config.json")
  try:
    return _read_config(directory, path)
  except ValueError as e:   # ModelConfig's own checks name its field; say which file holds it
    if str(e).startswith("ModelConfig."):
      raise ValueError(f"{path}: {e}") from None
    raise


def _read_config(directory: str, path: str) -> ModelConfig:
  cfg, _ = text_config(directory)
  arch = cfg.get("model_type")
  if arch not in ARCHITECTURES:
    raise ValueError(f"{path}: model_type {arch!r} is not supported; expected one of {ARCHITECTURES} or a "
                     f"multimodal {tuple(MULTIMODAL)} (its language model)")
  heads, d = _int(cfg, path, "num_attention_heads"), _int(cfg, path, "hidden_size")
  common = dict(arch=arch, vocab_size=_int(cfg, path, "vocab_size"), num_layers=_int(cfg, path, "num_hidden_layers"),
                d_model=d, num_heads=heads, num_kv_heads=_int(cfg, path, "num_key_value_heads", default=heads),
                head_dim=_int(cfg, path, "head_dim", default=d // heads),
                ffn_dim=_int(cfg, path, "shared_expert_intermediate_size" if arch == "qwen3_5_moe_text"
                             else "intermediate_size"),
                norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                max_positions=_int(cfg, path, "max_position_embeddings", default=8192))
  if arch == "gemma3_text":
    if cfg.get("attention_bias", False):
      raise ValueError(f"{path}: attention_bias is not supported by our gemma3_text decoder")
    return ModelConfig(**common, **_gemma_fields(cfg, path))
  if arch == "gemma4_text":
    return ModelConfig(**{**common, **_gemma4_fields(cfg, path)})
  if arch == "qwen3_5_text":
    return ModelConfig(**common, **_qwen3_5_fields(cfg, path))
  if arch == "qwen3_5_moe_text":   # Qwen3.5's layers, every MLP experts plus a shared expert; the router renormalises
    return ModelConfig(**common, **_qwen3_5_fields(cfg, path), num_experts=_int(cfg, path, "num_experts"),
                       experts_per_token=_int(cfg, path, "num_experts_per_tok"),
                       expert_ffn_dim=_int(cfg, path, "moe_intermediate_size"), norm_topk_prob=True)
  unsupported = {
      "attention_bias": arch != "qwen2" and cfg.get("attention_bias", False),
      "mlp_bias": cfg.get("mlp_bias", False),
      "use_sliding_window": cfg.get("use_sliding_window", False),
      "hidden_act != silu": cfg.get("hidden_act", "silu") != "silu",
  }
  for option, present in unsupported.items():
    if present:
      raise ValueError(f"{path}: {option} is not supported by our {arch} decoder")
  moe = {}
  if arch == "qwen3_moe":
    every, dense = _int(cfg, path, "decoder_sparse_step", default=1), list(cfg.get("mlp_only_layers") or [])
    if every != 1 or dense:
      raise ValueError(f"{path}: decoder_sparse_step={every}, mlp_only_layers={dense}: dense MLP layers among the "
                       "experts are not supported by our qwen3_moe decoder (every layer a mixture of experts)")
    moe = dict(num_experts=_int(cfg, path, "num_experts", "num_local_experts"),
               experts_per_token=_int(cfg, path, "num_experts_per_tok"),
               expert_ffn_dim=_int(cfg, path, "moe_intermediate_size"),
               norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
  theta, scaling = _rope(cfg, arch, path)
  return ModelConfig(**common, rope_theta=theta, rope_scaling=scaling,
                     tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), qkv_bias=arch == "qwen2",
                     qk_norm=arch in ("qwen3", "qwen3_moe"), **moe)


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


def _few(names: list[str], limit: int = 8) -> str:
  return str(names) if len(names) <= limit else f"{names[:limit]} and {len(names) - limit} more"


def check_tensors(tensors: dict, expected: dict[str, tuple], config: ModelConfig, source: str) -> None:
  """Refuse a checkpoint whose tensors are not exactly `expected` ({file tensor name: shape}).

  Raises:
    ValueError: naming `source`, every missing tensor, every unexpected tensor and every shape mismatch
      (file shape vs expected shape), in one message (the first 8 of each kind).
  """
  missing = [n for n in expected if n not in tensors]
  extra = [n for n in tensors if n not in expected]
  wrong = [f"{n} has shape {tuple(tensors[n].shape)}, expected {expected[n]}" for n in expected
           if n in tensors and tuple(tensors[n].shape) != tuple(expected[n])]
  problems = ([f"missing tensors {_few(missing)}"] if missing else []) + (
      [f"unexpected tensors {_few(extra)}"] if extra else []) + wrong[:8]
  if problems:
    raise ValueError(f"{source}: cannot load into {config}: " + "; ".join(problems))


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


def read_tensors(directory: str, multimodal: bool = False) -> dict[str, np.ndarray]:
  """The checkpoint's tensors (`weight_files`: what the index, or model.safetensors, names) as
  float32 numpy arrays (bf16/f16 upcast exactly), by the text model's names (`language_model_tensor`:
  a multimodal checkpoint's vision tower and Qwen3.5's mtp.* layers are not read).

  Raises:
    ValueError: `weight_files`'; a truncated or corrupt file (`check_safetensors`: the file, the
      tensor and the bytes expected and found); a tensor the index puts in a shard that lacks it; a
      tensor name in two files (without an index).
  """
  tensors, skipped = {}, 0
  for file, names in weight_files(directory).items():
    check_safetensors(file)
    with safe_open(file, framework="np") as f:
      keys = set(f.keys())
      for name in names if names is not None else sorted(keys):
        if name not in keys:
          raise ValueError(f"{file}: {INDEX} puts tensor {name!r} in this shard, but it is not there")
        text = language_model_tensor(name, multimodal)
        if text is None:
          skipped += 1
          continue
        if text in tensors:
          raise ValueError(f"{file}: tensor {name!r} also appears in another safetensors file")
        tensors[text] = np.asarray(f.get_tensor(name), dtype=np.float32)
  if skipped:
    logging.getLogger(__name__).info("%s: %d tensors the language model does not hold were not read (%s)", directory,
                                     skipped, ", ".join(SKIPPED_PREFIXES if multimodal else ("mtp.",)))
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
