#!/usr/bin/env bash
# The H200 benchmark of the CUDA backend on a Llama-3-8B-shaped model (random bf16 weights), in one
# run on the GPU machine. Everything it needs is built here and carried in .gpu/:
#   .gpu/corridor              the server and bench client (cargo build --release, CUDA enabled)
#   .gpu/corridor-gpu-check    the GPU check binary (crates/gpu-check), for its `logits` mode
#   .gpu/llama3-tokenizer/     tokenizer.json + tokenizer_config.json of Llama 3
# Run from anywhere:   OUT=/some/dir scripts/gpu/bench8b.sh
#
# Steps (each logs to $OUT, default /tmp, under a "=== [elapsed] step" header):
#   a. nvidia-smi; the checkpoint in /tmp/llama8b (make_llama8b.py; kept if already there)
#   b. logits of 16 fixed tokens: transformers fp32 vs corridor-gpu-check      -> logits.log
#   c. corridor serve on cuda:0 (max 128 running, 8192 batched tokens, context 8192) -> serve.log
#   d. decode: 512 in / 256 out at concurrency 1 8 32 128                      -> decode_B.json
#   e. prefill: 2048 and 8192 prompt tokens, 1 out, one at a time               -> prefill_P.json
#      (8192 words + BOS + 1 output exceed the 8192 context, so that case sends 8000: prefill_8000.json)
#   f. latency: 512 in / 128 out at concurrency 1 16 64                         -> latency_C.json
#   g. /v1/memory, `corridor memory`, /metrics, /v1/engine/stats; server stopped with SIGINT
#   h. summarize_bench.py                                                       -> summary.md
# A failed step is logged and the run goes on, so one run yields as much as it can; the exit status
# is 1 when any step failed. The whole run keeps within DEADLINE_S (default 540 s): steps that
# would start too late are skipped and the summary is still written.
#
# Environment (all optional):
#   OUT                    where logs and reports go (default /tmp)
#   SKIP_MAKE=1 SKIP_LOGITS=1 SKIP_SERVE=1 SKIP_DECODE=1 SKIP_PREFILL=1 SKIP_LATENCY=1
#                          skip steps (SKIP_SERVE skips c-g)
#   DECODE_BATCHES PREFILL_LENS LATENCY_CONC   the sweep lists ("1 8 32 128", "2048 8192", "1 16 64")
#   SERVE_ARGS             extra `corridor serve` flags (e.g. "--device-sampling off" for an A/B)
#   DEADLINE_S BENCH_TIMEOUT_S                 run and per-bench limits in seconds (540, 180)
#   MODEL_DIR TOKENIZER_DIR CORRIDOR_BIN CORRIDOR_E2E DEVICES PORT CONTEXT_LENGTH HF_DEVICE
set -uo pipefail
cd "$(dirname "$0")/../.."
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export CORRIDOR_CACHE_DIR=${CORRIDOR_CACHE_DIR:-/tmp/corridor-cache}
export NCCL_NVLS_ENABLE=0

out=${OUT:-/tmp}
mkdir -p "$out"
exec > >(tee "$out/bench8b.log") 2>&1

BIN=${CORRIDOR_BIN:-.gpu/corridor}
E2E=${CORRIDOR_E2E:-.gpu/corridor-gpu-check}
TOKENIZER_DIR=${TOKENIZER_DIR:-.gpu/llama3-tokenizer}
MODEL_DIR=${MODEL_DIR:-/tmp/llama8b}
DEVICES=${DEVICES:-cuda:0}
PORT=${PORT:-8000}
CONTEXT=${CONTEXT_LENGTH:-8192}
URL=http://127.0.0.1:$PORT
VOCAB=128256
DEADLINE_S=${DEADLINE_S:-540}
BENCH_TIMEOUT_S=${BENCH_TIMEOUT_S:-180}
DECODE_BATCHES=${DECODE_BATCHES:-1 8 32 128}
PREFILL_LENS=${PREFILL_LENS:-2048 8192}
LATENCY_CONC=${LATENCY_CONC:-1 16 64}

# The logits prompt, hard-coded: <|begin_of_text|> followed by the Llama-3 tokenizer's encoding of
# "The capital of France is Paris, and the capital of Germany is Berlin." (16 ids). The weights are
# random, so the text only makes the ids realistic; what is checked is corridor against transformers.
IDS=128000,791,6864,315,9822,374,12366,11,323,279,6864,315,10057,374,20437,13

