"""Argument checks shared by every public entry point: each bad input gets a ValueError or TypeError
that names the argument."""
from __future__ import annotations

import dataclasses

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from . import dispatch
from .kernels import masking, registry

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


# logits_soft_cap bounds: the float32 kernels multiply by cap * log2(e) and scale / cap, which must stay
# normal numbers (float32 max 3.4e38, min normal 1.2e-38); a cap of 1e30 already leaves every logit
# unchanged, one of 1e-30 makes every logit 0. scale / cap above the max is bounded there
# (masking.soft_cap_factors), below the min normal refused (check_soft_cap_scale).
SOFT_CAP_RANGE = (1e-30, 1e30)
# alibi_slopes bound: the kernels fold scale * log2(e) into the slope in float32, which must stay finite
# (float32 max 3.4e38; log2(e) = 1.44); a slope of 1e30 already masks every pair but the diagonal.
ALIBI_SLOPE_MAX = 1e30

def check_bool(name, value):
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a Python bool, got {type(value).__name__} {value!r}")
  return bool(value)


def positive_int(name: str, value, *, extra: str = "") -> int:
  """``value`` as an int >= 1: a TypeError naming ``name`` for anything but an int (a bool, a float),
  a ValueError for one below 1; ``extra`` is appended to the requirement (e.g. " or None")."""
  if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a positive int{extra}, got {type(value).__name__} {value!r}")
  if value < 1:
    raise ValueError(f"{name} must be a positive int{extra}, got {value!r}")
  return int(value)


def is_static_dim(d) -> bool:
  return isinstance(d, (int, np.integer))


def check_soft_cap_scale(scale: float, cap: float | None) -> None:
  """ValueError when ``|scale| / cap`` is nonzero but below float32's smallest normal number: the
  kernels multiply each raw logit by that factor, which would flush to 0 (every logit 0)."""
  tiny = float(np.finfo(np.float32).tiny)
  if cap is not None and 0 < abs(scale) / cap < tiny:
    raise ValueError(
        f"scale / logits_soft_cap must be 0 or at least {tiny:.3g} in magnitude (the kernels fold "
        f"them into one float32 factor), got {scale:g} / {cap:g}; a cap that large against the "
        "scale leaves every logit of a normal size unchanged: leave logits_soft_cap unset")


def is_real_dtype(dtype) -> bool:
  """Integer or floating, bfloat16 included (numpy files bfloat16 under kind 'V'); not timedelta
  or datetime (which ``jnp.issubdtype`` counts as integers)."""
  return (np.dtype(dtype).kind not in "mM"
          and bool(jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)))


def _as_float(name: str, x) -> float:
  """``float(x)``; a ValueError naming ``name`` for a number past float's range (``10**400``)."""
  try:
    return float(x)
  except OverflowError:
    raise ValueError(f"{name} must be finite, got a number too large for a float "
                     f"({len(str(x))} characters long)") from None


def check_scale(scale):
  if scale is None:
    return None
  if isinstance(scale, jax.core.Tracer):
    raise TypeError("scale must be a static Python float, not a traced value")
  if isinstance(scale, (bool, np.bool_)):
    raise TypeError(f"scale must be a Python float or None, got {type(scale).__name__}")
  if isinstance(scale, (np.ndarray, jax.Array)):
    if scale.shape != ():
      raise TypeError(f"scale must be a scalar, got an array of shape {scale.shape}")
    if not is_real_dtype(scale.dtype):
      raise TypeError(f"scale must be a real number, got an array of dtype {scale.dtype}")
  elif not isinstance(scale, numbers.Real):
    raise TypeError(f"scale must be a Python float or None, got {type(scale).__name__} {scale!r}")
  scale = _as_float("scale", scale)
  if not math.isfinite(scale):
    raise ValueError(f"scale must be finite, got {scale}")
  return scale


def resolve_scale(scale, head_dim: int) -> float:
  """The softmax scale a call runs with: ``scale`` checked (:func:`check_scale`), None giving
  ``1 / sqrt(head_dim)``."""
  scale = check_scale(scale)
  return 1.0 / math.sqrt(head_dim) if scale is None else scale


