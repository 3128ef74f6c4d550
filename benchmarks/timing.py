"""The one timing method of every benchmark, the project's anchor measurements':

* throughput: ``jax.jit``, ``warmup`` (2) calls, then the median over ``reps`` (5) repetitions of
  ``iters`` (10) back-to-back calls, ``block_until_ready`` once at the end of each repetition;
* forward: ``jit(f)``; forward+backward: ``jit(grad(lambda q, k, v: f(q, k, v).astype(f32).sum(),
  argnums=(0, 1, 2)))`` (the forward runs inside, as in training); backward time = forward+backward
  time − forward time; ``aux`` arrays (segment ids, lengths) are further arguments of the jitted
  function, never differentiated, so they are runtime data as in training, not compile-time constants;
* implementations compared in one cell (``measure_together``): every one is compiled and warmed up
  first, then the repetitions are interleaved: repetition ``r`` times each (implementation, pass) once,
  in an order rotated by ``r``, so that a clock or thermal drift over the cell's time (the forward's
  samples climb over the repetitions at 8k and 16k on the H200) falls on every row alike instead of on
  whichever ran last;
* latency: every call synchronised on its own, median over many calls, inputs rotated over a few sets.

Inputs are fresh random normals, never zeros. ``clock`` and ``block`` are parameters so that the
statistics can be tested with a fake clock.

FLOPs, the FlashAttention-2 paper's convention (§4.1; the anchors use the same): forward two matmuls,
``Q K^T`` and ``P V``, each ``2·B·N·T·S·H``, halved when causal; backward 2.5 times the forward (five
matmuls instead of two); forward+backward 3.5 times. The same count for every implementation, whatever
it really computes, so TFLOP/s compare like times.
"""
from __future__ import annotations

import time

import numpy as np


WARMUP = 2  # calls before timing: compilation, autotuning and first-touch allocations
REPS = 5  # repetitions; the median is reported
ITERS = 10  # back-to-back calls per repetition (launch gaps overlap with the previous call)
LATENCY_WARMUP = 5  # latency mode: more warm-up calls, as its single calls are short and clocks ramp
PASSES = ("fwd", "bwd", "fwd+bwd")
PASS_FLOP_MULT = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}



def err_str(e: BaseException, limit: int = 400) -> str:
  """One line: ``Type: message``, whitespace collapsed, cut at ``limit`` characters."""
  return f"{type(e).__name__}: {' '.join(str(e).split())}"[:limit]

def attention_flops(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int,
                    causal: bool) -> float:
  """Forward FLOPs: ``4·B·N·T·S·H``, halved when causal. ``heads`` counts query heads (GQA: N)."""
  for name, v in (("batch", batch), ("heads", heads), ("seq_q", seq_q), ("seq_k", seq_k),
                  ("head_dim", head_dim)):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
      raise ValueError(f"{name} must be a positive int, got {v!r}")
  f = 4.0 * batch * heads * seq_q * seq_k * head_dim
  return f / 2 if causal else f


def tflops(flops_fwd: float, pass_: str, seconds: float | None) -> float | None:
  """TFLOP/s of one pass that took ``seconds`` (None when there is no positive time)."""
  if pass_ not in PASS_FLOP_MULT:
    raise ValueError(f"pass_ must be one of {PASSES}, got {pass_!r}")
  if seconds is None or not seconds > 0:
    return None
  return PASS_FLOP_MULT[pass_] * flops_fwd / seconds / 1e12


def _block(x):
  import jax
  return jax.block_until_ready(x)


def _check_counts(iters, reps, warmup):
  for name, v, lo in (("iters", iters, 1), ("reps", reps, 1), ("warmup", warmup, 0)):
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
      raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")


def _stats(samples, *, iters, reps, warmup) -> dict:
  med = float(np.median(samples))
  return {"median_s": med, "min_s": float(min(samples)), "max_s": float(max(samples)),
          "spread": float((max(samples) - min(samples)) / med) if med > 0 else None,
          "samples_s": [float(x) for x in samples], "iters": iters, "reps": reps,
          "warmup": warmup}


def _one_rep(fn, args, iters, clock, block):
  """Seconds per call over ``iters`` back-to-back calls, one wait at the end: ``(seconds, output)``."""
  t0 = clock()
  out = None
  for _ in range(iters):
    out = fn(*args)
  block(out)
  return (clock() - t0) / iters, out


def time_calls(fn, args, *, iters: int = ITERS, reps: int = REPS, warmup: int = WARMUP,
               clock=time.perf_counter, block=_block):
  """Seconds per call of ``fn(*args)``: ``(stats, last output)``.

  ``stats``: ``median_s`` (the number), ``min_s``, ``max_s``, ``spread`` ((max − min) / median),
  ``samples_s`` (per-call time of each repetition), ``iters``, ``reps``, ``warmup``.
  """
  _check_counts(iters, reps, warmup)
  out = None
  for _ in range(warmup):
    out = block(fn(*args))
  samples = []
  for _ in range(reps):
    t, out = _one_rep(fn, args, iters, clock, block)
    samples.append(t)
  return _stats(samples, iters=iters, reps=reps, warmup=warmup), out


