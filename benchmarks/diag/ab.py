"""This checkout's fa2_jax against another version of it, side by side in one process.

    git archive REV fa2_jax kernels | tar -x -C BASE_DIR     # the other version's sources
    python -m benchmarks.diag.ab --base BASE_DIR [--cells "32,512,16,128,c;4,4096,28,128,c,4"]
        [--rounds 2] [--deterministic] [--new-config compute_registers=240,memory_registers=24]
        [--kwargs '{"logits_soft_cap": 50.0, "local_window_size": (4095, 0)}']

Imports the sources under ``BASE_DIR`` (its ``fa2_jax/`` and ``kernels/`` folders, as ``git archive``
writes them) as a second package, ``fa2_base``, beside this checkout's ``fa2_jax``, and times
``flash_attention`` of both with the anchors' method (benchmarks/timing.py) on each cell
``B,T,N,H,c|nc[,K]`` (bf16 random normals; K KV heads, a divisor of N, default N): forward and forward+backward, in ``--rounds`` rounds whose
order alternates (base, new, new, base, then new, base, base, new), so that drift during the run falls
on both alike. Per cell: each version's median TFLOP/s, the ratio new / base (above 1: this checkout
is faster), and the largest relative difference of the gradients (max |new − base| / max |base|).
A change that should cost nothing is measured this way; runs in separate processes drift by a few
percent on the H200. ``--new-config`` gives this checkout's calls ``MosaicConfig.default(...)`` with
those fields replaced (the Mosaic kernels; with ``--base`` a copy of this checkout, it times a config
candidate against the default). ``--kwargs`` passes the same further arguments of ``flash_attention``
to both versions (a variant); the rates then still count every pair of the cell (dense or causal), so
compare their ratios, not their TFLOP/s with other reports.
"""
from __future__ import annotations

import argparse
import importlib
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from .. import harness as h
from ..timing import attention_flops, forward_fn, fwd_bwd_fn, time_calls, tflops

BASE_NAME = "fa2_base"


