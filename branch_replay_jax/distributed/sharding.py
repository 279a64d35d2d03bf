"""Parameter layouts on the mesh by annotation: logical axis names -> mesh axes, one rules table.

Every parameter carries the logical names of its dimensions as Flax NNX sharding metadata (`models.llama.annotated`:
"layers", "vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "lora_rank", "conv_kernel", "experts", "ple"
(Gemma 4's per-layer embedding width); the layout tables are models/llama.py's and models/qwen3_5.py's docstrings).
`LOGICAL_AXIS_RULES` maps them to mesh axes, per parameter mode, as MaxText's `logical_axis_rules` do: an ordered list
of (logical name, mesh axes) pairs. A leaf's PartitionSpec (`spec_of`) takes the rules in order; a rule applies when
the leaf has that logical dimension, none of the rule's mesh axes is used yet by this leaf, and the dimension's size
is divisible by the product of those mesh axes' sizes. A rule that does not apply is skipped; a dimension no rule
applies to is not split, so a leaf that fits no rule is replicated (the documented fallback for sizes the mesh does
not divide).

    "replicated": no rule: every parameter whole on every device.
    "fsdp":       every rule splits over all mesh axes ("data", "branch", "seq"), so each leaf is
                  split on at most one dimension, the first of vocab, mlp, embed, head_dim, heads,
                  kv_heads, lora_rank, conv_kernel, experts, ple that the device count divides (for
                  SmolLM2 and the tests' tiny model, that is the largest dimension the device count
                  divides, the layout before annotations); "layers" has no rule: the layer scan slices one layer of
                  a stacked parameter and all-gathers that slice (distributed/mesh.py). ZeRO
                  stage 3 (Rajbhandari et al. 2020, arXiv 1910.02054).

Expert parallelism (mesh.expert = "data" or "branch", a mixture of experts): one rule more, first,
("experts", (that axis,)). The experts' weights (w_gate, w_up, w_down) and their adapters are split
over the axis on their experts dimension and never gathered: the MoE layer sends the tokens to them
(`models.llama.moe_mlp`, `Gather.dispatch`); the router (w_router, whose last axis is "experts") is split
alike and all-gathered over the axis before use. The rule takes the axis, so the FSDP rules (all
axes) skip those leaves; every other parameter is laid out as without it.

An optimizer state gets its parameter's spec the same way: `tx.init` (and every `jax.tree_util`
map) keeps each parameter's nnx.Variable node, metadata included, so a moment of Adam, or of an
`optax.multi_transform` label (PPO's, LoRA's adapters), carries its parameter's logical names; a
bare array leaf (Adam's step count) is a scalar and is replicated. No path or attribute name is
read anywhere here.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from branch_replay_jax.models.llama import AXES_KEY, LOGICAL_AXES, Gather

MESH_AXES = ("data", "branch", "seq")
PARAM_MODES = ("replicated", "fsdp")
EXPERT_AXES = ("data", "branch")   # the mesh axes mesh.expert may name

LOGICAL_AXIS_RULES: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "replicated": (),
    "fsdp": tuple((name, MESH_AXES) for name in ("vocab", "mlp", "embed", "head_dim", "heads", "kv_heads",
                                                  "lora_rank", "conv_kernel", "experts", "ple")),
}


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def spec_of(names: tuple[str, ...], shape: tuple[int, ...], rules, mesh) -> P:
  """The PartitionSpec of a leaf of `shape` with logical axis names `names` under `rules` (the
  module docstring's order and fallback)."""
  spec, used = [None] * len(shape), set()
  for name, axes in rules:
    size = int(np.prod([mesh.shape[a] for a in axes]))
    for dim, n in enumerate(names):
      if n == name and spec[dim] is None and not used & set(axes) and shape[dim] % size == 0:
        spec[dim] = axes if len(axes) > 1 else axes[0]
        used |= set(axes)
        break
  while spec and spec[-1] is None:
    spec.pop()
  return P(*spec)


def _where(path) -> str:
  """'embed', 'policy.layers.wq', 'opt_state[0].mu.layers.wq': a leaf's path for messages only
  (never to decide a layout): dict keys dotted, other keys as `jax.tree_util.keystr` writes them."""
  parts = []
  for k in path:
    if isinstance(k, jax.tree_util.DictKey):
      parts.append(("." if parts else "") + str(k.key))
    elif not (isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value"):
      parts.append(jax.tree_util.keystr((k,)))
  return repr("".join(parts) or "the tree's root")


def axis_rules(mode: str = "replicated", expert: str = "") -> tuple:
  """The rules table of a parameter mode and, with `expert` ("data" or "branch"), expert parallelism over that
  axis (the module docstring).

  Raises:
    ValueError: a mode outside PARAM_MODES or an expert axis outside EXPERT_AXES.
  """
  if mode not in PARAM_MODES:
    raise ValueError(f"param_specs: mode={mode!r} is not one of {PARAM_MODES}")
  if expert and expert not in EXPERT_AXES:
    raise ValueError(f"mesh.expert={expert!r} is not one of {EXPERT_AXES} (or '' for none)")
  return ((("experts", (expert,)),) if expert else ()) + LOGICAL_AXIS_RULES[mode]


def param_specs(params, mesh, mode: str = "replicated", rules=None, *, expert: str = ""):
  """PartitionSpecs of parameters, or of an optimizer state shaped like them: each nnx.Variable's
  logical axis names (models.llama.annotated) through `rules` (default `axis_rules(mode, expert)`).
  The result has params' tree structure, nnx.Variable nodes included (their values are the specs).

  Raises:
    ValueError: a mode outside PARAM_MODES; with any rule to apply, a Variable without logical axis
      names, with names not one per dimension or outside LOGICAL_AXES, or an array of rank >= 1
      outside any Variable (the path of each is named).
  """
  rules = axis_rules(mode, expert) if rules is None else tuple(rules)
  unknown = [name for name, _ in rules if name not in LOGICAL_AXES]
  if unknown:
    raise ValueError(f"param_specs: rules name {unknown}, not logical axes of {LOGICAL_AXES}")

  def spec(path, x):
    if _is_variable(x) and not hasattr(x.get_value(), "shape"):
      return x   # no array: optax.multi_transform's MaskedNode for another label's parameter
    if not rules:
      return x.replace(P()) if _is_variable(x) else P()
    if not _is_variable(x):
      if np.ndim(x):
        raise ValueError(f"param_specs: the array {_where(path)} (shape {np.shape(x)}) is not an nnx.Variable, so "
                         "it has no logical axis names to shard it by (models.llama.annotated)")
      return P()
    names = x.get_metadata(AXES_KEY, None)
    if names is None:
      raise ValueError(f"param_specs: parameter {_where(path)} (shape {tuple(x.shape)}) carries no logical axis "
                       f"names: create it with models.llama.annotated(value, names), names of {LOGICAL_AXES}")
    if len(names) != len(x.shape) or any(n not in LOGICAL_AXES for n in names):
      raise ValueError(f"param_specs: parameter {_where(path)} of shape {tuple(x.shape)} has logical axis names "
                       f"{names}: need one per dimension, each one of {LOGICAL_AXES}")
    return x.replace(spec_of(tuple(names), tuple(x.shape), rules, mesh))
  return jax.tree_util.tree_map_with_path(spec, params, is_leaf=_is_variable)


def shard_params(params, mesh, mode: str = "replicated", rules=None, *, expert: str = ""):
  """Place parameters (or an optimizer state shaped like them) with `param_specs`, from a whole
  copy in this process (with several processes, each process's own identical copy, e.g. the
  initialised or restored state: each places its devices' shards from it, no cross-host copy)."""
  def place(x, spec):
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec), lambda index: host[index])
  specs = jax.tree_util.tree_leaves(param_specs(params, mesh, mode, rules, expert=expert),
                                    is_leaf=lambda s: isinstance(s, P))
  leaves, treedef = jax.tree_util.tree_flatten(params)
  assert len(leaves) == len(specs), (len(leaves), len(specs))
  return jax.tree_util.tree_unflatten(treedef, [place(x, s) for x, s in zip(leaves, specs)])


