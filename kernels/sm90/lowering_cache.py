"""Reuse of lowered Mosaic kernels across jitted programs (``fa2_jax.reuse_kernels_across_programs``,
``fa2_jax/kernel_reuse.py``, which turns it on by default with a per-user cache folder and also pads
lengths; this module alone starts off).

Every program that holds a Mosaic kernel lowers it again: JAX runs the Pallas Mosaic GPU lowering
(layout inference, dialect lowering, serialization) once per kernel per ``jax.jit`` program, even for
a kernel an earlier program lowered with the same shapes and settings. That costs about 0.5 s per
kernel, 1.5 s for a forward + backward on the H200's host (docs/design.md, "What a new shape costs").
jaxlib keeps one compiled kernel per kernel hash (the SHA-256 of the serialized module, source
locations included) for the process, but a kernel lowered inside another program gets other locations,
so another hash, and is compiled again (ptxas, about 1 s per kernel).

With the cache on, each kernel launch function (the forward, dK/dV and dQ calls, whose settings are
static) is exported once per settings and operand shapes with ``jax.export`` and called through
``Exported.call`` in every program after: the program embeds the lowered module instead of lowering it,
and the module (so the kernel hash) is the same, so XLA's compile finds the kernel compiled. The key
holds the launch function, its settings, the operands' shapes and dtypes and the mesh in context (an
export records its device count). Programs traced before the switch keep their own lowering.

``vmap`` runs :func:`ops.batch_rule` (the mapped axis folded into the batch, as the fused dK/dV/dQ call
does for ``pl.run_state``): that costs an export at the per-element shape too (``custom_vmap`` traces its
body unbatched), and unbatched operands are broadcast in HBM.

With a cache folder (``reuse_kernels_across_programs(cache_dir=...)``) each export is also written
there (``jax.export``'s serialized form), named by a hash of its key, the JAX, jaxlib and CUDA plugin
versions, the GPU's kind and SM count, the package's sources and the user, and a later process reads it
instead of lowering the kernel. Nothing is ever removed from the folder (each version of the code
adds its own files; a process killed while writing can leave a ``.tmp`` file). With the compiled
kernels written there too (below), a shape that an earlier process ran costs the tracing of the call,
the reading of its kernels and the XLA compile of the program around them. Settings that hold a user's
function (``mask_fn``, ``score_fn``) have no name that is stable across processes: they are exported
per process only.

On a GPU each new export also starts its compile at once in a background thread, as a program of
its own (:func:`start_compile`): XLA would compile a program's Mosaic kernels one after another at
its compile, after the whole step is traced; these threads compile each one while the rest of the
step is traced and lowered (the forward's while the backward is). They still compile one kernel at
a time (jaxlib holds its kernel cache's lock while compiling), and the program's compile then finds
them in that process-wide cache. The backward rule waits for them
(:func:`wait_for_compiles`; docs/measurements.md, "Background compiles"). Not with JAX's persistent
compilation cache on, which keeps a program only if its compile takes a second or more.

The background compile also writes the compiled kernel to the cache folder (the per-kernel program's
XLA executable, serialized by the GPU client, in a file beside the export named also by the export's
module, the GPU client's platform version and the compute capability), and a later process that reads
the export loads that file instead of compiling: loading an executable registers its Mosaic kernels in
jaxlib's process-wide kernel cache, so the step's compile finds them (docs/measurements.md, "Compiled
kernels on disk"). Not with the background compiles off (nothing is written) nor with JAX's
persistent cache on (nothing is loaded: the step's compile would be too quick for that cache to keep).

Reading either kind of file runs the code it holds (an export's kernel module is compiled to GPU and
host code; an executable holds both), so a file is read only when it is a regular file owned by the
user running the process and writable by nobody else; every file is written so, whatever the umask,
and its name holds the user's id, so that users sharing a folder keep their files apart. Any other,
damaged or unloadable file is a miss: lowered or compiled again and written anew.

Not used in GPU interpret mode (``emulate``), nor for operands with symbolic dimensions.
"""
from __future__ import annotations

