"""Device memory of one jitted forward+backward against sequence length: linear (FlashAttention) vs
quadratic (the materialised score matrix).

Batch 1, 16 heads of 128, bf16, seq 1k ... 128k; fa2_jax vs XLA, cuDNN and the peers that import
(benchmarks/impls.py); forward+backward as benchmarks/timing.py builds it. The primary number is XLA's
own buffer assignment for the compiled program, ``jax.jit(...).lower(...).compile().memory_analysis()``:
arguments + outputs + temporaries − aliased bytes. It needs no memory, so it also gives the size of
programs that could never run. Where that size fits the device, the program also runs once and the
allocator's ``peak_bytes_in_use`` is read (from ``device.memory_stats()``). That peak can't be reset, so
on a GPU each implementation runs in its own process with the sizes ascending (each reading is then the
peak of the largest case so far, i.e. of this one). Failures (compile errors, out of memory) are
recorded as such; after a compile failure the larger sizes of that implementation are skipped.

    python -m benchmarks.memory [--quick] [--seqs 1k,...,128k] [--impls fa2,xla,cudnn]
    python -m benchmarks.memory --smoke
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import cli, impls
from .device import ROOT, device_info
from .memory_report import DEFAULT_IMPLS, STEM, render, summary
from .recorder import Recorder, finish_run
from .report import err_str, finite, fmt_bytes, is_oom, out_name, sanitize
from .timing import fwd_bwd_fn

SEQS = [1024 * 2 ** i for i in range(8)]  # 1k ... 128k
QUICK_SEQS = [1024, 8192, 32768, 131072]
RUN_FRACTION = 0.9  # run a case only if its compiled size is under this share of the device limit


def build_parser():
  p = argparse.ArgumentParser(prog="python -m benchmarks.memory", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--seqs", type=cli.parse_ints, default=None)
  p.add_argument("--impls", type=cli.impl_names, default=None,
                 help=f"comma list of {', '.join(impls.NAMES)} (default {','.join(DEFAULT_IMPLS)})")
  p.add_argument("--batch", type=cli.positive_int, default=1)
  p.add_argument("--heads", type=cli.positive_int, default=16)
  p.add_argument("--head-dim", type=cli.positive_int, default=128)
  p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
  p.add_argument("--causal", action="store_true", help="causal mask (default: none)")
  p.add_argument("--no-run", action="store_true", help="compile only (no peak_bytes_in_use)")
  p.add_argument("--no-isolate", action="store_true",
                 help="measure every implementation in this process (peaks then mix)")
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--worker-out", type=Path, default=None, help=argparse.SUPPRESS)
  cli.add_common_args(p)
  return p


def _settings(args):
  if args.smoke:
    seqs = args.seqs or [64, 128, 256]
    args.heads, args.head_dim = min(args.heads, 2), min(args.head_dim, 32)
  else:
    seqs = args.seqs or (QUICK_SEQS if args.quick else SEQS)
  return sorted(seqs), list(args.impls or DEFAULT_IMPLS)


def io_floor(batch, seq, heads, head_dim, itemsize):
  """Bytes that any implementation must hold: q, k, v in and dq, dk, dv out."""
  return 6 * batch * seq * heads * head_dim * itemsize


def measure_impl(impl, seqs, args, budget, emit):
  """Worker body: all sizes of one implementation, ascending; ``emit(cell)`` after each."""
  import jax
  import jax.numpy as jnp
  dtype = cli.jnp_dtype(args.dtype)
  dev = jax.devices()[0]
  failed_at = None
  run_failed_at = None
  for s in seqs:
    shape = (args.batch, s, args.heads, args.head_dim)
    cell = dict(impl=impl, label=impls.get(impl).label, seq=s, batch=args.batch,
                heads=args.heads, head_dim=args.head_dim, dtype=args.dtype, causal=args.causal,
                io_floor_bytes=io_floor(args.batch, s, args.heads, args.head_dim,
                                        jnp.dtype(dtype).itemsize), status="ok")
    # The XLA formula's seq limit of the throughput grid does not apply: sizing it is the point here.
    why = impls.unavailable(impl) or (None if impl == "xla" else impls.unsupported(
        impl, shape, shape, dtype, args.causal))
    if why:
      cell.update(status="unavailable" if impls.unavailable(impl) else "unsupported", error=why)
      emit(cell)
      continue
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
      g = fwd_bwd_fn(functools.partial(impls.get(impl), causal=args.causal))
      spec = jax.ShapeDtypeStruct(shape, dtype)
      compiled = g.lower(spec, spec, spec).compile()
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
      cell.update(status="oom" if is_oom(err_str(e)) else "error", error=err_str(e))
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
      cell["run_skipped"] = (f"compiled size {fmt_bytes(comp['total'])} exceeds "
                             f"{RUN_FRACTION:.0%} of the device limit {fmt_bytes(limit)}")
    else:
      try:
        before = (stats0 or {}).get("bytes_in_use")
        ins = cli.random_inputs(s + 5, [shape] * 3, dtype)
        out = compiled(*ins)
        jax.block_until_ready(out)
        st = _stats(dev) or {}
        run = {"peak_bytes_in_use": st.get("peak_bytes_in_use"), "bytes_in_use_before": before,
               "bytes_in_use_after": st.get("bytes_in_use")}
        if finite(run["peak_bytes_in_use"]) and finite(before):
          run["peak_minus_before"] = run["peak_bytes_in_use"] - before
        cell["run"] = run
        del ins, out
      except Exception as e:  # noqa: BLE001
        msg = err_str(e)
        cell["run_error"] = msg
        cell["status"] = "run_oom" if is_oom(msg) else "run_error"
        run_failed_at = s if is_oom(msg) else None
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
  seqs, names = _settings(args)
  budget = cli.make_budget(args)
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
    out.write(json.dumps({"worker_meta": {"error": err_str(e)}}) + "\n")
  for impl in names:
    measure_impl(impl, seqs, args, budget, lambda c: out.write(json.dumps(sanitize(c)) + "\n"))
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


def cell_key(c):
  return (c.get("impl"), c.get("seq"), c.get("dtype"), c.get("causal"))


def run(args) -> dict:
  if args.worker:
    _worker_main(args)
    return {}
  # With isolation this process never starts a jax backend: each child gets the whole device.
  info = device_info(init_backend=False)
  cli.cpu_fallback(args, info, STEM)
  isolate = not args.no_isolate and not args.smoke
  if not isolate:
    info = device_info()
  seqs, names = _settings(args)
  out_dir = cli.resolve_out(args, info)
  budget = cli.make_budget(args)
  rec = Recorder(out_dir / out_name(STEM, args.tag, "json"), info, dict(
      seqs=seqs, impls=names, batch=args.batch, heads=args.heads, head_dim=args.head_dim,
      dtype=args.dtype, causal=args.causal, isolated=isolate,
      method="compiled memory_analysis of jit(grad(f32 sum of attention)) (argument + output + temp "
             "− alias); "
             "peak_bytes_in_use after one run where it fits (one process per impl, sizes "
             "ascending)"), STEM)
  bar = cli.progress(len(names) * len(seqs), STEM)

  def emit(c):
    rec.add(c)
    bar.update(1)

  if not isolate:
    for impl in names:
      measure_impl(impl, seqs, args, budget, emit)
  else:
    for k, impl in enumerate(names):
      left = budget.left()
      share = None if math.isinf(left) else left / (len(names) - k)
      deadline = None if share is None else time.time() + share
      with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as fh:
        path = Path(fh.name)
      cmd = _child_args(args, impl, deadline)
      cmd[cmd.index("--worker") + 1:cmd.index("--worker") + 1] = ["--worker-out", str(path)]
      err = None
      try:
        timeout = None if share is None else max(30.0, share + 60.0)
        r = subprocess.run(cmd, cwd=ROOT, timeout=timeout, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0:
          err = f"worker exited with {r.returncode}: " + " ".join(r.stdout.split()[-60:])
      except subprocess.TimeoutExpired:
        err = "worker killed: time budget"
      except Exception as e:  # noqa: BLE001
        err = err_str(e)
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
          emit(dict(impl=impl, label=impls.get(impl).label, seq=s, batch=args.batch,
                    heads=args.heads, head_dim=args.head_dim, dtype=args.dtype,
                    causal=args.causal, status="error", error=err or "no result from worker"))
      if err:
        rec.note(f"{impl}: {err[:400]}")
      try:
        path.unlink()
      except OSError:
        pass
  absent = {c["impl"]: c["error"] for c in rec.cells if c.get("status") == "unavailable"}
  rec.data["meta"]["absent_impls"] = absent
  return finish_run(rec, bar, render, summary, out_dir, args.tag)


def main(argv=None):
  return cli.script_main(argv, build_parser(), run, render, summary, STEM, cell_key)


if __name__ == "__main__":
  main()
