"""Run the benchmarks under one time budget: attention, memory, latency, numerics (and, when named with
``--only``, the model configs' benchmark, models).

Each stage runs as its own process (a crash, a hung compile or a poisoned CUDA context costs one stage,
the memory stage gets a device no other stage has touched), with a soft deadline (the stage stops
starting cells and records the rest as skipped) and a hard timeout (its process group is killed; its
JSON, written after every cell, is rendered here). Time a stage does not use goes to the later ones.

    python -m benchmarks.run_all --quick [--budget-s 450] [--out DIR] [--archive FILE.tar.gz]
    python -m benchmarks.run_all --full --only attention --budget-s 540      # one part of the full set
    python -m benchmarks.run_all --smoke --out OUT_DIR                     # CPU, interpret mode
    python -m benchmarks.run_all --quick --only models --budget-s 540      # resumed after a crash

Without a GPU (asked of jax in a child process) the smoke size is run whatever the mode. Results go to
``out/<gpu>/`` in the checkout (ignored by git) unless ``--out`` says otherwise.
Stage-specific flags: ``--stage-args "attention=--impls cudnn,fa2"`` (repeatable).
The last thing printed is a summary of every stage (what a 12k-character log tail keeps).
"""
from __future__ import annotations

import importlib
import os
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from . import harness as h

STAGES = ("attention", "memory", "latency", "numerics")  # the default stages
OPTIONAL_STAGES = ("models",)  # run only when --only names them (the model configs fill a budget alone)
KNOWN = STAGES + OPTIONAL_STAGES
# WEIGHTS: each stage's share of the time budget (the throughput grid has the most cells).
# DEFAULT_BUDGET_S: seconds for all stages, under a 10-minute command limit with room for setup and the
# report. SUMMARY_CHARS: each stage's part of the 12k-character log tail printed last.
WEIGHTS = {"attention": 0.55, "memory": 0.13, "latency": 0.13, "numerics": 0.19, "models": 0.55}
DEFAULT_BUDGET_S = {"quick": 450.0, "full": 540.0, "smoke": 300.0}
RESUMABLE = ("attention", "latency", "numerics", "models")
SUMMARY_CHARS = {"attention": 4800, "memory": 1800, "latency": 2000, "numerics": 2200, "models": 4800}


def build_parser():
  p = h.script_parser("run_all", __doc__)
  mode = p.add_mutually_exclusive_group()
  mode.add_argument("--quick", action="store_true", help="the subsets (default)")
  mode.add_argument("--full", action="store_true", help="every stage's full sweep (split with --only)")
  mode.add_argument("--smoke", action="store_true", help="CPU, interpret mode, tiny shapes")
  p.add_argument("--out", type=Path, default=None,
                 help=f"output folder (default {h.DEFAULT_OUT.name}/<gpu>/ in the checkout)")
  p.add_argument("--tag", default=None)
  p.add_argument("--budget-s", type=h.positive_float, default=None,
                 help="total seconds (default: quick 450, full 540, smoke 300)")
  p.add_argument("--grace-s", type=float, default=None,
                 help="seconds a stage may overrun its soft deadline before it is killed "
                      "(default 45; smoke 60)")
  p.add_argument("--only", type=h.parse_strs, default=None,
                 help=f"stages from {','.join(KNOWN)} (default {','.join(STAGES)})")
  p.add_argument("--skip", type=h.parse_strs, default=[], help=",".join(KNOWN))
  p.add_argument("--archive", type=Path, default=None,
                 help="also pack the output folder into this .tar.gz (rewritten after every stage)")
  p.add_argument("--stage-args", action="append", default=[],
                 help='extra flags for one stage: "STAGE=--flag value ..." (repeatable)')
  return p


def _mode(args):
  return "smoke" if args.smoke else "full" if args.full else "quick"


def _kill_group(p: subprocess.Popen):
  """End the stage and the processes it started (its own process group), gently first."""
  for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
    try:
      os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
      return
    try:
      p.wait(timeout=wait)
      return
    except subprocess.TimeoutExpired:
      continue


