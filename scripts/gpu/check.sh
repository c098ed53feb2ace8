#!/usr/bin/env bash
# Run the CUDA backend self-check and benchmarks on the GPU machine.
# Build here first:
#   cargo build --release -p corridor-backend --features cuda --example cuda_check
#   mkdir -p .gpu && cp target/release/examples/cuda_check .gpu/
# then run this script there with .gpu carried.
set -euo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export CORRIDOR_CACHE_DIR=${CORRIDOR_CACHE_DIR:-/tmp/corridor-cache}
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
./.gpu/cuda_check --bench "$@"
# End-to-end: the tiny checkpoints through the real forward pass (scripts/gpu/e2e,
# built with: cd scripts/gpu/e2e && CARGO_TARGET_DIR=../../../target cargo build --release
# and copied to .gpu/corridor-gpu-e2e).
if [ -x ./.gpu/corridor-gpu-e2e ]; then
    ./.gpu/corridor-gpu-e2e tests/fixtures/tiny
fi
