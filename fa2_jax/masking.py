"""Which (query, key) pairs may attend and how their scores are modified: the one definition shared by
every kernel and the reference formula.

Everything here is plain ``jnp`` on broadcastable int32 index arrays, with no Python control flow on
traced values, so the same functions run on a kernel's tile (``q_idx`` of shape ``[block_q, 1]``,
``kv_idx`` of shape ``[1, block_k]``, per-row / per-column vectors for lengths and segment ids, scalar
batch and head indices) and on the reference's whole ``[B, N, T, S]`` arrays. Because both use these
functions they cannot disagree about the mask.

Positions. Query row ``i`` (``0 <= i < T``) of batch element ``b`` sits at the *absolute* position
``p = q_offset[b] + i`` (``q_offset = 0`` by default: top-left alignment, as
``jax.nn.dot_product_attention``); key ``j`` (``0 <= j < S``) sits at position ``j``. ``q_idx`` below
always means ``p``, ``kv_idx`` means ``j``.

The rule (:func:`allowed_pairs`): the pair ``(b, h, i, j)`` is allowed when every active term holds:

* causal: ``j <= p``;
* window ``(left, right)``: ``p - left <= j <= p + right`` (a side ``None`` is unbounded; with causal
  the right side is ``min(right, 0)``);
* query lengths: ``i < q_len[b]`` (rows past it are padding: no key at all);
* key/value lengths: ``j < kv_len[b]``;
* segments: ``q_seg[b, i] == kv_seg[b, j]``;
* ``mask_fn(b, h, p, j)`` is True;
* (kernels only) ``j < seq_k``: the padded tail of the last key tile.

Scores (:func:`modify_scores`), per pair, in this order: ``s = scale * q_i . k_j``;
``s = cap * tanh(s / cap)`` (soft cap); ``s = s - slope[b, h] * |p - j|`` (ALiBi);
``s = score_fn(s, b, h, p, j)``; then disallowed pairs become ``-inf``. A row with no allowed key has
output 0, lse ``-inf`` and zero gradients.

Block ranges (:func:`kv_block_range`, :func:`q_block_range`, :func:`kv_block_ranges`,
:func:`q_block_ranges`, :func:`mask_fn_block_mask`) tell a kernel which tiles it can skip (no allowed
pair) and which need no mask (every pair allowed).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

# Bound on |window side|, |q_offset| and sequence lengths: the sum of two such int32 values (p + right,
# p - left) cannot overflow int32 (2**31 - 1).
INT32_SAFE = 1 << 30


@dataclasses.dataclass(frozen=True)
class Variant:
  """The static part of an attention variant (hashable: a kernel's static argument).

  Attributes:
    is_causal: ``j <= p``.
    window: ``(left, right)`` (each an int >= 0 or None for unbounded) or None for no window.
    has_q_lengths: the call has ``query_seq_lengths`` (``VariantArrays.q_lengths``).
    has_kv_lengths: the call has ``key_value_seq_lengths`` (``VariantArrays.kv_lengths``).
    has_segments: the call has ``q_segment_ids`` and ``kv_segment_ids``.
    has_q_offset: the call has ``q_offset`` (``VariantArrays.q_offset``); otherwise positions start at 0.
    soft_cap: the ``logits_soft_cap`` (a float > 0) or None.
    has_alibi: the call has ``alibi_slopes`` (``VariantArrays.alibi_slopes``).
    mask_fn: ``mask_fn(b, h, q_idx, kv_idx) -> bool`` or None.
    score_fn: ``score_fn(score, b, h, q_idx, kv_idx) -> score`` or None.
  """

  is_causal: bool = False
  window: tuple[int | None, int | None] | None = None
  has_q_lengths: bool = False
  has_kv_lengths: bool = False
  has_segments: bool = False
  has_q_offset: bool = False
  soft_cap: float | None = None
  has_alibi: bool = False
  mask_fn: Callable | None = None
  score_fn: Callable | None = None

  @classmethod
  def dense(cls) -> "Variant":
    """Plain attention: every pair allowed, scores unmodified."""
    return cls()

  @property
  def is_dense(self) -> bool:
    """True for plain attention (not even causal)."""
    return self == Variant()

  @property
  def needs_mask(self) -> bool:
    """True when some pair may be disallowed (:func:`allowed_pairs` returns an array)."""
    return (self.is_causal or self.window is not None or self.has_q_lengths or self.has_kv_lengths
            or self.has_segments or self.mask_fn is not None)

  @property
  def modifies_scores(self) -> bool:
    """True when :func:`modify_scores` changes the scaled logits."""
    return self.soft_cap is not None or self.has_alibi or self.score_fn is not None

  @property
  def bounds(self) -> tuple[int | None, int | None]:
    """``(left, right)``: keys ``p - left <= j <= p + right`` may attend, None for unbounded; the
    causal rule is folded in (``right = min(right, 0)``)."""
    left, right = self.window if self.window is not None else (None, None)
    if self.is_causal:
      right = 0 if right is None else min(right, 0)
    return left, right

  @property
  def features(self) -> tuple[str, ...]:
    """The public arguments this variant uses beyond ``is_causal`` (what a backend must implement)."""
    names = []
    if self.has_q_lengths:
      names.append("query_seq_lengths")
    if self.has_kv_lengths:
      names.append("key_value_seq_lengths")
    if self.window is not None:
      names.append("local_window_size")
    if self.has_segments:
      names.append("q_segment_ids/kv_segment_ids")
    if self.has_q_offset:
      names.append("q_offset")
    if self.soft_cap is not None:
      names.append("logits_soft_cap")
    if self.has_alibi:
      names.append("alibi_slopes")
    if self.mask_fn is not None:
      names.append("mask_fn")
    if self.score_fn is not None:
      names.append("score_fn")
    return tuple(names)


class VariantArrays(NamedTuple):
  """The array part of a variant (a pytree), normalised by the public API; None where unused.

  Attributes:
    q_lengths: ``[B]`` int32, valid query rows per batch element.
    kv_lengths: ``[B]`` int32, valid keys per batch element.
    q_segment_ids: ``[B, T]`` int32.
    kv_segment_ids: ``[B, S]`` int32.
    q_offset: ``[B]`` int32, absolute position of query row 0.
    alibi_slopes: ``[B, N]`` float32 (not differentiated).
  """

  q_lengths: jax.Array | None = None
  kv_lengths: jax.Array | None = None
  q_segment_ids: jax.Array | None = None
  kv_segment_ids: jax.Array | None = None
  q_offset: jax.Array | None = None
  alibi_slopes: jax.Array | None = None


# --- the elementwise rule -------------------------------------------------------------------------

def allowed_pairs(variant: Variant, b, h, q_idx, kv_idx, *, q_len=None, kv_len=None, q_seg=None,
                  kv_seg=None, q_offset=None, seq_k=None):
  """Boolean mask, True where the pair may attend (the rule of the module docstring).

  Args:
    variant: the static :class:`Variant`.
    b, h: batch and query-head indices, int32 scalars or arrays broadcastable against the others
      (only ``mask_fn`` reads them).
    q_idx: int32 absolute query positions ``p = q_offset + i`` (e.g. ``[block_q, 1]``).
    kv_idx: int32 key indices ``j`` (e.g. ``[1, block_k]``).
    q_len, kv_len: the batch element's lengths (scalars or broadcastable), needed when
      ``variant.has_q_lengths`` / ``has_kv_lengths``.
    q_seg, kv_seg: segment ids of the rows (e.g. ``[block_q, 1]``) and keys (``[1, block_k]``), needed
      when ``variant.has_segments``.
    q_offset: the batch element's offset, needed for the query-length term when
      ``variant.has_q_offset`` (the row index is ``q_idx - q_offset``).
    seq_k: when given, keys at ``kv_idx >= seq_k`` (a tile's padded tail) are masked out.

  Returns:
    A bool array of the broadcast shape of the index arrays (and of ``mask_fn``'s result), or None
    when nothing is masked.
  """
  terms = []
  left, right = variant.bounds
  if right is not None:
    terms.append(kv_idx <= (q_idx + right if right else q_idx))  # causal: right = 0, no add
  if left is not None:
    terms.append(kv_idx >= (q_idx - left if left else q_idx))
  if variant.has_q_lengths:
    if q_len is None:
      raise ValueError("allowed_pairs: the variant has query lengths; pass q_len")
    if variant.has_q_offset and q_offset is None:
      raise ValueError("allowed_pairs: the variant has query lengths and q_offset; pass q_offset")
    row = q_idx - q_offset if variant.has_q_offset else q_idx
    terms.append(row < q_len)
  if variant.has_kv_lengths:
    if kv_len is None:
      raise ValueError("allowed_pairs: the variant has key/value lengths; pass kv_len")
    terms.append(kv_idx < kv_len)
  if variant.has_segments:
    if q_seg is None or kv_seg is None:
      raise ValueError("allowed_pairs: the variant has segment ids; pass q_seg and kv_seg")
    terms.append(q_seg == kv_seg)
  if variant.mask_fn is not None:
    terms.append(jnp.asarray(variant.mask_fn(b, h, q_idx, kv_idx), jnp.bool_))
  if seq_k is not None:
    terms.append(kv_idx < seq_k)
  if not terms:
    return None
  mask = functools.reduce(jnp.logical_and, terms)
  shape = jnp.broadcast_shapes(jnp.shape(mask), jnp.shape(q_idx), jnp.shape(kv_idx))
  return jnp.broadcast_to(mask, shape)


def allowed(*args, is_causal: bool | None = None, seq_k=None, **kwargs):
  """The mask, in two call forms (one rule, :func:`allowed_pairs`):

  * ``allowed(variant, b, h, q_idx, kv_idx, *, q_len, kv_len, q_seg, kv_seg, q_offset, seq_k)``: the
    general form, the same as :func:`allowed_pairs`.
  * ``allowed(q_pos, k_pos, *, is_causal, seq_k=None)``: the causal-only form the causal kernels call,
    ``allowed_pairs(Variant(is_causal=is_causal), None, None, q_pos, k_pos, seq_k=seq_k)``.

  Returns:
    A boolean array of the broadcast shape, or ``None`` when nothing is masked.
  """
  if args and isinstance(args[0], Variant):
    if is_causal is not None:
      raise TypeError("allowed(variant, ...): is_causal is part of the Variant")
    return allowed_pairs(*args, seq_k=seq_k, **kwargs)
  if len(args) != 2 or is_causal is None or kwargs:
    raise TypeError("allowed takes (variant, b, h, q_idx, kv_idx, **arrays) or "
                    "(q_pos, k_pos, *, is_causal, seq_k=None)")
  q_pos, k_pos = args
  return allowed_pairs(Variant(is_causal=bool(is_causal)), None, None, q_pos, k_pos, seq_k=seq_k)


# --- scores ---------------------------------------------------------------------------------------

def _modify(variant: Variant, s, b, h, q_idx, kv_idx, slope, with_derivative: bool):
  deriv = None
  if variant.soft_cap is not None:
    cap = variant.soft_cap
    s = cap * jnp.tanh(s / cap)
    if with_derivative:
      t = s / cap
      deriv = 1.0 - t * t  # d(cap * tanh(x / cap)) / dx = 1 - tanh^2
  if variant.has_alibi:
    if slope is None:
      raise ValueError("modify_scores: the variant has ALiBi; pass slope")
    dist = jnp.abs(q_idx - kv_idx).astype(s.dtype)  # |p - j|, int32 -> float
    s = s - jnp.asarray(slope).astype(s.dtype) * dist  # d/ds = 1
  if variant.score_fn is not None:
    fn = lambda x: variant.score_fn(x, b, h, q_idx, kv_idx)  # noqa: E731
    if with_derivative:
      s, d_fn = jax.jvp(fn, (s,), (jnp.ones_like(s),))
      deriv = d_fn if deriv is None else deriv * d_fn
    else:
      s = fn(s)
  return s, deriv


def modify_scores(variant: Variant, s, b, h, q_idx, kv_idx, *, slope=None):
  """The scaled logits ``s`` after soft cap, ALiBi and ``score_fn`` (in that order).

  Args:
    s: float scaled logits ``scale * q . k`` of the pairs (e.g. ``[block_q, block_k]``).
    b, h, q_idx, kv_idx: as in :func:`allowed_pairs` (``q_idx`` absolute).
    slope: the ALiBi slope of ``(b, h)`` (scalar or broadcastable), needed when ``variant.has_alibi``.
  """
  return _modify(variant, s, b, h, q_idx, kv_idx, slope, False)[0]


def modify_scores_and_derivative(variant: Variant, s, b, h, q_idx, kv_idx, *, slope=None):
  """``(modify_scores(...), score_derivative(...))`` in one pass (what a backward kernel needs)."""
  return _modify(variant, s, b, h, q_idx, kv_idx, slope, True)


def score_derivative(variant: Variant, s, b, h, q_idx, kv_idx, *, slope=None):
  """``d s_out / d s_in`` per element for the backward (``s`` the scaled logits before
  :func:`modify_scores`): soft cap ``1 - (s_cap / cap)^2``, ALiBi 1, ``score_fn`` by ``jax.jvp``
  (``score_fn`` must be elementwise in the score). None when it is 1 everywhere."""
  return _modify(variant, s, b, h, q_idx, kv_idx, slope, True)[1]


# --- block ranges (analytic: causal, window, lengths, offset) -------------------------------------

def _i32(x):
  return jnp.asarray(x, jnp.int32)


def _div(x, m: int):
  """``x // m`` for non-negative int32 ``x`` (truncating division, no sign fix-up in a kernel)."""
  return lax.div(_i32(x), jnp.int32(m))


def _cdiv(x, m: int):
  """``ceil(x / m)`` for non-negative int32 ``x``."""
  return _div(_i32(x) + (m - 1), m)


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
  reach_hi = key_end if right is None else jnp.clip(p_last + right + 1, 0, key_end)
  full_lo_k = zero if left is None else jnp.clip(p_last_all - left, 0, key_end)
  full_hi_k = key_end if right is None else jnp.clip(p_first + right + 1, 0, key_end)
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
  j_first, j_last, j_last_all = k_start, key_end - 1, k_start + k_cols - 1
  reach_lo = zero if right is None else jnp.clip(j_first - right - off, 0, row_end)
  reach_hi = row_end if left is None else jnp.clip(j_last + left - off + 1, 0, row_end)
  full_lo_r = zero if right is None else jnp.clip(j_last_all - right - off, 0, row_end)
  full_hi_r = row_end if left is None else jnp.clip(j_first + left - off + 1, 0, row_end)
  nonempty = nonempty & (reach_lo < reach_hi)
  # A full query block needs all its rows real: [ib*bq, ib*bq + bq) within row_end.
  return _normalize(_div(reach_lo, block_q), _cdiv(full_lo_r, block_q), _div(full_hi_r, block_q),
                    _cdiv(reach_hi, block_q), nonempty, keys_full)


# --- block ranges of a whole call (wrapper side, vectorised) --------------------------------------

def _block_min_max(ids, block: int):
  """Per-block min and max of ``ids [B, L]`` -> ``[B, ceil(L / block)]`` each (the tail block's
  missing entries repeat its last id, so they change nothing)."""
  b, length = ids.shape
  nb = -(-length // block)
  padded = jnp.pad(ids, ((0, 0), (0, nb * block - length)), mode="edge").reshape(b, nb, block)
  return padded.min(-1), padded.max(-1)


def _ranges_from_table(reach, full):
  """``(lo, full_lo, full_hi, hi)`` along the last axis of bool tables ``reach``/``full``
  ``[..., n]``: ``[lo, hi)`` spans every reachable block; ``[full_lo, full_hi)`` is the first run of
  full blocks."""
  n = reach.shape[-1]
  idx = jnp.arange(n, dtype=jnp.int32)
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
    q_min, q_max = _block_min_max(_i32(arrays.q_segment_ids), block_q)  # [B, nq]
    k_min, k_max = _block_min_max(_i32(arrays.kv_segment_ids), block_k)  # [B, nk]
    reach = ((q_min[:, :, None] <= k_max[:, None, :]) & (k_min[:, None, :] <= q_max[:, :, None]))
    full = ((q_min == q_max)[:, :, None] & (k_min == k_max)[:, None, :]
            & (q_min[:, :, None] == k_min[:, None, :]))
    rng = intersect_ranges(rng, _ranges_from_table(reach, full))
  return jnp.stack(rng, -1)


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
    q_min, q_max = _block_min_max(_i32(arrays.q_segment_ids), block_q)  # [B, nq]
    k_min, k_max = _block_min_max(_i32(arrays.kv_segment_ids), block_k)  # [B, nk]
    reach = ((k_min[:, :, None] <= q_max[:, None, :]) & (q_min[:, None, :] <= k_max[:, :, None]))
    full = ((k_min == k_max)[:, :, None] & (q_min == q_max)[:, None, :]
            & (k_min[:, :, None] == q_min[:, None, :]))
    rng = intersect_ranges(rng, _ranges_from_table(reach, full))
  return jnp.stack(rng, -1)


def mask_fn_block_mask(variant: Variant, arrays: VariantArrays, *, batch: int, heads: int,
                       seq_q: int, seq_k: int, block_q: int, block_k: int):
  """Per-block summary of ``mask_fn`` alone: ``(any_, all_)`` bool ``[B', N', nq, nk]`` (``B'`` is 1
  when neither ``mask_fn`` nor ``q_offset`` depends on the batch element, ``N'`` is 1 when ``mask_fn``
  ignores the head). ``any_`` False: no pair of the block pair passes ``mask_fn`` (skip it); ``all_``
  True: every pair passes (``mask_fn`` needs no mask there). Rows ``>= T`` and keys ``>= S`` are
  ignored. Evaluated one query block at a time (``lax.map``), so memory is ``O(B' N' block_q S)``;
  compute it once per call and reuse it in the forward and backward."""
  if variant.mask_fn is None:
    raise ValueError("mask_fn_block_mask: the variant has no mask_fn")
  nq, nk = -(-seq_q // block_q), -(-seq_k // block_k)
  i32 = jnp.int32
  probe = jax.eval_shape(variant.mask_fn, jax.ShapeDtypeStruct((batch, 1, 1, 1), i32),
                         jax.ShapeDtypeStruct((1, heads, 1, 1), i32),
                         jax.ShapeDtypeStruct((1, 1, block_q, 1), i32),
                         jax.ShapeDtypeStruct((1, 1, 1, nk * block_k), i32)).shape
  probe = (1,) * (4 - len(probe)) + tuple(probe)
  nb = batch if (probe[0] != 1 or variant.has_q_offset) else 1
  nh = heads if probe[1] != 1 else 1
  b = jnp.arange(nb, dtype=i32)[:, None, None, None]
  h = jnp.arange(nh, dtype=i32)[None, :, None, None]
  off = (_i32(arrays.q_offset)[:nb, None, None, None] if variant.has_q_offset else i32(0))
  kv_idx = jnp.arange(nk * block_k, dtype=i32)[None, None, None, :]
  key_real = kv_idx < seq_k

  def one_block(iq):
    rows = iq * block_q + jnp.arange(block_q, dtype=i32)[None, None, :, None]
    m = jnp.asarray(variant.mask_fn(b, h, rows + off, kv_idx), jnp.bool_)
    m = jnp.broadcast_to(m, (nb, nh, block_q, nk * block_k))
    real = (rows < seq_q) & key_real
    any_ = (m & real).reshape(nb, nh, block_q, nk, block_k).any((2, 4))
    all_ = (m | ~real).reshape(nb, nh, block_q, nk, block_k).all((2, 4))
    return any_, all_

  any_, all_ = lax.map(one_block, jnp.arange(nq, dtype=i32))  # [nq, B', N', nk]
  return jnp.moveaxis(any_, 0, 2), jnp.moveaxis(all_, 0, 2)
