"""Context parallelism (fa2_jax.context_parallel): each strategy inside jax.shard_map over the 4 CPU
devices of conftest, forward, lse and gradients against the single-device call and the float64
reference; the layouts; the ring's compiled collectives; errors.

Broad variant coverage runs the XLA formula (fast to compile); the Triton kernels in interpret mode
run two ring cases (their backward with the rows' global statistics)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import fa2_jax

C = 4  # conftest's CPU devices
B, T, N, K, H = 1, 32, 4, 2, 16
SEQ = P(None, "context")


@functools.lru_cache(maxsize=None)
def _mesh():
  return jax.make_mesh((C,), ("context",), axis_types=(jax.sharding.AxisType.Auto,))


def _inputs(seed=0, n=N, kh=K, t=T, hv=H, s=None):
  s = t if s is None else s
  ks = jax.random.split(jax.random.key(seed), 6)
  q = jax.random.normal(ks[0], (B, t, n, H), jnp.float32)
  k = jax.random.normal(ks[1], (B, s, kh, H), jnp.float32)
  v = jax.random.normal(ks[2], (B, s, kh, hv), jnp.float32)
  dout = jax.random.normal(ks[3], (B, t, n, hv), jnp.float32)
  dlse = jax.random.normal(ks[4], (B, t, n), jnp.float32)
  return q, k, v, dout, dlse


def _context_parallel(strategy, layout, segments=None, check_vma=True, **kw):
  """``f(q, k, v, slopes) -> (out, lse)`` on global arrays in natural order, through shard_map."""
  lay = functools.partial(fa2_jax.to_context_layout, axis_size=C, layout=layout)
  unlay = functools.partial(fa2_jax.from_context_layout, axis_size=C, layout=layout)

  def local(q, k, v, q_seg, kv_seg, slopes):
    extra = {} if q_seg is None else dict(q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    if slopes is not None:
      extra["alibi_slopes"] = slopes
    return fa2_jax.context_parallel_attention(q, k, v, axis_name="context", strategy=strategy,
                                              layout=layout, return_residual=True, **kw, **extra)

  sm = jax.shard_map(local, mesh=_mesh(), in_specs=(SEQ,) * 5 + (P(),), out_specs=(SEQ, SEQ),
                     check_vma=check_vma)

  def f(q, k, v, slopes=None):
    seg = (None, None) if segments is None else tuple(map(lay, segments))
    out, lse = sm(lay(q), lay(k), lay(v), *seg, slopes)
    return unlay(out), unlay(lse)

  return f


def _single(segments=None, fn=fa2_jax.flash_attention, **kw):
  extra = {} if segments is None else dict(q_segment_ids=segments[0], kv_segment_ids=segments[1])

  def f(q, k, v, slopes=None):
    more = {} if slopes is None else {"alibi_slopes": slopes}
    return fn(q, k, v, return_residual=True, **kw, **extra, **more)

  return f


def _value_and_grads(f, q, k, v, dout, dlse, slopes=None):
  """(out, lse, dq, dk, dv[, dslopes]) of ``sum(out * dout) + sum(lse * dlse)`` (finite lse)."""
  def loss(*args):
    out, lse = f(*args)
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    return jnp.sum((out * dout).astype(lse.dtype)) + jnp.sum(lse * dlse), (out, lse)

  args = (q, k, v) if slopes is None else (q, k, v, slopes)
  grad = jax.jit(jax.grad(loss, argnums=tuple(range(len(args))), has_aux=True))
  grads, (out, lse) = grad(*args)
  return [np.asarray(x.astype(jnp.float32), np.float64) for x in (out, lse, *grads)]


def _reference64(q, k, v, dout, dlse, slopes=None, segments=None, **kw):
  with jax.enable_x64(True):
    cast = lambda x: None if x is None else jnp.asarray(np.asarray(x, np.float64))  # noqa: E731
    args = [cast(x) for x in (q, k, v, dout, dlse, slopes)]
    f = _single(segments, fn=fa2_jax.reference_attention, **kw)
    return _value_and_grads(f, *args)


def _check(strategy, layout, *, seed=0, n=N, kh=K, hv=H, s=None, slopes=None, segments=None,
           check_vma=True, atol=2e-5, **kw):
  q, k, v, dout, dlse = _inputs(seed, n, kh, hv=hv, s=s)
  got = _value_and_grads(_context_parallel(strategy, layout, segments, check_vma, **kw),
                         q, k, v, dout, dlse, slopes)
  single = _value_and_grads(_single(segments, **kw), q, k, v, dout, dlse, slopes)
  ref_kw = {a: b for a, b in kw.items() if a not in ("implementation", "interpret")}
  ref = _reference64(q, k, v, dout, dlse, slopes, segments, **ref_kw)
  names = ["out", "lse", "dq", "dk", "dv", "dslopes"]
  for name, a, b, r in zip(names, got, single, ref):
    assert np.all(np.isfinite(a) | (name == "lse")), name  # never NaN
    np.testing.assert_allclose(a, b, atol=atol, rtol=1e-4, err_msg=f"{name} vs single device")
    np.testing.assert_allclose(a, r, atol=atol, rtol=1e-4, err_msg=f"{name} vs float64")


def _documents(lengths, t=T):
  """Segment ids ``[B, t]`` of packed documents of the given lengths (then padding id -1)."""
  ids = np.concatenate([np.full(n, i, np.int32) for i, n in enumerate(lengths)])
  ids = np.concatenate([ids, np.full(t - ids.size, -1, np.int32)])[None]
  return jnp.asarray(ids), jnp.asarray(ids)


# --- the formula: every strategy, the variants --------------------------------------------------

@pytest.mark.parametrize("strategy,layout", [("ring", "zigzag"), ("ring", "contiguous"),
                                             ("all_gather", "zigzag")])
def test_causal_ragged_documents(strategy, layout):
  """Causal GQA over packed documents (segment ids that cross the chunks) with a query length and
  a key length: rows past the length give 0 and lse -inf, never NaN."""
  _check(strategy, layout, implementation="xla", is_causal=True,
         segments=_documents([5, 14, 9]), query_seq_lengths=jnp.array([29]),
         key_value_seq_lengths=jnp.array([27]))


def test_ring_window_offset_soft_cap():
  """A sliding window (left 5, right 3) past q_offset, with a soft cap, not causal: most ring blocks
  are out of the window's reach and skipped."""
  _check("ring", "zigzag", implementation="xla", local_window_size=(5, 3), q_offset=3,
         logits_soft_cap=5.0)


