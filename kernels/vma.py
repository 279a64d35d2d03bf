"""Manual-axis types for the Pallas kernels, so that they run inside `jax.shard_map(check_vma=True)`.

Inside a `shard_map` with `check_vma=True` (the mesh step, distributed/mesh.py) every value carries
the set of manual mesh axes it varies over (`jax.typeof(x).manual_axis_type.varying`; `.vma` in
JAX releases before 0.10). A `pallas_call` cannot infer that set for its outputs, so since JAX 0.10
its `out_shape` must state it (`jax.ShapeDtypeStruct(..., manual_axis_type=ManualAxisType(varying=
...))`), or tracing raises "manual_axis_type on jax.ShapeDtypeStruct must not be None" (the same
change MaxText made for its megablox kernel, AI-Hypercomputer/maxtext PR #3534).

The kernels here use one rule: all the inputs of a kernel call are first cast to the union of
their varying axes (`to_common_varying`, a `pcast` of the missing axes, outside the kernels'
`custom_vjp`), and every output is typed with that union (`out_struct`). Inside the `custom_vjp`
every primal, residual and cotangent then has that one type, and the cotangent of an input that
was invariant over an axis is summed over it by the transpose of its `pcast` (JAX's own rule for
an implicit broadcast), not by the kernels. Outside `shard_map` the union is empty and nothing
changes (the cast is skipped; the stated type is ignored).
"""

from __future__ import annotations

import jax

try:   # JAX >= 0.10 (installed: 0.10.2)
  from jax.sharding import ManualAxisType
except ImportError:   # pragma: no cover - older JAX names the set `vma`
  ManualAxisType = None


def varying_axes(x) -> frozenset:
  """The manual mesh axes `x` varies over (empty outside `shard_map` or with check_vma off)."""
  aval = jax.typeof(x)
  if hasattr(aval, "manual_axis_type"):
    return frozenset(aval.manual_axis_type.varying)
  return frozenset(getattr(aval, "vma", ()))


def to_common_varying(*trees):
  """(trees with every array leaf cast to vary over the union of all leaves' varying axes, that union).

  The cast (`jax.lax.pcast(..., to="varying")` of the axes a leaf does not vary over) is free at
  run time; its transpose sums the cotangent over those axes.
  """
  leaves = jax.tree_util.tree_leaves(trees)
  union = frozenset().union(*(varying_axes(x) for x in leaves))

  def cast(x):
    missing = tuple(sorted(union - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x
  return jax.tree_util.tree_map(cast, trees), union


def interpret_per_device(fn, varying: frozenset, *args):
  """`fn(*args)` as one device's call inside `shard_map(check_vma=True)`, for a Pallas kernel run in the
  interpreter (tests on the CPU), whose outputs `fn` types invariant.

  The Pallas interpreter evaluates the state-discharged kernel, whose loops carry their blocks typed
  without manual axes, and JAX 0.10 refuses to run it on operands that vary over mesh axes ("Scan
  carry input and output got mismatched varying manual axes"); the Mosaic interpreter
  (`pltpu.InterpretParams`) runs per device but through io_callbacks, which `jax.checkpoint` (remat,
  FSDP's layer scan) does not take. So every device gathers all devices' operands (invariant:
  `all_gather(..., to="invarying")`), runs `fn` on each under `jax.vmap`, and keeps its own slice: the
  same values as the compiled kernel's one call per device, at `mesh size` times the interpreter's
  work. Never on a GPU, where the Triton kernel runs with the stated types.
  """
  axes = tuple(sorted(varying))
  outs = jax.vmap(fn)(*(jax.lax.all_gather(x, axes, to="invarying") for x in args))
  me = jax.lax.axis_index(axes)
  return jax.tree_util.tree_map(lambda o: o[me], outs)


def out_struct(shape, dtype, varying: frozenset) -> jax.ShapeDtypeStruct:
  """A `pallas_call` out_shape entry that varies over the manual axes `varying`."""
  if ManualAxisType is None:   # pragma: no cover
    return jax.ShapeDtypeStruct(shape, dtype, vma=varying)
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=ManualAxisType(varying=frozenset(varying)))
