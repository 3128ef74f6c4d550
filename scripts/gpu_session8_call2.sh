#!/usr/bin/env bash
# Session 8, device call 2 (nvidia-h200-x2):
#   both GPUs: GPT long8k, --data-parallel pmap over the two GPUs, default flash attention;
#   then two processes side by side, one per GPU:
#   GPU 0: gpu_todo.sh grid (fused-dQ row; the 512/1k columns; head_dim-64 causal 4k) with tokamax;
#   GPU 1: latency and memory sweeps, fp16 quick grid (gpu_todo.sh extras, shorter budgets).
# Everything under OUTDIR/{grid,extras} is packed into OUTDIR/results.tar.gz (the tool returns 8 files).
set -uo pipefail
out="${1:?OUTDIR}"
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh
mkdir -p "$out/gpt" "$out/grid" "$out/extras"
RUN_TIMEOUT=140 bash scripts/gpu_gpt_table1.sh "$out/gpt" pmap > "$out/gpt_pmap.log" 2>&1
( export CUDA_VISIBLE_DEVICES=0; cd "$PWD"
  timeout 130 python3 -m benchmarks.attention --out "$out/grid" --tag fused --seqs 2048,8192,16384 \
    --head-dims 128,64 --impls cudnn,fa2_mosaic,fa2_mosaic_fused --budget-s 110
  timeout 180 python3 -m benchmarks.attention --out "$out/grid" --tag short --seqs 512,1024 \
    --head-dims 64,128 --impls cudnn,fa2_mosaic,fa2_triton,tokamax_mosaic,xla --budget-s 160
  timeout 100 python3 -m benchmarks.attention --out "$out/grid" --tag h64c4k --seqs 4096 --head-dims 64 \
    --causal true --impls cudnn,fa2_mosaic,fa2_triton,tokamax_mosaic,xla --budget-s 85
) > "$out/grid.log" 2>&1 &
p0=$!
( export CUDA_VISIBLE_DEVICES=1
  timeout 260 python3 -m benchmarks.run_all --full --only latency,memory --budget-s 240 --out "$out/extras"
  timeout 160 python3 -m benchmarks.attention --quick --dtype fp16 --tag fp16 --out "$out/extras" \
    --impls cudnn,fa2_mosaic,fa2_triton,xla --budget-s 140
) > "$out/extras.log" 2>&1 &
p1=$!
wait $p0 $p1
tar czf "$out/results.tar.gz" -C "$out" grid extras gpt && rm -rf "$out/grid" "$out/extras" "$out/gpt"
cat "$out/gpt_pmap.log"
echo "--- grid"; tail -c 3000 "$out/grid.log"
echo "--- extras"; tail -c 2500 "$out/extras.log"
