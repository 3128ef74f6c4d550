"""A validated call: the arguments checked and normalised to rank 4, the attention variant built, and
the kernel family (or the formula) chosen. Shared by ``flash_attention``/``backend_for`` and the paged
path."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from . import dispatch
from .kernels import registry
from .kernels.backend import KernelCall
from .kernels.masking import clip_ranges
from .validation import (check_bool, check_no_dense, check_options, check_scale, resolve_scale,
                         check_soft_cap_scale, check_variant, is_static_dim, validate_qkv)


@dataclasses.dataclass(frozen=True)
class Call:
  """A validated call, rank 4."""

  query: object
  key: object
  value: object
  squeeze: bool
  scale: float
  is_causal: bool
  return_residual: bool
  deterministic: bool
  interpret: bool | None
  backend: str  # a kernel family's name, or "xla"
  variant: object = None  # masking.Variant
  # masking.VariantArrays, rank 4; int32 lengths and q_offset as given (clipped_arrays clips them)
  arrays: object = None
  kernel_call: KernelCall | None = None  # None: empty or symbolic shapes (the formula runs them)
  formula_reason: str | None = None  # why the formula runs a kernel_call-less call

  def clipped_arrays(self):
    """``arrays`` with the lengths and ``q_offset`` clipped to their ranges (masking.clip_ranges),
    as every consumer but a kernel that clips them itself takes them."""
    return clip_ranges(self.arrays, self.query.shape[1], self.key.shape[1])


def prepare(query, key, value, scale, is_causal, implementation, return_residual, block_sizes,
             deterministic, interpret, bias=None, mask=None, **variant_args) -> Call:
  validate_qkv(query, key, value)
  check_no_dense(bias, mask)
  if jnp.dtype(query.dtype) == jnp.float64:
    raise TypeError("query/key/value dtype must be bfloat16, float16 or float32, got float64 "
                    "(fa2_jax.reference_attention computes in float64)")
  check_scale(scale)  # before the other checks: its errors first
  is_causal = check_bool("is_causal", is_causal)
  return_residual = check_bool("return_residual", return_residual)
  deterministic = check_bool("deterministic", deterministic)
  if interpret is not None:
    interpret = check_bool("interpret", interpret)
  check_options(implementation, block_sizes)
  variant, arrays = check_variant(query, key, is_causal=is_causal, clip_int32=False, **variant_args)
  squeeze = query.ndim == 3
  if squeeze:  # arrays or jax.ShapeDtypeStruct (backend_for)
    query, key, value = (jax.ShapeDtypeStruct((1, *x.shape), x.dtype)
                         if isinstance(x, jax.ShapeDtypeStruct) else x[None]
                         for x in (query, key, value))
  h = query.shape[-1]
  scale = resolve_scale(scale, h)
  check_soft_cap_scale(scale, variant.soft_cap)
  symbolic = [d for d in (*query.shape, *key.shape, value.shape[-1]) if not is_static_dim(d)]
  kernel_call, formula_reason = None, None
  if symbolic or 0 in query.shape[:2] or key.shape[1] == 0:
    # Symbolic (jax.export) or empty dimensions: the kernels need static, non-empty grids. Empty
    # calls are exact through the formula (zeros; lse = -inf where S = 0); symbolic ones run it too.
    if symbolic and (implementation not in (None, "xla") or block_sizes is not None):
      raise ValueError(
          f"implementation={implementation!r} needs static shapes; query {tuple(query.shape)} / key "
          f"{tuple(key.shape)} have symbolic dimensions {sorted(set(map(str, symbolic)))} (jax.export): use "
          "implementation=None or 'xla', or export with concrete sequence lengths")
    backend = "xla"
    formula_reason = ("symbolic shapes (jax.export): the kernels need static shapes" if symbolic else
                      "an empty batch or sequence: the formula returns the empty (or all-zero) result")
  else:
    kernel_call = KernelCall(tuple(query.shape), tuple(key.shape), jnp.dtype(query.dtype), is_causal,
                             variant, bool(interpret), deterministic, value.shape[-1])
    backend = dispatch.choose_backend(implementation, kernel_call, block_sizes)
  if backend != "xla" and block_sizes is not None and (
      why := registry.get(backend).check_config(kernel_call, block_sizes)) is not None:
    raise ValueError(f"block_sizes: {why}")  # a config that cannot run this call (SMEM, head_dim)
  return Call(query, key, value, squeeze, scale, is_causal, return_residual, deterministic,
               interpret, backend, variant, arrays, kernel_call, formula_reason)
