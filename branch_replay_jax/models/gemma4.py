"""Gemma 4's text decoder in Flax NNX (transformers' `modeling_gemma4`, `Gemma4TextModel`): sliding-window
layers beside global layers of ANOTHER SHAPE, running one segment of a rollout tree.

What Gemma 4 changes from Gemma 3 (`llama.py` with `ModelConfig.gemma`), each checked against transformers
by tests/fixtures/gemma4_tiny (tools/make_gemma4_reference.py):
- the global layers have their own head width (global_head_dim, 512 against 256 in the released models)
  and fewer K/V heads (global_kv_heads), and with attention_k_eq_v their values come from the key
  projection (no v_proj); so the layers cannot share one stacked parameter set or one K/V array;
- values pass an RMSNorm without a scale (v_norm), queries and keys one with a scale, and the attention
  logits take no 1/sqrt(D) factor (transformers' `scaling = 1.0`);
- RMSNorms scale by w (not Gemma 3's 1 + w);
- the global layers' RoPE is "proportional": of a head's D/2 rotate-half frequency pairs the first
  global_rope_fraction · D/2 turn at base^(-2i/D), the rest not at all (zero frequency);
- every layer's output, residual included, is multiplied by a fixed per-layer scalar (`layer_scalar`, a
  buffer transformers does not train; `ModelConfig.layer_scalars`);
- the output logits are soft-capped, c · tanh(logits / c) (`ModelConfig.final_logit_softcap`; `llama.soft_cap`,
  applied by `Llama.logits` and `llama.token_logprobs`).
- with enable_moe_block (26B-A4B; `ModelConfig.moe`), each layer runs its dense MLP and, beside it, a mixture of
  GeGLU experts (transformers' `Gemma4TextDecoderLayer`): the router reads the residual stream (RMS-normalised
  without a weight, times router_scale · d^-1/2), the experts read it through their own norm (experts_norm), the
  top-k weights renormalised then multiplied by expert_scale (per_expert_scale), and the MLP's output is
  mlp_out_norm(dense) + experts_out_norm(experts) before post_mlp_norm (`llama.moe_mlp` with Gemma 4's router;
  routing replay, the load-balancing loss and expert parallelism as for Qwen3-MoE, docs/design.md).
- the small models (E2B, E4B; tests/fixtures/gemma4_e2b_tiny): per-layer embeddings, an input of width Dp to each
  layer made from the token and its embedding (`Gemma4._per_layer_inputs`), added after the MLP through a gate
  (transformers' `per_layer_input_gate`); and the last kv_shared_layers layers computing queries only, each
  attending to the K/V of the last earlier layer of its kind, their MLP 2F wide with double_wide_mlp. Those layers
  are a second parameter group (`layers.reuse`) and a second layer scan; a segment's K/V holds only the computing
  layers' (`ModelConfig.kv_layer_types`), so trimming, caches and trees carry it unchanged (docs/design.md,
  "Gemma 4's small models").

A segment's K/V is a `Gemma4KV`: the sliding layers' and the global layers' side by side. Replay hands its
descendants only what a window still reaches (`Gemma4.branch_kv`, `trim`): a `window_kv.WindowedPrompt` of the
global layers' whole K/V (`full`) and the sliding layers' last W - 1 real keys (`tail`, from `start`). A
descendant's sliding layer sees the tail behind a head block of `start` zero keys that only count positions (no
window reaches them: their probabilities are exactly 0), so its positions are unchanged (docs/design.md,
"Gemma 4: sliding and global layers of different shapes"). Layers repeat a pattern (`layer_types`, five
sliding then one global): the forward scans over its repetitions, as `qwen3_5` does.

Parameter layout (L layers, Ls sliding and Lg global; Hq query heads; sliding layers Hkv heads of width D,
global Hg heads of width Dg; F MLP width), logical axis names as in `llama.py`:

    embed [V, d], final_norm [d]   (the output projection is the tied embedding)
    layers.attn_norm, post_attn_norm, mlp_norm, post_mlp_norm [L, d]; layers.w_gate, w_up [L, d, F];
      layers.w_down [L, F, d]
    layers.sliding.wq [Ls, d, Hq, D]; wk, wv [Ls, d, Hkv, D]; wo [Ls, Hq, D, d]; q_norm, k_norm [Ls, D]
    layers.full.wq [Lg, d, Hq, Dg]; wk (and wv without k_eq_v) [Lg, d, Hg, Dg]; wo [Lg, Hq, Dg, d];
      q_norm, k_norm [Lg, Dg]
    with experts (E of width F_e): layers.w_router [L, d, E], router_scale [L, d], expert_scale [L, E];
      layers.e_gate, e_up [L, E, d, F_e], e_down [L, E, F_e, d]; experts_norm, mlp_out_norm, experts_out_norm [L, d]
    with per-layer embeddings (Dp wide): per_layer_projection [d, L, Dp], per_layer_projection_norm [Dp];
      layers.ple_table [L, V, Dp] (stacked by layer like the weights, so FSDP gathers one layer's table at a time),
      ple_gate [L, d, Dp], ple_proj [L, Dp, d], ple_norm [L, d]
    with K/V-sharing layers (the last Lr): the layers.* above are the first L - Lr layers'; layers.reuse holds the
      last Lr layers' in the same names, its sliding and full bags with wq, wo, q_norm only, its MLP 2F wide with
      double_wide_mlp
    with LoRA adapters (`models.lora`): each target's W_lora_a, W_lora_b beside its weight (an attention target's in
      `sliding` and in `full`, and in `reuse`'s)
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from branch_replay_jax.kernels import GLOBAL_WINDOW, KVBlock
from branch_replay_jax.kernels.reference import PositionedKV, accum_dtype, windowed_suffix_attention
from branch_replay_jax.models.config import FULL, SLIDING, ModelConfig
from branch_replay_jax.models.hf_loader import check_tensors
from branch_replay_jax.models.llama import (EXPERT_AXES, Llama, SegmentOutput, annotated, apply_rope, at_position,
                                            gathered,
                                            moe_mlp, param_value, per_layer_routes, project, rematerialized,
                                            rms_norm, rope_inv_freq, segment_positions, summed_over_layers)
from branch_replay_jax.models.qwen3_5 import ParamBag, stack_layers, stacked_kinds
from branch_replay_jax.models.window_kv import RingCache, WindowedPrompt, last_keys


# The mixture-of-experts block's norms (transformers' pre_feedforward_layernorm_2 of the experts' input,
# post_feedforward_layernorm_1 of the dense MLP's output, post_feedforward_layernorm_2 of the experts' output).
MOE_NORMS = ("experts_norm", "mlp_out_norm", "experts_out_norm")
# The experts' parameters as `llama.moe_mlp` names them: {ours: moe_mlp's}.
MOE_PARAMS = {"w_router": "w_router", "router_scale": "router_scale", "expert_scale": "expert_scale",
              "e_gate": "w_gate", "e_up": "w_up", "e_down": "w_down"}


class Gemma4KV(NamedTuple):
  """A segment's K/V for its descendants (a `KVBlock` with the global layers' beside it).

  k, v: [Ls, B, T, Hkv, D] the sliding layers' keys/values; valid: [B, T] bool.
  gk, gv: [Lg, B, T, Hg, Dg] the global layers' keys/values.
  """

  k: jax.Array
  v: jax.Array
  valid: jax.Array
  gk: jax.Array
  gv: jax.Array


def trim(kv: Gemma4KV, window: int) -> Gemma4KV | WindowedPrompt:
  """A segment's K/V (valid keys a prefix of its T slots) as replay hands it on (module docstring): a
  `WindowedPrompt` (full: the global layers' [Lg, B, T, ...]; tail: the sliding layers' [Ls, B, W - 1, ...] from
  start) where T > W - 1, else kv itself."""
  if kv.k.shape[2] <= window - 1:
    return kv
  return WindowedPrompt(KVBlock(kv.gk, kv.gv, kv.valid), *last_keys(KVBlock(kv.k, kv.v, kv.valid), window))


class RingSlots(NamedTuple):
  """A `RingCache`'s sliding layers' mask and positions, each [B, W - 1] (`_ancestor`)."""

  valid: jax.Array
  positions: jax.Array


def _ancestor(a: Gemma4KV | WindowedPrompt | RingCache, dtype) -> tuple:
  """((sliding k, v [Ls, ...]), sliding valid masks, (global k, v [Lg, ...]), global valid) of an ancestor; a
  trimmed one's sliding masks are its head block's ([B, T - (W - 1)] True before start) and its tail's; a ring
  cache's a `RingSlots`."""
  cast = lambda x: x.astype(dtype)
  if isinstance(a, RingCache):   # the sampler's decode cache: the sliding layers' ring with its positions
    return ((cast(a.ring.k), cast(a.ring.v)), RingSlots(a.ring.valid, a.positions), (cast(a.full.k), cast(a.full.v)),
            a.full.valid)
  if isinstance(a, WindowedPrompt):
    head = a.full.valid.shape[-1] - a.tail.valid.shape[-1]
    before = jnp.arange(head)[None] < a.start[:, None]
    return (cast(a.tail.k), cast(a.tail.v)), (before, a.tail.valid), (cast(a.full.k), cast(a.full.v)), a.full.valid
  return (cast(a.k), cast(a.v)), (a.valid,), (cast(a.gk), cast(a.gv)), a.valid


