"""DPO for the training loop (algorithms/loop.py): preference pairs, reference sums, the exact replay gradient.

One step:
  1. pairs. data.source = "task": for each of `rollout.prompts_per_step` prompts of a reasoning-gym
     task, sample G completions sharing one prefill (rollout/sampler.py), score them, and pair the
     best-reward completion (chosen) with the worst (rejected); a prompt whose G rewards are all
     equal gives no pair (counted in skipped_prompts). data.source = "jsonl": the next
     `data.pairs_per_step` lines of a {"prompt", "chosen", "rejected"} file (wrapping around);
  2. layout: one group per distinct prompt, its distinct completions as branches (gradients/preference.py);
  3. reference log-prob sums of the frozen initial policy (forward-only replay);
  4. the DPO (or IPO) gradient by two-pass replay (or naive), clipped by global norm, AdamW.
Steps 3-4 and the update are one jitted program per optimizer step
(`gradients.preference.make_preference_step`, on `gradients.step`'s forward, gradient and optax tail),
and step 1 samples and scores through the loop's (`loop.sample_each`, `rollout.collect.rollout`).
A step without pairs makes no update. With a device mesh (config.mesh: data x branch x seq > 1,
distributed/mesh.py; replay gradients), each pass of 3-4 runs on the step's groups padded to one
shape (`gradients.preference.replay_layout` with a mesh, `pad_groups`: padding completions and filler groups
carry zero weight) and stacked into one batch under `shard_map`: groups over `data`, completions
over `branch`, prompt tokens over `seq`; parameters and optimizer state replicated or
FSDP-sharded (mesh.params). Sampling (data.source = "task") is data-parallel on the mesh: the
prompts spread over every device (`placement.spread_devices`), each sampling from a copy of the
parameters gathered there with the key (seed, step, i), so the pairs are those of one device. As
several processes (distributed.num_processes) each process samples its devices' prompts and
every process receives every pair (or reads the same file lines), so all build the same batch and
place their own rows of it. Everything goes to RUN_DIR: metrics.jsonl, samples.jsonl,
preference.png, throughput.png, experiment.json and checkpoints/ (orbax; resume as every loop.train run).
"""

from __future__ import annotations

import json
import os

import numpy as np

from branch_replay_jax import losses as obj
from branch_replay_jax.algorithms import base, checks, loop, placement, producer, runs, schema
from branch_replay_jax.algorithms.checks import GRADIENTS, SCHEDULES
from branch_replay_jax.distributed import hosts
from branch_replay_jax.gradients import preference as pref
from branch_replay_jax.gradients.step import compiled_programs
from branch_replay_jax.models.loading import encode_chat
from branch_replay_jax.outputs import plots
from branch_replay_jax.rollout.collect import rollout

SOURCES = ("task", "jsonl")
FIELDS = ("prompt", "chosen", "rejected")


