"""Bounded staleness (train.max_staleness, algorithms/producer.py): step t samples with version
max(start, t - k), the data positions chain in order, resume trains every position once, errors reach
the step they stopped, and the loop's records say which version sampled each step."""

import json
import os
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

from branch_replay_jax.algorithms import grpo as train
from branch_replay_jax.algorithms.producer import Producer
from branch_replay_jax.distributed import hosts
from branch_replay_jax.rollout.tasks import Task
from conftest import grpo_smoke, length_score


def drive(k: int, start: int, steps: int, inline: bool = False, events: list | None = None):
  """Run the update loop's side of a Producer whose collect records (step, the version it sampled with,
  data_pos); each 'update' deletes the parameters it was given, as the train step's donation does.
  `events` (if given) gets ("sample", step) and ("update", step) in the order they happen."""
  seen, lock, events = [], threading.Lock(), [] if events is None else events

  def collect(params, step, data_pos):
    with lock:
      seen.append((step, int(params["version"]), data_pos))
      events.append(("sample", step))
    return f"batch {step}", data_pos + 2

  producer = Producer(collect, start=start, steps=steps, data_pos=10 * start, max_staleness=k, inline=inline)
  params = {"version": jnp.asarray(start)}
  taken = []
  try:
    producer.publish(start, params)
    for step in range(start, steps):
      produced = producer.take(step)
      taken.append((step, produced.batch, produced.data_pos, produced.version, produced.metrics(step)))
      with lock:
        events.append(("update", step))
      new = {"version": params["version"] + 1}
      if k:
        params["version"].delete()   # donated: a producer still holding it without a copy would fail
      params = new
      producer.publish(step + 1, params)
  finally:
    producer.close()
  return sorted(seen), taken


@pytest.mark.parametrize("inline", [False, True])
@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("start", [0, 3])
def test_each_step_samples_with_the_version_k_steps_back_and_positions_chain(k, start, inline):
  # Version v(t) = max(start, t - k): the first k steps of a (resumed) run sample with the starting
  # version, every later one with the parameters after t - k updates; data positions 10 * start + 2i.
  # Inline (several processes: no thread) gives the same batches, versions and positions.
  seen, taken = drive(k, start, steps=start + 6, inline=inline)
  want = [(t, max(start, t - k), 10 * start + 2 * (t - start)) for t in range(start, start + 6)]
  assert seen == want
  assert [(t, b, pos, v) for t, b, pos, v, _ in taken] == [
      (t, f"batch {t}", 10 * start + 2 * (t - start + 1), max(start, t - k)) for t in range(start, start + 6)]
  assert [m for *_, m in taken] == [
      {"policy_version": max(start, t - k), "staleness_mean": float(min(k, t - start)),
       "staleness_max": min(k, t - start)} for t in range(start, start + 6)]


@pytest.mark.parametrize("k", [1, 2])
def test_inline_samples_up_to_step_t_plus_k_right_after_update_t(k):
  # Several processes: the loop's thread samples step 0 on demand (no update yet to overlap), then right
  # after dispatching update t every step up to t + k (versions <= t exist by then), so a step's batch is
  # ready when the loop takes it; one fixed order, which is what makes the processes' collectives meet.
  events = []
  drive(k, 0, steps=6, inline=True, events=events)
  want, sampled = [("sample", 0)], 1
  for t in range(6):
    want.append(("update", t))
    while sampled <= min(t + k, 5):
      want.append(("sample", sampled))
      sampled += 1
  assert events == want


def test_no_batch_is_sampled_while_the_producer_is_held():
  # The loop holds the producer during a held-out evaluation (left out of wall_s): with versions
  # available it still starts nothing until the block ends. (A broken hold samples within the 0.3 s.)
  started = []
  producer = Producer(lambda p, step, pos: (started.append(step), (step, pos))[1], start=0, steps=4, data_pos=0,
                      max_staleness=2)
  try:
    with producer.held():
      producer.publish(0, {"w": jnp.zeros(())})
      time.sleep(0.3)
      assert started == []
    assert producer.take(0).batch == 0 and producer.take(1).batch == 1
  finally:
    producer.close()


