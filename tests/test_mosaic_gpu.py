"""The Mosaic GPU (Hopper) backend under JAX's transformations, and the default-backend dispatch.

The transformation tests are ``gpu``-marked (the Mosaic kernels have no CPU interpret mode for wgmma):
each compares the transformed call against the plain call of the same kernel (a wrong batching,
sharding or replication rule gives different numbers, not a rounding difference) and the plain call
against the float32 formula. The dispatch tests run everywhere: they patch the device query so the
choice of ``implementation=None`` is checked on a CPU too.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from fa2_jax.kernels import platform
import fa2_jax


mosaic = functools.partial(fa2_jax.flash_attention, implementation="mosaic")
# bf16 kernels vs the f32 formula: outputs and grads are O(1); 3e-2 is a few bf16 ulps at 1.0
# (8 bits of mantissa: ulp = 2^-7 = 7.8e-3), far below what a wrong mask or head mapping changes.
ATOL = 3e-2
# Transformed vs plain call of the same kernel: only XLA's fusion of the small ops around it differs.
# Jitted twice the gradients are bitwise equal; eager against jitted they differ by up to 0.031 in
# dK (values above 2) and 0.012 at |dQ| = 0.125, as much with the Triton kernels (H100,
# docs/measurements.md#tests-and-ci-time): 2e-2, with 2e-2 relative, holds those and is a tenth of
# what a wrong batching or sharding rule moves.
SAME = 2e-2


def _qkv(b=2, t=384, s=512, n=4, kh=2, h=128, seed=0, lead=(), dtype=jnp.bfloat16):
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (*lead, b, t, n, h), jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], (*lead, b, s, kh, h), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (*lead, b, s, kh, h), jnp.float32).astype(dtype)
  return q, k, v


def _loss(fn, causal=True):
  return lambda q, k, v: jnp.sum(jnp.tanh(fn(q, k, v, is_causal=causal).astype(jnp.float32)))


@functools.partial(jax.jit, static_argnums=3)  # jitted: op-by-op GPU compiles made these tests slow
def _ref(q, k, v, causal=True):
  f32 = lambda x: x.astype(jnp.float32)
  return fa2_jax.reference_attention(f32(q), f32(k), f32(v), is_causal=causal)


def _close(a, b, atol):
  np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=atol,
                             rtol=atol)


@pytest.mark.gpu
def test_mosaic_jit_grad_and_jit_of_grad():
  q, k, v = _qkv()
  out = jax.jit(lambda a, b, c: mosaic(a, b, c, is_causal=True))(q, k, v)
  _close(out, _ref(q, k, v), ATOL)
  g_ref = jax.jit(jax.grad(_loss(lambda a, b, c, is_causal: _ref(a, b, c, is_causal)),
                          argnums=(0, 1, 2)))(q, k, v)
  g_eager = jax.grad(_loss(mosaic), argnums=(0, 1, 2))(q, k, v)
  g_jit = jax.jit(jax.grad(_loss(mosaic), argnums=(0, 1, 2)))(q, k, v)
  # under jax.checkpoint (rematerialised forward): the same kernels, the same gradients (the CPU
  # emulation cannot run this: the Pallas GPU interpreter's ordered effects have no remat rule)
  g_remat = jax.jit(jax.grad(jax.checkpoint(_loss(mosaic)), argnums=(0, 1, 2)))(q, k, v)
  for a, b, c, r in zip(g_eager, g_jit, g_remat, g_ref):
    _close(a, b, SAME)
    _close(a, c, SAME)
    _close(a, r, ATOL)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])  # non-causal head_dim 128: the fused-dQ default
def test_mosaic_vmap_and_shared_kv(causal):
  q, k, v = _qkv(lead=(3,), b=1, seed=1)
  f = lambda a, b, c: mosaic(a, b, c, is_causal=causal)
  out = jax.vmap(f)(q, k, v)
  for i in range(3):
    _close(out[i], f(q[i], k[i], v[i]), SAME)
  # in_axes=None on k/v: three query sets share one K/V; the gradient sums dK/dV over the axis.
  g = jax.grad(lambda a, b, c: jnp.sum(jnp.sin(jax.vmap(f, in_axes=(0, None, None))(a, b, c)
                                               .astype(jnp.float32))), argnums=(0, 1, 2))
  gq, gk, gv = g(q, k[0], v[0])
  gk_sum = sum(jax.grad(lambda a, b, c: jnp.sum(jnp.sin(f(a, b, c).astype(jnp.float32))),
                        argnums=(1,))(q[i], k[0], v[0])[0].astype(jnp.float32) for i in range(3))
  _close(gk, gk_sum, 3 * SAME)


@pytest.mark.gpu
def test_mosaic_pmap_over_local_gpus():
  nd = jax.local_device_count()
  q, k, v = _qkv(lead=(nd,), b=1, seed=2)
  g = jax.pmap(jax.grad(_loss(mosaic), argnums=(0, 1, 2)))(q, k, v)
  for d in range(nd):
    g1 = jax.grad(_loss(mosaic), argnums=(0, 1, 2))(q[d], k[d], v[d])
    for a, b in zip(g, g1):
      _close(a[d], b, SAME)


@pytest.mark.gpu
@pytest.mark.parametrize("check_vma", [True, False])
def test_mosaic_shard_map_over_batch(check_vma):
  nd = jax.local_device_count()
  mesh = jax.make_mesh((nd,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  q, k, v = _qkv(b=2 * nd, seed=3)
  spec = P("data", None, None, None)
  local = lambda a, b, c: jax.grad(_loss(mosaic), argnums=(0, 1, 2))(a, b, c)
  sharded = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec,) * 3,
                                  check_vma=check_vma))
  put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))
  g = sharded(put(q), put(k), put(v))
  g1 = local(q, k, v)
  for a, b in zip(g, g1):
    _close(a, b, SAME)


@pytest.mark.gpu
def test_mosaic_lse_cotangent_and_determinism():
  """return_residual: lse matches the formula, its cotangent reaches dq/dk/dv, reruns are bitwise."""
  q, k, v = _qkv(t=300, s=700, seed=4)

  def loss(fn):
    def f(a, b, c):
      out, lse = fn(a, b, c)
      return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(jnp.sin(lse))
    return f

  ours = lambda a, b, c: mosaic(a, b, c, is_causal=True, return_residual=True, deterministic=True)
  ref = lambda a, b, c: fa2_jax.reference_attention(
      a.astype(jnp.float32), b.astype(jnp.float32), c.astype(jnp.float32), is_causal=True,
      return_residual=True)
  _close(jax.jit(ours)(q, k, v)[1], jax.jit(ref)(q, k, v)[1], ATOL)
  grad = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))
  g1, g2 = grad(q, k, v), grad(q, k, v)
  g_ref = jax.jit(jax.grad(loss(ref), argnums=(0, 1, 2)))(q, k, v)
  for a, b, r in zip(g1, g2, g_ref):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    _close(a, r, 2 * ATOL)


@pytest.mark.gpu
@pytest.mark.parametrize("h,kh,budget", [(128, 6, 2_048_000), (64, 3, 1_100_000)])
def test_mosaic_causal_launch_orders_agree_bitwise(monkeypatch, h, kh, budget):
  """The causal launch order only changes which CTA runs when, not what it computes: with the L2
  sections forced small (several sections, the last one smaller) forward and deterministic backward
  are bit-identical to the per-head order, and match the formula."""
  from fa2_jax.kernels.sm90 import schedule as common
  b, t, n = 3, 1000, 6
  monkeypatch.setattr(common, "L2_SECTION_BYTES", budget)
  q, k, v = _qkv(b=b, t=t, s=t, n=n, kh=kh, h=h, seed=11)
  cfg = fa2_jax.MosaicConfig.default(h, q.dtype, True)
  assert cfg.lpt_heads == 0
  cfg = cfg.replace(lpt_heads_dkv=0)  # the L2 sections in the dK/dV kernel too
  g, per_head = n // kh, 2 * t * h * 2  # K+V or Q+dO of one head, bf16
  assert 1 < common.causal_section(cfg, n_bh=b * n, group=g, kv_bytes=per_head) < b * n  # fwd, dQ
  assert 1 < common.causal_section(cfg, n_bh=b * kh, group=1, kv_bytes=per_head * g, dkv=True) < b * kh

  def run(lpt_heads):
    c = cfg.replace(lpt_heads=lpt_heads, lpt_heads_dkv=lpt_heads)
    f = lambda a, b_, c_: mosaic(a, b_, c_, is_causal=True, block_sizes=c, deterministic=True)
    out = jax.jit(f)(q, k, v)
    grads = jax.jit(jax.grad(lambda a, b_, c_: jnp.sum(jnp.tanh(f(a, b_, c_).astype(jnp.float32))),
                             argnums=(0, 1, 2)))(q, k, v)
    return (out, *grads)

  l2, head = run(0), run(1)
  for a, r, name in zip(l2, head, ("out", "dq", "dk", "dv")):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(r, np.float32), err_msg=name)
  ref = jax.jit(lambda a, b_, c_: fa2_jax.reference_attention(
      a.astype(jnp.float32), b_.astype(jnp.float32), c_.astype(jnp.float32), is_causal=True))(q, k, v)
  _close(l2[0], ref, ATOL)


@pytest.mark.gpu
@pytest.mark.parametrize("causal, ctas, variant, t, s", [
    (False, 0, False, 1000, 777),  # the default: one CTA per SM (here fewer tiles than SMs: one round)
    (False, 5, False, 1000, 777),  # 5 CTAs for 128 tiles: 26 rounds, the last partial
    (True, 7, False, 1000, 777),  # causal, the LPT order dealt cyclically (opt-in) over 7 CTAs
    (True, -7, False, 1000, 777),  # the same with the greedy deal (schedule.greedy_deal)
    (False, 6, True, 1000, 777),  # packed documents, padding lengths and a soft cap: uneven key ranges
    (True, None, False, 4000, 4000),  # the defaults: 512 causal tiles dealt greedily to 132 CTAs
])
def test_mosaic_persistent_forward_matches_one_cta_per_tile(causal, ctas, variant, t, s):
  """The persistent forward (MosaicConfig.persistent) only changes which CTA runs a query tile and
  where its K/V ring slots start, not what the tile computes: output and lse are bit-identical to
  the one-CTA-per-tile launch, and match the formula."""
  b, n, kh, h = 2, 8, 2, 128
  q, k, v = _qkv(b=b, t=t, s=s, n=n, kh=kh, h=h, seed=5)
  kwargs = dict(is_causal=causal)
  if variant:
    q_seg = jnp.repeat(jnp.arange(4), 250)  # 4 documents of 250 queries
    kv_seg = jnp.concatenate([jnp.repeat(jnp.arange(4), 190), jnp.full((17,), 3)])  # 190 keys each
    kwargs.update(q_segment_ids=jnp.tile(q_seg, (b, 1)), kv_segment_ids=jnp.tile(kv_seg, (b, 1)),
                  key_value_seq_lengths=jnp.array([777, 500]), logits_soft_cap=30.0)
  default = fa2_jax.MosaicConfig.default(h, q.dtype, causal)
  one = default.replace(persistent=False)
  if ctas is None:  # the defaults as they are
    assert default.deals_greedily(is_causal=causal, known_work=not variant)
    many = default
  else:
    deal = "greedy" if ctas < 0 else "cyclic"
    many = one.replace(persistent=True, persistent_ctas=abs(ctas), persistent_deal=deal)

  def run(cfg):
    return jax.jit(lambda a, b_, c_: mosaic(a, b_, c_, block_sizes=cfg, return_residual=True,
                                           **kwargs))(q, k, v)

  (o1, l1), (o2, l2) = run(one), run(many)
  np.testing.assert_array_equal(np.asarray(o2, np.float32), np.asarray(o1, np.float32))
  np.testing.assert_array_equal(np.asarray(l2), np.asarray(l1))
  f32 = lambda x: x.astype(jnp.float32)
  ref = jax.jit(lambda a, b_, c_: fa2_jax.reference_attention(f32(a), f32(b_), f32(c_), **kwargs))(
      q, k, v)
  _close(o2, ref, ATOL)


@pytest.mark.gpu
def test_default_implementation_picks_mosaic_on_hopper():
  if not platform.is_hopper():
    pytest.skip("not a Hopper GPU: the default is the Triton backend there (tests/test_dispatch.py)")
  q, k, v = _qkv(seed=5)
  assert fa2_jax.backend_for(q, k, is_causal=True).backend == "sm90"
  # None gives the same numbers as the backend it chose.
  chosen = fa2_jax.backend_for(q, k, is_causal=True).backend
  _close(fa2_jax.flash_attention(q, k, v, is_causal=True),
         fa2_jax.flash_attention(q, k, v, is_causal=True, implementation=chosen), 0.0)


@pytest.mark.gpu
def test_mosaic_with_x64_enabled():
  q, k, v = _qkv(t=200, s=300, seed=6)
  g = jax.grad(_loss(mosaic), argnums=(0, 1, 2))(q, k, v)
  with jax.enable_x64(True):
    g64 = jax.grad(_loss(mosaic), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(g, g64):
    _close(a, b, SAME)


# --- dispatch, checked on any platform by patching the device query ---------------------------------

@pytest.fixture
def fake_hopper(monkeypatch):
  monkeypatch.setattr(platform, "on_gpu", lambda: True)
  monkeypatch.setattr(platform, "gpu_compute_capability", lambda: (9, 0))


def _shapes(t=1024, s=1024, n=8, kh=2, h=128, dtype=jnp.bfloat16):
  return (jax.ShapeDtypeStruct((2, t, n, h), dtype), jax.ShapeDtypeStruct((2, s, kh, h), dtype))


# --- shard_map with check_vma=True (its default): output types, checked by tracing on any platform ---

@pytest.mark.parametrize("impl", ["mosaic", "triton"])
@pytest.mark.parametrize("kv_replicated", [False, True])
@pytest.mark.parametrize("causal", [True, False])  # Mosaic non-causal: the fused-dQ dK/dV kernel
def test_shard_map_check_vma_types(fake_hopper, impl, kv_replicated, causal):
  """Forward and gradients trace under shard_map(check_vma=True): every kernel output is typed as
  varying like its inputs. With K/V replicated (not varying) and Q sharded, the dispatcher casts K/V
  to varying, so their gradients come back summed over the mesh by the cast's transpose."""
  nd = len(jax.devices())
  mesh = jax.make_mesh((nd,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  qs = P("data", None, None, None)
  ks = P(None, None, None, None) if kv_replicated else qs

  def local(a, b, c):
    f = lambda a, b, c: jnp.sum(fa2_jax.flash_attention(a, b, c, is_causal=causal,
                                                         implementation=impl).astype(jnp.float32))
    return jax.value_and_grad(f, argnums=(0, 1, 2))(a, b, c)

  q = jax.ShapeDtypeStruct((2 * nd, 256, 4, 128), jnp.bfloat16, sharding=NamedSharding(mesh, qs))
  kb = 2 if kv_replicated else 2 * nd  # replicated: every device's 2 query rows use the same K/V
  k = jax.ShapeDtypeStruct((kb, 256, 2, 128), jnp.bfloat16, sharding=NamedSharding(mesh, ks))
  sm = jax.shard_map(lambda a, b, c: _psum_loss(local(a, b, c)), mesh=mesh, in_specs=(qs, ks, ks),
                     out_specs=(P(), (qs, ks, ks)), check_vma=True)
  traced = jax.jit(sm).trace(q, k, k)
  if impl == "mosaic":  # Mosaic lowers without a GPU: check the lowering too
    traced.lower(lowering_platforms=("cuda",))


def _psum_loss(res):
  loss, grads = res
  return jax.lax.psum(loss, "data"), grads


def _backward_operands(seed, t, s, n, kh, h, causal):
  """``(q, k, v, out, stats, do)`` of the Mosaic backward for random bf16 inputs (B=2), and the
  scale: the forward compiled once, the backward's configurations compared on the same operands."""
  from fa2_jax.kernels.sm90.forward import forward
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (2, t, n, h), jnp.float32).astype(jnp.bfloat16)
  k = jax.random.normal(ks[1], (2, s, kh, h), jnp.float32).astype(jnp.bfloat16)
  v = jax.random.normal(ks[2], (2, s, kh, h), jnp.float32).astype(jnp.bfloat16)
  do = jax.random.normal(ks[3], (2, t, n, h), jnp.float32).astype(jnp.bfloat16)
  scale = h ** -0.5
  out, stats = jax.jit(lambda q, k, v: forward(q, k, v, scale=scale, is_causal=causal))(q, k, v)
  return (q, k, v, out, stats, do), scale


def _formula_grads(operands, scale, causal):
  """dq, dk, dv of the float32 formula for :func:`_backward_operands`'s operands."""
  q, k, v, _, _, do = operands

  @jax.jit
  def grads(q, k, v, do):
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    attn = lambda a, b_, c_: fa2_jax.reference_attention(a, b_, c_, scale=scale,  # noqa: E731
                                                         is_causal=causal)
    return jax.vjp(attn, f32(q), f32(k), f32(v))[1](f32(do))

  return grads(q, k, v, do)


@pytest.mark.gpu
@pytest.mark.parametrize("h, causal, t, s, n, kh, bq_dkv", [
    (128, True, 1000, 777, 4, 2, None),  # dq_split "cols"
    (64, False, 512, 1024, 8, 8, None),  # "rows" (128-row dK/dV tiles)
    (128, False, 2048, 2048, 8, 1, None),
    (64, True, 300, 300, 4, 2, 64)])  # no split: one partial per consumer
def test_mosaic_fused_dq_matches_separate_pass(h, causal, t, s, n, kh, bq_dkv):
  """The fused dQ (TMA reduce-add in the dK/dV kernel) against the separate dQ kernel."""
  from fa2_jax.kernels.sm90.backward import backward
  from fa2_jax.kernels.sm90.config import MosaicConfig
  operands, scale = _backward_operands(7, t, s, n, kh, h, causal)
  base = MosaicConfig.default(h)
  fused = base.replace(dq_fused=True, dq_fused_min_t=0, num_stages_dkv=min(base.num_stages_dkv, 2),
                       block_q_dkv=bq_dkv or base.block_q_dkv)
  bwd = lambda cfg, det: jax.jit(lambda *a: backward(*a, scale=scale, is_causal=causal,
                                                     config=cfg, deterministic=det))
  ref = bwd(base, True)(*operands)
  got = bwd(fused, False)(*operands)
  for a, b in zip(got, ref):
    _close(a, b, SAME)


@pytest.mark.gpu
@pytest.mark.parametrize("h, causal, t, s, n, kh, dq_roles", [
    (256, True, 1000, 777, 4, 2, False), (256, False, 2048, 2048, 4, 4, False),
    (192, True, 300, 520, 3, 1, False),  # GQA 3:1: the group split over 3 CTAs
    (256, True, 1000, 777, 4, 2, True),
    (256, False, 300, 520, 4, 1, True)])
def test_mosaic_dkdv_roles_matches_formula(h, causal, t, s, n, kh, dq_roles):
  """The role-split dK/dV kernel (``dkv_roles``, P^T handed between the warpgroups in f32) against
  the float32 formula's gradients; with ``dq_roles`` the role-split dQ kernel against the
  one-warpgroup dQ kernel too. (Until they were removed, the reference was the dV and dK passes of
  ``dkv_split``: docs/removed-experiments.md.)"""
  from fa2_jax.kernels.sm90.backward import backward
  from fa2_jax.kernels.sm90.config import MosaicConfig
  operands, scale = _backward_operands(11, t, s, n, kh, h, causal)
  roles = MosaicConfig.default(h).replace(dkv_roles=True, dq_roles=dq_roles)
  bwd = lambda cfg: jax.jit(lambda *a: backward(*a, scale=scale, is_causal=causal, config=cfg))
  got = bwd(roles)(*operands)
  ref = _formula_grads(operands, scale, causal)
  for a, b in zip(got, ref):
    _close(a, b, 2 * ATOL)
  if dq_roles:  # the role-split dQ kernel against the one-warpgroup dQ kernel
    one = bwd(roles.replace(dq_roles=False))(*operands)
    _close(got[0], one[0], SAME)


@pytest.mark.gpu
@pytest.mark.parametrize("h, causal, fused, r", [
    (128, True, False, 2), (128, True, True, 3), (256, False, False, 3),
    (64, True, False, None)])  # None: group_split's own choice (one head per CTA on this small grid)
def test_mosaic_split_group_matches_formula(monkeypatch, h, causal, fused, r):
  """GQA groups of 6 over two KV heads, each group's dK/dV split over r CTAs that read their KV head
  (split c: head c // r) from the un-copied K/V, the r partials summed: against the float32
  formula's gradients (a wrong head mapping gives the other head's gradients, far outside ATOL)."""
  from fa2_jax.kernels.sm90 import backward as sm90_backward
  from fa2_jax.kernels.sm90.config import MosaicConfig
  if r is not None:
    monkeypatch.setattr(sm90_backward, "group_split", lambda *a: r)
  operands, scale = _backward_operands(13, 1000, 777, 12, 2, h, causal)
  cfg = MosaicConfig.default(h, is_causal=causal)
  if fused:
    cfg = cfg.replace(dq_fused=True, dq_fused_min_t=0)
  got = jax.jit(lambda *a: sm90_backward.backward(*a, scale=scale, is_causal=causal, config=cfg,
                                                  deterministic=not fused))(*operands)
  for a, b in zip(got, _formula_grads(operands, scale, causal)):
    _close(a, b, 2 * ATOL)


@pytest.mark.gpu
@pytest.mark.parametrize("h", [16, 48, 80, 96, 112, 144, 160, 176, 208])
@pytest.mark.parametrize("causal, t, s, deterministic", [(True, 1000, 777, True),
                                                         (False, 2048, 2048, False)])
def test_mosaic_head_dims_of_the_narrower_swizzles(h, causal, t, s, deterministic):
  """Every multiple of 16 runs on the Hopper kernels, tiled by the widest swizzle its rows fill
  (ops.smem_transforms: 32 bytes at 16/48/80/112/144/176/208, 64 at 96/160; 144-176 with the
  128-key forward tiles, 176 filling SMEM to 221 KiB): forward and gradients against
  the float32 formula within twice the error of the formula computed in bf16 (test_fuzz's budget)."""
  from test_fuzz import xla_formula
  assert fa2_jax.backend_for(*_qkv(1, t, s, 8, 2, h), is_causal=causal).backend == "sm90"
  q, k, v = _qkv(1, t, s, 8, 2, h, seed=h)
  do = jax.random.normal(jax.random.key(h + 1), q.shape, jnp.float32).astype(q.dtype)
  scale = h ** -0.5
  f32 = lambda x: x.astype(jnp.float32)

  @functools.partial(jax.jit, static_argnums=0)
  def values_and_grads(impl, q, k, v, do):
    if impl == "mosaic":
      f = lambda q, k, v: fa2_jax.flash_attention(q, k, v, is_causal=causal, implementation="mosaic",
                                                  deterministic=deterministic)
    else:  # the formula in the inputs' dtype
      f = lambda q, k, v: xla_formula(q, k, v, scale, causal)[0]
    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(do.astype(out.dtype)))

  got = values_and_grads("mosaic", q, k, v, do)
  budget = values_and_grads("formula", q, k, v, do)
  ref = values_and_grads("formula", f32(q), f32(k), f32(v), do)
  rel = lambda a, b: float(jnp.linalg.norm(f32(a) - f32(b)) / jnp.linalg.norm(f32(b)))
  for name, a, c, r in zip(("out", "dq", "dk", "dv"), got, budget, ref):
    assert rel(a, r) <= 2 * rel(c, r), (name, rel(a, r), rel(c, r))


