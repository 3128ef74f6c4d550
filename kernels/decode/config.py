"""Launch settings of the decode kernels: one frozen, validated dataclass, the split heuristic, and
the launch form (the config resolved against a call, with the training family its backward uses).

Names: ``block_k`` keys per step of a program's loop (the paper's ``B_c``); a *split* is one share of
a row's key range, run by its own program (flash-decoding); ``waves`` is how many times the programs
fill the GPU's SMs (one program per SM counted as one wave).
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from ..softmax import check_input_dtype
from ..triton.config import check_launch_field

# The heuristic never makes more splits than this (the combine's partials grow with them) nor splits
# shorter than MIN_BLOCKS_PER_SPLIT key blocks (each split pays its setup and a partial's write).
MAX_SPLITS = 128
MIN_BLOCKS_PER_SPLIT = 2
# Packed query rows from which a batch's rows keep one split count instead of splitting by length
# (kernels/decode/backend.py splits_by_length: MQA's 32-row tiles were 5% slower by length).
FULL_TILE_ROWS = 32
# Splits by the rows' lengths (row_splits): the grid holds at most this many times the static count
# per row, room for a row with this many times the mean row's reachable keys to split as finely as
# the rest (a longer one takes longer chunks); the unused programs cost their launch (3 against 2
# and 4: docs/measurements.md#decode-kernels).
LENGTH_SPLITS_FACTOR = 3
# The even-split rule (num_splits_heuristic): the programs reach this share of the wanted SM slots and
# fill their last round of SMs at least this full (8 x 32k GQA 32/8: 2 splits = 128 programs on 132
# SMs 339 us of device time, 3 = 192 programs 373, 4 = 256 programs 344, 5 = 320 programs 362).
SPLIT_FILL = 0.95
# Splits by length: programs per SM the rows' counts aim at (row_splits' target; 8 x 32k ragged:
# 156 us of device time against 163 with one per SM).
LENGTH_WAVES = 2
# SMs of an H100 SXM: the heuristic's count where the device does not say (on CPU, interpret mode).
DEFAULT_SMS = 132


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """Tiles and launch parameters of the decode (split-KV) forward kernel.

  ``DecodeConfig()`` is these fields' values for every call; what a call gets without
  ``block_sizes`` is :meth:`default` for its head_dim, dtype and packed rows (start from it:
  ``DecodeConfig.default(128).replace(num_splits=8)``).

  Attributes:
    block_k: keys per loop step (a power of two in [16, 256]).
    num_splits: programs per (batch element, KV head) that share its key range; None: the
      heuristic (:func:`num_splits_heuristic`) picks it from B, K, S and the SM count.
    num_warps, num_stages: Triton launch settings of the forward kernel.
    waves: the split rules' target, in programs per SM; None: one for a contiguous cache's
      even splits, two for a paged cache's (whose page lookups want a second program per SM to
      hide) and for splits by length (:data:`LENGTH_WAVES`). See :func:`num_splits_heuristic`
      and :func:`row_splits`.
  """

  block_k: int = 64
  num_splits: int | None = None
  num_warps: int = 4
  num_stages: int = 2
  waves: int | None = None

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if f.name in ("num_splits", "waves") and v is None:
        continue
      if not isinstance(v, (int, np.integer)) or isinstance(v, (bool, np.bool_)):
        raise TypeError(f"DecodeConfig.{f.name} must be an int, got {type(v).__name__} {v!r}")
      object.__setattr__(self, f.name, int(v))
    for f in dataclasses.fields(self):  # block_k, num_warps, num_stages: Triton's limits
      check_launch_field("DecodeConfig", f.name, getattr(self, f.name))
    if self.num_splits is not None and not 1 <= self.num_splits <= 1024:
      raise ValueError(f"DecodeConfig.num_splits must be None or in [1, 1024], got "
                       f"{self.num_splits}")
    if self.waves is not None and not 1 <= self.waves <= 64:
      raise ValueError(f"DecodeConfig.waves must be in [1, 64], got {self.waves}")

  replace = dataclasses.replace

  @classmethod
  def default(cls, head_dim: int, dtype=jnp.bfloat16, rows: int = 1) -> "DecodeConfig":
    """The default per (head_dim, dtype): 64 keys per step for 16-bit inputs with three stages
    (docs/measurements.md#decode-kernels: on an H100 three stages read 64 x 8k at 721 us against
    787 with two, 32 x 16k ragged at 461 against 507, the rest equal; at head_dim 256, [64, 256]
    K and V tiles of 32 KiB each, 8 x 32k at 751 us against 901 with 32 keys and two stages), 32
    keys and two stages for float32; ``waves`` None (the split rules' own). ``rows``: the query
    rows a program packs (``T * N / K``), checked only (the split rules see them through the
    launch)."""
    if isinstance(head_dim, (bool, np.bool_)) or not isinstance(head_dim, (int, np.integer)):
      raise TypeError(f"head_dim must be an int, got {type(head_dim).__name__} {head_dim!r}")
    if head_dim < 1:
      raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
    if isinstance(rows, (bool, np.bool_)) or not isinstance(rows, (int, np.integer)) or rows < 1:
      raise ValueError(f"rows must be a positive int (the query rows a program packs), got "
                       f"{rows!r}")
    f32 = check_input_dtype(dtype) == jnp.float32
    return cls(block_k=32 if f32 else 64, num_warps=4, num_stages=2 if f32 else 3)


def _runs_as(n_blocks: int, splits: int) -> int:
  """The splits that ``splits`` shares of ``n_blocks`` blocks run as: the least count with the same
  chunk length (no empty trailing chunk for the longest row)."""
  return max(1, -(-n_blocks // -(-n_blocks // splits)))


def num_splits_heuristic(programs: int, n_blocks: int, *, sms: int = DEFAULT_SMS, waves: int = 1,
                         max_splits: int = MAX_SPLITS,
                         min_blocks: int = MIN_BLOCKS_PER_SPLIT) -> int:
  """How many splits of the key range (>= 1) when every row takes the same count.

  ``programs`` = B * K (one program per batch element and KV head before splitting), ``n_blocks``
  the key blocks of the longest row. With at least 0.8 * ``waves * sms`` programs the GPU is full
  without splitting: 1. Otherwise the fewest splits whose programs reach :data:`SPLIT_FILL` of
  ``waves * sms`` and fill their last round of SMs to :data:`SPLIT_FILL` (a round that leaves SMs
  idle or doubles up a few of them costs the whole round: docs/measurements.md#decode-split-counts),
  or, where no count up to ``(waves + 1) * sms`` programs does, the fewest splits of the best fill;
  never more than ``max_splits`` nor splits shorter than ``min_blocks`` key blocks. Only counts
  that leave the longest row no empty trailing chunk are judged (each the least with its chunk
  length).
  """
  programs, n_blocks, sms = max(1, int(programs)), max(1, int(n_blocks)), max(1, int(sms))
  if programs >= 0.8 * waves * sms:
    return 1
  cap = max(1, min(max_splits, n_blocks // max(1, min_blocks)))
  counts = sorted({_runs_as(n_blocks, s) for s in range(1, cap + 1)})  # judged as they run
  splits, best_fill = 1, 0.0
  for s in counts:
    p = programs * s
    if s > 1 and p > (waves + 1) * sms:  # past one round more than asked: more, shorter splits
      break
    fill = p / (-(-p // sms) * sms)  # the programs over the SM slots of their rounds
    if p >= SPLIT_FILL * waves * sms and fill >= SPLIT_FILL:
      splits = s
      break
    if fill > best_fill:  # the fewest splits of the best fill
      splits, best_fill = s, fill
  return splits


def length_splits(programs: int, n_blocks: int, *, sms: int = DEFAULT_SMS,
                  waves: int = LENGTH_WAVES, max_splits: int = MAX_SPLITS,
                  min_blocks: int = MIN_BLOCKS_PER_SPLIT) -> int:
  """The base count of splits by length (:func:`grid_splits_by_length`, :func:`row_splits`): the
  fewest splits that reach ``waves * sms`` programs (1 from 0.8 of them), no more than
  ``max_splits`` nor splits shorter than ``min_blocks`` blocks, lowered to the least with the same
  chunk length. 1: the rows do not split by length."""
  programs, n_blocks, sms = max(1, int(programs)), max(1, int(n_blocks)), max(1, int(sms))
  target = waves * sms
  if programs >= 0.8 * target:
    return 1
  cap = max(1, min(max_splits, n_blocks // max(1, min_blocks)))
  return _runs_as(n_blocks, min(cap, -(-target // programs)))


def grid_splits_by_length(kv_heads: int, n_blocks: int, static_splits: int, *,
                          sms: int = DEFAULT_SMS, waves: int = 2, max_splits: int = MAX_SPLITS,
                          min_blocks: int = MIN_BLOCKS_PER_SPLIT,
                          factor: int | None = None) -> int:
  """The grid's splits per (batch element, KV head) when each row takes its own split count at run
  time (:func:`row_splits`): ``factor`` (None: :data:`LENGTH_SPLITS_FACTOR`) times the static count
  ``static_splits``, but no more than
  one row holding all the batch's work would take (``waves * sms`` programs over the ``kv_heads``
  heads) or ``max_splits``, and no splits shorter than ``min_blocks`` of ``n_blocks`` (the
  capacity's key blocks). Programs past their row's count load and write nothing."""
  kv_heads, n_blocks, sms = max(1, int(kv_heads)), max(1, int(n_blocks)), max(1, int(sms))
  factor = LENGTH_SPLITS_FACTOR if factor is None else factor
  return max(1, min(max_splits, n_blocks // max(1, min_blocks), -(-waves * sms // kv_heads),
                    factor * max(1, int(static_splits))))


def row_splits(work, *, kv_heads: int, grid_splits: int, target: int,
               min_blocks: int = MIN_BLOCKS_PER_SPLIT, total=None):
  """int32: each row's split count, from its reachable key blocks ``work`` (int32, at run time;
  ``[B]``, or one row's with ``total`` the sum over the batch's rows): the batch's ``kv_heads *
  total`` blocks in chunks sized so that about ``target`` programs share them (no chunk under
  ``min_blocks`` blocks), a row taking as many chunks as its blocks fill, at least 1 (an empty row's
  one split writes its zero output and statistics) and at most ``grid_splits``. Long rows split
  finely and short rows not at all, so no program of a ragged batch runs much past the others (the
  static count splits every row alike; FlashAttention-3's ``num_splits_dynamic`` does as this
  does). The decode kernel computes it in each program (jnp arithmetic: the same in and out of a
  kernel). Rows at one length round up to the count of the static 2 x SMs target, not the even
  count (8 x 32k at capacity: 5 splits, 354 us of device time where 2 static splits take 339;
  docs/measurements.md#decode-split-counts)."""
  work = jnp.asarray(work, jnp.int32)
  total = jnp.sum(work) if total is None else total
  chunk = jnp.maximum(jnp.int32(max(1, min_blocks)), (total * kv_heads + target - 1) // target)
  return jnp.clip((work + chunk - 1) // chunk, 1, grid_splits).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class DecodeLaunch:
  """A :class:`DecodeConfig` resolved against one call: what the kernels launch with (hashable: it
  is static state of the ``custom_vjp``).

  Attributes:
    config: the user's or the default :class:`DecodeConfig`.
    num_splits: the splits this call runs (the config's, or the heuristic's).
    rows: query rows a program packs, ``T * N / K`` (its tile has ``rows_padded`` rows).
    backward: the training family whose backward (and, for a call that is not decode-shaped as
      launched, forward) runs: ``"sm90"`` or ``"triton"``.
    backward_config: that family's launch config for the call.
    delegate_forward: True when the launched call is not decode-shaped (e.g. padded to a length
      multiple by ``reuse_kernels_across_programs``): the training family's forward runs it.
    split_target: None: every row runs ``num_splits`` splits. Else the rows take their own counts
      at run time (:func:`row_splits`, about this many programs in all), ``num_splits`` being the
      grid's (:func:`grid_splits_by_length`).
  """

  config: DecodeConfig
  num_splits: int
  rows: int
  backward: str
  backward_config: object
  delegate_forward: bool = False
  split_target: int | None = None

  @property
  def block_k(self) -> int:
    return self.config.block_k

  @property
  def rows_padded(self) -> int:
    """The tile's rows: ``rows`` up to a power of two, at least 16 (a tensor-core dot's M)."""
    return max(16, 1 << max(0, math.ceil(math.log2(max(1, self.rows)))))
