"""Benchmarks, one CLI style: `python -m branch_replay_jax.benchmarks.NAME --config=experiments/bench_NAME.py`."""
