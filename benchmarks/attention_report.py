"""Markdown table, plot and log summary of ``benchmarks.attention`` results."""
from __future__ import annotations

from pathlib import Path

from . import plots
from .flops import PASSES
from .report import (SMOKE_CAVEAT, fmt_num, fmt_tf, is_smoke, md_table, meta_lines, out_name, ratio,
                     seq_label, write_md)

STEM = "attention"
ROW_ORDER = ("fa2", "fa2_det", "fa2_triton", "cudnn", "fa3", "tokamax", "xla")
RATIO_TO = {"cudnn": "cuDNN", "fa3": "FA3"}  # every cell gets vs_<name>: its TFLOP/s over that row's
SHOWN = ("fwd", "fwd+bwd")


def attach_ratios(cells):
  """Add ``vs_cudnn`` and ``vs_fa3`` ({pass: TFLOP/s over that implementation's on the same cell})."""
  refs = {name: {(c.get("id"), c.get("dtype")): c for c in cells if c.get("impl") == name}
          for name in RATIO_TO}
  for c in cells:
    for name in RATIO_TO:
      ref = refs[name].get((c.get("id"), c.get("dtype")))
      c[f"vs_{name}"] = {p: ratio((c.get("tflops") or {}).get(p), ((ref or {}).get("tflops") or {}).get(p))
                         for p in PASSES}
  return cells


def _order(cells):
  names = list(dict.fromkeys([n for n in ROW_ORDER if any(c["impl"] == n for c in cells)]
                             + [c["impl"] for c in cells]))
  return names


def _groups(cells):
  """Group name -> the group's cells (one column each). The paper's groups by head_dim, non-causal
  first, their columns by sequence length; other groups after them, cells in the order measured."""
  out: dict = {}
  for c in cells:
    out.setdefault(c["group"], {}).setdefault(c["id"], c)

  def order(g):
    c, paper = next(iter(out[g].values())), g.startswith("head_dim")
    return (not paper, c["head_dim"] if paper else 0, c["causal"] if paper else False, g)

  return {g: sorted(out[g].values(), key=lambda c: c["seq_q"]) if g.startswith("head_dim")
          else list(out[g].values()) for g in sorted(out, key=order)}


def column_label(c) -> str:
  seq = seq_label(c["seq_q"]) if c["seq_q"] == c["seq_k"] else (
      f"T={seq_label(c['seq_q'])} S={seq_label(c['seq_k'])}")
  if c["group"].startswith("head_dim"):
    return f"{seq} (B={c['batch']})"
  heads = f"GQA {c['heads']}/{c['kv_heads']}" if c["kv_heads"] != c["heads"] else f"N={c['heads']}"
  return f"d{c['head_dim']} {seq} {'causal' if c['causal'] else 'non-causal'} (B={c['batch']}, {heads})"


def cell_text(c) -> str:
  if c is None:
    return "–"
  status = c.get("status")
  if status == "same":
    return f"= {c.get('same_as')}"
  if status == "skipped":
    return "skip"
  if status == "unsupported":
    return "n/a"
  if "crash" in (c.get("error") or ""):
    return "✗ crash"
  t = c.get("tflops") or {}
  if not any(t.get(p) is not None for p in SHOWN):
    return "✗"
  return " / ".join(fmt_tf(t.get(p)) for p in SHOWN) + (" ⚠" if c.get("warning") else "")


def _ratio_text(c, name) -> str | None:
  r = (c or {}).get(f"vs_{name}") or {}
  if not any(r.get(p) is not None for p in SHOWN):
    return None
  return " / ".join(fmt_num(r.get(p), ".2f") for p in SHOWN)


def table(cells, group_cells) -> str:
  """Rows: implementations, then fa2's ratio rows; columns: the group's cells; ``fwd / fwd+bwd``."""
  by = {(c["impl"], c["id"]): c for c in cells}
  rows = []
  for name in _order(cells):
    got = [by.get((name, g["id"])) for g in group_cells]
    if all(c is None or c.get("status") == "unavailable" for c in got):
      continue
    rows.append([next(c["label"] for c in got if c) + f" (`{name}`)"] + [cell_text(c) for c in got])
  for name, label in RATIO_TO.items():
    texts = [_ratio_text(by.get(("fa2", g["id"])), name) for g in group_cells]
    if any(texts):
      rows.append([f"fa2 ÷ {label}"] + [t or "–" for t in texts])
  return md_table(["impl"] + [column_label(g) for g in group_cells], rows)


