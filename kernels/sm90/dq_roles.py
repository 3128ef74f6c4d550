"""The dQ kernel for head_dim > 128: two consumer warpgroups on the same query rows, split by role.

At head_dim 256 the separate dQ kernel (``dq.py``) runs one consumer warpgroup per CTA (two would need
two Q/dO tiles beside the K/V ring, more shared memory than there is), which waits for every product
in turn. Here one CTA owns 64 query rows and its two consumers share each key tile's work::

    warpgroup 0 (P):   S = Q_i K_j^T, P (Alg. 2 lines 9-11)    dQ_i[:, :H/2] += dS K_j[:, :H/2]
    warpgroup 1 (dS):  dP = dO_i V_j^T (line 13),               dQ_i[:, H/2:] += dS K_j[:, H/2:]
                       dS = (P ∘ d) ∘ (dP - delta_i)  (line 14; d: a score modification's derivative)

``P ∘ d`` goes to warpgroup 1 through an f32 SMEM tile, ``dS`` back through a bf16 one, each behind an
mbarrier (``pd_full``, ``ds_full``). One of each suffices: warpgroup 0 writes step j+1's ``P ∘ d``
only after its step-j dQ product (which read ``dS``) has completed, and warpgroup 1 writes step
j+1's ``dS`` only after it has read that ``P ∘ d``, so neither tile is overwritten while in use. Each
warpgroup holds half of ``dQ_i`` (64 x H/2 f32) and issues two products per step of equal size
(``S`` or ``dP`` over H, and its half of ``dS K_j``). The producer is ``ops.stream_kv``, as for the
other dQ kernel; the range tables and masks are the same.
"""
from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..masking import Variant, allowed
from ..softmax import probabilities
from ..vma import out_struct

from .config import LOG2E, MosaicConfig
from .lowering_cache import kernel_call
from .ops import (Product, bcast_rows, iota2, kv_producer, mma, mma_many, per_cta_choice,
                  smem_transforms, smem_transforms_f32, step_loop, ws_kernel, zeros as _zeros)
from .schedule import causal_section, cta_tile, kv_block_ranges
from .variant import Refs

P_ROLE, DS_ROLE = 0, 1  # the consumer warpgroups' indices on the "wg" axis (the producer is 2)


@dataclasses.dataclass(frozen=True)
class _DqRoles:
  scale: float
  is_causal: bool
  seq_q: int  # true T
  seq_k: int  # true S
  group: int  # query heads per KV head
  head_dim: int
  block_q: int  # query rows per CTA (64: one wgmma M)
  block_k: int
  num_stages: int
  n_q_tiles: int
  dtype: object
  registers: int
  memory_registers: int
  n_heads: int = 1  # N
  n_bh: int = 1  # B * N
  section: int = 1  # causal launch order (schedule.lpt_tile)
  variant: Variant | None = None
  names: tuple[str, ...] = ()
  p_form: str = "per_head"  # MosaicConfig.p_form


