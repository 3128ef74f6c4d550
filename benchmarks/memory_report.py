"""Markdown, plot and log summary of ``benchmarks.memory`` results."""
from __future__ import annotations

from pathlib import Path

from . import plots
from .report import finite, fmt_bytes, fmt_num, md_table, meta_lines, out_name, seq_label, write_md

STEM = "memory"
DEFAULT_IMPLS = ("fa2", "cudnn", "fa3", "tokamax", "xla")

def _impls(cells):
  out = []
  for i in list(DEFAULT_IMPLS) + [c["impl"] for c in cells]:
    if i not in out and any(c["impl"] == i and c.get("status") != "unavailable" for c in cells):
      out.append(i)
  return out


def _label(cells, name):
  return next((c["label"] for c in cells if c["impl"] == name and c.get("label")), name)


def _total(c):
  return (c.get("compiled") or {}).get("total")


def _peak(c):
  return (c.get("run") or {}).get("peak_minus_before")


def slope(cells, impl, key=_total, min_seq=4096):
  """Log-log slope of bytes against seq (1 = linear, 2 = quadratic)."""
  import numpy as np
  pts = [(c["seq"], key(c)) for c in cells if c["impl"] == impl and finite(key(c)) and key(c) > 0]
  big = [p for p in pts if p[0] >= min_seq]
  pts = big if len(big) >= 2 else pts
  if len(pts) < 2:
    return None
  x = np.log([p[0] for p in pts])
  y = np.log([p[1] for p in pts])
  return float(np.polyfit(x, y, 1)[0])


def render(data, out_dir: Path, tag=None):
  cells = [c for c in data.get("cells", []) if "impl" in c]
  cfg = data.get("config", {})
  meta = data.get("meta", {})
  out_dir = Path(out_dir)
  lines = [f"# Memory of one forward+backward (batch {cfg.get('batch')}, {cfg.get('heads')} heads × "
           f"{cfg.get('head_dim')}, {cfg.get('dtype')}, {'causal' if cfg.get('causal') else 'non-causal'})",
           ""]
  lines += meta_lines(meta)
  lim = meta.get("device_bytes_limit")
  lines += [f"- method: {cfg.get('method')}",
            f"- device allocator limit: {fmt_bytes(lim)}" if lim else "- device limit: unknown",
            "", "Cells: compiled size (arguments + outputs + temporaries) / measured peak; "
            "I/O floor = q, k, v in + dq, dk, dv out. ✗ = failed (see below), "
            "— = not run (too big or --no-run).", ""]
  impls = _impls(cells)
  seqs = sorted({c["seq"] for c in cells})
  rows = []
  floors = {c["seq"]: c.get("io_floor_bytes") for c in cells}
  rows.append(["I/O floor"] + [fmt_bytes(floors.get(s)) for s in seqs])
  for i in impls:
    row = [_label(cells, i)]
    for s in seqs:
      cc = [c for c in cells if c["impl"] == i and c["seq"] == s]
      if not cc:
        row.append("–")
        continue
      c = cc[0]
      if c.get("status") == "skipped":
        row.append("✗" if "compile failed" in (c.get("error") or "") else "skip")
      elif not finite(_total(c)):
        row.append("✗ OOM" if c.get("status") == "oom" else "✗")
      else:
        pk = _peak(c)
        tail = (fmt_bytes(pk) if finite(pk)
                else ("OOM" if c.get("status") == "run_oom" else "—"))
        row.append(f"{fmt_bytes(_total(c))} / {tail}")
    rows.append(row)
  lines.append(md_table(["impl"] + [seq_label(s) for s in seqs], rows))
  lines += ["", "## Growth", ""]
  for i in impls:
    sl = slope(cells, i)
    sp = slope(cells, i, key=_peak)
    kind = ("–" if sl is None else "linear" if sl < 1.3 else "quadratic" if sl > 1.7 else "between")
    lines.append(f"- {_label(cells, i)}: log-log slope of compiled size "
                 f"{fmt_num(sl, '.2f')} ({kind}); of measured peak {fmt_num(sp, '.2f')}")
    ok = [c["seq"] for c in cells if c["impl"] == i and finite(_peak(c))]
    comp_ok = [c["seq"] for c in cells if c["impl"] == i and finite(_total(c))]
    if comp_ok:
      lines.append(f"  - compiles up to seq {seq_label(max(comp_ok))}"
                   + (f", runs up to seq {seq_label(max(ok))}" if ok else ""))
  errs = [c for c in cells if c.get("error") or c.get("run_error")]
  errs = [c for c in errs if c.get("status") not in ("skipped", "unavailable")]
  if errs:
    lines += ["", "## Failures", ""]
    for c in errs:
      lines.append(f"- {c['impl']} seq {seq_label(c['seq'])}: "
                   f"`{(c.get('error') or c.get('run_error'))[:300]}`")
  for n in data.get("notes", []):
    lines.append(f"- note: {n}")
  md = write_md(lines, out_dir, STEM, tag)
  files = [md]
  files += plot(cells, out_dir, tag, lim)
  return files


