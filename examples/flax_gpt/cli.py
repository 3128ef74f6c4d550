"""The command line of ``python -m examples.flax_gpt.train``: its parser, help text and messages.

:func:`build_parser` defines every flag; a model or training flag left out keeps its preset's value,
and its help lists the presets' values. :func:`configs_from_args` applies the flags to the preset's
configs; :func:`flag_names` and :func:`cli_message` rewrite config field names and fa2_jax argument
names in error messages as this command line's flags.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any

from .parallel import DISTRIBUTED_ENV, parse_mesh
from .config import (ATTENTIONS, CONTEXT_STRATEGIES, DTYPES, POSITIONS, PRESETS, GPTConfig,
                     TrainConfig, get_preset)

# The parser's description: the first line of train.py's docstring.
DESCRIPTION = "Train the example GPT on byte-level text with fa2_jax FlashAttention."

# flag -> (config class, field). Flags left at None keep the preset's value.
_OVERRIDES = {
    "seq_len": (GPTConfig, "seq_len"), "n_layer": (GPTConfig, "n_layer"),
    "n_head": (GPTConfig, "n_head"), "n_kv_head": (GPTConfig, "n_kv_head"),
    "n_embd": (GPTConfig, "n_embd"), "vocab_size": (GPTConfig, "vocab_size"),
    "position": (GPTConfig, "position"), "dtype": (GPTConfig, "dtype"),
    "attention": (GPTConfig, "attention"), "tie_embeddings": (GPTConfig, "tie_embeddings"),
    "remat": (GPTConfig, "remat"), "scan_layers": (GPTConfig, "scan_layers"),
    "interpret": (GPTConfig, "flash_interpret"), "window": (GPTConfig, "window"),
    "soft_cap": (GPTConfig, "soft_cap"), "context_strategy": (GPTConfig, "context_strategy"),
    "packing": (TrainConfig, "packing"),
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
    "context_strategy": "how the attention exchanges the sequence over --mesh's context axis "
                        "(fa2_jax.context_parallel_attention): ring (keys and values passed "
                        "around the devices), all_to_all (heads traded for the sequence) or "
                        "all_gather (keys and values gathered); unset: fa2_jax's choice",
    "packing": "each file of the data is a document: the training windows carry per-token segment "
               "ids (no attention across documents), positions restarting at 0 at each document, "
               "and targets in the next document left out of the loss (a single --data file is "
               "one document; needs --attention flash*). TFLOP/s and MFU still count the dense "
               "[T, T] attention",
    "batch_size": "global batch in sequences (split over the devices with --data-parallel pmap or "
                  "mesh)",
    "steps": "optimizer steps; also the length of the learning-rate schedule (warm-up, then cosine "
             "decay; a run of at most --warmup-steps steps stops before the peak --lr)",
    "lr": "peak learning rate, after a linear warm-up; cosine decay to a tenth of it",
    "warmup_steps": "linear learning-rate warm-up steps",
    "weight_decay": "AdamW decoupled weight decay, on matrices only",
    "grad_clip": "global-norm gradient clipping threshold (0: no clipping)",
    "eval_every": "steps between validation losses (0: only at the last step run)",
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


def add_model_flags(g, bools=("tie_embeddings", "remat", "scan_layers")) -> None:
  """The model flags (a :class:`GPTConfig` field each, the preset's value when left out) in the
  argument group ``g``; ``bools``: the boolean ones (generate.py has no ``--remat``)."""
  g.add_argument("--attention", choices=ATTENTIONS, help=_preset_help("attention"))
  _add_bool(g, "--interpret", _preset_help("interpret", BARE_TRUE))
  g.add_argument("--position", choices=POSITIONS, help=_preset_help("position"))
  g.add_argument("--dtype", choices=DTYPES, help=_preset_help("dtype"))
  for name in ("seq_len", "n_layer", "n_head", "n_kv_head", "n_embd", "vocab_size"):
    g.add_argument(_flag(name), type=int, help=_preset_help(name))
  for name in bools:
    _add_bool(g, _flag(name), _preset_help(name, BARE_TRUE))
  g.add_argument("--window", type=int, metavar="N", help=_preset_help("window"))
  g.add_argument("--soft-cap", type=float, metavar="X", help=_preset_help("soft_cap"))
  g.add_argument("--context-strategy", choices=CONTEXT_STRATEGIES,
                 help=_preset_help("context_strategy"))


class _Parser(argparse.ArgumentParser):
  """argparse with its usage errors as one line, ``train: error: MESSAGE; see --help``, and exit
  status 2 (argparse's own prints the whole usage, 35 lines, before the message)."""

  def error(self, message: str):
    self.exit(2, f"train: error: {' '.join(message.splitlines())}; see --help\n")


def build_parser() -> argparse.ArgumentParser:
  """The command line. A model or training flag left out keeps its preset's value."""
  p = _Parser(prog="python -m examples.flax_gpt.train", description=DESCRIPTION,
              formatter_class=_HelpFormatter)
  p.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                 help="the model and training configs; the flags below override single fields")
  add_model_flags(p.add_argument_group("model (defaults: the preset's)"))
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
                 "mesh: the same with one jit step over a batch sharded on a device mesh (every "
                 "device of every process on its 'data' axis; see --mesh)")
  g.add_argument("--mesh", metavar="data=D,context=C", type=_mesh_spec,
                 help="one jit step on a D x C mesh of every device (of every process): the batch "
                      "split over D, the sequence over C (context parallelism, "
                      "fa2_jax.context_parallel_attention: see --context-strategy); the parameters "
                      "replicated (see --fsdp). Either axis may be left out (it takes the other "
                      "devices); implies --data-parallel mesh (default: no mesh)")
  _add_bool(g, "--fsdp", "with --mesh or --data-parallel mesh: shard the parameters and the "
            "optimizer state over the mesh axis 'data' (each array along its largest dimension "
            "that the axis divides; XLA gathers them where they are used) instead of replicating "
            "them (default: false)", default=False)
  procs = p.add_argument_group(
      "processes (several processes, one per host or GPU, each with the same flags but its "
      "--process-id; unset: one process, or the environment variables "
      + ", ".join(DISTRIBUTED_ENV.values()) + ")")
  procs.add_argument("--coordinator", metavar="HOST:PORT",
                 help="process 0's address, where jax.distributed.initialize meets the others")
  procs.add_argument("--num-processes", type=int, metavar="N", help="processes in the run")
  procs.add_argument("--process-id", type=int, metavar="I", help="this process, 0 .. N-1")
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
                      "default data, else the first non-blank line of --data, at most 80 "
                      "bytes)")
  g.add_argument("--sample-tokens", type=int, default=300,
                 help="bytes to sample after training (0: no sample)")
  g.add_argument("--temperature", type=float, default=0.8,
                 help="the sample's temperature, >= 0 (0: greedy)")
  _add_bool(g, "--no-progress", "no progress bar or progress lines (evaluations and checkpoints "
            "are still printed); without it: a bar when stdout is a terminal, else a line every "
            "--log-every steps" + BARE_TRUE, default=False)
  return p