# --- block_sizes=MosaicConfig: the Mosaic kernels' tiles through the public API ---------------------

def test_block_sizes_type_must_match_implementation():
  q, k = jnp.zeros((1, 64, 2, 64), jnp.bfloat16), jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
  with pytest.raises(TypeError, match="MosaicConfig, which configures the sm90 kernels; "
                     "implementation='triton' takes a fa2_jax.BlockSizes"):
    fa2_jax.flash_attention(q, k, k, implementation="triton", interpret=True,
                            block_sizes=fa2_jax.MosaicConfig())
  with pytest.raises(TypeError, match="BlockSizes, which configures the triton kernels"):
    fa2_jax.flash_attention(q, k, k, implementation="mosaic", block_sizes=fa2_jax.BlockSizes())
  with pytest.raises(TypeError, match=r"block_sizes must be a .*fa2_jax.MosaicConfig .*BlockSizes"):
    fa2_jax.flash_attention(q, k, k, block_sizes=dict(block_q=64))


def test_mosaic_config_too_big_for_head_dim_names_block_sizes(fake_hopper):
  q = jnp.zeros((1, 128, 2, 256), jnp.bfloat16)
  cfg = fa2_jax.MosaicConfig(block_k=256, num_stages=4)
  with pytest.raises(ValueError, match="block_sizes: MosaicConfig forward kernel needs"):
    fa2_jax.flash_attention(q, q, q, block_sizes=cfg)


