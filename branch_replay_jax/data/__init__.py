"""Rollout data on the host: groups (groups.py), trees and their level layout (trees.py), token-position and
FLOP counts (counts.py), typed batches (batches.py), agentic episodes and their two layouts (episodes.py).
Pure numpy; nothing here imports a model."""
