"""flash_attention on sharded arrays under jax.jit (fa2_jax.sharding): batch- and head-sharded calls run
locally on each device, forward and backward, with Auto and Explicit mesh axes; what the kernels cannot
split is refused (Explicit) or gathered with a warning (Auto). Sequence-sharded calls (context
parallelism): tests/test_context_parallel_jit.py.

The evidence of "locally" is the compiled HLO: no all-gather, all-to-all, collective-permute or
reduce-scatter, and no all-reduce of anything but a scalar. Without the partitioning rule the same
jit(grad) compiles to 9 all-gathers of q/k/v and their residuals on these shapes.

CPU: the Triton kernels in interpret mode on the 4 CPU devices of conftest.py; the Mosaic kernels by
lowering for a Hopper GPU (no GPU needed). The ``gpu`` test compiles both on 2+ GPUs.
"""
from __future__ import annotations

import contextlib
import functools
import re
import warnings

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import fa2_jax
from fa2_jax.kernels import platform
from fa2_jax import attention, sharding
from conftest import on_gpu

INTERPRET = None if on_gpu() else True
flash = functools.partial(fa2_jax.flash_attention, implementation="triton", interpret=INTERPRET)
needs4 = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (conftest sets 4 CPUs)")

# [B, T, N, H] / [B, S, K, H]: B and K divisible by 2 and B by 4; N = 2 K (GQA); T != S.
B, T, S, N, K, H = 4, 16, 24, 4, 2, 16
COLLECTIVE = re.compile(
    r"=\s*(.*?)\s+(all-gather|all-to-all|collective-permute|reduce-scatter|all-reduce)(?:-start)?\(")


def _qkv(seed=0, dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (B, T, N, H), jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], (B, S, K, H), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (B, S, K, H), jnp.float32).astype(dtype)
  return q, k, v


def _loss(fn):
  return lambda q, k, v: jnp.sum(jnp.tanh(fn(q, k, v, is_causal=True).astype(jnp.float32)))


def _reference(q, k, v):
  """Unsharded loss and gradients through the formula."""
  return jax.value_and_grad(_loss(fa2_jax.reference_attention), argnums=(0, 1, 2))(q, k, v)


def _collectives(hlo: str) -> list[tuple[str, str]]:
  """(op, result shape) of every collective in compiled HLO text."""
  return [(m.group(2), m.group(1)) for m in map(COLLECTIVE.search, hlo.splitlines()) if m]


def _assert_local(hlo: str):
  """No collective moves activations: at most all-reduces of scalars (the loss)."""
  moving = [(op, shape) for op, shape in _collectives(hlo)
            if op != "all-reduce" or not re.fullmatch(r"\(?f32\[\](, f32\[\])*\)?", shape)]
  assert not moving, moving


def _check(got, want, atol=2e-5):
  (loss, grads), (loss_ref, grads_ref) = got, want
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-5)
  for a, b in zip(grads, grads_ref):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=1e-4)


def _mesh(shape, names, kind):
  devices = jax.devices()[:int(np.prod(shape))]
  return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape), devices=devices)


# --- the plan, without compiling -------------------------------------------------------------------

SIZES = {"data": 2, "model": 2, "all": 4}


def _plan(q_spec, k_spec, v_spec=None, kh=K):
  return sharding.plan(SIZES, [(B, T, N, H), (B, S, kh, H), (B, S, kh, H)],
                       [q_spec, k_spec, k_spec if v_spec is None else v_spec])


def test_plan_keeps_batch_and_heads():
  p = _plan(P("data", None, "model", None), P("data", None, "model", None))
  assert (p.batch, p.heads, p.problems) == (("data",), ("model",), ())
  assert p.spec(sharding.Q) == P("data", None, "model", None)
  assert p.spec(sharding.LSE) == P("data", "model", None)
  # Replicated k/v take q's sharding (a local slice); a sharding of k/v alone is taken too.
  assert _plan(P("data"), P()) == sharding.Plan(("data",), ())
  assert _plan(P(), P(None, None, "model")) == sharding.Plan((), ("model",))


@pytest.mark.parametrize("q_spec, k_spec, kh, match", [
    (P(None, "data"), P(None, "all"), K, r"key is sharded along its sequence axis S \(dim 1\) over "
     "mesh axis 'all', but query over mesh axis 'data'"),
    (P(None, ("data", "model")), P(), K, "query is sharded along its sequence axis T over mesh axes "
     r"\('data', 'model'\), but context parallelism runs over one mesh axis"),
    (P(None, "model"), P(None, None, "model"), K, "query is sharded along its sequence axis T over "
     "mesh axis 'model', but that axis also shards the batch axis B or the heads"),
    (P(None, None, None, "data"), P(), K, "query is sharded along head_dim H"),
    (P(None, None, "all"), P(), K, r"K=2 key/value heads do not split into 4 .* whole GQA groups"),
    (P(None, None, "model"), P(), 1, "K=1 key/value heads do not split into 2"),  # MQA
    (P("data"), P("model"), K, "key is sharded along its batch axis B .* but query over mesh axis "
     "'data'"),
])
def test_plan_reports_what_it_cannot_keep(q_spec, k_spec, kh, match):
  p = _plan(q_spec, k_spec, kh=kh)
  assert re.search(match, "; ".join(p.problems)), p.problems
  assert not set(p.axes) & {"all"}  # a refused sharding is replicated, never kept


