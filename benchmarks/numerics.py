"""Numerical error against a float64 reference: out, lse, dq, dk, dv for fp16 / bf16 / fp32, seq 512 ... 32k.

The question: does FlashAttention-2's *unscaled* accumulator (the output is divided by the softmax
denominator once at the end, not every step; paper §3.1.1) lose precision as the sequence grows? Beside
fa2_jax (its default backend, and the Triton kernels) the same error is measured for the plain XLA
formula in the same dtype (``jax.nn.dot_product_attention(implementation="xla")``; its lse from the same
f32-logits formula): fa2_jax's error should grow no faster than the formula's.

Inputs are standard normals rounded to bf16 (magnitudes below 2^-14 raised to it), so the *same* values
are exact in bf16, fp16 and fp32 and all dtypes are compared on identical inputs against one float64
reference. The reference (softmax, lse, and the analytic gradients with a random cotangent dO) is
computed in float64 on the CPU by default, in chunks of query rows so that seq 32k fits in memory.

    python -m benchmarks.numerics [--quick] [--seqs 512,...,32k] [--dtypes bf16,fp16,fp32]
    python -m benchmarks.numerics --smoke
"""
from __future__ import annotations

import functools
import math
import time

import numpy as np

from . import harness as h

STEM = "numerics"
SEQS = [512, 1024, 2048, 4096, 8192, 16384, 32768]
QUICK_SEQS = [1024, 8192, 32768]
DTYPES = ["bf16", "fp16", "fp32"]
IMPLS = ["fa2", "fa2_triton", "xla"]
QUANTS = ("out", "lse", "dq", "dk", "dv")
MARKERS = {"bf16": "o", "fp16": "s", "fp32": "^"}  # the plot: colour per implementation, marker per dtype


def build_parser():
  p = h.script_parser("numerics", __doc__)
  p.add_argument("--seqs", type=h.parse_ints, default=None)
  p.add_argument("--dtypes", type=h.parse_strs, default=None, help="bf16,fp16,fp32")
  p.add_argument("--impls", type=h.parse_strs, default=None, help=", ".join(IMPLS))
  p.add_argument("--causal", choices=["both", "true", "false"], default=None,
                 help="default: both (quick, smoke: false, the longest sums)")
  p.add_argument("--head-dim", type=h.positive_int, default=64)
  p.add_argument("--heads", type=h.positive_int, default=None,
                 help="default: 16384 // seq clamped to [1, 4] (batch is 1)")
  p.add_argument("--ref-device", choices=["cpu", "default"], default="cpu",
                 help="where the float64 reference runs (default cpu; 'default' = the accelerator)")
  p.add_argument("--ref-chunk", type=h.positive_int, default=2 ** 25,
                 help="max query-rows x keys per reference chunk")
  h.add_common_args(p)
  return p


def exact_inputs(seed: int, shape):
  """q, k, v, dO as float32 arrays whose values are exact in bf16 and fp16 (never zero)."""
  import jax.numpy as jnp
  rng, out = np.random.default_rng(seed), []
  for _ in range(4):
    x = rng.standard_normal(shape, dtype=np.float32).astype(jnp.bfloat16).astype(np.float32)
    tiny = np.abs(x) < 2.0 ** -14  # under fp16's smallest normal: would lose bits there
    x[tiny] = np.where(x[tiny] < 0, -(2.0 ** -14), 2.0 ** -14)
    out.append(x)
  return out


def _ref_chunk(q, k, v, do, row0, *, scale, causal):
  """float64 attention and its gradients for a chunk of query rows of one head (all keys)."""
  import jax.numpy as jnp
  s = (q @ k.T) * scale
  if causal:
    s = jnp.where(jnp.arange(k.shape[0])[None, :] <= row0 + jnp.arange(q.shape[0])[:, None], s, -jnp.inf)
  m = s.max(axis=-1, keepdims=True)
  p = jnp.exp(s - m)
  l = p.sum(axis=-1, keepdims=True)
  p = p / l
  o = p @ v
  ds = p * (do @ v.T - (do * o).sum(axis=-1)[:, None])
  return o, (m + jnp.log(l))[:, 0], (ds @ k) * scale, (ds.T @ q) * scale, p.T @ do


@functools.lru_cache(maxsize=None)
def _ref_jit():
  import jax
  return jax.jit(_ref_chunk, static_argnames=("scale", "causal"))


