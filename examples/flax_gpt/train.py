"""Train the example GPT on byte-level text with fa2_jax FlashAttention.

    python -m examples.flax_gpt.train --preset tiny                 # CPU, a few minutes
    python -m examples.flax_gpt.train --preset small --out out/small.json       # one GPU
    python -m examples.flax_gpt.train --preset long8k --data-parallel pmap      # all local GPUs

One ``jax.jit`` (or ``jax.pmap``) train step: AdamW with linear warm-up and cosine decay, global-
norm gradient clipping. The progress bar shows the loss, tokens/s, model TFLOP/s and MFU.

FLOPs per sequence follow the FlashAttention-2 paper (forward + backward):
``6 * seq_len * n_params + 12 * n_layer * n_embd * seq_len**2``, with every parameter counted
(embeddings too) and the attention term not halved for causal masking. MFU divides the achieved
FLOP/s by the dense bfloat16 peak of the devices: 989.4 TFLOP/s per H100/H200 SXM, 312 per A100
(``--peak-tflops`` overrides it); on CPU it is "n/a".
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
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
from .config import ATTENTIONS, DTYPES, POSITIONS, PRESETS, GPTConfig, TrainConfig, get_preset
from .model import GPT, count_params, cross_entropy

# Dense bfloat16 tensor-core peaks (TFLOP/s per device) from NVIDIA's data sheets, SXM parts.
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}
AXIS = "data"  # the pmap axis name
VAL_SEED_OFFSET = 1_000_003  # validation batches use their own fixed seed stream
DEFAULT_PROMPT = "def fibonacci(n):\n"


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


def init_state(model: GPT, tx: optax.GradientTransformation, seed: int) -> TrainState:
  """Fresh parameters (from ``seed``) and optimizer state."""
  tokens = jnp.zeros((1, model.config.seq_len), jnp.int32)
  params = jax.jit(model.init)(jax.random.PRNGKey(seed), tokens)["params"]
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


def make_steps(model: GPT, tx: optax.GradientTransformation, axis_name: str | None):
  """The (train_step, eval_step) functions; with ``axis_name`` they average over that axis."""
  def loss_fn(params, x, y):
    return cross_entropy(model.apply({"params": params}, x), y)

  def mean(v):
    return jax.lax.pmean(v, axis_name) if axis_name else v

  def train_step(state: TrainState, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, x, y)
    grads, loss = mean(grads), mean(loss)  # every device holds an equal share of the batch
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

  def eval_step(params, x, y):
    return mean(loss_fn(params, x, y))

  return train_step, eval_step


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
    if mode != "pmap":
      raise ValueError(f"--data-parallel must be 'none' or 'pmap', got {mode!r}")
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

  def shard(self, x: np.ndarray) -> np.ndarray:
    """A global batch ``[B, ...]`` -> ``[devices, B / devices, ...]`` for pmap."""
    return x if self.mode == "none" else x.reshape(self.n_devices, -1, *x.shape[1:])

  def scalar(self, v) -> float:
    """A (replicated) metric as a Python float; waits for the device."""
    return float(v if self.mode == "none" else v[0])


# --- FLOPs, MFU -----------------------------------------------------------------------------------

def flops_per_sequence(config: GPTConfig, n_params: int) -> float:
  """Training FLOPs of one sequence (forward + backward), as in the FlashAttention-2 paper."""
  t = config.seq_len
  return 6.0 * t * n_params + 12.0 * config.n_layer * config.n_embd * t * t


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
  """Continues ``prompt`` by ``n_tokens`` bytes (greedy when temperature is 0).

  Each token runs the model on a fixed ``[1, seq_len]`` window (no KV cache: one compiled shape);
  the window slides once the text is longer than seq_len. Causal attention ignores the padding.
  """
  seq_len = model.config.seq_len

  @jax.jit
  def next_token(params, window, length, key):
    logits = model.apply({"params": params}, window)[0, length - 1]
    if temperature <= 0:
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


def _attention_backend(mc: GPTConfig) -> str:
  """The kernel that ``mc.attention`` runs here (the fa2_jax backend its dispatcher picks)."""
  if not mc.attention.startswith("flash"):
    return f"jax.nn.dot_product_attention/{mc.attention}"
  from fa2_jax import attention as fa
  impl = {"flash": None, "flash_triton": "triton", "flash_mosaic": "mosaic"}[mc.attention]
  hd = mc.n_embd // mc.n_head
  q = jax.ShapeDtypeStruct((1, mc.seq_len, mc.n_head, hd), jnp.dtype(mc.dtype))
  k = jax.ShapeDtypeStruct((1, mc.seq_len, mc.n_kv_head or mc.n_head, hd), jnp.dtype(mc.dtype))
  try:
    return "fa2_jax/" + fa._choose_backend(impl, True if mc.flash_interpret else None, q, k, True)
  except ValueError as e:
    return f"unavailable: {e}"


def _summary(mc: GPTConfig, tc: TrainConfig, throughput: _Throughput, *, n_params: int,
             peak: float | None, devices, data_parallel: str, data_path: str | None) -> dict:
  """Throughput, MFU and the run's settings, for the JSON summary."""
  tok_s = tflops = None
  if throughput.steps:
    tok_s = tc.batch_size * mc.seq_len * throughput.steps / throughput.seconds
    flops = flops_per_sequence(mc, n_params) * tc.batch_size * throughput.steps
    tflops = flops / throughput.seconds / 1e12
  return {
      "tokens_per_s": tok_s, "tflops_per_s": tflops,
      "mfu": tflops / peak if (tflops and peak) else None, "peak_tflops": peak,
      "n_params": n_params, "flops_per_sequence": flops_per_sequence(mc, n_params),
      "attention": mc.attention, "attention_backend": _attention_backend(mc),
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
          stop_at: int | None = None, progress: bool = True, sample_tokens: int = 0,
          prompt: str = DEFAULT_PROMPT, temperature: float = 0.8,
          peak: float | None = None) -> tuple[TrainState, dict]:
  """Trains ``tc.steps`` steps (or until ``stop_at``) and returns (host state, summary dict).

  Args:
    mc, tc: model and training configs.
    data_path: a text file or folder; None reads the Python standard library's sources.
    data_parallel: "none" (one device) or "pmap" (every local device).
    ckpt_dir: save checkpoints here (every tc.ckpt_every steps and at the end).
    resume: continue from the newest checkpoint in ckpt_dir when there is one.
    stop_at: stop after this step (the schedule still spans tc.steps), e.g. to test resuming.
    progress: show a tqdm progress bar.
    sample_tokens: bytes to sample after training (0: none).
    prompt, temperature: for the sample.
    peak: dense peak TFLOP/s of all devices together for MFU (None: from the device kind).
  """
  from tqdm.auto import tqdm

  t_start = time.perf_counter()
  train_tokens, val_tokens = data_lib.load_splits(data_path, tc.data_bytes, mc.seq_len)
  model, tx = GPT(mc), make_optimizer(tc)
  runner = Runner.create(data_parallel, model, tx, tc.batch_size)
  state = init_state(model, tx, tc.seed)
  n_params = count_params(state.params)
  manager = checkpoint_manager(ckpt_dir) if ckpt_dir else None
  if manager is not None and resume:
    restored = restore_checkpoint(manager, state)
    if restored is not None:
      state = restored
  start = int(state.step)
  last = min(tc.steps, stop_at) if stop_at is not None else tc.steps
  devices = jax.local_devices()[:runner.n_devices]
  peak = peak if peak is not None else peak_tflops(devices)
  flops_per_step = flops_per_sequence(mc, n_params) * tc.batch_size
  tokens_per_step = tc.batch_size * mc.seq_len

  batch = lambda tokens, i, seed: data_lib.get_batch(tokens, i, batch_size=tc.batch_size,
                                                     seq_len=mc.seq_len, seed=seed)
  def validate(st) -> float:
    losses = [runner.scalar(runner.eval_step(st.params, *map(runner.shard, batch(
        val_tokens, i, tc.seed + VAL_SEED_OFFSET)))) for i in range(tc.eval_batches)]
    return float(np.mean(losses))

  state = runner.put_state(state)
  history, throughput, loss, val_loss = [], _Throughput(), None, None
  bar = tqdm(total=last, initial=start, disable=not progress, dynamic_ncols=True, unit="step")
  t_window, steps_in_window = time.perf_counter(), 0
  for step in range(start, last):
    x, y = batch(train_tokens, step, tc.seed)
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
      bar.set_postfix({"loss": f"{loss:.4f}", "tok/s": f"{tok_s:,.0f}",
                       "TFLOP/s": f"{tflops:.3g}", "MFU": f"{tflops / peak:.1%}" if peak else "n/a"})
      bar.update(done - bar.n)
      t_window, steps_in_window = time.perf_counter(), 0
    evaluate = (tc.eval_every and done % tc.eval_every == 0) or done == tc.steps
    if evaluate:
      val_loss = validate(state)
      history.append({"step": done, "val_loss": val_loss})
      bar.write(f"step {done}: train loss {loss:.4f}, val loss {val_loss:.4f}")
    save = manager is not None and (done == last or (tc.ckpt_every and done % tc.ckpt_every == 0))
    if save:
      save_checkpoint(manager, runner.get_state(state))
    if evaluate or save:  # both waited for the device: restart the throughput window
      t_window, steps_in_window = time.perf_counter(), 0
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
    "interpret": (GPTConfig, "flash_interpret"),
    "batch_size": (TrainConfig, "batch_size"), "steps": (TrainConfig, "steps"),
    "lr": (TrainConfig, "lr"), "warmup_steps": (TrainConfig, "warmup_steps"),
    "weight_decay": (TrainConfig, "weight_decay"), "grad_clip": (TrainConfig, "grad_clip"),
    "eval_every": (TrainConfig, "eval_every"), "eval_batches": (TrainConfig, "eval_batches"),
    "log_every": (TrainConfig, "log_every"), "ckpt_every": (TrainConfig, "ckpt_every"),
    "seed": (TrainConfig, "seed"), "data_bytes": (TrainConfig, "data_bytes"),
}


