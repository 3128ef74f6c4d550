#!/usr/bin/env bash
# Session 8, device call 4 (nvidia-h200-x2), two processes side by side, one per GPU:
#   GPU 0: the fused-dQ GPU tests (now with the dQ tile split between the consumers), then
#          fused vs separate dQ vs cuDNN at head_dim 128 (8k, 16k) and 64 (8k), causal and not;
#   GPU 1: the ablation (ideas + quick tile sweeps) at 8k for head_dim 128 and 64, causal and not.
# Results are packed into OUTDIR/results.tar.gz (the tool returns at most 8 files).
set -uo pipefail
out="${1:?OUTDIR}"
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh
mkdir -p "$out/fused" "$out/ablation"
( export CUDA_VISIBLE_DEVICES=0
  timeout 130 python3 -X faulthandler -m pytest -q -m gpu -p no:cacheprovider --tb=short \
    -o faulthandler_timeout=100 tests/test_mosaic_gpu.py -k "fused" > "$out/fused/pytest_fused.txt" 2>&1
  tail -3 "$out/fused/pytest_fused.txt"
  timeout 150 python3 -m benchmarks.attention --out "$out/fused" --tag fused_split --seqs 8192,16384 \
    --head-dims 128 --impls cudnn,fa2_mosaic,fa2_mosaic_fused --budget-s 110
  timeout 75 python3 -m benchmarks.attention --out "$out/fused" --tag fused_split_h64 --seqs 8192 \
    --head-dims 64 --impls cudnn,fa2_mosaic,fa2_mosaic_fused --budget-s 60
) > "$out/gpu0.log" 2>&1 &
p0=$!
( export CUDA_VISIBLE_DEVICES=1
  timeout 340 python3 -m benchmarks.ablation --out "$out/ablation" --head-dims 128,64 --seqs 8192 \
    --grid quick --no-small-batch --budget-s 300
) > "$out/gpu1.log" 2>&1 &
p1=$!
wait $p0 $p1
tar czf "$out/results.tar.gz" -C "$out" fused ablation && rm -rf "$out/fused" "$out/ablation"
echo "--- gpu0"; grep -vE "it/s|Autotuning" "$out/gpu0.log" | tail -c 3500
echo "--- gpu1"; grep -vE "it/s|Autotuning" "$out/gpu1.log" | tail -c 3000
