"""Train the example GPT on byte-level text with fa2_jax FlashAttention.

    python -m examples.flax_gpt.train --preset tiny                 # CPU, a few minutes
    python -m examples.flax_gpt.train --preset small --out out/small.json       # one GPU
    python -m examples.flax_gpt.train --preset long8k --data-parallel pmap      # all local GPUs
    python -m examples.flax_gpt.train --preset long8k --data-parallel mesh      # same, one jit step

One ``jax.jit`` (or ``jax.pmap``) train step: AdamW with linear warm-up and cosine decay, global-
norm gradient clipping. Progress (loss, tokens/s, model TFLOP/s, MFU) is a tqdm bar when stdout is a
terminal, else one plain line every ``--log-every`` steps. ``--help`` lists every flag with its default.

FLOPs per sequence follow the FlashAttention-2 paper (forward + backward):
``6 * seq_len * n_params + 12 * n_layer * n_embd * seq_len**2``, with every parameter counted
(embeddings too) and the attention term dense: every ``[T, T]`` pair, not halved for causal masking
nor reduced by ``--window`` or ``--packing``. MFU divides the achieved FLOP/s by the dense bfloat16
peak of the devices: 989.4 TFLOP/s per H100/H200 SXM, 312 per A100 (``--peak-tflops`` overrides it);
on CPU it is "n/a". The JSON summary also gives the attended-pair count
(``attended_flops_per_sequence``, ``attended_tflops_per_s``): ``12 * n_layer * n_embd`` times the
(query, key) pairs the causal mask and the window leave (cross-document pairs of ``--packing`` still
counted, as they vary by batch).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import re
import sys
import time
from collections.abc import Callable
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

import fa2_jax

from . import data as data_lib
from .config import (ATTENTIONS, BYTE_VOCAB, DTYPES, POSITIONS, PRESETS, GPTConfig, TrainConfig,
                     get_preset)
from .model import (FLASH_IMPLEMENTATIONS, GPT, attention_core, count_params, cross_entropy,
                    cross_entropy_sum)

# Dense bfloat16 tensor-core peaks (TFLOP/s per device) from NVIDIA's data sheets, SXM parts.
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}
AXIS = "data"  # the pmap axis name
VAL_SEED_OFFSET = 1_000_003  # validation batches use their own fixed seed stream
DEFAULT_PROMPT = "def fibonacci(n):\n"  # the sample's prompt for the default data (Python sources)
PROGRESS_MODES = ("auto", "bar", "lines", "off")


@struct.dataclass
class TrainState:
  """Everything a checkpoint holds: the step, the parameters and the optimizer state."""

  step: jax.Array
  params: Any
  opt_state: Any


# --- optimizer, state and steps -------------------------------------------------------------------

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
  def create(cls, mode: str, model: GPT, tx, batch_size: int) -> "Runner":
    if mode == "none":
      train_step, eval_step = make_steps(model, tx, None)
      return cls(mode, jax.jit(train_step, donate_argnums=0), jax.jit(eval_step), 1)
    if mode == "mesh":  # one jit step over a batch sharded on a device mesh (parallel.py)
      from .parallel import MeshRunner
      return MeshRunner.create(model, tx, batch_size, make_steps)
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
def compiled_steps(mc: GPTConfig, tc: TrainConfig, data_parallel: str,
                   n_devices: int) -> tuple[GPT, optax.GradientTransformation, Runner]:
  """The model, optimizer and :class:`Runner` of a configuration, kept for later :func:`train` calls
  with equal configs (a resumed run in the same process, runs on other data, the tests): a new jit
  closure would compile again, and compiling is most of a short run's time. ``n_devices`` (the
  local device count) keys the pmap layout."""
  del n_devices  # only a cache key: Runner.create reads the device count itself
  model, tx = GPT(mc), make_optimizer(tc)
  return model, tx, Runner.create(data_parallel, model, tx, tc.batch_size)


# --- FLOPs, MFU -----------------------------------------------------------------------------------

def flops_per_sequence(config: GPTConfig, n_params: int) -> float:
  """Training FLOPs of one sequence (forward + backward), as in the FlashAttention-2 paper: the
  attention term counts every ``[T, T]`` pair (dense), whatever the causal mask, window or packing."""
  t = config.seq_len
  return 6.0 * t * n_params + 12.0 * config.n_layer * config.n_embd * t * t


def attended_pairs(config: GPTConfig) -> int:
  """The (query, key) pairs one sequence attends under the causal mask and ``config.window``: query
  ``i`` sees ``min(i, window) + 1`` keys. (Packing's cross-document pairs are not subtracted.)"""
  t = config.seq_len
  w = t - 1 if config.window is None else min(config.window, t - 1)
  return (w + 1) * t - w * (w + 1) // 2  # sum over i of min(i, w) + 1


def attended_flops_per_sequence(config: GPTConfig, n_params: int) -> float:
  """:func:`flops_per_sequence` with the attention term counting only :func:`attended_pairs`
  (the forward's 4 FLOPs per pair and head channel, times 3 for forward + backward)."""
  return (6.0 * config.seq_len * n_params
          + 12.0 * config.n_layer * config.n_embd * attended_pairs(config))


def peak_tflops(devices) -> float | None:
  """Summed dense bf16 peak of ``devices``, or None when unknown (CPU, other GPUs)."""
  if devices[0].platform != "gpu":
    return None
  kind = devices[0].device_kind
  for name, tflops in PEAK_BF16_TFLOPS.items():
    if name in kind:
      return tflops * len(devices)
  return None


# --- checkpoints ----------------------------------------------------------------------------------

def checkpoint_manager(ckpt_dir: str):
  """An orbax CheckpointManager keeping the two newest checkpoints."""
  import orbax.checkpoint as ocp
  options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
  return ocp.CheckpointManager(os.path.abspath(ckpt_dir), options=options)


def latest_checkpoint_step(ckpt_dir: str) -> int | None:
  """The newest checkpoint's step in ``ckpt_dir``, or None when it holds none (or does not exist)."""
  if not os.path.isdir(ckpt_dir):
    return None
  manager = checkpoint_manager(ckpt_dir)
  try:
    return manager.latest_step()
  finally:
    manager.close()


def save_checkpoint(manager, state: TrainState) -> None:
  import orbax.checkpoint as ocp
  manager.save(int(state.step), args=ocp.args.StandardSave(state), force=True)


def restore_checkpoint(manager, template: TrainState) -> TrainState | None:
  """The newest checkpoint as host arrays shaped like ``template``, or None if there is none."""
  import orbax.checkpoint as ocp
  step = manager.latest_step()
  if step is None:
    return None
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
                          template)
  return jax.device_get(manager.restore(step, args=ocp.args.StandardRestore(abstract)))


