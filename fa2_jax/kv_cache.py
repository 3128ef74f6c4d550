"""Functional key/value caches for autoregressive decoding with :func:`fa2_jax.flash_attention`.

A cache is a pytree of arrays (it passes through ``jax.jit``, ``lax.scan`` and ``lax.fori_loop`` as a
carry); its methods return a new cache and never mutate. Under ``jax.jit`` with the cache donated
(``donate_argnums``), or as a loop carry, XLA writes the appended rows in place.

    cache = fa2_jax.KVCache.create(batch=2, capacity=1024, kv_heads=2, head_dim=64, dtype=jnp.bfloat16)
    out, cache = fa2_jax.prefill(q, k, v, lengths=prompt_lengths, capacity=1024)  # [B, T] prompts
    cache = cache.append(k_new, v_new)          # [B, T_new, K, H]: each row at its own length
    out = cache.attend(q_new)                   # [B, T_new, N, H]: the rows just appended, causal

Values may have their own head_dim (``create(..., value_head_dim=Hv)``, or a ``v`` ``[B, T, K, Hv]``
in :func:`prefill`; multi-head latent attention): ``v_new`` then has ``Hv`` and ``attend`` returns
``[B, T_new, N, Hv]``.

Each batch row has its own length (prompts of different lengths, left-aligned). ``attend`` is
``flash_attention(q, cache.k, cache.v, is_causal=True, key_value_seq_lengths=cache.lengths,
q_offset=cache.lengths - rows, query_seq_lengths=rows)`` with ``rows[b]`` the rows batch row ``b``
appended last (``cache.appended``: ``T_new``, or fewer after an append or prefill with ``lengths``):
query row ``i`` of batch row ``b`` sits at position ``lengths[b] - rows[b] + i`` and attends the
keys at positions ``<=`` it; its query rows from ``rows[b]`` on are padding (output 0). Attention variants
(``local_window_size``, ``logits_soft_cap``, ``alibi_slopes``, ``mask_fn``, ``score_fn``, ``scale``,
``implementation``, ...) pass through as keyword arguments; a decode-shaped call (``T_new = 1``) runs
whatever fa2_jax runs for that shape.

The caches are forward-only (inference): differentiating through :meth:`KVCache.attend`,
:meth:`PagedKVCache.attend` or :func:`prefill` raises a TypeError. To train, call
:func:`fa2_jax.flash_attention` on the whole sequence with ``is_causal=True`` (the same function).

:class:`PagedKVCache` keeps the rows in fixed-size pages ``[num_pages, page_size, K, H]`` found through
a page table ``[B, pages_per_row]`` (vLLM's paged attention; FlashAttention's ``block_table``).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .attention import flash_attention
from .validation import DTYPES, positive_int

__all__ = ["KVCache", "PagedKVCache", "prefill"]

FORWARD_ONLY_MESSAGE = (
    "fa2_jax's KV caches are forward-only (inference): KVCache.attend, PagedKVCache.attend and "
    "fa2_jax.prefill have no derivative. To train, call fa2_jax.flash_attention(q, k, v, "
    "is_causal=True) on the whole sequence (differentiable), outside the cache; for decoding, wrap "
    "the cache's inputs in jax.lax.stop_gradient if a transform differentiates around it")

# ``appended`` of a batch row given all of an append's rows (an append or prefill without lengths):
# attend's queries are then its newest T_new rows.
ALL_ROWS = -1

# flash_attention arguments the cache sets itself: a caller passing them would contradict it.
_SET_BY_CACHE = ("is_causal", "q_offset", "key_value_seq_lengths", "q_segment_ids",
                 "kv_segment_ids", "block_table")
# Whether fa2_jax.flash_attention takes a page table itself (FlashAttention's name, block_table):
# PagedKVCache.attend then passes the pages as they are, else it gathers them into rows first (the
# fallback, kept for an attention_fn that has no block_table).
KERNEL_TAKES_BLOCK_TABLE = "block_table" in inspect.signature(flash_attention).parameters


# --- forward-only ---------------------------------------------------------------------------------

@jax.custom_jvp
def _forward_only(x):
  return x


@_forward_only.defjvp
def _forward_only_jvp(primals, tangents):
  # JAX calls a custom_jvp rule only for an input that carries a nonzero tangent: grad, vjp, jvp,
  # jacfwd/jacrev through the cache all land here; calls that do not differentiate never do.
  del primals, tangents
  raise TypeError(FORWARD_ONLY_MESSAGE)


def _guard(*arrays):
  return tuple(_forward_only(x) for x in arrays)


# --- argument checks ------------------------------------------------------------------------------

def _is_tracer(x) -> bool:
  return isinstance(x, jax.core.Tracer)


def _concrete(x):
  """``x`` as numpy when its values are known now (not traced), else None."""
  if isinstance(x, (np.ndarray, np.generic, int)):
    return np.asarray(x)
  if isinstance(x, jax.Array) and not _is_tracer(x):
    return np.asarray(x)
  return None


def _cache_dtype(dtype) -> jnp.dtype:
  try:
    dtype = jnp.dtype(dtype)
  except TypeError as e:
    raise TypeError(f"dtype must be bfloat16, float16 or float32, got {dtype!r}") from e
  if dtype not in DTYPES:
    raise TypeError(f"dtype must be bfloat16, float16 or float32, got {dtype}")
  return dtype


def _array(name: str, x):
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name} must be an array, got {type(x).__name__}")
  return x


def _from_sequence(x):
  """A list or tuple as an array (numpy's, which stays concrete under jit, unless an item is a JAX
  array: a pytree's leaves may be traced); anything else as it is."""
  if not isinstance(x, (list, tuple)):
    return x
  return jnp.asarray(x) if any(isinstance(v, jax.Array) for v in x) else np.asarray(x)


def _lengths(name: str, x, batch: int, limit: int, limit_name: str):
  """Integer ``[batch]`` as int32; its values (when concrete) in ``[0, limit]``."""
  if isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)):
    x = np.full((batch,), int(x), np.int32)
  x = _array(name, _from_sequence(x))  # lists as flash_attention's lengths take them
  if np.dtype(x.dtype).kind not in "iu":
    raise TypeError(f"{name} must be an integer array [batch], got dtype {x.dtype}")
  if tuple(x.shape) != (batch,):
    raise ValueError(f"{name} must have shape [{batch}] (one length per batch row), got "
                     f"{list(x.shape)}")
  values = _concrete(x)
  if values is not None and values.size and (values.min() < 0 or values.max() > limit):
    raise ValueError(f"{name} must lie in [0, {limit}] ({limit_name}), got values in "
                     f"[{values.min()}, {values.max()}]")
  return jnp.asarray(x).astype(jnp.int32)


