"""Block ranges of the attention variants: which tiles a kernel can skip (no allowed pair) and which
need no mask (every pair allowed), derived from the rule of :mod:`fa2_jax.kernels.masking`.

* :func:`kv_block_range` / :func:`q_block_range`: one tile's key (query) blocks, analytic for causal,
  window, lengths and offset; plain jnp on int32 scalars, usable inside a kernel.
* :func:`kv_block_ranges` / :func:`q_block_ranges`: the table of a whole call ``[B, n_blocks, 4]``,
  built by the wrapper (vectorised jnp), segments included through per-block min/max ids.
* :func:`mask_fn_block_mask`: ``(any, all)`` per block pair for a user ``mask_fn``, computed once per call.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .masking import Variant, VariantArrays, allowed_pairs

# --- block ranges (analytic: causal, window, lengths, offset) -------------------------------------

def _i32(x):
  return jnp.asarray(x, jnp.int32)


def _div(x, m: int):
  """``x // m`` for non-negative int32 ``x`` (truncating division, no sign fix-up in a kernel)."""
  return lax.div(_i32(x), jnp.int32(m))


def _cdiv(x, m: int):
  """``ceil(x / m)`` for non-negative int32 ``x``."""
  return _div(_i32(x) + (m - 1), m)


def _clip_add(a, b, lo, hi):
  """``clip(a + b, lo, hi)`` for int32 ``a`` and ``0 <= b <= 2**30 + 1`` without overflowing int32
  where ``a + b`` would (an offset and a window side both near 2**30): ``clip(a, lo - b, hi - b) + b``.
  """
  return jnp.clip(a, lo - b, hi - b) + b


def _key_end(variant: Variant, seq_k, kv_len):
  """Keys ``j < key_end`` exist and are valid: ``min(seq_k, kv_len)`` clipped to ``[0, seq_k]``."""
  end = _i32(seq_k)
  if variant.has_kv_lengths:
    end = jnp.clip(_i32(kv_len), 0, end)
  return end


def _row_end(variant: Variant, seq_q, q_len):
  """Rows ``i < row_end`` hold real queries (None: unbounded)."""
  end = None if seq_q is None else _i32(seq_q)
  if variant.has_q_lengths:
    ql = jnp.maximum(_i32(q_len), 0)
    end = ql if end is None else jnp.minimum(end, ql)
  return end


def _normalize(lo, full_lo, full_hi, hi, nonempty, full_nonempty):
  """Empty reach: all four 0. Empty full set: ``full_lo = full_hi = lo`` (every block masked)."""
  zero = jnp.int32(0)
  lo = jnp.where(nonempty, lo, zero)
  hi = jnp.where(nonempty, jnp.maximum(hi, lo), zero)
  full_ok = nonempty & full_nonempty & (full_lo < full_hi)
  full_lo = jnp.where(full_ok, jnp.clip(full_lo, lo, hi), lo)
  full_hi = jnp.where(full_ok, jnp.clip(full_hi, full_lo, hi), full_lo)
  return lo, full_lo, full_hi, hi


