"""The attention implementations every benchmark compares: one registry, each entry a callable
``f(q, k, v, *, causal, **variant) -> out`` on ``q [B, T, N, H]``, ``k, v [B, S, K, H]`` (``N % K == 0``);
``variant``: keyword arguments passed to that implementation's own call as they are (its names, e.g.
``local_window_size`` for fa2 and cuDNN, ``window_size`` for fa3; benchmarks/variants.py).

=============  ==================================================================================
``fa2``        ``fa2_jax.flash_attention`` with its defaults (the Mosaic kernels on Hopper, Triton
               on other GPUs); on a CPU the Triton kernels in Pallas interpret mode
``fa2_det``    the same with ``deterministic=True`` (no fused dQ reduce-adds)
``fa2_triton`` the same with ``implementation="triton"``
``cudnn``      ``jax.nn.dot_product_attention(implementation="cudnn")``: NVIDIA GPU, bf16/fp16
``xla``        ``jax.nn.dot_product_attention(implementation="xla")``: the materialised formula
``tokamax``    ``tokamax.dot_product_attention(implementation="mosaic")``: optional peer, Hopper
``fa3``        ``flash_attn3_jax.flash_mha``: optional peer (FlashAttention-3's CUDA kernels), Hopper,
               head_dim 128, bf16/fp16 (its prebuilt wheel); GQA by fewer K/V heads
=============  ==================================================================================

``unavailable(name)`` says why an entry cannot run in this process at all (a peer that does not
import, no GPU), ``unsupported(name, ...)`` why it cannot run one shape. The peers are optional: a
benchmark adds their rows when they import and names the absent ones.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

from .timing import err_str

# The XLA formula materialises the [B, N, T, S] f32 scores, and its backward keeps several copies: with
# 16k tokens (batch = 16384 / seq) one copy is 16 GiB at seq 16k with 16 heads (32 GiB with 32), 8 GiB
# at 8k. The throughput grid leaves it out past 8k.
XLA_MAX_SEQ = 8192
HALF = ("bfloat16", "float16")


def _backend() -> str:
  import jax
  return jax.default_backend()


def on_gpu() -> bool:
  return _backend() in ("gpu", "cuda")


def compute_capability() -> str | None:
  """The GPU's compute capability as jax reports it ("9.0" on an H100 or H200), or None."""
  import jax
  return getattr(jax.devices()[0], "compute_capability", None) if on_gpu() else None


def is_hopper() -> bool:
  return str(compute_capability()).startswith("9.")


def _need_gpu() -> str | None:
  return None if on_gpu() else f"needs an NVIDIA GPU (jax backend {_backend()})"


def _need_hopper() -> str | None:
  cc = compute_capability()
  return None if is_hopper() else ("needs a Hopper GPU (compute capability 9.x); this is "
                                   + (f"compute capability {cc}" if cc else f"jax backend {_backend()}"))


def _import(module: str):
  """The module, or an ImportError whose message says it is an optional peer."""
  try:
    return importlib.import_module(module)
  except Exception as e:  # noqa: BLE001 - anything that stops the import means "absent"
    raise ImportError(f"{module} is not importable ({err_str(e, 300)})") from e


def _peer_probe(module: str) -> Callable[[], str | None]:
  def probe():
    try:
      _import(module)
    except ImportError as e:
      return str(e)
    return _need_hopper()
  return probe


# --- the callables ------------------------------------------------------------------------------------

def _interpret():
  """fa2_jax entries on a CPU run the kernels in Pallas interpret mode (its default there would be
  the XLA formula)."""
  return None if on_gpu() else True


def _fa2(**kw):
  def f(q, k, v, *, causal, **variant):
    import fa2_jax
    return fa2_jax.flash_attention(q, k, v, is_causal=causal, interpret=_interpret(), **kw, **variant)
  return f


def _fa2_describe(**kw):
  def d(q, k, v, *, causal, **variant):
    import fa2_jax
    return fa2_jax.backend_for(q, k, v, is_causal=causal, interpret=_interpret(), **kw, **variant)
  return d


def _jax_nn(implementation):
  def f(q, k, v, *, causal, **variant):
    import jax
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=implementation,
                                        **variant)
  return f


def _tokamax(q, k, v, *, causal, **variant):
  return _import("tokamax").dot_product_attention(q, k, v, is_causal=causal, implementation="mosaic",
                                                  **variant)


def _fa3(q, k, v, *, causal, **variant):
  return _import("flash_attn3_jax").flash_mha(q, k, v, softmax_scale=None, is_causal=causal, **variant)


