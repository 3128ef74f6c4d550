"""Benchmarks of fa2_jax: throughput, ablation, numerics, memory and latency (see benchmarks/README.md).

Each module is a script (``python -m benchmarks.attention`` ...) with a ``--smoke`` mode that runs on the
CPU in Pallas interpret mode; ``python -m benchmarks.run_all`` runs them all under one time budget.
"""
