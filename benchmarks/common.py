"""Shared pieces of the benchmark scripts: device facts, timing, FLOPs, the implementations under test,
time budgets, incremental JSON, markdown and plotting helpers.

Timing follows the project's anchor measurements (/work/shared/anchors): jit, two warm-up calls, then the
median over ``reps`` repetitions of ``iters`` back-to-back calls, the device synchronised (block_until_ready)
once at the end of each repetition; inputs are fresh random normals, never zeros. Latency instead
synchronises every call and takes the median of many.

Nothing here touches the accelerator at import time (``import jax`` does not start a backend), so an
orchestrator (run_all, the memory sweep) can import it and leave the GPU to its child processes.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

PKG_DIR = Path(__file__).resolve().parent
ROOT = PKG_DIR.parent
RESULTS_DIR = PKG_DIR / "results"

PASSES = ("fwd", "bwd", "fwd+bwd")
# FLOPs of a pass as a multiple of the forward's (FlashAttention-2 paper, §4.1; the anchors use the same).
PASS_FLOP_MULT = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}

IMPL_LABELS = {
    "fa2_triton": "fa2_jax triton",
    "fa2_triton_det": "fa2_jax triton (deterministic=True)",
    "fa2_triton_atomic": "fa2_jax triton (atomic dQ)",
    "fa2_mosaic": "fa2_jax mosaic",
    "fa2_mosaic_fused": "fa2_jax mosaic (fused dQ forced)",
    "fa2_mosaic_det": "fa2_jax mosaic (deterministic)",
    "xla": "XLA (jax.nn, xla)",
    "cudnn": "cuDNN (jax.nn, cudnn)",
    "tokamax_mosaic": "tokamax mosaic",
    "tokamax_triton": "tokamax triton",
}
ALL_IMPLS = tuple(IMPL_LABELS)
TOKAMAX_IMPLS = ("tokamax_mosaic", "tokamax_triton")


# --- imports ----------------------------------------------------------------------------------------

def ensure_fa2():
  """Import fa2_jax, also from a plain checkout that was never pip-installed.

  pyproject maps the package ``fa2_jax.kernels`` to the folder ``kernels/``; without an install that
  mapping is missing, so register ``kernels/`` under that name by hand.
  """
  import fa2_jax
  try:
    importlib.import_module("fa2_jax.kernels.triton")
    return fa2_jax
  except ImportError as e:
    if "fa2_jax.kernels" not in str(e) or not (ROOT / "kernels" / "__init__.py").exists():
      raise
  spec = importlib.util.spec_from_file_location(
      "fa2_jax.kernels", ROOT / "kernels" / "__init__.py",
      submodule_search_locations=[str(ROOT / "kernels")])
  mod = importlib.util.module_from_spec(spec)
  sys.modules["fa2_jax.kernels"] = mod
  spec.loader.exec_module(mod)
  fa2_jax.kernels = mod
  importlib.import_module("fa2_jax.kernels.triton")
  return fa2_jax


_TOKAMAX = None


def import_tokamax():
  """tokamax (optional peer, see /work/shared/device-wheels/README.md): the module, or the import error."""
  global _TOKAMAX
  if _TOKAMAX is None:
    try:
      _TOKAMAX = importlib.import_module("tokamax")
    except Exception as e:  # noqa: BLE001 - anything that stops the import means "not available"
      _TOKAMAX = e
  return _TOKAMAX


def tokamax_available() -> bool:
  return not isinstance(import_tokamax(), Exception)


def mosaic_available() -> bool:
  """True on a GPU where fa2_jax's Mosaic (Hopper) kernels run: sm90 or newer."""
  try:
    ensure_fa2()
    from fa2_jax.attention import _is_sm90_or_newer
    return bool(_is_sm90_or_newer())
  except Exception:  # noqa: BLE001
    return False


def with_mosaic(impls):
  """``impls`` with ``fa2_mosaic`` (the default backend on Hopper) put first where the GPU runs it."""
  return (["fa2_mosaic"] if mosaic_available() else []) + [i for i in impls if i != "fa2_mosaic"]


