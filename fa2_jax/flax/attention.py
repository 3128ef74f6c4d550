"""The Flax adapter: :func:`attention_fn` and :func:`make_attention_fn`, a drop-in ``attention_fn`` for
flax's attention layers that runs :func:`fa2_jax.flash_attention` (or says why it cannot, and uses
flax's formula). Re-exported, with the ready layers, by :mod:`fa2_jax.flax`: import them from there
(its docstring shows the use)."""
from __future__ import annotations

import functools
import inspect
import math
import os
import pathlib
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

try:
  import flax.linen as nn
  from flax import nnx
except ImportError as e:  # flax is an optional dependency (the [flax] extra)
  raise ImportError("fa2_jax.flax needs Flax: pip install 'fa2_jax[flax]' (or pip install flax)"
                    ) from e

from ..attention import flash_attention
from ..validation import DTYPES as _KERNEL_DTYPES
from .variants import check_static_variants, flash_any_batch, merge_variants
from ..validation import check_bool, check_options, is_static_dim

__all__ = ["attention_fn", "make_attention_fn", "FlashAttentionFn", "FlashAttentionFallbackWarning"]


class FlashAttentionFallbackWarning(UserWarning):
  """A call to :func:`attention_fn` was computed with flax's formula instead of the kernel."""


class TopLeftQueryRowWarning(UserWarning):
  """A one-row query with a positional variant and no causal flag or ``q_offset`` sits at position 0
  (flax's top-left alignment): right for cross-attention, not for a decode step."""


# Variants that depend on the query row's position (a lone decode row is placed at the last key).
_POSITIONAL = frozenset({"local_window_size", "alibi_slopes", "mask_fn", "score_fn"})

# What computes a call whose dense mask the kernels cannot take when it has variants.
_VARIANTS_FORMULA = ("fa2_jax's XLA formula (implementation=\"xla\") with the variants and the mask "
                     "as a mask_fn; a query row the mask leaves no key gives zero there, not "
                     "flax's mean of the values")


def _library_dirs() -> tuple[str, ...]:
  """The folders of fa2_jax, flax, jax and jaxlib: a warning names the first frame outside them
  (the user's call, through flax's layers and jax's tracing)."""
  import flax
  import jaxlib
  files = [pathlib.Path(m.__file__).parent for m in (flax, jax, jaxlib)]
  files.append(pathlib.Path(__file__).parents[1])  # fa2_jax
  # as imported (a frame's file name) and with links resolved
  dirs = {str(p) for d in files for p in (d.absolute(), d.resolve())}
  return tuple(sorted(d + os.sep for d in dirs))


def _warn(message: str, category: type[Warning]) -> None:
  """A warning at the user's line. Python's warning filters decide its repeats: by default once per
  message and calling line; ``"always"``, ``"error"`` and ``pytest.warns`` see every one."""
  warnings.warn(message, category, skip_file_prefixes=_LIBRARY_DIRS)


_LIBRARY_DIRS = _library_dirs()

# What to pass instead of a causal mask, in each flax API.
_CAUSAL_FLAG = ("pass is_causal=True and no mask instead (nnx: layer(x, is_causal=True); linen: "
                "attention_fn=fa2_jax.flax.make_attention_fn(is_causal=True))")
# What to pass instead of a dense mask (every such advice ends in "dense masks run the XLA formula":
# tests and users match on it).
_NO_MASK_ARGUMENT = ("To run the kernel, pass q_segment_ids/kv_segment_ids or query_seq_lengths/"
                     "key_value_seq_lengths instead of a dense mask (padding, packed documents), "
                     "local_window_size or mask_fn for other patterns (fa2_jax.flax's attention_fn "
                     "and CausalSelfAttention take them as keyword arguments); a decode cache's "
                     "mask has no such argument: dense masks run the XLA formula.")
# What to pass instead of a dense bias.
_NO_BIAS_ARGUMENT = ("To run the kernel, pass alibi_slopes (ALiBi) or score_fn (any elementwise "
                     "function of the score and its indices) instead of a dense bias: dense biases "
                     "run the XLA formula.")

def _warn_fallback(reason: str, advice: str, formula: str = "flax's dot_product_attention formula"
               ) -> None:
  message = (f"fa2_jax.flax.attention_fn: {reason}; the FlashAttention kernel cannot honour this, "
             f"so the call uses {formula} (the same math, with O(T*S) memory). {advice}")
  _warn(message, FlashAttentionFallbackWarning)


def _warn_top_left_row(variants: dict) -> None:
  """A lone query row with a positional variant and no causal flag or ``q_offset``
  keeps flax's top-left position 0, right for cross-attention but not for a decode step."""
  message = (
      "fa2_jax.flax.attention_fn: a single query row with "
      f"{', '.join(sorted(_POSITIONAL.intersection(variants)))} and neither is_causal nor "
      "q_offset sits at position 0 (flax's top-left alignment, as in cross-attention). For a "
      "decode step (decode=True) make the attention_fn with make_attention_fn(is_causal=True), "
      "which places the row at the last key its cache mask allows, or pass q_offset")
  _warn(message, TopLeftQueryRowWarning)


