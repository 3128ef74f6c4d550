"""Speed of the attention variants: fa2_jax's variant arguments beside the same work done another way
(a dense call, the documents as a batch) and beside the peers, forward and forward+backward, with the
bars they must meet.

Cells (bf16, head_dim 128, 16 heads; ``--smoke``: the same cells at tiny sizes):

  window-32k, window-128k   local window (4095, 0), causal, B=1: fa2 (``local_window_size``), fa2's dense
                            causal call (the bar's reference), FA3 (``window_size``), cuDNN
                            (``local_window_size``)
  packed-8x4k               32k tokens, 8 documents of 4k, causal within each (B=1): fa2 with
                            ``q_segment_ids = kv_segment_ids``; fa2 on the documents as a batch [8, 4k];
                            FA3 varlen (``cu_seqlens``); cuDNN on the batch
  packed-ragged             32k tokens of documents 100 ... 8k long (numpy seed RAGGED_SEED): the same
                            rows; the batch rows pad every document to the longest (rounded up to 128)
                            and pass ``query_seq_lengths = key_value_seq_lengths`` (one call, the layout
                            cuDNN takes; per-document calls would compile one program per length and
                            pay one launch per document)
  softcap-8k-c, -nc         B=2: fa2 with ``logits_soft_cap=50``, fa2 without, tokamax with the soft cap
                            (FA3's binding has no soft cap, jax.nn's cuDNN call neither)
  padding-8k-nc, -c         B=2, 50% fill: fa2 with ``query_seq_lengths = key_value_seq_lengths = 4096``,
                            the unpadded 8k call, cuDNN with the same lengths
  maskfn-causal-32k,        B=1: fa2 with a ``mask_fn`` equal to causal / to the window (4095, 0)
  maskfn-window-32k         (``is_causal=False``), fa2's built-in ``is_causal`` / ``local_window_size``

TFLOP/s count the *attended* (query, key) pairs: forward 4·N·H·pairs, forward+backward 3.5× that, so a
row that skips masked blocks gets no credit for them and rows doing the same work compare as times.
Bars (each pass, fwd and fwd+bwd, must meet it):
  window   fa2's rate ≥ 0.9× fa2's dense causal rate (per attended pair)
  padding  fa2 at 50% fill ≤ 0.55× the unpadded call's time
  maskfn   fa2 with mask_fn ≤ 1.10× the built-in's time
Every forward output is also checked against fa2_jax.reference_attention in float32 (batch 0, the
first REF_HEADS heads, the rows that hold tokens; ⚠ when off).

    python -m benchmarks.variants [--cells 'window-*,packed-*'] [--impls fa2,cudnn,fa3,tokamax]
                                  [--out DIR] [--quick] [--smoke] [--list-cells]
    python -m benchmarks.variants --merge a/variants.json b/variants.json --out DIR

``--quick`` leaves out window-128k (the longest cell). Timing: benchmarks/timing.py (segment ids, lengths
and cu_seqlens are arguments of the jitted call, as in training, not compile-time constants). The plot
draws each row in its implementation's colour, hatched where it does the same work another way.
"""

from __future__ import annotations

import dataclasses
import importlib
import time
import zlib
from typing import Callable

import numpy as np

from . import harness as h
from . import impls
from .harness import seq_label

STEM = "variants"
FAMILIES = ("fa2", "cudnn", "fa3", "tokamax")  # the registry entries (benchmarks/impls.py) with rows here
REF_HEADS = 2  # the reference check compares batch 0, the first REF_HEADS heads
DTYPE = "bf16"  # the inputs of every cell
QUICK_SKIP = ("window-128k",)  # --quick leaves out the longest cell
KIND_TITLES = {"window": "local window (4095, 0), causal", "packed": "packed documents, causal",
               "softcap": "soft cap 50", "padding": "50% padding", "maskfn": "mask_fn against the built-in"}
PASSES = ("fwd", "fwd+bwd")  # every row is timed, and every bar checked, on each pass
SOFT_CAP = 50.0  # logits_soft_cap of the soft-cap cells (Gemma 2's attention cap)
RAGGED_SEED = 0  # numpy seed of the ragged document lengths (fixed: every run packs the same documents)
PAD_MULTIPLE = 128  # the padded batch's length: the longest document rounded up to whole 128-row tiles

