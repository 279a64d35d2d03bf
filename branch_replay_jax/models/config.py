"""Architecture description of a Llama-family decoder (Llama 2/3, SmolLM/SmolLM2, Qwen2/2.5, Qwen3), of
Gemma 3's and Gemma 4's text decoders (sliding-window layers beside global ones) and of Qwen3.5's (Gated
DeltaNet linear-attention layers beside gated full-attention ones)."""

from __future__ import annotations

import dataclasses
import logging

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3_text", "gemma4_text", "qwen3_5_text", "qwen3_moe",
                 "qwen3_5_moe_text")
EXPERT_MATMULS = ("ragged_dot", "tiled", "pallas")   # ModelConfig.expert_matmul
GATED_DELTA_SCANS = ("xla", "pallas")   # ModelConfig.gated_delta_scan
# Attention layer kinds (transformers' `layer_types`): Gemma 3's sliding and full, Qwen3.5's linear and full.
SLIDING, FULL, LINEAR = "sliding_attention", "full_attention", "linear_attention"

# RoPE base of a checkpoint whose metadata omits it, for the families that document one: Llama 1/2's
# 10000 (transformers' LlamaConfig default, llama.cpp's fallback). Qwen2/2.5/3 checkpoints use 1000000
# while Qwen2Config / Qwen3Config default to 10000: a missing key there is refused, never guessed.
ROPE_THETA_DEFAULTS = {"llama": 10000.0}


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
  """Llama-3.1 frequency-dependent RoPE scaling (Meta's `apply_scaling`, HF `rope_type="llama3"`)."""

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class LinearRopeScaling:
  """Position interpolation (Chen et al. 2023, arXiv 2306.15595): every inverse frequency divided by
  `factor` (HF `rope_type="linear"`; Gemma 3's global layers from 4B up use factor 8)."""

  factor: float


