"""Inputs and transforms at the edges of the API: x64 mode, empty and symbolic shapes, derivatives the
kernels do not have, and validation of every public entry point.

Each test here failed (a crash or a bare error from inside JAX/Pallas) before the behaviour it checks
was built in. Kernels run in Pallas interpret mode on CPU and compiled on a GPU.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import fa2_jax
from fa2_jax.kernels import platform

from conftest import on_gpu

KERNEL = dict(implementation="triton", interpret=None if on_gpu() else True)


def _qkv(b=1, t=20, s=20, n=2, kh=1, h=16, dtype=jnp.float32, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(ks[0], (b, t, n, h), dtype),
          jax.random.normal(ks[1], (b, s, kh, h), dtype),
          jax.random.normal(ks[2], (b, s, kh, h), dtype))


# --- x64 ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_jit_with_x64_enabled(causal):
  """jit lowers an interpret-mode kernel while x64 is on: its index types must stay consistent."""
  q, k, v = _qkv(t=20, s=37, n=4, kh=2)
  f = lambda q, k, v: fa2_jax.flash_attention(q, k, v, is_causal=causal, **KERNEL)
  loss = lambda q, k, v: f(q, k, v).sum()
  want_out = f(q, k, v)
  want_grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  with jax.enable_x64(True):
    out = jax.jit(f)(q, k, v)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(out, want_out, atol=1e-6)
  for a, b in zip(grads, want_grads):
    np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("impl", ["triton", "mosaic"])
def test_kernels_lower_for_cuda_with_x64_enabled(impl, monkeypatch):
  """The compiled (not interpreted) kernels lower under x64 too (checked for sm90 on any machine)."""
  monkeypatch.setattr(platform, "on_gpu", lambda: True)
  monkeypatch.setattr(platform, "gpu_compute_capability", lambda: (9, 0))
  if impl == "triton":
    gpu_info = pytest.importorskip("jax._src.pallas.triton.gpu_info")
    registration = pytest.importorskip("jax._src.pallas.triton.pallas_call_registration")
    monkeypatch.setattr(registration.gpu_info_lib, "get_gpu_info",
                        lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))
  dt = jnp.bfloat16
  q = jax.ShapeDtypeStruct((1, 200, 4, 64), dt)
  kv = jax.ShapeDtypeStruct((1, 300, 2, 64), dt)
  loss = lambda q, k, v: fa2_jax.flash_attention(q, k, v, is_causal=True,
                                                 implementation=impl).astype(jnp.float32).sum()
  with jax.enable_x64(True):
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(
        lowering_platforms=("cuda",)).as_text()
  assert ("triton" in text) if impl == "triton" else ("mosaic_gpu" in text)


# --- empty shapes -----------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", [None, "triton", "xla"])
@pytest.mark.parametrize("q_shape, k_shape", [
    ((0, 16, 2, 16), (0, 16, 2, 16)),  # B = 0
    ((2, 0, 2, 16), (2, 5, 2, 16)),  # T = 0
    ((2, 3, 2, 16), (2, 0, 2, 16)),  # S = 0: every row has no key
    ((0, 16, 16), (0, 16, 16)),  # rank 3, T = 0
])
def test_empty_shapes_give_empty_outputs_and_zero_gradients(impl, q_shape, k_shape):
  kw = dict(implementation=impl, interpret=True if impl == "triton" and not on_gpu() else None)
  q = jnp.ones(q_shape, jnp.float32)
  k = jnp.ones(k_shape, jnp.float32)
  out, lse = fa2_jax.flash_attention(q, k, k, return_residual=True, **kw)
  assert out.shape == q.shape and lse.shape == q.shape[:-1]
  assert not jnp.any(out)  # zeros (S = 0) or empty
  assert bool(jnp.all(lse == -jnp.inf))  # vacuous when empty
  grads = jax.jit(jax.grad(lambda q, k, v: fa2_jax.flash_attention(q, k, v, **kw).sum(),
                           argnums=(0, 1, 2)))(q, k, k)
  for g, x in zip(grads, (q, k, k)):
    assert g.shape == x.shape and bool(jnp.all(g == 0))


# --- symbolic shapes (jax.export) ------------------------------------------------------------------

def test_export_with_symbolic_batch_and_length():
  b, t = export.symbolic_shape("b, t")
  spec = jax.ShapeDtypeStruct((b, t, 2, 16), jnp.float32)
  exp = export.export(jax.jit(lambda q: fa2_jax.flash_attention(q, q, q, is_causal=True)))(spec)
  q, _, _ = _qkv(b=2, t=5, s=5, n=2, kh=2)
  np.testing.assert_allclose(exp.call(q), fa2_jax.reference_attention(q, q, q, is_causal=True),
                             atol=1e-6)


def test_export_of_an_explicit_kernel_with_symbolic_length_names_the_limit():
  (t,) = export.symbolic_shape("t")
  spec = jax.ShapeDtypeStruct((1, t, 2, 16), jnp.float32)
  with pytest.raises(ValueError, match=r"implementation='triton' needs static shapes.*\['t'\]"):
    export.export(jax.jit(lambda q: fa2_jax.flash_attention(q, q, q, **KERNEL)))(spec)


# --- derivatives the kernels do not have -----------------------------------------------------------

def _loss(q):
  return fa2_jax.flash_attention(q, q, q, **KERNEL).sum()


@pytest.mark.parametrize("name, fn", [
    ("grad of grad", lambda q: jax.grad(lambda x: jax.grad(_loss)(x).sum())(q)),
    ("hessian", lambda q: jax.hessian(_loss)(q)),
    ("jvp of grad", lambda q: jax.jvp(jax.grad(_loss), (q,), (q,))),
])
def test_second_order_derivatives_name_the_limit(name, fn):
  q, _, _ = _qkv(t=4, s=4, n=1, h=2)
  with pytest.raises(TypeError, match="no second-order derivative.*implementation='xla'"):
    fn(q)


@pytest.mark.parametrize("fn", [lambda q: jax.jvp(_loss, (q,), (q,)), lambda q: jax.jacfwd(_loss)(q)])
def test_forward_mode_names_the_limit(fn):
  q, _, _ = _qkv(t=4, s=4, n=1, h=2)
  with pytest.raises(TypeError, match="reverse-mode autodiff only.*implementation='xla'"):
    fn(q)


def test_xla_implementation_has_higher_derivatives():
  """The documented workaround works: the formula differentiates to any order, and jacrev works
  through the kernels."""
  q, _, _ = _qkv(t=4, s=4, n=1, h=2)
  f = lambda q: fa2_jax.flash_attention(q, q, q, implementation="xla").sum()
  assert np.all(np.isfinite(jax.hessian(f)(q)))
  assert np.all(np.isfinite(jax.jvp(f, (q,), (q,))[1]))
  np.testing.assert_allclose(jax.jacrev(_loss)(q), jax.grad(f)(q), atol=1e-5)


# --- validation of the other entry points ----------------------------------------------------------

@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(query=jnp.ones((4, 2, 8))[0]), ValueError, "query must have rank 4"),
    (dict(key=jnp.ones((1, 4, 2))), ValueError, "key must have the same rank as query"),
    (dict(value=jnp.ones((1, 5, 2, 8))), ValueError, "key and value must have the same \\[B, S, K\\]"),
    (dict(scale=np.array(1 + 2j)), TypeError, "scale must be a real number"),
    (dict(scale=1j), TypeError, "scale must be a Python float"),
    (dict(scale=10 ** 400), ValueError, "scale must be finite, got a number too large"),
    (dict(is_causal=1), TypeError, "is_causal must be a Python bool"),
    (dict(query=[[1.0]]), TypeError, "query must be a jax/numpy array"),
    (dict(compute_dtype=jnp.int32), TypeError, "compute_dtype must be float16, bfloat16"),
    (dict(compute_dtype=bool), TypeError, "compute_dtype must be float16, bfloat16"),
    (dict(compute_dtype=jnp.complex64), TypeError, "compute_dtype must be float16, bfloat16"),
    (dict(compute_dtype="not a dtype"), TypeError, "compute_dtype must be a floating dtype"),
    (dict(compute_dtype=jnp.float64), ValueError, "compute_dtype float64 needs jax_enable_x64"),
])
def test_reference_attention_validates(kwargs, exc, match):
  args = dict(query=jnp.ones((1, 4, 2, 8)), key=jnp.ones((1, 4, 2, 8)), value=jnp.ones((1, 4, 2, 8)))
  args.update({k: v for k, v in kwargs.items() if k in args})
  kw = {k: v for k, v in kwargs.items() if k not in args}
  with pytest.raises(exc, match=match):
    fa2_jax.reference_attention(args["query"], args["key"], args["value"], **kw)


def test_reference_attention_rank3_matches_rank4():
  q, k, v = _qkv(t=6, s=7, n=2, kh=1)
  np.testing.assert_allclose(fa2_jax.reference_attention(q[0], k[0], v[0], is_causal=True),
                             fa2_jax.reference_attention(q, k, v, is_causal=True)[0], atol=0)


@pytest.mark.parametrize("scale", [np.array(1 + 2j), np.array([0.5]), 1j, "0.5", True,
                                   np.array(np.timedelta64(1, "s"))])
def test_flash_attention_scale_errors_name_scale(scale):
  q, k, v = _qkv(t=4, s=4)
  with pytest.raises(TypeError, match="scale"):
    fa2_jax.flash_attention(q, k, v, scale=scale)


def test_numpy_scalar_scale_is_accepted():
  q, k, v = _qkv(t=4, s=4)
  want = fa2_jax.flash_attention(q, k, v, scale=0.5)
  # 0-d arrays of any real dtype, bfloat16 included (numpy files it under kind 'V')
  for scale in (np.float32(0.5), jnp.array(0.5, jnp.bfloat16), jnp.array(0.5, jnp.float16)):
    np.testing.assert_allclose(fa2_jax.flash_attention(q, k, v, scale=scale), want, atol=0)
  np.testing.assert_allclose(
      fa2_jax.flash_attention(q, k, v, logits_soft_cap=jnp.array(30.0, jnp.bfloat16)),
      fa2_jax.flash_attention(q, k, v, logits_soft_cap=30.0), atol=0)


@pytest.mark.parametrize("head_dim, exc, match", [
    (0, ValueError, "head_dim must be a positive int"), (-1, ValueError, "head_dim must be a positive"),
    (2.5, TypeError, "head_dim must be an int, got float"), (64.0, TypeError, "head_dim must be an int"),
    (True, TypeError, "head_dim must be an int, got bool")])
def test_block_sizes_default_rejects_bad_head_dim(head_dim, exc, match):
  with pytest.raises(exc, match=match):
    fa2_jax.BlockSizes.default(head_dim)


@pytest.mark.parametrize("args, exc, match", [
    ((0,), ValueError, "head_dim: .*multiples of 16 up to 256"),
    ((1000,), ValueError, "head_dim: .*got 1000"), ((72,), ValueError, "got 72"),
    ((64.5,), TypeError, "head_dim must be an int, got float"),
    (("64",), TypeError, "head_dim must be an int, got str"),
    ((64, jnp.float32), TypeError, "dtype must be bfloat16 or float16 .*got float32"),
    ((64, None), TypeError, "dtype must be bfloat16 or float16 .*got None"),
    ((64, "int8"), TypeError, "dtype must be bfloat16 or float16 .*got int8")])
def test_mosaic_config_default_rejects_what_the_kernels_cannot_run(args, exc, match):
  with pytest.raises(exc, match=match):
    fa2_jax.MosaicConfig.default(*args)


@pytest.mark.parametrize("value_head_dim, exc, match", [
    (72, ValueError, "value_head_dim: .*multiples of 16 .*got 72"),
    (512, ValueError, "value_head_dim: .*up to 256"), (True, TypeError, "value_head_dim must be None or an int"),
    (128.0, TypeError, "value_head_dim must be None or an int, got float")])
def test_mosaic_config_default_rejects_a_value_head_dim_the_kernels_cannot_tile(value_head_dim, exc,
                                                                                match):
  with pytest.raises(exc, match=match):
    fa2_jax.MosaicConfig.default(192, value_head_dim=value_head_dim)
  # 192's settings, but the forward's 128-key tiles that 192/128 fits in SMEM
  assert fa2_jax.MosaicConfig.default(192, value_head_dim=128) == fa2_jax.MosaicConfig.default(
      192).replace(block_k=128, persistent=True, persistent_deal="greedy")


def test_config_defaults_take_numpy_ints_and_both_configs_replace():
  blocks = fa2_jax.BlockSizes.default(np.int64(64))
  assert blocks == fa2_jax.BlockSizes.default(64)
  assert blocks.replace(block_q=32).block_q == 32 and blocks.block_q != 32
  assert fa2_jax.MosaicConfig.default(np.int64(128)) == fa2_jax.MosaicConfig.default(128)
  # fields given as numpy ints, as DecodeConfig's: kept as Python ints; numpy bools refused
  assert fa2_jax.BlockSizes(block_q=np.int32(32)) == fa2_jax.BlockSizes(block_q=32)
  assert type(fa2_jax.MosaicConfig(num_stages=np.int64(2)).num_stages) is int
  with pytest.raises(TypeError, match="BlockSizes.block_q must be an int, got bool"):
    fa2_jax.BlockSizes(block_q=np.bool_(True))
  with pytest.raises(TypeError, match="dtype must be bfloat16, float16 or float32, got None"):
    fa2_jax.BlockSizes.default(64, None)


def test_mosaic_config_register_budget_fits_an_sm():
  """Two consumer warpgroups and the producer share the 64512 registers a CTA of 384 threads holds
  (168 each at launch): a split past that, which would hang in setmaxnreg, is refused when the
  config is made; every default fits (240 / 24 and 232 / 40 exactly)."""
  with pytest.raises(ValueError, match="98304 registers, more than the 64512 a CTA of 384 threads"):
    fa2_jax.MosaicConfig(compute_registers=256, memory_registers=256)
  with pytest.raises(ValueError, match="65536 registers, more than the 64512"):
    fa2_jax.MosaicConfig(compute_registers=240, memory_registers=32)
  fa2_jax.MosaicConfig(compute_registers=240, memory_registers=24)
  with pytest.raises(ValueError, match="compute_registers must be 0 or a multiple of 8 .*got 7"):
    fa2_jax.MosaicConfig(compute_registers=7)
  fa2_jax.MosaicConfig(num_wgs=1, pingpong=False, num_wgs_dkv=1, num_wgs_dq=1,
                       compute_registers=256, memory_registers=24)  # one consumer: 256 threads
  for h in (64, 128, 192, 256):
    for causal in (False, True):
      fa2_jax.MosaicConfig.default(h, jnp.bfloat16, causal)


def test_float64_inputs_name_the_reference():
  with jax.enable_x64(True):
    q = jnp.ones((1, 4, 1, 8), jnp.float64)
    with pytest.raises(TypeError, match="float64.*reference_attention"):
      fa2_jax.flash_attention(q, q, q)
    assert fa2_jax.reference_attention(q, q, q).dtype == jnp.float64


def test_formula_under_jit_at_extreme_scale():
  """The formula (the documented path for extreme logits) keeps the max it subtracts consistent
  under jit: XLA used to fuse `logits * scale - m` into one FMA and return NaN."""
  q = jnp.array([-1.7685119]).reshape(1, 1, 1, 1)
  k = jnp.array([-0.96385425, -3.1063368]).reshape(1, 2, 1, 1)
  v = jnp.array([-1.1422789, 1.2969154]).reshape(1, 2, 1, 1)
  for impl in (None, "xla"):
    out, lse = jax.jit(lambda q, k, v: fa2_jax.flash_attention(
        q, k, v, scale=1e9, implementation=impl, return_residual=True))(q, k, v)
    np.testing.assert_allclose(out, v[:, 1:], rtol=0)  # one-hot on the larger logit
    np.testing.assert_allclose(lse, 1e9 * float(q[0, 0, 0, 0] * k[0, 1, 0, 0]), rtol=1e-6)
