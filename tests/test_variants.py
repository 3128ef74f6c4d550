"""Attention variants (lengths, window, segments, q_offset, soft cap, ALiBi, mask_fn, score_fn):
out, lse and gradients against an independent float64 numpy reference, alone and combined; the
fully-masked-row and NaN contracts; transforms; the chunked formula; the block ranges of
``fa2_jax.kernels.masking``; dispatch; and every argument error.

The numpy reference below shares no code with ``fa2_jax``: it builds the explicit ``[B, N, T, S]`` mask
from the rules as the design states them and differentiates by the textbook formulas
(``dP = dO V^T``, ``dS = P * (dP - rowsum(dO * O) + dlse)``, chained through the score
modifications), loop-free.
"""
from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa2_jax
from fa2_jax.kernels import platform
from fa2_jax.kernels import block_ranges, masking
from fa2_jax.kernels.masking import Variant, VariantArrays

# --- implementations under test -------------------------------------------------------------------
# Every backend that implements the variants (each Backend.features), on float32 inputs:
# the Triton kernels in interpret mode off a GPU.
IMPLEMENTATIONS = {
    "xla": dict(implementation="xla"),
    "triton": dict(implementation="triton", interpret=jax.default_backend() == "cpu"),
}
# max |error| / (max |reference| + 1), float32 inputs vs the float64 reference
TOL = {"xla": 2e-5, "triton": 2e-5}


# --- the independent numpy reference --------------------------------------------------------------

@dataclasses.dataclass
class Spec:
  """A variant in the test's own terms (numpy arrays; None = absent)."""

  causal: bool = False
  window: tuple | None = None  # (left, right), None sides unbounded
  q_len: np.ndarray | None = None  # [B]
  kv_len: np.ndarray | None = None  # [B]
  q_seg: np.ndarray | None = None  # [B, T]
  kv_seg: np.ndarray | None = None  # [B, S]
  q_offset: np.ndarray | None = None  # [B]
  cap: float | None = None
  slopes: np.ndarray | None = None  # [B, N]
  mask_np: object = None  # (b, h, p, j) -> bool, numpy
  mask_jnp: object = None  # the same rule for fa2_jax
  score: tuple | None = None  # (fn_np, dfn_np, fn_jnp): s -> s', ds'/ds, same rule for fa2_jax

  def kwargs(self, b, n):
    kw = {}
    if self.causal:
      kw["is_causal"] = True
    if self.window is not None:
      kw["local_window_size"] = self.window
    if self.q_len is not None:
      kw["query_seq_lengths"] = jnp.asarray(self.q_len, jnp.int32)
    if self.kv_len is not None:
      kw["key_value_seq_lengths"] = jnp.asarray(self.kv_len, jnp.int32)
    if self.q_seg is not None:
      kw["q_segment_ids"] = jnp.asarray(self.q_seg, jnp.int32)
      kw["kv_segment_ids"] = jnp.asarray(self.kv_seg, jnp.int32)
    if self.q_offset is not None:
      kw["q_offset"] = jnp.asarray(self.q_offset, jnp.int32)
    if self.cap is not None:
      kw["logits_soft_cap"] = self.cap
    if self.slopes is not None:
      kw["alibi_slopes"] = jnp.asarray(self.slopes, jnp.float32)
    if self.mask_jnp is not None:
      kw["mask_fn"] = self.mask_jnp
    if self.score is not None:
      kw["score_fn"] = self.score[2]
    return kw


def np_mask(spec: Spec, b, n, t, s):
  """The explicit ``[B, N, T, S]`` mask and the absolute positions ``p [B, 1, T, 1]``, ``j``."""
  bi = np.arange(b)[:, None, None, None]
  hi = np.arange(n)[None, :, None, None]
  i = np.arange(t)[None, None, :, None]
  j = np.arange(s)[None, None, None, :]
  off = np.zeros(b, np.int64) if spec.q_offset is None else np.asarray(spec.q_offset, np.int64)
  p = off[:, None, None, None] + i
  allow = np.ones((b, n, t, s), bool)
  if spec.causal:
    allow &= j <= p
  if spec.window is not None:
    left, right = spec.window
    if left is not None:
      allow &= j >= p - left
    if right is not None:
      allow &= j <= p + right
  if spec.q_len is not None:
    allow &= i < np.asarray(spec.q_len)[:, None, None, None]
  if spec.kv_len is not None:
    allow &= j < np.asarray(spec.kv_len)[:, None, None, None]
  if spec.q_seg is not None:
    allow &= np.asarray(spec.q_seg)[:, None, :, None] == np.asarray(spec.kv_seg)[:, None, None, :]
  if spec.mask_np is not None:
    allow &= np.broadcast_to(spec.mask_np(bi, hi, p, j), allow.shape)
  return allow, bi, hi, p, j


def np_attention(q, k, v, spec: Spec, scale, dout, dlse):
  """float64 out ``[B, T, N, H]``, lse ``[B, T, N]`` and (dq, dk, dv) for cotangents (dout, dlse)."""
  q, k, v, dout, dlse = (np.asarray(x, np.float64) for x in (q, k, v, dout, dlse))
  b, t, n, hd = q.shape
  s, kh = k.shape[1], k.shape[2]
  g = n // kh
  kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # head h reads KV head h // G
  allow, bi, hi, p, j = np_mask(spec, b, n, t, s)
  x = np.einsum("btnh,bsnh->bnts", q, kr) * scale  # scaled logits
  d = np.ones_like(x)  # d s_final / d x
  sc = x
  if spec.cap is not None:
    sc = spec.cap * np.tanh(x / spec.cap)
    d = d * (1 - np.tanh(x / spec.cap) ** 2)
  if spec.slopes is not None:
    sc = sc - np.asarray(spec.slopes, np.float64)[:, :, None, None] * np.abs(p - j)
  if spec.score is not None:
    fn, dfn, _ = spec.score
    d = d * dfn(sc, bi, hi, p, j)
    sc = fn(sc, bi, hi, p, j)
  sc = np.where(allow, sc, -np.inf)
  has = allow.any(-1)  # [B, N, T]
  m = np.where(has, np.where(allow, sc, -np.inf).max(-1, initial=-np.inf), 0.0)
  e = np.where(allow, np.exp(np.where(allow, sc - m[..., None], 0.0)), 0.0)
  l = e.sum(-1)
  prob = e / np.where(has, l, 1.0)[..., None]  # [B, N, T, S]
  lse = np.where(has, m + np.log(np.where(has, l, 1.0)), -np.inf)
  out = np.einsum("bnts,bsnh->btnh", prob, vr)
  # Backward.
  do = np.swapaxes(dout, 1, 2)  # [B, N, T, H]
  dl = dlse.transpose(0, 2, 1)  # [B, N, T]; rows with no key have P = 0, so it drops out
  dp = np.einsum("bnth,bsnh->bnts", do, vr)
  delta = np.einsum("bnth,btnh->bnt", do, out)
  ds = prob * (dp - delta[..., None] + dl[..., None]) * d  # d loss / d x
  dq = np.einsum("bnts,bsnh->btnh", ds, kr) * scale
  dk = (np.einsum("bnts,btnh->bsnh", ds, q) * scale).reshape(b, s, kh, g, hd).sum(3)
  dv = np.einsum("bnts,bnth->bsnh", prob, do).reshape(b, s, kh, g, hd).sum(3)
  return out, np.swapaxes(lse, 1, 2), (dq, dk, dv)


# --- helpers --------------------------------------------------------------------------------------

def qkv(b, t, s, n, kh, h=8, seed=0, dtype=jnp.float32):
  """Random q, k, v and cotangents dout, dlse (numpy's generator: nothing to compile)."""
  rng = np.random.default_rng(seed)
  shapes = ((b, t, n, h), (b, s, kh, h), (b, s, kh, h), (b, t, n, h), (b, t, n))
  return tuple(jnp.asarray(rng.standard_normal(shape), dtype) for shape in shapes)


def make_run(kw, entry=fa2_jax.flash_attention):
  """A jitted ``(q, k, v, dout, dlse) -> ((out, lse), (dq, dk, dv))`` of ``entry(..., **kw)`` with
  ``return_residual=True`` (one compilation per case; eager dispatch would compile every op)."""
  f = lambda a, b_, c: entry(a, b_, c, return_residual=True, **kw)  # noqa: E731

  @jax.jit
  def fwd_bwd(q, k, v, dout, dlse):
    res, vjp = jax.vjp(f, q, k, v)
    return res, vjp((dout, dlse))

  return fwd_bwd


def run(q, k, v, dout, dlse, kw):
  return make_run(kw)(q, k, v, dout, dlse)


def assert_close(got, want, tol, what):
  got = np.asarray(got, np.float64)
  assert got.shape == want.shape, (what, got.shape, want.shape)
  fin = np.isfinite(want)
  np.testing.assert_array_equal(np.isfinite(got), fin, err_msg=f"{what}: finiteness")
  np.testing.assert_array_equal(got[~fin], want[~fin], err_msg=f"{what}: infinities")
  err = np.max(np.abs(got[fin] - want[fin]), initial=0.0)
  bound = tol * (np.max(np.abs(want[fin]), initial=0.0) + 1)
  assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


def check_against_numpy(impl, spec, b, t, s, n, kh, h=8, seed=0):
  q, k, v, dout, dlse = qkv(b, t, s, n, kh, h, seed)
  kw = dict(IMPLEMENTATIONS[impl], **spec.kwargs(b, n))
  (out, lse), grads = run(q, k, v, dout, dlse, kw)
  out_ref, lse_ref, grads_ref = np_attention(q, k, v, spec, 1 / np.sqrt(h), dout, dlse)
  tol = TOL[impl]
  assert_close(out, out_ref, tol, "out")
  assert_close(lse, lse_ref, tol, "lse")
  for name, g, r in zip(("dq", "dk", "dv"), grads, grads_ref):
    assert_close(g, r, tol, name)
  return out, lse, grads


B, N, KH = 2, 4, 2  # GQA: two query heads per KV head


def _packed(lengths_per_batch, total):
  """Segment ids ``[B, total]`` of packed documents of the given lengths (rest: the last id)."""
  rows = [np.repeat(np.arange(len(lens)), lens)[:total] for lens in lengths_per_batch]
  return np.stack([np.pad(r, (0, total - len(r)), mode="edge") for r in rows]).astype(np.int32)


def _score_fn():
  # s * (1 + h/10) + (p - j) / 50: depends on the score, the head and the positions.
  fn_np = lambda x, b, h, p, j: x * (1 + h / 10) + (p - j) / 50  # noqa: E731
  dfn_np = lambda x, b, h, p, j: np.broadcast_to(1 + h / 10, x.shape)  # noqa: E731
  fn_jnp = lambda x, b, h, p, j: (x * (1 + h.astype(x.dtype) / 10)  # noqa: E731
                                  + (p - j).astype(x.dtype) / 50)
  return fn_np, dfn_np, fn_jnp


