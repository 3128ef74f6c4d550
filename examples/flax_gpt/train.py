"""Train the example GPT on byte-level text with fa2_jax FlashAttention.

    python -m examples.flax_gpt.train --preset tiny                 # CPU, a few minutes
    python -m examples.flax_gpt.train --preset small --out out/small.json       # one GPU
    python -m examples.flax_gpt.train --preset long8k --data-parallel pmap      # all local GPUs
    python -m examples.flax_gpt.train --preset long8k --data-parallel mesh      # same, one jit step
    python -m examples.flax_gpt.train --preset long8k --mesh data=2,context=4   # batch x sequence

One ``jax.jit`` (or ``jax.pmap``) train step: AdamW with linear warm-up and cosine decay, global-
norm gradient clipping. Progress (loss, tokens/s; model TFLOP/s on a GPU, MFU where the peak is
known) is a tqdm bar when stdout is a terminal, else one plain line every ``--log-every`` steps.
``--help`` lists every flag with its default; a bad flag is one line, ``train: error: ...; see
--help``, exit status 2.

TFLOP/s and MFU count the FlashAttention-2 paper's dense FLOPs per sequence (forward + backward),
``6 * seq_len * n_params + 12 * n_layer * n_embd * seq_len**2``; the JSON summary adds the
attended-pair count (``attended_flops_per_sequence``, ``attended_tflops_per_s``); see metrics.py.

This module holds the training loop (:func:`train`), the checks before a run, sampling and
:func:`main`; the rest of the package: cli.py (the command line), steps.py (optimizer, train state,
compiled steps), checkpoint.py (orbax checkpoints), metrics.py (FLOPs, MFU), parallel.py (the mesh
mode: data x context, several processes), model.py, data.py, config.py.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys
import time

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax

import fa2_jax

from . import data as data_lib
from .checkpoint import (CheckpointMismatch, checkpoint_manager, latest_checkpoint_step,
                         restore_checkpoint, save_checkpoint, unwritable_reason)
from .cli import (build_parser, cli_message, configs_from_args, data_size, describe_configs,
                  flag_names)
from .config import BYTE_VOCAB, GPTConfig, TrainConfig
from .metrics import Throughput, attended_flops_per_sequence, flops_per_sequence, peak_tflops
from .model import FLASH_IMPLEMENTATIONS, GPT, attention_core, count_params
from . import parallel
from .steps import TrainState, compiled_steps, init_state, packed_batch

VAL_SEED_OFFSET = 1_000_003  # validation batches use their own fixed seed stream
DEFAULT_PROMPT = "def fibonacci(n):\n"  # the sample's prompt for the default data (Python sources)
PROGRESS_MODES = ("auto", "bar", "lines", "off")


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


def sample_expectation(summary: dict) -> str | None:
  """One line on the quality a sample of this run can have, from its final validation loss (nats
  per byte; None: no line). A byte-level model writes gibberish until its loss is far below that
  of the bytes' own frequencies (about 3 nats on Python sources)."""
  loss = summary.get("final_val_loss")
  if loss is None:
    return None
  if loss >= 4.0:
    quality = ("near-random bytes: it has hardly started to learn (a uniform guess scores ln 256 = "
               "5.55)")
  elif loss >= 2.5:
    quality = "mostly spaces, letters and punctuation, hardly a word: it has barely started to learn"
  elif loss >= 1.5:
    quality = "byte-level gibberish with word-like fragments of the training text"
  elif loss >= 1.0:
    quality = ("lines shaped like the training text, with its common words and names, that do not "
               "make sense")
  else:
    quality = "text that looks like the training text line by line, without meaning across lines"
  return (f"(what to expect: a {summary['n_params'] / 1e6:.2g}M-parameter byte-level model after "
          f"{summary['end_step']} steps, validation loss {loss:.2f} nats per byte, writes {quality})")


# --- attention backend and the checks before a run -----------------------------------------------

