"""The attention variants inside the Triton kernels: their extra inputs and what a tile does with them.

The rule itself is :mod:`fa2_jax.kernels.masking` (one definition for every kernel and the reference); the
block ranges come from :mod:`fa2_jax.kernels.block_ranges` as a small int32 table computed by the wrapper. This
module only moves them in and out of a kernel:

* :func:`inputs`: the extra kernel operands of a call (range table, per-batch scalars, segment ids,
  ALiBi slopes) with their ``BlockSpec`` for a grid ``(block, batch, head)``, and their names.
* :class:`Refs`: the kernel-side view of those operands (named refs) and the loads a tile needs.
* :func:`scores`: base-2 logits of a tile, ``modify_scores(scale * Q K^T) * log2(e)`` (and, for the
  backward, ``d s_out / d s_in``).

A plain dense or causal call has no extra inputs (``Variant.uses_table`` is False) and keeps the
kernels' analytic causal ranges.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..masking import Variant, VariantArrays, allowed, allowed_pairs, kernel_scores
from .common import LOG2E


def uses_table(variant: Variant) -> bool:
  """True when the kernels read block ranges from a table (every variant but dense and causal)."""
  return variant != Variant(is_causal=variant.is_causal)


def inputs(variant: Variant, arrays: VariantArrays, table, *, kv_heads_grid: bool, group: int):
  """Extra operands, their BlockSpecs and names for a kernel on grid ``(block, b, head)``.

  Args:
    table: int32 ``[B, N', n_blocks, 4]`` block ranges of this kernel (``N'`` is 1 or N).
    kv_heads_grid: the grid's head axis runs over KV heads (the dK/dV kernel, which loops over the
      ``group`` query heads of each): per-head operands then come as ``[group]`` slices.
    group: ``N // K``.

  Returns:
    ``(operands, specs, names)``.
  """
  ops, specs, names = [], [], []
  g = group if kv_heads_grid else 1

  per_head = table.shape[1] > 1
  if per_head:
    specs.append(pl.BlockSpec((None, g, None, 4) if kv_heads_grid else (None, None, None, 4),
                              lambda i, bi, hi: (bi, hi, i, 0)))
  else:
    specs.append(pl.BlockSpec((None, 1, None, 4) if kv_heads_grid else (None, None, None, 4),
                              lambda i, bi, hi: (bi, 0, i, 0)))
  ops.append(table)
  names.append("table")
  add_scalar_inputs(ops, specs, names, variant, arrays, lambda i, bi, hi: (bi,))
  if variant.has_segments:
    t, s = arrays.q_segment_ids.shape[1], arrays.kv_segment_ids.shape[1]
    ops += [arrays.q_segment_ids.astype(jnp.int32), arrays.kv_segment_ids.astype(jnp.int32)]
    specs += [pl.BlockSpec((None, t), lambda i, bi, hi: (bi, 0)),
              pl.BlockSpec((None, s), lambda i, bi, hi: (bi, 0))]
    names += ["q_seg", "kv_seg"]
  if variant.has_alibi:
    ops.append(arrays.alibi_slopes.astype(jnp.float32))  # [B, N]
    specs.append(pl.BlockSpec((None, g) if kv_heads_grid else (None, None),
                              lambda i, bi, hi: (bi, hi)))
    names.append("slopes")
  return ops, specs, tuple(names)


def add_scalar_inputs(ops: list, specs: list, names: list, variant: Variant, arrays: VariantArrays,
                      index_map) -> None:
  """Appends the variant's per-batch int32 scalars (``q_offset``, ``q_len``, ``kv_len``: ``[B]``
  arrays, those the variant uses) to a kernel's operands, BlockSpecs and names; ``index_map`` maps a
  program's grid indices to ``(batch element,)``. The Triton kernels' and the decode kernel's."""
  for name, arr, on in (("q_offset", arrays.q_offset, variant.has_q_offset),
                        ("q_len", arrays.q_lengths, variant.has_q_lengths),
                        ("kv_len", arrays.kv_lengths, variant.has_kv_lengths)):
    if on:
      ops.append(arr.astype(jnp.int32))
      specs.append(pl.BlockSpec((None,), index_map))
      names.append(name)


def any_along(mask, axis: int):
  """``jnp.any(mask, axis)`` as a max over int32 (the Triton lowering has no boolean reduction)."""
  return jnp.max(mask.astype(jnp.int32), axis=axis) > 0


def tile_mask(variant: Variant, vr: "Refs | None", b, h, row0, rows: int, col0, cols: int, *,
              seq_q: int, seq_k: int):
  """``[rows, cols]`` allowed pairs of a masked tile (None: nothing masked): the variant's rule
  through ``vr`` (:meth:`Refs.keep`), or, for a plain dense/causal call (``vr`` None), the causal
  kernels' mask with the ragged key tail."""
  if vr is not None:
    return vr.keep(b, h, row0, rows, col0, cols, seq_q, seq_k)
  q_pos = row0 + jnp.arange(rows)[:, None]
  k_pos = col0 + jnp.arange(cols)[None, :]
  return allowed(q_pos, k_pos, is_causal=variant.is_causal,
                 seq_k=seq_k if seq_k % cols else None)


