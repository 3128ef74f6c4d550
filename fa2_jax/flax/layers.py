"""Ready Flax layers on fa2_jax: causal self-attention blocks (linen and nnx) with grouped-query heads,
rotary position embeddings and the attention variants of :func:`fa2_jax.flash_attention` (sliding
windows, soft-capping, ALiBi, ``mask_fn``/``score_fn`` as fields; packed documents, padding lengths and
query offsets per call). Re-exported by :mod:`fa2_jax.flax`; import them from there."""
from __future__ import annotations

import functools
import numbers
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
from flax import nnx

from .attention import FlashAttentionFn, attention_fn
from .variants import check_static_variants
from ..kv_cache import KVCache, PagedKVCache
from ..validation import is_real_dtype, positive_int


# --- rotary position embeddings -------------------------------------------------------------------

def rotary_embedding(x: jax.Array, positions: jax.Array | None = None, *,
                     base: float = 10000.0) -> jax.Array:
  """Rotary position embedding (RoPE, Su et al. 2021), "rotate half" convention as nnx.RoPE.

  Channel ``i`` and ``i + H/2`` of each head are rotated by the angle ``pos * base**(-2i/H)``.
  Computed in float32 and cast back to ``x.dtype``.

  Args:
    x: ``[batch..., length, heads, head_dim]`` with an even head_dim.
    positions: integer positions ``[batch..., length]`` or ``[length]``; default ``arange(length)``.
    base: the wavelength base (10000 in the paper).

  Raises:
    ValueError: odd head_dim, positions whose length differs from x's, or a base that is not a
      finite number > 0.
  """
  _check_base(base)
  t, h = x.shape[-3], x.shape[-1]
  if h % 2:
    raise ValueError(f"rotary embeddings need an even head_dim, got {h}")
  if positions is None:
    positions = jnp.arange(t)
  elif positions.shape[-1] != t:
    raise ValueError(f"positions must have length {t} (x's length axis), got shape "
                     f"{positions.shape}")
  half = h // 2
  inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles = positions.astype(jnp.float32)[..., None] * lax.broadcast_to_rank(
      inv_freq, positions.ndim + 1)  # [..., T, H/2]
  # broadcast over heads (and, for positions without x's batch axes, over those: at x's rank, as
  # jax_numpy_rank_promotion="raise" asks)
  cos, sin = (lax.broadcast_to_rank(f(angles)[..., None, :], x.ndim) for f in (jnp.cos, jnp.sin))
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


# --- causal self-attention modules ----------------------------------------------------------------

def _check_base(base) -> None:
  """The RoPE wavelength base: a finite number > 0 (traced values are not checked)."""
  if isinstance(base, jax.core.Tracer):
    return
  if isinstance(base, (bool, np.bool_)) or not isinstance(base, (numbers.Real, np.ndarray, jax.Array)):
    raise TypeError(f"rotary_base must be a real number, got {type(base).__name__} {base!r}")
  if np.ndim(base) != 0 or not np.isfinite(float(base)) or float(base) <= 0:
    raise ValueError(f"rotary_base must be a finite number > 0, got {base!r}")


def _check_heads(num_heads: int, num_kv_heads: int | None, head_dim: int, rotary: bool,
                 rotary_base=10000.0, out_features=None) -> int:
  """Validates the head counts, the RoPE base and the output width; returns num_kv_heads (default:
  num_heads, plain multi-head)."""
  if out_features is not None:
    positive_int("out_features", out_features, extra=" or None (the input width)")
  _check_base(rotary_base)
  kv = num_heads if num_kv_heads is None else num_kv_heads
  for name, v in (("num_heads", num_heads), ("num_kv_heads", kv), ("head_dim", head_dim)):
    positive_int(name, v)
  if num_heads % kv:
    raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({kv}) "
                     "(num_kv_heads < num_heads is grouped-query attention)")
  if rotary and head_dim % 2:
    raise ValueError(f"rotary=True needs an even head_dim, got head_dim={head_dim}")
  return kv


