"""Data and context parallelism over a device mesh (``--mesh data=D,context=C``, or
``--data-parallel mesh``: every device on ``data``), and several processes (``jax.distributed``).

One ``jax.jit`` step over the global batch, as on one device, with shardings instead of a mapped
axis: every ``[B, T]`` array of a batch (tokens, targets, and with ``--packing`` the positions,
segment ids and loss weights) is split along B over the mesh axis ``data`` and along T over
``context`` (a ``NamedSharding``); the parameters and the optimizer state are replicated on every
device, or with ``--fsdp`` sharded over ``data`` (:func:`state_specs`: each array along its largest
dimension that the axis divides). XLA partitions the step: each device runs the model on its rows
and its part of the sequence, and the gradient's mean becomes an all-reduce of the parameter
gradients (with ``--fsdp``: the parameters all-gathered where they are used, the gradients
reduce-scattered to their shards), so the update equals the single-device update on the same
global batch.

The model is written for the whole sequence (global view): positions (``arange(T)`` or the packed
batch's own) and segment ids are arrays of the batch, sharded like the tokens, so learned position
embeddings and rotary angles are those of each token's global position on whatever device holds it.
Only attention mixes the sequence: :func:`context_attention` runs it per device in a ``shard_map``
over the mesh (the one place that knows the context layout), through
``fa2_jax.context_parallel_attention`` (``--context-strategy``: a ring of keys and values, an
all-to-all of heads and sequence, or an all-gather of keys and values), so the causal mask, a
sliding window and the packed documents' segments are those of the whole sequence. The batch's
tokens are laid out in the zigzag order (:data:`LAYOUT`: device ``d`` holds chunks ``d`` and
``2C-1-d`` of ``2C``, so every device does the same causal work), their positions with them; see
docs/design.md, "Context parallelism".

Several processes (``--coordinator HOST:PORT --num-processes N --process-id I``, one per host or per
GPU): :func:`initialize_distributed` calls ``jax.distributed.initialize`` before anything touches a
device; the mesh then spans every process's devices (``jax.devices()``, process-major: ``data``
across processes, ``context`` within one where it divides the local devices). Every process reads
the same data and builds the same global batch from the seed; each places only the blocks its own
devices hold (``jax.make_array_from_callback``).
"""
from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import fa2_jax

DATA, CONTEXT = "data", "context"  # the mesh axes: the batch over DATA, the sequence over CONTEXT
MESH_AXES = (DATA, CONTEXT)
# [B, T] arrays of a batch: rows over DATA, the sequence over CONTEXT.
ROWS = P(DATA, CONTEXT)
# The tokens' order along the sequence on a context mesh (fa2_jax.to_context_layout): "zigzag", device d
# holds chunks d and 2C-1-d of 2C, so that every device does the same causal attention work.
LAYOUT = "zigzag"


# --- the mesh flag --------------------------------------------------------------------------------

def parse_mesh(spec: str) -> dict[str, int]:
  """``"data=2,context=4"`` -> ``{"data": 2, "context": 4}``; either axis may be left out (it takes
  the devices the other leaves: :func:`mesh_axes`).

  Raises:
    ValueError: not ``name=N[,name=N]`` with names from ``data``/``context`` and N >= 1.
  """
  sizes: dict[str, int] = {}
  for item in spec.split(","):
    m = re.fullmatch(r"\s*(\w+)\s*=\s*(\d+)\s*", item)
    if not m:
      raise ValueError(f"--mesh {spec!r}: expected axis=size items separated by commas, e.g. "
                       "data=2,context=2")
    name, size = m.group(1), int(m.group(2))
    if name not in MESH_AXES:
      raise ValueError(f"--mesh {spec!r}: unknown axis {name!r}; the axes are {MESH_AXES}")
    if name in sizes:
      raise ValueError(f"--mesh {spec!r}: axis {name!r} is given twice")
    if size < 1:
      raise ValueError(f"--mesh {spec!r}: axis {name!r} needs a size >= 1, got {size}")
    sizes[name] = size
  return sizes


