"""Numerical safety of the attention kernels of both backends (Triton and Mosaic GPU).

1. Keys/values that no query attends may hold NaN or inf. Top-left causal with ``T < S`` never attends
   keys ``j >= T``: the outputs and every gradient must stay finite, equal the result computed with those
   rows zeroed, and their dK/dV rows must be exactly zero (no ``0 * NaN`` inside a matmul, no padded
   query row meeting them).
2. The online softmax is exact-safe for any finite logits: extreme scales (1e9, -1e9, 2^30, 1e30 on small
   logits, 0, 1e-35) and logits near the float32 maximum give finite outputs, lse and gradients that
   match a float64 reference. The data keep every logit exact in float32 (integers or a single nonzero
   feature), so the float64 reference is the exact answer and the kernels must reproduce it: the
   softmax is one-hot at these scales and a rounding error of the row maximum times ``scale`` would
   overflow (the bug these tests pin: NaN outputs and lse = inf before the fix).

On CPU the Triton kernels run in Pallas interpret mode (through ``fa2_jax.flash_attention``) and the
Mosaic kernels in Pallas GPU interpret mode with emulated wgmma (``kernels.mosaic.ops.emulated_mma``,
kernel entry points). ``gpu``-marked tests run the same checks compiled (``pytest -m gpu``; the Mosaic
ones need a Hopper GPU), and the sm90 / Hopper lowering tests run anywhere.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import fa2_jax
from fa2_jax import dispatch
from fa2_jax.kernels.mosaic.config import MosaicConfig

BF16 = jnp.bfloat16
F32 = jnp.float32


def _f64(x):
  return np.asarray(jnp.asarray(x, F32), np.float64)


def _reference(q, k, v, do, *, scale, causal):
  """float64 out, lse ``[B, T, N]``, dq, dk, dv of the formula (numpy arrays)."""
  with jax.enable_x64(True):
    def f(q, k, v):
      return fa2_jax.reference_attention(q, k, v, scale=scale, is_causal=causal, return_residual=True)

    (out, lse), vjp = jax.vjp(f, *(jnp.asarray(_f64(x)) for x in (q, k, v)))
    grads = vjp((jnp.asarray(_f64(do)), jnp.zeros_like(lse)))
    return [np.asarray(x) for x in (out, lse, *grads)]


def _check(got, ref, *, tol, lse_rtol=1e-6, names=("out", "lse", "dq", "dk", "dv")):
  """Every result finite and within ``tol`` of the float64 reference (relative to the largest
  reference entry of that result, at least 1)."""
  for name, x, r in zip(names, got, ref):
    xa = _f64(x)
    assert xa.shape == r.shape, (name, xa.shape, r.shape)
    assert np.isfinite(xa).all(), (name, xa)
    if name == "lse":
      np.testing.assert_allclose(xa, r, rtol=lse_rtol, atol=1e-5, err_msg=name)
    else:
      atol = tol * max(1.0, float(np.abs(r).max(initial=0.0)))
      np.testing.assert_allclose(xa, r, rtol=0, atol=atol, err_msg=name)


# --- the two backends ------------------------------------------------------------------------------

def _triton(q, k, v, do, *, scale, causal, blocks=None):
  """out, lse [B, T, N], dq, dk, dv through fa2_jax.flash_attention's Triton kernels."""
  interpret = not dispatch.on_gpu()

  def f(q, k, v):
    return fa2_jax.flash_attention(q, k, v, scale=scale, is_causal=causal, implementation="triton",
                                   return_residual=True, block_sizes=blocks, interpret=interpret)

  (out, lse), vjp = jax.vjp(f, q, k, v)
  return (out, lse, *vjp((do, jnp.zeros_like(lse))))


