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

Parameters are replicated or FSDP-sharded (Rajbhandari et al. 2020, ZeRO stage 3, arXiv
1910.02054) by annotation: each nnx.Param carries logical axis names and one rules table maps them
to mesh axes (distributed/sharding.py: `param_specs`, `shard_params`; re-exported here). FSDP
splits one logical dimension of each leaf over all devices (never "layers"), and the step keeps
them split: the shards enter the `shard_map` as they are, each shard's Variable is marked with the
dimension to all-gather (static metadata `models.llama.Gather`, from its spec: the gather is passed
explicitly, in the parameters the model reads), and the model all-gathers each parameter just
before use (`models.llama.param_value`), a layer's weights inside the layer scan, where remat
drops them again (they are gathered anew in the backward pass). The all-gather's transpose reduce-scatters
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

from flax import nnx

from branch_replay_jax.data.batches import RolloutBatch, is_group
from branch_replay_jax.distributed.sharding import (MESH_AXES, PARAM_MODES, gathers, param_specs,  # noqa: F401
                                                    shard_params)
from branch_replay_jax.kernels.vma import varying_axes
from branch_replay_jax.models.llama import GATHER_KEY


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


def stack_groups(groups: list[RolloutBatch]) -> RolloutBatch:
  """Stack groups (or trees) of equal shapes on a leading axis [B, ...].

  Raises:
    ValueError: groups whose shapes differ (bucket them to the same prompt/completion lengths).
  """
  shapes = {str(jax.tree_util.tree_map(np.shape, g)) for g in groups}
  if len(shapes) != 1:
    raise ValueError(f"stack_groups: {len(groups)} groups have {len(shapes)} different shapes; pad them to "
                     "common prompt_bucket / completion_bucket lengths")
  return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *groups)


def pad_prompts(groups: list[RolloutBatch], multiple: int = 1, *,
                longest: int | None = None) -> list[RolloutBatch]:
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
  def pad(g):
    more = p_pad - g.prompt_ids.shape[0]
    routes = getattr(g, "prompt_routes", None)   # a RolloutBatch's recorded routes: -1 (none) on the padding
    extra = {} if routes is None else {"prompt_routes": jnp.pad(routes, ((0, more), (0, 0), (0, 0)), constant_values=-1)}
    return g.replace(prompt_ids=jnp.pad(g.prompt_ids, (0, more)), **extra)
  return [pad(g) for g in groups]