@dataclasses.dataclass(frozen=True)
class GatedDeltaNetShape:
  """Qwen3.5's linear-attention layers (transformers' `Qwen3_5TextConfig.linear_*`): Hk key heads of width
  Dk (queries share them), Hv value heads of width Dv (Hv a multiple of Hk), a depthwise causal convolution
  of `conv_kernel` taps over the q, k, v channels (2·Hk·Dk + Hv·Dv)."""

  num_key_heads: int
  num_value_heads: int
  key_head_dim: int
  value_head_dim: int
  conv_kernel: int = 4

  def __post_init__(self):
    for name in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_kernel"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"GatedDeltaNetShape.{name} must be a positive int, got {value!r}")
    if self.num_value_heads % self.num_key_heads:
      raise ValueError(f"GatedDeltaNetShape.num_value_heads={self.num_value_heads} is not a multiple of "
                       f"num_key_heads={self.num_key_heads}")

  @property
  def conv_channels(self) -> int:
    return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of one decoder. Frozen and hashable: it is static under `jax.jit`.

  Fields:
    arch: one of `ARCHITECTURES`; only changes which optional parts below are expected.
    vocab_size: rows of the token embedding (tokens).
    num_layers: decoder blocks.
    d_model: residual stream width.
    num_heads: query heads (Hq).
    num_kv_heads: key/value heads (Hkv); `num_heads % num_kv_heads == 0` (GQA).
    head_dim: per-head width (D).
    ffn_dim: SwiGLU hidden width.
    rope_theta: RoPE base.
    rope_scaling: Llama-3 scaling, or None.
    norm_eps: RMSNorm epsilon.
    tie_embeddings: output projection is the transposed token embedding.
    qkv_bias: Q/K/V projections carry a bias (Qwen2/2.5).
    qk_norm: per-head RMSNorm on Q and K before RoPE (Qwen3).
    max_positions: the context length the weights were trained for (tokens).
    layer_types: Gemma 3 and 4 only: one of SLIDING, FULL per layer. A sliding layer's query at position p
      attends to the keys at positions p - sliding_window < q <= p (transformers' `sliding_window_overlay`),
      with RoPE base rope_local_theta and no scaling; a full layer to every earlier key, with
      rope_theta and rope_scaling.
    sliding_window: Gemma 3 and 4 only: the window W (tokens) of the sliding layers.
    rope_local_theta: Gemma 3 and 4 only: the sliding layers' RoPE base.
    query_pre_attn_scalar: Gemma 3 only: the logit scale is query_pre_attn_scalar ** -0.5 (else
      head_dim ** -0.5).
    linear_attention: Qwen3.5 only: the shape of its Gated DeltaNet layers (`GatedDeltaNetShape`);
      layer_types then holds LINEAR or FULL per layer, a repeating pattern (`models.qwen3_5`).
    rotary_dim: Qwen3.5 only: RoPE rotates the first rotary_dim of each head's head_dim dimensions
      (partial_rotary_factor · head_dim), the rest pass unrotated.
    num_experts, experts_per_token, expert_ffn_dim, norm_topk_prob: Qwen3-MoE only (arch="qwen3_moe"): every
      layer's MLP is `num_experts` SwiGLU experts of width expert_ffn_dim, each token routed to the top
      experts_per_token of softmax(x W_router), their probabilities renormalised to sum 1 when
      norm_topk_prob (`models.llama`, "Mixture of experts" in docs/design.md); ffn_dim is then unused.
      Qwen3.5-MoE (arch="qwen3_5_moe_text") has them too, beside Qwen3.5's fields: its layers are Qwen3.5's
      with this mixture of experts as the MLP, plus a shared expert (a SwiGLU of width ffn_dim, its output
      scaled by sigmoid(x w)) every token runs (transformers' `Qwen3_5MoeSparseMoeBlock`). Gemma 4 (arch=
      "gemma4_text") has them where its checkpoint enables the MoE block (26B-A4B): each layer runs its dense
      GeGLU MLP and, beside it, experts of width expert_ffn_dim (GeGLU too) routed by Gemma 4's router
      (`models.gemma4`); norm_topk_prob is then True, as its router always renormalises.
    expert_matmul: how the experts' grouped matmuls lower (a compute choice, not a checkpoint field):
      "ragged_dot" (`jax.lax.ragged_dot`: a grouped matmul on TPU, dense over every expert on XLA:CPU) or
      "tiled" (`kernels.grouped_matmul`: tiles of one expert's rows, any backend) or "pallas"
      (`kernels.grouped_matmul_pallas`: the same tiles as Pallas kernels, Triton on GPU, interpreted on the
      CPU; one device only); one of EXPERT_MATMULS.
    gated_delta_scan: Qwen3.5's linear layers: how the chunked gated delta rule scans its state over the chunks
      (a compute choice, not a checkpoint field): "xla" (`jax.lax.scan`) or "pallas"
      (`kernels.gated_delta_pallas`: one program per row and value head, Triton on GPU, interpreted on the CPU;
      on one device and inside the mesh step); one of GATED_DELTA_SCANS.
    global_head_dim, global_kv_heads, k_eq_v, global_rope_fraction, final_logit_softcap, layer_scalars: Gemma 4
      only (arch="gemma4_text", `models.gemma4`): its global layers' head width and K/V heads (head_dim and
      num_kv_heads are the sliding layers'), whether their values are their keys' projection (attention_k_eq_v),
      the fraction of each global head RoPE rotates (proportional RoPE: the first global_rope_fraction ·
      global_head_dim / 2 frequencies of the rotate-half pairs, the rest unrotated; rope_theta and rope_scaling
      its base and scaling), the cap c of the output logits (c · tanh(logits / c); None: none) and each
      layer's output scalar (transformers' `layer_scalar` buffer, not trained; None: all 1).
    per_layer_input_dim, kv_shared_layers, double_wide_mlp: Gemma 4's small models (E2B, E4B; `models.gemma4`):
      the width Dp of the per-layer embeddings (hidden_size_per_layer_input; None: none), the number of last
      layers that compute no K/V of their own and read the last earlier layer's of their kind
      (num_kv_shared_layers; the layers before them repeat the layer pattern whole), and whether those layers'
      MLP is 2 · ffn_dim wide (use_double_wide_mlp; needs kv_shared_layers).

  `arch="gemma3_text"` also selects Gemma 3's block (Gemma Team 2025, arXiv 2503.19786; transformers'
  `Gemma3DecoderLayer`): RMSNorm scaled by (1 + w), norms after attention and MLP as well as before,
  Q/K RMSNorm, a GeGLU MLP (tanh-approximated GELU), embeddings multiplied by sqrt(d_model).
  """

  vocab_size: int
  num_layers: int
  d_model: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  ffn_dim: int
  rope_theta: float = 10000.0
  rope_scaling: Llama3RopeScaling | None = None
  norm_eps: float = 1e-5
  tie_embeddings: bool = True
  qkv_bias: bool = False
  qk_norm: bool = False
  max_positions: int = 8192
  arch: str = "llama"
  layer_types: tuple[str, ...] | None = None
  sliding_window: int | None = None
  rope_local_theta: float | None = None
  query_pre_attn_scalar: float | None = None
  linear_attention: GatedDeltaNetShape | None = None
  rotary_dim: int | None = None
  num_experts: int | None = None
  experts_per_token: int | None = None
  expert_ffn_dim: int | None = None
  norm_topk_prob: bool = True
  expert_matmul: str = "ragged_dot"
  gated_delta_scan: str = "xla"
  global_head_dim: int | None = None
  global_kv_heads: int | None = None
  k_eq_v: bool = False
  global_rope_fraction: float | None = None
  final_logit_softcap: float | None = None
  layer_scalars: tuple[float, ...] | None = None
  per_layer_input_dim: int | None = None
  kv_shared_layers: int = 0
  double_wide_mlp: bool = False

  def __post_init__(self):
    if self.arch not in ARCHITECTURES:
      raise ValueError(f"ModelConfig.arch={self.arch!r} is not supported; expected one of {ARCHITECTURES}")
    if self.expert_matmul not in EXPERT_MATMULS:
      raise ValueError(f"ModelConfig.expert_matmul={self.expert_matmul!r} is not one of {EXPERT_MATMULS}")
    if self.gated_delta_scan not in GATED_DELTA_SCANS:
      raise ValueError(f"ModelConfig.gated_delta_scan={self.gated_delta_scan!r} is not one of {GATED_DELTA_SCANS}")
    for name in ("vocab_size", "num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim", "ffn_dim",
                 "max_positions"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"ModelConfig.num_heads={self.num_heads} is not a multiple of "
                       f"num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even for RoPE")
    moe_fields = ("num_experts", "experts_per_token", "expert_ffn_dim")
    if self.moe:
      for name in moe_fields:
        value = getattr(self, name)
        if not isinstance(value, int) or value <= 0:
          raise ValueError(f"ModelConfig.{name} must be a positive int for arch={self.arch!r}, got {value!r}")
      if self.experts_per_token > self.num_experts:
        raise ValueError(f"ModelConfig.experts_per_token={self.experts_per_token} exceeds "
                         f"num_experts={self.num_experts}")
      if self.gemma4 and not self.norm_topk_prob:
        raise ValueError("ModelConfig.norm_topk_prob=False: Gemma 4's router always renormalises its top k")
    else:
      for name in moe_fields:
        if getattr(self, name) is not None:
          raise ValueError(f"ModelConfig.{name} is a mixture of experts' (arch='qwen3_moe', 'qwen3_5_moe_text', or "
                           f"'gemma4_text' with num_experts); arch={self.arch!r} has none" + (
                               " without num_experts" if self.gemma4 else ""))
    gemma4_fields = ("global_head_dim", "global_kv_heads", "global_rope_fraction", "final_logit_softcap",
                     "layer_scalars", "per_layer_input_dim")
    if self.gemma4:
      self._check_gemma4()
    else:
      for name in gemma4_fields + ("k_eq_v", "kv_shared_layers", "double_wide_mlp"):
        if getattr(self, name) not in (None, False, 0):
          raise ValueError(f"ModelConfig.{name} is Gemma 4's (arch='gemma4_text'); arch={self.arch!r} has none")
    if self.hybrid:
      self._check_hybrid()
      return
    for name in ("linear_attention", "rotary_dim"):
      if getattr(self, name) is not None:
        raise ValueError(f"ModelConfig.{name} is Qwen3.5's (arch='qwen3_5_text'); arch={self.arch!r} has none")
    gemma_fields = ("layer_types", "sliding_window", "rope_local_theta", "query_pre_attn_scalar")
    if not self.sliding:
      for name in gemma_fields:
        if getattr(self, name) is not None:
          raise ValueError(f"ModelConfig.{name} is Gemma 3's (arch='gemma3_text'); arch={self.arch!r} has none")
      return
    types = self.layer_types
    if not isinstance(types, tuple) or len(types) != self.num_layers or any(t not in (SLIDING, FULL) for t in types):
      raise ValueError(f"ModelConfig.layer_types must be a tuple of {self.num_layers} values, each {SLIDING!r} or "
                       f"{FULL!r}; got {types!r}")
    if SLIDING in types and (not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
      raise ValueError(f"ModelConfig.sliding_window must be a positive int with sliding layers, got "
                       f"{self.sliding_window!r}")
    if SLIDING in types and self.rope_local_theta is None:
      raise ValueError("ModelConfig.rope_local_theta (the sliding layers' RoPE base) is missing")

  def _check_gemma4(self):
    for name in ("global_head_dim", "global_kv_heads"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"ModelConfig.{name} must be a positive int for arch='gemma4_text', got {value!r}")
    if self.global_head_dim % 2:
      raise ValueError(f"ModelConfig.global_head_dim={self.global_head_dim} must be even for RoPE")
    # transformers' Gemma4TextConfig gives the global layers K/V heads of their own only with attention_k_eq_v
    if not self.k_eq_v and self.global_kv_heads != self.num_kv_heads:
      raise ValueError(f"ModelConfig.global_kv_heads={self.global_kv_heads} differs from num_kv_heads="
                       f"{self.num_kv_heads} with k_eq_v=False; Gemma 4 gives the global layers their own K/V heads "
                       "only with attention_k_eq_v")
    if self.num_heads % self.global_kv_heads:
      raise ValueError(f"ModelConfig.num_heads={self.num_heads} is not a multiple of "
                       f"global_kv_heads={self.global_kv_heads}")
    f = self.global_rope_fraction
    if not isinstance(f, (int, float)) or not 0 < f <= 1:
      raise ValueError(f"ModelConfig.global_rope_fraction must be in (0, 1], got {f!r}")
    cap = self.final_logit_softcap
    if cap is not None and (not isinstance(cap, (int, float)) or cap <= 0):
      raise ValueError(f"ModelConfig.final_logit_softcap must be None or > 0, got {cap!r}")
    scalars = self.layer_scalars
    if scalars is not None and (not isinstance(scalars, tuple) or len(scalars) != self.num_layers):
      raise ValueError(f"ModelConfig.layer_scalars must be None or a tuple of {self.num_layers} floats, got "
                       f"{scalars!r}")
    if self.query_pre_attn_scalar is not None:
      raise ValueError("ModelConfig.query_pre_attn_scalar is Gemma 3's: Gemma 4's attention has no logit scale")
    for name in ("k_eq_v", "double_wide_mlp"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"ModelConfig.{name} must be a bool, got {getattr(self, name)!r}")
    dp = self.per_layer_input_dim
    if dp is not None and (isinstance(dp, bool) or not isinstance(dp, int) or dp <= 0):
      raise ValueError(f"ModelConfig.per_layer_input_dim must be None or a positive int, got {dp!r}")
    self._check_kv_sharing()

  def _check_kv_sharing(self):
    n = self.kv_shared_layers
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < self.num_layers:
      raise ValueError(f"ModelConfig.kv_shared_layers must be an int in [0, num_layers={self.num_layers}), got {n!r}")
    if self.double_wide_mlp and not n:
      raise ValueError("ModelConfig.double_wide_mlp=True widens the K/V-sharing layers' MLP; kv_shared_layers=0 has "
                       "none")
    if not n or not isinstance(self.layer_types, tuple):   # (layer_types is checked below)
      return
    if self.moe:
      raise ValueError(f"ModelConfig.kv_shared_layers={n} with num_experts={self.num_experts}: no Gemma 4 has both "
                       "and our decoder does not build it")
    unit = len(self.layer_pattern)
    if (self.num_layers - n) % unit:
      raise ValueError(f"ModelConfig.kv_shared_layers={n}: the first {self.num_layers - n} layers are not whole "
                       f"repetitions of the layer pattern ({unit} layers); our layer scans run whole repetitions")

  def _check_hybrid(self):
    types = self.layer_types
    if not isinstance(types, tuple) or len(types) != self.num_layers or any(t not in (LINEAR, FULL) for t in types):
      raise ValueError(f"ModelConfig.layer_types must be a tuple of {self.num_layers} values, each {LINEAR!r} or "
                       f"{FULL!r}; got {types!r}")
    if not isinstance(self.linear_attention, GatedDeltaNetShape):
      raise ValueError(f"ModelConfig.linear_attention must be a GatedDeltaNetShape for arch='qwen3_5_text', got "
                       f"{self.linear_attention!r}")
    rd = self.rotary_dim
    if not isinstance(rd, int) or rd <= 0 or rd % 2 or rd > self.head_dim:
      raise ValueError(f"ModelConfig.rotary_dim must be an even int in [2, head_dim={self.head_dim}], got {rd!r}")
    for name in ("sliding_window", "rope_local_theta", "query_pre_attn_scalar"):
      if getattr(self, name) is not None:
        raise ValueError(f"ModelConfig.{name} is Gemma 3's (arch='gemma3_text'); arch={self.arch!r} has none")

  @property
  def gemma(self) -> bool:
    """Gemma 3's block and attention layers (the class docstring)."""
    return self.arch == "gemma3_text"

  @property
  def gemma4(self) -> bool:
    """Gemma 4's decoder (`models.gemma4`): sliding and global layers of different shapes (the fields above)."""
    return self.arch == "gemma4_text"

  @property
  def sliding(self) -> bool:
    """Sliding-window layers beside global ones (layer_types of SLIDING and FULL): Gemma 3's or Gemma 4's."""
    return self.gemma or self.gemma4

  @property
  def unit_offset_norms(self) -> bool:
    """RMSNorms scale by (1 + w), their weights initialised at 0 (Gemma 3's and Qwen3.5's `RMSNorm`)."""
    return self.gemma or self.hybrid

  @property
  def moe(self) -> bool:
    """A mixture of experts in every layer: Qwen3-MoE's (a Qwen3 block), Qwen3.5-MoE's (a Qwen3.5 block, with a
    shared expert) or Gemma 4's where num_experts is set (beside the dense MLP)."""
    return self.arch in ("qwen3_moe", "qwen3_5_moe_text") or (self.gemma4 and self.num_experts is not None)

  @property
  def layer_pattern(self) -> tuple[str, ...] | None:
    """The repeating unit of layer_types (its shortest period; the whole list when none repeats): the layers one
    step of a layer scan runs (`models.qwen3_5`, `models.gemma4`)."""
    types = self.layer_types
    if types is None:
      return None
    return next(types[:k] for k in range(1, len(types) + 1)
                if len(types) % k == 0 and types == types[:k] * (len(types) // k))

  @property
  def kv_layer_types(self) -> tuple[str, ...] | None:
    """layer_types of the layers that compute K/V (a segment's K/V holds theirs): all but Gemma 4's last
    kv_shared_layers."""
    return None if self.layer_types is None else self.layer_types[:self.num_layers - self.kv_shared_layers]

  @property
  def hybrid(self) -> bool:
    """Qwen3.5's decoder: Gated DeltaNet layers beside gated full attention (`models.qwen3_5`); Qwen3.5-MoE's too."""
    return self.arch in ("qwen3_5_text", "qwen3_5_moe_text")

  @property
  def shared_expert(self) -> bool:
    """Qwen3.5-MoE: a shared expert of width ffn_dim beside the routed ones (the class docstring)."""
    return self.arch == "qwen3_5_moe_text"

  @property
  def params_per_token_linear(self) -> int:
    """Multiply-adds per token of the dense layers (projections, MLP, output head), no attention."""
    d, hq, hkv, hd, f = self.d_model, self.num_heads, self.num_kv_heads, self.head_dim, self.ffn_dim
    mlp = 3 * d * f
    if self.moe:   # the router and the experts a token runs (active parameters); Qwen3.5-MoE's shared expert
      mlp = (d * self.num_experts + 3 * d * self.expert_ffn_dim * self.experts_per_token
             + (3 * d * f + d if self.shared_expert else 0) + (3 * d * f if self.gemma4 else 0))
    per_layer = d * hq * hd + 2 * d * hkv * hd + hq * hd * d + mlp
    if self.gemma4:   # its global layers' own head width and K/V heads (one K/V projection with k_eq_v)
      gd, gkv = self.global_head_dim, self.global_kv_heads
      kv = {SLIDING: 2 * d * hkv * hd, FULL: (1 if self.k_eq_v else 2) * d * gkv * gd}
      qo = {SLIDING: 2 * d * hq * hd, FULL: 2 * d * hq * gd}
      dp, n_own = self.per_layer_input_dim or 0, self.num_layers - self.kv_shared_layers
      wide = 2 if self.double_wide_mlp else 1   # (K/V-sharing layers: no K/V projections, a wider MLP)
      layers = sum(qo[t] + (kv[t] + mlp if i < n_own else wide * mlp) + 2 * d * dp
                   for i, t in enumerate(self.layer_types))
      return layers + d * self.num_layers * dp + d * self.vocab_size   # (the per-layer embeddings' projection)
    if not self.hybrid:
      return self.num_layers * per_layer + d * self.vocab_size
    la = self.linear_attention   # Qwen3.5: the full layers' query gate; the linear layers' q, k, v, z, a, b, out
    full = per_layer + d * hq * hd
    linear = d * (la.conv_channels + 2 * la.num_value_heads * la.value_head_dim + 2 * la.num_value_heads) + mlp
    n_full = self.layer_types.count(FULL)
    return n_full * full + (self.num_layers - n_full) * linear + d * self.vocab_size


def default_rope_theta(arch: str, key: str, source: str) -> float:
  """The RoPE base for a checkpoint `source` whose metadata lacks `key`: the family's documented
  default (`ROPE_THETA_DEFAULTS`), logged as a warning.

  Raises:
    ValueError: naming `source` and `key`, for a family without one default (qwen2, qwen3).
  """
  if arch not in ROPE_THETA_DEFAULTS:
    raise ValueError(f"{source}: {key} is missing; the {arch} family has no single RoPE base (Qwen2/2.5/3 "
                     "checkpoints use 1000000, a 10000 default would rotate every position wrongly); add the key")
  theta = ROPE_THETA_DEFAULTS[arch]
  logging.getLogger(__name__).warning("%s: %s is missing; using the %s family's default RoPE base %s",
                                      source, key, arch, theta)
  return theta


def tiny_config(**overrides) -> ModelConfig:
  """A 2-layer random model for tests: GQA 4/2, head_dim 8, vocab 64."""
  base = dict(vocab_size=64, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, ffn_dim=48,
              rope_theta=10000.0, max_positions=256)
  base.update(overrides)
  return ModelConfig(**base)


# Architectures by name, for work that needs the shapes and not the weights: randomly initialised
# models in benchmarks, `jax.eval_shape` and compile-only memory analysis. No file is read. Values
# match the architecture that models.load reads from the checkpoint of the same name (the test
# test_loading.py::test_architecture_shapes_match_checkpoint holds them equal).
ARCHITECTURE_SHAPES = {
    "smollm2-135m": ModelConfig(vocab_size=49152, num_layers=30, d_model=576, num_heads=9, num_kv_heads=3,
                                head_dim=64, ffn_dim=1536, rope_theta=100000.0, norm_eps=1e-5, tie_embeddings=True,
                                max_positions=8192),
    # From each model's published config.json (Hugging Face model cards; shapes only, no weights):
    "llama-3.2-1b": ModelConfig(vocab_size=128256, num_layers=16, d_model=2048, num_heads=32, num_kv_heads=8,
                                head_dim=64, ffn_dim=8192, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=True,
                                rope_scaling=Llama3RopeScaling(32.0, 1.0, 4.0, 8192), max_positions=131072),
    "qwen2.5-1.5b": ModelConfig(vocab_size=151936, num_layers=28, d_model=1536, num_heads=12, num_kv_heads=2,
                                head_dim=128, ffn_dim=8960, rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=True,
                                qkv_bias=True, max_positions=32768, arch="qwen2"),
    "llama-3.1-8b": ModelConfig(vocab_size=128256, num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8,
                                head_dim=128, ffn_dim=14336, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=False,
                                rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 8192), max_positions=131072),
    # google/gemma-3-12b-pt's text_config: five sliding layers (W = 1024) to one global, every sixth.
    "gemma-3-12b": ModelConfig(vocab_size=262208, num_layers=48, d_model=3840, num_heads=16, num_kv_heads=8,
                               head_dim=256, ffn_dim=15360, rope_theta=1000000.0, rope_scaling=LinearRopeScaling(8.0),
                               norm_eps=1e-6, tie_embeddings=True, max_positions=131072, arch="gemma3_text",
                               layer_types=tuple(FULL if (i + 1) % 6 == 0 else SLIDING for i in range(48)),
                               sliding_window=1024, rope_local_theta=10000.0, query_pre_attn_scalar=256.0),
    # google/gemma-4-31B's text_config: five sliding layers (W = 1024; 16 K/V heads of 256) to one global layer
    # (4 K/V heads of 512 whose values are their keys, a quarter of each head turned by RoPE), every sixth.
    "gemma-4-31b": ModelConfig(vocab_size=262144, num_layers=60, d_model=5376, num_heads=32, num_kv_heads=16,
                               head_dim=256, ffn_dim=21504, rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=True,
                               max_positions=262144, arch="gemma4_text",
                               layer_types=tuple(FULL if (i + 1) % 6 == 0 else SLIDING for i in range(60)),
                               sliding_window=1024, rope_local_theta=10000.0, global_head_dim=512, global_kv_heads=4,
                               k_eq_v=True, global_rope_fraction=0.25, final_logit_softcap=30.0),
    # google/gemma-4-E2B's and google/gemma-4-E4B's text_config: per-layer embeddings of 256 per layer, the last 20
    # (E2B) or 18 (E4B) layers reading the K/V of the last earlier layer of their kind (E2B's with a double-wide
    # MLP); four (E2B) or five (E4B) sliding layers (W = 512) to one global layer (head width 512, own values).
    "gemma-4-e2b": ModelConfig(vocab_size=262144, num_layers=35, d_model=1536, num_heads=8, num_kv_heads=1,
                               head_dim=256, ffn_dim=6144, rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=True,
                               max_positions=131072, arch="gemma4_text",
                               layer_types=tuple(FULL if (i + 1) % 5 == 0 else SLIDING for i in range(35)),
                               sliding_window=512, rope_local_theta=10000.0, global_head_dim=512, global_kv_heads=1,
                               global_rope_fraction=0.25, final_logit_softcap=30.0, per_layer_input_dim=256,
                               kv_shared_layers=20, double_wide_mlp=True),
    "gemma-4-e4b": ModelConfig(vocab_size=262144, num_layers=42, d_model=2560, num_heads=8, num_kv_heads=2,
                               head_dim=256, ffn_dim=10240, rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=True,
                               max_positions=131072, arch="gemma4_text",
                               layer_types=tuple(FULL if (i + 1) % 6 == 0 else SLIDING for i in range(42)),
                               sliding_window=512, rope_local_theta=10000.0, global_head_dim=512, global_kv_heads=2,
                               global_rope_fraction=0.25, final_logit_softcap=30.0, per_layer_input_dim=256,
                               kv_shared_layers=18),
    # google/gemma-4-26B-A4B's text_config: 30 layers, five sliding (W = 1024; 8 K/V heads of 256) to one global
    # (2 K/V heads of 512, values their keys); each layer a dense GeGLU MLP of 2,112 beside 128 experts of 704
    # (8 per token).
    "gemma-4-26b-a4b": ModelConfig(vocab_size=262144, num_layers=30, d_model=2816, num_heads=16, num_kv_heads=8,
                                   head_dim=256, ffn_dim=2112, rope_theta=1000000.0, norm_eps=1e-6,
                                   tie_embeddings=True, max_positions=262144, arch="gemma4_text",
                                   layer_types=tuple(FULL if (i + 1) % 6 == 0 else SLIDING for i in range(30)),
                                   sliding_window=1024, rope_local_theta=10000.0, global_head_dim=512,
                                   global_kv_heads=2, k_eq_v=True, global_rope_fraction=0.25,
                                   final_logit_softcap=30.0, num_experts=128, experts_per_token=8,
                                   expert_ffn_dim=704),
    # transformers' Qwen3_5TextConfig defaults ("the Qwen3.5-9B style configuration"): three Gated DeltaNet
    # layers then one gated full-attention layer, eight times.
    # Qwen/Qwen3-30B-A3B's config.json: 48 layers, each a mixture of 128 experts (8 per token) of width 768.
    "qwen3-30b-a3b": ModelConfig(vocab_size=151936, num_layers=48, d_model=2048, num_heads=32, num_kv_heads=4,
                                 head_dim=128, ffn_dim=6144, rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=False,
                                 qk_norm=True, max_positions=40960, arch="qwen3_moe", num_experts=128,
                                 experts_per_token=8, expert_ffn_dim=768, norm_topk_prob=True),
    "qwen3.5-9b": ModelConfig(vocab_size=248320, num_layers=32, d_model=4096, num_heads=16, num_kv_heads=4,
                              head_dim=256, ffn_dim=12288, rope_theta=10000000.0, norm_eps=1e-6, tie_embeddings=False,
                              qk_norm=True, max_positions=32768, arch="qwen3_5_text",
                              layer_types=tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(32)),
                              linear_attention=GatedDeltaNetShape(16, 32, 128, 128, 4), rotary_dim=64),
}


def architecture_shape(name: str) -> ModelConfig:
  """The `ModelConfig` of a named architecture (`ARCHITECTURE_SHAPES`); ValueError naming the known ones."""
  if name not in ARCHITECTURE_SHAPES:
    raise ValueError(f"architecture {name!r} is not one of {tuple(ARCHITECTURE_SHAPES)}")
  return ARCHITECTURE_SHAPES[name]
