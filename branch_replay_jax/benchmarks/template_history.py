"""What rollout.episodes.history = "template" costs and shares on real episodes: the calculator
experiment's model (SmolLM2-135M-Instruct, embedded) and environment, its episodes sampled with the
model given the chat template's rendering of the conversation (rollout/chat.py), under the model's
own template (ChatML: each message rendered alone) and under Qwen3's non-thinking format
(qwen3_no_thinking: the generation prompt opens an empty `<think>\n\n</think>\n\n` block, which the
rendering of an earlier assistant turn leaves out, so every turn after the first is a rewrite; or
drops_reasoning: only a turn's own `<think>..</think>` is dropped; or trims: Llama 3's `| trim` of every
content), then the GRPO step on the same
episodes by replay over the rows' trie and by the naive rows, side by side.

    python -m branch_replay_jax.benchmarks.template_history --problems=2 --templates=own,qwen3_no_thinking

Prints one JSON line per template:
- episodes, turns, rows (`EpisodeResult.rows`), rewritten_episodes (episodes of more than one row);
- prefilled (tokens the episode sampler ran through a prefill, the rewrites' partial re-prefills
  included) against prefilled_full (what re-prefilling each turn's whole context costs: the sum of
  the turns' context lengths);
- positions_computed and positions_naive (the rows' trie against the naive per-turn rows,
  `data.counts.tree_counts`) and their ratio;
- exactness_grad_rel_err / exactness_loss_rel_err / exactness_ok: the run-time check
  (algorithms/exactness.py) of one problem's trie by replay against its naive rows, float32;
- sample_s and sample_cpu_s (wall and CPU seconds of sampling the episodes);
- with --time_steps: replay_step_s / naive_step_s (wall) and their CPU seconds, of one GRPO update
  (`grpo.update_on_batch`, the experiment's train settings) on the same groups, each after one
  untimed run that compiles it, and speedup (naive / replay, wall and CPU).
"""

from __future__ import annotations

import dataclasses
import json
import time

import jax
from absl import app, flags
from flax import nnx

from branch_replay_jax.algorithms import grpo, runs
from branch_replay_jax.algorithms.groups import rollout_group
from branch_replay_jax.benchmarks.chat_templates import DROPS_REASONING, QWEN3_NO_THINKING, TRIMS
from branch_replay_jax.benchmarks.replay import cpu_seconds
from branch_replay_jax.rollout import collect
from branch_replay_jax.rollout.episode_sampler import EpisodeSampler
from experiments import grpo_smollm2_calc

flags.DEFINE_integer("problems", 4, "problems (task items 0..problems-1), G = the experiment's group_size each")
flags.DEFINE_list("templates", ["own", "qwen3_no_thinking"], "own (the tokenizer's), qwen3_no_thinking, drops_reasoning, trims")
flags.DEFINE_bool("time_steps", True, "also time one GRPO update by replay and by the naive rows")
flags.DEFINE_integer("seed", 0, "sampling key")
FLAGS = flags.FLAGS


class _Recorded(EpisodeSampler):
  """EpisodeSampler that keeps its instances and the context length of each turn it samples."""
  made: list = []

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.contexts = []
    type(self).made.append(self)

  def __call__(self, ids, budget):
    self.contexts.append(len(ids))
    return super().__call__(ids, budget)


def main(_):
  config = grpo_smollm2_calc.get_config()
  config.rollout.episodes.history = "template"
  config.run_dir = "/tmp/template_history_bench"
  algorithm = grpo.GRPO(config)
  model, tokenizer = runs.build_model(config)
  own = tokenizer.chat_template
  graphdef, params = nnx.split(model)
  check = grpo.GRPOFunctions(runs_config(config), graphdef)
  collect.EpisodeSampler = _Recorded
  for name in FLAGS.templates:
    tokenizer.chat_template = {"own": own, "drops_reasoning": DROPS_REASONING, "qwen3_no_thinking": QWEN3_NO_THINKING,
                               "trims": TRIMS}[name]
    _Recorded.made = []
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    groups = [rollout_group(config, model, tokenizer, algorithm.task, pos, jax.random.fold_in(jax.random.key(FLAGS.seed), pos),
                            env=algorithm.env) for pos in range(FLAGS.problems)]
    sample_s, sample_cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    rows = sum(g.naive_batch.branches.tokens.shape[0] for g in groups)
    episodes = sum(len(g.rewards) for g in groups)
    out = check.check(params, params, groups)
    print(json.dumps({
        "template": name, "problems": FLAGS.problems, "episodes": episodes,
        "turns": int(sum(g.episode_stats["turns"].sum() for g in groups)), "rows": rows,
        "rewritten_episodes": sum(1 for s in _Recorded.made if s.reprefills),
        "reprefills": sum(s.reprefills for s in _Recorded.made),
        "prefilled": sum(s.prefilled for s in _Recorded.made),
        "prefilled_full": sum(sum(s.contexts) for s in _Recorded.made),
        "positions_computed": sum(g.counts["token_positions_computed"] for g in groups),
        "positions_naive": sum(g.counts["token_positions_naive"] for g in groups),
        "naive_over_computed": round(sum(g.counts["token_positions_naive"] for g in groups)
                                     / sum(g.counts["token_positions_computed"] for g in groups), 3),
        **{k: out[k] for k in ("exactness_ok", "exactness_grad_rel_err", "exactness_loss_rel_err") if out and k in out},
        "sample_s": round(sample_s, 1), "sample_cpu_s": round(sample_cpu, 1),
        **(_time_steps(config, graphdef, params, groups) if FLAGS.time_steps else {})}), flush=True)


def _time_steps(config, graphdef, params, groups) -> dict:
  """Wall and CPU seconds of one GRPO update by replay (the groups as built: the rows' trie) and by the
  naive rows (each group's `naive_batch`, what train.gradient = "naive" builds), each timed after an
  untimed run that compiles it; the reference policy is the policy (the KL term computed, 0)."""
  out = {}
  for gradient in ("replay", "naive"):
    cfg = config.copy_and_resolve_references()
    cfg.train.gradient = gradient
    batch = groups if gradient == "replay" else [
        dataclasses.replace(g, kind="group", batch=g.naive_batch, naive_batch=None) for g in groups]
    optimizer = runs.make_optimizer(cfg)
    fns = grpo.GRPOFunctions(cfg, graphdef, None, optimizer)
    for timed in (False, True):
      p = jax.tree_util.tree_map(lambda x: x.copy(), params)
      cpu0, t0 = cpu_seconds(), time.perf_counter()
      _, _, stats, _ = grpo.update_on_batch(cfg, fns, p, params, optimizer.init(p), batch)
      wall, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    out.update({f"{gradient}_step_s": round(wall, 2), f"{gradient}_step_cpu_s": round(cpu, 2),
                f"{gradient}_loss": stats["loss"], f"{gradient}_grad_norm": stats["grad_norm"]})
  out["speedup"] = round(out["naive_step_s"] / out["replay_step_s"], 3)
  out["cpu_speedup"] = round(out["naive_step_cpu_s"] / out["replay_step_cpu_s"], 3)
  return out


def runs_config(config):
  """The experiment with the run-time exactness check due at every step (its first group with unequal rewards)."""
  c = config.copy_and_resolve_references()
  c.train.exactness_check_every = 1
  return c


if __name__ == "__main__":
  app.run(main)
