"""FlashAttention-2 forward pass (paper Alg. 1) as a Pallas kernel on the Triton backend.

Grid: ``(query block i, batch b, head h)`` — the paper's §3.2 "parallelism over the sequence length":
with batch 1 and 16 heads at 8k tokens there are still 64 x 16 = 1024 programs for 132 SMs. Each program
keeps its ``Q_i`` tile on chip, streams the ``K_j, V_j`` tiles of its KV head (GQA: head ``h // G``, never
copied in HBM) and keeps the online-softmax state ``m_i, l_i`` and the *unscaled* accumulator ``acc``
(§3.1.1: one division by ``l_i`` at the end instead of a rescale per step). It writes ``O_i`` and
``lse_i = m_i + log(l_i)`` (one float per row, the only residual the backward needs besides Q, K, V, O).

Causal (§3.1.1 "causal masking"): the key blocks wholly above the diagonal are never loaded (the loop
stops early) and only blocks that straddle the diagonal — or hold the ragged tail of the keys — pay for
a mask; the others run an unmasked loop body. Keys that no query attends (top-left causal with
``T < S``: keys ``j >= T``) are never read at all (:func:`attended_keys`), so NaN or inf there cannot
reach ``O`` through ``P V`` (a masked ``P = 0`` times a NaN row of ``V`` is NaN inside the matmul).

Softmax units (exact-safe for any finite logits and scale, :func:`raw_units`): the running statistic
``m_i`` is the row's largest *raw* logit ``S = Q K^T`` (its smallest when ``scale < 0``) and
``p = exp2((s - m_i) * c)`` with ``c = scale * log2(e)``: the extreme element gives exactly
``exp2(0) = 1`` and every other ``p <= 1``, so nothing overflows and ``l_i >= 1``. (The fused form
``exp2(s*c - m_i*c)`` rounds ``m_i*c`` on its own: at ``|m_i*c| > 2^31`` its error alone overflows
exp2, giving inf/inf = NaN.) The lse stored per row is ``m_i + log(l_i) / scale``, in raw-logit units,
which is what the backward recomputes ``P`` against; :func:`lse_to_natural` gives the natural-log lse.

Triton splits the ``[block_q, ...]`` tiles across ``num_warps`` warps by rows, so each warp owns whole
query rows and needs no cross-warp reduction (§3.3, "split-Q").
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ...masking import allowed
from ..vma import out_struct
from .common import (LN2, LOG2E, cdiv, compiler_params, div, dot, load_tile, padded_head_dim,
                     store_tile)

# --- softmax units (shared with backward.py) ------------------------------------------------------
# Below this |scale| the raw-unit lse m + log(l) / scale could overflow float32 (log(l) <= 22 for up to
# 2^31 keys), so such calls (scale = 0 included) scale the logits first and keep every statistic in
# base-2 scaled units, where |S * scale * log2(e)| <= 3.4e38 * 2^-100 * 1.45 cannot overflow.
RAW_MIN_SCALE = 2.0 ** -100


def raw_units(scale: float) -> bool:
  """True: the kernels compare raw logits ``S`` (``P = exp2((S - m) * c)``); False: base-2 scaled
  logits ``S * c`` (``P = exp2(S * c - m)``), for ``|scale| < RAW_MIN_SCALE``."""
  return abs(scale) >= RAW_MIN_SCALE


def lse_to_natural(lse_raw, scale: float):
  """The kernels' per-row lse (raw-logit or base-2 units) -> natural log. Per row, not per element.
  A row with no key holds -inf (+inf when tracking the minimum for scale < 0) and maps to -inf."""
  return lse_raw * (scale if raw_units(scale) else LN2)


def lse_from_natural(lse, scale: float):
  """Natural-log lse -> the kernels' units (inverse of :func:`lse_to_natural`, up to one float32
  rounding: in raw units that rounding is of order ``|lse_raw| * 2^-24 * |c|`` in the exponent of the
  recomputed P, which matters only for |lse| beyond ~1e6; pass the forward's ``lse_raw`` to avoid it)."""
  return lse / scale if raw_units(scale) else lse * LOG2E


