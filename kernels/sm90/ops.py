"""Small Mosaic GPU building blocks shared by the forward and backward kernels.

``mma`` wraps the two wgmma idioms of Pallas Mosaic GPU (after JAX's ``attention_mgpu.py``):

* a fresh product, ``pl.run_scoped(f, plgpu.ACC(shape))`` — a zero-initialised f32 register
  accumulator; reading ``acc_ref[...]`` waits for the wgmma;
* accumulate into a carried value, ``pl.run_state(f)(plgpu.ACC.init(acc))`` — waits on exit.

Several products passed to one ``mma_many`` call are issued back to back and awaited once.

The asynchronous idiom (the dK/dV kernel, FlashAttention-3's schedule): :func:`accumulators` allocates
accumulators (around a whole loop, written with :func:`acc_loop`, or per step), :func:`wgmma` issues a
product without waiting, :func:`wgmma_load` reads an accumulator once at most ``wait_n`` products are
still in flight, :func:`wgmma_wait` waits without reading.

Emulation (CPU testing only): inside ``with emulated_mma():`` the same calls compute the products with
``jnp.dot`` on the loaded SMEM tiles instead of wgmma. Pallas' GPU interpret mode
(``plgpu.force_gpu_interpret_mode``) cannot run wgmma with a register operand or ``run_state``, but it
can run everything else of these kernels — TMA copies (with out-of-bounds zero fill), barriers and
their phases, the warp-specialised producer/consumer protocol, index math, masks and the online
softmax — so emulation + interpret mode checks the kernels' logic on a CPU. The wgmma path itself is
checked only by lowering (``jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))``) and on a GPU.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.state import types as state_types
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..batching import fold_mapped, unfold_mapped
from ..block_ranges import index_reads

# _COMPILE_NOTE: every kernel launch is wrapped in a jax.jit with its settings static, so a program that
# calls attention at many sites (one per layer) lowers each distinct kernel once and the Mosaic GPU
# custom calls of equal kernels carry one module and one kernel hash (docs/design.md, One jit per
# kernel launch, measures the lowering time it saves).
# The jit's static ``emulate`` flag keeps interpret-mode (emulated wgmma) traces apart.
# wgmma's shared-memory swizzles, in bytes per swizzled row (Mosaic GPU has no unswizzled wgmma). A
# tile uses the widest one that divides its rows' bytes: 128 (64 elements of a 16-bit dtype) for
# head_dims that are multiples of 64, 64 for 96/160 (32 elements), 32 for 80/112 (16 elements).
SWIZZLES = (128, 64, 32)
_EMULATE = [False]


@contextlib.contextmanager
def emulated_mma(on: bool = True):
  """Trace the kernels with jnp.dot instead of wgmma (for GPU interpret mode on CPU).

  A forward+backward under one ``jax.jit`` in this mode has been seen to hang, without error, when
  JAX has a single CPU device; with several (``jax.config.update("jax_num_cpu_devices", 4)``
  before the first use of JAX, as ``tests/conftest.py`` does) the same program runs. A limit of
  Pallas' GPU interpreter on CPU, not of the kernels."""
  prev = _EMULATE[0]
  _EMULATE[0] = bool(on)
  try:
    yield
  finally:
    _EMULATE[0] = prev


def emulating() -> bool:
  return _EMULATE[0]


def swizzle_bytes(cols: int, itemsize: int = 2) -> int | None:
  """The widest wgmma swizzle (bytes) whose swizzled rows tile ``cols`` elements of ``itemsize``
  bytes exactly, or None when none does (a 16-bit row not a multiple of 16 elements)."""
  return next((s for s in SWIZZLES if (cols * itemsize) % s == 0), None)


def smem_transforms(head_dim: int):
  """SMEM layout for the 16-bit tiles of a kernel of this ``head_dim``: ``(8, swizzle / 2)`` tiles
  with the widest swizzle of :func:`swizzle_bytes`. One swizzle serves every 16-bit tile of a kernel
  ([rows, head_dim] and [rows, keys] alike, whose sides are multiples of 64): a wgmma's two SMEM
  operands must share one."""
  swizzle = swizzle_bytes(head_dim, 2)
  if swizzle is None:
    raise ValueError(f"head_dim {head_dim} is not a multiple of 16: no wgmma swizzle tiles it")
  return (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))