def validate_qkv(query, key, value) -> None:
  """Shape, rank and dtype checks of the three arrays (shared with :func:`fa2_jax.reference_attention`)."""
  for name, x in (("query", query), ("key", key), ("value", value)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"{name} must be a jax/numpy array, got {type(x).__name__}")
  if query.ndim not in (3, 4):
    raise ValueError(f"query must have rank 4 [B, T, N, H] or rank 3 [T, N, H], got shape "
                     f"{tuple(query.shape)}")
  for name, x in (("key", key), ("value", value)):
    if x.ndim != query.ndim:
      raise ValueError(f"{name} must have the same rank as query ({query.ndim}: "
                       f"{'[B, S, K, H]' if query.ndim == 4 else '[S, K, H]'}), got shape "
                       f"{tuple(x.shape)}")
  dtypes = {jnp.dtype(x.dtype) for x in (query, key, value)}
  if len(dtypes) != 1:  # a ValueError, as jax.nn.dot_product_attention raises for it
    raise ValueError(f"query, key and value must share one dtype, got {query.dtype}, {key.dtype}, "
                     f"{value.dtype}")
  if jnp.dtype(query.dtype) not in DTYPES + (jnp.dtype(jnp.float64),):
    raise TypeError(f"query/key/value dtype must be bfloat16, float16 or float32, got {query.dtype}")
  q4 = query.shape if query.ndim == 4 else (1, *query.shape)
  k4 = key.shape if key.ndim == 4 else (1, *key.shape)
  v4 = value.shape if value.ndim == 4 else (1, *value.shape)
  b, _, n, h = q4
  # value's head_dim Hv may differ from the query/key head_dim H (multi-head latent attention, e.g.
  # DeepSeek-V2: H = 192, Hv = 128); B, S and K must match key's.
  if k4[:3] != v4[:3]:
    raise ValueError(f"key and value must have the same [B, S, K] (value: [B, S, K, Hv], Hv may "
                     f"differ from key's H), got {tuple(key.shape)} and {tuple(value.shape)}")
  if k4[0] != b:
    raise ValueError(f"key/value batch size {k4[0]} does not match query batch size {b}")
  if k4[3] != h:
    raise ValueError(f"key head_dim {k4[3]} does not match query head_dim {h}")
  kh = k4[2]
  if is_static_dim(n) and is_static_dim(kh) and (n < 1 or kh < 1 or n % kh != 0):
    raise ValueError(f"the query head count N={n} must be a positive multiple of the key/value "
                     f"head count K={kh} (K < N is GQA, K == 1 is MQA)")
  if is_static_dim(h) and h < 1:
    raise ValueError(f"head_dim must be >= 1, got {h}")
  if is_static_dim(v4[3]) and v4[3] < 1:
    raise ValueError(f"value head_dim must be >= 1, got {v4[3]}")


def check_no_dense(bias, mask) -> None:
  """``bias`` and ``mask`` (``jax.nn.dot_product_attention``'s dense arrays) must be None: a
  ValueError naming what to pass instead otherwise."""
  if bias is not None:
    raise ValueError(
        "bias: flash_attention takes no dense bias array (its kernels never form the [B, N, T, S] "
        "logits); pass bias=None and give the bias as alibi_slopes, logits_soft_cap or "
        "score_fn(score, b, h, q_idx, kv_idx) (a function of the score and its indices), or call "
        "jax.nn.dot_product_attention for a dense bias")
  if mask is not None:
    raise ValueError(
        "mask: flash_attention takes no dense mask array (its kernels never form the [B, N, T, S] "
        "logits); pass mask=None and give the mask by its structure: is_causal, "
        "query_seq_lengths/key_value_seq_lengths (padding), local_window_size, "
        "q_segment_ids/kv_segment_ids (packed documents) or mask_fn(b, h, q_idx, kv_idx), or call "
        "jax.nn.dot_product_attention for a dense mask")