# --- sampling -------------------------------------------------------------------------------------

def generate(model: GPT, params, prompt: str, n_tokens: int, *, temperature: float = 0.8,
             seed: int = 0) -> str:
  """Continues ``prompt`` by ``n_tokens`` bytes, sampled at ``temperature`` (0: greedy, the most
  likely byte each time).

  Each token runs the model on a fixed ``[1, seq_len]`` window (no KV cache: one compiled shape);
  the window slides once the text is longer than seq_len. Causal attention ignores the padding.

  Raises:
    ValueError: ``temperature`` < 0 or ``n_tokens`` < 0.
  """
  if not temperature >= 0:
    raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
  if n_tokens < 0:
    raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
  seq_len = model.config.seq_len

  @jax.jit
  def next_token(params, window, length, key):
    logits = model.apply({"params": params}, window)[0, length - 1]
    if temperature == 0:
      return jnp.argmax(logits)
    return jax.random.categorical(key, logits / temperature)

  ids = list(data_lib.encode(prompt)) or [ord("\n")]
  key = jax.random.PRNGKey(seed)
  for _ in range(n_tokens):
    context = ids[-seq_len:]
    window = np.zeros((1, seq_len), np.int32)
    window[0, :len(context)] = context
    key, sub = jax.random.split(key)
    ids.append(int(next_token(params, window, len(context), sub)))
  return data_lib.decode(ids)


# --- the training loop ----------------------------------------------------------------------------

@dataclasses.dataclass
class _Throughput:
  """Accumulates timed steps (the first, compiling, step and evaluations are excluded)."""

  seconds: float = 0.0
  steps: int = 0

  def add(self, seconds: float, steps: int) -> None:
    self.seconds += seconds
    self.steps += steps


# --- attention backend and the checks before a run -----------------------------------------------

# fa2_jax's argument names in its messages -> this command line's flags (longest first).
_CLI_NAMES = (
    ("implementation='triton' or None", "--attention flash_triton or --attention flash"),
    ("implementation='xla' or None", "--attention xla or --attention flash"),
    ("implementation='triton'", "--attention flash_triton"),
    ("implementation='mosaic'", "--attention flash_mosaic"),
    ("implementation='xla'", "--attention xla"),
    ("implementation=None", "--attention flash"),
    ("interpret=True", "--interpret true"),
)


def cli_message(message: str) -> str:
  """An fa2_jax message with its argument names written as this command line's flags."""
  for api_name, flag in _CLI_NAMES:
    message = message.replace(api_name, flag)
  return message


