"""Kernel reuse across jitted programs, and lengths padded so that new lengths reuse kernels.

``reuse_kernels_across_programs`` is the public switch. Its two halves live in two layers: the Mosaic
kernels' exported lowerings (``kernels/sm90/lowering_cache.py``), and the padding of T and S to a
length multiple, which ``flash_attention`` does before choosing the kernels (both backends).

On by default, with a per-user cache folder (:func:`default_cache_dir`: ``$FA2_JAX_CACHE_DIR``, else
``$XDG_CACHE_HOME/fa2_jax/kernels`` or ``~/.cache/fa2_jax/kernels``), as Triton keeps its compiled
kernels; ``FA2_JAX_CACHE_DIR=off`` turns the default off.
"""
from __future__ import annotations

import importlib.util
import os
import warnings

import numpy as np

from .kernels.sm90 import lowering_cache
from .validation import positive_int

lowering_cache.add_package_folder(os.path.dirname(os.path.abspath(__file__)))

_STATE = {"length_multiple": None}  # read at every traced call
# FA2_JAX_CACHE_DIR values that turn the default off, and those that ask for the default folder
_OFF = ("off", "0", "none", "false", "no", "")
_ON = ("on", "1", "true", "yes")
_DEFAULT = object()  # reuse_kernels_across_programs(cache_dir=...) not given: default_cache_dir()


def default_cache_dir() -> str | None:
  """The per-user folder of kernel lowerings: ``$FA2_JAX_CACHE_DIR`` when it names one, else
  ``$XDG_CACHE_HOME/fa2_jax/kernels`` (``~/.cache`` without XDG_CACHE_HOME; also where
  ``FA2_JAX_CACHE_DIR`` is ``on``, ``1``, ``true`` or ``yes``); None where ``FA2_JAX_CACHE_DIR`` is
  ``off`` (or ``0``, ``none``, ``false``, ``no``, empty), where it names a file (with a warning),
  or where ``jax.export``'s serialization cannot run (no ``flatbuffers`` package): then kernels are
  reused within the process only. The variable is read when fa2_jax is imported (the default's
  setting) and at each call of this function."""
  if not _default_enabled():
    return None
  value = os.environ.get("FA2_JAX_CACHE_DIR")
  if importlib.util.find_spec("flatbuffers") is None:
    return None
  if value and value.strip().lower() not in _ON:
    folder = os.path.expanduser(value)
    if os.path.exists(folder) and not os.path.isdir(folder):
      warnings.warn(f"fa2_jax: FA2_JAX_CACHE_DIR names the file {folder!r}, not a folder: kernel "
                    "lowerings are kept for this process only", RuntimeWarning, stacklevel=2)
      return None
    return folder
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
  return os.path.join(os.path.expanduser(base), "fa2_jax", "kernels")


def _default_enabled() -> bool:
  value = os.environ.get("FA2_JAX_CACHE_DIR")
  return value is None or value.strip().lower() not in _OFF


