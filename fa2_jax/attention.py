"""Public entry point: validation, backend choice, and the ``jax.custom_vjp`` around the kernels."""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from .config import BlockSizes
from .kernels.mosaic.common import MosaicConfig
from .kernels.vma import cast_like, match_vma
from .reference import reference_attention

_IMPLEMENTATIONS = (None, "triton", "mosaic", "xla")
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
MAX_HEAD_DIM = 256  # largest head_dim whose tiles fit the kernels' registers / shared memory


@dataclasses.dataclass(frozen=True)
class _Static:
  """Everything about a call that is not an array: hashable, passed as a nondiff argument."""

  scale: float
  is_causal: bool
  blocks: BlockSizes
  deterministic: bool
  interpret: bool
  # Ablation switches (benchmarks/ablation): FlashAttention-1 behaviour, not for normal use.
  normalize_each_step: bool = False
  seq_parallel: bool = True
  backend: str = "triton"  # "triton" | "mosaic"
  mosaic: MosaicConfig | None = None  # the Mosaic kernels' tiles (None: MosaicConfig.default)
  # dQ by atomic adds inside the dK/dV kernel (the paper's scheme) instead of a separate dQ pass.
  # Off by default: on an H200 the separate pass measured 367 TFLOP/s backward against 62 with
  # atomics (seq 8k, head_dim 128, bf16; benchmarks/results/h200/), and it is deterministic too.
  atomic_dq: bool = False


def _on_gpu() -> bool:
  return jax.default_backend() in ("gpu", "cuda", "rocm")


def _check_bool(name, value):
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a Python bool, got {type(value).__name__} {value!r}")
  return bool(value)


def _validate(query, key, value, scale, is_causal, implementation, return_residual, block_sizes,
              deterministic, interpret):
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
  if jnp.dtype(query.dtype) not in _DTYPES:
    raise TypeError(f"query/key/value dtype must be bfloat16, float16 or float32, got {query.dtype}")
  q4 = query.shape if query.ndim == 4 else (1, *query.shape)
  k4 = key.shape if key.ndim == 4 else (1, *key.shape)
  v4 = value.shape if value.ndim == 4 else (1, *value.shape)
  b, t, n, h = q4
  if k4 != v4:
    raise ValueError(f"key and value must have the same shape [B, S, K, H], got {tuple(key.shape)} "
                     f"and {tuple(value.shape)}")
  if k4[0] != b:
    raise ValueError(f"key/value batch size {k4[0]} does not match query batch size {b}")
  if k4[3] != h:
    raise ValueError(f"key/value head_dim {k4[3]} does not match query head_dim {h}")
  if t < 1 or k4[1] < 1:
    raise ValueError(f"sequence lengths must be >= 1, got query T={t}, key S={k4[1]}")
  if n < 1 or k4[2] < 1 or n % k4[2] != 0:
    raise ValueError(f"the query head count N={n} must be a positive multiple of the key/value "
                     f"head count K={k4[2]} (K < N is GQA, K == 1 is MQA)")
  if h < 1:
    raise ValueError(f"head_dim must be >= 1, got {h}")
  if scale is not None:
    if isinstance(scale, jax.core.Tracer):
      raise TypeError("scale must be a static Python float, not a traced value")
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (numbers.Real, np.ndarray)):
      raise TypeError(f"scale must be a Python float or None, got {type(scale).__name__}")
    if isinstance(scale, np.ndarray) and scale.shape != ():
      raise TypeError(f"scale must be a scalar, got an array of shape {scale.shape}")
    if not math.isfinite(float(scale)):
      raise ValueError(f"scale must be finite, got {scale}")
  is_causal = _check_bool("is_causal", is_causal)
  return_residual = _check_bool("return_residual", return_residual)
  deterministic = _check_bool("deterministic", deterministic)
  if interpret is not None:
    interpret = _check_bool("interpret", interpret)
  check_options(implementation, block_sizes)
  return is_causal, return_residual, deterministic, interpret


def check_options(implementation, block_sizes) -> None:
  """Validate the array-independent options (shared with the Flax adapter's factory)."""
  if implementation not in _IMPLEMENTATIONS:
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


# implementation=None picks the Mosaic GPU (Hopper) backend for the calls it supports on sm90+ (bf16/fp16,
# head_dim 64/128/192/256): on an H200 it measured 0.87-1.20x cuDNN in fwd+bwd against 0.66-0.96x for the
# Triton kernels (benchmarks/results/h200/attention_merged.md). Everything else runs the Triton kernels.
MOSAIC_BY_DEFAULT = True


def _is_sm90_or_newer() -> bool:
  if not _on_gpu():
    return False
  cc = getattr(jax.devices()[0], "compute_capability", None)
  try:
    return cc is not None and float(cc) >= 9.0
  except ValueError:
    return False


