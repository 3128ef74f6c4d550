"""Where the time of a Mosaic forward+backward goes: each piece timed on its own, beside cuDNN (Hopper).

    python -m benchmarks.diag.kernel_times [--shapes "2,8192,16,128;2,8192,32,64"] [--causal both]

For every shape ``B,T,N,H`` and mask: the Mosaic forward kernel, the backward's XLA prologue (delta and
the rows' (r, u) from the forward's row statistics), the backward with the separate dQ kernel (``deterministic=True``) and
its dK/dV kernel and dQ kernel alone, the backward with dQ
fused into the dK/dV kernel (``dq_fused=True``, where the config can fuse it), and, for causal calls, forward and backward in the
per-head launch order (``lpt_heads=1``); then fa2_jax's and cuDNN's forward+backward through the public
API. Milliseconds per call (benchmarks/timing.py) and TFLOP/s counted with the matmuls each piece does
(forward: 2 per tile pair; backward: dK/dV 4 + dQ 3; fused: 5).
"""
from __future__ import annotations

import argparse
import functools

from .. import cli, impls
from ..device import device_info
from ..report import err_str, write_json
from ..timing import forward_fn, fwd_bwd_fn, time_calls


def programs(head_dim: int, dtype, causal: bool) -> dict:
  """``{name: (jitted fn, argument names, matmuls per tile pair)}``; the arguments come from
  ``q, k, v, do`` and the forward's ``out, stats``."""
  import fa2_jax
  import jax
  from fa2_jax.kernels.sm90 import backward as mb
  from fa2_jax.kernels.sm90.forward import forward
  scale = head_dim ** -0.5
  cfg = fa2_jax.MosaicConfig.default(head_dim, dtype, causal)
  fused = cfg.replace(dq_fused=True, dq_fused_min_t=0)
  if fused.check(head_dim, jax.numpy.dtype(dtype).itemsize):  # shared memory: a shallower dK/dV ring
    fused = fused.replace(num_stages_dkv=2)

  def fwd(config):
    return jax.jit(functools.partial(forward, scale=scale, is_causal=causal, config=config))

  def bwd(config, deterministic):
    return jax.jit(functools.partial(mb.backward, scale=scale, is_causal=causal, config=config,
                                     deterministic=deterministic))

  grads = ("q", "k", "v", "out", "stats", "do")
  rows = ("q", "k", "v", "do", "rows", "delta", "exact")  # the kernels' operands after the prologue
  common = dict(scale=scale, is_causal=causal, cfg=cfg)

  def dkv(q, k, v, do, *r):
    if cfg.dkv_roles:
      return mb.dkv_roles_call(q, k, v, do, *r, seq_q=q.shape[1], seq_k=k.shape[1], **common)
    return mb.dkv_call(q, k, v, do, *r, seq_q=q.shape[1], emulate=False, **common)

  out = {
      "mosaic forward": (fwd(cfg), ("q", "k", "v"), 2),
      "backward prologue (XLA)": (jax.jit(functools.partial(mb.prologue, scale=scale)),
                                  ("out", "do", "stats"), 0),
      "mosaic backward, separate dQ": (bwd(cfg, True), grads, 7),
      **({"mosaic backward, fused dQ": (bwd(fused, False), grads, 5)}
         if fused.fuses_dq(1 << 30, deterministic=False) else {}),
      # the separate-dQ backward's kernels alone (whole tiles: T and S multiples of 128)
      "mosaic dK/dV kernel": (jax.jit(dkv), rows, 4),
      "mosaic dQ kernel": (jax.jit(lambda q, k, v, do, *r: (
          mb.dq_roles_call if cfg.dq_roles else mb.dq_call)(
              q, k, v, do, *r, seq_k=k.shape[1], emulate=False, **common)), rows, 3),
  }
  if causal:  # the per-head launch order, for comparison with the default L2 sections
    head = cfg.replace(lpt_heads=1, lpt_heads_dkv=1)
    out["mosaic forward [per-head order]"] = (fwd(head), ("q", "k", "v"), 2)
    out["mosaic backward [per-head order]"] = (bwd(head, True), grads, 7)
  for name in ("fa2", "fa2_det", "cudnn"):
    if impls.unavailable(name) is None:
      f = functools.partial(impls.get(name), causal=causal)
      out[f"{name} forward"] = (forward_fn(f), ("q", "k", "v"), 2)
      out[f"{name} forward+backward"] = (fwd_bwd_fn(f), ("q", "k", "v"), 7)
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(prog="python -m benchmarks.diag.kernel_times", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  cli.add_shape_args(ap, "2,8192,16,128;2,8192,32,64")
  ap.add_argument("--out", default=None, help="output folder (default out/<gpu>/)")
  args = ap.parse_args(argv)
  import jax.numpy as jnp
  from fa2_jax import dispatch
  if not dispatch.is_hopper():
    raise SystemExit("kernel_times times the Mosaic kernels: it needs a Hopper GPU (compute capability 9.x)")
  info = device_info()
  rows = []
  for shape, (b, t, n, h), masks in cli.shapes_and_masks(args):
    q, k, v, do = cli.random_inputs(t + h, [(b, t, n, h)] * 4, jnp.bfloat16)
    for causal in masks:
      pair_flops = 2.0 * b * n * t * t * h / (2 if causal else 1)  # one [T, S] x H matmul
      progs = programs(h, q.dtype, causal)
      out, stats = progs["mosaic forward"][0](q, k, v)
      arrays = dict(q=q, k=k, v=v, do=do, out=out, stats=stats)
      arrays.update(zip(("delta", "rows", "exact"), progs["backward prologue (XLA)"][0](out, do, stats)))
      for name, (fn, arg_names, mm) in progs.items():
        row = dict(shape=shape, causal=causal, piece=name, matmuls=mm)
        try:
          st, _ = time_calls(fn, tuple(arrays[a] for a in arg_names))
          row.update(ms=st["median_s"] * 1e3, spread=st["spread"],
                     tflops=mm * pair_flops / st["median_s"] / 1e12 if mm else None)
        except Exception as e:  # noqa: BLE001 - report and go on
          row["error"] = err_str(e, 300)
        rows.append(row)
  out = cli.resolve_out(argparse.Namespace(out=args.out), info)
  write_json(out / "kernel_times.json", {"meta": info, "rows": rows})
  print(f"\n{'shape':<16} {'mask':<6} {'piece':<34} {'ms':>8} {'TFLOP/s':>8}")
  for r in rows:
    tf = f"{r['tflops']:.0f}" if r.get("tflops") else "-"
    ms = f"{r['ms']:.3f}" if "ms" in r else r.get("error", "")[:60]
    print(f"{r['shape']:<16} {'c' if r['causal'] else 'nc':<6} {r['piece']:<34} {ms:>8} {tf:>8}")
  print(f"wrote {out / 'kernel_times.json'}")


if __name__ == "__main__":
  main()