def _check_arrays(query, key, value, bias, mask) -> None:
  """Shapes flax's layers produce; anything else raises an error naming the argument."""
  for name, x in (("query", query), ("key", key), ("value", value), ("bias", bias),
                  ("mask", mask)):
    if x is not None and (not hasattr(x, "shape") or not hasattr(x, "dtype")):
      raise TypeError(f"{name} must be a jax/numpy array, got {type(x).__name__}")
  if query.ndim < 3:
    raise ValueError(f"query must be [batch..., q_length, num_heads, head_dim] (rank >= 3), got "
                     f"shape {tuple(query.shape)}")
  for name, x in (("key", key), ("value", value)):
    if x.ndim != query.ndim:
      raise ValueError(f"{name} must have the rank of query ({query.ndim}: [batch..., kv_length, "
                       f"num_kv_heads, head_dim]), got shape {tuple(x.shape)}")
  if key.shape[:-1] != value.shape[:-1]:
    raise ValueError(f"key and value must share [batch..., kv_length, num_kv_heads], got shapes "
                     f"{tuple(key.shape)} and {tuple(value.shape)}")
  if key.shape[:-3] != query.shape[:-3]:
    raise ValueError(f"key/value batch dims {tuple(key.shape[:-3])} must equal query's "
                     f"{tuple(query.shape[:-3])}")
  if key.shape[-1] != query.shape[-1]:
    raise ValueError(f"key head_dim {key.shape[-1]} must equal query head_dim {query.shape[-1]}")
  n, kh = query.shape[-2], key.shape[-2]
  if is_static_dim(n) and is_static_dim(kh) and (kh < 1 or n % kh):
    raise ValueError(f"query num_heads ({n}) must be a multiple of key/value num_heads ({kh}) "
                     "(fewer key/value heads is grouped-query attention)")
  logits = (*query.shape[:-3], n, query.shape[-3], key.shape[-3])  # [batch..., N, T, S]
  for name, x in (("mask", mask), ("bias", bias)):
    if x is None:
      continue
    try:
      fits = jnp.broadcast_shapes(tuple(x.shape), logits) == logits
    except ValueError:
      fits = False
    if not fits:
      raise ValueError(f"{name} must broadcast to [batch..., num_heads, q_length, kv_length] = "
                       f"{logits}, got shape {tuple(x.shape)}")


def _check_dropout(dropout_rate, deterministic, dropout_rng) -> None:
  if isinstance(dropout_rate, jax.core.Tracer):
    if not deterministic:  # flax's formula, which would apply it, needs a concrete rate as well
      raise TypeError("dropout_rate must be a concrete float when deterministic=False (attention "
                      "dropout runs flax's formula, which branches on the rate), got a traced value; "
                      "with deterministic=True a traced rate is ignored as flax ignores it")
    return
  if isinstance(dropout_rate, (np.ndarray, jax.Array)) and dropout_rate.shape == ():
    dropout_rate = dropout_rate.item()
  if isinstance(dropout_rate, bool) or not isinstance(dropout_rate, (int, float, np.number)):
    raise TypeError(f"dropout_rate must be a float in [0, 1), got {type(dropout_rate).__name__} "
                    f"{dropout_rate!r}")
  if not 0.0 <= dropout_rate < 1.0:
    raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")
  if dropout_rate > 0.0 and deterministic is False and dropout_rng is None:
    raise ValueError(f"dropout_rate={dropout_rate} with deterministic=False needs a dropout_rng")


def _fallback_reason(dtype, bias, dropout_rate, deterministic, module, einsums,
                     extra) -> tuple[str, str] | None:
  """Why this call cannot run on the kernel and what to pass instead, or None when it can.

  The mask is judged separately (:func:`_mask_as_flag`): only this call's other arguments here.
  """
  if bias is not None:
    return ("an attention `bias` was passed", _NO_BIAS_ARGUMENT)
  # flax's order: `deterministic` first, so that a traced rate with dropout off runs the kernel
  # (_check_dropout refuses one with dropout on).
  if not deterministic and dropout_rate > 0.0:
    return (f"attention dropout (dropout_rate={dropout_rate}, deterministic=False) was asked for",
            "The kernel has no attention dropout: pass deterministic=True (or dropout_rate=0.0) "
            "to run it.")
  if module is not None:
    return ("the attention weights are to be sown (sow_weights=True / module=...)",
            "The kernel never forms the weights: call without sow_weights to run it.")
  if any(e is not None for e in einsums):
    return ("custom attention einsums were passed",
            "Leave qk_attn_weights_einsum / attn_weights_value_einsum unset to run the kernel.")
  if extra:
    return (f"unsupported arguments {sorted(extra)} were passed",
            "Leave them unset (None) to run the kernel.")
  if jnp.dtype(dtype) not in _KERNEL_DTYPES:
    return (f"dtype {jnp.dtype(dtype)} is not bfloat16, float16 or float32",
            "Pass dtype=jnp.float32 (or bfloat16/float16) to run the kernel.")
  return None


# What to pass instead of a decode step's cache mask.
_NO_CACHE_MASK_ARGUMENT = ("flax's decode=True layers hand their key/value cache to attention_fn with "
                           "a dense mask, which runs the kernel where it allows each row a prefix "
                           "of the keys (the cache's mask, right padding) and has no head axis; "
                           "called directly, fa2_jax.flax.attention_fn takes the cache's "
                           "key_value_seq_lengths and q_offset instead and runs the kernel: other "
                           "dense masks run the XLA formula.")


