"""Choosing the suffix-attention implementation: "xla" (the jnp reference), "pallas" (the Triton
FlashAttention-2 kernels) or "splash" (JAX's TPU splash attention kernels); and `causal_block_attention`,
`jax.nn.dot_product_attention` for blocks without ancestors beside one of them (a benchmark's choice,
benchmarks/replay.py's config.prompt_attention)."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
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


DPA_IMPLEMENTATIONS = ("xla", "cudnn")


def causal_block_attention(implementation: str, suffix):
  """A `suffix_attention`-compatible function: `jax.nn.dot_product_attention(implementation=...)`
  for a block with no ancestors, `suffix(q, ancestors, own)` otherwise.

  The block's own keys must be right-padded (valid a prefix of each row, the layout of
  data.groups): they are masked by `key_value_seq_lengths`, causally. Queries at padded positions
  get garbage, as `Llama.__call__` allows. The returned lse is the implementation's log-sum-exp
  (`return_residual`); cuDNN's backward takes no cotangent for it (the model's layer discards it),
  so this function is not for the context-parallel merge, which differentiates through lse.

  Args:
    implementation: "xla" or "cudnn" (cuDNN's flash attention: GPU, bf16/fp16, head dim <= 128).
    suffix: the function for blocks with ancestors (e.g. `kernels.attention_fn("pallas")`).

  Raises:
    ValueError: an implementation not in DPA_IMPLEMENTATIONS.
  """
  if implementation not in DPA_IMPLEMENTATIONS:
    raise ValueError(f"causal_block_attention: implementation={implementation!r}; expected one of "
                     f"{DPA_IMPLEMENTATIONS}")

  def attention(q_bthd, ancestors, own, *, scale=None):
    if len(ancestors):
      return suffix(q_bthd, ancestors, own, scale=scale)
    lengths = jnp.sum(own.valid, axis=-1, dtype=jnp.int32)
    lengths = jnp.broadcast_to(lengths, (q_bthd.shape[0],))
    out, lse = jax.nn.dot_product_attention(q_bthd, own.k.astype(q_bthd.dtype), own.v.astype(q_bthd.dtype),
                                            scale=scale, is_causal=True, key_value_seq_lengths=lengths,
                                            implementation=implementation, return_residual=True)
    return out, lse
  return attention