def _sliding_blocks(k, v, masks) -> list[KVBlock]:
  """One sliding layer's blocks of an ancestor: its K/V k, v [B or 1, S, Hkv, D] with their mask, behind a head
  block of zero keys where the ancestor is trimmed (masks = (head, tail)); a ring cache's with its keys'
  positions (masks a `RingSlots`)."""
  if isinstance(masks, RingSlots):
    return [PositionedKV(k, v, *masks)]
  if len(masks) == 1:
    return [KVBlock(k, v, masks[0])]
  zeros = jnp.broadcast_to(jnp.zeros((), k.dtype), (masks[0].shape[0], masks[0].shape[1], *k.shape[2:]))
  return [KVBlock(zeros, zeros, masks[0]), KVBlock(k, v, masks[1])]


def global_inv_freq(config: ModelConfig, dtype=jnp.float32) -> jax.Array:
  """[Dg/2] the global layers' proportional RoPE (transformers' `_compute_proportional_rope_parameters`):
  base^(-2i/Dg) for the first int(global_rope_fraction · Dg / 2) pairs, 0 (no rotation) for the rest, divided
  by a linear scaling factor where configured."""
  d = config.global_head_dim
  turned = int(config.global_rope_fraction * d // 2)
  inv = 1.0 / (config.rope_theta ** (jnp.arange(0, 2 * turned, 2, dtype=dtype) / d))
  inv = jnp.concatenate([inv, jnp.zeros((d // 2 - turned,), dtype)])
  return inv if config.rope_scaling is None else inv / config.rope_scaling.factor


class Gemma4Layers(nnx.Module):
  """Parameters of the layers that compute K/V (module docstring): norms and MLP [L0, ...], `sliding` [Ls, ...],
  `full` [Lg, ...]; with kv_shared_layers, `reuse`: the K/V-sharing layers' own (a `Gemma4Layers` built with
  reuse=True: their attention has no K/V projections, their MLP is 2 · F wide with double_wide_mlp)."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, reuse: bool = False):
    c = config
    types = c.layer_types[len(c.kv_layer_types):] if reuse else c.kv_layer_types
    L, d, hq, f = len(types), c.d_model, c.num_heads, c.ffn_dim * (2 if reuse and c.double_wide_mlp else 1)
    lg = types.count(FULL)
    init = nnx.initializers.normal(0.02)
    normal = lambda *ns: annotated(init(rngs.params(), tuple(s for _, s in ns)), [n for n, _ in ns])
    ones = lambda *ns: annotated(jnp.ones(tuple(s for _, s in ns), jnp.float32), [n for n, _ in ns])
    for name in ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm"):
      setattr(self, name, ones(("layers", L), ("embed", d)))
    self.w_gate = normal(("layers", L), ("embed", d), ("mlp", f))
    self.w_up = normal(("layers", L), ("embed", d), ("mlp", f))
    self.w_down = normal(("layers", L), ("mlp", f), ("embed", d))
    if c.per_layer_input_dim:   # E2B/E4B: the per-layer embedding's table, gate, projection and norm
      dp = c.per_layer_input_dim
      self.ple_table = normal(("layers", L), ("vocab", c.vocab_size), ("ple", dp))
      self.ple_gate = normal(("layers", L), ("embed", d), ("ple", dp))
      self.ple_proj = normal(("layers", L), ("ple", dp), ("embed", d))
      self.ple_norm = ones(("layers", L), ("embed", d))
    if c.moe:   # 26B-A4B: the router, E GeGLU experts of width F_e and their three norms (module docstring)
      e, fe = c.num_experts, c.expert_ffn_dim
      self.w_router = normal(("layers", L), ("embed", d), ("experts", e))
      self.router_scale = ones(("layers", L), ("embed", d))
      self.expert_scale = ones(("layers", L), ("experts", e))
      self.e_gate = normal(("layers", L), ("experts", e), ("embed", d), ("mlp", fe))
      self.e_up = normal(("layers", L), ("experts", e), ("embed", d), ("mlp", fe))
      self.e_down = normal(("layers", L), ("experts", e), ("mlp", fe), ("embed", d))
      for name in MOE_NORMS:
        setattr(self, name, ones(("layers", L), ("embed", d)))

    def attention(n, kv_heads, width, values: bool):
      own_kv = {} if reuse else dict(
          wk=normal(("layers", n), ("embed", d), ("kv_heads", kv_heads), ("head_dim", width)),
          k_norm=ones(("layers", n), ("head_dim", width)),
          **({"wv": normal(("layers", n), ("embed", d), ("kv_heads", kv_heads), ("head_dim", width))}
             if values else {}))
      return ParamBag(wq=normal(("layers", n), ("embed", d), ("heads", hq), ("head_dim", width)),
                     wo=normal(("layers", n), ("heads", hq), ("head_dim", width), ("embed", d)),
                     q_norm=ones(("layers", n), ("head_dim", width)), **own_kv)
    self.sliding = attention(L - lg, c.num_kv_heads, c.head_dim, True)
    self.full = attention(lg, c.global_kv_heads, c.global_head_dim, not c.k_eq_v)
    if c.kv_shared_layers and not reuse:
      self.reuse = Gemma4Layers(c, rngs=rngs, reuse=True)

  def stacked(self) -> tuple[tuple[dict, dict, dict], tuple[dict, dict, dict]]:
    """(values, gathers): ({shared name: [L, ...]}, {sliding name: [Ls, ...]}, {full name: [Lg, ...]}) and the
    same dicts of each parameter's `Gather` or None (FSDP, as `DecoderLayers.stacked`); `reuse`'s not included."""
    return stacked_kinds(self, self.sliding, self.full)


def _attention(config: ModelConfig, p: dict, h_btd, positions_bt, inv_freq, ancestors: Sequence[KVBlock], valid_bt,
               window, lora_scale: float = 0.0, donor=None):
  """One layer's attention (transformers' `Gemma4TextAttention`): (output [B, T, d], (k, v)). Values are the
  key projection where p has no wv (attention_k_eq_v). A K/V-sharing layer (p without wk) attends to donor =
  (k, v) [B, T, H, D], the segment's keys and values of the last earlier layer of its kind, and `ancestors` are
  that layer's. wq, wk, wv, wo with their LoRA adapters where p holds them (`models.lora`, scaled by lora_scale)."""
  eps = config.norm_eps
  q = rms_norm(project(p, "wq", "btd,dhk->bthk", h_btd, lora_scale), p["q_norm"], eps)
  q = apply_rope(q, positions_bt, inv_freq)
  if "wk" in p:
    k_raw = project(p, "wk", "btd,dhk->bthk", h_btd, lora_scale)
    v_raw = project(p, "wv", "btd,dhk->bthk", h_btd, lora_scale) if "wv" in p else k_raw
    k = rms_norm(k_raw, p["k_norm"], eps)
    v = rms_norm(v_raw, jnp.ones((), accum_dtype(v_raw.dtype)), eps)   # v_norm: no scale
    k = checkpoint_name(apply_rope(k, positions_bt, inv_freq), "k")
    v = checkpoint_name(v, "v")
  else:
    k, v = donor
  attn, _ = windowed_suffix_attention(q, ancestors, KVBlock(k, v, valid_bt), window=window,
                                      query_positions=positions_bt, scale=1.0)
  return project(p, "wo", "bthk,hkd->btd", attn, lora_scale), (k, v)


class Gemma4(Llama):
  """Gemma 4's text decoder (the module docstring); a `Llama` past the layers (embedding times sqrt(d), final
  norm, tied unembedding, `logits` soft-capped at its `logit_softcap`).

  Args:
    config: a `ModelConfig` with arch 'gemma4_text'.
    dtype, remat: as `Llama` ("offload_kv" too; Llama refuses another policy).
    attention_impl: "xla" or "auto" (the jnp windowed attention; ValueError otherwise, as Gemma 3).
  """

  layers_class = Gemma4Layers

  def __init__(self, config: ModelConfig, *, dtype=jnp.float32, remat: str = "none", attention_impl: str = "xla",
               rngs: nnx.Rngs | None = None):
    if not config.gemma4:
      raise ValueError(f"Gemma4: config.arch={config.arch!r}; expected 'gemma4_text'")
    if not config.tie_embeddings:
      raise ValueError("Gemma4: tie_embeddings=False; Gemma 4's output projection is its embedding")
    rngs = rngs if rngs is not None else nnx.Rngs(0)
    super().__init__(config, dtype=dtype, remat=remat, attention_impl=attention_impl, rngs=rngs)
    dp = config.per_layer_input_dim
    if dp:   # E2B/E4B's per-layer embeddings: the projection of the embedding (the tables are the layers')
      c, init = config, nnx.initializers.normal(0.02)
      self.per_layer_projection = annotated(init(rngs.params(), (c.d_model, c.num_layers, dp)),
                                            ("embed", "layers", "ple"))
      self.per_layer_projection_norm = annotated(jnp.ones((dp,), jnp.float32), ("ple",))

  @property
  def logit_softcap(self) -> float | None:
    """final_logit_softcap: the cap `Llama.logits` and `token_logprobs` apply (`llama.soft_cap`)."""
    return self.config.final_logit_softcap

  def initial_state(self, batch: int, length: int = 0) -> Gemma4KV:
    """An empty state of `length` slots: K/V zeros in the compute dtype, valid all False."""
    c = self.config
    types = c.kv_layer_types   # (K/V-sharing layers keep none)
    z = lambda n, h, d: jnp.zeros((n, batch, length, h, d), self.dtype)
    ks, gs = z(types.count(SLIDING), c.num_kv_heads, c.head_dim), z(types.count(FULL), c.global_kv_heads,
                                                                      c.global_head_dim)
    return Gemma4KV(ks, ks, jnp.zeros((batch, length), bool), gs, gs)

  def __call__(self, tokens_bt: jax.Array, offset, *, ancestors: Sequence[Gemma4KV] = (),
               valid_bt: jax.Array | None = None, attention=None, routes=None,
               replay_routes: bool = True, hidden_at=None) -> SegmentOutput:
    """Forward of one segment on its ancestors' K/V (`Llama.__call__`'s contract).

    Args:
      tokens_bt: [B, T] int token ids.
      offset: int or [B] int: the absolute position of the first token.
      ancestors: the ancestors' `Gemma4KV`s, oldest first (batch B or 1), each layer attending to its own kind's;
        any may be trimmed (`trim`, a `WindowedPrompt`).
      valid_bt: [B, T] bool, False on padding; default all True.
      attention: must be None (the windowed attention is the layers' own).
      routes, replay_routes: with experts (26B-A4B) only, the sampler's recorded experts [B, T, L, k] int32
        (`Llama.__call__`, `llama.moe_mlp`).
      hidden_at: None, or [] int: the one position whose final hidden state is read (a prompt's last real token:
        `Llama.prompt_forward`, the sampler's prefills). With K/V-sharing layers (E2B/E4B) those run on that
        position alone: they make no K/V, so their other positions feed nothing but final hidden states no one
        reads (transformers' generate skips them alike, `_maybe_slice_kv_shared_inputs`). hidden_btd is then
        [B, 1, d].

    Returns:
      SegmentOutput(kv: this segment's `Gemma4KV` [.., B, T, ..], hidden_btd [B, T, d] (hidden_at: [B, 1, d]);
      with experts: router, its `llama.RouterStats` [B, E] summed over the layers, experts [B, T, L, k] int32).

    Raises:
      ValueError: an attention override, routes to a model without experts, or int32 key ends in valid_bt (a
        packed tree: the window takes no key ends; use the level or depth-first tree layout).
    """
    b, t = tokens_bt.shape
    if valid_bt is None:
      valid_bt = jnp.ones((b, t), dtype=bool)
    if valid_bt.dtype != jnp.bool_ or jnp.ndim(offset) == 2:
      raise ValueError("Gemma4: a packed tree (per-token positions and key ends) is not supported: the sliding "
                       "window takes no key ends; use the level or depth-first tree layout")
    if routes is not None and not self.config.moe:
      raise ValueError("Gemma4: routes= is a mixture of experts' (routing replay); this Gemma 4 has no experts "
                       "(num_experts=None)")
    self._attention(attention)   # refuses an override
    positions = segment_positions(offset, b, t)
    x = self._embed(tokens_bt)
    x, (k, v, gk, gv), route, experts = self._layers(x, positions, list(ancestors), valid_bt,
                                                     per_layer_routes(self.config, routes), replay_routes,
                                                     (tokens_bt, self._per_layer_inputs(x)), hidden_at)
    if not self.config.kv_shared_layers:   # (else `_layers` took the position)
      x = at_position(x, hidden_at)
    return SegmentOutput(Gemma4KV(k, v, valid_bt, gk, gv), self._final_norm(x), route, experts)

  def prompt_and_rows(self, prompt_bt, prompt_valid_bt, prompt_last, rows_bt, rows_offset, rows_valid_bt, *,
                      attention=None, routes=(None, None), replay_routes: bool = True):
    """`Llama.prompt_and_rows`'s values: the prompt's forward, then the rows on its K/V (two layer scans)."""
    kw = dict(attention=attention, replay_routes=replay_routes)
    prompt = self(prompt_bt, 0, valid_bt=prompt_valid_bt, routes=routes[0], hidden_at=prompt_last, **kw)
    rows = self(rows_bt, rows_offset, ancestors=[prompt.kv], valid_bt=rows_valid_bt, routes=routes[1], **kw)
    return prompt.hidden_btd[0, 0], rows.hidden_btd, (prompt.router, rows.router)

  def branch_kv(self, kv: Gemma4KV) -> Gemma4KV | WindowedPrompt:
    """A segment's K/V as replay hands it to its descendants: trimmed to what a window reaches (`trim`)."""
    return trim(kv, self.config.sliding_window)

  def _per_layer_inputs(self, x_btd):
    """[L, B, T, Dp] the context half of each layer's per-layer input (E2B/E4B; transformers'
    `project_per_layer_inputs`): norm(x P · d^-1/2) of the embedded segment x (times sqrt(d) already); None without
    per-layer embeddings. The token half, table_l[token] · sqrt(Dp), is looked up in the layer scan (`_scan`),
    where FSDP gathers one layer's table [V, Dp] at a time."""
    c = self.config
    if not c.per_layer_input_dim:
      return None
    dt = self.dtype
    proj = jnp.einsum("btd,dlp->btlp", x_btd, param_value(self.per_layer_projection).astype(dt))
    proj = rms_norm(proj * jnp.asarray(c.d_model ** -0.5, dt), param_value(self.per_layer_projection_norm),
                    c.norm_eps)
    return jnp.moveaxis(proj, 2, 0)

  def _layers(self, x, positions, ancestors: list, valid_bt, routes=None, replay_routes: bool = True, ple=None,
              hidden_at=None):
    """The layers that compute K/V, then the K/V-sharing ones (`_scan` each): (x [B, T, d], (k, v [Ls, ...], gk,
    gv [Lg, ...]) of the former, and with experts the `RouterStats` [B, E] summed over the layers and the experts
    [B, T, L, k]; else None, None). routes: [L, B, T, k] recorded experts or None (`moe_mlp`); ple: (tokens [B, T],
    the per-layer inputs' context half [L, B, T, Dp] or None); hidden_at: `__call__`'s (the K/V-sharing layers on
    that position alone: x [B, 1, d] returned)."""
    cfg = self.config
    n = len(cfg.kv_layer_types)
    scalars = np.ones(cfg.num_layers) if cfg.layer_scalars is None else np.asarray(cfg.layer_scalars)
    parts = [_ancestor(a, self.dtype) for a in ancestors]
    head = lambda a: None if a is None else a[:n]
    tokens, ple = ple
    x, kv, route, experts = self._scan(self.layers, x, positions, parts, valid_bt, head(routes), replay_routes,
                                       None if ple is None else (tokens, ple[:n]), scalars[:n])
    if not cfg.kv_shared_layers:
      return x, kv, route, experts
    # each K/V-sharing layer reads the last computing layer of its kind: its K/V here and its ancestors'
    last = lambda p: ((p[0][0][-1:], p[0][1][-1:]), p[1], (p[2][0][-1:], p[2][1][-1:]), p[3])
    parts, donor, own_valid = [last(p) for p in parts], tuple(a[-1] for a in kv), None
    ple = None if ple is None else ple[n:]
    if hidden_at is not None:   # one query: the segment's donor K/V up to it as one more ancestor block, no own keys
      t = x.shape[1]
      upto = valid_bt & (jnp.arange(t) <= hidden_at)[None]
      parts.append(((donor[0][None], donor[1][None]), (upto,), (donor[2][None], donor[3][None]), upto))
      x, positions, valid_bt, tokens = (at_position(a, hidden_at) for a in (x, positions, valid_bt, tokens))
      ple = None if ple is None else at_position(ple, hidden_at, axis=2)
      donor = tuple(jnp.zeros_like(at_position(a, hidden_at)) for a in donor)
      own_valid = jnp.zeros_like(valid_bt)
    x = self._scan(self.layers.reuse, x, positions, parts, valid_bt, None, replay_routes,
                   None if ple is None else (tokens, ple), scalars[n:], donor=donor, own_valid=own_valid)[0]
    return x, kv, route, experts

  def _scan(self, group: Gemma4Layers, x, positions, parts: list, valid_bt, routes, replay_routes: bool, ple,
            scalars, donor=None, own_valid=None):
    """Scan over the repetitions of `ModelConfig.layer_pattern` of one group of layers (`Gemma4Layers`): (x, (k, v [Ls,
    ...], gk, gv [Lg, ...]), route stats, experts) as `_layers`. parts: the ancestors' `_ancestor`s. donor: for the
    K/V-sharing group, the segment's (k, v, gk, gv) [B, T, H, D] of the last computing layer of each kind (the parts
    are then theirs, [1, ...] too); this group then returns no K/V (None); own_valid: the donor K/V's valid mask where
    it is not valid_bt (`_layers`' hidden_at). ple: (tokens [B, T], the group's context halves [Lgroup, B, T, Dp]) or
    None."""
    cfg = self.config
    unit = cfg.layer_pattern
    reps = len(scalars) // len(unit)
    ns, nf = unit.count(SLIDING), unit.count(FULL)
    acc = accum_dtype(self.dtype)
    local_freq, glob_freq = rope_inv_freq(cfg, acc, local=True), global_inv_freq(cfg, acc)
    (shared, sliding, full), gathers = group.stacked()
    gathering = any(g is not None for d in gathers for g in d.values())
    per_rep = lambda tree, n: jax.tree_util.tree_map(lambda a: a.reshape(reps, n, *a.shape[1:]), tree)
    # each layer its own ancestors' K/V (scanned over); the K/V-sharing group's are the donor layers' (closed over)
    anc = None if donor is not None else (per_rep([p[0] for p in parts], ns), per_rep([p[2] for p in parts], nf))
    xs = (per_rep(shared, len(unit)), per_rep(sliding, ns), per_rep(full, nf), anc,
          jnp.asarray(np.reshape(scalars, (reps, len(unit))), self.dtype),
          None if routes is None else per_rep(routes, len(unit)), None if ple is None else per_rep(ple[1], len(unit)))
    dispatch = {g.axes for g in gathers[0].values() if g is not None and g.dispatch}   # expert parallelism
    sliding_masks, global_valid = [p[1] for p in parts], [p[3] for p in parts]
    keys_valid = valid_bt if own_valid is None else own_valid   # the segment's own keys' mask
    norm = lambda x, w: rms_norm(x, w, cfg.norm_eps)
    scale = 0.0 if self.lora is None else self.lora.scale   # LoRA (`models.lora`): both attention kinds and the MLP

    def body(x, xs_r):
      shared_r, sliding_r, full_r, anc_r, scalar_r, routes_r, ple_r = xs_r
      anc_s, anc_f = anc_r if donor is None else ([p[0] for p in parts], [p[2] for p in parts])
      x = checkpoint_name(x, "layer_input")
      out_s, out_f, router, experts = [], [], [], []

      def at(tree, j, g):   # layer j of a repetition's stacked weights; FSDP: all-gathered here, one layer at a time
        return {k: checkpoint_name(gathered(v[j], g[k], sliced=1), "gathered_weights") if gathering else v[j]
                for k, v in tree.items()}
      counts = {SLIDING: 0, FULL: 0}
      for i, kind in enumerate(unit):
        j = counts[kind]
        counts[kind] += 1
        a = j if donor is None else 0   # the ancestors' layer this one attends to
        p = at(shared_r, i, gathers[0])
        h = norm(x, p["attn_norm"])
        if kind == FULL:
          blocks = [KVBlock(k[a], v[a], m) for (k, v), m in zip(anc_f, global_valid)]
          out, kv = _attention(cfg, at(full_r, j, gathers[2]), h, positions, glob_freq, blocks, keys_valid,
                               GLOBAL_WINDOW, scale, None if donor is None else donor[2:])
          out_f.append(kv)
        else:
          blocks = [b for (k, v), m in zip(anc_s, sliding_masks) for b in _sliding_blocks(k[a], v[a], m)]
          out, kv = _attention(cfg, at(sliding_r, j, gathers[1]), h, positions, local_freq, blocks, keys_valid,
                               cfg.sliding_window, scale, None if donor is None else donor[:2])
          out_s.append(kv)
        x = x + norm(out, p["post_attn_norm"])
        h = norm(x, p["mlp_norm"])
        act = (jax.nn.gelu(project(p, "w_gate", "btd,df->btf", h, scale), approximate=True)
               * project(p, "w_up", "btd,df->btf", h, scale))
        out = project(p, "w_down", "btf,fd->btd", act, scale)
        if cfg.moe:   # the experts beside the dense MLP, routed by the residual stream (transformers' decoder layer)
          moe_p = {theirs: p[ours] for ours, theirs in MOE_PARAMS.items()}
          moe_p.update({EXPERT_AXES: axes for axes in dispatch})
          y, route, chosen = moe_mlp(cfg, moe_p, norm(x, p["experts_norm"]), valid_bt,
                                     None if routes_r is None else routes_r[i], replay_routes, router_btd=x)
          router.append(route), experts.append(chosen)
          out = norm(out, p["mlp_out_norm"]) + norm(y, p["experts_out_norm"])
        x = x + norm(out, p["post_mlp_norm"])
        if ple_r is not None:   # E2B/E4B: the layer's per-layer input, gated by the stream (transformers' layer)
          token = p["ple_table"][ple[0]].astype(x.dtype) * jnp.asarray(cfg.per_layer_input_dim ** 0.5, x.dtype)
          u = (ple_r[i] + token) * jnp.asarray(2.0 ** -0.5, x.dtype)
          gate = jax.nn.gelu(project(p, "ple_gate", "btd,dp->btp", x, 0.0), approximate=True) * u
          x = x + norm(project(p, "ple_proj", "btp,pd->btd", gate, 0.0), p["ple_norm"])
        x = x * scalar_r[i]
      stack = lambda kvs: tuple(jnp.stack(a) for a in zip(*kvs))
      kvs = None if donor is not None else (*stack(out_s), *stack(out_f))
      return x, (kvs, stack_layers(router), stack_layers(experts))

    x, (kvs, route, experts) = jax.lax.scan(rematerialized(body, self.remat, gathering), x, xs)
    merge = lambda a: a.reshape(-1, *a.shape[2:])
    route = None if route is None else summed_over_layers(jax.tree_util.tree_map(merge, route))
    experts = None if experts is None else jnp.moveaxis(merge(experts), 0, 2)   # [L, B, T, k] -> [B, T, L, k]
    return x, None if kvs is None else tuple(merge(a) for a in kvs), route, experts


# --- Hugging Face checkpoints (transformers' Gemma4ForCausalLM, model_type "gemma4_text") -----------------------

HF_LAYER = "model.layers.{}."
HF_SHARED = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "post_attn_norm",
             "pre_feedforward_layernorm.weight": "mlp_norm", "post_feedforward_layernorm.weight": "post_mlp_norm",
             "mlp.gate_proj.weight": "w_gate", "mlp.up_proj.weight": "w_up", "mlp.down_proj.weight": "w_down"}
HF_ATTENTION = {"self_attn.q_proj.weight": "wq", "self_attn.k_proj.weight": "wk", "self_attn.v_proj.weight": "wv",
                "self_attn.o_proj.weight": "wo", "self_attn.q_norm.weight": "q_norm",
                "self_attn.k_norm.weight": "k_norm"}
SCALAR = "layer_scalar"
# The mixture-of-experts block (transformers' Gemma4TextRouter and Gemma4TextExperts, 26B-A4B): router.proj [E, d],
# router.scale [d], router.per_expert_scale [E], experts.gate_up_proj [E, 2 F_e, d] (the gate's rows first),
# experts.down_proj [E, d, F_e], and its three norms.
HF_MOE_NORMS = {"pre_feedforward_layernorm_2.weight": "experts_norm",
                "post_feedforward_layernorm_1.weight": "mlp_out_norm",
                "post_feedforward_layernorm_2.weight": "experts_out_norm"}
HF_ROUTER = {"router.proj.weight": "w_router", "router.scale": "router_scale",
             "router.per_expert_scale": "expert_scale"}
HF_EXPERTS_GATE_UP, HF_EXPERTS_DOWN = "experts.gate_up_proj", "experts.down_proj"
# Per-layer embeddings (E2B/E4B; transformers' Gemma4TextModel): the table [V, L·Dp], the projection of the
# embedding [L·Dp, d] and its norm [Dp]; in each layer the gate [Dp, d], the projection [d, Dp] and its norm [d].
HF_PLE_TABLE, HF_PLE_PROJECTION = "model.embed_tokens_per_layer.weight", "model.per_layer_model_projection.weight"
HF_PLE_NORM = "model.per_layer_projection_norm.weight"
HF_PLE_LAYER = ("per_layer_input_gate.weight", "per_layer_projection.weight", "post_per_layer_input_norm.weight")
PLE_LAYER = ("ple_gate", "ple_proj", "ple_norm")


def _layer_shape(c: ModelConfig, kind: str) -> tuple[int, int, bool]:
  """(K/V heads, head width, has v_proj) of a layer kind."""
  if kind == FULL:
    return c.global_kv_heads, c.global_head_dim, not c.k_eq_v
  return c.num_kv_heads, c.head_dim, True


def _reuses(c: ModelConfig, i: int) -> bool:
  """Layer i is a K/V-sharing one (no k_proj, v_proj, k_norm; its MLP 2 · F wide with double_wide_mlp)."""
  return i >= len(c.kv_layer_types)


def _expected(c: ModelConfig) -> dict[str, tuple]:
  """{HF tensor name: shape} of a gemma4_text checkpoint of `c`."""
  d = c.d_model
  out = {"model.embed_tokens.weight": (c.vocab_size, d), "model.norm.weight": (d,)}
  dp = c.per_layer_input_dim
  if dp:
    out.update({HF_PLE_TABLE: (c.vocab_size, c.num_layers * dp), HF_PLE_PROJECTION: (c.num_layers * dp, d),
                HF_PLE_NORM: (dp,)})
  for i, kind in enumerate(c.layer_types):
    pre = HF_LAYER.format(i)
    f = c.ffn_dim * (2 if _reuses(c, i) and c.double_wide_mlp else 1)
    out.update({pre + n: s for n, s in zip(HF_SHARED, ((d,),) * 4 + ((f, d), (f, d), (d, f)))})
    out[pre + SCALAR] = (1,)
    if dp:
      out.update({pre + n: s for n, s in zip(HF_PLE_LAYER, ((dp, d), (d, dp), (d,)))})
    if c.moe:
      e, fe = c.num_experts, c.expert_ffn_dim
      out.update({pre + n: (d,) for n in HF_MOE_NORMS})
      out.update({pre + "router.proj.weight": (e, d), pre + "router.scale": (d,), pre + "router.per_expert_scale": (e,),
                  pre + HF_EXPERTS_GATE_UP: (e, 2 * fe, d), pre + HF_EXPERTS_DOWN: (e, d, fe)})
    hkv, w, values = _layer_shape(c, kind)
    shapes = {"wq": (c.num_heads * w, d), "wk": (hkv * w, d), "wv": (hkv * w, d), "wo": (d, c.num_heads * w),
              "q_norm": (w,), "k_norm": (w,)}
    own = ("wq", "wo", "q_norm") if _reuses(c, i) else ("wq", "wk", "wo", "q_norm", "k_norm") + (("wv",) * values)
    out.update({pre + hf: shapes[ours] for hf, ours in HF_ATTENTION.items() if ours in own})
  return out


def _group_from_hf(tensors: dict, c: ModelConfig, layers: range) -> dict:
  """The pure dict of one `Gemma4Layers` group (the layers computing K/V, or the K/V-sharing ones) in float32."""
  f32 = lambda x: np.ascontiguousarray(x, dtype=np.float32)
  moe_names = {**HF_MOE_NORMS, **HF_ROUTER} if c.moe else {}
  ple_names = dict(zip(HF_PLE_LAYER, PLE_LAYER)) if c.per_layer_input_dim else {}
  shared = {ours: [] for ours in (*HF_SHARED.values(), *moe_names.values(), *ple_names.values(),
                                  *(("ple_table",) if ple_names else ()),
                                  *(("e_gate", "e_up", "e_down") if c.moe else ()))}
  kinds = {SLIDING: {}, FULL: {}}
  table = (np.asarray(tensors[HF_PLE_TABLE]).reshape(c.vocab_size, c.num_layers, -1) if ple_names else None)
  for i in layers:
    kind = c.layer_types[i]
    t = lambda name: tensors[HF_LAYER.format(i) + name]
    if ple_names:   # the table [V, L·Dp]: layer i's [V, Dp]
      shared["ple_table"].append(table[:, i])
    for hf, ours in {**HF_SHARED, **ple_names}.items():   # matrices [out, in] -> [in, out]; norms as they are
      shared[ours].append(t(hf) if ours.endswith("norm") else t(hf).T)
    for hf, ours in moe_names.items():   # w_router [E, d] -> [d, E]; the norms and scales as they are
      shared[ours].append(t(hf).T if ours == "w_router" else t(hf))
    if c.moe:   # gate_up [E, 2 F_e, d] -> e_gate, e_up [E, d, F_e]; down [E, d, F_e] -> e_down [E, F_e, d]
      gate_up = np.swapaxes(t(HF_EXPERTS_GATE_UP), 1, 2)
      shared["e_gate"].append(gate_up[..., :c.expert_ffn_dim]), shared["e_up"].append(gate_up[..., c.expert_ffn_dim:])
      shared["e_down"].append(np.swapaxes(t(HF_EXPERTS_DOWN), 1, 2))
    hkv, w, values = _layer_shape(c, kind)
    heads = lambda m, h: m.T.reshape(c.d_model, h, w)                          # [h·w, d] -> [d, h, w]
    own = {"wq": heads(t("self_attn.q_proj.weight"), c.num_heads),
           "wo": t("self_attn.o_proj.weight").T.reshape(c.num_heads, w, c.d_model),
           "q_norm": t("self_attn.q_norm.weight")}
    if not _reuses(c, i):
      own.update(wk=heads(t("self_attn.k_proj.weight"), hkv), k_norm=t("self_attn.k_norm.weight"))
      if values:
        own["wv"] = heads(t("self_attn.v_proj.weight"), hkv)
    for name, value in own.items():
      kinds[kind].setdefault(name, []).append(value)
  stack = lambda d: {k: f32(np.stack(v)) for k, v in d.items()}
  return {**stack(shared), "sliding": stack(kinds[SLIDING]), "full": stack(kinds[FULL])}


def params_from_hf(tensors: dict, config: ModelConfig, source: str) -> tuple[ModelConfig, dict]:
  """(config with the checkpoint's layer scalars, the pure dict of `Gemma4`'s parameters in float32) from a
  checkpoint's HF-named tensors. A K/V-sharing layer's k_proj, v_proj, k_norm and v_norm, where a file holds
  them, are not read (transformers ignores them too: `_keys_to_ignore_on_load_unexpected`).

  Raises:
    ValueError: naming `source`, every missing and unexpected tensor and every shape mismatch (the first 8); a
      layer scalar that is not finite.
  """
  c = config
  unused = {HF_LAYER.format(i) + f"self_attn.{n}.weight" for i in range(len(c.kv_layer_types), c.num_layers)
            for n in ("k_proj", "v_proj", "k_norm", "v_norm")}
  tensors = {k: v for k, v in tensors.items() if k not in unused}
  check_tensors(tensors, _expected(config), config, source)
  f32 = lambda x: np.ascontiguousarray(x, dtype=np.float32)
  scalars = []
  for i in range(c.num_layers):
    scalars.append(float(np.asarray(tensors[HF_LAYER.format(i) + SCALAR]).reshape(())))
    if not np.isfinite(scalars[-1]):
      raise ValueError(f"{source}: {HF_LAYER.format(i) + SCALAR} is {scalars[-1]}; a layer scalar must be finite")
  n = len(c.kv_layer_types)
  params = {"embed": f32(tensors["model.embed_tokens.weight"]), "final_norm": f32(tensors["model.norm.weight"]),
            "layers": _group_from_hf(tensors, c, range(n))}
  if c.kv_shared_layers:
    params["layers"]["reuse"] = _group_from_hf(tensors, c, range(n, c.num_layers))
  dp = c.per_layer_input_dim
  if dp:   # projection [L·Dp, d] -> [d, L, Dp]
    params.update(per_layer_projection=f32(tensors[HF_PLE_PROJECTION].T).reshape(c.d_model, c.num_layers, dp),
                  per_layer_projection_norm=f32(tensors[HF_PLE_NORM]))
  return dataclasses.replace(c, layer_scalars=tuple(scalars)), params


def _group_to_hf(out: dict, c: ModelConfig, lay: dict, layers: range) -> None:
  """Write one layer group's HF-named float32 tensors (`_group_from_hf` inverted; lay: its pure dict, stacked from
  layers[0]) into out."""
  f32 = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))
  scalars = c.layer_scalars or (1.0,) * c.num_layers
  ple_names = dict(zip(HF_PLE_LAYER, PLE_LAYER)) if c.per_layer_input_dim else {}
  counts = {SLIDING: 0, FULL: 0}
  for at, i in enumerate(layers):
    kind = c.layer_types[i]
    pre = HF_LAYER.format(i)
    for hf, ours in {**HF_SHARED, **ple_names}.items():
      w = np.asarray(lay[ours][at])
      out[pre + hf] = f32(w if ours.endswith("norm") else w.T)
    out[pre + SCALAR] = f32([scalars[i]])
    if c.moe:
      for hf, ours in {**HF_MOE_NORMS, **HF_ROUTER}.items():
        w = np.asarray(lay[ours][at])
        out[pre + hf] = f32(w.T if ours == "w_router" else w)
      gate_up = np.concatenate([np.asarray(lay["e_gate"][at]), np.asarray(lay["e_up"][at])], axis=-1)
      out[pre + HF_EXPERTS_GATE_UP] = f32(np.swapaxes(gate_up, 1, 2))
      out[pre + HF_EXPERTS_DOWN] = f32(np.swapaxes(np.asarray(lay["e_down"][at]), 1, 2))
    p = {k: np.asarray(v[counts[kind]]) for k, v in lay["full" if kind == FULL else "sliding"].items()}
    counts[kind] += 1
    flat = lambda m: m.reshape(c.d_model, -1).T                                  # [d, h, w] -> [h·w, d]
    own = {"wq": flat(p["wq"]), "wo": p["wo"].reshape(-1, c.d_model).T, "q_norm": p["q_norm"],
           **({"wk": flat(p["wk"]), "k_norm": p["k_norm"]} if "wk" in p else {}),
           **({"wv": flat(p["wv"])} if "wv" in p else {})}
    out.update({pre + hf: f32(own[ours]) for hf, ours in HF_ATTENTION.items() if ours in own})


def hf_tensors(config: ModelConfig, params: dict) -> dict[str, np.ndarray]:
  """HF-named float32 tensors of `Gemma4` parameters (a pure dict) and the config's layer scalars:
  `params_from_hf` inverted."""
  c = config
  f32 = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))
  out = {"model.embed_tokens.weight": f32(params["embed"]), "model.norm.weight": f32(params["final_norm"])}
  lay, n = params["layers"], len(c.kv_layer_types)
  groups = [(lay, range(n))] + ([(lay["reuse"], range(n, c.num_layers))] if c.kv_shared_layers else [])
  for group, layers in groups:
    _group_to_hf(out, c, group, layers)
  if c.per_layer_input_dim:   # the groups' tables [Lgroup, V, Dp] -> [V, L·Dp]
    tables = np.concatenate([np.asarray(group["ple_table"]) for group, _ in groups])
    out[HF_PLE_TABLE] = f32(np.moveaxis(tables, 0, 1).reshape(c.vocab_size, -1))
    out[HF_PLE_PROJECTION] = f32(np.asarray(params["per_layer_projection"]).reshape(c.d_model, -1).T)
    out[HF_PLE_NORM] = f32(params["per_layer_projection_norm"])
  return out


