"""Context parallelism: attention over a sequence sharded along one mesh axis, inside ``jax.shard_map``.

Each of the ``C`` devices of mesh axis ``axis_name`` holds a chunk of the sequence: query
``[B, T/C, N, H]``, key/value ``[B, S/C, K, H]``, and computes the attention of its queries over the
whole sequence::

    C = 4
    mesh = jax.make_mesh((C,), ("context",), axis_types=(jax.sharding.AxisType.Auto,))
    spec = jax.sharding.PartitionSpec(None, "context")        # [B, T, N, H] sharded along T
    q, k, v = (fa2_jax.to_context_layout(x, C) for x in (q, k, v))   # zigzag: causal load balance
    attend = functools.partial(fa2_jax.context_parallel_attention, axis_name="context",
                               layout="zigzag", is_causal=True)
    out = jax.shard_map(attend, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(q, k, v)
    out = fa2_jax.from_context_layout(out, C)                 # == flash_attention(q, k, v, ...)

API (stable; other modules and the examples build on it):

* ``context_parallel_attention(query, key, value, *, axis_name, layout, strategy=None,
  **flash_attention's keywords)``: inside ``jax.shard_map``, on the local chunks; returns the local
  ``out`` (and ``lse [B, T/C, N]`` with ``return_residual``), in the same layout as the query.
* ``context_parallel_strategy(query_shape, key_shape, axis_size, ...) -> (name, reason)``: the
  strategy ``strategy=None`` picks, for GLOBAL shapes.
* ``to_context_layout(x, axis_size, *, seq_axis=1, layout)`` / ``from_context_layout``: the
  permutation of a global array's sequence axis that places chunks on devices (exact round trip).
* ``context_positions(local_len, axis_index, axis_size, *, layout)``: the global sequence index
  of each local token (positions travel with the chunks).

Layouts: the sequence is cut into ``C`` chunks (``"contiguous"``: device ``d`` holds chunk ``d``)
or ``2C`` chunks (``"zigzag"``, :func:`to_context_layout`'s default: device ``d`` holds chunks ``d`` and ``2C-1-d``, so that
under ``is_causal`` every device has the same number of allowed pairs). The arrays given to
``shard_map`` must be in that order (``to_context_layout``); ``q_segment_ids``/``kv_segment_ids``
are local chunks like the query/key, in the same layout; ``query_seq_lengths``,
``key_value_seq_lengths`` (``[B]``, one per batch row of the device's q, k, v), ``q_offset`` and
``alibi_slopes`` hold global values and are replicated over the context axis (sharded as the batch
or heads are, where other mesh axes shard those).
Positions (``is_causal``, ``local_window_size``, ALiBi, ``mask_fn``/``score_fn``'s ``q_idx``/
``kv_idx``) are absolute: global sequence indices, ``q_offset`` added for the queries.

Strategies:

* ``"ring"``: K/V blocks travel around the axis by ``lax.ppermute``, ``C`` steps; each step runs the
  local kernels on (local queries, visiting K/V) with the positions shifted, and the partial outputs
  are merged exactly by their lse. Where nothing but causality reads positions (no window,
  lengths, ``q_offset``, ALiBi, ``mask_fn``/``score_fn``; under ``is_causal`` T = S) a step is ONE
  kernel call on whole chunks (:func:`_whole_chunks`), else one per (query piece, key piece) pair.
  A ``jax.custom_vjp`` ring backward: the residuals are the local q, k, v, out and lse only; K/V
  circulate again with float32 dK/dV accumulators, and each block runs the kernels' backward with
  the GLOBAL out and lse (``attention.attention_backward``). Blocks no query may attend (causal
  future, out of a window's reach, past the lengths) are skipped by a ``lax.cond`` on the traced
  device and step indices; within a block the kernels skip masked tiles.
  Calls on the XLA formula, and calls with ``alibi_slopes`` (to differentiate them), take the
  per-block backward by recomputing the block's forward under ``jax.vjp`` instead.
* ``"all_to_all"`` (Ulysses): ``lax.all_to_all`` trades the sequence for the heads, one
  full-sequence ``flash_attention`` over ``N/C`` heads, and back. Needs ``N % C == 0`` and
  ``K % C == 0``.
* ``"all_gather"``: K/V (and ``kv_segment_ids``) are all-gathered; the local queries attend the
  whole sequence. Memory: the full K/V on every device.

Gradients of ``"all_to_all"``/``"all_gather"`` are autodiff's (the collectives' transposes).

Under ``jit``, :func:`fa2_jax.flash_attention` on q/k/v whose T and S one mesh axis shards runs this
module on the arrays' contiguous chunks, a causal ring or all-gather relaid out in the zigzag order
and back from :data:`BALANCE_MIN_ROWS` rows per device (:mod:`fa2_jax.sharding`): Explicit axes through
``context_parallel_attention`` in its ``shard_map`` (``sequence_sharded``, ``explicit_call``), Auto
axes from the kernels' partition callbacks (``partitioned_forward``, ``partitioned_backward``: the
strategies' forward as plain functions of an axis name, and the ring's or the all_gather strategy's
backward from the rows' out and row statistics; with ALiBi the statistics in the kernels' frame,
their row shift added, and where the slopes' gradient is asked the kernels' per-row slope sums,
each block's from its kernels' sums with its own shift taken out: ``_block_slope_rows``).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from . import attention, kernel_reuse, sharding
from .kernels.masking import (Variant, VariantArrays, alibi_row_shift, closes_over_arrays,
                              shifts_alibi)
from .kernels.backend import accumulate_dq
from .kernels.softmax import lse_from_stats, stats_from_lse
from .kernels.vma import match_vma
from .validation import _concrete, positive_int, resolve_scale

STRATEGIES = ("ring", "all_to_all", "all_gather")
LAYOUTS = ("zigzag", "contiguous")

# strategy=None gathers K/V while the gathered K and V take at most this many bytes per device:
# small next to a GPU's memory (80 GB on an H100) and to one layer's activations, and one collective
# and one kernel call per query piece beat C ring steps. Past it the memory per device must stay
# S/C: all_to_all where the heads divide, the ring otherwise.
GATHER_BYTES = 256 * 2**20


# --- layout --------------------------------------------------------------------------------------

def _check_layout(layout) -> int:
  """The number of chunks per device of ``layout`` (ValueError for an unknown one)."""
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  return 2 if layout == "zigzag" else 1


def _chunk_order(axis_size: int, layout: str) -> list[int]:
  """The global chunk index of each chunk in device order (device 0's chunks first)."""
  if layout == "zigzag":
    return [c for d in range(axis_size) for c in (d, 2 * axis_size - 1 - d)]
  return list(range(axis_size))


def _local_chunks(index, axis_size: int, layout: str) -> list:
  """The global chunk indices held by device ``index`` (an int or a traced int32), in local order."""
  if layout == "zigzag":
    return [index, 2 * axis_size - 1 - index]
  return [index]


def _permute_chunks(x, order: list[int], seq_axis: int):
  """``x`` with the ``len(order)`` equal chunks of ``seq_axis`` in the order ``order``."""
  size = x.shape[seq_axis] // len(order)
  if order == sorted(order):
    return x
  return jnp.concatenate([lax.slice_in_dim(x, i * size, (i + 1) * size, axis=seq_axis)
                          for i in order], axis=seq_axis)


def _check_global(x, axis_size, seq_axis, layout) -> tuple[int, int]:
  pieces = _check_layout(layout)
  if not hasattr(x, "shape") or not hasattr(x, "ndim"):
    raise TypeError(f"x must be an array, got {type(x).__name__}")
  axis_size = positive_int("axis_size", axis_size)
  if not -x.ndim <= seq_axis < x.ndim:
    raise ValueError(f"seq_axis={seq_axis} is out of range for an array of rank {x.ndim}")
  seq_axis %= x.ndim
  n = pieces * int(axis_size)
  if x.shape[seq_axis] % n:
    raise ValueError(
        f"layout={layout!r} cuts the sequence into {n} chunks ({pieces} per device, axis_size "
        f"{axis_size}): its length {x.shape[seq_axis]} (axis {seq_axis}) is not divisible by {n}; pad "
        f"it to a multiple of {n} (query_seq_lengths/key_value_seq_lengths mask the padding)"
        + (" or use layout='contiguous'" if pieces == 2 else ""))
  return seq_axis, n


def to_context_layout(x, axis_size: int, *, seq_axis: int = 1, layout: str = "zigzag"):
  """A global array's sequence axis reordered so that cutting it into ``axis_size`` equal contiguous
  shards (``PartitionSpec`` on ``seq_axis``) gives device ``d`` its chunks of ``layout``: for
  ``"zigzag"``, chunks ``d`` and ``2 * axis_size - 1 - d`` of ``2 * axis_size``; ``"contiguous"``
  leaves ``x`` as it is. A pure permutation (``from_context_layout`` undoes it exactly)."""
  seq_axis, _ = _check_global(x, axis_size, seq_axis, layout)
  return _permute_chunks(x, _chunk_order(int(axis_size), layout), seq_axis)


def from_context_layout(x, axis_size: int, *, seq_axis: int = 1, layout: str = "zigzag"):
  """The inverse of :func:`to_context_layout`: the sequence axis back in its natural order."""
  seq_axis, _ = _check_global(x, axis_size, seq_axis, layout)
  order = _chunk_order(int(axis_size), layout)
  return _permute_chunks(x, [int(i) for i in np.argsort(order)], seq_axis)


def context_positions(local_len: int, axis_index, axis_size: int, *, layout: str = "zigzag"):
  """``int32 [local_len]``: the global sequence index of each of the ``local_len`` tokens of device
  ``axis_index`` (an int, or ``lax.axis_index(axis_name)`` inside ``shard_map``) under ``layout``.
  Add ``q_offset`` for the queries' absolute positions."""
  pieces = _check_layout(layout)
  axis_size = positive_int("axis_size", axis_size)
  if isinstance(axis_index, (int, np.integer)) and not 0 <= axis_index < axis_size:
    raise ValueError(f"axis_index must lie in [0, axis_size={axis_size}), got {axis_index}")
  if local_len % pieces:
    raise ValueError(f"layout={layout!r} holds {pieces} chunks per device: local_len={local_len} "
                     f"must be divisible by {pieces}")
  size = local_len // pieces
  rows = jnp.arange(size, dtype=jnp.int32)
  return jnp.concatenate([jnp.asarray(c, jnp.int32) * size + rows
                          for c in _local_chunks(axis_index, axis_size, layout)])


def _halves_home(axis_size: int, half: int) -> int:
  """The device that holds the ``half``-th of ``2 * axis_size`` equal chunks in the zigzag layout."""
  return half if half < axis_size else 2 * axis_size - 1 - half


def _relayout(x, axis_name, axis_size: int, seq_axis: int, *, to_zigzag: bool):
  """Inside ``shard_map``: this device's chunk of ``x`` along ``seq_axis`` moved from the
  contiguous layout (device d: chunks 2d, 2d + 1 of 2C) to the zigzag one (chunks d, 2C - 1 - d),
  or back. Two ``ppermute``s: every device holds one even and one odd chunk in either layout (d and
  2C - 1 - d differ in parity), so the even chunks move by one permutation of the devices and the
  odd ones by another; in the zigzag layout the even chunk is the first on an even device and the
  second on an odd one."""
  c = axis_size
  even_home = [(d, _halves_home(c, 2 * d)) for d in range(c)]  # contiguous -> zigzag
  odd_home = [(d, _halves_home(c, 2 * d + 1)) for d in range(c)]
  size = x.shape[seq_axis] // 2
  first = lax.slice_in_dim(x, 0, size, axis=seq_axis)
  second = lax.slice_in_dim(x, size, 2 * size, axis=seq_axis)
  even_first = lax.axis_index(axis_name) % 2 == 0
  swap = lambda a, b: (jnp.where(even_first, a, b), jnp.where(even_first, b, a))  # noqa: E731
  if to_zigzag:
    first, second = swap(lax.ppermute(first, axis_name, even_home),
                         lax.ppermute(second, axis_name, odd_home))
  else:
    even, odd = swap(first, second)
    first = lax.ppermute(even, axis_name, [(b, a) for a, b in even_home])
    second = lax.ppermute(odd, axis_name, [(b, a) for a, b in odd_home])
  return jnp.concatenate([first, second], axis=seq_axis)


# From this many query rows per device, flash_attention on sequence-sharded arrays runs a causal
# call's ring or all-gather on chunks relaid out in the zigzag order and back: on contiguous chunks
# device d does about (2d + 1) / C of the mean work and every device waits for the last one, 1.75x
# the mean at C = 4; below it the relayout's collectives would cost about what balancing saves (a
# cost model, not yet measured: docs/design.md#context-parallelism, "Under jit").
BALANCE_MIN_ROWS = 4096


def _balances(is_causal: bool, window, t_loc: int, s_loc: int, strategy: str, axis_size: int,
              position_fns: bool) -> bool:
  """Whether a call on contiguous chunks runs in the zigzag layout (:data:`BALANCE_MIN_ROWS`):
  causal self-attention without a window (a band narrower than a chunk gives every chunk about
  the same work), the ring or all-gather (all_to_all runs whole sequences), chunks that halve; not
  with a ``mask_fn``/``score_fn`` (``position_fns``), whose ring steps hold a kernel copy per key
  chunk (:func:`_dispatch`): four pairs per zigzag step would compile about 8C copies, not C + 1."""
  return (is_causal and window is None and not position_fns and axis_size > 1
          and strategy in ("ring", "all_gather") and t_loc == s_loc and t_loc % 2 == 0
          and t_loc >= BALANCE_MIN_ROWS)


# --- strategy choice -----------------------------------------------------------------------------

def context_parallel_strategy(query_shape, key_shape, axis_size: int, *, dtype=jnp.bfloat16,
                              has_kv_segment_ids: bool = False,
                              value_head_dim: int | None = None) -> tuple[str, str]:
  """``(strategy, reason)``: what ``strategy=None`` runs for GLOBAL shapes ``[B, T, N, H]`` /
  ``[B, S, K, H]`` over an axis of ``axis_size`` devices (``dtype``: the keys'; ``value_head_dim``:
  the values' head_dim where it is not ``H``).

  The rule: gather K/V while the gathered K and V take at most :data:`GATHER_BYTES` per device
  (``"all_gather"``); else ``"all_to_all"`` where ``N`` and ``K`` divide by ``axis_size``; else
  ``"ring"``, whose memory per device stays ``S / axis_size``."""
  for name, shape in (("query_shape", query_shape), ("key_shape", key_shape)):
    if len(tuple(shape)) != 4:
      raise ValueError(f"{name} must be the global [B, {'T, N' if name == 'query_shape' else 'S, K'}"
                       f", H] (4 sizes), got {tuple(shape)}")
  b, s, kh, h = (int(d) for d in key_shape)
  n = int(query_shape[2])
  c = positive_int("axis_size", axis_size)
  if c == 1:
    return "all_gather", "one device on the axis: nothing to exchange, one kernel call"
  hv = h if value_head_dim is None else int(value_head_dim)
  gathered = b * s * kh * (h + hv) * jnp.dtype(dtype).itemsize + (4 * b * s if has_kv_segment_ids
                                                                    else 0)
  if gathered <= GATHER_BYTES:
    return "all_gather", (f"the gathered K and V take {gathered / 2**20:.1f} MiB per device "
                          f"(<= {GATHER_BYTES // 2**20} MiB): one all-gather and one kernel call "
                          "per query piece")
  if n % c == 0 and kh % c == 0:
    return "all_to_all", (f"the gathered K/V would take {gathered / 2**20:.0f} MiB per device and "
                          f"the heads (N={n}, K={kh}) divide by the axis size {c}: all-to-all trades "
                          "the sequence for the heads around one full-sequence call")
  return "ring", (f"the gathered K/V would take {gathered / 2**20:.0f} MiB per device and the heads "
                  f"(N={n}, K={kh}) do not divide by the axis size {c}: K/V travel around the ring, "
                  "memory per device stays S/C")


# --- the call's settings -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Config:
  """Everything about a context-parallel call that is not an array (hashable: the ring's
  custom_vjp takes it as a nondiff argument)."""

  axis_name: object
  axis_size: int
  layout: str
  kwargs: tuple  # flash_attention's static keywords, as (name, value) pairs
  mask_fn: object
  score_fn: object
  positions: bool  # whether anything reads positions (then every block call gets a q_offset)
  window: tuple  # (left, right) key bounds relative to the query position, None: unbounded
  kernel_backward: bool  # the ring's blocks run the kernels' backward (else: recompute under vjp)
  whole_chunks: bool  # each ring step is one kernel call on whole chunks (_whole_chunks)
  # the all-gather strategy's K/V chunks in another layout than the queries' (None: ``layout``):
  # flash_attention under jit moves only the query side to the zigzag layout for it (_balances)
  kv_layout: str | None = None

  @property
  def kv_order(self) -> str:
    return self.layout if self.kv_layout is None else self.kv_layout

  @property
  def pieces(self) -> int:
    return 2 if self.layout == "zigzag" else 1

  @property
  def is_causal(self) -> bool:
    return bool(dict(self.kwargs)["is_causal"])


def _whole_chunks(is_causal: bool, t_loc: int, s_loc: int, *, window, q_len, kv_len, q_offset,
                  slopes, mask_fn, score_fn) -> bool:
  """Whether each ring step can run as ONE kernel call on whole chunks instead of one per (query
  piece, key piece) pair: nothing but causality reads positions (no window, lengths, ``q_offset``,
  ALiBi, ``mask_fn``/``score_fn``; segment ids travel with their tokens and a soft cap reads
  none), and under ``is_causal`` the local query and key lengths are equal, so that query chunk i
  and key chunk i cover the same positions and causality between two chunks is decided by their
  order alone: a chunk attends the earlier ones whole, the later ones not at all, and itself
  causally (:func:`_forward_step`)."""
  return (window is None and q_len is None and kv_len is None and q_offset is None
          and slopes is None and mask_fn is None and score_fn is None
          and (not is_causal or t_loc == s_loc))


def _window(local_window_size, is_causal: bool) -> tuple:
  """``(left, right)`` of the keys a query at position p may attend, ``p - left <= j <= p + right``
  (None: unbounded), for skipping blocks; arguments flash_attention would refuse give
  ``(None, None)`` (its error comes from the block calls)."""
  left = right = None
  w = local_window_size
  if isinstance(w, (int, np.integer)) and not isinstance(w, bool):
    left = right = int(w)
  elif isinstance(w, (tuple, list)) and len(w) == 2 and all(
      x is None or (isinstance(x, (int, np.integer)) and not isinstance(x, bool)) for x in w):
    left, right = (None if x is None else int(x) for x in w)
  if is_causal:
    right = 0 if right is None else min(right, 0)
  return left, right


def _int_array(name, x, batch, scalar_ok: bool = False):
  """An integer argument as an int32 array (``[batch]`` for a per-row one: this device's batch
  rows, as its q, k, v hold them; a scalar broadcast where ``scalar_ok``)."""
  if x is None:
    return None
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must be integer, got dtype {x.dtype}")
  if batch is not None and x.shape != (batch,) and not (scalar_ok and x.ndim == 0):
    raise ValueError(
        f"{name} must have shape [{batch}] (one per batch row of this device's q, k and v"
        f"{', or one number for every row' if scalar_ok else ''}), got {list(x.shape)}: shard it "
        "as the batch is sharded (P() where the batch is replicated, the batch's mesh axis where "
        "it is sharded), not along the context axis")
  x = x.astype(jnp.int32)
  return x if batch is None else jnp.broadcast_to(x, (batch,))


def _axis_size(axis_name) -> int:
  try:
    return int(lax.axis_size(axis_name))
  except NameError as e:
    raise ValueError(
        f"axis_name={axis_name!r} is not a mesh axis bound here: call context_parallel_attention "
        "inside jax.shard_map over a mesh with that axis, on the local chunks") from e


# --- one block: local queries against one piece of keys ------------------------------------------

def _block_kwargs(cfg: _Config, ops: dict, q_row0, k_row0, tq: int, tk: int, q_seg, kv_seg,
                  shift=None) -> dict:
  """flash_attention's keywords for the queries of global rows ``[q_row0, q_row0 + tq)`` against
  the keys ``[k_row0, k_row0 + tk)``. The kernels count key positions from 0: ``q_offset`` is the
  query rows' absolute start minus ``k_row0``; ``mask_fn``/``score_fn`` get ``shift`` (the static
  ``k_row0``) added back to both indices."""
  kw = dict(cfg.kwargs)
  if cfg.positions:
    kw["q_offset"] = ops["q_offset"] + (q_row0 - k_row0)
  if ops["q_len"] is not None:
    kw["query_seq_lengths"] = jnp.clip(ops["q_len"] - q_row0, 0, tq)
  if ops["kv_len"] is not None:
    kw["key_value_seq_lengths"] = jnp.clip(ops["kv_len"] - k_row0, 0, tk)
  if q_seg is not None or kv_seg is not None:
    kw["q_segment_ids"], kw["kv_segment_ids"] = q_seg, kv_seg
  if ops["slopes"] is not None:
    kw["alibi_slopes"] = ops["slopes"]
  mask_fn, score_fn = cfg.mask_fn, cfg.score_fn
  if shift:  # a Python int: closures over scalars stay on the kernels
    if mask_fn is not None:
      kw["mask_fn"] = lambda b, h, qi, ki: mask_fn(b, h, qi + shift, ki + shift)
    if score_fn is not None:
      kw["score_fn"] = lambda x, b, h, qi, ki: score_fn(x, b, h, qi + shift, ki + shift)
  else:
    kw["mask_fn"], kw["score_fn"] = mask_fn, score_fn
  return kw


def _live(cfg: _Config, ops: dict, q_row0, k_row0, tq: int, tk: int):
  """Whether any query of the block may attend any of its keys (a traced bool): the causal and
  window bounds at the extreme ``q_offset``s, and the lengths. None where nothing can rule a block
  out (every block runs)."""
  live = []
  if ops["q_len"] is not None:
    live.append(q_row0 < jnp.max(ops["q_len"]))
  if ops["kv_len"] is not None:
    live.append(k_row0 < jnp.max(ops["kv_len"]))
  if cfg.positions:
    left, right = cfg.window
    q_first = jnp.min(ops["q_offset"]) + q_row0
    q_last = jnp.max(ops["q_offset"]) + q_row0 + (tq - 1)
    if right is not None:
      live.append(k_row0 <= q_last + right)
    if left is not None:
      live.append(k_row0 + (tk - 1) >= q_first - left)
  return functools.reduce(jnp.logical_and, live) if live else None


def _dispatch(cfg: _Config, live, k_chunk, n_chunks: int, tk: int, run, skip):
  """``run(shift)`` where ``live`` (None: always), else ``skip()``: a ``lax.cond``, or with
  ``mask_fn``/``score_fn`` a ``lax.switch`` over the key piece's chunk, whose branches shift their
  indices by a static ``chunk * tk``."""
  if cfg.mask_fn is None and cfg.score_fn is None:
    return run(None) if live is None else lax.cond(live, lambda: run(None), skip)
  index = k_chunk if live is None else jnp.where(live, k_chunk, n_chunks)
  return lax.switch(index, [functools.partial(run, c * tk) for c in range(n_chunks)] + [skip])


def _merge(acc, new):
  """Two partial softmaxes of the same rows merged exactly: ``lse = logaddexp(lse_a, lse_b)``,
  ``out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b``; a row without keys in either keeps
  output 0 and lse ``-inf``. ``acc``: float32 ``(out [B, t, N, H], lse [B, t, N])``."""
  (o_a, l_a), (o_b, l_b) = acc, new
  m = jnp.maximum(l_a, l_b)
  m = jnp.where(m == -jnp.inf, 0.0, m)  # no key in either: exp(-inf - 0) = 0
  w_a, w_b = jnp.exp(l_a - m), jnp.exp(l_b - m)
  total = w_a + w_b
  seen = total > 0
  total = jnp.where(seen, total, 1.0)
  lse = jnp.where(seen, m + jnp.log(total), -jnp.inf)
  out = (o_a * (w_a / total)[..., None] + o_b.astype(jnp.float32) * (w_b / total)[..., None])
  return out, lse


def _shift(x, cfg: _Config):
  """``x`` from the previous device of the ring (device d receives device d-1's). One ppermute per
  array: arrays of different dtypes never share one (jax-ml/jax#32148)."""
  if x is None:
    return None
  c = cfg.axis_size
  return lax.ppermute(x, cfg.axis_name, perm=[(i, (i + 1) % c) for i in range(c)])


def _piece(x, i: int, pieces: int):
  """Piece ``i`` of ``pieces`` along the sequence axis (1) of a local chunk."""
  if x is None:
    return None
  size = x.shape[1] // pieces
  return x[:, i * size:(i + 1) * size]


def _cat(xs):
  return xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=1)


