"""The Hopper (sm90) Mosaic GPU family as a :class:`kernels.backend.Backend`: wgmma, TMA and warp
specialisation, so NVIDIA compute capability 9.x only."""
from __future__ import annotations

import jax.numpy as jnp

from .. import platform
from ..backend import Backend, KernelCall
from ..block_ranges import mask_fn_depends_on_head
from ..vma import cast_like
from .config import MosaicConfig, supports


class SM90Backend(Backend):
  name = "sm90"
  config_type = MosaicConfig

  def supports(self, call: KernelCall) -> str | None:
    if call.interpret:
      return "it has no Pallas interpret mode here (interpret=True)"
    cc = platform.gpu_compute_capability()
    if cc is None or cc[0] != 9:
      return ("it needs an NVIDIA Hopper GPU (compute capability 9.x, wgmma); this is "
              f"{platform.describe()}")
    why = supports(call.q_shape, call.k_shape, call.dtype, call.head_dim, call.is_causal,
                   value_head_dim=call.value_head_dim)
    if why is None and mask_fn_depends_on_head(call.variant, call.q_shape[2]):
      why = ("its mask_fn depends on the head (these kernels read one block range per batch "
             "element and tile, shared by the heads)")
    return why

  def default_config(self, call: KernelCall) -> MosaicConfig:
    return MosaicConfig.default(call.head_dim, call.dtype, call.is_causal,
                                value_head_dim=call.value_head_dim)

  def check_config(self, call: KernelCall, config: MosaicConfig) -> str | None:
    return config.check(call.head_dim, jnp.dtype(call.dtype).itemsize, call.value_head_dim)

  def range_tiles(self, call: KernelCall, config: MosaicConfig) -> dict:
    return config.range_tiles(call.seq_q, deterministic=call.deterministic)

  def kernel_names(self, call: KernelCall, config: MosaicConfig) -> tuple:
    # An attention variant fuses dQ only with MosaicConfig.dq_fused_variants (on in the defaults).
    fused = config.fuses_dq(call.seq_q, deterministic=call.deterministic, variant=not call.plain)
    dq = "sm90 dQ (split by role)" if config.dq_roles else "sm90 dQ"
    if fused:
      bwd = ("sm90 dK/dV + fused dQ",)
    elif config.dkv_roles:
      bwd = ("sm90 dK/dV (split by role)", dq)
    else:
      bwd = ("sm90 dK/dV", dq)
    return ("sm90 forward",), bwd, not fused

  def partitionable(self) -> bool:
    # Not in Pallas GPU interpret mode (CPU tests with emulated wgmma): its host callbacks carry
    # ordered effects, which a custom_partitioning call cannot lower (a KeyError inside JAX).
    from .ops import emulating
    return not emulating()

  def forward(self, q, k, v, *, scale, is_causal, config, variant, arrays, table, interpret):
    del interpret  # compiled only (the CPU tests interpret it through ops.emulated_mma)
    from .forward import forward
    out, stats = forward(q, k, v, scale=scale, is_causal=is_causal, config=config, variant=variant,
                         arrays=arrays, table=table)
    return cast_like(q, out, stats)

  def backward(self, q, k, v, out, stats, dout, *, dlse, scale, is_causal, deterministic, config,
               variant, arrays, tables, interpret, slope_grad=False, dq_accumulator=None):
    del interpret
    assert not slope_grad  # differentiates_slopes is False: fa2_jax refuses such a call first
    from .backward import backward
    grads = backward(q, k, v, out, stats, dout, dlse=dlse, scale=scale, is_causal=is_causal,
                     deterministic=deterministic, config=config, variant=variant, arrays=arrays,
                     tables=tables, dq_accumulator=dq_accumulator)
    return cast_like(q, *grads)

  def accumulates_dq(self) -> bool:
    return True


SM90 = SM90Backend()
