"""A Llama-family decoder in Flax NNX that runs ONE SEGMENT of a rollout tree (also Gemma 3's text decoder,
`ModelConfig.gemma`, and Qwen3-MoE's, `ModelConfig.moe`).

Layer parameters are stacked on a leading layer axis and the forward scans over layers
(`jax.lax.scan`), so a 30-layer model compiles as one layer. A segment's forward takes the
K/V of its ancestors (prompt, shared response segments, a decode cache) and returns its own
per-layer K/V and its final hidden states: exactly what branch replay needs to run the prompt
once and each branch on top of it.

Parameter layout (L layers, d model width, Hq/Hkv heads, D head dim, F MLP width, V vocab), with
each parameter's logical axis names (its `nnx.Param` metadata "out_sharding", set by `annotated`):

    embed          [V, d]  (vocab, embed)         lm_head   [d, V]  (embed, vocab)   (absent when tie_embeddings)
    final_norm     [d]     (embed)
    layers.attn_norm, layers.mlp_norm [L, d]                     (layers, embed)
    layers.wq [L, d, Hq, D]            (layers, embed, heads, head_dim)
    layers.wk, layers.wv [L, d, Hkv, D] (layers, embed, kv_heads, head_dim)
    layers.wo [L, Hq, D, d]            (layers, heads, head_dim, embed)
    layers.bq [L, Hq, D]  (layers, heads, head_dim); bk, bv [L, Hkv, D] (layers, kv_heads, head_dim)   (qkv_bias, Qwen2)
    layers.q_norm, layers.k_norm [L, D]                          (layers, head_dim)              (qk_norm, Qwen3, Gemma 3)
    layers.post_attn_norm, layers.post_mlp_norm [L, d]           (layers, embed)                 (Gemma 3)
    layers.w_gate, layers.w_up [L, d, F]  (layers, embed, mlp)   layers.w_down [L, F, d]  (layers, mlp, embed)
    Qwen3-MoE instead: layers.w_router [L, d, E] (layers, embed, experts); layers.w_gate, w_up [L, E, d, F_e]
      (layers, experts, embed, mlp); layers.w_down [L, E, F_e, d] (layers, experts, mlp, embed)
    layers.W_lora_a [L, *in, r]  (layers, *W's input names, lora_rank)
    layers.W_lora_b [L, r, *out] (layers, lora_rank, *W's output names)  (LoRA adapters of W, models/lora.py)

The logical names (LOGICAL_AXES; MaxText's logical axis rules name dimensions the same way) say
what a dimension is, not where it lives: `distributed.sharding`'s one rules table maps them to
mesh axes, so a parameter's layout follows its annotation, never its attribute name.
models/critic.py's value head: value_w [d] (embed), value_b [] ().

Formulas: RMSNorm (Zhang & Sennrich 2019), RoPE in the "rotate half" layout (Su et al. 2021,
arXiv 2104.09864, eq. 34), SwiGLU (Shazeer 2020, arXiv 2002.05202), GQA (Ainslie et al. 2023,
arXiv 2305.13245), Llama-3 RoPE scaling (Meta's `apply_scaling`).

Qwen3-MoE (`ModelConfig.moe`; transformers' `modeling_qwen3_moe`): Qwen3's block with a mixture of E
SwiGLU experts as its MLP, each token run through its top-k experts (`moe_mlp`; docs/design.md, "Mixture
of experts (Qwen3-MoE)").

Gemma 3 (`ModelConfig.gemma`; Gemma Team 2025, arXiv 2503.19786, transformers' `modeling_gemma3`): every
RMSNorm scales by (1 + w), attention and MLP outputs are normed again before the residual add
(post_attn_norm, post_mlp_norm), the MLP is GeGLU with tanh-approximated GELU, embeddings are
multiplied by sqrt(d), and each layer has its own RoPE and window (`_layer_xs`): sliding layers
attend to the last `sliding_window` positions (`kernels.windowed_suffix_attention`, across segment
boundaries: a branch's token sees its ancestors' keys inside the window only).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from branch_replay_jax.kernels import (GLOBAL_WINDOW, KVBlock, attention_fn, resolve_attention_impl,
                                       suffix_attention, windowed_suffix_attention)
from branch_replay_jax.kernels.grouped_matmul import grouped_matmul
from branch_replay_jax.kernels.grouped_matmul_pallas import grouped_matmul_pallas
from branch_replay_jax.kernels.reference import accum_dtype
from branch_replay_jax.kernels.vma import varying_axes
from branch_replay_jax.models.config import SLIDING, LinearRopeScaling, ModelConfig
from branch_replay_jax.models.window_kv import WindowedPrompt, ancestor_blocks, trim


REMAT_POLICIES = ("none", "full", "save_kv", "offload_kv")
EXPERT_TILE = 128   # rows per tile of config.expert_matmul = "tiled" (`kernels.grouped_matmul`)

# Logical axis names of the parameters' dimensions (module docstring); `annotated` refuses others.
LOGICAL_AXES = ("layers", "vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "lora_rank", "conv_kernel",
                "experts", "ple")
AXES_KEY = "out_sharding"   # Flax NNX's Variable metadata key for sharding names (nnx.get_partition_spec reads it)
GATHER_KEY = "gather"       # Variable metadata the mesh step sets on an FSDP shard: a `Gather`


class Gather(NamedTuple):
  """How a parameter the mesh step holds FSDP-sharded becomes whole: all-gather its `dim` (of the
  parameter as stored, a stacked layer parameter's layer axis included) over mesh `axes`
  (`jax.lax.all_gather(..., tiled=True)`; Rajbhandari et al. 2020, ZeRO stage 3, arXiv 1910.02054).
  `distributed.mesh` sets it as the static metadata GATHER_KEY of each shard's Variable inside its
  `shard_map` (docs/design.md, "Mesh and sharding"); the model reads it in `param_value`."""

  dim: int
  axes: tuple[str, ...]
  dispatch: bool = False   # an expert weight split over `axes` on its experts dimension (expert parallelism,
                           # mesh.expert): never gathered; the MoE layer sends the tokens to the experts (`moe_mlp`)


EXPERT_AXES = "expert_axes"   # key of a layer's parameter dict holding the mesh axes its experts are split over

# The mesh axes over which the segment being traced is the same on every device (`replicated_over`).
_REPLICATED_OVER: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("replicated_over", default=())


@contextlib.contextmanager
def replicated_over(axes: Sequence[str]):
  """While tracing inside it, the segment's tokens are the same on every device along the mesh `axes` (a root
  prompt on the branch axis, which every branch device computes: `gradients.step._prompt_state`). A mixture of
  experts split over those axes then runs each device's experts on its own copy and sums the partial outputs
  (`_dispatched_expert_sum`), instead of all-gathering n copies of the same tokens. Read at trace time only."""
  token = _REPLICATED_OVER.set(tuple(axes))
  try:
    yield
  finally:
    _REPLICATED_OVER.reset(token)


def annotated(value, names: Sequence[str], kind=nnx.Param) -> nnx.Variable:
  """`kind(value)` (nnx.Param, or nnx.LoRAParam for adapters) carrying logical axis names `names`, one per
  dimension of value, as Flax NNX sharding metadata (AXES_KEY; eager_sharding off: the names are
  logical, the mesh places the parameter later through `distributed.sharding`'s rules table).

  Raises:
    ValueError: names not one per dimension of value, or a name outside LOGICAL_AXES.
  """
  names = tuple(names)
  if len(names) != len(value.shape) or any(n not in LOGICAL_AXES for n in names):
    raise ValueError(f"annotated: logical axis names {names} for a parameter of shape {tuple(value.shape)} must be "
                     f"one per dimension, each one of {LOGICAL_AXES}")
  return kind(value, eager_sharding=False, **{AXES_KEY: names})


def gathered(x: jax.Array, gather: Gather | None, *, sliced: int = 0) -> jax.Array:
  """x whole: x itself, or x all-gathered as `gather` says (its transpose reduce-scatters the
  gradient); `sliced` leading axes of the stored parameter are gone from x (1 for a layer's slice of
  a stacked parameter, read inside the layer scan)."""
  if gather is None or gather.dispatch:
    return x
  return jax.lax.all_gather(x, gather.axes, axis=gather.dim - sliced, tiled=True)


def param_value(variable: nnx.Variable) -> jax.Array:
  """A parameter's value as the model uses it: whole, all-gathered first when the mesh step holds it
  FSDP-sharded (its GATHER_KEY metadata; `gathered`). How every module reads an unstacked parameter
  (the Llama's own, models.critic's value head)."""
  return gathered(variable[...], variable.get_metadata(GATHER_KEY, None))


def _check_host_memory(remat: str) -> None:
  """Raise ValueError when the default device has no "pinned_host" memory kind to offload residuals to."""
  kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
  if "pinned_host" not in kinds:
    raise ValueError(f"Llama: remat={remat!r} needs a 'pinned_host' memory kind on {jax.devices()[0]}; "
                     f"this backend has {sorted(kinds)} (use remat='save_kv')")


class SegmentOutput(NamedTuple):
  """What one segment's forward returns.

  kv: the segment's own keys/values, k, v [L, B, T, Hkv, D] in the compute dtype, valid [B, T].
  hidden_btd: [B, T, d] final hidden states (after the final RMSNorm), compute dtype.
  router: a Qwen3-MoE model's `RouterStats` [B, E] of the segment's real tokens, every layer; else None.
  experts: a Qwen3-MoE model's experts each token ran, [B, T, L, k] int32 (the sampler records them); else None.
  """

  kv: KVBlock
  hidden_btd: jax.Array
  router: RouterStats | None = None   # Qwen3-MoE: its routing per row [B, E] over the layers (`RouterStats`)
  experts: jax.Array | None = None    # Qwen3-MoE: the experts each token ran per layer [B, T, L, k] int32


def segment_positions(offset, b: int, t: int) -> jax.Array:
  """[B, T] int32 absolute positions offset + i of a segment's tokens (offset an int or [B]), or offset
  itself when it is [B, T] (every token's own position: a packed tree's restart at each branch)."""
  if jnp.ndim(offset) == 2:
    return jnp.broadcast_to(jnp.asarray(offset, jnp.int32), (b, t))
  positions = jnp.reshape(jnp.asarray(offset, jnp.int32), (-1, 1)) + jnp.arange(t, dtype=jnp.int32)[None]
  return jnp.broadcast_to(positions, (b, t))


def rms_norm(x, weight, eps, unit_offset: bool = False):
  """RMSNorm computed in float32 (float64 for float64 x), returned in x's dtype; scaled by weight, or by
  (1 + weight) with unit_offset (Gemma's `Gemma3RMSNorm`, the sum taken in float32 as there)."""
  acc = accum_dtype(x.dtype)
  x32 = x.astype(acc)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * (weight.astype(acc) + (1.0 if unit_offset else 0.0))).astype(x.dtype)


def rope_inv_freq(config: ModelConfig, dtype=jnp.float32, *, local: bool = False) -> jax.Array:
  """[D/2] inverse frequencies (D = rotary_dim where set, else head_dim; float32, or float64 when asked),
  with Llama-3 or linear scaling where configured; local: Gemma 3's sliding layers' (base
  rope_local_theta, unscaled)."""
  d = config.rotary_dim or config.head_dim   # Qwen3.5 turns the first rotary_dim of each head
  theta = config.rope_local_theta if local else config.rope_theta
  inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=dtype) / d))
  s = None if local else config.rope_scaling
  if s is None:
    return inv_freq
  if isinstance(s, LinearRopeScaling):
    return inv_freq / s.factor
  low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
  high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  scaled = jnp.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
  smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
      s.high_freq_factor - s.low_freq_factor)
  smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return jnp.where(medium, smoothed, scaled)


