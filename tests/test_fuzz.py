"""Property-based fuzzing of fa2_jax.flash_attention against an independent float64 numpy reference.

Hypothesis draws whole calls: shapes (``B`` 0..3, ragged ``T``/``S`` 0..~70 including empty ones,
GQA/MQA head counts ``K | N``, head_dim 1..256 with short sequences for the big head dims), dtype,
``is_causal``, ``scale`` (None, small, negative, large), Triton ``BlockSizes`` (power-of-two
tiles 16..64) or, for the Mosaic kernels, the persistent forward's launch (1-3 CTAs, the tiles dealt
cyclically or greedily, or one CTA per tile; these calls have one query tile per head), rank 3 or 4 inputs, input amplitude, an optional cotangent on ``lse``, and the transform
that wraps the call: plain, ``jit``, ``vmap`` over an extra leading axis (also with shared K/V,
``in_axes=(0, None, None)``), ``jax.grad`` of a scalar loss, ``jax.checkpoint``, ``lax.scan`` over a
stack of inputs, and ``jit`` under ``jax_enable_x64``. Every example is differentiated (``vjp`` with random cotangents on
``out`` and ``lse``) and compared with :func:`numpy_reference`, written here in numpy float64 with the
gradients derived by hand (it shares no code with ``fa2_jax.reference_attention``):

* ``out``, ``lse`` (natural log; a row with no key, ``S = 0``: ``out = 0``, ``lse = -inf``), ``dq``,
  ``dk``, ``dv``, elementwise: ``|got - ref| <= factor * max|low - ref| + atol * (max|ref| + 1) +
  cond``. ``low`` is the plain formula in the input precision: XLA in bf16/fp16
  (:func:`xla_formula`, as ``test_attention.py`` does), :func:`numpy_reference` in float32 arithmetic
  for float32; where XLA's formula breaks down (fp16 overflow at extreme logits) the numpy float32
  error plus ``fallback`` dtype epsilons stands in. ``cond`` (:func:`logit_rounding_bound`) is what
  float32 logits cannot resolve: negligible for ordinary calls, it grows with ``|scale| * |q| |k|``
  (scale 1e3 with large inputs);
* never NaN, and finite wherever the reference is representable in the dtype;
* empty calls (``B``, ``T`` or ``S`` = 0) give empty or zero outputs and gradients;
* keys no query attends (causal, ``S > T``: keys ``j >= T``) may hold NaN or +-inf in K and/or V:
  every output still matches the clean reference and their dK/dV are exactly zero.

Backends: the Triton kernels in Pallas interpret mode (compiled on a GPU), the default implementation
(the XLA formula on CPU; Mosaic or Triton on a GPU), and the Mosaic kernels in Pallas GPU interpret
mode with emulated wgmma (bf16/fp16, head_dim 64/128; slow, so drawn rarely and small). The ``gpu``
tests draw the same properties at ``T, S`` up to 2048, compiled, for the default implementation and
``implementation="triton"``.

Profiles (registered in ``conftest.py``; ``HYPOTHESIS_PROFILE`` selects one, ``ci`` by default)::

    pytest tests/test_fuzz.py                                   # ci: derandomized, bounded (~2 min)
    HYPOTHESIS_PROFILE=ci-shrink pytest tests/test_fuzz.py      # the ci examples, failures minimised
    HYPOTHESIS_PROFILE=long pytest tests/test_fuzz.py           # many random examples, on demand
    HYPOTHESIS_PROFILE=gpu pytest -m gpu tests/test_fuzz.py     # on a GPU: compiled, bigger shapes

``ci`` and ``gpu`` do not shrink (a failing run stays bounded): they print the failing :class:`Call`
as drawn; ``ci-shrink`` and ``long`` minimise it. ``check_call(Call(...), "triton")`` (or ``"default"``,
``"mosaic"``) replays a printed call outside hypothesis.

The attention variants are drawn by :func:`variant_calls` (every combination of causal, window,
lengths, segment ids, offset, soft cap, ALiBi, ``mask_fn`` and ``score_fn``, GQA, ragged ``T``/``S``)
and checked against ``test_variants``' numpy reference on the formula and the Triton kernels.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import fa2_jax
from fa2_jax.kernels import platform
from conftest import on_gpu

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

# |got - ref| <= factor * err_low + atol * (max|ref| + 1) + cond (module docstring): the factor and
# atol of test_attention.py. fallback: dtype epsilons (times max|ref| + 1) added to the numpy float32
# formula's error where XLA's formula in the input dtype breaks down; 8 eps covers the final rounding
# of out / the gradients to the dtype plus the rounding of the f32 statistics behind them.
TOLERANCE = {
    "float32": dict(factor=2.0, atol=2e-5, fallback=0.0),
    "bfloat16": dict(factor=2.0, atol=2e-3, fallback=8 * 2.0 ** -8),
    "float16": dict(factor=2.0, atol=5e-4, fallback=8 * 2.0 ** -11),
}

# Transforms around the call. The stacking ones map over an extra leading axis of length `stack`.
TRANSFORMS = ("plain", "jit", "vmap", "vmap_shared_kv", "grad", "remat", "scan", "jit_x64")
STACKING = ("vmap", "vmap_shared_kv", "scan")

# head_dim draws: mostly small (CPU time), the odd and large ones included; repeats weight the draw.
HEAD_DIMS = (1, 3, 8, 8, 16, 16, 24, 32, 64, 80, 128, 256)
# scale draws: the default 1/sqrt(H), tiny (near-uniform softmax), negative (the kernels must not
# assume scale > 0) and large (near-argmax softmax).
SCALES = (None, None, None, 1e-3, 0.3, -0.5, -2.0, 1e3)
# input amplitudes: unit normal, tiny values, and large ones (logits in the thousands).
AMPLITUDES = (1.0, 1.0, 1e-3, 10.0)
# The largest |scale * q.k| drawn: the kernels' fused exp2(s*c - m) softmax rounds the row maximum
# m*c, so past 2^13 (fp16) / 2^16 (bf16) in base 2 (about 5.7e3 / 4.5e4 natural) a saturated row's
# largest P is no longer exactly 1 once cast to the input dtype for P V, and its gradients miss the
# formula's exact cancellation (a documented limit: README, Limits). q and k of a draw past it are scaled down together to reach it (logits of
# 4096 still give one-hot rows).
MAX_LOGIT = 4096.0
TILES = (16, 32, 64)


@dataclasses.dataclass(frozen=True)
class Call:
  """One drawn call: everything needed to replay it (inputs come from ``seed``)."""

  b: int
  t: int
  s: int
  n: int
  kh: int
  h: int
  dtype: str
  causal: bool
  scale: float | None
  blocks: fa2_jax.BlockSizes | fa2_jax.MosaicConfig | None  # the Triton or the Mosaic kernels' tiles
  rank3: bool  # drop the batch axis (only with b == 1)
  transform: str
  stack: int  # length of the mapped / scanned axis (1 for the other transforms)
  amplitude: float
  dlse: bool  # a random cotangent on lse (else zeros)
  seed: int


# --- the independent reference ------------------------------------------------------------------------

def _terms(q, k, v, do, dlse, scale, causal, dtype, shift=None):
  """The forward and backward intermediates in numpy ``dtype`` arithmetic, per head ([B, N, ...]).

  ``shift``: None, or ``(d_fwd, d_bwd)`` ``[B, N, T, S]`` perturbations of the logits: the forward
  uses ``s + d_fwd`` throughout, the backward recomputes ``P = exp(s + d_bwd - lse)`` from the
  forward's lse (FlashAttention-2's backward; the kernels recompute it from the rows' statistics,
  kernels/softmax.py, which round no large offset: a model that is conservative for them); the
  check of :func:`logit_rounding_bound` uses it.
  """
  q, k, v, do, dlse = (np.asarray(x, dtype) for x in (q, k, v, do, dlse))
  scale = dtype(scale)
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  g = n // kh
  qh = q.transpose(0, 2, 1, 3)  # [B, N, T, H]
  kr = np.repeat(k, g, axis=2).transpose(0, 2, 1, 3)  # [B, N, S, H]: query head n reads kv head n // G
  vr = np.repeat(v, g, axis=2).transpose(0, 2, 1, 3)
  doh = do.transpose(0, 2, 1, 3)
  visible = np.ones((t, s), bool)
  if causal:
    visible = np.arange(s)[None, :] <= np.arange(t)[:, None]  # [T, S]
  logits = np.where(visible, scale * (qh @ kr.swapaxes(-1, -2)), dtype(-np.inf))  # [B, N, T, S]
  d_fwd, d_bwd = (0.0, 0.0) if shift is None else shift
  logits_fwd = logits + d_fwd
  m_i = logits_fwd.max(axis=-1, initial=-np.inf)  # [B, N, T]; -inf for a row with no key
  m_safe = np.where(np.isfinite(m_i), m_i, dtype(0))
  p_un = np.exp(logits_fwd - m_safe[..., None])
  l_i = p_un.sum(axis=-1)
  l_safe = np.where(l_i > 0, l_i, dtype(1))
  lse = np.where(l_i > 0, m_safe + np.log(l_safe), dtype(-np.inf))
  p = p_un / l_safe[..., None]  # [B, N, T, S]
  out = p @ vr  # [B, N, T, H]
  if shift is not None:  # the backward's own P
    p = np.exp(logits + d_bwd - np.where(np.isfinite(lse), lse, dtype(0))[..., None])
  dp = doh @ vr.swapaxes(-1, -2)  # [B, N, T, S]
  delta = (doh * out).sum(axis=-1)  # [B, N, T]
  dlse_h = dlse.transpose(0, 2, 1)  # [B, N, T]
  ds = p * (dp - delta[..., None] + dlse_h[..., None])
  logp = logits_fwd - np.where(np.isfinite(lse), lse, dtype(0))[..., None]  # log P; -inf if masked
  return dict(scale=scale, g=g, visible=visible, qh=qh, kr=kr, vr=vr, doh=doh, p=p, logp=logp,
              lse=lse, out=out, dp=dp, delta=delta, dlse=dlse_h, ds=ds)


def _to_bthd(x):  # [B, N, T, H] -> [B, T, N, H] (and [B, N, T] -> [B, T, N])
  return x.transpose(0, 2, 1, 3) if x.ndim == 4 else x.transpose(0, 2, 1)


def _group_sum(x, kh):  # per query head [B, N, S, H] -> per kv head [B, S, K, H]
  b, n, s, h = x.shape
  return x.reshape(b, kh, n // kh, s, h).sum(axis=2).transpose(0, 2, 1, 3)


def numpy_reference(q, k, v, do, dlse, scale, causal, dtype=np.float64, shift=None):
  """out, lse, dq, dk, dv in numpy ``dtype`` arithmetic (float64: the reference), gradients by hand.

  Args: rank-4 arrays q, do ``[B, T, N, H]``, k, v ``[B, S, K, H]``, dlse ``[B, T, N]``; the float
  ``scale``; ``causal`` (key j visible to query i iff j <= i, top-left aligned). float32 arithmetic
  gives the error a float32-accumulating implementation may have (a budget fallback).

  With P = softmax(scale * Q K^T) per row (over the visible keys), O = P V, lse = log sum exp:
  dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO * O) + dlse), dQ = scale dS K, dK = scale dS^T Q;
  K/V heads shared by a group of G = N / K query heads sum their gradients over the group.
  """
  x = _terms(q, k, v, do, dlse, scale, causal, dtype, shift)
  kh = k.shape[2]
  dq = x["scale"] * (x["ds"] @ x["kr"])  # [B, N, T, H]
  dk = x["scale"] * (x["ds"].swapaxes(-1, -2) @ x["qh"])  # [B, N, S, H]
  dv = x["p"].swapaxes(-1, -2) @ x["doh"]  # [B, N, S, H]
  return (_to_bthd(x["out"]), _to_bthd(x["lse"]), _to_bthd(dq), _group_sum(dk, kh),
          _group_sum(dv, kh))


# float32 unit roundoff: the kernels compute the logits in float32 whatever the input dtype.
U32 = 2.0 ** -24


def logit_error(q, k, scale, causal):
  """Delta ``[B, N, T, S]``: a bound on the float32 rounding error of each scaled logit (0 where
  masked); see :func:`logit_rounding_bound`."""
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  qa = np.abs(q).transpose(0, 2, 1, 3)  # [B, N, T, H]
  ka = np.abs(np.repeat(k, n // kh, axis=2)).transpose(0, 2, 1, 3)  # [B, N, S, H]
  delta = abs(scale) * (h + 4) * U32 * (qa @ ka.swapaxes(-1, -2))
  if causal:
    delta = np.where(np.arange(s)[None, :] <= np.arange(t)[:, None], delta, 0.0)
  return delta


def _logsumexp_others(w):
  """``log sum_{l != j} e^(w_l)`` for every j along the last axis, from running log-sums (no
  cancellation, no underflow): -inf where j is the only finite entry."""
  neg = np.full(w.shape[:-1] + (1,), -np.inf)
  before = np.concatenate([neg, np.logaddexp.accumulate(w, axis=-1)[..., :-1]], axis=-1)
  after = np.concatenate([np.logaddexp.accumulate(w[..., ::-1], axis=-1)[..., ::-1][..., 1:], neg],
                         axis=-1)
  return np.logaddexp(before, after)


def _logsumexp(w):
  with np.errstate(invalid="ignore"):  # rows of -inf only
    m = np.max(w, axis=-1, initial=-np.inf)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    return m_safe + np.log(np.sum(np.exp(w - m_safe[..., None]), axis=-1))


def logit_rounding_bound(q, k, v, do, dlse, scale, causal):
  """Elementwise bounds on how far out, lse, dq, dk, dv may move when the logits carry the rounding
  error of a float32 evaluation: the conditioning of the call (float64 numpy).

  A float32 dot of H terms is off by at most gamma_H * sum_h |q_h| |k_h| (gamma_H ~ H u); the scale
  multiply, the exp2 base change and the subtraction of the running max add a few u of |s| each: so
  each logit moves by |d_ij| <= Delta_ij = |scale| (H + 4) u (|q_i| . |k_j|). Then, exactly (not to
  first order: the bounds stay valid, and saturate, when Delta is large; computed from log P):

  * forward (one pass uses the same logits for the max, the sum and the weights):
    P'_ij / P_ij = 1 / (P_ij + sum_{l != j} P_il e^(d_il - d_ij)) lies in [1 / (P_ij + R_ij),
    1 / (P_ij + r_ij)] with R_ij = sum_{l != j} P_il e^(Delta_il + Delta_ij) and r_ij the same with
    -Delta: F_ij = |P' - P| bound (0 for a lone key); |dO| <= F |V|;
    |dlse| <= max(log sum_l P_il e^Delta_il, -log sum_l P_il e^-Delta_il) + 2 u |lse|;
  * backward (P recomputed as exp(s' - lse) from a second evaluation s' of the logits and the
    forward's lse, as FlashAttention-2 does; the kernels' row-statistics form rounds less, so the
    bound holds for them too): |dP_ij| <= B_ij = P_ij (e^(Delta_ij + |dlse_i|) - 1);
    |dD| <= |dO| . |dO|_fwd; dP - D, which cancels on peaked rows, carries its own float32 rounding
    C_ij = (H + 2) u (|dO_i| . |v_j| + |dO_i| . |O_i|); |d dS| <= B |dP - D + dlse| + (P + B)
    (|dD| + C); |d dQ| <= |scale| |d dS| |K|, |d dK| <= |scale| |d dS|^T |Q|, |d dV| <= B^T |dO|.
    B may overflow to inf (a vacuous bound); an inf * 0 in the products is then taken as inf.

  Negligible for ordinary calls; at scale 1e3 with large inputs it covers what float32 logits cannot
  resolve.
  """
  x = _terms(q, k, v, do, dlse, scale, causal, np.float64)
  h, kh = q.shape[-1], k.shape[2]
  qa, ka = np.abs(x["qh"]), np.abs(x["kr"])
  delta_s = logit_error(q, k, scale, causal)  # [B, N, T, S]
  p, logp = x["p"], x["logp"]  # logp: -inf where masked
  with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
    log_r_up = delta_s + _logsumexp_others(logp + delta_s)  # log R_ij
    log_r_down = -delta_s + _logsumexp_others(logp - delta_s)  # log r_ij
    # P / (P + R) = e^(log P - logaddexp(log P, log R)): <= P, never overflows
    fwd = np.maximum(p - np.exp(logp - np.logaddexp(logp, log_r_up)),
                     np.exp(logp - np.logaddexp(logp, log_r_down)) - p)
    fwd = np.where(p > 0, fwd, 0.0)
    lse_fin = np.where(np.isfinite(x["lse"]), x["lse"], 0.0)
    d_lse = (np.maximum(_logsumexp(logp + delta_s), -_logsumexp(logp - delta_s))
             + 2 * U32 * np.abs(lse_fin))  # [B, N, T]
    d_lse = np.where(np.isfinite(x["lse"]), d_lse, 0.0)  # a row with no key: nothing moves
    d_out = fwd @ np.abs(x["vr"])  # [B, N, T, H]
    bwd = np.where(p > 0, np.exp(logp + delta_s + d_lse[..., None]) - p, 0.0)  # [B, N, T, S]
    d_delta = (np.abs(x["doh"]) * d_out).sum(axis=-1)  # [B, N, T]
    # dP - D cancels (exactly, on a one-hot row): its float32 rounding, which |scale| then multiplies
    doa, va = np.abs(x["doh"]), np.abs(x["vr"])
    d_cancel = (h + 2) * U32 * (doa @ va.swapaxes(-1, -2)
                                + (doa * np.abs(x["out"])).sum(axis=-1)[..., None])  # [B, N, T, S]
    d_ds = (bwd * np.abs(x["dp"] - x["delta"][..., None] + x["dlse"][..., None])
            + (p + bwd) * (d_delta[..., None] + d_cancel))
    d_dq = abs(scale) * (d_ds @ ka)
    d_dk = abs(scale) * (d_ds.swapaxes(-1, -2) @ qa)
    d_dv = bwd.swapaxes(-1, -2) @ np.abs(x["doh"])
  res = (_to_bthd(d_out), _to_bthd(d_lse), _to_bthd(d_dq), _group_sum(d_dk, kh),
         _group_sum(d_dv, kh))
  return tuple(np.nan_to_num(r, nan=np.inf, posinf=np.inf) for r in res)


# --- the error budget: the plain formula in the input dtype -------------------------------------------

def xla_formula(q, k, v, scale, causal):
  """softmax(scale Q K^T) V and lse, computed by XLA entirely in q's dtype (rank 4, S >= 1)."""
  g = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
  hi = jax.lax.Precision.HIGHEST
  logits = jnp.einsum("btnh,bsnh->bnts", q, k, precision=hi) * jnp.asarray(scale, q.dtype)
  if causal:
    t, s = q.shape[1], k.shape[1]
    logits = jnp.where(jnp.arange(s)[None, :] <= jnp.arange(t)[:, None], logits, -jnp.inf)
  lse = jax.nn.logsumexp(logits, axis=-1)  # [B, N, T]
  p = jnp.exp(logits - lse[..., None])
  out = jnp.einsum("bnts,bsnh->btnh", p, v, precision=hi)
  return out, jnp.swapaxes(lse, 1, 2)


@functools.partial(jax.jit, static_argnames=("scale", "causal"))
def _xla_values_and_grads(q, k, v, do, dlse, *, scale, causal):
  (out, lse), vjp = jax.vjp(lambda a, b, c: xla_formula(a, b, c, scale, causal), q, k, v)
  return (out, lse, *vjp((do, dlse.astype(lse.dtype))))


def xla_budget(q, k, v, do, dlse, scale, causal, dtype):
  """out, lse, dq, dk, dv of :func:`xla_formula` in ``dtype`` (rank-4 float64 inputs, S >= 1)."""
  args = [jnp.asarray(x, jnp.float32).astype(dtype) for x in (q, k, v, do)]
  res = _xla_values_and_grads(*args, jnp.asarray(dlse, jnp.float32), scale=scale, causal=causal)
  return [np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in res]


# --- strategies ---------------------------------------------------------------------------------------

# (N, K) pairs: MHA, GQA and MQA, small enough for interpret mode.
HEADS = ((1, 1), (2, 1), (2, 2), (4, 2), (3, 1), (4, 1), (3, 3), (6, 2), (6, 3))
# Empty calls are cheap and few: a None draw (shrinks first) keeps every axis non-empty.
EMPTY = (None,) * 12 + ("b", "t", "s")


def mosaic_configs(h: int, causal: bool):
  """The Mosaic defaults with the persistent forward's launch varied: 1-3 CTAs (so that a CTA runs
  several query tiles of these small calls, the K/V ring running on across them), the tiles dealt
  cyclically or greedily (MosaicConfig.persistent_deal), or one CTA per tile."""
  base = fa2_jax.MosaicConfig.default(h, is_causal=causal)
  persistent = st.builds(lambda ctas, deal: base.replace(persistent=True, persistent_ctas=ctas,
                                                         persistent_deal=deal),
                         st.integers(1, 3), st.sampled_from(("cyclic", "greedy")))
  return persistent | st.just(base.replace(persistent=False))


def block_sizes():
  """A valid Triton BlockSizes: every tile a power of two in 16..64."""
  tile = st.sampled_from(TILES)
  return st.builds(fa2_jax.BlockSizes, block_q=tile, block_k=tile, block_q_dkv=tile,
                   block_k_dkv=tile, block_q_dq=tile, block_k_dq=tile)


@st.composite
def calls(draw, *, max_len=70, head_dims=HEAD_DIMS, dtypes=tuple(DTYPES), transforms=TRANSFORMS,
          max_batch=3, heads=HEADS, with_blocks=True, max_work=None):
  """A :class:`Call`. ``max_work`` bounds ``stack * B * N * T * S`` (the float64 reference's size).
  ``with_blocks``: draw Triton tiles (True), none (False) or a Mosaic launch ("mosaic")."""
  h = draw(st.sampled_from(head_dims))
  # Interpret-mode time grows with H * T * S: the big head dims get a third of the lengths.
  cap = max_len if h <= 64 else max(1, max_len // 3)
  t = draw(st.integers(1, cap))
  s = draw(st.integers(1, cap))
  b = draw(st.sampled_from(tuple(range(1, max_batch + 1))))
  n, kh = draw(st.sampled_from(heads))
  transform = draw(st.sampled_from(transforms))
  stack = draw(st.sampled_from((1, 2))) if transform in STACKING else 1
  if max_work is not None:  # shrink T until the call fits (deterministic in the draws)
    t = max(1, min(t, max_work // (stack * b * n * s)))
  empty = draw(st.sampled_from(EMPTY))
  b, t, s = (0 if empty == "b" else b), (0 if empty == "t" else t), (0 if empty == "s" else s)
  dtype = draw(st.sampled_from(dtypes))
  causal = draw(st.booleans())
  scale = draw(st.sampled_from(SCALES))
  if with_blocks == "mosaic":
    blocks = draw(st.none() | mosaic_configs(h, causal))
  else:
    blocks = draw(st.none() | block_sizes()) if with_blocks else None
  rank3 = b == 1 and draw(st.booleans())
  amplitude = draw(st.sampled_from(AMPLITUDES))
  dlse = draw(st.booleans())
  seed = draw(st.integers(0, 2 ** 31 - 1))
  return Call(b, t, s, n, kh, h, dtype, causal, scale, blocks, rank3, transform, stack, amplitude,
              dlse, seed)


# --- running a call -----------------------------------------------------------------------------------

INTERPRET = None if on_gpu() else True


@contextlib.contextmanager
def mosaic_interpret():
  """The Mosaic kernels in Pallas GPU interpret mode with emulated wgmma (as test_mosaic_cpu.py), the
  dispatcher told it runs on Hopper so that implementation="mosaic" takes the public path."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  from fa2_jax.kernels.sm90.ops import emulated_mma
  with (mock.patch.object(platform, "gpu_compute_capability", return_value=(9, 0)), emulated_mma(),
        plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams())):
    yield


def attention(call: Call, backend: str):
  """``(q, k, v) -> (out, lse)`` for one backend: "triton" (the call's tiles; interpret mode on CPU,
  compiled on a GPU), "default" (implementation=None, default tiles) or "mosaic"."""
  kw = dict(scale=call.scale, is_causal=call.causal, return_residual=True)
  if backend == "triton":
    kw.update(implementation="triton", interpret=INTERPRET, block_sizes=call.blocks)
  elif backend == "mosaic":
    kw.update(implementation="mosaic", block_sizes=call.blocks)
  else:
    assert backend == "default", backend
  return lambda q, k, v: fa2_jax.flash_attention(q, k, v, **kw)


def shapes(call: Call):
  """Shapes of q (and do), k/v and lse as passed to the transform (with the stacked axis)."""
  lead_q = (call.stack,) if call.transform in STACKING else ()
  lead_kv = () if call.transform == "vmap_shared_kv" else lead_q
  batch = () if call.rank3 else (call.b,)
  q = (*lead_q, *batch, call.t, call.n, call.h)
  kv = (*lead_kv, *batch, call.s, call.kh, call.h)
  return q, kv, q[:-1]


def inputs(call: Call):
  """q, k, v, do in the call's dtype and dlse in float32, drawn from ``call.seed``."""
  rng = np.random.default_rng(call.seed)
  q_shape, kv_shape, lse_shape = shapes(call)
  dt = DTYPES[call.dtype]
  draw = lambda shape, amp: jnp.asarray(
      rng.standard_normal(shape, np.float32) * np.float32(amp)).astype(dt)
  q, k, v = (draw(sh, call.amplitude) for sh in (q_shape, kv_shape, kv_shape))
  scale = 1.0 / math.sqrt(call.h) if call.scale is None else call.scale
  if q.size and k.size:  # Cauchy-Schwarz bound of the largest |scale * q.k|, kept to MAX_LOGIT
    norm = lambda x: float(jnp.max(jnp.linalg.norm(x.astype(jnp.float32), axis=-1)))  # noqa: E731
    bound = abs(scale) * norm(q) * norm(k)
    if bound > MAX_LOGIT:
      shrink = math.sqrt(MAX_LOGIT / bound)
      q, k = ((x.astype(jnp.float32) * shrink).astype(dt) for x in (q, k))
  do = draw(q_shape, 1.0)
  dlse = (jnp.asarray(rng.standard_normal(lse_shape, np.float32)) if call.dlse
          else jnp.zeros(lse_shape, jnp.float32))
  return q, k, v, do, dlse


@contextlib.contextmanager
def x64_in_every_thread():
  """x64 switched on for the whole process, then back. The Pallas GPU interpreter (the emulated Mosaic
  kernels) runs kernel bodies in threads of its own, which do not see ``jax.enable_x64``'s
  thread-local setting: their int32 loop counters then meet the int64 ones traced under x64 and the
  lowering fails (found by the long profile). The compiled kernels have no such threads."""
  before = jax.config.read("jax_enable_x64")
  jax.config.update("jax_enable_x64", True)
  try:
    yield
  finally:
    jax.config.update("jax_enable_x64", before)


def run(call: Call, backend: str, q, k, v, do, dlse):
  """out, lse, dq, dk, dv of the backend under the call's transform, as float64 numpy arrays."""
  f = attention(call, backend)
  tr = call.transform
  ctx = mosaic_interpret() if backend == "mosaic" else contextlib.nullcontext()
  x64 = contextlib.nullcontext()
  if tr == "jit_x64":
    x64 = x64_in_every_thread() if backend == "mosaic" else jax.enable_x64(True)
  with ctx, x64:
    if tr == "grad":
      def loss(a, b, c):
        out, lse = f(a, b, c)
        # where(dlse != 0): an lse of -inf (S = 0) with a zero cotangent adds nothing, not NaN
        lse_term = jnp.sum(jnp.where(dlse != 0, lse * dlse, 0.0))
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)) + lse_term, (out, lse)

      (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
          q, k, v)
    else:
      g = {
          "plain": f,
          "jit": jax.jit(f),
          "jit_x64": jax.jit(f),
          "remat": jax.checkpoint(f),
          "vmap": jax.vmap(f),
          "vmap_shared_kv": jax.vmap(f, in_axes=(0, None, None)),
          "scan": lambda a, b, c: jax.lax.scan(lambda carry, x: (carry, f(*x)), None, (a, b, c))[1],
      }[tr]
      (out, lse), vjp = jax.vjp(g, q, k, v)
      grads = vjp((do, dlse))
  res = (out, lse, *grads)
  assert out.dtype == q.dtype and lse.dtype == jnp.float32, (out.dtype, lse.dtype)
  assert all(x.dtype == q.dtype for x in grads), [x.dtype for x in grads]
  return [np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in res]


@dataclasses.dataclass
class Expected:
  """What a call's outputs are held to, each a list (out, lse, dq, dk, dv) shaped like the outputs.

  ref: the float64 reference. cond: elementwise bounds of what float32 logits cannot resolve
  (:func:`logit_rounding_bound`). low: the budget formula (XLA in the input dtype; numpy float32 for
  float32 inputs). low32: the numpy float32 formula (the fallback). low and low32 are None for empty
  calls, which are held to the exact answer.
  """

  ref: list
  cond: list
  low: list | None
  low32: list | None


def expected(call: Call, q, k, v, do, dlse) -> Expected:
  f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)  # bf16 has no numpy dtype
  q, k, v, do, dlse = (f64(x) for x in (q, k, v, do, dlse))
  stacked = call.transform in STACKING
  shared = call.transform == "vmap_shared_kv"
  if not stacked:
    q, k, v, do, dlse = (x[None] for x in (q, k, v, do, dlse))
  if shared:
    k, v = (np.broadcast_to(x, (call.stack, *x.shape)) for x in (k, v))
  if call.rank3:  # add the batch axis back: [L, T, N, H] -> [L, 1, T, N, H]
    q, k, v, do, dlse = (x[:, None] for x in (q, k, v, do, dlse))
  scale = 1.0 / math.sqrt(call.h) if call.scale is None else call.scale
  empty = min(call.b, call.t, call.s) == 0
  per_slice = {"ref": [], "cond": [], "low": [], "low32": []}
  for i in range(q.shape[0]):
    args = (q[i], k[i], v[i], do[i], dlse[i], scale, call.causal)
    per_slice["ref"].append(numpy_reference(*args))
    per_slice["cond"].append(logit_rounding_bound(*args))
    if not empty:
      low32 = numpy_reference(*args, dtype=np.float32)
      per_slice["low32"].append(low32)
      # float32: numpy's float32 formula is the same-precision budget (and skips an XLA compile)
      per_slice["low"].append(low32 if call.dtype == "float32" else
                              xla_budget(*args, DTYPES[call.dtype]))

  def combine(slices, rounded=False):
    if not slices:
      return None
    res = []
    for j in range(5):
      parts = [np.asarray(sl[j], np.float64) for sl in slices]
      if shared and j >= 3:  # dk, dv of K/V shared across the mapped axis: summed over it
        x = np.sum(parts, axis=0)
        if rounded:  # the budget formula's sum is in the input dtype too (found by the long profile:
          x = f64(jnp.asarray(x, np.float32).astype(DTYPES[call.dtype]))  # half an ulp of the sum)
        res.append(x[0] if call.rank3 else x)
        continue
      x = np.stack(parts)
      x = x[:, 0] if call.rank3 else x
      res.append(x if stacked else x[0])
    return res

  return Expected(*(combine(per_slice[key], rounded=key == "low")
                    for key in ("ref", "cond", "low", "low32")))


NAMES = ("out", "lse", "dq", "dk", "dv")


def assert_matches(call: Call, got, want: Expected):
  """The tolerance rule of the module docstring, output by output."""
  tol = TOLERANCE[call.dtype]
  report = []
  for j, name in enumerate(NAMES):
    g, r = got[j], want.ref[j]
    assert g.shape == r.shape, f"{name}: shape {g.shape} != reference {r.shape}"
    assert not np.isnan(g).any(), f"{name}: NaN at {np.argwhere(np.isnan(g))[:4].tolist()}"
    finite = np.isfinite(r)
    # Only a row with no key (S = 0) has a non-finite reference: lse = -inf there.
    assert np.array_equal(g[~finite], r[~finite]), f"{name}: want {r[~finite][:4]} where keyless"
    if not finite.any():
      continue
    dt_max = float(jnp.finfo(jnp.float32 if name == "lse" else DTYPES[call.dtype]).max)
    representable = finite & (np.abs(r) < dt_max / 2)
    bad = representable & ~np.isfinite(g)
    assert not bad.any(), f"{name}: non-finite {g[bad][:4]} at {np.argwhere(bad)[:4].tolist()}"
    # Past half the dtype's range an infinity of the reference's sign is the rounded answer.
    finite &= ~(~representable & np.isinf(g) & (np.sign(g) == np.sign(r)))
    if not finite.any():
      continue
    mag = float(np.max(np.abs(r[finite]))) + 1.0
    if want.low is None:  # empty call: exact zeros
      err_xla = 0.0
    else:
      err_xla = float(np.max(np.abs(want.low[j][finite] - r[finite])))
      if not math.isfinite(err_xla):
        # The formula overflowed in the dtype (or XLA's fusion of it broke down at an extreme scale):
        # the error of the same formula in numpy float32 arithmetic, plus dtype epsilons.
        err_xla = (float(np.max(np.abs(want.low32[j][finite] - r[finite])))
                   + tol["fallback"] * mag)
    err = np.abs(g[finite] - r[finite])
    allowed = tol["factor"] * err_xla + tol["atol"] * mag + want.cond[j][finite]
    worst = int(np.argmax(err - allowed))
    report.append(f"{name}: err {err.max():.3g} xla {err_xla:.3g} cond {want.cond[j].max():.3g} "
                  f"worst err {err[worst]:.3g} > allowed {allowed[worst]:.3g}")
    assert err[worst] <= allowed[worst], (
        f"{name} error {err[worst]:.4g} > allowed {allowed[worst]:.4g} at "
        f"{np.argwhere(finite)[worst].tolist()}\n" + "\n".join(report))


def check_call(call: Call, backend: str, poison=None):
  """Run one call on one backend and check it against the reference.

  ``poison``: ``(which, value)`` with ``which`` in "k", "v", "kv": those arrays hold ``value`` at every
  key no query attends (causal, keys ``j >= T``). The reference and the budgets see the clean inputs;
  the gradients of the poisoned keys must be exactly zero.
  """
  q, k, v, do, dlse = inputs(call)
  want = expected(call, q, k, v, do, dlse)
  if poison is not None:
    which, value = poison
    fill = lambda x: x.at[..., call.t:, :, :].set(value)  # key axis: -3 in every layout
    k = fill(k) if "k" in which else k
    v = fill(v) if "v" in which else v
  got = run(call, backend, q, k, v, do, dlse)
  assert_matches(call, got, want)
  if poison is not None:
    for name, g in (("dk", got[3]), ("dv", got[4])):
      leak = g[..., call.t:, :, :]
      assert not leak.any(), f"{name} of unattended keys: {leak[np.nonzero(leak)][:4]}"


def examples(weight: float):
  """Settings with ``weight`` times the active profile's max_examples (at least 1)."""
  return settings(max_examples=max(1, round(settings.default.max_examples * weight)))


# --- the reference and the conditioning bound, checked on their own (numpy only, fast) -------------

def _float64_inputs(call: Call):
  """Rank-4 float64 q, k, v, do, dlse of a call (its seed and amplitude; no dtype rounding)."""
  rng = np.random.default_rng(call.seed)
  qs, kvs = (call.b, call.t, call.n, call.h), (call.b, call.s, call.kh, call.h)
  q, k, v = (rng.standard_normal(sh) * call.amplitude for sh in (qs, kvs, kvs))
  do, dlse = rng.standard_normal(qs), rng.standard_normal(qs[:-1]) * call.dlse
  return q, k, v, do, dlse


@examples(5.0)
@given(call=calls(max_len=12, head_dims=(1, 3, 8), max_batch=2))
def test_numpy_reference_gradients_are_the_derivative(call):
  """dq, dk, dv of :func:`numpy_reference` are the derivative of sum(out * do) + sum(lse * dlse):
  central differences along a random direction of each input agree to float64 precision."""
  scale = call.scale if call.scale is not None and abs(call.scale) <= 10 else 0.7
  q, k, v, do, dlse = _float64_inputs(dataclasses.replace(call, amplitude=1.0))
  ref = numpy_reference(q, k, v, do, dlse, scale, call.causal)
  if not np.isfinite(ref[1]).all():  # S = 0: lse = -inf, nothing to differentiate
    return

  def loss(q, k, v):
    out, lse = numpy_reference(q, k, v, do, dlse, scale, call.causal)[:2]
    return float(np.sum(out * do) + np.sum(lse * dlse))

  rng = np.random.default_rng(call.seed + 1)
  eps = 1e-6  # central differences: truncation ~eps^2, rounding ~1e-16 / eps
  for i, grad in enumerate(ref[2:]):
    d = rng.standard_normal(grad.shape)
    plus = [x + eps * d if j == i else x for j, x in enumerate((q, k, v))]
    minus = [x - eps * d if j == i else x for j, x in enumerate((q, k, v))]
    numeric = (loss(*plus) - loss(*minus)) / (2 * eps)
    analytic = float(np.sum(grad * d))
    assert abs(numeric - analytic) <= 1e-6 * (1 + abs(analytic)), (NAMES[2 + i], numeric, analytic)


@examples(5.0)
@given(call=calls(max_len=24, head_dims=(1, 3, 8, 64), max_batch=2), corner=st.booleans())
def test_logit_rounding_bound_covers_perturbed_logits(call, corner):
  """Perturb every logit by up to Delta (the forward and the backward independently, uniformly or at
  the +-Delta corners): out, lse and the gradients move by no more than :func:`logit_rounding_bound`."""
  scale = 1.0 / math.sqrt(call.h) if call.scale is None else call.scale
  q, k, v, do, dlse = _float64_inputs(call)
  ref = numpy_reference(q, k, v, do, dlse, scale, call.causal)
  bound = logit_rounding_bound(q, k, v, do, dlse, scale, call.causal)
  delta = logit_error(q, k, scale, call.causal)
  rng = np.random.default_rng(call.seed + 2)
  draw = ((lambda: delta * rng.choice([-1.0, 1.0], delta.shape)) if corner else
          (lambda: delta * rng.uniform(-1.0, 1.0, delta.shape)))
  with np.errstate(over="ignore", invalid="ignore"):
    moved = numpy_reference(q, k, v, do, dlse, scale, call.causal, shift=(draw(), draw()))
  for name, m, r, b in zip(NAMES, moved, ref, bound):
    fin = np.isfinite(r)
    if not fin.any():
      continue
    # float64 slack: both sides are float64 evaluations of values up to max|r|; an infinite bound
    # (saturated) holds whatever moved
    slack = 1e-9 * (np.max(np.abs(r[fin])) + 1.0)
    with np.errstate(invalid="ignore"):
      over = np.where(np.isinf(b[fin]), -1.0, np.abs(m[fin] - r[fin]) - b[fin] - slack)
    assert not (over > 0).any(), (name, float(np.max(over)))


# --- properties ---------------------------------------------------------------------------------------

@examples(1.0)
@given(call=calls())
# Found by the long profile: one key per row at logits of 1e5 (bf16), a saturated row whose dQ the
# formula cancels to exactly 0; now drawn with its logits kept to MAX_LOGIT.
@example(call=Call(b=2, t=1, s=1, n=1, kh=1, h=1, dtype="bfloat16", causal=False, scale=1e3,
                   blocks=None, rank3=False, transform="plain", stack=1, amplitude=10.0, dlse=False,
                   seed=0))
def test_triton_matches_reference(call):
  check_call(call, "triton")


@examples(0.6)
@given(call=calls(head_dims=HEAD_DIMS + (512,), with_blocks=False))
def test_default_matches_reference(call):
  check_call(call, "default")


# The Mosaic kernels: bf16/fp16 at head_dim 64/128, short ragged lengths (tiles are 64 rows). About
# 10 s an example in interpret mode: a fifth of the profile's examples (ci: 2, the first the simplest).
# No remat: the Pallas GPU interpreter that emulates them on a CPU has ordered effects, which
# jax.checkpoint cannot differentiate (the compiled kernels can: the GPU profile and
# test_mosaic_gpu.py draw and test it).
@examples(0.2)
@given(call=calls(max_len=80, head_dims=(64, 128), dtypes=("bfloat16", "float16"), max_batch=2,
                  heads=((1, 1), (2, 1), (2, 2)), with_blocks="mosaic",
                  transforms=tuple(t for t in TRANSFORMS if t != "remat")))
# Found by the long profile: jit under x64 in the emulator (see x64_in_every_thread).
@example(call=Call(b=2, t=1, s=1, n=1, kh=1, h=64, dtype="bfloat16", causal=False, scale=None,
                   blocks=None, rank3=False, transform="jit_x64", stack=1, amplitude=1.0, dlse=False,
                   seed=0))
def test_mosaic_interpret_matches_reference(call):
  check_call(call, "mosaic")


@st.composite
def unattended(draw, **kw):
  """A causal call with keys past the last query (S > T >= 1) and the poison those keys hold."""
  call = draw(calls(**kw))
  extra = draw(st.integers(1, 40))
  call = dataclasses.replace(call, b=max(call.b, 1), t=max(call.t, 1), causal=True,
                             rank3=call.rank3 and call.b == 1)
  call = dataclasses.replace(call, s=call.t + extra)
  poison = (draw(st.sampled_from(("kv", "k", "v"))),
            draw(st.sampled_from((float("nan"), float("inf"), -float("inf")))))
  return call, poison


@pytest.mark.parametrize("backend", ["triton", "default"])
@examples(0.3)
@given(case=unattended())
# K/V shared by a vmap: its dV, a sum of two bf16 gradients, rounds once more (found by the long
# profile against a budget that summed in float64)
@example(case=(Call(b=2, t=1, s=2, n=1, kh=1, h=3, dtype="bfloat16", causal=True, scale=None,
                    blocks=None, rank3=False, transform="vmap_shared_kv", stack=2, amplitude=1.0,
                    dlse=False, seed=0), ("kv", float("nan"))))
def test_unattended_keys_cannot_leak(backend, case):
  """Keys no query attends (causal, j >= T) may hold NaN/inf: outputs stay exact, and their dK/dV
  are zero."""
  call, poison = case
  check_call(call, backend, poison=poison)


# --- attention variants: drawn combinations ------------------------------------------------------

_MASK_FNS = (  # (numpy, jnp) pairs of the same rule, on absolute query positions p and keys j
    (lambda b, h, p, j: (p - j) % 3 != 1, lambda b, h, p, j: (p - j) % 3 != 1),
    (lambda b, h, p, j: (j != 2) | (b == 1), lambda b, h, p, j: (j != 2) | (b == 1)),
)


@st.composite
def variant_calls(draw, max_len=24):
  """A call with a drawn combination of attention variants: ``(spec, b, t, s, n, kh, h, seed)`` in
  the terms of ``test_variants.Spec``, every variant argument independently present or not."""
  from test_variants import Spec, _score_fn
  b, t, s = draw(st.integers(1, 2)), draw(st.integers(1, max_len)), draw(st.integers(1, max_len))
  kh = draw(st.sampled_from((1, 2)))
  n = kh * draw(st.sampled_from((1, 2)))
  h = draw(st.sampled_from((8, 16, 24)))
  side = st.none() | st.integers(0, 10)
  lengths = lambda hi: st.none() | st.lists(st.integers(0, hi), min_size=b, max_size=b)  # noqa: E731
  ids = lambda size: st.lists(st.integers(0, 3), min_size=size, max_size=size)  # noqa: E731
  spec = Spec(causal=draw(st.booleans()), window=draw(st.none() | st.tuples(side, side)))
  if (q_len := draw(lengths(t))) is not None:
    spec.q_len = np.array(q_len)
  if (kv_len := draw(lengths(s))) is not None:
    spec.kv_len = np.array(kv_len)
  if draw(st.booleans()):  # packed documents: non-decreasing segment ids per row
    spec.q_seg = np.sort(np.array([draw(ids(t)) for _ in range(b)]), axis=1).astype(np.int32)
    spec.kv_seg = np.sort(np.array([draw(ids(s)) for _ in range(b)]), axis=1).astype(np.int32)
  if draw(st.booleans()):
    spec.q_offset = np.array(draw(st.lists(st.integers(-8, 16), min_size=b, max_size=b)))
  spec.cap = draw(st.none() | st.sampled_from((0.75, 3.0)))
  if draw(st.booleans()):
    spec.slopes = np.array(draw(st.lists(st.sampled_from((0.0, 0.125, 0.5)), min_size=b * n,
                                         max_size=b * n)), np.float32).reshape(b, n)
  if (mask := draw(st.none() | st.sampled_from(_MASK_FNS))) is not None:
    spec.mask_np, spec.mask_jnp = mask
  if draw(st.booleans()):
    spec.score = _score_fn()
  return spec, b, t, s, n, kh, h, draw(st.integers(0, 2**16))


@pytest.mark.parametrize("backend", ["xla", "triton"])
@examples(0.5)
@given(case=variant_calls())
def test_variant_combinations_match_reference(backend, case):
  """Any combination of causal, window, lengths, segment ids, offset, soft cap, ALiBi, mask_fn and
  score_fn: out, lse and gradients against test_variants' independent float64 numpy reference (the
  Triton kernels in interpret mode off a GPU)."""
  from test_variants import check_against_numpy
  spec, b, t, s, n, kh, h, seed = case
  check_against_numpy(backend, spec, b, t, s, n, kh, h=h, seed=seed)


# --- GPU: compiled, bigger shapes ---------------------------------------------------------------------

# float64 reference of [B, N, T, S]: 2^24 elements (128 MiB per array) keeps the numpy side quick.
GPU_WORK = 1 << 24
GPU_HEAD_DIMS = (16, 32, 48, 64, 64, 80, 96, 112, 128, 128, 160, 192, 256)


def gpu_blocks(call: Call, backend: str) -> Call:
  """Drawn tiles only where they fit a GPU's shared memory: 64-wide tiles of a 16-bit head_dim <= 128
  (float32: <= 64) with the default pipelining; the default implementation keeps its own tiles."""
  fits = call.h <= (64 if call.dtype == "float32" else 128)
  return call if backend == "triton" and fits else dataclasses.replace(call, blocks=None)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["default", "triton"])
