"""Branch replay on a device mesh with `jax.shard_map`: groups over `data`, branches over `branch`,
the prompt over `seq`.

Mesh axes ("data", "branch", "seq"), every axis type Explicit (`jax.sharding.AxisType`):

    data   : a batch of B rollout groups (or trees) is split over devices (B % data == 0);
    branch : each group's G completions (a tree's first-level subtrees) are split over devices
             (G % branch == 0); every device runs the prompt's forward (replicated over `branch`)
             and its own completions; the prompt's cotangent is all-reduced over `branch` once,
             before the single prompt pullback;
    seq    : the padded prompt's P_pad tokens are split over devices (P_pad % seq == 0), context
             parallelism: see seq_parallel.py and kernels/context_parallel.py. Completions are
             replicated over `seq`.

Gradients are all-reduced once per step. The trap (jax-ml/jax #3970; docs/design.md, "Pitfalls"): with
`check_vma=True`, differentiating inside `shard_map` with respect to a replicated (invariant)
input already psums the gradient over the axes the computation varies on, and a hand-written
psum on top over-counts by the device count. Here the parameters are first cast to "varying"
(`jax.lax.pcast(..., to="varying")`), so the gradients stay per-device until the one explicit
psum. The prompt cotangent is divided by the branch count after its all-reduce: every branch
device then pulls back 1/n of it, and the final psum over `branch` adds the n identical
shares back to one (exact for power-of-two n, one rounding otherwise). With seq = S > 1 every
`seq` device computes the whole loss (the completions are replicated and see the whole prompt
through the log-sum-exp merge), so the psum over the mesh is S times the gradient: divided by S.

What runs per group is the caller's: `gradients.step.value_and_grad` and `forward` (every head and
layout) wrap themselves in `mesh_value_and_grad` / `mesh_map`; this module knows no model output and
no algorithm. Batches of groups are padded to one prompt length (`pad_prompts`) and stacked; ragged
groups (DPO's) to one shape (`pad_groups`, zero-weight padding); sampled trees to one level layout
first (`data.batches.pad_trees`).

Parameters are replicated or FSDP-sharded (`param_specs`; Rajbhandari et al. 2020, ZeRO stage 3,
arXiv 1910.02054). FSDP splits each leaf's largest evenly divisible dimension (never a stacked
layer parameter's layer axis) over all devices, and the step keeps them split: the shards enter
the `shard_map` as they are, and the model all-gathers each parameter just before use
(`models.llama.param_gather`), a layer's weights inside the layer scan, where remat drops them
again (they are gathered anew in the backward pass). The all-gather's transpose reduce-scatters
the gradient, which leaves the step in the FSDP layout, summed over the mesh: no device holds a
full parameter copy or a full gradient, only one layer's gathered weights at a time beyond the
embedding / output projection. The optimizer state follows the parameters' shardings. The
explicit psum is then skipped for gathered parameters (a second sum is the over-count trap).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from branch_replay_jax.data.batches import GroupBatch, TreeBatch
from branch_replay_jax.models.critic import TRUNKS
from branch_replay_jax.models.llama import param_gather

MESH_AXES = ("data", "branch", "seq")
PARAM_MODES = ("replicated", "fsdp")


def make_mesh(data: int, branch: int, seq: int = 1, devices=None) -> jax.sharding.Mesh:
  """A ("data", "branch", "seq") mesh with Explicit axis types over `devices` (default: all).

  Raises:
    ValueError: a size < 1, or a product that is not the device count.
  """
  devices = jax.devices() if devices is None else devices
  sizes = {"data": data, "branch": branch, "seq": seq}
  for name, size in sizes.items():
    if not isinstance(size, int) or size < 1:
      raise ValueError(f"make_mesh: {name}={size!r} must be a positive int")
  if data * branch * seq != len(devices):
    raise ValueError(f"make_mesh: data x branch x seq = {data} x {branch} x {seq} = {data * branch * seq} "
                     f"must equal the device count {len(devices)}")
  return jax.make_mesh((data, branch, seq), MESH_AXES, axis_types=(AxisType.Explicit,) * 3, devices=devices)


def stack_groups(groups: list[GroupBatch | TreeBatch]) -> GroupBatch | TreeBatch:
  """Stack GroupBatches (or TreeBatches) of equal shapes on a leading axis [B, ...].

  Raises:
    ValueError: groups whose shapes differ (bucket them to the same prompt/completion lengths).
  """
  shapes = {str(jax.tree_util.tree_map(np.shape, g)) for g in groups}
  if len(shapes) != 1:
    raise ValueError(f"stack_groups: {len(groups)} groups have {len(shapes)} different shapes; pad them to "
                     "common prompt_bucket / completion_bucket lengths")
  return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *groups)


def pad_prompts(groups: list[GroupBatch | TreeBatch], multiple: int = 1, *,
                longest: int | None = None) -> list[GroupBatch | TreeBatch]:
  """Right-pad every group's (or tree's) prompt_ids [P_pad] with token 0 to one length: the
  longest P_pad (or `longest`, when given: the longest over all processes' groups), rounded up
  to a multiple of `multiple` (the mesh's `seq` size), so that
  `stack_groups` can stack them. Positions at or after prompt_len are masked out of attention and
  never scored, so each group's loss and gradient are unchanged (only the padding compute grows).

  Raises:
    ValueError: no groups, or multiple < 1.
  """
  if not groups or multiple < 1:
    raise ValueError(f"pad_prompts: need at least one group and multiple >= 1, got {len(groups)} groups, "
                     f"multiple={multiple}")
  longest = max([g.prompt_ids.shape[0] for g in groups] + [longest or 0])
  p_pad = -(-longest // multiple) * multiple
  return [g.replace(prompt_ids=jnp.pad(g.prompt_ids, (0, p_pad - g.prompt_ids.shape[0]))) for g in groups]


def pad_groups(groups: list[GroupBatch], mesh) -> tuple[list[GroupBatch], np.ndarray]:
  """Ragged groups (different G_j completions of different lengths T_j: DPO's one group per
  distinct prompt) padded so that `stack_groups` stacks them and `shard_batch` splits them on mesh:
  prompts as `pad_prompts` (to a multiple of mesh.seq); every group to G' branches, the largest
  G_j rounded up to a multiple of mesh.branch, and T' tokens, the largest T_j; the group count to a
  multiple of mesh.data with filler groups (group 0's prompt, every branch padding).

  A padding branch (and a padding token) has mask False and every loss field 0 (tokens: id 0): its
  log-probs are 0 (the replay functions zero them off the mask), so its log-prob sum is 0, its
  loss weight is 0 and its log-prob cotangent is 0, so its gradient contribution is exactly 0, and
  a filler group's prompt gets a zero cotangent and pulls back zeros. The step's loss and
  gradient are unchanged; only the padding's compute is added.

  Returns:
    (padded groups, flat_index [N] int): N = Σ_j G_j; flat_index[i] is the position of the i-th
    completion of the concatenation of the groups' branches (group 0's first) in the padded
    groups' concatenation, i.e. j * G' + g.

  Raises:
    ValueError: no groups.
  """
  if not groups:
    raise ValueError("pad_groups: need at least one group")
  g_pad = -(-max(g.branches.tokens.shape[0] for g in groups) // mesh.shape["branch"]) * mesh.shape["branch"]
  t_pad = max(g.branches.tokens.shape[1] for g in groups)

  def pad_branches(batch: GroupBatch, keep: bool) -> GroupBatch:
    def pad(x):   # a branches field: [G_j] per completion or [G_j, T_j, ...] per token
      widths = [(0, g_pad - x.shape[0])] + [(0, t_pad - x.shape[1])] * (x.ndim > 1) + [(0, 0)] * (x.ndim - 2)
      return jnp.pad(x if keep else jnp.zeros_like(x), widths)
    return batch.replace(branches=jax.tree_util.tree_map(pad, batch.branches))

  padded = [pad_branches(g, True) for g in pad_prompts(groups, mesh.shape["seq"])]
  padded += [pad_branches(padded[0], False)] * (-len(padded) % mesh.shape["data"])
  flat_index = np.concatenate([j * g_pad + np.arange(g.branches.tokens.shape[0]) for j, g in enumerate(groups)])
  return padded, flat_index


def batch_specs(batch: GroupBatch | TreeBatch, mesh):
  """PartitionSpecs of a stacked batch: prompt_ids [B, P_pad] P("data", "seq"); completions
  (branches [B, G, ...]) and tree levels (levels [B, F_1, ...]) P("data", "branch"); the rest P("data").

  Raises:
    ValueError: B, G (F_1) or P_pad not divisible by the data, branch or seq size.
  """
  def spec(path, x):
    keys = [getattr(k, "name", getattr(k, "key", None)) for k in path]
    if "branches" in keys or "levels" in keys:
      name, s = "branches" if "branches" in keys else "levels", P("data", "branch")
    elif "prompt_ids" in keys:
      name, s = "prompt_ids", P("data", "seq")
    else:
      name, s = keys[-1], P("data")
    for dim, axis in enumerate(s):
      if x.shape[dim] % mesh.shape[axis]:
        raise ValueError(f"batch.{name}: axis {dim} has size {x.shape[dim]}, not divisible by "
                         f"{axis}={mesh.shape[axis]}")
    return s
  return jax.tree_util.tree_map_with_path(spec, batch)


def shard_batch(batch: GroupBatch | TreeBatch, mesh, num_groups: int | None = None) -> GroupBatch | TreeBatch:
  """Place a stacked batch on `mesh` with `batch_specs`.

  With several processes (distributed/hosts.py) `batch` holds this process's groups [B_local, ...]
  (those of its `data` rows, in order) and `num_groups` the step's B: each process passes its own
  part of one global batch (`jax.make_array_from_process_local_data`). One process, or
  `num_groups` None: `batch` is the whole batch (the same on every process; each places its rows).
  """
  num_groups = num_groups or jax.tree_util.tree_leaves(batch)[0].shape[0]
  shape = lambda x: (num_groups,) + tuple(x.shape[1:])
  specs = batch_specs(jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(shape(x), x.dtype), batch), mesh)
  return jax.tree_util.tree_map(
      lambda x, s: jax.make_array_from_process_local_data(NamedSharding(mesh, s), np.asarray(x), shape(x)),
      batch, specs)


def _leaf_name(path) -> str:
  """"embed", "layers.wq", "policy.layers.wq", ...: a parameter's dotted name from its nnx.State
  path: the trailing run of dict keys (the Variable's own `.value` attribute is not part of the
  name), so that an optimizer state's moments get their parameter's name, also inside
  `optax.multi_transform`'s dict of per-label states (PPO's)."""
  keys = list(path)
  if keys and isinstance(keys[-1], jax.tree_util.GetAttrKey) and keys[-1].name == "value":
    keys = keys[:-1]
  names = []
  for k in reversed(keys):
    if not isinstance(k, jax.tree_util.DictKey):
      break
    names.append(str(k.key))
  return ".".join(reversed(names))


def _read_name(name: str) -> str:
  """The name the model reads a parameter under (`models.llama.read_param`): its dotted name less an
  actor-critic's trunk prefix ("policy.layers.wq" -> "layers.wq"; models.critic.TRUNKS)."""
  head, _, rest = name.partition(".")
  return rest if head in TRUNKS and rest else name


def param_specs(params, mesh, mode: str = "replicated"):
  """PartitionSpecs of the parameters: P() for "replicated"; for "fsdp" each leaf's largest
  dimension divisible by the device count is split over all mesh axes (P() when none is). A
  stacked layer parameter [L, ...] is never split on its layer axis: the layer scan then slices
  each layer's shard and all-gathers it just before use (`_over_mesh`).

  Raises:
    ValueError: for a mode outside PARAM_MODES.
  """
  if mode not in PARAM_MODES:
    raise ValueError(f"param_specs: mode={mode!r} is not one of {PARAM_MODES}")
  n = mesh.size

  def spec(path, x):
    if mode == "replicated":
      return P()
    first = 1 if _read_name(_leaf_name(path)).startswith("layers.") else 0
    for dim in sorted(range(first, x.ndim), key=lambda i: -x.shape[i]):
      if x.shape[dim] % n == 0:
        return P(*([None] * dim), MESH_AXES)
    return P()
  return jax.tree_util.tree_map_with_path(spec, params)


def _sharded_dims(params) -> dict[str, int | None]:
  """name -> the dimension of the parameter split over all mesh axes (FSDP), or None when replicated.

  Raises:
    ValueError: a parameter sharded otherwise (over some axes only, or over several dimensions),
      naming it and its spec: the step gathers only `param_specs`'s layouts.
  """
  dims = {}
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    name, spec = _leaf_name(path), tuple(jax.typeof(x).sharding.spec)
    split = [(d, a) for d, a in enumerate(spec) if a is not None]
    if not split:
      dims[name] = None
    elif len(split) == 1 and tuple(split[0][1] if isinstance(split[0][1], tuple) else (split[0][1],)) == MESH_AXES:
      if _read_name(name).startswith("layers.") and split[0][0] == 0:
        raise ValueError(f"parameter {name!r} is split on its layer axis (spec {spec}); use param_specs")
      dims[name] = split[0][0]
    else:
      raise ValueError(f"parameter {name!r} has spec {spec}: the mesh step takes parameters replicated (P()) or "
                       f"split on one dimension over all of {MESH_AXES} (param_specs(..., 'fsdp'))")
  return dims


def shard_params(params, mesh, mode: str = "replicated"):
  """Place parameters (or an optimizer state shaped like them) with `param_specs`, from a whole
  copy in this process (with several processes, each process's own identical copy, e.g. the
  initialised or restored state: each places its devices' shards from it, no cross-host copy)."""
  def place(x, spec):
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec), lambda index: host[index])
  return jax.tree_util.tree_map(place, params, param_specs(params, mesh, mode))


