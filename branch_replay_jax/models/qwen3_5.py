"""Qwen3.5's text decoder in Flax NNX (transformers' `modeling_qwen3_5`, `Qwen3_5TextModel`): Gated DeltaNet
linear-attention layers beside gated full-attention layers, running ONE SEGMENT of a rollout tree.

A segment's forward takes its ancestors' `HybridState`s and returns its own: the K/V of the full-attention
layers (every ancestor's are attended to, as in `llama.py`) and, of the linear layers, the convolution
inputs and recurrent state after the segment's last real token (only the parent's is read: it already
holds every earlier ancestor's). Branch replay therefore hands each branch the prefix's final state, and
the branches' cotangents of that state are summed into one pullback as for K/V (docs/design.md, "Linear
attention (Qwen3.5)").

Layers repeat a pattern (`layer_types`, e.g. three linear then one full): the forward scans over the
repetitions (`jax.lax.scan`), each step running the pattern's layers in order.

Parameter layout (L layers, Lf full and Ll linear; d, Hq/Hkv heads of width D, F MLP width; Hk/Hv linear
key/value heads of width Dk/Dv, K conv taps), logical axis names as in `llama.py`:

    embed [V, d], lm_head [d, V] (absent when tied), final_norm [d]
    layers.attn_norm, layers.mlp_norm [L, d]; layers.w_gate, w_up [L, d, F]; layers.w_down [L, F, d]
      Qwen3.5-MoE instead (arch "qwen3_5_moe_text"): layers.w_router [L, d, E]; layers.w_gate, w_up [L, E, d, F_e],
      layers.w_down [L, E, F_e, d] (the experts, as Qwen3-MoE's in `llama.py`); the shared expert layers.ws_gate,
      ws_up [L, d, F], ws_down [L, F, d] and its gate layers.ws_scale [L, d]
    full.wq, full.wq_gate [Lf, d, Hq, D]; full.wk, full.wv [Lf, d, Hkv, D]; full.wo [Lf, Hq, D, d];
    full.q_norm, full.k_norm [Lf, D]
    linear.wq, linear.wk [Ll, d, Hk, Dk]; linear.wv, linear.wz [Ll, d, Hv, Dv]; linear.wb, linear.wa [Ll, d, Hv];
    linear.conv_q, linear.conv_k [Ll, K, Hk, Dk]; linear.conv_v [Ll, K, Hv, Dv]; linear.dt_bias, linear.a_log
    [Ll, Hv]; linear.norm [Ll, Dv]

Formulas (transformers' `Qwen3_5DecoderLayer`): RMSNorms scale by (1 + w) (Gemma's form), except the
linear layers' gated output norm (w, then × silu(z)); the full layers' query projection also yields a
per-head gate, output × sigmoid(gate) (Qiu et al. 2025, "Gated Attention", arXiv 2505.06708); Q/K
RMSNorm; RoPE on the first `rotary_dim` of each head; SwiGLU MLP. Qwen3.5-MoE (transformers'
`modeling_qwen3_5_moe`, `Qwen3_5MoeSparseMoeBlock`): the MLP is `llama.moe_mlp`'s mixture of experts (top-k of
softmax(x W_router), renormalised) plus sigmoid(x · ws_scale) · SwiGLU_shared(x). Linear layers: q, k, v through a
depthwise causal convolution of K taps and SiLU, q and k l2-normalised, β = sigmoid(x W_b), g =
-exp(A_log) softplus(x W_a + dt_bias), the gated delta rule (`models.gated_delta`), out_proj.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from branch_replay_jax.kernels import KVBlock
from branch_replay_jax.kernels.reference import accum_dtype
from branch_replay_jax.models import gated_delta
from branch_replay_jax.models.hf_loader import ROUTER_TENSOR, check_tensors, expert_tensor
from branch_replay_jax.models.config import FULL, LINEAR, ModelConfig
from branch_replay_jax.models.llama import (EXPERT_AXES, GATHER_KEY, REMAT_POLICIES, Llama, SegmentOutput, annotated,
                                            apply_rope, at_position, gathered, moe_mlp, per_layer_routes, project,
                                            rematerialized, rms_norm, rope_inv_freq, segment_positions,
                                            summed_over_layers)

CHUNK = 64   # tokens per chunk of the chunked gated delta rule (transformers' chunk_size)


class HybridState(NamedTuple):
  """A segment's state for its descendants (a `KVBlock` with the linear layers' state beside it).

  k, v: [Lf, B, T, Hkv, D] the full-attention layers' keys/values; valid: [B, T] bool.
  conv: [Ll, B, K-1, C] the linear layers' last K-1 convolution inputs (C = 2·Hk·Dk + Hv·Dv channels).
  recurrent: [Ll, B, Hv, Dk, Dv] the linear layers' recurrent state, in the accumulation dtype.
  Both after each row's last real token. Every field but `valid` leads with its layer axis.
  """

  k: jax.Array
  v: jax.Array
  valid: jax.Array
  conv: jax.Array
  recurrent: jax.Array


class HybridLayers(nnx.Module):
  """Parameters of the L layers, stacked per kind: `shared` norms and MLP [L, ...] (Qwen3.5-MoE: its router,
  experts and shared expert, the module docstring), `full` [Lf, ...], `linear` [Ll, ...]."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c, la = config, config.linear_attention
    L = c.num_layers
    lf = sum(t == FULL for t in c.layer_types)
    ll = L - lf
    init = nnx.initializers.normal(0.02)
    normal = lambda *ns: annotated(init(rngs.params(), tuple(s for _, s in ns)), [n for n, _ in ns])
    const = lambda value, *ns: annotated(jnp.full(tuple(s for _, s in ns), value, jnp.float32), [n for n, _ in ns])
    self.attn_norm = const(0.0, ("layers", L), ("embed", c.d_model))
    self.mlp_norm = const(0.0, ("layers", L), ("embed", c.d_model))
    if c.moe:   # Qwen3.5-MoE: the router, E experts of width expert_ffn_dim, and the shared expert of width ffn_dim
      e, fe = c.num_experts, c.expert_ffn_dim
      self.w_router = normal(("layers", L), ("embed", c.d_model), ("experts", e))
      self.w_gate = normal(("layers", L), ("experts", e), ("embed", c.d_model), ("mlp", fe))
      self.w_up = normal(("layers", L), ("experts", e), ("embed", c.d_model), ("mlp", fe))
      self.w_down = normal(("layers", L), ("experts", e), ("mlp", fe), ("embed", c.d_model))
      self.ws_gate = normal(("layers", L), ("embed", c.d_model), ("mlp", c.ffn_dim))
      self.ws_up = normal(("layers", L), ("embed", c.d_model), ("mlp", c.ffn_dim))
      self.ws_down = normal(("layers", L), ("mlp", c.ffn_dim), ("embed", c.d_model))
      self.ws_scale = normal(("layers", L), ("embed", c.d_model))
    else:
      self.w_gate = normal(("layers", L), ("embed", c.d_model), ("mlp", c.ffn_dim))
      self.w_up = normal(("layers", L), ("embed", c.d_model), ("mlp", c.ffn_dim))
      self.w_down = normal(("layers", L), ("mlp", c.ffn_dim), ("embed", c.d_model))
    self.full = ParamBag(
        wq=normal(("layers", lf), ("embed", c.d_model), ("heads", c.num_heads), ("head_dim", c.head_dim)),
        wq_gate=normal(("layers", lf), ("embed", c.d_model), ("heads", c.num_heads), ("head_dim", c.head_dim)),
        wk=normal(("layers", lf), ("embed", c.d_model), ("kv_heads", c.num_kv_heads), ("head_dim", c.head_dim)),
        wv=normal(("layers", lf), ("embed", c.d_model), ("kv_heads", c.num_kv_heads), ("head_dim", c.head_dim)),
        wo=normal(("layers", lf), ("heads", c.num_heads), ("head_dim", c.head_dim), ("embed", c.d_model)),
        q_norm=const(0.0, ("layers", lf), ("head_dim", c.head_dim)),
        k_norm=const(0.0, ("layers", lf), ("head_dim", c.head_dim)))
    hk, hv, dk, dv, k = (la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim, la.conv_kernel)
    self.linear = ParamBag(
        wq=normal(("layers", ll), ("embed", c.d_model), ("kv_heads", hk), ("head_dim", dk)),
        wk=normal(("layers", ll), ("embed", c.d_model), ("kv_heads", hk), ("head_dim", dk)),
        wv=normal(("layers", ll), ("embed", c.d_model), ("heads", hv), ("head_dim", dv)),
        wz=normal(("layers", ll), ("embed", c.d_model), ("heads", hv), ("head_dim", dv)),
        wb=normal(("layers", ll), ("embed", c.d_model), ("heads", hv)),
        wa=normal(("layers", ll), ("embed", c.d_model), ("heads", hv)),
        conv_q=normal(("layers", ll), ("conv_kernel", k), ("kv_heads", hk), ("head_dim", dk)),
        conv_k=normal(("layers", ll), ("conv_kernel", k), ("kv_heads", hk), ("head_dim", dk)),
        conv_v=normal(("layers", ll), ("conv_kernel", k), ("heads", hv), ("head_dim", dv)),
        dt_bias=const(1.0, ("layers", ll), ("heads", hv)),
        a_log=annotated(jnp.log(jax.random.uniform(rngs.params(), (ll, hv), minval=1.0, maxval=16.0)),
                        ("layers", "heads")),
        norm=const(1.0, ("layers", ll), ("head_dim", dv)),
        wo=normal(("layers", ll), ("heads", hv), ("head_dim", dv), ("embed", c.d_model)))

  def stacked(self) -> tuple[tuple[dict, dict, dict], tuple[dict, dict, dict]]:
    """(values, gathers): ({shared name: [L, ...]}, {full name: [Lf, ...]}, {linear name: [Ll, ...]}) and the
    same dicts of each parameter's `Gather` or None (FSDP, as `DecoderLayers.stacked`)."""
    return stacked_kinds(self, self.full, self.linear)


