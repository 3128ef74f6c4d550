"""Compile time of attention in a jitted program: per call site, and per new shape.

    python -m benchmarks.diag.compile_time [--impls fa2,fa2_triton] [--layers 1,2,4] [--shape B,T,N,H]
    python -m benchmarks.diag.compile_time --impls fa2 --shapes "2,8192,16,128;4,4096,16,128"
        [--cache-dir DIR] [--non-causal] [--other-programs] [--reuse-kernels [--length-multiple M]
        [--kernels-dir DIR]]

Prints lower / compile seconds of ``jit(grad)`` of L chained causal attention calls (``--non-causal``:
non-causal ones; default shape B=4, T=8192, N=8, H=128, bf16: the GPT long8k preset's), the first
run, and the steady time per call (the shared timing helper's median: what padding to a length
multiple costs in speed shows against the same shapes without ``--length-multiple``).

``--shapes``: one call site (L = 1), one shape after another in this process, for "time to first
step": the first shape pays the process's one-time costs, each later one what a new shape costs. Run
each implementation in a fresh process. ``--cache-dir`` turns on JAX's persistent compilation cache in
DIR (every entry kept, however fast its compile): a second process with the same DIR shows what a
shape seen by an earlier process costs. ``--other-programs``: after each shape's ``jit(grad)``, two
more programs with that shape, the forward alone (an evaluation step) and ``jit(grad)`` of another
loss, each timed the same way: what a program costs whose attention shapes an earlier program ran.
``--sequential-compiles`` (with ``--reuse-kernels``): the exported kernels are not compiled in
background threads (on by default: each program's compile then finds them compiled), so the
program's compile compiles them one after another, as without ``--reuse-kernels``.
``--lower-for-sm90``: no compile and no run; each program is traced and lowered for sm90 on any
machine (a CPU too: the dispatcher is told it runs on an H200), the shapes as given: the half of a
new shape's cost that does not need a GPU.
Without ``--reuse-kernels`` the diagnostic turns fa2_jax's kernel reuse off (on by default, with a
per-user folder): every process is cold. ``--reuse-kernels`` turns on
``fa2_jax.reuse_kernels_across_programs()`` in this process only, ``--length-multiple M`` with its
``length_multiple=M`` (lengths padded to multiples of M: shapes in one multiple share kernels); with
``--cache-dir`` too, its ``cache_dir=DIR/fa2_jax_kernels`` (the kernels' lowerings kept across
processes, as the default's per-user folder keeps them: a second process with the same DIR does not
lower a kernel an earlier one ran, and finds it compiled in JAX's cache there). ``--kernels-dir DIR``
(with ``--reuse-kernels``, without ``--cache-dir``): fa2_jax's kernel folder alone, as the default
per-user folder is used, JAX's cache off: a second process with the same DIR neither lowers nor
compiles a kernel an earlier one ran (it loads the compiled kernels written there;
``--sequential-compiles`` then writes none, and a folder that already holds them is loaded from).
"""
from __future__ import annotations

import argparse
import time

from .. import harness as h
from .. import impls
from ..timing import time_calls


