"""Benchmark agent-shaped episodes: replay over the episode tree, the naive flat rows and prompt-only
sharing side by side, and the sampler with and without the KV cache kept across turns.

  python -m branch_replay_jax.benchmarks.episodes --config=experiments/bench_episodes.py          # SmolLM2-135M shapes
  python -m branch_replay_jax.benchmarks.episodes --config=experiments/bench_episodes.py:smoke    # tiny, seconds

A case (P, T, O, fanouts) is one problem's episodes (data/episodes.py): a P-token prompt, then K =
len(fanouts) model turns of T tokens with an O-token observation after each turn but the last. Turn
k branches F_k ways (F_1 = G at the first turn and 1 later: G independent episodes; "2,2,2": a
branch at every turn boundary), so G = prod(fanouts) episodes. Tokens are random (the step's cost does
not depend on them); sibling turns differ in their first token, so the tree is exactly the branching.

Prints one JSON object per case with:
- ideal_flop_ratio (naive / replay) and ideal_flop_ratio_prompt_only (naive / prompt-only), both by
  `data.counts.ideal_flop_ratio`, and the token positions each layout computes;
- naive_s, replay_s, packed_s, prompt_only_s (median wall seconds of one jitted GRPO gradient step) and their
  CPU seconds (user + system of this process: robust to other jobs on the cores), speedup /
  cpu_speedup of replay and prompt_only_speedup / prompt_only_cpu_speedup against naive, and
  speedup_over_ideal = speedup / ideal_flop_ratio;
- max_rel_grad_err of replay, packed and prompt-only against naive; packed_speedup (and over the ideal,
  the tree's) and packed_row_length;
- with config.sampler: the sampler's seconds (wall, CPU) per episode with the KV cache kept across
  turns (`rollout.episode_sampler.EpisodeSampler`, the prompt's K/V shared by the G branches) and
  with the whole history re-prefilled every turn, and the tokens each prefills per episode. The
  sampler branches at the first turn only (G episodes of K turns each), whatever the fanouts.

Layouts: naive = every episode its own row with a loss mask (`episode_group_arrays`, how verl and
TRL train); replay = the episode tree (`episode_tree_arrays` of `episode_tree`): every shared turn
and observation computed once (the tree step, rollout.episodes.share = "tree"); prompt-only = the
naive rows through the group replay step, the prompt computed once and each episode's turns and
observations one row (rollout.episodes.share = "prompt"; what prompt-only stacks such as
PrefixGrouper compute; its positions are `data.episodes.prompt_only_tree`'s); packed = the episode
tree as one row whose attention mask is the tree (`data.batches.pack_trees`, train.tree_layout =
"packed"; the tree's positions, each attention pair of the causal triangle computed). All four use the
same objective terms (GRPO on-policy, as benchmarks/replay.py) and the same jitted step builder
(`gradients.step.value_and_grad`); each is compiled, run once untimed, then timed `repeats` times in
this process, one mode after another.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx
from ml_collections import config_flags

from branch_replay_jax import losses as obj
from branch_replay_jax.benchmarks.replay import (GRPO_OBJECTIVE, cpu_seconds, emitter,
                                                 load_model)
from branch_replay_jax.core.tree_replay import SCHEDULES
from branch_replay_jax.data.batches import pack_trees
from branch_replay_jax.data.counts import tree_counts
from branch_replay_jax.data.episodes import (MODEL, OBSERVATION, Episode, episode_group_arrays, episode_tree,
                                             episode_tree_arrays, prompt_only_tree)
from branch_replay_jax.gradients.heads import POLICY
from branch_replay_jax.gradients.step import value_and_grad
from branch_replay_jax.rollout.episode_sampler import EpisodeSampler


def parse_case(case) -> dict:
  """(P, T, O, "F_1,...,F_K") -> dict; ValueError naming the field for a bad value."""
  p, t, o, fanouts = case
  fanouts = [int(f) for f in str(fanouts).split(",")]
  for name, value in (("P", p), ("T", t), ("O", o)):
    if int(value) < 1:
      raise ValueError(f"bench_episodes: case {case!r}: {name}={value!r} must be >= 1")
  if not fanouts or min(fanouts) < 1:
    raise ValueError(f"bench_episodes: case {case!r}: fanouts must be integers >= 1")
  return {"P": int(p), "T": int(t), "O": int(o), "fanouts": fanouts, "turns": len(fanouts),
          "G": int(np.prod(fanouts))}


def case_episodes(case: dict, vocab: int, seed: int) -> list[Episode]:
  """The G episodes of one case (see the module docstring), random ids in [0, vocab)."""
  rng = np.random.default_rng(seed)
  prompt = rng.integers(0, vocab, case["P"]).astype(np.int32)
  episodes = []

  def grow(segments, roles, depth):
    if depth == case["turns"]:
      episodes.append(Episode(prompt, tuple(segments), tuple(roles)))
      return
    for i in range(case["fanouts"][depth]):
      turn = rng.integers(0, vocab, case["T"]).astype(np.int32)
      turn[0] = i   # siblings differ at their first token
      if depth + 1 < case["turns"]:
        observation = rng.integers(0, vocab, case["O"]).astype(np.int32)
        grow(segments + [turn, observation], roles + [MODEL, OBSERVATION], depth + 1)
      else:
        grow(segments + [turn], roles + [MODEL], depth + 1)

  grow([], [], 0)
  return episodes


def _time_step(step, params, arrays, repeats: int) -> dict:
  t0 = time.perf_counter()
  compiled = step.lower(params, arrays).compile()
  compile_s = time.perf_counter() - t0
  jax.block_until_ready(compiled(params, arrays))   # warm-up, untimed
  times, cpu = [], []
  for _ in range(repeats):
    t0, c0 = time.perf_counter(), cpu_seconds()
    out = jax.block_until_ready(compiled(params, arrays))
    times.append(time.perf_counter() - t0)
    cpu.append(cpu_seconds() - c0)
  return {"s": statistics.median(times), "cpu_s": statistics.median(cpu), "compile_s": compile_s, "times": times,
          "grads": [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(out[2])]}


def _rel_err(got, want) -> float:
  return max(float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)) for a, b in zip(got, want))


def _sampler_run(model, case, episodes, key, *, keep_cache, temperature) -> tuple[float, float, int]:
  """(wall s, CPU s, tokens prefilled) to sample G episodes of K turns from the prompt, each turn T
  tokens (no stop id), the case's observations (episode 0's) appended between turns."""
  observations = [s for s, r in zip(episodes[0].segments, episodes[0].roles) if r == OBSERVATION]
  prompt = np.asarray(episodes[0].prompt).tolist()
  t0, c0 = time.perf_counter(), cpu_seconds()
  samplers = EpisodeSampler.branches(model, prompt, case["G"], key=key, temperature=temperature,
                                     keep_cache=keep_cache)
  for s in samplers:
    ids = list(prompt)
    for k in range(case["turns"]):
      ids += s(ids, case["T"])
      if k < len(observations):
        ids += observations[k].tolist()
  return time.perf_counter() - t0, cpu_seconds() - c0, sum(s.prefilled for s in samplers)


def run_case(config, index: int, model, emit) -> dict:
  case = parse_case(config.cases[index])
  cfg = model.config
  graphdef, params = nnx.split(model)
  episodes = case_episodes(case, cfg.vocab_size, config.seed + index)
  g = case["G"]
  rng = np.random.default_rng(config.seed)
  adv = np.asarray(obj.group_advantages(jnp.asarray(rng.normal(size=g), jnp.float32)))
  replay_tree, prompt_tree = episode_tree(episodes), prompt_only_tree(episodes)
  w = obj.trajectory_weights(replay_tree.model_lengths(), mode="sequence_mean").astype(np.float32)
  longest = max(len(e.tokens()) for e in episodes)
  naive_arrays = episode_group_arrays(episodes, adv, w, vocab_size=cfg.vocab_size, max_positions=cfg.max_positions,
                                      prompt_bucket=case["P"], completion_bucket=longest)
  naive_m = g if config.naive_micro_batch == 0 else config.naive_micro_batch
  naive_step = jax.jit(lambda p, a: value_and_grad(POLICY, graphdef, p, a, GRPO_OBJECTIVE, layout="naive",
                                                   micro_batch=naive_m, logprob_chunk=config.logprob_chunk))
  naive = _time_step(naive_step, params, naive_arrays, config.repeats)
  record = {"case": index, **{k: case[k] for k in ("P", "T", "O", "fanouts", "turns", "G")}}
  for name, etree in (("replay", replay_tree), ("packed", replay_tree), ("prompt_only", prompt_tree)):
    if name in ("replay", "packed"):
      arrays = episode_tree_arrays(etree, adv, w, prompt_bucket=case["P"], vocab_size=cfg.vocab_size,
                                   max_positions=cfg.max_positions)
      leaf_siblings = arrays.levels[-1].tokens.shape[-2]
      m = leaf_siblings if config.tree_micro_batch == 0 else config.tree_micro_batch
      if name == "packed":   # the same tree as one row (train.tree_layout = "packed")
        (arrays,) = pack_trees([arrays])
        record["packed_row_length"] = int(arrays.row.tokens.shape[0])
      step = jax.jit(lambda p, a: value_and_grad(POLICY, graphdef, p, a, GRPO_OBJECTIVE, schedule=config.tree_schedule,
                                                 micro_batch=m, logprob_chunk=config.logprob_chunk))
    else:   # the naive rows through the group replay step: the prompt once (rollout.episodes.share = "prompt")
      arrays = naive_arrays
      step = jax.jit(lambda p, a: value_and_grad(POLICY, graphdef, p, a, GRPO_OBJECTIVE, layout="replay",
                                                 micro_batch=naive_m, logprob_chunk=config.logprob_chunk))
    r = _time_step(step, params, arrays, config.repeats)
    counts = tree_counts(etree.tree, cfg)
    suffix = "" if name == "replay" else f"_{name}"
    record.update({f"{name}_s": r["s"], f"{name}_cpu_s": r["cpu_s"], f"{name}_compile_s": r["compile_s"],
                   f"{name}_times": r["times"], f"max_rel_grad_err{suffix}": _rel_err(r["grads"], naive["grads"]),
                   f"ideal_flop_ratio{suffix}": counts["ideal_flop_ratio"],
                   f"token_positions_{name}": counts["token_positions_computed"],
                   "token_positions_naive": counts["token_positions_naive"]})
  record.update({"naive_s": naive["s"], "naive_cpu_s": naive["cpu_s"], "naive_compile_s": naive["compile_s"],
                 "naive_times": naive["times"], "speedup": naive["s"] / record["replay_s"],
                 "cpu_speedup": naive["cpu_s"] / record["replay_cpu_s"],
                 "prompt_only_speedup": naive["s"] / record["prompt_only_s"],
                 "prompt_only_cpu_speedup": naive["cpu_s"] / record["prompt_only_cpu_s"],
                 "replay_over_prompt_only": record["prompt_only_s"] / record["replay_s"],
                 "packed_speedup": naive["s"] / record["packed_s"], "packed_cpu_speedup": naive["cpu_s"] / record["packed_cpu_s"]})
  record["packed_speedup_over_ideal"] = record["packed_speedup"] / record["ideal_flop_ratio"]
  record["speedup_over_ideal"] = record["speedup"] / record["ideal_flop_ratio"]
  record["cpu_speedup_over_ideal"] = record["cpu_speedup"] / record["ideal_flop_ratio"]
  if config.sampler:
    key = jax.random.key(config.seed)
    for keep, name in ((True, "kept"), (False, "reprefill")):
      _sampler_run(model, case, episodes, key, keep_cache=keep, temperature=config.temperature)   # compiles
      wall, cpu, prefilled = _sampler_run(model, case, episodes, key, keep_cache=keep, temperature=config.temperature)
      record.update({f"sampler_{name}_s_per_episode": wall / g, f"sampler_{name}_cpu_s_per_episode": cpu / g,
                     f"sampler_{name}_prefilled_per_episode": prefilled / g})
    record["sampler_speedup"] = record["sampler_reprefill_s_per_episode"] / record["sampler_kept_s_per_episode"]
    record["sampler_branching"] = "first turn"
  record.update({"model": config.model, "dtype": config.dtype, "tree_schedule": config.tree_schedule,
                 "naive_micro_batch": naive_m, "backend": jax.default_backend()})
  emit(record)
  return record


def main(argv):
  del argv
  config = flags.FLAGS.config
  for i in range(len(config.cases)):
    parse_case(config.cases[i])   # refuse a bad case before any compile
  if config.tree_schedule not in SCHEDULES:   # packed rows are timed as their own mode
    raise ValueError(f"bench_episodes: tree_schedule={config.tree_schedule!r} is not one of {SCHEDULES}")
  model = load_model(config, remat=config.remat)
  emit = emitter(config.output)
  for i in range(len(config.cases)):
    run_case(config, i, model, emit)


if __name__ == "__main__":
  config_flags.DEFINE_config_file("config", "experiments/bench_episodes.py", "Benchmark config.")
  app.run(main)
