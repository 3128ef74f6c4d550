"""Markdown (bars' verdicts, each cell's rows), plot and log summary of ``benchmarks.variants`` results."""
from __future__ import annotations

from pathlib import Path

from . import plots
from .report import (SMOKE_CAVEAT, finite, fmt_num, fmt_tf, is_smoke, md_table, meta_lines,
                     out_name, ratio, write_md)
from .variant_cells import BARS, COMPARE, KINDS, PASSES

STEM = "variants"
ROW_ORDER = ("fa2", "fa2_dense", "fa2_batch", "fa2_nocap", "fa2_full", "fa2_mask_fn", "fa3", "fa3_varlen",
             "cudnn", "cudnn_batch", "tokamax")  # the plot's colours, the same in every panel


# --- bars' verdicts and comparisons ---------------------------------------------------------------------

def _value(c, measure, p):
  return ((c or {}).get("tflops" if measure == "rate" else "ms") or {}).get(p)


def evaluate(cells) -> list[dict]:
  """Every bar of every measured cell: ``ratio`` and ``ok`` per pass, ``verdict`` pass / fail / n/a
  (pass: every pass measured and within the bar)."""
  out = []
  for cid, by in _by_cell(cells).items():
    kind = next(iter(by.values())).get("kind")
    for bar in BARS.get(kind, []):
      r = {p: ratio(_value(by.get(bar.row), bar.measure, p), _value(by.get(bar.ref), bar.measure, p))
           for p in PASSES}
      ok = {p: None if r[p] is None else bool(r[p] >= bar.threshold if bar.op == ">="
                                              else r[p] <= bar.threshold) for p in PASSES}
      verdict = ("n/a" if all(v is None for v in ok.values()) else
                 "fail" if any(v is False for v in ok.values()) else
                 "pass" if all(ok.values()) else "n/a")
      out.append(dict(cell=cid, kind=kind, text=bar.text, row=bar.row, ref=bar.ref, measure=bar.measure,
                      op=bar.op, threshold=bar.threshold, ratio=r, ok=ok, verdict=verdict))
  return out


def compare(by: dict, kind: str) -> list[tuple[str, str, dict]]:
  """``(row, other, {pass: row's rate ÷ other's})`` for the pairs of COMPARE both measured."""
  got = []
  for a, b in COMPARE.get(kind, []):
    r = {p: ratio(_value(by.get(a), "rate", p), _value(by.get(b), "rate", p)) for p in PASSES}
    if any(v is not None for v in r.values()):
      got.append((a, b, r))
  return got


def _by_cell(cells) -> dict:
  out: dict = {}
  for c in cells:
    out.setdefault(c["id"], {})[c["row"]] = c
  return out


# --- rendering ------------------------------------------------------------------------------------------

def _ms(x) -> str:
  """Milliseconds: three significant digits below 100, whole numbers above."""
  return fmt_num(x, ".3g" if finite(x) and abs(x) < 100 else ".0f")


def _status_text(c) -> str:
  s = c.get("status")
  if s == "ok" or s == "partial" and (c.get("ms") or {}):
    t = (c.get("backend") or "").split(":")[0]
    return " ".join(x for x in (t, "⚠" if c.get("warning") else "", "partial" if s == "partial" else "")
                    if x) or "ok"
  return {"unavailable": "absent", "unsupported": "n/a", "skipped": "skip"}.get(s, "✗")


def _ratio(x) -> str:
  return fmt_num(x, ".2f")


def _pair_text(d, fmt) -> str:
  return " / ".join(fmt((d or {}).get(p)) for p in PASSES)


def _verdict_text(b) -> str:
  passes = ", ".join(f"{p} {fmt_num(b['ratio'][p], '.2f')} {'✓' if b['ok'][p] else '✗'}"
                     for p in PASSES if b["ratio"][p] is not None) or "not measured"
  return f"{b['text']}: {passes} → **{b['verdict']}**"


def _cells(data):
  return [c for c in data.get("cells", []) if "row" in c and "id" in c]


