"""The ring's per-block schedule on one device against one ``flash_attention`` call on the same sequence.

Context parallelism's ring (fa2_jax/context_parallel.py, ``strategy="ring"``) replaces one call over the
whole sequence by many smaller block calls whose partial softmaxes are merged by their lse. Summed over
the C devices of the ring, the blocks do the work of the one call; what they cost beyond it (smaller
kernels, the merges, the per-block control flow) is what the context-parallel scaling model needs from the
kernel side. This script measures it on ONE device, without communication:

  one call    fa2_jax.flash_attention(q, k, v, is_causal=...) over the whole sequence
  ring Cx     every block of the ring's C devices, in the zigzag layout (device d holds chunks d and
              2C-1-d of 2C): for each device d (a fori_loop, d traced as lax.axis_index is in the ring),
              C steps (a fori_loop; at step s the device holds the K/V of device (d - s) mod C), each
              step its two query pieces against the two visiting key pieces: ``out_j, lse_j =
              flash_attention(q_piece, k_piece, v_piece, return_residual=True, is_causal=...,
              q_offset=<q start - k start>)``, a block fully in the causal future skipped by a lax.cond
              on the traced indices (as the ring's), the pieces merged exactly in float32
              (``out = Σ exp(lse_j - lse) out_j``, the ring's _merge) and cast to the input dtype.
              Backward (a custom_vjp, the ring's kernel path): the same loops, each live block running
              ``fa2_jax.attention.attention_backward(q_piece, k_piece, v_piece, out, lse, dout)`` with
              its rows' GLOBAL out and lse, dQ per piece and dK/dV per key chunk accumulated in
              float32 (in the ring they travel with their K/V).
              The ring's lax.ppermute is replaced by a slice of the visiting K/V chunk out of the
              zigzag-ordered K/V: no communication is measured.

Inputs: the one call gets q, k, v in their natural order; the ring rows the same arrays in the zigzag
layout (fa2_jax.to_context_layout, outside the timed call) and return their output in it (the loss, an
f32 sum, does not depend on the order).

Cells (``--cells``): ``<T>-c`` (causal) and ``<T>-nc`` (not), T = S in 32k, 64k, 128k; rows
(``--contexts``): C in 2, 4, 8; GQA 32/8 at head_dim 128, bf16, B=1. Bar: ring time ÷ one-call time
≤ BAR (1.05) forward+backward (the forward's ratio is shown beside it).
``--quick``: 32k and 128k with C = 4 and 8, 3 repetitions. ``--smoke`` (automatic without a GPU): T = 64,
GQA 4/2 at head_dim 32, C = 2 and 4, the Triton kernels in Pallas interpret mode.

Check (every cell, every ring row): the ring's output and gradients (the last timed call's, put back in
the natural order) against the one call's: relative L2 error of out, dq, dk, dv; ⚠ above ERR_TOL.

Timing: benchmarks/timing.py's helpers (forward_fn, fwd_bwd_fn, time_interleaved: jit, 2 warm-up calls,
the median of reps × iters back-to-back calls, a cell's rows and passes interleaved), with ITERS = 2
calls per repetition by default: every call here takes 10 ms to seconds, so launch gaps are nothing
beside it, and 10 back-to-back calls of the 128k cells would take minutes per row. TFLOP/s: the one
call's FLOPs (timing.attention_flops) for every row.

    python -m benchmarks.context_schedule [--quick] [--cells '128k-*'] [--contexts 4,8]
    python -m benchmarks.context_schedule --render out/h200/context_schedule.json

Writes context_schedule.json / .md and context_schedule.png (ratio to the one call against T per C).
"""
from __future__ import annotations

import argparse
import functools
import time
import zlib

from . import harness as h
from . import impls
from .timing import PASS_FLOP_MULT, attention_flops, err_str, forward_fn, fwd_bwd_fn, time_interleaved

