# Sourced by the scripts/gpu_*.sh device-run scripts (from the repo root): the environment of a run on
# the GPU machine. Keeps NVLink multicast off (the device tool's KINDS.md says why), installs this
# checkout (or, where pip cannot, maps kernels/ into fa2_jax by a link on PYTHONPATH) and, when the
# tokamax wheels were carried in .peer/ (../shared/device-wheels/README.md), installs those beside it.
# GPU_ENV_NO_INSTALL=1: the exports only.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ "${GPU_ENV_NO_INSTALL:-0}" != 1 ]; then
  python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
    || { ln -sfn ../kernels fa2_jax/kernels; export PYTHONPATH=$PWD:${PYTHONPATH:-}; }
  if ls .peer/*.whl >/dev/null 2>&1; then
    rm -rf /tmp/peer; python3 -m pip install -q --no-index --no-deps --target /tmp/peer .peer/*.whl \
      && export PYTHONPATH=$PWD/.peer/stub:/tmp/peer:${PYTHONPATH:-}
  fi
fi
