"""Byte-level text data with no download: the Python standard library's own source files.

Tokens are raw bytes (vocabulary 256). The corpus is read in a fixed (sorted) order and split
deterministically: the first 90% of the bytes train, the last 10% validate. Batches are random
windows; batch ``i`` depends only on ``(seed, i)``, so a resumed run sees exactly the batches an
uninterrupted one would.

Packing (``--packing``): each file of the corpus is a document (a single ``--data`` file is one
document). The documents are concatenated as always, so a window holds the end of one, whole short
ones and the start of another; :func:`get_packed_batch` adds per-token segment ids (the document's
index), so attention never crosses documents, and positions that restart at 0 where each document
starts in the window (a document cut by the window's start begins at 0, as every unpacked window
does). The targets that cross into the next document are left out of the loss (weight 0): each
token is then trained on exactly as it would be in a sequence of its document alone.
"""
from __future__ import annotations

import pathlib
import sysconfig
import unicodedata
from typing import NamedTuple

import numpy as np

VAL_FRACTION = 0.1
PROMPT_MAX_BYTES = 80  # a sample's prompt taken from the data: at most one line of this many bytes
# Third-party packages live under the stdlib folder on some installs; they differ between machines.
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


class DataError(ValueError):
  """The text cannot train the model (too short for one window of each split)."""


def _sorted_files(root: pathlib.Path, pattern: str) -> list[pathlib.Path]:
  """Files under ``root`` matching ``pattern``, in a machine-independent order, skipping _SKIP_DIRS."""
  files = [p for p in root.rglob(pattern)
           if p.is_file() and not _SKIP_DIRS.intersection(p.relative_to(root).parts)
           and not any(part.startswith(".") for part in p.relative_to(root).parts)]
  return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _read_documents(files, max_bytes: int) -> list[bytes]:
  """The files' texts (each followed by a newline), until ``max_bytes`` in all; skips binary files."""
  chunks, total = [], 0
  for path in files:
    data = path.read_bytes()
    if b"\0" in data:  # not text
      continue
    data = (data[:max_bytes - total] + b"\n")[:max_bytes - total]
    chunks.append(data)
    total += len(data)
    if total >= max_bytes:
      break
  return chunks


def _read_capped(files, max_bytes: int) -> bytes:
  """Concatenates files (each followed by a newline) until ``max_bytes``; skips binary files."""
  return b"".join(_read_documents(files, max_bytes))


def stdlib_source_bytes(max_bytes: int) -> bytes:
  """Up to ``max_bytes`` of the standard library's ``*.py`` files, sorted by relative path."""
  return b"".join(stdlib_source_documents(max_bytes))