STEM = "context_schedule"
DTYPE = "bf16"
ITERS = 2  # back-to-back calls per repetition (module docstring: every call takes >= 10 ms)
REPS = 5  # repetitions, median taken (timing.REPS)
REPS_QUICK = 3
BAR = 1.05  # ring schedule time ÷ one call's time, forward+backward: at most this
ERR_TOL = 2e-2  # relative L2 error of the ring's out / dq / dk / dv against the one call's: ⚠ above
PASSES = ("fwd", "fwd+bwd")
ONE_CALL = "one_call"
K = 1024

# (heads, kv_heads, head_dim, seqs, contexts) per size
SIZES = {
    "full": dict(heads=32, kv_heads=8, head_dim=128, seqs=(32 * K, 64 * K, 128 * K), contexts=(2, 4, 8)),
    "quick": dict(heads=32, kv_heads=8, head_dim=128, seqs=(32 * K, 128 * K), contexts=(4, 8)),
    "smoke": dict(heads=4, kv_heads=2, head_dim=32, seqs=(64,), contexts=(2, 4)),
}


# --- cells -------------------------------------------------------------------------------------------

def make_cell(seq: int, causal: bool, heads: int, kv_heads: int, head_dim: int) -> dict:
  return dict(id=f"{h.seq_label(seq)}-{'c' if causal else 'nc'}", seq=seq, causal=causal, batch=1,
              heads=heads, kv_heads=kv_heads, head_dim=head_dim,
              flops_fwd=attention_flops(1, heads, seq, seq, head_dim, causal))


def build_cells(size: str = "full") -> list[dict]:
  s = SIZES[size]
  return [make_cell(t, causal, s["heads"], s["kv_heads"], s["head_dim"]) for t in s["seqs"]
          for causal in (True, False)]


def ring_name(contexts: int) -> str:
  return f"ring_c{contexts}"


def live_blocks(contexts: int, causal: bool) -> int:
  """Blocks one device of the zigzag ring runs (of 4C): all when not causal; causal, device d's pieces
  (chunks d and 2C-1-d) attend the key chunks at or before their own: (d + 1) + (2C - d) = 2C + 1."""
  return 2 * contexts + 1 if causal else 4 * contexts


# --- the schedule ------------------------------------------------------------------------------------

def _merge(acc, new):
  """Two partial softmaxes of the same rows merged exactly (context_parallel._merge): ``lse =
  logaddexp(lse_a, lse_b)``, ``out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b``; a row without
  keys in either keeps output 0 and lse -inf. float32 ``(out [B, t, N, H], lse [B, t, N])``."""
  import jax.numpy as jnp
  (o_a, l_a), (o_b, l_b) = acc, new
  m = jnp.maximum(l_a, l_b)
  m = jnp.where(m == -jnp.inf, 0.0, m)
  w_a, w_b = jnp.exp(l_a - m), jnp.exp(l_b - m)
  total = w_a + w_b
  seen = total > 0
  total = jnp.where(seen, total, 1.0)
  lse = jnp.where(seen, m + jnp.log(total), -jnp.inf)
  out = o_a * (w_a / total)[..., None] + o_b.astype(jnp.float32) * (w_b / total)[..., None]
  return out, lse


