"""flash_attention on query/key/value sharded along the sequence under jax.jit: context parallelism over
the mesh axis sharding T and S (fa2_jax.sharding, fa2_jax.context_parallel) instead of gathering, under
Explicit axes (context_parallel_attention inside the call's shard_map) and Auto axes (the kernels'
partition callbacks). Forward and gradients against the formula; the compiled HLO of jit(grad): the
ring moves K/V by collective-permute and gathers nothing, the all_gather strategy gathers K/V only.

The Triton kernels in interpret mode (the formula where only the routing is tested) on the 4 CPU
devices of conftest.py, tiny shapes: a compile is a few seconds.
"""
from __future__ import annotations

import contextlib
import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import fa2_jax
from fa2_jax import context_parallel

pytestmark = pytest.mark.skipif(len(jax.devices()) < 4,
                                reason="needs 4 devices (conftest sets 4 CPUs)")

flash = functools.partial(fa2_jax.flash_attention, implementation="triton", interpret=True)
B, T, N, K, H = 1, 32, 4, 2, 16  # K = 2 KV heads: not divisible by 4 devices (no all_to_all)
COLLECTIVE = re.compile(
    r"=\s*(.*?)\s+(all-gather|all-to-all|collective-permute|reduce-scatter|all-reduce)(?:-start)?\(")
KINDS = pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])


def _inputs(b=B, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (b, T, N, H), jnp.float32)
  k = jax.random.normal(ks[1], (b, T, K, H), jnp.float32)
  v = jax.random.normal(ks[2], (b, T, K, H), jnp.float32)
  return q, k, v


def _mesh(shape, names, kind):
  return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape),
                       devices=jax.devices()[:int(np.prod(shape))])


@pytest.fixture
def ring(monkeypatch):
  """strategy=None's rule picks the ring: K/V past the gather budget, heads the axis does not divide
  (a mesh axis of 2 divides K = 2: all_to_all)."""
  monkeypatch.setattr(context_parallel, "GATHER_BYTES", 0)


def _grad_fn(fn, **kw):
  loss = lambda q, k, v: jnp.sum(jnp.tanh(fn(q, k, v, **kw)))  # noqa: E731
  return jax.value_and_grad(loss, argnums=(0, 1, 2))


def _run(kind, mesh, spec, args, **kw):
  """Compiled jit(value_and_grad) of the Triton kernels on ``args`` put with ``spec``: (result,
  HLO text). Auto axes: a warning (something gathered) is an error."""
  with jax.set_mesh(mesh) if kind == AxisType.Explicit else contextlib.nullcontext():
    args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in args]
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      compiled = jax.jit(_grad_fn(flash, **kw)).lower(*args).compile()
    return compiled(*args), compiled.as_text()


def _run_with_segments(kind, mesh, args, **kw):
  """``_run`` with segment ids ``args[3]`` for both q and k/v, sharded like the sequence: (result,
  the formula's, HLO text)."""
  def grad_fn(fn):
    loss = lambda q, k, v, s: jnp.sum(jnp.tanh(fn(q, k, v, q_segment_ids=s, kv_segment_ids=s,  # noqa: E731
                                                  **kw)))
    return jax.value_and_grad(loss, argnums=(0, 1, 2))

  with jax.set_mesh(mesh) if kind == AxisType.Explicit else contextlib.nullcontext():
    put = [jax.device_put(x, NamedSharding(mesh, P(None, "context"))) for x in args]
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      compiled = jax.jit(grad_fn(flash)).lower(*put).compile()
    got = compiled(*put)
  return got, grad_fn(fa2_jax.reference_attention)(*args), compiled.as_text()


def _check(got, want, atol=2e-5):
  (loss, grads), (loss_ref, grads_ref) = got, want
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-5)
  for a, b in zip(grads, grads_ref):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=1e-4)


def _collectives(hlo: str) -> list[tuple[str, str]]:
  return [(m.group(2), m.group(1)) for m in map(COLLECTIVE.search, hlo.splitlines()) if m]


