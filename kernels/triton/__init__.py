"""FlashAttention-2 on the Pallas Triton backend: forward (Alg. 1) and backward (Alg. 2)."""
from .backward import backward
from .forward import forward

__all__ = ["forward", "backward"]
