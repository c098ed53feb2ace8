# Sourced by the Nsight Compute scripts (ncu_decode.sh, ncu_mmvq.sh): the repository root as the
# working directory, the CUDA libraries, a kernel cache, the output folder ($OUT, default /tmp) and
# ncu itself ($NCU, default /usr/local/cuda-13.0/bin/ncu on the GPU machine).
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export CORRIDOR_CACHE_DIR=${CORRIDOR_CACHE_DIR:-/tmp/corridor-cache}
out=${OUT:-/tmp}
NCU=${NCU:-/usr/local/cuda-13.0/bin/ncu}
