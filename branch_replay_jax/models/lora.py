"""LoRA adapters on the stacked projections of `Llama` (Hu et al. 2021, arXiv 2106.09685).

A mixture of experts (Qwen3-MoE, Qwen3.5-MoE) takes them on its attention and on its experts: the MLP
targets w_gate, w_up, w_down are its E experts [L, E, *in, *out], and each expert gets its own pair,
A [L, E, *in, r] and B [L, E, r, *out], applied by the same grouped matmul as its weight
(`llama._expert_sum`: x A_e then B_e on the rows routed to expert e). The router and Qwen3.5-MoE's shared
expert take none. Qwen3.5 (`models.qwen3_5`) takes them on
every layer's MLP and on its full-attention layers' wq, wk, wv, wo (stacked [Lf, ...] in `layers.full`, beside
the adapted weight); its Gated DeltaNet layers' projections take none. Gemma 4 (`models.gemma4`) takes them on
every layer's dense MLP and on both attention kinds: an attention target gets one pair per stack, its sliding
layers' in `layers.sliding` and its global layers' (of their own head width and K/V heads) in `layers.full`; a
global layer without v_proj (attention_k_eq_v) has no wv to adapt. Gemma 4's experts and router take none.

A target projection W of the stacked layout (models/llama.py) gets two adapters, stacked on the
same leading layer axis and typed `nnx.LoRAParam` (Flax NNX's LoRA variable type):

    W  [L, *in, *out]     wq [L, d, Hq, D], wk, wv [L, d, Hkv, D], wo [L, Hq, D, d],
                          w_gate, w_up [L, d, F], w_down [L, F, d]
    A = layers.W_lora_a [L, *in, r]     (he-uniform over the input axes, as qwix and nnx.LoRA)
    B = layers.W_lora_b [L, r, *out]    (zeros: the adapted model starts as the base model)

with W's logical axis names and "lora_rank" for r (A: (layers, *in names, lora_rank); B: (layers,
lora_rank, *out names); models/llama.py's parameter layout), so the adapters shard by the same
rules table as the base (`distributed.sharding`).

    y = x W + (alpha / r) (x A) B        (the layer computes x A first: rank-r intermediates)

Why not a library's interception: qwix (`qwix.LoraProvider`, as Tunix uses) adds adapters by
intercepting `einsum`/`dot_general` inside a module's call and matching the weight operand to a
parameter of the *current module* (by identity, tracer parentage or shape,
`qwix._src.utils.flax_util.find_param`). Our model scans over layers (`jax.lax.scan`) with every
parameter sliced out of a stacked [L, ...] array of the child module `DecoderLayers` (and, under
FSDP, all-gathered inside the scan): inside the scan body the weight is a per-layer slice that
matches no parameter of the calling `Llama`, so qwix would find none and add nothing, and were it
matched by shape it would create one unstacked adapter inside the scan trace, shared by all
layers. `nnx.LoRA` / `nnx.LoRALinear` are 2-D modules (x @ a @ b, no alpha / rank scaling) for
`nnx.Linear`-style layers, not stacked multi-axis einsum weights. So the adapters here are the
stacked parameters above, applied by `llama._layer` next to the projection they adapt, and typed
`nnx.LoRAParam` so that `nnx.split(model, nnx.LoRAParam, ...)` separates (adapters, base): the
training loop differentiates, optimises and checkpoints the adapters alone, and the replay
functions see the base through `WithBase` (closed over, never differentiated).

The reference policy of the KL term is the base model: the adapted model with its adapters set
to zero (`adapters_off`), which adds exactly 0 to every projection; same program, no copy of the
base parameters.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from branch_replay_jax.models.config import ModelConfig
from branch_replay_jax.models.llama import AXES_KEY, Llama, annotated

# Projection name -> number of its input axes after the layer axis (the rest are output axes).
IN_AXES = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1}
TARGETS = tuple(IN_AXES)
# The attention's projections (Qwen3.5: its full-attention layers', `target_weight`).
ATTENTION_TARGETS = ("wq", "wk", "wv", "wo")
# A mixture of experts' MLP targets: its experts, stacked [L, E, ...], one adapter pair per expert.
EXPERT_TARGETS = ("w_gate", "w_up", "w_down")


@dataclasses.dataclass(frozen=True)
class LoraSpec:
  """Which projections carry adapters and how large. Frozen and hashable (static in the graphdef).

  rank: r >= 1, at most min(fan-in, fan-out) of every target (`check_spec`).
  alpha: the adapters' output is scaled by alpha / rank (`scale`).
  targets: names of TARGETS.
  """

  rank: int
  alpha: float
  targets: tuple[str, ...] = TARGETS

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


def projection_shapes(config: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
  """name -> (input axes, output axes) of one layer's projection (without the layer axis) that can take adapters,
  every name of TARGETS; for a mixture of experts whose MLP is its experts the MLP's are one expert's (without its
  experts axis: `expert_axes`). Gemma 4's attention targets: its sliding layers' (`global_shapes` the others')."""
  d, hq, hkv, hd, f = config.d_model, config.num_heads, config.num_kv_heads, config.head_dim, config.ffn_dim
  # (Qwen3.5: wq .. wo are its full-attention layers', of the same shapes, `target_weights`)
  attention = {"wq": ((d,), (hq, hd)), "wk": ((d,), (hkv, hd)), "wv": ((d,), (hkv, hd)), "wo": ((hq, hd), (d,))}
  if config.moe and not config.gemma4:
    f = config.expert_ffn_dim
  return {**attention, "w_gate": ((d,), (f,)), "w_up": ((d,), (f,)), "w_down": ((f,), (d,))}


def global_shapes(config: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
  """Gemma 4's global layers' attention projections as `projection_shapes` gives them (no wv with k_eq_v); {}
  for another model."""
  if not config.gemma4:
    return {}
  d, hq, hg, dg = config.d_model, config.num_heads, config.global_kv_heads, config.global_head_dim
  out = {"wq": ((d,), (hq, dg)), "wk": ((d,), (hg, dg)), "wv": ((d,), (hg, dg)), "wo": ((hq, dg), (d,))}
  return {k: v for k, v in out.items() if k != "wv" or not config.k_eq_v}


def expert_axes(config: ModelConfig, target: str) -> int:
  """Axes between a target's layer axis and its input axes: 1 for a mixture of experts' expert weights (their
  experts axis E, which the adapters share), else 0 (Gemma 4's MLP targets are its dense MLP's)."""
  return int(config.moe and not config.gemma4 and target in EXPERT_TARGETS)


def check_spec(rank, alpha, targets, config: ModelConfig, *, field: str = "lora") -> LoraSpec:
  """The `LoraSpec` of (rank, alpha, targets) for `config`'s shapes.

  Raises:
    ValueError (naming `field`.rank / .alpha / .targets and the value): targets empty, repeated or
      not in TARGETS; rank not an int >= 1 or larger than min(fan-in, fan-out) of a target (fan-in
      and fan-out are the products of the projection's input and output axes); alpha not a finite
      number > 0.
  """
  targets = tuple(targets) if isinstance(targets, (tuple, list)) else targets
  if not isinstance(targets, tuple) or not targets or len(set(targets)) != len(targets):
    raise ValueError(f"{field}.targets={targets!r} must be a non-empty tuple of distinct names of {TARGETS}")
  unknown = [t for t in targets if t not in TARGETS]
  if unknown:
    raise ValueError(f"{field}.targets={targets!r}: {unknown} are not projections; expected names of {TARGETS}")
  if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
    raise ValueError(f"{field}.rank={rank!r} must be an int >= 1")
  for t, shape in [(t, shapes[t]) for shapes in (projection_shapes(config), global_shapes(config))
                   for t in targets if t in shapes]:
    fan_in, fan_out = (math.prod(s) for s in shape)
    if rank > min(fan_in, fan_out):
      raise ValueError(f"{field}.rank={rank} is larger than projection {t}'s dimensions (fan-in {fan_in}, fan-out "
                       f"{fan_out}): a rank-r update needs r <= {min(fan_in, fan_out)}")
  if isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.integer, np.floating)) or \
      not 0 < alpha < float("inf"):
    raise ValueError(f"{field}.alpha={alpha!r} must be a finite number > 0")
  return LoraSpec(int(rank), float(alpha), targets)