def _mask_reason(mask, is_causal: bool, one_row: bool = False,
                 shifted: bool = False) -> tuple[str, str]:
  """The fallback warning for a mask that :func:`_mask_as_flag` could not replace by the flag;
  ``one_row``: the call has one query row (as a decode step has); ``shifted``: it gives
  ``q_offset``."""
  if one_row:
    return ("a dense `mask` was passed for a single query row (as a decode=True layer's cache "
            "mask is) that is not a prefix of the keys or has a head axis", _NO_CACHE_MASK_ARGUMENT)
  if shifted and _values_known(mask):
    return ("a dense `mask` that does not allow every pair was passed with q_offset (which moves "
            "the query positions, not the mask's rows)", _NO_MASK_ARGUMENT)
  if _values_known(mask):
    return ("a dense `mask` that is neither all-True nor the causal mask was passed (padding, a "
            "decode cache or another pattern)", _NO_MASK_ARGUMENT)
  if is_causal:
    return ("a dense `mask` was passed with is_causal=True, traced (its values are unknown while "
            "tracing)",
            "The causal part needs no mask: if the mask only repeats the causal mask, pass "
            f"mask=None to run the kernel. {_NO_MASK_ARGUMENT}")
  return ("a dense `mask` was passed, traced (its values are unknown while tracing)",
          f"If it is a causal mask, {_CAUSAL_FLAG}. {_NO_MASK_ARGUMENT}")


def _values_known(x) -> bool:
  """Whether ``x``'s values can be read while tracing (a concrete array, not a tracer)."""
  if isinstance(x, jax.core.Tracer):
    return False
  return not isinstance(x, jax.Array) or x.is_fully_addressable


def _mask_as_flag(mask, is_causal: bool, t: int, s: int, shifted: bool = False) -> bool | None:
  """The kernel's ``is_causal`` that computes exactly what ``mask`` (AND the flag) does, or None.

  Only for masks whose values are known while tracing; flax attends where the mask is nonzero.
  A mask that allows every pair (the flag's causal pairs, with ``is_causal``) is dropped; one that
  allows exactly the top-left causal pairs in every ``[T, S]`` slice becomes ``is_causal=True``.
  ``shifted``: the call gives ``q_offset``, which moves the flag's causal pairs but not the mask's
  rows, so only a mask that allows every pair is dropped.
  """
  if not _values_known(mask) or not all(is_static_dim(d) for d in (t, s)):
    return None
  allowed = np.asarray(mask) != 0  # [..., T|1, S|1]
  allowed = allowed.reshape((1,) * max(0, 2 - allowed.ndim) + allowed.shape)
  allowed = np.broadcast_to(allowed, allowed.shape[:-2] + (t, s))  # [..., T, S]
  if shifted:
    return is_causal if np.all(allowed) else None
  causal = np.tril(np.ones((t, s), np.bool_))  # top-left: query i sees keys j <= i
  if is_causal:
    return True if np.all(allowed | ~causal) else None  # mask AND causal == causal
  if np.all(allowed):
    return False
  return True if np.all(allowed == causal) else None


def _folded_mask(mask, query):
  """A flax mask broadcastable to ``[batch..., N, T, S]`` -> bool ``[prod(batch) | 1, N | 1, T | 1,
  S | 1]``, the batch dims folded as :func:`flash_any_batch` folds them."""
  allowed = jnp.asarray(mask).astype(jnp.bool_)  # flax attends where the mask is nonzero
  batch = query.shape[:-3]
  allowed = allowed.reshape((1,) * (len(batch) + 3 - allowed.ndim) + allowed.shape)
  if any(d != 1 for d in allowed.shape[:-3]):
    allowed = jnp.broadcast_to(allowed, batch + allowed.shape[-3:])
    return allowed.reshape(math.prod(batch), *allowed.shape[-3:])
  return allowed.reshape(1, *allowed.shape[-3:])


def _position(p):
  """A position computed from a shape: the int itself, or an int32 scalar array when the shape is
  symbolic (``jax.export``), which ``q_offset`` takes where it refuses a dimension expression."""
  return p if isinstance(p, int) else jnp.asarray(p, jnp.int32)


def _mask_as_mask_fn(allowed, user_mask_fn: Callable | None, q_offset) -> Callable:
  """A ``mask_fn`` that reads the folded dense mask ``allowed`` ``[B|1, N|1, T|1, S|1]`` (AND the
  user's ``mask_fn``, when given); size-1 axes are broadcast. A ``mask_fn`` sees absolute query
  positions, ``q_offset + i`` (``q_offset``: None, an int or folded ``[B]``): mask row ``i`` is
  read there."""
  if q_offset is not None and getattr(q_offset, "ndim", 0) > 0:
    q_offset = jnp.asarray(q_offset).reshape(-1)  # [batch...] -> the folded batch

  def mask_fn(b, h, q_idx, kv_idx):
    row = q_idx
    if q_offset is not None:
      row = q_idx - (q_offset[b] if getattr(q_offset, "ndim", 0) > 0 else q_offset)
    index = tuple(x if n != 1 else 0 for x, n in zip((b, h, row, kv_idx), allowed.shape))
    keep = allowed[index]
    return keep if user_mask_fn is None else jnp.logical_and(keep,
                                                             user_mask_fn(b, h, q_idx, kv_idx))
  return mask_fn


