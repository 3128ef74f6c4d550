"""The online softmax's per-row scaling and row statistics, shared by the Triton and Mosaic kernels.

The kernels compute ``p = exp2(s * c - m)`` with ``c = scale * log2(e)`` and ``m = max(s) * c`` as one
FMA per element (docs/design.md, "Softmax form"). That is exact up to a per-row factor ``2^δ``, ``δ``
the rounding error of ``m``, which cancels in the output and the lse; :func:`huge_row_scale` keeps the
factor inside what ``P`` can hold, for any finite logits, with per-row work only. The forward stores
two floats per row (below); from them the backward recomputes the forward's ``P`` in one FMA per
element, or exactly for heads with huge logits (:func:`backward_rows`, :func:`probabilities`).
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from .masking import soft_cap_factors

# |m| (a row's scaled maximum, base 2) from which the forward scales the row by a power of two: the
# single-FMA p = exp2(s*c - m) is off by the rounding of m, 2^δ with |δ| <= ulp(m)/2, which must stay
# inside what P can hold. Below 2^30, |δ| <= 32 (float32 row sums and bfloat16 P hold 2^32); float16 P
# overflows past 2^16, so |δ| <= 8: below 2^28.
HUGE_ROW = {"float16": 2.0 ** 28}
HUGE_ROW_DEFAULT = 2.0 ** 30


def huge_row_scale(r, m, c: float, dtype):
  """Per-row multiplier and offset for the forward's ``p = exp2(s * c_row - t_row)``.

  ``r``: the row's raw logit of largest ``r * c`` (an element of the row), ``m = r * c`` (rounded),
  ``c != 0`` a static float. Ordinary rows get ``(c, m)``. A row with ``|m| >= HUGE_ROW`` gets
  ``c_row = ±2^(30 - E)`` (the sign of ``c``) with ``E`` the binary exponent
  of ``r``: ``r * c_row`` lies in ``[2^30, 2^31)`` and is exact, so the row maximum gets exactly 1. Such
  a row is one-hot up to its ties: any other logit differs from ``r`` by at least an ulp of ``r``,
  ``2^(E-23)``, which ``c`` turns into more than 2^6 binades (2^4 for float16) and ``c_row`` into
  2^7, so its weight is below 2^-64 (2^-16) in the exact softmax and 2^-128 here. The row's
  bookkeeping (``m``, ``alpha``, the lse) stays in ``c`` units.
  """
  huge = jnp.abs(m) >= HUGE_ROW.get(jnp.dtype(dtype).name, HUGE_ROW_DEFAULT)
  # 2^(30 - E) has the biased exponent 30 - E + 127 = 284 - (E + 127): its bits are 284 << 23 minus
  # r's exponent field, two integer operations. A huge row has E + 127 in [30, 254] (|r * c| >= 2^28
  # with |c| < 2^128), so the result is a normal float; other rows ignore it.
  exp_field = lax.bitcast_convert_type(r, jnp.uint32) & jnp.uint32(0x7F800000)
  pow2 = lax.bitcast_convert_type(jnp.uint32(284 << 23) - exp_field, jnp.float32)
  if c < 0:  # the sign of c
    pow2 = -pow2
  return jnp.where(huge, pow2, c), jnp.where(huge, r * pow2, m)


# --- the forward's row statistics and what the backward makes of them ------------------------------
#
# Both forward kernels write, per query row, ``stats [B, N, 2, T]`` float32: ``r`` (the raw logit of
# the row's largest ``s * c``, an element of the row) and ``l``, the row sum of the kernels' weights
# ``exp2(s * c_row - t_row)`` divided by the weight of ``r`` itself (:func:`row_sum_at_max`; 0 for a
# row with no allowed key). ``c`` is ``scale * log2(e)`` when the kernels fold the scale into the
# exponent (:func:`exponent_scale`); otherwise (a score modification, or scale 0) the kernels work on
# base-2 logits, ``c = 1`` and ``r`` is their maximum. The natural-log logsumexp is
# ``lse = (r * c) * ln 2 + log l`` (:func:`lse_from_stats`); the backward recomputes ``P`` from
# ``(r, l)`` (:func:`backward_rows`).

LN2 = math.log(2.0)
LOG2E = math.log2(math.e)


def check_input_dtype(dtype):
  """A config default's ``dtype`` -> a numpy dtype among the kernels' input dtypes (TypeError naming
  ``dtype`` otherwise)."""
  if dtype is None:  # jnp.dtype(None) is float64
    raise TypeError("dtype must be bfloat16, float16 or float32, got None")
  try:
    dt = jnp.dtype(dtype)
  except TypeError as e:
    raise TypeError(f"dtype must be bfloat16, float16 or float32, got {dtype!r}") from e
  if dt not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
    raise TypeError(f"dtype must be bfloat16, float16 or float32 (the kernels' input dtypes), got {dt}")
  return dt


# float32's smallest normal number: the kernels flush subnormals (the GPU's f32 arithmetic, XLA's CPU)
F32_TINY = float(np.finfo(np.float32).tiny)


def kernel_scale(scale: float) -> float:
  """The scale the kernels run with: ``scale``, or 0 where ``scale * log2(e)`` is subnormal in float32.

  Such a ``c`` is flushed to 0 inside the kernels while ``scale != 0`` sends them down the path that
  divides by it (NaN for every row at 0 < |scale| < 8.2e-39). Running them with scale 0 changes no
  float32 result where the scaled logits are finite: ``exp(scale · s)`` rounds to 1 until ``|scale ·
  s|`` passes 2^-25, i.e. ``|s|`` past 4e30, and the gradients' factor ``scale`` leaves only
  subnormals, which are flushed too."""
  return 0.0 if abs(scale) * LOG2E < F32_TINY else scale


def exponent_scale(scale: float, modifies_scores: bool) -> float:
  """``c``: what multiplies a raw logit inside the kernels' ``exp2`` (1: they see base-2 logits)."""
  return scale * LOG2E if scale != 0 and not modifies_scores else 1.0


