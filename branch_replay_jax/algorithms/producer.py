"""Rollouts sampled ahead of the update: bounded staleness (`train.max_staleness`; docs/design.md,
"Bounded staleness").

Step t's batch is sampled by the policy of version

    v(t) = max(start, t - k),     k = train.max_staleness, start = the run's first step (0, or the resumed one)

where version v is the parameters after v optimizer steps (version `start` is the run's starting
point). A producer thread samples, scores and runs environments for step t as soon as version v(t)
exists, while the update of an earlier step runs; the update takes the batches in order. The version
is a function of t alone, never of timing, so a run is reproducible: the same seed gives the same
samples and updates whatever the machine's speed (Tunix's `max_staleness` and slime's async loop take
the newest version available instead; that is faster only when sampling is slower than updating,
and then not reproducible). Staleness t - v(t) is therefore min(k, t - start).

k = 0 takes no thread: `take(t)` samples with version t right there, which is the synchronous loop,
call for call.

A resumed run restarts the producer from the checkpointed step s with version s: batches s .. s+k-1
are sampled by version s (staleness below k) where the uninterrupted run used versions s-k .. s-1.
Every data position is still trained once: a checkpoint stores the data position of the last batch
its update consumed, and the producer's batches beyond it are sampled again.

The producer samples with a copy of each version's parameters (the update donates its inputs), so
k > 0 holds up to k + 1 copies of the trainable parameters beside the run's own, and up to k + 1
sampled batches. An exception in the producer (an environment's, a reward function's) reaches the
update loop at the step whose batch it stopped, after every earlier step has been trained, logged
and checkpointed as due.

With several processes the producer takes no thread (`inline`): a thread's gathers across processes
(`hosts.gather_items`) would interleave with the update's collectives in an order that differs between
processes, and a collective whose processes meet in different orders deadlocks. Instead the update
loop's own thread samples step t + k with version t right after it dispatched update t
(`publish(t + 1)`): the same versions, so the same batches as a thread's, in one order on every process.
JAX dispatches the update asynchronously, so the sampling's host work (environments, reward functions,
tokenisation) overlaps the update's compute until the sampler first needs a device result.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Any, Callable

import jax

from branch_replay_jax.algorithms import schema
from branch_replay_jax.distributed import hosts

FIELD = "train.max_staleness"
METRICS = ("policy_version", "staleness_mean", "staleness_max")   # each step's record (`Produced.metrics`)


def max_staleness(config) -> int:
  """train.max_staleness, its schema default (0) when the experiment leaves it out."""
  return config.train.get("max_staleness", schema.defaults(schema.TrainConfig)["max_staleness"])


def validate(config) -> None:
  """Raise ValueError naming train.max_staleness when it is not an int >= 0."""
  k = max_staleness(config)
  if isinstance(k, bool) or not isinstance(k, int) or k < 0:
    raise ValueError(f"{FIELD}={k!r} must be an int >= 0 (0: sample each step with the current policy)")


def inline(config) -> bool:
  """Whether the producer samples in the update loop's thread: a run of several processes
  (distributed.num_processes or its environment variable, `hosts.settings`; module docstring)."""
  return hosts.settings(config)["num_processes"] > 1 or jax.process_count() > 1


@dataclasses.dataclass
class Produced:
  """One step's batch: what `collect` returned, the data position after it, the policy version that
  sampled it, and the seconds the update loop waited for it (k = 0: the whole collect)."""
  batch: Any
  data_pos: int
  version: int
  wait_s: float

  def metrics(self, step: int) -> dict:
    """policy_version and the staleness of the step's rollouts (step - version; every rollout of a
    step comes from one version, so the mean equals the max)."""
    staleness = step - self.version
    return dict(zip(METRICS, (self.version, float(staleness), staleness)))


class Producer:
  """The step's batches for the update loop (module docstring):

      producer = Producer(collect, start=s, steps=n, data_pos=d, max_staleness=k)
      producer.publish(s, params)                   # the run's starting version
      for t in range(s, n):
        produced = producer.take(t)                 # sampled by version max(s, t - k)
        params, ... = update(params, produced.batch)
        producer.publish(t + 1, params)
      producer.close()                              # also on an exception (try / finally)

  collect(params, step, data_pos) -> (batch, next data_pos) is the algorithm's (`base.Algorithm.collect`).
  inline: sample in the caller's thread (several processes; module docstring): `publish(v)` samples every
  step that versions before v sample, `take(t)` what is still missing; the same batches as a thread's.
  """

  def __init__(self, collect: Callable, *, start: int, steps: int, data_pos: int, max_staleness: int,
               inline: bool = False):
    self.collect, self.start, self.steps, self.k = collect, start, steps, max_staleness
    self.data_pos = data_pos
    self.versions: dict[int, Any] = {}    # version -> parameters (k > 0: copies)
    self.ready: dict[int, Produced | BaseException] = {}
    self.closed = self.holding = self.collecting = False
    self.lock = threading.Condition()
    self.thread, self.inline, self.next_step, self.newest = None, bool(inline and self.k), start, start - 1
    if self.k and not self.inline:
      self.thread = threading.Thread(target=self._produce, name="rollout-producer", daemon=True)
      self.thread.start()

  def version_of(self, step: int) -> int:
    return max(self.start, step - self.k)

  def publish(self, version: int, params) -> None:
    """Version `version` of the parameters (after that many optimizer steps), before the next update
    donates them; k > 0 keeps a copy only where a later step samples with it."""
    if not self.k:
      self.versions = {version: params}
      return
    if version + self.k < self.steps or version == self.start:   # else no step left samples with it
      copy = jax.tree.map(lambda x: x.copy(), params)
      with self.lock:
        self.versions[version] = copy
        self.newest = version
        self.lock.notify_all()
    if self.inline:   # version - 1 is computed; version itself may still be in flight (async dispatch)
      self._produce_inline(version - 1, self.steps - 1)

  def take(self, step: int) -> Produced:
    """Step `step`'s batch (in order); re-raises the producer's exception at the step it stopped."""
    t0 = time.perf_counter()
    if not self.k:
      batch, self.data_pos = self.collect(self.versions[step], step, self.data_pos)
      return Produced(batch, self.data_pos, step, time.perf_counter() - t0)
    if self.inline and step not in self.ready:
      self._produce_inline(self.newest, step)
    with self.lock:
      self.lock.wait_for(lambda: step in self.ready)
      item = self.ready.pop(step)
    if isinstance(item, BaseException):
      raise item
    item.wait_s = time.perf_counter() - t0
    return item

  @contextlib.contextmanager
  def held(self):
    """No sampling inside: waits for the batch the producer is sampling, and starts none until the
    block ends (the loop's held-out evaluation: its seconds are left out of the run's wall-clock, so
    the producer must not sample for free meanwhile; the wait itself is training time)."""
    with self.lock:
      self.holding = True
      self.lock.wait_for(lambda: not self.collecting)
    try:
      yield
    finally:
      with self.lock:
        self.holding = False
        self.lock.notify_all()

  def close(self) -> None:
    """Stop the producer (it finishes the batch it is sampling) and wait for it."""
    with self.lock:
      self.closed = True
      self.lock.notify_all()
    if self.thread is not None:
      self.thread.join()
    self.versions.clear()
    self.ready.clear()   # batches sampled ahead of a stopped run (and a stored exception's frame)

  def _produce_inline(self, newest: int, last: int) -> None:
    """Sample, in order, every step up to `last` not yet sampled whose version is at most `newest` (inline)."""
    while self.next_step <= last and self.version_of(self.next_step) <= newest and not self.closed:
      step, version = self.next_step, self.version_of(self.next_step)
      try:
        batch, self.data_pos = self.collect(self.versions[version], step, self.data_pos)
        self.ready[step] = Produced(batch, self.data_pos, version, wait_s=0.0)
      except BaseException as error:   # raised by take(step), after the earlier steps
        self.ready[step] = error
        self.closed = True
      self.next_step += 1
      if self.version_of(step + 1) != version:
        self.versions.pop(version, None)

  def _produce(self) -> None:
    data_pos = self.data_pos
    for step in range(self.start, self.steps):
      version = self.version_of(step)
      with self.lock:
        self.lock.wait_for(lambda: self.closed or (version in self.versions and not self.holding))
        if self.closed:
          return
        params, self.collecting = self.versions[version], True
      try:
        batch, data_pos = self.collect(params, step, data_pos)
        item = Produced(batch, data_pos, version, wait_s=0.0)   # (take() sets the update loop's wait)
      except BaseException as error:   # handed to the update loop at this step
        item = error
      with self.lock:
        self.collecting = False
        if self.version_of(step + 1) != version:
          self.versions.pop(version, None)
        self.ready[step] = item
        self.lock.notify_all()
      if isinstance(item, BaseException):
        return