import functools
import hashlib
import os
import stat
import tempfile
import threading
import warnings

import jax
from jax._src import config as jax_config  # export_ignore_forward_compatibility: no public context form

_STATE = {"enabled": False, "hits": 0, "misses": 0, "cache_dir": None, "reads": 0, "writes": 0,
          "warned": set(), "umask": 0o022, "background": True, "compiles": 0, "compile_errors": 0,
          "compiled_reads": 0, "compiled_writes": 0}
_SOURCES: list = []  # the package sources' hash, computed once (_sources_hash)
# The folders whose Python sources name a cache file (_sources_hash) and whose frames a warning skips
# (_internal_prefixes): the kernels' own, and those the caller adds (add_package_folder: the public
# package registers itself, so the kernels import nothing from it).
_KERNELS_FOLDER = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PACKAGE_FOLDERS: list = [_KERNELS_FOLDER]
_ENVIRONMENT: list = []  # versions and GPU, read once (_environment)
_EXPORTED: dict = {}
_LOADED: list = []  # the executables loaded from compiled files: their kernels stay registered
_LOCK = threading.Lock()
# Background compiles of new exports (start_compile): their futures until wait_for_compiles, and the
# pool that runs them (made on first use). XLA compiles the Mosaic kernels of one program one after
# another at its compile; compiled first in threads, each on its own, they are found in jaxlib's
# process-wide kernel cache (keyed by the module's hash, the same in every program that embeds the
# export) when the program compiles.
_PENDING = threading.local()  # .futures: the compiles this thread started (wait_for_compiles)
_POOL: list = []
# at most three kernels per attention call (forward, dK/dV, dQ) and a spare, fewer on a smaller host
COMPILE_THREADS = min(4, os.cpu_count() or 1)


def _forget_pool() -> None:  # a forked child has the pool's object but none of its threads
  _POOL.clear()
  _PENDING.__dict__.clear()


if hasattr(os, "register_at_fork"):
  os.register_at_fork(after_in_child=_forget_pool)


def add_package_folder(folder: str) -> None:
  """Count ``folder``'s sources in the cache files' names and skip its frames in warnings (the
  package that calls these kernels registers itself)."""
  folder = os.path.abspath(folder)
  if folder not in _PACKAGE_FOLDERS:
    _PACKAGE_FOLDERS.append(folder)
    _SOURCES.clear()


def set_enabled(enabled: bool) -> bool:
  """Turns the reuse on or off for what is traced after (``fa2_jax.reuse_kernels_across_programs``,
  which checks the argument); returns the previous setting."""
  previous = _STATE["enabled"]
  _STATE["enabled"] = bool(enabled)
  return previous


def set_cache_dir(path: str | None) -> str | None:
  """The folder exports are written to and read from across processes (None: this process only),
  kept as an absolute path; returns the previous one. The folder is made when the first export is
  written. Setting one hashes the package's sources now (:func:`_sources_hash`), so that code edited
  later in this process is not saved under the new code's name."""
  previous = _STATE["cache_dir"]
  if path is not None:
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    _sources_hash()
    # read here, once: os.umask can only be read by setting it, which no other thread should see
    umask = os.umask(0o022)
    os.umask(umask)
    _STATE["umask"] = umask
  _STATE["cache_dir"] = path
  return previous


def info() -> dict:
  """``{"enabled", "hits", "misses", "size", "cache_dir", "reads", "writes", "compiles",
  "compile_errors", "compiled_reads", "compiled_writes"}``: calls served by an exported kernel,
  exports made or read, kernels held; the cache folder, exports read from it and written to it;
  compiles started in the background (:func:`start_compile`) and those that failed; compiled kernels
  loaded from the folder and written to it."""
  with _LOCK:
    return {"enabled": _STATE["enabled"], "hits": _STATE["hits"], "misses": _STATE["misses"],
            "size": len(_EXPORTED), "cache_dir": _STATE["cache_dir"], "reads": _STATE["reads"],
            "writes": _STATE["writes"], "compiles": _STATE["compiles"],
            "compile_errors": _STATE["compile_errors"], "compiled_reads": _STATE["compiled_reads"],
            "compiled_writes": _STATE["compiled_writes"]}


