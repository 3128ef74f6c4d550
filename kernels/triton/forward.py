"""FlashAttention-2 forward pass (paper Alg. 1) as a Pallas kernel on the Triton backend.

Grid: ``(query block i, batch b, head h)`` — the paper's §3.2 "parallelism over the sequence length":
with batch 1 and 16 heads at 8k tokens there are still 64 x 16 = 1024 programs for 132 SMs. Each program
keeps its ``Q_i`` tile on chip, streams the ``K_j, V_j`` tiles of its KV head (GQA: head ``h // G``, never
copied in HBM) and keeps the online-softmax state ``m_i, l_i`` and the *unscaled* accumulator ``acc``
(§3.1.1: one division by ``l_i`` at the end instead of a rescale per step). It writes ``O_i`` and
the row statistics ``(r_i, l_i)`` (two floats per row, ``kernels/softmax.py``: the logsumexp follows from
them, and they are the only residual the backward needs besides Q, K, V, O).

Causal (§3.1.1 "causal masking"): the key blocks wholly above the diagonal are never loaded (the loop
stops early) and only blocks that straddle the diagonal — or hold the ragged tail of the keys — pay for
a mask; the others run an unmasked loop body.

Triton splits the ``[block_q, ...]`` tiles across ``num_warps`` warps by rows, so each warp owns whole
query rows and needs no cross-warp reduction (§3.3, "split-Q").
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..block_ranges import kv_range_table
from ..masking import Variant, VariantArrays
from ..softmax import huge_row_scale, row_sum_at_max
from ..vma import out_struct
from .common import (LOG2E, cdiv, compiler_params, div, dot, load_tile, padded_head_dim,
                     store_tile)
from .variant import Refs, tile_mask, uses_table, zero_unattended
from .variant import inputs as variant_inputs


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


def _fwd_kernel(q_ref, k_ref, v_ref, *rest, scale: float, variant: Variant, names: tuple[str, ...],
                seq_q: int, seq_k: int, head_dim: int, value_head_dim: int, block_q: int,
                block_k: int, f32: bool):
  # q_ref: [T, hp] (this batch, head); k_ref: [S, hp] (its KV head); v_ref: [S, hvp]; o_ref: [T, hvp];
  # stats_ref: [2, T] f32, the row statistics (r, l) of kernels/softmax.py; between them the variant
  # operands named by `names` (variant.inputs). hp, hvp: H and Hv padded (common.padded_head_dim).
  var_refs, (o_ref, stats_ref) = rest[:len(names)], rest[len(names):]
  hvp = v_ref.shape[-1]
  i, b, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  table = uses_table(variant)
  vr = Refs(variant, names, var_refs, seq_k=seq_k) if table else None
  # scale != 0 and no score modification: track the row's raw logit of largest s*c (the maximum, the
  # minimum when scale < 0) and fold scale*log2(e) into one FMA inside exp2, p = exp2(s*c - m*c).
  # Otherwise work on base-2 logits s2 = modify(scale * s) * log2(e) (c = 1 below).
  fold = scale != 0 and not variant.modifies_scores
  c = scale * LOG2E if fold else 1.0
  fill = jnp.inf if c < 0 else -jnp.inf  # a masked raw logit: exp2(fill * c) = 0
  q_limit = None if seq_q % block_q == 0 else seq_q
  row0 = i * block_q
  q = load_tile(q_ref, row0, block_q, q_limit, head_dim)  # [block_q, hp]
  key_end = vr.key_end(seq_k) if table else seq_k

  def body(j, carry, masked: bool):
    # [block_q, hvp] f32; [block_q] f32 each: m_i = r_i * c (base 2), l_i, r_i the raw logit of m_i
    acc, m_i, l_i, r_i = carry
    start = j * block_k
    k = load_tile(k_ref, start, block_k, key_end if masked else None, head_dim)  # [block_k, hp]
    v = load_tile(v_ref, start, block_k, key_end if masked else None,
                  value_head_dim)  # [block_k, hvp]
    s = dot(q, k, trans_b=True, f32=f32)  # S_ij = Q_i K_j^T, [block_q, block_k] f32
    if variant.modifies_scores:
      s, _ = vr.scores(s, scale, b, h, row0, start)  # base-2 modified logits
    elif not fold:
      s = s * (scale * LOG2E)
    if masked:
      keep = tile_mask(variant, vr, b, h, row0, block_q, start, block_k, seq_q=seq_q, seq_k=seq_k)
      if table:
        v = zero_unattended(keep, v, 0)  # no 0 * NaN in P V from a key the tile never attends
      if keep is not None:
        s = jnp.where(keep, s, fill)
    # Online softmax (Alg. 1 lines 9-10): m_new = max(m_old, rowmax(S_ij)), P~ = exp(S_ij - m_new).
    r_new = jnp.minimum(r_i, jnp.min(s, axis=1)) if c < 0 else jnp.maximum(r_i, jnp.max(s, axis=1))
    # = r_new * c, rounded: through a max, so that no compiler contracts m_i - r_new * c (alpha below)
    # into an FMA with the product unrounded, which differs from the rounded m_i.
    m_new = jnp.maximum(m_i, r_new * c)
    # A row whose keys so far are all masked keeps m = -inf; use 0 there so exp2 gives 0, not NaN.
    # (A score_fn may return -inf for a whole row of an unmasked tile too.)
    guard = masked or variant.score_fn is not None
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if guard else m_new
    r_use = jnp.where(m_new == -jnp.inf, 0.0, r_new) if guard else r_new
    alpha = jnp.exp2(m_i - m_use)  # e^{m_old - m_new}: rescales old state
    if scale == 0:  # every allowed logit is 0
      p = jnp.exp2(s - m_use[:, None])
    else:  # (c, m), but rows past 2^30 in base 2 are scaled by a power of two (kernels/softmax.py)
      c_row, t_row = huge_row_scale(r_use, m_use, c, v.dtype)
      p = jnp.exp2(s * c_row[:, None] - t_row[:, None])  # [block_q, block_k] f32
    l_new = alpha * l_i + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v, f32=f32)  # unscaled (§3.1.1 tweak 1)
    return acc, m_new, l_new, r_new

  carry = (jnp.zeros((block_q, hvp), jnp.float32), jnp.full((block_q,), -jnp.inf, jnp.float32),
           jnp.zeros((block_q,), jnp.float32), jnp.full((block_q,), fill, jnp.float32))
  masked, unmasked = functools.partial(body, masked=True), functools.partial(body, masked=False)
  if table:
    # Key blocks [lo, full_lo) and [full_hi, hi) need the mask, [full_lo, full_hi) none; the rest
    # have no allowed pair and are never loaded (fa2_jax.kernels.block_ranges).
    lo, full_lo, full_hi, hi = vr.ranges()
    carry = lax.fori_loop(full_lo, full_hi, unmasked, carry)
    carry = lax.fori_loop(lo, full_lo, masked, carry)
    acc, m_i, l_i, r_i = lax.fori_loop(full_hi, hi, masked, carry)
  else:
    n_full, n_end = kv_block_ranges(i, block_q=block_q, block_k=block_k, seq_k=seq_k,
                                    is_causal=variant.is_causal)
    carry = lax.fori_loop(0, n_full, unmasked, carry)
    acc, m_i, l_i, r_i = lax.fori_loop(n_full, n_end, masked, carry)

  # Alg. 1 line 12: O_i = diag(l_i)^-1 acc, once. A row with no allowed key returns zeros.
  out = acc / jnp.where(l_i == 0.0, 1.0, l_i)[:, None]
  store_tile(o_ref, row0, out, q_limit, value_head_dim)
  # Line 13: the row statistics (r, l) instead of L_i = m_i + log(l_i): the lse and the backward's P
  # follow from them (kernels/softmax.py); l relative to the maximum's weight.
  if scale != 0:
    l_i = row_sum_at_max(r_i, m_i, l_i, c, v_ref.dtype)
  mask = None if q_limit is None else row0 + jnp.arange(block_q) < q_limit
  for index, value in ((0, r_i), (1, l_i)):
    plgpu.store(stats_ref.at[jnp.int32(index), pl.ds(row0, block_q)], value, mask=mask)


def forward(q, k, v, *, scale: float, is_causal: bool, block_q: int, block_k: int, num_warps: int,
            num_stages: int, interpret: bool, variant: Variant | None = None,
            arrays: VariantArrays | None = None, table=None):
  """Run the forward kernel.

  Args:
    q: ``[B, T, N, H]``; k: ``[B, S, K, H]``, v: ``[B, S, K, Hv]`` with ``N % K == 0`` (``Hv``, the
      value's head_dim, may differ from ``H``).
    variant, arrays: the attention variant (:mod:`fa2_jax.kernels.masking`; None: dense or ``is_causal``).
    table: its precomputed key-block range table (``BlockSizes.range_tiles()["fwd"]``), or None to
      compute it here.

  Returns:
    ``out [B, T, N, Hv]`` (q's dtype) and the row statistics ``stats [B, N, 2, T]`` float32
    (``kernels/softmax.py``: the lse is ``lse_from_stats(stats, scale, modifies_scores)``).
  """
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  group = n // kh
  hv = v.shape[-1]
  hp, hvp = padded_head_dim(h), padded_head_dim(hv)
  nq = pl.cdiv(t, block_q)
  variant = variant or Variant(is_causal=bool(is_causal))
  ops, specs, names = [], [], ()
  if uses_table(variant):
    if table is None:
      table = kv_range_table(variant, arrays, batch=b, heads=n, seq_q=t, seq_k=s, block_q=block_q,
                             block_k=block_k)  # [B, N', nq, 4]
    ops, specs, names = variant_inputs(variant, arrays, table, kv_heads_grid=False, group=group)
  kernel = functools.partial(
      _fwd_kernel, scale=float(scale), variant=variant, names=names, seq_q=t, seq_k=s, head_dim=h,
      value_head_dim=hv, block_q=block_q, block_k=block_k, f32=q.dtype == jnp.float32)
  grid = (nq, b, n)
  qmap = lambda i, bi, hi: (bi, 0, hi, 0)
  kvmap = lambda i, bi, hi: (bi, 0, div(hi, group), 0)
  statsmap = lambda i, bi, hi: (bi, hi, 0, 0)
  out, stats = pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=[
          pl.BlockSpec((None, t, None, hp), qmap),
          pl.BlockSpec((None, s, None, hp), kvmap),
          pl.BlockSpec((None, s, None, hvp), kvmap),
          *specs,
      ],
      out_specs=[
          pl.BlockSpec((None, t, None, hvp), qmap),
          pl.BlockSpec((None, None, 2, t), statsmap),
      ],
      out_shape=[
          out_struct((b, t, n, hv), q.dtype, q),
          out_struct((b, n, 2, t), jnp.float32, q),
      ],
      compiler_params=compiler_params(num_warps, num_stages),
      interpret=interpret,
      name="fa2_forward",
  )(q, k, v, *ops)
  return out, stats
