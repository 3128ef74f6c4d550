"""FlashAttention-2 forward (paper Alg. 1) as a Pallas Mosaic GPU kernel for Hopper (sm90).

Structure of one CTA (grid ``(batch, head, query tile)``, FA2 §3.2: parallel over batch, heads *and*
the sequence, so 8k tokens x 16 heads x batch 2 give 1024 CTAs for 132 SMs):

* ``num_wgs`` (2) **consumer warpgroups**, each owning 64 whole query rows of the CTA's
  ``2 x 64``-row tile (FA2 §3.3 "split-Q" warp partitioning, lifted to warpgroups: the row max, row sum
  and the ``O`` accumulator of a row live in one warpgroup, so no cross-warpgroup reduction or SMEM
  exchange is ever needed). Each loads its ``Q_i`` once by TMA, then for every key tile issues
  ``S = Q_i K_j^T`` and ``O += P V_j`` as ``wgmma`` with f32 register accumulators.
* one **producer warpgroup** that only issues TMA copies of ``K_j, V_j`` into a ``num_stages``-deep
  SMEM ring: a slot is refilled once both consumers have arrived on its "free" barrier, and consumers
  wait on its "full" barrier (TMA completes it with the byte count). ``setmaxnreg`` moves registers from
  the producer to the consumers (``MosaicConfig.registers``: 24 and 240 in the defaults). This is the Hopper form of FA2's "load K_j, V_j to SRAM"
  (Alg. 1 line 6) overlapped with compute.
* Online softmax (Alg. 1 lines 8-10) with the *unscaled* accumulator (§3.1.1 tweak 1: ``O`` is
  rescaled by ``exp(m_old - m_new)`` only, and divided by ``l`` once at the end, line 12), exp2 with the
  softmax scale folded into one FMA (§3.1), and, instead of the lse of §3.1.1 tweak 2 (line 13), two
  floats per row saved for the backward: ``stats [B, N, 2, T]`` f32, the row's raw maximum and its
  sum relative to that maximum's weight (``kernels/softmax.py``; the lse follows from them in XLA).
* Causal (§3.1 "causal masking"): key tiles wholly above the diagonal are never loaded (the loop ends at
  ``n_end``); only tiles straddling the diagonal (and the ragged key tail) run the masked body.
* ``pingpong`` (optional, default on): FlashAttention-3's inter-warpgroup schedule, after JAX's
  ``jax/experimental/pallas/ops/gpu/attention_mgpu.py``: a 2-arrival barrier makes the two consumers
  alternate, so one's softmax overlaps the other's matmuls.

Ideas reused from JAX's ``attention_mgpu.py`` (Apache-2.0), re-written here: the producer/consumer
barrier protocol, the ``run_scoped(ACC)`` / ``run_state(ACC.init)`` wgmma idioms and the (8, 64) tiled
+ 128-byte swizzled SMEM layout. Added here: softmax scale, ragged lengths, key-tail masking, GQA head
mapping, LPT ordering of causal tiles (across L2-sized sections of heads), and the rows' statistics for an
exact backward at any logit size (kernels/softmax.py; the natural-log lse follows in XLA).
"""
from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..block_ranges import kv_range_table, static_kv_work
from ..masking import Variant, allowed, soft_cap_tanh
from ..softmax import folded_soft_cap, huge_row_scale, row_sum_at_max
from ..vma import out_struct
from .config import LOG2E, MosaicConfig, o_rows_in_q, supports
from .lengths import pad_axis, plan_lengths
from .schedule import causal_section, cta_tile, greedy_deal, kv_block_ranges, launch_tile
from .lowering_cache import kernel_call
from .ops import (bcast_rows, drain_kv, emulating, iota2, mma, sm_count, smem_transforms, step_loop,
                  stream_kv,
                  ws_kernel)
from .variant import Refs
from .variant import operands as variant_operands
from .variant import supported as variant_supported
from .variant import zero_padding