def clear() -> None:
  """Drops every exported kernel held in memory and resets the counts (the cache folder's files
  stay; kernels already compiled stay in jaxlib's cache for the process)."""
  with _LOCK:
    _EXPORTED.clear()
    _STATE["hits"] = _STATE["misses"] = _STATE["reads"] = _STATE["writes"] = 0
    _STATE["compiles"] = _STATE["compile_errors"] = 0
    _STATE["compiled_reads"] = _STATE["compiled_writes"] = 0


def _static_dims(x) -> bool:
  return all(isinstance(d, int) for d in x.shape)


def kernel_call(static_argnames: tuple[str, ...]):
  """Decorator for a kernel launch function ``fn(*arrays, **settings)``: ``jax.jit`` with the
  settings static, or, with the cache on, the exported form of that jitted function."""
  def wrap(fn):
    jitted = jax.jit(fn, static_argnames=static_argnames)

    @functools.wraps(fn)
    def call(*operands, **static):
      if (not _STATE["enabled"] or static.get("emulate")
          or not all(_static_dims(x) for x in operands)):
        return jitted(*operands, **static)
      return _cached(fn, jitted, static, operands)

    call.jitted = jitted
    return call
  return wrap


def _export(jitted, static: dict, avals):
  export = functools.partial(
      jax.export.export, jax.jit(functools.partial(jitted, **static)), platforms=("cuda",),
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("mosaic_gpu_v2")])
  # The module is used by this version of jax/jaxlib only (in this process, or read from cache_dir
  # under a name that holds those versions): lower it as a plain jit would, at the current Mosaic IR
  # version (an export otherwise serializes the kernel for forward compatibility, an older version).
  # JAX has no public context form of this flag; without it, the export's default applies.
  ignore = getattr(jax_config, "export_ignore_forward_compatibility", None)
  if ignore is None:
    return export()(*avals)
  with ignore(True):
    return export()(*avals)


def _sources_hash() -> str:
  """SHA-256 of the package's Python sources (fa2_jax and its kernels), so that a cache folder's
  exports from another version of the code are never read."""
  if not _SOURCES:
    digest = hashlib.sha256()
    for top in sorted(set(_PACKAGE_FOLDERS)):
      for folder, dirs, files in os.walk(top):
        dirs.sort()
        for name in sorted(files):
          if name.endswith(".py"):
            path = os.path.join(folder, name)
            digest.update(os.path.relpath(path, top).encode())
            with open(path, "rb") as f:
              digest.update(f.read())
    _SOURCES.append(digest.hexdigest())
  return _SOURCES[0]


def _environment() -> tuple:
  """What a lowering depends on beyond its key: the JAX, jaxlib and CUDA plugin versions (an export
  is serialized at the current Mosaic IR version) and the GPU's kind and SM count (a persistent
  kernel's launch is sized by ``ops.sm_count`` while it is traced)."""
  if not _ENVIRONMENT:
    import importlib.metadata

    from .ops import sm_count
    versions = []
    for dist in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin"):
      try:
        versions.append((dist, importlib.metadata.version(dist)))
      except importlib.metadata.PackageNotFoundError:
        pass
    try:
      kind = jax.devices("gpu")[0].device_kind
    except (RuntimeError, IndexError):
      kind = None  # lowered without a GPU (for sm90 on a CPU)
    _ENVIRONMENT.append((tuple(versions), kind, sm_count()))
  return _ENVIRONMENT[0]


