"""Running a sweep: the result file rewritten after every cell, a soft time budget, and recovery when a
kernel fault leaves the device unusable."""
from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

from .device import device_alive
from .report import err_str, read_json, write_json

DEVICE_LOST_EXIT = 87  # exit code after a cell that left the device unusable: run_all resumes
TEST_CRASH_EXIT = 86  # exit code of the simulated crash (FA2_BENCH_TEST_CRASH, tests of --resume)


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


class Recorder:
  """One JSON file per script, rewritten (atomically) after every cell so a killed run keeps its rows.

  ``begin(cell)`` marks the cell being measured. With ``resume=True`` an existing file is read back:
  its measured cells are kept (``done`` holds their keys) and a cell that was in progress when the
  process died is recorded as ``crashed`` (``crashed`` holds those cells), so a rerun goes on without
  repeating work or walking into the same crash.
  """

  def __init__(self, path, meta: dict, config: dict, script: str, *, key=None, resume: bool = False):
    self.path = Path(path)
    self.t0 = time.time()
    self.key = key or (lambda c: None)
    self.data = {"script": script, "status": "running", "meta": meta, "config": config,
                 "cells": [], "notes": []}
    if resume and self.path.exists():
      try:
        old = read_json(self.path)
        cells = [c for c in old.get("cells", []) if c.get("status") != "skipped"]
        if old.get("in_progress"):
          cells.append(dict(old["in_progress"], status="crashed",
                            error="crashed: the process died while measuring this cell"))
        self.data.update(cells=cells, notes=old.get("notes", []), resumed=old.get("resumed", 0) + 1)
        for k in ("matmul", "references"):
          if k in old:
            self.data[k] = old[k]
      except Exception as e:  # noqa: BLE001
        print(f"[bench] cannot resume from {self.path}: {err_str(e)}", file=sys.stderr)
    elif resume:  # a first run with --resume (run_all passes it on every try): say it starts afresh
      print(f"[bench] --resume: no earlier results at {self.path}, starting afresh", file=sys.stderr)
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


def check_device(rec: Recorder, cell: dict) -> None:
  """After a failed cell: if the device no longer works (a kernel fault poisons the CUDA context and
  every later cell would fail), record the cell as crashed and exit so run_all resumes in a fresh
  process without it."""
  errors = [cell[k] for k in cell if k.endswith("error") and cell[k]]
  if not errors or device_alive():
    return
  cell.update(status="crashed", error=f"crashed: device unusable after this cell ({errors[0][:200]})")
  rec.add(cell)
  print(f"[bench] device unusable after {cell.get('impl') or cell.get('variant')}; exiting",
        file=sys.stderr, flush=True)
  os._exit(DEVICE_LOST_EXIT)


def simulated_crash_hook(what: str) -> None:
  """Die like a crashed kernel when FA2_BENCH_TEST_CRASH names ``what`` (tests of --resume only)."""
  if what and os.environ.get("FA2_BENCH_TEST_CRASH") == what:
    os._exit(TEST_CRASH_EXIT)


def close_cell(rec: Recorder, budget: Budget, kind: str, cell: dict, t0: float, bar) -> None:
  """End of one measured cell: wall time, budget bookkeeping, the device check, record, progress."""
  cell["wall_s"] = time.time() - t0
  budget.record(kind, cell["wall_s"])
  check_device(rec, cell)
  rec.add(cell)
  bar.update(1)


def finish_run(rec: Recorder, bar, render, summary, out_dir, tag) -> dict:
  """End of a sweep: close the bar, finish the JSON, render md/png, print the summary."""
  bar.close()
  data = rec.finish("done")
  files = render(data, out_dir, tag)
  print(summary(data), flush=True)
  print(f"[bench] wrote {rec.path}" + "".join(f", {f}" for f in files), flush=True)
  data["files"] = [str(rec.path), *map(str, files)]
  return data
