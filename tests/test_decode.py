"""The decode family (kernels/decode): a few new query rows against a long key/value cache.

Out, lse and gradients against the float64 formula (``fa2_jax.reference_attention``) for the
decoding shapes and variants it runs (T_new 1, 4, 16; GQA, MQA, MHA; ragged per-row lengths with an
empty and a full row; per-row and scalar ``q_offset``; windows; soft cap; ALiBi; one split and
several; bfloat16 and float32), the split heuristic, and dispatch: which calls it takes, why, and
what falls through to the training families. On CPU the kernels run in Pallas interpret mode.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa2_jax
from conftest import on_gpu
from fa2_jax.kernels import registry
from fa2_jax.kernels.decode import backend as decode_backend
from fa2_jax.kernels.decode.config import (DecodeConfig, DecodeLaunch, MAX_SPLITS,
                                           grid_splits_by_length, length_splits,
                                           num_splits_heuristic, row_splits)

INTERPRET = None if on_gpu() else True
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# Errors as tests/test_attention.py bounds them: at most twice the formula's own error in the input
# dtype plus atol * (max |reference| + 1).
ATOL = {"float32": 2e-5, "bfloat16": 2e-3, "float16": 5e-4}


def _inputs(b, t, n, kh, h, s, dtype, seed=0, nan_past=None):
  ks = jax.random.split(jax.random.key(seed), 3)
  dt = DTYPES[dtype]
  q = jax.random.normal(ks[0], (b, t, n, h), jnp.float32).astype(dt)
  k = jax.random.normal(ks[1], (b, s, kh, h), jnp.float32).astype(dt)
  v = jax.random.normal(ks[2], (b, s, kh, h), jnp.float32).astype(dt)
  if nan_past is not None:  # NaN in the cache past each row's length: never attended
    past = (jnp.arange(s)[None, :] >= jnp.asarray(nan_past)[:, None])[:, :, None, None]
    k, v = jnp.where(past, jnp.nan, k).astype(dt), jnp.where(past, jnp.nan, v).astype(dt)
  return q, k, v


def _reference(q, k, v, compute_dtype=None, **kw):
  """(out, lse) as float64 numpy: the formula in float64 (compute_dtype None) or in the inputs'
  dtype (the error budget)."""
  cpu = jax.devices("cpu")[0]
  if compute_dtype is not None:
    out, lse = jax.jit(lambda a, b, c: fa2_jax.reference_attention(
        a, b, c, compute_dtype=compute_dtype, return_residual=True, **kw))(q, k, v)
    return np.asarray(out.astype(jnp.float32), np.float64), np.asarray(lse, np.float64)
  with jax.enable_x64(True):
    args = [jax.device_put(np.asarray(x.astype(jnp.float32), np.float64), cpu) for x in (q, k, v)]
    out, lse = jax.jit(lambda a, b, c: fa2_jax.reference_attention(
        a, b, c, return_residual=True, **kw))(*args)
    return np.asarray(out), np.asarray(lse)


def _split(kw):
  """(array keywords, the others): the arrays become arguments of a jitted call."""
  arrays = {n: x for n, x in kw.items() if isinstance(x, jax.Array)}
  return arrays, {n: x for n, x in kw.items() if n not in arrays}


def _jit_call(q, k, v, config=None, **kw):
  """flash_attention(..., return_residual=True) under jit: one compile (eager, every op of the
  wrapper compiles on its own, several times slower in interpret mode)."""
  arrays, static = _split(kw)
  return jax.jit(lambda a, b, c, arr: fa2_jax.flash_attention(
      a, b, c, interpret=INTERPRET, return_residual=True, block_sizes=config, **static, **arr))(
          q, k, v, arrays)


def _check(q, k, v, config=None, **kw):
  """Runs the call on the decode kernels (asserting that dispatch picks them) and checks out and
  lse against the float64 formula. Returns (out, lse) as numpy."""
  d = fa2_jax.backend_for(q, k, v, interpret=INTERPRET, block_sizes=config, **kw)
  assert d.backend == "decode", d
  out, lse = _jit_call(q, k, v, config=config, **kw)
  assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:3]
  got = [np.asarray(out.astype(jnp.float32), np.float64), np.asarray(lse, np.float64)]
  ref = _reference(q, k, v, **kw)
  dtype = jnp.dtype(q.dtype).name
  low = (_reference(q, k, v, compute_dtype=q.dtype, **kw) if dtype != "float32" else ref)
  for name, g, r, lo in zip(("out", "lse"), got, ref, low):
    np.testing.assert_array_equal(np.isneginf(g), np.isneginf(r), err_msg=f"{name}: -inf rows")
    fin = np.isfinite(r)
    assert np.all(np.isfinite(g[fin])), f"{name}: non-finite values"
    err = np.max(np.abs(g[fin] - r[fin]), initial=0.0)
    budget = 2 * np.max(np.abs(lo[fin] - r[fin]), initial=0.0)
    bound = budget + ATOL[dtype] * (np.max(np.abs(r[fin]), initial=0.0) + 1.0)
    assert err <= bound, f"{name}: error {err:.3g} > bound {bound:.3g} ({d})"
  return got


# --- forward: out and lse ------------------------------------------------------------------------

def test_one_row_gqa_ragged_lengths_several_splits():
  """T_new = 1, GQA (8 query heads on 2 KV heads), per-row lengths with an empty row (out 0, lse
  -inf) and a full one, q_offset = lengths - 1, 3 splits forced; NaN stored past each length."""
  lens = jnp.array([300, 0, 137], jnp.int32)
  q, k, v = _inputs(3, 1, 8, 2, 32, 300, "float32", nan_past=lens)
  cfg = DecodeConfig(block_k=32, num_splits=3)
  assert "3 splits" in str(fa2_jax.backend_for(q, k, interpret=INTERPRET, block_sizes=cfg,
                                               is_causal=True, key_value_seq_lengths=lens,
                                               q_offset=lens - 1))
  out, lse = _check(q, k, v, cfg, is_causal=True, key_value_seq_lengths=lens, q_offset=lens - 1)
  np.testing.assert_array_equal(out[1], 0.0)
  assert np.all(np.isneginf(lse[1])) and np.all(np.isfinite(lse[[0, 2]]))


def test_combine_of_a_sixteen_row_tile_at_head_dim_64():
  """The combine merging a 16-row tile (T_new = 4 x 4 query heads of one KV head) at head_dim 64,
  two 32-column chunks per row, with an empty row: the formula's result."""
  lens = jnp.array([300, 0, 137], jnp.int32)
  q, k, v = _inputs(3, 4, 4, 1, 64, 300, "float32", nan_past=lens, seed=5)
  _check(q, k, v, DecodeConfig(block_k=32, num_splits=3), is_causal=True,
         key_value_seq_lengths=lens, q_offset=lens - 4)