def validate(config, experiment=None) -> None:
  """Raise ValueError (naming the field and value) for settings that cannot run, before any compute,
  and for the fields of the other data source (task and rollout with jsonl; data.path and
  data.pairs_per_step with task), which would be ignored. `schema.parse` first: DPO's fields and types
  (unless `experiment` is its result already)."""
  if experiment is None:
    schema.parse(config, expect="dpo")
  d, t, p = config.data, config.train, config.dpo
  if d.source not in SOURCES:
    raise ValueError(f"data.source={d.source!r} is not one of {SOURCES}")
  if d.source == "jsonl" and producer.max_staleness(config):
    raise ValueError(f"{producer.FIELD}={producer.max_staleness(config)} with data.source='jsonl': the pairs are read, "
                     "not sampled by the policy, so nothing runs ahead; use 0")
  unused = (["task", "rollout"] if d.source == "jsonl" else ["data.path", "data.pairs_per_step"])
  for name in unused:
    section, _, field = name.rpartition(".")
    if (field in config[section]) if section else (name in config):
      raise ValueError(f"{name} does not apply to data.source={d.source!r}; remove it")
  checks.validate_common(config)
  if config.model.param_dtype != "float32":
    raise ValueError(f"model.param_dtype={config.model.param_dtype!r}: DPO's two-pass step keeps float32 parameters "
                     "(bfloat16 parameters are implemented for grpo and ppo); set it to 'float32'")
  if p.loss not in obj.PREFERENCE_LOSSES:
    raise ValueError(f"dpo.loss={p.loss!r} is not one of {obj.PREFERENCE_LOSSES}")
  if not p.beta > 0:
    raise ValueError(f"dpo.beta={p.beta!r} must be > 0")
  if not 0 <= p.label_smoothing < 0.5:
    raise ValueError(f"dpo.label_smoothing={p.label_smoothing!r} must lie in [0, 0.5)")
  if p.label_smoothing and p.loss != "sigmoid":
    raise ValueError(f"dpo.label_smoothing={p.label_smoothing!r} applies to dpo.loss='sigmoid' only (conservative "
                     f"DPO); dpo.loss={p.loss!r} has no label noise model; set it to 0")
  if t.gradient not in GRADIENTS:
    raise ValueError(f"train.gradient={t.gradient!r} is not one of {GRADIENTS}")
  if t.lr_schedule not in SCHEDULES:
    raise ValueError(f"train.lr_schedule={t.lr_schedule!r} is not one of {SCHEDULES}")
  counts = [("train.steps", t.steps), ("train.micro_batch", t.micro_batch),
            ("checkpoint_every", config.checkpoint_every)]
  if d.source == "jsonl":
    counts.append(("data.pairs_per_step", d.pairs_per_step))
  else:
    r = config.rollout
    counts += [("rollout.prompts_per_step", r.prompts_per_step), ("rollout.max_new_tokens", r.max_new_tokens)]
    if r.group_size < 2:
      raise ValueError(f"rollout.group_size={r.group_size}: a preference pair needs G >= 2 sampled completions")
  for name, value in counts:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"{name}={value!r} must be a positive int")
  # The step's groups are padded to the mesh (pad_groups): no divisibility to ask of the config.
  checks.validate_mesh_shape(config)


def fingerprint(config) -> dict:
  """Fields that define a DPO experiment: a run dir's checkpoints must belong to the same ones."""
  d = config.data
  data = ({"path": os.path.abspath(d.path), "pairs_per_step": d.pairs_per_step} if d.source == "jsonl" else
          {"task": config.task.name,
           **({} if config.task.get("source") is None else {"task_source": config.task.source}),   # as runs.fingerprint
           "task_seed": config.task.seed, "group_size": config.rollout.group_size,
           "prompts_per_step": config.rollout.prompts_per_step})
  return {"algorithm": "dpo", "model": config.model.name, "source": d.source, **data, "seed": config.seed}


def read_pairs_jsonl(path: str) -> list[dict]:
  """[{"prompt", "chosen", "rejected"}] from a JSON-lines file (blank lines skipped).

  Raises:
    ValueError: a missing file, or a line that is not a JSON object with non-empty string fields
      prompt, chosen and rejected, or whose chosen equals its rejected (naming the line number and
      the field); a file without pairs.
  """
  if not os.path.isfile(path):
    raise ValueError(f"data.path={path!r} is not a file")
  records = []
  with open(path) as f:
    for n, line in enumerate(f, start=1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path} line {n}: not valid JSON ({e.msg})") from e
      if not isinstance(record, dict):
        raise ValueError(f"{path} line {n}: expected a JSON object with fields {FIELDS}")
      for field in FIELDS:
        if not isinstance(record.get(field), str) or not record[field].strip():
          raise ValueError(f"{path} line {n}: field {field!r} must be a non-empty string, got {record.get(field)!r}")
      if record["chosen"] == record["rejected"]:
        raise ValueError(f"{path} line {n}: field 'rejected' equals field 'chosen'")
      records.append({k: record[k] for k in FIELDS})
  if not records:
    raise ValueError(f"data.path={path!r} holds no preference pairs")
  return records