def _dq_roles_kernel(q_ref, k_ref, v_ref, do_ref, rows_ref, delta_ref, exact_ref, *refs, q_smem,
                     do_smem, rows_smem, delta_smem, k_smem, v_smem, pd_smem, ds_smem, q_bar, do_bar,
                     rows_bar, delta_bar, k_bar, v_bar, k_free, v_free, pd_full, ds_full,
                     st: _DqRoles):
  # q_ref, do_ref: [B, T, N, H]; k_ref, v_ref: [B, S, K, H]; rows_ref: [B, N, 2, T_rows] (r, u);
  # delta_ref: [B, N, T_rows]; exact_ref: [B, N] int32 (kernels/softmax.py); then the variant
  # operands named by st.names; output dq_ref [B, T, N, H].
  # q_smem, do_smem [2, block_q, H/2]: Q_i and dO_i by column halves (each half a contiguous tile,
  # so that a warpgroup's half of dQ_i leaves through one by TMA); rows_smem [2, block_q];
  # delta_smem [block_q]; k_smem, v_smem [stages, block_k, H]; pd_smem [block_q, block_k] f32 (P ∘ d);
  # ds_smem [block_q, block_k] (dS).
  var_refs, (dq_ref,) = refs[:len(st.names)], refs[len(st.names):]
  bq, bk, stages = st.block_q, st.block_k, st.num_stages
  half = st.head_dim // 2
  variant = st.variant
  c = st.scale * LOG2E
  b, h, qt = cta_tile("q", is_causal=st.is_causal, n_heads=st.n_heads, n_tiles=st.n_q_tiles,
                      n_bh=st.n_bh, section=st.section, longest_last=True)
  wg = lax.axis_index("wg")
  kvh = lax.div(h, jnp.array(st.group, h.dtype))
  row0 = qt * bq
  vr = None
  if variant is None:
    lo = 0
    n_full, n_end = kv_block_ranges(row0, bq, block_k=bk, seq_k=st.seq_k, is_causal=st.is_causal)
  else:  # the call's range table (fa2_jax.kernels.block_ranges), the same for producer and consumers
    vr = Refs(variant, st.names, var_refs, b, seq_k=st.seq_k)
    lo, full_lo, full_hi, n_end = vr.ranges(qt)
  key_tail = st.seq_k % bk != 0
  q_tail = st.n_q_tiles * bq > st.seq_q  # rows past T in the last query tile
  tile = (bq, bk)
  rows = (b, pl.ds(row0, bq), h)

  def keep_of(j):
    """The allowed (row, key) pairs of a masked step, or None."""
    if variant is None:
      return allowed(row0 + iota2(tile, 0), j * bk + iota2(tile, 1), is_causal=st.is_causal,
                     seq_k=st.seq_k if key_tail else None)
    return vr.keep(tile, h, row0, j * bk, seq_q=st.seq_q if q_tail else None,
                   seq_k=st.seq_k if key_tail else None)

  def key_loop(step, dq):
    """``step(j, dq, masked)`` over the CTA's key tiles, in the producer's order."""
    masked = functools.partial(step, masked=True)
    unmasked = functools.partial(step, masked=False)
    if variant is None:
      dq = step_loop(0, n_full, unmasked, dq)
      return step_loop(n_full, n_end, masked, dq)
    dq = step_loop(lo, full_lo, masked, dq)
    dq = step_loop(full_lo, full_hi, unmasked, dq)
    return step_loop(full_hi, n_end, masked, dq)

  def slot_of(j):
    return lax.rem(j - lo, jnp.array(stages, j.dtype))

  def dq_half(dq, slot, cols):
    """This warpgroup's half of ``dQ_i += dS K_j`` (line 15), ``dS`` in SMEM."""
    return mma((bq, half), ds_smem, k_smem.at[slot, :, pl.ds(cols, half)], init=dq)

  def over_halves(x_smem, y_ref):
    """``x y^T`` for ``x`` [block_q, H] held by column halves and ``y`` [block_k, H] (S or dP)."""
    y0, y1 = (y_ref.at[:, pl.ds(w * half, half)] for w in range(2))
    return mma_many([Product(tile, x_smem.at[0], y0, tb=True,
                             more=[(x_smem.at[1], y1, False, True)])])[0]

  def load(src_ref, smem, bar):
    """``[block_q, H]`` rows of ``src_ref`` into ``smem`` [2, block_q, H/2], one TMA per half."""
    for w in range(2):
      plgpu.copy_gmem_to_smem(src_ref.at[rows + (pl.ds(w * half, half),)], smem.at[w], bar.at[w])
    for w in range(2):
      plgpu.barrier_wait(bar.at[w])

  def store(dq, cols):
    """This warpgroup's half of ``dQ_i``, scaled, through that half of the dead Q (or dO) tile."""
    smem = (q_smem if cols == 0 else do_smem).at[0 if cols == 0 else 1]
    smem[...] = (dq * st.scale).astype(st.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, dq_ref.at[rows + (pl.ds(cols, half),)])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == P_ROLE)
  def _p_role():
    plgpu.set_max_registers(st.registers, action="increase")
    plgpu.copy_gmem_to_smem(rows_ref.at[b, h, :, pl.ds(row0, bq)], rows_smem, rows_bar)
    load(q_ref, q_smem, q_bar)
    plgpu.barrier_wait(rows_bar)
    row_r = plgpu.load(rows_smem.at[0], layout=plgpu.Layout.WGMMA.reduce(1))
    row_u = plgpu.load(rows_smem.at[1], layout=plgpu.Layout.WGMMA.reduce(1))

    def step(j, dq, masked: bool, exact: bool):
      slot = slot_of(j)
      plgpu.barrier_wait(k_bar.at[slot])
      s = over_halves(q_smem, k_smem.at[slot])  # S = Q_i K_j^T
      modifies = variant is not None and variant.modifies_scores
      deriv = None
      if modifies:
        s, deriv = vr.scores(s, st.scale, h, row0, j * bk, derivative=True)
      p = probabilities(s, row_r, row_u, 1.0 if modifies else c, exact=exact, bcast=bcast_rows)
      keep = keep_of(j) if masked else None
      if keep is not None:
        p = jnp.where(keep, p, 0.0)
      if deriv is not None:  # masked pairs: no 0 * NaN from the derivative
        p = p * deriv if keep is None else jnp.where(keep, p * deriv, 0.0)
      pd_smem[...] = p
      plgpu.commit_smem()
      plgpu.barrier_arrive(pd_full)
      plgpu.barrier_wait(ds_full)
      dq = dq_half(dq, slot, 0)
      plgpu.barrier_arrive(k_free.at[slot])
      plgpu.barrier_arrive(v_free.at[slot])
      return dq

    def finish(exact: bool):
      store(key_loop(functools.partial(step, exact=exact), _zeros((bq, half))), 0)

    per_cta_choice(st.p_form, lambda: exact_ref[b, h] != 0, finish)  # as in dkdv.py

  @pl.when(wg == DS_ROLE)
  def _ds_role():
    plgpu.set_max_registers(st.registers, action="increase")
    plgpu.copy_gmem_to_smem(delta_ref.at[b, h, pl.ds(row0, bq)], delta_smem, delta_bar)
    load(do_ref, do_smem, do_bar)
    plgpu.barrier_wait(delta_bar)
    delta = plgpu.load(delta_smem, layout=plgpu.Layout.WGMMA.reduce(1))

    def step(j, dq, masked: bool):
      slot = slot_of(j)
      plgpu.barrier_wait(v_bar.at[slot])
      dp = over_halves(do_smem, v_smem.at[slot])  # dP = dO_i V_j^T
      if variant is not None and masked and (keep := keep_of(j)) is not None:
        dp = jnp.where(keep, dp, 0.0)  # masked pairs: no 0 * NaN from dP
      plgpu.barrier_wait(pd_full)
      pd = plgpu.load(pd_smem, layout=plgpu.Layout.WGMMA)
      ds_smem[...] = (pd * (dp - bcast_rows(delta, dp.shape))).astype(st.dtype)  # eq. 4
      plgpu.commit_smem()
      plgpu.barrier_arrive(ds_full)
      plgpu.barrier_wait(k_bar.at[slot])
      dq = dq_half(dq, slot, half)
      plgpu.barrier_arrive(k_free.at[slot])
      plgpu.barrier_arrive(v_free.at[slot])
      return dq

    store(key_loop(step, _zeros((bq, half))), half)

  pl.when(wg == 2)(functools.partial(
      kv_producer, st.memory_registers, k_ref=k_ref, v_ref=v_ref, k_smem=k_smem, v_smem=v_smem,
      k_bar=k_bar, v_bar=v_bar, k_free=k_free, v_free=v_free, b=b, kvh=kvh, n_end=n_end,
      block_k=bk, stages=stages, start=lo))


