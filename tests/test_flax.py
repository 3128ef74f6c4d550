"""fa2_jax.flax: the attention_fn inside flax's own layers, the fallbacks, and the causal modules.

On CPU the kernel path runs the Pallas kernels in interpret mode (float32, small shapes), so these
tests check the kernels themselves against flax's default attention, not the XLA formula.
"""
import functools
import subprocess
import sys
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fa2_jax
import fa2_jax.flax as fa2_flax
from fa2_jax.flax import FlashAttentionFallbackWarning

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = None if ON_GPU else True  # compiled kernels on a GPU, interpret mode elsewhere
# float32 through the Pallas interpreter matches flax's einsums to rounding; a GPU's f32 dots may
# use TF32, whose 10-bit mantissa needs the looser bound.
TOL = dict(atol=5e-3, rtol=5e-3) if ON_GPU else dict(atol=2e-5, rtol=2e-5)
B, T, D, HEADS = 2, 24, 32, 4  # T not a multiple of the 16-row tiles: exercises the padded tail


@pytest.fixture(autouse=True)
def _fresh_warnings():
  """Fallback warnings are one-time per reason; every test starts with none reported."""
  fa2_flax._warned.clear()
  yield
  fa2_flax._warned.clear()


@pytest.fixture
def spy(monkeypatch):
  """Records the keyword arguments of every fa2_jax.flash_attention call made by fa2_jax.flax."""
  calls = []
  real = fa2_flax.flash_attention

  def recording(*args, **kwargs):
    calls.append(kwargs)
    return real(*args, **kwargs)

  monkeypatch.setattr(fa2_flax, "flash_attention", recording)
  return calls


def kernel_fn(**kw):
  return fa2_flax.make_attention_fn(interpret=INTERPRET, **kw)


def inputs(seed=0, shape=(B, T, D)):
  return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)


def assert_trees_close(a, b, **tol):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tol), a, b)


def linen_value_and_grads(module, params, x, **call_kw):
  def loss(p, x):
    y = module.apply(p, x, **call_kw)
    return jnp.sum(y * jnp.cos(y)), y  # a loss with a nonuniform cotangent
  (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
  return y, grads


# --- linen ----------------------------------------------------------------------------------------

def test_linen_mha_matches_flax_default(spy):
  x = inputs()
  ref = nn.MultiHeadDotProductAttention(num_heads=HEADS)
  ours = nn.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=kernel_fn())
  params = ref.init(jax.random.PRNGKey(1), x)
  with warnings.catch_warnings():
    warnings.simplefilter("error", FlashAttentionFallbackWarning)
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
  with warnings.catch_warnings():
    warnings.simplefilter("error", FlashAttentionFallbackWarning)
    y, g = linen_value_and_grads(ours, params, x)
  y_ref, g_ref = linen_value_and_grads(ref, params, x, mask=nn.make_causal_mask(x[..., 0]))
  assert_trees_close(y, y_ref, **TOL)
  assert_trees_close(g, g_ref, **TOL)
  assert spy and all(c["is_causal"] for c in spy)


def test_linen_dense_causal_mask_falls_back_and_matches(spy):
  x = inputs()
  mask = nn.make_causal_mask(x[..., 0])
  ref = nn.MultiHeadDotProductAttention(num_heads=HEADS)
  ours = nn.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=kernel_fn())
  params = ref.init(jax.random.PRNGKey(1), x)
  with pytest.warns(FlashAttentionFallbackWarning, match="dense `mask`"):
    y, g = linen_value_and_grads(ours, params, x, mask=mask)
  y_ref, g_ref = linen_value_and_grads(ref, params, x, mask=mask)
  assert_trees_close(y, y_ref, atol=1e-6, rtol=1e-6)
  assert_trees_close(g, g_ref, atol=1e-6, rtol=1e-6)
  assert not spy  # the kernel never saw the call


def test_linen_dropout_falls_back_with_the_same_dropout():
  x = inputs()
  ref = nn.MultiHeadDotProductAttention(num_heads=HEADS, dropout_rate=0.5)
  ours = nn.MultiHeadDotProductAttention(num_heads=HEADS, dropout_rate=0.5,
                                         attention_fn=kernel_fn())
  params = ref.init(jax.random.PRNGKey(1), x, deterministic=True)
  rngs = {"dropout": jax.random.PRNGKey(3)}
  with pytest.warns(FlashAttentionFallbackWarning, match="dropout"):
    y = ours.apply(params, x, deterministic=False, rngs=rngs)
  y_ref = ref.apply(params, x, deterministic=False, rngs=rngs)
  np.testing.assert_allclose(y, y_ref, atol=1e-6, rtol=1e-6)
  # deterministic=True switches dropout off: the kernel may run again, without a warning.
  with warnings.catch_warnings():
    warnings.simplefilter("error", FlashAttentionFallbackWarning)
    y = ours.apply(params, x, deterministic=True)
  np.testing.assert_allclose(y, ref.apply(params, x, deterministic=True), **TOL)


def test_fallback_warns_once_per_reason():
  q = inputs(shape=(B, T, HEADS, 8))
  mask = jnp.ones((B, 1, T, T), bool)
  with pytest.warns(FlashAttentionFallbackWarning):
    fa2_flax.attention_fn(q, q, q, mask=mask)
  with warnings.catch_warnings():
    warnings.simplefilter("error", FlashAttentionFallbackWarning)
    fa2_flax.attention_fn(q, q, q, mask=mask)


# --- nnx ------------------------------------------------------------------------------------------

