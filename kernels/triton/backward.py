"""FlashAttention-2 backward pass (paper Alg. 2) as Pallas kernels on the Triton backend.

1. ``delta = rowsum(dO ∘ O)`` (Alg. 2 line 4, the ``D_i`` of eq. 4) is a memory-bound row reduction;
   the wrapper computes it with one fused XLA op before the kernels.
2. dK/dV kernel: grid ``(key block j, batch b, KV head)``. Each program keeps ``K_j, V_j`` and the f32
   accumulators ``dK_j, dV_j`` on chip and loops over the query blocks ``i`` (and, for GQA/MQA, over the
   ``G`` query heads that share this KV head, so dK/dV are summed over the group on chip without any
   atomics or repeated K/V in HBM), recomputing the forward's ``P_ij = exp2((S_ij - r_i)*c - u_i)`` from
   its row statistics (``kernels/softmax.py``, ``backward_rows``: exact at any logit size):
       dV_j += P_ij^T dO_i,   dP_ij = dO_i V_j^T,   dS_ij = P_ij ∘ (dP_ij - D_i),   dK_j += dS_ij^T Q_i.
3. dQ_i = sum_j dS_ij K_j receives a contribution from every key block: a separate kernel with grid
   ``(query block i, batch, head)`` loops over key blocks and accumulates dQ_i on chip (recomputing P and
   dS), with no atomics, so results are bit-identical across runs. (The paper's alternative, atomic adds
   of ``dS_ij K_j`` from the dK/dV kernel, was much slower on the Triton backend; docs/design.md.)

Causal: for key block ``j`` the query blocks wholly above the diagonal (``i < j*B_c // B_r``) are skipped;
only blocks that straddle the diagonal (or hold the ragged key tail) run the masked body.
The softmax scale is applied once to dK_j and dQ at the end (dS is left unscaled in the loop).
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..block_ranges import kv_range_table, q_range_table
from ..masking import Variant, VariantArrays
from ..softmax import backward_rows, probabilities
from ..vma import out_struct
from .common import (LOG2E, cdiv, compiler_params, div, dot, load_tile, padded_head_dim, round_up,
                     store_tile)
from .forward import kv_block_ranges
from .variant import Refs, tile_mask, uses_table, zero_unattended
from .variant import inputs as variant_inputs


def q_block_ranges(j, *, block_q: int, block_k: int, seq_q: int, seq_k: int, is_causal: bool):
  """Query-block ranges for key block ``j``: ``[i_start, i_full)`` masked, ``[i_full, nq)`` unmasked.

  Causal: query block ``i`` meets key block ``j`` when its last row ``(i+1)*B_r - 1 >= j*B_c``, i.e.
  ``i >= j*B_c // B_r``; it needs no mask when its first row is at or past the block's last key,
  ``i*B_r >= j*B_c + B_c - 1``. The key block holding the ragged tail of the keys is masked throughout.
  """
  nq = pl.cdiv(seq_q, block_q)
  tail = seq_k % block_k != 0
  is_tail = j == pl.cdiv(seq_k, block_k) - 1
  if is_causal:
    i_start = jnp.minimum(div(j * block_k, block_q), nq)
    i_full = jnp.minimum(cdiv(j * block_k + block_k - 1, block_q), nq)
  else:
    i_start, i_full = 0, 0
  if tail:
    # lax.select, not jnp.where: jnp.where wraps the select in a call that the Triton lowering of a
    # scalar loop bound mistypes (i1 vs i32, seen on jax 0.11.2 with a single ragged key block).
    i_full = lax.select(is_tail, jnp.int32(nq), jnp.asarray(i_full, jnp.int32))
  return i_start, i_full, nq


# P in the exact form for every head (kernels/softmax.py, probabilities): the Triton backward does not
# branch to the fast form per head, as the Mosaic kernels do.
_exact_p = functools.partial(probabilities, exact=True, bcast=lambda v, shape: v[:, None])

# 2^31: far below any base-2 logit whose weight is not 0 (exp2 of -2^31 underflows to 0)
_FLOOR = 2.0 ** 31


def _rounded(s2, r):
  """Base-2 modified logits ``s2`` (a soft cap or ``score_fn`` ends in a product) as the forward
  rounded them: the forward also takes their row maximum, so its compiler rounds the product; here
  ``s2 - r`` alone would let it contract the product into an FMA, unrounded, and an ulp of ``s2``
  (1e-3 at 1e4) moves ``P`` by ``2^ulp`` (4e-4 relative gradient error at logits of 1e4). A maximum
  with a floor per row (below any logit with a nonzero weight) needs the rounded value."""
  return jnp.maximum(s2, (r - _FLOOR)[:, None])


def _row_inputs(rows_ref, head, start, size):
  """The rows' ``(r, u)`` (``kernels/softmax.py``, ``backward_rows``), ``[size]`` f32 each."""
  return tuple(plgpu.load(rows_ref.at[head, jnp.int32(index), pl.ds(start, size)])
               for index in (0, 1))


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, rows_ref, delta_ref, *rest, scale: float,
                 variant: Variant, names: tuple[str, ...], seq_q: int, seq_k: int, head_dim: int,
                 value_head_dim: int, group: int, block_q: int, block_k: int, f32: bool):
  # q_ref: [T, G, hp], do_ref: [T, G, hvp] (the G query heads of this KV head); k_ref: [S, hp],
  # v_ref: [S, hvp]; rows_ref: [G, 2, Tp] f32 (r, u); delta_ref: [G, Tp] f32; then the variant
  # operands named by `names` (per-head ones as [G] / [G, 4] slices); outputs dk_ref: [S, hp], dv_ref:
  # [S, hvp]. hp, hvp: H and Hv padded (common.padded_head_dim).
  var_refs, (dk_ref, dv_ref) = rest[:len(names)], rest[len(names):]
  hp, hvp = k_ref.shape[-1], v_ref.shape[-1]
  j, b, hk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  table = uses_table(variant)
  vr = Refs(variant, names, var_refs, seq_k=seq_k) if table else None
  fold = not variant.modifies_scores
  c = scale * LOG2E
  k_start = j * block_k
  kv_limit = None if seq_k % block_k == 0 else seq_k
  q_limit = None if seq_q % block_q == 0 else seq_q
  # Keys past kv_len read as 0 (values held there never reach dK/dV or dQ).
  k_end = vr.key_end(seq_k) if table else kv_limit
  k = load_tile(k_ref, k_start, block_k, k_end, head_dim)  # K_j [block_k, hp], stays on chip
  v = load_tile(v_ref, k_start, block_k, k_end, value_head_dim)  # V_j [block_k, hvp]

  def body(i, carry, g, masked: bool):
    dk, dv = carry  # [block_k, hp], [block_k, hvp] f32
    start = i * block_q
    q = load_tile(q_ref, start, block_q, q_limit, head_dim, head=g)  # Q_i [block_q, hp]
    do = load_tile(do_ref, start, block_q, q_limit, value_head_dim, head=g)  # dO_i [block_q, hvp]
    r, u = _row_inputs(rows_ref, g, start, block_q)  # [block_q] each
    delta = plgpu.load(delta_ref.at[g, pl.ds(start, block_q)])  # D_i [block_q]
    s = dot(q, k, trans_b=True, f32=f32)  # S_ij [block_q, block_k]
    deriv = None
    if fold:
      p = _exact_p(s, r, u, c)  # P_ij recomputed (Alg. 2 line 11)
    else:
      h = hk * group + g
      s2, deriv = vr.scores(s, scale, b, h, start, k_start, g=g, derivative=True)
      p = _exact_p(_rounded(s2, r), r, u, 1.0)
    keep = None
    if masked:
      keep = tile_mask(variant, vr, b, hk * group + g, start, block_q, k_start, block_k,
                       seq_q=seq_q, seq_k=seq_k)
      if table:  # rows attending no key of the tile (padding): no 0 * NaN into dK, dV
        q, do = zero_unattended(keep, q, 1), zero_unattended(keep, do, 1)
      if keep is not None:
        p = jnp.where(keep, p, 0.0)
    dv = dv + dot(p.astype(do.dtype), do, trans_a=True, f32=f32)  # dV_j += P^T dO_i
    dp = dot(do, v, trans_b=True, f32=f32)  # dP_ij = dO_i V_j^T
    ds = p * (dp - delta[:, None])  # dS_ij = P_ij ∘ (dP_ij − D_i)   (eq. 4, unscaled)
    if deriv is not None:
      ds = ds * deriv  # through soft cap / score_fn: d s_out / d s_in
    if table and keep is not None:
      ds = jnp.where(keep, ds, 0.0)  # masked pairs: no 0 * NaN from dP or the derivative
    dk = dk + dot(ds.astype(q.dtype), q, trans_a=True, f32=f32)  # dK_j += dS^T Q_i
    return dk, dv

  def over_queries(g, carry):
    masked = functools.partial(body, g=g, masked=True)
    unmasked = functools.partial(body, g=g, masked=False)
    if table:
      lo, full_lo, full_hi, hi = vr.ranges(g)
      carry = lax.fori_loop(full_lo, full_hi, unmasked, carry)
      carry = lax.fori_loop(lo, full_lo, masked, carry)
      return lax.fori_loop(full_hi, hi, masked, carry)
    i_start, i_full, nq = q_block_ranges(j, block_q=block_q, block_k=block_k, seq_q=seq_q,
                                         seq_k=seq_k, is_causal=variant.is_causal)
    carry = lax.fori_loop(i_start, i_full, masked, carry)
    return lax.fori_loop(i_full, nq, unmasked, carry)

  carry = (jnp.zeros((block_k, hp), jnp.float32), jnp.zeros((block_k, hvp), jnp.float32))
  if group == 1:
    dk, dv = over_queries(jnp.int32(0), carry)
  else:
    dk, dv = lax.fori_loop(0, group, over_queries, carry)  # GQA: sum over the query-head group
  store_tile(dk_ref, k_start, dk * scale, kv_limit, head_dim)
  store_tile(dv_ref, k_start, dv, kv_limit, value_head_dim)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, rows_ref, delta_ref, *rest, scale: float,
               variant: Variant, names: tuple[str, ...], seq_q: int, seq_k: int, head_dim: int,
               value_head_dim: int, block_q: int, block_k: int, f32: bool,
               slope_grad: bool = False):
  # q_ref, dq_ref: [T, hp]; do_ref: [T, hvp]; k_ref: [S, hp], v_ref: [S, hvp] (KV head h // G);
  # rows_ref: [1, 2, Tp] (r, u); delta_ref: [1, Tp]; then the variant operands named by `names`; with
  # slope_grad a second output, dslope_ref [block_q]: this block's rows' sums of dS * d s / d slope
  # (ALiBi).
  var_refs, out_refs = rest[:len(names)], rest[len(names):]
  dq_ref = out_refs[0]
  hp = q_ref.shape[-1]
  i, b, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  table = uses_table(variant)
  vr = Refs(variant, names, var_refs, seq_k=seq_k) if table else None
  fold = not variant.modifies_scores
  c = scale * LOG2E
  start = i * block_q
  q_limit = None if seq_q % block_q == 0 else seq_q
  q = load_tile(q_ref, start, block_q, q_limit, head_dim)  # Q_i [block_q, hp]
  do = load_tile(do_ref, start, block_q, q_limit, value_head_dim)  # dO_i [block_q, hvp]
  r, u = _row_inputs(rows_ref, jnp.int32(0), start, block_q)
  delta = plgpu.load(delta_ref.at[jnp.int32(0), pl.ds(start, block_q)])
  key_end = vr.key_end(seq_k) if table else seq_k

  def body(j, carry, masked: bool):
    dq, dslope = carry if slope_grad else (carry, None)
    k_start = j * block_k
    k = load_tile(k_ref, k_start, block_k, key_end if masked else None, head_dim)
    v = load_tile(v_ref, k_start, block_k, key_end if masked else None, value_head_dim)
    s = dot(q, k, trans_b=True, f32=f32)
    deriv = None
    if fold:
      p = _exact_p(s, r, u, c)
    elif slope_grad:
      s2, deriv, d_slope = vr.scores(s, scale, b, h, start, k_start, derivative=True,
                                     slope_derivative=True)
      p = _exact_p(_rounded(s2, r), r, u, 1.0)
    else:
      s2, deriv = vr.scores(s, scale, b, h, start, k_start, derivative=True)
      p = _exact_p(_rounded(s2, r), r, u, 1.0)
    keep = None
    if masked:
      keep = tile_mask(variant, vr, b, h, start, block_q, k_start, block_k, seq_q=seq_q,
                       seq_k=seq_k)
      if table:
        k = zero_unattended(keep, k, 0)  # no 0 * NaN in dS K from a key the tile never attends
      if keep is not None:
        p = jnp.where(keep, p, 0.0)
    dp = dot(do, v, trans_b=True, f32=f32)
    ds = p * (dp - delta[:, None])
    if slope_grad:  # d loss / d slope: dS (w.r.t. the modified logits) times d s / d slope
      part = ds * d_slope
      if keep is not None:
        part = jnp.where(keep, part, 0.0)
      dslope = dslope + jnp.sum(part, axis=1)
    if deriv is not None:
      ds = ds * deriv
    if table and keep is not None:
      ds = jnp.where(keep, ds, 0.0)
    dq = dq + dot(ds.astype(k.dtype), k, f32=f32)  # dQ_i += dS_ij K_j
    return (dq, dslope) if slope_grad else dq

  dq = jnp.zeros((block_q, hp), jnp.float32)
  if slope_grad:
    dq = (dq, jnp.zeros((block_q,), jnp.float32))
  masked, unmasked = functools.partial(body, masked=True), functools.partial(body, masked=False)
  if table:
    lo, full_lo, full_hi, hi = vr.ranges()
    dq = lax.fori_loop(full_lo, full_hi, unmasked, dq)
    dq = lax.fori_loop(lo, full_lo, masked, dq)
    dq = lax.fori_loop(full_hi, hi, masked, dq)
  else:
    n_full, n_end = kv_block_ranges(i, block_q=block_q, block_k=block_k, seq_k=seq_k,
                                    is_causal=variant.is_causal)
    dq = lax.fori_loop(0, n_full, unmasked, dq)
    dq = lax.fori_loop(n_full, n_end, masked, dq)
  if slope_grad:
    dq, dslope = dq
    out_refs[1][...] = dslope
  store_tile(dq_ref, start, dq * scale, q_limit, head_dim)