def _gathered(hlo: str) -> list[str]:
  """The result shapes of the all-gathers in compiled HLO text (e.g. ``f32[1,32,2,16]``)."""
  return [shape.split("{")[0] for op, shape in _collectives(hlo) if op == "all-gather"]


@KINDS
@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_sequence_sharded_grad_runs_context_parallel(kind, strategy, monkeypatch):
  """q, k, v sharded along T/S over a 'context' axis of 4: jit(value_and_grad) equals the unsharded
  formula, and its HLO has no all-gather of q (ring: none at all, K/V move by collective-permute;
  all_gather: K and V, whose gradients go home by reduce-scatter)."""
  if strategy == "ring":
    monkeypatch.setattr(context_parallel, "GATHER_BYTES", 0)
  mesh = _mesh((4,), ("context",), kind)
  q, k, v = _inputs()
  got, hlo = _run(kind, mesh, P(None, "context"), (q, k, v), is_causal=True)
  _check(got, _grad_fn(fa2_jax.reference_attention, is_causal=True)(q, k, v))
  ops = {op for op, _ in _collectives(hlo)}
  if strategy == "ring":
    assert "collective-permute" in ops and not _gathered(hlo), _collectives(hlo)
  else:
    assert "collective-permute" not in ops and "reduce-scatter" in ops
    assert set(_gathered(hlo)) == {"f32[1,32,2,16]"}, _collectives(hlo)  # K/V [B, S, K, H]
  for g in got[1]:
    assert g.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "context")), 4), g.sharding


def test_relayout_to_zigzag_and_back():
  """Inside shard_map, each device's contiguous chunk moved to its zigzag chunks (two ppermutes)
  equals to_context_layout's placement; moving back restores the input exactly."""
  mesh = _mesh((4,), ("context",), AxisType.Explicit)
  x = jnp.arange(2 * 40 * 3, dtype=jnp.float32).reshape(2, 40, 3)

  def move(to_zigzag):
    fn = functools.partial(context_parallel._relayout, axis_name="context", axis_size=4, seq_axis=1,
                           to_zigzag=to_zigzag)
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(None, "context"),
                                 out_specs=P(None, "context")))

  with jax.set_mesh(mesh):
    xs = jax.device_put(x, P(None, "context"))
    zig = move(True)(xs)
    np.testing.assert_array_equal(zig, fa2_jax.to_context_layout(x, 4))
    np.testing.assert_array_equal(move(False)(zig), x)


