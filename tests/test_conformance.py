"""Conformance with ``jax.nn.dot_product_attention``: the same calls through jax.nn (its XLA
implementation) and through ``fa2_jax.flash_attention`` (the formula and the Triton kernels; on a GPU
also the default dispatch), across jax.nn's parameter space: dtypes, GQA/MQA, ``vmap``, causal x
padding x window, T != S, rank-3 inputs, None arguments, the lse and its cotangent, and the errors
jax.nn raises. Numbers are compared where the two are defined to agree; where they are not, the
documented difference (docs/jax-nn-differences.md) is asserted instead, so a change on either side
shows here.

Small shapes: on a CPU the whole module takes about a minute on one core (interpret-mode kernels).
"""
from __future__ import annotations

import contextlib
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa2_jax
from conftest import on_gpu

# The fa2_jax paths compared with jax.nn: the formula and the Triton kernels (Pallas interpret mode
# on a CPU); on a GPU also implementation=None (the Mosaic kernels on Hopper).
PATHS = {"xla": dict(implementation="xla"),
         "triton": dict(implementation="triton", interpret=not on_gpu())}
if on_gpu():
  PATHS["default"] = {}

# Error bounds, relative to max|jax.nn's value| (+1): jax.nn rounds the probabilities to the input
# dtype before P V (and its lse to the key dtype), fa2_jax keeps them in float32, so half-precision
# results differ by about the dtype's rounding. jax.nn's float32 dots on a GPU may use TF32.
TOL = {jnp.dtype(jnp.float32): 2e-3 if on_gpu() else 5e-5,
       jnp.dtype(jnp.bfloat16): 4e-2, jnp.dtype(jnp.float16): 6e-3}


def jax_nn(*args, **kw):
  """``jax.nn.dot_product_attention`` under JAX's standard dtype promotion: for bfloat16/float16
  inputs it promotes them with float32 implicitly (``jnp.promote_types``), which
  ``jax_numpy_dtype_promotion='strict'`` (this suite's setting, tests/conftest.py) refuses
  (test_strict_numpy_modes)."""
  with jax.numpy_dtype_promotion("standard"):
    return jax.nn.dot_product_attention(*args, **kw)


def _inputs(b, t, s, n, kh, h, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (b, t, n, h), jnp.float32).astype(dtype)
  k = jax.random.normal(keys[1], (b, s, kh, h), jnp.float32).astype(dtype)
  v = jax.random.normal(keys[2], (b, s, kh, h), jnp.float32).astype(dtype)
  dout = jax.random.normal(keys[3], (b, t, n, h), jnp.float32).astype(dtype)
  return q, k, v, dout


def _allowed(b, t, s, *, is_causal=False, window=None, q_len=None, kv_len=None):
  """numpy bool ``[B, T, S]``: jax.nn's rule (top-left causal, ``j`` in ``[i - left, i + right]``,
  lengths)."""
  i = np.arange(t)[None, :, None]
  j = np.arange(s)[None, None, :]
  ok = np.ones((b, t, s), bool)
  if is_causal:
    ok &= j <= i
  if window is not None:
    left, right = (window, window) if isinstance(window, int) else window
    ok &= (j >= i - left) & (j <= i + right)
  if q_len is not None:
    ok &= i < np.asarray(q_len)[:, None, None]
  if kv_len is not None:
    ok &= j < np.asarray(kv_len)[:, None, None]
  return ok


def _close(got, want, tol, what):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  err = float(np.max(np.abs(got - want), initial=0.0))
  bound = tol * (float(np.max(np.abs(want), initial=0.0)) + 1.0)
  assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


