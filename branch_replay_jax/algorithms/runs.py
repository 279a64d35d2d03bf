"""A run's setup and resume (what `loop.train` starts from): the model (`build_model`), its parameter
dtype casts (`param_casts`), the optimizer (`make_optimizer`; every algorithm folds its update into
its one-program step: `gradients.step.make_train_step`, DPO's `gradients.preference.make_preference_step`),
the fields that define an experiment (`fingerprint`), the task
(`make_task_from`), the process count check (`check_processes`), and `start_run`: RUN_DIR opened
and checked (`prepare_run_dir`), the latest checkpoint restored when config.resume, the logs cut
back to the step the run continues from (`Run`)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from tqdm import tqdm

from branch_replay_jax.algorithms.checks import TINY_MAX_POSITIONS, lora_spec
from branch_replay_jax.distributed import hosts
from branch_replay_jax.models import Llama, lora, tiny_config
from branch_replay_jax.outputs import plots
from branch_replay_jax.outputs.checkpoints import (RunCheckpoints, check_run_dir, config_changes, open_run_dir,
                                                  write_run_record)
from branch_replay_jax.rollout.environments import calculator_examples, make_environment
from branch_replay_jax.rollout.tasks.sources import make_task_from_fields

def build_model(config):
  """(model, tokenizer). "tiny" is a random 2-layer model over SmolLM2's real tokenizer. With
  config.lora the model carries LoRA adapters (models.lora.add_adapters: B = 0, so it computes the
  loaded model until trained; A drawn from config.seed)."""
  from branch_replay_jax.models.loading import load, load_tokenizer
  dtype = jnp.dtype(config.model.dtype)
  if config.model.name == "tiny":
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    cfg = tiny_config(vocab_size=len(tokenizer), max_positions=TINY_MAX_POSITIONS)
    model = Llama(cfg, dtype=dtype, remat=config.model.remat, attention_impl=config.model.attention_impl,
                  rngs=nnx.Rngs(config.seed))
  else:
    model, tokenizer = load(config.model.name, dtype=dtype, remat=config.model.remat,
                            attention_impl=config.model.attention_impl,
                            expert_matmul=config.model.get("expert_matmul", "ragged_dot"),
                            gated_delta_scan=config.model.get("gated_delta_scan", "xla"))
  if config.get("lora") is not None:
    rngs = nnx.Rngs(params=jax.random.fold_in(jax.random.key(config.seed), 1))
    lora.add_adapters(model, lora_spec(config, model.config), rngs=rngs)
  return model, tokenizer


def param_casts(config):
  """(cast, upcast) for model.param_dtype's mixed-precision scheme (docs/design.md, "Parameter dtype").

  The loop's parameters and optimizer state stay float32 (the master copy, Micikevicius et al.
  2018, arXiv 1710.03740, section 3.1); every gradient or log-prob step sees cast(params), the
  parameters rounded to model.param_dtype, so on a mesh the FSDP all-gathers and gradient
  reduce-scatters move that dtype; upcast(grads) returns the gradients to float32 for the update.
  Identities for "float32".
  """
  dtype = jnp.dtype(config.model.param_dtype)
  if dtype == jnp.float32:
    return (lambda p: p), (lambda g: g)
  cast = lambda tree, d: jax.tree_util.tree_map(lambda x: x.astype(d) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                                                tree)
  return (lambda p: cast(p, dtype)), (lambda g: cast(g, jnp.float32))


def make_optimizer(config) -> optax.GradientTransformation:
  t = config.train
  if t.lr_schedule == "cosine":
    lr = optax.warmup_cosine_decay_schedule(0.0, t.learning_rate, max(t.warmup_steps, 1), max(t.steps, 2),
                                            end_value=0.1 * t.learning_rate)
  else:
    lr = optax.join_schedules([optax.linear_schedule(0.0, t.learning_rate, t.warmup_steps),
                               optax.constant_schedule(t.learning_rate)], [t.warmup_steps])
  return optax.chain(optax.clip_by_global_norm(t.max_grad_norm), optax.adamw(lr, weight_decay=t.weight_decay))


def fingerprint(config) -> dict:
  """Fields that define an experiment: a run dir's checkpoints must belong to the same ones."""
  r = config.rollout
  shape = ({"tree_fanouts": list(r.tree_fanouts), "segment_length": r.segment_length} if r.tree_fanouts else
           {"group_size": r.group_size})
  if r.get("episodes") is not None:
    shape["environment"] = r.episodes.environment
  adapters = {} if config.get("lora") is None else {"lora": {"rank": config.lora.rank, "alpha": config.lora.alpha,
                                                             "targets": list(config.lora.targets)}}
  source = config.task.get("source")   # only when set: run dirs of the reasoning-gym presets keep their fingerprint
  task = {"task": config.task.name, **({} if source is None else {"task_source": source}), "task_seed": config.task.seed}
  return {"model": config.model.name, **task, **shape,
          "prompts_per_step": r.prompts_per_step, "seed": config.seed, **adapters}


