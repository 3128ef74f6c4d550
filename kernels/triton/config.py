"""Tile sizes and launch settings: one frozen, validated dataclass with heuristic defaults.

Names follow the paper (§3.1, Alg. 1 and 2): ``B_r`` (rows of Q per block) is ``block_q`` and ``B_c``
(rows of K/V per block) is ``block_k``. The forward kernel, the dK/dV kernel and the separate dQ kernel
each have their own pair because their best tiles differ (the backward keeps more tiles live).
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from ..softmax import check_input_dtype


def _is_pow2(x: int) -> bool:
  return x > 0 and (x & (x - 1)) == 0


# Triton needs power-of-two tile sides; 16 is the smallest side its tensor-core dots accept and 256 the
# largest that fits a [block, head_dim<=256] f32 accumulator in registers with room to spare.
_MIN_BLOCK, _MAX_BLOCK = 16, 256


def check_launch_field(owner: str, name: str, value: int) -> None:
  """Raises ValueError for an int field of a Triton kernel config (``owner``: its class name) that
  Triton cannot launch with: a tile side ``block_*`` that is not a power of two in [16, 256], a
  ``num_warps*`` not in 1, 2, 4, 8, 16, a ``num_stages*`` outside [1, 8]. Other fields pass."""
  if name.startswith("block_"):
    if not _is_pow2(value) or not _MIN_BLOCK <= value <= _MAX_BLOCK:
      raise ValueError(
          f"{owner}.{name} must be a power of two in [{_MIN_BLOCK}, {_MAX_BLOCK}], got {value}")
  elif name.startswith("num_warps"):
    if value not in (1, 2, 4, 8, 16):
      raise ValueError(f"{owner}.{name} must be one of 1, 2, 4, 8, 16, got {value}")
  elif name.startswith("num_stages"):
    if not 1 <= value <= 8:
      raise ValueError(f"{owner}.{name} must be in [1, 8], got {value}")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiles and launch parameters of the Triton kernels.

  Attributes:
    block_q, block_k: forward tiles (``B_r``, ``B_c`` of Alg. 1).
    block_q_dkv, block_k_dkv: tiles of the dK/dV kernel (Alg. 2): each program owns ``block_k_dkv`` keys
      and loops over query blocks of ``block_q_dkv`` rows.
    block_q_dq, block_k_dq: tiles of the separate (deterministic) dQ kernel.
    num_warps_fwd, num_stages_fwd: Triton launch settings of the forward kernel.
    num_warps_bwd, num_stages_bwd: the same for both backward kernels.
  """

  block_q: int = 128
  block_k: int = 64
  block_q_dkv: int = 64
  block_k_dkv: int = 64
  block_q_dq: int = 64
  block_k_dq: int = 64
  num_warps_fwd: int = 8
  num_stages_fwd: int = 3
  num_warps_bwd: int = 4
  num_stages_bwd: int = 2

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if not isinstance(v, (int, np.integer)) or isinstance(v, (bool, np.bool_)):
        raise TypeError(f"BlockSizes.{f.name} must be an int, got {type(v).__name__} {v!r}")
      object.__setattr__(self, f.name, int(v))  # a numpy int as the int it is
      check_launch_field("BlockSizes", f.name, int(v))

  @property
  def max_block_q(self) -> int:
    """Largest query tile: lse/delta/dQ buffers are padded to a multiple of it."""
    return max(self.block_q, self.block_q_dkv, self.block_q_dq)

  def range_tiles(self) -> dict:
    """The block-range tables the kernels read for an attention variant
    (:func:`fa2_jax.kernels.block_ranges.range_tables`): name -> (kind, block_q, block_k)."""
    return {"fwd": ("kv", self.block_q, self.block_k),
            "dkv": ("q", self.block_q_dkv, self.block_k_dkv),
            "dq": ("kv", self.block_q_dq, self.block_k_dq)}

  replace = dataclasses.replace  # as MosaicConfig.replace: a copy with the fields given changed

  def clamp(self, seq_q: int, seq_k: int) -> "BlockSizes":
    """Shrink tiles for short sequences (no tile larger than the next power of two of the length)."""
    cq = max(_MIN_BLOCK, 1 << max(0, math.ceil(math.log2(max(seq_q, 1)))))
    ck = max(_MIN_BLOCK, 1 << max(0, math.ceil(math.log2(max(seq_k, 1)))))
    return dataclasses.replace(
        self,
        block_q=min(self.block_q, cq), block_k=min(self.block_k, ck),
        block_q_dkv=min(self.block_q_dkv, cq), block_k_dkv=min(self.block_k_dkv, ck),
        block_q_dq=min(self.block_q_dq, cq), block_k_dq=min(self.block_k_dq, ck),
    )

  @classmethod
  def default(cls, head_dim: int, dtype=jnp.bfloat16) -> "BlockSizes":
    """Tuned default per (head_dim, dtype); the sweeps behind it: docs/design.md#triton-block-sizes.

    Args:
      head_dim: H of the call, >= 1 (the kernels pad it to a power of two).
      dtype: input dtype; float32 halves the tiles (twice the bytes per element, f32 dots).
    """
    if isinstance(head_dim, (bool, np.bool_)) or not isinstance(head_dim, (int, np.integer)):
      raise TypeError(f"head_dim must be an int, got {type(head_dim).__name__} {head_dim!r}")
    if head_dim < 1:
      raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
    head_dim = int(head_dim)
    hp = max(16, 1 << math.ceil(math.log2(head_dim)))
    f32 = check_input_dtype(dtype) == jnp.float32
    if hp <= 64:
      cfg = cls(block_q=64, block_k=128, num_warps_fwd=4, num_stages_fwd=2,
                block_q_dkv=64, block_k_dkv=64, block_q_dq=64, block_k_dq=64,
                num_warps_bwd=4, num_stages_bwd=2)
    elif hp <= 128:
      cfg = cls(block_q=128, block_k=128, num_warps_fwd=8, num_stages_fwd=3,
                block_q_dkv=64, block_k_dkv=64, block_q_dq=64, block_k_dq=64,
                num_warps_bwd=4, num_stages_bwd=2)
    else:  # 256: registers and shared memory halve the tiles
      cfg = cls(block_q=64, block_k=32, num_warps_fwd=4, num_stages_fwd=2,
                block_q_dkv=32, block_k_dkv=32, block_q_dq=32, block_k_dq=32,
                num_warps_bwd=4, num_stages_bwd=1)
    if f32:
      cfg = dataclasses.replace(
          cfg, block_q=max(_MIN_BLOCK, cfg.block_q // 2), block_k=max(_MIN_BLOCK, cfg.block_k // 2),
          block_q_dkv=max(_MIN_BLOCK, cfg.block_q_dkv // 2),
          block_k_dkv=max(_MIN_BLOCK, cfg.block_k_dkv // 2),
          block_q_dq=max(_MIN_BLOCK, cfg.block_q_dq // 2),
          block_k_dq=max(_MIN_BLOCK, cfg.block_k_dq // 2), num_stages_fwd=2, num_stages_bwd=1)
    return cfg