def _both(q, k, v, dout, path, **kw):
  """``(out, lse, (dq, dk, dv))`` of jax.nn and of fa2_jax (on ``path``) for the same call, the
  output cotangent ``dout`` and a zero lse cotangent (``dout`` may be a tuple of cotangents: then a
  tuple of gradients for each), each side one jitted program (jax.nn's traced
  under the standard dtype promotion, as :func:`jax_nn`; in float16 on a CPU eagerly: there it asks
  for an F16_F16_F32 dot, which the CPU refuses, and only an eager call falls back)."""
  results = []
  for fn, promotion in ((jax.nn.dot_product_attention, "standard"),
                        (lambda *a, **k_: fa2_jax.flash_attention(*a, **k_, **PATHS[path]), None)):
    def run(q, k, v, dout, fn=fn):
      (out, lse), vjp = jax.vjp(lambda q_, k_, v_: fn(q_, k_, v_, return_residual=True, **kw),
                                q, k, v)
      if isinstance(dout, tuple):
        return out, lse, tuple(vjp((d, jnp.zeros_like(lse))) for d in dout)
      return out, lse, vjp((dout, jnp.zeros_like(lse)))
    eager = promotion and q.dtype == jnp.float16 and not on_gpu()
    with jax.numpy_dtype_promotion(promotion) if promotion else contextlib.nullcontext():
      results.append((run if eager else jax.jit(run))(q, k, v, dout))
  return results


def _check_against_jax_nn(q, k, v, dout, path, *, allowed, **kw):
  """Both sides' out, lse and gradients agree on the rows that attend some key (``allowed``
  ``[B, T, S]``); on the rows that attend none, the documented difference: fa2_jax gives out 0,
  lse -inf (and zero gradients), jax.nn the mean of the values (0 past ``query_seq_lengths``) and a
  huge negative lse."""
  has_key = allowed.any(-1)  # [B, T]
  rows = jnp.asarray(has_key)[:, :, None, None]
  # gradients compared with a cotangent on the rows with keys; one on the others, apart
  douts = (jnp.where(rows, dout, jnp.zeros_like(dout)), jnp.where(rows, jnp.zeros_like(dout), dout))
  if has_key.all():
    douts = douts[0]
  (out_r, lse_r, grads_r), (out, lse, grads) = _both(q, k, v, douts, path, **kw)
  if not has_key.all():
    (grads_r, empty_grads_r), (grads, empty_grads) = grads_r, grads
  dtype = jnp.dtype(q.dtype)
  tol = TOL[dtype]
  assert out.dtype == dtype and out.shape == q.shape
  assert lse.dtype == jnp.float32 and lse_r.dtype == k.dtype  # difference: float32 lse
  rows = has_key[:, :, None, None]
  _close(np.where(rows, out, 0), np.where(rows, out_r, 0), tol, "out")
  lse_tol = 2 * tol if dtype == jnp.float32 else 1e-2  # jax.nn's lse is rounded to the key dtype
  _close(np.where(has_key[..., None], lse, 0), np.where(has_key[..., None], lse_r, 0), lse_tol, "lse")
  for name, g, g_r in zip(("dq", "dk", "dv"), grads, grads_r):
    assert g.dtype == g_r.dtype == dtype
    _close(g, g_r, 2 * tol, name)
  if not has_key.all():
    empty = ~has_key
    assert np.all(np.asarray(out, np.float32)[empty] == 0), "fa2_jax: out 0 on rows without keys"
    assert np.all(np.asarray(lse)[empty] == -np.inf), "fa2_jax: lse -inf on rows without keys"
    lse_r = np.asarray(lse_r, np.float32)[empty]
    assert np.all(lse_r < -1e38) or dtype == jnp.float16, lse_r  # jax.nn: -0.7 * float32 max
    group = q.shape[2] // k.shape[2]
    mean_v = np.repeat(np.asarray(v, np.float32).mean(1), group, axis=1)  # [B, N, H] of all S keys
    q_len = kw.get("query_seq_lengths")
    padded = (np.zeros_like(has_key) if q_len is None
              else np.arange(q.shape[1])[None, :] >= np.asarray(q_len)[:, None])
    want = np.where(padded[..., None, None], 0.0, mean_v[:, None])  # [B, T, N, H]
    _close(np.asarray(out_r, np.float32)[empty], want[empty], tol, "jax.nn's out on empty rows")
    # gradients from those rows: none in fa2_jax; into the values in jax.nn (the mean's), but from
    # rows past query_seq_lengths (its output is multiplied by 0 there)
    for name, g, g_r in zip(("dq", "dk", "dv"), empty_grads, empty_grads_r):
      assert not np.any(np.asarray(g, np.float32)), f"fa2_jax: {name} from rows without keys"
      assert np.any(np.asarray(g_r, np.float32)) == (name == "dv" and bool((empty & ~padded).any())), (
          f"jax.nn: {name} from rows without keys")


