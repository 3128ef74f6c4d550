"""Benchmarks of fa2_jax: throughput, attention variants, latency, memory, numerics (benchmarks/README.md).

Each script (``python -m benchmarks.attention`` ...) runs on the one harness (harness.py, timing.py,
impls.py) and has a ``--smoke`` size that runs on the CPU in Pallas interpret mode;
``python -m benchmarks.run_all`` runs several under one time budget.
"""