def encode_pairs(records: list[dict], tokenizer, max_positions: int) -> list[pref.PreferencePair]:
  """Token ids: the prompt as a user turn through the chat template (models.loading.encode_chat),
  each completion as its text's ids followed by EOS (the sampler ends a reply the same way).

  Raises:
    ValueError: a prompt + completion longer than max_positions (naming the record's index).
  """
  pairs = []
  for i, r in enumerate(records):
    prompt = encode_chat(tokenizer, [{"role": "user", "content": r["prompt"]}])
    comps = [tokenizer.encode(r[f], add_special_tokens=False) + [tokenizer.eos_token_id]
             for f in ("chosen", "rejected")]
    if len(prompt) + max(map(len, comps)) > max_positions:
      raise ValueError(f"pair {i}: prompt ({len(prompt)} tokens) + completion ({max(map(len, comps))} tokens) "
                       f"exceeds the model's max_positions={max_positions}")
    pairs.append(pref.PreferencePair(np.asarray(prompt), np.asarray(comps[0]), np.asarray(comps[1])))
  return pairs


def sample_prompt(config, policy, tokenizer, task, key, data_pos: int) -> dict:
  """One task prompt's G completions sampled (one shared prefill) and scored, and its pair: {"pair":
  the best-reward completion (chosen) with the worst (rejected), None when the G rewards are all
  equal; "rewards", "correct", "truncated" [G] (cut by the budget without one of the model's stop
  ids, `models.loading.stop_ids`, or a stop string of rollout.stop_strings), "stop_reasons" [G] str
  ("eos", "stop_string", "length"); "reward_terms": {name: [G] float64} per function of
  task.rewards (NaN where one returned None; {} without task.rewards); "sample_s", "score_s";
  "sample": the texts logged for the pair}. Host values only (numpy), so that a prompt sampled on
  another process can be sent here. The sampling and scoring are the loop's (`rollout.collect.rollout`:
  the completions scored as a batch, `score_group`, TRL's batch signature for task.rewards); a
  failing reward function raises naming it and `data_pos`."""
  raw = rollout(config.rollout, policy, tokenizer, task, data_pos, key)
  comps = [row[:n] for row, n in zip(raw.tokens, raw.lengths)]
  rew = raw.task_rewards.astype(np.float32)
  out = {"pair": None, "rewards": rew, "correct": raw.correct, "truncated": raw.truncated,
         "stop_reasons": raw.stop_reasons, "reward_terms": raw.reward_terms or {}, "sample_s": raw.sample_s,
         "score_s": raw.score_s, "sample": None}
  if not bool(obj.constant_groups(rew)):
    best, worst = int(np.argmax(rew)), int(np.argmin(rew))
    out["pair"] = pref.PreferencePair(np.asarray(raw.prompt_ids), comps[best], comps[worst])
    chosen, rejected = tokenizer.batch_decode([comps[best], comps[worst]], skip_special_tokens=True)
    out["sample"] = {"data_pos": data_pos, "prompt": raw.sample["question"], "answer": raw.sample["answer"],
                     "chosen": chosen, "rejected": rejected, "chosen_reward": float(rew[best]),
                     "rejected_reward": float(rew[worst])}
  return out