# --- numbers: dtypes, GQA/MQA, scale, T != S ------------------------------------------------------

@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype, n, kh, scale", [
    (jnp.float32, 4, 4, 0.3),    # MHA, a given scale
    (jnp.bfloat16, 4, 2, None),  # GQA
    (jnp.float16, 4, 1, None),   # MQA
])
def test_dtypes_and_heads(path, dtype, n, kh, scale):
  q, k, v, dout = _inputs(2, 24, 40, n, kh, 16, dtype)
  _check_against_jax_nn(q, k, v, dout, path, allowed=_allowed(2, 24, 40), scale=scale)


# --- causal x padding x window (T != S both ways) -------------------------------------------------

PADDINGS = {"none": {}, "kv": dict(key_value_seq_lengths=[29, 7]),
            "q_kv": dict(query_seq_lengths=[11, 24], key_value_seq_lengths=[40, 3])}
WINDOWS = [None, 3, (4, 0), (0, 6)]
GRID = list(itertools.product([False, True], PADDINGS, WINDOWS))
# The Triton kernels run a subset that meets every level of each factor (each combination
# compiles its own kernels in interpret mode); the formula runs them all.
TRITON_GRID = [(False, "q_kv", (0, 6)), (True, "none", 3), (True, "kv", (4, 0)),
               (False, "kv", None), (True, "q_kv", None)]


@pytest.mark.parametrize("path, is_causal, padding, window", [
    *(("xla", *c) for c in GRID), *(("triton", *c) for c in TRITON_GRID)])
def test_causal_padding_window(path, is_causal, padding, window):
  # T < S for a padded call, T > S otherwise: top-left causal then has rows past S, and the
  # q_kv/kv paddings leave rows without keys.
  t, s = (24, 40) if padding != "none" else (40, 24)
  lens = {name: jnp.asarray(x, jnp.int32) for name, x in PADDINGS[padding].items()}
  q, k, v, dout = _inputs(2, t, s, 4, 2, 16, jnp.float32, seed=1)
  allowed = _allowed(2, t, s, is_causal=is_causal, window=window,
                     q_len=lens.get("query_seq_lengths"), kv_len=lens.get("key_value_seq_lengths"))
  _check_against_jax_nn(q, k, v, dout, path, allowed=allowed, is_causal=is_causal,
                        local_window_size=window, **lens)


# --- rank 3, vmap ---------------------------------------------------------------------------------

@pytest.mark.parametrize("path", list(PATHS))
def test_rank3_inputs(path):
  q, k, v, dout = _inputs(1, 20, 28, 2, 1, 16, jnp.bfloat16, seed=2)
  kw = dict(is_causal=True, key_value_seq_lengths=jnp.array([17], jnp.int32))
  (out_r, lse_r, grads_r), (out, lse, grads) = _both(q[0], k[0], v[0], dout[0], path, **kw)
  assert out.shape == out_r.shape == q.shape[1:] and lse.shape == lse_r.shape == q.shape[1:3]
  _close(out, out_r, TOL[jnp.dtype(jnp.bfloat16)], "out")
  _close(lse, lse_r, 1e-2, "lse")
  for name, g, g_r in zip(("dq", "dk", "dv"), grads, grads_r):
    _close(g, g_r, 2 * TOL[jnp.dtype(jnp.bfloat16)], name)


