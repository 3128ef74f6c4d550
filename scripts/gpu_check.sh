#!/usr/bin/env bash
# One GPU session's checks, for the device machine (jax + CUDA plugin preinstalled there):
#   compiled test suite (-m gpu), a wgmma count in the compiled kernels, and the tuning sweep.
# Usage: bash scripts/gpu_check.sh OUTDIR [tune args...]
set -uo pipefail
out="${1:?OUTDIR}"; shift
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
  || { ln -sfn ../kernels fa2_jax/kernels; export PYTHONPATH=$PWD:${PYTHONPATH:-}; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1
python3 -c "import jax, jaxlib; print(jax.__version__, jaxlib.__version__, jax.devices())" >> "$out/gpu.txt" 2>&1
# wgmma: dump the compiled Triton kernels of one fwd+bwd and count Hopper tensor-core instructions.
rm -rf /tmp/xdump
XLA_FLAGS=--xla_dump_to=/tmp/xdump python3 - <<'PY' >> "$out/gpu.txt" 2>&1
import jax, jax.numpy as jnp, fa2_jax
q = jax.random.normal(jax.random.key(0), (1, 1024, 4, 128), jnp.bfloat16)
g = jax.jit(jax.grad(lambda q: fa2_jax.flash_attention(q, q, q, is_causal=True).astype(jnp.float32).sum()))
print("grad finite:", bool(jnp.isfinite(g(q)).all()))
PY
{ echo "files with wgmma.mma_async:"; grep -l "wgmma.mma_async" -r /tmp/xdump | head; \
  echo "count:"; grep -o "wgmma.mma_async" -r /tmp/xdump | wc -l; ls /tmp/xdump | head -40; } >> "$out/gpu.txt" 2>&1
timeout 300 python3 -m pytest -q -x -m gpu tests/test_attention.py tests/test_transforms.py \
  -p no:cacheprovider > "$out/pytest_gpu.txt" 2>&1; echo "pytest rc=$?" >> "$out/pytest_gpu.txt"
tail -5 "$out/pytest_gpu.txt"
python3 scripts/gpu_tune.py --out "$out/tune.json" "$@" 2> "$out/tune_err.txt"
cat "$out/gpu.txt" | head -20
