"""fa2_jax.flax: the attention_fn inside flax's own layers, the masks flax makes, the fallbacks, and
the causal modules.

On CPU the kernel path runs the Pallas kernels in interpret mode (float32, small shapes), so these
tests check the kernels themselves against flax's default attention, not the XLA formula. Calls with
a dense mask run flax's formula (the fallback): their tests check that every mask shape flax
produces gives flax's outputs and gradients, with no NaN in fully masked (padding) rows.
"""
import contextlib
import functools
import subprocess
import sys
import warnings
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fa2_jax
import fa2_jax.flax as fa2_flax
import fa2_jax.flax.attention as adapter  # the adapter's module: its one-time warnings, its calls
from fa2_jax.flax import FlashAttentionFallbackWarning

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = None if ON_GPU else True  # compiled kernels on a GPU, interpret mode elsewhere
# float32 through the Pallas interpreter matches flax's einsums to rounding; a GPU's f32 dots may
# use TF32, whose 10-bit mantissa needs the looser bound.
TOL = dict(atol=5e-3, rtol=5e-3) if ON_GPU else dict(atol=2e-5, rtol=2e-5)
# The fallback is flax's own formula: only the order of float32 roundings may differ (on a GPU, of
# TF32 ones: the same bound as the kernels').
FORMULA_TOL = TOL if ON_GPU else dict(atol=1e-5, rtol=1e-5)
B, T, D, HEADS = 2, 12, 32, 4  # head_dim D / HEADS = 8; T not a multiple of the 16-row tiles
T_CROSS = 8  # query length of the cross-attention cases (key/value length T)
KV_HEADS = 2  # grouped-query attention: 2 query heads per key/value head
PAD_WARNING = "dense masks run the XLA formula"  # every fallback caused by a mask says this
VARIANT_FORMULA = "uses fa2_jax's XLA formula"  # a masked call with variants runs it


@pytest.fixture(autouse=True)
def _fresh_warnings():
  """Python's default filter shows a warning once per message and line: every test sees them all."""
  with warnings.catch_warnings():
    warnings.simplefilter("always")
    yield


@pytest.fixture
def spy(monkeypatch):
  """Records the keyword arguments of every fa2_jax.flash_attention call made by fa2_jax.flax."""
  calls = []
  real = adapter.flash_attention

  def recording(*args, **kwargs):
    calls.append(kwargs)
    return real(*args, **kwargs)

  monkeypatch.setattr(adapter, "flash_attention", recording)
  return calls


@pytest.fixture
def nan_fallbacks(monkeypatch):
  """Call it to make the adapter's formula fallbacks return NaN: a decode step that then computes
  right ran the kernels (the other branch of its run-time choice)."""
  def nan_like(query, value):  # [batch..., T, N, Hv] in the compute dtype, as both formulas return
    return jnp.full(query.shape[:-1] + value.shape[-1:], jnp.nan, query.dtype)

  def poison():
    monkeypatch.setattr(adapter, "_flax_formula", lambda q, k, v, **kw: nan_like(q, v))
    monkeypatch.setattr(adapter, "_masked_variant_formula",
                        lambda formula, q, k, v, *args: nan_like(q, v))
  return poison


def kernel_fn(**kw):
  return fa2_flax.make_attention_fn(interpret=INTERPRET, **kw)


@contextlib.contextmanager
def no_fallback():
  """A context in which a FlashAttentionFallbackWarning fails the test."""
  with warnings.catch_warnings():
    warnings.simplefilter("error", FlashAttentionFallbackWarning)
    yield


def inputs(seed=0, shape=(B, T, D)):
  return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)


def valid_tokens(batch_shape, length):
  """``[batch..., length]`` bool, True on each sequence's tokens: sequence i keeps the first
  ``length - (5 i mod length)`` tokens (>= 1), so the first is unpadded and the others padded."""
  n = int(np.prod(batch_shape))
  lengths = length - (np.arange(n) * 5) % length
  return jnp.asarray(np.arange(length) < lengths[:, None]).reshape(*batch_shape, length)


def causal_like(mask, t, s):
  """The top-left causal mask ``[t, s]`` with ``mask``'s rank and dtype, for nn.combine_masks."""
  return jnp.tril(jnp.ones((t, s), mask.dtype)).reshape((1,) * (mask.ndim - 2) + (t, s))


def assert_trees_close(a, b, **tol):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tol), a, b)


def assert_trees_within_formula_error(ours, default, exact, slack=1e-5):
  """Per leaf, ``max |ours - exact| <= 2 max |default - exact| + slack``: our result errs at most
  twice as much as flax's own formula at the default precision (``default``; TF32 dots on a GPU)
  does against the same formula at the highest precision (``exact``)."""
  def check(o, d, e):
    o, d, e = (np.asarray(a, np.float64) for a in (o, d, e))
    ours_err, formula_err = np.max(np.abs(o - e)), np.max(np.abs(d - e))
    assert ours_err <= 2 * formula_err + slack, (ours_err, formula_err)
  jax.tree.map(check, ours, default, exact)


def assert_finite(tree):
  for leaf in jax.tree.leaves(tree):
    assert np.all(np.isfinite(np.asarray(leaf))), "NaN or inf"


def assert_rows_close(y, y_ref, rows, **tol):
  """Outputs ``[batch..., T, F]`` equal on the valid query rows (``rows [batch..., T]``)."""
  keep = np.asarray(rows)
  np.testing.assert_allclose(np.asarray(y)[keep], np.asarray(y_ref)[keep], **tol)


def row_weights(y, rows):
  return 1.0 if rows is None else rows[..., None].astype(y.dtype)


def linen_value_and_grads(module, params, x, rows=None, jit=True, **call_kw):
  """Output and gradients (params, x) of a loss over the valid query rows.

  ``jit``: compile it (the interpreted kernels run far faster compiled), with the masks passed in
  ``call_kw`` closed over, so concrete as in an eager call. Fallback tests run eagerly: flax's
  formula then reuses the per-op compilations of earlier tests.
  """
  def loss(p, x):
    y = module.apply(p, x, **call_kw)
    return jnp.sum(row_weights(y, rows) * y * jnp.cos(y)), y  # a nonuniform cotangent
  value_and_grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
  (_, y), grads = (jax.jit(value_and_grad) if jit else value_and_grad)(params, x)
  return y, grads


def nnx_value_and_grads(module, x, rows=None, args=(), jit=True, **call_kw):
  """As linen_value_and_grads for ``module(x, *args, **call_kw)``; returns the gradients of the
  Params and of x."""
  def loss(m, x):
    y = m(x, *args, **call_kw)
    return jnp.sum(row_weights(y, rows) * y * jnp.cos(y)), y
  value_and_grad = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)
  (_, y), (g_module, g_x) = (nnx.jit(value_and_grad) if jit else value_and_grad)(module, x)
  return y, (nnx.state(g_module, nnx.Param), g_x)


# --- the masks flax makes -------------------------------------------------------------------------

def mask_case(kind):
  """(x, call kwargs besides the mask, mask, valid query rows) for one kind of flax mask."""
  if kind == "padding":  # nn.make_attention_mask of a padded batch: [B, 1, T, T], float32
    rows = valid_tokens((B,), T)
    return inputs(), {}, nn.make_attention_mask(rows, rows), rows
  if kind == "combined":  # padding AND nn.make_causal_mask, as a decoder is trained
    rows = valid_tokens((B,), T)
    mask = nn.combine_masks(nn.make_attention_mask(rows, rows), nn.make_causal_mask(rows))
    return inputs(), {}, mask, rows
  if kind == "cross":  # T_CROSS queries against T keys/values: [B, 1, T_CROSS, T]
    rows, kv_valid = valid_tokens((B,), T_CROSS), valid_tokens((B,), T)
    kv = inputs(seed=5)
    return (inputs(shape=(B, T_CROSS, D)), {"kv": kv}, nn.make_attention_mask(rows, kv_valid),
            rows)
  if kind == "batch_dims":  # extra leading batch dims: [2, 3, 1, T, T]
    rows = valid_tokens((2, 3), T)
    return inputs(shape=(2, 3, T, D)), {}, nn.make_attention_mask(rows, rows), rows
  if kind == "broadcast":  # key padding [3, 1, T, T] shared by the outer batch dim of [2, 3, T, D]
    kv_valid = valid_tokens((3,), T)
    mask = nn.make_attention_mask(jnp.ones((3, T), bool), kv_valid)
    return inputs(shape=(2, 3, T, D)), {}, mask, None
  raise AssertionError(kind)


MASK_KINDS = ["padding", "combined", "cross", "batch_dims", "broadcast"]


@pytest.mark.parametrize("adapter_causal", [False, True])
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_linen_masks_match_flax(kind, adapter_causal):
  x, kw, mask, rows = mask_case(kind)
  # inputs_k = inputs_v is linen's (deprecated) inputs_kv
  call_kw = {"inputs_k": kw["kv"], "inputs_v": kw["kv"]} if "kv" in kw else {}
  ref = nn.MultiHeadDotProductAttention(num_heads=HEADS)
  ours = nn.MultiHeadDotProductAttention(num_heads=HEADS,
                                         attention_fn=kernel_fn(is_causal=adapter_causal))
  params = ref.init(jax.random.PRNGKey(1), x, **call_kw)
  t, s = x.shape[-2], (kw["kv"] if "kv" in kw else x).shape[-2]
  ref_mask = nn.combine_masks(mask, causal_like(mask, t, s)) if adapter_causal else mask
  with pytest.warns(FlashAttentionFallbackWarning, match=PAD_WARNING):
    y, g = linen_value_and_grads(ours, params, x, rows, jit=False, mask=mask, **call_kw)
  y_ref, g_ref = linen_value_and_grads(ref, params, x, rows, jit=False, mask=ref_mask, **call_kw)
  assert_finite((y, g))
  if rows is None:
    np.testing.assert_allclose(y, y_ref, **FORMULA_TOL)
  else:
    assert_rows_close(y, y_ref, rows, **FORMULA_TOL)
  assert_trees_close(g, g_ref, **FORMULA_TOL)


