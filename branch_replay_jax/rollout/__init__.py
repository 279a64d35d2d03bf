"""Rollouts: the KV-cache sampler (sampler.py), tree rollouts (tree_sampler.py), one prompt's raw
trajectories (collect.py: sample and score; the loss arrays are algorithms/groups.py's), the
reasoning-gym tasks (tasks/), and agents: token-in, token-out chat (chat.py), tools (tools.py),
environments with their episode loop (environments.py) and the episode sampler (episode_sampler.py)."""
