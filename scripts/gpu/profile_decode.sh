#!/usr/bin/env bash
# Where a decode step's time goes, op by op, on the Llama-3-8B-shaped checkpoint
# (made by make_llama8b.py): the server runs with CORRIDOR_CUDA_PROFILE (no graphs,
# every op waited for and timed) while `corridor bench` holds B requests in
# flight; the op tables land in $OUT/profile.log.
#   scripts/gpu/profile_decode.sh [B...]     (default: 1 128)
set -uo pipefail
cd "$(dirname "$0")/../.."
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export CORRIDOR_CACHE_DIR=${CORRIDOR_CACHE_DIR:-/tmp/corridor-cache}
out=${OUT:-/tmp}
model=${MODEL_DIR:-/tmp/llama8b}
[ -f "$model/config.json" ] || python3 scripts/gpu/make_llama8b.py "$model" --tokenizer-dir .gpu/llama3-tokenizer
for b in "${@:-1 128}"; do
    for batch in $b; do
        CORRIDOR_CUDA_PROFILE=100 ./.gpu/corridor serve --model "$model" --devices cuda:0 --port 8300 \
            --max-running-requests 128 --max-batched-tokens 8192 --context-length 8192 > "$out/profile_$batch.log" 2>&1 &
        pid=$!
        for _ in $(seq 120); do curl -sf -m 2 http://127.0.0.1:8300/health >/dev/null && break; sleep 1; done
        ./.gpu/corridor bench --base-url http://127.0.0.1:8300 --model llama8b --workload fixed --input-tokens 512 \
            --output-tokens 250 --concurrency "$batch" --num-requests "$batch" --length-control on --no-progress > /dev/null 2>&1
        kill -INT $pid; wait $pid
        echo "=== batch $batch: the last full report"; grep -A30 "CUDA op profile" "$out/profile_$batch.log" | tail -n 31
    done
done
