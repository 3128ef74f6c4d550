"""Small-batch latency: wall-clock microseconds per call (each call synchronised on its own).

Batch 1, 16 heads of 128, bf16, seq 128 ... 4k (powers of two), causal and not; forward and
forward+backward (benchmarks/timing.py); fa2_jax vs cuDNN, XLA and the peers that import (see
benchmarks/impls.py). Throughput hides launch and dispatch costs; this is what one inference step or a
tiny training step sees. Inputs rotate over a few random sets so repeated calls don't just re-read the
L2 cache.

    python -m benchmarks.latency [--quick] [--seqs 128,256,...] [--impls fa2,cudnn,xla]
    python -m benchmarks.latency --smoke
"""
from __future__ import annotations

import functools
import time

from . import harness as h
from . import impls
from .timing import forward_fn, fwd_bwd_fn, time_latency

STEM = "latency"
SEQS = [128, 256, 512, 1024, 2048, 4096]
QUICK_SEQS = [128, 1024, 4096]
DEFAULT_IMPLS = ("fa2", "cudnn", "fa3", "tokamax", "xla")
PASSES = ("fwd", "fwd+bwd")


def build_parser():
  p = h.script_parser("latency", __doc__)
  p.add_argument("--seqs", type=h.parse_ints, default=None)
  p.add_argument("--impls", type=h.impl_names, default=None,
                 help=f"comma list of {', '.join(impls.NAMES)} (default {','.join(DEFAULT_IMPLS)})")
  p.add_argument("--causal", choices=["both", "true", "false"], default="both")
  p.add_argument("--heads", type=h.positive_int, default=16)
  p.add_argument("--head-dim", type=h.positive_int, default=128)
  p.add_argument("--batch", type=h.positive_int, default=1)
  p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
  p.add_argument("--calls", type=h.positive_int, default=None,
                 help="timed calls per cell (default 200, quick 100, smoke 5)")
  p.add_argument("--input-sets", type=h.positive_int, default=4, help="random input sets rotated over")
  h.add_common_args(p)
  return p


def cell_key(c):
  return (c.get("seq"), c.get("causal"), c.get("impl"))


def run(args) -> dict:
  info = h.device_info()
  h.cpu_fallback(args, info, STEM)
  if args.smoke:
    seqs, calls = args.seqs or [64, 128], args.calls or 5
    args.heads, args.head_dim = min(args.heads, 2), min(args.head_dim, 32)
  else:
    seqs = args.seqs or (QUICK_SEQS if args.quick else SEQS)
    calls = args.calls or (100 if args.quick else 200)
  names, info["absent_impls"] = impls.split_available(args.impls or DEFAULT_IMPLS)
  dtype = h.jnp_dtype(args.dtype)
  # The two ends first (a budget cut then loses the middle of the curve).
  todo = [(s, c, i) for s in sorted(seqs, key=lambda s: (s not in (min(seqs), max(seqs)), s))
          for c in h.masks(args.causal) for i in names]
  run = h.Run(args, STEM, info, dict(
      seqs=seqs, impls=names, causal=h.masks(args.causal), batch=args.batch, heads=args.heads,
      head_dim=args.head_dim, dtype=args.dtype, calls=calls, input_sets=args.input_sets,
      method="jit; 5 warm-up calls; each timed call = dispatch + block_until_ready; median over "
      "calls (p10/p90 kept); inputs rotate over random sets; fwd+bwd = jit(grad(f32 sum))"),
      cell_key, len(todo))
  inputs = {}
  for s, causal, impl in todo:
    run.bar.set_postfix_str(f"{impl} T={s} causal={causal}")
    cell = dict(impl=impl, seq=s, causal=causal, batch=args.batch, heads=args.heads,
                head_dim=args.head_dim, dtype=args.dtype, status="ok", latency={})
    if run.skip(cell, impl):
      continue
    run.begin(cell, impl)
    t0, shape = time.time(), (args.batch, s, args.heads, args.head_dim)
    why = impls.unsupported(impl, shape, shape, dtype, causal)
    if why:
      run.add(dict(cell, status="unsupported", error=why), kind=impl, t0=t0, check=False)
      continue
    if s not in inputs:
      inputs = {s: [tuple(h.random_inputs(1000 * args.seed + 17 * s + j, [shape] * 3, dtype))
                    for j in range(args.input_sets)]}
    f = functools.partial(impls.get(impl), causal=causal)
    for p, fn in (("fwd", forward_fn), ("fwd+bwd", fwd_bwd_fn)):
      try:
        cell["latency"][p] = time_latency(fn(f), inputs[s], calls=calls)
      except Exception as e:  # noqa: BLE001
        cell[f"{p}_error"] = h.err_str(e)
    run.add(dict(cell, status=h.status_of(cell)), kind=impl, t0=t0)
  return run.finish(render, summary)


