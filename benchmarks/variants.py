"""Speed of the attention variants: fa2_jax's variant arguments beside the same work done another way
(a dense call, the documents as a batch) and beside the peers, forward and forward+backward, with the
bars they must meet.

Cells (bf16, head_dim 128, 16 heads; ``--smoke``: the same cells at tiny sizes):

  window-32k, window-128k   local window (4095, 0), causal, B=1: fa2 (``local_window_size``), fa2's dense
                            causal call (the bar's reference), FA3 (``window_size``), cuDNN
                            (``local_window_size``)
  packed-8x4k               32k tokens, 8 documents of 4k, causal within each (B=1): fa2 with
                            ``q_segment_ids = kv_segment_ids``; fa2 on the documents as a batch [8, 4k];
                            FA3 varlen (``cu_seqlens``); cuDNN on the batch
  packed-ragged             32k tokens of documents 100 ... 8k long (numpy seed RAGGED_SEED): the same
                            rows; the batch rows pad every document to the longest (rounded up to 128)
                            and pass ``query_seq_lengths = key_value_seq_lengths`` (one call, the layout
                            cuDNN takes; per-document calls would compile one program per length and
                            pay one launch per document)
  softcap-8k-c, -nc         B=2: fa2 with ``logits_soft_cap=50``, fa2 without, tokamax with the soft cap
                            (FA3's binding has no soft cap, jax.nn's cuDNN call neither)
  padding-8k-nc, -c         B=2, 50% fill: fa2 with ``query_seq_lengths = key_value_seq_lengths = 4096``,
                            the unpadded 8k call, cuDNN with the same lengths
  maskfn-causal-32k,        B=1: fa2 with a ``mask_fn`` equal to causal / to the window (4095, 0)
  maskfn-window-32k         (``is_causal=False``), fa2's built-in ``is_causal`` / ``local_window_size``

TFLOP/s count the *attended* (query, key) pairs: forward 4·N·H·pairs, forward+backward 3.5× that, so a
row that skips masked blocks gets no credit for them and rows doing the same work compare as times.
Bars (each pass, fwd and fwd+bwd, must meet it):
  window   fa2's rate ≥ 0.9× fa2's dense causal rate (per attended pair)
  padding  fa2 at 50% fill ≤ 0.55× the unpadded call's time
  maskfn   fa2 with mask_fn ≤ 1.10× the built-in's time
Every forward output is also checked against fa2_jax.reference_attention in float32 (batch 0, the
first REF_HEADS heads, the rows that hold tokens; ⚠ when off).

    python -m benchmarks.variants [--cells 'window-*,packed-*'] [--impls fa2,cudnn,fa3,tokamax]
                                  [--out DIR] [--quick] [--smoke] [--list-cells]
    python -m benchmarks.variants --merge a/variants.json b/variants.json --out DIR

``--quick`` leaves out window-128k (the longest cell). Timing: benchmarks/timing.py (segment ids, lengths
and cu_seqlens are arguments of the jitted call, as in training, not compile-time constants).
"""
from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import time
import zlib

from . import cli, impls
from .device import device_info
from .recorder import Recorder, close_cell, finish_run, simulated_crash_hook
from .report import err_str, out_name
from .timing import ITERS, REPS, WARMUP, measure_together
from .variant_cells import (BARS, PAD_MULTIPLE, PASSES, RAGGED_SEED, SIZES, SOFT_CAP, Arr, Cell, Row,
                            build_cells)
from .variants_report import STEM, render, summary

FAMILIES = ("fa2", "cudnn", "fa3", "tokamax")  # the registry entries (benchmarks/impls.py) with rows here
REL_ERR_WARN = 2e-2  # forward output vs the f32 reference: a fast row must also be a right one
REF_HEADS = 2  # the reference check compares batch 0, the first REF_HEADS heads
DTYPE = "bf16"  # the inputs of every cell
QUICK_SKIP = ("window-128k",)  # --quick leaves out the longest cell


# --- measuring ------------------------------------------------------------------------------------------

def cell_key(c):
  return (c.get("id"), c.get("row"))