def zero_unattended(keep, x, axis: int):
  """``x`` with the rows that no pair of ``keep`` reaches set to 0 (``axis`` 0: ``x`` holds the
  tile's keys; 1: its query rows), so that a NaN stored there cannot meet a masked ``P = 0``."""
  return jnp.where(any_along(keep, axis)[:, None], x, jnp.zeros_like(x))


class Refs:
  """The variant operands inside a kernel, by name, for batch element ``b``.

  Attributes:
    variant: the static :class:`Variant`.
    q_offset, q_len, kv_len: the batch element's int32 scalars (0 / None where unused).
  """

  def __init__(self, variant: Variant, names: tuple[str, ...], refs, *, seq_k: int):
    self.variant = variant
    self.seq_k = seq_k  # the call's key count: ALiBi distances from each row's nearest key
    self._refs = dict(zip(names, refs))
    r = self._refs
    self.q_offset = r["q_offset"][()] if "q_offset" in r else jnp.int32(0)
    self.q_len = r["q_len"][()] if "q_len" in r else None
    self.kv_len = r["kv_len"][()] if "kv_len" in r else None

  def ranges(self, g=None):
    """``(lo, full_lo, full_hi, hi)`` of this program's block (``g``: the query head within the
    group, for the dK/dV kernel's ``[group, 4]`` view; None for the ``[4]`` view)."""
    t = self._refs["table"]
    if g is None:
      return tuple(t[c] for c in range(4))
    g = g if t.shape[0] > 1 else 0
    return tuple(t[g, c] for c in range(4))

  def slope(self, g=None):
    """The ALiBi slope of this head (``g``: within the group), or None."""
    if "slopes" not in self._refs:
      return None
    ref = self._refs["slopes"]
    return ref[()] if g is None else ref[g]

  def key_end(self, seq_k: int):
    """Keys ``j < key_end`` exist and may be attended (``min(S, kv_len)``)."""
    if self.kv_len is None:
      return seq_k
    return jnp.clip(self.kv_len, 0, seq_k)

  def row_end(self, seq_q: int):
    """Query rows ``i < row_end`` are real (``min(T, q_len)``)."""
    if self.q_len is None:
      return seq_q
    return jnp.clip(self.q_len, 0, seq_q)

  def keep(self, b, h, row0: int | jnp.ndarray, rows: int, col0, cols: int, seq_q: int,
           seq_k: int):
    """``[rows, cols]`` bool: the allowed pairs of query rows ``[row0, row0 + rows)`` and keys
    ``[col0, col0 + cols)`` (:func:`fa2_jax.kernels.masking.allowed_pairs`, plus rows past ``T``)."""
    i = row0 + jnp.arange(rows, dtype=jnp.int32)[:, None]  # [rows, 1] row index
    j = col0 + jnp.arange(cols, dtype=jnp.int32)[None, :]  # [1, cols] key index
    q_seg = kv_seg = None
    if self.variant.has_segments:
      q_seg = plgpu.load(self._refs["q_seg"].at[pl.ds(row0, rows)], mask=i[:, 0] < seq_q,
                         other=0)[:, None]
      kv_seg = plgpu.load(self._refs["kv_seg"].at[pl.ds(col0, cols)], mask=j[0] < seq_k,
                          other=0)[None, :]
    keep = allowed_pairs(self.variant, b, h, i + self.q_offset, j, q_len=self.q_len,
                         kv_len=self.kv_len, q_seg=q_seg, kv_seg=kv_seg, q_offset=self.q_offset,
                         seq_k=seq_k, in_kernel=True)
    rows_real = i < seq_q
    return rows_real if keep is None else keep & rows_real

  def scores(self, s, scale: float, b, h, row0, col0, *, g=None, derivative: bool = False,
             slope_derivative: bool = False):
    """Base-2 logits ``modify_scores(scale * s) * log2(e)`` of a ``[rows, cols]`` tile of raw
    ``Q K^T`` (and ``d s_out / d s_in`` or None when ``derivative``; and ``d modify_scores / d
    slope`` when ``slope_derivative``: :func:`kernels.masking.kernel_scores`)."""
    rows, cols = s.shape
    q_idx = row0 + jnp.arange(rows, dtype=jnp.int32)[:, None] + self.q_offset
    kv_idx = col0 + jnp.arange(cols, dtype=jnp.int32)[None, :]
    return kernel_scores(self.variant, s, b, h, q_idx, kv_idx, scale=scale, out_scale=LOG2E,
                         slope=self.slope(g), derivative=derivative, kv_extent=self.seq_k,
                         in_kernel=True, slope_derivative=slope_derivative)
