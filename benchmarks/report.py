"""Result files: JSON (written atomically, merged across runs), markdown tables and number formats."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np


# --- numbers and errors ---------------------------------------------------------------------------

def err_str(e: BaseException, limit: int = 400) -> str:
  """One line: ``Type: message``, whitespace collapsed, cut at ``limit`` characters."""
  return f"{type(e).__name__}: {' '.join(str(e).split())}"[:limit]


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


# --- JSON -----------------------------------------------------------------------------------------

def sanitize(obj):
  """JSON-safe copy: numpy scalars to Python, NaN/inf to None, tuples to lists, Paths to str."""
  if isinstance(obj, dict):
    return {str(k): sanitize(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [sanitize(v) for v in obj]
  if isinstance(obj, (np.floating, float)):
    v = float(obj)
    return v if math.isfinite(v) else None
  if isinstance(obj, np.integer):
    return int(obj)
  if isinstance(obj, np.bool_):
    return bool(obj)
  if isinstance(obj, Path):
    return str(obj)
  return obj


def write_json(path, data) -> None:
  """Write through a temporary file and rename, so a reader never sees half a file."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(path.name + ".tmp")
  with open(tmp, "w") as fh:
    json.dump(sanitize(data), fh, indent=1)
  os.replace(tmp, path)


def read_json(path):
  with open(path) as fh:
    return json.load(fh)


SMOKE_CAVEAT = "smoke size (CPU, Pallas interpret mode): not a measurement"  # the console at --smoke


def is_smoke(data) -> bool:
  """A result of the CPU smoke size (its config says so): its numbers check the harness only."""
  return bool((data.get("config") or {}).get("smoke"))


def out_name(stem: str, tag: str | None, ext: str) -> str:
  return f"{stem}{'_' + tag if tag else ''}.{ext}"


def write_md(lines, out_dir, stem: str, tag: str | None = None) -> Path:
  """A report's markdown ``lines`` to ``out_dir/<stem>[_<tag>].md``; returns the path."""
  path = Path(out_dir) / out_name(stem, tag, "md")
  path.write_text("\n".join(lines) + "\n")
  return path


def _measured(c) -> bool:
  return isinstance(c, dict) and c.get("status") not in ("skipped", "unavailable") and bool(
      c.get("tflops") or c.get("latency") or c.get("compiled") or c.get("errors") or c.get("ms"))


def merge_json(paths, key) -> dict:
  """One result from several files of the same script: the cells of all (``key(cell)`` identifies a
  cell; where two files hold it the later file's wins unless it only skipped it; each cell records
  its ``source`` file), notes once each, the meta of the last file (the others' in ``merged_meta``)."""
  if not paths:
    raise ValueError("merge_json needs at least one file")
  datas = []
  for p in paths:
    try:
      datas.append(read_json(p))
    except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError
      raise ValueError(f"{p}: not a JSON file ({e})") from None
  for p, d in zip(paths, datas):
    if not isinstance(d, dict) or not isinstance(d.get("cells"), list):
      raise ValueError(f"{p}: not a benchmark result (a JSON object with a 'cells' list)")
  scripts = {d.get("script") for d in datas}
  if len(scripts) > 1:
    raise ValueError(f"cannot merge results of different scripts: {sorted(map(str, scripts))}")
  merged: dict = {}
  for path, d in zip(paths, datas):
    for c in d["cells"]:
      c = dict(c, source=str(path))
      k = key(c)
      if k in merged and _measured(merged[k]) and not _measured(c):
        continue
      merged.pop(k, None)
      merged[k] = c
  base = dict(datas[-1])
  base["cells"] = list(merged.values())
  base["notes"] = list(dict.fromkeys(n for d in datas for n in d.get("notes", [])))
  base["merged_from"] = [str(p) for p in paths]
  base["merged_meta"] = [d.get("meta") for d in datas[:-1]]
  return base


# --- markdown ---------------------------------------------------------------------------------------

def md_table(header, rows) -> str:
  lines = ["| " + " | ".join(str(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
  lines += ["| " + " | ".join("" if c is None else str(c) for c in r) + " |" for r in rows]
  return "\n".join(lines)


def meta_lines(meta: dict) -> list[str]:
  """A few lines that say where and how a result file was made."""
  v = meta.get("versions") or {}
  lines = [
      f"- device: {meta.get('gpu_name') or meta.get('device_kind') or meta.get('backend')}"
      f" (backend {meta.get('backend')}, driver {meta.get('driver_version') or '–'})",
      f"- jax {v.get('jax')}, jaxlib {v.get('jaxlib')}, cuda plugin "
      f"{v.get('jax-cuda13-plugin') or v.get('jax-cuda12-plugin') or '–'}; fa2_jax commit "
      f"{meta.get('git_commit') or '–'}; {meta.get('timestamp')}",
      f"- command: `{meta.get('parent_command') or meta.get('command')}`",
  ]
  if meta.get("parent_command"):
    lines.append(f"- stage command: `{meta.get('command')}`")
  absent = meta.get("absent_impls") or {}
  if absent:
    lines.append("- not measured here: " + "; ".join(f"{k} ({v})" for k, v in absent.items()))
  return lines
