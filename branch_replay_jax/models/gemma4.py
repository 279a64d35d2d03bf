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
Per-layer embeddings (the E2B/E4B models), K/V sharing across layers and the mixture-of-experts block
(26B-A4B) are not built: the loader refuses them by name (`models.hf_loader`).

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
from branch_replay_jax.kernels.reference import accum_dtype, windowed_suffix_attention
from branch_replay_jax.models.config import FULL, SLIDING, ModelConfig
from branch_replay_jax.models.hf_loader import check_tensors
from branch_replay_jax.models.llama import (Llama, SegmentOutput, annotated, apply_rope,
                                            gathered, project, rematerialized, rms_norm, rope_inv_freq,
                                            segment_positions)
from branch_replay_jax.models.qwen3_5 import ParamBag, pattern, stacked_kinds
from branch_replay_jax.models.window_kv import WindowedPrompt, last_keys


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


def _ancestor(a: Gemma4KV | WindowedPrompt, dtype) -> tuple:
  """((sliding k, v [Ls, ...]), sliding valid masks, (global k, v [Lg, ...]), global valid) of an ancestor; a
  trimmed one's sliding masks are its head block's ([B, T - (W - 1)] True before start) and its tail's."""
  cast = lambda x: x.astype(dtype)
  if isinstance(a, WindowedPrompt):
    head = a.full.valid.shape[-1] - a.tail.valid.shape[-1]
    before = jnp.arange(head)[None] < a.start[:, None]
    return (cast(a.tail.k), cast(a.tail.v)), (before, a.tail.valid), (cast(a.full.k), cast(a.full.v)), a.full.valid
  return (cast(a.k), cast(a.v)), (a.valid,), (cast(a.gk), cast(a.gv)), a.valid


def _sliding_blocks(k, v, masks) -> list[KVBlock]:
  """One sliding layer's blocks of an ancestor: its K/V k, v [B or 1, S, Hkv, D] with their mask, behind a head
  block of zero keys where the ancestor is trimmed (masks = (head, tail))."""
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
  """Parameters of the L layers (module docstring): norms and MLP [L, ...], `sliding` [Ls, ...], `full` [Lg, ...]."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c = config
    L, d, hq = c.num_layers, c.d_model, c.num_heads
    lg = c.layer_types.count(FULL)
    init = nnx.initializers.normal(0.02)
    normal = lambda *ns: annotated(init(rngs.params(), tuple(s for _, s in ns)), [n for n, _ in ns])
    ones = lambda *ns: annotated(jnp.ones(tuple(s for _, s in ns), jnp.float32), [n for n, _ in ns])
    for name in ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm"):
      setattr(self, name, ones(("layers", L), ("embed", d)))
    self.w_gate = normal(("layers", L), ("embed", d), ("mlp", c.ffn_dim))
    self.w_up = normal(("layers", L), ("embed", d), ("mlp", c.ffn_dim))
    self.w_down = normal(("layers", L), ("mlp", c.ffn_dim), ("embed", d))

    def attention(n, kv_heads, width, values: bool):
      return ParamBag(wq=normal(("layers", n), ("embed", d), ("heads", hq), ("head_dim", width)),
                     wk=normal(("layers", n), ("embed", d), ("kv_heads", kv_heads), ("head_dim", width)),
                     **({"wv": normal(("layers", n), ("embed", d), ("kv_heads", kv_heads), ("head_dim", width))}
                        if values else {}),
                     wo=normal(("layers", n), ("heads", hq), ("head_dim", width), ("embed", d)),
                     q_norm=ones(("layers", n), ("head_dim", width)), k_norm=ones(("layers", n), ("head_dim", width)))
    self.sliding = attention(L - lg, c.num_kv_heads, c.head_dim, True)
    self.full = attention(lg, c.global_kv_heads, c.global_head_dim, not c.k_eq_v)

  def stacked(self) -> tuple[tuple[dict, dict, dict], tuple[dict, dict, dict]]:
    """(values, gathers): ({shared name: [L, ...]}, {sliding name: [Ls, ...]}, {full name: [Lg, ...]}) and the
    same dicts of each parameter's `Gather` or None (FSDP, as `DecoderLayers.stacked`)."""
    return stacked_kinds(self, self.sliding, self.full)