def _lone_row_keys(allowed, s: int, kv_len):
  """The keys a lone query row may attend, ``[B|1, S]`` bool: the mask's row, below ``kv_len`` when
  given. ``allowed``: folded ``[B|1, 1, 1, S|1]`` (one head axis)."""
  row = allowed[:, 0, 0, :]  # [B|1, S|1]: the lone query row
  row = jnp.broadcast_to(row, row.shape[:-1] + (s,))
  if kv_len is not None:
    keys = jnp.arange(s, dtype=jnp.int32)[None, :]  # [1, S]
    row = jnp.logical_and(row, keys < jnp.reshape(jnp.asarray(kv_len, jnp.int32), (-1, 1)))
  return row


def _last_allowed_key(allowed, batch: tuple, s: int, kv_len):
  """Per batch element (``[batch...]``), the last of ``s`` keys a lone query row may attend (its
  position in a decode cache): the mask's last allowed key, below ``kv_len`` when given; -1 where
  there is none. ``allowed``: folded ``[B|1, 1, 1, S|1]`` (one head axis)."""
  row = _lone_row_keys(allowed, s, kv_len)  # [B|1, S]
  keys = jnp.arange(s, dtype=jnp.int32)[None, :]  # [1, S]
  last = jnp.max(jnp.where(row, keys, -1), axis=-1)  # [B|1]
  return jnp.broadcast_to(last, (math.prod(batch),)).reshape(batch)


def _is_cache_prefix(allowed, s: int, kv_len):
  """Whether every batch element's lone query row attends exactly a non-empty prefix ``[0, last]``
  of the ``s`` keys (a decode cache's mask, ``arange(S) <= cur_index``, AND any key padding of a
  right-padded batch): a bool scalar. An empty row is no prefix (flax's formula gives the mean of
  every value there, the kernels zeros). ``allowed``: folded ``[B|1, 1, 1, S|1]``."""
  row = _lone_row_keys(allowed, s, kv_len)  # [B|1, S]
  keys = jnp.arange(s, dtype=jnp.int32)[None, :]  # [1, S]
  last = jnp.max(jnp.where(row, keys, -1), axis=-1, keepdims=True)  # [B|1, 1]
  return jnp.logical_and(jnp.all(row == (keys <= last)), jnp.all(last >= 0))


def _masked_variant_formula(formula, query, key, value, mask, causal: bool, variants: dict,
                            lone_row: bool):
  """fa2_jax's formula (``formula``) for a call with variants and a dense ``mask`` the kernels
  cannot take: the mask becomes a ``mask_fn`` (AND the call's own). A lone decode row (the factory's
  ``is_causal``, one query row, no ``q_offset``) with a positional variant sits at the last key its
  mask (and ``key_value_seq_lengths``) allows."""
  allowed = _folded_mask(mask, query)
  if lone_row and not causal and _POSITIONAL.intersection(variants):
    if allowed.shape[1] != 1:
      raise ValueError(
          "fa2_jax.flax.attention_fn: a single query row (a decode step) with a `mask` that has a "
          f"head axis ({mask.shape}) and a variant that depends on the row's position "
          f"({', '.join(sorted(_POSITIONAL.intersection(variants)))}): the row would sit at a "
          "different key in each head; pass q_offset (the row's position), or a mask without a "
          "head axis")
    last = _last_allowed_key(allowed, query.shape[:-3], key.shape[-3],
                             variants.get("key_value_seq_lengths"))
    causal, variants = True, {**variants, "q_offset": last}
  variants = {**variants, "mask_fn": _mask_as_mask_fn(allowed, variants.get("mask_fn"),
                                                       variants.get("q_offset"))}
  return flash_any_batch(formula, query, key, value, causal, variants)