def ring_schedule(contexts: int, causal: bool, **kw):
  """``f(q, k, v) -> out``, all in the zigzag layout of ``contexts`` devices (``[B, T, N, H]``,
  ``[B, S, K, H]``): every block of the ring's devices on this one device, merged by lse; its gradient
  runs ``attention_backward`` per block (module docstring). ``kw``: flash_attention's other keywords
  (``interpret`` on the CPU)."""
  import jax
  import jax.numpy as jnp
  from jax import lax
  import fa2_jax
  from fa2_jax.attention import attention_backward

  c, pieces = contexts, 2

  def chunk(x, slot, size):  # slot ``slot`` of the layout's 2C equal chunks (a traced index)
    return lax.dynamic_slice_in_dim(x, slot * size, size, axis=1)

  def blocks(d, step, tq, tk):
    """The step's (p, r, q_row0, k_row0, live) of device ``d``: query piece p (chunk d or 2C-1-d)
    against the visiting device's key piece r; ``live``: None (every block) or a traced bool."""
    src = (d + (c - step)) % c  # the device whose K/V this one holds at this step
    q_chunks, k_chunks = (d, 2 * c - 1 - d), (src, 2 * c - 1 - src)
    for p in range(pieces):
      for r in range(pieces):
        q_row0, k_row0 = q_chunks[p] * tq, k_chunks[r] * tk
        yield p, r, src, q_row0, k_row0, (k_row0 <= q_row0 + (tq - 1)) if causal else None

  def block_kw(q_row0, k_row0, b):
    kwargs = dict(kw, is_causal=causal)
    if causal:  # the kernels count key positions from 0: the query rows' start minus the keys'
      kwargs["q_offset"] = jnp.zeros((b,), jnp.int32) + (q_row0 - k_row0)
    return kwargs

  def cond(live, run, skip):
    return run() if live is None else lax.cond(live, run, skip)

  def forward(q, k, v):
    b, t, n, _ = q.shape
    hv = v.shape[3]
    tq, tk = t // (pieces * c), k.shape[1] // (pieces * c)

    def device(d, bufs):
      qs = [chunk(q, pieces * d + p, tq) for p in range(pieces)]

      def step_fn(step, acc):
        acc = list(acc)
        for p, r, src, q_row0, k_row0, live in blocks(d, step, tq, tk):
          kp, vp = chunk(k, pieces * src + r, tk), chunk(v, pieces * src + r, tk)

          def run(qp=qs[p], kp=kp, vp=vp, q_row0=q_row0, k_row0=k_row0):
            out, lse = fa2_jax.flash_attention(qp, kp, vp, return_residual=True,
                                               **block_kw(q_row0, k_row0, b))
            return out, lse.astype(jnp.float32)

          def skip():
            return jnp.zeros((b, tq, n, hv), q.dtype), jnp.full((b, tq, n), -jnp.inf, jnp.float32)

          acc[p] = _merge(acc[p], cond(live, run, skip))
        return tuple(acc)

      acc = tuple((jnp.zeros((b, tq, n, hv), jnp.float32), jnp.full((b, tq, n), -jnp.inf, jnp.float32))
                  for _ in range(pieces))
      acc = lax.fori_loop(0, c, step_fn, acc)
      out, lse = bufs
      for p, (o, l) in enumerate(acc):
        out = lax.dynamic_update_slice_in_dim(out, o.astype(q.dtype), (pieces * d + p) * tq, axis=1)
        lse = lax.dynamic_update_slice_in_dim(lse, l, (pieces * d + p) * tq, axis=1)
      return out, lse

    return lax.fori_loop(0, c, device, (jnp.zeros((b, t, n, hv), q.dtype),
                                        jnp.zeros((b, t, n), jnp.float32)))

  def backward(q, k, v, out, lse, dout):
    b, t, _, _ = q.shape
    tq, tk = t // (pieces * c), k.shape[1] // (pieces * c)

    def device(d, carry):
      dq_buf, dk_buf, dv_buf = carry
      rows = [[chunk(x, pieces * d + p, tq) for x in (q, out, lse, dout)] for p in range(pieces)]

      def step_fn(step, carry):
        dq, dk_buf, dv_buf = carry
        dq = list(dq)
        for p, r, src, q_row0, k_row0, live in blocks(d, step, tq, tk):
          slot = pieces * src + r
          kp, vp = chunk(k, slot, tk), chunk(v, slot, tk)

          def run(rows=rows[p], kp=kp, vp=vp, q_row0=q_row0, k_row0=k_row0):
            qp, out_p, lse_p, dout_p = rows
            grads = attention_backward(qp, kp, vp, out_p, lse_p, dout_p, None,
                                       **block_kw(q_row0, k_row0, b))
            return tuple(x.astype(jnp.float32) for x in grads)

          def skip(kp=kp, vp=vp):
            return (jnp.zeros(rows[0][0].shape, jnp.float32), jnp.zeros(kp.shape, jnp.float32),
                    jnp.zeros(vp.shape, jnp.float32))

          g_q, g_k, g_v = cond(live, run, skip)
          dq[p] = dq[p] + g_q
          dk_buf = lax.dynamic_update_slice_in_dim(dk_buf, chunk(dk_buf, slot, tk) + g_k, slot * tk, 1)
          dv_buf = lax.dynamic_update_slice_in_dim(dv_buf, chunk(dv_buf, slot, tk) + g_v, slot * tk, 1)
        return tuple(dq), dk_buf, dv_buf

      dq = tuple(jnp.zeros(rows[p][0].shape, jnp.float32) for p in range(pieces))
      dq, dk_buf, dv_buf = lax.fori_loop(0, c, step_fn, (dq, dk_buf, dv_buf))
      for p in range(pieces):
        dq_buf = lax.dynamic_update_slice_in_dim(dq_buf, dq[p].astype(q.dtype), (pieces * d + p) * tq, 1)
      return dq_buf, dk_buf, dv_buf

    dq, dk, dv = lax.fori_loop(0, c, device, (jnp.zeros(q.shape, q.dtype),
                                              jnp.zeros(k.shape, jnp.float32),
                                              jnp.zeros(v.shape, jnp.float32)))
    return dq, dk.astype(k.dtype), dv.astype(v.dtype)

  @jax.custom_vjp
  def schedule(q, k, v):
    return forward(q, k, v)[0]

  def fwd(q, k, v):
    out, lse = forward(q, k, v)
    return out, (q, k, v, out, lse)

  def bwd(res, dout):
    return backward(*res, dout)

  schedule.defvjp(fwd, bwd)
  return schedule


