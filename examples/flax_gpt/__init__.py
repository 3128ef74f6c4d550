"""A small GPT in flax.linen trained with fa2_jax FlashAttention: see README.md."""
