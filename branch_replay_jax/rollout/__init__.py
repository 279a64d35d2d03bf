"""Rollouts: the KV-cache sampler (sampler.py), tree rollouts (tree_sampler.py), one prompt's collection
(collect.py: sample, score, advantages, layout) and the reasoning-gym tasks (tasks/)."""
