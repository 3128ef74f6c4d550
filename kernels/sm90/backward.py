"""FlashAttention-2 backward (paper Alg. 2) as Pallas Mosaic GPU kernels for Hopper (sm90).

1. ``delta = rowsum(dO ∘ O)`` (Alg. 2 line 4, the ``D_i`` of eq. 4) is a memory-bound row reduction:
   one fused XLA op computes it (minus the lse cotangent, if any) before the kernels, and others the
   rows' inputs from the forward's row statistics (``kernels/softmax.py``): a head whose rows all
   stay below ``|r c| = 2^10`` recomputes ``P = exp2(S*c - t)``, one FMA per element; any other head
   (a per-CTA choice, from the ``[B, N]`` flag ``exact_heads``) the exact ``P = exp2((S - r)*c - u)``
   (``MosaicConfig.backward_p``: or one form for every head, compiled alone).
2. **dK/dV kernel** (``dkdv.py``) — grid ``(batch, KV head, key tile)`` (FA2 §3.2: parallel over the *key* sequence,
   so no two CTAs write the same dK/dV rows and no atomics are needed). Each consumer warpgroup owns 64
   keys: ``K_j, V_j`` sit in SMEM, ``dK_j, dV_j`` in f32 registers (wgmma accumulators). A producer
   warpgroup streams ``Q_i, dO_i, (r, u)_i, delta_i`` tiles through a ``num_stages`` SMEM ring (TMA,
   barriers, ``setmaxnreg``), and each consumer recomputes, in the transposed orientation so that every
   product has the warpgroup's 64 keys as wgmma's M dimension:
       S^T = K_j Q_i^T,  P^T = exp2(S^T*c - t_i)                (Alg. 2 lines 9-11, P recomputed)
       dV_j += P^T dO_i                                           (line 12)
       dP^T = V_j dO_i^T,  dS^T = P^T ∘ (dP^T − delta_i)           (lines 13-14)
       dK_j += dS^T Q_i                                           (line 16)
   GQA/MQA: the loop runs over the ``G = N / K`` query heads of the KV head *inside* the kernel, so dK/dV
   are summed over the group on chip and written once per KV head (no XLA sum, no [B, S, N, H] buffer).
   A large group on few KV heads leaves SMs idle (MQA 32/1 at 8k: 64 CTAs on 132 SMs, each looping
   over 32 heads): :func:`group_split` then splits each group over ``r`` CTAs, which read the same
   KV head (the grid's head axis is ``K*r``, the group's heads split in ``r`` runs) and write ``r``
   partial dK/dV (``[B, S, K*r, H]``) that one XLA sum (f32) reduces.
   For head_dim > 128 two 64 x H f32 accumulators do not fit in one warpgroup's registers: the
   default there is ``dkdv_roles.py`` (``MosaicConfig.dkv_roles``), whose two consumers share 64 keys
   and split each step by role (S^T, P^T, dV | dP^T, dS^T, dK).
3. **dQ kernel** (``dq.py``; deterministic; FA2 writes dQ with atomic adds, here a separate pass with grid
   ``(batch, head, query tile)`` owns each dQ_i and loops over key tiles, recomputing S, P, dP, dS — the
   structure of the forward): ``dQ_i += dS K_j`` (line 15), no atomics, bit-identical across runs. At
   head_dim 256 the default is ``dq_roles.py`` (``MosaicConfig.dq_roles``): two consumers share 64
   query rows by role (S, P | dP, dS), each adding half of dQ's columns.

4. **Fused dQ** (``MosaicConfig.dq_fused``, only when the caller allows a
   non-deterministic backward): the dK/dV kernel also stages ``dS^T`` in SMEM, computes
   ``dS_ij K_j`` with wgmma and adds it to an f32 ``[B, T, N, H]`` dQ accumulator in HBM by TMA
   reduce-add (the paper's atomic-add dQ, Alg. 2 line 15, on Hopper's bulk-copy unit), so S and dP are
   computed once instead of twice and the dQ kernel is skipped. The two consumers split each step's
   dQ tile (``dq_split``) so every element is reduce-added once per step (with one partial per
   consumer it had measured slower than the separate dQ kernel at head_dim 128 on an H200). The
   default for head_dim 64/128 calls with ``deterministic=False`` and enough query rows
   (``MosaicConfig.fuses_dq``).

Causal (§3.1 "causal masking"): the dK/dV loop starts at the first query tile that reaches the CTA's
keys and only tiles straddling the diagonal run the masked body; the dQ loop stops at the diagonal.
The softmax scale multiplies dK and dQ once at the end (dS stays unscaled in the loops). A row with no
allowed key (an attention variant) gets u = +inf: its recomputed P is 0, not NaN.
Padded/out-of-bounds rows: Q, dO, (r, u) and delta read as zero there, which makes their P^T dO and
dS^T Q contributions exactly zero; padded keys have K = V = 0 and are masked in the dQ kernel.
"""
from __future__ import annotations

