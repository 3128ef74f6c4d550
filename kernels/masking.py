"""Which (query, key) pairs may attend and how their scores are modified: the one definition shared by
every kernel and the reference formula.

Everything here is plain ``jnp`` on broadcastable int32 index arrays, with no Python control flow on
traced values, so the same functions run on a kernel's tile (``q_idx`` of shape ``[block_q, 1]``,
``kv_idx`` of shape ``[1, block_k]``, per-row / per-column vectors for lengths and segment ids, scalar
batch and head indices) and on the reference's whole ``[B, N, T, S]`` arrays. Because both use these
functions they cannot disagree about the mask.

Positions. Query row ``i`` (``0 <= i < T``) of batch element ``b`` sits at the *absolute* position
``p = q_offset[b] + i`` (``q_offset = 0`` by default: top-left alignment, as
``jax.nn.dot_product_attention``); key ``j`` (``0 <= j < S``) sits at position ``j``. ``q_idx`` below
always means ``p``, ``kv_idx`` means ``j``.

The rule (:func:`allowed_pairs`): the pair ``(b, h, i, j)`` is allowed when every active term holds:

* causal: ``j <= p``;
* window ``(left, right)``: ``p - left <= j <= p + right`` (a side ``None`` is unbounded; with causal
  the right side is ``min(right, 0)``);
* query lengths: ``i < q_len[b]`` (rows past it are padding: no key at all);
* key/value lengths: ``j < kv_len[b]``;
* segments: ``q_seg[b, i] == kv_seg[b, j]``;
* ``mask_fn(b, h, p, j)`` is True;
* (kernels only) ``j < seq_k``: the padded tail of the last key tile.

Scores (:func:`modify_scores`), per pair, in this order: ``s = scale * q_i . k_j``;
``s = cap * tanh(s / cap)`` (soft cap); ``s = s - slope[b, h] * |p - j|`` (ALiBi);
``s = score_fn(s, b, h, p, j)``; then disallowed pairs become ``-inf``. A row with no allowed key has
output 0, lse ``-inf`` and zero gradients.

Block ranges, derived from this rule, are in :mod:`fa2_jax.kernels.block_ranges`: which tiles a kernel can skip
(no allowed pair) and which need no mask (every pair allowed).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

# Bound on |window side|, |q_offset| and sequence lengths: with each below 2**30, j - p and p - left
# stay inside int32; p + right can pass 2**31, so the rule compares j - p with the sides and the block
# ranges add a side through a clip (block_ranges._clip_add).
INT32_SAFE = 1 << 30


@dataclasses.dataclass(frozen=True)
class Variant:
  """The static part of an attention variant (hashable: a kernel's static argument).

  Attributes:
    is_causal: ``j <= p``.
    window: ``(left, right)`` (each an int >= 0 or None for unbounded) or None for no window.
    has_q_lengths: the call has ``query_seq_lengths`` (``VariantArrays.q_lengths``).
    has_kv_lengths: the call has ``key_value_seq_lengths`` (``VariantArrays.kv_lengths``).
    has_segments: the call has ``q_segment_ids`` and ``kv_segment_ids``.
    has_q_offset: the call has ``q_offset`` (``VariantArrays.q_offset``); otherwise positions start at 0.
    soft_cap: the ``logits_soft_cap`` (a float > 0) or None.
    has_alibi: the call has ``alibi_slopes`` (``VariantArrays.alibi_slopes``).
    mask_fn: ``mask_fn(b, h, q_idx, kv_idx) -> bool`` or None.
    score_fn: ``score_fn(score, b, h, q_idx, kv_idx) -> score`` or None.
    functions: what ``mask_fn`` and ``score_fn`` compute (:func:`functions_fingerprint`, set by the
      public API), so that the same function objects with a changed closure or global are another
      variant to every cache keyed by it (jitted kernels, block masks).
  """

  is_causal: bool = False
  window: tuple[int | None, int | None] | None = None
  has_q_lengths: bool = False
  has_kv_lengths: bool = False
  has_segments: bool = False
  has_q_offset: bool = False
  soft_cap: float | None = None
  has_alibi: bool = False
  mask_fn: Callable | None = None
  score_fn: Callable | None = None
  functions: str | None = None

  @classmethod
  def dense(cls) -> "Variant":
    """Plain attention: every pair allowed, scores unmodified."""
    return cls()

  @property
  def is_dense(self) -> bool:
    """True for plain attention (not even causal)."""
    return self == Variant()

  @property
  def static_ranges(self) -> bool:
    """True when the block ranges of :mod:`fa2_jax.kernels.block_ranges` follow from the static part alone,
    the same for every batch element and head (causal, window; a soft cap, ALiBi and ``score_fn``
    change no range): no lengths, segments, offset or ``mask_fn``."""
    return not (self.has_q_lengths or self.has_kv_lengths or self.has_segments
                or self.has_q_offset or self.mask_fn is not None)

  @property
  def needs_mask(self) -> bool:
    """True when some pair may be disallowed (:func:`allowed_pairs` returns an array)."""
    return (self.is_causal or self.window is not None or self.has_q_lengths or self.has_kv_lengths
            or self.has_segments or self.mask_fn is not None)

  @property
  def modifies_scores(self) -> bool:
    """True when :func:`modify_scores` changes the scaled logits."""
    return self.soft_cap is not None or self.has_alibi or self.score_fn is not None

  @property
  def bounds(self) -> tuple[int | None, int | None]:
    """``(left, right)``: keys ``p - left <= j <= p + right`` may attend, None for unbounded; the
    causal rule is folded in (``right = min(right, 0)``)."""
    left, right = self.window if self.window is not None else (None, None)
    if self.is_causal:
      right = 0 if right is None else min(right, 0)
    return left, right

  @property
  def features(self) -> tuple[str, ...]:
    """The public arguments this variant uses beyond ``is_causal`` (what a backend must implement)."""
    names = []
    if self.has_q_lengths:
      names.append("query_seq_lengths")
    if self.has_kv_lengths:
      names.append("key_value_seq_lengths")
    if self.window is not None:
      names.append("local_window_size")
    if self.has_segments:
      names.append("q_segment_ids/kv_segment_ids")
    if self.has_q_offset:
      names.append("q_offset")
    if self.soft_cap is not None:
      names.append("logits_soft_cap")
    if self.has_alibi:
      names.append("alibi_slopes")
    if self.mask_fn is not None:
      names.append("mask_fn")
    if self.score_fn is not None:
      names.append("score_fn")
    return tuple(names)


@functools.lru_cache(maxsize=64)  # dispatch asks several times per call; the key holds .functions
def closes_over_arrays(variant: Variant) -> str | None:
  """The name of ``mask_fn`` or ``score_fn`` when it closes over a JAX array (of any rank, a 0-d
  ``jnp.float32(x)`` too), a non-scalar numpy array or a traced value: a kernel cannot capture those
  (it must get them as operands). Python and numpy scalars are inlined as literals and are fine.
  Else None. Traced abstractly once on scalar int32 indices: what the function captures is what its
  jaxpr keeps as constants."""
  i32 = jax.ShapeDtypeStruct((), jnp.int32)
  for name, fn, args in (("mask_fn", variant.mask_fn, (i32,) * 4),
                         ("score_fn", variant.score_fn, (jax.ShapeDtypeStruct((), jnp.float32),
                                                         *(i32,) * 4))):
    if fn is None:
      continue
    if _trace(fn, args).consts:
      return name
  return None


def functions_fingerprint(mask_fn, score_fn) -> str | None:
  """What ``mask_fn`` and ``score_fn`` compute, as the text of their jaxprs on scalar indices (and a
  float32 score): the Python scalars they read, closed over or global, appear there as literals, so
  functions whose closure or globals changed get a new fingerprint (a cache keyed by the function
  objects alone would not see the change). None when neither is given."""
  if mask_fn is None and score_fn is None:
    return None
  i32, f32 = jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((), jnp.float32)
  return "\n".join(str(_trace(fn, args)) if fn is not None else "-"
                   for fn, args in ((mask_fn, (i32,) * 4), (score_fn, (f32, *(i32,) * 4))))


def _trace(fn, args):
  """``fn``'s closed jaxpr on ``args``, traced now: through a fresh wrapper, since ``make_jaxpr``
  keeps the trace of a function object it has seen (with the globals of that time baked in)."""
  return jax.make_jaxpr(lambda *a: fn(*a))(*args)


class VariantArrays(NamedTuple):
  """The array part of a variant (a pytree), normalised by the public API; None where unused.

  Attributes:
    q_lengths: ``[B]`` int32, valid query rows per batch element.
    kv_lengths: ``[B]`` int32, valid keys per batch element.
    q_segment_ids: ``[B, T]`` int32.
    kv_segment_ids: ``[B, S]`` int32.
    q_offset: ``[B]`` int32, absolute position of query row 0.
    alibi_slopes: ``[B, N]`` float32 (not differentiated).
  """

  q_lengths: jax.Array | None = None
  kv_lengths: jax.Array | None = None
  q_segment_ids: jax.Array | None = None
  kv_segment_ids: jax.Array | None = None
  q_offset: jax.Array | None = None
  alibi_slopes: jax.Array | None = None


# --- the elementwise rule -------------------------------------------------------------------------

def allowed_pairs(variant: Variant, b, h, q_idx, kv_idx, *, q_len=None, kv_len=None, q_seg=None,
                  kv_seg=None, q_offset=None, seq_k=None):
  """Boolean mask, True where the pair may attend (the rule of the module docstring).

  Args:
    variant: the static :class:`Variant`.
    b, h: batch and query-head indices, int32 scalars or arrays broadcastable against the others
      (only ``mask_fn`` reads them).
    q_idx: int32 absolute query positions ``p = q_offset + i`` (e.g. ``[block_q, 1]``).
    kv_idx: int32 key indices ``j`` (e.g. ``[1, block_k]``).
    q_len, kv_len: the batch element's lengths (scalars or broadcastable), needed when
      ``variant.has_q_lengths`` / ``has_kv_lengths``.
    q_seg, kv_seg: segment ids of the rows (e.g. ``[block_q, 1]``) and keys (``[1, block_k]``), needed
      when ``variant.has_segments``.
    q_offset: the batch element's offset, needed for the query-length term when
      ``variant.has_q_offset`` (the row index is ``q_idx - q_offset``).
    seq_k: when given, keys at ``kv_idx >= seq_k`` (a tile's padded tail) are masked out.

  Returns:
    A bool array of the broadcast shape of the index arrays (and of ``mask_fn``'s result), or None
    when nothing is masked.
  """
  terms = []
  left, right = variant.bounds
  # The window as bounds on j - p (|j - p| < 2**31 for any valid inputs), not on p +- a side, which
  # overflows int32 once the offset and a side are both near 2**30; causal (0) is a plain compare.
  j_minus_p = None if (left in (None, 0) and right in (None, 0)) else kv_idx - q_idx
  if right is not None:
    terms.append(kv_idx <= q_idx if right == 0 else j_minus_p <= right)
  if left is not None:
    terms.append(kv_idx >= q_idx if left == 0 else j_minus_p >= -left)
  if variant.has_q_lengths:
    if q_len is None:
      raise ValueError("allowed_pairs: the variant has query lengths; pass q_len")
    if variant.has_q_offset and q_offset is None:
      raise ValueError("allowed_pairs: the variant has query lengths and q_offset; pass q_offset")
    row = q_idx - q_offset if variant.has_q_offset else q_idx
    terms.append(row < q_len)
  if variant.has_kv_lengths:
    if kv_len is None:
      raise ValueError("allowed_pairs: the variant has key/value lengths; pass kv_len")
    terms.append(kv_idx < kv_len)
  if variant.has_segments:
    if q_seg is None or kv_seg is None:
      raise ValueError("allowed_pairs: the variant has segment ids; pass q_seg and kv_seg")
    terms.append(q_seg == kv_seg)
  if variant.mask_fn is not None:
    terms.append(jnp.asarray(variant.mask_fn(b, h, q_idx, kv_idx), jnp.bool_))
  if seq_k is not None:
    terms.append(kv_idx < seq_k)
  if not terms:
    return None
  mask = functools.reduce(jnp.logical_and, terms)
  shape = jnp.broadcast_shapes(jnp.shape(mask), jnp.shape(q_idx), jnp.shape(kv_idx))
  return jnp.broadcast_to(mask, shape)


def allowed(*args, is_causal: bool | None = None, seq_k=None, **kwargs):
  """The mask, in two call forms (one rule, :func:`allowed_pairs`):

  * ``allowed(variant, b, h, q_idx, kv_idx, *, q_len, kv_len, q_seg, kv_seg, q_offset, seq_k)``: the
    general form, the same as :func:`allowed_pairs`.
  * ``allowed(q_pos, k_pos, *, is_causal, seq_k=None)``: the causal-only form the causal kernels call,
    ``allowed_pairs(Variant(is_causal=is_causal), None, None, q_pos, k_pos, seq_k=seq_k)``.

  Returns:
    A boolean array of the broadcast shape, or ``None`` when nothing is masked.
  """
  if args and isinstance(args[0], Variant):
    if is_causal is not None:
      raise TypeError("allowed(variant, ...): is_causal is part of the Variant")
    return allowed_pairs(*args, seq_k=seq_k, **kwargs)
  if len(args) != 2 or is_causal is None or kwargs:
    raise TypeError("allowed takes (variant, b, h, q_idx, kv_idx, **arrays) or "
                    "(q_pos, k_pos, *, is_causal, seq_k=None)")
  q_pos, k_pos = args
  return allowed_pairs(Variant(is_causal=bool(is_causal)), None, None, q_pos, k_pos, seq_k=seq_k)


# --- scores ---------------------------------------------------------------------------------------

def alibi_nearest_key(q_idx, kv_extent: int):
  """The key position of ``[0, kv_extent)`` nearest to query position ``q_idx``: ``clip(p, 0, S - 1)``
  (int32). The kernels and the formula take a row's ALiBi distances from it, ``|clip(p) - j|``, which
  for every key ``j`` of ``[0, S)`` is ``|p - j|`` less the row's :func:`alibi_row_shift`, so that
  the bias ``slope * |p - j|`` stays as small as the row's keys are near, whatever ``q_offset`` is
  (the softmax is unchanged; the lse gets ``slope`` times the shift back, :func:`alibi_lse_shift`).
  Without it a row whose keys all lie ``d`` positions away carried a rounding of
  ``slope * d * 2^-24`` in every logit."""
  return jnp.clip(jnp.asarray(q_idx, jnp.int32), 0, kv_extent - 1)


def alibi_row_shift(q_idx, kv_extent: int):
  """The distance from query position ``q_idx`` to its :func:`alibi_nearest_key` (int32, exact)."""
  return jnp.abs(jnp.asarray(q_idx, jnp.int32) - alibi_nearest_key(q_idx, kv_extent))


def shifts_alibi(variant: Variant) -> bool:
  """True when the ALiBi distances of ``variant`` are taken relative to each row's nearest key
  (:func:`alibi_row_shift`): ALiBi without a ``score_fn``, which would see the shifted logits."""
  return variant.has_alibi and variant.score_fn is None


def alibi_lse_shift(variant: Variant, arrays: "VariantArrays", t: int, kv_extent: int,
                    dtype=jnp.float32):
  """``[B, T, N]`` (``dtype``) to subtract from an lse whose logits had the shifted ALiBi bias of
  keys ``[0, kv_extent)`` (``slope * alibi_row_shift(p)`` per row), or None when nothing was
  shifted. The slopes are constants of the call: no gradient flows to them."""
  if not shifts_alibi(variant):
    return None
  rows = jnp.arange(t, dtype=jnp.int32)[None, :]  # [1, T]
  p = rows + arrays.q_offset[:, None] if variant.has_q_offset else rows  # [B or 1, T]
  near = alibi_row_shift(p, kv_extent).astype(dtype)
  slopes = jax.lax.stop_gradient(arrays.alibi_slopes).astype(dtype)
  return slopes[:, None, :] * near[:, :, None]


def remove_alibi_shift(lse, shift):
  """``lse - shift`` (``shift`` from :func:`alibi_lse_shift`) where a row has a key; a row with none keeps lse ``-inf``, also where ``slope * distance`` overflows to ``-inf``
  (slopes near the bound at offsets near 2^30), which would give ``-inf - (-inf) = NaN``."""
  return jnp.where(lse == -jnp.inf, lse, lse - shift)


def _modify(variant: Variant, s, b, h, q_idx, kv_idx, slope, with_derivative: bool,
            in_scale=1.0, out_scale=1.0, kv_extent: int | None = None):
  """``(out_scale * modify_scores(in_scale * s), d s_out / d s_in)``. Without a ``score_fn`` the two
  scales fold into the soft cap's and ALiBi's constants: a kernel's softmax scale (``in_scale``) and
  base-2 conversion (``out_scale = log2 e``) then cost no multiply per score beyond the cap's own."""
  deriv = None
  fold = variant.score_fn is None
  if not fold:
    s = s * in_scale
    in_scale = 1.0
  if variant.soft_cap is not None:
    # cap * tanh(x / cap) with x = in_scale * s: one multiply into tanh, one out (times out_scale
    # when folding)
    into, out = soft_cap_factors(variant.soft_cap, in_scale, out_scale if fold else 1.0, s.dtype)
    t, deriv = soft_cap_tanh(s, into, with_derivative)
    s = out * t
  elif fold and in_scale * out_scale != 1.0:
    s = s * (in_scale * out_scale)
  if variant.has_alibi:
    if slope is None:
      raise ValueError("modify_scores: the variant has ALiBi; pass slope")
    if kv_extent is not None and shifts_alibi(variant):
      # distances from the row's nearest key: two int32 ops per score (keys past kv_extent, a
      # kernel's padding, are masked whatever their value)
      q_idx = alibi_nearest_key(q_idx, kv_extent)
    dist = jnp.abs(q_idx - kv_idx).astype(s.dtype)  # |p - j| in int32, then converted
    slope = jnp.asarray(slope).astype(s.dtype)
    s = s - (slope * out_scale if fold else slope) * dist  # d/ds = 1
  if variant.score_fn is not None:
    # in the scores' dtype whatever the function returns (a bfloat16 result would round the logits)
    fn = lambda x: jnp.asarray(variant.score_fn(x, b, h, q_idx, kv_idx), x.dtype)  # noqa: E731
    if with_derivative:
      s, d_fn = jax.jvp(fn, (s,), (jnp.ones_like(s),))
      deriv = d_fn if deriv is None else deriv * d_fn
    else:
      s = fn(s)
  if not fold and out_scale != 1.0:
    s = s * out_scale
  return s, deriv


def soft_cap_factors(cap: float, in_scale: float, out_scale: float, dtype=jnp.float32):
  """``(into, out)`` with ``out_scale * cap * tanh(in_scale * s / cap) = out * tanh(into * s)``, the
  constants of a soft cap (Python floats; ``1 / cap`` as a multiply, not a division, which costs
  several instructions on a GPU). A kernel whose softmax multiplies its logits anyway can take
  ``out`` into that multiply (``kernels/sm90/forward.py``).

  ``into`` is at most the largest finite value of ``dtype`` (the scores' dtype): an inf would give
  ``tanh(0 * inf) = NaN`` at a logit of exactly 0, and there ``tanh(into * s)`` is already
  ``sign(s)`` for every ``|s|`` above 3e-38 in float32. Its other end, a nonzero ``into`` below the
  smallest normal float32 (flushed to 0), is refused by ``validation.check_soft_cap_scale``."""
  limit = float(jnp.finfo(dtype).max)
  return max(-limit, min(limit, in_scale / cap)), cap * out_scale


def soft_cap_tanh(s, into: float, derivative: bool):
  """``(tanh(into * s), d(cap * tanh(x / cap)) / dx = 1 - tanh^2, or None without derivative)``: a
  soft cap's tanh (``into`` from :func:`soft_cap_factors`)."""
  t = jnp.tanh(s * into)
  return t, (1.0 - t * t) if derivative else None


def kernel_scores(variant: Variant, raw, b, h, q_idx, kv_idx, *, scale, out_scale, slope=None,
                  derivative: bool = False, kv_extent: int | None = None):
  """``(out_scale * modify_scores(scale * raw), d s_out / d s_in or None)`` of a tile of raw
  ``q . k`` products, the form a kernel's softmax needs (``out_scale = log2 e`` for base-2 logits),
  with the constants folded where no ``score_fn`` is involved. ``scale`` and ``out_scale`` are
  Python floats (static kernel settings), ``raw`` a float tile (float32 in the kernels, the
  formula's compute dtype there). ``derivative=False`` gives None for
  the derivative. ``kv_extent``: the call's key count S, for the ALiBi distances relative to each
  row's nearest key (:func:`alibi_row_shift`; the lse then needs :func:`alibi_lse_shift`)."""
  return _modify(variant, raw, b, h, q_idx, kv_idx, slope, derivative, scale, out_scale, kv_extent)


def modify_scores(variant: Variant, s, b, h, q_idx, kv_idx, *, slope=None,
                  kv_extent: int | None = None):
  """The scaled logits ``s`` after soft cap, ALiBi and ``score_fn`` (in that order).

  Args:
    s: float scaled logits ``scale * q . k`` of the pairs (e.g. ``[block_q, block_k]``).
    b, h, q_idx, kv_idx: as in :func:`allowed_pairs` (``q_idx`` absolute).
    slope: the ALiBi slope of ``(b, h)`` (scalar or broadcastable), needed when ``variant.has_alibi``.
    kv_extent: the key count S: ALiBi distances relative to each row's nearest key of ``[0, S)``
      (:func:`alibi_row_shift`), each row's logits less ``slope`` times that distance (None: as
      written above).
  """
  return _modify(variant, s, b, h, q_idx, kv_idx, slope, False, kv_extent=kv_extent)[0]


def modify_scores_and_derivative(variant: Variant, s, b, h, q_idx, kv_idx, *, slope=None):
  """``(modify_scores(...), score_derivative(...))`` in one pass (what a backward kernel needs)."""
  return _modify(variant, s, b, h, q_idx, kv_idx, slope, True)


def score_derivative(variant: Variant, s, b, h, q_idx, kv_idx, *, slope=None):
  """``d s_out / d s_in`` per element for the backward (``s`` the scaled logits before
  :func:`modify_scores`): soft cap ``1 - (s_cap / cap)^2``, ALiBi 1, ``score_fn`` by ``jax.jvp``
  (``score_fn`` must be elementwise in the score). None when it is 1 everywhere."""
  return _modify(variant, s, b, h, q_idx, kv_idx, slope, True)[1]