def nnx_value_and_grads(module, x, **call_kw):
  def loss(m, x):
    y = m(x, **call_kw)
    return jnp.sum(y * jnp.cos(y)), y
  (_, y), grads = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(module, x)
  return y, grads


@pytest.mark.parametrize("num_kv_heads", [HEADS, 2])  # plain multi-head and grouped-query
def test_nnx_mha_causal_matches_flax_default(spy, num_kv_heads):
  x = inputs()
  make = lambda **kw: nnx.MultiHeadAttention(HEADS, D, num_kv_heads=num_kv_heads, decode=False,
                                             rngs=nnx.Rngs(0), **kw)
  ref, ours = make(), make(attention_fn=kernel_fn())
  with warnings.catch_warnings():
    warnings.simplefilter("error", FlashAttentionFallbackWarning)
    y, g = nnx_value_and_grads(ours, x, is_causal=True)
  y_ref, g_ref = nnx_value_and_grads(ref, x, is_causal=True)
  assert_trees_close(y, y_ref, **TOL)
  assert_trees_close(nnx.state(g[0], nnx.Param), nnx.state(g_ref[0], nnx.Param), **TOL)
  assert_trees_close(g[1], g_ref[1], **TOL)
  assert spy and all(c["is_causal"] for c in spy)


def test_nnx_dense_mask_falls_back_and_matches(spy):
  x = inputs()
  mask = nnx.make_causal_mask(x[..., 0])
  make = lambda **kw: nnx.MultiHeadAttention(HEADS, D, decode=False, rngs=nnx.Rngs(0), **kw)
  ref, ours = make(), make(attention_fn=kernel_fn())
  with pytest.warns(FlashAttentionFallbackWarning, match="dense `mask`"):
    y = ours(x, mask=mask)
  np.testing.assert_allclose(y, ref(x, mask=mask), atol=1e-6, rtol=1e-6)
  assert not spy


def test_nnx_dropout_falls_back():
  x = inputs()
  make = lambda **kw: nnx.MultiHeadAttention(HEADS, D, dropout_rate=0.5, deterministic=False,
                                             decode=False, rngs=nnx.Rngs(0, dropout=7), **kw)
  ref, ours = make(), make(attention_fn=kernel_fn())
  with pytest.warns(FlashAttentionFallbackWarning, match="dropout"):
    y = ours(x)
  np.testing.assert_allclose(y, ref(x), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("is_causal", [False, True])
def test_extra_leading_batch_dims(is_causal):
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(keys[0], (2, 3, T, HEADS, 8))
  k, v = (jax.random.normal(kk, (2, 3, T, 2, 8)) for kk in keys[1:])
  out = kernel_fn()(q, k, v, is_causal=is_causal)
  np.testing.assert_allclose(out, nnx.dot_product_attention(q, k, v, is_causal=is_causal), **TOL)


# --- the causal self-attention modules ------------------------------------------------------------

XLA_ATTENTION = functools.partial(jax.nn.dot_product_attention, implementation="xla")
MODULE_KW = dict(num_heads=HEADS, num_kv_heads=2, head_dim=8, rotary=True)


def test_causal_self_attention_linen_matches_xla():
  x = inputs()
  ours = fa2_flax.CausalSelfAttention(**MODULE_KW, attention_fn=kernel_fn())
  ref = fa2_flax.CausalSelfAttention(**MODULE_KW, attention_fn=XLA_ATTENTION)
  params = ours.init(jax.random.PRNGKey(1), x)
  assert params["params"]["qkv"]["kernel"].shape == (D, HEADS + 2 * 2, 8)  # N query + 2K kv heads
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
  y, y2 = module.apply(params, x), module.apply(params, x2)
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
  np.testing.assert_allclose(g[0].qkv.kernel[...], g_ref[0]["params"]["qkv"]["kernel"], **TOL)


def test_rotary_matches_nnx_rope():
  x = inputs(shape=(B, T, HEADS, 16))
  positions = jnp.arange(T)
  expected = nnx.RoPE()(jnp.swapaxes(x, -2, -3), positions)  # nnx.RoPE wants [..., T, H]
  np.testing.assert_allclose(fa2_flax.rotary_embedding(x, positions), jnp.swapaxes(expected, -2, -3),
                             atol=1e-5, rtol=1e-5)


# --- errors and packaging -------------------------------------------------------------------------

def test_bad_arguments_raise_clear_errors():
  with pytest.raises(ValueError, match="implementation"):
    fa2_flax.make_attention_fn(implementation="flash")
  with pytest.raises(TypeError, match="block_sizes"):
    fa2_flax.make_attention_fn(block_sizes=(64, 64))
  with pytest.raises(TypeError, match="is_causal"):
    fa2_flax.make_attention_fn(is_causal="yes")
  with pytest.raises(ValueError, match="num_kv_heads"):
    fa2_flax.CausalSelfAttention(num_heads=4, num_kv_heads=3, head_dim=8)
  with pytest.raises(ValueError, match="num_kv_heads"):
    fa2_flax.NnxCausalSelfAttention(D, 4, 8, num_kv_heads=3, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="head_dim"):
    fa2_flax.CausalSelfAttention(num_heads=4, head_dim=7, rotary=True)
  with pytest.raises(ValueError, match="num_heads"):
    fa2_flax.NnxCausalSelfAttention(D, 0, 8, rngs=nnx.Rngs(0))


def test_importing_fa2_jax_does_not_import_flax():
  code = "import sys, fa2_jax; assert 'flax' not in sys.modules, 'flax imported'"
  subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
  assert fa2_jax.flash_attention is not None