def check_options(implementation, block_sizes) -> None:
  """Validate the array-independent options (shared with the Flax adapter's factory)."""
  if implementation not in dispatch.implementations():
    raise ValueError("implementation must be one of "
                     f"{', '.join(map(repr, dispatch.implementations()))}, got {implementation!r}")
  if block_sizes is None:
    return
  family = registry.for_config(block_sizes)
  if family is None:
    kinds = ", ".join(f"a fa2_jax.{b.config_type.__name__} ({b.name} kernels)"
                      for b in registry.backends())
    raise TypeError(f"block_sizes must be {kinds} or None, got {type(block_sizes).__name__}")
  if implementation == "xla":
    raise TypeError(f"block_sizes is a {type(block_sizes).__name__}, which configures the "
                    f"{family.name} kernels; implementation='xla' runs the formula, which has no "
                    "tiles")
  if implementation is not None and registry.get(implementation) is not family:
    theirs = registry.get(implementation)
    raise TypeError(f"block_sizes is a {type(block_sizes).__name__}, which configures the "
                    f"{family.name} kernels; implementation={implementation!r} takes a "
                    f"fa2_jax.{theirs.config_type.__name__}")


# --- attention variants ---------------------------------------------------------------------------

def _is_tracer(x) -> bool:
  return isinstance(x, jax.core.Tracer)


def _concrete(x):
  """A numpy copy of ``x`` when its values are known now (not traced, not a ShapeDtypeStruct)."""
  if isinstance(x, (np.ndarray, np.generic)) or (isinstance(x, jax.Array) and not _is_tracer(x)):
    return np.asarray(x)
  return None