def target_weights(model: Llama, target: str) -> list[tuple[Any, tuple[str, ...]]]:
  """[(a module holding a stack of `target`'s weight, its path in the model's pure dict)]: `model.layers`; for
  Qwen3.5's attention targets its full-attention layers' `model.layers.full` (stacked [Lf, ...]); for Gemma 4's
  its sliding layers' `layers.sliding` and its global layers' `layers.full` (where it has that weight); with
  K/V-sharing layers (E2B/E4B) their group's too, `layers.reuse` (no wk, wv there)."""
  groups = [(model.layers, ("layers",))]
  if model.config.kv_shared_layers:   # Gemma 4's K/V-sharing layers: their own group, `layers.reuse`
    groups.append((model.layers.reuse, ("layers", "reuse")))
  if target not in ATTENTION_TARGETS or not (model.config.hybrid or model.config.gemma4):
    return groups
  kinds = ("sliding", "full") if model.config.gemma4 else ("full",)
  return [(getattr(m, k), (*path, k)) for m, path in groups for k in kinds if hasattr(getattr(m, k), target)]


def add_adapters(model: Llama, spec: LoraSpec, *, rngs: nnx.Rngs) -> Llama:
  """Add `spec`'s adapters to `model` in place (A he-uniform, B zero: the output is unchanged) and return it.

  Sets `model.lora = spec` (read by the forward for the scale) and, per target W,
  `model.layers.W_lora_a` [L, *in, r] and `W_lora_b` [L, r, *out] (an expert weight's: [L, E, *in, r] and
  [L, E, r, *out]), float32 `nnx.LoRAParam` annotated with W's logical axis names and "lora_rank" (module
  docstring).

  Raises:
    ValueError: the model already has adapters, or `spec` does not fit its shapes (`check_spec`).
  """
  if model.lora is not None:
    raise ValueError(f"add_adapters: the model already has adapters ({model.lora})")
  check_spec(spec.rank, spec.alpha, spec.targets, model.config)
  r = spec.rank
  for t, (module, _) in [(t, m) for t in spec.targets for m in target_weights(model, t)]:
    weight = getattr(module, t)
    lead = 1 + expert_axes(model.config, t)   # the layer axis, and an expert weight's experts axis
    batch = tuple(weight.shape[:lead])
    ins, outs = weight.shape[lead:lead + IN_AXES[t]], weight.shape[lead + IN_AXES[t]:]
    names = weight.get_metadata(AXES_KEY)   # W's: (layers, [experts,] *in names, *out names)
    names_a = names[:lead + len(ins)] + ("lora_rank",)
    names_b = names[:lead] + ("lora_rank",) + names[lead + len(ins):]
    init_a = nnx.initializers.variance_scaling(2.0, "fan_in", "uniform", in_axis=tuple(range(lead, lead + len(ins))),
                                               out_axis=-1, batch_axis=tuple(range(lead)))
    setattr(module, t + "_lora_a", annotated(init_a(rngs.params(), (*batch, *ins, r), jnp.float32), names_a,
                                             nnx.LoRAParam))
    setattr(module, t + "_lora_b", annotated(jnp.zeros((*batch, r, *outs), jnp.float32), names_b, nnx.LoRAParam))
  model.lora = spec
  return model


