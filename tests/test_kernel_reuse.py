"""``fa2_jax.reuse_kernels_across_programs``: Mosaic kernels lowered once per process and embedded in
every program that launches them (``kernels/sm90/lowering_cache.py``), and lengths padded to a
multiple so that new lengths share kernels.

On CPU: the kernel hashes and export counts of programs lowered for sm90 (``lowering_platforms=
("cuda",)``), the ``vmap`` fold, and the padded lengths' results on the Triton kernels in interpret mode
against the unpadded call. Compiled on a GPU: ``tests/test_mosaic_gpu.py -k kernel_reuse``.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fa2_jax.kernels import platform
import fa2_jax
from fa2_jax import kernel_reuse
from fa2_jax.kernels.sm90 import lowering_cache
from fa2_jax.kernels.sm90.backward import backward
from fa2_jax.kernels.sm90.config import MosaicConfig
from fa2_jax.kernels.sm90.forward import forward
from fa2_jax.kernels.softmax import lse_from_stats

BF16 = jnp.bfloat16


def _kernel_hashes(fn, *avals):
  text = jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()
  return set(re.findall(r'kernel_hash = "((?:[^"\\]|\\.)*)"', text))


@pytest.fixture
def reuse():
  """Returns a function that turns the switch on (with its keywords) and empties the cache; the
  previous state is restored afterwards."""
  info = lowering_cache.info()
  previous = (info["enabled"], kernel_reuse.length_multiple(), info["cache_dir"])

  def on(**kwargs):
    kwargs.setdefault("cache_dir", None)  # this process only, unless the test names a folder
    fa2_jax.reuse_kernels_across_programs(True, **kwargs)
    lowering_cache.clear()
    return lowering_cache

  yield on
  fa2_jax.reuse_kernels_across_programs(previous[0], length_multiple=previous[1],
                                        cache_dir=previous[2] if previous[0] else None)
  lowering_cache.clear()


@pytest.fixture
def fake_hopper(monkeypatch):
  monkeypatch.setattr(platform, "on_gpu", lambda: True)
  monkeypatch.setattr(platform, "gpu_compute_capability", lambda: (9, 0))


def _train(scale, causal, cfg):
  def f(q, k, v, do):
    out, stats = forward(q, k, v, scale=scale, is_causal=causal, config=cfg)
    dq, dk, dv = backward(q, k, v, out, stats, do, scale=scale, is_causal=causal, config=cfg,
                          deterministic=False)
    return out, lse_from_stats(stats, scale, False), dq, dk, dv
  return f


def test_a_second_program_embeds_the_first_ones_kernels(reuse):
  """A second program with the same attention shapes embeds the first program's lowered kernels: the
  same kernel hashes (so jaxlib finds them compiled) and no new export. A new shape exports its own."""
  cache = reuse()
  sd = jax.ShapeDtypeStruct((1, 512, 2, 128), BF16)
  cfg = MosaicConfig.default(128, BF16, True).replace(dq_fused=True, dq_fused_min_t=0)
  train = _train(128 ** -0.5, True, cfg)

  def evaluate(q, k, v, do):  # another program: the forward alone, its output used otherwise
    return forward(q, k, v, scale=128 ** -0.5, is_causal=True, config=cfg)[0] * 2

  first = _kernel_hashes(train, sd, sd, sd, sd)
  assert len(first) == 2 and cache.info()["misses"] == 2  # the forward, the fused dK/dV/dQ kernel
  assert _kernel_hashes(evaluate, sd, sd, sd, sd) < first
  assert _kernel_hashes(lambda *a: [x + 1 for x in train(*a)], sd, sd, sd, sd) == first
  assert cache.info()["misses"] == 2 and cache.info()["hits"] == 3
  longer = jax.ShapeDtypeStruct((1, 768, 2, 128), BF16)
  assert not _kernel_hashes(evaluate, longer, longer, longer, longer) & first


class _Recorded(list):
  paths: list

  def __init__(self):
    super().__init__()
    self.paths = []


@pytest.fixture
def background(monkeypatch):
  """A GPU process's background compiles, observed on the CPU: ``_on_gpu`` says yes and each
  compile records the export it was given instead of compiling it; returns that list (and the
  compiled-kernel paths they were given, ``.paths``)."""
  compiled = _Recorded()
  monkeypatch.setattr(lowering_cache, "_on_gpu", lambda: True)
  monkeypatch.setattr(lowering_cache, "_compile", lambda exp, avals, path: (
      compiled.append(exp), compiled.paths.append(path)))
  previous = lowering_cache.set_background_compiles(True)
  yield compiled
  lowering_cache.wait_for_compiles()
  lowering_cache.set_background_compiles(previous)


def test_new_exports_compile_in_the_background(reuse, background):
  """On a GPU every new export starts its compile in a thread at once (the program's compile then
  finds the kernels compiled, in parallel instead of one after another); a program that reuses the
  exports starts none; with the background compiles off a new shape starts none."""
  cache = reuse()
  sd = jax.ShapeDtypeStruct((1, 512, 2, 128), BF16)
  cfg = MosaicConfig.default(128, BF16, True).replace(dq_fused=True, dq_fused_min_t=0)
  train = _train(128 ** -0.5, True, cfg)
  _kernel_hashes(train, sd, sd, sd, sd)
  assert lowering_cache.wait_for_compiles() == 2 and lowering_cache.wait_for_compiles() == 0
  assert len(background) == 2 and {id(e) for e in background} == {
      id(e) for e in lowering_cache._EXPORTED.values()}
  _kernel_hashes(lambda *a: [x + 1 for x in train(*a)], sd, sd, sd, sd)
  assert lowering_cache.wait_for_compiles() == 0 and cache.info()["compiles"] == 2
  lowering_cache.set_background_compiles(False)
  longer = jax.ShapeDtypeStruct((1, 768, 2, 128), BF16)
  _kernel_hashes(train, longer, longer, longer, longer)
  assert cache.info()["misses"] == 4 and len(background) == 2


def test_the_backward_rule_waits_for_the_background_compiles(reuse, background, fake_hopper,
                                                            monkeypatch):
  """``jit(grad(flash_attention))``: the backward rule, traced after every kernel of the step, waits
  for their compiles, so that the step's compile finds all of them compiled."""
  reuse()
  waited = []
  original = lowering_cache.wait_for_compiles
  monkeypatch.setattr(lowering_cache, "wait_for_compiles",
                      lambda: waited.append(original()) or waited[-1])
  sd = jax.ShapeDtypeStruct((1, 512, 2, 128), BF16)
  loss = lambda q, k, v: fa2_jax.flash_attention(q, k, v, is_causal=True).astype(jnp.float32).sum()  # noqa: E731
  jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(sd, sd, sd).lower(lowering_platforms=("cuda",))
  monkeypatch.setattr(lowering_cache, "wait_for_compiles", original)
  assert waited == [len(background)] and len(background) >= 2
  assert not getattr(lowering_cache._PENDING, "futures", [])


