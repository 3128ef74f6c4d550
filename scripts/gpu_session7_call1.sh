#!/usr/bin/env bash
# Session 7, device call 1 (one H200): Mosaic GPU tests (transforms + correctness cases), the Mosaic tile
# sweep, and the first GPT Table-1 rows (flash with the default backend, cudnn).
set -uo pipefail
out="${1:?OUTDIR}"
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$out/gpu.txt"
t0=$(date +%s)
timeout 170 python3 -m pytest -q -m gpu tests/test_mosaic_gpu.py tests/test_attention.py -k mosaic \
  -p no:cacheprovider > "$out/pytest_mosaic.txt" 2>&1
echo "pytest rc=$? $(tail -1 $out/pytest_mosaic.txt) [$(( $(date +%s) - t0 ))s]"
timeout 250 python3 scripts/gpu_tune_mosaic.py --out "$out/tune_mosaic.json" --budget-s 210 \
  > "$out/tune_mosaic.log" 2>&1
echo "tune done [$(( $(date +%s) - t0 ))s]"
RUN_TIMEOUT=100 bash scripts/gpu_gpt_table1.sh "$out" single_min > "$out/gpt_single.txt" 2>&1
echo "=== summary [$(( $(date +%s) - t0 ))s]"
grep -E "passed|failed|Error" "$out/pytest_mosaic.txt" | tail -8
grep -v "^===" "$out/gpt_single.txt"
sed -n '/^h seq causal/,$p' "$out/tune_mosaic.log"
