"""Attention at extreme logits, forward and gradients: no NaN for any finite logits, on both backends.

The forward computes ``p = exp2(s*c - m)`` as one FMA per element, off by a per-row factor ``2^δ`` (the
rounding of ``m``) that cancels in the output and the lse but must fit what ``P`` holds;
``kernels/softmax.py`` scales rows past 2^30 in base 2 (2^28 for float16) by a power of two. The
backward recomputes that ``P`` from the rows' raw maximum and sum, ``exp2((s - r)*c - u)``
(``backward_rows``), not from the rounded lse. These cases run from below the threshold to far past
it, ``|scale * q·k|`` from about 1e6 to 1e32: positive and negative scales, ties at the row maximum,
causal (masked tiles), a ragged key tail and rows whose maximum arrives in a later key tile. The
reference is the float32 formula (it subtracts the row maximum it rounded, exact there); the
gradients' bounds are derived in ``_check``. The inputs' dot products are exact sums (keys of 8
significant bits, q = 1), so the backward's recomputed logits equal the forward's in any summation
order, as gradients this sensitive need (docs/design.md, "Softmax form").

On CPU the Triton kernels run in Pallas interpret mode and the Mosaic kernels through the emulated
interpret path (one case per feature: it is slow); the ``gpu``-marked test runs them compiled.
"""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fa2_jax.kernels import platform
import fa2_jax

from fa2_jax.kernels.softmax import kernel_scale

SCALES = (1e5, 1e9, 1e30, -1e9)
# 32-row Triton tiles: several key tiles, full and ragged, at the small lengths interpret mode affords
TRITON_BLOCKS = fa2_jax.BlockSizes(block_q=32, block_k=32, block_q_dkv=32, block_k_dkv=32,
                                   block_q_dq=32, block_k_dq=32)


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


def _reference(q, k, v, do, *, scale, causal):
  """The float32 formula's output, lse, gradients and probabilities."""
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  attend = lambda q, k, v: fa2_jax.reference_attention(q, k, v, scale=scale, is_causal=causal,
                                                       return_residual=True)
  (out, lse), vjp = jax.vjp(attend, *f32)
  grads = vjp((do.astype(jnp.float32), jnp.zeros_like(lse)))
  logits = jnp.einsum("btnh,bsnh->bnts", f32[0], f32[1]) * scale
  if causal:
    t, s = logits.shape[-2:]
    logits = jnp.where(jnp.tril(jnp.ones((t, s), bool)), logits, -jnp.inf)
  probs = jax.nn.softmax(logits, axis=-1)  # [B, N, T, S]
  return out, lse, grads, probs


def _gqa_inputs(t, h, dtype):
  """GQA, one KV head for two query heads whose logits differ in size: q = 1 (head 0, huge logits
  at scale 1e9) and 2^-28 (head 1: |scale * q·k * log2 e| about 690 at scale 1e9 and h = 128, 170
  at h = 32: the fast form's range); keys in [0.25, 0.495] but 1 at key 5, so both heads' rows are
  one-hot."""
  q = jnp.ones((1, t, 2, h), jnp.float32).at[:, :, 1].set(2.0 ** -28)
  k = jax.random.uniform(jax.random.key(3), (1, t, 1, h), minval=0.25, maxval=0.495)
  k = k.at[0, 5, 0].set(1.0)
  v = jax.random.normal(jax.random.key(4), k.shape)
  return tuple(x.astype(dtype) for x in (q, k, v))