def row_label(c) -> str:
  """A cell as one line of the overview: ``h128 causal 8k (B=2)``, GQA and other head counts named."""
  seq = seq_label(c["seq_q"]) if c["seq_q"] == c["seq_k"] else (
      f"T={seq_label(c['seq_q'])}, S={seq_label(c['seq_k'])}")
  extra = [f"B={c['batch']}"]
  if c["kv_heads"] != c["heads"]:
    extra.append(f"GQA {c['heads']}/{c['kv_heads']}")
  elif c["heads"] * c["head_dim"] != 2048:  # the paper's grid: hidden 2048
    extra.append(f"N={c['heads']}")
  return (f"h{c['head_dim']} {'causal' if c['causal'] else 'non-causal'} {seq} "
          f"({', '.join(extra)})")


def overview(cells) -> str:
  """One table for the whole run (the README's): a row per cell, a column per implementation
  (``fwd / fwd+bwd``), then fa2's fwd+bwd over cuDNN's and FA3's."""
  names = [n for n in _order(cells) if any(c["impl"] == n and c.get("status") != "unavailable"
                                           for c in cells)]
  labels = {n: next(c["label"] for c in cells if c["impl"] == n) for n in names}
  by = {(c["impl"], c["id"]): c for c in cells}
  ratios = [(name, label) for name, label in RATIO_TO.items() if name in names]
  rows = []
  for group_cells in _groups(cells).values():
    for g in group_cells:
      row = [row_label(g)]
      for n in names:
        c = by.get((n, g["id"]))
        row.append("=" if (c or {}).get("status") == "same" else cell_text(c))
      fa2 = by.get(("fa2", g["id"])) or {}
      row += [fmt_num((fa2.get(f"vs_{name}") or {}).get("fwd+bwd"), ".2f") for name, _ in ratios]
      rows.append(row)
  head = (["cell"] + [f"{labels[n]} (`{n}`)" for n in names]
          + [f"fa2 ÷ {label}, fwd+bwd" for _, label in ratios])
  return md_table(head, rows)


def render(data, out_dir, tag=None):
  cells = attach_ratios([c for c in data.get("cells", []) if "impl" in c and "group" in c])
  cfg = data.get("config", {})
  meta = data.get("meta", {})
  lines = [f"# Attention throughput ({cfg.get('dtype', 'bf16')})", ""] + meta_lines(meta)
  if data.get("merged_from"):
    lines.append("- merged from these runs (each cell's `source` in the JSON; ratios compare rows of "
                 "one run); the lines above are the last one's:")
    metas = list(data.get("merged_meta") or []) + [meta]
    for path, m in zip(data["merged_from"], metas if len(metas) == len(data["merged_from"]) else []):
      m = m or {}
      lines.append(f"  - `{path}`: fa2_jax commit {m.get('git_commit') or '–'}, {m.get('timestamp')}, "
                   f"`{m.get('parent_command') or m.get('command')}`")
  mm = data.get("matmul") or {}
  if mm.get("tflops"):
    lines.append(f"- dense bf16 matmul 8192³ on this device: {mm['tflops']:.0f} TFLOP/s")
  lines += [
      "- FLOPs: forward 4·B·N·T·S·H (halved when causal), forward+backward 3.5× that",
      f"- timing: {cfg.get('method', '')}"]
  if is_smoke(data):
    lines.append("- smoke size on the CPU (Pallas interpret mode): the numbers check the harness, not "
                 "the speed, and the ratios mean nothing here")
  lines += [
      "",
      "Cells: TFLOP/s `fwd / fwd+bwd`; `= fa2`: the same program as the fa2 row; n/a: shape not "
      "supported by that implementation; skip: left out (see below); ✗: failed; ⚠: output off the "
      "f32 reference."]
  present = [label for name, label in RATIO_TO.items() if any(c["impl"] == name for c in cells)]
  if present:
    lines.append("`fa2 ÷ X` rows: fa2's TFLOP/s over X's on the same cell (`fwd / fwd+bwd`).")
  lines += ["", "## Overview", "", "`=`: the same program as the fa2 column.", "", overview(cells), ""]
  for group, gcells in _groups(cells).items():
    lines += [f"## {group}", "", table(cells, gcells), ""]
  errs: dict = {}
  for c in cells:
    for key in ("error", "fwd_error", "fwd+bwd_error", "warning"):
      if c.get(key):
        errs.setdefault((c["impl"], key, c[key]), []).append(c["id"])
  if errs:
    lines += ["## Left out, failures and warnings", ""]
    lines += [f"- **{impl}** {key} ({', '.join(where)}): `{msg[:300]}`"
              for (impl, key, msg), where in errs.items()]
    lines.append("")
  lines += [f"- note: {n}" for n in data.get("notes", [])]
  backends = {c["id"]: c["backend"] for c in cells if c["impl"] == "fa2" and c.get("backend")}
  if backends:
    lines += ["", "fa2 ran (`fa2_jax.backend_for`): " + "; ".join(
        f"{k}: {v.split(':')[0]}" for k, v in backends.items())]
  out_dir = Path(out_dir)
  md = write_md(lines, out_dir, STEM, tag)
  return [md] + plot(cells, out_dir, tag)