def _attention(config: ModelConfig, p: dict, h_btd, positions_bt, inv_freq, ancestors: Sequence[KVBlock], valid_bt,
               window):
  """One layer's attention (transformers' `Gemma4TextAttention`): (output [B, T, d], (k, v)). Values are the
  key projection where p has no wv (attention_k_eq_v)."""
  eps = config.norm_eps
  q = rms_norm(project(p, "wq", "btd,dhk->bthk", h_btd, 0.0), p["q_norm"], eps)
  k_raw = project(p, "wk", "btd,dhk->bthk", h_btd, 0.0)
  v_raw = project(p, "wv", "btd,dhk->bthk", h_btd, 0.0) if "wv" in p else k_raw
  k = rms_norm(k_raw, p["k_norm"], eps)
  v = rms_norm(v_raw, jnp.ones((), accum_dtype(v_raw.dtype)), eps)   # v_norm: no scale
  q = apply_rope(q, positions_bt, inv_freq)
  k = checkpoint_name(apply_rope(k, positions_bt, inv_freq), "k")
  v = checkpoint_name(v, "v")
  attn, _ = windowed_suffix_attention(q, ancestors, KVBlock(k, v, valid_bt), window=window,
                                      query_positions=positions_bt, scale=1.0)
  return project(p, "wo", "bthk,hkd->btd", attn, 0.0), (k, v)


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
    super().__init__(config, dtype=dtype, remat=remat, attention_impl=attention_impl, rngs=rngs)

  @property
  def logit_softcap(self) -> float | None:
    """final_logit_softcap: the cap `Llama.logits` and `token_logprobs` apply (`llama.soft_cap`)."""
    return self.config.final_logit_softcap

  def initial_state(self, batch: int, length: int = 0) -> Gemma4KV:
    """An empty state of `length` slots: K/V zeros in the compute dtype, valid all False."""
    c = self.config
    lg = c.layer_types.count(FULL)
    z = lambda n, h, d: jnp.zeros((n, batch, length, h, d), self.dtype)
    ks, gs = z(c.num_layers - lg, c.num_kv_heads, c.head_dim), z(lg, c.global_kv_heads, c.global_head_dim)
    return Gemma4KV(ks, ks, jnp.zeros((batch, length), bool), gs, gs)

  def __call__(self, tokens_bt: jax.Array, offset, *, ancestors: Sequence[Gemma4KV] = (),
               valid_bt: jax.Array | None = None, attention=None, routes=None,
               replay_routes: bool = True) -> SegmentOutput:
    """Forward of one segment on its ancestors' K/V (`Llama.__call__`'s contract).

    Args:
      tokens_bt: [B, T] int token ids.
      offset: int or [B] int: the absolute position of the first token.
      ancestors: the ancestors' `Gemma4KV`s, oldest first (batch B or 1), each layer attending to its own kind's;
        any may be trimmed (`trim`, a `WindowedPrompt`).
      valid_bt: [B, T] bool, False on padding; default all True.
      attention, routes: must be None (the windowed attention is the layers' own; no experts).

    Returns:
      SegmentOutput(kv: this segment's `Gemma4KV` [.., B, T, ..], hidden_btd [B, T, d]).

    Raises:
      ValueError: an attention override, routes, or int32 key ends in valid_bt (a packed tree: the window
        takes no key ends; use the level or depth-first tree layout).
    """
    b, t = tokens_bt.shape
    if valid_bt is None:
      valid_bt = jnp.ones((b, t), dtype=bool)
    if valid_bt.dtype != jnp.bool_ or jnp.ndim(offset) == 2:
      raise ValueError("Gemma4: a packed tree (per-token positions and key ends) is not supported: the sliding "
                       "window takes no key ends; use the level or depth-first tree layout")
    if routes is not None:
      raise ValueError("Gemma4: routes= is a mixture of experts' (routing replay); Gemma 4 here has no experts")
    self._attention(attention)   # refuses an override
    positions = segment_positions(offset, b, t)
    x, (k, v, gk, gv) = self._layers(self._embed(tokens_bt), positions, list(ancestors), valid_bt)
    return SegmentOutput(Gemma4KV(k, v, valid_bt, gk, gv), self._final_norm(x))

  def prompt_and_rows(self, prompt_bt, prompt_valid_bt, prompt_last, rows_bt, rows_offset, rows_valid_bt, *,
                      attention=None, routes=(None, None), replay_routes: bool = True):
    """`Llama.prompt_and_rows`'s values: the prompt's forward, then the rows on its K/V (two layer scans)."""
    prompt = self(prompt_bt, 0, valid_bt=prompt_valid_bt, attention=attention)
    rows = self(rows_bt, rows_offset, ancestors=[prompt.kv], valid_bt=rows_valid_bt, attention=attention)
    last = jax.lax.dynamic_index_in_dim(prompt.hidden_btd[0], prompt_last, keepdims=False)
    return last, rows.hidden_btd, (None, None)

  def branch_kv(self, kv: Gemma4KV) -> Gemma4KV | WindowedPrompt:
    """A segment's K/V as replay hands it to its descendants: trimmed to what a window reaches (`trim`)."""
    return trim(kv, self.config.sliding_window)

  def _layers(self, x, positions, ancestors: list, valid_bt):
    """Scan over the repetitions of `pattern`: (x [B, T, d], (k, v [Ls, ...], gk, gv [Lg, ...]))."""
    cfg = self.config
    unit = pattern(cfg)
    reps = cfg.num_layers // len(unit)
    ns, nf = unit.count(SLIDING), unit.count(FULL)
    acc = accum_dtype(self.dtype)
    local_freq, glob_freq = rope_inv_freq(cfg, acc, local=True), global_inv_freq(cfg, acc)
    (shared, sliding, full), gathers = self.layers.stacked()
    gathering = any(g is not None for d in gathers for g in d.values())
    per_rep = lambda tree, n: jax.tree_util.tree_map(lambda a: a.reshape(reps, n, *a.shape[1:]), tree)
    scalars = np.ones(cfg.num_layers) if cfg.layer_scalars is None else np.asarray(cfg.layer_scalars)
    parts = [_ancestor(a, self.dtype) for a in ancestors]
    xs = (per_rep(shared, len(unit)), per_rep(sliding, ns), per_rep(full, nf), per_rep([p[0] for p in parts], ns),
          per_rep([p[2] for p in parts], nf), jnp.asarray(scalars.reshape(reps, len(unit)), self.dtype))
    sliding_masks, global_valid = [p[1] for p in parts], [p[3] for p in parts]
    norm = lambda x, w: rms_norm(x, w, cfg.norm_eps)

    def body(x, xs_r):
      shared_r, sliding_r, full_r, anc_s, anc_f, scalar_r = xs_r
      x = checkpoint_name(x, "layer_input")
      out_s, out_f = [], []

      def at(tree, j, g):   # layer j of a repetition's stacked weights; FSDP: all-gathered here, one layer at a time
        return {k: checkpoint_name(gathered(v[j], g[k], sliced=1), "gathered_weights") if gathering else v[j]
                for k, v in tree.items()}
      counts = {SLIDING: 0, FULL: 0}
      for i, kind in enumerate(unit):
        j = counts[kind]
        counts[kind] += 1
        p = at(shared_r, i, gathers[0])
        h = norm(x, p["attn_norm"])
        if kind == FULL:
          blocks = [KVBlock(k[j], v[j], m) for (k, v), m in zip(anc_f, global_valid)]
          out, kv = _attention(cfg, at(full_r, j, gathers[2]), h, positions, glob_freq, blocks, valid_bt,
                               GLOBAL_WINDOW)
          out_f.append(kv)
        else:
          blocks = [b for (k, v), m in zip(anc_s, sliding_masks) for b in _sliding_blocks(k[j], v[j], m)]
          out, kv = _attention(cfg, at(sliding_r, j, gathers[1]), h, positions, local_freq, blocks, valid_bt,
                               cfg.sliding_window)
          out_s.append(kv)
        x = x + norm(out, p["post_attn_norm"])
        h = norm(x, p["mlp_norm"])
        act = (jax.nn.gelu(project(p, "w_gate", "btd,df->btf", h, 0.0), approximate=True)
               * project(p, "w_up", "btd,df->btf", h, 0.0))
        x = x + norm(project(p, "w_down", "btf,fd->btd", act, 0.0), p["post_mlp_norm"])
        x = x * scalar_r[i]
      stack = lambda kvs: tuple(jnp.stack(a) for a in zip(*kvs))
      return x, (*stack(out_s), *stack(out_f))

    x, ys = jax.lax.scan(rematerialized(body, self.remat, gathering), x, xs)
    return x, tuple(a.reshape(-1, *a.shape[2:]) for a in ys)


