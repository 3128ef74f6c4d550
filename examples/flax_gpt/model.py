"""A nanoGPT-like decoder in flax.linen whose attention is fa2_jax FlashAttention.

Pre-LayerNorm blocks ``x + attn(ln(x))``, ``x + mlp(ln(x))``; learned or rotary positions; grouped-
query attention when ``n_kv_head < n_head``; optionally tied input/output embeddings; optionally a
sliding attention window (``config.window``) and soft-capped attention logits (``config.soft_cap``).
Packed sequences pass per-token ``segment_ids`` (attention stays inside each document) and
``positions``. Parameters are float32, matmuls run in ``config.dtype`` (bfloat16 on GPU), logits and
the loss in float32.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

import fa2_jax
import fa2_jax.flax as fa2_flax

from .config import GPTConfig
from .parallel import CONTEXT, LAYOUT, context_attention

INIT_STD = 0.02  # GPT-2's initializer standard deviation for weights and embeddings
# config.attention -> the ``implementation`` argument of fa2_jax.flash_attention (None: its default).
FLASH_IMPLEMENTATIONS = {"flash": None, "flash_triton": "triton", "flash_mosaic": "mosaic"}


def attention_core(config: GPTConfig, context_mesh: Mesh | None = None) -> Callable[..., jax.Array]:
  """The attention function ``f(q, k, v, is_causal=True, **variants)`` named by ``config.attention``.

  ``flash`` is fa2_jax with its default backend (the Mosaic kernels on Hopper, the Triton kernels on
  other GPUs; on CPU its XLA formula, or the kernels in Pallas interpret mode with
  ``flash_interpret``); ``flash_triton`` / ``flash_mosaic`` force one backend; ``xla`` and ``cudnn``
  are ``jax.nn.dot_product_attention``.

  ``context_mesh``: a mesh whose ``context`` axis splits the sequence (``--mesh``): the fa2_jax
  attention runs as context parallelism (:func:`.parallel.context_attention`,
  ``config.context_strategy``); ``jax.nn``'s is left to XLA's partitioning of the jit step.

  Raises:
    ValueError: ``cudnn`` without a GPU.
  """
  if config.attention.startswith("flash"):
    kernels = dict(implementation=FLASH_IMPLEMENTATIONS[config.attention],
                   interpret=True if config.flash_interpret else None)
    if context_mesh is not None:
      return context_attention(context_mesh, config.context_strategy, **kernels)
    return fa2_flax.make_attention_fn(**kernels)
  if config.attention == "cudnn" and jax.default_backend() != "gpu":
    raise ValueError(f"--attention cudnn needs an NVIDIA GPU, but JAX's backend is "
                     f"{jax.default_backend()!r}; use --attention flash or xla")
  # (jax.nn.dot_product_attention promotes half-precision inputs with float32 implicitly, forward
  # and backward: under jax_numpy_dtype_promotion="strict" these two run in float32 only.)
  return functools.partial(jax.nn.dot_product_attention, implementation=config.attention)


class MLP(nn.Module):
  """``Dense(mlp_ratio * d) -> GELU -> Dense(d)``."""

  config: GPTConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    dense = functools.partial(nn.Dense, dtype=c.dtype, param_dtype=jnp.float32)
    h = dense(c.mlp_ratio * c.n_embd, kernel_init=nn.initializers.normal(INIT_STD), name="fc")(x)
    h = nn.gelu(h)
    return dense(c.n_embd, kernel_init=_residual_init(c), name="proj")(h)


def _layer_norm(config: GPTConfig, name: str, x: jax.Array) -> jax.Array:
  """``nn.LayerNorm`` (inside the calling module). Flax (0.12.10) computes its statistics in
  ``promote_types(dtype, float32)``, which ``jax_numpy_dtype_promotion="strict"`` refuses for a
  bfloat16/float16 dtype: it runs under the standard promotion, the rest of the model under the
  user's setting."""
  with jax.numpy_dtype_promotion("standard"):
    return nn.LayerNorm(dtype=config.dtype, name=name)(x)


def _residual_init(config: GPTConfig):
  """GPT-2 scales the projections into the residual stream by 1/sqrt(2 * n_layer)."""
  return nn.initializers.normal(INIT_STD / math.sqrt(2 * config.n_layer))