def lse_for_backward(lse_raw, scale: float):
  """The per-row statistic the backward kernels subtract: the forward's ``lse_raw``, with a row that
  had no key (the empty reduction, -inf, or +inf for the minimum) mapped to the opposite infinity so
  that its recomputed ``P`` is exp2(-inf) = 0, not exp2(+inf) or NaN."""
  empty = jnp.inf if (raw_units(scale) and scale < 0) else -jnp.inf
  return jnp.where(lse_raw == empty, -empty, lse_raw)


def attended_keys(seq_q: int, seq_k: int, is_causal: bool) -> int:
  """How many leading keys any query attends: ``S``, or ``min(S, T)`` with a top-left causal mask
  (query ``i`` attends keys ``j <= i``, so keys ``j >= T`` are never attended). The kernels read
  only these keys (tiles past them load as 0), so NaN/inf stored in the others cannot leak in."""
  return min(seq_k, seq_q) if is_causal else seq_k


def kv_block_ranges(i, *, block_q: int, block_k: int, seq_k: int, is_causal: bool):
  """Key-block ranges for query block ``i``: ``[0, n_full)`` unmasked, ``[n_full, n_end)`` masked.

  A key block ``j`` needs no mask when all its keys are in range (``(j+1)*block_k <= seq_k``) and, if
  causal, when its last key is at or below the first query row of the block
  (``j*block_k + block_k - 1 <= i*block_q``). Blocks past ``n_end`` lie wholly above the diagonal.
  """
  nk = pl.cdiv(seq_k, block_k)
  nk_full = seq_k // block_k
  if not is_causal:
    return nk_full, nk
  n_full = jnp.minimum(div(i * block_q + 1, block_k), nk_full)
  n_end = jnp.minimum(cdiv((i + 1) * block_q, block_k), nk)
  return n_full, n_end


def _fwd_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale: float, is_causal: bool, seq_q: int,
                seq_k: int, head_dim: int, block_q: int, block_k: int, f32: bool):
  # q_ref, o_ref: [T, hp] (this batch, head); k_ref, v_ref: [S, hp] (its KV head), of which only the
  # first seq_k rows (attended_keys) are read; lse_ref: [T] f32, in the units of raw_units(scale).
  hp = q_ref.shape[-1]
  raw = raw_units(scale)
  c = scale * LOG2E
  # raw: p = exp2((s - m) * c). Per element in the unmasked loop that is a subtract and a multiply
  # before exp2: ONE FP32 op more than the fused exp2(s*c - m*c) (one FMA), which was not exact-safe.
  # base-2 (|scale| < RAW_MIN_SCALE): s is scaled first (a multiply) and p = exp2(s - m), as before.
  lowest = raw and scale < 0  # scale < 0: the largest scaled logit is the smallest raw one
  neutral = jnp.inf if lowest else -jnp.inf  # the empty reduction, and the masked logit
  extreme = jnp.minimum if lowest else jnp.maximum
  q_limit = None if seq_q % block_q == 0 else seq_q

  def units(x):  # exponents in base 2
    return x * c if raw else x

  def one_query_block(i):
    q = load_tile(q_ref, i * block_q, block_q, q_limit, head_dim)  # [block_q, hp]
    q_pos = i * block_q + jnp.arange(block_q)[:, None]  # [block_q, 1]

    def body(j, carry, masked: bool):
      acc, m_i, l_i = carry  # [block_q, hp] f32, [block_q] f32, [block_q] f32
      start = j * block_k
      # Masked blocks hold the key tail: rows >= seq_k read as 0, whatever the array holds there.
      k = load_tile(k_ref, start, block_k, seq_k if masked else None, head_dim)  # [block_k, hp]
      v = load_tile(v_ref, start, block_k, seq_k if masked else None, head_dim)  # [block_k, hp]
      s = dot(q, k, trans_b=True, f32=f32)  # S_ij = Q_i K_j^T, [block_q, block_k] f32
      if not raw:
        s = s * c
      if masked:
        k_pos = start + jnp.arange(block_k)[None, :]
        keep = allowed(q_pos, k_pos, is_causal=is_causal,
                       seq_k=seq_k if seq_k % block_k else None)
        if keep is not None:
          s = jnp.where(keep, s, neutral)
      # Online softmax (Alg. 1 lines 9-10): m_new = max(m_old, rowmax(S_ij)), P~ = exp(S_ij - m_new).
      m_new = extreme(m_i, jnp.min(s, axis=1) if lowest else jnp.max(s, axis=1))
      # A row whose keys so far are all masked keeps m = neutral; use 0 there so exp2 gives 0, not NaN.
      m_use = jnp.where(m_new == neutral, 0.0, m_new) if masked else m_new
      alpha = jnp.exp2(units(m_i - m_use))  # e^{scale (m_old - m_new)} <= 1: rescales old state
      p = jnp.exp2(units(s - m_use[:, None]))  # [block_q, block_k] f32, in [0, 1]
      l_new = alpha * l_i + jnp.sum(p, axis=1)
      acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v, f32=f32)  # unscaled (§3.1.1 tweak 1)
      return acc, m_new, l_new

    acc = jnp.zeros((block_q, hp), jnp.float32)
    m_i = jnp.full((block_q,), neutral, jnp.float32)
    l_i = jnp.zeros((block_q,), jnp.float32)
    n_full, n_end = kv_block_ranges(i, block_q=block_q, block_k=block_k, seq_k=seq_k,
                                    is_causal=is_causal)
    carry = lax.fori_loop(0, n_full, functools.partial(body, masked=False), (acc, m_i, l_i))
    acc, m_i, l_i = lax.fori_loop(n_full, n_end, functools.partial(body, masked=True), carry)

    # Alg. 1 line 12: O_i = diag(l_i)^-1 acc, once. A row with no key (not reachable with today's
    # masks) returns zeros, and its lse stays the empty reduction (natural lse -inf).
    l_safe = jnp.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    store_tile(o_ref, i * block_q, out, q_limit, head_dim)
    # Alg. 1 line 13: L_i = m_i + log(l_i), here in the units of m_i: raw logits (log(l_i) / scale)
    # or base-2 scaled logits (log2(l_i)). The extreme logit itself is kept exactly.
    lse = m_i + jnp.log(l_safe) * (1.0 / scale if raw else LOG2E)
    rows = lse_ref.at[pl.ds(i * block_q, block_q)]
    if q_limit is None:
      plgpu.store(rows, lse)
    else:
      plgpu.store(rows, lse, mask=i * block_q + jnp.arange(block_q) < q_limit)

  one_query_block(pl.program_id(0))