@pytest.mark.parametrize("causal", ["none", "adapter", "call"])  # no causal / the factory's / nnx's
@pytest.mark.parametrize("kind", ["padding", "combined", "cross", "broadcast"])
def test_nnx_masks_match_flax(kind, causal):
  """nnx's layer with grouped-query heads; flax's own nnx attention is the reference."""
  x, kw, mask, rows = mask_case(kind)
  kv = (kw["kv"],) * 2 if "kv" in kw else ()
  make = lambda **kw: nnx.MultiHeadAttention(HEADS, D, num_kv_heads=KV_HEADS, decode=False,
                                             rngs=nnx.Rngs(0), **kw)
  ref, ours = make(), make(attention_fn=kernel_fn(is_causal=causal == "adapter"))
  # flax's nnx formula folds [batch...] by reshaping the mask, so it needs the full batch dims.
  ref_mask = jnp.broadcast_to(mask, (*x.shape[:-2], *mask.shape[-3:]))
  with pytest.warns(FlashAttentionFallbackWarning, match=PAD_WARNING):
    y, g = nnx_value_and_grads(ours, x, rows, kv, jit=False, mask=mask,
                               is_causal=causal == "call")
  y_ref, g_ref = nnx_value_and_grads(ref, x, rows, kv, jit=False, mask=ref_mask,
                                     is_causal=causal != "none")
  assert_finite((y, g))
  if rows is None:
    np.testing.assert_allclose(y, y_ref, **FORMULA_TOL)
  else:
    assert_rows_close(y, y_ref, rows, **FORMULA_TOL)
  assert_trees_close(g, g_ref, **FORMULA_TOL)


@pytest.mark.parametrize("caller, causal", [("linen", False), ("nnx", True)])
def test_attention_fn_mask_shapes_and_gqa(caller, causal):
  """Every rank and broadcast shape flax accepts, with extra batch dims and GQA, through either
  flax formula (linen's caller passes force_fp32_for_softmax)."""
  keys = jax.random.split(jax.random.PRNGKey(0), 5)
  q = jax.random.normal(keys[0], (2, 3, T, HEADS, 8))
  k, v = (jax.random.normal(kk, (2, 3, T, KV_HEADS, 8)) for kk in keys[1:3])
  rows = valid_tokens((2, 3), T)
  per_head = jax.random.bernoulli(keys[3], 0.7, (2, 3, HEADS, T, T))
  masks = {
      "[S]": valid_tokens((2,), T)[1],  # a padded sequence's keys
      "[T, S] float": jax.random.bernoulli(keys[4], 0.7, (T, T)).astype(jnp.float32),
      "[3, 1, T, S]": nn.make_attention_mask(jnp.ones((3, T), bool), valid_tokens((3,), T)),
      "[2, 1, 1, 1, S]": valid_tokens((2,), T)[:, None, None, None, :],
      "[batch, 1, T, S] padding": nn.make_attention_mask(rows, rows),  # padded query rows
      "[batch, N, T, S]": per_head,
  }
  linen_kw = {"force_fp32_for_softmax": False} if caller == "linen" else {}
  ours = kernel_fn(is_causal=causal)

  def reference(q, k, v, mask):
    # flax's linen formula, with the key/value heads repeated and the causal mask AND-ed in.
    k, v = (jnp.repeat(x, HEADS // KV_HEADS, axis=-2) for x in (k, v))
    if causal:
      rank = max(mask.ndim, 2)
      mask = jnp.logical_and(jax.lax.broadcast_to_rank(mask.astype(bool), rank),
                             jax.lax.broadcast_to_rank(jnp.tril(jnp.ones((T, T), bool)), rank))
    return nn.dot_product_attention(q, k, v, mask=mask)

  def value_and_grads(fn, mask):
    def loss(q, k, v):
      y = fn(q, k, v, mask)
      return jnp.sum(y * jnp.cos(y)), y
    (_, y), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
    return y, grads

  for name, mask in masks.items():
    with pytest.warns(FlashAttentionFallbackWarning, match=PAD_WARNING):
      y, g = value_and_grads(lambda q, k, v, m: ours(q, k, v, mask=m, **linen_kw), mask)
    y_ref, g_ref = value_and_grads(reference, mask)
    try:
      assert_finite((y, g))
      assert_trees_close((y, g), (y_ref, g_ref), **FORMULA_TOL)
    except AssertionError as e:
      raise AssertionError(f"mask {name}") from e


# --- a mask that provably is the causal mask (or no mask) keeps the kernel ------------------------

@pytest.mark.parametrize("adapter_causal", [False, True])
def test_linen_causal_mask_runs_the_kernel(spy, adapter_causal):
  """nn.make_causal_mask built outside the traced function is a concrete array: it equals the
  is_causal flag, so the kernel runs, with or without the adapter's own is_causal."""
  x = inputs()
  mask = nn.make_causal_mask(x[..., 0])  # [B, 1, T, T], float32, concrete
  ref = nn.MultiHeadDotProductAttention(num_heads=HEADS)
  ours = nn.MultiHeadDotProductAttention(num_heads=HEADS,
                                         attention_fn=kernel_fn(is_causal=adapter_causal))
  params = ref.init(jax.random.PRNGKey(1), x)
  with no_fallback():
    y, g = linen_value_and_grads(ours, params, x, mask=mask)
  y_ref, g_ref = linen_value_and_grads(ref, params, x, mask=mask)
  assert_trees_close(y, y_ref, **TOL)
  assert_trees_close(g, g_ref, **TOL)
  assert spy and all(c["is_causal"] for c in spy)


def test_nnx_causal_mask_and_all_true_mask_run_the_kernel(spy):
  x = inputs()
  make = lambda **kw: nnx.MultiHeadAttention(HEADS, D, num_kv_heads=KV_HEADS, decode=False,
                                             rngs=nnx.Rngs(0), **kw)
  ref, ours = make(), make(attention_fn=kernel_fn())
  mask = nnx.make_causal_mask(x[..., 0])  # concrete, closed over by the jitted calls below
  with no_fallback():
    y = nnx.jit(lambda m, x: m(x, mask=mask))(ours, x)
  np.testing.assert_allclose(y, ref(x, mask=mask), **TOL)
  assert [c["is_causal"] for c in spy] == [True]
  # A padding mask of an unpadded batch allows every pair: the mask is dropped, is_causal kept.
  full = nnx.make_attention_mask(jnp.ones((B, T)), jnp.ones((B, T)))
  with no_fallback():
    y = nnx.jit(lambda m, x: m(x, mask=full, is_causal=True))(ours, x)
  np.testing.assert_allclose(y, ref(x, is_causal=True), **TOL)
  assert [c["is_causal"] for c in spy] == [True, True]


@pytest.mark.parametrize("adapter_causal", [False, True])
def test_traced_causal_mask_falls_back_and_names_the_flag(spy, adapter_causal):
  """A mask computed inside jit is traced: its values are unknown, so it runs flax's formula, and
  the warning names what to pass instead."""
  x = inputs()
  ref = nn.MultiHeadDotProductAttention(num_heads=HEADS)
  ours = nn.MultiHeadDotProductAttention(num_heads=HEADS,
                                         attention_fn=kernel_fn(is_causal=adapter_causal))
  params = ref.init(jax.random.PRNGKey(1), x)
  apply = lambda m: jax.jit(lambda p, x: m.apply(p, x, mask=nn.make_causal_mask(x[..., 0])))
  advice = "mask=None" if adapter_causal else r"is_causal=True.*make_attention_fn\(is_causal=True\)"
  with pytest.warns(FlashAttentionFallbackWarning, match=advice) as record:
    y = apply(ours)(params, x)
  assert PAD_WARNING in str(record[0].message)
  np.testing.assert_allclose(y, apply(ref)(params, x), **FORMULA_TOL)
  assert not spy  # the kernel never saw the call


def test_init_with_a_padding_mask_runs(spy):
  """linen's causal adapter with a rank-4 mask (it used to fail merging a rank-3 causal mask)."""
  x = jnp.ones((2, 8, 16))
  pad = jnp.ones((2, 8), bool)
  m = nn.MultiHeadDotProductAttention(num_heads=2, attention_fn=kernel_fn(is_causal=True))
  mask = nn.make_attention_mask(pad, pad)  # [2, 1, 8, 8]
  with no_fallback():  # an unpadded batch: the mask allows every pair, the kernel runs
    (y, _) = jax.jit(lambda x: m.init_with_output(jax.random.PRNGKey(0), x, mask=mask))(x)
  assert y.shape == x.shape and spy and all(c["is_causal"] for c in spy)
  pad = pad.at[1, 5:].set(False)
  with pytest.warns(FlashAttentionFallbackWarning, match=PAD_WARNING):
    m.init(jax.random.PRNGKey(0), x, mask=nn.make_attention_mask(pad, pad))


# --- autoregressive decoding (decode=True) --------------------------------------------------------

@pytest.mark.parametrize("adapter_causal", [False, True])
def test_linen_decode_matches_flax_step_by_step(adapter_causal, nan_fallbacks):
  """Init with the full-length input, then one token per step against the key/value cache, with a
  key padding mask [B, 1, 1, T]; every step's output and gradients equal flax's own. The steps'
  masks (the cache's AND the padding) allow a prefix of the keys: they run the kernels, with no
  warning."""
  x = inputs()
  key_mask = valid_tokens((B,), T)[:, None, None, :]  # [B, 1, 1, T]: key padding, rank 4
  ref = nn.MultiHeadDotProductAttention(num_heads=HEADS, decode=True)
  ours = nn.MultiHeadDotProductAttention(num_heads=HEADS, decode=True,
                                         attention_fn=kernel_fn(is_causal=adapter_causal))
  init_mask = nn.combine_masks(key_mask, nn.make_causal_mask(x[..., 0], dtype=jnp.bool_))
  y_ref, variables = ref.init_with_output(jax.random.PRNGKey(1), x, mask=init_mask)
  # The causal adapter needs only the padding; the plain one the full mask, as flax.
  with pytest.warns(FlashAttentionFallbackWarning, match=PAD_WARNING):
    y, ours_variables = ours.init_with_output(jax.random.PRNGKey(1), x,
                                              mask=key_mask if adapter_causal else init_mask)
  np.testing.assert_allclose(y, y_ref, **FORMULA_TOL)
  assert_trees_close(ours_variables, variables, atol=0, rtol=0)  # same params, an empty cache
  # flax's decode step i is causal attention of query i: the full-length output's row i.
  y_full = ref.clone(decode=False).apply({"params": variables["params"]}, x, mask=init_mask)

  def make_step(module):
    def loss(params, cache, x_t):
      y, updated = module.apply({"params": params, "cache": cache}, x_t, mask=key_mask,
                                mutable=["cache"])
      return jnp.sum(y * jnp.cos(y)), (y, updated["cache"])
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 2), has_aux=True))

  ref_step, our_step = make_step(ref), make_step(ours)
  nan_fallbacks()  # (the init above ran flax's formula: 12 rows, a padded causal mask)
  params = variables["params"]
  ref_cache = our_cache = variables["cache"]
  for i in range(T):
    x_t = x[:, i:i + 1]
    with no_fallback():
      (_, (y, our_cache)), g = our_step(params, our_cache, x_t)
    (_, (y_ref, ref_cache)), g_ref = ref_step(params, ref_cache, x_t)
    assert_finite((y, g))
    np.testing.assert_allclose(y, y_ref, **FORMULA_TOL)
    assert_trees_close(g, g_ref, **FORMULA_TOL)
    np.testing.assert_allclose(y_ref[:, 0], y_full[:, i], **FORMULA_TOL)


