"""fa2_jax: FlashAttention-2 for JAX as Pallas GPU kernels behind a ``jax.custom_vjp``.

    import fa2_jax
    out = fa2_jax.flash_attention(q, k, v, is_causal=True)   # q: [B, T, N, H], k/v: [B, S, K, H]
    print(fa2_jax.backend_for(q, k, is_causal=True))          # which kernels that call runs, and why
"""
import importlib.util as _util

if _util.find_spec(f"{__name__}.kernels") is None:  # a source folder imported, not the package

  def _installed_elsewhere(folder: str) -> bool:
    """Whether a folder on the path other than this source tree's root holds an installed fa2_jax
    (one with its kernels)."""
    import os
    import sys
    root = os.path.realpath(os.path.dirname(folder))
    for entry in sys.path:
      where = os.path.realpath(entry or os.getcwd())
      if where != root and os.path.isdir(os.path.join(where, "fa2_jax", "kernels")):
        return True
    return False

  _folder = __path__[0]
  if _installed_elsewhere(_folder):  # e.g. `pip install .`, then Python started inside the clone
    raise ImportError(
        f"fa2_jax was imported from the source folder {_folder}, which shadows the installed "
        "package (Python looks in the current directory first) and has no kernels: run from "
        "outside the clone, or install it with `pip install -e .`, which imports from its root too")
  raise ImportError(
      f"fa2_jax was imported from the source folder {_folder}, which has no kernels (the folder "
      "kernels/ of the source tree becomes fa2_jax.kernels when installed): install the checkout "
      "first, e.g. `pip install -e .` from its root (scripts/setup.sh does)")
from .attention import backend_for, flash_attention
from .context_parallel import (context_parallel_attention, context_parallel_strategy,
                               context_positions, from_context_layout, to_context_layout)
from .dispatch import Dispatch
from .kernels.decode.config import DecodeConfig
from .kernels.sm90.config import MosaicConfig
from .kernels.triton.config import BlockSizes
from .kernel_reuse import reuse_kernels_across_programs
from .kv_cache import KVCache, PagedKVCache, prefill
from .reference import reference_attention

__all__ = ["flash_attention", "backend_for", "Dispatch", "BlockSizes", "DecodeConfig", "MosaicConfig",
           "reference_attention", "reuse_kernels_across_programs", "KVCache", "PagedKVCache",
           "prefill", "context_parallel_attention", "context_parallel_strategy",
           "to_context_layout", "from_context_layout", "context_positions"]
__version__ = "0.1.0"
