"""The cells of ``benchmarks.variants`` (described in its docstring): sizes, attended (query, key) pair
counts, the rows each cell measures, and the bars and comparisons its results are judged by."""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

import numpy as np

from .report import seq_label

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

  name: str  # unique in its cell: fa2, fa2_dense, fa3, cudnn_batch, ...
  impl: str  # the benchmarks/impls.py entry whose availability and shape limits apply
  label: str
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


def _window_cell(seq, w, n, h):
  win = dict(local_window_size=(w, 0))
  pw = causal_pairs(seq, w)
  ref = dict(is_causal=True, **win)
  rows = [
      Row("fa2", "fa2", "fa2_jax", f"flash_attention(is_causal=True, local_window_size=({w}, 0))",
          layout="seq", causal=True, kw=win, pairs=pw, ref=ref),
      Row("fa2_dense", "fa2", "fa2_jax dense causal", "flash_attention(is_causal=True)",
          layout="seq", causal=True, kw={}, pairs=causal_pairs(seq), ref=dict(is_causal=True)),
      Row("fa3", "fa3", "FlashAttention-3", f"flash_mha(is_causal=True, window_size=({w}, 0))",
          layout="seq", causal=True, kw=dict(window_size=(w, 0)), pairs=pw, ref=ref),
      Row("cudnn", "cudnn", "cuDNN", 'jax.nn.dot_product_attention(implementation="cudnn", '
          f"is_causal=True, local_window_size=({w}, 0))",
          layout="seq", causal=True, kw=win, pairs=pw, ref=ref),
  ]
  return Cell(f"window-{seq_label(seq)}", "window", f"window ({w}, 0) causal, {seq_label(seq)} (B=1)",
              n, h, layouts={"seq": (1, seq)}, rows=rows)


def _packed_cell(lens, n, h, ragged):
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
      Row("fa2", "fa2", "fa2_jax packed", "flash_attention(is_causal=True, q_segment_ids = "
          "kv_segment_ids = document ids) on [1, total]",
          layout="packed", causal=True, kw=packed, pairs=pairs, ref=dict(is_causal=True, **packed)),
      Row("fa2_batch", "fa2", "fa2_jax batch", f"flash_attention(is_causal=True) on {on_batch}",
          layout="batch", causal=True, kw=batch, pairs=pairs, ref=dict(is_causal=True, **batch)),
      Row("fa3_varlen", "fa3", "FlashAttention-3 varlen", "flash_mha_varlen(cu_seqlens, max_seqlen = "
          "longest document, is_causal=True) on [total]",
          layout="packed", causal=True, kw=dict(cu_seqlens=Arr("cu"), max_seqlen=max(lens)),
          pairs=pairs, ref=dict(is_causal=True, **packed), call=_fa3_varlen),
      Row("cudnn_batch", "cudnn", "cuDNN batch",
          f'jax.nn.dot_product_attention(implementation="cudnn", is_causal=True) on {on_batch}',
          layout="batch", causal=True, kw=batch, pairs=pairs, ref=dict(is_causal=True, **batch)),
  ]
  return Cell(cid, "packed", f"packed: {seq_label(total)} tokens, {what}, causal", n, h,
              layouts={"packed": (1, total), "batch": (docs, width)}, rows=rows,
              arrays=dict(seg=seg, cu=cu, lens=np.asarray(lens, np.int32)),
              info=dict(doc_lengths=lens, padded_width=width if ragged else None))


