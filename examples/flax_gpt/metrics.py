"""FLOP and MFU accounting of the example GPT's training runs.

FLOPs per sequence follow the FlashAttention-2 paper (forward + backward):
``6 * seq_len * n_params + 12 * n_layer * n_embd * seq_len**2``, with every parameter counted
(embeddings too) and the attention term dense: every ``[T, T]`` pair, not halved for causal masking
nor reduced by ``--window`` or ``--packing``. MFU divides the achieved FLOP/s by the dense bfloat16
peak of the devices: 989.4 TFLOP/s per H100/H200 SXM, 312 per A100 (``--peak-tflops`` overrides it);
on CPU it is None (the progress lines then show neither TFLOP/s nor MFU). The attended-pair count (:func:`attended_flops_per_sequence`) is
``12 * n_layer * n_embd`` times the (query, key) pairs the causal mask and the window leave
(cross-document pairs of ``--packing`` still counted, as they vary by batch).
"""
from __future__ import annotations

import dataclasses

from .config import GPTConfig

# Dense bfloat16 tensor-core peaks (TFLOP/s per device) from NVIDIA's data sheets, SXM parts.
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}


def flops_per_sequence(config: GPTConfig, n_params: int) -> float:
  """Training FLOPs of one sequence (forward + backward), as in the FlashAttention-2 paper: the
  attention term counts every ``[T, T]`` pair (dense), whatever the causal mask, window or packing."""
  t = config.seq_len
  return 6.0 * t * n_params + 12.0 * config.n_layer * config.n_embd * t * t


def attended_pairs(config: GPTConfig) -> int:
  """The (query, key) pairs one sequence attends under the causal mask and ``config.window``: query
  ``i`` sees ``min(i, window) + 1`` keys. (Packing's cross-document pairs are not subtracted.)"""
  t = config.seq_len
  w = t - 1 if config.window is None else min(config.window, t - 1)
  return (w + 1) * t - w * (w + 1) // 2  # sum over i of min(i, w) + 1


def attended_flops_per_sequence(config: GPTConfig, n_params: int) -> float:
  """:func:`flops_per_sequence` with the attention term counting only :func:`attended_pairs`
  (the forward's 4 FLOPs per pair and head channel, times 3 for forward + backward)."""
  return (6.0 * config.seq_len * n_params
          + 12.0 * config.n_layer * config.n_embd * attended_pairs(config))


def peak_tflops(devices) -> float | None:
  """Summed dense bf16 peak of ``devices``, or None when unknown (CPU, other GPUs)."""
  if devices[0].platform != "gpu":
    return None
  kind = devices[0].device_kind
  for name, tflops in PEAK_BF16_TFLOPS.items():
    if name in kind:
      return tflops * len(devices)
  return None


@dataclasses.dataclass
class Throughput:
  """Accumulates timed steps (the first, compiling, step and evaluations are excluded)."""

  seconds: float = 0.0
  steps: int = 0

  def add(self, seconds: float, steps: int) -> None:
    self.seconds += seconds
    self.steps += steps