def attention_dispatch(mc: GPTConfig, packing: bool = False) -> fa2_jax.Dispatch | None:
  """What fa2_jax runs for the model's attention here (``fa2_jax.backend_for`` on its shapes and
  variants: the window, the soft cap and, with ``packing``, segment ids), or None for
  ``xla``/``cudnn``, which are ``jax.nn.dot_product_attention``.

  Raises:
    ValueError: the attention cannot run here (``flash_triton`` on CPU without ``flash_interpret``,
      ``flash_mosaic`` off Hopper or with ``flash_interpret``, ``cudnn`` without a GPU), with
      fa2_jax's own message.
  """
  if not mc.attention.startswith("flash"):
    attention_core(mc)  # raises for cudnn without a GPU
    return None
  # The model's query and key/value shapes, [batch, seq_len, heads, head_dim] (the batch does not
  # change the choice).
  shape = lambda heads: jax.ShapeDtypeStruct((1, mc.seq_len, heads, mc.head_dim), jnp.dtype(mc.dtype))
  segments = jax.ShapeDtypeStruct((1, mc.seq_len), jnp.int32) if packing else None
  return fa2_jax.backend_for(shape(mc.n_head), shape(mc.kv_heads), is_causal=True,
                             implementation=FLASH_IMPLEMENTATIONS[mc.attention],
                             interpret=True if mc.flash_interpret else None,
                             local_window_size=None if mc.window is None else (mc.window, 0),
                             logits_soft_cap=mc.soft_cap, q_segment_ids=segments,
                             kv_segment_ids=segments)


def describe_attention(mc: GPTConfig, packing: bool = False) -> str:
  """One line: the ``--attention`` choice and the kernels it runs here, in command-line terms."""
  dispatch = attention_dispatch(mc, packing)
  if dispatch is None:
    return f"attention {mc.attention}: jax.nn.dot_product_attention(implementation={mc.attention!r})"
  return f"attention {mc.attention}: fa2_jax {cli_message(str(dispatch))}"


def check_run(mc: GPTConfig, tc: TrainConfig, *, data_path: str | None, data_parallel: str,
              ckpt_dir: str | None, resume: bool, stop_at: int | None, sample_tokens: int,
              temperature: float, peak: float | None) -> fa2_jax.Dispatch | None:
  """Checks the arguments of :func:`train` that the configs cannot check alone, before any work.

  Returns:
    ``attention_dispatch(mc)``.

  Raises:
    ValueError: naming the command-line flag, for a run that cannot work here.
  """
  if mc.vocab_size < BYTE_VOCAB:
    raise ValueError(f"--vocab-size must be >= {BYTE_VOCAB} (the tokens are bytes), got "
                     f"{mc.vocab_size}")
  if mc.flash_interpret and not mc.attention.startswith("flash"):
    raise ValueError(f"--interpret true runs the fa2_jax kernels, which --attention {mc.attention} "
                     "does not use; pass --attention flash or flash_triton")
  if not mc.attention.startswith("flash"):
    # jax.nn.dot_product_attention has a window (local_window_size) but no segment ids or soft cap.
    for flag, used, missing in (("--packing", tc.packing, "segment ids"),
                                ("--soft-cap", mc.soft_cap is not None, "logits soft cap")):
      if used:
        raise ValueError(f"{flag} needs fa2_jax attention (--attention flash, flash_triton or "
                         f"flash_mosaic): jax.nn.dot_product_attention (--attention "
                         f"{mc.attention}) has no {missing}")
  if data_parallel not in ("none", "pmap", "mesh"):
    raise ValueError(f"--data-parallel must be 'none', 'pmap' or 'mesh', got {data_parallel!r}")
  n = jax.local_device_count()
  if data_parallel in ("pmap", "mesh") and tc.batch_size % n:
    raise ValueError(f"--batch-size {tc.batch_size} must be divisible by the {n} local devices "
                     f"for --data-parallel {data_parallel}")
  if data_path is not None and not os.path.exists(data_path):
    raise ValueError(f"--data {data_path}: no such file or folder")
  if resume and not ckpt_dir:
    raise ValueError("--resume needs --ckpt-dir, the folder of the checkpoints to resume from")
  if ckpt_dir:
    if os.path.exists(ckpt_dir) and not os.path.isdir(ckpt_dir):
      raise ValueError(f"--ckpt-dir {ckpt_dir} is a file, not a folder")
    newest = latest_checkpoint_step(ckpt_dir)
    if newest is not None and not resume:
      raise ValueError(f"--ckpt-dir {ckpt_dir} already holds checkpoints (newest: step {newest}): "
                       "pass --resume to continue from it, or choose another folder")
  if stop_at is not None and stop_at < 1:
    raise ValueError(f"--stop-at must be >= 1, got {stop_at}")
  if sample_tokens < 0:
    raise ValueError(f"--sample-tokens must be >= 0, got {sample_tokens}")
  if not temperature >= 0:
    raise ValueError(f"--temperature must be >= 0 (0: greedy), got {temperature}")
  if peak is not None and not peak > 0:
    raise ValueError(f"--peak-tflops must be > 0, got {peak}")
  try:
    return attention_dispatch(mc, tc.packing)
  except ValueError as e:
    raise ValueError(cli_message(str(e))) from e


