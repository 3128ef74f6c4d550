"""Examples for fa2_jax (run from the repository root, e.g. ``python -m examples.flax_gpt.train``)."""