def _split_heads(qkv: jax.Array, num_heads: int, num_kv_heads: int):
  """``[..., T, N + 2K, H]`` from the fused projection -> q ``[..., T, N, H]``, k, v ``[..., T, K, H]``."""
  return jnp.split(qkv, [num_heads, num_heads + num_kv_heads], axis=-2)


def _static_variants(local_window_size, logits_soft_cap, alibi_slopes, mask_fn, score_fn) -> dict:
  """The module's static variant fields that are set, as keyword arguments of the attention_fn."""
  if alibi_slopes is not None:
    alibi_slopes = jnp.asarray(alibi_slopes, jnp.float32)  # [num_heads]
  static = dict(local_window_size=local_window_size, logits_soft_cap=logits_soft_cap,
                alibi_slopes=alibi_slopes, mask_fn=mask_fn, score_fn=score_fn)
  return {k: v for k, v in static.items() if v is not None}


def _plain_window(window):
  """``local_window_size`` with Python ints (a numpy or JAX integer scalar as given would be kept
  as such by nnx, and compared elementwise); checked already (:func:`_check_static_fields`)."""
  if window is None:
    return None
  if isinstance(window, (tuple, list)):
    return tuple(None if w is None else int(w) for w in window)
  return int(window)


def _check_static_fields(num_heads: int, local_window_size, logits_soft_cap, alibi_slopes, mask_fn,
                         score_fn) -> None:
  """The static variant fields, checked when the module is made (ValueError/TypeError naming one)."""
  check_static_variants(local_window_size=local_window_size, logits_soft_cap=logits_soft_cap,
                         mask_fn=mask_fn, score_fn=score_fn)
  if alibi_slopes is not None:
    slopes = np.asarray(alibi_slopes)
    if slopes.shape != (num_heads,) or not is_real_dtype(slopes.dtype):
      raise ValueError(f"alibi_slopes must be {num_heads} real numbers (one per query head), got "
                       f"{alibi_slopes!r}")


def _attend(q, k, v, attend_fn, rotary: bool, base: float, positions, mask, variants: dict):
  """Rotary embeddings, then ``attend_fn(q, k, v, [mask=mask,] is_causal=True, **variants)`` with the
  variant arguments that are set (functions without them still work without them)."""
  if rotary:
    q, k = rotary_embedding(q, positions, base=base), rotary_embedding(k, positions, base=base)
  variants = {k_: v_ for k_, v_ in variants.items() if v_ is not None}
  if mask is not None:
    variants["mask"] = mask
  return attend_fn(q, k, v, is_causal=True, **variants)


def _module_variants(module, **call) -> dict:
  """The variant keyword arguments of one call of either module: its static fields that are set
  (:func:`_static_variants`) and this call's per-batch arrays (``query_seq_lengths`` ...
  ``q_offset``)."""
  variants = _static_variants(module.local_window_size, module.logits_soft_cap,
                              module.alibi_slopes, module.mask_fn, module.score_fn)
  variants.update(call)
  return variants