def _mosaic(q, k, v, do, *, scale, causal, cfg=None, exact_lse=False):
  """out, lse [B, T, N], dq, dk, dv of the Mosaic kernels: compiled through
  fa2_jax.flash_attention on a Hopper GPU, in GPU interpret mode with emulated wgmma on CPU.

  ``exact_lse``: hand the backward the forward's raw-unit lse (``return_lse_raw``) instead of letting
  it derive that from the natural-log lse (kernel entry points, both platforms).
  """
  from fa2_jax.kernels.mosaic.backward import backward
  from fa2_jax.kernels.mosaic.forward import forward
  deterministic = not (cfg is not None and cfg.dq_fused)
  if dispatch.on_gpu() and not exact_lse:
    def f(q, k, v):
      return fa2_jax.flash_attention(q, k, v, scale=scale, is_causal=causal, implementation="mosaic",
                                     return_residual=True, block_sizes=cfg,
                                     deterministic=deterministic)

    (out, lse), vjp = jax.vjp(f, q, k, v)
    return (out, lse, *vjp((do, jnp.zeros_like(lse))))

  def f(q, k, v, do):
    out, lse, lse_raw = forward(q, k, v, scale=scale, is_causal=causal, config=cfg,
                                return_lse_raw=True)
    grads = backward(q, k, v, out, lse, do, scale=scale, is_causal=causal, config=cfg,
                     deterministic=deterministic, lse_raw=lse_raw if exact_lse else None)
    return (out, jnp.swapaxes(lse, 1, 2), *grads)

  if dispatch.on_gpu():
    return jax.jit(f)(q, k, v, do)
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from fa2_jax.kernels.mosaic.ops import emulated_mma
  with emulated_mma(), plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
    return jax.block_until_ready(jax.jit(f)(q, k, v, do))


def _needs_hopper():
  if dispatch.on_gpu() and not dispatch.is_hopper():
    pytest.skip("the Mosaic kernels run on Hopper (sm90) only")


# --- 1. non-finite keys/values that no query attends --------------------------------------------------

def _poisoned(b, t, s, n, kh, h, dtype, k_bad, v_bad, seed=0):
  """Random q/k/v/do with key and value rows ``j >= t`` set to ``k_bad`` / ``v_bad`` (None: left
  finite), and the same k/v with those rows zeroed (what the result must equal)."""
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (b, t, n, h), F32).astype(dtype)
  k = jax.random.normal(ks[1], (b, s, kh, h), F32).astype(dtype)
  v = jax.random.normal(ks[2], (b, s, kh, h), F32).astype(dtype)
  do = jax.random.normal(ks[3], (b, t, n, h), F32).astype(dtype)
  k0, v0 = k.at[:, t:].set(0), v.at[:, t:].set(0)
  if k_bad is not None:
    k = k.at[:, t:].set(k_bad)
  if v_bad is not None:
    v = v.at[:, t:].set(v_bad)
  return q, k, v, do, k0, v0


BAD = [  # (key rows, value rows) past T
    (jnp.nan, jnp.nan),
    (jnp.inf, -jnp.inf),
    (jnp.nan, None),
    (None, jnp.inf),
]


def _check_unattended(got, q, k0, v0, do, t, *, scale, tol):
  ref = _reference(q, k0, v0, do, scale=scale, causal=True)
  _check(got, ref, tol=tol, lse_rtol=1e-5)
  dk, dv = _f64(got[3]), _f64(got[4])
  assert not dk[:, t:].any() and not dv[:, t:].any(), "unattended keys must get exactly zero dK/dV"


@pytest.mark.parametrize("k_bad,v_bad", BAD, ids=lambda x: str(x))
@pytest.mark.parametrize("t,s", [(20, 45), (32, 45)])  # T ragged / T a whole number of key blocks
def test_unattended_nonfinite_keys_triton(t, s, k_bad, v_bad):
  """Causal, T < S, GQA 2:1, 16-row tiles (the last query tile has padded rows, the key blocks
  straddle T); K/V rows >= T hold NaN/inf."""
  q, k, v, do, k0, v0 = _poisoned(1, t, s, 2, 1, 16, F32, k_bad, v_bad)
  blocks = fa2_jax.BlockSizes(block_q=16, block_k=16, block_q_dkv=16, block_k_dkv=16,
                              block_q_dq=16, block_k_dq=16)
  got = _triton(q, k, v, do, scale=0.25, causal=True, blocks=blocks)
  _check_unattended(got, q, k0, v0, do, t, scale=0.25, tol=1e-5)


@pytest.mark.parametrize("cfg", [None, MosaicConfig.default(64).replace(dq_fused=True,
                                                                           num_stages_dkv=2)],
                         ids=["dq-kernel", "fused-dq"])
def test_unattended_nonfinite_keys_mosaic(cfg):
  """Causal, T = 72 < S = 200 (ragged query tile, TMA bounds), K rows >= T NaN and V rows inf, with
  the separate dQ kernel and with the fused dQ (whose dS K product reads every key of the tile)."""
  _needs_hopper()
  t = 72
  q, k, v, do, k0, v0 = _poisoned(1, t, 200, 2, 1, 64, BF16, jnp.nan, jnp.inf)
  got = _mosaic(q, k, v, do, scale=0.125, causal=True, cfg=cfg)
  _check_unattended(got, q, k0, v0, do, t, scale=0.125, tol=2e-2)


