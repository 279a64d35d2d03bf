"""Export a trained policy as a Hugging Face directory: config.json, model.safetensors, tokenizer files.

    python -m branch_replay_jax.export --config=experiments/grpo_smollm2_arith.py --out=exported/grpo
    python -m branch_replay_jax.export --config=experiments/ppo_smollm2_arith.py --out=exported/ppo --step=20
    python -m branch_replay_jax.export --config=experiments/grpo_smollm2_arith.py --out=exported/base --base

Reads the run directory of the experiment config (`config.run_dir`, as the training run wrote it:
the model, tokenizer and chat template come from its experiment.json, and a config naming another
model.name is refused), restores the checkpoint of `--step` (default: the latest) and writes the
policy (PPO: the policy trunk, without the critic); `--base` writes config.model.name as loaded,
with no run. The layout is the one transformers, vLLM and our own `models.load` read
(`LlamaForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`, `Gemma3ForCausalLM`, `Gemma4ForCausalLM`, ...). The
tensors are the inverse of
`models.loading.assemble_params`: projections transposed back to [out, in] and heads flattened.
A LoRA run (config.lora) is written with its adapters merged into the base weights
(`models.lora.merged`: W + alpha / r A B), after checking that the checkpoint's base record
matches the base model loaded now.
"""

from __future__ import annotations

import contextlib
import json
import os

import jax
import ml_collections
import numpy as np
from absl import app, flags, logging
from flax import nnx
from ml_collections import config_flags
from safetensors.numpy import save_file

from branch_replay_jax.models import Llama, gemma4, lora, qwen3_5
from branch_replay_jax.models.config import FULL, SLIDING, LinearRopeScaling, ModelConfig
from branch_replay_jax.models.hf_loader import GLOBAL_NAMES, LAYER_PREFIX, layer_names
from branch_replay_jax.models.loading import LAYER_PARAMS, generation_config, stop_ids
from branch_replay_jax.outputs.checkpoints import read_run_record

HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
              "gemma3_text": "Gemma3ForCausalLM", "gemma4_text": "Gemma4ForCausalLM",
              "qwen3_5_text": "Qwen3_5ForCausalLM",
              "qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}
DTYPES = {"float32": np.float32, "bfloat16": "bfloat16"}


def hf_config(config: ModelConfig, dtype: str = "float32") -> dict:
  """The config.json of `config` (transformers' field names; `models.hf_loader.read_config` inverts it)."""
  c = config
  out = {"architectures": [HF_CLASSES[c.arch]], "model_type": c.arch, "vocab_size": c.vocab_size,
         "hidden_size": c.d_model, "intermediate_size": c.ffn_dim, "num_hidden_layers": c.num_layers,
         "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
         "hidden_act": "silu", "max_position_embeddings": c.max_positions, "rms_norm_eps": c.norm_eps,
         "rope_theta": c.rope_theta, "tie_word_embeddings": c.tie_embeddings, "torch_dtype": dtype,
         "attention_bias": c.qkv_bias, "mlp_bias": False}
  if c.rope_scaling is not None and not c.sliding:
    s = c.rope_scaling
    out["rope_scaling"] = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                           "high_freq_factor": s.high_freq_factor,
                           "original_max_position_embeddings": s.original_max_position_embeddings}
  if c.arch == "qwen2":
    out["use_sliding_window"] = False
  if c.gemma:   # transformers-5 Gemma3TextConfig fields (`models.hf_loader._gemma_fields` reads them)
    del out["hidden_act"], out["mlp_bias"], out["rope_theta"]
    full = {"rope_type": "default", "rope_theta": c.rope_theta}
    if isinstance(c.rope_scaling, LinearRopeScaling):
      full = {"rope_type": "linear", "factor": c.rope_scaling.factor, "rope_theta": c.rope_theta}
    out.update(hidden_activation="gelu_pytorch_tanh", layer_types=list(c.layer_types),
               sliding_window=c.sliding_window,
               query_pre_attn_scalar=int(q) if (q := c.query_pre_attn_scalar).is_integer() else q,   # an int there
               rope_parameters={FULL: full, SLIDING: {"rope_type": "default", "rope_theta": c.rope_local_theta}},
               final_logit_softcapping=None, attn_logit_softcapping=None)
  if c.moe and c.shared_expert:   # Qwen3_5MoeTextConfig's (the shared expert's width is our ffn_dim)
    out.update(num_experts=c.num_experts, num_experts_per_tok=c.experts_per_token,
               moe_intermediate_size=c.expert_ffn_dim, shared_expert_intermediate_size=out.pop("intermediate_size"),
               output_router_logits=False)
  elif c.arch == "qwen3_moe":   # Qwen3MoeConfig's fields (`models.hf_loader.read_config` reads them)
    out.update(num_experts=c.num_experts, num_experts_per_tok=c.experts_per_token,
               moe_intermediate_size=c.expert_ffn_dim, norm_topk_prob=c.norm_topk_prob, decoder_sparse_step=1,
               mlp_only_layers=[], output_router_logits=False)
  if c.hybrid:   # transformers-5 Qwen3_5TextConfig fields (`models.hf_loader._qwen3_5_fields` reads them)
    del out["rope_theta"], out["mlp_bias"]
    out.update(qwen3_5.hf_config_fields(c))
  if c.gemma4:   # Gemma4TextConfig's fields (`models.hf_loader._gemma4_fields` reads them)
    del out["hidden_act"], out["mlp_bias"], out["rope_theta"]
    out.update(gemma4.hf_config_fields(c))
  return out