@pytest.mark.parametrize("deterministic, kernels", [(False, {"forward", "dkdv_dq"}),
                                                    (True, {"forward", "dkdv", "dq"})])
def test_mosaic_config_reaches_the_kernels(fake_hopper, deterministic, kernels):
  """block_sizes=MosaicConfig(dq_fused=True): the fused-dQ dK/dV kernel replaces the dQ kernel
  unless deterministic=True (checked in the sm90 lowering of grad)."""
  import re
  cfg = fa2_jax.MosaicConfig.default(128).replace(dq_fused=True, dq_fused_min_t=0)
  sd = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
  loss = lambda q, k, v: jnp.sum(fa2_jax.flash_attention(
      q, k, v, is_causal=True, block_sizes=cfg, deterministic=deterministic).astype(jnp.float32))
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(sd, sd, sd).lower(
      lowering_platforms=("cuda",)).as_text()
  assert set(re.findall(r"fa2_mosaic_(forward|dkdv_dq|dkdv_roles|dkdv|dq)_mosaic_gpu", text)) == kernels


@pytest.mark.parametrize("h, t, causal, deterministic, kernels", [
    (128, 2048, False, False, {"forward", "dkdv_dq"}),  # the default: fused dQ from 2k rows non-causal
    (64, 2048, False, False, {"forward", "dkdv_dq"}),
    (128, 6144, True, False, {"forward", "dkdv_dq"}),  # and from 5k rows causal (head_dim 128)
    (128, 4096, True, False, {"forward", "dkdv", "dq"}),
    (64, 4096, True, False, {"forward", "dkdv_dq"}),  # head_dim 64: from 4k rows causal
    (128, 2048, True, False, {"forward", "dkdv", "dq"}),  # fewer rows: the separate dQ kernel
    (128, 256, False, False, {"forward", "dkdv", "dq"}),
    (128, 4096, False, True, {"forward", "dkdv", "dq"}),  # deterministic: the separate dQ kernel
    (256, 4096, False, False, {"forward", "dkdv_roles", "dq_roles"})])  # head_dim 256: no fusion