def split(model: Llama):
  """(graphdef, adapters, base) = `nnx.split(model, nnx.LoRAParam, ...)`: the trained and the frozen state."""
  return nnx.split(model, nnx.LoRAParam, ...)


@dataclasses.dataclass(frozen=True)
class WithBase:
  """A graphdef bound to the frozen base state it merges with. Pass it where the replay and naive
  functions (gradients/step.py) take `graphdef`, with the adapters as `params`: they merge
  through `merge`, so only the adapters are differentiated; the base enters as a closed-over
  array argument (build it inside the jitted function from a traced base, not a constant)."""

  graphdef: Any
  base: Any


def merge(graphdef, params):
  """`nnx.merge(graphdef, params)`, or with a `WithBase` graph `nnx.merge(graph, params, base)`."""
  if isinstance(graphdef, WithBase):
    return nnx.merge(graphdef.graphdef, params, graphdef.base)
  return nnx.merge(graphdef, params)


def adapters_off(adapters):
  """The adapters set to zero: the adapted model then computes exactly the base model (every
  projection adds (x 0) 0 * scale = 0). The reference policy; adapter-sized, not model-sized."""
  return jax.tree_util.tree_map(jnp.zeros_like, adapters)


def merged(model: Llama) -> Llama:
  """A copy of `model` without adapters whose weights are W + (alpha / r) A B (summed in float64,
  stored in W's dtype): the same function up to rounding. For export; `model` unchanged. A model
  without adapters is returned as is."""
  if model.lora is None:
    return model
  spec = model.lora
  graphdef, state = nnx.split(model)
  pure = nnx.to_pure_dict(state)
  for t, (_, path) in [(t, m) for t in spec.targets for m in target_weights(model, t)]:
    layers = pure   # down the target's path (Qwen3.5's full-attention layers, Gemma 4's kinds and groups), copied
    for key in path:
      layers[key] = dict(layers[key])
      layers = layers[key]
    dtype = np.asarray(layers[t]).dtype
    a, b, w = (np.asarray(layers.pop(t + s), np.float64) for s in ("_lora_a", "_lora_b", ""))
    batch = w.shape[:1 + expert_axes(model.config, t)]   # [L] or an expert weight's [L, E]
    delta = np.einsum("nir,nro->nio", a.reshape(-1, math.prod(a.shape[len(batch):-1]), spec.rank),
                      b.reshape(-1, spec.rank, math.prod(b.shape[len(batch) + 1:])))
    layers[t] = (w + spec.scale * delta.reshape(w.shape)).astype(dtype)
  cfg = model.config
  # the same class and options (Qwen3.5's chunk too), without adapters
  options = {"chunk": model.chunk} if hasattr(model, "chunk") else {}
  plain = nnx.eval_shape(lambda: type(model)(cfg, dtype=model.dtype, remat=model.remat,
                                             attention_impl=model.attention_impl, rngs=nnx.Rngs(0), **options))
  plain_graph, plain_state = nnx.split(plain)
  nnx.replace_by_pure_dict(plain_state, jax.tree_util.tree_map(jnp.asarray, pure))
  return nnx.merge(plain_graph, plain_state)