def _resolve(kw: dict, arrays: dict, batch0: bool = False) -> dict:
  """``kw`` with each Arr replaced by the cell's array (``batch0``: its batch-0 slice, ``[:1]``)."""
  import jax.numpy as jnp
  return {k: (jnp.asarray(arrays[v.name][:1] if batch0 else arrays[v.name]) if isinstance(v, Arr) else v)
          for k, v in kw.items()}


def timed_fn(row: Row):
  """``(f(q, k, v, *aux), aux names)``: the row's call with its array arguments as runtime ``aux``."""
  fn = row.call or impls.get(row.impl)
  names = [k for k, v in row.kw.items() if isinstance(v, Arr)]
  static = {k: v for k, v in row.kw.items() if not isinstance(v, Arr)}

  def f(q, k, v, *aux):
    return fn(q, k, v, causal=row.causal, **static, **dict(zip(names, aux)))

  return f, tuple(row.kw[n].name for n in names)


def _reference(row: Row, arrays, q, k, v):
  """float32 reference output of batch 0, heads [0, REF_HEADS), and the mask of its rows with tokens."""
  import jax
  import jax.numpy as jnp
  import fa2_jax
  kw = _resolve(row.ref, arrays, batch0=True)
  nh = min(REF_HEADS, q.shape[2])
  ref = jax.block_until_ready(jax.jit(lambda q, k, v: fa2_jax.reference_attention(
      q, k, v, compute_dtype=jnp.float32, query_block="auto", **kw).astype(jnp.float32))(
          q[:1, :, :nh], k[:1, :, :nh], v[:1, :, :nh]))
  qlen = kw.get("query_seq_lengths")
  valid = None if qlen is None else (jnp.arange(q.shape[1])[None, :] < qlen[:, None])  # [1, T]
  return ref, valid


def _rel_err(out, ref, valid) -> float:
  import jax.numpy as jnp
  d = out[:1, :, :ref.shape[2]].astype(jnp.float32) - ref
  r = ref
  if valid is not None:
    d, r = (jnp.where(valid[:, :, None, None], x, 0.0) for x in (d, r))
  return float(jnp.linalg.norm(d) / jnp.linalg.norm(r))


def _row_record(cell: Cell, row: Row) -> dict:
  batch, seq = cell.layouts[row.layout]
  return dict(id=cell.id, kind=cell.kind, title=cell.title, row=row.name, impl=row.impl, label=row.label,
              about=row.about, layout=row.layout, batch=batch, seq=seq, heads=cell.heads,
              head_dim=cell.head_dim, causal=row.causal, dtype=DTYPE, pairs=row.pairs,
              flops_fwd=4.0 * cell.heads * cell.head_dim * row.pairs, **cell.info)


def prepare_row(cell: Cell, row: Row, inputs):
  """One row's record and its timed call ``(f, (q, k, v, *aux))``, or ``None`` where it does not run
  (the record says why)."""
  import jax.numpy as jnp
  q, k, v = inputs[row.layout]
  rec = dict(_row_record(cell, row), status="ok")
  why = impls.unsupported(row.impl, q.shape, k.shape, q.dtype, row.causal)
  if why:
    rec.update(status="unsupported", error=why)
    return rec, None
  impl = impls.get(row.impl)
  if impl.describe is not None and row.call is None:
    try:
      rec["backend"] = str(impl.describe(q, k, v, causal=row.causal, **_resolve(row.kw, cell.arrays)))
    except Exception as e:  # noqa: BLE001 - the call itself will report it
      rec["backend"] = err_str(e, 200)
  f, aux_names = timed_fn(row)
  aux = tuple(jnp.asarray(cell.arrays[n]) for n in aux_names)  # one per argument, repeats kept
  return rec, (f, (q, k, v, *aux))


