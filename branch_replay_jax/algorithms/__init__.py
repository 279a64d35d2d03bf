"""The one training loop (loop.py) and the algorithms that plug into it: GRPO / RLOO (grpo.py), PPO (ppo.py),
DPO / IPO (dpo.py)."""