# --- per-shape limits ---------------------------------------------------------------------------------

def _half_only(q_shape, kv_shape, dtype, causal):
  del q_shape, kv_shape, causal
  return None if str(dtype) in HALF else f"bf16/fp16 only, got {dtype}"


def _fa3_shapes(q_shape, kv_shape, dtype, causal):
  if q_shape[-1] != 128:
    return f"head_dim 128 only (its prebuilt sm90 kernels), got {q_shape[-1]}"
  return _half_only(q_shape, kv_shape, dtype, causal)


def _xla_shapes(q_shape, kv_shape, dtype, causal):
  del dtype, causal
  if max(q_shape[1], kv_shape[1]) > XLA_MAX_SEQ:
    return (f"skipped above seq {XLA_MAX_SEQ}: the formula materialises the [B, N, T, S] scores "
            f"({4 * q_shape[0] * q_shape[2] * q_shape[1] * kv_shape[1] / 2 ** 30:.0f} GiB per f32 "
            "copy here)")
  return None


# --- the registry -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Impl:
  """One implementation: ``impl(q, k, v, causal=..., **variant)`` runs it."""

  name: str  # its legend name and colour in tables and plots: harness.PALETTE
  about: str
  fn: Callable
  probe: Callable[[], str | None] = lambda: None
  shapes: Callable[..., str | None] = lambda *a: None
  describe: Callable | None = None  # fa2_jax entries: fa2_jax.backend_for of the same call

  def __call__(self, q, k, v, *, causal: bool, **variant):
    return self.fn(q, k, v, causal=causal, **variant)


IMPLS = {i.name: i for i in (
    Impl("fa2", "fa2_jax.flash_attention defaults", _fa2(), describe=_fa2_describe()),
    Impl("fa2_det", "fa2_jax.flash_attention(deterministic=True)", _fa2(deterministic=True),
         describe=_fa2_describe(deterministic=True)),
    Impl("fa2_triton", 'fa2_jax.flash_attention(implementation="triton")', _fa2(implementation="triton"),
         describe=_fa2_describe(implementation="triton")),
    Impl("cudnn", 'jax.nn.dot_product_attention(implementation="cudnn")', _jax_nn("cudnn"), _need_gpu,
         _half_only),
    Impl("xla", 'jax.nn.dot_product_attention(implementation="xla")', _jax_nn("xla"), shapes=_xla_shapes),
    Impl("tokamax", 'tokamax.dot_product_attention(implementation="mosaic")', _tokamax,
         _peer_probe("tokamax"), _half_only),
    Impl("fa3", "flash_attn3_jax.flash_mha", _fa3, _peer_probe("flash_attn3_jax"), _fa3_shapes),
)}
NAMES = tuple(IMPLS)

_PROBED: dict[str, str | None] = {}


def get(name: str) -> Impl:
  if name not in IMPLS:
    raise ValueError(f"unknown implementation {name!r}; known: {', '.join(NAMES)}")
  return IMPLS[name]


def unavailable(name: str) -> str | None:
  """None when ``name`` can run in this process, else why not (probed once per process)."""
  impl = get(name)
  if name not in _PROBED:
    try:
      _PROBED[name] = impl.probe()
    except Exception as e:  # noqa: BLE001 - a probe that fails says why
      _PROBED[name] = err_str(e, 300)
  return _PROBED[name]


def unsupported(name: str, q_shape, kv_shape, dtype, causal: bool) -> str | None:
  """None when ``name`` runs this shape, else why not."""
  return get(name).shapes(tuple(q_shape), tuple(kv_shape), str(dtype), bool(causal))


def availability(names=NAMES) -> dict[str, str | None]:
  """``{name: None or the reason it cannot run here}``."""
  return {n: unavailable(n) for n in names}


def split_available(names) -> tuple[list[str], dict[str, str]]:
  """``(runnable names, {absent name: reason})``, order kept."""
  reasons = availability(names)
  return [n for n in names if reasons[n] is None], {n: r for n, r in reasons.items() if r}


def parse_names(text_or_list) -> list[str]:
  """``"fa2,cudnn"`` (or a list) -> ``["fa2", "cudnn"]``; ValueError naming an unknown entry."""
  names = (text_or_list.replace(" ", "").split(",") if isinstance(text_or_list, str)
           else list(text_or_list))
  names = [n for n in names if n]
  bad = [n for n in names if n not in IMPLS]
  if bad:
    raise ValueError(f"unknown implementations {bad}; known: {', '.join(NAMES)}")
  return names
