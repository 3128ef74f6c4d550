"""One steady-state forward+backward per implementation, for a profiler such as Nsight Compute:

    ncu --clock-control none -k regex:'fa2|sdpa|fmha|flash|cudnn' --launch-count 12 \
        --section SpeedOfLight python -m benchmarks.diag.profile --impls fa2,cudnn

Each implementation's ``jit(grad(f32 sum))`` (benchmarks/timing.py) is compiled and warmed up, then run
``--runs`` times; the median wall time per call is printed (under a profiler it includes the replays).
Default shape B=2, T=S=8192, N=16, H=128 (``--shape``), bf16, non-causal unless ``--causal``.
"""
from __future__ import annotations

import argparse
import functools
import time

from .. import cli, impls
from ..timing import fwd_bwd_fn


def main(argv=None):
  ap = argparse.ArgumentParser(prog="python -m benchmarks.diag.profile", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--impls", type=cli.impl_names, default=["fa2", "fa2_det", "cudnn"])
  ap.add_argument("--shape", default="2,8192,16,128", help="B,T,N,H")
  ap.add_argument("--causal", action="store_true")
  ap.add_argument("--runs", type=int, default=1)
  args = ap.parse_args(argv)
  import jax
  import jax.numpy as jnp
  b, t, n, h = map(int, args.shape.split(","))
  q, k, v = cli.random_inputs(0, [(b, t, n, h)] * 3, jnp.bfloat16)
  for name in args.impls:
    if impls.unavailable(name):
      print(f"{name:<10} not run: {impls.unavailable(name)}")
      continue
    g = fwd_bwd_fn(functools.partial(impls.get(name), causal=args.causal))
    jax.block_until_ready(g(q, k, v))
    times = []
    for _ in range(args.runs):
      t0 = time.perf_counter()
      jax.block_until_ready(g(q, k, v))
      times.append(time.perf_counter() - t0)
    times.sort()
    print(f"{name:<10} fwd+bwd {1e3 * times[len(times) // 2]:.3f} ms/call (median of {args.runs})",
          flush=True)


if __name__ == "__main__":
  main()
