"""Decode latency: a few new query rows against a key/value cache, forward only.

Every cell is one decoding step, bf16: ``q [B, T_new, N, H]`` against a cache of ``S`` keys per row
(``k, v [B, S, K, H]``, or pages ``[num_pages, page_size, K, H]`` with a ``block_table``), each row's
``key_value_seq_lengths``, ``q_offset = lengths - T_new`` and ``is_causal=True``. GQA 32 query / 8 K/V
heads at head_dim 128 unless the cell says otherwise.

Cells (``--list-cells``; ``--cells`` takes patterns of their ids):

  1x8k, 1x128k, 8x32k, 16x32k, 64x8k   every row full (lengths = S)
  8x32k-ragged, 32x16k-ragged          per-row lengths drawn in [S/8, S] (numpy seed RAGGED_SEED)
  8x32k-t4, 8x32k-t16                  T_new = 4 and 16 new rows (causal among themselves)
  8x32k-mqa                            MQA: 32 query heads, 1 K/V head
  8x32k-d64, 8x32k-d256                head_dim 64 and 256
  8x32k-paged16, 8x32k-paged256        a paged cache, pages of 16 / 256 keys in a shuffled order
                                       (numpy seed PAGE_SEED)

``--quick`` runs QUICK (8 cells, about 3 minutes of an H100/H200 with the compiles); ``--smoke`` (chosen
without a GPU) the same kinds of cell at tiny sizes in Pallas interpret mode.

Rows (``--impls``, default all that run here; benchmarks/impls.py says which peers are absent):

  fa2        fa2_jax.flash_attention(q, k, v, is_causal=True, q_offset=lengths - T_new,
             key_value_seq_lengths=lengths[, block_table=...]): the decode family
  fa2_train  the same call with implementation="sm90" (Hopper) or "triton" (other GPUs): the training
             kernels (a paged cache is gathered first)
  cudnn      jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths,
             implementation="cudnn"): T_new = 1 only (jax.nn has no q_offset), no paged cache
  fa3        flash_attn3_jax.flash_mha_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
             is_causal=True, num_splits=n[, page_table=block_table]): FlashAttention-3's kvcache
             kernel, head_dim 128 only; n is FA3's own split heuristic (fa3_num_splits: the binding
             takes a fixed count, 1 by default) unless --fa3-splits says otherwise
  xla        jax.nn.dot_product_attention(..., implementation="xla"): T_new = 1 only, no paged cache

Timing: benchmarks/timing.py, forward only: jit, 2 warm-up calls, then the median of 5 repetitions of 20
back-to-back calls, the rows of a cell interleaved (time_interleaved). Lengths, q_offset and the block
table are runtime arguments of the jitted call. TB/s = K/V bytes the call must read (2 × Σ lengths ×
K × H × 2 bytes) ÷ time; the md gives the device's copy rate (timing.copy_rate) beside it and the time
of a jitted call that does nothing but scale q (the dispatch floor: a time near it measures the host).

Every output is checked: fa2's against the float32 formula (fa2_jax.reference_attention) on rows 0 and
B−1, every other row's against fa2's output; the max abs error is in the md and a row off by more than
ERR_TOL of the compared output's largest magnitude is flagged (⚠), not silently timed.

``--sweep`` adds rows of DecodeConfig settings (block_k, num_splits / waves, num_warps, num_stages) to
each cell, beside the default (combine with ``--cells`` and ``--impls fa2``: each setting is a compile).

    python -m benchmarks.decode [--quick] [--cells '8x32k*'] [--impls fa2,cudnn,fa3] [--sweep]
    python -m benchmarks.decode --render out/h200/decode.json

Writes decode.json / .md and decode.png (time and TB/s per cell, cells by cache size).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import math
import time
from typing import Callable

import numpy as np

from . import harness as h
from . import impls

STEM = "decode"
DTYPE = "bf16"
ITERS = 20  # back-to-back calls per repetition (the "5 x 20"); timing.REPS repetitions
RAGGED_SEED = 0  # numpy seed of the ragged cells' per-row lengths
PAGE_SEED = 1  # numpy seed of the paged cells' page order
ERR_TOL = 2e-2  # a row whose max abs error exceeds this share of the compared output's magnitude: ⚠
L2_BYTES = 50 * 2 ** 20  # an H100's / H200's L2: K/V below it can stay there between back-to-back calls
BASE = (32, 8, 128)  # heads, K/V heads, head_dim of a cell that says nothing else
SMOKE_BASE = (4, 2, 32)  # the smoke cells' (their S >= 256: decode-shaped)
RATIO_TO = {"cudnn": "cuDNN", "fa3": "FA3"}  # fa2's time over these rows' time in the table


# --- cells -------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Cell:
  """One decoding step's shape. ``ragged``: per-row lengths drawn in ``[lo, hi]`` (else every row
  holds ``capacity`` keys); ``page_size``: a paged cache of that many keys per page."""

  id: str
  label: str
  batch: int
  capacity: int
  t_new: int = 1
  heads: int = 32
  kv_heads: int = 8
  head_dim: int = 128
  ragged: tuple | None = None
  page_size: int | None = None

  def lengths(self) -> np.ndarray:
    """int32 ``[B]``: each row's keys (a fixed seed: every run measures the same lengths)."""
    if self.ragged is None:
      return np.full((self.batch,), self.capacity, np.int32)
    lo, hi = self.ragged
    return np.random.default_rng(RAGGED_SEED).integers(lo, hi + 1, size=self.batch).astype(np.int32)

  def block_table(self) -> np.ndarray | None:
    """int32 ``[B, capacity / page_size]``: every page once, in a shuffled order; None unpaged."""
    if self.page_size is None:
      return None
    per_row = self.capacity // self.page_size
    order = np.random.default_rng(PAGE_SEED).permutation(self.batch * per_row)
    return order.reshape(self.batch, per_row).astype(np.int32)

  def keys(self) -> int:
    """Keys the call reads, summed over the batch (Σ lengths)."""
    return int(self.lengths().sum())

  def kv_bytes(self, itemsize: int = 2) -> int:
    """Bytes of K and V the call must read: 2 × Σ lengths × K × H × itemsize."""
    return 2 * self.keys() * self.kv_heads * self.head_dim * itemsize