def pad_groups(groups: list[RolloutBatch], mesh=None) -> tuple[list[RolloutBatch], np.ndarray]:
  """Ragged groups (different G_j completions of different lengths T_j: DPO's one group per
  distinct prompt, a naive step's tree trajectories) padded so that `stack_groups` stacks them and
  `shard_batch` splits them on mesh (mesh None: one device, every mesh size 1):
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
  sizes = {"data": 1, "branch": 1, "seq": 1} if mesh is None else mesh.shape
  g_pad = -(-max(g.branches.tokens.shape[0] for g in groups) // sizes["branch"]) * sizes["branch"]
  t_pad = max(g.branches.tokens.shape[1] for g in groups)

  def pad_branches(batch: RolloutBatch, keep: bool) -> RolloutBatch:
    def pad(x):   # a branches field: [G_j] per completion or [G_j, T_j, ...] per token
      widths = [(0, g_pad - x.shape[0])] + ([(0, t_pad - x.shape[1])] if x.ndim > 1 else []) + [(0, 0)] * (x.ndim - 2)
      return jnp.pad(x if keep else jnp.zeros_like(x), widths)
    return batch.replace(levels=(jax.tree_util.tree_map(pad, batch.branches),))

  padded = [pad_branches(g, True) for g in pad_prompts(groups, sizes["seq"])]
  padded += [pad_branches(padded[0], False)] * (-len(padded) % sizes["data"])
  flat_index = np.concatenate([j * g_pad + np.arange(g.branches.tokens.shape[0]) for j, g in enumerate(groups)])
  return padded, flat_index


def batch_specs(batch: RolloutBatch, mesh):
  """PartitionSpecs of a stacked batch: prompt_ids [B, P_pad] and prompt_routes [B, P_pad, layers, k]
  P("data", "seq"); completions
  (branches [B, G, ...]) and tree levels (levels [B, F_1, ...]) P("data", "branch"); the rest P("data").

  Raises:
    ValueError: B, G (F_1) or P_pad not divisible by the data, branch or seq size.
  """
  def spec(path, x):
    keys = [getattr(k, "name", getattr(k, "key", None)) for k in path]
    if "levels" in keys:   # a group's rows (its one level, `RolloutBatch.branches`) or a tree's levels
      name, s = "branches" if is_group(batch) else "levels", P("data", "branch")
    elif "prompt_ids" in keys or "prompt_routes" in keys:
      name, s = keys[-1], P("data", "seq")
    else:
      name, s = keys[-1], P("data")
    for dim, axis in enumerate(s):
      if x.shape[dim] % mesh.shape[axis]:
        raise ValueError(f"batch.{name}: axis {dim} has size {x.shape[dim]}, not divisible by "
                         f"{axis}={mesh.shape[axis]}")
    return s
  return jax.tree_util.tree_map_with_path(spec, batch)


def shard_batch(batch: RolloutBatch, mesh, num_groups: int | None = None) -> RolloutBatch:
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


def _invariant_over_seq(tree):
  """Every `seq` device holds the same completion values (module docstring): mark them invariant
  over `seq` (pmax of equal values is exact) so that out_specs may omit the axis."""
  return jax.tree_util.tree_map(lambda x: jax.lax.pmax(x, "seq") if "seq" in varying_axes(x) else x, tree)


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def unsummed_axes(gather) -> tuple[str, ...]:
  """The mesh axes a parameter's gradient still has to be summed over inside the mesh step: all of them for a
  replicated one (None), the others for one split over some (its gather's transpose, or the token dispatch's,
  already summed over its own)."""
  return tuple(a for a in MESH_AXES if gather is None or a not in gather.axes)


def _over_mesh(per_device, params, batch, mesh, out_specs):
  """`shard_map` of per_device(local params, this device's part of the batch, gathers) on `mesh`.

  Replicated parameters enter whole (P()) and are cast to varying over every mesh axis inside:
  their gradients then stay per-device until an explicit psum (no implicit one; module docstring),
  and the layer scan's carry keeps one type while mixing the prompt (varying over `seq`) with the
  completions (varying over `branch`). FSDP parameters enter as this device's shard (already
  varying), and each one's nnx.Variable gets the static metadata GATHER_KEY = its `Gather`
  (`sharding.gathers`, from its spec): the model then all-gathers it just before use
  (`models.llama.param_value`; a layer's slice inside the layer scan), so no device holds more than
  one layer's gathered weights beyond the embedding; the all-gather's transpose reduce-scatters
  their gradients, already summed over the gather's axes. Expert parallelism's leaves (split over one
  axis, mesh.expert) enter as this device's shard too, cast to varying over the other axes; an expert
  weight is never gathered (`Gather.dispatch`), the tokens are sent to it. per_device gets `gathers`
  (`sharding.gathers`'s list, in the order of `_leaves`): its caller sums a gradient over the axes its
  gather did not already sum over (`unsummed_axes`; psum on top would be the over-count trap,
  docs/design.md "Pitfalls"), and must hand back gradients in params' own tree structure (without
  the Gather metadata), which the out_specs are.
  """
  split = gathers(params)
  specs = jax.tree_util.tree_map(lambda x: jax.typeof(x).sharding.spec, params)

  def local(x, gather):
    cast = lambda v: jax.lax.pcast(v, unsummed_axes(gather), to="varying") if unsummed_axes(gather) else v
    if gather is not None:
      return x.copy(cast(x[...]), **{GATHER_KEY: gather})
    return x.copy(cast(x[...])) if _is_variable(x) else cast(x)

  def body(params, batch):
    leaves, treedef = jax.tree_util.tree_flatten(params, is_leaf=_is_variable)
    return per_device(jax.tree_util.tree_unflatten(treedef, [local(x, g) for x, g in zip(leaves, split)]), batch,
                      split)
  return jax.shard_map(body, mesh=mesh, in_specs=(specs, batch_specs(batch, mesh)),
                       out_specs=out_specs(specs) if callable(out_specs) else out_specs, check_vma=True)(params, batch)


def _leaves(tree) -> list:
  """tree's nnx.Variables (or bare arrays), the order of `sharding.gathers`."""
  return jax.tree_util.tree_leaves(tree, is_leaf=_is_variable)


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

  treedef = jax.tree_util.tree_structure(params)   # without the gather metadata `_over_mesh` adds

  def per_device(local, batch, split):   # split: params' leaves' gathers first, then frozen's (`_leaves` order)
    local, extra = (local, {}) if frozen is None else (local[0], {"frozen": local[1]})

    def one_group(carry, batch):
      loss, aux, grads = per_group(local, batch, reduce_prompt_cotangent, **extra)
      return (carry[0] + loss, jax.tree_util.tree_map(jnp.add, carry[1], grads)), aux

    zeros = jax.tree_util.tree_map(jnp.zeros_like, local)
    leaf = jax.tree_util.tree_leaves(local)[0]   # varying over the mesh, like the losses
    loss0 = jnp.zeros_like(leaf, shape=(), dtype=jnp.promote_types(leaf.dtype, jnp.float32))
    (loss, grads), aux = jax.lax.scan(one_group, (loss0, zeros), batch)
    loss = jax.lax.psum(loss, MESH_AXES)
    # A gathered (FSDP) parameter's gradient left the backward reduce-scattered, summed over the gather's
    # axes already: a psum over them on top would count it that many times.
    grads = [jax.tree_util.tree_map(lambda x: jax.lax.psum(x, unsummed_axes(gather)), g) if unsummed_axes(gather)
             else g for g, gather in zip(_leaves(grads), split)]
    grads = jax.tree_util.tree_unflatten(treedef, jax.tree_util.tree_leaves(grads))
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
  def per_device(local, batch, split):
    del split
    local, extra = (local, {}) if frozen is None else (local[0], {"frozen": local[1]})
    return _invariant_over_seq(jax.lax.scan(lambda _, one: (None, per_group(local, one, **extra)), None, batch)[1])
  return _over_mesh(per_device, params if frozen is None else (params, frozen), batch, mesh,
                    out_specs=P("data", "branch"))