SECONDS=0
failed=()
passed=()
skipped=()
server_pid=

header() { echo; echo "=== [${SECONDS}s] $*"; }
# Step outcomes, also listed in $out/steps.txt for the summary.
: > "$out/steps.txt"
ok() { passed+=("$1"); echo "--- ok: $1"; echo "ok $1" >> "$out/steps.txt"; }
fail() { failed+=("$1"); echo "--- FAILED: $1${2:+ ($2)}"; echo "failed $1${2:+ ($2)}" >> "$out/steps.txt"; }
skip() { skipped+=("$1"); echo "--- skipped: $1${2:+ ($2)}"; echo "skipped $1${2:+ ($2)}" >> "$out/steps.txt"; }
left() { echo $((DEADLINE_S - SECONDS)); }
# Whether a step that needs about $2 seconds may still start; logs a skip otherwise.
time_for() {
    if (( $(left) < $2 )); then
        skip "$1" "$(left) s left of DEADLINE_S=$DEADLINE_S, the step needs about $2 s"
        return 1
    fi
}

stop_server() {
    [ -n "$server_pid" ] || return 0
    if kill -0 "$server_pid" 2>/dev/null; then
        header "stopping the server (SIGINT to pid $server_pid)"
        kill -INT "$server_pid" 2>/dev/null
        for _ in $(seq 60); do kill -0 "$server_pid" 2>/dev/null || break; sleep 1; done
        if kill -0 "$server_pid" 2>/dev/null; then
            echo "server still running 60 s after SIGINT; sending SIGKILL"
            kill -KILL "$server_pid" 2>/dev/null
        fi
    fi
    wait "$server_pid" 2>/dev/null
    echo "server exited with status $?"
    server_pid=
}
trap stop_server EXIT

# ---------------------------------------------------------------- a. card and checkpoint
header "a. card"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$out/nvidia-smi.txt"
    nvidia-smi >> "$out/nvidia-smi.txt"
else
    echo "nvidia-smi not found" | tee "$out/nvidia-smi.txt"
fi
for f in "$BIN" "$E2E"; do [ -x "$f" ] || echo "WARNING: $f is missing or not executable"; done
[ -x "$BIN" ] && { "$BIN" --version 2>/dev/null || true; }

header "a. checkpoint $MODEL_DIR (Llama-3-8B shape, random bf16)"
if [ "${SKIP_MAKE:-0}" = 1 ]; then
    skip checkpoint "SKIP_MAKE=1"
else
    python3 scripts/gpu/make_llama8b.py "$MODEL_DIR" --tokenizer-dir "$TOKENIZER_DIR" 2>&1 | tee "$out/make_llama8b.log"
    if [ "${PIPESTATUS[0]}" = 0 ]; then ok checkpoint; else fail checkpoint "see make_llama8b.log"; fi
fi
du -sh "$MODEL_DIR" 2>/dev/null

# ---------------------------------------------------------------- b. logits
if [ "${SKIP_LOGITS:-0}" = 1 ]; then
    header "b. logits"; skip logits "SKIP_LOGITS=1"
elif time_for logits 200; then
    header "b. logits: transformers fp32 vs corridor-gpu-check over $IDS" | tee "$out/logits.log"
    ref=/tmp/ref.f32 got=/tmp/got.f32
    # The reference depends only on the checkpoint and the ids: reuse it when both are unchanged.
    stamp="$IDS $(stat -c %Y "$MODEL_DIR/config.json" 2>/dev/null)"
    if [ -s "$ref" ] && [ "$(cat "$ref.stamp" 2>/dev/null)" = "$stamp" ]; then
        echo "reusing $ref (same checkpoint and ids)" | tee -a "$out/logits.log"
    else
        rm -f "$ref" "$ref.stamp"
        timeout 300 python3 scripts/gpu/hf_logits.py "$MODEL_DIR" --ids "$IDS" --out "$ref" --device "${HF_DEVICE:-cuda}" 2>&1 | tee -a "$out/logits.log"
        [ "${PIPESTATUS[0]}" = 0 ] && echo "$stamp" > "$ref.stamp"
        # The same forward in bf16: the error a plain bf16 implementation makes, the tolerance's yardstick.
        timeout 300 python3 scripts/gpu/hf_logits.py "$MODEL_DIR" --ids "$IDS" --out /tmp/peer_bf16.f32 --dtype bfloat16 --device "${HF_DEVICE:-cuda}" 2>&1 | tee -a "$out/logits.log"
    fi
    rm -f "$got"
    echo "--- $E2E logits $MODEL_DIR $IDS $got" | tee -a "$out/logits.log"
    timeout 300 "$E2E" logits "$MODEL_DIR" "$IDS" "$got" 2>&1 | tee -a "$out/logits.log"
    e2e_rc=${PIPESTATUS[0]}
    if [ -s "$ref" ] && [ -s "$got" ]; then
        peer=(); [ -s /tmp/peer_bf16.f32 ] && peer=(--peer /tmp/peer_bf16.f32)
        python3 scripts/gpu/compare_logits.py "$ref" "$got" --vocab "$VOCAB" "${peer[@]}" 2>&1 | tee -a "$out/logits.log"
        case "${PIPESTATUS[0]}" in
            0) ok logits ;;
            1) fail logits "corridor's logits differ from the reference: see logits.log" ;;
            *) fail logits "the logit files could not be compared" ;;
        esac
    else
        echo "RESULT NOT RUN: reference present: $([ -s "$ref" ] && echo yes || echo no), corridor logits present: $([ -s "$got" ] && echo yes || echo no) (corridor-gpu-check status $e2e_rc)" | tee -a "$out/logits.log"
        fail logits "a logit file is missing"
    fi