def _params(module) -> dict:
  return {n: v for n, v in vars(module).items() if isinstance(v, nnx.Param)}


def stacked_kinds(*modules) -> tuple[tuple[dict, ...], tuple[dict, ...]]:
  """(values, gathers) of the parameters each module holds directly (its own, not its submodules'), one dict per
  module, and the same dicts of each parameter's `Gather` or None (FSDP, as `DecoderLayers.stacked`)."""
  kinds = tuple(_params(m) for m in modules)
  return (tuple({n: v[...] for n, v in d.items()} for d in kinds),
          tuple({n: v.get_metadata(GATHER_KEY, None) for n, v in d.items()} for d in kinds))


def stack_layers(outputs: list):
  """A scan body's per-layer outputs (pytrees of like shapes, in layer order) stacked leaf by leaf on a new
  leading layer axis; None for no layers."""
  return jax.tree_util.tree_map(lambda *a: jnp.stack(a), *outputs) if outputs else None


class ParamBag(nnx.Module):
  """A named bag of stacked parameters."""

  def __init__(self, **params):
    for name, value in params.items():
      setattr(self, name, value)


def _full_layer(config, p, x_btd, positions_bt, inv_freq, ancestors: Sequence[KVBlock], valid_bt, attention,
                lora_scale: float = 0.0):
  """A gated full-attention block's mixer: (output [B, T, d], (k, v)); wq, wk, wv, wo with their LoRA adapters
  where p holds them (`models.lora`, scaled by lora_scale)."""
  norm = lambda x, w: rms_norm(x, w, config.norm_eps, unit_offset=True)
  q = norm(project(p, "wq", "btd,dhk->bthk", x_btd, lora_scale), p["q_norm"])
  gate = project(p, "wq_gate", "btd,dhk->bthk", x_btd, 0.0)
  k = norm(project(p, "wk", "btd,dhk->bthk", x_btd, lora_scale), p["k_norm"])
  v = checkpoint_name(project(p, "wv", "btd,dhk->bthk", x_btd, lora_scale), "v")
  rd = config.rotary_dim
  rope = lambda t: jnp.concatenate([apply_rope(t[..., :rd], positions_bt, inv_freq), t[..., rd:]], axis=-1)
  q, k = rope(q), checkpoint_name(rope(k), "k")
  attn, _ = attention(q, ancestors, KVBlock(k, v, valid_bt))
  attn = attn * jax.nn.sigmoid(gate.astype(accum_dtype(gate.dtype))).astype(attn.dtype)
  return project(p, "wo", "bthk,hkd->btd", attn, lora_scale), (k, v)


