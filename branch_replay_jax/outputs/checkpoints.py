"""Checkpoints of a training run with orbax: parameters, optimizer state, step, PRNG key, data position.

orbax writes each step to a temporary directory and renames it when complete, so a run killed
mid-save leaves the previous checkpoint as the latest usable one. Saves are asynchronous: a step
blocks only for the device-to-host copy, and the disk write overlaps the next steps.
"""

from __future__ import annotations

import json
import os
import shutil
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


RUN_RECORD = "experiment.json"
# Fields that say where and how a run starts, not what it trains (a run dir copied elsewhere resumes
# alike): not reported as changes.
RESUME_FIELDS = ("resume", "overwrite", "run_dir")


def check_run_dir_path(run_dir) -> None:
  """Raise ValueError, naming run_dir and the reason, when it cannot hold a run: not a non-empty
  string, an existing file, or a directory that cannot be created or written (the nearest existing
  ancestor is a file or not writable). Creates nothing: it runs before anything loads."""
  if not isinstance(run_dir, str) or not run_dir:
    raise ValueError(f"run_dir={run_dir!r} must be a non-empty path string")
  path = os.path.abspath(run_dir)
  if os.path.exists(path) and not os.path.isdir(path):
    raise ValueError(f"run_dir={run_dir!r} is a file, not a directory")
  existing = path
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  verb = "written" if existing == path else "created"
  if not os.path.isdir(existing):
    raise ValueError(f"run_dir={run_dir!r} cannot be created: {existing} is a file")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise ValueError(f"run_dir={run_dir!r} cannot be {verb}: {existing} is not writable")


def open_run_dir(run_dir: str, *, resume: bool, overwrite: bool) -> None:
  """Make run_dir ready for a run. A fresh run (neither flag) needs it absent or empty; overwrite=True
  first removes everything a previous run left there (checkpoints included); resume=True continues
  whatever is there. Never a mix of two runs: a fresh run beside old checkpoints would resume from
  them later.

  Raises:
    ValueError: run_dir is not empty and neither flag is set (naming both); overwrite=True on a
      directory that holds no run (no experiment.json: nothing is removed).
  """
  entries = sorted(os.listdir(run_dir)) if os.path.isdir(run_dir) else []
  if not entries or resume:
    return
  shown = entries if len(entries) <= 6 else entries[:6] + [f"... {len(entries) - 6} more"]
  if not overwrite:
    raise ValueError(f"run_dir={run_dir!r} is not empty ({shown}): a new run there would mix with the old one "
                     "(its checkpoints stay and a later resume restores them); pass resume=True to continue it, "
                     "overwrite=True to delete everything in it first, or choose another run_dir")
  if RUN_RECORD not in entries:
    raise ValueError(f"run_dir={run_dir!r} holds files no run wrote (no {RUN_RECORD}: {shown}); overwrite=True "
                     "deletes only a run's directory; choose another run_dir")
  for name in entries:
    path = os.path.join(run_dir, name)
    shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)


def _read_record(run_dir: str) -> dict | None:
  """RUN_DIR/experiment.json as {"fingerprint", "config", "chat_template"} (a file of an older
  version held the fingerprint alone), or None."""
  path = os.path.join(run_dir, RUN_RECORD)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    record = json.load(f)
  return record if "fingerprint" in record else {"fingerprint": record, "config": None, "chat_template": None}


def read_run_record(run_dir: str) -> dict:
  """The run's experiment.json: {"fingerprint": check_run_dir's fields, "config": the run's whole
  config as JSON (None in a file of an older version), "chat_template": the tokenizer's (or None)}.

  Raises:
    ValueError: run_dir holds no experiment.json (no run was started there).
  """
  record = _read_record(run_dir)
  if record is None:
    raise ValueError(f"run_dir={run_dir!r} holds no run (no {RUN_RECORD})")
  return record


def write_run_record(run_dir: str, fingerprint: dict, config: dict, chat_template: str | None) -> None:
  """Write RUN_DIR/experiment.json (`read_run_record`'s fields) whole or not at all (a temporary file
  renamed: other processes may read it meanwhile); the directory must exist."""
  path = os.path.join(run_dir, RUN_RECORD)
  with open(path + ".tmp", "w") as f:
    json.dump({"fingerprint": fingerprint, "config": config, "chat_template": chat_template}, f, indent=1,
              sort_keys=True)
  os.replace(path + ".tmp", path)


def flat_fields(tree: dict, prefix: str = "") -> dict:
  """{"train.learning_rate": 2e-06, ...}: the leaves of nested dicts under dotted names."""
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict) and v:
      out.update(flat_fields(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def config_changes(old: dict | None, new: dict) -> dict:
  """{dotted field: (value in `old`, value in `new`)} for the fields that differ, `RESUME_FIELDS` left
  out; {} without an old config."""
  if old is None:
    return {}
  a, b = flat_fields(old), flat_fields(new)
  return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b))
          if k not in RESUME_FIELDS and a.get(k) != b.get(k)}


def check_run_dir(run_dir: str, fingerprint: dict) -> dict | None:
  """Refuse a run dir of another experiment (changing a fingerprint field breaks the data order or
  exactness of a resumed run); returns the run's saved config (None without an experiment.json, or
  in one of an older version), for `config_changes`.

  Raises:
    ValueError: RUN_DIR holds checkpoints of an experiment whose fingerprint differs (naming the
      differing fields).
  """
  record = _read_record(run_dir)
  if record is None:
    return None
  old = record["fingerprint"]
  diff = sorted(k for k in set(old) | set(fingerprint) if old.get(k) != fingerprint.get(k))
  has_checkpoints = os.path.isdir(os.path.join(run_dir, "checkpoints")) and os.listdir(
      os.path.join(run_dir, "checkpoints"))
  if diff and has_checkpoints:
    raise ValueError(f"run_dir={run_dir!r} holds checkpoints of a different experiment (fields {diff} differ: "
                     f"{ {k: old.get(k) for k in diff} } vs { {k: fingerprint.get(k) for k in diff} }); "
                     "choose another run_dir")
  return record["config"]