def test_plan_shards_the_sequence():
  """T of q and S of k/v over one mesh axis: context parallelism over it (``Plan.context``), with B
  and the heads as before; a replicated sequence is sliced to match; what cannot be split is
  reported and replicated."""
  p = _plan(P(None, "data"), P(None, "data"))
  assert (p.batch, p.heads, p.context, p.problems) == ((), (), ("data",), ())
  assert p.spec(sharding.Q) == P(None, "data", None, None)
  assert p.spec(sharding.STATS) == P(None, None, None, "data")
  assert p.spec("bs") == P(None, "data")  # kv segment ids travel with their keys
  assert _plan(P("data", "model"), P()) == sharding.Plan(("data",), (), (), ("model",))
  assert _plan(P(), P(None, "model")).context == ("model",)  # q replicated: sliced to match
  shapes = [(B, 18, N, H), (B, S, K, H), (B, S, K, H)]
  p = sharding.plan(SIZES, shapes, [P(None, "all")] * 3)
  assert p.context == () and "its 4 devices do not divide T=18 and S=24" in p.problems[0]
  p = sharding.plan(SIZES, [(B, T, N, H), (B, S, K, H), (B, S, K, H)], [P(None, "data")] * 3,
                    whole={"t": "a reason"})
  assert p.context == () and p.problems[0].endswith("over mesh axis 'data', but a reason")


def test_plan_covers_operands_by_layout():
  """Further operands (per-row lengths "b", per-head slopes "n") follow the plan through their
  layouts, and their own shardings are checked like q/k/v's."""
  shapes = [(B, T, N, H), (B, S, K, H), (B, S, K, H), (B,), (N,)]
  layouts = (sharding.Q, sharding.KV, sharding.KV, "b", "n")
  names = (*sharding.QKV_NAMES, "lengths", "slopes")
  qkv = [P("data", None, "model")] * 3
  p = sharding.plan(SIZES, shapes, qkv + [P(), P("model")], layouts, names)
  assert not p.problems and (p.spec("b"), p.spec("n")) == (P("data"), P("model"))
  p = sharding.plan(SIZES, shapes, qkv + [P("model"), P()], layouts, names)
  assert p.problems == ("lengths is sharded along its batch axis B (dim 0) over mesh axis 'model', "
                        "but query over mesh axis 'data'",)
  rule, kw = sharding._rule(None, layouts, (sharding.Q,), (), None, None, None, None)
  assert rule == "b t n h, b s k h, b s k h, b, n -> b t n h"
  assert kw == dict(need_replication_factors=("h",))  # T and S may be sharded: context parallelism


# --- Auto mesh axes: custom_partitioning ------------------------------------------------------------

@needs4
def test_auto_batch_sharded_grad_runs_locally():
  """device_put with a NamedSharding over B: jit(value_and_grad) compiles with no collective of the
  activations, keeps B sharded in the gradients, and matches the unsharded formula."""
  mesh = _mesh((4,), ("data",), AxisType.Auto)
  q, k, v = _qkv()
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data")))
  fn = jax.jit(jax.value_and_grad(_loss(flash), argnums=(0, 1, 2)))
  args = tuple(map(put, (q, k, v)))
  compiled = fn.lower(*args).compile()
  _assert_local(compiled.as_text())
  got = compiled(*args)
  _check(got, _reference(q, k, v))
  for g in got[1]:
    assert g.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 4), g.sharding


@needs4
@pytest.mark.parametrize("shape, names, spec", [
    ((2, 2), ("data", "model"), P("data", None, "model", None)),  # batch and heads
    ((2,), ("model",), P(None, None, "model", None)),  # heads only: one KV head per device
])
def test_auto_head_sharded_grad_runs_locally(shape, names, spec):
  """jit with in_shardings/out_shardings over the heads (GQA: N = 4 query heads, K = 2 KV heads)."""
  mesh = _mesh(shape, names, AxisType.Auto)
  q, k, v = _qkv(seed=1)
  s = NamedSharding(mesh, spec)
  fn = jax.jit(jax.value_and_grad(_loss(flash), argnums=(0, 1, 2)), in_shardings=(s, s, s),
               out_shardings=(NamedSharding(mesh, P()), (s, s, s)))
  compiled = fn.lower(q, k, v).compile()
  _assert_local(compiled.as_text())
  _check(compiled(q, k, v), _reference(q, k, v))


