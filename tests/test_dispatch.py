"""Which kernels run where: the backend choice and ``fa2_jax.backend_for``, on any machine.

The device is faked by patching ``fa2_jax.kernels.platform.on_gpu`` / ``gpu_compute_capability`` (nothing is
run: the choice needs only shapes and dtypes).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from fa2_jax.kernels import platform
import fa2_jax


from conftest import on_gpu


def _shapes(t=1024, s=1024, n=8, kh=2, h=128, dtype=jnp.bfloat16):
  return (jax.ShapeDtypeStruct((2, t, n, h), dtype), jax.ShapeDtypeStruct((2, s, kh, h), dtype))


@pytest.fixture
def fake_gpu(monkeypatch):
  """``fake_gpu(cc)``: pretend the first device is an NVIDIA GPU of compute capability ``cc``
  (None: a GPU that reports none, e.g. ROCm)."""

  def set_cc(cc):
    monkeypatch.setattr(platform, "on_gpu", lambda: True)
    monkeypatch.setattr(platform, "gpu_compute_capability", lambda: cc)

  return set_cc


@pytest.mark.parametrize("cc, name", [
    ((8, 0), "A100"), ((8, 6), "RTX 30"), ((8, 9), "L4 / RTX 40"), ((10, 0), "B200"),
    ((12, 0), "RTX 50"), (None, "ROCm / unknown")])
def test_non_hopper_gpus_get_the_triton_kernels(fake_gpu, cc, name):
  fake_gpu(cc)
  q, k = _shapes()
  d = fa2_jax.backend_for(q, k, is_causal=True)
  assert d.backend == "triton", name
  assert d.forward == ("triton forward",) and d.backward == ("triton dK/dV", "triton dQ")
  assert "Hopper" in d.reason  # the reason names why the Mosaic kernels do not run
  with pytest.raises(ValueError, match="implementation='mosaic' cannot run this call: .*Hopper"):
    fa2_jax.backend_for(q, k, implementation="mosaic")


def test_hopper_runs_variants_on_the_mosaic_kernels(fake_gpu):
  fake_gpu((9, 0))
  q, k = _shapes()
  seg = jax.ShapeDtypeStruct((q.shape[0], q.shape[1]), jnp.int32)
  d = fa2_jax.backend_for(q, k, q_segment_ids=seg, kv_segment_ids=seg, logits_soft_cap=30.0)
  assert d.backend == "sm90" and d.backward == ("sm90 dK/dV", "sm90 dQ"), d  # no fused dQ
  assert d.deterministic
  # A mask_fn that reads the head: one range table per head, which the Mosaic kernels do not read.
  per_head = dict(mask_fn=lambda b, h, i, j: (j <= i) | (h == 0))
  d = fa2_jax.backend_for(q, k, **per_head)
  assert d.backend == "triton" and "mask_fn depends on the head" in d.reason, d
  with pytest.raises(ValueError, match="mask_fn depends on the head"):
    fa2_jax.backend_for(q, k, implementation="mosaic", **per_head)
  assert fa2_jax.backend_for(q, k, mask_fn=lambda b, h, i, j: j <= i).backend == "sm90"


@pytest.mark.parametrize("cc", [(9, 0), (9, 0xa)])
def test_hopper_gets_the_mosaic_kernels(fake_gpu, cc):
  fake_gpu(cc)
  q, k = _shapes()
  d = fa2_jax.backend_for(q, k, is_causal=True)
  assert d.backend == "sm90" and d.forward == ("sm90 forward",)
  assert d.backward == ("sm90 dK/dV", "sm90 dQ") and d.deterministic  # causal 1k: separate dQ
  long_c = fa2_jax.backend_for(*_shapes(t=6144), is_causal=True)  # causal from 5k rows: fused
  assert long_c.backward == ("sm90 dK/dV + fused dQ",) and not long_c.deterministic
  # MHA, GQA and MQA alike: separate at 4k, fused from 5k
  for n, kh in ((16, 16), (32, 8), (48, 1)):
    shapes = lambda t: _shapes(t=t, s=t, n=n, kh=kh)  # noqa: E731
    assert fa2_jax.backend_for(*shapes(4096), is_causal=True).backward == ("sm90 dK/dV", "sm90 dQ")
    assert fa2_jax.backend_for(*shapes(6144), is_causal=True).backward == ("sm90 dK/dV + fused dQ",)
  nc = fa2_jax.backend_for(*_shapes(t=2048), is_causal=False)  # non-causal from 2k rows: fused
  assert nc.backward == ("sm90 dK/dV + fused dQ",) and not nc.deterministic
  few = fa2_jax.backend_for(*_shapes(t=128), is_causal=False)  # few query rows: separate dQ
  assert few.backward == ("sm90 dK/dV", "sm90 dQ") and few.deterministic
  window = dict(is_causal=True, local_window_size=(512, 0))  # a variant: the same length rule
  win = fa2_jax.backend_for(*_shapes(t=6144), **window)
  assert win.backward == ("sm90 dK/dV + fused dQ",) and not win.deterministic
  win_det = fa2_jax.backend_for(*_shapes(t=6144), deterministic=True, **window)
  assert win_det.backward == ("sm90 dK/dV", "sm90 dQ") and win_det.deterministic
  assert fa2_jax.backend_for(*_shapes(t=4096), **window).backward == ("sm90 dK/dV", "sm90 dQ")
  off = fa2_jax.MosaicConfig.default(128, is_causal=True).replace(dq_fused_variants=False)
  assert fa2_jax.backend_for(*_shapes(t=6144), block_sizes=off, **window).backward == (
      "sm90 dK/dV", "sm90 dQ")
  assert fa2_jax.backend_for(*_shapes(t=6144), block_sizes=off, is_causal=True).backward == (
      "sm90 dK/dV + fused dQ",)  # dq_fused_variants leaves plain causal calls alone
  det = fa2_jax.backend_for(*_shapes(t=4096), is_causal=True, deterministic=True)
  assert det.backward == ("sm90 dK/dV", "sm90 dQ") and det.deterministic
  big = fa2_jax.backend_for(*_shapes(h=256))
  assert big.backward == ("sm90 dK/dV (split by role)", "sm90 dQ (split by role)")
  h192 = fa2_jax.backend_for(*_shapes(h=192))
  assert h192.backward == ("sm90 dK/dV (split by role)", "sm90 dQ")
  one_dq = fa2_jax.MosaicConfig.default(256).replace(dq_roles=False)
  assert fa2_jax.backend_for(*_shapes(h=256), block_sizes=one_dq).backward == (
      "sm90 dK/dV (split by role)", "sm90 dQ")
  assert str(d).startswith("sm90 (sm90 forward, sm90 dK/dV, sm90 dQ): ")


@pytest.mark.parametrize("kw, want", [
    (dict(), "sm90"),
    (dict(h=64, t=17, s=1), "sm90"),  # any length
    (dict(h=256), "sm90"),
    (dict(dtype=jnp.float16), "sm90"),
    (dict(dtype=jnp.float32), "triton"),  # wgmma backend: 16-bit inputs only
    (dict(h=96), "sm90"),  # any multiple of 16: the swizzle that tiles it (ops.smem_transforms)
    (dict(h=80), "sm90"),
    (dict(h=32), "sm90"),
    (dict(h=72), "triton"),  # not a multiple of 16: no wgmma swizzle tiles its rows
    (dict(h=40), "triton"),
])
def test_default_dispatch_on_hopper(fake_gpu, kw, want):
  fake_gpu((9, 0))
  q, k = _shapes(**kw)
  assert fa2_jax.backend_for(q, k, is_causal=True).backend == want
  assert fa2_jax.backend_for(q, k, is_causal=True, implementation="triton").backend == "triton"
  # interpret=True: the Pallas interpreter, which only the Triton kernels run in
  assert fa2_jax.backend_for(q, k, is_causal=True, interpret=True).backend == "triton"


def test_mosaic_refusal_names_the_reason(fake_gpu):
  fake_gpu((9, 0))
  q, k = _shapes(dtype=jnp.float32)
  with pytest.raises(ValueError, match="implementation='mosaic' cannot run this call: .*float32"):
    fa2_jax.backend_for(q, k, implementation="mosaic")
  q, k = _shapes(h=72)
  with pytest.raises(ValueError, match="implementation=.sm90. cannot run this call: .*multiples of 16"):
    fa2_jax.backend_for(q, k, implementation="sm90")


def test_block_sizes_type_selects_the_kernels(fake_gpu):
  fake_gpu((9, 0))
  q, k = _shapes()
  assert fa2_jax.backend_for(q, k, block_sizes=fa2_jax.BlockSizes()).backend == "triton"
  assert fa2_jax.backend_for(q, k, block_sizes=fa2_jax.MosaicConfig()).backend == "sm90"
  q32, k32 = _shapes(dtype=jnp.float32)
  with pytest.raises(ValueError, match="block_sizes is a MosaicConfig, which asks for the sm90 "
                     "kernels, and they cannot run this call: .*float32.*block_sizes=None"):
    fa2_jax.backend_for(q32, k32, block_sizes=fa2_jax.MosaicConfig())


@pytest.mark.skipif(on_gpu(), reason="CPU-only dispatch rule")
def test_cpu_runs_the_formula_or_the_interpreted_kernels():
  q, k = _shapes(t=64, s=64)
  d = fa2_jax.backend_for(q, k)
  assert d.backend == "xla" and d.forward == () and "interpret=True" in d.reason
  d = fa2_jax.backend_for(q, k, interpret=True)
  assert d.backend == "triton" and d.interpret
  assert fa2_jax.backend_for(q, k, implementation="xla").reason.startswith("implementation='xla'")


def test_backend_for_validates_like_flash_attention():
  q, k = _shapes(t=64, s=64)
  with pytest.raises(ValueError, match="implementation must be one of"):
    fa2_jax.backend_for(q, k, implementation="cuda")
  with pytest.raises(ValueError, match="multiple of the key/value head count"):
    fa2_jax.backend_for(*_shapes(n=6, kh=4))
  with pytest.raises(TypeError, match="is_causal must be a Python bool"):
    fa2_jax.backend_for(q, k, is_causal="yes")
  # every flash_attention argument is taken: return_residual is checked and changes nothing
  assert str(fa2_jax.backend_for(q, k, return_residual=True)) == str(fa2_jax.backend_for(q, k))
  with pytest.raises(TypeError, match="return_residual must be a Python bool"):
    fa2_jax.backend_for(q, k, return_residual="yes")
  with pytest.raises(TypeError, match=r"backend_for\(\) got unexpected keyword arguments \['foo'\]"):
    fa2_jax.backend_for(q, k, foo=1)


def test_backend_for_refuses_a_mosaic_config_that_cannot_run_the_call(fake_gpu):
  """As flash_attention does: a MosaicConfig whose tiles do not fit this call's SMEM (or head_dim)."""
  fake_gpu((9, 0))
  q, k = _shapes()
  too_big = fa2_jax.MosaicConfig(num_stages=6, block_k=256)
  with pytest.raises(ValueError, match="block_sizes: .*shared memory"):
    fa2_jax.backend_for(q, k, block_sizes=too_big)
  with pytest.raises(ValueError, match="block_sizes: "):
    fa2_jax.backend_for(*_shapes(h=64), block_sizes=fa2_jax.MosaicConfig.default(256))