fi

# ---------------------------------------------------------------- c. server
served=
if [ "${SKIP_SERVE:-0}" = 1 ]; then
    header "c. server"; skip serve "SKIP_SERVE=1"
elif time_for serve 90; then
    header "c. corridor serve --model $MODEL_DIR --devices $DEVICES on port $PORT"
    mkdir -p "$out/flight"
    "$BIN" serve --model "$MODEL_DIR" --devices "$DEVICES" \
        --max-running-requests 128 --max-batched-tokens 8192 --context-length "$CONTEXT" \
        --host 127.0.0.1 --port "$PORT" --flight-dir "$out/flight" ${SERVE_ARGS:-} > "$out/serve.log" 2>&1 &
    server_pid=$!
    echo "server pid $server_pid; waiting for GET /health (up to 300 s)"
    up=0
    for _ in $(seq 300); do
        if ! kill -0 "$server_pid" 2>/dev/null; then break; fi
        if curl -sf -m 2 "$URL/health" >/dev/null 2>&1; then up=1; break; fi
        sleep 1
    done
    if [ "$up" = 1 ]; then
        echo "healthy after ${SECONDS}s of the run"
        served=$(curl -sf -m 5 "$URL/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])' 2>/dev/null)
        served=${served:-$(basename "$MODEL_DIR")}
        echo "served model name: $served"
        grep -iE "KV|sized|card|memory" "$out/serve.log" | tail -n 8
        ok serve
    else
        if kill -0 "$server_pid" 2>/dev/null; then
            fail serve "no answer on /health within 300 s"
        else
            wait "$server_pid" 2>/dev/null; fail serve "the server exited with status $? before answering /health"
            server_pid=
        fi
        echo "--- last lines of serve.log"; tail -n 40 "$out/serve.log"
        stop_server
    fi
fi

# One `corridor bench` run: bench NAME SECONDS_NEEDED ARGS... -> $out/NAME.json and NAME.txt.
# Each run draws its prompts from a seed of its own, so no run finds its prompts in the prefix
# cache from an earlier one (a latency run after the decode runs would otherwise skip most of its
# prefill, and its TTFT and ITL p99 would not be those of new prompts).
bench_seed=100
bench() {
    local name=$1 need=$2; shift 2
    bench_seed=$(( bench_seed + 1 ))
    time_for "$name" "$need" || return 0
    header "bench $name: $*"
    if [ -n "$server_pid" ] && ! kill -0 "$server_pid" 2>/dev/null; then
        fail "$name" "the server is no longer running (see serve.log)"; return 0
    fi
    local limit=$BENCH_TIMEOUT_S
    (( limit > $(left) - 30 )) && limit=$(( $(left) - 30 ))
    (( limit < 10 )) && limit=10
    rm -f "$out/$name.json"
    curl -s -m 5 "$URL/v1/engine/stats" > "$out/$name.stats0.json"
    timeout "$limit" "$BIN" bench --base-url "$URL" --model "$served" --workload fixed \
        --length-control on --no-progress --request-timeout 120 --seed "$bench_seed" --json "$out/$name.json" "$@" \
        2>&1 | tee "$out/$name.txt"
    local rc=${PIPESTATUS[0]}
    curl -s -m 5 "$URL/v1/engine/stats" > "$out/$name.stats1.json"
    python3 scripts/gpu/step_phases.py "$out/$name.stats0.json" "$out/$name.stats1.json" | tee -a "$out/$name.txt"
    if [ ! -s "$out/$name.json" ]; then
        fail "$name" "no report (bench status $rc$( [ "$rc" = 124 ] && echo ", stopped after $limit s"))"
    elif python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); sys.exit(0 if d["requests_completed"] > 0 and d["requests_failed"] == 0 else 1)' "$out/$name.json"; then
        ok "$name"
    else
        fail "$name" "requests failed: see $name.txt"
    fi
}

