#!/usr/bin/env bash
# The floor under sustained foreign growth on one H200, in one run: a Llama-3-8B-shaped model
# (random bf16 weights) served with KV filling the card, 32 streams of load, and a foreign process
# that grows 8 GiB in 1 GiB steps, holds it, frees it, every PERIOD_S seconds.
#   .gpu/corridor              the server and bench client (cargo build --release --features cuda)
#   .gpu/llama3-tokenizer/     tokenizer.json + tokenizer_config.json of Llama 3
# Run:   OUT=/some/dir SOAK_S=300 scripts/gpu/relief_soak.sh
#
# Steps (logs under $OUT):
#   a. the checkpoint in /tmp/llama8b (make_llama8b.py; kept if already there)
#   b. corridor serve on cuda:0 (32 running, context 4096, flight recorder)      -> serve.log
#   c. baseline: 32 streams, 512 in / 128 out, BASE_S seconds, no intruder     -> base.json
#   d. soak: the same load for SOAK_S seconds while scripts/gpu/intruder.py cycles -> soak.json,
#      intruder.log; /v1/memory and /v1/engine/stats sampled before and after
#   e. /v1/memory, `corridor memory`, /metrics, /v1/engine/stats; the server stopped with SIGINT
set -uo pipefail
cd "$(dirname "$0")/../.."
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export CORRIDOR_CACHE_DIR=${CORRIDOR_CACHE_DIR:-/tmp/corridor-cache}
out=${OUT:-/tmp}
mkdir -p "$out"
exec > >(tee "$out/relief_soak.log") 2>&1

BIN=${CORRIDOR_BIN:-.gpu/corridor}
MODEL_DIR=${MODEL_DIR:-/tmp/llama8b}
PORT=${PORT:-8000}
URL=http://127.0.0.1:$PORT
BASE_S=${BASE_S:-45}
SOAK_S=${SOAK_S:-300}
PERIOD_S=${PERIOD_S:-30}
SECONDS=0
header() { echo; echo "=== [${SECONDS}s] $*"; }

# stop_server (SIGINT, then SIGKILL after 60 s) on exit; ensure_checkpoint.
source scripts/gpu/server_lib.sh

header "a. card and checkpoint"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
ensure_checkpoint "$MODEL_DIR"

header "b. corridor serve"
mkdir -p "$out/flight"
"$BIN" serve --model "$MODEL_DIR" --devices cuda:0 --max-running-requests ${MAX_RUNNING:-128} --max-batched-tokens 2048 \
    --context-length ${CONTEXT:-8192} --host 127.0.0.1 --port "$PORT" --flight-dir "$out/flight" > "$out/serve.log" 2>&1 &
server_pid=$!
for _ in $(seq 300); do
    kill -0 "$server_pid" 2>/dev/null || { echo "server exited"; tail -n 40 "$out/serve.log"; exit 1; }
    curl -sf -m 2 "$URL/health" >/dev/null 2>&1 && break
    sleep 1
done
served=$(curl -sf -m 5 "$URL/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
echo "healthy; serving $served"
grep -E "KV sized|committed|boot" "$out/serve.log" | tail -n 4

load() { # NAME SECONDS
    timeout $(( $2 + 120 )) "$BIN" bench --base-url "$URL" --model "$served" --workload fixed --length-control on \
        --no-progress --request-timeout 120 --input-tokens 512 --output-tokens 128 --concurrency 32 \
        --duration "$2" --json "$out/$1.json" 2>&1 | tail -n 25 > "$out/$1.txt"
}

header "c. baseline: 32 streams for ${BASE_S}s, no intruder"
curl -s "$URL/v1/engine/stats" > "$out/stats_before_base.json"
load base "$BASE_S"
cat "$out/base.txt"

header "d. soak: 32 streams for ${SOAK_S}s; an intruder grows 8 GiB in 1 GiB steps every ${PERIOD_S}s"
curl -s "$URL/v1/engine/stats" > "$out/stats_before_soak.json"
curl -s "$URL/v1/memory" > "$out/memory_before_soak.json"
python3 scripts/gpu/intruder.py --seconds "$SOAK_S" --period "$PERIOD_S" --steps 8 --step-gib 1 --hold 10 \
    > "$out/intruder.log" 2>&1 &
intruder=$!
load soak "$SOAK_S"
wait "$intruder"
cat "$out/soak.txt"
tail -n 5 "$out/intruder.log"
sleep 8 # KV grows back after the hold time

header "e. memory and counters"
curl -s "$URL/v1/memory" > "$out/memory_after.json"
curl -s "$URL/v1/engine/stats" > "$out/stats_after.json"
curl -s "$URL/metrics" > "$out/metrics.txt"
"$BIN" memory --url "$URL" | tee "$out/corridor_memory.txt"
python3 - "$out" <<'EOF'
import json, sys
out = sys.argv[1]
s0 = json.load(open(f"{out}/stats_before_soak.json")); s1 = json.load(open(f"{out}/stats_after.json"))
m = json.load(open(f"{out}/memory_after.json"))["cards"][0]
def tput(name):
    r = json.load(open(f"{out}/{name}.json"))
    return r.get("summary", r)
print("engine stats delta during the soak:",
      {k: s1[k] - s0[k] for k in s1 if isinstance(s1[k], (int, float)) and k in s0 and s1[k] != s0[k]})
print("card0: breaches", m["breaches"], "intrusions", m["intrusions"], "restore_ms_max", m["restore_ms_max"],
      "min_free", m["min_free_bytes"] >> 20, "MiB", "free", m["free_bytes"] >> 20, "MiB",
      "floor", m["floor_bytes"] >> 20, "MiB")
EOF
grep -cE "preempting request" "$out/serve.log" | sed 's/^/preemption log lines: /'
grep -E "relief exhausted|gave KV memory back|preempting" "$out/serve.log" | tail -n 12
grep -E "under its floor|floor restored" "$out/serve.log" | tail -n 6
stop_server
echo "done in ${SECONDS}s"