def test_default_backward_kernels(fake_hopper, h, t, causal, deterministic, kernels):
  """Which backward kernels implementation=None runs on Hopper (sm90 lowering of grad)."""
  import re
  sd = jax.ShapeDtypeStruct((1, t, 4, h), jnp.bfloat16)
  loss = lambda q, k, v: jnp.sum(fa2_jax.flash_attention(
      q, k, v, is_causal=causal, deterministic=deterministic).astype(jnp.float32))
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(sd, sd, sd).lower(
      lowering_platforms=("cuda",)).as_text()
  assert set(re.findall(r"fa2_mosaic_(forward|dkdv_dq|dkdv_roles|dkdv|dq_roles|dq|dv|dk)_mosaic_gpu", text)) == kernels


@pytest.mark.parametrize("kv_axes", [0, None])
def test_vmap_of_grad_lowers_with_fused_dq(fake_hopper, kv_axes):
  """vmap(grad) of a non-causal call with the fused dQ lowers for sm90 (the fused kernel's
  run_state needs the custom_vmap that folds the vmapped axis into the batch)."""
  import re
  cfg = fa2_jax.MosaicConfig.default(128).replace(dq_fused_min_t=0)
  loss = lambda q, k, v: jnp.sum(fa2_jax.flash_attention(q, k, v, block_sizes=cfg).astype(jnp.float32))
  g = jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=(0, kv_axes, kv_axes))
  qs = jax.ShapeDtypeStruct((3, 2, 256, 4, 128), jnp.bfloat16)
  kvs = qs if kv_axes == 0 else jax.ShapeDtypeStruct((2, 256, 4, 128), jnp.bfloat16)
  traced = jax.jit(g).trace(qs, kvs, kvs)
  dq, dk, dv = traced.out_info
  assert dq.shape == dk.shape == dv.shape == (3, 2, 256, 4, 128)  # per-element gradients
  text = traced.lower(lowering_platforms=("cuda",)).as_text()
  assert set(re.findall(r"fa2_mosaic_(forward|dkdv_dq|dkdv|dq)_mosaic_gpu", text)) == {
      "forward", "dkdv_dq"}