def specs(t, s):
  """One Spec per variant alone, and the combination, for lengths T, S."""
  q_len = np.array([t - 3, 0 if t > 4 else 1])
  kv_len = np.array([s, max(1, s - 5)])
  slopes = np.array([[0.5, 0.25, 0.125, 0.0625], [0.3, 0.2, 0.1, 0.05]], np.float32)
  off = np.array([s - t, 3])
  return {
      "dense": Spec(),
      "causal": Spec(causal=True),
      "causal_bottom_right": Spec(causal=True, q_offset=np.array([s - t, s - t])),
      "window_sym": Spec(window=(3, 3)),
      "window_left": Spec(window=(4, None)),
      "window_right": Spec(window=(None, 2)),
      "window_zero": Spec(window=(0, 0)),
      "causal_window": Spec(causal=True, window=(5, 3)),
      "q_lengths": Spec(q_len=q_len),
      "kv_lengths": Spec(kv_len=kv_len),
      "segments": Spec(q_seg=_packed([[5, 4, t], [t]], t), kv_seg=_packed([[7, 6, s], [s]], s)),
      "offset_window": Spec(window=(2, 1), q_offset=off),
      "soft_cap": Spec(cap=1.5),
      "alibi": Spec(slopes=slopes, q_offset=off),
      # queries 2^30 positions from every key, both sides: the bias is taken from each row's nearest
      # key (masking.alibi_nearest_key); as |p - j| in float32 it swamped the logits (80% off)
      "alibi_far_offset": Spec(slopes=slopes, q_offset=np.array([2 ** 30 - 1 - t, 1 - 2 ** 30])),
      "mask_fn": Spec(mask_np=lambda b, h, p, j: ((p - j) % 3 != 1) | (h == 0),
                      mask_jnp=lambda b, h, p, j: ((p - j) % 3 != 1) | (h == 0)),
      "score_fn": Spec(score=_score_fn()),
      "combined": Spec(causal=True, window=(6, None), q_len=q_len, kv_len=kv_len,
                       q_seg=_packed([[4, 5, t], [2, t]], t), kv_seg=_packed([[6, 5, s], [4, s]], s),
                       q_offset=off, cap=2.0, slopes=slopes,
                       mask_np=lambda b, h, p, j: (j != 1) | (b == 1),
                       mask_jnp=lambda b, h, p, j: (j != 1) | (b == 1), score=_score_fn()),
  }


VARIANTS = list(specs(8, 8))
# T < S for every variant; T > S for those where the alignment matters.
CASES = [(v, 13, 21) for v in VARIANTS] + [
    (v, 21, 13) for v in ("causal", "causal_bottom_right", "offset_window", "q_lengths", "segments",
                          "combined")]
# Triton cases marked slow (CI time: each compiles its kernels, about 3 s): no variant (dense,
# causal), which test_attention.py runs on the kernels at T < S and T > S; window sides that the
# others combine (window_zero; window_left's open right side in "combined", causal_window's causal
# window in "combined" and its two sides in window_sym); and T > S of the variants "combined" holds.
# The formula runs every case in CI.
TRITON_SLOW = {("dense", 13, 21), ("causal", 13, 21), ("window_zero", 13, 21), ("window_left", 13, 21),
               ("causal_window", 13, 21), ("causal", 21, 13), ("causal_bottom_right", 21, 13),
               ("offset_window", 21, 13), ("q_lengths", 21, 13), ("segments", 21, 13)}


# --- every variant, alone and combined ------------------------------------------------------------

@pytest.mark.parametrize("impl, variant, t, s", [
    pytest.param(impl, *case, id=f"{case[0]}-{case[1]}-{case[2]}-{impl}",
                 marks=[pytest.mark.slow] if impl == "triton" and case in TRITON_SLOW else [])
    for case in CASES for impl in IMPLEMENTATIONS])
def test_variant_matches_numpy(impl, variant, t, s):
  check_against_numpy(impl, specs(t, s)[variant], B, t, s, N, KH)


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_mqa_and_equal_lengths(impl):
  check_against_numpy(impl, specs(16, 16)["combined"], B, 16, 16, N, 1)


def test_float64_reference_is_exact():
  with jax.enable_x64(True):
    q, k, v, dout, dlse = qkv(B, 11, 17, N, KH, seed=3, dtype=jnp.float64)
    spec = specs(11, 17)["combined"]
    (out, lse), grads = make_run(spec.kwargs(B, N), fa2_jax.reference_attention)(
        q, k, v, dout, dlse)
    assert out.dtype == jnp.float64 and lse.dtype == jnp.float64
    out_ref, lse_ref, grads_ref = np_attention(q, k, v, spec, 1 / np.sqrt(8), dout, dlse)
    assert_close(out, out_ref, 1e-12, "out")
    assert_close(lse, lse_ref, 1e-12, "lse")
    for name, g, r in zip(("dq", "dk", "dv"), grads, grads_ref):
      assert_close(g, r, 1e-12, name)


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_variant_constants_at_the_ends_of_their_ranges_stay_finite(impl):
  """Arguments inside their documented ranges whose folded constants leave float32's range (found by
  adversarial passes; each gave NaN or a wrong result before): a soft cap of 1e-30 with scale 1e9
  (the kernels' factor scale / cap, 1e39, met a logit of exactly 0: a zero query row, a zero key); a
  soft cap with scale 1e38 (the formula's q * scale overflowed); scale / cap below the smallest
  normal float (refused by flash_attention; the formula computes it); an ALiBi slope of -9.9e29 at a
  query 2^30 - 10 from the keys (slope * distance is -inf, and a row with no key got lse
  -inf - (-inf))."""
  kw = IMPLEMENTATIONS[impl]
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((1, 4, 1, 8)), jnp.float32).at[0, 1].set(0.0)
  k = jnp.asarray(rng.standard_normal((1, 6, 1, 8)), jnp.float32).at[0, 2].set(0.0)
  v = jnp.asarray(rng.standard_normal((1, 6, 1, 8)), jnp.float32)

  def np_capped(q, cap, scale):  # float64: softmax(cap * tanh(scale * q.k / cap)) v
    z = np.einsum("th,sh->ts", np.float64(q[0, :, 0]), np.float64(k[0, :, 0])) * scale
    logits = cap * np.tanh(z / cap)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ np.float64(v[0, :, 0])

  out, lse = fa2_jax.flash_attention(q, k, v, logits_soft_cap=1e-30, scale=1e9,
                                     return_residual=True, **kw)
  np.testing.assert_allclose(out[0, :, 0], np_capped(q, 1e-30, 1e9), atol=1e-6)
  grads = jax.grad(lambda q, k, v: fa2_jax.flash_attention(
      q, k, v, logits_soft_cap=1e-30, scale=1e9, **kw).sum(), argnums=(0, 1, 2))(q, k, v)
  assert all(bool(jnp.isfinite(g).all()) for g in grads)

  q5 = jnp.full((1, 4, 1, 8), 5.0).at[0, :, 0, ::2].set(-5.0)
  out = fa2_jax.flash_attention(q5, k, v, logits_soft_cap=1.0, scale=1e38, **kw)
  np.testing.assert_allclose(out[0, :, 0], np_capped(q5, 1.0, 1e38), atol=1e-5)

  # The other end: scale / cap below float32's smallest normal would flush the kernels' factor to 0
  # (every logit 0); flash_attention refuses it, naming both arguments, and the formula (which
  # keeps a scale of at most 1 on q) computes it: scaled logits about 6, left as they are by the cap.
  big = q * 1e4, k * 1e4
  with pytest.raises(ValueError, match=r"scale / logits_soft_cap must be 0 or at least 1.18e-38"):
    fa2_jax.flash_attention(*big, v, logits_soft_cap=1e30, scale=1e-9, **kw)
  np.testing.assert_allclose(
      fa2_jax.reference_attention(*big, v, logits_soft_cap=1e30, scale=1e-9)[0, :, 0],
      np_capped(q * 1e8, 1e30, 1e-9), atol=1e-5)

  out, lse = fa2_jax.flash_attention(q, k, v, alibi_slopes=jnp.array([-9.9e29]),
                                     q_offset=2 ** 30 - 10, query_seq_lengths=jnp.array([2]),
                                     return_residual=True, **kw)
  assert np.all(np.asarray(lse[0, 2:]) == -np.inf) and not np.any(np.asarray(out[0, 2:]))
  assert not np.isnan(np.asarray(lse)).any() and bool(jnp.isfinite(out).all())


# --- rows with no key, NaN in masked positions ----------------------------------------------------

@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("case", ["q_len_zero", "kv_len_zero", "no_segment", "window_before_keys",
                                  "mask_fn_none", "score_fn_minus_inf"])
def test_rows_without_keys(impl, case):
  t, s = 6, 9
  q, k, v, dout, dlse = qkv(B, t, s, N, KH, seed=1)
  kw = {
      "q_len_zero": dict(query_seq_lengths=jnp.array([0, 0])),
      "kv_len_zero": dict(key_value_seq_lengths=jnp.array([0, 0])),
      "no_segment": dict(q_segment_ids=np.zeros((B, t), np.int32),
                         kv_segment_ids=np.ones((B, s), np.int32)),
      "window_before_keys": dict(is_causal=True, q_offset=-t),  # every position < 0
      "mask_fn_none": dict(mask_fn=lambda b, h, p, j: p < -1),
      "score_fn_minus_inf": dict(score_fn=lambda x, b, h, p, j: x - jnp.inf),
  }[case]
  (out, lse), grads = run(q, k, v, dout, dlse, dict(IMPLEMENTATIONS[impl], **kw))
  assert not np.any(np.asarray(out))
  assert np.all(np.asarray(lse) == -np.inf)
  for g in grads:
    assert not np.any(np.asarray(g)), "a row with no key has zero gradients"


# slow on the kernels (CI time): causal_unreached_keys, which test_numerical_safety.py's
# test_unattended_nonfinite_keys_triton runs there with every poison, at two lengths
@pytest.mark.parametrize("impl, case", [
    pytest.param(impl, case, id=f"{case}-{impl}",
                 marks=[pytest.mark.slow] if (impl, case) == ("triton", "causal_unreached_keys") else [])
    for case in ("padded_rows_and_keys", "dead_segment", "causal_unreached_keys",
                 "window_unreached_keys", "soft_cap_and_score_fn") for impl in IMPLEMENTATIONS])