# --- the ring ------------------------------------------------------------------------------------
# C steps: at step s device d holds the K/V of device src = (d - s) mod C (kv = (k, v, kv_seg)).
# A step is _forward_step / _backward_step of (d, src), after _forward_start / _backward_start;
# the ring moves K/V on by ppermute between steps, benchmarks/context_schedule.py runs the same
# steps of every device on one device with K/V sliced out of the global arrays.

def _shift_all(xs, cfg: _Config):
  return tuple(_shift(x, cfg) for x in xs)


def _whole_kwargs(cfg: _Config, causal: bool, q_seg, kv_seg) -> dict:
  """flash_attention's keywords for a whole-chunk call (:func:`_whole_chunks`): the call's own, with
  ``is_causal`` as the pair of chunks needs it; no position reaches the kernels."""
  kw = dict(cfg.kwargs, is_causal=causal)
  if q_seg is not None or kv_seg is not None:
    kw["q_segment_ids"], kw["kv_segment_ids"] = q_seg, kv_seg
  return kw


def _whole_call(cfg: _Config, q, k, v, q_seg, kv_seg, causal: bool):
  """``(out, lse float32)`` of one whole-chunk kernel call."""
  out, lse = attention.flash_attention(q, k, v, return_residual=True,
                                       **_whole_kwargs(cfg, causal, q_seg, kv_seg))
  return tuple(match_vma(out, lse.astype(jnp.float32), q)[:2])


