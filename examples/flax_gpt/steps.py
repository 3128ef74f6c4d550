"""The example GPT's optimizer, train state and compiled train/eval steps.

:func:`make_optimizer` is AdamW with linear warm-up and cosine decay after global-norm gradient
clipping; :func:`make_steps` builds the train and eval steps (plain or packed batches, averaged
over a device axis with pmap); :class:`Runner` compiles them for one ``--data-parallel`` mode
(``none``, ``pmap``, or ``mesh`` through :mod:`.parallel`, a ``data`` x ``context`` mesh) and moves the state and batches into its
layout; :func:`compiled_steps` keeps the compiled steps of a configuration for later runs.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from . import data as data_lib
from .config import GPTConfig, TrainConfig
from .model import GPT, cross_entropy, cross_entropy_sum

AXIS = "data"  # the pmap axis name


@struct.dataclass
class TrainState:
  """Everything a checkpoint holds: the step, the parameters and the optimizer state."""

  step: jax.Array
  params: Any
  opt_state: Any


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW on a warm-up + cosine schedule; no decay on vectors."""
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=tc.lr, warmup_steps=tc.warmup_steps,
      decay_steps=max(tc.steps, tc.warmup_steps + 1), end_value=tc.lr * tc.min_lr_ratio)
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # matrices only
  adamw = optax.adamw(schedule, b1=tc.beta1, b2=tc.beta2, weight_decay=tc.weight_decay,
                      mask=decay_mask)
  if tc.grad_clip > 0:
    return optax.chain(optax.clip_by_global_norm(tc.grad_clip), adamw)
  return adamw


@functools.lru_cache(maxsize=4)
def _jitted_init(model: GPT) -> Callable:
  """``jax.jit(model.init)``, one per model config: a later run of the same model skips its compile."""
  return jax.jit(model.init)


def init_state(model: GPT, tx: optax.GradientTransformation, seed: int) -> TrainState:
  """Fresh parameters (from ``seed``) and optimizer state."""
  tokens = jnp.zeros((1, model.config.seq_len), jnp.int32)
  params = _jitted_init(model)(jax.random.PRNGKey(seed), tokens)["params"]
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


def make_steps(model: GPT, tx: optax.GradientTransformation, axis_name: str | None):
  """The (train_step, eval_step) functions; with ``axis_name`` they average over that axis.

  A batch is ``x`` tokens ``[B, T]`` and ``y`` targets ``[B, T]`` (loss: the mean over every token),
  or, packed (:func:`packed_batch`), ``x = {"tokens", "positions", "segment_ids"}`` and
  ``y = {"targets", "weights"}`` (loss: the weighted mean over the global batch).
  """
  def mean(v):
    return jax.lax.pmean(v, axis_name) if axis_name else v

  def loss_fn(params, x, y, weight_total):
    if not isinstance(x, dict):
      return cross_entropy(model.apply({"params": params}, x), y)
    logits = model.apply({"params": params}, x["tokens"], x["positions"], x["segment_ids"])
    return cross_entropy_sum(logits, y["targets"], y["weights"]) / weight_total

  def weight_total(y):
    """The packed loss's divisor: the global batch's weight, over the devices that ``mean`` averages,
    so the mean of the devices' losses is the global batch's weighted mean."""
    if not isinstance(y, dict):
      return None
    return jnp.maximum(mean(jnp.sum(y["weights"]).astype(jnp.float32)), 1.0)

  def train_step(state: TrainState, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, x, y, weight_total(y))
    grads, loss = mean(grads), mean(loss)  # every device holds an equal share of the batch
    # optax (0.2.8) raises a Python float to an int32 count (Adam's bias correction), which
    # jax_numpy_dtype_promotion="strict" refuses: its update runs under the standard promotion.
    with jax.numpy_dtype_promotion("standard"):
      updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

  def eval_step(params, x, y):
    return mean(loss_fn(params, x, y, weight_total(y)))

  return train_step, eval_step


def packed_batch(batch: data_lib.PackedBatch) -> tuple[dict, dict]:
  """A :class:`data.PackedBatch` as the steps' ``(x, y)``."""
  return ({"tokens": batch.tokens, "positions": batch.positions, "segment_ids": batch.segment_ids},
          {"targets": batch.targets, "weights": batch.weights})


