"""What each FlashAttention-2 idea brings: the Triton kernels with one idea switched off at a time.

  (a) deferred normalisation (§3.1.1): off = FlashAttention-1's rescale of the accumulator every step
      (``normalize_each_step``) — forward;
  (b) sequence-length parallelism (§3.2): off = one forward program per (batch, head) looping over the
      query blocks (``seq_parallel=False``) — forward; matters at small batch × heads;
  (c) the separate dQ pass vs the paper's atomic dQ adds from the dK/dV kernel (``atomic_dq``) — backward.
The forward with (a) and (b) both off ("FA1-like") is measured too. The variants are benchmark-only
kernels (benchmarks/ablation_kernels.py); the "on" rows are fa2_jax's production Triton kernels.
Cases: head_dim 128/64, seq 8k/2k, 16k tokens, causal and not, plus batch 1 × 16 heads at 8k/16k.

    python -m benchmarks.ablation [--quick] [--head-dims 64,128] [--seqs 2k,8k] [--causal both]
    python -m benchmarks.ablation --merge a.json b.json --out DIR
"""
from __future__ import annotations

import argparse
import functools
import math
import time
import zlib

from . import ablation_kernels, cli
from .device import device_info
from .flops import attention_flops
from .recorder import Recorder, close_cell, finish_run
from .report import (SMOKE_CAVEAT, err_str, fmt_num, fmt_tf, is_oom, is_smoke, md_table, meta_lines, out_name,
                     ratio, seq_label, write_md)
from .timing import ITERS, REPS, WARMUP, measure

STEM = "ablation"
# name: (ablation_kernels.attention switches, pass timed)
VARIANTS = {
    "fa2": ({}, "fwd"),
    "no_deferred_norm": (dict(normalize_each_step=True), "fwd"),
    "no_seq_parallel": (dict(seq_parallel=False), "fwd"),
    "fa1_like": (dict(normalize_each_step=True, seq_parallel=False), "fwd"),
    "separate_dq": ({}, "fwd+bwd"),
    "atomic_dq": (dict(atomic_dq=True), "fwd+bwd"),
}
LABELS = {"fa2": "FA2 (all on)", "no_deferred_norm": "(a) off: normalise every step",
          "no_seq_parallel": "(b) off: one program per head", "fa1_like": "(a)+(b) off",
          "separate_dq": "separate dQ pass", "atomic_dq": "(c) off: atomic dQ"}