def test_no_background_compiles_with_jax_compilation_cache(reuse, background, monkeypatch):
  """With JAX's persistent compilation cache on, no kernel compiles in the background: the step's
  compile would then take well under the cache's 1 s threshold and not be kept, so a later process
  would compile its kernels again one after another."""
  cache = reuse()
  sd = jax.ShapeDtypeStruct((1, 512, 2, 128), BF16)
  fwd = lambda q, k, v: forward(q, k, v, scale=0.1, is_causal=True,  # noqa: E731
                                config=MosaicConfig.default(128, BF16, True))[0]
  previous = jax.config.jax_compilation_cache_dir
  try:
    jax.config.update("jax_compilation_cache_dir", "/nonexistent/jax_cache_for_the_test")
    assert lowering_cache._jax_cache_on()
    _kernel_hashes(fwd, sd, sd, sd)
  finally:
    jax.config.update("jax_compilation_cache_dir", previous)
  assert not lowering_cache._jax_cache_on()
  assert cache.info()["misses"] == 1 and cache.info()["compiles"] == 0
  _kernel_hashes(fwd, *(jax.ShapeDtypeStruct((1, 768, 2, 128), BF16),) * 3)
  assert cache.info()["compiles"] == 1 and lowering_cache.wait_for_compiles() == 1


def test_a_failed_background_compile_is_counted(reuse, monkeypatch):
  """The real background compile of a CUDA export on this CPU fails: counted, not raised (the
  program's own compile reports such an error)."""
  cache = reuse()
  monkeypatch.setattr(lowering_cache, "_on_gpu", lambda: True)
  previous = lowering_cache.set_background_compiles(True)
  try:
    sd = jax.ShapeDtypeStruct((1, 512, 2, 128), BF16)
    _kernel_hashes(lambda q, k, v: forward(q, k, v, scale=0.1, is_causal=False,
                                           config=MosaicConfig.default(128, BF16, False))[0],
                   sd, sd, sd)
    assert lowering_cache.wait_for_compiles() == 1
  finally:
    lowering_cache.set_background_compiles(previous)
  assert cache.info()["compiles"] == 1 and cache.info()["compile_errors"] == 1


