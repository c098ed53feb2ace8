#!/usr/bin/env bash
# What limits the one-row integer GEMV (kernels/mmvq.cu) on the card: Nsight Compute's throughput,
# occupancy, warp-state and memory sections for a few launches of one instantiation, taken from the
# decode-layer benchmark (`cuda_check --bench-q8-layer`, Llama-3-8B shapes, graph replays profiled
# node by node).
#
#   scripts/gpu/ncu_mmvq.sh [KERNEL_REGEX]      (default mmvq_q4_k_r1)
#
# SKIP launches of the kernel are passed over first (default 40: past the first variants' warm-up),
# then COUNT are profiled (default 4). Needs ncu (/usr/local/cuda-13.0/bin/ncu on the GPU machine)
# and .gpu/cuda_check (the release example of crates/backend, --features cuda). Output in $OUT
# (default /tmp): ncu_mmvq.txt.
set -uo pipefail
source "$(dirname "$0")/ncu_env.sh"
kernel=${1:-mmvq_q4_k_r1}
"$NCU" --graph-profiling node --kernel-name "regex:^${kernel}\$" --launch-skip "${SKIP:-40}" \
    --launch-count "${COUNT:-4}" --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
    ./.gpu/cuda_check --bench-q8-layer > "$out/ncu_mmvq.txt" 2> "$out/ncu_mmvq.err"
echo "ncu exit $?"; tail -n 2 "$out/ncu_mmvq.err"
grep -E "^  [a-z_0-9]+.*\(|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Warp Cycles Per Issued|Issued Warp Per|No Eligible|Stall|L1/TEX Hit|L2 Hit" \
    "$out/ncu_mmvq.txt" | head -n 80
