"""Time each Mosaic kernel on its own (forward, dK/dV, dK/dV with fused dQ, dQ) beside cuDNN.

    python3 scripts/diag/kernel_times.py [--shapes 2,8192,16,128;2,8192,32,64] [--causal both]

Where does the backward's time go? The fwd+bwd benchmark only sees the sum. For every shape and
mask this prints milliseconds per call and TFLOP/s counted with the matmuls each kernel really does
(fwd: 2 per tile pair; dK/dV: 4 (S^T, dP^T, dV, dK); fused dK/dV: 5 (+ dQ); dQ: 3 (S, dP, dQ)),
plus the XLA prologue (delta, lse in base 2) and cuDNN's fwd and fwd+bwd for scale. Same method as
benchmarks.common.time_throughput (median of reps of back-to-back calls). GPU only.
"""
import argparse
import json
import sys

import jax
import jax.numpy as jnp

from benchmarks import common as C
import importlib

B = importlib.import_module("fa2_jax.kernels.mosaic.backward")
F = importlib.import_module("fa2_jax.kernels.mosaic.forward")  # the package re-exports a function of that name
from fa2_jax.kernels.mosaic.common import MosaicConfig

ap = argparse.ArgumentParser()
ap.add_argument("--shapes", default="2,8192,16,128;2,8192,32,64", help="B,T,N,H;...")
ap.add_argument("--causal", default="both", choices=("both", "true", "false"))
ap.add_argument("--json", default=None, help="write the rows here")
args = ap.parse_args()
causals = {"both": (False, True), "true": (True,), "false": (False,)}[args.causal]

rows = []
for shape in args.shapes.split(";"):
  b, t, n, h = map(int, shape.split(","))
  ks = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (jax.random.normal(kk, (b, t, n, h), jnp.float32).astype(jnp.bfloat16) for kk in ks)
  scale = h ** -0.5
  for causal in causals:
    cfg = MosaicConfig.default(h, q.dtype, causal)
    pair_flops = 2.0 * b * n * t * t * h / (2 if causal else 1)  # one [T, S] x H matmul
    fwd = jax.jit(lambda q, k, v: F.forward(q, k, v, scale=scale, is_causal=causal, config=cfg))
    out, lse = fwd(q, k, v)
    prologue = jax.jit(B.prologue)
    delta, lse2 = prologue(out, do, lse)
    common = dict(scale=scale, is_causal=causal, cfg=cfg, emulate=False)
    kern = {
        "forward": (lambda: fwd(q, k, v), 2),
        "prologue (delta, lse2)": (lambda: prologue(out, do, lse), 0),
        "dK/dV": (lambda: B._dkv_call(q, k, v, do, lse2, delta, seq_q=t, want_dk=True, want_dv=True,
                                      num_wgs=cfg.num_wgs_dkv, **common), 4),
        "dK/dV + fused dQ": (lambda: B._dkv_call(
            q, k, v, do, lse2, delta, seq_q=t, want_dk=True, want_dv=True, num_wgs=cfg.num_wgs_dkv,
            fused_dq=True, **dict(common, cfg=cfg.replace(dq_fused=True, num_stages_dkv=2))), 5),
        "dQ": (lambda: B._dq_call(q, k, v, do, lse2, delta, seq_k=t, **common), 3),
    }
    if causal:  # the previous launch order, for comparison
      hcfg = cfg.replace(lpt_heads=1, lpt_heads_dkv=1)
      hc = dict(common, cfg=hcfg)
      fwd_h = jax.jit(lambda q, k, v: F.forward(q, k, v, scale=scale, is_causal=causal, config=hcfg))
      kern["forward [head order]"] = (lambda: fwd_h(q, k, v), 2)
      kern["dK/dV [head order]"] = (lambda: B._dkv_call(
          q, k, v, do, lse2, delta, seq_q=t, want_dk=True, want_dv=True, num_wgs=cfg.num_wgs_dkv,
          **hc), 4)
      kern["dQ [head order]"] = (lambda: B._dq_call(q, k, v, do, lse2, delta, seq_k=t, **hc), 3)
    cud = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                       implementation="cudnn")
    cud_fb = C.fwd_bwd(cud)
    kern["cuDNN fwd"] = (lambda: jax.jit(cud)(q, k, v), 2)
    kern["cuDNN fwd+bwd"] = (lambda: cud_fb(q, k, v, do), 7)
    ours_fb = {det: C.fwd_bwd(lambda q, k, v, det=det: __import__("fa2_jax").flash_attention(
        q, k, v, is_causal=causal, implementation="mosaic", deterministic=det)) for det in (False, True)}
    kern["fa2_mosaic fwd+bwd"] = (lambda: ours_fb[False](q, k, v, do), 7)
    kern["fa2_mosaic det fwd+bwd"] = (lambda: ours_fb[True](q, k, v, do), 7)
    for name, (fn, mm) in kern.items():
      try:
        stats, _ = C.time_throughput(lambda: fn(), ())
        ms = stats["median_s"] * 1e3
        tf = mm * pair_flops / stats["median_s"] / 1e12 if mm else None
        row = dict(shape=shape, causal=causal, kernel=name, ms=ms, matmuls=mm, tflops=tf,
                   spread=stats["spread"])
      except Exception as e:  # noqa: BLE001 - report and go on
        row = dict(shape=shape, causal=causal, kernel=name, error=f"{type(e).__name__}: {e}"[:300])
      rows.append(row)
      print(json.dumps(row), flush=True)

if args.json:
  with open(args.json, "w") as f:
    json.dump(rows, f, indent=1)
print(f"\n{'shape':<16} {'causal':<6} {'kernel':<24} {'ms':>8} {'TFLOP/s':>8}")
for r in rows:
  tf = f"{r['tflops']:.0f}" if r.get("tflops") else "-"
  ms = f"{r['ms']:.3f}" if "ms" in r else r.get("error", "")[:60]
  print(f"{r['shape']:<16} {str(r['causal']):<6} {r['kernel']:<24} {ms:>8} {tf:>8}")
sys.exit(0)