def _int_array(name, x, clip=None, clip_int32=True):
  """``x`` as an int32 array (Python ints accepted); TypeError naming ``name`` otherwise.

  ``clip=(lo, hi)``: values are clipped to ``[lo, hi]`` in their own dtype before the cast, so that a
  traced value outside int32 (an int64 under x64) or near its ends cannot wrap (the value checks
  only see concrete arrays); with ``clip_int32=False`` an int32 array is left as given (no cast can
  wrap it: :func:`kernels.masking.clip_ranges` clips it later, or the kernel itself)."""
  if isinstance(x, (bool, np.bool_)):
    raise TypeError(f"{name} must be an integer array, got a bool")
  if isinstance(x, (int, np.integer)):
    if not -2 ** 31 <= int(x) < 2 ** 31:
      raise ValueError(f"{name} must fit int32, got {x}")
    return jnp.asarray(x, jnp.int32)
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name} must be an integer array, got {type(x).__name__}")
  if np.dtype(x.dtype).kind not in "iu":
    raise TypeError(f"{name} must have an integer dtype, got {x.dtype}")
  if isinstance(x, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(x.shape, jnp.int32)
  x = jnp.asarray(x)
  if clip is not None and (clip_int32 or x.dtype != jnp.int32):
    info = jnp.iinfo(x.dtype)
    lo, hi = max(clip[0], int(info.min)), min(clip[1], int(info.max))
    x = jnp.clip(x, jnp.asarray(lo, x.dtype), jnp.asarray(hi, x.dtype))
  return x.astype(jnp.int32)


def _shape_str(shape) -> str:
  return "[" + ", ".join(map(str, shape)) + "]"


def _sequence_array(name, x):
  """A list or tuple as the array it makes (as ``jax.nn.dot_product_attention`` takes them): a
  ``jnp`` array where an element is a jax array (traced or on a device), else a numpy one (values
  still checked); ``[]`` as int32; a ragged one is a ValueError naming ``name``."""
  if any(isinstance(e, jax.Array) for e in jax.tree.leaves(x)):
    return jnp.asarray(x)
  try:
    arr = np.asarray(x)
  except ValueError as e:  # ragged
    raise ValueError(f"{name} must be an integer array, got a {type(x).__name__} that is not "
                     f"one: {e}") from None
  return arr.astype(np.int32) if arr.size == 0 and arr.dtype.kind == "f" else arr


def _check_lengths(name, x, b, limit, rank3: bool, clip_int32: bool = True):
  """Lengths: integer ``[B]`` (rank-3 call: scalar or ``[1]``), values in ``[0, limit]`` when known.
  A list or tuple counts as the array it makes (as in ``jax.nn.dot_product_attention``); a numeric
  dtype that is not an integer one (float, bool, complex) is a ValueError, as there."""
  if isinstance(x, (list, tuple)):
    x = _sequence_array(name, x)
  elif isinstance(x, (bool, np.bool_)):
    x = np.asarray(x)
  if hasattr(x, "dtype") and not isinstance(x, type) and (
      np.dtype(x.dtype).kind in "fcb" or jnp.issubdtype(x.dtype, jnp.floating)):
    raise ValueError(f"{name} must have an integer dtype (jax.nn.dot_product_attention: int32), got "
                     f"{x.dtype}")
  raw = x
  x = _int_array(name, x, clip=(0, limit) if is_static_dim(limit) else None, clip_int32=clip_int32)
  want = [(b,)] + ([()] if rank3 else [])
  if tuple(x.shape) not in want:
    raise ValueError(f"{name} must have shape {_shape_str((b,))}" + (" or be a scalar" if rank3 else "")
                     + f", got {_shape_str(x.shape)}")
  values = _concrete(raw) if not isinstance(raw, (int, np.integer)) else np.asarray(raw)
  if values is not None and values.size and is_static_dim(limit) and (
      values.min() < 0 or values.max() > limit):
    raise ValueError(f"{name} must lie in [0, {limit}], got values in [{values.min()}, "
                     f"{values.max()}]")
  return x.reshape(b) if not isinstance(x, jax.ShapeDtypeStruct) else x


def _check_segments(name, x, b, length, rank3: bool):
  """Segment ids: integer ``[B, L]`` (rank-3 call: ``[L]`` too) -> ``(int32 [B, L], ranked,
  values)``: ``ranked`` when the ids' dtype can hold values past int32 (64-bit, uint32) and they are
  not known to fit it (traced, or concrete and outside): the caller then replaces both sides by their
  joint ranks (:func:`_rank_segments`), which a plain cast would wrap (``2**32`` equal to ``0``).
  ``values``: the host copy such ids were checked on (None when traced or not wide), which the
  ranking reuses."""
  if isinstance(x, (list, tuple)):
    x = _sequence_array(name, x)
  raw = x
  x = _int_array(name, x)
  want = [(b, length)] + ([(length,)] if rank3 else [])
  if tuple(x.shape) not in want:
    raise ValueError(f"{name} must have shape {_shape_str((b, length))}"
                     + (f" or {_shape_str((length,))}" if rank3 else "")
                     + f", got {_shape_str(x.shape)}")
  if isinstance(x, jax.ShapeDtypeStruct):
    return x, False, None
  wide = np.dtype(raw.dtype).itemsize > 4 or np.dtype(raw.dtype) == np.uint32
  values = _concrete(raw) if wide else None
  fits = not wide or (values is not None and (
      not values.size or (values.min() >= -2 ** 31 and values.max() < 2 ** 31)))
  return x.reshape(b, length), not fits, values


def _rank_segments(q_ids, kv_ids, b: int, t: int, s: int, q_raw=None, kv_raw=None):
  """Both sides' segment ids replaced by their ranks among the ids of their batch row (``[B, T]``,
  ``[B, S]`` int32 in ``[0, T + S)``): equal ids stay equal and order is kept (the kernels' block
  ranges read per-block minima and maxima), so 64-bit ids past int32 keep their meaning. Concrete
  ids are ranked on the host, traced ones in the program; ``q_raw``/``kv_raw``: host copies already
  taken (:func:`_check_segments`), else taken here."""
  q_raw = _concrete(q_ids) if q_raw is None else q_raw
  kv_raw = _concrete(kv_ids) if kv_raw is None else kv_raw
  host = q_raw is not None and kv_raw is not None
  dtypes = (np.dtype(q_ids.dtype), np.dtype(kv_ids.dtype))
  common = np.promote_types(*dtypes)
  if common.kind not in "iu" or (not host and jax.dtypes.canonicalize_dtype(common) != common):
    raise TypeError(f"q_segment_ids ({dtypes[0]}) and kv_segment_ids ({dtypes[1]}) have no common "
                    "integer dtype here (uint64 beside a signed dtype, or 64 bits with x64 off): "
                    "pass both signed or both unsigned")
  xp = np if host else jnp
  if host:
    q_ids, kv_ids = q_raw, kv_raw
  ids = xp.concatenate([xp.broadcast_to(q_ids.reshape(-1, t), (b, t)).astype(common),
                        xp.broadcast_to(kv_ids.reshape(-1, s), (b, s)).astype(common)], axis=1)
  if host:
    ranks = np.stack([np.searchsorted(np.sort(row), row) for row in ids]).astype(np.int32)
  else:
    ranks = jax.vmap(jnp.searchsorted)(jnp.sort(ids, axis=1), ids).astype(jnp.int32)
  ranks = jnp.asarray(ranks)
  return ranks[:, :t], ranks[:, t:]


def check_window(window):
  """``local_window_size`` -> ``(left, right)`` (None sides unbounded) or None."""
  if window is None:
    return None
  if isinstance(window, (tuple, list)):
    if len(window) != 2:
      raise ValueError(f"local_window_size must be an int or a (left, right) pair, got "
                       f"{len(window)} values {tuple(window)!r}")
    sides = tuple(window)
  else:
    sides = (window, window)
  out = []
  for side in sides:
    if side is None:
      out.append(None)
      continue
    if isinstance(side, (bool, np.bool_)) or not isinstance(side, (int, np.integer)):
      raise TypeError(f"local_window_size must hold Python ints >= 0 or None, got "
                      f"{type(side).__name__} {side!r}")
    if side < 0:
      raise ValueError(f"local_window_size sides must be >= 0 (None for unbounded), got {side}")
    if side >= masking.INT32_SAFE:
      raise ValueError(f"local_window_size sides must be < 2**30 (None for unbounded), got {side}")
    out.append(int(side))
  return None if out == [None, None] else tuple(out)


def check_soft_cap(cap):
  """``logits_soft_cap`` -> a float > 0 or None (a static Python number; traced values are refused)."""
  if cap is None:
    return None
  if _is_tracer(cap):
    raise TypeError("logits_soft_cap must be a static Python float, not a traced value")
  if isinstance(cap, (bool, np.bool_)) or not isinstance(cap, (numbers.Real, np.ndarray, jax.Array)):
    raise TypeError(f"logits_soft_cap must be a Python float or None, got {type(cap).__name__}")
  if isinstance(cap, (np.ndarray, jax.Array)):
    if cap.shape != () or not is_real_dtype(cap.dtype):
      raise TypeError(f"logits_soft_cap must be a real scalar, got an array of shape {cap.shape} "
                      f"and dtype {cap.dtype}")
  cap = _as_float("logits_soft_cap", cap)
  if not math.isfinite(cap) or cap <= 0:
    raise ValueError(f"logits_soft_cap must be finite and > 0, got {cap}")
  if not SOFT_CAP_RANGE[0] <= cap <= SOFT_CAP_RANGE[1]:
    raise ValueError(f"logits_soft_cap must be in [{SOFT_CAP_RANGE[0]:g}, {SOFT_CAP_RANGE[1]:g}] (the "
                     f"kernels compute cap * log2(e) and scale / cap in float32), got {cap:g}")
  return cap


def _check_q_offset(q_offset, b, rank3: bool, clip_int32: bool = True):
  """``q_offset`` -> int32 ``[B]``, or None for a static 0."""
  if q_offset is None:
    return None
  if isinstance(q_offset, (int, np.integer)) and not isinstance(q_offset, (bool, np.bool_)):
    if abs(int(q_offset)) >= masking.INT32_SAFE:
      raise ValueError(f"q_offset must satisfy |q_offset| < 2**30, got {q_offset}")
    return None if int(q_offset) == 0 else jnp.full((b,), int(q_offset), jnp.int32)
  if isinstance(q_offset, (list, tuple)):
    q_offset = _sequence_array("q_offset", q_offset)
  raw = q_offset
  # A traced offset acts as clipped to masking.OFFSET_RANGE (here, masking.clip_ranges or the kernel).
  x = _int_array("q_offset", q_offset, clip=masking.OFFSET_RANGE, clip_int32=clip_int32)
  del rank3  # a scalar (e.g. a traced decoding position) serves every batch element
  if tuple(x.shape) not in [(b,), ()]:
    raise ValueError(f"q_offset must be an int, an integer scalar or an integer array of shape "
                     f"{_shape_str((b,))}, got shape {_shape_str(x.shape)}")
  values = _concrete(raw)
  if values is not None and values.size and np.abs(values.astype(np.int64)).max() >= masking.INT32_SAFE:
    raise ValueError(f"q_offset must satisfy |q_offset| < 2**30, got {values}")
  if isinstance(x, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct((b,), x.dtype)
  return jnp.broadcast_to(x, (b,))


def _check_alibi(slopes, b, n, rank3: bool):
  if not hasattr(slopes, "shape") or not hasattr(slopes, "dtype"):
    raise TypeError(f"alibi_slopes must be a float array of shape [N] or [B, N], got "
                    f"{type(slopes).__name__}")
  if not jnp.issubdtype(slopes.dtype, jnp.floating):
    raise TypeError(f"alibi_slopes must have a floating dtype, got {slopes.dtype}")
  if tuple(slopes.shape) not in ((n,), (b, n)):
    raise ValueError(f"alibi_slopes must have shape {_shape_str((n,))} or {_shape_str((b, n))}, got "
                     f"{_shape_str(slopes.shape)}")
  values = _concrete(slopes)
  if values is not None and not np.all(np.isfinite(values.astype(np.float64))):
    raise ValueError("alibi_slopes must be finite")
  if values is not None and values.size and np.abs(values.astype(np.float64)).max() > ALIBI_SLOPE_MAX:
    raise ValueError(f"alibi_slopes must satisfy |slope| <= {ALIBI_SLOPE_MAX:g} (the kernels multiply "
                     f"it by the softmax scale and log2(e) in float32), got "
                     f"{np.abs(values.astype(np.float64)).max():g}")
  if isinstance(slopes, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct((b, n), jnp.float32)
  return jnp.broadcast_to(jnp.asarray(slopes).astype(jnp.float32), (b, n))


def _trace_user_fn(name, fn, make_args, check_out):
  """Trace ``fn`` on one pair (scalar int32 indices: every path calls it so, masking.per_pair);
  TypeError naming ``name`` with the cause when it fails, then ``check_out(out)``."""
  args = make_args([jax.ShapeDtypeStruct((), jnp.int32)] * 4)
  try:
    out = jax.eval_shape(fn, *args)
  except Exception as e:  # noqa: BLE001  any failure of user code at trace time
    raise TypeError(f"{name} could not be traced on one pair (it is called per pair, with scalar "
                    f"int32 indices b, h, q_idx, kv_idx): {type(e).__name__}: {e}") from e
  if not isinstance(out, jax.ShapeDtypeStruct):
    raise TypeError(f"{name} must return one array, got {type(out).__name__}")
  check_out(out)


def check_variant(query, key, *, is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
                  local_window_size=None, q_segment_ids=None, kv_segment_ids=None, q_offset=None,
                  logits_soft_cap=None, alibi_slopes=None, mask_fn=None, score_fn=None,
                  clip_int32=True):
  """Validate and normalise the variant arguments of a call whose ``query``/``key`` passed
  :func:`validate_qkv` (rank 3 or 4) -> ``(masking.Variant, masking.VariantArrays)`` (arrays at rank 4).

  Value checks (lengths in range, offsets and slopes bounded) run only on concrete arrays; traced
  values cannot be checked (lengths behave as if clipped to ``[0, T]`` / ``[0, S]``, offsets to
  ``masking.OFFSET_RANGE``). ``clip_int32=False``: int32 lengths and offsets are returned as given,
  for ``masking.clip_ranges`` or a kernel that clips them itself (other dtypes are clipped before
  their cast, which could wrap them)."""
  rank3 = query.ndim == 3
  q4 = (1, *query.shape) if rank3 else tuple(query.shape)
  k4 = (1, *key.shape) if rank3 else tuple(key.shape)
  b, t, n, _ = q4
  s = k4[1]
  is_causal = bool(is_causal)
  q_len = kv_len = q_seg = kv_seg = offset = slopes = None
  if query_seq_lengths is not None:
    q_len = _check_lengths("query_seq_lengths", query_seq_lengths, b, t, rank3, clip_int32)
  if key_value_seq_lengths is not None:
    kv_len = _check_lengths("key_value_seq_lengths", key_value_seq_lengths, b, s, rank3, clip_int32)
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("q_segment_ids and kv_segment_ids must be given together (both or neither)")
  if q_segment_ids is not None:
    q_seg, q_wide, q_host = _check_segments("q_segment_ids", q_segment_ids, b, t, rank3)
    kv_seg, kv_wide, kv_host = _check_segments("kv_segment_ids", kv_segment_ids, b, s, rank3)
    if q_wide or kv_wide:
      q_seg, kv_seg = _rank_segments(q_segment_ids, kv_segment_ids, b, t, s, q_host, kv_host)
  window = check_window(local_window_size)
  cap = check_soft_cap(logits_soft_cap)
  if alibi_slopes is not None:
    slopes = _check_alibi(alibi_slopes, b, n, rank3)
  for name, fn in (("mask_fn", mask_fn), ("score_fn", score_fn)):
    if fn is not None and not callable(fn):
      raise TypeError(f"{name} must be a callable or None, got {type(fn).__name__}")
  offset = _check_q_offset(q_offset, b, rank3, clip_int32)
  positional = (is_causal or window is not None or slopes is not None or mask_fn is not None
                or score_fn is not None)
  if not positional:
    offset = None  # q_offset only moves positions, which nothing here reads
  variant = masking.Variant(
      is_causal=is_causal, window=window, has_q_lengths=q_len is not None,
      has_kv_lengths=kv_len is not None, has_segments=q_seg is not None,
      has_q_offset=offset is not None, soft_cap=cap, has_alibi=slopes is not None, mask_fn=mask_fn,
      score_fn=score_fn)
  arrays = masking.VariantArrays(q_len, kv_len, q_seg, kv_seg, offset, slopes)

  # The user functions, traced on one pair: every path calls them per pair, with scalars
  # (masking.per_pair), so a function that is not elementwise means the same everywhere.
  if mask_fn is not None:
    def check_mask(out):
      if out.dtype != jnp.bool_:
        raise TypeError(f"mask_fn must return a bool array, got dtype {out.dtype}")
      if out.shape != ():
        raise ValueError(f"mask_fn must return one bool per pair (a scalar: it is called with scalar "
                         f"indices), got shape {_shape_str(out.shape)}")
    _trace_user_fn("mask_fn", mask_fn, lambda a: a, check_mask)
  if score_fn is not None:
    def check_score(out):
      if not jnp.issubdtype(out.dtype, jnp.floating):
        raise TypeError(f"score_fn must return a floating array, got dtype {out.dtype}")
      if out.shape != ():
        raise ValueError(f"score_fn must return one score per pair (a scalar: it is called with a "
                         f"scalar score and indices), got shape {_shape_str(out.shape)}")
    _trace_user_fn("score_fn", score_fn, lambda a: [jax.ShapeDtypeStruct((), jnp.float32), *a],
                   check_score)
  if mask_fn is not None or score_fn is not None:  # checked: now what they compute, for the caches
    variant = dataclasses.replace(variant, functions=masking.functions_fingerprint(mask_fn, score_fn))
  return variant, arrays