def lse_from_stats(stats, scale: float, modifies_scores: bool):
  """``lse [B, N, T]`` float32 (natural log; ``-inf`` for a row with no allowed key) from the
  forward's ``stats [B, N, 2, T]``: ``m + log2 l`` in base 2 with ``m = r * c`` rounded (within that
  rounding of the exact ``r * c + log2 l``)."""
  r, l = stats[:, :, 0], stats[:, :, 1]
  m = r * np.float32(exponent_scale(scale, modifies_scores))
  empty = l == 0.0
  return jnp.where(empty, -jnp.inf, m * LN2 + jnp.log(jnp.where(empty, 1.0, l)))


def stats_from_lse(lse, scale: float, modifies_scores: bool):
  """Row statistics ``[B, N, 2, T]`` float32 for rows whose lse ``[B, N, T]`` (natural log, the
  kernels' frame) is given: the inverse of :func:`lse_from_stats`, ``r = lse / (c ln 2)`` and ``l = 1``
  (``l = 0``, no key, where lse is ``-inf``). The backward of rows whose softmax spans more keys
  than one call's (context parallelism: ``fa2_jax.attention.attention_backward``) recomputes
  ``P = exp(s - lse)`` from them. Unlike the forward's stored ``(r, l)``, ``r`` is not a logit: the
  backward's ``(s - r) * c`` loses ``|lse| * 2^-24`` of the exponent to the rounding of ``r``
  (a relative error within 1e-4 in ``P`` while ``|lse| < 2^10``)."""
  c = np.float32(exponent_scale(scale, modifies_scores))
  empty = lse == -jnp.inf
  r = jnp.where(empty, 0.0, lse.astype(jnp.float32) * np.float32(LOG2E) / c)
  l = jnp.where(empty, 0.0, 1.0).astype(jnp.float32)
  return jnp.stack([r, l], axis=2)


def row_sum_at_max(r, m, l, c: float, dtype):
  """The row sum the forward stores: ``l`` rescaled so that the row maximum's weight counts as 1.

  The kernels' ``p = exp2(s * c_row - t_row)`` gives the maximum ``2^x``, ``x = r * c_row - t_row``
  as the compiler evaluates it: ``δ = r * c - m`` exactly when it contracts the product into an FMA
  (Mosaic: ptxas), 0 when it rounds the product first (Pallas Triton on an H200), 0 for a huge row.
  This evaluates ``x`` in the same form, per row, so the stored ``l * 2^-x`` is relative to ``r``
  whichever the compiler did, and the backward's ``exp2((s - r) * c - log2 l)`` needs no
  assumption about it. ``r``, ``m``: as for :func:`huge_row_scale`; a row with no key (``m = -inf``,
  ``l = 0``) keeps ``l``.
  """
  seen = m > -jnp.inf
  r, m = jnp.where(seen, r, 0.0), jnp.where(seen, m, 0.0)
  c_row, t_row = huge_row_scale(r, m, c, dtype)
  return l * jnp.exp2(t_row - r * c_row)


def backward_rows(stats, exact=None, c: float = 1.0):
  """The backward kernels' per-row inputs ``[B, N, 2, T]`` float32.

  For a head that needs the exact form (``exact [B, N]`` nonzero, or ``exact=None``: every head),
  ``(r, u)`` with ``u = log2 l``: ``P = exp2((s - r) * c - u)`` (on base-2 logits ``s2``,
  ``exp2((s2 - r) - u)``) is the forward's ``P`` for any finite logits. The stored ``l`` is
  relative to ``r`` itself (:func:`row_sum_at_max`), so the only roundings are the product's and the
  exponent's, as in the forward; unlike one offset ``lse * log2(e)``, whose rounding is a factor up
  to ``2^(ulp/2)`` on the whole row (``2^32`` and more past ``|lse| = 2^30``), this keeps ``P`` as
  exact as the forward's at any logit size; a huge row's tied maxima get ``1 / l`` each.

  Any other head gets ``(t, u)``, ``t = r * c + u`` (``c`` of :func:`exponent_scale`), for the
  one-FMA ``exp2(s * c - t)`` (:func:`probabilities`). A row with no allowed key gets ``r = t = 0,
  u = +inf``: ``P = 0`` in either form.
  """
  r, l = stats[:, :, 0], stats[:, :, 1]
  empty = l == 0.0
  u = jnp.log2(jnp.where(empty, 1.0, l))
  r = jnp.where(empty, 0.0, r)
  if exact is not None:
    t = r * np.float32(c) + u
    r = jnp.where(exact[:, :, None] != 0, r, jnp.where(empty, jnp.inf, t))
  return jnp.stack([r, jnp.where(empty, jnp.inf, u)], axis=2)


