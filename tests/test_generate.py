"""The KV caches (fa2_jax.KVCache, PagedKVCache, prefill) and cached generation in the GPT example.

The caches against flash_attention on whole sequences (per-row lengths, GQA, a variant, paged
layouts), forward-only, one test per bad argument; the example's cached sampler token for token
against the uncached one (train.generate), a batch of prompts of different lengths against each
prompt alone, and the generate command on a checkpoint that a 2-step training run writes.
Tiny shapes on CPU (the XLA formula); compiling is most of the time, so the generation tests share
one model and few sampler settings.
"""
import dataclasses
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fa2_jax  # noqa: E402
import fa2_jax.flax as fa2_flax  # noqa: E402
from fa2_jax import KVCache, PagedKVCache, prefill  # noqa: E402
from examples.flax_gpt import data as data_lib  # noqa: E402
from examples.flax_gpt import generate as gen_lib  # noqa: E402
from examples.flax_gpt import train as train_lib  # noqa: E402
from examples.flax_gpt.config import GPTConfig, TrainConfig  # noqa: E402
from examples.flax_gpt.model import GPT, init_cache  # noqa: E402

B, S, N, K, H = 2, 11, 4, 2, 8  # GQA: 4 query heads on 2 key/value heads


def qkv(seed=0, b=B, s=S, dtype=jnp.float32):
  keys = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(keys[0], (b, s, N, H), dtype),
          jax.random.normal(keys[1], (b, s, K, H), dtype),
          jax.random.normal(keys[2], (b, s, K, H), dtype))


def rows_alone(q, k, v, prompt, **kw):
  """flash_attention on each batch row's own sequence: rows [0, prompt[b]) then the rest."""
  return [fa2_jax.flash_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], is_causal=True, **kw)[0]
          for b in range(q.shape[0])]


# --- the caches -----------------------------------------------------------------------------------

@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_prefill_then_append_and_attend_equals_flash_attention(paged):
  """Prompts of lengths 3 and 6 (left-aligned in one [B, 6] prefill), then 5 decode steps of one row
  and one step of several rows: each row's outputs equal flash_attention on that row's sequence."""
  q, k, v = qkv()
  window = (3, 0)  # a variant passes through to flash_attention
  prompt = np.array([3, 6])
  full = rows_alone(q, k, v, prompt, local_window_size=window)
  # The cache's rows: row b's token t sits at position t, whatever the other row's length.
  out, cache = prefill(q[:, :6], k[:, :6], v[:, :6], lengths=jnp.asarray(prompt), capacity=16,
                       local_window_size=window)
  np.testing.assert_array_equal(np.asarray(cache.lengths), prompt)
  for b in range(B):
    np.testing.assert_allclose(out[b, :prompt[b]], full[b][:prompt[b]], atol=1e-5)
    np.testing.assert_array_equal(out[b, prompt[b]:], 0)  # padding rows
  if paged:  # pages in a shuffled order, 4 rows each: the positions cross page boundaries
    table = jnp.asarray(np.random.default_rng(0).permutation(8).reshape(B, 4), jnp.int32)
    paged_cache = PagedKVCache.create(B, 8, 4, K, H, page_table=table)
    cache = paged_cache.append(k[:, :6], v[:, :6], lengths=jnp.asarray(prompt))
  take = lambda x, t: jnp.stack([x[b, prompt[b] + t] for b in range(B)])[:, None]
  append = jax.jit(lambda c, kn, vn: c.append(kn, vn), donate_argnums=0)  # in place under jit
  for t in range(3):  # one row per step, each batch row at its own position
    cache = append(cache, take(k, t), take(v, t))
    step = cache.attend(take(q, t), local_window_size=window)
    for b in range(B):
      np.testing.assert_allclose(step[b, 0], full[b][prompt[b] + t], atol=1e-5)
    if paged and t == 0:  # the gathered fallback (an attention_fn need not take block_table)
      gathered = cache.attend(take(q, t), local_window_size=window,
                              attention_fn=fa2_jax.flash_attention)
      np.testing.assert_allclose(gathered, step, atol=1e-6)
  # Two rows at once, the second batch row appending only one of them.
  new = lambda x: jnp.stack([x[b, prompt[b] + 3:prompt[b] + 5] for b in range(B)])
  counts = jnp.array([2, 1])
  cache = cache.append(new(k), new(v), lengths=counts)
  np.testing.assert_array_equal(np.asarray(cache.lengths), prompt + 3 + np.array([2, 1]))
  out = cache.attend(new(q), query_seq_lengths=counts, local_window_size=window)
  np.testing.assert_allclose(out[0], full[0][6:8], atol=1e-5)
  np.testing.assert_allclose(out[1, 0], full[1][9], atol=1e-5)
  np.testing.assert_array_equal(out[1, 1], 0)
  # without query_seq_lengths the queries' rows are the last append's lengths (cache.appended)
  np.testing.assert_array_equal(cache.attend(new(q), local_window_size=window), out)
  if paged:
    k_rows, v_rows = cache.gather()  # row b's positions in order
    np.testing.assert_array_equal(k_rows[0, :8], k[0, :8])
    np.testing.assert_array_equal(v_rows[1, :10], v[1, :10])


