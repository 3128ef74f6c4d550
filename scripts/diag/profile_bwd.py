"""Run one jitted forward+backward per implementation (for `ncu`), at the paper's 8k shape.

    ncu --clock-control none -k regex:'fa2_mosaic|sdpa|fmha|flash|cudnn' --launch-skip 0 \
        --launch-count 12 --section SpeedOfLight ... python3 scripts/diag/profile_bwd.py

B=2, T=S=8192, N=16, H=128 (``--shape``), bf16, non-causal unless ``--causal``. Each implementation's
program is compiled, run once to warm up and then run ``--runs`` more times, so that ncu sees the
kernels of a steady-state call. Prints the median wall time per call (without ncu it is a quick
timing check; under ncu the times include the replays and mean nothing).
"""
import argparse
import time

import jax
import jax.numpy as jnp

import fa2_jax

ap = argparse.ArgumentParser()
ap.add_argument("--impls", default="mosaic,mosaic_det,cudnn",
                help="mosaic (default settings), mosaic_det (deterministic=True), mosaic_fused (fused dQ "
                     "forced), triton, cudnn")
ap.add_argument("--shape", default="2,8192,16,128")
ap.add_argument("--causal", action="store_true")
ap.add_argument("--runs", type=int, default=1)
args = ap.parse_args()
b, t, n, h = map(int, args.shape.split(","))
ks = jax.random.split(jax.random.key(0), 4)
q, k, v, do = (jax.random.normal(kk, (b, t, n, h), jnp.float32).astype(jnp.bfloat16) for kk in ks)


def attention(impl):
  if impl == "cudnn":
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=args.causal,
                                                        implementation="cudnn")
  if impl == "mosaic_fused":
    cfg = fa2_jax.MosaicConfig.default(h, q.dtype, args.causal).replace(dq_fused=True)
    return lambda q, k, v: fa2_jax.flash_attention(q, k, v, is_causal=args.causal,
                                                   implementation="mosaic", block_sizes=cfg,
                                                   deterministic=False)
  if impl == "mosaic_det":
    return lambda q, k, v: fa2_jax.flash_attention(q, k, v, is_causal=args.causal,
                                                   implementation="mosaic", deterministic=True)
  return lambda q, k, v: fa2_jax.flash_attention(q, k, v, is_causal=args.causal, implementation=impl)


for impl in args.impls.split(","):
  f = attention(impl)
  g = jax.jit(lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do))
  jax.block_until_ready(g(q, k, v, do))
  times = []
  for _ in range(args.runs):
    t0 = time.perf_counter()
    jax.block_until_ready(g(q, k, v, do))
    times.append(time.perf_counter() - t0)
  times.sort()
  print(f"{impl:14s} fwd+bwd {1e3 * times[len(times) // 2]:.3f} ms/call (median of {args.runs})",
        flush=True)