def gathers(params) -> list:
  """[one per nnx.Variable (or bare array) of params, in `jax.tree_util.tree_leaves(params,
  is_leaf=nnx.Variable)` order]: None for a replicated leaf, else its `models.llama.Gather`: the
  dimension split over all of MESH_AXES (FSDP: the mesh step all-gathers it just before use), or the
  "experts" dimension split over one of EXPERT_AXES (expert parallelism: an array per expert, whose experts
  axis is not its last (the experts' weights and their adapters), is dispatched to, `Gather.dispatch`; the
  router, whose last axis is the experts, is all-gathered over that axis).

  Raises:
    ValueError: a leaf sharded otherwise (over some mesh axes only, on several dimensions, on a
      "layers" dimension, or a bare array, which has no Variable metadata for the model to read
      its gather from), naming its path and spec: the step gathers only `param_specs`'s layouts.
  """
  out = []
  for path, x in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_variable)[0]:
    value = x[...] if _is_variable(x) else x
    spec = tuple(jax.typeof(value).sharding.spec)
    split = [(d, a if isinstance(a, tuple) else (a,)) for d, a in enumerate(spec) if a is not None]
    names = x.get_metadata(AXES_KEY, None) if _is_variable(x) else None
    if not split:
      out.append(None)
    elif len(split) == 1 and split[0][1] == MESH_AXES and names is not None and names[split[0][0]] != "layers":
      out.append(Gather(split[0][0], MESH_AXES))
    elif (len(split) == 1 and len(split[0][1]) == 1 and split[0][1][0] in EXPERT_AXES and names is not None
          and names[split[0][0]] == "experts"):   # an array per expert (experts not its last axis) is dispatched to
      out.append(Gather(split[0][0], split[0][1], dispatch=names[-1] != "experts"))
    else:
      raise ValueError(f"parameter {_where(path)} has spec {spec}: the mesh step takes parameters replicated (P()) "
                       f"or, as annotated nnx.Variables, split on one dimension other than 'layers' over all of "
                       f"{MESH_AXES} (param_specs(..., 'fsdp')), or on 'experts' over one of {EXPERT_AXES} "
                       "(param_specs(..., expert=...))")
  return out
