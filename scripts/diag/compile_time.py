"""How compile time grows with the number of attention call sites in one jitted program (GPU).

    python scripts/diag/compile_time.py [--impls mosaic,triton] [--layers 1,2,4]
Prints lower / compile seconds of jit(grad) of L stacked causal attention calls (B=4, T=8192, N=8,
H=128, bf16: the GPT long8k preset's shape), and the run time of one call of the compiled program.
"""
import argparse
import time

import jax
import jax.numpy as jnp

import fa2_jax

ap = argparse.ArgumentParser()
ap.add_argument("--impls", default="mosaic,triton")
ap.add_argument("--layers", default="1,2,4")
ap.add_argument("--shape", default="4,8192,8,128")
args = ap.parse_args()
b, t, n, h = map(int, args.shape.split(","))
ks = jax.random.split(jax.random.key(0), 3)
q, k, v = (jax.random.normal(kk, (b, t, n, h), jnp.float32).astype(jnp.bfloat16) for kk in ks)
for impl in args.impls.split(","):
  for L in map(int, args.layers.split(",")):
    def loss(q, k, v):
      x = q
      for _ in range(L):
        x = fa2_jax.flash_attention(x, k, v, is_causal=True, implementation=impl)
      return jnp.sum(x.astype(jnp.float32))
    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    t0 = time.perf_counter()
    lo = g.lower(q, k, v)
    t1 = time.perf_counter()
    c = lo.compile()
    t2 = time.perf_counter()
    jax.block_until_ready(c(q, k, v))
    t3 = time.perf_counter()
    jax.block_until_ready(c(q, k, v))
    t4 = time.perf_counter()
    print(f"{impl:7s} L={L}: lower {t1 - t0:6.2f} s  compile {t2 - t1:6.2f} s  first run "
          f"{t3 - t2:6.3f} s  run {t4 - t3:6.3f} s", flush=True)
