#!/usr/bin/env bash
# Session 9, device call 5 (nvidia-h200-x2), last ~5 minutes of the session's device time:
#   GPU 0: compiled vmap test, now also non-causal (the fused-dQ default under custom_vmap);
#   GPU 1: head_dim 64 causal 8k: fused dQ forced vs the default separate pass, 3 rounds, the
#          anchors' way (kernel times in s9 suggested fused may win there: 3.52 vs 2.23+1.43 ms).
set -uo pipefail
export PYTHONPATH=$PWD:${PYTHONPATH:-}
out="${1:?OUTDIR}"
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh
( export CUDA_VISIBLE_DEVICES=0
  timeout 140 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/test_mosaic_gpu.py \
    -k "vmap" > "$out/pytest_vmap.txt" 2>&1; tail -3 "$out/pytest_vmap.txt" ) > "$out/gpu0.log" 2>&1 &
( export CUDA_VISIBLE_DEVICES=1
  timeout 140 python3 scripts/diag/anchor_method.py --causal true --rounds 3 \
    --impls fa2_mosaic,fa2_mosaic_fused --cells "2,32,8192,64" --json "$out/h64_fused.json" \
    > "$out/h64_fused.txt" 2>&1; tail -3 "$out/h64_fused.txt" ) > "$out/gpu1.log" 2>&1 &
wait
cat "$out/gpu0.log" "$out/gpu1.log"