@pytest.mark.parametrize("backend", ["triton", "mosaic"])
def test_unattended_rows_change_no_bit(backend):
  """Finite data: what the unattended key/value rows hold changes no bit of any result (the kernels
  never read them), and those rows' dK/dV are exact zeros."""
  if backend == "mosaic":
    _needs_hopper()
  t, s, dtype = (20, 45, F32) if backend == "triton" else (72, 200, BF16)
  h = 16 if backend == "triton" else 64
  q, k, v, do, k0, v0 = _poisoned(1, t, s, 2, 1, h, dtype, None, None, seed=6)
  ks = jax.random.split(jax.random.key(7), 2)
  k1 = k.at[:, t:].set(1e4 * jax.random.normal(ks[0], k[:, t:].shape, F32).astype(dtype))
  v1 = v.at[:, t:].set(-1e4 * jax.random.normal(ks[1], v[:, t:].shape, F32).astype(dtype))
  if backend == "triton":
    blocks = fa2_jax.BlockSizes(block_q=16, block_k=16, block_q_dkv=16, block_k_dkv=16,
                                block_q_dq=16, block_k_dq=16)
    run = lambda k, v: _triton(q, k, v, do, scale=0.25, causal=True, blocks=blocks)
  else:
    run = lambda k, v: _mosaic(q, k, v, do, scale=0.125, causal=True)
  for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), run(k, v), run(k1, v1)):
    np.testing.assert_array_equal(_f64(a), _f64(b), err_msg=name)
    if name in ("dk", "dv"):
      assert not _f64(a)[:, t:].any(), name


# --- 2. extreme scales and logits --------------------------------------------------------------------

def _two_keys(key0, key1, h, dtype):
  """q = e_0 (one query), keys key0 * e_0 and key1 * e_0, values 5 + j/4 and 7 - j/4 (feature j),
  dO = 1.5: raw logits exactly key0 and key1, and every dot product exact, in any float32 arithmetic
  (so dP - delta is exactly 0 for a one-hot row and the scale-amplified dQ/dK are exactly 0)."""
  e0 = jnp.zeros((h,), F32).at[0].set(1.0)
  ramp = 0.25 * jnp.arange(h, dtype=F32)
  q = e0.reshape(1, 1, 1, h)
  k = jnp.stack([key0 * e0, key1 * e0]).reshape(1, 2, 1, h)
  v = jnp.stack([5.0 + ramp, 7.0 - ramp]).reshape(1, 2, 1, h)
  do = jnp.full((1, 1, 1, h), 1.5, F32)
  return tuple(x.astype(dtype) for x in (q, k, v, do))


TWO_KEYS = [  # (scale, key0, key1): the one-hot (or uniform) softmax of a single query
    (1e9, 3.0, 1.0),  # scaled logits 3e9, 1e9: out = v0, lse = 3e9 (was NaN / inf)
    (-1e9, 3.0, 1.0),  # negative scale: out = v1, lse = -1e9
    (1e30, 2.0 ** -65, 2.0 ** -66),  # huge scale on tiny logits: scaled 2.7e10, 1.4e10
    (1.0, 3e38, -3e38),  # logits near the float32 maximum: s * log2(e) overflows float32
    (0.0, 3.0, 1.0),  # scale 0: uniform weights, lse = log 2
    (1e-35, 1e36, -1e36),  # tiny scale (the kernels then scale the logits first): +-10
]


@pytest.mark.parametrize("h,dtype", [(1, F32), (16, BF16)], ids=["h1-f32", "h16-bf16"])
@pytest.mark.parametrize("scale,key0,key1", TWO_KEYS, ids=lambda x: f"{x:g}")
def test_extreme_two_keys_triton(scale, key0, key1, h, dtype):
  if dtype == BF16 and abs(key0) > 1e38:
    key0 = float(jnp.asarray(key0, BF16))  # the nearest bfloat16
  q, k, v, do = _two_keys(key0, key1, h, dtype)
  got = _triton(q, k, v, do, scale=scale, causal=False)
  _check(got, _reference(q, k, v, do, scale=scale, causal=False), tol=1e-5 if dtype == F32 else 1e-2)


