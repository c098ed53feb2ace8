#!/usr/bin/env bash
# The H200 benchmark of the CUDA mixture-of-experts path on a Qwen3-30B-A3B-shaped model (random
# bf16 weights, about 61 GB), in one run on the GPU machine. Built here and carried in .gpu/:
#   .gpu/corridor              the server and bench client (cargo build --release, CUDA enabled)
#   .gpu/qwen3-tokenizer/ or .gpu/llama3-tokenizer/   tokenizer.json + tokenizer_config.json
#                              (any tokenizer whose ids stay below 151936 serves for timing)
# Run from anywhere:   OUT=/some/dir scripts/gpu/bench_moe.sh
#
# Steps (each logs to $OUT, default /tmp/bench_moe, under a "=== [elapsed] step" header):
#   a. nvidia-smi; the checkpoint (make_qwen3moe.py; kept if already there) in MODEL_DIR, by
#      default /dev/shm/qwen3moe when /dev/shm has room (the 64 GiB disk of a one-GPU machine
#      barely holds it), else /tmp/qwen3moe
#   b. corridor serve on cuda:0                                                 -> serve.log
#   c. decode: 512 in / 256 out at concurrency 1 and 32                         -> decode_B.json
#   d. prefill: 2048 prompt tokens, 1 out, one at a time                        -> prefill_2048.json
#   f. (PROFILE=N) serve again with --cuda-profile N and decode one request of 512 in / 192 out:
#      the op table of a batch-1 decode step, from the server's log                -> profile.log
#   e. summary: decode at batch 1 as a fraction of the floor of the bytes a token reads (attention,
#      router, 8 experts per layer, one embedding row, lm_head: 6.08 GB, printed by the maker; plus
#      the KV it reads) at 4.3e12 B/s, the same yardstick as summarize_bench.py; decode at 32 in
#      tokens/s and step time; prefill tokens/s                                -> summary.md
# A failed step is logged and the run goes on; the exit status is 1 when any step failed.
#
# Environment (all optional): OUT MODEL_DIR TOKENIZER_DIR CORRIDOR_BIN DEVICES PORT
#   DECODE_BATCHES ("1 32") PREFILL_LENS ("2048") BENCH_TIMEOUT_S (180) SKIP_MAKE=1 LAYERS (48) PROFILE
#   BASE_ARGS, BASE_BIN (serve flags or a binary of a same-run batch-1 baseline: decode_1_base.json)
set -uo pipefail
cd "$(dirname "$0")/../.."
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export CORRIDOR_CACHE_DIR=${CORRIDOR_CACHE_DIR:-/tmp/corridor-cache}

out=${OUT:-/tmp/bench_moe}
mkdir -p "$out"
exec > >(tee "$out/bench_moe.log") 2>&1

BIN=${CORRIDOR_BIN:-.gpu/corridor}
if [ -z "${TOKENIZER_DIR:-}" ]; then
    TOKENIZER_DIR=.gpu/qwen3-tokenizer
    [ -d "$TOKENIZER_DIR" ] || TOKENIZER_DIR=.gpu/llama3-tokenizer
fi
if [ -z "${MODEL_DIR:-}" ]; then
    shm_free_gb=$(df -BG --output=avail /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)
    # The checkpoint is 61 GB = 57 GiB.
    if [ -d /dev/shm/qwen3moe ] || [ "${shm_free_gb:-0}" -ge 60 ]; then
        MODEL_DIR=/dev/shm/qwen3moe
    else
        MODEL_DIR=/tmp/qwen3moe
    fi
fi
DEVICES=${DEVICES:-cuda:0}
PORT=${PORT:-8000}
URL=http://127.0.0.1:$PORT
BENCH_TIMEOUT_S=${BENCH_TIMEOUT_S:-180}
DECODE_BATCHES=${DECODE_BATCHES:-1 32}
PREFILL_LENS=${PREFILL_LENS:-2048}
LAYERS=${LAYERS:-48}

