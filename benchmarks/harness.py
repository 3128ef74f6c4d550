"""The harness every benchmark script uses (benchmarks/README.md); timing and FLOPs are in timing.py,
the implementations in impls.py.

* run metadata: GPU, driver, versions, commit and command line, without machine paths;
* result files: one JSON per run, rewritten after every cell (``Recorder``), a soft time budget
  (``Budget``), ``--resume`` after a crash, ``--merge`` of runs, ``--render`` of a result file;
* the command line: common flags, the CPU fallback to the smoke size, the output folder;
* a run's loop (``Run``): skip what is measured, crashed or out of time, record each cell;
* reports: markdown tables, number formats, the failures section;
* plots: one palette (``PALETTE``: legend name, colour and hatch per implementation, the same in every
  plot), titles that name the GPU, tick labels that do not overlap.

Nothing here starts a jax backend unless asked, so an orchestrator (run_all, the memory sweep) can record
the machine and leave the GPU to its children.
"""
from __future__ import annotations

import argparse
import datetime
import fnmatch
import importlib.metadata
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from . import impls
from .timing import ITERS, REPS, err_str, measure_together

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "out"  # ignored by git; benchmarks/results/ only when --out names it
GPU_BACKENDS = ("gpu", "cuda", "rocm")
VERSIONED = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "fa2_jax", "numpy", "triton",
             "tokamax", "flash_attn3_jax", "matplotlib")
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
SMOKE_ITERS, SMOKE_REPS = 2, 2  # --smoke: a few calls check the harness; the numbers mean nothing
SMOKE_CAVEAT = "smoke size (CPU, Pallas interpret mode): not a measurement"
DEVICE_LOST_EXIT = 87  # exit code after a cell that left the device unusable: run_all resumes
TEST_CRASH_EXIT = 86  # exit code of the simulated crash (FA2_BENCH_TEST_CRASH, tests of --resume)
REL_ERR_WARN = 2e-2  # forward output vs the f32 reference: a fast row must also be a right one


# --- numbers ----------------------------------------------------------------------------------------

def is_oom(msg: str | None) -> bool:
  m = (msg or "").lower()
  return any(s in m for s in ("resource_exhausted", "out of memory", "oom", "failed to allocate",
                               "allocator", "exceeds the memory"))


def finite(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def ratio(a, b):
  """``a / b`` when both are finite and b > 0, else None."""
  return a / b if finite(a) and finite(b) and b > 0 else None


def seq_label(n: int) -> str:
  """16384 -> '16k', 512 -> '512'."""
  return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def fmt_num(x, spec: str = ".0f", none: str = "–") -> str:
  return format(x, spec) if finite(x) else none


def fmt_tf(x) -> str:
  """TFLOP/s: integers on a GPU, three significant digits for the tiny CPU smoke numbers."""
  return fmt_num(x, ".0f" if finite(x) and abs(x) >= 10 else ".3g")


def fmt_ratio(x) -> str:
  return fmt_num(x, ".2f")


def fmt_ms(x) -> str:
  """Milliseconds: three significant digits below 100, whole numbers above."""
  return fmt_num(x, ".3g" if finite(x) and abs(x) < 100 else ".0f")


def fmt_bytes(x) -> str:
  if not finite(x):
    return "–"
  for unit, div in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
    if abs(x) >= div:
      return f"{x / div:.2f} {unit}"
  return f"{int(x)} B"


def pair(d, fmt, passes=("fwd", "fwd+bwd")) -> str:
  """``fwd / fwd+bwd`` of a ``{pass: number}`` dict."""
  return " / ".join(fmt((d or {}).get(p)) for p in passes)


# --- run metadata -----------------------------------------------------------------------------------

def pkg_version(name: str) -> str | None:
  try:
    return importlib.metadata.version(name)
  except Exception:  # noqa: BLE001 - not installed
    return None


def nvidia_smi() -> dict | None:
  """Name, driver, memory and clocks of GPU 0 from nvidia-smi (``count``: GPUs seen), or None."""
  fields = {"name": "name", "driver_version": "driver_version", "memory.total": "memory_total",
            "clocks.max.sm": "clocks_max_sm", "clocks.sm": "clocks_sm"}
  try:
    r = subprocess.run(["nvidia-smi", "--query-gpu=" + ",".join(fields), "--format=csv,noheader"],
                       capture_output=True, text=True, timeout=30)
  except Exception:  # noqa: BLE001 - no nvidia-smi
    return None
  lines = [ln for ln in r.stdout.strip().splitlines() if ln.strip()]
  if r.returncode != 0 or not lines:
    return None
  return dict(zip(fields.values(), (x.strip() for x in lines[0].split(","))), count=len(lines))


def git_commit() -> str | None:
  """Short commit of the checkout, ``+dirty`` when tracked files differ from it; ``FA2_GIT_COMMIT``
  names it where the checkout is a copy without git (a device machine's working tree)."""
  if os.environ.get("FA2_GIT_COMMIT"):
    return os.environ["FA2_GIT_COMMIT"]
  try:
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True,  # noqa: E731
                                    timeout=10)
    r, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
  except Exception:  # noqa: BLE001 - no git
    return None
  return r.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if r.returncode == 0 else None


