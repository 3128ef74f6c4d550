"""Byte-level text data with no download: the Python standard library's own source files.

Tokens are raw bytes (vocabulary 256). The corpus is read in a fixed (sorted) order and split
deterministically: the first 90% of the bytes train, the last 10% validate. Batches are random
windows; batch ``i`` depends only on ``(seed, i)``, so a resumed run sees exactly the batches an
uninterrupted one would.
"""
from __future__ import annotations

import pathlib
import sysconfig

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


def _read_capped(files, max_bytes: int) -> bytes:
  """Concatenates files (each followed by a newline) until ``max_bytes``; skips binary files."""
  chunks, total = [], 0
  for path in files:
    data = path.read_bytes()
    if b"\0" in data:  # not text
      continue
    data = data[:max_bytes - total] + b"\n"
    chunks.append(data)
    total += len(data)
    if total >= max_bytes:
      break
  return b"".join(chunks)[:max_bytes]


def stdlib_source_bytes(max_bytes: int) -> bytes:
  """Up to ``max_bytes`` of the standard library's ``*.py`` files, sorted by relative path."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  return _read_capped(_sorted_files(root, "*.py"), max_bytes)


def text_bytes(path: str | pathlib.Path, max_bytes: int) -> bytes:
  """Up to ``max_bytes`` of a text file, or of every (non-binary) file under a folder, sorted."""
  path = pathlib.Path(path)
  if path.is_file():
    return path.read_bytes()[:max_bytes]
  if path.is_dir():
    return _read_capped(_sorted_files(path, "*"), max_bytes)
  raise FileNotFoundError(f"--data {str(path)!r} is neither a file nor a folder")


def load_splits(path: str | None, max_bytes: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """The (train, val) byte arrays of ``path`` (default: the stdlib sources).

  Raises:
    FileNotFoundError: ``path`` is neither a file nor a folder.
    DataError: either split is shorter than one training window of ``seq_len + 1`` bytes.
  """
  raw = stdlib_source_bytes(max_bytes) if path is None else text_bytes(path, max_bytes)
  tokens = np.frombuffer(raw, dtype=np.uint8)
  n_val = int(len(tokens) * VAL_FRACTION)
  train, val = tokens[:len(tokens) - n_val], tokens[len(tokens) - n_val:]
  if min(len(train), len(val)) < seq_len + 1:
    raise DataError(f"the data ({len(tokens)} bytes) are too short for seq_len={seq_len}: each "
                    f"split needs at least {seq_len + 1} bytes")
  return train, val


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


def opening_line(tokens: np.ndarray, max_bytes: int = PROMPT_MAX_BYTES) -> str:
  """The first non-blank line of ``tokens`` (with its newline), cut to ``max_bytes`` bytes: a prompt
  in the style of the data. A character cut in half by the limit is dropped."""
  head = bytes(np.asarray(tokens[:64 * max_bytes], np.uint8))  # room for blank lines before the text
  for line in head.splitlines(keepends=True):
    if line.strip():
      return line[:max_bytes].decode("utf-8", "ignore")
  return head[:max_bytes].decode("utf-8", "ignore")


def decode(ids) -> str:
  """Bytes to text; ids outside a byte (GPT-2-sized vocabularies) and bad UTF-8 are replaced."""
  return bytes(int(i) if 0 <= int(i) < 256 else ord("?") for i in ids).decode("utf-8", "replace")


def encode(text: str) -> np.ndarray:
  """Text to byte ids (int32)."""
  return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)
