"""Rollout data on the host: groups (groups.py), trees and their level layout (trees.py), token-position and
FLOP counts (counts.py). Pure numpy; nothing here imports a model."""
