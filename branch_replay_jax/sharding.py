"""Branch replay on a device mesh with `jax.shard_map`: groups over `data`, branches over `branch`.

Mesh axes ("data", "branch", "seq"), every axis type Explicit:

    data   : a batch of B rollout groups is split over devices (B % data == 0);
    branch : each group's G completions are split over devices (G % branch == 0); every device
             runs the prompt's forward (replicated compute, no communication) and its own
             completions; the prompt's cotangent is all-reduced over `branch` once, before the
             single prompt pullback;
    seq    : reserved for a sequence-sharded prompt (context parallelism); only size 1 is
             supported for now (ValueError otherwise).

Gradients are all-reduced once per step. The trap (jax-ml/jax #3970; shared/cases C15): with
`check_vma=True`, differentiating inside `shard_map` with respect to a replicated (invariant)
input already psums the gradient over the axes the computation varies on, and a hand-written
psum on top over-counts by the device count. Here the parameters are first cast to "varying"
(`jax.lax.pcast(..., to="varying")`), so the gradients stay per-device until the one explicit
psum. The prompt cotangent is divided by the branch count after its all-reduce: every branch
device then pulls back 1/n of it, and the final psum over `branch` adds the n identical
shares back to one (exact for power-of-two n, one rounding otherwise).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from branch_replay_jax.policy import Objective, replay_value_and_grad

MESH_AXES = ("data", "branch", "seq")


def make_mesh(data: int, branch: int, seq: int = 1, devices=None) -> jax.sharding.Mesh:
  """A ("data", "branch", "seq") mesh with Explicit axis types over `devices` (default: all).

  Raises:
    ValueError: a size < 1, a product that is not the device count, or seq > 1.
  """
  devices = jax.devices() if devices is None else devices
  sizes = {"data": data, "branch": branch, "seq": seq}
  for name, size in sizes.items():
    if not isinstance(size, int) or size < 1:
      raise ValueError(f"make_mesh: {name}={size!r} must be a positive int")
  if data * branch * seq != len(devices):
    raise ValueError(f"make_mesh: data x branch x seq = {data} x {branch} x {seq} = {data * branch * seq} "
                     f"must equal the device count {len(devices)}")
  if seq != 1:
    raise ValueError(f"make_mesh: seq={seq}: a sequence-sharded prompt is not implemented yet; use seq=1")
  return jax.make_mesh((data, branch, seq), MESH_AXES, axis_types=(AxisType.Explicit,) * 3, devices=devices)


def stack_groups(groups: list[dict]) -> dict:
  """Stack `group_arrays` dicts of equal shapes on a leading group axis [B, ...].

  Raises:
    ValueError: groups whose shapes differ (bucket them to the same prompt/completion lengths).
  """
  shapes = {str(jax.tree_util.tree_map(np.shape, g)) for g in groups}
  if len(shapes) != 1:
    raise ValueError(f"stack_groups: {len(groups)} groups have {len(shapes)} different shapes; pad them to "
                     "common prompt_bucket / completion_bucket lengths")
  return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *groups)


def shard_batch(batch: dict, mesh) -> dict:
  """Place a stacked batch: groups over `data`, branches (their axis 1) over `branch`."""
  def place(path, x):
    in_branches = any(getattr(k, "key", None) == "branches" for k in path)
    spec = P("data", "branch") if in_branches else P("data")
    return jax.device_put(x, NamedSharding(mesh, spec))
  return jax.tree_util.tree_map_with_path(place, batch)


def sharded_replay_value_and_grad(graphdef, params, batch: dict, objective: Objective, mesh, *,
                                  micro_batch: int = 1, logprob_chunk: int = 256):
  """(loss, grads) summed over a batch of groups, by replay under `shard_map` on `mesh`.

  Args:
    params: replicated parameters (an nnx.State).
    batch: `stack_groups` output placed with `shard_batch`: prompt [B, P_pad], branches [B, G, ...].
    micro_batch: completions per scan step on each device; must divide G / branch.

  Returns:
    loss: scalar, Σ over groups and completions of the objective (replicated).
    grads: like params (replicated): equal to the single-device replay and naive gradients.
  """
  n_branch = mesh.shape["branch"]

  def reduce_prompt_cotangent(cotangent):
    # psum makes the cotangent invariant over `branch`; the pullback expects the prompt output's
    # own type (varying over both axes), so cast back.
    return jax.tree_util.tree_map(
        lambda c: jax.lax.pcast(jax.lax.psum(c, "branch") / n_branch, "branch", to="varying"), cotangent)

  def per_device(params, batch):
    local = jax.lax.pcast(params, ("data", "branch"), to="varying")

    def one_group(carry, arrays):
      loss, _, grads = replay_value_and_grad(graphdef, local, arrays, objective, micro_batch=micro_batch,
                                             logprob_chunk=logprob_chunk,
                                             reduce_prefix_cotangent=reduce_prompt_cotangent)
      return (carry[0] + loss, jax.tree_util.tree_map(jnp.add, carry[1], grads)), None

    zeros = jax.tree_util.tree_map(jnp.zeros_like, local)
    loss0 = jnp.zeros_like(jax.tree_util.tree_leaves(local)[0], shape=())
    (loss, grads), _ = jax.lax.scan(one_group, (loss0, zeros), batch)
    return jax.lax.psum(loss, ("data", "branch")), jax.lax.psum(grads, ("data", "branch"))

  specs = jax.tree_util.tree_map_with_path(
      lambda path, _: P("data", "branch") if any(getattr(k, "key", None) == "branches" for k in path) else P("data"),
      batch)
  fn = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), specs), out_specs=(P(), P()), check_vma=True)
  return fn(params, batch)
