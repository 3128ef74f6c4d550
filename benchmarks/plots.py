"""matplotlib helpers shared by the benchmark plots (Agg backend; every plot is optional)."""
from __future__ import annotations

from .report import seq_label


def get_pyplot():
  """matplotlib.pyplot on the Agg backend, or None when matplotlib is missing."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
  except Exception:  # noqa: BLE001 - plots are optional
    return None


def seq_log_axis(ax) -> None:
  """x axis: sequence length on a log-2 scale, ticks as 512 / 1k / ..."""
  from matplotlib.ticker import FuncFormatter
  ax.set_xscale("log", base=2)
  ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: seq_label(int(round(x)))))
  ax.set_xlabel("sequence length")


def shared_legend(fig, axes, *, ncol: int, fontsize: int, loc: str = "lower center") -> None:
  """One legend for all panels, each label once (panels plot overlapping subsets of rows)."""
  handles, labels = [], []
  for ax in getattr(axes, "flat", axes):
    for hnd, lab in zip(*ax.get_legend_handles_labels()):
      if lab not in labels:
        handles.append(hnd)
        labels.append(lab)
  if handles:
    fig.legend(handles, labels, loc=loc, ncol=min(ncol, len(labels)), fontsize=fontsize,
               frameon=False)


def grouped_bar_panels(plt, panels, *, colors, ylabel: str, suptitle: str,
                       panel_size=(7.0, 3.2), extra_height: float = 0.9, rect=(0, 0.07, 1, 0.96)):
  """A figure of grouped-bar panels, two per row, with one shared legend.

  ``panels``: ``(title, tick labels, tick fontsize, series)`` each, ``series`` a list of ``(label,
  colour key, values)`` drawn side by side at each tick; ``colors`` maps colour keys to colours.
  """
  import numpy as np
  ncol = 2 if len(panels) > 1 else 1
  nrow = -(-len(panels) // ncol)
  fig, axes = plt.subplots(nrow, ncol, squeeze=False,
                           figsize=(panel_size[0] * ncol, panel_size[1] * nrow + extra_height))
  for ax, (title, ticks, fontsize, series) in zip(axes.flat, panels):
    width = 0.8 / max(1, len(series))
    x = np.arange(len(ticks))
    for j, (label, key, values) in enumerate(series):
      ax.bar(x + (j - (len(series) - 1) / 2) * width, values, width, color=colors[key], label=label)
    ax.set_xticks(x, ticks, fontsize=fontsize)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
  for ax in list(axes.flat)[len(panels):]:
    ax.axis("off")
  shared_legend(fig, axes, ncol=6, fontsize=8)
  fig.suptitle(suptitle)
  fig.tight_layout(rect=rect)
  return fig


def save_png(plt, fig, path, dpi: int = 110):
  """Write the figure, close it, return the path."""
  fig.savefig(path, dpi=dpi)
  plt.close(fig)
  return path
