"""Flax integration: an ``attention_fn`` for flax's attention layers, and (from :mod:`fa2_jax.flax.layers`)
ready causal modules.

Flax is an optional dependency; importing :mod:`fa2_jax` does not import it, this module does::

    import flax.linen as nn
    from flax import nnx
    import fa2_jax.flax as fa2_flax

    # Drop-in for flax's own layers (same arguments, same layout [batch..., length, heads, head_dim]):
    nn.MultiHeadDotProductAttention(num_heads=8, attention_fn=fa2_flax.attention_fn)
    nnx.MultiHeadAttention(8, 512, attention_fn=fa2_flax.attention_fn, rngs=nnx.Rngs(0))
    # linen's layer has no ``is_causal`` argument, so ask for causal attention in the function:
    nn.MultiHeadDotProductAttention(num_heads=8,
                                    attention_fn=fa2_flax.make_attention_fn(is_causal=True))

    # Or a causal self-attention block with GQA and rotary embeddings:
    fa2_flax.CausalSelfAttention(num_heads=8, num_kv_heads=2, head_dim=64, rotary=True)
    fa2_flax.NnxCausalSelfAttention(512, num_heads=8, num_kv_heads=2, head_dim=64, rngs=nnx.Rngs(0))

The attention variants of :func:`fa2_jax.flash_attention` reach it through the adapters: the static
ones (``local_window_size``, ``logits_soft_cap``, ``alibi_slopes``, ``mask_fn``, ``score_fn``) as
arguments of :func:`make_attention_fn` (or fields of the modules), the per-batch arrays
(``query_seq_lengths``, ``key_value_seq_lengths``, ``q_segment_ids``, ``kv_segment_ids``,
``q_offset``, and ``alibi_slopes`` per batch element) as keyword arguments of each call::

    fn = fa2_flax.make_attention_fn(is_causal=True, local_window_size=(256, 0), logits_soft_cap=30.0)
    out = fn(q, k, v, q_segment_ids=seg, kv_segment_ids=seg)   # packed documents, [batch..., T]
    block = fa2_flax.CausalSelfAttention(num_heads=8, head_dim=64, local_window_size=(256, 0))
    y = block.apply(params, x, positions=pos, q_segment_ids=seg, kv_segment_ids=seg)

The kernel never sees a dense ``[T, S]`` mask: causal masking is the ``is_causal`` flag, padding and
packed documents are lengths and segment ids. A ``mask`` whose values are known while tracing (a
concrete array, not one computed inside ``jax.jit``) and that provably equals no mask or the causal
mask (e.g. ``nn.make_causal_mask(x)`` built eagerly, or a padding mask without padding) is replaced
by the flag and runs the kernel. Calls the kernel cannot honour exactly (any other mask: padding, a
``decode=True`` cache, a traced mask; a ``bias``, attention dropout, ``sow_weights``, custom einsums,
float64) are computed with flax's own ``dot_product_attention`` instead, after a
:class:`FlashAttentionFallbackWarning` (at the caller's line; Python's default filter shows it once
per reason and line) that names what to pass to run the kernel, where such an argument exists: the
math never changes silently. A value head_dim other than the query's runs the kernels (flax's own
formula refuses it).
Fully masked query rows (padding) are finite, never NaN: flax's value (the mean of V) on flax's
formula. flax's formula has no variants: such a call with variant arguments and a dense mask (and
nothing else the kernel lacks) runs fa2_jax's own XLA formula with the mask as a ``mask_fn`` (the same
warning), where a fully masked row is zero, as in the kernels; with a bias, dropout or the other
reasons it raises a ValueError instead of dropping the variant.
"""
from __future__ import annotations

from .attention import (FlashAttentionFallbackWarning, FlashAttentionFn, TopLeftQueryRowWarning,
                             attention_fn, make_attention_fn)
from .layers import CausalSelfAttention, NnxCausalSelfAttention, rotary_embedding

__all__ = [
    "attention_fn", "make_attention_fn", "FlashAttentionFn", "FlashAttentionFallbackWarning",
    "TopLeftQueryRowWarning",
    "rotary_embedding", "CausalSelfAttention", "NnxCausalSelfAttention",
]
