#!/usr/bin/env bash
# Where a captured decode step's time goes on the card, as it runs: Nsight Systems traces every
# kernel node of the replayed graphs (`--cuda-graph-trace=node`) with its real start and end, so
# kernels that overlap (programmatic dependent launch) and the card's idle time between steps show
# as they are, where Nsight Compute (ncu_decode.sh) runs each kernel alone.
#
#   scripts/gpu/nsys_decode.sh MODEL [corridor generate flags...]
#
# Runs `corridor generate` (a 501-token prompt, MAX_TOKENS tokens, default 120, batch 1) under nsys
# and prints, over the last STEPS steps (default 60; a step ends with the sampling kernel), the step
# period, the card's busy and idle time per step, and per kernel name the calls, mean duration and
# the mean time from the previous kernel's end to its start (negative: it overlapped). Needs nsys
# (NSYS, default: the first of /usr/local/cuda-13.0/bin/nsys, nsys on PATH). Output in $OUT
# (default /tmp): nsys_decode.csv (the kernel trace), nsys_decode.txt (the summary).
set -uo pipefail
cd "$(dirname "$0")/../.."
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export CORRIDOR_CACHE_DIR=${CORRIDOR_CACHE_DIR:-/tmp/corridor-cache}
out=${OUT:-/tmp}
NSYS=${NSYS:-$(ls /usr/local/cuda-13.0/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -n 1)}
NSYS=${NSYS:-$(command -v nsys)}
if [ -z "$NSYS" ]; then
    echo "nsys: not found in /usr/local/cuda-13.0/bin, /opt/nvidia/nsight-systems/*/bin or PATH (set NSYS=... to its path)"
    exit 2
fi
BIN=${CORRIDOR_BIN:-.gpu/corridor}
model=$1
shift
tag=${TAG:-nsys_decode}
prompt=$(python3 -c "print('hello world ' * 250)")
rm -f "$out/$tag.nsys-rep" "$out/$tag.sqlite"
"$NSYS" profile --trace cuda --cuda-graph-trace node --sample none --cpuctxsw none \
    --force-overwrite true --output "$out/$tag" \
    "$BIN" generate --model "$model" --devices cuda:0 --context-length 4096 \
    --max-tokens "${MAX_TOKENS:-120}" --ignore-eos --prompt "$prompt" "$@" > "$out/$tag.gen" 2> "$out/$tag.err"
echo "nsys exit $?"; tail -n 2 "$out/$tag.err"
"$NSYS" stats --report cuda_gpu_trace --format csv --force-export true --output "$out/$tag" \
    "$out/$tag.nsys-rep" > /dev/null 2>> "$out/$tag.err"
csv=$(ls "$out/$tag"*cuda_gpu_trace*.csv 2>/dev/null | head -n 1)
if [ -z "$csv" ]; then echo "nsys stats: no trace"; tail -n 5 "$out/$tag.err"; exit 1; fi
mv "$csv" "$out/$tag.csv"
rm -f "$out/$tag.sqlite" "$out/$tag.nsys-rep"
python3 scripts/gpu/nsys_summary.py "$out/$tag.csv" "${STEPS:-60}" | tee "$out/$tag.txt"