def _archive(out: Path, dest: Path):
  dest = Path(dest)
  dest.parent.mkdir(parents=True, exist_ok=True)
  tmp = dest.with_name(dest.name + ".tmp")
  with tarfile.open(tmp, "w:gz") as tf:
    for f in sorted(out.glob("*")):  # this run's files only (not subfolders of older results)
      if f.is_file() and not f.name.endswith(".tmp") and f.resolve() != dest.resolve():
        tf.add(f, arcname=f"{out.name}/{f.name}")
  os.replace(tmp, dest)


def run_stage(name, args, mode, out: Path, deadline: float, timeout: float, extra: list[str]):
  cmd = [sys.executable, "-m", f"benchmarks.{name}", "--out", str(out), "--deadline",
         f"{deadline:.3f}"]
  if mode != "full":
    cmd.append(f"--{mode}")
  if args.tag:
    cmd += ["--tag", args.tag]
  cmd += extra
  print(f"\n[run_all] === {name}: soft {deadline - time.time():.0f} s, hard {timeout:.0f} s ===\n"
        f"[run_all] {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  t0 = time.time()
  rec = {"stage": name, "command": cmd, "soft_s": deadline - t0, "hard_s": timeout}
  try:
    p = subprocess.Popen(cmd, cwd=h.ROOT, env=env, process_group=0)
  except Exception as e:  # noqa: BLE001
    rec.update(status="failed to start", error=h.err_str(e), seconds=0.0)
    return rec
  try:
    rc = p.wait(timeout=max(1.0, timeout))
    rec.update(rc=rc, status="ok" if rc == 0 else f"exit {rc}")
  except subprocess.TimeoutExpired:
    _kill_group(p)
    rec.update(rc=None, status="killed (hard timeout)")
  except KeyboardInterrupt:
    _kill_group(p)
    raise
  rec["seconds"] = time.time() - t0
  return rec


def finish_stage(name, out: Path, tag, force_render=False):
  """Render a stage whose process died before rendering, and return its summary text."""
  base = out / h.out_name(name, tag)
  if not base.with_suffix(".json").exists():
    return None, "no results file"
  try:
    mod = importlib.import_module(f"benchmarks.{name}")
    data = h.read_json(base.with_suffix(".json"))
    if force_render or data.get("status") != "done" or not base.with_suffix(".md").exists():
      mod.render(data, base)
    skipped = sum(1 for c in data.get("cells", []) if c.get("status") == "skipped")
    return data, (f"{len(data.get('cells', []))} cells ({skipped} skipped), status {data.get('status')}\n"
                  f"{mod.summary(data)}")
  except Exception as e:  # noqa: BLE001
    return None, f"could not render/summarise: {h.err_str(e)}"


def main(argv=None):
  args = build_parser().parse_args(argv)
  mode = _mode(args)
  if mode != "smoke" and not h.gpu_in_subprocess():
    print(f"[run_all] no GPU: running the CPU smoke size instead of --{mode}", flush=True)
    mode = "smoke"
  t_start = time.time()
  budget = args.budget_s if args.budget_s is not None else DEFAULT_BUDGET_S[mode]
  grace = args.grace_s if args.grace_s is not None else (60.0 if mode == "smoke" else 45.0)
  hard_end = t_start + budget
  stages = [s for s in (args.only or STAGES) if s in KNOWN and s not in args.skip]
  bad = [s for s in (args.only or []) + args.skip if s not in KNOWN]
  if bad:
    raise SystemExit(f"unknown stages {bad}; known: {', '.join(KNOWN)}")
  extra = {s: [] for s in KNOWN}
  for item in args.stage_args:
    name, _, rest = item.partition("=")
    if name not in extra:
      raise SystemExit(f"--stage-args: unknown stage {name!r}")
    extra[name] += shlex.split(rest)
  os.environ["FA2_BENCH_PARENT_CMD"] = h.command_line()
  # No jax backend here: the GPU is left to the stages.
  info = h.device_info(init_backend=False)
  out = h.resolve_out(args, dict(info, backend="cpu" if mode == "smoke" else None)).resolve()
  print(f"[run_all] mode {mode}, budget {budget:.0f} s, stages {', '.join(stages)}, out {out}",
        flush=True)
  weights = WEIGHTS
  records, summaries = [], {}
  reserve = 15.0  # for the final rendering and the archive
  for i, name in enumerate(stages):
    now = time.time()
    left = hard_end - now - reserve
    wsum = sum(weights[s] for s in stages[i:])
    share = left * weights[name] / wsum
    if share < (5.0 if mode == "smoke" else 20.0):
      records.append({"stage": name, "status": f"not run: {max(0.0, left):.0f} s left"})
      summaries[name] = "not run: out of time budget"
      print(f"[run_all] {name}: not run, {max(0.0, left):.0f} s left", flush=True)
      continue
    timeout = min(share + grace, hard_end - now)
    deadline = now + share
    rec = run_stage(name, args, mode, out, deadline, timeout, extra[name])
    # A crash (not a timeout) of a stage that can resume: go on from its JSON, without the cell that
    # was running when it died.
    tries = 0
    while (rec.get("rc") not in (0, None) and name in RESUMABLE and tries < 2
           and deadline - time.time() > (5.0 if mode == "smoke" else 20.0)):
      tries += 1
      now2 = time.time()
      print(f"[run_all] {name} crashed ({rec.get('status')}); resuming (try {tries})", flush=True)
      r2 = run_stage(name, args, mode, out, deadline, min(deadline + grace, hard_end) - now2,
                     extra[name] + ["--resume"])
      r2["seconds"] = r2.get("seconds", 0.0) + rec.get("seconds", 0.0)
      r2["status"] = f"{r2.get('status')} after {tries} resume(s) (first: {rec.get('status')})"
      r2["first"] = rec.get("first", rec)
      rec = r2
    _, text = finish_stage(name, out, args.tag, force_render=rec.get("status") != "ok")
    summaries[name] = text
    records.append(rec)
    print(f"[run_all] {name}: {rec.get('status')} in {rec.get('seconds', 0):.0f} s", flush=True)
    if args.archive:
      try:
        _archive(out, args.archive)
      except Exception as e:  # noqa: BLE001
        print(f"[run_all] archive failed: {h.err_str(e)}", flush=True)
  total = time.time() - t_start
  overview = h.md_table(["stage", "status", "seconds", "soft budget s"],
                        [[r["stage"], r.get("status"), h.fmt_num(r.get("seconds"), ".0f"),
                          h.fmt_num(r.get("soft_s"), ".0f")] for r in records])
  md = ["# Benchmarks: run_all", ""] + h.meta_lines(dict(info, parent_command=None)) + [
      f"- mode {mode}, budget {budget:.0f} s, used {total:.0f} s", "", overview, ""]
  for name in stages:
    md += [f"## {name}", "", "```", (summaries.get(name) or "").strip(), "```", ""]
  (out / h.out_name("run_all", args.tag, "md")).write_text("\n".join(md) + "\n")
  h.write_json(out / h.out_name("run_all", args.tag, "json"),
               {"meta": info, "mode": mode, "budget_s": budget, "seconds": total,
                "stages": records, "out": str(out)})
  if args.archive:
    try:
      _archive(out, args.archive)
    except Exception as e:  # noqa: BLE001
      print(f"[run_all] archive failed: {h.err_str(e)}", flush=True)
  # Last: the summary (a log's tail keeps it).
  print("\n" + "=" * 30 + " SUMMARY " + "=" * 30)
  print(f"{info.get('gpu_name') or 'cpu'} | jax {info['versions'].get('jax')} | mode {mode} | "
        f"{total:.0f} s of {budget:.0f} | out {out}"
        + (f" | archive {args.archive}" if args.archive else ""))
  for name in stages:
    text = (summaries.get(name) or "").strip()
    cap = SUMMARY_CHARS.get(name, 1500)
    if len(text) > cap:
      text = text[:cap].rsplit("\n", 1)[0] + f"\n  … (cut; see {h.out_name(name, args.tag, 'md')})"
    print(f"--- {name}: {text}")
  print(overview)
  return {"out": str(out), "stages": records}


if __name__ == "__main__":
  main()