def test_poison_in_masked_positions_never_reaches_results(impl, case):
  t, s = 7, 12
  q, k, v, dout, dlse = qkv(B, t, s, N, KH, seed=2)
  kw, poisoned = {}, []
  for poison in (np.nan, np.inf, -np.inf):
    qn, kn, vn = (np.array(x) for x in (q, k, v))
    kw = _poison(case, poison, qn, kn, vn, t)
    poisoned.append(tuple(jnp.asarray(x) for x in (qn, kn, vn)))
  kw.update(IMPLEMENTATIONS[impl])
  fwd_bwd = make_run(kw)
  clean = fwd_bwd(q, k, v, dout, dlse)
  for qn, kn, vn in poisoned:
    dirty = fwd_bwd(qn, kn, vn, dout, dlse)
    for c, d in zip(jax.tree.leaves(clean), jax.tree.leaves(dirty)):
      c, d = np.asarray(c), np.asarray(d)
      assert np.all(np.isfinite(d) | (d == -np.inf)), "poison reached a result"
      np.testing.assert_allclose(d, c, atol=1e-6)


def _poison(case, poison, qn, kn, vn, t):
  """Write ``poison`` into the positions ``case`` masks out (in place); the call's kwargs."""
  kw = {}
  if case in ("padded_rows_and_keys", "soft_cap_and_score_fn"):
    kw = dict(query_seq_lengths=jnp.array([5, 2]), key_value_seq_lengths=jnp.array([9, 4]))
    qn[0, 5:], qn[1, 2:] = poison, poison
    kn[0, 9:], kn[1, 4:], vn[0, 9:], vn[1, 4:] = poison, poison, poison, poison
    if case == "soft_cap_and_score_fn":
      kw.update(logits_soft_cap=3.0, alibi_slopes=np.full((N,), 0.5, np.float32),
                score_fn=lambda x, b, h, p, j: jnp.sin(x) * x)
  elif case == "dead_segment":  # keys 8.. hold segment 9, which no query has
    kv_seg = np.zeros((B, kn.shape[1]), np.int32)
    kv_seg[:, 8:] = 9
    kw = dict(q_segment_ids=np.zeros((B, t), np.int32), kv_segment_ids=kv_seg)
    kn[:, 8:], vn[:, 8:] = poison, poison
  elif case == "causal_unreached_keys":  # T < S, top-left: keys >= T are never attended
    kw = dict(is_causal=True)
    kn[:, t:], vn[:, t:] = poison, poison
  else:  # window reaching keys [p - 1, p + 1] only, p < T
    kw = dict(local_window_size=1)
    kn[:, t + 1:], vn[:, t + 1:] = poison, poison
  return kw


# --- transforms -----------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_jit_with_traced_lengths_offsets_and_segments(impl):
  t, s = 10, 14
  spec = specs(t, s)["combined"]
  q, k, v, dout, dlse = qkv(B, t, s, N, KH, seed=4)
  kw = spec.kwargs(B, N)
  traced = {name: kw.pop(name) for name in ("query_seq_lengths", "key_value_seq_lengths",
                                             "q_segment_ids", "kv_segment_ids", "q_offset",
                                             "alibi_slopes")}

  def loss(q, k, v, arrays):
    out, lse = fa2_jax.flash_attention(q, k, v, return_residual=True, **arrays, **kw,
                                       **IMPLEMENTATIONS[impl])
    return jnp.sum(out * dout) + jnp.sum(jnp.where(jnp.isfinite(lse), lse * dlse, 0))

  val, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v, traced)
  out_ref, lse_ref, grads_ref = np_attention(q, k, v, spec, 1 / np.sqrt(8), dout, dlse)
  fin = np.isfinite(lse_ref)
  want_val = np.sum(out_ref * np.asarray(dout, np.float64)) + np.sum(
      np.where(fin, lse_ref, 0) * np.asarray(dlse, np.float64))
  np.testing.assert_allclose(val, want_val, rtol=1e-5)
  for name, g, r in zip(("dq", "dk", "dv"), grads, grads_ref):
    assert_close(g, r, TOL[impl], f"{name} under jit")


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_vmap_of_rank3_calls_with_scalar_lengths(impl):
  t, s = 9, 11
  q, k, v, _, _ = qkv(B, t, s, N, KH, seed=5)
  q_len, kv_len, off = jnp.array([9, 4]), jnp.array([7, 11]), jnp.array([2, -1])
  kw = dict(is_causal=True, local_window_size=(4, 0), **IMPLEMENTATIONS[impl])
  call = lambda a, b_, c, ql, kl, o: fa2_jax.flash_attention(  # noqa: E731
      a, b_, c, query_seq_lengths=ql, key_value_seq_lengths=kl, q_offset=o, **kw)
  got = jax.jit(jax.vmap(call))(q, k, v, q_len, kv_len, off)
  want = jax.jit(call)(q, k, v, q_len, kv_len, off)
  spec = Spec(causal=True, window=(4, 0), q_len=np.asarray(q_len), kv_len=np.asarray(kv_len),
              q_offset=np.asarray(off))
  zeros = np.zeros(q.shape)
  assert_close(want, np_attention(q, k, v, spec, 1 / np.sqrt(8), zeros, zeros[..., 0])[0],
               TOL[impl], "out")
  np.testing.assert_allclose(got, want, atol=1e-6)
  rank3 = jax.jit(lambda a, b_, c: fa2_jax.flash_attention(
      a, b_, c, query_seq_lengths=4, key_value_seq_lengths=11, q_offset=-1, **kw))(q[1], k[1], v[1])
  np.testing.assert_allclose(rank3, want[1], atol=1e-6)


def np_slopes_grad(q, k, v, spec: Spec, scale, dout, dlse, eps=1e-4):
  """d (sum out * dout + sum lse * dlse) / d slopes ``[B, N]`` of :func:`np_attention` (float64), by
  central differences."""
  grad = np.zeros(spec.slopes.shape)
  for idx in np.ndindex(*spec.slopes.shape):
    loss = []
    for sign in (1, -1):
      sl = np.array(spec.slopes, np.float64)
      sl[idx] += sign * eps
      out, lse, _ = np_attention(q, k, v, dataclasses.replace(spec, slopes=sl), scale, dout, dlse)
      loss.append(np.sum(out * np.asarray(dout, np.float64))
                  + np.sum(np.where(np.isfinite(lse), lse, 0) * np.asarray(dlse, np.float64)))
    grad[idx] = (loss[0] - loss[1]) / (2 * eps)
  return grad


_SLOPES = np.array([[0.5, 0.25, 0.125, 0.0625], [0.3, 0.2, 0.1, 0.05]])
ALIBI_GRAD_CASES = {
    # the distances from each row's nearest key (no score_fn), rows past the keys both sides
    "offsets": Spec(slopes=_SLOPES, q_offset=np.array([30, -4])),
    # a soft cap before, a score_fn after (its derivative in the slopes' chain), causal, lengths
    "cap_score_fn_lengths": Spec(causal=True, cap=2.0, slopes=_SLOPES, score=_score_fn(),
                                 q_len=np.array([11, 13]), kv_len=np.array([21, 9])),
}


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("case", list(ALIBI_GRAD_CASES))
def test_alibi_slopes_are_differentiated(impl, case):
  """The gradient with respect to alibi_slopes (once silently zero), together with the
  query's, against float64 finite differences and the numpy gradient; ``[N]`` slopes get the sum
  over the batch."""
  spec = ALIBI_GRAD_CASES[case]
  t, s = 13, 21
  q, k, v, dout, dlse = qkv(B, t, s, N, KH, seed=13)
  kw = dict(IMPLEMENTATIONS[impl], **spec.kwargs(B, N))
  del kw["alibi_slopes"]

  def loss(q, slopes):
    out, lse = fa2_jax.flash_attention(q, k, v, alibi_slopes=slopes, return_residual=True, **kw)
    return jnp.sum(out * dout) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0) * dlse)

  grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
  dq, dslopes = grad(q, jnp.asarray(spec.slopes, jnp.float32))
  want = np_slopes_grad(q, k, v, spec, 1 / np.sqrt(8), dout, dlse)
  assert_close(dslopes, want, 1e-4, "dslopes")
  assert_close(dq, np_attention(q, k, v, spec, 1 / np.sqrt(8), dout, dlse)[2][0], TOL[impl], "dq")
  shared = spec.slopes[0]
  _, d_shared = grad(q, jnp.asarray(shared, jnp.float32))
  assert_close(d_shared, np_slopes_grad(q, k, v, dataclasses.replace(
      spec, slopes=np.broadcast_to(shared, (B, N))), 1 / np.sqrt(8), dout, dlse).sum(0), 1e-4,
      "dslopes [N]")


def test_alibi_slopes_gradient_on_the_mosaic_kernels_raises(monkeypatch):
  """The Mosaic kernels do not differentiate the slopes: a gradient asked of them raises, naming
  alibi_slopes and the ways out (traced for sm90 on the CPU); a gradient of the query alone runs."""
  monkeypatch.setattr(platform, "on_gpu", lambda: True)
  monkeypatch.setattr(platform, "gpu_compute_capability", lambda: (9, 0))
  q = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)
  slopes = jax.ShapeDtypeStruct((2,), jnp.float32)

  def loss(q, slopes):
    return fa2_jax.flash_attention(q, q, q, alibi_slopes=slopes, implementation="mosaic").astype(
        jnp.float32).sum()

  with pytest.raises(TypeError, match=r"alibi_slopes.*stop_gradient.*'triton' or 'xla'"):
    jax.jit(jax.grad(loss, argnums=1)).trace(q, slopes)
  jax.jit(jax.grad(loss)).trace(q, slopes)
  jax.jit(jax.grad(lambda q, sl: loss(q, jax.lax.stop_gradient(sl)), argnums=(0, 1))).trace(q, slopes)


def test_score_fn_closing_over_an_array_on_the_formula_path():
  t, s = 6, 8
  q, k, v, _, _ = qkv(B, t, s, N, KH)
  bias = jnp.asarray(np.random.default_rng(9).standard_normal((t, s)), jnp.float32)
  f = lambda bias: fa2_jax.flash_attention(  # noqa: E731
      q, k, v, implementation="xla", score_fn=lambda x, b, h, p, j: x + bias[p, j]).sum()
  # Compare with a dense bias added by hand.
  spec = Spec(score=(lambda x, b, h, p, j: x + np.asarray(bias, np.float64)[p, j],
                     lambda x, b, h, p, j: np.ones_like(x), None))
  out_ref, _, _ = np_attention(q, k, v, spec, 1 / np.sqrt(8), np.zeros(q.shape), np.zeros(q.shape[:3]))
  val, grad = jax.jit(jax.value_and_grad(f))(bias)
  np.testing.assert_allclose(val, out_ref.sum(), rtol=1e-5)
  assert np.any(np.asarray(grad))  # the closed-over array is differentiated


