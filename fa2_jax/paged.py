"""A paged key/value cache (``flash_attention(..., block_table=...)``, FlashAttention's
``flash_attn_with_kvcache`` name): K and V are pages ``[num_pages, page_size, K, H]`` (V's last axis
may be its own head_dim ``Hv``) and row ``b``'s
key ``j`` is at ``(block_table[b, j // page_size], j % page_size)``.

A decode-shaped call (the decode family takes it: kernels/decode) reads the pages through the table
inside the kernel. Any other call gathers the pages into contiguous ``[B, max_pages * page_size, K,
H]`` K/V and runs the usual path. Gradients (to the query and the pages) are exact either way: the
paged decode call's backward differentiates the gathered form.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import dispatch
from .call import prepare
from .kernels import registry
from .kernels.masking import Variant, alibi_lse_shift, remove_alibi_shift
from .kernels.softmax import kernel_scale, lse_from_stats


def _concrete(x):
  """``x`` as a numpy array when its values are known now, else None."""
  if x is None or isinstance(x, jax.core.Tracer) or isinstance(x, jax.ShapeDtypeStruct):
    return None
  x = np.asarray(x)
  return x if x.dtype.kind in "iub" else None


def check_paged(query, key, value, block_table, key_value_seq_lengths):
  """Validate a paged call; returns ``(max_pages, page_size)``. Errors name the argument."""
  if not hasattr(block_table, "shape") or not hasattr(block_table, "dtype"):
    raise TypeError(f"block_table must be an integer array [B, max_pages], got "
                    f"{type(block_table).__name__}")
  if not jnp.issubdtype(block_table.dtype, jnp.integer) or jnp.dtype(block_table.dtype) == bool:
    raise TypeError(f"block_table must be an integer array (page ids), got dtype "
                    f"{block_table.dtype}")
  for name, x in (("query", query), ("key", key), ("value", value)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"{name} must be a jax/numpy array, got {type(x).__name__}")
  if query.ndim != 4:
    raise ValueError(f"block_table needs a rank-4 query [B, T, N, H], got shape "
                     f"{tuple(query.shape)}")
  for name, x in (("key", key), ("value", value)):
    if x.ndim != 4:
      raise ValueError(f"with block_table, {name} must be pages [num_pages, page_size, K, H], got "
                       f"shape {tuple(x.shape)}")
  if tuple(key.shape[:3]) != tuple(value.shape[:3]):
    raise ValueError(f"with block_table, key and value must be pages of one [num_pages, page_size, "
                     f"K] (value: [num_pages, page_size, K, Hv]), got {tuple(key.shape)} and "
                     f"{tuple(value.shape)}")
  b = query.shape[0]
  if block_table.ndim != 2 or block_table.shape[0] != b:
    raise ValueError(f"block_table must have shape [B, max_pages] with B={b} (the query's batch), "
                     f"got {tuple(block_table.shape)}")
  num_pages, page_size = key.shape[0], key.shape[1]
  max_pages = block_table.shape[1]
  if num_pages < 1 or page_size < 1 or max_pages < 1:
    raise ValueError(f"block_table needs at least one page of at least one key: key/value pages "
                     f"{tuple(key.shape)}, block_table {tuple(block_table.shape)}")
  if key_value_seq_lengths is None:
    raise ValueError("block_table needs key_value_seq_lengths (each row's keys in its pages)")
  lens = _concrete(key_value_seq_lengths)
  if lens is not None and lens.size and np.any(np.asarray(lens, np.int64) > max_pages * page_size):
    raise ValueError(f"key_value_seq_lengths must be at most max_pages * page_size = {max_pages} * "
                     f"{page_size} = {max_pages * page_size} with this block_table, got "
                     f"{np.asarray(lens).tolist()}")
  table = _concrete(block_table)
  if table is not None:
    table = np.asarray(table, np.int64)
    if lens is not None and lens.ndim <= 1:  # the entries each row's keys live in
      need = -(-np.broadcast_to(np.asarray(lens, np.int64), (b,)) // page_size)
      used = np.arange(max_pages)[None, :] < need[:, None]
      bad = used & ((table < 0) | (table >= num_pages))
    else:  # traced lengths: a negative entry may be a "no page yet" past a row's keys
      bad = table >= num_pages
    if np.any(bad):
      rows, cols = np.nonzero(bad)
      raise ValueError(f"block_table holds page ids outside [0, {num_pages}) (num_pages: "
                       f"key.shape[0]): block_table[{rows[0]}, {cols[0]}] = "
                       f"{table[rows[0], cols[0]]}"
                       + ("" if lens is None else " (an entry a row's keys live in)"))
  return max_pages, page_size


def logical_kv(key, value, batch: int, seq_k: int):
  """The contiguous K/V ``[B, S, K, H]`` / ``[B, S, K, Hv]`` the pages stand for, as
  ``jax.ShapeDtypeStruct``s (``S = max_pages * page_size``)."""
  return tuple(jax.ShapeDtypeStruct((batch, seq_k, *x.shape[2:]), x.dtype) for x in (key, value))


def gather_pages(pages, block_table):
  """``[B, max_pages * page_size, K, H]`` (H: the pages' last axis): each row's pages, in its
  table's order (ids clipped to the pages there are)."""
  b, max_pages = block_table.shape
  idx = jnp.clip(block_table.astype(jnp.int32), 0, pages.shape[0] - 1)
  out = jnp.take(pages, idx, axis=0)  # [B, max_pages, page_size, K, H]
  return out.reshape(b, max_pages * pages.shape[1], *pages.shape[2:])


def _split(kwargs):
  """(array keywords, hashable others)."""
  arrays = {n: x for n, x in kwargs.items() if isinstance(x, (jax.Array, np.ndarray))}
  static = tuple(sorted((n, x) for n, x in kwargs.items() if n not in arrays))
  return arrays, static


def flash_attention_paged(query, key, value, block_table, attend, **kwargs):
  """:func:`fa2_jax.flash_attention` with ``block_table`` (its module docstring); ``attend`` is
  ``flash_attention`` itself, which runs the gathered form (and its gradient)."""
  check_paged(query, key, value, block_table, kwargs.get("key_value_seq_lengths"))
  max_pages, page_size = block_table.shape[1], key.shape[1]
  b, _, _, _ = query.shape
  logical_k, logical_v = logical_kv(key, value, b, max_pages * page_size)
  call = prepare(query, logical_k, logical_v, **_prepare_args(kwargs))
  if not reads_pages(call, kwargs):
    return attend(query, gather_pages(key, block_table), gather_pages(value, block_table), **kwargs)
  arrays, static = _split(kwargs)
  out, lse = _paged_decode(query, key, value, block_table, arrays, static, attend)
  return (out, lse) if kwargs.get("return_residual") else out


def reads_pages(call, kwargs) -> bool:
  """Whether the decode kernel reads the pages through the table (else they are gathered first):
  a call the decode family runs itself, without ALiBi, whose slopes' gradient only the gathered
  form's families give (or refuse)."""
  return (call.backend == "decode" and kwargs.get("alibi_slopes") is None
          and not registry.get("decode").launch_config(call.kernel_call,
                                                       kwargs.get("block_sizes")).delegate_forward)


def _paged_call(call, page_size: int):
  """The kernel call as the decode family sees a paged cache (its split rule counts the pages'
  lookups)."""
  return dataclasses.replace(call.kernel_call, page_size=int(page_size))


def _prepare_args(kwargs):
  names = ("scale", "is_causal", "implementation", "return_residual", "block_sizes",
           "deterministic", "interpret")
  defaults = dict(scale=None, is_causal=False, implementation=None, return_residual=False,
                  block_sizes=None, deterministic=False, interpret=None)
  args = {n: kwargs.get(n, defaults[n]) for n in names}
  args.update({n: x for n, x in kwargs.items() if n not in names})
  return args


def _decode_forward(query, key, value, block_table, arrays, static):
  """The paged decode kernel: ``(out, lse [B, T, N])``."""
  kwargs = {**dict(static), **arrays}
  max_pages, page_size = block_table.shape[1], key.shape[1]
  b = query.shape[0]
  s = max_pages * page_size
  logical_k, logical_v = logical_kv(key, value, b, s)
  call = prepare(query, logical_k, logical_v, **_prepare_args(kwargs))
  family = registry.get("decode")
  launch = family.launch_config(_paged_call(call, page_size), kwargs.get("block_sizes"))
  variant = call.variant
  scale = kernel_scale(call.scale)
  with jax.enable_x64(False):
    out, stats = family.forward(
        query, key, value, scale=scale, is_causal=call.is_causal, config=launch,
        variant=None if variant == Variant(is_causal=call.is_causal) else variant,
        arrays=call.arrays, table=None, interpret=bool(call.interpret),
        block_table=block_table.astype(jnp.int32), seq_k=s)
  lse = jnp.swapaxes(lse_from_stats(stats, scale, variant.modifies_scores), 1, 2)
  shift = alibi_lse_shift(variant, call.clipped_arrays(), lse.shape[1], s)
  return out, (lse if shift is None else remove_alibi_shift(lse, shift))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _paged_decode(query, key, value, block_table, arrays, static, attend):
  return _decode_forward(query, key, value, block_table, arrays, static)


def _paged_decode_fwd(query, key, value, block_table, arrays, static, attend):
  del attend
  out = _decode_forward(query, key, value, block_table, arrays, static)
  return out, (query, key, value, block_table, arrays)


def _paged_decode_bwd(static, attend, residuals, cotangents):
  # The gradient of the gathered form (the same function, ``attend`` = flash_attention): the
  # training family's backward on the gathered K/V, whose cotangent the gather's transpose adds back
  # into the pages. Its forward is recomputed on the contiguous K/V (its own split count), so its out
  # and lse may differ from the paged forward's by rounding; the gradient is that of the recomputed
  # forward.
  query, key, value, block_table, arrays = residuals
  kwargs = {**dict(static), **arrays, "return_residual": True}

  def gathered(q, k, v):
    return attend(q, gather_pages(k, block_table), gather_pages(v, block_table), **kwargs)

  _, vjp = jax.vjp(gathered, query, key, value)
  dq, dk, dv = vjp(cotangents)
  return dq, dk, dv, None, jax.tree.map(lambda _: None, arrays)


_paged_decode.defvjp(_paged_decode_fwd, _paged_decode_bwd)


def backend_for_paged(query, key, value, block_table, **kwargs):
  """:func:`fa2_jax.backend_for` of a paged call."""
  check_paged(query, key, value, block_table, kwargs.get("key_value_seq_lengths"))
  b, max_pages, page_size = query.shape[0], block_table.shape[1], key.shape[1]
  logical_k, logical_v = logical_kv(key, value, b, max_pages * page_size)
  call = prepare(query, logical_k, logical_v, **_prepare_args(kwargs))
  pages = reads_pages(call, kwargs)
  d = dispatch.describe(call.backend, _paged_call(call, page_size) if pages else call.kernel_call,
                        implementation=kwargs.get("implementation"),
                        config=kwargs.get("block_sizes"), formula_reason=call.formula_reason)
  if pages:
    return dataclasses.replace(d, reason=f"block_table: the kernel reads the {max_pages} pages of "
                               f"{page_size} keys per row through the table; {d.reason}")
  return dataclasses.replace(d, reason="block_table: the pages are gathered into contiguous K/V "
                             f"[B, {max_pages * page_size}, K, H] first; {d.reason}")