@dataclasses.dataclass(frozen=True)
class _Fwd:
  scale: float
  is_causal: bool
  seq_q: int  # true T (rows past it are padding / TMA out-of-bounds)
  seq_k: int  # true S: keys >= seq_k are masked
  group: int  # N // K (GQA)
  head_dim: int
  value_head_dim: int  # V's and O's (MLA: other than head_dim)
  block_q: int
  block_k: int
  num_stages: int
  num_wgs: int
  pingpong: bool
  n_q_tiles: int
  dtype: object
  registers: int
  memory_registers: int
  emulate: bool = False  # traced for interpret mode (ops.emulated_mma); part of the cache key
  n_heads: int = 1  # N
  n_bh: int = 1  # B * N: the (batch, head) pairs of the grid
  section: int = 1  # causal launch order: heads per LPT section (schedule.lpt_tile)
  n_ctas: int = 0  # persistent: CTAs that share the query tiles (MosaicConfig.persistent); 0: one per tile
  dealt: bool = False  # persistent: the tiles of each CTA from a deal table (schedule.greedy_deal)
  variant: Variant | None = None  # an attention variant beyond is_causal (kernels/sm90/variant.py)
  names: tuple[str, ...] = ()  # its operands, after v
  o_rows: int = 0  # rows of O's view in Q's SMEM (config.o_rows_in_q); 0: O's own SMEM


