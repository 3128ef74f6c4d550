"""The dK/dV kernel for head_dim > 128: two consumer warpgroups on the same keys, split by role.

At head_dim 256 a ``[64, H]`` f32 accumulator is 128 registers per thread, so one warpgroup cannot
hold both ``dK_j`` and ``dV_j`` (the kernel of ``dkdv.py`` once ran as a dV pass and a dK pass there,
each recomputing ``S^T``, and the dK pass ``dP^T``: docs/removed-experiments.md). Here one CTA owns
64 keys and its two consumer warpgroups share every step of Alg. 2 between them, two products each::

    warpgroup 0 (P):   S^T = K_j Q_i^T, P^T (lines 9-11)     dV_j += P^T dO_i  (line 12)
    warpgroup 1 (dS):  dP^T = V_j dO_i^T (line 13)           dK_j += dS^T Q_i  (line 16)
                       dS^T = (P^T ∘ d) ∘ (dP^T - delta_i)  (line 14; d = d s_out / d s_in of a score
                                                             modification, else 1)

``P^T ∘ d`` goes from warpgroup 0 to warpgroup 1 through one f32 SMEM tile and two mbarriers
(``pd_full``: written; ``pd_empty``: read). Each warpgroup holds one ``[64, H]`` accumulator; ``S``
and ``dP`` are computed once per step instead of ``S`` twice and ``dP`` once over the two passes,
and Q and dO stream once per 64 keys instead of once for each pass. The producer warpgroup is the
other dK/dV kernel's (``dkdv.stream_queries``); the range tables and masks are the same.
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
from .dkdv import kv_head, stream_queries
from .lowering_cache import kernel_call
from .ops import (acc_loop, accumulators, bcast_cols, iota2, per_cta_choice, smem_transforms,
                  smem_transforms_f32, wgmma, wgmma_load, wgmma_wait, ws_kernel)
from .schedule import causal_section, cta_tile, over_query_ranges, q_block_ranges
from .variant import Refs

P_ROLE, DS_ROLE = 0, 1  # the consumer warpgroups' indices on the "wg" axis (the producer is 2)


@dataclasses.dataclass(frozen=True)
class _Roles:
  scale: float
  is_causal: bool
  seq_q: int  # true T
  seq_k: int  # true S
  group: int  # query heads per KV head
  head_dim: int
  value_head_dim: int  # V's, dO's and dV's (MLA: other than head_dim)
  block_q: int  # rows of each streamed Q/dO tile
  block_k: int  # keys per CTA (64: one wgmma M)
  num_stages: int
  dtype: object
  registers: int
  memory_registers: int
  n_heads: int = 1  # K * kv_copies (the grid's head axis)
  n_bh: int = 1  # B * n_heads
  n_k_tiles: int = 1
  section: int = 1  # causal launch order (schedule.lpt_tile)
  kv_copies: int = 1  # a GQA group split over this many CTAs (dkdv._Dkv.kv_copies)
  variant: Variant | None = None
  names: tuple[str, ...] = ()
  p_form: str = "per_head"  # MosaicConfig.p_form


def _roles_kernel(q_ref, k_ref, v_ref, do_ref, rows_ref, delta_ref, exact_ref, *refs, k_smem, v_smem,
                  q_smem, do_smem, rows_smem, delta_smem, pd_smem, k_bar, v_bar, q_bar, do_bar,
                  rows_bar, delta_bar, free, pd_full, pd_empty, out_smem=None, st: _Roles):
  # q_ref: [B, T, N, H], do_ref: [B, T, N, Hv]; k_ref: [B, S, K, H], v_ref: [B, S, K, Hv] (Hv: the
  # value head_dim); rows_ref: [B, N, 2, T_rows] (r, u);
  # delta_ref: [B, N, T_rows]; exact_ref: [B, N] int32 (kernels/softmax.py: backward_rows,
  # exact_heads); then the variant operands named by st.names; outputs dk_ref [B, S, K * kv_copies,
  # H], dv_ref [B, S, K * kv_copies, Hv] (partials of a split group: dkdv._Dkv.kv_copies).
  # k_smem [block_k, H], v_smem [block_k, Hv]; q_smem [stages, block_q, H], do_smem [stages, block_q,
  # Hv]; out_smem (Hv != H only): the staging tiles of dK [block_k, H] and dV [block_k, Hv], where
  # the dead K_j / V_j tiles are another width; rows_smem [stages, 2, block_q];
  # delta_smem [stages, block_q]; pd_smem [block_k, block_q] f32: P^T ∘ d of the current step.
  var_refs, (dk_ref, dv_ref) = refs[:len(st.names)], refs[len(st.names):]
  bq, bk, stages, g_size = st.block_q, st.block_k, st.num_stages, st.group
  variant = st.variant
  c = st.scale * LOG2E
  b, kvh, kt = cta_tile("k", is_causal=st.is_causal, n_heads=st.n_heads, n_tiles=st.n_k_tiles,
                        n_bh=st.n_bh, section=st.section, longest_last=False)
  wg = lax.axis_index("wg")
  k0 = kt * bk
  vr = None
  if variant is None:
    q_ranges = q_block_ranges(k0, bk, block_q=bq, seq_q=st.seq_q, is_causal=st.is_causal)
  else:  # the call's range table (fa2_jax.kernels.block_ranges), the same for producer and consumers
    vr = Refs(variant, st.names, var_refs, b, seq_k=st.seq_k)
    q_ranges = vr.ranges(kt)
  i_start, nq = q_ranges[0], q_ranges[-1]  # the first query tile and one past the last
  n_i = nq - i_start  # query tiles per group head
  q_tail = st.seq_q % bq != 0  # rows past T in a partial last query tile
  k_tail = st.n_k_tiles * bk > st.seq_k  # keys past S in the last key tile
  tile = (bk, bq)
  key_rows = (b, pl.ds(k0, bk), kvh)  # this CTA's dK/dV rows (its partial's, with kv_copies)
  kv_rows = (b, pl.ds(k0, bk), kv_head(kvh, st.kv_copies))

  def keep_of(i, h):
    """The allowed (key, row) pairs of a masked step, or None."""
    if variant is None:
      return allowed(i * bq + iota2(tile, 1), k0 + iota2(tile, 0), is_causal=st.is_causal)
    return vr.keep(tile, h, i * bq, k0, seq_q=st.seq_q if q_tail else None,
                   seq_k=st.seq_k if k_tail else None, transposed=True)

  def query_loop(step, acc):
    """``step(i, g, masked)`` over every query tile of every group head, in the producer's order."""
    def over_queries(g):
      masked = functools.partial(step, g=g, masked=True)
      unmasked = functools.partial(step, g=g, masked=False)
      over_query_ranges(functools.partial(acc_loop, accs=(acc,)), masked, unmasked, q_ranges)

    if g_size == 1:
      over_queries(jnp.int32(0))
    else:
      acc_loop(0, g_size, over_queries, (acc,))  # GQA: summed over the head group

  def slot_of(i, g):
    idx = g * n_i + (i - i_start)
    return lax.rem(idx, jnp.array(stages, idx.dtype))

  def store(x, smem, out_ref):
    """The epilogue: a [block_k, H] result through a dead SMEM tile to HBM by TMA."""
    smem[...] = x.astype(st.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, out_ref.at[key_rows])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == P_ROLE)
  def _p_role():
    plgpu.set_max_registers(st.registers, action="increase")
    plgpu.copy_gmem_to_smem(k_ref.at[kv_rows], k_smem, k_bar)
    plgpu.barrier_wait(k_bar)

    def step(i, g, masked: bool, dv_acc, exact: bool):
      slot = slot_of(i, g)
      h = kvh * g_size + g
      plgpu.barrier_wait(q_bar.at[slot])

      def scores(s_acc):
        wgmma(s_acc, k_smem, q_smem.at[slot], tb=True)  # S^T = K_j Q_i^T [keys, rows]
        s_t = wgmma_load(s_acc)
        plgpu.barrier_wait(rows_bar.at[slot])
        row_r = plgpu.load(rows_smem.at[slot, 0], layout=plgpu.Layout.WGMMA.reduce(0))
        row_u = None
        if exact:
          row_u = plgpu.load(rows_smem.at[slot, 1], layout=plgpu.Layout.WGMMA.reduce(0))
        modifies = variant is not None and variant.modifies_scores
        deriv = None
        if modifies:
          s_t, deriv = vr.scores(s_t, st.scale, h, i * bq, k0, transposed=True, derivative=True)
        p_t = probabilities(s_t, row_r, row_u, 1.0 if modifies else c, exact=exact,
                            bcast=bcast_cols)
        keep = keep_of(i, h) if masked else None
        if keep is not None:
          p_t = jnp.where(keep, p_t, 0.0)
        pd_t = p_t
        if deriv is not None:  # masked pairs: no 0 * NaN from the derivative
          pd_t = p_t * deriv if keep is None else jnp.where(keep, p_t * deriv, 0.0)
        return p_t.astype(st.dtype), pd_t

      p16, pd_t = accumulators(scores, tile)
      plgpu.barrier_wait(pd_empty)  # the dS warpgroup has read the last step's tile
      pd_smem[...] = pd_t
      plgpu.commit_smem()
      plgpu.barrier_arrive(pd_full)
      plgpu.barrier_wait(do_bar.at[slot])
      wgmma(dv_acc, p16, do_smem.at[slot])  # dV_j += P^T dO_i
      wgmma_wait(0)
      plgpu.barrier_arrive(free.at[slot])

    def finish(exact: bool):
      def body(dv_acc):
        query_loop(functools.partial(step, dv_acc=dv_acc, exact=exact), dv_acc)
        return wgmma_load(dv_acc)

      dv = accumulators(body, (bk, st.value_head_dim))
      plgpu.barrier_wait(pd_empty)  # the last read: every arrival is waited once
      # K_j is dead (only this warpgroup reads it); its own tile where K_j is another width
      store(dv, k_smem if out_smem is None else out_smem[1], dv_ref)

    # The form of P, per CTA (kernels/sm90/dkdv.py); only this warpgroup computes P.
    per_cta_choice(st.p_form, lambda: exact_ref[b, kvh * g_size] != 0, finish)

  @pl.when(wg == DS_ROLE)
  def _ds_role():
    plgpu.set_max_registers(st.registers, action="increase")
    plgpu.copy_gmem_to_smem(v_ref.at[kv_rows], v_smem, v_bar)
    plgpu.barrier_wait(v_bar)
    plgpu.barrier_arrive(pd_empty)  # the exchange tile starts free

    def step(i, g, masked: bool, dk_acc):
      slot = slot_of(i, g)
      h = kvh * g_size + g
      plgpu.barrier_wait(do_bar.at[slot])

      def d_probs(dp_acc):
        wgmma(dp_acc, v_smem, do_smem.at[slot], tb=True)  # dP^T = V_j dO_i^T
        return wgmma_load(dp_acc)

      dp_t = accumulators(d_probs, tile)
      if variant is not None and masked and (keep := keep_of(i, h)) is not None:
        dp_t = jnp.where(keep, dp_t, 0.0)  # masked pairs: no 0 * NaN from dP
      plgpu.barrier_wait(delta_bar.at[slot])
      delta = plgpu.load(delta_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
      plgpu.barrier_wait(pd_full)
      pd_t = plgpu.load(pd_smem, layout=plgpu.Layout.WGMMA)
      plgpu.barrier_arrive(pd_empty)
      ds16 = (pd_t * (dp_t - bcast_cols(delta, dp_t.shape))).astype(st.dtype)  # eq. 4
      plgpu.barrier_wait(q_bar.at[slot])
      wgmma(dk_acc, ds16, q_smem.at[slot])  # dK_j += dS^T Q_i
      wgmma_wait(0)
      plgpu.barrier_arrive(free.at[slot])

    def body(dk_acc):
      query_loop(functools.partial(step, dk_acc=dk_acc), dk_acc)
      return wgmma_load(dk_acc)

    dk = accumulators(body, (bk, st.head_dim))
    # V_j is dead (only this warpgroup reads it); its own tile where V_j is another width
    store(dk * st.scale, v_smem if out_smem is None else out_smem[0], dk_ref)

  @pl.when(wg == 2)
  def _producer():
    plgpu.set_max_registers(st.memory_registers, action="decrease")
    stream_queries(q_ref, do_ref, rows_ref, delta_ref, q_smem, do_smem, rows_smem, delta_smem, q_bar,
                   do_bar, rows_bar, delta_bar, free, b=b, kvh=kvh, group=g_size, i_start=i_start,
                   n_i=n_i, block_q=bq, stages=stages)


@kernel_call(('scale', 'is_causal', 'seq_q', 'seq_k', 'cfg', 'emulate', 'variant', 'names',
              'kv_copies'))
def dkv_roles_call(q, k, v, do, rows, delta, exact, *extras, scale, is_causal, seq_q, seq_k,
                   cfg: MosaicConfig, emulate=False, variant=None, names=(), kv_copies=1):
  """``(dk, dv)`` ``[B, S_hbm, K * kv_copies, H]`` of the role-split kernel; operands as
  ``dkdv.dkv_call``."""
  b, t_hbm, n, h = q.shape
  s_hbm, kh, hv = k.shape[1], k.shape[2] * kv_copies, v.shape[3]
  bq, bk, stages = cfg.block_q_dkv, cfg.block_k_dkv, cfg.num_stages_dkv
  n_k_tiles = -(-s_hbm // bk)
  st = _Roles(scale=scale, is_causal=is_causal, seq_q=seq_q, seq_k=seq_k, group=n // kh,
              head_dim=h, value_head_dim=hv, block_q=bq, block_k=bk, num_stages=stages, dtype=q.dtype,
              registers=cfg.registers(2), memory_registers=cfg.memory_registers, n_heads=kh,
              n_bh=b * kh, n_k_tiles=n_k_tiles,
              section=causal_section(cfg, n_bh=b * kh, group=1, dkv=True,
                                     kv_bytes=t_hbm * (h + hv) * q.dtype.itemsize * (n // kh)),
              variant=variant, names=names, p_form=cfg.p_form(variant), kv_copies=kv_copies)
  # Q/K tiles take H's swizzle, V/dO tiles Hv's (a wgmma's SMEM operands share one: dV from P^T in
  # registers and dO; dP^T from V and dO; dK from dS^T in registers and Q)
  tf, tfv = smem_transforms(h), smem_transforms(hv)
  scratch = dict(
      k_smem=plgpu.SMEM((bk, h), k.dtype, transforms=tf),
      v_smem=plgpu.SMEM((bk, hv), v.dtype, transforms=tfv),
      q_smem=plgpu.SMEM((stages, bq, h), q.dtype, transforms=tf),
      do_smem=plgpu.SMEM((stages, bq, hv), do.dtype, transforms=tfv),
      rows_smem=plgpu.SMEM((stages, 2, bq), jnp.float32),
      delta_smem=plgpu.SMEM((stages, bq), jnp.float32),
      pd_smem=plgpu.SMEM((bk, bq), jnp.float32, transforms=smem_transforms_f32(bq)),
      k_bar=plgpu.Barrier(), v_bar=plgpu.Barrier(),
      q_bar=plgpu.Barrier(num_barriers=stages),
      do_bar=plgpu.Barrier(num_barriers=stages),
      rows_bar=plgpu.Barrier(num_barriers=stages),
      delta_bar=plgpu.Barrier(num_barriers=stages),
      free=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
      pd_full=plgpu.Barrier(), pd_empty=plgpu.Barrier(),
  )
  if hv != h:
    scratch["out_smem"] = (plgpu.SMEM((bk, h), k.dtype, transforms=tf),
                           plgpu.SMEM((bk, hv), v.dtype, transforms=tfv))
  out_type = (out_struct((b, s_hbm, kh, h), k.dtype, q), out_struct((b, s_hbm, kh, hv), v.dtype, q))
  return tuple(ws_kernel(
      functools.partial(_roles_kernel, st=st), out_type=out_type, scratch=scratch,
      grid=(b, kh, n_k_tiles), grid_names=("b", "h", "k"), num_consumers=2,
      name="fa2_mosaic_dkdv_roles",
  )(q, k, v, do, rows, delta, exact, *extras))