def one_call(causal: bool, **kw):
  """``f(q, k, v) -> out``: one fa2_jax.flash_attention call over the whole sequence."""
  def f(q, k, v):
    import fa2_jax
    return fa2_jax.flash_attention(q, k, v, is_causal=causal, **kw)
  return f


# --- measuring ---------------------------------------------------------------------------------------

def cell_key(c):
  return (c.get("id"), c.get("row"))


def build_parser():
  p = argparse.ArgumentParser(prog="python -m benchmarks.context_schedule", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--cells", type=h.parse_strs, default=None,
                 help="only the cells whose id matches one of these patterns, e.g. '128k-*,*-c'")
  p.add_argument("--contexts", type=h.parse_ints, default=None,
                 help="ring sizes C to measure, comma list (default: the size's, 2,4,8; --quick 4,8)")
  p.add_argument("--no-check", action="store_true",
                 help="skip comparing the ring's output and gradients with the one call's")
  h.add_common_args(p, counts=True)
  p.set_defaults(iters=ITERS, reps=None)  # REPS, --quick REPS_QUICK, --smoke harness.SMOKE_REPS
  return p


def size_of(args) -> str:
  return "smoke" if args.smoke else "quick" if args.quick else "full"


def select_cells(args) -> list[dict]:
  size = size_of(args)
  which = {"smoke": "the CPU smoke cells (--smoke, or no GPU)", "quick": "the quick GPU cells",
           "full": "the GPU cells"}[size]
  return h.select(build_cells(size), args.cells, lambda c: c["id"], f"{which}; their ids")


def contexts_of(args, cell: dict) -> list[int]:
  """The ring sizes to run: ``--contexts`` or the size's; each must cut T into 2C chunks."""
  cs = args.contexts or list(SIZES[size_of(args)]["contexts"])
  bad = [x for x in cs if x < 1 or cell["seq"] % (2 * x)]
  if bad:
    raise SystemExit(f"--contexts {','.join(map(str, bad))}: the zigzag layout cuts T = {cell['seq']} "
                     "into 2C equal chunks; C must be a positive divisor of T/2")
  return cs


def inputs_of(cell: dict, seed: int):
  """Fresh normals ``q [1, T, N, H]``, ``k, v [1, S, K, H]``, drawn from the cell's T (a cell's causal
  and non-causal ids measure the same inputs)."""
  t = cell["seq"]
  return h.random_inputs(zlib.crc32(f"{t}/{seed}".encode()),
                         [(1, t, cell["heads"], cell["head_dim"]), (1, t, cell["kv_heads"], cell["head_dim"]),
                          (1, t, cell["kv_heads"], cell["head_dim"])], h.jnp_dtype(DTYPE))


