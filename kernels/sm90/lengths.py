"""Ragged sequence lengths on the Mosaic GPU kernels: TMA bounds or an HBM pad (:func:`plan_lengths`)."""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from .config import RAGGED_MODES, WG_ROWS
from .schedule import round_up

# --- ragged lengths ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LengthPlan:
  """How the wrapper lays out the sequence axes in HBM before calling a kernel.

  ``t_hbm``/``s_hbm``: lengths of the arrays handed to the kernels (``t``/``s`` unless padded).
  ``t_rows``: length of the f32 per-row arrays (row statistics, the backward's row inputs, delta): a
  whole number of query tiles, so every 1-D TMA of them is in bounds and 16-byte aligned. The kernels always mask keys ``>= s``.
  """

  t: int
  s: int
  t_hbm: int
  s_hbm: int
  t_rows: int

  @property
  def pad_t(self) -> int:
    return self.t_hbm - self.t

  @property
  def pad_s(self) -> int:
    return self.s_hbm - self.s


def plan_lengths(t: int, s: int, *, q_tile: int, k_tile: int, mode: str) -> LengthPlan:
  """Decide the HBM lengths for a call.

  ``q_tile``/``k_tile``: the query/key extent (rows) that the largest CTA tile covers in any kernel of
  the call; every tile side is a multiple of 64.

  ``mode="tma"``: a length that is a multiple of 8 (and at least one tile) stays as it is: TMA
  zero-fills the rows of a tile past the end on load and drops them on store, so the cost is only the
  masked tail tile and the f32 per-row arrays' padding. Mosaic GPU's tiled TMA descriptors split the
  sequence axis into 8-row tiles, so other lengths (and arrays shorter than one tile) are padded in HBM like
  ``"pad"``.
  ``mode="pad"``: T and S are padded to whole tiles in HBM whenever ragged (cost: a copy of q/k/v —
  and do/out in the backward — plus a slice of the outputs, about 2x the input bytes).
  Why ``"tma"`` is the default: docs/design.md#ragged-lengths.
  """
  if mode not in RAGGED_MODES:
    raise ValueError(f"ragged mode must be one of {RAGGED_MODES}, got {mode!r}")

  def hbm_len(n: int, tile: int) -> int:
    if mode == "tma" and n % 8 == 0 and n >= tile:
      return n
    return round_up(n, tile)

  rows_tile = math.lcm(q_tile, WG_ROWS)
  return LengthPlan(t=t, s=s, t_hbm=hbm_len(t, q_tile), s_hbm=hbm_len(s, k_tile),
                    t_rows=round_up(t, rows_tile))


def pad_axis(x, axis: int, new_len: int):
  """Zero-pad ``x`` along ``axis`` up to ``new_len`` (no-op if already that long)."""
  extra = new_len - x.shape[axis]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths)
