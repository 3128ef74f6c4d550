#!/usr/bin/env bash
# Session 8, device call 3 (nvidia-h200-x2), two processes side by side, one per GPU:
#   GPU 0: latency and memory sweeps (now with the Mosaic row); head_dim-64 seq-512 column; fp16
#          head_dim-64 2k cells;
#   GPU 1: ncu profile of one fwd+bwd at 8k non-causal (Mosaic separate dQ, Mosaic fused dQ, cuDNN),
#          then the ablation (ideas + quick tile sweeps) at 8k for head_dim 128 and 64, causal and not.
# Results are packed into OUTDIR/results.tar.gz (the tool returns at most 8 files).
set -uo pipefail
out="${1:?OUTDIR}"
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh
mkdir -p "$out/extras" "$out/grid" "$out/prof" "$out/ablation"
( export CUDA_VISIBLE_DEVICES=0
  timeout 230 python3 -m benchmarks.run_all --full --only latency,memory --budget-s 215 --out "$out/extras"
  timeout 110 python3 -m benchmarks.attention --out "$out/grid" --tag h64s512 --seqs 512 --head-dims 64 \
    --impls cudnn,fa2_mosaic,fa2_triton,tokamax_mosaic,xla --budget-s 95
  timeout 70 python3 -m benchmarks.attention --out "$out/grid" --tag fp16h64 --dtype fp16 --seqs 2048 \
    --head-dims 64 --impls cudnn,fa2_mosaic,fa2_triton,xla --budget-s 60
) > "$out/gpu0.log" 2>&1 &
p0=$!
( export CUDA_VISIBLE_DEVICES=1
  timeout 170 ncu --clock-control none -k "regex:fa2_mosaic|sdpa|fmha|flash|cudnn" --launch-count 24 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    python3 scripts/diag/profile_bwd.py --impls mosaic,mosaic_fused,cudnn > "$out/prof/ncu.txt" 2>&1
  echo "ncu rc=$?"
  timeout 230 python3 -m benchmarks.ablation --out "$out/ablation" --head-dims 128,64 --seqs 8192 \
    --grid quick --no-small-batch --budget-s 215
) > "$out/gpu1.log" 2>&1 &
p1=$!
wait $p0 $p1
tar czf "$out/results.tar.gz" -C "$out" extras grid prof ablation && rm -rf "$out/extras" "$out/grid" "$out/prof" "$out/ablation"
echo "--- gpu0"; grep -vE "it/s|Autotuning" "$out/gpu0.log" | tail -c 3000
echo "--- gpu1"; grep -vE "it/s|Autotuning" "$out/gpu1.log" | tail -c 4000