@pytest.mark.gpu
@pytest.mark.parametrize("causal, t", [(True, 5120), (False, 2048), (True, 1000)])
def test_kernel_reuse_across_programs_compiled(causal, t):
  """``reuse_kernels_across_programs``: the exported kernels, called from two programs and under
  vmap, give the results of the kernels lowered in place (fused dQ at 5k causal and 2k non-causal,
  the separate dQ kernel at 1000 rows), and the second program finds them compiled."""
  from fa2_jax.kernels.sm90 import lowering_cache
  if not platform.is_hopper():
    pytest.skip("the Mosaic kernels run on Hopper (sm90) only")
  q, k, v = _qkv(b=2, t=t, s=t, n=4, kh=2)
  # fresh functions on each side of the switch: jit's trace cache would keep the other lowering
  grad = lambda: jax.grad(_loss(mosaic, causal), argnums=(0, 1, 2))  # noqa: E731
  fwd = lambda a, b, c: mosaic(a, b, c, is_causal=causal)  # noqa: E731
  ref_out = jax.jit(fwd)(q, k, v)
  ref_grads = jax.jit(grad())(q, k, v)
  previous = fa2_jax.reuse_kernels_across_programs(True)
  lowering_cache.clear()
  try:
    grads = jax.jit(grad())(q, k, v)
    assert lowering_cache.info()["misses"] > 0
    # each new kernel compiled in the background, and none failed (kernels/sm90/lowering_cache.py)
    # (a kernel whose compiled file an earlier test left in the default folder is loaded instead)
    assert (lowering_cache.info()["compiles"] + lowering_cache.info()["compiled_reads"]
            == lowering_cache.info()["misses"])
    assert lowering_cache.info()["compile_errors"] == 0
    exports = lowering_cache.info()["misses"]
    out = jax.jit(lambda a, b, c: fwd(a, b, c) * 1)(q, k, v)  # another program: reuses the forward
    assert lowering_cache.info()["misses"] == exports
    mapped = jax.jit(jax.vmap(lambda a, b, c: fwd(a, b, c)))(
        q[:, None], k[:, None], v[:, None])[:, 0]
  finally:
    fa2_jax.reuse_kernels_across_programs(previous)
    lowering_cache.clear()
  _close(out, ref_out, SAME)
  _close(mapped, ref_out, SAME)
  for g, r in zip(grads, ref_grads):
    _close(g, r, SAME)