# --- Hugging Face checkpoints (transformers' Gemma4ForCausalLM, model_type "gemma4_text") -----------------------

HF_LAYER = "model.layers.{}."
HF_SHARED = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "post_attn_norm",
             "pre_feedforward_layernorm.weight": "mlp_norm", "post_feedforward_layernorm.weight": "post_mlp_norm",
             "mlp.gate_proj.weight": "w_gate", "mlp.up_proj.weight": "w_up", "mlp.down_proj.weight": "w_down"}
HF_ATTENTION = {"self_attn.q_proj.weight": "wq", "self_attn.k_proj.weight": "wk", "self_attn.v_proj.weight": "wv",
                "self_attn.o_proj.weight": "wo", "self_attn.q_norm.weight": "q_norm",
                "self_attn.k_norm.weight": "k_norm"}
SCALAR = "layer_scalar"


def _layer_shape(c: ModelConfig, kind: str) -> tuple[int, int, bool]:
  """(K/V heads, head width, has v_proj) of a layer kind."""
  if kind == FULL:
    return c.global_kv_heads, c.global_head_dim, not c.k_eq_v
  return c.num_kv_heads, c.head_dim, True


def _expected(c: ModelConfig) -> dict[str, tuple]:
  """{HF tensor name: shape} of a gemma4_text checkpoint of `c`."""
  d, f = c.d_model, c.ffn_dim
  out = {"model.embed_tokens.weight": (c.vocab_size, d), "model.norm.weight": (d,)}
  for i, kind in enumerate(c.layer_types):
    pre = HF_LAYER.format(i)
    out.update({pre + n: s for n, s in zip(HF_SHARED, ((d,),) * 4 + ((f, d), (f, d), (d, f)))})
    out[pre + SCALAR] = (1,)
    hkv, w, values = _layer_shape(c, kind)
    shapes = {"wq": (c.num_heads * w, d), "wk": (hkv * w, d), "wv": (hkv * w, d), "wo": (d, c.num_heads * w),
              "q_norm": (w,), "k_norm": (w,)}
    out.update({pre + hf: shapes[ours] for hf, ours in HF_ATTENTION.items() if values or ours != "wv"})
  return out


