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
# End-to-end: the tiny checkpoints through the real forward pass (crates/gpu-check,
# built with: cargo build --release -p corridor-gpu-check --features cuda
# and copied to .gpu/: cp target/release/corridor-gpu-check .gpu/).
if [ -x ./.gpu/corridor-gpu-check ]; then
    ./.gpu/corridor-gpu-check tests/fixtures/tiny
fi
# Sampling on the GPU against the host sampler, row for row, and its cost at 1-128 rows
# (built with: cargo build --release -p corridor-engine --features cuda --example device_sampling_check
# and copied to .gpu/: cp target/release/examples/device_sampling_check .gpu/).
if [ -x ./.gpu/device_sampling_check ]; then
    ./.gpu/device_sampling_check --bench
fi