def _forward_start(cfg: _Config, ops, q, kv):
  """``(acc, first)``: the forward's accumulators (per query piece, float32 ``(out [B, t, N, Hv],
  lse [B, t, N])``) before step ``first``. Whole chunks: the first step (``src == d``) runs here,
  ONE call on the local chunks whose result is the accumulators (nothing to merge), ``first = 1``;
  causal with positions counted from 0 (zigzag: chunk 2C-1-d is later than chunk d and its rows
  come after chunk d's in local order, so local causality is the global one). Otherwise empty
  accumulators (output 0, lse ``-inf``), ``first = 0``."""
  pieces = cfg.pieces
  if cfg.whole_chunks:
    out, lse = _whole_call(cfg, q, kv[0], kv[1], ops["q_seg"], kv[2], cfg.is_causal)
    return tuple((_piece(out, p, pieces).astype(jnp.float32), _piece(lse, p, pieces))
                 for p in range(pieces)), 1
  b, t, n, _ = q.shape
  empty = lambda: tuple(match_vma(  # noqa: E731
      jnp.zeros((b, t // pieces, n, kv[1].shape[3]), jnp.float32),
      jnp.full((b, t // pieces, n), -jnp.inf, jnp.float32), q)[:2])
  return tuple(empty() for _ in range(pieces)), 0


def _forward_step(cfg: _Config, ops, q, kv, acc, d, src):
  """``acc`` (:func:`_forward_start`) with device ``d``'s queries ``q`` attending device ``src``'s
  K/V ``kv`` merged in (``d``, ``src``: traced int32; with whole chunks, a step past the first)."""
  if cfg.whole_chunks:
    return _whole_forward_step(cfg, ops, q, kv, acc, d, src)
  c, pieces = cfg.axis_size, cfg.pieces
  tq, tk = q.shape[1] // pieces, kv[0].shape[1] // pieces
  hv = kv[1].shape[3]
  q_chunks, k_chunks = _local_chunks(d, c, cfg.layout), _local_chunks(src, c, cfg.layout)
  acc = list(acc)
  for p in range(pieces):
    qp, q_seg = _piece(q, p, pieces), _piece(ops["q_seg"], p, pieces)
    for r in range(pieces):
      kp, vp, kv_seg = (_piece(x, r, pieces) for x in kv)
      q_row0, k_row0 = q_chunks[p] * tq, k_chunks[r] * tk

      def run(shift, qp=qp, kp=kp, vp=vp, q_seg=q_seg, kv_seg=kv_seg, q_row0=q_row0,
              k_row0=k_row0):
        kw = _block_kwargs(cfg, ops, q_row0, k_row0 if shift is None else shift, tq, tk, q_seg,
                           kv_seg, shift)
        out, lse = attention.flash_attention(qp, kp, vp, return_residual=True, **kw)
        return tuple(match_vma(out, lse.astype(jnp.float32), qp)[:2])

      def skip(qp=qp):
        empty = (jnp.zeros((*qp.shape[:3], hv), qp.dtype),
                 jnp.full(qp.shape[:3], -jnp.inf, jnp.float32))
        return tuple(match_vma(*empty, qp)[:2])

      live = _live(cfg, ops, q_row0, k_row0, tq, tk)
      acc[p] = _merge(acc[p], _dispatch(cfg, live, k_chunks[r], pieces * c, tk, run, skip))
  return tuple(acc)


def _whole_forward_step(cfg: _Config, ops, q, kv, acc, d, src):
  """:func:`_forward_step` on whole chunks (``src != d``): ONE kernel call without causal masking.
  Without ``is_causal`` every local query row attends every visiting key. With it: device ``d``
  holds chunks ``d`` and ``2C-1-d`` (zigzag; contiguous: ``d``), device ``src`` chunks ``src`` and
  ``2C-1-src``, and ``src < C <= 2C-1-d``; so ``src < d``: both query chunks attend key chunk
  ``src`` (piece 0) whole and none of ``2C-1-src`` (later than both); ``src > d``: query chunk
  ``2C-1-d`` (piece 1) attends both key chunks whole, chunk ``d`` none (contiguous: nothing). A
  ``lax.cond`` on the traced indices, each branch merging into the query pieces it covers."""
  pieces = cfg.pieces
  k, v, kv_seg = kv
  q_seg = ops["q_seg"]

  def merge(acc, new, first: int = 0):  # new: the rows of query pieces first...
    n = pieces - first
    return acc[:first] + tuple(_merge(a, (_piece(new[0], i, n), _piece(new[1], i, n)))
                               for i, a in enumerate(acc[first:]))

  if not cfg.is_causal:
    return merge(acc, _whole_call(cfg, q, k, v, q_seg, kv_seg, False))

  def earlier(acc):  # src < d: every query row, key piece 0
    kp, vp, kv_seg_p = (_piece(x, 0, pieces) for x in kv)
    return merge(acc, _whole_call(cfg, q, kp, vp, q_seg, kv_seg_p, False))

  def later(acc):  # src > d: query piece 1 (zigzag), every key
    if pieces == 1:
      return acc
    new = _whole_call(cfg, _piece(q, 1, pieces), k, v, _piece(q_seg, 1, pieces), kv_seg, False)
    return merge(acc, new, first=1)

  return lax.cond(src < d, earlier, later, acc)


def _ring_forward(cfg: _Config, q, k, v, ops):
  c = cfg.axis_size
  d = lax.axis_index(cfg.axis_name)
  kv = (k, v, ops["kv_seg"])
  acc, first = _forward_start(cfg, ops, q, kv)
  if first:
    kv = _shift_all(kv, cfg)

  def step_fn(step, carry):
    acc, kv = carry
    src = (d + (c - step)) % c  # the device whose K/V this one holds at this step
    # Every step sends its K/V on, the last one too (its transfer overlaps the step's kernels; a
    # loop of C steps keeps one copy of the kernels in the program).
    return _forward_step(cfg, ops, q, kv, acc, d, src), _shift_all(kv, cfg)

  acc, _ = lax.fori_loop(first, c, step_fn, (acc, kv))
  out = _cat([o for o, _ in acc]).astype(q.dtype)
  return out, _cat([l for _, l in acc])


def _block_grads(cfg: _Config, ops, qp, kp, vp, out_p, lse_p, dout_p, dlse_p, kw,
                 slope_grad: bool = True, slope_rows: bool = False, whole_row: bool = False):
  """``(dq, dk, dv, dslopes)`` of one block given the rows' global out and lse; ``slope_grad``:
  whether the ALiBi slopes' gradient is wanted (else they are constants of the block, and kernels
  that cannot differentiate them run it). ``slope_rows`` (kernels that differentiate the slopes):
  the fourth is instead each query row's gradient with respect to its slope over the block's keys,
  ``[B, t, N]`` float32, ``sum_j dS_ij * (-|p_i - j|)`` (:func:`_block_slope_rows`)."""
  if slope_rows:
    return _block_slope_rows(qp, kp, vp, out_p, lse_p, dout_p, dlse_p, kw, whole_row)
  if cfg.kernel_backward:
    dq, dk, dv = attention.attention_backward(qp, kp, vp, out_p, lse_p, dout_p, dlse_p, **kw)
    return dq, dk, dv, None
  # Recompute the block's forward: out = sum_j w_j out_j with w_j = exp(lse_j - lse), so the block
  # gets dout_j = w_j dout and dlse_j = w_j (dlse + rowsum(dout * (out_j - out))).
  slopes = kw.pop("alibi_slopes", None)
  if not slope_grad and slopes is not None:
    kw["alibi_slopes"], slopes = slopes, None

  def block(qp, kp, vp, slopes):
    extra = {} if slopes is None else {"alibi_slopes": slopes}
    return attention.flash_attention(qp, kp, vp, return_residual=True, **kw, **extra)

  (out_j, lse_j), vjp = jax.vjp(block, qp, kp, vp, slopes)
  lse_j = lse_j.astype(jnp.float32)
  w = jnp.where(lse_p == -jnp.inf, 0.0, jnp.exp(lse_j - jnp.where(lse_p == -jnp.inf, 0.0, lse_p)))
  dout32 = dout_p.astype(jnp.float32)
  d_out_j = (w[..., None] * dout32).astype(out_j.dtype)
  d_lse_j = w * (dlse_p + jnp.sum(dout32 * (out_j.astype(jnp.float32)
                                            - out_p.astype(jnp.float32)), axis=-1))
  dq, dk, dv, dslopes = vjp((d_out_j, d_lse_j))
  return dq, dk, dv, dslopes


def _block_slope_rows(qp, kp, vp, out_p, lse_p, dout_p, dlse_p, kw, whole_row: bool):
  """``(dq, dk, dv, rows)`` of one block from the kernels' backward with the slopes' per-row sums
  (``attention._attention_backward``): ``rows [B, t, N]`` float32, each query row's
  ``sum_j dS_ij * (-|p_i - j|)`` over the block's keys. The kernels measure distances from the row's
  nearest key of the block (``masking.alibi_row_shift``, ``near``): their sums are ``rows + near *
  rowsum(dS)``, ``rowsum(dS)_i = w_i (dout_i . (out_j,i - out_i) + dlse_i)`` with the block's
  weight ``w = exp(lse_j - lse)`` (``sum_j P_ij = w``, ``sum_j P_ij dP_ij = w dout . out_j``,
  ``D = dout . out - dlse``), which needs the block's forward; ``whole_row``: the block holds
  every key of its rows, so ``rowsum(dS) = dlse`` (0 on a row without keys)."""
  dq, dk, dv, rows, near = attention._attention_backward(qp, kp, vp, out_p, lse_p, dout_p, dlse_p,
                                                         slope_rows=True, **kw)
  if near is None:
    return dq, dk, dv, rows
  empty = lse_p == -jnp.inf
  if whole_row:
    ds_sum = jnp.where(empty, 0.0, dlse_p)
  else:
    out_j, lse_j = attention.flash_attention(qp, kp, vp, return_residual=True, **kw)
    w = jnp.where(empty, 0.0, jnp.exp(lse_j.astype(jnp.float32) - jnp.where(empty, 0.0, lse_p)))
    dot = jnp.sum(dout_p.astype(jnp.float32) * (out_j.astype(jnp.float32)
                                                - out_p.astype(jnp.float32)), axis=-1)
    ds_sum = w * (dot + dlse_p)
  return dq, dk, dv, rows - near * ds_sum


def _backward_start(cfg: _Config, ops, rows, kv, *, with_slopes: bool, slope_rows: bool):
  """``(grads, first)``: the backward's float32 accumulators ``(dq, dk, dv, dslopes)`` (dq per query
  piece, dk/dv per key piece; dslopes: the slopes' (``with_slopes``), per query piece
  ``[B, t, N]`` (``slope_rows``), or None) before step ``first``; as :func:`_forward_start`, the
  whole-chunk first step (one causal call on the local chunks) runs here. ``rows``: this device's
  ``(q, q_seg, out, lse, dout, dlse)``; ``kv``: ``(k, v, kv_seg)``."""
  pieces = cfg.pieces
  split = lambda x: tuple(_piece(x, i, pieces) for i in range(pieces))  # noqa: E731
  if cfg.whole_chunks:  # dq: one float32 accumulator of dQ / scale (_whole_grads)
    q = rows[0]
    acc = match_vma(jnp.zeros(q.shape, jnp.float32), q)[0]
    dq, dk, dv = _whole_grads(cfg, ops, rows, kv, cfg.is_causal, acc)
    return (dq, split(dk), split(dv), None), 1
  q = rows[0]
  zeros = lambda x: match_vma(jnp.zeros(x.shape, jnp.float32), q)[0]  # noqa: E731
  dq, dk, dv = (tuple(zeros(x) for x in split(y)) for y in (q, kv[0], kv[1]))
  dslopes = zeros(ops["slopes"]) if with_slopes else None
  if slope_rows:
    dslopes = tuple(zeros(x[..., 0]) for x in split(q))
  return (dq, dk, dv, dslopes), 0


def _whole_grads(cfg: _Config, ops, rows, kv, causal: bool, dq_acc):
  """float32 ``(dq_acc, dk, dv)`` of one whole-chunk call of the rows ``rows`` against ``kv``:
  ``dq_acc`` (float32, the rows' shape) with the call's dQ / scale added — by the fused dQ kernel
  itself where it runs (``attention._attention_backward``'s ``dq_accumulator``: no zero-filled
  accumulator, rounding pass or add per step) — and the keys' dK, dV."""
  q, q_seg, out, lse, dout, dlse = rows
  k, v, kv_seg = kv
  kw = _whole_kwargs(cfg, causal, q_seg, kv_seg)
  if cfg.kernel_backward:
    grads = attention._attention_backward(q, k, v, out, lse, dout, dlse, dq_accumulator=dq_acc,
                                          **kw)
  else:
    grads = _block_grads(cfg, ops, q, k, v, out, lse, dout, dlse, kw)[:3]
    grads = (accumulate_dq(dq_acc, grads[0], _scale(cfg, q)), *grads[1:])
  return match_vma(*(x.astype(jnp.float32) for x in grads), q)[:3]


def _scale(cfg: _Config, q) -> float:
  """The call's softmax scale, as flash_attention resolves it (None: 1 / sqrt(H))."""
  return resolve_scale(dict(cfg.kwargs).get("scale"), q.shape[-1])


def _backward_step(cfg: _Config, ops, rows, kv, grads, d, src, *, with_slopes: bool,
                   slope_rows: bool):
  """``grads`` (:func:`_backward_start`) plus those of device ``d``'s rows ``rows`` against device
  ``src``'s K/V ``kv`` (dk/dv: of those K/V)."""
  if cfg.whole_chunks:
    return _whole_backward_step(cfg, ops, rows, kv, grads, d, src)
  c, pieces = cfg.axis_size, cfg.pieces
  q = rows[0]
  tq, tk = q.shape[1] // pieces, kv[0].shape[1] // pieces
  hv = kv[1].shape[3]
  q_chunks, k_chunks = _local_chunks(d, c, cfg.layout), _local_chunks(src, c, cfg.layout)
  dq, dk, dv, dslopes = grads
  dq, dk, dv = list(dq), list(dk), list(dv)
  for p in range(pieces):
    qp, q_seg, out_p, lse_p, dout_p, dlse_p = (_piece(x, p, pieces) for x in rows)
    for r in range(pieces):
      kp, vp, kv_seg = (_piece(x, r, pieces) for x in kv)
      q_row0, k_row0 = q_chunks[p] * tq, k_chunks[r] * tk

      def run(shift, qp=qp, kp=kp, vp=vp, q_seg=q_seg, kv_seg=kv_seg, q_row0=q_row0,
              k_row0=k_row0, out_p=out_p, lse_p=lse_p, dout_p=dout_p, dlse_p=dlse_p):
        kw = _block_kwargs(cfg, ops, q_row0, k_row0 if shift is None else shift, tq, tk, q_seg,
                           kv_seg, shift)
        grads = _block_grads(cfg, ops, qp, kp, vp, out_p, lse_p, dout_p, dlse_p, kw,
                             slope_grad=with_slopes, slope_rows=slope_rows)
        grads = tuple(x.astype(jnp.float32) for x in grads if x is not None)
        return match_vma(*grads, qp)[:len(grads)]

      def skip(qp=qp, kp=kp):
        zeros = [jnp.zeros(qp.shape, jnp.float32), jnp.zeros(kp.shape, jnp.float32),
                 jnp.zeros((*kp.shape[:3], hv), jnp.float32)]
        if with_slopes:
          zeros.append(jnp.zeros(ops["slopes"].shape, jnp.float32))
        if slope_rows:
          zeros.append(jnp.zeros(qp.shape[:3], jnp.float32))
        return match_vma(*zeros, qp)[:len(zeros)]

      live = _live(cfg, ops, q_row0, k_row0, tq, tk)
      g = _dispatch(cfg, live, k_chunks[r], pieces * c, tk, run, skip)
      dq[p], dk[r], dv[r] = dq[p] + g[0], dk[r] + g[1], dv[r] + g[2]
      if with_slopes:
        dslopes = dslopes + g[3]
      elif slope_rows:
        dslopes = tuple(x + g[3] if i == p else x for i, x in enumerate(dslopes))
  return tuple(dq), tuple(dk), tuple(dv), dslopes


def _whole_backward_step(cfg: _Config, ops, rows, kv, grads, d, src):
  """:func:`_backward_step` on whole chunks (``src != d``): the calls of
  :func:`_whole_forward_step`, each branch adding to the query and key pieces it covers (causal,
  ``src < d``: dq of every row, dk/dv of key piece 0; ``src > d``: dq of query piece 1, dk/dv of
  every key)."""
  pieces = cfg.pieces

  def add(grads, new, k_count: int = pieces):
    """``grads`` with dq the new accumulator ``new[0]`` and ``new = (dq, dk, dv)``'s dK/dV added to
    key pieces ``...k_count - 1``."""
    _, dk, dv, dslopes = grads
    plus = lambda acc, g: tuple(a + _piece(g, i, len(acc)) for i, a in enumerate(acc))  # noqa: E731
    return (new[0], plus(dk[:k_count], new[1]) + dk[k_count:],
            plus(dv[:k_count], new[2]) + dv[k_count:], dslopes)

  if not cfg.is_causal:
    return add(grads, _whole_grads(cfg, ops, rows, kv, False, grads[0]))

  def earlier(grads):  # src < d: every query row, key piece 0
    return add(grads, _whole_grads(cfg, ops, rows, tuple(_piece(x, 0, pieces) for x in kv), False,
                                   grads[0]), k_count=1)

  def later(grads):  # src > d: query piece 1 (zigzag), every key
    if pieces == 1:
      return grads
    dq = grads[0]
    half = dq.shape[1] // 2
    new = _whole_grads(cfg, ops, tuple(_piece(x, 1, pieces) for x in rows), kv, False,
                       dq[:, half:])
    return add(grads, (dq.at[:, half:].set(new[0]), *new[1:]))

  return lax.cond(src < d, earlier, later, grads)


def _ring_backward(cfg: _Config, q, k, v, ops, out, lse, dout, dlse, slope_grad: bool = True,
                   slope_rows: bool = False):
  """``(dq, dk, dv, dslopes)`` of the ring from the rows' global out and lse. ``slope_grad``: the
  slopes' gradient, summed as the slopes' shape; ``slope_rows`` (kernels that differentiate them):
  instead each query row's ``[B, T/C, N]`` (:func:`_block_grads`), summed over the blocks."""
  c = cfg.axis_size
  d = lax.axis_index(cfg.axis_name)
  slope_rows = ops["slopes"] is not None and slope_rows
  with_slopes = ops["slopes"] is not None and slope_grad and not slope_rows
  flags = dict(with_slopes=with_slopes, slope_rows=slope_rows)
  rows = (q, ops["q_seg"], out, lse, dout, dlse)
  kv = (k, v, ops["kv_seg"])
  grads, first = _backward_start(cfg, ops, rows, kv, **flags)

  def shift(grads, kv):
    # The float32 dK/dV accumulators travel with their K/V block: after C shifts they are home.
    dq, dk, dv, dslopes = grads
    return (dq, _shift_all(dk, cfg), _shift_all(dv, cfg), dslopes), _shift_all(kv, cfg)

  if first:
    grads, kv = shift(grads, kv)

  def step_fn(step, carry):
    grads, kv = carry
    src = (d + (c - step)) % c
    return shift(_backward_step(cfg, ops, rows, kv, grads, d, src, **flags), kv)

  (dq, dk, dv, dslopes), _ = lax.fori_loop(first, c, step_fn, (grads, kv))
  if slope_rows:
    dslopes = _cat(dslopes)
  elif with_slopes:
    dslopes = dslopes.astype(ops["slopes"].dtype)
  return (_final_dq(cfg, dq, q), _cat(dk).astype(k.dtype), _cat(dv).astype(v.dtype), dslopes)


def _final_dq(cfg: _Config, dq, q):
  """The ring's dQ in ``q``'s dtype from its accumulator: whole chunks, one float32 array of
  dQ / scale (:func:`_whole_grads`); else float32 pieces of dQ."""
  return (dq * _scale(cfg, q) if cfg.whole_chunks else _cat(dq)).astype(q.dtype)


def _ring_impl(cfg: _Config, q, k, v, ops):
  return _ring_forward(cfg, q, k, v, ops)


# Two custom_vjps of the ring, as attention._flash/_flash_slopes: _ring_slopes (symbolic_zeros,
# under a jit of its own) for calls with ALiBi slopes, whose fwd learns whether their gradient is
# wanted (CustomVJPPrimal.perturbed), so that fixed slopes run on kernels that cannot differentiate
# them (sm90).
_ring = jax.custom_vjp(_ring_impl, nondiff_argnums=(0,))
_ring_slopes = jax.custom_vjp(_ring_impl, nondiff_argnums=(0,))
_ring_slopes_jit = jax.jit(_ring_slopes, static_argnums=(0,))


def _ring_fwd(cfg: _Config, q, k, v, ops):
  slope_grad = ops["slopes"] is not None and getattr(ops["slopes"], "perturbed", True)
  q, k, v = (getattr(x, "value", x) for x in (q, k, v))
  ops = {name: getattr(x, "value", x) for name, x in ops.items()}
  out, lse = _ring_forward(cfg, q, k, v, ops)
  # slope_grad, static, as the residuals' structure: () or (None,)
  return (out, lse), (q, k, v, ops, out, lse, (None,) if slope_grad else ())


def _ring_bwd(cfg: _Config, residuals, cotangents):
  q, k, v, ops, out, lse, slope_grad = residuals
  dout, dlse = (jnp.zeros(c.shape, c.dtype) if isinstance(c, SymbolicZero) else c
                for c in cotangents)
  dq, dk, dv, dslopes = _ring_backward(cfg, q, k, v, ops, out, lse, dout,
                                       dlse.astype(jnp.float32), slope_grad=bool(slope_grad))
  kernel_reuse.wait_for_compiles()  # the step's kernels compiled before its compile (as _flash_bwd)
  d_ops = {name: None for name in ops}
  if dslopes is not None:
    d_ops["slopes"] = dslopes
  return dq, dk, dv, d_ops


_ring.defvjp(_ring_fwd, _ring_bwd)
_ring_slopes.defvjp(_ring_fwd, _ring_bwd, symbolic_zeros=True)


# --- all-gather and all-to-all -------------------------------------------------------------------

def _natural(x, cfg: _Config, layout: str | None = None):
  """A gathered ``[B, seq, ...]`` array (device order, ``layout``, default ``cfg.layout``) in the
  sequence's natural order."""
  return from_context_layout(x, cfg.axis_size, layout=layout or cfg.layout)


def _gathered(cfg: _Config, k, v, ops):
  """K, V and the key segment ids of the whole sequence (all-gathered, in natural order), and the
  global chunk indices of this device's query pieces."""
  gather = lambda x: None if x is None else _natural(  # noqa: E731
      lax.all_gather(x, cfg.axis_name, axis=1, tiled=True), cfg, cfg.kv_order)
  q_chunks = _local_chunks(lax.axis_index(cfg.axis_name), cfg.axis_size, cfg.layout)
  return gather(k), gather(v), gather(ops["kv_seg"]), q_chunks


def _all_gather(cfg: _Config, q, k, v, ops):
  pieces = cfg.pieces
  tq = q.shape[1] // pieces
  k_all, v_all, kv_seg, q_chunks = _gathered(cfg, k, v, ops)
  s = k_all.shape[1]
  outs, lses = [], []
  for p in range(pieces):
    kw = _block_kwargs(cfg, ops, q_chunks[p] * tq, 0, tq, s, _piece(ops["q_seg"], p, pieces),
                       kv_seg)
    out, lse = attention.flash_attention(_piece(q, p, pieces), k_all, v_all, return_residual=True,
                                         **kw)
    outs.append(out)
    lses.append(lse.astype(jnp.float32))
  return _cat(outs), _cat(lses)


def _all_gather_backward(cfg: _Config, q, k, v, ops, out, lse, dout, dlse,
                         slope_grad: bool = True, slope_rows: bool = False):
  """The gradients of :func:`_all_gather` from the rows' out and lse: K/V gathered again, one
  block gradient per query piece against the whole sequence, dK/dV summed back to their devices
  (``psum_scatter``). ``(dq, dk, dv, dslopes)`` as :func:`_ring_backward` returns them (with
  ``slope_rows``, this device's rows' ``[B, T/C, N]``)."""
  slope_rows = ops["slopes"] is not None and slope_rows
  c, pieces = cfg.axis_size, cfg.pieces
  tq = q.shape[1] // pieces
  k_all, v_all, kv_seg, q_chunks = _gathered(cfg, k, v, ops)
  s = k_all.shape[1]
  dq, dk, dv, dslopes = [], 0.0, 0.0, None
  for p in range(pieces):
    kw = _block_kwargs(cfg, ops, q_chunks[p] * tq, 0, tq, s, _piece(ops["q_seg"], p, pieces),
                       kv_seg)
    piece = lambda x: _piece(x, p, pieces)  # noqa: E731
    grads = _block_grads(cfg, ops, piece(q), k_all, v_all, piece(out), piece(lse), piece(dout),
                         piece(dlse), kw, slope_grad=slope_grad, slope_rows=slope_rows,
                         whole_row=True)
    dq.append(grads[0])
    dk, dv = dk + grads[1].astype(jnp.float32), dv + grads[2].astype(jnp.float32)
    if slope_rows:
      dslopes = [grads[3]] if dslopes is None else [*dslopes, grads[3]]
    elif grads[3] is not None:
      dslopes = grads[3] if dslopes is None else dslopes + grads[3]
  home = lambda x: lax.psum_scatter(  # noqa: E731  [B, S, ...] natural -> this device's chunk
      to_context_layout(x, c, layout=cfg.kv_order), cfg.axis_name, scatter_dimension=1,
      tiled=True)
  if slope_rows:
    dslopes = _cat(dslopes)
  elif dslopes is not None:
    dslopes = lax.psum(dslopes, cfg.axis_name)
  return _cat(dq).astype(q.dtype), home(dk).astype(k.dtype), home(dv).astype(v.dtype), dslopes


def _all_to_all(cfg: _Config, q, k, v, ops):
  c = cfg.axis_size
  n, kh = q.shape[2], k.shape[2]
  if n % c or kh % c:
    raise ValueError(
        f"strategy='all_to_all' splits the heads over the {c} devices of axis {cfg.axis_name!r}: the "
        f"query heads N={n} and key/value heads K={kh} must both be divisible by {c}; use "
        "strategy='ring' or 'all_gather' (or strategy=None)")
  to_heads = lambda x: _natural(lax.all_to_all(  # noqa: E731  [B, T/C, N, H] -> [B, T, N/C, H]
      x, cfg.axis_name, split_axis=2, concat_axis=1, tiled=True), cfg)
  to_seq = lambda x: lax.all_to_all(  # noqa: E731  [B, T, N/C, ...] -> [B, T/C, N, ...]
      to_context_layout(x, c, layout=cfg.layout), cfg.axis_name, split_axis=1, concat_axis=2,
      tiled=True)
  gather = lambda x: None if x is None else _natural(  # noqa: E731
      lax.all_gather(x, cfg.axis_name, axis=1, tiled=True), cfg)
  qh, kh_, vh = to_heads(q), to_heads(k), to_heads(v)
  d = lax.axis_index(cfg.axis_name)
  kw = dict(cfg.kwargs)
  if cfg.positions:
    kw["q_offset"] = ops["q_offset"]
  if ops["q_len"] is not None:
    kw["query_seq_lengths"] = ops["q_len"]
  if ops["kv_len"] is not None:
    kw["key_value_seq_lengths"] = ops["kv_len"]
  if ops["q_seg"] is not None or ops["kv_seg"] is not None:
    kw["q_segment_ids"], kw["kv_segment_ids"] = gather(ops["q_seg"]), gather(ops["kv_seg"])
  heads = n // c
  if ops["slopes"] is not None:  # this device's heads
    kw["alibi_slopes"] = lax.dynamic_slice_in_dim(ops["slopes"], d * heads, heads, axis=-1)

  def run(h0):
    fns = {}
    if cfg.mask_fn is not None:
      fns["mask_fn"] = lambda b, h, qi, ki: cfg.mask_fn(b, h + h0, qi, ki)
    if cfg.score_fn is not None:
      fns["score_fn"] = lambda x, b, h, qi, ki: cfg.score_fn(x, b, h + h0, qi, ki)
    out, lse = attention.flash_attention(qh, kh_, vh, return_residual=True, **kw, **fns)
    return tuple(match_vma(out, lse.astype(jnp.float32), qh)[:2])

  if cfg.mask_fn is None and cfg.score_fn is None:
    out, lse = run(0)
  else:  # the functions see the global head index: a static offset per device
    out, lse = lax.switch(d, [functools.partial(run, i * heads) for i in range(c)])
  return to_seq(out), to_seq(lse)


def _setup(axis_name, axis_size: int, layout: str, strategy: str, query, key, value, *, scale=None,
           is_causal=False, implementation=None, block_sizes=None, deterministic=False,
           interpret=None, query_seq_lengths=None, key_value_seq_lengths=None,
           local_window_size=None, q_segment_ids=None, kv_segment_ids=None, q_offset=None,
           logits_soft_cap=None, alibi_slopes=None, mask_fn=None, score_fn=None):
  """``(cfg, ops)``: the settings (:class:`_Config`) and operands of a call of
  :func:`context_parallel_attention` running ``strategy`` on local chunks shaped as ``query``,
  ``key``, ``value`` (arrays or ``jax.ShapeDtypeStruct``) over ``axis_size`` devices."""
  c, pieces = axis_size, _check_layout(layout)
  b, t_loc, n, _ = query.shape
  s_loc, kh = key.shape[1], key.shape[2]
  if isinstance(local_window_size, list):
    local_window_size = tuple(local_window_size)
  positions = bool(is_causal) or local_window_size is not None or alibi_slopes is not None or (
      mask_fn is not None or score_fn is not None)
  ops = {
      "q_len": _int_array("query_seq_lengths", query_seq_lengths, b),
      "kv_len": _int_array("key_value_seq_lengths", key_value_seq_lengths, b),
      "q_seg": q_segment_ids, "kv_seg": kv_segment_ids,
      "q_offset": (_int_array("q_offset", 0 if q_offset is None else q_offset, b, scalar_ok=True)
                   if positions else None),
      "slopes": None if alibi_slopes is None else jnp.asarray(alibi_slopes),
  }
  for name, raw, limit in (("query_seq_lengths", query_seq_lengths, t_loc * c),
                           ("key_value_seq_lengths", key_value_seq_lengths, s_loc * c)):
    x = np.asarray(raw) if isinstance(raw, (int, list, tuple)) else _concrete(raw)
    if x is not None and x.size and (x.min() < 0 or x.max() > limit):
      raise ValueError(f"{name} are global lengths and must lie in [0, {limit}], got values in "
                       f"[{x.min()}, {x.max()}]")
  kwargs = (("scale", scale), ("is_causal", is_causal), ("implementation", implementation),
            ("block_sizes", block_sizes), ("deterministic", deterministic),
            ("interpret", interpret), ("local_window_size", local_window_size),
            ("logits_soft_cap", logits_soft_cap))
  whole = strategy == "ring" and _whole_chunks(
      bool(is_causal), t_loc, s_loc, window=local_window_size, q_len=ops["q_len"],
      kv_len=ops["kv_len"], q_offset=q_offset, slopes=alibi_slopes, mask_fn=mask_fn,
      score_fn=score_fn)
  kernel_backward = False
  if strategy == "ring" and alibi_slopes is None:
    # the ring's calls (query rows, keys, is_causal): the blocks' backward runs the kernels where
    # every one of them does
    if not whole:
      calls = [(t_loc // pieces, s_loc // pieces, bool(is_causal))]
    elif is_causal and pieces == 2:  # _forward_start, _whole_forward_step
      calls = [(t_loc, s_loc, True), (t_loc, s_loc // 2, False), (t_loc // 2, s_loc, False)]
    else:
      calls = [(t_loc, s_loc, bool(is_causal))] + ([(t_loc, s_loc, False)] if is_causal else [])
    seg = lambda x, t: None if x is None else jax.ShapeDtypeStruct((b, t), x.dtype)  # noqa: E731
    struct = lambda x: None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
    kernel_backward = all(attention.backend_for(
        jax.ShapeDtypeStruct((b, tq, n, query.shape[3]), query.dtype),
        jax.ShapeDtypeStruct((b, tk, kh, key.shape[3]), key.dtype),
        jax.ShapeDtypeStruct((b, tk, kh, value.shape[3]), value.dtype),
        **dict(kwargs, is_causal=causal), q_segment_ids=seg(q_segment_ids, tq),
        kv_segment_ids=seg(kv_segment_ids, tk), mask_fn=mask_fn, score_fn=score_fn,
        query_seq_lengths=struct(ops["q_len"]), key_value_seq_lengths=struct(ops["kv_len"]),
        q_offset=None if whole else struct(ops["q_offset"])).backend != "xla"
        for tq, tk, causal in calls)
  cfg = _Config(axis_name, c, layout, kwargs, mask_fn, score_fn, positions,
                _window(local_window_size, bool(is_causal)), kernel_backward, whole)
  return cfg, ops


# --- the public call -----------------------------------------------------------------------------

def context_parallel_attention(query, key, value, *, axis_name, layout=None, strategy=None,
                               scale=None, is_causal=False, implementation=None,
                               return_residual=False, block_sizes=None, deterministic=False,
                               interpret=None, query_seq_lengths=None, key_value_seq_lengths=None,
                               local_window_size=None, q_segment_ids=None, kv_segment_ids=None,
                               q_offset=None, logits_soft_cap=None, alibi_slopes=None,
                               mask_fn=None, score_fn=None):
  """:func:`fa2_jax.flash_attention` over a sequence sharded along mesh axis ``axis_name``, called
  inside ``jax.shard_map`` on each device's chunks (module docstring: layout, strategies).

  Args:
    query: the local chunk ``[B, T/C, N, H]``; key, value: ``[B, S/C, K, H]``, all in ``layout``
      (:func:`to_context_layout` of the global arrays), ``C`` the size of ``axis_name``.
    axis_name: the mesh axis the sequence is sharded along (a name ``shard_map`` binds).
    strategy: ``"ring"``, ``"all_to_all"``, ``"all_gather"``, or None:
      :func:`context_parallel_strategy` picks (and says why).
    layout: required: ``"zigzag"`` (device ``d`` holds chunks ``d`` and ``2C-1-d`` of ``2C``:
      balanced under ``is_causal``; the arrays put in that order by :func:`to_context_layout`) or
      ``"contiguous"`` (chunk ``d`` of ``C``: a sequence sharded as it is). The chunks' order
      cannot be seen in them, and the wrong one gives wrong results, so it has no default.
    q_segment_ids, kv_segment_ids: the local chunks ``[B, T/C]``, ``[B, S/C]``, in ``layout``.
    query_seq_lengths, key_value_seq_lengths: GLOBAL lengths ``[B]`` (counted in the natural order).
    q_offset: the absolute position of GLOBAL query row 0 (int, scalar or ``[B]``).
    mask_fn, score_fn: see absolute positions (global sequence indices; ``q_offset`` added for
      queries) and the global head index. With the kernels they must close over Python scalars
      only (the ring and all_to_all pass them static index shifts, one ``lax.switch`` branch per
      chunk or device).
    The other keywords are :func:`fa2_jax.flash_attention`'s, with its meaning.

  Returns:
    The local ``out [B, T/C, N, H]`` in ``layout`` (and ``lse [B, T/C, N]`` with
    ``return_residual``): ``from_context_layout`` of the gathered result is ``flash_attention``'s.

  Raises TypeError without ``layout``; ValueError for an unknown strategy or layout, local lengths that ``layout`` cannot cut
  (zigzag: ``T/C`` and ``S/C`` even), an ``axis_name`` not bound by ``shard_map``, and a strategy
  that cannot run the call (``all_to_all`` with heads not divisible by ``C``), naming the fix.
  """
  if layout is None:
    raise TypeError(
        "context_parallel_attention needs layout=: 'contiguous' for chunks sharded in sequence "
        "order (a PartitionSpec on the sequence axis of the arrays as they are), or 'zigzag' for "
        "arrays put in that order by fa2_jax.to_context_layout (balanced under is_causal); the "
        "chunks' order cannot be seen in them and the wrong one gives wrong results")
  return _context_parallel(
      query, key, value, axis_name=axis_name, strategy=strategy, layout=layout, kv_layout=None,
      return_residual=return_residual, scale=scale, is_causal=is_causal,
      implementation=implementation, block_sizes=block_sizes, deterministic=deterministic,
      interpret=interpret, query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size,
      q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, q_offset=q_offset,
      logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes, mask_fn=mask_fn,
      score_fn=score_fn)


def _context_parallel(query, key, value, *, axis_name, strategy, layout, kv_layout,
                      return_residual, **kw):
  """:func:`context_parallel_attention`, with ``kv_layout``: None, or the K/V chunks' layout where
  it differs from the queries' (the all-gather strategy only, which gathers K/V into natural order
  from either: ``flash_attention`` under jit moves only the query side to the zigzag layout)."""
  kv_segment_ids, score_fn = kw["kv_segment_ids"], kw["score_fn"]
  if strategy is not None and strategy not in STRATEGIES:
    raise ValueError(f"strategy must be None or one of {STRATEGIES}, got {strategy!r}")
  pieces = _check_layout(layout)
  for name, x in (("query", query), ("key", key), ("value", value)):
    if getattr(x, "ndim", None) != 4:
      raise ValueError(f"context_parallel_attention takes rank-4 local chunks ([B, T/C, N, H], "
                       f"[B, S/C, K, H]); {name} has shape {getattr(x, 'shape', None)}")
  c = _axis_size(axis_name)
  b, t_loc, n, _ = query.shape
  s_loc, kh = key.shape[1], key.shape[2]
  for what, length in (("query", t_loc), ("key/value", s_loc)):
    if length % pieces:
      raise ValueError(
          f"layout='zigzag' cuts the sequence into 2*C = {2 * c} chunks (C = {c}, the size of axis "
          f"{axis_name!r}): the {what} sequence length {length * c} (local {length}) is not "
          f"divisible by {2 * c}; pad it to a multiple of {2 * c} (query_seq_lengths/"
          "key_value_seq_lengths mask the padding) or use layout='contiguous'")
  if strategy is None:
    strategy, _ = context_parallel_strategy(
        (b, t_loc * c, n, query.shape[3]), (b, s_loc * c, kh, key.shape[3]), c, dtype=key.dtype,
        has_kv_segment_ids=kv_segment_ids is not None, value_head_dim=value.shape[3])
  if strategy == "ring" and score_fn is not None and closes_over_arrays(
      Variant(score_fn=score_fn)) is not None:
    raise ValueError(
        "strategy='ring' does not differentiate arrays that score_fn closes over (its custom_vjp "
        "takes the function as static); use strategy='all_gather' or 'all_to_all', or a score_fn "
        "that closes over Python scalars only")
  if kv_layout not in (None, layout) and strategy != "all_gather":
    raise ValueError(f"K/V chunks in another layout than the queries' need strategy='all_gather', "
                     f"got {strategy!r}")
  cfg, ops = _setup(axis_name, c, layout, strategy, query, key, value, **kw)
  if kv_layout not in (None, layout):
    cfg = dataclasses.replace(cfg, kv_layout=kv_layout)
  if strategy == "ring":
    arrays = match_vma(query, key, value, *(x for x in ops.values() if x is not None))
    query, key, value = arrays[:3]
    ops = dict(zip([name for name, x in ops.items() if x is not None], arrays[3:]),
               **{name: None for name, x in ops.items() if x is None})
    ring = _ring if ops["slopes"] is None else _ring_slopes_jit
    out, lse = ring(cfg, query, key, value, ops)
  elif strategy == "all_gather":
    out, lse = _all_gather(cfg, query, key, value, ops)
  else:
    out, lse = _all_to_all(cfg, query, key, value, ops)
  return (out, lse) if return_residual else out


# --- flash_attention on sequence-sharded arrays under jit ----------------------------------------
# flash_attention runs a call whose q/k/v are sharded along T and S over one mesh axis as context
# parallelism over that axis, on the arrays' contiguous chunks (natural order; a causal call relaid
# out in zigzag order and back where _balances says): under
# Explicit axes as context_parallel_attention inside a shard_map (sequence_sharded, explicit_call);
# under Auto axes from the kernels' partition callbacks (partitioned_forward, partitioned_backward),
# which run the strategies' forward and backward on each device's chunks.


def _kernel_setup(st, axis_name, q, k, v, extras) -> tuple[_Config, dict, str]:
  """The ring's settings, operands and strategy for a kernel call (``attention._Static`` ``st``,
  its extra operands ``extras`` in the order of ``st.fields``) split along the sequence over
  ``axis_name`` in contiguous chunks: each block runs ``st``'s kernel family with its own tuned
  tiles. The settings' layout is zigzag where :func:`_balances` says (the caller relays the
  chunks out: :func:`_to_layout`)."""
  variant = st.variant
  window = None if variant is None else variant.window
  cap = None if variant is None else variant.soft_cap
  mask_fn = None if variant is None else variant.mask_fn
  score_fn = None if variant is None else variant.score_fn
  a = dict(zip(st.fields, extras))
  slopes = a.get("alibi_slopes")  # [B, N] float32
  positions = bool(st.is_causal) or window is not None or mask_fn is not None or (
      score_fn is not None) or slopes is not None
  q_offset = a.get("q_offset")
  if positions and q_offset is None:
    q_offset = jnp.zeros((q.shape[0],), jnp.int32)
  ops = {"q_len": a.get("q_lengths"), "kv_len": a.get("kv_lengths"),
         "q_seg": a.get("q_segment_ids"), "kv_seg": a.get("kv_segment_ids"),
         "q_offset": q_offset if positions else None, "slopes": slopes}
  kwargs = (("scale", st.scale), ("is_causal", st.is_causal), ("implementation", st.backend),
            ("block_sizes", None), ("deterministic", st.deterministic),
            ("interpret", st.interpret), ("local_window_size", window), ("logits_soft_cap", cap))
  whole = _whole_chunks(bool(st.is_causal), q.shape[1], k.shape[1], window=window,
                        q_len=ops["q_len"], kv_len=ops["kv_len"], q_offset=a.get("q_offset"),
                        slopes=slopes, mask_fn=mask_fn, score_fn=score_fn)
  cfg = _Config(axis_name, _axis_size(axis_name), "contiguous", kwargs, mask_fn, score_fn,
                positions, _window(window, bool(st.is_causal)), kernel_backward=True,
                whole_chunks=whole)
  strategy = _kernel_strategy(cfg, q, k, v, ops)
  if _balances(bool(st.is_causal), window, q.shape[1], k.shape[1], strategy, cfg.axis_size,
               mask_fn is not None or score_fn is not None):
    # the all-gather gathers K/V into natural order from either layout: they stay where they are
    cfg = dataclasses.replace(cfg, layout="zigzag",
                              kv_layout="contiguous" if strategy == "all_gather" else None)
  return cfg, ops, strategy


def _move(xs, axis_name, axis_size: int, layout: str, *, back: bool = False) -> tuple:
  """``xs`` (arrays with the sequence on axis 1, or None) between this device's contiguous chunk
  and its chunks of ``layout`` (``back``: to the contiguous one)."""
  if layout == "contiguous":
    return tuple(xs)
  return tuple(None if x is None else _relayout(x, axis_name, axis_size, 1, to_zigzag=not back)
               for x in xs)


def _to_layout(cfg: _Config, *xs, back: bool = False, kv: bool = False):
  """:func:`_move` to ``cfg.layout`` (``kv``: to ``cfg.kv_order``) or back."""
  return _move(xs, cfg.axis_name, cfg.axis_size, cfg.kv_order if kv else cfg.layout, back=back)


def _ops_in_layout(cfg: _Config, ops: dict) -> dict:
  """``ops`` with the per-token segment ids in ``cfg.layout`` (the rest is per batch row)."""
  (q_seg,), (kv_seg,) = _to_layout(cfg, ops["q_seg"]), _to_layout(cfg, ops["kv_seg"], kv=True)
  return dict(ops, q_seg=q_seg, kv_seg=kv_seg)


def _kernel_strategy(cfg: _Config, q, k, v, ops) -> str:
  """The strategy of :func:`context_parallel_strategy` for the local chunks ``q``, ``k``, ``v``."""
  c = cfg.axis_size
  b, t, n, h = q.shape
  return context_parallel_strategy((b, t * c, n, h), (b, k.shape[1] * c, *k.shape[2:]), c,
                                   dtype=k.dtype, has_kv_segment_ids=ops["kv_seg"] is not None,
                                   value_head_dim=v.shape[3])[0]


def _kernel_row_distance(st, cfg: _Config, ops, q, k):
  """``[B, T/C, 1]`` float32: the distance from each of this device's query rows to its nearest key
  of the whole call (``masking.alibi_row_shift`` at the global positions, against the global S), or
  None where the kernels shift nothing. Their lse (and row statistics) is the softmax's plus
  ``slope`` times it."""
  if st.variant is None or not shifts_alibi(st.variant):
    return None
  t = q.shape[1]
  rows = lax.axis_index(cfg.axis_name) * t + jnp.arange(t, dtype=jnp.int32)  # global rows [T/C]
  p = ops["q_offset"][:, None] + rows[None, :]  # [B, T/C] absolute positions
  return alibi_row_shift(p, k.shape[1] * cfg.axis_size).astype(jnp.float32)[:, :, None]


def partitioned_forward(st, axis_name, q, k, v, *extras):
  """The forward of a kernel call whose sequence the compiler shards over ``axis_name`` (Auto mesh
  axes; ``fa2_jax.sharding.Context``), on each device's chunks: ``(out, stats)`` as the kernels'
  forward returns them, the row statistics those of the whole softmax
  (``kernels.softmax.stats_from_lse``) in the kernels' frame (with ALiBi: the lse plus their row
  shift ``slope * near``, :func:`_kernel_row_distance`, which ``attention._lse`` removes). The
  strategy is ``strategy=None``'s."""
  cfg, ops, strategy = _kernel_setup(st, axis_name, q, k, v, extras)
  run = {"ring": _ring_forward, "all_gather": _all_gather, "all_to_all": _all_to_all}
  out, lse = run[strategy](cfg, *_to_layout(cfg, q), *_to_layout(cfg, k, v, kv=True),
                           _ops_in_layout(cfg, ops))
  out, lse = _to_layout(cfg, out, lse, back=True)
  if (near := _kernel_row_distance(st, cfg, ops, q, k)) is not None:
    lse = jnp.where(lse == -jnp.inf, lse, lse + ops["slopes"][:, None, :] * near)
  modifies = st.variant is not None and st.variant.modifies_scores
  return out, stats_from_lse(jnp.swapaxes(lse, 1, 2), st.scale, modifies)


def partitioned_backward(st, axis_name, q, k, v, out, stats, dout, dlse, *extras):
  """The backward of :func:`partitioned_forward` on each device's chunks (``dlse [B, N, T/C]``):
  ``(dq, dk, dv)``, and with ``st.slope_grad`` the kernels' ``dslope_rows [B, N, T/C]`` (per
  query row the sum of ``dS * d s / d slope`` over all its keys, distances in the kernels' frame:
  the row's gradient plus ``near * dlse``, since ``rowsum(dS) = dlse``). K/V gathered again where
  the forward gathered them (all_gather), else the ring (all_to_all's memory per device stays S/C
  so)."""
  cfg, ops, strategy = _kernel_setup(st, axis_name, q, k, v, extras)
  modifies = st.variant is not None and st.variant.modifies_scores
  lse = jnp.swapaxes(lse_from_stats(stats, st.scale, modifies), 1, 2)  # [B, T/C, N]
  near = _kernel_row_distance(st, cfg, ops, q, k)
  if near is not None:  # the softmax's own
    lse = jnp.where(lse == -jnp.inf, lse, lse - ops["slopes"][:, None, :] * near)
  dlse = jnp.swapaxes(dlse, 1, 2).astype(jnp.float32)
  run = _all_gather_backward if strategy == "all_gather" else _ring_backward
  args = (cfg, *_to_layout(cfg, q), *_to_layout(cfg, k, v, kv=True), _ops_in_layout(cfg, ops),
          *_to_layout(cfg, out, lse, dout, dlse))

  def back(dq, dk, dv, *rows):  # the gradients (and the slopes' row sums) in contiguous chunks
    dq, *rows = _to_layout(cfg, dq, *rows, back=True)
    return (dq, *_to_layout(cfg, dk, dv, back=True, kv=True), *rows)

  if not st.slope_grad:  # the slopes (if any) are constants: the kernels' backward as is
    return back(*run(*args, slope_grad=False)[:3])
  dq, dk, dv, rows = back(*run(*args, slope_rows=True))
  if near is not None:
    rows = rows + near * jnp.where(lse == -jnp.inf, 0.0, dlse)
  return dq, dk, dv, jnp.swapaxes(rows, 1, 2)


def _operands(call):
  """``(arrays, layouts, names, fields, whole)`` of a validated call (``call.Call``): q, k, v and
  its variant arrays, with their sharding layouts, and the axes a mask_fn/score_fn keeps whole."""
  fields = tuple(f for f in VariantArrays._fields if getattr(call.arrays, f) is not None)
  arrays = (call.query, call.key, call.value, *(getattr(call.arrays, f) for f in fields))
  layouts = (sharding.Q, sharding.KV, sharding.V, *(attention._FIELD_LAYOUTS[f] for f in fields))
  names = (*sharding.QKV_NAMES, *fields)
  whole = attention._unsplittable(call.variant, call.query.shape[0], call.query.shape[2])
  return arrays, layouts, names, fields, whole


def sequence_sharded(call):
  """``(mesh, specs, plan)`` where Explicit mesh axes shard the sequence (T or S) of a validated
  call's query/key/value, or None.

  Raises:
    ValueError: a sharding the call cannot keep (the plan's problems: the sequence over several
      mesh axes or over axes that do not divide T and S, T and S over different axes, ...).
  """
  arrays, layouts, names, _, whole = _operands(call)
  found = sharding.explicit_plan(arrays, layouts, names, whole)
  if found is None:
    return None
  mesh, specs, p = found
  if not any(axes for spec, layout in zip(specs[:3], layouts)
             for c, axes in zip(layout, sharding._entries(spec, len(layout))) if c in "ts"):
    return None
  if p.problems:
    raise sharding.refusal(p.problems)
  return mesh, specs, p


def explicit_strategy(call, found) -> tuple[str, str, str]:
  """``(strategy, reason, layout)``: ``context_parallel_strategy`` of a call that
  ``sequence_sharded`` found, for each device's share of the batch and heads, and the layout its
  chunks run in (zigzag where :func:`_balances` says, else the arrays' contiguous one)."""
  mesh, _, p = found
  size = lambda axes: math.prod(mesh.shape[a] for a in axes)  # noqa: E731
  b, t, n, h = call.query.shape
  _, s, kh, _ = call.key.shape
  c = size(p.context)
  local = lambda shape: (shape[0] // size(p.batch), shape[1], shape[2] // size(p.heads), shape[3])  # noqa: E731
  strategy, why = context_parallel_strategy(
      local((b, t, n, h)), local((b, s, kh, call.key.shape[3])), c,
      dtype=call.key.dtype, has_kv_segment_ids=call.arrays.kv_segment_ids is not None,
      value_head_dim=call.value.shape[3])
  variant = call.variant
  window = None if variant is None else variant.window
  fns = variant is not None and (variant.mask_fn is not None or variant.score_fn is not None)
  zigzag = _balances(bool(call.is_causal), window, t // c, s // c, strategy, c, fns)
  return strategy, why, "zigzag" if zigzag else "contiguous"


def explicit_call(call, found, implementation, block_sizes):
  """``(out, lse)`` of a validated call that ``sequence_sharded`` found: context parallelism over the
  sequence's mesh axis, with the batch and heads split as the plan says, inside a ``shard_map``, on
  the arrays' contiguous chunks or, where ``explicit_strategy`` says, relaid out in the zigzag
  order and back; ``implementation`` and ``block_sizes`` as the call gave them (each block's
  ``flash_attention`` chooses by them)."""
  mesh, specs, p = found
  arrays, layouts, _, fields, _ = _operands(call)
  strategy, _, layout = explicit_strategy(call, found)
  variant = call.variant
  axis = p.context[0]
  c = math.prod(mesh.shape[a] for a in p.context)

  # The all-gather gathers K/V into natural order from either layout: only the query side moves.
  kv_layout = "contiguous" if strategy == "all_gather" else layout

  def body(q, k, v, *extras):
    a = dict(zip(fields, extras))
    # segment ids travel with their tokens; the rest is per batch row
    q, a["q_segment_ids"] = _move((q, a.get("q_segment_ids")), axis, c, layout)
    k, v, a["kv_segment_ids"] = _move((k, v, a.get("kv_segment_ids")), axis, c, kv_layout)
    kw = dict(scale=call.scale, is_causal=call.is_causal, implementation=implementation,
              block_sizes=block_sizes, deterministic=call.deterministic, interpret=call.interpret,
              query_seq_lengths=a.get("q_lengths"), key_value_seq_lengths=a.get("kv_lengths"),
              local_window_size=variant.window, q_segment_ids=a.get("q_segment_ids"),
              kv_segment_ids=a.get("kv_segment_ids"), q_offset=a.get("q_offset"),
              logits_soft_cap=variant.soft_cap, alibi_slopes=a.get("alibi_slopes"),
              mask_fn=variant.mask_fn, score_fn=variant.score_fn)
    out, lse = _context_parallel(q, k, v, axis_name=axis, strategy=strategy, layout=layout,
                                 return_residual=True, kv_layout=kv_layout, **kw)
    return _move((out, lse), axis, c, layout, back=True)

  return sharding.shard_map_call(body, mesh, p, arrays, specs, layouts,
                                 (sharding.O, sharding.LSE_PUBLIC))
