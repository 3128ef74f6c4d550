"""A value head_dim ``Hv`` other than the query/key head_dim ``H`` (multi-head latent attention, e.g.
DeepSeek-V2's ``H = 192``, ``Hv = 128``): ``value [B, S, K, Hv]`` gives ``out [B, T, N, Hv]``, the lse
unchanged, ``dq``/``dk`` with ``H`` and ``dv`` with ``Hv``; the default scale stays ``1 / sqrt(H)``.

Out, lse and gradients against the float64 formula (bounds as tests/test_attention.py: at most twice
the formula's own error in the input dtype plus ``atol * (max |reference| + 1)``) on the Triton
kernels (Pallas interpret mode on CPU), the XLA formula (one block and chunked) and the decode kernels;
the argument checks; dispatch (``implementation=None`` runs the sm90 kernels on Hopper, which tile
V/O by their own head_dim); sharding, the paged and contiguous caches, and the Flax adapter.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import fa2_jax
from conftest import on_gpu
from fa2_jax.kernels import platform

INTERPRET = None if on_gpu() else True
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
ATOL = {"float32": 2e-5, "bfloat16": 2e-3, "float16": 5e-4}  # as tests/test_attention.py
needs4 = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (conftest sets 4 CPUs)")


@dataclasses.dataclass(frozen=True)
class Case:
  b: int
  t: int
  s: int
  n: int
  kh: int
  h: int
  hv: int
  dtype: str
  variant: str = "causal"  # a key of _variant_args

  def __str__(self):
    return (f"b{self.b}-t{self.t}-s{self.s}-n{self.n}-k{self.kh}-h{self.h}-hv{self.hv}-"
            f"{self.variant}-{self.dtype}")


def _variant_args(case: Case) -> dict:
  """The attention-variant keywords of a case."""
  if case.variant == "causal":
    return dict(is_causal=True)
  if case.variant == "dense":
    return {}
  if case.variant == "decoding":  # the newest T rows against per-row cache lengths
    lens = jnp.asarray(np.linspace(case.s, case.t, case.b).astype(np.int32))
    return dict(is_causal=True, key_value_seq_lengths=lens, q_offset=lens - case.t)
  if case.variant == "window_segments_lengths":  # causal, a sliding window, two documents, padding
    q_seg = np.repeat(np.arange(2), [case.t // 2, case.t - case.t // 2])[None].repeat(case.b, 0)
    kv_seg = np.repeat(np.arange(2), [case.s // 2, case.s - case.s // 2])[None].repeat(case.b, 0)
    return dict(is_causal=True, local_window_size=(9, 0), q_segment_ids=jnp.asarray(q_seg, jnp.int32),
                kv_segment_ids=jnp.asarray(kv_seg, jnp.int32),
                query_seq_lengths=jnp.full((case.b,), case.t - 3, jnp.int32),
                key_value_seq_lengths=jnp.full((case.b,), case.s - 5, jnp.int32),
                q_offset=case.s - case.t)
  raise ValueError(case.variant)


def _inputs(case: Case, seed: int = 0):
  dt = DTYPES[case.dtype]
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (case.b, case.t, case.n, case.h), jnp.float32).astype(dt)
  k = jax.random.normal(ks[1], (case.b, case.s, case.kh, case.h), jnp.float32).astype(dt)
  v = jax.random.normal(ks[2], (case.b, case.s, case.kh, case.hv), jnp.float32).astype(dt)
  do = jax.random.normal(ks[3], (case.b, case.t, case.n, case.hv), jnp.float32).astype(dt)
  return q, k, v, do


def _out_lse_grads(fn, q, k, v, do):
  """``(out, lse, dq, dk, dv)`` of ``fn(q, k, v) -> (out, lse)``, the cotangent ``do`` on out (and a
  cosine of the lse on it: its gradient flows too)."""
  (out, lse), vjp = jax.vjp(fn, q, k, v)
  dlse = jnp.where(jnp.isfinite(lse), jnp.cos(lse), 0).astype(lse.dtype)
  return (out, lse, *vjp((do, dlse)))


def _reference(q, k, v, do, compute_dtype=None, **kw):
  """The formula's ``(out, lse, dq, dk, dv)`` as float64 numpy: in float64 (``compute_dtype`` None)
  or in the inputs' dtype (the error budget)."""
  fn = lambda a, b, c: fa2_jax.reference_attention(  # noqa: E731
      a, b, c, return_residual=True, compute_dtype=compute_dtype, **kw)
  if compute_dtype is not None:
    got = jax.jit(lambda *a: _out_lse_grads(fn, *a))(q, k, v, do)
    return [np.asarray(x.astype(jnp.float32), np.float64) for x in got]
  cpu = jax.devices("cpu")[0]
  with jax.enable_x64(True):
    args = [jax.device_put(np.asarray(x.astype(jnp.float32), np.float64), cpu) for x in (q, k, v, do)]
    return [np.asarray(x) for x in jax.jit(lambda *a: _out_lse_grads(fn, *a))(*args)]


