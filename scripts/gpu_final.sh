#!/usr/bin/env bash
# One device call on nvidia-h200-x2: the benchmark harness (one GPU) and the GPT example
# (one GPU, then pmap over both). Usage: bash scripts/gpu_final.sh OUTDIR BENCH_BUDGET_S
set -uo pipefail
out="${1:?OUTDIR}"; budget="${2:-420}"
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$out/gpu.txt"
CUDA_VISIBLE_DEVICES=0 timeout $((budget + 60)) python3 -m benchmarks.run_all --quick \
  --budget-s "$budget" --out benchmarks/results/h200 --archive "$out/bench_h200.tar.gz" \
  > "$out/run_all.log" 2>&1
tail -c 5000 "$out/run_all.log"
gpt="--preset long8k --steps 12 --eval-every 1000 --eval-batches 1 --log-every 2 --sample-tokens 16 \
  --data-bytes 4000000 --no-progress"
CUDA_VISIBLE_DEVICES=0 timeout 110 python3 -m examples.flax_gpt.train $gpt --attention flash \
  --out "$out/gpt_long8k_flash_1gpu.json" > "$out/gpt.log" 2>&1
timeout 110 python3 -m examples.flax_gpt.train $gpt --attention flash --data-parallel pmap \
  --out "$out/gpt_long8k_flash_pmap2.json" >> "$out/gpt.log" 2>&1
tail -c 3000 "$out/gpt.log"
