#!/usr/bin/env bash
# The GPT long-context Table-1 analogue: tokens/s, TFLOP/s and MFU of the long8k preset for each attention.
#   bash scripts/gpu_gpt_table1.sh OUTDIR single   # one GPU: flash (default backend), flash_triton,
#                                                  #   flash_mosaic, cudnn, xla (xla needs --remat true)
#                                                  #   (WITH_REMAT_FLASH=1: flash with --remat too)
#   (single_min: the first two only; single_rest: the others; single_flash, xla_only: one each)
#   bash scripts/gpu_gpt_table1.sh OUTDIR pmap     # every local GPU, --data-parallel pmap, flash
#                                                  #   (WITH_CUDNN_PMAP=1: cudnn too)
# Each run: 12 steps, batch 4 per device, throughput over the steps after the compile (see train.py).
set -uo pipefail
out="${1:?OUTDIR}"; mode="${2:-single}"
case "$mode" in
  single|single_min|single_flash|single_rest|xla_only|pmap) ;;
  *) echo "gpu_gpt_table1.sh: mode must be single, single_min, single_flash, single_rest, xla_only or pmap, got '$mode'" >&2
     exit 2 ;;
esac
cd "$(dirname "$0")/.."
GPU_ENV_NO_INSTALL=1 . scripts/gpu_env.sh
gpt="--preset long8k --steps 12 --eval-every 1000 --eval-batches 1 --log-every 4 --sample-tokens 16
  --data-bytes 4000000 --no-progress"
run() {  # name, extra flags...
  local name="$1"; shift
  echo "=== $name: python3 -m examples.flax_gpt.train $gpt $*" | tr '\n' ' '; echo
  timeout -s ABRT ${RUN_TIMEOUT:-130} python3 -X faulthandler -m examples.flax_gpt.train $gpt "$@" --out "$out/gpt_long8k_$name.json" \
    > "$out/gpt_long8k_$name.log" 2>&1
  echo "rc=$? $(grep -E 'tokens/s|Error|error' "$out/gpt_long8k_$name.log" | tail -2)"
}
if [ "$mode" = single ] || [ "$mode" = single_min ] || [ "$mode" = single_flash ]; then
  run flash_1gpu --attention flash
fi
if [ "$mode" = single ] || [ "$mode" = single_min ]; then
  run cudnn_1gpu --attention cudnn
fi
if [ "$mode" = single ] || [ "$mode" = single_rest ]; then
  run flash_triton_1gpu --attention flash_triton
  run xla_remat_1gpu --attention xla --remat true
  [ "${WITH_REMAT_FLASH:-0}" = 1 ] && run flash_remat_1gpu --attention flash --remat true
fi
if [ "$mode" = xla_only ]; then
  run xla_remat_1gpu --attention xla --remat true
fi
if [ "$mode" = pmap ]; then
  n=$(python3 -c "import jax; print(jax.local_device_count())")
  run "flash_pmap$n" --attention flash --data-parallel pmap
  [ "${WITH_CUDNN_PMAP:-0}" = 1 ] && run "cudnn_pmap$n" --attention cudnn --data-parallel pmap
fi
