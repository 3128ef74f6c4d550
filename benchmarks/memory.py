"""Device memory of one jitted forward+backward against sequence length: linear (FlashAttention) vs
quadratic (the materialised score matrix).

Batch 1, 16 heads of 128, bf16, seq 1k ... 128k; fa2_jax vs XLA, cuDNN and the peers that import
(benchmarks/impls.py); forward+backward as benchmarks/timing.py builds it. The primary number is XLA's
own buffer assignment for the compiled program, ``jax.jit(...).lower(...).compile().memory_analysis()``:
arguments + outputs + temporaries − aliased bytes. It needs no memory, so it also gives the size of
programs that could never run. Where that size fits the device, the program also runs once and the
allocator's ``peak_bytes_in_use`` is read. That peak can't be reset, so on a GPU each implementation
runs in its own process with the sizes ascending (each reading is then the peak of the largest case so
far, i.e. of this one). Failures (compile errors, out of memory) are recorded as such; after a compile
failure the larger sizes of that implementation are skipped.

    python -m benchmarks.memory [--quick] [--seqs 1k,...,128k] [--impls fa2,xla,cudnn]
    python -m benchmarks.memory --smoke
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from . import harness as h
from . import impls
from .timing import fwd_bwd_fn

STEM = "memory"
SEQS = [1024 * 2 ** i for i in range(8)]  # 1k ... 128k
QUICK_SEQS = [1024, 8192, 32768, 131072]
DEFAULT_IMPLS = ("fa2", "cudnn", "fa3", "tokamax", "xla")
RUN_FRACTION = 0.9  # run a case only if its compiled size is under this share of the device limit


def build_parser():
  p = h.script_parser("memory", __doc__)
  p.add_argument("--seqs", type=h.parse_ints, default=None)
  p.add_argument("--impls", type=h.impl_names, default=None,
                 help=f"comma list of {', '.join(impls.NAMES)} (default {','.join(DEFAULT_IMPLS)})")
  p.add_argument("--batch", type=h.positive_int, default=1)
  p.add_argument("--heads", type=h.positive_int, default=16)
  p.add_argument("--head-dim", type=h.positive_int, default=128)
  p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
  p.add_argument("--causal", action="store_true", help="causal mask (default: none)")
  p.add_argument("--no-run", action="store_true", help="compile only (no peak_bytes_in_use)")
  p.add_argument("--no-isolate", action="store_true",
                 help="measure every implementation in this process (peaks then mix)")
  p.add_argument("--worker-out", type=Path, default=None, help=argparse.SUPPRESS)  # a child's output
  h.add_common_args(p)
  return p


def settings(args):
  if args.smoke:
    args.heads, args.head_dim = min(args.heads, 2), min(args.head_dim, 32)
    return sorted(args.seqs or [64, 128, 256]), list(args.impls or DEFAULT_IMPLS)
  return sorted(args.seqs or (QUICK_SEQS if args.quick else SEQS)), list(args.impls or DEFAULT_IMPLS)


def measure_impl(impl, seqs, args, budget, emit):
  """All sizes of one implementation, ascending; ``emit(cell)`` after each."""
  import jax
  import jax.numpy as jnp
  dtype, dev = h.jnp_dtype(args.dtype), jax.devices()[0]

  def stats():
    try:
      return dev.memory_stats() or {}
    except Exception:  # noqa: BLE001 - the CPU backend has no memory stats
      return {}

  failed_at = run_failed_at = None
  for s in seqs:
    shape = (args.batch, s, args.heads, args.head_dim)
    cell = dict(impl=impl, seq=s, batch=args.batch, heads=args.heads, head_dim=args.head_dim,
                dtype=args.dtype, causal=args.causal, status="ok",
                io_floor_bytes=6 * math.prod(shape) * jnp.dtype(dtype).itemsize)  # q, k, v in; dq, dk, dv out
    # The throughput grid's seq limit of the XLA formula does not apply: sizing it is the point here.
    why = impls.unavailable(impl) or (None if impl == "xla" else impls.unsupported(
        impl, shape, shape, dtype, args.causal))
    if why or failed_at is not None or not budget.fits(impl):
      emit(dict(cell, status="unavailable" if impls.unavailable(impl) else "unsupported" if why else
                "skipped", error=why or (f"skipped: compile failed at seq {failed_at}" if failed_at
                                         else "skipped: time budget")))
      continue
    t0 = time.time()
    try:
      spec = jax.ShapeDtypeStruct(shape, dtype)
      compiled = fwd_bwd_fn(functools.partial(impls.get(impl), causal=args.causal)).lower(
          spec, spec, spec).compile()
      cell["compile_s"] = time.time() - t0
      ma = compiled.memory_analysis()
      comp = {k: getattr(ma, f"{k}_size_in_bytes", None) for k in (
          "argument", "output", "temp", "alias", "generated_code")}
      comp["total"] = comp["argument"] + comp["output"] + comp["temp"] - (comp["alias"] or 0)
      cell["compiled"] = comp
    except Exception as e:  # noqa: BLE001
      failed_at = s
      budget.record(impl, time.time() - t0)
      emit(dict(cell, status="oom" if h.is_oom(h.err_str(e)) else "error", error=h.err_str(e)))
      continue
    limit = cell["bytes_limit"] = stats().get("bytes_limit")
    if args.no_run or run_failed_at is not None or (limit and comp["total"] > RUN_FRACTION * limit):
      cell["run_skipped"] = ("--no-run" if args.no_run else f"ran out of memory at seq {run_failed_at}"
                             if run_failed_at is not None else f"compiled size {h.fmt_bytes(comp['total'])} "
                             f"exceeds {RUN_FRACTION:.0%} of the device limit {h.fmt_bytes(limit)}")
    else:
      try:
        before = stats().get("bytes_in_use")
        jax.block_until_ready(compiled(*h.random_inputs(s + 5, [shape] * 3, dtype)))
        peak = stats().get("peak_bytes_in_use")
        cell["run"] = dict(peak_bytes_in_use=peak, bytes_in_use_before=before,
                           peak_minus_before=peak - before if h.finite(peak) and h.finite(before) else None)
      except Exception as e:  # noqa: BLE001
        cell.update(run_error=h.err_str(e), status="run_oom" if h.is_oom(h.err_str(e)) else "run_error")
        run_failed_at = s if h.is_oom(h.err_str(e)) else None
    cell["wall_s"] = time.time() - t0
    budget.record(impl, cell["wall_s"])
    emit(cell)


def in_child(impl, seqs, args, deadline) -> tuple[list[dict], str | None]:
  """One implementation's cells, measured in a fresh process (the whole device, its own peak)."""
  with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as fh:
    path = Path(fh.name)
  cmd = [sys.executable, "-m", "benchmarks.memory", "--worker-out", str(path), "--impls", impl,
         "--seqs", ",".join(map(str, seqs)), "--batch", str(args.batch), "--heads", str(args.heads),
         "--head-dim", str(args.head_dim), "--dtype", args.dtype, "--seed", str(args.seed),
         *(["--causal"] if args.causal else []), *(["--no-run"] if args.no_run else []),
         *(["--deadline", str(deadline)] if deadline is not None else [])]
  err = None
  try:
    timeout = None if deadline is None else max(30.0, deadline - time.time() + 60.0)
    r = subprocess.run(cmd, cwd=h.ROOT, timeout=timeout, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
      err = f"worker exited with {r.returncode}: " + " ".join(r.stdout.split()[-60:])
  except subprocess.TimeoutExpired:
    err = "worker killed: time budget"
  except Exception as e:  # noqa: BLE001
    err = h.err_str(e)
  cells = [json.loads(line) for line in (path.read_text().splitlines() if path.exists() else [])]
  path.unlink(missing_ok=True)
  return cells, err


def cell_key(c):
  return (c.get("impl"), c.get("seq"), c.get("dtype"), c.get("causal"))


def run(args) -> dict:
  seqs, names = settings(args)
  if args.worker_out:  # a child process of an isolated run: one JSON line per cell
    with open(args.worker_out, "a", buffering=1) as out:
      for impl in names:
        measure_impl(impl, seqs, args, h.Budget(args.deadline),
                     lambda c: out.write(json.dumps(h.sanitize(c)) + "\n"))
    return {}
  # With isolation this process never starts a jax backend: each child gets the whole device.
  info = h.device_info(init_backend=False)
  h.cpu_fallback(args, info, STEM)
  isolate = not args.no_isolate and not args.smoke
  info = info if isolate else h.device_info()
  seqs, names = settings(args)
  run = h.Run(args, STEM, info, dict(
      seqs=seqs, impls=names, batch=args.batch, heads=args.heads, head_dim=args.head_dim,
      dtype=args.dtype, causal=args.causal, isolated=isolate,
      method="compiled memory_analysis of jit(grad(f32 sum of attention)) (argument + output + temp "
             "− alias); peak_bytes_in_use after one run where it fits (one process per impl, sizes "
             "ascending)"), cell_key, len(names) * len(seqs))
  emit = lambda c: run.add(c, check=False)  # noqa: E731
  for k, impl in enumerate(names):
    if not isolate:
      measure_impl(impl, seqs, args, run.budget, emit)
      continue
    left = run.budget.left()  # each implementation gets an equal share of what is left
    cells, err = in_child(impl, seqs, args,
                          None if math.isinf(left) else time.time() + left / (len(names) - k))
    for c in cells:
      emit(c)
    for s in sorted(set(seqs) - {c["seq"] for c in cells}):
      emit(dict(impl=impl, seq=s, batch=args.batch, heads=args.heads, head_dim=args.head_dim,
                dtype=args.dtype, causal=args.causal, status="error", error=err or "no result from worker"))
    if err:
      run.rec.note(f"{impl}: {err[:400]}")
  run.rec.data["meta"].update(absent_impls={c["impl"]: c["error"] for c in run.rec.cells
                                            if c.get("status") == "unavailable"},
                              device_bytes_limit=max([c.get("bytes_limit") or 0 for c in run.rec.cells]
                                                     + [info.get("device_bytes_limit") or 0]) or None)
  return run.finish(render, summary)


def _total(c):
  return (c.get("compiled") or {}).get("total")


def _peak(c):
  return (c.get("run") or {}).get("peak_minus_before")


def slope(cells, impl, key=_total, min_seq=4096):
  """Log-log slope of bytes against seq (1 = linear, 2 = quadratic), from 4k on where it can."""
  pts = [(c["seq"], key(c)) for c in cells if c["impl"] == impl and h.finite(key(c)) and key(c) > 0]
  big = [p for p in pts if p[0] >= min_seq]
  pts = big if len(big) >= 2 else pts
  return float(np.polyfit(*np.log(list(zip(*pts))), 1)[0]) if len(pts) >= 2 else None


def _impls(cells):
  return h.ordered(c["impl"] for c in cells if c.get("status") != "unavailable")


def render(data, base):
  cells = [c for c in data.get("cells", []) if "impl" in c]
  cfg, meta = data.get("config", {}), data.get("meta", {})
  lines = h.header(data, f"Memory of one forward+backward (batch {cfg.get('batch')}, {cfg.get('heads')} "
                   f"heads × {cfg.get('head_dim')}, {cfg.get('dtype')}, "
                   f"{'causal' if cfg.get('causal') else 'non-causal'})") + [
      f"- method: {cfg.get('method')}",
      f"- device allocator limit: {h.fmt_bytes(meta.get('device_bytes_limit'))}", "",
      "Cells: compiled size (arguments + outputs + temporaries) / measured peak; I/O floor = q, k, v "
      "in + dq, dk, dv out. ✗ = failed (see below), — = not run (too big or --no-run).", ""]
  seqs = sorted({c["seq"] for c in cells})
  by = {(c["impl"], c["seq"]): c for c in cells}
  floors = {c["seq"]: c.get("io_floor_bytes") for c in cells}

  def text(c):
    if c is None or c.get("status") == "skipped":
      return "–" if c is None else "✗" if "compile failed" in (c.get("error") or "") else "skip"
    if not h.finite(_total(c)):
      return "✗ OOM" if c.get("status") == "oom" else "✗"
    return f"{h.fmt_bytes(_total(c))} / " + (h.fmt_bytes(_peak(c)) if h.finite(_peak(c)) else
                                            "OOM" if c.get("status") == "run_oom" else "—")

  lines.append(h.md_table(["impl"] + [h.seq_label(s) for s in seqs],
                          [["I/O floor"] + [h.fmt_bytes(floors.get(s)) for s in seqs]]
                          + [[h.style(i)[0]] + [text(by.get((i, s))) for s in seqs] for i in _impls(cells)]))
  lines += ["", "## Growth", ""]
  for i in _impls(cells):
    sl = slope(cells, i)
    kind = "–" if sl is None else "linear" if sl < 1.3 else "quadratic" if sl > 1.7 else "between"
    runs, comps = ([c["seq"] for c in cells if c["impl"] == i and h.finite(f(c))] for f in (_peak, _total))
    lines.append(f"- {h.style(i)[0]}: log-log slope of compiled size {h.fmt_num(sl, '.2f')} ({kind}); "
                 f"of measured peak {h.fmt_num(slope(cells, i, _peak), '.2f')}" + (
                     f"; compiles up to seq {h.seq_label(max(comps))}" if comps else "")
                 + (f", runs up to seq {h.seq_label(max(runs))}" if runs else ""))
  lines += h.failures([c for c in cells if c.get("status") != "skipped"], lambda c: h.style(c["impl"])[0],
                      lambda c: h.seq_label(c["seq"]), keys=("error", "run_error"))
  lines += [f"- note: {n}" for n in data.get("notes", [])]
  return [h.write_md(lines, base)] + plot(data, cells, base)


def plot(data, cells, base):
  """Compiled size (lines) and measured peak (crosses) against seq, log-log, with the I/O floor and
  lines proportional to seq and seq² for reference."""
  plt = h.pyplot()
  if plt is None or not cells:
    return []
  from matplotlib.ticker import FuncFormatter
  fig, ax = plt.subplots(figsize=(7.5, 5.5))
  for i in reversed(_impls(cells)):  # fa2_jax drawn last, on top
    label, colour, _ = h.style(i)
    for key, fmt, kw in ((_total, "-o", dict(label=label)), (_peak, "x", dict(ms=9))):
      pts = sorted((c["seq"], key(c)) for c in cells if c["impl"] == i and h.finite(key(c)))
      if pts:
        ax.plot(*zip(*pts), fmt, color=colour, **kw)
  fl = sorted({(c["seq"], c["io_floor_bytes"]) for c in cells if h.finite(c.get("io_floor_bytes"))})
  if fl:
    xs, (s0, b0) = [x for x, _ in fl], fl[0]
    ax.plot(xs, [b for _, b in fl], ":", color="black", label="I/O floor (6 tensors)")
    ax.plot(xs, [b0 * x / s0 for x in xs], "--", color="0.75", lw=0.8, label="∝ seq")
    ax.plot(xs, [b0 * (x / s0) ** 2 for x in xs], "-.", color="0.75", lw=0.8, label="∝ seq²")
  limit = (data.get("meta") or {}).get("device_bytes_limit")
  if limit:
    ax.axhline(limit, color="black", lw=0.8, ls="--", label="device limit")
  h.seq_axis(ax)
  ax.set_yscale("log", base=2)
  ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: h.fmt_bytes(y)))
  ax.set_ylabel("device memory (line: compiled, ×: measured peak)")
  ax.grid(alpha=0.3, which="both")
  entries = h.legend_entries([ax])
  ax.legend(entries.values(), entries.keys(), fontsize=7)
  cfg = data.get("config", {})
  return h.save(plt, fig, base, data, f"Memory of one fwd+bwd, {cfg.get('heads')} × {cfg.get('head_dim')} "
                f"{cfg.get('dtype')}, batch {cfg.get('batch')}")


def summary(data) -> str:
  cells = [c for c in data.get("cells", []) if "impl" in c]
  return "\n".join(["memory fwd+bwd: compiled total / measured peak"] + [
      f"  {i:<12} slope {h.fmt_num(slope(cells, i), '.2f')}: " + "; ".join(
          f"{h.seq_label(c['seq'])}: {h.fmt_bytes(_total(c)) if h.finite(_total(c)) else c.get('status')}"
          f" / {h.fmt_bytes(_peak(c)) if h.finite(_peak(c)) else '-'}"
          for c in sorted((c for c in cells if c["impl"] == i), key=lambda c: c["seq"]))
      for i in _impls(cells)])


def main(argv=None):
  return h.script_main(argv, build_parser(), run, render, summary, STEM, cell_key)


if __name__ == "__main__":
  main()