def base_hash(base) -> str:
  """sha256 (hex) of a base state's arrays: each leaf's path, dtype, shape and bytes, in path order.
  Identifies the base model an adapter checkpoint was trained on (`check_base`)."""
  h = hashlib.sha256()
  leaves = jax.tree_util.tree_leaves_with_path(base)
  for path, x in sorted(leaves, key=lambda kv: jax.tree_util.keystr(kv[0])):
    x = np.asarray(jax.device_get(x))
    h.update(f"{jax.tree_util.keystr(path)}|{x.dtype}|{x.shape}|".encode())
    h.update(np.ascontiguousarray(x).tobytes())
  return h.hexdigest()


def check_base(saved: dict | None, current: dict, where: str) -> None:
  """Refuse adapters saved on another base model.

  saved, current: {"model": model.name, "sha256": base_hash(base)} of the checkpoint and of the
  model loaded now.

  Raises:
    ValueError: the checkpoint `where` records no base (it is not a LoRA checkpoint) or another
      one (naming model.name and both hashes).
  """
  if saved is None:
    raise ValueError(f"{where}: the checkpoint holds no LoRA base record (not a LoRA run's checkpoint); "
                     f"lora is set for model.name={current['model']!r}")
  if saved.get("sha256") != current["sha256"]:
    raise ValueError(f"{where}: the adapters were trained on base model.name={saved.get('model')!r} (weights sha256 "
                     f"{saved.get('sha256')}), but model.name={current['model']!r} loads weights with sha256 "
                     f"{current['sha256']}; use the base model the adapters were trained on")