@needs4
def test_auto_forward_output_keeps_the_sharding():
  mesh = _mesh((2, 2), ("data", "model"), AxisType.Auto)
  q, k, v = _qkv(seed=2)
  s = NamedSharding(mesh, P("data", None, "model", None))
  fn = jax.jit(lambda a, b, c: flash(a, b, c, is_causal=True, return_residual=True),
               in_shardings=(s, s, s))
  compiled = fn.lower(q, k, v).compile()
  assert not _collectives(compiled.as_text())
  out, lse = compiled(*(jax.device_put(x, s) for x in (q, k, v)))
  out_ref, lse_ref = fa2_jax.reference_attention(q, k, v, is_causal=True, return_residual=True)
  np.testing.assert_allclose(out, out_ref, atol=2e-5)
  np.testing.assert_allclose(lse, lse_ref, atol=2e-5)
  assert out.sharding.is_equivalent_to(s, 4)
  assert lse.sharding.is_equivalent_to(NamedSharding(mesh, P("data", None, "model")), 3)


@needs4
@pytest.mark.parametrize("q_spec, k_spec, match", [
    (P(None, None, None, "data"), P(), "query is sharded along head_dim H"),
    (P(None, None, "data"), P(), "whole GQA groups"),  # 4 devices over K = 2 KV heads
])
def test_auto_unsupported_sharding_is_gathered_with_a_warning(q_spec, k_spec, match):
  """Under Auto axes the compiler's callback cannot raise a readable error: XLA gathers the axis, the
  result is correct, and a UserWarning says what was gathered and why."""
  mesh = _mesh((4,), ("data",), AxisType.Auto)
  q, k, v = _qkv(seed=3)
  qs, ks = NamedSharding(mesh, q_spec), NamedSharding(mesh, k_spec)
  fn = jax.jit(jax.value_and_grad(_loss(flash), argnums=(0, 1, 2)), in_shardings=(qs, ks, ks))
  with pytest.warns(UserWarning, match=match):
    compiled = fn.lower(q, k, v).compile()
  assert any(op == "all-gather" for op, _ in _collectives(compiled.as_text()))
  _check(compiled(jax.device_put(q, qs), jax.device_put(k, ks), jax.device_put(v, ks)),
         _reference(q, k, v))



