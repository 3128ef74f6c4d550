"""What every benchmark script shares on the command line: common flags, where results go, the CPU
fallback, ``--merge``, random inputs and the progress bar."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .device import GPU_BACKENDS, ROOT, device_slug, gpu_in_subprocess
from .recorder import Budget
from .report import merge_json, out_name, write_json

DEFAULT_OUT = ROOT / "out"  # ignored by git; benchmarks/results/ only when --out names it
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
SMOKE_ITERS, SMOKE_REPS = 2, 2  # --smoke: a few calls check the harness; the numbers mean nothing


def parse_ints(text: str) -> list[int]:
  """'512,1k,2K,16384' -> [512, 1024, 2048, 16384]; every size at least 1."""
  out = []
  for tok in str(text).replace(" ", "").split(","):
    if not tok:
      continue
    mult = 1024 if tok[-1] in "kK" else 1
    try:
      out.append(int(float(tok[:-1] if mult > 1 else tok) * mult))
    except ValueError:
      raise argparse.ArgumentTypeError(f"not a list of sizes: {text!r}") from None
    if out[-1] < 1:
      raise argparse.ArgumentTypeError(f"sizes must be at least 1: {text!r}")
  return out


def _whole_number(text: str, least: int) -> int:
  try:
    n = int(str(text).strip())
  except ValueError:
    raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
  if n < least:
    raise argparse.ArgumentTypeError(f"must be at least {least}, got {n}")
  return n


def positive_int(text: str) -> int:
  """A count or size flag (``--iters``, ``--reps``, ``--calls``, ``--heads`` ...): a whole number >= 1;
  anything else is an argparse error (usage, the message, exit code 2)."""
  return _whole_number(text, 1)


def positive_float(text: str) -> float:
  """A time flag (``--budget-s``): a finite number of seconds > 0."""
  try:
    x = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
  if not (0.0 < x < float("inf")):
    raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
  return x


def parse_strs(text: str) -> list[str]:
  """'a,b*,c' -> ['a', 'b*', 'c']; an empty list (``''``, ``','``) is an argparse error, not "all"."""
  out = [t for t in str(text).replace(" ", "").split(",") if t]
  if not out:
    raise argparse.ArgumentTypeError(f"names nothing: {text!r}")
  return out


def nonnegative_int(text: str) -> int:
  """A count that may be 0 (``--random``): a whole number >= 0."""
  return _whole_number(text, 0)


def parse_shape(text: str) -> tuple[int, int, int, int]:
  """'B,T,N,H' -> four whole numbers >= 1 (an attention call's q shape)."""
  try:
    shape = tuple(int(t) for t in str(text).replace(" ", "").split(","))
  except ValueError:
    raise argparse.ArgumentTypeError(f"not B,T,N,H whole numbers: {text!r}") from None
  if len(shape) != 4 or min(shape) < 1:
    raise argparse.ArgumentTypeError(f"must be four whole numbers >= 1, B,T,N,H: {text!r}")
  return shape


def parse_shapes(text: str) -> list[tuple[int, int, int, int]]:
  """'B,T,N,H;B,T,N,H' -> a non-empty list of shapes (:func:`parse_shape`)."""
  parts = [s for s in str(text).split(";") if s.strip()]
  if not parts:
    raise argparse.ArgumentTypeError(f"names no shape: {text!r}")
  return [parse_shape(s) for s in parts]


def call_kwargs(text: str | None) -> dict:
  """``--kwargs``: a Python dict literal of further ``flash_attention`` arguments (an attention
  variant, e.g. ``{"logits_soft_cap": 50.0, "local_window_size": (4095, 0)}``) -> dict; lists
  become tuples, or float32 arrays for ``alibi_slopes``. SystemExit naming ``--kwargs`` when it is not one."""
  import ast
  if not text:
    return {}
  try:
    out = ast.literal_eval(text)
  except (ValueError, SyntaxError) as e:
    raise SystemExit(f"--kwargs: {text!r} is not a Python dict literal ({e})") from None
  if not isinstance(out, dict) or not all(isinstance(k, str) for k in out):
    raise SystemExit(f"--kwargs: {text!r} is not a dict of argument names")
  import numpy as np
  arrays = ("alibi_slopes",)  # array arguments: a list of numbers becomes a float32 array

  def value(k, v):
    if not isinstance(v, list):
      return v
    return np.asarray(v, np.float32) if k in arrays else tuple(v)
  return {k: value(k, v) for k, v in out.items()}


def add_shape_args(p: argparse.ArgumentParser, default_shapes: str) -> None:
  """``--shapes "B,T,N,H;..."`` and ``--causal both|true|false`` of the kernel diagnostics; read them
  back with :func:`shapes_and_masks`."""
  p.add_argument("--shapes", default=default_shapes, help="B,T,N,H;...")
  p.add_argument("--causal", default="both", choices=("both", "true", "false"))


def shapes_and_masks(args) -> list[tuple[str, tuple[int, int, int, int], tuple[bool, ...]]]:
  """``[(shape text, (B, T, N, H), causal values)]`` from :func:`add_shape_args`' arguments."""
  masks = {"both": (False, True), "true": (True,), "false": (False,)}[args.causal]
  out = []
  for shape in args.shapes.split(";"):
    dims = tuple(int(x) for x in shape.split(","))
    if len(dims) != 4:
      raise SystemExit(f"--shapes: {shape!r} is not B,T,N,H")
    out.append((shape, dims, masks))
  return out


def impl_names(text: str) -> list[str]:
  """``--impls``: names of benchmarks/impls.py entries; an unknown one is an argparse error naming it."""
  from . import impls
  try:
    names = impls.parse_names(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None
  if not names:  # '' would otherwise mean every row
    raise argparse.ArgumentTypeError(f"names no implementation: {text!r}")
  return names


def add_common_args(p: argparse.ArgumentParser) -> None:
  g = p.add_argument_group("common")
  g.add_argument("--out", type=Path, default=None,
                 help=f"output folder (default {DEFAULT_OUT.name}/<gpu>/ in the checkout, ignored by git)")
  g.add_argument("--tag", default=None, help="suffix for the output file names")
  mode = g.add_mutually_exclusive_group()
  mode.add_argument("--quick", action="store_true", help="a small subset (minutes on an H200)")
  mode.add_argument("--smoke", action="store_true",
                    help="tiny shapes on the CPU in Pallas interpret mode: exercises the harness "
                         "(chosen automatically where there is no GPU)")
  g.add_argument("--budget-s", type=positive_float, default=None,
                 help="skip (and record as skipped) the cells that would start after this many seconds")
  g.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)  # epoch s (run_all)
  g.add_argument("--merge", type=Path, nargs="+", default=None,
                 help="render md/png from these result files (cells combined) instead of measuring")
  g.add_argument("--seed", type=int, default=0)
  g.add_argument("--resume", action="store_true",
                 help="keep the cells of an existing result file, skip what crashed the last run")


def cpu_fallback(args, info: dict, script: str) -> None:
  """Without a GPU the full sweeps would run for hours in interpret mode: run the smoke size instead.
  ``info`` without a ``backend`` (this process started none) is checked in a child process."""
  if args.smoke:
    return
  backend = info.get("backend")
  if backend in GPU_BACKENDS or (backend is None and gpu_in_subprocess()):
    return
  print(f"[{script}] no GPU (jax backend {backend or 'cpu'}): running the CPU smoke size (--smoke) "
        "instead of the GPU sweep", file=sys.stderr, flush=True)
  args.smoke, args.quick = True, False


def smoke_counts(args) -> None:
  """At the smoke size ``--iters`` / ``--reps`` become SMOKE_ITERS / SMOKE_REPS: call it after
  ``cpu_fallback`` and before the config is recorded, so the result file names the counts that ran."""
  if args.smoke:
    args.iters, args.reps = SMOKE_ITERS, SMOKE_REPS


def make_budget(args) -> Budget:
  deadline = args.deadline
  if args.budget_s is not None:
    d = time.time() + args.budget_s
    deadline = d if deadline is None else min(deadline, d)
  return Budget(deadline)


def resolve_out(args, info: dict) -> Path:
  out = Path(args.out) if args.out is not None else DEFAULT_OUT / device_slug(info)
  out.mkdir(parents=True, exist_ok=True)
  return out


def script_main(argv, parser, run, render, summary, stem: str, key):
  """Shared ``main``: measure (``run(args)``), or with ``--merge`` combine result files and render."""
  args = parser.parse_args(argv)
  if not args.merge:
    return run(args)
  try:
    data = merge_json(args.merge, key)
  except OSError as e:  # missing file, a folder, no permission
    parser.error(f"--merge: cannot read {e.filename}: {e.strerror}")
  except ValueError as e:  # not JSON, not a benchmark result, results of different scripts
    parser.error(f"--merge: {e}")
  tag = args.tag or "merged"
  out = Path(args.out) if args.out else Path(args.merge[0]).parent
  out.mkdir(parents=True, exist_ok=True)
  write_json(out / out_name(stem, tag, "json"), data)
  files = render(data, out, tag)
  print(summary(data), flush=True)
  data["files"] = [str(out / out_name(stem, tag, "json")), *map(str, files)]
  return data


def jnp_dtype(name: str):
  import jax.numpy as jnp
  return jnp.dtype(DTYPES.get(name, name))


def random_inputs(seed: int, shapes, dtype):
  """Fresh standard-normal arrays (never zeros), one per shape: ``jax.random.normal(key, shape, dtype)``."""
  import jax
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  return [jax.random.normal(k, s, dtype) for k, s in zip(keys, shapes)]


class _NullBar:
  def __init__(self, total=None, desc=""):
    self.n, self.total, self.desc = 0, total, desc

  def update(self, k=1):
    self.n += k

  def set_postfix_str(self, s):
    pass

  def close(self):
    pass


def progress(total: int, desc: str):
  """A tqdm bar on stderr (sparse updates when not a terminal, to keep logs short)."""
  try:
    from tqdm import tqdm
  except Exception:  # noqa: BLE001 - tqdm is optional
    return _NullBar(total, desc)
  tty = sys.stderr.isatty()
  return tqdm(total=total, desc=desc, file=sys.stderr, mininterval=0.5 if tty else 30.0,
              dynamic_ncols=True, leave=True)
