"""Several processes (JAX's multi-controller runtime) and data-parallel sampling on a device mesh.

A multi-process run starts the same program once per host (or, on one machine, once per process):
`jax.distributed.initialize` connects them through a coordinator, after which `jax.devices()` lists
every process's devices and one `jax.sharding.Mesh` spans them all. Each process runs the same
Python loop; jitted steps over the mesh are collective (every process calls them, each feeding
and reading only its own devices' shards; on CPU the collectives go through gloo).

Who does what (algorithms/grpo.py, algorithms/loop.py, algorithms/placement.py):
  - sampling: the step's B groups are split over the mesh's `data` rows as the update splits them
    (group i belongs to row i // (B / data)); within its row, group i samples on the row's device
    (i mod B / data) mod (branch x seq), from a full copy of the parameters gathered onto that
    device (`device_copies`). Every device of the mesh samples when B >= its device count. The
    keys are those of one device, (seed, step, i) folded (loop.sample_groups), and a group's
    program is the same on every device, so a mesh run samples the same tokens as a one-device
    run of the same seed (tests/test_multihost.py). A process samples only the groups of its own
    devices ("loads only its data");
  - the update: each process places its groups as its part of one global batch
    (`distributed.mesh.shard_batch`, `jax.make_array_from_process_local_data`). Steps that see the
    whole step (PPO's minibatch shuffle and whitening, DPO's pairs, sampled trees' common padded
    shape) first share every group's arrays with every process (`gather_items`), build the same
    batch everywhere and place only their own rows of it (DPO's prompts sample on
    `spread_devices`, as they are re-laid out anyway);
  - logs: every process learns every group's rewards, lengths and timings (`allgather_objects`),
    so the step's metrics are the same everywhere; only process 0 writes files (`is_primary`);
  - held-out evaluation (rollout/evaluate.py): the problems spread over every device, taking each
    process in turn (`spread_devices`); each process answers its devices' problems in threads
    (`run_on_devices`, as the sampling above) and the results are gathered (`gather_items`);
  - checkpoints: orbax's multi-process save (every process writes its shards, process 0 the
    metadata) into one directory all processes see.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import pickle
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# config.distributed field -> the environment variable read when the field is None.
ENVIRONMENT = {"coordinator_address": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
               "process_id": "JAX_PROCESS_ID"}


def settings(config) -> dict:
  """{"coordinator_address", "num_processes", "process_id"} of config.distributed, each field
  that is None read from its environment variable (`ENVIRONMENT`); one process when neither gives
  num_processes.

  Raises:
    ValueError: num_processes < 1, process_id outside [0, num_processes), or several processes
      without a coordinator address (naming the field, or the variable it came from).
  """
  d = config.get("distributed") or {}
  out = {}
  for field, var in ENVIRONMENT.items():
    value, source = d.get(field), f"distributed.{field}"
    if value is None and os.environ.get(var) not in (None, ""):
      value, source = os.environ[var], f"environment variable {var}"
      if field != "coordinator_address":
        try:
          value = int(value)
        except ValueError:
          raise ValueError(f"{source}={os.environ[var]!r} must be an int") from None
    out[field] = (value, source)
  (n, n_src), (pid, pid_src), (addr, addr_src) = out["num_processes"], out["process_id"], out["coordinator_address"]
  n = 1 if n is None else n
  pid = 0 if pid is None else pid
  if isinstance(n, bool) or not isinstance(n, int) or n < 1:
    raise ValueError(f"{n_src}={n!r} must be an int >= 1")
  if isinstance(pid, bool) or not isinstance(pid, int) or not 0 <= pid < n:
    raise ValueError(f"{pid_src}={pid!r} must be an int in [0, num_processes={n})")
  if n > 1 and not (isinstance(addr, str) and addr):
    raise ValueError(f"{addr_src}={addr!r}: {n} processes need a coordinator address 'host:port' "
                     "(process 0's host)")
  return {"coordinator_address": addr, "num_processes": n, "process_id": pid}


def initialize(config) -> None:
  """Join the run's processes (`jax.distributed.initialize`) when `settings` gives more than one;
  a no-op for one process or when already initialised. Must run before anything touches a JAX
  device (the entry point calls it first)."""
  s = settings(config)
  if s["num_processes"] > 1 and not jax.distributed.is_initialized():
    jax.distributed.initialize(s["coordinator_address"], num_processes=s["num_processes"],
                               process_id=s["process_id"])


def is_primary() -> bool:
  """True in process 0, the one that writes logs, plots and experiment.json."""
  return jax.process_index() == 0


def allgather_objects(obj) -> list:
  """[the object of process 0, of process 1, ...]: any picklable object from every process, on
  every process (pickled, padded to the longest and gathered as uint8 with
  `multihost_utils.process_allgather`). One process: [obj]. A collective: every process calls it."""
  if jax.process_count() == 1:
    return [obj]
  data = np.frombuffer(pickle.dumps(obj), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int64))).reshape(-1)
  buffer = np.zeros(int(sizes.max()), np.uint8)
  buffer[:data.size] = data
  gathered = np.asarray(multihost_utils.process_allgather(buffer))
  return [pickle.loads(gathered[i, :sizes[i]].tobytes()) for i in range(len(sizes))]


def sampling_devices(mesh, num_groups: int) -> list:
  """[num_groups] the device that samples each of a step's groups (module docstring): group i in
  `data` row i // (num_groups / data), on that row's device (i mod num_groups / data) mod (branch x
  seq) in the mesh's device order.

  Raises:
    ValueError: num_groups not divisible by the mesh's data size.
  """
  rows = mesh.devices.reshape(mesh.shape["data"], -1)
  if num_groups % rows.shape[0]:
    raise ValueError(f"{num_groups} groups do not split over mesh.data={rows.shape[0]}")
  per_row = num_groups // rows.shape[0]
  return [rows[i // per_row][(i % per_row) % rows.shape[1]] for i in range(num_groups)]


def spread_devices(mesh, num_items: int) -> list:
  """[num_items] the device of each item when independent items (held-out evaluation problems)
  spread over every device of `mesh`: item j on device j mod (mesh size) of an order that takes
  one device of each process in turn (process 0's first, process 1's first, ..., process 0's
  second, ...; one process: the mesh's device order), so the processes share even a few items.

    2 processes x 4 devices (ids 0-3 and 4-7), 3 items -> devices 0, 4, 1.
  """
  by_process: dict[int, list] = {}
  for device in mesh.devices.flat:
    by_process.setdefault(device.process_index, []).append(device)
  order = [d for turn in itertools.zip_longest(*by_process.values()) for d in turn if d is not None]
  return [order[j % len(order)] for j in range(num_items)]


def run_on_devices(fn: Callable[[int, Any], Any], devices) -> dict:
  """{i: fn(i, devices[i])} for the items i whose device belongs to this process: each of those
  devices runs its items one after another, in its own host thread under
  `jax.default_device(device)`, all devices at once. `fn` places whatever it needs on the device it
  is given (a key: `jax.device_put(key, device)`). Not a collective: gather the results with
  `gather_items`."""
  mine: dict[Any, list[int]] = {}
  for i, device in enumerate(devices):
    if device.process_index == jax.process_index():
      mine.setdefault(device, []).append(i)

  def on_device(device):
    with jax.default_device(device):
      return [(i, fn(i, device)) for i in mine[device]]
  with concurrent.futures.ThreadPoolExecutor(max(len(mine), 1)) as pool:
    return dict(pair for part in pool.map(on_device, mine) for pair in part)


def gather_items(local: dict) -> dict:
  """The union of every process's {item: value} dict, on every process (`allgather_objects`; the
  values must pickle). A collective: every process calls it. One process: `local` itself."""
  merged: dict = {}
  for part in allgather_objects(local):
    merged.update(part)
  return merged


def check_rows_local(mesh) -> None:
  """Every `data` row of the mesh lies in one process, so that a process can sample and place
  whole groups (a group's completions and prompt span its row's branch and seq devices).

  Raises:
    ValueError: a row whose devices belong to several processes, naming the mesh's sizes.
  """
  rows = mesh.devices.reshape(mesh.shape["data"], -1)
  for row in rows:
    if len({d.process_index for d in row}) > 1:
      raise ValueError(f"mesh.branch x mesh.seq = {mesh.shape['branch']} x {mesh.shape['seq']} devices span several "
                       f"processes ({jax.local_device_count()} devices each): a data row must lie in one process; "
                       f"raise mesh.data to at least the process count {jax.process_count()}")


def device_copies(params, mesh, devices) -> dict:
  """{device: a full copy of `params` on that device} for this process's `devices` of `mesh`.

  FSDP-sharded parameters are all-gathered once (a jitted reshard to replicated, a collective
  every process joins); replicated ones already hold a full copy per device. Each copy is that
  device's own buffer, so the samplers on different devices read no common memory.
  """
  replicated = jax.jit(lambda p: p, out_shardings=NamedSharding(mesh, P()))(params)
  leaves, treedef = jax.tree_util.tree_flatten(replicated)
  shards = [{s.device: s.data for s in x.addressable_shards} for x in leaves]
  return {d: jax.tree_util.tree_unflatten(treedef, [s[d] for s in shards]) for d in dict.fromkeys(devices)}


def global_max(value: int) -> int:
  """The largest of an int over all processes (itself in one process)."""
  return max(allgather_objects(int(value)))
