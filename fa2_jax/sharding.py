"""Sharded inputs under ``jax.jit``: every device runs the kernels on its own batch rows and heads.

Attention is independent across the batch axis B and across key/value-head groups (query head ``n``
reads KV head ``n // G``, ``G = N / K``), so a call whose q/k/v are sharded along B and/or the heads
runs locally on each device with no collective, forward and backward. Left alone, XLA cannot see into
a Pallas call and all-gathers q/k/v around it (every device computes the whole batch); with an
Explicit-axes mesh the kernels' refs refuse sharded slicing outright. Which mesh axes may shard what:

* B (dim 0 of every operand): any mesh axes that divide B.
* Heads (N of q, K of k/v): mesh axes over ``d`` devices with ``K % d == 0``, so that each device
  holds whole GQA groups (its query heads and the KV heads they read). q and k/v shard alike.
* T, S (the sequence axes) and H (head_dim): not at all. Sharding T or S is context parallelism
  (ring / all-to-all attention), which these kernels do not implement.

Three kinds of mesh axes, three mechanisms:

* Explicit axes (``jax.sharding.AxisType.Explicit``): shardings are part of the arrays' types at trace
  time. :func:`local_call` wraps the kernel call in a ``jax.shard_map`` over the axes sharding B and
  the heads, so the kernels trace on per-device shapes. A sharding the kernels cannot keep (T, S or H
  sharded, heads not in whole GQA groups, q and k/v sharded differently) raises a ValueError naming it.
* Auto axes (``jit`` with ``in_shardings``, ``device_put`` with a ``NamedSharding``): shardings are
  chosen by the compiler after tracing. The forward and backward kernel calls are each wrapped in
  ``jax.experimental.custom_partitioning`` (:func:`forward`, :func:`backward`): a Shardy sharding rule
  relates the operands' axes, and at compile time the partition callback keeps the B and head
  shardings and runs the kernel on the local blocks. A sharding it cannot keep is gathered by XLA
  before the kernel (correct, but every device then holds the gathered axis) and a UserWarning names
  it: an exception raised inside the compiler's callback would reach the user as an opaque runtime
  error.
* Manual axes (inside ``shard_map`` or ``pmap``): the arrays are already per-device blocks and both
  mechanisms step aside (``custom_partitioning`` lowers its body directly there).

Under ``vmap`` the partitioned calls batch as the plain kernels do (their ``custom_vmap`` rule maps the
plain kernel), and their derivatives are those of the plain kernels (a ``custom_jvp`` whose rule is
the plain kernel's JVP), so second-order and forward-mode errors are unchanged. A vmapped call does
not get the partitioning rule: XLA's default (gather) applies there.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Mapping, Sequence

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

AxisNames = tuple[str, ...]

# --- the plan: which mesh axes shard B and the heads, and what cannot be kept ---------------------


def _axes(entry) -> AxisNames:
  """The mesh axis names of one PartitionSpec entry (None, a name, or a tuple of names)."""
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _entries(spec, ndim: int) -> list[AxisNames]:
  """Per array dimension, the mesh axes sharding it (a spec may be shorter than the rank)."""
  spec = tuple(spec) if spec is not None else ()
  return [_axes(spec[i]) if i < len(spec) else () for i in range(ndim)]


def _entry(axes: AxisNames):
  """The PartitionSpec entry for ``axes``: None, one name, or a tuple of names."""
  return None if not axes else axes[0] if len(axes) == 1 else axes


def _show(axes: AxisNames) -> str:
  return ", ".join(repr(a) for a in axes)


@dataclasses.dataclass(frozen=True)
class Plan:
  """How a call is split over the mesh.

  Attributes:
    batch: mesh axes sharding B of every operand (``()``: B replicated).
    heads: mesh axes sharding N of q and K of k/v alike (``()``: heads replicated).
    problems: one sentence for each input sharding the kernels cannot keep (it is replicated
      instead: gathered under Auto axes, an error under Explicit axes).
  """

  batch: AxisNames
  heads: AxisNames
  problems: tuple[str, ...]

  @property
  def axes(self) -> AxisNames:
    return self.batch + self.heads

  def bthh(self) -> P:
    """Spec of q/out/dout ``[B, T, N, H]`` and k/v/dk/dv ``[B, S, K, H]``."""
    return P(_entry(self.batch), None, _entry(self.heads), None)

  def bnt(self) -> P:
    """Spec of the kernels' lse/dlse ``[B, N, T]``."""
    return P(_entry(self.batch), _entry(self.heads), None)

  def btn(self) -> P:
    """Spec of the public lse ``[B, T, N]``."""
    return P(_entry(self.batch), None, _entry(self.heads))