def smem_transforms_f32(cols: int):
  """SMEM layout for f32 [rows, cols] tiles (staging for TMA only, never a wgmma operand):
  ``(8, swizzle / 4)`` tiles with the widest swizzle that tiles ``cols``."""
  swizzle = swizzle_bytes(cols, 4)
  if swizzle is None:
    raise ValueError(f"{cols} f32 columns are not a multiple of 8: no swizzle tiles them")
  return (plgpu.TilingTransform((8, swizzle // 4)), plgpu.SwizzleTransform(swizzle))


def compiler_params():
  # approx_math: exp2/log/reciprocal may use the fast MUFU forms (as FA2 does with ex2.approx).
  # unsafe_no_auto_barriers: Pallas otherwise puts a warpgroup barrier before and after every SMEM
  # store of a register array and before every TMA load, for threads that read SMEM other threads
  # wrote. No thread of these kernels does: what they store (dS^T, the fused dQ piece, the epilogues'
  # outputs) is read by wgmma or TMA only, after commit_smem (fence + barrier) or a consumers'
  # barrier, and what they load (row inputs, delta) comes by TMA behind an mbarrier. A kernel that
  # reads SMEM written by other threads needs its own barrier (docs/design.md, "SMEM barriers").
  return plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True)


# H100 / H200 SXM: 132 streaming multiprocessors (the count a persistent kernel assumes when it is
# lowered with no GPU in the process, e.g. for sm90 on a CPU).
HOPPER_SMS = 132


def sm_count() -> int:
  """The first GPU's streaming multiprocessors (:data:`HOPPER_SMS` without a GPU)."""
  try:
    return int(jax.devices("gpu")[0].core_count)
  except (RuntimeError, AttributeError, TypeError, ValueError):
    return HOPPER_SMS


def ws_kernel(body, *, out_type, scratch, grid, grid_names, num_consumers: int, name: str):
  """A warp-specialised launch: ``num_consumers`` compute warpgroups plus one producer warpgroup
  (thread axis ``"wg"``: consumers are ``wg < num_consumers``, the producer ``wg == num_consumers``)."""
  return plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=grid,
                      grid_names=grid_names, num_threads=num_consumers + 1, thread_name="wg",
                      compiler_params=compiler_params(), kernel_name=name)


def batch_rule(call, axis_size: int, in_batched, operands, variant):
  """``vmap`` of a kernel launch ``call(*operands) -> tuple`` whose operands and results all have the
  batch axis first (a ``custom_vmap`` rule's body): the mapped axis folded into the batch, one launch
  over ``axis_size * B`` (unbatched operands broadcast), and unfolded. Where the variant's ``mask_fn``
  or ``score_fn`` reads the batch index, the kernels would hand it the folded index: then one launch
  per mapped element instead (``lax.map``). Returns ``(outs, out_batched)``."""
  if "b" in index_reads(variant):
    def one(mapped):
      it = iter(mapped)
      return tuple(call(*[next(it) if bt else x for x, bt in zip(operands, in_batched)]))
    outs = lax.map(one, [x for x, bt in zip(operands, in_batched) if bt])
  else:
    outs = unfold_mapped(axis_size, call(*fold_mapped(axis_size, in_batched, operands)))
  return outs, tuple(True for _ in outs)


def bcast_rows(x, shape):
  """[rows] (WGMMA row layout) -> [rows, cols]: the row statistic repeated along each row."""
  return lax.broadcast_in_dim(x, shape, [0])


def bcast_cols(x, shape):
  """[cols] -> [rows, cols]: a per-column vector (the transposed S^T tiles of the backward)."""
  return lax.broadcast_in_dim(x, shape, [1])


def iota2(shape, dim):
  return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def zeros(shape):
  return plgpu.layout_cast(jnp.full(shape, 0.0, jnp.float32), plgpu.Layout.WGMMA)


def _operand(x, transpose: bool):
  if transpose:
    return x.transpose((1, 0))
  return x


def _is_ref(x) -> bool:
  if isinstance(x, state_types.TransformedRef):
    return True
  return isinstance(getattr(x, "aval", None), state_types.AbstractRef)


def _load(x, transpose: bool):
  v = x[...] if _is_ref(x) else x  # a ref (SMEM tile) or a register value
  return v.T if transpose else v


class Product:
  """One wgmma: ``init + a @ (b^T if tb else b)``; ``init`` None means a fresh zero accumulator.

  ``a``: SMEM ref or register array (16-bit), ``b``: SMEM ref. ``ta``/``tb`` transpose the SMEM
  operand views (wgmma reads 16-bit operands transposed for free). ``more``: further ``(a, b, ta,
  tb)`` terms added into the same accumulator (a contraction split over several SMEM tiles, issued
  back to back like the k-steps of a matmul).
  """

  def __init__(self, shape, a, b, *, tb: bool = False, ta: bool = False, init=None, more=()):
    self.shape, self.init = tuple(shape), init
    self.terms = [(a, b, ta, tb), *more]


def mma_many(products: Sequence[Product], between: Callable[[], None] | None = None):
  """Issue the products back to back, run ``between`` (e.g. a scheduling barrier), wait, return."""
  if emulating():
    out = []
    for p in products:
      r = sum(jnp.dot(_load(a, ta), _load(b, tb), preferred_element_type=jnp.float32)
              for a, b, ta, tb in p.terms)
      out.append(r if p.init is None else p.init + r)
    if between is not None:
      between()
    return out

  def issue(refs):
    for ref, p in zip(refs, products):
      for a, b, ta, tb in p.terms:
        plgpu.wgmma(ref, _operand(a, ta), _operand(b, tb))
    if between is not None:
      between()

  if len(products) == 1 and products[0].init is None:
    # Fresh accumulator: zero-initialised by the allocation; reading it waits for the wgmma.
    def fresh(acc_ref):
      issue([acc_ref])
      return acc_ref[...]

    return [pl.run_scoped(fresh, plgpu.ACC(products[0].shape, jnp.float32))]
  inits = tuple(plgpu.ACC.init(zeros(p.shape) if p.init is None else p.init) for p in products)
  # run_state waits for all outstanding wgmmas before returning the final accumulators.
  return list(pl.run_state(issue)(inits))


def mma(shape, a, b, *, tb: bool = False, ta: bool = False, init=None, between=None):
  """One product (see :class:`Product`)."""
  return mma_many([Product(shape, a, b, tb=tb, ta=ta, init=init)], between=between)[0]


class _EmulatedAccumulator:
  """Emulation's stand-in for a wgmma accumulator ref: a traced f32 value, updated at issue."""

  def __init__(self, shape):
    self.value = jnp.zeros(shape, jnp.float32)


def accumulators(body, *shapes):
  """``body(*acc_refs)`` with fresh zero f32 wgmma accumulators of the given shapes, for the
  asynchronous idiom: :func:`wgmma` issues a product without waiting, :func:`wgmma_load` reads an
  accumulator once at most ``wait_n`` issued products are still in flight, :func:`wgmma_wait` waits
  without reading. Accumulators allocated around a loop stay in registers across its steps; such a
  loop is written with :func:`acc_loop`.

  Emulation: each accumulator is a traced value, products run at issue, loops carry the values.
  """
  if emulating():
    return body(*[_EmulatedAccumulator(tuple(s)) for s in shapes])
  return pl.run_scoped(body, *[plgpu.ACC(tuple(s), jnp.float32) for s in shapes])


def consumers_sync(barrier_ref):
  """The consumer warpgroups wait here for each other (all of them must call it): ``barrier_ref`` is
  an mbarrier expecting one arrival per consumer warpgroup; each arrives, then waits on its phase."""
  plgpu.barrier_arrive(barrier_ref)
  plgpu.barrier_wait(barrier_ref)


def per_cta_choice(p_form: str, flag, body):
  """Run ``body(exact)`` in the backward's form of P (``MosaicConfig.p_form``): ``"exact"`` or
  ``"fast"`` compile that form alone; ``"per_head"`` compiles both and each CTA runs
  ``body(True)`` where the traced scalar ``flag()`` holds, else ``body(False)`` (nothing crosses the
  branch; ``body`` stores its results itself). ``flag`` is read only then, at the branch.

  One two-way branch (``lax.cond``: an if/else), not two ``pl.when`` in a row: after the first of two
  sequential ifs the compiler must keep everything the second one reads live through the first one's
  loop, which spilled registers in the dK/dV kernel (docs/design.md, "Softmax form")."""
  if p_form != "per_head":
    body(p_form == "exact")
    return
  lax.cond(flag(), functools.partial(body, True), functools.partial(body, False))


def statically_empty(lower, upper) -> bool:
  """True when ``[lower, upper)`` is known empty at trace time (both bounds Python ints): such a loop
  is not traced at all, so its body is neither lowered nor compiled (e.g. the masked step of a
  non-causal call whose tiles have no ragged tail; ``lax.fori_loop`` would still trace it)."""
  return isinstance(lower, int) and isinstance(upper, int) and lower >= upper


def _fori(lower, upper, body, carry):
  """``lax.fori_loop(lower, upper, body, carry)`` with the loop's counter counting from 0: a traced
  ``lower`` read from an operand that varies over a ``shard_map`` axis would type the counter as
  varying, which the kernel's body (traced with the check off) returns as invariant, and the loop's
  carry types would differ (``check_vma=True``)."""
  if isinstance(lower, int):
    return lax.fori_loop(lower, upper, body, carry)
  return lax.fori_loop(0, upper - lower, lambda j, c: body(lower + j, c), carry)


def step_loop(lower, upper, body, carry):
  """``lax.fori_loop(lower, upper, body, carry)``, with no trace of ``body`` for a range that is
  :func:`statically_empty`."""
  if statically_empty(lower, upper):
    return carry
  return _fori(lower, upper, body, carry)


def acc_loop(lower, upper, body, accs):
  """``for i in [lower, upper): body(i)`` where ``body`` issues products into the accumulators
  ``accs`` allocated outside the loop (None entries are ignored); a :func:`statically_empty` range
  is not traced."""
  if statically_empty(lower, upper):
    return
  accs = [a for a in accs if a is not None]
  if not emulating():
    _fori(lower, upper, lambda i, c: (body(i), c)[1], jnp.int32(0))
    return

  def carried(i, values):
    for a, v in zip(accs, values):
      a.value = v
    body(i)
    return tuple(a.value for a in accs)

  values = _fori(lower, upper, carried, tuple(a.value for a in accs))
  for a, v in zip(accs, values):
    a.value = v


def wgmma(acc, a, b, *, ta: bool = False, tb: bool = False):
  """Issue ``acc += a @ b`` (one wgmma commit group) without waiting; operands as in :class:`Product`
  (a register A operand must stay unchanged until the product completes)."""
  if emulating():
    acc.value = acc.value + jnp.dot(_load(a, ta), _load(b, tb), preferred_element_type=jnp.float32)
  else:
    plgpu.wgmma(acc, _operand(a, ta), _operand(b, tb))


def wgmma_load(acc, wait_n: int = 0):
  """The accumulator's value once at most ``wait_n`` of the issued products are in flight (they
  complete in issue order)."""
  if emulating():
    return acc.value
  return plgpu.wgmma_accumulator_load(acc, wait_n=wait_n)


def wgmma_wait(n: int = 0):
  """Wait until at most ``n`` issued products are in flight."""
  if not emulating():
    plgpu.wgmma_wait(n)


def kv_producer(memory_registers: int, **stream_args):
  """The producer warpgroup of the dQ kernels: give registers back to the consumers
  (``setmaxnreg``), then :func:`stream_kv` (the forward calls it per query tile)."""
  plgpu.set_max_registers(memory_registers, action="decrease")
  stream_kv(**stream_args)


def stream_kv(k_ref, v_ref, k_smem, v_smem, k_bar, v_bar, k_free, v_free, *, b, kvh, n_end,
              block_k: int, stages: int, start=0, ring_step=0, drain: bool = True):
  """The producer warpgroup of the forward and dQ kernels: TMA ``K_j, V_j`` (``start <= j < n_end``,
  rows ``[j*block_k, (j+1)*block_k)`` of KV head ``kvh``) into a ``stages``-deep SMEM ring.

  Block ``j`` is the ring's step ``g = ring_step + j - start`` (``ring_step``: the steps of the CTA's
  earlier tiles in a persistent kernel, else 0) and goes to slot ``g % stages``, refilled once every
  consumer has arrived on its free barrier for step ``g - stages``; K and V have separate barriers so
  a consumer can start ``S = Q K^T`` before ``V`` lands. The drain (``drain``, or :func:`drain_kv`
  after a persistent kernel's last tile) observes the consumers' last releases, so every barrier
  phase is waited exactly once (the GPU does not need it; it keeps the protocol symmetric and
  interpret mode's checks happy).
  """

  @pl.loop(start, n_end)
  def _(j):
    g = ring_step + j - start
    slot = lax.rem(g, jnp.array(stages, g.dtype))
    rows = (b, pl.ds(j * block_k, block_k), kvh)

    @pl.when(g >= stages)
    def _():
      plgpu.barrier_wait(k_free.at[slot])  # every consumer is done with K in this slot

    plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_bar.at[slot])

    @pl.when(g >= stages)
    def _():
      plgpu.barrier_wait(v_free.at[slot])

    plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_bar.at[slot])

  if drain:
    drain_kv(k_free, v_free, ring_step + n_end - start, stages)


def drain_kv(k_free, v_free, n_steps, stages: int):
  """Wait for the consumers' releases of the ring's last ``stages`` steps (of ``n_steps`` in all)."""

  @pl.loop(jnp.maximum(n_steps - stages, 0), n_steps)
  def _(g):
    slot = lax.rem(g, jnp.array(stages, g.dtype))
    plgpu.barrier_wait(k_free.at[slot])
    plgpu.barrier_wait(v_free.at[slot])