def _check_kv(name: str, x, batch: int, kv_heads: int, head_dim: int, dtype) -> None:
  _array(name, x)
  if x.ndim != 4 or x.shape[0] != batch or x.shape[2] != kv_heads or x.shape[3] != head_dim:
    raise ValueError(f"{name} must have shape [batch={batch}, T_new, kv_heads={kv_heads}, "
                     f"head_dim={head_dim}], got {list(x.shape)}")
  if jnp.dtype(x.dtype) != dtype:
    raise TypeError(f"{name} must have the cache's dtype {dtype}, got {x.dtype} (cast it, or "
                    f"create the cache with dtype={x.dtype})")


def _check_kwargs(kwargs: dict) -> None:
  for name in _SET_BY_CACHE:
    if name in kwargs:
      raise TypeError(f"{name} is set by the cache (causal attention of the newest rows against "
                      "the cache's lengths; a paged cache's page table), so it cannot be passed "
                      "to attend/prefill")


def _check_pages(page_table, num_pages: int) -> None:
  """ValueError for a concrete page table (a traced one is not checked) with a page at or past
  ``num_pages`` (a negative entry is "no page yet": append refuses to write through one)."""
  values = _concrete(page_table)
  if values is not None and values.size and values.max() >= num_pages:
    raise ValueError(f"page_table's pages must lie in [0, {num_pages}) (or be negative: no page "
                     f"yet), got values up to {values.max()}")