def command_line() -> str:
  """The command that ran, without machine paths: the checkout's root and a device tool's ``$OUT``
  folder are written as relative paths and ``$OUT``."""
  argv = getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv]
  out = (os.environ.get("OUT") or "").rstrip("/")

  def portable(arg: str) -> str:
    if out and (arg == out or arg.startswith(out + "/")):
      return "$OUT" + arg[len(out):]
    return arg[len(str(ROOT)) + 1:] if arg.startswith(str(ROOT) + "/") else arg

  return " ".join(w if w.startswith("$OUT") else shlex.quote(w) for w in map(portable, argv))


def gpu_in_subprocess(timeout: float = 120.0) -> bool:
  """Whether jax sees a GPU, asked in a child process so this one starts no backend."""
  try:
    r = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"],
                       capture_output=True, text=True, timeout=timeout)
  except Exception:  # noqa: BLE001
    return False
  lines = r.stdout.strip().splitlines()
  return r.returncode == 0 and bool(lines) and lines[-1] in GPU_BACKENDS


def device_alive() -> bool:
  """A tiny computation still gives the right answer (a kernel fault can poison the CUDA context)."""
  try:
    import jax
    import jax.numpy as jnp
    return float(jax.block_until_ready(jnp.arange(8.0).sum())) == 28.0
  except Exception:  # noqa: BLE001
    return False