def seq_log_axis(ax) -> None:
  """x axis: sequence length on a log-2 scale, ticks as 512 / 1k / ... (every plot of a sweep)."""
  from matplotlib.ticker import FuncFormatter
  ax.set_xscale("log", base=2)
  ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: seq_label(int(round(x)))))
  ax.set_xlabel("sequence length")


def shared_legend(fig, axes, *, ncol: int, fontsize: int) -> None:
  """One legend under all panels, each label once (panels plot overlapping subsets of rows)."""
  handles, labels = [], []
  for ax in axes.flat:
    for hnd, lab in zip(*ax.get_legend_handles_labels()):
      if lab not in labels:
        handles.append(hnd)
        labels.append(lab)
  if handles:
    fig.legend(handles, labels, loc="lower center", ncol=min(ncol, len(labels)), fontsize=fontsize,
               frameon=False)


def save_png(plt, fig, path, dpi: int = 110):
  """Write the figure, close it, return the path."""
  fig.savefig(path, dpi=dpi)
  plt.close(fig)
  return path


def get_pyplot():
  """matplotlib.pyplot on the Agg backend, or None when matplotlib is missing."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
  except Exception:  # noqa: BLE001
    return None


# --- device facts -------------------------------------------------------------------------------------

def _pkg_version(name):
  try:
    return importlib.metadata.version(name)
  except Exception:  # noqa: BLE001
    return None


def nvidia_smi() -> dict | None:
  """Name, driver and memory of GPU 0 from nvidia-smi, or None where it is missing."""
  try:
    r = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.sm",
         "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
  except Exception:  # noqa: BLE001
    return None
  if r.returncode != 0 or not r.stdout.strip():
    return None
  lines = [ln for ln in r.stdout.strip().splitlines() if ln.strip()]
  f = [x.strip() for x in lines[0].split(",")]
  keys = ["name", "driver_version", "memory_total", "clocks_max_sm", "clocks_sm"]
  d = dict(zip(keys, f))
  d["count"] = len(lines)
  return d


def git_commit() -> str | None:
  try:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                       text=True, timeout=10)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True, timeout=10)
    if r.returncode == 0:
      return r.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
  except Exception:  # noqa: BLE001
    pass
  return None


def command_line() -> str:
  argv = getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv]
  return " ".join(shlex.quote(a) for a in argv)


def device_info(init_backend: bool = True, tokamax: bool = False) -> dict:
  """Everything that identifies a run. ``init_backend=False`` leaves jax's backends unstarted;
  ``tokamax=True`` also tries to import tokamax (seconds) and records whether it can."""
  info = {
      "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "command": command_line(),
      "parent_command": os.environ.get("FA2_BENCH_PARENT_CMD"),
      "cwd": os.getcwd(),
      "hostname": platform.node(),
      "python": platform.python_version(),
      "versions": {p: _pkg_version(p) for p in (
          "jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "fa2_jax", "numpy", "triton",
          "tokamax", "matplotlib")},
      "git_commit": git_commit(),
      "nvidia_smi": nvidia_smi(),
      "xla_flags": os.environ.get("XLA_FLAGS"),
      "xla_python_client": {k: v for k, v in os.environ.items() if k.startswith("XLA_PYTHON_CLIENT")},
  }
  try:
    import jax
    info["versions"]["jax"] = jax.__version__
    import jaxlib
    info["versions"]["jaxlib"] = jaxlib.__version__
  except Exception:  # noqa: BLE001
    pass
  smi = info["nvidia_smi"] or {}
  info["gpu_name"] = smi.get("name")
  info["driver_version"] = smi.get("driver_version")
  if init_backend:
    try:
      import jax
      dev = jax.devices()[0]
      info["backend"] = jax.default_backend()
      info["device_kind"] = dev.device_kind
      info["device_count"] = jax.device_count()
      stats = _memory_stats(dev)
      info["device_bytes_limit"] = stats.get("bytes_limit") if stats else None
      if info["gpu_name"] is None and info["backend"] == "gpu":
        info["gpu_name"] = dev.device_kind
    except Exception as e:  # noqa: BLE001
      info["backend_error"] = err_str(e)
  if tokamax:
    tk = import_tokamax()
    info["tokamax"] = (getattr(tk, "__version__", "importable") if not isinstance(tk, Exception)
                       else "not importable: " + err_str(tk, 200))
  return info


def _memory_stats(dev):
  try:
    return dev.memory_stats()
  except Exception:  # noqa: BLE001
    return None


def device_slug(info: dict) -> str:
  """'NVIDIA H200' -> 'h200'; no GPU -> 'cpu'."""
  name = info.get("gpu_name")
  if not name:
    if info.get("backend") in (None, "cpu"):
      return "cpu"
    name = info.get("device_kind") or info.get("backend")
  s = re.sub(r"^nvidia\s+", "", name.strip(), flags=re.I).lower()
  s = re.sub(r"[^a-z0-9]+", "-", s).strip("-")
  return s or "unknown"


def on_gpu() -> bool:
  import jax
  return jax.default_backend() in ("gpu", "cuda", "rocm")


# --- small utilities ----------------------------------------------------------------------------------

def err_str(e: BaseException, limit: int = 400) -> str:
  msg = " ".join(str(e).split())
  return f"{type(e).__name__}: {msg}"[:limit]


def is_oom(msg: str | None) -> bool:
  m = (msg or "").lower()
  return any(s in m for s in ("resource_exhausted", "out of memory", "oom", "failed to allocate",
                               "allocator", "exceeds the memory"))


def parse_ints(text: str) -> list[int]:
  """'512,1k,2K,16384' -> [512, 1024, 2048, 16384]."""
  out = []
  for tok in str(text).replace(" ", "").split(","):
    if not tok:
      continue
    mult = 1
    if tok[-1] in "kK":
      tok, mult = tok[:-1], 1024
    out.append(int(float(tok) * mult))
  return out


def parse_strs(text: str) -> list[str]:
  return [t for t in str(text).replace(" ", "").split(",") if t]


def seq_label(n: int) -> str:
  return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def attn_flops(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int, causal: bool) -> float:
  """Forward FLOPs, paper convention: 4·B·N·T·S·H (two matmuls), halved when causal."""
  f = 4.0 * batch * heads * seq_q * seq_k * head_dim
  return f / 2 if causal else f


def finite(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def sanitize(obj):
  """JSON-safe copy: numpy scalars to Python, NaN/inf to None, tuples to lists, Paths to str."""
  if isinstance(obj, dict):
    return {str(k): sanitize(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [sanitize(v) for v in obj]
  if isinstance(obj, (np.floating, float)):
    v = float(obj)
    return v if math.isfinite(v) else None
  if isinstance(obj, (np.integer,)):
    return int(obj)
  if isinstance(obj, (np.bool_,)):
    return bool(obj)
  if isinstance(obj, Path):
    return str(obj)
  return obj


def write_json(path: Path, data) -> None:
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(path.name + ".tmp")
  with open(tmp, "w") as fh:
    json.dump(sanitize(data), fh, indent=1)
  os.replace(tmp, path)


def read_json(path: Path):
  with open(path) as fh:
    return json.load(fh)


def out_name(stem: str, tag: str | None, ext: str) -> str:
  return f"{stem}{'_' + tag if tag else ''}.{ext}"


# --- recording ----------------------------------------------------------------------------------------

class Recorder:
  """One JSON file per script, rewritten (atomically) after every cell so a killed run keeps its rows.

  ``begin(cell)`` marks the cell being measured. With ``resume=True`` an existing file is read back:
  its measured cells are kept (``done`` holds their keys) and a cell that was in progress when the
  process died is recorded as ``crashed`` (``crashed`` holds those cells), so a rerun can go on without
  repeating work or walking into the same crash.
  """

  def __init__(self, path: Path, meta: dict, config: dict, script: str, *, key=None,
               resume: bool = False):
    self.path = Path(path)
    self.t0 = time.time()
    self.key = key or (lambda c: None)
    self.data = {"script": script, "status": "running", "meta": meta, "config": config,
                 "cells": [], "notes": []}
    if resume and self.path.exists():
      try:
        old = read_json(self.path)
        cells = [c for c in old.get("cells", []) if c.get("status") != "skipped"]
        ip = old.get("in_progress")
        if ip:
          cells.append(dict(ip, status="crashed",
                            error="crashed: the process died while measuring this cell"))
        self.data["cells"] = cells
        self.data["notes"] = old.get("notes", [])
        self.data["resumed"] = old.get("resumed", 0) + 1
        for k in ("matmul", "references"):
          if k in old:
            self.data[k] = old[k]
      except Exception as e:  # noqa: BLE001
        print(f"[bench] cannot resume from {self.path}: {err_str(e)}", file=sys.stderr)
    self.done = {self.key(c) for c in self.data["cells"]}
    self.crashed = [c for c in self.data["cells"] if c.get("status") == "crashed"]
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


def device_alive() -> bool:
  try:
    import jax
    import jax.numpy as jnp
    return float(jax.block_until_ready(jnp.arange(8.0).sum())) == 28.0
  except Exception:  # noqa: BLE001
    return False


def close_cell(rec: "Recorder", budget, key: str, cell: dict, t0: float, bar) -> None:
  """End of one measured cell: wall time, budget bookkeeping, the device check, record, progress."""
  cell["wall_s"] = time.time() - t0
  budget.record(key, cell["wall_s"])
  check_device(rec, cell)
  rec.add(cell)
  bar.update(1)


def finish_run(rec: "Recorder", bar, render, summary, out_dir, tag) -> dict:
  """End of a script's sweep: close the bar, finish the JSON, render md/png, print the summary."""
  bar.close()
  data = rec.finish("done")
  files = render(data, out_dir, tag)
  print(summary(data), flush=True)
  data["files"] = [str(rec.path), *map(str, files)]
  return data