def apply_rope(x_bthd, positions_bt, inv_freq):
  """Rotate-half RoPE at absolute positions (the segment's offset + i)."""
  acc = accum_dtype(x_bthd.dtype)
  angles = positions_bt[..., None].astype(acc) * inv_freq.astype(acc)      # [B, T, D/2]
  cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, :, None, :]
  sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, :, None, :]
  x = x_bthd.astype(acc)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return (x * cos + rotated * sin).astype(x_bthd.dtype)


def _matmul_2d(x, w, n_in: int, n_out: int):
  """x [*kept, *in] times w [*in, *out] -> [*kept, *out], the n_in contracted axes and the n_out
  produced ones each flattened to one, so the dot and both of its gradient dots contract exactly one
  axis. (With several contracted axes, e.g. "btd,btf->df" for a weight gradient, XLA:CPU
  canonicalises the dot by a transposed copy of the [B, T, F] cotangent into [F, B*T]: see
  docs/design.md, "Step profile (CPU)".) Row-major reshapes only: no data moves."""
  kept = x.shape[:x.ndim - n_in]
  c = math.prod(x.shape[x.ndim - n_in:])
  out = w.shape[n_in:n_in + n_out]
  y = jnp.matmul(x.reshape(math.prod(kept), c), w.reshape(c, math.prod(out)))
  return y.reshape(*kept, *out)


