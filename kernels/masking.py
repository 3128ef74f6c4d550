"""Which (query, key) pairs may attend and how their scores are modified: the one definition shared by
every kernel and the reference formula.

Everything here is plain ``jnp`` on broadcastable int32 index arrays, with no Python control flow on
traced values, so the same functions run on a kernel's tile (``q_idx`` of shape ``[block_q, 1]``,
``kv_idx`` of shape ``[1, block_k]``, per-row / per-column vectors for lengths and segment ids, scalar
batch and head indices) and on the reference's whole ``[B, N, T, S]`` arrays. Because both use these
functions they cannot disagree about the mask. The user's ``mask_fn``/``score_fn`` are the exception
to "any shape": they are called per pair, with scalars, whatever the shapes (:func:`per_pair`).

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
* ``mask_fn(b, h, p, j)`` is True (called per pair, with scalars: :func:`per_pair`);
* (kernels only) ``j < seq_k``: the padded tail of the last key tile.

Scores (:func:`modify_scores`), per pair, in this order: ``s = scale * q_i . k_j``;
``s = cap * tanh(s / cap)`` (soft cap); ``s = s - slope[b, h] * |p - j|`` (ALiBi);
``s = score_fn(s, b, h, p, j)`` (per pair); then disallowed pairs become ``-inf``. A row with no
allowed key has output 0, lse ``-inf`` and zero gradients.

Block ranges, derived from this rule, are in :mod:`fa2_jax.kernels.block_ranges`: which tiles a kernel can skip
(no allowed pair) and which need no mask (every pair allowed).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
from jax import lax

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


# --- mask_fn / score_fn, called per pair ----------------------------------------------------------
# The user functions are called as if once per (b, h, q_idx, kv_idx) pair, with scalars: a function
# that is not elementwise (``j <= jnp.min(q_idx)``) then means the same on every path (the minimum of
# one position is that position), instead of reducing over whatever array a path happens to pass (the
# formula's whole [B, N, T, S] grid, a kernel's tile). Two evaluations, one meaning:
#
# * off the kernels (the formula, the block masks): ``jax.vmap`` of the function over every axis of the
#   index arrays (:func:`per_pair`), which takes any jnp function (gathers from arrays it closes over,
#   control flow) and keeps its custom derivative rules for autodiff;
# * inside a kernel: the function traced once on scalars, and that jaxpr evaluated primitive by
#   primitive on the tile (:func:`_evaluate`), each elementwise primitive bound on the tile's arrays
#   as jnp would bind it, calls inlined, a reduction over no axis dropped: for an elementwise function
#   a kernel holds the operations it held when the function was called on the tile (or fewer: the
#   constant factors of a derivative stay scalars), and vmap's batching rules, which emit operations
#   a tile never held (a reduction over no axis, moved batch axes), stay out of the kernels. A
#   primitive that is not elementwise on a pair (``while``, ``iota``, a gather) cannot run there:
#   :func:`not_per_pair` names it and dispatch runs the formula instead (an explicit kernel raises).

# Elementwise primitives, bound as they stand on broadcastable operands (lax broadcasts them as jnp
# does); select_n and clamp need operands of one shape (or scalar ones) and get them broadcast.
_ELEMENTWISE = frozenset("""
    abs acos acosh add add_any and asin asinh atan atan2 atanh bessel_i0e bessel_i1e cbrt ceil clamp
    clz convert_element_type cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt igamma
    igammac integer_pow is_finite le lgamma log log1p log2 logistic lt max min mul mulhi ne neg
    nextafter not or polygamma population_count pow reduce_precision rem round rsqrt select_n
    shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt square sub tan tanh xor
    zeta""".split())
_SAME_SHAPE = frozenset({"select_n", "clamp"})
# The identity on a scalar (a reduction over no axis, a reshape to (), a copy; stop_gradient: a kernel
# takes no derivative through the function, only the one it asks jax.jvp for, per pair).
_IDENTITY = frozenset("""
    reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor broadcast_in_dim
    reshape squeeze copy copy_p transpose rev optimization_barrier stop_gradient""".split())
# Calls: their jaxpr is evaluated in place (a custom_jvp's primal: the kernels differentiate with
# jax.jvp per pair, where the custom rule applies).
_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
          "remat2": "jaxpr", "checkpoint": "jaxpr", "custom_jvp_call": "call_jaxpr",
          "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr"}


class NotPerPair(TypeError):
  """A user function whose trace on one pair holds an operation a kernel cannot evaluate on a tile."""


def _pair_aval(x):
  """The abstract value of one element of ``x`` (int32 for Python ints and None)."""
  dtype = getattr(x, "dtype", None)
  return jax.ShapeDtypeStruct((), jnp.int32 if dtype is None else dtype)


def _open(jaxpr):
  """``(jaxpr, consts)`` of a Jaxpr or ClosedJaxpr."""
  if isinstance(jaxpr, jex_core.ClosedJaxpr):
    return jaxpr.jaxpr, jaxpr.consts
  return jaxpr, ()


def _unsupported(jaxpr) -> str | None:
  """The first primitive of ``jaxpr`` (traced on scalars, sub-jaxprs included) that
  :func:`_evaluate` cannot evaluate on a tile, else None."""
  jaxpr, consts = _open(jaxpr)
  if any(jnp.ndim(c) for c in consts):
    return "an array constant"
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    avals = [v.aval for v in (*eqn.invars, *eqn.outvars)]
    if any(getattr(a, "shape", None) != () for a in avals):
      return f"{name} (on a non-scalar array)"
    if name in _CALLS and _CALLS[name] in eqn.params:
      if (why := _unsupported(eqn.params[_CALLS[name]])) is not None:
        return why
    elif name == "cond":
      for branch in eqn.params["branches"]:
        if (why := _unsupported(branch)) is not None:
          return why
    elif name not in _ELEMENTWISE and name not in _IDENTITY:
      return name
  return None


def _broadcast_all(values, scalars: bool = True):
  """``values`` broadcast to one shape, as ``jnp.where`` broadcasts its operands (``scalars``
  False: rank-0 values stay, as ``lax.clamp`` takes them)."""
  shape = jnp.broadcast_shapes(*(jnp.shape(x) for x in values))
  return [x if jnp.shape(x) == shape or (not scalars and jnp.ndim(x) == 0)
          else jnp.broadcast_to(x, shape) for x in values]


def _evaluate(jaxpr, args):
  """The scalar ``jaxpr`` evaluated on broadcastable arrays ``args``, as on each of their elements
  (its primitives elementwise: :func:`_unsupported` is None)."""
  jaxpr, consts = _open(jaxpr)
  env = {}
  read = lambda v: v.val if isinstance(v, jex_core.Literal) else env[v]  # noqa: E731
  env.update(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    name = eqn.primitive.name
    if name in _CALLS and _CALLS[name] in eqn.params:
      outs = _evaluate(eqn.params[_CALLS[name]], ins)
    elif name == "cond":  # every branch, then the index's (what vmap does with a mapped index)
      index, *ops = ins
      results = [_evaluate(branch, ops) for branch in eqn.params["branches"]]
      outs = [lax.select_n(*_broadcast_all([index, *r])) for r in zip(*results)]
    elif name in _IDENTITY:
      outs = ins[:len(eqn.outvars)]
    elif name in _ELEMENTWISE:
      if name in _SAME_SHAPE:
        ins = _broadcast_all(ins, scalars=name == "select_n")
      out = eqn.primitive.bind(*ins, **eqn.params)
      outs = out if eqn.primitive.multiple_results else [out]
    else:
      raise NotPerPair(f"the kernels cannot evaluate {name} on a tile")
    for v, x in zip(eqn.outvars, outs):
      if not isinstance(v, jex_core.DropVar):
        env[v] = x
  return [read(v) for v in jaxpr.outvars]


def _reads(jaxpr) -> list[bool]:
  """Which inputs of ``jaxpr`` its equations or outputs use."""
  jaxpr, _ = _open(jaxpr)
  used = {v for eqn in jaxpr.eqns for v in eqn.invars if not isinstance(v, jex_core.Literal)}
  used |= {v for v in jaxpr.outvars if not isinstance(v, jex_core.Literal)}
  return [v in used for v in jaxpr.invars]


def _map_axes(fn, args):
  """``fn`` over the broadcast of ``args`` (each rank 0 or all one rank), by one ``jax.vmap`` per
  axis; an argument of size 1 on an axis enters that level unmapped."""
  ranked = [x for x in args if jnp.ndim(x)]
  if not ranked:
    return fn(*args)
  # mapped: the arguments whose size here is not 1 (all the same size; symbolic sizes, jax.export's,
  # count as not 1, as broadcasting takes them)
  one = lambda d: isinstance(d, int) and d == 1  # noqa: E731
  axes = tuple(0 if jnp.ndim(x) and not one(x.shape[0]) else None for x in args)
  inner = [x if ax == 0 else (x[0] if jnp.ndim(x) else x) for x, ax in zip(args, axes)]
  if all(ax is None for ax in axes):
    return jax.tree.map(lambda y: y[None], _map_axes(fn, inner))
  return jax.vmap(lambda *xs: _map_axes(fn, xs), in_axes=axes)(*inner)


def per_pair(fn, *args, in_kernel: bool = False):
  """``fn(*args)`` as if called once per element of the broadcast of ``args`` (the pairs), with
  scalars: the tuple of ``fn``'s results (the leaves of what it returns), each of the broadcast
  shape of the arguments it reads (arguments it does not read add no axes) or a scalar.

  Args:
    fn: a function of scalars (``mask_fn``, ``score_fn``, or a wrapper of one).
    args: int32 index arrays, a float score array, scalars; broadcastable against each other.
    in_kernel: True inside a Pallas kernel: ``fn`` traced once on scalars and its jaxpr evaluated on
      the arrays (elementwise primitives only; :class:`NotPerPair` otherwise). False: ``jax.vmap``.
  """
  jaxpr = _trace(fn, [_pair_aval(x) for x in args])
  reads = _reads(jaxpr)
  if in_kernel:
    if (why := _unsupported(jaxpr)) is not None:
      raise NotPerPair(f"a kernel cannot evaluate this function per pair: it holds {why}")
    outs = _evaluate(jaxpr, [x if r else None for x, r in zip(args, reads)])
    outs = [jnp.asarray(x) for x in outs]
  else:
    # unread arguments as scalars (no axes), the rest at one rank
    args = [x if r else jnp.zeros((), _pair_aval(x).dtype) for x, r in zip(args, reads)]
    rank = max(jnp.ndim(x) for x in args)
    args = [x if jnp.ndim(x) in (0, rank) else jnp.reshape(x, (1,) * (rank - jnp.ndim(x))
                                                             + jnp.shape(x)) for x in args]
    outs = jax.tree.leaves(_map_axes(lambda *a: jax.tree.map(jnp.asarray, fn(*a)), args))
  return tuple(outs)


def _score_one(score_fn, with_derivative: bool):
  """``score_fn`` on one pair, its result in the score's dtype (a bfloat16 result would round the
  logits), with ``d out / d score`` by ``jax.jvp`` when ``with_derivative`` (a custom JVP rule of the
  function applies)."""
  def one(x, b, h, q_idx, kv_idx):
    f = lambda x: jnp.asarray(score_fn(x, b, h, q_idx, kv_idx), x.dtype)  # noqa: E731
    return jax.jvp(f, (x,), (jnp.ones_like(x),)) if with_derivative else f(x)
  return one


def _mask_one(mask_fn):
  return lambda b, h, q_idx, kv_idx: jnp.asarray(mask_fn(b, h, q_idx, kv_idx), jnp.bool_)


@functools.lru_cache(maxsize=64)  # dispatch asks several times per call; the key holds .functions
def not_per_pair(variant: Variant) -> str | None:
  """Why the kernels cannot evaluate ``mask_fn`` or ``score_fn`` (and its derivative) on a tile, one
  pair per element (a primitive that is not elementwise, e.g. ``while`` or ``iota``: see
  :func:`per_pair`), or None when they can."""
  i32, f32 = jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((), jnp.float32)
  forms = []
  if variant.mask_fn is not None:
    forms.append(("mask_fn", _mask_one(variant.mask_fn), (i32,) * 4))
  if variant.score_fn is not None:
    for deriv in (False, True):
      forms.append(("score_fn", _score_one(variant.score_fn, deriv), (f32, *(i32,) * 4)))
  for name, fn, args in forms:
    try:
      why = _unsupported(_trace(fn, args))
    except Exception as e:  # noqa: BLE001  e.g. jax.jvp of a custom_vjp function
      why = f"{type(e).__name__}: {e}"
    if why is not None:
      return (f"a {name} whose trace on one pair holds {why}, which a kernel cannot evaluate "
              "elementwise on its tile")
  return None


class VariantArrays(NamedTuple):
  """The array part of a variant (a pytree), normalised by the public API; None where unused.

  Attributes:
    q_lengths: ``[B]`` int32, valid query rows per batch element.
    kv_lengths: ``[B]`` int32, valid keys per batch element.
    q_segment_ids: ``[B, T]`` int32.
    kv_segment_ids: ``[B, S]`` int32.
    q_offset: ``[B]`` int32, absolute position of query row 0.
    alibi_slopes: ``[B, N]`` float32 (differentiated on the formula and the Triton kernels).
  """

  q_lengths: jax.Array | None = None
  kv_lengths: jax.Array | None = None
  q_segment_ids: jax.Array | None = None
  kv_segment_ids: jax.Array | None = None
  q_offset: jax.Array | None = None
  alibi_slopes: jax.Array | None = None


# The range a traced q_offset acts as clipped to, that of a concrete one (INT32_SAFE: positions
# q_offset + i and the rule's j - p stay inside int32).
OFFSET_RANGE = (1 - INT32_SAFE, INT32_SAFE - 1)


def clip_ranges(arrays: VariantArrays, seq_q: int, seq_k: int) -> VariantArrays:
  """``arrays`` with the lengths clipped to ``[0, seq_q]`` / ``[0, seq_k]`` and ``q_offset`` to
  :data:`OFFSET_RANGE`: what traced out-of-range values act as. The public API's validation leaves
  int32 ones as given; this clips them (XLA ops) before every kernel but one that clips its scalars
  itself (the decode kernel: a decoding step then runs no clip op before it)."""
  def clip(x, lo, hi):
    if x is None or isinstance(x, jax.ShapeDtypeStruct):
      return x
    if not isinstance(hi, int):  # a symbolic length (jax.export): the formula, unclipped above
      return jnp.maximum(x, jnp.int32(lo))
    return jnp.clip(x, jnp.int32(lo), jnp.int32(hi))
  return arrays._replace(q_lengths=clip(arrays.q_lengths, 0, seq_q),
                         kv_lengths=clip(arrays.kv_lengths, 0, seq_k),
                         q_offset=clip(arrays.q_offset, *OFFSET_RANGE))


# --- the elementwise rule -------------------------------------------------------------------------

def allowed_pairs(variant: Variant, b, h, q_idx, kv_idx, *, q_len=None, kv_len=None, q_seg=None,
                  kv_seg=None, q_offset=None, seq_k=None, in_kernel: bool = False):
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
    in_kernel: True inside a kernel (``mask_fn`` evaluated as :func:`per_pair` says).

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
    # called per pair, whatever the shapes of the index arrays
    terms.append(per_pair(_mask_one(variant.mask_fn), b, h, q_idx, kv_idx, in_kernel=in_kernel)[0])
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
  shifted. Differentiable in the slopes (``-slope`` times the shift enters their gradient)."""
  if not shifts_alibi(variant):
    return None
  rows = jnp.arange(t, dtype=jnp.int32)[None, :]  # [1, T]
  p = rows + arrays.q_offset[:, None] if variant.has_q_offset else rows  # [B or 1, T]
  near = alibi_row_shift(p, kv_extent).astype(dtype)
  slopes = arrays.alibi_slopes.astype(dtype)
  return slopes[:, None, :] * near[:, :, None]


