"""GPU check + block-size sweep for the Triton kernels, beside cuDNN and XLA in the same process.

Run on the GPU machine:  python scripts/gpu_tune.py --out $OUT/tune.json [--quick]
Prints a short table last. Timing: jit, warm-up, then the median over `reps` of `iters` back-to-back
calls, each rep synchronised (the anchors' method). FLOPs: fwd = 4·B·N·T·S·H (halved when causal),
bwd = 2.5·fwd, fwd+bwd = 3.5·fwd; bwd time = (fwd+bwd) − fwd.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp

import fa2_jax


def timeit(fn, args, iters=10, reps=5):
  out = fn(*args)
  jax.block_until_ready(out)
  out = fn(*args)
  jax.block_until_ready(out)
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(iters):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / iters)
  return statistics.median(times)


def make_fns(attn):
  fwd = jax.jit(lambda q, k, v: attn(q, k, v))

  def loss(q, k, v, do):
    return jnp.sum(attn(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))

  fb = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  return fwd, fb


def measure(attn, b, t, n, h, causal, dtype=jnp.bfloat16):
  ks = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (jax.random.normal(kk, (b, t, n, h), jnp.float32).astype(dtype) for kk in ks)
  fwd, fb = make_fns(lambda q, k, v: attn(q, k, v, causal))
  tf = timeit(fwd, (q, k, v))
  tfb = timeit(fb, (q, k, v, do))
  flops = 4 * b * n * t * t * h * (0.5 if causal else 1.0)
  return dict(fwd=flops / tf / 1e12, bwd=2.5 * flops / max(tfb - tf, 1e-9) / 1e12,
              fwdbwd=3.5 * flops / tfb / 1e12, t_fwd_ms=tf * 1e3, t_fwdbwd_ms=tfb * 1e3)


def impl_ours(blocks=None, deterministic=False):
  return lambda q, k, v, c: fa2_jax.flash_attention(q, k, v, is_causal=c, block_sizes=blocks,
                                                     deterministic=deterministic,
                                                     implementation="triton")


def impl_jax(name):
  return lambda q, k, v, c: jax.nn.dot_product_attention(q, k, v, is_causal=c, implementation=name)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="tune.json")
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--sweep", action="store_true")
  args = ap.parse_args()
  rows = []

  def run(label, attn, b, t, n, h, causal):
    try:
      r = measure(attn, b, t, n, h, causal)
    except Exception as e:  # noqa: BLE001 - record and go on
      r = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
      traceback.print_exc(file=sys.stderr)
    r.update(label=label, b=b, t=t, n=n, h=h, causal=causal)
    rows.append(r)
    print(json.dumps(r), flush=True)
    with open(args.out, "w") as f:
      json.dump(dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__, rows=rows), f,
                indent=1)

  shapes = [(2, 8192, 16, 128), (2, 8192, 32, 64)]
  if not args.quick:
    shapes += [(8, 2048, 16, 128)]
  for (b, t, n, h), causal in itertools.product(shapes, (False, True)):
    run("cudnn", impl_jax("cudnn"), b, t, n, h, causal)
    run("xla", impl_jax("xla"), b, t, n, h, causal)
    run("ours", impl_ours(), b, t, n, h, causal)

  if args.sweep:
    for h in (128, 64):
      base = fa2_jax.BlockSizes.default(h)
      n = 16 if h == 128 else 32
      for causal in (False, True):
        for bq, bk, w, st in [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (64, 128, 8, 2),
                              (32, 128, 4, 2), (128, 128, 8, 1), (64, 32, 4, 3)]:
          if h == 128 and bq * bk >= 128 * 128 and st > 1:
            continue
          blk = dataclasses.replace(base, block_q_dkv=bq, block_k_dkv=bk, block_q_dq=bk,
                                    block_k_dq=bq, num_warps_bwd=w, num_stages_bwd=st)
          run(f"bwd q{bq} k{bk} w{w} s{st}", impl_ours(blk), 2, 8192, n, h, causal)
      for bq, bk, w, st in [(128, 128, 8, 3), (128, 64, 8, 3), (64, 128, 4, 2), (128, 128, 8, 2)]:
        blk = dataclasses.replace(base, block_q=bq, block_k=bk, num_warps_fwd=w, num_stages_fwd=st)
        run(f"fwd q{bq} k{bk} w{w} s{st}", impl_ours(blk), 2, 8192, n, h, True)

  print("\nlabel | B T N H causal | fwd / bwd / fwd+bwd TFLOP/s")
  for r in rows:
    cell = (f"{r['fwd']:.0f} / {r['bwd']:.0f} / {r['fwdbwd']:.0f}" if "fwd" in r
            else r["error"][:90])
    print(f"{r['label']:24s} | {r['b']} {r['t']} {r['n']} {r['h']} {int(r['causal'])} | {cell}")


if __name__ == "__main__":
  main()
