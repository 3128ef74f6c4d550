"""Data parallelism over a device mesh (``--data-parallel mesh``), beside the ``pmap`` mode.

One ``jax.jit`` step over the global batch, as on one device, with shardings instead of a mapped
axis: the batch is split over the mesh axis ``data`` (a ``NamedSharding``), the parameters and the
optimizer state are replicated on every device. XLA partitions the step: each device runs the model
on its batch rows, and the gradient's mean over the batch becomes an all-reduce of the parameter
gradients, so the update equals the single-device update on the same global batch. The attention
of ``fa2_jax.flash_attention`` stays per device too (``fa2_jax.sharding``): its kernels run on the
local batch rows, with no gather of q/k/v.

Compared with ``pmap``: the state is one array per parameter (no leading device axis), the step is the
single-device step unchanged (no ``pmean``), and the same code extends to model parallelism by
sharding more axes.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

AXIS = "data"  # the mesh axis the batch is split over


@dataclasses.dataclass
class MeshRunner:
  """Compiled steps on a 1-D mesh of every local device, with the :class:`steps.Runner` interface:
  ``put_state`` / ``get_state`` move the state in and out, ``shard`` places a global batch, ``scalar``
  reads a metric."""

  mode: str
  train_step: Callable
  eval_step: Callable
  n_devices: int
  mesh: Mesh

  @classmethod
  def create(cls, model, tx, batch_size: int, make_steps: Callable) -> MeshRunner:
    """``make_steps(model, tx, None)`` gives the single-device (train_step, eval_step)."""
    devices = jax.local_devices()
    n = len(devices)
    if batch_size % n:
      raise ValueError(f"--batch-size {batch_size} must be divisible by the {n} local devices "
                       "for --data-parallel mesh")
    mesh = jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Auto,), devices=devices)
    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
    train_step, eval_step = make_steps(model, tx, None)
    # A sharding given for a pytree argument applies to each of its leaves.
    train = jax.jit(train_step, in_shardings=(replicated, rows, rows),
                    out_shardings=(replicated, replicated), donate_argnums=0)
    evaluate = jax.jit(eval_step, in_shardings=(replicated, rows, rows), out_shardings=replicated)
    return cls("mesh", train, evaluate, n, mesh)

  def put_state(self, state):
    """Host/single-device state -> replicated on the mesh, in fresh buffers (the step donates its
    input; the caller keeps ``state``)."""
    host = jax.tree.map(np.asarray, jax.device_get(state))
    return jax.device_put(host, NamedSharding(self.mesh, P()))

  def get_state(self, state):
    """The state as host numpy arrays."""
    return jax.device_get(state)

  def shard(self, x: np.ndarray) -> jax.Array:
    """A global batch ``[B, ...]`` split over the devices along B."""
    return jax.device_put(x, NamedSharding(self.mesh, P(AXIS)))

  def scalar(self, v) -> float:
    """A (replicated) metric as a Python float; waits for the device."""
    return float(v)
