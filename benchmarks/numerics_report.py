"""Markdown, plot and log summary of ``benchmarks.numerics`` results, and the answer to its question."""
from __future__ import annotations

from pathlib import Path

from . import plots
from .report import finite, fmt_num, md_table, meta_lines, out_name, seq_label, write_md

STEM = "numerics"
DTYPE_NAMES = ["bf16", "fp16", "fp32"]
IMPLS = ["fa2", "fa2_triton", "fa2_normstep", "fa2_atomic_dq", "xla"]
QUANTS = ("out", "lse", "dq", "dk", "dv")
LABELS = {"fa2": "fa2_jax (default backend)", "fa2_triton": "fa2_jax triton",
          "fa2_normstep": "triton, normalise every step (FA1-style)",
          "fa2_atomic_dq": "triton, atomic dQ", "xla": "XLA formula, same dtype"}

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
                    if c["impl"] == "fa2" and finite(_err(c, "out")))
      if len(ours) < 2:
        continue
      (s0, e0), (s1, e1) = ours[0], ours[-1]
      xla = {c["seq"]: _err(c, "out") for c in sub if c["impl"] == "xla"}
      nrm = {c["seq"]: _err(c, "out") for c in sub if c["impl"] == "fa2_normstep"}
      lse = {c["seq"]: _err(c, "lse") for c in sub if c["impl"] == "fa2"}
      txt = (f"- {dt}, {'causal' if cz else 'non-causal'}: fa2_jax out rel-L2 {e0:.2e} at "
             f"{seq_label(s0)} → {e1:.2e} at {seq_label(s1)} (×{e1 / e0:.2f})")
      verdict_ok = True
      if finite(xla.get(s0)) and finite(xla.get(s1)):
        g_x = xla[s1] / xla[s0]
        txt += (f"; the {dt} XLA formula {xla[s0]:.2e} → {xla[s1]:.2e} (×{g_x:.2f}); "
                f"fa2/XLA at {seq_label(s1)}: {e1 / xla[s1]:.2f}")
        verdict_ok &= e1 <= 1.5 * xla[s1] and e1 / e0 <= max(2.0, 1.5 * g_x)
      if finite(nrm.get(s1)):
        txt += f"; per-step normalisation at {seq_label(s1)}: {nrm[s1]:.2e} (ratio {e1 / nrm[s1]:.2f})"
        verdict_ok &= e1 <= 1.5 * nrm[s1]
      if finite(lse.get(s0)) and finite(lse.get(s1)):
        txt += f"; lse rel-L2 {lse[s0]:.1e} → {lse[s1]:.1e}"
      txt += (". **No loss** from the unscaled accumulator at this length." if verdict_ok else
              ". **Possible loss**: the error grows faster than the same-precision formula's "
              "(or than per-step normalisation) — look closer.")
      lines.append(txt)
  if not lines:
    lines.append("- not enough measurements (needs fa2 at two or more lengths).")
  return lines


def render(data, out_dir: Path, tag=None):
  cells = [c for c in data.get("cells", []) if "impl" in c]
  cfg = data.get("config", {})
  out_dir = Path(out_dir)
  lines = ["# Numerical error vs a float64 reference", ""]
  lines += meta_lines(data.get("meta", {}))
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
            elif finite(r):
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
        lines.append(md_table(["dtype", "impl"] + [seq_label(s) for s in seqs], rows))
        lines.append("")
  refs = data.get("references") or []
  if refs:
    lines.append("Reference time: " + ", ".join(
        f"{seq_label(r['seq'])}{'c' if r['causal'] else ''} {r['seconds']:.1f} s" for r in refs))
  errs = {}
  for c in cells:
    if c.get("error") and c.get("status") != "skipped":
      errs.setdefault((c["impl"], c["error"]), []).append(f"{c['dtype']}/{seq_label(c['seq'])}")
  if errs:
    lines += ["", "## Failures", ""]
    lines += [f"- {i} ({', '.join(w[:6])}{'…' if len(w) > 6 else ''}): `{e[:300]}`"
              for (i, e), w in errs.items()]
  md = write_md(lines, out_dir, STEM, tag)
  return [md] + plot(cells, out_dir, tag)


def plot(cells, out_dir, tag=None):
  plt = plots.get_pyplot()
  if plt is None or not cells:
    return []
  causals = sorted({c["causal"] for c in cells})
  fig, axes = plt.subplots(len(causals), len(QUANTS), figsize=(4 * len(QUANTS), 3.6 * len(causals)),
                           squeeze=False)
  colors = {"bf16": "tab:blue", "fp16": "tab:orange", "fp32": "tab:green"}
  styles = {"fa2": "-d", "fa2_triton": "-o", "fa2_atomic_dq": "-s", "fa2_normstep": "--^",
            "xla": ":x"}
  for r, cz in enumerate(causals):
    for col, q in enumerate(QUANTS):
      ax = axes[r][col]
      for dt in DTYPE_NAMES:
        for i in _impls(cells):
          pts = sorted((c["seq"], _err(c, q)) for c in cells if c["causal"] == cz
                       and c["dtype"] == dt and c["impl"] == i and finite(_err(c, q)))
          if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], styles.get(i, "-"),
                    color=colors.get(dt), ms=4, lw=1, label=f"{dt} {i}")
      plots.seq_log_axis(ax)
      ax.set_yscale("log")
      ax.set_title(f"{q}, {'causal' if cz else 'non-causal'}", fontsize=9)
      if col == 0:
        ax.set_ylabel("relative L2 error")
      ax.grid(alpha=0.3, which="both")
  plots.shared_legend(fig, axes, ncol=6, fontsize=7)
  fig.suptitle("Error vs float64 reference")
  fig.tight_layout(rect=(0, 0.1, 1, 0.96))
  return [plots.save_png(plt, fig, Path(out_dir) / out_name(STEM, tag, "png"), dpi=100)]


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
        vals = " ".join(f"{seq_label(c['seq'])}:{fmt_num(_err(c, 'out'), '.1e')}"
                        f"({fmt_num(_err(c, 'dq'), '.0e')})" for c in sub)
        lines.append(f"  {'c ' if cz else 'nc'} {dt} {i:<14} {vals}")
  lines += [x[:300] for x in answer(cells)]
  return "\n".join(lines)