if [ -n "$served" ]; then
    # A short warm-up so the first measured run does not pay for first-use compilation.
    bench warmup 60 --input-tokens 512 --output-tokens 16 --concurrency 8 --num-requests 8

    # ------------------------------------------------------------ d. decode
    if [ "${SKIP_DECODE:-0}" = 1 ]; then skip decode "SKIP_DECODE=1"; else
        for b in $DECODE_BATCHES; do
            n=$(( b * 2 > 4 ? b * 2 : 4 ))
            bench "decode_$b" 40 --input-tokens 512 --output-tokens 256 --concurrency "$b" --num-requests "$n"
        done
    fi

    # ------------------------------------------------------------ e. prefill
    if [ "${SKIP_PREFILL:-0}" = 1 ]; then skip prefill "SKIP_PREFILL=1"; else
        for p in $PREFILL_LENS; do
            # The prompt's words are one Llama-3 token each, and a BOS token may be added: a prompt
            # of P words is up to P+1 tokens, plus the one output token, and must fit the context.
            # For 8192 with the 8192 context that is 8194 tokens: 8000 words are sent instead.
            if (( p + 2 > CONTEXT )); then
                echo "prefill $p: $p words + BOS + 1 output token = $((p + 2)) tokens exceed the context of $CONTEXT;" \
                     "sending $((CONTEXT - 192)) words instead (file prefill_$((CONTEXT - 192)).json)"
                p=$((CONTEXT - 192))
            fi
            bench "prefill_$p" 30 --input-tokens "$p" --output-tokens 1 --concurrency 1 --num-requests 5
        done
    fi

    # ------------------------------------------------------------ f. latency
    if [ "${SKIP_LATENCY:-0}" = 1 ]; then skip latency "SKIP_LATENCY=1"; else
        for c in $LATENCY_CONC; do
            n=$(( c * 2 > 8 ? c * 2 : 8 ))
            bench "latency_$c" 30 --input-tokens 512 --output-tokens 128 --concurrency "$c" --num-requests "$n"
        done
    fi

    # ------------------------------------------------------------ g. memory and metrics
    header "g. memory and metrics"
    curl -s -m 10 "$URL/v1/memory" > "$out/memory.json"; echo "memory.json: $(wc -c < "$out/memory.json") bytes"
    curl -s -m 10 "$URL/v1/engine/stats" > "$out/engine_stats.json"
    curl -s -m 10 "$URL/metrics" > "$out/metrics.txt"; echo "metrics.txt: $(wc -l < "$out/metrics.txt") lines"
    if timeout 30 "$BIN" memory --url "$URL" > "$out/memory.txt" 2>&1; then
        cat "$out/memory.txt"; ok memory
    else
        tail -n 20 "$out/memory.txt"; fail memory "corridor memory failed"
    fi
    command -v nvidia-smi >/dev/null &&
        nvidia-smi --query-gpu=memory.used,memory.total --format=csv | tee "$out/nvidia-smi-serving.txt"
    stop_server
    echo "--- last lines of serve.log"; tail -n 15 "$out/serve.log"
elif [ "${SKIP_SERVE:-0}" != 1 ]; then
    header "d-g. benchmarks"; skip benchmarks "no server"
fi

# ---------------------------------------------------------------- h. summary
header "h. summary"
# A GGUF file's ceilings are those of its own bytes, not the bf16 checkpoint's.
case "$MODEL_DIR" in *.gguf) export WEIGHT_BYTES=$(stat -c %s "$MODEL_DIR") ;; esac
python3 scripts/gpu/summarize_bench.py "$out" | tee "$out/summary.md"

header "done in ${SECONDS}s"
echo "passed:  ${passed[*]:-none}"
echo "skipped: ${skipped[*]:-none}"
echo "failed:  ${failed[*]:-none}"
[ ${#failed[@]} -eq 0 ]