def test_compute_capability_parsing(monkeypatch):
  class Dev:
    compute_capability = "9.0"

  monkeypatch.setattr(platform, "on_gpu", lambda: True)
  monkeypatch.setattr(jax, "devices", lambda: [Dev()])
  assert platform.gpu_compute_capability() == (9, 0) and platform.is_hopper()
  Dev.compute_capability = "10.0"
  assert platform.gpu_compute_capability() == (10, 0) and not platform.is_hopper()
  Dev.compute_capability = "12.0"
  assert not platform.is_hopper()
  Dev.compute_capability = "gfx942"  # not an NVIDIA capability: unknown, so not Hopper
  assert platform.gpu_compute_capability() is None and not platform.is_hopper()


def test_backend_for_takes_rank3_shape_dtype_structs(fake_gpu):
  """[T, N, H] inputs (no batch dim) as jax.ShapeDtypeStruct, as flash_attention takes arrays."""
  fake_gpu((9, 0))
  sd = jax.ShapeDtypeStruct
  d = fa2_jax.backend_for(sd((1024, 8, 128), jnp.bfloat16), sd((1024, 2, 128), jnp.bfloat16),
                          is_causal=True)
  assert d.backend == "sm90", d
  d = fa2_jax.backend_for(sd((64, 4, 16), jnp.float32), sd((48, 2, 16), jnp.float32),
                          interpret=True, local_window_size=(8, 0))
  assert d.backend == "triton", d


def test_backend_for_names_empty_and_symbolic_shapes(fake_gpu):
  """On a GPU, empty and symbolic shapes run the formula, and backend_for says why (not "no GPU")."""
  from jax import export
  fake_gpu((9, 0))
  q, k = _shapes(t=0)
  d = fa2_jax.backend_for(q, k)
  assert d.backend == "xla" and "empty" in d.reason
  (t,) = export.symbolic_shape("t")
  sym = jax.ShapeDtypeStruct((2, t, 8, 128), jnp.bfloat16)
  d = fa2_jax.backend_for(sym, sym)
  assert d.backend == "xla" and "symbolic" in d.reason
