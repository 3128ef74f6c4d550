"""The one timing method of every benchmark, the project's anchor measurements':

* throughput: ``jax.jit``, ``warmup`` (2) calls, then the median over ``reps`` (5) repetitions of
  ``iters`` (10) back-to-back calls, ``block_until_ready`` once at the end of each repetition;
* forward: ``jit(f)``; forward+backward: ``jit(grad(lambda q, k, v: f(q, k, v).astype(f32).sum(),
  argnums=(0, 1, 2)))`` (the forward runs inside, as in training); backward time = forward+backward
  time − forward time; ``aux`` arrays (segment ids, lengths) are further arguments of the jitted
  function, never differentiated, so they are runtime data as in training, not compile-time constants;
* latency: every call synchronised on its own, median over many calls, inputs rotated over a few sets.

Inputs are fresh random normals, never zeros. ``clock`` and ``block`` are parameters so that the
statistics can be tested with a fake clock.
"""
from __future__ import annotations

import time

import numpy as np

from .flops import tflops

WARMUP = 2  # calls before timing: compilation, autotuning and first-touch allocations
REPS = 5  # repetitions; the median is reported
ITERS = 10  # back-to-back calls per repetition (launch gaps overlap with the previous call)
LATENCY_WARMUP = 5


def _block(x):
  import jax
  return jax.block_until_ready(x)


def time_calls(fn, args, *, iters: int = ITERS, reps: int = REPS, warmup: int = WARMUP,
               clock=time.perf_counter, block=_block):
  """Seconds per call of ``fn(*args)``: ``(stats, last output)``.

  ``stats``: ``median_s`` (the number), ``min_s``, ``max_s``, ``spread`` ((max − min) / median),
  ``samples_s`` (per-call time of each repetition), ``iters``, ``reps``, ``warmup``.
  """
  for name, v, lo in (("iters", iters, 1), ("reps", reps, 1), ("warmup", warmup, 0)):
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
      raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
  out = None
  for _ in range(warmup):
    out = block(fn(*args))
  samples = []
  for _ in range(reps):
    t0 = clock()
    for _ in range(iters):
      out = fn(*args)
    block(out)
    samples.append((clock() - t0) / iters)
  med = float(np.median(samples))
  return {"median_s": med, "min_s": float(min(samples)), "max_s": float(max(samples)),
          "spread": float((max(samples) - min(samples)) / med) if med > 0 else None,
          "samples_s": [float(x) for x in samples], "iters": iters, "reps": reps,
          "warmup": warmup}, out


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


def measure(f, q, k, v, *, flops_fwd: float, passes=("fwd", "fwd+bwd"), iters: int = ITERS,
            reps: int = REPS, warmup: int = WARMUP, clock=time.perf_counter, block=_block,
            aux=()) -> dict:
  """Time ``f(q, k, v, *aux)`` forward and forward+backward; errors are recorded per pass, never raised.
  ``aux``: arrays passed to the jitted function after ``q, k, v`` (not differentiated).

  Returns ``{"timing": {pass: stats}, "ms": {...}, "tflops": {...}, "<pass>_error": str, "out": the
  forward output}``; ``bwd`` is derived (forward+backward − forward) when both passes ran.
  """
  res = {"timing": {}, "ms": {}, "tflops": {}, "out": None}
  call_args = (q, k, v, *aux)
  fns = {"fwd": lambda: (forward_fn(f), call_args), "fwd+bwd": lambda: (fwd_bwd_fn(f), call_args)}
  for p in passes:
    try:
      fn, args = fns[p]()
      st, out = time_calls(fn, args, iters=iters, reps=reps, warmup=warmup, clock=clock,
                           block=block)
    except Exception as e:  # noqa: BLE001 - a failed pass is a result
      res[f"{p}_error"] = f"{type(e).__name__}: {' '.join(str(e).split())}"[:400]
      continue
    if p == "fwd":
      res["out"] = out
    res["timing"][p] = st
    res["ms"][p] = st["median_s"] * 1e3
    res["tflops"][p] = tflops(flops_fwd, p, st["median_s"])
  fwd, fb = res["ms"].get("fwd"), res["ms"].get("fwd+bwd")
  if fwd is not None and fb is not None and fb > fwd:
    res["ms"]["bwd"] = fb - fwd
    res["tflops"]["bwd"] = tflops(flops_fwd, "bwd", res["ms"]["bwd"] * 1e-3)
  return res


def matmul_peak(n: int = 8192) -> dict:
  """Measured bf16 ``n³`` matmul rate: the ceiling the attention numbers are read against."""
  import jax
  import jax.numpy as jnp
  a, b = (jax.random.normal(k, (n, n), jnp.bfloat16) for k in jax.random.split(jax.random.key(7), 2))
  st, _ = time_calls(jax.jit(lambda x, y: x @ y), (a, b))
  return {"n": n, "dtype": "bfloat16", "median_s": st["median_s"],
          "tflops": 2.0 * n ** 3 / st["median_s"] / 1e12}