# Sizes of the cells. full: the GPU sweep; smoke: seconds on a CPU in Pallas interpret mode. window: the
# left reach of the (window, 0) cells (4095: 4096 keys with the query's own); tokens / docs: the packed
# cells (equal documents: tokens // docs each; ragged: lengths in ragged = (lo, hi)); batch: of the
# soft-cap and padding cells; pad_fill: the tokens each padded sequence holds.
SIZES = {
    "full": dict(heads=16, head_dim=128, window=4095, window_seqs=(32768, 131072), tokens=32768, docs=8,
                 ragged=(100, 8192), batch=2, cap_seq=8192, pad_seq=8192, pad_fill=4096,
                 mask_seq=32768),
    "smoke": dict(heads=2, head_dim=32, window=31, window_seqs=(128,), tokens=256, docs=4,
                  ragged=(8, 96), batch=2, cap_seq=64, pad_seq=64, pad_fill=32, mask_seq=128),
}


# --- attended pairs -----------------------------------------------------------------------------------

def causal_pairs(n: int, left: int | None = None) -> int:
  """(query, key) pairs of a causal ``n x n`` call, key ``j`` in ``[i - left, i]`` (``left=None``: all
  ``j <= i``)."""
  if left is None or left >= n - 1:
    return n * (n + 1) // 2
  # rows i < left see i + 1 keys, the others left + 1
  return left * (left + 1) // 2 + (n - left) * (left + 1)


def dense_pairs(n: int, causal: bool) -> int:
  return causal_pairs(n) if causal else n * n


def ragged_lengths(total: int, lo: int, hi: int, seed: int = RAGGED_SEED) -> list[int]:
  """Document lengths in ``[lo, hi]`` summing to ``total`` (``total >= lo``), drawn uniformly with a
  fixed numpy seed; each draw leaves at least ``lo`` tokens for the documents after it."""
  if not 1 <= lo <= hi or total < lo:
    raise ValueError(f"need 1 <= lo <= hi and total >= lo, got total={total}, lo={lo}, hi={hi}")
  rng = np.random.default_rng(seed)
  lens, left = [], total
  while left > hi:
    n = int(rng.integers(lo, min(hi, left - lo) + 1))
    lens.append(n)
    left -= n
  return lens + [left]


# --- cells and rows -----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Arr:
  """A keyword argument that is one of the cell's integer arrays (``Cell.arrays[name]``): passed to the
  timed function as a runtime argument."""

  name: str


@dataclasses.dataclass(frozen=True)
class Row:
  """One measured call of a cell."""

  name: str  # unique in its cell: fa2, fa2_dense, fa3, cudnn_batch, ... (its legend: harness.PALETTE)
  impl: str  # the benchmarks/impls.py entry whose availability and shape limits apply
  about: str  # the call, in words
  layout: str  # which of the cell's input layouts it runs on
  causal: bool
  kw: dict  # the call's keyword arguments (Arr values: runtime arrays)
  pairs: int  # attended (query, key) pairs per head, summed over the batch
  ref: dict  # fa2_jax.reference_attention arguments computing the same attention on this layout
  call: Callable | None = None  # f(q, k, v, *, causal, **kw); None: the registry entry


@dataclasses.dataclass
class Cell:
  id: str
  kind: str  # window, packed, softcap, padding, maskfn
  title: str
  heads: int
  head_dim: int
  layouts: dict  # name -> (batch, seq)
  rows: list
  arrays: dict = dataclasses.field(default_factory=dict)  # name -> int32 numpy array
  info: dict = dataclasses.field(default_factory=dict)  # recorded with every row (document lengths...)


def _fa3_varlen(q, k, v, *, causal, cu_seqlens, max_seqlen):
  """FlashAttention-3's varlen call on the packed layout ``[1, total, N, H]`` (a free reshape)."""
  fa3 = importlib.import_module("flash_attn3_jax")
  return fa3.flash_mha_varlen(q[0], k[0], v[0], cu_seqlens, cu_seqlens, max_seqlen_q=max_seqlen,
                              max_seqlen_k=max_seqlen, is_causal=causal)[None]