def rel_l2(got, want) -> float:
  import jax.numpy as jnp
  d = got.astype(jnp.float32) - want.astype(jnp.float32)
  return float(jnp.linalg.norm(d) / jnp.linalg.norm(want.astype(jnp.float32)))


def check_row(rec: dict, outs: dict, base: dict, contexts: int) -> None:
  """The ring row's last forward output and gradients, put back in the natural order, against the
  one call's: ``err = {out, dq, dk, dv: relative L2}``; ⚠ ``warning`` above ERR_TOL."""
  import fa2_jax
  natural = functools.partial(fa2_jax.from_context_layout, axis_size=contexts)
  err = {}
  if outs.get("fwd") is not None and base.get("fwd") is not None:
    err["out"] = rel_l2(natural(outs["fwd"]), base["fwd"])
  if outs.get("fwd+bwd") is not None and base.get("fwd+bwd") is not None:
    for name, g, g1 in zip(("dq", "dk", "dv"), outs["fwd+bwd"], base["fwd+bwd"]):
      err[name] = rel_l2(natural(g), g1)
  rec["err"] = err
  off = {k: e for k, e in err.items() if not e <= ERR_TOL}
  if off:
    rec["warning"] = "ring differs from the one call: " + ", ".join(
        f"{k} rel. L2 {e:.2e}" for k, e in off.items()) + f" (> {ERR_TOL:g})"


def measure_cell(run, cell: dict, rows: dict, args, t0: float) -> None:
  """Time the cell's rows, both passes, interleaved (time_interleaved); ratios to the one call; check
  the ring rows; record each. ``rows = {name: (record, f, args, contexts)}``."""
  entries = {}
  for name, (rec, f, call_args, _) in rows.items():
    for p in PASSES:
      entries[(name, p)] = ({"fwd": forward_fn, "fwd+bwd": fwd_bwd_fn}[p](f), call_args)
  started = set()

  def before(key):
    if key[0] not in started:
      started.add(key[0])
      run.begin(rows[key[0]][0], rows[key[0]][0]["row"])

  try:
    timed = time_interleaved(entries, iters=args.iters, reps=args.reps, before=before)
  except Exception as e:  # noqa: BLE001
    timed = {key: e for key in entries}
  outs = {}
  for name, (rec, _, _, _) in rows.items():
    rec.update(timing={}, ms={}, tflops={})
    outs[name] = {}
    for p in PASSES:
      got = timed[(name, p)]
      if isinstance(got, Exception):
        rec[f"{p}_error"] = err_str(got)
        continue
      st, outs[name][p] = got
      rec["timing"][p], rec["ms"][p] = st, st["median_s"] * 1e3
      rec["tflops"][p] = PASS_FLOP_MULT[p] * cell["flops_fwd"] / st["median_s"] / 1e12
  base = rows.get(ONE_CALL)
  for name, (rec, _, _, contexts) in rows.items():
    if base is not None and name != ONE_CALL:
      rec["vs_one_call"] = {p: h.ratio(rec["ms"].get(p), base[0]["ms"].get(p)) for p in PASSES}
      r = rec["vs_one_call"].get("fwd+bwd")
      rec["bar_ok"] = None if r is None else r <= BAR
      if not args.no_check:
        try:
          check_row(rec, outs[name], outs[ONE_CALL], contexts)
        except Exception as e:  # noqa: BLE001
          rec["check_error"] = f"no check: {err_str(e, 300)}"
    rec["status"] = h.status_of(rec)
    run.add(rec, t0=t0)


