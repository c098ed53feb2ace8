#!/usr/bin/env bash
# Same-run A/B of the decode launch tuning on one GPU (the Llama-3-8B-shaped checkpoint of
# make_llama8b.py): for each named configuration the server boots with its environment, greedy
# probes are taken (compared with the first configuration's: the tuning must not change what is
# computed beyond float reassociation), and decode runs at each batch size; the engine's own
# forward time per step is printed beside the client's tok/s and ITL.
#
#   OUT=/tmp/ab scripts/gpu/decode_ab.sh
#
# Environment (all optional):
#   AB_CONFIGS     space-separated names, each defined in the case below (default: base fuse pdl all;
#                  lanes0 sets CORRIDOR_ATTN_LANES=0); prof and profbase run with CORRIDOR_CUDA_PROFILE
#                  (per-op device time, graphs off) at PROFILE_BATCHES (default "1 32") and print the
#                  last op table
#   DECODE_BATCHES batch sizes (default "1 8 32 128")
#   SKIP_CHECKS=1  skip the kernel checks and the tiny-checkpoint GPU-vs-CPU runs
#   DEADLINE_S     stop starting configurations after this many seconds (default 540)
set -uo pipefail
cd "$(dirname "$0")/../.."
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export CORRIDOR_CACHE_DIR=${CORRIDOR_CACHE_DIR:-/tmp/corridor-cache}
out=${OUT:-/tmp/ab}
mkdir -p "$out"
exec > >(tee -a "$out/decode_ab.log") 2>&1
BIN=${CORRIDOR_BIN:-.gpu/corridor}
MODEL_DIR=${MODEL_DIR:-/tmp/llama8b}
DEADLINE_S=${DEADLINE_S:-540}
SECONDS=0
header() { echo; echo "=== [${SECONDS}s] $*"; }

nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
if [ "${SKIP_CHECKS:-0}" != 1 ]; then
    header "kernels vs CPU"
    ./.gpu/cuda_check > "$out/checks.log" 2>&1
    grep -E "^FAIL|failures|comparisons" "$out/checks.log"
    header "tiny checkpoints GPU vs CPU"
    ./.gpu/corridor-gpu-check tests/fixtures/tiny > "$out/e2e.log" 2>&1
    tail -n 3 "$out/e2e.log"
fi
source scripts/gpu/server_lib.sh
ensure_checkpoint "$MODEL_DIR"

run_config() { # name, then VAR=value ... for the server's environment
    local name=$1; shift
    (( SECONDS > DEADLINE_S - 60 )) && { echo "skipping $name: ${SECONDS}s of $DEADLINE_S used"; return; }
    header "$name: $*"
    local port=8400 url=http://127.0.0.1:8400
    env "$@" "$BIN" serve --model "$MODEL_DIR" --devices cuda:0 --max-running-requests 128 \
        --max-batched-tokens 8192 --context-length 8192 --host 127.0.0.1 --port $port \
        > "$out/serve_$name.log" 2>&1 &
    server_pid=$!
    local up=0
    for _ in $(seq 240); do
        kill -0 "$server_pid" 2>/dev/null || break
        curl -sf -m 2 "$url/health" >/dev/null 2>&1 && { up=1; break; }
        sleep 1
    done
    if [ $up != 1 ]; then
        echo "server $name did not come up"; tail -n 25 "$out/serve_$name.log"; stop_server; return
    fi
    python3 scripts/gpu/layout_probe.py "$url" llama8b "$out/probe_$name.json"
    [ "$name" != "$first" ] && [ -s "$out/probe_$first.json" ] &&
        python3 scripts/gpu/compare_probes.py "$out/probe_$first.json" "$out/probe_$name.json" | tail -n 2
    local batches=${DECODE_BATCHES:-1 8 32 128}
    [[ " $* " == *" CORRIDOR_CUDA_PROFILE="* ]] && batches=${PROFILE_BATCHES:-1 32}
    for b in $batches; do
        curl -s -m 5 "$url/v1/engine/stats" > "$out/stats0.json"
        timeout 120 "$BIN" bench --base-url "$url" --model llama8b --workload fixed --length-control on \
            --no-progress --request-timeout 110 --input-tokens 512 --output-tokens 256 --concurrency "$b" \
            --num-requests "$b" --json "$out/decode_${name}_$b.json" > "$out/decode_${name}_$b.txt" 2>&1
        curl -s -m 5 "$url/v1/engine/stats" > "$out/stats1.json"
        python3 - "$out/decode_${name}_$b.json" "$name" "$b" <<'EOF' || tail -n 5 "$out/decode_${name}_$b.txt"
import json, sys
d = json.load(open(sys.argv[1]))
itl = d.get("itl_ms", {})
print(f"{sys.argv[2]} B={sys.argv[3]}: {d['output_tokens_per_s']:.1f} tok/s, ITL p50 {itl.get('p50', float('nan')):.2f} ms, "
      f"failed {d['requests_failed']}")
EOF
        python3 scripts/gpu/step_phases.py "$out/stats0.json" "$out/stats1.json"
    done
    stop_server
    # Profiled runs: the last op table of each batch size (device time per op, graphs off).
    python3 scripts/gpu/op_tables.py "$out/serve_$name.log" > "$out/oprof_$name.txt"
    cat "$out/oprof_$name.txt"
}

first=
for c in ${AB_CONFIGS:-base fuse pdl all}; do
    [ -z "$first" ] && first=$c
    case $c in
        base) run_config base CORRIDOR_PDL=0 CORRIDOR_FUSE=0 ;;
        fuse) run_config fuse CORRIDOR_PDL=0 CORRIDOR_FUSE=1 ;;
        pdl) run_config pdl CORRIDOR_PDL=1 CORRIDOR_FUSE=0 ;;
        all) run_config all CORRIDOR_PDL=1 CORRIDOR_FUSE=1 ;;
        lanes0) run_config lanes0 CORRIDOR_PDL=1 CORRIDOR_FUSE=1 CORRIDOR_ATTN_LANES=0 ;;
        prof) run_config prof CORRIDOR_PDL=1 CORRIDOR_FUSE=1 CORRIDOR_CUDA_PROFILE=100 ;;
        profbase) run_config profbase CORRIDOR_PDL=0 CORRIDOR_FUSE=0 CORRIDOR_CUDA_PROFILE=100 ;;
        *) echo "unknown configuration $c" ;;
    esac
done
header "done"