def test_cache_under_jit_and_scan_is_a_pytree():
  """A decode loop as a lax.scan carry gives flash_attention's rows; bfloat16 keeps its dtype."""
  q, k, v = qkv(1, dtype=jnp.bfloat16)

  @jax.jit
  def decode(cache, q, k, v):
    def step(cache, x):
      qt, kt, vt = (a[:, None] for a in x)
      cache = cache.append(kt, vt)
      return cache, cache.attend(qt)[:, 0]
    return jax.lax.scan(step, cache, (q.swapaxes(0, 1), k.swapaxes(0, 1), v.swapaxes(0, 1)))

  cache, out = decode(KVCache.create(B, S, K, H, jnp.bfloat16), q, k, v)
  assert cache.k.dtype == jnp.bfloat16 and out.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(cache.lengths), [S, S])
  want = fa2_jax.flash_attention(q, k, v, is_causal=True)
  np.testing.assert_allclose(np.asarray(out.swapaxes(0, 1), np.float32),
                             np.asarray(want, np.float32), atol=2e-2)


def test_attend_takes_the_rows_of_the_last_ragged_append():
  """After prefill or append with lengths, attend without query_seq_lengths places each batch row's
  queries at its own new positions (cache.appended); appends without lengths then keep the cache's
  structure (a scan carry from a ragged prefill) and attend's newest-rows rule."""
  q, k, v = qkv(2)
  prompt = np.array([2, 5])
  full = rows_alone(q, k, v, prompt)
  _, cache = prefill(q[:, :5], k[:, :5], v[:, :5], lengths=prompt, capacity=S)
  np.testing.assert_array_equal(np.asarray(cache.appended), prompt)
  np.testing.assert_allclose(cache.attend(q[:, :5])[0, :2], full[0][:2], atol=1e-5)
  np.testing.assert_array_equal(cache.attend(q[:, :5])[0, 2:], 0)  # row 0's padding queries

  take = lambda x, t: jnp.stack([x[b, prompt[b] + t] for b in range(B)])[:, None]

  @jax.jit
  def steps(cache, xs):
    def step(cache, x):
      qt, kt, vt = (a[:, None] for a in x)
      cache = cache.append(kt, vt)
      return cache, cache.attend(qt)[:, 0]
    return jax.lax.scan(step, cache, xs)

  xs = tuple(jnp.concatenate([take(x, t) for t in range(3)], axis=1).swapaxes(0, 1)
             for x in (q, k, v))
  cache, out = steps(cache, xs)
  np.testing.assert_array_equal(np.asarray(cache.appended), [-1, -1])
  for b in range(B):
    np.testing.assert_allclose(out[:, b], full[b][prompt[b]:prompt[b] + 3], atol=1e-5)
  # a ragged append under jit: batch row 1 takes one of two rows
  new = lambda x: jnp.stack([x[b, prompt[b] + 3:prompt[b] + 5] for b in range(B)])
  attend = jax.jit(lambda c, qn, kn, vn: c.append(kn, vn, lengths=jnp.array([2, 1])).attend(qn))
  out = attend(cache, new(q), new(k), new(v))
  np.testing.assert_allclose(out[0], full[0][5:7], atol=1e-5)
  np.testing.assert_allclose(out[1, 0], full[1][8], atol=1e-5)
  np.testing.assert_array_equal(out[1, 1], 0)
  # more query rows than a batch row holds: an error, as without appended
  with pytest.raises(ValueError, match="batch row 0 has 8 query rows but the cache holds only 6"):
    cache.append(new(k)[:, :1], new(v)[:, :1]).attend(q[:, :8])


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_cache_keeps_its_structure_through_ragged_and_plain_appends(paged):
  """create() and prefill() caches are loop carries through appends with and without lengths
  (continuous batching: rows that take no new token)."""
  k = jnp.ones((B, 1, K, H))
  cache = (PagedKVCache.create(B, 4, 4, K, H, page_table=jnp.arange(4).reshape(B, 2)) if paged
           else KVCache.create(B, 8, K, H))
  _, prefilled = prefill(*qkv(b=B, s=3), capacity=8)

  def step(c, active):
    c = c.append(k, k, lengths=active)
    return c.append(k, k), None

  for start in (cache,) + (() if paged else (prefilled,)):
    end, _ = jax.lax.scan(step, start, jnp.array([[1, 0], [1, 1]], jnp.int32))
    np.testing.assert_array_equal(np.asarray(end.lengths - start.lengths), [4, 3])
    assert jax.tree.structure(end) == jax.tree.structure(start)