def _fwd_kernel(q_ref, k_ref, v_ref, *refs, qo_smem, k_smem, v_smem, stats_smem, q_bar, k_bar,
                v_bar, k_free, v_free, sched=None, o_smem=None, st: _Fwd):
  # q_ref: [B, T, N, H], o_ref: [B, T, N, Hv]; k_ref: [B, S, K, H], v_ref: [B, S, K, Hv] (Hv: the value
  # head_dim); stats_ref: [B, N, 2, T_rows] f32, the row statistics (r, l) of kernels/softmax.py;
  # between them the variant operands named by st.names (kernels/sm90/variant.py).
  # qo_smem: Q's tiles [nwg, bq, H], also O's staging where Hv == H; where O is narrower, a RefUnion
  # of them and an O view [nwg, st.o_rows, Hv] over the same bytes (config.o_rows_in_q); else O
  # has o_smem [nwg, bq, Hv] of its own.
  if st.o_rows not in (0, st.block_q):
    qo_smem, o_smem = qo_smem
  var_refs, refs = refs[:len(st.names)], refs[len(st.names):]
  # deal_ref [n_ctas, 1 + max tiles] int32: a CTA's tile count, then its launch positions
  deal_ref, (o_ref, stats_ref) = (refs[0], refs[1:]) if st.dealt else (None, refs)
  bq, bk, nwg, stages = st.block_q, st.block_k, st.num_wgs, st.num_stages
  variant = st.variant
  # Score modifications work on base-2 logits modify(scale * s) * log2(e): c = 1 then; a bounded
  # soft cap alone works on tanh(into * s) with c = cap * log2(e) (kernels/softmax.py,
  # folded_soft_cap), storing the base-2 logit m = r * c as the row's r.
  folded = folded_soft_cap(variant, st.scale)
  if folded is not None:
    into, c = folded
  else:
    c = 1.0 if variant is not None and variant.modifies_scores else st.scale * LOG2E
  wg = lax.axis_index("wg")
  key_tail = st.seq_k % bk != 0
  q_tail = st.n_q_tiles * nwg * bq > st.seq_q  # rows past T in the last query tiles

  def tile_plan(b, h, qt):
    """The key range of query tile ``qt`` of ``(b, h)``: ``(lo, full_lo, full_hi, n_end)``, masked
    blocks in ``[lo, full_lo)`` and ``[full_hi, n_end)``, and the variant's refs (or None)."""
    # Both consumers run the CTA's key range, so their step counts (and barrier phases) always
    # match; the first warpgroup's extra diagonal tile (if block_k < 2*block_q) is fully masked.
    if variant is None:
      n_full, n_end = kv_block_ranges(qt * (nwg * bq), nwg * bq, block_k=bk, seq_k=st.seq_k,
                                      is_causal=st.is_causal)
      return (0, 0, n_full, n_end), None
    # the range table of the call (fa2_jax.kernels.block_ranges), the same for producer and consumers
    vr = Refs(variant, st.names, var_refs, b, seq_k=st.seq_k)
    return vr.ranges(qt), vr

  def over_tiles(body):
    """``body(b, h, qt, ring_step)`` for each query tile of this CTA; returns the K/V ring's steps in
    all. One tile per CTA (grid ``(B, N, q tiles)``), or, persistent (``st.n_ctas``), the launch
    positions ``cta, cta + n_ctas, ...`` (cyclic) or those of the CTA's row of the deal table
    (``st.dealt``: schedule.greedy_deal), with the ring's steps running on across them. Causal: the
    last query tiles see the most keys, so they go first (LPT, schedule.lpt_tile)."""
    order = dict(is_causal=st.is_causal, n_heads=st.n_heads, n_tiles=st.n_q_tiles, n_bh=st.n_bh,
                 section=st.section, longest_last=True)
    if not st.n_ctas:
      return body(*cta_tile("q", **order), 0)
    cta, n_ctas, n_tiles = lax.axis_index("sm"), st.n_ctas, st.n_bh * st.n_q_tiles
    if st.dealt:  # this CTA's row of the deal table
      count = deal_ref[cta, 0]
      position = lambda i: deal_ref[cta, 1 + i]
    else:
      # n_tiles // n_ctas full rounds, then a partial one where CTA c takes position c if c < the rest
      count = n_tiles // n_ctas + (cta < n_tiles % n_ctas).astype(jnp.int32)
      position = lambda i: i * n_ctas + cta  # round i: launch positions [i * n_ctas, (i + 1) * n_ctas)

    def tile(i, ring_step):
      return ring_step + body(*launch_tile(position(i), **order), ring_step)

    return lax.fori_loop(0, count, tile, jnp.int32(0))

  def schedule():
    plgpu.barrier_arrive(sched)
    plgpu.barrier_wait(sched)

  def consumer_tile(b, h, qt, ring_step):
    (lo, full_lo, full_hi, n_end), vr = tile_plan(b, h, qt)
    q_s = qo_smem.at[wg]
    row0 = qt * (nwg * bq) + wg * bq
    plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(row0, bq), h], q_s, q_bar.at[wg])
    plgpu.barrier_wait(q_bar.at[wg])

    m_i = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    l_i = plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    acc = plgpu.layout_cast(jnp.full((bq, st.value_head_dim), 0.0, jnp.float32),
                            plgpu.Layout.WGMMA)

    if st.pingpong:
      pl.when(wg == 1)(schedule)

    def step(j, carry, masked: bool):
      acc, m_i, l_i, r_i = carry  # r_i: see below
      slot = lax.rem(ring_step + j - lo, jnp.array(stages, j.dtype))
      plgpu.barrier_wait(k_bar.at[slot])

      # S_ij = Q_i K_j^T (Alg. 1 line 8): wgmma, f32 accumulate on the tensor cores. With pingpong the
      # scheduling barrier sits between issuing the wgmma and waiting for it.
      s = mma((bq, bk), q_s, k_smem.at[slot], tb=True,
              between=schedule if st.pingpong else None)
      plgpu.barrier_arrive(k_free.at[slot])

      # Online softmax, m kept in scaled base-2 units so p = exp2(s*c - m) is one FMA per element.
      if folded is not None:
        s, _ = soft_cap_tanh(s, into, derivative=False)  # the capped logit over cap
      elif variant is not None and variant.modifies_scores:
        s, _ = vr.scores(s, st.scale, h, row0, j * bk)  # base-2 modified logits (c = 1)
      keep = None
      if masked and variant is None:
        q_pos = row0 + iota2((bq, bk), 0)
        k_pos = j * bk + iota2((bq, bk), 1)
        keep = allowed(q_pos, k_pos, is_causal=st.is_causal, seq_k=st.seq_k if key_tail else None)
      elif masked:
        keep = vr.keep((bq, bk), h, row0, j * bk, seq_q=st.seq_q if q_tail else None,
                       seq_k=st.seq_k if key_tail else None)
      # A row with no visible key yet keeps m = -inf (use 0 there, so exp2 gives 0, not NaN); a
      # score_fn may return -inf for every key of a row of an unmasked tile too.
      guard = masked or (variant is not None and variant.score_fn is not None)
      if c == 0.0:  # scale 0: every allowed logit is 0
        sc = s * c if keep is None else jnp.where(keep, s * c, -jnp.inf)
        m_new = jnp.maximum(m_i, sc.max(axis=1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp2(sc - bcast_rows(m_use, sc.shape))
      else:
        # r_i: the row's raw logit of largest s*c (an element of the row), m = r_i * c.
        sr = s if keep is None else jnp.where(keep, s, -jnp.inf if c > 0 else jnp.inf)
        r_i = jnp.maximum(r_i, sr.max(axis=1)) if c > 0 else jnp.minimum(r_i, sr.min(axis=1))
        # = r_i * c, rounded: through a max, so that no compiler contracts m_i - r_i * c (alpha
        # below) into an FMA with the product unrounded, which differs from the rounded m_i.
        m_new = jnp.maximum(m_i, r_i * c)
        r_use, m_use = r_i, m_new
        if guard:
          r_use = jnp.where(m_new == -jnp.inf, 0.0, r_i)
          m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        if folded is not None:  # |m| <= cap * log2 e <= 2^9 (fast_form_suffices): never huge
          p = jnp.exp2(sr * c - bcast_rows(m_use, sr.shape))
        else:
          c_row, t_row = huge_row_scale(r_use, m_use, c, st.dtype)  # (c, m) but for huge rows
          p = jnp.exp2(sr * bcast_rows(c_row, sr.shape) - bcast_rows(t_row, sr.shape))
      alpha = jnp.exp2(m_i - m_use)  # e^{m_old - m_new}: rescales the old state (line 10)
      acc = acc * bcast_rows(alpha, acc.shape)  # unscaled accumulator (§3.1.1 tweak 1)
      l_i = l_i * alpha
      p16 = p.astype(st.dtype)
      # Instruction order around the barriers follows attention_mgpu.py, where it was measured to
      # matter: finish the row sum before signalling for head_dim <= 128, after it otherwise.
      early_sum = st.head_dim <= 128
      if early_sum:
        l_i = l_i + p.sum(axis=1)
        if not st.emulate:
          acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))

      if st.pingpong:
        plgpu.barrier_arrive(sched)  # done with softmax
      plgpu.barrier_wait(v_bar.at[slot])
      if st.pingpong:
        plgpu.barrier_wait(sched)  # the other warpgroup has issued its S matmul: tensor cores free
      if not early_sum:
        l_i = l_i + p.sum(axis=1)

      acc = mma((bq, st.value_head_dim), p16, v_smem.at[slot], init=acc)  # O_i += P~_ij V_j (line 10)
      plgpu.barrier_arrive(v_free.at[slot])
      return acc, m_new, l_i, r_i

    masked, unmasked = functools.partial(step, masked=True), functools.partial(step, masked=False)
    carry = (acc, m_i, l_i, m_i if c >= 0 else -m_i)  # r_i: -inf, or +inf for c < 0
    # in the producer's order: [lo, full_lo) masked, [full_lo, full_hi) not, [full_hi, n_end) masked
    carry = step_loop(lo, full_lo, masked, carry)
    carry = step_loop(full_lo, full_hi, unmasked, carry)
    acc, m_i, l_i, r_i = step_loop(full_hi, n_end, masked, carry)
    if st.pingpong:
      pl.when(wg == 0)(schedule)

    # Alg. 1 line 12: O_i = diag(l_i)^-1 acc, once. Causal or dense: every row sees key 0, so l_i >= 1;
    # a variant's row may see no key (l_i = 0): output 0.
    inv_l = 1.0 / (l_i if variant is None else jnp.where(l_i == 0.0, 1.0, l_i))
    # Q_i is dead: its SMEM stages O where it fits
    if st.o_rows == bq:
      o_s = q_s
    elif st.o_rows:
      o_s = o_smem.at[wg, pl.ds(0, bq)]
    else:
      o_s = o_smem.at[wg]
    o_s[...] = (acc * bcast_rows(inv_l, acc.shape)).astype(st.dtype)
    # Line 13: the row statistics (r, l) instead of L_i = m_i + log(l_i): the lse and the backward's
    # P follow from them (kernels/softmax.py); l relative to the maximum's weight. Scale 0 works on
    # base-2 logits: r = m there, with weight 1.
    # A folded soft cap stores m = r * c (rounded) and l as summed: its backward recomputes the
    # base-2 logits, and exp2(s2 - m - log2 l) is then this kernel's P, up to the rounding of s2.
    if c != 0.0 and folded is None:
      l_i = row_sum_at_max(r_i, m_i, l_i, c, st.dtype)
    stats_smem.at[wg, 0][...] = m_i if c == 0.0 or folded is not None else r_i
    stats_smem.at[wg, 1][...] = l_i
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_s, o_ref.at[b, pl.ds(row0, bq), h], commit_group=False)
    plgpu.copy_smem_to_gmem(stats_smem.at[wg], stats_ref.at[b, h, :, pl.ds(row0, bq)],
                            commit_group=False)
    plgpu.commit_smem_to_gmem_group()
    # Persistent: the next tile's Q lands in this SMEM once the stores have read it.
    plgpu.wait_smem_to_gmem(0, wait_read_only=bool(st.n_ctas))
    return jnp.asarray(n_end - lo, jnp.int32)

  @pl.when(wg < nwg)
  def _consumer():
    plgpu.set_max_registers(st.registers, action="increase")
    over_tiles(consumer_tile)
    if st.n_ctas:
      plgpu.wait_smem_to_gmem(0)

  def producer_tile(b, h, qt, ring_step):
    (lo, _, _, n_end), _ = tile_plan(b, h, qt)
    stream_kv(k_ref=k_ref, v_ref=v_ref, k_smem=k_smem, v_smem=v_smem, k_bar=k_bar, v_bar=v_bar,
              k_free=k_free, v_free=v_free, b=b, kvh=lax.div(h, jnp.array(st.group, h.dtype)),
              n_end=n_end, block_k=bk, stages=stages, start=lo, ring_step=ring_step,
              drain=not st.n_ctas)
    return jnp.asarray(n_end - lo, jnp.int32)

  @pl.when(wg == nwg)
  def _producer():
    plgpu.set_max_registers(st.memory_registers, action="decrease")
    steps = over_tiles(producer_tile)
    if st.n_ctas:
      drain_kv(k_free, v_free, steps, stages)


