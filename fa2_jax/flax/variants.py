"""How the Flax adapters hand the attention variants to :func:`fa2_jax.flash_attention`: the static
variant arguments checked once, a factory's and a call's variants merged, and calls on
``[batch..., T, N, H]`` inputs folded to one batch dimension, with the per-batch variant arrays folded
alike. No Flax import: :mod:`fa2_jax.flax` and :mod:`fa2_jax.flax.layers` use it."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..validation import check_soft_cap, check_window

# The per-batch variant arrays of fa2_jax.flash_attention, with the dims that follow [batch...] in
# their shape (t: q_length, s: kv_length, n: num_heads). alibi_slopes may also be [num_heads], shared
# by the batch (the only form make_attention_fn takes).
_PER_BATCH_DIMS = {
    "query_seq_lengths": lambda t, s, n: (), "key_value_seq_lengths": lambda t, s, n: (),
    "q_offset": lambda t, s, n: (), "q_segment_ids": lambda t, s, n: (t,),
    "kv_segment_ids": lambda t, s, n: (s,), "alibi_slopes": lambda t, s, n: (n,),
}


def check_static_variants(**static) -> dict[str, Any]:
  """The static variant arguments that are set, checked as far as they can be without the arrays."""
  window, cap = static.get("local_window_size"), static.get("logits_soft_cap")
  if window is not None:
    check_window(window)
  if cap is not None:
    check_soft_cap(cap)
  for name in ("mask_fn", "score_fn"):
    fn = static.get(name)
    if fn is not None and not callable(fn):
      raise TypeError(f"{name} must be a callable or None, got {type(fn).__name__}")
  slopes = static.get("alibi_slopes")
  if slopes is not None and (not hasattr(slopes, "shape") or not hasattr(slopes, "dtype")):
    raise TypeError(f"alibi_slopes must be a float array of shape [num_heads] (or, per call, "
                    f"[batch..., num_heads]), got {type(slopes).__name__}")
  return {k: v for k, v in static.items() if v is not None}


def merge_variants(fixed: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
  """The factory's variants and a call's, set ones only; one given twice is a ValueError."""
  given = {k: v for k, v in given.items() if v is not None}
  twice = sorted(set(fixed) & set(given))
  if twice:
    raise ValueError(f"{', '.join(twice)} given both to make_attention_fn and to the call: set "
                     "each variant argument in one place")
  return {**fixed, **given}


def fold_variant(name: str, x, batch: tuple, t: int, s: int, n: int):
  """A per-batch variant array ``[batch..., *dims]`` -> ``[prod(batch), *dims]``."""
  if not hasattr(x, "shape") or (name == "q_offset" and (isinstance(x, (int, np.integer))
                                                       or getattr(x, "ndim", None) == 0)):
    return x  # an int or scalar q_offset, or something flash_attention rejects with its own message
  dims = _PER_BATCH_DIMS[name](t, s, n)
  if name == "alibi_slopes" and tuple(x.shape) == dims:
    return x  # [num_heads]: shared by every batch element
  if tuple(x.shape) != (*batch, *dims):
    trailing = {"q_segment_ids": ", q_length", "kv_segment_ids": ", kv_length",
                "alibi_slopes": ", num_heads"}.get(name, "")
    raise ValueError(f"{name} must have shape [batch...{trailing}] = {(*batch, *dims)} (query "
                     f"batch dims {tuple(batch)}), got shape {tuple(x.shape)}")
  return x.reshape(math.prod(batch), *dims)


def flash_any_batch(kernel, query, key, value, is_causal: bool, variants: dict[str, Any]):
  """Calls the kernel on ``[batch..., T, N, H]`` inputs by folding the batch dims (and the per-batch
  variant arrays' batch dims) into one."""
  batch = query.shape[:-3]
  if len(batch) <= 1:
    return kernel(query, key, value, is_causal=is_causal, **variants)
  t, n, s = query.shape[-3], query.shape[-2], key.shape[-3]
  variants = {k: fold_variant(k, v, batch, t, s, n) if k in _PER_BATCH_DIMS else v
              for k, v in variants.items()}
  fold = lambda x: x.reshape(math.prod(batch), *x.shape[-3:])
  out = kernel(fold(query), fold(key), fold(value), is_causal=is_causal, **variants)
  return out.reshape(*batch, *out.shape[1:])
