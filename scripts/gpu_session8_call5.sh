#!/usr/bin/env bash
# Session 8, device call 5 (one H200): the new default (fused dQ on non-causal calls) against the
# deterministic separate dQ pass and cuDNN at 2k and 4k, head_dim 128 and 64 (8k/16k: call 4).
set -uo pipefail
out="${1:?OUTDIR}"
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh
timeout 170 python3 -m benchmarks.attention --out "$out" --tag default_fused --seqs 2048,4096 \
  --head-dims 128,64 --causal false --impls cudnn,fa2_mosaic,fa2_mosaic_det --budget-s 150 \
  > "$out/bench.log" 2>&1
grep -vE "it/s|Autotuning" "$out/bench.log" | tail -c 2500