class Block(nn.Module):
  """One pre-LayerNorm transformer block (``context_mesh``: as :class:`GPT`'s)."""

  config: GPTConfig
  context_mesh: Mesh | None = None

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None, cache: fa2_jax.KVCache | None = None,
               lengths: jax.Array | None = None):
    """``x -> x``; with ``cache`` (this layer's, decoding) ``x -> (x, new cache)``, ``lengths``
    the valid new tokens per row."""
    c = self.config
    attn = fa2_flax.CausalSelfAttention(
        num_heads=c.n_head, num_kv_heads=c.kv_heads, head_dim=c.head_dim,
        rotary=c.position == "rotary", use_bias=True, dtype=c.dtype, param_dtype=jnp.float32,
        kernel_init=nn.initializers.normal(INIT_STD), out_kernel_init=_residual_init(c),
        attention_fn=attention_core(c, self.context_mesh),
        local_window_size=None if c.window is None else (c.window, 0),
        logits_soft_cap=c.soft_cap, name="attn")
    h = _layer_norm(c, "ln_1", x)
    if cache is not None:
      y, cache = attn(h, positions, cache=cache, query_seq_lengths=lengths)
      x = x + y
      return x + MLP(c, name="mlp")(_layer_norm(c, "ln_2", x)), cache
    x = x + attn(h, positions, q_segment_ids=segment_ids, kv_segment_ids=segment_ids)
    return x + MLP(c, name="mlp")(_layer_norm(c, "ln_2", x))


class _ScanBlock(nn.Module):
  """``Block`` in ``nn.scan``'s ``(carry, x) -> (carry, y)`` form; positions, segment ids and
  lengths are broadcast to every layer, the cache (one per layer, stacked) is scanned."""

  config: GPTConfig
  context_mesh: Mesh | None = None

  @nn.compact
  def __call__(self, x: jax.Array, positions, segment_ids, cache=None, lengths=None):
    if cache is None:
      return Block(self.config, self.context_mesh, name="block")(x, positions, segment_ids), None
    return Block(self.config, name="block")(x, positions, cache=cache, lengths=lengths)


