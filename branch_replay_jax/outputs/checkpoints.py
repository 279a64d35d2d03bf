"""Checkpoints of a training run with orbax: parameters, optimizer state, step, PRNG key, data position.

orbax writes each step to a temporary directory and renames it when complete, so a run killed
mid-save leaves the previous checkpoint as the latest usable one. Saves are asynchronous: a step
blocks only for the device-to-host copy, and the disk write overlaps the next steps.
"""

from __future__ import annotations

import json
import os
import time

import jax
import orbax.checkpoint as ocp


class RunCheckpoints:
  """`RUN_DIR/checkpoints/<step>/` managed by `ocp.CheckpointManager`; keeps the newest `max_to_keep`."""

  def __init__(self, run_dir: str, *, max_to_keep: int = 2, meta: dict | None = None):
    """meta: JSON fields written with every checkpoint's own (e.g. a LoRA run's base model record)."""
    self.extra_meta = dict(meta or {})
    self.directory = os.path.abspath(os.path.join(run_dir, "checkpoints"))
    self.manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=True))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def steps(self) -> list[int]:
    """The steps with a checkpoint on disk, ascending."""
    return sorted(self.manager.all_steps())

  def save(self, step: int, state, meta: dict) -> float:
    """Start saving `step` and return the seconds this call blocked (the device-to-host copy, plus
    any wait for the previous save still writing); the write to disk runs in the background.

    state: pytree of arrays (params, opt_state, PRNG key data); meta: JSON (step, data position).
    The arrays are copied to host numpy first (`jax.device_get`), so the caller may donate or
    overwrite them at once (the training step donates params and opt_state). A checkpoint is
    complete on disk after the next `save`, `wait`, `restore` or `close`.
    """
    t0 = time.perf_counter()
    # Several processes: each array spans devices of other processes, so no process can copy it
    # whole; orbax's multi-process save writes each process's shards (its own device-to-host copy
    # also happens before save returns).
    host = jax.device_get(state) if jax.process_count() == 1 else state
    self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(host),
                                                    meta=ocp.args.JsonSave({**self.extra_meta, **meta})))
    return time.perf_counter() - t0

  def wait(self) -> None:
    """Block until the last started save is on disk."""
    self.manager.wait_until_finished()

  def restore(self, step: int, abstract_state=None):
    """Restore into the structure, shapes, dtypes and shardings of `abstract_state` (e.g. the live
    state), or, without one, as saved onto this process's first device and returned as nested
    dicts of numpy arrays (for inspection; also a checkpoint written by several processes, whose
    saved device layout this process does not have)."""
    self.wait()
    if abstract_state is None:
      saved = ocp.StandardCheckpointer().metadata(os.path.join(self.directory, str(step), "state"))
      device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
      target = jax.tree_util.tree_map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                                      saved.item_metadata)
    else:
      target = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, abstract_state)
    out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                             meta=ocp.args.JsonRestore()))
    state = out["state"] if abstract_state is not None else jax.device_get(out["state"])
    return state, out["meta"]

  def meta(self, step: int) -> dict:
    """The JSON meta of checkpoint `step` alone (no array is read)."""
    self.wait()
    return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def close(self) -> None:
    """Finish the last save and release the manager."""
    self.manager.wait_until_finished()
    self.manager.close()


def pure_params(tree):
  """Parameters restored without a target (`RunCheckpoints.restore(step)`): each nnx.Param is saved
  as {"value": array}; returns the nested dict without that level (`nnx.to_pure_dict`'s layout)."""
  if isinstance(tree, dict):
    return pure_params(tree["value"]) if set(tree) == {"value"} else {k: pure_params(v) for k, v in tree.items()}
  return tree


def check_run_dir(run_dir: str, fingerprint: dict, *, write: bool = True) -> None:
  """Record the experiment's identity in RUN_DIR/experiment.json (unless write=False: only check);
  refuse a run dir of another one.

  Raises:
    ValueError: RUN_DIR holds checkpoints of an experiment whose fingerprint differs (naming the
      differing fields).
  """
  os.makedirs(run_dir, exist_ok=True)
  path = os.path.join(run_dir, "experiment.json")
  if os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
    diff = sorted(k for k in set(old) | set(fingerprint) if old.get(k) != fingerprint.get(k))
    has_checkpoints = os.path.isdir(os.path.join(run_dir, "checkpoints")) and os.listdir(
        os.path.join(run_dir, "checkpoints"))
    if diff and has_checkpoints:
      raise ValueError(f"run_dir={run_dir!r} holds checkpoints of a different experiment (fields {diff} differ: "
                       f"{ {k: old.get(k) for k in diff} } vs { {k: fingerprint.get(k) for k in diff} }); "
                       "choose another run_dir")
  if not write:
    return
  with open(path, "w") as f:
    json.dump(fingerprint, f, indent=1, sort_keys=True)
