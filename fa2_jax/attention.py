"""Public entry point: validation, backend choice, and the ``jax.custom_vjp`` around the kernels."""
from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from . import dispatch, kernel_reuse, sharding
from .kernels import registry
from .kernels.backend import KernelCall, accumulate_dq
from .kernels.softmax import kernel_scale, lse_from_stats, stats_from_lse
from .kernels.vma import match_vma, varying_axes
from .kernels.block_ranges import index_reads, range_tables, warm_static_masks
from .kernels.masking import (Variant, VariantArrays, alibi_lse_shift, clip_ranges,
                              remove_alibi_shift)
from .call import prepare
from .paged import backend_for_paged, flash_attention_paged
from .reference import attention_formula
from .validation import check_no_dense, check_variant

_SECOND_ORDER = (
    "fa2_jax kernels have no second-order derivative (grad of grad, hessian, jvp of the backward): "
    "the backward is itself a Pallas kernel with no derivative rule. Use implementation='xla' for "
    "higher-order derivatives.")
_FORWARD_MODE = (
    "fa2_jax kernels support reverse-mode autodiff only (grad, vjp, jacrev); forward-mode (jvp, "
    "jacfwd) is not available through the kernels. Use jax.jacrev instead of jacfwd, or "
    "implementation='xla' for forward-mode derivatives.")


@dataclasses.dataclass(frozen=True)
class _Static:
  """Everything about a kernel call that is not an array: hashable, passed as a nondiff argument."""

  scale: float
  is_causal: bool
  backend: str  # a kernel family's name (kernels.registry)
  deterministic: bool
  interpret: bool
  config: object  # the family's launch config (Backend.launch_config: tuned default or the user's)
  variant: Variant | None = None  # the attention variant (None: dense, or causal by is_causal)
  # The extra operands: VariantArrays fields, then "table_<name>" range tables (fa2_jax.kernels.block_ranges).
  fields: tuple[str, ...] = ()
  # (axis, reason) of the axes the kernels cannot split over devices (_unsplittable).
  whole: tuple[tuple[str, str], ...] = ()
  # The backward also returns the ALiBi slopes' gradient (set in _flash_bwd where they are perturbed).
  slope_grad: bool = False

  def arrays(self, extras) -> VariantArrays:
    """The :class:`VariantArrays` of the extra operands (in the order of ``fields``)."""
    return VariantArrays(**{f: x for f, x in zip(self.fields, extras) if f in _FIELD_LAYOUTS})

  def clipped_arrays(self, extras, seq_q: int, seq_k: int) -> VariantArrays:
    """:meth:`arrays`, the lengths and ``q_offset`` clipped where the kernels took them as given
    (``Backend.clips_ranges``)."""
    arrays = self.arrays(extras)
    if registry.get(self.backend).clips_ranges(self.config):
      arrays = clip_ranges(arrays, seq_q, seq_k)
    return arrays

  def tables(self, extras) -> dict:
    """The range tables among the extra operands, by kernel name (``"fwd"``, ``"dkv"``, ...)."""
    return {f[len("table_"):]: x for f, x in zip(self.fields, extras) if f.startswith("table_")}


# Sharding layouts (fa2_jax.sharding) of the VariantArrays fields the kernels take.
_FIELD_LAYOUTS = {"q_lengths": "b", "kv_lengths": "b", "q_segment_ids": "bt",
                  "kv_segment_ids": "bs", "q_offset": "b", "alibi_slopes": "bn"}
# A range table [B, N', n_blocks, 4]: B with the batch, N' (N or 1) with the heads or whole, and its
# own letter for the block axis (tables of different kernels have different block counts).
_TABLE_BLOCK_AXIS = {"fwd": "c", "dkv": "e", "dq": "g"}


# The extra operand of a backward that adds its dQ / scale to a float32 accumulator
# (_attention_backward's dq_accumulator: the ring's running dQ), laid out as q.
DQ_ACCUMULATOR = "dq_accumulator"


def _layout(field: str, extra) -> str:
  if field == DQ_ACCUMULATOR:
    return "btnh"
  if field in _FIELD_LAYOUTS:
    return _FIELD_LAYOUTS[field]
  return "b" + ("n" if extra.shape[1] > 1 else "a") + _TABLE_BLOCK_AXIS[field[len("table_"):]] + "d"


