#!/usr/bin/env bash
# Session 9, device call 2 (nvidia-h200-x2), two processes side by side, one per GPU:
#   GPU 0: GPU tests of the new causal launch order (bitwise equal to the per-head order, causal
#          reference cases, fused dQ), then per-kernel times with ptxas/SASS dumps;
#   GPU 1: causal cells the anchors' way: default (L2-section order) vs the per-head order vs fused dQ
#          forced, beside cuDNN and tokamax.
set -uo pipefail
out="${1:?OUTDIR}"
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh
mkdir -p "$out/r/dump"
( export CUDA_VISIBLE_DEVICES=0
  timeout 260 python3 -X faulthandler -m pytest -q -m gpu -p no:cacheprovider --tb=short \
    -o faulthandler_timeout=120 tests/test_mosaic_gpu.py tests/test_attention.py \
    -k "launch_orders or fused or (mosaic_matches_reference_gpu and causal)" > "$out/r/pytest_causal.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$out/r/pytest_causal.txt" | tail -12
  MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_TO="$out/r/dump" timeout 240 \
    python3 scripts/diag/kernel_times.py --json "$out/r/kernel_times.json" > "$out/r/kernel_times.txt" 2>&1
  tail -32 "$out/r/kernel_times.txt"
) > "$out/gpu0.log" 2>&1 &
p0=$!
( export CUDA_VISIBLE_DEVICES=1
  timeout 520 python3 scripts/diag/anchor_method.py --causal true \
    --impls cudnn,fa2_mosaic,fa2_mosaic_head,fa2_mosaic_fused,tokamax_mosaic \
    --cells "8,16,2048,128;2,16,8192,128;1,16,16384,128;2,32,8192,64" \
    --json "$out/r/anchor_causal.json" > "$out/r/anchor_causal.txt" 2>&1
  tail -6 "$out/r/anchor_causal.txt"
) > "$out/gpu1.log" 2>&1 &
p1=$!
wait $p0 $p1
ls -la "$out/r/dump" | head -80 > "$out/r/dump_list.txt"
tar czf "$out/results.tar.gz" -C "$out" r && rm -rf "$out/r"
echo "--- gpu0"; tail -c 5000 "$out/gpu0.log"
echo "--- gpu1"; tail -c 2500 "$out/gpu1.log"
