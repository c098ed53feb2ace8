#!/usr/bin/env bash
# The H200 benchmark of the Qwen3.5 hybrid on the CUDA backend: a Qwen3.5-27B-shaped model with
# random bf16 weights (about 54 GB; scripts/gpu/make_qwen35_27b.py states the shape), decode at
# batch 1 and 32 and prefill of 2048 and 8192 tokens, printed as fractions of their floors
# (scripts/gpu/qwen35_floors.py). Everything it needs is built here and carried in .gpu/:
#   .gpu/corridor              the server and bench client (cargo build --release --features cuda)
#   .gpu/corridor-gpu-check    the GPU check binary (crates/gpu-check), for its `logits` mode
#   .gpu/llama3-tokenizer/     tokenizer.json + tokenizer_config.json (Llama 3's; any whose ids fit)
# Run from anywhere:   OUT=/some/dir scripts/gpu/bench_qwen35.sh
#
# Steps (each logs to $OUT, default /tmp/qwen35, under a "=== [elapsed] step" header):
#   a. nvidia-smi; the checkpoint in $MODEL_DIR (default /tmp/qwen35_27b; kept if already there:
#      a second run skips the minutes of writing 54 GB). It needs about 55 GB of free disk. Its
#      vocabulary is the served tokenizer's 128256 ids (VOCAB), not Qwen3.5's 248320: the server
#      detokenizes every sampled id, and random logits pick ids past a smaller tokenizer. That
#      is 2.5 GB less embedding and lm_head (51.3 GB in all); the floors count the bytes there are.
#   b. logits of 16 fixed tokens: transformers (bf16 on the GPU) vs corridor-gpu-check  -> logits.log
#      (a float32 reference would need 108 GB of device memory; SKIP_LOGITS=1 leaves it out)
#   c. corridor serve on cuda:0 (max 32 running, 8192 batched tokens, context 10240)     -> serve.log
#   d. decode: 512 in / 256 out at concurrency 1 and 32                               -> decode_B.json
#   e. prefill: 2048 and 8192 prompt tokens, 1 out, one at a time                     -> prefill_P.json
#   f. qwen35_floors.py                                                               -> summary.md
# A failed step is logged and the run goes on; the exit status is 1 when any step failed. The run
# keeps within DEADLINE_S (default 560 s): steps that would start too late are skipped.
#
# Environment (all optional):
#   OUT MODEL_DIR TOKENIZER_DIR CORRIDOR_BIN CORRIDOR_E2E DEVICES PORT CONTEXT_LENGTH LAYERS VOCAB
#   SKIP_MAKE=1 SKIP_LOGITS=1 SKIP_DECODE=1 SKIP_PREFILL=1
#   DECODE_BATCHES PREFILL_LENS ("1 32", "2048 8192")   DEADLINE_S BENCH_TIMEOUT_S (560, 150)
set -uo pipefail
cd "$(dirname "$0")/../.."
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export CORRIDOR_CACHE_DIR=${CORRIDOR_CACHE_DIR:-/tmp/corridor-cache}

out=${OUT:-/tmp/qwen35}
mkdir -p "$out"
exec > >(tee "$out/bench_qwen35.log") 2>&1

BIN=${CORRIDOR_BIN:-.gpu/corridor}
E2E=${CORRIDOR_E2E:-.gpu/corridor-gpu-check}
TOKENIZER_DIR=${TOKENIZER_DIR:-.gpu/llama3-tokenizer}
MODEL_DIR=${MODEL_DIR:-/tmp/qwen35_27b}
DEVICES=${DEVICES:-cuda:0}
PORT=${PORT:-8000}
CONTEXT=${CONTEXT_LENGTH:-10240}
URL=http://127.0.0.1:$PORT
VOCAB=${VOCAB:-128256}
DEADLINE_S=${DEADLINE_S:-560}
BENCH_TIMEOUT_S=${BENCH_TIMEOUT_S:-150}
DECODE_BATCHES=${DECODE_BATCHES:-1 32}
PREFILL_LENS=${PREFILL_LENS:-2048 8192}
# Llama 3's encoding of "<|begin_of_text|>The capital of France is Paris, and the capital of Germany
# is Berlin." (16 ids, all inside the vocabulary); the weights are random, so only corridor against
# transformers is checked.
IDS=128000,791,6864,315,9822,374,12366,11,323,279,6864,315,10057,374,20437,13

SECONDS=0
failed=()
server_pid=
header() { echo; echo "=== [${SECONDS}s] $*"; }
ok() { echo "--- ok: $1"; }
fail() { failed+=("$1"); echo "--- FAILED: $1${2:+ ($2)}"; }
left() { echo $((DEADLINE_S - SECONDS)); }
time_for() {
    if (( $(left) < $2 )); then
        echo "--- skipped: $1 ($(left) s left of DEADLINE_S=$DEADLINE_S, it needs about $2 s)"
        return 1
    fi
}
stop_server() {
    [ -n "$server_pid" ] || return 0
    if kill -0 "$server_pid" 2>/dev/null; then
        header "stopping the server (SIGINT to pid $server_pid)"
        kill -INT "$server_pid" 2>/dev/null
        for _ in $(seq 60); do kill -0 "$server_pid" 2>/dev/null || break; sleep 1; done
        kill -0 "$server_pid" 2>/dev/null && kill -KILL "$server_pid" 2>/dev/null
    fi
    wait "$server_pid" 2>/dev/null
    server_pid=
}
trap stop_server EXIT

