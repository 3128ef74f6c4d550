"""Sweep the causal launch-order section size (MosaicConfig.lpt_heads) per Mosaic kernel.

    python3 scripts/diag/lpt_sweep.py --shapes "2,8192,16,128;1,16384,16,128" --heads 1,2,4,8,16

Times forward, dK/dV and dQ on their own (causal, bf16) for each ``lpt_heads`` (1 = longest first
within each head only; 0 = the automatic L2-budget choice, whose value is printed) with the method of
benchmarks.common.time_throughput. GPU only.
"""
import argparse
import importlib
import json

import jax
import jax.numpy as jnp

from benchmarks import common as C
from fa2_jax.kernels.mosaic.common import MosaicConfig, causal_section

B = importlib.import_module("fa2_jax.kernels.mosaic.backward")
F = importlib.import_module("fa2_jax.kernels.mosaic.forward")  # the package re-exports a function

ap = argparse.ArgumentParser()
ap.add_argument("--shapes", default="2,8192,16,128;1,16384,16,128;2,8192,32,64;8,2048,16,128")
ap.add_argument("--heads", default="0,1,2,4,8,16")
ap.add_argument("--json", default=None)
args = ap.parse_args()

rows = []
for shape in args.shapes.split(";"):
  b, t, n, h = map(int, shape.split(","))
  ks = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (jax.random.normal(kk, (b, t, n, h), jnp.float32).astype(jnp.bfloat16) for kk in ks)
  scale = h ** -0.5
  base = MosaicConfig.default(h, q.dtype, True)
  out, lse = jax.jit(lambda q, k, v: F.forward(q, k, v, scale=scale, is_causal=True, config=base))(q, k, v)
  delta, lse2 = jax.jit(B.prologue)(out, do, lse)
  per_head = 2 * t * h * 2  # K+V (forward, dQ) or Q+dO (dK/dV) of one head, bf16; no GQA here
  auto = {name: causal_section(base, n_bh=b * n, group=1, kv_bytes=per_head, dkv=name == "dK/dV")
          for name in ("forward", "dK/dV", "dQ")}
  for lh in map(int, args.heads.split(",")):
    cfg = base.replace(lpt_heads=lh, lpt_heads_dkv=lh)
    common = dict(scale=scale, is_causal=True, cfg=cfg, emulate=False)
    fwd = jax.jit(lambda q, k, v, cfg=cfg: F.forward(q, k, v, scale=scale, is_causal=True, config=cfg))
    kern = {
        "forward": lambda: fwd(q, k, v),
        "dK/dV": lambda: B._dkv_call(q, k, v, do, lse2, delta, seq_q=t, want_dk=True, want_dv=True,
                                     num_wgs=cfg.num_wgs_dkv, **common),
        "dQ": lambda: B._dq_call(q, k, v, do, lse2, delta, seq_k=t, **common),
    }
    for name, fn in kern.items():
      stats, _ = C.time_throughput(lambda: fn(), ())
      sec = auto[name] if lh == 0 else min(lh, b * n)
      row = dict(shape=shape, kernel=name, lpt_heads=lh, section=sec, ms=stats["median_s"] * 1e3,
                 spread=stats["spread"])
      rows.append(row)
      print(json.dumps(row), flush=True)

if args.json:
  with open(args.json, "w") as f:
    json.dump(rows, f, indent=1)
heads = list(map(int, args.heads.split(",")))
print(f"\nms per call, causal; columns lpt_heads ({', '.join(map(str, heads))}; 0 = auto, section in [])")
for shape in args.shapes.split(";"):
  for name in ("forward", "dK/dV", "dQ"):
    rs = {r["lpt_heads"]: r for r in rows if r["shape"] == shape and r["kernel"] == name}
    cells = [f"{rs[x]['ms']:.3f}" + (f" [{rs[x]['section']}]" if x == 0 else "") for x in heads if x in rs]
    print(f"{shape:<16} {name:<8} " + "  ".join(cells))