SECONDS=0
failed=()
server_pid=
header() { echo; echo "=== [${SECONDS}s] $*"; }
ok() { echo "--- ok: $1"; }
fail() { failed+=("$1"); echo "--- FAILED: $1${2:+ ($2)}"; }

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

header "a. card"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
[ -x "$BIN" ] || echo "WARNING: $BIN is missing or not executable"

header "a. checkpoint $MODEL_DIR (Qwen3-30B-A3B shape, random bf16, $LAYERS layers)"
if [ "${SKIP_MAKE:-0}" = 1 ]; then
    echo "SKIP_MAKE=1"
else
    # As many vocabulary rows as the tokenizer has ids (see make_qwen3moe.py --vocab).
    python3 scripts/gpu/make_qwen3moe.py "$MODEL_DIR" --tokenizer-dir "$TOKENIZER_DIR" --layers "$LAYERS" --vocab tokenizer 2>&1 | tee "$out/make.log"
    if [ "${PIPESTATUS[0]}" = 0 ]; then ok checkpoint; else fail checkpoint "see make.log"; fi
fi
du -sh "$MODEL_DIR" 2>/dev/null

# serve LOG EXTRA_ARGS...: start the server, wait for /health; sets $served (empty when it failed).
serve() {
    local log=$1; shift
    header "b. corridor serve --model $MODEL_DIR --devices $DEVICES $*"
    "$BIN" serve --model "$MODEL_DIR" --devices "$DEVICES" \
        --max-running-requests 64 --max-batched-tokens 4096 --context-length 4096 \
        --host 127.0.0.1 --port "$PORT" "$@" > "$out/$log" 2>&1 &
    server_pid=$!
    served=
    for _ in $(seq 400); do
        kill -0 "$server_pid" 2>/dev/null || break
        if curl -sf -m 2 "$URL/health" >/dev/null 2>&1; then
            served=$(curl -sf -m 5 "$URL/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])' 2>/dev/null)
            served=${served:-$(basename "$MODEL_DIR")}
            break
        fi
        sleep 1
    done
    if [ -n "$served" ]; then
        ok "serve ($served, healthy after ${SECONDS}s)"
    else
        fail serve "no answer on /health"; tail -n 40 "$out/$log"; stop_server
    fi
}
serve serve.log

# bench NAME ARGS... -> $out/NAME.json and NAME.txt
bench() {
    local name=$1; shift
    header "bench $name: $*"
    rm -f "$out/$name.json"
    timeout "$BENCH_TIMEOUT_S" "$BIN" bench --base-url "$URL" --model "$served" --workload fixed \
        --length-control on --no-progress --request-timeout 120 --json "$out/$name.json" "$@" 2>&1 | tee "$out/$name.txt"
    if [ -s "$out/$name.json" ] && python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); sys.exit(0 if d["requests_completed"] > 0 and d["requests_failed"] == 0 else 1)' "$out/$name.json"; then
        ok "$name"
    else
        fail "$name" "see $name.txt"
    fi
}

if [ -n "$served" ]; then
    bench warmup --input-tokens 512 --output-tokens 16 --concurrency 8 --num-requests 8
    for b in $DECODE_BATCHES; do
        n=$(( b * 2 > 4 ? b * 2 : 4 ))
        bench "decode_$b" --input-tokens 512 --output-tokens 256 --concurrency "$b" --num-requests "$n"
    done
    for p in $PREFILL_LENS; do
        bench "prefill_$p" --input-tokens "$p" --output-tokens 1 --concurrency 1 --num-requests 5
    done
    curl -s -m 10 "$URL/v1/engine/stats" > "$out/engine_stats.json"
    stop_server
    echo "--- last lines of serve.log"; tail -n 15 "$out/serve.log"
fi

# BASE_ARGS / BASE_BIN: serve again with these flags (the switches that turn this build's changes
# off) or this binary (the build before them) and decode at batch 1 -> decode_1_base.json, a
# same-run baseline.
if [ -n "${BASE_ARGS:-}${BASE_BIN:-}" ]; then
    this_bin=$BIN
    BIN=${BASE_BIN:-$BIN}
    # shellcheck disable=SC2086
    serve base_serve.log ${BASE_ARGS:-}
    if [ -n "$served" ]; then
        bench warmup_base --input-tokens 512 --output-tokens 16 --concurrency 1 --num-requests 2
        bench decode_1_base --input-tokens 512 --output-tokens 256 --concurrency 1 --num-requests 4
        stop_server
    fi
    BIN=$this_bin