def run(args) -> dict:
  import jax
  info = h.device_info()
  h.cpu_fallback(args, info, STEM)
  if args.reps is None:
    args.reps = REPS_QUICK if args.quick else REPS
  cells = select_cells(args)
  todo = [(c, contexts_of(args, c)) for c in cells]
  kw = {} if impls.on_gpu() else {"interpret": True}  # the CPU: the Triton kernels interpreted
  size = size_of(args)
  run = h.Run(args, STEM, info, dict(
      size=size, cells=cells, contexts=todo[0][1] if todo else [], dtype=DTYPE, iters=args.iters,
      reps=args.reps, bar=BAR, err_tol=ERR_TOL,
      shape="GQA {heads}/{kv_heads}, head_dim {head_dim}, B=1".format(**SIZES[size]),
      layout="zigzag (device d holds chunks d and 2C-1-d of 2C)",
      backward="custom_vjp: attention_backward per live block with the rows' global out and lse "
               "(the ring's kernel path), dq/dk/dv accumulated in float32",
      flops="the one call's: forward 4·B·N·T·S·H, halved when causal; forward+backward 3.5× that",
      method="benchmarks.timing: jit; 2 warm-up calls; median of reps x (iters back-to-back calls, then "
             "block_until_ready), the rows and passes of a cell interleaved (order rotated each "
             "repetition); fwd+bwd = jit(grad(f32 sum of the output)); ring rows on the zigzag-ordered "
             "inputs"), cell_key, sum(1 + len(cs) for _, cs in todo))
  for cell, contexts in todo:
    run.bar.set_postfix_str(cell["id"])
    t0, inputs, rows = time.time(), None, {}
    for name, c in [(ONE_CALL, None)] + [(ring_name(x), x) for x in contexts]:
      rec = dict(cell, row=name, impl="fa2", contexts=c, dtype=DTYPE, status="ok")
      if c is not None:
        rec.update(blocks_per_device=4 * c, live_blocks_per_device=live_blocks(c, cell["causal"]),
                   block=[cell["seq"] // (2 * c)] * 2)
      if run.skip(rec):
        continue
      try:
        if inputs is None:
          inputs = inputs_of(cell, args.seed)
        import fa2_jax
        if c is None:
          rec["backend"] = str(fa2_jax.backend_for(*inputs, is_causal=cell["causal"], **kw))
          rows[name] = (rec, one_call(cell["causal"], **kw), tuple(inputs), c)
        else:
          layout = tuple(fa2_jax.to_context_layout(x, c) for x in inputs)
          rows[name] = (rec, ring_schedule(c, cell["causal"], **kw), layout, c)
      except Exception as e:  # noqa: BLE001
        run.add(dict(rec, status="error", error=h.err_str(e)))
    if rows:
      measure_cell(run, cell, rows, args, t0)
    del inputs, rows
    jax.clear_caches()  # this cell's programs are not used again
  return run.finish(render, summary)


# --- report ------------------------------------------------------------------------------------------

def cells_of(data) -> list[dict]:
  return [c for c in data.get("cells") or [] if "row" in c and "id" in c]


def cell_ids(cells) -> list[str]:
  """Cell ids in build order (unknown ids after, as they came)."""
  known = [c["id"] for size in ("full", "smoke") for c in build_cells(size)]
  ids = list(dict.fromkeys(c["id"] for c in cells))
  return sorted(ids, key=lambda i: (known.index(i) if i in known else len(known), ids.index(i)))


def ring_sizes(cells) -> list[int]:
  return sorted({c["contexts"] for c in cells if c.get("contexts")})


def _time_text(c, pass_) -> str:
  if c is None:
    return "–"
  if c.get("status") == "skipped":
    return "skip"
  ms, tf = (c.get("ms") or {}).get(pass_), (c.get("tflops") or {}).get(pass_)
  if ms is None:
    return "✗ crash" if "crash" in (c.get("error") or "") else "✗"
  return f"{h.fmt_ms(ms)} ms ({h.fmt_tf(tf)})" + (" ⚠" if c.get("warning") else "")


def _ratio_text(c, pass_, bar: bool) -> str:
  r = ((c or {}).get("vs_one_call") or {}).get(pass_)
  if r is None:
    return _time_text(c, pass_) if c and (c.get("ms") or {}).get(pass_) is None else "–"
  return f"{r:.3f}" + ((" ✓" if r <= BAR else " ✗") if bar else "") + (" ⚠" if c.get("warning") else "")


def table(cells, pass_: str) -> str:
  by = {(c["id"], c["row"]): c for c in cells}
  firsts = {c["id"]: c for c in reversed(cells)}
  sizes = ring_sizes(cells)
  bar = pass_ == "fwd+bwd"
  head = ["cell", "causal", "one call: ms (TFLOP/s)"] + [
      f"ring C={x}: ÷ one call" + (f" (bar ≤ {BAR:.2f})" if bar else "") for x in sizes] + [
      f"ring C={x}: ms" for x in sizes]
  rows = []
  for i in cell_ids(cells):
    c = firsts[i]
    rows.append([f"`{i}`", "yes" if c["causal"] else "no", _time_text(by.get((i, ONE_CALL)), pass_)]
                + [_ratio_text(by.get((i, ring_name(x))), pass_, bar) for x in sizes]
                + [h.fmt_ms(((by.get((i, ring_name(x))) or {}).get("ms") or {}).get(pass_)) for x in sizes])
  return h.md_table(head, rows)


def check_table(cells) -> str:
  rows = []
  for i in cell_ids(cells):
    for c in sorted((c for c in cells if c["id"] == i and c.get("err")), key=lambda c: c["contexts"]):
      rows.append([f"`{i}`", c["contexts"]] + [
          h.fmt_num(c["err"].get(k), ".1e") + (" ⚠" if c["err"].get(k, 0) > ERR_TOL else "")
          for k in ("out", "dq", "dk", "dv")])
  return h.md_table(["cell", "C", "out", "dq", "dk", "dv"], rows) if rows else "(no check recorded)"


def evaluate(cells) -> list[dict]:
  """The bar per ring row with a forward+backward ratio: ``{id, contexts, ratio, ok}``."""
  return [dict(id=c["id"], contexts=c["contexts"], ratio=c["vs_one_call"]["fwd+bwd"],
               ok=c["vs_one_call"]["fwd+bwd"] <= BAR)
          for c in cells if (c.get("vs_one_call") or {}).get("fwd+bwd") is not None]


def render(data, base):
  cells, cfg = cells_of(data), data.get("config", {})
  lines = h.header(data, "The ring's per-block schedule on one device against one flash_attention call")
  lines += [
      f"- {cfg.get('shape', '')}, {cfg.get('dtype', DTYPE)}, self-attention T = S; layout "
      f"{cfg.get('layout', 'zigzag')}",
      "- one call: `flash_attention(q, k, v, is_causal=...)` over the whole sequence",
      "- ring C=x: every block of the ring's C devices run one after another on this device, as the "
      "ring runs them (a fori_loop over devices and one over the C steps, 4 blocks per step: "
      "`flash_attention(q_piece, k_piece, v_piece, return_residual=True, q_offset=q start − k start)`, "
      "a block in the causal future skipped by lax.cond, the pieces merged by lse in float32); K/V "
      "sliced out of the zigzag-ordered arrays instead of the ring's ppermute: no communication",
      f"- backward: {cfg.get('backward', '')}",
      f"- timing: {cfg.get('method', '')}; {cfg.get('reps')} × {cfg.get('iters')} calls",
      f"- FLOPs: {cfg.get('flops', '')} (TFLOP/s of every row over the one call's FLOPs)", ""]
  got = evaluate(cells)
  if got:
    bad = [f"{b['id']} C={b['contexts']} {b['ratio']:.3f}" for b in got if not b["ok"]]
    lines += ["## Bar: ring schedule ≤ " f"{BAR:.2f}× one call, forward+backward", "",
              f"- met in {len(got) - len(bad)} of {len(got)} (cell, C)" + (
                  f"; not met: {', '.join(bad)}" if bad else ""), ""]
  blocks = {c["contexts"]: (c["live_blocks_per_device"], c["blocks_per_device"]) for c in cells
            if c.get("contexts") and c.get("causal")}
  lines += ["## Forward+backward", "",
            "Ratio: the ring rows' time over the one call's (✓ at or below the bar); ✗: failed; ⚠: "
            "the ring's output or gradients off the one call's (check below).", "",
            table(cells, "fwd+bwd"), "", "## Forward", "", table(cells, "fwd"), ""]
  if blocks:
    lines += ["Causal: live blocks per device (of 4C; the rest skipped by lax.cond): " + "; ".join(
        f"C={x}: {a} of {b}" for x, (a, b) in sorted(blocks.items())), ""]
  lines += ["## Check: ring against the one call", "",
            f"Relative L2 error of the ring's out, dq, dk, dv (natural order) against the one call's; "
            f"⚠ above {cfg.get('err_tol', ERR_TOL):g}.", "", check_table(cells), ""]
  backends = {c["id"]: c["backend"] for c in cells if c.get("backend")}
  if backends:
    lines += ["One call ran (`fa2_jax.backend_for`): " + "; ".join(
        f"{k}: {v.split(':')[0]}" for k, v in backends.items()), ""]
  lines += h.failures(cells, lambda c: c["row"], lambda c: c["id"])
  lines += [f"- note: {n}" for n in data.get("notes", [])]
  return [h.write_md(lines, base)] + plot(data, cells, base)


def plot(data, cells, base):
  """Ring time ÷ one-call time against T, one line per C (solid fwd+bwd, dashed fwd), a panel for
  causal and one for not; the bar dotted."""
  plt = h.pyplot()
  rings = [c for c in cells if (c.get("vs_one_call") or {}).get("fwd+bwd") is not None
           or (c.get("vs_one_call") or {}).get("fwd") is not None]
  if plt is None or not rings:
    return []
  fig, axes = plt.subplots(1, 2, squeeze=False, figsize=(12.0, 4.6))
  colours = {x: f"C{i}" for i, x in enumerate(ring_sizes(cells))}
  for ax, causal in zip(axes[0], (True, False)):
    for x, colour in colours.items():
      for pass_, ls in (("fwd+bwd", "-"), ("fwd", "--")):
        pts = sorted((c["seq"], c["vs_one_call"][pass_]) for c in rings
                     if c["contexts"] == x and c["causal"] == causal
                     and c["vs_one_call"].get(pass_) is not None)
        if pts:
          ax.plot(*zip(*pts), ls, marker="o", color=colour, label=f"C={x} {pass_}")
    ax.axhline(BAR, ls=":", color="black", lw=1, label=f"bar {BAR:.2f} (fwd+bwd)")
    ax.axhline(1.0, color="grey", lw=0.5)
    if ax.lines:
      h.seq_axis(ax)
    ax.set_ylabel("ring schedule time ÷ one call's")
    ax.set_title("causal" if causal else "not causal", fontsize=10)
    ax.grid(alpha=0.3)
  h.legend_below(fig, axes, ncol=4)
  return h.save(plt, fig, base, data, "Ring's per-block schedule on one device ÷ one flash_attention "
                "call (lower is better)")


def summary(data) -> str:
  cells = cells_of(data)
  caveat = f" ({h.SMOKE_CAVEAT})" if h.is_smoke(data) else ""
  lines = [f"{STEM}: ms fwd+bwd (ratio to one call)" + caveat]
  for i in cell_ids(cells):
    row = []
    for c in sorted((c for c in cells if c["id"] == i), key=lambda c: c.get("contexts") or 0):
      ms = (c.get("ms") or {}).get("fwd+bwd")
      r = (c.get("vs_one_call") or {}).get("fwd+bwd")
      row.append(f"{c['row']} " + (str(c.get("status")) if ms is None else h.fmt_ms(ms))
                 + (f" ({r:.3f})" if r is not None else "") + (" ⚠" if c.get("warning") else ""))
    lines.append(f"  {i:<8} " + "  ".join(row))
  got = evaluate(cells)
  if got:
    lines.append(f"  BAR ring fwd+bwd <= {BAR:.2f}x one call: {sum(b['ok'] for b in got)}/{len(got)} met"
                 + "".join(f"; {b['id']} C={b['contexts']} {b['ratio']:.3f}" for b in got if not b["ok"])
                 + caveat)
  return "\n".join(lines)


def main(argv=None):
  return h.script_main(argv, build_parser(), run, render, summary, STEM, cell_key)


if __name__ == "__main__":
  main()