def _invariant_over_seq(tree):
  """Every `seq` device holds the same completion values (module docstring): mark them invariant
  over `seq` (pmax of equal values is exact) so that out_specs may omit the axis."""
  def varying(x):   # the value's varying manual axes (`.vma` in older JAX releases)
    aval = jax.typeof(x)
    return aval.vma if hasattr(aval, "vma") else aval.manual_axis_type.varying
  return jax.tree_util.tree_map(lambda x: jax.lax.pmax(x, "seq") if "seq" in varying(x) else x, tree)


def _over_mesh(per_device, params, batch, mesh, out_specs):
  """`shard_map` of per_device(local params, this device's part of the batch) on `mesh`.

  Replicated parameters enter whole (P()) and are cast to varying over every mesh axis inside:
  their gradients then stay per-device until an explicit psum (no implicit one; module docstring),
  and the layer scan's carry keeps one type while mixing the prompt (varying over `seq`) with the
  completions (varying over `branch`). FSDP parameters enter as this device's shard (already
  varying) and the model all-gathers each one just before use (`models.llama.param_gather`):
  inside the layer scan for layer weights, so no device holds more than one layer's gathered
  weights beyond the embedding; the all-gather's transpose reduce-scatters their gradients,
  already summed over the mesh. per_device gets `fsdp`, the set of gathered names (its caller
  must not psum their gradients again: the over-count trap, docs/design.md "Pitfalls").
  """
  dims = _sharded_dims(params)
  specs = jax.tree_util.tree_map(lambda x: jax.typeof(x).sharding.spec, params)
  read_dims = {}   # by the name the model reads (an actor-critic's two trunks share their layouts)
  for name, dim in dims.items():
    if read_dims.setdefault(_read_name(name), dim) != dim:
      raise ValueError(f"parameter {name!r} is split on dimension {dim}, its namesake in the other trunk on "
                       f"{read_dims[_read_name(name)]}: use param_specs")

  def gather(name, x):
    dim = read_dims[name]
    if dim is None:
      return x
    axis = dim - 1 if name.startswith("layers.") else dim   # inside the scan: the layer axis is gone
    return jax.lax.all_gather(x, MESH_AXES, axis=axis, tiled=True)

  fsdp = {name for name, dim in dims.items() if dim is not None}

  def body(params, batch):
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x if _leaf_name(path) in fsdp else jax.lax.pcast(x, MESH_AXES, to="varying"), params)
    with param_gather(gather):
      return per_device(params, batch, fsdp)
  return jax.shard_map(body, mesh=mesh, in_specs=(specs, batch_specs(batch, mesh)),
                       out_specs=out_specs(specs) if callable(out_specs) else out_specs, check_vma=True)(params, batch)