def plot(cells, out_dir, tag=None, limit=None):
  plt = plots.get_pyplot()
  if plt is None or not cells:
    return []
  fig, ax = plt.subplots(figsize=(7, 5))
  cmap = plt.get_cmap("tab10")
  for k, i in enumerate(_impls(cells)):
    col = cmap(k % 10)
    pts = sorted((c["seq"], _total(c)) for c in cells if c["impl"] == i and finite(_total(c)))
    if pts:
      ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", color=col,
              label=f"{_label(cells, i)} (compiled)")
    pk = sorted((c["seq"], _peak(c)) for c in cells if c["impl"] == i and finite(_peak(c)))
    if pk:
      ax.plot([p[0] for p in pk], [p[1] for p in pk], "x", color=col, markersize=9,
              label=f"{_label(cells, i)} (measured peak)")
  fl = sorted({(c["seq"], c.get("io_floor_bytes")) for c in cells if finite(c.get("io_floor_bytes"))})
  if fl:
    xs = [p[0] for p in fl]
    ax.plot(xs, [p[1] for p in fl], ":", color="gray", label="I/O floor (6 tensors)")
    s0, b0 = fl[0]
    ax.plot(xs, [b0 * (x / s0) for x in xs], "--", color="0.7", lw=0.8, label="∝ seq")
    ax.plot(xs, [b0 * (x / s0) ** 2 for x in xs], "-.", color="0.7", lw=0.8, label="∝ seq²")
  if limit:
    ax.axhline(limit, color="red", lw=0.8, ls="--", label="device limit")
  from matplotlib.ticker import FuncFormatter
  plots.seq_log_axis(ax)
  ax.set_yscale("log", base=2)
  ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: fmt_bytes(y)))
  ax.set_ylabel("device memory")
  ax.grid(alpha=0.3, which="both")
  ax.legend(fontsize=7)
  ax.set_title("Memory of one forward+backward")
  fig.tight_layout()
  return [plots.save_png(plt, fig, Path(out_dir) / out_name(STEM, tag, "png"))]


def summary(data) -> str:
  cells = [c for c in data.get("cells", []) if "impl" in c]
  lines = ["memory fwd+bwd: compiled total / measured peak"]
  for i in _impls(cells):
    parts = []
    for c in sorted((c for c in cells if c["impl"] == i), key=lambda c: c["seq"]):
      t = fmt_bytes(_total(c)) if finite(_total(c)) else c.get("status", "?")
      p = fmt_bytes(_peak(c)) if finite(_peak(c)) else "-"
      parts.append(f"{seq_label(c['seq'])}: {t} / {p}")
    lines.append(f"  {i:<12} slope {fmt_num(slope(cells, i), '.2f')}: " + "; ".join(parts))
  return "\n".join(lines)