def _check_written_pages(pages, written, num_pages: int) -> None:
  """ValueError where an append, when its pages and rows are known, would write a page outside
  ``[0, num_pages)`` or one page from two rows (``pages`` ``[B, T_new]``: the page of each new
  row; ``written``: whether the row is written). Entries no row writes may hold anything (a
  negative "no page yet")."""
  pages, written = _concrete(pages), _concrete(written)
  if pages is None or written is None:
    return
  owner: dict = {}
  for b in range(pages.shape[0]):
    for page in sorted(set(pages[b][written[b]].tolist())):
      if not 0 <= page < num_pages:
        raise ValueError(f"page_table gives batch row {b} page {page} for rows it appends: pages "
                         f"must lie in [0, {num_pages})")
      if owner.setdefault(page, b) != b:
        raise ValueError(f"page_table makes batch rows {owner[page]} and {b} both append to page "
                         f"{page}: rows may share pages they only read (a common prefix); give "
                         "each row its own pages for the positions it appends")


def _append_lengths(cache_lengths, lengths, t_new: int, capacity: int):
  """The per-row count of new rows ([B] int32), after checking that they fit (when concrete)."""
  batch = cache_lengths.shape[0]
  if t_new > capacity:
    raise ValueError(f"k_new/v_new have T_new = {t_new} rows, more than the cache's capacity "
                     f"{capacity}")
  new = (jnp.full((batch,), t_new, jnp.int32) if lengths is None
         else _lengths("lengths", lengths, batch, t_new, "T_new, the rows of k_new"))
  old, added = _concrete(cache_lengths), _concrete(new)
  if old is not None and added is not None and (old + added > capacity).any():
    row = int(np.argmax(old + added > capacity))
    raise ValueError(
        f"appending overflows the cache: batch row {row} holds {int(old[row])} rows and gets "
        f"{int(added[row])} more, past the capacity {capacity} (create a larger cache)")
  return new


# --- what both caches share ----------------------------------------------------------------------