def _cached_attend(module, q, k, v, positions, mask, cache, query_seq_lengths, **set_by_cache):
  """The ``cache=`` path of both modules: rotary embeddings at the cache's positions, the new keys
  and values appended to ``cache``, the queries attended against it. Returns ``(y, new cache)``."""
  if not isinstance(cache, (KVCache, PagedKVCache)):
    raise TypeError(f"cache must be a fa2_jax.KVCache or fa2_jax.PagedKVCache, got "
                    f"{type(cache).__name__}")
  given = sorted(name for name, value in set_by_cache.items() if value is not None)
  if mask is not None:
    given.insert(0, "mask")
  if given:
    raise TypeError(f"{', '.join(given)} cannot be passed with cache: the cache sets the keys' "
                    "lengths and the queries' positions (causal attention of the new rows)")
  if q.ndim != 4:
    raise ValueError(f"with cache, x must be [batch, T, features], got a query of shape "
                     f"{tuple(q.shape)} [.., T, heads, head_dim]")
  # the layer's own sizes against the cache's (append would name its k_new/v_new instead)
  layer = dict(batch=q.shape[0], kv_heads=k.shape[2], head_dim=k.shape[3], value_head_dim=v.shape[3])
  held = dict(batch=cache.batch, kv_heads=cache.kv_heads, head_dim=cache.head_dim,
              value_head_dim=cache.value_head_dim)
  wrong = [f"{name} {held[name]} (this call: {layer[name]})" for name in layer
           if layer[name] != held[name]]
  if wrong:
    raise ValueError(f"cache does not fit this layer and input: it holds {', '.join(wrong)}; "
                     "create it with the layer's kv heads and head dims and the input's batch")
  if cache.dtype != k.dtype:
    raise TypeError(f"cache holds {cache.dtype} keys and values, this layer computes them in "
                    f"{k.dtype}: create the cache with dtype={k.dtype} (or set the layer's dtype)")
  if positions is None:  # the new rows continue each batch row's sequence
    positions = cache.lengths[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)[None, :]
  if module.rotary:
    q = rotary_embedding(q, positions, base=module.rotary_base)
    k = rotary_embedding(k, positions, base=module.rotary_base)
  cache = cache.append(k, v, lengths=query_seq_lengths)
  variants = _static_variants(module.local_window_size, module.logits_soft_cap, module.alibi_slopes,
                              module.mask_fn, module.score_fn)
  # The module's attention_fn where it is fa2_jax's (it takes q_offset and the lengths); other
  # functions (jax.nn.dot_product_attention) have no q_offset: fa2_jax.flash_attention runs instead.
  fn = module.attention_fn if isinstance(module.attention_fn, FlashAttentionFn) else None
  y = cache.attend(q, query_seq_lengths=query_seq_lengths, attention_fn=fn, **variants)
  return y, cache


