"""Helpers shared by the Triton-backend kernels: masked tile loads/stores and constants."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# exp(x) = exp2(x * log2(e)): the kernels work in base 2 (exp2 is one MUFU instruction; exp is exp2 plus
# a multiply), with the softmax scale folded into the same multiply (paper §3.1, "exp2 with folded scale").
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def padded_head_dim(head_dim: int) -> int:
  """Triton tiles need power-of-two sides of at least 16: H is padded to that inside the kernel."""
  return max(16, 1 << math.ceil(math.log2(head_dim)))


def tile_mask(start, size: int, limit: int | None, head_dim: int, hp: int):
  """Mask for a ``[size, hp]`` tile whose rows start at ``start``.

  Rows at or past ``limit`` (the sequence length; None when every row is in bounds) and columns at or
  past ``head_dim`` (the padding up to ``hp``) are False. Returns None when nothing is masked, so the
  common case compiles to plain loads.
  """
  mask = None
  if limit is not None:
    mask = (start + jnp.arange(size) < limit)[:, None]
  if head_dim != hp:
    cols = (jnp.arange(hp) < head_dim)[None, :]
    mask = cols if mask is None else jnp.logical_and(mask, cols)
  return mask


def _view(ref, start, size, head):
  # One indexer only (the Triton lowering takes a single NDIndexer per load/store). Every start is an
  # int32 (no `:`, whose start would be a Python int): Pallas interpret mode lowers the kernel when the
  # caller's jit lowers, and with x64 on there a Python-int start becomes int64 beside our int32 ones.
  cols = pl.ds(jnp.int32(0), ref.shape[-1])
  if head is None:
    return ref.at[pl.ds(start, size), cols]  # ref: [rows, hp]
  return ref.at[pl.ds(start, size), head, cols]  # ref: [rows, heads, hp]


def load_tile(ref, start, size: int, limit: int | None, head_dim: int, head=None):
  """Load rows ``[start, start+size)`` of a ``[rows, hp]`` (or ``[rows, heads, hp]`` at ``head``) ref.

  Out-of-range rows and padded columns read as 0.
  """
  hp = ref.shape[-1]
  view = _view(ref, start, size, head)
  mask = tile_mask(start, size, limit, head_dim, hp)
  if mask is None:
    return plgpu.load(view)
  return plgpu.load(view, mask=mask, other=0.0)


def store_tile(ref, start, value, limit: int | None, head_dim: int, head=None):
  """Store a ``[size, hp]`` tile at rows ``start``; rows past ``limit`` and padded columns untouched."""
  size, hp = value.shape
  view = _view(ref, start, size, head)
  mask = tile_mask(start, size, limit, head_dim, hp)
  plgpu.store(view, value.astype(ref.dtype), mask=mask)


def dot(a, b, *, trans_a=False, trans_b=False, f32: bool = False):
  """Tensor-core dot with an f32 accumulator; float32 operands use full f32 (no tf32 rounding)."""
  return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b,
                   precision=jax.lax.Precision.HIGHEST if f32 else None)


def div(x, m: int):
  """``x // m`` for non-negative x (a traced int32 or a Python int): one integer division, no
  floor-division sign fix-up in the kernel."""
  if isinstance(x, int):
    return x // m
  return jax.lax.div(x, jnp.asarray(m, x.dtype))


def cdiv(x, m: int):
  """``ceil(x / m)`` for non-negative x."""
  return div(x + (m - 1), m)


def round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def compiler_params(num_warps: int, num_stages: int):
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
