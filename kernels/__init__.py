"""Suffix attention for branch replay: a dense jnp reference (the oracle and CPU default).

Installed as `branch_replay_jax.kernels` (see setup.cfg) so that it never shadows the unrelated
top-level `kernels` package of the Hugging Face ecosystem.
"""

from branch_replay_jax.kernels.reference import KVBlock, suffix_attention

__all__ = ["KVBlock", "suffix_attention"]