def time_interleaved(entries: dict, *, iters: int = ITERS, reps: int = REPS, warmup: int = WARMUP,
                     clock=time.perf_counter, block=_block, before=None) -> dict:
  """``time_calls`` for several functions at once, their repetitions interleaved.

  ``entries``: ``{key: (fn, args)}``. Each is warmed up in turn (``before(key)`` is called first: the
  caller's crash bookkeeping); then repetition ``r`` runs every entry's ``iters`` calls once, the
  entries' order rotated by ``r``. Returns ``{key: (stats, last output)}``, or ``{key: exception}``
  for an entry whose warm-up or repetition raised (the others go on without it).
  """
  _check_counts(iters, reps, warmup)
  result, live, outs = {}, [], {}
  for key, (fn, args) in entries.items():
    if before is not None:
      before(key)
    try:
      out = None
      for _ in range(warmup):
        out = block(fn(*args))
      outs[key] = out
      live.append(key)
    except Exception as e:  # noqa: BLE001 - one entry's failure is its result
      result[key] = e
  samples = {key: [] for key in live}
  for r in range(reps):
    shift = r % len(live) if live else 0
    for key in live[shift:] + live[:shift]:
      if key in result:
        continue
      fn, args = entries[key]
      try:
        t, outs[key] = _one_rep(fn, args, iters, clock, block)
        samples[key].append(t)
      except Exception as e:  # noqa: BLE001
        result[key] = e
  for key in live:
    if key not in result:
      result[key] = (_stats(samples[key], iters=iters, reps=reps, warmup=warmup), outs[key])
  return {key: result[key] for key in entries}


def time_latency(fn, arg_sets, *, calls: int = 100, warmup: int = LATENCY_WARMUP,
                 clock=time.perf_counter, block=_block) -> dict:
  """Wall-clock µs of single synchronised calls; inputs rotate over ``arg_sets``."""
  if not arg_sets:
    raise ValueError("arg_sets must hold at least one tuple of arguments")
  for i in range(warmup):
    block(fn(*arg_sets[i % len(arg_sets)]))
  us = np.empty(calls)
  for i in range(calls):
    a = arg_sets[i % len(arg_sets)]
    t0 = clock()
    block(fn(*a))
    us[i] = (clock() - t0) * 1e6
  return {"median_us": float(np.median(us)), "p10_us": float(np.percentile(us, 10)),
          "p90_us": float(np.percentile(us, 90)), "min_us": float(us.min()),
          "mean_us": float(us.mean()), "calls": calls}


def forward_fn(f):
  """``jit(f)`` for ``f(q, k, v) -> out``."""
  import jax
  return jax.jit(f)


def fwd_bwd_fn(f):
  """The anchors' forward+backward: ``(q, k, v, *aux) -> (dq, dk, dv)`` of the f32 sum of the output
  (``aux``: further arguments of ``f``, not differentiated)."""
  import jax
  import jax.numpy as jnp
  return jax.jit(jax.grad(lambda q, k, v, *aux: f(q, k, v, *aux).astype(jnp.float32).sum(),
                          argnums=(0, 1, 2)))


def measure_together(calls: dict, *, flops_fwd, passes=("fwd", "fwd+bwd"), iters: int = ITERS,
                     reps: int = REPS, warmup: int = WARMUP, clock=time.perf_counter, block=_block,
                     before=None) -> dict:
  """``measure`` for every call of ``calls = {name: (f, (q, k, v, *aux))}``, all their repetitions
  interleaved (``time_interleaved``): ``{name: measure's result}``. ``flops_fwd``: one number for
  all, or ``{name: number}``; ``before(name)`` is called before each name's first call."""
  entries, build_errors = {}, {}
  for name, (f, call_args) in calls.items():
    for p in passes:
      try:
        entries[(name, p)] = ({"fwd": forward_fn, "fwd+bwd": fwd_bwd_fn}[p](f), tuple(call_args))
      except Exception as e:  # noqa: BLE001 - a failed pass is a result
        build_errors[(name, p)] = e
  started = set()

  def first_call(key):
    if before is not None and key[0] not in started:
      started.add(key[0])
      before(key[0])

  timed = time_interleaved(entries, iters=iters, reps=reps, warmup=warmup, clock=clock, block=block,
                           before=first_call)
  timed.update(build_errors)
  results = {}
  for name in calls:
    fl = flops_fwd[name] if isinstance(flops_fwd, dict) else flops_fwd
    res = {"timing": {}, "ms": {}, "tflops": {}, "out": None}
    for p in passes:
      got = timed[(name, p)]
      if isinstance(got, Exception):
        res[f"{p}_error"] = err_str(got)
        continue
      st, out = got
      if p == "fwd":
        res["out"] = out
      res["timing"][p] = st
      res["ms"][p] = st["median_s"] * 1e3
      res["tflops"][p] = tflops(fl, p, st["median_s"])
    fwd, fb = res["ms"].get("fwd"), res["ms"].get("fwd+bwd")
    if fwd is not None and fb is not None and fb > fwd:
      res["ms"]["bwd"] = fb - fwd
      res["tflops"]["bwd"] = tflops(fl, "bwd", res["ms"]["bwd"] * 1e-3)
    results[name] = res
  return results


