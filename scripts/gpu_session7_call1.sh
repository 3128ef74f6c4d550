#!/usr/bin/env bash
# Session 7, device call 1 (nvidia-h200-x2): Mosaic GPU tests (both GPUs), then in parallel the GPT
# Table-1 rows (GPU 0) and the Mosaic tile sweep + Mosaic correctness cases (GPU 1), then GPT pmap.
set -uo pipefail
out="${1:?OUTDIR}"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
  || { ln -sfn ../kernels fa2_jax/kernels; export PYTHONPATH=$PWD:${PYTHONPATH:-}; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$out/gpu.txt"
t0=$(date +%s)
timeout 150 python3 -m pytest -q -m gpu tests/test_mosaic_gpu.py -p no:cacheprovider \
  > "$out/pytest_mosaic_transforms.txt" 2>&1
echo "transforms pytest rc=$? $(tail -1 $out/pytest_mosaic_transforms.txt) [$(( $(date +%s) - t0 ))s]"
( CUDA_VISIBLE_DEVICES=0 bash scripts/gpu_gpt_table1.sh "$out" single > "$out/gpt_single.txt" 2>&1 ) &
p0=$!
( export CUDA_VISIBLE_DEVICES=1
  timeout 100 python3 -m pytest -q -m gpu tests/test_attention.py -k mosaic -p no:cacheprovider \
    > "$out/pytest_mosaic_cases.txt" 2>&1
  echo "cases rc=$?" >> "$out/pytest_mosaic_cases.txt"
  timeout 290 python3 scripts/gpu_tune_mosaic.py --out "$out/tune_mosaic.json" --budget-s 240 \
    > "$out/tune_mosaic.log" 2>&1 ) &
p1=$!
wait $p0; echo "gpt single done [$(( $(date +%s) - t0 ))s]"; wait $p1
echo "tune done [$(( $(date +%s) - t0 ))s]"
left=$(( 560 - ($(date +%s) - t0) ))
if [ $left -gt 100 ]; then bash scripts/gpu_gpt_table1.sh "$out" pmap > "$out/gpt_pmap.txt" 2>&1; fi
echo "=== summary [$(( $(date +%s) - t0 ))s]"
tail -3 "$out/pytest_mosaic_transforms.txt"; tail -4 "$out/pytest_mosaic_cases.txt"
cat "$out/gpt_single.txt" "$out/gpt_pmap.txt" 2>/dev/null | grep -v "^===" 
sed -n '/^h seq causal/,$p' "$out/tune_mosaic.log"
