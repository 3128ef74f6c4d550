#!/usr/bin/env bash
# Session 9, device call 1 (nvidia-h200-x2), two processes side by side, one per GPU:
#   GPU 0: the owed compiled suite (vmap fix, ws_kernel refactor, fp16 fused) + compile time;
#   GPU 1: per-kernel times at 8k (scripts/diag/kernel_times.py) with ptxas/SASS dumps of every
#          kernel, then the issue-5 cells measured the anchors' way beside cuDNN and tokamax
#          (scripts/diag/anchor_method.py).
# Results are packed into OUTDIR/results.tar.gz (the tool returns at most 8 files).
set -uo pipefail
out="${1:?OUTDIR}"
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh
mkdir -p "$out/r/dump"
( export CUDA_VISIBLE_DEVICES=0
  bash scripts/gpu_todo.sh "$out/r" tests
) > "$out/gpu0.log" 2>&1 &
p0=$!
( export CUDA_VISIBLE_DEVICES=1
  MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_TO="$out/r/dump" timeout 180 \
    python3 scripts/diag/kernel_times.py --json "$out/r/kernel_times.json" > "$out/r/kernel_times.txt" 2>&1
  tail -25 "$out/r/kernel_times.txt"
  timeout 370 python3 scripts/diag/anchor_method.py --json "$out/r/anchor_method.json" > "$out/r/anchor_method.txt" 2>&1
  tail -14 "$out/r/anchor_method.txt"
) > "$out/gpu1.log" 2>&1 &
p1=$!
wait $p0 $p1
ls "$out/r/dump" | head -50 > "$out/r/dump_list.txt"
tar czf "$out/results.tar.gz" -C "$out" r && rm -rf "$out/r"
echo "--- gpu0"; tail -c 4000 "$out/gpu0.log"
echo "--- gpu1"; tail -c 3000 "$out/gpu1.log"