def test_ring_alibi_and_functions():
  """ALiBi (its slopes differentiated: the recomputing block backward) and a mask_fn/score_fn that
  read absolute positions (a lax.switch over the key chunk), causal, zigzag."""
  slopes = jnp.array([0.5, 0.25, 0.125, 0.0625], jnp.float32)
  _check("ring", "zigzag", implementation="xla", is_causal=True, slopes=slopes,
         mask_fn=lambda b, h, p, j: (p - j) % 7 != 3,
         score_fn=lambda x, b, h, p, j: x + 0.01 * (p % 5 - 2 * (j % 3)).astype(x.dtype))


@pytest.mark.parametrize("kw", [dict(implementation="xla"),
                                dict(implementation="triton", interpret=True)])
def test_ring_value_head_dim_of_its_own(kw):
  """A value head_dim unlike the query/key one (MLA): the ring's skipped blocks and accumulators
  have the values' width (causal, so blocks are skipped)."""
  _check("ring", "zigzag", hv=8, is_causal=True, check_vma="interpret" not in kw,
         atol=1e-4 if "interpret" in kw else 2e-5, **kw)


def test_ring_fixed_alibi_slopes_on_the_hopper_kernels(monkeypatch):
  """ALiBi with fixed slopes (stop_gradient) on the sm90 kernels, which cannot differentiate them:
  the ring's backward runs them (lowered for a faked Hopper); slopes whose gradient is asked raise
  the kernels' TypeError naming stop_gradient."""
  from fa2_jax.kernels import platform
  monkeypatch.setattr(platform, "on_gpu", lambda: True)
  monkeypatch.setattr(platform, "gpu_compute_capability", lambda: (9, 0))
  q = jax.ShapeDtypeStruct((1, 512, 4, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 512, 2, 128), jnp.bfloat16)
  slopes = jax.ShapeDtypeStruct((4,), jnp.float32)

  def loss(q, k, v, slopes, fixed):
    local = lambda q, k, v, sl: fa2_jax.context_parallel_attention(
        q, k, v, axis_name="context", strategy="ring", layout="zigzag", is_causal=True,
        alibi_slopes=jax.lax.stop_gradient(sl) if fixed else sl)
    sm = jax.shard_map(local, mesh=_mesh(), in_specs=(SEQ,) * 3 + (P(),), out_specs=SEQ)
    return jnp.sum(sm(q, k, v, slopes).astype(jnp.float32))

  grads = jax.eval_shape(jax.grad(functools.partial(loss, fixed=True), argnums=(0, 1, 2, 3)),
                         q, k, k, slopes)
  assert [g.shape for g in grads] == [q.shape, k.shape, k.shape, slopes.shape]
  with pytest.raises(TypeError, match="stop_gradient"):
    jax.eval_shape(jax.grad(functools.partial(loss, fixed=False), argnums=(0, 1, 2, 3)),
                   q, k, k, slopes)