def _distinct_logits(b, t, s, n, kh, h, dtype, seed):
  """Logits q_i . k_j = sign_i * key_j with keys distinct per (batch, KV head), drawn from the 2048
  bfloat16 numbers of magnitude in [1, 256): each row's maximum is unique, so at extreme scales the
  softmax is one-hot. The other feature columns of q are random, those of k zero, and v, dO are
  multiples of 1/4 in [-1, 1]: every logit and every dot product is exact in any float32 order, so
  dP - delta is exactly 0 on one-hot rows (dQ and dK, which the scale multiplies, are exactly 0)."""
  assert s <= 2048
  mant = 1.0 + np.arange(128) / 128.0  # the 128 bfloat16 mantissas of one binade
  pool = np.concatenate([mant * 2.0 ** e for e in range(8)])
  pool = np.concatenate([pool, -pool])
  rng = np.random.default_rng(seed)
  keys = np.stack([np.stack([rng.permutation(pool)[:s] for _ in range(kh)], axis=-1)
                   for _ in range(b)])  # [b, s, kh]
  ks = jax.random.split(jax.random.key(seed), 4)
  sign = jnp.where(jax.random.bernoulli(ks[0], 0.5, (b, t, n)), 1.0, -1.0)
  q = jax.random.normal(ks[1], (b, t, n, h), F32).at[..., 0].set(sign)
  k = jnp.zeros((b, s, kh, h), F32).at[..., 0].set(jnp.asarray(keys, F32))
  v = jax.random.randint(ks[2], (b, s, kh, h), -4, 5).astype(F32) / 4
  do = jax.random.randint(ks[3], (b, t, n, h), -4, 5).astype(F32) / 4
  return tuple(x.astype(dtype) for x in (q, k, v, do))


@pytest.mark.parametrize("scale", [2.0 ** 30, -(2.0 ** 30)])
@pytest.mark.parametrize("causal", [True, False])
def test_extreme_scale_many_blocks_triton(scale, causal):
  """Several key blocks per row (the running maximum moves between blocks, alpha rescales), ragged
  T and S, GQA: one-hot rows with out = the chosen value row and zero dQ/dK."""
  q, k, v, do = _distinct_logits(1, 40, 37, 2, 1, 16, F32, seed=1)
  blocks = fa2_jax.BlockSizes(block_q=16, block_k=16, block_q_dkv=16, block_k_dkv=16,
                              block_q_dq=16, block_k_dq=16)
  got = _triton(q, k, v, do, scale=scale, causal=causal, blocks=blocks)
  _check(got, _reference(q, k, v, do, scale=scale, causal=causal), tol=1e-6)


@pytest.mark.parametrize("scale", [-0.3, 0.0])
def test_nonpositive_scale_random_triton(scale):
  """scale <= 0 on random data (a running minimum of the raw logits for scale < 0, uniform weights for
  0): same numbers as the float64 formula."""
  ks = jax.random.split(jax.random.key(2), 4)
  q, k, v, do = (jax.random.normal(kk, shape, F32) for kk, shape in zip(
      ks, [(1, 40, 2, 16), (1, 37, 1, 16), (1, 37, 1, 16), (1, 40, 2, 16)]))
  blocks = fa2_jax.BlockSizes(block_q=16, block_k=16, block_q_dkv=16, block_k_dkv=16,
                              block_q_dq=16, block_k_dq=16)
  got = _triton(q, k, v, do, scale=scale, causal=True, blocks=blocks)
  _check(got, _reference(q, k, v, do, scale=scale, causal=True), tol=1e-5, lse_rtol=1e-5)


def test_exact_lse_roundtrip_triton():
  """``forward(..., return_lse_raw=True)`` hands the backward the row statistic it compares logits
  against, exactly: with max logit 1.125 and scale 1e9 the natural-log lse 1.125e9 does not divide
  back to 1.125 in float32 (1.125 has no float32 preimage under x -> x * 1e9), so only this path gives
  P = 1 for the maximum in the backward."""
  from fa2_jax.kernels.triton.backward import backward
  from fa2_jax.kernels.triton.forward import forward
  scale = 1e9
  assert np.float32(np.float32(1.125 * scale) / np.float32(scale)) != np.float32(1.125)
  q, k, v, do = _two_keys(1.125, 0.125, 16, F32)
  launch = dict(block_q=16, block_k=16, num_warps=4, num_stages=1,
                interpret=not dispatch.on_gpu())
  out, lse, lse_raw = forward(q, k, v, scale=scale, is_causal=False, return_lse_raw=True, **launch)
  np.testing.assert_array_equal(np.asarray(lse_raw), 1.125)
  grads = backward(q, k, v, out, lse, do, lse_raw=lse_raw, scale=scale, is_causal=False,
                   block_q_dkv=16, block_k_dkv=16, block_q_dq=16, block_k_dq=16,
                   num_warps=launch["num_warps"], num_stages=launch["num_stages"],
                   interpret=launch["interpret"])
  ref = _reference(q, k, v, do, scale=scale, causal=False)
  _check((out, jnp.swapaxes(lse, 1, 2), *grads), ref, tol=1e-6)