def build_parser():
  p = argparse.ArgumentParser(prog="python -m benchmarks.ablation", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--head-dims", type=cli.parse_ints, default=None)
  p.add_argument("--seqs", type=cli.parse_ints, default=None)
  p.add_argument("--causal", choices=["both", "true", "false"], default="both")
  p.add_argument("--no-small-batch", action="store_true", help="leave out the batch-1 cases")
  p.add_argument("--iters", type=cli.positive_int, default=ITERS,
                 help=f"back-to-back calls per repetition (--smoke: {cli.SMOKE_ITERS})")
  p.add_argument("--reps", type=cli.positive_int, default=REPS,
                 help=f"repetitions, median taken (--smoke: {cli.SMOKE_REPS})")
  cli.add_common_args(p)
  return p


def _case(batch, heads, seq, hd, causal, kind):
  return dict(batch=batch, heads=heads, seq=seq, head_dim=hd, causal=causal, kind=kind)


def cases(args):
  """The cases, most informative first."""
  causals = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
  if args.smoke:
    return [_case(1, 2, 128, 32, c, "smoke") for c in causals[:1]]
  hds = args.head_dims or ([128] if args.quick else [128, 64])
  seqs = args.seqs or ([8192] if args.quick else [8192, 2048])
  out = [_case(max(1, 16384 // s), 2048 // h, s, h, c, "16k tokens")
         for h in hds for s in seqs for c in causals]
  if not args.no_small_batch:
    out += [_case(1, 16, s, 128, c, "batch 1") for s in ([16384] if args.quick else [8192, 16384])
            for c in ([True] if args.quick else causals)]
  return out


def _case_id(c):
  return tuple(c[k] for k in ("batch", "heads", "seq", "head_dim", "causal"))


def cell_key(c):
  return (_case_id(c), c.get("variant"))


def run(args) -> dict:
  import jax.numpy as jnp
  info = device_info()
  cli.cpu_fallback(args, info, STEM)
  cli.smoke_counts(args)
  out_dir = cli.resolve_out(args, info)
  todo = [(cs, v) for cs in cases(args) for v in VARIANTS if not (args.quick and v == "fa1_like")]
  rec = Recorder(out_dir / out_name(STEM, args.tag, "json"), info, dict(
      cases=cases(args), variants={v: dict(switches=s, pass_=p) for v, (s, p) in VARIANTS.items()},
      dtype="bf16", iters=args.iters, reps=args.reps, smoke=args.smoke,
      method="benchmarks.timing (median of reps x iters back-to-back calls); bwd time = fwd+bwd - "
             "fwd of the production forward of the same case"),
      STEM, key=cell_key, resume=args.resume)
  budget = cli.make_budget(args)
  bar = cli.progress(len(todo), STEM)
  inputs_key, inputs = None, None
  for cs, var in todo:
    switches, pass_ = VARIANTS[var]
    fl = attention_flops(cs["batch"], cs["heads"], cs["seq"], cs["seq"], cs["head_dim"], cs["causal"])
    cell = dict(cs, variant=var, label=LABELS[var], pass_=pass_, switches=switches, flops_fwd=fl,
                status="ok")
    bar.set_postfix_str(f"{var} T={cs['seq']} H={cs['head_dim']} causal={cs['causal']}")
    if cell_key(cell) in rec.done:
      bar.update(1)
      continue
    if not budget.fits(var):
      rec.add(dict(cell, status="skipped", error="skipped: time budget"))
      bar.update(1)
      continue
    rec.begin(cell)
    t0 = time.time()
    try:
      if inputs_key != _case_id(cs):
        shape = (cs["batch"], cs["seq"], cs["heads"], cs["head_dim"])
        inputs = cli.random_inputs(zlib.crc32(repr(_case_id(cs)).encode()) % 100003 + args.seed,
                                   [shape] * 3, jnp.bfloat16)
        inputs_key = _case_id(cs)
      f = functools.partial(ablation_kernels.attention, is_causal=cs["causal"], **switches)
      # Backward variants: fwd+bwd minus the production forward (timed in the same call).
      res = measure(f, *inputs, flops_fwd=fl, iters=args.iters, reps=args.reps, warmup=WARMUP,
                    passes=("fwd",) if pass_ == "fwd" else ("fwd", "fwd+bwd"))
      res.pop("out")
      cell.update(res)
      errs = [v for k, v in res.items() if k.endswith("_error")]
      if errs:
        cell.update(status="oom" if is_oom(errs[0]) else "error", error=errs[0])
    except Exception as e:  # noqa: BLE001
      msg = err_str(e)
      cell.update(status="oom" if is_oom(msg) else "error", error=msg)
    close_cell(rec, budget, var, cell, t0, bar)
  return finish_run(rec, bar, render, summary, out_dir, args.tag)


# --- rendering ------------------------------------------------------------------------------------------

def _case_label(c):
  return (f"d{c['head_dim']} {'causal' if c['causal'] else 'non-causal'} T={seq_label(c['seq'])} "
          f"B={c['batch']} N={c['heads']}")


def _tf(c, p):
  return ((c or {}).get("tflops") or {}).get(p)


def ideas_rows(cells):
  """One row per case: forward TFLOP/s with each idea on/off, backward TFLOP/s with each dQ scheme,
  and the speed-up each idea brings (on ÷ off)."""
  rows = []
  for key in sorted({_case_id(c) for c in cells}):
    by = {c["variant"]: c for c in cells if _case_id(c) == key}
    base = _tf(by.get("fa2"), "fwd")
    row = {"case": _case_label(next(iter(by.values()))), "fwd_fa2": base}
    for v in ("no_deferred_norm", "no_seq_parallel", "fa1_like"):
      row[v] = _tf(by.get(v), "fwd")
      row[v + "_gain"] = ratio(base, row[v])
    row["bwd_separate"], row["bwd_atomic"] = (_tf(by.get(v), "bwd") for v in ("separate_dq", "atomic_dq"))
    row["separate_gain"] = ratio(row["bwd_separate"], row["bwd_atomic"])
    rows.append(row)
  return rows


def render(data, out_dir, tag=None):
  cells = [c for c in data.get("cells", []) if "variant" in c]
  lines = ["# Ablation of the FlashAttention-2 ideas (Triton kernels, bf16)", ""]
  lines += meta_lines(data.get("meta", {})) + [f"- method: {data.get('config', {}).get('method')}", ""]
  rows = ideas_rows(cells)
  if rows:
    lines += ["TFLOP/s; `×` = speed-up the idea brings (on ÷ off). (a), (b): forward; (c): backward "
              "(bwd = fwd+bwd − fwd). – = not measured (`--quick` leaves out (a)+(b) together).", ""]
    g = lambda r, v: (f"{fmt_tf(r[v])} (×{fmt_num(r[v + '_gain'], '.2f')})" if r[v] is not None  # noqa: E731
                      else "–")
    lines.append(md_table(
        ["case", "fwd FA2", "(a) off", "(b) off", "(a)+(b) off", "bwd separate dQ", "bwd atomic dQ"],
        [[r["case"], fmt_tf(r["fwd_fa2"]), g(r, "no_deferred_norm"), g(r, "no_seq_parallel"),
          g(r, "fa1_like"), f"{fmt_tf(r['bwd_separate'])} (×{fmt_num(r['separate_gain'], '.2f')})",
          fmt_tf(r["bwd_atomic"])] for r in rows]))
    lines.append("")
    for idea, key in (("(a) deferred normalisation", "no_deferred_norm_gain"),
                      ("(b) sequence parallelism", "no_seq_parallel_gain"),
                      ("(c) separate dQ pass over atomic dQ", "separate_gain")):
      gains = [(r["case"], r[key]) for r in rows if r[key]]
      if gains:
        lo, hi = min(gains, key=lambda x: x[1]), max(gains, key=lambda x: x[1])
        gm = math.exp(sum(math.log(x) for _, x in gains) / len(gains))
        lines.append(f"- {idea}: ×{gm:.2f} geometric mean over {len(gains)} cases (×{lo[1]:.2f} at "
                     f"{lo[0]} to ×{hi[1]:.2f} at {hi[0]})")
  fails = [c for c in cells if c.get("error")]
  if fails:
    lines += ["", "## Left out and failures", ""]
    lines += [f"- {c['variant']} {_case_label(c)}: `{c['error'][:300]}`" for c in fails]
  path = write_md(lines, out_dir, STEM, tag)
  return [path]


def summary(data) -> str:
  cells = [c for c in data.get("cells", []) if "variant" in c]
  lines = [f"{STEM}: fwd TFLOP/s FA2 | (a) off xgain | (b) off xgain ; bwd separate | atomic xgain"
           + (f" ({SMOKE_CAVEAT})" if is_smoke(data) else "")]
  for r in ideas_rows(cells):
    lines.append(f"  {r['case']:<38} {fmt_tf(r['fwd_fa2']):>5} | {fmt_tf(r['no_deferred_norm']):>5} "
                 f"x{fmt_num(r['no_deferred_norm_gain'], '.2f')} | {fmt_tf(r['no_seq_parallel']):>5} "
                 f"x{fmt_num(r['no_seq_parallel_gain'], '.2f')} ; {fmt_tf(r['bwd_separate']):>5} | "
                 f"{fmt_tf(r['bwd_atomic']):>5} x{fmt_num(r['separate_gain'], '.2f')}")
  return "\n".join(lines)


def main(argv=None):
  return cli.script_main(argv, build_parser(), run, render, summary, STEM, cell_key)


if __name__ == "__main__":
  main()