def make_cell(batch, capacity, *, t_new=1, heads=32, kv_heads=8, head_dim=128, ragged=None,
              page_size=None, base=None) -> Cell:
  """A cell named after what differs from ``base`` (heads, kv_heads, head_dim): id ``8x32k-ragged``,
  label ``8 × 32k ragged (4k–32k)``."""
  base = base or BASE
  cid, label = f"{batch}x{h.seq_label(capacity)}", f"{batch} × {h.seq_label(capacity)}"
  if ragged:
    cid += "-ragged"
    label += f" ragged ({h.seq_label(ragged[0])}–{h.seq_label(ragged[1])})"
  if t_new > 1:
    cid += f"-t{t_new}"
    label += f", T_new {t_new}"
  if (heads, kv_heads) != tuple(base[:2]):
    cid += "-mqa" if kv_heads == 1 else f"-gqa{heads}x{kv_heads}"
    label += f", {'MQA' if kv_heads == 1 else 'GQA'} {heads}/{kv_heads}"
  if head_dim != base[2]:
    cid += f"-d{head_dim}"
    label += f", head_dim {head_dim}"
  if page_size:
    cid += f"-paged{page_size}"
    label += f", paged ({page_size}-key pages)"
  return Cell(cid, label, batch, capacity, t_new, heads, kv_heads, head_dim,
              tuple(ragged) if ragged else None, page_size)


def full_cells() -> list[Cell]:
  k = 1024
  return [make_cell(1, 8 * k), make_cell(1, 128 * k), make_cell(8, 32 * k), make_cell(16, 32 * k),
          make_cell(64, 8 * k), make_cell(8, 32 * k, ragged=(4 * k, 32 * k)),
          make_cell(32, 16 * k, ragged=(2 * k, 16 * k)), make_cell(8, 32 * k, t_new=4),
          make_cell(8, 32 * k, t_new=16), make_cell(8, 32 * k, kv_heads=1),
          make_cell(8, 32 * k, head_dim=64), make_cell(8, 32 * k, head_dim=256),
          make_cell(8, 32 * k, page_size=16), make_cell(8, 32 * k, page_size=256)]


QUICK = ("1x8k", "1x128k", "8x32k", "64x8k", "8x32k-ragged", "8x32k-t4", "8x32k-mqa", "8x32k-paged256")


def smoke_cells() -> list[Cell]:
  kw = dict(heads=4, kv_heads=2, head_dim=32, base=SMOKE_BASE)
  return [make_cell(1, 256, **kw), make_cell(2, 512, ragged=(64, 512), **kw),
          make_cell(2, 256, t_new=4, **kw), make_cell(2, 256, page_size=16, **kw)]


def build_cells(size: str = "full") -> list[Cell]:
  if size == "smoke":
    return smoke_cells()
  cells = full_cells()
  return [c for c in cells if c.id in QUICK] if size == "quick" else cells


# --- rows --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Row:
  name: str  # its legend name and colour: harness.PALETTE (sweep rows: their own name, grey)
  impl: str  # the benchmarks/impls.py entry whose availability applies
  about: str
  config: object = None  # fa2 sweep rows: the DecodeConfig


ROWS = {r.name: r for r in (
    Row("fa2", "fa2", "fa2_jax.flash_attention(q, k, v, is_causal=True, q_offset=lengths - T_new, "
        "key_value_seq_lengths=lengths[, block_table=...])"),
    Row("fa2_train", "fa2", 'the same with implementation="sm90" (Hopper) or "triton" (other GPUs): '
        "the training kernels (a paged cache gathered first)"),
    Row("cudnn", "cudnn", 'jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths, '
        'implementation="cudnn")'),
    Row("fa3", "fa3", "flash_attn3_jax.flash_mha_with_kvcache(q, k_cache, v_cache, "
        "cache_seqlens=lengths, is_causal=True, num_splits=n[, page_table=block_table])"),
    Row("xla", "xla", 'jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths, '
        'implementation="xla")'),
)}
DEFAULT_ROWS = tuple(ROWS)
XLA_MAX_SCORE_BYTES = 4 * 2 ** 30  # the formula's f32 scores [B, N, T, S]: no row past this