def mesh_value_and_grad(per_group, params, batch, mesh, frozen=None):
  """Σ over the batch of per_group(local params, one group's batch, reduce) under shard_map (the one
  mesh wrapper of `gradients.step.value_and_grad`).

  per_group returns (loss, aux, grads) of one group on this device, aux with a leading G (or F_1)
  axis; reduce is the prompt-cotangent all-reduce over `branch`. Returns (loss replicated, aux
  [B, G, ...] sharded P("data", "branch"), grads resharded like `params`). frozen: parameters read
  but not differentiated (LoRA's base, `models.lora.WithBase`), placed and gathered like `params`
  (replicated or FSDP) and passed as per_group(..., frozen=this device's frozen); no gradient.
  """
  n_branch, n_seq = mesh.shape["branch"], mesh.shape["seq"]

  def reduce_prompt_cotangent(cotangent):
    # psum makes the cotangent invariant over `branch`; the pullback expects the prompt output's
    # own type (varying over `branch`), so cast back.
    return jax.tree_util.tree_map(
        lambda c: jax.lax.pcast(jax.lax.psum(c, "branch") / n_branch, "branch", to="varying"), cotangent)

  def per_device(local, batch, fsdp):
    local, extra = (local, {}) if frozen is None else (local[0], {"frozen": local[1]})

    def one_group(carry, batch):
      loss, aux, grads = per_group(local, batch, reduce_prompt_cotangent, **extra)
      return (carry[0] + loss, jax.tree_util.tree_map(jnp.add, carry[1], grads)), aux

    zeros = jax.tree_util.tree_map(jnp.zeros_like, local)
    leaf = jax.tree_util.tree_leaves(local)[0]   # varying over the mesh, like the losses
    loss0 = jnp.zeros_like(leaf, shape=(), dtype=jnp.promote_types(leaf.dtype, jnp.float32))
    (loss, grads), aux = jax.lax.scan(one_group, (loss0, zeros), batch)
    loss = jax.lax.psum(loss, MESH_AXES)
    # A gathered (FSDP) parameter's gradient left the backward reduce-scattered, summed over the
    # mesh already: a psum on top would count it mesh.size times.
    grads = jax.tree_util.tree_map_with_path(
        lambda path, g: g if _leaf_name(path) in fsdp else jax.lax.psum(g, MESH_AXES), grads)
    if n_seq > 1:   # every seq device computed the whole loss (module docstring)
      loss, grads = loss / n_seq, jax.tree_util.tree_map(lambda g: g / n_seq, grads)
    return loss, _invariant_over_seq(aux), grads

  tree = params if frozen is None else (params, frozen)
  return _over_mesh(per_device, tree, batch, mesh,
                    out_specs=lambda specs: (P(), P("data", "branch"), specs if frozen is None else specs[0]))


def mesh_map(per_group, params, batch, mesh, frozen=None):
  """Forward-only `shard_map` of per_group(local params, one group's or tree's batch) over a stacked
  batch (the forward twin of `mesh_value_and_grad`, `frozen` as there). Returns its outputs stacked
  [B, G (F_1), ...], sharded P("data", "branch")."""
  def per_device(local, batch, fsdp):
    del fsdp
    local, extra = (local, {}) if frozen is None else (local[0], {"frozen": local[1]})
    return _invariant_over_seq(jax.lax.scan(lambda _, one: (None, per_group(local, one, **extra)), None, batch)[1])
  return _over_mesh(per_device, params if frozen is None else (params, frozen), batch, mesh,
                    out_specs=P("data", "branch"))