def render(data, out_dir, tag=None):
  cells = _cells(data)
  meta, cfg = data.get("meta", {}), data.get("config", {})
  lines = ["# Attention variants: speed and bars (bf16)", ""] + meta_lines(meta)
  if data.get("merged_from"):
    lines.append("- merged from " + ", ".join(f"`{p}`" for p in data["merged_from"]))
  lines += [
      f"- FLOPs over *attended* (query, key) pairs: {cfg.get('flops', '')}",
      f"- timing: {cfg.get('method', '')}",
      "- cells: ms and TFLOP/s `fwd / fwd+bwd`; fa2 rows name the kernels that ran "
      "(`fa2_jax.backend_for`); absent: implementation not importable here; n/a: shape not supported; "
      "⚠: forward output off the f32 reference"]
  if cfg.get("smoke"):
    lines.append("- smoke size on the CPU (Pallas interpret mode): the numbers check the harness, not the "
                 "speed, and the bars mean nothing here")
  lines.append("")
  bars = evaluate(cells)
  if bars:
    lines += ["## Bars", "", md_table(
        ["cell", "bar", *(f"{p} ratio" for p in PASSES), "verdict"],
        [[b["cell"], b["text"], *(fmt_num(b["ratio"][p], ".2f") for p in PASSES), f"**{b['verdict']}**"]
         for b in bars]), ""]
  by_bar = {}
  for b in bars:
    by_bar.setdefault(b["cell"], []).append(b)
  for cid, by in _by_cell(cells).items():
    first = next(iter(by.values()))
    lines += [f"## {cid}: {first.get('title', '')}", ""]
    if first.get("doc_lengths"):
      lens = first["doc_lengths"]
      lines.append(f"Documents ({len(lens)}): {', '.join(map(str, lens))}" + (
          f"; padded batch width {first['padded_width']}" if first.get("padded_width") else ""))
      lines.append("")
    lines.append(md_table(
        ["row", "call", "shape [B, T]", "ms", "TFLOP/s", "ran"],
        [[f"{c['label']} (`{c['row']}`)", c.get("about", ""), f"[{c.get('batch')}, {c.get('seq')}]",
          _pair_text(c.get("ms"), _ms), _pair_text(c.get("tflops"), fmt_tf), _status_text(c)]
         for c in by.values()]))
    ran = [c["row"] for c in by.values() if c.get("ms")]
    lines += ["", f"- ran: {', '.join(ran) or 'none'}"]
    for a, b, r in compare(by, first.get("kind")):
      lines.append(f"- `{a}` ÷ `{b}` (rate over the same attended pairs): {_pair_text(r, _ratio)}")
    lines += [f"- bar: {_verdict_text(b)}" for b in by_bar.get(cid, [])]
    lines.append("")
  errs: dict = {}
  for c in cells:
    for key in ("error", "fwd_error", "fwd+bwd_error", "check_error", "warning"):
      if c.get(key):
        errs.setdefault((c["row"], key, c[key]), []).append(c["id"])
  if errs:
    lines += ["## Left out, failures and warnings", ""]
    lines += [f"- **{row}** {key} ({', '.join(where)}): `{msg[:300]}`"
              for (row, key, msg), where in errs.items()]
    lines.append("")
  lines += [f"- note: {n}" for n in data.get("notes", [])]
  out_dir = Path(out_dir)
  md = write_md(lines, out_dir, STEM, tag)
  return [md] + plot(cells, out_dir, tag)


def plot(cells, out_dir, tag=None):
  """One PNG: forward+backward TFLOP/s over attended pairs, one panel per kind of cell, a bar per row."""
  plt = plots.get_pyplot()
  by_cell = _by_cell(cells)
  kinds = [k for k in KINDS if any(next(iter(by.values())).get("kind") == k for by in by_cell.values())]
  if plt is None or not kinds:
    return []
  rows = list(dict.fromkeys([r for r in ROW_ORDER if any(c["row"] == r for c in cells)]
                            + [c["row"] for c in cells]))
  cmap = plt.get_cmap("tab20")
  colors = {r: cmap(i % 20) for i, r in enumerate(dict.fromkeys(ROW_ORDER + tuple(rows)))}
  panels = []
  for kind in kinds:
    ids = [cid for cid, by in by_cell.items() if next(iter(by.values())).get("kind") == kind]
    shown = [r for r in rows if any(_value(by_cell[i].get(r), "rate", "fwd+bwd") for i in ids)]
    panels.append((kind, ids, 7, [(r, r, [_value(by_cell[i].get(r), "rate", "fwd+bwd") or 0.0
                                          for i in ids]) for r in shown]))
  fig = plots.grouped_bar_panels(
      plt, panels, colors=colors, ylabel="fwd+bwd TFLOP/s",
      suptitle="Attention variants: forward+backward TFLOP/s over attended pairs (higher is better)")
  return [plots.save_png(plt, fig, Path(out_dir) / out_name(STEM, tag, "png"))]


def summary(data) -> str:
  cells = _cells(data)
  smoke = is_smoke(data)
  lines = [f"{STEM}: ms fwd / fwd+bwd, TFLOP/s over attended pairs fwd / fwd+bwd"
           + (f" ({SMOKE_CAVEAT}; the bars' verdicts mean nothing)" if smoke else "")]
  for c in cells:
    lines.append(f"  {c['id']:<18} {c['row']:<12} "
                 + (f"{_pair_text(c.get('ms'), _ms)} ms  {_pair_text(c.get('tflops'), fmt_tf)} TF"
                    if c.get("ms") else str(c.get("status"))))
  for b in evaluate(cells):
    lines.append(f"  BAR {b['cell']:<18} {b['row']} vs {b['ref']} ({b['measure']} {b['op']} "
                 f"{b['threshold']:g}): " + " ".join(f"{p} {_ratio(b['ratio'][p])}" for p in PASSES)
                 + f" -> {b['verdict']}" + (f" ({SMOKE_CAVEAT})" if smoke else ""))
  return "\n".join(lines)

