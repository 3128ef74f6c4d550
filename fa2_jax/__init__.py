"""fa2_jax: FlashAttention-2 for JAX as Pallas GPU kernels behind a ``jax.custom_vjp``.

    import fa2_jax
    out = fa2_jax.flash_attention(q, k, v, is_causal=True)   # q: [B, T, N, H], k/v: [B, S, K, H]
    print(fa2_jax.backend_for(q, k, is_causal=True))          # which kernels that call runs, and why
"""
import os as _os

# The kernels live in the top-level folder kernels/ of the source tree, which the wheel installs as
# fa2_jax/kernels (pyproject.toml's package-dir). Run from a checkout without installing, that folder
# sits beside this package instead: let `fa2_jax.kernels` resolve to it there.
_checkout_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if (not _os.path.isdir(_os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "kernels"))
    and _os.path.isfile(_os.path.join(_checkout_root, "kernels", "__init__.py"))
    and _checkout_root not in __path__):
  __path__.append(_checkout_root)

from .attention import backend_for, flash_attention  # noqa: E402
from .dispatch import Dispatch  # noqa: E402
from .kernels.mosaic.config import MosaicConfig  # noqa: E402
from .kernels.triton.config import BlockSizes  # noqa: E402
from .kernel_reuse import reuse_kernels_across_programs  # noqa: E402
from .reference import reference_attention  # noqa: E402

__all__ = ["flash_attention", "backend_for", "Dispatch", "BlockSizes", "MosaicConfig",
           "reference_attention", "reuse_kernels_across_programs"]
__version__ = "0.1.0"
