"""Where an algorithm's steps run: one device (mesh None) or config.mesh's ("data", "branch", "seq")
mesh (`mesh_from`). Parameters and optimizer state onto the mesh (`place`), the devices that sample
a step's groups (`sampling_devices`) or independent items (`spread_devices`), the sampler's policy
on them (`sampling_policy`), a step's batch on the mesh (`on_mesh`) or stacked on one device
(`stack_on_device`) and the mesh context its steps run in (`mesh_context`); unchanged or None
without a mesh."""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import jax
from flax import nnx

from branch_replay_jax.algorithms import schema
from branch_replay_jax.data.batches import RolloutBatch, is_tree, pad_trees
from branch_replay_jax.distributed import hosts
from branch_replay_jax.distributed.mesh import (make_mesh, pad_groups, pad_prompts, shard_batch, shard_params,
                                               stack_groups)


def mesh_from(config):
  """The ("data", "branch", "seq") mesh of config.mesh, or None for 1 x 1 x 1 (one device: the first).
  With mesh.rollout_devices r > 0 the mesh takes the devices `rollout_devices` leaves (each process's first).

  Raises:
    ValueError: with several processes, a `data` row spanning processes (hosts.check_rows_local).
  """
  m = config.mesh
  n = m.data * m.branch * m.seq
  if n == 1:
    return None
  rollout = set(rollout_devices(config))
  mesh = make_mesh(m.data, m.branch, m.seq, devices=[d for d in jax.devices() if d not in rollout] if rollout else None)
  if jax.process_count() > 1:
    hosts.check_rows_local(mesh)
  return mesh


class ParamLayout(NamedTuple):
  """How parameters lie on the mesh: mode (mesh.params: "replicated" or "fsdp") and expert, the axis a mixture
  of experts' experts are split over (mesh.expert; "": none)."""
  mode: str
  expert: str = ""


def param_layout(config) -> ParamLayout:
  """config.mesh's `ParamLayout`."""
  return ParamLayout(config.mesh.params, expert_axis(config))


def expert_axis(config) -> str:
  """mesh.expert, its schema default ("") when the experiment leaves it out."""
  return config.mesh.get("expert", schema.defaults(schema.MeshConfig)["expert"]) if "mesh" in config else ""


def place(tree, mesh, layout: ParamLayout):
  """Parameters or optimizer state onto `mesh` in `layout` (distributed.mesh.shard_params); unchanged without a
  mesh."""
  return tree if mesh is None else shard_params(tree, mesh, layout.mode, expert=layout.expert)


def rollout_device_count(config) -> int:
  """mesh.rollout_devices, its schema default (0) when the experiment leaves it out."""
  return config.mesh.get("rollout_devices", schema.defaults(schema.MeshConfig)["rollout_devices"])


def rollout_devices(config) -> list:
  """The rollout sub-mesh ([] for mesh.rollout_devices = 0): the last r / (process count) devices of each
  process, process 0's first (one process: the last r devices). Each process then samples its groups on
  devices of its own, from a parameter copy of its own training devices, and no parameters cross processes
  (`sampling_policy`). Validated by `checks.validate_mesh_shape` (r a multiple of the process count)."""
  r = rollout_device_count(config)
  if not r:
    return []
  per_process: dict[int, list] = {}
  for device in jax.devices():
    per_process.setdefault(device.process_index, []).append(device)
  share = r // len(per_process)
  return [d for process in sorted(per_process) for d in per_process[process][len(per_process[process]) - share:]]


def sampling_devices(mesh, num_groups: int, rollout=()):
  """[num_groups] the device that samples each of a step's groups: None without a mesh (every group samples
  on this process's default device), else on its `data` row of the mesh (`hosts.sampling_devices`); with
  `rollout` devices (the rollout sub-mesh) on one of them in the process that holds that row, a process's
  k-th group on its k-th rollout device (mod their number; one process: group i on rollout[i mod r]), so
  that each process samples the groups it places on the mesh (`GRPOFunctions.units`)."""
  if not rollout:
    return None if mesh is None else hosts.sampling_devices(mesh, num_groups)
  owners = [0] * num_groups if mesh is None else [d.process_index for d in hosts.sampling_devices(mesh, num_groups)]
  own = {p: [d for d in rollout if d.process_index == p] for p in set(owners)}
  taken = dict.fromkeys(own, 0)
  devices = []
  for p in owners:
    devices.append(own[p][taken[p] % len(own[p])])
    taken[p] += 1
  return devices