def check_device(rec: "Recorder", cell: dict) -> None:
  """After a failed cell: a kernel fault can leave the CUDA context unusable, failing every later cell.
  If the device no longer works, record the cell as crashed and exit (code 87) so that run_all resumes
  in a fresh process without it."""
  if not any(k.endswith("error") for k in cell) or device_alive():
    return
  first = next((cell[k] for k in cell if k.endswith("error")), "")
  cell.update(status="crashed", error=f"crashed: device unusable after this cell ({first[:200]})")
  rec.add(cell)
  print(f"[bench] device unusable after {cell.get('impl') or cell.get('variant')}; exiting",
        file=sys.stderr, flush=True)
  os._exit(87)


def test_crash_hook(what: str) -> None:
  """Die like a crashed kernel when FA2_BENCH_TEST_CRASH names ``what`` (tests of --resume only)."""
  if what and os.environ.get("FA2_BENCH_TEST_CRASH") == what:
    os._exit(86)


# --- time budget --------------------------------------------------------------------------------------

class Budget:
  """A soft deadline: a cell starts only if the time it is expected to take (the last cell of the same
  kind, or a default) is left. Skipped cells are recorded as such."""

  def __init__(self, deadline: float | None = None):
    self.deadline = deadline
    self.cost: dict[str, float] = {}

  def left(self) -> float:
    return math.inf if self.deadline is None else self.deadline - time.time()

  def fits(self, kind: str, default: float = 0.0) -> bool:
    return self.left() >= self.cost.get(kind, default)

  def record(self, kind: str, seconds: float) -> None:
    self.cost[kind] = seconds