def _check(out, lse, q, k, v, *, scale, causal, grads=None, do=None):
  group = q.shape[2] // k.shape[2]
  if group > 1:  # GQA: check against the formula on each query head's copy of its KV head
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  ref, ref_lse, ref_grads, probs = _reference(q, k, v, q if do is None else do, scale=scale,
                                              causal=causal)
  out = np.asarray(out.astype(jnp.float32))
  assert np.isfinite(out).all() and np.isfinite(np.asarray(lse)).all()
  # One-hot rows (or the mean of tied values): exact up to the output dtype's rounding.
  eps = float(jnp.finfo(q.dtype).eps)
  np.testing.assert_allclose(out, np.asarray(ref), atol=4 * eps, rtol=0)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=2e-6, atol=0)
  if grads is None:
    return
  dq, dk, dv = (np.asarray(g.astype(jnp.float32)) for g in grads)
  ref_dq, ref_dk, ref_dv = (np.asarray(g) for g in ref_grads)
  t, h = q.shape[1], q.shape[-1]
  # dV = P^T dO: the probabilities are 1 or 1/(number of ties), exact; the sum over up to T rows of
  # dO in float32, then one rounding to the dtype.
  p_abs_do = np.einsum("bnts,btnh->bsnh", np.asarray(probs), np.abs(np.asarray(do, np.float32)))
  bound_dv = (2 * eps + t * 2.0 ** -24) * p_abs_do
  # dS = P (dP - D): on a one-hot row the exact dS is 0 and what remains is rounding, dominated by
  # D = rowsum(dO O) with O rounded to the output dtype (the formula's O is float32): per row at
  # most e_i = (eps + H 2^-24) sum_h |dO_ih O_ih|, times |scale| and |K| (dQ) or the column's
  # probabilities and |Q| (dK); plus each gradient's own rounding.
  e_row = (eps + h * 2.0 ** -24) * np.sum(np.abs(np.asarray(do, np.float32) * np.asarray(ref)), -1)
  kmax, qmax = (np.abs(np.asarray(x, np.float32)).max() for x in (k, q))
  bound_dq = 4 * abs(scale) * e_row[..., None] * kmax + 2 * eps * np.abs(ref_dq)
  col = np.einsum("bnts,btn->bsn", np.asarray(probs), e_row)  # sum_i P_ij e_i  [B, S, N]
  bound_dk = 4 * abs(scale) * col[..., None] * qmax + 2 * eps * np.abs(ref_dk)
  # Never NaN. Finite and within the bound wherever the dtype holds the reference plus the bound:
  # with float16 and |scale| past ~1e7, |scale| times the rounding of O alone can pass 65504 (so
  # it does for the float16 formula), and then the gradient may be inf.
  if group > 1:  # a KV head's gradient is the sum over its query heads' copies
    b_, s_, n_, h_ = ref_dk.shape
    ref_dk, ref_dv, bound_dk, bound_dv = (x.reshape(b_, s_, n_ // group, group, h_).sum(3)
                                          for x in (ref_dk, ref_dv, bound_dk, bound_dv))
  big = 0.5 * float(jnp.finfo(q.dtype).max)
  for name, g, r, bound in (("dq", dq, ref_dq, bound_dq), ("dk", dk, ref_dk, bound_dk),
                            ("dv", dv, ref_dv, bound_dv)):
    assert not np.isnan(g).any(), name
    held = np.abs(r) + bound < big
    assert np.isfinite(g[held]).all(), name
    assert (np.abs(g - r) <= bound)[held].all(), (name, np.abs(g - r)[held].max())


def _grad_inputs(q, seed=7):
  return jax.random.normal(jax.random.key(seed), q.shape).astype(q.dtype)


def _fwd_bwd_eager(fn, q, k, v, do):
  """``fn(q, k, v) -> (out, lse)``: its outputs and the gradients of ``sum(out * do)``."""
  (out, lse), vjp = jax.vjp(fn, q, k, v)
  return out, lse, vjp((do, jnp.zeros_like(lse)))


# One jit for every call: the same ``fn`` on new inputs of the same shapes reuses its compilation.
_fwd_bwd = jax.jit(_fwd_bwd_eager, static_argnums=0)


# CI runs every scale with two dtypes and every dtype with two scales or more (bfloat16 with all four,
# float16 past its 2^28 threshold, float32 below and past 2^30); the other four cells are slow (CI
# time: each compiles its own kernels)
_TRITON_SLOW = {(jnp.float16, 1e5), (jnp.float16, -1e9), (jnp.float32, 1e9), (jnp.float32, 1e30)}


@pytest.mark.parametrize("dtype, scale", [
    pytest.param(dtype, scale, id=f"{scale}-{dtype.__name__}",
                 marks=[pytest.mark.slow] if (dtype, scale) in _TRITON_SLOW else [])
    for scale in SCALES for dtype in (jnp.bfloat16, jnp.float16, jnp.float32)])
def test_extreme_logits_triton(dtype, scale):
  """32-row tiles over T = S = 72: two full key tiles and a ragged one; causal and not, ties (the
  inputs with and without ties run one compiled program)."""
  for causal in (False, True):
    fn = lambda q, k, v, causal=causal: fa2_jax.flash_attention(
        q, k, v, scale=scale, is_causal=causal, implementation="triton", interpret=True,
        block_sizes=TRITON_BLOCKS, return_residual=True)
    for ties in (False, True):
      q, k, v = _inputs(72, 32, dtype, ties)
      do = _grad_inputs(q)
      out, lse, grads = _fwd_bwd(fn, q, k, v, do)
      _check(out, lse, q, k, v, scale=scale, causal=causal, grads=grads, do=do)


TINY_SCALES = (1e-39, -3e-39, 1e-45, 8.3e-39)  # scale * log2(e) subnormal in float32 (the last normal)


def _check_tiny_scale(fn, scale, causal):
  q, k, v = (jax.random.normal(jax.random.key(i), (1, 40, 2, 16), jnp.float32) for i in range(3))
  do = _grad_inputs(q)
  out, lse, grads = _fwd_bwd(fn, q, k, v, do)
  ref = lambda q, k, v: fa2_jax.reference_attention(q, k, v, scale=scale, is_causal=causal,  # noqa: E731
                                                    return_residual=True)
  r_out, r_lse, r_grads = _fwd_bwd(ref, q, k, v, do)
  for name, x, r in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (r_out, r_lse, *r_grads)):
    assert np.isfinite(np.asarray(x)).all(), name
    np.testing.assert_allclose(np.asarray(x), np.asarray(r), atol=2e-5, rtol=2e-5, err_msg=name)