def project(p: dict, name: str, spec: str, x, lora_scale: float):
  """x projected by p[name] (einsum `spec`, of the form "KEPT IN, IN OUT -> KEPT OUT"), plus
  lora_scale * (x A) B where p holds the adapters NAME_lora_a [*in, r] and NAME_lora_b [r, *out] of
  models/lora.py; in the compute dtype of x. Computed as 2-D matmuls (`_matmul_2d`) under a
  jax.named_scope of the spec (benchmarks/profile.py tells projections apart by it)."""
  dt = x.dtype
  lhs, rest = spec.split(",")
  w, out = rest.split("->")
  contracted = "".join(c for c in w if c in lhs)
  kept = "".join(c for c in lhs if c not in contracted)
  produced = "".join(c for c in w if c not in lhs)
  if lhs != kept + contracted or w != contracted + produced or out != kept + produced:
    raise ValueError(f"project: spec {spec!r} is not of the form 'KEPT IN, IN OUT -> KEPT OUT'")
  with jax.named_scope(spec):
    y = _matmul_2d(x, p[name].astype(dt), len(contracted), len(produced))
    if name + "_lora_a" not in p:
      return y
    xa = _matmul_2d(x, p[name + "_lora_a"].astype(dt), len(contracted), 1)
    delta = _matmul_2d(xa, p[name + "_lora_b"].astype(dt), 1, len(produced))
  return y + lora_scale * delta


def _layer(config: ModelConfig, p: dict, x_btd, positions_bt, inv_freq, ancestors: Sequence[KVBlock], own_valid_bt,
           attention=suffix_attention, lora_scale: float = 0.0, routes=None, replay_routes: bool = True):
  """One decoder block (Gemma 3's where config.gemma: the module docstring); `attention` has
  `suffix_attention`'s signature; lora_scale multiplies the adapters' output (alpha / rank) where p
  holds adapters; routes, replay_routes: a Qwen3-MoE layer's recorded routes [B, T, k] (`moe_mlp`). Returns (new
  residual, (k, v, route, experts)): a Qwen3-MoE layer's `RouterStats` per row [B, E] over own_valid_bt's tokens
  and the experts each token ran [B, T, k] int32, else None, None."""
  dt = x_btd.dtype
  gemma = config.gemma
  norm = lambda x, w: rms_norm(x, w, config.norm_eps, unit_offset=gemma)
  h = norm(x_btd, p["attn_norm"])
  q = project(p, "wq", "btd,dhk->bthk", h, lora_scale)
  k = project(p, "wk", "btd,dhk->bthk", h, lora_scale)
  v = project(p, "wv", "btd,dhk->bthk", h, lora_scale)
  if config.qkv_bias:
    q, k, v = q + p["bq"].astype(dt), k + p["bk"].astype(dt), v + p["bv"].astype(dt)
  if config.qk_norm:
    q = norm(q, p["q_norm"])
    k = norm(k, p["k_norm"])
  q = apply_rope(q, positions_bt, inv_freq)
  k = checkpoint_name(apply_rope(k, positions_bt, inv_freq), "k")
  v = checkpoint_name(v, "v")
  attn, _ = attention(q, ancestors, KVBlock(k, v, own_valid_bt))
  out = project(p, "wo", "bthk,hkd->btd", attn, lora_scale)
  x_btd = x_btd + (norm(out, p["post_attn_norm"]) if gemma else out)
  h = norm(x_btd, p["mlp_norm"])
  if config.moe:
    out, route, experts = moe_mlp(config, p, h, own_valid_bt, routes, replay_routes, lora_scale)
    return x_btd + out, (k, v, route, experts)
  gate = project(p, "w_gate", "btd,df->btf", h, lora_scale)
  up = project(p, "w_up", "btd,df->btf", h, lora_scale)
  act = jax.nn.gelu(gate, approximate=True) if gemma else jax.nn.silu(gate)
  out = project(p, "w_down", "btf,fd->btd", act * up, lora_scale)
  x_btd = x_btd + (norm(out, p["post_mlp_norm"]) if gemma else out)
  return x_btd, (k, v, None, None)


class RouterStats(NamedTuple):
  """A Qwen3-MoE segment's routing, summed per row over its real tokens and over the layers: counts [B, E] how
  many (layer, token) pairs ran expert e among their k (a function of the selection alone: no gradient),
  probs [B, E] the sum of the router's softmax probabilities of e (differentiable), both in the accumulation
  dtype (float32; float64 under x64). What `losses.load_balancing_loss` reads: sums, so a trajectory's are the
  sums of its segments' (a prefix's once, its continuations' each). With recorded routes (`moe_mlp`'s
  routes): recorded [B] int32 the (layer, token) pairs that have one, mismatch [B] int32 those whose own top k
  (the router's choice now) is another set of experts than the recorded one; 0 without. (Integers: no
  cotangent, so replay carries none for them.)"""
  counts: jax.Array
  probs: jax.Array
  recorded: jax.Array
  mismatch: jax.Array