def forward(q, k, v, *, scale: float, is_causal: bool, config: MosaicConfig | None = None,
            variant=None, arrays=None, table=None):
  """Attention forward on Hopper.

  Args:
    q: ``[B, T, N, H]``; k: ``[B, S, K, H]``, v: ``[B, S, K, Hv]`` (``N % K == 0``; the value head_dim
      ``Hv`` a multiple of 16 up to 256, MLA's may differ from ``H``), bfloat16 or float16.
    scale: static Python float. is_causal: top-left causal mask.
    config: a :class:`MosaicConfig`, default ``MosaicConfig.default(H)``.
    variant, arrays: an attention variant (:mod:`fa2_jax.kernels.masking`; None: dense or ``is_causal``).
    table: its precomputed range table (``config.range_tiles()["fwd"]``), or None to compute it.

  Returns:
    ``out [B, T, N, Hv]`` (q's dtype) and the row statistics ``stats [B, N, 2, T]`` float32
    (``kernels/softmax.py``: the lse is ``lse_from_stats(stats, scale, modifies_scores)``).
  """
  reason = supports(q.shape, k.shape, q.dtype, q.shape[-1], is_causal, value_head_dim=v.shape[-1])
  if reason is not None:
    raise ValueError(f"fa2_jax mosaic forward: {reason}")
  if not (q.dtype == k.dtype == v.dtype):
    raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  b, t, n, h = q.shape
  s, hv = k.shape[1], v.shape[-1]
  cfg = config or MosaicConfig.default(h, q.dtype, is_causal, value_head_dim=hv)
  if (why := cfg.check(h, q.dtype.itemsize, hv)) is not None:
    raise ValueError(why)
  rows = cfg.num_wgs * cfg.block_q
  plan = plan_lengths(t, s, q_tile=rows, k_tile=cfg.block_k, mode=cfg.ragged)
  extras, names = (), ()
  if variant is not None:
    v = zero_padding(v, arrays.kv_lengths)  # P V: a padded key's NaN must not meet P = 0
    n_tiles = -(-plan.t_hbm // rows)
    if table is None:
      table = kv_range_table(variant, arrays, batch=b, heads=n, seq_q=t, seq_k=s, block_q=rows,
                             block_k=cfg.block_k)  # [B, N', cdiv(T, rows), 4]
    if (why := variant_supported(variant, table.shape[1])) is not None:
      raise NotImplementedError(f"fa2_jax mosaic forward: {why}")
    table = jnp.pad(table, ((0, 0), (0, 0), (0, n_tiles - table.shape[2]), (0, 0)))
    k_tiles = -(-plan.s_hbm // cfg.block_k)
    extras, names = variant_operands(variant, arrays, table, t_pad=n_tiles * rows,
                                     s_pad=k_tiles * cfg.block_k)
  # A causal variant's tiles' work, where it is known at trace time (block_ranges.static_kv_work):
  # the greedy deal of a persistent forward weighs the tiles by it.
  work = None
  if variant is not None and is_causal and cfg.persistent and cfg.persistent_deal == "greedy":
    work = static_kv_work(variant, seq_q=t, seq_k=s, block_q=rows, block_k=cfg.block_k)
  return _forward_call(q, k, v, *extras, scale=float(scale), is_causal=bool(is_causal), cfg=cfg,
                       plan_t=plan.t_hbm, plan_s=plan.s_hbm, t_rows=plan.t_rows, emulate=emulating(),
                       variant=variant, names=tuple(names),
                       variant_work=None if work is None else tuple(work.tolist()))


def qo_scratch(nwg: int, block_q: int, h: int, hv: int, dtype):
  """Q's SMEM tiles ``[nwg, block_q, H]``; where O is narrower and fits (config.o_rows_in_q), a
  ``RefUnion`` of them and O's view ``[nwg, rows, Hv]``. The kernel relies on both groups of the
  union starting at its first byte (warpgroup w's O then lies in w's Q tile): Pallas places each
  group from offset 0 (``flatten_ref_union``; tests/test_mosaic_cpu.py checks it)."""
  q_tiles = plgpu.SMEM((nwg, block_q, h), dtype, transforms=smem_transforms(h))
  rows = o_rows_in_q(block_q, h, hv)
  if rows in (None, block_q):
    return q_tiles
  return plgpu.RefUnion(q_tiles, plgpu.SMEM((nwg, rows, hv), dtype, transforms=smem_transforms(hv)))


def _causal_deal(st: _Fwd, variant_work=None):
  """The greedy deal (``schedule.greedy_deal``) of a causal call's query tiles, in launch order,
  each weighing the key tiles it visits: a dense call's from ``schedule.kv_block_ranges``, a
  variant's ``variant_work`` (``fa2_jax.kernels.block_ranges.static_kv_work``: the same for every batch
  element and head)."""
  rows = st.num_wgs * st.block_q
  if variant_work is None:
    per_tile = [kv_block_ranges(qt * rows, rows, block_k=st.block_k, seq_k=st.seq_k,
                                is_causal=True)[1] for qt in range(st.n_q_tiles)]
  else:
    per_tile = list(variant_work) + [0] * (st.n_q_tiles - len(variant_work))  # tiles past T
  work = []
  for pos in range(st.n_bh * st.n_q_tiles):
    _, _, qt = launch_tile(pos, is_causal=True, n_heads=st.n_heads, n_tiles=st.n_q_tiles,
                           n_bh=st.n_bh, section=st.section, longest_last=True)
    work.append(per_tile[qt])
  return greedy_deal(work, st.n_ctas)


# jit: one lowering per distinct kernel in a program (see _COMPILE_NOTE in ops.py); one per process
# with the lowering cache on (lowering_cache.py).
@kernel_call(('scale', 'is_causal', 'cfg', 'plan_t', 'plan_s', 't_rows', 'emulate', 'variant',
              'names', 'variant_work'))
def _forward_call(q, k, v, *extras, scale, is_causal, cfg: MosaicConfig, plan_t, plan_s, t_rows,
                  emulate, variant=None, names=(), variant_work=None):
  """Pads (per the plan), launches the kernel, slices back. Returns out [B,T,N,Hv], stats [B,N,2,T]."""
  b, t, n, h = q.shape
  s, kh, hv = k.shape[1], k.shape[2], v.shape[3]
  qp = pad_axis(q, 1, plan_t)
  kp = pad_axis(k, 1, plan_s)
  vp = pad_axis(v, 1, plan_s)
  rows = cfg.num_wgs * cfg.block_q
  n_q_tiles = -(-plan_t // rows)
  # each tile's key range known at trace time: dense, or variant_work (key tiles per query tile)
  known_work = variant is None or variant_work is not None
  st = _Fwd(scale=scale, is_causal=is_causal, seq_q=t, seq_k=s, group=n // kh, head_dim=h,
            value_head_dim=hv, block_q=cfg.block_q, block_k=cfg.block_k, num_stages=cfg.num_stages,
            num_wgs=cfg.num_wgs, pingpong=cfg.pingpong and cfg.num_wgs == 2,
            n_q_tiles=n_q_tiles, dtype=q.dtype, registers=cfg.registers(cfg.num_wgs),
            memory_registers=cfg.memory_registers, emulate=emulate, n_heads=n, n_bh=b * n,
            section=causal_section(cfg, n_bh=b * n, group=n // kh,
                                   kv_bytes=plan_s * (h + hv) * q.dtype.itemsize),
            variant=variant, names=names,
            n_ctas=(min(b * n * n_q_tiles, cfg.persistent_ctas or sm_count())
                    if cfg.forward_persistent(is_causal=is_causal, known_work=known_work) else 0),
            dealt=cfg.deals_greedily(is_causal=is_causal, known_work=known_work),
            o_rows=o_rows_in_q(cfg.block_q, h, hv) or 0)
  if st.dealt:
    extras = (*extras, jnp.asarray(_causal_deal(st, variant_work)))
  tf = smem_transforms(h)
  nwg, stages = cfg.num_wgs, cfg.num_stages
  scratch = dict(
      qo_smem=qo_scratch(nwg, cfg.block_q, h, hv, q.dtype),
      k_smem=plgpu.SMEM((stages, cfg.block_k, h), k.dtype, transforms=tf),
      v_smem=plgpu.SMEM((stages, cfg.block_k, hv), v.dtype, transforms=smem_transforms(hv)),
      stats_smem=plgpu.SMEM((nwg, 2, cfg.block_q), jnp.float32),
      q_bar=plgpu.Barrier(num_barriers=nwg),
      k_bar=plgpu.Barrier(num_barriers=stages),
      v_bar=plgpu.Barrier(num_barriers=stages),
      k_free=plgpu.Barrier(num_arrivals=nwg, num_barriers=stages),
      v_free=plgpu.Barrier(num_arrivals=nwg, num_barriers=stages),
  )
  if st.pingpong:
    scratch["sched"] = plgpu.Barrier(num_arrivals=nwg)
  if not st.o_rows:  # O's staging tiles: they do not fit in Q's
    scratch["o_smem"] = plgpu.SMEM((nwg, cfg.block_q, hv), q.dtype, transforms=smem_transforms(hv))
  out, stats = ws_kernel(
      functools.partial(_fwd_kernel, st=st),
      out_type=(out_struct((*qp.shape[:3], hv), q.dtype, q),
                out_struct((b, n, 2, t_rows), jnp.float32, q)),
      scratch=scratch, num_consumers=nwg, name="fa2_mosaic_forward",
      **(dict(grid=(st.n_ctas,), grid_names=("sm",)) if st.n_ctas else
         dict(grid=(b, n, n_q_tiles), grid_names=("b", "h", "q"))),
  )(qp, kp, vp, *extras)
  if plan_t != t:
    out = out[:, :t]
  if t_rows != t:
    stats = stats[..., :t]
  return out, stats
