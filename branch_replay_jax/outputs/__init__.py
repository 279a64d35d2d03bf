"""What a run writes: orbax checkpoints (checkpoints.py), metrics and samples JSON lines, plots and tree
drawings (plots.py)."""