def finish_row(cell: Cell, row: Row, rec: dict, res: dict, inputs, refs, args) -> dict:
  """A row's record with its measurement (benchmarks/timing) and the forward's error."""
  q, k, v = inputs[row.layout]
  out = res.pop("out")
  rec.update(res)
  if out is not None and not args.no_check:
    key = (row.layout, repr(sorted(row.ref.items())))
    try:
      if key not in refs:
        refs[key] = _reference(row, cell.arrays, q, k, v)
      rec["rel_err"] = _rel_err(out, *refs[key])
      if not rec["rel_err"] <= REL_ERR_WARN:
        rec["warning"] = f"forward rel. error {rec['rel_err']:.2e} vs the f32 reference"
    except Exception as e:  # noqa: BLE001
      rec["check_error"] = f"no f32 reference: {err_str(e, 300)}"
  errs = [rec.get(f"{p}_error") for p in PASSES]
  if all(errs):
    rec["status"] = "error"
  elif any(errs):
    rec["status"] = "partial"
  return rec


def _inputs(cell: Cell, seed: int, dtype):
  """Fresh random normals ``q, k, v [B, T, N, H]`` per layout of the cell, drawn from the cell's id and
  layout (and ``--seed``), so that a ``--cells`` subset measures the same inputs."""
  return {name: cli.random_inputs(zlib.crc32(f"{cell.id}/{name}/{seed}".encode()),
                                  [(b, t, cell.heads, cell.head_dim)] * 3, dtype)
          for name, (b, t) in cell.layouts.items()}


def build_parser():
  p = argparse.ArgumentParser(prog="python -m benchmarks.variants", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--cells", type=cli.parse_strs, default=None,
                 help="only the cells whose id matches one of these patterns, e.g. 'window-*,packed-*'")
  p.add_argument("--list-cells", action="store_true", help="print the cell ids and rows, and exit")
  p.add_argument("--impls", type=cli.impl_names, default=None,
                 help=f"rows of these registry entries only: comma list of {', '.join(FAMILIES)} "
                      "(default all)")
  p.add_argument("--iters", type=cli.positive_int, default=ITERS,
                 help=f"back-to-back calls per repetition (--smoke: {cli.SMOKE_ITERS})")
  p.add_argument("--reps", type=cli.positive_int, default=REPS,
                 help=f"repetitions, median taken (--smoke: {cli.SMOKE_REPS})")
  p.add_argument("--no-check", action="store_true", help="skip the f32 reference check")
  cli.add_common_args(p)
  return p


def select_cells(args) -> list[Cell]:
  """The cells of the size that runs (``--cells``: those matching a pattern); none matching is an error
  that lists the ids of that size's cells."""
  every = build_cells("smoke" if args.smoke else "full")
  if args.quick:
    every = [c for c in every if c.id not in QUICK_SKIP]
  if not args.cells:
    return every
  cells = [c for c in every if any(fnmatch.fnmatchcase(c.id, pat) for pat in args.cells)]
  if not cells:
    which = ("the CPU smoke cells (--smoke, or no GPU)" if args.smoke else
             "the quick GPU cells" if args.quick else "the GPU cells")
    raise SystemExit(f"--cells {','.join(args.cells)} matches no cell of {which}; their ids: "
                     + " ".join(c.id for c in every))
  return cells


def _families(args) -> list[str]:
  names = args.impls or list(FAMILIES)
  bad = [n for n in names if n not in FAMILIES]
  if bad:
    raise SystemExit(f"--impls: {', '.join(bad)} {'has' if len(bad) == 1 else 'have'} no rows here; "
                     f"the variants' rows run {', '.join(FAMILIES)}")
  return names