def sample_pairs(config, policy, tokenizer, task, key, step: int, data_pos: int, *, devices=None) -> tuple[list, dict]:
  """(pairs, info) from `rollout.prompts_per_step` task prompts (`sample_prompt`), prompt i from
  task item data_pos + i with the key (seed, step, i) folded, as loop.sample_groups; info: the
  sampled completions' rewards, correctness, truncated flags and stop reasons [prompts * G],
  reward_terms (each prompt's, logged as rewards/NAME: `loop.reward_term_means`), skipped_prompts,
  sample_s, score_s and one logged sample (the first pair's).

  Args:
    policy: the model, or with `devices` {device: the model on it} for this process's devices.
    devices: None (every prompt here, one after another), or [prompts_per_step] the device of each
      prompt (`placement.spread_devices`): each of this process's devices samples its prompts in its own
      thread, all at once, and every process receives every prompt's pair and figures
      (`hosts.gather_items`, a collective), so all hold the step's pairs in the same order.
  """
  one = lambda device, pos, k: sample_prompt(config, policy if device is None else policy[device], tokenizer, task,
                                             k, pos)
  prompts = loop.sample_each(config.rollout.prompts_per_step, key, step, data_pos, one, devices=devices)
  pairs = [p["pair"] for p in prompts if p["pair"] is not None]
  info = {"rewards": np.concatenate([p["rewards"] for p in prompts]),
          "correct": np.concatenate([p["correct"] for p in prompts]),
          "truncated": np.concatenate([p["truncated"] for p in prompts]),
          "stop_reasons": np.concatenate([p["stop_reasons"] for p in prompts]),
          "reward_terms": [p["reward_terms"] for p in prompts],
          "skipped_prompts": sum(p["pair"] is None for p in prompts),
          "sample_s": sum(p["sample_s"] for p in prompts), "score_s": sum(p["score_s"] for p in prompts),
          "sample": next((p["sample"] for p in prompts if p["sample"] is not None), None)}
  return pairs, info


class DPOFunctions:
  """A DPO step as one jitted program per optimizer step (`gradients.preference.make_preference_step`:
  reference sums, the loss gradient and the update; compiled per group / batch shape), on one device
  or, with config.mesh, on the device mesh."""

  def __init__(self, config, graphdef, optimizer):
    t, p = config.train, config.dpo
    self.mesh, self.param_mode = placement.mesh_from(config), placement.param_layout(config)
    self.train_step = pref.make_preference_step(graphdef, optimizer, beta=p.beta, loss_type=p.loss,
                                                label_smoothing=p.label_smoothing, layout=t.gradient, mesh=self.mesh,
                                                micro_batch=t.micro_batch)

  def step(self, params, ref_params, opt_state, batch: pref.PreferenceBatch):
    """Reference sums, the loss gradient and one optimizer update, one program; returns (params,
    opt_state, stats)."""
    params, opt_state, out = self.train_step(params, ref_params, opt_state, batch)
    loss, metrics, grad_norm = out["loss"], out["metrics"], out["grad_norm"]
    stats = {"loss": float(loss), "chosen_reward": float(np.mean(metrics["chosen_reward"])),
             "rejected_reward": float(np.mean(metrics["rejected_reward"])),
             "reward_margin": float(np.mean(metrics["margin"])),
             "reward_accuracy": float(np.mean(metrics["correct"])), "grad_norm": float(grad_norm),
             "step_compiles": compiled_programs(self.train_step.program)}
    return params, opt_state, stats


