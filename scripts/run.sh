#!/usr/bin/env bash
# The main job: set up, then train the Flax GPT example. On a CPU-only machine this trains the `tiny`
# preset (attention falls back to the XLA formula there) and prints a sample; on a GPU it uses the
# FlashAttention-2 kernels. Extra arguments go to the trainer, e.g. `bash scripts/run.sh --preset small`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh examples
. .venv/bin/activate
if [ "$#" -eq 0 ]; then set -- --preset tiny; fi
exec python -m examples.flax_gpt.train "$@"
