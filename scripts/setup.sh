#!/usr/bin/env bash
# Create .venv (Python >= 3.12) and install fa2_jax with the given extras, pinned by constraints.txt.
# Usage: bash scripts/setup.sh "test,examples,bench"
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-examples}"
py="${PYTHON:-python3.12}"
command -v "$py" >/dev/null 2>&1 || py=python3
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# On a GPU machine install the CUDA plugin too: pip install -c constraints.txt "jax[cuda13]==0.11.2"
python -m pip install -q -c constraints.txt -e ".[${extras}]"