class CausalSelfAttention(nn.Module):
  """Causal self-attention (linen) with GQA and optional rotary embeddings, on FlashAttention.

  ``x [batch..., T, features] -> [batch..., T, out_features or features]``. One fused projection
  makes ``num_heads`` query and ``num_kv_heads`` key/value heads of ``head_dim``; attention runs
  through ``attention_fn(q, k, v, is_causal=True)`` (any function with that call form, e.g.
  ``functools.partial(jax.nn.dot_product_attention, implementation="xla")``; with a ``mask``,
  ``attention_fn(q, k, v, mask=mask, is_causal=True)``). The variant fields and call arguments that
  are set are passed to it as keyword arguments of :func:`fa2_jax.flash_attention`'s names (and only
  those: a function without them works as long as they are unset).

  Attributes:
    num_heads: query heads.
    head_dim: channels per head.
    num_kv_heads: key/value heads (default num_heads); must divide num_heads.
    out_features: output width (default: the input width).
    rotary: apply rotary position embeddings to q and k.
    rotary_base: RoPE wavelength base.
    use_bias: biases in the projections.
    dtype: compute dtype (e.g. bfloat16); None infers from inputs and params.
    param_dtype: parameter dtype.
    kernel_init: initializer of the qkv projection.
    out_kernel_init: initializer of the output projection (default kernel_init).
    attention_fn: the attention core, default :data:`fa2_jax.flax.attention_fn`.
    local_window_size: sliding window, an int ``w`` or ``(left, right)`` as in
      :func:`fa2_jax.flash_attention`; with the causal mask ``(w, 0)``: query ``p`` attends keys
      ``p - w .. p``. None: no window.
    logits_soft_cap: ``cap * tanh(s / cap)`` on the scaled logits (a float > 0), or None.
    alibi_slopes: one ALiBi slope per query head (a tuple of floats), or None.
    mask_fn, score_fn: as in :func:`fa2_jax.flash_attention`, or None.
  """

  num_heads: int
  head_dim: int
  num_kv_heads: int | None = None
  out_features: int | None = None
  rotary: bool = False
  rotary_base: float = 10000.0
  use_bias: bool = False
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Callable = nn.linear.default_kernel_init
  out_kernel_init: Callable | None = None
  attention_fn: Callable[..., jax.Array] = attention_fn  # the module-level default above
  local_window_size: int | tuple[int | None, int | None] | None = None
  logits_soft_cap: float | None = None
  alibi_slopes: tuple[float, ...] | None = None
  mask_fn: Callable | None = None
  score_fn: Callable | None = None

  def __post_init__(self):
    _check_heads(self.num_heads, self.num_kv_heads, self.head_dim, self.rotary, self.rotary_base,
                 self.out_features)
    _check_static_fields(self.num_heads, self.local_window_size, self.logits_soft_cap,
                         self.alibi_slopes, self.mask_fn, self.score_fn)
    super().__post_init__()

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array | None = None,
               mask: jax.Array | None = None, *, query_seq_lengths: jax.Array | None = None,
               key_value_seq_lengths: jax.Array | None = None,
               q_segment_ids: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
               q_offset: jax.Array | int | None = None,
               cache: KVCache | PagedKVCache | None = None):
    """Causal self-attention of ``x``.

    Args:
      x: ``[batch..., T, features]``.
      positions: ``[batch..., T]`` integer positions for rotary (default ``arange(T)``); e.g.
        restarting at 0 at each packed document.
      mask: optional, broadcastable to ``[batch..., num_heads, T, T]``, nonzero where a query may
        attend a key (e.g. ``nn.make_attention_mask(tokens != pad, tokens != pad)``), AND-ed with
        the causal mask. The kernel takes no dense mask: pass the segment ids or lengths below
        instead (see :func:`make_attention_fn`).
      query_seq_lengths, key_value_seq_lengths: integer ``[batch...]``: rows / keys past them are
        padding (padded rows get output 0).
      q_segment_ids, kv_segment_ids: integer ``[batch..., T]`` (both, usually the same array):
        tokens attend only tokens of their own segment (packed documents).
      q_offset: int, integer scalar or integer ``[batch...]``: the position of query row 0 for the
        causal mask and the window (not for ``positions``).
      cache: a :class:`fa2_jax.KVCache` (or ``PagedKVCache``) of this layer, for decoding
        (forward-only): ``x`` ``[batch, T, features]`` holds the next ``T`` tokens of each batch
        row; their keys and values are appended to the cache and their queries attend it causally
        (:meth:`fa2_jax.KVCache.attend`). ``positions`` defaults to ``cache.lengths[:, None] +
        arange(T)``; ``query_seq_lengths`` gives each row's count of valid new tokens (prompts of
        different lengths); ``mask``, ``key_value_seq_lengths``, segment ids and ``q_offset``
        cannot be given (the cache sets them). Runs the ``attention_fn`` when it is a
        :class:`FlashAttentionFn`, else :func:`fa2_jax.flash_attention`.

    Returns:
      ``[batch..., T, out_features or features]``; with ``cache``, ``(output, new cache)``.
    """
    kv = self.num_kv_heads or self.num_heads
    dense = functools.partial(nn.DenseGeneral, use_bias=self.use_bias, dtype=self.dtype,
                              param_dtype=self.param_dtype)
    qkv = dense(features=(self.num_heads + 2 * kv, self.head_dim), kernel_init=self.kernel_init,
                name="qkv")(x)
    q, k, v = _split_heads(qkv, self.num_heads, kv)
    width = x.shape[-1] if self.out_features is None else self.out_features
    out = dense(features=width, axis=(-2, -1), kernel_init=self.out_kernel_init or self.kernel_init,
                name="out")
    if cache is not None:
      y, cache = _cached_attend(self, q, k, v, positions, mask, cache, query_seq_lengths,
                                key_value_seq_lengths=key_value_seq_lengths,
                                q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                                q_offset=q_offset)
      return out(y), cache
    variants = _module_variants(self, query_seq_lengths=query_seq_lengths,
                                key_value_seq_lengths=key_value_seq_lengths,
                                q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                                q_offset=q_offset)
    y = _attend(q, k, v, self.attention_fn, self.rotary, self.rotary_base, positions, mask,
                variants)
    return out(y)


