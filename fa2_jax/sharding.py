"""Sharded inputs under ``jax.jit``: every device runs the kernels on its own batch rows and heads,
and a sequence-sharded call runs as context parallelism.

Attention is independent across the batch axis B and across key/value-head groups (query head ``n``
reads KV head ``n // G``, ``G = N / K``), so a call whose q/k/v are sharded along B and/or the heads
runs locally on each device with no collective, forward and backward. Left alone, XLA cannot see into
a Pallas call and all-gathers q/k/v around it (every device computes the whole batch); under an
Explicit-axes mesh the kernels' refs refuse sharded slicing outright. Which mesh axes may shard what:

* B (dim 0 of every operand): any mesh axes whose devices divide B.
* The heads (N of q, K of k/v, alike): mesh axes over ``d`` devices with ``K % d == 0``, so that each
  device holds whole GQA groups (its query heads and the KV heads they read).
* T and S (the sequence axes), alike: one mesh axis (not a tuple of axes) of ``C`` devices, none of
  B's or the heads', dividing T and S. The call runs as context parallelism over it
  (:mod:`fa2_jax.context_parallel`): device ``d`` holds the contiguous chunk ``d`` of the natural
  order (``layout="contiguous"``), segment ids travel with their chunks, lengths and ``q_offset``
  stay global; ``context_parallel_strategy`` picks the strategy (``backend_for`` names it under
  Explicit axes). Only T (or only S) sharded: the replicated one is sliced to match (no
  communication), so that case runs the same way. A causal call from ``BALANCE_MIN_ROWS`` rows
  per device runs in the zigzag layout, its chunks moved there and back by ``ppermute``
  (``context_parallel._balances``); tokens laid out in zigzag order once (``to_context_layout``)
  and ``context_parallel_attention`` inside a ``shard_map`` save those exchanges.
* H and Hv (the query/key and value head_dims): none.
* Neither B nor the heads where the call's ``mask_fn``/``score_fn`` reads that index: the kernels pass
  the index of their grid, which on a device's share counts from 0 (``whole`` of :func:`plan`).

One plan (:func:`plan`) decides from the operands' PartitionSpecs; three kinds of mesh axes get it
applied three ways:

* Explicit axes (``jax.sharding.AxisType.Explicit``): shardings are part of the arrays' types at trace
  time. :func:`local_call` wraps the kernel call in a ``jax.shard_map`` with the plan's specs, so the
  kernels trace on per-device shapes; a sequence-sharded call's ``shard_map`` runs
  ``context_parallel_attention`` instead (``context_parallel.explicit_call``), whose gradients are
  its own. A sharding the plan cannot keep (H sharded, heads not in whole GQA groups, the sequence
  over several axes or axes not dividing it, operands sharded unlike each other) raises a
  ValueError naming it.
* Auto axes (``jit`` with ``in_shardings``, ``device_put`` with a ``NamedSharding``): shardings are
  chosen by the compiler after tracing. The forward and backward kernel calls are each wrapped in
  ``jax.experimental.custom_partitioning`` (:func:`partitioned`): a Shardy rule names each operand's
  axes, and at compile time the partition callback applies the plan to the shardings the compiler
  proposes and runs the kernel on the local blocks. Where the sequence is sharded the callbacks run
  context parallelism (:class:`Context`) with collectives over that mesh axis name: the forward's
  strategy, returning the kernels' ``(out, stats)`` with the whole softmax's row statistics, and
  from them the ring's backward (the all_gather strategy's where the forward gathered). T and S
  are therefore free factors of the Shardy rule (ALiBi slopes included: the stats carry the kernels'
  row shift, and a backward asked for the slopes' gradient returns their per-row sums). A sharding
  the plan cannot keep (also: a sequence-sharded call on the decode kernels) is gathered by XLA
  before the kernel (correct, but every device then holds that axis whole) and a UserWarning names
  it: an exception inside the compiler's callback would reach the user as an opaque error.
* Manual axes (inside ``shard_map`` or ``pmap``): the arrays are already per-device blocks; both
  mechanisms step aside (``custom_partitioning`` lowers its body directly there).

Operands are described by layouts, one letter per dimension: ``b`` batch, ``t`` query sequence, ``s``
key sequence, ``n`` query heads, ``k`` KV heads, ``h`` head_dim, ``v`` the value's head_dim (which
may differ: out and dout ``"btnv"``), ``x`` the two row statistics (q ``"btnh"``, k ``"bskh"``, v
``"bskv"``, the forward's row statistics ``"bnxt"``, the lse cotangent ``"bnt"``).
An operand the kernels gain later (lengths ``"b"``, segment ids ``"bt"``/``"bs"``, per-head slopes
``"n"``, a scalar ``""``) is sharded by the same plan through its layout.

Under ``vmap`` the partitioned calls fold the mapped axis into B (their ``custom_vmap`` rule; over
Explicit axes through :func:`local_call`), so a mapped axis sharded like B runs locally too; where a
``mask_fn``/``score_fn`` reads the batch index (which folding would change) they map the plain
kernel, which XLA partitions by gathering (Explicit axes: a ValueError).
Limits: the partitioned calls' derivatives are those of the plain kernels (a ``custom_jvp`` whose rule is the plain kernel's JVP), so
second-order and forward-mode errors are unchanged. On a mesh mixing Explicit and Auto axes the
``shard_map`` covers every axis, so what the Auto axes shard is gathered there. ``jax.export`` of a
call sharded over Auto axes fails ("serialization of host_callbacks is not yet implemented": the
partition callback is Python); exporting it with Explicit axes (or inside a ``shard_map``) works, and
single-device exports are unaffected.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Mapping, Sequence

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from .kernels.batching import fold_mapped, unfold_mapped

AxisNames = tuple[str, ...]

# Layouts of the kernels' operands, one letter per dimension (see the module docstring).
Q = "btnh"  # q, dq: [B, T, N, H]
KV = "bskh"  # k, dk: [B, S, K, H]
O = "btnv"  # out, dout: [B, T, N, Hv] (Hv: the value's head_dim, H or another)
V = "bskv"  # v, dv: [B, S, K, Hv]
LSE = "bnt"  # the kernels' lse cotangent dlse: [B, N, T]
STATS = "bnxt"  # the forward's row statistics (r, l): [B, N, 2, T] (kernels/softmax.py)
LSE_PUBLIC = "btn"  # flash_attention's lse: [B, T, N]
QKV_NAMES = ("query", "key", "value")
_WHAT = {"b": "batch axis B", "t": "sequence axis T", "s": "sequence axis S", "n": "heads",
         "k": "heads", "h": "head_dim H", "v": "value head_dim Hv"}
_WHOLE = "hvx"  # letters no mesh axis may shard


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
  return f"mesh axis {axes[0]!r}" if len(axes) == 1 else f"mesh axes {tuple(axes)!r}"


@dataclasses.dataclass(frozen=True)
class Plan:
  """How a call is split over the mesh.

  Attributes:
    batch: mesh axes sharding B of every operand (``()``: B replicated).
    heads: mesh axes sharding N of q and K of k/v alike (``()``: heads replicated).
    problems: one sentence for each input sharding the kernels cannot keep (the plan replicates
      that axis instead: gathered under Auto axes, an error under Explicit axes).
    context: the mesh axis (one name) sharding T of q and S of k/v alike: the call runs as context
      parallelism over it (``fa2_jax.context_parallel``); ``()``: none.
  """

  batch: AxisNames
  heads: AxisNames
  problems: tuple[str, ...] = ()
  context: AxisNames = ()

  @property
  def axes(self) -> AxisNames:
    return self.batch + self.heads + self.context

  def spec(self, layout: str) -> P:
    """The PartitionSpec of an operand with this layout (e.g. ``Q``, ``KV``, ``LSE``)."""
    return P(*(_entry(self.batch) if c == "b" else _entry(self.heads) if c in "nk"
               else _entry(self.context) if c in "ts" else None for c in layout))


def plan(axis_sizes: Mapping[str, int], shapes: Sequence[Sequence[int]], specs: Sequence,
         layouts: Sequence[str] = (Q, KV, V), names: Sequence[str] = QKV_NAMES,
         whole: Mapping[str, str] | None = None, whole_head_dims: bool = True) -> Plan:
  """The local split of a call whose operands (shapes, layouts, names for the messages) are sharded
  by ``specs`` over a mesh with ``axis_sizes``; the first three operands are q, k, v.

  B and the heads keep the first sharding found among the operands (q's, else k's, ...); the
  sequence (T of q, S of k/v: context parallelism) the first one among q, k, v, which must be one
  mesh axis, none of B's or the heads', dividing T and S; an operand replicated where the plan
  shards is sliced locally. Whatever cannot be split is reported in ``problems`` and replicated.
  ``whole``: ``"b"`` (B), ``"n"`` (the heads) and/or ``"t"`` (the sequence) that this call cannot
  split, each with the reason (e.g. a ``mask_fn`` that reads the batch index).
  ``whole_head_dims=False``: H and Hv may be sharded (the XLA formula contracts them across
  devices; a kernel tile needs them whole).
  """
  whole = whole or {}
  dims = [_entries(spec, len(layout)) for spec, layout in zip(specs, layouts)]
  problems = [f"{name} is sharded along {_WHAT[c]} (dim {i}) over {_show(d[i])}: each kernel tile "
              f"needs whole rows of {_WHAT[c].split()[-1]}"
              for name, layout, d in zip(names, layouts, dims)
              for i, c in enumerate(layout) if c in "hv" and d[i] and whole_head_dims]
  if not whole_head_dims:  # the formula: q K^T contracts H, which JAX's Explicit rules cannot
    h_of = [set(d[layout.index("h")]) for layout, d in zip(layouts[:2], dims[:2]) if "h" in layout]
    both = sorted(set.intersection(*h_of)) if len(h_of) == 2 else []  # split in q and k alike
    if both:
      problems.append(f"query and key are both sharded along head_dim H over {_show(tuple(both))}: "
                      "the formula's q K^T would contract it across devices")

  def size(axes: AxisNames) -> int:
    return math.prod(axis_sizes[a] for a in axes)

  def first(letters: str, count: int | None = None) -> tuple[AxisNames, str]:
    """The first sharding of a dimension named by ``letters`` (among the first ``count`` operands),
    and whose it is."""
    return next(((d[i], name) for name, layout, d in list(zip(names, layouts, dims))[:count]
                 for i, c in enumerate(layout) if c in letters and d[i]), ((), ""))

  def extent(letter: str) -> int | None:
    return next((shape[layout.index(letter)] for shape, layout in zip(shapes, layouts)
                 if letter in layout), None)

  (batch, batch_of), (heads, heads_of) = first("b"), first("nk")
  context, context_of = first("ts", 3)
  for name, layout, d in zip(names, layouts, dims):
    for i, c in enumerate(layout):
      want, of = ((batch, batch_of) if c == "b" else (heads, heads_of) if c in "nk"
                  else (context, context_of) if c in "ts" else ((), ""))
      if c in "bnkts" and d[i] and d[i] != want:
        what = f"its {_WHAT[c]}" if c in "bts" else _WHAT[c]
        problems.append(f"{name} is sharded along {what} (dim {i}) over {_show(d[i])}, but "
                        + (f"{of} over {_show(want)}" if want else
                           "query, key and value are not sharded along their sequence axes"))
  b = extent("b")
  if batch and b is not None and b % size(batch):
    problems.append(f"the batch axis B={b} is sharded over {_show(batch)} ({size(batch)} devices), "
                    "which does not divide it")
    batch = ()
  if batch and "b" in whole:
    problems.append(f"the batch axis B is sharded over {_show(batch)}, but {whole['b']}")
    batch = ()
  if heads and "n" in whole:
    problems.append(f"the heads are sharded over {_show(heads)}, but {whole['n']}")
    heads = ()
  if heads and set(heads) & set(batch):
    problems.append(f"{_show(heads)} shards the heads of {heads_of} and the batch axis of {batch_of}")
    heads = ()
  n, kh = extent("n"), extent("k")
  kh = n if kh is None else kh
  if heads and kh is not None and kh % size(heads):
    group = f" ({n // kh} query heads per KV head)" if n and n != kh else ""
    problems.append(
        f"the heads are sharded over {_show(heads)} ({size(heads)} devices), but the K={kh} "
        f"key/value heads do not split into {size(heads)} equal parts: each device must hold whole "
        f"GQA groups{group}, so K must be a multiple of the number of devices sharding the heads")
    heads = ()
  if context:
    seq = (f"{context_of} is sharded along its sequence axis {'T' if context_of == 'query' else 'S'}"
           f" over {_show(context)}")
    t, s = extent("t"), extent("s")
    why = None
    if len(context) > 1:
      why = ("context parallelism runs over one mesh axis: shard the sequence over one (or "
             "reshard it to replicated)")
    elif set(context) & set(batch + heads):
      why = "that axis also shards the batch axis B or the heads"
    elif any(x is not None and x % size(context) for x in (t, s)):
      why = (f"its {size(context)} devices do not divide T={t} and S={s} (context parallelism cuts "
             "both into equal chunks; pad them and pass the lengths)")
    elif "t" in whole:
      why = whole["t"]
    if why is not None:
      problems.append(f"{seq}, but {why}")
      context = ()
  return Plan(batch, heads, tuple(dict.fromkeys(problems)), context)


# --- Explicit mesh axes: shard_map at trace time --------------------------------------------------


def _explicit_spec(x) -> tuple[object, P] | None:
  """(abstract mesh, spec over its Explicit axes) of ``x``'s type (a ``jax.ShapeDtypeStruct``: its
  sharding), or None when none shards it."""
  sharding = (x.sharding if isinstance(x, jax.ShapeDtypeStruct)
              else getattr(jax.typeof(x), "sharding", None))
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or not getattr(mesh, "axis_names", ()):
    return None
  explicit = {a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit}
  kept = [tuple(a for a in d if a in explicit) for d in _entries(sharding.spec, x.ndim)]
  if not any(kept):
    return None
  return mesh, P(*map(_entry, kept))


def explicit_plan(arrays: Sequence, layouts: Sequence[str] = (Q, KV, V),
                  names: Sequence[str] = QKV_NAMES, whole: Mapping[str, str] | None = None,
                  whole_head_dims: bool = True):
  """``(mesh, specs, plan)`` of operands that Explicit mesh axes shard (their specs over those axes
  and the :func:`plan` of them), or None when none does. ``arrays`` start with q, k, v (arrays, or
  ``jax.ShapeDtypeStruct`` with a sharding); ``whole``: as for :func:`plan`."""
  found = [_explicit_spec(x) for x in arrays]
  if not any(found):
    return None
  mesh = next(f[0] for f in found if f)
  specs = [f[1] if f else P() for f in found]
  return mesh, specs, plan(dict(mesh.shape), [x.shape for x in arrays], specs, layouts, names,
                           whole, whole_head_dims)


def refusal(problems: Sequence[str]) -> ValueError:
  """The error for Explicit-sharded inputs the plan cannot keep (its ``problems``)."""
  return ValueError(
      "flash_attention cannot run these Explicit-sharded inputs: " + "; ".join(problems)
      + ". Shard the batch axis B, the heads (N of query, K of key/value, K a multiple of the "
      "devices sharding them) and the sequence (T of query and S of key/value over one mesh axis "
      "dividing both: context parallelism), alike in query, key and value, and neither B nor the "
      "heads where a mask_fn/score_fn reads its index; jax.sharding.reshard the other axes to "
      "replicated.")


def shard_map_call(fn: Callable, mesh, p: Plan, arrays: Sequence, specs: Sequence,
                   layouts: Sequence[str], out_layouts: Sequence[str]):
  """``fn`` on each device's blocks of ``arrays`` (a ``jax.shard_map`` over every mesh axis not
  already manual) as plan ``p`` splits them; an operand replicated where the plan shards it is
  sliced locally (no communication)."""
  in_specs = tuple(p.spec(layout) for layout in layouts)
  arrays = [x if _entries(s, x.ndim) == _entries(want, x.ndim)
            else jax.sharding.reshard(x, NamedSharding(mesh, want))
            for x, s, want in zip(arrays, specs, in_specs)]
  # Over every mesh axis not already manual: over fewer, the kernels' custom_partitioning would meet a
  # partially manual partitioner. The operands vary over the plan's axes and are replicated over the
  # others, whose devices compute the same blocks. check_vma=False: the kernels in interpret mode are
  # not typed for varying manual axes.
  free = frozenset(a for a, t in zip(mesh.axis_names, mesh.axis_types) if t != AxisType.Manual)
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs,
                       out_specs=tuple(p.spec(layout) for layout in out_layouts),
                       axis_names=free, check_vma=False)(*arrays)


def local_call(fn: Callable, arrays: Sequence, layouts: Sequence[str] = (Q, KV, V),
               out_layouts: Sequence[str] = (O, LSE_PUBLIC), names: Sequence[str] = QKV_NAMES,
               whole: Mapping[str, str] | None = None):
  """``fn(*arrays)``, run per device (a ``shard_map``) when Explicit mesh axes shard the arrays' B
  or heads; called as is otherwise. ``arrays`` start with q, k, v; ``fn`` returns arrays of
  ``out_layouts``; ``whole``: as for :func:`plan`. A sequence-sharded call does not come here:
  ``flash_attention`` runs it as context parallelism (``fa2_jax.context_parallel``).

  Raises:
    ValueError: an Explicit axis shards T, S or H, splits GQA groups, shards operands unalike, or
      shards an axis named in ``whole``.
  """
  found = explicit_plan(arrays, layouts, names, {"t": "this call runs on whole sequences",
                                                 **(whole or {})})
  if found is None:
    return fn(*arrays)
  mesh, specs, p = found
  if p.problems:
    raise refusal(p.problems)
  return shard_map_call(fn, mesh, p, arrays, specs, layouts, out_layouts)


# --- Auto mesh axes: custom_partitioning around each kernel call ----------------------------------


@dataclasses.dataclass(frozen=True)
class Context:
  """How a partitioned call runs where the compiler shards its sequence (T of q and S of k/v over one
  mesh axis): ``fn(axis_name, *arrays)`` computes the call's results on each device's chunks with
  collectives over ``axis_name`` (``fa2_jax.context_parallel``), reading the first ``reads``
  operands (the others, the block-range tables of the whole call, stay as the compiler proposes
  them); ``refusal``: why this call cannot, or None (a refused call's sequence is gathered, with a
  warning). ``fn`` is part of a static argument: hashable."""

  fn: Callable
  reads: int = 0
  refusal: str | None = None


def _auto_plan(mesh, arg_shapes, layouts, whole=()) -> Plan:
  """The plan from the shardings the compiler proposes for q, k, v (the first three operands: the
  others, such as the backward's dout, are resharded to match), warning about every sharding the
  kernels cannot keep (XLA gathers it)."""
  qkv = arg_shapes[:3]
  if not all(isinstance(a.sharding, NamedSharding) for a in qkv):
    # No mesh to read the shardings against (GSPMD shardings without one): replicate.
    warnings.warn("flash_attention: the inputs' shardings name no mesh, so XLA gathers them and "
                  "every device computes the whole call")
    return Plan((), ())
  p = plan(dict(mesh.shape), [a.shape for a in qkv], [a.sharding.spec for a in qkv], layouts[:3],
           whole=dict(whole))
  if p.problems:
    warnings.warn(
        "flash_attention: " + "; ".join(p.problems) + ". XLA gathers these axes so that every "
        "device holds them whole before the kernel runs; shard only the batch axis B, the heads "
        "and/or the sequence (T and S alike, over one mesh axis) to run it without gathering.")
  # Segment ids ("bt", "bs") follow the plan of q, k, v; one sharded along its sequence axis unlike
  # them is gathered (as are the block ranges computed from it before the kernel), which no check
  # above sees.
  for a, layout in zip(arg_shapes[3:], layouts[3:]):
    if layout in ("bt", "bs") and isinstance(a.sharding, NamedSharding):
      if _entries(a.sharding.spec, len(layout))[1] not in ((), p.context):
        warnings.warn(
            f"flash_attention: the segment ids are sharded along their sequence axis "
            f"{layout[1].upper()} unlike query/key/value: XLA gathers them (and the block ranges "
            "computed from them); shard them like the batch and sequence axes of query/key/value.")
        break
  return p


def _partition(fn, in_layouts, out_layouts, whole, context, mesh, arg_shapes, result_shape):
  del result_shape
  whole = dict(whole)
  if context is None or context.refusal is not None:
    whole["t"] = "this call runs on whole sequences" if context is None else context.refusal
  p = _auto_plan(mesh, arg_shapes, in_layouts, whole)
  shard = lambda layout: NamedSharding(mesh, p.spec(layout))
  ins = tuple(map(shard, in_layouts))
  if not p.context:
    return mesh, lambda *arrays: tuple(fn(*arrays)), tuple(map(shard, out_layouts)), ins
  # Context parallelism over the sequence's mesh axis: the operands it reads as the plan splits
  # them (segment ids with their tokens), the tables it does not read as they come.
  axis = p.context[0]
  ins = ins[:context.reads] + tuple(a.sharding if isinstance(a.sharding, NamedSharding) else s
                                    for a, s in zip(arg_shapes[context.reads:],
                                                    ins[context.reads:]))
  return (mesh, lambda *arrays: tuple(context.fn(axis, *arrays)), tuple(map(shard, out_layouts)),
          ins)


def _rule(fn, in_layouts, out_layouts, whole, context, mesh, value_types, result_types):
  """The Shardy rule, e.g. ``b t n h, b s k h, b s k v -> b t n v, b n x t``. The query heads N and
  the KV heads K are separate factors: relating them as N = (K G) would let propagation split K over
  part of a mesh axis (K % devices != 0), a sharding no PartitionSpec names; the partition callback
  shards K with N itself. H and the value's Hv are separate factors too (their sizes may differ).
  H, Hv and the statistics' axis must stay whole (need-replication factors, listed in the order the
  rule first names them, as Shardy requires); T and S may be sharded (context parallelism, or
  gathered by the callback's plan)."""
  del fn, whole, context, mesh, value_types, result_types
  side = lambda layouts: ", ".join(" ".join(layout) for layout in layouts)
  order = dict.fromkeys("".join((*in_layouts, *out_layouts)))
  return (f"{side(in_layouts)} -> {side(out_layouts)}",
          dict(need_replication_factors=tuple(c for c in order if c in _WHOLE)))


@functools.partial(custom_partitioning, static_argnums=(0, 1, 2, 3, 4))
def _partitioned(fn, in_layouts, out_layouts, whole, context, *arrays):
  del in_layouts, out_layouts, whole, context
  return tuple(fn(*arrays))


_partitioned.def_partition(_partition, sharding_rule=_rule)


def partitioned(fn: Callable, arrays: Sequence, in_layouts: Sequence[str],
                out_layouts: Sequence[str], whole: Mapping[str, str] | None = None,
                fold_vmap: bool = False, context: Context | None = None):
  """``fn(*arrays)`` (a tuple of arrays of ``out_layouts``), partitioned over Auto mesh axes by the
  plan of q, k, v (``arrays[:3]``; ``whole`` as for :func:`plan`: gathered, with a warning). It
  differentiates (jvp) as ``fn`` does: ``custom_partitioning`` has no rule of its own. Under
  ``vmap``: with ``fold_vmap`` (every operand and result has B first, and ``fn`` does not read the
  batch index) the mapped axis folds into B (``[E, B, ...]`` -> ``[E * B, ...]``, unmapped operands
  broadcast), so the call stays partitioned over a mapped axis sharded like B; otherwise ``fn`` is
  mapped as is, which XLA partitions by gathering. ``fn`` is a static argument: hashable."""
  in_layouts, out_layouts = tuple(in_layouts), tuple(out_layouts)
  whole = tuple(sorted((whole or {}).items()))  # a static argument: hashable
  fold = fold_vmap and all(layout.startswith("b") for layout in (*in_layouts, *out_layouts))

  @jax.custom_batching.custom_vmap
  def call(*xs):
    return _partitioned(fn, in_layouts, out_layouts, whole, context, *xs)

  @call.def_vmap
  def _vmap(axis_size, in_batched, *xs):
    if not fold:
      if any(_explicit_spec(x) for x, mapped in zip(xs, in_batched) if mapped):
        raise ValueError(
            "flash_attention under vmap over an axis sharded over Explicit mesh axes runs per "
            "device by folding the mapped axis into the batch axis B, which would change the batch "
            "index that the mask_fn/score_fn reads: reshard the mapped axis to replicated "
            "(jax.sharding.reshard), or use implementation='xla'")
      outs = jax.vmap(fn, in_axes=tuple(0 if b else None for b in in_batched))(*xs)
      return outs, jax.tree.map(lambda _: True, outs)
    xs = fold_mapped(axis_size, in_batched, xs)  # [E, B, ...] -> [E * B, ...]
    if any(_explicit_spec(x) for x in xs):  # a mapped axis sharded over Explicit axes: per device
      names = (*QKV_NAMES, *(f"operand {i}" for i in range(3, len(xs))))
      outs = local_call(call, xs, in_layouts, out_layouts, names, dict(whole))
    else:
      outs = call(*xs)
    outs = unfold_mapped(axis_size, outs)
    return outs, tuple(True for _ in outs)

  @jax.custom_jvp
  def differentiable(*xs):
    return call(*xs)

  @differentiable.defjvp
  def _jvp(primals, tangents):
    return jax.jvp(fn, primals, tangents)

  return differentiable(*arrays)


def forward(kernel: Callable, q, k, v, st, extras=(), extra_layouts=(), partition: bool = True,
            whole: Mapping[str, str] | None = None, fold_vmap: bool = False,
            context: Context | None = None):
  """``kernel(q, k, v, extras, st) -> (out [B, T, N, Hv], stats [B, N, 2, T])``, partitioned; ``extras``
  (the variant operands) are sharded by their ``extra_layouts`` (e.g. ``"b"``, ``"bt"``).
  ``partition=False`` calls the kernel as is (kernels that cannot be partitioned, see
  ``attention._partitionable``); ``whole`` as for :func:`plan`; ``fold_vmap`` as for
  :func:`partitioned`; ``context``: how the call runs where the sequence is sharded (None: it is
  gathered, with a warning)."""
  fn = functools.partial(_call_forward, kernel, st)
  if not partition:
    return fn(q, k, v, *extras)
  return partitioned(fn, (q, k, v, *extras), (Q, KV, V, *extra_layouts), (O, STATS), whole,
                     fold_vmap, context)


def backward(kernel: Callable, st, q, k, v, out, stats, dout, dlse, extras=(), extra_layouts=(),
             partition: bool = True, whole: Mapping[str, str] | None = None,
             fold_vmap: bool = False, extra_outputs: Sequence[str] = (),
             context: Context | None = None):
  """``kernel(st, q, k, v, out, stats, dout, dlse, *extras) -> (dq, dk, dv, *more)``, partitioned;
  ``extra_outputs``: the layouts of ``more`` (e.g. the ALiBi slopes' row sums, ``LSE``); the rest
  as for :func:`forward`."""
  fn = functools.partial(_call_backward, kernel, st)
  arrays = (q, k, v, out, stats, dout, dlse, *extras)
  if not partition:
    return fn(*arrays)
  return partitioned(fn, arrays, (Q, KV, V, O, STATS, O, LSE, *extra_layouts),
                     (Q, KV, V, *extra_outputs), whole, fold_vmap, context)


def _call_forward(kernel, st, q, k, v, *extras):
  return tuple(kernel(q, k, v, tuple(extras), st))


def _call_backward(kernel, st, *arrays):
  return tuple(kernel(st, *arrays))
