"""The backend seam: a kernel family is one object in kernels.registry, and a new one plugs in there.

The proof is a family of its own: the XLA formula behind the :class:`kernels.backend.Backend`
interface, registered for one test, run through ``flash_attention``'s dispatch, custom_vjp and
``backend_for`` exactly as the Pallas families are.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa2_jax
from fa2_jax.kernels import registry
from fa2_jax.kernels.backend import ALL_FEATURES, Backend, KernelCall
from fa2_jax.kernels.masking import Variant
from fa2_jax.kernels.softmax import LN2, exponent_scale
from fa2_jax.reference import attention_formula


@dataclasses.dataclass(frozen=True)
class FormulaConfig:
  """The test family's config: it has no tiles."""


class FormulaBackend(Backend):
  """The formula as a kernel family: the forward returns the row statistics the kernels return
  (``r`` with ``l = 1``, so that ``lse = r * c * ln 2``), the backward is the formula's vjp."""

  name = "formula_test"
  config_type = FormulaConfig
  features = ALL_FEATURES - {"alibi_slopes"}  # the kernels' lse carries an ALiBi shift; this has none

  def supports(self, call: KernelCall):
    return None if call.head_dim != 7 else "it refuses head_dim 7 (to test a refusal)"

  def default_config(self, call):
    return FormulaConfig()

  def range_tiles(self, call, config):
    return {}

  def kernel_names(self, call, config):
    return ("formula forward",), ("formula vjp",), True

  @staticmethod
  def _formula(q, k, v, scale, is_causal, variant, arrays):
    variant = variant or Variant(is_causal=is_causal)
    return attention_formula(q, k, v, variant, arrays, scale=scale)

  def forward(self, q, k, v, *, scale, is_causal, config, variant, arrays, table, interpret):
    out, lse = self._formula(q, k, v, scale, is_causal, variant, arrays)
    lse = jnp.swapaxes(lse, 1, 2)  # [B, N, T]
    modifies = variant is not None and variant.modifies_scores
    c = np.float32(exponent_scale(scale, modifies))
    seen = lse > -jnp.inf
    r = jnp.where(seen, lse / (c * np.float32(LN2)), 0.0)
    return out, jnp.stack([r, seen.astype(jnp.float32)], axis=2)

  def backward(self, q, k, v, out, stats, dout, *, dlse, scale, is_causal, deterministic, config,
               variant, arrays, tables, interpret, slope_grad=False):
    assert not slope_grad  # differentiates_slopes is False (and it has no ALiBi)
    f = lambda q, k, v: self._formula(q, k, v, scale, is_causal, variant, arrays)  # noqa: E731
    _, vjp = jax.vjp(f, q, k, v)
    return vjp((dout, jnp.swapaxes(dlse, 1, 2).astype(jnp.float32)))


@pytest.fixture
def formula_backend():
  backend = FormulaBackend()
  registry.register(backend)
  try:
    yield backend
  finally:
    registry.unregister(backend.name)
  assert backend.name not in registry.names()


def _qkv(b=2, t=24, s=40, n=4, kh=2, h=16, dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(0), 3)
  return (jax.random.normal(ks[0], (b, t, n, h), dtype), jax.random.normal(ks[1], (b, s, kh, h), dtype),
          jax.random.normal(ks[2], (b, s, kh, h), dtype))