def test_a_compiled_kernel_file_loads_in_place_of_a_compile(reuse, tmp_path):
  """The background compile writes the program's executable (here a CPU program: this machine's
  client) never group- or other-writable, and loading it back counts as a compiled read."""
  cache = reuse()
  sd = jax.ShapeDtypeStruct((8,), jnp.float32)
  exp = jax.export.export(jax.jit(lambda x: x * 2 + 1))(sd)
  path = str(tmp_path / "kernel.xla_compiled")
  lowering_cache._compile(exp, [sd], path)
  assert cache.info()["compiled_writes"] == 1 and cache.info()["compile_errors"] == 0
  assert not os.stat(path).st_mode & 0o022
  assert lowering_cache._load_compiled(path) and cache.info()["compiled_reads"] == 1


def test_a_compiled_kernel_file_is_loaded_only_when_trusted_and_intact(reuse, tmp_path,
                                                                       monkeypatch):
  """Loading an executable runs its code: a file others can write, another user's, a symbolic link,
  a damaged file, one copied under another name, and one whose payload is not an executable are not
  loaded (compiled again)."""
  cache = reuse()
  sd = jax.ShapeDtypeStruct((8,), jnp.float32)
  exp = jax.export.export(jax.jit(lambda x: x * 2 + 1))(sd)
  path = tmp_path / "kernel.xla_compiled"
  lowering_cache._compile(exp, [sd], str(path))
  data = path.read_bytes()
  assert lowering_cache._load_compiled(str(path))
  os.chmod(path, 0o664)
  assert not lowering_cache._load_compiled(str(path))
  os.chmod(path, 0o644)
  damaged = bytearray(data)
  damaged[-10] ^= 0x01
  path.write_bytes(bytes(damaged))
  assert not lowering_cache._load_compiled(str(path))
  other = tmp_path / "other.xla_compiled"
  other.write_bytes(data)
  os.chmod(other, 0o644)
  assert not lowering_cache._load_compiled(str(other))
  junk = b"not an executable"
  path.write_bytes(lowering_cache._header(str(path), junk, lowering_cache._COMPILED_MAGIC) + junk)
  assert not lowering_cache._load_compiled(str(path))
  assert not lowering_cache._load_compiled(str(tmp_path / "missing.xla_compiled"))
  path.write_bytes(data)
  os.chmod(path, 0o644)
  assert lowering_cache._load_compiled(str(path))
  real_uid = os.getuid()
  monkeypatch.setattr(os, "getuid", lambda: real_uid + 1)  # the file is another user's
  assert not lowering_cache._load_compiled(str(path))
  monkeypatch.undo()
  link = tmp_path / "link.xla_compiled"  # a symbolic link is not followed
  link.symlink_to(path)
  assert not lowering_cache._payload(str(link), lowering_cache._COMPILED_MAGIC)
  fifo = tmp_path / "fifo.xla_compiled"  # nor is a FIFO read (an open would wait for a writer)
  os.mkfifo(fifo)
  assert not lowering_cache._payload(str(fifo), lowering_cache._COMPILED_MAGIC)
  assert cache.info()["compiled_reads"] == 2


def test_an_export_file_is_read_only_when_trusted(tmp_path, monkeypatch):
  """An export's kernel module is compiled to code that runs: like a compiled file, an export that
  others can write, or another user's, is not read (lowered again); each user's names differ."""
  aval = jax.ShapeDtypeStruct((2,), jnp.float32)
  exp = jax.export.export(jax.jit(lambda x: x * 2))(aval)
  path = tmp_path / "k.jax_exported"
  assert lowering_cache._write(str(path), exp)
  assert not path.stat().st_mode & 0o022
  assert lowering_cache._read(str(path), (aval,)) is not None
  os.chmod(path, 0o666)
  assert lowering_cache._read(str(path), (aval,)) is None
  os.chmod(path, 0o644)
  key = ("m", "f", (), (aval,), None)
  mine = lowering_cache._file_name(key, {})
  real_uid = os.getuid()
  monkeypatch.setattr(os, "getuid", lambda: real_uid + 1)
  assert lowering_cache._read(str(path), (aval,)) is None
  assert lowering_cache._file_name(key, {}) != mine


def test_a_failed_compiled_write_stays_in_the_background(reuse, tmp_path, monkeypatch):
  """A compiled file that cannot be written (here the write raises, as a warning turned into an
  error would) leaves the background compile quietly: nothing reaches wait_for_compiles."""
  cache = reuse()
  sd = jax.ShapeDtypeStruct((8,), jnp.float32)
  exp = jax.export.export(jax.jit(lambda x: x + 1))(sd)

  def failing(*args, **kwargs):
    raise RuntimeWarning("cannot write")

  monkeypatch.setattr(lowering_cache, "_write_file", failing)
  lowering_cache._compile(exp, [sd], str(tmp_path / "kernel.xla_compiled"))
  assert cache.info()["compiled_writes"] == 0 and cache.info()["compile_errors"] == 0