def make_task_from(config, *, seed: int | None = None, size: int | None = None, split: str = "train"):
  """The task config.task describes (rollout/tasks/sources.py, `make_task_from_fields`: a reasoning-gym
  dataset, a local file, or a python task, with its prompt fields and reward functions); `seed` and
  `size` replace task.seed and task.size when given, and split="eval" builds the held-out
  evaluation's task (algorithms/evaluation.py). Raises ValueError naming the field and value."""
  t = config.task
  return make_task_from_fields(t, seed=t.seed if seed is None else seed, size=t.size if size is None else size,
                               split=split)


def make_episode_environment(config, task):
  """The run's environment with rollout.episodes (rollout/environments.py, `make_environment`: the
  environment rollout.episodes.environment names over `task`, with rollout.episodes.env_options; the
  calculator with rollout.episodes.few_shot solved examples from items 0.. of the task at
  task.few_shot_seed, `calculator_examples`), else None. Called when the algorithm is built, before
  the model loads.

  Raises:
    ValueError: an example problem the calculator cannot show a call for (naming its question), and
      `make_environment`'s (an environment path that does not resolve, a factory that raises, an
      object without the protocol's reset / step), naming the field.
  """
  e = config.rollout.get("episodes") if config.get("rollout") is not None else None
  if e is None:
    return None
  examples = []
  if e.few_shot:
    source = make_task_from(config, seed=config.task.few_shot_seed, size=e.few_shot)
    examples = calculator_examples(source, [source[i] for i in range(e.few_shot)])
  options = e.get("env_options")
  options = options.to_dict() if hasattr(options, "to_dict") else options   # a ConfigDict section
  return make_environment(e.environment, task, max_tool_calls=e.max_tool_calls, examples=examples, options=options)


def check_processes(config) -> None:
  """Raise ValueError when the processes this one belongs to differ from config.distributed's
  (`hosts.settings`: a run of several processes starts through `hosts.initialize`, as main.py
  does)."""
  n = hosts.settings(config)["num_processes"]
  if n != jax.process_count():
    raise ValueError(f"distributed.num_processes={n} but this is one of {jax.process_count()} processes: start the run "
                     "through branch_replay_jax.main (it calls distributed.hosts.initialize(config) first)")


@dataclasses.dataclass
class Run:
  """What a training loop starts from (start_run). `start` and `data_pos` are the step and data
  position to continue from; `initial_params` is a copy of the parameters before any update (the
  frozen reference policy; also after a resume), or None. `params` and `opt_state` belong to the
  loop: the first step donates them (read the loop's returned state, not these).
  With config.lora, `params` are the LoRA adapters alone (what is differentiated, optimised and
  checkpointed), `frozen` the base model's parameters (cast to model.param_dtype) and graphdef
  merges both (`nnx.merge(graphdef, params, frozen)`); `frozen` is None otherwise."""
  tokenizer: Any
  model_config: Any
  graphdef: Any
  params: Any
  initial_params: Any
  optimizer: optax.GradientTransformation
  opt_state: Any
  ckpt: RunCheckpoints
  key: jax.Array
  start: int
  data_pos: int
  frozen: Any = None

  def progress(self, config, desc: str):
    """The steps still to run, start .. config.train.steps - 1, as a tqdm progress bar."""
    return tqdm(range(self.start, config.train.steps), initial=self.start, total=config.train.steps, desc=desc,
                unit="step", disable=not hosts.is_primary())