MOSAIC_TWO_KEYS = TWO_KEYS[:5]


@pytest.mark.parametrize("scale,key0,key1", MOSAIC_TWO_KEYS, ids=lambda x: f"{x:g}")
def test_extreme_two_keys_mosaic(scale, key0, key1):
  _needs_hopper()
  key0 = float(jnp.asarray(key0, BF16))
  q, k, v, do = _two_keys(key0, key1, 64, BF16)
  got = _mosaic(q, k, v, do, scale=scale, causal=False)
  _check(got, _reference(q, k, v, do, scale=scale, causal=False), tol=1e-2)


@pytest.mark.parametrize("scale,causal,cfg", [
    (2.0 ** 30, True, None),
    (-(2.0 ** 30), False, MosaicConfig.default(64).replace(dq_fused=True, num_stages_dkv=2)),
], ids=["pos-causal", "neg-fused-dq"])
def test_extreme_scale_many_blocks_mosaic(scale, causal, cfg):
  """136 keys over 64-row key tiles in the backward, 72 query rows (ragged): one-hot rows."""
  _needs_hopper()
  q, k, v, do = _distinct_logits(1, 72, 136, 2, 1, 64, BF16, seed=3)
  got = _mosaic(q, k, v, do, scale=scale, causal=causal, cfg=cfg)
  _check(got, _reference(q, k, v, do, scale=scale, causal=causal), tol=1e-2)


def test_nonpositive_scale_random_mosaic():
  """scale < 0 on random data, causal, ragged: the running minimum and its masks, with the f64
  formula."""
  _needs_hopper()
  ks = jax.random.split(jax.random.key(4), 4)
  q, k, v, do = (jax.random.normal(kk, shape, F32).astype(BF16) for kk, shape in zip(
      ks, [(1, 72, 2, 64), (1, 136, 1, 64), (1, 136, 1, 64), (1, 72, 2, 64)]))
  got = _mosaic(q, k, v, do, scale=-0.125, causal=True)
  _check(got, _reference(q, k, v, do, scale=-0.125, causal=True), tol=2e-2, lse_rtol=1e-3)


def test_exact_lse_roundtrip_mosaic():
  """The Mosaic kernels' exact lse path (see test_exact_lse_roundtrip_triton)."""
  _needs_hopper()
  q, k, v, do = _two_keys(1.125, 0.125, 64, BF16)
  got = _mosaic(q, k, v, do, scale=1e9, causal=False, exact_lse=True)
  _check(got, _reference(q, k, v, do, scale=1e9, causal=False), tol=1e-2)


# --- lowering (no GPU needed) ------------------------------------------------------------------------

LOWER_SCALES = [1e9, -1e9, 0.0]


@pytest.mark.parametrize("scale", LOWER_SCALES, ids=lambda x: f"{x:g}")
def test_mosaic_lowers_for_sm90(scale):
  """Forward + backward of the three softmax forms (running maximum, running minimum, scaled logits)
  with unattended keys (causal, T < S) lower through Mosaic GPU for sm90."""
  from fa2_jax.kernels.mosaic.backward import backward
  from fa2_jax.kernels.mosaic.forward import forward
  sd = jax.ShapeDtypeStruct
  b, t, s, n, kh, h = 1, 200, 333, 4, 2, 128

  def f(q, k, v, do):
    out, lse, lse_raw = forward(q, k, v, scale=scale, is_causal=True, return_lse_raw=True)
    return (out, lse) + tuple(backward(q, k, v, out, lse, do, scale=scale, is_causal=True,
                                       lse_raw=lse_raw))

  qs, kvs = sd((b, t, n, h), BF16), sd((b, s, kh, h), BF16)
  lowered = jax.jit(f).trace(qs, kvs, kvs, qs).lower(lowering_platforms=("cuda",))
  assert lowered.as_text().count("stablehlo.custom_call @mosaic_gpu") == 3
  assert [o.shape for o in lowered.out_info] == [(b, t, n, h), (b, n, t), (b, t, n, h),
                                                 (b, s, kh, h), (b, s, kh, h)]