def params_from_hf(tensors: dict, config: ModelConfig, source: str) -> tuple[ModelConfig, dict]:
  """(config with the checkpoint's layer scalars, the pure dict of `Gemma4`'s parameters in float32) from a
  checkpoint's HF-named tensors.

  Raises:
    ValueError: naming `source`, every missing and unexpected tensor and every shape mismatch (the first 8); a
      layer scalar that is not finite.
  """
  check_tensors(tensors, _expected(config), config, source)
  c = config
  f32 = lambda x: np.ascontiguousarray(x, dtype=np.float32)
  shared = {ours: [] for ours in HF_SHARED.values()}
  kinds = {SLIDING: {}, FULL: {}}
  scalars = []
  for i, kind in enumerate(c.layer_types):
    t = lambda name: tensors[HF_LAYER.format(i) + name]
    for hf, ours in HF_SHARED.items():
      shared[ours].append(t(hf) if ours.endswith("norm") else t(hf).T)
    scalars.append(float(np.asarray(t(SCALAR)).reshape(())))
    if not np.isfinite(scalars[-1]):
      raise ValueError(f"{source}: {HF_LAYER.format(i) + SCALAR} is {scalars[-1]}; a layer scalar must be finite")
    hkv, w, values = _layer_shape(c, kind)
    heads = lambda m, h: m.T.reshape(c.d_model, h, w)                          # [h·w, d] -> [d, h, w]
    own = {"wq": heads(t("self_attn.q_proj.weight"), c.num_heads), "wk": heads(t("self_attn.k_proj.weight"), hkv),
           "wo": t("self_attn.o_proj.weight").T.reshape(c.num_heads, w, c.d_model),
           "q_norm": t("self_attn.q_norm.weight"), "k_norm": t("self_attn.k_norm.weight")}
    if values:
      own["wv"] = heads(t("self_attn.v_proj.weight"), hkv)
    for name, value in own.items():
      kinds[kind].setdefault(name, []).append(value)
  stack = lambda d: {k: f32(np.stack(v)) for k, v in d.items()}
  params = {"embed": f32(tensors["model.embed_tokens.weight"]), "final_norm": f32(tensors["model.norm.weight"]),
            "layers": {**stack(shared), "sliding": stack(kinds[SLIDING]), "full": stack(kinds[FULL])}}
  return dataclasses.replace(c, layer_scalars=tuple(scalars)), params