@pytest.mark.parametrize("adapter_causal", [False, True])
def test_nnx_decode_matches_flax_step_by_step(adapter_causal, nan_fallbacks):
  """nnx's cache (init_cache) with grouped-query heads, one token per step; outputs and gradients
  of every step equal flax's own, through the kernels (the cache's mask is a prefix), unwarned."""
  x = inputs()
  make = lambda **kw: nnx.MultiHeadAttention(HEADS, D, num_kv_heads=KV_HEADS, decode=True,
                                             rngs=nnx.Rngs(0), **kw)
  ref, ours = make(), make(attention_fn=kernel_fn(is_causal=adapter_causal))

  # flax's decode step i is causal attention of query i: the full-length output's row i.
  y_full = ref(x, decode=False, is_causal=True)

  @nnx.jit
  def step(module, x_t):  # one token through the cache; gradients of the Params and of x_t
    def loss(module, x_t):
      y = module(x_t)
      return jnp.sum(y * jnp.cos(y)), y
    (_, y), (g_module, g_x) = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(module, x_t)
    return y, (nnx.state(g_module, nnx.Param), g_x)

  ref.init_cache(x.shape)
  ours.init_cache(x.shape)
  nan_fallbacks()
  for i in range(T):
    x_t = x[:, i:i + 1]
    with no_fallback():
      y, g = step(ours, x_t)
    y_ref, g_ref = step(ref, x_t)
    assert_finite((y, g))
    np.testing.assert_allclose(y, y_ref, **FORMULA_TOL)
    assert_trees_close(g, g_ref, **FORMULA_TOL)
    np.testing.assert_allclose(y_ref[:, 0], y_full[:, i], **FORMULA_TOL)
  assert int(ours.cache_index[...]) == T


def test_single_query_row_and_the_adapter_flag(spy):
  """The factory's is_causal leaves a one-row query (a decode step) unmasked; nnx's per-call
  is_causal keeps flax's top-left meaning (query 0 sees key 0)."""
  keys = jax.random.split(jax.random.PRNGKey(2), 2)
  q = jax.random.normal(keys[0], (B, 1, HEADS, 8))
  kv = jax.random.normal(keys[1], (B, T, HEADS, 8))
  fn = fa2_flax.make_attention_fn(implementation="xla", is_causal=True)
  np.testing.assert_allclose(fn(q, kv, kv), nnx.dot_product_attention(q, kv, kv), **FORMULA_TOL)
  np.testing.assert_allclose(fn(q, kv, kv, is_causal=True),
                             nnx.dot_product_attention(q, kv, kv, is_causal=True), **FORMULA_TOL)
  assert [c["is_causal"] for c in spy] == [False, True]


# --- linen, no mask -------------------------------------------------------------------------------

def test_linen_mha_matches_flax_default(spy):
  x = inputs()
  ref = nn.MultiHeadDotProductAttention(num_heads=HEADS)
  ours = nn.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=kernel_fn())
  params = ref.init(jax.random.PRNGKey(1), x)
  with no_fallback():
    y, g = linen_value_and_grads(ours, params, x)
  y_ref, g_ref = linen_value_and_grads(ref, params, x)
  assert_trees_close(y, y_ref, **TOL)
  assert_trees_close(g, g_ref, **TOL)
  assert spy and all(not c["is_causal"] for c in spy)


def test_linen_causal_reaches_kernel_as_flag(spy):
  x = inputs()
  ref = nn.MultiHeadDotProductAttention(num_heads=HEADS)
  ours = nn.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=kernel_fn(is_causal=True))
  params = ref.init(jax.random.PRNGKey(1), x)
  with no_fallback():
    y, g = linen_value_and_grads(ours, params, x)
  y_ref, g_ref = linen_value_and_grads(ref, params, x, mask=nn.make_causal_mask(x[..., 0]))
  assert_trees_close(y, y_ref, **TOL)
  assert_trees_close(g, g_ref, **TOL)
  assert spy and all(c["is_causal"] for c in spy)


def test_linen_dropout_falls_back_with_the_same_dropout():
  x = inputs()
  ref = nn.MultiHeadDotProductAttention(num_heads=HEADS, dropout_rate=0.5)
  ours = nn.MultiHeadDotProductAttention(num_heads=HEADS, dropout_rate=0.5,
                                         attention_fn=kernel_fn(is_causal=True))
  params = ref.init(jax.random.PRNGKey(1), x, deterministic=True)
  rngs = {"dropout": jax.random.PRNGKey(3)}
  mask = nn.make_causal_mask(x[..., 0])
  with pytest.warns(FlashAttentionFallbackWarning, match="deterministic=True"):
    y = ours.apply(params, x, deterministic=False, rngs=rngs)
  y_ref = ref.apply(params, x, mask=mask, deterministic=False, rngs=rngs)
  np.testing.assert_allclose(y, y_ref, **FORMULA_TOL)
  # deterministic=True switches dropout off: the kernel may run again, without a warning.
  with no_fallback():
    y = jax.jit(lambda p, x: ours.apply(p, x, deterministic=True))(params, x)
  np.testing.assert_allclose(y, ref.apply(params, x, mask=mask, deterministic=True), **TOL)


def test_traced_dropout_rate():
  """A traced dropout_rate: with deterministic=True dropout is off and the kernel runs (flax accepts
  this too); with deterministic=False a TypeError names dropout_rate (flax's formula, which would
  apply the dropout, cannot branch on a traced rate either). Before, the adapter raised a
  TracerBoolConversionError in both cases."""
  q = inputs(shape=(B, T, HEADS, 8))
  fn = kernel_fn()
  with no_fallback():
    y = jax.jit(lambda r: fn(q, q, q, dropout_rate=r, deterministic=True))(0.1)
  np.testing.assert_allclose(y, nn.dot_product_attention(q, q, q), **TOL)
  with pytest.raises(TypeError, match="dropout_rate must be a concrete float"):
    jax.jit(lambda r: fn(q, q, q, dropout_rate=r, deterministic=False,
                         dropout_rng=jax.random.PRNGKey(5)))(0.5)


def test_fallback_warning_follows_the_warning_filters():
  """The fallback warning names the caller's line (through flax's layer too); Python's filters
  decide its repeats: the default once per reason and line, "error" at every call."""
  q = inputs(shape=(B, T, HEADS, 8))
  rows = valid_tokens((B,), T)
  mask = nn.make_attention_mask(rows, rows)
  fn = fa2_flax.make_attention_fn(implementation="xla")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("default")
    for _ in range(3):
      fn(q, q, q, mask=mask)
    fn(q, q, q, bias=jnp.zeros((T, T)))  # another reason: warned
  assert [w.category for w in caught] == [FlashAttentionFallbackWarning] * 2
  assert "bias" in str(caught[1].message)
  assert all(w.filename == __file__ for w in caught), [w.filename for w in caught]
  for _ in range(2):
    with warnings.catch_warnings(), pytest.raises(FlashAttentionFallbackWarning):
      warnings.simplefilter("error")
      fn(q, q, q, mask=mask)
  layer = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=HEADS * 8,
                                          attention_fn=fn)
  x = inputs(shape=(B, T, HEADS * 8))
  params = layer.init(jax.random.PRNGKey(0), x)
  with pytest.warns(FlashAttentionFallbackWarning) as caught:
    layer.apply(params, x, mask=mask)
  assert caught[0].filename == __file__  # the user's line, not flax's


# --- nnx, no mask ---------------------------------------------------------------------------------

