"""Tile and pipeline sweeps of fa2_jax's kernels: each setting against the default, in one process.

  --backend triton   ``BlockSizes`` grids (every combination): the forward's tiles and launch settings,
                     the dK/dV kernel's and the dQ kernel's (the two backward kernels share
                     num_warps_bwd / num_stages_bwd)
  --backend mosaic   ``MosaicConfig`` changed one knob at a time (Hopper): forward tiles, ring depth and
                     pingpong; backward tiles, ring depths and fused dQ; for causal calls the launch
                     order's section size (``lpt_heads`` / ``lpt_heads_dkv``: 1 = longest first within
                     each head, n = sections of n heads; the default 0 sizes them from the L2 budget)

Cases: the paper grid's shapes (16k tokens, hidden 2048) at head_dim 128 and 64, seq 8k (and 2k without
``--quick``), causal and not. Forward settings time the forward; backward settings time forward+backward,
and their backward time is that minus the default forward's. Calls go through the public API
(``fa2_jax.flash_attention(implementation=..., block_sizes=...)``), timed as benchmarks/timing.py says.
The md ends with the best setting per (head_dim, causal, pass) over the cases.

    python -m benchmarks.tune --backend mosaic [--quick] [--head-dims 128] [--seqs 8k] [--budget-s 500]
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time

from . import harness as h
from . import impls
from .timing import attention_flops, measure, tflops

STEM = "tune"
# Triton: {sweep: {field: values}}; the product of the values is timed. "fwd" is timed forward only.
TRITON_GRIDS = {
    "full": {
        "fwd": dict(block_q=[64, 128], block_k=[64, 128], num_warps_fwd=[4, 8], num_stages_fwd=[2, 3]),
        "bwd_dkv": dict(block_q_dkv=[32, 64], block_k_dkv=[64, 128], num_warps_bwd=[4, 8],
                        num_stages_bwd=[2, 3]),
        "bwd_dq": dict(block_q_dq=[64, 128], block_k_dq=[32, 64], num_warps_bwd=[4, 8],
                       num_stages_bwd=[2, 3]),
    },
    "quick": {
        "fwd": dict(block_q=[64, 128], block_k=[64, 128]),
        "bwd_dkv": dict(block_q_dkv=[32, 64], block_k_dkv=[64, 128]),
        "bwd_dq": dict(block_q_dq=[64, 128], block_k_dq=[32, 64]),
    },
    "smoke": {
        "fwd": dict(block_q=[16, 32], block_k=[16]),
        "bwd_dkv": dict(block_q_dkv=[16], block_k_dkv=[16, 32]),
    },
}
# Mosaic: one change at a time per head_dim (fields of MosaicConfig).
MOSAIC_FWD = {
    128: [dict(block_k=64, num_stages=2), dict(block_k=64, num_stages=3), dict(block_k=64, num_stages=4),
          dict(pingpong=False)],
    64: [dict(num_stages=2), dict(block_k=192, num_stages=3),
         dict(block_k=256, num_stages=2), dict(pingpong=False)],
}
MOSAIC_BWD = {
    128: [dict(dq_fused=True, dq_fused_min_t=0), dict(dq_fused=False), dict(num_stages_dkv=3), dict(block_q_dkv=128),
          dict(block_k_dq=128), dict(num_stages_dq=3)],
    64: [dict(dq_fused=True, dq_fused_min_t=0, num_stages_dkv=2), dict(dq_fused=False), dict(num_stages_dkv=3),
         dict(block_q_dkv=128), dict(block_k_dq=128), dict(num_stages_dq=3)],
}
LPT_HEADS = (1, 2, 4, 8, 16)  # causal launch-order sections swept (0, the L2 default, is the baseline)


def build_parser():
  p = h.script_parser("tune", __doc__)
  p.add_argument("--backend", choices=["triton", "mosaic"], default="triton")
  p.add_argument("--head-dims", type=h.parse_ints, default=None)
  p.add_argument("--seqs", type=h.parse_ints, default=None)
  p.add_argument("--causal", choices=["both", "true", "false"], default="both")
  h.add_common_args(p, counts=True)
  return p


def cases(args):
  causals = h.masks(args.causal)
  if args.smoke:
    return [dict(batch=1, heads=2, seq=64, head_dim=32, causal=c) for c in causals[:1]]
  hds = args.head_dims or [128, 64]
  seqs = args.seqs or ([8192] if args.quick else [8192, 2048])
  return [dict(batch=max(1, 16384 // s), heads=2048 // d, seq=s, head_dim=d, causal=c)
          for d in hds for s in seqs for c in causals]


def variants(backend, case, grid):
  """``[(sweep, pass, changes)]`` of one case; the first is the default (no changes)."""
  out = [("default", "fwd+bwd", {})]
  if backend == "triton":
    for sweep, g in TRITON_GRIDS[grid].items():
      out += [(sweep, "fwd" if sweep == "fwd" else "fwd+bwd", dict(zip(g, vals)))
              for vals in itertools.product(*g.values())]
    return out
  out += [("fwd", "fwd", v) for v in MOSAIC_FWD.get(case["head_dim"], [])]
  out += [("bwd", "fwd+bwd", v) for v in MOSAIC_BWD.get(case["head_dim"], [])]
  if case["causal"]:
    out += [("fwd", "fwd", dict(lpt_heads=n)) for n in LPT_HEADS]
    out += [("bwd", "fwd+bwd", dict(lpt_heads=n, lpt_heads_dkv=n)) for n in LPT_HEADS]
  return out


def _config(backend, case, changes):
  """The config with ``changes``, or a string saying why it is not a valid one."""
  import jax.numpy as jnp
  import fa2_jax
  try:
    if backend == "triton":
      return dataclasses.replace(fa2_jax.BlockSizes.default(case["head_dim"], jnp.bfloat16), **changes)
    cfg = fa2_jax.MosaicConfig.default(case["head_dim"], jnp.bfloat16, case["causal"]).replace(**changes)
  except (TypeError, ValueError) as e:
    return h.err_str(e)
  return cfg.check(case["head_dim"]) or cfg


def _case_id(c):
  return tuple(c[k] for k in ("batch", "heads", "seq", "head_dim", "causal"))


def cell_key(c):
  return (c.get("backend"), _case_id(c), c.get("sweep"), tuple(sorted((c.get("changes") or {}).items())))


def run(args) -> dict:
  import jax.numpy as jnp
  import fa2_jax
  info = h.device_info()
  h.cpu_fallback(args, info, STEM)
  if args.backend == "mosaic" and not impls.is_hopper():
    raise SystemExit("--backend mosaic needs a Hopper GPU (compute capability 9.x)")
  grid = "smoke" if args.smoke else "quick" if args.quick else "full"
  todo = [(cs, *v) for cs in cases(args) for v in variants(args.backend, cs, grid)]
  args.tag = f"{args.backend}{'_' + args.tag if args.tag else ''}"
  run = h.Run(args, STEM, info, dict(
      backend=args.backend, cases=cases(args), grid=grid, iters=args.iters, reps=args.reps,
      method="benchmarks.timing; bwd = fwd+bwd - the default's fwd of the same case"), cell_key, len(todo))
  inputs_key, inputs, default_fwd = None, None, {}
  for cs, sweep, pass_, changes in todo:
    fl = attention_flops(cs["batch"], cs["heads"], cs["seq"], cs["seq"], cs["head_dim"], cs["causal"])
    cell = dict(cs, backend=args.backend, sweep=sweep, pass_=pass_, changes=changes, flops_fwd=fl,
                status="ok")
    run.bar.set_postfix_str(f"{sweep} {changes} T={cs['seq']} H={cs['head_dim']}")
    cfg = _config(args.backend, cs, changes)
    if isinstance(cfg, str):
      if run.rec.key(cell) not in run.rec.done:
        run.add(dict(cell, status="invalid", error=cfg), check=False)
      continue
    if run.skip(cell, sweep):
      continue
    run.begin(cell, sweep)
    t0 = time.time()
    try:
      if inputs_key != _case_id(cs):
        shape = (cs["batch"], cs["seq"], cs["heads"], cs["head_dim"])
        inputs = h.random_inputs(args.seed + cs["seq"] + cs["head_dim"], [shape] * 3, jnp.bfloat16)
        inputs_key = _case_id(cs)
      f = functools.partial(fa2_jax.flash_attention, is_causal=cs["causal"], block_sizes=cfg,
                            implementation=args.backend, interpret=True if args.smoke else None)
      res = measure(f, *inputs, flops_fwd=fl, iters=args.iters, reps=args.reps,
                    passes=("fwd", "fwd+bwd") if sweep == "default" else (pass_,))
      res.pop("out")
      cell.update(res, config=dataclasses.asdict(cfg))
      if sweep == "default" and "fwd" in res["ms"]:
        default_fwd[_case_id(cs)] = res["ms"]["fwd"]
      fwd_ms, fb_ms = default_fwd.get(_case_id(cs)), cell["ms"].get("fwd+bwd")
      if sweep != "default" and fwd_ms is not None and fb_ms is not None and fb_ms > fwd_ms:
        cell["ms"]["bwd"] = fb_ms - fwd_ms
        cell["tflops"]["bwd"] = tflops(fl, "bwd", cell["ms"]["bwd"] * 1e-3)
      errs = [v for k, v in res.items() if k.endswith("_error")]
      if errs:
        cell.update(status="error", error=errs[0])
    except Exception as e:  # noqa: BLE001
      cell.update(status="error", error=h.err_str(e))
    run.add(cell, kind=sweep, t0=t0)
  return run.finish(render, summary)


# --- rendering ------------------------------------------------------------------------------------------

def _metric(c):
  """The number a setting is judged by: forward TFLOP/s for forward settings, else backward."""
  return ((c.get("tflops") or {}).get("fwd" if c.get("sweep") == "fwd" else "bwd"))


def best_rows(cells):
  """Per case and sweep: the default's number, the best setting's, its gain; and over the cases of each
  (head_dim, causal, sweep) the setting with the best geometric mean relative to each case's best."""
  per_case, overall, groups = [], [], {}
  defaults = {_case_id(c): c for c in cells if c.get("sweep") == "default"}
  for c in cells:
    if c.get("sweep") != "default" and _metric(c):
      groups.setdefault((c["head_dim"], c["causal"], c["sweep"]), []).append(c)
  for (d, cz, sweep), lst in sorted(groups.items()):
    by_case: dict = {}
    for c in lst:
      by_case.setdefault(_case_id(c), []).append(c)
    scores: dict = {}
    for cid, cs in sorted(by_case.items()):
      best = max(cs, key=_metric)
      base = ((defaults.get(cid) or {}).get("tflops") or {}).get("fwd" if sweep == "fwd" else "bwd")
      per_case.append(dict(head_dim=d, causal=cz, sweep=sweep, seq=cid[2], batch=cid[0],
                           best=best["changes"], tflops=_metric(best), default_tflops=base,
                           gain=h.ratio(_metric(best), base), n=len(cs)))
      for c in cs:
        scores.setdefault(tuple(sorted(c["changes"].items())), []).append(_metric(c) / _metric(best))
    full = {k: v for k, v in scores.items() if len(v) == len(by_case)}
    if full:
      k = max(full, key=lambda k: sum(math.log(x) for x in full[k]))
      overall.append(dict(head_dim=d, causal=cz, sweep=sweep, best=dict(k), n_cases=len(by_case),
                          rel=math.exp(sum(math.log(x) for x in full[k]) / len(full[k]))))
  return per_case, overall


