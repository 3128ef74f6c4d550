"""Diagnostics of fa2_jax's kernels on a GPU (each a script: ``python -m benchmarks.diag.<name>``):

* ``kernel_times``: the Mosaic forward, backward and its XLA prologue timed on their own, beside cuDNN;
* ``compile_time``: lower / compile seconds of ``jit(grad)`` with 1, 2, 4 ... attention calls;
* ``profile``: one steady-state forward+backward per implementation, to run under ``ncu``.
"""
