"""The plain attention formula in jnp, upcast: the reference for tests, benchmarks and ``"xla"``.

``softmax(scale * Q K^T + mask) V``, computed in float32 (or float64 when the inputs are float64 or
``precision=jnp.float64`` is asked for and x64 is on), then cast back to the query dtype. It builds the
full ``[B, N, T, S]`` score matrix, so its memory is quadratic in sequence length: it is the
definition, not a fast path.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from . import masking
from .validation import check_bool, check_scale, validate_qkv


def reference_attention(query, key, value, *, scale=None, is_causal=False, return_residual=False,
                        compute_dtype=None):
  """Reference attention on ``[B, T, N, H]`` / ``[B, S, K, H]`` inputs (GQA when ``K < N``).

  Args:
    query, key, value: arrays as in :func:`fa2_jax.flash_attention` (rank 4, or rank 3 without the
      batch axis); float64 inputs compute in float64.
    scale: logit scale, default ``1/sqrt(H)``.
    is_causal: top-left causal mask (see :mod:`fa2_jax.masking`).
    return_residual: also return ``lse`` of shape ``[B, T, N]`` (natural log, float32/64).
    compute_dtype: dtype of the arithmetic; default float32, or float64 if an input is float64.

  Returns:
    ``out`` with the query's dtype (and ``lse`` when asked).
  """
  validate_qkv(query, key, value)
  scale = check_scale(scale)
  is_causal = check_bool("is_causal", is_causal)
  return_residual = check_bool("return_residual", return_residual)
  if query.ndim == 3:
    res = reference_attention(query[None], key[None], value[None], scale=scale, is_causal=is_causal,
                              return_residual=return_residual, compute_dtype=compute_dtype)
    return tuple(x[0] for x in res) if return_residual else res[0]
  b, t, n, h = query.shape
  s, kh = key.shape[1], key.shape[2]
  if compute_dtype is None:
    compute_dtype = jnp.float64 if query.dtype == jnp.float64 else jnp.float32
  if scale is None:
    scale = 1.0 / math.sqrt(h)
  g = n // kh
  q = query.astype(compute_dtype).reshape(b, t, kh, g, h)
  k = key.astype(compute_dtype)
  v = value.astype(compute_dtype)
  prec = jax.lax.Precision.HIGHEST
  logits = jnp.einsum("btkgh,bskh->bkgts", q, k, precision=prec) * scale
  mask = masking.allowed(jnp.arange(t)[:, None], jnp.arange(s)[None, :], is_causal=is_causal)
  if mask is not None:
    logits = jnp.where(mask, logits, -jnp.inf)
  lse = jax.nn.logsumexp(logits, axis=-1)  # [B, K, G, T]
  # A row with no key (S = 0) gives zeros and lse = -inf, not NaN.
  safe_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
  probs = jnp.exp(logits - safe_lse[..., None])
  out = jnp.einsum("bkgts,bskh->btkgh", probs, v, precision=prec).reshape(b, t, n, h)
  out = out.astype(query.dtype)
  if return_residual:
    return out, lse.reshape(b, n, t).transpose(0, 2, 1)
  return out
