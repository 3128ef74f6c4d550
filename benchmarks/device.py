"""What a result was measured on: GPU, driver, package versions, commit and command line.

Nothing here starts a jax backend unless asked (``device_info(init_backend=True)``), so an
orchestrator (run_all, the memory sweep) can record the machine and leave the GPU to its children.
"""
from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

PKG_DIR = Path(__file__).resolve().parent
ROOT = PKG_DIR.parent
# Packages whose versions identify a run (the peers are optional and recorded as None when absent).
GPU_BACKENDS = ("gpu", "cuda", "rocm")
VERSIONED = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "fa2_jax", "numpy", "triton",
             "tokamax", "flash_attn3_jax", "matplotlib")


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
  d = dict(zip(fields.values(), (x.strip() for x in lines[0].split(","))))
  d["count"] = len(lines)
  return d


def git_commit() -> str | None:
  """Short commit of the checkout, ``+dirty`` when tracked files differ from it; ``FA2_GIT_COMMIT``
  names it where the checkout is a copy without git (a device machine's working tree)."""
  if os.environ.get("FA2_GIT_COMMIT"):
    return os.environ["FA2_GIT_COMMIT"]
  try:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                       text=True, timeout=10)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True, timeout=10)
  except Exception:  # noqa: BLE001 - no git
    return None
  if r.returncode != 0:
    return None
  return r.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def command_line() -> str:
  """The command that ran, without machine paths: the checkout's root and a device tool's ``$OUT``
  folder are written as relative paths and ``$OUT``."""
  argv = getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv]
  out = os.environ.get("OUT")

  def portable(arg: str) -> str:
    if out and (arg == out or arg.startswith(out.rstrip("/") + "/")):
      return "$OUT" + arg[len(out.rstrip("/")):]
    if arg.startswith(str(ROOT) + "/"):
      return arg[len(str(ROOT)) + 1:]
    return arg

  words = [portable(a) for a in argv]
  return " ".join(w if w.startswith("$OUT") else shlex.quote(w) for w in words)


def on_gpu() -> bool:
  """True when jax's default backend is a GPU (starts the backend)."""
  import jax
  return jax.default_backend() in GPU_BACKENDS


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
      "command": command_line(),
      "parent_command": os.environ.get("FA2_BENCH_PARENT_CMD"),
      "python": platform.python_version(),
      "versions": {p: pkg_version(p) for p in VERSIONED},
      "git_commit": git_commit(),
      "nvidia_smi": smi or None,
      "gpu_name": smi.get("name"),
      "driver_version": smi.get("driver_version"),
      "xla_flags": os.environ.get("XLA_FLAGS"),
      "xla_python_client": {k: v for k, v in os.environ.items() if k.startswith("XLA_PYTHON_CLIENT")},
  }
  if not init_backend:
    return info
  try:
    import jax
    import jaxlib
    info["versions"].update(jax=jax.__version__, jaxlib=jaxlib.__version__)
    dev = jax.devices()[0]
    info["backend"] = jax.default_backend()
    info["device_kind"] = dev.device_kind
    info["device_count"] = jax.device_count()
    info["compute_capability"] = getattr(dev, "compute_capability", None)
    try:
      info["device_bytes_limit"] = (dev.memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001 - the CPU backend has no memory stats
      info["device_bytes_limit"] = None
    if info["gpu_name"] is None and info["backend"] != "cpu":
      info["gpu_name"] = dev.device_kind
  except Exception as e:  # noqa: BLE001
    info["backend_error"] = f"{type(e).__name__}: {e}"[:400]
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