def reference_f64(q, k, v, do, *, scale, causal, device, chunk_elems):
  """out [B,T,N,H], lse [B,T,N], dq, dk, dv in float64 (numpy), computed on ``device``."""
  import jax
  b, t, n, hd = q.shape
  s = k.shape[1]
  res = {"out": np.empty((b, t, n, hd)), "lse": np.empty((b, t, n)), "dq": np.empty((b, t, n, hd)),
         "dk": np.empty((b, s, n, hd)), "dv": np.empty((b, s, n, hd))}
  c = 1 << int(math.log2(max(1, min(t, chunk_elems // max(s, 1)))))  # few chunk shapes, few compiles
  with jax.enable_x64(True):
    put = lambda x: jax.device_put(np.ascontiguousarray(x, dtype=np.float64), device)  # noqa: E731
    for bi in range(b):
      for hi in range(n):
        kk, vv, dk, dv = put(k[bi, :, hi]), put(v[bi, :, hi]), 0.0, 0.0
        for r0 in range(0, t, c):
          r1 = min(t, r0 + c)
          o, lse, dq, dkp, dvp = _ref_jit()(put(q[bi, r0:r1, hi]), kk, vv, put(do[bi, r0:r1, hi]), r0,
                                            scale=scale, causal=causal)
          for name, x in (("out", o), ("lse", lse), ("dq", dq)):
            res[name][bi, r0:r1, hi] = np.asarray(x)
          dk, dv = dk + np.asarray(dkp), dv + np.asarray(dvp)
        res["dk"][bi, :, hi], res["dv"][bi, :, hi] = dk, dv
  return res


def run_impl(impl, q, k, v, do, *, causal):
  """(out, lse, dq, dk, dv) of one implementation, as float64 numpy arrays."""
  import jax
  import jax.numpy as jnp
  import fa2_jax
  if impl == "xla":
    def f(q, k, v):
      logits = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32)
      logits = logits / math.sqrt(q.shape[-1])
      if causal:
        logits = jnp.where(jnp.tril(jnp.ones(logits.shape[-2:], bool)), logits, -jnp.inf)
      return (jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla"),
              jnp.swapaxes(jax.nn.logsumexp(logits, axis=-1), 1, 2))
  else:
    f = functools.partial(fa2_jax.flash_attention, is_causal=causal, return_residual=True,
                          interpret=None if jax.default_backend() in h.GPU_BACKENDS else True,
                          implementation="triton" if impl == "fa2_triton" else None)

  def g(q, k, v, do):
    (o, lse), pull = jax.vjp(f, q, k, v)
    return (o, lse, *pull((do, jnp.zeros_like(lse))))
  return [np.asarray(x.astype(jnp.float32), dtype=np.float64)
          for x in jax.block_until_ready(jax.jit(g)(q, k, v, do))]


def error_stats(x, ref):
  bad, d, nr = int(np.sum(~np.isfinite(x))), x - ref, float(np.linalg.norm(ref))
  return {"max_abs": None if bad else float(np.max(np.abs(d))),
          "rel_l2": None if bad else float(np.linalg.norm(d)) / (nr if nr > 0 else 1.0),
          "ref_max_abs": float(np.max(np.abs(ref))), "nonfinite": bad}


def cell_key(c):
  return (c.get("causal"), c.get("dtype"), c.get("seq"), c.get("impl"))


def run(args) -> dict:
  import jax
  info = h.device_info()
  h.cpu_fallback(args, info, STEM)
  small = args.smoke or args.quick
  seqs = sorted(args.seqs or ([64, 128] if args.smoke else QUICK_SEQS if args.quick else SEQS))
  dts = args.dtypes or (["bf16", "fp32"] if args.smoke else DTYPES)
  impls = args.impls or (["fa2", "xla"] if small else IMPLS)
  bad = [i for i in impls if i not in IMPLS] + [d for d in dts if d not in DTYPES]
  if bad:
    raise SystemExit(f"unknown --impls/--dtypes {bad}; known: {IMPLS}, {DTYPES}")
  causals = h.masks(args.causal or ("false" if small else "both"))
  if args.smoke:
    args.head_dim = min(args.head_dim, 32)
  heads = {s: args.heads or (1 if args.smoke else int(min(4, max(1, 16384 // s)))) for s in seqs}
  ref_dev = jax.devices("cpu")[0] if args.ref_device == "cpu" else jax.devices()[0]
  todo = [(cz, dt, s, i) for cz in causals for dt in sorted(dts, key=DTYPES.index) for s in seqs
          for i in impls]
  run = h.Run(args, STEM, info, dict(
      seqs=seqs, dtypes=dts, impls=impls, causal=causals, head_dim=args.head_dim, batch=1, heads=heads,
      ref_device=str(ref_dev),
      inputs="standard normal rounded to bf16 (|x| >= 2^-14): identical values in every dtype",
      reference="float64, chunked over query rows; gradients analytic with a random dO"), cell_key,
      len(todo))
  run.rec.data.setdefault("references", [])
  refs, inputs = {}, {}
  for causal, dt, s, impl in todo:
    run.bar.set_postfix_str(f"{impl} {dt} T={s} causal={causal}")
    cell = dict(impl=impl, dtype=dt, seq=s, causal=causal, batch=1, heads=heads[s], head_dim=args.head_dim,
                status="ok")
    if run.skip(cell, impl + dt):
      continue
    if (s, causal) not in refs:
      t0 = time.time()
      try:
        inputs[s] = inputs.get(s) or exact_inputs(args.seed * 7919 + s, (1, s, heads[s], args.head_dim))
        refs[(s, causal)] = reference_f64(*inputs[s], scale=args.head_dim ** -0.5, causal=causal,
                                          device=ref_dev, chunk_elems=args.ref_chunk)
        run.rec.data["references"].append(dict(seq=s, causal=causal, seconds=time.time() - t0))
      except Exception as e:  # noqa: BLE001
        refs[(s, causal)] = "reference failed: " + h.err_str(e)
    if isinstance(refs[(s, causal)], str):
      run.add(dict(cell, status="error", error=refs[(s, causal)]), check=False)
      continue
    run.begin(cell, impl)
    t0 = time.time()
    try:
      got = run_impl(impl, *(jax.numpy.asarray(x, h.jnp_dtype(dt)) for x in inputs[s]), causal=causal)
      cell["errors"] = {n: error_stats(x, refs[(s, causal)][n]) for n, x in zip(QUANTS, got)}
      if any(e["nonfinite"] for e in cell["errors"].values()):
        cell["status"] = "nonfinite"
    except Exception as e:  # noqa: BLE001
      cell.update(status="error", error=h.err_str(e))
    run.add(cell, kind=impl + dt, t0=t0)
  return run.finish(render, summary)


# --- report -----------------------------------------------------------------------------------------

def _err(c, q, kind="rel_l2"):
  return (((c or {}).get("errors") or {}).get(q) or {}).get(kind)


def answer(cells) -> list[str]:
  """The md's paragraph on the question, from the numbers: fa2_jax's out error at the shortest and the
  longest length beside the same-dtype formula's (and, in earlier files, per-step normalisation's)."""
  lines = []
  ours = "fa2" if any(c["impl"] == "fa2" for c in cells) else "fa2_triton"
  for cz in sorted({c["causal"] for c in cells}):
    for dt in DTYPES:
      by = {(c["impl"], c["seq"]): _err(c, "out") for c in cells if c["causal"] == cz and c["dtype"] == dt}
      pts = sorted((s, e) for (i, s), e in by.items() if i == ours and h.finite(e))
      if len(pts) < 2:
        continue
      (s0, e0), (s1, e1) = pts[0], pts[-1]
      txt = (f"- {dt}, {'causal' if cz else 'non-causal'}: fa2_jax out rel-L2 {e0:.2e} at {h.seq_label(s0)}"
             f" → {e1:.2e} at {h.seq_label(s1)} (×{e1 / e0:.2f})")
      ok = True
      x0, x1, n1 = by.get(("xla", s0)), by.get(("xla", s1)), by.get(("fa2_normstep", s1))
      if h.finite(x0) and h.finite(x1):
        txt += (f"; the {dt} XLA formula {x0:.2e} → {x1:.2e} (×{x1 / x0:.2f}); fa2_jax/XLA at "
                f"{h.seq_label(s1)}: {e1 / x1:.2f}")
        ok &= e1 <= 1.5 * x1 and e1 / e0 <= max(2.0, 1.5 * x1 / x0)
      if h.finite(n1):
        txt += f"; per-step normalisation at {h.seq_label(s1)}: {n1:.2e}"
        ok &= e1 <= 1.5 * n1
      lines.append(txt + (". **No loss** from the unscaled accumulator at this length." if ok else
                          ". **Possible loss**: the error grows faster than the same-precision formula's "
                          "(or than per-step normalisation): look closer."))
  return lines or ["- not enough measurements (needs fa2_jax at two or more lengths)."]


def render(data, base):
  cells, cfg = [c for c in data.get("cells", []) if "impl" in c], data.get("config", {})
  lines = h.header(data, "Numerical error vs a float64 reference") + [
      f"- batch 1, heads per length {cfg.get('heads')}, head_dim {cfg.get('head_dim')}, scale "
      f"1/√head_dim; inputs: {cfg.get('inputs')}", f"- reference: {cfg.get('reference')}, on "
      f"{cfg.get('ref_device')}", "- fp32 note: the kernels use full-f32 dots; XLA's default f32 matmul "
      "on a GPU may use TF32, which shows in its fp32 row.", "",
      "## Does the unscaled accumulator lose precision at long sequence?", ""] + answer(cells) + [
      "", "Cells: relative L2 error ‖x − ref‖/‖ref‖ (max abs error in brackets).", ""]
  for cz in sorted({c["causal"] for c in cells}):
    sub = {(c["impl"], c["dtype"], c["seq"]): c for c in cells if c["causal"] == cz}
    seqs = sorted({s for _, _, s in sub})
    for q in QUANTS:
      def text(c):
        if c is None or c.get("status") == "skipped":
          return "–" if c is None else "skip"
        r, bad = _err(c, q), _err(c, q, "nonfinite")
        if h.finite(r):
          return f"{r:.1e} ({_err(c, q, 'max_abs'):.1e})"
        return f"NaN/inf ×{bad}" if bad else "–"
      rows = [[dt, h.style(i)[0]] + [text(sub.get((i, dt, s))) for s in seqs]
              for dt in DTYPES for i in h.ordered(i for i, _, _ in sub)
              if any(_err(sub.get((i, dt, s)), q) is not None for s in seqs)]
      if rows:
        lines += [f"## {q}, {'causal' if cz else 'non-causal'}", "",
                  h.md_table(["dtype", "impl"] + [h.seq_label(s) for s in seqs], rows), ""]
  if data.get("references"):
    lines.append("Reference time: " + ", ".join(f"{h.seq_label(r['seq'])}{'c' if r['causal'] else ''} "
                                                f"{r['seconds']:.1f} s" for r in data["references"]))
  lines += h.failures([c for c in cells if c.get("status") != "skipped"], lambda c: h.style(c["impl"])[0],
                      lambda c: f"{c['dtype']}/{h.seq_label(c['seq'])}", keys=("error",))
  return [h.write_md(lines, base)] + plot(data, cells, base)


def plot(data, cells, base):
  """Relative L2 error against seq: a panel per quantity (and mask), a colour per implementation, a
  marker per dtype."""
  plt = h.pyplot()
  causals = sorted({c["causal"] for c in cells})
  if plt is None or not causals:
    return []
  fig, axes = plt.subplots(len(causals), len(QUANTS), figsize=(3.8 * len(QUANTS), 3.6 * len(causals) + 0.8),
                           squeeze=False)
  for r, cz in enumerate(causals):
    for col, q in enumerate(QUANTS):
      ax = axes[r][col]
      for dt in DTYPES:
        for i in reversed(h.ordered(c["impl"] for c in cells)):  # fa2_jax drawn last, on top
          pts = sorted((c["seq"], _err(c, q)) for c in cells if c["causal"] == cz and c["dtype"] == dt
                       and c["impl"] == i and h.finite(_err(c, q)))
          if pts:
            ax.plot(*zip(*pts), "-" if i != "xla" else ":", marker=MARKERS[dt], color=h.style(i)[1], ms=4,
                    lw=1)
      h.seq_axis(ax)
      ax.set_yscale("log")
      ax.set_title(f"{q}, {'causal' if cz else 'non-causal'}", fontsize=9)
      ax.set_ylabel("relative L2 error" if col == 0 else None)
      ax.grid(alpha=0.3, which="both")
  from matplotlib.lines import Line2D
  handles = [Line2D([], [], color=h.style(i)[1], ls=":" if i == "xla" else "-", label=h.style(i)[0])
             for i in h.ordered(c["impl"] for c in cells)]
  handles += [Line2D([], [], color="black", ls="", marker=m, label=dt) for dt, m in MARKERS.items()
              if any(c["dtype"] == dt for c in cells)]
  fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
  return h.save(plt, fig, base, data, "Error against a float64 reference", dpi=100)


def summary(data) -> str:
  cells = [c for c in data.get("cells", []) if "impl" in c]
  lines = ["numerics: out rel-L2 (dq rel-L2) per seq"]
  for cz in sorted({c["causal"] for c in cells}):
    for dt in DTYPES:
      for i in h.ordered(c["impl"] for c in cells):
        sub = sorted((c for c in cells if (c["causal"], c["dtype"], c["impl"]) == (cz, dt, i)),
                     key=lambda c: c["seq"])
        if any(c.get("errors") for c in sub):
          lines.append(f"  {'c ' if cz else 'nc'} {dt} {i:<14} " + " ".join(
              f"{h.seq_label(c['seq'])}:{h.fmt_num(_err(c, 'out'), '.1e')}({h.fmt_num(_err(c, 'dq'), '.0e')})"
              for c in sub))
  return "\n".join(lines + [x[:300] for x in answer(cells)])


def main(argv=None):
  return h.script_main(argv, build_parser(), run, render, summary, STEM, cell_key)


if __name__ == "__main__":
  main()