def test_cache_is_forward_only():
  q, k, v = qkv(2)
  _, cache = prefill(q[:, :4], k[:, :4], v[:, :4], capacity=8)
  cache = cache.append(k[:, 4:5], v[:, 4:5])
  paged = PagedKVCache.create(B, 4, 4, K, H).append(k[:, :5], v[:, :5])
  for f in (lambda q: cache.attend(q).sum(), lambda q: paged.attend(q).sum()):
    with pytest.raises(TypeError, match="forward-only.*fa2_jax.flash_attention"):
      jax.grad(f)(q[:, 4:5])
    with pytest.raises(TypeError, match="forward-only"):
      jax.jvp(f, (q[:, 4:5],), (q[:, 4:5],))
  with pytest.raises(TypeError, match="forward-only"):
    jax.grad(lambda k: prefill(q, k, v)[0].sum())(k)
  with pytest.raises(TypeError, match="forward-only"):  # differentiating into the cache's keys
    jax.grad(lambda k: cache.append(k, k).attend(q[:, :1]).sum())(k[:, :1])
  # A forward pass never trips it, under jit too.
  assert jax.jit(lambda q: cache.attend(q))(q[:, 4:5]).shape == (B, 1, N, H)


def test_caches_from_the_host_lists_and_x64():
  """A cache brought to the host (``jax.device_get``: numpy arrays), one built by hand with a list
  of lengths, and a paged cache under ``jax_enable_x64`` with strict dtype promotion (the suite's)
  append and attend as the device cache does; a paged table may hold negative "no page yet"
  entries where no row writes, and lists."""
  q, k, v = qkv(3)
  _, cache = prefill(q[:, :4], k[:, :4], v[:, :4], capacity=8)
  want = cache.append(k[:, 4:5], v[:, 4:5]).attend(q[:, 4:5])
  host = jax.device_get(cache)
  assert isinstance(host.lengths, np.ndarray)
  np.testing.assert_array_equal(host.append(k[:, 4:5], v[:, 4:5]).attend(q[:, 4:5]), want)
  np.testing.assert_array_equal(host.attend(q[:, 3:4]), cache.attend(q[:, 3:4]))
  by_hand = KVCache(cache.k, cache.v, [4, 4])
  np.testing.assert_array_equal(by_hand.attend(q[:, 3:4]), cache.attend(q[:, 3:4]))
  with pytest.raises(TypeError, match="the cache's lengths must be an integer array"):
    KVCache(cache.k, cache.v, "4").attend(q[:, 3:4])
  # appended: -1 or a row count per batch row
  with pytest.raises(TypeError, match=r"appended must be None or an integer array \[batch=2\], got "
                                      r"float32 \[2\]"):
    KVCache(cache.k, cache.v, [4, 4], jnp.ones((2,))).attend(q[:, 3:4])
  with pytest.raises(ValueError, match="appended must be -1 .* batch row 1 holds -2"):
    KVCache(cache.k, cache.v, [4, 4], [1, -2]).attend(q[:, 3:4])
  table = [[0, 1, -1], [2, 3, -1]]  # the third page of each row not given yet
  paged = PagedKVCache.create(B, 4, 2, K, H, page_table=table).append(k[:, :4], v[:, :4])
  np.testing.assert_allclose(paged.attend(q[:, 3:4]), cache.attend(q[:, 3:4]), atol=1e-6)
  with pytest.raises(ValueError, match="page_table gives batch row 0 page -1"):
    paged.append(k[:, 4:5], v[:, 4:5])
  # under jit (the lengths traced, the table a closed-over constant) the "no page yet" entries,
  # past every row's keys, are no error either; a hand-built cache's list lengths may be traced
  three = PagedKVCache.create(B, 4, 2, K, H, page_table=table).append(k[:, :3], v[:, :3])
  step = jax.jit(lambda k1, v1, q: three.append(k1, v1).attend(q))
  np.testing.assert_allclose(step(k[:, 3:4], v[:, 3:4], q[:, 3:4]), cache.attend(q[:, 3:4]),
                             atol=1e-6)
  traced = jax.jit(lambda n, q: KVCache(cache.k, cache.v, [n, n]).attend(q))
  np.testing.assert_array_equal(traced(jnp.int32(4), q[:, 3:4]), cache.attend(q[:, 3:4]))
  # a host cache closed over by a jitted step keeps its lengths' checks
  with pytest.raises(ValueError, match="q's rows are the newest rows of the cache"):
    jax.jit(lambda q: host.attend(q))(q[:, :5])
  with jax.enable_x64(True):
    np.testing.assert_allclose(
        KVCache.create(B, 8, K, H).append(k[:, :4], v[:, :4]).attend(q[:, 3:4]),
        cache.attend(q[:, 3:4]), atol=1e-6)
    paged = PagedKVCache.create(B, 4, 2, K, H).append(k[:, :4], v[:, :4])
    assert paged.lengths.dtype == jnp.int32
    np.testing.assert_allclose(paged.attend(q[:, 3:4]), cache.attend(q[:, 3:4]), atol=1e-6)


