"""The attention formula in jnp, upcast: the reference for tests and benchmarks, and ``"xla"``.

``softmax(mask(modify(scale * Q K^T))) V`` for every variant of :mod:`fa2_jax.kernels.masking` (the same
``allowed_pairs`` / ``modify_scores`` the kernels use), computed in float32 (or float64 when the inputs
are float64 or ``compute_dtype=jnp.float64`` is asked for and x64 is on), then cast back to the query
dtype. :func:`reference_attention` builds the whole ``[B, N, T, S]`` score matrix (the definition)
unless asked for blocks; ``implementation="xla"`` (:func:`attention_formula`'s default ``"auto"``)
runs long calls (``T > CHUNK_ROWS`` and ``T * S >= CHUNK_MIN_PAIRS``) one block of query rows at a
time (``lax.map``, each block rematerialised in the backward by ``jax.checkpoint``), so memory is
``O(B N block S)`` forward and backward.

NaN safety. Keys that no query row may attend and query rows that attend no key are replaced by zeros
(``where``, so their gradients are exactly zero) before any product; the logits of masked pairs are
replaced by 0 before the soft cap / ``score_fn`` and by ``-inf`` before ``exp``; ``log`` and the
division by the row sum only ever see a positive sum. So NaN or inf held by masked-out positions
never reaches outputs or gradients. (A key that *some* row attends enters every row's ``P V`` and
``dS K`` products, where a masked ``P = 0`` times its NaN is NaN: that key is real data.)
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from .kernels import masking
from .kernels.masking import Variant, VariantArrays
from .validation import check_bool, check_scale, check_variant, is_static_dim, validate_qkv

CHUNK_ROWS = 512  # query rows per block of the chunked formula: [B, N, 512, S] scores live at once
# Below this many score entries per (batch, head) the full matrix is small (4 MiB in float32) and one
# block is fastest; above it the chunked formula keeps memory linear in T.
CHUNK_MIN_PAIRS = 1 << 20


def reference_attention(query, key, value, *, scale=None, is_causal=False, return_residual=False,
                        compute_dtype=None, query_seq_lengths=None, key_value_seq_lengths=None,
                        local_window_size=None, q_segment_ids=None, kv_segment_ids=None,
                        q_offset=None, logits_soft_cap=None, alibi_slopes=None, mask_fn=None,
                        score_fn=None, query_block=None):
  """Reference attention on ``[B, T, N, H]`` / ``[B, S, K, H]`` inputs (GQA when ``K < N``); the value
  ``[B, S, K, Hv]`` may have its own head_dim ``Hv`` (the output's).

  Args:
    query, key, value: arrays as in :func:`fa2_jax.flash_attention` (rank 4, or rank 3 without the
      batch axis); float64 inputs compute in float64.
    scale: logit scale, default ``1/sqrt(H)`` (the query/key head_dim).
    is_causal, query_seq_lengths, key_value_seq_lengths, local_window_size, q_segment_ids,
      kv_segment_ids, q_offset, logits_soft_cap, alibi_slopes, mask_fn, score_fn: the variant, as in
      :func:`fa2_jax.flash_attention` (``mask_fn``/``score_fn`` may close over arrays here).
    return_residual: also return ``lse`` of shape ``[B, T, N]`` (natural log, in ``compute_dtype``;
      ``-inf`` for a row with no allowed key).
    compute_dtype: dtype of the arithmetic; default float32, or float64 if an input is float64.
    query_block: query rows per block of the chunked formula: None (the default) computes every row
      at once, an int that many rows per block, ``"auto"`` what ``implementation="xla"`` does (one
      block for short calls, ``CHUNK_ROWS`` rows for long ones, see the module docstring).

  Returns:
    ``out`` with the query's dtype (and ``lse`` when asked).
  """
  validate_qkv(query, key, value)
  scale = check_scale(scale)
  is_causal = check_bool("is_causal", is_causal)
  return_residual = check_bool("return_residual", return_residual)
  query_block = check_query_block(query_block)
  compute_dtype = check_compute_dtype(compute_dtype)
  variant, arrays = check_variant(
      query, key, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size,
      q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, q_offset=q_offset,
      logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes, mask_fn=mask_fn,
      score_fn=score_fn)
  squeeze = query.ndim == 3
  if squeeze:
    query, key, value = query[None], key[None], value[None]
  out, lse = attention_formula(query, key, value, variant, arrays, scale=scale,
                               compute_dtype=compute_dtype, query_block=query_block)
  if squeeze:
    out, lse = out[0], lse[0]
  return (out, lse) if return_residual else out


def check_compute_dtype(compute_dtype):
  """``compute_dtype`` -> a floating numpy dtype or None; float64 needs ``jax_enable_x64`` (JAX would
  otherwise compute in float32 with only a warning)."""
  if compute_dtype is None:
    return None
  try:
    dt = jnp.dtype(compute_dtype)
  except TypeError as e:
    raise TypeError(f"compute_dtype must be a floating dtype or None, got {compute_dtype!r}") from e
  if dt not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32),
                jnp.dtype(jnp.float64)):
    raise TypeError(f"compute_dtype must be float16, bfloat16, float32 or float64, got {dt}")
  if dt == jnp.float64 and not jax.config.jax_enable_x64:
    raise ValueError("compute_dtype float64 needs jax_enable_x64 (jax.enable_x64(True) or "
                     "JAX_ENABLE_X64=1); without it JAX computes in float32")
  return dt


def check_query_block(query_block):
  if query_block is None or query_block == "auto":
    return query_block
  if isinstance(query_block, bool) or not isinstance(query_block, int) or query_block < 1:
    raise ValueError(f"query_block must be a positive int, 'auto' or None, got {query_block!r}")
  return query_block


def _block_rows(query_block, t, s):
  """Rows per block, or None for the one-block formula."""
  if not (is_static_dim(t) and is_static_dim(s)):
    return None  # symbolic (jax.export) lengths: one block
  if query_block == "auto":
    query_block = CHUNK_ROWS if t > CHUNK_ROWS and t * s >= CHUNK_MIN_PAIRS else None
  if query_block is None or query_block >= t:
    return None
  return query_block


def _index_arrays(variant: Variant, arrays: VariantArrays, row0, rows, s, q_seg):
  """The broadcastable ``[B?, N?, rows, S]`` index arrays and per-batch values of rows
  ``[row0, row0 + rows)``, as :func:`masking.allowed_pairs` takes them."""
  i32 = jnp.int32
  col = lambda x: x[:, None, None, None]  # noqa: E731  [B] -> [B, 1, 1, 1]
  off = col(arrays.q_offset) if variant.has_q_offset else i32(0)
  rows_idx, kv_idx = _opaque(jnp.arange(rows, dtype=i32), jnp.arange(s, dtype=i32))
  return dict(
      q_idx=row0 + rows_idx[None, None, :, None] + off,  # absolute positions
      kv_idx=kv_idx[None, None, None, :],
      q_len=col(arrays.q_lengths) if variant.has_q_lengths else None,
      kv_len=col(arrays.kv_lengths) if variant.has_kv_lengths else None,
      q_seg=q_seg[:, None, :, None] if variant.has_segments else None,
      kv_seg=arrays.kv_segment_ids[:, None, None, :] if variant.has_segments else None,
      q_offset=off if variant.has_q_offset else None)


def _opaque(*iotas):
  """Index arrays XLA does not treat as constants: a mask computed from constants alone (a user's
  ``mask_fn`` of the indices, no per-batch array) is otherwise constant-folded element by element at
  compile time, which took 200 s for a [1, 2, 54, 42] mask of ``(i + j) % 2 != 0 | h == 0`` on the
  CPU (1.3 s without the ``h`` term)."""
  return lax.optimization_barrier(iotas)


def _batch_head_indices(b, n):
  bi, hi = _opaque(jnp.arange(b, dtype=jnp.int32), jnp.arange(n, dtype=jnp.int32))
  return bi[:, None, None, None], hi[None, :, None, None]


def _mask(variant, arrays, b, n, row0, rows, s, q_seg):
  idx = _index_arrays(variant, arrays, row0, rows, s, q_seg)
  bi, hi = _batch_head_indices(b, n)
  return masking.allowed_pairs(variant, bi, hi, idx["q_idx"], idx["kv_idx"], q_len=idx["q_len"],
                               kv_len=idx["kv_len"], q_seg=idx["q_seg"], kv_seg=idx["kv_seg"],
                               q_offset=idx["q_offset"]), idx


def _live_keys_to_kv(live, kh):
  """Key liveness ``[B?, N?, S]`` -> ``[B?, S, K?, 1]`` (a KV head is live for a key when any of its
  query heads may attend it), to mask ``k``/``v`` ``[B, S, K, H]``."""
  bb, nn, s = live.shape
  if nn != 1:
    live = live.reshape(bb, kh, nn // kh, s).any(2)
  return jnp.swapaxes(live, 1, 2)[..., None]


def attention_formula(query, key, value, variant: Variant, arrays: VariantArrays, *, scale=None,
                      compute_dtype=None, query_block="auto"):
  """The formula on validated rank-4 inputs and a normalised variant (see :func:`reference_attention`).

  Returns:
    ``out [B, T, N, Hv]`` (query dtype) and ``lse [B, T, N]`` (compute dtype).
  """
  b, t, n, hd = query.shape
  hv = value.shape[-1]  # the value's head_dim: the output's
  s, kh = key.shape[1], key.shape[2]
  if compute_dtype is None:
    compute_dtype = jnp.float64 if query.dtype == jnp.float64 else jnp.float32
  if scale is None:
    scale = 1.0 / math.sqrt(hd)
  q = query.astype(compute_dtype)
  k = key.astype(compute_dtype)
  v = value.astype(compute_dtype)
  slopes = None
  if variant.has_alibi:  # differentiated (dslope = -sum dS * |p - j|, by autodiff)
    slopes = arrays.alibi_slopes.astype(compute_dtype)[:, :, None, None]
  q_seg = arrays.q_segment_ids
  block = _block_rows(query_block, t, s)
  if block is not None:
    t_pad = -(-t // block) * block
    if t_pad != t:
      # The padded rows are not queries: a query-length term hides them.
      q_len = arrays.q_lengths if variant.has_q_lengths else jnp.full((b,), t, jnp.int32)
      arrays = arrays._replace(q_lengths=jnp.minimum(q_len, t))
      variant = dataclasses.replace(variant, has_q_lengths=True)
      if variant.has_segments:
        q_seg = jnp.pad(q_seg, ((0, 0), (0, t_pad - t)))
  else:
    t_pad, block = t, t

  # Keys no row may attend: zero them (NaN there must not meet a zero P inside a matmul).
  if variant.needs_mask:
    if block == t_pad:
      mask, _ = _mask(variant, arrays, b, n, 0, t_pad, s, q_seg)
      live = mask.any(2)  # [B?, N?, S]
    else:
      def or_block(live, i):
        seg = lax.dynamic_slice_in_dim(q_seg, i * block, block, 1) if variant.has_segments else None
        m, _ = _mask(variant, arrays, b, n, i * block, block, s, seg)
        return live | m.any(2), None
      shape = jax.eval_shape(lambda: _mask(variant, arrays, b, n, 0, block, s, q_seg[:, :block]
                                           if variant.has_segments else None)[0]).shape
      live0 = jnp.zeros((shape[0], shape[1], s), jnp.bool_)
      live, _ = lax.scan(or_block, live0, jnp.arange(t_pad // block, dtype=jnp.int32))
    live = _live_keys_to_kv(live, kh)
    k = jnp.where(live, k, 0)
    v = jnp.where(live, v, 0)

  prec = lax.Precision.HIGHEST
  g = n // kh

  def rows_block(q_blk, row0, seg_blk):
    """Out ``[B, rows, N, Hv]`` and lse ``[B, rows, N]`` of the query rows ``[row0, row0 + rows)``."""
    rows = q_blk.shape[1]
    mask, idx = _mask(variant, arrays, b, n, row0, rows, s, seg_blk)
    if mask is not None:
      row_live = jnp.broadcast_to(mask.any(3), (b, n, rows))  # [B, N, rows]
      q_blk = jnp.where(jnp.swapaxes(row_live, 1, 2)[..., None], q_blk, 0)
    # The scale goes into q before the dot, not onto the logits after it: XLA would fuse a
    # `logits * scale` into each consumer and contract it with `- m` into an FMA, whose unrounded
    # product no longer matches the rounded max (NaN at |scale * logit| ~ 1e9).
    # With a soft cap (and no score_fn, which must see the scaled logits) a scale above 1 goes into
    # the cap's tanh(q.k * scale / cap), as in the kernels: q * scale can overflow where the capped
    # logits are finite (NaN at scale 1e38), and the product feeds tanh, not `- m`. A scale of at
    # most 1 stays on q, where q.k alone could overflow and q * scale cannot.
    folded_cap = variant.soft_cap is not None and variant.score_fn is None and abs(scale) > 1
    q_scaled = q_blk if folded_cap else q_blk * jnp.asarray(scale, compute_dtype)
    logits = jnp.einsum("btkgh,bskh->bkgts", q_scaled.reshape(b, rows, kh, g, hd), k, precision=prec)
    logits = logits.reshape(b, n, rows, s)  # [B, N, rows, S], scaled (raw with a folded soft cap)
    if mask is not None:
      logits = jnp.where(mask, logits, 0)  # finite inputs for the soft cap / score_fn
    if variant.modifies_scores:
      bi, hi = _batch_head_indices(b, n)
      # ALiBi distances from each row's nearest key (masking.alibi_nearest_key); the lse gets the
      # rows' shift back below
      logits, _ = masking.kernel_scores(variant, logits, bi, hi, idx["q_idx"], idx["kv_idx"],
                                        scale=scale if folded_cap else 1.0, out_scale=1.0,
                                        slope=slopes, kv_extent=s)
      logits = logits.astype(compute_dtype)
    if mask is not None:
      logits = jnp.where(mask, logits, -jnp.inf)
    # Materialised: where the contraction is a plain multiply (head_dim 1), XLA would otherwise fuse
    # it into `logits - m` below as one FMA with the product unrounded, unlike the rounded max (NaN or
    # an empty row at |logit| ~ 1e10).
    logits = lax.optimization_barrier(logits)
    m = lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True, initial=-jnp.inf))
    m = jnp.where(jnp.isfinite(m), m, 0)  # a row with no key: exp(-inf - 0) = 0
    p = jnp.exp(logits - m)  # [B, N, rows, S]
    l = p.sum(-1)  # [B, N, rows]
    has_key = l > 0
    l_safe = jnp.where(has_key, l, 1)  # log and division never see 0
    lse = jnp.where(has_key, m[..., 0] + jnp.log(l_safe), -jnp.inf)
    out = jnp.einsum("bkgts,bskh->btkgh", p.reshape(b, kh, g, rows, s), v, precision=prec)
    out = out.reshape(b, rows, n, hv) / jnp.swapaxes(l_safe, 1, 2)[..., None]
    return out, jnp.swapaxes(lse, 1, 2)

  if block == t_pad:
    out, lse = rows_block(q, 0, q_seg)
  else:
    nblk = t_pad // block
    qb = jnp.pad(q, ((0, 0), (0, t_pad - t), (0, 0), (0, 0)))
    qb = jnp.moveaxis(qb.reshape(b, nblk, block, n, hd), 1, 0)  # [nblk, B, block, N, H]
    segb = (jnp.moveaxis(q_seg.reshape(b, nblk, block), 1, 0) if variant.has_segments
            else jnp.zeros((nblk,), jnp.int32))
    starts = jnp.arange(nblk, dtype=jnp.int32) * block

    def body(args):
      q_blk, row0, seg_blk = args
      return rows_block(q_blk, row0, seg_blk if variant.has_segments else None)

    # jax.checkpoint: the backward recomputes each block's scores instead of storing all of them.
    out, lse = lax.map(jax.checkpoint(body), (qb, starts, segb))
    out = jnp.moveaxis(out, 0, 1).reshape(b, t_pad, n, hv)[:, :t]
    lse = jnp.moveaxis(lse, 0, 1).reshape(b, t_pad, n)[:, :t]
  # ALiBi's distances were taken from each row's nearest key (masking.alibi_nearest_key): the rows'
  # shift back into the lse
  shift = masking.alibi_lse_shift(variant, arrays, t, s, dtype=lse.dtype)
  if shift is not None:
    lse = masking.remove_alibi_shift(lse, shift)
  return out.astype(query.dtype), lse