@pytest.mark.parametrize("scale", TINY_SCALES[:2])
def test_tiny_scales_triton(scale):
  """A scale whose ``scale * log2(e)`` is subnormal in float32: the kernels ran with ``c`` flushed to
  0 on the path that needs it nonzero, NaN in every row (0 < |scale| < 8.2e-39); they run such a
  scale as 0 now (kernels/softmax.kernel_scale), which equals the formula in float32."""
  assert [kernel_scale(x) for x in TINY_SCALES] == [0.0, 0.0, 0.0, 8.3e-39]
  for causal in (False, True):
    fn = lambda q, k, v, causal=causal: fa2_jax.flash_attention(  # noqa: E731
        q, k, v, scale=scale, is_causal=causal, implementation="triton", interpret=True,
        block_sizes=TRITON_BLOCKS, return_residual=True)
    _check_tiny_scale(fn, scale, causal)


def _fused_dq_config(head_dim, dtype, causal):
  """The Mosaic config whose backward runs dQ inside the dK/dV kernel at any length."""
  cfg = fa2_jax.MosaicConfig.default(head_dim, dtype, causal).replace(dq_fused=True,
                                                                      dq_fused_min_t=0)
  if cfg.check(head_dim, jnp.dtype(dtype).itemsize):  # shared memory: a shallower dK/dV ring
    cfg = cfg.replace(num_stages_dkv=2)
  return cfg


def test_extreme_logits_gqa_mixed_group_triton():
  q, k, v = _gqa_inputs(72, 32, jnp.bfloat16)
  do = _grad_inputs(q)
  fn = lambda q, k, v: fa2_jax.flash_attention(q, k, v, scale=1e9, implementation="triton",
                                               interpret=True, block_sizes=TRITON_BLOCKS,
                                               return_residual=True)
  out, lse, grads = _fwd_bwd(fn, q, k, v, do)
  _check(out, lse, q, k, v, scale=1e9, causal=False, grads=grads, do=do)