def main(argv=None):
  ap = argparse.ArgumentParser(prog="python -m benchmarks.diag.compile_time", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--impls", type=h.impl_names, default=["fa2", "fa2_triton"])
  ap.add_argument("--layers", type=h.parse_ints, default=[1, 2, 4])
  ap.add_argument("--shape", type=h.parse_shape, default=(4, 8192, 8, 128), help="B,T,N,H")
  ap.add_argument("--shapes", type=h.parse_shapes, default=None,
                  help="B,T,N,H;B,T,N,H...: one call site per shape, in order (see above)")
  ap.add_argument("--cache-dir", default=None, help="JAX's persistent compilation cache folder")
  ap.add_argument("--non-causal", action="store_true", help="time non-causal calls (default causal)")
  ap.add_argument("--other-programs", action="store_true",
                  help="with --shapes: two more programs per shape (see above)")
  ap.add_argument("--reuse-kernels", action="store_true",
                  help="fa2_jax.reuse_kernels_across_programs() on (without it: off, a cold "
                       "process)")
  ap.add_argument("--length-multiple", type=h.positive_int, default=None,
                  help="with --reuse-kernels: its length_multiple")
  ap.add_argument("--kernels-dir", default=None,
                  help="with --reuse-kernels: fa2_jax's kernel folder, JAX's cache off (see above)")
  ap.add_argument("--sequential-compiles", action="store_true",
                  help="with --reuse-kernels: no background compiles of new kernels (each "
                       "program's compile then compiles its Mosaic kernels one after another)")
  ap.add_argument("--lower-for-sm90", action="store_true",
                  help="lower only, for sm90, on any machine (see above)")
  ap.add_argument("--out", default=None, help="output folder (default out/<gpu>/)")
  args = ap.parse_args(argv)
  if args.other_programs and not args.shapes:
    ap.error("--other-programs needs --shapes")
  if args.length_multiple is not None and not args.reuse_kernels:
    ap.error("--length-multiple needs --reuse-kernels")
  if args.kernels_dir and (not args.reuse_kernels or args.cache_dir):
    ap.error("--kernels-dir needs --reuse-kernels and no --cache-dir (--cache-dir puts the kernel "
             "folder in DIR/fa2_jax_kernels)")
  if args.sequential_compiles and not args.reuse_kernels:
    ap.error("--sequential-compiles needs --reuse-kernels (the background compiles are the "
             "exported kernels')")
  import jax
  import jax.numpy as jnp
  if args.cache_dir:
    jax.config.update("jax_compilation_cache_dir", args.cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  if args.kernels_dir:  # fa2_jax's folder alone, even where the environment turns JAX's cache on
    jax.config.update("jax_enable_compilation_cache", False)
  import fa2_jax
  if args.reuse_kernels:
    import os

    fa2_jax.reuse_kernels_across_programs(
        True, length_multiple=args.length_multiple,
        cache_dir=(os.path.join(args.cache_dir, "fa2_jax_kernels") if args.cache_dir
                   else args.kernels_dir))
    if args.sequential_compiles:
      from fa2_jax.kernels.sm90 import lowering_cache
      lowering_cache.set_background_compiles(False)
  else:  # a cold process: fa2_jax's default reuse (and its per-user folder) off
    fa2_jax.reuse_kernels_across_programs(False)
  info = h.device_info()
  shapes = args.shapes or [args.shape]
  if args.lower_for_sm90:
    from fa2_jax.kernels import platform  # the dispatcher believes it runs on an H200 (9.0)
    platform.on_gpu = lambda: True
    platform.gpu_compute_capability = lambda: (9, 0)
    # and so do the benchmark entries: on a CPU they would ask for Pallas interpret mode, whose
    # emulated Mosaic kernels are neither lowered for sm90 nor exported to the kernel cache
    impls.on_gpu = lambda: True
    _TIMING["lower_only"] = True
  elif info.get("backend") == "cpu":
    shapes = [(1, 64 * (i + 1), 2, 32) for i in range(len(shapes))]
    print(f"no GPU: CPU-sized shapes instead, {shapes}")
  rows = []
  if args.shapes:
    for name in args.impls:
      rows += _new_shapes(name, shapes, jax, jnp, causal=not args.non_causal,
                          other_programs=args.other_programs)
  else:
    rows = _call_sites(args.impls, args.layers, shapes[0], jax, jnp, causal=not args.non_causal)
  reuse = None
  if args.reuse_kernels:  # what the switch did in this process: exports made, read, written
    from fa2_jax import kernel_reuse
    reuse = kernel_reuse.info()
  out = h.resolve_out(argparse.Namespace(out=args.out), info)
  stem = "compile_time_shapes" if args.shapes else "compile_time"
  h.write_json(out / (stem + ("_lowered_sm90" if args.lower_for_sm90 else "") + ".json"),
               {"meta": dict(info, cache_dir=bool(args.cache_dir),
                             kernels_dir=bool(args.kernels_dir), causal=not args.non_causal,
                             reuse_kernels=args.reuse_kernels, length_multiple=args.length_multiple,
                             background_compiles=args.reuse_kernels and not args.sequential_compiles,
                             lower_for_sm90=args.lower_for_sm90, kernel_reuse=reuse),
                "rows": rows})


_TIMING = {"lower_only": False}  # --lower-for-sm90


def _timed(fn, args):
  """lower, compile and first run seconds of ``jit(fn)`` on ``args``, then its steady time per call
  (``run_s``: the shared timing helper's median, :func:`benchmarks.timing.time_calls`)."""
  import jax
  if _TIMING["lower_only"]:
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    t0 = time.perf_counter()
    jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",))
    return dict(lower_s=time.perf_counter() - t0)
  t0 = time.perf_counter()
  lowered = jax.jit(fn).lower(*args)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  jax.block_until_ready(compiled(*args))
  t3 = time.perf_counter()
  stats, _ = time_calls(compiled, args)
  return dict(lower_s=t1 - t0, compile_s=t2 - t1, first_run_s=t3 - t2, run_s=stats["median_s"],
              run_spread=stats["spread"])


def _new_shapes(name, shapes, jax, jnp, *, causal: bool, other_programs: bool = False):
  attn = impls.get(name)
  rows = []
  for i, shape in enumerate(shapes):
    q, k, v = h.random_inputs(i, [shape] * 3, jnp.bfloat16)
    loss = lambda q, k, v: jnp.sum(attn(q, k, v, causal=causal).astype(jnp.float32))  # noqa: E731
    programs = [("grad", jax.grad(loss, argnums=(0, 1, 2)))]
    if other_programs:
      def square(q, k, v):
        return jnp.sum(jnp.square(attn(q, k, v, causal=causal).astype(jnp.float32)))
      programs += [("forward", lambda q, k, v: attn(q, k, v, causal=causal)),
                   ("grad_other_loss", jax.grad(square, argnums=(0, 1, 2)))]
    for program, fn in programs:
      row = dict(impl=name, shape=list(shape), order=i, causal=causal, program=program)
      rows.append(_measured_row(row, f"{name:<10} {'x'.join(map(str, shape)):<16} {program:<15}:",
                                fn, (q, k, v)))
  return rows


def _call_sites(names, layer_counts, shape, jax, jnp, *, causal: bool):
  q, k, v = h.random_inputs(0, [shape] * 3, jnp.bfloat16)
  rows = []
  for name in names:
    attn = impls.get(name)
    if impls.unavailable(name):
      print(f"{name}: {impls.unavailable(name)}")
      continue
    for layers in layer_counts:
      def loss(q, k, v, layers=layers):
        x = q
        for _ in range(layers):
          x = attn(x, k, v, causal=causal)
        return jnp.sum(x.astype(jnp.float32))
      row = dict(impl=name, layers=layers, shape=list(shape), causal=causal)
      rows.append(_measured_row(row, f"{name:<10} L={layers}:", jax.grad(loss, argnums=(0, 1, 2)),
                                (q, k, v)))
  return rows


def _measured_row(row, label, fn, args):
  """``row`` with :func:`_timed`'s seconds of ``fn`` (or the error), printed after ``label``."""
  try:
    row.update(_timed(fn, args))
    if "compile_s" not in row:  # --lower-for-sm90
      print(f"{label} lower {row['lower_s']:6.2f} s (for sm90)", flush=True)
      return row
    print(f"{label} lower {row['lower_s']:6.2f} s  compile {row['compile_s']:6.2f} s  "
          f"first run {row['first_run_s']:6.3f} s  run {row['run_s'] * 1e3:7.3f} ms", flush=True)
  except Exception as e:  # noqa: BLE001
    row["error"] = h.err_str(e)
    print(f"{label} {row['error']}", flush=True)
  return row


if __name__ == "__main__":
  main()