@pytest.mark.parametrize("num_kv_heads", [HEADS, KV_HEADS])  # plain multi-head and grouped-query
def test_nnx_mha_causal_matches_flax_default(spy, num_kv_heads):
  x = inputs()
  make = lambda **kw: nnx.MultiHeadAttention(HEADS, D, num_kv_heads=num_kv_heads, decode=False,
                                             rngs=nnx.Rngs(0), **kw)
  ref, ours = make(), make(attention_fn=kernel_fn())
  with no_fallback():
    y, g = nnx_value_and_grads(ours, x, is_causal=True)
  y_ref, g_ref = nnx_value_and_grads(ref, x, is_causal=True)
  if ON_GPU:  # TF32 dots on both sides: bounded by twice the formula's own error
    with jax.default_matmul_precision("highest"):
      exact = nnx_value_and_grads(ref, x, is_causal=True)
    assert_trees_within_formula_error((y, g), (y_ref, g_ref), exact)
  else:
    assert_trees_close(y, y_ref, **TOL)
    assert_trees_close(g, g_ref, **TOL)
  assert spy and all(c["is_causal"] for c in spy)


def test_nnx_dropout_falls_back():
  x = inputs()
  make = lambda **kw: nnx.MultiHeadAttention(HEADS, D, dropout_rate=0.5, deterministic=False,
                                             decode=False, rngs=nnx.Rngs(0, dropout=7), **kw)
  ref, ours = make(), make(attention_fn=kernel_fn())
  with pytest.warns(FlashAttentionFallbackWarning, match="dropout"):
    y = ours(x)
  np.testing.assert_allclose(y, ref(x), **FORMULA_TOL)


@pytest.mark.parametrize("is_causal", [False, True])
def test_extra_leading_batch_dims(is_causal):
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(keys[0], (2, 3, T, HEADS, 8))
  k, v = (jax.random.normal(kk, (2, 3, T, KV_HEADS, 8)) for kk in keys[1:])
  out = jax.jit(functools.partial(kernel_fn(), is_causal=is_causal))(q, k, v)
  np.testing.assert_allclose(out, nnx.dot_product_attention(q, k, v, is_causal=is_causal), **TOL)


# --- the causal self-attention modules ------------------------------------------------------------

XLA_ATTENTION = functools.partial(jax.nn.dot_product_attention, implementation="xla")
MODULE_KW = dict(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=8, rotary=True)


def test_causal_self_attention_linen_matches_xla():
  x = inputs()
  ours = fa2_flax.CausalSelfAttention(**MODULE_KW, attention_fn=kernel_fn())
  ref = fa2_flax.CausalSelfAttention(**MODULE_KW, attention_fn=XLA_ATTENTION)
  params = ours.init(jax.random.PRNGKey(1), x)
  assert params["params"]["qkv"]["kernel"].shape == (D, HEADS + 2 * KV_HEADS, 8)  # N + 2K heads
  y, g = linen_value_and_grads(ours, params, x)
  y_ref, g_ref = linen_value_and_grads(ref, params, x)
  assert_trees_close(y, y_ref, **TOL)
  assert_trees_close(g, g_ref, **TOL)


