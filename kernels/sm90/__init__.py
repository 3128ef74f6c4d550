"""FlashAttention-2 on Hopper (sm90) as Pallas Mosaic GPU kernels: wgmma, TMA, warp specialisation.

Modules (import what you use; this package imports nothing eagerly, so ``import fa2_jax`` stays light):

* ``config``: :class:`MosaicConfig` (tiles, ring depths, warpgroups), its per-head_dim defaults, the
  shared-memory budget and ``supports(q_shape, k_shape, dtype, head_dim, is_causal,
  value_head_dim=None) -> None | reason``.
* ``forward``: ``forward(q, k, v, scale=..., is_causal=..., config=None) -> (out, stats [B, N, 2, T])``
  (the rows' statistics, ``kernels/softmax.py``; the lse follows from them).
* ``backward``: ``backward(q, k, v, out, stats, do, dlse=None, scale=..., is_causal=...,
  deterministic=True, config=None) -> (dq, dk, dv)``.
* ``schedule``: block ranges (causal block skipping) and the longest-first launch order.
* ``lengths``: ragged sequence lengths (TMA bounds or an HBM pad).
* ``ops``: wgmma idioms, the producer warpgroup's TMA ring, and the CPU emulation used by the tests.

bfloat16/float16, head_dims that are multiples of 16 up to 256 (V's may differ from Q/K's: MLA), GQA/MQA,
causal (top-left) or not, any sequence lengths.
Needs an sm90 GPU at run time; everything imports (and lowers for sm90) on CPU.
"""
