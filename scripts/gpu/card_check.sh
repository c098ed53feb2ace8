#!/usr/bin/env bash
# Check the CUDA card and the allocation chokepoint on a real GPU: NVML and
# driver totals, carve-out, the process list, a 4 GiB address reservation,
# 1 GiB committed in 2 MiB granules (driver free must drop by exactly 1 GiB),
# half of it decommitted (free must rise by exactly 512 MiB), a plain
# allocation, and the memory report with its drift.
#
# Build on the development machine (no CUDA toolkit needed there):
#   cargo build --release -p corridor-vram --features cuda --example cuda_card_check
#   mkdir -p .gpu && cp target/release/examples/cuda_card_check .gpu/
# then run this script on the GPU machine with .gpu carried:
#   scripts/gpu/card_check.sh                 # cuda:0
#   scripts/gpu/card_check.sh cuda:1          # another ordinal
#   scripts/gpu/card_check.sh cuda:GPU-1a2b   # a UUID (or a unique prefix)
# Extra flags go to the binary: --va-gib N --commit-mib N --tolerance-mib N
# --max-drift-mib N --json PATH. When $OUT is set, the memory report is also
# written there as card_report.json.
#
# Exit status: 0 every check passed, 1 a check failed, 2 the card could not be
# opened (the message names the missing library or device).
# The exact checks assume nothing else allocates on the card during the run;
# the process list before and after names anyone who did.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${CARD_CHECK_BIN:-./.gpu/cuda_card_check}
if [ ! -x "$BIN" ]; then
    echo "card_check: $BIN not found; build it as the header of $0 says" >&2
    exit 2
fi
# The driver (libcuda.so.1) and NVML (libnvidia-ml.so.1) live in /usr/lib and
# are found by default; the toolkit path is added the same way as check.sh.
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=index,uuid,name,driver_version,memory.used,memory.total --format=csv
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv || true
fi
ARGS=("$@")
if [ -n "${OUT:-}" ]; then
    ARGS+=(--json "$OUT/card_report.json")
fi
RUST_LOG=${RUST_LOG:-info} "$BIN" "${ARGS[@]}"