def mesh_axes(spec: str | None, n_devices: int) -> tuple[tuple[str, int], ...]:
  """The ``((data, D), (context, C))`` sizes of ``--mesh spec`` over ``n_devices`` (every device of
  every process): a missing axis takes ``n_devices`` / the other's size; None (``--data-parallel
  mesh`` alone) puts every device on ``data``.

  Raises:
    ValueError: the sizes do not multiply to ``n_devices``.
  """
  sizes = parse_mesh(spec) if spec is not None else {DATA: n_devices}
  given = int(np.prod(list(sizes.values())))
  if len(sizes) == 1 and n_devices % given == 0:
    missing = next(a for a in MESH_AXES if a not in sizes)
    sizes[missing] = n_devices // given
  if int(np.prod(list(sizes.values()))) != n_devices:
    shown = ",".join(f"{a}={sizes[a]}" for a in MESH_AXES if a in sizes)
    raise ValueError(f"--mesh {shown} covers {int(np.prod(list(sizes.values())))} devices, but "
                     f"there are {n_devices} (every process's); the axis sizes must multiply to "
                     f"{n_devices}")
  return tuple((a, sizes[a]) for a in MESH_AXES)


def describe_mesh(axes: tuple[tuple[str, int], ...]) -> str:
  """``data=2,context=2``."""
  return ",".join(f"{name}={size}" for name, size in axes)


# --- several processes ----------------------------------------------------------------------------

# The environment variables read where a flag is left out (JAX_COORDINATOR_ADDRESS is also
# jax.distributed's own).
DISTRIBUTED_ENV = {"coordinator": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
                   "process_id": "JAX_PROCESS_ID"}


@dataclasses.dataclass(frozen=True)
class Distributed:
  """Where ``jax.distributed`` meets its peers: ``coordinator`` (``HOST:PORT`` of process 0),
  ``num_processes`` and this process's ``process_id``."""

  coordinator: str
  num_processes: int
  process_id: int


def distributed_settings(coordinator: str | None, num_processes: int | None,
                         process_id: int | None, environ=os.environ) -> Distributed | None:
  """The multi-process settings from the flags, else the environment (:data:`DISTRIBUTED_ENV`);
  None when neither names a coordinator (one process).

  Raises:
    ValueError: a coordinator without both counts (or counts without a coordinator), a process id
      outside ``[0, num_processes)``, or a coordinator that is not ``HOST:PORT``.
  """
  flags = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
  values = {}
  for name, value in flags.items():
    if value is None and environ.get(DISTRIBUTED_ENV[name]):
      value = environ[DISTRIBUTED_ENV[name]]
      if name != "coordinator":
        if not value.strip().isdigit():
          raise ValueError(f"{DISTRIBUTED_ENV[name]}={value!r} is not a count")
        value = int(value)
    values[name] = value
  if all(v is None for v in values.values()):
    return None
  missing = [f"--{name.replace('_', '-')} (or {DISTRIBUTED_ENV[name]})"
             for name, v in values.items() if v is None]
  if missing:
    raise ValueError(f"a multi-process run needs --coordinator, --num-processes and --process-id; "
                     f"missing: {', '.join(missing)}")
  if not re.fullmatch(r"\[?[\w.:-]+\]?:\d+", values["coordinator"]):
    raise ValueError(f"--coordinator must be HOST:PORT (process 0's address), got "
                     f"{values['coordinator']!r}")
  if values["num_processes"] < 1:
    raise ValueError(f"--num-processes must be >= 1, got {values['num_processes']}")
  if not 0 <= values["process_id"] < values["num_processes"]:
    raise ValueError(f"--process-id must be in [0, {values['num_processes']}) for "
                     f"--num-processes {values['num_processes']}, got {values['process_id']}")
  return Distributed(**values)


