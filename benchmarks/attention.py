"""Attention throughput in TFLOP/s, after the FlashAttention-2 paper's Figures 4-6.

16k tokens in total (batch = 16384 // seq), hidden 2048 (head_dim 64 -> 32 heads, 128 -> 16), causal and
not, forward, backward and forward+backward, bf16 (``--dtype fp16``). Every implementation runs in the
same process on the same random inputs; each cell also gets its ratio to cuDNN.

    python -m benchmarks.attention [--quick] [--seqs 512,1k,...] [--head-dims 64,128]
                                   [--impls fa2_triton,cudnn,...] [--out DIR] [--tag T]
    python -m benchmarks.attention --smoke      # CPU, interpret mode, tiny shapes
    python -m benchmarks.attention --merge a.json b.json --out DIR   # re-render

FLOPs (paper convention): fwd = 4·B·N·T·S·H (halved when causal), bwd = 2.5 fwd, fwd+bwd = 3.5 fwd;
bwd time = fwd+bwd time - fwd time.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from . import common as C

SEQS = [512, 1024, 2048, 4096, 8192, 16384]
HEAD_DIMS = [64, 128]
QUICK_SEQS = [2048, 8192]
QUICK_HEAD_DIMS = [128, 64]
DEFAULT_IMPLS = ["cudnn", "fa2_triton", "fa2_triton_det", "fa2_triton_atomic", "fa2_mosaic",
                 "fa2_mosaic_det", "xla",
                 "tokamax_mosaic", "tokamax_triton"]
# Outputs against the f32 reference: a check that a fast row is also a right one.
REL_ERR_WARN = 2e-2
REF_HEADS = 4  # the check compares batch 0, heads [0, REF_HEADS) (f32 logits at 16k: 4 GiB)
STEM = "attention"


def build_parser():
  p = argparse.ArgumentParser(prog="python -m benchmarks.attention", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--seqs", type=C.parse_ints, default=None, help="sequence lengths, e.g. 512,2k,8k")
  p.add_argument("--head-dims", type=C.parse_ints, default=None)
  p.add_argument("--causal", choices=["both", "true", "false"], default="both")
  p.add_argument("--impls", type=C.parse_strs, default=None,
                 help=f"comma list of {', '.join(C.ALL_IMPLS)} (default: all that import)")
  p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
  p.add_argument("--tokens", type=int, default=16384, help="batch = tokens // seq")
  p.add_argument("--hidden", type=int, default=2048, help="heads = hidden // head_dim")
  p.add_argument("--iters", type=int, default=10, help="back-to-back calls per repetition")
  p.add_argument("--reps", type=int, default=5, help="repetitions (median taken)")
  p.add_argument("--no-check", action="store_true", help="skip the f32 reference check")
  p.add_argument("--no-matmul", action="store_true", help="skip the bf16 matmul ceiling")
  C.add_common_args(p)
  return p


def configs(args):
  """(seq, head_dim, causal) in priority order, so a budget cut loses the least important cells."""
  if args.smoke:  # 256 tokens, 2 heads of 32
    seqs, hds = args.seqs or [64, 128], args.head_dims or [32]
    args.tokens, args.hidden = min(args.tokens, 256), min(args.hidden, 64)
  elif args.quick:
    seqs, hds = args.seqs or QUICK_SEQS, args.head_dims or QUICK_HEAD_DIMS
  else:
    seqs, hds = args.seqs or SEQS, args.head_dims or HEAD_DIMS
  prio = [8192, 2048, 16384, 4096, 1024, 512]
  seqs = sorted(seqs, key=lambda s: (prio.index(s) if s in prio else len(prio), s))
  causals = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
  out = []
  for s in seqs:
    for h in sorted(hds, key=lambda h: (h != 128, h)):
      for c in causals:
        b = max(1, args.tokens // s)
        n = max(1, args.hidden // h)
        out.append(dict(seq=s, head_dim=h, causal=c, batch=b, heads=n))
  return out


def impl_list(args):
  if args.impls:
    unknown = [i for i in args.impls if i not in C.ALL_IMPLS]
    if unknown:
      raise SystemExit(f"unknown --impls {unknown}; known: {', '.join(C.ALL_IMPLS)}")
    impls = list(args.impls)
  elif args.smoke:
    impls = ["fa2_triton", "xla"]
  else:
    impls = [i for i in DEFAULT_IMPLS if i not in C.TOKAMAX_IMPLS or C.tokamax_available()]
    # The default backward is either the separate dQ pass (then deterministic=True is the same
    # program: one row) or atomic dQ (then the deterministic row is the other scheme). Atomic dQ as
    # a non-default is measured by benchmarks.ablation (c), not here.
    impls = [i for i in impls if i != "fa2_triton_atomic"
             and (i != "fa2_triton_det" or not C.fa2_default_deterministic())]
  # cuDNN first: the other rows of a config are read against it.
  return sorted(impls, key=lambda i: i != "cudnn")


def cfg_key(c):
  return (c["seq"], c["head_dim"], c["causal"])


def attach_ratios(cells):
  """Add ``vs_cudnn`` (TFLOP/s over cuDNN's, per pass) to every measured cell."""
  cud = {cfg_key(c): c for c in cells if c.get("impl") == "cudnn"}
  for c in cells:
    ref = cud.get(cfg_key(c))
    c["vs_cudnn"] = {}
    for p in C.PASSES:
      a = (c.get("tflops") or {}).get(p)
      b = (ref.get("tflops") or {}).get(p) if ref else None
      c["vs_cudnn"][p] = a / b if C.finite(a) and C.finite(b) and b > 0 else None
  return cells


def measure(impl, cfg, inputs, ref, args, interpret):
  """One cell: forward, then forward+backward; errors are recorded, never raised."""
  import jax
  import jax.numpy as jnp
  q, k, v, do = inputs
  fl = C.attn_flops(cfg["batch"], cfg["heads"], cfg["seq"], cfg["seq"], cfg["head_dim"],
                    cfg["causal"])
  cell = dict(cfg, impl=impl, label=C.IMPL_LABELS.get(impl, impl), dtype=args.dtype,
              flops_fwd=fl, tflops={}, ms={}, timing={}, status="ok")
  t0 = time.time()
  iters, reps = (2, 2) if args.smoke else (args.iters, args.reps)
  try:
    f = C.make_attention(impl, causal=cfg["causal"], interpret=interpret)
  except Exception as e:  # noqa: BLE001
    cell.update(status="unavailable", error=C.err_str(e))
    return cell
  try:
    ff = jax.jit(f)
    st, out = C.time_throughput(ff, (q, k, v), iters=iters, reps=reps)
    cell["timing"]["fwd"] = st
    cell["ms"]["fwd"] = st["median_s"] * 1e3
    cell["tflops"]["fwd"] = fl / st["median_s"] / 1e12
    if ref is not None:
      o = out[:1, :, :REF_HEADS].astype(jnp.float32)
      cell["rel_err"] = float(jnp.linalg.norm(o - ref) / jnp.linalg.norm(ref))
      if not (cell["rel_err"] <= REL_ERR_WARN):
        cell["warning"] = f"forward rel. error {cell['rel_err']:.2e} vs the f32 reference"
    del out
  except Exception as e:  # noqa: BLE001
    cell["fwd_error"] = C.err_str(e)
  try:
    g = C.fwd_bwd(f)
    st, _ = C.time_throughput(g, (q, k, v, do), iters=iters, reps=reps)
    cell["timing"]["fwd+bwd"] = st
    cell["ms"]["fwd+bwd"] = st["median_s"] * 1e3
    cell["tflops"]["fwd+bwd"] = 3.5 * fl / st["median_s"] / 1e12
    tf = cell["ms"].get("fwd")
    if tf is not None and cell["ms"]["fwd+bwd"] > tf:
      cell["ms"]["bwd"] = cell["ms"]["fwd+bwd"] - tf
      cell["tflops"]["bwd"] = 2.5 * fl / (cell["ms"]["bwd"] * 1e-3) / 1e12
  except Exception as e:  # noqa: BLE001
    cell["bwd_error"] = C.err_str(e)
  if "fwd_error" in cell and "bwd_error" in cell:
    cell["status"] = "error"
    if cell["fwd_error"] == cell["bwd_error"] and cell["fwd_error"].startswith("ValueError"):
      # Refused at trace time (e.g. implementation="mosaic" on a shape it does not support).
      cell["status"] = "unavailable" if "not available" in cell["fwd_error"] else "unsupported"
  elif "fwd_error" in cell or "bwd_error" in cell:
    cell["status"] = "partial"
  cell["wall_s"] = time.time() - t0
  return cell


def _reference(inputs, causal):
  """f32 reference output of batch 0, heads [0, REF_HEADS) (heads are independent)."""
  import jax
  import jax.numpy as jnp
  fa2 = C.ensure_fa2()
  sl = lambda x: x[:1, :, :REF_HEADS]  # noqa: E731
  f = jax.jit(lambda q, k, v: fa2.reference_attention(
      sl(q), sl(k), sl(v), is_causal=causal, compute_dtype=jnp.float32).astype(jnp.float32))
  return jax.block_until_ready(f(*inputs[:3]))


def run(args) -> dict:
  C.ensure_fa2()
  info = C.device_info(tokamax=True)
  out_dir = C.resolve_out(args, info)
  impls = impl_list(args)
  cfgs = configs(args)
  interpret = C.default_interpret()
  dtype = C.jnp_dtype(args.dtype)
  rec = C.Recorder(out_dir / C.out_name(STEM, args.tag, "json"), info, dict(
      impls=impls, configs=cfgs, dtype=args.dtype, tokens=args.tokens, hidden=args.hidden,
      iters=args.iters, reps=args.reps, interpret=interpret, smoke=args.smoke, quick=args.quick,
      method="jit; 2 warm-up calls; median of reps x (iters back-to-back calls, then "
             "block_until_ready); bwd = (fwd+bwd) - fwd; fwd+bwd = jax.vjp with a random cotangent"),
      STEM, key=lambda c: (c.get("seq"), c.get("head_dim"), c.get("causal"), c.get("impl")),
      resume=args.resume)
  crashed = {c.get("impl") for c in rec.crashed}
  budget = C.make_budget(args)
  if not args.smoke and not args.no_matmul and C.on_gpu() and "matmul" not in rec.data:
    try:
      rec.data["matmul"] = C.matmul_peak()
      print(f"[attention] bf16 matmul 8192^3: {rec.data['matmul']['tflops']:.0f} TFLOP/s", flush=True)
    except Exception as e:  # noqa: BLE001
      rec.data["matmul"] = {"error": C.err_str(e)}
  if C.fa2_default_deterministic():
    rec.note("fa2_jax triton's default backward is the separate dQ pass (deterministic), so a "
             "deterministic=True row would repeat it (its atomic dQ: benchmarks.ablation (c)); fa2_jax "
             "mosaic's default fuses dQ into the dK/dV kernel for non-causal head_dim 64/128 (TMA "
             "reduce-adds), and its row fa2_mosaic_det is deterministic=True")
  if not args.smoke and not args.impls and not C.tokamax_available():
    rec.note(f"tokamax rows left out: {info.get('tokamax')}")
  bar = C.progress(len(cfgs) * len(impls), "attention")
  for ci, cfg in enumerate(cfgs):
    shape_q = (cfg["batch"], cfg["seq"], cfg["heads"], cfg["head_dim"])
    inputs = ref = None
    for impl in impls:
      bar.set_postfix_str(f"{impl} T={cfg['seq']} H={cfg['head_dim']} causal={cfg['causal']}")
      base = dict(cfg, impl=impl, label=C.IMPL_LABELS.get(impl, impl), dtype=args.dtype)
      if rec.key(base) in rec.done:  # --resume: measured by the last run
        bar.update(1)
        continue
      if impl in crashed or not budget.fits(impl, default=0.0):
        rec.add(dict(base, status="skipped", error="skipped: " + (
            "this implementation crashed the process earlier" if impl in crashed
            else "time budget")))
        bar.update(1)
        continue
      rec.begin(base)
      C.test_crash_hook(impl)
      t0 = time.time()
      try:
        if inputs is None:
          inputs = C.random_inputs(args.seed * 1000 + ci, [shape_q] * 4, dtype)
          if not args.no_check:
            try:
              ref = _reference(inputs, cfg["causal"])
            except Exception as e:  # noqa: BLE001
              rec.note(f"no f32 reference for {cfg}: {C.err_str(e)}")
        cell = measure(impl, cfg, inputs, ref, args, interpret)
      except Exception as e:  # noqa: BLE001
        cell = dict(cfg, impl=impl, label=C.IMPL_LABELS.get(impl, impl), status="error",
                    error=C.err_str(e))
      budget.record(impl, time.time() - t0)
      C.check_device(rec, cell)
      rec.add(cell)
      attach_ratios(rec.cells)
      bar.update(1)
    del inputs, ref
  bar.close()
  attach_ratios(rec.cells)
  data = rec.finish("done")
  files = render(data, out_dir, args.tag)
  print(summary(data), flush=True)
  print(f"[attention] wrote {rec.path} and {', '.join(str(f) for f in files)}", flush=True)
  data["files"] = [str(rec.path), *map(str, files)]
  return data


# --- rendering ----------------------------------------------------------------------------------------

def _groups(cells):
  hds = sorted({c["head_dim"] for c in cells})
  causals = sorted({c["causal"] for c in cells})
  return hds, causals


def _impl_order(cells):
  seen = []
  for i in DEFAULT_IMPLS + [c["impl"] for c in cells]:
    if i not in seen and any(c["impl"] == i for c in cells):
      seen.append(i)
  return seen


def _cell_text(c):
  if c is None:
    return "–"
  if "crash" in (c.get("error") or ""):
    return "✗ crash"
  if c.get("status") == "skipped":
    return "skip"
  t = c.get("tflops") or {}
  if not t:
    return "✗"
  vals = " / ".join(C.fmt_tf(t.get(p)) for p in C.PASSES)
  r = c.get("vs_cudnn") or {}
  if any(C.finite(r.get(p)) for p in C.PASSES):
    vals += " (" + " / ".join(C.fmt_num(r.get(p), ".2f") for p in C.PASSES) + "×)"
  if c.get("warning"):
    vals += " ⚠"
  return vals


def render(data, out_dir: Path, tag=None):
  cells = attach_ratios([c for c in data.get("cells", []) if "impl" in c])
  meta = data.get("meta", {})
  out_dir = Path(out_dir)
  files = []
  lines = [f"# Attention throughput ({data.get('config', {}).get('dtype', 'bf16')})", ""]
  lines += C.meta_lines(meta)
  if data.get("merged_from"):
    lines.append("- merged from " + ", ".join(f"`{p}`" for p in data["merged_from"]) + ": where "
                 "two runs hold a cell the later run's wins (each cell's `source` in the JSON); a "
                 "run measures every row of a column in one process, so ratios stay within a run")
  mm = data.get("matmul") or {}
  if C.finite(mm.get("tflops")):
    lines.append(f"- dense bf16 matmul 8192³ on this device: {mm['tflops']:.0f} TFLOP/s")
  cfg = data.get("config", {})
  lines += [
      f"- shapes: {cfg.get('tokens', 16384)} tokens (batch = tokens / seq), hidden "
      f"{cfg.get('hidden', 2048)} (heads = hidden / head_dim); FLOPs fwd = 4·B·N·T²·H (½ causal), "
      "bwd = 2.5×, fwd+bwd = 3.5×; bwd time = fwd+bwd − fwd",
      f"- timing: {cfg.get('method', '')}",
      "", "Cells: TFLOP/s `fwd / bwd / fwd+bwd`, then `(×cuDNN)` per pass; ✗ failed (see below), "
      "skip = time budget, ⚠ = output off the f32 reference.", ""]
  hds, causals = _groups(cells)
  impls = _impl_order(cells)
  for h in hds:
    for cz in causals:
      sub = [c for c in cells if c["head_dim"] == h and c["causal"] == cz]
      if not sub:
        continue
      seqs = sorted({c["seq"] for c in sub})
      b_n = {c["seq"]: (c.get("batch"), c.get("heads")) for c in sub}
      lines.append(f"## head_dim {h}, {'causal' if cz else 'non-causal'}")
      lines.append("")
      header = ["impl"] + [f"{C.seq_label(s)} (B={b_n[s][0]}, N={b_n[s][1]})" for s in seqs]
      rows = []
      for i in impls:
        row_cells = {c["seq"]: c for c in sub if c["impl"] == i}
        if not row_cells or all(c.get("status") == "unavailable" for c in row_cells.values()):
          continue
        rows.append([C.IMPL_LABELS.get(i, i)] + [_cell_text(row_cells.get(s)) for s in seqs])
      lines.append(C.md_table(header, rows))
      lines.append("")
  errs = {}
  for c in cells:
    for key in ("error", "fwd_error", "bwd_error", "warning"):
      if c.get(key) and c.get("status") != "skipped":
        errs.setdefault((c["impl"], key, c[key]), []).append(
            f"{C.seq_label(c['seq'])}/d{c['head_dim']}/{'c' if c['causal'] else 'nc'}")
  if errs:
    lines += ["## Failures and warnings", ""]
    for (impl, key, msg), where in errs.items():
      lines.append(f"- **{impl}** {key} ({', '.join(where)}): `{msg[:300]}`")
    lines.append("")
  for n in data.get("notes", []):
    lines.append(f"- note: {n}")
  md = out_dir / C.out_name(STEM, tag, "md")
  md.write_text("\n".join(lines) + "\n")
  files.append(md)
  files += plot(cells, out_dir, tag)
  return files


def plot(cells, out_dir: Path, tag=None):
  """Paper-style grouped bars: TFLOP/s per sequence length, one bar per implementation; one panel
  per (head_dim, causal), one figure per pass."""
  plt = C.get_pyplot()
  if plt is None or not cells:
    return []
  import numpy as np
  hds, causals = _groups(cells)
  impls = _impl_order(cells)
  files = []
  cmap = plt.get_cmap("tab10")
  colors = {i: cmap(k % 10) for k, i in enumerate(DEFAULT_IMPLS + [x for x in impls
                                                                     if x not in DEFAULT_IMPLS])}
  for p in C.PASSES:
    fig, axes = plt.subplots(len(hds), len(causals), figsize=(6.5 * len(causals), 3.8 * len(hds)),
                             squeeze=False)
    for r, h in enumerate(hds):
      for col, cz in enumerate(causals):
        ax = axes[r][col]
        sub = [c for c in cells if c["head_dim"] == h and c["causal"] == cz]
        seqs = sorted({c["seq"] for c in sub})
        shown = [i for i in impls if any(C.finite((c.get("tflops") or {}).get(p))
                                         for c in sub if c["impl"] == i)]
        width = 0.8 / max(1, len(shown))
        x = np.arange(len(seqs))
        for k, i in enumerate(shown):
          vals = []
          for s in seqs:
            cc = [c for c in sub if c["impl"] == i and c["seq"] == s]
            v = (cc[0].get("tflops") or {}).get(p) if cc else None
            vals.append(v if C.finite(v) else 0.0)
          bars = ax.bar(x + (k - (len(shown) - 1) / 2) * width, vals, width,
                        label=C.IMPL_LABELS.get(i, i), color=colors[i])
          for bb, v in zip(bars, vals):
            if v > 0:
              ax.text(bb.get_x() + bb.get_width() / 2, v, C.fmt_tf(v), ha="center", va="bottom",
                      fontsize=6, rotation=90 if len(shown) > 4 else 0)
        ax.set_xticks(x)
        ax.set_xticklabels([C.seq_label(s) for s in seqs])
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{p}, {'with' if cz else 'without'} causal mask, head dim {h}", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.margins(y=0.15)
    C.shared_legend(fig, axes, ncol=4, fontsize=8)
    fig.suptitle(f"Attention {p} speed (TFLOP/s)")
    fig.tight_layout(rect=(0, 0.08, 1, 0.97))
    files.append(C.save_png(plt, fig, out_dir / C.out_name(f"{STEM}_{p.replace('+', '_')}", tag,
                                                           "png")))
  return files


def summary(data) -> str:
  """A short fixed-width table for the end of a log."""
  cells = attach_ratios([c for c in data.get("cells", []) if "impl" in c])
  lines = ["attention TFLOP/s fwd/bwd/fwd+bwd (xcuDNN fwd+bwd)"]
  for c in sorted(cells, key=lambda c: (c["head_dim"], c["causal"], c["seq"],
                                          _impl_order(cells).index(c["impl"]))):
    t = c.get("tflops") or {}
    r = (c.get("vs_cudnn") or {}).get("fwd+bwd")
    if c.get("status") == "unavailable":
      continue
    txt = (" / ".join(f"{C.fmt_tf(t.get(p)):>4}" for p in C.PASSES) if t
           else (c.get("error") or c.get("fwd_error") or c.get("status", ""))[:50])
    lines.append(f"  d{c['head_dim']:<3} {'c ' if c['causal'] else 'nc'} {C.seq_label(c['seq']):>4} "
                 f"{c['impl']:<15} {txt}{'' if r is None else f'  x{r:.2f}'}")
  return "\n".join(lines)


def main(argv=None):
  return C.script_main(argv, build_parser(), run, render, summary, STEM)


if __name__ == "__main__":
  main()
