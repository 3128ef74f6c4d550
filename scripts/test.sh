#!/usr/bin/env bash
# Set up, then run the test suite. On CPU the Pallas kernels run in interpret mode and the tests marked
# `gpu` are deselected; on a GPU machine `bash scripts/gpu.sh tests` runs them (compiled kernels, bigger
# shapes); scripts/gpu.sh also runs the benchmarks there.
# The tests marked `slow` are deselected too (CI's default set, to fit its 20 minutes on a 2-core
# machine): CPU cases whose kernels and code paths other tests in the default set run as well (each
# says which). The full CPU suite, slow tests included (pytest takes the last -m given):
#   bash scripts/test.sh -m "not gpu"
# and the slow tests alone: bash scripts/test.sh -m "slow and not gpu".
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh "test,examples,bench"
. .venv/bin/activate
# XLA's CPU backend without LLVM optimisation (its HLO passes still run): the tests compile many small
# interpret-mode programs, and compiling them dominates; this cuts the suite's CPU time by about 40%
# (docs/design.md, Tests). It does not reach the GPU: scripts/gpu.sh runs pytest itself.
export XLA_FLAGS="--xla_backend_optimization_level=0${XLA_FLAGS:+ $XLA_FLAGS}"
# Two worker processes (pytest-xdist; the CI machine has 2 cores): the interpret-mode kernels are
# CPU-bound and single-threaded; idle workers take queued tests from busy ones (worksteal).
exec pytest -q -n "${FA2_TEST_WORKERS:-2}" --dist worksteal -m "not gpu and not slow" --durations=15 "$@"