# A (batch, head) whose rows all have |r * c| below this takes the backward's fast form of P, one FMA
# per element: exp2(s * c - t) with t = r * c + log2 l rounded twice (|t| < 2^11: an error within
# 2^-12, P within 2^-12 ln 2 = 1.7e-4, under half a float16 ulp). A head with a row past it takes the
# exact form, one subtraction more per element (measured: docs/design.md, "Softmax form").
FAST_FORM_LIMIT = 2.0 ** 10


def fast_form_suffices(variant) -> bool:
  """Whether every row's ``|r * c|`` stays below :data:`FAST_FORM_LIMIT` whatever the inputs, so the
  backward needs no exact form: the scores of ``variant`` (a ``fa2_jax.kernels.masking.Variant`` or None)
  are a soft cap's ``cap * tanh(.)`` (base-2 logits, ``c = 1``: ``|r| <= cap * log2 e``) with
  nothing added after it (ALiBi, a ``score_fn``). Half the limit as margin for the rounding of
  ``cap * log2 e``."""
  return (variant is not None and variant.soft_cap is not None and not variant.has_alibi
          and variant.score_fn is None and variant.soft_cap * LOG2E <= FAST_FORM_LIMIT / 2)


def folded_soft_cap(variant, scale: float) -> tuple[float, float] | None:
  """``(into, c)`` for a call whose kernels take the soft cap's outer factor into their softmax's
  multiply, None for others: a soft cap with nothing after it, bounded as
  :func:`fast_form_suffices` asks. Their logits are then ``tanh(into * s)`` with ``c = cap * log2 e``
  (``exp2(t * c - m)``, one multiply per element less than ``exp2(cap * log2 e * t - m)``); what they
  store stays in base-2 logits (``m = r * c`` and ``l`` as summed, relative to ``2^m``), so the lse
  and the backward's rows are computed as for other score modifications; the row maximum is then at
  most ``cap * log2 e``, so the forward also skips :func:`huge_row_scale`. The Mosaic forward folds
  (its other calls' ``exp2(s * c_row - t_row)`` has a per-row ``c_row``, so the cap's factor was a
  multiply of its own); the backwards do not: in their fast form ``exp2(s2 - t)`` the
  compiler already contracts the factor into the FMA (folded, the H200 gave the same gradients bit
  for bit, docs/design.md, "Attention variants")."""
  if not fast_form_suffices(variant):
    return None
  return soft_cap_factors(variant.soft_cap, scale, LOG2E)


def exact_heads(stats, scale: float, modifies_scores: bool, group: int = 1):
  """``[B, N]`` int32: 1 where a row of that (batch, head) needs the backward's exact form, and then
  for every head of its GQA group of ``group`` consecutive query heads (one KV head): a dK/dV
  kernel runs a group's heads in one CTA, in one form, so their rows must all be in that form."""
  r, l = stats[:, :, 0], stats[:, :, 1]
  m = r * np.float32(exponent_scale(scale, modifies_scores))
  exact = jnp.any((l > 0.0) & ~(jnp.abs(m) < FAST_FORM_LIMIT), axis=-1)  # [B, N]
  if group > 1:
    b, n = exact.shape
    exact = jnp.repeat(jnp.any(exact.reshape(b, n // group, group), axis=-1), group, axis=1)
  return exact.astype(jnp.int32)


def probabilities(s, r, u, c: float, *, exact: bool, bcast):
  """The forward's ``P`` of a tile of raw logits ``s`` (base-2 logits when ``c = 1``) from its rows'
  inputs (:func:`backward_rows`); ``bcast(v, shape)`` spreads a per-row vector over the tile.

  ``exact``: ``exp2((s - r) * c - u)``, exact at any logit size, and at most 1: where the recomputed
  logit exceeds the forward's maximum (a dot product summed in another order: an ulp, which a huge
  ``c`` turns into many binades) the exponent stops at 0 rather than overflow into inf and NaN.
  Otherwise ``r`` holds ``t`` and ``P`` is one FMA per element, ``exp2(s * c - t)``, for heads that
  :func:`exact_heads` leaves to it (``u`` unused; there an ulp of ``s`` moves ``P`` by a factor
  within ``2^(2^-13)``).
  """
  scaled = (lambda x: x) if c == 1.0 else (lambda x: x * c)
  if exact:
    return jnp.exp2(jnp.minimum(scaled(s - bcast(r, s.shape)) - bcast(u, s.shape), 0.0))
  return jnp.exp2(scaled(s) - bcast(r, s.shape))