def _cache_prefix_decode(kernel, fallback: Callable, query, key, value, mask, causal: bool,
                         lone_row: bool, variants: dict):
  """A one-query-row call with a dense ``mask`` (a decode=True layer's step): the kernels where the
  mask is a decode cache's, else ``fallback()``, chosen at run time; None (decided while tracing)
  for a call that is no such step, or whose known mask is not a cache's.

  A mask without a head axis (folded ``[B|1, 1, 1, S|1]``) whose row allows exactly a non-empty
  prefix ``[0, last]`` of the keys (flax's cache mask ``arange(S) <= cur_index``, AND key padding)
  is ``key_value_seq_lengths = last + 1`` (``last`` below the call's own lengths); a lone decode row
  (``lone_row``) sits at ``last`` (``q_offset``, causal), where :func:`_masked_variant_formula`
  places it, which also makes the call decode-shaped for :mod:`fa2_jax.dispatch` (the decode family
  on GPU). The mask's values are traced in a decode step: ``lax.cond`` takes the kernels when every
  row is such a prefix and ``fallback`` otherwise (under ``vmap`` with a batched mask the cond is a
  select that runs both branches: the same result, for both costs). Known values decide here.
  """
  if query.shape[-3] != 1:
    return None
  batch, s = query.shape[:-3], key.shape[-3]
  kv_len = variants.get("key_value_seq_lengths")
  if _folded_mask(mask, query).shape[1] != 1:  # (shapes only)
    return None  # a head axis: each head would need its own lengths

  def kernel_path():
    # max(., 0): the branch the cond does not take (both run under vmap) stays a valid call on a row
    # with no allowed key; when taken, every row's last is >= 0.
    last = _last_allowed_key(_folded_mask(mask, query), batch, s, kv_len)  # [batch...]
    last = jnp.maximum(last, 0)
    call_variants = {**variants, "key_value_seq_lengths": last + 1}
    is_causal = causal
    if lone_row and not causal:
      is_causal, call_variants = True, {**call_variants, "q_offset": last}
    return flash_any_batch(kernel, query, key, value, is_causal, call_variants)

  if _values_known(mask) and (kv_len is None or _values_known(kv_len)) and is_static_dim(s):
    with jax.ensure_compile_time_eval():  # concrete values under jit too
      prefix = bool(_is_cache_prefix(_folded_mask(mask, query), s, kv_len))
    return kernel_path() if prefix else None
  return lax.cond(_is_cache_prefix(_folded_mask(mask, query), s, kv_len), kernel_path, fallback)


def _causal_mask(t: int, s: int):
  """Top-left aligned causal mask ``[t, s]`` (query i sees keys j <= i), as flax's is_causal."""
  return jnp.tril(jnp.ones((t, s), dtype=jnp.bool_))


def _with_batch_dims(x, query):
  """``x`` broadcastable to ``[batch..., N, T, S]`` -> rank ``query.ndim`` with query's batch dims.

  nnx's formula folds ``[batch...]`` into one axis by reshaping every array, which is only right for
  arrays that carry the full batch dims.
  """
  x = x.reshape((1,) * (query.ndim - x.ndim) + x.shape)
  return jnp.broadcast_to(x, query.shape[:-3] + x.shape[-3:])


def _flax_formula(query, key, value, *, linen_caller: bool, is_causal: bool, promote_dtype,
                  force_fp32_for_softmax, qk_attn_weights_einsum, attn_weights_value_einsum,
                  extra, mask, bias, **common):
  """Exactly what flax's own ``dot_product_attention`` computes for this call.

  ``flax.linen.MultiHeadDotProductAttention`` passes ``force_fp32_for_softmax``, so its presence
  (``linen_caller``) selects linen's function; otherwise nnx's (which also knows GQA and
  ``is_causal``). The causal flag is folded into a dense mask by broadcasting (``mask AND
  causal``), which is what both flax functions do, for a mask of any rank flax accepts.
  """
  if mask is not None:
    mask = jnp.asarray(mask).astype(jnp.bool_)  # flax attends where the mask is nonzero
    if is_causal:
      rank = max(mask.ndim, 2)  # explicit ranks: jax_numpy_rank_promotion="raise" allows no other
      mask = jnp.logical_and(lax.broadcast_to_rank(mask, rank),
                             lax.broadcast_to_rank(_causal_mask(query.shape[-3], key.shape[-3]),
                                                   rank))
      is_causal = False
  if not linen_caller:
    if promote_dtype is not None:
      extra = {**extra, "promote_dtype": promote_dtype}
    if query.ndim > 4:
      mask, bias = (None if x is None else _with_batch_dims(x, query) for x in (mask, bias))
    return nnx.dot_product_attention(query, key, value, mask=mask, bias=bias, is_causal=is_causal,
                                     **common, **extra)
  # linen's function has neither ``is_causal`` nor GQA: fold them in without changing the math.
  if is_causal:  # at the logits' rank, [batch..., N, T, S]
    mask = lax.broadcast_to_rank(_causal_mask(query.shape[-3], key.shape[-3]), query.ndim)
  groups = query.shape[-2] // key.shape[-2]
  if groups > 1:
    key, value = (jnp.repeat(x, groups, axis=-2) for x in (key, value))
  return nn.dot_product_attention(
      query, key, value, mask=mask, bias=bias,
      force_fp32_for_softmax=bool(force_fp32_for_softmax),
      qk_attn_weights_einsum=qk_attn_weights_einsum,
      attn_weights_value_einsum=attn_weights_value_einsum, **common, **extra)


@functools.cache
def _formula_parameters(linen_caller: bool) -> frozenset[str]:
  """The keyword names flax's own formula takes (linen's or nnx's: :func:`_flax_formula`)."""
  fn = nn.dot_product_attention if linen_caller else nnx.dot_product_attention
  return frozenset(inspect.signature(fn).parameters)