@kernel_call(('scale', 'is_causal', 'seq_k', 'cfg', 'emulate', 'seq_q', 'variant', 'names'))
def dq_roles_call(q, k, v, do, rows, delta, exact, *extras, scale, is_causal, seq_k,
                  cfg: MosaicConfig, emulate=False, seq_q=0, variant=None, names=()):
  """``dq [B, T_hbm, N, H]`` of the role-split dQ kernel; operands as ``dq.dq_call``."""
  b, t_hbm, n, h = q.shape
  kh = k.shape[2]
  bq, bk, stages = cfg.block_q_dq, cfg.block_k_dq, cfg.num_stages_dq
  n_q_tiles = -(-t_hbm // bq)
  st = _DqRoles(scale=scale, is_causal=is_causal, seq_q=seq_q or t_hbm, seq_k=seq_k, group=n // kh,
                head_dim=h, block_q=bq, block_k=bk, num_stages=stages, n_q_tiles=n_q_tiles,
                dtype=q.dtype, registers=cfg.registers(2), memory_registers=cfg.memory_registers,
                n_heads=n, n_bh=b * n,
                section=causal_section(cfg, n_bh=b * n, group=n // kh,
                                       kv_bytes=2 * k.shape[1] * h * k.dtype.itemsize),
                variant=variant, names=names, p_form=cfg.p_form(variant))
  tf = smem_transforms(h)
  scratch = dict(
      q_smem=plgpu.SMEM((2, bq, h // 2), q.dtype, transforms=tf),
      do_smem=plgpu.SMEM((2, bq, h // 2), do.dtype, transforms=tf),
      rows_smem=plgpu.SMEM((2, bq), jnp.float32),
      delta_smem=plgpu.SMEM((bq,), jnp.float32),
      k_smem=plgpu.SMEM((stages, bk, h), k.dtype, transforms=tf),
      v_smem=plgpu.SMEM((stages, bk, h), v.dtype, transforms=tf),
      pd_smem=plgpu.SMEM((bq, bk), jnp.float32, transforms=smem_transforms_f32(bk)),
      ds_smem=plgpu.SMEM((bq, bk), q.dtype, transforms=tf),
      q_bar=plgpu.Barrier(num_barriers=2), do_bar=plgpu.Barrier(num_barriers=2),
      rows_bar=plgpu.Barrier(),
      delta_bar=plgpu.Barrier(),
      k_bar=plgpu.Barrier(num_barriers=stages),
      v_bar=plgpu.Barrier(num_barriers=stages),
      k_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      v_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      pd_full=plgpu.Barrier(), ds_full=plgpu.Barrier(),
  )
  return ws_kernel(
      functools.partial(_dq_roles_kernel, st=st), out_type=out_struct(q.shape, q.dtype, q),
      scratch=scratch, grid=(b, n, n_q_tiles), grid_names=("b", "h", "q"), num_consumers=2,
      name="fa2_mosaic_dq_roles",
  )(q, k, v, do, rows, delta, exact, *extras)
