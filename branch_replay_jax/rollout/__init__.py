"""Rollouts: the KV-cache sampler (sampler.py), tree rollouts (tree_sampler.py), one prompt's raw
trajectories (collect.py: sample and score; the loss arrays are algorithms/groups.py's) and the
reasoning-gym tasks (tasks/)."""
