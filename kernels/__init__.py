"""The kernel families and what they share (installed as ``fa2_jax.kernels``; imports nothing from
``fa2_jax``).

``backend.py``: the interface a family implements; ``registry.py``: the families in the order
``implementation=None`` tries them. ``decode/``: split-KV forward for a few new rows against a long
cache (Pallas Triton). ``sm90/``: Hopper's Mosaic GPU kernels (wgmma, TMA). ``triton/``: the portable
Pallas Triton kernels (every GPU; interpret mode on CPU). ``masking.py`` and ``block_ranges.py``: the
one mask rule and the tile ranges it gives; ``softmax.py``: the row statistics.
"""