def test_causal_self_attention_is_causal():
  """Changing a later token must not change earlier outputs."""
  module = fa2_flax.CausalSelfAttention(**MODULE_KW, attention_fn=kernel_fn())
  x = inputs()
  params = module.init(jax.random.PRNGKey(1), x)
  x2 = x.at[:, T // 2:].set(0.0)
  y, y2 = jnp.split(jax.jit(module.apply)(params, jnp.concatenate([x, x2])), 2)
  np.testing.assert_allclose(y[:, :T // 2], y2[:, :T // 2], **TOL)
  assert not np.allclose(y[:, T // 2:], y2[:, T // 2:])


def test_nnx_causal_self_attention_matches_linen():
  x = inputs()
  linen_module = fa2_flax.CausalSelfAttention(**MODULE_KW, attention_fn=XLA_ATTENTION)
  params = linen_module.init(jax.random.PRNGKey(1), x)["params"]
  module = fa2_flax.NnxCausalSelfAttention(D, **MODULE_KW, attention_fn=kernel_fn(),
                                           rngs=nnx.Rngs(0))
  module.qkv.kernel[...] = params["qkv"]["kernel"]
  module.out.kernel[...] = params["out"]["kernel"]
  y_ref, g_ref = linen_value_and_grads(linen_module, {"params": params}, x)
  y, g = nnx_value_and_grads(module, x)
  assert_trees_close(y, y_ref, **TOL)
  assert_trees_close(g[1], g_ref[1], **TOL)  # input gradients
  np.testing.assert_allclose(g[0]["qkv"]["kernel"][...], g_ref[0]["params"]["qkv"]["kernel"],
                             **TOL)


@pytest.mark.parametrize("batch", [(B,), (2, 3)])  # one batch dim, extra leading batch dims
def test_causal_modules_with_padding_mask(batch):
  """Both modules with a padding mask AND their causal mask, against flax's nnx attention."""
  x = inputs(shape=(*batch, T, D))
  rows = valid_tokens(batch, T)
  mask = nn.make_attention_mask(rows, rows)  # [batch..., 1, T, T]
  linen_ours = fa2_flax.CausalSelfAttention(**MODULE_KW, attention_fn=kernel_fn())
  linen_ref = fa2_flax.CausalSelfAttention(**MODULE_KW, attention_fn=nnx.dot_product_attention)
  params = linen_ref.init(jax.random.PRNGKey(1), x)
  with pytest.warns(FlashAttentionFallbackWarning, match=PAD_WARNING):
    y, g = linen_value_and_grads(linen_ours, params, x, rows, jit=False, mask=mask)
  y_ref, g_ref = linen_value_and_grads(linen_ref, params, x, rows, jit=False, mask=mask)
  assert_finite((y, g))
  assert_rows_close(y, y_ref, rows, **FORMULA_TOL)
  assert_trees_close(g, g_ref, **FORMULA_TOL)

  make = lambda fn: fa2_flax.NnxCausalSelfAttention(D, **MODULE_KW, attention_fn=fn,
                                                    rngs=nnx.Rngs(0))
  nnx_ours, nnx_ref = make(kernel_fn()), make(nnx.dot_product_attention)
  with pytest.warns(FlashAttentionFallbackWarning, match=PAD_WARNING):
    y, g = nnx_value_and_grads(nnx_ours, x, rows, jit=False, mask=mask)
  y_ref, g_ref = nnx_value_and_grads(nnx_ref, x, rows, jit=False, mask=mask)
  assert_finite((y, g))
  assert_rows_close(y, y_ref, rows, **FORMULA_TOL)
  assert_trees_close(g, g_ref, **FORMULA_TOL)


def test_rotary_matches_nnx_rope():
  x = inputs(shape=(B, T, HEADS, 16))
  positions = jnp.arange(T)
  # nnx.RoPE wants [..., T, H] (and float positions under strict dtype promotion)
  expected = nnx.RoPE()(jnp.swapaxes(x, -2, -3), positions.astype(jnp.float32))
  np.testing.assert_allclose(fa2_flax.rotary_embedding(x, positions), jnp.swapaxes(expected, -2, -3),
                             atol=1e-5, rtol=1e-5)


# --- attention variants ---------------------------------------------------------------------------

WINDOW = (3, 0)  # sliding window: each query sees itself and the 3 keys before it
SOFT_CAP = 2.0  # small enough that tanh changes the logits of these unit-variance inputs


def mask_fn_even_keys_or_diagonal(b, h, q_idx, kv_idx):
  """A pattern no other argument gives: even keys, or the query's own position."""
  return (kv_idx % 2 == 0) | (kv_idx == q_idx)


def score_fn_head_bias(score, b, h, q_idx, kv_idx):
  return score + 0.25 * h.astype(score.dtype)


def qkv(batch=(B,), t=T, heads=HEADS, kv_heads=KV_HEADS, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = jax.random.normal(keys[0], (*batch, t, heads, 8))
  k, v = (jax.random.normal(kk, (*batch, t, kv_heads, 8)) for kk in keys[1:])
  return q, k, v


def packed_segments(batch, t):
  """``[batch..., t]`` int32: two documents per sequence, split at a place that varies by row."""
  n = int(np.prod(batch))
  split = 3 + (np.arange(n) * 4) % (t - 4)
  return jnp.asarray(np.arange(t) >= split[:, None], jnp.int32).reshape(*batch, t)


def value_and_grads(fn, q, k, v):
  def loss(q, k, v):
    y = fn(q, k, v)
    return jnp.sum(y * jnp.cos(y)), y  # a nonuniform cotangent
  (_, y), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
  return y, grads


def test_attention_fn_passes_every_variant_to_flash_attention(spy):
  """Static variants from the factory, per-batch arrays from the call: the outputs and gradients are
  fa2_jax.flash_attention's with the same arguments (the XLA formula), and the call reached it with
  every argument."""
  q, k, v = qkv()
  segments = packed_segments((B,), T)
  lengths = jnp.array([T, T - 3])
  per_call = dict(q_segment_ids=segments, kv_segment_ids=segments, query_seq_lengths=lengths,
                  key_value_seq_lengths=lengths, q_offset=jnp.array([0, 2]),
                  alibi_slopes=jnp.array([[0.5, 0.25, 0.125, 0.0625]] * B))
  static = dict(local_window_size=WINDOW, logits_soft_cap=SOFT_CAP,
                mask_fn=mask_fn_even_keys_or_diagonal, score_fn=score_fn_head_bias)
  ours = kernel_fn(is_causal=True, **static)
  with no_fallback():
    y, g = value_and_grads(lambda q, k, v: ours(q, k, v, **per_call), q, k, v)
  y_ref, g_ref = value_and_grads(functools.partial(
      fa2_jax.flash_attention, is_causal=True, implementation="xla", **static, **per_call), q, k, v)
  assert_finite((y, g))
  assert_trees_close((y, g), (y_ref, g_ref), **TOL)
  assert spy and all(set(c) >= set(static) | set(per_call) and c["is_causal"] for c in spy)
  assert all(c["local_window_size"] == WINDOW and c["mask_fn"] is mask_fn_even_keys_or_diagonal
             for c in spy)


def test_variants_with_extra_batch_dims():
  """[2, 3, T, N, H] inputs with [2, 3, ...] per-batch arrays: the batch dims are folded together
  with the arrays', so each (i, j) element gets its own segments, lengths and slopes."""
  batch = (2, 3)
  q, k, v = qkv(batch)
  segments = packed_segments(batch, T)  # [2, 3, T]
  lengths = jnp.asarray(T - np.arange(6).reshape(batch))  # [2, 3]
  slopes = jnp.linspace(0.1, 0.6, 6 * HEADS).reshape(*batch, HEADS)  # [2, 3, N]
  fn = fa2_flax.make_attention_fn(implementation="xla", local_window_size=WINDOW)
  out = fn(q, k, v, is_causal=True, q_segment_ids=segments, kv_segment_ids=segments,
           key_value_seq_lengths=lengths, alibi_slopes=slopes)
  fold = lambda x: x.reshape(6, *x.shape[2:])
  expected = fa2_jax.reference_attention(
      fold(q), fold(k), fold(v), is_causal=True, local_window_size=WINDOW,
      q_segment_ids=fold(segments), kv_segment_ids=fold(segments),
      key_value_seq_lengths=fold(lengths), alibi_slopes=fold(slopes))
  np.testing.assert_allclose(out, expected.reshape(out.shape), **FORMULA_TOL)
  # [N] slopes are shared by every batch element; [batch...] arrays of the wrong shape are named.
  shared = fn(q, k, v, alibi_slopes=slopes[0, 0])
  np.testing.assert_allclose(shared, fa2_jax.reference_attention(
      fold(q), fold(k), fold(v), local_window_size=WINDOW,
      alibi_slopes=slopes[0, 0]).reshape(out.shape), **FORMULA_TOL)
  with pytest.raises(ValueError, match=r"q_segment_ids must have shape \[batch\.\.\., q_length\] "
                     r"= \(2, 3, 12\)"):
    fn(q, k, v, q_segment_ids=segments[0], kv_segment_ids=segments[0])
  with pytest.raises(ValueError, match="key_value_seq_lengths must have shape"):
    fn(q, k, v, key_value_seq_lengths=lengths.reshape(6))


def test_lengths_and_segments_replace_a_padding_mask():
  """What the fallback warning advises: lengths, or segment ids, give flax's padding-mask output on
  the valid rows, through the kernel path."""
  q, k, v = qkv()
  rows = valid_tokens((B,), T)  # [B, T], True on each sequence's tokens
  lengths = rows.sum(-1)
  expected = nnx.dot_product_attention(q, k, v, mask=nn.make_attention_mask(rows, rows),
                                       is_causal=True)
  fn = kernel_fn(is_causal=True)
  with no_fallback():
    by_lengths = jax.jit(lambda q, k, v: fn(q, k, v, query_seq_lengths=lengths,
                                            key_value_seq_lengths=lengths))(q, k, v)
    segments = rows.astype(jnp.int32)  # padding is its own segment, never attended by the tokens
    by_segments = jax.jit(lambda q, k, v: fn(q, k, v, q_segment_ids=segments,
                                             kv_segment_ids=segments))(q, k, v)
  assert_rows_close(by_lengths, expected, rows, **TOL)
  assert_rows_close(by_segments, expected, rows, **TOL)
  np.testing.assert_array_equal(np.asarray(by_lengths)[~np.asarray(rows)], 0.0)  # padded rows


def test_fallback_warnings_name_the_arguments_to_pass():
  q, _, _ = qkv(kv_heads=HEADS)
  rows = valid_tokens((B,), T)
  fn = fa2_flax.make_attention_fn(implementation="xla")
  with pytest.warns(FlashAttentionFallbackWarning) as record:
    fn(q, q, q, mask=nn.make_attention_mask(rows, rows))
  message = str(record[0].message)
  assert "q_segment_ids/kv_segment_ids" in message and PAD_WARNING in message
  assert "query_seq_lengths/key_value_seq_lengths" in message
  with pytest.warns(FlashAttentionFallbackWarning, match="pass alibi_slopes.*or score_fn"):
    fn(q, q, q, bias=jnp.zeros((T, T)))


def test_variants_with_a_dense_mask_run_the_variant_formula(spy):
  """flax's formula has no variants: a call with variants and a dense mask the kernels cannot take
  runs fa2_jax's XLA formula with the mask as a mask_fn (warning once); a dense bias with variants
  raises instead of dropping them."""
  q, _, _ = qkv(kv_heads=HEADS)
  rows = valid_tokens((B,), T)
  lengths = rows.sum(-1).astype(jnp.int32)
  fn = fa2_flax.make_attention_fn(implementation="xla", local_window_size=WINDOW)
  want = fa2_jax.reference_attention(q, q, q, local_window_size=WINDOW, query_seq_lengths=lengths,
                                     key_value_seq_lengths=lengths)
  for jit in (False, True):  # the mask's values known while tracing, and traced
    call = lambda q, mask: fn(q, q, q, mask=mask)
    with pytest.warns(FlashAttentionFallbackWarning, match=VARIANT_FORMULA):
      out = (jax.jit(call) if jit else call)(q, nn.make_attention_mask(rows, rows))
    assert_rows_close(out, want, rows, **FORMULA_TOL)
    assert_finite(out)
  assert [c["implementation"] for c in spy] == ["xla", "xla"]
  spy.clear()
  with pytest.raises(ValueError, match=r"bias.*\(key_value_seq_lengths\)"):
    fa2_flax.make_attention_fn(implementation="xla")(
        q, q, q, bias=jnp.zeros((T, T)), key_value_seq_lengths=lengths)
  assert not spy
  # A mask that is provably the causal mask is still the flag: the variant keeps the kernel path.
  with no_fallback():
    out = fn(q, q, q, mask=nn.make_causal_mask(q[..., 0, 0]))
  np.testing.assert_allclose(out, fa2_jax.reference_attention(
      q, q, q, is_causal=True, local_window_size=WINDOW), **FORMULA_TOL)


def test_dense_mask_rows_stay_rows_under_q_offset():
  """q_offset moves the query rows' positions, not the mask's rows: mask row i applies to query row
  i (flax's [..., q_length, kv_length] layout), traced or concrete, with or without the flag."""
  q, k, v = qkv(batch=(1,), t=4, kv_heads=HEADS)
  rows = jnp.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]], bool)
  mask = rows[None, None]  # [1, 1, T, S]
  capped = fa2_flax.make_attention_fn(implementation="xla", logits_soft_cap=SOFT_CAP)
  with pytest.warns(FlashAttentionFallbackWarning, match=VARIANT_FORMULA):
    want = capped(q, k, v, mask=mask)  # the soft cap does not depend on positions
  with pytest.warns(FlashAttentionFallbackWarning, match="passed with q_offset"):
    np.testing.assert_allclose(capped(q, k, v, mask=mask, q_offset=2), want, **FORMULA_TOL)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", FlashAttentionFallbackWarning)  # traced under jit: another reason
    np.testing.assert_allclose(jax.jit(capped)(q, k, v, mask=mask, q_offset=2), want, **FORMULA_TOL)
  # A concrete causal mask with the per-call flag and q_offset: the mask's rows AND the shifted flag.
  causal_rows = jnp.tril(jnp.ones((4, 4), bool))
  fn = fa2_flax.make_attention_fn(implementation="xla")
  with pytest.warns(FlashAttentionFallbackWarning, match="with q_offset"):
    out = fn(q, k, v, mask=causal_rows[None, None], is_causal=True, q_offset=jnp.array([2]))
  want = fa2_jax.reference_attention(q, k, v, is_causal=True, q_offset=2,
                                     mask_fn=lambda b, h, i, j: causal_rows[i - 2, j])
  np.testing.assert_allclose(out, want, **FORMULA_TOL)
  assert np.abs(np.asarray(out - fn(q, k, v, is_causal=True, q_offset=2))).max() > 1e-2


def test_lone_row_mask_with_extra_batch_dims_and_per_head_masks():
  """A decode step's cache mask on [b1, b2, 1, N, H] queries places each row at its own last
  allowed key, on the kernel path (a prefix mask) and on the formula's (a hole in one row); a mask
  with a head axis and a positional variant asks for q_offset instead."""
  q, k, v = qkv(batch=(2, 2), t=6, kv_heads=HEADS)
  q = q[:, :, -1:]
  last = jnp.array([[3, 5], [0, 2]])
  mask = (jnp.arange(6)[None, None] <= last[..., None])[:, :, None, None, :]  # [b1, b2, 1, 1, S]
  fn = fa2_flax.make_attention_fn(implementation="xla", is_causal=True, local_window_size=(2, 0))
  with no_fallback():
    prefix_out = fn(q, k, v, mask=mask)
  holed = mask.at[0, 1, :, :, 2].set(False)  # key 2 masked below row (0, 1)'s last key, 5
  with pytest.warns(FlashAttentionFallbackWarning, match="single query row"):
    holed_out = fn(q, k, v, mask=holed)
  for out, m in ((prefix_out, mask), (holed_out, holed)):
    for b1 in range(2):
      for b2 in range(2):
        n = int(last[b1, b2]) + 1
        keep = m[b1, b2, 0, 0]
        want = fa2_jax.reference_attention(
            q[b1, b2][None], k[b1, b2][None, :n], v[b1, b2][None, :n], is_causal=True,
            q_offset=n - 1, local_window_size=(2, 0), mask_fn=lambda b, h, i, j: keep[j])
        np.testing.assert_allclose(out[b1, b2], want[0], **FORMULA_TOL)
  per_head = jnp.broadcast_to(mask[0, 0], (1, HEADS, 1, 6)).at[:, 1, :, 3:].set(False)
  with pytest.raises(ValueError, match=r"head axis.*local_window_size.*pass q_offset"):
    fn(q[0], k[0], v[0], mask=jnp.broadcast_to(per_head, (2, HEADS, 1, 6)))


# slow with the soft cap (CI time): it reads no position, where the decode step's row placement is
# what this checks; test_attention_fn_passes_every_variant_to_flash_attention passes it through
@pytest.mark.parametrize("variant", ["window", pytest.param("soft_cap", marks=pytest.mark.slow),
                                     "alibi", "mask_fn"])
def test_nnx_decode_with_static_variants_matches_the_full_sequence(variant, nan_fallbacks):
  """A decode=True layer whose attention_fn has static variants: step i (the cache's mask, traced
  under nnx.jit, runs the kernels) equals row i of the full causal call, the row's position taken
  from the cache mask's last allowed key."""
  static = {"window": dict(local_window_size=(2, 0)), "soft_cap": dict(logits_soft_cap=SOFT_CAP),
            "alibi": dict(alibi_slopes=jnp.linspace(0.25, 1.0, HEADS)),
            "mask_fn": dict(mask_fn=mask_fn_even_keys_or_diagonal)}[variant]
  x = inputs()
  layer = nnx.MultiHeadAttention(HEADS, D, decode=True, rngs=nnx.Rngs(0),
                                 attention_fn=kernel_fn(is_causal=True, **static))
  y_full = layer(x, decode=False)  # T > 1 rows: the kernels, causal, with the variant

  @nnx.jit
  def step(module, x_t):
    def loss(module, x_t):
      y = module(x_t)
      return jnp.sum(y * jnp.cos(y)), y
    (_, y), grads = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(module, x_t)
    return y, grads

  layer.init_cache(x.shape)
  nan_fallbacks()
  for i in range(T):
    with no_fallback():
      y, grads = step(layer, x[:, i:i + 1])
    assert_finite((y, nnx.state(grads[0], nnx.Param), grads[1]))
    np.testing.assert_allclose(y[:, 0], y_full[:, i], **TOL)


def test_linen_decode_with_a_window_matches_the_full_sequence():
  """linen's decode=True with a padded cache and the causal adapter's window: every step equals
  the full-length call's row (valid rows), the row placed at the cache mask's last allowed key."""
  x = inputs()
  rows = valid_tokens((B,), T)
  key_mask = rows[:, None, None, :]  # [B, 1, 1, T]
  module = nn.MultiHeadDotProductAttention(
      num_heads=HEADS, decode=True, attention_fn=kernel_fn(is_causal=True, local_window_size=(2, 0)))
  with pytest.warns(FlashAttentionFallbackWarning):
    _, variables = module.init_with_output(jax.random.PRNGKey(1), x, mask=key_mask)
  with pytest.warns(FlashAttentionFallbackWarning):
    y_full = module.clone(decode=False).apply({"params": variables["params"]}, x, mask=key_mask)

  @jax.jit
  def step(cache, x_t):
    y, updated = module.apply({"params": variables["params"], "cache": cache}, x_t, mask=key_mask,
                              mutable=["cache"])
    return y, updated["cache"]

  cache = variables["cache"]
  for i in range(T):
    with no_fallback():  # the padded cache's mask is a prefix too: the kernels
      y, cache = step(cache, x[:, i:i + 1])
    assert_finite(y)
    valid = np.asarray(rows[:, i])
    np.testing.assert_allclose(np.asarray(y[:, 0])[valid], np.asarray(y_full[:, i])[valid],
                               **FORMULA_TOL)


def test_linen_decode_with_a_hole_in_the_mask_runs_the_formula_at_run_time(nan_fallbacks):
  """A key mask with a hole (key 2 of sequence 1) makes that row's cache mask no prefix from the
  step that allows a key past the hole (step 3) on: those steps run flax's formula, the earlier
  ones the kernels, chosen at run time (no step warns); every step equals flax's own."""
  t = 6
  x = inputs(shape=(B, t, D))
  key_mask = jnp.ones((B, 1, 1, t), jnp.bool_).at[1, :, :, 2].set(False)
  ref = nn.MultiHeadDotProductAttention(num_heads=HEADS, decode=True)
  ours = nn.MultiHeadDotProductAttention(num_heads=HEADS, decode=True,
                                         attention_fn=kernel_fn(is_causal=True))
  variables = ref.init(jax.random.PRNGKey(1), x, mask=key_mask)  # the params and an empty cache

  def decode(module):
    @jax.jit
    def step(cache, x_t):
      y, updated = module.apply({"params": variables["params"], "cache": cache}, x_t,
                                mask=key_mask, mutable=["cache"])
      return y, updated["cache"]
    cache, ys = variables["cache"], []
    for i in range(t):
      y, cache = step(cache, x[:, i:i + 1])
      ys.append(y)
    return np.asarray(jnp.concatenate(ys, axis=1))  # [B, t, D]

  want = decode(ref)
  with no_fallback():
    np.testing.assert_allclose(decode(ours), want, **TOL)
    nan_fallbacks()
    poisoned = decode(ours)
  assert np.all(np.isfinite(poisoned[:, :3])) and np.all(np.isnan(poisoned[:, 3:]))
  np.testing.assert_allclose(poisoned[:, :3], want[:, :3], **TOL)


def test_a_cache_mask_step_is_a_decoding_call(spy):
  """The kernel branch of a one-row call with a traced cache mask gives the cache's lengths (the
  last allowed key + 1) and the row's position (q_offset, causal): a decoding call, which
  fa2_jax.dispatch sends to the decode kernels (kernels/decode) when the cache is long enough.
  Under vmap (a batched cond: both branches run, a select keeps one) each element still gets its
  own branch's values."""
  b, s, h = 2, 256, 8
  spec = jax.ShapeDtypeStruct
  q, k = spec((b, 1, HEADS, h), jnp.float32), spec((b, s, KV_HEADS, h), jnp.float32)
  fn = kernel_fn(is_causal=True)
  jaxpr = str(jax.make_jaxpr(lambda q, k, m: fn(q, k, k, mask=m))(
      q, k, spec((b, 1, 1, s), jnp.bool_)))
  assert "cond[" in jaxpr and "pallas_call" in jaxpr
  (call,) = spy  # the other branch is flax's formula
  assert call["is_causal"] and call["key_value_seq_lengths"].shape == (b,)
  assert call["q_offset"].shape == (b,)
  lengths = spec((b,), jnp.int32)
  assert fa2_jax.backend_for(q, k, is_causal=True, key_value_seq_lengths=lengths, q_offset=lengths,
                             interpret=INTERPRET).backend == "decode"

  q, k, v = qkv(batch=(2, 1), t=6, kv_heads=HEADS)  # [2 (mapped), 1, 6, N, 8]
  mask = (jnp.arange(6)[None] <= jnp.array([[2], [4]]))[:, None, None, None, :]  # [2, 1, 1, 1, 6]
  mask = mask.at[1, ..., 1].set(False)  # the second mapped element: a hole, the formula's
  with no_fallback():
    got = jax.vmap(jax.jit(lambda q, k, v, m: fn(q, k, v, mask=m)))(q[:, :, -1:], k, v, mask)
  want = jax.vmap(lambda q, k, v, m: nn.dot_product_attention(q, k, v, mask=m))(q[:, :, -1:], k, v,
                                                                                mask)
  np.testing.assert_allclose(got, want, **TOL)


def test_decode_without_the_factory_causal_flag_warns_that_rows_sit_at_position_0():
  """A decode=True layer trained causal through the per-call flag (nnx's usual way) but whose
  attention_fn was made without is_causal: its one-row steps keep flax's top-left position 0, so a
  positional variant gives other values than the full sequence; the call says so, once, and names
  the fix. The factory's flag decodes right and does not warn."""
  x = inputs(shape=(1, 6, D))
  for factory_causal in (False, True):
    layer = nnx.MultiHeadAttention(HEADS, D, decode=True, rngs=nnx.Rngs(0), attention_fn=(
        fa2_flax.make_attention_fn(implementation="xla", is_causal=factory_causal,
                                   local_window_size=(2, 0))))
    y_full = layer(x, decode=False, is_causal=True)
    layer.init_cache(x.shape)
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("default")  # once per line: the steps' one line
      steps = jnp.concatenate([layer(x[:, i:i + 1]) for i in range(6)], axis=1)
    top_left = [w for w in caught if w.category is fa2_flax.TopLeftQueryRowWarning]
    if factory_causal:
      assert not top_left
      np.testing.assert_allclose(steps, y_full, **FORMULA_TOL)
    else:
      assert len(top_left) == 1 and "make_attention_fn(is_causal=True)" in str(top_left[0].message)
      assert "local_window_size" in str(top_left[0].message)
      assert float(jnp.max(jnp.abs(steps - y_full))) > 0.1  # the documented top-left meaning


def test_export_with_symbolic_shapes_and_variants():
  """jax.export of the adapter with variants and symbolic batch and length: with a dense mask (the
  variant formula reads it as a mask_fn), and a one-row query (a decode step, placed at the last
  key) with and without a cache mask; each exported call equals the eager one."""
  from jax import export
  fn = fa2_flax.make_attention_fn(is_causal=True, local_window_size=(2, 0))
  b, t = export.symbolic_shape("b, t")
  spec = lambda *shape, dtype=jnp.float32: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, HEADS, 8))
  mask = jnp.tril(jnp.ones((2, 1, 5, 5), bool)).at[1, :, :, 3:].set(False)
  cache_mask = (jnp.arange(5)[None] <= jnp.array([2, 4])[:, None])[:, None, None, :]
  cases = [
      (lambda q, m: fn(q, q, q, mask=m), (spec(b, t, HEADS, 8), spec(b, 1, t, t, dtype=jnp.bool_)),
       (x, mask)),
      (lambda q, k: fn(q, k, k), (spec(b, 1, HEADS, 8), spec(b, t, HEADS, 8)), (x[:, :1], x)),
      (lambda q, k, m: fn(q, k, k, mask=m),
       (spec(b, 1, HEADS, 8), spec(b, t, HEADS, 8), spec(b, 1, 1, t, dtype=jnp.bool_)),
       (x[:, :1], x, cache_mask)),
  ]
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", FlashAttentionFallbackWarning)
    for f, specs, args in cases:
      exported = export.export(jax.jit(f))(*specs)
      np.testing.assert_allclose(exported.call(*args), f(*args), **FORMULA_TOL)


def test_single_query_row_with_q_offset_is_causal(spy):
  """The factory's causal flag skips a lone query row (a decode step at an unknown position), but
  not one whose position q_offset gives."""
  q, k, v = qkv()
  fn = fa2_flax.make_attention_fn(implementation="xla", is_causal=True)
  out = fn(q[:, 5:6], k, v, q_offset=5)
  np.testing.assert_allclose(out, fa2_jax.reference_attention(q, k, v, is_causal=True)[:, 5:6],
                             **FORMULA_TOL)
  assert [c["is_causal"] for c in spy] == [True]


def test_single_query_row_positional_variants_sit_at_the_last_key():
  """A lone query row under the factory's causal flag is the newest position: the window and ALiBi
  place it at the last key (kv_length - 1), as a decode step's position is, not at position 0."""
  q, k, v = qkv()
  slopes = jnp.linspace(0.25, 1.0, q.shape[2])
  for variant in (dict(local_window_size=(2, 0)), dict(alibi_slopes=slopes)):
    fn = fa2_flax.make_attention_fn(implementation="xla", is_causal=True, **variant)
    want = fa2_jax.reference_attention(q, k, v, is_causal=True, **variant)[:, -1:]
    np.testing.assert_allclose(fn(q[:, -1:], k, v), want, **FORMULA_TOL)
    # q_offset given: the row sits where it says
    want = fa2_jax.reference_attention(q, k, v, is_causal=True, **variant)[:, 3:4]
    np.testing.assert_allclose(fn(q[:, 3:4], k, v, q_offset=3), want, **FORMULA_TOL)
    # key lengths given (a padded cache): the row sits at each batch element's last valid key
    lengths = jnp.array([5, 2])[:q.shape[0]]
    got = fn(q[:, :1], k, v, key_value_seq_lengths=lengths)
    for b, n in enumerate(lengths.tolist()):
      want = fa2_jax.reference_attention(q[b:b + 1, :1], k[b:b + 1, :n], v[b:b + 1, :n],
                                         is_causal=True, q_offset=n - 1, **variant)
      np.testing.assert_allclose(got[b:b + 1], want, **FORMULA_TOL)


def test_variant_arguments_raise_clear_errors():
  with pytest.raises(ValueError, match="local_window_size"):
    fa2_flax.make_attention_fn(local_window_size=-1)
  with pytest.raises(TypeError, match="local_window_size"):
    fa2_flax.make_attention_fn(local_window_size=2.5)
  with pytest.raises(ValueError, match="logits_soft_cap"):
    fa2_flax.make_attention_fn(logits_soft_cap=0.0)
  with pytest.raises(TypeError, match="mask_fn must be a callable"):
    fa2_flax.make_attention_fn(mask_fn=True)
  with pytest.raises(TypeError, match="alibi_slopes must be a float array"):
    fa2_flax.make_attention_fn(alibi_slopes=[0.5, 0.25])
  q, k, v = qkv()
  fn = fa2_flax.make_attention_fn(implementation="xla", logits_soft_cap=SOFT_CAP)
  with pytest.raises(ValueError, match="logits_soft_cap given both to make_attention_fn and to "
                     "the call"):
    fn(q, k, v, logits_soft_cap=SOFT_CAP)
  with pytest.raises(TypeError, match="score_fn must be a callable"):
    fn(q, k, v, score_fn="tanh")
  with pytest.raises(ValueError, match="q_segment_ids and kv_segment_ids must be given together"):
    fn(q, k, v, q_segment_ids=packed_segments((B,), T))
  with pytest.raises(ValueError, match="alibi_slopes must be 4 real numbers"):
    fa2_flax.CausalSelfAttention(num_heads=HEADS, head_dim=8, alibi_slopes=(0.5, 0.25))
  with pytest.raises(ValueError, match="local_window_size"):
    fa2_flax.NnxCausalSelfAttention(D, HEADS, 8, local_window_size=(2, -1), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="logits_soft_cap"):
    fa2_flax.CausalSelfAttention(num_heads=HEADS, head_dim=8, logits_soft_cap=-1.0)


MODULE_VARIANTS = dict(local_window_size=WINDOW, logits_soft_cap=SOFT_CAP,
                       alibi_slopes=(0.5, 0.25, 0.125, 0.0625))


def test_causal_modules_with_variants_match_the_reference():
  """Both modules with window, soft cap and ALiBi fields and per-call segment ids and lengths,
  against the same module on fa2_jax.reference_attention; the nnx twin with the linen module's
  parameters gives the same. (The gradients of the variants through the adapter:
  test_attention_fn_passes_every_variant_to_flash_attention.)"""
  x = inputs()
  segments = packed_segments((B,), T)
  call = dict(q_segment_ids=segments, kv_segment_ids=segments,
              key_value_seq_lengths=jnp.array([T, T - 2]))
  ours = fa2_flax.CausalSelfAttention(**MODULE_KW, **MODULE_VARIANTS, attention_fn=kernel_fn())
  ref = fa2_flax.CausalSelfAttention(**MODULE_KW, **MODULE_VARIANTS,
                                     attention_fn=fa2_jax.reference_attention)
  params = jax.jit(ref.init)(jax.random.PRNGKey(1), x)
  with no_fallback():
    y = jax.jit(functools.partial(ours.apply, **call))(params, x)
  y_ref = jax.jit(functools.partial(ref.apply, **call))(params, x)
  assert_finite(y)
  assert_trees_close(y, y_ref, **TOL)
  # The window and the segments do change the output (the fields are not ignored).
  plain = fa2_flax.CausalSelfAttention(**MODULE_KW, attention_fn=kernel_fn())
  assert not np.allclose(y, jax.jit(plain.apply)(params, x), **TOL)

  module = fa2_flax.NnxCausalSelfAttention(D, **MODULE_KW, **MODULE_VARIANTS,
                                           attention_fn=kernel_fn(), rngs=nnx.Rngs(0))
  module.qkv.kernel[...] = params["params"]["qkv"]["kernel"]
  module.out.kernel[...] = params["params"]["out"]["kernel"]
  with no_fallback():
    y_nnx = nnx.jit(lambda m, x: m(x, **call))(module, x)
  assert_trees_close(y_nnx, y_ref, **TOL)


def test_packed_documents_equal_separate_documents():
  """Two documents packed into one sequence (segment ids, rotary positions restarting at 0) give
  each token the output it has when its document runs alone."""
  n1, n2 = 5, T - 5
  x = inputs(shape=(1, T, D))
  segments = jnp.asarray([[0] * n1 + [1] * n2], jnp.int32)  # [1, T]
  positions = jnp.asarray([list(range(n1)) + list(range(n2))])  # [1, T]
  module = fa2_flax.CausalSelfAttention(**MODULE_KW, local_window_size=(6, 0),
                                        attention_fn=kernel_fn())
  params = jax.jit(module.init)(jax.random.PRNGKey(1), x)
  apply = jax.jit(module.apply)
  with no_fallback():
    packed = apply(params, x, positions, q_segment_ids=segments, kv_segment_ids=segments)
    first, second = apply(params, x[:, :n1]), apply(params, x[:, n1:])
  np.testing.assert_allclose(packed[:, :n1], first, **TOL)
  np.testing.assert_allclose(packed[:, n1:], second, **TOL)


# --- errors and packaging -------------------------------------------------------------------------

def test_bad_arguments_raise_clear_errors():
  with pytest.raises(ValueError, match="implementation"):
    fa2_flax.make_attention_fn(implementation="flash")
  with pytest.raises(TypeError, match="block_sizes"):
    fa2_flax.make_attention_fn(block_sizes=(64, 64))
  with pytest.raises(TypeError, match="is_causal"):
    fa2_flax.make_attention_fn(is_causal="yes")
  with pytest.raises(TypeError, match="deterministic"):
    fa2_flax.make_attention_fn(deterministic=1)
  with pytest.raises(TypeError, match="interpret"):
    fa2_flax.make_attention_fn(interpret="on")
  with pytest.raises(ValueError, match="num_kv_heads"):
    fa2_flax.CausalSelfAttention(num_heads=4, num_kv_heads=3, head_dim=8)
  with pytest.raises(ValueError, match="num_kv_heads"):
    fa2_flax.NnxCausalSelfAttention(D, 4, 8, num_kv_heads=3, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="head_dim"):
    fa2_flax.CausalSelfAttention(num_heads=4, head_dim=7, rotary=True)
  with pytest.raises(ValueError, match="num_heads"):
    fa2_flax.NnxCausalSelfAttention(D, 0, 8, rngs=nnx.Rngs(0))
  # the RoPE base and the output width (before: NaN outputs, 0 read as "the input width", or an
  # error from inside flax's broadcasting)
  for base in (-1.0, 0.0, float("nan"), float("inf")):
    with pytest.raises(ValueError, match="rotary_base must be a finite number > 0"):
      fa2_flax.CausalSelfAttention(num_heads=4, head_dim=8, rotary=True, rotary_base=base)
    with pytest.raises(ValueError, match="rotary_base"):
      fa2_flax.NnxCausalSelfAttention(D, 4, 8, rotary=True, rotary_base=base, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="rotary_base"):
      fa2_flax.rotary_embedding(jnp.ones((1, 4, 2, 8)), base=base)
  with pytest.raises(TypeError, match="rotary_base must be a real number"):
    fa2_flax.CausalSelfAttention(num_heads=4, head_dim=8, rotary_base="1e4")
  for width, error in ((0, ValueError), (-3, ValueError), (2.0, TypeError), (True, TypeError)):
    with pytest.raises(error, match="out_features must be a positive int or None"):
      fa2_flax.CausalSelfAttention(num_heads=4, head_dim=8, out_features=width)
    with pytest.raises(error, match="out_features"):
      fa2_flax.NnxCausalSelfAttention(D, 4, 8, out_features=width, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match="head_dim must be a positive int, got float 8.0"):
    fa2_flax.CausalSelfAttention(num_heads=4, head_dim=8.0)


def test_bad_call_arguments_raise_clear_errors():
  """The attention_fn checks what flax would pass before the kernel or a fallback sees it."""
  fn = fa2_flax.make_attention_fn(implementation="xla")
  q = jnp.zeros((B, T, HEADS, 8))
  kv = jnp.zeros((B, T, KV_HEADS, 8))
  cases = [
      (TypeError, "query", dict(query=[[0.0]])),
      (ValueError, "query", dict(query=jnp.zeros((T, 8)))),
      (ValueError, "key", dict(key=jnp.zeros((1, B, T, KV_HEADS, 8)))),
      (ValueError, "key and value", dict(value=jnp.zeros((B, T + 1, KV_HEADS, 8)))),
      (ValueError, "batch dims", dict(key=jnp.zeros((B + 1, T, KV_HEADS, 8)),
                                      value=jnp.zeros((B + 1, T, KV_HEADS, 8)))),
      (ValueError, "num_heads", dict(key=jnp.zeros((B, T, 3, 8)), value=jnp.zeros((B, T, 3, 8)))),
      (ValueError, "head_dim", dict(key=jnp.zeros((B, T, KV_HEADS, 4)))),
      (TypeError, "mask", dict(mask=[[True]])),
      (ValueError, "mask", dict(mask=jnp.ones((B, 1, T, T + 1), bool))),  # kv_length T
      (ValueError, "mask", dict(mask=jnp.ones((3, B, 1, T, T), bool))),  # more dims than logits
      (ValueError, "bias", dict(bias=jnp.zeros((B, 3, T, T)))),  # 3 heads of 4
      (TypeError, "is_causal", dict(is_causal="yes")),
      (ValueError, "dropout_rate", dict(dropout_rate=1.5, dropout_rng=jax.random.PRNGKey(0))),
      (TypeError, "dropout_rate", dict(dropout_rate="0.1")),
      (ValueError, "dropout_rng", dict(dropout_rate=0.1, deterministic=False)),
      # what nnx.MultiHeadAttention passes on for rotary attention functions: flax's own formula
      # does not take it either, so no fallback can honour it
      (TypeError, "input_positions, which flax passes on for rotary embeddings; it applies none",
       dict(input_positions=jnp.arange(T))),
      (TypeError, r"unexpected arguments \['future_option'\]", dict(future_option=3)),
  ]
  fn(query=q, key=kv, value=kv, future_option=None)  # an unset argument is ignored
  for error, match, kw in cases:
    args = dict(query=q, key=kv, value=kv) | kw
    with pytest.raises(error, match=match):
      fn(**args)
  module = fa2_flax.CausalSelfAttention(**MODULE_KW)
  x = inputs()
  params = module.init(jax.random.PRNGKey(1), x)
  with pytest.raises(ValueError, match="mask"):
    module.apply(params, x, mask=jnp.ones((B, 1, T, T - 1), bool))


def test_nnx_rotary_positions_through_the_advised_wrapper():
  """The input_positions error's advice works: nnx.MultiHeadAttention with an attention_fn that
  rotates query and key, equal to the same rotation before flax's own formula."""
  x = inputs()
  pos = jnp.broadcast_to(jnp.arange(T) + 3, (B, T))

  def rotated(attend):
    return lambda q, k, v, *, input_positions, **kw: attend(
        fa2_flax.rotary_embedding(q, input_positions), fa2_flax.rotary_embedding(k, input_positions),
        v, **kw)

  layers = [nnx.MultiHeadAttention(HEADS, D, decode=False, rngs=nnx.Rngs(0), attention_fn=rotated(fn))
            for fn in (fa2_flax.make_attention_fn(interpret=INTERPRET), nnx.dot_product_attention)]
  got, want = (layer(x, input_positions=pos, is_causal=True) for layer in layers)
  np.testing.assert_allclose(got, want, **TOL)


def test_nnx_modules_pickle_and_equal_factories_compare_equal():
  """The attention_fn is a picklable object, so nnx graphs that hold it pickle; two made with the
  same arguments are equal (nnx compares graphs' static fields), others are not."""
  import pickle
  block = fa2_flax.NnxCausalSelfAttention(D, HEADS, 8, local_window_size=(4, 0), rngs=nnx.Rngs(0))
  graph = pickle.loads(pickle.dumps(nnx.graphdef(block)))
  assert graph == nnx.graphdef(block)
  layer = nnx.MultiHeadAttention(HEADS, D, rngs=nnx.Rngs(0), attention_fn=fa2_flax.attention_fn)
  pickle.dumps(nnx.graphdef(layer))
  make = fa2_flax.make_attention_fn
  assert make(is_causal=True, local_window_size=4) == make(is_causal=True, local_window_size=4)
  assert hash(make(alibi_slopes=np.array([0.5, 0.25]))) == hash(make(alibi_slopes=np.array([0.5, 0.25])))
  assert make(is_causal=True) != make() and make(local_window_size=4) != make(local_window_size=5)
  assert make(alibi_slopes=np.array([0.5, 0.25])) != make(alibi_slopes=np.array([0.5, 0.5]))
  assert pickle.loads(pickle.dumps(make(logits_soft_cap=30.0))) == make(logits_soft_cap=30.0)
  # numpy slopes changed after the call: the function keeps (and compares by) the values it was given
  slopes = np.array([0.5, 0.25, 0.125, 0.0625])
  fn = make(alibi_slopes=slopes, implementation="xla")
  q = jax.random.normal(jax.random.PRNGKey(0), (1, T, HEADS, 8))
  want = fn(q, q, q)
  slopes[:] = 2.0
  assert fn == make(alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625]), implementation="xla")
  np.testing.assert_array_equal(fn(q, q, q), want)


