"""Rollouts: the KV-cache sampler (sampler.py), tree rollouts (tree_sampler.py), one prompt's collection
(collect.py: sample, score, advantages, layout), the reasoning-gym tasks (tasks/), and agents: token-in,
token-out chat (chat.py), tools (tools.py) and environments with their episode loop (environments.py)."""