def sweep_configs() -> list:
  """The DecodeConfig grid of ``--sweep``: block_k × warps × stages × (the split rules' own
  programs per SM, two per SM, or one split)."""
  from fa2_jax import DecodeConfig
  return [DecodeConfig(block_k=bk, num_splits=sp, num_warps=w, num_stages=st, waves=wv)
          for bk, w, st in itertools.product((32, 64, 128), (4, 8), (2, 3))
          for sp, wv in ((None, None), (None, 2), (1, None))]


def config_name(cfg) -> str:
  return (f"cfg bk{cfg.block_k} splits {cfg.num_splits or 'auto'} waves {cfg.waves or 'auto'} "
          f"warps {cfg.num_warps} stages {cfg.num_stages}")


def sweep_rows(cell: Cell) -> list[Row]:
  from fa2_jax import DecodeConfig
  default = DecodeConfig.default(cell.head_dim, h.jnp_dtype(DTYPE))
  return [Row(config_name(c), "fa2", f"fa2 with block_sizes={c}", c) for c in sweep_configs()
          if c != default]


def sm_count() -> int:
  """SMs of the device (its ``core_count``; 132, an H100's / H200's, where jax does not say)."""
  import jax
  count = getattr(jax.devices()[0], "core_count", None)
  return count if isinstance(count, int) and count > 0 else 132


def train_implementation() -> str:
  """fa2_train's family: the sm90 kernels on Hopper, Triton elsewhere (CPU: in interpret mode)."""
  return "sm90" if impls.is_hopper() else "triton"


