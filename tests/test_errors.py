"""Bad input gets a clear ValueError/TypeError naming the argument."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa2_jax
from conftest import on_gpu

Q = jnp.zeros((2, 8, 4, 16), jnp.float32)
KV = jnp.zeros((2, 12, 2, 16), jnp.float32)


def call(q=Q, k=KV, v=KV, **kw):
  return fa2_jax.flash_attention(q, k, v, **kw)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(q=jnp.zeros((8, 16))), ValueError, "query must have rank 4"),
    (dict(k=jnp.zeros((12, 2, 16))), ValueError, "key must have the same rank"),
    (dict(v=jnp.zeros((2, 12, 2, 16), jnp.bfloat16)), ValueError, "share one dtype"),  # as jax.nn
    (dict(q=Q.astype(jnp.int32), k=KV.astype(jnp.int32), v=KV.astype(jnp.int32)), TypeError,
     "bfloat16, float16 or float32"),
    (dict(v=jnp.zeros((2, 11, 2, 16))), ValueError,
     "key and value must have the same \\[B, S, K\\]"),
    (dict(k=jnp.zeros((3, 12, 2, 16)), v=jnp.zeros((3, 12, 2, 16))), ValueError, "batch size"),
    (dict(k=jnp.zeros((2, 12, 2, 32)), v=jnp.zeros((2, 12, 2, 32))), ValueError, "head_dim"),
    (dict(k=jnp.zeros((2, 12, 3, 16)), v=jnp.zeros((2, 12, 3, 16))), ValueError,
     "multiple of the key/value head count"),
    (dict(q=jnp.zeros((2, 8, 0, 16))), ValueError, "positive multiple of the key/value head count"),
    (dict(scale=float("nan")), ValueError, "scale must be finite"),
    (dict(scale="0.1"), TypeError, "scale must be a Python float"),
    (dict(scale=np.ones(2)), TypeError, "scale must be a scalar"),
    (dict(is_causal=1), TypeError, "is_causal must be a Python bool"),
    (dict(return_residual="yes"), TypeError, "return_residual must be a Python bool"),
    (dict(deterministic=None), TypeError, "deterministic must be a Python bool"),
    (dict(interpret="no"), TypeError, "interpret must be a Python bool"),
    (dict(implementation="cuda"), ValueError, "implementation must be one of"),
    (dict(implementation="mosaic", interpret=True), ValueError,
     "implementation='mosaic' cannot run this call: it has no Pallas interpret mode"),
    (dict(block_sizes=(64, 64)), TypeError, "block_sizes must be a fa2_jax.DecodeConfig \\(decode kernels\\), a fa2_jax.MosaicConfig \\(sm90 kernels\\), a fa2_jax.BlockSizes"),
    (dict(q="not an array"), TypeError, "query must be a jax/numpy array"),
])
def test_bad_arguments(kwargs, exc, match):
  with pytest.raises(exc, match=match):
    call(**kwargs)


def test_head_dim_over_kernel_limit():
  q = jnp.zeros((1, 4, 1, 384), jnp.float32)
  with pytest.raises(ValueError, match="head_dim <= 256"):
    fa2_jax.flash_attention(q, q, q, implementation="triton", interpret=True)
  # The default implementation falls back to the XLA formula instead of failing.
  assert fa2_jax.flash_attention(q, q, q).shape == q.shape


def test_traced_scale_is_rejected():
  with pytest.raises(TypeError, match="static Python float"):
    jax.jit(lambda s: call(scale=s))(0.5)


@pytest.mark.skipif(on_gpu(), reason="CPU-only dispatch rule")
def test_mosaic_on_cpu_names_the_reason():
  with pytest.raises(ValueError, match="needs an NVIDIA Hopper GPU"):
    call(implementation="mosaic")


@pytest.mark.skipif(on_gpu(), reason="CPU-only dispatch rule")
def test_triton_on_cpu_without_interpret():
  with pytest.raises(ValueError, match="interpret=True"):
    call(implementation="triton")


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(block_q=48), ValueError, "block_q must be a power of two"),
    (dict(block_k=8), ValueError, "block_k must be a power of two in \\[16, 256\\]"),
    (dict(block_q_dkv=512), ValueError, "block_q_dkv"),
    (dict(num_warps_fwd=3), ValueError, "num_warps_fwd must be one of"),
    (dict(num_stages_bwd=0), ValueError, "num_stages_bwd must be in"),
    (dict(block_k_dq=64.0), TypeError, "block_k_dq must be an int"),
])
def test_bad_block_sizes(kwargs, exc, match):
  with pytest.raises(exc, match=match):
    fa2_jax.BlockSizes(**kwargs)


def test_config_defaults_check_their_arguments():
  """The defaults' dtype is an input dtype of the kernels, and MosaicConfig's is_causal a bool (a
  string was read as true before)."""
  for default, names in ((fa2_jax.BlockSizes.default, "bfloat16, float16 or float32"),
                         (fa2_jax.MosaicConfig.default, "bfloat16 or float16")):
    for dt in (jnp.int32, jnp.float64, "not a dtype"):
      with pytest.raises(TypeError, match=f"dtype must be {names}"):
        default(64, dt)
  with pytest.raises(TypeError, match="is_causal must be a Python bool"):
    fa2_jax.MosaicConfig.default(64, jnp.bfloat16, "yes")
  assert fa2_jax.MosaicConfig.default(64, jnp.float16, np.bool_(True)) == fa2_jax.MosaicConfig.default(
      64, jnp.float16, True)


def test_block_size_defaults_are_valid_and_clamped():
  for h in (16, 40, 64, 80, 96, 128, 200, 256):
    for dt in (jnp.bfloat16, jnp.float16, jnp.float32):
      cfg = fa2_jax.BlockSizes.default(h, dt)
      small = cfg.clamp(1, 20)
      assert small.block_q == 16 and small.block_k <= 32
