"""RLOO (REINFORCE leave-one-out, Ahmadian et al. 2024, arXiv 2402.14740) with branch replay on
SmolLM2-135M-Instruct and reasoning-gym's basic_arithmetic.

The GRPO loop and settings of grpo_smollm2_arith.py, with each completion's advantage
A_i = r_i - mean_{j != i} r_j instead of the group-normalised one.

  python -m branch_replay_jax.main --config=experiments/rloo_smollm2_arith.py
  python -m branch_replay_jax.main --config=experiments/rloo_smollm2_arith.py:smoke      # tiny model, 2 steps
"""

from experiments import grpo_smollm2_arith


def get_config(arg=None):
  if arg not in (None, "", "smoke"):
    raise ValueError(f"experiments/rloo_smollm2_arith.py: unknown variant {arg!r}; use '' or 'smoke'")
  c = grpo_smollm2_arith.get_config(arg)
  c.algorithm = "grpo"                    # RLOO is the GRPO loop with loss.advantage = "rloo"
  c.loss.advantage = "rloo"
  del c.loss.advantage_eps                # RLOO's baseline divides by no standard deviation
  c.run_dir = "runs/rloo_smoke" if arg == "smoke" else "runs/rloo_smollm2_arith"
  return c