def test_a_kernel_with_a_compiled_file_is_not_compiled_again(reuse, background, monkeypatch,
                                                            tmp_path):
  """With a cache folder on a GPU each new export compiles in the background with the path of its
  compiled file beside the export; a later process (the in-memory exports dropped) that loads those
  files starts no compile, and one whose load fails compiles again."""
  cache = reuse(cache_dir=tmp_path)
  sd = jax.ShapeDtypeStruct((1, 512, 2, 128), BF16)
  # a fresh function each time: jit's trace cache would keep the first lowering
  fwd = lambda: lambda q, k, v: forward(q, k, v, scale=0.1, is_causal=True,  # noqa: E731
                                        config=MosaicConfig.default(128, BF16, True))[0]
  _kernel_hashes(fwd(), sd, sd, sd)
  assert lowering_cache.wait_for_compiles() == 1 and cache.info()["compiled_reads"] == 0
  (path,) = background.paths
  assert path.endswith(".xla_compiled") and os.path.dirname(path) == str(tmp_path)
  loads = []
  monkeypatch.setattr(lowering_cache, "_load_compiled", lambda p: loads.append(p) or True)
  lowering_cache.clear()
  _kernel_hashes(fwd(), sd, sd, sd)
  assert cache.info()["reads"] == 1 and loads == [path]
  assert lowering_cache.wait_for_compiles() == 0 and len(background) == 1
  monkeypatch.setattr(lowering_cache, "_load_compiled", lambda p: False)
  lowering_cache.clear()
  _kernel_hashes(fwd(), sd, sd, sd)
  assert lowering_cache.wait_for_compiles() == 1 and background.paths == [path, path]
  # JAX's persistent cache on: nothing loaded (the step, its kernels loaded, would compile too
  # quickly for that cache to keep it) and nothing compiled in the background
  loads.clear()
  monkeypatch.setattr(lowering_cache, "_load_compiled", lambda p: loads.append(p) or True)
  monkeypatch.setattr(lowering_cache, "_jax_cache_on", lambda: True)
  lowering_cache.clear()
  _kernel_hashes(fwd(), sd, sd, sd)
  assert not loads and lowering_cache.wait_for_compiles() == 0 and len(background) == 2


def test_vmap_folds_into_the_batch(reuse):
  """Under ``vmap`` the reused kernel runs with the mapped axis folded into the batch: the kernel of
  ``vmap`` over 2 x [1, T, N, H] is the one of a direct [2, T, N, H] call."""
  reuse()
  one = jax.ShapeDtypeStruct((1, 256, 2, 64), BF16)
  mapped = jax.ShapeDtypeStruct((2, 1, 256, 2, 64), BF16)
  both = jax.ShapeDtypeStruct((2, 256, 2, 64), BF16)

  def fwd(q, k, v):
    return forward(q, k, v, scale=0.125, is_causal=False)[0]

  assert _kernel_hashes(jax.vmap(fwd), mapped, mapped, mapped) == _kernel_hashes(fwd, both, both, both)
  assert not _kernel_hashes(fwd, one, one, one) & _kernel_hashes(fwd, both, both, both)


def test_vmap_of_the_backward_with_unbatched_keys(reuse):
  """``vmap`` of a forward + backward over the queries only (keys and values unbatched, so broadcast
  by the fold): the per-element gradients' shapes, and the folded kernels' hashes those of a direct
  call with the batch times the mapped size."""
  reuse()
  cfg = MosaicConfig.default(128, BF16, False).replace(dq_fused=True, dq_fused_min_t=0)
  train = _train(128 ** -0.5, False, cfg)
  q, kv = (jax.ShapeDtypeStruct((3, 1, 256, 2, 128), BF16), jax.ShapeDtypeStruct((1, 256, 2, 128), BF16))
  traced = jax.jit(jax.vmap(train, in_axes=(0, None, None, 0))).trace(q, kv, kv, q)
  assert [o.shape for o in traced.out_info[2:]] == [q.shape, q.shape, q.shape]  # dq; dk, dv per element
  text = traced.lower(lowering_platforms=("cuda",)).as_text()
  folded = jax.ShapeDtypeStruct((3, 256, 2, 128), BF16)
  assert set(re.findall(r'kernel_hash = "((?:[^"\\]|\\.)*)"', text)) == _kernel_hashes(
      train, folded, folded, folded, folded)


def test_an_export_under_a_mesh_is_not_reused_outside_it(reuse):
  """An export records its mesh's device count: a kernel first exported inside ``jax.set_mesh`` (a
  sharded step) is exported again for a program outside it (a single-device step), not reused."""
  cache = reuse()
  sd = jax.ShapeDtypeStruct((1, 256, 2, 64), BF16)

  def fwd(q, k, v):
    return forward(q, k, v, scale=0.125, is_causal=True)[0]

  mesh = jax.make_mesh((4,), ("b",), axis_types=(jax.sharding.AxisType.Explicit,))
  with jax.set_mesh(mesh):
    inside = _kernel_hashes(lambda q, k, v: fwd(q, k, v) + 1, sd, sd, sd)
  outside = _kernel_hashes(fwd, sd, sd, sd)
  assert inside and outside and cache.info()["misses"] == 2