def _mosaic_reason(query, key, is_causal, interpret) -> str | None:
  """None when the Mosaic GPU backend can run this call here, else why not."""
  if interpret:
    return "it has no Pallas interpret mode here (interpret=True)"
  if not _is_sm90_or_newer():
    return f"it needs an sm90 (Hopper) or newer GPU; this platform is {jax.default_backend()}"
  from .kernels import mosaic
  return mosaic.supports(query.shape, key.shape, query.dtype, query.shape[-1], is_causal)


def _choose_backend(implementation, interpret, query, key, is_causal, block_sizes=None):
  head_dim = query.shape[-1]
  if implementation == "xla":
    return "xla"
  # With implementation=None the type of block_sizes names the kernels it tunes.
  if implementation is None and isinstance(block_sizes, MosaicConfig):
    implementation = "mosaic"
  if implementation == "mosaic":
    why = _mosaic_reason(query, key, is_causal, interpret)
    if why is not None:
      raise ValueError(f"implementation='mosaic' cannot run this call: {why}; use "
                       "implementation='triton' or None")
    return "mosaic"
  kernel_ok = head_dim <= MAX_HEAD_DIM
  if implementation == "triton":
    if not kernel_ok:
      raise ValueError(f"implementation='triton' supports head_dim <= {MAX_HEAD_DIM}, got "
                       f"{head_dim}; use implementation='xla' or None")
    if not interpret and not _on_gpu():
      raise ValueError(
          "implementation='triton' needs a GPU; on this platform "
          f"({jax.default_backend()}) pass interpret=True to run the kernel in Pallas interpret mode")
    return "triton"
  # implementation=None: Mosaic where enabled and supported, the Triton kernels on GPU (or wherever
  # interpret=True asks for them), else XLA.
  if (MOSAIC_BY_DEFAULT and not isinstance(block_sizes, BlockSizes)
      and _mosaic_reason(query, key, is_causal, interpret) is None):
    return "mosaic"
  if kernel_ok and (interpret or _on_gpu()):
    return "triton"
  return "xla"


def flash_attention(query, key, value, *, scale=None, is_causal=False, implementation=None,
                    return_residual=False, block_sizes=None, deterministic=False, interpret=None):
  """Exact attention, ``softmax(scale * Q K^T) V``, with FlashAttention-2 kernels.

  Args:
    query: ``[B, T, N, H]`` or ``[T, N, H]``.
    key, value: ``[B, S, K, H]`` (or ``[S, K, H]``), ``N % K == 0``: ``K < N`` is grouped-query
      attention, ``K == 1`` multi-query. K/V heads are shared without copies.
    scale: logit scale, default ``1 / sqrt(H)``. A static Python float.
    is_causal: query ``i`` attends keys ``j <= i`` (top-left aligned, as
      ``jax.nn.dot_product_attention``; for ``T > S`` rows past ``S`` see every key).
    implementation: None (on a Hopper GPU the Mosaic kernels for bf16/fp16 with head_dim 64, 128,
      192 or 256, the Triton kernels for every other call on a GPU, the XLA reference on CPU),
      ``"triton"``, ``"mosaic"`` (Hopper backend; raises a ValueError naming the reason on a call it
      cannot run) or ``"xla"`` (the reference formula).
    return_residual: also return ``lse`` ``[B, T, N]`` float32, the natural-log logsumexp of each
      row's scaled logits (differentiable).
    block_sizes: None for the per-head_dim defaults, a :class:`fa2_jax.BlockSizes` (tiles of the
      Triton kernels; with ``implementation=None`` it selects them) or a :class:`fa2_jax.MosaicConfig`
      (tiles of the Mosaic kernels; with ``implementation=None`` it selects them, and a call they
      cannot run raises a ValueError naming the reason).
    deterministic: guarantee a backward without atomics, bit-identical across runs (a separate dQ
      pass). With False (the default) the Mosaic backend on Hopper fuses dQ into the dK/dV kernel
      (TMA reduce-adds, ``MosaicConfig.dq_fused``; faster, the adds' order varies) for non-causal
      head_dim 64/128 calls; every other call already gets the deterministic separate dQ pass.
    interpret: True runs the Pallas kernels in interpret mode on any platform (CPU tests).

  Returns:
    ``out`` with the shape and dtype of ``query`` (and ``lse`` if ``return_residual``).
  """
  is_causal, return_residual, deterministic, interpret = _validate(
      query, key, value, scale, is_causal, implementation, return_residual, block_sizes,
      deterministic, interpret)
  squeeze = query.ndim == 3
  if squeeze:
    query, key, value = query[None], key[None], value[None]
  h = query.shape[-1]
  scale = 1.0 / math.sqrt(h) if scale is None else float(scale)
  backend = _choose_backend(implementation, interpret, query, key, is_causal, block_sizes)
  if backend == "xla":
    res = reference_attention(query, key, value, scale=scale, is_causal=is_causal,
                              return_residual=True)
  else:
    tri = block_sizes if isinstance(block_sizes, BlockSizes) else None
    blocks = (tri or BlockSizes.default(h, query.dtype)).clamp(query.shape[1], key.shape[1])
    mos = block_sizes if isinstance(block_sizes, MosaicConfig) else None
    if mos is not None and (why := mos.check(h, jnp.dtype(query.dtype).itemsize)) is not None:
      raise ValueError(f"block_sizes: {why}")
    static = _Static(scale=scale, is_causal=is_causal, blocks=blocks, deterministic=deterministic,
                     interpret=bool(interpret), backend=backend, mosaic=mos)
    res = _flash(*match_vma(query, key, value), static)
  out, lse = res
  if squeeze:
    out, lse = out[0], lse[0]
  return (out, lse) if return_residual else out


