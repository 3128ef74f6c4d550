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


def save_png(plt, fig, path, dpi: int = 110):
  """Write the figure, close it, return the path."""
  fig.savefig(path, dpi=dpi)
  plt.close(fig)
  return path