# --- timing -------------------------------------------------------------------------------------------

def block(x):
  import jax
  return jax.block_until_ready(x)


def time_throughput(fn, args, *, iters: int = 10, reps: int = 5, warmup: int = 2,
                    max_rep_s: float = 0.3):
  """Median seconds per call of ``fn(*args)`` over ``reps`` runs of ``iters`` back-to-back calls.

  Slow calls (over ``max_rep_s / iters``) get fewer calls per repetition (at least 1). Returns
  ``(stats, last_output)``.
  """
  out = None
  for _ in range(max(1, warmup)):
    out = block(fn(*args))
  t = time.perf_counter()
  out = block(fn(*args))
  one = time.perf_counter() - t
  iters = max(1, min(iters, int(max_rep_s / max(one, 1e-9))))
  ts = []
  for _ in range(reps):
    t = time.perf_counter()
    for _ in range(iters):
      out = fn(*args)
    block(out)
    ts.append((time.perf_counter() - t) / iters)
  med = float(np.median(ts))
  return {"median_s": med, "min_s": float(min(ts)), "max_s": float(max(ts)),
          "spread": float((max(ts) - min(ts)) / med) if med > 0 else None,
          "iters": iters, "reps": reps}, out


def time_latency(fn, arg_sets, *, n: int = 100, warmup: int = 5):
  """Per-call wall-clock latency: each call synchronised on its own; inputs rotate over ``arg_sets``."""
  for i in range(max(1, warmup)):
    block(fn(*arg_sets[i % len(arg_sets)]))
  ts = np.empty(n)
  for i in range(n):
    a = arg_sets[i % len(arg_sets)]
    t = time.perf_counter()
    block(fn(*a))
    ts[i] = time.perf_counter() - t
  us = ts * 1e6
  return {"median_us": float(np.median(us)), "p10_us": float(np.percentile(us, 10)),
          "p90_us": float(np.percentile(us, 90)), "min_us": float(us.min()),
          "mean_us": float(us.mean()), "n": n}