def _file_name(key, static: dict) -> str | None:
  """The cache file of an export's key, or None where the key has no text that is the same in every
  process: a variant with a user's ``mask_fn`` or ``score_fn`` (whose code the text does not hold),
  or any setting that prints with its address."""
  variant = static.get("variant")
  if variant is not None and (variant.mask_fn is not None or variant.score_fn is not None):
    return None
  # the user's id too: a folder several users share holds each one's files apart (_payload reads a
  # user's own files only)
  uid = os.getuid() if hasattr(os, "getuid") else None
  text = repr((_environment(), _sources_hash(), uid, key))
  if " at 0x" in text:
    return None
  return hashlib.sha256(text.encode()).hexdigest() + ".jax_exported"


# A cache file: this magic, the SHA-256 of the file's own name (its key's digest: 32 bytes), the
# SHA-256 of the payload (32 bytes), then the payload (jax.export's serialized form). The name's
# digest catches a file copied under another key's name (same operands, other settings: it would
# run); the payload's a damaged file that would still deserialize (the kernel's module is an opaque
# string inside the export, and its kernel hash would name the undamaged module).
_MAGIC = b"fa2_jax-export-2\n"


# A compiled-kernel file: the same layout under its own magic, the payload being the GPU client's
# serialized executable of the per-kernel program.
_COMPILED_MAGIC = b"fa2_jax-compiled-1\n"


def _header(path: str, payload: bytes, magic: bytes = _MAGIC) -> bytes:
  return (magic + hashlib.sha256(os.path.basename(path).encode()).digest()
          + hashlib.sha256(payload).digest())


def _payload(path: str, magic: bytes = _MAGIC) -> bytes | None:
  """The payload of the cache file ``path``, or None where there is none, it is not a regular file
  owned by this process's user and writable by nobody else (reading either kind of file runs the
  code it holds: an export's kernel module is compiled to GPU and host code), it was written under
  another name, or it is damaged (its header). The checks and the read use one open descriptor, so
  the file cannot be swapped between them."""
  try:
    # without blocking: a FIFO planted under a cache file's name would otherwise hang the open
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
  except OSError:
    return None
  with os.fdopen(fd, "rb") as f:
    st = os.fstat(f.fileno())
    owner = os.getuid() if hasattr(os, "getuid") else st.st_uid
    if not stat.S_ISREG(st.st_mode) or st.st_uid != owner or st.st_mode & 0o022:
      return None
    try:
      data = f.read()  # None where a non-blocking read would wait (some network file systems)
    except OSError:
      return None
  if data is None:
    return None
  head = len(magic) + 64
  if len(data) < head or data[:head] != _header(path, data[head:], magic):
    return None
  return data[head:]


def _read(path: str, avals):
  """The export in ``path``, or None where there is none, it was written under another name (a
  file copied under another key's name), it is damaged (digest), it does not deserialize, or it
  was made for other operands than ``avals``: then the kernel is lowered again and the file written
  anew."""
  payload = _payload(path)
  if payload is None:
    return None
  try:
    exp = jax.export.deserialize(bytearray(payload))
  except Exception:  # noqa: BLE001  a damaged file is a miss, not an error of the user's program
    return None
  if tuple(exp.in_avals) != tuple(jax.core.ShapedArray(a.shape, a.dtype) for a in avals):
    return None
  return exp


def _write(path: str, exp) -> bool:
  """Writes ``exp`` to ``path`` (:func:`_write_file`)."""
  return _write_file(path, bytes(exp.serialize()))


def _write_file(path: str, payload: bytes, magic: bytes = _MAGIC, warn: bool = True) -> bool:
  """Writes atomically (a reader sees the whole file or none; another process may write it too),
  readable by whoever the umask lets read new files and writable by this user alone, whatever the
  umask (:func:`_payload` reads no other file). A folder that cannot be written costs a warning
  (``warn``), once per folder and process, not the user's program: False."""
  folder = os.path.dirname(path)
  tmp = None
  try:
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
      f.write(_header(path, payload, magic) + payload)
    os.chmod(tmp, 0o644 & ~_STATE["umask"])
    os.replace(tmp, path)
    return True
  except OSError as e:
    if tmp is not None and os.path.exists(tmp):
      os.remove(tmp)
    with _LOCK:
      first = warn and folder not in _STATE["warned"]
      if first:
        _STATE["warned"].add(folder)
    if first:
      warnings.warn(f"fa2_jax: cannot write kernel lowerings to cache_dir {folder!r} ({e}); they "
                    "are kept for this process only", RuntimeWarning,
                    skip_file_prefixes=_internal_prefixes())
    return False


