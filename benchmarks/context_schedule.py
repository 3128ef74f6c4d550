"""The ring's per-step schedule on one device against one ``flash_attention`` call on the same sequence.

Context parallelism's ring (fa2_jax/context_parallel.py, ``strategy="ring"``) replaces one call over the
whole sequence by C smaller calls per device, one per ring step, whose partial softmaxes are merged by
their lse. Summed over the C devices of the ring, the calls do the work of the one call; what they cost
beyond it (smaller kernels, the merges, the per-step control flow) is what the context-parallel scaling
model needs from the kernel side. This script measures it on ONE device, without communication:

  one call    fa2_jax.flash_attention(q, k, v, is_causal=...) over the whole sequence
  ring Cx     every step of the ring's C devices, in the zigzag layout (device d holds chunks d and
              2C-1-d of 2C), run by the ring's own step functions (context_parallel._forward_start,
              _forward_step, _backward_start, _backward_step): for each device d (a fori_loop, d
              traced as lax.axis_index is in the ring), C steps (at step s the device holds the K/V
              of device src = (d - s) mod C), each ONE ``flash_attention(..., return_residual=True)``
              call on whole chunks (step_calls): step 0 the local chunks against themselves (causal
              when the cell is; its result starts the float32 accumulators), the later steps (a
              fori_loop) not causal: causal, src < d every local query row against the visiting
              first key chunk (chunk src), src > d the later query chunk (2C-1-d) against both
              visiting key chunks, a lax.cond on the traced indices; each merged exactly in float32
              into the query rows it covers (``out = Σ exp(lse_j - lse) out_j``) and cast to the
              input dtype at the end. Backward (a custom_vjp, the ring's kernel path): the same
              loops, each step's call running ``fa2_jax.attention.attention_backward`` with its rows'
              GLOBAL out and lse, dQ and dK/dV accumulated in float32 (in the ring dK/dV travel with
              their K/V). The ring's lax.ppermute is replaced by a slice of the visiting K/V chunks
              out of the zigzag-ordered K/V: no communication is measured.

Inputs: the one call gets q, k, v in their natural order; the ring rows the same arrays in the zigzag
layout (fa2_jax.to_context_layout, outside the timed call) and return their output in it (the loss, an
f32 sum, does not depend on the order).

Cells (``--cells``): ``<T>-c`` (causal) and ``<T>-nc`` (not), T = S in 32k, 64k, 128k; rows
(``--contexts``): C in 2, 4, 8; GQA 32/8 at head_dim 128, bf16, B=1. Bar: ring time ÷ one-call time
≤ BAR (1.05) forward+backward (the forward's ratio is shown beside it).
``--quick``: 32k and 128k with C = 4 and 8, 3 repetitions. ``--smoke`` (automatic without a GPU): T = 64,
GQA 4/2 at head_dim 32, C = 2 and 4, the Triton kernels in Pallas interpret mode.

``--kernels-alone``: also time each distinct kernel call of the ring's steps (step_calls) by itself
(PART_ITERS back-to-back calls per repetition on a GPU, after the cell's rows), a
plain ``flash_attention`` call on leading slices of the cell's inputs of its shape, and report their
sum over the C devices' steps (C × step 0's call + C(C-1) later calls, evenly between a causal cell's
two later shapes) over the one call's time: the part of the ring's cost that its smaller kernel calls
(each with its own backward prologue) account for; the rest is the merges, the float32 accumulation
across steps and the control flow.

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

import functools
import time
import zlib

from . import harness as h
from . import impls
from .timing import PASS_FLOP_MULT, attention_flops, err_str, forward_fn, fwd_bwd_fn, time_interleaved

STEM = "context_schedule"
DTYPE = "bf16"
ITERS = 2  # back-to-back calls per repetition (module docstring: every call takes >= 10 ms)
# --kernels-alone: back-to-back calls per repetition of each step call timed alone (a 32k cell's step
# calls take 0.3-3 ms, where ITERS calls and a sync would add the dispatch to every call: the anchors'
# 10 calls)
PART_ITERS = 10
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


def call_counts(seq: int, contexts: int, causal: bool) -> list[tuple]:
  """``[(label, [query rows, keys], causal, calls)]``: each distinct kernel call of the ring's steps
  (:func:`step_calls`) and how many of them the C devices run in all: step 0's once per device,
  the C - 1 later steps' evenly between a causal cell's two later shapes (zigzag: C(C-1)/2 each)."""
  calls = step_calls(seq, contexts, causal)
  later = calls["later"]
  return [("first", calls["first"], causal, contexts)] + [
      (f"later{i}", shape, False, contexts * (contexts - 1) // len(later))
      for i, shape in enumerate(later)]


def step_calls(seq: int, contexts: int, causal: bool) -> dict:
  """The kernel call of each of one device's C ring steps, ``[query rows, keys]`` (the ring's whole-chunk
  step, context_parallel._forward_step): ``first``: step 0's, the local chunks (T/C x S/C; causal when the
  cell is); ``later``: what each later step runs, not causal: causal, ``[T/C, S/2C]`` (the visiting
  device is before this one: every local row, its first key chunk) or ``[T/2C, S/C]`` (after: the later
  query chunk, every key); not causal ``[T/C, S/C]``."""
  t = seq // contexts
  return dict(first=[t, t], later=[[t, t // 2], [t // 2, t]] if causal else [[t, t]])


# --- the schedule ------------------------------------------------------------------------------------

def ring_schedule(contexts: int, causal: bool, **kw):
  """``f(q, k, v) -> out``, all in the zigzag layout of ``contexts`` devices (``[B, T, N, H]``,
  ``[B, S, K, H]``): the ring's steps of every device (context_parallel's own step functions) on this
  one device; its gradient runs the ring's backward steps (module docstring). ``kw``: flash_attention's
  other keywords (``interpret`` on the CPU)."""
  import jax
  import jax.numpy as jnp
  from jax import lax
  from fa2_jax import context_parallel as cp

  c = contexts
  flags = dict(with_slopes=False, slope_rows=False)

  def setup(q, k, v):
    """The ring's settings for device chunks of these global arrays (no axis: the device index is
    passed to each step)."""
    local = lambda x: jax.ShapeDtypeStruct((x.shape[0], x.shape[1] // c, *x.shape[2:]), x.dtype)  # noqa: E731
    cfg, ops = cp._setup(None, c, "zigzag", "ring", local(q), local(k), local(v), is_causal=causal, **kw)
    assert cfg.whole_chunks, "the ring's step on whole chunks"
    return cfg, ops, q.shape[1] // c, k.shape[1] // c

  def chunk(x, d, size):  # device d's local chunk (its two zigzag chunks) of a zigzag-ordered array
    return None if x is None else lax.dynamic_slice_in_dim(x, d * size, size, axis=1)

  def forward(q, k, v):
    cfg, ops, tq, tk = setup(q, k, v)
    kv_of = lambda src: (chunk(k, src, tk), chunk(v, src, tk), None)  # noqa: E731  (k, v, kv_seg)

    def device(d, bufs):
      q_d = chunk(q, d, tq)
      acc, first = cp._forward_start(cfg, ops, q_d, kv_of(d))

      def step_fn(step, acc):
        src = (d + (c - step)) % c  # the device whose K/V device d holds at this step
        return cp._forward_step(cfg, ops, q_d, kv_of(src), acc, d, src)

      acc = lax.fori_loop(first, c, step_fn, acc)
      out, lse = bufs
      out = lax.dynamic_update_slice_in_dim(out, cp._cat([o for o, _ in acc]).astype(q.dtype), d * tq, 1)
      lse = lax.dynamic_update_slice_in_dim(lse, cp._cat([l for _, l in acc]), d * tq, 1)
      return out, lse

    b, t, n, _ = q.shape
    return lax.fori_loop(0, c, device, (jnp.zeros((b, t, n, v.shape[3]), q.dtype),
                                        jnp.zeros((b, t, n), jnp.float32)))

  def backward(q, k, v, out, lse, dout):
    cfg, ops, tq, tk = setup(q, k, v)
    kv_of = lambda src: (chunk(k, src, tk), chunk(v, src, tk), None)  # noqa: E731
    pieces = lambda buf, src: tuple(cp._piece(chunk(buf, src, tk), i, cfg.pieces)  # noqa: E731
                                    for i in range(cfg.pieces))
    put = lambda buf, src, xs: lax.dynamic_update_slice_in_dim(buf, cp._cat(xs), src * tk, 1)  # noqa: E731

    def device(d, bufs):
      dq_buf, dk_buf, dv_buf = bufs
      rows = tuple(chunk(x, d, tq) for x in (q, None, out, lse, dout, None))  # (q, q_seg, ..., dlse)
      (dq, dk, dv, _), first = cp._backward_start(cfg, ops, rows, kv_of(d), **flags)
      # the first step's dK/dV (zeros where it runs in the loop) go to device d's accumulators
      dk_buf = put(dk_buf, d, [a + b for a, b in zip(pieces(dk_buf, d), dk)])
      dv_buf = put(dv_buf, d, [a + b for a, b in zip(pieces(dv_buf, d), dv)])

      def step_fn(step, carry):
        dq, dk_buf, dv_buf = carry
        src = (d + (c - step)) % c
        # device src's float32 dK/dV accumulators (in the ring they travel with its K/V)
        grads = (dq, pieces(dk_buf, src), pieces(dv_buf, src), None)
        dq, dk, dv, _ = cp._backward_step(cfg, ops, rows, kv_of(src), grads, d, src, **flags)
        return dq, put(dk_buf, src, dk), put(dv_buf, src, dv)

      dq, dk_buf, dv_buf = lax.fori_loop(first, c, step_fn, (dq, dk_buf, dv_buf))
      return (lax.dynamic_update_slice_in_dim(dq_buf, cp._final_dq(cfg, dq, rows[0]), d * tq, 1),
              dk_buf, dv_buf)

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
  p = h.script_parser("context_schedule", __doc__)
  h.add_cell_args(p, "128k-*,*-c")
  p.add_argument("--contexts", type=h.parse_ints, default=None,
                 help="ring sizes C to measure, comma list (default: the size's, 2,4,8; --quick 4,8)")
  p.add_argument("--kernels-alone", action="store_true",
                 help="also time the ring steps' kernel calls alone and report their sum (module "
                      "docstring)")
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


def measure_cell(run, cell: dict, rows: dict, args, t0: float, parts: dict | None = None) -> None:
  """Time the cell's rows, both passes, interleaved (time_interleaved); ratios to the one call; check
  the ring rows; record each. ``rows = {name: (record, f, args, contexts)}``; ``parts = {(contexts,
  label): (f, args, calls)}``: the ring steps' kernel calls alone (``--kernels-alone``), timed with
  them and summed into each ring row's ``kernels_alone_ms``."""
  entries, part_entries = {}, {}
  for name, (rec, f, call_args, _) in rows.items():
    for p in PASSES:
      entries[(name, p)] = ({"fwd": forward_fn, "fwd+bwd": fwd_bwd_fn}[p](f), call_args)
  for key, (f, call_args, _) in (parts or {}).items():
    for p in PASSES:
      part_entries[("part", key, p)] = ({"fwd": forward_fn, "fwd+bwd": fwd_bwd_fn}[p](f), call_args)
  started = set()

  def before(key):
    if key[0] in rows and key[0] not in started:
      started.add(key[0])
      run.begin(rows[key[0]][0], rows[key[0]][0]["row"])

  try:
    timed = time_interleaved(entries, iters=args.iters, reps=args.reps, before=before)
  except Exception as e:  # noqa: BLE001
    timed = {key: e for key in entries}
  if part_entries:  # the short step calls alone: more calls per repetition (PART_ITERS)
    try:
      part_iters = args.iters if args.smoke else max(args.iters, PART_ITERS)
      timed.update(time_interleaved(part_entries, iters=part_iters, reps=args.reps))
    except Exception as e:  # noqa: BLE001
      timed.update({key: e for key in part_entries})
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
    mine = {key: calls for key, (_, _, calls) in (parts or {}).items() if key[0] == contexts}
    if mine:
      rec["kernels_alone_ms"] = {}
      for p in PASSES:
        got = [timed[("part", key, p)] for key in mine]
        if not any(isinstance(g, Exception) for g in got):
          rec["kernels_alone_ms"][p] = sum(
              calls * g[0]["median_s"] * 1e3 for calls, g in zip(mine.values(), got))
    if base is not None and name != ONE_CALL:
      rec["vs_one_call"] = {p: h.ratio(rec["ms"].get(p), base[0]["ms"].get(p)) for p in PASSES}
      if mine:
        rec["kernels_alone_vs_one_call"] = {
            p: h.ratio(rec["kernels_alone_ms"].get(p), base[0]["ms"].get(p)) for p in PASSES}
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
      backward="custom_vjp: the ring's backward steps, attention_backward per step call with the "
               "rows' global out and lse (the ring's kernel path), dq/dk/dv accumulated in float32",
      flops="the one call's: forward 4·B·N·T·S·H, halved when causal; forward+backward 3.5× that",
      method="benchmarks.timing: jit; 2 warm-up calls; median of reps x (iters back-to-back calls, then "
             "block_until_ready), the rows and passes of a cell interleaved (order rotated each "
             "repetition); fwd+bwd = jit(grad(f32 sum of the output)); ring rows on the zigzag-ordered "
             "inputs"), cell_key, sum(1 + len(cs) for _, cs in todo))
  for cell, contexts in todo:
    run.bar.set_postfix_str(cell["id"])
    t0, inputs, rows, parts = time.time(), None, {}, {}
    for name, c in [(ONE_CALL, None)] + [(ring_name(x), x) for x in contexts]:
      rec = dict(cell, row=name, impl="fa2", contexts=c, dtype=DTYPE, status="ok")
      if c is not None:
        rec.update(calls_per_device=c, step_calls=step_calls(cell["seq"], c, cell["causal"]))
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
          if args.kernels_alone:
            for label, (tq, tk), causal, calls in call_counts(cell["seq"], c, cell["causal"]):
              shaped = [x[:, :n] for x, n in zip(inputs, (tq, tk, tk))]
              parts[(c, label)] = (one_call(causal, **kw), tuple(shaped), calls)
      except Exception as e:  # noqa: BLE001
        run.add(dict(rec, status="error", error=h.err_str(e)))
    if rows:
      measure_cell(run, cell, rows, args, t0, parts)
    del inputs, rows, parts
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
  alone = [x for x in sizes if any(
      ((c.get("kernels_alone_vs_one_call") or {}).get(pass_) is not None and c["contexts"] == x)
      for c in cells)]
  head = ["cell", "causal", "one call: ms (TFLOP/s)"] + [
      f"ring C={x}: ÷ one call" + (f" (bar ≤ {BAR:.2f})" if bar else "") for x in sizes] + [
      f"C={x} kernels alone: ÷ one call" for x in alone] + [
      f"ring C={x}: ms" for x in sizes]
  rows = []
  for i in cell_ids(cells):
    c = firsts[i]
    rows.append([f"`{i}`", "yes" if c["causal"] else "no", _time_text(by.get((i, ONE_CALL)), pass_)]
                + [_ratio_text(by.get((i, ring_name(x))), pass_, bar) for x in sizes]
                + [h.fmt_num(((by.get((i, ring_name(x))) or {}).get("kernels_alone_vs_one_call")
                              or {}).get(pass_), ".3f") for x in alone]
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
  lines = h.header(data, "The ring's per-step schedule on one device against one flash_attention call")
  lines += [
      f"- {cfg.get('shape', '')}, {cfg.get('dtype', DTYPE)}, self-attention T = S; layout "
      f"{cfg.get('layout', 'zigzag')}",
      "- one call: `flash_attention(q, k, v, is_causal=...)` over the whole sequence",
      "- ring C=x: the ring's steps of its C devices run one after another on this device by the "
      "ring's own step code (a fori_loop over devices and one over the C steps): ONE "
      "`flash_attention(..., return_residual=True)` call per step on whole chunks — step 0 the local "
      "chunks (causal when the cell is), later steps not causal: causal, every local row against the "
      "visiting first key chunk or the later query chunk against both (a lax.cond on the device "
      "indices) — merged by lse into float32 accumulators; K/V sliced out of the zigzag-ordered "
      "arrays instead of the ring's ppermute: no communication",
      f"- backward: {cfg.get('backward', '')}",
      f"- timing: {cfg.get('method', '')}; {cfg.get('reps')} × {cfg.get('iters')} calls",
      f"- FLOPs: {cfg.get('flops', '')} (TFLOP/s of every row over the one call's FLOPs)", ""]
  got = evaluate(cells)
  if got:
    bad = [f"{b['id']} C={b['contexts']} {b['ratio']:.3f}" for b in got if not b["ok"]]
    lines += ["## Bar: ring schedule ≤ " f"{BAR:.2f}× one call, forward+backward", "",
              f"- met in {len(got) - len(bad)} of {len(got)} (cell, C)" + (
                  f"; not met: {', '.join(bad)}" if bad else ""), ""]
  calls = {(c["id"], c["contexts"]): c["step_calls"] for c in cells if c.get("step_calls")}
  lines += ["## Forward+backward", "",
            "Ratio: the ring rows' time over the one call's (✓ at or below the bar); ✗: failed; ⚠: "
            "the ring's output or gradients off the one call's (check below). Kernels alone "
            "(`--kernels-alone`): the ring steps' kernel calls timed one by one and summed over the C "
            "devices, over the one call's time.", "",
            table(cells, "fwd+bwd"), "", "## Forward", "", table(cells, "fwd"), ""]
  if calls:
    shape = lambda x: "×".join(map(str, x))  # noqa: E731
    lines += ["Kernel calls per device: C, one per ring step, [query rows × keys]: " + "; ".join(
        f"`{cid}` C={x}: step 0 {shape(c['first'])}, then " + " or ".join(shape(s) for s in c["later"])
        for (cid, x), c in calls.items()), ""]  # the cells' order
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
  return h.save(plt, fig, base, data, "Ring's per-step schedule on one device ÷ one flash_attention "
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
      alone = (c.get("kernels_alone_vs_one_call") or {}).get("fwd+bwd")
      row.append(f"{c['row']} " + (str(c.get("status")) if ms is None else h.fmt_ms(ms))
                 + (f" ({r:.3f})" if r is not None else "")
                 + (f" [kernels alone {alone:.3f}]" if alone is not None else "")
                 + (" ⚠" if c.get("warning") else ""))
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