def _cache():
  return KVCache.create(B, 8, K, H)


ERRORS = {
    # create
    "capacity 0": (lambda: KVCache.create(B, 0, K, H), ValueError, "capacity must be a positive int"),
    "batch float": (lambda: KVCache.create(2.0, 8, K, H), TypeError, "batch must be a positive int"),
    "dtype int": (lambda: KVCache.create(B, 8, K, H, jnp.int32), TypeError, "dtype must be bfloat16"),
    # append
    "k_new shape": (lambda: _cache().append(jnp.zeros((B, 1, K + 1, H)), jnp.zeros((B, 1, K + 1, H))),
                    ValueError, r"k_new must have shape \[batch=2, T_new, kv_heads=2"),
    "v_new shape": (lambda: _cache().append(jnp.zeros((B, 1, K, H)), jnp.zeros((B, 2, K, H))),
                    ValueError, r"k_new and v_new must have the same \[batch, T_new, kv_heads\]"),
    "k_new dtype": (lambda: _cache().append(jnp.zeros((B, 1, K, H), jnp.bfloat16),
                                            jnp.zeros((B, 1, K, H), jnp.bfloat16)),
                    TypeError, "k_new must have the cache's dtype float32"),
    "k_new rank": (lambda: _cache().append(jnp.zeros((1, K, H)), jnp.zeros((1, K, H))),
                   ValueError, "k_new must have shape"),
    "T_new > capacity": (lambda: _cache().append(jnp.zeros((B, 9, K, H)), jnp.zeros((B, 9, K, H))),
                         ValueError, "T_new = 9 rows, more than the cache's capacity 8"),
    "overflow": (lambda: _cache().append(jnp.zeros((B, 5, K, H)), jnp.zeros((B, 5, K, H)))
                 .append(jnp.zeros((B, 4, K, H)), jnp.zeros((B, 4, K, H))),
                 ValueError, "batch row 0 holds 5 rows and gets 4 more, past the capacity 8"),
    "lengths > T_new": (lambda: _cache().append(jnp.zeros((B, 2, K, H)), jnp.zeros((B, 2, K, H)),
                                                lengths=jnp.array([1, 3])),
                        ValueError, r"lengths must lie in \[0, 2\]"),
    "lengths < 0": (lambda: _cache().append(jnp.zeros((B, 2, K, H)), jnp.zeros((B, 2, K, H)),
                                            lengths=jnp.array([-1, 1])),
                    ValueError, r"lengths must lie in \[0, 2\]"),
    "lengths shape": (lambda: _cache().append(jnp.zeros((B, 2, K, H)), jnp.zeros((B, 2, K, H)),
                                              lengths=jnp.array([1, 1, 1])),
                      ValueError, r"lengths must have shape \[2\]"),
    "lengths float": (lambda: _cache().append(jnp.zeros((B, 2, K, H)), jnp.zeros((B, 2, K, H)),
                                              lengths=jnp.array([1.0, 1.0])),
                      TypeError, "lengths must be an integer array"),
    # attend
    "q heads": (lambda: _cache().append(jnp.zeros((B, 1, K, H)), jnp.zeros((B, 1, K, H)))
                .attend(jnp.zeros((B, 1, 3, H))), ValueError, "num_heads a multiple of the cache's"),
    "q dtype": (lambda: _cache().append(jnp.zeros((B, 1, K, H)), jnp.zeros((B, 1, K, H)))
                .attend(jnp.zeros((B, 1, N, H), jnp.float16)), TypeError, "q must have the cache's dtype"),
    "q before append": (lambda: _cache().attend(jnp.zeros((B, 1, N, H))), ValueError,
                        "append them first.*holds only 0"),
    "q_offset given": (lambda: _cache().attend(jnp.zeros((B, 1, N, H)), q_offset=0), TypeError,
                       "q_offset is set by the cache"),
    "is_causal given": (lambda: prefill(*qkv(), is_causal=False), TypeError,
                        "is_causal is set by the cache"),
    # prefill
    "prefill capacity": (lambda: prefill(*qkv(), capacity=4), ValueError,
                         r"capacity \(4\) must be >= the prompts' length T = 11"),
    "prefill lengths": (lambda: prefill(*qkv(), lengths=jnp.array([12, 1])), ValueError,
                        r"lengths must lie in \[0, 11\]"),
    "prefill k shape": (lambda: prefill(qkv()[0], qkv()[1][:, :5], qkv()[2][:, :5]), ValueError,
                        "k and v must have shape"),
    "prefill dtype": (lambda: prefill(qkv()[0], *(x.astype(jnp.bfloat16) for x in qkv()[1:])),
                      TypeError, "q, k and v must have one dtype"),
    "prefill float64 lengths": (lambda: prefill(*qkv(), lengths=np.array([1.0, 2.0])), TypeError,
                                "lengths must be an integer array"),
    # paged
    "page table pages": (lambda: PagedKVCache.create(B, 4, 2, K, H, page_table=np.array([[0, 4],
                                                                                         [1, 2]])),
                         ValueError, r"page_table's pages must lie in \[0, 4\)"),
    "page table shape": (lambda: PagedKVCache.create(B, 4, 2, K, H, page_table=np.zeros((3, 2), int)),
                         ValueError, r"page_table must have shape \[batch=2"),
    "paged overflow": (lambda: PagedKVCache.create(B, 4, 2, K, H).append(jnp.zeros((B, 5, K, H)),
                                                                         jnp.zeros((B, 5, K, H))),
                       ValueError, "T_new = 5 rows, more than the cache's capacity 4"),
    "paged negative page at append": (  # row 1's third row falls on its page -1
        lambda: dataclasses.replace(PagedKVCache.create(B, 4, 2, K, H),
                                    page_table=jnp.array([[0, 1], [2, -1]])).append(
            jnp.zeros((B, 3, K, H)), jnp.zeros((B, 3, K, H))),
        ValueError, r"page_table gives batch row 1 page -1 for rows it appends: pages must lie in "
                    r"\[0, 4\)"),
    "paged two rows write a page": (
        lambda: dataclasses.replace(PagedKVCache.create(B, 4, 2, K, H),
                                    page_table=jnp.array([[0, 1], [0, 2]])).append(
            jnp.zeros((B, 1, K, H)), jnp.zeros((B, 1, K, H))),
        ValueError, "page_table makes batch rows 0 and 1 both append to page 0"),
    "block_table given": (lambda: _cache().append(jnp.zeros((B, 1, K, H)), jnp.zeros((B, 1, K, H)))
                          .attend(jnp.zeros((B, 1, N, H)), block_table=jnp.zeros((B, 1), jnp.int32)),
                          TypeError, "block_table is set by the cache"),
    "prefill query_seq_lengths": (lambda: prefill(*qkv(), query_seq_lengths=jnp.array([2, 4])),
                                  TypeError, "query_seq_lengths is set by prefill's lengths"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_arguments_raise_naming_them(case):
  fn, error, match = ERRORS[case]
  with pytest.raises(error, match=match):
    fn()


def test_shared_prefix_pages_and_traced_bad_pages():
  """Rows may share the pages they only read (a common prefix) and append to their own; under jit a
  negative page ("no page yet") drops the row's write instead of wrapping to another row's page."""
  k0 = jax.random.normal(jax.random.key(1), (B, 3, K, H))
  cache = PagedKVCache.create(B, 6, 2, K, H, page_table=np.array([[0, 1, 2], [3, 4, 5]]))
  cache = cache.append(k0, k0)
  shared = dataclasses.replace(cache, page_table=jnp.array([[0, 1, 2], [0, 4, 5]]),
                               lengths=jnp.array([2, 2]))  # row 1 reads row 0's first page
  shared = shared.append(k0[:, :1], k0[:, :1])  # each writes its own second page
  np.testing.assert_array_equal(shared.k_pages[1, 0], k0[0, 0])
  np.testing.assert_array_equal(shared.k_pages[4, 0], k0[1, 0])
  bad = dataclasses.replace(cache, page_table=jnp.array([[0, 1, 2], [3, -3, 5]]))
  after = jax.jit(lambda c, x: c.append(x, x))(bad, jnp.full((B, 1, K, H), 7.0))
  # row 1's position 3 falls on its page -3: dropped; page 3 (index -3 of 6) is row 1's own
  # first page and page 1 row 0's second: neither changed
  np.testing.assert_array_equal(after.k_pages[3], bad.k_pages[3])
  np.testing.assert_array_equal(after.k_pages[1, 1], 7.0)  # row 0's position 3: its page 1, slot 1
  # an unused "no page yet" entry is fine where no row writes it (eager too)
  unused = dataclasses.replace(cache, page_table=jnp.array([[0, 1, 2], [3, 4, -1]]))
  unused.append(k0[:, :1], k0[:, :1])
  # a row's padding past its lengths is never written, even where its table names another's page
  pad = PagedKVCache.create(B, 4, 2, K, H, page_table=np.array([[0, 1], [2, 3]]))
  pad = pad.append(k0[:, :2], k0[:, :2], lengths=jnp.array([1, 2]))
  pad = dataclasses.replace(pad, page_table=jnp.array([[0, 1], [2, 0]]))
  after = pad.append(jnp.full((B, 2, K, H), 9.0), jnp.full((B, 2, K, H), 9.0),
                     lengths=jnp.array([2, 0]))
  np.testing.assert_array_equal(after.k_pages[0, 0], k0[0, 0])  # row 0's first row kept
  np.testing.assert_array_equal(after.k_pages[0, 1], 9.0)  # its append, not row 1's padding
  assert after.lengths.tolist() == [3, 2]


def test_traced_overflow_drops_rows_instead_of_overwriting():
  """Under jit the lengths are not known: rows past the capacity are dropped, never written over
  earlier rows (a clamped dynamic_update_slice would)."""
  cache = KVCache.create(1, 4, 1, 2).append(jnp.ones((1, 3, 1, 2)), jnp.ones((1, 3, 1, 2)))
  cache = jax.jit(lambda c, x: c.append(x, x))(cache, jnp.full((1, 2, 1, 2), 7.0))
  np.testing.assert_array_equal(cache.k[0, :, 0, 0], [1, 1, 1, 7])
  assert int(cache.lengths[0]) == 5
  with pytest.raises(ValueError, match=r"the cache's lengths must lie in \[0, 4\].*holds 5"):
    cache.attend(jnp.ones((1, 1, 1, 2)))
  with pytest.raises(TypeError, match="the cache's lengths must be an integer array"):
    KVCache(cache.k, cache.v, jnp.array([1.0])).attend(jnp.ones((1, 1, 1, 2)))


def test_flax_layer_cache_argument():
  """CausalSelfAttention(cache=...) (linen and nnx) step by step equals the layer on the whole
  sequence (the same parameters), and refuses the arguments the cache sets."""
  layer = fa2_flax.CausalSelfAttention(num_heads=4, num_kv_heads=2, head_dim=8, rotary=True)
  x = jax.random.normal(jax.random.key(3), (B, 6, 16))
  params = layer.init(jax.random.key(0), x)
  want = layer.apply(params, x)
  y, cache = layer.apply(params, x[:, :4], cache=KVCache.create(B, 8, 2, 8))
  y2, cache = layer.apply(params, x[:, 4:], cache=cache)
  np.testing.assert_allclose(jnp.concatenate([y, y2], 1), want, atol=1e-5)
  with pytest.raises(TypeError, match="q_offset cannot be passed with cache"):
    layer.apply(params, x[:, :1], cache=cache, q_offset=3)
  with pytest.raises(TypeError, match="cache must be a fa2_jax.KVCache"):
    layer.apply(params, x[:, :1], cache=(cache,))
  with pytest.raises(ValueError, match=r"cache does not fit .* kv_heads 4 \(this call: 2\)"):
    layer.apply(params, x[:, :1], cache=KVCache.create(B, 8, 4, 8))
  with pytest.raises(ValueError, match=r"cache does not fit .* batch 1 \(this call: 2\)"):
    layer.apply(params, x[:, :1], cache=KVCache.create(1, 8, 2, 8))
  with pytest.raises(TypeError, match="cache holds bfloat16 keys and values, this layer"):
    layer.apply(params, x[:, :1], cache=KVCache.create(B, 8, 2, 8, jnp.bfloat16))
  nnx_layer = fa2_flax.NnxCausalSelfAttention(16, 4, 8, num_kv_heads=2, rotary=True,
                                              rngs=nnx.Rngs(0))
  want = nnx_layer(x)
  y, cache = nnx_layer(x[:, :5], cache=KVCache.create(B, 6, 2, 8))
  y2, _ = nnx_layer(x[:, 5:], cache=cache)
  np.testing.assert_allclose(jnp.concatenate([y, y2], 1), want, atol=1e-5)
  with pytest.raises(TypeError, match="mask cannot be passed with cache"):
    nnx_layer(x[:, :1], mask=jnp.ones((1, 1), bool), cache=cache)


# --- the GPT example ------------------------------------------------------------------------------

MODEL = GPTConfig(seq_len=24, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, position="rotary",
                  dtype="float32", attention="flash")


@pytest.fixture(autouse=True)
def lossless_text(monkeypatch):
  """Text with one character per byte (latin-1) in both samplers, so that comparing texts compares
  every token (a random model's bytes are seldom UTF-8, which data.decode replaces)."""
  monkeypatch.setattr(data_lib, "decode", lambda ids: bytes(int(i) for i in ids).decode("latin-1"))


@pytest.fixture(scope="module")
def model_params():
  """A random model whose greedy continuations vary (GPT-2's initialisation makes nearly uniform
  logits, whose argmax repeats one byte): every parameter drawn from a standard normal."""
  model = GPT(MODEL)
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, MODEL.seq_len), jnp.int32))["params"]
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
  return model, jax.tree.unflatten(tree, [jax.random.normal(k, x.shape)
                                          for k, x in zip(keys, leaves)])