def progress_mode(progress: str | bool) -> str:
  """``"bar"``, ``"lines"`` or ``"off"`` for :func:`train`'s ``progress`` (``"auto"``: a bar when
  stdout is a terminal, plain lines when it is a file or a pipe; True/False: "auto"/"off")."""
  if isinstance(progress, bool):
    progress = "auto" if progress else "off"
  if progress not in PROGRESS_MODES:
    raise ValueError(f"progress must be one of {PROGRESS_MODES} or a bool, got {progress!r}")
  if progress == "auto":
    return "bar" if sys.stdout.isatty() else "lines"
  return progress


def _summary(mc: GPTConfig, tc: TrainConfig, throughput: _Throughput, *, n_params: int,
             peak: float | None, devices, data_parallel: str, data_path: str | None) -> dict:
  """Throughput, MFU and the run's settings, for the JSON summary."""
  tok_s = tflops = attended_tflops = None
  dispatch = attention_dispatch(mc, tc.packing)
  if throughput.steps:
    tok_s = tc.batch_size * mc.seq_len * throughput.steps / throughput.seconds
    per_second = tc.batch_size * throughput.steps / throughput.seconds / 1e12  # sequences / 1e12
    tflops = flops_per_sequence(mc, n_params) * per_second
    attended_tflops = attended_flops_per_sequence(mc, n_params) * per_second
  return {
      "tokens_per_s": tok_s, "tflops_per_s": tflops,
      "mfu": tflops / peak if (tflops and peak) else None, "peak_tflops": peak,
      "n_params": n_params, "flops_per_sequence": flops_per_sequence(mc, n_params),
      "attended_flops_per_sequence": attended_flops_per_sequence(mc, n_params),
      "attended_tflops_per_s": attended_tflops,
      "attention": mc.attention,
      "attention_backend": (f"jax.nn.dot_product_attention/{mc.attention}" if dispatch is None
                            else f"fa2_jax/{dispatch.backend}"),
      "attention_kernels": None if dispatch is None else str(dispatch),
      "data_parallel": data_parallel,
      "devices": {"count": len(devices), "platform": devices[0].platform,
                  "kind": devices[0].device_kind},
      "versions": {"jax": jax.__version__, "flax": flax.__version__,
                   "fa2_jax": fa2_jax.__version__, "optax": optax.__version__},
      "model_config": dataclasses.asdict(mc), "train_config": dataclasses.asdict(tc),
      "data": data_path or "python-stdlib-sources",
  }