@pytest.mark.parametrize("path", list(PATHS))
def test_vmap(path):
  """``vmap`` over a leading axis of the query (keys and values shared), as with jax.nn."""
  q, k, v, _ = _inputs(3, 16, 24, 2, 2, 16, jnp.float32, seed=3)
  q = q.reshape(3, 1, 16, 2, 16)
  k, v = k[:1], v[:1]
  fns = (jax_nn,
         lambda *a, **kw: fa2_jax.flash_attention(*a, **kw, **PATHS[path]))
  want, got = (jax.vmap(lambda q_: fn(q_, k, v, is_causal=True))(q) for fn in fns)
  assert got.shape == want.shape == q.shape
  _close(got, want, TOL[jnp.dtype(jnp.float32)], "out")


# --- None arguments, dense arrays -----------------------------------------------------------------

def test_bias_and_mask_none_by_position_and_keyword():
  q, k, v, _ = _inputs(2, 8, 12, 2, 1, 16, jnp.float32, seed=4)
  want = jax_nn(q, k, v, None, None, is_causal=True)
  for got in (fa2_jax.flash_attention(q, k, v, None, None, is_causal=True),
              fa2_jax.flash_attention(q, k, v, None, is_causal=True),
              fa2_jax.flash_attention(q, k, v, bias=None, mask=None, is_causal=True),
              fa2_jax.flash_attention(q, k, v, mask=None, is_causal=True)):
    _close(got, want, TOL[jnp.dtype(jnp.float32)], "out")
  assert fa2_jax.backend_for(q, k, v, None, None).backend == fa2_jax.backend_for(q, k).backend
  for kw in (dict(query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                  scale=None, implementation=None),):
    _close(fa2_jax.flash_attention(q, k, v, **kw), jax_nn(q, k, v, **kw),
           TOL[jnp.dtype(jnp.float32)], "out with every optional argument None")


@pytest.mark.parametrize("by_position", [False, True])
def test_dense_bias_and_mask_name_what_to_pass(by_position):
  """A difference: jax.nn takes dense bias/mask arrays, flash_attention raises a ValueError naming
  the keyword to pass instead (its kernels never form the [T, S] logits)."""
  q, k, v, _ = _inputs(1, 8, 8, 2, 2, 16, jnp.float32)
  mask = jnp.tril(jnp.ones((1, 1, 8, 8), jnp.bool_))
  bias = jnp.zeros((1, 2, 8, 8), jnp.float32)
  jax_nn(q, k, v, bias, mask)  # jax.nn takes them
  for name, args, match in (("bias", (bias,), r"bias: .*pass bias=None.*alibi_slopes.*score_fn"),
                            ("mask", (None, mask), r"mask: .*pass mask=None.*is_causal.*mask_fn")):
    kw = {} if by_position else {name: args[-1]}
    for fn in (fa2_jax.flash_attention, fa2_jax.backend_for):
      with pytest.raises(ValueError, match=match):
        fn(q, k, v, *(args if by_position else ()), **kw)


# --- lse and its cotangent ------------------------------------------------------------------------