def kv_block_range(variant: Variant, q_start, q_rows: int, block_k: int, seq_k, *, seq_q=None,
                   q_offset=None, q_len=None, kv_len=None):
  """Key-block range of the query rows ``[q_start, q_start + q_rows)`` from the analytic terms
  (causal, window, lengths, offset; segments and ``mask_fn`` are separate: :func:`kv_block_ranges`,
  :func:`mask_fn_block_mask`).

  Args:
    variant: the static :class:`Variant`.
    q_start: first row ``i`` of the query block (int32 scalar, or an array: vectorised).
    q_rows: rows in the block (static).
    block_k: keys per key block (static).
    seq_k: keys ``S`` (static int or int32).
    seq_q: rows ``T``; rows past it are ignored (None: every row of the block counts).
    q_offset, q_len, kv_len: the batch element's values (scalars or broadcastable against
      ``q_start``), needed when the variant has them.

  Returns:
    int32 ``(lo, full_lo, full_hi, hi)``, ``lo <= full_lo <= full_hi <= hi``: key blocks outside
    ``[lo, hi)`` have no allowed pair (never load them); blocks in ``[full_lo, full_hi)`` have every
    pair of the block's rows allowed (no mask; they also lie wholly below ``seq_k``); the rest need the
    mask. A block with no valid row gives ``(0, 0, 0, 0)``.
  """
  left, right = variant.bounds
  q_start = _i32(q_start)
  off = _i32(q_offset) if variant.has_q_offset else jnp.int32(0)
  key_end = _key_end(variant, seq_k, kv_len)
  block_end = q_start + q_rows
  if seq_q is not None:
    block_end = jnp.minimum(block_end, _i32(seq_q))
  row_end = _row_end(variant, seq_q, q_len)
  reach_end = block_end if row_end is None else jnp.minimum(block_end, row_end)
  nonempty = reach_end > q_start
  # Full: every row of the block real (rows past q_len would need the mask).
  rows_full = jnp.bool_(True) if not variant.has_q_lengths else block_end <= row_end
  p_first = off + q_start
  p_last = off + reach_end - 1  # last row any key can reach
  p_last_all = off + block_end - 1  # last row of the block
  zero = jnp.int32(0)
  # Keys [reach_lo, reach_hi) meet some row; keys [full_lo_k, full_hi_k) meet every row.
  reach_lo = zero if left is None else jnp.clip(p_first - left, 0, key_end)
  reach_hi = key_end if right is None else _clip_add(p_last, _i32(right + 1), zero, key_end)
  full_lo_k = zero if left is None else jnp.clip(p_last_all - left, 0, key_end)
  full_hi_k = key_end if right is None else _clip_add(p_first, _i32(right + 1), zero, key_end)
  nonempty = nonempty & (reach_lo < reach_hi)
  return _normalize(_div(reach_lo, block_k), _cdiv(full_lo_k, block_k), _div(full_hi_k, block_k),
                    _cdiv(reach_hi, block_k), nonempty, rows_full)


def q_block_range(variant: Variant, k_start, k_cols: int, block_q: int, seq_q, *, seq_k=None,
                  q_offset=None, q_len=None, kv_len=None):
  """Query-block range of the keys ``[k_start, k_start + k_cols)`` (the dK/dV kernel's loop), from
  the analytic terms, as :func:`kv_block_range` transposed.

  Args:
    k_start: first key ``j`` of the key block (int32 scalar or array).
    k_cols: keys in the block (static).
    block_q: rows per query block (static).
    seq_q: rows ``T``.
    seq_k: keys ``S``; keys past it are ignored (None: every key of the block counts).

  Returns:
    int32 ``(lo, full_lo, full_hi, hi)`` query-block indices: blocks outside ``[lo, hi)`` meet no key
    of this block; blocks in ``[full_lo, full_hi)`` have every (row, key) pair allowed (every row real,
    every key of the block below ``seq_k`` and ``kv_len``). A key block with no valid key gives
    ``(0, 0, 0, 0)``.
  """
  left, right = variant.bounds
  k_start = _i32(k_start)
  off = _i32(q_offset) if variant.has_q_offset else jnp.int32(0)
  block_end = k_start + k_cols
  if seq_k is not None:
    block_end = jnp.minimum(block_end, _i32(seq_k))
  key_end = block_end
  if variant.has_kv_lengths:
    key_end = jnp.minimum(key_end, jnp.maximum(_i32(kv_len), 0))
  nonempty = key_end > k_start
  # Full: every key of the block valid (and the block inside seq_k when seq_k is given).
  keys_full = (k_start + k_cols <= key_end)
  row_end = _row_end(variant, seq_q, q_len)
  zero = jnp.int32(0)
  # Row i meets key j when p - left <= j <= p + right, p = off + i: i in [j - right - off, j + left - off].
  # In row units: j - off (|j - off| < 2**31), then the sides through _clip_add (no int32 overflow).
  j_first, j_last, j_last_all = k_start - off, key_end - 1 - off, k_start + k_cols - 1 - off
  reach_lo = zero if right is None else jnp.clip(j_first - right, 0, row_end)
  reach_hi = row_end if left is None else _clip_add(j_last, _i32(left + 1), zero, row_end)
  full_lo_r = zero if right is None else jnp.clip(j_last_all - right, 0, row_end)
  full_hi_r = row_end if left is None else _clip_add(j_first, _i32(left + 1), zero, row_end)
  nonempty = nonempty & (reach_lo < reach_hi)
  # A full query block needs all its rows real: [ib*bq, ib*bq + bq) within row_end.
  return _normalize(_div(reach_lo, block_q), _cdiv(full_lo_r, block_q), _div(full_hi_r, block_q),
                    _cdiv(reach_hi, block_q), nonempty, keys_full)