def train(mc: GPTConfig, tc: TrainConfig, *, data_path: str | None = None,
          data_parallel: str = "none", ckpt_dir: str | None = None, resume: bool = False,
          stop_at: int | None = None, progress: str | bool = "auto", sample_tokens: int = 0,
          prompt: str | None = None, temperature: float = 0.8,
          peak: float | None = None) -> tuple[TrainState, dict]:
  """Trains ``tc.steps`` steps (or until ``stop_at``) and returns (host state, summary dict).

  Args:
    mc, tc: model and training configs.
    data_path: a text file or folder; None reads the Python standard library's sources.
    data_parallel: "none" (one device), "pmap" or "mesh" (every local device; see parallel.py).
    ckpt_dir: save checkpoints here (every tc.ckpt_every steps and at the end); a folder that
      already holds checkpoints needs ``resume``.
    resume: continue from the newest checkpoint in ckpt_dir (a fresh start, said so, when it has
      none).
    stop_at: stop after this step (the schedule still spans tc.steps), e.g. to test resuming.
    progress: "auto" (a tqdm bar when stdout is a terminal, else "lines"), "bar", "lines" (a plain
      line every tc.log_every steps) or "off" (only evaluations and checkpoints are printed);
      True/False mean "auto"/"off".
    sample_tokens: bytes to sample after training (0: none).
    prompt: the sample's prompt (None: DEFAULT_PROMPT for the default data, else the first line of
      the data).
    temperature: the sample's temperature (0: greedy).
    peak: dense peak TFLOP/s of all devices together for MFU (None: from the device kind).

  Raises:
    ValueError: from :func:`check_run`, before any work; data_lib.DataError: text too short.
  """
  from tqdm.auto import tqdm

  mode = progress_mode(progress)
  check_run(mc, tc, data_path=data_path, data_parallel=data_parallel, ckpt_dir=ckpt_dir,
            resume=resume, stop_at=stop_at, sample_tokens=sample_tokens, temperature=temperature,
            peak=peak)
  t_start = time.perf_counter()
  train_data, val_data = data_lib.load_documents(data_path, tc.data_bytes, mc.seq_len)
  if prompt is None:
    prompt = DEFAULT_PROMPT if data_path is None else data_lib.opening_line(train_data.tokens)
  model, tx, runner = compiled_steps(mc, tc, data_parallel, jax.local_device_count())
  state = init_state(model, tx, tc.seed)
  n_params = count_params(state.params)
  manager = checkpoint_manager(ckpt_dir) if ckpt_dir else None
  if manager is not None and resume:
    restored = restore_checkpoint(manager, state)
    if restored is None:
      print(f"no checkpoint in {manager.directory}: starting from step 0", flush=True)
    else:
      state = restored
      print(f"resuming from the checkpoint of step {int(state.step)} in {manager.directory}",
            flush=True)
  start = int(state.step)
  last = min(tc.steps, stop_at) if stop_at is not None else tc.steps
  if start >= last:
    print(f"the checkpoint's step {start} is at or past the last step {last}: nothing to train",
          flush=True)
  devices = jax.local_devices()[:runner.n_devices]
  peak = peak if peak is not None else peak_tflops(devices)
  flops_per_step = flops_per_sequence(mc, n_params) * tc.batch_size
  tokens_per_step = tc.batch_size * mc.seq_len

  def batch(split: data_lib.Split, i: int, seed: int):
    if tc.packing:
      return packed_batch(data_lib.get_packed_batch(split, i, batch_size=tc.batch_size,
                                                    seq_len=mc.seq_len, seed=seed))
    return data_lib.get_batch(split.tokens, i, batch_size=tc.batch_size, seq_len=mc.seq_len,
                              seed=seed)

  def validate(st) -> float:
    losses = [runner.scalar(runner.eval_step(st.params, *map(runner.shard, batch(
        val_data, i, tc.seed + VAL_SEED_OFFSET)))) for i in range(tc.eval_batches)]
    return float(np.mean(losses))

  state = runner.put_state(state)
  history, throughput, loss, val_loss = [], _Throughput(), None, None
  if mode == "bar":
    bar = tqdm(total=last, initial=start, dynamic_ncols=True, unit="step", file=sys.stdout)
    say = bar.write  # prints above the bar
  else:
    bar, say = None, lambda line: print(line, flush=True)
  t_window, steps_in_window = time.perf_counter(), 0
  for step in range(start, last):
    x, y = batch(train_data, step, tc.seed)
    state, metrics = runner.train_step(state, runner.shard(x), runner.shard(y))
    steps_in_window += 1
    done = step + 1
    if done % tc.log_every == 0 or done == last or step == start:
      loss = runner.scalar(metrics["loss"])  # waits for the device
      dt = time.perf_counter() - t_window
      if step != start:  # the first step includes compilation
        throughput.add(dt, steps_in_window)
      tok_s = tokens_per_step * steps_in_window / dt
      tflops = flops_per_step * steps_in_window / dt / 1e12
      history.append({"step": done, "loss": loss})
      mfu = f"{tflops / peak:.1%}" if peak else "n/a"
      if bar is not None:
        bar.set_postfix({"loss": f"{loss:.4f}", "tok/s": f"{tok_s:,.0f}",
                         "TFLOP/s": f"{tflops:.3g}", "MFU": mfu})
        bar.update(done - bar.n)
      elif mode == "lines":
        say(f"step {done}/{last}: loss {loss:.4f}, {tok_s:,.0f} tok/s, {tflops:.3g} TFLOP/s, "
            f"MFU {mfu}" + (" (includes compilation)" if step == start else ""))
      t_window, steps_in_window = time.perf_counter(), 0
    evaluate = (tc.eval_every and done % tc.eval_every == 0) or done == tc.steps
    if evaluate:
      val_loss = validate(state)
      history.append({"step": done, "val_loss": val_loss})
      say(f"step {done}: train loss {loss:.4f}, val loss {val_loss:.4f}")
    save = manager is not None and (done == last or (tc.ckpt_every and done % tc.ckpt_every == 0))
    if save:
      save_checkpoint(manager, runner.get_state(state))
      say(f"saving the checkpoint of step {done} to {manager.directory / str(done)}")
    if evaluate or save:  # both waited for the device: restart the throughput window
      t_window, steps_in_window = time.perf_counter(), 0
  if bar is not None:
    bar.close()
  if manager is not None:
    manager.wait_until_finished()
    manager.close()
  state = runner.get_state(state)

  summary = {"final_train_loss": loss, "final_val_loss": val_loss, "start_step": start,
             "end_step": last}
  summary.update(_summary(mc, tc, throughput, n_params=n_params, peak=peak, devices=devices,
                          data_parallel=data_parallel, data_path=data_path))
  summary["history"] = history
  if sample_tokens:
    summary["prompt"] = prompt
    summary["sample"] = generate(model, state.params, prompt, sample_tokens,
                                 temperature=temperature, seed=tc.seed)
  summary["wall_time_s"] = time.perf_counter() - t_start
  return state, summary


