#!/usr/bin/env bash
# One GPU session's checks, in two steps so each call carries under the
# device transfer limit (binaries built on the development machine into .gpu/):
#   scripts/gpu/session.sh checks   # card + chokepoint check, kernel checks, tiny checkpoints GPU vs CPU
#   scripts/gpu/session.sh paris    # SmolLM2 "Paris" on the GPU; its GGUF arrives as .gpu-a/part + .gpu-b/part
# Logs go to $OUT (or /tmp) as they run.
set -uo pipefail
cd "$(dirname "$0")/../.."
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export CORRIDOR_CACHE_DIR=${CORRIDOR_CACHE_DIR:-/tmp/corridor-cache}
out=${OUT:-/tmp}
case "${1:-checks}" in
  checks)
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$out/nvidia-smi.txt"
    echo "== card and chokepoint"; scripts/gpu/card_check.sh 2>&1 | tee "$out/card_check.log"
    echo "== kernels vs CPU"; ./.gpu/cuda_check 2>&1 | tail -n 40 | tee "$out/cuda_check.log"
    echo "== tiny checkpoints GPU vs CPU"; ./.gpu/corridor-gpu-e2e tests/fixtures/tiny 2>&1 | tee "$out/e2e.log"
    ;;
  paris)
    cat .gpu-a/part .gpu-b/part > /tmp/smollm2.gguf
    sha256sum /tmp/smollm2.gguf | tee "$out/paris.log"
    ./.gpu/corridor-gpu-e2e /tmp/smollm2.gguf 2>&1 | tee -a "$out/paris.log"
    ;;
esac
