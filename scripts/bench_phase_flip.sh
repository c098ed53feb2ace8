#!/usr/bin/env bash
# Prefill bursts between decode phases on a flipping group of sim cards (32/20/20 GiB, CPU ranks)
# joined by a modelled link, served three ways in one run: --phase-flip auto, held in TP, held in PP
# (the same group, flipped once by hand before the load). Each phase is one `corridor bench` run:
#   decode: 8 streams of 32-token prompts and DECODE_OUT (64) generated tokens
#   burst:  BURST_N (12) prompts of BURST_TOKENS (768) tokens at once, 4 generated each
# alternating decode, burst, decode, burst, decode. Reports per mode: wall time, output tokens/s,
# TTFT and ITL p50/p99 of each phase kind, and the flips the server made (from /v1/memory).
# Usage: scripts/bench_phase_flip.sh [LINK] [OUT_DIR]   (LINK default 16GB/s,5us)
# What matters is the link's time against the compute's: a CPU rank computes hundreds of times
# slower than a GPU, so a PCIe link between CPU ranks costs next to nothing; a link slowed by the
# same factor (e.g. 25MB/s,500us) gives CPU ranks the trade-off PCIe gives GPUs.
# Needs a built corridor (CORRIDOR_BIN, default target/debug/corridor: the dev profile is optimized)
# and the default model (corridor pull).
set -euo pipefail
cd "$(dirname "$0")/.."
link=${1:-16GB/s,5us}
out=${2:-target/bench-phase-flip}
mkdir -p "$out"
bin=${CORRIDOR_BIN:-target/debug/corridor}
model=${MODEL:-$($bin pull)}
port=18461
BURST_N=${BURST_N:-12} BURST_TOKENS=${BURST_TOKENS:-768} DECODE_OUT=${DECODE_OUT:-64}
url=http://127.0.0.1:$port

serve() { # mode
    local mode=$1 flip=manual
    [ "$mode" = auto ] && flip=auto
    $bin --log warn serve --model "$model" --port $port --served-model-name m \
        --devices sim:32GiB,20GiB,20GiB --phase-flip $flip --sim-link "$link" \
        --max-running-requests 16 --max-batched-tokens 512 > "$out/$mode.serve.log" 2>&1 &
    server=$!
    for _ in $(seq 1 240); do curl -sf $url/health >/dev/null && break; sleep 0.5; done
    if [ "$mode" = pp ]; then
        curl -sf -X POST $url/v1/admin/layout -H 'content-type: application/json' -d '{"layout":"pp"}' > /dev/null
    fi
}
phase() { # mode name seed args... (each phase its own prompts, the same in every mode)
    local mode=$1 name=$2 seed=$3; shift 3
    $bin bench --base-url $url --model m --no-progress --seed "$seed" --json "$out/$mode.$name.json" "$@" > "$out/$mode.$name.txt"
}
for mode in auto tp pp; do
    serve $mode
    start=$(date +%s.%N)
    seed=0
    for p in decode1 burst1 decode2 burst2 decode3; do
        seed=$((seed + 1))
        case $p in
            decode*) phase $mode $p $seed --input-tokens 32 --output-tokens "$DECODE_OUT" --concurrency 8 --num-requests 8 ;;
            burst*) phase $mode $p $seed --input-tokens "$BURST_TOKENS" --output-tokens 4 --concurrency "$BURST_N" --num-requests "$BURST_N" ;;
        esac
    done
    end=$(date +%s.%N)
    echo "$end - $start" | bc > "$out/$mode.wall"
    curl -sf $url/v1/memory > "$out/$mode.memory.json"
    kill -INT $server; wait $server 2>/dev/null || true
done
python3 - "$out" "$link" <<'PY'
import json, sys
out, link = sys.argv[1], sys.argv[2]
print(f"link {link}; sim cards 32/20/20 GiB; phases decode, burst, decode, burst, decode")
print("| mode | wall s | out tok/s (all) | burst TTFT p50 / p99 ms | decode ITL p50 / p99 ms | flips (to pp, to tp, abandoned) |")
print("|---|---|---|---|---|---|")
for mode in ("auto", "tp", "pp"):
    runs = {n: json.load(open(f"{out}/{mode}.{n}.json")) for n in ("decode1", "burst1", "decode2", "burst2", "decode3")}
    wall = float(open(f"{out}/{mode}.wall").read())
    toks = sum(r["output_tokens"] for r in runs.values())
    bursts = [r for n, r in runs.items() if n.startswith("burst")]
    decodes = [r for n, r in runs.items() if n.startswith("decode")]
    mean = lambda rs, k, q: sum(r[k][q] for r in rs) / len(rs)
    f = json.load(open(f"{out}/{mode}.memory.json"))["layout"]["flips"]
    failed = sum(r["requests_failed"] for r in runs.values())
    print(f"| {mode} | {wall:.1f} | {toks / wall:.1f} | {mean(bursts, 'ttft_ms', 'p50'):.0f} / {mean(bursts, 'ttft_ms', 'p99'):.0f} "
          f"| {mean(decodes, 'itl_ms', 'p50'):.1f} / {mean(decodes, 'itl_ms', 'p99'):.1f} "
          f"| {f['to_pp']}, {f['to_tp']}, {sum(f['abandoned'].values())}{'' if failed == 0 else f'; {failed} requests failed'} |")
PY
