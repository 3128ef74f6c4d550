"""Numerical safety: keys and values that no query attends may hold NaN or inf.

Top-left causal with ``T < S`` never attends keys ``j >= T``: the outputs and every gradient must stay
finite, equal the result computed with those rows zeroed, and their dK/dV rows must be exactly zero (no
``0 * NaN`` inside a matmul, no padded query row meeting them). ``flash_attention`` drops those keys
before the kernels of either backend, so the kernels never read them.

On CPU the Triton kernels run in Pallas interpret mode; ``gpu``-marked tests run both backends compiled
(``pytest -m gpu``; the Mosaic ones need a Hopper GPU).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fa2_jax.kernels import platform
import fa2_jax

from fa2_jax.kernels.sm90.config import MosaicConfig

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

def _run(q, k, v, do, *, scale, causal, implementation, block_sizes=None, deterministic=False):
  """out, lse [B, T, N], dq, dk, dv through fa2_jax.flash_attention, jitted."""
  return _jitted_run(scale, causal, implementation, block_sizes, deterministic)(q, k, v, do)


@functools.lru_cache(maxsize=None)
def _jitted_run(scale, causal, implementation, block_sizes, deterministic):
  """One jit per setting: the poisoned and clean inputs of a shape share its compilation. The
  traced program is kept for the process: only for calls under the default global settings (no
  ``fa2_jax.reuse_kernels_across_programs``, no monkeypatching), which jit's key does not see."""
  interpret = True if implementation == "triton" and not platform.on_gpu() else None

  def f(q, k, v):
    return fa2_jax.flash_attention(q, k, v, scale=scale, is_causal=causal,
                                   implementation=implementation, return_residual=True,
                                   block_sizes=block_sizes, interpret=interpret,
                                   deterministic=deterministic)

  @jax.jit
  def run(q, k, v, do):
    (out, lse), vjp = jax.vjp(f, q, k, v)
    return (out, lse, *vjp((do, jnp.zeros_like(lse))))

  return run


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
  got = _run(q, k, v, do, scale=0.25, causal=True, implementation="triton", block_sizes=blocks)
  _check_unattended(got, q, k0, v0, do, t, scale=0.25, tol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [None, MosaicConfig.default(64).replace(dq_fused=True, dq_fused_min_t=0,
                                                                           num_stages_dkv=2)],
                         ids=["dq-kernel", "fused-dq"])
def test_unattended_nonfinite_keys_mosaic(cfg):
  """Causal, T = 72 < S = 200 (ragged query tile), K rows >= T NaN and V rows inf, with the separate
  dQ kernel and with the fused dQ (whose dS K product reads every key of the tile)."""
  if not platform.is_hopper():
    pytest.skip("the Mosaic kernels run on Hopper (sm90) only")
  t = 72
  q, k, v, do, k0, v0 = _poisoned(1, t, 200, 2, 1, 64, BF16, jnp.nan, jnp.inf)
  got = _run(q, k, v, do, scale=0.125, causal=True, implementation="mosaic", block_sizes=cfg,
             deterministic=cfg is None)
  _check_unattended(got, q, k0, v0, do, t, scale=0.125, tol=2e-2)


@pytest.mark.parametrize("implementation", ["triton", "xla"])
def test_unattended_rows_change_no_bit(implementation):
  """Whatever the unattended rows hold, every result is bit-identical to the call with them zeroed."""
  q, k, v, do, k0, v0 = _poisoned(1, 20, 45, 2, 1, 16, F32, 3.0, -7.0, seed=1)
  a = _run(q, k, v, do, scale=0.25, causal=True, implementation=implementation)
  b = _run(q, k0, v0, do, scale=0.25, causal=True, implementation=implementation)
  for name, x, y in zip(("out", "lse", "dq"), a[:3], b[:3]):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)
  for name, x, y in zip(("dk", "dv"), a[3:], b[3:]):
    np.testing.assert_array_equal(np.asarray(x)[:, :20], np.asarray(y)[:, :20], err_msg=name)
    assert not np.asarray(x)[:, 20:].any(), name


def _low_logit_inputs(s, dtype):
  """Every logit strongly negative (q = 1, keys in [-1, -0.9]; at scale 2 the row maxima are about
  -330 in base 2, inside the backward's fast form), S = ``s`` keys, T = 128, head_dim 128."""
  q = jnp.ones((1, 128, 1, 128), jnp.float32)
  k = jax.random.uniform(jax.random.key(0), (1, s, 1, 128), minval=-1.0, maxval=-0.9)
  v = jax.random.normal(jax.random.key(1), k.shape)
  do = jax.random.normal(jax.random.key(2), q.shape)
  return tuple(x.astype(dtype) for x in (q, k, v, do))