def moe_mlp(config: ModelConfig, p: dict, h_btd, valid_bt=None, routes=None, replay_routes: bool = True,
            lora_scale: float = 0.0, router_btd=None):
  """Qwen3-MoE's sparse MLP (transformers' `Qwen3MoeSparseMoeBlock`): each token's router probabilities softmax(h
  W_router) (float32), its top experts_per_token experts, their probabilities renormalised to sum 1 with
  norm_topk_prob, and Σ_k w_k · SwiGLU_expert_k(h). The experts run as grouped matmuls: the (token, slot) pairs
  sorted by expert, each expert's rows one contiguous group, by `jax.lax.ragged_dot` (config.expert_matmul
  "ragged_dot": a grouped matmul on TPU, dense over all E on XLA:CPU), `kernels.grouped_matmul` ("tiled": tiles
  of EXPERT_TILE rows of one expert, a token's k experts only, on any backend) or `kernels.grouped_matmul_pallas`
  ("pallas": those tiles as Pallas kernels). The routing is a function of h
  alone, so a prefix's tokens route the same in replay and in naive rows; the router's gradient flows through
  the selected probabilities (the selection itself is piecewise constant). [B, T, d] -> ([B, T, d] in h's dtype,
  the `RouterStats` [B, E] of the tokens where valid_bt [B, T] (default: all) is True, the experts each token
  ran [B, T, k] int32).

  routes: None, or [B, T, k] int32 expert ids the sampler chose for each token at this layer (-1: none
  recorded, the token routes itself). With replay_routes (routing replay, R3: Ma et al. 2025, arXiv 2510.11370;
  NeMo-RL #2590) a token with recorded routes runs those experts, weighted by the current router's
  probabilities of them (renormalised where norm_topk_prob), so the router's gradient flows through the
  weights as it does through its own choice; without, it runs its own top k and the routes are only compared
  (`RouterStats.mismatch`). Where p holds the experts' adapters (w_gate_lora_a [E, d, r], .._lora_b [E, r, F_e],
  models/lora.py) each expert adds lora_scale · (x A_e) B_e to its projection.

  Gemma 4 (config.gemma4; transformers' `Gemma4TextRouter`, `Gemma4TextExperts`): the router reads router_btd
  [B, T, d] (the residual stream; the experts read h_btd), RMS-normalised without a weight and multiplied by
  p["router_scale"] [d] · d^-1/2; the renormalised top-k weights are multiplied by p["expert_scale"] [E] of their
  experts (per_expert_scale); the experts are GeGLU (tanh-approximated GELU) rather than SwiGLU."""
  b, t, d = h_btd.shape
  k, e = config.experts_per_token, config.num_experts
  dt, acc = h_btd.dtype, accum_dtype(h_btd.dtype)
  x = h_btd.reshape(b * t, d)
  r = x if router_btd is None else router_btd.reshape(b * t, d)
  if config.gemma4:
    r = rms_norm(r, jnp.ones((), acc), config.norm_eps) * p["router_scale"].astype(dt) * (d ** -0.5)
  logits = jnp.matmul(r, p["w_router"].astype(dt))
  probs = jax.nn.softmax(logits.astype(acc), axis=-1)
  weights, experts = jax.lax.top_k(probs, k)                                     # [N, k]
  recorded = mismatch = jnp.zeros((b * t,), jnp.int32)
  if routes is not None:
    given = routes.reshape(b * t, k).astype(jnp.int32)
    has = jnp.all(given >= 0, axis=-1)
    recorded = has.astype(jnp.int32)
    mismatch = (has & jnp.any(jnp.sort(given, axis=-1) != jnp.sort(experts, axis=-1), axis=-1)).astype(jnp.int32)
    if replay_routes:
      experts = jnp.where(has[:, None], given, experts)
      weights = jnp.take_along_axis(probs, experts, axis=-1)
  if config.norm_topk_prob:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  if config.gemma4:
    weights = weights * p["expert_scale"].astype(acc)[experts]
  axes = p.get(EXPERT_AXES)
  y = (_expert_sum(config, p, x, experts, weights, lora_scale) if axes is None else
       _dispatched_expert_sum(config, p, x, experts, weights, axes, lora_scale))
  real = (jnp.ones((b, t), bool) if valid_bt is None else valid_bt > 0).reshape(b, t, 1)
  chosen = jnp.sum(jax.nn.one_hot(experts, e, dtype=acc), axis=1).reshape(b, t, e)   # 1 where e is among the top k
  per_row = lambda x: jnp.sum(jnp.where(real, x.reshape(b, t, -1), 0), axis=1)
  route = RouterStats(per_row(chosen), per_row(probs), per_row(recorded)[:, 0], per_row(mismatch)[:, 0])
  return y.reshape(b, t, d), route, experts.reshape(b, t, k)


def _expert_sum(config: ModelConfig, p: dict, x, experts, weights, lora_scale: float = 0.0):
  """Σ_k w_k · SwiGLU_{experts_k}(x) (Gemma 4: GeGLU) [N, d] of N tokens x [N, d] over the E experts p holds
  (w_gate, w_up [E, d, F_e], w_down [E, F_e, d], and their adapters where present), their ids experts [N, k] in
  0..E-1 and weights [N, k]: the (token, slot) pairs sorted by expert, each expert's rows one group of
  config.expert_matmul's grouped matmul."""
  k, e, dt = experts.shape[1], p["w_gate"].shape[0], x.dtype
  flat = experts.reshape(-1)                                                     # [N·k], (token, slot) order
  order = jnp.argsort(flat, stable=True)                                         # sorted by expert
  sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
  rows = x[order // k]
  grouped = {"ragged_dot": jax.lax.ragged_dot, "tiled": functools.partial(grouped_matmul, tile=EXPERT_TILE),
             "pallas": functools.partial(grouped_matmul_pallas, tile=EXPERT_TILE)}[config.expert_matmul]
  def project_experts(rows, name):   # each row by its expert's weight, plus its adapters' rank-r update
    y = grouped(rows, p[name].astype(dt), sizes)
    if name + "_lora_a" not in p:
      return y
    xa = grouped(rows, p[name + "_lora_a"].astype(dt), sizes)
    return y + lora_scale * grouped(xa, p[name + "_lora_b"].astype(dt), sizes)
  with jax.named_scope("moe experts"):
    gate = project_experts(rows, "w_gate")
    up = project_experts(rows, "w_up")
    act = jax.nn.gelu(gate, approximate=True) if config.gemma4 else jax.nn.silu(gate)
    out = project_experts(act * up, "w_down")   # [N·k, d], sorted
  out = out[jnp.argsort(order)].reshape(x.shape[0], k, -1)                     # back to (token, slot) order
  return jnp.einsum("nkd,nk->nd", out, weights.astype(dt))


def _varying(x, axes):
  """x cast to varying over the mesh axes `axes` where it is not yet (a collective over them needs it)."""
  missing = tuple(a for a in axes if a not in varying_axes(x))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def _dispatched_expert_sum(config: ModelConfig, p: dict, x, experts, weights, axes, lora_scale: float = 0.0):
  """`_expert_sum` under expert parallelism (mesh.expert; inside the mesh step's `shard_map`): this device holds
  experts [i·E_l, (i+1)·E_l) of the E (w_gate, w_up, w_down [E_l, ...], i its index over `axes`). The tokens of
  the n devices along `axes` are all-gathered, each device runs its own experts on the (token, slot) pairs routed
  to them (the other pairs run its expert 0 with weight 0: exactly 0, and no gradient), and the partial
  sums are reduce-scattered back to each device's own tokens, so each token gets Σ_k w_k · SwiGLU_{experts_k}
  over all n devices' experts: the one-device value, summed in another order. Megatron-LM's "allgather" token
  dispatcher (`moe_token_dispatcher_type`); its transpose (reduce-scatter of the cotangents, all-gather of the
  partial sums' cotangents) brings each expert the gradient of every token routed to it.

  Where the tokens are the same on every device along `axes` (`replicated_over`: the root prompt over branch),
  nothing is gathered: each device runs its experts on its own copy and the partial sums are all-reduced (psum),
  so every copy gets the whole value. The psum's transpose hands each device's experts the cotangent summed over
  the devices, each copy's share of the prompt's (docs/design.md, "Expert parallelism")."""
  e_local = p["w_gate"].shape[0]
  x, experts, weights = (_varying(a, axes) for a in (x, experts, weights))
  replicated = set(axes) <= set(_REPLICATED_OVER.get())
  gather = (lambda a: a) if replicated else lambda a: jax.lax.all_gather(a, axes, axis=0, tiled=True)
  local = gather(experts) - jax.lax.axis_index(axes) * e_local                    # [n·N, k] this device's ids
  mine = (local >= 0) & (local < e_local)
  y = _expert_sum(config, p, gather(x), jnp.where(mine, local, 0), jnp.where(mine, gather(weights), 0), lora_scale)
  if replicated:
    return jax.lax.pcast(jax.lax.psum(y, axes), axes, to="varying")
  return jax.lax.psum_scatter(y, axes, scatter_dimension=0, tiled=True)


def at_position(x, position, axis: int = 1):
  """x (e.g. [B, T, d]) itself (position None), or its one position `position` ([] int, may be traced) along
  `axis`, kept as a length-1 axis ([B, 1, d])."""
  return x if position is None else jax.lax.dynamic_slice_in_dim(x, position, 1, axis=axis)


def per_layer_routes(config: ModelConfig, routes):
  """Recorded routes [B, T, L, k] as the layer scan's xs [L, B, T, k] (None stays None; ValueError for a model
  without experts)."""
  if routes is None:
    return None
  if not config.moe:
    raise ValueError(f"Llama: routes (recorded expert ids) are a mixture of experts' (arch='qwen3_moe'); "
                     f"arch={config.arch!r} has no experts")
  return jnp.moveaxis(jnp.asarray(routes, jnp.int32), 2, 0)


def summed_over_layers(route: RouterStats | None) -> RouterStats | None:
  """A scan's per-layer `RouterStats` [L, B, E] summed over the layers (None stays None)."""
  return None if route is None else RouterStats(*(jnp.sum(x, axis=0) for x in route))


def rematerialized(body, remat: str, gathering: bool):
  """A scanned layer body under a remat policy (`Llama`'s `remat` argument): its residuals named "layer_input",
  "k", "v" and "gathered_weights" (FSDP's all-gathered weights, never kept: with remat "none" and gathering,
  every activation but them)."""
  if remat == "none" and gathering:
    return jax.checkpoint(body, policy=jax.checkpoint_policies.save_anything_except_these_names("gathered_weights"))
  if remat == "full":
    return jax.checkpoint(body)
  if remat == "save_kv":
    return jax.checkpoint(body, policy=jax.checkpoint_policies.save_only_these_names("k", "v"))
  if remat == "offload_kv":
    return jax.checkpoint(body, policy=jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=("layer_input", "k", "v"),
        offload_src="device", offload_dst="pinned_host"))
  return body