def _bool(s: str) -> bool:
  if s.lower() in ("1", "true", "yes", "on"):
    return True
  if s.lower() in ("0", "false", "no", "off"):
    return False
  raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
  g = p.add_argument_group("model (default: the preset's)")
  g.add_argument("--attention", choices=ATTENTIONS,
                 help="flash: fa2_jax, default backend (XLA formula on CPU); flash_triton/flash_mosaic: "
                      "one fa2_jax backend; xla/cudnn: jax.nn.dot_product_attention")
  g.add_argument("--interpret", type=_bool, help="run the fa2_jax kernels in Pallas interpret mode")
  g.add_argument("--position", choices=POSITIONS)
  g.add_argument("--dtype", choices=DTYPES, help="compute dtype (parameters stay float32)")
  for name in ("seq_len", "n_layer", "n_head", "n_kv_head", "n_embd", "vocab_size"):
    g.add_argument("--" + name.replace("_", "-"), type=int)
  g.add_argument("--tie-embeddings", type=_bool)
  g.add_argument("--remat", type=_bool, help="rematerialise blocks in the backward pass")
  g.add_argument("--scan-layers", type=_bool,
                 help="run the blocks with flax.linen.scan (compile time independent of depth)")
  g = p.add_argument_group("training (default: the preset's)")
  for name in ("batch_size", "steps", "warmup_steps", "eval_every", "eval_batches", "log_every",
               "ckpt_every", "seed", "data_bytes"):
    g.add_argument("--" + name.replace("_", "-"), type=int)
  for name in ("lr", "weight_decay", "grad_clip"):
    g.add_argument("--" + name.replace("_", "-"), type=float)
  g = p.add_argument_group("run")
  g.add_argument("--data", help="a text file or folder (default: the Python stdlib's sources)")
  g.add_argument("--data-parallel", choices=("none", "pmap"), default="none")
  g.add_argument("--ckpt-dir", help="save orbax checkpoints here")
  g.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
  g.add_argument("--stop-at", type=int, help="stop after this step (the schedule keeps --steps)")
  g.add_argument("--out", help="write a JSON summary here")
  g.add_argument("--peak-tflops", type=float, help="dense peak TFLOP/s of all devices, for MFU")
  g.add_argument("--prompt", default=DEFAULT_PROMPT)
  g.add_argument("--sample-tokens", type=int, default=300)
  g.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
  g.add_argument("--no-progress", action="store_true")
  return p.parse_args(argv)


