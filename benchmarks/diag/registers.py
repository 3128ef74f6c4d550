"""Registers and spills of the Mosaic kernels that a forward+backward compiles (Hopper).

    python -m benchmarks.diag.registers [--shapes "2,8192,32,64;32,512,16,128"] [--causal both]
        [--impls fa2,fa2_det] [--kwargs '{"logits_soft_cap": 50.0}']

For every shape ``B,T,N,H``, mask and implementation (``fa2``: the default backward, with dQ fused
into the dK/dV kernel where the config says so; ``fa2_det``: ``deterministic=True``, the separate dQ
kernel), compiles and runs ``jit(grad(sum f))`` once with ptxas' report switched on (Mosaic GPU's
``MOSAIC_GPU_DUMP_PTXAS``, one file per compiled kernel in a temporary folder) and prints, per kernel:
the registers per thread ptxas allocated (the launch value; ``setmaxnreg`` then moves registers
between the producer and consumer warpgroups), and the bytes of stack frame, spill stores and spill
loads, and ptxas' performance advisories for it (``(C7510)``-style lines: ``serialized`` counts those
saying wgmma instructions are serialized, which costs the overlap of the tensor cores with everything
else; ``arrive`` counts ``warpgroup.arrive is injected``, fences ptxas added). A kernel that spills
is the first suspect of a pass slower than its arithmetic: a duplicated loop once spilled 268 bytes
in the dK/dV kernel and cost 4-7% (docs/design.md, "Softmax form"). ``--kwargs`` gives the calls an
attention variant's arguments (a Python dict literal, as ``benchmarks.diag.ab`` takes them).
Kernels compiled earlier in the process (the same kernel for another case) are not compiled, so not
listed, again.
"""
from __future__ import annotations

import argparse
import os
import re
import tempfile
from pathlib import Path

from .. import harness as h
from .. import impls

_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_ADVICE = re.compile(r"\((C\d+)\) (.*)")


def advisories(text: str) -> dict:
  """ptxas' coded advisories in a report: ``{serialized, arrive, codes: {code: count}}``;
  ``serialized``: lines saying wgmma instructions are serialized; ``arrive``: lines saying a
  ``warpgroup.arrive`` was injected."""
  codes: dict[str, int] = {}
  serialized = arrive = 0
  for code, message in _ADVICE.findall(text):
    codes[code] = codes.get(code, 0) + 1
    serialized += "serialized" in message
    arrive += "warpgroup.arrive is injected" in message
  return dict(serialized=serialized, arrive=arrive, codes=codes)


def parse_ptxas(text: str) -> list[dict]:
  """``[{kernel, registers, stack_bytes, spill_store_bytes, spill_load_bytes}]``, one per entry
  function of a ``ptxas -v`` report (the text ptxas prints with ``-v``)."""
  out = []
  parts = _ENTRY.split(text)  # [before, name, its report, name, its report, ...]
  for name, body in zip(parts[1::2], parts[2::2]):
    row = dict(kernel=name.removesuffix("_mosaic_gpu_kernel"))
    if (m := _USED.search(body)) is not None:
      row["registers"] = int(m.group(1))
    if (m := _FRAME.search(body)) is not None:
      row.update(stack_bytes=int(m.group(1)), spill_store_bytes=int(m.group(2)),
                 spill_load_bytes=int(m.group(3)))
    out.append(row)
  return out


def _reports(folder: Path, seen: set) -> list[dict]:
  """The rows of the ptxas reports written to ``folder`` since the files in ``seen``."""
  rows = []
  for path in sorted(folder.glob("*.ptxas"), key=lambda p: p.stat().st_mtime):
    if path.name in seen:
      continue
    seen.add(path.name)
    text = path.read_text()  # Mosaic GPU writes one kernel's report per file: its advisories
    rows += [dict(r, file=path.name, advisories=advisories(text)) for r in parse_ptxas(text)]
  return rows


def main(argv=None):
  ap = argparse.ArgumentParser(prog="python -m benchmarks.diag.registers", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--shapes", type=h.parse_shapes, default="2,8192,32,64;2,8192,16,128;32,512,16,128",
                  help="B,T,N,H;...")
  ap.add_argument("--causal", default="both", choices=("both", "true", "false"))
  ap.add_argument("--impls", type=h.impl_names, default=["fa2", "fa2_det"])
  ap.add_argument("--kwargs", default=None,
                  help="further flash_attention arguments (an attention variant), a Python dict literal")
  ap.add_argument("--out", default=None, help="output folder (default out/<gpu>/)")
  args = ap.parse_args(argv)
  kwargs = h.call_kwargs(args.kwargs)
  folder = Path(tempfile.mkdtemp(prefix="fa2_ptxas_"))
  # Read by Mosaic GPU when it compiles a kernel: set before the first compilation.
  os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
  os.environ["MOSAIC_GPU_DUMP_TO"] = str(folder)
  import jax.numpy as jnp
  from ..timing import fwd_bwd_fn
  if not impls.is_hopper():
    raise SystemExit("registers reports the Mosaic kernels' ptxas allocation: it needs a Hopper GPU "
                     "(compute capability 9.x)")
  info = h.device_info()
  out = h.resolve_out(argparse.Namespace(out=args.out), info)
  rows, seen = [], set()
  # Each case compiles its kernels (seconds each): rows are printed and the JSON rewritten as they
  # come, so a run cut short by a time limit still reports the cases it finished.
  print(f"{'shape':<16} {'mask':<5} {'impl':<8} {'kernel':<22} {'regs':>5} {'stack':>6} "
        f"{'spill st':>9} {'spill ld':>9} {'serialized':>10} {'arrive':>6}", flush=True)
  for shape in args.shapes:
    q, k, v = h.random_inputs(sum(shape), [shape] * 3, jnp.bfloat16)
    for causal in h.masks(args.causal):
      for name in args.impls:
        case = dict(shape=",".join(map(str, shape)), causal=causal, impl=name)
        if (why := impls.unavailable(name)) is not None:
          new = [dict(case, error=why)]
        else:
          attn = impls.get(name)
          try:
            fwd_bwd_fn(lambda q, k, v: attn(q, k, v, causal=causal, **kwargs))(q, k, v)[0].block_until_ready()
            new = [dict(case, **r) for r in _reports(folder, seen)] or [dict(case, note="no new kernel compiled")]
          except Exception as e:  # noqa: BLE001 - report and go on
            new = [dict(case, error=h.err_str(e, 300))]
        rows += new
        for r in new:
          print(format_row(r), flush=True)
        h.write_json(out / "registers.json", {"meta": info, "rows": rows,
                                              "kwargs": {k: repr(v) for k, v in kwargs.items()}})
  print(f"wrote {out / 'registers.json'}")


def format_row(r: dict) -> str:
  """One printed line of the report: a kernel's allocation, or the case's error or note."""
  head = f"{r['shape']:<16} {'c' if r['causal'] else 'nc':<5} {r['impl']:<8} "
  if "kernel" not in r:
    return head + (r.get("error") or r.get("note", ""))[:80]
  return head + (f"{r['kernel']:<22} {r.get('registers', '-'):>5} {r.get('stack_bytes', '-'):>6} "
                 f"{r.get('spill_store_bytes', '-'):>9} {r.get('spill_load_bytes', '-'):>9} "
                 f"{r['advisories']['serialized']:>10} {r['advisories']['arrive']:>6}")


if __name__ == "__main__":
  main()