def _check(got, q, k, v, do, dtype: str, **kw):
  """``got`` ``(out, lse, dq, dk, dv)`` against the float64 formula, with its shapes."""
  ref = _reference(q, k, v, do, **kw)
  low = ref if dtype == "float32" else _reference(q, k, v, do, compute_dtype=q.dtype, **kw)
  b, t, n, h = q.shape
  hv = v.shape[-1]
  shapes = ((b, t, n, hv), (b, t, n), q.shape, k.shape, v.shape)
  for name, g, r, lo, shape in zip(("out", "lse", "dq", "dk", "dv"), got, ref, low, shapes):
    g = np.asarray(jnp.asarray(g).astype(jnp.float32), np.float64)
    assert g.shape == shape, (name, g.shape, shape)
    np.testing.assert_array_equal(np.isneginf(g), np.isneginf(r), err_msg=f"{name}: -inf rows")
    fin = np.isfinite(r)
    assert np.all(np.isfinite(g[fin])), f"{name}: non-finite values"
    err = np.max(np.abs(g[fin] - r[fin]), initial=0.0)
    bound = (2 * np.max(np.abs(lo[fin] - r[fin]), initial=0.0)
             + ATOL[dtype] * (np.max(np.abs(r[fin]), initial=0.0) + 1.0))
    assert err <= bound, f"{name}: error {err:.3g} > bound {bound:.3g}"


CASES = [
    Case(1, 37, 45, 4, 2, 24, 16, "float32"),  # GQA, T < S; H 24 padded to 32, Hv 16 not padded
    Case(2, 50, 33, 2, 1, 16, 8, "bfloat16"),  # MQA, T > S (rows past S see every key); Hv -> 16
    Case(1, 40, 40, 2, 2, 16, 40, "float16", "dense"),  # Hv > H (Hv 40 padded to 64)
    Case(1, 36, 44, 4, 2, 24, 16, "float32", "window_segments_lengths"),
]


