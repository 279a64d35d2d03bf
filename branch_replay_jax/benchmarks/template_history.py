"""What rollout.episodes.history = "template" costs and shares on real episodes: the calculator
experiment's model (SmolLM2-135M-Instruct, embedded) and environment, its episodes sampled with the
model given the chat template's rendering of the conversation (rollout/chat.py), under the model's
own template and under a Qwen3-style one that drops an earlier turn's <think>.

    python -m branch_replay_jax.benchmarks.template_history --problems=4 --templates=own,drops_reasoning

Prints one JSON line per template:
- episodes, turns, rows (`EpisodeResult.rows`), rewritten_episodes (episodes of more than one row);
- prefilled (tokens the episode sampler ran through a prefill, the rewrites' partial re-prefills
  included) against prefilled_full (what re-prefilling each turn's whole context costs: the sum of
  the turns' context lengths);
- positions_computed and positions_naive (the rows' trie against the naive per-turn rows,
  `data.counts.tree_counts`) and their ratio;
- exactness_grad_rel_err / exactness_loss_rel_err / exactness_ok: the run-time check
  (algorithms/exactness.py) of one problem's trie by replay against its naive rows, float32;
- sample_s and sample_cpu_s (wall and CPU seconds of sampling the episodes).
"""

from __future__ import annotations

import json
import time

import jax
from absl import app, flags
from flax import nnx

from branch_replay_jax.algorithms import grpo, runs
from branch_replay_jax.algorithms.groups import rollout_group
from branch_replay_jax.benchmarks.replay import cpu_seconds
from branch_replay_jax.rollout import collect
from branch_replay_jax.rollout.episode_sampler import EpisodeSampler
from experiments import grpo_smollm2_calc

flags.DEFINE_integer("problems", 4, "problems (task items 0..problems-1), G = the experiment's group_size each")
flags.DEFINE_list("templates", ["own", "drops_reasoning"], "own (the tokenizer's) and/or drops_reasoning")
flags.DEFINE_integer("seed", 0, "sampling key")
FLAGS = flags.FLAGS

# A Qwen3-style template (its multi-turn rule): an assistant message that is not the last one loses
# its <think> reasoning; every message otherwise as SmolLM2's ChatML.
DROPS_REASONING = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
    "{{ '<|im_start|>assistant\n' + m['content'].split('</think>')[-1].lstrip() + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


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
    tokenizer.chat_template = {"own": own, "drops_reasoning": DROPS_REASONING}[name]
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
        "sample_s": round(sample_s, 1), "sample_cpu_s": round(sample_cpu, 1)}), flush=True)


def runs_config(config):
  """The experiment with the run-time exactness check due at every step (its first group with unequal rewards)."""
  c = config.copy_and_resolve_references()
  c.train.exactness_check_every = 1
  return c


if __name__ == "__main__":
  app.run(main)