def hf_tensors(config: ModelConfig, params: dict) -> dict[str, np.ndarray]:
  """HF-named float32 tensors of `Gemma4` parameters (a pure dict) and the config's layer scalars:
  `params_from_hf` inverted."""
  c = config
  f32 = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))
  out = {"model.embed_tokens.weight": f32(params["embed"]), "model.norm.weight": f32(params["final_norm"])}
  lay = params["layers"]
  scalars = c.layer_scalars or (1.0,) * c.num_layers
  counts = {SLIDING: 0, FULL: 0}
  for i, kind in enumerate(c.layer_types):
    pre = HF_LAYER.format(i)
    for hf, ours in HF_SHARED.items():
      w = np.asarray(lay[ours][i])
      out[pre + hf] = f32(w if ours.endswith("norm") else w.T)
    out[pre + SCALAR] = f32([scalars[i]])
    p = {k: np.asarray(v[counts[kind]]) for k, v in lay["full" if kind == FULL else "sliding"].items()}
    counts[kind] += 1
    flat = lambda m: m.reshape(c.d_model, -1).T                                  # [d, h, w] -> [h·w, d]
    own = {"wq": flat(p["wq"]), "wk": flat(p["wk"]), "wo": p["wo"].reshape(-1, c.d_model).T,
           "q_norm": p["q_norm"], "k_norm": p["k_norm"], **({"wv": flat(p["wv"])} if "wv" in p else {})}
    out.update({pre + hf: f32(own[ours]) for hf, ours in HF_ATTENTION.items() if ours in own})
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
              hidden_size_per_layer_input=0, num_kv_shared_layers=0, enable_moe_block=False,
              rope_parameters={FULL: full_rope,
                               SLIDING: {"rope_type": "default", "rope_theta": c.rope_local_theta}})
