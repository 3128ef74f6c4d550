"""Argument checks shared by every public entry point: each bad input gets a ValueError or TypeError
that names the argument."""
from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from . import dispatch
from .kernels.mosaic.config import MosaicConfig
from .kernels.triton.config import BlockSizes

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def check_bool(name, value):
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a Python bool, got {type(value).__name__} {value!r}")
  return bool(value)


def is_static_dim(d) -> bool:
  return isinstance(d, (int, np.integer))


def check_scale(scale):
  if scale is None:
    return None
  if isinstance(scale, jax.core.Tracer):
    raise TypeError("scale must be a static Python float, not a traced value")
  if isinstance(scale, (bool, np.bool_)):
    raise TypeError(f"scale must be a Python float or None, got {type(scale).__name__}")
  if isinstance(scale, (np.ndarray, jax.Array)):
    if scale.shape != ():
      raise TypeError(f"scale must be a scalar, got an array of shape {scale.shape}")
    if np.dtype(scale.dtype).kind not in "fiu":
      raise TypeError(f"scale must be a real number, got an array of dtype {scale.dtype}")
    scale = float(scale)
  elif not isinstance(scale, numbers.Real):
    raise TypeError(f"scale must be a Python float or None, got {type(scale).__name__} {scale!r}")
  if not math.isfinite(float(scale)):
    raise ValueError(f"scale must be finite, got {scale}")
  return float(scale)


def validate_qkv(query, key, value) -> None:
  """Shape, rank and dtype checks of the three arrays (shared with :func:`fa2_jax.reference_attention`)."""
  for name, x in (("query", query), ("key", key), ("value", value)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"{name} must be a jax/numpy array, got {type(x).__name__}")
  if query.ndim not in (3, 4):
    raise ValueError(f"query must have rank 4 [B, T, N, H] or rank 3 [T, N, H], got shape "
                     f"{tuple(query.shape)}")
  for name, x in (("key", key), ("value", value)):
    if x.ndim != query.ndim:
      raise ValueError(f"{name} must have the same rank as query ({query.ndim}: "
                       f"{'[B, S, K, H]' if query.ndim == 4 else '[S, K, H]'}), got shape "
                       f"{tuple(x.shape)}")
  dtypes = {jnp.dtype(x.dtype) for x in (query, key, value)}
  if len(dtypes) != 1:
    raise TypeError(f"query, key and value must share one dtype, got {query.dtype}, {key.dtype}, "
                    f"{value.dtype}")
  if jnp.dtype(query.dtype) not in DTYPES + (jnp.dtype(jnp.float64),):
    raise TypeError(f"query/key/value dtype must be bfloat16, float16 or float32, got {query.dtype}")
  q4 = query.shape if query.ndim == 4 else (1, *query.shape)
  k4 = key.shape if key.ndim == 4 else (1, *key.shape)
  v4 = value.shape if value.ndim == 4 else (1, *value.shape)
  b, _, n, h = q4
  if k4 != v4:
    raise ValueError(f"key and value must have the same shape [B, S, K, H], got {tuple(key.shape)} "
                     f"and {tuple(value.shape)}")
  if k4[0] != b:
    raise ValueError(f"key/value batch size {k4[0]} does not match query batch size {b}")
  if k4[3] != h:
    raise ValueError(f"key/value head_dim {k4[3]} does not match query head_dim {h}")
  kh = k4[2]
  if is_static_dim(n) and is_static_dim(kh) and (n < 1 or kh < 1 or n % kh != 0):
    raise ValueError(f"the query head count N={n} must be a positive multiple of the key/value "
                     f"head count K={kh} (K < N is GQA, K == 1 is MQA)")
  if is_static_dim(h) and h < 1:
    raise ValueError(f"head_dim must be >= 1, got {h}")


def check_options(implementation, block_sizes) -> None:
  """Validate the array-independent options (shared with the Flax adapter's factory)."""
  if implementation not in dispatch.IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of None, 'triton', 'mosaic', 'xla', got "
                     f"{implementation!r}")
  if block_sizes is not None and not isinstance(block_sizes, (BlockSizes, MosaicConfig)):
    raise TypeError(f"block_sizes must be a fa2_jax.BlockSizes (Triton kernels), a "
                    f"fa2_jax.MosaicConfig (Mosaic kernels) or None, got {type(block_sizes).__name__}")
  if isinstance(block_sizes, MosaicConfig) and implementation == "triton":
    raise TypeError("block_sizes is a MosaicConfig, which configures implementation='mosaic'; the "
                    "Triton kernels take a fa2_jax.BlockSizes")
  if isinstance(block_sizes, BlockSizes) and implementation == "mosaic":
    raise TypeError("block_sizes is a BlockSizes, which configures the Triton kernels; "
                    "implementation='mosaic' takes a fa2_jax.MosaicConfig")
