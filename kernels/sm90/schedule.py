"""Which tiles a CTA visits and in which order the CTAs launch (Mosaic GPU kernels).

* :func:`kv_block_ranges` / :func:`q_block_ranges`: the key (query) blocks a CTA visits and which of
  them need a mask (FA2 §3.1 causal block skipping). They accept Python ints or traced int32 scalars.
* :func:`lpt_tile`, :func:`section_heads`, :func:`causal_section`: longest-first launch order of causal
  CTAs across L2-sized sections of heads.
"""
from __future__ import annotations

import heapq

import jax.numpy as jnp
import numpy as np
from jax import lax

from .config import L2_SECTION_BYTES, MosaicConfig

def cdiv(a, b):
  """Ceil division for Python ints and traced int32 scalars alike."""
  return (a + b - 1) // b


def round_up(x: int, m: int) -> int:
  return cdiv(x, m) * m


def _min(a, b):
  if isinstance(a, int) and isinstance(b, int):
    return min(a, b)
  return jnp.minimum(a, b)


# --- block ranges (FA2 §3.1 causal block skipping) ---------------------------------------------------

def kv_block_ranges(q_start, rows: int, *, block_k: int, seq_k: int, is_causal: bool):
  """Key blocks seen by query rows ``[q_start, q_start + rows)``.

  Returns ``(n_full, n_end)``: blocks ``[0, n_full)`` need no mask, ``[n_full, n_end)`` need one
  (they straddle the causal diagonal for some row, or hold the ragged key tail); blocks from
  ``n_end`` on lie wholly above the diagonal for every row and are never loaded.
  Causal is top-left: row ``i`` attends keys ``j <= i``. Block ``j`` is unmasked for every row when
  ``j*block_k + block_k - 1 <= q_start``, i.e. ``j < (q_start + 1) // block_k``.
  """
  nk = cdiv(seq_k, block_k)
  nk_full = seq_k // block_k
  if is_causal:
    n_end = _min(cdiv(q_start + rows, block_k), nk)
    n_full = _min((q_start + 1) // block_k, nk_full)
  else:
    n_end, n_full = nk, nk_full
  return _min(n_full, n_end), n_end


def q_block_ranges(k_start, cols: int, *, block_q: int, seq_q: int, is_causal: bool):
  """Query blocks that see keys ``[k_start, k_start + cols)`` (the dK/dV kernel's loop).

  Returns ``(i_start, i_full, nq)``: blocks ``[i_start, i_full)`` straddle the diagonal (masked),
  ``[i_full, nq)`` need no mask. Block ``i`` has a row at or below key ``k_start`` when
  ``(i+1)*block_q - 1 >= k_start`` (``i >= k_start // block_q``) and needs no mask when its first row
  is at or past the last key, ``i*block_q >= k_start + cols - 1``. Padded query rows (past ``seq_q``)
  need no mask: their Q, dO, row inputs and delta are zero, so they add nothing to dK and dV.
  """
  nq = cdiv(seq_q, block_q)
  if not is_causal:
    return 0, 0, nq
  i_start = _min(k_start // block_q, nq)
  i_full = _min(cdiv(k_start + cols - 1, block_q), nq)
  return i_start, i_full, nq


def over_query_ranges(loop, masked, unmasked, ranges):
  """The dK/dV kernels' query loop, in the producer's order: ``ranges`` is ``(i_start, i_full, nq)``
  from :func:`q_block_ranges` (masked tiles straddling the diagonal, then unmasked ones) or a
  variant's ``(lo, full_lo, full_hi, hi)`` range-table row (masked, unmasked, masked);
  ``loop(lower, upper, body)`` runs ``body`` over one range."""
  if len(ranges) == 3:
    i_start, i_full, nq = ranges
    loop(i_start, i_full, masked)
    loop(i_full, nq, unmasked)
    return
  lo, full_lo, full_hi, hi = ranges
  loop(lo, full_lo, masked)
  loop(full_lo, full_hi, unmasked)
  loop(full_hi, hi, masked)


# --- launch order of causal CTAs (longest processing time first) ------------------------------------

def _div(a, b):
  return a // b if isinstance(a, int) else lax.div(a, jnp.asarray(b, a.dtype))


def _rem(a, b):
  return a % b if isinstance(a, int) else lax.rem(a, jnp.asarray(b, a.dtype))


def section_heads(bytes_per_head: int, n_heads: int, group: int = 1,
                  budget: int = L2_SECTION_BYTES) -> int:
  """How many (batch, head) pairs one LPT section holds: as many as stream ``budget`` bytes from HBM
  (so a section's K/V, or Q/dO, stay in L2 while its CTAs run), a multiple of the GQA ``group`` when
  it holds more than one group (group-mates share K/V), at least 1, at most ``n_heads``
  (docs/design.md#causal-launch-order)."""
  sec = max(1, budget // max(1, bytes_per_head))
  if sec >= group > 1:
    sec -= sec % group
  return min(sec, n_heads)


def lpt_tile(b, h, t, *, n_h: int, n_t: int, n_bh: int, section: int, longest_last: bool):
  """The (batch, head, tile) a causal CTA works on, given its launch coordinates ``(b, h, t)``.

  CUDA starts CTAs in launch order, ``t`` fastest (Mosaic GPU maps the last grid axis to x), and
  causal CTAs differ in work (a query tile's keys, or a key tile's queries, grow along the diagonal).
  Longest-processing-time-first keeps the end of the kernel from waiting on a few long CTAs. Ordering
  only within each head (``section=1``) leaves the last head's longest CTAs to start when most of
  the work is done (a greedy-schedule estimate at 8k, 64 tiles per head on 132 SMs: they could end
  up to ~10% after the average SM). Here the launch order is cut into sections of ``section`` heads;
  within a section all heads' longest tiles come first, then the next longest, and so on. The
  section is small enough that its streamed operands stay in L2 (CTAs running together share them),
  see :func:`section_heads`. Measured faster per kernel than ``section=1`` at 8k, except the
  head_dim-64 dK/dV kernel; at 16k within noise (docs/design.md#causal-launch-order).
  ``longest_last``: tile ``n_t - 1`` is the longest (forward, dQ) rather than tile 0 (dK/dV).
  Works on Python ints and traced int32 scalars; a bijection on ``[0, n_bh * n_t)``.
  """
  return lpt_position((b * n_h + h) * n_t + t, n_h=n_h, n_t=n_t, n_bh=n_bh, section=section,
                      longest_last=longest_last)


def lpt_position(lin, *, n_h: int, n_t: int, n_bh: int, section: int, longest_last: bool):
  """:func:`lpt_tile` of the CTA at launch position ``lin = (b * n_h + h) * n_t + t``."""
  sec = _div(lin, section * n_t)
  within = _rem(lin, section * n_t)
  heads = _min(section, n_bh - sec * section)  # the last section may be smaller
  rank = _div(within, heads)  # 0 = longest
  head = sec * section + _rem(within, heads)
  tile = (n_t - 1) - rank if longest_last else rank
  return _div(head, n_h), _rem(head, n_h), tile


def cta_tile(tile_axis: str, *, is_causal: bool, n_heads: int, n_tiles: int, n_bh: int,
              section: int, longest_last: bool):
  """``(batch, head, tile)`` of the running CTA on a grid ``("b", "h", tile_axis)``: its launch
  coordinates, remapped longest-first (:func:`lpt_tile`) for causal calls."""
  b, h, t = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index(tile_axis)
  if is_causal:
    b, h, t = lpt_tile(b, h, t, n_h=n_heads, n_t=n_tiles, n_bh=n_bh, section=section,
                       longest_last=longest_last)
  return b, h, t


def launch_tile(lin, *, is_causal: bool, n_heads: int, n_tiles: int, n_bh: int, section: int,
                longest_last: bool):
  """:func:`cta_tile` of the CTA at launch position ``lin = (b * n_heads + h) * n_tiles + t`` (a
  persistent kernel's CTA runs its positions in turn: ``cta, cta + n_ctas, ...``, or its row of a
  :func:`greedy_deal`)."""
  if is_causal:
    return lpt_position(lin, n_h=n_heads, n_t=n_tiles, n_bh=n_bh, section=section,
                        longest_last=longest_last)
  bh = _div(lin, n_tiles)
  return _div(bh, n_heads), _rem(bh, n_heads), _rem(lin, n_tiles)


def causal_section(cfg: "MosaicConfig", *, n_bh: int, group: int, kv_bytes: int,
                   dkv: bool = False) -> int:
  """Heads per LPT section for a kernel whose CTAs of one (batch, head) stream ``kv_bytes`` of
  operands shared by ``group`` heads (forward/dQ: one KV head's K and V for its GQA group; dK/dV:
  ``group = 1`` and the group's Q and dO, ``dkv=True``). ``cfg.lpt_heads`` (``lpt_heads_dkv``) when
  set, capped at ``n_bh``."""
  fixed = cfg.lpt_heads_dkv if dkv else cfg.lpt_heads
  if fixed:
    return min(fixed, n_bh)
  return section_heads(-(-kv_bytes // group), n_bh, group, budget=L2_SECTION_BYTES)


def greedy_deal(work, n_ctas: int):
  """A static deal of tiles to the ``n_ctas`` CTAs of a persistent kernel: the launch positions in
  order (longest first for causal calls), each to the CTA with the least work so far (ties: the
  lowest CTA), as the hardware's scheduler would hand one-CTA-per-tile launches to the first free SM,
  with ``work[pos]`` as the tile's duration. Dealing positions ``c, c + n_ctas, ...`` to CTA ``c``
  instead gives CTA 0 the longest tile of every round.

  Returns an int32 numpy table ``[n_ctas, 1 + max count]``: row ``c`` is CTA ``c``'s tile count, then
  its launch positions in increasing order (zero-padded)."""
  loads = [(0.0, c) for c in range(n_ctas)]
  owned = [[] for _ in range(n_ctas)]
  for pos, w in enumerate(work):
    load, c = heapq.heappop(loads)
    owned[c].append(pos)
    heapq.heappush(loads, (load + float(w), c))
  table = np.zeros((n_ctas, 1 + max(len(o) for o in owned)), np.int32)
  for c, o in enumerate(owned):
    table[c, 0] = len(o)
    table[c, 1:1 + len(o)] = o
  return table