# --- the chunked formula --------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["dense", "combined"])
def test_chunked_formula_matches_one_block_and_numpy(variant):
  t, s = 37, 29  # 37 rows in blocks of 8: a ragged last block
  spec = specs(t, s)[variant]
  q, k, v, dout, dlse = qkv(B, t, s, N, KH, seed=6)
  one = make_run(spec.kwargs(B, N), fa2_jax.reference_attention)(q, k, v, dout, dlse)
  chunked = make_run(dict(spec.kwargs(B, N), query_block=8), fa2_jax.reference_attention)(
      q, k, v, dout, dlse)
  for a, c in zip(jax.tree.leaves(one), jax.tree.leaves(chunked)):
    np.testing.assert_allclose(c, a, atol=2e-6)
  out_ref, lse_ref, grads_ref = np_attention(q, k, v, spec, 1 / np.sqrt(8), dout, dlse)
  for name, g, r in zip(("out", "lse", "dq", "dk", "dv"), jax.tree.leaves(chunked),
                        (out_ref, lse_ref, *grads_ref)):
    assert_close(g, r, 2e-5, name)


def test_long_calls_run_chunked_in_linear_memory():
  """T = S = 4096: the compiled gradient's temporaries stay below one [T, S] float32 score matrix
  (the one-block formula needs several)."""
  t = 4096
  spec = jax.ShapeDtypeStruct((1, t, 1, 16), jnp.float32)
  f = lambda q, k, v: fa2_jax.flash_attention(q, k, v, is_causal=True, local_window_size=64,  # noqa
                                              implementation="xla").sum()
  mem = jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(spec, spec, spec).compile().memory_analysis()
  assert mem.temp_size_in_bytes < t * t * 4, mem.temp_size_in_bytes


# --- mask_fn / score_fn against the built-in rules ------------------------------------------------

@pytest.mark.parametrize("builtin, fn, offset", [
    (dict(is_causal=True), lambda b, h, p, j: j <= p, None),
    (dict(local_window_size=(3, 1)), lambda b, h, p, j: (j >= p - 3) & (j <= p + 1), 4),
    (dict(is_causal=True, local_window_size=2), lambda b, h, p, j: (j >= p - 2) & (j <= p), -2),
])
def test_mask_fn_equal_to_a_builtin_rule(builtin, fn, offset):
  q, k, v, dout, dlse = qkv(B, 9, 13, N, KH, seed=7)
  kw = {} if offset is None else dict(q_offset=offset)
  a = run(q, k, v, dout, dlse, dict(builtin, **kw))
  b = run(q, k, v, dout, dlse, dict(mask_fn=fn, **kw))
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)


def test_score_fn_equal_to_soft_cap():
  q, k, v, dout, dlse = qkv(B, 9, 13, N, KH, seed=8)
  a = run(q, k, v, dout, dlse, dict(logits_soft_cap=1.5, is_causal=True))
  b = run(q, k, v, dout, dlse, dict(score_fn=lambda x, b, h, p, j: 1.5 * jnp.tanh(x / 1.5),
                                    is_causal=True))
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, atol=1e-6)


# Functions that are not elementwise on arrays (`j <= jnp.min(i)` and `jnp.sum(i)` were once accepted
# and reduced over whatever array a path passed, the formula's whole grid or a kernel's tile: results
# 3.7 apart). They are called per pair, with scalars, so a reduction is over one element.
NOT_ELEMENTWISE = Spec(
    mask_np=lambda b, h, p, j: (j <= p) | ((p + j) % 3 == 0),
    mask_jnp=lambda b, h, p, j: (j <= jnp.min(p)) | ((jnp.sum(p) + j) % 3 == 0),
    score=(lambda x, b, h, p, j: 0.9 * x + (p - j) / 64,
           lambda x, b, h, p, j: np.full_like(x, 0.9),
           lambda x, b, h, p, j: x - 0.1 * jnp.max(x) + (jnp.sum(p) - j).astype(x.dtype) / 64),
    q_offset=np.array([3, -2]))


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_user_functions_are_called_per_pair(impl):
  """Out, lse and gradients of both paths equal the numpy reference of the per-pair meaning."""
  check_against_numpy(impl, NOT_ELEMENTWISE, B, 37, 45, N, KH, seed=12)


def test_user_functions_are_traced_on_scalars():
  seen = []
  def mask_fn(b, h, p, j):
    seen.append(tuple(jnp.shape(x) for x in (b, h, p, j)))
    return j <= p
  q, k, v, _, _ = qkv(B, 9, 13, N, KH)
  fa2_jax.flash_attention(q, k, v, mask_fn=mask_fn, implementation="triton", interpret=True)
  fa2_jax.flash_attention(q, k, v, mask_fn=mask_fn, implementation="xla")
  assert seen and set(seen) == {((), (), (), ())}, set(seen)


def test_a_mask_fn_the_kernels_cannot_evaluate_per_pair_runs_the_formula():
  """A function whose trace on one pair is not elementwise (an iota, a loop) cannot run on a
  kernel's tile: implementation=None runs the formula, an explicit kernel names the cause."""
  q, k, v, _, _ = qkv(B, 9, 13, N, KH)
  fn = lambda b, h, p, j: jnp.any(jnp.arange(3) == (p - j) % 5)  # noqa: E731
  d = fa2_jax.backend_for(q, k, mask_fn=fn, interpret=True)
  assert d.backend == "xla" and "mask_fn" in d.reason and "iota" in d.reason, d
  with pytest.raises(ValueError, match="implementation='triton' cannot run this call: it cannot take a mask_fn.*iota"):
    fa2_jax.flash_attention(q, k, v, mask_fn=fn, implementation="triton", interpret=True)
  spec = Spec(mask_np=lambda b, h, p, j: (p - j) % 5 < 3, mask_jnp=fn)
  check_against_numpy("xla", spec, B, 9, 13, N, KH)
  loop = lambda x, b, h, p, j: jax.lax.fori_loop(0, 2, lambda i, y: y * 0.5, x)  # noqa: E731
  d = fa2_jax.backend_for(q, k, score_fn=loop, interpret=True)
  assert d.backend == "xla" and "score_fn" in d.reason, d


# --- fa2_jax.kernels.masking: the elementwise rule and scores on kernel-shaped tiles ----------------------

def test_allowed_keeps_the_causal_kernel_form():
  q_pos = jnp.arange(4, dtype=jnp.int32)[:, None]
  k_pos = jnp.arange(6, dtype=jnp.int32)[None, :]
  np.testing.assert_array_equal(masking.allowed(q_pos, k_pos, is_causal=True),
                                np.arange(6)[None, :] <= np.arange(4)[:, None])
  np.testing.assert_array_equal(masking.allowed(q_pos, k_pos, is_causal=False, seq_k=5),
                                np.broadcast_to(np.arange(6) < 5, (4, 6)))
  assert masking.allowed(q_pos, k_pos, is_causal=False) is None
  general = masking.allowed(Variant(is_causal=True), None, None, q_pos, k_pos, seq_k=5)
  np.testing.assert_array_equal(general, masking.allowed(q_pos, k_pos, is_causal=True, seq_k=5))


def test_allowed_pairs_on_a_tile_matches_numpy():
  """A kernel's view: scalar b/h, a [bq, 1] column of absolute rows, a [1, bk] row of keys."""
  spec = specs(16, 24)["combined"]
  allow, *_ = np_mask(spec, B, N, 16, 24)
  var = Variant(is_causal=True, window=(6, None), has_q_lengths=True, has_kv_lengths=True,
                has_segments=True, has_q_offset=True, mask_fn=spec.mask_jnp)
  rows = jnp.arange(8, 16, dtype=jnp.int32)[:, None]  # the second query tile
  keys = jnp.arange(8, 24, dtype=jnp.int32)[None, :]

  @jax.jit
  def tile(b, h, off, q_len, kv_len, q_seg, kv_seg):  # b, h, off, lengths: int32 scalars
    return masking.allowed_pairs(var, b, h, rows + off, keys, q_len=q_len, kv_len=kv_len,
                                 q_seg=q_seg[:, None], kv_seg=kv_seg[None, :], q_offset=off)

  i32 = jnp.int32
  for b in range(B):
    for h in (0, 3):
      got = tile(i32(b), i32(h), i32(spec.q_offset[b]), i32(spec.q_len[b]), i32(spec.kv_len[b]),
                 jnp.asarray(spec.q_seg[b, 8:16]), jnp.asarray(spec.kv_seg[b, 8:24]))
      assert got.shape == (8, 16)
      np.testing.assert_array_equal(got, allow[b, h, 8:16, 8:24])


@pytest.mark.parametrize("variant", [Variant(soft_cap=2.0), Variant(has_alibi=True),
                                     Variant(score_fn=lambda x, b, h, p, j: x * jnp.tanh(x) + h.astype(x.dtype)),
                                     Variant(soft_cap=1.0, has_alibi=True,
                                             score_fn=lambda x, b, h, p, j: jnp.exp(x / 4) * p.astype(x.dtype))])