def _internal_prefixes() -> tuple[str, ...]:
  """Folders of the frames a warning skips, so that it points at the user's line: this package, its
  kernels and JAX (the kernels are lowered while JAX traces the user's program)."""
  return tuple(folder + os.sep for folder in (*_PACKAGE_FOLDERS, os.path.dirname(jax.__file__)))


def _exported(fn, jitted, static: dict, operands):
  avals = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in operands)
  mesh = jax.sharding.get_abstract_mesh()  # its axes and sizes: an export records the device count
  key = (fn.__module__, fn.__qualname__, tuple(sorted(static.items())), avals, mesh)
  with _LOCK:
    exp = _EXPORTED.get(key)
    _STATE["hits" if exp is not None else "misses"] += 1
    folder = _STATE["cache_dir"]
  if exp is not None:
    return exp
  # outside the lock: a concurrent miss may export (or read) it twice
  name = None if folder is None else _file_name(key, static)
  path = None if name is None else os.path.join(folder, name)
  exp = None if path is None else _read(path, avals)
  if exp is not None:
    with _LOCK:
      _STATE["reads"] += 1
  else:
    exp = _export(jitted, static, avals)
    if path is not None and _write(path, exp):
      with _LOCK:
        _STATE["writes"] += 1
  with _LOCK:
    kept = _EXPORTED.setdefault(key, exp)
  if kept is exp:
    # no compiled file with JAX's persistent cache on: the step's compile, its kernels loaded,
    # would take well under that cache's 1 s threshold and never be kept there (start_compile)
    compiled = (None if path is None or _jax_cache_on() or not _compilable_here(exp)
                else _compiled_path(path, exp))
    if compiled is None or not _load_compiled(compiled):
      start_compile(exp, compiled)
  return kept


def _compilable_here(exp) -> bool:
  """Whether this process compiles ``exp`` as a program of its own: one device, CUDA, on a GPU."""
  return exp.nr_devices == 1 and "cuda" in exp.platforms and _on_gpu()


def _compiled_path(path: str, exp) -> str:
  """The compiled-kernel file of the export file ``path`` (an export :func:`_compilable_here`):
  beside it, named by its name, the digest of the export's module (an export lowered anew with
  other bytes names another kernel), the GPU client's platform version and the GPU's compute
  capability."""
  device = jax.local_devices()[0]
  text = repr((os.path.basename(path), hashlib.sha256(exp.mlir_module_serialized).hexdigest(),
               device.client.platform_version, getattr(device, "compute_capability", None)))
  return os.path.join(os.path.dirname(path),
                      hashlib.sha256(text.encode()).hexdigest() + ".xla_compiled")


def _load_compiled(path: str) -> bool:
  """Loads the compiled kernel in ``path`` onto this process's first GPU (which registers it in
  jaxlib's kernel cache, where the program's compile finds it): False where there is no such file,
  :func:`_payload` refuses it, or the GPU client cannot load it (the kernel is then compiled in the
  background, :func:`start_compile`, which writes the file anew)."""
  payload = _payload(path, _COMPILED_MAGIC)
  if payload is None:
    return False
  try:
    from jax._src.lib import xla_client  # DeviceList, for deserialize_executable: no public form
    device = jax.local_devices()[0]
    loaded = device.client.deserialize_executable(
        payload, executable_devices=xla_client.DeviceList((device,)))
  except Exception:  # noqa: BLE001  a file this runtime cannot load is a miss, not an error
    return False
  with _LOCK:
    _LOADED.append(loaded)
    _STATE["compiled_reads"] += 1
  return True


def _jax_cache_on() -> bool:
  """Whether JAX's persistent compilation cache is on (a folder set and the cache enabled)."""
  return bool(jax.config.jax_compilation_cache_dir) and bool(jax.config.jax_enable_compilation_cache)