def token_ids(tokenizer) -> tuple[dict, dict]:
  """(config.json's token-id fields, generation_config.json) that say how the exported model starts
  and stops: config.json gets the tokenizer's bos_token_id / eos_token_id / pad_token_id (those it
  has); generation_config.json is the source model's own (`models.loading.generation_config`: GGUF
  metadata or the source directory's file) with eos_token_id the whole stop set
  (`models.loading.stop_ids`: an int when one, else a list) and the tokenizer's ids where the source
  names none. Without them transformers falls back to per-family class defaults."""
  ids = {k: getattr(tokenizer, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
  ids = {k: int(v) for k, v in ids.items() if v is not None}
  stops = list(stop_ids(tokenizer))
  generation = {**ids, **generation_config(tokenizer), "eos_token_id": stops[0] if len(stops) == 1 else stops}
  return ids, generation


def hf_tensors(config: ModelConfig, params: dict) -> dict[str, np.ndarray]:
  """HF-named float32 tensors of `Llama` parameters (a pure dict, `nnx.to_pure_dict`); Qwen3.5's by
  `qwen3_5.hf_tensors`."""
  c = config
  if c.hybrid:
    return qwen3_5.hf_tensors(c, params)
  if c.gemma4:
    return gemma4.hf_tensors(c, params)
  to_hf = {
      "q": lambda w: w.reshape(c.d_model, c.num_heads * c.head_dim).T,
      "k": lambda w: w.reshape(c.d_model, c.num_kv_heads * c.head_dim).T,
      "v": lambda w: w.reshape(c.d_model, c.num_kv_heads * c.head_dim).T,
      "o": lambda w: w.reshape(c.num_heads * c.head_dim, c.d_model).T,
      "gate": lambda w: w.T, "up": lambda w: w.T, "down": lambda w: w.T,
      "bq": lambda b: b.reshape(-1), "bk": lambda b: b.reshape(-1), "bv": lambda b: b.reshape(-1),
      "router": lambda w: w.T,
  }
  f32 = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))
  out = {}
  for hf_name, ours in GLOBAL_NAMES.items():
    if ours in params:
      out[hf_name] = f32(params[ours].T if ours == "lm_head" else params[ours])
  for hf_suffix, canonical in layer_names(c.arch, c.num_experts).items():
    kind, _, expert = canonical.partition(".")   # Qwen3-MoE: "gate.e", expert e's slice of w_gate [L, E, d, F_e]
    stacked = params["layers"].get(LAYER_PARAMS[kind])
    if stacked is None:
      continue
    for i in range(c.num_layers):
      w = np.asarray(stacked[i])
      w = w[int(expert)].T if expert else to_hf.get(canonical, lambda w: w)(w)
      out[LAYER_PREFIX.format(i) + hf_suffix] = f32(w)
  return out


