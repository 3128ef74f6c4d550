#!/usr/bin/env bash
# One GPU session's checks, for the device machine (jax + CUDA plugin preinstalled there):
#   compiled test suite (-m gpu), a wgmma count in the compiled kernels, and the tuning sweep.
# Usage: bash scripts/gpu_check.sh OUTDIR [tune args...]
set -uo pipefail
out="${1:?OUTDIR}"; shift
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1
python3 -c "import jax, jaxlib; print(jax.__version__, jaxlib.__version__, jax.devices())" >> "$out/gpu.txt" 2>&1
# wgmma: count Hopper tensor-core instructions (GMMA) vs older mma (HMMA) in our kernels with ncu.
cat > /tmp/one_step.py <<'PY'
import jax, jax.numpy as jnp, fa2_jax
q = jax.random.normal(jax.random.key(0), (1, 2048, 4, 128), jnp.bfloat16)
g = jax.jit(jax.grad(lambda q: fa2_jax.flash_attention(q, q, q, is_causal=True).astype(jnp.float32).sum()))
print("grad finite:", bool(jnp.isfinite(g(q)).all()))
PY
timeout 120 ncu --clock-control none -k "regex:fa2" -c 3 \
  --metrics sm__inst_executed_pipe_tensor_op_gmma.sum,sm__inst_executed_pipe_tensor_op_hmma.sum \
  python3 /tmp/one_step.py > "$out/ncu_gmma.txt" 2>&1
grep -E "fa2|gmma|hmma" "$out/ncu_gmma.txt" | head -20
timeout 300 python3 -m pytest -q -m gpu tests/test_attention.py tests/test_transforms.py \
  -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} > "$out/pytest_gpu.txt" 2>&1; echo "pytest rc=$?" >> "$out/pytest_gpu.txt"
tail -5 "$out/pytest_gpu.txt"
python3 scripts/gpu_tune.py --out "$out/tune.json" "$@" 2> "$out/tune_err.txt"
cat "$out/gpu.txt" | head -20