def plan(axis_sizes: Mapping[str, int], q_shape: Sequence[int], k_shape: Sequence[int], q_spec,
         k_spec, v_spec) -> Plan:
  """The local split of a call with q ``[B, T, N, H]`` and k/v ``[B, S, K, H]`` sharded by the given
  PartitionSpecs over a mesh with ``axis_sizes``.

  B and the heads keep the sharding of q (or of k/v where q's is replicated); everything else the
  kernels cannot split is reported in ``problems`` and replicated.
  """
  b, n, kh = q_shape[0], q_shape[2], k_shape[2]
  named = {"query": _entries(q_spec, 4), "key": _entries(k_spec, 4), "value": _entries(v_spec, 4)}
  problems = []
  for name, dims in named.items():
    seq = "T" if name == "query" else "S"
    if dims[1]:
      problems.append(
          f"{name} is sharded along its sequence axis {seq} (dim 1) over mesh axes "
          f"({_show(dims[1])}): context parallelism (a sequence-sharded attention) is not supported")
    if dims[3]:
      problems.append(f"{name} is sharded along head_dim H (dim 3) over mesh axes "
                      f"({_show(dims[3])}): each kernel tile needs whole rows of H")

  def size(axes: AxisNames) -> int:
    return math.prod(axis_sizes[a] for a in axes)

  def pick(dim: int) -> AxisNames:
    return next((dims[dim] for dims in named.values() if dims[dim]), ())

  batch = first_batch = pick(0)
  if batch and b % size(batch):
    problems.append(f"the batch axis B={b} is sharded over mesh axes ({_show(batch)}) of "
                    f"{size(batch)} devices, which do not divide it")
    batch = ()
  heads = first_heads = pick(2)
  if heads and set(heads) & set(batch):
    problems.append(f"mesh axes ({_show(heads)}) shard the heads of one operand and the batch axis "
                    "of another")
    heads = ()
  if heads and kh % size(heads):
    problems.append(
        f"the heads are sharded over mesh axes ({_show(heads)}) of {size(heads)} devices, but the "
        f"K={kh} key/value heads do not split into {size(heads)} equal parts: each device must hold "
        f"whole GQA groups ({n // kh} query heads per KV head), so K must be a multiple of the "
        "number of devices sharding the heads")
    heads = ()
  for name, dims in named.items():
    for dim, first, what in ((0, first_batch, "batch axis B"), (2, first_heads, "head axis")):
      if dims[dim] and dims[dim] != first:
        problems.append(f"{name} is sharded along its {what} (dim {dim}) over mesh axes "
                        f"({_show(dims[dim])}), unlike query/key ({_show(first)})")
  return Plan(batch, heads, tuple(dict.fromkeys(problems)))


# --- Explicit mesh axes: shard_map at trace time --------------------------------------------------


