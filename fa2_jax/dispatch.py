"""Which kernels run a call, and why: the backend choice and its public introspection, ``backend_for``.

What runs where (``implementation=None``):

* NVIDIA Hopper (compute capability 9.x: H100, H200): the Mosaic GPU kernels for the calls they support
  (bfloat16/float16, head_dim 64/128/192/256), the Triton kernels for the rest.
* Every other GPU (A100 = sm80, sm86, sm89, Blackwell sm100/sm120, ROCm): the Triton kernels. The Mosaic
  kernels use Hopper's ``wgmma``, which no later generation has.
* CPU: the XLA reference formula, or the Triton kernels in Pallas interpret mode with ``interpret=True``.
* An attention variant (``fa2_jax.masking.Variant.features``) a kernel family does not implement
  (``KERNEL_FEATURES``) never runs on it: ``implementation=None`` picks one that does, else the XLA
  formula; an explicit ``"triton"``/``"mosaic"`` raises a ValueError naming the arguments.

The full table, and the explicit-``implementation`` errors: docs/design.md#dispatch.
"""
from __future__ import annotations

import dataclasses

import jax

from .kernels.mosaic.config import MosaicConfig
from .kernels.triton.config import BlockSizes

IMPLEMENTATIONS = (None, "triton", "mosaic", "xla")
MAX_HEAD_DIM = 256  # largest head_dim whose tiles fit the Triton kernels' registers / shared memory


def on_gpu() -> bool:
  return jax.default_backend() in ("gpu", "cuda", "rocm")


def gpu_compute_capability() -> tuple[int, int] | None:
  """``(major, minor)`` of the first GPU (NVIDIA), or None off an NVIDIA GPU or when unknown."""
  if not on_gpu():
    return None
  cc = getattr(jax.devices()[0], "compute_capability", None)
  if cc is None:
    return None
  try:
    major, _, minor = str(cc).partition(".")
    return int(major), int(minor or 0)
  except ValueError:
    return None


def is_hopper() -> bool:
  """True on compute capability 9.x, the only generation with ``wgmma`` (the Mosaic kernels' matmul)."""
  cc = gpu_compute_capability()
  return cc is not None and cc[0] == 9


def mosaic_reason(query, key, is_causal: bool, interpret, variant=None) -> str | None:
  """None when the Mosaic GPU kernels can run this call here, else why not."""
  if interpret:
    return "it has no Pallas interpret mode here (interpret=True)"
  if not is_hopper():
    cc = gpu_compute_capability()
    where = f"compute capability {cc[0]}.{cc[1]}" if cc else f"platform {jax.default_backend()}"
    return f"it needs an NVIDIA Hopper GPU (compute capability 9.x, wgmma); this is {where}"
  from .kernels.mosaic.config import supports
  why = supports(query.shape, key.shape, query.dtype, query.shape[-1], is_causal)
  if why is None and variant is not None:
    from .block_ranges import mask_fn_depends_on_head
    if mask_fn_depends_on_head(variant, query.shape[2]):
      why = ("its mask_fn depends on the head (the Mosaic kernels read one block range per batch "
             "element and tile, shared by the heads)")
  return why


# The attention variants (fa2_jax.masking.Variant.features) each kernel family implements; a call
# using any other feature runs on the XLA formula (implementation=None) or is refused (explicit).
KERNEL_FEATURES = {
    "triton": frozenset({"query_seq_lengths", "key_value_seq_lengths", "local_window_size",
                         "q_segment_ids/kv_segment_ids", "q_offset", "logits_soft_cap",
                         "alibi_slopes", "mask_fn", "score_fn"}),
    "mosaic": frozenset({"query_seq_lengths", "key_value_seq_lengths", "local_window_size",
                         "q_segment_ids/kv_segment_ids", "q_offset", "logits_soft_cap",
                         "alibi_slopes", "mask_fn", "score_fn"}),
}


def unsupported_features(backend: str, variant) -> tuple[str, ...]:
  """The variant features (beyond ``is_causal``) that ``backend`` does not implement."""
  if variant is None or backend == "xla":
    return ()
  missing = tuple(f for f in variant.features if f not in KERNEL_FEATURES[backend])
  from .masking import closes_over_arrays, not_per_pair
  if (fn := closes_over_arrays(variant)) is not None:
    missing += (f"a {fn} whose trace holds an array constant (an array it closes over or builds, "
                "e.g. jnp.asarray of a list) or a traced value (a kernel needs it as an operand; "
                "close over Python scalars instead)",)
  elif (why := not_per_pair(variant)) is not None:
    missing += (why,)
  return missing