def hf_config_fields(config: ModelConfig) -> dict:
  """The gemma4_text fields of config.json (`hf_loader._gemma4_fields` inverted), beside `export.hf_config`'s
  common ones."""
  c = config
  full_rope = {"rope_type": "proportional", "partial_rotary_factor": c.global_rope_fraction,
               "rope_theta": c.rope_theta, **({"factor": c.rope_scaling.factor} if c.rope_scaling else {})}
  return dict(layer_types=list(c.layer_types), sliding_window=c.sliding_window, global_head_dim=c.global_head_dim,
              num_global_key_value_heads=c.global_kv_heads, attention_k_eq_v=c.k_eq_v,
              final_logit_softcapping=c.final_logit_softcap, hidden_activation="gelu_pytorch_tanh",
              hidden_size_per_layer_input=c.per_layer_input_dim or 0, vocab_size_per_layer_input=c.vocab_size,
              num_kv_shared_layers=c.kv_shared_layers, use_double_wide_mlp=c.double_wide_mlp, enable_moe_block=c.moe,
              **(dict(num_experts=c.num_experts, top_k_experts=c.experts_per_token,
                      moe_intermediate_size=c.expert_ffn_dim) if c.moe else {}),
              rope_parameters={FULL: full_rope,
                               SLIDING: {"rope_type": "default", "rope_theta": c.rope_local_theta}})
