"""Read a llama.cpp GGUF file: architecture, dequantised tensors and tokenizer, without torch.

The file is parsed once (`gguf.GGUFReader`, ~2 s for SmolLM2-135M, mostly the 49k-entry
vocabulary) and serves both the weights and the tokenizer.

Tensors are dequantised with the `gguf` package's reference `gguf.quants.dequantize` (Q4_0,
Q4_1, Q8_0, K-quants, F16, BF16, F32, ...), the same numbers llama.cpp computes, and returned
as float32 numpy arrays in numpy order [out, in] (GGUF lists dimensions the other way round).

llama.cpp's converter (`convert_hf_to_gguf.py`, `LlamaModel.permute`) reorders the rows of
the Q and K projections of arch "llama" for its interleaved RoPE:

    w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)

with n_head = query heads for Q and KV heads for K. `unpermute_rows` undoes it to the HF
"rotate half" layout our model uses. Qwen2/Qwen3 files are written unpermuted.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import gguf
import numpy as np
from tokenizers import Tokenizer

from branch_replay_jax.models.config import ModelConfig, default_rope_theta

# GGUF names: the same for every supported architecture; which optional ones must be present
# follows from the config (qkv_bias, qk_norm, tie_embeddings).
GLOBAL_NAMES = {"token_embd.weight": "embed", "output_norm.weight": "final_norm", "output.weight": "lm_head"}
LAYER_PREFIX = "blk.{}."
LAYER_NAMES = {
    "attn_norm.weight": "attn_norm",
    "ffn_norm.weight": "mlp_norm",
    "attn_q.weight": "q",
    "attn_k.weight": "k",
    "attn_v.weight": "v",
    "attn_output.weight": "o",
    "ffn_gate.weight": "gate",
    "ffn_up.weight": "up",
    "ffn_down.weight": "down",
    "attn_q.bias": "bq",
    "attn_k.bias": "bk",
    "attn_v.bias": "bv",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
}
# Whether llama.cpp's converter permuted the Q/K rows of this architecture.
QK_PERMUTED = {"llama": True, "qwen2": False, "qwen3": False}


@dataclasses.dataclass
class GGUFContents:
  """Everything `load` needs from one GGUF file.

  config: the architecture from the metadata.
  tensors: GGUF tensor name -> float32 array in numpy order [out, in] (1-D for norms, biases),
    still in llama.cpp's Q/K row order.
  metadata: the `tokenizer.*` metadata fields, decoded to Python values.
  """

  config: ModelConfig
  tensors: dict[str, np.ndarray]
  metadata: dict


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
  """llama.cpp's Q/K row permutation (for tests and for writing GGUF files): HF -> GGUF order."""
  rows = w.shape[0]
  return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w: np.ndarray, n_head: int, name: str = "tensor") -> np.ndarray:
  """Inverse of `permute_rows`: GGUF row order -> HF rotate-half order.

  Args:
    w: [n_head * head_dim, ...] rows of a Q (n_head = query heads) or K (n_head = KV heads,
      see transformers #31766) projection or bias.
    n_head: the head count the rows were permuted with.
    name: used in the error message.

  Raises:
    ValueError: the rows do not split into n_head heads of even size.
  """
  rows = w.shape[0]
  if rows % (2 * n_head):
    raise ValueError(f"{name}: {rows} rows do not split into {n_head} heads of even size for RoPE un-permutation")
  return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize(tensor) -> np.ndarray:
  """One `gguf.ReaderTensor` -> float32 array in numpy order (the GGUF dims reversed)."""
  shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
  values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
  if values.size != int(np.prod(shape)):
    raise ValueError(f"GGUF tensor {tensor.name}: {tensor.tensor_type.name} data dequantises to {values.shape}, "
                     f"not the declared shape {shape}")
  return np.ascontiguousarray(values.reshape(shape), dtype=np.float32)