def _lse_formula(q, k, allowed, scale):
  """The lse of jax.nn's logits, differentiable: float32 logsumexp over the allowed keys."""
  logits = jnp.einsum("btnh,bsnh->btns", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
  return jax.nn.logsumexp(jnp.where(allowed[:, :, None, :], logits,
                                    jnp.full_like(logits, -jnp.inf)), axis=-1)


@pytest.mark.parametrize("path", list(PATHS))
def test_lse_cotangent(path):
  """fa2_jax's lse is float32 and differentiable (d lse / d s = softmax); jax.nn's is in the key dtype
  under stop_gradient (its lse cotangent does nothing). A bfloat16 lse cotangent, as code written for
  jax.nn makes, reaches fa2_jax through a cast of its lse (user code); a plain jax.vjp refuses it
  itself (JAX compares each cotangent's dtype with its output's before any rule runs)."""
  q, k, v, _ = _inputs(1, 16, 24, 2, 2, 16, jnp.bfloat16, seed=5)
  scale = 0.25
  ours = lambda q_, k_: fa2_jax.flash_attention(q_, k_, v, is_causal=True, scale=scale,  # noqa: E731
                                                return_residual=True, **PATHS[path])[1]
  allowed = jnp.asarray(_allowed(1, 16, 24, is_causal=True))
  dlse = jax.random.normal(jax.random.key(6), (1, 16, 2), jnp.float32)
  dlse16 = dlse.astype(jnp.bfloat16)

  @jax.jit
  def run(q, k):
    lse, vjp = jax.vjp(ours, q, k)
    want, vjp_f = jax.vjp(lambda q_, k_: _lse_formula(q_, k_, allowed, scale), q, k)
    # a bfloat16 cotangent through the user's cast of the lse, and through jax.grad of a bfloat16 loss
    _, vjp_cast = jax.vjp(lambda q_, k_: ours(q_, k_).astype(jnp.bfloat16), q, k)
    grad16 = jax.grad(lambda q_: (ours(q_, k).astype(jnp.bfloat16) * dlse16).sum())(q)
    return (lse, want, vjp(dlse), vjp_f(dlse), vjp(dlse16.astype(jnp.float32)), vjp_cast(dlse16),
            grad16)

  lse, want, grads, grads_f, grads_16, grads_cast, grad16 = run(q, k)
  assert lse.dtype == jnp.float32
  _close(lse, want, 1e-5, "lse")
  for name, g, g_f in zip(("dq", "dk"), grads, grads_f):
    assert g.dtype == jnp.bfloat16
    _close(g, g_f, 2e-2, name)
  for name, g, g_16 in zip(("dq", "dk"), grads_cast, grads_16):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(g_16, np.float32), name)
  _close(grad16, grads_16[0], 1e-2, "grad through a bfloat16 lse")

  with jax.numpy_dtype_promotion("standard"):  # jax.nn in half precision (jax_nn)
    lse_r, vjp_r = jax.vjp(lambda q_, k_: jax.nn.dot_product_attention(
        q_, k_, v, is_causal=True, scale=scale, return_residual=True)[1], q, k)
    assert lse_r.dtype == jnp.bfloat16
    _close(lse, lse_r, 1e-2, "lse against jax.nn's")
    for g in vjp_r(dlse16):  # jax.nn: stop_gradient
      assert not np.any(np.asarray(g, np.float32))
  # JAX's own vjp refuses a bfloat16 cotangent for the float32 lse (docs/jax-nn-differences.md).
  _, vjp = jax.vjp(jax.jit(ours), q, k)
  with pytest.raises(ValueError, match="got bfloat16.*expected float32"):
    vjp(dlse16)


# --- strict JAX modes -----------------------------------------------------------------------------

@pytest.mark.parametrize("path", [p for p in PATHS if p != "xla"])
def test_strict_numpy_modes(path):
  """Under jax_numpy_rank_promotion='raise' and jax_numpy_dtype_promotion='strict' (the whole suite
  runs so, tests/conftest.py; set here too, so this holds whatever the session's settings): the
  kernel calls of the issue that raised (segment ids with the backward, in bfloat16; a mask_fn):
  their range tables broadcast implicitly."""
  q, k, v, dout = _inputs(1, 64, 64, 2, 2, 32, jnp.bfloat16, seed=7)
  seg = jnp.zeros((1, 64), jnp.int32)
  with jax.numpy_rank_promotion("raise"), jax.numpy_dtype_promotion("strict"):
    @jax.jit
    def run(q, k, v, dout):
      out, vjp = jax.vjp(lambda q_, k_, v_: fa2_jax.flash_attention(
          q_, k_, v_, q_segment_ids=seg, kv_segment_ids=seg, **PATHS[path]), q, k, v)
      masked = fa2_jax.flash_attention(q, k, v, mask_fn=lambda b, h, i, j: (j <= i) & (i - j < 40),
                                       **PATHS[path])
      return out, masked, vjp(dout)
    out, masked, grads = run(q, k, v, dout)
  want = fa2_jax.flash_attention(q, k, v, implementation="xla")
  _close(out, want, 1e-2, "out")
  assert masked.dtype == jnp.bfloat16 and np.isfinite(np.asarray(masked, np.float32)).all()
  assert all(np.isfinite(np.asarray(g, np.float32)).all() for g in grads)


