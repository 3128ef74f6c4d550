"""Configuration of the Mosaic GPU (Hopper) kernels: tiles, pipeline depths, warpgroups, the
shared-memory budget, the per-head_dim defaults and the support check.

Pure Python: nothing here touches a GPU, so all of it is unit-testable on CPU. The measurements behind
the defaults are in docs/design.md.

Vocabulary: a *warpgroup* (WG) is 4 warps = 128 threads, the unit that issues one ``wgmma``; a CTA of
these kernels runs ``num_wgs`` consumer WGs (tensor-core math) plus one producer WG (TMA loads).
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from ..softmax import fast_form_suffices

# exp(x) = exp2(x * log2 e): the kernels use exp2 with the softmax scale folded into the same multiply
# (FA2 §3.1: fewer non-matmul FLOPs; exp2 is a single MUFU instruction).
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

# Hopper (sm90) opt-in shared memory per block is 227 KiB; keep a little for barriers and the
# cross-warp reduction scratch Mosaic GPU reserves (CompilerParams.reduction_scratch_bytes).
SMEM_BYTES = 227 * 1024
SMEM_RESERVE = 4 * 1024

# wgmma's M is 64 rows per warpgroup; every tile side here is a multiple of 64, so the swizzle that
# tiles the head_dim (ops.smem_transforms) tiles every other side of a kernel's SMEM tiles too.
WG_ROWS = 64
WG_THREADS = 128  # a warpgroup: 4 warps of 32 threads
SM_REGISTERS = 65536  # 32-bit registers per SM on sm90
LAUNCH_REGISTERS_MAX = 248  # registers per thread a launch can give (255, in the allocation's steps of 8)


def o_rows_in_q(block_q: int, head_dim: int, value_head_dim: int) -> int | None:
  """Rows of the forward's O staging view inside Q's SMEM: a warpgroup's ``[block_q, head_dim]`` Q
  tile (dead once its last ``S`` product is read) holds its ``[block_q, value_head_dim]`` O tile as
  the first ``block_q`` rows of a ``[rows, value_head_dim]`` view of the same bytes (a
  ``plgpu.RefUnion`` of ``[wgs, block_q, head_dim]`` and ``[wgs, rows, value_head_dim]``, so each
  warpgroup's O starts where its Q does). ``block_q`` where the widths agree; None where O is wider
  or the view's rows would not be whole 8-row tiles (O then gets SMEM of its own)."""
  if value_head_dim == head_dim:
    return block_q
  if value_head_dim > head_dim or (block_q * head_dim) % (8 * value_head_dim):
    return None
  return block_q * head_dim // value_head_dim


def register_pool(threads: int) -> int:
  """The registers a CTA of ``threads`` threads holds for its life: ``setmaxnreg`` moves registers
  between its warpgroups within this pool (a warpgroup asking for more waits until another gives
  some back, so a split past the pool hangs), which is what the launch allocated: per thread the
  most that fits the SM (a multiple of 8, at most 248), times the threads. 384 threads: 168 each,
  64512."""
  return threads * min(LAUNCH_REGISTERS_MAX, SM_REGISTERS // threads // 8 * 8)
_TILE_SIDES = (64, 128, 192, 256)
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# head_dims: every multiple of 16 (the narrowest wgmma swizzle, 32 bytes, holds 16 elements of a
# 16-bit dtype) up to 256 (a 64 x 256 f32 accumulator per consumer warpgroup is the register limit).
HEAD_DIM_STEP = 16
HEAD_DIM_MAX = 256
RAGGED_MODES = ("tma", "pad")
# How the backward recomputes P (MosaicConfig.backward_p; kernels/softmax.py, docs/design.md "Softmax form")
BACKWARD_P_FORMS = ("auto", "per_head", "exact")
# How the persistent forward hands query tiles to its CTAs (MosaicConfig.persistent_deal; schedule.py)
PERSISTENT_DEALS = ("cyclic", "greedy")
# The L2 working set one section of heads may stream: H100/H200 have 50 MiB of L2; keep room for the
# outputs (and dQ's reduce-adds) passing through it (docs/design.md#causal-launch-order).
L2_SECTION_BYTES = 32 * 1024 * 1024


# --- configuration -----------------------------------------------------------------------------------

def dq_split(block_q: int, head_dim: int, num_wgs: int) -> str | None:
  """How the fused dQ's per-step ``[block_q, H]`` tile is shared by ``num_wgs`` consumers.

  A split halves (for two consumers) the f32 bytes each step reduce-adds into HBM: without it, every
  consumer adds its own keys' partial of the *same* rows, so the L2 reduction traffic is num_wgs times
  larger (that version measured slower than the separate dQ kernel: see docs/design.md#split-dq-tile).
  With it, each consumer reads both consumers' dS^T tiles (one barrier per step) and computes a
  disjoint piece over all the CTA's keys. Pieces must be whole 64-element swizzled SMEM tiles.
  """
  if num_wgs == 1:
    return None
  if head_dim % (num_wgs * WG_ROWS) == 0:
    return "cols"
  if block_q % (num_wgs * WG_ROWS) == 0:
    return "rows"
  return None


def dq_piece(block_q: int, head_dim: int, num_wgs: int) -> tuple[int, int]:
  """``(rows, cols)`` of the fused-dQ piece each consumer computes and reduce-adds per step."""
  split = dq_split(block_q, head_dim, num_wgs)
  return (block_q // num_wgs if split == "rows" else block_q,
          head_dim // num_wgs if split == "cols" else head_dim)


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
  """Tiles and pipeline settings of the Mosaic GPU kernels (paper names: ``B_r`` = block_q, ``B_c`` =
  block_k).

  Forward (Alg. 1): a CTA owns ``num_wgs * block_q`` query rows, ``block_q`` (= 64) per consumer
  warpgroup, and streams ``block_k``-key tiles of K and V through a ``num_stages``-deep SMEM ring.

  dK/dV (Alg. 2): a CTA owns ``num_wgs_dkv * block_k_dkv`` keys, ``block_k_dkv`` (= 64) per consumer
  warpgroup, and streams ``block_q_dkv``-row tiles of Q, dO, the rows' (r, u) and delta (``num_stages_dkv`` deep).
  ``dkv_roles``: the dK/dV kernel for a large head_dim (the default for head_dim > 128, where two
  64 x 256 f32 accumulators in one warpgroup would be 256 registers per thread): its CTA owns
  ``block_k_dkv`` keys and its two consumer warpgroups split each step by role (``S^T``, ``P^T``,
  ``dV`` | ``dP^T``, ``dS^T``, ``dK``; ``kernels/sm90/dkdv_roles.py``), so S and dP are computed
  once per step.
  ``dq_roles``: the same for the separate dQ kernel, whose CTA then owns ``block_q_dq`` query rows
  (``S``, ``P`` | ``dP``, ``dS``; each warpgroup half of dQ's columns; ``kernels/sm90/dq_roles.py``).
  ``dq_fused`` (on by default for head_dim 64/128, used only when the call allows a non-deterministic
  backward, dK/dV are not split by role and T >= ``dq_fused_min_t``, see :meth:`fuses_dq`): the
  dK/dV kernel also computes ``dS_ij K_j``
  and adds it to an f32 dQ accumulator in HBM by TMA reduce-add (FA2 Alg. 2 line 15), replacing the dQ
  kernel and its second computation of S and dP; it stages dS^T (bf16, double-buffered) and the dQ piece (f32) in SMEM. With
  two consumers the [block_q_dkv, H] dQ tile is split between them (by columns when H >= 128, else by
  rows when block_q_dkv >= 128), so each step reduce-adds each dQ element once, not once per consumer.

  dQ (deterministic, separate pass): a CTA owns ``num_wgs_dq * block_q_dq`` query rows and streams
  ``block_k_dq``-key tiles of K and V.

  ``pingpong``: the forward's two consumer warpgroups take turns on the tensor cores through a shared
  barrier, so one's softmax overlaps the other's matmuls (FlashAttention-3's inter-warpgroup schedule,
  as in JAX's ``attention_mgpu.py``). ``ragged``: ``"tma"`` lets TMA zero-fill out-of-bounds loads and
  clip out-of-bounds stores; ``"pad"`` pads T and S to whole tiles in HBM first (one extra copy of
  q/k/v (and do/out) and a slice of the outputs). Both mask padded keys inside the kernels.
  ``lpt_heads``: launch order of causal CTAs, whose work differs by tile (see :func:`lpt_tile`): the
  (batch, head) pairs per section within which the longest tiles go first; 0 (default) sizes the
  sections from an L2 budget per kernel (:func:`causal_section`), 1 is longest first within each head
  only. ``lpt_heads_dkv`` is the same for the dK/dV kernel.
  ``backward_p``: how the backward kernels recompute P from the forward's row statistics
  (``kernels/softmax.py``). ``"per_head"``: each CTA runs the one-FMA form, or the exact form for a
  (batch, head) with huge logits (``exact_heads``; both forms compiled, one if/else per CTA);
  ``"exact"``: the exact form everywhere (one loop per kernel, a subtraction and a ``min`` more per
  element: slower than ``"per_head"`` on the H200, docs/design.md "Softmax form");
  ``"auto"`` (default): the one-FMA form alone where the call's logits are bounded below its limit
  whatever the inputs (a soft cap with no ALiBi or ``score_fn``), else ``"per_head"``.
  ``persistent``: the forward launches ``persistent_ctas`` CTAs (0: one per SM) that each run their
  share of the query tiles of the launch order (see ``persistent_deal``), their producer streaming the next tile's
  ``K_j, V_j`` while the consumers finish a tile, instead of one CTA per query tile whose ring fills
  and drains on its own. ``persistent_deal``: which CTA runs which tile. ``"cyclic"``: CTA ``c`` runs
  the launch positions ``c, c + n_ctas, ...``. ``"greedy"``: each position in turn goes to the CTA
  with the least work so far, counted in key tiles (``schedule.greedy_deal``), for the causal calls,
  whose tiles differ in work; a causal call with an attention variant whose key ranges are known
  only at run time (lengths, segments, an offset, a ``mask_fn``) then runs one CTA per tile (see
  :meth:`forward_persistent`).
  """

  block_q: int = 64
  block_k: int = 128
  num_stages: int = 2
  num_wgs: int = 2
  pingpong: bool = True
  block_q_dkv: int = 64
  block_k_dkv: int = 64
  num_stages_dkv: int = 2
  num_wgs_dkv: int = 2
  dkv_roles: bool = False
  dq_roles: bool = False
  block_q_dq: int = 64
  block_k_dq: int = 64
  num_stages_dq: int = 2
  num_wgs_dq: int = 2
  ragged: str = "tma"
  dq_fused: bool = False
  dq_fused_min_t: int = 0  # fused dQ only for calls with at least this many query rows (see fuses_dq)
  dq_fused_variants: bool = False  # fused dQ also with an attention variant (on in .default())
  lpt_heads: int = 0
  lpt_heads_dkv: int = 0
  # setmaxnreg (registers()); .default() sets 240 / 24 for head_dim <= 128
  compute_registers: int = 0  # 0: 232 with two consumer warpgroups, 240 with one
  memory_registers: int = 40
  backward_p: str = "auto"
  persistent: bool = False  # forward: one CTA per SM looping over the query tiles
  persistent_ctas: int = 0  # with persistent: how many CTAs (0: the GPU's SM count)
  persistent_deal: str = "cyclic"  # persistent: which CTA runs which tile ("cyclic" | "greedy")

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if f.name == "ragged":
        if v not in RAGGED_MODES:
          raise ValueError(f"MosaicConfig.ragged must be one of {RAGGED_MODES}, got {v!r}")
        continue
      if f.name == "backward_p":
        if v not in BACKWARD_P_FORMS:
          raise ValueError(f"MosaicConfig.backward_p must be one of {BACKWARD_P_FORMS}, got {v!r}")
        continue
      if f.name == "persistent_deal":
        if v not in PERSISTENT_DEALS:
          raise ValueError(f"MosaicConfig.persistent_deal must be one of {PERSISTENT_DEALS}, got "
                           f"{v!r}")
        continue
      if f.name in ("pingpong", "dkv_roles", "dq_roles", "dq_fused", "dq_fused_variants",
                    "persistent"):
        if not isinstance(v, bool):
          raise TypeError(f"MosaicConfig.{f.name} must be a bool, got {v!r}")
        continue
      if not isinstance(v, (int, np.integer)) or isinstance(v, (bool, np.bool_)):
        raise TypeError(f"MosaicConfig.{f.name} must be an int, got {type(v).__name__} {v!r}")
      object.__setattr__(self, f.name, int(v))  # a numpy int as the int it is
    for name in ("block_q", "block_k_dkv", "block_q_dq"):
      if getattr(self, name) != WG_ROWS:
        raise ValueError(f"MosaicConfig.{name} must be {WG_ROWS} (the rows of one warpgroup's "
                         f"wgmma), got {getattr(self, name)}")
    for name in ("block_k", "block_q_dkv", "block_k_dq"):
      if getattr(self, name) not in _TILE_SIDES:
        raise ValueError(f"MosaicConfig.{name} must be one of {_TILE_SIDES}, got "
                         f"{getattr(self, name)}")
    for name in ("num_stages", "num_stages_dkv", "num_stages_dq"):
      if not 1 <= getattr(self, name) <= 6:
        raise ValueError(f"MosaicConfig.{name} must be in [1, 6], got {getattr(self, name)}")
    for name in ("num_wgs", "num_wgs_dkv", "num_wgs_dq"):
      if getattr(self, name) not in (1, 2):
        raise ValueError(f"MosaicConfig.{name} must be 1 or 2, got {getattr(self, name)}")
    if self.pingpong and self.num_wgs != 2:
      raise ValueError("MosaicConfig.pingpong needs num_wgs=2")
    if self.compute_registers and (self.compute_registers % 8 or
                                   not 24 <= self.compute_registers <= 256):
      raise ValueError(f"MosaicConfig.compute_registers must be 0 or a multiple of 8 in [24, 256], "
                       f"got {self.compute_registers}")
    if self.dq_fused_min_t < 0:
      raise ValueError(f"MosaicConfig.dq_fused_min_t must be >= 0 (query rows), got "
                       f"{self.dq_fused_min_t}")
    for name in ("lpt_heads", "lpt_heads_dkv"):
      if getattr(self, name) < 0:
        raise ValueError(f"MosaicConfig.{name} must be >= 0 (0: from the L2 budget), got "
                         f"{getattr(self, name)}")
    if self.persistent_ctas < 0:
      raise ValueError(f"MosaicConfig.persistent_ctas must be >= 0 (0: the GPU's SM count), got "
                       f"{self.persistent_ctas}")
    if self.memory_registers % 8 or not 24 <= self.memory_registers <= 256:
      raise ValueError(f"MosaicConfig.memory_registers must be a multiple of 8 in [24, 256], got "
                       f"{self.memory_registers}")
    # Every kernel's consumers (128 threads each) and producer share the CTA's register pool.
    consumers = 2 if (max(self.num_wgs, self.num_wgs_dkv, self.num_wgs_dq) == 2
                      or self.dkv_roles or self.dq_roles) else 1
    total = consumers * WG_THREADS * self.registers(consumers) + WG_THREADS * self.memory_registers
    pool = register_pool((consumers + 1) * WG_THREADS)
    if total > pool:
      raise ValueError(
          f"MosaicConfig.compute_registers / memory_registers: {consumers} consumer warpgroups x "
          f"{WG_THREADS} threads x {self.registers(consumers)} + {WG_THREADS} producer threads x "
          f"{self.memory_registers} = {total} registers, more than the {pool} a CTA of "
          f"{(consumers + 1) * WG_THREADS} threads holds")

  replace = dataclasses.replace

  def range_tiles(self, seq_q: int | None = None, *, deterministic: bool = False) -> dict:
    """The block-range tables the kernels read for an attention variant
    (:func:`fa2_jax.kernels.block_ranges.range_tables`), one per CTA tiling: name -> (kind, rows, keys).
    Given ``seq_q``, a backward that fuses dQ (:meth:`fuses_dq`) reads no dQ table."""
    tiles = {"fwd": ("kv", self.num_wgs * self.block_q, self.block_k),
             "dkv": ("q", self.block_q_dkv, self.dkv_keys())}
    if seq_q is not None and self.fuses_dq(seq_q, deterministic=deterministic, variant=True):
      return tiles
    tiles["dq"] = ("kv", self.dq_rows(), self.block_k_dq)
    return tiles

  def dkv_keys(self) -> int:
    """Keys per CTA of the dK/dV kernel: one warpgroup's ``block_k_dkv`` for the role-split
    kernel, whose two consumers share them, else ``num_wgs_dkv * block_k_dkv``."""
    return self.block_k_dkv if self.dkv_roles else self.num_wgs_dkv * self.block_k_dkv

  def dq_rows(self) -> int:
    """Query rows per CTA of the separate dQ kernel: ``block_q_dq`` for the role-split kernel, whose
    two consumers share them, else ``num_wgs_dq * block_q_dq``."""
    return self.block_q_dq if self.dq_roles else self.num_wgs_dq * self.block_q_dq

  def registers(self, num_wgs: int) -> int:
    """setmaxnreg of the consumer warpgroups (the producer gets ``memory_registers``).

    ``compute_registers``, or with 0 the fallback: 232 with two consumers (65536 registers per SM:
    2 x 128 x 232 + 128 x 40 = 64512 fits), 240 with one. :meth:`default` sets 240 for the consumers
    and 24 for the producer (2 x 128 x 240 + 128 x 24 = 64512) at head_dim <= 128
    (docs/design.md#register-split).
    """
    if self.compute_registers:
      return self.compute_registers
    return 232 if num_wgs == 2 else 240

  @classmethod
  def default(cls, head_dim: int, dtype=jnp.bfloat16, is_causal: bool = False, *,
              value_head_dim: int | None = None) -> "MosaicConfig":
    """Per-head_dim defaults for H100/H200 (bf16/fp16); the sweeps behind them are in
    docs/design.md#defaults-and-the-measurements-behind-them. A ``value_head_dim`` of its own
    (None: ``head_dim``; MLA) takes the settings of the wider of the two, without the role-split dQ
    kernel.

    head_dim 64: 256-key forward tiles, 128-row dK/dV tiles, 128-key dQ tiles (the fastest in the
    sweep, docs/design.md#mosaic-tiles-head-dim-64). 128: 128-key tiles, 2-deep rings (no variant was
    faster, docs/design.md#mosaic-tiles-head-dim-128); both run the forward persistent, causal calls
    dealing their tiles greedily (docs/design.md#persistent-forward). Wider: 128-key forward tiles
    run so where V is no wider than Q and their ring fits (144-176, 192/128), else 64-key tiles; the
    backward runs the role-split dK/dV kernel (``dkv_roles``: faster than the dV and dK passes) and,
    at 256, the role-split dQ kernel (``dq_roles``; at 192 the dQ kernel with one consumer
    warpgroup), to fit SMEM and registers (docs/design.md#mosaic-tiles-head-dim-192-and-256).
    """
    if isinstance(head_dim, (bool, np.bool_)) or not isinstance(head_dim, (int, np.integer)):
      raise TypeError(f"head_dim must be an int, got {type(head_dim).__name__} {head_dim!r}")
    if (why := head_dim_reason(int(head_dim))) is not None:
      raise ValueError(f"head_dim: {why}")
    try:
      dt = None if dtype is None else jnp.dtype(dtype)
    except TypeError:
      dt = None
    if dt not in _DTYPES:  # same settings for bf16/fp16 until measured otherwise
      raise TypeError(f"dtype must be bfloat16 or float16 (the Mosaic kernels' input dtypes), got "
                      f"{dt if dt is not None else repr(dtype)}")
    head_dim = int(head_dim)
    if value_head_dim is not None:
      if isinstance(value_head_dim, (bool, np.bool_)) or not isinstance(value_head_dim,
                                                                          (int, np.integer)):
        raise TypeError(f"value_head_dim must be None or an int, got "
                        f"{type(value_head_dim).__name__} {value_head_dim!r}")
      if (why := head_dim_reason(int(value_head_dim))) is not None:
        raise ValueError(f"value_head_dim: {why}")
      value_head_dim = int(value_head_dim)
    if not isinstance(is_causal, (bool, np.bool_)):
      raise TypeError(f"is_causal must be a Python bool, got {type(is_causal).__name__} {is_causal!r}")
    # Fused dQ (used only when the call allows a non-deterministic backward) from 2k query rows
    # non-causal and 4k causal (5k at head_dim 128, below): with fewer query tiles the key tiles'
    # reduce-adds pile onto few dQ rows and the separate dQ kernel is faster; calls with an attention
    # variant follow the same rule (docs/design.md#when-the-backward-fuses-dq). The consumers get 240
    # registers and the producer 24 (docs/design.md#register-split).
    fused = dict(dq_fused=True, dq_fused_min_t=4096 if is_causal else 2048, dq_fused_variants=True)
    # The forward runs persistent at head_dim <= 128 and with the wider heads' 128-key tiles (as fast
    # or faster at every length measured; head_dim 256 does not gain); causal calls, whose tiles
    # differ in work, deal them greedily (a cyclic deal loses at length:
    # docs/design.md#persistent-forward).
    regs = dict(compute_registers=240, memory_registers=24, persistent=True,
                persistent_deal="greedy")
    # A value head_dim of its own: the tiles of the wider of the two (SMEM and the dV accumulator's
    # registers grow with it); the dQ settings follow head_dim (dQ's columns).
    width = max(head_dim, value_head_dim or head_dim)
    if width <= 64:
      # The fused dS^T/dQ staging needs the SMEM of a third dK/dV stage. Causal dK/dV keeps the
      # per-head launch order (lpt_heads_dkv=1), faster than any L2 section for this kernel only
      # (docs/design.md#causal-launch-order).
      return cls(block_k=256, num_stages=2 if is_causal else 3, block_q_dkv=128, num_stages_dkv=2,
                 block_k_dq=128, num_stages_dq=2, lpt_heads_dkv=1, **fused, **regs)
    if width <= 128:
      # Fused dQ only where its tile splits between the consumers (head_dim 128, by columns): at
      # 80/96/112 each consumer would reduce-add its own partial of the same rows, and the separate
      # dQ kernel measured 11-30% faster (docs/design.md#when-the-backward-fuses-dq).
      if dq_split(WG_ROWS, head_dim, 2) is None:
        fused = dict(dq_fused=False)
      elif is_causal:
        # Causal calls fuse dQ from 5120 rows: below, the separate dQ kernel was faster for MHA, GQA
        # and MQA alike (docs/design.md#when-the-backward-fuses-dq).
        fused = dict(fused, dq_fused_min_t=5120)
      return cls(block_k=128, num_stages=2, num_stages_dkv=2, num_stages_dq=2, **fused, **regs)
    wide = cls(block_k=64, num_stages=2, dkv_roles=True, num_stages_dkv=2, num_wgs_dq=1,
               num_stages_dq=2, dq_roles=head_dim % (2 * WG_ROWS) == 0 and value_head_dim in (
                   None, head_dim))
    # 128-key forward tiles, run persistent, where V is no wider than Q and their 2-deep ring fits
    # beside Q (144-176; DeepSeek-V2's 192/128, O in Q's bytes; measured there only, wider V keeps
    # the 64-key tiles: docs/design.md#mosaic-tiles-head-dim-192-and-256).
    k128 = dataclasses.replace(wide, block_k=128, persistent=True, persistent_deal="greedy")
    if (value_head_dim or head_dim) <= head_dim and (
        k128.smem_forward(head_dim, 2, value_head_dim) <= SMEM_BYTES - SMEM_RESERVE):
      return k128
    return wide

  def forward_persistent(self, *, is_causal: bool, known_work: bool) -> bool:
    """Whether the forward runs persistent (one CTA per SM looping over the query tiles):
    ``persistent``, except for a causal call under the greedy deal whose tiles' work is not
    ``known_work`` at trace time (an attention variant with lengths, segments, an offset or a
    ``mask_fn``: ``Variant.static_ranges``; a dense call's is known)."""
    return self.persistent and not (is_causal and not known_work
                                    and self.persistent_deal == "greedy")

  def deals_greedily(self, *, is_causal: bool, known_work: bool) -> bool:
    """Whether a persistent forward deals its tiles by :func:`schedule.greedy_deal` (causal calls
    whose tiles' work is known at trace time, under ``persistent_deal="greedy"``) rather than
    cyclically."""
    return (self.forward_persistent(is_causal=is_causal, known_work=known_work) and is_causal
            and known_work and self.persistent_deal == "greedy")

  def fuses_dq(self, seq_q: int, *, deterministic: bool, variant: bool = False) -> bool:
    """Whether a backward of ``seq_q`` query rows (``variant``: with an attention variant beyond
    causal) runs dQ inside the dK/dV kernel."""
    return (self.dq_fused and not deterministic and not self.dkv_roles
            and seq_q >= self.dq_fused_min_t and (self.dq_fused_variants or not variant))

  def p_form(self, variant=None) -> str:
    """How a call's backward recomputes P (:attr:`backward_p` resolved for an attention ``variant``,
    a ``fa2_jax.kernels.masking.Variant`` or None): ``"fast"`` (the one-FMA form alone: ``"auto"`` where the
    logits are bounded below its limit, ``kernels/softmax.py``: ``fast_form_suffices``),
    ``"per_head"`` or ``"exact"``."""
    if self.backward_p != "auto":
      return self.backward_p
    if fast_form_suffices(variant):
      return "fast"
    return "per_head"

  # --- shared-memory budget (bytes), one function per kernel ---------------------------------------
  # ``value_head_dim`` (None: ``head_dim``): V, O, dO and dV tiles are that wide (MLA).
  def smem_forward(self, head_dim: int, itemsize: int = 2, value_head_dim: int | None = None) -> int:
    hv = head_dim if value_head_dim is None else value_head_dim
    q = self.num_wgs * self.block_q * head_dim * itemsize  # Q tile, reused for O where O fits in it
    o = 0 if o_rows_in_q(self.block_q, head_dim, hv) else (
        self.num_wgs * self.block_q * hv * itemsize)
    kv = self.num_stages * self.block_k * (head_dim + hv) * itemsize
    return q + o + kv + self.num_wgs * 2 * self.block_q * 4  # + the row statistics (r, l)

  def smem_dkv(self, head_dim: int, itemsize: int = 2, value_head_dim: int | None = None) -> int:
    hv = head_dim if value_head_dim is None else value_head_dim
    nwg = self.num_wgs_dkv
    tiles_k = self.block_k_dkv * (head_dim + hv) * itemsize  # K and V (for dP)
    resident = nwg * tiles_k
    # Q, dO tiles; the row inputs (r, u) and delta: f32 [block_q] each
    ring = self.num_stages_dkv * (self.block_q_dkv * (head_dim + hv) * itemsize
                                  + self.block_q_dkv * 4 * 3)
    fused = 0
    if self.dkv_roles:  # one consumer's keys (shared by both) and the P^T ∘ d tile, f32
      resident = tiles_k * (1 if hv == head_dim else 2)  # + dK/dV staging where K/V differ in width
      fused = self.block_k_dkv * self.block_q_dkv * 4
    elif self.dq_fused:
      # dS^T [keys, rows] per consumer in the input dtype, double-buffered, + each consumer's f32 dQ
      # piece (a 1/nwg share of [rows, H] when the tile splits among the consumers, see dq_split)
      rows, cols = dq_piece(self.block_q_dkv, head_dim, nwg)
      fused = 2 * nwg * self.block_k_dkv * self.block_q_dkv * itemsize + nwg * rows * cols * 4
    return resident + ring + fused

  def smem_dq(self, head_dim: int, itemsize: int = 2, value_head_dim: int | None = None) -> int:
    hv = head_dim if value_head_dim is None else value_head_dim
    # Q, dO tiles; (r, u) and delta, f32 [block_q] each
    tiles = 1 if self.dq_roles else self.num_wgs_dq  # dq_roles: both consumers share one
    resident = tiles * (self.block_q_dq * (head_dim + hv) * itemsize + 3 * self.block_q_dq * 4)
    ring = self.num_stages_dq * self.block_k_dq * (head_dim + hv) * itemsize
    # dq_roles: the P ∘ d tile (f32) and the dS tile
    exchange = self.block_q_dq * self.block_k_dq * (4 + itemsize) if self.dq_roles else 0
    return resident + ring + exchange

  def check(self, head_dim: int, itemsize: int = 2, value_head_dim: int | None = None) -> str | None:
    """None if every kernel's tiles fit in shared memory for this head_dim (and value head_dim:
    None, the same), else a reason."""
    hv = head_dim if value_head_dim is None else value_head_dim
    if self.dq_roles and head_dim % (2 * WG_ROWS):
      return (f"MosaicConfig.dq_roles needs a head_dim that is a multiple of {2 * WG_ROWS} (each "
              f"warpgroup computes half of dQ's columns, whole {WG_ROWS}-element tiles), got "
              f"{head_dim}")
    if self.dq_roles and hv != head_dim:
      return (f"MosaicConfig.dq_roles needs the value head_dim equal to the head_dim (its warpgroups "
              f"split Q and dO by the same columns), got {hv} != {head_dim}: use dq_roles=False")
    limit = SMEM_BYTES - SMEM_RESERVE
    need = {"forward": self.smem_forward(head_dim, itemsize, hv),
            "dQ": self.smem_dq(head_dim, itemsize, hv),
            "dK/dV": self.smem_dkv(head_dim, itemsize, hv)}
    for name, b in need.items():
      if b > limit:
        return (f"MosaicConfig {name} kernel needs {b // 1024} KiB of shared memory for "
                f"head_dim={head_dim}" + (f", value head_dim {hv}" if hv != head_dim else "")
                + f", more than the {limit // 1024} KiB available: use fewer stages or smaller "
                "tiles")
    return None


# --- support check -----------------------------------------------------------------------------------

def head_dim_reason(head_dim: int) -> str | None:
  """None for a head_dim the kernels tile natively (a multiple of :data:`HEAD_DIM_STEP` up to
  :data:`HEAD_DIM_MAX`), else why not."""
  if head_dim % HEAD_DIM_STEP or not 0 < head_dim <= HEAD_DIM_MAX:
    return (f"the Mosaic GPU backend supports head_dims that are multiples of {HEAD_DIM_STEP} up to "
            f"{HEAD_DIM_MAX} (wgmma's narrowest swizzled SMEM tile holds {HEAD_DIM_STEP} elements), "
            f"got {head_dim}")
  return None


def supports(q_shape, k_shape, dtype, head_dim: int, is_causal: bool,
             value_head_dim: int | None = None) -> str | None:
  """None when ``forward``/``backward`` of this backend can run the call, else a one-line reason.

  Shapes are ``[B, T, N, H]`` / ``[B, S, K, H]``; ``value_head_dim`` (None: H) is V's and the
  output's. Sequence lengths may be any positive length (ragged tails are handled by TMA bounds or
  an HBM pad, see :func:`plan_lengths`).
  """
  if is_causal and (why := _causal_ptxas_bug()) is not None:
    return why
  try:
    dt = jnp.dtype(dtype)
  except TypeError:
    return f"unsupported dtype {dtype!r}"
  if dt not in _DTYPES:
    return (f"the Mosaic GPU backend supports bfloat16 and float16 (wgmma with f32 accumulators), "
            f"got {dt.name}")
  if len(q_shape) != 4 or len(k_shape) != 4:
    return f"expected rank-4 q [B, T, N, H] and k [B, S, K, H], got {q_shape} and {k_shape}"
  b, t, n, h = q_shape
  bk, s, kh, hk = k_shape
  if h != head_dim or hk != head_dim:
    return f"head_dim {head_dim} does not match q/k shapes {q_shape}, {k_shape}"
  if (why := head_dim_reason(head_dim)) is not None:
    return why
  hv = head_dim if value_head_dim is None else value_head_dim
  if hv != head_dim and (why := head_dim_reason(hv)) is not None:
    return f"value head_dim: {why}"
  if bk != b:
    return f"batch mismatch: q {b}, k {bk}"
  if min(b, t, n, s, kh) < 1:
    return f"empty dimension in q {q_shape} / k {k_shape}"
  if n % kh:
    return f"query heads N={n} must be a multiple of key/value heads K={kh}"
  if b > 65535 or n > 65535:
    return f"batch and head counts must be <= 65535 (CUDA grid y/z), got B={b}, N={n}"
  cfg = MosaicConfig.default(head_dim, dt, value_head_dim=hv)
  return cfg.check(head_dim, dt.itemsize, hv)


def _causal_ptxas_bug() -> str | None:
  """JAX's attention_mgpu.py refuses causal masking with CUDA 12.8.0 - 12.9.0 (a ptxas
  miscompilation); do the same (docs/design.md#the-ptxas-guard). None on CPU or when the CUDA version
  is unknown."""
  try:
    from jax._src.lib import cuda_versions  # None without the CUDA plugin
    if cuda_versions is None:
      return None
    v = int(cuda_versions.cuda_runtime_get_version())
  except Exception:  # noqa: BLE001 - best effort only
    return None
  if 12080 <= v < 12091:
    return (f"causal masking is disabled with CUDA runtime {v // 1000}.{v % 1000 // 10} "
            f"(12.8.0-12.9.0 ptxas miscompiles it, per JAX's attention_mgpu.py); use CUDA >= 12.9.1")
  return None