@needs4
def test_auto_segment_ids_sharded_along_the_sequence_warn():
  """Segment ids sharded along T/S under Auto axes (query/key/value sharded on B only) are gathered
  before the kernel: the result is correct and a UserWarning names them (none did before: the plan
  read the shardings of query, key and value alone)."""
  mesh = _mesh((2, 2), ("data", "model"), AxisType.Auto)
  q, k, v = _qkv(seed=3)
  b, t, s = q.shape[0], q.shape[1], k.shape[1]
  q_seg = jnp.asarray(np.repeat(np.arange(2), t // 2)[None].repeat(b, 0), jnp.int32)
  kv_seg = jnp.asarray(np.repeat(np.arange(2), s // 2)[None].repeat(b, 0), jnp.int32)
  qkv_s, seg_s = NamedSharding(mesh, P("data")), NamedSharding(mesh, P("data", "model"))
  f = lambda q, k, v, a, c: flash(q, k, v, q_segment_ids=a, kv_segment_ids=c)  # noqa: E731
  fn = jax.jit(f, in_shardings=(qkv_s, qkv_s, qkv_s, seg_s, seg_s))
  with pytest.warns(UserWarning, match="segment ids are sharded along their sequence axis"):
    compiled = fn.lower(q, k, v, q_seg, kv_seg).compile()
  out = compiled(*(jax.device_put(x, qkv_s) for x in (q, k, v)),
                 jax.device_put(q_seg, seg_s), jax.device_put(kv_seg, seg_s))
  want = fa2_jax.reference_attention(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg)
  np.testing.assert_allclose(out, want, atol=2e-5)


@needs4
def test_auto_sequence_sharded_segment_ids_over_more_devices_than_blocks():
  """q, k, v and segment ids sharded along the sequence over a 'context' axis of 4, with 2 key/query
  blocks per range table (float32 tiles of 32 at T = 64): jit(grad) compiles (the block-range tables
  used to reach the partition callback split over part of the axis: an IndivisibleError), runs
  context parallelism with the segment ids travelling with their chunks (no warning: nothing is
  gathered but K/V by the all_gather strategy), and matches the formula."""
  mesh = _mesh((4,), ("context",), AxisType.Auto)
  t = 64
  ks = jax.random.split(jax.random.key(5), 3)
  q = jax.random.normal(ks[0], (1, t, 2, H), jnp.float32)
  k, v = (jax.random.normal(x, (1, t, 1, H), jnp.float32) for x in ks[1:])
  seg = jnp.asarray(np.repeat(np.arange(4), t // 4)[None], jnp.int32)  # 4 documents of 16 tokens
  seq = NamedSharding(mesh, P(None, "context"))

  def loss(fn):
    return lambda q, k, v, s: jnp.sum(jnp.tanh(fn(q, k, v, is_causal=True, q_segment_ids=s,
                                                  kv_segment_ids=s)))

  fn = jax.jit(jax.value_and_grad(loss(flash), argnums=(0, 1, 2)), in_shardings=(seq,) * 4)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    compiled = fn.lower(q, k, v, seg).compile()
  want = jax.value_and_grad(loss(fa2_jax.reference_attention), argnums=(0, 1, 2))(q, k, v, seg)
  _check(compiled(*(jax.device_put(x, seq) for x in (q, k, v, seg))), want)


def _add_table_sums(q, k, v, *tables):
  """A stand-in for the kernels behind the partitioned call: q plus every table entry's sum."""
  del k, v
  return (q + sum(jnp.sum(t) for t in tables).astype(q.dtype),)


@needs4
@pytest.mark.parametrize("family", ["triton", "sm90"])
def test_range_tables_of_sequence_sharded_segment_ids_reach_the_partitioner(family):
  """The range tables of each family's tiles (sm90: 2 forward blocks of 128 rows at T = 256, the
  Hopper report's shape; the kernels cannot run on CPU, so a stand-in consumes the tables), computed
  from segment ids sharded along the sequence over 4 devices, pass through the partition callback:
  no IndivisibleError, and the same tables as on one device."""
  from fa2_jax.kernels.block_ranges import range_tables
  from fa2_jax.kernels.masking import Variant, VariantArrays
  mesh = _mesh((4,), ("context",), AxisType.Auto)
  t, h = (256, 64) if family == "sm90" else (64, H)
  tiles = (fa2_jax.MosaicConfig.default(h, jnp.bfloat16, is_causal=True).range_tiles(t)
           if family == "sm90" else fa2_jax.BlockSizes.default(h, jnp.float32).clamp(t, t)
           .range_tiles())
  assert min(-(-t // rows) for _, rows, _ in tiles.values()) < 4  # fewer blocks than devices
  variant = Variant(is_causal=True, has_segments=True)

  def f(q, seg):
    arrays = VariantArrays(q_segment_ids=seg, kv_segment_ids=seg)
    tables = range_tables(variant, arrays, tiles, batch=1, heads=1, seq_q=t, seq_k=t)
    layouts = tuple(attention._layout(f"table_{name}", x) for name, x in tables.items())
    return sharding.partitioned(_add_table_sums, (q, q, q, *tables.values()),
                                (sharding.Q, sharding.KV, sharding.KV, *layouts), (sharding.Q,))[0]

  q = jnp.zeros((1, t, 1, h), jnp.float32)
  seg = jnp.asarray(np.repeat(np.arange(4), t // 4)[None], jnp.int32)
  seq = NamedSharding(mesh, P(None, "context"))
  with pytest.warns(UserWarning, match="sequence axis"):
    got = jax.jit(f, in_shardings=(seq, seq))(q, seg)
  np.testing.assert_array_equal(got, jax.jit(f)(q, seg))


# --- Explicit mesh axes: shard_map at trace time ----------------------------------------------------

@needs4
def test_explicit_mesh_batch_and_heads():
  """jax.set_mesh with Explicit axes: the call used to fail ("sharded ref ... can only be sliced along
  unsharded axes"); now it runs per device, typed with the inputs' sharding, with no collective."""
  mesh = _mesh((2, 2), ("data", "model"), AxisType.Explicit)
  q, k, v = _qkv(seed=4)
  spec = P("data", None, "model", None)
  with jax.set_mesh(mesh):
    args = tuple(jax.device_put(x, spec) for x in (q, k, v))
    out = jax.jit(lambda a, b, c: flash(a, b, c, is_causal=True))(*args)
    assert jax.typeof(out).sharding.spec == spec
    compiled = jax.jit(jax.value_and_grad(_loss(flash), argnums=(0, 1, 2))).lower(*args).compile()
    _assert_local(compiled.as_text())
    got = compiled(*args)
  np.testing.assert_allclose(out, fa2_jax.reference_attention(q, k, v, is_causal=True), atol=2e-5)
  _check(got, _reference(q, k, v))
  assert all(jax.typeof(g).sharding.spec == spec for g in got[1])


@needs4
def test_explicit_mesh_replicated_kv_and_eager():
  """q sharded over B, k/v replicated: k/v are sliced locally; their gradients come back replicated
  (gathered, as their type says). Also outside jit."""
  mesh = _mesh((4,), ("data",), AxisType.Explicit)
  q, k, v = _qkv(seed=5)
  with jax.set_mesh(mesh):
    qs = jax.device_put(q, P("data"))
    ks, vs = jax.device_put(k, P()), jax.device_put(v, P())
    got = jax.jit(jax.value_and_grad(_loss(flash), argnums=(0, 1, 2)))(qs, ks, vs)
    eager = flash(qs, ks, vs, is_causal=True)
  _check(got, _reference(q, k, v))
  assert jax.typeof(got[1][1]).sharding.spec == P(None, None, None, None)
  np.testing.assert_allclose(eager, fa2_jax.reference_attention(q, k, v, is_causal=True),
                             atol=2e-5)


@needs4
def test_explicit_mesh_alibi_slopes_gradient_and_eager():
  """ALiBi's slopes sharded with B over Explicit axes: their gradient equals the formula's, and an
  eager call runs (the kernels' custom_vjp with symbolic zeros, which an eager shard_map refuses
  unless under a jit of its own)."""
  mesh = _mesh((4,), ("data",), AxisType.Explicit)
  q, k, v = _qkv(seed=6)
  slopes = jnp.linspace(0.1, 0.8, B * N).reshape(B, N)

  def loss(fn):
    return lambda q, sl: jnp.sum(jnp.tanh(fn(q, k, v, is_causal=True, alibi_slopes=sl)))

  want = jax.value_and_grad(loss(fa2_jax.reference_attention), argnums=(0, 1))(q, slopes)
  with jax.set_mesh(mesh):
    qs, sls = jax.device_put(q, P("data")), jax.device_put(slopes, P("data"))
    got = jax.jit(jax.value_and_grad(loss(flash), argnums=(0, 1)))(qs, sls)
    out = flash(qs, k, v, is_causal=True, alibi_slopes=sls)  # an eager shard_map
  _check(got, want)
  np.testing.assert_allclose(out, fa2_jax.reference_attention(q, k, v, is_causal=True,
                                                              alibi_slopes=slopes), atol=2e-5)


@needs4
@pytest.mark.parametrize("q_spec, k_spec, match", [
    (P("data"), P(None, "data"), "key is sharded along its sequence axis S over mesh axis 'data', "
     "but that axis also shards the batch axis B"),
    (P(None, None, None, "data"), P(), "head_dim H"),
    (P(None, None, "data"), P(), "whole GQA groups"),  # 4 devices over K = 2 KV heads
])
def test_explicit_mesh_unsupported_sharding_raises(q_spec, k_spec, match):
  mesh = _mesh((4,), ("data",), AxisType.Explicit)
  q, k, v = _qkv(seed=6)
  with jax.set_mesh(mesh):
    args = jax.device_put(q, q_spec), jax.device_put(k, k_spec), jax.device_put(v, k_spec)
    with pytest.raises(ValueError, match=match):
      jax.jit(lambda a, b, c: flash(a, b, c))(*args)
    with pytest.raises(ValueError, match=match):  # backend_for raises what flash_attention would
      fa2_jax.backend_for(*args, implementation="triton", interpret=INTERPRET)
    formula = jax.jit(lambda a, b, c: fa2_jax.flash_attention(a, b, c, implementation="xla"))
    if "head_dim" in match:  # the formula contracts a sharded head_dim across devices
      np.testing.assert_allclose(formula(*args), fa2_jax.reference_attention(q, k, v), atol=2e-5)
    else:  # the formula refuses the rest as the kernels do, not with JAX's sharding errors
      with pytest.raises(ValueError, match=match):
        formula(*args)


@needs4
def test_explicit_head_dim_of_query_and_key_refused_by_the_formula_too():
  """q and k both sharded along head_dim: the formula's q K^T would contract it across devices,
  which JAX's Explicit rules refuse unreadably; flash_attention and backend_for name it."""
  mesh = _mesh((4,), ("data",), AxisType.Explicit)
  q, k, v = _qkv(seed=6)
  spec = P(None, None, None, "data")
  with jax.set_mesh(mesh):
    args = [jax.device_put(x, spec) for x in (q, k, v)]
    for call in (lambda: jax.jit(lambda a, b, c: fa2_jax.flash_attention(a, b, c))(*args),
                 lambda: fa2_jax.backend_for(*args)):
      with pytest.raises(ValueError, match="query and key are both sharded along head_dim H over "
                                           "mesh axis 'data'"):
        call()


@needs4
def test_export_of_an_explicit_sharded_call():
  """jax.export of a sharded jit(grad) under Explicit axes: the kernels lower per device, with no
  partitioner callback in the module (which export could not serialize)."""
  mesh = _mesh((4,), ("data",), AxisType.Explicit)
  q = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32, sharding=NamedSharding(mesh, P("data")))
  k = jax.ShapeDtypeStruct((B, S, K, H), jnp.float32, sharding=NamedSharding(mesh, P("data")))
  with jax.set_mesh(mesh):
    exp = jax.export.export(jax.jit(jax.grad(_loss(flash), argnums=(0, 1, 2))))(q, k, k)
  assert exp.nr_devices == 4 and "CustomSPMDPartitioning" not in exp.mlir_module()


# --- existing call sites: shard_map, and the Mosaic kernels by lowering ------------------------------

def _primitives(jaxpr) -> list[str]:
  names = []
  for eqn in jaxpr.eqns:
    names.append(eqn.primitive.name)
    for value in eqn.params.values():
      for item in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(item, jax.extend.core.ClosedJaxpr):
          names += _primitives(item.jaxpr)
        elif isinstance(item, jax.extend.core.Jaxpr):
          names += _primitives(item)
  return names


@pytest.fixture
def fake_hopper(monkeypatch):
  """The dispatcher believes it runs on an H200: the Mosaic kernels trace and lower for "cuda"."""
  monkeypatch.setattr(platform, "on_gpu", lambda: True)
  monkeypatch.setattr(platform, "gpu_compute_capability", lambda: (9, 0))


@needs4
@pytest.mark.parametrize("impl", ["triton", "mosaic"])
def test_inside_shard_map_nothing_is_added(fake_hopper, impl):
  """Inside a user's shard_map (check_vma=True) the arrays are already local: no second shard_map,
  and custom_partitioning lowers straight to the kernels (no partitioner custom call)."""
  mesh = _mesh((4,), ("data",), AxisType.Explicit)
  spec = P("data", None, None, None)
  local = lambda a, b, c: jax.grad(_loss(functools.partial(
      fa2_jax.flash_attention, implementation=impl)), argnums=(0, 1, 2))(a, b, c)
  sm = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec,) * 3,
                             check_vma=True))
  q = jax.ShapeDtypeStruct((4, 256, 4, 128), jnp.bfloat16, sharding=NamedSharding(mesh, spec))
  k = jax.ShapeDtypeStruct((4, 256, 2, 128), jnp.bfloat16, sharding=NamedSharding(mesh, spec))
  traced = sm.trace(q, k, k)
  assert _primitives(traced.jaxpr.jaxpr).count("shard_map") == 1
  if impl == "mosaic":  # the Triton lowering needs the GPU's description (tests/test_lowering.py)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "CustomSPMDPartitioning" not in text and "all_gather" not in text


@needs4
def test_interpret_inside_shard_map_with_check_vma_says_how():
  """Pallas interpret mode is not typed for varying manual axes: a clear error naming
  check_vma=False, not the interpreter's failure inside JAX; with it the call runs."""
  mesh = _mesh((4,), ("data",), AxisType.Explicit)
  spec = P("data")
  q, k, v = _qkv(seed=7)
  local = lambda a, b, c: fa2_jax.flash_attention(a, b, c, interpret=True)  # noqa: E731
  with jax.set_mesh(mesh):
    args = [jax.device_put(x, spec) for x in (q, k, v)]
    with pytest.raises(ValueError, match="pass check_vma=False to jax.shard_map"):
      jax.jit(jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec))(*args)
    out = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec,
                                check_vma=False))(*args)
  np.testing.assert_allclose(out, fa2_jax.reference_attention(q, k, v), atol=2e-5)


@needs4
@pytest.mark.parametrize("name", ["q_offset", "key_value_seq_lengths", "segment_ids"])
def test_mosaic_variant_operands_varying_inside_shard_map(fake_hopper, name):
  """The Mosaic kernels' loop bounds read from variant operands that vary over a shard_map axis (a
  per-device q_offset, lengths, segment ids: what context parallelism passes every block) trace
  forward and backward under check_vma=True (the loops' counters typed alike on both sides)."""
  mesh = _mesh((4,), ("data",), AxisType.Auto)
  spec = P("data")

  def local(q, k, v, offsets, segments):
    extra = ({name: offsets} if name != "segment_ids"
             else dict(q_segment_ids=segments, kv_segment_ids=segments))
    f = lambda q, k, v: jnp.sum(fa2_jax.flash_attention(
        q, k, v, is_causal=True, implementation="mosaic", **extra).astype(jnp.float32))
    return jax.grad(f, argnums=(0, 1, 2))(q, k, v)

  sm = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 5, out_specs=(spec,) * 3,
                     check_vma=True)
  q = jax.ShapeDtypeStruct((4, 256, 4, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((4, 256, 2, 128), jnp.bfloat16)
  ints = (jax.ShapeDtypeStruct((4,), jnp.int32), jax.ShapeDtypeStruct((4, 256), jnp.int32))
  grads = jax.eval_shape(sm, q, k, k, *ints)
  assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]


def _mosaic_static(h=128, causal=False):
  return attention._Static(h ** -0.5, causal, "sm90", False, False,
                           fa2_jax.MosaicConfig.default(h, jnp.bfloat16, causal))


@pytest.mark.parametrize("causal", [True, False])  # non-causal: the fused-dQ (custom_vmap) backward
def test_mosaic_partition_callbacks_lower_local_blocks(fake_hopper, causal):
  """The Auto path for the Mosaic kernels, short of compiling: the partition callbacks keep B and
  the heads sharded and their per-device functions lower for a Hopper GPU at the local shapes."""
  from fa2_jax.sharding import KV, LSE, STATS, Q
  mesh = _mesh((2, 2), ("data", "model"), AxisType.Auto)
  b, t, n, kh, h = 4, 256, 8, 4, 128
  io = NamedSharding(mesh, P("data", None, "model", None))
  lse = NamedSharding(mesh, P("data", "model", None))
  stats = NamedSharding(mesh, P("data", "model", None, None))
  sds = lambda shape, s, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=s)
  q, kv = sds((b, t, n, h), io), sds((b, t, kh, h), io)
  lse_sds = sds((b, n, t), lse, jnp.float32)
  stats_sds = sds((b, n, 2, t), stats, jnp.float32)
  st = _mosaic_static(h, causal)
  for fn, args, layouts, out_layouts, want_outs in [
      (functools.partial(sharding._call_forward, attention._forward, st), (q, kv, kv),
       (Q, KV, KV), (Q, STATS), (io, stats)),
      (functools.partial(sharding._call_backward, attention._backward, st),
       (q, kv, kv, q, stats_sds, q, lse_sds), (Q, KV, KV, Q, STATS, Q, LSE), (Q, KV, KV),
       (io,) * 3)]:
    _, local_fn, outs, ins = sharding._partition(fn, layouts, out_layouts, (), None, mesh, args,
                                                 None)
    assert ins == tuple(a.sharding for a in args) and outs == want_outs
    local = [jax.ShapeDtypeStruct(s.shard_shape(a.shape), a.dtype) for a, s in zip(args, ins)]
    text = jax.jit(local_fn).trace(*local).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@needs4
def test_mosaic_jit_grad_lowers_with_partitioning_rules(fake_hopper):
  """jit(grad) of the Mosaic kernels on Auto-sharded inputs lowers with one partitioned custom call
  for the forward and one for the backward, each carrying its Shardy rule."""
  mesh = _mesh((4,), ("data",), AxisType.Auto)
  s = NamedSharding(mesh, P("data", None, None, None))
  q = jax.ShapeDtypeStruct((4, 256, 4, 128), jnp.bfloat16, sharding=s)
  k = jax.ShapeDtypeStruct((4, 256, 2, 128), jnp.bfloat16, sharding=s)
  fn = jax.jit(jax.grad(_loss(functools.partial(fa2_jax.flash_attention, implementation="mosaic")),
                        argnums=(0, 1, 2)))
  text = fn.trace(q, k, k).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("custom_call @CustomSPMDPartitioning(") == 2
  assert text.count("sdy.sharding_rule") == 2


@pytest.mark.gpu
@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2+ GPUs")
@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize("impl", [None, "triton"])  # None: Mosaic on Hopper, else Triton
def test_compiled_batch_sharded_grad_runs_locally_gpu(impl, kind):
  """Compiled kernels on every GPU: batch-sharded jit(value_and_grad) has no collective of the
  activations and matches the single-device call of the same kernels."""
  nd = len(jax.devices())
  mesh = jax.make_mesh((nd,), ("data",), axis_types=(kind,))
  ks = jax.random.split(jax.random.key(7), 3)
  q = jax.random.normal(ks[0], (2 * nd, 512, 8, 128), jnp.float32).astype(jnp.bfloat16)
  k = jax.random.normal(ks[1], (2 * nd, 768, 2, 128), jnp.float32).astype(jnp.bfloat16)
  v = jax.random.normal(ks[2], (2 * nd, 768, 2, 128), jnp.float32).astype(jnp.bfloat16)
  fn = jax.jit(jax.value_and_grad(_loss(functools.partial(fa2_jax.flash_attention,
                                                          implementation=impl)),
                                  argnums=(0, 1, 2)))
  one = jax.devices()[0]
  want = fn(*(jax.device_put(x, one) for x in (q, k, v)))
  with jax.set_mesh(mesh):
    args = tuple(jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (q, k, v))
    compiled = fn.lower(*args).compile()
    got = compiled(*args)
  _assert_local(compiled.as_text())
  _check(got, want, atol=1e-2)


@needs4
@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit])
def test_batch_sharded_variants_run_locally(kind):
  """Packed documents with a sliding window, padding lengths and ALiBi, batch-sharded: the variant
  operands and the range tables are split with B (Auto: no collective of the activations in the
  compiled step; Explicit: one shard_map), and the result is the unsharded formula's."""
  mesh = _mesh((4,), ("data",), kind)
  q, k, v = _qkv(3)
  seg_q = jnp.asarray(np.repeat(np.arange(2), T // 2)[None].repeat(B, 0), jnp.int32)
  seg_k = jnp.asarray(np.repeat(np.arange(2), S // 2)[None].repeat(B, 0), jnp.int32)
  kw = dict(q_segment_ids=seg_q, kv_segment_ids=seg_k,
            key_value_seq_lengths=jnp.array([S, S - 3, 7, S], jnp.int32),
            alibi_slopes=jnp.linspace(0.1, 0.4, N))

  def loss(fn):
    return lambda q, k, v, kw: jnp.sum(jnp.tanh(fn(q, k, v, is_causal=True,
                                                   local_window_size=(5, 0), **kw)))

  want = jax.value_and_grad(loss(fa2_jax.reference_attention), argnums=(0, 1, 2))(q, k, v, kw)
  with jax.set_mesh(mesh) if kind == AxisType.Explicit else contextlib.nullcontext():
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data")))  # noqa: E731
    args = tuple(map(put, (q, k, v)))
    kw_sharded = {name: (put(x) if name.endswith(("segment_ids", "lengths")) else x)
                  for name, x in kw.items()}
    compiled = jax.jit(jax.value_and_grad(loss(flash), argnums=(0, 1, 2))).lower(
        *args, kw_sharded).compile()
    _assert_local(compiled.as_text())
    got = compiled(*args, kw_sharded)
  _check(got, want)


def _mask_reads_b(b, h, i, j):
  """A mask_fn of the batch index: batch element b also sees the b keys after its own position."""
  return j <= i + b


def _mask_of_positions(b, h, i, j):
  return (i + j) % 3 != 0


def _score_reads_h(s, b, h, i, j):
  return s * (1.0 + 0.5 * h.astype(s.dtype))


@needs4
@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit])
def test_index_functions_under_sharding(kind):
  """The kernels give mask_fn/score_fn the index of their grid: under a split of B (heads) that is a
  device's own row (head) counted from 0. A function of the positions alone runs locally (its block
  mask computed on the whole call: inside the shard_map nothing can be evaluated while tracing); one
  that reads a split axis's index is gathered with a warning (Auto) or refused (Explicit), never
  computed with the wrong index."""
  mesh = _mesh((2, 2), ("data", "model"), kind)
  q, k, v = _qkv(seed=8)
  spec = P("data", None, "model", None)

  def grad_fn(**kw):
    f = lambda q, k, v: jnp.sum(jnp.tanh(flash(q, k, v, **kw)))  # noqa: E731
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))

  def want(**kw):
    f = lambda q, k, v: jnp.sum(jnp.tanh(fa2_jax.reference_attention(q, k, v, **kw)))  # noqa: E731
    return jax.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)

  with jax.set_mesh(mesh) if kind == AxisType.Explicit else contextlib.nullcontext():
    args = tuple(jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v))
    compiled = grad_fn(mask_fn=_mask_of_positions).lower(*args).compile()
    _assert_local(compiled.as_text())
    _check(compiled(*args), want(mask_fn=_mask_of_positions))
    for kw, match in ((dict(mask_fn=_mask_reads_b), "batch axis B is sharded over mesh axis "
                       "'data', but mask_fn/score_fn reads the batch index b"),
                      (dict(score_fn=_score_reads_h), "heads are sharded over mesh axis 'model', "
                       "but mask_fn/score_fn reads the head index h")):
      if kind == AxisType.Explicit:
        with pytest.raises(ValueError, match=match):
          grad_fn(**kw)(*args)
        continue
      with pytest.warns(UserWarning, match=match):
        compiled = grad_fn(**kw).lower(*args).compile()
      _check(compiled(*args), want(**kw))


