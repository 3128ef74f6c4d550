"""Which kernels run a call, and why: the walk over the kernel families, and ``backend_for``.

What runs where (``implementation=None``), in the order of :mod:`kernels.registry`:

* ``"decode"``: decoding calls on any GPU (and ``interpret=True``): at most 16 new query rows (times
  the query heads per KV head at most 64) against at least 256 keys and 8 per row, with the variants
  it implements (lengths, ``q_offset``, causal, window, soft cap, ALiBi); split-KV forward, the
  backward of the family below that would run the call (kernels/decode).
* ``"sm90"``: NVIDIA Hopper (compute capability 9.x: H100, H200), for the calls its kernels support
  (bfloat16/float16, head_dims that are multiples of 16 up to 256).
* ``"triton"``: every other GPU (A100 = sm80, sm86, sm89, Blackwell sm100/sm120, ROCm) and Hopper calls
  the sm90 kernels refuse; on CPU with ``interpret=True`` (Pallas interpret mode).
* ``"xla"``: the reference formula, for what no family runs (CPU, head_dim > 256, empty or symbolic
  shapes, an attention variant no family implements).

An explicit ``implementation`` (a family's name, or ``"mosaic"`` for the Mosaic GPU family of this
GPU) that cannot run the call raises a ValueError naming the reason; so does a ``block_sizes`` config
whose family cannot. The full table: docs/design.md#dispatch.
"""
from __future__ import annotations

import dataclasses

import jax

from .kernels import platform, registry
from .kernels.backend import Backend, KernelCall
from .kernels.masking import closes_over_arrays, not_per_pair


def implementations() -> tuple:
  """The values ``implementation=`` takes."""
  return (None, *registry.names(), *registry.ALIASES, "xla")


def unsupported_features(backend: Backend, variant) -> tuple[str, ...]:
  """The variant features (beyond ``is_causal``) that ``backend``'s kernels do not implement."""
  if variant is None:
    return ()
  missing = tuple(f for f in variant.features if f not in backend.features)
  if "mask_fn" in missing or "score_fn" in missing:  # what the functions hold is moot then
    return missing
  if (fn := closes_over_arrays(variant)) is not None:
    missing += (f"a {fn} whose trace holds an array constant (an array it closes over or builds, "
                "e.g. jnp.asarray of a list) or a traced value (a kernel needs it as an operand; "
                "close over Python scalars instead)",)
  elif (why := not_per_pair(variant)) is not None:
    missing += (why,)
  return missing


def _missing_text(missing, subject: str) -> str:
  """``missing`` (:func:`unsupported_features`: feature names, and sentences on a function the
  kernels cannot take) as one clause of ``subject``."""
  names = [f for f in missing if " " not in f]
  reasons = [f for f in missing if " " in f]
  verb = "does" if subject == "it" else "do"
  parts = [f"{verb} not implement {', '.join(names)} yet"] if names else []
  parts += [f"cannot take {'; '.join(reasons)}"] if reasons else []
  return f"{subject} {' and '.join(parts)}"


def _refusal(backend: Backend, call: KernelCall) -> str | None:
  """Why ``backend`` cannot run ``call``, or None."""
  missing = unsupported_features(backend, call.variant)
  if missing:
    return _missing_text(missing, "it")
  return backend.supports(call)


def choose_backend(implementation, call: KernelCall, config=None) -> str:
  """The name of the family (or ``"xla"``) that runs a validated, static, non-empty call; raises
  ValueError when an explicit ``implementation`` or a ``config`` asks for a family that cannot."""
  if implementation == "xla":
    return "xla"
  if implementation is not None:
    backend = registry.get(implementation)
    if (why := _refusal(backend, call)) is not None:
      raise ValueError(f"implementation={implementation!r} cannot run this call: {why}; use "
                       "implementation=None or 'xla'")
    return backend.name
  if config is not None:  # the type of the config names the family it tunes
    backend = registry.for_config(config)
    if (why := _refusal(backend, call)) is not None:
      raise ValueError(f"block_sizes is a {type(config).__name__}, which asks for the "
                       f"{backend.name} kernels, and they cannot run this call: {why}; pass "
                       "block_sizes=None to let implementation=None choose")
    return backend.name
  for backend in registry.backends():
    if _refusal(backend, call) is None:
      return backend.name
  return "xla"


@dataclasses.dataclass(frozen=True)
class Dispatch:
  """What :func:`fa2_jax.flash_attention` would run for a call.

  Attributes:
    backend: the kernel family's name (``"sm90"``, ``"triton"``, ...) or ``"xla"`` (the formula).
    forward: the forward kernel(s), e.g. ``("sm90 forward",)``; ``()`` for ``"xla"``.
    backward: the backward kernels, e.g. ``("sm90 dK/dV + fused dQ",)``; ``()`` for ``"xla"``.
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


def describe(backend: str, call: KernelCall | None, *, implementation, config, formula_reason=None
             ) -> Dispatch:
  """The :class:`Dispatch` of a call whose backend is already chosen. ``call`` None: the call has
  empty or symbolic shapes (``formula_reason`` says which)."""
  if backend == "xla":
    if implementation == "xla":
      why = "implementation='xla' asks for the reference formula"
    elif call is None:
      why = formula_reason
    else:
      refusals = [f"{b.name}: {_refusal(b, call)}" for b in registry.backends()]
      missing = [b for b in registry.backends() if unsupported_features(b, call.variant)]
      if len(missing) == len(registry.backends()):
        feats = dict.fromkeys(f for b in missing for f in unsupported_features(b, call.variant))
        # a function some family cannot take says more than another family's missing features
        reasons = tuple(f for f in feats if " " in f)
        why = (f"{_missing_text(reasons or tuple(feats), 'the kernels')}; the XLA formula runs every "
               "attention variant")
      elif not platform.on_gpu() and not call.interpret:
        why = (f"no GPU on this platform ({jax.default_backend()}); pass interpret=True to run the "
               "Triton kernels in Pallas interpret mode")
      else:
        why = "no kernel family runs this call (" + "; ".join(refusals) + ")"
    return Dispatch("xla", (), (), True, False, why)
  family = registry.get(backend)
  launch = family.launch_config(call, config)
  fwd, bwd, deterministic = family.kernel_names(call, launch)
  if implementation is not None:
    why = f"implementation={implementation!r}"
  elif config is not None:
    why = f"a {type(config).__name__} was passed"
  else:
    earlier = [b for b in registry.backends()[:registry.names().index(backend)]]
    why = ("Hopper GPU and a supported call (bf16/fp16, head_dim a multiple of 16 up to 256)"
           if backend == "sm90" else "the first kernel family that runs this call")
    if earlier:
      why += " (" + "; ".join(f"{b.name}: {_refusal(b, call)}" for b in earlier) + ")"
    if call.interpret:
      why = f"interpret=True runs the {backend} kernels in Pallas interpret mode"
  # A family may say what about the call made it the one (kernels/decode: a decoding call).
  if (text := family.chosen_because(call, launch)) is not None:
    why = f"{text}; {why}"
  return Dispatch(backend, fwd, bwd, deterministic, bool(call.interpret), why)