def fa3_num_splits(cell: Cell, sms: int = 132, max_splits: int = 128) -> int:
  """The splits FlashAttention-3 would pick itself (``num_splits=0``: hopper/flash_api.cpp
  ``get_num_splits`` and heuristics.h ``num_splits_heuristic``), which flash_attn3_jax's binding
  cannot ask for (its ``num_splits`` is a fixed count >= 1, default 1). With ``cache_seqlens`` the
  call is varlen, so FA3 sizes the splits for batch 1 (its dynamic split then shares them out per
  row); the GQA group is packed into one 64-row query tile (head_dim 128: ``use_one_mma_wg``), keys
  in blocks of 176 (128 when causal: T_new > 1 or a paged cache)."""
  packed = cell.t_new * (cell.heads // cell.kv_heads)
  block_m = 64 if cell.head_dim == 128 and cell.t_new <= 64 else 128
  block_n = 128 if cell.t_new > 1 or cell.page_size else 176
  m_blocks = -(-packed // block_m)
  total = 1 * cell.kv_heads * m_blocks  # varlen (cache_seqlens): batch counted as 1
  n_blocks = -(-cell.capacity // block_n)
  if total >= 0.8 * sms:
    return 1  # (FA3 splits here only for non-causal calls with >= 2 * sms query tiles)
  if n_blocks <= 4:
    return 1
  top = min(max_splits, sms, n_blocks)
  eff = [(total * s / sms) / math.ceil(total * s / sms) for s in range(1, top + 1)]
  return next(s for s, e in enumerate(eff, 1) if e >= 0.85 * max(eff))


def unsupported(row: Row, cell: Cell) -> str | None:
  """None when ``row`` can run ``cell``, else why not ("skipped ..." for a size left out)."""
  q_shape = (cell.batch, cell.t_new, cell.heads, cell.head_dim)
  kv_shape = (cell.batch, cell.capacity, cell.kv_heads, cell.head_dim)
  if row.name in ("cudnn", "xla"):
    if cell.t_new != 1:
      return ("T_new = 1 only: jax.nn's call has no q_offset, so causal new rows cannot sit at the "
              "end of the cache")
    if cell.page_size:
      return "no paged cache in jax.nn's call"
  if row.name == "xla" and 4 * cell.batch * cell.heads * cell.t_new * cell.capacity > XLA_MAX_SCORE_BYTES:
    return f"skipped: the formula's f32 scores would exceed {h.fmt_bytes(XLA_MAX_SCORE_BYTES)}"
  if row.impl in ("cudnn", "fa3"):
    return impls.unsupported(row.impl, q_shape, kv_shape, h.jnp_dtype(DTYPE), True)
  return None


def call_fn(row: Row, cell: Cell, fa3_splits: int | None = None) -> Callable:
  """``f(q, k, v, lengths, q_offset[, block_table]) -> out`` of the row (jit it)."""
  if row.impl == "fa2":
    kw = dict(interpret=None if impls.on_gpu() else True, block_sizes=row.config,
              implementation=train_implementation() if row.name == "fa2_train" else None)

    def fa2(q, k, v, lens, off, *table):
      import fa2_jax
      return fa2_jax.flash_attention(q, k, v, is_causal=True, q_offset=off, key_value_seq_lengths=lens,
                                     block_table=table[0] if table else None, **kw)
    return fa2
  if row.name in ("cudnn", "xla"):
    def jax_nn(q, k, v, lens, off):
      import jax
      del off
      # jax.nn promotes half precision with float32 implicitly, which strict dtype promotion (the
      # test suite's) refuses: its call runs under the standard promotion
      with jax.numpy_dtype_promotion("standard"):
        return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lens,
                                            implementation=row.name)
    return jax_nn
  if row.name == "fa3":
    splits = fa3_splits or fa3_num_splits(cell, sms=sm_count())

    def fa3(q, k, v, lens, off, *table):
      import flash_attn3_jax
      del off
      return flash_attn3_jax.flash_mha_with_kvcache(
          q, k, v, cache_seqlens=lens, is_causal=True, num_splits=splits,
          page_table=table[0] if table else None)
    return fa3
  raise ValueError(f"unknown row {row.name!r}")


def make_inputs(cell: Cell, seed: int) -> tuple:
  """``(q, k, v, lengths, q_offset[, block_table])`` on the device: fresh normals, the cell's lengths."""
  import jax.numpy as jnp
  kv = ((cell.batch * cell.capacity // cell.page_size, cell.page_size) if cell.page_size
        else (cell.batch, cell.capacity))
  q, k, v = h.random_inputs(seed, [(cell.batch, cell.t_new, cell.heads, cell.head_dim)]
                            + [(*kv, cell.kv_heads, cell.head_dim)] * 2, h.jnp_dtype(DTYPE))
  lens = cell.lengths()
  table = cell.block_table()
  return (q, k, v, jnp.asarray(lens), jnp.asarray(lens - cell.t_new)) + (
      () if table is None else (jnp.asarray(table),))


def reference_rows(cell: Cell, inputs) -> tuple:
  """``(rows, out)``: the float32 formula's output on rows 0 and B−1 (a paged cache gathered)."""
  import jax
  import jax.numpy as jnp
  import fa2_jax
  rows = np.unique([0, cell.batch - 1])
  q, k, v, lens, off = inputs[:5]

  @jax.jit
  def ref(q, k, v, lens, off, *table):
    if table:
      k, v = (x[table[0]].reshape(len(rows), -1, *x.shape[2:]) for x in (k, v))
    else:
      k, v = k[rows], v[rows]
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    return fa2_jax.reference_attention(f32(q[rows]), f32(k), f32(v), is_causal=True,
                                       q_offset=off[rows], key_value_seq_lengths=lens[rows])

  table = () if len(inputs) < 6 else (inputs[5][rows],)
  return rows, jax.block_until_ready(ref(q, k, v, lens, off, *table))


@functools.lru_cache(maxsize=None)
def _max_abs_fn():
  import jax
  import jax.numpy as jnp

  def f(a, b, rows=None):
    a = a if rows is None else a[np.asarray(rows)]
    b = b.astype(jnp.float32)
    return jnp.max(jnp.abs(a.astype(jnp.float32) - b)), jnp.max(jnp.abs(b))
  return jax.jit(f, static_argnames="rows")


def max_abs(a, b, rows=None) -> tuple[float, float]:
  """``(max |a[rows] − b|, max |b|)`` in float32 (one jitted call)."""
  err, scale = _max_abs_fn()(a, b, rows=None if rows is None else tuple(int(r) for r in rows))
  return float(err), float(scale)


# --- measuring ---------------------------------------------------------------------------------------

def cell_key(c):
  return (c.get("id"), c.get("row"))


def record(cell: Cell, row: Row) -> dict:
  lens = cell.lengths()
  return dict(id=cell.id, label=cell.label, row=row.name, impl=row.impl, about=row.about,
              sweep=row.config is not None, batch=cell.batch, capacity=cell.capacity,
              t_new=cell.t_new, heads=cell.heads, kv_heads=cell.kv_heads, head_dim=cell.head_dim,
              page_size=cell.page_size, ragged=list(cell.ragged) if cell.ragged else None,
              lengths=lens.tolist() if cell.ragged else None, keys=int(lens.sum()),
              kv_bytes=cell.kv_bytes(), dtype=DTYPE, status="ok")


def row_names(text: str) -> list[str]:
  """``--impls``: names of ROWS."""
  names = h.parse_strs(text)
  bad = [n for n in names if n not in ROWS]
  if bad:
    raise argparse.ArgumentTypeError(f"unknown rows {bad}; known: {', '.join(ROWS)}")
  return names


def fa3_splits_arg(text: str):
  return None if text == "auto" else h.positive_int(text)


def build_parser():
  p = h.script_parser("decode", __doc__)
  h.add_cell_args(p, "8x32k*,1x*", "print the cells and exit")
  p.add_argument("--impls", type=row_names, default=None,
                 help=f"comma list of {', '.join(ROWS)} (default all that run here)")
  p.add_argument("--fa3-splits", type=fa3_splits_arg, default=None,
                 help="num_splits of FA3's kvcache call: 'auto' (default: FA3's own heuristic, "
                      "computed here) or a count")
  p.add_argument("--sweep", action="store_true",
                 help="add rows of DecodeConfig settings to each cell (a compile each)")
  h.add_common_args(p, counts=True)
  p.set_defaults(iters=ITERS)
  return p


def select_cells(args) -> list[Cell]:
  size = "smoke" if args.smoke else "quick" if args.quick else "full"
  which = {"smoke": "the CPU smoke cells (--smoke, or no GPU)", "quick": "the quick cells",
           "full": "the cells"}[size]
  return h.select(build_cells(size), args.cells, lambda c: c.id, f"{which}; their ids")


def dispatch_floor(iters: int, reps: int) -> dict:
  """Time per call of a jitted call that only scales its first argument, given five small arrays
  like a decode row's: what the host's dispatch costs in the same back-to-back loop."""
  import jax
  import jax.numpy as jnp
  from .timing import time_calls
  args = (jnp.ones((8, 1, 32, 128), jnp.bfloat16),) * 3 + (jnp.ones((8,), jnp.int32),) * 2
  st, _ = time_calls(jax.jit(lambda q, k, v, lens, off: q * 2), args, iters=iters, reps=reps)
  return {"us": st["median_s"] * 1e6, "what": "jit(lambda q, k, v, lengths, q_offset: q * 2)"}


def run(args) -> dict:
  import jax
  from .timing import copy_rate, time_interleaved
  if args.list_cells:
    for c in select_cells(args):
      lens = c.lengths()
      print(f"{c.id:<16} {c.label}: B={c.batch} T_new={c.t_new} N={c.heads} K={c.kv_heads} "
            f"H={c.head_dim} S={c.capacity} lengths {lens.min()}..{lens.max()} "
            f"K/V read {c.kv_bytes() / 1e6:.0f} MB")
    return {}
  info = h.device_info()
  h.cpu_fallback(args, info, STEM)
  cells = select_cells(args)
  wanted = args.impls or list(DEFAULT_ROWS)
  families = list(dict.fromkeys(ROWS[r].impl for r in wanted))
  _, absent = impls.split_available(families)
  info.update(absent_impls=absent, rows={r: ROWS[r].about for r in wanted},
              train_implementation=train_implementation(),
              sm_count=sm_count() if impls.on_gpu() else None)
  todo = [(c, r) for c in cells for r in [ROWS[n] for n in wanted] + (
      sweep_rows(c) if args.sweep and "fa2" in wanted else []) if r.impl not in absent]
  size = "smoke" if args.smoke else "quick" if args.quick else "full"
  run = h.Run(args, STEM, info, dict(
      size=size, cells=[dataclasses.asdict(c) for c in cells], rows=wanted, dtype=DTYPE,
      base="GQA {}/{}, head_dim {}".format(*(SMOKE_BASE if args.smoke else BASE)),
      iters=args.iters, reps=args.reps, sweep=args.sweep, fa3_splits=args.fa3_splits or "auto",
      ragged_seed=RAGGED_SEED, page_seed=PAGE_SEED, err_tol=ERR_TOL,
      bytes="K/V bytes read: 2 × Σ lengths × K × H × 2 (bf16)",
      call="q_offset = lengths - T_new, key_value_seq_lengths = lengths, is_causal=True; forward only",
      method="benchmarks.timing.time_interleaved: jit; 2 warm-up calls; median of reps x (iters "
             "back-to-back calls, then block_until_ready), the repetitions of a cell's rows interleaved "
             "(order rotated each repetition); lengths, q_offset and the block table are runtime "
             "arguments"), cell_key, len(todo))
  if not args.smoke:
    for key, measure in (("copy", copy_rate), ("floor", lambda: dispatch_floor(args.iters, args.reps))):
      if key not in run.rec.data:
        try:
          run.rec.data[key] = measure()
        except Exception as e:  # noqa: BLE001
          run.rec.data[key] = {"error": h.err_str(e)}
    run.rec.flush()
  for ci, cell in enumerate(cells):
    run.bar.set_postfix_str(cell.id)
    t0, inputs, entries, recs = time.time(), None, {}, {}
    for c, row in todo:
      if c is not cell:
        continue
      rec = record(cell, row)
      if run.skip(rec):
        continue
      why = unsupported(row, cell)
      if why:
        run.add(dict(rec, status="skipped" if why.startswith("skipped") else "unsupported", error=why),
                check=False)
        continue
      try:
        if inputs is None:
          inputs = make_inputs(cell, args.seed * 1000 + ci)
        fn = call_fn(row, cell, args.fa3_splits)
        if row.impl == "fa2":
          import fa2_jax
          if row.name == "fa2" or row.config is not None:
            rec["config"] = config_name(row.config or fa2_jax.DecodeConfig.default(
                cell.head_dim, h.jnp_dtype(DTYPE)))
          q, k, v, lens, off = inputs[:5]
          rec["backend"] = str(fa2_jax.backend_for(
              q, k, v, is_causal=True, q_offset=off, key_value_seq_lengths=lens,
              block_table=inputs[5] if len(inputs) > 5 else None,
              interpret=None if impls.on_gpu() else True, block_sizes=row.config,
              implementation=train_implementation() if row.name == "fa2_train" else None))
        if row.name == "fa3":
          rec["num_splits"] = args.fa3_splits or fa3_num_splits(cell, sms=sm_count())
        entries[row.name] = (jax.jit(fn), inputs)
        recs[row.name] = rec
      except Exception as e:  # noqa: BLE001
        run.add(dict(rec, status="error", error=h.err_str(e)))
    if entries:
      measure_cell(run, cell, entries, recs, inputs, args, time_interleaved, t0)
    del inputs, entries, recs
    jax.clear_caches()  # this cell's programs are not used again
  return run.finish(render, summary)


def measure_cell(run, cell, entries, recs, inputs, args, time_interleaved, t0) -> None:
  """Time the cell's rows together, check their outputs, record them."""
  def before(name):
    run.begin(recs[name], recs[name]["row"])

  try:
    res = time_interleaved(entries, iters=args.iters, reps=args.reps, before=before)
  except Exception as e:  # noqa: BLE001
    res = {n: e for n in entries}
  outs = {}
  for name, got in res.items():
    rec = recs[name]
    if isinstance(got, Exception):
      rec.update(status="error", error=h.err_str(got))
      continue
    st, outs[name] = got
    rec.update(timing=st, us=st["median_s"] * 1e6,
               tbps=rec["kv_bytes"] / st["median_s"] / 1e12 if st["median_s"] > 0 else None)
  if outs and impls.on_gpu() and not args.smoke:  # the device's share of each call
    from .timing import device_busy
    for name, busy in device_busy({n: entries[n] for n in outs}, calls=args.iters).items():
      if busy:
        recs[name].update(busy_us=busy * 1e6, busy_tbps=recs[name]["kv_bytes"] / busy / 1e12)
  check_outputs(cell, recs, outs, inputs)
  for rec in recs.values():
    run.add(rec, t0=t0)


def check_outputs(cell, recs, outs, inputs) -> None:
  """fa2 against the float32 formula (rows 0 and B−1), every other row against fa2's output (or
  the formula when fa2 has none): ``max_abs_err``, ``err_vs``; ⚠ ``warning`` past ERR_TOL."""
  ref = None
  for name, out in outs.items():
    rec = recs[name]
    try:
      if name != "fa2" and "fa2" in outs:
        err, scale = max_abs(out, outs["fa2"])
        rec["err_vs"] = "fa2"
      else:
        if ref is None:
          ref = reference_rows(cell, inputs)
        rows, ref_out = ref
        err, scale = max_abs(out, ref_out, rows)
        rec["err_vs"] = "f32 formula, rows " + ", ".join(map(str, rows))
    except Exception as e:  # noqa: BLE001
      rec["check_error"] = f"no check: {h.err_str(e, 300)}"
      continue
    rec.update(max_abs_err=err, ref_max=scale)
    if not err <= ERR_TOL * scale:
      rec["warning"] = (f"output off the {rec['err_vs']}: max abs error {err:.3g} "
                        f"(> {ERR_TOL:g} × its largest magnitude {scale:.3g})")


# --- report ------------------------------------------------------------------------------------------

def cells_of(data) -> list[dict]:
  return [c for c in data.get("cells", []) if "row" in c and "id" in c]


def cell_order(cells) -> list[str]:
  """Cell ids in the order of the cell list (unknown ids after, as they came)."""
  known = [c.id for c in full_cells() + smoke_cells()]
  ids = list(dict.fromkeys(c["id"] for c in cells))
  return sorted(ids, key=lambda i: (known.index(i) if i in known else len(known), ids.index(i)))


def fmt_us(x) -> str:
  return h.fmt_num(x, ".1f" if h.finite(x) and x < 100 else ".0f")


def fmt_tbps(x) -> str:
  """TB/s: two decimals on a GPU, three significant digits for the CPU smoke numbers."""
  return h.fmt_num(x, ".2f" if h.finite(x) and x >= 0.1 else ".3g")


def fmt_mb(x) -> str:
  return h.fmt_num(x / 1e6 if h.finite(x) else None, ",.0f" if h.finite(x) and x >= 1e7 else ".3g") + " MB"


def cell_text(c) -> str:
  if c is None:
    return "–"
  s = c.get("status")
  if s in ("skipped", "unsupported"):
    return "skip" if s == "skipped" else "n/a"
  if not h.finite(c.get("us")):
    return "✗ crash" if "crash" in (c.get("error") or "") else "✗"
  return f"{fmt_us(c['us'])} ({fmt_tbps(c.get('tbps'))})" + (" ⚠" if c.get("warning") else "")


def main_rows(cells) -> list[str]:
  return h.ordered(c["row"] for c in cells if not c.get("sweep"))


def time_ratios(by, cid, names) -> list:
  fa2 = (by.get(("fa2", cid)) or {}).get("us")
  return [h.ratio(fa2, (by.get((n, cid)) or {}).get("us")) for n in RATIO_TO if n in names and "fa2" in names]


def table(data, cells) -> str:
  names = main_rows(cells)
  by = {(c["row"], c["id"]): c for c in cells}
  firsts = {c["id"]: c for c in reversed(cells)}
  copy = (data.get("copy") or {}).get("tbps")
  head = "cell: µs per call (TB/s)" + (f"; copy rate {copy:.2f} TB/s" if h.finite(copy) else "")
  return h.md_table(
      [head, "K/V read"] + [h.style(n)[0] for n in names]
      + [f"fa2_jax ÷ {label} (time)" for n, label in RATIO_TO.items() if n in names and "fa2" in names],
      [[firsts[i]["label"], fmt_mb(firsts[i]["kv_bytes"])]
       + [cell_text(by.get((n, i))) for n in names] + [h.fmt_ratio(r) for r in time_ratios(by, i, names)]
       for i in cell_order(cells)])


def row_table(cells, head: str, text) -> str:
  """A cell × implementation table of ``text(record or None)``."""
  names = main_rows(cells)
  by = {(c["row"], c["id"]): c for c in cells}
  firsts = {c["id"]: c for c in reversed(cells)}
  return h.md_table([head] + [h.style(n)[0] for n in names],
                    [[firsts[i]["label"]] + [text(by.get((n, i))) for n in names]
                     for i in cell_order(cells)])


def busy_table(cells) -> str | None:
  """µs of device work per call (TB/s over it), where a trace gave them (None: nowhere)."""
  if not any(h.finite(c.get("busy_us")) for c in cells):
    return None

  def text(c):
    if c is None or not h.finite(c.get("busy_us")):
      return "–"
    return f"{fmt_us(c['busy_us'])} ({fmt_tbps(c.get('busy_tbps'))})"

  return row_table(cells, "cell: device µs per call (TB/s)", text)


def error_table(cells) -> str:
  def text(c):
    if c is None or not h.finite(c.get("max_abs_err")):
      return "–"
    return f"{c['max_abs_err']:.1e}" + (" ⚠" if c.get("warning") else "")

  return row_table(cells, "cell", text)


def sweep_lines(cells) -> list[str]:
  """Per cell, the DecodeConfig rows against the default, fastest first."""
  by: dict = {}
  for c in cells:
    if c.get("sweep") or c["row"] == "fa2":
      by.setdefault(c["id"], []).append(c)
  lines = []
  for cid in cell_order(cells):
    rows = by.get(cid, [])
    if not any(c.get("sweep") for c in rows):
      continue
    default = next((c.get("us") for c in rows if c["row"] == "fa2"), None)
    rows = sorted(rows, key=lambda c: c.get("us") if h.finite(c.get("us")) else math.inf)
    lines += [f"### {rows[0]['label']}", "", h.md_table(
        ["setting", "µs", "TB/s", "÷ default (time)", "device µs"],
        [[f"default ({c.get('config', '')})" if c["row"] == "fa2" else c["row"],
          fmt_us(c.get("us")) + (" ⚠" if c.get("warning") else ""),
          fmt_tbps(c.get("tbps")), h.fmt_ratio(h.ratio(c.get("us"), default)),
          fmt_us(c.get("busy_us")) if h.finite(c.get("busy_us")) else "–"]
         for c in rows]), ""]
  return ["## DecodeConfig sweep", ""] + lines if lines else []


def render(data, base):
  cells, cfg = cells_of(data), data.get("config", {})
  lines = h.header(data, f"Decode attention against a KV cache ({cfg.get('dtype', DTYPE)})")
  copy, floor = data.get("copy") or {}, data.get("floor") or {}
  lines += [f"- call: {cfg.get('call', '')}; {cfg.get('base', 'GQA 32/8, head_dim 128')} unless the "
            "cell says otherwise",
            f"- TB/s: {cfg.get('bytes', '')} ÷ time"]
  if h.finite(copy.get("tbps")):
    lines.append(f"- this device's copy rate: {copy['tbps']:.2f} TB/s ({copy.get('what', '')})")
  if h.finite(floor.get("us")):
    lines.append(f"- dispatch floor: {floor['us']:.1f} µs per call for `{floor.get('what', '')}` in the "
                 "same loop; a time near it is the host's, not the kernel's")
  small = [c["label"] for c in {c["id"]: c for c in cells}.values()
           if c.get("kv_bytes", math.inf) < L2_BYTES]
  if small and not h.is_smoke(data):
    lines.append(f"- K/V of {'; '.join(small)} fit in the 50 MiB L2 of an H100/H200: back-to-back "
                 "calls may read them from there")
  lines += [f"- timing: {cfg.get('method', '')}; {cfg.get('reps')} × {cfg.get('iters')} calls", "",
            "Cells: µs per call (TB/s); n/a: the implementation cannot express the call; skip: left "
            "out (see below); ✗: failed; ⚠: output off (see the check below). `fa2_jax ÷ X (time)`: "
            "fa2_jax's time over X's (below 1: fa2_jax is faster).", "", table(data, cells), ""]
  busy = busy_table(cells)
  if busy:
    lines += ["## Device time", "",
              "The kernels' and memory operations' durations per call, summed from a `jax.profiler` "
              "trace of each row's back-to-back calls (`benchmarks.timing.device_busy`): the device's "
              "work without the launch gaps and the host's dispatch that the time per call above "
              "includes. TB/s: the same K/V bytes over it.", "", busy, ""]
  lines += ["## Output check", "",
            f"Max abs error of each output: fa2_jax against the float32 formula (rows 0 and B−1), every "
            f"other implementation against fa2_jax's output; ⚠ above {cfg.get('err_tol', ERR_TOL):g} × "
            "the compared output's largest magnitude.", "", error_table(cells), ""]
  backends = {c["label"]: c["backend"] for c in cells if c["row"] == "fa2" and c.get("backend")}
  if backends:
    lines += ["fa2_jax ran (`fa2_jax.backend_for`):", ""] + [
        f"- {k}: {v}" for k, v in backends.items()] + [""]
  splits = {c["label"]: c["num_splits"] for c in cells if c["row"] == "fa3" and c.get("num_splits")}
  if splits:
    lines += ["FlashAttention-3's num_splits (its own heuristic unless `--fa3-splits` set it): "
              + "; ".join(f"{k}: {v}" for k, v in splits.items()), ""]
  ragged = {c["label"]: c["lengths"] for c in cells if c.get("lengths")}
  lines += [f"- lengths of {k}: {', '.join(map(str, v))}" for k, v in ragged.items()]
  lines += sweep_lines(cells)
  lines += h.failures(cells, lambda c: h.style(c["row"])[0], lambda c: c["id"])
  lines += [f"- note: {n}" for n in data.get("notes", [])]
  return [h.write_md(lines, base)] + plot(data, cells, base)


def plot(data, cells, base):
  """Two panels, one bar per implementation at each cell, cells ordered by the keys they read: µs per
  call (log scale) and achieved TB/s (the copy rate dashed)."""
  plt = h.pyplot()
  main = [c for c in cells if not c.get("sweep")]
  names = [n for n in main_rows(main) if any(h.finite(c.get("us")) for c in main if c["row"] == n)]
  if plt is None or not names:
    return []
  firsts = {c["id"]: c for c in reversed(main)}
  order = cell_order(main)
  ids = sorted(order, key=lambda i: (firsts[i]["keys"], order.index(i)))
  by = {(c["row"], c["id"]): c for c in main}
  ticks = [firsts[i]["label"].replace(", ", "\n").replace(" ragged", "\nragged") for i in ids]
  fig, axes = plt.subplots(2, 1, squeeze=False, figsize=(max(8.0, 1.0 * len(ids) + 2.5), 8.5))
  width, x = 0.8 / len(names), np.arange(len(ids))
  copy = (data.get("copy") or {}).get("tbps")
  for ax, (key, ylabel) in zip(axes[:, 0], (("us", "µs per call (median, log scale)"),
                                            ("tbps", "TB/s: K/V bytes read ÷ time"))):
    for j, n in enumerate(names):
      label, colour, hatch = h.style(n)
      vals = [(by.get((n, i)) or {}).get(key) for i in ids]
      ax.bar(x + (j - (len(names) - 1) / 2) * width, [v if h.finite(v) else np.nan for v in vals],
             width, color=colour, hatch=hatch, label=label)
    if key == "us":
      from matplotlib.ticker import FuncFormatter
      ax.set_yscale("log")
      ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    elif h.finite(copy):
      ax.axhline(copy, ls="--", lw=1, color="black", label=f"copy rate ({copy:.2f} TB/s)")
    ax.set_xticks(x, ticks, fontsize=7)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3, which="both")
  axes[0, 0].set_title("time per decoding call (lower is better)", fontsize=10)
  axes[1, 0].set_title("K/V read rate (higher is better)", fontsize=10)
  h.legend_below(fig, axes)
  return h.save(plt, fig, base, data, f"Decode attention, {data.get('config', {}).get('dtype', DTYPE)}, "
                "cells by cache size")


def summary(data) -> str:
  cells = cells_of(data)
  copy = (data.get("copy") or {}).get("tbps")
  lines = [f"{STEM}: us per call (TB/s)" + (f"; copy rate {copy:.2f} TB/s" if h.finite(copy) else "")
           + (f" ({h.SMOKE_CAVEAT})" if h.is_smoke(data) else "")]
  rank = {i: n for n, i in enumerate(cell_order(cells))}
  for c in sorted(cells, key=lambda c: (rank[c["id"]], c.get("sweep", False), h.rank(c["row"]))):
    text = cell_text(c) if h.finite(c.get("us")) else str(c.get("status"))
    lines.append(f"  {c['id']:<16} {c['row']:<12} {text}" + (
        f"  err {c['max_abs_err']:.1e}" if h.finite(c.get("max_abs_err")) else ""))
  return "\n".join(lines)


def main(argv=None):
  return h.script_main(argv, build_parser(), run, render, summary, STEM, cell_key)


if __name__ == "__main__":
  main()