def _window_cell(seq, w, n, d):
  win = dict(local_window_size=(w, 0))
  pw = causal_pairs(seq, w)
  ref = dict(is_causal=True, **win)
  rows = [
      Row("fa2", "fa2", f"flash_attention(is_causal=True, local_window_size=({w}, 0))",
          layout="seq", causal=True, kw=win, pairs=pw, ref=ref),
      Row("fa2_dense", "fa2", "flash_attention(is_causal=True)",
          layout="seq", causal=True, kw={}, pairs=causal_pairs(seq), ref=dict(is_causal=True)),
      Row("fa3", "fa3", f"flash_mha(is_causal=True, window_size=({w}, 0))",
          layout="seq", causal=True, kw=dict(window_size=(w, 0)), pairs=pw, ref=ref),
      Row("cudnn", "cudnn", 'jax.nn.dot_product_attention(implementation="cudnn", '
          f"is_causal=True, local_window_size=({w}, 0))",
          layout="seq", causal=True, kw=win, pairs=pw, ref=ref),
  ]
  return Cell(f"window-{seq_label(seq)}", "window", f"window ({w}, 0) causal, {seq_label(seq)} (B=1)",
              n, d, layouts={"seq": (1, seq)}, rows=rows)


def _packed_cell(lens, n, d, ragged):
  """Documents ``lens`` packed in one causal row of ``sum(lens)`` tokens, and the same as a batch."""
  lens = [int(x) for x in lens]
  total, docs = sum(lens), len(lens)
  seg = np.repeat(np.arange(docs, dtype=np.int32), lens)[None]  # [1, total]: document of each token
  cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)  # [docs + 1]: FA3's cu_seqlens
  pairs = sum(causal_pairs(x) for x in lens)
  packed = dict(q_segment_ids=Arr("seg"), kv_segment_ids=Arr("seg"))
  if ragged:
    width = -(-max(lens) // PAD_MULTIPLE) * PAD_MULTIPLE
    batch = dict(query_seq_lengths=Arr("lens"), key_value_seq_lengths=Arr("lens"))
    cid, what = "packed-ragged", f"{docs} documents of {min(lens)} ... {max(lens)} tokens"
    on_batch = f"a padded batch [{docs}, {width}], query_seq_lengths = key_value_seq_lengths"
  else:
    width, batch = lens[0], {}
    cid, what = f"packed-{docs}x{seq_label(width)}", f"{docs} documents of {seq_label(width)}"
    on_batch = f"a batch [{docs}, {seq_label(width)}]"
  rows = [
      Row("fa2", "fa2", "flash_attention(is_causal=True, q_segment_ids = "
          "kv_segment_ids = document ids) on [1, total]",
          layout="packed", causal=True, kw=packed, pairs=pairs, ref=dict(is_causal=True, **packed)),
      Row("fa2_batch", "fa2", f"flash_attention(is_causal=True) on {on_batch}",
          layout="batch", causal=True, kw=batch, pairs=pairs, ref=dict(is_causal=True, **batch)),
      Row("fa3_varlen", "fa3", "flash_mha_varlen(cu_seqlens, max_seqlen = "
          "longest document, is_causal=True) on [total]",
          layout="packed", causal=True, kw=dict(cu_seqlens=Arr("cu"), max_seqlen=max(lens)),
          pairs=pairs, ref=dict(is_causal=True, **packed), call=_fa3_varlen),
      Row("cudnn_batch", "cudnn",
          f'jax.nn.dot_product_attention(implementation="cudnn", is_causal=True) on {on_batch}',
          layout="batch", causal=True, kw=batch, pairs=pairs, ref=dict(is_causal=True, **batch)),
  ]
  return Cell(cid, "packed", f"packed: {seq_label(total)} tokens, {what}, causal", n, d,
              layouts={"packed": (1, total), "batch": (docs, width)}, rows=rows,
              arrays=dict(seg=seg, cu=cu, lens=np.asarray(lens, np.int32)),
              info=dict(doc_lengths=lens, padded_width=width if ragged else None))


def _softcap_cell(seq, b, n, d, causal):
  cap = dict(logits_soft_cap=SOFT_CAP)
  p = b * dense_pairs(seq, causal)
  flag = "is_causal=True, " if causal else ""  # the call text names what the row passes
  rows = [
      Row("fa2", "fa2", f"flash_attention({flag}logits_soft_cap={SOFT_CAP:g})",
          layout="seq", causal=causal, kw=cap, pairs=p, ref=dict(is_causal=causal, **cap)),
      Row("fa2_nocap", "fa2", f"flash_attention({flag.rstrip(', ')})",
          layout="seq", causal=causal, kw={}, pairs=p, ref=dict(is_causal=causal)),
      Row("tokamax", "tokamax", 'tokamax.dot_product_attention(implementation='
          f'"mosaic", {flag}logits_soft_cap={SOFT_CAP:g})',
          layout="seq", causal=causal, kw=cap, pairs=p, ref=dict(is_causal=causal, **cap)),
  ]
  mode = "causal" if causal else "non-causal"
  return Cell(f"softcap-{seq_label(seq)}-{'c' if causal else 'nc'}", "softcap",
              f"soft cap {SOFT_CAP:g}, {seq_label(seq)} {mode} (B={b})", n, d,
              layouts={"seq": (b, seq)}, rows=rows)


def _padding_cell(seq, fill, b, n, d, causal):
  lens = dict(query_seq_lengths=Arr("lens"), key_value_seq_lengths=Arr("lens"))
  p_fill = b * dense_pairs(fill, causal)
  rows = [
      Row("fa2", "fa2",
          f"flash_attention(query_seq_lengths = key_value_seq_lengths = {fill})",
          layout="seq", causal=causal, kw=lens, pairs=p_fill, ref=dict(is_causal=causal, **lens)),
      Row("fa2_full", "fa2", f"flash_attention() on all {seq_label(seq)}",
          layout="seq", causal=causal, kw={}, pairs=b * dense_pairs(seq, causal),
          ref=dict(is_causal=causal)),
      Row("cudnn", "cudnn", 'jax.nn.dot_product_attention(implementation="cudnn", '
          f"query_seq_lengths = key_value_seq_lengths = {fill})",
          layout="seq", causal=causal, kw=lens, pairs=p_fill, ref=dict(is_causal=causal, **lens)),
  ]
  mode = "causal" if causal else "non-causal"
  return Cell(f"padding-{seq_label(seq)}-{'c' if causal else 'nc'}", "padding",
              f"padding: {seq_label(fill)} of {seq_label(seq)} filled, {mode} (B={b})", n, d,
              layouts={"seq": (b, seq)}, rows=rows, arrays=dict(lens=np.full((b,), fill, np.int32)))


def _causal_mask(b, head, q_idx, kv_idx):
  del b, head
  return kv_idx <= q_idx


def _window_mask(left: int):
  def mask(b, head, q_idx, kv_idx):
    del b, head
    return (kv_idx <= q_idx) & (kv_idx >= q_idx - left)
  return mask


def _maskfn_cell(seq, n, d, left=None):
  """fa2 with a mask_fn equal to causal (``left=None``) or to the window ``(left, 0)``; the built-in."""
  if left is None:
    name, title, builtin, mask, text = "causal", "causal", {}, _causal_mask, "kv_idx <= q_idx"
  else:
    name, title = "window", f"window ({left}, 0)"
    builtin, mask, text = dict(local_window_size=(left, 0)), _window_mask(left), (
        f"q_idx - {left} <= kv_idx <= q_idx")
  pairs, ref = causal_pairs(seq, left), dict(is_causal=True, **builtin)
  call = "flash_attention(is_causal=True" + "".join(f", {k}={v}" for k, v in builtin.items()) + ")"
  rows = [
      Row("fa2_mask_fn", "fa2", f"flash_attention(mask_fn: {text})",
          layout="seq", causal=False, kw=dict(mask_fn=mask), pairs=pairs, ref=ref),
      Row("fa2", "fa2", call,
          layout="seq", causal=True, kw=builtin, pairs=pairs, ref=ref),
  ]
  return Cell(f"maskfn-{name}-{seq_label(seq)}", "maskfn", f"mask_fn = {title}, {seq_label(seq)} (B=1)",
              n, d, layouts={"seq": (1, seq)}, rows=rows)


def build_cells(size: str = "full") -> list[Cell]:
  s = SIZES[size]
  n, d, w = s["heads"], s["head_dim"], s["window"]
  return ([_window_cell(t, w, n, d) for t in s["window_seqs"]]
          + [_packed_cell([s["tokens"] // s["docs"]] * s["docs"], n, d, ragged=False),
             _packed_cell(ragged_lengths(s["tokens"], *s["ragged"]), n, d, ragged=True)]
          + [_softcap_cell(s["cap_seq"], s["batch"], n, d, c) for c in (True, False)]
          + [_padding_cell(s["pad_seq"], s["pad_fill"], s["batch"], n, d, c) for c in (False, True)]
          + [_maskfn_cell(s["mask_seq"], n, d), _maskfn_cell(s["mask_seq"], n, d, w)])


# --- bars and comparisons -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Bar:
  row: str
  ref: str
  measure: str  # "rate": TFLOP/s over attended pairs, row ÷ ref; "time": ms, row ÷ ref
  op: str  # ">=" or "<="
  threshold: float
  text: str


BARS = {
    "window": [Bar("fa2", "fa2_dense", "rate", ">=", 0.9,
                   "fa2 window rate ≥ 0.9× fa2 dense causal rate (per attended pair)")],
    "padding": [Bar("fa2", "fa2_full", "time", "<=", 0.55, "fa2 at 50% fill ≤ 0.55× the unpadded time")],
    "maskfn": [Bar("fa2_mask_fn", "fa2", "time", "<=", 1.10, "fa2 mask_fn ≤ 1.10× the built-in's time")],
}
# (row, other): row's rate over other's, both over the same attended pairs (so other's time ÷ row's).
COMPARE = {
    "window": [("fa2", "fa3"), ("fa2", "cudnn")],
    "packed": [("fa2", "fa2_batch"), ("fa2", "fa3_varlen"), ("fa2", "cudnn_batch")],
    "softcap": [("fa2", "fa2_nocap"), ("fa2", "tokamax")],
    "padding": [("fa2", "cudnn")],
    "maskfn": [],
}
KINDS = ("window", "packed", "softcap", "padding", "maskfn")


# --- measuring ------------------------------------------------------------------------------------------

def cell_key(c):
  return (c.get("id"), c.get("row"))


def _resolve(kw: dict, arrays: dict) -> dict:
  """``kw`` with each Arr replaced by the cell's array."""
  import jax.numpy as jnp
  return {k: jnp.asarray(arrays[v.name]) if isinstance(v, Arr) else v for k, v in kw.items()}


def timed_fn(row: Row):
  """``(f(q, k, v, *aux), aux names)``: the row's call with its array arguments as runtime ``aux``."""
  fn = row.call or impls.get(row.impl)
  names = [k for k, v in row.kw.items() if isinstance(v, Arr)]
  static = {k: v for k, v in row.kw.items() if not isinstance(v, Arr)}

  def f(q, k, v, *aux):
    return fn(q, k, v, causal=row.causal, **static, **dict(zip(names, aux)))

  return f, tuple(row.kw[n].name for n in names)


def record(cell: Cell, row: Row) -> dict:
  batch, seq = cell.layouts[row.layout]
  return dict(id=cell.id, kind=cell.kind, title=cell.title, row=row.name, impl=row.impl, about=row.about,
              layout=row.layout, batch=batch, seq=seq, heads=cell.heads, head_dim=cell.head_dim,
              causal=row.causal, dtype=DTYPE, pairs=row.pairs, status="ok",
              flops_fwd=4.0 * cell.heads * cell.head_dim * row.pairs, **cell.info)


def build_parser():
  p = h.script_parser("variants", __doc__)
  h.add_cell_args(p, "window-*,packed-*", "print the cell ids and rows, and exit")
  p.add_argument("--impls", type=h.impl_names, default=None,
                 help=f"rows of these registry entries only: comma list of {', '.join(FAMILIES)} "
                      "(default all)")
  p.add_argument("--no-check", action="store_true", help="skip the f32 reference check")
  h.add_common_args(p, counts=True)
  return p


def select_cells(args) -> list[Cell]:
  """The cells of the size that runs (``--cells``: those matching a pattern)."""
  every = [c for c in build_cells("smoke" if args.smoke else "full")
           if not (args.quick and c.id in QUICK_SKIP)]
  which = ("the CPU smoke cells (--smoke, or no GPU)" if args.smoke else
           "the quick GPU cells" if args.quick else "the GPU cells")
  return h.select(every, args.cells, lambda c: c.id, f"{which}; their ids")


def run(args) -> dict:
  import jax
  families = args.impls or list(FAMILIES)
  if set(families) - set(FAMILIES):
    bad = [n for n in families if n not in FAMILIES]
    raise SystemExit(f"--impls: {', '.join(bad)} {'has' if len(bad) == 1 else 'have'} no rows here; "
                     f"the variants' rows run {', '.join(FAMILIES)}")
  if args.list_cells:
    for c in select_cells(args):
      shapes = ", ".join(f"{k} [{b}, {t}]" for k, (b, t) in c.layouts.items())
      print(f"{c.id:<20} {c.title}; {c.heads} x {c.head_dim}; {shapes}; rows "
            + " ".join(r.name for r in c.rows if r.impl in families))
    return {}
  info = h.device_info()
  h.cpu_fallback(args, info, STEM)
  cells = select_cells(args)
  names, absent = impls.split_available(families)
  info.update(absent_impls=absent, impls={n: impls.get(n).about for n in names})
  size = "smoke" if args.smoke else "full"
  todo = [(c, r) for c in cells for r in c.rows if r.impl in families]
  run = h.Run(args, STEM, info, dict(
      size=size, sizes=SIZES[size], cells=[dict(id=c.id, kind=c.kind, title=c.title, layouts=c.layouts,
                                                rows=[r.name for r in c.rows], **c.info) for c in cells],
      impls=families, dtype=DTYPE, iters=args.iters, reps=args.reps, soft_cap=SOFT_CAP,
      ragged_seed=RAGGED_SEED, pad_multiple=PAD_MULTIPLE,
      bars={k: [dataclasses.asdict(b) for b in v] for k, v in BARS.items()},
      flops="forward 4·N·H·(attended pairs), forward+backward 3.5× that",
      method="benchmarks.timing: jit; 2 warm-up calls; median of reps x (iters back-to-back calls, then "
             "block_until_ready), the repetitions of a cell's rows and passes interleaved (order "
             "rotated each repetition); fwd+bwd = jit(grad(f32 sum of the output)); integer arrays "
             "(segment ids, lengths, cu_seqlens) are runtime arguments"), cell_key, len(todo))
  for cell in cells:
    run.bar.set_postfix_str(cell.id)
    t0, inputs, refs, rows = time.time(), None, {}, {}
    for row in (r for r in cell.rows if r.impl in families):
      rec = record(cell, row)
      if row.impl in absent:
        if run.rec.key(rec) not in run.rec.done:
          run.add(dict(rec, status="unavailable", error=absent[row.impl]), check=False)
        continue
      if run.skip(rec):
        continue
      try:
        if inputs is None:  # drawn from the cell's id: a --cells subset measures the same inputs
          inputs = {name: h.random_inputs(zlib.crc32(f"{cell.id}/{name}/{args.seed}".encode()),
                                          [(b, t, cell.heads, cell.head_dim)] * 3, h.jnp_dtype(DTYPE))
                    for name, (b, t) in cell.layouts.items()}
        q, k, v = inputs[row.layout]
        why = impls.unsupported(row.impl, q.shape, k.shape, q.dtype, row.causal)
        if why:
          run.add(dict(rec, status="unsupported", error=why), check=False)
          continue
        if impls.get(row.impl).describe is not None and row.call is None:
          rec["backend"] = str(impls.get(row.impl).describe(q, k, v, causal=row.causal,
                                                             **_resolve(row.kw, cell.arrays)))
        f, aux = timed_fn(row)
        rows[row.name] = (rec, f, (q, k, v, *(jax.numpy.asarray(cell.arrays[n]) for n in aux)))
      except Exception as e:  # noqa: BLE001
        run.add(dict(rec, status="error", error=h.err_str(e)))

    def check(name, out, cell=cell, inputs=inputs, refs=refs):
      if args.no_check:
        return None
      row = next(r for r in cell.rows if r.name == name)
      key = (row.layout, repr(sorted(row.ref.items())))
      if key not in refs:
        refs[key] = h.reference(*inputs[row.layout], REF_HEADS, **_resolve(row.ref, cell.arrays))
      return h.rel_err(out, *refs[key])

    if rows:
      run.together(rows, iters=args.iters, reps=args.reps, check=check, t0=t0)
    del inputs, refs, rows, check
    jax.clear_caches()  # compiled programs of this cell's shapes are not used again
  return run.finish(render, summary)


# --- report ---------------------------------------------------------------------------------------------

def _value(c, measure, p):
  return ((c or {}).get("tflops" if measure == "rate" else "ms") or {}).get(p)


def by_cell(cells) -> dict:
  out: dict = {}
  for c in cells:
    if "row" in c and "id" in c:
      out.setdefault(c["id"], {})[c["row"]] = c
  return out


def evaluate(cells) -> list[dict]:
  """Every bar of every measured cell: ``ratio`` and ``ok`` per pass, ``verdict`` pass / fail / n/a
  (pass: every pass measured and within the bar)."""
  out = []
  for cid, by in by_cell(cells).items():
    kind = next(iter(by.values())).get("kind")
    for bar in BARS.get(kind, []):
      r = {p: h.ratio(_value(by.get(bar.row), bar.measure, p), _value(by.get(bar.ref), bar.measure, p))
           for p in PASSES}
      ok = {p: None if r[p] is None else bool(r[p] >= bar.threshold if bar.op == ">="
                                              else r[p] <= bar.threshold) for p in PASSES}
      verdict = ("fail" if any(v is False for v in ok.values()) else
                 "pass" if all(v is not None for v in ok.values()) else "n/a")
      out.append(dict(cell=cid, kind=kind, text=bar.text, row=bar.row, ref=bar.ref, measure=bar.measure,
                      op=bar.op, threshold=bar.threshold, ratio=r, ok=ok, verdict=verdict))
  return out


def compare(by: dict, kind: str) -> list[tuple[str, str, dict]]:
  """``(row, other, {pass: row's rate ÷ other's})`` for the pairs of COMPARE both measured."""
  got = [(a, b, {p: h.ratio(_value(by.get(a), "rate", p), _value(by.get(b), "rate", p)) for p in PASSES})
         for a, b in COMPARE.get(kind, [])]
  return [g for g in got if any(v is not None for v in g[2].values())]


def _status_text(c) -> str:
  s = c.get("status")
  if s == "ok" or s == "partial" and (c.get("ms") or {}):
    parts = ((c.get("backend") or "").split(":")[0], "⚠" if c.get("warning") else "",
             "partial" if s == "partial" else "")
    return " ".join(x for x in parts if x) or "ok"
  return {"unavailable": "absent", "unsupported": "n/a", "skipped": "skip"}.get(s, "✗")


def render(data, base):
  cells, cfg = [c for c in data.get("cells", []) if "row" in c and "id" in c], data.get("config", {})
  lines = h.header(data, "Attention variants: speed and bars (bf16)") + [
      f"- FLOPs over *attended* (query, key) pairs: {cfg.get('flops', '')}",
      f"- timing: {cfg.get('method', '')}",
      "- cells: ms and TFLOP/s `fwd / fwd+bwd`; fa2_jax rows name the kernels that ran "
      "(`fa2_jax.backend_for`); absent: implementation not importable here; n/a: shape not supported; "
      "⚠: forward output off the f32 reference", ""]
  bars = evaluate(cells)
  if bars:
    lines += ["## Bars", "", h.md_table(
        ["cell", "bar", *(f"{p} ratio" for p in PASSES), "verdict"],
        [[b["cell"], b["text"], *(h.fmt_num(b["ratio"][p], ".2f") for p in PASSES), f"**{b['verdict']}**"]
         for b in bars]), ""]
  for cid, by in by_cell(cells).items():
    first = next(iter(by.values()))
    lines += [f"## {cid}: {first.get('title', '')}", ""]
    if first.get("doc_lengths"):
      lens = first["doc_lengths"]
      lines += [f"Documents ({len(lens)}): {', '.join(map(str, lens))}" + (
          f"; padded batch width {first['padded_width']}" if first.get("padded_width") else ""), ""]
    lines.append(h.md_table(
        ["row", "call", "shape [B, T]", "ms", "TFLOP/s", "ran"],
        [[f"{h.style(c['row'])[0]} (`{c['row']}`)", c.get("about", ""), f"[{c.get('batch')}, {c.get('seq')}]",
          h.pair(c.get("ms"), h.fmt_ms), h.pair(c.get("tflops"), h.fmt_tf), _status_text(c)]
         for c in by.values()]))
    lines += ["", f"- ran: {', '.join(c['row'] for c in by.values() if c.get('ms')) or 'none'}"]
    lines += [f"- `{a}` ÷ `{b}` (rate over the same attended pairs): {h.pair(r, h.fmt_ratio)}"
              for a, b, r in compare(by, first.get("kind"))]
    lines += [f"- bar: {b['text']}: " + (", ".join(
        f"{p} {h.fmt_num(b['ratio'][p], '.2f')} {'✓' if b['ok'][p] else '✗'}" for p in PASSES
        if b["ratio"][p] is not None) or "not measured") + f" → **{b['verdict']}**"
        for b in bars if b["cell"] == cid]
    lines.append("")
  lines += h.failures(cells, lambda c: c["row"], lambda c: c["id"])
  lines += [f"- note: {n}" for n in data.get("notes", [])]
  return [h.write_md(lines, base)] + plot(data, cells, base)


def plot(data, cells, base):
  """Forward+backward TFLOP/s over attended pairs: a panel per kind of cell, a bar per row (the
  implementation's colour; hatched: the same work done another way), each panel with its legend."""
  plt, grouped = h.pyplot(), by_cell(cells)
  kinds = [k for k in KINDS if any(next(iter(by.values())).get("kind") == k for by in grouped.values())]
  if plt is None or not kinds:
    return []
  known = [c.id for c in build_cells("full")] + [c.id for c in build_cells("smoke")]
  panels = []
  for kind in kinds:
    ids = sorted((cid for cid, by in grouped.items() if next(iter(by.values())).get("kind") == kind),
                 key=lambda i: known.index(i) if i in known else len(known))
    rows = h.ordered(r for i in ids for r in grouped[i] if _value(grouped[i][r], "rate", "fwd+bwd"))
    panels.append((KIND_TITLES[kind], ids, [(r, [_value(grouped[i].get(r), "rate", "fwd+bwd") or 0.0
                                                 for i in ids]) for r in rows]))
  fig = h.bar_panels(plt, panels, ylabel="fwd+bwd TFLOP/s", shared_legend=False)
  return h.save(plt, fig, base, data, "Attention variants: forward+backward TFLOP/s over attended pairs "
                "(higher is better)")


def summary(data) -> str:
  cells, smoke = [c for c in data.get("cells", []) if "row" in c and "id" in c], h.is_smoke(data)
  caveat = f" ({h.SMOKE_CAVEAT})" if smoke else ""
  lines = [f"{STEM}: ms fwd / fwd+bwd, TFLOP/s over attended pairs fwd / fwd+bwd"
           + (f" ({h.SMOKE_CAVEAT}; the bars' verdicts mean nothing)" if smoke else "")]
  lines += [f"  {c['id']:<18} {c['row']:<12} " + (f"{h.pair(c.get('ms'), h.fmt_ms)} ms  "
                                                  f"{h.pair(c.get('tflops'), h.fmt_tf)} TF"
                                                  if c.get("ms") else str(c.get("status"))) for c in cells]
  lines += [f"  BAR {b['cell']:<18} {b['row']} vs {b['ref']} ({b['measure']} {b['op']} {b['threshold']:g}): "
            + " ".join(f"{p} {h.fmt_num(b['ratio'][p], '.2f')}" for p in PASSES) + f" -> {b['verdict']}"
            + caveat for b in evaluate(cells)]
  return "\n".join(lines)


def main(argv=None):
  return h.script_main(argv, build_parser(), run, render, summary, STEM, cell_key)


if __name__ == "__main__":
  main()
