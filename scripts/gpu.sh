#!/usr/bin/env bash
# The GPU entry point: tests and benchmarks on a GPU machine, from the repository root of a checkout.
#
#   bash scripts/gpu.sh tests    [pytest args]   compiled test suite: pytest -m gpu tests, then (when
#                                                tests/test_fuzz.py is there) its GPU profile:
#                                                HYPOTHESIS_PROFILE=gpu pytest -m gpu tests/test_fuzz.py;
#                                                args starting with a test path or node id run only
#                                                those, e.g. tests tests/test_variants.py -k mosaic, or
#                                                tests tests/test_gpt.py::test_name (the whole
#                                                suite takes longer than one 10-minute device call:
#                                                split it by files); GPU_TEST_WORKERS=N runs N pytest
#                                                workers (pytest-xdist) on the one GPU, each without
#                                                JAX's memory preallocation: the compiled tests spend
#                                                most of their time lowering and compiling kernels on
#                                                the host's CPUs (default 1: one process); each
#                                                test's outcome and seconds are appended to
#                                                durations.tsv as it finishes (kept on a timeout);
#                                                FA2_TEST_FIRST=SUBSTR,... names the tests to start
#                                                first (default: the longest compiles)
#   bash scripts/gpu.sh grid     [args]          the README's throughput grid, every implementation in one
#                                                process (python -m benchmarks.attention --grid headline);
#                                                split it with --cells, e.g. grid --cells 'd64-*,d256-*'
#                                                then grid --cells 'd128-*' --tag b, and combine with
#                                                python -m benchmarks.attention --merge A.json B.json
#   bash scripts/gpu.sh gpt      [ATTENTION...]  GPT long8k throughput (tokens/s, MFU) on one GPU for each
#                                                --attention named (flash, flash_triton, flash_mosaic,
#                                                cudnn, xla (with --remat true); default: flash cudnn)
#   bash scripts/gpu.sh gpt pmap                 the same with flash, data-parallel over every GPU
#   bash scripts/gpu.sh variants [args]          the attention variants' speed and bars
#                                                (python -m benchmarks.variants); split it with --cells,
#                                                e.g. variants --cells 'window-*' --tag a
#   bash scripts/gpu.sh decode   [args]          decode latency against a KV cache, every implementation
#                                                (python -m benchmarks.decode); --quick: 8 cells, about 3 min
#   bash scripts/gpu.sh models   [args]          the attention of public model configs at 4k and 16k,
#                                                fwd+bwd beside cuDNN, FA3, tokamax (python -m
#                                                benchmarks.models --budget-s GPU_TIMEOUT-60: a cell
#                                                that would start later is recorded as skipped and the
#                                                md and plot are still written); --quick: the 4k and
#                                                6000-token cells; the 16k ones: --cells '*-16k' --tag
#                                                16k, then python -m benchmarks.models --merge A B
#   bash scripts/gpu.sh context  [args]          the ring's per-block schedule on one GPU against one
#                                                flash_attention call, 32k-128k, C = 2, 4, 8 (python -m
#                                                benchmarks.context_schedule --budget-s GPU_TIMEOUT-60);
#                                                --quick: 32k and 128k at C = 4 and 8 (one call); the full
#                                                sweep in two: --cells '128k-*' --tag 128k, then --cells
#                                                '32k-*,64k-*' --tag a, merged with --merge A B;
#                                                --kernels-alone adds the steps' kernel calls timed
#                                                one by one (what the smaller calls alone cost)
#   bash scripts/gpu.sh latency|memory|numerics|tune [args]   python -m benchmarks.<mode>
#   bash scripts/gpu.sh all      [args]          python -m benchmarks.run_all --quick (attention, memory,
#                                                latency, numerics under one time budget)
#
# Results go to $OUT/<mode>/ when OUT is set (a device tool's output folder), else ./out/<mode>/ (ignored
# by git). GPU_TIMEOUT (seconds, default 570) bounds each command, so a device call's limit is not hit.
# FA2_GIT_COMMIT names the commit in the results' metadata where the checkout is a copy without git.
# Environment: NVLink multicast stays off (NCCL, PyTorch, NVSHMEM: a program that uses it can put a
# shared host's GPUs out of service); optional peer wheels carried in .peer/ (tokamax, flash_attn3_jax,
# and a stub/ folder) are installed to .peer/site and put on PYTHONPATH, so the benchmarks add their rows.
set -uo pipefail
MODES="tests grid gpt variants decode models context latency memory numerics tune all"
mode="${1:-}"
if [ -z "$mode" ] || [[ "$mode" == *[[:space:]]* ]] || [[ " $MODES " != *" $mode "* ]]; then
  echo "scripts/gpu.sh: mode must be one of: $MODES; got '$mode'" >&2
  exit 2
