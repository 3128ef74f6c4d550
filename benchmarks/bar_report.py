"""Issue-5 speed bar report: the cells of the bar, measured the anchors' way (scripts/diag/anchor_method.py),
as markdown and a plot beside the bar's reference numbers.

    python3 -m benchmarks.bar_report benchmarks/results/h200/s9/anchor_method_final.json \
        --out benchmarks/results/h200/issue5_bar --command "..." --commit 7f0c2e1

Each cell is the median over the run's rounds; ratios are to cuDNN of the same process. The bar's
reference numbers (../shared/anchors/h200-2026-11-30.md, tokamax "mosaic" fwd+bwd, measured in another
process on another day) are printed beside them for the head_dim-128 cells.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from benchmarks import common as C

# tokamax "mosaic" fwd+bwd TFLOP/s from the anchors (issue 5's minimum bar), head_dim 128
BAR_TOKAMAX = {(2048, False): 477, (8192, False): 505, (16384, False): 537,
               (2048, True): 385, (8192, True): 471, (16384, True): 506}
PASS_KEYS = (("fwd", "fwd"), ("bwd", "bwd"), ("fwdbwd", "fwd+bwd"))


def cells(rows):
  """{(h, t, causal): {impl: (fwd, bwd, fwdbwd) medians over rounds}}, in first-seen order."""
  out: dict = {}
  for r in rows:
    if "fwd" not in r:
      continue
    out.setdefault((r["h"], r["t"], r["causal"]), {}).setdefault(r["impl"], []).append(
        tuple(r[k] for k, _ in PASS_KEYS))
  return {c: {i: tuple(float(np.median(x)) for x in zip(*v)) for i, v in d.items()}
          for c, d in out.items()}


def markdown(data, *, meta, command, commit) -> str:
  table = cells(data["rows"])
  impls = [i for i in ("cudnn", "fa2_mosaic", "fa2_mosaic_det", "tokamax_mosaic", "fa2_mosaic_head",
                       "fa2_mosaic_fused") if any(i in d for d in table.values())]
  lines = ["# Issue 5 speed bar, measured the anchors' way (bf16)", "",
           f"- device: {meta.get('device')}; jax {meta.get('jax')}; fa2_jax commit {commit}",
           f"- command: `{command}`",
           f"- method: {meta.get('method')}; all rows of a cell in one process; cell = median over "
           f"rounds (implementation order reversed every other round)",
           "- shapes: 16k tokens (batch = 16384 / seq), hidden 2048 (16 heads of 128, 32 of 64)", "",
           "Cells: TFLOP/s `fwd / bwd / fwd+bwd`, then fwd+bwd ×cuDNN. `bar` = tokamax mosaic fwd+bwd of "
           "the anchors (another process), the issue's minimum.", "",
           "| head_dim | seq | mask | " + " | ".join(C.IMPL_LABELS.get(i, i) for i in impls) + " | bar |",
           "|---|---|---|" + "---|" * (len(impls) + 1)]
  for (h, t, causal), d in table.items():
    ref = d.get("cudnn", (None, None, None))[2]
    row = [str(h), C.seq_label(t), "causal" if causal else "non-causal"]
    for i in impls:
      if i not in d:
        row.append("✗")
        continue
      f, b, fb = d[i]
      ratio = f" ({fb / ref:.2f}×)" if ref else ""
      row.append(f"{f:.0f} / {b:.0f} / {fb:.0f}{ratio}")
    bar = BAR_TOKAMAX.get((t, causal)) if h == 128 else None
    row.append(str(bar) if bar else "–")
    lines.append("| " + " | ".join(row) + " |")
  return "\n".join(lines) + "\n"


def plot(data, path):
  plt = C.get_pyplot()
  if plt is None:
    return None
  table = cells(data["rows"])
  keys = list(table)
  impls = [i for i in ("cudnn", "fa2_mosaic", "fa2_mosaic_det", "tokamax_mosaic")
           if any(i in d for d in table.values())]
  fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(keys)), 3.6))
  x = np.arange(len(keys))
  w = 0.8 / max(1, len(impls))
  for j, i in enumerate(impls):
    ax.bar(x + j * w, [table[k].get(i, (0, 0, 0))[2] for k in keys], w, label=C.IMPL_LABELS.get(i, i))
  for n, (h, t, causal) in enumerate(keys):
    if h == 128 and (t, causal) in BAR_TOKAMAX:
      ax.hlines(BAR_TOKAMAX[(t, causal)], n - 0.1, n + 0.8, colors="k", linestyles="dashed",
                label="bar (tokamax, anchors)" if n == 0 else None)
  ax.set_xticks(x + 0.4 - w / 2, [f"h{h} {C.seq_label(t)}\n{'causal' if c else 'nc'}"
                                  for h, t, c in keys], fontsize=7)
  ax.set_ylabel("fwd+bwd TFLOP/s")
  ax.legend(fontsize=7, ncol=3, loc="lower right")
  fig.tight_layout()
  return C.save_png(plt, fig, path)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("json", type=Path)
  p.add_argument("--out", type=Path, required=True, help="output stem (.md and .png are added)")
  p.add_argument("--command", default="python3 scripts/diag/anchor_method.py")
  p.add_argument("--commit", default="unknown")
  a = p.parse_args(argv)
  data = json.loads(a.json.read_text())
  if "rows" not in data:
    raise ValueError(f"{a.json}: expected a JSON object with 'rows' (scripts/diag/anchor_method.py)")
  a.out.parent.mkdir(parents=True, exist_ok=True)
  a.out.with_suffix(".md").write_text(markdown(data, meta=data.get("meta", {}), command=a.command,
                                               commit=a.commit))
  png = plot(data, a.out.with_suffix(".png"))
  print(a.out.with_suffix(".md"), png or "(no matplotlib: no plot)")


if __name__ == "__main__":
  main()