class DPO(base.Algorithm):
  """DPO / IPO on preference pairs sampled and scored on the fly (data.source = "task") or read from
  a JSON-lines file ("jsonl"); the reference is the frozen initial policy."""

  name = "dpo"
  keep_initial = True

  def __init__(self, config, experiment=None):
    validate(config, experiment)
    super().__init__(config)
    self.records = read_pairs_jsonl(config.data.path) if config.data.source == "jsonl" else None
    self.task = None if self.records else runs.make_task_from(config)

  def fingerprint(self):
    return fingerprint(self.config)

  def setup(self, run):
    self.run = run
    cfg = run.model_config
    self.data = encode_pairs(self.records, run.tokenizer, cfg.max_positions) if self.records else None
    self.fns = DPOFunctions(self.config, run.graphdef, run.optimizer)
    mesh, mode = self.fns.mesh, self.fns.param_mode
    self.ref_params = placement.place(run.initial_params, mesh, mode)
    return placement.place(run.params, mesh, mode), placement.place(run.opt_state, mesh, mode)

  def collect(self, run, params, step, data_pos):
    """((pairs, info), next data position): the next pairs of the file, or pairs sampled from task prompts."""
    d = self.config.data
    if self.data is not None:
      pairs = [self.data[(data_pos + i) % len(self.data)] for i in range(d.pairs_per_step)]
      info = {"skipped_prompts": 0, "sample": _text_sample(self.records, data_pos)}
      return (pairs, info), data_pos + d.pairs_per_step
    devices = placement.spread_devices(self.fns.mesh, self.config.rollout.prompts_per_step)
    policy = placement.sampling_policy(run.graphdef, params, self.fns.mesh, devices)
    pairs, info = sample_pairs(self.config, policy, run.tokenizer, self.task, run.key, step, data_pos, devices=devices)
    return (pairs, info), data_pos + self.config.rollout.prompts_per_step

  def eval_policy(self, run, params, num_problems):
    """The policy `collect` samples with; on a mesh the problems spread over every device."""
    devices = placement.spread_devices(self.fns.mesh, num_problems)
    return placement.sampling_policy(run.graphdef, params, self.fns.mesh, devices), devices

  def update(self, params, opt_state, batch, step):
    """Lay the pairs out (`gradients.preference.make_batch`) and take one step; no update without pairs."""
    pairs, _ = batch
    stats, counts = {}, {"token_positions_naive": 0, "token_positions_computed": 0}
    if pairs:
      cfg, tokenizer = self.run.model_config, self.run.tokenizer
      layout = pref.make_batch(pairs, vocab_size=cfg.vocab_size, max_positions=cfg.max_positions,
                               pad_id=tokenizer.pad_token_id or 0)
      with placement.mesh_context(self.fns.mesh):
        params, opt_state, stats = self.fns.step(params, self.ref_params, opt_state, layout)
      counts = layout.counts
    return params, opt_state, {**stats, **counts}

  def log(self, bar, step, batch, stats, *, rollout_s, update_s, wall_s):
    pairs, info = batch
    counts = {k: stats.pop(k) for k in ("token_positions_naive", "token_positions_computed")}
    record = {**_record(step, len(pairs), info, stats, counts, rollout_s=rollout_s, update_s=update_s),
              "wall_s": wall_s}
    if hosts.is_primary():   # every process computes the record; process 0 writes it
      plots.append_jsonl(os.path.join(self.config.run_dir, "metrics.jsonl"), record)
      if info["sample"] is not None:
        plots.append_jsonl(os.path.join(self.config.run_dir, "samples.jsonl"), {"step": step + 1, **info["sample"]})
    bar.set_postfix(loss=f"{record['loss']:.4f}" if pairs else "-", pairs=len(pairs), step_s=f"{record['step_s']:.1f}")
    return record

  def write_plots(self):
    plots.write_preference_plots(self.config.run_dir)


def train(config, experiment=None) -> list[dict]:
  """Run the DPO experiment in `config` (see experiments/dpo_smollm2_arith.py); returns this run's metrics."""
  return loop.train(config, DPO(config, experiment))


def _text_sample(records: list[dict], data_pos: int) -> dict:
  return {"data_pos": data_pos, **records[data_pos % len(records)]}


def _record(step: int, num_pairs: int, info: dict, stats: dict, counts: dict, *, rollout_s: float,
            update_s: float) -> dict:
  """One metrics.jsonl line; the loss fields are null for a step without pairs (no update)."""
  loss_fields = ("loss", "chosen_reward", "rejected_reward", "reward_margin", "reward_accuracy", "grad_norm",
                 "step_compiles")
  record = {"step": step + 1, "pairs": num_pairs, "skipped_prompts": info["skipped_prompts"],
            **{k: stats.get(k) for k in loss_fields}, **{k: stats[k] for k in producer.METRICS}, **counts}
  if "rewards" in info:   # sampled pairs: the task reward of every sampled completion
    record.update(reward_mean=float(info["rewards"].mean()), accuracy=float(info["correct"].mean()),
                  truncated_frac=float(info["truncated"].mean()),
                  **loop.stop_reason_fracs(info["stop_reasons"]),
                  **loop.reward_term_means(info["reward_terms"], stats.get(loop.MATH_VERIFY_TIMEOUTS, 0)),
                  sample_s=info["sample_s"], score_s=info["score_s"])
  return {**record, "update_s": update_s, "step_s": rollout_s + update_s}