@pytest.mark.parametrize("implementation", ["triton", "xla"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_the_float64_formula(case, implementation):
  q, k, v, do = _inputs(case)
  kw = _variant_args(case)
  arrays = {n: x for n, x in kw.items() if isinstance(x, jax.Array)}
  static = {n: x for n, x in kw.items() if n not in arrays}
  d = fa2_jax.backend_for(q, k, v, implementation=implementation, interpret=INTERPRET, **kw)
  assert d.backend == implementation, d

  def run(q, k, v, do, arrays):
    fn = lambda a, b, c: fa2_jax.flash_attention(  # noqa: E731
        a, b, c, implementation=implementation, interpret=INTERPRET, return_residual=True,
        **static, **arrays)
    return _out_lse_grads(fn, q, k, v, do)

  _check(jax.jit(run)(q, k, v, do, arrays), q, k, v, do, case.dtype, **kw)


def test_default_scale_is_one_over_sqrt_of_the_query_head_dim():
  """scale=None means 1 / sqrt(H) (the query/key head_dim), not 1 / sqrt(Hv)."""
  q, k, v, _ = _inputs(Case(1, 9, 11, 2, 1, 24, 8, "float32"))
  for impl in ("triton", "xla"):
    out = jax.jit(lambda a, b, c: fa2_jax.flash_attention(  # noqa: B023  (called at once)
        a, b, c, implementation=impl, interpret=INTERPRET))(q, k, v)
    want = fa2_jax.reference_attention(q, k, v, scale=1 / math.sqrt(24))
    np.testing.assert_allclose(out, want, atol=2e-5, err_msg=impl)
    other = fa2_jax.reference_attention(q, k, v, scale=1 / math.sqrt(8))
    assert np.max(np.abs(np.asarray(out) - np.asarray(other))) > 1e-3


@pytest.mark.parametrize("variant", ["causal", "window_segments_lengths"])
def test_chunked_formula_matches_one_block(variant):
  """The formula's chunked path (query blocks, implementation='xla' on long calls): out, lse and
  gradients with Hv != H equal the one-block formula's."""
  case = Case(2, 37, 29, 4, 2, 16, 8, "float32", variant)
  q, k, v, do = _inputs(case, seed=1)
  kw = _variant_args(case)

  def grads(query_block):
    fn = lambda a, b, c: fa2_jax.reference_attention(  # noqa: E731
        a, b, c, return_residual=True, query_block=query_block, **kw)
    return _out_lse_grads(fn, q, k, v, do)

  for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), grads(16), grads(None)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5, err_msg=name)


# --- decoding: the decode kernels, a paged cache, the caches ---------------------------------------

def test_decode_kernels_and_a_paged_cache():
  """A decoding call (one new row against 300 keys, 3 splits) runs the decode forward with Hv != H
  (the backward is the Triton family's); the paged form reads [pages, page_size, K, Hv] value
  pages through the table."""
  from fa2_jax.paged import gather_pages
  b, n, kh, h, hv, s = 2, 4, 2, 24, 16, 300
  ks = jax.random.split(jax.random.key(2), 4)
  q = jax.random.normal(ks[0], (b, 1, n, h), jnp.float32)
  k = jax.random.normal(ks[1], (b, s, kh, h), jnp.float32)
  v = jax.random.normal(ks[2], (b, s, kh, hv), jnp.float32)
  do = jax.random.normal(ks[3], (b, 1, n, hv), jnp.float32)
  lens = jnp.array([300, 137], jnp.int32)
  kw = dict(is_causal=True, key_value_seq_lengths=lens, q_offset=lens - 1)
  cfg = fa2_jax.DecodeConfig(block_k=32, num_splits=3)
  d = fa2_jax.backend_for(q, k, v, interpret=INTERPRET, block_sizes=cfg, **kw)
  assert d.backend == "decode" and "decode split-KV forward" in d.forward[0], d

  def run(q, k, v, do, lens, table=None):
    extra = dict(key_value_seq_lengths=lens, q_offset=lens - 1, block_table=table)
    fn = lambda a, b_, c: fa2_jax.flash_attention(  # noqa: E731
        a, b_, c, is_causal=True, interpret=INTERPRET, block_sizes=cfg, return_residual=True,
        **extra)
    return _out_lse_grads(fn, q, k, v, do)

  _check(jax.jit(run)(q, k, v, do, lens), q, k, v, do, "float32", **kw)

  page_size, num_pages = 16, 40
  pk = jax.random.normal(ks[1], (num_pages, page_size, kh, h), jnp.float32)
  pv = jax.random.normal(ks[2], (num_pages, page_size, kh, hv), jnp.float32)
  table = jax.random.permutation(ks[3], num_pages)[:b * 19].reshape(b, 19).astype(jnp.int32)
  d = fa2_jax.backend_for(q, pk, pv, interpret=INTERPRET, block_sizes=cfg, block_table=table, **kw)
  assert d.backend == "decode" and "through the table" in d.reason, d
  out, lse = jax.jit(run)(q, pk, pv, do, lens, table)[:2]
  want, want_lse = fa2_jax.reference_attention(q, gather_pages(pk, table), gather_pages(pv, table),
                                               return_residual=True, **kw)
  assert out.shape == (b, 1, n, hv)
  np.testing.assert_allclose(out, want, atol=2e-5)
  np.testing.assert_allclose(lse, want_lse, atol=2e-5)