def _lat(c, p):
  return ((c.get("latency") or {}).get(p) or {}).get("median_us")


def render(data, base):
  cells, cfg = [c for c in data.get("cells", []) if "impl" in c], data.get("config", {})
  lines = h.header(data, f"Latency (batch {cfg.get('batch')}, {cfg.get('heads')} heads × "
                   f"{cfg.get('head_dim')}, {cfg.get('dtype')})") + [
      f"- method: {cfg.get('method')}; {cfg.get('calls')} timed calls per cell", "",
      "Median µs per call `fwd / fwd+bwd` (p10–p90 of fwd+bwd in brackets); ✗ failed.", ""]
  for causal in sorted({c["causal"] for c in cells}):
    sub = {(c["impl"], c["seq"]): c for c in cells if c["causal"] == causal}
    seqs = sorted({s for _, s in sub})

    def text(c):
      if c is None or c.get("status") in ("skipped", "unsupported"):
        return "–" if c is None else "skip" if c["status"] == "skipped" else "n/a"
      fb = (c.get("latency") or {}).get("fwd+bwd") or {}
      spread = f" [{fb['p10_us']:.0f}–{fb['p90_us']:.0f}]" if h.finite(fb.get("p10_us")) else ""
      return (f"{h.fmt_num(_lat(c, 'fwd'))} / {h.fmt_num(_lat(c, 'fwd+bwd'))}{spread}"
              if c.get("latency") else "✗")

    lines += [f"## {'causal' if causal else 'non-causal'}", "", h.md_table(
        ["impl"] + [h.seq_label(s) for s in seqs],
        [[h.style(i)[0]] + [text(sub.get((i, s))) for s in seqs]
         for i in h.ordered(i for i, _ in sub)]), ""]
  lines += h.failures(cells, lambda c: h.style(c["impl"])[0],
                      lambda c: f"{h.seq_label(c['seq'])} {'c' if c['causal'] else 'nc'}")
  return [h.write_md(lines, base)] + plot(data, cells, base)


def plot(data, cells, base):
  """Median µs per call against seq, a panel per mask: forward dashed, forward+backward solid."""
  plt = h.pyplot()
  causals = sorted({c["causal"] for c in cells})
  if plt is None or not causals:
    return []
  fig, axes = plt.subplots(1, len(causals), figsize=(6.5 * len(causals), 4.6), squeeze=False)
  for ax, causal in zip(axes[0], causals):
    for i in reversed(h.ordered(c["impl"] for c in cells)):  # fa2_jax drawn last, on top
      for p, ls in (("fwd", "--"), ("fwd+bwd", "-")):
        pts = sorted((c["seq"], _lat(c, p)) for c in cells
                     if c["impl"] == i and c["causal"] == causal and h.finite(_lat(c, p)))
        if pts:
          ax.plot(*zip(*pts), ls, marker="o", ms=4, color=h.style(i)[1], label=h.style(i)[0]
                  if p == "fwd+bwd" else None)
    h.seq_axis(ax)
    ax.set_yscale("log")
    ax.set_ylabel("µs per call (median)")
    ax.set_title(f"{'causal' if causal else 'non-causal'} (solid: fwd+bwd, dashed: fwd)", fontsize=10)
    ax.grid(alpha=0.3, which="both")
  h.legend_below(fig, axes)
  cfg = data.get("config", {})
  return h.save(plt, fig, base, data, f"Latency per call, batch {cfg.get('batch')}, "
                f"{cfg.get('heads')} × {cfg.get('head_dim')} {cfg.get('dtype')} (lower is better)")


def summary(data) -> str:
  cells = [c for c in data.get("cells", []) if "impl" in c]
  return "\n".join(["latency median us fwd / fwd+bwd"] + [
      f"  {'c ' if c['causal'] else 'nc'} {h.seq_label(c['seq']):>4} {c['impl']:<12} "
      f"{h.fmt_num(_lat(c, 'fwd'), '7.0f')} / {h.fmt_num(_lat(c, 'fwd+bwd'), '7.0f')}"
      f"{'' if c.get('status') == 'ok' else '  ' + str(c.get('status'))}"
      for c in sorted(cells, key=lambda c: (c["causal"], c["seq"], h.rank(c["impl"])))])


def main(argv=None):
  return h.script_main(argv, build_parser(), run, render, summary, STEM, cell_key)


if __name__ == "__main__":
  main()