# --- command line ---------------------------------------------------------------------------------

# flag -> (config class, field). Flags left at None keep the preset's value.
_OVERRIDES = {
    "seq_len": (GPTConfig, "seq_len"), "n_layer": (GPTConfig, "n_layer"),
    "n_head": (GPTConfig, "n_head"), "n_kv_head": (GPTConfig, "n_kv_head"),
    "n_embd": (GPTConfig, "n_embd"), "vocab_size": (GPTConfig, "vocab_size"),
    "position": (GPTConfig, "position"), "dtype": (GPTConfig, "dtype"),
    "attention": (GPTConfig, "attention"), "tie_embeddings": (GPTConfig, "tie_embeddings"),
    "remat": (GPTConfig, "remat"), "scan_layers": (GPTConfig, "scan_layers"),
    "interpret": (GPTConfig, "flash_interpret"), "window": (GPTConfig, "window"),
    "soft_cap": (GPTConfig, "soft_cap"), "packing": (TrainConfig, "packing"),
    "batch_size": (TrainConfig, "batch_size"), "steps": (TrainConfig, "steps"),
    "lr": (TrainConfig, "lr"), "warmup_steps": (TrainConfig, "warmup_steps"),
    "weight_decay": (TrainConfig, "weight_decay"), "grad_clip": (TrainConfig, "grad_clip"),
    "eval_every": (TrainConfig, "eval_every"), "eval_batches": (TrainConfig, "eval_batches"),
    "log_every": (TrainConfig, "log_every"), "ckpt_every": (TrainConfig, "ckpt_every"),
    "seed": (TrainConfig, "seed"), "data_bytes": (TrainConfig, "data_bytes"),
}


# The help of each preset-derived flag; _preset_help appends the presets' values.
_FLAG_HELP = {
    "attention": "flash: fa2_jax with its default backend (on CPU its XLA formula); flash_triton / "
                 "flash_mosaic: one fa2_jax backend forced (flash_triton on CPU needs --interpret "
                 "true; flash_mosaic needs a Hopper GPU); xla / cudnn: jax.nn.dot_product_attention "
                 "(cudnn: GPU only)",
    "interpret": "run the fa2_jax kernels in Pallas interpret mode (slow; lets --attention flash and "
                 "flash_triton run the Triton kernels on CPU)",
    "position": "learned absolute position embeddings or rotary (RoPE on q and k)",
    "dtype": "compute dtype (parameters stay float32)",
    "seq_len": "context length in tokens (bytes)",
    "n_layer": "transformer blocks",
    "n_head": "query heads",
    "n_kv_head": "key/value heads, dividing --n-head; fewer than --n-head: grouped-query attention "
                 "(unset: --n-head)",
    "n_embd": "model width; head_dim = n_embd / n_head",
    "vocab_size": "output classes, >= 256 (the tokens are bytes)",
    "tie_embeddings": "the output layer reuses the token embedding matrix",
    "remat": "recompute each block's activations in the backward pass (saves memory)",
    "scan_layers": "run the blocks with flax.linen.scan (compile time independent of depth)",
    "window": "sliding-window attention: each token attends itself and the N tokens before it "
              "(local_window_size=(N, 0) with the causal mask; unset: the whole context). "
              "TFLOP/s and MFU still count the dense [T, T] attention",
    "soft_cap": "attention logits soft cap X: X * tanh(logits / X) (needs fa2_jax attention, "
                "--attention flash*; unset: none)",
    "packing": "each file of the data is a document: the training windows carry per-token segment "
               "ids (no attention across documents), positions restarting at 0 at each document, "
               "and targets in the next document left out of the loss (a single --data file is "
               "one document; needs --attention flash*). TFLOP/s and MFU still count the dense "
               "[T, T] attention",
    "batch_size": "global batch in sequences (split over the devices with --data-parallel pmap or "
                  "mesh)",
    "steps": "optimizer steps; also the length of the learning-rate schedule",
    "lr": "peak learning rate, after a linear warm-up; cosine decay to a tenth of it",
    "warmup_steps": "linear learning-rate warm-up steps",
    "weight_decay": "AdamW decoupled weight decay, on matrices only",
    "grad_clip": "global-norm gradient clipping threshold (0: no clipping)",
    "eval_every": "steps between validation losses (0: only at the end)",
    "eval_batches": "batches averaged per validation loss",
    "log_every": "steps between progress updates (bar or line; each waits for the device)",
    "ckpt_every": "steps between checkpoints with --ckpt-dir (0: only at the end)",
    "seed": "seed of the initialisation and of the batches, >= 0",
    "data_bytes": "read at most this many bytes of text (split 90/10 into train/val)",
}


