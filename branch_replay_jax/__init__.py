"""branch_replay_jax: exact-gradient shared-prefix replay for RL post-training in JAX."""

__version__ = "0.1.0"
