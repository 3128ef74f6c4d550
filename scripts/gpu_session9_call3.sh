#!/usr/bin/env bash
# Session 9, device call 3 (nvidia-h200-x2): sweep MosaicConfig.lpt_heads (the causal launch order's
# section size) per kernel, two shapes per GPU (scripts/diag/lpt_sweep.py).
set -uo pipefail
out="${1:?OUTDIR}"
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh
( export CUDA_VISIBLE_DEVICES=0
  timeout 330 python3 scripts/diag/lpt_sweep.py --shapes "2,8192,16,128;1,16384,16,128" \
    --json "$out/lpt_gpu0.json" > "$out/lpt_gpu0.txt" 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=1
  timeout 330 python3 scripts/diag/lpt_sweep.py --shapes "2,8192,32,64;8,2048,16,128" \
    --json "$out/lpt_gpu1.json" > "$out/lpt_gpu1.txt" 2>&1 ) &
wait
tail -8 "$out/lpt_gpu0.txt"; tail -8 "$out/lpt_gpu1.txt"
