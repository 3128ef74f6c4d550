"""Split-KV ("flash-decoding") forward for a few new query rows against a long key/value cache.

Grid ``(b, kv head, split)``. A program packs the ``G = N / K`` query heads that share its KV head,
times the ``T`` new rows, into the rows of one tile (row ``r = t * G + g``, padded up to a power of
two of at least 16 rows: a tensor-core dot's ``M``), so the group's K/V tiles are read once for all of
them instead of once per query head. The rows' reachable key blocks ``[lo, hi)`` follow from the
lengths, ``q_offset``, causality and the window (:func:`kernels.block_ranges.kv_block_range`, on
int32 scalars inside the kernel); split ``c`` of ``num_splits`` runs the ``c``-th even share of them,
so a short row's range is split as finely as a long one's and a block no row reaches is never
loaded (a share past a row's range loads nothing). Inside its share a program runs the training
forward's online softmax (kernels/triton/forward.py): unmasked blocks ``[full_lo, full_hi)``
without a mask, the others with the variant's rule.

Each program writes its share's output, already divided by its row sum, and its rows' statistics
``(r, l)`` in the kernels' form (kernels/softmax.py: ``r`` the raw logit of the largest ``s * c``,
``l`` the row sum relative to that logit's weight). With one split these are the result, written
straight into ``out [B, T, N, Hv]`` (q's dtype; ``Hv`` the value's head_dim, ``H`` or another) and
``stats [B, N, 2, T]``; with several, float32 partials ``[B, splits, T, N, Hv]`` /
``[B, splits, N, 2, T]`` that :func:`combine` (a second small kernel, grid ``(B, K, column chunks)``) merges exactly
by their log-sum-exp into the same two outputs. Between and around the kernels only reshapes (free)
run.

Paged caches (``block_table``): K and V are ``[pages, page_size, K, H]`` (V's last axis ``Hv``); the
row's key ``j`` lives
at ``(block_table[b, j // page_size], j % page_size)``, and every loop step gathers its ``block_k``
key rows through the table (any page order, shared pages, any page size: one row's gather is
``H`` contiguous elements).
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..block_ranges import kv_block_range
from ..masking import OFFSET_RANGE, Variant, VariantArrays, allowed_pairs, kernel_scores
from ..softmax import exponent_scale, huge_row_scale, row_sum_at_max
from ..triton.common import LOG2E, cdiv, compiler_params, dot, load_tile, padded_head_dim
from ..triton.variant import add_scalar_inputs, zero_unattended
from ..vma import out_struct
from .config import row_splits


def _idiv(x, m: int):
  """``x // m`` elementwise for a non-negative int32 array and a static ``m`` (one truncating
  division: no sign fix-up)."""
  return lax.div(x, jnp.full(x.shape, m, x.dtype)) if m > 1 else x


def _packed_rows(kh, *, seq_q: int, group: int, heads: int, rows_padded: int):
  """The rows of KV head ``kh``'s tile: ``(t, head, real, row, stat)`` per tile row ``r = t * G +
  g`` (int32 ``[rows_padded]``): its new-token index, query head, whether it is a row at all (the
  padding up to ``rows_padded`` is not), its row of the ``[T * N, H]`` view of q and out and its
  index ``(head, 0, t)`` in the ``[N * 2 * T]`` view of the statistics. A padding row's indices
  point past the end (masked: never read or written; in interpret mode an out-of-range gather is
  clamped and an out-of-range scatter dropped)."""
  r = jnp.arange(rows_padded, dtype=jnp.int32)
  t = _idiv(r, group)
  head = kh * group + (r - t * group)
  real = r < seq_q * group
  row = jnp.where(real, t * heads + head, seq_q * heads)
  stat = jnp.where(real, head * (2 * seq_q) + t, heads * 2 * seq_q)
  return t, head, real, row, stat


def _kernel(q_ref, k_ref, v_ref, *rest, scale: float, variant: Variant, names: tuple[str, ...],
            seq_q: int, seq_k: int, heads: int, group: int, head_dim: int, value_head_dim: int,
            block_k: int, rows_padded: int, splits: int, page_size: int | None, f32: bool,
            batch: int, split_target: int | None):
  # q_ref: [T * N, hp] (this batch element's rows, row t * N + head); k_ref: [S, hp] (this KV head)
  # or, paged, [pages, page_size, hp]; v_ref the same with hvp; then the variant operands named by
  # `names`; o_ref: [T * N, hvp] of this split; stats_ref: [N * 2 * T] of this split (the [N, 2, T]
  # statistics); counts_ref (split_target set): this row's split count, a scalar. hp, hvp: H and Hv
  # padded (triton.common.padded_head_dim).
  var_refs, out_refs = rest[:len(names)], rest[len(names):]
  o_ref, stats_ref = out_refs[:2]
  refs = dict(zip(names, var_refs))
  hp, hvp = q_ref.shape[-1], v_ref.shape[-1]
  b, kh, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  rp = rows_padded
  t_of, head, real, qrow, at = _packed_rows(kh, seq_q=seq_q, group=group, heads=heads,
                                            rows_padded=rp)
  qrow = qrow[:, None]  # [rp, 1]

  def columns(dim: int, padded: int):
    """The ``[1, padded]`` column indices and which of them are real (None: all)."""
    cols = jnp.arange(padded, dtype=jnp.int32)[None, :]
    return cols, None if dim == padded else cols < dim

  q_cols, q_col_ok = columns(head_dim, hp)
  o_cols, o_col_ok = columns(value_head_dim, hvp)  # V's, the output's
  row_mask = lambda rows, ok: rows[:, None] if ok is None else rows[:, None] & ok  # noqa: E731

  # The scalars as given (int32): clipped here to the ranges they act as (masking.clip_ranges).
  bounds = {"q_offset": OFFSET_RANGE, "q_len": (0, seq_q), "kv_len": (0, seq_k)}
  scalar = lambda name, x: jnp.clip(x, *bounds[name])  # noqa: E731
  off = scalar("q_offset", refs["q_offset"][()]) if "q_offset" in refs else jnp.int32(0)
  q_len = scalar("q_len", refs["q_len"][()]) if "q_len" in refs else None
  kv_len = scalar("kv_len", refs["kv_len"][()]) if "kv_len" in refs else None
  pos = off + t_of  # [rp] absolute positions of the rows
  slope = None
  if "slopes" in refs:
    slope = plgpu.load(refs["slopes"].at[jnp.where(real, head, 0)])[:, None]  # [rp, 1]
  key_end = seq_k if kv_len is None else kv_len

  # The rows' key blocks: [lo, hi) reachable, [full_lo, full_hi) with every pair allowed.
  lo, full_lo, full_hi, hi = kv_block_range(variant, jnp.int32(0), seq_q, block_k, seq_k,
                                            seq_q=seq_q, q_offset=off, q_len=q_len, kv_len=kv_len)
  # This row's split count: the grid's, or its own from its reachable keys and every row's
  # (row_splits, over the [B] arrays gathered whole: B need not be a power of two); a program past
  # it has an empty share and loads and writes nothing. Each row's first program records the count
  # for the combine.
  n_split = splits
  if split_target is not None:
    every = jnp.arange(1 << max(0, (batch - 1).bit_length()), dtype=jnp.int32)
    ok = every < batch

    def each_row(name):
      ref = refs.get("every_" + name)
      return None if ref is None else scalar(name, plgpu.load(ref.at[jnp.where(ok, every, 0)],
                                                              mask=ok, other=0))

    lo_b, _, _, hi_b = kv_block_range(variant, jnp.int32(0), seq_q, block_k, seq_k, seq_q=seq_q,
                                      q_offset=each_row("q_offset"), q_len=each_row("q_len"),
                                      kv_len=each_row("kv_len"))
    total = jnp.sum(jnp.where(ok, jnp.broadcast_to(hi_b - lo_b, every.shape), 0))
    n_split = row_splits(hi - lo, kv_heads=heads // group, grid_splits=splits,
                         target=split_target, total=total)

    @pl.when(split == 0)
    def _():
      out_refs[2][...] = n_split
  live = split < n_split
  # Row gathers index every axis with an array (the form Pallas interpret mode takes too); a program
  # past its row's splits reads no q either.
  q = plgpu.load(q_ref.at[qrow, q_cols], mask=row_mask(real & live, q_col_ok),
                 other=0.0)  # [rp, hp]
  share = cdiv(hi - lo, n_split)
  c0 = jnp.minimum(lo + split * share, hi)
  c1 = jnp.minimum(c0 + share, hi)

  if page_size is None:
    def load_kv(ref, start, limit, dim):
      return load_tile(ref, start, block_k, limit, dim)
  else:
    table = refs["block_table"]  # [max_pages] int32 of this batch element

    def load_kv(ref, start, limit, dim):
      cols, col_ok = columns(dim, ref.shape[-1])
      j = start + jnp.arange(block_k, dtype=jnp.int32)
      ok = j < (seq_k if limit is None else limit)
      j = jnp.where(ok, j, 0)
      index = _idiv(j, page_size)
      page = jnp.clip(plgpu.load(table.at[index]), 0, ref.shape[0] - 1)  # ids past the pages: clip
      rows = ref.at[page[:, None], (j - index * page_size)[:, None], cols]
      mask = ok[:, None] if col_ok is None else ok[:, None] & col_ok
      return plgpu.load(rows, mask=mask, other=0.0)

  fold = scale != 0 and not variant.modifies_scores
  c = scale * LOG2E if fold else 1.0
  fill = jnp.inf if c < 0 else -jnp.inf  # a masked raw logit: exp2(fill * c) = 0

  def body(j, carry, masked: bool):
    acc, m_i, l_i, r_i = carry
    start = j * block_k
    k = load_kv(k_ref, start, key_end if masked else None, head_dim)  # [block_k, hp]
    v = load_kv(v_ref, start, key_end if masked else None, value_head_dim)  # [block_k, hvp]
    s = dot(q, k, trans_b=True, f32=f32)  # [rp, block_k] f32
    kv_idx = start + jnp.arange(block_k, dtype=jnp.int32)[None, :]
    if variant.modifies_scores:
      s, _ = kernel_scores(variant, s, b, None, pos[:, None], kv_idx, scale=scale,
                           out_scale=LOG2E, slope=slope, kv_extent=seq_k)
    elif not fold:
      s = s * (scale * LOG2E)
    if masked:
      keep = allowed_pairs(variant, b, None, pos[:, None], kv_idx, q_len=q_len, kv_len=kv_len,
                           q_offset=off, seq_k=seq_k)
      keep = real[:, None] if keep is None else keep & real[:, None]
      v = zero_unattended(keep, v, 0)  # no 0 * NaN in P V from a key no row attends
      s = jnp.where(keep, s, fill)
    # The online softmax of kernels/triton/forward.py, row for row.
    r_new = jnp.minimum(r_i, jnp.min(s, axis=1)) if c < 0 else jnp.maximum(r_i, jnp.max(s, axis=1))
    m_new = jnp.maximum(m_i, r_new * c)
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
    r_use = jnp.where(m_new == -jnp.inf, 0.0, r_new) if masked else r_new
    alpha = jnp.exp2(m_i - m_use)
    if scale == 0:
      p = jnp.exp2(s - m_use[:, None])
    else:
      c_row, t_row = huge_row_scale(r_use, m_use, c, v.dtype)
      p = jnp.exp2(s * c_row[:, None] - t_row[:, None])
    l_new = alpha * l_i + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v, f32=f32)
    return acc, m_new, l_new, r_new

  carry = (jnp.zeros((rp, hvp), jnp.float32), jnp.full((rp,), -jnp.inf, jnp.float32),
           jnp.zeros((rp,), jnp.float32), jnp.full((rp,), fill, jnp.float32))
  masked, unmasked = functools.partial(body, masked=True), functools.partial(body, masked=False)
  # This split's share [c0, c1) of the three ranges: masked [lo, full_lo), unmasked [full_lo,
  # full_hi), masked [full_hi, hi). An empty share (c0 >= c1) runs no step and loads nothing.
  carry = lax.fori_loop(jnp.maximum(full_lo, c0), jnp.maximum(jnp.minimum(full_hi, c1), c0),
                        unmasked, carry)
  carry = lax.fori_loop(c0, jnp.maximum(jnp.minimum(full_lo, c1), c0), masked, carry)
  acc, m_i, l_i, r_i = lax.fori_loop(jnp.maximum(full_hi, c0), c1, masked, carry)

  out = acc / jnp.where(l_i == 0.0, 1.0, l_i)[:, None]
  written = real & live
  plgpu.store(o_ref.at[qrow, o_cols], out.astype(o_ref.dtype), mask=row_mask(written, o_col_ok))
  if scale != 0:
    l_i = row_sum_at_max(r_i, m_i, l_i, c, v_ref.dtype)
  plgpu.store(stats_ref.at[at], r_i, mask=written)
  plgpu.store(stats_ref.at[at + seq_q], l_i, mask=written)


def forward(q, k, v, *, scale: float, variant: Variant, arrays: VariantArrays | None,
            block_k: int, num_splits: int, rows_padded: int, num_warps: int, num_stages: int,
            interpret: bool, block_table=None, seq_k: int | None = None,
            split_target: int | None = None):
  """Run the decode forward (and :func:`combine` when it splits the keys).

  Args:
    q: ``[B, T, N, H]``; k: ``[B, S, K, H]``, v: ``[B, S, K, Hv]`` with ``N % K == 0``, or with
      ``block_table`` pages ``[pages, page_size, K, H]`` (v: ``Hv``).
    variant, arrays: the attention variant (:mod:`kernels.masking`; lengths, ``q_offset``, window,
      soft cap and ALiBi: the features of :class:`kernels.decode.backend.DecodeBackend`).
    block_k, num_splits, rows_padded, num_warps, num_stages: the launch (:class:`DecodeLaunch`).
    block_table: int32 ``[B, max_pages]`` for a paged cache, else None; ``seq_k`` then the keys per
      row the call spans (``max_pages * page_size``).
    split_target: None: every row runs ``num_splits`` splits; else each row its own count, at most
      ``num_splits``, from the rows' reachable key blocks (:func:`kernels.decode.config.row_splits`
      for about ``split_target`` programs), computed in the kernel's programs.

  Returns:
    ``out [B, T, N, Hv]`` (q's dtype) and ``stats [B, N, 2, T]`` float32, as
    :meth:`kernels.backend.Backend.forward`.
  """
  b, t, n, h = q.shape
  kh = k.shape[2]
  group = n // kh
  paged = block_table is not None
  page_size = k.shape[1] if paged else None
  s = seq_k if paged else k.shape[1]
  hv = v.shape[-1]
  hp, hvp = padded_head_dim(h), padded_head_dim(hv)
  arrays = arrays or VariantArrays()
  if (rows_padded < t * group or rows_padded < 16 or rows_padded & (rows_padded - 1)):
    raise ValueError(f"rows_padded {rows_padded} cannot hold {t} x {group} rows")
  ops, specs, names = [], [], []
  add_scalar_inputs(ops, specs, names, variant, arrays, lambda bi, hi, ci: (bi,))
  by_length = split_target is not None and num_splits > 1
  if by_length:  # every row's [B] arrays too, whole: each program sums the rows' reachable keys
    for i, name in enumerate(list(names)):
      ops.append(ops[i])
      specs.append(pl.BlockSpec((b,), lambda bi, hi, ci: (0,)))
      names.append("every_" + name)
  if variant.has_alibi:
    ops.append(arrays.alibi_slopes.astype(jnp.float32))  # [B, N]
    specs.append(pl.BlockSpec((None, n), lambda bi, hi, ci: (bi, 0)))
    names.append("slopes")
  if paged:
    ops.append(block_table.astype(jnp.int32))  # [B, max_pages]
    specs.append(pl.BlockSpec((None, block_table.shape[1]), lambda bi, hi, ci: (bi, 0)))
    names.append("block_table")
    kv_block, kv_index = (k.shape[0], page_size, None), lambda bi, hi, ci: (0, 0, hi, 0)
  else:
    kv_block, kv_index = (None, s, None), lambda bi, hi, ci: (bi, 0, hi, 0)
  kv_spec = lambda d: pl.BlockSpec((*kv_block, d), kv_index)  # noqa: E731  K's (hp), V's (hvp)
  final = num_splits == 1
  out_dtype = q.dtype if final else jnp.float32
  kernel = functools.partial(
      _kernel, scale=float(scale), variant=variant, names=tuple(names), seq_q=t, seq_k=s,
      heads=n, group=group, head_dim=h, value_head_dim=hv, block_k=block_k,
      rows_padded=rows_padded, splits=num_splits, page_size=page_size, f32=q.dtype == jnp.float32,
      batch=b, split_target=split_target if by_length else None)
  counts_spec = [pl.BlockSpec((None, None), lambda bi, hi, ci: (bi, hi))] if by_length else []
  counts_shape = [out_struct((b, kh), jnp.int32, q)] if by_length else []
  outs = pl.pallas_call(
      kernel,
      grid=(b, kh, num_splits),
      in_specs=[pl.BlockSpec((None, t * n, hp), lambda bi, hi, ci: (bi, 0, 0)), kv_spec(hp),
                kv_spec(hvp), *specs],
      out_specs=[pl.BlockSpec((None, None, t * n, hvp), lambda bi, hi, ci: (bi, ci, 0, 0)),
                 pl.BlockSpec((None, None, n * 2 * t), lambda bi, hi, ci: (bi, ci, 0)),
                 *counts_spec],
      out_shape=[out_struct((b, num_splits, t * n, hv), out_dtype, q),
                 out_struct((b, num_splits, n * 2 * t), jnp.float32, q), *counts_shape],
      compiler_params=compiler_params(num_warps, num_stages),
      interpret=interpret,
      name="fa2_decode_forward",
  )(q.reshape(b, t * n, h), k, v, *ops)
  o, stats, counts = outs if by_length else (*outs, None)
  if final:
    o, stats = o[:, 0], stats[:, 0]
  else:
    o, stats = combine(o, stats, scale=scale, modifies_scores=variant.modifies_scores,
                       dtype=q.dtype, seq_q=t, kv_heads=kh, rows_padded=rows_padded,
                       interpret=interpret, row_splits=counts)
  return o.reshape(b, t, n, hv), stats.reshape(b, n, 2, t)


def _combine_kernel(*refs, c: float, seq_q: int, group: int, heads: int, head_dim: int,
                    rows_padded: int, splits: int, cols: int, step: int, by_row: bool):
  # [counts_ref: the row's split count (by_row), a scalar;] o_ref: [splits, T * N, hp] f32, each
  # split's output over its own row sum; stats_ref: [splits, N * 2 * T]; out_ref: [T * N, hp] (q's
  # dtype); final_ref: [N * 2 * T]. Splits past the row's count were not written and are not read.
  # One program per (b, KV head, chunk of `cols` output columns). It loads `step` splits' partials
  # at a time as ONE [step, rows, cols] block (all of a row's splits where they fit: one round of
  # loads instead of a chain of dependent ones) and merges them by their weights, the chunks of
  # splits one after another as the online softmax merges key blocks (every column chunk's program
  # reads the rows' statistics; the first writes the merged ones).
  counts_ref, (o_ref, stats_ref, out_ref, final_ref) = (refs[0] if by_row else None), refs[-4:]
  n_split = counts_ref[()] if by_row else splits
  first = pl.program_id(2) == 0
  _, _, real, row, at = _packed_rows(pl.program_id(1), seq_q=seq_q, group=group, heads=heads,
                                     rows_padded=rows_padded)
  col = pl.program_id(2) * cols + jnp.arange(cols, dtype=jnp.int32)  # [cols]
  col_ok = col < head_dim
  fill = jnp.inf if c < 0 else -jnp.inf
  lane = jnp.arange(step, dtype=jnp.int32)[:, None]  # [step, 1]: a split's place in its chunk

  def chunk(i, carry):
    acc, big, total, r_top = carry
    split = i * step + lane  # [step, 1]
    ok = (split < n_split) & real[None, :]  # [step, rp]; a split past the row's count: l = 0
    split = jnp.where(split < n_split, split, 0)
    r = plgpu.load(stats_ref.at[split, at[None, :]], mask=ok, other=0.0)  # [step, rp]
    l = plgpu.load(stats_ref.at[split, at[None, :] + seq_q], mask=ok, other=0.0)
    o = plgpu.load(o_ref.at[split[:, :, None], row[None, :, None], col[None, None, :]],
                   mask=ok[:, :, None] & col_ok[None, None, :], other=0.0)  # [step, rp, cols]
    seen = l > 0.0
    m = jnp.where(seen, r * c, -jnp.inf)  # each split's maximum, base-2 scaled
    m_top = jnp.max(m, axis=0)  # [rp]
    big_new = jnp.maximum(big, m_top)
    base = jnp.where(big_new == -jnp.inf, 0.0, big_new)
    alpha = jnp.exp2(big - base)  # 0 while nothing was seen (big = -inf)
    w = jnp.where(seen, l * jnp.exp2(m - base[None, :]), 0.0)  # weights relative to 2^base
    acc = acc * alpha[:, None] + jnp.sum(w[:, :, None] * o, axis=0)
    # the raw logit of the largest m: the chunk's first split attaining it, if above the running
    first_top = jnp.min(jnp.where(m == m_top[None, :], lane, step), axis=0)  # [rp]
    r_chunk = jnp.sum(jnp.where(lane == first_top[None, :], r, 0.0), axis=0)
    r_top = jnp.where(m_top > big, r_chunk, r_top)
    return acc, big_new, total * alpha + jnp.sum(w, axis=0), r_top

  carry = (jnp.zeros((rows_padded, cols), jnp.float32),
           jnp.full((rows_padded,), -jnp.inf, jnp.float32),
           jnp.zeros((rows_padded,), jnp.float32), jnp.full((rows_padded,), fill, jnp.float32))
  acc, _, total, r_top = lax.fori_loop(0, cdiv(n_split, step), chunk, carry)
  out = acc / jnp.where(total == 0.0, 1.0, total)[:, None]
  plgpu.store(out_ref.at[row[:, None], col[None, :]], out.astype(out_ref.dtype),
              mask=real[:, None] & col_ok[None, :])
  plgpu.store(final_ref.at[at], r_top, mask=real & first)
  plgpu.store(final_ref.at[at + seq_q], total, mask=real & first)


# A combine program's loaded partials: at most this many float32 elements (splits x rows x
# columns) at once, 64 registers per thread of its 4 warps.
COMBINE_ELEMENTS = 8192
# Output columns per combine program: at least this many (a 32-byte memory sector of float32) and
# at most this many (a program per 32 columns when the splits are few).
COMBINE_MIN_COLS = 8
COMBINE_MAX_COLS = 32


def _pow2_floor(x: int) -> int:
  return 1 << max(0, int(x).bit_length() - 1)


def combine_tiling(splits: int, rows_padded: int, hp: int) -> tuple[int, int]:
  """``(cols, step)`` of the combine: output columns per program and splits loaded at once. All of
  a row's splits in one load where ``COMBINE_ELEMENTS`` holds them with ``COMBINE_MIN_COLS`` columns
  (the columns then as many as fit, up to ``COMBINE_MAX_COLS``); else chunks of splits at the
  minimum columns. Powers of two (Triton's block sides)."""
  splits_p2 = 1 << max(0, (splits - 1).bit_length())
  cols = _pow2_floor(max(1, COMBINE_ELEMENTS // (splits_p2 * rows_padded)))
  cols = min(hp, COMBINE_MAX_COLS, max(COMBINE_MIN_COLS, cols))
  step = min(splits_p2, _pow2_floor(max(1, COMBINE_ELEMENTS // (rows_padded * cols))))
  return cols, step


def combine(o, stats, *, scale: float, modifies_scores: bool, dtype, seq_q: int, kv_heads: int,
            rows_padded: int, interpret: bool, num_warps: int = 4, row_splits=None):
  """Merge the splits' partials exactly (a Pallas kernel, grid ``(B, K, H / cols)``,
  :func:`combine_tiling`).

  ``o [B, splits, T * N, Hv]`` float32, each split's output divided by its own row sum; ``stats [B,
  splits, N * 2 * T]`` its ``(r, l)`` (the ``[N, 2, T]`` statistics flattened). Split ``c`` weighs
  ``l_c 2^(m_c - M)`` (``m_c = r_c * c``, ``M`` the largest): its share of the row's total weight,
  relative to the row maximum's. ``row_splits``: None, or int32 ``[B, K]`` the splits each row ran
  (the rest were not written). Returns ``(out [B, T * N, Hv] dtype, stats [B, N * 2 * T])``: the
  maximum's ``r`` and the total ``l`` relative to it (a row no split reached keeps ``l = 0``).
  """
  b, splits, rows, h = o.shape
  heads = rows // seq_q
  n_2t = stats.shape[-1]
  hp = padded_head_dim(h)
  cols, step = combine_tiling(splits, rows_padded, hp)
  kernel = functools.partial(_combine_kernel, c=float(exponent_scale(scale, modifies_scores)),
                             seq_q=seq_q, group=heads // kv_heads, heads=heads, head_dim=h,
                             rows_padded=rows_padded, splits=splits, cols=cols, step=step,
                             by_row=row_splits is not None)
  counts = [] if row_splits is None else [row_splits.astype(jnp.int32)]
  return pl.pallas_call(
      kernel,
      grid=(b, kv_heads, hp // cols),
      in_specs=[pl.BlockSpec((None, None), lambda bi, hi, ci: (bi, hi))] * len(counts) + [
          pl.BlockSpec((None, splits, rows, hp), lambda bi, hi, ci: (bi, 0, 0, 0)),
          pl.BlockSpec((None, splits, n_2t), lambda bi, hi, ci: (bi, 0, 0))],
      out_specs=[pl.BlockSpec((None, rows, hp), lambda bi, hi, ci: (bi, 0, 0)),
                 pl.BlockSpec((None, n_2t), lambda bi, hi, ci: (bi, 0))],
      out_shape=[out_struct((b, rows, h), dtype, o), out_struct((b, n_2t), jnp.float32, o)],
      compiler_params=compiler_params(num_warps, 1),
      interpret=interpret,
      name="fa2_decode_combine",
  )(*counts, o, stats)
