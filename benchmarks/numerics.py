"""Numerical error against a float64 reference: out, lse, dq, dk, dv for fp16 / bf16 / fp32, seq 512 ... 32k.

The question: does FlashAttention-2's *unscaled* accumulator (the output is divided by the softmax
denominator once at the end, not every step; paper §3.1.1) lose precision as the sequence grows? Beside
fa2_jax (its default backend, and the Triton kernels) the same error is measured for the
FlashAttention-1 style kernel that normalises every step and for the atomic-dQ backward (both from
benchmarks/ablation_kernels.py), and for the plain XLA formula in the same dtype
(``jax.nn.dot_product_attention(implementation="xla")``; its lse from the same f32-logits formula).

Inputs are standard normals rounded to bf16 (magnitudes below 2^-14 raised to it), so the *same* values are
exact in bf16, fp16 and fp32 and all dtypes are compared on identical inputs against one float64
reference. The reference (softmax, lse, and the analytic gradients with a random cotangent dO) is computed
in float64 on the CPU by default, in chunks of query rows so that seq 32k fits in memory.

    python -m benchmarks.numerics [--quick] [--seqs 512,...,32k] [--dtypes bf16,fp16,fp32]
    python -m benchmarks.numerics --smoke
"""
from __future__ import annotations

import argparse
import functools
import math
import time

import numpy as np

from . import ablation_kernels, cli
from .device import device_info, on_gpu
from .numerics_report import DTYPE_NAMES, IMPLS, LABELS, QUANTS, STEM, render, summary
from .recorder import Recorder, close_cell, finish_run
from .report import err_str, out_name

SEQS = [512, 1024, 2048, 4096, 8192, 16384, 32768]
QUICK_SEQS = [1024, 8192, 32768]
ABLATION = {"fa2_normstep": dict(normalize_each_step=True), "fa2_atomic_dq": dict(atomic_dq=True)}
QUICK_IMPLS = ["fa2", "fa2_normstep", "xla"]