def make_attention_fn(implementation: str | None = None,
                      block_sizes=None,
                      deterministic: bool = False, interpret: bool | None = None, *,
                      is_causal: bool = False, local_window_size: Any = None,
                      logits_soft_cap: float | None = None, alibi_slopes: Any = None,
                      mask_fn: Callable | None = None,
                      score_fn: Callable | None = None) -> "FlashAttentionFn":
  """Returns an ``attention_fn`` for flax's attention layers that runs :func:`fa2_jax.flash_attention`.

  Args:
    implementation: passed to :func:`fa2_jax.flash_attention`: None (the kernels on GPU, the XLA
      formula on CPU), a kernel family's name (``"sm90"``, ``"triton"``, ``"mosaic"``) or ``"xla"``.
    block_sizes: None (defaults) or a kernel family's config (:class:`fa2_jax.MosaicConfig`,
      :class:`fa2_jax.BlockSizes`); see :func:`fa2_jax.flash_attention`.
    deterministic: the kernel's *backward* determinism (no atomics). Not to be confused with the
      ``deterministic`` argument flax passes to the returned function, which switches dropout.
    interpret: True runs the Pallas kernels in interpret mode (CPU tests).
    is_causal: always attend causally (query i sees keys j <= i, top-left aligned). For
      ``flax.linen.MultiHeadDotProductAttention``, which has no ``is_causal`` argument; nnx's layer
      passes ``is_causal`` per call and the two are OR-ed. A call with a single query row
      (``q_length == 1``: the step of a layer with ``decode=True``, whose cache mask already admits
      only the keys up to the current position) is the newest position, so this flag masks none of
      its keys there, and the window, ALiBi and ``mask_fn``/``score_fn`` see the row at the last
      key's position, ``kv_length - 1`` (``key_value_seq_lengths - 1`` when the call gives those,
      the last key its dense mask allows when it gives one; unless it gives ``q_offset``, the
      row's position); a per-call ``is_causal`` keeps flax's top-left meaning.
    local_window_size, logits_soft_cap, alibi_slopes, mask_fn, score_fn: the static variants of
      every call, as in :func:`fa2_jax.flash_attention` (``alibi_slopes``: ``[num_heads]`` here;
      per-batch slopes go to the call). A call may give these instead, but not the same one twice.
      With extra batch dims (``[b1, b2, ..., T, N, H]``) ``mask_fn``/``score_fn`` see the batch
      index ``b`` of the folded batch, ``b1_index * b2 + b2_index``.

  The returned function (a :class:`FlashAttentionFn`: picklable where its functions are, and equal
  to another made with the same arguments) also takes, per call, ``query_seq_lengths``,
  ``key_value_seq_lengths``, ``q_offset`` (``[batch...]``), ``q_segment_ids`` (``[batch...,
  q_length]``), ``kv_segment_ids`` (``[batch..., kv_length]``) and ``alibi_slopes``
  (``[num_heads]`` or ``[batch..., num_heads]``).

  A ``decode=True`` step (one query row, a dense mask without a head axis: flax's cache mask
  ``arange(max_length) <= cur_index``, with any key padding) runs the kernels, with no warning:
  where every row's mask allows exactly the keys ``[0, last]``, the call is the cache's
  ``key_value_seq_lengths = last + 1`` (with ``is_causal``, the row at ``q_offset = last``), a
  decoding call (on a GPU the decode kernels, for a long enough cache). The mask's values are traced, so
  this is chosen at run time (``lax.cond``): another mask (a hole, left padding, an empty row) runs
  the formula the call would otherwise fall back to, unwarned (a mask whose values are known while
  tracing is judged then, and its fallback warns). With a bias, dropout, sown weights or custom
  einsums the step falls back as any call does.

  Raises:
    ValueError: unknown ``implementation``, a bad ``local_window_size`` or ``logits_soft_cap``.
    TypeError: ``block_sizes`` not a BlockSizes/MosaicConfig (or one that does not match
      ``implementation``), a flag that is not a bool, a ``mask_fn``/``score_fn`` that is not
      callable, ``alibi_slopes`` that is not an array.
  """
  check_options(implementation, block_sizes)
  deterministic = check_bool("deterministic", deterministic)
  always_causal = check_bool("is_causal", is_causal)
  if interpret is not None:
    interpret = check_bool("interpret", interpret)
  fixed = check_static_variants(local_window_size=local_window_size,
                                 logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes,
                                 mask_fn=mask_fn, score_fn=score_fn)
  return FlashAttentionFn(implementation, block_sizes, deterministic, interpret, always_causal,
                          fixed)


def _comparable(x):
  """``x`` as a value that compares and hashes without arrays' elementwise ``==``: a concrete array
  as its dtype and values, a hashable object as itself, anything else by identity."""
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    if isinstance(x, jax.core.Tracer):
      return ("id", id(x))
    a = np.asarray(x)
    return ("array", str(a.dtype), a.shape, tuple(a.ravel().tolist()))
  try:
    hash(x)
  except TypeError:
    return ("id", id(x))
  return x


def _frozen(x):
  """A numpy array as a read-only copy; anything else as it is."""
  if isinstance(x, np.ndarray):
    x = np.array(x, copy=True)
    x.setflags(write=False)
  return x


