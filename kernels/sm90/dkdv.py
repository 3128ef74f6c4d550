"""The dK/dV kernel of the Hopper backward (paper Alg. 2), optionally with the fused dQ.

Grid ``(batch, KV head, key tile)`` (FA2 §3.2: parallel over the *key* sequence, so no two CTAs write
the same dK/dV rows and no atomics are needed). Each consumer warpgroup owns 64 keys: ``K_j, V_j`` sit
in SMEM, ``dK_j, dV_j`` in f32 registers (wgmma accumulators). A producer warpgroup streams ``Q_i, dO_i,
r_i, u_i, delta_i`` tiles through a ``num_stages`` SMEM ring (TMA, barriers, ``setmaxnreg``), and each
consumer recomputes, in the transposed orientation so that every product has the warpgroup's 64 keys
as wgmma's M dimension::

    S^T = K_j Q_i^T,  P^T = exp2(S^T*c - t_i)                (Alg. 2 lines 9-11, P from the forward's
                                                               row statistics: kernels/softmax.py;
                                                               exp2((S^T - r_i)*c - u_i) for a head
                                                               with huge logits)
    dV_j += P^T dO_i                                           (line 12)
    dP^T = V_j dO_i^T,  dS^T = P^T ∘ (dP^T − delta_i)           (lines 13-14)
    dK_j += dS^T Q_i                                           (line 16)

GQA/MQA: the loop runs over the ``G = N / K`` query heads of the KV head *inside* the kernel, so dK/dV
are summed over the group on chip and written once per KV head. For head_dim > 128 two 64 x H f32
accumulators do not fit in one warpgroup's registers: ``dkdv_roles.py`` (the default there) splits
each step between two warpgroups by role.

Fused dQ (``fused_dq``): the kernel also stages ``dS^T`` in SMEM, computes ``dS_ij K_j`` with wgmma and
adds it to an f32 ``[B, T, N, H]`` dQ accumulator in HBM by TMA reduce-add (see ``backward.py``).

Each product is issued asynchronously and awaited only where its result is needed (``ops.wgmma``,
``ops.wgmma_load(wait_n)``); dK_j and dV_j are accumulators held across the whole query loop. With the
fused dQ the step follows FlashAttention-3's order: S^T and dP^T issued together, P^T computed while
dP^T runs; dS^T staged, dV issued and the consumers' barrier passed while it runs; the dQ product and
dK issued, the dQ piece awaited and sent to its reduce-add while dK runs. Without it, dP^T is issued
after the softmax with dV behind it (measured faster there; docs/design.md#the-backwards-step-order).
An attention variant reads its query-tile range from the call's table (``kernels/sm90/variant.py``).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..masking import Variant, allowed
from ..softmax import probabilities
from ..vma import out_struct

from .config import LOG2E, MosaicConfig, dq_piece, dq_split
from .lowering_cache import kernel_call
from .ops import (acc_loop, accumulators, batch_rule, bcast_cols, consumers_sync, iota2,
                  per_cta_choice, smem_transforms, smem_transforms_f32, wgmma, wgmma_load, wgmma_wait,
                  ws_kernel)
from .schedule import causal_section, cta_tile, over_query_ranges, q_block_ranges
from .variant import Refs


# --- dK / dV ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Dkv:
  scale: float
  is_causal: bool
  seq_q: int  # true T
  group: int
  head_dim: int
  value_head_dim: int  # V's, dO's and dV's (MLA: other than head_dim)
  block_q: int  # rows of each streamed Q/dO tile
  block_k: int  # keys per consumer warpgroup (64)
  num_stages: int
  num_wgs: int
  dtype: object
  registers: int
  memory_registers: int
  emulate: bool = False
  n_heads: int = 1  # K * kv_copies (the grid's head axis)
  n_bh: int = 1  # B * n_heads
  n_k_tiles: int = 1
  section: int = 1  # causal launch order: KV heads per LPT section (schedule.lpt_tile)
  # A GQA group split over kv_copies CTAs (backward.group_split): grid head c reads KV head
  # c // kv_copies, runs that group's query heads [c * group, (c + 1) * group) and writes its partial
  # dK/dV at head c of [B, S, K * kv_copies, H] (summed by the caller).
  kv_copies: int = 1
  # dQ inside this kernel (FA2 Alg. 2 line 15 with the paper's accumulation across key blocks): each
  # step's dS_ij K_j goes to an f32 HBM accumulator by a TMA reduce-add (no separate dQ kernel, so S
  # and dP are computed once instead of twice; not bit-reproducible: the adds' order varies).
  fused_dq: bool = False
  # How the fused dQ_i contribution of a CTA ([block_q, H] over all its num_wgs * block_k keys) is cut
  # among the consumers: "cols" (each consumer H / num_wgs columns), "rows" (block_q / num_wgs rows)
  # or None (each consumer its own keys' full [block_q, H] partial: num_wgs reduce-adds of the same
  # rows). See dq_split.
  dq_split: str | None = None
  seq_k: int = 0  # true S (keys past it are zero fill: a variant's mask excludes them, fused dQ masks dS)
  variant: Variant | None = None  # an attention variant beyond is_causal (kernels/sm90/variant.py)
  names: tuple[str, ...] = ()  # its operands, after delta
  # Order of a step's products: dP^T issued right behind S^T, so the softmax runs while dP^T is in
  # flight (FA3's order), or issued after the softmax together with dV (then dV runs while dS is formed).
  dp_early: bool = True
  # The form of P (MosaicConfig.p_form): "per_head" (both forms compiled, one per CTA by exact_ref),
  # "exact" or "fast" (one loop).
  p_form: str = "per_head"


def kv_head(head, kv_copies: int):
  """The KV head that grid head ``head`` reads when each group is split over ``kv_copies`` CTAs."""
  return head if kv_copies == 1 else lax.div(head, jnp.array(kv_copies, head.dtype))


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, rows_ref, delta_ref, exact_ref, *refs, k_smem, v_smem,
                q_smem,
                do_smem, rows_smem, delta_smem, k_bar, v_bar, q_bar, do_bar, rows_bar, delta_bar,
                free, ds_smem=None, dq_smem=None, ds_bar=None, dq_acc_ref=None,
                st: _Dkv):
  # q_ref: [B, T, N, H], do_ref: [B, T, N, Hv]; k_ref: [B, S, K, H], v_ref: [B, S, K, Hv] (Hv: the value
  # head_dim, MLA's other than H); rows_ref: [B, N, 2, T_rows] the rows'
  # (r, u) (kernels/softmax.py, backward_rows); delta_ref: [B, N, T_rows]; exact_ref: [B, N] int32,
  # the heads whose rows need the exact P (kernels/softmax.py, exact_heads)
  # outputs: dk_ref [B, S, K * kv_copies, H], dv_ref [B, S, K * kv_copies, Hv] (partials of a split
  # group: _Dkv.kv_copies).
  # fused_dq: dq_acc_ref [B, T, N, H] f32, zero-initialised by the caller (a closed-over ref, so it is
  # aliased in and out of the kernel); emulation: [n_k_tiles * num_wgs, B, T, N, H], one slab per
  # consumer, summed by the caller (Pallas' GPU interpreter has no TMA reduce-add).
  # ds_smem [2, num_wgs, block_k, block_q]: dS^T per consumer, double-buffered by step parity so a
  # consumer can write step i+1's tile while the other still reads step i's (dq_split);
  # dq_smem [num_wgs, rows, cols]: each consumer's f32 dQ piece, the source of its reduce-add.
  # Then the variant operands named by st.names (kernels/sm90/variant.py).
  var_refs, out_refs = refs[:len(st.names)], refs[len(st.names):]
  bq, bk, nwg, stages, g_size = st.block_q, st.block_k, st.num_wgs, st.num_stages, st.group
  variant = st.variant
  c = st.scale * LOG2E
  dk_ref, dv_ref = out_refs
  # Causal: the first key tiles see the most queries, launch them first (LPT).
  b, kvh, kt = cta_tile("k", is_causal=st.is_causal, n_heads=st.n_heads, n_tiles=st.n_k_tiles,
                        n_bh=st.n_bh, section=st.section, longest_last=False)
  wg = lax.axis_index("wg")
  cta_k0 = kt * (nwg * bk)
  if variant is None:
    q_ranges = q_block_ranges(cta_k0, nwg * bk, block_q=bq, seq_q=st.seq_q, is_causal=st.is_causal)
  else:  # the call's range table (fa2_jax.kernels.block_ranges), the same for producer and consumers
    vr = Refs(variant, st.names, var_refs, b, seq_k=st.seq_k)
    q_ranges = vr.ranges(kt)
  i_start, nq = q_ranges[0], q_ranges[-1]  # the first query tile and one past the last
  n_i = nq - i_start  # query tiles per group head (traced when causal)
  # Fused dQ over a ragged key extent: the last key tile's rows past S are zero K, where the fast
  # form's P = exp2(-t) is not bounded (it overflows for a row whose logits are all below -128 in
  # base 2), and its dS^T times those zero rows of K would be NaN in dQ. The separate dQ kernel
  # masks them itself; dK and dV of those keys are cut off by the caller.
  k_tail = st.n_k_tiles * nwg * bk > st.seq_k  # key tiles overhang S
  key_tail = variant is None and st.fused_dq and st.seq_k > 0 and k_tail
  # Variants: rows past T only in a partial last query tile (the range table stops at T).
  q_tail = st.seq_q % bq != 0

  rows_q, cols_q = dq_piece(bq, st.head_dim, nwg) if st.fused_dq else (0, 0)

  def dq_dst(i, g, w):
    """The fused dQ accumulator's block that consumer ``w``'s piece of query tile ``i``, group head
    ``g`` adds into (emulation: that consumer's own slab, summed by the caller)."""
    h = kvh * g_size + g
    r0 = i * bq + w * rows_q if st.dq_split == "rows" else i * bq
    dq_rows = (b, pl.ds(r0, rows_q), h)
    if st.dq_split == "cols":
      dq_rows += (pl.ds(w * cols_q, cols_q),)
    if st.emulate:
      return dq_acc_ref.at[(kt * nwg + w,) + dq_rows]
    return dq_acc_ref.at[dq_rows]

  def reduce_add(src, dst):
    plgpu.copy_smem_to_gmem(src, dst, reduction_op=None if st.emulate else "add")

  @pl.when(wg < nwg)
  def _consumer():
    plgpu.set_max_registers(st.registers, action="increase")
    k0 = cta_k0 + wg * bk
    k_s = k_smem.at[wg]
    rows = (b, pl.ds(k0, bk), kvh)  # this CTA's dK/dV rows (its partial's, with kv_copies)
    kv_rows = (b, pl.ds(k0, bk), kv_head(kvh, st.kv_copies))
    plgpu.copy_gmem_to_smem(k_ref.at[kv_rows], k_s, k_bar.at[wg])
    v_s = v_smem.at[wg]
    plgpu.copy_gmem_to_smem(v_ref.at[kv_rows], v_s, v_bar.at[wg])
    plgpu.barrier_wait(k_bar.at[wg])
    plgpu.barrier_wait(v_bar.at[wg])

    hd = st.head_dim
    split = st.dq_split

    def store_ds(idx, ds16):
      """Fused dQ: dS^T [keys, rows] to SMEM (double-buffered by step parity, so a consumer can write
      step i+1's tile while the other still reads step i's), where the dQ wgmma reads it transposed.
      Not yet fenced: the caller issues dV first, then ``commit_smem`` (FA3's order)."""
      par = lax.rem(idx, jnp.array(2, idx.dtype))
      ds_smem.at[par, wg][...] = ds16
      return par

    def fused_dq_step(par, i, g, ds16, q_t, dk_acc):
      """The fused dQ_i += dS_ij K_j (Alg. 2 line 15) and dK_j += dS^T Q_i (line 16): both issued, dQ
      awaited while dK runs, then its piece leaves by TMA reduce-add into the f32 HBM accumulator."""
      if split is None:  # this consumer's keys only: A = (dS^T)^T [rows, keys], B = K_j [keys, H]
        terms = [(ds_smem.at[par, wg], k_s)]
      else:  # both consumers' keys (wait until both dS^T tiles are in SMEM)
        consumers_sync(ds_bar.at[0])
        if split == "cols":
          terms = [(ds_smem.at[par, w], k_smem.at[w, :, pl.ds(wg * cols_q, cols_q)])
                   for w in range(nwg)]
        else:
          terms = [(ds_smem.at[par, w, :, pl.ds(wg * rows_q, rows_q)], k_smem.at[w])
                   for w in range(nwg)]

      def dq_piece_of_step(dq_acc):
        for a, b_ in terms:
          wgmma(dq_acc, a, b_, ta=True)
        wgmma(dk_acc, ds16, q_t)  # dK_j += dS^T Q_i, in flight while the dQ piece is stored
        return wgmma_load(dq_acc, wait_n=1)

      dq_part = accumulators(dq_piece_of_step, (rows_q, cols_q))
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last reduce-add has read dq_smem
      dq_smem.at[wg][...] = dq_part
      plgpu.commit_smem()
      reduce_add(dq_smem.at[wg], dq_dst(i, g, wg))

    def step(i, g, masked: bool, dk_acc, dv_acc, exact: bool):
      """One query tile: FA3's order of products, each awaited only where its result is needed."""
      idx = g * n_i + (i - i_start)
      slot = lax.rem(idx, jnp.array(stages, idx.dtype))
      q_t = q_smem.at[slot]
      do_t = do_smem.at[slot]
      h = kvh * g_size + g
      plgpu.barrier_wait(q_bar.at[slot])

      def scores(s_acc, dp_acc=None):
        """S^T = K_j Q_i^T and dP^T = V_j dO_i^T issued back to back; P^T (Alg. 2 lines 9-11, from the
        forward's row statistics) is computed while dP^T is still in flight."""
        wgmma(s_acc, k_s, q_t, tb=True)  # [keys, rows]
        if dp_acc is not None:
          plgpu.barrier_wait(do_bar.at[slot])
          wgmma(dp_acc, v_s, do_t, tb=True)  # line 13
        s_t = wgmma_load(s_acc, wait_n=0 if dp_acc is None else 1)
        plgpu.barrier_wait(rows_bar.at[slot])
        row_r = plgpu.load(rows_smem.at[slot, 0], layout=plgpu.Layout.WGMMA.reduce(0))
        row_u = None  # the fast form reads t alone (kernels/softmax.py, backward_rows)
        if exact:
          row_u = plgpu.load(rows_smem.at[slot, 1], layout=plgpu.Layout.WGMMA.reduce(0))
        modifies = variant is not None and variant.modifies_scores
        deriv = keep = None
        if modifies:
          s_t, deriv = vr.scores(s_t, st.scale, h, i * bq, k0, transposed=True, derivative=True)
        # P^T as the forward had it (kernels/softmax.py, backward_rows and exact_heads)
        p_t = probabilities(s_t, row_r, row_u, 1.0 if modifies else c, exact=exact,
                            bcast=bcast_cols)
        if masked:
          if variant is None:
            k_pos = k0 + iota2((bk, bq), 0)
            q_pos = i * bq + iota2((bk, bq), 1)
            keep = allowed(q_pos, k_pos, is_causal=st.is_causal)
          else:
            keep = vr.keep((bk, bq), h, i * bq, k0, seq_q=st.seq_q if q_tail else None,
                           seq_k=st.seq_k if k_tail else None, transposed=True)
          if keep is not None:
            p_t = jnp.where(keep, p_t, 0.0)
        # P^T times d s_out / d s_in (soft cap / score_fn) now, while P^T is at hand: only this
        # product and P^T's bf16 copy stay live until dS^T, not P^T and the derivative both
        pd_t = p_t if deriv is None else p_t * deriv
        dp_t = None if dp_acc is None else wgmma_load(dp_acc)
        if variant is not None and keep is not None and dp_t is not None:
          # dS^T's mask on its two factors here, so that the mask need not stay live until dS^T:
          # masked pairs get P^T d = 0 and dP^T = 0, no 0 * NaN from dP or the derivative
          if deriv is not None:
            pd_t = jnp.where(keep, pd_t, 0.0)
          dp_t = jnp.where(keep, dp_t, 0.0)
          keep = None
        return p_t.astype(st.dtype), pd_t, keep, dp_t

      tile = (bk, bq)
      early = st.dp_early
      p16, pd_t, keep, dp_t = accumulators(scores, *([tile, tile] if early else [tile]))
      if not early:  # dP^T issued now, dV_j += P^T dO_i behind it: dV runs while dS^T is formed
        plgpu.barrier_wait(do_bar.at[slot])

        def dp_then_dv(dp_acc):
          wgmma(dp_acc, v_s, do_t, tb=True)  # line 13
          wgmma(dv_acc, p16, do_t)  # line 12
          return wgmma_load(dp_acc, wait_n=1)

        dp_t = accumulators(dp_then_dv, tile)
      plgpu.barrier_wait(delta_bar.at[slot])
      delta = plgpu.load(delta_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
      # dS^T = P^T ∘ (dP^T − D_i) (eq. 4), times d s_out / d s_in through a soft cap or score_fn
      ds_t = pd_t * (dp_t - bcast_cols(delta, dp_t.shape))
      if variant is not None and keep is not None:  # (dP^T issued late) masked pairs: no 0 * NaN
        ds_t = jnp.where(keep, ds_t, 0.0)  # from dP or the derivative
      if key_tail:  # keys past S (zero K rows) leave dS^T as 0: no inf * 0 in the fused dS K
        ds_t = jnp.where(k0 + iota2(tile, 0) < st.seq_k, ds_t, 0.0)
      ds16 = ds_t.astype(st.dtype)
      par = store_ds(idx, ds16) if st.fused_dq else None
      if early:
        # dV_j += P^T dO_i (line 12), in flight from here on; issued before dS^T's fence, which
        # orders nothing it reads (P^T in registers, dO_i loaded by TMA)
        wgmma(dv_acc, p16, do_t)
      if st.fused_dq:
        plgpu.commit_smem()  # dS^T visible to the dQ wgmma (async proxy)
        fused_dq_step(par, i, g, ds16, q_t, dk_acc)
      else:
        wgmma(dk_acc, ds16, q_t)  # dK_j += dS^T Q_i  (line 16)
      wgmma_wait(0)
      plgpu.barrier_arrive(free.at[slot])  # all wgmmas reading this slot have completed

    def over_queries(g, dk_acc, dv_acc, exact):
      loop = functools.partial(acc_loop, accs=(dk_acc, dv_acc))
      masked = functools.partial(step, g=g, masked=True, dk_acc=dk_acc, dv_acc=dv_acc, exact=exact)
      unmasked = functools.partial(step, g=g, masked=False, dk_acc=dk_acc, dv_acc=dv_acc,
                                   exact=exact)
      over_query_ranges(loop, masked, unmasked, q_ranges)

    def all_queries(dk_acc, dv_acc, *, exact):
      """dK_j, dV_j accumulated in registers over every query tile (and GQA group head)."""
      body = functools.partial(over_queries, dk_acc=dk_acc, dv_acc=dv_acc, exact=exact)
      if g_size == 1:
        body(jnp.int32(0))
      else:
        acc_loop(0, g_size, body, (dk_acc, dv_acc))  # GQA: sum over the head group
      return wgmma_load(dk_acc), wgmma_load(dv_acc)

    def finish(exact: bool):
      """The query loop and the epilogue, in the exact or the fast form of P (one per CTA)."""
      dk, dv = accumulators(functools.partial(all_queries, exact=exact), (bk, hd),
                            (bk, st.value_head_dim))
      epilogue(dk, dv)

    def epilogue(dk, dv):
      if st.fused_dq and split is not None:  # the other consumer's last dQ wgmma has read our K_j
        consumers_sync(ds_bar.at[0])
      # K_j / V_j are dead: reuse their SMEM to stage the results for the TMA store.
      k_s[...] = (dk * st.scale).astype(st.dtype)
      v_s[...] = dv.astype(st.dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(k_s, dk_ref.at[rows], commit_group=False)
      plgpu.copy_smem_to_gmem(v_s, dv_ref.at[rows], commit_group=False)
      plgpu.commit_smem_to_gmem_group()
      plgpu.wait_smem_to_gmem(0)

    # Per head: exact when any head of the group has a row past the fast form's range (the flag is
    # the group's, on each of its heads: exact_heads). Read at the branch: read before the K_j / V_j
    # waits it made the fused kernel 0.68x at head_dim 64 (docs/design.md, "Softmax form").
    per_cta_choice(st.p_form, lambda: exact_ref[b, kvh * g_size] != 0, finish)

  @pl.when(wg == nwg)
  def _producer():
    plgpu.set_max_registers(st.memory_registers, action="decrease")
    stream_queries(q_ref, do_ref, rows_ref, delta_ref, q_smem, do_smem, rows_smem, delta_smem, q_bar,
                   do_bar, rows_bar, delta_bar, free, b=b, kvh=kvh, group=g_size, i_start=i_start,
                   n_i=n_i, block_q=bq, stages=stages)


def stream_queries(q_ref, do_ref, rows_ref, delta_ref, q_smem, do_smem, rows_smem, delta_smem, q_bar,
                   do_bar, rows_bar, delta_bar, free, *, b, kvh, group: int, i_start, n_i,
                   block_q: int, stages: int):
  """The producer warpgroup of the dK/dV kernels: TMA each step's ``Q_i``, the rows' ``(r, u)_i``,
  ``dO_i`` and ``delta_i`` into a ``stages``-deep SMEM ring, over the query tiles ``[i_start,
  i_start + n_i)`` of each of the ``group`` query heads of grid head ``kvh`` (the KV head, or with
  a split group its partial: ``_Dkv.kv_copies``).

  Slot ``step % stages`` is refilled once every consumer has arrived on its ``free`` barrier for the
  step ``stages`` back; the drain at the end observes the consumers' last releases (as
  ``ops.stream_kv``)."""
  n_steps = n_i * group

  @pl.loop(0, n_steps)
  def _(idx):
    slot = lax.rem(idx, jnp.array(stages, idx.dtype))
    g = lax.div(idx, n_i)
    i = i_start + lax.rem(idx, n_i)
    h = kvh * group + g  # query head g of this KV head's group
    rows = (b, pl.ds(i * block_q, block_q), h)
    row_span = (b, h, pl.ds(i * block_q, block_q))  # this tile's rows of delta (and of r, u)

    @pl.when(idx >= stages)
    def _():
      plgpu.barrier_wait(free.at[slot])

    plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[slot], q_bar.at[slot])
    plgpu.copy_gmem_to_smem(rows_ref.at[b, h, :, pl.ds(i * block_q, block_q)], rows_smem.at[slot],
                            rows_bar.at[slot])
    plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[slot], do_bar.at[slot])
    plgpu.copy_gmem_to_smem(delta_ref.at[row_span], delta_smem.at[slot], delta_bar.at[slot])

  @pl.loop(jnp.maximum(n_steps - stages, 0), n_steps)  # drain (see ops.stream_kv)
  def _(idx):
    plgpu.barrier_wait(free.at[lax.rem(idx, jnp.array(stages, idx.dtype))])


# jit: one lowering per distinct kernel in a program (see _COMPILE_NOTE in ops.py); one per process
# with the lowering cache on (lowering_cache.py).
@kernel_call(('scale', 'is_causal', 'seq_q', 'cfg', 'emulate', 'fused_dq', 'seq_k', 'variant',
              'names', 'accumulate', 'kv_copies'))
def dkv_call(q, k, v, do, rows, delta, exact, *extras, scale, is_causal, seq_q, cfg: MosaicConfig,
             emulate, fused_dq=False, seq_k=0, variant=None, names=(), accumulate=False,
             kv_copies=1):
  # accumulate (with fused_dq): the last operand is the dQ accumulator's initial value, float32
  # [B, t_hbm, N, H] (the caller's running sum of dS K, unscaled), which the reduce-adds continue in
  # place of a zero-filled one.
  # kv_copies: each GQA group split over that many CTAs (_Dkv.kv_copies); dK and dV are then
  # [B, S, K * kv_copies, H] partials.
  if accumulate:
    assert fused_dq, "accumulate needs the fused dQ"
    *extras, dq_init = extras
  b, t_hbm, n, h = q.shape
  s_hbm, kh, hv = k.shape[1], k.shape[2] * kv_copies, v.shape[3]
  bq, bk, stages, num_wgs = cfg.block_q_dkv, cfg.block_k_dkv, cfg.num_stages_dkv, cfg.num_wgs_dkv
  n_k_tiles = -(-s_hbm // (num_wgs * bk))
  st = _Dkv(scale=scale, is_causal=is_causal, seq_q=seq_q, group=n // kh, head_dim=h,
            value_head_dim=hv, block_q=bq,
            block_k=bk, num_stages=stages, num_wgs=num_wgs, dtype=q.dtype,
            registers=cfg.registers(num_wgs), memory_registers=cfg.memory_registers, emulate=emulate,
            fused_dq=fused_dq, dq_split=dq_split(bq, h, num_wgs) if fused_dq else None, n_heads=kh,
            n_bh=b * kh, n_k_tiles=n_k_tiles,
            section=causal_section(cfg, n_bh=b * kh, group=1, dkv=True,
                                   kv_bytes=t_hbm * (h + hv) * q.dtype.itemsize * (n // kh)),
            seq_k=seq_k, variant=variant, names=names, dp_early=fused_dq,
            p_form=cfg.p_form(variant), kv_copies=kv_copies)
  # Q/K tiles (and dS^T, which meets K in the fused dQ product) take H's swizzle, V/dO tiles Hv's: a
  # wgmma's SMEM operands share one (dV: P^T from registers, dO; dP^T: V, dO; dK: dS^T, Q)
  tf, tfv = smem_transforms(h), smem_transforms(hv)
  scratch = dict(
      k_smem=plgpu.SMEM((num_wgs, bk, h), k.dtype, transforms=tf),
      v_smem=plgpu.SMEM((num_wgs, bk, hv), v.dtype, transforms=tfv),
      q_smem=plgpu.SMEM((stages, bq, h), q.dtype, transforms=tf),
      do_smem=plgpu.SMEM((stages, bq, hv), do.dtype, transforms=tfv),
      rows_smem=plgpu.SMEM((stages, 2, bq), jnp.float32),
      delta_smem=plgpu.SMEM((stages, bq), jnp.float32),
      k_bar=plgpu.Barrier(num_barriers=num_wgs),
      v_bar=plgpu.Barrier(num_barriers=num_wgs),
      q_bar=plgpu.Barrier(num_barriers=stages),
      do_bar=plgpu.Barrier(num_barriers=stages),
      rows_bar=plgpu.Barrier(num_barriers=stages),
      delta_bar=plgpu.Barrier(num_barriers=stages),
      free=plgpu.Barrier(num_arrivals=num_wgs, num_barriers=stages),
  )
  if fused_dq:
    rows_q, cols_q = dq_piece(bq, h, num_wgs)
    scratch["ds_smem"] = plgpu.SMEM((2, num_wgs, bk, bq), q.dtype, transforms=tf)
    scratch["dq_smem"] = plgpu.SMEM((num_wgs, rows_q, cols_q), jnp.float32,
                                    transforms=smem_transforms_f32(cols_q))
    # The consumers' meeting before the dS^T exchange (ops.consumers_sync)
    if st.dq_split is not None:
      scratch["ds_bar"] = plgpu.Barrier(num_arrivals=num_wgs, num_barriers=1)
  dk_shape, dv_shape = (b, s_hbm, kh, h), (b, s_hbm, kh, hv)
  out_type = [out_struct(dk_shape, k.dtype, q), out_struct(dv_shape, v.dtype, q)]

  def launch(out_type, operands, **extra):
    return ws_kernel(
        functools.partial(_dkv_kernel, st=st, **extra), out_type=tuple(out_type), scratch=scratch,
        grid=(b, kh, n_k_tiles), grid_names=("b", "h", "k"), num_consumers=num_wgs,
        name="fa2_mosaic_dkdv" + ("_dq" if fused_dq else ""),
    )(*operands)

  operands = (q, k, v, do, rows, delta, exact, *extras)
  if not fused_dq:
    return tuple(launch(out_type, operands))
  # The dQ accumulator is a ref the kernel closes over: Pallas passes its zero-filled initial value in
  # and aliases it to the output, which a TMA reduce-add needs (a kernel's own outputs start
  # uninitialised). dK and dV are the kernel's own outputs, which it writes whole, stored into the
  # state's refs (no zero-filled buffers aliased to them: two such buffers of equal shape and dtype
  # are one value to XLA).
  acc_shape = (b, t_hbm, n, h) if not emulate else (n_k_tiles * num_wgs, b, t_hbm, n, h)

  @jax.custom_batching.custom_vmap
  def fused(*operands):
    *kernel_operands, init = operands if accumulate else (*operands, None)

    def stateful(refs):
      acc_ref, dk_ref, dv_ref = refs
      dk_ref[...], dv_ref[...] = launch(out_type, kernel_operands, dq_acc_ref=acc_ref)

    # The emulation's per-CTA partials start at zero and are summed (then the initial value added).
    start = init if init is not None and not emulate else jnp.zeros(acc_shape, jnp.float32)
    acc, dk, dv = pl.run_state(stateful)((start, jnp.empty(dk_shape, k.dtype),
                                          jnp.empty(dv_shape, v.dtype)))
    if emulate:
      acc = acc.sum(axis=0) if init is None else init + acc.sum(axis=0)
    return dk, dv, acc

  @fused.def_vmap
  def _vmap(axis_size, in_batched, *args):
    # run_state has no batching rule: every operand has B first (the variant operands too), so the
    # vmapped axis folds into B (ops.batch_rule)
    call = functools.partial(dkv_call, scale=scale, is_causal=is_causal, seq_q=seq_q, cfg=cfg,
                             emulate=emulate, fused_dq=True, seq_k=seq_k, variant=variant, names=names,
                             accumulate=accumulate, kv_copies=kv_copies)
    return batch_rule(call, axis_size, in_batched, args, variant)

  return fused(*operands, *([dq_init] if accumulate else []))
