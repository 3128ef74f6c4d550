"""The kernels lower to Triton IR for a Hopper GPU, checked on any machine (no GPU needed).

`jax.export` lowers a jitted forward+backward for the "cuda" platform; the Pallas Triton lowering runs
then (it is what rejects unsupported ops, non-power-of-two tiles or mistyped loop bounds), with the GPU
description of an H200 given explicitly. Compiling the Triton IR to machine code still needs the GPU.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import export

import fa2_jax
from fa2_jax.kernels import platform


gpu_info = pytest.importorskip("jax._src.pallas.triton.gpu_info")
registration = pytest.importorskip("jax._src.pallas.triton.pallas_call_registration")


@pytest.fixture
def as_h200(monkeypatch):
  monkeypatch.setattr(registration.gpu_info_lib, "get_gpu_info",
                      lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))
  monkeypatch.setattr(platform, "on_gpu", lambda: True)


CASES = [  # (b, t, s, n, kh, h, causal, dtype)
    (2, 1024, 1024, 8, 8, 128, False, jnp.bfloat16),
    (2, 1023, 1000, 8, 2, 80, True, jnp.bfloat16),
    (3, 113, 1, 4, 4, 64, False, jnp.bfloat16),  # one ragged key block (was an i1/i32 bug)
    (1, 300, 100, 4, 1, 96, True, jnp.float16),
    (1, 128, 128, 2, 2, 256, True, jnp.float32),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:7])))
def test_lowers_for_hopper(case, as_h200):
  b, t, s, n, kh, h, causal, dtype = case
  q = jax.ShapeDtypeStruct((b, t, n, h), dtype)
  kv = jax.ShapeDtypeStruct((b, s, kh, h), dtype)

  def loss(q, k, v):
    o = fa2_jax.flash_attention(q, k, v, is_causal=causal, implementation="triton")
    return o.astype(jnp.float32).sum()

  fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  exp = export.export(fn, platforms=["cuda"], disabled_checks=[
      export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(q, kv, kv)
  text = exp.mlir_module()
  # forward, dK/dV and dQ kernels: each a Triton custom call
  assert text.count("__gpu$xla.gpu.triton") >= 3


@pytest.mark.parametrize("t, s, causal", [(300, 300, True), (1, 1024, False)],
                         ids=["training", "decoding"])
def test_value_head_dim_lowers_for_hopper(as_h200, t, s, causal):
  """A value head_dim other than the query/key one (DeepSeek-V2's H 192, Hv 128): V, O, dO and dV
  tiles of 128 columns beside Q/K/dQ/dK tiles of 256 (192 padded) pass the Triton lowering, on the
  training kernels and on the decode forward (whose backward is the Triton one)."""
  q = jax.ShapeDtypeStruct((2, t, 8, 192), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((2, s, 2, 192), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((2, s, 2, 128), jnp.bfloat16)
  assert fa2_jax.backend_for(q, k, v, is_causal=causal).backend == ("triton" if t > 1 else "decode")

  def loss(q, k, v):
    return fa2_jax.flash_attention(q, k, v, is_causal=causal).astype(jnp.float32).sum()

  fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  exp = export.export(fn, platforms=["cuda"], disabled_checks=[
      export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(q, k, v)
  assert [a.shape for a in exp.out_avals] == [q.shape, k.shape, v.shape]
  assert exp.mlir_module().count("__gpu$xla.gpu.triton") >= 3


@pytest.mark.parametrize("score_fn", [None, lambda x, b, h, i, j: x * 0.9 + jnp.sin(x) * 0.1])
def test_alibi_slopes_gradient_lowers_for_hopper(as_h200, score_fn):
  """The dQ kernel's second output, the rows' sums of dS * d s / d slope, when the slopes are
  differentiated (with a score_fn, its derivative in the chain)."""
  q = jax.ShapeDtypeStruct((2, 300, 4, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 260, 2, 64), jnp.bfloat16)
  slopes = jax.ShapeDtypeStruct((4,), jnp.float32)

  def loss(q, k, v, slopes):
    o = fa2_jax.flash_attention(q, k, v, is_causal=True, implementation="triton",
                                alibi_slopes=slopes, score_fn=score_fn, q_offset=40)
    return o.astype(jnp.float32).sum()

  fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
  exp = export.export(fn, platforms=["cuda"], disabled_checks=[
      export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(q, kv, kv, slopes)
  assert exp.mlir_module().count("__gpu$xla.gpu.triton") >= 3