@pytest.mark.parametrize("inline", [False, True])
@pytest.mark.parametrize("k", [0, 2])
def test_a_producer_error_reaches_the_step_it_stopped_after_the_earlier_ones(k, inline):
  # Steps 0 and 1 are taken (and would be trained, logged, checkpointed); step 2's collect raised, and
  # take(2) raises it; nothing is sampled past it.
  sampled = []

  def collect(params, step, data_pos):
    if step == 2:
      raise RuntimeError("environment failed at step 2")
    sampled.append(step)
    return step, data_pos

  producer = Producer(collect, start=0, steps=6, data_pos=0, max_staleness=k, inline=inline)
  producer.publish(0, {"w": jnp.zeros(())})
  taken = []
  with pytest.raises(RuntimeError, match="environment failed at step 2"):
    for step in range(6):
      taken.append(producer.take(step).batch)
      producer.publish(step + 1, {"w": jnp.zeros(())})
  producer.close()
  assert taken == [0, 1] and sampled == [0, 1]


def test_close_stops_a_producer_that_waits_for_a_version():
  # k = 1 and 4 steps: the producer samples steps 0 and 1 with version 0, then waits for version 1,
  # which never comes; close() must wake it and join.
  producer = Producer(lambda p, step, pos: (step, pos), start=0, steps=4, data_pos=0, max_staleness=1)
  producer.publish(0, {"w": jnp.zeros(())})
  assert producer.take(0).batch == 0
  producer.close()
  assert not producer.thread.is_alive()


def test_a_negative_max_staleness_is_refused_before_the_model_loads(tmp_path):
  # (ConfigDict refuses a float or a string for the experiment's int field on its own.)
  with pytest.raises(ValueError, match=r"train.max_staleness=-1 must be an int >= 0"):
    train.GRPO(grpo_smoke(tmp_path, **{"train.max_staleness": -1}))




def stale_smoke(run_dir, **overrides):
  # A learning rate that moves the tiny model's log-probs far beyond float32 rounding in one step, and
  # TIS on so the step computes π_old and logs its distance to the sampler's log-probs.
  return grpo_smoke(run_dir, **{"train.steps": 3, "train.learning_rate": 1e-3, "loss.rollout_correction": "tis",
                                "eval.size": 0, "checkpoint_every": 2, **overrides})


def records(run_dir, name="metrics.jsonl"):
  with open(os.path.join(run_dir, name)) as f:
    return [json.loads(line) for line in f]