def test_combine_loads_splits_in_chunks():
  """A 64-row tile (T_new = 16 x 4 query heads of one KV head) over 20 splits: more partials than a
  combine program loads at once, so it merges them in chunks (the last one part-empty), per-row
  lengths leaving some rows fewer splits' worth of keys; the formula's result. And the tiling
  rule: every split in one load where they fit, whole power-of-two chunks otherwise."""
  from fa2_jax.kernels.decode.forward import COMBINE_ELEMENTS, combine_tiling
  cols, step = combine_tiling(20, 64, 64)
  assert step < 20 and step * 64 * cols <= COMBINE_ELEMENTS, (cols, step)
  assert combine_tiling(32, 16, 128) == (16, 32)  # 1 x 8k GQA 32/8: every split at once
  assert combine_tiling(17, 32, 128) == (8, 32)  # MQA 32/1: 17 splits padded to 32
  assert combine_tiling(2, 16, 16) == (16, 2)
  lens = jnp.array([640, 333], jnp.int32)
  q, k, v = _inputs(2, 16, 4, 1, 64, 640, "float32", nan_past=lens, seed=7)
  _check(q, k, v, DecodeConfig(block_k=16, num_splits=20), is_causal=True,
         key_value_seq_lengths=lens, q_offset=lens - 16)


def test_four_rows_mqa_window_soft_cap_query_lengths_bf16_one_split():
  """T_new = 4, MQA (one KV head), bfloat16, one split: bottom-right causal rows (q_offset =
  lengths - 4) with a sliding window, a soft cap and query lengths (a padded row)."""
  lens = jnp.array([512, 45], jnp.int32)
  q, k, v = _inputs(2, 4, 4, 1, 64, 512, "bfloat16", seed=1)
  _check(q, k, v, DecodeConfig(block_k=64, num_splits=1), is_causal=True,
         key_value_seq_lengths=lens, q_offset=lens - 4, local_window_size=(64, 0),
         logits_soft_cap=20.0, query_seq_lengths=jnp.array([4, 3], jnp.int32))


def test_sixteen_rows_mha_alibi_scalar_offset_heuristic_splits():
  """T_new = 16, MHA, a scalar q_offset, ALiBi, the heuristic's splits."""
  q, k, v = _inputs(2, 16, 2, 2, 16, 384, "float32", seed=2)
  _check(q, k, v, is_causal=True, q_offset=300, alibi_slopes=jnp.array([0.05, 0.3], jnp.float32))


def test_dense_gqa_ragged_head_dim_and_keys_bf16():
  """No variant at all (a cross-attention-like call): head_dim 40 (padded to 64 in the tile), S not
  a multiple of block_k, 4 splits, two-sided window on another call."""
  q, k, v = _inputs(2, 2, 8, 2, 40, 260, "bfloat16", seed=3)
  _check(q, k, v, DecodeConfig(block_k=32, num_splits=4))
  lens = jnp.array([260, 200], jnp.int32)
  _check(q, k, v, DecodeConfig(block_k=16, num_splits=5), key_value_seq_lengths=lens,
         q_offset=jnp.array([100, 7], jnp.int32), local_window_size=(50, 20))


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    (4, 1, 32, 8, 128, 4096, "bfloat16", None),
    (2, 4, 16, 2, 64, 8192, "float16", None),
    (3, 16, 4, 4, 256, 2048, "bfloat16", 7),
    (64, 1, 8, 1, 128, 1024, "bfloat16", None),
], ids=lambda c: "-".join(map(str, c[:7])))
def test_compiled_decoding_shapes_gpu(case):
  """Compiled (GPU): the decoding shapes the kernels are made for, ragged rows, heuristic splits."""
  b, t, n, kh, h, s, dtype, splits = case
  q, k, v = _inputs(b, t, n, kh, h, s, dtype, seed=9)
  lens = jnp.asarray(np.linspace(s, t, b).astype(np.int32))
  _check(q, k, v, DecodeConfig.default(h, DTYPES[dtype]).replace(num_splits=splits),
         is_causal=True, key_value_seq_lengths=lens, q_offset=lens - t)


# --- backward: the training family's, exact ------------------------------------------------------

