"""Writes experiments/data/gcd_{train,eval}.jsonl: a "bring your own data" task for the README's
"Train on your own task" measurement (docs/results/own-task-smollm2). Each row is
{"prompt", "answer", "a", "b"}: the greatest common divisor of two numbers below 100 whose GCD is
at least 2 (so that a partial-credit reward, experiments/rewards/gcd.py, has divisors to credit).

  python experiments/data/make_gcd.py        # deterministic (seed 0 train, seed 1 eval)
"""

import json
import math
import os
import random

PHRASES = ("What is the greatest common divisor of {a} and {b}?",
           "Find the GCD of {a} and {b}.",
           "What is the largest number that divides both {a} and {b}?")


def rows(seed: int, n: int, exclude=frozenset()):
  rng, out, seen = random.Random(seed), [], set(exclude)
  while len(out) < n:
    a, b = rng.randint(4, 99), rng.randint(4, 99)
    if a == b or math.gcd(a, b) < 2 or (min(a, b), max(a, b)) in seen:
      continue
    seen.add((min(a, b), max(a, b)))
    out.append({"prompt": rng.choice(PHRASES).format(a=a, b=b), "answer": str(math.gcd(a, b)), "a": a, "b": b})
  return out


if __name__ == "__main__":
  here = os.path.dirname(os.path.abspath(__file__))
  train = rows(0, 1000)
  evals = rows(1, 200, exclude={(min(r["a"], r["b"]), max(r["a"], r["b"])) for r in train})
  for name, data in (("gcd_train.jsonl", train), ("gcd_eval.jsonl", evals)):
    with open(os.path.join(here, name), "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in data)
    print(name, len(data))