def test_jax_nn_refuses_half_precision_under_strict_dtype_promotion():
  """A difference: jax.nn (0.11.2) promotes bfloat16/float16 inputs with float32 implicitly, which
  strict dtype promotion refuses; fa2_jax runs (test_strict_numpy_modes, and the whole suite)."""
  q = jnp.ones((1, 8, 2, 16), jnp.bfloat16)
  with jax.numpy_dtype_promotion("strict"):
    with pytest.raises(jax.dtypes.TypePromotionError):
      jax.nn.dot_product_attention(q, q, q)
    assert fa2_jax.flash_attention(q, q, q).dtype == jnp.bfloat16


# --- argument forms and errors --------------------------------------------------------------------

def test_lengths_as_lists_tuples_and_numpy():
  q, k, v, _ = _inputs(2, 8, 12, 2, 1, 16, jnp.float32, seed=8)
  want = jax_nn(q, k, v, query_seq_lengths=jnp.array([5, 8], jnp.int32),
                                      key_value_seq_lengths=jnp.array([12, 4], jnp.int32))
  for q_len, kv_len in (([5, 8], [12, 4]), ((5, 8), (12, 4)),
                        (np.array([5, 8], np.int32), np.array([12, 4], np.int64)),
                        ([np.int32(5), 8], jnp.array([12, 4], jnp.int32))):
    got_r = jax_nn(q, k, v, query_seq_lengths=q_len,
                                         key_value_seq_lengths=kv_len)
    got = fa2_jax.flash_attention(q, k, v, query_seq_lengths=q_len, key_value_seq_lengths=kv_len)
    np.testing.assert_array_equal(got_r, want)
    _close(got, want, TOL[jnp.dtype(jnp.float32)], f"lengths {q_len!r}, {kv_len!r}")
  # traced elements of a list
  got = jax.jit(lambda n: fa2_jax.flash_attention(q, k, v, query_seq_lengths=[n, 8],
                                                  key_value_seq_lengths=[12, 4]))(jnp.int32(5))
  _close(got, want, TOL[jnp.dtype(jnp.float32)], "traced list")


def test_offsets_and_segment_ids_as_lists():
  """q_offset and segment ids take lists as the lengths do (the arrays they make); a ragged or
  float list is an error naming the argument."""
  q, k, v, _ = _inputs(2, 8, 12, 2, 1, 16, jnp.float32, seed=9)
  seg_q, seg_kv = [[0] * 4 + [1] * 4, [2] * 8], [[0] * 6 + [1] * 6, [2] * 12]
  want = fa2_jax.flash_attention(q, k, v, is_causal=True, q_offset=jnp.array([4, 2]),
                                 q_segment_ids=jnp.array(seg_q), kv_segment_ids=jnp.array(seg_kv))
  got = fa2_jax.flash_attention(q, k, v, is_causal=True, q_offset=[4, 2], q_segment_ids=seg_q,
                                kv_segment_ids=tuple(seg_kv))
  np.testing.assert_array_equal(got, want)
  with pytest.raises(ValueError, match="q_offset must be an integer array, got a list"):
    fa2_jax.flash_attention(q, k, v, q_offset=[[1, 2], [3]])
  with pytest.raises(TypeError, match="q_segment_ids must have an integer dtype"):
    fa2_jax.flash_attention(q, k, v, q_segment_ids=[[0.5] * 8] * 2, kv_segment_ids=seg_kv)