import math

import jax.numpy as jnp

from ..backend import accumulate_dq
from ..block_ranges import kv_range_table, q_range_table
from ..softmax import backward_rows, exact_heads, exponent_scale
from .config import WG_ROWS, MosaicConfig, supports
from .dkdv import dkv_call
from .dkdv_roles import dkv_roles_call
from .dq import dq_call
from .dq_roles import dq_roles_call
from .lengths import pad_axis, plan_lengths
from .ops import emulating, sm_count
from .variant import operands as variant_operands
from .variant import supported as variant_supported
from .variant import zero_padding


# --- entry point -------------------------------------------------------------------------------------

def backward_tiles(cfg: MosaicConfig) -> tuple[int, int]:
  """(query, key) extents that every backward kernel's tiles divide: the HBM padding unit."""
  q_tile = math.lcm(cfg.dq_rows(), cfg.block_q_dkv)
  return q_tile, math.lcm(cfg.block_k_dq, cfg.dkv_keys())


def prologue(out, do, stats, dlse=None, *, scale: float, modifies_scores: bool = False,
             group: int = 1, p_form: str = "per_head"):
  """The kernels' row inputs, computed by XLA before them: ``delta [B, N, T]`` f32, the rows'
  ``[B, N, 2, T]`` f32 and the heads that need the exact form of P, ``[B, N]`` int32
  (``kernels/softmax.py``: ``backward_rows``, ``exact_heads``). ``p_form``
  (``MosaicConfig.p_form``): with ``"exact"`` or ``"fast"`` every head's rows take that form and the
  kernels do not read the flag.

  Alg. 2 line 4: ``D_i = rowsum(dO_i ∘ O_i)`` (minus the lse cotangent, if any). A multiply + row sum
  rather than an einsum, which XLA may turn into a TF32 dot on GPU.
  """
  delta = jnp.swapaxes(jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), axis=-1), 1, 2)
  if dlse is not None:
    delta = delta - dlse.astype(jnp.float32)
  c = exponent_scale(scale, modifies_scores)
  if p_form == "per_head":
    exact = exact_heads(stats, scale, modifies_scores, group)  # group: query heads per KV head
    return delta, backward_rows(stats, exact, c), exact
  exact = jnp.full(stats.shape[:2], p_form == "exact", jnp.int32)
  return delta, backward_rows(stats, None if p_form == "exact" else exact, c), exact


# The dK/dV grid is split until it has this many CTAs per SM: causal key tiles differ in work (the
# last tiles see the fewest query rows), so two CTAs per SM let the scheduler even them out ...
SPLIT_CTAS_PER_SM = 2
# ... and until a CTA loops over at most this many query heads: a long loop per CTA (7 or 8 heads)
# leaves the causal tail uneven even on a full grid, while at 4 or 5 heads the split's partial dK/dV
# and their f32 sums cost more than they even out (docs/measurements.md#dkdv-group-split).
SPLIT_HEADS_PER_CTA = 5


