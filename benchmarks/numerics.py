"""Numerical error against a float64 reference: out, lse, dq, dk, dv for fp16 / bf16 / fp32, seq 512 ... 32k.

The question: does FlashAttention-2's *unscaled* accumulator (the output is divided by the softmax
denominator once at the end, not every step; paper §3.1.1) lose precision as the sequence grows? Beside
fa2_jax (Triton) the same error is measured for the FlashAttention-1 style kernel that normalises every
step (``normalize_each_step=True``) and for the plain XLA formula in the same dtype
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
import inspect
import math
import time
from pathlib import Path

import numpy as np

from . import common as C

SEQS = [512, 1024, 2048, 4096, 8192, 16384, 32768]
QUICK_SEQS = [1024, 8192, 32768]
DTYPE_NAMES = ["bf16", "fp16", "fp32"]
IMPLS = ["fa2_triton", "fa2_triton_det", "fa2_triton_atomic", "fa2_normstep", "fa2_mosaic", "xla"]
QUICK_IMPLS = ["fa2_triton", "fa2_normstep", "xla"]
QUANTS = ("out", "lse", "dq", "dk", "dv")
LABELS = dict(C.IMPL_LABELS, fa2_normstep="fa2_jax triton, normalise every step (FA1-style)",
              xla="XLA formula, same dtype")
STEM = "numerics"


def build_parser():
  p = argparse.ArgumentParser(prog="python -m benchmarks.numerics", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--seqs", type=C.parse_ints, default=None)
  p.add_argument("--dtypes", type=C.parse_strs, default=None, help="bf16,fp16,fp32")
  p.add_argument("--impls", type=C.parse_strs, default=None, help=", ".join(IMPLS))
  p.add_argument("--causal", choices=["both", "true", "false"], default=None,
                 help="default: both (quick: false, the longest sums)")
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--heads", type=int, default=None,
                 help="default: 16384 // seq clamped to [1, 4] (batch is 1)")
  p.add_argument("--ref-device", choices=["cpu", "default"], default="cpu",
                 help="where the float64 reference runs (default cpu; 'default' = the accelerator)")
  p.add_argument("--ref-chunk", type=int, default=2 ** 25,
                 help="max query-rows x keys per reference chunk")
  C.add_common_args(p)
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


def run_impl(impl, q, k, v, do, *, causal, interpret):
  """(out, lse or None, dq, dk, dv) of one implementation, as float64 numpy arrays."""
  import jax
  import jax.numpy as jnp
  fa2 = C.ensure_fa2()
  scale = 1.0 / math.sqrt(q.shape[-1])
  if impl in ("fa2_triton", "fa2_triton_det", "fa2_mosaic"):
    kind = "mosaic" if impl == "fa2_mosaic" else "triton"

    def f(q, k, v):
      return fa2.flash_attention(q, k, v, is_causal=causal, implementation=kind,
                                 return_residual=True, deterministic=impl == "fa2_triton_det",
                                 interpret=interpret)

    def g(q, k, v, do):
      (o, lse), pull = jax.vjp(f, q, k, v)
      return (o, lse, *pull((do, jnp.zeros_like(lse))))
  elif impl in ("fa2_normstep", "fa2_triton_atomic"):
    abl, kw = (C.fa2_ablation(normalize_each_step=True) if impl == "fa2_normstep"
               else C.fa2_ablation(atomic_dq=True))
    with_lse = "return_residual" in inspect.signature(abl).parameters

    def f(q, k, v):
      return abl(q, k, v, is_causal=causal, interpret=interpret, **kw,
                 **({"return_residual": True} if with_lse else {}))

    def g(q, k, v, do):
      if with_lse:
        (o, lse), pull = jax.vjp(f, q, k, v)
        return (o, lse, *pull((do, jnp.zeros_like(lse))))
      o, pull = jax.vjp(f, q, k, v)
      return (o, None, *pull(do))
  elif impl == "xla":
    def f(q, k, v):
      return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")

    def g(q, k, v, do):
      o, pull = jax.vjp(f, q, k, v)
      return (o, _xla_lse(q, k, scale, causal), *pull(do))
  else:
    raise ValueError(f"unknown implementation {impl!r}; known: {', '.join(IMPLS)}")
  res = jax.block_until_ready(jax.jit(g)(q, k, v, do))
  return [None if x is None else np.asarray(x.astype(jnp.float32), dtype=np.float64) for x in res]


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
    impls = args.impls or ["fa2_triton", "fa2_normstep", "xla"]
    causal = args.causal or "false"
    args.head_dim = min(args.head_dim, 32)
  elif args.quick:
    seqs, dts = args.seqs or QUICK_SEQS, args.dtypes or DTYPE_NAMES
    impls, causal = args.impls or QUICK_IMPLS, args.causal or "false"
  else:
    seqs, dts = args.seqs or SEQS, args.dtypes or DTYPE_NAMES
    causal = args.causal or "both"
    # The other dQ scheme than the default (the default is one of the two already).
    other = "fa2_triton_atomic" if C.fa2_default_deterministic() else "fa2_triton_det"
    impls = args.impls or [i for i in IMPLS if i in (other, "fa2_triton", "fa2_normstep",
                                                     "fa2_mosaic", "xla")]
  bad = [i for i in impls if i not in IMPLS] + [d for d in dts if d not in DTYPE_NAMES]
  if bad:
    raise SystemExit(f"unknown --impls/--dtypes {bad}; known: {IMPLS}, {DTYPE_NAMES}")
  causals = {"both": [False, True], "true": [True], "false": [False]}[causal]
  return sorted(seqs), dts, impls, causals


def heads_for(args, seq):
  if args.heads:
    return args.heads
  if args.smoke:
    return 1
  return int(min(4, max(1, 16384 // seq)))


def run(args) -> dict:
  import jax
  C.ensure_fa2()
  info = C.device_info()
  out_dir = C.resolve_out(args, info)
  seqs, dts, impls, causals = _settings(args)
  interpret = C.default_interpret()
  ref_dev = jax.devices("cpu")[0] if args.ref_device == "cpu" else jax.devices()[0]
  rec = C.Recorder(out_dir / C.out_name(STEM, args.tag, "json"), info, dict(
      seqs=seqs, dtypes=dts, impls=impls, causal=causals, head_dim=args.head_dim, batch=1,
      heads={s: heads_for(args, s) for s in seqs}, ref_device=str(ref_dev), interpret=interpret,
      inputs="standard normal rounded to bf16 (|x| >= 2^-14): identical values in every dtype",
      reference="float64, chunked over query rows; gradients analytic with a random dO"), STEM,
      key=lambda c: (c.get("causal"), c.get("dtype"), c.get("seq"), c.get("impl")),
      resume=args.resume)
  rec.data.setdefault("references", [])
  crashed = {c.get("impl") for c in rec.crashed}
  budget = C.make_budget(args)
  refs, inputs = {}, {}
  dts = sorted(dts, key=["bf16", "fp32", "fp16"].index)  # fp32 shows accumulation error best
  todo = [(cz, dt, s, i) for cz in causals for dt in dts for s in seqs for i in impls]
  bar = C.progress(len(todo), "numerics")
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
          refs[key] = "reference failed: " + C.err_str(e)
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
      dtype = C.jnp_dtype(dt)
      q, k, v, do = (jax.numpy.asarray(x, dtype=dtype) for x in inputs[s])
      got = run_impl(impl, q, k, v, do, causal=cz, interpret=interpret)
      cell["errors"] = {name: error_stats(x, ref[name]) for name, x in zip(QUANTS, got)}
      if any((e or {}).get("nonfinite") for e in cell["errors"].values()):
        cell["status"] = "nonfinite"
    except Exception as e:  # noqa: BLE001
      cell.update(status="error", error=C.err_str(e))
    C.close_cell(rec, budget, impl + dt, cell, t0, bar)
  return C.finish_run(rec, bar, render, summary, out_dir, args.tag)


# --- rendering ----------------------------------------------------------------------------------------

def _err(c, q, kind="rel_l2"):
  return ((c.get("errors") or {}).get(q) or {}).get(kind)


def _impls(cells):
  out = []
  for i in IMPLS + [c["impl"] for c in cells]:
    if i not in out and any(c["impl"] == i and c.get("errors") for c in cells):
      out.append(i)
  return out


def _find(cells, **kw):
  for c in cells:
    if all(c.get(k) == v for k, v in kw.items()):
      return c
  return None


def answer(cells) -> list[str]:
  """The md paragraph on the question, from the numbers."""
  lines = []
  for cz in sorted({c["causal"] for c in cells}):
    for dt in DTYPE_NAMES:
      sub = [c for c in cells if c["causal"] == cz and c["dtype"] == dt and c.get("errors")]
      ours = sorted((c["seq"], _err(c, "out")) for c in sub
                    if c["impl"] == "fa2_triton" and C.finite(_err(c, "out")))
      if len(ours) < 2:
        continue
      (s0, e0), (s1, e1) = ours[0], ours[-1]
      xla = {c["seq"]: _err(c, "out") for c in sub if c["impl"] == "xla"}
      nrm = {c["seq"]: _err(c, "out") for c in sub if c["impl"] == "fa2_normstep"}
      lse = {c["seq"]: _err(c, "lse") for c in sub if c["impl"] == "fa2_triton"}
      txt = (f"- {dt}, {'causal' if cz else 'non-causal'}: fa2_jax out rel-L2 {e0:.2e} at "
             f"{C.seq_label(s0)} → {e1:.2e} at {C.seq_label(s1)} (×{e1 / e0:.2f})")
      verdict_ok = True
      if C.finite(xla.get(s0)) and C.finite(xla.get(s1)):
        g_x = xla[s1] / xla[s0]
        txt += (f"; the {dt} XLA formula {xla[s0]:.2e} → {xla[s1]:.2e} (×{g_x:.2f}); "
                f"fa2/XLA at {C.seq_label(s1)}: {e1 / xla[s1]:.2f}")
        verdict_ok &= e1 <= 1.5 * xla[s1] and e1 / e0 <= max(2.0, 1.5 * g_x)
      if C.finite(nrm.get(s1)):
        txt += f"; per-step normalisation at {C.seq_label(s1)}: {nrm[s1]:.2e} (ratio {e1 / nrm[s1]:.2f})"
        verdict_ok &= e1 <= 1.5 * nrm[s1]
      if C.finite(lse.get(s0)) and C.finite(lse.get(s1)):
        txt += f"; lse rel-L2 {lse[s0]:.1e} → {lse[s1]:.1e}"
      txt += (". **No loss** from the unscaled accumulator at this length." if verdict_ok else
              ". **Possible loss**: the error grows faster than the same-precision formula's "
              "(or than per-step normalisation) — look closer.")
      lines.append(txt)
  if not lines:
    lines.append("- not enough measurements (needs fa2_triton at two or more lengths).")
  return lines


def render(data, out_dir: Path, tag=None):
  cells = [c for c in data.get("cells", []) if "impl" in c]
  cfg = data.get("config", {})
  out_dir = Path(out_dir)
  lines = ["# Numerical error vs a float64 reference", ""]
  lines += C.meta_lines(data.get("meta", {}))
  lines += [f"- batch 1, heads per length {cfg.get('heads')}, head_dim {cfg.get('head_dim')}, "
            f"scale 1/√head_dim; inputs: {cfg.get('inputs')}",
            f"- reference: {cfg.get('reference')}, on {cfg.get('ref_device')}",
            "- fp32 note: the kernels use full-f32 dots; XLA's default f32 matmul on a GPU may use "
            "TF32, which shows in its fp32 row.",
            "", "## Does the unscaled accumulator lose precision at long sequence?", ""]
  lines += answer(cells)
  lines += ["", "Cells: relative L2 error ‖x − ref‖/‖ref‖ (max abs error in brackets).", ""]
  impls = _impls(cells)
  for cz in sorted({c["causal"] for c in cells}):
    for q in QUANTS:
      sub = [c for c in cells if c["causal"] == cz]
      seqs = sorted({c["seq"] for c in sub})
      rows = []
      for dt in DTYPE_NAMES:
        for i in impls:
          row, any_val = [dt, LABELS.get(i, i)], False
          for s in seqs:
            c = _find(sub, impl=i, dtype=dt, seq=s)
            r, m = (_err(c, q), _err(c, q, "max_abs")) if c else (None, None)
            if c and c.get("status") == "skipped":
              row.append("skip")
            elif C.finite(r):
              any_val = True
              row.append(f"{r:.1e} ({m:.1e})")
            elif c and (c.get("errors") or {}).get(q, {}) and c["errors"][q].get("nonfinite"):
              any_val = True
              row.append(f"NaN/inf ×{c['errors'][q]['nonfinite']}")
            else:
              row.append("–")
          if any_val:
            rows.append(row)
      if rows:
        lines += [f"## {q}, {'causal' if cz else 'non-causal'}", ""]
        lines.append(C.md_table(["dtype", "impl"] + [C.seq_label(s) for s in seqs], rows))
        lines.append("")
  refs = data.get("references") or []
  if refs:
    lines.append("Reference time: " + ", ".join(
        f"{C.seq_label(r['seq'])}{'c' if r['causal'] else ''} {r['seconds']:.1f} s" for r in refs))
  errs = {}
  for c in cells:
    if c.get("error") and c.get("status") != "skipped":
      errs.setdefault((c["impl"], c["error"]), []).append(f"{c['dtype']}/{C.seq_label(c['seq'])}")
  if errs:
    lines += ["", "## Failures", ""]
    lines += [f"- {i} ({', '.join(w[:6])}{'…' if len(w) > 6 else ''}): `{e[:300]}`"
              for (i, e), w in errs.items()]
  md = out_dir / C.out_name(STEM, tag, "md")
  md.write_text("\n".join(lines) + "\n")
  return [md] + plot(cells, out_dir, tag)


def plot(cells, out_dir, tag=None):
  plt = C.get_pyplot()
  if plt is None or not cells:
    return []
  causals = sorted({c["causal"] for c in cells})
  fig, axes = plt.subplots(len(causals), len(QUANTS), figsize=(4 * len(QUANTS), 3.6 * len(causals)),
                           squeeze=False)
  colors = {"bf16": "tab:blue", "fp16": "tab:orange", "fp32": "tab:green"}
  styles = {"fa2_triton": "-o", "fa2_triton_det": "-s", "fa2_triton_atomic": "-s",
            "fa2_normstep": "--^", "fa2_mosaic": "-d", "xla": ":x"}
  for r, cz in enumerate(causals):
    for col, q in enumerate(QUANTS):
      ax = axes[r][col]
      for dt in DTYPE_NAMES:
        for i in _impls(cells):
          pts = sorted((c["seq"], _err(c, q)) for c in cells if c["causal"] == cz
                       and c["dtype"] == dt and c["impl"] == i and C.finite(_err(c, q)))
          if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], styles.get(i, "-"),
                    color=colors.get(dt), ms=4, lw=1, label=f"{dt} {i}")
      C.seq_log_axis(ax)
      ax.set_yscale("log")
      ax.set_title(f"{q}, {'causal' if cz else 'non-causal'}", fontsize=9)
      if col == 0:
        ax.set_ylabel("relative L2 error")
      ax.grid(alpha=0.3, which="both")
  C.shared_legend(fig, axes, ncol=6, fontsize=7)
  fig.suptitle("Error vs float64 reference")
  fig.tight_layout(rect=(0, 0.1, 1, 0.96))
  return [C.save_png(plt, fig, Path(out_dir) / C.out_name(STEM, tag, "png"), dpi=100)]


def summary(data) -> str:
  cells = [c for c in data.get("cells", []) if "impl" in c]
  lines = ["numerics: out rel-L2 (dq rel-L2) per seq"]
  for cz in sorted({c["causal"] for c in cells}):
    for dt in DTYPE_NAMES:
      for i in _impls(cells):
        sub = sorted((c for c in cells if c["causal"] == cz and c["dtype"] == dt
                      and c["impl"] == i), key=lambda c: c["seq"])
        if not any(c.get("errors") for c in sub):
          continue
        vals = " ".join(f"{C.seq_label(c['seq'])}:{C.fmt_num(_err(c, 'out'), '.1e')}"
                        f"({C.fmt_num(_err(c, 'dq'), '.0e')})" for c in sub)
        lines.append(f"  {'c ' if cz else 'nc'} {dt} {i:<14} {vals}")
  lines += [x[:300] for x in answer(cells)]
  return "\n".join(lines)


def main(argv=None):
  return C.script_main(argv, build_parser(), run, render, summary, STEM)


if __name__ == "__main__":
  main()
