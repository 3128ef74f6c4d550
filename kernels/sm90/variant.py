"""The attention variants inside the Mosaic GPU kernels: their extra operands and what a tile does
with them.

The rule is :mod:`fa2_jax.kernels.masking` (one definition for every kernel and the reference); the block
ranges are :mod:`fa2_jax.kernels.block_ranges` tables computed by the wrapper, one row per CTA tile, read by
the consumers *and* the producer (both must walk the same blocks, or their barrier phases part).

* :func:`operands`: the extra kernel inputs of a call (range table, per-batch scalars, segment ids
  padded to whole tiles, ALiBi slopes) and their names.
* :class:`Refs`: the kernel-side view: scalars read from GMEM (plain scalar loads, every thread), the
  range of a tile, and, on a ``[rows, cols]`` WGMMA-layout tile, the allowed pairs and the modified
  base-2 logits.

Operands in GMEM, per name: ``table [B, 1, n_tiles, 4]`` int32, ``q_offset``/``q_len``/``kv_len``
``[B]`` int32, ``q_seg [B, T_pad]``/``kv_seg [B, S_pad]`` int32, ``slopes [B, N]`` float32.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..masking import Variant, VariantArrays, allowed_pairs, kernel_scores
from .config import LOG2E
from .ops import bcast_cols, bcast_rows, iota2

ROW = plgpu.Layout.WGMMA.reduce(1)  # a [rows] vector that broadcasts along a tile's columns
COL = plgpu.Layout.WGMMA.reduce(0)  # a [cols] vector that broadcasts along a tile's rows


def supported(variant: Variant, heads_table: int) -> str | None:
  """None when the Mosaic kernels run this variant, else why not (``heads_table``: the head extent
  of its range table, N when ``mask_fn`` depends on the head)."""
  if heads_table != 1:
    return "a mask_fn that depends on the head (its block ranges differ per head)"
  return None


def _pad_to(x, length: int, value: int):
  return jnp.pad(x, ((0, 0), (0, length - x.shape[1])), constant_values=value)


def operands(variant: Variant, arrays: VariantArrays, table, *, t_pad: int, s_pad: int):
  """``(operands, names)`` of a kernel: ``table`` ``[B, 1, n, 4]`` first, then what the variant
  uses. Segment ids are padded to ``t_pad``/``s_pad`` (whole tiles: a kernel's vector loads have no
  bounds check); the padding never matches (query -2, key -1), though the key-tail mask covers it."""
  ops, names = [table.astype(jnp.int32)], ["table"]
  for name, arr, on in (("q_offset", arrays.q_offset, variant.has_q_offset),
                        ("q_len", arrays.q_lengths, variant.has_q_lengths),
                        ("kv_len", arrays.kv_lengths, variant.has_kv_lengths)):
    if on:
      ops.append(arr.astype(jnp.int32))
      names.append(name)
  if variant.has_segments:
    ops += [_pad_to(arrays.q_segment_ids.astype(jnp.int32), t_pad, -2),
            _pad_to(arrays.kv_segment_ids.astype(jnp.int32), s_pad, -1)]
    names += ["q_seg", "kv_seg"]
  if variant.has_alibi:
    ops.append(arrays.alibi_slopes.astype(jnp.float32))
    names.append("slopes")
  return ops, tuple(names)


class Refs:
  """The variant operands inside a kernel for batch element ``b``.

  ``transposed`` tiles are ``[keys, rows]`` (the dK/dV kernel's ``S^T``), others ``[rows, keys]``.
  """

  def __init__(self, variant: Variant, names: tuple[str, ...], refs, b, *, seq_k: int):
    self.variant = variant
    self._refs = dict(zip(names, refs))
    self.b = b
    self.seq_k = seq_k  # the call's key count: ALiBi distances from each row's nearest key
    r = self._refs
    self.q_offset = r["q_offset"][b] if "q_offset" in r else jnp.int32(0)
    self.q_len = r["q_len"][b] if "q_len" in r else None
    self.kv_len = r["kv_len"][b] if "kv_len" in r else None

  def ranges(self, tile):
    """``(lo, full_lo, full_hi, hi)`` of CTA tile ``tile`` (int32 scalars)."""
    t = self._refs["table"]
    return tuple(t[self.b, 0, tile, c] for c in range(4))

  def _indices(self, shape, row0, col0, transposed: bool):
    """Absolute query positions and key indices of a tile, both full ``shape`` WGMMA arrays."""
    q_dim, k_dim = (1, 0) if transposed else (0, 1)
    rows = row0 + iota2(shape, q_dim)  # query row index i
    keys = col0 + iota2(shape, k_dim)  # key index j
    return rows, keys

  def _segments(self, shape, row0, col0, transposed: bool):
    rows_n, keys_n = (shape[1], shape[0]) if transposed else shape
    q_layout, k_layout = (COL, ROW) if transposed else (ROW, COL)
    q_seg = plgpu.load(self._refs["q_seg"].at[self.b, pl.ds(row0, rows_n)], layout=q_layout,
                       optimized=False)
    kv_seg = plgpu.load(self._refs["kv_seg"].at[self.b, pl.ds(col0, keys_n)], layout=k_layout,
                        optimized=False)
    if transposed:
      return bcast_cols(q_seg, shape), bcast_rows(kv_seg, shape)
    return bcast_rows(q_seg, shape), bcast_cols(kv_seg, shape)

  def keep(self, shape, h, row0, col0, *, seq_q: int | None, seq_k: int | None,
           transposed: bool = False):
    """Bool tile: the allowed pairs (:func:`fa2_jax.kernels.masking.allowed_pairs`), rows past ``seq_q``
    and keys past ``seq_k`` excluded. A kernel passes None for an extent its tiles never pass (a
    whole number of tiles: the range tables stop at ``T`` and ``S``), which saves two compares
    per element of every masked tile."""
    rows, keys = self._indices(shape, row0, col0, transposed)
    q_seg = kv_seg = None
    if self.variant.has_segments:
      q_seg, kv_seg = self._segments(shape, row0, col0, transposed)
    keep = allowed_pairs(self.variant, self.b, h, rows + self.q_offset, keys, q_len=self.q_len,
                         kv_len=self.kv_len, q_seg=q_seg, kv_seg=kv_seg, q_offset=self.q_offset,
                         seq_k=seq_k, in_kernel=True)
    if seq_q is None:
      return keep
    return rows < seq_q if keep is None else keep & (rows < seq_q)

  def slope(self, h):
    return self._refs["slopes"][self.b, h] if "slopes" in self._refs else None

  def scores(self, s, scale: float, h, row0, col0, *, transposed: bool = False,
             derivative: bool = False):
    """Base-2 logits ``modify_scores(scale * s) * log2(e)`` of a raw ``Q K^T`` tile (and ``d s_out
    / d s_in``, or None, when ``derivative``)."""
    rows, keys = self._indices(s.shape, row0, col0, transposed)
    return kernel_scores(self.variant, s, self.b, h, rows + self.q_offset, keys, scale=scale,
                         out_scale=LOG2E, slope=self.slope(h), derivative=derivative,
                         kv_extent=self.seq_k, in_kernel=True)


def zero_padding(x, lengths):
  """``x [B, L, ...]`` with rows ``>= lengths[b]`` set to 0 (None: ``x``).

  The wgmma products sum over whole tiles, where a masked ``P = 0`` times a NaN or inf stored in a
  padded row would still be NaN; the Mosaic kernels therefore read padded rows (past the query or
  key/value lengths) as zeros. One fused elementwise pass over ``x``."""
  if lengths is None:
    return x
  rows = jnp.arange(x.shape[1], dtype=jnp.int32).reshape((1, -1) + (1,) * (x.ndim - 2))
  keep = rows < jnp.asarray(lengths, jnp.int32).reshape((-1,) + (1,) * (x.ndim - 1))
  return jnp.where(keep, x, jnp.zeros((), x.dtype))