@pytest.mark.parametrize("paged", [False, True])
def test_kv_caches_hold_values_of_their_own_head_dim(paged):
  """KVCache/PagedKVCache.create(value_head_dim=...) and prefill with v [B, T, K, Hv]: append and
  attend give [B, T_new, N, Hv], the formula over the rows held."""
  b, n, kh, h, hv, t = 2, 4, 2, 16, 8, 5
  ks = jax.random.split(jax.random.key(3), 6)
  q, q_new = (jax.random.normal(x, (b, t_, n, h), jnp.float32) for x, t_ in zip(ks[:2], (t, 1)))
  k = jax.random.normal(ks[2], (b, t + 1, kh, h), jnp.float32)
  v = jax.random.normal(ks[3], (b, t + 1, kh, hv), jnp.float32)
  if paged:
    cache = fa2_jax.PagedKVCache.create(b, 8, 4, kh, h, value_head_dim=hv)
    assert (cache.head_dim, cache.value_head_dim) == (h, hv)
    cache = cache.append(k[:, :t], v[:, :t])
  else:
    out, cache = fa2_jax.prefill(q, k[:, :t], v[:, :t], capacity=16)
    assert out.shape == (b, t, n, hv) and cache.value_head_dim == hv
    np.testing.assert_allclose(out, fa2_jax.reference_attention(q, k[:, :t], v[:, :t],
                                                                is_causal=True), atol=2e-5)
  cache = cache.append(k[:, t:], v[:, t:])
  out = cache.attend(q_new, implementation="xla")
  assert out.shape == (b, 1, n, hv)
  np.testing.assert_allclose(out, fa2_jax.reference_attention(q_new, k, v), atol=2e-5)
  with pytest.raises(ValueError, match=f"v_new must have shape .*head_dim={hv}"):
    cache.append(k[:, t:], k[:, t:])
  with pytest.raises(ValueError, match="value_head_dim must be a positive int"):
    fa2_jax.KVCache.create(b, 8, kh, h, value_head_dim=0)


# --- argument checks and dispatch ----------------------------------------------------------------

Q = jnp.zeros((2, 8, 4, 16), jnp.float32)
K = jnp.zeros((2, 12, 2, 16), jnp.float32)
V = jnp.zeros((2, 12, 2, 8), jnp.float32)


@pytest.mark.parametrize("q, k, v, exc, match", [
    (Q, K, jnp.zeros((2, 11, 2, 8)), ValueError, r"key and value must have the same \[B, S, K\]"),
    (Q, K, jnp.zeros((2, 12, 1, 8)), ValueError, r"key and value must have the same \[B, S, K\]"),
    (Q, K, jnp.zeros((3, 12, 2, 8)), ValueError, r"key and value must have the same \[B, S, K\]"),
    (Q, jnp.zeros((2, 12, 2, 8)), V, ValueError, "key head_dim 8 does not match query head_dim 16"),
    (Q, K, jnp.zeros((2, 12, 2, 0)), ValueError, "value head_dim must be >= 1"),
    (Q, K, jnp.zeros((12, 2, 8)), ValueError, "value must have the same rank as query"),
    (Q, K, V.astype(jnp.bfloat16), ValueError, "share one dtype"),
])
def test_other_mismatches_still_raise(q, k, v, exc, match):
  for entry in (fa2_jax.flash_attention, fa2_jax.reference_attention, fa2_jax.backend_for):
    with pytest.raises(exc, match=match):
      entry(q, k, v)