def _linear_layer(config, p, x_btd, conv_state, state, valid_bt, chunk):
  """A Gated DeltaNet block's mixer: (output [B, T, d], (conv state [B, K-1, C], recurrent state [B, Hv, Dk, Dv]))."""
  la = config.linear_attention
  b, t, _ = x_btd.shape
  acc = accum_dtype(x_btd.dtype)
  hk, hv, dk, dv = la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim
  x = jnp.where(valid_bt[..., None], x_btd, 0).astype(x_btd.dtype)
  qkv = jnp.concatenate([project(p, n, "btd,dhk->bthk", x, 0.0).reshape(b, t, -1) for n in ("wq", "wk", "wv")], -1)
  taps = jnp.concatenate([p[n].reshape(la.conv_kernel, -1) for n in ("conv_q", "conv_k", "conv_v")], -1)
  mixed, conv_state = gated_delta.causal_conv(qkv, conv_state, taps, valid_bt)
  q, k, v = jnp.split(mixed.astype(acc), [hk * dk, 2 * hk * dk], axis=-1)
  q, k, v = q.reshape(b, t, hk, dk), k.reshape(b, t, hk, dk), v.reshape(b, t, hv, dv)
  q = gated_delta.l2_normalize(q) * dk ** -0.5
  k = gated_delta.l2_normalize(k)
  if hv != hk:   # each key head serves hv / hk consecutive value heads
    q, k = jnp.repeat(q, hv // hk, axis=2), jnp.repeat(k, hv // hk, axis=2)
  beta = jax.nn.sigmoid(project(p, "wb", "btd,dh->bth", x, 0.0).astype(acc))
  g = -jnp.exp(p["a_log"].astype(acc)) * jax.nn.softplus(project(p, "wa", "btd,dh->bth", x, 0.0).astype(acc)
                                                          + p["dt_bias"].astype(acc))
  beta, g = jnp.where(valid_bt[..., None], beta, 0), jnp.where(valid_bt[..., None], g, 0)   # padding: no-op
  k = jnp.where(valid_bt[..., None, None], k, 0)
  rule = gated_delta.recurrent if t == 1 else lambda *a: gated_delta.chunked(*a, chunk=chunk,
                                                                          scan=config.gated_delta_scan)
  out, state = rule(q, k, v, g, beta, jnp.broadcast_to(state.astype(acc), (b, *state.shape[1:])))
  z = project(p, "wz", "btd,dhk->bthk", x, 0.0).astype(acc)
  y = out * jax.lax.rsqrt(jnp.mean(out * out, axis=-1, keepdims=True) + config.norm_eps)
  y = (y * p["norm"].astype(acc) * jax.nn.silu(z)).astype(x_btd.dtype)
  return project(p, "wo", "bthk,hkd->btd", y, 0.0), (conv_state, state)


class Qwen35(Llama):
  """Qwen3.5's text decoder (the module docstring); a `Llama` for everything past the layers (embedding,
  final norm, unembedding, `token_logprobs`), so heads, losses and steps take it as they take a Llama.

  Args:
    config: a `ModelConfig` with arch 'qwen3_5_text'.
    dtype: compute dtype; the linear layers' recurrence runs in float32 (float64 under float64).
    remat: one of `REMAT_POLICIES` but "offload_kv" (ValueError): as `Llama`, "save_kv" saving the full
      layers' K/V.
    attention_impl: the full layers' suffix attention, as `Llama`.
    chunk: tokens per chunk of the chunked gated delta rule.
  """

  layers_class = HybridLayers

  def __init__(self, config: ModelConfig, *, dtype=jnp.float32, remat: str = "none", attention_impl: str = "xla",
               chunk: int = CHUNK, rngs: nnx.Rngs | None = None):
    if not config.hybrid:
      raise ValueError(f"Qwen35: config.arch={config.arch!r}; expected 'qwen3_5_text'")
    if remat not in REMAT_POLICIES or remat == "offload_kv":   # named with the policies Qwen3.5 takes
      raise ValueError(f"Qwen35: remat={remat!r} is not one of {tuple(r for r in REMAT_POLICIES if r != 'offload_kv')}")
    if not isinstance(chunk, int) or chunk < 1:
      raise ValueError(f"Qwen35: chunk={chunk!r} must be a positive int")
    super().__init__(config, dtype=dtype, remat=remat, attention_impl=attention_impl, rngs=rngs)
    self.chunk = chunk

  def initial_state(self, batch: int) -> HybridState:
    """The state before a sequence's first token: no keys, zero convolution inputs and recurrent state."""
    c, la = self.config, self.config.linear_attention
    lf = sum(t == FULL for t in c.layer_types)
    ll = c.num_layers - lf
    kv = jnp.zeros((lf, batch, 0, c.num_kv_heads, c.head_dim), self.dtype)
    return HybridState(kv, kv, jnp.zeros((batch, 0), bool),
                       jnp.zeros((ll, batch, la.conv_kernel - 1, la.conv_channels), self.dtype),
                       jnp.zeros((ll, batch, la.num_value_heads, la.key_head_dim, la.value_head_dim),
                                 accum_dtype(self.dtype)))

  def __call__(self, tokens_bt: jax.Array, offset, *, ancestors: Sequence[HybridState] = (),
               valid_bt: jax.Array | None = None, attention=None, routes=None,
               replay_routes: bool = True, hidden_at=None) -> SegmentOutput:
    """Forward of one segment on its ancestors' states (`Llama.__call__`'s contract).

    Args:
      tokens_bt: [B, T] int token ids.
      offset: int or [B] int: the absolute position of the first token (RoPE of the full layers).
      ancestors: the ancestors' `HybridState`s, oldest first (batch B or 1): the full layers attend to
        all of their keys, the linear layers continue from the last one's state (none: the zero state).
      valid_bt: [B, T] bool, a prefix of each row (right padding) or, for a whole sequence, a suffix
        (left padding); default all True. Padded positions leave the linear layers' state unchanged.
      attention: a `suffix_attention`-compatible function for the full layers (default: the model's own).
      routes, replay_routes: Qwen3.5-MoE only, the sampler's recorded experts [B, T, L, k] (`Llama.__call__`).
      hidden_at: None or [] int, `Llama.__call__`'s: hidden_btd is then that position's, [B, 1, d].

    Returns:
      SegmentOutput(kv: this segment's `HybridState` [.., B, ..], hidden_btd [B, T, d]; Qwen3.5-MoE: router, its
      `llama.RouterStats` [B, E] summed over the layers, experts [B, T, L, k] int32).

    Raises:
      ValueError: int32 key ends in valid_bt (a packed tree: the recurrence has no per-token ancestry).
    """
    b, t = tokens_bt.shape
    if valid_bt is None:
      valid_bt = jnp.ones((b, t), dtype=bool)
    if valid_bt.dtype != jnp.bool_ or jnp.ndim(offset) == 2:
      raise ValueError("Qwen35: a packed tree (per-token positions and key ends) is not supported: the linear "
                       "layers' recurrence runs along a row; use the level or depth-first tree layout")
    positions = segment_positions(offset, b, t)
    parent = ancestors[-1] if ancestors else self.initial_state(1)
    x, state, route, experts = self._layers(self._embed(tokens_bt), positions, list(ancestors), parent, valid_bt,
                                            self._attention(attention), per_layer_routes(self.config, routes),
                                            replay_routes)
    return SegmentOutput(HybridState(*state[:2], valid_bt, *state[2:]), self._final_norm(at_position(x, hidden_at)),
                         route, experts)

  def prompt_and_rows(self, prompt_bt, prompt_valid_bt, prompt_last, rows_bt, rows_offset, rows_valid_bt, *,
                      attention=None, routes=(None, None), replay_routes: bool = True):
    """`Llama.prompt_and_rows`'s values: the prompt's forward, then the rows on its state (two layer scans;
    the fused single scan is Llama's only); Qwen3.5-MoE's routing of each as Llama's."""
    kw = dict(attention=attention, replay_routes=replay_routes)
    prompt = self(prompt_bt, 0, valid_bt=prompt_valid_bt, routes=routes[0], hidden_at=prompt_last, **kw)
    rows = self(rows_bt, rows_offset, ancestors=[prompt.kv], valid_bt=rows_valid_bt, routes=routes[1], **kw)
    return prompt.hidden_btd[0, 0], rows.hidden_btd, (prompt.router, rows.router)

  def _layers(self, x, positions, ancestors, parent: HybridState, valid_bt, attention, routes=None,
              replay_routes: bool = True):
    """Scan over the repetitions of `ModelConfig.layer_pattern`: (x [B, T, d], (k, v [Lf, ...], conv, recurrent
    [Ll, ...]), and of Qwen3.5-MoE the `RouterStats` [B, E] summed over the layers and the experts [B, T, L, k];
    else None, None).
    routes: [L, B, T, k] recorded experts or None (`moe_mlp`)."""
    cfg = self.config
    unit = cfg.layer_pattern
    reps = cfg.num_layers // len(unit)
    nf, nl = unit.count(FULL), unit.count(LINEAR)
    inv_freq = rope_inv_freq(cfg, accum_dtype(self.dtype))
    (shared, full, linear), gathers = self.layers.stacked()
    gathering = any(g is not None for d in gathers for g in d.values())
    per_rep = lambda tree, n: jax.tree_util.tree_map(lambda a: a.reshape(reps, n, *a.shape[1:]), tree)
    xs = (per_rep(shared, len(unit)), per_rep(full, nf), per_rep(linear, nl),
          per_rep([(a.k.astype(self.dtype), a.v.astype(self.dtype)) for a in ancestors], nf),
          per_rep((parent.conv, parent.recurrent), nl), None if routes is None else per_rep(routes, len(unit)))
    dispatch = {g.axes for g in gathers[0].values() if g is not None and g.dispatch}   # expert parallelism
    anc_valid = [a.valid for a in ancestors]
    norm = lambda x, w: rms_norm(x, w, cfg.norm_eps, unit_offset=True)
    scale = 0.0 if self.lora is None else self.lora.scale   # LoRA (`models.lora`): the MLP's and full layers'

    def body(x, xs_r):
      shared_r, full_r, linear_r, anc_r, (conv_r, rec_r), routes_r = xs_r
      if gathering:   # FSDP: one repetition's weights all-gathered just before use (the layer axis is never split)
        gather = lambda d, g: {k: checkpoint_name(gathered(v, g[k]), "gathered_weights") for k, v in d.items()}
        shared_r, full_r, linear_r = (gather(d, g) for d, g in zip((shared_r, full_r, linear_r), gathers))
      x = checkpoint_name(x, "layer_input")
      ks, vs, convs, recs, router, experts = [], [], [], [], [], []
      i_full = i_lin = 0
      for i, kind in enumerate(unit):
        at = lambda tree, j: jax.tree_util.tree_map(lambda a: a[j], tree)
        h = norm(x, shared_r["attn_norm"][i])
        if kind == FULL:
          blocks = [KVBlock(k[i_full], v[i_full], m) for (k, v), m in zip(anc_r, anc_valid)]
          out, (k, v) = _full_layer(cfg, at(full_r, i_full), h, positions, inv_freq, blocks, valid_bt, attention,
                                    scale)
          ks.append(k), vs.append(v)
          i_full += 1
        else:
          out, (conv, rec) = _linear_layer(cfg, at(linear_r, i_lin), h, conv_r[i_lin], rec_r[i_lin], valid_bt,
                                           self.chunk)
          convs.append(conv), recs.append(rec)
          i_lin += 1
        x = x + out
        h = norm(x, shared_r["mlp_norm"][i])
        p = at(shared_r, i)
        if cfg.moe:   # Qwen3.5-MoE: the routed experts plus the gated shared expert
          p.update({EXPERT_AXES: axes for axes in dispatch})
          out, route, chosen = moe_mlp(cfg, p, h, valid_bt, None if routes_r is None else routes_r[i], replay_routes,
                                       scale)
          router.append(route), experts.append(chosen)
          act = jax.nn.silu(project(p, "ws_gate", "btd,df->btf", h, 0.0)) * project(p, "ws_up", "btd,df->btf", h, 0.0)
          gate = jax.nn.sigmoid(jnp.einsum("btd,d->bt", h, p["ws_scale"].astype(h.dtype)))[..., None]
          x = x + out + gate * project(p, "ws_down", "btf,fd->btd", act, 0.0)
        else:
          act = (jax.nn.silu(project(p, "w_gate", "btd,df->btf", h, scale))
                 * project(p, "w_up", "btd,df->btf", h, scale))
          x = x + project(p, "w_down", "btf,fd->btd", act, scale)
      return x, tuple(stack_layers(o) for o in (ks, vs, convs, recs, router, experts))

    x, ys = jax.lax.scan(rematerialized(body, self.remat, gathering), x, xs)
    b = x.shape[0]
    merge = lambda a, like: (a.reshape(-1, *a.shape[2:]) if a is not None else like)
    empty = self.initial_state(b)
    state = tuple(merge(a, e) for a, e in zip(ys[:4], (empty.k, empty.v, empty.conv, empty.recurrent)))
    route = None if ys[4] is None else summed_over_layers(jax.tree_util.tree_map(lambda a: merge(a, None), ys[4]))
    experts = None if ys[5] is None else jnp.moveaxis(merge(ys[5], None), 0, 2)   # [L, B, T, k] -> [B, T, L, k]
    return x, state, route, experts


# --- Hugging Face checkpoints (transformers' Qwen3_5ForCausalLM, model_type "qwen3_5_text") -----------------

HF_LAYER = "model.layers.{}."
HF_NORMS = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "mlp_norm"}
HF_SHARED = {**HF_NORMS, "mlp.gate_proj.weight": "w_gate", "mlp.up_proj.weight": "w_up",
             "mlp.down_proj.weight": "w_down"}