Q = jnp.zeros((2, 8, 4, 16), jnp.float32)
KV = jnp.zeros((2, 12, 2, 16), jnp.float32)


@pytest.mark.parametrize("args, kw, exc", [
    ((Q, KV, KV.astype(jnp.bfloat16)), {}, ValueError),                      # mixed dtypes
    ((Q.astype(jnp.bfloat16), KV, KV), {}, ValueError),
    ((Q, KV, KV), dict(query_seq_lengths=jnp.array([3.0, 4.0])), ValueError),  # float lengths
    ((Q, KV, KV), dict(key_value_seq_lengths=[2.0, 3.0]), ValueError),
    ((Q, KV, KV), dict(query_seq_lengths=[True, False]), ValueError),          # bool lengths
    ((Q, KV, KV), dict(query_seq_lengths=jnp.array(3, jnp.int32)), ValueError),  # rank 0
    ((Q, KV, KV), dict(key_value_seq_lengths=jnp.zeros((2, 1), jnp.int32)), ValueError),
    ((Q, KV, KV), dict(query_seq_lengths="3"), TypeError),                     # not numeric
    ((jnp.zeros((2, 8, 3, 16)), KV, KV), {}, ValueError),                      # N % K != 0
    ((jnp.zeros((2, 8, 4, 8)), KV, KV), {}, ValueError),                       # head_dim
    ((jnp.zeros((3, 8, 4, 16)), KV, KV), {}, ValueError),                      # batch
    ((Q, KV, KV[:, :5]), {}, ValueError),                                      # key vs value
    ((Q, KV, KV), dict(implementation="something"), ValueError),
])
def test_error_types_match_jax_nn(args, kw, exc):
  """Where jax.nn raises for an input, flash_attention raises the same exception type (and names the
  argument)."""
  with pytest.raises(exc):
    jax_nn(*args, **kw)
  with pytest.raises(exc):
    fa2_jax.flash_attention(*args, **kw)


def test_implementation_values_differ():
  """A difference: jax.nn's implementations are None/'xla'/'cudnn', fa2_jax's None/'triton'/'mosaic'/
  'xla'. 'xla' is the plain formula on both; 'cudnn' is a ValueError here."""
  q, k, v, _ = _inputs(1, 8, 8, 2, 2, 16, jnp.float32)
  _close(fa2_jax.flash_attention(q, k, v, implementation="xla"),
         jax_nn(q, k, v, implementation="xla"), TOL[jnp.dtype(jnp.float32)],
         "xla")
  with pytest.raises(ValueError, match="implementation must be one of"):
    fa2_jax.flash_attention(q, k, v, implementation="cudnn")


@pytest.mark.parametrize("path", list(PATHS))
def test_nan_in_masked_values(path):
  """A difference: NaN stored in values no query may attend (past key_value_seq_lengths) makes
  jax.nn's whole output NaN (0 * NaN in P V); fa2_jax's formula and Triton kernels never let it
  through."""
  q, k, v, _ = _inputs(2, 8, 12, 2, 1, 16, jnp.float32, seed=9)
  lens = jnp.array([12, 5], jnp.int32)
  v = v.at[1, 5:].set(jnp.nan)
  want = jax_nn(q, k, jnp.nan_to_num(v), key_value_seq_lengths=lens)
  assert np.isnan(np.asarray(jax_nn(q, k, v, key_value_seq_lengths=lens))[1]).all()
  got = fa2_jax.flash_attention(q, k, v, key_value_seq_lengths=lens, **PATHS[path])
  _close(got, want, TOL[jnp.dtype(jnp.float32)], "out")


