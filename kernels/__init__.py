"""Pallas kernel bodies and their pallas_call builders (installed as ``fa2_jax.kernels``).

``triton/``: the portable Triton backend (A100 = sm80 and newer; runs in interpret mode on CPU).
``mosaic/``: the Hopper (sm90) backend on Pallas Mosaic GPU (the default on sm90+ for the calls it supports).
"""
