"""How evenly deals of a causal forward's query tiles to persistent CTAs spread the work (CPU only).

    python -m benchmarks.diag.deal_balance [--docs "4096*8;6984,5254,4236,2283,2591,431,708,233,1518,6681,1849"]
        [--random 4] [--heads 16] [--ctas 132] [--out DIR]

A causal call with packed documents (``q_segment_ids``), lengths or an offset has per-tile work
(key tiles) known only on the device, so a persistent forward would need its deal computed there.
For each packing of documents into one sequence (``--docs``: document lengths, ``L*n`` for ``n``
documents of ``L``; ``--random N`` adds N packings of 12 documents of 100-8191 tokens), this computes
each query tile's key tiles (128 x 128 tiles, the Mosaic forward's at head_dim 128), orders the tiles
as the kernel launches them (longest first within L2 sections of heads, ``schedule.lpt_position``,
section from ``schedule.section_heads``) and prints the busiest CTA's work over the mean for:

- ``hardware``: one CTA per tile, each next tile to the first free SM (``schedule.greedy_deal`` on
  the true work: what the GPU's scheduler does);
- ``cyclic``: position ``p`` to CTA ``p mod ctas`` (``MosaicConfig.persistent_deal="cyclic"``);
- ``dense_work``: ``schedule.greedy_deal`` by the dense causal work, known at trace time;
- ``work_quanta``: the order cut into quanta of 2x the mean tile's work, dealt cyclically;
- ``section_snake``: each section sorted longest first, dealt in a snake (forward, then reverse);
- ``global_snake``: all tiles sorted longest first, dealt in a snake (ignores the L2 sections).

The last four can be computed on the device with sorts and prefix sums (no sequential loop); the
first is the baseline the one-CTA-per-tile launch gets. docs/design.md, "Attention variants".
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from ..cli import nonnegative_int, positive_int
from ..report import write_json

ROWS = BLOCK_K = 128  # the Mosaic forward's query rows per CTA tile and key tile at head_dim 128


def tile_work(docs: list[int]) -> np.ndarray:
  """Key tiles each 128-row query tile of the packed sequence visits (causal, within its document;
  a tile spanning a document boundary visits from its first row's document start)."""
  total = sum(docs)
  starts = np.cumsum([0] + docs[:-1])
  n_tiles = -(-total // ROWS)
  first = np.arange(n_tiles) * ROWS
  last = np.minimum(first + ROWS, total) - 1
  doc_start = starts[np.searchsorted(starts, first, side="right") - 1]
  return last // BLOCK_K - doc_start // BLOCK_K + 1


def loads(owner: np.ndarray, work: np.ndarray, ctas: int) -> np.ndarray:
  return np.bincount(owner, weights=work, minlength=ctas)


def table_owner(table: np.ndarray, n: int) -> np.ndarray:
  owner = np.empty(n, np.int64)
  for c, row in enumerate(table):
    owner[row[1:1 + row[0]]] = c
  return owner


def snake(order: np.ndarray, ctas: int) -> np.ndarray:
  """CTA of each position when ``order`` (positions) is dealt in a snake."""
  owner = np.empty(len(order), np.int64)
  k = np.arange(len(order))
  r, c = k // ctas, k % ctas
  owner[order] = np.where(r % 2 == 0, c, ctas - 1 - c)
  return owner


def deals(docs: list[int], heads: int, ctas: int) -> dict[str, float]:
  from fa2_jax.kernels.sm90.schedule import greedy_deal, lpt_position, section_heads

  per_tile = tile_work(docs)
  n_t = len(per_tile)
  kv_bytes = 2 * sum(docs) * 128 * 2  # one head's K and V, bf16, head_dim 128
  section = section_heads(kv_bytes, heads)
  pos = np.arange(heads * n_t, dtype=np.int32)
  qt = np.asarray(lpt_position(pos, n_h=heads, n_t=n_t, n_bh=heads, section=section,
                               longest_last=True)[2])
  work = per_tile[qt].astype(np.float64)  # per launch position
  n = len(work)
  mean = work.sum() / ctas
  group = section * n_t  # positions per L2 section
  quantum = 2 * work.mean()
  mid = np.cumsum(work) - work / 2
  by_section = np.lexsort((pos, -work, pos // group))
  owners = {
      "hardware": table_owner(greedy_deal(work, ctas), n),
      "cyclic": pos % ctas,
      "dense_work": table_owner(greedy_deal(qt + 1, ctas), n),
      "work_quanta": (mid // quantum).astype(np.int64) % ctas,
      "section_snake": snake(by_section, ctas),
      "global_snake": snake(np.lexsort((pos, -work)), ctas),
  }
  out = {name: float(loads(o, work, ctas).max() / mean) for name, o in owners.items()}
  out["section_heads"] = section
  return out


def parse_docs(text: str) -> list[list[int]]:
  """'4096*8;100,200' -> [[4096] * 8, [100, 200]]; ValueError for anything but lengths >= 1 and
  counts >= 1."""
  out = []
  for packing in text.split(";"):
    docs = []
    for part in packing.split(","):
      length, _, count = part.partition("*")
      try:
        length, count = int(length), int(count or 1)
      except ValueError:
        raise ValueError(f"{part!r} is not LENGTH or LENGTH*COUNT") from None
      if length < 1 or count < 1:
        raise ValueError(f"{part!r}: lengths and counts must be at least 1")
      docs += [length] * count
    out.append(docs)
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--docs", default="4096*8;6984,5254,4236,2283,2591,431,708,233,1518,6681,1849")
  p.add_argument("--random", type=nonnegative_int, default=4, help="random packings of 12 documents")
  p.add_argument("--seed", type=int, default=1)
  p.add_argument("--heads", type=positive_int, default=16)
  p.add_argument("--ctas", type=positive_int, default=132,
                 help="persistent CTAs (the H100/H200 SM count)")
  p.add_argument("--out", default=None, help="folder for deal_balance.json")
  argv = sys.argv[1:] if argv is None else list(argv)
  args = p.parse_args(argv)
  rng = np.random.default_rng(args.seed)
  try:
    packings = parse_docs(args.docs)
  except ValueError as e:
    p.error(f"--docs: {e}")
  packings += [[int(x) for x in rng.integers(100, 8192, 12)] for _ in range(args.random)]
  rows = []
  for docs in packings:
    r = deals(docs, args.heads, args.ctas)
    rows.append(dict(docs=docs, **r))
  names = ["hardware", "cyclic", "dense_work", "work_quanta", "section_snake", "global_snake"]
  print("busiest CTA's work / mean, per deal (1.00: balanced)")
  print(f"{'packing':34s} " + " ".join(f"{n:>13s}" for n in names))
  for r in rows:
    label = f"{len(r['docs'])} docs, {sum(r['docs'])} tokens"
    print(f"{label:34s} " + " ".join(f"{r[n]:13.3f}" for n in names))
  if args.out:
    write_json(f"{args.out}/deal_balance.json", dict(
        heads=args.heads, ctas=args.ctas, seed=args.seed, rows=rows,
        command=" ".join(["python -m benchmarks.diag.deal_balance", *argv])))
  return rows


if __name__ == "__main__":
  main()