def run(args) -> dict:
  import jax
  families = _families(args)
  if args.list_cells:
    for c in select_cells(args):
      shapes = ", ".join(f"{k} [{b}, {t}]" for k, (b, t) in c.layouts.items())
      print(f"{c.id:<20} {c.title}; {c.heads} x {c.head_dim}; {shapes}; rows "
            + " ".join(r.name for r in c.rows if r.impl in families))
    return {}
  info = device_info()
  cli.cpu_fallback(args, info, STEM)
  cli.smoke_counts(args)  # a few calls: the smoke size checks the harness
  cells = select_cells(args)
  names, absent = impls.split_available(families)
  info["absent_impls"] = absent
  info["impls"] = {n: impls.get(n).about for n in names}
  out_dir = cli.resolve_out(args, info)
  dtype = cli.jnp_dtype(DTYPE)
  size = "smoke" if args.smoke else "full"
  rec = Recorder(out_dir / out_name(STEM, args.tag, "json"), info, dict(
      size=size, sizes=SIZES[size], cells=[dict(id=c.id, kind=c.kind, title=c.title, layouts=c.layouts,
                                                rows=[r.name for r in c.rows], **c.info) for c in cells],
      impls=families, dtype=DTYPE, iters=args.iters, reps=args.reps, smoke=args.smoke,
      soft_cap=SOFT_CAP, ragged_seed=RAGGED_SEED, pad_multiple=PAD_MULTIPLE,
      bars={k: [dataclasses.asdict(b) for b in v] for k, v in BARS.items()},
      flops="forward 4·N·H·(attended pairs), forward+backward 3.5× that",
      method="benchmarks.timing: jit; 2 warm-up calls; median of reps x (iters back-to-back calls, then "
             "block_until_ready), the repetitions of a cell's rows and passes interleaved (order "
             "rotated each repetition); fwd+bwd = jit(grad(f32 sum of the output)); integer arrays (segment "
             "ids, lengths, cu_seqlens) are runtime arguments"),
      STEM, key=cell_key, resume=args.resume)
  crashed = {(c.get("id"), c.get("row")) for c in rec.crashed}
  budget = cli.make_budget(args)
  todo = [(c, r) for c in cells for r in c.rows if r.impl in families]
  bar = cli.progress(len(todo), STEM)
  for cell in cells:
    # A cell's rows are compiled and warmed up, then timed with their repetitions interleaved
    # (benchmarks/timing.measure_together): a drift over the cell's time falls on every row alike.
    bar.set_postfix_str(cell.id)
    t0 = time.time()
    inputs, refs, timed = None, {}, {}  # timed: row name -> (row, record, call)
    for row in (r for r in cell.rows if r.impl in families):
      base = _row_record(cell, row)
      if cell_key(base) in rec.done:  # --resume: measured by the last run
        bar.update(1)
        continue
      if row.impl in absent:
        rec.add(dict(base, status="unavailable", error=absent[row.impl]))
        bar.update(1)
        continue
      if cell_key(base) in crashed or not budget.fits("cell"):
        rec.add(dict(base, status="skipped", error="skipped: " + (
            "it crashed the process in the last run" if cell_key(base) in crashed else "time budget")))
        bar.update(1)
        continue
      rec.begin(base)
      simulated_crash_hook(row.impl)
      try:
        if inputs is None:
          inputs = _inputs(cell, args.seed, dtype)
        out, call = prepare_row(cell, row, inputs)
        if call is not None:
          timed[row.name] = (row, out, call)
          continue
      except Exception as e:  # noqa: BLE001
        out = dict(base, status="error", error=err_str(e))
      close_cell(rec, budget, "cell", out, t0, bar)
    if timed:
      def before(name, timed=timed):
        rec.begin(timed[name][1])
        simulated_crash_hook(timed[name][0].impl)
      try:
        results = measure_together({n: call for n, (_, _, call) in timed.items()},
                                   flops_fwd={n: r["flops_fwd"] for n, (_, r, _) in timed.items()},
                                   iters=args.iters, reps=args.reps, warmup=WARMUP, before=before)
      except Exception as e:  # noqa: BLE001
        results = {n: {"fwd_error": err_str(e), "fwd+bwd_error": err_str(e), "out": None}
                   for n in timed}
      for name, (row, out, _) in timed.items():
        try:
          out = finish_row(cell, row, out, results[name], inputs, refs, args)
        except Exception as e:  # noqa: BLE001
          out.update(status="error", error=err_str(e))
        close_cell(rec, budget, "cell", out, t0, bar)  # wall_s: the cell's time so far
    del inputs, refs, timed
    jax.clear_caches()  # compiled programs of this cell's shapes are not used again
  return finish_run(rec, bar, render, summary, out_dir, args.tag)


def main(argv=None):
  return cli.script_main(argv, build_parser(), run, render, summary, STEM, cell_key)


if __name__ == "__main__":
  main()