def plot(cells, out_dir, tag=None):
  """One PNG: forward+backward TFLOP/s as grouped bars, one panel per group of cells."""
  plt = plots.get_pyplot()
  groups = _groups(cells)
  if plt is None or not groups:
    return []
  names = _order(cells)
  cmap = plt.get_cmap("tab10")
  colors = {n: cmap(i % 10) for i, n in enumerate(ROW_ORDER + tuple(x for x in names
                                                                    if x not in ROW_ORDER))}
  by = {(c["impl"], c["id"]): c for c in cells}

  def fwd_bwd(n, g):
    return ((by.get((n, g["id"])) or {}).get("tflops") or {}).get("fwd+bwd")

  panels = []
  for group, gcells in groups.items():
    shown = [n for n in names if any(fwd_bwd(n, g) for g in gcells)]
    series = [(next(by[(n, g["id"])]["label"] for g in gcells if (n, g["id"]) in by), n,
               [fwd_bwd(n, g) or 0.0 for g in gcells]) for n in shown]
    panels.append((group, [column_label(g).replace(" (", "\n(") for g in gcells],
                   7 if group.startswith("head_dim") else 6, series))
  fig = plots.grouped_bar_panels(
      plt, panels, colors=colors, ylabel="fwd+bwd TFLOP/s",
      suptitle="Attention forward+backward throughput (TFLOP/s, higher is better)",
      panel_size=(7.5, 3.4), extra_height=0.8, rect=(0, 0.05, 1, 0.97))
  return [plots.save_png(plt, fig, Path(out_dir) / out_name(STEM, tag, "png"))]


def summary(data) -> str:
  """Fixed-width lines for the end of a log: one per cell and implementation."""
  cells = attach_ratios([c for c in data.get("cells", []) if "impl" in c and "group" in c])
  has_cudnn = any(c["impl"] == "cudnn" and c.get("tflops") for c in cells)
  lines = [f"{STEM} TFLOP/s fwd / fwd+bwd" + (" (fwd+bwd x cuDNN)" if has_cudnn else "")
           + (f" ({SMOKE_CAVEAT})" if is_smoke(data) else "")]
  order = _order(cells)
  for c in sorted(cells, key=lambda c: (c["group"], c["id"], order.index(c["impl"]))):
    r = (c.get("vs_cudnn") or {}).get("fwd+bwd")
    lines.append(f"  {c['id']:<18} {c['impl']:<10} {cell_text(c) if c.get('tflops') else c.get('status')}"
                 + (f"  x{r:.2f}" if r is not None and has_cudnn else ""))
  return "\n".join(lines)
