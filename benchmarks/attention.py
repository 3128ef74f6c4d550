"""Attention throughput in TFLOP/s, forward and forward+backward, every implementation in one process.

Grids (``--grid``):
  headline (default)  paper + extra: the README's table and plot
  paper               the FlashAttention-2 paper's Figures 4-6: seq 512, 1k, 2k, 4k, 8k, 16k with 16k
                      tokens per call (batch = 16384 / seq), hidden 2048 (head_dim 64: 32 heads; 128: 16
                      heads), causal and not
  extra               shapes of today's models: GQA 32/8 head_dim 128 causal 8k (B=1) and non-causal
                      4k (B=2); head_dim 256 (8 heads) 8k causal and not (B=2); 32k causal (B=1,
                      16 x 128); T=128 queries over S=8k keys (B=16, 16 x 128, non-causal)
  quick               head_dim 64 and 128 at 8k, causal and not
``--smoke`` (automatic without a GPU) runs a few tiny cells in Pallas interpret mode.

Rows (``--impls``, default ``fa2,fa2_det,cudnn,fa3,tokamax,xla``; see benchmarks/impls.py): the ones that
cannot run here (a peer that does not import, no GPU) are left out and named; ``fa2_det`` is measured
only where it is a different program from ``fa2`` (fa2_jax.backend_for); ``xla`` only up to seq 8k.
Each forward output is checked against the f32 reference (⚠ when off).

    python -m benchmarks.attention [--grid headline] [--cells 'd128-*,*-kv8'] [--impls fa2,cudnn]
    python -m benchmarks.attention --list-cells
    python -m benchmarks.attention --merge a/attention.json b/attention.json --out DIR

Cell ids: ``d<head_dim>-<seq>-<c|nc>`` (``t<T>-s<S>`` when they differ; ``-kv<K>`` for GQA), e.g.
``d128-8k-c``, ``d128-8k-c-kv8``, ``d128-t128-s8k-nc``; ``--cells`` takes comma-separated patterns.
Writes attention.json / .md, attention.png (fwd+bwd) and attention_fwd.png (forward).
"""
from __future__ import annotations

import functools
import time

import numpy as np

from . import harness as h
from . import impls
from .timing import attention_flops, matmul_peak

STEM = "attention"
DEFAULT_IMPLS = ("fa2", "fa2_det", "cudnn", "fa3", "tokamax", "xla")
REF_HEADS = 4  # the reference check compares batch 0, the first REF_HEADS query heads
REF_MAX_SCORES = 16384 * 16384  # no reference past T*S = 16k x 16k (its f32 scores: 4 GiB per head)
TOKENS, HIDDEN = 16384, 2048  # the paper's grid: batch = TOKENS // seq, heads = HIDDEN // head_dim
RATIO_TO = {"cudnn": "cuDNN", "fa3": "FA3"}  # every row gets vs_<name>: its TFLOP/s over that row's
SHOWN = ("fwd", "fwd+bwd")
EXTRA = "other shapes"


def make_cell(batch, seq_q, seq_k, heads, kv_heads, head_dim, causal, group=None) -> dict:
  seq = h.seq_label(seq_q) if seq_q == seq_k else f"t{h.seq_label(seq_q)}-s{h.seq_label(seq_k)}"
  cid = f"d{head_dim}-{seq}-{'c' if causal else 'nc'}" + (f"-kv{kv_heads}" if kv_heads != heads else "")
  group = group or f"head_dim {head_dim} ({heads} heads), {'causal' if causal else 'non-causal'}"
  return dict(id=cid, group=group, batch=batch, seq_q=seq_q, seq_k=seq_k, heads=heads,
              kv_heads=kv_heads, head_dim=head_dim, causal=causal)


