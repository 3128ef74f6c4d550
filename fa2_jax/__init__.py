"""fa2_jax: FlashAttention-2 for JAX as Pallas GPU kernels behind a ``jax.custom_vjp``.

    import fa2_jax
    out = fa2_jax.flash_attention(q, k, v, is_causal=True)   # q: [B, T, N, H], k/v: [B, S, K, H]
"""
from .attention import flash_attention
from .config import BlockSizes
from .kernels.mosaic.common import MosaicConfig
from .reference import reference_attention

__all__ = ["flash_attention", "BlockSizes", "MosaicConfig", "reference_attention"]
__version__ = "0.1.0"
