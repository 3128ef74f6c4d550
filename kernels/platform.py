"""The platform the kernels would run on: GPU or not, and an NVIDIA GPU's compute capability."""
from __future__ import annotations

import jax


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


def describe() -> str:
  """``"compute capability 9.0"`` on an NVIDIA GPU, else ``"platform <name>"``."""
  cc = gpu_compute_capability()
  return f"compute capability {cc[0]}.{cc[1]}" if cc else f"platform {jax.default_backend()}"


def is_hopper() -> bool:
  """True on compute capability 9.x (H100, H200), the only generation with ``wgmma``."""
  cc = gpu_compute_capability()
  return cc is not None and cc[0] == 9