def matmul_peak(n: int = 8192, dtype=None) -> dict:
  """Measured dense matmul rate (the ceiling the attention numbers are read against)."""
  import jax
  import jax.numpy as jnp
  dtype = dtype or jnp.bfloat16
  a, b = (jax.random.normal(k, (n, n), dtype) for k in jax.random.split(jax.random.key(7), 2))
  st, _ = time_throughput(jax.jit(lambda x, y: x @ y), (a, b))
  return {"n": n, "dtype": jnp.dtype(dtype).name, "median_s": st["median_s"],
          "tflops": 2.0 * n ** 3 / st["median_s"] / 1e12}


# --- inputs and implementations -----------------------------------------------------------------------

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def jnp_dtype(name: str):
  import jax.numpy as jnp
  return jnp.dtype(DTYPES.get(name, name))


def random_inputs(seed: int, shapes, dtype):
  """Fresh standard-normal arrays (never zeros), one per shape."""
  import jax
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  return [jax.random.normal(k, s, dtype) for k, s in zip(keys, shapes)]


def fa2_ablation(*, atomic_dq: bool | None = None, **switches):
  """``(flash_attention_ablation, kwargs)`` for the asked switches, across the two spellings of the dQ
  switch (``atomic_dq=`` now; ``deterministic=`` when atomic dQ was the default)."""
  ensure_fa2()
  from fa2_jax.attention import flash_attention_ablation as abl
  params = set(inspect.signature(abl).parameters)
  kw = {k: v for k, v in switches.items() if v is not None}
  if atomic_dq is not None:
    if "atomic_dq" in params:
      kw["atomic_dq"] = atomic_dq
    elif "deterministic" in params:
      kw["deterministic"] = not atomic_dq
    else:
      raise TypeError("flash_attention_ablation has no dQ switch (atomic_dq / deterministic)")
  unknown = set(kw) - params
  if unknown:
    raise TypeError(f"flash_attention_ablation does not take {sorted(unknown)}")
  return abl, kw


def fa2_default_deterministic() -> bool:
  """True when fa2_jax's default backward is already the separate (deterministic) dQ pass."""
  try:
    ensure_fa2()
    from fa2_jax.attention import flash_attention_ablation as abl
    return "atomic_dq" in inspect.signature(abl).parameters
  except Exception:  # noqa: BLE001
    return False