def build_parser():
  p = argparse.ArgumentParser(prog="python -m benchmarks.numerics", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--seqs", type=cli.parse_ints, default=None)
  p.add_argument("--dtypes", type=cli.parse_strs, default=None, help="bf16,fp16,fp32")
  p.add_argument("--impls", type=cli.parse_strs, default=None, help=", ".join(IMPLS))
  p.add_argument("--causal", choices=["both", "true", "false"], default=None,
                 help="default: both (quick: false, the longest sums)")
  p.add_argument("--head-dim", type=cli.positive_int, default=64)
  p.add_argument("--heads", type=cli.positive_int, default=None,
                 help="default: 16384 // seq clamped to [1, 4] (batch is 1)")
  p.add_argument("--ref-device", choices=["cpu", "default"], default="cpu",
                 help="where the float64 reference runs (default cpu; 'default' = the accelerator)")
  p.add_argument("--ref-chunk", type=cli.positive_int, default=2 ** 25,
                 help="max query-rows x keys per reference chunk")
  cli.add_common_args(p)
  return p


def exact_inputs(seed: int, shape):
  """q, k, v, dO as float32 arrays whose values are exact in bf16 and fp16 (never zero)."""
  import jax.numpy as jnp
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(4):
    x = rng.standard_normal(shape, dtype=np.float32)
    x = x.astype(jnp.bfloat16).astype(np.float32)
    tiny = np.abs(x) < 2.0 ** -14  # under fp16's smallest normal: would lose bits there
    x[tiny] = np.where(x[tiny] < 0, -(2.0 ** -14), 2.0 ** -14)
    assert np.array_equal(x.astype(np.float16).astype(np.float32), x)
    out.append(x)
  return out


def _ref_chunk(q, k, v, do, row0, *, scale, causal):
  """float64 attention and its gradients for a chunk of query rows of one head (all keys)."""
  import jax.numpy as jnp
  s = (q @ k.T) * scale
  if causal:
    rows = row0 + jnp.arange(q.shape[0])[:, None]
    s = jnp.where(jnp.arange(k.shape[0])[None, :] <= rows, s, -jnp.inf)
  m = s.max(axis=-1, keepdims=True)
  p = jnp.exp(s - m)
  l = p.sum(axis=-1, keepdims=True)
  lse = (m + jnp.log(l))[:, 0]
  p = p / l
  o = p @ v
  delta = (do * o).sum(axis=-1)
  ds = p * (do @ v.T - delta[:, None])
  return o, lse, (ds @ k) * scale, (ds.T @ q) * scale, p.T @ do


@functools.lru_cache(maxsize=None)
def _ref_jit():
  import jax
  return jax.jit(_ref_chunk, static_argnames=("scale", "causal"))


def reference_f64(q, k, v, do, *, scale, causal, device, chunk_elems):
  """out [B,T,N,H], lse [B,T,N], dq, dk, dv in float64 (numpy), computed on ``device``."""
  import jax
  b, t, n, h = q.shape
  s = k.shape[1]
  res = {"out": np.empty((b, t, n, h)), "lse": np.empty((b, t, n)), "dq": np.empty((b, t, n, h)),
         "dk": np.empty((b, s, n, h)), "dv": np.empty((b, s, n, h))}
  c = max(1, min(t, chunk_elems // max(s, 1)))
  c = 1 << int(math.log2(c))  # a power of two: few distinct chunk shapes, few compiles
  fn = _ref_jit()
  with jax.enable_x64(True):
    put = lambda x: jax.device_put(np.ascontiguousarray(x, dtype=np.float64), device)  # noqa: E731
    for bi in range(b):
      for hi in range(n):
        kk, vv = put(k[bi, :, hi]), put(v[bi, :, hi])
        dk = dv = None
        for r0 in range(0, t, c):
          r1 = min(t, r0 + c)
          o, lse, dq, dkp, dvp = fn(put(q[bi, r0:r1, hi]), kk, vv, put(do[bi, r0:r1, hi]), r0,
                                    scale=scale, causal=causal)
          res["out"][bi, r0:r1, hi] = np.asarray(o)
          res["lse"][bi, r0:r1, hi] = np.asarray(lse)
          res["dq"][bi, r0:r1, hi] = np.asarray(dq)
          dk = dkp if dk is None else dk + dkp
          dv = dvp if dv is None else dv + dvp
        res["dk"][bi, :, hi] = np.asarray(dk)
        res["dv"][bi, :, hi] = np.asarray(dv)
  return res


def _xla_lse(q, k, scale, causal):
  import jax
  import jax.numpy as jnp
  logits = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32) * scale
  if causal:
    t, s = logits.shape[-2:]
    logits = jnp.where(jnp.arange(s)[None, :] <= jnp.arange(t)[:, None], logits, -jnp.inf)
  return jnp.swapaxes(jax.nn.logsumexp(logits, axis=-1), 1, 2)  # [B, T, N]


def _with_lse(impl, causal):
  """``f(q, k, v) -> (out, lse [B, T, N])`` of a kernel implementation."""
  import fa2_jax
  if impl in ABLATION:
    return functools.partial(ablation_kernels.attention, is_causal=causal, return_residual=True,
                             **ABLATION[impl])
  kw = {"implementation": "triton"} if impl == "fa2_triton" else {}
  return functools.partial(fa2_jax.flash_attention, is_causal=causal, return_residual=True,
                           interpret=None if on_gpu() else True, **kw)


def run_impl(impl, q, k, v, do, *, causal):
  """(out, lse, dq, dk, dv) of one implementation, as float64 numpy arrays."""
  import jax
  import jax.numpy as jnp
  if impl not in IMPLS:
    raise ValueError(f"unknown implementation {impl!r}; known: {', '.join(IMPLS)}")
  if impl == "xla":
    def g(q, k, v, do):
      o, pull = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=causal, implementation="xla"), q, k, v)
      return (o, _xla_lse(q, k, 1.0 / math.sqrt(q.shape[-1]), causal), *pull(do))
  else:
    f = _with_lse(impl, causal)

    def g(q, k, v, do):
      (o, lse), pull = jax.vjp(f, q, k, v)
      return (o, lse, *pull((do, jnp.zeros_like(lse))))
  res = jax.block_until_ready(jax.jit(g)(q, k, v, do))
  return [np.asarray(x.astype(jnp.float32), dtype=np.float64) for x in res]


def error_stats(x, ref):
  if x is None:
    return None
  bad = int(np.sum(~np.isfinite(x)))
  d = x - ref
  nr = float(np.linalg.norm(ref))
  return {"max_abs": None if bad else float(np.max(np.abs(d))),
          "rel_l2": None if bad else float(np.linalg.norm(d)) / (nr if nr > 0 else 1.0),
          "ref_max_abs": float(np.max(np.abs(ref))), "nonfinite": bad}


def _settings(args):
  if args.smoke:
    seqs = args.seqs or [64, 128]
    dts = args.dtypes or ["bf16", "fp32"]
    impls = args.impls or ["fa2", "fa2_normstep", "xla"]
    causal = args.causal or "false"
    args.head_dim = min(args.head_dim, 32)
  elif args.quick:
    seqs, dts = args.seqs or QUICK_SEQS, args.dtypes or DTYPE_NAMES
    impls, causal = args.impls or QUICK_IMPLS, args.causal or "false"
  else:
    seqs, dts = args.seqs or SEQS, args.dtypes or DTYPE_NAMES
    causal = args.causal or "both"
    impls = args.impls or IMPLS
  bad = [i for i in impls if i not in IMPLS] + [d for d in dts if d not in DTYPE_NAMES]
  if bad:
    raise SystemExit(f"unknown --impls/--dtypes {bad}; known: {IMPLS}, {DTYPE_NAMES}")
  causals = {"both": [False, True], "true": [True], "false": [False]}[causal]
  return sorted(seqs), dts, impls, causals