def flash_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                    implementation=None, return_residual=False, block_sizes=None,
                    deterministic=False, interpret=None, query_seq_lengths=None,
                    key_value_seq_lengths=None, local_window_size=None, q_segment_ids=None,
                    kv_segment_ids=None, q_offset=None, logits_soft_cap=None, alibi_slopes=None,
                    mask_fn=None, score_fn=None, block_table=None):
  """Exact attention, ``softmax(scale * Q K^T) V``, with FlashAttention-2 kernels.

  Args:
    query: ``[B, T, N, H]`` or ``[T, N, H]``; bfloat16, float16 or float32.
    key: ``[B, S, K, H]`` (or ``[S, K, H]``), ``N % K == 0``: ``K < N`` is grouped-query
      attention, ``K == 1`` multi-query. K/V heads are shared without copies.
    value: ``[B, S, K, Hv]`` (or ``[S, K, Hv]``): ``Hv`` may differ from ``H`` (multi-head latent
      attention, e.g. DeepSeek-V2's ``H = 192``, ``Hv = 128``; jax.nn requires ``Hv == H``); the
      output has ``Hv``. The sm90 kernels need ``Hv == H`` (``implementation=None`` runs the
      Triton kernels for such a call).
    bias, mask: None only, by keyword or position (``jax.nn.dot_product_attention``'s argument
      order). A dense array raises a ValueError naming what to pass instead: the kernels never form
      the ``[T, S]`` logits, so masks are given by their structure (``is_causal``, lengths,
      ``local_window_size``, segment ids, ``mask_fn``) and biases as ``alibi_slopes``,
      ``logits_soft_cap`` or ``score_fn``.
    scale: logit scale, default ``1 / sqrt(H)`` (the query/key head_dim). A static Python float.
    is_causal: query ``i`` attends keys ``j <= p`` where ``p = q_offset + i`` is its absolute
      position (``q_offset = 0``: top-left aligned, as ``jax.nn.dot_product_attention``; for
      ``T > S`` rows past ``S`` see every key; ``q_offset = S - T`` aligns bottom-right).
    implementation: None (see :mod:`fa2_jax.dispatch`: the sm90 Mosaic GPU kernels on Hopper for
      the calls they support, the Triton kernels on every other GPU, the XLA formula on CPU), a
      kernel family's name (``"sm90"``, ``"triton"``; ``"mosaic"`` names the Mosaic GPU family of
      this GPU, sm90's), which raises a ValueError naming the reason on a call it cannot run, or
      ``"xla"``. :func:`fa2_jax.backend_for` tells which kernels a call runs, and why.
    return_residual: also return ``lse`` ``[B, T, N]`` float32, the natural-log logsumexp of each
      row's scaled logits (differentiable; jax.nn's is in the key's dtype, without a gradient:
      docs/jax-nn-differences.md).
    block_sizes: None for the tuned defaults, or a kernel family's config, which selects that
      family (a ValueError if it cannot run the call): :class:`fa2_jax.MosaicConfig` (sm90) or
      :class:`fa2_jax.BlockSizes` (Triton).
    deterministic: guarantee a backward without atomics, bit-identical across runs. With False (the
      default) the sm90 kernels fuse dQ into the dK/dV kernel for head_dim 64/128 calls from 2k
      query rows non-causal and 4k causal (5k at head_dim 128; TMA reduce-adds, whose order varies;
      ``MosaicConfig.fuses_dq``); every other call is deterministic anyway.
    interpret: True runs the Pallas kernels in interpret mode on any platform (CPU tests).
    query_seq_lengths: integer ``[B]`` (rank-3 call: a scalar or ``[1]``), values in ``[0, T]``:
      query rows ``i >= query_seq_lengths[b]`` are padding, with output 0, lse ``-inf`` and zero
      gradients.
    key_value_seq_lengths: integer ``[B]`` (rank-3: scalar or ``[1]``), values in ``[0, S]``: keys
      ``j >= key_value_seq_lengths[b]`` are never attended (their dK, dV are zero).
      Lengths are checked against ``[0, T]`` / ``[0, S]`` only when concrete; a traced length
      outside the range behaves as if clipped to it.
    local_window_size: an int ``w`` (the same as ``(w, w)``) or ``(left, right)``, each an int
      ``>= 0`` or None (unbounded): the query at absolute position ``p`` attends keys
      ``p - left <= j <= p + right`` (``jax.nn.dot_product_attention``'s semantics). With
      ``is_causal`` the right side is ``min(right, 0)``.
    q_segment_ids, kv_segment_ids: integer ``[B, T]`` and ``[B, S]`` (rank-3: ``[T]``, ``[S]``),
      both or neither: query ``i`` attends key ``j`` only where ``q_segment_ids[b, i] ==
      kv_segment_ids[b, j]`` (packed documents). Any int32 values.
    q_offset: an int, an integer scalar (e.g. a traced decoding position) or an integer ``[B]``,
      ``|q_offset| < 2**30``: the absolute position of query row 0, used by ``is_causal``,
      ``local_window_size``, ``alibi_slopes``, ``mask_fn`` and ``score_fn`` (bottom-right alignment
      ``S - T``, chunked prefill, decoding against a cache). Key ``j`` sits at position ``j``.
      Ignored when nothing reads positions.
    logits_soft_cap: a static float ``> 0``: the scaled logits become ``cap * tanh(s / cap)``.
    alibi_slopes: float ``[N]`` or ``[B, N]`` (used as float32): adds ``-slope[b, h] * |p - j|`` to
      the logits (after the soft cap). Differentiated on the formula and the Triton kernels; a
      gradient asked of the Mosaic kernels raises a TypeError (``jax.lax.stop_gradient`` the slopes,
      or pick ``implementation="triton"``/``"xla"``).
    mask_fn: ``mask_fn(b, h, q_idx, kv_idx) -> bool``: a jnp function called as if per pair, with
      int32 scalars (every path evaluates it so: ``jax.vmap`` on the formula, its scalar jaxpr on a
      kernel's tile), so it must be elementwise: a reduction such as ``jnp.min(q_idx)`` sees one
      element. Returns one bool; ``q_idx`` is the absolute query position ``q_offset + i``, ``h``
      the query head. False hides the pair. Traced once at the call on scalars (a TypeError naming
      ``mask_fn`` and the cause if that fails). The kernels take closures over Python and numpy
      scalars and elementwise operations; a function that closes over a JAX array (0-d ones too) or
      a traced value, or whose trace holds an operation that is not elementwise (``iota``, a loop),
      runs the XLA formula (an explicit kernel raises). A ``mask_fn`` of the indices alone has its
      block mask computed once, when the call is traced; on Hopper one that reads ``h`` runs the
      Triton kernels (the Mosaic ones share block ranges across heads).
    score_fn: ``score_fn(score, b, h, q_idx, kv_idx) -> score``: called as ``mask_fn`` is, per pair
      with a float scalar score, returning one float; applied after the soft cap and ALiBi.
      Differentiated with respect to the score (and, on the formula path, to arrays it closes over).
    block_table: a paged key/value cache (FlashAttention's ``flash_attn_with_kvcache`` name): integer
      ``[B, max_pages]`` page ids, with ``key``/``value`` pages ``[num_pages, page_size, K, H]``
      (``value``'s last axis ``Hv``);
      row ``b``'s key ``j`` is ``key[block_table[b, j // page_size], j % page_size]`` (any page
      order, pages may be shared). Needs ``key_value_seq_lengths`` (at most ``max_pages *
      page_size``) and a rank-4 query. Decoding calls read the pages in the kernel
      (kernels/decode); others gather them into contiguous K/V first (fa2_jax/paged.py).

    The order of operations per ``(b, h, i, j)``, ``p = q_offset[b] + i``:
    ``s = scale * q_i . k_j``; ``s = cap * tanh(s / cap)``; ``s -= slope[b, h] * |p - j|``;
    ``s = score_fn(s, b, h, p, j)``; pairs not allowed (causal, window, lengths, segments,
    ``mask_fn``: :mod:`fa2_jax.kernels.masking`) get ``-inf``; ``out_i = softmax(s_i) V``. A row with no
    allowed key gives output 0, lse ``-inf`` and zero gradients, and NaN/inf held by query rows that
    attend no key, or by keys or values no row may attend, never reach the outputs or gradients, except
    on the Mosaic kernels, where such keys and values inside an attended tile reach the outputs
    through the tile products, and such query rows (and their ``dout`` rows) reach dK and dV (keys
    past ``key_value_seq_lengths``, rows past ``query_seq_lengths`` and keys past ``T`` under
    top-left causal excepted: README, Limits).
    Gradients flow to ``query``, ``key``, ``value`` and ``alibi_slopes`` (integer arguments have
    none; ``mask_fn``/``score_fn`` closures: on the formula path). The
    kernel families implement the variants each lists in its ``Backend.features``; with
    ``implementation=None`` any other variant runs on the XLA formula (chunked over query blocks
    for long sequences, so memory stays linear in ``T``), and an explicit family raises a
    ValueError naming the argument (:func:`fa2_jax.backend_for` says which).

  Returns:
    ``out`` with the dtype of ``query`` and its shape with ``H`` replaced by the value's ``Hv``
    (``[B, T, N, Hv]``; and ``lse`` if ``return_residual``).

  Differentiable in reverse mode (``grad``, ``vjp``), once. Forward-mode and second-order derivatives
  raise a TypeError naming the workaround (``implementation="xla"``).
  """
  if block_table is not None:
    check_no_dense(bias, mask)
    return flash_attention_paged(
        query, key, value, block_table, flash_attention, scale=scale, is_causal=is_causal,
        implementation=implementation, return_residual=return_residual, block_sizes=block_sizes,
        deterministic=deterministic, interpret=interpret, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, q_offset=q_offset,
        logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes, mask_fn=mask_fn,
        score_fn=score_fn)
  call = prepare(query, key, value, scale, is_causal, implementation, return_residual, block_sizes,
                  deterministic, interpret, bias, mask, query_seq_lengths=query_seq_lengths,
                  key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size,
                  q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, q_offset=q_offset,
                  logits_soft_cap=logits_soft_cap, alibi_slopes=alibi_slopes, mask_fn=mask_fn,
                  score_fn=score_fn)
  from . import context_parallel  # it imports this module
  if (found := context_parallel.sequence_sharded(call)) is not None:
    # Explicit mesh axes shard the sequence: context parallelism over that axis (fa2_jax.sharding).
    call = dataclasses.replace(call, arrays=call.clipped_arrays())
    out, lse = context_parallel.explicit_call(call, found, implementation, block_sizes)
  elif call.backend == "xla":
    _check_explicit(call, formula=True)  # what JAX's sharding rules would refuse less readably
    out, lse = attention_formula(call.query, call.key, call.value, call.variant,
                                 call.clipped_arrays(), scale=call.scale)
  else:
    _check_interpret_vma(call)
    launch = _launch(call, block_sizes)
    q, k, v, extras, static = launch.q, launch.k, launch.v, launch.extras, launch.static
    fields = static.fields[:len(extras)]

    def local(q, k, v, *extras):
      # On each device's blocks (under Explicit mesh axes) or on the whole call: the block ranges of
      # every kernel, once per call, shared by the forward and the backward.
      extras = launch.with_tables(q, k, extras)
      return _kernels(static)(*match_vma(q, k, v), tuple(extras), static)

    layouts = (sharding.Q, sharding.KV, sharding.V, *(_FIELD_LAYOUTS[f] for f in fields))
    names = (*sharding.QKV_NAMES, *fields)
    try:
      # Per device where Explicit mesh axes shard B or the heads (fa2_jax.sharding).
      out, lse = sharding.local_call(local, (q, k, v, *extras), layouts, names=names,
                                     whole=dict(static.whole))
    except TypeError as e:
      if "forward-mode autodiff" in str(e) or "can't apply forward-mode" in str(e):
        raise TypeError(_FORWARD_MODE) from e
      raise
    if out.shape[1] != launch.t_call:  # padded to the length multiple
      out, lse = out[:, :launch.t_call], lse[:, :launch.t_call]
  if call.squeeze:
    out, lse = out[0], lse[0]
  return (out, lse) if call.return_residual else out