def test_score_derivative_matches_autodiff(variant):
  s = jnp.asarray(np.random.default_rng(1).standard_normal((8, 16)) * 3, jnp.float32)
  b, h = jnp.int32(1), jnp.int32(2)
  p = jnp.arange(5, 13, dtype=jnp.int32)[:, None]
  j = jnp.arange(16, dtype=jnp.int32)[None, :]
  f = lambda x: masking.modify_scores(variant, x, b, h, p, j, slope=0.25)  # noqa: E731
  want = jax.vmap(jax.vmap(jax.grad(lambda x, pi, ji: masking.modify_scores(
      variant, x, b, h, pi, ji, slope=0.25))))(s, jnp.broadcast_to(p, s.shape),
                                               jnp.broadcast_to(j, s.shape))
  out, deriv = masking.modify_scores_and_derivative(variant, s, b, h, p, j, slope=0.25)
  np.testing.assert_allclose(out, f(s), rtol=1e-6)
  d = masking.score_derivative(variant, s, b, h, p, j, slope=0.25)
  d = jnp.ones_like(s) if d is None else d
  np.testing.assert_allclose(d, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(jnp.ones_like(s) if deriv is None else deriv, d, rtol=0)


@pytest.mark.parametrize("scale", [0.125, -0.125, 0.0])
@pytest.mark.parametrize("variant", [Variant(), Variant(soft_cap=2.0), Variant(has_alibi=True),
                                     Variant(soft_cap=3.0, has_alibi=True),
                                     Variant(has_alibi=True, score_fn=lambda x, b, h, p, j: x * x),
                                     Variant(soft_cap=1.0, has_alibi=True,
                                             score_fn=lambda x, b, h, p, j: jnp.exp(x / 4) * p.astype(x.dtype))])
def test_kernel_scores_fold_the_scales(variant, scale):
  """kernel_scores (the kernels' form, scale and log2 e folded into the cap's and ALiBi's
  constants) equals out_scale * modify_scores(scale * raw), and gives the same derivative."""
  raw = jnp.asarray(np.random.default_rng(2).standard_normal((8, 16)) * 9, jnp.float32)
  b, h = jnp.int32(0), jnp.int32(1)
  p = jnp.arange(3, 11, dtype=jnp.int32)[:, None]
  j = jnp.arange(16, dtype=jnp.int32)[None, :]
  out_scale = float(np.log2(np.e))
  want, want_d = masking.modify_scores_and_derivative(variant, raw * scale, b, h, p, j, slope=0.5)
  got, got_d = masking.kernel_scores(variant, raw, b, h, p, j, scale=scale, out_scale=out_scale,
                                     slope=0.5, derivative=True)
  np.testing.assert_allclose(got, want * out_scale, rtol=2e-6, atol=1e-6)
  if want_d is None:
    assert got_d is None
  else:
    np.testing.assert_allclose(got_d, want_d, rtol=1e-5, atol=1e-6)
  no_d = masking.kernel_scores(variant, raw, b, h, p, j, scale=scale, out_scale=out_scale, slope=0.5)
  np.testing.assert_array_equal(no_d[0], got)
  assert no_d[1] is None


def _tile_kernel(var, s, off, kv_len, slopes, *, block_q, block_k, interpret):
  """A Pallas (Triton) kernel that uses the masking functions as a kernel would: per (query block,
  batch element) it loads the per-batch scalars, loops over the key blocks of
  :func:`block_ranges.kv_block_range` and writes ``where(allowed, s' * ds'/ds, 0)`` of its tiles."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu
  b, t, seq_k = s.shape

  def kernel(off_ref, kv_len_ref, slope_ref, s_ref, o_ref):
    i, bi = pl.program_id(0), pl.program_id(1)
    off, kl, slope = off_ref[bi], kv_len_ref[bi], slope_ref[bi]  # scalars
    lo, _, _, hi = block_ranges.kv_block_range(var, i * block_q, block_q, block_k, seq_k, seq_q=t,
                                          q_offset=off, kv_len=kl)
    q_idx = off + i * block_q + jnp.arange(block_q, dtype=jnp.int32)[:, None]  # [bq, 1]
    o_ref[...] = jnp.zeros((block_q, seq_k), jnp.float32)

    def body(j, carry):
      kv_idx = j * block_k + jnp.arange(block_k, dtype=jnp.int32)[None, :]  # [1, bk]
      x = s_ref[:, pl.ds(j * block_k, block_k)]
      keep = masking.allowed_pairs(var, bi, 0, q_idx, kv_idx, kv_len=kl, q_offset=off)
      y, d = masking.modify_scores_and_derivative(var, x, bi, 0, q_idx, kv_idx, slope=slope)
      o_ref[:, pl.ds(j * block_k, block_k)] = jnp.where(keep, y * d, 0.0)
      return carry

    jax.lax.fori_loop(lo, hi, body, 0)

  scalar = pl.BlockSpec((b,), lambda i, bi: (0,))
  tile = pl.BlockSpec((None, block_q, seq_k), lambda i, bi: (bi, i, 0))
  return pl.pallas_call(kernel, grid=(t // block_q, b), in_specs=[scalar] * 3 + [tile],
                        out_specs=tile, out_shape=jax.ShapeDtypeStruct(s.shape, jnp.float32),
                        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
                        interpret=interpret)(off, kv_len, slopes, s)


TILE_VARIANT = Variant(is_causal=True, window=(5, None), has_kv_lengths=True, has_q_offset=True,
                       soft_cap=2.0, has_alibi=True,
                       score_fn=lambda x, b, h, p, j: x * jnp.tanh(x) + b.astype(x.dtype))


def _tile_inputs():
  s = jnp.asarray(np.random.default_rng(3).standard_normal((2, 32, 64)) * 3, jnp.float32)
  return s, jnp.array([0, 20], jnp.int32), jnp.array([40, 33], jnp.int32), jnp.array([0.5, 0.25],
                                                                                     jnp.float32)


def test_masking_inside_a_pallas_kernel():
  """allowed_pairs, modify_scores_and_derivative and kv_block_range on kernel tiles (interpret
  mode) against numpy."""
  s, off, kv_len, slopes = _tile_inputs()
  got = _tile_kernel(TILE_VARIANT, s, off, kv_len, slopes, block_q=16, block_k=16, interpret=True)
  spec = Spec(causal=True, window=(5, None), kv_len=np.asarray(kv_len), q_offset=np.asarray(off))
  allow, bi, _, p, j = np_mask(spec, 2, 1, 32, 64)
  x = np.asarray(s, np.float64)[:, None]
  y = 2.0 * np.tanh(x / 2.0)
  d = 1 - np.tanh(x / 2.0) ** 2
  y = y - np.asarray(slopes, np.float64)[:, None, None, None] * np.abs(p - j)
  d = d * (np.tanh(y) + y * (1 - np.tanh(y) ** 2))
  y = y * np.tanh(y) + bi
  np.testing.assert_allclose(got, np.where(allow, y * d, 0)[:, 0], rtol=1e-5, atol=1e-5)


def test_masking_lowers_in_a_triton_kernel_for_cuda(monkeypatch):
  """The same kernel, compiled: every masking function has a Pallas Triton lowering (checked on any
  machine by lowering for CUDA)."""
  gpu_info = pytest.importorskip("jax._src.pallas.triton.gpu_info")
  registration = pytest.importorskip("jax._src.pallas.triton.pallas_call_registration")
  monkeypatch.setattr(registration.gpu_info_lib, "get_gpu_info",
                      lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))
  f = lambda *a: _tile_kernel(TILE_VARIANT, *a, block_q=16, block_k=16, interpret=False)  # noqa
  text = jax.jit(f).trace(*_tile_inputs()).lower(lowering_platforms=("cuda",)).as_text()
  assert "triton" in text


def test_variant_properties():
  assert Variant.dense().is_dense and not Variant.dense().needs_mask
  assert not Variant(is_causal=True).is_dense and Variant(is_causal=True).features == ()
  assert Variant(is_causal=True, window=(None, 4)).bounds == (None, 0)
  assert Variant(window=(2, 5)).bounds == (2, 5)
  assert Variant(soft_cap=1.0).modifies_scores and not Variant(soft_cap=1.0).needs_mask
  assert hash(Variant(window=(1, 2))) == hash(Variant(window=(1, 2)))
  assert Variant(has_segments=True, has_alibi=True).features == ("q_segment_ids/kv_segment_ids",
                                                                  "alibi_slopes")


# --- block ranges against the brute-force block table ---------------------------------------------

def _block_table(allow, block_r, block_c):
  """Per block pair: any pair allowed, every pair allowed (rows/cols past the ends ignored)."""
  r, c = allow.shape[-2:]
  nr, nc = -(-r // block_r), -(-c // block_c)
  pad_any = np.zeros(allow.shape[:-2] + (nr * block_r, nc * block_c), bool)
  pad_all = np.ones_like(pad_any)
  pad_any[..., :r, :c] = allow
  pad_all[..., :r, :c] = allow
  shp = allow.shape[:-2] + (nr, block_r, nc, block_c)
  return pad_any.reshape(shp).any((-3, -1)), pad_all.reshape(shp).all((-3, -1))


def _check_ranges(ranges, any_, all_, tight):
  """``ranges [..., n, 4]`` against the block tables ``[..., n, m]``."""
  lo, flo, fhi, hi = (np.asarray(ranges[..., i]) for i in range(4))
  assert np.all((lo <= flo) & (flo <= fhi) & (fhi <= hi))
  m = any_.shape[-1]
  idx = np.arange(m)
  inside = (idx >= lo[..., None]) & (idx < hi[..., None])
  full = (idx >= flo[..., None]) & (idx < fhi[..., None])
  assert not np.any(any_ & ~inside), "a block with an allowed pair lies outside [lo, hi)"
  assert np.all(all_[full]), "a block in [full_lo, full_hi) has a masked pair"
  if tight:  # analytic ranges are exact: the end blocks have a pair
    nonempty = hi > lo
    assert np.all(np.take_along_axis(any_, np.where(nonempty, lo, 0)[..., None], -1)[..., 0]
                  | ~nonempty)
    assert np.all(np.take_along_axis(any_, np.where(nonempty, hi - 1, 0)[..., None], -1)[..., 0]
                  | ~nonempty)


# Representative variants (random lengths, offsets and segment ids are drawn for each).
RANGE_VARIANTS = [
    dict(causal=True),
    dict(causal=True, window=(3, None), q_offset=True),
    dict(window=(None, 5), kv_len=True),
    dict(window=(7, 2), q_offset=True, kv_len=True, q_len=True),
    dict(causal=True, q_len=True, kv_len=True, q_offset=True),
    dict(window=(0, 0), q_offset=True),
    dict(causal=True, segments=True),
    dict(window=(6, 6), segments=True, q_len=True, kv_len=True, q_offset=True),
]


@pytest.mark.parametrize("variant", RANGE_VARIANTS, ids=str)
@pytest.mark.parametrize("t, s, bq, bk", [(37, 45, 8, 16), (45, 19, 16, 4)])
def test_block_ranges_are_sound_and_tight(variant, t, s, bq, bk):
  """Blocks outside [lo, hi) have no allowed pair, blocks in [full_lo, full_hi) no masked pair, for
  random lengths / offsets / sorted segment ids; without segments [lo, hi) is tight and (without
  query lengths) the full range is maximal."""
  segments = variant.get("segments", False)
  var = Variant(is_causal=variant.get("causal", False), window=variant.get("window"),
                has_q_lengths=variant.get("q_len", False), has_kv_lengths=variant.get("kv_len", False),
                has_segments=segments, has_q_offset=variant.get("q_offset", False))
  kw = dict(batch=B, seq_q=t, seq_k=s, block_q=bq, block_k=bk)
  tables = jax.jit(lambda a: (block_ranges.kv_block_ranges(var, a, **kw),
                              block_ranges.q_block_ranges(var, a, **kw)))
  rng = np.random.default_rng(t * 100 + s)
  for trial in range(8):
    spec = Spec(causal=var.is_causal, window=var.window,
                q_len=rng.integers(0, t + 1, B) if var.has_q_lengths else None,
                kv_len=rng.integers(0, s + 1, B) if var.has_kv_lengths else None,
                q_offset=rng.integers(-s, s, B) if var.has_q_offset else None)
    if segments:
      spec.q_seg = np.sort(rng.integers(0, 4, (B, t)), -1)
      spec.kv_seg = np.sort(rng.integers(0, 4, (B, s)), -1)
    arr = lambda x: None if x is None else jnp.asarray(x, jnp.int32)  # noqa: E731
    arrays = VariantArrays(arr(spec.q_len), arr(spec.kv_len), arr(spec.q_seg), arr(spec.kv_seg),
                           arr(spec.q_offset))
    kv, qr = tables(arrays)  # [B, nq, 4], [B, nk, 4]
    allow = np_mask(spec, B, 1, t, s)[0][:, 0]  # [B, T, S]
    any_, all_ = _block_table(allow, bq, bk)
    _check_ranges(kv, any_, all_, tight=not segments)
    _check_ranges(qr, np.swapaxes(any_, -1, -2), np.swapaxes(all_, -1, -2), tight=not segments)
    if not segments and spec.q_len is None:
      lo, flo, fhi, hi = (np.asarray(kv[..., i]) for i in range(4))
      for bi in range(B):
        for r in range(kv.shape[1]):
          if fhi[bi, r] > flo[bi, r]:
            if flo[bi, r] > 0:
              assert not all_[bi, r, flo[bi, r] - 1] or not any_[bi, r, flo[bi, r] - 1]
            if fhi[bi, r] < all_.shape[-1] and (fhi[bi, r] + 1) * bk <= s:
              assert not all_[bi, r, fhi[bi, r]] or not any_[bi, r, fhi[bi, r]]


def test_block_range_of_one_tile_inside_a_kernel():
  """The scalar form (what a kernel evaluates per program) agrees with the vectorised table."""
  var = Variant(is_causal=True, window=(9, None), has_q_offset=True, has_kv_lengths=True)
  arrays = VariantArrays(kv_lengths=jnp.array([30, 17]), q_offset=jnp.array([5, -3]))
  table = block_ranges.kv_block_ranges(var, arrays, batch=2, seq_q=40, seq_k=33, block_q=8, block_k=8)
  f = jax.jit(lambda i, off, kl: jnp.stack(block_ranges.kv_block_range(
      var, i * 8, 8, 8, 33, seq_q=40, q_offset=off, kv_len=kl)))
  for b in range(2):
    for i in range(5):
      np.testing.assert_array_equal(f(jnp.int32(i), arrays.q_offset[b], arrays.kv_lengths[b]),
                                    table[b, i])


def test_mask_fn_block_mask_matches_brute_force():
  t, s, bq, bk = 37, 45, 8, 16
  fn = lambda b, h, p, j: ((p // 8) == (j // 8)) | ((h == 1) & (j < 4))  # noqa: E731
  var = Variant(mask_fn=fn, has_q_offset=True)
  arrays = VariantArrays(q_offset=jnp.array([0, 5]))
  any_, all_ = block_ranges.mask_fn_block_mask(var, arrays, batch=B, heads=N, seq_q=t, seq_k=s,
                                          block_q=bq, block_k=bk)
  spec = Spec(q_offset=np.array([0, 5]), mask_np=fn)
  want_any, want_all = _block_table(np_mask(spec, B, N, t, s)[0], bq, bk)
  np.testing.assert_array_equal(any_, want_any)
  np.testing.assert_array_equal(all_, want_all)
  # A mask_fn of the positions only gives one row of batch and head.
  any1, _ = block_ranges.mask_fn_block_mask(Variant(mask_fn=lambda b, h, p, j: j <= p), VariantArrays(),
                                       batch=B, heads=N, seq_q=t, seq_k=s, block_q=bq, block_k=bk)
  assert any1.shape == (1, 1, 5, 3)


# --- dispatch -------------------------------------------------------------------------------------

def test_variants_run_on_the_kernels_and_backend_for_says_why():
  q, k, v, _, _ = qkv(1, 8, 8, 2, 2)
  d = fa2_jax.backend_for(q, k, local_window_size=4, interpret=True)
  assert d.backend == "triton", d
  d = fa2_jax.backend_for(q, k, local_window_size=4)
  assert d.backend == "xla" and "interpret=True" in d.reason, d
  # The causal mask alone still runs the kernels.
  assert fa2_jax.backend_for(q, k, is_causal=True, interpret=True).backend == "triton"
  # A static zero offset (or one nothing reads) is no variant.
  assert fa2_jax.backend_for(q, k, q_offset=0, is_causal=True, interpret=True).backend == "triton"
  assert fa2_jax.backend_for(q, k, q_offset=jnp.array([3]), interpret=True).backend == "triton"
  out = jax.jit(lambda a, b_, c: fa2_jax.flash_attention(a, b_, c, local_window_size=2,
                                                         interpret=True))(q, k, v)
  spec = Spec(window=(2, 2))
  zeros = np.zeros(q.shape)
  assert_close(out, np_attention(q, k, v, spec, 1 / np.sqrt(8), zeros, zeros[..., 0])[0], 2e-5,
               "out")


# --- argument errors ------------------------------------------------------------------------------

Q4 = jnp.zeros((2, 8, 4, 16))
KV4 = jnp.zeros((2, 12, 2, 16))
I32 = lambda *shape: jnp.zeros(shape, jnp.int32)  # noqa: E731


def _bad_mask(b, h, p, j):
  return p[0, 0, :] >= j[0, 0, :]  # indexes the formula's rank-4 arrays: fails on one pair


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(query_seq_lengths=jnp.zeros(2)), ValueError, "query_seq_lengths must have an integer dtype"),
    (dict(query_seq_lengths=I32(3)), ValueError, r"query_seq_lengths must have shape \[2\]"),
    (dict(query_seq_lengths=3), ValueError, r"query_seq_lengths must have shape \[2\]"),
    (dict(query_seq_lengths=[3.0, 3.0]), ValueError, "query_seq_lengths must have an integer dtype"),
    (dict(query_seq_lengths=[[3], [3, 3]]), ValueError, "query_seq_lengths must be an integer array"),
    (dict(query_seq_lengths="3"), TypeError, "query_seq_lengths must be an integer array"),
    (dict(query_seq_lengths=[3, 3, 3]), ValueError, r"query_seq_lengths must have shape \[2\]"),
    (dict(query_seq_lengths=jnp.array([1, 9])), ValueError,
     r"query_seq_lengths must lie in \[0, 8\]"),
    (dict(query_seq_lengths=jnp.array([-1, 2])), ValueError, r"query_seq_lengths must lie in"),
    (dict(key_value_seq_lengths=jnp.array([True, False])), ValueError,
     "key_value_seq_lengths must have an integer dtype"),
    (dict(key_value_seq_lengths=jnp.array([13, 2])), ValueError,
     r"key_value_seq_lengths must lie in \[0, 12\]"),
    (dict(key_value_seq_lengths=I32(2, 1)), ValueError, "key_value_seq_lengths must have shape"),
    (dict(q_segment_ids=I32(2, 8)), ValueError, "both or neither"),
    (dict(kv_segment_ids=I32(2, 12)), ValueError, "both or neither"),
    (dict(q_segment_ids=I32(2, 7), kv_segment_ids=I32(2, 12)), ValueError,
     r"q_segment_ids must have shape \[2, 8\]"),
    (dict(q_segment_ids=I32(2, 8), kv_segment_ids=I32(2, 8)), ValueError,
     r"kv_segment_ids must have shape \[2, 12\]"),
    (dict(q_segment_ids=jnp.zeros((2, 8)), kv_segment_ids=I32(2, 12)), TypeError,
     "q_segment_ids must have an integer dtype"),
    (dict(local_window_size=-1), ValueError, "local_window_size sides must be >= 0"),
    (dict(local_window_size=(2, -3)), ValueError, "local_window_size sides must be >= 0"),
    (dict(local_window_size=(1, 2, 3)), ValueError, "local_window_size must be an int or a"),
    (dict(local_window_size=2.5), TypeError, "local_window_size must hold Python ints"),
    (dict(local_window_size=True), TypeError, "local_window_size must hold Python ints"),
    (dict(local_window_size=1 << 31), ValueError, r"local_window_size sides must be < 2\*\*30"),
    (dict(q_offset=1.5), TypeError, "q_offset must be an integer array"),
    (dict(q_offset=jnp.zeros(2)), TypeError, "q_offset must have an integer dtype"),
    (dict(q_offset=I32(3)), ValueError,
     r"q_offset must be an int, an integer scalar or an integer array of shape \[2\]"),
    (dict(q_offset=I32(2, 1)), ValueError, r"q_offset must be an int, an integer scalar or an"),
    (dict(q_offset=1 << 30), ValueError, r"q_offset must satisfy \|q_offset\| < 2\*\*30"),
    (dict(logits_soft_cap=0.0), ValueError, "logits_soft_cap must be finite and > 0"),
    (dict(logits_soft_cap=2.4e38), ValueError, r"logits_soft_cap must be in \[1e-30, 1e\+30\]"),
    (dict(logits_soft_cap=1e-35), ValueError, "logits_soft_cap must be in"),
    (dict(logits_soft_cap=-2.0), ValueError, "logits_soft_cap must be finite and > 0"),
    (dict(logits_soft_cap=float("inf")), ValueError, "logits_soft_cap must be finite and > 0"),
    (dict(logits_soft_cap=float("nan")), ValueError, "logits_soft_cap must be finite and > 0"),
    (dict(logits_soft_cap=10 ** 400), ValueError, "logits_soft_cap must be finite, got a number too large"),
    (dict(logits_soft_cap="30"), TypeError, "logits_soft_cap must be a Python float"),
    (dict(logits_soft_cap=True), TypeError, "logits_soft_cap must be a Python float"),
    (dict(alibi_slopes=I32(4)), TypeError, "alibi_slopes must have a floating dtype"),
    (dict(alibi_slopes=jnp.ones(2)), ValueError, r"alibi_slopes must have shape \[4\] or \[2, 4\]"),
    (dict(alibi_slopes=jnp.ones((4, 2))), ValueError, "alibi_slopes must have shape"),
    (dict(alibi_slopes=[0.5] * 4), TypeError, "alibi_slopes must be a float array"),
    (dict(alibi_slopes=jnp.array([1, 1, 1, jnp.nan])), ValueError, "alibi_slopes must be finite"),
    (dict(alibi_slopes=jnp.array([1, 1, 1, 2.5e38])), ValueError,
     r"alibi_slopes must satisfy \|slope\| <= 1e\+30"),
    (dict(q_segment_ids=np.full((2, 8), 2 ** 40, np.uint64), kv_segment_ids=np.zeros((2, 12), np.int64)),
     TypeError, "no common integer dtype"),
    (dict(score_fn=lambda s, b, h, p, j: s - s.max(axis=-1, keepdims=True)), TypeError,
     "score_fn could not be traced on one pair"),
    (dict(mask_fn="causal"), TypeError, "mask_fn must be a callable"),
    (dict(score_fn=3), TypeError, "score_fn must be a callable"),
    (dict(mask_fn=lambda b, h, p: p > 0), TypeError, "mask_fn could not be traced.*TypeError"),
    (dict(mask_fn=_bad_mask), TypeError, "mask_fn could not be traced on one pair.*IndexError"),
    (dict(mask_fn=lambda b, h, p, j: p - j), TypeError, "mask_fn must return a bool array"),
    (dict(mask_fn=lambda b, h, p, j: jnp.ones((3, 3), bool)), ValueError,
     r"mask_fn must return one bool per pair .*got shape \[3, 3\]"),
    (dict(score_fn=lambda s, b, h, p, j: s > 0), TypeError, "score_fn must return a floating array"),
    (dict(score_fn=lambda s, b, h, p, j: jnp.stack([s, s])), ValueError,
     r"score_fn must return one score per pair .*got shape \[2\]"),
    (dict(score_fn=lambda s, b, h, p, j: (s, s)), TypeError, "score_fn must return one array"),
    (dict(score_fn=lambda s, b, h, p, j: s + undefined_name), TypeError,  # noqa: F821
     "score_fn could not be traced.*NameError"),
])
@pytest.mark.parametrize("entry", ["flash_attention", "reference_attention", "backend_for"])
def test_bad_variant_arguments(kwargs, exc, match, entry):
  fn = {"flash_attention": lambda: fa2_jax.flash_attention(Q4, KV4, KV4, **kwargs),
        "reference_attention": lambda: fa2_jax.reference_attention(Q4, KV4, KV4, **kwargs),
        "backend_for": lambda: fa2_jax.backend_for(Q4, KV4, **kwargs)}[entry]
  with pytest.raises(exc, match=match):
    fn()


@pytest.mark.parametrize("kwargs, match", [
    (dict(query_seq_lengths=I32(2)), r"query_seq_lengths must have shape \[1\] or be a scalar"),
    (dict(q_segment_ids=I32(2, 8), kv_segment_ids=I32(12)), r"q_segment_ids must have shape"),
    (dict(q_offset=I32(2)), r"q_offset must be an int, an integer scalar or an integer array of shape \[1\]"),
])
def test_bad_variant_arguments_of_a_rank3_call(kwargs, match):
  with pytest.raises(ValueError, match=match):
    fa2_jax.flash_attention(Q4[0], KV4[0], KV4[0], **kwargs)



@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_scalar_q_offset_serves_every_batch_element(impl):
  """A 0-d q_offset (e.g. a traced decoding position under jit) equals the int and the [B] array."""
  kw = IMPLEMENTATIONS[impl]
  ks = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(ks[0], (2, 3, 4, 16))  # T=3 query rows against S=12 cached keys
  k, v = (jax.random.normal(x, (2, 12, 2, 16)) for x in ks[1:])
  want = fa2_jax.flash_attention(q, k, v, is_causal=True, q_offset=5, **kw)
  per_batch = fa2_jax.flash_attention(q, k, v, is_causal=True, q_offset=jnp.array([5, 5]), **kw)
  scalar = fa2_jax.flash_attention(q, k, v, is_causal=True, q_offset=jnp.int32(5), **kw)
  traced = jax.jit(lambda o: fa2_jax.flash_attention(q, k, v, is_causal=True, q_offset=o, **kw))(
      jnp.int32(5))
  for got in (per_batch, scalar, traced):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=1e-6, atol=1e-6)

@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_offset_and_window_sides_near_int32_limit(impl):
  """q_offset and both window sides just under 2**30: positions plus a side pass 2**31, which must not
  wrap around in the rule or the block ranges (it masked whole rows). Row i then attends keys j >= i,
  as q_offset=0 with local_window_size=(0, None) does; 16-row/16-key tiles, so ranges matter."""
  kw = dict(IMPLEMENTATIONS[impl])
  if impl == "triton":
    kw["block_sizes"] = fa2_jax.BlockSizes(block_q=16, block_k=16, block_q_dkv=16, block_k_dkv=16,
                                           block_q_dq=16, block_k_dq=16)
  q, k, v, do, _ = qkv(1, 40, 40, 2, 1)
  big = 2 ** 30 - 1

  def run(**variant):
    f = lambda q, k, v: fa2_jax.flash_attention(q, k, v, **variant, **kw)  # noqa: E731
    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(do))

  got = run(q_offset=big, local_window_size=(big, big))
  want = run(local_window_size=(0, None))
  for what, x, r in zip(("out", "dq", "dk", "dv"), got, want):
    np.testing.assert_allclose(np.asarray(x), np.asarray(r), rtol=1e-5, atol=1e-5, err_msg=what)
  rows, keys = jnp.arange(40)[:, None] + big, jnp.arange(40)[None, :]
  mask = masking.allowed_pairs(Variant(window=(big, big), has_q_offset=True), 0, 0, rows, keys)
  np.testing.assert_array_equal(np.asarray(mask), np.arange(40)[None, :] >= np.arange(40)[:, None])


def test_traced_values_are_not_range_checked():
  """Under jit the lengths are traced: out-of-range values are documented to act as clipped."""
  q, k, v, _, _ = qkv(B, 8, 12, N, KH)
  f = jax.jit(lambda ql, kl: fa2_jax.flash_attention(q, k, v, query_seq_lengths=ql,
                                                     key_value_seq_lengths=kl))
  np.testing.assert_allclose(f(jnp.array([99, -5]), jnp.array([99, 99])),
                             f(jnp.array([8, 0]), jnp.array([12, 12])), atol=0)


@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_traced_offsets_act_as_clipped(impl):
  """A traced q_offset at the ends of int32 (or past it under x64) acts as clipped to the range a
  concrete one must lie in, |q_offset| < 2**30, on both backends: positions q_offset + i never wrap
  (before the clip 2**31 - 1 wrapped: the formula zeroed rows 1..3, the Triton block table every row)."""
  q, k, v, _, _ = qkv(1, 4, 6, 2, 1)
  kw = dict(implementation=impl, interpret=True) if impl == "triton" else dict(implementation=impl)
  edge = masking.INT32_SAFE - 1

  @functools.cache  # one jitted function per variant: its offsets share one compilation
  def jitted(variant):
    return jax.jit(lambda o: fa2_jax.flash_attention(q, k, v, q_offset=o, return_residual=True,
                                                     **dict(variant), **kw))

  def run(o, **variant):
    return jitted(tuple(variant.items()))(o)

  for variant in (dict(is_causal=True), dict(local_window_size=(5, edge))):
    for far, clipped in ((2 ** 31 - 1, edge), (-2 ** 31, -edge)):
      got = run(jnp.array([far], jnp.int32), **variant)
      want = run(jnp.array([clipped], jnp.int32), **variant)
      for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"{variant} {far}")
  # causal with every query past every key: rows see all keys, not none
  out, _ = run(jnp.array([2 ** 31 - 1], jnp.int32), is_causal=True)
  assert np.all(np.linalg.norm(np.asarray(out), axis=-1) > 0)
  with jax.enable_x64(True):  # an int64 offset past int32 is clipped, not truncated to 1
    out64, _ = run(jnp.array([2 ** 32 + 1], jnp.int64), is_causal=True)
  np.testing.assert_array_equal(np.asarray(out64), np.asarray(out))



@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_segment_ids_past_int32_keep_their_meaning(impl):
  """64-bit segment ids past int32, concrete or traced, mean what they say: ids that differ stay
  different (a plain cast made 2**32 equal to 0: rows attended a document they do not share), on
  both backends and the formula. They are ranked jointly per batch row (validation._rank_segments),
  so the call equals the one with the ids' ranks; uint32 ids past int32 too."""
  q, k, v, _, _ = qkv(2, 4, 6, 2, 1)
  kw = dict(implementation=impl, interpret=True) if impl == "triton" else dict(implementation=impl)
  big = 2 ** 32
  q_ids = np.array([[big, big, 5, 5], [0, 0, 0, 0]])
  kv_ids = np.array([[big, big, big, 5, 5, 5], [big] * 6])  # row 1: no document in common
  q_rank, kv_rank = np.array([[1, 1, 0, 0], [0] * 4]), np.array([[1, 1, 1, 0, 0, 0], [1] * 6])
  want = fa2_jax.reference_attention(q, k, v, is_causal=False, q_segment_ids=jnp.asarray(q_rank),
                                     kv_segment_ids=jnp.asarray(kv_rank), return_residual=True)
  call = lambda a, b: fa2_jax.flash_attention(q, k, v, q_segment_ids=a, kv_segment_ids=b,  # noqa: E731
                                              return_residual=True, **kw)
  with jax.enable_x64(True):
    for a, b in ((q_ids, kv_ids), (jnp.asarray(q_ids), jnp.asarray(kv_ids))):
      for got in (call(a, b), jax.jit(call)(a, b)):
        for g, w in zip(got, want):
          np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w), atol=1e-6)
    out, lse = jax.jit(call)(jnp.asarray(q_ids), jnp.asarray(kv_ids))
    assert not np.any(np.asarray(out[1])) and np.all(np.asarray(lse[1]) == -np.inf)
  high = np.uint32(2 ** 31)  # uint32 ids past int32, without x64
  unsigned = call(q_rank.astype(np.uint32) + high, kv_rank.astype(np.uint32) + high)
  for g, w in zip(unsigned, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-6)

