#!/usr/bin/env bash
# Session 7, device call 2 (one H200): why did the Mosaic path stall (compile-time scaling? a hang?),
# the Mosaic GPU tests with the tuned head_dim-64 tiles, and the GPT long8k row with the Mosaic default.
set -uo pipefail
out="${1:?OUTDIR}"
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh
t0=$(date +%s)
el() { echo "[$(( $(date +%s) - t0 ))s]"; }
timeout -s ABRT 130 python3 -X faulthandler scripts/diag/compile_time.py --impls mosaic,triton \
  --layers 1,3 > "$out/compile_time.txt" 2>&1; echo "compile diag rc=$? $(el)"
pt() {  # name, timeout, pytest args...
  local name="$1" to="$2"; shift 2
  timeout -s ABRT "$to" python3 -X faulthandler -m pytest -q -m gpu -p no:cacheprovider \
    -o faulthandler_timeout=50 --tb=short "$@" > "$out/pytest_$name.txt" 2>&1
  echo "pytest $name rc=$? $(tail -1 "$out/pytest_$name.txt") $(el)"
}
pt transforms 110 tests/test_mosaic_gpu.py
pt cases 150 tests/test_attention.py -k mosaic
RUN_TIMEOUT=170 bash scripts/gpu_gpt_table1.sh "$out" single_flash > "$out/gpt_single.txt" 2>&1
echo "gpt $(el)"
echo "=== summary"
cat "$out/compile_time.txt" | grep -v "^ *$" | tail -12
for f in transforms cases; do grep -E "^(FAILED|ERROR)|passed|failed|Timeout" "$out/pytest_$f.txt" | tail -6; done
grep -v "^===" "$out/gpt_single.txt"
grep -E "step [0-9]+:" "$out"/gpt_long8k_flash_1gpu.log | tail -3
