"""Reuse of lowered Mosaic kernels across jitted programs (opt-in:
``fa2_jax.reuse_kernels_across_programs()``, ``fa2_jax/kernel_reuse.py``, which also pads lengths).

Every program that holds a Mosaic kernel lowers it again: JAX runs the Pallas Mosaic GPU lowering
(layout inference, dialect lowering, serialization) once per kernel per ``jax.jit`` program, even for
a kernel an earlier program lowered with the same shapes and settings. That costs about 0.5 s per
kernel, 1.5 s for a forward + backward on the H200's host (docs/design.md, "What a new shape costs").
jaxlib keeps one compiled kernel per kernel hash (the SHA-256 of the serialized module, source
locations included) for the process, but a kernel lowered inside another program gets other locations,
so another hash, and is compiled again (ptxas, about 1 s per kernel).

With the cache on, each kernel launch function (the forward, dK/dV and dQ calls, whose settings are
static) is exported once per settings and operand shapes with ``jax.export`` and called through
``Exported.call`` in every program after: the program embeds the lowered module instead of lowering it,
and the module (so the kernel hash) is the same, so XLA's compile finds the kernel compiled. The key
holds the launch function, its settings, the operands' shapes and dtypes and the mesh in context (an
export records its device count). Programs traced before the switch keep their own lowering.

``vmap`` runs :func:`ops.batch_rule` (the mapped axis folded into the batch, as the fused dK/dV/dQ call
does for ``pl.run_state``): that costs an export at the per-element shape too (``custom_vmap`` traces its
body unbatched), and unbatched operands are broadcast in HBM.

Not used in GPU interpret mode (``emulate``), nor for operands with symbolic dimensions.
"""
from __future__ import annotations

import functools
import threading

import jax
from jax._src import config as jax_config  # export_ignore_forward_compatibility: no public context form

_STATE = {"enabled": False, "hits": 0, "misses": 0}
_EXPORTED: dict = {}
_LOCK = threading.Lock()


def set_enabled(enabled: bool) -> bool:
  """Turns the reuse on or off for what is traced after (``fa2_jax.reuse_kernels_across_programs``,
  which checks the argument); returns the previous setting."""
  previous = _STATE["enabled"]
  _STATE["enabled"] = bool(enabled)
  return previous


def info() -> dict:
  """``{"enabled", "hits", "misses", "size"}``: calls served by an exported kernel, exports made,
  kernels held."""
  with _LOCK:
    return {"enabled": _STATE["enabled"], "hits": _STATE["hits"], "misses": _STATE["misses"],
            "size": len(_EXPORTED)}


def clear() -> None:
  """Drops every exported kernel and resets the counts."""
  with _LOCK:
    _EXPORTED.clear()
    _STATE["hits"] = _STATE["misses"] = 0


def _static_dims(x) -> bool:
  return all(isinstance(d, int) for d in x.shape)


def kernel_call(static_argnames: tuple[str, ...]):
  """Decorator for a kernel launch function ``fn(*arrays, **settings)``: ``jax.jit`` with the
  settings static, or, with the cache on, the exported form of that jitted function."""
  def wrap(fn):
    jitted = jax.jit(fn, static_argnames=static_argnames)

    @functools.wraps(fn)
    def call(*operands, **static):
      if (not _STATE["enabled"] or static.get("emulate")
          or not all(_static_dims(x) for x in operands)):
        return jitted(*operands, **static)
      return _cached(fn, jitted, static, operands)

    call.jitted = jitted
    return call
  return wrap


def _export(jitted, static: dict, avals):
  export = functools.partial(
      jax.export.export, jax.jit(functools.partial(jitted, **static)), platforms=("cuda",),
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("mosaic_gpu_v2")])
  # The module is used in this process only: lower it as a plain jit would, at the current Mosaic IR
  # version (an export otherwise serializes the kernel for forward compatibility, an older version).
  # JAX has no public context form of this flag; without it, the export's default applies.
  ignore = getattr(jax_config, "export_ignore_forward_compatibility", None)
  if ignore is None:
    return export()(*avals)
  with ignore(True):
    return export()(*avals)


def _exported(fn, jitted, static: dict, operands):
  avals = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in operands)
  mesh = jax.sharding.get_abstract_mesh()  # its axes and sizes: an export records the device count
  key = (fn.__module__, fn.__qualname__, tuple(sorted(static.items())), avals, mesh)
  with _LOCK:
    exp = _EXPORTED.get(key)
    _STATE["hits" if exp is not None else "misses"] += 1
  if exp is not None:
    return exp
  exp = _export(jitted, static, avals)  # outside the lock: a concurrent miss may export it twice
  with _LOCK:
    return _EXPORTED.setdefault(key, exp)


def _cached(fn, jitted, static: dict, operands):
  @jax.custom_batching.custom_vmap
  def call(*ops):
    return _exported(fn, jitted, static, ops).call(*ops)

  @call.def_vmap
  def _vmap(axis_size, in_batched, *ops):
    from .ops import batch_rule  # `import fa2_jax` loads this module, not the kernels' (ops)
    launch = lambda *merged: _cached(fn, jitted, static, merged)  # noqa: E731
    return batch_rule(launch, axis_size, in_batched, ops, static.get("variant"))

  return call(*operands)
