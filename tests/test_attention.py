"""Correctness of fa2_jax.flash_attention: forward, lse and gradients against a float64 reference.

On CPU the Pallas kernels run in interpret mode (small shapes); on a GPU they run compiled, and the
``gpu``-marked cases add the bigger shapes. Every case draws fresh random inputs and a random cotangent.
For bf16/fp16 the kernel's error must be at most twice the error of the same formula evaluated by XLA in
the input precision (plus a small atol); float32 is held to an absolute bound.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa2_jax
from conftest import on_gpu

# One tolerance table. "atol" is relative to max|reference| (+1): error <= 2 * err_xla + atol * scale.
TOLERANCE = {
    "float32": dict(factor=2.0, atol=2e-5),
    "bfloat16": dict(factor=2.0, atol=2e-3),
    "float16": dict(factor=2.0, atol=5e-4),
}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class Case:
  b: int
  t: int
  s: int
  n: int
  kh: int
  h: int
  causal: bool
  dtype: str
  deterministic: bool = False  # passed to flash_attention (the Mosaic fused dQ vs the separate pass)

  def __str__(self):
    return (f"b{self.b}-t{self.t}-s{self.s}-n{self.n}-k{self.kh}-h{self.h}-"
            f"{'causal' if self.causal else 'full'}-{self.dtype}"
            f"{'-det' if self.deterministic else ''}")


# CPU (interpret mode): ragged lengths, T != S both ways, GQA/MQA, non-power-of-two head dims. Slow
# (CI time, about 5 s each): a single row and key (test_fuzz.py's examples run T = S = 1 on the
# kernels), a small causal GQA float32 case (float32 causal GQA runs at T = 1 below, causal float32
# at 1000 rows), and 1023 rows non-causal (many key blocks run in the 1000-row causal case and in
# test_small_blocks_many_iterations).
_slow = functools.partial(pytest.param, marks=pytest.mark.slow)
CPU_CASES = [
    _slow(Case(1, 1, 1, 1, 1, 16, False, "float32")),
    Case(1, 1, 37, 2, 1, 32, True, "float32"),
    _slow(Case(1, 17, 17, 2, 1, 16, True, "float32")),
    Case(2, 113, 113, 4, 2, 80, True, "bfloat16"),
    Case(1, 113, 200, 2, 2, 96, True, "float16"),
    Case(1, 200, 113, 2, 1, 64, True, "bfloat16"),
    Case(1, 33, 47, 3, 3, 40, False, "float16"),
    Case(1, 130, 129, 2, 2, 64, False, "float32"),
    Case(1, 64, 64, 2, 1, 256, False, "bfloat16"),
    _slow(Case(1, 1023, 1024, 1, 1, 32, False, "bfloat16")),
    Case(1, 1000, 1000, 1, 1, 24, True, "float32"),
    Case(1, 257, 255, 4, 1, 128, True, "bfloat16"),
]

# GPU (compiled): the same kinds of shapes, bigger.
GPU_CASES = [
    Case(2, 1024, 1024, 8, 8, 128, c, d, det)
    for c, d, det in itertools.product((False, True), ("bfloat16", "float16"), (False, True))
] + [
    Case(2, 2048, 2048, 8, 2, 64, True, "bfloat16"),
    Case(1, 4096, 4096, 4, 1, 128, False, "bfloat16"),
    Case(2, 1023, 1024, 4, 4, 128, True, "bfloat16"),
    Case(1, 1000, 3000, 4, 2, 96, True, "bfloat16"),
    Case(1, 3000, 1000, 4, 2, 80, True, "float16"),
    Case(3, 113, 1, 4, 4, 64, False, "bfloat16"),
    Case(2, 777, 777, 4, 4, 256, True, "bfloat16"),
    Case(2, 511, 513, 4, 4, 32, False, "float32"),
    Case(1, 1024, 1024, 4, 4, 16, True, "float32"),
]


def _inputs(case: Case, seed: int):
  dt = DTYPES[case.dtype]
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (case.b, case.t, case.n, case.h), jnp.float32).astype(dt)
  k = jax.random.normal(ks[1], (case.b, case.s, case.kh, case.h), jnp.float32).astype(dt)
  v = jax.random.normal(ks[2], (case.b, case.s, case.kh, case.h), jnp.float32).astype(dt)
  do = jax.random.normal(ks[3], (case.b, case.t, case.n, case.h), jnp.float32).astype(dt)
  return q, k, v, do


def _value_and_grads(fn, q, k, v, do):
  out, vjp = jax.vjp(fn, q, k, v)
  return (out, *vjp(do))


def reference_f64(q, k, v, do, causal):
  """out, lse, dq, dk, dv in float64 on the CPU."""
  cpu = jax.devices("cpu")[0]
  with jax.enable_x64(True):
    q64, k64, v64, do64 = (jax.device_put(np.asarray(x, np.float64), cpu) for x in (q, k, v, do))
    # jitted (the inputs live on the CPU, so it runs there): one compile instead of one per op
    out, lse = jax.jit(lambda a, b, c: fa2_jax.reference_attention(
        a, b, c, is_causal=causal, return_residual=True))(q64, k64, v64)
    _, dq, dk, dv = jax.jit(lambda *a: _value_and_grads(
        lambda x, y, z: fa2_jax.reference_attention(x, y, z, is_causal=causal), *a))(
            q64, k64, v64, do64)
    return [np.asarray(x) for x in (out, lse, dq, dk, dv)]


def low_precision_xla(q, k, v, do, causal):
  """The same formula evaluated by XLA entirely in the input dtype: the error budget."""
  dt = q.dtype
  f = lambda a, b, c: fa2_jax.reference_attention(a, b, c, is_causal=causal, compute_dtype=dt)
  # jitted: on a GPU, op-by-op dispatch compiles every primitive separately (slow at these shapes)
  out, dq, dk, dv = jax.jit(lambda *a: _value_and_grads(f, *a))(q, k, v, do)
  _, lse = jax.jit(lambda a, b, c: fa2_jax.reference_attention(
      a, b, c, is_causal=causal, compute_dtype=dt, return_residual=True))(q, k, v)
  return [np.asarray(x.astype(jnp.float32), np.float64) for x in (out, lse, dq, dk, dv)]


def ours(q, k, v, do, causal, implementation="triton", **kw):
  interpret = None if on_gpu() else True
  f = lambda a, b, c: fa2_jax.flash_attention(a, b, c, is_causal=causal, interpret=interpret,
                                              implementation=implementation,
                                              return_residual=True, **kw)
  (out, lse), vjp = jax.vjp(f, q, k, v)
  dq, dk, dv = vjp((do, jnp.zeros_like(lse)))
  return [np.asarray(x.astype(jnp.float32), np.float64) for x in (out, lse, dq, dk, dv)]


def check_case(case: Case, seed: int = 0, **kw):
  q, k, v, do = _inputs(case, seed)
  got = ours(q, k, v, do, case.causal, deterministic=case.deterministic, **kw)
  ref = reference_f64(q, k, v, do, case.causal)
  low = low_precision_xla(q, k, v, do, case.causal)
  tol = TOLERANCE[case.dtype]
  names = ("out", "lse", "dq", "dk", "dv")
  report = []
  for name, g, r, lo in zip(names, got, ref, low):
    assert g.shape == r.shape, (name, g.shape, r.shape)
    assert np.all(np.isfinite(g)), f"{name}: non-finite values"
    err = np.max(np.abs(g - r))
    err_xla = np.max(np.abs(lo - r))
    bound = tol["factor"] * err_xla + tol["atol"] * (np.max(np.abs(r)) + 1.0)
    report.append(f"{name}: err {err:.3g} xla {err_xla:.3g} bound {bound:.3g}")
    assert err <= bound, f"{case}: {name} error {err:.4g} > bound {bound:.4g}\n" + "\n".join(report)
  return report


@pytest.mark.parametrize("case", CPU_CASES, ids=str)
def test_matches_reference(case):
  check_case(case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_matches_reference_gpu(case):
  check_case(case, seed=1)


# The Hopper (Mosaic GPU) backend: bf16/fp16, head_dim 64/128/256, any length, GQA, causal.
MOSAIC_CASES = [
    Case(2, 1024, 1024, 8, 8, 128, False, "bfloat16"),
    Case(2, 1024, 1024, 8, 2, 128, True, "bfloat16"),
    Case(2, 2048, 2048, 8, 8, 64, True, "float16"),
    Case(1, 1000, 1000, 4, 4, 128, True, "bfloat16"),
    Case(1, 777, 1500, 4, 1, 64, False, "bfloat16"),
    Case(1, 512, 512, 4, 4, 256, True, "bfloat16"),
    Case(1, 1500, 777, 4, 2, 128, True, "bfloat16"),  # causal, T > S: rows past S see every key
    Case(2, 1, 300, 4, 1, 128, True, "float16"),
    Case(3, 113, 1, 4, 4, 64, False, "bfloat16"),
    Case(1, 1024, 2048, 4, 4, 192, False, "bfloat16"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", MOSAIC_CASES, ids=str)
def test_mosaic_matches_reference_gpu(case):
  check_case(case, seed=2, implementation="mosaic")


def test_small_blocks_many_iterations():
  """16x16 tiles: many key/query blocks per program, ragged tails, causal skipping and GQA."""
  blocks = fa2_jax.BlockSizes(block_q=16, block_k=16, block_q_dkv=16, block_k_dkv=32,
                              block_q_dq=32, block_k_dq=16, num_warps_fwd=4, num_warps_bwd=4)
  check_case(Case(1, 75, 90, 4, 2, 24, True, "float32"), block_sizes=blocks)
  check_case(Case(1, 90, 75, 2, 1, 24, True, "bfloat16"), block_sizes=blocks)


def _interp():
  return None if on_gpu() else True


def test_deterministic_is_bitwise_reproducible():
  q, k, v, do = _inputs(Case(1, 100, 100, 4, 2, 32, True, "float32"), 3)
  outs = [ours(q, k, v, do, True, deterministic=True) for _ in range(2)]
  for a, b in zip(*outs):
    np.testing.assert_array_equal(a, b)


def test_lse_is_differentiable():
  """A cotangent on lse flows through the kernel's backward (dS = P ∘ (dP − D + dlse))."""
  case = Case(1, 40, 56, 2, 1, 32, True, "float32")
  q, k, v, _ = _inputs(case, 4)

  def loss(fn):
    def f(a, b, c):
      out, lse = fn(a, b, c)
      return jnp.sum(out * jnp.cos(out)) + jnp.sum(jnp.sin(lse))
    return f

  mine = loss(lambda a, b, c: fa2_jax.flash_attention(a, b, c, is_causal=True, interpret=_interp(),
                                                      return_residual=True))
  ref = loss(lambda a, b, c: fa2_jax.reference_attention(a, b, c, is_causal=True,
                                                         return_residual=True))
  g1 = jax.grad(mine, argnums=(0, 1, 2))(q, k, v)
  g2 = jax.grad(ref, argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(g1, g2):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-4)


