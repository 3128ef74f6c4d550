"""The online softmax's per-row scaling, shared by the Triton and Mosaic forward kernels.

The kernels compute ``p = exp2(s * c - m)`` with ``c = scale * log2(e)`` and ``m = max(s) * c`` as one
FMA per element (docs/design.md, "Softmax form"). That is exact up to a per-row factor ``2^δ``, ``δ``
the rounding error of ``m``, which cancels in the output and the lse; :func:`huge_row_scale` keeps the
factor inside what ``P`` can hold, for any finite logits, with per-row work only.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

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
