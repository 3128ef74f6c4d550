#!/usr/bin/env bash
# Session 7, device call 3 (one H200): the paper's full bf16 grid (seq 512-16k, head_dim 64/128, causal
# and not) for fa2_jax's two backends beside cuDNN, tokamax "mosaic" and XLA in one process.
set -uo pipefail
out="${1:?OUTDIR}"; budget="${2:-440}"
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh
python3 -m benchmarks.run_all --full --only attention --budget-s "$budget" --out "$out/full" \
  --stage-args "attention=--impls cudnn,fa2_mosaic,fa2_triton,tokamax_mosaic,xla" \
  --archive "$out/full.tar.gz" > "$out/run_all.log" 2>&1
tail -c 6000 "$out/run_all.log"