def test_rank3_and_the_kernels_value_head_dim_limit():
  out = jax.jit(lambda a, b, c: fa2_jax.flash_attention(a, b, c, implementation="triton",
                                                      interpret=True))(Q[0], K[0], V[0])
  assert out.shape == (8, 4, 8)
  wide = jnp.zeros((2, 12, 2, 384), jnp.float32)
  with pytest.raises(ValueError, match="value head_dim <= 256, got 384"):
    fa2_jax.flash_attention(Q, K, wide, implementation="triton", interpret=True)
  assert fa2_jax.flash_attention(Q, K, wide).shape == (2, 8, 4, 384)  # the formula runs it


@pytest.fixture
def fake_hopper(monkeypatch):
  """The dispatcher believes it runs on an H100/H200 (as tests/test_sharding.py's fixture)."""
  monkeypatch.setattr(platform, "on_gpu", lambda: True)
  monkeypatch.setattr(platform, "gpu_compute_capability", lambda: (9, 0))


def test_sm90_runs_a_value_head_dim_of_its_own(fake_hopper):
  """DeepSeek-V2's shapes (H 192, Hv 128): the sm90 kernels tile V, O, dO and dV by their own
  width, so implementation=None picks sm90; a wider value (H 64, Hv 128) too; a value head_dim the
  kernels cannot tile (Hv 300) goes to Triton with the reason."""
  sds = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731
  q, k, v = sds(2, 1024, 8, 192), sds(2, 1024, 8, 192), sds(2, 1024, 8, 128)
  assert fa2_jax.backend_for(q, k, v, is_causal=True).backend == "sm90"
  assert fa2_jax.backend_for(q, k, v, block_sizes=fa2_jax.MosaicConfig.default(192)).backend == "sm90"
  q64 = sds(2, 1024, 8, 64)
  assert fa2_jax.backend_for(q64, q64, v, is_causal=True).backend == "sm90"
  d = fa2_jax.backend_for(q64, q64, sds(2, 1024, 8, 300), is_causal=True)
  assert d.backend != "sm90" and "up to 256" in d.reason, d
  # A decoding call: the decode forward, and the sm90 backward
  lens = jax.ShapeDtypeStruct((2,), jnp.int32)
  d = fa2_jax.backend_for(sds(2, 1, 8, 192), k, v, is_causal=True, key_value_seq_lengths=lens,
                          q_offset=lens)
  assert d.backend == "decode" and "the backward is sm90's" in d.reason, d


# --- sharding and the Flax adapter ---------------------------------------------------------------

def _loss(fn):
  return lambda q, k, v: jnp.sum(jnp.tanh(fn(q, k, v, is_causal=True).astype(jnp.float32)))


@needs4
@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit])
def test_batch_and_head_sharded_grad_runs_locally(kind):
  """B and the heads sharded over a 2 x 2 mesh: out [.., Hv] and dv keep the sharding, and the
  gradients equal the unsharded formula's (Auto axes: custom_partitioning, whose Shardy rule names H
  and Hv as separate factors; Explicit: a shard_map)."""
  q, k, v, _ = _inputs(Case(4, 16, 24, 4, 2, 16, 8, "float32"), seed=4)
  devices = jax.devices()[:4]
  mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(kind,) * 2, devices=devices)
  spec = P("data", None, "model", None)
  flash = lambda *a, **kw: fa2_jax.flash_attention(  # noqa: E731
      *a, implementation="triton", interpret=INTERPRET, **kw)
  fn = jax.jit(jax.value_and_grad(_loss(flash), argnums=(0, 1, 2)))
  want = jax.value_and_grad(_loss(fa2_jax.reference_attention), argnums=(0, 1, 2))(q, k, v)
  if kind == AxisType.Explicit:
    with jax.set_mesh(mesh):
      args = tuple(jax.device_put(x, spec) for x in (q, k, v))
      out = jax.jit(lambda a, b, c: flash(a, b, c, is_causal=True))(*args)
      assert jax.typeof(out).sharding.spec == spec and out.shape == (4, 16, 4, 8)
      got = fn(*args)
  else:
    args = tuple(jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v))
    text = fn.lower(*args).compile().as_text()
    assert "all-gather" not in text and "all-to-all" not in text
    got = fn(*args)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for name, a, b in zip(("dq", "dk", "dv"), got[1], want[1]):
    assert a.shape == b.shape, name
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4, err_msg=name)
  assert got[1][2].sharding.is_equivalent_to(NamedSharding(mesh, spec), 4)


