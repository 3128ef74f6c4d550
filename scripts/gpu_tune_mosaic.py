"""Tile / pipeline sweep of the Mosaic GPU (Hopper) kernels, beside cuDNN in the same process.

Run on an H100/H200:  python scripts/gpu_tune_mosaic.py --out $OUT/tune_mosaic.json [--budget-s 300]

Each (head_dim, seq, causal) shape is timed with the default ``MosaicConfig`` and with one knob
changed at a time: forward variants time the forward kernel alone; dK/dV and dQ variants time the
backward kernels alone (``backward(...)`` on a saved forward), so a change shows up undiluted.
Shapes follow the paper's grid: 16k tokens (batch = 16384 / seq), hidden 2048. FLOPs: fwd =
4·B·N·T²·H (halved when causal), bwd = 2.5·fwd. Timing: jit, 2 warm-ups, median of 5 repetitions of
back-to-back calls (benchmarks.common.time_throughput). Prints a short table last.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import jax
import jax.numpy as jnp

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))  # the repo root
from benchmarks import common as C
from fa2_jax.kernels import mosaic
from fa2_jax.kernels.mosaic import MosaicConfig

FWD_VARIANTS = {
    128: [dict(block_k=64, num_stages=2), dict(block_k=64, num_stages=3),
          dict(block_k=64, num_stages=4), dict(pingpong=False)],
    64: [dict(num_stages=2), dict(num_stages=4), dict(block_k=192, num_stages=3),
         dict(block_k=256, num_stages=2), dict(block_k=256, num_stages=3), dict(pingpong=False)],
}
BWD_VARIANTS = {
    128: [dict(dq_fused=True), dict(num_stages_dkv=3), dict(block_q_dkv=128), dict(block_k_dq=128),
          dict(num_stages_dq=3), dict(block_k_dq=128, num_stages_dq=1)],
    64: [dict(dq_fused=True, num_stages_dkv=2), dict(dq_fused=True, block_q_dkv=64),
         dict(num_stages_dkv=3), dict(num_stages_dkv=4), dict(block_q_dkv=128),
         dict(block_q_dkv=128, num_stages_dkv=3), dict(block_k_dq=128), dict(num_stages_dq=3),
         dict(block_k_dq=128, num_stages_dq=3)],
}
SHAPES = [(128, 8192), (64, 8192), (64, 2048), (128, 2048)]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="tune_mosaic.json")
  ap.add_argument("--budget-s", type=float, default=300.0)
  args = ap.parse_args()
  deadline = time.time() + args.budget_s
  rows = []

  def record(r):
    rows.append(r)
    print(json.dumps(r), flush=True)
    with open(args.out, "w") as f:
      json.dump(dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                     command=" ".join(sys.argv), rows=rows), f, indent=1)

  for (h, seq), causal in [(s, c) for s in SHAPES for c in (False, True)]:
    if time.time() > deadline:
      break
    b, n = 16384 // seq, 2048 // h
    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(kk, (b, seq, n, h), jnp.float32).astype(jnp.bfloat16)
                   for kk in ks)
    flops = 4 * b * n * seq * seq * h * (0.5 if causal else 1.0)
    scale = h ** -0.5
    base = MosaicConfig.default(h, jnp.bfloat16, causal)
    shape = dict(h=h, seq=seq, b=b, n=n, causal=causal)

    # cuDNN beside it (forward, and backward as fwd+bwd minus fwd).
    try:
      f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                        implementation="cudnn")
      tf, _ = C.time_throughput(jax.jit(f), (q, k, v))
      tfb, _ = C.time_throughput(C.fwd_bwd(f), (q, k, v, do))
      record(dict(shape, label="cudnn", fwd=flops / tf["median_s"] / 1e12,
                  bwd=2.5 * flops / (tfb["median_s"] - tf["median_s"]) / 1e12,
                  fwdbwd=3.5 * flops / tfb["median_s"] / 1e12))
    except Exception as e:  # noqa: BLE001
      record(dict(shape, label="cudnn", error=C.err_str(e)))

    def fwd_time(cfg):
      fn = jax.jit(lambda q, k, v: mosaic.forward(q, k, v, scale=scale, is_causal=causal,
                                                  config=cfg))
      st, out = C.time_throughput(fn, (q, k, v))
      return st["median_s"], out

    def bwd_time(cfg, out, lse):
      fn = jax.jit(lambda q, k, v, o, l, d: mosaic.backward(
          q, k, v, o, l, d, scale=scale, is_causal=causal, config=cfg,
          deterministic=not cfg.dq_fused))
      st, _ = C.time_throughput(fn, (q, k, v, out, lse, do))
      return st["median_s"]

    out = lse = None
    for kind, variants in (("fwd", [{}] + FWD_VARIANTS[h]), ("bwd", [{}] + BWD_VARIANTS[h])):
      for var in variants:
        if time.time() > deadline:
          break
        label = f"{kind} " + (",".join(f"{a}={b}" for a, b in var.items()) or "default")
        try:
          cfg = base.replace(**var)
          if (why := cfg.check(h)) is not None:
            record(dict(shape, label=label, error=why))
            continue
          if kind == "fwd":
            t, res = fwd_time(cfg)
            if not var:
              out, lse = res
            record(dict(shape, label=label, fwd=flops / t / 1e12, ms=t * 1e3))
          else:
            t = bwd_time(cfg, out, lse)
            record(dict(shape, label=label, bwd=2.5 * flops / t / 1e12, ms=t * 1e3))
        except Exception as e:  # noqa: BLE001 - record and go on
          traceback.print_exc(file=sys.stderr)
          record(dict(shape, label=label, error=C.err_str(e, 300)))

  print("\nh seq causal | label | TFLOP/s (fwd or bwd; cudnn: fwd / bwd / fwd+bwd)")
  for r in rows:
    if "error" in r:
      val = "ERR " + r["error"][:80]
    elif r["label"] == "cudnn":
      val = f"{r['fwd']:.0f} / {r['bwd']:.0f} / {r['fwdbwd']:.0f}"
    else:
      val = f"{r.get('fwd', r.get('bwd')):.0f}"
    print(f"{r['h']} {r['seq']} {int(r['causal'])} | {r['label']:38s} | {val}")


if __name__ == "__main__":
  main()