def test_lengths_in_one_multiple_share_kernels(reuse, fake_hopper):
  """With ``length_multiple``, ``flash_attention`` calls of 200 and 250 rows (both padded to 256)
  run the same kernels, forward and backward; 300 rows (padded to 512) others."""
  cache = reuse(length_multiple=256)

  def hashes(t):
    sd = jax.ShapeDtypeStruct((2, t, 4, 64), BF16)
    loss = lambda q, k, v: jnp.sum(fa2_jax.flash_attention(q, k, v, is_causal=True)  # noqa: E731
                                   .astype(jnp.float32))
    return _kernel_hashes(jax.grad(loss, argnums=(0, 1, 2)), sd, sd, sd)

  first = hashes(250)
  exports = cache.info()["misses"]
  assert len(first) == 3 and exports == 3  # forward, dK/dV, dQ (256 causal rows: no fused dQ)
  assert hashes(200) == first and cache.info()["misses"] == exports
  assert not hashes(300) & first


def _run(t, s, n, kh, **kwargs):
  ks = jax.random.split(jax.random.key(t * 7 + s), 4)
  q = jax.random.normal(ks[0], (2, t, n, 32), jnp.float32)
  k = jax.random.normal(ks[1], (2, s, kh, 32), jnp.float32)
  v = jax.random.normal(ks[2], (2, s, kh, 32), jnp.float32)

  def f(q, k, v):
    return fa2_jax.flash_attention(q, k, v, implementation="triton", interpret=True,
                                   return_residual=True, **kwargs)

  (out, lse), vjp = jax.vjp(f, q, k, v)
  do = jax.random.normal(ks[3], out.shape, jnp.float32)
  return (out, lse, *vjp((do, jnp.zeros_like(lse))))


PADDED_CASES = {  # name: (t, s, n, kh, flash_attention keywords)
    # top-left causal with T < S (the keys past T dropped before the padding), GQA
    "causal_t_below_s_gqa": (37, 45, 4, 2, lambda: dict(is_causal=True)),
    # T > S, a two-sided window from per-batch offsets, the call's own lengths, segments, soft cap
    "window_lengths_offset_segments_soft_cap": (40, 30, 2, 2, lambda: dict(
        local_window_size=(9, 2), q_offset=jnp.array([3, 0]), query_seq_lengths=jnp.array([33, 17]),
        key_value_seq_lengths=jnp.array([30, 20]),
        q_segment_ids=jnp.repeat(jnp.array([[0, 1], [2, 2]]), 20, axis=1),
        kv_segment_ids=jnp.repeat(jnp.array([[0, 1], [2, 2]]), 15, axis=1), logits_soft_cap=5.0)),
}


@pytest.mark.parametrize("name", sorted(PADDED_CASES))
def test_padded_lengths_give_the_unpadded_results(reuse, name):
  """T and S padded to a multiple of 32 (the true lengths as lengths): outputs, lse and gradients
  equal the unpadded call's, shapes unchanged, on the Triton kernels in interpret mode."""
  t, s, n, kh, kwargs = PADDED_CASES[name]
  base = _run(t, s, n, kh, **kwargs())
  reuse(length_multiple=32)
  got = _run(t, s, n, kh, **kwargs())
  for what, x, r in zip(("out", "lse", "dq", "dk", "dv"), got, base):
    assert x.shape == r.shape, what
    np.testing.assert_allclose(np.asarray(x), np.asarray(r), rtol=1e-5, atol=1e-5, err_msg=what)


_CACHE_DIR_PROGRAM = """
import json, re, sys
import jax, jax.numpy as jnp
import fa2_jax
from fa2_jax.kernels.sm90 import lowering_cache
from fa2_jax.kernels.sm90.backward import backward
from fa2_jax.kernels.sm90.config import MosaicConfig
from fa2_jax.kernels.sm90.forward import forward
fa2_jax.reuse_kernels_across_programs(True, cache_dir=sys.argv[1])
cfg = MosaicConfig.default(128, jnp.bfloat16, True).replace(dq_fused=True, dq_fused_min_t=0)
mask_fn = (lambda b, h, i, j: j <= i) if sys.argv[2] == "mask_fn" else None
def train(q, k, v, do):
  out, stats = forward(q, k, v, scale=0.1, is_causal=True, config=cfg)
  return out, backward(q, k, v, out, stats, do, scale=0.1, is_causal=True, config=cfg,
                       deterministic=False)
def with_mask_fn(q, k, v):
  return fa2_jax.flash_attention(q, k, v, mask_fn=mask_fn, implementation="mosaic")
sd = jax.ShapeDtypeStruct((1, 512, 2, 128), jnp.bfloat16)
fn, avals = (with_mask_fn, (sd,) * 3) if mask_fn else (train, (sd,) * 4)
text = jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()
hashes = sorted(set(re.findall(r'kernel_hash = "((?:[^"\\\\]|\\\\.)*)"', text)))
print(json.dumps(dict(lowering_cache.info(), hashes=hashes)))
"""