class NnxCausalSelfAttention(nnx.Module):
  """The nnx twin of :class:`CausalSelfAttention` (same arguments, plus in_features and rngs)."""

  def __init__(self, in_features: int, num_heads: int, head_dim: int, *,
               num_kv_heads: int | None = None, out_features: int | None = None,
               rotary: bool = False, rotary_base: float = 10000.0, use_bias: bool = False,
               dtype: Any = None, param_dtype: Any = jnp.float32,
               kernel_init: Callable = nnx.nn.linear.default_kernel_init,
               out_kernel_init: Callable | None = None,
               attention_fn: Callable[..., jax.Array] = attention_fn,
               local_window_size: int | tuple[int | None, int | None] | None = None,
               logits_soft_cap: float | None = None, alibi_slopes: tuple[float, ...] | None = None,
               mask_fn: Callable | None = None, score_fn: Callable | None = None,
               rngs: nnx.Rngs):
    self.num_heads, self.head_dim = num_heads, head_dim
    self.num_kv_heads = _check_heads(num_heads, num_kv_heads, head_dim, rotary, rotary_base,
                                     out_features)
    _check_static_fields(num_heads, local_window_size, logits_soft_cap, alibi_slopes, mask_fn,
                         score_fn)
    self.in_features = in_features
    # a numpy/JAX scalar base as a float; a traced one (a block built inside jax.jit) as it is
    self.rotary = rotary
    self.rotary_base = rotary_base if isinstance(rotary_base, jax.core.Tracer) else float(rotary_base)
    self.attention_fn = attention_fn
    # Static: a plain int / tuple / float / function (no arrays or numpy scalars, which nnx would
    # compare elementwise between graphs or find traced under nnx.jit), so nnx keeps them out of the
    # state.
    self.local_window_size = _plain_window(local_window_size)
    self.logits_soft_cap = None if logits_soft_cap is None else float(logits_soft_cap)
    self.alibi_slopes = None if alibi_slopes is None else tuple(float(a) for a in alibi_slopes)
    self.mask_fn, self.score_fn = mask_fn, score_fn
    linear = functools.partial(nnx.LinearGeneral, use_bias=use_bias, dtype=dtype,
                               param_dtype=param_dtype, rngs=rngs)
    self.qkv = linear(in_features, (num_heads + 2 * self.num_kv_heads, head_dim),
                      kernel_init=kernel_init)
    width = in_features if out_features is None else out_features
    self.out = linear((num_heads, head_dim), width, axis=(-2, -1),
                      kernel_init=out_kernel_init or kernel_init)

  def __call__(self, x: jax.Array, positions: jax.Array | None = None,
               mask: jax.Array | None = None, *, query_seq_lengths: jax.Array | None = None,
               key_value_seq_lengths: jax.Array | None = None,
               q_segment_ids: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
               q_offset: jax.Array | int | None = None,
               cache: KVCache | PagedKVCache | None = None):
    """x: ``[batch..., T, in_features]``; the other arguments as in :class:`CausalSelfAttention`
    (with ``cache``: returns ``(output, new cache)``)."""
    want = tuple(self.in_features) if isinstance(self.in_features, (tuple, list)) else (
        self.in_features,)  # nnx.LinearGeneral takes an int or a tuple of trailing dims
    if tuple(x.shape[-len(want):]) != want:
      raise ValueError(f"x must end in in_features = {self.in_features} (its trailing dims), got "
                       f"shape {tuple(x.shape)}")
    q, k, v = _split_heads(self.qkv(x), self.num_heads, self.num_kv_heads)
    if cache is not None:
      y, cache = _cached_attend(self, q, k, v, positions, mask, cache, query_seq_lengths,
                                key_value_seq_lengths=key_value_seq_lengths,
                                q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                                q_offset=q_offset)
      return self.out(y), cache
    variants = _module_variants(self, query_seq_lengths=query_seq_lengths,
                                key_value_seq_lengths=key_value_seq_lengths,
                                q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                                q_offset=q_offset)
    y = _attend(q, k, v, self.attention_fn, self.rotary, self.rotary_base, positions, mask,
                variants)
    return self.out(y)