def choose_backend(implementation, interpret, query, key, is_causal: bool, block_sizes=None,
                   variant=None) -> str:
  """``"mosaic"``, ``"triton"`` or ``"xla"`` for a validated rank-4 call; raises ValueError when an
  explicit ``implementation`` cannot run it. ``variant``: the call's :class:`fa2_jax.masking.Variant`;
  features no kernel implements send an ``implementation=None`` call to ``"xla"``."""
  head_dim = query.shape[-1]
  if implementation == "xla":
    return "xla"
  if implementation in ("triton", "mosaic"):
    missing = unsupported_features(implementation, variant)
    if missing:
      raise ValueError(f"implementation={implementation!r} does not support {', '.join(missing)} "
                       "yet; use implementation='xla' or None")
  elif unsupported_features("triton", variant) and unsupported_features("mosaic", variant):
    return "xla"
  # With implementation=None the type of block_sizes names the kernels it tunes (if they run the
  # variant).
  by_config = (implementation is None and isinstance(block_sizes, MosaicConfig)
               and not unsupported_features("mosaic", variant))
  if implementation == "mosaic" or by_config:
    why = mosaic_reason(query, key, is_causal, interpret, variant)
    if why is not None and by_config:
      raise ValueError(f"block_sizes is a MosaicConfig, which asks for the Mosaic kernels, and they "
                       f"cannot run this call: {why}; pass block_sizes=None (or a BlockSizes) to "
                       "let implementation=None choose")
    if why is not None:
      raise ValueError(f"implementation='mosaic' cannot run this call: {why}; use "
                       "implementation='triton' or None")
    return "mosaic"
  kernel_ok = head_dim <= MAX_HEAD_DIM
  if implementation == "triton":
    if not kernel_ok:
      raise ValueError(f"implementation='triton' supports head_dim <= {MAX_HEAD_DIM}, got "
                       f"{head_dim}; use implementation='xla' or None")
    if not interpret and not on_gpu():
      raise ValueError(
          "implementation='triton' needs a GPU; on this platform "
          f"({jax.default_backend()}) pass interpret=True to run the kernel in Pallas interpret mode")
    return "triton"
  # implementation=None: Mosaic where supported, the Triton kernels on GPU (or wherever interpret=True
  # asks for them), else XLA.
  if (not isinstance(block_sizes, BlockSizes) and not unsupported_features("mosaic", variant)
      and mosaic_reason(query, key, is_causal, interpret, variant) is None):
    return "mosaic"
  if kernel_ok and (interpret or on_gpu()) and not unsupported_features("triton", variant):
    return "triton"
  return "xla"


@dataclasses.dataclass(frozen=True)
class Dispatch:
  """What :func:`fa2_jax.flash_attention` would run for a call.

  Attributes:
    backend: ``"mosaic"`` (Hopper kernels), ``"triton"`` (Pallas Triton kernels) or ``"xla"`` (the
      reference formula).
    forward: the forward kernel(s), e.g. ``("mosaic forward",)``; ``()`` for ``"xla"``.
    backward: the backward kernels, e.g. ``("mosaic dK/dV + fused dQ",)``; ``()`` for ``"xla"``.
    deterministic: True when the backward is bit-identical across runs.
    interpret: True when the kernels run in Pallas interpret mode.
    reason: one sentence on why this backend was chosen.
  """

  backend: str
  forward: tuple[str, ...]
  backward: tuple[str, ...]
  deterministic: bool
  interpret: bool
  reason: str

  def __str__(self) -> str:
    kernels = ", ".join(self.forward + self.backward) or "the XLA formula"
    return f"{self.backend} ({kernels}): {self.reason}"


def describe(backend: str, query, key, *, is_causal: bool, implementation, block_sizes,
             deterministic: bool, interpret: bool, variant=None) -> Dispatch:
  """The :class:`Dispatch` of a call whose backend is already chosen (shapes rank 4)."""
  if backend == "xla":
    tri, mos = unsupported_features("triton", variant), unsupported_features("mosaic", variant)
    missing = tuple(dict.fromkeys(tri + mos)) if tri and mos else ()
    if implementation == "xla":
      why = "implementation='xla' asks for the reference formula"
    elif missing:
      why = (f"the kernels do not implement {', '.join(missing)} yet; the XLA formula runs every "
             "attention variant")
    elif not all(isinstance(d, int) for d in (*query.shape, *key.shape)):
      why = "symbolic shapes (jax.export): the kernels need static shapes"
    elif 0 in (*query.shape[:2], key.shape[1]):
      why = "an empty batch or sequence: the formula returns the empty (or all-zero) result"
    elif query.shape[-1] > MAX_HEAD_DIM:
      why = f"head_dim {query.shape[-1]} is larger than the kernels' {MAX_HEAD_DIM}"
    else:
      why = (f"no GPU on this platform ({jax.default_backend()}); pass interpret=True to run the "
             "Triton kernels in Pallas interpret mode")
    return Dispatch("xla", (), (), True, False, why)
  if backend == "mosaic":
    h = query.shape[-1]
    cfg = block_sizes if isinstance(block_sizes, MosaicConfig) else MosaicConfig.default(
        h, query.dtype, is_causal)
    # An attention variant fuses dQ only with MosaicConfig.dq_fused_variants (on in the defaults).
    plain = variant is None or variant == type(variant)(is_causal=variant.is_causal)
    fused = cfg.fuses_dq(query.shape[1], deterministic=deterministic, variant=not plain)
    if fused:
      bwd = ("mosaic dK/dV + fused dQ",)
    elif cfg.dkv_roles:
      bwd = ("mosaic dK/dV (split by role)",
             "mosaic dQ (split by role)" if cfg.dq_roles else "mosaic dQ")
    elif cfg.dkv_split:
      bwd = ("mosaic dV", "mosaic dK", "mosaic dQ (split by role)" if cfg.dq_roles else "mosaic dQ")
    else:
      bwd = ("mosaic dK/dV", "mosaic dQ (split by role)" if cfg.dq_roles else "mosaic dQ")
    why = ("a MosaicConfig was passed" if isinstance(block_sizes, MosaicConfig) else
           "implementation='mosaic'" if implementation == "mosaic" else
           "Hopper GPU and a supported call (bf16/fp16, head_dim 64/128/192/256)")
    return Dispatch("mosaic", ("mosaic forward",), bwd, not fused, False, why)
  if implementation == "triton":
    why = "implementation='triton'"
  elif isinstance(block_sizes, BlockSizes):
    why = "a BlockSizes was passed"
  elif interpret:
    why = "interpret=True runs the Triton kernels in Pallas interpret mode"
  else:
    why = ("the Mosaic kernels cannot run it: "
           f"{mosaic_reason(query, key, is_causal, interpret, variant)}")
  return Dispatch("triton", ("triton forward",), ("triton dK/dV", "triton dQ"), True,
                  bool(interpret), why)