def test_formula_with_a_constant_mask_fn_compiles_quickly():
  """A mask_fn of the indices alone makes the formula's mask a function of constants; XLA folded
  it element by element at compile time (200 s on a 2-core CPU for this [1, 2, 54, 42] mask; 1.7 s
  since the index arrays are opaque to it). The bound leaves a wide margin for slow machines."""
  q, k, v, _, _ = qkv(1, 54, 42, 2, 1, h=24)
  mask_fn = lambda b, h, i, j: ((i + j) % 2 != 0) | (h == 0)  # noqa: E731
  f = jax.jit(lambda q, k, v: fa2_jax.flash_attention(q, k, v, implementation="xla", mask_fn=mask_fn))
  t0 = time.perf_counter()
  f.lower(q, k, v).compile()
  assert time.perf_counter() - t0 < 60.0


def test_traced_soft_cap_is_rejected():
  with pytest.raises(TypeError, match="logits_soft_cap must be a static Python float"):
    jax.jit(lambda c: fa2_jax.flash_attention(Q4, KV4, KV4, logits_soft_cap=c))(2.0)


@pytest.mark.parametrize("query_block", [0, -4, 2.0, True, "all"])
def test_bad_query_block(query_block):
  with pytest.raises(ValueError, match="query_block must be a positive int, 'auto' or None"):
    fa2_jax.reference_attention(Q4, KV4, KV4, query_block=query_block)