def _explicit_spec(x) -> tuple[object, P] | None:
  """(abstract mesh, spec over its Explicit axes) of ``x``'s type, or None when none shards it."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or not getattr(mesh, "axis_names", ()):
    return None
  explicit = {a for a, t in zip(mesh.axis_names, mesh.axis_types)
              if t == jax.sharding.AxisType.Explicit}
  dims = _entries(sharding.spec, x.ndim)
  kept = [tuple(a for a in d if a in explicit) for d in dims]
  if not any(kept):
    return None
  return mesh, P(*map(_entry, kept))


def local_call(fn: Callable, q, k, v):
  """``fn(q, k, v) -> (out [B, T, N, H], lse [B, T, N])``, run per device when Explicit mesh axes
  shard q/k/v (a ``shard_map`` over the axes that shard B and the heads); ``fn(q, k, v)`` otherwise.

  Raises:
    ValueError: an Explicit axis shards T, S or H, splits GQA groups, or shards q and k/v unlike.
  """
  found = [_explicit_spec(x) for x in (q, k, v)]
  if not any(found):
    return fn(q, k, v)
  mesh = next(f[0] for f in found if f)
  specs = [f[1] if f else P() for f in found]
  p = plan(dict(zip(mesh.axis_names, mesh.axis_shape)), q.shape, k.shape, *specs)
  if p.problems:
    raise ValueError(
        "flash_attention cannot run these Explicit-sharded inputs locally: " + "; ".join(p.problems)
        + ". Shard only the batch axis B and/or the heads (N of query, K of key/value, K a multiple "
        "of the devices sharding them), e.g. jax.sharding.reshard(x, P('data', None, None, None)).")
  spec = p.bthh()
  # Operands replicated where the plan shards them are sliced locally (no communication).
  q, k, v = (x if s == spec else jax.sharding.reshard(x, NamedSharding(mesh, spec))
             for x, s in zip((q, k, v), specs))
  # check_vma=False: every operand varies over every axis of the shard_map (they share one spec), so
  # there is no replication to check; the Triton kernels in interpret mode are not VMA-typed inside.
  return jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, p.btn()),
                       axis_names=frozenset(p.axes), check_vma=False)(q, k, v)


# --- Auto mesh axes: custom_partitioning around each kernel call ----------------------------------


def _auto_plan(mesh, arg_shapes) -> Plan:
  """The plan from the shardings the compiler proposes for q, k, v (the first three operands),
  warning about every sharding the kernels cannot keep (XLA gathers it)."""
  q, k, v = arg_shapes[:3]
  if not all(isinstance(a.sharding, NamedSharding) for a in (q, k, v)):
    # No mesh to read the shardings against (e.g. GSPMD shardings without a mesh): replicate.
    warnings.warn("flash_attention: the inputs' shardings name no mesh, so XLA gathers them and "
                  "every device computes the whole call", stacklevel=2)
    return Plan((), (), ("no mesh",))
  p = plan(dict(mesh.shape), q.shape, k.shape, *(a.sharding.spec for a in (q, k, v)))
  if p.problems:
    warnings.warn(
        "flash_attention: " + "; ".join(p.problems) + ". XLA gathers these axes so that every "
        "device holds them whole before the kernel runs; shard only the batch axis B and/or the "
        "heads to run it locally.", stacklevel=2)
  return p


def _partition_forward(kernel, st, mesh, arg_shapes, result_shape):
  del result_shape
  p = _auto_plan(mesh, arg_shapes)
  io, lse = NamedSharding(mesh, p.bthh()), NamedSharding(mesh, p.bnt())
  return mesh, lambda q, k, v: kernel(q, k, v, st), (io, lse), (io, io, io)


def _partition_backward(kernel, st, mesh, arg_shapes, result_shape):
  del result_shape
  p = _auto_plan(mesh, arg_shapes)
  io, lse = NamedSharding(mesh, p.bthh()), NamedSharding(mesh, p.bnt())
  return (mesh, lambda *arrays: tuple(kernel(st, *arrays)), (io, io, io),
          (io, io, io, io, lse, io, lse))


# Shardy sharding rules. The query heads N and the KV heads K are separate factors: relating them as
# N = (K G) would let propagation split K over part of a mesh axis (K % devices != 0), a sharding no
# PartitionSpec can name; the partition callback shards K with N itself. T, S and H must stay whole.
_Q, _KV, _LSE = "b t n h", "b s k h", "b n t"  # q/out/dout; k/v; lse/dlse [B, N, T]
_WHOLE = ("t", "h", "s")  # need-replication factors, in the order the rule first names them
_FORWARD_RULE = f"{_Q}, {_KV}, {_KV} -> {_Q}, {_LSE}"  # q, k, v -> out, lse
# q, k, v, out, lse, dout, dlse -> dq, dk, dv
_BACKWARD_RULE = f"{_Q}, {_KV}, {_KV}, {_Q}, {_LSE}, {_Q}, {_LSE} -> {_Q}, {_KV}, {_KV}"


@functools.partial(custom_partitioning, static_argnums=(0, 1))
def _forward_partitioned(kernel, st, q, k, v):
  return kernel(q, k, v, st)


@functools.partial(custom_partitioning, static_argnums=(0, 1))
def _backward_partitioned(kernel, st, *arrays):
  return tuple(kernel(st, *arrays))


_forward_partitioned.def_partition(_partition_forward, sharding_rule=_FORWARD_RULE,
                                   need_replication_factors=_WHOLE)
_backward_partitioned.def_partition(_partition_backward, sharding_rule=_BACKWARD_RULE,
                                    need_replication_factors=_WHOLE)


def _wrap(plain: Callable, partitioned: Callable, *arrays):
  """``partitioned(*arrays)``, which batches (vmap) and differentiates (jvp) as ``plain`` does:
  ``custom_partitioning`` has neither rule of its own."""

  @jax.custom_batching.custom_vmap
  def call(*xs):
    return partitioned(*xs)

  @call.def_vmap
  def _vmap(axis_size, in_batched, *xs):
    del axis_size
    outs = jax.vmap(plain, in_axes=tuple(0 if b else None for b in in_batched))(*xs)
    return outs, jax.tree.map(lambda _: True, outs)

  @jax.custom_jvp
  def differentiable(*xs):
    return call(*xs)

  @differentiable.defjvp
  def _jvp(primals, tangents):
    return jax.jvp(plain, primals, tangents)

  return differentiable(*arrays)


def forward(kernel: Callable, q, k, v, st):
  """``kernel(q, k, v, st) -> (out, lse [B, N, T])``, partitioned over Auto mesh axes along B and
  the heads."""
  return _wrap(lambda q, k, v: kernel(q, k, v, st),
               functools.partial(_forward_partitioned, kernel, st), q, k, v)


def backward(kernel: Callable, st, q, k, v, out, lse, dout, dlse):
  """``kernel(st, q, k, v, out, lse, dout, dlse) -> (dq, dk, dv)``, partitioned like
  :func:`forward`."""
  return _wrap(lambda *a: tuple(kernel(st, *a)),
               functools.partial(_backward_partitioned, kernel, st), q, k, v, out, lse, dout, dlse)