def attention_dispatch(mc: GPTConfig, packing: bool = False,
                       context: int = 1) -> fa2_jax.Dispatch | None:
  """What fa2_jax runs for the model's attention here (``fa2_jax.backend_for`` on its shapes and
  variants: the window, the soft cap and, with ``packing``, segment ids), or None for
  ``xla``/``cudnn``, which are ``jax.nn.dot_product_attention``. ``context`` > 1 (the mesh's
  ``context`` axis): each device's call, its ``seq_len / context`` queries at a ``q_offset``
  against the whole sequence's keys (``parallel.context_attention``).

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
  sds = lambda *shape, dtype=jnp.int32: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
  t_local = mc.seq_len // context
  return fa2_jax.backend_for(sds(1, t_local, mc.n_head, mc.head_dim, dtype=mc.dtype),
                             sds(1, mc.seq_len, mc.kv_heads, mc.head_dim, dtype=mc.dtype),
                             is_causal=True, implementation=FLASH_IMPLEMENTATIONS[mc.attention],
                             interpret=True if mc.flash_interpret else None,
                             local_window_size=None if mc.window is None else (mc.window, 0),
                             logits_soft_cap=mc.soft_cap,
                             q_segment_ids=sds(1, t_local) if packing else None,
                             kv_segment_ids=sds(1, mc.seq_len) if packing else None,
                             q_offset=sds(1) if context > 1 else None)


def describe_attention(mc: GPTConfig, packing: bool = False, context: int = 1) -> str:
  """One line: the ``--attention`` choice and the kernels it runs here, in command-line terms
  (``context``: as for :func:`attention_dispatch`)."""
  dispatch = attention_dispatch(mc, packing, context)
  if dispatch is None:
    line = f"attention {mc.attention}: jax.nn.dot_product_attention(implementation={mc.attention!r})"
    return line + (f", the sequence split over {context} devices by XLA" if context > 1 else "")
  line = f"attention {mc.attention}: fa2_jax {cli_message(str(dispatch))}"
  if context > 1:
    strategy, why = mc.context_strategy, "--context-strategy"
    if strategy is None:
      strategy, why = fa2_jax.context_parallel_strategy(
          (1, mc.seq_len, mc.n_head, mc.head_dim), (1, mc.seq_len, mc.kv_heads, mc.head_dim),
          context, dtype=mc.dtype, has_kv_segment_ids=packing)
    line += (f"; context parallelism over {context} devices ({mc.seq_len // context} queries "
             f"each): {strategy} ({why})")
  return line


def run_mesh_axes(data_parallel: str, mesh: str | None) -> tuple[tuple[str, int], ...] | None:
  """The ``(("data", D), ("context", C))`` sizes of a mesh run (``--mesh``, or ``--data-parallel
  mesh``: every device on ``data``), over every process's devices; None for ``none``/``pmap``.

  Raises:
    ValueError: ``--mesh`` with ``--data-parallel pmap``, or a ``--mesh`` that does not fit.
  """
  if mesh is None:
    return parallel.mesh_axes(None, jax.device_count()) if data_parallel == "mesh" else None
  if data_parallel == "pmap":
    raise ValueError("--mesh runs one jit step on a device mesh; it cannot be combined with "
                     "--data-parallel pmap (leave --data-parallel out, or pass mesh)")
  return parallel.mesh_axes(mesh, jax.device_count())


def check_run(mc: GPTConfig, tc: TrainConfig, *, data_path: str | None, data_parallel: str,
              ckpt_dir: str | None, resume: bool, stop_at: int | None, sample_tokens: int,
              temperature: float, peak: float | None,
              mesh: str | None = None, fsdp: bool = False) -> fa2_jax.Dispatch | None:
  """Checks the arguments of :func:`train` that the configs cannot check alone, before any work.

  Returns:
    ``attention_dispatch(mc)`` (each device's call where ``--mesh`` splits the sequence).

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
  if data_parallel == "pmap" and tc.batch_size % n:
    raise ValueError(f"--batch-size {tc.batch_size} must be divisible by the {n} local devices "
                     f"for --data-parallel {data_parallel}")
  axes = run_mesh_axes(data_parallel, mesh)
  if not isinstance(fsdp, bool):
    raise TypeError(f"fsdp must be a bool, got {type(fsdp).__name__}")
  if fsdp and axes is None:
    raise ValueError("--fsdp shards the parameters and optimizer state over the mesh axis 'data': "
                     f"it needs --mesh or --data-parallel mesh, got --data-parallel {data_parallel}")
  context = 1
  if axes is not None:
    sizes, shown = dict(axes), parallel.describe_mesh(axes)
    context = sizes[parallel.CONTEXT]
    if tc.batch_size % sizes[parallel.DATA]:
      raise ValueError(f"--batch-size {tc.batch_size} must be divisible by the "
                       f"{sizes[parallel.DATA]} devices of the mesh axis 'data' (--mesh {shown})")
    if context > 1 and mc.seq_len % (2 * context):
      raise ValueError(f"--seq-len {mc.seq_len} must be divisible by {2 * context}: twice the "
                       f"{context} devices of the mesh axis 'context', whose layout gives each "
                       f"device two chunks of the sequence (--mesh {shown})")
    kv_heads = mc.n_kv_head or mc.n_head
    if mc.context_strategy == "all_to_all" and (mc.n_head % context or kv_heads % context):
      raise ValueError(f"--context-strategy all_to_all splits the heads over the {context} devices "
                       f"of the mesh axis 'context': --n-head {mc.n_head} and the {kv_heads} "
                       "key/value heads (--n-kv-head) must both be divisible by it; use "
                       f"--context-strategy ring or all_gather (--mesh {shown})")
  if ckpt_dir and jax.process_count() > 1:
    raise ValueError(f"--ckpt-dir with {jax.process_count()} processes: this example saves "
                     "checkpoints from one process only; run without --ckpt-dir")
  if data_path is not None and not os.path.exists(data_path):
    raise ValueError(f"--data {data_path}: no such file or folder")
  if resume and not ckpt_dir:
    raise ValueError("--resume needs --ckpt-dir, the folder of the checkpoints to resume from")
  if ckpt_dir:
    if os.path.exists(ckpt_dir) and not os.path.isdir(ckpt_dir):
      raise ValueError(f"--ckpt-dir {ckpt_dir} is a file, not a folder")
    problem = unwritable_reason(ckpt_dir)
    if problem is not None:
      raise ValueError(f"--ckpt-dir {ckpt_dir}: {problem}; choose a folder you can write to")
    newest = latest_checkpoint_step(ckpt_dir)
    if newest is not None and not resume:
      raise ValueError(f"--ckpt-dir {ckpt_dir} already holds checkpoints (newest: step {newest}): "
                       "pass --resume to continue from it, or choose another folder")
  if stop_at is not None and stop_at < 1:
    raise ValueError(f"--stop-at must be >= 1, got {stop_at}")
  if stop_at is not None and stop_at > tc.steps:
    raise ValueError(f"--stop-at {stop_at} is past --steps {tc.steps} (the last step of the "
                     "learning-rate schedule); give a smaller --stop-at or more --steps")
  if sample_tokens < 0:
    raise ValueError(f"--sample-tokens must be >= 0, got {sample_tokens}")
  if not temperature >= 0:
    raise ValueError(f"--temperature must be >= 0 (0: greedy), got {temperature}")
  if peak is not None and not peak > 0:
    raise ValueError(f"--peak-tflops must be > 0, got {peak}")
  try:
    return attention_dispatch(mc, tc.packing, context)
  except ValueError as e:
    raise ValueError(cli_message(str(e))) from e


# --- the training loop ----------------------------------------------------------------------------

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


def _summary(mc: GPTConfig, tc: TrainConfig, throughput: Throughput, *, n_params: int,
             peak: float | None, devices, data_parallel: str, data_path: str | None,
             mesh_axes=None, fsdp: bool = False) -> dict:
  """Throughput, MFU and the run's settings, for the JSON summary."""
  tok_s = tflops = attended_tflops = None
  context = dict(mesh_axes or ()).get(parallel.CONTEXT, 1)
  dispatch = attention_dispatch(mc, tc.packing, context)
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
      "mesh": None if mesh_axes is None else dict(mesh_axes), "fsdp": fsdp,
      "processes": jax.process_count(),
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
          peak: float | None = None, mesh: str | None = None,
          fsdp: bool = False) -> tuple[TrainState, dict]:
  """Trains ``tc.steps`` steps (or until ``stop_at``) and returns (host state, summary dict).

  Args:
    mc, tc: model and training configs.
    data_path: a text file or folder; None reads the Python standard library's sources.
    data_parallel: "none" (one device), "pmap" (every local device) or "mesh" (every device of
      every process on the mesh axis "data"; see parallel.py).
    ckpt_dir: save checkpoints here (every tc.ckpt_every steps and at the end); a folder that
      already holds checkpoints needs ``resume``.
    resume: continue from the newest checkpoint in ckpt_dir (a fresh start, said so, when it has
      none).
    stop_at: stop after this step (the schedule still spans tc.steps), e.g. to test resuming.
    progress: "auto" (a tqdm bar when stdout is a terminal, else "lines"), "bar", "lines" (a plain
      line every tc.log_every steps) or "off" (only evaluations and checkpoints are printed);
      True/False mean "auto"/"off".
    sample_tokens: bytes to sample after training (0: none).
    prompt: the sample's prompt (None: DEFAULT_PROMPT for the default data, else the first
      non-blank line of the data, at most 80 bytes: data.opening_line).
    temperature: the sample's temperature (0: greedy).
    peak: dense peak TFLOP/s of all devices together for MFU (None: from the device kind).
    mesh: ``"data=D,context=C"`` (``--mesh``; either axis may be left out): the batch split over
      D devices and the sequence over C, every device of every process (parallel.py); implies
      ``data_parallel="mesh"``.
    fsdp: (``--fsdp``) with a mesh, the parameters and optimizer state sharded over its axis
      "data" instead of replicated (parallel.state_specs).

  Several processes (``jax.distributed`` initialized before): each runs this with the same
  arguments; only process 0 prints.

  Raises:
    ValueError: from :func:`check_run`, before any work; data_lib.DataError: text too short.
  """
  from tqdm.auto import tqdm

  mode = progress_mode(progress)
  check_run(mc, tc, data_path=data_path, data_parallel=data_parallel, ckpt_dir=ckpt_dir,
            resume=resume, stop_at=stop_at, sample_tokens=sample_tokens, temperature=temperature,
            peak=peak, mesh=mesh, fsdp=fsdp)
  axes = run_mesh_axes(data_parallel, mesh)
  if axes is not None:
    data_parallel = "mesh"
  lead = jax.process_index() == 0  # the process that prints
  t_start = time.perf_counter()
  train_data, val_data = data_lib.load_documents(data_path, tc.data_bytes, mc.seq_len)
  if prompt is None:
    prompt = DEFAULT_PROMPT if data_path is None else data_lib.opening_line(train_data.tokens)
  model, tx, runner = compiled_steps(mc, tc, data_parallel, jax.local_device_count(), axes, fsdp)
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
  devices = (list(runner.mesh.devices.flat) if axes is not None
             else jax.local_devices()[:runner.n_devices])
  peak = peak if peak is not None else peak_tflops(devices)
  # TFLOP/s on a GPU or with a known peak; MFU with a known peak (on CPU neither means much).
  show_flops = peak is not None or devices[0].platform != "cpu"
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
  history, throughput, loss, val_loss = [], Throughput(), None, None
  if not lead:
    mode = "off"
  if mode == "bar":
    bar = tqdm(total=last, initial=start, dynamic_ncols=True, unit="step", file=sys.stdout)
    say = bar.write  # prints above the bar
  else:
    bar = None
    say = (lambda line: print(line, flush=True)) if lead else (lambda line: None)
  t_window, steps_in_window = time.perf_counter(), 0
  for step in range(start, last):
    x, y = batch(train_data, step, tc.seed)
    state, metrics = runner.train_step(state, runner.shard(x), runner.shard(y))
    steps_in_window += 1
    done = step + 1
    # Evaluations at every eval_every steps and at the last step run (stop_at included).
    evaluate = (tc.eval_every and done % tc.eval_every == 0) or done == last
    if done % tc.log_every == 0 or done == last or step == start or evaluate:
      loss = runner.scalar(metrics["loss"])  # waits for the device
      dt = time.perf_counter() - t_window
      if step != start:  # the first step includes compilation
        throughput.add(dt, steps_in_window)
      tok_s = tokens_per_step * steps_in_window / dt
      tflops = flops_per_step * steps_in_window / dt / 1e12
      history.append({"step": done, "loss": loss})
      columns = {"loss": f"{loss:.4f}", "tok/s": f"{tok_s:,.0f}"}
      if show_flops:
        columns["TFLOP/s"] = f"{tflops:.3g}"
      if peak:
        columns["MFU"] = f"{tflops / peak:.1%}"
      if bar is not None:
        bar.set_postfix(columns)
        bar.update(done - bar.n)
      elif mode == "lines" and (done % tc.log_every == 0 or done == last or step == start):
        say(f"step {done}/{last}: loss {columns.pop('loss')}, {columns.pop('tok/s')} tok/s"
            + "".join(f", {value} {name}" if name != "MFU" else f", MFU {value}"
                      for name, value in columns.items())
            + (" (includes compilation)" if step == start else ""))
      t_window, steps_in_window = time.perf_counter(), 0
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
                          data_parallel=data_parallel, data_path=data_path, mesh_axes=axes,
                          fsdp=fsdp))
  summary["history"] = history
  if sample_tokens and lead:
    summary["prompt"] = prompt
    summary["sample"] = generate(model, state.params, prompt, sample_tokens,
                                 temperature=temperature, seed=tc.seed)
  summary["wall_time_s"] = time.perf_counter() - t_start
  return state, summary