def paper_cells(seqs=(8192, 2048, 16384, 4096, 1024, 512)) -> list[dict]:
  """Most informative lengths first, so that a budget cut loses the least."""
  return [make_cell(TOKENS // s, s, s, HIDDEN // d, HIDDEN // d, d, c)
          for s in seqs for d in (128, 64) for c in (False, True)]


GRIDS = {
    "paper": paper_cells,
    "extra": lambda: [make_cell(*shape, EXTRA) for shape in (
        (1, 8192, 8192, 32, 8, 128, True), (2, 4096, 4096, 32, 8, 128, False),
        (2, 8192, 8192, 8, 8, 256, True), (2, 8192, 8192, 8, 8, 256, False),
        (1, 32768, 32768, 16, 16, 128, True), (16, 128, 8192, 16, 16, 128, False))],
    "quick": lambda: paper_cells(seqs=(8192,)),
    "smoke": lambda: [make_cell(2, 64, 64, 2, 2, 32, False), make_cell(2, 64, 64, 2, 2, 32, True),
                      make_cell(1, 32, 64, 4, 2, 32, False, EXTRA)],  # CPU, interpret mode
}
GRIDS["headline"] = lambda: GRIDS["paper"]() + GRIDS["extra"]()


def build_parser():
  p = h.script_parser("attention", __doc__)
  p.add_argument("--grid", choices=[g for g in GRIDS if g != "smoke"], default="headline")
  h.add_cell_args(p, "d64-*,d256-*", "print the grid's cell ids and exit")
  p.add_argument("--impls", type=h.impl_names, default=None,
                 help=f"comma list of {', '.join(impls.NAMES)} (default {','.join(DEFAULT_IMPLS)})")
  p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
  p.add_argument("--no-check", action="store_true", help="skip the f32 reference check")
  p.add_argument("--no-matmul", action="store_true", help="skip the bf16 matmul ceiling")
  h.add_common_args(p, counts=True)
  return p


def select_cells(args) -> list[dict]:
  """The grid's cells (``--cells``: those matching a pattern; none matching lists the grid's ids)."""
  grid = "smoke" if args.smoke else "quick" if args.quick else args.grid
  which = "the CPU smoke grid (--smoke, or no GPU)" if grid == "smoke" else f"the {grid} grid"
  return h.select(GRIDS[grid](), args.cells, lambda c: c["id"], f"{which}; its ids")


def cell_key(c):
  return (c.get("id"), c.get("impl"), c.get("dtype"))


def run(args) -> dict:
  import jax
  if args.list_cells:
    for c in select_cells(args):
      print(f"{c['id']:<20} B={c['batch']} T={c['seq_q']} S={c['seq_k']} N={c['heads']} "
            f"K={c['kv_heads']} H={c['head_dim']}")
    return {}
  info = h.device_info()
  h.cpu_fallback(args, info, STEM)
  cells = select_cells(args)
  names, info["absent_impls"] = impls.split_available(args.impls or DEFAULT_IMPLS)
  info["impls"] = {n: impls.get(n).about for n in names}
  run = h.Run(args, STEM, info, dict(
      grid="smoke" if args.smoke else "quick" if args.quick else args.grid, cells=cells, impls=names,
      dtype=args.dtype, iters=args.iters, reps=args.reps,
      method="jit; 2 warm-up calls; median of reps x (iters back-to-back calls, then "
             "block_until_ready), the repetitions of a cell's implementations and passes interleaved "
             "(order rotated each repetition); fwd+bwd = jit(grad(f32 sum of the output)); bwd = "
             "fwd+bwd - fwd"), cell_key, len(cells) * len(names))
  if not args.smoke and not args.no_matmul and "matmul" not in run.rec.data:
    try:
      run.rec.data["matmul"] = matmul_peak()
    except Exception as e:  # noqa: BLE001
      run.rec.data["matmul"] = {"error": h.err_str(e)}
  for ci, cell in enumerate(cells):
    run.bar.set_postfix_str(cell["id"])
    t0, inputs, refs, rows = time.time(), None, {}, {}
    for name in names:
      row = dict(cell, impl=name, dtype=args.dtype, status="ok", flops_fwd=attention_flops(
          cell["batch"], cell["heads"], cell["seq_q"], cell["seq_k"], cell["head_dim"], cell["causal"]))
      if run.skip(row):
        continue
      try:
        if inputs is None:
          inputs = h.random_inputs(args.seed * 1000 + ci, [(cell["batch"], cell["seq_q"], cell["heads"],
                                                            cell["head_dim"])] + [
              (cell["batch"], cell["seq_k"], cell["kv_heads"], cell["head_dim"])] * 2,
              h.jnp_dtype(args.dtype))
        impl, why = impls.get(name), impls.unsupported(name, inputs[0].shape, inputs[1].shape,
                                                       inputs[0].dtype, cell["causal"])
        if impl.describe is not None and not why:
          backend = impl.describe(*inputs, causal=cell["causal"])
          if name == "fa2_det" and impls.get("fa2").describe(*inputs, causal=cell["causal"]).deterministic:
            run.add(dict(row, status="same", same_as="fa2", note="fa2's default backward is already "
                         "deterministic here: the same program"), check=False)
            continue
          row["backend"] = str(backend)
        if why:
          run.add(dict(row, status="skipped" if why.startswith("skipped") else "unsupported", error=why),
                  check=False)
          continue
        rows[name] = (row, functools.partial(impl, causal=cell["causal"]), inputs)
      except Exception as e:  # noqa: BLE001
        run.add(dict(row, status="error", error=h.err_str(e)))

    def check(name, out, cell=cell, inputs=inputs, refs=refs):
      if args.no_check or cell["seq_q"] * cell["seq_k"] > REF_MAX_SCORES:
        return None
      if not refs:
        refs[0] = h.reference(*inputs, REF_HEADS, is_causal=cell["causal"])
      return h.rel_err(out, *refs[0])

    if rows:
      run.together(rows, iters=args.iters, reps=args.reps, check=check, t0=t0)
    del inputs, refs, rows, check
    jax.clear_caches()  # compiled programs of this cell's shapes are not used again
  attach_ratios(run.rec.cells)
  return run.finish(render, summary)


# --- report -----------------------------------------------------------------------------------------

def attach_ratios(cells):
  """Add ``vs_cudnn`` and ``vs_fa3`` ({pass: TFLOP/s over that implementation's on the same cell})."""
  refs = {(c.get("impl"), c.get("id"), c.get("dtype")): c.get("tflops") or {} for c in cells}
  for c in cells:
    for name in RATIO_TO:
      ref = refs.get((name, c.get("id"), c.get("dtype")), {})
      c[f"vs_{name}"] = {p: h.ratio((c.get("tflops") or {}).get(p), ref.get(p))
                         for p in ("fwd", "bwd", "fwd+bwd")}
  return cells


def cells_of(data) -> list[dict]:
  """A result's cells with their ratios, also from the earlier harness's files (one ``seq``; or
  ``rows`` of per-round rates, of which each (shape, implementation) gets the median)."""
  cells = list(data.get("cells") or [])
  by: dict = {}
  for r in data.get("rows") or []:
    by.setdefault((r["impl"], r["b"], r["n"], r["t"], r["h"], r["causal"]), []).append(r)
  cells += [dict(impl=k[0], batch=k[1], heads=k[2], seq=k[3], head_dim=k[4], causal=k[5], dtype="bf16",
                 status="ok", tflops={p: float(np.median([r[f] for r in rs])) for p, f in (
                     ("fwd", "fwd"), ("bwd", "bwd"), ("fwd+bwd", "fwdbwd"))}) for k, rs in by.items()]
  return attach_ratios([c if "id" in c else dict(make_cell(
      c["batch"], c["seq"], c["seq"], c["heads"], c["heads"], c["head_dim"], c["causal"]), **c)
      for c in cells if "impl" in c])


def groups(cells) -> dict:
  """Group name -> its cells, one column each: the paper's groups by head_dim, non-causal first,
  columns by sequence length; other groups after them, cells in the order measured."""
  out: dict = {}
  for c in cells:
    out.setdefault(c["group"], {}).setdefault(c["id"], c)
  paper = lambda g: g.startswith("head_dim")  # noqa: E731
  first = lambda g: next(iter(out[g].values()))  # noqa: E731
  return {g: sorted(out[g].values(), key=lambda c: c["seq_q"]) if paper(g) else list(out[g].values())
          for g in sorted(out, key=lambda g: (not paper(g), first(g)["head_dim"] if paper(g) else 0,
                                              first(g)["causal"] if paper(g) else False, g))}


def cell_label(c, tick: bool = False) -> str:
  """``h128 8k causal (B=2)``, other head counts and GQA named; ``tick``: a plot's tick label, on
  several short lines, only sequence and batch in the paper's groups (the panel names the rest)."""
  seq = h.seq_label(c["seq_q"]) if c["seq_q"] == c["seq_k"] else (
      f"T={h.seq_label(c['seq_q'])} S={h.seq_label(c['seq_k'])}")
  extra = [f"B={c['batch']}"] + ([f"GQA {c['heads']}/{c['kv_heads']}"] if c["kv_heads"] != c["heads"]
                                 else [f"N={c['heads']}"] if c["heads"] * c["head_dim"] != HIDDEN else [])
  if tick and c["group"].startswith("head_dim"):
    return f"{seq}\n({', '.join(extra)})"
  parts = [f"h{c['head_dim']} {seq}", "causal" if c["causal"] else "non-causal"]
  return "\n".join(parts + extra) if tick else " ".join(parts) + f" ({', '.join(extra)})"


def cell_text(c) -> str:
  if c is None:
    return "–"
  status = c.get("status")
  if status in ("same", "skipped", "unsupported"):
    return {"same": "=", "skipped": "skip", "unsupported": "n/a"}[status]
  if "crash" in (c.get("error") or ""):
    return "✗ crash"
  t = c.get("tflops") or {}
  if not any(t.get(p) is not None for p in SHOWN):
    return "✗"
  return h.pair(t, h.fmt_tf) + (" ⚠" if c.get("warning") else "")


def table(cells) -> str:
  """A row per cell (grouped), a column per implementation, then fa2_jax's ratios; ``fwd / fwd+bwd``."""
  names = h.ordered(c["impl"] for c in cells if c.get("status") != "unavailable")
  by = {(c["impl"], c["id"]): c for c in cells}
  ratios = [(n, label) for n, label in RATIO_TO.items() if n in names and "fa2" in names]
  return h.md_table(
      ["cell"] + [h.style(n)[0] for n in names] + [f"fa2_jax ÷ {label}" for _, label in ratios],
      [[cell_label(g)] + [cell_text(by.get((n, g["id"]))) for n in names]
       + [h.pair((by.get(("fa2", g["id"])) or {}).get(f"vs_{n}"), h.fmt_ratio)
          for n, _ in ratios] for cs in groups(cells).values() for g in cs])


def render(data, base):
  cells, cfg = cells_of(data), data.get("config", {})
  lines = h.header(data, f"Attention throughput ({cfg.get('dtype', 'bf16')})")
  mm = data.get("matmul") or {}
  if mm.get("tflops"):
    lines.append(f"- dense bf16 matmul 8192³ on this device: {mm['tflops']:.0f} TFLOP/s")
  lines += ["- FLOPs: forward 4·B·N·T·S·H (halved when causal), forward+backward 3.5× that",
            f"- timing: {cfg.get('method', '')}", "",
            "Cells: TFLOP/s `fwd / fwd+bwd`; `=`: the same program as the fa2_jax column; n/a: shape "
            "not supported by that implementation; skip: left out (see below); ✗: failed; ⚠: output "
            "off the f32 reference. `fa2_jax ÷ X`: fa2_jax's TFLOP/s over X's in the same cell.",
            "", table(cells), ""]
  lines += h.failures(cells, lambda c: h.style(c["impl"])[0], lambda c: c["id"])
  lines += [f"- note: {n}" for n in data.get("notes", [])]
  backends = {c["id"]: c["backend"] for c in cells if c["impl"] == "fa2" and c.get("backend")}
  if backends:
    lines += ["", "fa2_jax ran (`fa2_jax.backend_for`): " + "; ".join(
        f"{k}: {v.split(':')[0]}" for k, v in backends.items())]
  return [h.write_md(lines, base)] + plot(data, cells, base, "fwd+bwd") + plot(data, cells, base, "fwd")


def plot(data, cells, base, pass_: str):
  """Grouped bars of one pass's TFLOP/s, a panel per group of cells (``<base>.png`` for fwd+bwd,
  ``<base>_fwd.png`` for the forward)."""
  plt, grouped = h.pyplot(), groups(cells)
  if plt is None or not grouped:
    return []
  by = {(c["impl"], c["id"]): c for c in cells}
  value = lambda n, g: ((by.get((n, g["id"])) or {}).get("tflops") or {}).get(pass_)  # noqa: E731
  panels = [(group, [cell_label(g, tick=True) for g in gcells],
             [(n, [value(n, g) or 0.0 for g in gcells])
              for n in h.ordered(c["impl"] for c in cells) if any(value(n, g) for g in gcells)])
            for group, gcells in grouped.items()]
  fig = h.bar_panels(plt, panels, ylabel=f"{pass_} TFLOP/s")
  what = "forward+backward" if pass_ == "fwd+bwd" else "forward"
  dtype = data.get("config", {}).get("dtype", "bf16")
  return h.save(plt, fig, base, data, f"Attention {what} TFLOP/s, {dtype} (higher is better)",
                "" if pass_ == "fwd+bwd" else "_fwd")


def summary(data) -> str:
  """Fixed-width lines for the end of a log: one per cell and implementation."""
  cells = cells_of(data)
  has_cudnn = any(c["impl"] == "cudnn" and c.get("tflops") for c in cells)
  lines = [f"{STEM} TFLOP/s fwd / fwd+bwd" + (" (fwd+bwd x cuDNN)" if has_cudnn else "")
           + (f" ({h.SMOKE_CAVEAT})" if h.is_smoke(data) else "")]
  for c in sorted(cells, key=lambda c: (c["group"], c["id"], h.rank(c["impl"]))):
    r = (c.get("vs_cudnn") or {}).get("fwd+bwd")
    lines.append(f"  {c['id']:<18} {c['impl']:<10} {cell_text(c) if c.get('tflops') else c.get('status')}"
                 + (f"  x{r:.2f}" if r is not None and has_cudnn else ""))
  return "\n".join(lines)


def main(argv=None):
  return h.script_main(argv, build_parser(), run, render, summary, STEM, cell_key)


if __name__ == "__main__":
  main()