@pytest.mark.gpu
def test_kernel_reuse_with_length_multiple_compiled():
  """``length_multiple=1024``: 900 and 1000 rows run the same padded kernels (no new export for the
  second), with the unpadded calls' outputs and gradients, causal with GQA and T != S."""
  from fa2_jax.kernels.sm90 import lowering_cache
  if not platform.is_hopper():
    pytest.skip("the Mosaic kernels run on Hopper (sm90) only")
  grad = jax.jit(jax.grad(_loss(mosaic, True), argnums=(0, 1, 2)))
  cases = [_qkv(b=2, t=t, s=t + 20, n=4, kh=2, seed=t) for t in (1000, 900)]  # both pad to 1024
  refs = [grad(*qkv) for qkv in cases]
  previous = fa2_jax.reuse_kernels_across_programs(True, length_multiple=1024)
  lowering_cache.clear()
  try:  # fresh functions (_loss returns a new one): jit's trace cache would keep the other lowering
    got = [jax.jit(jax.grad(_loss(mosaic, True), argnums=(0, 1, 2)))(*cases[0])]
    exports = lowering_cache.info()["misses"]
    assert exports > 0
    got.append(jax.jit(jax.grad(_loss(mosaic, True), argnums=(0, 1, 2)))(*cases[1]))
    assert lowering_cache.info()["misses"] == exports
  finally:
    fa2_jax.reuse_kernels_across_programs(previous)
    lowering_cache.clear()
  for g, r in zip(got, refs):
    for a, b in zip(g, r):
      _close(a, b, SAME)


