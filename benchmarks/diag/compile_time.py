"""How compile time grows with the number of attention call sites in one jitted program.

    python -m benchmarks.diag.compile_time [--impls fa2,fa2_triton] [--layers 1,2,4] [--shape B,T,N,H]

Prints lower / compile seconds of ``jit(grad)`` of L chained causal attention calls (default shape
B=4, T=8192, N=8, H=128, bf16: the GPT long8k preset's), the first run and one more run.
"""
from __future__ import annotations

import argparse
import time

from .. import cli, impls
from ..device import device_info
from ..report import err_str, write_json


def main(argv=None):
  ap = argparse.ArgumentParser(prog="python -m benchmarks.diag.compile_time", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--impls", type=cli.impl_names, default=["fa2", "fa2_triton"])
  ap.add_argument("--layers", type=cli.parse_ints, default=[1, 2, 4])
  ap.add_argument("--shape", default="4,8192,8,128", help="B,T,N,H")
  ap.add_argument("--out", default=None, help="output folder (default out/<gpu>/)")
  args = ap.parse_args(argv)
  import jax
  import jax.numpy as jnp
  info = device_info()
  b, t, n, h = map(int, args.shape.split(","))
  if info.get("backend") == "cpu":
    b, t, n, h = 1, 64, 2, 32
    print(f"no GPU: a CPU-sized shape instead, B={b} T={t} N={n} H={h}")
  q, k, v = cli.random_inputs(0, [(b, t, n, h)] * 3, jnp.bfloat16)
  rows = []
  for name in args.impls:
    attn = impls.get(name)
    if impls.unavailable(name):
      print(f"{name}: {impls.unavailable(name)}")
      continue
    for layers in args.layers:
      def loss(q, k, v, layers=layers):
        x = q
        for _ in range(layers):
          x = attn(x, k, v, causal=True)
        return jnp.sum(x.astype(jnp.float32))
      row = dict(impl=name, layers=layers, shape=[b, t, n, h])
      try:
        t0 = time.perf_counter()
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v))
        t3 = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v))
        row.update(lower_s=t1 - t0, compile_s=t2 - t1, first_run_s=t3 - t2,
                   run_s=time.perf_counter() - t3)
        print(f"{name:<10} L={layers}: lower {row['lower_s']:6.2f} s  compile {row['compile_s']:6.2f} s  "
              f"first run {row['first_run_s']:6.3f} s  run {row['run_s']:6.3f} s", flush=True)
      except Exception as e:  # noqa: BLE001
        row["error"] = err_str(e)
        print(f"{name:<10} L={layers}: {row['error']}", flush=True)
      rows.append(row)
  out = cli.resolve_out(argparse.Namespace(out=args.out), info)
  write_json(out / "compile_time.json", {"meta": info, "rows": rows})


if __name__ == "__main__":
  main()