class _ShortRead(Exception):
  """A read of `wanted` bytes at `offset` past the end of a file of `size` bytes (in `tensor`, if
  any; `others` more tensors lie wholly or partly beyond the end)."""

  def __init__(self, offset: int, wanted: int, size: int, tensor: str | None = None, others: int = 0):
    super().__init__(offset, wanted, size, tensor, others)
    self.offset, self.wanted, self.size, self.tensor, self.others = offset, wanted, size, tensor, others


class _CheckedReader(gguf.GGUFReader):
  """`gguf.GGUFReader` whose reads past the end of the file raise `_ShortRead`.

  The stock reader slices its memmap, gets a short array and fails far from the cause: numpy's
  "When changing to a larger dtype, its size must be a divisor of the total size in bytes of the
  last axis of the array" or an IndexError, naming neither the file nor the tensor. Overrides
  two private methods (`_get`, `_build_tensors`) of gguf 0.17-0.19; tests/test_loading.py
  loads truncated files through it.
  """

  def _get(self, offset, dtype, count=1, *args, **kwargs):
    wanted = int(np.dtype(dtype).itemsize) * int(count)
    if int(offset) + wanted > self.data.size:
      raise _ShortRead(int(offset), wanted, int(self.data.size))
    return super()._get(offset, dtype, count, *args, **kwargs)

  def _build_tensors(self, start_offs, fields):
    tensors, short = [], []
    for field in fields:   # one at a time, to name the tensors whose data is cut
      try:
        super()._build_tensors(start_offs, [field])
      except _ShortRead as e:
        short.append(_ShortRead(e.offset, e.wanted, e.size, tensor=bytes(field.parts[1]).decode("utf-8", "replace")))
        continue
      tensors.extend(self.tensors)
    if short:   # report the tensor the file ends in (the lowest offset), not the first one listed
      first = min(short, key=lambda e: e.offset)
      raise _ShortRead(first.offset, first.wanted, first.size, first.tensor, others=len(short) - 1)
    self.tensors = tensors


