"""Device memory of one jitted forward+backward against sequence length: linear (FlashAttention) vs
quadratic (the materialised score matrix).

Batch 1, 16 heads of 128, bf16, seq 1k ... 128k; fa2_jax vs XLA vs cuDNN. The primary number is XLA's
own buffer assignment for the compiled program, ``jax.jit(...).lower(...).compile().memory_analysis()``:
arguments + outputs + temporaries − aliased bytes. It needs no memory, so it also gives the size of
programs that could never run. Where that size fits the device, the program also runs once and the
allocator's ``peak_bytes_in_use`` is read (from ``device.memory_stats()``). That peak can't be reset, so
on a GPU each implementation runs in its own process with the sizes ascending (each reading is then the
peak of the largest case so far, i.e. of this one). Failures (compile errors, out of memory) are
recorded as such; after a compile failure the larger sizes of that implementation are skipped.

    python -m benchmarks.memory [--quick] [--seqs 1k,...,128k] [--impls fa2_triton,xla,cudnn]
    python -m benchmarks.memory --smoke
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import common as C

SEQS = [1024 * 2 ** i for i in range(8)]  # 1k ... 128k
QUICK_SEQS = [1024, 8192, 32768, 131072]
DEFAULT_IMPLS = ["fa2_triton", "xla", "cudnn"]
RUN_FRACTION = 0.9  # run a case only if its compiled size is under this share of the device limit
STEM = "memory"


def build_parser():
  p = argparse.ArgumentParser(prog="python -m benchmarks.memory", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--seqs", type=C.parse_ints, default=None)
  p.add_argument("--impls", type=C.parse_strs, default=None)
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
  p.add_argument("--causal", action="store_true", help="causal mask (default: none)")
  p.add_argument("--no-run", action="store_true", help="compile only (no peak_bytes_in_use)")
  p.add_argument("--no-isolate", action="store_true",
                 help="measure every implementation in this process (peaks then mix)")
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--worker-out", type=Path, default=None, help=argparse.SUPPRESS)
  C.add_common_args(p)
  return p


def _settings(args):
  if args.smoke:
    seqs = args.seqs or [64, 128, 256]
    args.heads, args.head_dim = min(args.heads, 2), min(args.head_dim, 32)
    impls = args.impls or ["fa2_triton", "xla"]
  else:
    seqs = args.seqs or (QUICK_SEQS if args.quick else SEQS)
    impls = args.impls or C.with_mosaic(DEFAULT_IMPLS)
  unknown = [i for i in impls if i not in C.ALL_IMPLS]
  if unknown:
    raise SystemExit(f"unknown --impls {unknown}; known: {', '.join(C.ALL_IMPLS)}")
  return sorted(seqs), impls


def io_floor(batch, seq, heads, head_dim, itemsize):
  """Bytes that any implementation must hold: q, k, v, dO in and dq, dk, dv out."""
  return 7 * batch * seq * heads * head_dim * itemsize


def measure_impl(impl, seqs, args, budget, emit):
  """Worker body: all sizes of one implementation, ascending; ``emit(cell)`` after each."""
  import jax
  import jax.numpy as jnp
  C.ensure_fa2()
  interpret = C.default_interpret()
  dtype = C.jnp_dtype(args.dtype)
  dev = jax.devices()[0]
  failed_at = None
  run_failed_at = None
  for s in seqs:
    shape = (args.batch, s, args.heads, args.head_dim)
    cell = dict(impl=impl, label=C.IMPL_LABELS.get(impl, impl), seq=s, batch=args.batch,
                heads=args.heads, head_dim=args.head_dim, dtype=args.dtype, causal=args.causal,
                io_floor_bytes=io_floor(args.batch, s, args.heads, args.head_dim,
                                        jnp.dtype(dtype).itemsize), status="ok")
    if failed_at is not None:
      cell.update(status="skipped", error=f"skipped: compile failed at seq {failed_at}")
      emit(cell)
      continue
    if not budget.fits(impl):
      cell.update(status="skipped", error="skipped: time budget")
      emit(cell)
      continue
    t0 = time.time()
    try:
      f = C.make_attention(impl, causal=args.causal, interpret=interpret)
      g = C.fwd_bwd(f)
      spec = jax.ShapeDtypeStruct(shape, dtype)
      compiled = g.lower(spec, spec, spec, spec).compile()
      cell["compile_s"] = time.time() - t0
      ma = compiled.memory_analysis()
      if ma is None:
        raise RuntimeError("memory_analysis() returned None on this backend")
      fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                "alias_size_in_bytes", "generated_code_size_in_bytes", "peak_memory_in_bytes")
      comp = {k.replace("_size_in_bytes", "").replace("_in_bytes", ""): getattr(ma, k, None)
              for k in fields}
      comp["total"] = (comp["argument"] + comp["output"] + comp["temp"] - (comp["alias"] or 0))
      cell["compiled"] = comp
    except Exception as e:  # noqa: BLE001
      cell.update(status="oom" if C.is_oom(C.err_str(e)) else "error", error=C.err_str(e))
      failed_at = s
      budget.record(impl, time.time() - t0)
      emit(cell)
      continue
    stats0 = _stats(dev)
    limit = (stats0 or {}).get("bytes_limit")
    cell["bytes_limit"] = limit
    if args.no_run:
      cell["run_skipped"] = "--no-run"
    elif run_failed_at is not None:
      cell["run_skipped"] = f"ran out of memory at seq {run_failed_at}"
    elif limit and comp["total"] > RUN_FRACTION * limit:
      cell["run_skipped"] = (f"compiled size {C.fmt_bytes(comp['total'])} exceeds "
                             f"{RUN_FRACTION:.0%} of the device limit {C.fmt_bytes(limit)}")
    else:
      try:
        before = (stats0 or {}).get("bytes_in_use")
        ins = C.random_inputs(s + 5, [shape] * 4, dtype)
        out = compiled(*ins)
        jax.block_until_ready(out)
        st = _stats(dev) or {}
        run = {"peak_bytes_in_use": st.get("peak_bytes_in_use"), "bytes_in_use_before": before,
               "bytes_in_use_after": st.get("bytes_in_use")}
        if C.finite(run["peak_bytes_in_use"]) and C.finite(before):
          run["peak_minus_before"] = run["peak_bytes_in_use"] - before
        cell["run"] = run
        del ins, out
      except Exception as e:  # noqa: BLE001
        msg = C.err_str(e)
        cell["run_error"] = msg
        cell["status"] = "run_oom" if C.is_oom(msg) else "run_error"
        run_failed_at = s if C.is_oom(msg) else None
    cell["wall_s"] = time.time() - t0
    budget.record(impl, cell["wall_s"])
    emit(cell)


def _stats(dev):
  try:
    return dev.memory_stats()
  except Exception:  # noqa: BLE001
    return None


def _worker_main(args):
  """Child process: measure the given implementations, one JSON line per cell."""
  seqs, impls = _settings(args)
  budget = C.make_budget(args)
  out = open(args.worker_out, "a", buffering=1)
  import jax
  try:
    dev = jax.devices()[0]
    st = _stats(dev) or {}
    out.write(json.dumps({"worker_meta": {"backend": jax.default_backend(),
                                          "device_kind": dev.device_kind,
                                          "bytes_limit": st.get("bytes_limit"),
                                          "pid": os.getpid()}}) + "\n")
  except Exception as e:  # noqa: BLE001
    out.write(json.dumps({"worker_meta": {"error": C.err_str(e)}}) + "\n")
  for impl in impls:
    measure_impl(impl, seqs, args, budget, lambda c: out.write(json.dumps(C.sanitize(c)) + "\n"))
  out.close()


def _child_args(args, impl, deadline):
  a = [sys.executable, "-m", "benchmarks.memory", "--worker", "--impls", impl,
       "--seqs", ",".join(map(str, _settings(args)[0])), "--batch", str(args.batch),
       "--heads", str(args.heads), "--head-dim", str(args.head_dim), "--dtype", args.dtype,
       "--seed", str(args.seed)]
  if args.causal:
    a.append("--causal")
  if args.no_run:
    a.append("--no-run")
  if args.smoke:
    a.append("--smoke")
  if deadline is not None:
    a += ["--deadline", str(deadline)]
  return a


def run(args) -> dict:
  if args.worker:
    _worker_main(args)
    return {}
  seqs, impls = _settings(args)
  isolate = not args.no_isolate and not args.smoke
  # With isolation this process never starts a jax backend: each child gets the whole device.
  info = C.device_info(init_backend=not isolate)
  out_dir = C.resolve_out(args, info)
  budget = C.make_budget(args)
  rec = C.Recorder(out_dir / C.out_name(STEM, args.tag, "json"), info, dict(
      seqs=seqs, impls=impls, batch=args.batch, heads=args.heads, head_dim=args.head_dim,
      dtype=args.dtype, causal=args.causal, isolated=isolate,
      method="compiled memory_analysis of jit(vjp(attention)) (argument + output + temp − alias); "
             "peak_bytes_in_use after one run where it fits (one process per impl, sizes "
             "ascending)"), STEM)
  bar = C.progress(len(impls) * len(seqs), "memory")

  def emit(c):
    rec.add(c)
    bar.update(1)

  if not isolate:
    C.ensure_fa2()
    for impl in impls:
      measure_impl(impl, seqs, args, budget, emit)
  else:
    for k, impl in enumerate(impls):
      left = budget.left()
      share = None if math.isinf(left) else left / (len(impls) - k)
      deadline = None if share is None else time.time() + share
      with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as fh:
        path = Path(fh.name)
      cmd = _child_args(args, impl, deadline)
      cmd[cmd.index("--worker") + 1:cmd.index("--worker") + 1] = ["--worker-out", str(path)]
      err = None
      try:
        timeout = None if share is None else max(30.0, share + 60.0)
        r = subprocess.run(cmd, cwd=C.ROOT, timeout=timeout, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0:
          err = f"worker exited with {r.returncode}: " + " ".join(r.stdout.split()[-60:])
      except subprocess.TimeoutExpired:
        err = "worker killed: time budget"
      except Exception as e:  # noqa: BLE001
        err = C.err_str(e)
      got = set()
      for line in path.read_text().splitlines() if path.exists() else []:
        try:
          obj = json.loads(line)
        except json.JSONDecodeError:
          continue
        if "worker_meta" in obj:
          wm = obj["worker_meta"]
          rec.data["meta"].setdefault("backend", wm.get("backend"))
          rec.data["meta"].setdefault("device_kind", wm.get("device_kind"))
          rec.data["meta"].setdefault("device_bytes_limit", wm.get("bytes_limit"))
          continue
        got.add(obj.get("seq"))
        emit(obj)
      for s in seqs:
        if s not in got:
          emit(dict(impl=impl, label=C.IMPL_LABELS.get(impl, impl), seq=s, batch=args.batch,
                    heads=args.heads, head_dim=args.head_dim, dtype=args.dtype,
                    causal=args.causal, status="error", error=err or "no result from worker"))
      if err:
        rec.note(f"{impl}: {err[:400]}")
      try:
        path.unlink()
      except OSError:
        pass
  return C.finish_run(rec, bar, render, summary, out_dir, args.tag)


# --- rendering ----------------------------------------------------------------------------------------

def _impls(cells):
  out = []
  for i in ["fa2_mosaic"] + DEFAULT_IMPLS + [c["impl"] for c in cells]:
    if i not in out and any(c["impl"] == i for c in cells):
      out.append(i)
  return out


def _total(c):
  return (c.get("compiled") or {}).get("total")


def _peak(c):
  return (c.get("run") or {}).get("peak_minus_before")


def slope(cells, impl, key=_total, min_seq=4096):
  """Log-log slope of bytes against seq (1 = linear, 2 = quadratic)."""
  import numpy as np
  pts = [(c["seq"], key(c)) for c in cells if c["impl"] == impl and C.finite(key(c)) and key(c) > 0]
  big = [p for p in pts if p[0] >= min_seq]
  pts = big if len(big) >= 2 else pts
  if len(pts) < 2:
    return None
  x = np.log([p[0] for p in pts])
  y = np.log([p[1] for p in pts])
  return float(np.polyfit(x, y, 1)[0])


def render(data, out_dir: Path, tag=None):
  cells = [c for c in data.get("cells", []) if "impl" in c]
  cfg = data.get("config", {})
  meta = data.get("meta", {})
  out_dir = Path(out_dir)
  lines = [f"# Memory of one forward+backward (batch {cfg.get('batch')}, {cfg.get('heads')} heads × "
           f"{cfg.get('head_dim')}, {cfg.get('dtype')}, {'causal' if cfg.get('causal') else 'non-causal'})",
           ""]
  lines += C.meta_lines(meta)
  lim = meta.get("device_bytes_limit")
  lines += [f"- method: {cfg.get('method')}",
            f"- device allocator limit: {C.fmt_bytes(lim)}" if lim else "- device limit: unknown",
            "", "Cells: compiled size (arguments + outputs + temporaries) / measured peak; "
            "I/O floor = q, k, v, dO in + dq, dk, dv out. ✗ = failed (see below), "
            "— = not run (too big or --no-run).", ""]
  impls = _impls(cells)
  seqs = sorted({c["seq"] for c in cells})
  rows = []
  floors = {c["seq"]: c.get("io_floor_bytes") for c in cells}
  rows.append(["I/O floor"] + [C.fmt_bytes(floors.get(s)) for s in seqs])
  for i in impls:
    row = [C.IMPL_LABELS.get(i, i)]
    for s in seqs:
      cc = [c for c in cells if c["impl"] == i and c["seq"] == s]
      if not cc:
        row.append("–")
        continue
      c = cc[0]
      if c.get("status") == "skipped":
        row.append("✗" if "compile failed" in (c.get("error") or "") else "skip")
      elif not C.finite(_total(c)):
        row.append("✗ OOM" if c.get("status") == "oom" else "✗")
      else:
        pk = _peak(c)
        tail = (C.fmt_bytes(pk) if C.finite(pk)
                else ("OOM" if c.get("status") == "run_oom" else "—"))
        row.append(f"{C.fmt_bytes(_total(c))} / {tail}")
    rows.append(row)
  lines.append(C.md_table(["impl"] + [C.seq_label(s) for s in seqs], rows))
  lines += ["", "## Growth", ""]
  for i in impls:
    sl = slope(cells, i)
    sp = slope(cells, i, key=_peak)
    kind = ("–" if sl is None else "linear" if sl < 1.3 else "quadratic" if sl > 1.7 else "between")
    lines.append(f"- {C.IMPL_LABELS.get(i, i)}: log-log slope of compiled size "
                 f"{C.fmt_num(sl, '.2f')} ({kind}); of measured peak {C.fmt_num(sp, '.2f')}")
    ok = [c["seq"] for c in cells if c["impl"] == i and C.finite(_peak(c))]
    comp_ok = [c["seq"] for c in cells if c["impl"] == i and C.finite(_total(c))]
    if comp_ok:
      lines.append(f"  - compiles up to seq {C.seq_label(max(comp_ok))}"
                   + (f", runs up to seq {C.seq_label(max(ok))}" if ok else ""))
  errs = [c for c in cells if c.get("error") or c.get("run_error")]
  errs = [c for c in errs if c.get("status") != "skipped"]
  if errs:
    lines += ["", "## Failures", ""]
    for c in errs:
      lines.append(f"- {c['impl']} seq {C.seq_label(c['seq'])}: "
                   f"`{(c.get('error') or c.get('run_error'))[:300]}`")
  for n in data.get("notes", []):
    lines.append(f"- note: {n}")
  md = out_dir / C.out_name(STEM, tag, "md")
  md.write_text("\n".join(lines) + "\n")
  files = [md]
  files += plot(cells, out_dir, tag, lim)
  return files


def plot(cells, out_dir, tag=None, limit=None):
  plt = C.get_pyplot()
  if plt is None or not cells:
    return []
  fig, ax = plt.subplots(figsize=(7, 5))
  cmap = plt.get_cmap("tab10")
  for k, i in enumerate(_impls(cells)):
    col = cmap(k % 10)
    pts = sorted((c["seq"], _total(c)) for c in cells if c["impl"] == i and C.finite(_total(c)))
    if pts:
      ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", color=col,
              label=f"{C.IMPL_LABELS.get(i, i)} (compiled)")
    pk = sorted((c["seq"], _peak(c)) for c in cells if c["impl"] == i and C.finite(_peak(c)))
    if pk:
      ax.plot([p[0] for p in pk], [p[1] for p in pk], "x", color=col, markersize=9,
              label=f"{C.IMPL_LABELS.get(i, i)} (measured peak)")
  fl = sorted({(c["seq"], c.get("io_floor_bytes")) for c in cells if C.finite(c.get("io_floor_bytes"))})
  if fl:
    xs = [p[0] for p in fl]
    ax.plot(xs, [p[1] for p in fl], ":", color="gray", label="I/O floor (7 tensors)")
    s0, b0 = fl[0]
    ax.plot(xs, [b0 * (x / s0) for x in xs], "--", color="0.7", lw=0.8, label="∝ seq")
    ax.plot(xs, [b0 * (x / s0) ** 2 for x in xs], "-.", color="0.7", lw=0.8, label="∝ seq²")
  if limit:
    ax.axhline(limit, color="red", lw=0.8, ls="--", label="device limit")
  from matplotlib.ticker import FuncFormatter
  C.seq_log_axis(ax)
  ax.set_yscale("log", base=2)
  ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: C.fmt_bytes(y)))
  ax.set_ylabel("device memory")
  ax.grid(alpha=0.3, which="both")
  ax.legend(fontsize=7)
  ax.set_title("Memory of one forward+backward")
  fig.tight_layout()
  return [C.save_png(plt, fig, Path(out_dir) / C.out_name(STEM, tag, "png"))]


def summary(data) -> str:
  cells = [c for c in data.get("cells", []) if "impl" in c]
  lines = ["memory fwd+bwd: compiled total / measured peak"]
  for i in _impls(cells):
    parts = []
    for c in sorted((c for c in cells if c["impl"] == i), key=lambda c: c["seq"]):
      t = C.fmt_bytes(_total(c)) if C.finite(_total(c)) else c.get("status", "?")
      p = C.fmt_bytes(_peak(c)) if C.finite(_peak(c)) else "-"
      parts.append(f"{C.seq_label(c['seq'])}: {t} / {p}")
    lines.append(f"  {i:<12} slope {C.fmt_num(slope(cells, i), '.2f')}: " + "; ".join(parts))
  return "\n".join(lines)


def main(argv=None):
  return C.script_main(argv, build_parser(), run, render, summary, STEM)


if __name__ == "__main__":
  main()
