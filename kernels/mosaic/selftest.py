"""GPU self-test of the Mosaic GPU (Hopper) kernels: correctness matrix, then TFLOP/s beside cuDNN.

    python -m fa2_jax.kernels.mosaic.selftest            # on an sm90 GPU, < 5 minutes
    OUT=/some/dir python -m fa2_jax.kernels.mosaic.selftest   # + tracebacks/JSON under $OUT

Correctness: each case compiles and runs forward + backward and compares out, lse, dq, dk, dv with
``fa2_jax.reference_attention`` in float32 (relative L2 error). A value passes when its error is at
most ``2 x`` the error of the same formula evaluated by XLA in the input dtype, plus 1e-3.
Speed: B=2, T=S=8192, N=16, H=128 bf16, non-causal and causal; median of jitted, block_until_ready
runs; forward FLOPs = 4 B N T S H (halved when causal), backward = 2.5 x forward.

Every case runs under try/except (one line per failure; full tracebacks go to
``$OUT/mosaic_selftest.log``). A watchdog ends the process with the table printed if a case hangs
(a barrier deadlock cannot be interrupted otherwise) or the whole run nears its time budget.
Options: ``--quick`` (three small correctness cases), ``--no-bench``, ``--bench-only``,
``--only SUBSTRING``, ``--case-timeout S`` (per phase), ``--budget S``, ``--interpret`` (CPU: shrunken shapes in Pallas GPU interpret mode with emulated
wgmma, see ``ops.emulated_mma``; checks the harness and the kernels' logic, not wgmma), ``--lower``
(CPU: lower every case for sm90 — Mosaic layout inference and dialect lowering, no execution).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import threading
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import fa2_jax

from .backward import backward
from .common import MosaicConfig, supports
from .forward import forward

_OUT = os.environ.get("OUT")
_LOG = os.path.join(_OUT, "mosaic_selftest.log") if _OUT else None
_ROWS: list[dict] = []
_T0 = time.time()


def _log_exc(title: str):
  if _LOG is None:
    return
  with open(_LOG, "a") as f:
    f.write(f"===== {title}\n{traceback.format_exc()}\n")


def _short(e: BaseException, n: int = 220) -> str:
  msg = " ".join(str(e).split())
  return f"{type(e).__name__}: {msg[:n]}"


# --- watchdog -----------------------------------------------------------------------------------------

class _Watchdog:
  """Kills the process (after printing the table) if a case or the whole run overstays."""

  def __init__(self, budget_s: float):
    self.budget = budget_s
    self.case = None
    self.case_deadline = None
    self.lock = threading.Lock()
    t = threading.Thread(target=self._run, daemon=True)
    t.start()

  def start(self, name: str, timeout_s: float):
    with self.lock:
      self.case, self.case_deadline = name, time.time() + timeout_s

  def stop(self):
    with self.lock:
      self.case, self.case_deadline = None, None

  def _run(self):
    while True:
      time.sleep(1.0)
      with self.lock:
        now = time.time()
        late_case = self.case_deadline is not None and now > self.case_deadline
        late_all = now - _T0 > self.budget + 60
        name = self.case
      if late_case or late_all:
        why = (f"TIMEOUT in case {name!r} (likely a barrier deadlock or a very slow compile)"
               if late_case else f"TIMEOUT: whole run exceeded {self.budget + 60:.0f}s")
        print(f"\n!!! {why}; exiting", flush=True)
        _ROWS.append(dict(kind="timeout", name=name or "-", status="TIMEOUT", note=why))
        _print_table()
        _dump_json()
        sys.stdout.flush()
        os._exit(3)


# --- correctness --------------------------------------------------------------------------------------

def _rel(x, ref) -> float:
  x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
  den = np.linalg.norm(ref)
  return float(np.linalg.norm(x - ref) / (den if den > 0 else 1.0))


def _inputs(b, t, s, n, kh, h, dtype, seed=0, with_dlse=False):
  ks = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(ks[0], (b, t, n, h), jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], (b, s, kh, h), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (b, s, kh, h), jnp.float32).astype(dtype)
  do = jax.random.normal(ks[3], (b, t, n, h), jnp.float32).astype(dtype)
  dlse = jax.random.normal(ks[4], (b, n, t), jnp.float32) if with_dlse else None
  return q, k, v, do, dlse


def _reference(q, k, v, do, dlse, scale, causal, compute_dtype):
  """out, lse [B,N,T], dq, dk, dv of the plain formula in ``compute_dtype``."""

  def f(q, k, v):
    out, lse = fa2_jax.reference_attention(q, k, v, scale=scale, is_causal=causal,
                                           return_residual=True, compute_dtype=compute_dtype)
    return out, lse

  @jax.jit
  def run(q, k, v, do, dlse):
    (out, lse), vjp = jax.vjp(f, q, k, v)
    dlse_btn = (jnp.zeros(lse.shape, lse.dtype) if dlse is None
                else jnp.swapaxes(dlse, 1, 2).astype(lse.dtype))
    dq, dk, dv = vjp((do.astype(out.dtype), dlse_btn))
    return out, jnp.swapaxes(lse, 1, 2), dq, dk, dv

  return run(q, k, v, do, dlse)


def _mosaic(q, k, v, do, dlse, scale, causal, cfg, wd=None, name="", timeout=60.0):
  """Forward, then backward, each jitted and awaited separately (a hang names its phase)."""
  if wd is not None:
    wd.start(f"{name} [forward]", timeout)
  fwd = jax.jit(lambda q, k, v: forward(q, k, v, scale=scale, is_causal=causal, config=cfg))
  out, lse = jax.block_until_ready(fwd(q, k, v))
  if wd is not None:
    wd.start(f"{name} [backward]", timeout)
  bwd = jax.jit(lambda q, k, v, out, lse, do, dlse: backward(
      q, k, v, out, lse, do, dlse=dlse, scale=scale, is_causal=causal, config=cfg))
  dq, dk, dv = jax.block_until_ready(bwd(q, k, v, out, lse, do, dlse))
  return out, lse, dq, dk, dv


def _case(name, b, t, s, n, kh, h, causal, dtype=jnp.bfloat16, cfg=None, with_dlse=False,
          timeout=90.0, wd=None):
  row = dict(kind="check", name=name, shape=f"B{b} T{t} S{s} N{n} K{kh} H{h}",
             causal=causal, dtype=jnp.dtype(dtype).name, status="?", note="")
  t0 = time.time()
  if wd is not None:
    wd.start(name, timeout)
  try:
    why = supports((b, t, n, h), (b, s, kh, h), dtype, h, causal)
    if why is not None:
      raise ValueError(f"supports() refused: {why}")
    scale = 1.0 / math.sqrt(h)
    q, k, v, do, dlse = _inputs(b, t, s, n, kh, h, dtype, with_dlse=with_dlse)
    got = _mosaic(q, k, v, do, dlse, scale, causal, cfg, wd=wd, name=name, timeout=timeout)
    if wd is not None:
      wd.start(f"{name} [reference]", timeout)
    ref = _reference(q, k, v, do, dlse, scale, causal, jnp.float32)
    low = _reference(q, k, v, do, dlse, scale, causal, dtype)
    names = ("out", "lse", "dq", "dk", "dv")
    errs, bad = {}, []
    for nm, x, r, lo in zip(names, got, ref, low):
      if not np.all(np.isfinite(np.asarray(jnp.asarray(x, jnp.float32)))):
        bad.append(f"{nm}:nonfinite")
        errs[nm] = float("nan")
        continue
      e, e_xla = _rel(x, r), _rel(lo, r)
      errs[nm] = e
      if e > 2.0 * e_xla + 1e-3:
        bad.append(f"{nm}:{e:.1e}>{2 * e_xla + 1e-3:.1e}")
    row.update(errs)
    row["status"] = "ok" if not bad else "FAIL"
    row["note"] = " ".join(bad)
  except Exception as e:  # noqa: BLE001 - one failure must not hide the others
    row["status"] = "ERROR"
    row["note"] = _short(e)
    _log_exc(f"case {name}")
  finally:
    if wd is not None:
      wd.stop()
  row["secs"] = round(time.time() - t0, 1)
  _ROWS.append(row)
  errs = " ".join(f"{k}={row[k]:.1e}" for k in ("out", "lse", "dq", "dk", "dv") if k in row)
  print(f"[{row['status']:5s}] {name:28s} {row['shape']:28s} causal={int(causal)} "
        f"{row['dtype']:8s} {errs} {row['note']} ({row['secs']}s)", flush=True)


# --- speed --------------------------------------------------------------------------------------------

def _mosaic_attention(scale, causal, cfg):
  @jax.custom_vjp
  def attn(q, k, v):
    return forward(q, k, v, scale=scale, is_causal=causal, config=cfg)[0]

  def fwd(q, k, v):
    out, lse = forward(q, k, v, scale=scale, is_causal=causal, config=cfg)
    return out, (q, k, v, out, lse)

  def bwd(res, do):
    q, k, v, out, lse = res
    return backward(q, k, v, out, lse, do, scale=scale, is_causal=causal, config=cfg)

  attn.defvjp(fwd, bwd)
  return attn


def _time(fn, args, reps):
  jfn = jax.jit(fn)
  jax.block_until_ready(jfn(*args))  # compile
  jax.block_until_ready(jfn(*args))  # warm
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(jfn(*args))
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts)


def _bench(impl, causal, mode, b=2, t=8192, n=16, h=128, reps=10, cfg=None, label=None, wd=None,
           timeout=90.0):
  label = label or impl
  row = dict(kind="bench", name=f"{label} {mode}", shape=f"B{b} T{t} S{t} N{n} H{h}",
             causal=causal, dtype="bfloat16", status="?", note="")
  if wd is not None:
    wd.start(row["name"], timeout)
  try:
    scale = 1.0 / math.sqrt(h)
    q, k, v, do, _ = _inputs(b, t, t, n, n, h, jnp.bfloat16, seed=1)
    if impl == "mosaic":
      attn = _mosaic_attention(scale, causal, cfg)
    else:
      attn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                                          implementation="cudnn")
    flops_fwd = 4.0 * b * n * t * t * h * (0.5 if causal else 1.0)
    if mode == "fwd":
      sec = _time(attn, (q, k, v), reps)
      flops = flops_fwd
    else:
      def fwd_bwd(q, k, v, do):
        out, vjp = jax.vjp(attn, q, k, v)
        return out, vjp(do)
      sec = _time(fwd_bwd, (q, k, v, do), reps)
      flops = flops_fwd * 3.5  # forward + backward (2.5 x forward)
    row["ms"] = round(sec * 1e3, 3)
    row["tflops"] = round(flops / sec / 1e12, 1)
    row["status"] = "ok"
  except Exception as e:  # noqa: BLE001
    row["status"] = "ERROR"
    row["note"] = _short(e)
    _log_exc(f"bench {row['name']} causal={causal}")
  finally:
    if wd is not None:
      wd.stop()
  _ROWS.append(row)
  perf = f"{row['ms']:8.3f} ms {row['tflops']:6.1f} TFLOP/s" if row["status"] == "ok" else ""
  print(f"[{row['status']:5s}] {row['name']:28s} causal={int(causal)} {perf} {row['note']}",
        flush=True)


# --- report -------------------------------------------------------------------------------------------

def _print_table():
  print("\n==== fa2_jax mosaic self-test summary ====")
  checks = [r for r in _ROWS if r["kind"] == "check"]
  if checks:
    print(f"{'case':28s} {'shape':28s} {'c':1s} {'dtype':8s} {'out':>8s} {'lse':>8s} {'dq':>8s} "
          f"{'dk':>8s} {'dv':>8s}  status")
    for r in checks:
      vals = " ".join(f"{r[k]:8.1e}" if k in r else f"{'-':>8s}"
                      for k in ("out", "lse", "dq", "dk", "dv"))
      print(f"{r['name']:28s} {r['shape']:28s} {int(r['causal'])} {r['dtype']:8s} {vals}  "
            f"{r['status']} {r['note'][:120]}")
  benches = [r for r in _ROWS if r["kind"] == "bench"]
  if benches:
    print(f"\n{'benchmark (B2 T=S=8192 N16 H128 bf16)':40s} {'causal':>6s} {'ms':>9s} "
          f"{'TFLOP/s':>8s}")
    for r in benches:
      ms = f"{r['ms']:9.3f}" if "ms" in r else f"{'-':>9s}"
      tf = f"{r['tflops']:8.1f}" if "tflops" in r else f"{'-':>8s}"
      print(f"{r['name']:40s} {int(r['causal']):6d} {ms} {tf}  {r['status']} {r['note'][:100]}")
  for r in _ROWS:
    if r["kind"] == "timeout":
      print(f"TIMEOUT: {r['note']}")
  n_bad = sum(r["status"] != "ok" for r in _ROWS)
  print(f"\n{len(_ROWS) - n_bad}/{len(_ROWS)} ok, total {time.time() - _T0:.0f}s"
        + (f"; tracebacks in {_LOG}" if _LOG and n_bad else ""), flush=True)


def _dump_json():
  if _OUT:
    try:
      with open(os.path.join(_OUT, "mosaic_selftest.json"), "w") as f:
        json.dump(_ROWS, f, indent=1, default=str)
    except OSError:
      pass


def _cases():
  C = MosaicConfig.default
  return [
      # name, b, t, s, n, kh, h, causal, extra kwargs
      ("h64 small", 2, 256, 256, 4, 4, 64, False, {}),
      ("h128 small causal", 2, 256, 256, 4, 4, 128, True, {}),
      ("h64 causal 1k", 1, 1024, 1024, 4, 4, 64, True, {}),
      ("h128 2k", 1, 2048, 2048, 4, 4, 128, False, {}),
      ("h128 causal 4k", 1, 4096, 4096, 2, 2, 128, True, {}),
      ("h128 GQA 8/2 causal", 1, 1024, 1024, 8, 2, 128, True, {}),
      ("h128 ragged 1000 (tma)", 1, 1000, 1000, 2, 2, 128, True, {}),
      ("h128 ragged 777x1111 (pad)", 1, 777, 1111, 2, 1, 128, False, {}),
      ("h128 dlse cotangent", 1, 512, 512, 2, 2, 128, True, dict(with_dlse=True)),
      ("h128 fp16", 1, 512, 512, 2, 2, 128, False, dict(dtype=jnp.float16)),
      ("h128 causal no-pingpong", 1, 1024, 1024, 2, 2, 128, True,
       dict(cfg=C(128).replace(pingpong=False))),
      ("h256 causal", 1, 512, 512, 2, 2, 256, True, {}),
  ]


def _lower_all():
  """Lower forward + backward of every case for the cuda platform (no GPU needed).

  This runs Pallas -> Mosaic GPU lowering, Mosaic's layout inference and its dialect lowering with
  arch sm90 — most API/shape/layout mistakes surface here. What it cannot check: the C++ passes
  (LLVM/PTX/ptxas, register allocation) and runtime behaviour (deadlocks, numerics).
  """
  cases = _cases() + [("bench", 2, 8192, 8192, 16, 16, 128, c, {}) for c in (False, True)]
  n_bad = 0
  for name, b, t, s, n, kh, h, causal, kw in cases:
    dt = kw.get("dtype", jnp.bfloat16)
    attn = _mosaic_attention(1.0 / math.sqrt(h), causal, kw.get("cfg"))

    def fwd_bwd(q, k, v, do):
      out, vjp = jax.vjp(attn, q, k, v)
      return out, vjp(do)

    sd = lambda shape: jax.ShapeDtypeStruct(shape, dt)
    t0 = time.time()
    try:
      jax.jit(fwd_bwd).trace(sd((b, t, n, h)), sd((b, s, kh, h)), sd((b, s, kh, h)),
                             sd((b, t, n, h))).lower(lowering_platforms=("cuda",))
      status = "ok"
    except Exception as e:  # noqa: BLE001
      status, n_bad = f"ERROR {_short(e, 400)}", n_bad + 1
      _log_exc(f"lower {name}")
    print(f"[lower] {name:28s} B{b} T{t} S{s} N{n} K{kh} H{h} causal={int(causal)} "
          f"{jnp.dtype(dt).name}: {status} ({time.time() - t0:.1f}s)", flush=True)
  print(f"{len(cases) - n_bad}/{len(cases)} lowered")
  return 0 if n_bad == 0 else 1


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="three small correctness cases only")
  ap.add_argument("--no-bench", action="store_true")
  ap.add_argument("--case-timeout", type=float, default=75.0,
                  help="seconds per phase (compile + run) before the watchdog ends the run")
  ap.add_argument("--only", default="", help="run only cases/benchmarks whose name contains this")
  ap.add_argument("--bench-only", action="store_true")
  ap.add_argument("--budget", type=float, default=270.0, help="seconds; later cases are skipped")
  ap.add_argument("--interpret", action="store_true",
                  help="CPU: small shapes, GPU interpret mode, emulated wgmma, no benchmarks")
  ap.add_argument("--lower", action="store_true",
                  help="CPU: only lower every case (and the benchmark shapes) for sm90")
  args = ap.parse_args(argv)
  if args.lower:
    return _lower_all()
  if args.interpret:
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from .ops import emulated_mma
    args.no_bench = True
    args.budget = max(args.budget, 3600.0)
    with emulated_mma(), plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
      return _main(args)
  return _main(args)


def _main(args):
  if _OUT:
    os.makedirs(_OUT, exist_ok=True)
  dev = jax.devices()[0]
  cc = getattr(dev, "compute_capability", "?")
  print(f"jax {jax.__version__}, device {dev.device_kind} (compute capability {cc}), "
        f"backend {jax.default_backend()}", flush=True)
  if str(cc) != "9.0":
    print("WARNING: these kernels target sm90 (Hopper); expect failures elsewhere", flush=True)
  wd = _Watchdog(args.budget)
  to = args.case_timeout
  cases = _cases()
  if args.quick:
    cases = cases[:3]
  if args.interpret:  # shrink: interpret mode runs every warpgroup as a Python thread
    shrink = lambda x: 192 + x % 64 if x % 64 else min(x, 256)  # keeps ragged lengths ragged
    cases = [(nm, 1, shrink(t), shrink(s), min(n, 4), min(n, 4) if kh == n else max(1, min(n, 4) * kh // n),
              h, c, kw) for nm, b, t, s, n, kh, h, c, kw in cases]
  if args.only:
    cases = [c for c in cases if args.only in c[0]]
  if args.bench_only:
    cases = []
  for name, b, t, s, n, kh, h, causal, kw in cases:
    if time.time() - _T0 > args.budget * 0.55:
      _ROWS.append(dict(kind="check", name=name, shape=f"B{b} T{t} S{s} N{n} K{kh} H{h}",
                        causal=causal, dtype="-", status="SKIP", note="time budget"))
      print(f"[SKIP ] {name} (time budget)", flush=True)
      continue
    _case(name, b, t, s, n, kh, h, causal, timeout=to, wd=wd, **kw)
  if not (args.quick or args.no_bench):
    benches = [("mosaic", False, "fwd"), ("cudnn", False, "fwd"),
               ("mosaic", False, "fwd+bwd"), ("cudnn", False, "fwd+bwd"),
               ("mosaic", True, "fwd"), ("cudnn", True, "fwd"),
               ("mosaic", True, "fwd+bwd"), ("cudnn", True, "fwd+bwd")]
    if args.only:
      benches = [x for x in benches if args.only in f"{x[0]} {x[2]}"]
    for impl, causal, mode in benches:
      if time.time() - _T0 > args.budget * 0.9:
        print(f"[SKIP ] {impl} {mode} causal={int(causal)} (time budget)", flush=True)
        continue
      _bench(impl, causal, mode, wd=wd, timeout=to)
    if time.time() - _T0 < args.budget * 0.85 and not args.only:
      _bench("mosaic", False, "fwd", cfg=MosaicConfig.default(128).replace(pingpong=False),
             label="mosaic no-pingpong", wd=wd, timeout=to)
  _print_table()
  _dump_json()
  return 0 if all(r["status"] == "ok" for r in _ROWS) else 1


if __name__ == "__main__":
  sys.exit(main())
