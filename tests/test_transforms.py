"""flash_attention composes with jit, grad, jit(grad), vmap, pmap and shard_map; memory stays linear."""
from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fa2_jax
from conftest import on_gpu

INTERPRET = None if on_gpu() else True
flash = functools.partial(fa2_jax.flash_attention, implementation="triton", interpret=INTERPRET)


def _qkv(b=2, t=24, s=40, n=4, kh=2, h=16, seed=0, lead=()):
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (*lead, b, t, n, h), jnp.float32)
  k = jax.random.normal(ks[1], (*lead, b, s, kh, h), jnp.float32)
  v = jax.random.normal(ks[2], (*lead, b, s, kh, h), jnp.float32)
  return q, k, v


def _loss(fn, causal=True):
  return lambda q, k, v: jnp.sum(jnp.tanh(fn(q, k, v, is_causal=causal)))


def test_jit_grad_and_jit_of_grad():
  q, k, v = _qkv()
  out = jax.jit(lambda a, b, c: flash(a, b, c, is_causal=True))(q, k, v)
  np.testing.assert_allclose(out, fa2_jax.reference_attention(q, k, v, is_causal=True),
                             atol=2e-5)
  g_ref = jax.grad(_loss(fa2_jax.reference_attention), argnums=(0, 1, 2))(q, k, v)
  for g in (jax.grad(_loss(flash), argnums=(0, 1, 2))(q, k, v),
            jax.jit(jax.grad(_loss(flash), argnums=(0, 1, 2)))(q, k, v)):
    for a, b in zip(g, g_ref):
      np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)


def test_vmap_extra_leading_axis_and_shared_kv():
  q, k, v = _qkv(lead=(3,), b=1, seed=1)
  out = jax.vmap(lambda a, b, c: flash(a, b, c, is_causal=True))(q, k, v)
  ref = jax.vmap(lambda a, b, c: fa2_jax.reference_attention(a, b, c, is_causal=True))(q, k, v)
  np.testing.assert_allclose(out, ref, atol=2e-5)
  # in_axes=None on k/v: three query sets share one K/V.
  f = lambda a, b, c: flash(a, b, c, is_causal=False)
  out = jax.vmap(f, in_axes=(0, None, None))(q, k[0], v[0])
  ref = jax.vmap(lambda a: fa2_jax.reference_attention(a, k[0], v[0]))(q)
  np.testing.assert_allclose(out, ref, atol=2e-5)
  # ... and its gradient, which sums dK/dV over the mapped axis.
  g = jax.grad(lambda a, b, c: jnp.sum(jnp.sin(jax.vmap(f, in_axes=(0, None, None))(a, b, c))),
               argnums=(0, 1, 2))(q, k[0], v[0])
  g_ref = jax.grad(lambda a, b, c: jnp.sum(jnp.sin(jax.vmap(
      lambda x: fa2_jax.reference_attention(x, b, c))(a))), argnums=(0, 1, 2))(q, k[0], v[0])
  for a, b in zip(g, g_ref):
    np.testing.assert_allclose(a, b, atol=5e-5, rtol=1e-4)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs several devices (conftest sets 4 CPUs)")
def test_pmap():
  nd = len(jax.devices())
  q, k, v = _qkv(lead=(nd,), b=1, seed=2)
  grad_fn = jax.pmap(jax.grad(_loss(flash), argnums=(0, 1, 2)))
  g = grad_fn(q, k, v)
  g_ref = jax.vmap(jax.grad(_loss(fa2_jax.reference_attention), argnums=(0, 1, 2)))(q, k, v)
  for a, b in zip(g, g_ref):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs several devices (conftest sets 4 CPUs)")
def test_shard_map_over_batch_and_heads():
  nd = len(jax.devices())
  mesh = jax.make_mesh((nd // 2, 2), ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  q, k, v = _qkv(b=nd // 2 * 2, n=4, kh=2, seed=3)
  spec = P("data", None, "model", None)

  def local(a, b, c):
    return jax.grad(_loss(flash), argnums=(0, 1, 2))(a, b, c)

  # check_vma=False: the interpret-mode kernel's internals are not varying-manual-axes aware.
  sharded = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec,) * 3,
                                  check_vma=False))
  put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))
  g = sharded(put(q), put(k), put(v))
  g_ref = jax.grad(_loss(fa2_jax.reference_attention), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(g, g_ref):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)


def _sub_jaxprs(params):
  for value in params.values():
    for item in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(item, jax.extend.core.ClosedJaxpr):
        yield item.jaxpr
      elif isinstance(item, jax.extend.core.Jaxpr):
        yield item


def _max_intermediate(jaxpr) -> int:
  """Largest array (elements) produced by any equation of a jaxpr, recursing into sub-jaxprs except
  the kernels' own bodies (whose values are on-chip tiles)."""
  biggest = 0
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      shape = getattr(var.aval, "shape", ())
      biggest = max(biggest, int(np.prod(shape)) if shape else 1)
    if eqn.primitive.name == "pallas_call":
      continue
    for sub in _sub_jaxprs(eqn.params):
      biggest = max(biggest, _max_intermediate(sub))
  return biggest


def test_memory_is_linear_in_sequence_length():
  """No [T, S] array anywhere in forward + backward: the largest intermediate is O(T)."""
  b, t, n, h = 1, 4096, 2, 64
  q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
  grad = jax.grad(lambda a, c, d: jnp.sum(flash(a, c, d, is_causal=True).astype(jnp.float32)),
                  argnums=(0, 1, 2))
  jaxpr = jax.make_jaxpr(grad)(q, q, q).jaxpr
  biggest = _max_intermediate(jaxpr)
  assert biggest <= 4 * b * t * n * h, biggest  # O(T * N * H), far below T * S = 16.7M
  assert biggest < t * t
  # The reference formula, by contrast, does build the quadratic score matrix.
  ref = jax.grad(lambda a, c, d: jnp.sum(fa2_jax.reference_attention(a, c, d)),
                 argnums=(0, 1, 2))
  assert _max_intermediate(jax.make_jaxpr(ref)(q, q, q).jaxpr) >= b * n * t * t


@pytest.mark.gpu
def test_compiled_memory_is_linear_gpu():
  """On the GPU: compiled temp memory of fwd+bwd at 32k tokens stays far below one [T, S] f32 array."""
  b, t, n, h = 1, 32768, 4, 128
  q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
  grad = jax.jit(jax.grad(lambda a, c, d: jnp.sum(flash(a, c, d).astype(jnp.float32)),
                          argnums=(0, 1, 2)))
  mem = grad.lower(q, q, q).compile().memory_analysis()
  assert mem.temp_size_in_bytes < 64 * b * t * n * h, mem.temp_size_in_bytes


def test_works_with_x64_enabled():
  """With jax_enable_x64 on, the kernels still trace (their index math stays int32)."""
  q, k, v = _qkv(b=1, t=17, s=23, seed=4)
  with jax.enable_x64(True):
    g = jax.grad(_loss(flash), argnums=(0, 1, 2))(q, k, v)
  g_ref = jax.grad(_loss(fa2_jax.reference_attention), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(g, g_ref):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)