def cell_key(c):
  return (c.get("causal"), c.get("dtype"), c.get("seq"), c.get("impl"))


def heads_for(args, seq):
  if args.heads:
    return args.heads
  if args.smoke:
    return 1
  return int(min(4, max(1, 16384 // seq)))


def run(args) -> dict:
  import jax
  info = device_info()
  cli.cpu_fallback(args, info, STEM)
  out_dir = cli.resolve_out(args, info)
  seqs, dts, impls, causals = _settings(args)
  ref_dev = jax.devices("cpu")[0] if args.ref_device == "cpu" else jax.devices()[0]
  rec = Recorder(out_dir / out_name(STEM, args.tag, "json"), info, dict(
      seqs=seqs, dtypes=dts, impls=impls, causal=causals, head_dim=args.head_dim, batch=1,
      heads={s: heads_for(args, s) for s in seqs}, ref_device=str(ref_dev),
      inputs="standard normal rounded to bf16 (|x| >= 2^-14): identical values in every dtype",
      reference="float64, chunked over query rows; gradients analytic with a random dO"), STEM,
      key=cell_key,
      resume=args.resume)
  rec.data.setdefault("references", [])
  crashed = {c.get("impl") for c in rec.crashed}
  budget = cli.make_budget(args)
  refs, inputs = {}, {}
  dts = sorted(dts, key=["bf16", "fp32", "fp16"].index)  # fp32 shows accumulation error best
  todo = [(cz, dt, s, i) for cz in causals for dt in dts for s in seqs for i in impls]
  bar = cli.progress(len(todo), "numerics")
  for cz, dt, s, impl in todo:
    bar.set_postfix_str(f"{impl} {dt} T={s} causal={cz}")
    n = heads_for(args, s)
    base = dict(impl=impl, label=LABELS.get(impl, impl), dtype=dt, seq=s, causal=cz, batch=1,
                heads=n, head_dim=args.head_dim)
    if rec.key(base) in rec.done:
      bar.update(1)
      continue
    if impl in crashed:
      rec.add(dict(base, status="skipped",
                   error="skipped: this implementation crashed the process earlier"))
      bar.update(1)
      continue
    key = (s, cz)
    if key not in refs:
      if not budget.fits("ref", default=0.0):
        refs[key] = "skipped: time budget"
      else:
        t0 = time.time()
        try:
          shape = (1, s, n, args.head_dim)
          inputs[s] = inputs.get(s) or exact_inputs(args.seed * 7919 + s, shape)
          refs[key] = reference_f64(*inputs[s], scale=1.0 / math.sqrt(args.head_dim), causal=cz,
                                    device=ref_dev, chunk_elems=args.ref_chunk)
          rec.data["references"].append(dict(seq=s, causal=cz, seconds=time.time() - t0,
                                             device=str(ref_dev)))
        except Exception as e:  # noqa: BLE001
          refs[key] = "reference failed: " + err_str(e)
        budget.record("ref", time.time() - t0)
    ref = refs[key]
    if isinstance(ref, str):
      rec.add(dict(base, status="skipped" if "budget" in ref else "error", error=ref))
      bar.update(1)
      continue
    if not budget.fits(impl + dt):
      rec.add(dict(base, status="skipped", error="skipped: time budget"))
      bar.update(1)
      continue
    rec.begin(base)
    t0 = time.time()
    cell = dict(base, status="ok")
    try:
      dtype = cli.jnp_dtype(dt)
      q, k, v, do = (jax.numpy.asarray(x, dtype=dtype) for x in inputs[s])
      got = run_impl(impl, q, k, v, do, causal=cz)
      cell["errors"] = {name: error_stats(x, ref[name]) for name, x in zip(QUANTS, got)}
      if any((e or {}).get("nonfinite") for e in cell["errors"].values()):
        cell["status"] = "nonfinite"
    except Exception as e:  # noqa: BLE001
      cell.update(status="error", error=err_str(e))
    close_cell(rec, budget, impl + dt, cell, t0, bar)
  return finish_run(rec, bar, render, summary, out_dir, args.tag)


def main(argv=None):
  return cli.script_main(argv, build_parser(), run, render, summary, STEM, cell_key)


if __name__ == "__main__":
  main()