# --- compiled on the GPU --------------------------------------------------------------------------
# bf16 kernels (Triton at head_dim 40: padded tiles; Mosaic at 64) against the float64 reference, each
# error bounded by twice the bf16 XLA formula's error on the same inputs, or by 2e-2 * (max|ref| + 1)
# (a few bf16 ulps: the kernels round P and dS to bf16 for the tensor cores, the formula does not).
GPU_CASES = CASES + [(v, 300, 520) for v in ("causal_window", "segments", "combined")] + [
    ("offset_window", 700, 300)]


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "mosaic"])
@pytest.mark.parametrize("variant, t, s", GPU_CASES)
def test_variant_compiled_on_gpu(impl, variant, t, s):
  check_compiled(variant, t, s, 64 if impl == "mosaic" else 40, dict(implementation=impl))


# The Mosaic dK/dV kernel with the fused dQ (MosaicConfig.dq_fused_variants, at any length).
# soft_cap / alibi: the folded scale constants (masking.kernel_scores); score_fn: not folded.
FUSED_GPU_CASES = [c for c in GPU_CASES if c[1] >= 300] + [
    (v, 21, 13) for v in ("causal", "q_lengths", "segments", "combined")] + [
    (v, 300, 520) for v in ("soft_cap", "alibi", "score_fn")]


