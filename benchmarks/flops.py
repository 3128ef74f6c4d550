"""FLOP counts of attention, the FlashAttention-2 paper's convention (§4.1; the anchors use the same).

Forward: two matmuls, ``Q K^T`` and ``P V``, each ``2·B·N·T·S·H``: ``4·B·N·T·S·H`` in all, halved when
causal (about half of the score matrix is masked). Backward: 2.5 times the forward (five matmuls instead
of two); forward+backward: 3.5 times. The same count is used for every implementation, whatever it
really computes, so TFLOP/s compare like times.
"""
from __future__ import annotations

PASSES = ("fwd", "bwd", "fwd+bwd")
PASS_FLOP_MULT = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}


def attention_flops(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int,
                    causal: bool) -> float:
  """Forward FLOPs: ``4·B·N·T·S·H``, halved when causal. ``heads`` counts query heads (GQA: N)."""
  for name, v in (("batch", batch), ("heads", heads), ("seq_q", seq_q), ("seq_k", seq_k),
                  ("head_dim", head_dim)):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
      raise ValueError(f"{name} must be a positive int, got {v!r}")
  f = 4.0 * batch * heads * seq_q * seq_k * head_dim
  return f / 2 if causal else f


def tflops(flops_fwd: float, pass_: str, seconds: float | None) -> float | None:
  """TFLOP/s of one pass that took ``seconds`` (None when there is no positive time)."""
  if pass_ not in PASS_FLOP_MULT:
    raise ValueError(f"pass_ must be one of {PASSES}, got {pass_!r}")
  if seconds is None or not seconds > 0:
    return None
  return PASS_FLOP_MULT[pass_] * flops_fwd / seconds / 1e12