def _mosaic_fwd_bwd(q, k, v, do, *, scale, causal, config=None, emulate=False):
  """The Mosaic kernels called directly: ``(out, lse [B, T, N], (dq, dk, dv))`` of ``sum(out * do)``;
  with ``config`` fusing dQ (the non-deterministic backward); ``emulate``: in GPU interpret mode
  with emulated wgmma (CPU)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from fa2_jax.kernels.sm90.backward import backward
  from fa2_jax.kernels.sm90.forward import forward
  from fa2_jax.kernels.sm90.ops import emulated_mma
  from fa2_jax.kernels.softmax import lse_from_stats
  fused = config is not None and config.fuses_dq(q.shape[1], deterministic=False)

  def run(q, k, v, do):
    out, stats = forward(q, k, v, scale=scale, is_causal=causal)
    grads = backward(q, k, v, out, stats, do, scale=scale, is_causal=causal, config=config,
                     deterministic=not fused)
    return out, jnp.swapaxes(lse_from_stats(stats, scale, False), 1, 2), grads

  if not emulate:
    return jax.jit(run)(q, k, v, do)
  with emulated_mma(), plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
    return jax.jit(run)(q, k, v, do)


def test_extreme_logits_gqa_mixed_group_mosaic_emulated():
  """A KV head whose query heads need different forms of P (one huge, one ordinary): the dK/dV
  kernel runs the group's heads in one CTA, so the whole group takes the exact form."""
  q, k, v = _gqa_inputs(256, 128, jnp.bfloat16)
  do = _grad_inputs(q)
  out, lse, grads = _mosaic_fwd_bwd(q, k, v, do, scale=1e9, causal=False, emulate=True)
  _check(out, lse, q, k, v, scale=1e9, causal=False, grads=grads, do=do)


@pytest.mark.parametrize("dtype,scale,causal,ties,t,fused", [
    # two unmasked key tiles: the maximum moves (slow: non-causal bfloat16 at 1e9, 256 rows, runs in
    # CI in the GQA case above, the maximum moving to a later key tile in the exact-form one below)
    pytest.param(jnp.bfloat16, 1e9, False, False, 256, False, marks=pytest.mark.slow),
    (jnp.float16, -1e9, False, True, 256, False),   # negative scale (the row maximum is the minimum)
    (jnp.bfloat16, 1e30, True, True, 200, False),   # causal, ragged key tail: masked tiles
    (jnp.bfloat16, 1e9, True, True, 256, True),     # dQ fused into the dK/dV kernel
])
def test_extreme_logits_mosaic_emulated(dtype, scale, causal, ties, t, fused):
  q, k, v = _inputs(t, 128, dtype, ties)
  do = _grad_inputs(q)
  cfg = _fused_dq_config(128, dtype, causal) if fused else None
  assert cfg is None or cfg.fuses_dq(t, deterministic=False)
  out, lse, grads = _mosaic_fwd_bwd(q, k, v, do, scale=scale, causal=causal, config=cfg,
                                    emulate=True)
  _check(out, lse, q, k, v, scale=scale, causal=causal, grads=grads, do=do)


@pytest.mark.parametrize("fused", [False, True], ids=["separate_dq", "fused_dq"])
def test_extreme_logits_exact_form_everywhere_mosaic_emulated(fused):
  """``MosaicConfig.backward_p="exact"``: every head in the exact form, one loop per kernel (no
  per-CTA choice); huge logits with ties, and (with the separate dQ kernel) a GQA group of one huge
  and one ordinary head."""
  cfg = (_fused_dq_config(128, jnp.bfloat16, True) if fused else
         fa2_jax.MosaicConfig.default(128, jnp.bfloat16, True)).replace(backward_p="exact")
  assert cfg.p_form() == "exact"
  q, k, v = _inputs(256, 128, jnp.bfloat16, ties=True)
  do = _grad_inputs(q)
  out, lse, grads = _mosaic_fwd_bwd(q, k, v, do, scale=1e9, causal=True, config=cfg, emulate=True)
  _check(out, lse, q, k, v, scale=1e9, causal=True, grads=grads, do=do)
  if fused:  # its GQA case would run the separate dQ kernel, as the separate_dq case does (CI time)
    return
  q, k, v = _gqa_inputs(256, 128, jnp.bfloat16)
  do = _grad_inputs(q)
  out, lse, grads = _mosaic_fwd_bwd(q, k, v, do, scale=1e9, causal=False,
                                    config=cfg.replace(dq_fused=False), emulate=True)
  _check(out, lse, q, k, v, scale=1e9, causal=False, grads=grads, do=do)


