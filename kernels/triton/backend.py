"""The Pallas Triton family as a :class:`kernels.backend.Backend`: every GPU, and the kernels the CPU
tests run in Pallas interpret mode."""
from __future__ import annotations

from .. import platform
from ..backend import Backend, KernelCall
from .config import BlockSizes

# Largest head_dim whose tiles fit the kernels' registers and shared memory.
MAX_HEAD_DIM = 256


def triton_refusal(call: KernelCall, max_head_dim: int = MAX_HEAD_DIM) -> str | None:
  """Why a family of Pallas Triton kernels (this one, the decode family) cannot run ``call``: a
  head_dim (the query/key one or the value's) past ``max_head_dim``, or no GPU outside interpret
  mode; None when it can."""
  if call.head_dim > max_head_dim:
    return f"it supports head_dim <= {max_head_dim}, got {call.head_dim}"
  if call.value_head_dim > max_head_dim:
    return f"it supports value head_dim <= {max_head_dim}, got {call.value_head_dim}"
  if not call.interpret and not platform.on_gpu():
    return (f"it needs a GPU; on this platform ({platform.describe().split()[-1]}) pass "
            "interpret=True to run the kernels in Pallas interpret mode")
  return None


class TritonBackend(Backend):
  name = "triton"
  config_type = BlockSizes

  def supports(self, call: KernelCall) -> str | None:
    return triton_refusal(call)

  def default_config(self, call: KernelCall) -> BlockSizes:
    # The tiles of the larger head_dim: Q/K tiles have H columns, the V tile and accumulator Hv.
    return BlockSizes.default(max(call.head_dim, call.value_head_dim), call.dtype)

  def launch_config(self, call: KernelCall, config) -> BlockSizes:
    config = self.default_config(call) if config is None else config
    return config.clamp(call.seq_q, call.seq_k)  # no tile past the next power of two of a length

  def range_tiles(self, call: KernelCall, config: BlockSizes) -> dict:
    return config.range_tiles()

  def kernel_names(self, call: KernelCall, config) -> tuple:
    return ("triton forward",), ("triton dK/dV", "triton dQ"), True

  def forward(self, q, k, v, *, scale, is_causal, config: BlockSizes, variant, arrays, table,
              interpret):
    from .forward import forward
    return forward(q, k, v, scale=scale, is_causal=is_causal, block_q=config.block_q,
                   block_k=config.block_k, num_warps=config.num_warps_fwd,
                   num_stages=config.num_stages_fwd, interpret=interpret, variant=variant,
                   arrays=arrays, table=table)

  def differentiates_slopes(self, config) -> bool:
    return True

  def backward(self, q, k, v, out, stats, dout, *, dlse, scale, is_causal, deterministic,
               config: BlockSizes, variant, arrays, tables, interpret, slope_grad=False):
    from .backward import backward
    return backward(q, k, v, out, stats, dout, dlse=dlse, scale=scale, is_causal=is_causal,
                    block_q_dkv=config.block_q_dkv, block_k_dkv=config.block_k_dkv,
                    block_q_dq=config.block_q_dq, block_k_dq=config.block_k_dq,
                    num_warps=config.num_warps_bwd, num_stages=config.num_stages_bwd,
                    interpret=interpret, variant=variant, arrays=arrays, tables=tables,
                    slope_grad=slope_grad)


TRITON = TritonBackend()
