"""The figures of README.md from the raw jsonl beside it (no dependencies):

  python docs/results/own-task-smollm2/summarize.py chain_sum gcd learn_api

Training reward: the mean over the 16 completions of each of the first and last 5 steps (80
completions), with a normal 95% interval mean +- 1.96 sqrt(var / 80), var pooled from the steps'
reward_mean and reward_std (the completions of one group are correlated, so the interval is
narrower than an exact one). Held-out accuracy: the greedy evaluation's 95% Wilson interval
(rollout/evaluate.py).
"""
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def window(rows):
  mu = sum(r["reward_mean"] for r in rows) / len(rows)
  var = sum(r["reward_std"] ** 2 + (r["reward_mean"] - mu) ** 2 for r in rows) / len(rows)
  return mu, 1.96 * math.sqrt(var / (16 * len(rows)))


for run in sys.argv[1:]:
  m = [json.loads(l) for l in open(os.path.join(HERE, f"{run}_metrics.jsonl"))]
  e = [json.loads(l) for l in open(os.path.join(HERE, f"{run}_eval.jsonl"))]
  (s, ds), (t, dt) = window(m[:5]), window(m[-5:])
  print(f"{run}: train reward steps 1-5 {s:.3f} +- {ds:.3f}; steps {m[-5]['step']}-{m[-1]['step']} {t:.3f} +- {dt:.3f}")
  for k in (k for k in m[0] if k.startswith("rewards/")):
    print(f"  {k}: steps 1-5 {sum(r[k] for r in m[:5]) / 5:.3f}; last 5 {sum(r[k] for r in m[-5:]) / 5:.3f}")
  for r in e:
    print(f"  eval step {r['step']}: accuracy {r['accuracy']:.3f} [{r['accuracy_lo']:.3f}, {r['accuracy_hi']:.3f}] "
          f"reward {r['reward_mean']:.3f} format {r['format_rate']:.2f} ({r['problems']} problems)")
  print(f"  training wall {m[-1]['wall_s']:.0f} s")