def main(argv=None) -> dict:
  """Parses ``argv`` (None: ``sys.argv``), trains, prints and returns the summary. A flag value that
  cannot work exits through ``parser.error`` (one line, status 2), before any training."""
  parser = build_parser()
  args = parser.parse_args(argv)
  try:
    mc, tc = configs_from_args(args)
    # Before anything touches a device (check_run counts them).
    parallel.initialize_distributed(parallel.distributed_settings(
        args.coordinator, args.num_processes, args.process_id))
  except (ValueError, TypeError) as e:
    parser.error(flag_names(str(e)))
  run_args = dict(data_path=args.data, data_parallel=args.data_parallel, ckpt_dir=args.ckpt_dir,
                  resume=args.resume, stop_at=args.stop_at, sample_tokens=args.sample_tokens,
                  temperature=args.temperature, peak=args.peak_tflops, mesh=args.mesh,
                  fsdp=bool(args.fsdp))
  try:
    check_run(mc, tc, **run_args)
    axes = run_mesh_axes(args.data_parallel, args.mesh)
    # the flag given for a run it would not reach (a model config may carry it to one device)
    if args.context_strategy is not None and dict(axes or ()).get(parallel.CONTEXT, 1) == 1:
      raise ValueError(f"--context-strategy {args.context_strategy} exchanges the sequence over "
                       "the mesh axis 'context': it needs --mesh with context=C, C > 1")
  except ValueError as e:
    parser.error(str(e))
  lead = jax.process_index() == 0  # the process that prints
  devices = jax.devices() if axes is not None else jax.local_devices()
  data = args.data or "the Python standard library's sources"
  layout = ""
  if axes is not None:
    layout = f", mesh {parallel.describe_mesh(axes)}" + (", state sharded over data (FSDP)"
                                                         if args.fsdp else "")
  elif args.data_parallel != "none":
    layout = f", data parallel: {args.data_parallel}"
  if jax.process_count() > 1:
    layout += f", {jax.process_count()} processes"
  if lead:
    print("\n".join(describe_configs(args.preset, mc, tc)))
    print(f"  data: {data}, at most {data_size(tc.data_bytes)}; jax {jax.__version__} on "
          f"{len(devices)} x {devices[0].device_kind} ({jax.default_backend()}){layout}")
    context = dict(axes or ()).get(parallel.CONTEXT, 1)
    print(describe_attention(mc, tc.packing, context), flush=True)
  try:
    _, summary = train(mc, tc, progress="off" if args.no_progress else "auto", prompt=args.prompt,
                       **run_args)
  except data_lib.DataError as e:
    parser.error(f"{e}; give more text (--data, --data-bytes) or a shorter --seq-len")
  except CheckpointMismatch as e:
    parser.error(str(e))
  summary["preset"] = args.preset
  if not lead:  # process 0 prints the summary and writes --out
    return summary
  fmt = lambda v, f: "n/a" if v is None else format(v, f)
  speed = f"{fmt(summary['tokens_per_s'], ',.0f')} tokens/s"
  if summary["peak_tflops"] is not None or summary["devices"]["platform"] != "cpu":
    speed += f", {fmt(summary['tflops_per_s'], '.3g')} TFLOP/s"
  if summary["peak_tflops"] is not None:
    speed += f", MFU {fmt(summary['mfu'], '.1%')}"
  print(f"\n{summary['n_params']:,} parameters; final train loss "
        f"{fmt(summary['final_train_loss'], '.4f')}, "
        f"val loss {fmt(summary['final_val_loss'], '.4f')}; {speed}; "
        f"wall time {summary['wall_time_s']:.1f} s")
  if "sample" in summary:
    expect = sample_expectation(summary)
    print(f"\n--- sample: {args.sample_tokens} bytes after the prompt, temperature "
          f"{args.temperature:g} ---\n{summary['sample']}\n---" + (f"\n{expect}" if expect else ""))
  if args.out:
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"summary written to {path}")
  return summary


if __name__ == "__main__":
  main()