def test_grad_through_a_decoding_call_matches_the_formula():
  """jax.grad through a decoding call (out and lse cotangents) runs the training family's backward
  on the decode forward's statistics: equal to the formula's gradients."""
  lens = jnp.array([256, 0, 70], jnp.int32)
  q, k, v = _inputs(3, 2, 4, 2, 16, 256, "float32", seed=4)
  kw = dict(is_causal=True, key_value_seq_lengths=lens, q_offset=lens - 2)
  cfg = DecodeConfig(block_k=32, num_splits=2)
  d = fa2_jax.backend_for(q, k, interpret=INTERPRET, block_sizes=cfg, **kw)
  assert d.backend == "decode" and d.backward and "backward is" in d.reason, d

  def loss(fn):
    def f(a, b, c):
      out, lse = fn(a, b, c)
      lse = jnp.where(jnp.isneginf(lse), 0.0, lse)
      return jnp.sum(out * jnp.cos(out)) + jnp.sum(jnp.sin(lse))
    return f

  mine = jax.jit(jax.grad(loss(lambda a, b, c: fa2_jax.flash_attention(
      a, b, c, interpret=INTERPRET, block_sizes=cfg, return_residual=True, **kw)),
      argnums=(0, 1, 2)))(q, k, v)
  with jax.enable_x64(True):
    q64, k64, v64 = (jnp.asarray(np.asarray(x), jnp.float64) for x in (q, k, v))
    ref = jax.jit(jax.grad(loss(lambda a, b, c: fa2_jax.reference_attention(
        a, b, c, return_residual=True, **kw)), argnums=(0, 1, 2)))(q64, k64, v64)
    ref = [np.asarray(x) for x in ref]
  for name, a, r in zip(("dq", "dk", "dv"), mine, ref):
    err = np.max(np.abs(np.asarray(a, np.float64) - r))
    assert err <= 5e-5 * (np.max(np.abs(r)) + 1.0), f"{name}: error {err:.3g}"
  np.testing.assert_array_equal(np.asarray(mine[0])[1], 0.0)  # the empty row: no gradient


def test_traced_out_of_range_values_act_as_clipped():
  """The decode kernel takes int32 lengths and offsets as given (no XLA op before it) and clips them
  itself: traced values past their ranges (lengths < 0 or > S, offsets at the ends of int32) give
  what the clipped ones give, out, lse (ALiBi: its shift read from the offsets) and gradients; the
  clipped call matches the formula (the backward takes the clipped values)."""
  edge = (1 << 30) - 1
  q, k, v = _inputs(3, 2, 4, 2, 16, 256, "float32", seed=5)
  slopes = jnp.array([0.5, 0.25, 0.125, 0.0625], jnp.float32)
  cfg = DecodeConfig(block_k=32, num_splits=2)
  kw = dict(is_causal=True, alibi_slopes=slopes, block_sizes=cfg, interpret=INTERPRET,
            return_residual=True)
  # Row 0: every key, ALiBi distances from an offset at int32's end (row 1 would wrap); row 1: an
  # offset before every key (wrapped, j - p would pass int32); row 2: a negative length (empty).
  far = (jnp.array([300, 2 ** 31 - 1, -7], jnp.int32), jnp.array([2 ** 31 - 1, -2 ** 31, 90],
                                                                   jnp.int32))
  near = (jnp.array([256, 256, 0], jnp.int32), jnp.array([edge, -edge, 90], jnp.int32))
  d = fa2_jax.backend_for(q, k, key_value_seq_lengths=near[0], q_offset=near[1],
                          **{n: x for n, x in kw.items() if n != "return_residual"})
  assert d.backend == "decode", d

  def run(lens, off):
    def loss(a, b, c):
      out, lse = fa2_jax.flash_attention(a, b, c, key_value_seq_lengths=lens, q_offset=off, **kw)
      return jnp.sum(out * jnp.cos(out)) + jnp.sum(jnp.where(jnp.isneginf(lse), 0.0, jnp.sin(lse)))
    out = fa2_jax.flash_attention(q, k, v, key_value_seq_lengths=lens, q_offset=off, **kw)
    return (*out, *jax.grad(loss, argnums=(0, 1, 2))(q, k, v))

  run = jax.jit(run)
  got, want = run(*far), run(*near)
  for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)
  with jax.enable_x64(True):
    args = [jnp.asarray(np.asarray(x), jnp.float64) for x in (q, k, v)]
    ref_out, ref_lse = fa2_jax.reference_attention(
        *args, key_value_seq_lengths=near[0], q_offset=near[1], is_causal=True,
        alibi_slopes=slopes, return_residual=True)
  fin = np.isfinite(np.asarray(ref_lse))
  np.testing.assert_array_equal(np.isneginf(np.asarray(want[1])), np.isneginf(np.asarray(ref_lse)))
  np.testing.assert_allclose(np.asarray(want[1])[fin], np.asarray(ref_lse)[fin], atol=1e-4)
  np.testing.assert_allclose(np.asarray(want[0]), np.asarray(ref_out), atol=1e-4)


def test_a_call_padded_past_decoding_shape_runs_the_training_forward():
  """reuse_kernels_across_programs(length_multiple=...) pads T for the kernels: the launched call is
  no longer decode-shaped, and the training family's forward runs it (same results)."""
  lens = jnp.array([300, 41], jnp.int32)
  q, k, v = _inputs(2, 1, 4, 2, 16, 300, "float32", seed=5)
  previous = fa2_jax.reuse_kernels_across_programs(True, length_multiple=64)
  try:
    _check(q, k, v, is_causal=True, key_value_seq_lengths=lens, q_offset=lens - 1)
  finally:
    fa2_jax.reuse_kernels_across_programs(previous)


# --- dispatch ------------------------------------------------------------------------------------

def _shapes(b=2, t=1, n=8, kh=2, h=64, s=1024, dtype=jnp.bfloat16):
  return (jax.ShapeDtypeStruct((b, t, n, h), dtype), jax.ShapeDtypeStruct((b, s, kh, h), dtype))


