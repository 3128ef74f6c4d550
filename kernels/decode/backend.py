"""The decode family as a :class:`kernels.backend.Backend`: a forward made for a few new query rows
against a long key/value cache (split-KV with the GQA group packed into one tile, kernels/decode/
forward.py); the backward is the training family's.

It is registered first, so ``implementation=None`` runs every decode-shaped call here and every
other call falls through to the training families (``supports`` says why not). The backward
(``jax.grad`` through a decoding call) is the one the training family that would have run the call
computes, from the forward's row statistics, which have the training kernels' form.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import platform
from ..backend import Backend, KernelCall
from ..sm90.backend import SM90
from ..triton.backend import TRITON, triton_refusal
from .config import (DEFAULT_SMS, FULL_TILE_ROWS, LENGTH_WAVES, DecodeConfig, DecodeLaunch,
                     grid_splits_by_length, length_splits, num_splits_heuristic)

# Programs per SM the even split count aims at (DecodeConfig.waves None): one for a contiguous
# cache, two for a paged one, whose per-page table lookups leave one program per SM waiting (8 x 32k,
# 16- and 256-key pages: 2 splits 430 and 419 us of device time, 4-5 splits 346-352;
# docs/measurements.md#decode-split-counts).
EVEN_WAVES = 1
PAGED_EVEN_WAVES = 2

# Decode-shaped: at most MAX_NEW_ROWS new rows, at most MAX_ROWS packed rows (T * N / K) per program,
# and keys at least MIN_KEYS and KEYS_PER_ROW times the rows.
MAX_NEW_ROWS = 16
MAX_ROWS = 64
MIN_KEYS = 256
KEYS_PER_ROW = 8
MAX_HEAD_DIM = 256
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def sm_count() -> int:
  """SMs of the first GPU (its ``core_count``), or :data:`DEFAULT_SMS` (an H100's) where unknown."""
  if platform.on_gpu():
    count = getattr(jax.devices()[0], "core_count", None)
    if isinstance(count, int) and count > 0:
      return count
  return DEFAULT_SMS


def decode_shape_refusal(q_shape, k_shape) -> str | None:
  """None when ``q [B, T, N, H]`` against ``k [B, S, K, H]`` is decode-shaped, else why not."""
  _, t, n, _ = q_shape
  s, kh = k_shape[1], k_shape[2]
  rows = t * (n // kh)
  if t > MAX_NEW_ROWS:
    return f"it runs decoding calls of at most {MAX_NEW_ROWS} new query rows, got T={t}"
  if rows > MAX_ROWS:
    return (f"it packs at most {MAX_ROWS} rows (new rows x query heads per KV head) into a tile, "
            f"got T={t} x {n // kh} = {rows}")
  if s < MIN_KEYS or s < KEYS_PER_ROW * t:
    return (f"it runs decoding calls, keys S >= {MIN_KEYS} and S >= {KEYS_PER_ROW} T, got T={t}, "
            f"S={s}")
  return None


def splits_by_length(call: KernelCall) -> bool:
  """Whether the rows of a split call take their own split counts at run time
  (:func:`kernels.decode.config.row_splits`): with several rows whose reachable keys come from
  run-time lengths or offsets (then they may differ row to row), and tiles of fewer than
  :data:`~kernels.decode.config.FULL_TILE_ROWS` packed rows (docs/measurements.md#decode-kernels:
  8 x 32k ragged 177 us against 206 with one count for every row; MQA's one wave of 32-row tiles
  was 5% slower with it)."""
  v = call.variant
  b, t, n, _ = call.q_shape
  return (b > 1 and t * (n // call.k_shape[2]) < FULL_TILE_ROWS
          and (v.has_kv_lengths or v.has_q_offset or v.has_q_lengths))


class DecodeBackend(Backend):
  name = "decode"
  config_type = DecodeConfig
  features = frozenset({"query_seq_lengths", "key_value_seq_lengths", "local_window_size",
                        "q_offset", "logits_soft_cap", "alibi_slopes"})

  def supports(self, call: KernelCall) -> str | None:
    if (why := triton_refusal(call, MAX_HEAD_DIM)) is not None:
      return why
    if jnp.dtype(call.dtype) not in _DTYPES:
      return f"it supports bfloat16, float16 and float32, got {jnp.dtype(call.dtype).name}"
    if (why := decode_shape_refusal(call.q_shape, call.k_shape)) is not None:
      return why
    if call.variant.is_causal and not call.variant.has_q_offset:
      return ("top-left causal (is_causal without q_offset) attends the first T keys only; a "
              "decoding step passes q_offset (e.g. lengths - T)")
    if call.q_shape[0] > 65535 or call.k_shape[2] > 65535:
      return "it needs B and K <= 65535 (CUDA grid)"
    return None

  def default_config(self, call: KernelCall) -> DecodeConfig:
    # The tiles of the larger head_dim: K tiles have H columns, the V tile and accumulator Hv.
    b, t, n, _ = call.q_shape
    return DecodeConfig.default(max(call.head_dim, call.value_head_dim), call.dtype,
                                rows=t * (n // call.k_shape[2]))

  def check_config(self, call: KernelCall, config: DecodeConfig) -> str | None:
    del call, config
    return None

  @staticmethod
  def training_family(call: KernelCall) -> Backend:
    """The family whose backward runs the call: sm90 where it supports the call, else Triton."""
    return SM90 if SM90.supports(call) is None else TRITON

  def launch_config(self, call: KernelCall, config) -> DecodeLaunch:
    config = self.default_config(call) if config is None else config
    family = self.training_family(call)
    b, t, n, _ = call.q_shape
    kh = call.k_shape[2]
    n_blocks = -(-call.seq_k // config.block_k)
    sms = sm_count()
    even_waves = config.waves or (EVEN_WAVES if call.page_size is None else PAGED_EVEN_WAVES)
    splits = config.num_splits or num_splits_heuristic(b * kh, n_blocks, sms=sms,
                                                       waves=even_waves)
    target = None
    if config.num_splits is None and splits_by_length(call):
      length_waves = config.waves or LENGTH_WAVES
      base = length_splits(b * kh, n_blocks, sms=sms, waves=length_waves)
      if base > 1:  # each row its own count, from its reachable keys at run time
        target = length_waves * sms
        splits = grid_splits_by_length(kh, n_blocks, base, sms=sms, waves=length_waves)
    return DecodeLaunch(config, min(splits, n_blocks), t * (n // kh), family.name,
                        family.launch_config(call, None),
                        delegate_forward=decode_shape_refusal(call.q_shape, call.k_shape)
                        is not None, split_target=target)

  def clips_ranges(self, config: DecodeLaunch) -> bool:
    # The decode kernel clips its scalars (kernels/decode/forward.py); a delegated forward does not.
    return not config.delegate_forward

  def _family(self, launch: DecodeLaunch) -> Backend:
    return SM90 if launch.backward == SM90.name else TRITON

  def range_tiles(self, call: KernelCall, config: DecodeLaunch) -> dict:
    # The training family's tables (its backward reads them); "fwd" only when its forward runs.
    tiles = self._family(config).range_tiles(call, config.backward_config)
    return tiles if config.delegate_forward else {k: v for k, v in tiles.items() if k != "fwd"}

  def kernel_names(self, call: KernelCall, config: DecodeLaunch) -> tuple:
    family = self._family(config)
    fwd_names, bwd, deterministic = family.kernel_names(call, config.backward_config)
    if config.delegate_forward:
      return fwd_names, bwd, deterministic
    fwd = (f"decode split-KV forward ({'up to ' if config.split_target else ''}"
           f"{config.num_splits} split{'s' if config.num_splits > 1 else ''})",)
    if config.num_splits > 1:
      fwd += ("decode combine",)
    return fwd, bwd, deterministic

  def chosen_because(self, call: KernelCall, config: DecodeLaunch) -> str | None:
    """Why a decode-shaped call runs here, for ``backend_for`` (None when the launched call is not
    decode-shaped)."""
    if config.delegate_forward:
      return None
    t, n, kh = call.q_shape[1], call.q_shape[2], call.k_shape[2]
    splits = f"{config.num_splits} split{'s' if config.num_splits > 1 else ''}"
    if config.split_target:
      splits = (f"up to {splits} per row, each row's count from the rows' reachable keys at run "
                f"time for about {config.split_target} programs in all,")
    return (f"a decoding call (T={t} new rows x {n // kh} query heads per KV head = {config.rows} "
            f"rows in one {config.rows_padded}-row tile, S={call.seq_k} keys in {splits} of "
            f"{config.block_k}-key blocks); the backward is {config.backward}'s")

  def forward(self, q, k, v, *, scale, is_causal, config: DecodeLaunch, variant, arrays, table,
              interpret, block_table=None, seq_k=None):
    from ..masking import Variant
    if config.delegate_forward:
      return self._family(config).forward(
          q, k, v, scale=scale, is_causal=is_causal, config=config.backward_config,
          variant=variant, arrays=arrays, table=table, interpret=interpret)
    from .forward import forward
    variant = variant or Variant(is_causal=bool(is_causal))
    return forward(q, k, v, scale=scale, variant=variant, arrays=arrays, block_k=config.block_k,
                   num_splits=config.num_splits, rows_padded=config.rows_padded,
                   num_warps=config.config.num_warps, num_stages=config.config.num_stages,
                   interpret=interpret, block_table=block_table, seq_k=seq_k,
                   split_target=config.split_target)

  def differentiates_slopes(self, config: DecodeLaunch) -> bool:
    return self._family(config).differentiates_slopes(config.backward_config)

  def backward(self, q, k, v, out, stats, dout, *, dlse, scale, is_causal, deterministic,
               config: DecodeLaunch, variant, arrays, tables, interpret, slope_grad=False):
    return self._family(config).backward(
        q, k, v, out, stats, dout, dlse=dlse, scale=scale, is_causal=is_causal,
        deterministic=deterministic, config=config.backward_config, variant=variant,
        arrays=arrays, tables=tables, interpret=interpret, slope_grad=slope_grad)


DECODE = DecodeBackend()