def test_index_reads():
  from fa2_jax.kernels.block_ranges import index_reads
  from fa2_jax.kernels.masking import Variant
  reads = lambda **kw: index_reads(Variant(**kw))  # noqa: E731
  assert reads(mask_fn=_mask_reads_b) == {"b"} and reads(score_fn=_score_reads_h) == {"h"}
  assert reads(mask_fn=_mask_of_positions) == set() and index_reads(None) == set()
  assert reads(mask_fn=_mask_reads_b, score_fn=_score_reads_h) == {"b", "h"}
  # A score_fn that keeps its result to the score's shape (as validation requires) still reads h.
  assert reads(score_fn=lambda s, b, h, i, j: jnp.where(h == 0, s, 0.5 * s).reshape(s.shape)) == {"h"}

@needs4
@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("mask_fn", [None, _mask_reads_b], ids=["plain", "mask_fn_reads_b"])
def test_vmap_over_a_sharded_axis(kind, mask_fn):
  """vmap over an axis sharded like B folds it into B (sharding.partitioned's vmap rule): the call
  runs per device with no collective (before: under Auto axes XLA gathered q, k and v around the
  kernels; under Explicit ones the Pallas interpreter failed inside JAX). A mask_fn that reads the
  batch index keeps the plain vmap, since folding would change the index it sees: correct values,
  gathered, under Auto axes; a ValueError naming the way out under Explicit ones."""
  mesh = _mesh((4,), ("data",), kind)
  qs, ks, vs = zip(*(_qkv(seed=20 + e) for e in range(4)))  # [E=4, B, ...]
  q, k, v = (jnp.stack(x) for x in (qs, ks, vs))
  kw = dict(is_causal=True, key_value_seq_lengths=jnp.full((B,), S - 3, jnp.int32), mask_fn=mask_fn)
  loss = lambda q, k, v: jnp.sum(jnp.tanh(flash(q, k, v, **kw)))  # noqa: E731
  fn = jax.jit(jax.vmap(jax.value_and_grad(loss, argnums=(0, 1, 2))))
  ref = lambda q, k, v: jnp.sum(jnp.tanh(fa2_jax.reference_attention(q, k, v, **kw)))  # noqa: E731
  want = jax.vmap(jax.value_and_grad(ref, argnums=(0, 1, 2)))(q, k, v)
  with jax.set_mesh(mesh) if kind == AxisType.Explicit else contextlib.nullcontext():
    args = [jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (q, k, v)]
    if kind == AxisType.Explicit and mask_fn is not None:
      with pytest.raises(ValueError, match="would change the batch index"):
        fn(*args)
      return
    compiled = fn.lower(*args).compile()
    got = compiled(*args)
  gathered = any(op == "all-gather" for op, _ in _collectives(compiled.as_text()))
  assert gathered == (mask_fn is not None)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, atol=5e-5, rtol=1e-5)