def forward(q, k, v, *, scale: float, is_causal: bool, block_q: int, block_k: int, num_warps: int,
            num_stages: int, interpret: bool, return_lse_raw: bool = False):
  """Run the forward kernel.

  Args:
    q: ``[B, T, N, H]``; k, v: ``[B, S, K, H]`` with ``N % K == 0``.
    return_lse_raw: also return the kernel's own per-row lse (see :func:`raw_units`), which the
      backward takes as ``lse_raw=`` to recompute P exactly (the natural-log lse divided back by
      ``scale`` can be one float32 step off, which at extreme scales is far off in P).

  Returns:
    ``out [B, T, N, H]`` (q's dtype) and ``lse [B, N, T]`` float32, natural log (and ``lse_raw
    [B, N, T]`` float32 with ``return_lse_raw``).
  """
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  group = n // kh
  hp = padded_head_dim(h)
  nq = pl.cdiv(t, block_q)
  kernel = functools.partial(
      _fwd_kernel, scale=float(scale), is_causal=is_causal, seq_q=t,
      seq_k=attended_keys(t, s, is_causal), head_dim=h, block_q=block_q, block_k=block_k,
      f32=q.dtype == jnp.float32)
  grid = (nq, b, n)
  qmap = lambda i, bi, hi: (bi, 0, hi, 0)
  kvmap = lambda i, bi, hi: (bi, 0, div(hi, group), 0)
  lsemap = lambda i, bi, hi: (bi, hi, 0)
  out, lse_raw = pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=[
          pl.BlockSpec((None, t, None, hp), qmap),
          pl.BlockSpec((None, s, None, hp), kvmap),
          pl.BlockSpec((None, s, None, hp), kvmap),
      ],
      out_specs=[
          pl.BlockSpec((None, t, None, hp), qmap),
          pl.BlockSpec((None, None, t), lsemap),
      ],
      out_shape=[
          out_struct(q.shape, q.dtype, q),
          out_struct((b, n, t), jnp.float32, q),
      ],
      compiler_params=compiler_params(num_warps, num_stages),
      interpret=interpret,
      name="fa2_forward",
  )(q, k, v)
  lse = lse_to_natural(lse_raw, float(scale))
  return (out, lse, lse_raw) if return_lse_raw else (out, lse)
