"""The forward at extreme logits: no NaN or inf for any finite logits, on both backends.

The kernels compute ``p = exp2(s*c - m)`` as one FMA per element, off by a per-row factor ``2^δ`` (the
rounding of ``m``) that cancels in the output and the lse but must fit what ``P`` holds;
``kernels/softmax.py`` scales rows past 2^30 in base 2 (2^28 for float16) by a power of two. These
cases run from below it to far past it, ``|scale * q·k|`` from about 1e6 to 1e32: positive and
negative scales, ties at the row maximum, causal (masked tiles), a ragged key tail and rows whose
maximum arrives in a later key tile. The reference is the float32 formula (it subtracts the row maximum it rounded, exact there).

On CPU the Triton kernels run in Pallas interpret mode and the Mosaic kernels through the emulated
interpret path (one case per feature: it is slow); the ``gpu``-marked test runs them compiled.
"""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa2_jax
from fa2_jax import dispatch

SCALES = (1e5, 1e9, 1e30, -1e9)


def _inputs(t, h, dtype, ties, seed=0):
  """q = 1 and keys in [0.5, 0.99], but 1 at key 5 of head 0 (the row maximum in the first key tile)
  and at key t - 3 of head 1 (in the last); ``ties``: also at keys 9 and t - 10."""
  q = jnp.ones((1, t, 2, h), jnp.float32)
  k = jax.random.uniform(jax.random.key(seed), q.shape, minval=0.5, maxval=0.99)
  k = k.at[0, 5, 0].set(1.0).at[0, t - 3, 1].set(1.0)
  if ties:
    k = k.at[0, 9, 0].set(1.0).at[0, t - 10, 1].set(1.0)
  v = jax.random.normal(jax.random.key(seed + 1), q.shape)
  return tuple(x.astype(dtype) for x in (q, k, v))


def _check(out, lse, q, k, v, *, scale, causal):
  ref, ref_lse = fa2_jax.reference_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                             scale=scale, is_causal=causal, return_residual=True)
  out = np.asarray(out.astype(jnp.float32))
  assert np.isfinite(out).all() and np.isfinite(np.asarray(lse)).all()
  # One-hot rows (or the mean of tied values): exact up to the output dtype's rounding.
  eps = float(jnp.finfo(q.dtype).eps)
  np.testing.assert_allclose(out, np.asarray(ref), atol=4 * eps, rtol=0)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=2e-6, atol=0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=lambda d: d.__name__)
@pytest.mark.parametrize("scale", SCALES)
def test_forward_extreme_logits_triton(dtype, scale):
  """32-row tiles over T = S = 72: two full key tiles and a ragged one; causal and not, ties."""
  blocks = fa2_jax.BlockSizes(block_q=32, block_k=32, block_q_dkv=32, block_k_dkv=32,
                              block_q_dq=32, block_k_dq=32)
  for causal, ties in itertools.product((False, True), (False, True)):
    q, k, v = _inputs(72, 32, dtype, ties)
    out, lse = jax.jit(lambda q, k, v: fa2_jax.flash_attention(
        q, k, v, scale=scale, is_causal=causal, implementation="triton", interpret=True,
        block_sizes=blocks, return_residual=True))(q, k, v)
    _check(out, lse, q, k, v, scale=scale, causal=causal)


@pytest.mark.parametrize("dtype,scale,causal,ties,t", [
    (jnp.bfloat16, 1e9, False, False, 256),  # two unmasked key tiles: the maximum moves to the 2nd
    (jnp.float16, -1e9, False, True, 256),   # negative scale (the row maximum is the raw minimum)
    (jnp.bfloat16, 1e30, True, True, 200),   # causal, ragged key tail: masked tiles
])
def test_forward_extreme_logits_mosaic_emulated(dtype, scale, causal, ties, t):
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from fa2_jax.kernels.mosaic.forward import forward
  from fa2_jax.kernels.mosaic.ops import emulated_mma

  q, k, v = _inputs(t, 128, dtype, ties)
  with emulated_mma(), plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
    out, lse = jax.jit(lambda q, k, v: forward(q, k, v, scale=scale, is_causal=causal))(q, k, v)
  _check(out, jnp.swapaxes(lse, 1, 2), q, k, v, scale=scale, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["mosaic", "triton"])
def test_forward_extreme_logits_compiled(implementation):
  if implementation == "mosaic" and not dispatch.is_hopper():
    pytest.skip("the Mosaic kernels run on Hopper (sm90) only")
  # T = 1000: full and ragged tiles; non-causal one-hot rows, causal rows with ties.
  for dtype, scale, causal in itertools.product((jnp.bfloat16, jnp.float16), SCALES, (False, True)):
    q, k, v = _inputs(1000, 128, dtype, ties=causal)
    out, lse = jax.jit(lambda q, k, v: fa2_jax.flash_attention(
        q, k, v, scale=scale, is_causal=causal, implementation=implementation,
        return_residual=True))(q, k, v)
    _check(out, lse, q, k, v, scale=scale, causal=causal)
