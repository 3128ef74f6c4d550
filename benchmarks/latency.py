"""Small-batch latency: wall-clock microseconds per call (each call synchronised on its own).

Batch 1, 16 heads of 128, bf16, seq 128 ... 4k (powers of two), causal and not; forward and
forward+backward (benchmarks/timing.py); fa2_jax vs cuDNN, XLA and the peers that import (see
benchmarks/impls.py). Throughput hides launch and dispatch costs; this is
what one decode-free inference step or a tiny training step sees. Inputs rotate over a few random sets
so repeated calls don't just re-read the L2 cache.

    python -m benchmarks.latency [--quick] [--seqs 128,256,...] [--impls fa2,cudnn,xla]
    python -m benchmarks.latency --smoke
"""
from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path

from . import cli, impls, plots
from .device import device_info
from .recorder import Recorder, close_cell, finish_run
from .report import err_str, finite, fmt_num, md_table, meta_lines, out_name, seq_label, write_md
from .timing import forward_fn, fwd_bwd_fn, time_latency

SEQS = [128, 256, 512, 1024, 2048, 4096]
QUICK_SEQS = [128, 1024, 4096]
DEFAULT_IMPLS = ("fa2", "cudnn", "fa3", "tokamax", "xla")
PASS_NAMES = ("fwd", "fwd+bwd")
STEM = "latency"