def flash_attention_ablation(query, key, value, *, scale=None, is_causal=False, block_sizes=None,
                             interpret=None, normalize_each_step=False, seq_parallel=True,
                             atomic_dq=False, return_residual=False):
  """The Triton kernels with the paper's ideas switched off one by one (for benchmarks/ablation).

  ``normalize_each_step=True`` rescales the accumulator by ``l`` every step (FlashAttention-1),
  ``seq_parallel=False`` runs one forward program per (batch, head) looping over query blocks, and
  ``atomic_dq=True`` accumulates dQ with atomic adds (the paper's scheme) instead of the separate dQ
  pass. Rank-4 inputs only.
  """
  _validate(query, key, value, scale, is_causal, "triton", False, block_sizes, False, interpret)
  for name, flag in (("normalize_each_step", normalize_each_step), ("seq_parallel", seq_parallel),
                     ("atomic_dq", atomic_dq), ("return_residual", return_residual)):
    _check_bool(name, flag)
  h = query.shape[-1]
  blocks = (block_sizes or BlockSizes.default(h, query.dtype)).clamp(query.shape[1], key.shape[1])
  static = _Static(scale=1.0 / math.sqrt(h) if scale is None else float(scale),
                   is_causal=bool(is_causal), blocks=blocks, deterministic=not atomic_dq,
                   interpret=bool(interpret), normalize_each_step=bool(normalize_each_step),
                   seq_parallel=bool(seq_parallel), atomic_dq=bool(atomic_dq))
  out, lse = _flash(*match_vma(query, key, value), static)
  return (out, lse) if return_residual else out


# --- custom_vjp core ------------------------------------------------------------------------------

def _forward(q, k, v, st: _Static):
  # The kernels index with int32 (program ids are int32); tracing them with x64 on would mix int64
  # Python constants into their index arithmetic, so every backend is traced with x64 off.
  with jax.enable_x64(False):
    if st.backend == "mosaic":
      from .kernels import mosaic
      out, lse = mosaic.forward(q, k, v, scale=st.scale, is_causal=st.is_causal,
                                config=st.mosaic)  # lse: [B, N, T]
      return cast_like(q, out, lse)
    from .kernels import triton as tk
    bs = st.blocks
    return tk.forward(q, k, v, scale=st.scale, is_causal=st.is_causal, block_q=bs.block_q,
                      block_k=bs.block_k, num_warps=bs.num_warps_fwd,
                      num_stages=bs.num_stages_fwd, interpret=st.interpret,
                      normalize_each_step=st.normalize_each_step, seq_parallel=st.seq_parallel)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _flash(q, k, v, st: _Static):
  out, lse = _forward(q, k, v, st)
  return out, jnp.swapaxes(lse, 1, 2)


def _flash_fwd(q, k, v, st: _Static):
  out, lse = _forward(q, k, v, st)
  return (out, jnp.swapaxes(lse, 1, 2)), (q, k, v, out, lse)


def _flash_bwd(st: _Static, residuals, cotangents):
  from .kernels import triton as tk
  q, k, v, out, lse = residuals
  dout, dlse = cotangents
  bs = st.blocks
  # d lse_i / d S_ij = P_ij, so a cotangent on lse enters dS = P ∘ (dP − D + dlse): fold it into D.
  dlse = jnp.swapaxes(dlse, 1, 2).astype(jnp.float32)  # [B, N, T]
  with jax.enable_x64(False):  # see _forward
    if st.backend == "mosaic":
      from .kernels import mosaic
      grads = mosaic.backward(q, k, v, out, lse, dout.astype(q.dtype), dlse=dlse, scale=st.scale,
                              is_causal=st.is_causal, deterministic=st.deterministic,
                              config=st.mosaic)
      return cast_like(q, *grads)
    dq, dk, dv = tk.backward(
        q, k, v, out, lse, dout.astype(q.dtype), dlse=dlse, scale=st.scale,
        is_causal=st.is_causal, block_q_dkv=bs.block_q_dkv, block_k_dkv=bs.block_k_dkv,
        block_q_dq=bs.block_q_dq, block_k_dq=bs.block_k_dq, num_warps=bs.num_warps_bwd,
        num_stages=bs.num_stages_bwd, atomic_dq=st.atomic_dq, interpret=st.interpret)
  return dq, dk, dv


_flash.defvjp(_flash_fwd, _flash_bwd)