def test_cached_model_equals_the_model_on_whole_sequences():
  """GPT(cache=...) logits, a prefill then one token at a time, equal the training model's, here
  with learned positions and scanned layers (the sampler's tests below use rotary, unscanned)."""
  config = dataclasses.replace(MODEL, position="learned", scan_layers=True)
  model = GPT(config)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (B, 9)), jnp.int32)
  params = model.init(jax.random.PRNGKey(0), tokens)["params"]
  want = model.apply({"params": params}, tokens)
  logits, cache = model.apply({"params": params}, tokens[:, :7], cache=init_cache(config, B))
  steps = [logits]
  for t in range(7, 9):
    logits, cache = model.apply({"params": params}, tokens[:, t:t + 1], cache=cache)
    steps.append(logits)
  np.testing.assert_allclose(jnp.concatenate(steps, 1), want, atol=1e-5)


def test_cached_greedy_equals_uncached_greedy(model_params):
  """Token for token train.generate's output: greedy within the context, greedy past it with
  keep=seq_len (the sliding window), and sampled at temperature 1 (the same key sequence)."""
  model, params = model_params
  prompt = "def fib"
  uncached = train_lib.generate(model, params, prompt, 40, temperature=0.0)
  assert len(set(uncached[len(prompt):])) > 3, uncached  # a continuation worth comparing
  assert gen_lib.generate(model, params, prompt, 40, temperature=0.0, keep=MODEL.seq_len) == uncached
  # With the default keep (seq_len // 2) the tokens within the context are the same (byte ids: a
  # random model's bytes need not be UTF-8).
  within = MODEL.seq_len - len(prompt) + 1
  ids = [list(data_lib.encode(prompt))]
  slide = gen_lib.generate_ids(model, params, ids, 40, temperature=0.0, keep=MODEL.seq_len).tokens
  cached = gen_lib.generate_ids(model, params, ids, 40, temperature=0.0).tokens
  np.testing.assert_array_equal(cached[:, :within], slide[:, :within])
  sampled = train_lib.generate(model, params, prompt, 10, temperature=1.0, seed=3)
  assert gen_lib.generate(model, params, prompt, 10, temperature=1.0, seed=3) == sampled


