"""The seam between the public API and the kernel families: what a family must provide.

Each family (``triton/``, ``sm90/``, ...) is one :class:`Backend` object in its ``backend.py``, and
:mod:`kernels.registry` keeps them in the order ``implementation=None`` tries them. The public package
(``fa2_jax``) validates a call, describes it as a :class:`KernelCall`, walks the registry, and then
talks to the chosen backend through these methods alone: one call signature for every family.

Adding a family (docs/design.md#backends): a folder with its config, forward and backward, a
``backend.py`` with a :class:`Backend` subclass, and one line in :mod:`kernels.registry`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from .masking import Variant

# The attention variants (Variant.features) a kernel family can implement; a family lists those it
# does in Backend.features, and a call using any other runs elsewhere (dispatch).
ALL_FEATURES = frozenset({"query_seq_lengths", "key_value_seq_lengths", "local_window_size",
                          "q_segment_ids/kv_segment_ids", "q_offset", "logits_soft_cap",
                          "alibi_slopes", "mask_fn", "score_fn"})


@dataclasses.dataclass(frozen=True)
class KernelCall:
  """A validated call as a backend sees it before it runs: shapes and settings, no arrays.

  ``q_shape`` ``[B, T, N, H]``, ``k_shape`` ``[B, S, K, H]`` (static ints, non-empty); ``variant`` the
  call's attention variant (``Variant(is_causal=...)`` for a plain call); ``interpret``: Pallas
  interpret mode was asked for (``interpret=True``); ``value_head_dim`` the value's (and the
  output's) head_dim ``Hv``, value ``[B, S, K, Hv]`` (None given: ``H``, stored so);
  ``page_size``: keys per page where the decode kernel reads a paged cache through its table
  (``k_shape`` then the logical ``[B, max_pages * page_size, K, H]``), else None.
  """

  q_shape: tuple[int, ...]
  k_shape: tuple[int, ...]
  dtype: Any
  is_causal: bool
  variant: Variant
  interpret: bool = False
  deterministic: bool = False
  value_head_dim: int | None = None
  page_size: int | None = None

  def __post_init__(self):
    if self.value_head_dim is None:  # one value per call: equal calls compare (and hash) equal
      object.__setattr__(self, "value_head_dim", self.q_shape[-1])

  @property
  def head_dim(self) -> int:
    """The query/key head_dim ``H``."""
    return self.q_shape[-1]

  @property
  def v_shape(self) -> tuple[int, ...]:
    """``[B, S, K, Hv]``."""
    return (*self.k_shape[:3], self.value_head_dim)

  @property
  def seq_q(self) -> int:
    return self.q_shape[1]

  @property
  def seq_k(self) -> int:
    return self.k_shape[1]

  @property
  def plain(self) -> bool:
    """No attention variant beyond ``is_causal``."""
    return self.variant == Variant(is_causal=self.variant.is_causal)


class Backend:
  """One kernel family. Subclasses set the class attributes and implement the methods.

  Attributes:
    name: the ``implementation=`` value that asks for it, and ``Dispatch.backend``.
    config_type: the frozen, hashable dataclass of its tiles (``block_sizes=`` takes one).
    features: the attention variants its kernels implement (a subset of :data:`ALL_FEATURES`).
    partitionable: whether its calls may go through ``custom_partitioning`` (fa2_jax.sharding).
  """

  name: str = ""
  config_type: type = type(None)
  features: frozenset = ALL_FEATURES

  def supports(self, call: KernelCall) -> str | None:
    """None when this family can run ``call`` here (platform, dtype, head_dim, variant), else why
    not, in words that finish "... cannot run this call: "."""
    raise NotImplementedError

  def default_config(self, call: KernelCall):
    """The tuned config for ``call``."""
    raise NotImplementedError

  def check_config(self, call: KernelCall, config) -> str | None:
    """None when a user's ``config`` can run ``call``, else why not (shared memory, head_dim)."""
    del call, config
    return None

  def launch_config(self, call: KernelCall, config):
    """The config the kernels are launched with (``config`` or the default, adapted to the call:
    e.g. tiles clamped to short sequences). Hashable: it is part of the custom_vjp's static state."""
    return self.default_config(call) if config is None else config

  def range_tiles(self, call: KernelCall, config) -> dict:
    """The block-range tables its kernels read for an attention variant, by kernel name:
    ``name -> (kind, rows, keys)`` (:func:`kernels.block_ranges.range_tables`)."""
    raise NotImplementedError

  def kernel_names(self, call: KernelCall, config) -> tuple[tuple[str, ...], tuple[str, ...], bool]:
    """``(forward kernels, backward kernels, deterministic)`` for ``fa2_jax.backend_for``."""
    raise NotImplementedError

  def partitionable(self) -> bool:
    return True

  def clips_ranges(self, config) -> bool:
    """Whether :meth:`forward` takes lengths and ``q_offset`` as given (int32, possibly out of
    range) and clips them itself, so that no XLA clip op runs before its kernel
    (:func:`kernels.masking.clip_ranges` otherwise clips them first). :meth:`backward` always
    takes them clipped."""
    del config
    return False

  def accumulates_dq(self) -> bool:
    """Whether :meth:`backward` takes ``dq_accumulator`` (float32 ``[B, T, N, H]``, a running sum of
    dQ / scale) and returns it with this call's dQ / scale added in place of dQ (the ring's steps;
    otherwise the caller adds)."""
    return False

  def differentiates_slopes(self, config) -> bool:
    """Whether :meth:`backward` returns the ALiBi slopes' gradient when asked (``slope_grad``)."""
    del config
    return False

  def chosen_because(self, call: KernelCall, config) -> str | None:
    """What about ``call`` made this family the one, for ``backend_for`` (None: nothing to add to
    dispatch's reason)."""
    del call, config
    return None

  def forward(self, q, k, v, *, scale: float, is_causal: bool, config, variant: Variant | None,
              arrays, table, interpret: bool):
    """``(out [B, T, N, Hv] in q's dtype, stats [B, N, 2, T] f32)``: the rows' statistics
    (kernels/softmax.py). ``variant`` None: a plain (dense or causal) call; ``arrays`` its
    :class:`kernels.masking.VariantArrays`; ``table`` the forward's block-range table or None."""
    raise NotImplementedError

  def backward(self, q, k, v, out, stats, dout, *, dlse, scale: float, is_causal: bool,
               deterministic: bool, config, variant: Variant | None, arrays, tables: dict,
               interpret: bool, slope_grad: bool = False):
    """``(dq, dk, dv)`` in q's dtype. ``dlse`` ``[B, N, T]`` f32, the lse cotangent; ``tables`` the
    block-range tables by kernel name. ``slope_grad`` (only where :meth:`differentiates_slopes`):
    also each query row's part of the ALiBi slopes' gradient, ``[B, N, T]`` f32, as a fourth
    output."""
    raise NotImplementedError

  def __repr__(self) -> str:
    return f"<fa2_jax backend {self.name!r}>"


def accumulate_dq(dq_accumulator, dq, scale: float):
  """``dq`` itself (no accumulator), or ``dq_accumulator + dq / scale`` in float32, the form of
  :meth:`Backend.backward`'s ``dq_accumulator`` (a call with ``scale = 0`` adds nothing: its dQ is
  0)."""
  if dq_accumulator is None:
    return dq
  if scale == 0:
    return dq_accumulator
  return dq_accumulator + dq.astype(jnp.float32) * (1.0 / scale)
