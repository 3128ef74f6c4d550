#!/usr/bin/env bash
# Session 9, device call 4 (nvidia-h200-x2), final check of the session's defaults:
#   GPU 0: the full compiled suite (pytest -m gpu);
#   GPU 1: the issue-5 cells the anchors' way beside cuDNN and tokamax (scripts/diag/anchor_method.py).
set -uo pipefail
export PYTHONPATH=$PWD:${PYTHONPATH:-}
out="${1:?OUTDIR}"
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh
( export CUDA_VISIBLE_DEVICES=0
  timeout 440 python3 -X faulthandler -m pytest -q -m gpu -p no:cacheprovider --tb=short \
    -o faulthandler_timeout=120 tests > "$out/pytest_gpu.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$out/pytest_gpu.txt" | tail -12 ) > "$out/gpu0.log" 2>&1 &
( export CUDA_VISIBLE_DEVICES=1
  timeout 440 python3 scripts/diag/anchor_method.py --json "$out/anchor_method.json" \
    > "$out/anchor_method.txt" 2>&1
  tail -12 "$out/anchor_method.txt" ) > "$out/gpu1.log" 2>&1 &
wait
cat "$out/gpu0.log" "$out/gpu1.log"