# a ragged key extent (zero-filled keys past S: the defect), whole tiles (slow: CI time)
@pytest.mark.parametrize("s", [200, pytest.param(256, marks=pytest.mark.slow)])
def test_fused_dq_ragged_keys_low_logits_mosaic_emulated(s):
  """The fused dQ reads dS^T of every key of the last key tile, the zero-filled ones past S too; with
  rows whose logits are all very negative the fast form's P is huge there, and its dS times the zero
  rows of K must not make dQ NaN (it did: every dQ element at S = 200)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from fa2_jax.kernels.sm90.backward import backward
  from fa2_jax.kernels.sm90.forward import forward
  from fa2_jax.kernels.sm90.ops import emulated_mma

  q, k, v, do = _low_logit_inputs(s, BF16)
  cfg = MosaicConfig.default(128, BF16, False).replace(dq_fused=True, dq_fused_min_t=0)
  assert cfg.fuses_dq(128, deterministic=False)

  def run(q, k, v, do, fused):
    out, stats = forward(q, k, v, scale=2.0, is_causal=False)
    return backward(q, k, v, out, stats, do, scale=2.0, is_causal=False, config=cfg,
                    deterministic=not fused)

  with emulated_mma(), plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
    fused = jax.jit(run, static_argnums=4)(q, k, v, do, True)
    separate = jax.jit(run, static_argnums=4)(q, k, v, do, False)  # masks the key tail itself
  _check_low_logit_grads(fused, separate, q, k, v, do)


def _check_low_logit_grads(grads, separate, q, k, v, do):
  """Finite; dQ as the separate dQ kernel has it (the same products summed in another order); dK and
  dV within twice the XLA formula's error in the same dtype. dQ is not held to that here: with keys
  this alike, dQ = scale * sum_j dS_ij K_j cancels a large common part, and Δ = rowsum(dO ∘ O), from
  the output rounded to bfloat16 (as in FlashAttention-2/3), leaves about 25 times the formula's
  error in both dQ paths; float64 arithmetic with that Δ alone gives 15 times (docs/design.md,
  "Numerics contract")."""
  f32 = [x.astype(F32) for x in (q, k, v)]

  def vjp(fn, q, k, v, do):  # jitted: one compile (eagerly: one per op)
    return jax.jit(lambda q, k, v, do: jax.vjp(fn, q, k, v)[1](do))(q, k, v, do)

  ref = vjp(lambda q, k, v: fa2_jax.reference_attention(q, k, v, scale=2.0), *f32, do.astype(F32))
  xla = vjp(lambda q, k, v: fa2_jax.flash_attention(q, k, v, scale=2.0, implementation="xla"),
            q, k, v, do)
  for i, name in enumerate(("dq", "dk", "dv")):
    g, r = _f64(grads[i]), np.asarray(ref[i], np.float64)
    assert np.isfinite(g).all(), name
    if name == "dq":
      other = _f64(separate[i])
      assert np.abs(g - other).max() <= 1e-2 * np.abs(other).max(), np.abs(g - other).max()
    else:
      bound = 2 * np.abs(_f64(xla[i]) - r).max() + 1e-6 * np.abs(r).max()
      assert np.abs(g - r).max() <= bound, (name, np.abs(g - r).max(), bound)


@pytest.mark.gpu
def test_fused_dq_ragged_keys_low_logits_compiled():
  """The same, compiled, through the public API's default (fused dQ from 2k query rows)."""
  if not platform.is_hopper():
    pytest.skip("the Mosaic kernels run on Hopper (sm90) only")
  q = jnp.ones((1, 2048, 2, 128), BF16)
  k = jax.random.uniform(jax.random.key(0), (1, 2000, 2, 128), minval=-1.0, maxval=-0.9).astype(BF16)
  v = jax.random.normal(jax.random.key(1), k.shape).astype(BF16)
  do = jax.random.normal(jax.random.key(2), q.shape).astype(BF16)
  assert MosaicConfig.default(128, BF16, False).fuses_dq(2048, deterministic=False)
  grads = {}
  for deterministic in (False, True):
    _, vjp = jax.vjp(lambda q, k, v: fa2_jax.flash_attention(
        q, k, v, scale=2.0, implementation="mosaic", deterministic=deterministic), q, k, v)
    grads[deterministic] = vjp(do)
  _check_low_logit_grads(grads[False], grads[True], q, k, v, do)