def open_gguf(path: str) -> gguf.GGUFReader:
  """A `gguf.GGUFReader` of `path` that refuses a truncated or corrupt file.

  Raises:
    ValueError: naming the file, and for a short read the tensor (or the header/metadata), the
      bytes expected and the bytes found, e.g. SmolLM2's Q4_1 file cut 1000 bytes into a tensor:
      "x.gguf: truncated or corrupt GGUF file (33528872 bytes): tensor 'blk.0.ffn_norm.weight'
      expects 2304 bytes at offset 33527872, found 1000 (266 more tensors lie beyond the end)";
      its first megabyte: "... (1048576 bytes): the header/metadata expects 7 bytes at offset
      1048575, found 1". Also for a bad magic, an unsupported version, an empty file or
      duplicate keys.

  A file is parsed once per (path, size, modification time) in a process: gguf's reader parses every
  metadata field, SmolLM2's 49,152-entry vocabulary included (~4 s), and a run reads the header for its
  checks and again to load. The reader only reads its memory map, so sharing it changes nothing.
  """
  if not os.path.isfile(path):
    return _open_gguf(path)
  stat = os.stat(path)
  return _cached_gguf(os.path.realpath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _cached_gguf(path: str, size: int, mtime_ns: int) -> gguf.GGUFReader:
  del size, mtime_ns   # the cache key: a rewritten file is parsed again
  return _open_gguf(path)


def _open_gguf(path: str) -> gguf.GGUFReader:
  try:
    return _CheckedReader(path)
  except _ShortRead as e:
    where = f"tensor {e.tensor!r}" if e.tensor else "the header/metadata"
    more = f" ({e.others} more tensors lie beyond the end)" if e.others else ""
    raise ValueError(f"{path}: truncated or corrupt GGUF file ({e.size} bytes): {where} expects {e.wanted} bytes at "
                     f"offset {e.offset}, found {max(0, e.size - e.offset)}{more}") from None
  except (ValueError, KeyError, IndexError, OverflowError) as e:
    raise ValueError(f"{path}: not a readable GGUF file ({os.path.getsize(path)} bytes): {e}") from e


def _field(reader: gguf.GGUFReader, key: str, path: str, default=None, required: bool = True):
  field = reader.fields.get(key)
  if field is None:
    if required and default is None:
      raise ValueError(f"{path}: GGUF metadata key {key!r} is missing")
    return default
  return field.contents()


def read_config(reader: gguf.GGUFReader, path: str) -> ModelConfig:
  """The `ModelConfig` the metadata describes.

  A missing `<arch>.rope.freq_base` takes the family's documented default with a warning (llama:
  10000) or is refused (qwen2, qwen3: `config.default_rope_theta`).

  Raises:
    ValueError: an architecture other than llama/qwen2/qwen3, RoPE scaling (not supported from
      GGUF metadata), a missing key, or a vocabulary size that disagrees with the token list.
  """
  arch = _field(reader, "general.architecture", path)
  if arch not in QK_PERMUTED:
    raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; expected one of {sorted(QK_PERMUTED)}")
  scaling = _field(reader, f"{arch}.rope.scaling.type", path, required=False)
  if scaling not in (None, "none"):
    raise ValueError(f"{path}: GGUF RoPE scaling {scaling!r} ({arch}.rope.scaling.type) is not supported")
  d = int(_field(reader, f"{arch}.embedding_length", path))
  heads = int(_field(reader, f"{arch}.attention.head_count", path))
  kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", path, default=heads))
  head_dim = int(_field(reader, f"{arch}.attention.key_length", path, default=d // heads))
  value_dim = int(_field(reader, f"{arch}.attention.value_length", path, default=head_dim))
  if value_dim != head_dim:
    raise ValueError(f"{path}: key_length {head_dim} != value_length {value_dim} is not supported")
  vocab = len(reader.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in reader.fields else None
  if vocab is None:
    raise ValueError(f"{path}: GGUF metadata key 'tokenizer.ggml.tokens' is missing")
  declared_vocab = _field(reader, f"{arch}.vocab_size", path, required=False)
  if declared_vocab is not None and int(declared_vocab) != vocab:
    raise ValueError(f"{path}: {arch}.vocab_size={declared_vocab} but tokenizer.ggml.tokens has {vocab} entries")
  names = {t.name for t in reader.tensors}
  theta = _field(reader, f"{arch}.rope.freq_base", path, required=False)
  return ModelConfig(
      arch=arch,
      vocab_size=vocab,
      num_layers=int(_field(reader, f"{arch}.block_count", path)),
      d_model=d,
      num_heads=heads,
      num_kv_heads=kv_heads,
      head_dim=head_dim,
      ffn_dim=int(_field(reader, f"{arch}.feed_forward_length", path)),
      rope_theta=float(default_rope_theta(arch, f"{arch}.rope.freq_base", path) if theta is None else theta),
      norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", path)),
      tie_embeddings="output.weight" not in names,
      qkv_bias=arch == "qwen2",
      qk_norm=arch == "qwen3",
      max_positions=int(_field(reader, f"{arch}.context_length", path)),
  )


def read_gguf(path: str | os.PathLike) -> GGUFContents:
  """Parse a GGUF file once: config, dequantised tensors, tokenizer metadata.

  Raises:
    ValueError: see `open_gguf` (a truncated or corrupt file) and `read_config`; a tensor whose
      data does not match its declared shape.
  """
  path = os.fspath(path)
  reader = open_gguf(path)
  config = read_config(reader, path)
  tensors = {}
  for tensor in reader.tensors:
    if tensor.name in tensors:
      raise ValueError(f"{path}: tensor {tensor.name!r} appears twice")
    tensors[tensor.name] = dequantize(tensor)
  metadata = {k: reader.fields[k].contents() for k in reader.fields if k.startswith("tokenizer.")}
  return GGUFContents(config=config, tensors=tensors, metadata=metadata)


def _drop_tokens_beyond(backend, vocab_size: int):
  """Remove added tokens with id >= vocab_size from a `tokenizers.Tokenizer`.

  transformers' byte-level builder (`GPT2Tokenizer`) defaults its special tokens to
  "<|endoftext|>" and appends it when the vocabulary lacks it (Llama 3 GGUFs, which say
  "<|end_of_text|>"): an id the embedding does not have, emitted whenever a text contains it.
  """
  spec = json.loads(backend.to_str())
  kept = [t for t in spec["added_tokens"] if t["id"] < vocab_size]
  if len(kept) == len(spec["added_tokens"]):
    return backend
  spec["added_tokens"] = kept
  return Tokenizer.from_str(json.dumps(spec))


# llama.cpp's end-of-generation ids (`llama_vocab_is_eog`): end of sequence, of turn, of message.
STOP_KEYS = ("eos_token_id", "eot_token_id", "eom_token_id")


def generation_config(metadata: dict) -> dict:
  """The file's generation settings in generation_config.json's field names, from the `tokenizer.*`
  metadata: {"eos_token_id": the stop ids of `STOP_KEYS` present (an int when one, else a list),
  "bos_token_id", "pad_token_id"}, each only when the metadata has it."""
  stops = list(dict.fromkeys(int(metadata[f"tokenizer.ggml.{k}"]) for k in STOP_KEYS
                             if f"tokenizer.ggml.{k}" in metadata))
  out = {} if not stops else {"eos_token_id": stops[0] if len(stops) == 1 else stops}
  for ours, key in (("bos_token_id", "bos_token_id"), ("pad_token_id", "padding_token_id")):
    if f"tokenizer.ggml.{key}" in metadata:
      out[ours] = int(metadata[f"tokenizer.ggml.{key}"])
  return out


def build_tokenizer(arch: str, metadata: dict, path: str):
  """A `PreTrainedTokenizerFast` from the `tokenizer.*` metadata, without torch.

  Uses transformers' own GGUF tokenizer mapping (`gguf_tokenizer_mapping`), the code behind
  `AutoTokenizer.from_pretrained(..., gguf_file=...)`, fed from our already-parsed metadata.
  `tokenizer.ggml.add_bos_token` decides whether encoding adds BOS (sentencepiece vocabularies
  without the flag add it, as llama.cpp does). The file's token list is the whole vocabulary:
  tokens the builder invents beyond it are dropped (see `_drop_tokens_beyond`).

  Raises:
    ValueError: the metadata describes a tokenizer type transformers cannot build.
    ImportError: transformers older than 5.18 (no GGUF tokenizer builder where this reads it).
  """
  import transformers
  from transformers import PreTrainedTokenizerFast
  try:   # transformers' GGUF tokenizer builder; its module moved and was renamed before 5.18
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
  except ImportError as e:
    raise ImportError(f"{path}: building a GGUF tokenizer needs transformers>=5.18 (setup.cfg); found "
                      f"transformers {transformers.__version__}: {e}") from e

  tokenizer_dict = {name: metadata[f"tokenizer.{key}"] for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
                    if f"tokenizer.{key}" in metadata}
  if "tokens" not in tokenizer_dict:
    raise ValueError(f"{path}: GGUF metadata has no tokenizer.ggml.tokens")
  try:
    backend, _ = convert_gguf_tokenizer(arch, tokenizer_dict)
  except ValueError as e:
    raise ValueError(f"{path}: cannot build the tokenizer: {e}") from e
  tokens = tokenizer_dict["tokens"]
  backend = _drop_tokens_beyond(backend, len(tokens))

  def special(key):
    token_id = metadata.get(f"tokenizer.ggml.{key}")
    return None if token_id is None else tokens[int(token_id)]

  add_bos = metadata.get("tokenizer.ggml.add_bos_token", tokenizer_dict.get("tokenizer_type") == "llama")
  return PreTrainedTokenizerFast(
      tokenizer_object=backend,
      chat_template=metadata.get("tokenizer.chat_template"),
      bos_token=special("bos_token_id"),
      eos_token=special("eos_token_id"),
      pad_token=special("padding_token_id"),
      unk_token=special("unknown_token_id"),
      add_bos_token=bool(add_bos),
      add_eos_token=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
  )