fi
shift
GPT_ATTENTIONS="flash flash_triton flash_mosaic cudnn xla"
if [ "$mode" = gpt ] && [ "${1:-}" = pmap ] && [ $# -gt 1 ]; then
  echo "scripts/gpu.sh gpt pmap: takes no further arguments (it runs flash); got '${*:2}'" >&2
  exit 2
fi
if [ "$mode" = gpt ] && [ "${1:-}" != pmap ]; then
  for a in "$@"; do
    if [[ "$a" == *[[:space:]]* ]] || [[ " $GPT_ATTENTIONS " != *" $a "* ]]; then
      echo "scripts/gpu.sh gpt: give either pmap alone or attentions from: $GPT_ATTENTIONS; got '$a'" >&2
      exit 2
    fi
  done
fi
if ! [[ "${GPU_TIMEOUT:-570}" =~ ^[1-9][0-9]*$ ]]; then
  echo "scripts/gpu.sh: GPU_TIMEOUT must be a positive whole number of seconds; got '${GPU_TIMEOUT}'" >&2
  exit 2
fi
workers="${GPU_TEST_WORKERS:-1}"
if ! [[ "$workers" =~ ^[1-9][0-9]*$ ]]; then
  echo "scripts/gpu.sh: GPU_TEST_WORKERS must be a positive integer; got '$workers'" >&2
  exit 2
fi
cd "$(dirname "$0")/.."
root="$PWD"
out="${OUT:-$root/out}/$mode"
mkdir -p "$out"
limit="${GPU_TIMEOUT:-570}"

export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"  # benchmarks and examples from this checkout
# fa2_jax as an editable install of this checkout (its kernels/ folder is the package fa2_jax.kernels),
# from the machine's own setuptools: no download
if ! python3 -c "import fa2_jax.kernels.registry" >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e "$root" >"$out/install.log" 2>&1 \
    || { echo "scripts/gpu.sh: installing fa2_jax from $root failed (log: $out/install.log)" >&2; exit 1; }
fi
if ls .peer/*.whl >/dev/null 2>&1; then
  rm -rf .peer/site
  python3 -m pip install -q --no-index --no-deps --target .peer/site .peer/*.whl \
    && export PYTHONPATH="$root/.peer/stub:$root/.peer/site:$PYTHONPATH" \
    || echo "scripts/gpu.sh: installing the peer wheels of .peer/ failed; their rows are left out" >&2
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader \
  | tee "$out/gpu.txt"

run() {  # log name, command...: bounded by GPU_TIMEOUT; the log in $out/<name>.log, its tail on stdout
  local log="$out/$1.log"; shift
  echo "+ $*"
  timeout -s ABRT "$limit" "$@" > "$log" 2>&1
  local rc=$?
  grep -vE "it/s\]|Autotuning" "$log" | tail -c 6000
  echo "rc=$rc (log: $log)"
  return $rc
}

gpt_run() {  # name, train.py flags...: 12 steps of the long8k preset, throughput after the compile
  local name="$1"; shift
  echo "=== $name"
  timeout -s ABRT "${GPT_TIMEOUT:-240}" python3 -X faulthandler -m examples.flax_gpt.train \
    --preset long8k --steps 12 --eval-every 1000 --eval-batches 1 --log-every 4 --sample-tokens 16 \
    --data-bytes 4000000 --no-progress --out "$out/gpt_long8k_$name.json" "$@" \
    > "$out/gpt_long8k_$name.log" 2>&1
  echo "rc=$? $(grep -E 'tokens/s|Error|error' "$out/gpt_long8k_$name.log" | tail -2)"
}

case "$mode" in
  tests)
    pytest_gpu=(python3 -X faulthandler -m pytest -q -m gpu -p no:cacheprovider --tb=short
                -o faulthandler_timeout=120)
    # each test's outcome and seconds as it finishes (tests/conftest.py), kept if a time limit stops
    # the run: $out/durations.tsv
    export FA2_TEST_DURATIONS="$out/durations.tsv"
    # the longest compiles start first, at the heads of the workers' shares (tests/conftest.py),
    # unless FA2_TEST_FIRST is set
    export FA2_TEST_FIRST="${FA2_TEST_FIRST-registers_and_mosaic_tune,mosaic_jit_grad_and_jit_of_grad,dkdv_roles_head_dim_256,extreme_logits_compiled,extreme_logits_gqa_compiled}"
    if [ "$workers" -gt 1 ]; then  # several processes share the GPU: each allocates as it goes
      export XLA_PYTHON_CLIENT_PREALLOCATE=false
      pytest_gpu+=(-n "$workers" --dist worksteal)
    fi
    if [ "$#" -gt 0 ] && [ -e "${1%%::*}" ]; then  # test files, folders or node ids given: just those
      run tests "${pytest_gpu[@]}" "$@"; exit $?
    fi
    if [ -f tests/test_fuzz.py ]; then
      run tests "${pytest_gpu[@]}" tests --ignore=tests/test_fuzz.py "$@"; rc=$?
      HYPOTHESIS_PROFILE=gpu run fuzz "${pytest_gpu[@]}" tests/test_fuzz.py "$@" || rc=$?
      exit $rc
    fi
    run tests "${pytest_gpu[@]}" tests "$@" ;;
  grid)
    run grid python3 -m benchmarks.attention --grid headline --out "$out" "$@" ;;
  gpt)
    if [ "${1:-}" = pmap ]; then
      n=$(python3 -c "import jax; print(jax.local_device_count())")
      gpt_run "flash_pmap$n" --attention flash --data-parallel pmap
    else
      [ "$#" -eq 0 ] && set -- flash cudnn
      for a in "$@"; do
        if [ "$a" = xla ]; then  # the materialised scores of 8k tokens fit only with rematerialisation
          gpt_run xla_remat_1gpu --attention xla --remat true
        else
          gpt_run "${a}_1gpu" --attention "$a"
        fi
      done
    fi ;;
  models)  # under the call's limit, so that the md and plot are written (a later --budget-s wins):
    # a minute for rendering and the last cell's overrun, half the limit when it is short
    run models python3 -m benchmarks.models --out "$out" \
      --budget-s $(( limit > 120 ? limit - 60 : (limit + 1) / 2 )) "$@" ;;
  context)  # the budget as models' (its 128k cells take minutes each)
    run context python3 -m benchmarks.context_schedule --out "$out" \
      --budget-s $(( limit > 120 ? limit - 60 : (limit + 1) / 2 )) "$@" ;;
  all)
    run all python3 -m benchmarks.run_all --quick --budget-s $((limit - 60)) --out "$out" "$@" ;;
  *)
    run "$mode" python3 -m "benchmarks.$mode" --out "$out" "$@" ;;
esac