def _softcap_cell(seq, b, n, h, causal):
  cap = dict(logits_soft_cap=SOFT_CAP)
  p = b * dense_pairs(seq, causal)
  flag = "is_causal=True, " if causal else ""  # the call text names what the row passes
  rows = [
      Row("fa2", "fa2", "fa2_jax", f"flash_attention({flag}logits_soft_cap={SOFT_CAP:g})",
          layout="seq", causal=causal, kw=cap, pairs=p, ref=dict(is_causal=causal, **cap)),
      Row("fa2_nocap", "fa2", "fa2_jax without the cap", f"flash_attention({flag.rstrip(', ')})",
          layout="seq", causal=causal, kw={}, pairs=p, ref=dict(is_causal=causal)),
      Row("tokamax", "tokamax", "tokamax mosaic", 'tokamax.dot_product_attention(implementation='
          f'"mosaic", {flag}logits_soft_cap={SOFT_CAP:g})',
          layout="seq", causal=causal, kw=cap, pairs=p, ref=dict(is_causal=causal, **cap)),
  ]
  mode = "causal" if causal else "non-causal"
  return Cell(f"softcap-{seq_label(seq)}-{'c' if causal else 'nc'}", "softcap",
              f"soft cap {SOFT_CAP:g}, {seq_label(seq)} {mode} (B={b})", n, h,
              layouts={"seq": (b, seq)}, rows=rows)


def _padding_cell(seq, fill, b, n, h, causal):
  lens = dict(query_seq_lengths=Arr("lens"), key_value_seq_lengths=Arr("lens"))
  p_fill = b * dense_pairs(fill, causal)
  rows = [
      Row("fa2", "fa2", "fa2_jax",
          f"flash_attention(query_seq_lengths = key_value_seq_lengths = {fill})",
          layout="seq", causal=causal, kw=lens, pairs=p_fill, ref=dict(is_causal=causal, **lens)),
      Row("fa2_full", "fa2", "fa2_jax unpadded", f"flash_attention() on all {seq_label(seq)}",
          layout="seq", causal=causal, kw={}, pairs=b * dense_pairs(seq, causal),
          ref=dict(is_causal=causal)),
      Row("cudnn", "cudnn", "cuDNN", 'jax.nn.dot_product_attention(implementation="cudnn", '
          f"query_seq_lengths = key_value_seq_lengths = {fill})",
          layout="seq", causal=causal, kw=lens, pairs=p_fill, ref=dict(is_causal=causal, **lens)),
  ]
  mode = "causal" if causal else "non-causal"
  return Cell(f"padding-{seq_label(seq)}-{'c' if causal else 'nc'}", "padding",
              f"padding: {seq_label(fill)} of {seq_label(seq)} filled, {mode} (B={b})", n, h,
              layouts={"seq": (b, seq)}, rows=rows, arrays=dict(lens=np.full((b,), fill, np.int32)))


def _causal_mask(b, h, q_idx, kv_idx):
  del b, h
  return kv_idx <= q_idx


def _window_mask(left: int):
  def mask(b, h, q_idx, kv_idx):
    del b, h
    return (kv_idx <= q_idx) & (kv_idx >= q_idx - left)
  return mask


def _maskfn_cell(seq, n, h, left=None):
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
      Row("fa2_mask_fn", "fa2", "fa2_jax mask_fn", f"flash_attention(mask_fn: {text})",
          layout="seq", causal=False, kw=dict(mask_fn=mask), pairs=pairs, ref=ref),
      Row("fa2", "fa2", "fa2_jax built-in", call,
          layout="seq", causal=True, kw=builtin, pairs=pairs, ref=ref),
  ]
  return Cell(f"maskfn-{name}-{seq_label(seq)}", "maskfn", f"mask_fn = {title}, {seq_label(seq)} (B=1)",
              n, h, layouts={"seq": (1, seq)}, rows=rows)


def build_cells(size: str = "full") -> list[Cell]:
  s = SIZES[size]
  n, h, w = s["heads"], s["head_dim"], s["window"]
  return ([_window_cell(t, w, n, h) for t in s["window_seqs"]]
          + [_packed_cell([s["tokens"] // s["docs"]] * s["docs"], n, h, ragged=False),
             _packed_cell(ragged_lengths(s["tokens"], *s["ragged"]), n, h, ragged=True)]
          + [_softcap_cell(s["cap_seq"], s["batch"], n, h, c) for c in (True, False)]
          + [_padding_cell(s["pad_seq"], s["pad_fill"], s["batch"], n, h, c) for c in (False, True)]
          + [_maskfn_cell(s["mask_seq"], n, h), _maskfn_cell(s["mask_seq"], n, h, w)])


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