def stdlib_source_documents(max_bytes: int) -> list[bytes]:
  """:func:`stdlib_source_bytes` as one text per file."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  return _read_documents(_sorted_files(root, "*.py"), max_bytes)


def text_documents(path: str | pathlib.Path, max_bytes: int) -> list[bytes]:
  """Up to ``max_bytes`` of a text file (one document), or of every (non-binary) file under a folder,
  sorted (one document per file)."""
  path = pathlib.Path(path)
  if path.is_file():
    return [path.read_bytes()[:max_bytes]]
  if path.is_dir():
    return _read_documents(_sorted_files(path, "*"), max_bytes)
  raise FileNotFoundError(f"--data {str(path)!r} is neither a file nor a folder")


def text_bytes(path: str | pathlib.Path, max_bytes: int) -> bytes:
  """Up to ``max_bytes`` of a text file, or of every (non-binary) file under a folder, sorted."""
  return b"".join(text_documents(path, max_bytes))


class Split(NamedTuple):
  """One split of a corpus of documents: its bytes and where each document starts in them."""

  tokens: np.ndarray  # [n] uint8
  doc_starts: np.ndarray  # [documents] int64, increasing, doc_starts[0] == 0


def load_documents(path: str | None, max_bytes: int, seq_len: int) -> tuple[Split, Split]:
  """The (train, val) splits of ``path`` (default: the stdlib sources) with their documents' starts
  (one document per file; a document cut by the 90/10 split continues in val as a document).

  Raises:
    FileNotFoundError: ``path`` is neither a file nor a folder.
    DataError: either split is shorter than one training window of ``seq_len + 1`` bytes.
  """
  docs = stdlib_source_documents(max_bytes) if path is None else text_documents(path, max_bytes)
  tokens = np.frombuffer(b"".join(docs), dtype=np.uint8)
  starts = np.cumsum([0] + [len(d) for d in docs[:-1]], dtype=np.int64)  # [documents]
  n_val = int(len(tokens) * VAL_FRACTION)
  cut = len(tokens) - n_val
  if min(cut, n_val) < seq_len + 1:
    raise DataError(f"the data ({len(tokens)} bytes) are too short for seq_len={seq_len}: each "
                    f"split needs at least {seq_len + 1} bytes")
  train = Split(tokens[:cut], starts[starts < cut])
  val_starts = starts[starts >= cut] - cut
  val = Split(tokens[cut:], np.concatenate([[0], val_starts[val_starts > 0]]).astype(np.int64))
  return train, val


def load_splits(path: str | None, max_bytes: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """The (train, val) byte arrays of ``path`` (default: the stdlib sources).

  Raises:
    FileNotFoundError: ``path`` is neither a file nor a folder.
    DataError: either split is shorter than one training window of ``seq_len + 1`` bytes.
  """
  train, val = load_documents(path, max_bytes, seq_len)
  return train.tokens, val.tokens


def get_batch(tokens: np.ndarray, step: int, *, batch_size: int, seq_len: int,
              seed: int) -> tuple[np.ndarray, np.ndarray]:
  """Batch number ``step``: ``batch_size`` random windows as int32 inputs and next-byte targets.

  The windows depend only on ``(seed, step)`` (a fresh numpy Generator per batch), so training can
  resume at any step and every device count sees the same global batch.
  """
  rng = np.random.default_rng([seed, step])
  starts = rng.integers(0, len(tokens) - seq_len, size=batch_size)
  windows = np.stack([tokens[s:s + seq_len + 1] for s in starts]).astype(np.int32)
  return windows[:, :-1], windows[:, 1:]


class PackedBatch(NamedTuple):
  """A batch of windows over concatenated documents, ``[batch_size, seq_len]`` int32 each."""

  tokens: np.ndarray  # the inputs
  targets: np.ndarray  # the next bytes
  segment_ids: np.ndarray  # each input's document (its index in the split)
  positions: np.ndarray  # each input's position in its document's part of the window (from 0)
  weights: np.ndarray  # 1 where the target is in the input's document, else 0 (left out of the loss)


def get_packed_batch(split: Split, step: int, *, batch_size: int, seq_len: int,
                     seed: int) -> PackedBatch:
  """Batch number ``step`` of :func:`get_batch` (the same windows) with the documents marked: the
  segment ids, positions restarting at 0 where a document starts, and loss weights that leave out
  the targets in the next document."""
  tokens, targets = get_batch(split.tokens, step, batch_size=batch_size, seq_len=seq_len, seed=seed)
  rng = np.random.default_rng([seed, step])  # get_batch's windows: the same draws
  starts = rng.integers(0, len(split.tokens) - seq_len, size=batch_size)  # [batch_size]
  index = starts[:, None] + np.arange(seq_len + 1)  # [batch_size, seq_len + 1]: the window's bytes
  doc = np.searchsorted(split.doc_starts, index, side="right") - 1  # their documents
  # Where each byte's document starts in the window (0 for one that started before it).
  first = np.maximum(split.doc_starts[doc] - starts[:, None], 0)
  positions = np.arange(seq_len + 1) - first
  return PackedBatch(tokens, targets, doc[:, :-1].astype(np.int32),
                     positions[:, :-1].astype(np.int32),
                     (doc[:, :-1] == doc[:, 1:]).astype(np.int32))


def opening_line(tokens: np.ndarray, max_bytes: int = PROMPT_MAX_BYTES) -> str:
  """The first non-blank line of ``tokens`` (with its newline), cut to ``max_bytes`` bytes: a prompt
  in the style of the data. A character cut in half by the limit is dropped."""
  head = bytes(np.asarray(tokens[:64 * max_bytes], np.uint8))  # room for blank lines before the text
  for line in head.splitlines(keepends=True):
    if line.strip():
      return line[:max_bytes].decode("utf-8", "ignore")
  return head[:max_bytes].decode("utf-8", "ignore")


# Characters written as escapes by decode: control and format characters (newline and tab kept),
# line and paragraph separators, surrogates, private-use and unassigned code points.
_UNPRINTABLE = ("Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn")


def _printable(ch: str) -> str:
  if ch in "\n\t" or unicodedata.category(ch) not in _UNPRINTABLE:
    return ch
  return ascii(ch)[1:-1]  # \r, \x1b, \u202e, ...


def decode(ids) -> str:
  """Bytes to printable text: UTF-8 where it is valid; each byte that is not valid UTF-8 as a
  ``\\xNN`` escape (no U+FFFD replacement characters), control and other invisible characters
  (newline and tab kept) as Python escapes (``\\r``, ``\\x1b``, ``\\u202e``); ids outside a
  byte (GPT-2-sized vocabularies) as ``?``."""
  raw = bytes(int(i) if 0 <= int(i) < 256 else ord("?") for i in ids)
  text = raw.decode("utf-8", "backslashreplace")
  return "".join(map(_printable, text))


def encode(text: str) -> np.ndarray:
  """Text to byte ids (int32). Bytes that are not UTF-8 and reached Python as lone surrogates (a
  command-line argument, decoded with ``surrogateescape``) are their original bytes again."""
  return np.frombuffer(text.encode("utf-8", "surrogateescape"), dtype=np.uint8).astype(np.int32)
