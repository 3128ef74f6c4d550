"""FlashAttention-2 on Hopper (sm90) as Pallas Mosaic GPU kernels: wgmma, TMA, warp specialisation.

Entry points (same signatures as the Triton backend's ``forward``/``backward`` plus ``config``):

    out, lse = forward(q, k, v, scale=..., is_causal=..., config=None)        # lse: [B, N, T] f32
    dq, dk, dv = backward(q, k, v, out, lse, do, dlse=None, scale=..., is_causal=...,
                          deterministic=True, config=None)
    supports(q_shape, k_shape, dtype, head_dim, is_causal) -> None | reason

bfloat16/float16, head_dim 64/128/192/256, GQA/MQA, causal (top-left) or not, any sequence lengths.
Needs an sm90 GPU at run time; everything imports (and lowers, see ``ops``) on CPU.
Self-test on a GPU: ``python -m fa2_jax.kernels.mosaic.selftest``.
"""
from .backward import backward
from .common import MosaicConfig, supports
from .forward import forward

AVAILABLE = True  # importable; whether a call can run is ``supports(...)`` plus an sm90 GPU

__all__ = ["forward", "backward", "supports", "MosaicConfig", "AVAILABLE"]
