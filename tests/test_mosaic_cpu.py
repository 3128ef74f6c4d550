"""CPU-side tests of the Mosaic GPU (Hopper) backend, ``fa2_jax.kernels.sm90``.

No GPU needed:

* ``supports()`` and ``MosaicConfig`` validation / shared-memory budget;
* the causal block ranges (``kv_block_ranges`` / ``q_block_ranges``) brute-forced against
  ``fa2_jax.kernels.masking.allowed``;
* ``plan_lengths`` / ``pad_axis``;
* lowering of forward + backward for sm90 (Pallas -> Mosaic GPU, layout inference, no execution);
* numerics of forward + backward in Pallas GPU interpret mode with emulated wgmma (``ops.emulated_mma``),
  against ``fa2_jax.reference_attention``. The interpreter's ``detect_races`` stays off (the kernel
  author's advice: it is very slow and not what these tests check).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa2_jax
from fa2_jax.kernels.sm90.backward import backward, backward_tiles, group_split
from fa2_jax.kernels.sm90.config import (SMEM_BYTES, SMEM_RESERVE, MosaicConfig, o_rows_in_q,
                                          register_pool, supports)
from fa2_jax.kernels.sm90.forward import forward
from fa2_jax.kernels.sm90.lengths import pad_axis, plan_lengths
from fa2_jax.kernels.sm90.schedule import (causal_section, kv_block_ranges, launch_tile, lpt_tile,
                                             q_block_ranges, section_heads)
from fa2_jax.kernels.sm90.ops import emulated_mma, emulating
from fa2_jax.kernels.softmax import lse_from_stats
from fa2_jax.kernels.masking import alibi_lse_shift, allowed

BF16 = jnp.bfloat16


# --- supports() ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("q_shape,k_shape,dtype,h,causal", [
    ((2, 256, 4, 64), (2, 256, 4, 64), jnp.bfloat16, 64, False),
    ((1, 1000, 8, 128), (1, 777, 2, 128), jnp.float16, 128, True),  # ragged, GQA, causal
    ((1, 1, 4, 192), (1, 3, 1, 192), jnp.bfloat16, 192, True),  # tiny, MQA
    ((3, 300, 2, 256), (3, 100, 2, 256), "bfloat16", 256, False),  # dtype given by name
    # head_dims tiled by the narrower swizzles: 64 bytes (96, 160), 32 bytes (16, 80, 112)
    ((1, 500, 8, 96), (1, 500, 2, 96), jnp.bfloat16, 96, True),
    ((1, 500, 8, 80), (1, 300, 8, 80), jnp.bfloat16, 80, False),
    ((2, 64, 4, 112), (2, 64, 1, 112), jnp.float16, 112, True),
    ((1, 128, 2, 16), (1, 128, 2, 16), jnp.bfloat16, 16, False),
    ((1, 128, 2, 160), (1, 128, 2, 160), jnp.bfloat16, 160, True),
])
def test_supports_accepts(q_shape, k_shape, dtype, h, causal):
  assert supports(q_shape, k_shape, dtype, h, causal) is None


@pytest.mark.parametrize("q_shape,k_shape,dtype,h,words", [
    ((2, 256, 4, 64), (2, 256, 4, 64), jnp.float32, 64, ("bfloat16", "float16", "float32")),
    ((2, 256, 4, 72), (2, 256, 4, 72), jnp.bfloat16, 72, ("head_dim", "multiples of 16", "72")),
    ((2, 256, 4, 8), (2, 256, 4, 8), jnp.bfloat16, 8, ("head_dim", "8")),
    ((2, 256, 4, 272), (2, 256, 4, 272), jnp.bfloat16, 272, ("up to 256", "272")),
    ((2, 256, 6, 64), (2, 256, 4, 64), jnp.bfloat16, 64, ("N=6", "K=4", "multiple")),
    ((2, 256, 4, 64), (3, 256, 4, 64), jnp.bfloat16, 64, ("batch mismatch", "2", "3")),
    ((2, 256, 4, 128), (2, 256, 4, 128), jnp.bfloat16, 64, ("head_dim 64", "does not match")),
    ((2, 0, 4, 64), (2, 256, 4, 64), jnp.bfloat16, 64, ("empty",)),
    ((2, 256, 64), (2, 256, 64), jnp.bfloat16, 64, ("rank-4",)),
])
def test_supports_rejects(q_shape, k_shape, dtype, h, words):
  for causal in (False, True):
    why = supports(q_shape, k_shape, dtype, h, causal)
    assert isinstance(why, str) and why, (q_shape, k_shape, dtype, h, causal)
    for w in words:
      assert w in why, (w, why)


def test_backend_accepts_a_value_head_dim_of_its_own(monkeypatch):
  """What dispatch asks the family: a value head_dim Hv != H (multi-head latent attention,
  DeepSeek-V2's 192 / 128) runs on Hopper, V/O/dO/dV tiled by their own width; the defaults are the
  wider width's (forward key tiles as SMEM allows), without the role-split dQ kernel; an Hv no
  swizzle tiles is refused."""
  from fa2_jax.kernels import platform
  from fa2_jax.kernels.backend import KernelCall
  from fa2_jax.kernels.masking import Variant
  from fa2_jax.kernels.sm90.backend import SM90
  monkeypatch.setattr(platform, "gpu_compute_capability", lambda: (9, 0))
  call = KernelCall((2, 1024, 8, 192), (2, 1024, 8, 192), jnp.dtype(BF16), True,
                    Variant(is_causal=True))
  mla = dataclasses.replace(call, value_head_dim=128)
  assert mla.v_shape == (2, 1024, 8, 128) and SM90.supports(mla) is None
  # the wider width's settings, but the forward's 128-key tiles that O staged in Q's bytes lets fit
  assert SM90.default_config(mla) == MosaicConfig.default(192, BF16, True).replace(
      block_k=128, persistent=True, persistent_deal="greedy")
  assert not MosaicConfig.default(256, value_head_dim=128).dq_roles
  # the 128 tiles; dQ (64 columns) does not split between the consumers: not fused
  assert MosaicConfig.default(64, value_head_dim=128) == MosaicConfig.default(96)
  assert "value head_dim: " in SM90.supports(dataclasses.replace(call, value_head_dim=72))
  assert "value head_dim" in MosaicConfig.default(256).check(256, 2, 128)  # dq_roles


@pytest.mark.parametrize("h, hv, fused", [(64, 32, True), (32, 64, False), (192, 128, False)])
def test_interpret_value_head_dim_of_its_own(h, hv, fused):
  """Forward and gradients with V/O/dO/dV tiles of their own width (Q/K tiles of H's), in emulated
  interpret mode against the float32 formula: the fused-dQ dK/dV kernel (64/32), the dK/dV and dQ
  kernels with V wider than Q (32/64), the role-split dK/dV kernel with its own dK/dV staging tiles
  and the one-warpgroup dQ kernel (192/128, DeepSeek-V2's)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  b, t, s, n, kh = 1, 136, 200, 2, 1
  ks = jax.random.split(jax.random.key(h + hv), 4)
  q = jax.random.normal(ks[0], (b, t, n, h), jnp.float32).astype(BF16)
  k = jax.random.normal(ks[1], (b, s, kh, h), jnp.float32).astype(BF16)
  v = jax.random.normal(ks[2], (b, s, kh, hv), jnp.float32).astype(BF16)
  do = jax.random.normal(ks[3], (b, t, n, hv), jnp.float32).astype(BF16)
  scale = h ** -0.5
  cfg = MosaicConfig.default(h, BF16, True, value_head_dim=hv)
  if fused:
    cfg = cfg.replace(dq_fused=True, dq_fused_min_t=0, dq_fused_variants=True)

  def f(q, k, v, do):
    out, stats = forward(q, k, v, scale=scale, is_causal=True, config=cfg)
    return (out, *backward(q, k, v, out, stats, do, scale=scale, is_causal=True, config=cfg,
                           deterministic=not fused))

  with emulated_mma(), plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
    got = jax.block_until_ready(jax.jit(f)(q, k, v, do))
  ref = lambda q, k, v: fa2_jax.reference_attention(q, k, v, scale=scale, is_causal=True)  # noqa: E731
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  want, vjp = jax.vjp(ref, f32(q), f32(k), f32(v))
  for name, x, r in zip(("out", "dq", "dk", "dv"), got, (want, *vjp(f32(do)))):
    assert x.shape == r.shape, (name, x.shape, r.shape)
    assert _rel(x, r) < 1e-2, (name, _rel(x, r))


# --- MosaicConfig -------------------------------------------------------------------------------------

@pytest.mark.parametrize("h", range(16, 257, 16))
def test_default_configs_fit(h):
  cfg = MosaicConfig.default(h)
  assert cfg.check(h) is None
  assert cfg.dkv_roles == (h > 128) and cfg.dq_roles == (h == 256)
  for nwg in (1, 2):
    # the CTA's register pool (kernels/sm90/config.register_pool): producer WG + consumers fit
    assert 128 * (nwg * cfg.registers(nwg) + cfg.memory_registers) <= register_pool(128 * (nwg + 1))


def test_smem_budget_matches_docstring():
  # default(128) forward: 2 x 2 x 32 KiB of K/V + 32 KiB of Q (+ 2 x 2 x 64 f32 row statistics).
  assert MosaicConfig.default(128).smem_forward(128) == 160 * 1024 + 2 * 2 * 64 * 4
  # default(64), non-causal: 3-deep ring of 2 x 32 KiB K/V (256-key tiles) + 16 KiB Q; causal 2-deep.
  assert MosaicConfig.default(64).smem_forward(64) == 3 * 2 * 32 * 1024 + 16 * 1024 + 2 * 2 * 64 * 4
  assert (MosaicConfig.default(64, is_causal=True).smem_forward(64)
          == 2 * 2 * 32 * 1024 + 16 * 1024 + 2 * 2 * 64 * 4)


@pytest.mark.parametrize("h, hv, rows", [(128, 128, 64), (192, 128, 96), (64, 32, 128), (96, 64, 96),
                                         (112, 96, None), (64, 128, None), (80, 48, None)])
def test_o_staged_in_q_smem(h, hv, rows):
  """O's staging tile lives in the bytes of the warpgroup's own Q tile wherever it fits as whole
  8-row tiles of a [rows, Hv] view; elsewhere it has SMEM of its own, which the budget counts."""
  assert o_rows_in_q(64, h, hv) == rows
  cfg = MosaicConfig(block_k=64)
  own_o = 0 if rows else 2 * 64 * hv * 2
  assert cfg.smem_forward(h, 2, hv) == 2 * 64 * h * 2 + own_o + 2 * 64 * (h + hv) * 2 + 2 * 2 * 64 * 4
  if rows:
    assert rows * hv == 64 * h and rows % 8 == 0  # each warpgroup's O view starts at its Q tile


@pytest.mark.parametrize("h, hv", [(192, 128), (176, 128), (96, 64), (144, 96)])
def test_o_view_starts_at_its_warpgroups_q_tile(h, hv):
  """The forward's union of Q's tiles and O's narrower view (forward.qo_scratch): both start at the
  union's first byte, so warpgroup w's O rows [w*rows, w*rows + 64) lie in w's Q tile and never in
  the other's (the kernel writes O while the other warpgroup still reads its Q). Pins Pallas'
  placement, which RefUnion's docstring leaves open."""
  from jax._src.pallas.mosaic_gpu import core as mgpu_core
  from fa2_jax.kernels.sm90.forward import qo_scratch
  rows = o_rows_in_q(64, h, hv)
  union = qo_scratch(2, 64, h, hv, BF16)
  assert isinstance(union, mgpu_core.RefUnion)
  q_view, o_view = mgpu_core.flatten_ref_union(union.get_ref_aval())
  (q_at,), (o_at,) = ([t for t in r.transforms if isinstance(t, mgpu_core.ExtractAliasedRef)]
                      for r in (q_view, o_view))
  # (shapes in the tiled layout: compare the elements)
  assert (q_at.offset, math.prod(q_at.shape), o_at.offset, math.prod(o_at.shape)) == (
      0, 2 * 64 * h, 0, 2 * rows * hv)
  assert union.get_ref_aval().shape == (2 * 64 * h * 2,)  # O adds no bytes
  assert isinstance(qo_scratch(2, 64, 128, 128, BF16), type(union.refs[0]))  # same width: Q only


@pytest.mark.parametrize("h", range(144, 257, 16))
@pytest.mark.parametrize("hv", [None, 64, 128, 176, 256])
def test_wide_forward_key_tiles_default(h, hv):
  """Above 128: 128-key forward tiles, persistent, exactly where V is no wider than Q and their
  ring fits beside Q; 64-key tiles, one CTA per tile, elsewhere. (Some wide pairs fit no tiles, e.g.
  192/256: the family refuses them, ``supports``.)"""
  cfg = MosaicConfig.default(h, BF16, True, value_head_dim=hv)
  k128 = MosaicConfig.default(h, BF16, True).replace(block_k=128)
  fits = k128.smem_forward(h, 2, hv) <= SMEM_BYTES - SMEM_RESERVE
  want = (hv or h) <= h and fits
  assert (cfg.block_k, cfg.persistent) == ((128, True) if want else (64, False))
  if want:
    assert cfg.check(h, 2, hv) is None
  if hv is None:
    assert want == (h <= 176)


def test_mla_forward_fits_128_key_tiles():
  """DeepSeek-V2's 192/128 heads: with O in Q's bytes, a 2-deep ring of 128-key K/V tiles fits
  (48 KiB Q + 96 KiB K + 64 KiB V); 192/192 does not."""
  cfg = MosaicConfig.default(192, BF16, True, value_head_dim=128).replace(block_k=128)
  assert cfg.smem_forward(192, 2, 128) == (48 + 96 + 64) * 1024 + 2 * 2 * 64 * 4
  assert "forward kernel needs" in MosaicConfig.default(192, BF16, True).replace(
      block_k=128).check(192)


def test_fuses_dq_default_rule():
  # The fused dQ needs deterministic=False, dK/dV not split by role and enough query rows (2k / 5k
  # causal at head_dim 128).
  nc, c = MosaicConfig.default(128), MosaicConfig.default(128, is_causal=True)
  assert nc.fuses_dq(2048, deterministic=False) and not nc.fuses_dq(1024, deterministic=False)
  assert c.fuses_dq(6144, deterministic=False) and not c.fuses_dq(4096, deterministic=False)
  assert not c.fuses_dq(8192, deterministic=True)
  # attention variants follow the same length rule (dq_fused_variants is on in the defaults)
  assert c.fuses_dq(6144, deterministic=False, variant=True)
  assert not c.fuses_dq(4096, deterministic=False, variant=True)
  assert not c.replace(dq_fused_variants=False).fuses_dq(8192, deterministic=False, variant=True)
  assert MosaicConfig.default(64, is_causal=True).fuses_dq(8192, deterministic=False)
  assert not MosaicConfig.default(256).fuses_dq(8192, deterministic=False)  # role-split dK/dV
  # fused only where the dQ tile splits between the consumers: by rows at <= 64 (128-row dK/dV
  # tiles), by columns at 128; not at 80/96/112
  for h in (16, 48, 64, 128):
    assert MosaicConfig.default(h, is_causal=True).fuses_dq(8192, deterministic=False), h
  for h in (80, 96, 112):
    assert not MosaicConfig.default(h, is_causal=True).fuses_dq(8192, deterministic=False), h
  # causal head_dim 128 fuses from 5120 rows, non-causal from 2048, head_dim 64 causal from 4096
  assert (c.dq_fused_min_t, nc.dq_fused_min_t) == (5120, 2048)
  assert MosaicConfig.default(64, is_causal=True).dq_fused_min_t == 4096
  assert c.fuses_dq(5120, deterministic=False) and not c.fuses_dq(5119, deterministic=False)
  # a variant call builds the dQ kernel's range table only when its backward runs that kernel
  assert set(c.range_tiles(6144)) == {"fwd", "dkv"}
  assert set(c.range_tiles(6144, deterministic=True)) == set(c.range_tiles(4096)) == {
      "fwd", "dkv", "dq"} == set(c.range_tiles())
  assert set(MosaicConfig.default(256).range_tiles(8192)) == {"fwd", "dkv", "dq"}
  assert c.registers(2) == nc.registers(2) == 240 and c.memory_registers == nc.memory_registers == 24
  for h in (64, 128):
    for causal in (False, True):
      assert MosaicConfig.default(h, is_causal=causal).check(h) is None


def test_fused_dq_split_and_smem():
  from fa2_jax.kernels.sm90.config import dq_split
  # head_dim 128, 64-row tiles: columns; head_dim 64 with 128-row tiles: rows; else none.
  assert dq_split(64, 128, 2) == "cols" and dq_split(128, 64, 2) == "rows"
  assert dq_split(64, 64, 2) is None and dq_split(64, 128, 1) is None
  base = MosaicConfig.default(128, is_causal=True).replace(dq_fused=False)
  fused = base.replace(dq_fused=True, dq_fused_min_t=0)
  # + double-buffered dS^T (2 x 2 consumers x 64 x 64 bf16) + half a [64, 128] f32 tile per consumer
  assert fused.smem_dkv(128) - base.smem_dkv(128) == 2 * 2 * 64 * 64 * 2 + 2 * 64 * 64 * 4
  assert fused.check(128) is None
  # no split with 64-row tiles at head_dim 64: whole tiles
  h64 = MosaicConfig.default(64).replace(dq_fused=True, dq_fused_min_t=0, block_q_dkv=64)
  assert (h64.smem_dkv(64) - h64.replace(dq_fused=False).smem_dkv(64)
          == 2 * 2 * 64 * 64 * 2 + 2 * 64 * 64 * 4)


@pytest.mark.parametrize("kwargs,exc,field", [
    (dict(block_q=128), ValueError, "block_q"),
    (dict(block_k_dkv=32), ValueError, "block_k_dkv"),
    (dict(block_k=96), ValueError, "block_k"),
    (dict(block_q_dkv=512), ValueError, "block_q_dkv"),
    (dict(block_k_dq=0), ValueError, "block_k_dq"),
    (dict(num_stages=0), ValueError, "num_stages"),
    (dict(num_stages_dkv=7), ValueError, "num_stages_dkv"),
    (dict(num_wgs=3, pingpong=False), ValueError, "num_wgs"),
    (dict(num_wgs_dq=0), ValueError, "num_wgs_dq"),
    (dict(num_wgs=1), ValueError, "pingpong"),  # pingpong defaults to True: needs two consumers
    (dict(ragged="zero"), ValueError, "ragged"),
    (dict(lpt_heads=-1), ValueError, "lpt_heads"),
    (dict(lpt_heads_dkv=-2), ValueError, "lpt_heads_dkv"),
    (dict(lpt_heads="l2"), TypeError, "lpt_heads"),
    (dict(compute_registers=100), ValueError, "compute_registers"),
    (dict(compute_registers=16), ValueError, "compute_registers"),
    (dict(memory_registers=20), ValueError, "memory_registers"),
    (dict(memory_registers=264), ValueError, "memory_registers"),
    (dict(pingpong=1), TypeError, "pingpong"),
    (dict(dq_fused=1), TypeError, "dq_fused"),
    (dict(dq_fused_variants=1), TypeError, "dq_fused_variants"),
    (dict(dq_fused_min_t=-1), ValueError, "dq_fused_min_t"),
    (dict(dq_fused_min_t=2048.0), TypeError, "dq_fused_min_t"),
    (dict(dkv_roles=1), TypeError, "dkv_roles"),
    (dict(dq_roles="no"), TypeError, "dq_roles"),
    (dict(block_k=128.0), TypeError, "block_k"),
    (dict(num_stages=True), TypeError, "num_stages"),
    (dict(memory_registers="40"), TypeError, "memory_registers"),
    (dict(backward_p="fast"), ValueError, "backward_p"),
    (dict(backward_p=None), ValueError, "backward_p"),
    (dict(persistent=1), TypeError, "persistent"),
    (dict(persistent_ctas=-1), ValueError, "persistent_ctas"),
    (dict(persistent_ctas=2.0), TypeError, "persistent_ctas"),
    (dict(persistent_deal="snake"), ValueError, "persistent_deal"),
    (dict(persistent_deal=None), ValueError, "persistent_deal"),
])
def test_config_validation(kwargs, exc, field):
  with pytest.raises(exc, match=rf"MosaicConfig\.{field}\b"):
    MosaicConfig(**kwargs)
  # replace() re-validates too
  with pytest.raises(exc, match=rf"MosaicConfig\.{field}\b"):
    MosaicConfig.default(128).replace(**kwargs)


def test_config_valid_variants():
  MosaicConfig(num_wgs=1, pingpong=False, num_wgs_dkv=1, num_wgs_dq=1, compute_registers=240,
               ragged="pad")
  MosaicConfig(block_k=256, block_q_dkv=192, block_k_dq=128, num_stages=1, num_stages_dq=6)
  assert MosaicConfig().registers(2) == 232 and MosaicConfig().registers(1) == 240
  assert MosaicConfig(compute_registers=200).registers(2) == 200


def test_persistent_forward_default_rule():
  """The forward runs persistent by default where it measured as fast or faster: head_dim <= 128,
  causal calls dealing their tiles greedily; a causal call whose tiles' work is unknown at trace time
  (a variant with lengths, segments, an offset or a mask_fn) keeps one CTA per tile
  (docs/design.md#persistent-forward)."""
  for h in (64, 128):
    for causal in (False, True):
      cfg = MosaicConfig.default(h, is_causal=causal)
      assert cfg.persistent and cfg.persistent_deal == "greedy"
      assert cfg.forward_persistent(is_causal=causal, known_work=True)
      assert cfg.forward_persistent(is_causal=causal, known_work=False) == (not causal)
      assert cfg.deals_greedily(is_causal=causal, known_work=True) == causal
      assert not cfg.deals_greedily(is_causal=causal, known_work=False)
      cyclic = cfg.replace(persistent_deal="cyclic")  # every call persistent, none dealt greedily
      assert cyclic.forward_persistent(is_causal=causal, known_work=False)
      assert not cyclic.deals_greedily(is_causal=causal, known_work=True)
      off = cfg.replace(persistent=False)
      assert not off.forward_persistent(is_causal=causal, known_work=True)
      assert not off.deals_greedily(is_causal=causal, known_work=True)
  for h in (192, 256):
    assert not MosaicConfig.default(h, is_causal=True).forward_persistent(is_causal=True,
                                                                          known_work=True)
    assert not MosaicConfig.default(h).persistent
  assert MosaicConfig.default(128).persistent_ctas == 0  # 0: one CTA per SM

def test_greedy_deal_balances_causal_tiles():
  """schedule.greedy_deal gives each launch position (longest first) to the least-loaded CTA: every
  position once, each CTA's in increasing order, and the most-loaded CTA within one tile of the
  least; the cyclic deal of the same LPT order leaves CTA 0 the longest tile of every round."""
  from fa2_jax.kernels.sm90.schedule import greedy_deal

  work = sorted([w for w in range(1, 65) for _ in range(32)], reverse=True)  # causal 8k, 2x16 heads
  n_ctas = 132
  table = greedy_deal(work, n_ctas)
  counts = table[:, 0]
  dealt = [list(table[c, 1:1 + counts[c]]) for c in range(n_ctas)]
  assert sorted(p for d in dealt for p in d) == list(range(len(work)))
  assert all(d == sorted(d) for d in dealt)
  assert not table[:, 1:][np.arange(table.shape[1] - 1)[None, :] >= counts[:, None]].any()
  loads = [sum(work[p] for p in d) for d in dealt]
  assert max(loads) - min(loads) <= max(work)
  cyclic = [sum(work[c::n_ctas]) for c in range(n_ctas)]
  assert max(loads) < max(cyclic)
  assert (max(cyclic) - min(cyclic)) > 4 * (max(loads) - min(loads))
  assert table.dtype == np.int32 and greedy_deal([3], 4)[:, 0].tolist() == [1, 0, 0, 0]

def test_backward_p_form():
  """``backward_p="auto"`` compiles the one-FMA form alone only where the logits are bounded below
  its limit whatever the inputs (a soft cap, nothing added after it); else the per-head choice."""
  from fa2_jax.kernels.masking import Variant
  auto, exact = MosaicConfig.default(128), MosaicConfig.default(128).replace(backward_p="exact")
  assert auto.backward_p == "auto" and auto.p_form() == auto.p_form(Variant()) == "per_head"
  assert auto.p_form(Variant(is_causal=True, soft_cap=50.0, window=(100, 0))) == "fast"
  assert auto.p_form(Variant(soft_cap=50.0, has_alibi=True)) == "per_head"  # ALiBi is unbounded
  assert auto.p_form(Variant(soft_cap=50.0, score_fn=lambda x, *_: x)) == "per_head"
  assert auto.p_form(Variant(soft_cap=1e4)) == "per_head"  # cap * log2 e past the limit
  assert exact.p_form() == exact.p_form(Variant(soft_cap=50.0)) == "exact"
  assert auto.replace(backward_p="per_head").p_form(Variant(soft_cap=50.0)) == "per_head"


@pytest.mark.parametrize("h,kwargs,kernel", [
    (128, dict(num_stages=6), "forward"),
    (64, dict(block_k=256, num_stages=6), "forward"),
    (128, dict(num_stages_dq=6, block_k_dq=256), "dQ"),
    (128, dict(num_stages_dkv=6, block_q_dkv=256), "dK/dV"),
    (256, dict(num_stages_dkv=6, block_q_dkv=128), "dK/dV"),  # default(256): the role-split kernel
    (256, dict(num_stages_dq=3), "dQ"),  # default(256): the role-split dQ kernel's own layout
])
def test_check_rejects_oversized(h, kwargs, kernel):
  cfg = MosaicConfig.default(h).replace(**kwargs)
  why = cfg.check(h)
  assert why is not None
  assert kernel in why and "shared memory" in why and f"head_dim={h}" in why, why
  # the reported need is real: above the budget
  kib = int(re.search(r"needs (\d+) KiB", why).group(1))
  assert kib * 1024 > SMEM_BYTES - SMEM_RESERVE - 1024
  # forward/backward refuse it before tracing a kernel
  q = jnp.zeros((1, 128, 1, h), BF16)
  with pytest.raises(ValueError, match="shared memory"):
    if kernel == "forward":
      forward(q, q, q, scale=1.0, is_causal=False, config=cfg)
    else:
      stats = jnp.zeros((1, 1, 2, 128), jnp.float32)
      backward(q, q, q, q, stats, q, scale=1.0, is_causal=False, config=cfg)


def test_dq_roles_needs_head_dim_multiple_of_128():
  cfg = MosaicConfig.default(192).replace(dq_roles=True)
  why = cfg.check(192)
  assert why is not None and "dq_roles" in why and "192" in why, why
  assert MosaicConfig.default(256).replace(dq_roles=True).check(256) is None


def test_check_fp32_itemsize_doubles_need():
  # h=64 with a 6-deep forward ring of 128-key tiles fits (~208 KiB) for 16-bit but not for 4 bytes.
  cfg = MosaicConfig.default(64).replace(block_k=128, num_stages=6)
  assert cfg.check(64, 2) is None
  why = cfg.check(64, 4)
  assert why is not None and "forward" in why


# --- block ranges vs masking.allowed ------------------------------------------------------------------

def _block_mask(q_lo, q_hi, k_lo, k_hi, *, is_causal, seq_k=None):
  """allowed() on the query rows [q_lo, q_hi) x keys [k_lo, k_hi), as a numpy bool array."""
  q = np.arange(q_lo, q_hi, dtype=np.int32)[:, None]
  k = np.arange(k_lo, k_hi, dtype=np.int32)[None, :]
  m = allowed(q, k, is_causal=is_causal, seq_k=seq_k)
  if m is None:
    return np.ones((q_hi - q_lo, k_hi - k_lo), bool)
  return np.asarray(m)


SEQS = (1, 8, 63, 64, 65, 127, 128, 136, 200, 257, 777, 1000)


def _kv_cases():
  rng = np.random.default_rng(0)
  for seq_k, bk, rows, causal in itertools.product(SEQS, (64, 128, 192, 256), (64, 128),
                                                   (False, True)):
    top = max(seq_k, 3 * bk) + 2 * rows
    starts = set(range(0, top, rows))  # CTA tile starts
    starts |= {1, bk - 1, bk, bk + 1, seq_k - 1, seq_k, seq_k + 1, 3 * bk - 1}  # odd starts too
    starts |= set(rng.integers(0, top, 12).tolist())  # the contract holds for any start
    # first row (q_start + 1) and last row (q_start + rows) on each side of a block boundary
    starts |= {m * bk + d - off for m in range(4) for d in (-1, 0, 1) for off in (1, rows)}
    for q_start in sorted(x for x in starts if x >= 0):
      yield q_start, rows, bk, seq_k, causal


def test_kv_block_ranges_brute_force():
  n_checked = 0
  for q_start, rows, bk, seq_k, causal in _kv_cases():
    n_full, n_end = kv_block_ranges(q_start, rows, block_k=bk, seq_k=seq_k, is_causal=causal)
    nk = math.ceil(seq_k / bk)
    ctx = dict(q_start=q_start, rows=rows, bk=bk, seq_k=seq_k, causal=causal, n_full=n_full,
               n_end=n_end)
    assert 0 <= n_full <= n_end <= nk, ctx
    # All keys of [0, nk + 1) blocks (one block past the end) against every row of the tile.
    m = _block_mask(q_start, q_start + rows, 0, (nk + 1) * bk, is_causal=causal, seq_k=seq_k)
    per_block = m.reshape(rows, nk + 1, bk)
    any_allowed = per_block.any(axis=(0, 2))
    all_allowed = per_block.all(axis=(0, 2))
    # every allowed pair lies in a visited block, blocks past n_end hold none
    assert not any_allowed[n_end:].any(), ctx
    # the unmasked sub-range needs no mask: every (row, key) pair there is allowed
    assert all_allowed[:n_full].all(), ctx
    # tight: the last visited block has an allowed pair, the first masked one needs the mask
    assert n_end == 0 or any_allowed[n_end - 1], ctx
    assert n_full == n_end or not all_allowed[n_full], ctx
    if not causal:
      assert (n_full, n_end) == (seq_k // bk, nk), ctx
    n_checked += 1
  assert n_checked > 2000


def _q_cases():
  rng = np.random.default_rng(1)
  for seq_q, bq, cols, causal in itertools.product(SEQS, (64, 128, 192, 256), (64, 128),
                                                   (False, True)):
    top = max(seq_q, 3 * bq) + 2 * cols
    starts = set(range(0, top, cols))
    starts |= {1, bq - 1, bq, bq + 1, seq_q - 1, seq_q, seq_q + 1}
    starts |= set(rng.integers(0, top, 12).tolist())
    # first key (k_start) and last key (k_start + cols - 1) on each side of a block boundary
    starts |= {m * bq + d - off for m in range(4) for d in (-1, 0, 1) for off in (0, cols - 1)}
    for k_start in sorted(x for x in starts if x >= 0):
      yield k_start, cols, bq, seq_q, causal


def test_q_block_ranges_brute_force():
  n_checked = 0
  for k_start, cols, bq, seq_q, causal in _q_cases():
    i_start, i_full, nq = q_block_ranges(k_start, cols, block_q=bq, seq_q=seq_q, is_causal=causal)
    ctx = dict(k_start=k_start, cols=cols, bq=bq, seq_q=seq_q, causal=causal, i_start=i_start,
               i_full=i_full, nq=nq)
    assert nq == math.ceil(seq_q / bq), ctx
    assert 0 <= i_start <= i_full <= nq, ctx
    # Query rows of all nq blocks (incl. the padded tail of the last) vs the CTA's keys.
    m = _block_mask(0, nq * bq, k_start, k_start + cols, is_causal=causal)
    per_block = m.reshape(nq, bq, cols)
    real_b = (np.arange(nq * bq) < seq_q).reshape(nq, bq)
    # every pair that may attend lies in a visited block [i_start, nq) (padded rows included)
    assert not per_block[:i_start].any(), ctx
    # blocks [i_full, nq) need no mask for their real rows (padded rows contribute zeros anyway)
    for i in range(i_full, nq):
      assert per_block[i][real_b[i]].all(), (ctx, i)
    # tight: block i_start is reached, and the last masked block really needs its mask
    if i_start < nq:
      assert per_block[i_start].any(), ctx
    if i_full > i_start:
      assert not per_block[i_full - 1][real_b[i_full - 1]].all(), ctx
    if not causal:
      assert (i_start, i_full) == (0, 0), ctx
    n_checked += 1
  assert n_checked > 2000


def test_block_ranges_traced_match_python():
  """The kernels call these with traced int32 tile starts: same answers as with Python ints."""
  for bk, rows, seq, causal in [(128, 128, 1000, True), (64, 128, 777, True), (256, 64, 200, True),
                                (128, 128, 1000, False)]:
    starts = list(range(0, seq + 3 * rows, rows)) + [1, 65, 129, 999]

    @jax.jit
    def traced(s):
      return (kv_block_ranges(s, rows, block_k=bk, seq_k=seq, is_causal=causal),
              q_block_ranges(s, rows, block_q=bk, seq_q=seq, is_causal=causal))

    (tf, te), (ts, tfull, tnq) = traced(jnp.asarray(starts, jnp.int32))
    for idx, s in enumerate(starts):
      f, e = kv_block_ranges(s, rows, block_k=bk, seq_k=seq, is_causal=causal)
      a, b, c = q_block_ranges(s, rows, block_q=bk, seq_q=seq, is_causal=causal)
      got_kv = (int(np.broadcast_to(tf, (len(starts),))[idx]),
                int(np.broadcast_to(te, (len(starts),))[idx]))
      got_q = tuple(int(np.broadcast_to(x, (len(starts),))[idx]) for x in (ts, tfull, tnq))
      assert got_kv == (f, e), (bk, rows, seq, causal, s)
      assert got_q == (a, b, c), (bk, rows, seq, causal, s)


# --- plan_lengths / pad_axis --------------------------------------------------------------------------

def _fwd_tiles(cfg):  # as forward() computes them
  return cfg.num_wgs * cfg.block_q, cfg.block_k


@pytest.mark.parametrize("n_b,n_h,n_t,section,longest_last", [
    (2, 16, 64, 8, True), (1, 5, 7, 2, False), (3, 4, 1, 5, True), (2, 3, 9, 1, True),
    (1, 1, 4, 1, False), (4, 6, 5, 24, False)])
def test_lpt_tile_is_a_longest_first_bijection(n_b, n_h, n_t, section, longest_last):
  """Every launch coordinate maps to one distinct (b, h, tile); in launch order the tiles of each
  section of heads run longest first across all its heads; section 1 is the per-head order."""
  n_bh = n_b * n_h
  seen = []
  for b, h, t in itertools.product(range(n_b), range(n_h), range(n_t)):  # launch order: t fastest
    seen.append(lpt_tile(b, h, t, n_h=n_h, n_t=n_t, n_bh=n_bh, section=section,
                         longest_last=longest_last))
  assert sorted(seen) == sorted(itertools.product(range(n_b), range(n_h), range(n_t)))
  rank = [(n_t - 1 - t) if longest_last else t for _, _, t in seen]  # 0 = longest
  sec = [(b * n_h + h) // section for b, h, _ in seen]
  assert sec == sorted(sec)  # sections are launched one after another
  for s_ in set(sec):
    ranks = [r for r, x in zip(rank, sec) if x == s_]
    assert ranks == sorted(ranks)  # longest first within a section
  if section == 1:  # the per-head order: heads in order, each head's tiles longest first
    assert [(b, h) for b, h, _ in seen] == [(b, h) for b, h, _ in
                                            itertools.product(range(n_b), range(n_h), range(n_t))]


@pytest.mark.parametrize("is_causal", [False, True])
def test_launch_tile_is_the_grid_launch_order(is_causal):
  """A persistent CTA's launch position ``lin`` maps to the tile the one-CTA-per-tile grid launches
  at ``lin``: ``(b, h, t)`` in order, remapped by :func:`lpt_tile` when causal."""
  n_b, n_h, n_t, section = 2, 3, 5, 4
  for lin, (b, h, t) in enumerate(itertools.product(range(n_b), range(n_h), range(n_t))):
    want = (lpt_tile(b, h, t, n_h=n_h, n_t=n_t, n_bh=n_b * n_h, section=section, longest_last=True)
            if is_causal else (b, h, t))
    assert launch_tile(lin, is_causal=is_causal, n_heads=n_h, n_tiles=n_t, n_bh=n_b * n_h,
                       section=section, longest_last=True) == want


def test_lpt_tile_traced_matches_python():
  args = dict(n_h=3, n_t=5, n_bh=6, section=4, longest_last=True)
  f = jax.jit(lambda b, h, t: lpt_tile(b, h, t, **args))
  for b, h, t in itertools.product(range(2), range(3), range(5)):
    got = tuple(int(x) for x in f(jnp.int32(b), jnp.int32(h), jnp.int32(t)))
    assert got == lpt_tile(b, h, t, **args)


def test_group_split():
  """The dK/dV kernel splits a GQA group over CTAs (by the smallest divisor of the group) until the
  grid has 2 CTAs per SM and each loops over at most 5 heads; a grid that fills the GPU with short
  loops is left alone."""
  assert group_split(1, 1, 32, 64, 132) == 8  # MQA 32/1 at 8k: 64 key CTAs -> 512
  assert group_split(4, 1, 48, 32, 132) == 12  # StarCoder 48/1 at 4k x 4: 128 -> 1536, 4 heads each
  assert group_split(4, 1, 8, 64, 132) == 2  # Gemma 2B 8/1 (head_dim 256, 64-key CTAs) at 4k x 4
  assert group_split(64, 1, 32, 32, 132) == 8  # a full grid, but 32 heads per CTA -> 4
  assert group_split(4, 8, 8, 32, 132) == 2  # Llama-3 70B 64/8 at 4k x 4: a full grid, 8 heads -> 4
  assert group_split(1, 8, 8, 128, 132) == 2  # ... and at 16k
  assert group_split(1, 8, 4, 64, 132) == 1  # GQA 32/8 at 8k: 512 CTAs of 4 heads already
  assert group_split(1, 4, 7, 128, 132) == 7  # Qwen2 28/4 at 16k: 7 is prime, one head per CTA
  assert group_split(4, 8, 5, 32, 132) == 1  # GQA 40/8: 5 heads per CTA stay together
  assert group_split(1, 1, 2, 1, 132) == 2  # capped at the group
  assert group_split(1, 1, 12, 1, 132) == 12  # no divisor fills the grid: one head per CTA
  assert group_split(4, 8, 6, 32, 132) == 2  # a group of 6: 3 heads per CTA
  assert group_split(1, 1, 1, 1, 132) == 1  # MHA


@pytest.mark.parametrize("r", [2, 3])
def test_group_split_below_the_group_interpret(monkeypatch, r):
  """GQA groups of 6 split over r CTAs of 6 / r heads each (r neither 1 nor G, 3 not a power of
  two), two KV heads (split c reads KV head c // r): the partial dK/dV summed per KV head, against
  the float64 formula; r = 3 with the fused dQ (its reduce-adds into the split's query heads)."""
  from fa2_jax.kernels.sm90 import backward as sm90_backward
  from jax.experimental.pallas import mosaic_gpu as plgpu
  monkeypatch.setattr(sm90_backward, "group_split", lambda *a: r)
  b, t, s, n, kh, h = 1, 72, 136, 12, 2, 64
  scale = 1.0 / math.sqrt(h)
  ks = jax.random.split(jax.random.key(r), 4)
  q = jax.random.normal(ks[0], (b, t, n, h), jnp.float32).astype(BF16)
  k = jax.random.normal(ks[1], (b, s, kh, h), jnp.float32).astype(BF16)
  v = jax.random.normal(ks[2], (b, s, kh, h), jnp.float32).astype(BF16)
  do = jax.random.normal(ks[3], (b, t, n, h), jnp.float32).astype(BF16)
  cfg = MosaicConfig.default(64, is_causal=True).replace(persistent=False)
  if r == 3:
    cfg = cfg.replace(dq_fused=True, dq_fused_min_t=0)
  with emulated_mma(), plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
    got = jax.block_until_ready(jax.jit(_fwd_bwd(scale, True, cfg, with_dlse=False))(
        q, k, v, do, None))
  ref = _reference(q, k, v, do, None, scale, True)
  for name, x, want in list(zip(("out", "lse", "dq", "dk", "dv"), got, ref))[2:]:
    assert x.shape == want.shape, name
    assert _rel(x, want) < 1e-2, (name, _rel(x, want))


def test_split_group_reads_its_kv_head_without_copies():
  """MQA 4/1 split over 4 dK/dV CTAs (a small grid: group_split gives one head per CTA): every
  Mosaic kernel of the step, lowered for sm90, takes K and V as they are, [B, S, 1, H] (no r-fold
  copies in HBM), and the dK/dV kernel returns the 4 partials [B, S, 4, H] that XLA sums."""
  b, t, s, n, kh, h = 1, 256, 512, 4, 1, 64
  sd = jax.ShapeDtypeStruct
  f = _fwd_bwd(1.0 / math.sqrt(h), True, None, with_dlse=False)
  text = jax.jit(f).trace(sd((b, t, n, h), BF16), sd((b, s, kh, h), BF16), sd((b, s, kh, h), BF16),
                          sd((b, t, n, h), BF16), None).lower(lowering_platforms=("cuda",)).as_text()
  calls = [line for line in text.splitlines() if "stablehlo.custom_call @mosaic_gpu" in line]
  kv = f"tensor<{b}x{s}x{kh}x{h}xbf16>"
  assert len(calls) == 3, text[:2000]  # forward, dK/dV, dQ
  for line in calls:
    operands, results = re.search(r": \((.*?)\) -> (.*)$", line).groups()
    assert operands.split(", ")[1:3] == [kv, kv], operands
  assert sum(f"tensor<{b}x{s}x{n}x{h}xbf16>, tensor<{b}x{s}x{n}x{h}xbf16>" in line
             for line in calls) == 1, calls  # the dK/dV partials, one per split


def test_section_heads():
  mib = 1024 * 1024
  assert section_heads(4 * mib, 32, budget=32 * mib) == 8  # 8k x 128 bf16 K+V per head
  assert section_heads(8 * mib, 16, budget=32 * mib) == 4
  assert section_heads(1 * mib, 16, budget=32 * mib) == 16  # capped at the heads there are
  assert section_heads(64 * mib, 16, budget=32 * mib) == 1  # at least one head
  assert section_heads(5 * mib, 64, group=4, budget=32 * mib) == 4  # 6 -> a multiple of the group
  assert section_heads(12 * mib, 64, group=4, budget=32 * mib) == 2  # below one group: as is
  cfg = MosaicConfig()
  assert causal_section(cfg, n_bh=32, group=1, kv_bytes=4 * mib) == 8
  assert causal_section(cfg.replace(lpt_heads=1), n_bh=32, group=1, kv_bytes=4 * mib) == 1
  assert causal_section(cfg.replace(lpt_heads=6), n_bh=32, group=1, kv_bytes=4 * mib) == 6
  assert causal_section(cfg.replace(lpt_heads=64), n_bh=32, group=1, kv_bytes=4 * mib) == 32
  assert causal_section(cfg.replace(lpt_heads=1), n_bh=32, group=1, kv_bytes=4 * mib, dkv=True) == 8
  assert causal_section(cfg.replace(lpt_heads_dkv=1), n_bh=32, group=1, kv_bytes=4 * mib, dkv=True) == 1
  assert MosaicConfig.default(64, is_causal=True).lpt_heads_dkv == 1  # docs/design.md#causal-launch-order


def test_plan_lengths_default_tiles():
  cfg = MosaicConfig.default(128)
  assert _fwd_tiles(cfg) == (128, 128)
  assert backward_tiles(cfg) == (128, 128)
  for q_tile, k_tile in (_fwd_tiles(cfg), backward_tiles(cfg)):
    p = plan_lengths(1000, 777, q_tile=q_tile, k_tile=k_tile, mode="tma")
    assert (p.t, p.s) == (1000, 777)
    assert p.t_hbm == 1000 and p.pad_t == 0  # multiple of 8 and >= one tile: TMA bounds, no pad
    assert p.s_hbm == 896 and p.pad_s == 119  # 777 is not a multiple of 8: padded to 7 x 128
    assert p.t_rows == 1024
  # h256: 64-key forward tiles; the role-split dQ kernel's CTA owns 64 rows and the role-split dK/dV
  # kernel's 64 keys
  cfg = MosaicConfig.default(256)
  assert _fwd_tiles(cfg) == (128, 64)
  assert plan_lengths(1000, 777, q_tile=128, k_tile=64, mode="tma").s_hbm == 832
  assert backward_tiles(cfg) == (64, 64)


@pytest.mark.parametrize("t,s,q_tile,k_tile,mode,want", [
    # (t_hbm, s_hbm, t_rows)
    (1000, 1000, 128, 128, "tma", (1000, 1000, 1024)),
    (1000, 1000, 128, 128, "pad", (1024, 1024, 1024)),
    (1024, 1024, 128, 128, "pad", (1024, 1024, 1024)),
    (8, 8, 128, 128, "tma", (128, 128, 128)),  # shorter than a tile: padded even in tma mode
    (1, 1, 128, 64, "tma", (128, 64, 128)),
    (120, 64, 128, 64, "tma", (128, 64, 128)),
    (136, 200, 128, 128, "tma", (136, 200, 256)),
    (100, 77, 128, 128, "pad", (128, 128, 128)),
    (200, 64, 64, 64, "tma", (200, 64, 256)),
    (200, 64, 192, 64, "tma", (200, 64, 384)),  # lse rows: a whole number of lcm(192, 64) tiles
    (1001, 999, 384, 256, "tma", (1152, 1024, 1152)),
    (1000, 777, 64, 128, "tma", (1000, 896, 1024)),
])
def test_plan_lengths_cases(t, s, q_tile, k_tile, mode, want):
  p = plan_lengths(t, s, q_tile=q_tile, k_tile=k_tile, mode=mode)
  assert (p.t_hbm, p.s_hbm, p.t_rows) == want
  assert (p.pad_t, p.pad_s) == (want[0] - t, want[1] - s)


def test_plan_lengths_invariants():
  for t, tile, mode in itertools.product(range(1, 700, 7), (64, 128, 192, 256), ("tma", "pad")):
    p = plan_lengths(t, t, q_tile=tile, k_tile=tile, mode=mode)
    for n in (p.t_hbm, p.s_hbm):
      assert n >= t
      if n != t:  # padded: to whole tiles, less than one extra
        assert n % tile == 0 and n - t < tile
      else:  # unpadded: TMA needs 8-row multiples and at least one tile; pad mode only whole tiles
        assert t >= tile and (t % 8 == 0 if mode == "tma" else t % tile == 0)
    lcm = math.lcm(tile, 64)
    assert p.t_rows % lcm == 0 and t <= p.t_rows < t + lcm
    assert p.t_rows >= math.ceil(p.t_hbm / tile) * tile  # every lse tile store stays in bounds
  with pytest.raises(ValueError, match="ragged mode"):
    plan_lengths(10, 10, q_tile=128, k_tile=128, mode="zero")


def test_pad_axis():
  x = jnp.arange(1, 2 * 3 * 4 + 1, dtype=BF16).reshape(2, 3, 4)
  y = pad_axis(x, 1, 7)
  assert y.shape == (2, 7, 4) and y.dtype == x.dtype
  np.testing.assert_array_equal(np.asarray(y[:, :3], np.float32), np.asarray(x, np.float32))
  assert not np.asarray(y[:, 3:], np.float32).any()
  z = pad_axis(x, 2, 5)
  assert z.shape == (2, 3, 5) and not np.asarray(z[..., 4:], np.float32).any()
  assert pad_axis(x, 0, 2) is x  # no-op


# --- lowering for sm90 --------------------------------------------------------------------------------

def _fwd_bwd(scale, causal, cfg=None, with_dlse=False):
  deterministic = not (cfg is not None and cfg.dq_fused)

  def f(q, k, v, do, dlse):
    out, stats = forward(q, k, v, scale=scale, is_causal=causal, config=cfg)
    lse = lse_from_stats(stats, scale, False)
    dq, dk, dv = backward(q, k, v, out, stats, do, dlse=dlse if with_dlse else None, scale=scale,
                          is_causal=causal, config=cfg, deterministic=deterministic)
    return out, lse, dq, dk, dv
  return f


LOWER_CASES = [  # b, t, s, n, kh, h, causal, dtype, cfg, kernels
    (2, 256, 256, 4, 4, 64, False, BF16, None, ("forward", "dkdv", "dq")),
    (1, 1000, 777, 4, 2, 128, True, BF16, None, ("forward", "dkdv", "dq")),
    (1, 300, 300, 2, 1, 128, True, jnp.float16,
     MosaicConfig.default(128, is_causal=True).replace(pingpong=False, ragged="pad"), ("forward", "dkdv", "dq")),
    # head_dim 256: dK/dV in one kernel whose two consumers split each step by role (the default),
    # and dQ split by role too (the default) or in the dQ kernel with one consumer warpgroup
    (1, 256, 200, 2, 2, 256, True, BF16, None, ("forward", "dkdv_roles", "dq_roles")),
    (1, 256, 200, 4, 2, 256, False, BF16, MosaicConfig.default(256).replace(dq_roles=False),
     ("forward", "dkdv_roles", "dq")),
    # fused dQ (TMA reduce-add inside the dK/dV kernel): no dQ kernel
    (1, 1000, 777, 4, 2, 128, True, BF16, MosaicConfig.default(128).replace(dq_fused=True, dq_fused_min_t=0),
     ("forward", "dkdv_dq")),
    (2, 512, 512, 4, 4, 64, False, BF16,
     MosaicConfig.default(64).replace(dq_fused=True, dq_fused_min_t=0, num_stages_dkv=2), ("forward", "dkdv_dq")),
    # fp16, non-causal: the default fused dQ (dS^T staged in fp16; fused here from any length)
    (1, 256, 320, 4, 2, 128, False, jnp.float16, MosaicConfig.default(128).replace(dq_fused_min_t=0),
     ("forward", "dkdv_dq")),
    # fused dQ with 64-row dK/dV tiles at head_dim 64: no split, one partial per consumer
    (1, 256, 256, 2, 2, 64, False, BF16,
     MosaicConfig.default(64).replace(dq_fused=True, dq_fused_min_t=0, block_q_dkv=64), ("forward", "dkdv_dq")),
    # head_dims of the narrower swizzles (ops.smem_transforms): 64 bytes at 96 (fused dQ, its f32
    # staging 128-byte) and 160 (the role-split dK/dV kernel, the one-warpgroup dQ kernel), 32 bytes
    # at 80 (fused dQ staged with a 64-byte f32 swizzle) and 112, and 16 (the head_dim-64 tiles)
    (1, 1000, 777, 4, 2, 96, True, BF16, MosaicConfig.default(96).replace(dq_fused=True, dq_fused_min_t=0, dq_fused_variants=True),
     ("forward", "dkdv_dq")),
    (1, 300, 520, 4, 1, 80, False, BF16, MosaicConfig.default(80).replace(dq_fused=True, dq_fused_min_t=0, dq_fused_variants=True),
     ("forward", "dkdv_dq")),
    (1, 256, 200, 2, 2, 112, True, BF16, None, ("forward", "dkdv", "dq")),
    (1, 256, 200, 2, 1, 160, True, BF16, None, ("forward", "dkdv_roles", "dq")),
    (2, 256, 256, 2, 2, 16, False, BF16, None, ("forward", "dkdv", "dq")),
]


@pytest.mark.parametrize("case", LOWER_CASES, ids=lambda c: f"h{c[5]}-t{c[1]}-s{c[2]}-c{int(c[6])}")
def test_lowers_for_sm90(case):
  b, t, s, n, kh, h, causal, dt, cfg, kernels = case
  sd = jax.ShapeDtypeStruct
  f = _fwd_bwd(1.0 / math.sqrt(h), causal, cfg, with_dlse=True)
  lowered = jax.jit(f).trace(sd((b, t, n, h), dt), sd((b, s, kh, h), dt), sd((b, s, kh, h), dt),
                             sd((b, t, n, h), dt), sd((b, n, t), jnp.float32)
                             ).lower(lowering_platforms=("cuda",))
  text = lowered.as_text()
  # one Mosaic GPU custom call per kernel, each carrying its serialized Mosaic module
  assert text.count("stablehlo.custom_call @mosaic_gpu") == len(kernels), text[:2000]
  names = set(re.findall(r"fa2_mosaic_(forward|dkdv_dq|dkdv_roles|dkdv|dq_roles|dq)_mosaic_gpu", text))
  assert names == set(kernels)
  # output shapes/dtypes as documented
  outs = lowered.out_info
  assert outs[0].shape == (b, t, n, h) and outs[0].dtype == dt
  assert outs[1].shape == (b, n, t) and outs[1].dtype == jnp.float32
  assert [o.shape for o in outs[2:]] == [(b, t, n, h), (b, s, kh, h), (b, s, kh, h)]


@pytest.mark.parametrize("h, hv, causal, kernels", [
    (192, 128, True, ("forward", "dkdv_roles", "dq")),  # DeepSeek-V2: both 128-byte swizzles
    (128, 64, True, ("forward", "dkdv_dq")),  # fused dQ from 5k causal rows
    (96, 64, False, ("forward", "dkdv", "dq")),  # Q/K tiles 64-byte swizzled, V/dO tiles 128
    (64, 256, False, ("forward", "dkdv_roles", "dq"))])  # V wider: the 256 tiles
def test_value_head_dim_of_its_own_lowers_for_sm90(h, hv, causal, kernels):
  """V, O, dO and dV tiled by their own width (and swizzle), Q/K by H's: every kernel lowers for
  sm90, with the outputs' shapes."""
  b, t, n, kh = 1, 6144, 4, 2
  sd = jax.ShapeDtypeStruct
  cfg = MosaicConfig.default(h, BF16, causal, value_head_dim=hv)

  def f(q, k, v, do):
    out, stats = forward(q, k, v, scale=h ** -0.5, is_causal=causal, config=cfg)
    return (out, *backward(q, k, v, out, stats, do, scale=h ** -0.5, is_causal=causal, config=cfg,
                           deterministic=False))

  lowered = jax.jit(f).trace(sd((b, t, n, h), BF16), sd((b, t, kh, h), BF16),
                             sd((b, t, kh, hv), BF16), sd((b, t, n, hv), BF16)
                             ).lower(lowering_platforms=("cuda",))
  names = set(re.findall(r"fa2_mosaic_(forward|dkdv_dq|dkdv_roles|dkdv|dq_roles|dq)_mosaic_gpu",
                         lowered.as_text()))
  assert names == set(kernels)
  assert [o.shape for o in lowered.out_info] == [(b, t, n, hv), (b, t, n, h), (b, t, kh, h),
                                                 (b, t, kh, hv)]


# --- numerics in GPU interpret mode (emulated wgmma) -------------------------------------------------

def _rel(x, ref):
  x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
  return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


@functools.partial(jax.jit, static_argnums=(5, 6))  # one compile (eagerly: one per op and shape)
def _reference(q, k, v, do, dlse, scale, causal):
  def f(q, k, v):
    return fa2_jax.reference_attention(q, k, v, scale=scale, is_causal=causal, return_residual=True,
                                       compute_dtype=jnp.float32)

  (out, lse), vjp = jax.vjp(f, q, k, v)  # lse [B, T, N]
  dlse_btn = jnp.zeros_like(lse) if dlse is None else jnp.swapaxes(dlse, 1, 2)
  dq, dk, dv = vjp((do.astype(out.dtype), dlse_btn))
  return out, jnp.swapaxes(lse, 1, 2), dq, dk, dv


# CI time: each case runs kernels or a launch order that no other case here runs. The default causal
# head_dim-64 kernels (separate dQ) run in test_interpret_causal_lpt_sections (the forward dealing
# its tiles greedily, as by default) and below at T < S (keys never attended) and at 520 rows (three
# persistent CTAs); the non-causal head_dim-64 defaults in the persistent case below (which differs
# from them only in its CTA count), so neither is a case of its own.
INTERPRET_CASES = [  # b, t, s, n, kh, h, causal, cfg, with_dlse
    # causal, T far below S (ragged): keys >= T never attended, and the dK/dV CTAs past the last
    # query row run no steps at all; the forward one CTA per query tile
    (1, 72, 264, 1, 1, 64, True,
     MosaicConfig.default(64, is_causal=True).replace(persistent=False), False),
    # non-causal, ragged lengths padded in HBM, lse cotangent, one consumer warpgroup (no pingpong)
    (1, 100, 77, 2, 2, 128, False,
     MosaicConfig.default(128).replace(ragged="pad", num_wgs=1, pingpong=False), True),
    # fused dQ: causal, GQA 3:1 (the group split over 3 CTAs, group_split), ragged T/S, lse
    # cotangent (emulated: per-consumer slabs, summed)
    (1, 136, 200, 3, 1, 64, True, MosaicConfig.default(64).replace(dq_fused=True, dq_fused_min_t=0, num_stages_dkv=2),
     True),
    # head_dim 80 (32-byte swizzle), fused dQ without a split (64-row dK/dV tiles, 80 columns):
    # causal, ragged, GQA 2:1
    (1, 136, 200, 2, 1, 80, True, MosaicConfig.default(80).replace(dq_fused=True, dq_fused_min_t=0, dq_fused_variants=True), False),
    # head_dim 256, the role-split dK/dV and dQ kernels: causal, T < S, GQA 2:1, lse cotangent
    (1, 136, 200, 2, 1, 256, True, None, True),
    # non-causal, T > S, ragged (slow: the role-split kernels run non-causal in CI with a variant,
    # test_interpret_variants_dkdv_roles); head_dim 192: the one-warpgroup dQ kernel
    pytest.param((1, 200, 136, 1, 1, 256, False, None, False), marks=pytest.mark.slow),
    (1, 100, 77, 1, 1, 192, False, None, False),
    # head_dim 160's defaults: 128-key forward tiles, persistent, causal tiles dealt greedily (64-byte
    # swizzle), the role-split dK/dV kernel; T < S ragged, GQA 2:1
    (1, 136, 300, 2, 1, 160, True, None, False),
    # fused dQ at head_dim 128: the two consumers split each dQ tile by columns (dq_split "cols")
    (1, 200, 136, 2, 1, 128, True, MosaicConfig.default(128).replace(dq_fused=True, dq_fused_min_t=0), False),
    # fused dQ, 64-row tiles at head_dim 64: no split (each consumer adds its own keys' partial)
    (1, 136, 136, 1, 1, 64, False, MosaicConfig.default(64).replace(dq_fused=True, dq_fused_min_t=0, block_q_dkv=64),
     False),
    # the non-causal head_dim 64 defaults (256-key forward tiles, 128-row dK/dV tiles), T > S,
    # ragged, GQA 2:1; the persistent forward with 2 CTAs for 6 query tiles (3 rounds, the K/V ring
    # running on across tiles)
    (1, 300, 136, 2, 1, 64, False, MosaicConfig.default(64).replace(persistent_ctas=2), False),
    # persistent causal, the cyclic deal (opt-in) of the LPT launch order, 3 CTAs for 4 tiles: a
    # partial last round (slow: the cyclic deal of a causal call runs in CI with a variant,
    # test_interpret_causal_variant_persistent_forward)
    pytest.param((2, 200, 264, 1, 1, 128, True,
                  MosaicConfig.default(128, is_causal=True).replace(persistent=True, persistent_ctas=3,
                                                                    persistent_deal="cyclic"), False),
                 marks=pytest.mark.slow),
    # persistent causal with the greedy deal (schedule.greedy_deal, the default's): 3 CTAs for 10
    # tiles (2 heads x 5 query tiles) of 1-5 key tiles each, uneven counts per CTA
    (1, 520, 520, 2, 1, 64, True,
     MosaicConfig.default(64, is_causal=True).replace(persistent=True, persistent_ctas=3,
                                                      persistent_deal="greedy", block_k=128), False),
]


@pytest.mark.parametrize("case", INTERPRET_CASES,
                         ids=lambda c: f"t{c[1]}-s{c[2]}-n{c[3]}k{c[4]}-h{c[5]}-c{int(c[6])}")
def test_interpret_numerics(case):
  from jax.experimental.pallas import mosaic_gpu as plgpu

  b, t, s, n, kh, h, causal, cfg, with_dlse = case
  scale = 1.0 / math.sqrt(h)
  ks = jax.random.split(jax.random.key(t * 1000 + s), 5)
  q = jax.random.normal(ks[0], (b, t, n, h), jnp.float32).astype(BF16)
  k = jax.random.normal(ks[1], (b, s, kh, h), jnp.float32).astype(BF16)
  v = jax.random.normal(ks[2], (b, s, kh, h), jnp.float32).astype(BF16)
  do = jax.random.normal(ks[3], (b, t, n, h), jnp.float32).astype(BF16)
  dlse = jax.random.normal(ks[4], (b, n, t), jnp.float32) if with_dlse else None

  params = plgpu.InterpretGPUParams()  # detect_races stays False (see module docstring)
  assert not params.detect_races
  f = _fwd_bwd(scale, causal, cfg, with_dlse=with_dlse)
  with emulated_mma(), plgpu.force_gpu_interpret_mode(params):
    assert emulating()
    got = jax.block_until_ready(jax.jit(f)(q, k, v, do, dlse))
  assert not emulating()
  ref = _reference(q, k, v, do, dlse, scale, causal)

  for name, x, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
    assert x.shape == r.shape, name
    xa = np.asarray(jnp.asarray(x, jnp.float32))
    assert np.isfinite(xa).all(), name
    if name == "lse":  # f32 statistics of bf16 logits: tight
      np.testing.assert_allclose(xa, np.asarray(r), atol=1e-3, rtol=0)
    else:  # bf16 inputs/outputs, f32 accumulation: a few bf16 ulps in relative L2
      err = _rel(x, r)
      assert err < 1e-2, (name, err)
  assert got[0].dtype == BF16 and got[1].dtype == jnp.float32
  assert all(g.dtype == BF16 for g in got[2:])
  if causal and s > t:  # keys past the last query are never attended: exactly zero gradients
    assert not np.asarray(got[3][:, t:], np.float32).any()
    assert not np.asarray(got[4][:, t:], np.float32).any()


# slow with the fused dQ: its dK/dV kernel maps its CTAs to sections by the same code (dkdv.py) as
# the separate pass's, which runs here in CI with the forward and the dQ kernel
@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_interpret_causal_lpt_sections(monkeypatch, fused):
  """Causal kernels with the launch order cut into several L2 sections (the budget shrunk so that 6
  (batch, head) pairs make sections of 4 and 2 heads in all three kernels): same numbers as the
  reference, so every CTA found its (batch, head, tile) exactly once."""
  from fa2_jax.kernels.sm90 import schedule as common
  h, t = 64, 144
  per_head = 2 * t * h * 2  # K+V (forward, dQ) or Q+dO (dK/dV) of one head, bf16
  monkeypatch.setattr(common, "L2_SECTION_BYTES", 4 * per_head)
  cfg = MosaicConfig.default(h, is_causal=True).replace(dq_fused=fused, dq_fused_min_t=0, num_stages_dkv=2,
                                                        lpt_heads_dkv=0)
  assert causal_section(cfg, n_bh=6, group=1, kv_bytes=per_head) == 4
  test_interpret_numerics((2, t, t, 3, 3, h, True, cfg, False))


def test_fused_dq_under_vmap_interpret():
  """vmap of the fused-dQ backward (its run_state has no batching rule; a custom_vmap folds the
  vmapped axis into the batch) equals the per-element results, with K/V shared (in_axes=None: they
  are broadcast, and their per-element gradients come back stacked)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  cfg = MosaicConfig.default(64).replace(dq_fused_min_t=0)  # fused at this short length too
  assert cfg.fuses_dq(136, deterministic=False)
  h, scale = 64, 1.0 / 8.0
  ks = jax.random.split(jax.random.key(3), 4)
  q = jax.random.normal(ks[0], (2, 1, 136, 2, h), jnp.float32).astype(BF16)  # [V, B, T, N, H]
  do = jax.random.normal(ks[1], (2, 1, 136, 2, h), jnp.float32).astype(BF16)
  k = jax.random.normal(ks[2], (1, 72, 1, h), jnp.float32).astype(BF16)
  v = jax.random.normal(ks[3], (1, 72, 1, h), jnp.float32).astype(BF16)

  def one(q, k, v, do):
    out, stats = forward(q, k, v, scale=scale, is_causal=False, config=cfg)
    return backward(q, k, v, out, stats, do, scale=scale, is_causal=False, config=cfg,
                    deterministic=False)

  with emulated_mma(), plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
    got = jax.jit(jax.vmap(one, in_axes=(0, None, None, 0)))(q, k, v, do)
    each = [jax.jit(one)(q[i], k, v, do[i]) for i in range(2)]
  for g, name in zip(got, ("dq", "dk", "dv")):
    assert g.shape[0] == 2, name
  for i in range(2):
    for g, e, name in zip(got, each[i], ("dq", "dk", "dv")):
      np.testing.assert_allclose(np.asarray(g[i], np.float32), np.asarray(e, np.float32),
                                 atol=2e-2, rtol=0, err_msg=name)


@pytest.mark.parametrize("fused, segments", [(True, False), (True, True), (False, False)])
def test_dq_accumulator_continues_a_running_dq_interpret(fused, segments):
  """A backward given a dQ accumulator (float32, a running sum of dQ / scale: the ring's steps)
  returns it with its own dQ / scale added: the fused dQ's reduce-adds start from it (plain and with
  segment ids, the variant kernels), the separate dQ's result is added to it; equal to the
  accumulator plus the call's dQ / scale, dK and dV unchanged."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from fa2_jax.validation import check_variant
  cfg = MosaicConfig.default(64).replace(dq_fused_min_t=0 if fused else 10 ** 6)
  assert cfg.fuses_dq(136, deterministic=False) == fused
  h, scale = 64, 1.0 / 8.0
  ks = jax.random.split(jax.random.key(5), 5)
  q = jax.random.normal(ks[0], (1, 136, 2, h), jnp.float32).astype(BF16)
  do = jax.random.normal(ks[1], (1, 136, 2, h), jnp.float32).astype(BF16)
  k = jax.random.normal(ks[2], (1, 72, 1, h), jnp.float32).astype(BF16)
  v = jax.random.normal(ks[3], (1, 72, 1, h), jnp.float32).astype(BF16)
  acc = jax.random.normal(ks[4], q.shape, jnp.float32)
  variant = arrays = None
  if segments:
    variant, arrays = check_variant(q, k, q_segment_ids=(jnp.arange(136)[None] >= 60).astype(
        jnp.int32), kv_segment_ids=(jnp.arange(72)[None] >= 30).astype(jnp.int32))

  def run(q, k, v, do, acc):
    out, stats = forward(q, k, v, scale=scale, is_causal=False, config=cfg, variant=variant,
                         arrays=arrays)
    kw = dict(scale=scale, is_causal=False, config=cfg, deterministic=False, variant=variant,
              arrays=arrays)
    return (backward(q, k, v, out, stats, do, **kw),
            backward(q, k, v, out, stats, do, dq_accumulator=acc, **kw))

  with emulated_mma(), plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
    (dq, dk, dv), (acc_out, dk2, dv2) = jax.jit(run)(q, k, v, do, acc)
  assert acc_out.dtype == jnp.float32 and acc_out.shape == q.shape
  want = np.asarray(acc) + np.asarray(dq, np.float32) / scale
  # dq was rounded to bf16 (2^-8 relative); the accumulator's sum was not
  np.testing.assert_allclose(np.asarray(acc_out), want, atol=2e-2 / scale, rtol=0)
  assert np.abs(np.asarray(acc_out) - np.asarray(acc)).max() > 1.0  # the call added its dQ
  np.testing.assert_array_equal(np.asarray(dk2, np.float32), np.asarray(dk, np.float32))
  np.testing.assert_array_equal(np.asarray(dv2, np.float32), np.asarray(dv, np.float32))


def test_dq_accumulator_is_aliased_in_place_for_sm90():
  """The fused dQ kernel given an accumulator lowers for sm90 with it aliased to its output (the
  reduce-adds continue it in place: no zero-filled buffer)."""
  cfg = MosaicConfig.default(128)
  sd = jax.ShapeDtypeStruct

  def f(q, k, v, do, acc):
    out, stats = forward(q, k, v, scale=0.1, is_causal=False, config=cfg)
    return backward(q, k, v, out, stats, do, scale=0.1, is_causal=False, config=cfg,
                    deterministic=False, dq_accumulator=acc)

  q, kv = sd((1, 2048, 4, 128), BF16), sd((1, 2048, 2, 128), BF16)
  text = jax.jit(f).trace(q, kv, kv, q, sd(q.shape, jnp.float32)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "fa2_mosaic_dkdv_dq" in text and "output_operand_aliases" in text


def test_equal_kernels_lower_once_per_program():
  """Four layers of fwd+bwd in one program: the Mosaic custom calls share 3 kernels (forward, dK/dV,
  dQ), not 12 — each distinct kernel is lowered and hashed once (its compile can then be shared)."""
  sd = jax.ShapeDtypeStruct((1, 256, 4, 128), BF16)
  scale = 1.0 / math.sqrt(128)

  def loss(q, k, v):
    x = q
    for _ in range(4):
      out, stats = forward(x, k, v, scale=scale, is_causal=True)
      do = jnp.ones_like(out)
      dq, dk, dv = backward(x, k, v, out, stats, do, scale=scale, is_causal=True)
      x = (out + dq + dk + dv).astype(BF16)
    return x

  text = jax.jit(loss).trace(sd, sd, sd).lower(lowering_platforms=("cuda",)).as_text()
  hashes = re.findall(r'kernel_hash = "((?:[^"\\]|\\.)*)"', text)
  assert len(set(hashes)) == 3, len(set(hashes))


# --- attention variants: emulated interpret numerics and sm90 lowering ----------------------------

VARIANT_CASES = {  # name: (b, t, s, n, kh, h, variant kwargs)
    "causal_window_segments_offset": (1, 200, 264, 2, 1, 64, lambda: dict(
        is_causal=True, local_window_size=(70, 0), q_offset=jnp.array([40]),
        q_segment_ids=jnp.array([[0] * 70 + [1] * 130]),
        kv_segment_ids=jnp.array([[0] * 110 + [1] * 154]))),
    # static key ranges (no lengths, segments, offset or mask_fn): Variant.static_ranges
    "causal_window_soft_cap_alibi": (2, 330, 330, 2, 1, 64, lambda: dict(
        is_causal=True, local_window_size=(100, 0), logits_soft_cap=5.0,
        alibi_slopes=jnp.array([0.1, 0.2]))),
    "lengths_soft_cap_alibi": (2, 136, 200, 2, 2, 64, lambda: dict(
        query_seq_lengths=jnp.array([100, 0]), key_value_seq_lengths=jnp.array([150, 77]),
        logits_soft_cap=2.0, alibi_slopes=jnp.array([0.1, 0.3]))),
    "mask_fn_score_fn": (1, 150, 150, 2, 1, 64, lambda: dict(  # a score-dependent derivative
        mask_fn=lambda b, h, i, j: (i - j) % 3 != 1,
        score_fn=lambda x, b, h, i, j: x * 0.7 + 0.3 * jnp.sin(2 * x) - (i - j).astype(x.dtype) / 64)),
    # functions that are not elementwise on arrays, called per pair (masking.per_pair): the formula
    # reduced over its whole grid, the kernels over a tile; with per-batch offsets
    "not_elementwise_user_fns": (2, 100, 140, 2, 1, 64, lambda: dict(
        q_offset=jnp.array([5, -3]),
        mask_fn=lambda b, h, i, j: (j <= jnp.min(i)) | ((jnp.sum(i) + j) % 3 == 0),
        score_fn=lambda x, b, h, i, j: x - 0.1 * jnp.max(x) + (jnp.sum(i) - j).astype(x.dtype) / 64)),
    # ALiBi without a cap, per-batch offsets, one 2^30 positions past the keys (the bias from each
    # row's nearest key, fa2_jax.kernels.masking.alibi_nearest_key, and the lse's shift back)
    "alibi_offsets_gqa": (2, 72, 130, 2, 1, 64, lambda: dict(
        is_causal=True, q_offset=jnp.array([2 ** 30 - 100, 7]),
        alibi_slopes=jnp.array([[0.1, 0.3], [0.05, 0.25]]))),
    # a soft cap alone: the forward's folded cap factor and the one-FMA backward; rows past the
    # query length have no key
    "soft_cap_window_gqa": (1, 140, 200, 4, 2, 64, lambda: dict(
        is_causal=True, local_window_size=(90, 0), logits_soft_cap=3.0,
        query_seq_lengths=jnp.array([120]))),
    # T and S whole numbers of every kernel's tiles: the masks leave out the rows-past-T and
    # keys-past-S terms (kernels/sm90/variant.py, Refs.keep), so lengths and segments must do it
    "whole_tiles_window_lengths_segments": (1, 256, 256, 2, 1, 64, lambda: dict(
        is_causal=True, local_window_size=(70, 0), query_seq_lengths=jnp.array([230]),
        key_value_seq_lengths=jnp.array([190]), q_segment_ids=jnp.array([[0] * 100 + [1] * 156]),
        kv_segment_ids=jnp.array([[0] * 120 + [1] * 136]))),
}


def _variant_run(q, k, v, do, variant, arrays, scale, cfg=None, deterministic=True):
  out, stats = forward(q, k, v, scale=scale, is_causal=variant.is_causal, variant=variant,
                       arrays=arrays, config=cfg)
  grads = backward(q, k, v, out, stats, do, scale=scale, is_causal=variant.is_causal,
                   variant=variant, arrays=arrays, config=cfg, deterministic=deterministic)
  lse = lse_from_stats(stats, scale, variant.modifies_scores)  # [B, N, T]
  shift = alibi_lse_shift(variant, arrays, q.shape[1], k.shape[1])  # [B, T, N] or None
  return (out, lse if shift is None else lse - jnp.swapaxes(shift, 1, 2), *grads)


FUSED_VARIANTS = MosaicConfig.default(64).replace(dq_fused_variants=True, dq_fused_min_t=0)


# The cases whose separate-dQ backward the persistent-forward tests below run (deterministic=True,
# the default backward): not run twice with the separate dQ kernel here (CI time).
SEPARATE_DQ_ELSEWHERE = ("lengths_soft_cap_alibi", "causal_window_segments_offset",
                         "causal_window_soft_cap_alibi")
# Separate-dQ cases marked slow (CI time): their fused-dQ case runs in CI, and what they add runs
# through the separate dK/dV and dQ kernels in CI elsewhere: windows, query lengths, segments, offsets,
# ALiBi and soft caps in the persistent-forward tests below; GQA there and in mask_fn_score_fn; a soft
# cap alone (the one-FMA backward) in test_extreme_logits.py's
# test_soft_cap_with_huge_scale_takes_the_fast_form_mosaic_emulated; the masks of whole tiles in the
# fused case, whose forward applies them as the dQ kernel does (Refs.keep on [rows, keys] tiles); the
# per-pair evaluation of user functions in the fused case's forward and dK/dV kernels (the dQ kernel
# evaluates them through the same Refs.keep / Refs.scores).
SEPARATE_DQ_SLOW = ("alibi_offsets_gqa", "soft_cap_window_gqa", "whole_tiles_window_lengths_segments",
                    "not_elementwise_user_fns")
# Fused-dQ case marked slow: its variant (static key ranges) runs with the separate dQ kernel in
# test_interpret_static_causal_variant_greedy_forward, whose dK/dV kernel reads the same range
# table; the fused dK/dV kernel runs every other variant here.
FUSED_DQ_SLOW = ("causal_window_soft_cap_alibi",)


def _slow_if(slow, *values):
  return pytest.param(*values, marks=pytest.mark.slow) if slow else values


@pytest.mark.parametrize("name, fused", [
    *(_slow_if(name in SEPARATE_DQ_SLOW, name, False)
      for name in VARIANT_CASES if name not in SEPARATE_DQ_ELSEWHERE),
    *(_slow_if(name in FUSED_DQ_SLOW, name, True) for name in VARIANT_CASES)],
    ids=lambda x: x if isinstance(x, str) else ("fused_dq" if x else "separate_dq"))
def test_interpret_variants(name, fused):
  """Forward and backward of the Mosaic kernels with attention variants in emulated interpret mode,
  against the float32 formula, with the separate dQ kernel and with dQ fused into the dK/dV kernel
  (``dq_fused_variants``). Eager calls: under one ``jit`` the interpreter runs the independent
  dK/dV and dQ kernels concurrently and its simulated barriers deadlock (a limit of the CPU
  interpreter, not of the kernels)."""
  assert not fused or FUSED_VARIANTS.fuses_dq(VARIANT_CASES[name][1], deterministic=False,
                                              variant=True)
  _check_interpret_variant(name, FUSED_VARIANTS if fused else None, deterministic=not fused)


def test_interpret_variants_dkdv_roles():
  """Head_dim 256 with the role-split dK/dV and dQ kernels (``dkv_roles``, ``dq_roles``; their dense
  cases in ``INTERPRET_CASES``): lengths (a batch element with no query row), a soft cap's derivative handed
  between the warpgroups with P, and ALiBi."""
  assert MosaicConfig.default(256).dkv_roles
  _check_interpret_variant("lengths_soft_cap_alibi", None, deterministic=True, h=256)


def test_interpret_variants_persistent_forward():
  """A variant (per-batch lengths with an empty batch element, soft cap, ALiBi) through the
  persistent forward: 3 CTAs for 8 query tiles, each tile's key range from the variant's table."""
  cfg = MosaicConfig.default(64).replace(persistent_ctas=3)
  assert cfg.persistent
  _check_interpret_variant("lengths_soft_cap_alibi", cfg, deterministic=True)


def test_interpret_causal_variant_persistent_forward():
  """A causal variant (window, packed segments, an offset) through the persistent forward with the
  cyclic deal (opt-in: under the default greedy deal a causal variant runs one CTA per tile, its key
  ranges (segments, an offset) being known only at run time): 2 CTAs for 4 query tiles."""
  cfg = MosaicConfig.default(64, is_causal=True).replace(persistent_ctas=2, persistent_deal="cyclic")
  assert cfg.forward_persistent(is_causal=True, known_work=False)
  assert not cfg.deals_greedily(is_causal=True, known_work=False)
  _check_interpret_variant("causal_window_segments_offset", cfg, deterministic=True)


def test_interpret_static_causal_variant_greedy_forward():
  """A causal variant whose key ranges follow from its static part (a window, a soft cap, ALiBi)
  through the persistent forward with the greedy deal the defaults give it: 3 CTAs for 12 query
  tiles weighing 1-3 key tiles of 64 each."""
  cfg = MosaicConfig.default(64, is_causal=True).replace(persistent_ctas=3, block_k=64)
  assert cfg.deals_greedily(is_causal=True, known_work=True)
  _check_interpret_variant("causal_window_soft_cap_alibi", cfg, deterministic=True)


@pytest.mark.parametrize("case, dealt", [
    ("default causal", True),  # the defaults deal a dense causal call's tiles greedily
    ("default non-causal", False),  # equal tiles: the cyclic deal
    ("cyclic causal", False),
    ("causal window", True),  # a variant whose key ranges follow from its static part
    ("causal lengths", False),  # one CTA per tile (key ranges known only at run time)
])
def test_forward_builds_the_greedy_deal_where_it_applies(case, dealt):
  """The forward computes the greedy deal's table (``forward._causal_deal``) for exactly the calls
  ``MosaicConfig.deals_greedily`` names, checked by tracing the kernel call for sm90 on the CPU."""
  from unittest import mock

  from fa2_jax.kernels.sm90 import forward as forward_module
  from fa2_jax.validation import check_variant

  causal = case != "default non-causal"
  cfg = MosaicConfig.default(128, is_causal=causal)
  if case == "cyclic causal":
    cfg = cfg.replace(persistent_deal="cyclic")
  q = jnp.zeros((4, 1000, 8, 128), BF16)
  kv = jnp.zeros((4, 1000, 4, 128), BF16)
  variant = arrays = None
  if case == "causal window":
    variant, arrays = check_variant(q, kv, is_causal=True, local_window_size=(300, 0),
                                    logits_soft_cap=20.0)
  elif case == "causal lengths":
    variant, arrays = check_variant(q, kv, is_causal=True, local_window_size=(300, 0),
                                    key_value_seq_lengths=jnp.full((4,), 900))
  calls = []
  real = forward_module._causal_deal

  def spy(st, variant_work=None):
    table = real(st, variant_work)
    calls.append((st, table))
    return table

  with mock.patch.object(forward_module, "_causal_deal", spy):
    jax.jit(lambda a, b_, c_: forward(a, b_, c_, scale=0.1, is_causal=causal, config=cfg,
                                      variant=variant, arrays=arrays)).trace(q, kv, kv)
  assert bool(calls) == dealt
  if dealt:
    st, table = calls[0]
    assert st.n_ctas == 132  # one per SM (ops.HOPPER_SMS without a GPU) for 4 x 8 heads x 8 tiles
    assert table[:, 0].sum() == 256 and set(table[:, 0].tolist()) <= {1, 2, 3, 4}
    positions = np.concatenate([table[c, 1:1 + table[c, 0]] for c in range(132)])
    assert sorted(positions.tolist()) == list(range(256))
    if variant is not None:  # query tile i sees key tiles [i - 3, i] (a window of 300 keys): 1-4
      from fa2_jax.kernels.block_ranges import static_kv_work
      work = static_kv_work(variant, seq_q=1000, seq_k=1000, block_q=128, block_k=128)
      assert work.tolist() == [1, 2, 3, 4, 4, 4, 4, 4]


def _check_interpret_variant(name, cfg, *, deterministic, h=None):
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from fa2_jax.validation import check_variant

  b, t, s, n, kh, case_h, make_kwargs = VARIANT_CASES[name]
  h = h or case_h
  kwargs = make_kwargs()
  ks = jax.random.split(jax.random.key(t + s), 4)
  q = jax.random.normal(ks[0], (b, t, n, h), jnp.float32).astype(BF16)
  k = jax.random.normal(ks[1], (b, s, kh, h), jnp.float32).astype(BF16)
  v = jax.random.normal(ks[2], (b, s, kh, h), jnp.float32).astype(BF16)
  do = jax.random.normal(ks[3], (b, t, n, h), jnp.float32).astype(BF16)
  variant, arrays = check_variant(q, k, **kwargs)
  scale = 1.0 / math.sqrt(h)
  with emulated_mma(), plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
    got = jax.block_until_ready(_variant_run(q, k, v, do, variant, arrays, scale, cfg,
                                             deterministic=deterministic))

  def ref(q, k, v):
    return fa2_jax.reference_attention(q, k, v, scale=scale, return_residual=True,
                                       compute_dtype=jnp.float32, **kwargs)

  @jax.jit  # one compile of the formula (eagerly: one per op)
  def expected(q, k, v, do):
    (out, lse), vjp = jax.vjp(ref, q, k, v)
    return (out, jnp.swapaxes(lse, 1, 2), *vjp((do, jnp.zeros_like(lse))))

  want = expected(q, k, v, do)
  for what, x, r in zip(("out", "lse", "dq", "dk", "dv"), got, want):
    x, r = np.asarray(x, np.float32), np.asarray(r, np.float32)
    fin = np.isfinite(r)
    np.testing.assert_array_equal(np.isfinite(x), fin, err_msg=what)
    x, r = np.where(fin, x, 0), np.where(fin, r, 0)
    err = np.abs(x - r).max() / (np.abs(r).max() + 1)
    assert err < 1e-2, (what, err)


@pytest.mark.parametrize("fused", [False, True], ids=["separate_dq", "fused_dq"])
def test_alibi_from_the_nearest_key_lowers_for_sm90(fused):
  """ALiBi without a score_fn takes each row's distances from its nearest key (int32 arithmetic on
  the WGMMA-layout index tiles, fa2_jax.kernels.masking.alibi_nearest_key): every kernel lowers for sm90 (the
  variant test below has a score_fn, which keeps the bias as written)."""
  from fa2_jax.validation import check_variant
  b, t, s, n, kh, h = 2, 1000, 777, 4, 2, 128
  sd = jax.ShapeDtypeStruct
  q, kv = sd((b, t, n, h), BF16), sd((b, s, kh, h), BF16)
  variant, arrays = check_variant(q, kv, is_causal=True, q_offset=jnp.array([2 ** 29, 0]),
                                  alibi_slopes=jnp.ones((n,)))
  assert variant.has_alibi and variant.score_fn is None
  cfg = MosaicConfig.default(h).replace(dq_fused_variants=True, dq_fused_min_t=0) if fused else None
  f = lambda q, k, v, do, arrays: _variant_run(q, k, v, do, variant, arrays, h ** -0.5, cfg,  # noqa: E731
                                               deterministic=not fused)
  text = jax.jit(f).trace(q, kv, kv, q, arrays).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("stablehlo.custom_call @mosaic_gpu") == (2 if fused else 3)


# slow (CI time: about 12 s): the fused dQ, whose kernel lowers in CI with a variant under vmap
# (test_fused_dq_variant_under_vmap_lowers_for_sm90) and whose dK/dV code with every variant here
# (dkdv.py, the separate pass's)
@pytest.mark.parametrize("h, fused", [(128, False), (256, False),
                                      pytest.param(128, True, marks=pytest.mark.slow)])
def test_variant_kernels_lower_for_sm90(h, fused):
  """256: the role-split dK/dV kernel; fused: dQ inside the dK/dV kernel (``dq_fused_variants``)."""
  from fa2_jax.validation import check_variant
  b, t, s, n, kh = 2, 1000, 777, 4, 2
  sd = jax.ShapeDtypeStruct
  q, kv = sd((b, t, n, h), BF16), sd((b, s, kh, h), BF16)
  kwargs = dict(is_causal=True, local_window_size=(300, 0), q_offset=jnp.array([5, 0]),
                query_seq_lengths=jnp.array([900, 1000]), key_value_seq_lengths=jnp.array([777, 500]),
                q_segment_ids=jnp.zeros((b, t), jnp.int32), kv_segment_ids=jnp.zeros((b, s), jnp.int32),
                logits_soft_cap=30.0, alibi_slopes=jnp.ones((n,)),
                mask_fn=lambda b_, h_, i, j: (i + j) % 5 != 0, score_fn=lambda x, *_: x * 0.5)
  variant, arrays = check_variant(q, kv, **kwargs)
  cfg = MosaicConfig.default(h).replace(dq_fused_variants=True, dq_fused_min_t=0) if fused else None
  f = lambda q, k, v, do, arrays: _variant_run(q, k, v, do, variant, arrays, h ** -0.5, cfg,
                                               deterministic=not fused)
  text = jax.jit(f).trace(q, kv, kv, q, arrays).lower(lowering_platforms=("cuda",)).as_text()
  kernels = (("forward", "dkdv_dq") if fused else
             ("forward", "dkdv_roles", "dq_roles") if h == 256 else ("forward", "dkdv", "dq"))
  assert text.count("stablehlo.custom_call @mosaic_gpu") == len(kernels)
  assert set(re.findall(r"fa2_mosaic_(forward|dkdv_dq|dkdv_roles|dkdv|dq_roles|dq)_mosaic_gpu", text)) == set(kernels)


def test_fused_dq_under_vmap_keeps_the_batch_index_of_mask_fn():
  """vmap of a fused-dQ backward whose ``mask_fn`` reads the batch index: the kernels hand the
  function their grid's batch index, so the vmapped axis cannot fold into the batch there
  (``ops.batch_rule`` runs one launch per mapped element); each element's results equal the
  formula's for that element alone."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from fa2_jax.validation import check_variant
  b, t, n, kh, h, lead = 1, 72, 2, 1, 64, 2
  ks = jax.random.split(jax.random.key(11), 4)
  q, do = (jax.random.normal(x, (lead, b, t, n, h), jnp.float32).astype(BF16) for x in ks[:2])
  k, v = (jax.random.normal(x, (lead, b, t, kh, h), jnp.float32).astype(BF16) for x in ks[2:])
  variant, arrays = check_variant(q[0], k[0], mask_fn=lambda b_, h_, i, j: (i + j + b_) % 3 != 0)
  f = lambda q, k, v, do: _variant_run(q, k, v, do, variant, arrays, h ** -0.5, FUSED_VARIANTS,  # noqa: E731
                                       deterministic=False)
  assert FUSED_VARIANTS.fuses_dq(t, deterministic=False, variant=True)
  with emulated_mma(), plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
    mapped = jax.block_until_ready(jax.vmap(f)(q, k, v, do))

  @jax.jit  # one compile of the formula (eagerly: one per op)
  def ref(q, k, v, do):  # one element: the formula, batch index 0
    def attn(q, k, v):
      return fa2_jax.reference_attention(q, k, v, scale=h ** -0.5, return_residual=True,
                                         compute_dtype=jnp.float32, mask_fn=variant.mask_fn)
    (out, lse), vjp = jax.vjp(attn, q, k, v)
    return (out, jnp.swapaxes(lse, 1, 2), *vjp((do, jnp.zeros_like(lse))))

  single = [ref(q[i], k[i], v[i], do[i]) for i in range(lead)]
  for what, x, *per in zip(("out", "lse", "dq", "dk", "dv"), mapped, *single):
    x, r = np.asarray(x, np.float32), np.stack([np.asarray(y, np.float32) for y in per])
    err = np.abs(x - r).max() / (np.abs(r).max() + 1)
    assert err < 1e-2, (what, err)  # the folded index gave 45% of the elements off


def test_fused_dq_variant_under_vmap_lowers_for_sm90():
  """vmap of a variant's backward with the fused dQ: the custom_vmap folds the vmapped axis into the
  batch of every operand, the variant's (range table, lengths, segment ids) too."""
  from fa2_jax.validation import check_variant
  b, t, s, n, kh, h = 2, 300, 260, 2, 1, 128
  sd = jax.ShapeDtypeStruct
  q, kv = sd((b, t, n, h), BF16), sd((b, s, kh, h), BF16)
  variant, arrays = check_variant(q, kv, is_causal=True, local_window_size=(100, 0),
                                  key_value_seq_lengths=jnp.array([260, 200]),
                                  q_segment_ids=jnp.zeros((b, t), jnp.int32),
                                  kv_segment_ids=jnp.zeros((b, s), jnp.int32))
  cfg = MosaicConfig.default(h).replace(dq_fused_variants=True, dq_fused_min_t=0)
  f = lambda q, k, v, do, arrays: _variant_run(q, k, v, do, variant, arrays, h ** -0.5, cfg,
                                               deterministic=False)
  g = jax.vmap(f, in_axes=(0, 0, 0, 0, None))
  qs, kvs = sd((3, b, t, n, h), BF16), sd((3, b, s, kh, h), BF16)
  traced = jax.jit(g).trace(qs, kvs, kvs, qs, arrays)
  assert [o.shape for o in traced.out_info[2:]] == [qs.shape, kvs.shape, kvs.shape]
  text = traced.lower(lowering_platforms=("cuda",)).as_text()
  assert set(re.findall(r"fa2_mosaic_(forward|dkdv_dq|dkdv_roles|dkdv|dq_roles|dq)_mosaic_gpu", text)) == {
      "forward", "dkdv_dq"}