def _layer_attention(config: ModelConfig, layer_xs, inv_freq, attention, positions_bt):
  """(RoPE inverse frequencies, attention function) of one scanned layer: the model's own (layer_xs
  None), or Gemma 3's layer's (layer_xs = its inverse frequencies and window, `Llama._layer_xs`): the
  windowed attention at its window and logit scale query_pre_attn_scalar ** -0.5."""
  if layer_xs is None:
    return inv_freq, attention
  freq, window = layer_xs
  scale = None if config.query_pre_attn_scalar is None else config.query_pre_attn_scalar ** -0.5
  return freq, functools.partial(windowed_suffix_attention, window=window, query_positions=positions_bt, scale=scale)


class DecoderLayers(nnx.Module):
  """The L decoder blocks, each parameter stacked on a leading layer axis."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    L, d, hq, hkv, hd, f = (config.num_layers, config.d_model, config.num_heads, config.num_kv_heads,
                            config.head_dim, config.ffn_dim)
    init = nnx.initializers.normal(0.02)
    normal = lambda *names_shape: annotated(init(rngs.params(), tuple(s for _, s in names_shape)),
                                            [n for n, _ in names_shape])
    norm_init = jnp.zeros if config.gemma else jnp.ones   # Gemma scales by (1 + w)
    self.attn_norm = annotated(norm_init((L, d)), ("layers", "embed"))
    self.mlp_norm = annotated(norm_init((L, d)), ("layers", "embed"))
    if config.gemma:
      self.post_attn_norm = annotated(norm_init((L, d)), ("layers", "embed"))
      self.post_mlp_norm = annotated(norm_init((L, d)), ("layers", "embed"))
    self.wq = normal(("layers", L), ("embed", d), ("heads", hq), ("head_dim", hd))
    self.wk = normal(("layers", L), ("embed", d), ("kv_heads", hkv), ("head_dim", hd))
    self.wv = normal(("layers", L), ("embed", d), ("kv_heads", hkv), ("head_dim", hd))
    self.wo = normal(("layers", L), ("heads", hq), ("head_dim", hd), ("embed", d))
    if config.moe:   # Qwen3-MoE: a router and E experts of width expert_ffn_dim
      e, fe = config.num_experts, config.expert_ffn_dim
      self.w_router = normal(("layers", L), ("embed", d), ("experts", e))
      self.w_gate = normal(("layers", L), ("experts", e), ("embed", d), ("mlp", fe))
      self.w_up = normal(("layers", L), ("experts", e), ("embed", d), ("mlp", fe))
      self.w_down = normal(("layers", L), ("experts", e), ("mlp", fe), ("embed", d))
    else:
      self.w_gate = normal(("layers", L), ("embed", d), ("mlp", f))
      self.w_up = normal(("layers", L), ("embed", d), ("mlp", f))
      self.w_down = normal(("layers", L), ("mlp", f), ("embed", d))
    if config.qkv_bias:
      self.bq = normal(("layers", L), ("heads", hq), ("head_dim", hd))
      self.bk = normal(("layers", L), ("kv_heads", hkv), ("head_dim", hd))
      self.bv = normal(("layers", L), ("kv_heads", hkv), ("head_dim", hd))
    if config.qk_norm:
      self.q_norm = annotated(norm_init((L, hd)), ("layers", "head_dim"))
      self.k_norm = annotated(norm_init((L, hd)), ("layers", "head_dim"))

  def stacked(self) -> tuple[dict, dict]:
    """({name: stacked value [L, ...]}, {name: its `Gather` or None}) of every parameter (adapters included)."""
    params = {name: v for name, v in vars(self).items() if isinstance(v, nnx.Param)}
    return ({name: v[...] for name, v in params.items()},
            {name: v.get_metadata(GATHER_KEY, None) for name, v in params.items()})


class Llama(nnx.Module):
  """Llama-family decoder; see the module docstring for the parameter layout.

  Args:
    config: the architecture.
    dtype: compute dtype (float32, bfloat16, or float64 under `jax_enable_x64`). Parameters
      keep their own dtype (float32 when loaded) and are cast at use.
    remat: rematerialisation policy of each layer (`jax.checkpoint` around the scanned layer body),
      one of REMAT_POLICIES: "none" keeps every activation for the backward pass; "full" keeps
      only each layer's input and recomputes the rest; "save_kv" keeps each layer's input and its
      K/V (`checkpoint_name` "k", "v") and recomputes the rest; "offload_kv" keeps the same
      residuals ("layer_input", "k", "v") in host memory ("pinned_host" memory kind) instead of
      device memory, and raises ValueError here on a backend without that memory kind.
      Gradients are identical.
    attention_impl: suffix attention, one of `ATTENTION_IMPLS`: "xla" (dense jnp reference),
      "pallas" (FlashAttention-2 kernels, interpreted on the CPU; splash attention on a TPU),
      "splash" (TPU splash attention, interpreted on the CPU), "auto" (pallas on a GPU or TPU when
      the head dim allows, else xla); resolved once here and stored as `self.attention_impl`. Gemma 3
      takes "xla" or "auto" (its layers' windowed attention has no kernel yet); ValueError otherwise.
    rngs: initialisation randomness (the loaders overwrite every parameter).
  """

  layers_class = DecoderLayers   # the stacked layer parameters (`qwen3_5.Qwen35` builds its own)

  def __init__(self, config: ModelConfig, *, dtype=jnp.float32, remat: str = "none", attention_impl: str = "xla",
               rngs: nnx.Rngs | None = None):
    rngs = rngs if rngs is not None else nnx.Rngs(0)
    self.config = config
    self.dtype = jnp.dtype(dtype)
    if remat not in REMAT_POLICIES:
      raise ValueError(f"Llama: remat={remat!r} is not one of {REMAT_POLICIES}")
    if remat == "offload_kv":
      _check_host_memory(remat)
    self.remat = remat
    if config.sliding and attention_impl not in ("xla", "auto"):
      raise ValueError(f"Llama: attention_impl={attention_impl!r}: Gemma's layers run the jnp windowed attention "
                       "(kernels.windowed_suffix_attention); no Pallas kernel takes a window yet; use 'xla'")
    self.attention_impl = "xla" if config.sliding else resolve_attention_impl(attention_impl, config.head_dim)
    normal = nnx.initializers.normal(0.02)
    self.embed = annotated(normal(rngs.params(), (config.vocab_size, config.d_model)), ("vocab", "embed"))
    self.layers = self.layers_class(config, rngs=rngs)
    self.final_norm = annotated((jnp.zeros if config.unit_offset_norms else jnp.ones)((config.d_model,)), ("embed",))
    if not config.tie_embeddings:
      self.lm_head = annotated(normal(rngs.params(), (config.d_model, config.vocab_size)), ("embed", "vocab"))
    self.lora = None   # models.lora.LoraSpec once models.lora.add_adapters has added adapters

  def __call__(self, tokens_bt: jax.Array, offset, *, ancestors: Sequence[KVBlock] = (),
               valid_bt: jax.Array | None = None, attention=None, routes=None,
               replay_routes: bool = True, hidden_at=None) -> SegmentOutput:
    """Forward of one segment.

    Args:
      tokens_bt: [B, T] int token ids.
      offset: int or [B] int: absolute position of the segment's first token (the sum of its
        ancestors' lengths). RoPE uses offset + i. Or [B, T] int: each token's position (a packed
        tree, `data.batches.PackedBatch`: positions restart at every branch).
      ancestors: stacked KV blocks of the ancestors, k, v [L, B or 1, S, Hkv, D], valid
        [B or 1, S]; every ancestor key is visible to every query of the segment. Any may be a
        `window_kv.WindowedPrompt` (a Gemma 3 segment's K/V as `branch_kv` trims it).
      valid_bt: [B, T] bool, False on padding; default all True. Padded positions are masked
        out as keys; their own outputs are garbage that callers must mask. Or [B, T] int32 key
        ends (a packed tree): token j is a key of the tokens i with j <= i < valid_bt[j], its
        node's subtree (0: padding); the jnp attention only (`kernels.reference.KVBlock`).
      attention: a `suffix_attention`-compatible function replacing the model's own (default:
        `attention_impl`); context parallelism passes the wrappers of `kernels/context_parallel.py`.
        Gemma 3 takes none (ValueError): its layers' windowed attention is its own.
      routes: Qwen3-MoE only, None or [B, T, L, k] int32 the experts the sampler chose per token and layer
        (-1: none recorded), run in their place with replay_routes (routing replay), else only compared
        (`moe_mlp`, `RouterStats.mismatch`).
      hidden_at: None, or [] int: the one position whose final hidden state is read (a prompt's last real token:
        `prompt_forward`, the sampler's prefills); hidden_btd is then [B, 1, d]. A model with layers whose other
        positions feed nothing else skips them (Gemma 4's K/V-sharing layers, `gemma4.Gemma4.__call__`).

    Returns:
      SegmentOutput(kv with k, v [L, B, T, Hkv, D], hidden_btd [B, T, d] (hidden_at: [B, 1, d]), router:
      Qwen3-MoE's `RouterStats`).
    """
    cfg = self.config
    b, t = tokens_bt.shape
    if valid_bt is None:
      valid_bt = jnp.ones((b, t), dtype=bool)
    positions = segment_positions(offset, b, t)
    inv_freq = rope_inv_freq(cfg, accum_dtype(self.dtype))
    x = self._embed(tokens_bt)
    anc_xs, ancestor_blocks_of = ancestor_blocks(ancestors, self.dtype, cfg.layer_types)
    attention = self._attention(attention)
    lora_scale = 0.0 if self.lora is None else self.lora.scale

    def layer(p, x, xs):
      anc, layer_xs, layer_routes = xs
      freq, attn = _layer_attention(cfg, layer_xs, inv_freq, attention, positions)
      return _layer(cfg, p, x, positions, freq, ancestor_blocks_of(anc), valid_bt, attn, lora_scale, layer_routes,
                    replay_routes)

    xs = (anc_xs, self._layer_xs(), per_layer_routes(cfg, routes))
    x, (k, v, route, experts) = self._scan_layers(layer, x, xs)
    hidden = self._final_norm(at_position(x, hidden_at))
    experts = None if experts is None else jnp.moveaxis(experts, 0, 2)   # [L, B, T, k] -> [B, T, L, k]
    return SegmentOutput(KVBlock(k, v, valid_bt), hidden, summed_over_layers(route), experts)

  def prompt_forward(self, prompt_bt: jax.Array, valid_bt: jax.Array, last, **kw) -> tuple:
    """A root prompt's forward for replay, of whose final hidden states only position `last`'s is read (it
    predicts each child's first token): (its K/V for its descendants (`branch_kv`), the hidden state at `last`
    [d], its `RouterStats` or None). prompt_bt, valid_bt: [1, P]; last: [] int; kw: `__call__`'s routes. Gemma 4
    runs its K/V-sharing layers on position `last` alone (`__call__`'s hidden_at)."""
    out = self(prompt_bt, 0, valid_bt=valid_bt, hidden_at=last, **kw)
    return self.branch_kv(out.kv), out.hidden_btd[0, 0], out.router

  def branch_kv(self, kv: KVBlock) -> KVBlock | WindowedPrompt:
    """A segment's K/V (`SegmentOutput.kv`, its valid keys a prefix of its slots: a prompt, a tree node, an
    episode's turn) as replay hands it to its descendants, which take it back as an ancestor: a sliding-window
    model's trimmed to the keys a window still reaches (`window_kv.trim`), else kv itself."""
    return trim(kv, self.config.layer_types, self.config.sliding_window) if self.config.gemma else kv

  def _embed(self, tokens_bt):
    """[B, T, d] token embeddings in the compute dtype (Gemma's times sqrt(d), taken in that dtype as
    transformers' `Gemma3TextScaledWordEmbedding` does)."""
    x = param_value(self.embed)[tokens_bt].astype(self.dtype)
    return x * jnp.asarray(self.config.d_model ** 0.5, self.dtype) if self.config.sliding else x

  def _final_norm(self, x):
    return rms_norm(x, param_value(self.final_norm), self.config.norm_eps, unit_offset=self.config.unit_offset_norms)

  def _attention(self, attention):
    """The suffix attention a forward uses: the model's own, or the caller's (not for Gemma 3)."""
    if attention is not None and self.config.sliding:
      raise ValueError("Llama: Gemma's layers take no attention= override (context parallelism, a kernel): their "
                       "sliding windows run in kernels.windowed_suffix_attention only")
    return attention_fn(self.attention_impl) if attention is None else attention

  def _layer_xs(self):
    """None, or for Gemma 3 (inv_freq [L, D/2], window [L] int32) scanned with the layers: a sliding
    layer's local RoPE and sliding_window, a full layer's global RoPE and `GLOBAL_WINDOW`."""
    cfg = self.config
    if not cfg.gemma:
      return None
    acc = accum_dtype(self.dtype)
    glob, local = rope_inv_freq(cfg, acc), None
    if SLIDING in cfg.layer_types:
      local = rope_inv_freq(cfg, acc, local=True)
    sliding = [kind == SLIDING for kind in cfg.layer_types]
    freqs = jnp.stack([local if s else glob for s in sliding])
    windows = jnp.asarray([cfg.sliding_window if s else GLOBAL_WINDOW for s in sliding], jnp.int32)
    return freqs, windows

  def prompt_and_rows(self, prompt_bt: jax.Array, prompt_valid_bt: jax.Array, prompt_last, rows_bt: jax.Array,
                      rows_offset, rows_valid_bt: jax.Array, *, attention=None, routes=(None, None),
                      replay_routes: bool = True) -> tuple:
    """Forward of a prompt and B rows that continue it (a group's completions), in ONE layer scan.

    Layer l runs the prompt, then the rows on top of the prompt's layer-l K/V (the prompt shared as
    one batch-1 ancestor block). The result equals `self(prompt)` followed by `self(rows, ancestors=
    [the prompt's K/V])`; the difference is only in what the backward pass holds. Differentiated as
    one function, autodiff sums the B rows' cotangents of layer l's prompt K/V inside layer l's
    backward and pulls them back there, so no [L, P] K/V cotangent exists: the saved residuals are
    those of P + B·T positions under `remat` (docs/design.md, "Memory and remat"). No K/V is
    returned: nothing attends to the rows afterwards, and of the prompt's final hidden states only
    position prompt_last's (the one that predicts each row's first token) is normalised and returned,
    so no [P, d] final-norm output or its cotangent exists either (RMSNorm is per position).

    Args:
      prompt_bt: [1, P] int token ids of the prompt (positions 0..P-1).
      prompt_valid_bt: [1, P] bool, False on padding (masked as keys).
      prompt_last: int or [] int, the prompt position whose hidden state is returned (its last real one).
      rows_bt: [B, T] int token ids of the rows.
      rows_offset: int or [B] int, the absolute position of each row's first token (the prompt's length).
      rows_valid_bt: [B, T] bool, False on padding.
      attention: a `suffix_attention`-compatible function replacing the model's own (default:
        `attention_impl`).
      routes, replay_routes: Qwen3-MoE's recorded routes of the prompt [1, P, L, k] and of the rows
        [B, T, L, k] (each None or int32, `__call__`'s).

    Returns:
      (prompt hidden at prompt_last [d], rows hidden [B, T, d], routes): final hidden states (after the final
      RMSNorm), compute dtype; routes a Qwen3-MoE model's (prompt's `RouterStats` [1, E], rows' [B, E]), else
      (None, None).
    """
    cfg = self.config
    p_len = prompt_bt.shape[1]
    b, t = rows_bt.shape
    prompt_positions = segment_positions(0, 1, p_len)
    rows_positions = segment_positions(rows_offset, b, t)
    inv_freq = rope_inv_freq(cfg, accum_dtype(self.dtype))
    x = (self._embed(prompt_bt), self._embed(rows_bt))
    attention = self._attention(attention)
    lora_scale = 0.0 if self.lora is None else self.lora.scale

    def layer(p, x, xs):
      x_prompt, x_rows = x
      layer_xs, (prompt_routes, rows_routes) = xs
      freq, attn = _layer_attention(cfg, layer_xs, inv_freq, attention, prompt_positions)
      x_prompt, (k, v, prompt_route, _) = _layer(cfg, p, x_prompt, prompt_positions, freq, (), prompt_valid_bt, attn,
                                              lora_scale, prompt_routes, replay_routes)
      freq, attn = _layer_attention(cfg, layer_xs, inv_freq, attention, rows_positions)
      x_rows, (_, _, rows_route, _) = _layer(cfg, p, x_rows, rows_positions, freq, [KVBlock(k, v, prompt_valid_bt)],
                                          rows_valid_bt, attn, lora_scale, rows_routes, replay_routes)
      return (x_prompt, x_rows), (prompt_route, rows_route)

    xs = (self._layer_xs(), tuple(per_layer_routes(cfg, r) for r in routes))
    (x_prompt, x_rows), routes = self._scan_layers(layer, x, xs)
    x_last = jax.lax.dynamic_index_in_dim(x_prompt[0], prompt_last, keepdims=False)
    return self._final_norm(x_last), self._final_norm(x_rows), tuple(summed_over_layers(r) for r in routes)

  def _scan_layers(self, layer, x, xs):
    """`jax.lax.scan` of layer(p, x, xs_l) -> (x, ys_l) over the L layers, p one layer's parameters
    (all-gathered just before use where the mesh step marked them with a `Gather`), x the carry (a
    residual stream [B, T, d] or a tuple of them, each named "layer_input"), under this model's remat
    policy. Returns (x, ys stacked [L, ...])."""
    stacked, gathers = self.layers.stacked()
    gathering = any(g is not None for g in gathers.values())

    def body(x, layer_xs):
      p, xs_l = layer_xs
      if gathering:   # FSDP: one layer's weights all-gathered here, just before use
        p = {k: checkpoint_name(gathered(v, gathers[k], sliced=1), "gathered_weights") for k, v in p.items()}
        p.update({EXPERT_AXES: g.axes for g in gathers.values() if g is not None and g.dispatch})
      # every use below reads the named copy, so "offload_kv" can offload it
      x = jax.tree_util.tree_map(lambda a: checkpoint_name(a, "layer_input"), x)
      return layer(p, x, xs_l)

    return jax.lax.scan(rematerialized(body, self.remat, gathering), x, (stacked, xs))

  def unembedding(self) -> jax.Array:
    """[d, V] output projection (the transposed embedding when tied)."""
    if self.config.tie_embeddings:
      return param_value(self.embed).T
    return param_value(self.lm_head)

  def output_weights(self) -> tuple[jax.Array, int]:
    """(w, vocab_axis): the output projection as stored, the tied embedding [V, d] (vocab_axis 0) or
    lm_head [d, V] (vocab_axis 1), for `token_logprobs`. Contracting the embedding as stored spares
    the [d, V] transpose `unembedding()` makes, which XLA does not hoist out of a replay scan: it
    was copied once per scan step (docs/design.md, "Step profile")."""
    if self.config.tie_embeddings:
      return param_value(self.embed), 0
    return param_value(self.lm_head), 1

  @property
  def logit_softcap(self) -> float | None:
    """The cap of the output logits (`token_logprobs`' softcap): None here, Gemma 4's in `gemma4.Gemma4`."""
    return None

  def logits(self, hidden_btd: jax.Array) -> jax.Array:
    """[B, T, V] float32 (float64 for float64 compute) logits, soft-capped where the model caps them
    (`logit_softcap`). Only for short segments; long ones use `token_logprobs`."""
    w = self.unembedding().astype(hidden_btd.dtype)
    return soft_cap(jnp.einsum("btd,dv->btv", hidden_btd, w, preferred_element_type=accum_dtype(hidden_btd.dtype)),
                    self.logit_softcap)


def soft_cap(logits: jax.Array, cap: float | None) -> jax.Array:
  """c · tanh(logits / c) for a cap c (Gemma 4's final_logit_softcapping, transformers' `Gemma4ForCausalLM`);
  the logits themselves for None."""
  return logits if cap is None else cap * jnp.tanh(logits / cap)


def token_logprobs(hidden_btd: jax.Array, w: jax.Array, targets_bt: jax.Array, *, chunk: int = 256,
                   vocab_axis: int = 1, temperature: float = 1.0, softcap: float | None = None) -> jax.Array:
  """log softmax(cap(h_t W) / τ)[target_t] without holding [T, V] logits for the whole segment.

  Positions are processed in n = ceil(T / chunk) equal chunks of ceil(T / n) <= chunk positions with
  `jax.lax.map` (the last padded by fewer than n positions); when there are several chunks each
  chunk's logits are recomputed in the backward pass (`jax.checkpoint`), so memory is O(B * chunk * V).
  A single chunk is not recomputed: its logits are live at the backward's start either way.

  Args:
    hidden_btd: [B, T, d] hidden states that predict the targets (position t predicts target t).
    w: the unembedding, [d, V] (vocab_axis 1) or [V, d] (vocab_axis 0: a tied embedding as stored,
      `Llama.output_weights`).
    targets_bt: [B, T] int token ids.
    chunk: positions per chunk (tokens).
    vocab_axis: 0 or 1, the axis of w that indexes the vocabulary.
    temperature: τ > 0, a Python float: the logits are divided by it before the softmax, as the
      sampler draws (docs/design.md, "Log-prob temperature"); 1 (the default) skips the division.
    softcap: None, or c > 0: the logits soft-capped first, cap(z) = c · tanh(z / c) (Gemma 4's
      final_logit_softcapping, `Llama.logit_softcap`); None (the default) leaves them as they are.

  Returns:
    [B, T] float32 log-probabilities (float64 for float64 hidden states).

  Raises:
    ValueError: if vocab_axis is not 0 or 1.
  """
  if vocab_axis not in (0, 1):
    raise ValueError(f"token_logprobs: vocab_axis={vocab_axis!r} must be 0 ([V, d]) or 1 ([d, V])")
  spec = "nd,dv->nv" if vocab_axis == 1 else "nd,vd->nv"   # rows flattened: one contracted axis in every gradient dot
  b, t, d = hidden_btd.shape
  n = -(-t // max(1, min(chunk, t)))   # chunks of at most `chunk` positions,
  c = -(-t // n)                        # as even as they go: t = 320 at chunk 128 pads to 321, not 384
  pad = n * c - t
  h = jnp.pad(hidden_btd, ((0, 0), (0, pad), (0, 0))).reshape(b, n, c, d).swapaxes(0, 1)
  y = jnp.pad(targets_bt, ((0, 0), (0, pad))).reshape(b, n, c).swapaxes(0, 1)
  w = w.astype(hidden_btd.dtype)

  def one(args):
    h_bcd, y_bc = args
    logits = jnp.einsum(spec, h_bcd.reshape(-1, d), w, preferred_element_type=accum_dtype(h_bcd.dtype))
    logits = soft_cap(logits, softcap)
    if temperature != 1.0:
      logits = logits / temperature
    picked = jnp.take_along_axis(logits, y_bc.reshape(-1, 1), axis=-1)[:, 0]
    return (picked - jax.nn.logsumexp(logits, axis=-1)).reshape(y_bc.shape)

  if n == 1:   # one chunk: recomputing it in the backward pass would not lower the peak, only add a matmul
    out = one((h[0], y[0]))[None]
  else:
    out = jax.lax.map(jax.checkpoint(one), (h, y))   # [n, B, c]
  return out.swapaxes(0, 1).reshape(b, n * c)[:, :t]