class _Cache:
  """The part of :class:`KVCache` and :class:`PagedKVCache` that is the same: keys laid out
  ``[..., ..., kv_heads, head_dim]`` (``_keys``: ``k`` or ``k_pages``), values alike with their own
  ``value_head_dim`` (``_values``), per-row ``lengths``, append's checks and attend's call. A
  subclass defines ``_keys``, ``_values``, ``batch`` and ``capacity``."""

  @property
  def kv_heads(self) -> int:
    return self._keys.shape[2]

  @property
  def head_dim(self) -> int:
    """The keys' (and queries') head_dim."""
    return self._keys.shape[3]

  @property
  def value_head_dim(self) -> int:
    """The values' head_dim (the output's): ``head_dim`` unless created otherwise."""
    return self._values.shape[3]

  @property
  def dtype(self) -> jnp.dtype:
    return jnp.dtype(self._keys.dtype)

  def _held(self) -> jax.Array:
    """The cache's ``lengths`` as int32 ``[batch]`` (a cache built by hand, or brought to the host
    by ``jax.device_get``, may hold a list or a numpy array)."""
    held = _from_sequence(self.lengths)
    if not hasattr(held, "shape") or not hasattr(held, "dtype"):
      raise TypeError(f"the cache's lengths must be an integer array [batch], got "
                      f"{type(held).__name__}")
    if np.dtype(held.dtype).kind not in "iu":
      raise TypeError(f"the cache's lengths must be an integer array [batch], got dtype "
                      f"{held.dtype}")
    if held.ndim != 1:
      raise ValueError(f"the cache's lengths must have shape [batch], got {list(held.shape)}")
    if isinstance(held, np.ndarray):  # stays concrete under jit, so its values are still checked
      return held.astype(np.int32)
    return jnp.asarray(held).astype(jnp.int32)

  def _appended(self):
    """``(appended, values)``: the cache's ``appended`` as int32 ``[batch]`` and its host values
    (None where traced), or ``(None, None)`` (see :class:`KVCache`)."""
    if self.appended is None:
      return None, None
    held = _from_sequence(self.appended)
    if (not hasattr(held, "shape") or np.dtype(held.dtype).kind not in "iu"
        or held.shape != (self.batch,)):
      raise TypeError(f"the cache's appended must be None or an integer array [batch={self.batch}], "
                      f"got {getattr(held, 'dtype', type(held).__name__)} "
                      f"{list(getattr(held, 'shape', ()))}")
    values = _concrete(held)
    if values is not None and values.size and values.min() < ALL_ROWS:
      raise ValueError(f"the cache's appended must be {ALL_ROWS} (all of the last append's rows) or a "
                       f"row count >= 0, but batch row {int(np.argmin(values))} holds "
                       f"{int(values.min())}")
    return jnp.asarray(held).astype(jnp.int32), values

  def _next_appended(self, lengths, added):
    """``appended`` after an append of ``added`` rows per batch row (``lengths``: append's): an
    array where the cache holds one (``create`` and ``prefill`` make one, so a loop's cache keeps
    its structure), None kept for a cache built without one and appended to without lengths."""
    if lengths is not None:
      return added
    return None if self.appended is None else jnp.full((self.batch,), ALL_ROWS, jnp.int32)

  def _new_rows(self, k_new, v_new, lengths):
    """append's checks of ``k_new``/``v_new`` and ``lengths``: the new rows' positions ``[B, T_new]``
    (int32, from each row's length on), the per-row count of rows they add and the cache's lengths
    after them (``[B]`` int32 each)."""
    _check_kv("k_new", k_new, self.batch, self.kv_heads, self.head_dim, self.dtype)
    _check_kv("v_new", v_new, self.batch, self.kv_heads, self.value_head_dim, self.dtype)
    if k_new.shape[:3] != v_new.shape[:3]:
      raise ValueError(f"k_new and v_new must have the same [batch, T_new, kv_heads], got "
                       f"{list(k_new.shape)} and {list(v_new.shape)}")
    t = k_new.shape[1]
    held = self._held()
    added = _append_lengths(held, lengths, t, self.capacity)
    positions = held[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    return positions, added, held + added

  def _attend(self, q, k, v, query_seq_lengths, attention_fn, kwargs, extra=None):
    """flash_attention of the newest rows against the cache's keys and values ``k``, ``v`` (the
    cache's own arrays, or the paged cache's gathered copy): the body of both caches' attend."""
    _check_kwargs(kwargs)
    _array("q", q)
    cache_lengths, dtype, capacity = self._held(), self.dtype, self.capacity
    batch, kv_heads, head_dim = cache_lengths.shape[0], self.kv_heads, self.head_dim
    if (q.ndim != 4 or q.shape[0] != batch or q.shape[3] != head_dim or q.shape[2] % kv_heads):
      raise ValueError(f"q must have shape [batch={batch}, T_new, num_heads, head_dim={head_dim}] "
                       f"with num_heads a multiple of the cache's kv_heads={kv_heads}, got "
                       f"{list(q.shape)}")
    if jnp.dtype(q.dtype) != dtype:
      raise TypeError(f"q must have the cache's dtype {dtype}, got {q.dtype}")
    t = q.shape[1]
    if t > capacity:
      raise ValueError(f"q has T_new = {t} rows, more than the cache's capacity {capacity}")
    appended, known = self._appended() if query_seq_lengths is None else (None, None)
    if appended is not None:  # the last append's rows per batch row (its newest t): the queries'
      newest = query_seq_lengths = jnp.where(appended == ALL_ROWS, t, jnp.minimum(appended, t))
      # rows from the host values (a host cache's too, under jit), for the check below
      rows = None if known is None else np.where(known == ALL_ROWS, t, np.minimum(known, t))
    elif query_seq_lengths is None:
      newest = jnp.full((batch,), t, jnp.int32)
      rows = np.full((batch,), t)  # (q's row count is known under jit too)
    else:
      newest = query_seq_lengths = _lengths("query_seq_lengths", query_seq_lengths, batch, t,
                                            "T_new, q's rows")
      rows = _concrete(newest)
    held = _concrete(cache_lengths)
    if held is not None and held.size and held.min() < 0:
      raise ValueError(f"the cache's lengths must lie in [0, {capacity}], but batch row "
                       f"{int(np.argmin(held))} holds {int(held.min())}")
    if held is not None and held.size and held.max() > capacity:
      raise ValueError(
          f"the cache's lengths must lie in [0, {capacity}] (its capacity), but batch row "
          f"{int(np.argmax(held))} holds {int(held.max())}: an append under jit went past the "
          "capacity (its rows were dropped); create a larger cache")
    if held is not None and rows is not None and (rows > held).any():
      row = int(np.argmax(rows > held))
      raise ValueError(
          f"q's rows are the newest rows of the cache (append them first): batch row {row} has "
          f"{int(rows[row])} query rows but the cache holds only {int(held[row])}")
    q, k, v = _guard(q, k, v)
    fn = flash_attention if attention_fn is None else attention_fn
    variants = dict(kwargs, is_causal=True, q_offset=cache_lengths - newest,
                    key_value_seq_lengths=cache_lengths, **(extra or {}))
    if query_seq_lengths is not None:
      variants["query_seq_lengths"] = query_seq_lengths
    return fn(q, k, v, **variants)


# --- the contiguous cache -------------------------------------------------------------------------

@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["k", "v", "lengths", "appended"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class KVCache(_Cache):
  """Keys and values of ``batch`` sequences, up to ``capacity`` rows each: a pytree.

  Attributes:
    k, v: ``[batch, capacity, kv_heads, head_dim]`` (v: ``value_head_dim``); rows ``>= lengths[b]``
      of row ``b`` are unused (never attended; their contents are arbitrary).
    lengths: int32 ``[batch]``: the rows held per batch row (its next row's position).
    appended: int32 ``[batch]``: the rows the last append (or :func:`prefill`) gave each batch row,
      ``-1`` for all of them (no ``lengths``): :meth:`attend` without ``query_seq_lengths`` takes
      them as the queries' rows, so the queries of a batch row that appended fewer rows than
      ``T_new`` sit at its own new positions. None (a cache built by hand): every row took all of
      them; such a cache gets an array at its first append with ``lengths``, which changes its
      pytree structure (a loop carry: build it with ``appended=jnp.full((batch,), -1)``).
  """

  k: jax.Array
  v: jax.Array
  lengths: jax.Array
  appended: jax.Array | None = None

  @classmethod
  def create(cls, batch: int, capacity: int, kv_heads: int, head_dim: int,
             dtype=jnp.float32, *, value_head_dim: int | None = None) -> "KVCache":
    """An empty cache (zeros, every length 0); ``value_head_dim``: the values' head_dim, default
    ``head_dim``.

    Raises:
      TypeError: a size that is not an int, a dtype other than bfloat16, float16 or float32;
        ValueError: a size below 1.
    """
    shape = tuple(positive_int(name, value) for name, value in (
        ("batch", batch), ("capacity", capacity), ("kv_heads", kv_heads), ("head_dim", head_dim)))
    hv = shape[3] if value_head_dim is None else positive_int("value_head_dim", value_head_dim)
    dtype = _cache_dtype(dtype)
    return cls(jnp.zeros(shape, dtype), jnp.zeros((*shape[:3], hv), dtype),
               jnp.zeros((shape[0],), jnp.int32), jnp.full((shape[0],), ALL_ROWS, jnp.int32))

  @property
  def _keys(self) -> jax.Array:
    return self.k

  @property
  def _values(self) -> jax.Array:
    return self.v

  @property
  def batch(self) -> int:
    return self.k.shape[0]

  @property
  def capacity(self) -> int:
    return self.k.shape[1]

  def append(self, k_new: jax.Array, v_new: jax.Array, *, lengths=None) -> "KVCache":
    """The cache with ``k_new``/``v_new`` ``[batch, T_new, kv_heads, head_dim]`` (``v_new``:
    ``value_head_dim``) written after each
    batch row's last row (row ``b`` at positions ``self.lengths[b] ...``).

    Args:
      k_new, v_new: the new rows, in the cache's dtype.
      lengths: optional int ``[batch]`` in ``[0, T_new]``: row ``b`` appends only its first
        ``lengths[b]`` rows (the others are written past its new length, where nothing reads them:
        left-aligned prompts of different lengths); default ``T_new`` for every row.

    Under ``jax.jit`` the overflow check below needs concrete lengths; a traced overflow writes the
    rows that fit (never over earlier rows) and counts the rest, which attend cannot see.

    Raises:
      ValueError: shapes that do not match the cache, ``T_new`` above the capacity, lengths outside
        ``[0, T_new]`` or past the capacity (when concrete); TypeError: another dtype.
    """
    positions, added, new_lengths = self._new_rows(k_new, v_new, lengths)  # [B, T_new], [B], [B]
    rows = jnp.arange(self.batch, dtype=jnp.int32)[:, None]
    # A scatter (in place under jit with donation); rows past the capacity are dropped.
    k = jnp.asarray(self.k).at[rows, positions].set(k_new, mode="drop")
    v = jnp.asarray(self.v).at[rows, positions].set(v_new, mode="drop")
    return KVCache(k, v, new_lengths, self._next_appended(lengths, added))

  def attend(self, q: jax.Array, *, query_seq_lengths=None, attention_fn: Callable | None = None,
             **kwargs):
    """Causal attention of the newest rows' queries against the cache.

    ``flash_attention(q, k, v, is_causal=True, key_value_seq_lengths=self.lengths,
    q_offset=self.lengths - rows, query_seq_lengths=rows, **kwargs)``, ``rows`` the queries' rows
    per batch row (below): query row ``i`` of batch row ``b`` sits at position ``lengths[b] - rows[b]
    + i``, so call it after :meth:`append` of the same rows' keys and values.

    Args:
      q: ``[batch, T_new, num_heads, head_dim]`` in the cache's dtype; ``num_heads`` a multiple of
        ``kv_heads`` (grouped-query attention when larger).
      query_seq_lengths: optional int ``[batch]`` in ``[0, T_new]``, as ``append``'s ``lengths``:
        row ``b``'s queries are its newest ``query_seq_lengths[b]`` rows, its other query rows are
        padding (output 0). Default: the rows the last append (or prefill) gave each batch row
        (``appended``: its ``lengths``, else ``T_new``), at most ``T_new`` (the newest of them).
        An ``attention_fn`` receives it too.
      attention_fn: called instead of :func:`fa2_jax.flash_attention` with the same arguments
        (e.g. a :func:`fa2_jax.flax.make_attention_fn` function).
      **kwargs: further arguments of flash_attention (``scale``, ``implementation``,
        ``local_window_size``, ``logits_soft_cap``, ``return_residual``, ...); not those the cache
        sets (``is_causal``, ``q_offset``, ``key_value_seq_lengths``, segment ids).

    Returns:
      flash_attention's result: ``[batch, T_new, num_heads, value_head_dim]`` (and the lse with
      ``return_residual=True``). Not differentiable (a TypeError names flash_attention instead).
    """
    return self._attend(q, self.k, self.v, query_seq_lengths, attention_fn, kwargs)


def prefill(q: jax.Array, k: jax.Array, v: jax.Array, *, lengths=None, capacity: int | None = None,
            attention_fn: Callable | None = None, **kwargs) -> tuple[jax.Array, KVCache]:
  """Causal attention over prompts, and the cache that holds their keys and values.

  Args:
    q: ``[batch, T, num_heads, head_dim]``; k: ``[batch, T, kv_heads, head_dim]``, v: ``[batch, T,
      kv_heads, Hv]`` (same dtype; ``Hv``, the cache's ``value_head_dim``, may differ).
    lengths: optional int ``[batch]`` in ``[0, T]``: left-aligned prompts, row ``b`` valid up to
      ``lengths[b]`` (its later rows are padding: output 0, not in the cache); default ``T``.
    capacity: the cache's rows per batch row, ``>= T`` (default ``T``).
    attention_fn, **kwargs: as in :meth:`KVCache.attend`.

  Returns:
    ``(out, cache)``: ``flash_attention(q, k, v, is_causal=True, query_seq_lengths=lengths,
    key_value_seq_lengths=lengths, **kwargs)`` and a :class:`KVCache` of ``capacity`` rows holding
    the prompts (``cache.lengths == lengths``). Not differentiable.

  Raises:
    ValueError / TypeError: bad shapes, dtypes, lengths or capacity, naming the argument.
  """
  _check_kwargs(kwargs)
  if "query_seq_lengths" in kwargs:
    raise TypeError("query_seq_lengths is set by prefill's lengths (the prompts' valid rows, for "
                    "the queries and the cache alike): pass lengths")
  for name, x in (("q", q), ("k", k), ("v", v)):
    _array(name, x)
    if x.ndim != 4:
      raise ValueError(f"{name} must have shape [batch, T, heads, head_dim], got {list(x.shape)}")
  batch, t, heads, head_dim = q.shape
  if (k.shape[:3] != v.shape[:3] or k.shape[:2] != (batch, t) or k.shape[3] != head_dim
      or heads % k.shape[2]):
    raise ValueError(f"k and v must have shape [batch={batch}, T={t}, kv_heads, head_dim="
                     f"{head_dim}] (v: its own head_dim) with kv_heads dividing q's {heads} heads, "
                     f"got {list(k.shape)} and {list(v.shape)}")
  dtype = jnp.dtype(q.dtype)
  if dtype not in DTYPES:
    raise TypeError(f"q must be bfloat16, float16 or float32, got {q.dtype}")
  if jnp.dtype(k.dtype) != dtype or jnp.dtype(v.dtype) != dtype:
    raise TypeError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  capacity = t if capacity is None else positive_int("capacity", capacity)
  if capacity < t:
    raise ValueError(f"capacity ({capacity}) must be >= the prompts' length T = {t}")
  if t == 0:
    raise ValueError("q, k and v must hold at least one row (T >= 1)")
  if lengths is not None:
    lengths = _lengths("lengths", lengths, batch, t, "T, the prompts' rows")
    kwargs = dict(kwargs, query_seq_lengths=lengths, key_value_seq_lengths=lengths)
  q_, k_, v_ = _guard(q, k, v)
  fn = flash_attention if attention_fn is None else attention_fn
  out = fn(q_, k_, v_, is_causal=True, **kwargs)
  pad = ((0, 0), (0, capacity - t), (0, 0), (0, 0))
  cache = KVCache(jnp.pad(k, pad), jnp.pad(v, pad),
                  jnp.full((batch,), t, jnp.int32) if lengths is None else lengths,
                  jnp.full((batch,), ALL_ROWS, jnp.int32) if lengths is None else lengths)
  return out, cache


# --- the paged cache ------------------------------------------------------------------------------

@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["k_pages", "v_pages", "page_table", "lengths", "appended"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class PagedKVCache(_Cache):
  """Keys and values in fixed-size pages shared by every batch row: a pytree.

  Row ``b``'s position ``p`` lives in page ``page_table[b, p // page_size]`` at slot
  ``p % page_size``; a row holds up to ``capacity = pages_per_row * page_size`` positions.

  Attributes:
    k_pages, v_pages: ``[num_pages, page_size, kv_heads, head_dim]`` (v_pages: ``value_head_dim``).
    page_table: int32 ``[batch, pages_per_row]``: the pages of each batch row, in order.
    lengths: int32 ``[batch]``: the positions held per batch row.
    appended: as :class:`KVCache`'s (the rows of the last append that took ``lengths``).

  :meth:`attend` passes the pages and the table to flash_attention as ``block_table`` (a decode
  call's kernel reads the pages through the table; other calls gather them inside flash_attention).
  With an ``attention_fn`` (which need not take ``block_table``), or a flash_attention without
  ``block_table`` (``KERNEL_TAKES_BLOCK_TABLE`` False), it gathers each row's pages into a
  contiguous ``[batch, capacity, kv_heads, head_dim]`` copy first (:meth:`gather`: the same result,
  plus one copy of the cache per call).
  """

  k_pages: jax.Array
  v_pages: jax.Array
  page_table: jax.Array
  lengths: jax.Array
  appended: jax.Array | None = None

  @classmethod
  def create(cls, batch: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
             dtype=jnp.float32, *, page_table=None,
             value_head_dim: int | None = None) -> "PagedKVCache":
    """An empty paged cache.

    Args:
      value_head_dim: the values' head_dim, default ``head_dim``.
      page_table: int ``[batch, pages_per_row]`` (an array or nested lists) with values in
        ``[0, num_pages)``, or negative for "no page yet" (an append that would write through one
        raises); default: row ``b`` owns pages ``b * P ... (b + 1) * P - 1`` with
        ``P = num_pages // batch``. Two rows must not share a page they both write. (Rows that
        share a filled prefix's pages: ``dataclasses.replace(cache, page_table=..., lengths=...)``
        of a cache that holds the prefix.)

    Raises:
      ValueError: sizes below 1, a page table of another shape or with pages at or past
        ``num_pages``; TypeError: sizes that are not ints, another dtype, a page table that is not
        integer.
    """
    batch, num_pages, page_size, kv_heads, head_dim = (positive_int(name, value) for name, value in (
        ("batch", batch), ("num_pages", num_pages), ("page_size", page_size),
        ("kv_heads", kv_heads), ("head_dim", head_dim)))
    hv = head_dim if value_head_dim is None else positive_int("value_head_dim", value_head_dim)
    dtype = _cache_dtype(dtype)
    if page_table is None:
      if num_pages < batch:
        raise ValueError(f"num_pages ({num_pages}) must be >= batch ({batch}) for the default "
                         "page table (one share of the pages per row)")
      per_row = num_pages // batch
      page_table = np.arange(batch * per_row, dtype=np.int32).reshape(batch, per_row)
    page_table = _array("page_table", _from_sequence(page_table))  # lists as the lengths
    if np.dtype(page_table.dtype).kind not in "iu":
      raise TypeError(f"page_table must be an integer array, got dtype {page_table.dtype}")
    if page_table.ndim != 2 or page_table.shape[0] != batch or page_table.shape[1] < 1:
      raise ValueError(f"page_table must have shape [batch={batch}, pages_per_row >= 1], got "
                       f"{list(page_table.shape)}")
    _check_pages(page_table, num_pages)
    shape = (num_pages, page_size, kv_heads, head_dim)
    return cls(jnp.zeros(shape, dtype), jnp.zeros((*shape[:3], hv), dtype),
               jnp.asarray(page_table, jnp.int32), jnp.zeros((batch,), jnp.int32),
               jnp.full((batch,), ALL_ROWS, jnp.int32))

  @property
  def _keys(self) -> jax.Array:
    return self.k_pages

  @property
  def _values(self) -> jax.Array:
    return self.v_pages

  @property
  def batch(self) -> int:
    return self.page_table.shape[0]

  @property
  def page_size(self) -> int:
    return self.k_pages.shape[1]

  @property
  def capacity(self) -> int:
    return self.page_table.shape[1] * self.page_size

  def append(self, k_new: jax.Array, v_new: jax.Array, *, lengths=None) -> "PagedKVCache":
    """As :meth:`KVCache.append`: each row's new positions go to the slots of its pages. Where the
    pages and lengths are known (not traced), a page outside ``[0, num_pages)`` or one page written
    by two rows raises; entries no row writes may hold anything (a negative "no page yet"). Under
    ``jit`` such writes, the rows past each row's ``lengths`` and those past the capacity are
    dropped, never written to another page."""
    num_pages = self.k_pages.shape[0]
    positions, added, new_lengths = self._new_rows(k_new, v_new, lengths)  # [B, T_new], [B], [B]
    table = jnp.asarray(self.page_table).astype(jnp.int32)
    index = jnp.minimum(positions // self.page_size, table.shape[1] - 1)
    pages = jnp.take_along_axis(table, index, axis=1)
    # the rows each batch row appends: not its padding past lengths, nor past the capacity
    written = ((jnp.arange(positions.shape[1], dtype=jnp.int32)[None, :] < added[:, None])
               & (positions < self.capacity))
    _check_written_pages(pages, written, num_pages)
    # every other row, and pages out of range, go to page num_pages, out of bounds: dropped (a
    # negative index would wrap to another row's page)
    pages = jnp.where(written & (pages >= 0) & (pages < num_pages), pages, num_pages)
    slots = positions % self.page_size
    k = jnp.asarray(self.k_pages).at[pages, slots].set(k_new, mode="drop")
    v = jnp.asarray(self.v_pages).at[pages, slots].set(v_new, mode="drop")
    return PagedKVCache(k, v, self.page_table, new_lengths, self._next_appended(lengths, added))

  def gather(self) -> tuple[jax.Array, jax.Array]:
    """Each row's pages in order, as contiguous ``[batch, capacity, kv_heads, head_dim]`` keys and
    values (``value_head_dim``; a copy)."""
    shape = (self.batch, self.capacity, self.kv_heads)
    return (self.k_pages[self.page_table].reshape(*shape, self.head_dim),
            self.v_pages[self.page_table].reshape(*shape, self.value_head_dim))

  def attend(self, q: jax.Array, *, query_seq_lengths=None, attention_fn: Callable | None = None,
             **kwargs):
    """As :meth:`KVCache.attend`, over the pages (``block_table``, or gathered with an
    ``attention_fn``: see the class docstring)."""
    if attention_fn is None and KERNEL_TAKES_BLOCK_TABLE:
      return self._attend(q, self.k_pages, self.v_pages, query_seq_lengths, None, kwargs,
                          extra={"block_table": self.page_table})
    k, v = self.gather()
    return self._attend(q, k, v, query_seq_lengths, attention_fn, kwargs)