def group_split(batch: int, kv_heads: int, group: int, key_ctas: int, sms: int) -> int:
  """CTAs per GQA group of the dK/dV kernel: the smallest divisor ``r`` of ``group`` with ``batch *
  kv_heads * r * key_ctas >= SPLIT_CTAS_PER_SM * sms`` and ``group / r <= SPLIT_HEADS_PER_CTA``
  (``group`` itself where no divisor reaches both: one head per CTA). 1 for a grid that fills the
  GPU with short loops already (GQA 32/8)."""
  for r in range(1, group + 1):
    if (group % r == 0 and batch * kv_heads * r * key_ctas >= SPLIT_CTAS_PER_SM * sms
        and group // r <= SPLIT_HEADS_PER_CTA):
      return r
  return group


def backward(q, k, v, out, stats, do, *, dlse=None, scale: float, is_causal: bool,
             deterministic: bool = True, config: MosaicConfig | None = None, variant=None,
             arrays=None, tables=None, split_groups: bool = True, dq_accumulator=None):
  """Gradients of attention w.r.t. q, k, v on Hopper.

  Args:
    q: ``[B, T, N, H]``; out, do: ``[B, T, N, Hv]``; k: ``[B, S, K, H]``; v: ``[B, S, K, Hv]`` (Hv:
      the value head_dim, MLA's other than H); stats: ``[B, N, 2, T]`` f32, the row statistics of
      :func:`forward`.
    dlse: optional cotangent of lse ``[B, N, T]``: since d lse_i / d S_ij = P_ij it enters as
      ``dS = P ∘ (dP − (D − dlse))``, i.e. it is subtracted from delta.
    deterministic: True guarantees the separate dQ kernel (no atomics, bit-identical across runs).
      False allows the fused dQ where ``config.fuses_dq`` says so (TMA reduce-adds).
    dq_accumulator: None, or float32 ``[B, T, N, H]``, a running sum of dQ / scale (the kernels'
      unscaled ``sum dS K``, a ring's over its steps): returned in place of dQ with this call's
      dQ / scale added, by the fused dQ's reduce-adds themselves where it runs (no zero-filled
      accumulator, no scaling and rounding pass), else by an add.
    split_groups: split large GQA groups over several dK/dV CTAs where the grid is small
      (:func:`group_split`).

  Returns:
    ``dq, dk, dv`` in the dtypes of q, k, v (dk/dv already summed over each GQA group).
  """
  reason = supports(q.shape, k.shape, q.dtype, q.shape[-1], is_causal, value_head_dim=v.shape[-1])
  if reason is not None:
    raise ValueError(f"fa2_jax mosaic backward: {reason}")
  b, t, n, h = q.shape
  s, hv = k.shape[1], v.shape[-1]
  cfg = config or MosaicConfig.default(h, q.dtype, is_causal, value_head_dim=hv)
  if (why := cfg.check(h, q.dtype.itemsize, hv)) is not None:
    raise ValueError(why)
  q_tile, k_tile = backward_tiles(cfg)
  plan = plan_lengths(t, s, q_tile=q_tile, k_tile=k_tile, mode=cfg.ragged)
  kh = k.shape[2]
  r = 1
  if split_groups:
    r = group_split(b, kh, n // kh, -(-plan.s_hbm // cfg.dkv_keys()), sm_count())
  dq, dk, dv = _backward(q, k, v, out, stats, do, dlse=dlse, scale=float(scale),
                         is_causal=bool(is_causal), deterministic=deterministic, cfg=cfg,
                         plan=plan, variant=variant, arrays=arrays, tables=tables,
                         dq_accumulator=dq_accumulator, kv_copies=r)
  if r == 1:
    return dq, dk, dv

  # Query head n reads KV head n // G; its dK/dV CTA is split c = n // (G / r) of that head, whose
  # partial dK/dV sums its run of G / r heads, each partial rounded to K's dtype; their sum (in f32,
  # then rounded) is dK/dV.
  def merge(g, like):
    # Elementwise adds in a fixed order (no reduction, whose order a GPU may vary): bit-identical
    # across runs, as deterministic=True promises.
    parts = g.reshape(b, s, kh, r, g.shape[-1]).astype(jnp.float32)
    total = parts[:, :, :, 0]
    for i in range(1, r):
      total = total + parts[:, :, :, i]
    return total.astype(like.dtype)

  return dq, merge(dk, k), merge(dv, v)


def _backward(q, k, v, out, stats, do, *, dlse, scale: float, is_causal: bool, deterministic: bool,
              cfg: MosaicConfig, plan, variant, arrays, tables, dq_accumulator, kv_copies: int):
  """:func:`backward`'s kernels for one ``kv_copies``, the CTAs per GQA group of the dK/dV kernel
  (:func:`group_split`): with more than one, dk and dv are the ``[B, S, K * kv_copies, H]``
  partials."""
  t, n = q.shape[1], q.shape[2]
  s, kh = k.shape[1], k.shape[2]
  if variant is not None:  # padded rows read as zeros (kernels/sm90/variant.py, zero_padding)
    q, do = zero_padding(q, arrays.q_lengths), zero_padding(do, arrays.q_lengths)
    k, v = zero_padding(k, arrays.kv_lengths), zero_padding(v, arrays.kv_lengths)
  delta, row_inputs, exact = prologue(out, do, stats, dlse, scale=scale, modifies_scores=(
      variant is not None and variant.modifies_scores), group=n // (kh * kv_copies),
      p_form=cfg.p_form(variant))
  # Zero rows past T: the padded query rows then contribute exactly nothing (see module docstring).
  delta = pad_axis(delta, 2, plan.t_rows)
  row_inputs = pad_axis(row_inputs, 3, plan.t_rows)
  do = do.astype(q.dtype)
  qp, dop = pad_axis(q, 1, plan.t_hbm), pad_axis(do, 1, plan.t_hbm)
  kp, vp = pad_axis(k, 1, plan.s_hbm), pad_axis(v, 1, plan.s_hbm)
  per_row = (row_inputs, delta, exact)  # every backward kernel's row operands, after Q, K, V, dO

  common = dict(scale=scale, is_causal=is_causal, seq_q=t, cfg=cfg, emulate=emulating())
  if variant is not None:
    return _variant_backward(qp, kp, vp, dop, per_row, variant, arrays, plan=plan,
                             tables=tables or {}, deterministic=deterministic,
                             dq_accumulator=dq_accumulator, kv_copies=kv_copies, **common)
  if cfg.fuses_dq(t, deterministic=deterministic):
    init = _accumulator_operand(dq_accumulator, plan.t_hbm)
    dk, dv, dq_acc = dkv_call(qp, kp, vp, dop, *per_row, *init, fused_dq=True, seq_k=s,
                              accumulate=bool(init), kv_copies=kv_copies, **common)
    dq = dq_acc[:, :t] if init else (dq_acc[:, :t] * scale).astype(q.dtype)
    if plan.pad_s:
      dk, dv = dk[:, :s], dv[:, :s]
    return dq, dk, dv
  if cfg.dkv_roles:
    dk, dv = dkv_roles_call(qp, kp, vp, dop, *per_row, scale=scale, is_causal=is_causal, seq_q=t,
                            seq_k=s, cfg=cfg, emulate=emulating(), kv_copies=kv_copies)
  else:
    dk, dv = dkv_call(qp, kp, vp, dop, *per_row, kv_copies=kv_copies, **common)
  if cfg.dq_roles:
    dq = dq_roles_call(qp, kp, vp, dop, *per_row, scale=scale, is_causal=is_causal, seq_k=s,
                       cfg=cfg, seq_q=t, emulate=emulating())
  else:
    dq = dq_call(qp, kp, vp, dop, *per_row, scale=scale, is_causal=is_causal, seq_k=s, cfg=cfg,
                 emulate=emulating())
  if plan.pad_t:
    dq = dq[:, :t]
  if plan.pad_s:
    dk, dv = dk[:, :s], dv[:, :s]
  return accumulate_dq(dq_accumulator, dq, scale), dk, dv


def _accumulator_operand(dq_accumulator, t_hbm: int) -> tuple:
  """``()``, or the accumulator's rows padded to the kernels' ``t_hbm`` as the fused kernel's last
  operand."""
  if dq_accumulator is None:
    return ()
  return (pad_axis(dq_accumulator.astype(jnp.float32), 1, t_hbm),)


def _variant_backward(qp, kp, vp, dop, per_row, variant, arrays, *, plan, tables, scale,
                      is_causal, seq_q, cfg, emulate, deterministic, dq_accumulator=None,
                      kv_copies=1):
  """The backward kernels of an attention variant, each reading the range table of its own tiles:
  dK/dV with the fused dQ where ``cfg.fuses_dq`` allows it (``dq_fused_variants``), else the separate
  dK/dV and dQ kernels."""
  b, t_hbm, n, h = qp.shape
  s_hbm = kp.shape[1]
  t, s = plan.t, plan.s
  dims = dict(batch=b, heads=n, seq_q=t, seq_k=s)
  q_tile, k_tile = backward_tiles(cfg)
  t_pad, s_pad = -(-t_hbm // q_tile) * q_tile, -(-s_hbm // k_tile) * k_tile  # segment-id padding

  def inputs(table, n_tiles):
    if (why := variant_supported(variant, table.shape[1])) is not None:
      raise NotImplementedError(f"fa2_jax mosaic backward: {why}")
    table = jnp.pad(table, ((0, 0), (0, 0), (0, n_tiles - table.shape[2]), (0, 0)))
    return variant_operands(variant, arrays, table, t_pad=t_pad, s_pad=s_pad)

  common = dict(scale=scale, is_causal=is_causal, cfg=cfg, emulate=emulate, variant=variant)

  def dkv(fused_dq=False, init=()):
    cols = cfg.dkv_keys()  # keys per CTA
    table = tables.get("dkv")
    if table is None:
      table = q_range_table(variant, arrays, block_q=cfg.block_q_dkv, block_k=cols, **dims)
    ops, names = inputs(table, -(-s_hbm // cols))
    if cfg.dkv_roles:
      return dkv_roles_call(qp, kp, vp, dop, *per_row, *ops, scale=scale, is_causal=is_causal,
                            seq_q=seq_q, seq_k=s, cfg=cfg, emulate=emulate, variant=variant,
                            names=names, kv_copies=kv_copies)
    return dkv_call(qp, kp, vp, dop, *per_row, *ops, *init, seq_q=seq_q, seq_k=s, names=names,
                    fused_dq=fused_dq, accumulate=bool(init), kv_copies=kv_copies, **common)

  if cfg.fuses_dq(t, deterministic=deterministic, variant=True):
    init = _accumulator_operand(dq_accumulator, t_hbm)
    dk, dv, dq_acc = dkv(fused_dq=True, init=init)
    dq = dq_acc[:, :t] if init else (dq_acc[:, :t] * scale).astype(qp.dtype)
    return dq, dk[:, :s], dv[:, :s]
  dk, dv = dkv()
  rows = cfg.dq_rows()  # query rows per dQ CTA
  table = tables.get("dq")
  if table is None:
    table = kv_range_table(variant, arrays, block_q=rows, block_k=cfg.block_k_dq, **dims)
  ops, names = inputs(table, -(-t_hbm // rows))
  if cfg.dq_roles:
    dq = dq_roles_call(qp, kp, vp, dop, *per_row, *ops, seq_k=s, seq_q=seq_q, names=names, **common)
  else:
    dq = dq_call(qp, kp, vp, dop, *per_row, *ops, seq_k=s, seq_q=seq_q, names=names, **common)
  return accumulate_dq(dq_accumulator, dq[:, :t], scale), dk[:, :s], dv[:, :s]


__all__ = ["backward", "backward_tiles", "group_split", "WG_ROWS"]