def test_backend_for_names_decode_and_why():
  q, k = _shapes()
  lens = jax.ShapeDtypeStruct((2,), jnp.int32)
  d = fa2_jax.backend_for(q, k, interpret=True, is_causal=True, key_value_seq_lengths=lens,
                          q_offset=lens)
  assert d.backend == "decode", d
  assert d.forward[0].startswith("decode split-KV forward") and d.backward == (
      "triton dK/dV", "triton dQ") or on_gpu(), d
  assert "a decoding call (T=1 new rows x 4 query heads per KV head = 4 rows in one 16-row tile" \
      in d.reason and "interpret=True" in d.reason, d.reason
  # the registry tries it first
  assert registry.names()[0] == "decode"
  assert registry.for_config(DecodeConfig()) is registry.get("decode")


@pytest.mark.parametrize("shape, kw, why", [
    (dict(t=1024, s=1024), {}, "at most 16 new query rows, got T=1024"),
    (dict(t=16, n=8, kh=1), dict(is_causal=True, q_offset=5), "at most 64 rows"),
    (dict(t=1, s=128), {}, "keys S >= 256"),
    (dict(t=16, n=2, kh=2, s=100 * 1), {}, "keys S >= 256"),
    (dict(t=1), dict(is_causal=True), "top-left causal"),
    (dict(t=1, h=512), {}, "head_dim <= 256"),
])
def test_calls_that_are_not_decode_shaped_fall_through(shape, kw, why):
  q, k = _shapes(**shape)
  d = fa2_jax.backend_for(q, k, interpret=True, **kw)
  assert d.backend != "decode", d
  if q.shape[-1] <= 256:
    assert d.backend == "triton", d
  with pytest.raises(ValueError, match=f"implementation='decode' cannot run this call: .*{why}"):
    fa2_jax.backend_for(q, k, interpret=True, implementation="decode", **kw)
  with pytest.raises(ValueError, match="block_sizes is a DecodeConfig"):
    fa2_jax.backend_for(q, k, interpret=True, block_sizes=DecodeConfig(), **kw)


def test_variants_it_lacks_fall_through_to_triton():
  q, k = _shapes(b=1)
  seg = jax.ShapeDtypeStruct((1, 1), jnp.int32), jax.ShapeDtypeStruct((1, 1024), jnp.int32)
  for kw, name in ((dict(q_segment_ids=seg[0], kv_segment_ids=seg[1]), "q_segment_ids"),
                   (dict(mask_fn=lambda b, h, i, j: j <= i + 3), "mask_fn"),
                   (dict(score_fn=lambda s, b, h, i, j: s * 0.5), "score_fn")):
    d = fa2_jax.backend_for(q, k, interpret=True, **kw)
    assert d.backend == "triton", d
    with pytest.raises(ValueError, match=f"implementation='decode' cannot run this call: it does "
                       f"not implement {name}"):
      fa2_jax.backend_for(q, k, interpret=True, implementation="decode", **kw)


def test_off_gpu_without_interpret_runs_the_formula():
  if on_gpu():
    pytest.skip("CPU dispatch rule")
  q, k = _shapes()
  assert fa2_jax.backend_for(q, k).backend == "xla"


def test_static_split_counts_fill_the_sms_and_pages_ask_two_per_sm(monkeypatch):
  """Without run-time lengths (or with one row) every row takes the even count on 132 SMs (an
  H100's): 8 x 32k GQA 32/8 (64 programs) 2 splits; one row of 8 KV heads 16 splits from a
  contiguous cache, 32 from a paged one (kernels/decode/backend.py PAGED_EVEN_WAVES)."""
  monkeypatch.setattr(decode_backend, "sm_count", lambda: 132)
  q, k = _shapes(b=8, n=32, kh=8, h=128, s=32768)
  d = fa2_jax.backend_for(q, k, interpret=True)
  assert d.forward[0] == "decode split-KV forward (2 splits)", d
  lens = jax.ShapeDtypeStruct((1,), jnp.int32)
  kw = dict(interpret=True, is_causal=True, key_value_seq_lengths=lens, q_offset=lens)
  q1, k1 = _shapes(b=1, n=32, kh=8, h=128, s=32768)
  assert fa2_jax.backend_for(q1, k1, **kw).forward[0] == "decode split-KV forward (16 splits)"
  pages = jax.ShapeDtypeStruct((256, 128, 8, 128), jnp.bfloat16)
  table = jax.ShapeDtypeStruct((1, 256), jnp.int32)
  d = fa2_jax.backend_for(q1, pages, pages, block_table=table, **kw)
  assert "through the table" in d.reason and d.forward[0] == "decode split-KV forward (32 splits)", d


def test_a_forced_split_count_shows_in_backend_for():
  q, k = _shapes(s=4096)
  for splits, names in ((1, ("decode split-KV forward (1 split)",)),
                        (7, ("decode split-KV forward (7 splits)", "decode combine"))):
    d = fa2_jax.backend_for(q, k, interpret=True, block_sizes=DecodeConfig(num_splits=splits))
    assert d.forward == names, d