def _lower_in_a_fresh_process(cache_dir, kind="dense"):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  if kind == "mask_fn":  # flash_attention's dispatch believes it runs on an H200
    program = _CACHE_DIR_PROGRAM.replace(
        "fa2_jax.reuse_kernels_across_programs(",
        "from fa2_jax.kernels import platform\nplatform.on_gpu = lambda: True\n"
        "platform.gpu_compute_capability = lambda: (9, 0)\nfa2_jax.reuse_kernels_across_programs(")
  else:
    program = _CACHE_DIR_PROGRAM
  out = subprocess.run([sys.executable, "-c", program, str(cache_dir), kind], check=True, env=env,
                       capture_output=True, text=True).stdout
  return json.loads(out.strip().splitlines()[-1])


def test_a_later_process_reads_the_kernels_from_the_cache_dir(tmp_path):
  """With ``cache_dir`` the first process writes each kernel's export; a second process reads them
  instead of lowering (no write), and embeds the same modules: the same kernel hashes, so JAX's
  persistent compilation cache finds them compiled."""
  first = _lower_in_a_fresh_process(tmp_path)
  assert first["writes"] == 2 and first["reads"] == 0 and len(first["hashes"]) == 2
  assert len(list(tmp_path.glob("*.jax_exported"))) == 2
  second = _lower_in_a_fresh_process(tmp_path)
  assert second["reads"] == 2 and second["writes"] == 0
  assert second["hashes"] == first["hashes"]