def test_balance_rule():
  """Causal self-attention on the ring or all-gather, from BALANCE_MIN_ROWS rows per device and
  chunks that halve; not windows, mask_fn/score_fn, all_to_all, T != S or one device."""
  rows = context_parallel.BALANCE_MIN_ROWS
  balances = lambda causal, window, t, s, strategy, c, fns=False: (  # noqa: E731
      context_parallel._balances(causal, window, t, s, strategy, c, fns))
  assert balances(True, None, rows, rows, "ring", 4)
  assert balances(True, None, rows, rows, "all_gather", 3)
  assert not balances(False, None, rows, rows, "ring", 4)
  assert not balances(True, (127, 0), rows, rows, "ring", 4)
  assert not balances(True, None, rows, rows, "ring", 4, fns=True)
  assert not balances(True, None, rows, rows, "all_to_all", 4)
  assert not balances(True, None, rows, 2 * rows, "ring", 4)
  assert not balances(True, None, rows // 2, rows // 2, "ring", 4)
  assert not balances(True, None, rows + 1, rows + 1, "ring", 4)
  assert not balances(True, None, rows, rows, "ring", 1)


@KINDS
@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_causal_chunks_relaid_out_in_zigzag(kind, strategy, monkeypatch):
  """From BALANCE_MIN_ROWS rows per device (2 here) a causal call's contiguous chunks run in the
  zigzag order (every device the same work) and come back: jit(value_and_grad) with packed
  segment ids equals the formula, q is never gathered, the outputs and gradients keep the inputs'
  sharding, and the relayout's collective-permutes are in the HLO (all_gather: of the query side
  only, beside its all-gather of K/V); backend_for says so under Explicit axes."""
  monkeypatch.setattr(context_parallel, "BALANCE_MIN_ROWS", 2)
  if strategy == "ring":
    monkeypatch.setattr(context_parallel, "GATHER_BYTES", 0)
  mesh = _mesh((4,), ("context",), kind)
  q, k, v = _inputs(seed=6)
  seg = jnp.asarray(np.repeat(np.arange(3), [13, 11, 8])[None], jnp.int32)
  got, want, hlo = _run_with_segments(kind, mesh, (q, k, v, seg), is_causal=True)
  _check(got, want)
  if kind == AxisType.Explicit:
    with jax.set_mesh(mesh):
      args = [jax.device_put(x, P(None, "context")) for x in (q, k, v)]
      reason = fa2_jax.backend_for(*args, is_causal=True, implementation="triton",
                                   interpret=True).reason
    assert "relaid out in zigzag order and back" in reason, reason
  permuted = {shape.split("{")[0] for op, shape in _collectives(hlo) if op == "collective-permute"}
  assert "f32[1,4,4,16]" in permuted, _collectives(hlo)  # q / out: half of a device's chunk
  # K/V halves: moved for the ring; the all-gather gathers them into natural order from any layout
  assert ("f32[1,4,2,16]" in permuted) == (strategy == "ring"), _collectives(hlo)
  assert set(_gathered(hlo)) <= {"f32[1,32,2,16]", "s32[1,32]"}, _collectives(hlo)  # K/V, ids
  for g in got[1]:
    assert g.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "context")), 4), g.sharding


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_zigzag_on_three_devices_with_alibi_and_lse(strategy, monkeypatch):
  """The relayout on an odd axis (C = 3, Auto axes): differentiated ALiBi slopes with a q_offset
  (the kernels' row shift is added and removed in the contiguous frame) and a loss on lse as well
  as out (a nonzero dlse moves to the zigzag chunks too): equal to the formula."""
  monkeypatch.setattr(context_parallel, "BALANCE_MIN_ROWS", 2)
  if strategy == "ring":
    monkeypatch.setattr(context_parallel, "GATHER_BYTES", 0)
  mesh = _mesh((3,), ("context",), AxisType.Auto)
  ks = jax.random.split(jax.random.key(7), 3)
  t = 24  # 8 rows per device, two chunks of 4
  q = jax.random.normal(ks[0], (B, t, N, H), jnp.float32)
  k, v = (jax.random.normal(x, (B, t, K, H), jnp.float32) for x in ks[1:])
  slopes = jnp.linspace(0.1, 0.7, N)

  def grad_fn(fn):
    def loss(q, k, v, sl):
      out, lse = fn(q, k, v, alibi_slopes=sl, is_causal=True, q_offset=2, return_residual=True)
      return jnp.sum(jnp.tanh(out)) + 0.1 * jnp.sum(jnp.sin(lse))
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))

  args = [jax.device_put(x, NamedSharding(mesh, P(None, "context"))) for x in (q, k, v)]
  calls = []
  relayout = context_parallel._relayout
  monkeypatch.setattr(context_parallel, "_relayout",
                      lambda *a, **kw: calls.append(1) or relayout(*a, **kw))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    got = jax.jit(grad_fn(flash))(*args, slopes)
  assert calls, "the zigzag relayout did not run"
  _check(got, grad_fn(fa2_jax.reference_attention)(q, k, v, slopes), atol=5e-5)