def test_flax_attention_fn_runs_the_kernel():
  """fa2_jax.flax.attention_fn takes flax's value of its own depth (flax's dot_product_attention
  does) and runs the kernel, with no fallback warning."""
  pytest.importorskip("flax")
  import warnings

  import flax.linen as nn

  from fa2_jax import flax as fa2_flax
  q, k, v, _ = _inputs(Case(2, 12, 12, 4, 4, 16, 8, "float32"), seed=5)
  with warnings.catch_warnings():
    warnings.simplefilter("error", fa2_flax.FlashAttentionFallbackWarning)
    out = fa2_flax.make_attention_fn(is_causal=True, interpret=INTERPRET,
                                     implementation="triton")(q, k, v)
  want = nn.dot_product_attention(q, k, v, mask=nn.make_causal_mask(jnp.zeros((2, 12))))
  np.testing.assert_allclose(out, want, atol=2e-5)


# --- compiled (GPU) -----------------------------------------------------------------------------

GPU_CASES = [
    Case(2, 1024, 1024, 8, 8, 192, 128, "bfloat16"),  # DeepSeek-V2's head dims
    Case(1, 1000, 777, 8, 2, 192, 128, "bfloat16", "window_segments_lengths"),
    Case(2, 513, 1024, 4, 1, 64, 256, "float16", "dense"),
    # O staged in Q's bytes with a swizzle of its own (Q 32-byte, O 64-byte; 128-key forward tiles)
    Case(2, 700, 900, 4, 2, 144, 96, "bfloat16"),
    Case(1, 1000, 1000, 4, 4, 176, 128, "bfloat16", "dense"),  # O view of 88 rows
    Case(1, 300, 300, 4, 2, 96, 40, "float32"),
    Case(3, 1, 4096, 16, 16, 192, 128, "bfloat16", "decoding"),  # the decode forward
    Case(2, 4, 2000, 8, 2, 64, 128, "float16", "decoding"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case, impl", [(c, None) for c in GPU_CASES] + [
    (c, "triton") for c in GPU_CASES if c.variant != "decoding"], ids=str)
def test_compiled_matches_the_float64_formula_gpu(case, impl):
  """On the default kernels (Hopper: the sm90 kernels for 16-bit inputs, V/O tiles of their own
  width; other GPUs and float32: Triton; the decode forward for decoding calls) and on the Triton
  kernels."""
  from fa2_jax.kernels import platform
  q, k, v, do = _inputs(case, seed=6)
  kw = _variant_args(case)
  arrays = {n: x for n, x in kw.items() if isinstance(x, jax.Array)}
  static = {n: x for n, x in kw.items() if n not in arrays}
  hopper = (platform.gpu_compute_capability() or (0,))[0] == 9
  want = ("decode" if case.variant == "decoding" else impl if impl is not None
          else "sm90" if hopper and case.dtype != "float32" else "triton")
  assert fa2_jax.backend_for(q, k, v, implementation=impl, **kw).backend == want

  def run(q, k, v, do, arrays):
    fn = lambda a, b, c: fa2_jax.flash_attention(  # noqa: E731
        a, b, c, return_residual=True, implementation=impl, **static, **arrays)
    return _out_lse_grads(fn, q, k, v, do)

  _check(jax.jit(run)(q, k, v, do, arrays), q, k, v, do, case.dtype, **kw)
