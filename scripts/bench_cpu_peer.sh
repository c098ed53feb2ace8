#!/usr/bin/env bash
# CPU decode against llama.cpp on the same GGUF files, in one run: tokens/s at batch 1 and 8.
#
#   scripts/bench_cpu_peer.sh CORRIDOR LLAMA_BIN_DIR FILE.gguf [FILE.gguf ...]
#
# CORRIDOR: a release `corridor` binary. LLAMA_BIN_DIR: llama.cpp's CPU tools (llama-bench and
# llama-batched-bench, built from the llama-cpp-python sdist: scripts/build_llama_cpp.sh, with
# `--target llama-bench llama-batched-bench`). Both use 2 threads. For each file:
#   prefill: `corridor generate` on a 512-token prompt (its "prompt tok/s") against
#            `llama-bench -p 512 -n 0` (pp512), 3 runs each;
#   long context: a 2,031-token prompt then 64 tokens generated (prompt and decode rates) against
#            `llama-bench -p 2048 -n 0` and `llama-bench -p 0 -n 64 -d 2031` (tg64 after 2,031), 2 runs;
#   batch 1: `corridor generate` (128 tokens, EOS ignored; its "decode" rate) against
#            `llama-bench -p 0 -n 128` (tg128), 3 runs each;
#   batch 8: `corridor serve --devices cpu` driven by `corridor bench` (8 requests at once, 128-token
#            prompts, 128 generated; decode rate = 8 / ITL p50) against
#            `llama-batched-bench -npp 128 -ntg 128 -npl 8` (its S_TG).
# Run it on an otherwise idle machine: both programs' rates fall with any other load.
set -uo pipefail
bin=$1 lcpp=$2
shift 2
threads=${THREADS:-2}
port=${PORT:-18093}
# llama.cpp repacks some formats at load where the CPU has kernels for another layout (AMX, AVX-512:
# on an AMX Xeon its Q4_1 decodes twice as fast repacked); every llama.cpp measurement runs with
# repacking on and off (REPACKS, default "1 0"), each line labelled, a run that crashes or prints
# nothing said so.
repacks=${REPACKS:-1 0}
lbench() { # LABEL PATTERN llama-bench-args...
    local label=$1 pat=$2 rp line
    shift 2
    for rp in $repacks; do
        line=$("$lcpp/llama-bench" -t "$threads" -m "$f" "$@" --repack "$rp" 2>/dev/null | grep -E "$pat")
        echo "llama.cpp $label (repack $rp): ${line:-no result (llama-bench failed)}"
    done
}
for f in "$@"; do
    name=$(basename "$f")
    echo "=== $name"
    rates=()
    for run in 1 2 3; do
        r=$("$bin" --log warn generate --model "$f" --prompt "Write a long story about a lighthouse keeper." \
            --chat --max-tokens 128 --ignore-eos --threads "$threads" 2>&1 >/dev/null |
            grep -oE "decode [0-9.]+ tok/s" | grep -oE "[0-9.]+")
        rates+=("$r")
    done
    echo "corridor batch 1 decode tok/s: ${rates[*]}"
    # 73 repetitions of this sentence are 512 tokens for SmolLM2's tokenizer (the count is printed).
    long=$(python3 -c 'print("The lighthouse keeper watched the sea. " * 73)')
    pre=()
    for run in 1 2 3; do
        r=$("$bin" --log warn generate --model "$f" --prompt "$long" --max-tokens 1 --threads "$threads" \
            2>&1 >/dev/null | grep -oE "^\[[0-9]+ prompt tokens|[0-9.]+ prompt tok/s" | grep -oE "^\[?[0-9.]+" | tr -d '[' | paste -sd':')
        pre+=("$r")
    done
    echo "corridor prefill (prompt tokens, tok/s): ${pre[*]}"
    lbench prefill pp512 -p 512 -n 0 -r 3
    # 290 repetitions are 2,031 tokens.
    longer=$(python3 -c 'print("The lighthouse keeper watched the sea. " * 290)')
    for run in 1 2; do
        "$bin" --log warn generate --model "$f" --prompt "$longer" --max-tokens 64 --ignore-eos \
            --threads "$threads" 2>&1 >/dev/null | grep -oE "^\[[0-9]+ prompt tokens|[0-9.]+ prompt tok/s|decode [0-9.]+ tok/s" |
            paste -sd' ' | sed 's/^\[/corridor long context: /'
    done
    lbench "long prefill" pp2048 -p 2048 -n 0 -r 2
    lbench "decode after 2031" tg64 -p 0 -n 64 -d 2031 -r 2
    lbench "batch 1" tg128 -p 0 -n 128 -r 3
    "$bin" --log warn serve --model "$f" --devices cpu --threads "$threads" --port "$port" \
        --host 127.0.0.1 > /tmp/bench_cpu_peer_serve.log 2>&1 &
    pid=$!
    for _ in $(seq 120); do curl -sf -m 2 "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
    served=$(curl -sf "http://127.0.0.1:$port/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
    "$bin" bench --base-url "http://127.0.0.1:$port" --model "$served" --workload fixed --length-control on \
        --no-progress --input-tokens 128 --output-tokens 128 --concurrency 8 --num-requests 16 \
        --json /tmp/bench_cpu_peer.json > /tmp/bench_cpu_peer.txt 2>&1
    kill -INT "$pid"; wait "$pid" 2>/dev/null
    python3 - /tmp/bench_cpu_peer.json <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
p50 = r["itl_ms"]["p50"]
print(f"corridor batch 8: ITL p50 {p50:.2f} ms -> {8000 / p50:.1f} tok/s decode "
      f"({r['requests_completed']}/{r['requests_sent']} requests)")
PY
    for rp in $repacks; do
        flag=; [ "$rp" = 0 ] && flag=--no-repack
        if "$lcpp/llama-batched-bench" -m "$f" -t "$threads" -c 4096 -npp 128 -ntg 128 -npl 8 $flag \
            > /tmp/bench_cpu_peer_lbb.txt 2>&1; then
            grep -E "^\|" /tmp/bench_cpu_peer_lbb.txt | tail -n 1 | sed "s/^/llama.cpp batch 8 (repack $rp): /"
        else
            echo "llama.cpp batch 8 (repack $rp): llama-batched-bench exited with status $? (see /tmp/bench_cpu_peer_lbb.txt)"
        fi
    done
done
