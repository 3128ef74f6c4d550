"""Diagnostics for work on the kernels, each answering a question docs/design.md still asks
(``python -m benchmarks.diag.<name>``; benchmarks/README.md):

* ``ab``: this checkout against another version (or a config candidate) in one process;
* ``compile_time``: lower / compile seconds per call site and per new shape, kernel reuse and caches;
* ``registers``: registers and spills of the Mosaic kernels (ptxas' report).
"""
