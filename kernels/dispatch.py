"""Choosing the suffix-attention implementation: "xla" (the jnp reference), "pallas" (the Triton
FlashAttention-2 kernels) or "splash" (JAX's TPU splash attention kernels)."""

from __future__ import annotations

from typing import Callable

import jax
from absl import logging

from branch_replay_jax.kernels.pallas_attention import HEAD_DIMS, suffix_attention_pallas
from branch_replay_jax.kernels.reference import suffix_attention
from branch_replay_jax.kernels.splash_attention import SPLASH_HEAD_DIMS, suffix_attention_splash

ATTENTION_IMPLS = ("xla", "pallas", "splash", "auto")
"""xla: the dense jnp reference, any shape, every backend. pallas: the Pallas kernels of the
backend: on a TPU splash attention (Mosaic), elsewhere the FlashAttention-2 kernels (Triton on
GPUs, the Pallas interpreter on the CPU). splash: splash attention on any backend (interpreted on
the CPU; for tests). auto: pallas on a GPU or TPU when the head dim is one its kernels take, else
xla (with a logged warning on a GPU or TPU)."""


def resolve_attention_impl(impl: str, head_dim: int, backend: str | None = None) -> str:
  """"xla", "pallas" (Triton kernels) or "splash" for a requested name and head dim on `backend`.

  `backend` defaults to JAX's default backend. "pallas" on a TPU resolves to "splash".

  Raises:
    ValueError: for an unknown name, or "pallas"/"splash" with a head dim its kernels do not take
      (`HEAD_DIMS` for Triton, `SPLASH_HEAD_DIMS` for splash).
  """
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f"attention_impl={impl!r}; expected one of {ATTENTION_IMPLS}")
  backend = backend or jax.default_backend()
  if impl == "xla":
    return impl
  if impl == "auto":
    if backend not in ("gpu", "tpu"):
      return "xla"
    kernel, dims = ("splash", SPLASH_HEAD_DIMS) if backend == "tpu" else ("pallas", HEAD_DIMS)
    if head_dim not in dims:
      logging.warning("attention_impl='auto': head dim %d is not in %s (%s kernels), using the xla reference",
                      head_dim, dims, kernel)
      return "xla"
    return kernel
  kernel = "splash" if impl == "splash" or backend == "tpu" else "pallas"
  dims = SPLASH_HEAD_DIMS if kernel == "splash" else HEAD_DIMS
  if head_dim not in dims:
    raise ValueError(f"attention_impl={impl!r} ({kernel} kernels on {backend}) needs a head dim in {dims}, the "
                     f"model has {head_dim}; use 'xla' (or 'auto', which falls back to it)")
  return kernel


def attention_fn(impl: str) -> Callable:
  """The `suffix_attention`-compatible function for a resolved implementation name."""
  return {"xla": suffix_attention, "pallas": suffix_attention_pallas, "splash": suffix_attention_splash}[impl]