def test_ragged_rows_take_their_own_split_counts():
  """The default config on a ragged batch: each row's split count from its reachable keys at run
  time (a long row many, an empty or short row one), the unused programs of the grid writing
  nothing; out and lse against the float64 formula, with NaN stored past each row's length, and with
  a window that leaves a long row few reachable keys."""
  lens = jnp.array([1000, 0, 40, 700, 1024], jnp.int32)
  q, k, v = _inputs(5, 1, 4, 2, 32, 1024, "float32", nan_past=lens)
  kw = dict(is_causal=True, key_value_seq_lengths=lens, q_offset=lens - 1)
  d = fa2_jax.backend_for(q, k, v, interpret=INTERPRET, **kw)
  assert "up to" in d.forward[0] and d.forward[1] == "decode combine", d
  assert "from the rows' reachable keys at run time" in d.reason, d
  _check(q, k, v, **kw)
  _check(q, k, v, local_window_size=(100, 0), **kw)
  # the same rows as one fixed split count: the static grid
  _check(q, k, v, DecodeConfig(num_splits=4), **kw)
  # MQA's 32-row tiles keep one count for every row; so does a single row
  q32 = jnp.zeros((5, 1, 32, 32), jnp.float32)
  d = fa2_jax.backend_for(q32, k[:, :, :1], interpret=INTERPRET, **kw)
  assert d.backend == "decode" and "up to" not in d.forward[0], d
  d = fa2_jax.backend_for(q[:1], k[:1], interpret=INTERPRET, is_causal=True,
                          key_value_seq_lengths=lens[:1], q_offset=lens[:1] - 1)
  assert d.backend == "decode" and "up to" not in d.forward[0], d


