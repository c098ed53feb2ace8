#!/usr/bin/env bash
# Throughput and latency of `corridor serve` on the default model on this
# machine's CPU, at concurrency 1, 8 and 32, measured with `corridor bench`
# (fixed lengths: 128-token prompts, 64 output tokens, EOS ignored).
# Usage: scripts/bench_serve_cpu.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/bench-serve-cpu}
mkdir -p "$out"
cargo build --release -q -p corridor-cli
bin=target/release/corridor
model=$($bin pull)
port=18431
$bin --log warn serve --model "$model" --port $port --served-model-name smollm2 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' EXIT
for i in $(seq 1 120); do curl -sf localhost:$port/health >/dev/null && break; sleep 0.5; done
for c in 1 8 32; do
  n=$(( c < 8 ? 8 : c * 2 ))
  $bin bench --base-url http://127.0.0.1:$port --model smollm2 --input-tokens 128 --output-tokens 64 \
    --concurrency $c --num-requests $n --seed 1 --no-progress --json "$out/c$c.json" | tee "$out/c$c.txt"
done
python3 - "$out" <<'PY'
import json, sys
print(f"{'conc':>4} {'req/s':>7} {'out tok/s':>9} {'ttft p50':>9} {'ttft p99':>9} {'itl p50':>8} {'itl p99':>8} {'failed':>6}")
for c in (1, 8, 32):
    r = json.load(open(f"{sys.argv[1]}/c{c}.json"))
    print(f"{c:>4} {r['request_throughput']:>7.2f} {r['output_tokens_per_s']:>9.1f} {r['ttft_ms']['p50']:>9.0f} {r['ttft_ms']['p99']:>9.0f} {r['itl_ms']['p50']:>8.1f} {r['itl_ms']['p99']:>8.1f} {r['requests_failed']:>6}")
PY