def render(data, base):
  cells, cfg = [c for c in data.get("cells", []) if "sweep" in c], data.get("config", {})
  lines = h.header(data, f"{cfg.get('backend', '')} kernel settings (bf16)") + [
      f"- method: {cfg.get('method')}", ""]
  per_case, overall = best_rows(cells)
  mask = lambda r: "causal" if r["causal"] else "non-causal"  # noqa: E731
  if overall:
    lines += ["## Best setting per (head_dim, causal, sweep)", "", h.md_table(
        ["head_dim", "mask", "sweep", "changes to the default", "× of per-case best", "cases"],
        [[o["head_dim"], mask(o), o["sweep"], f"`{o['best']}`", f"{o['rel']:.3f}", o["n_cases"]]
         for o in overall]), ""]
  if per_case:
    lines += ["## Best per case", "", h.md_table(
        ["head_dim", "mask", "sweep", "seq", "best changes", "TFLOP/s", "default", "gain", "settings"],
        [[r["head_dim"], mask(r), r["sweep"], f"{h.seq_label(r['seq'])} (B={r['batch']})", f"`{r['best']}`",
          h.fmt_tf(r["tflops"]), h.fmt_tf(r["default_tflops"]), h.fmt_num(r["gain"], ".2f"), r["n"]]
         for r in per_case]), ""]
  lines += h.failures([c for c in cells if c.get("status") != "skipped"],
                      lambda c: f"{c['sweep']} `{c['changes']}`",
                      lambda c: f"d{c['head_dim']} {h.seq_label(c['seq'])} {'c' if c['causal'] else 'nc'}",
                      keys=("error",))
  return [h.write_md(lines, base)]


def summary(data) -> str:
  _, overall = best_rows([c for c in data.get("cells", []) if "sweep" in c])
  return "\n".join([f"{STEM}: best setting per (head_dim, causal, sweep), × of each case's best"
                    + (f" ({h.SMOKE_CAVEAT})" if h.is_smoke(data) else "")] + [
      f"  d{o['head_dim']} {'c ' if o['causal'] else 'nc'} {o['sweep']:<8} {o['best']} ({o['rel']:.3f})"
      for o in overall])


def main(argv=None):
  return h.script_main(argv, build_parser(), run, render, summary, STEM, cell_key)


if __name__ == "__main__":
  main()
