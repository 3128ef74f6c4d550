"""The mapped axis of a ``vmap`` folded into the batch axis B, for calls whose operands and results
all have B first: ``[E, B, ...] -> [E * B, ...]`` before one call, ``[E * B, ...] -> [E, B, ...]``
after. Shared by the Mosaic kernels' ``custom_vmap`` rule (:func:`kernels.sm90.ops.batch_rule`) and
the partitioned calls' (:func:`fa2_jax.sharding.partitioned`)."""
from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp


def fold_mapped(axis_size: int, in_batched: Sequence[bool], operands: Sequence) -> list:
  """Each operand ``[E, B, ...]`` as ``[E * B, ...]``; an unmapped one (``[B, ...]``, the same for
  every ``e``) broadcast first."""
  full = [x if mapped else jnp.broadcast_to(x, (axis_size, *x.shape))
          for x, mapped in zip(operands, in_batched)]
  return [x.reshape((axis_size * x.shape[1], *x.shape[2:])) for x in full]


def unfold_mapped(axis_size: int, outs: Sequence) -> tuple:
  """Each result ``[E * B, ...]`` as ``[E, B, ...]``."""
  return tuple(o.reshape((axis_size, o.shape[0] // axis_size, *o.shape[1:])) for o in outs)
