"""Suffix attention for branch replay: a dense jnp reference (the oracle and CPU default) and
Pallas FlashAttention-2 kernels with the same signature (`suffix_attention_pallas`, Triton on GPUs)
and, for TPUs, JAX's splash attention behind that signature (`suffix_attention_splash`). A mixture of
experts' grouped matmul in tiles (`grouped_matmul`: a scan; `grouped_matmul_pallas`: Pallas kernels).

Installed as `branch_replay_jax.kernels` (see setup.cfg) so that it never shadows the unrelated
top-level `kernels` package of the Hugging Face ecosystem.
"""

from branch_replay_jax.kernels.dispatch import (ATTENTION_IMPLS, attention_fn, causal_block_attention,
                                                resolve_attention_impl)
from branch_replay_jax.kernels.pallas_attention import suffix_attention_pallas
from branch_replay_jax.kernels.reference import GLOBAL_WINDOW, KVBlock, suffix_attention, windowed_suffix_attention
from branch_replay_jax.kernels.splash_attention import suffix_attention_splash

__all__ = ["ATTENTION_IMPLS", "GLOBAL_WINDOW", "KVBlock", "attention_fn", "causal_block_attention",
           "resolve_attention_impl", "suffix_attention",
           "suffix_attention_pallas", "suffix_attention_splash", "windowed_suffix_attention"]
