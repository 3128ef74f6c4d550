"""Which (query, key) pairs may attend: the one definition shared by every kernel and the reference.

The kernels call :func:`allowed` on the index vectors of a tile (``q_pos`` of shape ``[block_q, 1]``,
``k_pos`` of shape ``[1, block_k]``); the reference calls it on the full ``[T, 1]`` and ``[1, S]`` ranges.
Because both use this function they cannot disagree about the mask.

Causal alignment is *top-left*, as in ``jax.nn.dot_product_attention``: query ``i`` attends keys
``j <= i``. With ``T > S`` the rows ``i >= S`` attend every key; with ``T < S`` the keys ``j > T - 1``
are never attended (their gradients are zero). Every query row always has key 0, so no row is empty.
"""
from __future__ import annotations

import jax.numpy as jnp


def allowed(q_pos, k_pos, *, is_causal: bool, seq_k: int | None = None):
  """Boolean mask, True where query ``q_pos`` may attend key ``k_pos``.

  Args:
    q_pos: integer array of query positions, broadcastable against ``k_pos`` (e.g. ``[bq, 1]``).
    k_pos: integer array of key positions (e.g. ``[1, bk]``).
    is_causal: apply the top-left causal rule ``k_pos <= q_pos``.
    seq_k: when given, keys at positions ``>= seq_k`` (the padded tail of the last key block
      inside a kernel) are masked out.

  Returns:
    A boolean array of the broadcast shape, or ``None`` when nothing is masked.
  """
  mask = None
  if is_causal:
    mask = k_pos <= q_pos
  if seq_k is not None:
    tail = k_pos < seq_k
    mask = tail if mask is None else jnp.logical_and(mask, tail)
  if mask is not None:
    mask = jnp.broadcast_to(mask, jnp.broadcast_shapes(jnp.shape(q_pos), jnp.shape(k_pos)))
  return mask
