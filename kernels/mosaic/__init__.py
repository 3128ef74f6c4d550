"""Hopper backend on Pallas Mosaic GPU (wgmma, TMA, warpgroups): not written yet.

``fa2_jax.flash_attention(..., implementation="mosaic")`` raises a ValueError saying so; the default
``implementation=None`` uses the Triton backend on every GPU meanwhile.
"""
AVAILABLE = False