# ---------------------------------------------------------------- a. card and checkpoint
header "a. card"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv 2>&1 | tee "$out/nvidia-smi.txt"
df -h "$(dirname "$MODEL_DIR")" | tail -n 1
for f in "$BIN" "$E2E"; do [ -x "$f" ] || echo "WARNING: $f is missing or not executable"; done
header "a. checkpoint $MODEL_DIR (Qwen3.5-27B shape, random bf16)"
if [ "${SKIP_MAKE:-0}" != 1 ]; then
    python3 scripts/gpu/make_qwen35_27b.py "$MODEL_DIR" --tokenizer-dir "$TOKENIZER_DIR" --vocab "$VOCAB" ${LAYERS:+--layers "$LAYERS"} 2>&1 \
        | tee "$out/make.log"
    if [ "${PIPESTATUS[0]}" = 0 ]; then ok checkpoint; else fail checkpoint "see make.log"; fi
fi
du -sh "$MODEL_DIR" 2>/dev/null

# ---------------------------------------------------------------- b. logits
if [ "${SKIP_LOGITS:-0}" != 1 ] && time_for logits 200; then
    header "b. logits: transformers bf16 vs corridor-gpu-check over $IDS" | tee "$out/logits.log"
    ref=$out/ref_bf16.f32 got=$out/got.f32
    rm -f "$got"
    timeout 240 python3 scripts/gpu/hf_logits.py "$MODEL_DIR" --ids "$IDS" --out "$ref" --dtype bfloat16 --device cuda 2>&1 \
        | tee -a "$out/logits.log"
    timeout 240 "$E2E" logits "$MODEL_DIR" "$IDS" "$got" 2>&1 | tee -a "$out/logits.log"
    if [ -s "$ref" ] && [ -s "$got" ]; then
        python3 scripts/gpu/compare_logits.py "$ref" "$got" --vocab "$VOCAB" 2>&1 | tee -a "$out/logits.log"
        if [ "${PIPESTATUS[0]}" = 0 ]; then ok logits; else fail logits "see logits.log"; fi
    else
        fail logits "a logit file is missing (see logits.log)"
    fi
fi

# ---------------------------------------------------------------- c. server
served=
if time_for serve 120; then
    header "c. corridor serve --model $MODEL_DIR --devices $DEVICES"
    "$BIN" serve --model "$MODEL_DIR" --devices "$DEVICES" \
        --max-running-requests 32 --max-batched-tokens 8192 --context-length "$CONTEXT" \
        --host 127.0.0.1 --port "$PORT" > "$out/serve.log" 2>&1 &
    server_pid=$!
    for _ in $(seq 300); do
        kill -0 "$server_pid" 2>/dev/null || break
        curl -sf -m 2 "$URL/health" >/dev/null 2>&1 && { served=1; break; }
        sleep 1
    done
    if [ -n "$served" ]; then
        served=$(curl -sf -m 5 "$URL/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])' 2>/dev/null)
        served=${served:-$(basename "$MODEL_DIR")}
        echo "healthy after ${SECONDS}s; model $served"
        grep -iE "KV|state|sized|captured" "$out/serve.log" | tail -n 8
        ok serve
    else
        fail serve "no answer on /health"
        tail -n 40 "$out/serve.log"
        stop_server
    fi
fi

# One `corridor bench` run: bench NAME SECONDS_NEEDED ARGS... -> $out/NAME.json and NAME.txt.
bench() {
    local name=$1 need=$2; shift 2
    time_for "$name" "$need" || return 0
    header "bench $name: $*"
    local limit=$BENCH_TIMEOUT_S
    (( limit > $(left) - 20 )) && limit=$(( $(left) - 20 ))
    (( limit < 10 )) && limit=10
    rm -f "$out/$name.json"
    timeout "$limit" "$BIN" bench --base-url "$URL" --model "$served" --workload fixed \
        --length-control on --no-progress --request-timeout 120 --json "$out/$name.json" "$@" 2>&1 | tee "$out/$name.txt"
    if [ -s "$out/$name.json" ] && python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); sys.exit(0 if d["requests_completed"] > 0 and d["requests_failed"] == 0 else 1)' "$out/$name.json"; then
        ok "$name"
    else
        fail "$name" "no report or failed requests: see $name.txt"
    fi
}

if [ -n "$served" ]; then
    bench warmup 40 --input-tokens 256 --output-tokens 8 --concurrency 4 --num-requests 4
    if [ "${SKIP_DECODE:-0}" != 1 ]; then
        for b in $DECODE_BATCHES; do
            bench "decode_$b" 60 --input-tokens 512 --output-tokens 256 --concurrency "$b" --num-requests "$b"
        done
    fi
    if [ "${SKIP_PREFILL:-0}" != 1 ]; then
        for p in $PREFILL_LENS; do
            bench "prefill_$p" 40 --input-tokens "$p" --output-tokens 1 --concurrency 1 --num-requests 3
        done
    fi
    curl -s -m 10 "$URL/v1/memory" > "$out/memory.json"
    stop_server
    tail -n 15 "$out/serve.log"
fi

# ---------------------------------------------------------------- f. summary
header "f. summary"
python3 scripts/gpu/qwen35_floors.py "$out" "$MODEL_DIR" | tee "$out/summary.md"
header "done in ${SECONDS}s; failed: ${failed[*]:-none}"
[ ${#failed[@]} -eq 0 ]