def test_row_split_counts():
  # the grid: 3x the static count, at most what one row with every key of the batch would take
  assert grid_splits_by_length(8, 512, 5, sms=132, waves=2) == 15
  assert grid_splits_by_length(8, 512, 5, sms=132, waves=2, factor=4) == 20
  assert grid_splits_by_length(8, 512, 12, sms=132, waves=2) == 33
  assert grid_splits_by_length(8, 16, 5, sms=132, waves=2) == 8  # no split under 2 blocks
  assert grid_splits_by_length(1, 4096, 50, sms=132, waves=2) == MAX_SPLITS
  # full rows: the static count's chunks (8 rows x 8 heads x 512 blocks over 264 programs)
  full = row_splits(jnp.full((8,), 512), kv_heads=8, grid_splits=33, target=264)
  assert list(np.asarray(full)) == [5] * 8
  # ragged: rows split in proportion to their blocks, an empty row once, none past the grid
  counts = np.asarray(row_splits(jnp.array([445, 0, 71, 300, 5]), kv_heads=8, grid_splits=6,
                                 target=264))
  chunk = -(-(445 + 71 + 300 + 5) * 8 // 264)
  assert list(counts) == [min(6, -(-445 // chunk)), 1, -(-71 // chunk), min(6, -(-300 // chunk)), 1]
  assert counts[0] > counts[2] >= 1
  # never a chunk under MIN_BLOCKS_PER_SPLIT blocks
  assert list(np.asarray(row_splits(jnp.array([4, 3]), kv_heads=1, grid_splits=8,
                                    target=264))) == [2, 2]


# --- config and heuristic ------------------------------------------------------------------------

def test_decode_config_validates_its_fields():
  with pytest.raises(ValueError, match="block_k must be a power of two"):
    DecodeConfig(block_k=48)
  with pytest.raises(ValueError, match="num_splits"):
    DecodeConfig(num_splits=0)
  with pytest.raises(TypeError, match="num_warps must be an int"):
    DecodeConfig(num_warps=4.0)
  with pytest.raises(ValueError, match="waves"):
    DecodeConfig(waves=0)
  assert DecodeConfig.default(128, jnp.bfloat16).block_k == 64
  assert DecodeConfig.default(256, jnp.bfloat16) == DecodeConfig.default(128, jnp.bfloat16)
  assert DecodeConfig.default(64, jnp.float32).block_k == 32
  # the split rules' own programs per SM unless asked (kernels/decode/backend.py)
  assert DecodeConfig.default(128, jnp.bfloat16, rows=4).waves is None
  assert DecodeConfig.default(128, jnp.bfloat16, rows=32).waves is None
  assert DecodeConfig(waves=3).waves == 3
  for rows in (0, 2.0, True):
    with pytest.raises(ValueError, match="rows must be a positive int"):
      DecodeConfig.default(128, jnp.bfloat16, rows=rows)
  hash(DecodeLaunch(DecodeConfig(), 3, 4, "triton", fa2_jax.BlockSizes()))


def test_split_heuristic_fills_the_sms_evenly():
  # enough (batch, KV head) programs already: no split
  assert num_splits_heuristic(64 * 8, 64, sms=132) == 1
  assert num_splits_heuristic(128, 512, sms=132) == 1  # 16 x 32k GQA 32/8: 128 of 132 SMs
  # 8 x 32k GQA 32/8 (64 programs): 2 splits fill one round (128 of 132); 3 would double up 60 SMs
  assert num_splits_heuristic(64, 512, sms=132) == 2
  # a paged cache asks two programs per SM: 4 splits, 256 programs in two rounds
  assert num_splits_heuristic(64, 512, sms=132, waves=2) == 4
  # MQA / one sequence of 8 KV heads: 16 splits, 128 programs; one KV head 128, two 64 (counts
  # judged as they run: 126 would run as 103 splits, 78% of a round)
  assert num_splits_heuristic(8, 512, sms=132) == 16
  assert num_splits_heuristic(1, 512, sms=132) == 128
  assert num_splits_heuristic(2, 512, sms=132) == 64
  # no count fills 95% within two rounds: the fewest splits of the best fill (3 x 40 = 120)
  assert num_splits_heuristic(40, 512, sms=132) == 3
  # two full rounds where one round cannot be filled evenly (24 x 11 = 264)
  assert num_splits_heuristic(24, 512, sms=132) == 11
  for programs, n_blocks in [(64, 512), (8, 2048), (40, 512), (3, 777), (17, 300)]:
    for waves in (1, 2):
      s = num_splits_heuristic(programs, n_blocks, sms=132, waves=waves)
      assert 1 <= s <= MAX_SPLITS and programs * s <= (waves + 1) * 132
      per = -(-n_blocks // s)
      assert -(-n_blocks // per) == s  # no empty trailing chunk
  # short cache: never a split shorter than 2 blocks
  assert num_splits_heuristic(1, 5, sms=132) == 2
  assert num_splits_heuristic(1, 1, sms=132) == 1


def test_length_split_base_count_reaches_two_programs_per_sm():
  assert length_splits(64 * 8, 64, sms=132) == 1
  assert length_splits(220, 64, sms=132) == 1
  # 8 x 32k GQA 32/8: 5 splits reach 264 programs
  assert length_splits(64, 512, sms=132) == 5
  # one sequence, 8 KV heads, 4096 keys in 64-key blocks: 33 splits would reach 2 waves, but a
  # split keeps 2 blocks at least: 32
  assert length_splits(8, 64, sms=132) == 32
  s = length_splits(8, 2048, sms=132)
  assert 8 * s >= 264 and s <= MAX_SPLITS
  assert length_splits(1, 5, sms=132) == 2
  assert length_splits(16, 1024, sms=132, waves=4) >= length_splits(16, 1024, sms=132)


# --- the Triton lowering (no GPU needed) ---------------------------------------------------------

LOWERING_CASES = [  # (b, t, n, kh, h, s, dtype, splits, variant keywords)
    (2, 1, 32, 8, 128, 4096, jnp.bfloat16, None, dict(is_causal=True, lengths=True)),
    # three rows (not a power of two) splitting by their lengths, MQA, a window
    (3, 1, 16, 1, 128, 8192, jnp.bfloat16, None, dict(is_causal=True, lengths=True,
                                                      local_window_size=(1000, 0))),
    (4, 4, 8, 1, 64, 1000, jnp.float16, 1, dict(is_causal=True, lengths=True,
                                                 local_window_size=(256, 0),
                                                 logits_soft_cap=30.0)),
    (1, 16, 4, 4, 256, 2048, jnp.float32, 5, dict(is_causal=True, q_offset=2000, alibi=True)),
    (3, 2, 6, 2, 80, 777, jnp.bfloat16, 3, {}),
    (2, 1, 16, 2, 128, 2048, jnp.bfloat16, None, dict(is_causal=True, lengths=True, pages=16)),
    (2, 2, 8, 8, 64, 1024, jnp.float16, 4, dict(is_causal=True, lengths=True, pages=256)),
]


@pytest.mark.parametrize("case", LOWERING_CASES, ids=lambda c: "-".join(map(str, c[:6])))
def test_lowers_for_hopper(case, monkeypatch):
  """The decode forward (and the delegated backward) lower to Triton IR with an H200's Triton limits
  (jax.export for "cuda" on any machine, as tests/test_lowering.py): the row gathers, the in-kernel
  block range and the split shares pass the Pallas Triton lowering. The compute capability reads as
  unknown, as on a CPU, so that on a Hopper GPU too the delegated backward is the Triton kernels'."""
  from jax import export
  gpu_info = pytest.importorskip("jax._src.pallas.triton.gpu_info")
  registration = pytest.importorskip("jax._src.pallas.triton.pallas_call_registration")
  from fa2_jax.kernels import platform
  monkeypatch.setattr(registration.gpu_info_lib, "get_gpu_info",
                      lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))
  monkeypatch.setattr(platform, "on_gpu", lambda: True)
  monkeypatch.setattr(platform, "gpu_compute_capability", lambda: None)
  b, t, n, kh, h, s, dtype, splits, kw = case
  kw = dict(kw)
  q = jax.ShapeDtypeStruct((b, t, n, h), dtype)
  kv = jax.ShapeDtypeStruct((b, s, kh, h), dtype)
  lengths = kw.pop("lengths", False)
  alibi = kw.pop("alibi", False)
  page_size = kw.pop("pages", None)
  config = DecodeConfig.default(h, dtype).replace(num_splits=splits)
  table = None
  if page_size is not None:  # a paged cache: as many pages as keys, in one table per row
    kv = jax.ShapeDtypeStruct((b * s // page_size, page_size, kh, h), dtype)
    table = jnp.arange(b * s // page_size, dtype=jnp.int32).reshape(b, s // page_size)[::-1]

  def loss(q, k, v, lens, slopes):
    extra = dict(key_value_seq_lengths=lens, q_offset=lens - t) if lengths else {}
    if alibi:
      extra["alibi_slopes"] = slopes
    if table is not None:
      extra["block_table"] = table
    o = fa2_jax.flash_attention(q, k, v, block_sizes=config, **extra, **kw)
    return o.astype(jnp.float32).sum()

  lens = jax.ShapeDtypeStruct((b,), jnp.int32)
  slopes = jax.ShapeDtypeStruct((n,), jnp.float32)
  assert fa2_jax.backend_for(q, kv, block_sizes=config, block_table=table, **kw,
                             **(dict(key_value_seq_lengths=lens, q_offset=lens) if lengths
                                else {})).backend == "decode"
  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  exp = export.export(fn, platforms=["cuda"], disabled_checks=[
      export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(q, kv, kv, lens, slopes)
  text = exp.mlir_module()
  assert "fa2_decode_forward" in text and text.count("__gpu$xla.gpu.triton") >= 3


# --- a paged key/value cache (block_table) --------------------------------------------------------

def _paged(b, t, n, kh, h, page_size, max_pages, num_pages, dtype, seed=0):
  """q, key/value pages, and a block table whose pages are in random order, with rows 0 and 1
  sharing their first pages."""
  ks = jax.random.split(jax.random.key(seed), 4)
  dt = DTYPES[dtype]
  q = jax.random.normal(ks[0], (b, t, n, h), jnp.float32).astype(dt)
  kp = jax.random.normal(ks[1], (num_pages, page_size, kh, h), jnp.float32).astype(dt)
  vp = jax.random.normal(ks[2], (num_pages, page_size, kh, h), jnp.float32).astype(dt)
  table = jax.random.permutation(ks[3], num_pages)[:b * max_pages].reshape(b, max_pages)
  if b > 1:
    table = table.at[1, :2].set(table[0, :2])  # shared pages (a common prefix)
  return q, kp, vp, table.astype(jnp.int32)


@pytest.mark.parametrize("case", [
    # (b, t, n, kh, h, page_size, max_pages, num_pages, dtype, block_k, splits, lengths)
    (3, 1, 4, 1, 32, 16, 20, 64, "bfloat16", 32, 3, (320, 0, 77)),  # a block spans 2 pages
    (2, 4, 8, 2, 16, 64, 5, 12, "float32", 16, None, (300, 64)),  # a page holds 4 blocks
    (2, 1, 2, 2, 64, 256, 2, 5, "float32", 64, 1, (512, 257)),
], ids=lambda c: f"page{c[5]}-t{c[1]}-{c[8]}")
def test_paged_cache_matches_the_gathered_formula(case):
  from fa2_jax.paged import gather_pages
  b, t, n, kh, h, page_size, max_pages, num_pages, dtype, block_k, splits, lengths = case
  q, kp, vp, table = _paged(b, t, n, kh, h, page_size, max_pages, num_pages, dtype)
  lens = jnp.array(lengths, jnp.int32)
  kw = dict(is_causal=True, key_value_seq_lengths=lens, q_offset=lens - t)
  cfg = DecodeConfig(block_k=block_k, num_splits=splits)
  d = fa2_jax.backend_for(q, kp, vp, interpret=INTERPRET, block_table=table, block_sizes=cfg, **kw)
  assert d.backend == "decode" and "reads the" in d.reason and "through the table" in d.reason, d
  out, lse = _jit_call(q, kp, vp, config=cfg, block_table=table, **kw)
  k, v = gather_pages(kp, table), gather_pages(vp, table)
  ref = _reference(q, k, v, **kw)
  low = _reference(q, k, v, compute_dtype=q.dtype, **kw) if dtype != "float32" else ref
  for name, g, r, lo in zip(("out", "lse"), (out.astype(jnp.float32), lse), ref, low):
    g = np.asarray(g, np.float64)
    np.testing.assert_array_equal(np.isneginf(g), np.isneginf(r), err_msg=name)
    fin = np.isfinite(r)
    err = np.max(np.abs(g[fin] - r[fin]))
    bound = (2 * np.max(np.abs(lo[fin] - r[fin]))
             + ATOL[dtype] * (np.max(np.abs(r[fin])) + 1.0))
    assert err <= bound, f"{name}: error {err:.3g} > {bound:.3g}"


def test_traced_out_of_range_values_act_as_clipped_paged_per_row_splits():
  """A paged cache with per-row split counts (``num_splits`` from the heuristic: the rows' counts
  from every row's clipped lengths, in the kernel) and query lengths: traced lengths past their
  ranges give what the clipped ones give."""
  edge = (1 << 30) - 1
  q, kp, vp, table = _paged(3, 2, 4, 2, 16, 16, 20, 64, "float32", seed=6)
  cfg = DecodeConfig(block_k=32)
  kw = dict(is_causal=True, block_table=table, block_sizes=cfg, interpret=INTERPRET,
            return_residual=True)
  far = (jnp.array([400, 2 ** 31 - 1, -3], jnp.int32), jnp.array([9, 2, -1], jnp.int32),
         jnp.array([2 ** 31 - 1, 150, 40], jnp.int32))
  near = (jnp.array([320, 320, 0], jnp.int32), jnp.array([2, 2, 0], jnp.int32),
          jnp.array([edge, 150, 40], jnp.int32))
  d = fa2_jax.backend_for(q, kp, vp, key_value_seq_lengths=near[0], query_seq_lengths=near[1],
                          q_offset=near[2], **{n: x for n, x in kw.items() if n != "return_residual"})
  assert d.backend == "decode" and "per row" in d.reason and "through the table" in d.reason, d
  run = jax.jit(lambda kv, ql, off: fa2_jax.flash_attention(
      q, kp, vp, key_value_seq_lengths=kv, query_seq_lengths=ql, q_offset=off, **kw))
  for name, g, w in zip(("out", "lse"), run(*far), run(*near)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)


def test_grad_through_a_paged_decoding_call():
  """Gradients to the query and the pages (shared pages get both rows' share) equal the gathered
  formula's."""
  from fa2_jax.paged import gather_pages
  q, kp, vp, table = _paged(2, 2, 4, 2, 16, 32, 9, 20, "float32", seed=7)
  lens = jnp.array([288, 100], jnp.int32)
  kw = dict(is_causal=True, key_value_seq_lengths=lens, q_offset=lens - 2)
  cfg = DecodeConfig(block_k=16, num_splits=2)
  mine = jax.jit(jax.grad(lambda a, b, c: jnp.sum(jnp.sin(fa2_jax.flash_attention(
      a, b, c, interpret=INTERPRET, block_sizes=cfg, block_table=table, **kw))),
      argnums=(0, 1, 2)))(q, kp, vp)
  ref = jax.jit(jax.grad(lambda a, b, c: jnp.sum(jnp.sin(fa2_jax.reference_attention(
      a, gather_pages(b, table), gather_pages(c, table), **kw))), argnums=(0, 1, 2)))(q, kp, vp)
  for name, a, r in zip(("dq", "dkp", "dvp"), mine, ref):
    np.testing.assert_allclose(a, r, atol=2e-5 * (float(jnp.max(jnp.abs(r))) + 1.0), err_msg=name)


def test_alibi_slopes_gradient_through_a_paged_decoding_call():
  """ALiBi with a paged cache runs the gathered form, so the slopes' gradient is the formula's (the
  paged kernel's custom rule differentiates q, k and v only; it once returned zero for the slopes)."""
  from fa2_jax.paged import gather_pages
  q, kp, vp, table = _paged(2, 1, 2, 1, 16, 32, 9, 20, "float32", seed=9)
  lens = jnp.array([200, 256], jnp.int32)
  kw = dict(is_causal=True, key_value_seq_lengths=lens, q_offset=lens - 1)
  slopes = jnp.array([0.1, 0.2], jnp.float32)
  d = fa2_jax.backend_for(q, kp, vp, interpret=INTERPRET, block_table=table, alibi_slopes=slopes,
                          **kw)
  assert "pages are gathered" in d.reason, d
  mine = jax.grad(lambda s: fa2_jax.flash_attention(
      q, kp, vp, interpret=INTERPRET, block_table=table, alibi_slopes=s, **kw).sum())(slopes)
  ref = jax.grad(lambda s: fa2_jax.reference_attention(
      q, gather_pages(kp, table), gather_pages(vp, table), alibi_slopes=s, **kw).sum())(slopes)
  assert float(jnp.max(jnp.abs(ref))) > 1e-3
  np.testing.assert_allclose(mine, ref, rtol=1e-4, atol=1e-5)


def test_backend_for_describes_the_padded_call_under_a_length_multiple():
  """With reuse_kernels_across_programs(length_multiple=...) flash_attention pads T and S before the
  kernels; backend_for describes that padded call (T = 2 padded to 128 is no decoding call)."""
  q, k, v = _inputs(2, 2, 4, 2, 16, 256, "float32")[:3]
  lens = jnp.array([200, 256], jnp.int32)
  kw = dict(is_causal=True, key_value_seq_lengths=lens, q_offset=lens - 2, interpret=INTERPRET)
  assert fa2_jax.backend_for(q, k, v, **kw).backend == "decode"
  previous = fa2_jax.reuse_kernels_across_programs(True, length_multiple=128)
  try:
    d = fa2_jax.backend_for(q, k, v, **kw)
  finally:
    fa2_jax.reuse_kernels_across_programs(previous)
  assert "decode split-KV" not in " ".join(d.forward), d


def test_a_paged_call_that_is_not_decoding_gathers_the_pages():
  from fa2_jax.paged import gather_pages
  q, kp, vp, table = _paged(2, 24, 2, 1, 16, 16, 4, 9, "float32", seed=8)
  lens = jnp.array([64, 30], jnp.int32)
  kw = dict(is_causal=True, key_value_seq_lengths=lens, q_offset=lens - 24)
  d = fa2_jax.backend_for(q, kp, vp, interpret=INTERPRET, block_table=table, **kw)
  assert d.backend != "decode" and "gathered into contiguous K/V [B, 64, K, H]" in d.reason, d
  out, lse = _jit_call(q, kp, vp, block_table=table, **kw)
  ref_out, ref_lse = _reference(q, gather_pages(kp, table), gather_pages(vp, table), **kw)
  np.testing.assert_allclose(np.asarray(out, np.float64), ref_out, atol=2e-5)
  np.testing.assert_allclose(np.asarray(lse, np.float64), ref_lse, atol=2e-5)


def test_paged_arguments_are_validated():
  q, kp, vp, table = _paged(2, 1, 4, 2, 16, 16, 4, 8, "float32")
  lens = jnp.array([64, 20], jnp.int32)
  call = lambda **kw: fa2_jax.backend_for(q, kw.pop("k", kp), kw.pop("v", vp),  # noqa: E731
                                          interpret=True, **{"block_table": table,
                                                             "key_value_seq_lengths": lens, **kw})
  with pytest.raises(TypeError, match="block_table must be an integer array"):
    call(block_table=table.astype(jnp.float32))
  with pytest.raises(ValueError, match=r"block_table must have shape \[B, max_pages\] with B=2"):
    call(block_table=table[:1])
  with pytest.raises(ValueError, match="block_table needs key_value_seq_lengths"):
    call(key_value_seq_lengths=None)
  with pytest.raises(ValueError, match="key_value_seq_lengths must be at most max_pages"):
    call(key_value_seq_lengths=jnp.array([65, 3], jnp.int32))
  with pytest.raises(ValueError, match=r"page ids outside \[0, 8\).*block_table\[1, 0\] = 8"):
    call(block_table=table.at[1, 0].set(8))
  # entries past a row's keys are never read: -1 padding there is fine
  call(block_table=table.at[1, 2:].set(-1))
  with pytest.raises(ValueError, match=r"key/value must be pages|key and value must be pages"):
    call(v=vp[:, :8])
  with pytest.raises(ValueError, match="needs a rank-4 query"):
    fa2_jax.flash_attention(q[0], kp, vp, block_table=table, key_value_seq_lengths=lens)
  with pytest.raises(TypeError, match="block_table must be an integer array"):
    fa2_jax.flash_attention(q, kp, vp, block_table=[[0, 1]], key_value_seq_lengths=lens)