def test_argument_domains_differ():
  """Differences in what each takes (docs/jax-nn-differences.md): fa2_jax refuses what is likely a
  mistake or what its kernels cannot take, and takes an unbounded window side."""
  q, k, v, _ = _inputs(1, 8, 8, 2, 2, 16, jnp.float32)
  jax_nn_only = [
      (dict(is_causal=1), TypeError, "is_causal must be a Python bool"),
      (dict(local_window_size=-1), ValueError, "local_window_size sides must be >= 0"),
      (dict(query_seq_lengths=jnp.array([9], jnp.int32)), ValueError,
       r"query_seq_lengths must lie in \[0, 8\]"),
  ]
  for kw, exc, match in jax_nn_only:
    jax_nn(q, k, v, **kw)
    with pytest.raises(exc, match=match):
      fa2_jax.flash_attention(q, k, v, **kw)
  for args, exc, match in (((q.astype(jnp.int32),) * 3, TypeError, "bfloat16, float16 or float32"),
                           ((np.asarray(q).tolist(), k, v), TypeError, "query must be a jax/numpy"),
                           ((q[0, 0], k[0, 0], v[0, 0]), ValueError, "query must have rank 4")):
    jax_nn(*args)
    with pytest.raises(exc, match=match):
      fa2_jax.flash_attention(*args)
  jax.jit(lambda s: jax_nn(q, k, v, scale=s))(0.5)
  with pytest.raises(TypeError, match="static Python float"):
    jax.jit(lambda s: fa2_jax.flash_attention(q, k, v, scale=s))(0.5)
  with pytest.raises(TypeError):  # jax.nn: no unbounded side
    jax_nn(q, k, v, local_window_size=(None, 0))
  _close(fa2_jax.flash_attention(q, k, v, local_window_size=(None, 0)),
         jax_nn(q, k, v, is_causal=True), TOL[jnp.dtype(jnp.float32)], "(None, 0) is causal")


def test_a_value_head_dim_of_its_own_differs():
  """A difference: jax.nn needs value with key's shape; fa2_jax takes value [B, S, K, Hv] with
  another Hv (MLA) and returns [B, T, N, Hv], at the scale 1 / sqrt(H) jax.nn would use: per value
  column the same as jax.nn on the value padded to H with zeros."""
  q, k, v, _ = _inputs(1, 8, 8, 2, 2, 16, jnp.float32)
  narrow = v[..., :8]
  with pytest.raises(ValueError, match="value shape"):
    jax_nn(q, k, narrow)
  padded = jnp.pad(narrow, ((0, 0), (0, 0), (0, 0), (0, 8)))
  for path in ("xla", "triton"):
    got = fa2_jax.flash_attention(q, k, narrow, is_causal=True, **PATHS[path])
    assert got.shape == (1, 8, 2, 8)
    _close(got, jax_nn(q, k, padded, is_causal=True)[..., :8], TOL[jnp.dtype(jnp.float32)], path)


def test_forward_mode_through_the_kernels_differs():
  """A difference: jax.nn differentiates in forward mode; fa2_jax's kernels in reverse mode only
  (a TypeError naming implementation='xla', whose formula does)."""
  q, k, v, _ = _inputs(1, 8, 8, 2, 2, 16, jnp.float32)
  tangent = jnp.ones_like(q)
  jax.jvp(lambda q_: jax_nn(q_, k, v), (q,), (tangent,))
  jax.jvp(lambda q_: fa2_jax.flash_attention(q_, k, v, implementation="xla"), (q,), (tangent,))
  with pytest.raises(TypeError, match="implementation='xla'"):
    jax.jvp(lambda q_: fa2_jax.flash_attention(q_, k, v, **PATHS["triton"]), (q,), (tangent,))


def test_empty_sequences_agree():
  """S = 0: out 0 and lse -inf on both; T = 0: empty on both."""
  q, k, v, _ = _inputs(1, 4, 0, 2, 2, 8, jnp.float32)
  for fn in (jax_nn, fa2_jax.flash_attention):
    out, lse = fn(q, k, v, return_residual=True)
    assert out.shape == q.shape and not np.any(np.asarray(out))
    assert np.all(np.asarray(lse) == -np.inf)
    assert fn(q[:, :0], q, q).shape == (1, 0, 2, 8)