def make_attention(name: str, *, causal: bool, interpret: bool | None = None, block_sizes=None):
  """``f(q, k, v) -> out`` for one implementation; raises where it cannot be built (missing peer)."""
  import jax
  if name == "fa2_triton_atomic":
    abl, kw = fa2_ablation(atomic_dq=True)
    return lambda q, k, v: abl(q, k, v, is_causal=causal, block_sizes=block_sizes,
                               interpret=interpret, **kw)
  if name == "fa2_mosaic_fused":  # fused dQ (TMA reduce-add) forced on, also where not the default
    fa2 = ensure_fa2()

    def fused(q, k, v):
      cfg = fa2.MosaicConfig.default(q.shape[-1], q.dtype, causal).replace(dq_fused=True)
      if cfg.check(q.shape[-1], q.dtype.itemsize) is not None:  # SMEM: a shallower dK/dV ring
        cfg = cfg.replace(num_stages_dkv=2)
      return fa2.flash_attention(q, k, v, is_causal=causal, implementation="mosaic",
                                 block_sizes=cfg, deterministic=False)
    return fused
  if name.startswith("fa2_"):
    fa2 = ensure_fa2()
    impl = {"fa2_triton": "triton", "fa2_triton_det": "triton", "fa2_mosaic": "mosaic",
            "fa2_mosaic_det": "mosaic"}[name]
    det = name in ("fa2_triton_det", "fa2_mosaic_det")
    return lambda q, k, v: fa2.flash_attention(q, k, v, is_causal=causal, implementation=impl,
                                               block_sizes=block_sizes, deterministic=det,
                                               interpret=interpret)
  if name in ("xla", "cudnn"):
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                        implementation=name)
  if name in TOKAMAX_IMPLS:
    tk = import_tokamax()
    if isinstance(tk, Exception):
      raise ImportError(f"tokamax is not importable: {err_str(tk, 200)}")
    impl = name.split("_", 1)[1]
    return lambda q, k, v: tk.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)
  raise ValueError(f"unknown implementation {name!r}; known: {', '.join(ALL_IMPLS)}")


def fwd_bwd(f):
  """Jitted forward+backward: ``(q, k, v, do) -> (dq, dk, dv)`` through ``jax.vjp`` with a random
  cotangent (the forward runs inside, as in training)."""
  import jax

  def g(q, k, v, do):
    _, pull = jax.vjp(f, q, k, v)
    return pull(do)
  return jax.jit(g)


def default_interpret() -> bool:
  """Pallas interpret mode wherever there is no GPU (CPU smoke runs)."""
  return not on_gpu()


# --- CLI ----------------------------------------------------------------------------------------------

def add_common_args(p: argparse.ArgumentParser) -> None:
  g = p.add_argument_group("common")
  g.add_argument("--out", type=Path, default=None,
                 help="output folder (default benchmarks/results/<gpu-slug>/; --smoke: a temp folder)")
  g.add_argument("--tag", default=None, help="suffix for the output file names")
  mode = g.add_mutually_exclusive_group()
  mode.add_argument("--quick", action="store_true", help="a small subset (minutes on an H200)")
  mode.add_argument("--smoke", action="store_true",
                    help="tiny shapes on the CPU in Pallas interpret mode: exercises the harness")
  g.add_argument("--budget-s", type=float, default=None,
                 help="skip (and record as skipped) the cells that would start after this many seconds")
  g.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)  # epoch s (run_all)
  g.add_argument("--merge", type=Path, nargs="+", default=None,
                 help="render md/png from these JSON files (cells concatenated) instead of measuring")
  g.add_argument("--seed", type=int, default=0)
  g.add_argument("--resume", action="store_true",
                 help="keep the cells of an existing result file, skip what crashed the last run")


def make_budget(args) -> Budget:
  deadline = args.deadline
  if args.budget_s is not None:
    d = time.time() + args.budget_s
    deadline = d if deadline is None else min(deadline, d)
  return Budget(deadline)


def resolve_out(args, info: dict) -> Path:
  if args.out is not None:
    out = Path(args.out)
  elif getattr(args, "smoke", False):
    out = Path(tempfile.mkdtemp(prefix="fa2_bench_smoke_"))
  else:
    out = RESULTS_DIR / device_slug(info)
  out.mkdir(parents=True, exist_ok=True)
  return out


_CELL_KEYS = ("impl", "seq", "head_dim", "causal", "dtype", "batch", "heads")


def _cell_key(c):
  if not isinstance(c, dict) or "impl" not in c or "seq" not in c:
    return ("unique", id(c))
  return tuple(c.get(k) for k in _CELL_KEYS)


def _measured(c) -> bool:
  return isinstance(c, dict) and c.get("status") not in ("skipped", "unavailable") and bool(
      c.get("tflops") or c.get("latency") or c.get("peak_bytes") or c.get("errors"))