class GPT(nn.Module):
  """``tokens [B, T] int -> logits [B, T, vocab] float32``.

  ``positions`` ``[B, T]`` (default ``arange(T)``) index the learned position table or the rotary
  angles; ``segment_ids`` ``[B, T]`` (default: one segment) keep each token's attention inside its
  own segment (packed documents).

  Decoding (forward-only, the same parameters): ``cache`` (:func:`init_cache`: one
  ``fa2_jax.KVCache`` per layer) makes ``tokens`` the next ``T`` tokens of each batch row, at
  positions ``cache lengths + arange(T)`` (default); their keys and values are appended to the
  caches and the call returns ``(logits, new cache)``. ``lengths`` ``[B]`` (optional) counts each
  row's valid new tokens (left-aligned prompts of different lengths; the other rows' logits are
  meaningless). ``generate.py`` samples with it.

  ``context_mesh`` (training on a ``--mesh`` with ``context`` > 1): the batch's tokens arrive in
  the context layout (:data:`.parallel.LAYOUT`; default positions follow it) and the attention runs
  per device on the sequence-split arrays (:func:`.parallel.context_attention`); the parameters are
  the same.
  """

  config: GPTConfig
  context_mesh: Mesh | None = None

  @nn.compact
  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None, *, cache=None,
               lengths: jax.Array | None = None):
    c = self.config
    if tokens.shape[-1] > c.seq_len:
      raise ValueError(f"sequence length {tokens.shape[-1]} exceeds seq_len={c.seq_len}")
    for name, a in (("positions", positions), ("segment_ids", segment_ids)):
      if a is not None and a.shape != tokens.shape:
        raise ValueError(f"{name} must have the tokens' shape {tokens.shape}, got {a.shape}")
    if cache is not None:
      if segment_ids is not None:
        raise ValueError("segment_ids cannot be given with cache (decoding one sequence per row)")
      if tokens.ndim != 2:
        raise ValueError(f"with cache, tokens must be [batch, T], got shape {tokens.shape}")
      if positions is None:  # each row continues at its cache's length (every layer's is the same)
        held = (cache.lengths[0] if c.scan_layers else cache[0].lengths)
        positions = held[:, None] + jnp.arange(tokens.shape[-1], dtype=jnp.int32)[None, :]
    if positions is None and cache is None and self.context_mesh is not None:
      # The batch arrives in the context layout (parallel.MeshRunner.shard): the positions too.
      t = tokens.shape[-1]
      order = fa2_jax.to_context_layout(jnp.arange(t, dtype=jnp.int32)[None],
                                        self.context_mesh.shape[CONTEXT], layout=LAYOUT)
      positions = jnp.broadcast_to(order, tokens.shape)
    wte = nn.Embed(c.vocab_size, c.n_embd, embedding_init=nn.initializers.normal(INIT_STD),
                   dtype=c.dtype, name="wte")
    x = wte(tokens)
    if c.position == "learned":
      wpe = nn.Embed(c.seq_len, c.n_embd, embedding_init=nn.initializers.normal(INIT_STD),
                     dtype=c.dtype, name="wpe")
      pos = wpe(jnp.arange(tokens.shape[-1]) if positions is None else positions)
      x = x + jax.lax.broadcast_to_rank(pos, x.ndim)  # [T, C] for every sequence of the batch
    if cache is not None:
      x, cache = self._cached_blocks(x, positions, cache, lengths)
    elif c.scan_layers:
      body = nn.remat(_ScanBlock) if c.remat else _ScanBlock
      stack = nn.scan(body, variable_axes={"params": 0}, split_rngs={"params": True},
                      in_axes=(nn.broadcast, nn.broadcast), length=c.n_layer)
      x, _ = stack(c, self.context_mesh, name="h")(x, positions, segment_ids)
    else:
      block = nn.remat(Block) if c.remat else Block
      for i in range(c.n_layer):
        x = block(c, self.context_mesh, name=f"h_{i}")(x, positions, segment_ids)
    x = _layer_norm(c, "ln_f", x)
    if c.tie_embeddings:
      logits = wte.attend(x)
    else:
      logits = nn.Dense(c.vocab_size, use_bias=False, dtype=c.dtype,
                        kernel_init=nn.initializers.normal(INIT_STD), name="lm_head")(x)
    logits = logits.astype(jnp.float32)
    return logits if cache is None else (logits, cache)

  def _cached_blocks(self, x, positions, cache, lengths):
    """The blocks with their caches (no remat: decoding has no backward pass); the module names
    are the training path's, so the parameters are the same."""
    c = self.config
    if c.scan_layers:
      stack = nn.scan(_ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                      in_axes=(nn.broadcast, nn.broadcast, 0, nn.broadcast), length=c.n_layer)
      return stack(c, name="h")(x, positions, None, cache, lengths)
    if len(cache) != c.n_layer:
      raise ValueError(f"cache must hold one KVCache per layer ({c.n_layer}), got {len(cache)}")
    new = []
    for i in range(c.n_layer):
      x, layer_cache = Block(c, name=f"h_{i}")(x, positions, cache=cache[i], lengths=lengths)
      new.append(layer_cache)
    return x, tuple(new)


def init_cache(config: GPTConfig, batch: int, capacity: int | None = None):
  """Empty KV caches for :class:`GPT` decoding: a tuple of one ``fa2_jax.KVCache`` per layer
  (with ``scan_layers``, one KVCache whose arrays have a leading layer axis), ``capacity`` rows
  (default ``config.seq_len``) of the compute dtype."""
  one = fa2_jax.KVCache.create(batch, capacity or config.seq_len, config.kv_heads, config.head_dim,
                               dtype=config.dtype)
  if config.scan_layers:
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (config.n_layer, *a.shape)), one)
  return (one,) * config.n_layer


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy (nats) in float32."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


def cross_entropy_sum(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> jax.Array:
  """Next-token cross-entropy (nats, float32) summed over the tokens, each times its weight."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  return jnp.sum(weights.astype(jnp.float32) * nll)


def count_params(params) -> int:
  """Every parameter, embeddings included (the convention of the FLOP formula in metrics.py)."""
  return sum(x.size for x in jax.tree.leaves(params))
