#!/usr/bin/env bash
# Session 8, device call 1 (nvidia-h200-x2, the two GPUs used side by side by two processes):
#   GPU 0: compile-time check and the compiled GPU test suite (gpu_todo.sh tests);
#   GPU 1: GPT long8k on one GPU with the default flash attention (Mosaic) and with XLA (--remat true).
# Two separate processes on two GPUs; the GPT throughput is that of GPU 1 alone (the host has 32 cores).
set -uo pipefail
out="${1:?OUTDIR}"
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh
python3 -c 'import jax; print(jax.devices())'
mkdir -p "$out/tests" "$out/gpt"
( export CUDA_VISIBLE_DEVICES=0; GPU_ENV_NO_INSTALL=1 bash scripts/gpu_todo.sh "$out/tests" tests > "$out/tests/todo.log" 2>&1 ) &
p0=$!
( export CUDA_VISIBLE_DEVICES=1
  RUN_TIMEOUT=250 bash scripts/gpu_gpt_table1.sh "$out/gpt" single_flash
  RUN_TIMEOUT=250 bash scripts/gpu_gpt_table1.sh "$out/gpt" xla_only ) > "$out/gpt/gpt.log" 2>&1 &
p1=$!
wait $p0 $p1
echo "--- compile time"; tail -20 "$out/tests/compile_time.txt"
echo "--- gpt"; cat "$out/gpt/gpt.log"
echo "--- tests"; tail -c 3500 "$out/tests/pytest_gpu.txt"