@KINDS
def test_batch_and_sequence_mesh(kind, ring):
  """A 2 x 2 mesh, B over 'data' and the sequence over 'context': the heads divide 'context' (2), so
  the rule picks all_to_all (Auto axes: its forward, then the ring's backward); no all-gather."""
  mesh = _mesh((2, 2), ("data", "context"), kind)
  q, k, v = _inputs(b=2, seed=1)
  kw = dict(is_causal=True, local_window_size=(9, 0))
  got, hlo = _run(kind, mesh, P("data", "context"), (q, k, v), **kw)
  _check(got, _grad_fn(fa2_jax.reference_attention, **kw)(q, k, v))
  assert "all-to-all" in {op for op, _ in _collectives(hlo)} and not _gathered(hlo)


@KINDS
def test_variants_travel_with_the_chunks(kind, ring):
  """Segment ids sharded like the sequence (they travel with their chunks), global lengths and a
  soft cap, on the ring: equal to the formula, nothing gathered."""
  mesh = _mesh((4,), ("context",), kind)
  q, k, v = _inputs(seed=2)
  seg = jnp.asarray(np.repeat(np.arange(3), [10, 12, 10])[None], jnp.int32)
  lengths = jnp.array([T - 5], jnp.int32)
  kw = dict(is_causal=True, logits_soft_cap=5.0, key_value_seq_lengths=lengths)

  got, want, hlo = _run_with_segments(kind, mesh, (q, k, v, seg), **kw)
  _check(got, want)
  assert not _gathered(hlo)


def test_explicit_formula_and_alibi_slopes():
  """Explicit axes route every call, the formula's too (before: a ShardingTypeError from its einsum):
  ALiBi slopes (replicated, differentiated), a mask_fn of the positions, q_offset."""
  mesh = _mesh((4,), ("context",), AxisType.Explicit)
  q, k, v = _inputs(seed=3)
  slopes = jnp.linspace(0.1, 0.7, N)
  kw = dict(is_causal=True, q_offset=3, mask_fn=lambda b, h, i, j: (i + j) % 5 != 1)

  def grad_fn(fn):
    loss = lambda q, k, v, sl: jnp.sum(jnp.tanh(fn(q, k, v, alibi_slopes=sl, **kw)))  # noqa: E731
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))

  want = grad_fn(fa2_jax.reference_attention)(q, k, v, slopes)
  with jax.set_mesh(mesh):
    args = [jax.device_put(x, P(None, "context")) for x in (q, k, v)]
    got = jax.jit(grad_fn(fa2_jax.flash_attention))(*args, slopes)
    assert jax.typeof(got[1][0]).sharding.spec == P(None, "context", None, None)
  _check(got, want)


@pytest.mark.parametrize("strategy, slope_grad, kw", [
    ("ring", False, dict(is_causal=True, q_offset=5)),
    ("ring", True, dict(q_offset=-3, local_window_size=(None, 12))),
    ("all_gather", True, dict(is_causal=True, q_offset=5))],
    ids=["ring-fixed", "ring-differentiated", "all_gather-differentiated"])
def test_auto_alibi_slopes_run_context_parallel(strategy, slope_grad, kw, monkeypatch):
  """ALiBi slopes on a sequence-sharded call under Auto axes run context parallelism, no warning:
  the forward's stats carry the kernels' row shift and the backward the slopes' per-row sums
  (fixed: stop_gradient; differentiated: their gradient too). q_offset puts rows past the keys'
  ends (and, non-causal, before them), where the shift is not 0. Equal to the formula; the ring
  gathers nothing, the all_gather strategy K and V only."""
  if strategy == "ring":
    monkeypatch.setattr(context_parallel, "GATHER_BYTES", 0)
  mesh = _mesh((4,), ("context",), AxisType.Auto)
  q, k, v = _inputs(seed=4)
  slopes = jnp.linspace(0.1, 0.7, N)
  fix = (lambda sl: sl) if slope_grad else jax.lax.stop_gradient

  def grad_fn(fn):
    loss = lambda q, k, v, sl: jnp.sum(jnp.tanh(fn(q, k, v, alibi_slopes=fix(sl), **kw)))  # noqa: E731
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))

  args = [jax.device_put(x, NamedSharding(mesh, P(None, "context"))) for x in (q, k, v)]
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    compiled = jax.jit(grad_fn(flash)).lower(*args, slopes).compile()
  got = compiled(*args, slopes)
  _check(got, grad_fn(fa2_jax.reference_attention)(q, k, v, slopes), atol=5e-5)
  if not slope_grad:
    assert not np.any(np.asarray(got[1][3]))
  hlo = compiled.as_text()
  if strategy == "ring":
    assert "collective-permute" in {op for op, _ in _collectives(hlo)} and not _gathered(hlo)
  else:
    assert set(_gathered(hlo)) == {"f32[1,32,2,16]"}, _collectives(hlo)  # K/V [B, S, K, H]