# Qwen3.5-MoE's MLP: the router and each expert's projections (`hf_loader.ROUTER_TENSOR`, `expert_tensor`, as
# Qwen3-MoE's) and the shared expert with its gate.
HF_SHARED_EXPERT = {"mlp.shared_expert.gate_proj.weight": "ws_gate", "mlp.shared_expert.up_proj.weight": "ws_up",
                    "mlp.shared_expert.down_proj.weight": "ws_down", "mlp.shared_expert_gate.weight": "ws_scale"}
HF_FULL = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
           "self_attn.q_norm.weight", "self_attn.k_norm.weight")
HF_LINEAR = ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight", "linear_attn.in_proj_b.weight",
             "linear_attn.in_proj_a.weight", "linear_attn.conv1d.weight", "linear_attn.dt_bias", "linear_attn.A_log",
             "linear_attn.norm.weight", "linear_attn.out_proj.weight")


def _expected(config: ModelConfig) -> dict[str, tuple]:
  """{HF tensor name: shape} of a qwen3_5_text (or qwen3_5_moe_text) checkpoint of `config`."""
  c, la = config, config.linear_attention
  out = {"model.embed_tokens.weight": (c.vocab_size, c.d_model), "model.norm.weight": (c.d_model,)}
  if not c.tie_embeddings:
    out["lm_head.weight"] = (c.vocab_size, c.d_model)
  vd = la.num_value_heads * la.value_head_dim
  for i, kind in enumerate(c.layer_types):
    pre = HF_LAYER.format(i)
    d, f = c.d_model, c.ffn_dim
    mlp = dict(zip(HF_SHARED, ((d,), (d,), (f, d), (f, d), (d, f))))
    if c.moe:   # the router, the experts and the shared expert with its gate in place of the dense MLP
      mlp = {n: s for n, s in mlp.items() if n in HF_NORMS}
      mlp.update(dict(zip(HF_SHARED_EXPERT, ((f, d), (f, d), (d, f), (1, d)))))
      mlp[ROUTER_TENSOR] = (c.num_experts, d)
      fe = c.expert_ffn_dim
      for e in range(c.num_experts):
        mlp.update({expert_tensor(e, "gate"): (fe, d), expert_tensor(e, "up"): (fe, d),
                    expert_tensor(e, "down"): (d, fe)})
    out.update({pre + n: s for n, s in mlp.items()})
    if kind == FULL:
      q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
      shapes = ((2 * q, c.d_model), (kv, c.d_model), (kv, c.d_model), (c.d_model, q), (c.head_dim,), (c.head_dim,))
      out.update({pre + n: s for n, s in zip(HF_FULL, shapes)})
    else:
      hv = la.num_value_heads
      shapes = ((la.conv_channels, c.d_model), (vd, c.d_model), (hv, c.d_model), (hv, c.d_model),
                (la.conv_channels, 1, la.conv_kernel), (hv,), (hv,), (la.value_head_dim,), (c.d_model, vd))
      out.update({pre + n: s for n, s in zip(HF_LINEAR, shapes)})
  return out