def remove_alibi_shift(lse, shift):
  """``lse - shift`` (``shift`` from :func:`alibi_lse_shift`) where a row has a key; a row with none keeps lse ``-inf``, also where ``slope * distance`` overflows to ``-inf``
  (slopes near the bound at offsets near 2^30), which would give ``-inf - (-inf) = NaN``."""
  return jnp.where(lse == -jnp.inf, lse, lse - shift)


def _modify(variant: Variant, s, b, h, q_idx, kv_idx, slope, with_derivative: bool,
            in_scale=1.0, out_scale=1.0, kv_extent: int | None = None, in_kernel: bool = False,
            slope_derivative: bool = False):
  """``(out_scale * modify_scores(in_scale * s), d s_out / d s_in)``, and with ``slope_derivative``
  a third element, ``d modify_scores / d slope`` (without ``out_scale``: ``-|p - j|`` times the
  ``score_fn``'s derivative). Without a ``score_fn`` the two scales fold into the soft cap's and
  ALiBi's constants: a kernel's softmax scale (``in_scale``) and base-2 conversion (``out_scale =
  log2 e``) then cost no multiply per score beyond the cap's own."""
  deriv = d_slope = None
  with_derivative = with_derivative or slope_derivative
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
    d_slope = -dist
  if variant.score_fn is not None:
    # called per pair (per_pair), in the scores' dtype whatever the function returns
    out = per_pair(_score_one(variant.score_fn, with_derivative), s, b, h, q_idx, kv_idx,
                   in_kernel=in_kernel)
    shape = jnp.shape(s)
    if with_derivative:
      s, d_fn = (jnp.broadcast_to(x, shape) for x in out)
      deriv = d_fn if deriv is None else deriv * d_fn
      d_slope = None if d_slope is None else d_slope * d_fn
    else:
      s = jnp.broadcast_to(out[0], shape)
  if not fold and out_scale != 1.0:
    s = s * out_scale
  if slope_derivative:
    return s, deriv, d_slope
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
                  derivative: bool = False, kv_extent: int | None = None, in_kernel: bool = False,
                  slope_derivative: bool = False):
  """``(out_scale * modify_scores(scale * raw), d s_out / d s_in or None)`` of a tile of raw
  ``q . k`` products, the form a kernel's softmax needs (``out_scale = log2 e`` for base-2 logits),
  with the constants folded where no ``score_fn`` is involved. ``scale`` and ``out_scale`` are
  Python floats (static kernel settings), ``raw`` a float tile (float32 in the kernels, the
  formula's compute dtype there). ``derivative=False`` gives None for
  the derivative. ``kv_extent``: the call's key count S, for the ALiBi distances relative to each
  row's nearest key (:func:`alibi_row_shift`; the lse then needs :func:`alibi_lse_shift`).
  ``in_kernel``: True inside a kernel (``score_fn`` evaluated as :func:`per_pair` says).
  ``slope_derivative``: also return ``d modify_scores / d slope`` per pair (natural units, for the
  slopes' gradient ``sum dS * it``: :func:`_modify`), the derivative then computed too."""
  return _modify(variant, raw, b, h, q_idx, kv_idx, slope, derivative, scale, out_scale, kv_extent,
                 in_kernel, slope_derivative)


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
