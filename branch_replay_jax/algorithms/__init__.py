"""The one training loop (loop.py) and the algorithms that plug into it: GRPO / RLOO (grpo.py), PPO (ppo.py),
DPO / IPO (dpo.py). The loop's parts: run setup and resume (runs.py), config checks (checks.py),
placement on the mesh (placement.py), the held-out evaluation (evaluation.py)."""