def test_rank3_inputs_and_scale():
  q, k, v, _ = _inputs(Case(1, 30, 20, 4, 2, 16, False, "float32"), 5)
  out = fa2_jax.flash_attention(q[0], k[0], v[0], scale=0.3, interpret=_interp())
  ref = fa2_jax.reference_attention(q, k, v, scale=0.3)[0]
  assert out.shape == q[0].shape
  np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)
  # A negative scale is unusual but valid math: the kernel must not assume scale > 0.
  out = fa2_jax.flash_attention(q, k, v, scale=-0.5, is_causal=True, interpret=_interp())
  ref = fa2_jax.reference_attention(q, k, v, scale=-0.5, is_causal=True)
  np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)


def test_default_implementation_on_cpu_is_the_reference():
  if on_gpu():
    pytest.skip("CPU dispatch rule")
  q, k, v, _ = _inputs(Case(2, 9, 11, 2, 1, 8, True, "float32"), 6)
  out = fa2_jax.flash_attention(q, k, v, is_causal=True)
  np.testing.assert_allclose(out, fa2_jax.reference_attention(q, k, v, is_causal=True), atol=1e-6)
  xla = fa2_jax.flash_attention(q, k, v, is_causal=True, implementation="xla")
  np.testing.assert_allclose(out, xla, atol=1e-6)


def test_matches_jax_nn_dot_product_attention():
  """Drop-in for jax.nn.dot_product_attention, including its causal alignment when T != S."""
  for t, s in ((24, 40), (40, 24)):
    q, k, v, _ = _inputs(Case(2, t, s, 4, 2, 32, True, "float32"), 7)
    mine = fa2_jax.flash_attention(q, k, v, is_causal=True, interpret=_interp())
    theirs = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    np.testing.assert_allclose(mine, theirs, atol=2e-5, rtol=2e-5)