@pytest.mark.gpu
@pytest.mark.parametrize("variant, t, s", FUSED_GPU_CASES)
def test_variant_fused_dq_compiled_on_gpu(variant, t, s):
  cfg = fa2_jax.MosaicConfig.default(64).replace(dq_fused_variants=True, dq_fused_min_t=0)
  check_compiled(variant, t, s, 64, dict(implementation="mosaic", block_sizes=cfg,
                                         deterministic=False))


@pytest.mark.gpu
@pytest.mark.parametrize("variant, causal", [("combined", True), ("soft_cap", False),
                                             ("segments", False)])
def test_variant_fused_dq_head_dim_128_compiled_on_gpu(variant, causal):
  """Head_dim 128's fused dQ (the tile split by columns) with its default tiles and register split."""
  cfg = fa2_jax.MosaicConfig.default(128, is_causal=causal).replace(dq_fused_min_t=0)
  check_compiled(variant, 300, 520, 128, dict(implementation="mosaic", block_sizes=cfg,
                                              deterministic=False))


@pytest.mark.gpu
@pytest.mark.parametrize("variant, t, s", [("combined", 300, 520), ("soft_cap", 300, 520),
                                           ("causal_window", 300, 520), ("segments", 21, 13)])
def test_variant_dkdv_roles_head_dim_256_compiled_on_gpu(variant, t, s):
  """Head_dim 256's role-split dK/dV and dQ kernels (``dkv_roles``, ``dq_roles``, its defaults) with
  attention variants."""
  assert fa2_jax.MosaicConfig.default(256).dkv_roles and fa2_jax.MosaicConfig.default(256).dq_roles
  check_compiled(variant, t, s, 256, dict(implementation="mosaic"))


def check_compiled(variant, t, s, h, impl_kw):
  spec = specs(t, s)[variant]
  q, k, v, dout, dlse = qkv(B, t, s, N, KH, h, seed=5, dtype=jnp.bfloat16)
  dlse = dlse.astype(jnp.float32)  # the lse is float32
  kw = spec.kwargs(B, N)
  impl = impl_kw["implementation"]
  if impl == "mosaic" and variant in ("mask_fn", "combined") and spec.mask_jnp is not None:
    probe = Variant(mask_fn=spec.mask_jnp)
    if block_ranges.mask_fn_depends_on_head(probe, N):
      with pytest.raises(ValueError, match="mask_fn depends on the head"):
        run(q, k, v, dout, dlse, dict(kw, **impl_kw))
      return
  (out, lse), grads = run(q, k, v, dout, dlse, dict(kw, **impl_kw))
  (x_out, x_lse), x_grads = run(q, k, v, dout, dlse, dict(kw, implementation="xla"))
  out_ref, lse_ref, grads_ref = np_attention(q, k, v, spec, 1 / np.sqrt(h), dout, dlse)
  for what, got, xla, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads),
                                  (x_out, x_lse, *x_grads), (out_ref, lse_ref, *grads_ref)):
    fin = np.isfinite(want)
    x_err = np.max(np.abs(np.asarray(xla, np.float64)[fin] - want[fin]), initial=0.0)
    scale = np.max(np.abs(want[fin]), initial=0.0) + 1
    assert_close(got, want, max(2 * x_err / scale, 2e-2), f"{impl} {what}")


# --- mask_fn: block mask once per mask_fn, closures over arrays -----------------------------------

def test_static_mask_fn_block_mask_is_computed_once_at_trace_time():
  """A mask_fn of the indices alone: its block mask is evaluated when the call is traced, kept for
  the next call with the same function and shapes, and is a constant of the program (no loop over
  mask_fn in it). With a traced q_offset it is computed in the program."""
  block_ranges._STATIC_MASKS.clear()
  q = jnp.ones((1, 64, 2, 16))
  fn = lambda b, h, i, j: (j <= i) & (i - j < 20)  # noqa: E731
  f = jax.jit(lambda a: fa2_jax.flash_attention(a, a, a, mask_fn=fn, interpret=True))
  f.lower(q)
  cached = dict(block_ranges._STATIC_MASKS)
  assert cached and all(k[0].mask_fn is fn for k in cached)
  jax.jit(lambda a: 2 * fa2_jax.flash_attention(a, a, a, mask_fn=fn, interpret=True)).lower(q)
  assert block_ranges._STATIC_MASKS.keys() == cached.keys()
  variant = Variant(mask_fn=fn, has_q_offset=True)
  arrays = VariantArrays(q_offset=jnp.array([3]))
  jaxpr = jax.make_jaxpr(lambda off: block_ranges.mask_fn_block_mask(
      variant, VariantArrays(q_offset=off), batch=1, heads=2, seq_q=64, seq_k=64, block_q=16,
      block_k=16))(arrays.q_offset)
  assert jaxpr.eqns  # computed in the program: it depends on the offset
  assert block_ranges._STATIC_MASKS.keys() == cached.keys()


def test_mask_fn_closing_over_an_array_runs_the_formula():
  q, k, v, _, _ = qkv(1, 16, 16, 2, 2)
  keep = jnp.arange(16) % 3 != 0
  fn = lambda b, h, i, j: keep[j]  # noqa: E731
  d = fa2_jax.backend_for(q, k, mask_fn=fn, interpret=True)
  assert d.backend == "xla" and "array constant" in d.reason, d
  with pytest.raises(ValueError, match="it cannot take a mask_fn whose trace holds an array constant"):
    fa2_jax.flash_attention(q, k, v, mask_fn=fn, implementation="triton", interpret=True)
  # a family without mask_fn at all says that, not what the function holds
  with pytest.raises(ValueError, match="it does not implement mask_fn yet; use"):
    fa2_jax.backend_for(q, k, mask_fn=fn, implementation="decode")
  out = fa2_jax.flash_attention(q, k, v, mask_fn=fn, interpret=True)
  want = fa2_jax.flash_attention(q, k, v, mask_fn=lambda b, h, i, j: j % 3 != 0, interpret=True)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5)
  # A 0-d JAX array is captured too (a Python or numpy scalar is inlined and runs the kernel).
  width, temp = jnp.int32(4), jnp.float32(1.5)
  for kw in (dict(mask_fn=lambda b, h, i, j: (i - j) < width),
             dict(score_fn=lambda x, b, h, i, j: x / temp)):
    assert fa2_jax.backend_for(q, k, interpret=True, **kw).backend == "xla"
    with pytest.raises(ValueError, match=f"it cannot take a {next(iter(kw))} whose trace holds"):
      fa2_jax.flash_attention(q, k, v, implementation="triton", interpret=True, **kw)
  assert fa2_jax.backend_for(q, k, interpret=True,
                             score_fn=lambda x, b, h, i, j: x / np.float32(1.5)).backend == "triton"


def test_mask_fn_block_mask_follows_a_changed_closure():
  """The cached block mask of a mask_fn is keyed by what the function computes, not only by the
  function object: after the global it reads changes, the kernel skips the blocks of the new mask."""
  block_ranges._STATIC_MASKS.clear()
  q, k, v, _, _ = qkv(1, 48, 48, 2, 2)
  tiles = fa2_jax.BlockSizes(block_q=16, block_k=16, block_q_dkv=16, block_k_dkv=16,
                             block_q_dq=16, block_k_dq=16)
  width = [4]
  fn = lambda b, h, i, j: (j <= i) & (i - j <= width[0])  # noqa: E731
  for w in (4, 40):
    width[0] = w
    out = fa2_jax.flash_attention(q, k, v, mask_fn=fn, block_sizes=tiles, implementation="triton",
                                  interpret=True)
    want = fa2_jax.reference_attention(q, k, v, is_causal=True, local_window_size=(w, 0))
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5, err_msg=f"width {w}")
  assert len(block_ranges._STATIC_MASKS) == 2


def test_score_fn_result_dtype_does_not_round_the_kernel_scores():
  """A score_fn that returns bfloat16 is taken back to the kernel's float32 scores before the base-2
  conversion: the kernel matches the formula on the same function. Small-integer q and k (head_dim
  16, scale 1/4) make every score exact in float32 whatever the order of the dot's sums, so the
  function's own bfloat16 rounding cannot fall differently in the kernel (compiled on a GPU its sums
  run in another order than XLA's), while a rounding after the base-2 conversion would still show."""
  q, k, v, _, _ = qkv(1, 16, 16, 2, 2, h=16)  # default scale 1/4: exact on the integer scores
  q, k = jnp.round(3 * q), jnp.round(3 * k)
  fn = lambda x, b, h, i, j: (x * 0.5).astype(jnp.bfloat16)  # noqa: E731
  out = fa2_jax.flash_attention(q, k, v, score_fn=fn, implementation="triton", interpret=True)
  want = fa2_jax.flash_attention(q, k, v, score_fn=fn, implementation="xla")
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5)


def test_one_index_read_rule_serves_block_masks_dispatch_and_sharding():
  """The block mask's batch/head extents, the Mosaic kernels' per-head refusal and the sharding
  rule's whole axes all come from block_ranges.index_reads."""
  cases = {(): lambda b, h, i, j: j <= i, ("b",): lambda b, h, i, j: j <= i + b,
           ("h",): lambda b, h, i, j: j <= i - h, ("b", "h"): lambda b, h, i, j: j <= i + b - h}
  for reads, fn in cases.items():
    variant = Variant(mask_fn=fn)
    assert block_ranges.index_reads(variant) == set(reads)
    assert block_ranges._mask_extent(variant, 2, 3) == (2 if "b" in reads else 1,
                                                        3 if "h" in reads else 1)
    assert block_ranges.mask_fn_depends_on_head(variant, 3) == ("h" in reads)
    assert not block_ranges.mask_fn_depends_on_head(variant, 1)
    with_offset = Variant(mask_fn=fn, has_q_offset=True)
    assert block_ranges._mask_extent(with_offset, 2, 3)[0] == 2  # the offset is per batch element
  # A score_fn's reads count for sharding, not for the block mask.
  both = Variant(mask_fn=cases[()], score_fn=lambda s, b, h, i, j: s - h.astype(s.dtype))
  assert block_ranges.index_reads(both) == {"h"}
  assert block_ranges._mask_extent(both, 2, 3) == (1, 1)
