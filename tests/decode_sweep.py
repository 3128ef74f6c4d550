"""Time the decode kernels on a GPU against cuDNN and the training families (not a test: run it).

    python tests/decode_sweep.py                 # the default shapes, the default config
    python tests/decode_sweep.py --sweep         # and a grid of DecodeConfig settings per shape
    python tests/decode_sweep.py --shapes 1,1,32,8,128,8192 8,1,32,8,128,4096

A shape is ``B,T,N,K,H,S``: each row decodes T new rows against a cache of S keys, every row
full (key_value_seq_lengths = S; T > 1 adds is_causal with q_offset = S - T, which cuDNN's
jax.nn call cannot express, so its column is empty there). Prints microseconds per call (median of
repetitions of 20 back-to-back calls) and GB/s of K/V read.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import time

import jax
import jax.numpy as jnp

import fa2_jax
from fa2_jax import DecodeConfig

SHAPES = ["1,1,32,8,128,4096", "1,1,32,8,128,32768", "8,1,32,8,128,4096", "32,1,32,8,128,4096",
          "128,1,32,8,128,2048", "16,4,32,8,128,8192", "4,1,64,8,128,16384", "8,1,32,32,128,4096",
          "8,1,8,1,64,8192", "2,16,16,4,128,4096", "8,1,32,8,256,4096"]


def _time(fn, *args, reps=7, inner=20):
  out = fn(*args)
  jax.block_until_ready(out)
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(inner):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / inner)
  return statistics.median(times) * 1e6


def run(shape, configs, dtype=jnp.bfloat16):
  b, t, n, kh, h, s = shape
  ks = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(ks[0], (b, t, n, h), dtype)
  k = jax.random.normal(ks[1], (b, s, kh, h), dtype)
  v = jax.random.normal(ks[2], (b, s, kh, h), dtype)
  lens = jnp.full((b,), s, jnp.int32)
  kw = dict(key_value_seq_lengths=lens)
  if t > 1:
    kw.update(is_causal=True, q_offset=lens - t)
  gb = 2 * b * s * kh * h * jnp.dtype(dtype).itemsize / 1e9
  rows = []

  def add(name, fn):
    try:
      us = _time(jax.jit(fn), q, k, v)
      rows.append((name, us, gb / (us * 1e-6)))
    except Exception as e:  # noqa: BLE001
      rows.append((name, float("nan"), f"{type(e).__name__}: {str(e)[:80]}"))

  ref = jax.jit(lambda a, b_, c: fa2_jax.flash_attention(a, b_, c, **kw))(q, k, v)
  for cfg in configs:
    out = jax.jit(lambda a, b_, c: fa2_jax.flash_attention(a, b_, c, block_sizes=cfg, **kw))(q, k, v)
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
    assert err < 5e-2, (cfg, err)
    add(f"decode {cfg}" if cfg is not None else "decode default",
        lambda a, b_, c, cfg=cfg: fa2_jax.flash_attention(a, b_, c, block_sizes=cfg, **kw))
  for impl in ("sm90", "triton"):
    add(impl, lambda a, b_, c, impl=impl: fa2_jax.flash_attention(a, b_, c, implementation=impl,
                                                                  **kw))
  if t == 1:
    add("cudnn", lambda a, b_, c: jax.nn.dot_product_attention(
        a, b_, c, key_value_seq_lengths=lens, implementation="cudnn"))
  print(f"\nB={b} T={t} N={n} K={kh} H={h} S={s}: {fa2_jax.backend_for(q, k, **kw)}")
  for name, us, bw in sorted(rows, key=lambda r: r[1]):
    print(f"  {us:9.1f} us  {bw if isinstance(bw, str) else f'{bw:7.0f} GB/s'}  {name}")


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--shapes", nargs="*", default=SHAPES)
  p.add_argument("--sweep", action="store_true")
  args = p.parse_args()
  for text in args.shapes:
    shape = tuple(int(x) for x in text.split(","))
    configs = [None]
    if args.sweep:
      configs += [DecodeConfig(block_k=bk, num_splits=sp, num_warps=w, num_stages=st, waves=wv)
                  for bk, w, st in itertools.product((32, 64, 128), (4, 8), (2, 3))
                  for sp, wv in ((None, 2), (None, 4), (1, 2))]
    run(shape, configs)


if __name__ == "__main__":
  main()