def initialize_distributed(settings: Distributed | None) -> None:
  """``jax.distributed.initialize`` with ``settings`` (None: one process, nothing to do). Call it
  before anything touches a device. CPU processes exchange their collectives through gloo (the
  default of jax 0.11; named here so the choice does not depend on the version)."""
  if settings is None:
    return
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(settings.coordinator, settings.num_processes, settings.process_id)


# --- attention over the context axis --------------------------------------------------------------

def context_attention(mesh: Mesh, strategy: str | None = None,
                      **flash_kwargs) -> Callable[..., jax.Array]:
  """fa2_jax attention ``f(q, k, v, is_causal=..., **variants)`` on q, k, v ``[B, T, N|K, H]``
  split along B over ``data`` and along T over ``context``: context parallelism.

  Per device (a ``shard_map``): ``fa2_jax.context_parallel_attention`` over the ``context`` axis,
  with ``strategy`` (None: fa2_jax's choice) and the :data:`LAYOUT` the batch arrives in
  (:meth:`MeshRunner.shard` lays every ``[B, T]`` array out so), the key segment ids travelling with
  the keys; the causal mask, ``local_window_size`` and the packed documents see global positions. ``flash_kwargs``: further ``flash_attention`` keywords (``implementation``,
  ``interpret``).
  """
  def attend(q, k, v, *, is_causal: bool = False, q_segment_ids=None, kv_segment_ids=None,
             **variants):
    segments = [] if q_segment_ids is None else [q_segment_ids, kv_segment_ids]

    def local(q, k, v, *segments):
      extra = {}
      if segments:
        extra = dict(q_segment_ids=segments[0], kv_segment_ids=segments[1])
      return fa2_jax.context_parallel_attention(
          q, k, v, axis_name=CONTEXT, strategy=strategy, layout=LAYOUT,
          is_causal=is_causal, **extra, **variants, **flash_kwargs)

    spec = P(DATA, CONTEXT)  # q, k, v [B, T, heads, H] and the segment ids [B, T]
    # check_vma=False: the fa2_jax kernels in interpret mode are not typed for varying manual axes.
    return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * (3 + len(segments)),
                         out_specs=spec, check_vma=False)(q, k, v, *segments)

  return attend


# --- the runner -----------------------------------------------------------------------------------

def state_specs(state, data: int):
  """The ``PartitionSpec`` of each array of ``state`` (parameters, optimizer state) for ``--fsdp``:
  sharded over ``data`` along its largest dimension that ``data`` divides (the first of equal ones),
  replicated where none does (scalars, small vectors)."""
  def spec(x):
    dims = [i for i, n in enumerate(x.shape) if n % data == 0 and n >= data]
    if data == 1 or not dims:
      return P()
    axis = max(dims, key=lambda i: (x.shape[i], -i))
    return P(*([None] * axis + [DATA]))
  return jax.tree.map(spec, state)