def export_model(model: Llama, tokenizer, out_dir: str, *, dtype: str = "float32") -> str:
  """Write `model` (and `tokenizer`, when given) as a Hugging Face directory; returns out_dir.

  dtype: "float32" (exact) or "bfloat16" (rounded, half the bytes). A model with LoRA adapters is
  written merged (`models.lora.merged`). With a tokenizer, config.json carries its token ids and
  generation_config.json the source model's stop set (`token_ids`).

  Raises:
    ValueError: dtype not in DTYPES, or out_dir exists and is not empty (nothing is overwritten).
  """
  if dtype not in DTYPES:
    raise ValueError(f"export: dtype={dtype!r} is not one of {tuple(DTYPES)}")
  if os.path.exists(out_dir) and os.listdir(out_dir):
    raise ValueError(f"export: {out_dir} exists and is not empty; give a new directory")
  os.makedirs(out_dir, exist_ok=True)
  model = lora.merged(model)
  tensors = hf_tensors(model.config, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  if dtype == "bfloat16":
    import ml_dtypes
    tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
  save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
  ids, generation = ({}, None) if tokenizer is None else token_ids(tokenizer)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump({**hf_config(model.config, dtype), **ids}, f, indent=2)
  if tokenizer is not None:
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
      json.dump(generation, f, indent=2)
    tokenizer.save_pretrained(out_dir)
  return out_dir


@contextlib.contextmanager
def quiet_absl():
  """absl's logger (orbax logs every checkpoint phase through it at INFO) at WARNING inside the block."""
  before = logging.get_verbosity()
  logging.set_verbosity(logging.WARNING)
  try:
    yield
  finally:
    logging.set_verbosity(before)


def run_config(config):
  """The config the run in config.run_dir trained with (its experiment.json), and its chat template.

  Raises:
    ValueError: no run there (no experiment.json: train first, or export the base model with
      `export_base`); config.model.name differs from the run's (naming both).
  """
  try:
    record = read_run_record(config.run_dir)
  except ValueError as e:
    raise ValueError(f"export: {e}; train there first, or export the base model with --base") from None
  trained = record["fingerprint"]["model"]
  if config.model.name != trained:
    raise ValueError(f"export: model.name={config.model.name!r} but run_dir={config.run_dir!r} trained "
                     f"model.name={trained!r}; export that run with its model, or the base model with --base")
  saved = config if record["config"] is None else ml_collections.ConfigDict(record["config"])
  return saved, record["chat_template"]


def export_run(config, out_dir: str, *, step: int | None = None, dtype: str = "float32") -> str:
  """Export the policy of `config.run_dir`'s checkpoint `step` (default: the latest); returns out_dir.

  The model (name, LoRA shape, algorithm), the tokenizer and its chat template are the run's, from
  its experiment.json (`run_config`): settings changed in `config` since the run do not leak into
  the export.

  Raises:
    ValueError: as `run_config` (no run in run_dir, another model.name); the run directory has no
      checkpoint, or no checkpoint `step` (naming the ones it has); a LoRA run's checkpoint was
      trained on another base model (models.lora.check_base).
  """
  from branch_replay_jax.algorithms.runs import build_model
  from branch_replay_jax.outputs.checkpoints import RunCheckpoints, pure_params
  config, chat_template = run_config(config)
  with quiet_absl():
    ckpt = RunCheckpoints(config.run_dir)
    try:
      steps = ckpt.steps()
      if not steps or (step is not None and step not in steps):
        raise ValueError(f"export: {config.run_dir} has no checkpoint {step if step is not None else ''} "
                         f"(checkpoints: {steps})")
      state, meta = ckpt.restore(steps[-1] if step is None else step)
    finally:
      ckpt.close()
  params = pure_params(state["params"])
  if config.get("algorithm", "grpo") == "ppo":
    params = params["policy"]   # the actor-critic's policy trunk; the critic does not leave
  model, tokenizer = build_model(config)
  if chat_template is not None:
    tokenizer.chat_template = chat_template
  if model.lora is not None:   # the checkpoint holds the adapters only: check the base they belong to
    lora.check_base(meta.get("lora_base"), {"model": config.model.name, "sha256": lora.base_hash(lora.split(model)[2])},
                    f"run_dir={config.run_dir!r}")
  graphdef, state = nnx.split(model)
  nnx.replace_by_pure_dict(state, jax.tree_util.tree_map(np.asarray, params))
  return export_model(nnx.merge(graphdef, state), tokenizer, out_dir, dtype=dtype)


def export_base(config, out_dir: str, *, dtype: str = "float32") -> str:
  """Export config.model.name as loaded, before any training (no run directory is read); returns
  out_dir. "tiny" is the random model a run of the same seed starts from; with config.lora the
  untrained adapters (B = 0) merge to the base weights exactly."""
  from branch_replay_jax.algorithms.runs import build_model
  model, tokenizer = build_model(config)
  return export_model(model, tokenizer, out_dir, dtype=dtype)


def main(argv):
  del argv
  f = flags.FLAGS
  if f.base:
    if f.step is not None:
      raise app.UsageError("--base exports the model before training; it takes no --step")
    print(export_base(f.config, f.out, dtype=f.dtype))
  else:
    print(export_run(f.config, f.out, step=f.step, dtype=f.dtype))


if __name__ == "__main__":
  config_flags.DEFINE_config_file("config", None, "The experiment config whose run directory to export.")
  flags.DEFINE_string("out", None, "The new directory to write.", required=True)
  flags.DEFINE_integer("step", None, "The checkpoint step (default: the latest).")
  flags.DEFINE_string("dtype", "float32", "float32 (exact) or bfloat16.")
  flags.DEFINE_bool("base", False, "Export config.model.name as loaded, without a run (no checkpoint).")
  app.run(main)