fi

if [ -n "${PROFILE:-}" ]; then
    serve profile_serve.log --cuda-profile "$PROFILE"
    if [ -n "$served" ]; then
        bench profile_decode --input-tokens 512 --output-tokens 192 --concurrency 1 --num-requests 1
        stop_server
        header "f. the op table of batch-1 decode steps (--cuda-profile $PROFILE)"
        grep -A 40 "CUDA op profile" "$out/profile_serve.log" | tail -n 41 | tee "$out/profile.log"
    fi
fi

header "e. summary"
python3 - "$out" "$LAYERS" "$MODEL_DIR" <<'EOF' | tee "$out/summary.md"
import glob, json, os, re, sys
sys.path.insert(0, "scripts/gpu")
import make_qwen3moe as shape

out, layers, model_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with open(os.path.join(model_dir, "config.json")) as f:
    shape.SHAPE["vocab_size"] = json.load(f)["vocab_size"]
HBM = 4.3e12  # B/s, the yardstick of summarize_bench.py
read = shape.token_read_bytes(layers)
kv_per_token = layers * 2 * shape.SHAPE["num_key_value_heads"] * shape.SHAPE["head_dim"] * 2


def load(name):
    try:
        with open(os.path.join(out, name + ".json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def p50(r, series):
    v = (r.get(series) or {}).get("p50")
    return float(v) if isinstance(v, (int, float)) else None


print(f"# Qwen3-30B-A3B shape ({layers} layers), random bf16, one H200\n")
print(f"Weights one decoded token reads at batch 1: {read / 1e9:.3f} GB (attention, router, 8 experts per layer, "
      f"one embedding row, lm_head); floor at {HBM / 1e12:.1f} TB/s: {read / HBM * 1e3:.3f} ms.\n")
print("| run | ITL p50 ms | output tok/s | floor ms (weights + KV) | fraction of floor |")
print("|---|---:|---:|---:|---:|")
for path in sorted(glob.glob(os.path.join(out, "decode_*.json")), key=lambda p: int(re.findall(r"\d+", os.path.basename(p))[0])):
    name = os.path.basename(path)[:-5]
    r = load(name)
    if not r:
        print(f"| {name} | unreadable | - | - | - |")
        continue
    b = int(name.split("_")[1])
    itl = p50(r, "itl_ms")
    done = r.get("requests_completed") or 0
    ctx = ((r.get("input_tokens") or 0) / done + (r.get("output_tokens") or 0) / done / 2) if done else 0
    # At batch 1 a step reads the 8 chosen experts of one token; a batch reads more experts, so
    # the floor is only stated for batch 1.
    floor_ms = (read + b * ctx * kv_per_token) / HBM * 1e3 if b == 1 else None
    frac = floor_ms / itl if (floor_ms and itl) else None
    tps = r.get("output_tokens_per_s")
    print(f"| {name} | {itl if itl is None else f'{itl:.2f}'} | {tps if tps is None else f'{tps:.0f}'} | "
          f"{'-' if floor_ms is None else f'{floor_ms:.3f}'} | {'-' if frac is None else f'{frac:.0%}'} |")
for path in sorted(glob.glob(os.path.join(out, "prefill_*.json"))):
    name = os.path.basename(path)[:-5]
    r = load(name)
    ttft = p50(r, "ttft_ms") if r else None
    p = int(name.split("_")[1])
    print(f"\n{name}: TTFT p50 {'-' if ttft is None else f'{ttft:.1f} ms'}"
          f"{'' if not ttft else f', {p / ttft * 1e3:.0f} prompt tokens/s'}")
EOF

header "done in ${SECONDS}s"
echo "failed: ${failed[*]:-none}"
[ ${#failed[@]} -eq 0 ]