def build_parser():
  p = argparse.ArgumentParser(prog="python -m benchmarks.latency", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--seqs", type=cli.parse_ints, default=None)
  p.add_argument("--impls", type=cli.impl_names, default=None,
                 help=f"comma list of {', '.join(impls.NAMES)} (default {','.join(DEFAULT_IMPLS)})")
  p.add_argument("--causal", choices=["both", "true", "false"], default="both")
  p.add_argument("--heads", type=cli.positive_int, default=16)
  p.add_argument("--head-dim", type=cli.positive_int, default=128)
  p.add_argument("--batch", type=cli.positive_int, default=1)
  p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
  p.add_argument("--calls", type=cli.positive_int, default=None,
                 help="timed calls per cell (default 200, quick 100, smoke 5)")
  p.add_argument("--input-sets", type=cli.positive_int, default=4,
                 help="random input sets rotated over")
  cli.add_common_args(p)
  return p


def cell_key(c):
  return (c.get("seq"), c.get("causal"), c.get("impl"))


def run(args) -> dict:
  info = device_info()
  cli.cpu_fallback(args, info, STEM)
  if args.smoke:
    seqs = args.seqs or [64, 128]
    args.heads, args.head_dim = min(args.heads, 2), min(args.head_dim, 32)
    calls = args.calls or 5
  else:
    seqs = args.seqs or (QUICK_SEQS if args.quick else SEQS)
    calls = args.calls or (100 if args.quick else 200)
  names, absent = impls.split_available(args.impls or DEFAULT_IMPLS)
  info["absent_impls"] = absent
  out_dir = cli.resolve_out(args, info)
  causals = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
  dtype = cli.jnp_dtype(args.dtype)
  rec = Recorder(out_dir / out_name(STEM, args.tag, "json"), info, dict(
      seqs=seqs, impls=names, causal=causals, batch=args.batch, heads=args.heads,
      head_dim=args.head_dim, dtype=args.dtype, calls=calls, input_sets=args.input_sets,
      method="jit; 5 warm-up calls; each timed call = dispatch + block_until_ready; median over "
      "calls (p10/p90 kept); inputs rotate over random sets; fwd+bwd = jit(grad(f32 sum))"), STEM,
      key=cell_key, resume=args.resume)
  crashed = {c.get("impl") for c in rec.crashed}
  budget = cli.make_budget(args)
  # The two ends first (a budget cut then loses the middle of the curve).
  order = sorted(seqs, key=lambda s: (s not in (min(seqs), max(seqs)), s))
  todo = [(s, c, i) for s in order for c in causals for i in names]
  bar = cli.progress(len(todo), STEM)
  arg_cache = {}
  for s, c, impl in todo:
    bar.set_postfix_str(f"{impl} T={s} causal={c}")
    base = dict(impl=impl, label=impls.get(impl).label, seq=s, causal=c, batch=args.batch,
                heads=args.heads, head_dim=args.head_dim, dtype=args.dtype)
    if rec.key(base) in rec.done:
      bar.update(1)
      continue
    if impl in crashed or not budget.fits(impl):
      rec.add(dict(base, status="skipped", error="skipped: " + (
          "this implementation crashed the process earlier" if impl in crashed else "time budget")))
      bar.update(1)
      continue
    rec.begin(base)
    t0 = time.time()
    cell = dict(base, status="ok", latency={})
    shape = (args.batch, s, args.heads, args.head_dim)
    why = impls.unsupported(impl, shape, shape, dtype, c)
    if why:
      cell.update(status="unsupported", error=why)
      close_cell(rec, budget, impl, cell, t0, bar)
      continue
    try:
      if s not in arg_cache:
        arg_cache.clear()
        arg_cache[s] = [tuple(cli.random_inputs(1000 * args.seed + 17 * s + j, [shape] * 3, dtype))
                        for j in range(max(1, args.input_sets))]
      f = functools.partial(impls.get(impl), causal=c)
      for pname, fn in (("fwd", forward_fn(f)), ("fwd+bwd", fwd_bwd_fn(f))):
        try:
          cell["latency"][pname] = time_latency(fn, arg_cache[s], calls=calls)
        except Exception as e:  # noqa: BLE001
          cell[f"{pname}_error"] = err_str(e)
      if not cell["latency"]:
        cell["status"] = "error"
      elif len(cell["latency"]) < len(PASS_NAMES):
        cell["status"] = "partial"
    except Exception as e:  # noqa: BLE001
      cell.update(status="error", error=err_str(e))
    close_cell(rec, budget, impl, cell, t0, bar)
  return finish_run(rec, bar, render, summary, out_dir, args.tag)


def _lat(c, p):
  return ((c.get("latency") or {}).get(p) or {}).get("median_us")


def _impls(cells):
  out = []
  for i in list(DEFAULT_IMPLS) + [c["impl"] for c in cells]:
    if i not in out and any(c["impl"] == i for c in cells):
      out.append(i)
  return out


def _label(cells, name):
  return next((c["label"] for c in cells if c["impl"] == name and c.get("label")), name)


def render(data, out_dir: Path, tag=None):
  cells = [c for c in data.get("cells", []) if "impl" in c]
  out_dir = Path(out_dir)
  cfg = data.get("config", {})
  lines = [f"# Latency (batch {cfg.get('batch')}, {cfg.get('heads')} heads × {cfg.get('head_dim')}, "
           f"{cfg.get('dtype')})", ""]
  lines += meta_lines(data.get("meta", {}))
  lines += [f"- method: {cfg.get('method')}; {cfg.get('calls')} timed calls per cell", "",
            "Median µs per call `fwd / fwd+bwd` (p10–p90 of fwd+bwd in brackets); ✗ failed.", ""]
  impls = _impls(cells)
  for cz in sorted({c["causal"] for c in cells}):
    sub = [c for c in cells if c["causal"] == cz]
    seqs = sorted({c["seq"] for c in sub})
    lines += [f"## {'causal' if cz else 'non-causal'}", ""]
    rows = []
    for i in impls:
      row = [_label(cells, i)]
      for s in seqs:
        cc = [c for c in sub if c["impl"] == i and c["seq"] == s]
        if not cc:
          row.append("–")
          continue
        c = cc[0]
        if c.get("status") == "skipped":
          row.append("skip")
          continue
        lf, lb = _lat(c, "fwd"), _lat(c, "fwd+bwd")
        if lf is None and lb is None:
          row.append("✗")
          continue
        fb = (c.get("latency") or {}).get("fwd+bwd") or {}
        spread = (f" [{fb['p10_us']:.0f}–{fb['p90_us']:.0f}]" if finite(fb.get("p10_us")) else "")
        row.append(f"{fmt_num(lf, '.0f')} / {fmt_num(lb, '.0f')}{spread}")
      rows.append(row)
    lines.append(md_table(["impl"] + [seq_label(s) for s in seqs], rows))
    lines.append("")
  errs = [(c["impl"], c["seq"], c["causal"], c.get("error") or c.get("fwd_error")
           or c.get("fwd+bwd_error")) for c in cells
          if c.get("status") in ("error", "partial")]
  if errs:
    lines += ["## Failures", ""]
    lines += [f"- {i} T={s} causal={cz}: `{(e or '')[:300]}`" for i, s, cz, e in errs]
  md = write_md(lines, out_dir, STEM, tag)
  files = [md]
  files += plot(cells, out_dir, tag)
  return files


def plot(cells, out_dir, tag=None):
  plt = plots.get_pyplot()
  if plt is None or not cells:
    return []
  causals = sorted({c["causal"] for c in cells})
  fig, axes = plt.subplots(1, len(causals), figsize=(6 * len(causals), 4), squeeze=False)
  for ax, cz in zip(axes[0], causals):
    for i in _impls(cells):
      for p, ls in (("fwd", "--"), ("fwd+bwd", "-")):
        pts = sorted((c["seq"], _lat(c, p)) for c in cells
                     if c["impl"] == i and c["causal"] == cz and finite(_lat(c, p)))
        if pts:
          ax.plot([x for x, _ in pts], [y for _, y in pts], ls, marker="o",
                  label=f"{_label(cells, i)} {p}")
    plots.seq_log_axis(ax)
    ax.set_yscale("log")
    ax.set_ylabel("µs per call (median)")
    ax.set_title(f"{'causal' if cz else 'non-causal'}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
  fig.suptitle("Latency per call, batch 1")
  fig.tight_layout()
  return [plots.save_png(plt, fig, Path(out_dir) / out_name(STEM, tag, "png"))]


def summary(data) -> str:
  cells = [c for c in data.get("cells", []) if "impl" in c]
  lines = ["latency median us fwd / fwd+bwd"]
  for c in sorted(cells, key=lambda c: (c["causal"], c["seq"], c["impl"])):
    lines.append(f"  {'c ' if c['causal'] else 'nc'} {seq_label(c['seq']):>4} {c['impl']:<12} "
                 f"{fmt_num(_lat(c, 'fwd'), '7.0f')} / {fmt_num(_lat(c, 'fwd+bwd'), '7.0f')}"
                 f"{'' if c.get('status') == 'ok' else '  ' + c.get('status', '')}")
  return "\n".join(lines)


def main(argv=None):
  return cli.script_main(argv, build_parser(), run, render, summary, STEM, cell_key)


if __name__ == "__main__":
  main()