def test_batch_of_prompts_equals_each_prompt_alone(model_params):
  """Prompts of 1, 7 and 30 bytes (longer than the context) in one batch, 40 tokens each (past the
  context: every row refills its cache at its own step): each row's text is that prompt's alone."""
  model, params = model_params
  prompts = ["x", "def fib", "import numpy as np\nimport jax\n\n"]
  together = gen_lib.generate(model, params, prompts, 40, temperature=0.0)
  alone = [gen_lib.generate(model, params, p, 40, temperature=0.0) for p in prompts]
  assert together == alone
  top1 = gen_lib.generate(model, params, prompts, 40, temperature=0.7, top_k=1)
  assert top1 == together  # top-k 1 is greedy
  out = gen_lib.generate_ids(model, params, [[1, 2], [3]], 5, temperature=0.0)
  assert out.tokens.shape == (2, 5) and out.ms_per_token > 0 and out.tokens_per_s > 0
  for kw, match in (({"temperature": -1.0}, "temperature must be >= 0"),
                    ({"top_k": 0}, "top_k must be an int >= 1"),
                    ({"keep": MODEL.seq_len + 1}, r"keep must be an int in \[1, seq_len=24\]")):
    with pytest.raises(ValueError, match=match):
      gen_lib.generate(model, params, "x", 3, **kw)
  with pytest.raises(ValueError, match="prompt 1 is empty"):
    gen_lib.generate_ids(model, params, [[1], []], 3)