def _flag(name: str) -> str:
  """``seq_len`` -> ``--seq-len``."""
  return "--" + name.replace("_", "-")


def _show(value) -> str:
  """A config value as it is written on the command line."""
  if isinstance(value, bool):
    return "true" if value else "false"
  if value is None:
    return "unset"
  return format(value, "g") if isinstance(value, float) else str(value)


def _preset_help(name: str, note: str = "") -> str:
  """``_FLAG_HELP[name] + note`` and the default of its field in each preset."""
  cls, field = _OVERRIDES[name]
  values = {preset: _show(getattr(configs[0 if cls is GPTConfig else 1], field))
            for preset, configs in PRESETS.items()}
  if len(set(values.values())) == 1:
    return f"{_FLAG_HELP[name]}{note} (default: {next(iter(values.values()))} in every preset)"
  per_preset = ", ".join(f"{preset} {value}" for preset, value in values.items())
  return f"{_FLAG_HELP[name]}{note} (default per preset: {per_preset})"


class _HelpFormatter(argparse.HelpFormatter):
  """Appends "(default: X)" to the flags with a fixed default; a preset-derived flag (default None)
  lists the presets' values in its own help instead."""

  def _get_help_string(self, action):
    if action.default is None or action.default is argparse.SUPPRESS:
      return action.help
    return f"{action.help} (default: {_show(action.default)})"


def _bool(s: str) -> bool:
  if s.lower() in ("1", "true", "yes", "on"):
    return True
  if s.lower() in ("0", "false", "no", "off"):
    return False
  raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")


BARE_TRUE = "; the bare flag means true"  # the help note of every boolean flag


def _add_bool(group, flag: str, help: str, default: bool | None = None) -> None:
  """A boolean flag: bare ``--flag`` is true, ``--flag true|false`` (or 1/0, yes/no, on/off) sets it."""
  group.add_argument(flag, type=_bool, nargs="?", const=True, default=default,
                     metavar="{true,false}", help=help)


def build_parser() -> argparse.ArgumentParser:
  """The command line. A model or training flag left out keeps its preset's value."""
  p = argparse.ArgumentParser(prog="python -m examples.flax_gpt.train",
                              description=__doc__.split("\n\n")[0], formatter_class=_HelpFormatter)
  p.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                 help="the model and training configs; the flags below override single fields")
  g = p.add_argument_group("model (defaults: the preset's)")
  g.add_argument("--attention", choices=ATTENTIONS, help=_preset_help("attention"))
  _add_bool(g, "--interpret", _preset_help("interpret", BARE_TRUE))
  g.add_argument("--position", choices=POSITIONS, help=_preset_help("position"))
  g.add_argument("--dtype", choices=DTYPES, help=_preset_help("dtype"))
  for name in ("seq_len", "n_layer", "n_head", "n_kv_head", "n_embd", "vocab_size"):
    g.add_argument(_flag(name), type=int, help=_preset_help(name))
  for name in ("tie_embeddings", "remat", "scan_layers"):
    _add_bool(g, _flag(name), _preset_help(name, BARE_TRUE))
  g.add_argument("--window", type=int, metavar="N", help=_preset_help("window"))
  g.add_argument("--soft-cap", type=float, metavar="X", help=_preset_help("soft_cap"))
  g = p.add_argument_group("training (defaults: the preset's)")
  for name in ("batch_size", "steps", "warmup_steps", "eval_every", "eval_batches", "log_every",
               "ckpt_every", "seed", "data_bytes"):
    g.add_argument(_flag(name), type=int, help=_preset_help(name))
  for name in ("lr", "weight_decay", "grad_clip"):
    g.add_argument(_flag(name), type=float, help=_preset_help(name))
  _add_bool(g, "--packing", _preset_help("packing", BARE_TRUE))
  g = p.add_argument_group("run")
  g.add_argument("--data", metavar="PATH",
                 help="a text file, or a folder whose files are read in sorted order (default: the "
                      "Python standard library's sources)")
  g.add_argument("--data-parallel", choices=("none", "pmap", "mesh"), default="none",
                 help="pmap: split the global batch over every local device, average the gradients; "
                 "mesh: the same with one jit step over a batch sharded on a device mesh")
  g.add_argument("--ckpt-dir", metavar="DIR",
                 help="save orbax checkpoints here, every --ckpt-every steps and at the end "
                      "(default: none); a folder that holds checkpoints needs --resume")
  _add_bool(g, "--resume", "continue from the newest checkpoint in --ckpt-dir (needs --ckpt-dir)"
            + BARE_TRUE, default=False)
  g.add_argument("--stop-at", type=int, metavar="STEP",
                 help="stop after this step; the learning-rate schedule still spans --steps "
                      "(default: run all --steps)")
  g.add_argument("--out", metavar="PATH", help="write a JSON summary here (default: none)")
  g.add_argument("--peak-tflops", type=float,
                 help="dense peak TFLOP/s of all devices together, for MFU (default: from the "
                      "device kind: 989.4 per H100/H200, 312 per A100; none on CPU). MFU counts "
                      "the FlashAttention-2 paper's dense FLOPs, 6 * seq * params + 12 * layers * "
                      "width * seq^2: every [T, T] attention pair, whatever the causal mask, "
                      "--window or --packing skip; the JSON summary adds the attended-pair count")
  g.add_argument("--prompt",
                 help="the sample's prompt (default: 'def fibonacci(n):' and a newline for the "
                      "default data, else the first line of --data)")
  g.add_argument("--sample-tokens", type=int, default=300,
                 help="bytes to sample after training (0: no sample)")
  g.add_argument("--temperature", type=float, default=0.8,
                 help="the sample's temperature, >= 0 (0: greedy)")
  _add_bool(g, "--no-progress", "no progress bar or progress lines (evaluations and checkpoints "
            "are still printed); without it: a bar when stdout is a terminal, else a line every "
            "--log-every steps" + BARE_TRUE, default=False)
  return p