@pytest.mark.parametrize("modification", ["soft_cap", "score_fn"])
def test_modified_logits_backward_sees_the_forward_rounding_triton(modification):
  """Logits of about 1e4 through a soft cap that changes nothing (cap 1e6) or an identity
  ``score_fn``: float32 dV (``P^T dO``, well conditioned; dQ and dK carry the formula's cancellation
  times the scale, README Limits) as exact as without them. The modified logits end in a product
  (the cap's factor, ``log2 e``), which the backward's ``s2 - r`` alone let the compiler contract,
  unrounded, where the forward used it rounded: 6e-4 relative error in dV before."""
  rng = np.random.default_rng(2)
  q, k, v, do = (jnp.array(rng.standard_normal(shape), jnp.float32)
                 for shape in [(1, 20, 2, 16), (1, 24, 2, 16), (1, 24, 2, 16), (1, 20, 2, 16)])
  kw = (dict(logits_soft_cap=1e6) if modification == "soft_cap" else
        dict(score_fn=lambda s, b, h, i, j: s))

  def dv(**impl):
    return jax.grad(lambda v: jnp.sum(fa2_jax.flash_attention(
        q, k, v, scale=2500.0, **impl, **kw) * do))(v)

  got, want = dv(implementation="triton", interpret=True), dv(implementation="xla")
  err = float(jnp.abs(got - want).max() / jnp.abs(want).max())
  assert err < 1e-5, err