@pytest.mark.gpu
def test_kernel_reuse_cache_dir_compiled(tmp_path):
  """``cache_dir``: the kernels one program writes, and their compiled forms, read back after the
  process's own exports are dropped (as a new process would; no kernel compiles again), run compiled
  with the results of the kernels lowered in place (causal 4k)."""
  from fa2_jax.kernels.sm90 import lowering_cache
  if not platform.is_hopper():
    pytest.skip("the Mosaic kernels run on Hopper (sm90) only")
  grad = lambda: jax.jit(jax.grad(_loss(mosaic, True), argnums=(0, 1, 2)))  # noqa: E731
  q, k, v = _qkv(b=2, t=4096, s=4096, n=4, kh=2)
  ref = grad()(q, k, v)
  previous = fa2_jax.reuse_kernels_across_programs(True, cache_dir=tmp_path)
  lowering_cache.clear()
  try:
    first = grad()(q, k, v)
    lowering_cache.wait_for_compiles()
    written = lowering_cache.info()["writes"]
    assert written > 0 and lowering_cache.info()["compiled_writes"] == written
    lowering_cache.clear()
    second = grad()(q, k, v)
    assert lowering_cache.info()["reads"] == written and lowering_cache.info()["writes"] == 0
    assert lowering_cache.info()["compiled_reads"] == written
    assert lowering_cache.info()["compiles"] == 0
  finally:
    fa2_jax.reuse_kernels_across_programs(previous)
    lowering_cache.clear()
  for got in (first, second):
    for a, b in zip(got, ref):
      _close(a, b, SAME)