def backward(q, k, v, out, stats, do, *, dlse=None, scale: float, is_causal: bool, block_q_dkv: int,
             block_k_dkv: int, block_q_dq: int, block_k_dq: int, num_warps: int, num_stages: int,
             interpret: bool, variant: Variant | None = None, arrays: VariantArrays | None = None,
             tables: dict | None = None, slope_grad: bool = False):
  """Gradients of attention w.r.t. q, k, v (and the ALiBi slopes' part from the scores).

  Args:
    q: ``[B, T, N, H]``; out, do: ``[B, T, N, Hv]``; k: ``[B, S, K, H]``; v: ``[B, S, K, Hv]``;
      stats: ``[B, N, 2, T]`` f32, the forward's row statistics.
    dlse: optional cotangent of lse ``[B, N, T]``: since d lse_i / d S_ij = P_ij it enters as
      ``dS = P ∘ (dP − (D − dlse))``, i.e. it is subtracted from delta.
    variant, arrays: the attention variant (:mod:`fa2_jax.kernels.masking`; None: dense or ``is_causal``).
    tables: its precomputed range tables ``{"dkv": ..., "dq": ...}`` (``BlockSizes.range_tiles``),
      or None to compute them here.
    slope_grad: also return ``dslope_rows [B, N, T]`` f32, per query row the sum over its keys of
      ``dS * d s / d slope`` (ALiBi; summed over T it is the slopes' gradient through the scores:
      ``masking.kernel_scores``). The dQ kernel adds it up in the loop it runs anyway.

  Returns:
    ``dq, dk, dv`` in the dtypes of q, k, v (then ``dslope_rows`` with ``slope_grad``).
  """
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  group = n // kh
  hv = v.shape[-1]
  hp, hvp = padded_head_dim(h), padded_head_dim(hv)
  f32 = q.dtype == jnp.float32
  tp = round_up(t, max(block_q_dkv, block_q_dq))
  # D_i = rowsum(dO_i ∘ O_i) (Alg. 2 line 4), in f32; (r, u) and delta padded to Tp with zeros so that
  # the kernels read whole tiles without masks (padded rows have Q = dO = 0, hence dS = 0).
  delta = jnp.einsum("btnh,btnh->bnt", out.astype(jnp.float32), do.astype(jnp.float32))
  if dlse is not None:
    delta = delta - dlse
  pad = ((0, 0), (0, 0), (0, tp - t))
  variant = variant or Variant(is_causal=bool(is_causal))
  rows_p = jnp.pad(backward_rows(stats), pad[:2] + ((0, 0),) + pad[2:])
  delta_p = jnp.pad(delta, pad)
  params = compiler_params(num_warps, num_stages)
  table = uses_table(variant)
  dkv_ops, dkv_specs, dkv_names = [], [], ()
  dq_ops, dq_specs, dq_names = [], [], ()
  if table:
    dims = dict(batch=b, heads=n, seq_q=t, seq_k=s)
    tables = tables or {}
    q_table = tables.get("dkv")
    if q_table is None:
      q_table = q_range_table(variant, arrays, block_q=block_q_dkv, block_k=block_k_dkv, **dims)
    dkv_ops, dkv_specs, dkv_names = variant_inputs(variant, arrays, q_table, kv_heads_grid=True,
                                                   group=group)
    kv_table = tables.get("dq")
    if kv_table is None:
      kv_table = kv_range_table(variant, arrays, block_q=block_q_dq, block_k=block_k_dq, **dims)
    dq_ops, dq_specs, dq_names = variant_inputs(variant, arrays, kv_table, kv_heads_grid=False,
                                                group=group)

  # --- dK, dV ----------------------------------------------------------------------------------
  nk = pl.cdiv(s, block_k_dkv)
  in_specs = [
      pl.BlockSpec((None, t, group, hp), lambda j, bi, hk: (bi, 0, hk, 0)),  # q
      pl.BlockSpec((None, s, None, hp), lambda j, bi, hk: (bi, 0, hk, 0)),  # k
      pl.BlockSpec((None, s, None, hvp), lambda j, bi, hk: (bi, 0, hk, 0)),  # v
      pl.BlockSpec((None, t, group, hvp), lambda j, bi, hk: (bi, 0, hk, 0)),  # do
      pl.BlockSpec((None, group, 2, tp), lambda j, bi, hk: (bi, hk, 0, 0)),  # (r, u)
      pl.BlockSpec((None, group, tp), lambda j, bi, hk: (bi, hk, 0)),  # delta
      *dkv_specs,
  ]
  out_specs = [
      pl.BlockSpec((None, s, None, hp), lambda j, bi, hk: (bi, 0, hk, 0)),  # dk
      pl.BlockSpec((None, s, None, hvp), lambda j, bi, hk: (bi, 0, hk, 0)),  # dv
  ]
  out_shape = [out_struct(k.shape, k.dtype, q), out_struct(v.shape, v.dtype, q)]
  dk, dv = pl.pallas_call(
      functools.partial(_dkdv_kernel, scale=float(scale), variant=variant, names=dkv_names,
                        seq_q=t, seq_k=s, head_dim=h, value_head_dim=hv, group=group,
                        block_q=block_q_dkv, block_k=block_k_dkv, f32=f32),
      grid=(nk, b, kh),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=params,
      interpret=interpret,
      name="fa2_backward_dkdv",
  )(q, k, v, do, rows_p, delta_p, *dkv_ops)

  # --- dQ --------------------------------------------------------------------------------------
  slope_grad = bool(slope_grad and variant.has_alibi)
  dq_spec = pl.BlockSpec((None, t, None, hp), lambda i, bi, hi: (bi, 0, hi, 0))
  dq_shape = out_struct(q.shape, q.dtype, q)
  if slope_grad:  # per query row, padded to Tp: [B, N, Tp] f32
    dq_spec = [dq_spec, pl.BlockSpec((None, None, block_q_dq), lambda i, bi, hi: (bi, hi, i))]
    dq_shape = [dq_shape, out_struct((b, n, tp), jnp.float32, q)]
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, scale=float(scale), variant=variant, names=dq_names, seq_q=t,
                        seq_k=s, head_dim=h, value_head_dim=hv, block_q=block_q_dq,
                        block_k=block_k_dq, f32=f32, slope_grad=slope_grad),
      grid=(pl.cdiv(t, block_q_dq), b, n),
      in_specs=[
          pl.BlockSpec((None, t, None, hp), lambda i, bi, hi: (bi, 0, hi, 0)),  # q
          pl.BlockSpec((None, s, None, hp), lambda i, bi, hi: (bi, 0, div(hi, group), 0)),  # k
          pl.BlockSpec((None, s, None, hvp), lambda i, bi, hi: (bi, 0, div(hi, group), 0)),  # v
          pl.BlockSpec((None, t, None, hvp), lambda i, bi, hi: (bi, 0, hi, 0)),  # do
          pl.BlockSpec((None, 1, 2, tp), lambda i, bi, hi: (bi, hi, 0, 0)),  # (r, u)
          pl.BlockSpec((None, 1, tp), lambda i, bi, hi: (bi, hi, 0)),  # delta
          *dq_specs,
      ],
      out_specs=dq_spec,
      out_shape=dq_shape,
      compiler_params=params,
      interpret=interpret,
      name="fa2_backward_dq",
  )(q, k, v, do, rows_p, delta_p, *dq_ops)
  if slope_grad:
    dq, dslope_rows = dq
    return dq, dk, dv, dslope_rows[:, :, :t]
  return dq, dk, dv
