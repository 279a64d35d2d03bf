"""GRPO with TREE rollouts (TreePO-style, arXiv 2508.17445) and nested branch replay.

Each prompt grows a tree: segments of `segment_length` tokens with fan-outs (4, 2, 2), so 16
trajectories share the prompt and, below it, their early response segments; a path that hits
EOS stops. Nested replay computes every distinct token position once.

  python -m branch_replay_jax.main --config=experiments/grpo_tree_smollm2_arith.py
  python -m branch_replay_jax.main --config=experiments/grpo_tree_smollm2_arith.py:smoke
"""

from experiments import grpo_smollm2_arith


def get_config(arg=None):
  c = grpo_smollm2_arith.get_config("smoke" if arg == "smoke" else None)
  c.algorithm = "grpo"                   # the GRPO loop (as grpo_smollm2_arith's)
  del c.rollout.group_size, c.rollout.max_new_tokens   # a tree's leaves are its group; segments bound its length
  c.rollout.tree_fanouts = (4, 2, 2)     # 16 trajectories per prompt
  c.rollout.segment_length = 12          # tokens per segment: completions of up to 36 tokens
  c.train.micro_batch = 2                # leaf siblings vmapped together (divides the last fan-out)
  c.train.steps = 20
  c.run_dir = "runs/grpo_tree_smollm2_arith"
  if arg == "smoke":
    c.rollout.tree_fanouts = (2, 2)
    c.rollout.segment_length = 4
    c.train.steps = 2
    c.run_dir = "runs/grpo_tree_smoke"
  elif arg not in (None, ""):
    raise ValueError(f"experiments/grpo_tree_smollm2_arith.py: unknown variant {arg!r}; use '' or 'smoke'")
  return c
