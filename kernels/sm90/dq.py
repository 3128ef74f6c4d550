"""The separate dQ kernel of the Hopper backward (paper Alg. 2 line 15, deterministic).

Grid ``(batch, head, query tile)``: each CTA owns ``dQ_i`` and loops over key tiles, recomputing S, P,
dP and dS (the structure of the forward), ``dQ_i += dS K_j``; no atomics, bit-identical across runs.
A producer warpgroup streams ``K_j, V_j`` (``ops.stream_kv``). An attention variant reads its key-tile
range from the call's table (``kernels/sm90/variant.py``).
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
                  smem_transforms, step_loop, ws_kernel, zeros as _zeros)
from .schedule import causal_section, cta_tile, kv_block_ranges
from .variant import Refs


# --- dQ ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Dq:
  scale: float
  is_causal: bool
  seq_k: int  # true S
  group: int
  head_dim: int
  block_q: int  # rows per consumer warpgroup (64)
  block_k: int
  num_stages: int
  num_wgs: int
  n_q_tiles: int
  dtype: object
  registers: int
  memory_registers: int
  emulate: bool = False
  n_heads: int = 1  # N
  n_bh: int = 1  # B * N
  section: int = 1  # causal launch order: heads per LPT section (schedule.lpt_tile)
  seq_q: int = 0  # true T
  variant: Variant | None = None  # an attention variant beyond is_causal (kernels/sm90/variant.py)
  names: tuple[str, ...] = ()  # its operands, after delta
  p_form: str = "per_head"  # the form of P (as in dkdv.py's _Dkv)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, rows_ref, delta_ref, exact_ref, *refs, q_smem, do_smem,
               rows_smem, delta_smem, k_smem, v_smem, q_bar, do_bar, rows_bar, delta_bar, k_bar,
               v_bar, k_free, v_free, st: _Dq):
  # rows_ref: [B, N, 2, T_rows] f32, the rows' (r, u) (kernels/softmax.py, backward_rows); delta_ref:
  # [B, N, T_rows]; exact_ref: [B, N] int32, the heads whose rows need the exact P (kernels/softmax.py,
  # exact_heads). Then the variant operands named by st.names, then dq_ref [B, T, N, H]. do_ref and
  # v_ref are [.., Hv] (the value head_dim), q_ref and k_ref [.., H].
  var_refs, (dq_ref,) = refs[:len(st.names)], refs[len(st.names):]
  bq, bk, nwg, stages = st.block_q, st.block_k, st.num_wgs, st.num_stages
  variant = st.variant
  c = st.scale * LOG2E
  # Causal: the last query tiles see the most keys, launch them first (LPT).
  b, h, qt = cta_tile("q", is_causal=st.is_causal, n_heads=st.n_heads, n_tiles=st.n_q_tiles,
                      n_bh=st.n_bh, section=st.section, longest_last=True)
  wg = lax.axis_index("wg")
  kvh = lax.div(h, jnp.array(st.group, h.dtype))
  cta_row0 = qt * (nwg * bq)
  if variant is None:
    lo = 0
    n_full, n_end = kv_block_ranges(cta_row0, nwg * bq, block_k=bk, seq_k=st.seq_k,
                                    is_causal=st.is_causal)
  else:  # the call's range table (fa2_jax.kernels.block_ranges), the same for producer and consumers
    vr = Refs(variant, st.names, var_refs, b, seq_k=st.seq_k)
    lo, full_lo, full_hi, n_end = vr.ranges(qt)
  key_tail = st.seq_k % bk != 0
  q_tail = st.n_q_tiles * nwg * bq > st.seq_q  # rows past T in the last query tiles

  @pl.when(wg < nwg)
  def _consumer():
    plgpu.set_max_registers(st.registers, action="increase")
    row0 = cta_row0 + wg * bq
    rows = (b, pl.ds(row0, bq), h)
    row_span = (b, h, pl.ds(row0, bq))  # this tile's rows of delta (and of r, u)
    q_s, do_s = q_smem.at[wg], do_smem.at[wg]
    plgpu.copy_gmem_to_smem(q_ref.at[rows], q_s, q_bar.at[wg])
    plgpu.copy_gmem_to_smem(do_ref.at[rows], do_s, do_bar.at[wg])
    plgpu.copy_gmem_to_smem(rows_ref.at[b, h, :, pl.ds(row0, bq)], rows_smem.at[wg],
                            rows_bar.at[wg])
    plgpu.copy_gmem_to_smem(delta_ref.at[row_span], delta_smem.at[wg], delta_bar.at[wg])
    for bar in (q_bar, do_bar, rows_bar, delta_bar):
      plgpu.barrier_wait(bar.at[wg])
    row_r = plgpu.load(rows_smem.at[wg, 0], layout=plgpu.Layout.WGMMA.reduce(1))
    row_u = plgpu.load(rows_smem.at[wg, 1], layout=plgpu.Layout.WGMMA.reduce(1))
    delta = plgpu.load(delta_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))

    def step(j, dq, masked: bool, exact: bool):
      slot = lax.rem(j - lo, jnp.array(stages, j.dtype))
      k_t, v_t = k_smem.at[slot], v_smem.at[slot]
      plgpu.barrier_wait(k_bar.at[slot])
      plgpu.barrier_wait(v_bar.at[slot])

      # S = Q_i K_j^T and dP = dO_i V_j^T, both in flight, one wait.
      s, dp = mma_many([Product((bq, bk), q_s, k_t, tb=True), Product((bq, bk), do_s, v_t, tb=True)])
      plgpu.barrier_arrive(v_free.at[slot])
      deriv = keep = None
      modifies = variant is not None and variant.modifies_scores
      if modifies:
        s, deriv = vr.scores(s, st.scale, h, row0, j * bk, derivative=True)
      # P_ij as the forward had it (kernels/softmax.py, backward_rows and exact_heads)
      p = probabilities(s, row_r, row_u, 1.0 if modifies else c, exact=exact, bcast=bcast_rows)
      if masked:
        if variant is None:
          q_pos = row0 + iota2((bq, bk), 0)
          k_pos = j * bk + iota2((bq, bk), 1)
          keep = allowed(q_pos, k_pos, is_causal=st.is_causal,
                         seq_k=st.seq_k if key_tail else None)
        else:
          keep = vr.keep((bq, bk), h, row0, j * bk, seq_q=st.seq_q if q_tail else None,
                         seq_k=st.seq_k if key_tail else None)
        if keep is not None:
          p = jnp.where(keep, p, 0.0)
      ds = p * (dp - bcast_rows(delta, dp.shape))  # dS = P ∘ (dP − D_i)
      if deriv is not None:
        ds = ds * deriv  # through soft cap / score_fn
      if variant is not None and keep is not None:
        ds = jnp.where(keep, ds, 0.0)  # masked pairs: no 0 * NaN from dP or the derivative
      ds16 = ds.astype(st.dtype)

      dq = mma((bq, st.head_dim), ds16, k_t, init=dq)  # dQ_i += dS_ij K_j (line 15, no atomics)
      plgpu.barrier_arrive(k_free.at[slot])
      return dq

    def finish(exact: bool):
      """The key loop and the store of dQ_i, in the exact or the fast form of P (one per CTA)."""
      dq = _zeros((bq, st.head_dim))
      masked = functools.partial(step, masked=True, exact=exact)
      unmasked = functools.partial(step, masked=False, exact=exact)
      if variant is None:
        dq = step_loop(0, n_full, unmasked, dq)
        dq = step_loop(n_full, n_end, masked, dq)
      else:  # in the producer's order
        dq = step_loop(lo, full_lo, masked, dq)
        dq = step_loop(full_lo, full_hi, unmasked, dq)
        dq = step_loop(full_hi, n_end, masked, dq)
      q_s[...] = (dq * st.scale).astype(st.dtype)  # Q_i is dead: stage dQ_i in its SMEM
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_s, dq_ref.at[rows])
      plgpu.wait_smem_to_gmem(0)

    per_cta_choice(st.p_form, lambda: exact_ref[b, h] != 0, finish)  # as in dkdv.py

  pl.when(wg == nwg)(functools.partial(
      kv_producer, st.memory_registers, k_ref=k_ref, v_ref=v_ref, k_smem=k_smem, v_smem=v_smem,
      k_bar=k_bar, v_bar=v_bar, k_free=k_free, v_free=v_free, b=b, kvh=kvh, n_end=n_end,
      block_k=bk, stages=stages, start=lo))


@kernel_call(('scale', 'is_causal', 'seq_k', 'cfg', 'emulate', 'seq_q', 'variant', 'names'))
def dq_call(q, k, v, do, rows, delta, exact, *extras, scale, is_causal, seq_k, cfg: MosaicConfig, emulate,
             seq_q=0, variant=None, names=()):
  b, t_hbm, n, h = q.shape
  kh, hv = k.shape[2], v.shape[3]
  bq, bk, stages, nwg = cfg.block_q_dq, cfg.block_k_dq, cfg.num_stages_dq, cfg.num_wgs_dq
  n_q_tiles = -(-t_hbm // (nwg * bq))
  st = _Dq(scale=scale, is_causal=is_causal, seq_k=seq_k, group=n // kh, head_dim=h, block_q=bq,
           block_k=bk, num_stages=stages, num_wgs=nwg, n_q_tiles=n_q_tiles, dtype=q.dtype,
           registers=cfg.registers(nwg), memory_registers=cfg.memory_registers,
           emulate=emulate, n_heads=n, n_bh=b * n,
           section=causal_section(cfg, n_bh=b * n, group=n // kh,
                                  kv_bytes=k.shape[1] * (h + hv) * k.dtype.itemsize),
           seq_q=seq_q, variant=variant, names=names, p_form=cfg.p_form(variant))
  # Q/K tiles take H's swizzle, dO/V tiles Hv's (the value head_dim; S = Q K^T and dP = dO V^T each
  # pair one)
  tf, tfv = smem_transforms(h), smem_transforms(hv)
  scratch = dict(
      q_smem=plgpu.SMEM((nwg, bq, h), q.dtype, transforms=tf),
      do_smem=plgpu.SMEM((nwg, bq, hv), do.dtype, transforms=tfv),
      rows_smem=plgpu.SMEM((nwg, 2, bq), jnp.float32),
      delta_smem=plgpu.SMEM((nwg, bq), jnp.float32),
      k_smem=plgpu.SMEM((stages, bk, h), k.dtype, transforms=tf),
      v_smem=plgpu.SMEM((stages, bk, hv), v.dtype, transforms=tfv),
      q_bar=plgpu.Barrier(num_barriers=nwg),
      do_bar=plgpu.Barrier(num_barriers=nwg),
      rows_bar=plgpu.Barrier(num_barriers=nwg),
      delta_bar=plgpu.Barrier(num_barriers=nwg),
      k_bar=plgpu.Barrier(num_barriers=stages),
      v_bar=plgpu.Barrier(num_barriers=stages),
      k_free=plgpu.Barrier(num_arrivals=nwg, num_barriers=stages),
      v_free=plgpu.Barrier(num_arrivals=nwg, num_barriers=stages),
  )
  return ws_kernel(
      functools.partial(_dq_kernel, st=st), out_type=out_struct(q.shape, q.dtype, q),
      scratch=scratch, grid=(b, n, n_q_tiles), grid_names=("b", "h", "q"), num_consumers=nwg,
      name="fa2_mosaic_dq",
  )(q, k, v, do, rows, delta, exact, *extras)