def device_info(init_backend: bool = True) -> dict:
  """Everything that identifies a run. ``init_backend=False`` leaves jax's backends unstarted."""
  smi = nvidia_smi() or {}
  info = {
      "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "command": command_line(), "parent_command": os.environ.get("FA2_BENCH_PARENT_CMD"),
      "python": platform.python_version(), "versions": {p: pkg_version(p) for p in VERSIONED},
      "git_commit": git_commit(), "nvidia_smi": smi or None, "gpu_name": smi.get("name"),
      "driver_version": smi.get("driver_version"), "xla_flags": os.environ.get("XLA_FLAGS"),
      "xla_python_client": {k: v for k, v in os.environ.items() if k.startswith("XLA_PYTHON_CLIENT")},
  }
  if not init_backend:
    return info
  try:
    import jax
    import jaxlib
    info["versions"].update(jax=jax.__version__, jaxlib=jaxlib.__version__)
    dev = jax.devices()[0]
    info.update(backend=jax.default_backend(), device_kind=dev.device_kind,
                device_count=jax.device_count(),
                compute_capability=getattr(dev, "compute_capability", None))
    try:
      info["device_bytes_limit"] = (dev.memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001 - the CPU backend has no memory stats
      info["device_bytes_limit"] = None
    if info["gpu_name"] is None and info["backend"] != "cpu":
      info["gpu_name"] = dev.device_kind
  except Exception as e:  # noqa: BLE001
    info["backend_error"] = err_str(e)
  return info


def device_slug(info: dict) -> str:
  """'NVIDIA H200' -> 'h200'; no GPU -> 'cpu' (the default output folder's name)."""
  name = info.get("gpu_name")
  if not name:
    if info.get("backend") in (None, "cpu"):
      return "cpu"
    name = info.get("device_kind") or info.get("backend")
  s = re.sub(r"^nvidia\s+", "", name.strip(), flags=re.I).lower()
  return re.sub(r"[^a-z0-9]+", "-", s).strip("-") or "unknown"


# --- result files -----------------------------------------------------------------------------------

def sanitize(obj):
  """JSON-safe copy: numpy scalars to Python, NaN/inf to None, tuples to lists, Paths to str."""
  if isinstance(obj, dict):
    return {str(k): sanitize(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [sanitize(v) for v in obj]
  if isinstance(obj, (np.floating, float)):
    return float(obj) if math.isfinite(obj) else None
  if isinstance(obj, (np.integer, np.bool_)):
    return obj.item()
  return str(obj) if isinstance(obj, Path) else obj


def write_json(path, data) -> None:
  """Write through a temporary file and rename, so a reader never sees half a file."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text(json.dumps(sanitize(data), indent=1))
  os.replace(tmp, path)


def read_json(path):
  return json.loads(Path(path).read_text())


def out_name(stem: str, tag: str | None, ext: str = "") -> str:
  return f"{stem}{'_' + tag if tag else ''}{'.' + ext if ext else ''}"


def is_smoke(data) -> bool:
  """A result of the CPU smoke size (its config says so): its numbers check the harness only."""
  return bool((data.get("config") or {}).get("smoke"))


def _has_numbers(c) -> bool:
  return bool(c.get("tflops") or c.get("latency") or c.get("compiled") or c.get("errors")
              or c.get("ms") or c.get("us"))


def _keeps(old, new) -> bool:
  """Whether a merge keeps the earlier record ``old`` of a cell over the later ``new``: when ``new``
  says nothing (skipped for the time budget, unavailable, "ok" without numbers) and ``old`` does, or
  when ``new`` is a failure without numbers (an error, a crash, an OOM) and ``old`` has numbers (a
  partial rerun that crashed does not wipe a measurement). A later ``same`` (the same program as
  another row) or ``unsupported`` record always wins: it describes the current code."""
  def silent(c):
    return (not isinstance(c, dict) or c.get("status") in ("skipped", "unavailable")
            or (c.get("status") == "ok" and not _has_numbers(c)))

  if silent(new):
    return not silent(old)
  if new.get("status") in ("same", "unsupported") or _has_numbers(new):
    return False
  return isinstance(old, dict) and _has_numbers(old)


def merge_json(paths, key) -> dict:
  """One result from several files of the same script: the cells of all (``key(cell)`` identifies a
  cell; where two files hold it the later file's wins, unless :func:`_keeps` says otherwise; each
  cell records
  its ``source`` file), notes once each, the meta of the last file (the others' in ``merged_meta``)."""
  if not paths:
    raise ValueError("merge_json needs at least one file")
  datas = []
  for p in paths:
    try:
      datas.append(read_json(p))
    except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError
      raise ValueError(f"{p}: not a JSON file ({e})") from None
    if not isinstance(datas[-1], dict) or not isinstance(datas[-1].get("cells"), list):
      raise ValueError(f"{p}: not a benchmark result (a JSON object with a 'cells' list)")
  scripts = {d.get("script") for d in datas}
  if len(scripts) > 1:
    raise ValueError(f"cannot merge results of different scripts: {sorted(map(str, scripts))}")
  merged: dict = {}
  for path, d in zip(paths, datas):
    for c in d["cells"]:
      c, k = dict(c, source=str(path)), key(c)
      if not (k in merged and _keeps(merged[k], c)):
        merged.pop(k, None)
        merged[k] = c
  return dict(datas[-1], cells=list(merged.values()), merged_from=[str(p) for p in paths],
              notes=list(dict.fromkeys(n for d in datas for n in d.get("notes", []))),
              merged_meta=[d.get("meta") for d in datas[:-1]])


class Budget:
  """A soft deadline: a cell starts only if the time it is expected to take (the last cell of the same
  kind, or a default) is left."""

  def __init__(self, deadline: float | None = None):
    self.deadline, self.cost = deadline, {}

  def left(self) -> float:
    return math.inf if self.deadline is None else self.deadline - time.time()

  def fits(self, kind: str, default: float = 0.0) -> bool:
    return self.left() >= self.cost.get(kind, default)

  def record(self, kind: str, seconds: float) -> None:
    self.cost[kind] = seconds


class Recorder:
  """One JSON file per run, rewritten (atomically) after every cell so a killed run keeps its rows.

  ``begin(cell)`` marks the cell being measured. With ``resume=True`` an existing file is read back:
  its measured cells are kept (``done`` holds their keys) and a cell that was in progress when the
  process died is recorded as ``crashed``, so a rerun goes on without repeating work or walking into
  the same crash.
  """

  def __init__(self, path, meta: dict, config: dict, script: str, *, key=None, resume: bool = False):
    self.path, self.t0, self.key = Path(path), time.time(), key or (lambda c: None)
    self.data = {"script": script, "status": "running", "meta": meta, "config": config,
                 "cells": [], "notes": []}
    if resume and self.path.exists():
      try:
        old = read_json(self.path)
        cells = [c for c in old.get("cells", []) if c.get("status") != "skipped"]
        if old.get("in_progress"):
          cells.append(dict(old["in_progress"], status="crashed",
                            error="crashed: the process died while measuring this cell"))
        self.data.update(cells=cells, notes=old.get("notes", []), resumed=old.get("resumed", 0) + 1,
                         **{k: old[k] for k in ("matmul", "references") if k in old})
      except Exception as e:  # noqa: BLE001
        print(f"[bench] cannot resume from {self.path}: {err_str(e)}", file=sys.stderr)
    elif resume:  # a first run with --resume (run_all passes it on every try): say it starts afresh
      print(f"[bench] --resume: no earlier results at {self.path}, starting afresh", file=sys.stderr)
    self.done = {self.key(c) for c in self.data["cells"]}
    self.flush()

  @property
  def cells(self):
    return self.data["cells"]

  def begin(self, cell: dict) -> None:
    self.data["in_progress"] = dict(cell)
    self.flush()

  def add(self, cell: dict) -> dict:
    self.data.pop("in_progress", None)
    self.data["cells"].append(cell)
    self.done.add(self.key(cell))
    self.flush()
    return cell

  def note(self, text: str) -> None:
    if text not in self.data["notes"]:
      self.data["notes"].append(text)
    self.flush()

  def flush(self) -> None:
    self.data["elapsed_s"] = time.time() - self.t0
    try:
      write_json(self.path, self.data)
    except Exception as e:  # noqa: BLE001 - never lose the run over a write
      print(f"[bench] could not write {self.path}: {err_str(e)}", file=sys.stderr)

  def finish(self, status: str = "done") -> dict:
    self.data.pop("in_progress", None)
    self.data["status"] = status
    self.flush()
    return self.data


def simulated_crash_hook(what: str) -> None:
  """Die like a crashed kernel when FA2_BENCH_TEST_CRASH names ``what`` (tests of --resume only)."""
  if what and os.environ.get("FA2_BENCH_TEST_CRASH") == what:
    os._exit(TEST_CRASH_EXIT)


# --- the command line -------------------------------------------------------------------------------

def _arg_error(msg):
  raise argparse.ArgumentTypeError(msg)


def whole_number(text: str, least: int = 1) -> int:
  try:
    n = int(str(text).strip())
  except ValueError:
    _arg_error(f"not a whole number: {text!r}")
  return n if n >= least else _arg_error(f"must be at least {least}, got {n}")


def positive_int(text: str) -> int:
  """A count or size flag (``--iters``, ``--heads`` ...): a whole number >= 1, else an argparse error."""
  return whole_number(text, 1)


def positive_float(text: str) -> float:
  """A time flag (``--budget-s``): a finite number of seconds > 0."""
  try:
    x = float(text)
  except ValueError:
    _arg_error(f"not a number: {text!r}")
  return x if 0.0 < x < math.inf else _arg_error(f"must be a finite number > 0, got {text!r}")


def parse_ints(text: str) -> list[int]:
  """'512,1k,2K,16384' -> [512, 1024, 2048, 16384]; every size at least 1."""
  out = []
  for tok in filter(None, str(text).replace(" ", "").split(",")):
    mult = 1024 if tok[-1] in "kK" else 1
    try:
      out.append(int(float(tok[:-1] if mult > 1 else tok) * mult))
    except ValueError:
      _arg_error(f"not a list of sizes: {text!r}")
    if out[-1] < 1:
      _arg_error(f"sizes must be at least 1: {text!r}")
  return out


def parse_strs(text: str) -> list[str]:
  """'a,b*,c' -> ['a', 'b*', 'c']; an empty list (``''``, ``','``) is an argparse error, not "all"."""
  return [t for t in str(text).replace(" ", "").split(",") if t] or _arg_error(f"names nothing: {text!r}")


def parse_shape(text: str) -> tuple[int, int, int, int]:
  """'B,T,N,H' -> four whole numbers >= 1 (an attention call's q shape)."""
  try:
    shape = tuple(int(t) for t in str(text).replace(" ", "").split(","))
  except ValueError:
    _arg_error(f"not B,T,N,H whole numbers: {text!r}")
  if len(shape) != 4 or min(shape) < 1:
    _arg_error(f"must be four whole numbers >= 1, B,T,N,H: {text!r}")
  return shape


def parse_shapes(text: str) -> list[tuple[int, int, int, int]]:
  """'B,T,N,H;B,T,N,H' -> a non-empty list of shapes."""
  return [parse_shape(s) for s in str(text).split(";") if s.strip()] or _arg_error(
      f"names no shape: {text!r}")


def impl_names(text: str) -> list[str]:
  """``--impls``: names of benchmarks/impls.py entries; an unknown one is an argparse error naming it."""
  try:
    names = impls.parse_names(text)
  except ValueError as e:
    _arg_error(str(e))
  return names or _arg_error(f"names no implementation: {text!r}")


def call_kwargs(text: str | None) -> dict:
  """``--kwargs``: a Python dict literal of further ``flash_attention`` arguments (an attention
  variant, e.g. ``{"logits_soft_cap": 50.0, "local_window_size": (4095, 0)}``) -> dict; lists become
  tuples, or float32 arrays for ``alibi_slopes``. SystemExit naming ``--kwargs`` when it is not one."""
  import ast
  if not text:
    return {}
  try:
    out = ast.literal_eval(text)
  except (ValueError, SyntaxError) as e:
    raise SystemExit(f"--kwargs: {text!r} is not a Python dict literal ({e})") from None
  if not isinstance(out, dict) or not all(isinstance(k, str) for k in out):
    raise SystemExit(f"--kwargs: {text!r} is not a dict of argument names")
  return {k: (v if not isinstance(v, list) else np.asarray(v, np.float32) if k == "alibi_slopes"
              else tuple(v)) for k, v in out.items()}


def masks(text: str) -> list[bool]:
  """``--causal both|true|false`` -> the causal values to run."""
  return {"both": [False, True], "true": [True], "false": [False]}[text]


def script_parser(module: str, doc: str | None) -> argparse.ArgumentParser:
  """The argument parser of ``python -m benchmarks.<module>``, its docstring ``doc`` as the help's
  description (kept as written)."""
  return argparse.ArgumentParser(prog=f"python -m benchmarks.{module}", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)


def add_cell_args(p: argparse.ArgumentParser, example: str, listing: str | None = None) -> None:
  """``--cells`` (patterns of cell ids, ``example`` shown in the help) and, with ``listing`` (its
  help), ``--list-cells``."""
  p.add_argument("--cells", type=parse_strs, default=None,
                 help=f"only the cells whose id matches one of these patterns, e.g. '{example}'")
  if listing is not None:
    p.add_argument("--list-cells", action="store_true", help=listing)


def add_common_args(p: argparse.ArgumentParser, *, counts: bool = False) -> None:
  """The flags of every script; ``counts``: also ``--iters`` / ``--reps`` of the timing helper."""
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
                 help="combine these result files (a later file's cell wins) and render md/png")
  g.add_argument("--render", type=Path, default=None,
                 help="render a result file's md and png beside it (FILE.json -> FILE.md, FILE.png)")
  g.add_argument("--seed", type=int, default=0)
  g.add_argument("--resume", action="store_true",
                 help="keep the cells of an existing result file, skip what crashed the last run")
  if counts:
    g.add_argument("--iters", type=positive_int, default=ITERS,
                   help=f"back-to-back calls per repetition (--smoke: {SMOKE_ITERS})")
    g.add_argument("--reps", type=positive_int, default=REPS,
                   help=f"repetitions, median taken (--smoke: {SMOKE_REPS})")


def cpu_fallback(args, info: dict, script: str) -> None:
  """Without a GPU the sweeps would run for hours in interpret mode: run the smoke size instead (with
  SMOKE_ITERS x SMOKE_REPS calls). ``info`` without a ``backend`` is checked in a child process."""
  backend = info.get("backend")
  if not args.smoke and not (backend in GPU_BACKENDS or (backend is None and gpu_in_subprocess())):
    print(f"[{script}] no GPU (jax backend {backend or 'cpu'}): running the CPU smoke size (--smoke) "
          "instead of the GPU sweep", file=sys.stderr, flush=True)
    args.smoke, args.quick = True, False
  if args.smoke and hasattr(args, "iters"):
    args.iters, args.reps = SMOKE_ITERS, SMOKE_REPS


def resolve_out(args, info: dict) -> Path:
  out = Path(args.out) if args.out is not None else DEFAULT_OUT / device_slug(info)
  out.mkdir(parents=True, exist_ok=True)
  return out


def select(items, patterns, ident, what: str):
  """The items whose ``ident`` matches one of ``patterns`` (all without patterns); none matching is a
  SystemExit that lists the ids there are (``what``: where they come from)."""
  got = [x for x in items if not patterns or any(fnmatch.fnmatchcase(ident(x), p) for p in patterns)]
  if not got:
    raise SystemExit(f"--cells {','.join(patterns)} matches no cell of {what}: "
                     + " ".join(ident(x) for x in items))
  return got


def script_main(argv, parser, run, render, summary, stem: str, key):
  """Shared ``main``: measure (``run(args)``), or combine result files (``--merge``) or render one
  (``--render``). ``render(data, base)`` writes ``base.md`` (and plots); returns the files."""
  args = parser.parse_args(argv)
  if args.render:
    try:
      data = read_json(args.render)
    except (OSError, ValueError) as e:
      parser.error(f"--render: cannot read {args.render}: {e}")
    files = render(data, args.render.with_suffix(""))
  elif args.merge:
    try:
      data = merge_json(args.merge, key)
    except OSError as e:  # missing file, a folder, no permission
      parser.error(f"--merge: cannot read {e.filename}: {e.strerror}")
    except ValueError as e:  # not JSON, not a benchmark result, results of different scripts
      parser.error(f"--merge: {e}")
    out = Path(args.out) if args.out else Path(args.merge[0]).parent
    base = out / out_name(stem, args.tag or "merged")
    write_json(base.with_suffix(".json"), data)
    files = [base.with_suffix(".json"), *render(data, base)]
  else:
    return run(args)
  print(summary(data), flush=True)
  data["files"] = [str(f) for f in files]
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
  def update(self, k=1):
    pass

  def set_postfix_str(self, s):
    pass

  def close(self):
    pass


def progress(total: int, desc: str):
  """A tqdm bar on stderr (sparse updates when not a terminal, to keep logs short)."""
  try:
    from tqdm import tqdm
  except Exception:  # noqa: BLE001 - tqdm is optional
    return _NullBar()
  return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=True,
              mininterval=0.5 if sys.stderr.isatty() else 30.0)


# --- a run's loop -----------------------------------------------------------------------------------

class Run:
  """One measuring run of a script: its result file (``rec``), time budget, progress bar and output
  folder. ``skip(cell)`` leaves out what the last run measured (``--resume``) and records what the
  budget leaves no time for; ``add(cell)`` records a measured cell after checking the device."""

  def __init__(self, args, stem: str, info: dict, config: dict, key, total: int):
    self.out = resolve_out(args, info)
    self.rec = Recorder(self.out / out_name(stem, args.tag, "json"), info, dict(config, smoke=args.smoke),
                        stem, key=key, resume=args.resume)
    deadline = args.deadline
    if args.budget_s is not None:
      deadline = min(deadline or math.inf, time.time() + args.budget_s)
    self.budget, self.bar, self.stem = Budget(deadline), progress(total, stem), stem

  def skip(self, cell: dict, kind: str = "cell", default: float = 0.0) -> bool:
    if self.rec.key(cell) in self.rec.done:  # --resume: measured (or crashed) in the last run
      self.bar.update(1)
      return True
    if not self.budget.fits(kind, default):
      self.add(dict(cell, status="skipped", error="skipped: time budget"), check=False)
      return True
    return False

  def begin(self, cell: dict, crash_name: str) -> None:
    self.rec.begin(cell)
    simulated_crash_hook(crash_name)

  def add(self, cell: dict, *, kind: str | None = None, t0: float | None = None, check=True) -> dict:
    """Record ``cell`` (``t0``: its start, for the budget of ``kind``). After a failed cell, if the
    device no longer works (a kernel fault poisons the CUDA context and every later cell would fail),
    record it as crashed and exit so that run_all resumes in a fresh process without it."""
    if t0 is not None:
      cell["wall_s"] = time.time() - t0
      self.budget.record(kind or "cell", cell["wall_s"])
    errors = [v for k, v in cell.items() if k.endswith("error") and v]
    if check and errors and not device_alive():
      cell.update(status="crashed", error=f"crashed: device unusable after this cell ({errors[0][:200]})")
      self.rec.add(cell)
      print(f"[bench] device unusable after {cell.get('impl') or cell.get('row')}; exiting",
            file=sys.stderr, flush=True)
      os._exit(DEVICE_LOST_EXIT)
    self.bar.update(1)
    return self.rec.add(cell)

  def together(self, rows: dict, *, iters: int, reps: int, check=None, t0=None) -> None:
    """Time the rows of one cell together and record each: ``rows = {name: (record, f, args)}``, all
    compiled and warmed up first, then their repetitions interleaved (timing.measure_together);
    ``check(name, out)`` gives a row's forward error against the reference (⚠ above REL_ERR_WARN;
    None: not checked)."""

    def before(name):
      self.begin(rows[name][0], rows[name][0].get("impl"))

    try:
      res = measure_together({n: (f, a) for n, (_, f, a) in rows.items()}, before=before,
                             flops_fwd={n: r["flops_fwd"] for n, (r, _, _) in rows.items()},
                             iters=iters, reps=reps)
    except Exception as e:  # noqa: BLE001
      res = {n: {"fwd_error": err_str(e), "fwd+bwd_error": err_str(e), "out": None} for n in rows}
    for name, (cell, _, _) in rows.items():
      out = res[name].pop("out")
      cell.update(res[name])
      try:
        err = None if check is None or out is None else check(name, out)
      except Exception as e:  # noqa: BLE001
        err, cell["check_error"] = None, f"no f32 reference: {err_str(e, 300)}"
      if err is not None:
        cell["rel_err"] = err
        if not err <= REL_ERR_WARN:
          cell["warning"] = f"forward rel. error {err:.2e} vs the f32 reference"
      cell["status"] = status_of(cell)
      self.add(cell, t0=t0)

  def finish(self, render, summary) -> dict:
    self.bar.close()
    data = self.rec.finish("done")
    files = [self.rec.path, *render(data, self.rec.path.with_suffix(""))]
    print(summary(data), flush=True)
    print(f"[{self.stem}] wrote " + ", ".join(map(str, files)), flush=True)
    data["files"] = [str(f) for f in files]
    return data


def status_of(cell: dict, passes=("fwd", "fwd+bwd")) -> str:
  """``error`` when every pass failed, ``partial`` when some did, else the cell's status."""
  errs = [cell.get(f"{p}_error") for p in passes]
  return "error" if all(errs) else "partial" if any(errs) else cell.get("status", "ok")


BATCHED = ("query_seq_lengths", "key_value_seq_lengths", "q_segment_ids", "kv_segment_ids")


def reference(q, k, v, heads: int, **kw):
  """The float32 reference output (``fa2_jax.reference_attention`` with ``kw``) of batch 0, the first
  ``heads`` query heads and their K/V heads, and the mask of its rows that hold tokens (or None)."""
  import jax
  import jax.numpy as jnp
  import fa2_jax
  nq = min(heads, q.shape[2])
  nk = max(1, -(-nq // (q.shape[2] // k.shape[2])))
  kw = {n: jnp.asarray(x)[:1] if n in BATCHED else x for n, x in kw.items()}
  ref = jax.block_until_ready(jax.jit(lambda q, k, v: fa2_jax.reference_attention(
      q, k, v, compute_dtype=jnp.float32, query_block="auto", **kw).astype(jnp.float32))(
          q[:1, :, :nq], k[:1, :, :nk], v[:1, :, :nk]))
  lens = kw.get("query_seq_lengths")
  return ref, None if lens is None else (jnp.arange(q.shape[1])[None, :] < lens[:, None])


def rel_err(out, ref, valid=None) -> float:
  """Relative L2 error of ``out``'s batch 0 and first heads against :func:`reference`'s output."""
  import jax.numpy as jnp
  d = out[:1, :, :ref.shape[2]].astype(jnp.float32) - ref
  if valid is not None:
    d, ref = (jnp.where(valid[:, :, None, None], x, 0.0) for x in (d, ref))
  return float(jnp.linalg.norm(d) / jnp.linalg.norm(ref))


# --- reports ----------------------------------------------------------------------------------------

def md_table(header, rows) -> str:
  lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "|".join("---" for _ in header) + "|"]
  return "\n".join(lines + ["| " + " | ".join("" if c is None else str(c) for c in r) + " |" for r in rows])


def meta_lines(meta: dict) -> list[str]:
  """A few lines that say where and how a result file was made."""
  v = meta.get("versions") or {}
  lines = [
      f"- device: {meta.get('gpu_name') or meta.get('device_kind') or meta.get('backend')}"
      f" (backend {meta.get('backend')}, driver {meta.get('driver_version') or '–'})",
      f"- jax {v.get('jax')}, jaxlib {v.get('jaxlib')}, cuda plugin "
      f"{v.get('jax-cuda13-plugin') or v.get('jax-cuda12-plugin') or '–'}; fa2_jax commit "
      f"{meta.get('git_commit') or '–'}; {meta.get('timestamp')}",
      f"- command: `{meta.get('parent_command') or meta.get('command')}`"]
  if meta.get("parent_command"):
    lines.append(f"- stage command: `{meta.get('command')}`")
  absent = meta.get("absent_impls") or {}
  if absent:
    lines.append("- not measured here: " + "; ".join(f"{k} ({v})" for k, v in absent.items()))
  return lines


def header(data, title: str) -> list[str]:
  """The top of a report: title, where it was measured, and the runs a merged result combines."""
  meta = data.get("meta", {})
  lines = [f"# {title}", ""] + meta_lines(meta)
  if data.get("merged_from"):
    lines.append("- merged from these runs (each cell's `source` in the JSON; ratios compare rows of "
                 "one run); the lines above are the last one's:")
    metas = list(data.get("merged_meta") or []) + [meta]
    for path, m in zip(data["merged_from"], metas if len(metas) == len(data["merged_from"]) else []):
      m = m or {}
      lines.append(f"  - `{path}`: fa2_jax commit {m.get('git_commit') or '–'}, {m.get('timestamp')}, "
                   f"`{m.get('parent_command') or m.get('command')}`")
  if is_smoke(data):
    lines.append("- smoke size on the CPU (Pallas interpret mode): the numbers check the harness, not "
                 "the speed, and the ratios and verdicts mean nothing here")
  return lines


def failures(cells, name, where, keys=("error", "fwd_error", "fwd+bwd_error", "check_error",
                                       "run_error", "warning")) -> list[str]:
  """A report's last section: each message once, with the cells (``where(cell)``) that gave it."""
  errs: dict = {}
  for c in cells:
    for k in keys:
      if c.get(k) and not (k == "error" and c.get("status") == "unavailable"):
        errs.setdefault((name(c), k, c[k]), []).append(where(c))
  if not errs:
    return []
  return ["", "## Left out, failures and warnings", ""] + [
      f"- **{n}** {k} ({', '.join(map(str, w[:8]))}{' …' if len(w) > 8 else ''}): `{m[:300]}`"
      for (n, k, m), w in errs.items()]


def write_md(lines, base: Path) -> Path:
  path = Path(base).with_suffix(".md")
  path.write_text("\n".join(lines) + "\n")
  return path


# --- plots ------------------------------------------------------------------------------------------

_FA2, _DET, _TRITON, _CUDNN = "#1f77b4", "#17becf", "#2ca02c", "#d62728"
_FA3, _TOKAMAX, _XLA, _FA1, _ATOMIC = "#9467bd", "#8c564b", "#7f7f7f", "#ff7f0e", "#bcbd22"
_TRAIN = "#e377c2"
# Every row name any result file holds -> (legend name, colour, hatch): one colour per implementation in
# every plot; a hatched bar is that implementation doing the same work another way (the variants'
# reference rows). The earlier harness's names map to the implementation they ran.
PALETTE = {
    "fa2": ("fa2_jax", _FA2, ""),
    "fa2_mosaic": ("fa2_jax", _FA2, ""),
    "fa2_dense": ("fa2_jax dense causal", _FA2, "//"),
    "fa2_batch": ("fa2_jax on a batch", _FA2, "//"),
    "fa2_nocap": ("fa2_jax without the cap", _FA2, "//"),
    "fa2_full": ("fa2_jax unpadded", _FA2, "//"),
    "fa2_mask_fn": ("fa2_jax mask_fn", _FA2, "//"),
    "fa2_det": ("fa2_jax (deterministic)", _DET, ""),
    "fa2_mosaic_det": ("fa2_jax (deterministic)", _DET, ""),
    "fa2_triton": ("fa2_jax (Triton)", _TRITON, ""),
    "fa2_train": ("fa2_jax (training kernels)", _TRAIN, ""),  # decode: the call without the decode family
    "fa2_normstep": ("FlashAttention-1 form (normalise every step)", _FA1, ""),
    "fa2_atomic_dq": ("atomic dQ", _ATOMIC, ""),
    "cudnn": ("cuDNN", _CUDNN, ""),
    "cudnn_batch": ("cuDNN on a batch", _CUDNN, "//"),
    "fa3": ("FlashAttention-3", _FA3, ""),
    "fa3_varlen": ("FlashAttention-3 varlen", _FA3, "//"),
    "tokamax": ("tokamax", _TOKAMAX, ""),
    "tokamax_mosaic": ("tokamax", _TOKAMAX, ""),
    "xla": ("XLA", _XLA, ""),
}
ORDER = tuple(PALETTE)  # rows in tables and legends: fa2_jax first, the peers after it


def style(name: str) -> tuple[str, str, str]:
  """(legend name, colour, hatch) of a row name (an unknown name: itself, grey)."""
  return PALETTE.get(name, (name, "#c7c7c7", ""))


def rank(name: str) -> int:
  return ORDER.index(name) if name in ORDER else len(ORDER)


def ordered(names) -> list[str]:
  """The names once each, in the palette's order (fa2_jax first), unknown ones last as they came."""
  names = list(dict.fromkeys(names))
  return sorted(names, key=lambda n: (rank(n), names.index(n)))


def gpu_title(data) -> str:
  """What the plot's title says the numbers were measured on."""
  meta = data.get("meta") or {}
  if is_smoke(data):
    return "CPU (smoke size: not a measurement)"
  return meta.get("gpu_name") or meta.get("device_kind") or meta.get("device") or "unknown device"


def pyplot():
  """matplotlib.pyplot on the Agg backend, or None when matplotlib is missing (plots are optional)."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
  except Exception:  # noqa: BLE001
    return None


def seq_axis(ax) -> None:
  """x axis: sequence length on a log-2 scale, ticks as 512 / 1k / ..."""
  from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator
  ax.set_xscale("log", base=2)
  lo, hi = (int(round(x)) for x in ax.get_xlim())
  ax.xaxis.set_major_locator(FixedLocator([2 ** i for i in range(24) if lo <= 2 ** i <= hi]))
  ax.xaxis.set_minor_locator(NullLocator())
  ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: seq_label(int(round(x)))))
  ax.set_xlabel("sequence length")


def overlapping_ticks(fig) -> list:
  """The axes whose x tick labels overlap one another once drawn."""
  if not hasattr(fig.canvas, "get_renderer"):  # a closed figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    FigureCanvasAgg(fig)
  renderer = fig.canvas.get_renderer()
  bad = []
  for ax in fig.axes:
    boxes = sorted((t.get_window_extent(renderer) for t in ax.get_xticklabels()
                    if t.get_visible() and t.get_text()), key=lambda b: b.x0)
    if any(a.x1 > b.x0 + 0.5 for a, b in zip(boxes, boxes[1:])):
      bad.append(ax)
  return bad


def save(plt, fig, base, data, title: str, suffix: str = "", dpi: int = 110) -> list[Path]:
  """Title the figure with what it shows and the GPU it was measured on, rotate x tick labels that
  would overlap, leave room for a figure legend below the panels, write ``<base><suffix>.png``."""
  fig.suptitle(f"{title} — {gpu_title(data)}")
  below = sum(lg.get_window_extent().height for lg in fig.legends) / fig.bbox.height
  fig.tight_layout(rect=(0, below, 1, 0.97))
  crowded = overlapping_ticks(fig)
  for ax in crowded:
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right", rotation_mode="anchor")
  if crowded:
    fig.tight_layout(rect=(0, below, 1, 0.97))
  path = Path(f"{base}{suffix}.png")
  fig.savefig(path, dpi=dpi)
  plt.close(fig)
  return [path]


def bar_panels(plt, panels, *, ylabel: str, shared_legend: bool = True, ncol: int | None = None,
               panel_width: float = 7.5):
  """A figure of grouped-bar panels, ``ncol`` per row (default two). ``panels``: ``(title, tick labels,
  series)``, each series ``(row name, values)`` drawn side by side at each tick in the row's palette
  style; one legend for the figure (``shared_legend``) or one per panel. ``panel_width``: inches."""
  ncol = min(ncol or 2, len(panels)) or 1
  nrow = -(-len(panels) // ncol)
  fig, axes = plt.subplots(nrow, ncol, squeeze=False, figsize=(panel_width * ncol, 3.6 * nrow + 0.8))
  for ax, (title, ticks, series) in zip(axes.flat, panels):
    width, x = 0.8 / max(1, len(series)), np.arange(len(ticks))
    for j, (name, values) in enumerate(series):
      label, colour, hatch = style(name)
      ax.bar(x + (j - (len(series) - 1) / 2) * width, values, width, color=colour, hatch=hatch,
             edgecolor="white" if hatch else colour, label=label)
    ax.set_xticks(x, ticks, fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    if not shared_legend and series:  # above the bars: the axis grows by the legend's rows
      ax.set_ylim(top=ax.get_ylim()[1] * (1.12 + 0.09 * math.ceil(len(series) / 2)))
      ax.legend(fontsize=7, loc="upper left", ncol=2, framealpha=0.9)
  for ax in list(axes.flat)[len(panels):]:
    ax.axis("off")
  if shared_legend:
    legend_below(fig, axes)
  return fig


def legend_entries(axes) -> dict:
  """``{label: handle}`` of the axes' artists, each label once, in the palette's order."""
  seen, order = {}, [style(n)[0] for n in ORDER]
  for ax in getattr(axes, "flat", axes):
    for handle, label in zip(*ax.get_legend_handles_labels()):
      seen.setdefault(label, handle)
  return dict(sorted(seen.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))


def legend_below(fig, axes, ncol: int = 7) -> None:
  """One legend for all panels under them (panels show overlapping subsets of the rows)."""
  seen = legend_entries(axes)
  if seen:
    fig.legend(seen.values(), seen.keys(), loc="lower center", ncol=min(ncol, len(seen)), fontsize=8,
               frameon=False)