# --- the command line -----------------------------------------------------------------------------

CLI_MODEL = ["--seq-len", "24", "--n-layer", "2", "--n-kv-head", "2", "--n-embd", "32",
             "--position", "rotary"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """A checkpoint of a 2-step training run of MODEL (train.py's own saving code) and its params."""
  data = tmp_path_factory.mktemp("data") / "text.txt"
  data.write_bytes(data_lib.stdlib_source_bytes(60_000))
  ckpt = tmp_path_factory.mktemp("ckpt")
  tc = TrainConfig(batch_size=2, steps=2, warmup_steps=0, eval_every=0, eval_batches=1,
                   data_bytes=60_000)
  state, _ = train_lib.train(MODEL, tc, data_path=str(data), ckpt_dir=str(ckpt), progress="off")
  return str(ckpt), state.params


def one_error_line(argv, capsys) -> str:
  with pytest.raises(SystemExit) as exit_info:
    gen_lib.main(argv)
  assert exit_info.value.code == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1, err
  assert err.startswith("generate: error: ")
  return err


def test_generate_command_samples_a_checkpoint(checkpoint, capsys):
  ckpt, params = checkpoint
  capsys.readouterr()
  summary = gen_lib.main(["--ckpt-dir", ckpt, "--prompt", "def fib", "--prompt", "x", "--tokens",
                          "12", "--temperature", "0", *CLI_MODEL])
  out = capsys.readouterr().out
  assert f"checkpoint of step 2 in {ckpt}" in out
  # the XLA formula on a CPU; elsewhere what backend_for names for the model's decode step
  args = gen_lib.build_parser().parse_args(["--ckpt-dir", ckpt, *CLI_MODEL])
  expected = gen_lib.describe_decode_attention(gen_lib.model_config(args), 2)
  assert expected in out
  assert jax.default_backend() != "cpu" or expected.startswith(
      "decode attention: fa2_jax xla (the XLA formula)")
  assert "--- sample 1 of 2 (temperature 0.0) ---" in out
  assert "ms/token" in out and "tokens/s" in out and "prefill:" in out
  want = train_lib.generate(GPT(MODEL), params, "def fib", 12, temperature=0.0)
  assert summary["samples"][0] == want and f"\n{want}\n---" in out
  assert summary["ms_per_token"] > 0 and summary["tokens_per_s"] > 0


def test_generate_command_errors_are_one_line(checkpoint, tmp_path, capsys):
  ckpt, _ = checkpoint
  missing = tmp_path / "missing"
  assert one_error_line(["--ckpt-dir", str(missing)], capsys).endswith(
      f"--ckpt-dir {missing}: no such folder")
  afile = tmp_path / "file"
  afile.write_text("x")
  assert "is a file, not a folder of checkpoints" in one_error_line(["--ckpt-dir", str(afile)],
                                                                     capsys)
  empty = tmp_path / "empty"
  empty.mkdir()
  assert f"--ckpt-dir {empty} holds no checkpoint: train with" in one_error_line(
      ["--ckpt-dir", str(empty)], capsys)
  assert one_error_line(["--ckpt-dir", ckpt, "--prompt", ""], capsys).endswith(
      "--prompt is empty: give the text to continue")
  assert "holds another model than these flags build" in one_error_line(
      ["--ckpt-dir", ckpt, *CLI_MODEL, "--n-layer", "1"], capsys)
  assert "--tokens must be >= 1" in one_error_line(["--ckpt-dir", ckpt, "--tokens", "0"], capsys)
  assert "--temperature must be >= 0" in one_error_line(
      ["--ckpt-dir", ckpt, "--temperature", "-1"], capsys)
  assert "--n-head" in one_error_line(["--ckpt-dir", ckpt, "--n-head", "3"], capsys)
  assert "invalid int value: 'many'" in one_error_line(["--ckpt-dir", ckpt, "--tokens", "many"],
                                                      capsys)
  assert "required: --ckpt-dir" in one_error_line([], capsys)
  if jax.default_backend() == "cpu":  # attentions that cannot run here: one line, before the model
    assert "--attention cudnn needs an NVIDIA GPU" in one_error_line(
        ["--ckpt-dir", ckpt, *CLI_MODEL, "--attention", "cudnn"], capsys)
    assert "--attention flash_mosaic cannot run this call" in one_error_line(
        ["--ckpt-dir", ckpt, *CLI_MODEL, "--attention", "flash_mosaic"], capsys)
    assert "--attention cudnn needs an NVIDIA GPU" in one_error_line(  # before the checkpoint
        ["--ckpt-dir", str(missing), *CLI_MODEL, "--attention", "cudnn"], capsys)
    assert "no Pallas interpret mode" in one_error_line(
        ["--ckpt-dir", ckpt, *CLI_MODEL, "--attention", "flash_mosaic", "--interpret", "true"],
        capsys)
  assert "--interpret true runs the fa2_jax kernels, which --attention xla" in one_error_line(
      ["--ckpt-dir", ckpt, *CLI_MODEL, "--attention", "xla", "--interpret", "true"], capsys)