def _on_gpu() -> bool:
  """Whether this process can compile for an NVIDIA GPU. Not ``kernels.platform.on_gpu``: the tests
  and ``--lower-for-sm90`` make the dispatcher believe it runs on a GPU, where nothing can compile."""
  try:
    return jax.default_backend() in ("gpu", "cuda")
  except RuntimeError:  # no backend can start
    return False


def start_compile(exp, compiled_path: str | None = None) -> None:
  """Compiles ``exp`` (a kernel's export) for this process's GPU in a background thread, as a
  program of its own, so that the kernels of a training step compile at once, and while the rest
  of the step is traced, instead of one after another in its compile (:func:`wait_for_compiles`).
  Nothing happens off a GPU, for an export over several devices, with JAX's persistent compilation
  cache on (a program compiled in well under its 1 s threshold would not be kept there, and a later
  process would compile its kernels again, one after another), or with the background compiles
  turned off (:func:`set_background_compiles`). A failed compile is counted (``info()
  ["compile_errors"]``) and otherwise ignored here: the program's own compile meets the error again
  and reports it. Two compiles of one kernel (a program compiled before its background compile ends)
  are safe: jaxlib keeps the first result. ``compiled_path``: where to write the compiled kernel
  (:func:`_compiled_path`), or None."""
  if not _STATE["background"] or _jax_cache_on() or not _compilable_here(exp):
    return
  import concurrent.futures  # imported on use: only a GPU process compiles in the background
  with _LOCK:
    if not _POOL:
      _POOL.append(concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS,
                                                         thread_name_prefix="fa2_jax_compile"))
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in exp.in_avals]
    future = _POOL[0].submit(_compile, exp, avals, compiled_path)
    _STATE["compiles"] += 1
  if not hasattr(_PENDING, "futures"):
    _PENDING.futures = []
  _PENDING.futures.append(future)


def _compile(exp, avals, compiled_path: str | None) -> None:
  try:
    compiled = jax.jit(exp.call).lower(*avals).compile()
  except Exception:  # noqa: BLE001 - the program's compile reports it (start_compile)
    with _LOCK:
      _STATE["compile_errors"] += 1
    return
  if compiled_path is None:
    return
  # Nothing from here may reach wait_for_compiles (the user's trace): a client that cannot
  # serialize, or a folder that cannot be written (no warning from this thread), leaves the kernel
  # to be compiled again by a later process.
  try:
    executable = compiled.runtime_executable()
    payload = bytes(executable.client.serialize_executable(executable))
    written = _write_file(compiled_path, payload, _COMPILED_MAGIC, warn=False)
  except Exception:  # noqa: BLE001
    return
  if written:
    with _LOCK:
      _STATE["compiled_writes"] += 1


def wait_for_compiles() -> int:
  """Waits for the background compiles this thread started so far (:func:`start_compile`); returns
  how many. Called where a training step's last kernels have been traced (the backward rule), so
  that its compile finds every kernel compiled instead of compiling one a thread is still working
  on."""
  pending = getattr(_PENDING, "futures", [])
  _PENDING.futures = []
  for future in pending:
    future.result()
  return len(pending)


def set_background_compiles(enabled: bool) -> bool:
  """Turns the background compiles of new exports on (default) or off; returns the previous
  setting."""
  previous = _STATE["background"]
  _STATE["background"] = bool(enabled)
  return previous


def _cached(fn, jitted, static: dict, operands):
  @jax.custom_batching.custom_vmap
  def call(*ops):
    return _exported(fn, jitted, static, ops).call(*ops)

  @call.def_vmap
  def _vmap(axis_size, in_batched, *ops):
    from .ops import batch_rule  # imported on use: ops imports Mosaic GPU, this module does not
    launch = lambda *merged: _cached(fn, jitted, static, merged)  # noqa: E731
    return batch_rule(launch, axis_size, in_batched, ops, static.get("variant"))

  return call(*operands)