def test_a_registered_family_runs_through_dispatch_vjp_and_backend_for(formula_backend):
  q, k, v = _qkv()
  seg_q = jnp.repeat(jnp.arange(2)[None], 12, axis=0).T.reshape(1, 24).repeat(2, 0)
  seg_k = jnp.concatenate([jnp.zeros((2, 20), jnp.int32), jnp.ones((2, 20), jnp.int32)], axis=1)
  kw = dict(is_causal=True, q_offset=16, local_window_size=(9, 0), q_segment_ids=seg_q,
            kv_segment_ids=seg_k)
  d = fa2_jax.backend_for(q, k, implementation="formula_test", **kw)
  assert (d.backend, d.forward, d.backward) == ("formula_test", ("formula forward",),
                                                ("formula vjp",)), d
  # on CPU without interpret=True the Pallas families refuse, so implementation=None walks to it
  if jax.default_backend() == "cpu":
    d = fa2_jax.backend_for(q, k, **kw)
    assert d.backend == "formula_test" and "triton: it needs a GPU" in d.reason, d
  # its config type selects it
  assert fa2_jax.backend_for(q, k, block_sizes=FormulaConfig(), **kw).backend == "formula_test"

  def loss(impl):
    def f(q, k, v):
      out, lse = fa2_jax.flash_attention(q, k, v, implementation=impl, return_residual=True, **kw)
      return jnp.sum(out * out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) ** 2)
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))

  got = loss("formula_test")(q, k, v)
  want = loss("xla")(q, k, v)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


def test_a_registered_family_refuses_by_its_own_rules(formula_backend):
  q, k, v = _qkv(h=7)
  with pytest.raises(ValueError, match="implementation='formula_test' cannot run this call: it "
                     "refuses head_dim 7"):
    fa2_jax.flash_attention(q, k, v, implementation="formula_test")
  # a variant feature it does not list
  q, k, v = _qkv()
  with pytest.raises(ValueError, match="formula_test' cannot run this call: it does not implement "
                     "alibi_slopes"):
    fa2_jax.flash_attention(q, k, v, implementation="formula_test",
                            alibi_slopes=jnp.ones((4,), jnp.float32))
  # an implementation=None call falls through it to the formula
  assert fa2_jax.backend_for(q, k, alibi_slopes=jnp.ones((4,), jnp.float32)).backend in (
      "xla", "sm90", "triton")
  with pytest.raises(TypeError, match="block_sizes is a FormulaConfig, which configures the "
                     "formula_test kernels; implementation='triton' takes a fa2_jax.BlockSizes"):
    fa2_jax.flash_attention(q, k, v, implementation="triton", block_sizes=FormulaConfig())


def test_registry_refuses_duplicates_and_unknown_names(formula_backend):
  with pytest.raises(ValueError, match="already registered"):
    registry.register(FormulaBackend())
  with pytest.raises(TypeError, match="named kernels.backend.Backend"):
    registry.register(object())
  q, k, _ = _qkv()
  with pytest.raises(ValueError, match="implementation must be one of .*'formula_test'"):
    fa2_jax.backend_for(q, k, implementation="formula")


def test_the_shipped_families_and_their_order():
  assert registry.names()[:3] == ("decode", "sm90", "triton")
  assert registry.get("mosaic") is registry.get("sm90")  # the Mosaic GPU family of this GPU
  assert registry.for_config(fa2_jax.MosaicConfig()) is registry.get("sm90")
  assert registry.for_config(fa2_jax.BlockSizes()) is registry.get("triton")
  assert fa2_jax.dispatch.implementations() == (None, "decode", "sm90", "triton", "mosaic", "xla")


def test_kernels_import_nothing_from_the_public_package():
  """kernels/ is self-contained: no module under it imports fa2_jax or climbs above kernels/ with a
  relative import (the mask rule and the block ranges live in kernels/; the public package registers
  itself where a kernel needs to know it: lowering_cache.add_package_folder)."""
  import ast
  import pathlib
  root = pathlib.Path(fa2_jax.kernels.__file__).parent
  offenders = []
  for path in sorted(root.rglob("*.py")):
    inside = len(path.relative_to(root).parts)  # relative levels that stay inside kernels/
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        offenders += [f"{path.name}: import {a.name}" for a in node.names
                      if a.name.split(".")[0] == "fa2_jax"]
      elif isinstance(node, ast.ImportFrom):
        if node.level == 0 and (node.module or "").split(".")[0] == "fa2_jax":
          offenders.append(f"{path.name}: from {node.module}")
        elif node.level > inside:
          offenders.append(f"{path.name}: from {'.' * node.level}{node.module or ''}")
  assert not offenders, offenders