def launched_call(kernel_call: KernelCall) -> KernelCall:
  """The call as the kernels see it: top-left causal with ``T < S`` sliced to ``S = T`` (keys no
  query attends), then T and S padded to the length multiple (``reuse_kernels_across_programs``),
  their true lengths passed as lengths. ``flash_attention`` slices and pads the arrays so."""
  b, t, n, h = kernel_call.q_shape
  _, s, kh, _ = kernel_call.k_shape
  variant = kernel_call.variant
  if kernel_call.is_causal and t < s and not variant.has_q_offset:
    s = t
  if (multiple := kernel_reuse.length_multiple()) is not None:
    t_pad, s_pad = -(-t // multiple) * multiple, -(-s // multiple) * multiple
    if (t_pad, s_pad) != (t, s):
      t, s = t_pad, s_pad
      variant = dataclasses.replace(variant, has_q_lengths=True, has_kv_lengths=True)
  return dataclasses.replace(kernel_call, q_shape=(b, t, n, h), k_shape=(b, s, kh, h),
                             variant=variant)


@dataclasses.dataclass(frozen=True)
class _Launch:
  """A call's operands as its kernels take them (sliced, padded: :func:`launched_call`) and its
  static state."""

  q: object
  k: object
  v: object
  extras: tuple  # the VariantArrays operands, in the order of static.fields
  static: _Static
  tiles: dict  # Backend.range_tiles
  t_call: int  # the call's T before padding
  s_call: int  # the call's S before slicing and padding
  s_kept: int  # the keys kept by the slice, before padding

  def with_tables(self, q, k, extras) -> tuple:
    """``extras`` and the block-range tables of every kernel, computed from them (on one device's
    blocks or on the whole call)."""
    variant = self.static.variant
    if variant is None:
      return tuple(extras)
    arrays = self.static.clipped_arrays(extras, q.shape[1], k.shape[1])
    return tuple(extras) + tuple(range_tables(variant, arrays, self.tiles, batch=q.shape[0],
                                              heads=q.shape[2], seq_q=q.shape[1],
                                              seq_k=k.shape[1]).values())


def _launch(call, block_sizes) -> _Launch:
  """The kernel launch of a validated call on a kernel family (``call.backend != "xla"``)."""
  q, k, v = call.query, call.key, call.value
  family = registry.get(call.backend)
  launched = launched_call(call.kernel_call)  # as the kernels see it (sliced, padded)
  config = family.launch_config(launched, block_sizes)
  # Lengths and offsets clipped by XLA ops, unless the kernel clips them itself.
  variant = call.variant
  arrays = call.arrays if family.clips_ranges(config) else call.clipped_arrays()
  s_call = k.shape[1]
  if call.is_causal and q.shape[1] < k.shape[1] and not variant.has_q_offset:
    # Top-left causal: keys j >= T are never attended. Drop them before the kernels, so values
    # stored there (NaN, inf) cannot reach O or dQ through a masked 0 * NaN inside a matmul; their
    # dK/dV are exact zeros (the slice's transpose pads them).
    t = q.shape[1]
    k, v = k[:, :t], v[:, :t]
    if variant.has_segments:
      arrays = arrays._replace(kv_segment_ids=arrays.kv_segment_ids[:, :t])
    if variant.has_kv_lengths:
      arrays = arrays._replace(kv_lengths=jnp.minimum(arrays.kv_lengths, t))
  t_call, s_kept = q.shape[1], k.shape[1]
  if (multiple := kernel_reuse.length_multiple()) is not None:
    q, k, v, variant, arrays = _pad_lengths(q, k, v, variant, arrays, multiple)
  fields = tuple(f for f in VariantArrays._fields if getattr(arrays, f) is not None)
  extras = tuple(getattr(arrays, f) for f in fields)
  assert (launched.q_shape, launched.k_shape) == (tuple(q.shape), tuple(k.shape))
  variant = None if variant == Variant(is_causal=call.is_causal) else variant
  tiles = family.range_tiles(launched, config)
  tables = tuple(f"table_{name}" for name in tiles) if variant is not None else ()
  whole = _unsplittable(variant, q.shape[0], q.shape[2])
  static = _Static(kernel_scale(call.scale), call.is_causal, family.name, call.deterministic,
                   bool(call.interpret), config, variant=variant, fields=fields + tables,
                   whole=tuple(sorted(whole.items())))
  if variant is not None:  # on the whole call: a shard_map cannot evaluate them while tracing
    warm_static_masks(variant, tiles, batch=q.shape[0], heads=q.shape[2], seq_q=q.shape[1],
                      seq_k=k.shape[1])
  return _Launch(q, k, v, extras, static, tiles, t_call, s_call, s_kept)


def _pad_lengths(q, k, v, variant: Variant, arrays: VariantArrays, multiple: int):
  """T and S padded with zeros up to a multiple of ``multiple``, the true lengths (and any the call
  gave) as ``query_seq_lengths`` / ``key_value_seq_lengths``, segment ids padded alike
  (``fa2_jax.reuse_kernels_across_programs``). Unchanged where both are multiples already."""
  b, t, s = q.shape[0], q.shape[1], k.shape[1]
  t_pad, s_pad = -(-t // multiple) * multiple, -(-s // multiple) * multiple
  if (t_pad, s_pad) == (t, s):
    return q, k, v, variant, arrays
  pad = lambda x, n: jnp.pad(x, ((0, 0), (0, n - x.shape[1])) + ((0, 0),) * (x.ndim - 2))  # noqa: E731
  q_len = jnp.full((b,), t, jnp.int32)
  kv_len = jnp.full((b,), s, jnp.int32)
  if variant.has_q_lengths:
    q_len = jnp.minimum(arrays.q_lengths.astype(jnp.int32), t)
  if variant.has_kv_lengths:
    kv_len = jnp.minimum(arrays.kv_lengths.astype(jnp.int32), s)
  arrays = arrays._replace(q_lengths=q_len, kv_lengths=kv_len)
  if variant.has_segments:
    arrays = arrays._replace(q_segment_ids=pad(arrays.q_segment_ids, t_pad),
                             kv_segment_ids=pad(arrays.kv_segment_ids, s_pad))
  variant = dataclasses.replace(variant, has_q_lengths=True, has_kv_lengths=True)
  return pad(q, t_pad), pad(k, s_pad), pad(v, s_pad), variant, arrays


# flash_attention's attention-variant keywords (backend_for passes them on as **variant_args)
_VARIANT_ARGUMENTS = frozenset(inspect.signature(check_variant).parameters) - {"query", "key",
                                                                             "is_causal"}


def backend_for(query, key, value=None, bias=None, mask=None, *, is_causal=False,
                implementation=None, block_sizes=None, deterministic=False, interpret=None,
                scale=None, return_residual=False, block_table=None,
                **variant_args) -> dispatch.Dispatch:
  """Which kernels :func:`flash_attention` would run for these arguments, and why.

  Takes the same arguments (arrays or ``jax.ShapeDtypeStruct``; ``value`` defaults to ``key``'s shape)
  and raises the same errors; runs nothing. ``print(fa2_jax.backend_for(q, k))`` gives one line, e.g.
  ``sm90 (sm90 forward, sm90 dK/dV, sm90 dQ): Hopper GPU and a supported call``.
  ``variant_args``: the attention-variant arguments of :func:`flash_attention`
  (``query_seq_lengths`` ... ``score_fn``; arrays or ``jax.ShapeDtypeStruct``). ``return_residual``
  is checked and does not change the choice.
  """
  value = key if value is None else value
  unknown = sorted(set(variant_args) - _VARIANT_ARGUMENTS)
  if unknown:
    raise TypeError(f"backend_for() got unexpected keyword arguments {unknown} (flash_attention "
                    f"takes none of them)")
  if block_table is not None:
    check_no_dense(bias, mask)
    return backend_for_paged(query, key, value, block_table, scale=scale, is_causal=is_causal,
                             implementation=implementation, return_residual=return_residual,
                             block_sizes=block_sizes, deterministic=deterministic,
                             interpret=interpret, **variant_args)
  call = prepare(query, key, value, scale, is_causal, implementation, return_residual, block_sizes,
                  deterministic, interpret, bias, mask, **variant_args)
  kernel_call = None if call.kernel_call is None else launched_call(call.kernel_call)
  chosen = dispatch.describe(call.backend, kernel_call, implementation=implementation,
                             config=block_sizes, formula_reason=call.formula_reason)
  from . import context_parallel  # it imports this module
  if (found := context_parallel.sequence_sharded(call)) is not None:
    strategy, why, layout = context_parallel.explicit_strategy(call, found)
    axis = found[2].context[0]
    chunks = ("contiguous chunks" if layout == "contiguous" else
              "the chunks relaid out in zigzag order and back (causal load balance)")
    chosen = dataclasses.replace(chosen, reason=(
        f"the sequence is sharded over Explicit mesh axis {axis!r}: context parallelism, strategy "
        f"{strategy!r} ({why}), {chunks}; the kernels as chosen for the whole call: "
        f"{chosen.reason}"))
  else:  # the Explicit-sharding rules flash_attention applies
    _check_explicit(call, formula=call.backend == "xla")
  return chosen


def _check_interpret_vma(call) -> None:
  """The ValueError of kernels in Pallas interpret mode on inputs that vary over manual mesh axes
  (inside ``jax.shard_map`` with its ``check_vma=True`` default), which the interpreter is not typed
  for (JAX would fail inside it, asking for an issue to be filed)."""
  if not call.interpret or call.backend == "xla":
    return
  axes = sorted(set().union(*(varying_axes(x) for x in (call.query, call.key, call.value))))
  if axes:
    raise ValueError(
        f"interpret=True runs the kernels in Pallas interpret mode, which is not typed for values "
        f"that vary over manual mesh axes ({', '.join(map(repr, axes))}: inside jax.shard_map with "
        "check_vma=True, its default): pass check_vma=False to jax.shard_map (the compiled kernels "
        "need no such flag), or run the XLA formula (implementation='xla', or interpret left "
        "out on CPU)")


def _check_explicit(call, formula: bool) -> None:
  """The ValueError of Explicit mesh axes that shard q, k, v in a way the call cannot keep (a call
  whose sequence is not sharded): the kernels' rules (:func:`sharding.local_call`); the formula
  shares those on the batch and the heads (GQA groups split over devices fail inside JAX), but not
  the head dims, which it contracts across devices, nor the batch or heads a ``mask_fn``/``score_fn``
  reads (it evaluates those globally)."""
  q = call.query
  whole = {"t": "this call runs on whole sequences"}
  if not formula:
    whole.update(_unsplittable(call.variant, q.shape[0], q.shape[2]))
  found = sharding.explicit_plan((q, call.key, call.value), whole=whole,
                                 whole_head_dims=not formula)
  if found is not None and found[2].problems:
    raise sharding.refusal(found[2].problems)


# --- custom_vjp core ------------------------------------------------------------------------------
# The kernels index with int32 (program ids are int32): tracing them with x64 on would mix int64
# constants into their index arithmetic, so every kernel is traced with x64 off and its f32 outputs
# keep their dtypes.

@functools.partial(jax.custom_jvp, nondiff_argnums=(4,))
def _forward(q, k, v, extras, st: _Static):
  # A custom_jvp only to name the limit: the custom_vjp below never differentiates this function in
  # first-order reverse mode; a second-order derivative would (through the Pallas call, which has no
  # derivative rule and fails with a bare AssertionError).
  with jax.enable_x64(False):
    return registry.get(st.backend).forward(
        q, k, v, scale=st.scale, is_causal=st.is_causal, config=st.config, variant=st.variant,
        arrays=st.arrays(extras), table=st.tables(extras).get("fwd"), interpret=st.interpret)


@_forward.defjvp
def _forward_jvp(st, primals, tangents):
  del st, primals, tangents
  raise TypeError(_SECOND_ORDER)


def _layouts(st: _Static, extras) -> tuple[str, ...]:
  return tuple(map(_layout, st.fields, extras))


def _unsplittable(variant: Variant | None, batch: int, heads: int) -> dict[str, str]:
  """The axes (``"b"``: B, ``"n"``: the heads) that a call's kernels cannot split over devices, with
  the reason for fa2_jax.sharding: those its ``mask_fn``/``score_fn`` reads, whose index the kernels
  take from their grid (a device's own rows or heads, counted from 0)."""
  what = {"b": ("b", "batch index b", "B"), "h": ("n", "head index h", "the heads")}
  out = {}
  if batch == 1 and heads == 1:
    return out
  for index in sorted(index_reads(variant)):
    axis, name, shard = what[index]
    out[axis] = (f"mask_fn/score_fn reads the {name}, which the kernels on one device's share "
                 f"would count from 0: shard {shard} only for functions that ignore it, or use "
                 "implementation='xla'")
  return out


def _partitionable(st: _Static) -> bool:
  """Whether the call may go through custom_partitioning (``Backend.partitionable``)."""
  return registry.get(st.backend).partitionable()


def _foldable(st: _Static) -> bool:
  """Whether a vmapped call may fold its mapped axis into B (fa2_jax.sharding.partitioned): not where
  a ``mask_fn``/``score_fn`` reads the batch index, which folding would change."""
  return "b" not in index_reads(st.variant)


def _lse(st: _Static, stats, extras, kv_extent: int):
  """flash_attention's ``lse [B, T, N]`` from the kernels' row statistics ``[B, N, 2, T]`` (with
  ALiBi, the kernels' row shift added back: ``masking.alibi_lse_shift``; ``kv_extent`` the kernels'
  S)."""
  modifies = st.variant is not None and st.variant.modifies_scores
  lse = jnp.swapaxes(lse_from_stats(stats, st.scale, modifies), 1, 2)
  shift = None if st.variant is None else alibi_lse_shift(
      st.variant, st.clipped_arrays(extras, lse.shape[1], kv_extent), lse.shape[1], kv_extent)
  return lse if shift is None else remove_alibi_shift(lse, shift)


def _context(st: _Static, backward: bool = False) -> sharding.Context:
  """How the kernel call runs where Auto mesh axes shard its sequence (fa2_jax.sharding.Context):
  context parallelism on each device's chunks (fa2_jax.context_parallel), reading q, k, v (the
  backward: and out, stats, dout, dlse) and the variant arrays, not the whole call's range tables.
  With ALiBi the forward's stats carry the kernels' row shift and a backward with ``st.slope_grad``
  returns the kernels' per-row slope sums (``partitioned_forward``, ``partitioned_backward``)."""
  from . import context_parallel  # it imports this module
  refusal = None
  if st.backend == "decode":
    refusal = "a decoding call (a few query rows) runs on whole sequences"
  fn = context_parallel.partitioned_backward if backward else context_parallel.partitioned_forward
  reads = (7 if backward else 3) + sum(not f.startswith("table_") for f in st.fields)
  return sharding.Context(functools.partial(fn, st), reads, refusal)


def _flash_impl(q, k, v, extras, st: _Static):
  out, stats = sharding.forward(_forward, q, k, v, st, extras, _layouts(st, extras),
                                partition=_partitionable(st), whole=dict(st.whole),
                                fold_vmap=_foldable(st), context=_context(st))
  return out, _lse(st, stats, extras, k.shape[1])


# Two custom_vjps of the same kernels: _flash for calls without ALiBi; _flash_slopes, with
# symbolic_zeros, for calls with it, whose fwd must know whether the slopes are differentiated
# (CustomVJPPrimal.perturbed), under a jit of its own (an eager shard_map, Explicit mesh axes,
# refuses a symbolic_zeros custom_vjp; under a jit it is traced as usual).
_flash = jax.custom_vjp(_flash_impl, nondiff_argnums=(4,))
_flash_slopes = jax.custom_vjp(_flash_impl, nondiff_argnums=(4,))
_flash_slopes_jit = jax.jit(_flash_slopes, static_argnums=(4,))


def _kernels(st: _Static):
  """The custom_vjp call of a call's kernels (see ``_flash_slopes``)."""
  if st.variant is not None and st.variant.has_alibi:
    return _flash_slopes_jit
  return _flash


def _slopes_refused(backend: str) -> str:
  return (f"fa2_jax: the {backend} kernels do not differentiate alibi_slopes, and a gradient with "
          "respect to them is requested here; pass jax.lax.stop_gradient(alibi_slopes) for fixed "
          "slopes, or implementation='triton' or 'xla', which differentiate them")


def _flash_fwd(q, k, v, extras, st: _Static):
  # _flash_slopes (symbolic_zeros): each primal comes as a CustomVJPPrimal, .perturbed telling
  # whether it has a tangent (the ALiBi slopes: whether their gradient is wanted); _flash: arrays
  slopes = st.fields.index("alibi_slopes") if "alibi_slopes" in st.fields else None
  slope_grad = slopes is not None and getattr(extras[slopes], "perturbed", False)
  if slope_grad and not registry.get(st.backend).differentiates_slopes(st.config):
    raise TypeError(_slopes_refused(st.backend))
  q, k, v = (getattr(x, "value", x) for x in (q, k, v))
  extras = tuple(getattr(x, "value", x) for x in extras)
  out, stats = sharding.forward(_forward, q, k, v, st, extras, _layouts(st, extras),
                                partition=_partitionable(st), whole=dict(st.whole),
                                fold_vmap=_foldable(st), context=_context(st))
  # slope_grad, static, as the residuals' structure: () or (None,)
  return (out, _lse(st, stats, extras, k.shape[1])), (q, k, v, extras, out, stats,
                                                      (None,) if slope_grad else ())


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _backward(st: _Static, q, k, v, out, stats, dout, dlse, *extras):
  backend = registry.get(st.backend)
  kw = dict(dlse=dlse, scale=st.scale, is_causal=st.is_causal, deterministic=st.deterministic,
            config=st.config, variant=st.variant,
            arrays=st.clipped_arrays(extras, q.shape[1], k.shape[1]),
            tables=st.tables(extras), interpret=st.interpret, slope_grad=st.slope_grad)
  acc = extras[st.fields.index(DQ_ACCUMULATOR)] if DQ_ACCUMULATOR in st.fields else None
  with jax.enable_x64(False):
    if acc is not None and backend.accumulates_dq():
      return backend.backward(q, k, v, out, stats, dout, dq_accumulator=acc, **kw)
    grads = backend.backward(q, k, v, out, stats, dout, **kw)
    if acc is None:
      return grads
    return (accumulate_dq(acc, grads[0], st.scale), *grads[1:])


@_backward.defjvp
def _backward_jvp(st, primals, tangents):
  del st, primals, tangents
  raise TypeError(_SECOND_ORDER)


def _flash_bwd(st: _Static, residuals, cotangents):
  q, k, v, extras, out, stats, slope_grad = residuals
  dout, dlse_public = (jnp.zeros(c.shape, c.dtype) if isinstance(c, SymbolicZero) else c
                       for c in cotangents)
  # d lse_i / d S_ij = P_ij, so a cotangent on lse enters dS = P ∘ (dP − D + dlse): fold it into D.
  dlse = jnp.swapaxes(dlse_public, 1, 2).astype(jnp.float32)  # [B, N, T]
  if slope_grad:  # the Triton backward adds up the slopes' gradient through the scores
    st = dataclasses.replace(st, slope_grad=True)
  grads = sharding.backward(_backward, st, q, k, v, out, stats, dout.astype(q.dtype), dlse,
                            extras, _layouts(st, extras), partition=_partitionable(st),
                            whole=dict(st.whole), fold_vmap=_foldable(st),
                            extra_outputs=(sharding.LSE,) if slope_grad else (),
                            context=_context(st, backward=True))
  # The step's kernels are traced (the forward's before this): its compile then finds them compiled
  # by the background threads that started at their exports, while the rest was traced.
  kernel_reuse.wait_for_compiles()
  # The variant operands (lengths, segment ids, offsets: integers) get zero cotangents; the ALiBi
  # slopes, where perturbed, theirs: through the scores (the kernel's row sums) and through the
  # lse's shift back (masking.alibi_lse_shift).
  cts = [None for _ in extras]
  if slope_grad:
    i = st.fields.index("alibi_slopes")
    shift = lambda sl: _lse(st, stats, extras[:i] + (sl,) + extras[i + 1:], k.shape[1])  # noqa: E731
    d_shift, = jax.vjp(shift, extras[i])[1](dlse_public.astype(jnp.float32))
    cts[i] = grads[3].sum(-1) + d_shift
  return (*grads[:3], tuple(cts))


_flash.defvjp(_flash_fwd, _flash_bwd)
_flash_slopes.defvjp(_flash_fwd, _flash_bwd, symbolic_zeros=True)


def attention_backward(query, key, value, out, lse, dout, dlse=None, *, scale=None, is_causal=False,
                       implementation=None, block_sizes=None, deterministic=False, interpret=None,
                       **variant_args):
  """``(dq, dk, dv)`` of one block of keys of a softmax that spans more keys than this call's.

  The FlashAttention-2 backward of ``query`` over ``key``/``value`` with the rows' statistics of the
  whole softmax: ``out [B, T, N, Hv]`` and ``lse [B, T, N]`` (float32, natural log) are each row's
  output and logsumexp over ALL its keys, ``dout`` and ``dlse`` (None: zero) their cotangents, so
  ``P = exp(S - lse)`` and ``D = rowsum(dout * out)``; summed over the key blocks, ``dq`` and each
  block's ``dk``/``dv`` are the whole softmax's gradients (the ring of
  :mod:`fa2_jax.context_parallel`). ``lse`` is converted to the kernels' row statistics
  (``kernels.softmax.stats_from_lse``, which states its rounding). Rank-4 arrays; the other
  arguments as :func:`flash_attention`'s. Runs the kernel families only: a call that
  :func:`flash_attention` would run on the XLA formula raises a ValueError. ``alibi_slopes`` are
  applied, not differentiated. ``dq`` in ``query``'s dtype, ``dk``/``dv`` in ``key``'s.
  """
  return _attention_backward(query, key, value, out, lse, dout, dlse, scale=scale,
                             is_causal=is_causal, implementation=implementation,
                             block_sizes=block_sizes, deterministic=deterministic,
                             interpret=interpret, **variant_args)


def _attention_backward(query, key, value, out, lse, dout, dlse=None, *, scale=None,
                        is_causal=False, implementation=None, block_sizes=None, deterministic=False,
                        interpret=None, slope_rows=False, dq_accumulator=None, **variant_args):
  """:func:`attention_backward`; with ``slope_rows`` (a call with ``alibi_slopes`` on kernels that
  differentiate them) it returns ``(dq, dk, dv, rows, near)``: ``rows [B, T, N]`` float32, per
  query row the kernels' sum over this call's keys of ``dS * d s / d slope`` in their frame (the
  distances from each row's nearest key of this call), and ``near [B, T, N]`` float32, each row's
  distance to that key (``masking.alibi_row_shift``; None where the kernels shift nothing), so that
  a row's gradient with respect to its slope over these keys is ``rows - near * rowsum(dS)``.
  ``dq_accumulator`` (float32, ``query``'s shape): returned in place of ``dq`` with this call's
  ``dq / scale`` added (``scale`` the call's, resolved), a ring's running dQ over its steps; the
  fused dQ kernel adds into it directly (``Backend.accumulates_dq``), so a step costs no
  zero-filled accumulator, no rounding pass and no add."""
  call = prepare(query, key, value, scale, is_causal, implementation, False, block_sizes,
                 deterministic, interpret, **variant_args)
  if call.squeeze:
    raise ValueError(f"attention_backward takes rank-4 arrays, got query {tuple(query.shape)}")
  if call.backend == "xla":
    raise ValueError("attention_backward runs the kernel families; this call runs on the XLA "
                     "formula (differentiate flash_attention instead)")
  launch = _launch(call, block_sizes)
  st, q, k, v = launch.static, launch.q, launch.k, launch.v
  pad = q.shape[1] - launch.t_call  # rows padded to the length multiple
  rows = lambda x, fill: jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2),  # noqa: E731
                                  constant_values=fill)
  out, dout = rows(out.astype(q.dtype), 0), rows(dout.astype(q.dtype), 0)
  lse = rows(lse.astype(jnp.float32), -jnp.inf)
  dlse = jnp.zeros(lse.shape, jnp.float32) if dlse is None else rows(dlse.astype(jnp.float32), 0)
  extras = launch.with_tables(q, k, launch.extras)
  if dq_accumulator is not None:
    if slope_rows or tuple(dq_accumulator.shape) != tuple(query.shape):
      raise ValueError(f"dq_accumulator must have query's shape {tuple(query.shape)} (and no "
                       f"slope_rows), got {tuple(dq_accumulator.shape)}")
    extras = (*extras, rows(dq_accumulator.astype(jnp.float32), 0))
    st = dataclasses.replace(st, fields=(*st.fields, DQ_ACCUMULATOR))
  shift = None
  if st.variant is not None and (shift := alibi_lse_shift(
      st.variant, st.clipped_arrays(extras, q.shape[1], k.shape[1]), q.shape[1],
      k.shape[1])) is not None:
    lse = jnp.where(lse == -jnp.inf, lse, lse + shift)  # the kernels' frame (_lse removes it)
  modifies = st.variant is not None and st.variant.modifies_scores
  stats = stats_from_lse(jnp.swapaxes(lse, 1, 2), st.scale, modifies)
  slope_rows = bool(slope_rows)
  if slope_rows:
    if st.variant is None or not st.variant.has_alibi:
      raise ValueError("slope_rows needs a call with alibi_slopes")
    if not registry.get(st.backend).differentiates_slopes(st.config):
      raise TypeError(_slopes_refused(st.backend))
    st = dataclasses.replace(st, slope_grad=True)
  grads = sharding.backward(_backward, st, q, k, v, out, stats, dout, jnp.swapaxes(dlse, 1, 2),
                            extras, _layouts(st, extras), partition=_partitionable(st),
                            whole=dict(st.whole), fold_vmap=_foldable(st),
                            extra_outputs=(sharding.LSE,) if slope_rows else ())
  dq, dk, dv = grads[:3]
  dq = dq[:, :launch.t_call]
  keys = ((0, 0), (0, launch.s_call - launch.s_kept), (0, 0), (0, 0))  # keys sliced off: zeros
  dk, dv = (jnp.pad(x[:, :launch.s_kept], keys) for x in (dk, dv))
  if not slope_rows:
    return dq, dk.astype(key.dtype), dv.astype(value.dtype)
  rows = jnp.swapaxes(grads[3], 1, 2)[:, :launch.t_call]  # [B, N, T] -> [B, T, N]
  near = None
  if shift is not None:  # the shift of unit slopes: the distances
    arrays = st.clipped_arrays(extras, q.shape[1], k.shape[1])
    unit = arrays._replace(alibi_slopes=jnp.ones_like(arrays.alibi_slopes))
    near = alibi_lse_shift(st.variant, unit, q.shape[1], k.shape[1])[:, :launch.t_call]
  return dq, dk.astype(key.dtype), dv.astype(value.dtype), rows, near