def merge_json(paths) -> dict:
  """The cells of several result files (meta of the last, the others' listed). Where two files hold
  the same cell (implementation, shape, dtype), the later file's wins unless it only skipped it; each
  cell records the file it came from. Notes are kept once each; a file's "tokamax rows left out" note
  is dropped when another file measured tokamax rows."""
  datas = [read_json(p) for p in paths]
  base = dict(datas[-1])
  merged: dict = {}
  for path, d in zip(paths, datas):
    dtype = (d.get("config") or {}).get("dtype")  # older files: skipped cells carry no dtype
    for c in d.get("cells", []):
      if isinstance(c, dict):
        c = dict(c, source=str(path))
        if dtype and "dtype" not in c and "impl" in c:
          c["dtype"] = dtype
      key = _cell_key(c)
      if key in merged and _measured(merged[key]) and not _measured(c):
        continue
      merged.pop(key, None)
      merged[key] = c
  base["cells"] = list(merged.values())
  has_tokamax = any(str(c.get("impl", "")).startswith("tokamax") for c in base["cells"]
                    if isinstance(c, dict))
  notes = dict.fromkeys(n for d in datas for n in d.get("notes", []))
  base["notes"] = [n for n in notes if not (has_tokamax and "tokamax rows left out" in n)]
  base["merged_from"] = [str(p) for p in paths]
  base["merged_meta"] = [d.get("meta") for d in datas[:-1]]
  return base


def script_main(argv, parser, run, render, summary, stem: str):
  """Shared ``main``: measure (``run(args)``), or with ``--merge`` re-render from result files."""
  args = parser.parse_args(argv)
  if not args.merge:
    return run(args)
  data = merge_json(args.merge)
  tag = args.tag or "merged"
  out = Path(args.out) if args.out else Path(args.merge[0]).parent
  out.mkdir(parents=True, exist_ok=True)
  write_json(out / out_name(stem, tag, "json"), data)
  files = render(data, out, tag)
  print(summary(data), flush=True)
  data["files"] = [str(f) for f in files]
  return data


# --- progress -----------------------------------------------------------------------------------------

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
  except Exception:  # noqa: BLE001
    return _NullBar(total, desc)
  tty = sys.stderr.isatty()
  return tqdm(total=total, desc=desc, file=sys.stderr, mininterval=0.5 if tty else 30.0,
              dynamic_ncols=True, leave=True)


# --- markdown -----------------------------------------------------------------------------------------

def md_table(header, rows) -> str:
  lines = ["| " + " | ".join(str(h) for h in header) + " |",
           "|" + "|".join("---" for _ in header) + "|"]
  for r in rows:
    lines.append("| " + " | ".join("" if c is None else str(c) for c in r) + " |")
  return "\n".join(lines)


def fmt_num(x, spec: str = ".0f", none: str = "–") -> str:
  return format(x, spec) if finite(x) else none


def fmt_tf(x, none: str = "–") -> str:
  """TFLOP/s: integers on a GPU, three significant digits for the tiny CPU smoke numbers."""
  if not finite(x):
    return none
  return f"{x:.0f}" if abs(x) >= 10 else f"{x:.3g}"


def fmt_bytes(x) -> str:
  if not finite(x):
    return "–"
  for unit, div in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
    if abs(x) >= div:
      return f"{x / div:.2f} {unit}"
  return f"{int(x)} B"


def meta_lines(meta: dict) -> list[str]:
  """A few lines that say where and how a result file was made."""
  v = meta.get("versions") or {}
  lines = [
      f"- device: {meta.get('gpu_name') or meta.get('device_kind') or meta.get('backend')}"
      f" (backend {meta.get('backend')}, driver {meta.get('driver_version') or '–'})",
      f"- jax {v.get('jax')}, jaxlib {v.get('jaxlib')}, cuda plugin "
      f"{v.get('jax-cuda13-plugin') or v.get('jax-cuda12-plugin') or '–'}, tokamax: "
      f"{meta.get('tokamax') or (meta.get('versions') or {}).get('tokamax') or '–'}",
      f"- fa2_jax commit {meta.get('git_commit') or '–'}; {meta.get('timestamp')}",
      f"- command: `{meta.get('parent_command') or meta.get('command')}`",
  ]
  if meta.get("parent_command"):
    lines.append(f"- stage command: `{meta.get('command')}`")
  return lines