def test_a_damaged_cache_file_is_lowered_again(tmp_path):
  """A damaged file (one byte changed, which may still deserialize: the kernel's module is an opaque
  string there, under the undamaged module's kernel hash) and an intact export of another kernel
  copied under this one's name are misses: the kernel is lowered and the file written anew."""
  first = _lower_in_a_fresh_process(tmp_path)
  damaged, copied_over = sorted(tmp_path.glob("*.jax_exported"))
  data = bytearray(damaged.read_bytes())
  copied_over.write_bytes(bytes(data))  # the other kernel's operands
  data[len(data) // 2] ^= 0x01
  damaged.write_bytes(bytes(data))
  again = _lower_in_a_fresh_process(tmp_path)
  assert again["reads"] == 0 and again["writes"] == 2 and again["hashes"] == first["hashes"]
  third = _lower_in_a_fresh_process(tmp_path)  # the files written anew are read
  assert third["reads"] == 2 and third["writes"] == 0


def test_kernels_of_a_mask_fn_are_not_written(tmp_path):
  """A ``mask_fn``'s code is not in the key's text: its kernels stay in the process."""
  info = _lower_in_a_fresh_process(tmp_path, "mask_fn")
  assert info["misses"] >= 1 and info["writes"] == 0 and not list(tmp_path.iterdir())


def test_cache_file_names_change_with_sources_versions_gpu_and_mesh(monkeypatch):
  """Another version of the package's sources, of jax/jaxlib, another GPU (SM count: a persistent
  kernel's launch) or another mesh names other files: such an export is never read."""
  key = ("m", "f", (("scale", 0.1),), (jax.ShapeDtypeStruct((1, 8), BF16),),
         jax.sharding.get_abstract_mesh())
  name = lowering_cache._file_name(key, {})
  assert name == lowering_cache._file_name(key, {})
  env = lowering_cache._environment()
  with monkeypatch.context() as m:
    m.setattr(lowering_cache, "_SOURCES", ["another version"])
    assert lowering_cache._file_name(key, {}) != name
  with monkeypatch.context() as m:
    m.setattr(lowering_cache, "_ENVIRONMENT", [(env[0], env[1], env[2] - 18)])  # an H100 PCIe
    assert lowering_cache._file_name(key, {}) != name
  with monkeypatch.context() as m:
    m.setattr(lowering_cache, "_ENVIRONMENT", [((("jaxlib", "0.0"),), env[1], env[2])])
    assert lowering_cache._file_name(key, {}) != name
  mesh = jax.sharding.AbstractMesh((4,), ("data",))
  assert lowering_cache._file_name(key[:-1] + (mesh,), {}) != name


def test_the_sources_hash_covers_the_kernels(monkeypatch):
  """The hash reads fa2_jax and its kernels (kernels/ is a folder of its own in the source tree)."""
  import builtins

  import fa2_jax.kernels
  read, real_open = [], builtins.open

  def spy(path, *a, **k):
    read.append(os.path.relpath(path, os.path.dirname(fa2_jax.kernels.__file__)))
    return real_open(path, *a, **k)

  monkeypatch.setattr(lowering_cache, "_SOURCES", [])
  monkeypatch.setattr(builtins, "open", spy)
  lowering_cache._sources_hash()
  monkeypatch.undo()
  assert os.path.join("sm90", "forward.py") in read and os.path.join("sm90", "dkdv.py") in read
  # and the public package's, which registers itself (kernel_reuse: add_package_folder)
  assert os.path.join("..", "fa2_jax", "attention.py") in read or "attention.py" in {
      os.path.basename(p) for p in read if "fa2_jax" in p}


def test_a_function_with_its_own_repr_is_not_written():
  """A ``mask_fn`` whose repr carries no address still keeps its kernels out of the folder."""
  from fa2_jax.kernels.masking import Variant

  class Causal:
    def __call__(self, b, h, i, j):
      return j <= i

    def __repr__(self):
      return "Causal()"

  key = ("m", "f", (), (), None)
  assert lowering_cache._file_name(key, {"variant": Variant(mask_fn=Causal())}) is None
  assert lowering_cache._file_name(key, {"variant": Variant(score_fn=lambda s, *a: s)}) is None
  assert lowering_cache._file_name(key, {"variant": Variant(is_causal=True)}) is not None


def test_a_folder_that_cannot_be_written_warns_and_keeps_the_kernels(tmp_path, monkeypatch):
  """A failed write costs a warning, once per folder, not the user's program; the export is still
  held. A file is read only under the name it was written to, for the operands it was made for."""
  aval = jax.ShapeDtypeStruct((2,), jnp.float32)
  exp = jax.export.export(jax.jit(lambda x: x + 1))(aval)
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  monkeypatch.setitem(lowering_cache._STATE, "warned", set())
  with pytest.warns(RuntimeWarning, match="cannot write kernel lowerings"):
    assert not lowering_cache._write(str(blocker / "sub" / "k.jax_exported"), exp)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert not lowering_cache._write(str(blocker / "sub" / "k.jax_exported"), exp)  # warned already
  with pytest.warns(RuntimeWarning, match="other"):  # another folder warns again
    assert not lowering_cache._write(str(blocker / "other" / "k.jax_exported"), exp)
  path = tmp_path / "new" / "k.jax_exported"  # a folder not there yet is made
  monkeypatch.setitem(lowering_cache._STATE, "umask", lowering_cache._STATE["umask"])  # restored after
  umask = os.umask(0o027)  # a group-shared folder's umask, read when the folder is set
  try:
    previous = lowering_cache.set_cache_dir(tmp_path)
    lowering_cache.set_cache_dir(previous)
  finally:
    os.umask(umask)
  assert lowering_cache._write(str(path), exp)
  assert path.stat().st_mode & 0o777 == 0o640
  assert lowering_cache._read(str(path), (aval,)).call(jnp.ones(2)).tolist() == [2.0, 2.0]
  assert lowering_cache._read(str(path), (jax.ShapeDtypeStruct((3,), jnp.float32),)) is None
  copied = tmp_path / "new" / "another_key.jax_exported"  # same operands, another key's name
  copied.write_bytes(path.read_bytes())
  assert lowering_cache._read(str(copied), (aval,)) is None


def test_the_unwritable_folder_warning_points_at_the_users_line(tmp_path, monkeypatch, reuse):
  """The warning skips the frames of fa2_jax, its kernels and JAX (the kernel is lowered while JAX
  traces the user's program), so it names a line of the user's file: the traced function's (with
  stacklevel=2 it named lowering_cache.py)."""
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  monkeypatch.setitem(lowering_cache._STATE, "warned", set())
  reuse(cache_dir=str(blocker / "sub"))
  cfg = MosaicConfig.default(128, BF16, True)
  fwd = lambda q, k, v: forward(q, k, v, scale=0.1, is_causal=True, config=cfg)[0]  # noqa: E731
  sd = jax.ShapeDtypeStruct((1, 256, 2, 128), BF16)
  with pytest.warns(RuntimeWarning, match="cannot write kernel lowerings") as caught:
    jax.jit(fwd).trace(sd, sd, sd).lower(lowering_platforms=("cuda",))
  assert caught[0].filename == __file__


def test_cache_dir_without_flatbuffers_names_the_package(monkeypatch, tmp_path):
  import importlib.util
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "flatbuffers" else real(name, *a))
  before = kernel_reuse.info()
  with pytest.raises(ImportError, match="pip install flatbuffers"):
    fa2_jax.reuse_kernels_across_programs(True, cache_dir=tmp_path)
  assert kernel_reuse.info() == before


