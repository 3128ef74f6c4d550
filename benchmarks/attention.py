"""Attention throughput in TFLOP/s, forward and forward+backward, every implementation in one process.

Grids (``--grid``):
  headline (default)  paper + extra: the README's table and plot
  paper               the FlashAttention-2 paper's Figures 4-6: seq 512, 1k, 2k, 4k, 8k, 16k with 16k
                      tokens per call (batch = 16384 / seq), hidden 2048 (head_dim 64: 32 heads; 128: 16
                      heads), causal and not
  extra               GQA 32/8 head_dim 128 causal 8k (B=1) and non-causal 4k (B=2); head_dim 256 (8
                      heads) 8k causal and not (B=2); 32k causal (B=1, 16 x 128); T=128 S=8k (B=16,
                      16 x 128, non-causal)
  quick               head_dim 64 and 128 at 8k, causal and not
``--smoke`` (automatic without a GPU) runs a few tiny cells in Pallas interpret mode.

Rows (``--impls``, default ``fa2,fa2_det,cudnn,fa3,tokamax,xla``; see benchmarks/impls.py): the ones that
cannot run here (a peer that does not import, no GPU) are left out and named; ``fa2_det`` is measured
only where it is a different program from ``fa2`` (fa2_jax.backend_for); ``xla`` only up to seq 8k.

    python -m benchmarks.attention [--grid headline] [--cells 'd128-*,*-kv8'] [--impls fa2,cudnn]
    python -m benchmarks.attention --list-cells
    python -m benchmarks.attention --merge a/attention.json b/attention.json --out DIR

Cell ids: ``d<head_dim>-<seq>-<c|nc>`` (``t<T>-s<S>`` when they differ; ``-kv<K>`` for GQA), e.g.
``d128-8k-c``, ``d128-8k-c-kv8``, ``d128-t128-s8k-nc``; ``--cells`` takes comma-separated patterns.
Timing and FLOPs: benchmarks/timing.py and benchmarks/flops.py.
"""
from __future__ import annotations

import argparse
import fnmatch
import functools
import time

from . import cli, impls
from .attention_report import attach_ratios, render, summary
from .device import device_info
from .flops import attention_flops
from .recorder import Recorder, check_device, simulated_crash_hook
from .report import err_str, out_name, seq_label
from .timing import ITERS, REPS, WARMUP, matmul_peak, measure_together

STEM = "attention"
DEFAULT_IMPLS = ("fa2", "fa2_det", "cudnn", "fa3", "tokamax", "xla")
REL_ERR_WARN = 2e-2  # forward output vs the f32 reference: a fast row must also be a right one
REF_HEADS = 4  # the reference check compares batch 0, the first REF_HEADS query heads
REF_MAX_SCORES = 16384 * 16384  # no reference past T*S = 16k x 16k (its f32 scores: 4 GiB per head)
TOKENS, HIDDEN = 16384, 2048  # the paper's grid: batch = TOKENS // seq, heads = HIDDEN // head_dim


def make_cell(batch, seq_q, seq_k, heads, kv_heads, head_dim, causal, group=None) -> dict:
  seq = seq_label(seq_q) if seq_q == seq_k else f"t{seq_label(seq_q)}-s{seq_label(seq_k)}"
  cid = f"d{head_dim}-{seq}-{'c' if causal else 'nc'}" + (f"-kv{kv_heads}" if kv_heads != heads else "")
  group = group or f"head_dim {head_dim} ({heads} heads), {'causal' if causal else 'non-causal'}"
  return dict(id=cid, group=group, batch=batch, seq_q=seq_q, seq_k=seq_k, heads=heads,
              kv_heads=kv_heads, head_dim=head_dim, causal=causal)