def test_default_strategy_bfloat16():
  """strategy=None (all_gather at this size) and the ring in bfloat16 (bfloat16 K/V and float32
  dK/dV accumulators each in a ppermute of their own), not causal, contiguous."""
  q, k, v, dout, dlse = _inputs(seed=2)
  q, k, v, dout = (x.astype(jnp.bfloat16) for x in (q, k, v, dout))  # the lse stays float32
  single = _value_and_grads(_single(implementation="xla"), q, k, v, dout, dlse)
  for strategy in (None, "ring"):
    got = _value_and_grads(_context_parallel(strategy, "contiguous", implementation="xla"),
                           q, k, v, dout, dlse)
    for a, b in zip(got, single):
      np.testing.assert_allclose(a, b, atol=2e-2, rtol=2e-2)


def test_all_to_all():
  """Ulysses: heads split over the axis (N = 8, K = 4), causal zigzag, ALiBi, and a mask_fn that
  reads the global head index."""
  slopes = jnp.linspace(0.5, 0.05, 8, dtype=jnp.float32)
  _check("all_to_all", "zigzag", n=8, kh=4, implementation="xla", is_causal=True, slopes=slopes,
         mask_fn=lambda b, h, p, j: (h < 6) | (p - j < 4))


# --- the ring's step on whole chunks ----------------------------------------------------------------

def _ring_calls(monkeypatch, layout, **kw):
  """The kernel calls the ring traces (each fori_loop body and lax.cond branch once): ``(forward,
  backward)``, each a list of ``(query rows, keys, is_causal, whether q_offset is passed)``, from
  the block calls of the forward and the block gradients of the backward (formula; T = S = 32 over
  the 4 devices of conftest)."""
  from fa2_jax import attention, context_parallel
  q, k, v, _, _ = _inputs()
  local = functools.partial(fa2_jax.context_parallel_attention, axis_name="context",
                            strategy="ring", layout=layout, implementation="xla", **kw)
  sm = jax.shard_map(local, mesh=_mesh(), in_specs=(SEQ,) * 3, out_specs=SEQ)
  record = lambda log, q, k, kw: log.append(  # noqa: E731
      (q.shape[1], k.shape[1], bool(kw.get("is_causal")), kw.get("q_offset") is not None))
  forward, backward = [], []

  def flash(q, k, v, **kw):
    record(forward, q, k, kw)
    return flash_attention(q, k, v, **kw)

  def block_grads(cfg, ops, q, k, *args, **kwargs):
    record(backward, q, k, args[5])  # args: v, out, lse, dout, dlse, kw
    return block_grads_of(cfg, ops, q, k, *args, **kwargs)

  flash_attention, block_grads_of = attention.flash_attention, context_parallel._block_grads
  monkeypatch.setattr(attention, "flash_attention", flash)
  jax.eval_shape(sm, q, k, v)
  monkeypatch.setattr(attention, "flash_attention", flash_attention)
  monkeypatch.setattr(context_parallel, "_block_grads", block_grads)
  jax.eval_shape(jax.grad(lambda q, k, v: jnp.sum(sm(q, k, v)), argnums=(0, 1, 2)), q, k, v)
  return forward, backward