@dataclasses.dataclass
class Runner:
  """Compiled steps for one data-parallel mode, with the state/batch layout that mode needs.

  ``none`` runs one ``jax.jit`` step on the default device. ``pmap`` keeps one replica of the state
  per local device and splits each global batch evenly between them; gradients are averaged with
  ``lax.pmean``, so the update equals the single-device update on the same global batch.
  """

  mode: str
  train_step: Callable
  eval_step: Callable
  n_devices: int

  @classmethod
  def create(cls, mode: str, model: GPT, tx, batch_size: int,
             mesh_axes: tuple[tuple[str, int], ...] | None = None, fsdp: bool = False) -> "Runner":
    """``mesh_axes`` (mode ``mesh``): the ``(("data", D), ("context", C))`` sizes
    (``parallel.mesh_axes``); None puts every device on ``data``. ``fsdp`` (mode ``mesh``): the
    parameters and optimizer state sharded over ``data`` (``parallel.state_specs``)."""
    if fsdp and mode != "mesh":
      raise ValueError(f"--fsdp shards the state over the mesh axis 'data': it needs --mesh or "
                       f"--data-parallel mesh, got --data-parallel {mode}")
    if mode == "none":
      train_step, eval_step = make_steps(model, tx, None)
      return cls(mode, jax.jit(train_step, donate_argnums=0), jax.jit(eval_step), 1)
    if mode == "mesh":  # one jit step over a batch sharded on a device mesh (parallel.py)
      from .parallel import MeshRunner, mesh_axes as default_axes
      axes = mesh_axes if mesh_axes is not None else default_axes(None, jax.device_count())
      return MeshRunner.create(model, tx, batch_size, make_steps, axes, init_state=init_state,
                               fsdp=fsdp)
    if mode != "pmap":
      raise ValueError(f"--data-parallel must be 'none', 'pmap' or 'mesh', got {mode!r}")
    n = jax.local_device_count()
    if batch_size % n:
      raise ValueError(f"--batch-size {batch_size} must be divisible by the {n} local devices "
                       "for --data-parallel pmap")
    train_step, eval_step = make_steps(model, tx, AXIS)
    return cls(mode, jax.pmap(train_step, AXIS, donate_argnums=0), jax.pmap(eval_step, AXIS), n)

  def put_state(self, state: TrainState) -> TrainState:
    """Host/single-device state -> the layout the step takes (one replica per device for pmap)."""
    if self.mode == "none":  # a copy: the step donates its input, the caller keeps `state`
      return jax.tree.map(lambda x: jnp.array(x, copy=True), state)
    # Committed, replicated device arrays: the layout (and avals) the pmap step returns, so the second
    # step reuses the first step's executable instead of compiling again (seen on 2 x H200: a numpy
    # input compiled the step twice and the second compile landed in the throughput window).
    stacked = jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (self.n_devices, *x.shape)),
                           state)
    return jax.pmap(lambda s: s, AXIS)(stacked)

  def get_state(self, state: TrainState) -> TrainState:
    """The state as host numpy arrays (replica 0 for pmap)."""
    if self.mode == "pmap":
      state = jax.tree.map(lambda x: x[0], state)
    return jax.device_get(state)

  def shard(self, x):
    """A global batch ``[B, ...]`` (or a dict of them) -> ``[devices, B / devices, ...]`` for pmap."""
    if self.mode == "none":
      return x
    return jax.tree.map(lambda a: a.reshape(self.n_devices, -1, *a.shape[1:]), x)

  def scalar(self, v) -> float:
    """A (replicated) metric as a Python float; waits for the device."""
    return float(v if self.mode == "none" else v[0])


@functools.lru_cache(maxsize=4)
def compiled_steps(mc: GPTConfig, tc: TrainConfig, data_parallel: str, n_devices: int,
                   mesh_axes: tuple[tuple[str, int], ...] | None = None, fsdp: bool = False
                   ) -> tuple[GPT, optax.GradientTransformation, Runner]:
  """The model, optimizer and :class:`Runner` of a configuration, kept for later :func:`train` calls
  with equal configs (a resumed run in the same process, runs on other data, the tests): a new jit
  closure would compile again, and compiling is most of a short run's time. ``n_devices`` (the
  local device count) keys the pmap layout; ``mesh_axes`` and ``fsdp`` the mesh's
  (:meth:`Runner.create`). The model returned is the single-device one (sampling, checkpoints: the
  same parameters)."""
  del n_devices  # only a cache key: Runner.create reads the device count itself
  model, tx = GPT(mc), make_optimizer(tc)
  return model, tx, Runner.create(data_parallel, model, tx, tc.batch_size, mesh_axes, fsdp)