@pytest.mark.parametrize("scale", LOWER_SCALES, ids=lambda x: f"{x:g}")
def test_triton_lowers_for_hopper(scale, monkeypatch):
  """The same for the Triton kernels (jax.export for "cuda" with an H200's GPU description)."""
  gpu_info = pytest.importorskip("jax._src.pallas.triton.gpu_info")
  registration = pytest.importorskip("jax._src.pallas.triton.pallas_call_registration")
  monkeypatch.setattr(registration.gpu_info_lib, "get_gpu_info",
                      lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))
  monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
  sd = jax.ShapeDtypeStruct
  q, kv = sd((1, 200, 4, 64), BF16), sd((1, 333, 2, 64), BF16)

  def loss(q, k, v):
    o = fa2_jax.flash_attention(q, k, v, scale=scale, is_causal=True, implementation="triton")
    return o.astype(F32).sum()

  exp = export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=["cuda"],
                      disabled_checks=[export.DisabledSafetyCheck.custom_call(
                          "__gpu$xla.gpu.triton")])(q, kv, kv)
  assert exp.mlir_module().count("__gpu$xla.gpu.triton") >= 3


# --- compiled on a GPU -------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "mosaic"])
@pytest.mark.parametrize("scale", [2.0 ** 30, -(2.0 ** 30), 0.0, 0.125], ids=lambda x: f"{x:g}")
def test_gpu_extreme_scale_and_unattended_keys(backend, scale):
  """Compiled kernels at a realistic size: causal, T = 1000 < S = 1500 with K/V rows >= T NaN/inf,
  distinct exact logits (one-hot rows at +-2^30, uniform at 0, soft at 0.125); bf16, head_dim 128,
  GQA 4:2."""
  if backend == "mosaic":
    _needs_hopper()
  t, s = 1000, 1500
  q, k, v, do = _distinct_logits(2, t, s, 4, 2, 128, BF16, seed=5)
  k0, v0 = k.at[:, t:].set(0), v.at[:, t:].set(0)
  k = k.at[:, t:].set(jnp.nan)
  v = v.at[:, t:].set(jnp.inf)
  run = _triton if backend == "triton" else _mosaic
  got = run(q, k, v, do, scale=scale, causal=True)
  _check(got, _reference(q, k0, v0, do, scale=scale, causal=True), tol=2e-2, lse_rtol=1e-5)
  assert not _f64(got[3])[:, t:].any() and not _f64(got[4])[:, t:].any()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "mosaic"])
@pytest.mark.parametrize("scale,key0,key1", TWO_KEYS, ids=lambda x: f"{x:g}")
def test_gpu_extreme_two_keys(backend, scale, key0, key1):
  """The two-key extreme cases compiled, bf16, head_dim 64."""
  if backend == "mosaic":
    _needs_hopper()
  key0 = float(jnp.asarray(key0, BF16))
  q, k, v, do = _two_keys(key0, key1, 64, BF16)
  run = _triton if backend == "triton" else _mosaic
  got = run(q, k, v, do, scale=scale, causal=False)
  _check(got, _reference(q, k, v, do, scale=scale, causal=False), tol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "mosaic"])
def test_gpu_exact_lse_path(backend):
  """The kernels' raw-unit lse path compiled (forward(..., return_lse_raw=True) -> backward)."""
  q, k, v, do = _two_keys(1.125, 0.125, 64, BF16)
  ref = _reference(q, k, v, do, scale=1e9, causal=False)
  if backend == "mosaic":
    _needs_hopper()
    got = _mosaic(q, k, v, do, scale=1e9, causal=False, exact_lse=True)
  else:
    from fa2_jax.kernels.triton.backward import backward
    from fa2_jax.kernels.triton.forward import forward
    out, lse, lse_raw = forward(q, k, v, scale=1e9, is_causal=False, block_q=16, block_k=16,
                                num_warps=4, num_stages=1, interpret=False, return_lse_raw=True)
    grads = backward(q, k, v, out, lse, do, lse_raw=lse_raw, scale=1e9, is_causal=False,
                     block_q_dkv=16, block_k_dkv=16, block_q_dq=16, block_k_dq=16, num_warps=4,
                     num_stages=1, interpret=False)
    got = (out, jnp.swapaxes(lse, 1, 2), *grads)
  _check(got, ref, tol=1e-2)