@pytest.mark.parametrize("layout,kw,calls", [
    # zigzag, causal: the local chunks (8 rows) causal; then every row x key piece 0 (4 keys) or
    # query piece 1 (4 rows) x every key, not causal
    ("zigzag", dict(is_causal=True), [(8, 8, True, False), (8, 4, False, False),
                                      (4, 8, False, False)]),
    ("zigzag", dict(is_causal=True, logits_soft_cap=5.0), [(8, 8, True, False),
                                                           (8, 4, False, False),
                                                           (4, 8, False, False)]),
    ("zigzag", dict(), [(8, 8, False, False)] * 2),
    ("contiguous", dict(is_causal=True), [(8, 8, True, False), (8, 8, False, False)]),
    # positions read otherwise: one call per (query piece, key piece) pair, with a q_offset
    ("zigzag", dict(is_causal=True, local_window_size=(5, 0)), [(4, 4, True, True)] * 4),
    ("zigzag", dict(is_causal=True, q_offset=2), [(4, 4, True, True)] * 4),
    ("zigzag", dict(query_seq_lengths=jnp.array([30])), [(4, 4, False, False)] * 4),
    # (a mask_fn: one lax.switch branch per key chunk, each its own index shift)
    ("contiguous", dict(mask_fn=lambda b, h, p, j: p != j), [(8, 8, False, True)] * C),
])
def test_ring_step_calls(monkeypatch, layout, kw, calls):
  """Where nothing but causality reads positions, each ring step is ONE kernel call on whole
  chunks, forward and backward (the first step's, then one call in each branch of the later
  steps' lax.cond); a window, q_offset, lengths or a mask_fn keep the per-piece calls."""
  forward, backward = _ring_calls(monkeypatch, layout, **kw)
  assert forward == calls
  assert backward == calls


def test_backward_adds_its_dq_to_an_accumulator():
  """attention._attention_backward(dq_accumulator=...) (the ring's whole-chunk steps) returns the
  accumulator plus this call's dQ / scale in float32, dK/dV as without it (a family that does not
  add in its kernels, here Triton in interpret mode: added after); a wrong shape is refused."""
  from fa2_jax import attention
  q, k, v = (x.astype(jnp.bfloat16) for x in _inputs()[:3])
  kw = dict(is_causal=True, scale=0.3, implementation="triton", interpret=True)
  out, lse = fa2_jax.flash_attention(q, k, v, return_residual=True, **kw)
  do = jnp.cos(out.astype(jnp.float32)).astype(out.dtype)
  acc = jnp.full(q.shape, 2.0, jnp.float32)
  dq, dk, dv = attention._attention_backward(q, k, v, out, lse, do, **kw)
  got, dk2, dv2 = attention._attention_backward(q, k, v, out, lse, do, dq_accumulator=acc, **kw)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), 2.0 + np.asarray(dq, np.float32) / 0.3, rtol=1e-6,
                             atol=1e-6)
  np.testing.assert_array_equal(np.asarray(dk2), np.asarray(dk))
  np.testing.assert_array_equal(np.asarray(dv2), np.asarray(dv))
  with pytest.raises(ValueError, match="dq_accumulator must have query's shape"):
    attention._attention_backward(q, k, v, out, lse, do, dq_accumulator=acc[:, :4], **kw)


