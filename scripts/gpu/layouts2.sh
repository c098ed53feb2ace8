#!/usr/bin/env bash
# One Llama-3-8B-shaped model (random bf16 weights) on the two-GPU machine: first on one GPU, then
# split over both by NCCL as TP=2 and as PP=2, with card budgets that make the two H200s a 32 GB and
# a 20 GB card (--card-budget-mib 32000,20000; the one-GPU run gets 32000) and `auto` splits.
# For each: greedy continuations with top-5 log-probs (layout_probe.py), decode at concurrency 1, 8
# and 32 (512 in / 128 out), a loaded run (concurrency 64, 192 requests of 256 tokens), and
# `corridor memory` at the end (breaches, each card's rest). compare_probes.py then compares each
# layout with one GPU. Needs .gpu/corridor (cuda build) and .gpu/llama3-tokenizer.
#   OUT=/dir scripts/gpu/layouts2.sh            (CONFIGS="one tp2 pp2" by default)
# Diagnostic configs: tp2nog (TP=2 auto without captured steps: CORRIDOR_NCCL_GRAPHS=0), tp2even
# (TP=2 with an even split), tp2prof (TP=2 auto with the per-op profile in serve_tp2prof.log).
# DECODE_BATCHES (default "1 8 32") and SKIP_LOADED=1 shorten a run.
set -uo pipefail
cd "$(dirname "$0")/../.."
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export CORRIDOR_CACHE_DIR=${CORRIDOR_CACHE_DIR:-/tmp/corridor-cache}
export NCCL_NVLS_ENABLE=0
out=${OUT:-/tmp/layouts}
mkdir -p "$out"
exec > >(tee -a "$out/layouts2.log") 2>&1
BIN=${CORRIDOR_BIN:-.gpu/corridor}
MODEL_DIR=${MODEL_DIR:-/tmp/llama8b}
CONFIGS=${CONFIGS:-one tp2 pp2}
DEADLINE_S=${DEADLINE_S:-560}
SECONDS=0
header() { echo; echo "=== [${SECONDS}s] $*"; }

nvidia-smi -L
source scripts/gpu/server_lib.sh
ensure_checkpoint "$MODEL_DIR"

start_server() { # name port args...
    local name=$1 port=$2; shift 2
    mkdir -p "$out/flight_$name"
    "$BIN" serve --model "$MODEL_DIR" --max-running-requests 64 --max-batched-tokens 4096 \
        --context-length 8192 --host 127.0.0.1 --port "$port" --flight-dir "$out/flight_$name" "$@" \
        > "$out/serve_$name.log" 2>&1 &
    server_pid=$!
    for _ in $(seq 240); do
        kill -0 "$server_pid" 2>/dev/null || break
        curl -sf -m 2 "http://127.0.0.1:$port/health" >/dev/null 2>&1 && return 0
        sleep 1
    done
    echo "server $name did not come up; last lines:"; tail -n 25 "$out/serve_$name.log"
    stop_server
    return 1
}

run_config() { # name port args...
    local name=$1 port=$2; shift 2
    (( SECONDS > DEADLINE_S - 150 )) && { echo "skipping $name: ${SECONDS}s of $DEADLINE_S used"; return; }
    header "$name: corridor serve $*"
    if ! start_server "$name" "$port" "$@"; then
        if [ "$name" = tp2 ]; then
            header "$name again without graphs (CORRIDOR_NCCL_GRAPHS=0)"
            CORRIDOR_NCCL_GRAPHS=0 start_server "$name" "$port" "$@" || return
        else
            return
        fi
    fi
    local url=http://127.0.0.1:$port
    grep -E "layout solved|KV share|KV pool sized|NCCL|captured|warmed" "$out/serve_$name.log" | cut -c1-400
    python3 scripts/gpu/layout_probe.py "$url" llama8b "$out/probe_$name.json"
    for b in ${DECODE_BATCHES:-1 8 32}; do
        n=$(( b * 2 > 4 ? b * 2 : 4 ))
        timeout 90 "$BIN" bench --base-url "$url" --model llama8b --workload fixed --length-control on \
            --no-progress --request-timeout 120 --input-tokens 512 --output-tokens 128 --concurrency "$b" \
            --num-requests "$n" --json "$out/decode_${name}_$b.json" > "$out/decode_${name}_$b.txt" 2>&1
        python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], "decode batch", sys.argv[3], "output tok/s", round(d["output_tokens_per_s"], 1), "failed", d["requests_failed"])' \
            "$out/decode_${name}_$b.json" "$name" "$b" 2>/dev/null || tail -n 5 "$out/decode_${name}_$b.txt"
    done
    if [ "${SKIP_LOADED:-0}" != 1 ]; then
        timeout 150 "$BIN" bench --base-url "$url" --model llama8b --workload fixed --length-control on \
            --no-progress --request-timeout 140 --input-tokens 512 --output-tokens 256 --concurrency 64 \
            --num-requests 192 --json "$out/loaded_$name.json" > "$out/loaded_$name.txt" 2>&1
        tail -n 12 "$out/loaded_$name.txt"
    fi
    curl -s -m 10 "$url/v1/memory" > "$out/memory_$name.json"
    timeout 30 "$BIN" memory --url "$url" > "$out/memory_$name.txt" 2>&1
    cat "$out/memory_$name.txt"
    stop_server
}

for c in $CONFIGS; do
    case $c in
        one) run_config one 8101 --devices cuda:0 --card-budget-mib 32000 ;;
        tp2) run_config tp2 8102 --devices cuda:0,1 --tp 2 --tp-ratio auto --card-budget-mib 32000,20000 ;;
        pp2) run_config pp2 8103 --devices cuda:0,1 --pp 2 --pp-layers auto --card-budget-mib 32000,20000 ;;
        tp2nog) (export CORRIDOR_NCCL_GRAPHS=0
            run_config tp2nog 8104 --devices cuda:0,1 --tp 2 --tp-ratio auto --card-budget-mib 32000,20000) ;;
        tp2even) run_config tp2even 8105 --devices cuda:0,1 --tp 2 --tp-ratio even --card-budget-mib 32000,20000 ;;
        tp2prof) (export CORRIDOR_CUDA_PROFILE=200
            run_config tp2prof 8106 --devices cuda:0,1 --tp 2 --tp-ratio auto --card-budget-mib 32000,20000
            grep -A 40 "CUDA op profile" "$out/serve_tp2prof.log" | head -n 90) ;;
    esac
done
header "compare with one GPU"
for c in tp2 pp2; do
    [ -s "$out/probe_one.json" ] && [ -s "$out/probe_$c.json" ] && {
        echo "--- $c vs one"; python3 scripts/gpu/compare_probes.py "$out/probe_one.json" "$out/probe_$c.json"; }
done
header "done"