def params_from_hf(tensors: dict, config: ModelConfig, source: str) -> dict:
  """The pure dict of `Qwen35`'s parameters (float32) from a checkpoint's HF-named tensors.

  Raises:
    ValueError: naming `source`, every missing and unexpected tensor and every shape mismatch (the first 8).
  """
  check_tensors(tensors, _expected(config), config, source)
  c, la = config, config.linear_attention
  f32 = lambda x: np.ascontiguousarray(x, dtype=np.float32)
  heads = lambda w, h, d: w.T.reshape(c.d_model, h, d)                       # [h·d, d_model] -> [d_model, h, d]
  mlp = ({**HF_NORMS, **HF_SHARED_EXPERT} if c.moe else HF_SHARED)
  shared = {ours: [] for ours in mlp.values()}
  experts = {n: [] for n in ("w_router", "w_gate", "w_up", "w_down")} if c.moe else {}
  full = {n: [] for n in ("wq", "wq_gate", "wk", "wv", "wo", "q_norm", "k_norm")}
  linear = {n: [] for n in ("wq", "wk", "wv", "wz", "wb", "wa", "conv_q", "conv_k", "conv_v", "dt_bias", "a_log",
                            "norm", "wo")}
  kd, hk, hv, dk, dv = la.num_key_heads * la.key_head_dim, la.num_key_heads, la.num_value_heads, la.key_head_dim, \
      la.value_head_dim
  for i, kind in enumerate(c.layer_types):
    t = lambda name: tensors[HF_LAYER.format(i) + name]
    for hf, ours in mlp.items():
      shared[ours].append(t(hf) if ours.endswith("norm") else t(hf).T[:, 0] if ours == "ws_scale" else t(hf).T)
    if c.moe:   # [E, d] -> [d, E]; each expert's [F_e, d] (down: [d, F_e]) transposed and stacked over E
      experts["w_router"].append(t(ROUTER_TENSOR).T)
      for proj in ("gate", "up", "down"):
        experts["w_" + proj].append(np.stack([t(expert_tensor(e, proj)).T for e in range(c.num_experts)]))
    if kind == FULL:
      q = t("self_attn.q_proj.weight").reshape(c.num_heads, 2, c.head_dim, c.d_model)   # per head: query, gate
      full["wq"].append(q[:, 0].transpose(2, 0, 1))
      full["wq_gate"].append(q[:, 1].transpose(2, 0, 1))
      full["wk"].append(heads(t("self_attn.k_proj.weight"), c.num_kv_heads, c.head_dim))
      full["wv"].append(heads(t("self_attn.v_proj.weight"), c.num_kv_heads, c.head_dim))
      full["wo"].append(t("self_attn.o_proj.weight").T.reshape(c.num_heads, c.head_dim, c.d_model))
      full["q_norm"].append(t("self_attn.q_norm.weight"))
      full["k_norm"].append(t("self_attn.k_norm.weight"))
    else:
      qkv = t("linear_attn.in_proj_qkv.weight")
      conv = t("linear_attn.conv1d.weight")[:, 0].T                              # [K, C]
      linear["wq"].append(heads(qkv[:kd], hk, dk))
      linear["wk"].append(heads(qkv[kd:2 * kd], hk, dk))
      linear["wv"].append(heads(qkv[2 * kd:], hv, dv))
      linear["conv_q"].append(conv[:, :kd].reshape(-1, hk, dk))
      linear["conv_k"].append(conv[:, kd:2 * kd].reshape(-1, hk, dk))
      linear["conv_v"].append(conv[:, 2 * kd:].reshape(-1, hv, dv))
      linear["wz"].append(heads(t("linear_attn.in_proj_z.weight"), hv, dv))
      linear["wb"].append(t("linear_attn.in_proj_b.weight").T)
      linear["wa"].append(t("linear_attn.in_proj_a.weight").T)
      linear["dt_bias"].append(t("linear_attn.dt_bias"))
      linear["a_log"].append(t("linear_attn.A_log"))
      linear["norm"].append(t("linear_attn.norm.weight"))
      linear["wo"].append(t("linear_attn.out_proj.weight").T.reshape(hv, dv, c.d_model))
  stack = lambda d: {k: f32(np.stack(v)) for k, v in d.items() if v}
  params = {"embed": f32(tensors["model.embed_tokens.weight"]), "final_norm": f32(tensors["model.norm.weight"]),
            "layers": {**stack(shared), **stack(experts), "full": stack(full), "linear": stack(linear)}}
  if not c.tie_embeddings:
    params["lm_head"] = f32(tensors["lm_head.weight"].T)
  return params


