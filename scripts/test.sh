#!/usr/bin/env bash
# Set up, then run the test suite. On CPU the Pallas kernels run in interpret mode and the tests marked
# `gpu` are deselected; on a GPU machine run `pytest -m gpu` (compiled kernels, bigger shapes) as well.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh "test,examples,bench"
. .venv/bin/activate
exec pytest -q -m "not gpu" --durations=15 "$@"