def _placed(x, sharding: NamedSharding) -> jax.Array:
  """The host array ``x`` (the same on every process) as a global array: each process places the
  blocks its own devices hold."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


@dataclasses.dataclass
class MeshRunner:
  """Compiled steps on a ``data`` x ``context`` mesh of every device (of every process), with the
  :class:`steps.Runner` interface: ``put_state`` / ``get_state`` move the state in and out, ``shard``
  places a global batch, ``scalar`` reads a metric."""

  mode: str
  train_step: Callable
  eval_step: Callable
  n_devices: int
  mesh: Mesh
  state_sharding: object  # a NamedSharding per array of the state (replicated, or --fsdp's)

  @classmethod
  def create(cls, model, tx, batch_size: int, make_steps: Callable,
             axes: tuple[tuple[str, int], ...], init_state: Callable | None = None,
             fsdp: bool = False) -> MeshRunner:
    """``make_steps(model, tx, None)`` gives the single-device (train_step, eval_step); ``axes``:
    :func:`mesh_axes`. With ``context`` > 1 the model's fa2_jax attention runs through
    :func:`context_attention` (``GPT.context_mesh``). ``fsdp``: the state sharded over ``data``
    (:func:`state_specs`), its structure from ``init_state(model, tx, seed)``, traced only."""
    sizes = dict(axes)
    if batch_size % sizes[DATA]:
      raise ValueError(f"--batch-size {batch_size} must be divisible by the {sizes[DATA]} devices "
                       f"of the mesh axis 'data' (--mesh {describe_mesh(axes)})")
    seq_len = model.config.seq_len
    if sizes[CONTEXT] > 1 and seq_len % (2 * sizes[CONTEXT]):
      raise ValueError(f"--seq-len {seq_len} must be divisible by {2 * sizes[CONTEXT]}: twice the "
                       f"{sizes[CONTEXT]} devices of the mesh axis 'context', whose layout gives "
                       f"each device two chunks of the sequence (--mesh {describe_mesh(axes)})")
    mesh = jax.make_mesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES,
                         axis_types=(AxisType.Auto,) * 2, devices=jax.devices())
    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, ROWS)
    if fsdp:  # the state's structure from the one-device model (a one-row init, traced only)
      if init_state is None:
        raise ValueError("fsdp needs init_state, the state's structure")
      specs = state_specs(jax.eval_shape(lambda: init_state(model, tx, 0)), sizes[DATA])
      state_sharding = jax.tree.map(lambda p: NamedSharding(mesh, p), specs)
      params_sharding = state_sharding.params
    else:  # a sharding given for a pytree argument applies to each of its leaves
      state_sharding = params_sharding = replicated
    if sizes[CONTEXT] > 1:
      model = model.clone(context_mesh=mesh)
    train_step, eval_step = make_steps(model, tx, None)
    train = jax.jit(train_step, in_shardings=(state_sharding, rows, rows),
                    out_shardings=(state_sharding, replicated), donate_argnums=0)
    evaluate = jax.jit(eval_step, in_shardings=(params_sharding, rows, rows),
                       out_shardings=replicated)
    return cls("mesh", train, evaluate, mesh.size, mesh, state_sharding)

  def put_state(self, state):
    """Host/single-device state (the same on every process) -> on the mesh (replicated, or
    sharded with ``--fsdp``), in fresh buffers (the step donates its input; the caller keeps
    ``state``)."""
    if isinstance(self.state_sharding, NamedSharding):
      return jax.tree.map(lambda x: _placed(jax.device_get(x), self.state_sharding), state)
    return jax.tree.map(lambda x, sh: _placed(jax.device_get(x), sh), state, self.state_sharding)

  def get_state(self, state):
    """The state as host numpy arrays: a replicated array from this process's first device, a
    sharded one (``--fsdp``) gathered from every process."""
    from jax.experimental import multihost_utils

    def host(x):
      if x.sharding.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
      if x.is_fully_addressable:
        return np.asarray(x)
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return jax.tree.map(host, state)

  def shard(self, x):
    """A global batch (``[B, T]`` arrays, or a dict of them) split over the mesh: B over ``data``,
    T over ``context``, in the :data:`LAYOUT` order along T (a permutation of the tokens: the loss
    is a sum over them, and the model's positions travel with them)."""
    rows = NamedSharding(self.mesh, ROWS)
    c = self.mesh.shape[CONTEXT]
    if c > 1:
      x = jax.tree.map(lambda a: np.asarray(fa2_jax.to_context_layout(np.asarray(a), c,
                                                                      layout=LAYOUT)), x)
    return jax.tree.map(lambda a: _placed(a, rows), x)

  def scalar(self, v) -> float:
    """A (replicated) metric as a Python float; waits for the device."""
    return float(np.asarray(v.addressable_data(0)))