def reuse_kernels_across_programs(enabled: bool = True, *, length_multiple: int | None = None,
                                  cache_dir=_DEFAULT) -> bool:
  """Lower each Mosaic kernel (per settings and shapes) once per process and embed that lowering in
  every jitted program that launches it, so a second program with the same attention shapes (an
  evaluation step beside the training step, ``jit(f)`` beside ``jit(grad(f))``) neither lowers nor
  compiles those kernels again; with a cache folder, later processes read the lowerings too. On by
  default with :func:`default_cache_dir` (``FA2_JAX_CACHE_DIR=off`` in the environment: off by
  default). It applies to what is traced after the call: a jitted function traced before keeps its
  lowering (``jax.clear_caches()`` drops it). ``reuse_kernels_across_programs(False)`` turns it off.

  ``length_multiple``: with ``enabled``, the kernels of ``fa2_jax.flash_attention`` (Mosaic and
  Triton) see T and S padded up to a multiple of it, the true lengths passed as
  ``query_seq_lengths`` / ``key_value_seq_lengths`` (the padding is never attended and gets no
  gradient): calls whose lengths round up to the same multiples share kernels, so a new length
  costs no kernel lowering or compile. Results equal the unpadded call's up to rounding (the padded
  call may run other kernels: the fused dQ from a padded 6144 causal rows, say); the padding costs a
  copy of the inputs and the masked variant of the kernels (measured in
  ``benchmarks/results/h200/compile_reuse_kernels.md``). None (default): no padding.

  ``cache_dir``: with ``enabled``, a folder where each kernel's lowering is also written (a file per
  kernel, settings and shapes, named by their hash with the JAX version and this package's sources)
  and read back by later processes, which then do not lower that kernel; on a GPU its compiled form
  is written beside it by the background compile and loaded by later processes, which then do not
  compile it either (not with JAX's persistent compilation cache on, which then keeps the whole
  program): a shape that an earlier process ran costs the call's tracing, the reading of its kernels
  and XLA's compile of the program around them. Reading a file runs the code it holds: only files
  owned by the user and writable by nobody else are read (each user's files are named apart, so a
  folder can be shared; a file of another user is a miss). Kernels of a ``mask_fn`` or
  ``score_fn`` are not written (a function's code has
  no name that is stable across processes). Not given: :func:`default_cache_dir`; None: this
  process only; each call sets it anew. A folder that cannot be written gives a warning and the
  kernels stay in the process. Nothing is ever removed from the folder (delete it to reclaim the
  space: each version of fa2_jax and JAX writes files of its own).

  Returns the previous ``enabled`` (to restore the settings, read :func:`length_multiple` and
  ``info()["cache_dir"]`` first).
  """
  if not isinstance(enabled, (bool, np.bool_)):
    raise TypeError(f"enabled must be True or False, got {type(enabled).__name__}")
  enabled = bool(enabled)
  if cache_dir is _DEFAULT:
    cache_dir = default_cache_dir() if enabled else None
  if length_multiple is not None:  # an int, numpy's too
    length_multiple = positive_int("length_multiple", length_multiple, extra=" or None")
  if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
    raise TypeError(f"cache_dir must be None, a str or an os.PathLike, got {type(cache_dir).__name__}")
  if cache_dir is not None and not os.fspath(cache_dir):
    raise ValueError("cache_dir must name a folder, got ''")
  if cache_dir is not None:  # checked as it will be used: "~" expanded
    folder = os.path.expanduser(os.fspath(cache_dir))
    if os.path.exists(folder) and not os.path.isdir(folder):
      raise ValueError(f"cache_dir must be a folder, got the file {folder!r}")
  if cache_dir is not None and not enabled:
    raise ValueError("cache_dir needs enabled=True (the folder holds the reused kernels)")
  if length_multiple is not None and not enabled:
    raise ValueError("length_multiple needs enabled=True (the padded lengths reuse the kernels)")
  if enabled and cache_dir is not None:
    if importlib.util.find_spec("flatbuffers") is None:  # jax.export's serialization needs it
      raise ImportError("cache_dir needs the flatbuffers package for jax.export's serialization "
                        "(a dependency of fa2_jax): pip install flatbuffers")
  previous = lowering_cache.set_enabled(enabled)
  _STATE["length_multiple"] = length_multiple
  lowering_cache.set_cache_dir(cache_dir if enabled else None)
  return previous


if _default_enabled():  # the default: on, with the per-user folder (module docstring)
  lowering_cache.set_enabled(True)
  if (folder := default_cache_dir()) is not None:
    lowering_cache.set_cache_dir(folder)


def length_multiple() -> int | None:
  """The multiple ``flash_attention`` pads T and S to (:func:`reuse_kernels_across_programs`)."""
  return _STATE["length_multiple"]


def wait_for_compiles() -> int:
  """Waits for the kernels compiling in the background (each new export of a GPU process starts
  its compile at once, ``kernels/sm90/lowering_cache.py``); how many there were."""
  return lowering_cache.wait_for_compiles()


def info() -> dict:
  """``{"enabled", "length_multiple", "hits", "misses", "size", "cache_dir", "reads", "writes",
  "compiles", "compile_errors", "compiled_reads", "compiled_writes"}``: the switch, calls served by
  an exported kernel, exports made or read, kernels held; the cache folder, exports read from it and
  written to it; the exports compiled in background threads on a GPU, and those of them that failed;
  compiled kernels loaded from the folder and written to it."""
  return dict(lowering_cache.info(), length_multiple=length_multiple())