def test_soft_cap_with_huge_scale_takes_the_fast_form_mosaic_emulated():
  """A soft cap bounds the logits whatever the scale, so the backward compiles the one-FMA form
  alone (``backward_p="auto"``); at ``scale=1e6`` (the capped logits saturate at ±cap, with ties)
  it still matches the float32 formula."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from fa2_jax.kernels.sm90.backward import backward
  from fa2_jax.kernels.sm90.forward import forward
  from fa2_jax.kernels.sm90.ops import emulated_mma
  from fa2_jax.kernels.softmax import lse_from_stats
  from fa2_jax.validation import check_variant
  ks = jax.random.split(jax.random.key(7), 4)
  q, k, v, do = (jax.random.normal(kk, (1, 200, 2, 64), jnp.float32).astype(jnp.bfloat16)
                 for kk in ks)
  scale, cap = 1e6, 20.0
  variant, arrays = check_variant(q, k, logits_soft_cap=cap)
  assert fa2_jax.MosaicConfig.default(64).p_form(variant) == "fast"

  def run(q, k, v, do):
    out, stats = forward(q, k, v, scale=scale, is_causal=False, variant=variant, arrays=arrays)
    grads = backward(q, k, v, out, stats, do, scale=scale, is_causal=False, variant=variant,
                     arrays=arrays)
    return (out, jnp.swapaxes(lse_from_stats(stats, scale, True), 1, 2), *grads)

  with emulated_mma(), plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
    got = jax.block_until_ready(run(q, k, v, do))
  ref = lambda q, k, v: fa2_jax.reference_attention(
      q, k, v, scale=scale, logits_soft_cap=cap, return_residual=True, compute_dtype=jnp.float32)

  @jax.jit  # one compile of the formula (eagerly: one per op)
  def expected(q, k, v, do):
    (out, lse), vjp = jax.vjp(ref, q, k, v)
    return (out, lse, *vjp((do, jnp.zeros_like(lse))))

  want = expected(q, k, v, do)
  for what, x, r in zip(("out", "lse", "dq", "dk", "dv"), got, want):
    x, r = np.asarray(x, np.float32), np.asarray(r, np.float32)
    assert np.isfinite(x).all(), what
    assert np.abs(x - r).max() <= 1e-2 * (np.abs(r).max() + 1), (what, np.abs(x - r).max())


# one case per (implementation, dtype, mask) and one GQA case: each compiles kernels for every scale
# (tens of seconds each), so that test workers on one GPU share them
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: d.__name__)
@pytest.mark.parametrize("implementation", ["mosaic", "triton"])
def test_extreme_logits_compiled(implementation, dtype, causal):
  if implementation == "mosaic" and not platform.is_hopper():
    pytest.skip("the Mosaic kernels run on Hopper (sm90) only")
  # T = 1000: full and ragged tiles; non-causal one-hot rows, causal rows with ties.
  for scale in SCALES:
    q, k, v = _inputs(1000, 128, dtype, ties=causal)
    do = _grad_inputs(q)
    fn = lambda q, k, v: fa2_jax.flash_attention(q, k, v, scale=scale, is_causal=causal,  # noqa: E731
                                                 implementation=implementation,
                                                 return_residual=True)
    out, lse, grads = _fwd_bwd(fn, q, k, v, do)
    _check(out, lse, q, k, v, scale=scale, causal=causal, grads=grads, do=do)


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["mosaic", "triton"])
def test_extreme_logits_gqa_compiled(implementation):
  """A GQA group whose query heads need different forms of P (bfloat16: float16 flushes q = 2^-28)."""
  if implementation == "mosaic" and not platform.is_hopper():
    pytest.skip("the Mosaic kernels run on Hopper (sm90) only")
  q, k, v = _gqa_inputs(1000, 128, jnp.bfloat16)
  do = _grad_inputs(q)
  fn = lambda q, k, v: fa2_jax.flash_attention(q, k, v, scale=1e9, implementation=implementation,  # noqa: E731
                                               return_residual=True)
  out, lse, grads = _fwd_bwd(fn, q, k, v, do)
  _check(out, lse, q, k, v, scale=1e9, causal=False, grads=grads, do=do)


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["mosaic", "triton"])
def test_tiny_scales_compiled(implementation):
  if implementation == "mosaic" and not platform.is_hopper():
    pytest.skip("the Mosaic kernels run on Hopper (sm90) only")
  for scale, causal in itertools.product(TINY_SCALES, (False, True)):
    fn = lambda q, k, v, scale=scale, causal=causal: fa2_jax.flash_attention(  # noqa: E731
        q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), scale=scale,
        is_causal=causal, implementation=implementation, return_residual=True)
    q, k, v = (jax.random.normal(jax.random.key(i), (1, 40, 2, 128), jnp.float32) for i in range(3))
    out, lse, grads = _fwd_bwd(fn, q, k, v, _grad_inputs(q).astype(jnp.bfloat16))
    for name, x in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads)):
      assert np.isfinite(np.asarray(x, np.float32)).all(), (scale, causal, name)
    # scale 0: every allowed key has the same logit, so lse = log(allowed keys of the row)
    allowed_keys = np.arange(1, 41) if causal else np.full(40, 40)
    np.testing.assert_allclose(np.asarray(lse),
                               np.broadcast_to(np.log(allowed_keys)[None, :, None], (1, 40, 2)),
                               atol=1e-5, err_msg=f"{scale} {causal}")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_extreme_logits_compiled_fused_dq(causal):
  if not platform.is_hopper():
    pytest.skip("the Mosaic kernels run on Hopper (sm90) only")
  for scale in SCALES:
    q, k, v = _inputs(1000, 128, jnp.bfloat16, ties=causal)
    do = _grad_inputs(q)
    cfg = _fused_dq_config(128, jnp.bfloat16, causal)
    assert cfg.fuses_dq(1000, deterministic=False)
    out, lse, grads = _mosaic_fwd_bwd(q, k, v, do, scale=scale, causal=causal, config=cfg)
    _check(out, lse, q, k, v, scale=scale, causal=causal, grads=grads, do=do)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True], ids=["separate_dq", "fused_dq"])
def test_extreme_logits_compiled_exact_form_everywhere(fused):
  """``MosaicConfig.backward_p="exact"`` compiled: every head in the exact form, at huge, negative
  and ordinary scales (the ordinary heads through the exact form too)."""
  if not platform.is_hopper():
    pytest.skip("the Mosaic kernels run on Hopper (sm90) only")
  for scale, causal in itertools.product((1e9, -1e9, 0.1), (False, True)):
    q, k, v = _inputs(1000, 128, jnp.bfloat16, ties=causal)
    do = _grad_inputs(q)
    cfg = (_fused_dq_config(128, jnp.bfloat16, causal) if fused else
           fa2_jax.MosaicConfig.default(128, jnp.bfloat16, causal)).replace(backward_p="exact")
    out, lse, grads = _mosaic_fwd_bwd(q, k, v, do, scale=scale, causal=causal, config=cfg)
    _check(out, lse, q, k, v, scale=scale, causal=causal, grads=grads, do=do)