@examples(1.0)
@given(call=calls(max_len=2048, head_dims=GPU_HEAD_DIMS, max_batch=2, max_work=GPU_WORK,
                  heads=HEADS + ((8, 8), (8, 2), (8, 1))))
def test_compiled_matches_reference_gpu(backend, call):
  check_call(gpu_blocks(call, backend), backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["default", "triton"])
@examples(0.5)
@given(case=unattended(max_len=2048, head_dims=GPU_HEAD_DIMS, max_batch=2, max_work=GPU_WORK))
def test_unattended_keys_cannot_leak_gpu(backend, case):
  call, poison = case
  check_call(gpu_blocks(call, backend), backend, poison=poison)


# --- the forward at extreme logits --------------------------------------------------------------------

@st.composite
def extreme_calls(draw, **kw):
  """A call whose |scale * q.k| reaches 1e5 to 1e30 (either sign of scale), the inputs unshrunk."""
  call = draw(calls(transforms=("jit",), **kw))
  scale = draw(st.sampled_from((1.0, -1.0))) * 10.0 ** draw(st.integers(5, 26))
  return dataclasses.replace(call, b=max(call.b, 1), t=max(call.t, 1), s=max(call.s, 1),
                             scale=scale, dlse=False)


def check_extreme(call: Call, backend: str):
  """Out and lse finite; each output is a convex combination of the attended values (within the
  dtype's rounding); the lse is the float64 one up to float32 rounding of logits this large. The
  gradients hold no NaN, and each recomputed weight stays in [0, 1], so |dV_j| <= sum_i |dO_i|.
  (Their accuracy at these logits needs the backward's logits bitwise equal to the forward's, which
  interpret mode does not give: XLA sums the two kernels' dot products in different orders, and an
  ulp times |scale| is many binades. tests/test_extreme_logits.py checks it on exact sums.)"""
  rng = np.random.default_rng(call.seed)
  q_shape, kv_shape, _ = shapes(call)
  dt = DTYPES[call.dtype]
  q, k, v, do = (jnp.asarray(rng.standard_normal(sh, np.float32) * np.float32(amp)).astype(dt)
                 for sh, amp in ((q_shape, call.amplitude), (kv_shape, call.amplitude),
                                 (kv_shape, call.amplitude), (q_shape, 1.0)))

  def run(q, k, v, do):
    (out, lse), vjp = jax.vjp(attention(call, backend), q, k, v)
    return out, lse, vjp((do, jnp.zeros_like(lse)))

  ctx = mosaic_interpret() if backend == "mosaic" else contextlib.nullcontext()
  with ctx:
    out, lse, grads = jax.jit(run)(q, k, v, do)
  out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
  dq, dk, dv = (np.asarray(g.astype(jnp.float32), np.float64) for g in grads)
  do = np.asarray(do, np.float64)
  if call.rank3:
    out, lse, q, k, v, dq, dk, dv, do = (x[None] for x in (out, lse, q, k, v, dq, dk, dv, do))
  assert np.isfinite(out).all() and np.isfinite(lse).all(), "non-finite forward at extreme logits"
  x = _terms(q, k, v, np.zeros(q.shape), np.zeros(lse.shape), call.scale, call.causal, np.float64)
  live = np.broadcast_to(x["visible"], x["logp"].shape)  # [B, N, T, S]
  vn = x["vr"][:, :, None]  # [B, N, 1, S, H]
  lo = _to_bthd(np.where(live[..., None], vn, np.inf).min(3))  # [B, T, N, H]
  hi = _to_bthd(np.where(live[..., None], vn, -np.inf).max(3))
  slack = 4 * float(jnp.finfo(dt).eps) * np.maximum(np.abs(lo), np.abs(hi))
  assert (out >= lo - slack).all() and (out <= hi + slack).all(), "output outside the values' hull"
  # The lse moves by at most the largest float32 rounding of a logit of its row.
  ref_lse = _to_bthd(x["lse"])
  fin = np.isfinite(ref_lse)
  bound = (_to_bthd(logit_error(np.asarray(q, np.float64), np.asarray(k, np.float64), call.scale,
                                call.causal).max(-1))
           + 1e-5 * np.abs(np.where(fin, ref_lse, 0)) + 1e-3)
  assert (np.abs(lse - ref_lse)[fin] <= bound[fin]).all(), "lse off"
  for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
    assert not np.isnan(g).any(), f"NaN in {name} at extreme logits"
  b, t, n, h = do.shape
  kh = dv.shape[2]
  rows = np.abs(do).reshape(b, t, kh, n // kh, h).sum(axis=(1, 3))  # [B, K, H]: sum_i |dO_i|
  assert (np.abs(dv) <= rows[:, None] * (1 + 4 * float(jnp.finfo(dt).eps)) + 1e-6).all(), "dV blew up"


@pytest.mark.parametrize("backend", ["triton", "default"])
@examples(0.3)
@given(call=extreme_calls(max_len=40, heads=((1, 1), (2, 1), (4, 2))))
# Found by the long profile on the kernels before the huge-row scaling: NaN at scale 1e9.
@example(call=Call(b=2, t=1, s=33, n=1, kh=1, h=1, dtype="float32", causal=False, scale=1e9,
                   blocks=fa2_jax.BlockSizes(block_q=16, block_k=16, block_q_dkv=16, block_k_dkv=16,
                                             block_q_dq=16, block_k_dq=16), rank3=False, transform="jit",
                   stack=1, amplitude=1.0, dlse=False, seed=0))
# And in the formula (the default on a CPU), at head_dim 1: an empty row (lse -inf) at scale 1e10.
@example(call=Call(b=2, t=1, s=2, n=1, kh=1, h=1, dtype="float32", causal=False, scale=1e10,
                   blocks=None, rank3=False, transform="jit", stack=1, amplitude=1.0, dlse=False,
                   seed=0))
# Found by the long profile once it checked gradients: NaN in dQ at scale 1e8 (the backward's
# recomputed logit an ulp above the forward's maximum, times |scale|: an exponent past 2^128).
@example(call=Call(b=2, t=3, s=33, n=1, kh=1, h=24, dtype="float32", causal=False, scale=1e8,
                   blocks=None, rank3=False, transform="jit", stack=1, amplitude=1.0, dlse=False,
                   seed=0))
def test_finite_at_extreme_logits(backend, call):
  check_extreme(call, backend)


@examples(0.1)
@given(call=extreme_calls(max_len=80, head_dims=(64, 128), dtypes=("bfloat16", "float16"),
                          max_batch=2, heads=((1, 1), (2, 1)), with_blocks=False))
def test_finite_at_extreme_logits_mosaic(call):
  check_extreme(call, "mosaic")
