"""The kernel families, in the order ``implementation=None`` tries them.

The first registered family whose :meth:`Backend.supports` accepts a call runs it (the XLA formula
runs what none accepts). A new family is one folder and one line below; tests may :func:`register`
one of their own.
"""
from __future__ import annotations

from .backend import Backend
from .decode.backend import DECODE
from .sm90.backend import SM90
from .triton.backend import TRITON

# Most specialised first: the Hopper kernels where they run, the portable Triton kernels after.
_BACKENDS: list[Backend] = [DECODE, SM90, TRITON]

# Other names ``implementation=`` takes: "mosaic", the Mosaic GPU family of this GPU generation (the
# only one today is sm90's).
ALIASES = {"mosaic": "sm90"}


def backends() -> tuple[Backend, ...]:
  return tuple(_BACKENDS)


def names() -> tuple[str, ...]:
  return tuple(b.name for b in _BACKENDS)


def get(name: str) -> Backend:
  name = ALIASES.get(name, name)
  for b in _BACKENDS:
    if b.name == name:
      return b
  raise KeyError(name)


def for_config(config) -> Backend | None:
  """The family whose config type ``config`` is, or None."""
  for b in _BACKENDS:
    if isinstance(config, b.config_type):
      return b
  return None


def register(backend: Backend, *, position: int | None = None) -> None:
  """Add ``backend`` (at ``position`` in the order, default last). Its name and config type must be
  new."""
  if not isinstance(backend, Backend) or not backend.name:
    raise TypeError(f"register takes a named kernels.backend.Backend, got {backend!r}")
  if backend.name in names() or backend.name in ALIASES or backend.name in ("xla", None):
    raise ValueError(f"a backend named {backend.name!r} is already registered")
  if any(b.config_type is backend.config_type for b in _BACKENDS):
    raise ValueError(f"config type {backend.config_type.__name__} already belongs to a backend")
  _BACKENDS.insert(len(_BACKENDS) if position is None else position, backend)


def unregister(name: str) -> None:
  _BACKENDS.remove(get(name))