# --- block ranges of a whole call (wrapper side, vectorised) --------------------------------------

def _block_min_max(ids, block: int):
  """Per-block min and max of ``ids [B, L]`` -> ``[B, ceil(L / block)]`` each (the tail block's
  missing entries are the reduction's identity, so they change nothing).

  A strided window reduction, not a reshape to ``[B, blocks, block]``: on ids sharded along L over
  more devices than there are blocks (e.g. 2 blocks, 4 devices), the reshape would split that mesh
  axis between the block axis and the rows of a block, and the range tables would reach the kernels'
  partition callback sharded over part of a mesh axis, which no PartitionSpec names (an
  IndivisibleError inside the compiler). The window reduction keeps whole mesh axes."""
  length = ids.shape[1]
  pad = ((0, 0), (0, -(-length // block) * block - length))
  info = jnp.iinfo(ids.dtype)

  def reduce(op, identity):
    return lax.reduce_window(ids, np.array(identity, ids.dtype), op, (1, block), (1, block), pad)

  return reduce(lax.min, info.max), reduce(lax.max, info.min)


def _ranges_from_table(reach, full):
  """``(lo, full_lo, full_hi, hi)`` along the last axis of bool tables ``reach``/``full``
  ``[..., n]``: ``[lo, hi)`` spans every reachable block; ``[full_lo, full_hi)`` is the first run of
  full blocks."""
  n = reach.shape[-1]
  idx = lax.broadcasted_iota(jnp.int32, (1,) * (reach.ndim - 1) + (n,), reach.ndim - 1)  # [1.., n]
  big = jnp.int32(n)
  lo = jnp.min(jnp.where(reach, idx, big), -1)
  hi = jnp.max(jnp.where(reach, idx + 1, 0), -1)
  full_lo = jnp.min(jnp.where(full, idx, big), -1)
  full_hi = jnp.min(jnp.where((idx >= full_lo[..., None]) & ~full, idx, big), -1)
  return _normalize(lo, full_lo, full_hi, hi, hi > lo, full_lo < big)


def intersect_ranges(a, b):
  """Both ``(lo, full_lo, full_hi, hi)`` rules at once: the intersection of the reach ranges and of
  the full ranges."""
  lo, hi = jnp.maximum(a[0], b[0]), jnp.minimum(a[3], b[3])
  full_lo, full_hi = jnp.maximum(a[1], b[1]), jnp.minimum(a[2], b[2])
  return _normalize(lo, full_lo, full_hi, hi, hi > lo, full_lo < full_hi)


def _per_batch(variant: Variant, arrays: VariantArrays):
  col = lambda x: None if x is None else _i32(x)[:, None]  # noqa: E731  [B] -> [B, 1]
  return dict(q_offset=col(arrays.q_offset) if variant.has_q_offset else None,
              q_len=col(arrays.q_lengths) if variant.has_q_lengths else None,
              kv_len=col(arrays.kv_lengths) if variant.has_kv_lengths else None)


def kv_block_ranges(variant: Variant, arrays: VariantArrays, *, batch: int, seq_q: int, seq_k: int,
                    block_q: int, block_k: int):
  """``[B, ceil(T / block_q), 4]`` int32 table of :func:`kv_block_range` per (batch element, query
  block), segments included (from per-block min/max segment ids: a key block whose id interval does
  not meet the query block's is unreachable; a block pair is full only when both hold one single, equal
  id). ``mask_fn`` is not included (:func:`mask_fn_block_mask`)."""
  nq = -(-seq_q // block_q)
  q_start = (jnp.arange(nq, dtype=jnp.int32) * block_q)[None, :]  # [1, nq]
  rng = kv_block_range(variant, q_start, block_q, block_k, seq_k, seq_q=seq_q,
                       **_per_batch(variant, arrays))
  rng = tuple(jnp.broadcast_to(x, (batch, nq)) for x in rng)
  if variant.has_segments:
    rng = intersect_ranges(rng, _segment_ranges(arrays.q_segment_ids, block_q,
                                                arrays.kv_segment_ids, block_k))
  return jnp.stack(rng, -1)


def _segment_ranges(row_ids, row_block: int, col_ids, col_block: int):
  """The ranges of column blocks that a row block's segments reach, per (batch element, row
  block): from per-block min/max segment ids (``[B, rows]`` and ``[B, cols]`` blocks), a column
  block whose id interval does not meet the row block's is unreachable, and a pair is full only
  when both hold one single, equal id. Rows are query blocks for the kernels that loop over keys,
  key blocks for the dK/dV kernel."""
  r_min, r_max = _block_min_max(_i32(row_ids), row_block)  # [B, n_rows]
  c_min, c_max = _block_min_max(_i32(col_ids), col_block)  # [B, n_cols]
  reach = (r_min[:, :, None] <= c_max[:, None, :]) & (c_min[:, None, :] <= r_max[:, :, None])
  full = ((r_min == r_max)[:, :, None] & (c_min == c_max)[:, None, :]
          & (r_min[:, :, None] == c_min[:, None, :]))
  return _ranges_from_table(reach, full)


def q_block_ranges(variant: Variant, arrays: VariantArrays, *, batch: int, seq_q: int, seq_k: int,
                   block_q: int, block_k: int):
  """``[B, ceil(S / block_k), 4]`` int32 table of :func:`q_block_range` per (batch element, key
  block), segments included as in :func:`kv_block_ranges` (for the dK/dV kernel)."""
  nk = -(-seq_k // block_k)
  k_start = (jnp.arange(nk, dtype=jnp.int32) * block_k)[None, :]  # [1, nk]
  rng = q_block_range(variant, k_start, block_k, block_q, seq_q, seq_k=seq_k,
                      **_per_batch(variant, arrays))
  rng = tuple(jnp.broadcast_to(x, (batch, nk)) for x in rng)
  if variant.has_segments:
    rng = intersect_ranges(rng, _segment_ranges(arrays.kv_segment_ids, block_k,
                                                arrays.q_segment_ids, block_q))
  return jnp.stack(rng, -1)


_MASK_CHUNK = 1 << 25  # elements of mask_fn evaluated per step of mask_fn_block_mask (32 Mi bools)


class _Kept(dict):
  """Values evaluated while a call is traced, kept for later calls with the same key; past ``limit``
  entries the oldest leaves (a program that needs it again evaluates it again)."""

  def __init__(self, limit: int):
    super().__init__()
    self.limit = limit

  def keep(self, key, value):
    if len(self) >= self.limit:
      self.pop(next(iter(self)))
    self[key] = value
    return value


# (variant, dims) -> concrete (any_, all_): see mask_fn_block_mask. At 128k x 128k with 64-row tiles
# one entry holds about 4 MiB, hence 16.
_STATIC_MASKS = _Kept(16)


def mask_fn_block_mask(variant: Variant, arrays: VariantArrays, *, batch: int, heads: int,
                       seq_q: int, seq_k: int, block_q: int, block_k: int):
  """Per-block summary of ``mask_fn`` alone: ``(any_, all_)`` bool ``[B', N', nq, nk]`` (``B'`` is 1
  when neither ``mask_fn`` nor ``q_offset`` depends on the batch element, ``N'`` is 1 when ``mask_fn``
  ignores the head). ``any_`` False: no pair of the block pair passes ``mask_fn`` (skip it); ``all_``
  True: every pair passes (``mask_fn`` needs no mask there). Rows ``>= T`` and keys ``>= S`` are
  ignored. Evaluated a few query blocks at a time (``lax.map`` over steps of about ``_MASK_CHUNK``
  pairs), so memory stays bounded for any ``T * S``.

  A ``mask_fn`` of the indices alone (no ``q_offset``, no closed-over traced array) gives the same
  block mask at every call: it is evaluated once, when the call is traced (on the default device),
  kept for later calls with the same ``mask_fn`` object computing the same thing
  (``Variant.functions``) and shapes, and enters the program as a
  constant, so the kernels pay nothing for it at run time. Otherwise it is computed inside the
  program at every call (``O(T S)`` evaluations of ``mask_fn``)."""
  if variant.mask_fn is None:
    raise ValueError("mask_fn_block_mask: the variant has no mask_fn")
  dims = dict(batch=batch, heads=heads, seq_q=seq_q, seq_k=seq_k, block_q=block_q, block_k=block_k)
  if variant.has_q_offset:
    return _block_mask(variant, arrays, **dims)
  # Keyed by the extents the mask has ([B', N']), so that a device's share of the batch or heads
  # finds the mask of the whole call (warm_static_masks) when mask_fn does not read that index.
  nb, nh = _mask_extent(variant, batch, heads)
  key = (variant, tuple(sorted({**dims, "batch": nb, "heads": nh}.items())))  # variant.functions
  if key in _STATIC_MASKS:
    return _STATIC_MASKS[key]
  with jax.ensure_compile_time_eval():
    masks = _block_mask(variant, VariantArrays(), **dims, extent=(nb, nh))
  if any(isinstance(m, jax.core.Tracer) for m in masks):
    return masks  # mask_fn reads a traced value: computed in the program
  # Host copies: a plain constant in any program (a device array made under a mesh carries that
  # mesh's sharding, which a shard_map cannot close over).
  return _STATIC_MASKS.keep(key, tuple(np.asarray(m) for m in masks))


_STATIC_WORK = _Kept(64)  # (variant, dims) -> numpy [nq]: see static_kv_work (one int per query block)


def static_kv_work(variant: Variant, *, seq_q: int, seq_k: int, block_q: int,
                   block_k: int) -> np.ndarray | None:
  """The key blocks each query block visits, ``hi - lo`` of :func:`kv_block_range`, as a numpy int
  array ``[ceil(T / block_q)]``, for a variant whose ranges are known at trace time and the same for
  every batch element and head (``Variant.static_ranges``); None for any other variant, or where it
  cannot be evaluated while tracing (then nothing is kept). Evaluated when first asked (outside a
  ``shard_map``'s manual axes: :func:`warm_static_masks` asks on the whole call) and kept: a
  persistent kernel deals its tiles by it (``kernels/sm90/forward.py``)."""
  if not variant.static_ranges:
    return None
  key = (variant, seq_q, seq_k, block_q, block_k)
  if key in _STATIC_WORK:
    return _STATIC_WORK[key]
  q_start = np.arange(-(-seq_q // block_q), dtype=np.int32) * block_q
  with jax.ensure_compile_time_eval():
    lo, _, _, hi = kv_block_range(variant, q_start, block_q, block_k, seq_k, seq_q=seq_q)
    work = hi - lo
  if isinstance(work, jax.core.Tracer):
    return None
  return _STATIC_WORK.keep(key, np.asarray(work))


def warm_static_masks(variant: Variant, tiles: dict, *, batch: int, heads: int, seq_q: int,
                      seq_k: int) -> None:
  """Computes (and keeps) the block masks of a ``mask_fn`` of the indices alone for every tile of
  ``tiles`` (as :func:`range_tables` takes them), where the call is traced: a per-device call inside
  a ``shard_map`` then finds them, since it cannot evaluate anything at trace time under its manual
  mesh axes. Nothing to do without a ``mask_fn``, or with ``q_offset`` (computed in the program).
  Likewise the per-block work of :func:`static_kv_work` for every ``"kv"`` tiling."""
  for kind, block_q, block_k in tiles.values():
    if kind == "kv":
      static_kv_work(variant, seq_q=seq_q, seq_k=seq_k, block_q=block_q, block_k=block_k)
  if variant.mask_fn is None or variant.has_q_offset:
    return
  for _, block_q, block_k in tiles.values():
    mask_fn_block_mask(variant, VariantArrays(), batch=batch, heads=heads, seq_q=seq_q,
                       seq_k=seq_k, block_q=block_q, block_k=block_k)


def _mask_extent(variant: Variant, batch: int, heads: int):
  """``(B', N')``: the batch and head extents of ``mask_fn``'s block mask, ``batch`` / ``heads``
  where ``mask_fn`` reads that index (:func:`index_reads`; with ``q_offset`` the mask is per batch
  element anyway), else 1."""
  reads = index_reads(variant, functions=("mask_fn",))
  return (batch if ("b" in reads or variant.has_q_offset) else 1,
          heads if "h" in reads else 1)


def index_reads(variant: Variant | None,
                functions: tuple[str, ...] = ("mask_fn", "score_fn")) -> frozenset[str]:
  """Which of the batch (``"b"``) and head (``"h"``) indices the variant's ``mask_fn`` or
  ``score_fn`` (those named in ``functions``) reads: those its result depends on, found abstractly
  on one pair of scalars, as every path calls them (``masking.per_pair``: the function ``vmap``-ed
  over that index with an unmapped result fails to trace when the result varies with it, through
  any operation; any other failure counts as a read too). The
  kernels give these functions the index of their grid, so an axis they read cannot be split over
  devices, and a ``mask_fn`` that reads ``h`` has a block mask per head. Memoized per variant."""
  if variant is None:
    return frozenset()
  return _index_reads(variant, tuple(functions))


@functools.lru_cache(maxsize=256)
def _index_reads(variant: Variant, functions: tuple[str, ...]) -> frozenset[str]:
  i32, f32 = jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((), jnp.float32)
  pair = (i32, i32, i32, i32)  # b, h, q_idx, kv_idx
  calls = []
  if "mask_fn" in functions and variant.mask_fn is not None:
    calls.append((variant.mask_fn, pair, 0))
  if "score_fn" in functions and variant.score_fn is not None:
    calls.append((variant.score_fn, (f32, *pair), 1))
  reads = set()
  for fn, args, first in calls:
    for name, pos in (("b", first), ("h", first + 1)):
      axes = tuple(0 if a == pos else None for a in range(len(args)))
      mapped = tuple(jax.ShapeDtypeStruct((2,), jnp.int32) if a == pos else x
                     for a, x in enumerate(args))
      try:
        jax.eval_shape(jax.vmap(fn, in_axes=axes, out_axes=None), *mapped)
      except Exception:  # noqa: BLE001 - the result varies with the index (or cannot be told)
        reads.add(name)
  return frozenset(reads)


def _block_mask(variant: Variant, arrays: VariantArrays, *, batch: int, heads: int, seq_q: int,
                seq_k: int, block_q: int, block_k: int, extent: tuple[int, int] | None = None):
  """``mask_fn_block_mask``'s computation; ``extent``: its ``_mask_extent`` when already known."""
  nq, nk = -(-seq_q // block_q), -(-seq_k // block_k)
  i32 = jnp.int32
  nb, nh = extent or _mask_extent(variant, batch, heads)
  b = jnp.arange(nb, dtype=i32)[:, None, None, None]
  h = jnp.arange(nh, dtype=i32)[None, :, None, None]
  off = (_i32(arrays.q_offset)[:nb, None, None, None] if variant.has_q_offset else i32(0))
  kv_idx = jnp.arange(nk * block_k, dtype=i32)[None, None, None, :]
  key_real = kv_idx < seq_k

  # Query blocks per lax.map step: as many as keep one step's [B', N', rows, S] mask near
  # _MASK_CHUNK elements (a few large steps: each step is a separate kernel launch on a GPU).
  per_step = max(1, min(nq, _MASK_CHUNK // max(1, nb * nh * block_q * nk * block_k)))
  steps = -(-nq // per_step)

  def one_step(st):
    rows = (st * per_step * block_q
            + jnp.arange(per_step * block_q, dtype=i32)[None, None, :, None])
    m = allowed_pairs(Variant(mask_fn=variant.mask_fn), b, h, rows + off, kv_idx)  # per pair
    m = jnp.broadcast_to(m, (nb, nh, per_step * block_q, nk * block_k))
    real = (rows < seq_q) & key_real
    shape = (nb, nh, per_step, block_q, nk, block_k)
    any_ = (m & real).reshape(shape).any((3, 5))
    all_ = (m | ~real).reshape(shape).all((3, 5))
    return any_, all_  # [B', N', per_step, nk]

  any_, all_ = lax.map(one_step, jnp.arange(steps, dtype=i32))  # [steps, B', N', per_step, nk]
  any_, all_ = (jnp.moveaxis(x, 0, 2).reshape(nb, nh, steps * per_step, nk)[:, :, :nq]
                for x in (any_, all_))
  return any_, all_


def mask_fn_depends_on_head(variant: Variant, heads: int) -> bool:
  """True when ``variant.mask_fn`` reads the head index (:func:`index_reads`) and there are heads to
  tell apart."""
  return heads > 1 and "h" in index_reads(variant, functions=("mask_fn",))


# --- the tables the kernels read --------------------------------------------------------------------

def _with_mask_fn(rng, any_, all_):
  """Intersect ``(lo, full_lo, full_hi, hi)`` ``[B, n]`` with a ``mask_fn`` block mask ``[B', N', n,
  m]`` -> ranges ``[B, N', n]``: reachable blocks must pass ``any_``, full ones ``all_``."""
  m = any_.shape[-1]
  idx = jnp.arange(m, dtype=jnp.int32)[None, None, None, :]  # [1, 1, 1, m]
  lo, full_lo, full_hi, hi = (x[:, None, :, None] for x in rng)  # [B, 1, n, 1]
  reach = (idx >= lo) & (idx < hi) & any_
  full = (idx >= full_lo) & (idx < full_hi) & all_
  return _ranges_from_table(reach, full)


def kv_range_table(variant: Variant, arrays: VariantArrays, *, batch: int, heads: int, seq_q: int,
                   seq_k: int, block_q: int, block_k: int):
  """The key-block ranges a forward or dQ kernel reads: int32 ``[B, N', ceil(T / block_q), 4]``
  (``N' = N`` when ``mask_fn`` depends on the head, else 1) of ``(lo, full_lo, full_hi, hi)`` per
  (batch element, head, query block): analytic terms, segments and the ``mask_fn`` block mask."""
  rng = kv_block_ranges(variant, arrays, batch=batch, seq_q=seq_q, seq_k=seq_k, block_q=block_q,
                        block_k=block_k)  # [B, nq, 4]
  if variant.mask_fn is None:
    return rng[:, None]
  any_, all_ = mask_fn_block_mask(variant, arrays, batch=batch, heads=heads, seq_q=seq_q,
                                  seq_k=seq_k, block_q=block_q, block_k=block_k)  # [B', N', nq, nk]
  out = _with_mask_fn(tuple(rng[..., c] for c in range(4)), any_, all_)
  return jnp.stack(jnp.broadcast_arrays(*out), -1).astype(jnp.int32)


def q_range_table(variant: Variant, arrays: VariantArrays, *, batch: int, heads: int, seq_q: int,
                  seq_k: int, block_q: int, block_k: int):
  """The query-block ranges a dK/dV kernel reads: int32 ``[B, N', ceil(S / block_k), 4]`` per
  (batch element, query head, key block), as :func:`kv_range_table` transposed."""
  rng = q_block_ranges(variant, arrays, batch=batch, seq_q=seq_q, seq_k=seq_k, block_q=block_q,
                       block_k=block_k)  # [B, nk, 4]
  if variant.mask_fn is None:
    return rng[:, None]
  any_, all_ = mask_fn_block_mask(variant, arrays, batch=batch, heads=heads, seq_q=seq_q,
                                  seq_k=seq_k, block_q=block_q, block_k=block_k)  # [B', N', nq, nk]
  out = _with_mask_fn(tuple(rng[..., c] for c in range(4)), jnp.swapaxes(any_, 2, 3),
                      jnp.swapaxes(all_, 2, 3))
  return jnp.stack(jnp.broadcast_arrays(*out), -1).astype(jnp.int32)


def range_tables(variant: Variant, arrays: VariantArrays, tiles: dict, *, batch: int, heads: int,
                 seq_q: int, seq_k: int) -> dict:
  """Every range table a backend's kernels read, by name: ``tiles`` maps a name to ``("kv",
  block_q, block_k)`` (:func:`kv_range_table`: forward and dQ kernels) or ``("q", block_q,
  block_k)`` (:func:`q_range_table`: dK/dV kernels), as the backend's config gives them
  (``BlockSizes.range_tiles``, ``MosaicConfig.range_tiles``). Computed once per call, outside the
  kernels' ``custom_vjp``, and shared by the forward and the backward."""
  build = {"kv": kv_range_table, "q": q_range_table}
  return {name: build[kind](variant, arrays, batch=batch, heads=heads, seq_q=seq_q, seq_k=seq_k,
                            block_q=bq, block_k=bk) for name, (kind, bq, bk) in tiles.items()}