class FlashAttentionFn:
  """The ``attention_fn`` :func:`make_attention_fn` returns: its settings, and ``__call__`` with the
  signature of flax's ``dot_product_attention``. A class, not a closure, so that modules holding it
  pickle (where its ``mask_fn``/``score_fn`` do), and equal to another made with the same
  arguments (nnx compares a graph's static fields: equal ones reuse a jitted trace)."""

  def __init__(self, implementation, block_sizes, deterministic: bool, interpret, always_causal: bool,
               fixed: dict[str, Any]):
    self._kernel = functools.partial(flash_attention, implementation=implementation,
                                     block_sizes=block_sizes, deterministic=deterministic,
                                     interpret=interpret)
    # A call with variants and a dense mask the kernels cannot take (a decode cache's, padding)
    self._formula = functools.partial(flash_attention, implementation="xla")
    # numpy arrays (alibi_slopes) copied read-only: the caller's array may change after, and the key
    # below holds the values (jax arrays are immutable; tracers compare by identity).
    self._always_causal, self._fixed = always_causal, {k: _frozen(v) for k, v in fixed.items()}
    self._key = (implementation, _comparable(block_sizes), deterministic, interpret, always_causal,
                 tuple(sorted((k, _comparable(v)) for k, v in self._fixed.items())))

  def __eq__(self, other):
    return type(other) is type(self) and other._key == self._key

  def __hash__(self):
    return hash(self._key)

  def __repr__(self):
    impl, block_sizes, det, interp, causal, fixed = self._key
    args = [f"implementation={impl!r}"] + [f"{k}={v!r}" for k, v in (
        ("block_sizes", block_sizes), ("deterministic", det), ("interpret", interp),
        ("is_causal", causal)) if v]
    args += [f"{k}=<array>" if isinstance(v, tuple) and v[:1] in (("array",), ("id",))
             else f"{k}={v!r}" for k, v in fixed]
    return f"fa2_jax.flax.FlashAttentionFn({', '.join(args)})"

  # The parameter names are the ones flax's layers pass (linen passes only the names listed here).
  def __call__(self, query: jax.Array, key: jax.Array, value: jax.Array, bias: jax.Array | None = None,
                     mask: jax.Array | None = None, broadcast_dropout: bool = True,
                     dropout_rng: jax.Array | None = None, dropout_rate: float = 0.0,
                     deterministic: bool = False, dtype: Any = None, precision: Any = None,
                     module: Any = None, is_causal: bool = False,
                     force_fp32_for_softmax: bool | None = None,
                     qk_attn_weights_einsum: Callable | None = None,
                     attn_weights_value_einsum: Callable | None = None,
                     promote_dtype: Callable | None = None, query_seq_lengths: Any = None,
                     key_value_seq_lengths: Any = None, q_segment_ids: Any = None,
                     kv_segment_ids: Any = None, q_offset: Any = None, alibi_slopes: Any = None,
                     local_window_size: Any = None, logits_soft_cap: float | None = None,
                     mask_fn: Callable | None = None, score_fn: Callable | None = None,
                     input_positions: jax.Array | None = None, **kwargs) -> jax.Array:
    """FlashAttention with the signature of flax's ``dot_product_attention``.

    Args:
      query: ``[batch..., q_length, num_heads, head_dim]``.
      key, value: ``[batch..., kv_length, num_kv_heads, head_dim]``, ``num_heads % num_kv_heads
        == 0`` (grouped-query attention when smaller).
      bias, mask: broadcastable to ``[batch..., num_heads, q_length, kv_length]``, as in flax (the
        mask attends where nonzero). A mask runs the kernel only when its values are known while
        tracing and it equals no mask or (without ``q_offset``) the causal mask, or when the call
        has one query row and the mask (no head axis) allows a prefix of the keys (a decode step:
        chosen at run time, see :func:`make_attention_fn`); otherwise, and with any bias, the call
        runs flax's formula, or, with variants and a mask (no bias), fa2_jax's XLA formula with
        the mask as a ``mask_fn`` (a lone query row then sits at the last key the mask allows).
      broadcast_dropout, dropout_rng, dropout_rate, deterministic, module: as in flax; active
        dropout or a module to sow weights into fall back to flax's formula.
      dtype: compute dtype (default: the promoted input dtype), as in flax.
      precision: ignored by the kernel (it accumulates in float32); honoured on fallbacks.
      is_causal: top-left causal attention, reaching the kernel as a flag.
      force_fp32_for_softmax: the kernel's softmax is always float32; passed on on fallbacks.
      qk_attn_weights_einsum, attn_weights_value_einsum, promote_dtype: flax's hooks; custom
        einsums fall back, ``promote_dtype`` is used to promote the inputs.
      query_seq_lengths, key_value_seq_lengths, q_offset: integer ``[batch...]`` (``q_offset`` may
        be an int); q_segment_ids, kv_segment_ids: integer ``[batch..., q_length]`` and
        ``[batch..., kv_length]``; alibi_slopes: ``[num_heads]`` or ``[batch..., num_heads]``;
        local_window_size, logits_soft_cap, mask_fn, score_fn: as in
        :func:`fa2_jax.flash_attention` (those not already given to :func:`make_attention_fn`).
      input_positions: a TypeError (``nnx.MultiHeadAttention`` passes them on for a rotary
        ``attention_fn``; this one applies no rotary embeddings).
      **kwargs: future flax arguments: ``None`` values are ignored, others fall back to flax's
        formula where it takes them, and are a TypeError naming them where it does not.

    Returns:
      ``[batch..., q_length, num_heads, head_dim]`` in the compute dtype.

    Raises:
      TypeError, ValueError: an argument of the wrong type or shape, named in the message; a
        ValueError for a variant argument in a call that needs flax's formula (a bias, dropout,
        sown weights, custom einsums: flax's formula has no variants).
    """
    _check_arrays(query, key, value, bias, mask)
    _check_dropout(dropout_rate, deterministic, dropout_rng)
    if input_positions is not None:
      raise TypeError(
          "fa2_jax.flax.attention_fn got input_positions, which flax passes on for rotary "
          "embeddings; it applies none. Rotate query and key before it, e.g. attention_fn="
          "lambda q, k, v, *, input_positions, **kw: fa2_jax.flax.attention_fn("
          "rotary_embedding(q, input_positions), rotary_embedding(k, input_positions), v, **kw) "
          "with fa2_jax.flax.rotary_embedding, or use fa2_jax.flax.NnxCausalSelfAttention("
          "rotary=True)")
    given = dict(query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
                 q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, q_offset=q_offset,
                 **check_static_variants(
                     local_window_size=local_window_size, logits_soft_cap=logits_soft_cap,
                     alibi_slopes=alibi_slopes, mask_fn=mask_fn, score_fn=score_fn))
    variants = merge_variants(self._fixed, given)
    # The factory's flag leaves a single query row (a decode step) unmasked, unless q_offset says
    # where that row sits; see make_attention_fn.
    per_call_causal = check_bool("is_causal", is_causal)
    lone_row = self._always_causal and query.shape[-3] == 1 and q_offset is None
    causal = per_call_causal or (self._always_causal and not lone_row)
    if (query.shape[-3] == 1 and key.shape[-3] != 1 and not (self._always_causal or per_call_causal)
        and q_offset is None and _POSITIONAL.intersection(variants)):
      _warn_top_left_row(variants)
    extra = {k: v for k, v in kwargs.items() if v is not None}
    linen_caller = force_fp32_for_softmax is not None
    unknown = sorted(set(extra) - _formula_parameters(linen_caller))
    if unknown:
      raise TypeError(f"fa2_jax.flax.attention_fn got unexpected arguments {unknown}: neither the "
                      f"kernel nor flax's {'linen' if linen_caller else 'nnx'} "
                      "dot_product_attention formula takes them")
    einsums = (qk_attn_weights_einsum, attn_weights_value_einsum)
    if promote_dtype is not None:
      query, key, value = promote_dtype((query, key, value), dtype=dtype)
    else:
      query, key, value = nn.dtypes.promote_dtype(query, key, value, dtype=dtype)
    why = _fallback_reason(query.dtype, bias, dropout_rate, deterministic, module, einsums,
                           extra)

    def flax_formula():
      return _flax_formula(
          query, key, value, linen_caller=linen_caller, is_causal=causal,
          promote_dtype=promote_dtype, force_fp32_for_softmax=force_fp32_for_softmax,
          qk_attn_weights_einsum=qk_attn_weights_einsum,
          attn_weights_value_einsum=attn_weights_value_einsum, extra=extra, bias=bias, mask=mask,
          broadcast_dropout=broadcast_dropout, dropout_rng=dropout_rng,
          dropout_rate=dropout_rate, deterministic=deterministic, dtype=dtype,
          precision=precision, module=module)

    if why is None and mask is not None:
      flag = _mask_as_flag(mask, causal, query.shape[-3], key.shape[-3],
                           shifted="q_offset" in variants)
      if flag is None:
        # Only the mask stands in the kernel's way: with variants, fa2_jax's own formula computes
        # the call, the mask as a mask_fn (flax's formula has no variants).
        fallback = (functools.partial(_masked_variant_formula, self._formula, query, key, value,
                                      mask, causal, variants, lone_row)
                    if variants else flax_formula)
        # A decode step's cache mask runs the kernels (the fallback only where, at run time, the
        # mask is no cache's): nothing to warn about.
        out = _cache_prefix_decode(self._kernel, fallback, query, key, value, mask, causal,
                                   lone_row, variants)
        if out is not None:
          return out
        reason = _mask_reason(mask, causal, one_row=query.shape[-3] == 1,
                              shifted="q_offset" in variants)
        out = fallback()
        _warn_fallback(*reason, **({"formula": _VARIANTS_FORMULA} if variants else {}))
        return out
      mask, causal = None, flag
    if why is not None:
      if variants:
        raise ValueError(
            f"fa2_jax.flax.attention_fn: {why[0]}, which only flax's dot_product_attention formula "
            f"can compute, and that formula has none of the variant arguments given "
            f"({', '.join(sorted(variants))}). {why[1]}")
      _warn_fallback(*why)
      return flax_formula()
    if lone_row and not causal and _POSITIONAL.intersection(variants):
      # The newest position is the last (valid) key's: the window, ALiBi and mask_fn/score_fn see the
      # row there.
      kv_len = variants.get("key_value_seq_lengths")
      last = (_position(key.shape[-3] - 1) if kv_len is None
              else jnp.asarray(kv_len, jnp.int32) - 1)
      causal, variants = True, {**variants, "q_offset": last}
    return flash_any_batch(self._kernel, query, key, value, causal, variants)


# The default attention_fn: implementation=None (kernels on GPU, XLA formula on CPU).
attention_fn = make_attention_fn()