def configs_from_args(args: argparse.Namespace) -> tuple[GPTConfig, TrainConfig]:
  """The preset's configs with every flag that was given replacing its field."""
  mc, tc = get_preset(args.preset)
  changes: dict[type, dict[str, Any]] = {GPTConfig: {}, TrainConfig: {}}
  for flag, (cls, field) in _OVERRIDES.items():
    if getattr(args, flag) is not None:
      changes[cls][field] = getattr(args, flag)
  return dataclasses.replace(mc, **changes[GPTConfig]), dataclasses.replace(tc, **changes[TrainConfig])


def main(argv=None) -> dict:
  args = parse_args(argv)
  mc, tc = configs_from_args(args)
  devices = jax.local_devices()
  print(f"preset {args.preset}: {mc}\n{tc}\njax {jax.__version__}, {len(devices)} x "
        f"{devices[0].device_kind} ({jax.default_backend()}), data parallel: {args.data_parallel}")
  if mc.attention == "flash" and jax.default_backend() != "gpu" and not mc.flash_interpret:
    print("attention flash on CPU: fa2_jax uses its XLA formula (the kernels need a GPU, or "
          "--interpret true)")
  _, summary = train(mc, tc, data_path=args.data, data_parallel=args.data_parallel,
                     ckpt_dir=args.ckpt_dir, resume=args.resume, stop_at=args.stop_at,
                     progress=not args.no_progress, sample_tokens=args.sample_tokens,
                     prompt=args.prompt, temperature=args.temperature, peak=args.peak_tflops)
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