TIMINGS = {"sample_s", "score_s", "update_s", "step_s", "wall_s"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The stale smoke run at k = 0 and k = 1, and k = 1 stopped after step 2 and resumed."""
  out = {}
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(Task, "score", length_score)
    for name, k in (("k0", 0), ("k1", 1)):
      out[name] = tmp_path_factory.mktemp(name)
      train.train(stale_smoke(out[name], **{"train.max_staleness": k}))
    # The same k = 1 run with its sampler on a rollout sub-mesh: the update on device 0 (1 x 1 x 1), the
    # groups sampled on devices 1..7 (mesh.rollout_devices), the devices each step's sampling ran on recorded.
    out["rollout"], out["rollout_devices"] = tmp_path_factory.mktemp("rollout"), []
    run_on_devices = hosts.run_on_devices
    mp.setattr(hosts, "run_on_devices",
               lambda fn, devices: out["rollout_devices"].append(list(devices)) or run_on_devices(fn, devices))
    train.train(stale_smoke(out["rollout"], **{"train.max_staleness": 1, "mesh.rollout_devices": 7}))
    mp.setattr(hosts, "run_on_devices", run_on_devices)
    out["uncorrected"] = tmp_path_factory.mktemp("uncorrected")
    train.train(stale_smoke(out["uncorrected"], **{"train.max_staleness": 1, "train.steps": 2,
                                                   "loss.rollout_correction": "none"}))
    out["resumed"] = tmp_path_factory.mktemp("resumed")
    train.train(stale_smoke(out["resumed"], **{"train.max_staleness": 1, "train.steps": 2}))
    train.train(stale_smoke(out["resumed"], **{"train.max_staleness": 1}, resume=True))
  return out


def test_a_rollout_sub_mesh_samples_on_its_own_devices_and_logs_what_one_device_logs(runs):
  # Sampling is a function of the keys and the parameters, and the parameters sent device to device
  # are the same numbers: every step's record equals the one-device run's, bit for bit but for the
  # timings, at k = 1 (the producer samples on devices 1..7 while device 0 updates).
  import jax
  rollout, one = records(runs["rollout"]), records(runs["k1"])
  assert [{k: v for k, v in r.items() if k not in TIMINGS} for r in rollout] == \
         [{k: v for k, v in r.items() if k not in TIMINGS} for r in one]
  sampled = {d for devices in runs["rollout_devices"] for d in devices}
  assert runs["rollout_devices"] and sampled <= set(jax.devices()[1:]) and len(sampled) >= 2


def test_a_rollout_sub_mesh_that_does_not_fit_the_devices_or_the_run_is_refused(tmp_path):
  # 8 devices: a 2 x 2 x 1 training mesh leaves 4 for the sampler, not 3; PPO samples on its mesh.
  from experiments import ppo_smollm2_arith
  from branch_replay_jax.algorithms import ppo
  from conftest import experiment_config
  with pytest.raises(ValueError, match=r"mesh.data x mesh.branch x mesh.seq \+ mesh.rollout_devices = 4 \+ 3 must "
                                       r"equal the device count 8"):
    train.GRPO(stale_smoke(tmp_path, **{"mesh.data": 2, "mesh.branch": 2, "mesh.rollout_devices": 3}))
  with pytest.raises(ValueError, match=r"mesh.rollout_devices=-1 must be an int >= 0"):
    train.GRPO(stale_smoke(tmp_path, **{"mesh.rollout_devices": -1}))
  with pytest.raises(ValueError, match=r"mesh.rollout_devices=7 with algorithm='ppo'"):
    ppo.PPO(experiment_config(ppo_smollm2_arith, "smoke", tmp_path, **{"mesh.rollout_devices": 7}))


def test_a_stale_run_samples_with_the_older_policy_and_logs_it(runs):
  k0, k1 = records(runs["k0"]), records(runs["k1"])
  assert [r["policy_version"] for r in k0] == [0, 1, 2] and [r["staleness_max"] for r in k0] == [0, 0, 0]
  assert [r["policy_version"] for r in k1] == [0, 0, 1] and [r["staleness_max"] for r in k1] == [0, 1, 1]
  # Step 1 samples with version 0 at any k: the same record, bit for bit, but for the timings.
  assert {k: v for k, v in k0[0].items() if k not in TIMINGS} == {k: v for k, v in k1[0].items() if k not in TIMINGS}
  # On-policy, π_old and the sampler's log-probs differ by float32 rounding (< 1e-4 nats); a step
  # sampled one update back (learning rate 1e-3) differs by far more. A producer that sampled with
  # the current parameters would log the on-policy figure.
  assert max(r["sampler_logp_diff_mean"] for r in k0) < 1e-4
  assert min(r["sampler_logp_diff_mean"] for r in k1[1:]) > 1e-3
  assert max(r["is_ratio_max"] for r in k1) <= 2.0   # TIS caps the ratio at loss.rollout_is_cap


def test_a_stale_step_logs_its_mismatch_without_a_correction(runs):
  # An uncorrected stale step trains as on-policy, but still computes π_old so that the lag shows:
  # step 2's mismatch is the corrected run's (same samples, parameters within float32 rounding of it).
  got, want = records(runs["uncorrected"]), records(runs["k1"])
  assert got[1]["sampler_logp_diff_mean"] == pytest.approx(want[1]["sampler_logp_diff_mean"], rel=1e-3)
  assert got[1]["sampler_logp_diff_mean"] > 1e-3 and got[1]["is_masked_frac"] == 0.0


def test_a_stale_ppo_run_with_a_correction_logs_the_lag_its_factors_weigh(tmp_path, monkeypatch):
  # PPO at k = 1 with TIS (AReaL's decoupled PPO): π_old is the update's own forward at the current
  # parameters, the factor min(π_old / π_sampler, C) weighs each policy term. Step 1 is on-policy (float32
  # rounding between the sampler and the forward, < 1e-4 nats); step 2 was sampled one update back at a
  # learning rate of 1e-3, which moves the log-probs by far more. A PPO that ignored the sampler's
  # log-probs, or sampled with the current parameters, would log the on-policy figure at step 2.
  from experiments import ppo_smollm2_arith
  from branch_replay_jax.algorithms import ppo
  from conftest import experiment_config
  monkeypatch.setattr(Task, "score", length_score)
  ppo.train(experiment_config(ppo_smollm2_arith, "smoke", tmp_path, **{
      "train.max_staleness": 1, "train.steps": 2, "train.learning_rate": 1e-3, "loss.rollout_correction": "tis",
      "eval.size": 0, "checkpoint_every": 2}))
  got = records(tmp_path)
  assert [r["staleness_max"] for r in got] == [0, 1]
  assert got[0]["sampler_logp_diff_mean"] < 1e-4 < 1e-3 < got[1]["sampler_logp_diff_mean"]
  assert max(r["is_ratio_max"] for r in got) <= 2.0   # TIS caps the ratio at loss.rollout_is_cap


def test_staleness_is_refused_where_nothing_would_read_it(tmp_path):
  # PPO without a correction computes its old log-probs and values at the current parameters (a stale
  # batch would train as on-policy); DPO's pairs from a file are not sampled, so nothing runs ahead.
  from experiments import dpo_smollm2_arith, ppo_smollm2_arith
  from branch_replay_jax.algorithms import dpo, ppo
  from conftest import experiment_config
  with pytest.raises(ValueError, match=r"train.max_staleness=1 with PPO and loss.rollout_correction='none'"):
    ppo.PPO(experiment_config(ppo_smollm2_arith, "smoke", tmp_path, **{"train.max_staleness": 1}))
  config = experiment_config(dpo_smollm2_arith, "smoke", tmp_path, **{"train.max_staleness": 2})
  config.data.source = "jsonl"
  with pytest.raises(ValueError, match=r"train.max_staleness=2 with data.source='jsonl'"):
    dpo.DPO(config)


def test_a_step_logs_the_math_verify_timeouts_it_was_given_only_with_that_reward():
  from branch_replay_jax.algorithms import loop
  terms = {"math_verify": np.array([0.0, 1.0])}
  assert loop.reward_term_means([terms], 3) == {"rewards/math_verify": 0.5, "math_verify_timeouts": 3}
  assert loop.reward_term_means([{"exact": np.array([1.0])}], 3) == {"rewards/exact": 1.0}


def test_a_resumed_stale_run_trains_every_data_position_once(runs):
  # The resumed run restarts its producer at step 3 with version 2 (staleness 0 there); it trains the
  # same prompts in the same order as the uninterrupted run: nothing lost, nothing twice.
  full, resumed = records(runs["k1"]), records(runs["resumed"])
  assert [r["step"] for r in resumed] == [1, 2, 3]
  assert [r["policy_version"] for r in resumed] == [0, 0, 2]
  assert full[:2] == [{**r, **{k: full[i][k] for k in TIMINGS}} for i, r in enumerate(resumed[:2])]
  questions = lambda d: [s["question"] for s in records(d, "samples.jsonl")]
  assert questions(runs["resumed"]) == questions(runs["k1"])


@pytest.mark.heavy   # one smoke run on 8 fake devices, ~1 min. CI covers the pieces: the producer above, and the
# mesh step with the correction (tests/test_train.py's mesh runs, tests/test_rollout_correction.py's heavy one).
def test_a_stale_run_on_an_fsdp_mesh_logs_what_one_device_logs(runs, tmp_path):
  # The producer samples on the mesh's devices from a copy of FSDP-sharded parameters while the mesh
  # step runs: the same versions, and the same mismatch against the older policy as on one device.
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(Task, "score", length_score)
    train.train(stale_smoke(tmp_path, **{"train.max_staleness": 1, "mesh.data": 2, "mesh.branch": 4,
                                         "mesh.params": "fsdp", "train.micro_batch": 1}))
  mesh, one = records(tmp_path), records(runs["k1"])
  assert [r["policy_version"] for r in mesh] == [0, 0, 1]
  for a, b in zip(mesh, one):
    assert a["sampler_logp_diff_mean"] == pytest.approx(b["sampler_logp_diff_mean"], rel=1e-3, abs=1e-6)
    assert a["reward_mean"] == b["reward_mean"]