def import_base(base_dir: str):
  """The package of ``base_dir`` (``fa2_jax/`` and ``kernels/`` beside it, or ``fa2_jax/kernels/``),
  imported as :data:`BASE_NAME` from a temporary copy laid out as the wheel installs it."""
  src = Path(base_dir)
  if not (src / "fa2_jax" / "__init__.py").is_file():
    raise SystemExit(f"--base: {base_dir} holds no fa2_jax/__init__.py (make it with "
                     "`git archive REV fa2_jax kernels | tar -x -C DIR`)")
  root = Path(tempfile.mkdtemp(prefix="fa2_ab_"))
  pkg = root / BASE_NAME
  shutil.copytree(src / "fa2_jax", pkg, ignore=shutil.ignore_patterns("__pycache__"))
  if not (pkg / "kernels").is_dir():
    if not (src / "kernels" / "__init__.py").is_file():
      raise SystemExit(f"--base: {base_dir} holds no kernels/ beside fa2_jax/")
    shutil.copytree(src / "kernels", pkg / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
  sys.path.insert(0, str(root))
  return importlib.import_module(BASE_NAME)


def parse_cells(text: str) -> list[tuple[int, int, int, int, bool, int]]:
  """``"B,T,N,H,c|nc[,K];..."`` -> ``[(B, T, N, H, causal, K)]`` (K: KV heads, default N)."""
  cells = []
  for item in text.split(";"):
    parts = item.split(",")
    dims = parts[:4] + parts[5:]
    if (len(parts) not in (5, 6) or parts[4] not in ("c", "nc")
        or not all(p.isdigit() and int(p) >= 1 for p in dims)
        or (len(parts) == 6 and int(parts[2]) % int(parts[5]) != 0)):
      raise SystemExit(f"--cells: {item!r} is not B,T,N,H,c|nc[,K] with B, T, N, H, K at least 1 "
                       "and K a divisor of N")
    b, t, n, d = map(int, parts[:4])
    cells.append((b, t, n, d, parts[4] == "c", int(parts[5]) if len(parts) == 6 else n))
  return cells


def cell_name(b: int, t: int, n: int, d: int, causal: bool, kh: int) -> str:
  """A cell as ``--cells`` writes it."""
  return f"{b},{t},{n},{d},{'c' if causal else 'nc'}" + (f",{kh}" if kh != n else "")


def parse_config(text: str | None) -> dict:
  """``"field=value,..."`` -> ``{field: value}`` for ``MosaicConfig.replace`` (ints, true/false, or
  text); an unknown field is an error naming it."""
  import dataclasses
  from fa2_jax import MosaicConfig
  if not text:
    return {}
  known = {f.name for f in dataclasses.fields(MosaicConfig)}
  out = {}
  for item in text.split(","):
    name, sep, value = item.partition("=")
    if not sep or name not in known:
      raise SystemExit(f"--new-config: {item!r} is not FIELD=VALUE with a MosaicConfig field "
                       f"({', '.join(sorted(known))})")
    lowered = value.lower()
    out[name] = (int(value) if value.lstrip("-").isdigit() else
                 lowered == "true" if lowered in ("true", "false") else value)
  return out


def check_arguments(cells, new_config: dict, kwargs: dict) -> None:
  """SystemExit naming the flag where ``--new-config`` or ``--kwargs`` cannot make this checkout's
  call for a cell (a field's bad value, an unknown argument), before any timing."""
  import jax
  import jax.numpy as jnp

  import fa2_jax
  taken = sorted({"block_sizes", "deterministic", "is_causal"} & set(kwargs))
  if taken:
    raise SystemExit(f"--kwargs: {taken} are set by --new-config, --deterministic and --cells")
  for b, t, n, d, causal, kh in cells:
    if new_config:
      cell = cell_name(b, t, n, d, causal, kh)
      try:
        cfg = fa2_jax.MosaicConfig.default(d, jnp.bfloat16, causal)
      except (TypeError, ValueError) as e:
        raise SystemExit(f"--cells: {cell}: {e} (--new-config runs the Mosaic kernels)") from None
      try:
        cfg = cfg.replace(**new_config)
      except (TypeError, ValueError) as e:
        raise SystemExit(f"--new-config: {e}") from None
      if (why := cfg.check(d, 2)) is not None:
        raise SystemExit(f"--new-config: at {cell}: {why}")
    q = jax.ShapeDtypeStruct((b, t, n, d), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((b, t, kh, d), jnp.bfloat16)
    try:
      fa2_jax.backend_for(q, k, is_causal=causal, **kwargs)
    except (TypeError, ValueError) as e:
      raise SystemExit(f"--kwargs: {e}") from None


def _rel_diff(new, base) -> float:
  import jax.numpy as jnp
  new, base = jnp.asarray(new, jnp.float32), jnp.asarray(base, jnp.float32)
  scale = float(jnp.max(jnp.abs(base)))
  return float(jnp.max(jnp.abs(new - base))) / scale if scale > 0 else float(jnp.max(jnp.abs(new)))


def compare(versions: dict, cells, *, rounds: int, deterministic: bool, iters: int, reps: int,
            new_config: dict | None = None, kwargs: dict | None = None,
            seed: int = 0) -> list[dict]:
  """One row per cell: ``{cell, tflops: {version: {fwd, fwd+bwd}}, ratio: {fwd, fwd+bwd},
  grad_rel_diff: [dq, dk, dv], samples}`` for ``versions = {"base": module, "new": module}``;
  ``new_config``: fields of the new version's ``MosaicConfig``; ``kwargs``: further arguments of
  both versions' calls."""
  kwargs = dict(kwargs or {})
  import jax.numpy as jnp
  rows = []
  for b, t, n, d, causal, kh in cells:
    q, k, v = h.random_inputs(seed + t + d, [(b, t, n, d), (b, t, kh, d), (b, t, kh, d)],
                              jnp.bfloat16)
    fns = {}
    for name, mod in versions.items():
      blocks = None
      if name == "new" and new_config:
        blocks = mod.MosaicConfig.default(d, jnp.bfloat16, causal).replace(**new_config)
      f = (lambda mod, blocks: lambda q, k, v: mod.flash_attention(
          q, k, v, is_causal=causal, deterministic=deterministic, block_sizes=blocks, **kwargs))(
              mod, blocks)
      fns[name] = {"fwd": forward_fn(f), "fwd+bwd": fwd_bwd_fn(f)}
    samples = {name: {"fwd": [], "fwd+bwd": []} for name in versions}
    grads = {}
    for r in range(rounds):
      order = ["base", "new", "new", "base"] if r % 2 == 0 else ["new", "base", "base", "new"]
      for name in order:
        for pass_ in ("fwd", "fwd+bwd"):
          st, out = time_calls(fns[name][pass_], (q, k, v), iters=iters, reps=reps)
          samples[name][pass_].append(st["median_s"])
          if pass_ == "fwd+bwd":
            grads[name] = out
    flops = attention_flops(b, n, t, t, d, causal)
    rates = {name: {p: tflops(flops, p, statistics.median(s)) for p, s in by_pass.items()}
             for name, by_pass in samples.items()}
    rows.append(dict(
        cell=cell_name(b, t, n, d, causal, kh), tflops=rates,
        ratio={p: rates["new"][p] / rates["base"][p] for p in ("fwd", "fwd+bwd")},
        grad_rel_diff=[_rel_diff(x, y) for x, y in zip(grads["new"], grads["base"])],
        samples_s=samples))
  return rows


def main(argv=None):
  ap = argparse.ArgumentParser(prog="python -m benchmarks.diag.ab", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--base", required=True, help="folder with the other version's fa2_jax/ and kernels/")
  ap.add_argument("--cells", default="32,512,16,128,c;8,2048,16,128,c;2,8192,16,128,nc;2,8192,32,64,nc",
                  help="B,T,N,H,c|nc[,K];... (K: KV heads, default N)")
  ap.add_argument("--rounds", type=h.positive_int, default=2)
  ap.add_argument("--deterministic", action="store_true", help="both versions with deterministic=True")
  ap.add_argument("--new-config", default=None,
                  help="MosaicConfig fields for this checkout's calls: field=value,...")
  ap.add_argument("--kwargs", default=None,
                  help="further flash_attention arguments for both versions, a Python dict literal")
  ap.add_argument("--iters", type=h.positive_int, default=10)
  ap.add_argument("--reps", type=h.positive_int, default=5)
  ap.add_argument("--out", default=None, help="output folder (default out/<gpu>/)")
  args = ap.parse_args(argv)
  cells = parse_cells(args.cells)
  new_config = parse_config(args.new_config)
  kwargs = h.call_kwargs(args.kwargs)
  check_arguments(cells, new_config, kwargs)
  import fa2_jax
  base = import_base(args.base)
  info = h.device_info()
  rows = compare({"base": base, "new": fa2_jax}, cells, rounds=args.rounds,
                 deterministic=args.deterministic, iters=args.iters, reps=args.reps,
                 new_config=new_config, kwargs=kwargs)
  out = h.resolve_out(argparse.Namespace(out=args.out), info)
  h.write_json(out / "ab.json", {"meta": info, "deterministic": args.deterministic,
                                 "new_config": new_config, "rounds": args.rounds, "rows": rows,
                                 "kwargs": {k: repr(v) for k, v in kwargs.items()}})
  print(f"\n{'cell':<20} {'base fwd / fwd+bwd':>20} {'new fwd / fwd+bwd':>20} {'new/base fwd':>13} "
        f"{'fwd+bwd':>8}  grad rel diff (dq, dk, dv)")
  for r in rows:
    tb, tn = r["tflops"]["base"], r["tflops"]["new"]
    print(f"{r['cell']:<20} {tb['fwd']:>9.1f} / {tb['fwd+bwd']:>7.1f} {tn['fwd']:>11.1f} / "
          f"{tn['fwd+bwd']:>7.1f} {r['ratio']['fwd']:>13.3f} {r['ratio']['fwd+bwd']:>8.3f}  "
          + ", ".join(f"{d:.1e}" for d in r["grad_rel_diff"]))
  print(f"wrote {out / 'ab.json'}")


if __name__ == "__main__":
  main()