def measure(f, q, k, v, *, flops_fwd: float, passes=("fwd", "fwd+bwd"), iters: int = ITERS,
            reps: int = REPS, warmup: int = WARMUP, clock=time.perf_counter, block=_block,
            aux=()) -> dict:
  """Time ``f(q, k, v, *aux)`` forward and forward+backward (their repetitions interleaved); errors
  are recorded per pass, never raised. ``aux``: arrays passed to the jitted function after ``q, k, v``
  (not differentiated).

  Returns ``{"timing": {pass: stats}, "ms": {...}, "tflops": {...}, "<pass>_error": str, "out": the
  forward output}``; ``bwd`` is derived (forward+backward − forward) when both passes ran.
  """
  return measure_together({None: (f, (q, k, v, *aux))}, flops_fwd=flops_fwd, passes=passes,
                          iters=iters, reps=reps, warmup=warmup, clock=clock, block=block)[None]


def matmul_peak(n: int = 8192) -> dict:
  """Measured bf16 ``n³`` matmul rate: the ceiling the attention numbers are read against."""
  import jax
  import jax.numpy as jnp
  a, b = (jax.random.normal(k, (n, n), jnp.bfloat16) for k in jax.random.split(jax.random.key(7), 2))
  st, _ = time_calls(jax.jit(lambda x, y: x @ y), (a, b))
  return {"n": n, "dtype": "bfloat16", "median_s": st["median_s"],
          "tflops": 2.0 * n ** 3 / st["median_s"] / 1e12}


def copy_rate(nbytes: int = 2 ** 30) -> dict:
  """Measured device-to-device copy rate: ``jit(x + 1)`` over a bf16 array of ``nbytes`` (it reads
  and writes ``nbytes``), timed as every benchmark (``time_calls``); TB/s counts both. The ceiling
  the K/V read rates of benchmarks/decode.py are read against."""
  import jax
  import jax.numpy as jnp
  x = jax.random.normal(jax.random.key(11), (nbytes // 2,), jnp.bfloat16)
  st, _ = time_calls(jax.jit(lambda x: x + jnp.bfloat16(1)), (x,))
  return {"bytes": nbytes, "median_s": st["median_s"], "tbps": 2.0 * nbytes / st["median_s"] / 1e12,
          "what": f"jit(x + 1) on {nbytes / 2 ** 30:g} GiB of bf16: bytes read + written ÷ time"}


# --- device time ---------------------------------------------------------------------------------

DEVICE_PROCESS = "/device:GPU"  # a trace process whose name holds this is a GPU's (kernels, memsets)


def device_seconds(events) -> float | None:
  """Seconds of device work in a perfetto/chrome trace's event list: the summed durations (``dur``,
  µs) of the complete (``X``) events of every process whose name (its ``process_name`` metadata)
  holds :data:`DEVICE_PROCESS`; None where the trace has no such event (no GPU)."""
  names = {e.get("pid"): str((e.get("args") or {}).get("name", "")) for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  device = [e for e in events if e.get("ph") == "X" and DEVICE_PROCESS in names.get(e.get("pid"), "")]
  if not device:
    return None
  return sum(float(e.get("dur", 0.0)) for e in device) * 1e-6


def device_busy(entries: dict, *, calls: int = 20, block=_block) -> dict:
  """Device work per call of each entry (``{key: (fn, args)}``, already warmed up): ``{key:
  seconds or None}``. Each entry runs ``calls`` back-to-back calls in a ``jax.profiler`` trace of its
  own; the kernels' and memory operations' durations are summed and divided by ``calls``. Launch
  gaps and the host's dispatch are not in it: next to the back-to-back time per call it tells the
  device's share. None without a GPU or a trace."""
  import glob
  import gzip
  import json
  import tempfile

  import jax
  busy = {}
  for key, (fn, args) in entries.items():
    busy[key] = None
    with tempfile.TemporaryDirectory() as d:
      try:
        with jax.profiler.trace(d, create_perfetto_trace=True):
          out = None
          for _ in range(calls):
            out = fn(*args)
          block(out)
        files = glob.glob(f"{d}/**/perfetto_trace.json.gz", recursive=True)
        if not files:
          continue
        with gzip.open(files[0]) as f:
          trace = json.load(f)
        seconds = device_seconds(trace["traceEvents"] if isinstance(trace, dict) else trace)
      except Exception:  # noqa: BLE001 - no profiler or an unreadable trace: no device time
        continue
    busy[key] = None if seconds is None else seconds / calls
  return busy