def test_ring_whole_chunks_rule():
  """_whole_chunks through the call's settings: segment ids, a soft cap and non-causal T != S
  keep whole chunks; ALiBi, a score_fn and causal T != S (chunk i of the queries and of the keys
  cover other positions) do not."""
  from fa2_jax import context_parallel

  def whole(t=32, s=32, layout="zigzag", strategy="ring", **kw):
    struct = lambda l, h: jax.ShapeDtypeStruct((B, l // C, h, H), jnp.float32)  # noqa: E731
    cfg, _ = context_parallel._setup("context", C, layout, strategy, struct(t, N), struct(s, K),
                                     struct(s, K), implementation="xla", **kw)
    return cfg.whole_chunks

  seg = jax.ShapeDtypeStruct((B, 8), jnp.int32)
  assert whole(is_causal=True, q_segment_ids=seg, kv_segment_ids=seg, logits_soft_cap=3.0)
  assert whole(s=64) and whole(s=64, layout="contiguous")
  assert not whole(s=64, is_causal=True) and not whole(s=64, is_causal=True, layout="contiguous")
  assert not whole(is_causal=True, alibi_slopes=jnp.ones((N,), jnp.float32))
  assert not whole(score_fn=lambda x, b, h, p, j: x)
  assert not whole(strategy="all_gather")


@pytest.mark.parametrize("layout,kw", [
    ("zigzag", dict(is_causal=True)),
    ("zigzag", dict()),
    ("contiguous", dict(is_causal=True)),
    ("zigzag", dict(s=48)),  # not causal, S != T: whole chunks
    ("contiguous", dict(is_causal=True, s=48)),  # causal, S != T: per piece
])
def test_ring_whole_chunks(layout, kw):
  """The ring's whole-chunk steps: GQA over packed documents whose segments cross the chunks, with
  a soft cap, against the single-device call and float64 (and a causal S != T on the per-piece
  steps)."""
  s = kw.get("s", T)
  segments = _documents([5, 14, 9])[0], _documents([5, 14, 9] if s == T else [8, 21, 14], t=s)[1]
  _check("ring", layout, implementation="xla", segments=segments, logits_soft_cap=5.0, **kw)


# --- the Triton kernels (interpret mode): the ring's kernel backward ------------------------------

@pytest.mark.parametrize("layout,kw", [
    ("contiguous", dict(is_causal=True)),
    ("zigzag", dict(is_causal=True, local_window_size=(9, None), segments=_documents([11, 17]))),
])
def test_ring_triton_kernels(layout, kw):
  """The ring on the Triton kernels: each block's forward, and each block's backward with the rows'
  global out and lse (attention.attention_backward). check_vma=False: the interpret-mode kernels'
  internals are not varying-manual-axes aware."""
  _check("ring", layout, implementation="triton", interpret=True, check_vma=False, **kw)


def test_attention_backward_blocks_sum_to_the_call():
  """attention.attention_backward on key blocks, with the whole call's out and lse: dq sums to the
  call's, each block's dk/dv is the call's slice (Triton, interpret mode; T = S = 24 padded to a
  length multiple of 16, so rows and keys are padded inside)."""
  from fa2_jax.attention import attention_backward
  q, k, v, dout, dlse = (x[:, :24] for x in _inputs(seed=4))
  kw = dict(implementation="triton", interpret=True, is_causal=True)
  previous = fa2_jax.kernel_reuse.info()
  fa2_jax.reuse_kernels_across_programs(True, length_multiple=16)
  try:
    f = lambda q, k, v: fa2_jax.flash_attention(q, k, v, return_residual=True, **kw)  # noqa: E731
    (out, lse), vjp = jax.vjp(f, q, k, v)
    dq, dk, dv = vjp((dout, dlse))
    grads = [attention_backward(q, k[:, j:j + 12], v[:, j:j + 12], out, lse, dout, dlse,
                                q_offset=-j, **kw) for j in (0, 12)]
  finally:
    fa2_jax.reuse_kernels_across_programs(previous["enabled"],
                                          length_multiple=previous["length_multiple"])
  np.testing.assert_allclose(grads[0][0] + grads[1][0], dq, atol=2e-5, rtol=1e-4)
  np.testing.assert_allclose(jnp.concatenate([g[1] for g in grads], 1), dk, atol=2e-5, rtol=1e-4)
  np.testing.assert_allclose(jnp.concatenate([g[2] for g in grads], 1), dv, atol=2e-5, rtol=1e-4)
  with pytest.raises(ValueError, match="runs on the XLA formula"):
    attention_backward(q, k, v, out, lse, dout, implementation="xla")


# --- the compiled ring --------------------------------------------------------------------------

def test_ring_compiles_to_collective_permutes():
  """jit(grad) of the ring inside shard_map: K/V and dK/dV move by collective-permute; nothing
  all-gathers q, k or v."""
  q, k, v, _, _ = _inputs()

  def local_loss(q, k, v):
    return fa2_jax.context_parallel_attention(q, k, v, axis_name="context", strategy="ring",
                                              layout="zigzag", implementation="xla",
                                              is_causal=True).sum()

  grad = jax.jit(jax.shard_map(jax.grad(local_loss, argnums=(0, 1, 2)), mesh=_mesh(),
                               in_specs=(SEQ,) * 3, out_specs=(SEQ,) * 3))
  hlo = grad.lower(q, k, v).compile().as_text()
  assert "collective-permute" in hlo
  assert "all-gather" not in hlo


# --- layout, strategy choice, errors --------------------------------------------------------------

@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_layout_round_trip_and_positions(layout):
  x = jnp.arange(2 * 16 * 3, dtype=jnp.int32).reshape(2, 16, 3)
  y = fa2_jax.to_context_layout(x, C, layout=layout)
  np.testing.assert_array_equal(fa2_jax.from_context_layout(y, C, layout=layout), x)
  z = fa2_jax.to_context_layout(jnp.swapaxes(x, 0, 1), C, seq_axis=0, layout=layout)
  np.testing.assert_array_equal(jnp.swapaxes(z, 0, 1), y)
  # device d's shard holds the tokens context_positions names
  shards = np.asarray(y[0, :, 0]).reshape(C, -1) // 3
  for d in range(C):
    np.testing.assert_array_equal(fa2_jax.context_positions(4, d, C, layout=layout), shards[d])
  if layout == "zigzag":
    np.testing.assert_array_equal(shards[0], [0, 1, 14, 15])


def test_strategy_choice():
  name, why = fa2_jax.context_parallel_strategy((1, 4096, 8, 64), (1, 4096, 8, 64), 4)
  assert name == "all_gather" and "MiB" in why
  long = (1, 1 << 20, 8, 128)
  assert fa2_jax.context_parallel_strategy(long, long, 4)[0] == "all_to_all"
  name, why = fa2_jax.context_parallel_strategy((1, 1 << 20, 6, 128), (1, 1 << 20, 6, 128), 4)
  assert name == "ring" and "do not divide" in why
  name, why = fa2_jax.context_parallel_strategy(long, long, 1)
  assert name == "all_gather" and "one device" in why


def test_layout_helpers_and_strategy_refuse_bad_arguments():
  with pytest.raises(ValueError, match=r"query_shape must be the global \[B, T, N, H\]"):
    fa2_jax.context_parallel_strategy((64, 8, 128), (64, 2, 128), 4)
  with pytest.raises(ValueError, match="axis_size must be a positive int, got 0"):
    fa2_jax.context_parallel_strategy((1, 64, 8, 128), (1, 64, 2, 128), 0)
  with pytest.raises(TypeError, match="x must be an array, got list"):
    fa2_jax.to_context_layout([[1, 2, 3, 4]], 2)
  with pytest.raises(TypeError, match="axis_size must be a positive int, got bool"):
    fa2_jax.to_context_layout(jnp.ones((1, 4)), True)
  with pytest.raises(ValueError, match=r"axis_index must lie in \[0, axis_size=4\), got 7"):
    fa2_jax.context_positions(16, 7, 4)


def _trace(strategy="ring", layout="zigzag", n=N, kh=K, t=T, axis_name="context", **kw):
  q, k, v, _, _ = _inputs(n=n, kh=kh, t=t)
  f = functools.partial(fa2_jax.context_parallel_attention, axis_name=axis_name,
                        strategy=strategy, layout=layout, implementation="xla", **kw)
  return jax.eval_shape(jax.shard_map(f, mesh=_mesh(), in_specs=(SEQ,) * 3, out_specs=SEQ),
                        q, k, v)


def test_errors():
  with pytest.raises(TypeError, match="needs layout=: 'contiguous' for chunks sharded in sequence"):
    _trace(layout=None)  # a sequence sharded as it is would be read as zigzag chunks: no default
  with pytest.raises(ValueError, match="strategy must be None or one of"):
    _trace(strategy="ulysses")
  with pytest.raises(ValueError, match="layout must be one of"):
    _trace(layout="striped")
  with pytest.raises(ValueError, match=r"N=4 and key/value heads K=2 must both be divisible by 4"):
    _trace(strategy="all_to_all")
  with pytest.raises(ValueError, match=r"sequence length 12 \(local 3\) is not divisible by 8.*"
                                       "layout='contiguous'"):
    _trace(t=12)
  with pytest.raises(ValueError, match="axis_name='sequence' is not a mesh axis"):
    _trace(axis_name="sequence")
  with pytest.raises(ValueError, match="length 12 .* not divisible by 8"):
    fa2_jax.to_context_layout(jnp.zeros((1, 12)), C)
  bias = jnp.ones((4,), jnp.float32)
  with pytest.raises(ValueError, match="strategy='ring' does not differentiate arrays that score_fn"):
    _trace(score_fn=lambda x, b, h, p, j: x + bias[p % 4])
  with pytest.raises(ValueError, match=r"query_seq_lengths are global lengths and must lie in \[0, 32\]"):
    _trace(query_seq_lengths=jnp.array([33]))
  with pytest.raises(TypeError, match="query_seq_lengths must be integer"):
    _trace(query_seq_lengths=jnp.array([3.0]))
  # lengths are per batch row of the device's q, k, v: not a scalar, nor sharded along the context
  for lengths in (jnp.array([3, 4]), jnp.array(3), 3):
    with pytest.raises(ValueError, match=r"key_value_seq_lengths must have shape \[1\] .* not "
                                         "along the context axis"):
      _trace(key_value_seq_lengths=lengths)
  _trace(q_offset=2, is_causal=True)  # an offset may be one number for every row


_EIGHT_DEVICES = r"""
import jax
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")
import functools
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
import fa2_jax

C, B, T, N, K, H = 8, 1, 64, 4, 1, 16
mesh = jax.make_mesh((C,), ("context",), axis_types=(jax.sharding.AxisType.Auto,))
ks = jax.random.split(jax.random.key(0), 4)
q = jax.random.normal(ks[0], (B, T, N, H), jnp.float32)
k = jax.random.normal(ks[1], (B, T, K, H), jnp.float32)
v = jax.random.normal(ks[2], (B, T, K, H), jnp.float32)
dout = jax.random.normal(ks[3], (B, T, N, H), jnp.float32)
lay = functools.partial(fa2_jax.to_context_layout, axis_size=C)
unlay = functools.partial(fa2_jax.from_context_layout, axis_size=C)
q64, k64, v64, d64 = (np.asarray(x, np.float64) for x in (q, k, v, dout))

def loss(f, q, k, v, dout):
  return jnp.sum(f(q, k, v) * dout)

# a window: the per-piece steps; plain causal: one call per step on whole chunks
for kw in (dict(is_causal=True, local_window_size=(20, 0), implementation="xla"),
           dict(is_causal=True, implementation="xla")):
  local = functools.partial(fa2_jax.context_parallel_attention, axis_name="context", strategy="ring",
                            layout="zigzag", **kw)
  sm = jax.shard_map(local, mesh=mesh, in_specs=(P(None, "context"),) * 3, out_specs=P(None, "context"))
  ring = lambda q, k, v: unlay(sm(lay(q), lay(k), lay(v)))
  ref = lambda q, k, v: fa2_jax.reference_attention(q, k, v, **{a: b for a, b in kw.items() if a != "implementation"})
  got = jax.jit(jax.value_and_grad(functools.partial(loss, ring), argnums=(0, 1, 2)))(q, k, v, dout)
  with jax.enable_x64(True):
    want = jax.value_and_grad(functools.partial(loss, ref), argnums=(0, 1, 2))(
        *map(jnp.asarray, (q64, k64, v64, d64)))
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w), rtol=2e-4, atol=2e-4)
print("ok", len(jax.devices()))
"""


# slow (CI time: a subprocess importing JAX and compiling the ring, about 18 s): the ring's code does
# not depend on the axis size, and its per-piece (window) and whole-chunk steps run in CI on the 4
# devices of this process (test_ring_whole_chunks, test_causal_ragged_documents and others here)
@pytest.mark.slow
def test_ring_on_eight_devices():
  """The zigzag ring over 8 devices (a subprocess: conftest's process has 4): causal MQA with a
  window (per-piece steps) and without (whole-chunk steps), value and gradients against the float64
  reference."""
  import os
  import subprocess
  import sys
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
  env["JAX_PLATFORMS"] = "cpu"
  done = subprocess.run([sys.executable, "-c", _EIGHT_DEVICES], env=env, capture_output=True,
                        text=True, timeout=300)
  assert done.returncode == 0, done.stdout + done.stderr
  assert done.stdout.split()[-2:] == ["ok", "8"]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_ring_steps_compiled_on_one_gpu(causal):
  """The ring's own step functions (benchmarks/context_schedule.py runs them for every device of a
  C = 4 ring, one after another, K/V sliced instead of sent) on the compiled kernels at 8k GQA 8/2,
  head_dim 128: every step's call is large enough for the default fused-dQ backward. Output and
  gradients against the float32 formula within twice the error of the formula computed in bf16."""
  from benchmarks.context_schedule import ring_schedule
  from test_fuzz import xla_formula
  t, c = 8192, 4
  ks = jax.random.split(jax.random.key(5), 4)
  q = jax.random.normal(ks[0], (1, t, 8, 128), jnp.bfloat16)
  k, v = (jax.random.normal(x, (1, t, 2, 128), jnp.bfloat16) for x in ks[1:3])
  w = jax.random.normal(ks[3], q.shape, jnp.float32)  # a random output cotangent
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  zig = lambda x: fa2_jax.to_context_layout(x, c)  # noqa: E731

  def grads(f, w):
    return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(f32(f(q, k, v)) * w),
                                      argnums=(0, 1, 2)))

  ring = grads(ring_schedule(c, causal), zig(w))(zig(q), zig(k), zig(v))
  ring = [fa2_jax.from_context_layout(x, c) for x in ring[1]]
  formula = lambda q, k, v: xla_formula(q, k, v, 128 ** -0.5, causal)[0]  # noqa: E731
  budget = grads(formula, w)(q, k, v)[1]
  ref = grads(formula, w)(f32(q), f32(k), f32(v))[1]
  rel = lambda a, b: float(jnp.linalg.norm(f32(a) - f32(b)) / jnp.linalg.norm(f32(b)))  # noqa: E731
  for name, a, b, r in zip(("dq", "dk", "dv"), ring, budget, ref):
    assert rel(a, r) <= 2 * rel(b, r), (name, rel(a, r), rel(b, r))
