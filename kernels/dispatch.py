"""Choosing the suffix-attention implementation: "xla" (the jnp reference) or "pallas" (the kernels)."""

from __future__ import annotations

from typing import Callable

import jax
from absl import logging

from branch_replay_jax.kernels.pallas_attention import HEAD_DIMS, suffix_attention_pallas
from branch_replay_jax.kernels.reference import suffix_attention

ATTENTION_IMPLS = ("xla", "pallas", "auto")
"""xla: the dense jnp reference, any shape, every backend. pallas: the FlashAttention-2 kernels
(Triton on GPUs, the Pallas interpreter on the CPU; untested under Mosaic on TPUs). auto: pallas on
a GPU when the head dim is one the kernels take, else xla (with a logged warning on a GPU)."""


def resolve_attention_impl(impl: str, head_dim: int, backend: str | None = None) -> str:
  """"xla" or "pallas" for a requested implementation and head dim on `backend` (default: JAX's).

  Raises:
    ValueError: for an unknown name, or "pallas" with a head dim outside `HEAD_DIMS`.
  """
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f"attention_impl={impl!r}; expected one of {ATTENTION_IMPLS}")
  if impl == "pallas" and head_dim not in HEAD_DIMS:
    raise ValueError(f"attention_impl='pallas' needs a head dim in {HEAD_DIMS}, the model has {head_dim}; "
                     f"use 'xla' (or 'auto', which falls back to it)")
  if impl != "auto":
    return impl
  if (backend or jax.default_backend()) != "gpu":
    return "xla"
  if head_dim not in HEAD_DIMS:
    logging.warning("attention_impl='auto': head dim %d is not in %s, using the xla reference", head_dim, HEAD_DIMS)
    return "xla"
  return "pallas"


def attention_fn(impl: str) -> Callable:
  """The `suffix_attention`-compatible function for a resolved implementation name."""
  return {"xla": suffix_attention, "pallas": suffix_attention_pallas}[impl]
