"""FlashAttention-2 on the Pallas Triton backend: the portable GPU path (A100 = sm80 and newer, every GPU
that is not Hopper) and the kernels the CPU tests run in interpret mode.

Modules (nothing is imported eagerly, so ``import fa2_jax`` stays light):

* ``config``: :class:`BlockSizes`, the tiles and launch settings, with tuned defaults.
* ``forward``: ``forward(q, k, v, ...) -> (out, stats [B, N, 2, T])`` (paper Alg. 1; the rows'
  statistics, ``kernels/softmax.py``, from which the lse follows).
* ``backward``: ``backward(q, k, v, out, stats, do, ...) -> (dq, dk, dv)`` (paper Alg. 2, deterministic).
* ``common``: masked tile loads/stores, dots and integer helpers.
"""