def test_switch_arguments_are_checked(tmp_path, monkeypatch):
  before = kernel_reuse.info()
  with pytest.raises(TypeError, match="enabled must be True or False, got str"):
    fa2_jax.reuse_kernels_across_programs("yes")
  for bad in (0, -4):
    with pytest.raises(ValueError, match="length_multiple must be a positive int or None"):
      fa2_jax.reuse_kernels_across_programs(True, length_multiple=bad)
  for bad in (2.0, True, "8"):
    with pytest.raises(TypeError, match="length_multiple must be a positive int or None"):
      fa2_jax.reuse_kernels_across_programs(True, length_multiple=bad)
  with pytest.raises(TypeError, match="cache_dir must be None, a str or an os.PathLike"):
    fa2_jax.reuse_kernels_across_programs(True, cache_dir=3)
  with pytest.raises(ValueError, match="cache_dir must be a folder"):
    fa2_jax.reuse_kernels_across_programs(True, cache_dir=__file__)
  with pytest.raises(ValueError, match="cache_dir must name a folder"):
    fa2_jax.reuse_kernels_across_programs(True, cache_dir="")
  monkeypatch.setenv("HOME", str(tmp_path))
  (tmp_path / "a_file").write_text("")
  with pytest.raises(ValueError, match="cache_dir must be a folder"):  # after "~" is expanded
    fa2_jax.reuse_kernels_across_programs(True, cache_dir="~/a_file")
  with pytest.raises(ValueError, match="cache_dir needs enabled=True"):
    fa2_jax.reuse_kernels_across_programs(False, cache_dir=os.path.dirname(__file__))
  with pytest.raises(ValueError, match="length_multiple needs enabled=True"):
    fa2_jax.reuse_kernels_across_programs(False, length_multiple=64)
  assert kernel_reuse.info() == before  # a rejected call changes nothing
  try:  # numpy's bool and ints are taken as Python's
    fa2_jax.reuse_kernels_across_programs(np.bool_(True), length_multiple=np.int64(64),
                                          cache_dir=None)
    assert kernel_reuse.length_multiple() == 64 and type(kernel_reuse.length_multiple()) is int
  finally:
    fa2_jax.reuse_kernels_across_programs(before["enabled"],
                                          length_multiple=before["length_multiple"],
                                          cache_dir=before["cache_dir"] if before["enabled"]
                                          else None)
  assert kernel_reuse.info() == before


@pytest.mark.parametrize("setting", ["default", "xdg", "named", "off", "on", "file"])
def test_a_fresh_process_reuses_kernels_in_the_per_user_folder(setting, tmp_path):
  """On by default, with the folder of FA2_JAX_CACHE_DIR, else $XDG_CACHE_HOME/fa2_jax/kernels, else
  ~/.cache/fa2_jax/kernels; FA2_JAX_CACHE_DIR=off: off."""
  env = {k: v for k, v in os.environ.items() if k not in ("FA2_JAX_CACHE_DIR", "XDG_CACHE_HOME")}
  env.update(JAX_PLATFORMS="cpu", HOME=str(tmp_path))
  expected = str(tmp_path / ".cache" / "fa2_jax" / "kernels")
  if setting == "xdg":
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    expected = str(tmp_path / "xdg" / "fa2_jax" / "kernels")
  elif setting == "named":
    env["FA2_JAX_CACHE_DIR"] = "~/kernels"
    expected = str(tmp_path / "kernels")
  elif setting == "off":
    env["FA2_JAX_CACHE_DIR"] = "off"
    expected = None
  elif setting == "on":  # the default folder, not a folder named "on"
    env["FA2_JAX_CACHE_DIR"] = "On"
  elif setting == "file":  # a file is no folder: reuse within the process only, and a warning
    (tmp_path / "a_file").write_text("")
    env["FA2_JAX_CACHE_DIR"] = str(tmp_path / "a_file")
    expected = None
  code = ("import fa2_jax; from fa2_jax import kernel_reuse as r; i = r.info(); "
          "print(i['enabled'], i['cache_dir'], i['length_multiple'], r.default_cache_dir())")
  run = subprocess.run([sys.executable, "-c", code], check=True, env=env, capture_output=True,
                       text=True)
  got = run.stdout.split()
  assert got == [str(expected is not None or setting == "file"), str(expected), "None",
                 str(expected)]
  assert ("FA2_JAX_CACHE_DIR names the file" in run.stderr) == (setting == "file")
  assert not (tmp_path / ".cache").exists()  # made when a kernel is first written
