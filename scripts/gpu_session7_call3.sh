#!/usr/bin/env bash
# Session 7, device call 3 (one H200): the paper's full bf16 grid (seq 512-16k, head_dim 64/128, causal
# and not) for fa2_jax's two backends beside cuDNN, tokamax "mosaic" and XLA in one process.
set -uo pipefail
out="${1:?OUTDIR}"; budget="${2:-440}"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
  || { ln -sfn ../kernels fa2_jax/kernels; export PYTHONPATH=$PWD:${PYTHONPATH:-}; }
if ls .peer/*.whl >/dev/null 2>&1; then  # tokamax, carried (../shared/device-wheels/README.md)
  rm -rf /tmp/peer; python3 -m pip install -q --no-index --no-deps --target /tmp/peer .peer/*.whl \
    && export PYTHONPATH=$PWD/.peer/stub:/tmp/peer:${PYTHONPATH:-}
fi
python3 -m benchmarks.run_all --full --only attention --budget-s "$budget" --out "$out/full" \
  --stage-args "attention=--impls cudnn,fa2_mosaic,fa2_triton,tokamax_mosaic,xla" \
  --archive "$out/full.tar.gz" > "$out/run_all.log" 2>&1
tail -c 6000 "$out/run_all.log"