def test_explicit_refusals_and_backend_for():
  """backend_for names the strategy and why (Explicit axes: the sharding is in the type); T and S over
  different mesh axes is a ValueError naming them, from both."""
  mesh = _mesh((2, 2), ("data", "context"), AxisType.Explicit)
  q, k, v = _inputs(seed=5)
  with jax.set_mesh(mesh):
    qs, ks, vs = (jax.device_put(x, P(None, "context")) for x in (q, k, v))
    d = fa2_jax.backend_for(qs, ks, vs, is_causal=True, implementation="triton", interpret=True)
    assert d.backend == "triton"
    assert re.search("sequence is sharded over Explicit mesh axis 'context': context parallelism, "
                     "strategy 'all_gather' \\(the gathered K and V take", d.reason), d.reason
    sds = jax.ShapeDtypeStruct(k.shape, k.dtype, sharding=NamedSharding(mesh, P(None, "data")))
    match = "key is sharded along its sequence axis S .* over mesh axis 'data', but query over mesh"
    with pytest.raises(ValueError, match=match):
      fa2_jax.backend_for(qs, sds, sds)
    kd = jax.device_put(k, P(None, "data"))
    with pytest.raises(ValueError, match=match):
      jax.jit(fa2_jax.flash_attention)(qs, kd, kd)


def test_mosaic_partition_functions_lower(monkeypatch, ring):
  """The Auto axes' per-device functions on the sm90 kernels, short of a GPU: the ring's forward and
  backward (attention_backward with the rows' statistics) lower for a Hopper GPU at the local shapes,
  K/V moving by collective-permute (inside a shard_map, which binds the axis name as the partition
  callback's lowering does)."""
  from fa2_jax import attention
  from fa2_jax.kernels import platform
  monkeypatch.setattr(platform, "on_gpu", lambda: True)
  monkeypatch.setattr(platform, "gpu_compute_capability", lambda: (9, 0))
  st = attention._Static(128 ** -0.5, True, "sm90", False, False,
                         fa2_jax.MosaicConfig.default(128, jnp.bfloat16, True))
  mesh = _mesh((4,), ("context",), AxisType.Explicit)
  seq, rows, stats = P(None, "context"), P(None, None, "context"), P(None, None, None, "context")
  sds = lambda shape, spec, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(  # noqa: E731
      shape, dtype, sharding=NamedSharding(mesh, spec))
  q, kv = sds((1, 1024, 2, 128), seq), sds((1, 1024, 1, 128), seq)
  for fn, args, in_specs, out_specs in [
      (context_parallel.partitioned_forward, (q, kv, kv), (seq,) * 3, (seq, stats)),
      (context_parallel.partitioned_backward,
       (q, kv, kv, q, sds((1, 2, 2, 1024), stats, jnp.float32), q, sds((1, 2, 1024), rows,
                                                                          jnp.float32)),
       (seq,) * 4 + (stats, seq, rows), (seq,) * 3)]:
    local = jax.shard_map(functools.partial(fn, st, "context"), mesh=mesh, in_specs=in_specs,
                          out_specs=out_specs, check_vma=False)
    text = jax.jit(local).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "collective_permute" in text and "all_gather" not in text