def _mesh_spec(spec: str) -> str:
  """``--mesh``'s value, checked for its form (the device count is checked before the run)."""
  try:
    parse_mesh(spec)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None
  return spec


def parse_args(argv=None) -> argparse.Namespace:
  return build_parser().parse_args(argv)


def flag_names(message: str) -> str:
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


def _count(n: int, noun: str) -> str:
  """``3 layers``, ``1 layer``."""
  return f"{n:,} {noun}{'' if n == 1 else 's'}"


def data_size(n_bytes: int) -> str:
  """``8 MiB`` for whole MiB, else ``200,000 bytes``."""
  return f"{n_bytes // 2**20} MiB" if n_bytes % 2**20 == 0 else f"{n_bytes:,} bytes"


def describe_configs(preset: str, mc: GPTConfig, tc: TrainConfig) -> list[str]:
  """The run's model and training in a few readable lines: what the preset is, and the flags that
  changed it (the JSON summary of ``--out`` keeps every field)."""
  heads = _count(mc.n_head, "head") + f" of {mc.head_dim}"
  if mc.kv_heads != mc.n_head:
    heads += f" ({_count(mc.kv_heads, 'key/value head')})"
  vocab = "bytes" if mc.vocab_size == 256 else f"bytes in a {mc.vocab_size:,}-entry vocabulary"
  features = [f"{mc.position} positions", f"{mc.dtype} compute"]
  if mc.window is not None:
    features.append(f"a sliding window of {mc.window}")
  if mc.soft_cap is not None:
    features.append(f"logits soft-capped at {mc.soft_cap:g}")
  if not mc.tie_embeddings:
    features.append("untied embeddings")
  features += [name for name, on in (("remat", mc.remat), ("scanned layers", mc.scan_layers)) if on]
  evals = (f"validation every {tc.eval_every} steps" if tc.eval_every
           else "validation at the last step")
  lines = [
      f"model: a GPT of {_count(mc.n_layer, 'layer')} x {mc.n_embd} wide, {heads}, a context of "
      f"{mc.seq_len} tokens ({vocab}), {', '.join(features)}",
      f"training: {_count(tc.steps, 'step')} of {_count(tc.batch_size, 'sequence')}"
      + (" (packed documents)" if tc.packing else "")
      + f", learning rate {tc.lr:g} after {_count(tc.warmup_steps, 'warm-up step')}, then cosine "
      f"decay; "
      f"{evals}"]
  preset_mc, preset_tc = get_preset(preset)
  changed = [f"{_flag(name)} {_show(getattr(configs[1], field))}"
             for name, (cls, field) in _OVERRIDES.items()
             for configs in [(preset_mc, mc) if cls is GPTConfig else (preset_tc, tc)]
             if getattr(configs[0], field) != getattr(configs[1], field)]
  head = f"preset {preset}" + (f", changed by {' '.join(changed)}" if changed else "")
  return [head] + ["  " + line for line in lines]


# fa2_jax's argument names in its messages -> this command line's flags (longest first).
_CLI_NAMES = (
    ("implementation='triton' or None", "--attention flash_triton or --attention flash"),
    ("implementation='xla' or None", "--attention xla or --attention flash"),
    ("implementation=None or 'xla'", "--attention flash or --attention xla"),
    ("implementation='triton'", "--attention flash_triton"),
    ("implementation='mosaic'", "--attention flash_mosaic"),
    ("implementation='xla'", "--attention xla"),
    ("implementation=None", "--attention flash"),
    ("interpret=True", "--interpret true"),
    ("local_window_size sides", "--window"),  # the example passes (window, 0)
    ("(None for unbounded)", "(unset: the whole context)"),
    ("logits_soft_cap", "--soft-cap"),
)


def cli_message(message: str) -> str:
  """An fa2_jax message with its argument names written as this command line's flags."""
  for api_name, flag in _CLI_NAMES:
    message = message.replace(api_name, flag)
  return message