def parse_args(argv=None) -> argparse.Namespace:
  return build_parser().parse_args(argv)


def _flag_names(message: str) -> str:
  """A config error with its field names written as flags: ``n_head (4)`` -> ``--n-head (4)``."""
  flags = {field: _flag(name) for name, (_, field) in _OVERRIDES.items()}
  pattern = r"\b(" + "|".join(sorted(flags, key=len, reverse=True)) + r")\b"
  return re.sub(pattern, lambda m: flags[m.group(1)], message)


def configs_from_args(args: argparse.Namespace) -> tuple[GPTConfig, TrainConfig]:
  """The preset's configs with every flag that was given replacing its field."""
  mc, tc = get_preset(args.preset)
  changes: dict[type, dict[str, Any]] = {GPTConfig: {}, TrainConfig: {}}
  for flag, (cls, field) in _OVERRIDES.items():
    if getattr(args, flag) is not None:
      changes[cls][field] = getattr(args, flag)
  return dataclasses.replace(mc, **changes[GPTConfig]), dataclasses.replace(tc, **changes[TrainConfig])


def main(argv=None) -> dict:
  """Parses ``argv`` (None: ``sys.argv``), trains, prints and returns the summary. A flag value that
  cannot work exits through ``parser.error`` (usage, the message, status 2), before any training."""
  parser = build_parser()
  args = parser.parse_args(argv)
  try:
    mc, tc = configs_from_args(args)
  except (ValueError, TypeError) as e:
    parser.error(_flag_names(str(e)))
  run_args = dict(data_path=args.data, data_parallel=args.data_parallel, ckpt_dir=args.ckpt_dir,
                  resume=args.resume, stop_at=args.stop_at, sample_tokens=args.sample_tokens,
                  temperature=args.temperature, peak=args.peak_tflops)
  try:
    check_run(mc, tc, **run_args)
  except ValueError as e:
    parser.error(str(e))
  devices = jax.local_devices()
  print(f"preset {args.preset}: {mc}\n{tc}\njax {jax.__version__}, {len(devices)} x "
        f"{devices[0].device_kind} ({jax.default_backend()}), data parallel: {args.data_parallel}")
  print(describe_attention(mc, tc.packing), flush=True)
  try:
    _, summary = train(mc, tc, progress="off" if args.no_progress else "auto", prompt=args.prompt,
                       **run_args)
  except data_lib.DataError as e:
    parser.error(f"{e}; give more text (--data, --data-bytes) or a shorter --seq-len")
  summary["preset"] = args.preset
  fmt = lambda v, f: "n/a" if v is None else format(v, f)
  print(f"\n{summary['n_params']:,} parameters; final train loss "
        f"{fmt(summary['final_train_loss'], '.4f')}, "
        f"val loss {fmt(summary['final_val_loss'], '.4f')}; "
        f"{fmt(summary['tokens_per_s'], ',.0f')} tokens/s, "
        f"{fmt(summary['tflops_per_s'], '.3g')} TFLOP/s, MFU {fmt(summary['mfu'], '.1%')}; "
        f"wall time {summary['wall_time_s']:.1f} s")
  if "sample" in summary:
    print(f"\n--- sample (temperature {args.temperature}) ---\n{summary['sample']}\n---")
  if args.out:
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"summary written to {path}")
  return summary


if __name__ == "__main__":
  main()