def hf_tensors(config: ModelConfig, params: dict) -> dict[str, np.ndarray]:
  """HF-named float32 tensors of `Qwen35` parameters (a pure dict): `params_from_hf` inverted."""
  c, la = config, config.linear_attention
  f32 = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))
  flat = lambda w: np.asarray(w).reshape(c.d_model, -1).T                       # [d_model, h, d] -> [h·d, d_model]
  out = {"model.embed_tokens.weight": f32(params["embed"]), "model.norm.weight": f32(params["final_norm"])}
  if not c.tie_embeddings:
    out["lm_head.weight"] = f32(np.asarray(params["lm_head"]).T)
  lay = params["layers"]
  i_full = i_lin = 0
  mlp = ({**HF_NORMS, **HF_SHARED_EXPERT} if c.moe else HF_SHARED)
  for i, kind in enumerate(c.layer_types):
    pre = HF_LAYER.format(i)
    for hf, ours in mlp.items():
      w = np.asarray(lay[ours][i])
      out[pre + hf] = f32(w if ours.endswith("norm") else w[None] if ours == "ws_scale" else w.T)
    if c.moe:
      out[pre + ROUTER_TENSOR] = f32(np.asarray(lay["w_router"][i]).T)
      for proj in ("gate", "up", "down"):
        for e in range(c.num_experts):
          out[pre + expert_tensor(e, proj)] = f32(np.asarray(lay["w_" + proj][i][e]).T)
    if kind == FULL:
      p = {k: np.asarray(v[i_full]) for k, v in lay["full"].items()}
      q = np.stack([p["wq"].transpose(1, 2, 0), p["wq_gate"].transpose(1, 2, 0)], axis=1)   # [Hq, 2, D, d]
      out.update({pre + "self_attn.q_proj.weight": f32(q.reshape(-1, c.d_model)),
                  pre + "self_attn.k_proj.weight": f32(flat(p["wk"])),
                  pre + "self_attn.v_proj.weight": f32(flat(p["wv"])),
                  pre + "self_attn.o_proj.weight": f32(p["wo"].reshape(-1, c.d_model).T),
                  pre + "self_attn.q_norm.weight": f32(p["q_norm"]), pre + "self_attn.k_norm.weight": f32(p["k_norm"])})
      i_full += 1
    else:
      p = {k: np.asarray(v[i_lin]) for k, v in lay["linear"].items()}
      k = la.conv_kernel
      conv = np.concatenate([p[n].reshape(k, -1) for n in ("conv_q", "conv_k", "conv_v")], axis=1)   # [K, C]
      out.update({pre + "linear_attn.in_proj_qkv.weight": f32(np.concatenate([flat(p[n]) for n in ("wq", "wk", "wv")])),
                  pre + "linear_attn.in_proj_z.weight": f32(flat(p["wz"])),
                  pre + "linear_attn.in_proj_b.weight": f32(p["wb"].T),
                  pre + "linear_attn.in_proj_a.weight": f32(p["wa"].T),
                  pre + "linear_attn.conv1d.weight": f32(conv.T[:, None, :]),
                  pre + "linear_attn.dt_bias": f32(p["dt_bias"]), pre + "linear_attn.A_log": f32(p["a_log"]),
                  pre + "linear_attn.norm.weight": f32(p["norm"]),
                  pre + "linear_attn.out_proj.weight": f32(p["wo"].reshape(-1, c.d_model).T)})
      i_lin += 1
  return out


def hf_config_fields(config: ModelConfig) -> dict:
  """The qwen3_5_text (and qwen3_5_moe_text) fields of config.json (`config_fields` inverted), beside
  `export.hf_config`'s common ones."""
  la = config.linear_attention
  return dict(layer_types=list(config.layer_types), linear_num_key_heads=la.num_key_heads,
              linear_num_value_heads=la.num_value_heads, linear_key_head_dim=la.key_head_dim,
              linear_value_head_dim=la.value_head_dim, linear_conv_kernel_dim=la.conv_kernel,
              rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta,
                               "partial_rotary_factor": config.rotary_dim / config.head_dim})