def spread_devices(mesh, num_items: int):
  """None without a mesh, else [num_items] the device of each of independent items (held-out
  problems, DPO's prompts): `hosts.spread_devices`, every device of the mesh, the processes in turn."""
  return None if mesh is None else hosts.spread_devices(mesh, num_items)


def sampling_policy(graphdef, params, mesh, devices, select=None, frozen=None):
  """The policy the sampler runs, from `params` as the update holds them (cast by the caller):
  without `devices`, the model nnx.merge(graphdef, params) where the parameters lie; with
  `devices` ([n] from `sampling_devices` or `eval_devices`, on `mesh`), {device: the model on a
  full copy of the parameters on that device} for this process's devices (`hosts.device_copies`:
  FSDP parameters all-gathered once, a collective every process joins); a device outside the mesh (the
  rollout sub-mesh, `rollout_devices`) gets its copy by `jax.device_put` from a training device of its
  process. `select` picks the module that samples out of the merged one (PPO: the actor-critic's `.policy`);
  default the model itself.
  frozen: LoRA's base state (params are then the adapters), merged with them and copied alike."""
  select = select or (lambda model: model)
  states = (params,) if frozen is None else (params, frozen)
  if devices is None:
    return select(nnx.merge(graphdef, *states))
  mine = [d for d in devices if d.process_index == jax.process_index()]
  inside = set() if mesh is None else set(mesh.devices.flat)
  outside = [d for d in dict.fromkeys(mine) if d not in inside]   # the rollout sub-mesh's
  copies = {}
  if mesh is not None:
    with jax.set_mesh(mesh):
      own = [d for d in mesh.devices.flat if d.process_index == jax.process_index()][:1]   # a training device here
      copies = hosts.device_copies(states, mesh, [d for d in mine if d in inside] or own)
  source = next(iter(copies.values())) if copies else states
  # Device to device: a full copy from a training device onto each rollout device.
  copies.update({d: jax.device_put(source, d) for d in outside})
  return {d: select(nnx.merge(graphdef, *copies[d])) for d in dict.fromkeys(mine)}


def on_mesh(batches: list, mesh):
  """Group batches of one completion shape as one batch on `mesh`: prompts padded to one length
  (a multiple of mesh.seq: distributed.mesh.pad_prompts), stacked [B, ...] and placed (shard_batch).
  With several processes every process passes the same, whole batch and places its own rows."""
  return shard_batch(stack_groups(pad_prompts(batches, mesh.shape["seq"])), mesh)


def stack_on_device(batches: list, layouts=None) -> RolloutBatch:
  """The step's group (or tree) batches as one batch stacked [B, ...] for the one-device step
  (`gradients.step.make_train_step`): trees padded to one level layout (data.batches.pad_trees), groups
  to the largest G and T (distributed.mesh.pad_groups: a no-op when they share them, as a step's
  sampled groups do), prompts to the longest P_pad (pad_prompts). Every padding adds exact zeros to
  loss, gradient and metric sums. Prompt buckets are powers of two (data.groups.bucket_length), so
  a step compiles one program per largest prompt bucket. layouts: the run's `data.batches.TreeLayouts`
  (trees go onto a layout compiled before when one holds them), or None."""
  if is_tree(batches[0]):
    return stack_groups(pad_prompts(pad_trees(batches, layouts)))
  return stack_groups(pad_groups(batches)[0])


def mesh_context(mesh):
  """`jax.set_mesh(mesh)` (the mesh's Explicit axes need it around its steps), or a no-op context without a mesh."""
  return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)
