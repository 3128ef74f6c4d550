"""The issue-5 cells measured exactly the way ../shared/anchors/anchor_bench_tokamax.py measured them,
with cuDNN, tokamax "mosaic" and fa2_jax's Mosaic backend in one process.

    python3 scripts/diag/anchor_method.py [--json OUT.json] [--rounds 2]

The anchors' method differs from benchmarks.attention in two details: fwd+bwd is
``jit(grad(lambda q, k, v: f(q, k, v).astype(f32).sum(), argnums=(0, 1, 2)))`` (a cotangent of ones,
not a random one), and inputs are ``jax.random.normal(key, shape, bf16)``; timing is the same (median
of 5 reps of 10 back-to-back calls after 2 warm-up calls). ``--rounds`` repeats every cell, with the
implementations in a different order each round, so clock drift shows as a spread instead of a bias.
"""
import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import fa2_jax

ap = argparse.ArgumentParser()
ap.add_argument("--json", default=None)
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--impls", default="cudnn,fa2_mosaic,fa2_mosaic_det,tokamax_mosaic",
                help="also: fa2_mosaic_head (lpt_heads=1), fa2_mosaic_fused (fused dQ forced), "
                     "fa2_mosaic_fused_head (both)")
ap.add_argument("--causal", default="both", choices=("both", "true", "false"))
ap.add_argument("--cells", default="8,16,2048,128;2,16,8192,128;1,16,16384,128;2,32,8192,64;8,32,2048,64",
                help="B,N,T,H;... (the anchors' shapes)")
args = ap.parse_args()


def bench(fn, a, iters=10, reps=5):  # the anchors' timing loop
  out = fn(*a); jax.block_until_ready(out)
  out = fn(*a); jax.block_until_ready(out)
  ts = []
  for _ in range(reps):
    t = time.perf_counter()
    for _ in range(iters):
      out = fn(*a)
    jax.block_until_ready(out)
    ts.append((time.perf_counter() - t) / iters)
  return float(np.median(ts))


def impl_fn(name, causal):
  if name == "cudnn":
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
  if name == "tokamax_mosaic":
    import tokamax
    return lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=causal, implementation="mosaic")
  det = name == "fa2_mosaic_det"

  def f(q, k, v):
    cfg = None
    if name in ("fa2_mosaic_head", "fa2_mosaic_fused", "fa2_mosaic_fused_head"):
      cfg = fa2_jax.MosaicConfig.default(q.shape[-1], q.dtype, causal)
      if name.endswith("head"):
        cfg = cfg.replace(lpt_heads=1, lpt_heads_dkv=1)
      if "fused" in name:
        cfg = cfg.replace(dq_fused=True, num_stages_dkv=2)
    return fa2_jax.flash_attention(q, k, v, is_causal=causal, implementation="mosaic",
                                   deterministic=det, block_sizes=cfg)
  return f


impls = args.impls.split(",")
if "tokamax_mosaic" in impls:
  try:
    import tokamax  # noqa: F401
  except Exception as e:  # noqa: BLE001
    print("tokamax not importable:", e)
    impls.remove("tokamax_mosaic")
causals = {"both": (False, True), "true": (True,), "false": (False,)}[args.causal]

rows = []
for cell in args.cells.split(";"):
  b, n, t, h = map(int, cell.split(","))
  for causal in causals:
    ks = jax.random.split(jax.random.key(t + h), 3)
    q, k, v = (jax.random.normal(kk, (b, t, n, h), jnp.bfloat16) for kk in ks)
    fl = 4.0 * b * n * t * t * h / (2 if causal else 1)
    fns = {}
    for name in impls:
      f = impl_fn(name, causal)
      fns[name] = (jax.jit(f), jax.jit(jax.grad(lambda q, k, v, f=f: f(q, k, v).astype(jnp.float32).sum(),
                                                argnums=(0, 1, 2))))
    for rnd in range(args.rounds):
      order = impls if rnd % 2 == 0 else impls[::-1]
      for name in order:
        ff, g = fns[name]
        row = dict(impl=name, b=b, n=n, t=t, h=h, causal=causal, round=rnd)
        try:
          tf = bench(ff, (q, k, v))
          tb = bench(g, (q, k, v))
          row.update(fwd=fl / tf / 1e12, bwd=2.5 * fl / (tb - tf) / 1e12, fwdbwd=3.5 * fl / tb / 1e12)
        except Exception as e:  # noqa: BLE001
          row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)

meta = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
            method="anchors (../shared/anchors/anchor_bench_tokamax.py): grad of f32 sum, median 5x10")
if args.json:
  with open(args.json, "w") as fh:
    json.dump(dict(meta=meta, rows=rows), fh, indent=1)
print("\nmedian over rounds, fwd / bwd / fwd+bwd TFLOP/s")
for cell in args.cells.split(";"):
  b, n, t, h = map(int, cell.split(","))
  for causal in causals:
    line = f"h{h} T={t:<6} {'causal' if causal else 'nc':<6}"
    for name in impls:
      rs = [r for r in rows if (r["t"], r["h"], r["causal"], r["impl"]) == (t, h, causal, name) and "fwd" in r]
      if rs:
        med = [float(np.median([r[x] for r in rs])) for x in ("fwd", "bwd", "fwdbwd")]
        line += f" | {name} {med[0]:.0f}/{med[1]:.0f}/{med[2]:.0f}"
      else:
        line += f" | {name} ✗"
    print(line)
os.sys.exit(0)
