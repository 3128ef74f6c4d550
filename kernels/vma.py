"""Output types that work inside ``jax.shard_map`` with ``check_vma=True`` (its default).

Under ``shard_map`` every value carries the set of manual mesh axes it varies over (its VMA). A Pallas
call does not infer it: each output's ``ShapeDtypeStruct`` must say it, or ``check_vma=True`` rejects
the call (Triton backend) or the ``custom_vjp`` finds the gradients typed differently from the inputs
(Mosaic backend). Attention outputs vary wherever any input does, so the dispatcher first makes q, k,
v vary over the union of their axes (:func:`match_vma`) and the kernels type every output like q
(:func:`out_struct`). Outside ``shard_map`` the axis set is empty and both are no-ops.
"""
from __future__ import annotations

import jax


def varying_axes(x) -> frozenset:
  """The manual mesh axes ``x`` varies over (empty outside ``shard_map`` or with its check off)."""
  mat = getattr(jax.typeof(x), "manual_axis_type", None)
  return frozenset(mat.varying) if mat is not None else frozenset()


def _vary_over(x, axes: frozenset):
  """``x`` cast to vary over ``axes`` too (a no-op where it already does)."""
  missing = tuple(sorted(axes - varying_axes(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def match_vma(*xs):
  """The arrays, each cast to vary over the union of the manual axes any of them varies over."""
  union = frozenset().union(*(varying_axes(x) for x in xs))
  return tuple(_vary_over(x, union) for x in xs)


def out_struct(shape, dtype, like) -> jax.ShapeDtypeStruct:
  """``ShapeDtypeStruct(shape, dtype)`` varying over the same manual mesh axes as ``like``."""
  if not varying_axes(like):
    return jax.ShapeDtypeStruct(shape, dtype)
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(like).manual_axis_type)


def cast_like(like, *xs):
  """Each array cast to vary over the manual axes of ``like`` too (Mosaic GPU's ``plgpu.kernel``
  traces its call with the check off, so its outputs come back typed as invariant)."""
  target = varying_axes(like)
  return tuple(_vary_over(x, target) for x in xs)