def start_run(config, run_fingerprint: dict, *, optimizer_fn=make_optimizer, wrap=None,
              keep_initial: bool = False) -> Run:
  """Checks RUN_DIR against `run_fingerprint` (outputs.checkpoints.check_run_dir), builds the model
  (`wrap(model)` when given, e.g. an actor-critic), the optimizer `optimizer_fn(config)` and its
  state, restores the latest checkpoint when config.resume, and cuts every log the run appends to
  (RUN_DIR/*.jsonl, tree drawings) back to the step it continues from (plots.cut_logs_back).

  With config.lora only the adapters train (`models.lora.split`: params = adapters, frozen =
  base); each checkpoint records the base ({"model": model.name, "sha256": models.lora.base_hash})
  and a resume checks it before restoring.

  Before the model loads, RUN_DIR is opened (outputs.checkpoints.open_run_dir: a fresh run needs it
  empty, config.overwrite empties it first, config.resume continues it) and, resuming, every config
  field that differs from the run's experiment.json is printed; experiment.json then records this
  run's fingerprint, config and chat template (what the export reads).

  Raises:
    ValueError: RUN_DIR is not empty without resume or overwrite (open_run_dir), holds another
      experiment's checkpoints (check_run_dir), or, with config.lora, adapters trained on another
      base model (models.lora.check_base).
  """
  saved = prepare_run_dir(config, run_fingerprint)
  model, tokenizer = build_model(config)
  if hosts.is_primary():
    write_run_record(config.run_dir, run_fingerprint, saved, tokenizer.chat_template)
  model_config = model.config
  frozen, meta = None, {}
  if model.lora is None:
    graphdef, params = nnx.split(model if wrap is None else wrap(model))
  else:
    graphdef, params, frozen = lora.split(model)
    meta = {"lora_base": {"model": config.model.name, "sha256": lora.base_hash(frozen)}}
    frozen = param_casts(config)[0](frozen)   # the base never updates: held in model.param_dtype
  initial = jax.tree_util.tree_map(jnp.copy, params) if keep_initial and frozen is None else None
  optimizer = optimizer_fn(config)
  opt_state = optimizer.init(params)
  ckpt = RunCheckpoints(config.run_dir, meta=meta)
  key, start, data_pos = jax.random.key(config.seed), 0, 0
  if config.resume and ckpt.latest_step() is not None:
    if frozen is not None:
      lora.check_base(ckpt.meta(ckpt.latest_step()).get("lora_base"), meta["lora_base"],
                      f"run_dir={config.run_dir!r} checkpoint {ckpt.latest_step()}")
    abstract = {"params": params, "opt_state": opt_state, "rng": jax.random.key_data(key)}
    state, meta = ckpt.restore(ckpt.latest_step(), abstract)
    params, opt_state, key = state["params"], state["opt_state"], jax.random.wrap_key_data(state["rng"])
    start, data_pos = meta["step"], meta["data_pos"]
  if hosts.is_primary():
    plots.cut_logs_back(config.run_dir, start)
  return Run(tokenizer, model_config, graphdef, params, initial, optimizer, opt_state, ckpt, key, start, data_pos,
             frozen)


def prepare_run_dir(config, run_fingerprint: dict) -> dict:
  """Open config.run_dir on process 0 (`open_run_dir`; its verdict shared, so every process raises
  alike, and they continue once it is done), refuse another experiment's checkpoints on every
  process (`check_run_dir`), print the config fields a resume changes; returns this run's config
  as JSON (what experiment.json records)."""
  error = None
  if hosts.is_primary():
    try:
      open_run_dir(config.run_dir, resume=config.resume, overwrite=config.overwrite)
      os.makedirs(config.run_dir, exist_ok=True)
    except ValueError as e:
      error = str(e)
  error = hosts.allgather_objects(error)[0]   # also the barrier: overwrite's removal is done
  if error is not None:
    raise ValueError(error)
  # to_json_best_effort, not to_dict: it reads no field through ConfigDict.__getitem__, so
  # tests/test_config_fields.py still sees which fields the run itself reads.
  now = json.loads(config.to_json_best_effort())
  changes = config_changes(check_run_dir(config.run_dir, run_fingerprint), now)
  if changes and hosts.is_primary():
    print(f"resume: {len(changes)} config fields differ from run_dir={config.run_dir!r}'s experiment.json:\n" +
          "\n".join(f"  {k}: {a!r} -> {b!r}" for k, (a, b) in changes.items()), flush=True)
  return now
