"""FlashAttention-1-like variants of the Triton kernels: benchmark-only code for ``benchmarks.ablation``
(and ``benchmarks.numerics``), not part of fa2_jax.

The production kernels (``fa2_jax.kernels.triton``) are FlashAttention-2. Each switch here turns one of
its ideas off:

* ``normalize_each_step=True`` (forward): rescale the accumulator by the softmax denominator every step,
  ``acc = diag(l_new)^-1 (diag(l_old) e^{m_old - m_new} acc + P~ V)``, as FlashAttention-1 does, instead
  of one division at the end (paper §3.1.1);
* ``seq_parallel=False`` (forward): one program per (batch, head) looping over the query blocks, as
  FlashAttention-1 parallelises, instead of one program per query block (§3.2);
* ``atomic_dq=True`` (backward): the dK/dV kernel adds ``dS_ij K_j`` into an f32 dQ buffer with atomics
  (Alg. 2 line 15 as written) instead of the separate dQ kernel.

Only the variant kernel bodies live here; tiles (``BlockSizes``), the mask (``fa2_jax.kernels.masking``), block
ranges, tile loads/stores and the unchanged passes come from the production modules. With every switch
off :func:`attention` runs exactly the production forward and backward.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fa2_jax import BlockSizes, dispatch
from fa2_jax.kernels.triton import backward as prod_bwd
from fa2_jax.kernels.triton import forward as prod_fwd
from fa2_jax.kernels.triton.common import (LN2, LOG2E, compiler_params, div, dot, load_tile,
                                           padded_head_dim, round_up, store_tile)
from fa2_jax.kernels.softmax import lse_from_stats
from fa2_jax.kernels.masking import allowed
from fa2_jax.validation import check_bool, check_scale, validate_qkv


# --- forward: per-step normalisation and/or one program per (batch, head) ---------------------------

def _fwd_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale: float, is_causal: bool, seq_q: int,
                seq_k: int, head_dim: int, block_q: int, block_k: int, f32: bool,
                normalize_each_step: bool, seq_parallel: bool):
  # q_ref, o_ref: [T, hp] (this batch, head); k_ref, v_ref: [S, hp] (its KV head); lse_ref: [T] f32.
  hp = q_ref.shape[-1]
  c = scale * LOG2E  # exp(x * scale) = exp2(x * c); the scale > 0 fold of the production kernel
  fold = scale > 0
  q_limit = None if seq_q % block_q == 0 else seq_q

  def one_query_block(i):
    q = load_tile(q_ref, i * block_q, block_q, q_limit, head_dim)  # Q_i [block_q, hp]
    q_pos = i * block_q + jnp.arange(block_q)[:, None]  # [block_q, 1]

    def body(j, carry, masked: bool):
      acc, m_i, l_i = carry  # [block_q, hp] f32, [block_q] f32, [block_q] f32
      start = j * block_k
      k = load_tile(k_ref, start, block_k, seq_k if masked else None, head_dim)  # K_j [block_k, hp]
      v = load_tile(v_ref, start, block_k, seq_k if masked else None, head_dim)  # V_j [block_k, hp]
      s = dot(q, k, trans_b=True, f32=f32)  # S_ij [block_q, block_k] f32
      if not fold:
        s = s * c
      if masked:
        keep = allowed(q_pos, start + jnp.arange(block_k)[None, :], is_causal=is_causal,
                       seq_k=seq_k if seq_k % block_k else None)
        if keep is not None:
          s = jnp.where(keep, s, -jnp.inf)
      m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
      m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new  # all-masked row: no NaN
      mc = m_use * c if fold else m_use
      alpha = jnp.exp2((m_i * c if fold else m_i) - mc)  # e^{m_old - m_new}
      p = jnp.exp2((s * c if fold else s) - mc[:, None])  # P~_ij [block_q, block_k] f32
      l_new = alpha * l_i + jnp.sum(p, axis=1)
      pv = dot(p.astype(v.dtype), v, f32=f32)  # P~_ij V_j [block_q, hp]
      if normalize_each_step:  # FlashAttention-1: acc stays normalised, one divide per element per step
        inv = 1.0 / jnp.where(l_new == 0.0, 1.0, l_new)
        acc = acc * (alpha * l_i * inv)[:, None] + pv * inv[:, None]
      else:
        acc = acc * alpha[:, None] + pv  # FlashAttention-2: unscaled
      return acc, m_new, l_new

    carry = (jnp.zeros((block_q, hp), jnp.float32), jnp.full((block_q,), -jnp.inf, jnp.float32),
             jnp.zeros((block_q,), jnp.float32))
    n_full, n_end = prod_fwd.kv_block_ranges(i, block_q=block_q, block_k=block_k, seq_k=seq_k,
                                             is_causal=is_causal)
    carry = lax.fori_loop(0, n_full, functools.partial(body, masked=False), carry)
    acc, m_i, l_i = lax.fori_loop(n_full, n_end, functools.partial(body, masked=True), carry)
    empty = l_i == 0.0
    l_safe = jnp.where(empty, 1.0, l_i)
    store_tile(o_ref, i * block_q, acc if normalize_each_step else acc / l_safe[:, None], q_limit,
               head_dim)
    lse = jnp.where(empty, -jnp.inf, (m_i * c if fold else m_i) * LN2 + jnp.log(l_safe))  # natural log
    rows = lse_ref.at[pl.ds(i * block_q, block_q)]
    if q_limit is None:
      plgpu.store(rows, lse)
    else:
      plgpu.store(rows, lse, mask=i * block_q + jnp.arange(block_q) < q_limit)

  if seq_parallel:
    one_query_block(pl.program_id(0))
  else:  # FlashAttention-1's parallelisation: this program walks every query block of its head
    @pl.loop(0, pl.cdiv(seq_q, block_q))
    def _(i):
      one_query_block(i)


def forward(q, k, v, *, scale: float, is_causal: bool, blocks: BlockSizes, interpret: bool,
            normalize_each_step: bool, seq_parallel: bool):
  """``(out [B, T, N, H], lse [B, N, T] f32)``, as the production ``forward``."""
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  group = n // kh
  hp = padded_head_dim(h)
  kernel = functools.partial(
      _fwd_kernel, scale=float(scale), is_causal=is_causal, seq_q=t, seq_k=s, head_dim=h,
      block_q=blocks.block_q, block_k=blocks.block_k, f32=q.dtype == jnp.float32,
      normalize_each_step=normalize_each_step, seq_parallel=seq_parallel)
  if seq_parallel:  # grid (query block, batch, head); the index maps drop the query block
    grid = (pl.cdiv(t, blocks.block_q), b, n)
    bh = lambda f: lambda i, bi, hi: f(bi, hi)  # noqa: E731
  else:  # grid (batch, head)
    grid = (b, n)
    bh = lambda f: f  # noqa: E731
  qmap = bh(lambda bi, hi: (bi, 0, hi, 0))
  kvmap = bh(lambda bi, hi: (bi, 0, div(hi, group), 0))
  return pl.pallas_call(
      kernel, grid=grid,
      in_specs=[pl.BlockSpec((None, t, None, hp), qmap), pl.BlockSpec((None, s, None, hp), kvmap),
                pl.BlockSpec((None, s, None, hp), kvmap)],
      out_specs=[pl.BlockSpec((None, t, None, hp), qmap),
                 pl.BlockSpec((None, None, t), bh(lambda bi, hi: (bi, hi, 0)))],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, n, t), jnp.float32)],
      compiler_params=compiler_params(blocks.num_warps_fwd, blocks.num_stages_fwd),
      interpret=interpret, name="fa2_ablation_forward",
  )(q, k, v)


# --- backward: dQ by atomic adds from the dK/dV kernel -----------------------------------------------

def _dkdv_atomic_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_in_ref, dk_ref, dv_ref,
                        dq_ref, *, scale: float, is_causal: bool, seq_q: int, seq_k: int,
                        head_dim: int, group: int, block_q: int, block_k: int, f32: bool):
  # q_ref, do_ref: [T, G, hp]; k_ref, v_ref, dk_ref, dv_ref: [S, hp]; lse_ref, delta_ref: [G, Tp] f32;
  # dq_ref: [Tp, G, hp] f32, aliased with dq_in_ref (zeros in).
  del dq_in_ref
  hp = k_ref.shape[-1]
  c = scale * LOG2E
  k_start = pl.program_id(0) * block_k
  kv_limit = None if seq_k % block_k == 0 else seq_k
  q_limit = None if seq_q % block_q == 0 else seq_q
  k = load_tile(k_ref, k_start, block_k, kv_limit, head_dim)  # K_j [block_k, hp]
  v = load_tile(v_ref, k_start, block_k, kv_limit, head_dim)  # V_j [block_k, hp]
  k_pos = k_start + jnp.arange(block_k)[None, :]
  i_start, i_full, nq = prod_bwd.q_block_ranges(pl.program_id(0), block_q=block_q, block_k=block_k,
                                                seq_q=seq_q, seq_k=seq_k, is_causal=is_causal)

  def body(i, carry, g, masked: bool):
    dk, dv = carry  # [block_k, hp] f32 each
    start = i * block_q
    q = load_tile(q_ref, start, block_q, q_limit, head_dim, head=g)  # Q_i
    do = load_tile(do_ref, start, block_q, q_limit, head_dim, head=g)  # dO_i
    lse = plgpu.load(lse_ref.at[g, pl.ds(start, block_q)])  # L_i, natural log
    lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse * LOG2E)  # base 2; a keyless row gives P = 0
    delta = plgpu.load(delta_ref.at[g, pl.ds(start, block_q)])  # D_i
    p = jnp.exp2(dot(q, k, trans_b=True, f32=f32) * c - lse2[:, None])  # P_ij [block_q, block_k]
    if masked:
      keep = allowed(start + jnp.arange(block_q)[:, None], k_pos, is_causal=is_causal,
                     seq_k=kv_limit)
      if keep is not None:
        p = jnp.where(keep, p, 0.0)
    dv = dv + dot(p.astype(do.dtype), do, trans_a=True, f32=f32)  # dV_j += P^T dO_i
    ds = (p * (dot(do, v, trans_b=True, f32=f32) - delta[:, None])).astype(q.dtype)  # dS_ij
    dk = dk + dot(ds, q, trans_a=True, f32=f32)  # dK_j += dS^T Q_i
    # dQ_i += dS_ij K_j: atomics into the f32 buffer (padded to Tp rows, so no mask is needed).
    plgpu.atomic_add(dq_ref, (pl.ds(start, block_q), g, pl.ds(0, hp)), dot(ds, k, f32=f32))
    return dk, dv

  def over_queries(g, carry):
    carry = lax.fori_loop(i_start, i_full, functools.partial(body, g=g, masked=True), carry)
    return lax.fori_loop(i_full, nq, functools.partial(body, g=g, masked=False), carry)

  carry = (jnp.zeros((block_k, hp), jnp.float32), jnp.zeros((block_k, hp), jnp.float32))
  dk, dv = lax.fori_loop(0, group, over_queries, carry)  # GQA: the query heads of this KV head
  store_tile(dk_ref, k_start, dk * scale, kv_limit, head_dim)
  store_tile(dv_ref, k_start, dv, kv_limit, head_dim)


def backward_atomic_dq(q, k, v, out, lse, do, *, dlse, scale: float, is_causal: bool,
                       blocks: BlockSizes, interpret: bool):
  """``(dq, dk, dv)`` from one dK/dV kernel that also adds dQ atomically (no dQ kernel)."""
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  group, hp = n // kh, padded_head_dim(h)
  bq, bk = blocks.block_q_dkv, blocks.block_k_dkv
  tp = round_up(t, bq)
  delta = jnp.einsum("btnh,btnh->bnt", out.astype(jnp.float32), do.astype(jnp.float32))  # D_i
  if dlse is not None:
    delta = delta - dlse
  pad = ((0, 0), (0, 0), (0, tp - t))  # whole tiles: padded rows have Q = dO = 0, hence dS = 0
  kv_spec = pl.BlockSpec((None, s, None, hp), lambda j, bi, hk: (bi, 0, hk, 0))
  qg_spec = pl.BlockSpec((None, t, group, hp), lambda j, bi, hk: (bi, 0, hk, 0))
  row_spec = pl.BlockSpec((None, group, tp), lambda j, bi, hk: (bi, hk, 0))
  dq_spec = pl.BlockSpec((None, tp, group, hp), lambda j, bi, hk: (bi, 0, hk, 0))
  dk, dv, dq_acc = pl.pallas_call(
      functools.partial(_dkdv_atomic_kernel, scale=float(scale), is_causal=is_causal, seq_q=t,
                        seq_k=s, head_dim=h, group=group, block_q=bq, block_k=bk,
                        f32=q.dtype == jnp.float32),
      grid=(pl.cdiv(s, bk), b, kh),
      in_specs=[qg_spec, kv_spec, kv_spec, qg_spec, row_spec, row_spec, dq_spec],
      out_specs=[kv_spec, kv_spec, dq_spec],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype),
                 jax.ShapeDtypeStruct((b, tp, n, hp), jnp.float32)],
      input_output_aliases={6: 2},
      compiler_params=compiler_params(blocks.num_warps_bwd, blocks.num_stages_bwd),
      interpret=interpret, name="fa2_ablation_backward_dkdv_atomic_dq",
  )(q, k, v, do, jnp.pad(lse, pad), jnp.pad(delta, pad), jnp.zeros((b, tp, n, hp), jnp.float32))
  return (dq_acc[:, :t, :, :h] * scale).astype(q.dtype), dk, dv


# --- the differentiable entry point ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Static:
  scale: float
  is_causal: bool
  blocks: BlockSizes
  interpret: bool
  normalize_each_step: bool
  seq_parallel: bool
  atomic_dq: bool


def _forward(q, k, v, st: _Static):
  """``(out, lse [B, N, T], stats [B, N, 2, T])``: the production backward reads the row statistics
  (``fa2_jax.kernels.softmax``), the ablated one the lse."""
  with jax.enable_x64(False):  # the kernels index with int32, as in fa2_jax.attention
    if st.normalize_each_step or not st.seq_parallel:
      out, lse = forward(q, k, v, scale=st.scale, is_causal=st.is_causal, blocks=st.blocks,
                         interpret=st.interpret, normalize_each_step=st.normalize_each_step,
                         seq_parallel=st.seq_parallel)
      # Row statistics with the same P: r = lse / scale (so r * c = lse * log2(e)) and l = 1.
      return out, lse, jnp.stack([lse / st.scale, jnp.ones_like(lse)], axis=2)
    bs = st.blocks
    out, stats = prod_fwd.forward(q, k, v, scale=st.scale, is_causal=st.is_causal,
                                  block_q=bs.block_q, block_k=bs.block_k,
                                  num_warps=bs.num_warps_fwd, num_stages=bs.num_stages_fwd,
                                  interpret=st.interpret)
    return out, lse_from_stats(stats, st.scale, False), stats


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention(q, k, v, st: _Static):
  out, lse, _ = _forward(q, k, v, st)
  return out, jnp.swapaxes(lse, 1, 2)


def _attention_fwd(q, k, v, st: _Static):
  out, lse, stats = _forward(q, k, v, st)
  return (out, jnp.swapaxes(lse, 1, 2)), (q, k, v, out, lse, stats)


def _attention_bwd(st: _Static, res, cts):
  q, k, v, out, lse, stats = res
  dout, dlse = cts
  dout, dlse = dout.astype(q.dtype), jnp.swapaxes(dlse, 1, 2).astype(jnp.float32)  # dlse [B, N, T]
  bs = st.blocks
  with jax.enable_x64(False):
    if st.atomic_dq:
      return backward_atomic_dq(q, k, v, out, lse, dout, dlse=dlse, scale=st.scale,
                                is_causal=st.is_causal, blocks=bs, interpret=st.interpret)
    return prod_bwd.backward(q, k, v, out, stats, dout, dlse=dlse, scale=st.scale,
                             is_causal=st.is_causal, block_q_dkv=bs.block_q_dkv,
                             block_k_dkv=bs.block_k_dkv, block_q_dq=bs.block_q_dq,
                             block_k_dq=bs.block_k_dq, num_warps=bs.num_warps_bwd,
                             num_stages=bs.num_stages_bwd, interpret=st.interpret)


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(query, key, value, *, scale=None, is_causal=False, block_sizes=None, interpret=None,
              normalize_each_step=False, seq_parallel=True, atomic_dq=False, return_residual=False):
  """The Triton kernels with FlashAttention-2's ideas switched off (see the module docstring).

  Args as :func:`fa2_jax.flash_attention` (rank 4 only; ``block_sizes`` a ``BlockSizes`` or None;
  ``interpret`` None = Pallas interpret mode wherever there is no GPU). Returns ``out`` (and ``lse``
  ``[B, T, N]`` f32 when ``return_residual``).
  """
  validate_qkv(query, key, value)
  scale = check_scale(scale)
  if query.ndim != 4:
    raise ValueError(f"query must have rank 4 [B, T, N, H], got shape {tuple(query.shape)}")
  if query.shape[-1] > dispatch.MAX_HEAD_DIM:
    raise ValueError(f"head_dim must be <= {dispatch.MAX_HEAD_DIM}, got {query.shape[-1]}")
  if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
    raise TypeError(f"block_sizes must be a fa2_jax.BlockSizes or None, got "
                    f"{type(block_sizes).__name__}")
  flags = {n: check_bool(n, f) for n, f in (
      ("is_causal", is_causal), ("normalize_each_step", normalize_each_step),
      ("seq_parallel", seq_parallel), ("atomic_dq", atomic_dq), ("return_residual", return_residual))}
  if interpret is None:
    interpret = not dispatch.on_gpu()
  h = query.shape[-1]
  blocks = (block_sizes or BlockSizes.default(h, query.dtype)).clamp(query.shape[1], key.shape[1])
  st = _Static(scale=1.0 / math.sqrt(h) if scale is None else float(scale),
               is_causal=flags["is_causal"], blocks=blocks,
               interpret=check_bool("interpret", interpret),
               normalize_each_step=flags["normalize_each_step"], seq_parallel=flags["seq_parallel"],
               atomic_dq=flags["atomic_dq"])
  out, lse = _attention(query, key, value, st)
  return (out, lse) if flags["return_residual"] else out
