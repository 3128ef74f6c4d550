"""Ablation of the three FlashAttention-2 ideas, and a block-size sweep of the Triton kernels.

Ideas (the paper measures none of them separately), each switched off alone:
  (a) deferred normalisation (§3.1.1): ``normalize_each_step=True`` rescales the accumulator by the
      softmax denominator every step, as FlashAttention-1 does — forward;
  (b) sequence-length parallelism (§3.2): ``seq_parallel=False`` runs one forward program per
      (batch, head) looping over the query blocks — forward; matters at small batch × heads;
  (c) atomic dQ in the dK/dV kernel vs a separate dQ pass (``deterministic=True``) — backward.
The forward with both (a) and (b) off ("FA1-like") is measured too. Cases: head_dim 64/128, seq 2k/8k,
16k tokens, causal and not, plus small batches (batch 1, 16 heads, seq 8k/16k) where (b) matters.

Sweep: forward ``block_q × block_k × num_warps_fwd × num_stages_fwd`` and backward
``block_q_dkv × block_k_dkv × num_warps_bwd × num_stages_bwd`` (atomic dQ; the forward at its default
tiles; bwd time = fwd+bwd − default fwd). The md ends with the best tiles per (head_dim, causal, pass)
as a ready ``BlockSizes(...)`` line.

    python -m benchmarks.ablation [--quick] [--parts ideas,sweep] [--head-dims 64,128] [--seqs 2k,8k]
    python -m benchmarks.ablation --smoke
    python -m benchmarks.ablation --merge a.json b.json --out DIR   # combine split runs
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import time
import zlib
from pathlib import Path

from . import common as C

STEM = "ablation"
FWD_VARIANTS = {  # name: flash_attention_ablation switches
    "fa2": dict(),
    "no_deferred_norm": dict(normalize_each_step=True),
    "no_seq_parallel": dict(seq_parallel=False),
    "fa1_like": dict(normalize_each_step=True, seq_parallel=False),
}
BWD_VARIANTS = {"atomic_dq": dict(atomic_dq=True), "separate_dq": dict(atomic_dq=False)}
VARIANT_LABELS = {
    "fa2": "FA2 (all on)", "no_deferred_norm": "(a) off: normalise every step",
    "no_seq_parallel": "(b) off: no seq parallelism", "fa1_like": "(a)+(b) off",
    "atomic_dq": "(c) atomic dQ", "separate_dq": "(c) off: separate dQ pass",
}
# Sweeps: forward tiles; dK/dV-kernel tiles (dQ kernel at its default); dQ-kernel tiles (dK/dV at its
# default; only when the backward uses the separate dQ pass). The two backward kernels are separate
# launches, so their times add and each set of tiles can be tuned on its own (num_warps_bwd and
# num_stages_bwd are shared by both).
GRIDS = {
    "full": {
        "fwd": dict(block_q=[64, 128], block_k=[64, 128], num_warps_fwd=[4, 8], num_stages_fwd=[2, 3]),
        "bwd_dkv": dict(block_q_dkv=[32, 64], block_k_dkv=[64, 128], num_warps_bwd=[4, 8],
                        num_stages_bwd=[2, 3]),
        "bwd_dq": dict(block_q_dq=[64, 128], block_k_dq=[32, 64], num_warps_bwd=[4, 8],
                       num_stages_bwd=[2, 3]),
    },
    "quick": {
        "fwd": dict(block_q=[64, 128], block_k=[64, 128], num_warps_fwd=[8], num_stages_fwd=[3]),
        "bwd_dkv": dict(block_q_dkv=[32, 64], block_k_dkv=[64, 128], num_warps_bwd=[4],
                        num_stages_bwd=[2]),
        "bwd_dq": dict(block_q_dq=[64, 128], block_k_dq=[32, 64], num_warps_bwd=[4],
                       num_stages_bwd=[2]),
    },
    "smoke": {
        "fwd": dict(block_q=[32], block_k=[16, 32], num_warps_fwd=[4], num_stages_fwd=[2]),
        "bwd_dkv": dict(block_q_dkv=[16, 32], block_k_dkv=[32], num_warps_bwd=[4],
                        num_stages_bwd=[2]),
        "bwd_dq": dict(block_q_dq=[32], block_k_dq=[16, 32], num_warps_bwd=[4], num_stages_bwd=[2]),
    },
}
SWEEPS = ("fwd", "bwd_dkv", "bwd_dq")


def build_parser():
  p = argparse.ArgumentParser(prog="python -m benchmarks.ablation", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--parts", type=C.parse_strs, default=["ideas", "sweep"], help="ideas,sweep")
  p.add_argument("--head-dims", type=C.parse_ints, default=None)
  p.add_argument("--seqs", type=C.parse_ints, default=None)
  p.add_argument("--causal", choices=["both", "true", "false"], default="both")
  p.add_argument("--no-small-batch", action="store_true", help="leave out the batch-1 cases")
  p.add_argument("--sweeps", type=C.parse_strs, default=list(SWEEPS), help=",".join(SWEEPS))
  p.add_argument("--grid", choices=list(GRIDS), default=None,
                 help="sweep grid size (default: full; --quick: quick; --smoke: smoke)")
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--reps", type=int, default=5)
  C.add_common_args(p)
  return p


def _case(batch, heads, seq, hd, causal, kind):
  return dict(batch=batch, heads=heads, seq=seq, head_dim=hd, causal=causal, kind=kind)


def cases(args):
  """(ideas cases, sweep cases), most informative first."""
  causals = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
  if args.smoke:
    ideas = [_case(1, 2, 128, 32, c, "smoke") for c in causals[:1]]
    return ideas, ideas[:1]
  if args.quick:
    hds, seqs = args.head_dims or [128], args.seqs or [8192]
  else:
    hds, seqs = args.head_dims or [128, 64], args.seqs or [8192, 2048]
  main_cases = [_case(max(1, 16384 // s), 2048 // h, s, h, c, "16k tokens")
                for h in hds for s in seqs for c in causals]
  small = []
  if not args.no_small_batch:
    small_seqs = [16384] if args.quick else [8192, 16384]
    small_causal = [True] if args.quick else causals
    small = [_case(1, 16, s, 128, c, "batch 1") for s in small_seqs for c in small_causal]
  sweep = main_cases[:1] if args.quick else main_cases
  return main_cases + small, sweep


def _case_id(c):
  return tuple((k, c[k]) for k in ("batch", "heads", "seq", "head_dim", "causal"))


def _job_key(c):
  blocks = tuple(sorted((c.get("blocks") or {}).items()))
  return (c.get("part"), c.get("sweep"), c.get("pass_"), _case_id(c), c.get("variant"), blocks)


def _grid(g):
  keys = list(g)
  return [dict(zip(keys, vals)) for vals in itertools.product(*(g[k] for k in keys))]


def _fn(case, *, interpret, blocks=None, **switches):
  abl, kw = C.fa2_ablation(**switches)

  def f(q, k, v):
    return abl(q, k, v, is_causal=case["causal"], block_sizes=blocks, interpret=interpret, **kw)
  return f


def _time(f, inputs, args, pass_):
  import jax
  iters, reps = (2, 2) if args.smoke else (args.iters, args.reps)
  if pass_ == "fwd":
    st, _ = C.time_throughput(jax.jit(f), inputs[:3], iters=iters, reps=reps)
  else:
    st, _ = C.time_throughput(C.fwd_bwd(f), inputs, iters=iters, reps=reps)
  return st


def run(args) -> dict:
  fa2 = C.ensure_fa2()
  info = C.device_info()
  out_dir = C.resolve_out(args, info)
  interpret = C.default_interpret()
  ideas, sweep_cases = cases(args)
  grid_name = args.grid or ("smoke" if args.smoke else "quick" if args.quick else "full")
  grids = GRIDS[grid_name]
  parts = [p for p in args.parts if p in ("ideas", "sweep")]
  sweeps = [w for w in args.sweeps if w in SWEEPS]
  if "bwd_dq" in sweeps and not C.fa2_default_deterministic():
    sweeps.remove("bwd_dq")  # the default backward has no dQ kernel (atomic dQ)
  rec = C.Recorder(out_dir / C.out_name(STEM, args.tag, "json"), info, dict(
      parts=parts, ideas_cases=ideas, sweep_cases=sweep_cases, grid=grid_name,
      grids={w: grids[w] for w in sweeps}, dtype="bf16", iters=args.iters, reps=args.reps,
      default_backward="separate dQ pass" if C.fa2_default_deterministic() else "atomic dQ",
      interpret=interpret, method="as benchmarks.attention (median of reps x iters back-to-back "
      "calls); bwd time = fwd+bwd − fwd of the default forward of the same case"), STEM,
      key=_job_key, resume=args.resume)
  budget = C.make_budget(args)
  jobs = []  # (part, case, variant name or tiles dict, pass, sweep name)
  if "ideas" in parts:
    fwd_vars = [v for v in FWD_VARIANTS if not (args.quick and v == "fa1_like")]
    for cs in ideas:
      jobs += [("ideas", cs, v, "fwd", None) for v in fwd_vars]
      jobs += [("ideas", cs, v, "fwd+bwd", None) for v in BWD_VARIANTS]
  if "sweep" in parts:
    for cs in sweep_cases:
      jobs.append(("sweep", cs, "default", "fwd", "fwd"))
      for w in sweeps:
        jobs += [("sweep", cs, g, "fwd" if w == "fwd" else "fwd+bwd", w) for g in _grid(grids[w])]
  bar = C.progress(len(jobs), "ablation")
  inputs_key, inputs = None, None
  fwd_default_ms = {_case_id(c): c["ms"] for c in rec.cells  # from a resumed run
                    if c.get("pass_") == "fwd" and c.get("variant") in ("fa2", "default")
                    and C.finite(c.get("ms"))}
  import jax.numpy as jnp
  for part, cs, var, pass_, sweep in jobs:
    ck = _case_id(cs)
    fl = C.attn_flops(cs["batch"], cs["heads"], cs["seq"], cs["seq"], cs["head_dim"], cs["causal"])
    cell = dict(cs, part=part, pass_=pass_, sweep=sweep, flops_fwd=fl, status="ok")
    if isinstance(var, dict):
      cell["blocks"] = var
    else:
      cell["variant"] = var
    what = "/".join(map(str, var.values())) if isinstance(var, dict) else var
    bar.set_postfix_str(f"{part} {sweep or ''} {what} T={cs['seq']} H={cs['head_dim']}")
    kind = f"{part}:{pass_}:{sweep}"
    if rec.key(cell) in rec.done:  # --resume: measured (or crashed) in the last run
      bar.update(1)
      continue
    if not budget.fits(kind):
      cell.update(status="skipped", error="skipped: time budget")
      rec.add(cell)
      bar.update(1)
      continue
    rec.begin(cell)
    t0 = time.time()
    try:
      if inputs_key != ck:
        inputs = None
        shape = (cs["batch"], cs["seq"], cs["heads"], cs["head_dim"])
        inputs = C.random_inputs(zlib.crc32(repr(ck).encode()) % 100003 + args.seed,
                                  [shape] * 4, jnp.bfloat16)
        inputs_key = ck
      default = fa2.BlockSizes.default(cs["head_dim"], jnp.bfloat16)
      if part == "ideas":
        sw = FWD_VARIANTS[var] if var in FWD_VARIANTS else BWD_VARIANTS[var]
        f = _fn(cs, interpret=interpret, **sw)
        cell["blocks_used"] = dataclasses.asdict(default)
      else:
        blocks = default if var == "default" else dataclasses.replace(default, **var)
        cell["blocks_used"] = dataclasses.asdict(blocks)
        f = _fn(cs, interpret=interpret, blocks=blocks)
      st = _time(f, inputs, args, pass_)
      ms = st["median_s"] * 1e3
      cell["timing"] = st
      cell["ms"] = ms
      if pass_ == "fwd":
        cell["tflops"] = fl / st["median_s"] / 1e12
        if var in ("fa2", "default"):
          fwd_default_ms[ck] = ms
      else:
        cell["tflops_fwd_bwd"] = 3.5 * fl / st["median_s"] / 1e12
        fms = fwd_default_ms.get(ck)
        if fms is not None and ms > fms:
          cell["bwd_ms"] = ms - fms
          cell["tflops"] = 2.5 * fl / (cell["bwd_ms"] * 1e-3) / 1e12
        else:
          cell["note"] = "no default forward time for this case: bwd not derived"
    except Exception as e:  # noqa: BLE001
      msg = C.err_str(e)
      cell.update(status="oom" if C.is_oom(msg) else "error", error=msg)
    C.close_cell(rec, budget, kind, cell, t0, bar)
  return C.finish_run(rec, bar, render, summary, out_dir, args.tag)


# --- rendering ----------------------------------------------------------------------------------------

def _case_key(c):
  return (c["head_dim"], c["causal"], c["seq"], c["batch"], c["heads"])


def _case_label(c):
  return (f"d{c['head_dim']} {'causal' if c['causal'] else 'non-causal'} T={C.seq_label(c['seq'])} "
          f"B={c['batch']} N={c['heads']}")


def _tf(c):
  return c.get("tflops") if c else None


def ideas_rows(cells):
  """One row per case: TFLOP/s with each idea on/off and the speed-up it brings."""
  ideas = [c for c in cells if c.get("part") == "ideas"]
  rows = []
  for key in sorted({_case_key(c) for c in ideas}):
    by = {c["variant"]: c for c in ideas if _case_key(c) == key}
    any_c = next(iter(by.values()))
    base = _tf(by.get("fa2"))
    row = {"case": _case_label(any_c), "kind": any_c.get("kind"), "fwd_fa2": base}
    for v in ("no_deferred_norm", "no_seq_parallel", "fa1_like"):
      t = _tf(by.get(v))
      row[v] = t
      row[v + "_gain"] = base / t if C.finite(base) and C.finite(t) and t > 0 else None
    a, s = _tf(by.get("atomic_dq")), _tf(by.get("separate_dq"))
    row.update(bwd_atomic=a, bwd_separate=s,
               atomic_gain=a / s if C.finite(a) and C.finite(s) and s > 0 else None,
               fb_atomic=(by.get("atomic_dq") or {}).get("tflops_fwd_bwd"),
               fb_separate=(by.get("separate_dq") or {}).get("tflops_fwd_bwd"))
    row["failed"] = {v: c.get("error") for v, c in by.items() if c.get("error")}
    rows.append(row)
  return rows


def _blocks_key(c):
  return tuple(sorted((c.get("blocks") or {}).items()))


def _sweep_of(c):
  return c.get("sweep") or ("fwd" if c["pass_"] == "fwd" else "bwd_dkv")


def suggestions(cells, overall):
  """One ``BlockSizes(...)`` per (head_dim, causal) from the best tiles of each sweep (unswept fields
  keep the default of that head_dim)."""
  out = []
  for h, cz in sorted({(o["head_dim"], o["causal"]) for o in overall}):
    base = next((c.get("blocks_used") for c in cells if c.get("part") == "sweep"
                 and c.get("variant") == "default" and c["head_dim"] == h and c["causal"] == cz
                 and c.get("blocks_used")), None)
    fields = dict(base or {})
    src = []
    # bwd_dq first so that bwd_dkv's (bigger) kernel wins the shared warps/stages.
    for w in ("fwd", "bwd_dq", "bwd_dkv"):
      o = next((o for o in overall if (o["head_dim"], o["causal"], o["pass_"]) == (h, cz, w)), None)
      if o:
        fields.update(o["best"])
        src.append(w)
    if fields:
      out.append(dict(head_dim=h, causal=cz, from_sweeps=src, blocks=fields,
                      text="BlockSizes(" + ", ".join(f"{k}={v}" for k, v in fields.items()) + ")"))
  return out


def best_rows(cells):
  """Best tiles per (head_dim, causal, pass, seq) and, over seqs, per (head_dim, causal, pass)."""
  import numpy as np
  sweep = [c for c in cells if c.get("part") == "sweep" and c.get("blocks") and C.finite(_tf(c))]
  defaults = {_case_key(c): c for c in cells if c.get("part") == "sweep"
              and c.get("variant") == "default" and C.finite(_tf(c))}
  per_seq, overall = [], []
  groups = {}
  for c in sweep:
    groups.setdefault((c["head_dim"], c["causal"], _sweep_of(c)), []).append(c)
  for (h, cz, p), cs in sorted(groups.items()):
    by_case = {}
    for c in cs:
      by_case.setdefault(_case_key(c), []).append(c)
    for key, lst in sorted(by_case.items()):
      best = max(lst, key=_tf)
      d = defaults.get(key)
      dflt = _tf(d) if p == "fwd" else None
      if p != "fwd":  # the default backward tiles, if they were in the grid
        dk = [c for c in lst if all(c["blocks_used"].get(k) == v for k, v in
                                    (d or {}).get("blocks_used", {}).items())]
        dflt = _tf(dk[0]) if dk else None
      per_seq.append(dict(head_dim=h, causal=cz, pass_=p, seq=key[2], batch=key[3], heads=key[4],
                          best=best["blocks"], tflops=_tf(best), default_tflops=dflt,
                          gain=_tf(best) / dflt if C.finite(dflt) and dflt > 0 else None,
                          n_configs=len(lst)))
    # Over all lengths: the tiles with the best geometric mean of TFLOP/s relative to each length's best.
    scores = {}
    for key, lst in by_case.items():
      top = max(_tf(c) for c in lst)
      for c in lst:
        scores.setdefault(_blocks_key(c), []).append(_tf(c) / top)
    n_cases = len(by_case)
    full = {k: v for k, v in scores.items() if len(v) == n_cases}
    if full:
      bk = max(full, key=lambda k: float(np.exp(np.mean(np.log(full[k])))))
      overall.append(dict(head_dim=h, causal=cz, pass_=p, best=dict(bk),
                          rel_to_best=float(np.exp(np.mean(np.log(full[bk])))), n_seqs=n_cases))
  return per_seq, overall


def render(data, out_dir: Path, tag=None):
  cells = [c for c in data.get("cells", []) if "part" in c]
  out_dir = Path(out_dir)
  cfg = data.get("config", {})
  lines = ["# Ablation of the FlashAttention-2 ideas, and block sizes (bf16)", ""]
  lines += C.meta_lines(data.get("meta", {}))
  lines += [f"- method: {cfg.get('method')}", ""]
  rows = ideas_rows(cells)
  if rows:
    lines += ["## The three ideas", "",
              "TFLOP/s; `×` = speed-up the idea brings (on ÷ off). (a) deferred normalisation and "
              "(b) sequence parallelism: forward; (c) atomic dQ: backward (bwd TFLOP/s, fwd+bwd in "
              "brackets). – = not measured in this run (`--quick` leaves out (a)+(b) together).",
              ""]
    header = ["case", "fwd FA2", "(a) off", "(b) off", "(a)+(b) off", "bwd atomic dQ",
              "bwd separate dQ"]
    tbl = []
    for r in rows:
      g = lambda v: (f"{C.fmt_tf(r[v])} (×{C.fmt_num(r[v + '_gain'], '.2f')})"  # noqa: E731
                     if C.finite(r[v]) else "–")
      tbl.append([r["case"], C.fmt_tf(r["fwd_fa2"]), g("no_deferred_norm"), g("no_seq_parallel"),
                  g("fa1_like"),
                  f"{C.fmt_tf(r['bwd_atomic'])} ({C.fmt_tf(r['fb_atomic'])}) "
                  f"(×{C.fmt_num(r['atomic_gain'], '.2f')})",
                  f"{C.fmt_tf(r['bwd_separate'])} ({C.fmt_tf(r['fb_separate'])})"])
    lines.append(C.md_table(header, tbl))
    lines.append("")
    for idea, key in (("(a) deferred normalisation", "no_deferred_norm_gain"),
                      ("(b) sequence parallelism", "no_seq_parallel_gain"),
                      ("(c) atomic dQ", "atomic_gain")):
      gains = [(r["case"], r[key]) for r in rows if C.finite(r[key])]
      if gains:
        lo, hi = min(gains, key=lambda x: x[1]), max(gains, key=lambda x: x[1])
        gm = math.exp(sum(math.log(g) for _, g in gains) / len(gains))
        lines.append(f"- {idea}: ×{gm:.2f} geometric mean over {len(gains)} cases "
                     f"(from ×{lo[1]:.2f} at {lo[0]} to ×{hi[1]:.2f} at {hi[0]})")
    lines.append("")
  per_seq, overall = best_rows(cells)
  if overall:
    lines += ["## Best block sizes per (head_dim, causal, pass)", "",
              "Chosen by the geometric mean, over the swept lengths, of TFLOP/s relative to each "
              "length's best.", ""]
    tbl = []
    for o in overall:
      args_txt = ", ".join(f"{k}={v}" for k, v in o["best"].items())
      tbl.append([o["head_dim"], "causal" if o["causal"] else "non-causal", o["pass_"],
                  f"`BlockSizes(..., {args_txt})`", f"{o['rel_to_best']:.3f}", o["n_seqs"]])
    lines.append(C.md_table(["head_dim", "mask", "pass", "best tiles", "× of per-length best",
                             "lengths"], tbl))
    lines.append("")
    sug = suggestions(cells, overall)
    if sug:
      lines += ["Combined (the best of each sweep; the two backward kernels share num_warps_bwd / "
                "num_stages_bwd, the dK/dV kernel's choice is kept):", ""]
      lines += [f"- head_dim {g['head_dim']}, {'causal' if g['causal'] else 'non-causal'}: "
                f"`{g['text']}`" for g in sug]
      lines.append("")
  if per_seq:
    lines += ["### Best per length", ""]
    tbl = [[r["head_dim"], "causal" if r["causal"] else "non-causal", r["pass_"],
            f"{C.seq_label(r['seq'])} (B={r['batch']})",
            ", ".join(f"{k}={v}" for k, v in r["best"].items()), C.fmt_tf(r["tflops"]),
            C.fmt_tf(r["default_tflops"]), C.fmt_num(r["gain"], ".2f"), r["n_configs"]]
           for r in per_seq]
    lines.append(C.md_table(["head_dim", "mask", "pass", "seq", "best tiles", "TFLOP/s",
                             "default TFLOP/s", "gain", "configs"], tbl))
    lines.append("")
    lines += ["### Top 5 per sweep case", ""]
    sweep = [c for c in cells if c.get("part") == "sweep" and c.get("blocks")]
    for key in sorted({(_case_key(c), _sweep_of(c)) for c in sweep}):
      lst = sorted((c for c in sweep if (_case_key(c), _sweep_of(c)) == key and C.finite(_tf(c))),
                   key=_tf, reverse=True)
      fails = [c for c in sweep if (_case_key(c), _sweep_of(c)) == key and c.get("error")
               and c.get("status") != "skipped"]
      if not lst and not fails:
        continue
      p = key[1]
      c0 = (lst or fails)[0]
      lines.append(f"- {_case_label(c0)} {p}: " + "; ".join(
          f"{C.fmt_tf(_tf(c))} [{', '.join(str(v) for v in c['blocks'].values())}]"
          for c in lst[:5]) + (f" ({len(fails)} configs failed)" if fails else ""))
    lines.append("")
  errs = {}
  for c in cells:
    if c.get("error") and c.get("status") != "skipped":
      errs.setdefault(c["error"][:200], []).append(
          c.get("variant") or ",".join(map(str, (c.get("blocks") or {}).values())))
  if errs:
    lines += ["## Failures", ""]
    lines += [f"- {len(w)}× ({', '.join(w[:4])}{'…' if len(w) > 4 else ''}): `{e}`"
              for e, w in errs.items()]
  skipped = sum(1 for c in cells if c.get("status") == "skipped")
  if skipped:
    lines.append(f"\n{skipped} cells skipped for the time budget.")
  md = out_dir / C.out_name(STEM, tag, "md")
  md.write_text("\n".join(lines) + "\n")
  return [md]


def summary(data) -> str:
  cells = [c for c in data.get("cells", []) if "part" in c]
  lines = ["ablation: fwd TFLOP/s FA2 | (a) off xgain | (b) off xgain ; bwd atomic | separate xgain"]
  for r in ideas_rows(cells):
    lines.append(f"  {r['case']:<38} {C.fmt_tf(r['fwd_fa2']):>5} | "
                 f"{C.fmt_tf(r['no_deferred_norm']):>5} x{C.fmt_num(r['no_deferred_norm_gain'], '.2f')} | "
                 f"{C.fmt_tf(r['no_seq_parallel']):>5} x{C.fmt_num(r['no_seq_parallel_gain'], '.2f')} ; "
                 f"{C.fmt_tf(r['bwd_atomic']):>5} | {C.fmt_tf(r['bwd_separate']):>5} "
                 f"x{C.fmt_num(r['atomic_gain'], '.2f')}")
  _, overall = best_rows(cells)
  for o in overall:
    lines.append(f"  best {o['pass_']} d{o['head_dim']} {'c ' if o['causal'] else 'nc'}: "
                 + ", ".join(f"{k}={v}" for k, v in o["best"].items()))
  return "\n".join(lines)


def main(argv=None):
  return C.script_main(argv, build_parser(), run, render, summary, STEM)


if __name__ == "__main__":
  main()