def test_nnx_block_keeps_plain_static_fields():
  """numpy / JAX scalars given as static fields are kept as Python numbers: under nnx.jit a JAX
  scalar soft cap is no traced value, and a numpy window compares with a tuple one without raising."""
  x = jax.random.normal(jax.random.PRNGKey(0), (1, T, D))
  step = nnx.jit(lambda m, x: m(x))
  fn = fa2_flax.make_attention_fn(implementation="xla")
  make = lambda **kw: fa2_flax.NnxCausalSelfAttention(D, HEADS, 8, rngs=nnx.Rngs(0),  # noqa: E731
                                                     attention_fn=fn, **kw)
  numpy_fields = make(local_window_size=np.int64(4), logits_soft_cap=jnp.float32(3.0),
                      rotary=True, rotary_base=np.float32(500.0))
  plain = make(local_window_size=4, logits_soft_cap=3.0, rotary=True, rotary_base=500.0)
  np.testing.assert_array_equal(step(numpy_fields, x), step(plain, x))
  step(make(local_window_size=(4, 0)), x)  # after a module with the numpy window
  assert type(numpy_fields.local_window_size) is int and type(numpy_fields.logits_soft_cap) is float
  with pytest.raises(ValueError, match="in_features = 32"):
    plain(jnp.ones((1, T, 16)))
  # in_features as nnx.LinearGeneral takes it (a tuple of trailing dims), and a base traced inside
  # jax.jit (a block built there)
  tupled = fa2_flax.NnxCausalSelfAttention((D,), HEADS, 8, rngs=nnx.Rngs(0), attention_fn=fn)
  np.testing.assert_array_equal(tupled(x), make()(x))
  built_in_jit = jax.jit(lambda base, x: make(rotary=True, rotary_base=base)(x))
  np.testing.assert_allclose(built_in_jit(500.0, x), make(rotary=True, rotary_base=500.0)(x),
                             **(FORMULA_TOL if ON_GPU else dict(rtol=1e-5, atol=1e-6)))


def test_importing_fa2_jax_does_not_import_flax():
  code = "import sys, fa2_jax; assert 'flax' not in sys.modules, 'flax imported'"
  subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
  assert fa2_jax.flash_attention is not None


def test_missing_flax_names_the_extra():
  """Without Flax installed, importing fa2_jax.flax says how to get it (a fresh process, with flax
  hidden from the import system)."""
  code = ("import sys; sys.modules['flax'] = None\n"
          "try:\n  import fa2_jax.flax\nexcept ImportError as e:\n  print(e)\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=str(Path(__file__).resolve().parents[1]))
  assert "pip install 'fa2_jax[flax]'" in out.stdout, (out.stdout, out.stderr[-2000:])