def paper_cells(seqs=(8192, 2048, 16384, 4096, 1024, 512)) -> list[dict]:
  """Most informative lengths first, so that a budget cut loses the least."""
  return [make_cell(TOKENS // s, s, s, HIDDEN // h, HIDDEN // h, h, c)
          for s in seqs for h in (128, 64) for c in (False, True)]


EXTRA = "other shapes"
GRIDS = {
    "paper": paper_cells,
    "extra": lambda: [
        make_cell(1, 8192, 8192, 32, 8, 128, True, EXTRA),
        make_cell(2, 4096, 4096, 32, 8, 128, False, EXTRA),
        make_cell(2, 8192, 8192, 8, 8, 256, True, EXTRA),
        make_cell(2, 8192, 8192, 8, 8, 256, False, EXTRA),
        make_cell(1, 32768, 32768, 16, 16, 128, True, EXTRA),
        make_cell(16, 128, 8192, 16, 16, 128, False, EXTRA),
    ],
    "quick": lambda: paper_cells(seqs=(8192,)),
    "smoke": lambda: [  # CPU, interpret mode: seconds per cell
        make_cell(2, 64, 64, 2, 2, 32, False),
        make_cell(2, 64, 64, 2, 2, 32, True),
        make_cell(1, 32, 64, 4, 2, 32, False, EXTRA),
    ],
}
GRIDS["headline"] = lambda: GRIDS["paper"]() + GRIDS["extra"]()


def build_parser():
  p = argparse.ArgumentParser(prog="python -m benchmarks.attention", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--grid", choices=[g for g in GRIDS if g != "smoke"], default="headline")
  p.add_argument("--cells", type=cli.parse_strs, default=None,
                 help="only the cells whose id matches one of these patterns, e.g. 'd64-*,d256-*'")
  p.add_argument("--list-cells", action="store_true", help="print the grid's cell ids and exit")
  p.add_argument("--impls", type=cli.impl_names, default=None,
                 help=f"comma list of {', '.join(impls.NAMES)} (default {','.join(DEFAULT_IMPLS)})")
  p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
  p.add_argument("--iters", type=cli.positive_int, default=ITERS,
                 help=f"back-to-back calls per repetition (--smoke: {cli.SMOKE_ITERS})")
  p.add_argument("--reps", type=cli.positive_int, default=REPS,
                 help=f"repetitions, median taken (--smoke: {cli.SMOKE_REPS})")
  p.add_argument("--no-check", action="store_true", help="skip the f32 reference check")
  p.add_argument("--no-matmul", action="store_true", help="skip the bf16 matmul ceiling")
  cli.add_common_args(p)
  return p


def grid_name(args) -> str:
  return "smoke" if args.smoke else "quick" if args.quick else args.grid


def select_cells(args) -> list[dict]:
  """The selected grid's cells (``--cells``: those matching a pattern); none matching is an error that
  lists the ids of that grid, the one that would run."""
  grid = grid_name(args)
  every = GRIDS[grid]()
  if not args.cells:
    return every
  cells = [c for c in every if any(fnmatch.fnmatchcase(c["id"], pat) for pat in args.cells)]
  if not cells:
    which = ("the CPU smoke grid (--smoke, or no GPU)" if grid == "smoke" else f"the {grid} grid")
    raise SystemExit(f"--cells {','.join(args.cells)} matches no cell of {which}; its ids: "
                     + " ".join(c["id"] for c in every))
  return cells


def cell_key(c):
  return (c.get("id"), c.get("impl"), c.get("dtype"))


def _reference(q, k, v, causal):
  """f32 reference output of batch 0, query heads [0, REF_HEADS) and their K/V heads."""
  import jax
  import jax.numpy as jnp
  import fa2_jax
  group = q.shape[2] // k.shape[2]
  nq = min(REF_HEADS, q.shape[2])
  nk = max(1, -(-nq // group))
  return jax.block_until_ready(jax.jit(lambda q, k, v: fa2_jax.reference_attention(
      q[:1, :, :nq], k[:1, :, :nk], v[:1, :, :nk], is_causal=causal,
      compute_dtype=jnp.float32).astype(jnp.float32))(q, k, v))


def _rel_err(out, ref):
  import jax.numpy as jnp
  o = out[:1, :, :ref.shape[2]].astype(jnp.float32)
  return float(jnp.linalg.norm(o - ref) / jnp.linalg.norm(ref))


def prepare_row(name, cell, inputs, args) -> tuple[dict, object]:
  """One implementation's row of a cell and the function to time, or ``None`` where it does not run
  (the row says why)."""
  q, k, v = inputs
  impl = impls.get(name)
  row = dict(cell, impl=name, label=impl.label, dtype=args.dtype, status="ok",
             flops_fwd=attention_flops(cell["batch"], cell["heads"], cell["seq_q"], cell["seq_k"],
                                       cell["head_dim"], cell["causal"]))
  why = impls.unsupported(name, q.shape, k.shape, q.dtype, cell["causal"])
  if why:
    row.update(status="skipped" if why.startswith("skipped") else "unsupported", error=why)
    return row, None
  if impl.describe is not None:
    try:
      row["backend"] = str(impl.describe(q, k, v, causal=cell["causal"]))
    except Exception as e:  # noqa: BLE001 - the call itself will report it
      row["backend"] = err_str(e, 200)
  return row, functools.partial(impl, causal=cell["causal"])


def finish_row(row, res, ref) -> dict:
  """A row with its measurement (``timing.measure``'s result) and the forward's error."""
  out = res.pop("out")
  row.update(res)
  if ref is not None and out is not None:
    row["rel_err"] = _rel_err(out, ref)
    if not row["rel_err"] <= REL_ERR_WARN:
      row["warning"] = f"forward rel. error {row['rel_err']:.2e} vs the f32 reference"
  errs = [row.get(f"{p}_error") for p in ("fwd", "fwd+bwd")]
  if all(errs):
    row["status"] = "error"
  elif any(errs):
    row["status"] = "partial"
  return row


def _same_as_fa2(cell, inputs) -> bool:
  """fa2_det is the same program as fa2 where fa2's default backward is already deterministic."""
  try:
    return impls.get("fa2").describe(*inputs, causal=cell["causal"]).deterministic
  except Exception:  # noqa: BLE001 - measure it then
    return False


def run(args) -> dict:
  import jax
  if args.list_cells:
    for c in select_cells(args):
      print(f"{c['id']:<20} B={c['batch']} T={c['seq_q']} S={c['seq_k']} N={c['heads']} "
            f"K={c['kv_heads']} H={c['head_dim']}")
    return {}
  info = device_info()
  cli.cpu_fallback(args, info, STEM)
  cli.smoke_counts(args)
  cells = select_cells(args)
  names, absent = impls.split_available(args.impls or DEFAULT_IMPLS)
  info["absent_impls"] = absent
  info["impls"] = {n: impls.get(n).about for n in names}
  out_dir = cli.resolve_out(args, info)
  dtype = cli.jnp_dtype(args.dtype)
  rec = Recorder(out_dir / out_name(STEM, args.tag, "json"), info, dict(
      grid=grid_name(args), cells=cells,
      impls=names, dtype=args.dtype, iters=args.iters, reps=args.reps, smoke=args.smoke,
      method="jit; 2 warm-up calls; median of reps x (iters back-to-back calls, then "
             "block_until_ready), the repetitions of a cell's implementations and passes "
             "interleaved (order rotated each repetition); fwd+bwd = jit(grad(f32 sum of the "
             "output)); bwd = fwd+bwd - fwd"),
      STEM, key=cell_key, resume=args.resume)
  crashed = {c.get("impl") for c in rec.crashed}
  budget = cli.make_budget(args)
  if not args.smoke and not args.no_matmul and "matmul" not in rec.data:
    try:
      rec.data["matmul"] = matmul_peak()
    except Exception as e:  # noqa: BLE001
      rec.data["matmul"] = {"error": err_str(e)}
  bar = cli.progress(len(cells) * len(names), STEM)
  for ci, cell in enumerate(cells):
    # Every implementation of a cell is compiled and warmed up, then timed with their repetitions
    # interleaved (benchmarks/timing.measure_together), so that a drift over the cell's time does not
    # favour the rows that ran first.
    bar.set_postfix_str(cell["id"])
    t0 = time.time()
    inputs = ref = None
    todo = {}  # name -> (row, f) to be timed together
    for name in names:
      base = dict(cell, impl=name, label=impls.get(name).label, dtype=args.dtype)
      if cell_key(base) in rec.done:  # --resume: measured by the last run
        bar.update(1)
        continue
      if name in crashed or not budget.fits("cell"):
        rec.add(dict(base, status="skipped", error="skipped: " + (
            "this implementation crashed the process earlier" if name in crashed else "time budget")))
        bar.update(1)
        continue
      rec.begin(base)
      simulated_crash_hook(name)
      try:
        if inputs is None:
          shapes = [(cell["batch"], cell["seq_q"], cell["heads"], cell["head_dim"])] + [
              (cell["batch"], cell["seq_k"], cell["kv_heads"], cell["head_dim"])] * 2
          inputs = cli.random_inputs(args.seed * 1000 + ci, shapes, dtype)
          if not args.no_check and cell["seq_q"] * cell["seq_k"] <= REF_MAX_SCORES:
            try:
              ref = _reference(*inputs, cell["causal"])
            except Exception as e:  # noqa: BLE001
              rec.note(f"no f32 reference for {cell['id']}: {err_str(e)}")
        if name == "fa2_det" and _same_as_fa2(cell, inputs):
          row = dict(base, status="same", same_as="fa2",
                     note="fa2's default backward is already deterministic here: the same program")
        else:
          row, f = prepare_row(name, cell, inputs, args)
          if f is not None:
            todo[name] = (row, f)
            continue
      except Exception as e:  # noqa: BLE001
        row = dict(base, status="error", error=err_str(e))
      rec.add(row)
      bar.update(1)
    if todo:
      def before(name, todo=todo):
        rec.begin(todo[name][0])
        simulated_crash_hook(name)
      try:
        results = measure_together({n: (f, inputs) for n, (_, f) in todo.items()},
                                   flops_fwd={n: r["flops_fwd"] for n, (r, _) in todo.items()},
                                   iters=args.iters, reps=args.reps, warmup=WARMUP, before=before)
      except Exception as e:  # noqa: BLE001
        results = {n: {"fwd_error": err_str(e), "fwd+bwd_error": err_str(e), "out": None}
                   for n in todo}
      wall = time.time() - t0
      for name, (row, _) in todo.items():
        row = finish_row(row, results[name], ref)
        row["wall_s"] = wall  # the cell's time, every row's measurement in it
        check_device(rec, row)
        rec.add(row)
        bar.update(1)
    budget.record("cell", time.time() - t0)
    del inputs, ref, todo
    jax.clear_caches()  # compiled programs of this cell's shapes are not used again
  bar.close()
  attach_ratios(rec.cells)
  data = rec.finish("done")
  files = render(data, out_dir, args.tag)
  print(summary(data), flush=True)
  print(f"[{STEM}] wrote {rec.path}" + "".join(f", {f}" for f in files), flush=True)
  data["files"] = [str(rec.path), *map(str, files)]
  return data


def main(argv=None):
  return cli.script_main(argv, build_parser(), run, render, summary, STEM, cell_key)


if __name__ == "__main__":
  main()
