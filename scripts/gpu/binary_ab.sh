#!/usr/bin/env bash
# Same-run A/B of two corridor binaries on one GPU (the Llama-3-8B-shaped checkpoint of
# make_llama8b.py): each serves in turn and bench8b.sh measures decode at DECODE_BATCHES and
# prefill at PREFILL_LENS; the tiny checkpoints go through the GPU check of the new build first.
#   OUT=/tmp/ab A=.gpu/corridor-before B=.gpu/corridor scripts/gpu/binary_ab.sh
# SIDES (default "A B") names the runs in order; each side X runs binary $X (default: $B) with
# the serve flags in X_ARGS, e.g. SIDES="A B C" C_ARGS="--cuda-early-weights off", and decodes at
# X_BATCHES (default DECODE_BATCHES).
# MODEL_DIR (a checkpoint directory or a GGUF file) and SKIP_* reach bench8b.sh; SKIP_TINY=1 skips
# the tiny checkpoints' check.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/ab}
mkdir -p "$out"
A=${A:-.gpu/corridor-before}
B=${B:-.gpu/corridor}
export DECODE_BATCHES=${DECODE_BATCHES:-1 32} PREFILL_LENS=${PREFILL_LENS:-2048}
if [ -z "${SKIP_TINY:-}" ]; then
    echo "=== tiny checkpoints, GPU against CPU (new build)"
    timeout 120 .gpu/corridor-gpu-check tests/fixtures/tiny 2>&1 | tail -n 14
fi
for side in ${SIDES:-A B}; do
    bin=${!side:-$B}
    args_var=${side}_ARGS batches_var=${side}_BATCHES
    echo "=== $side: $bin ${!args_var:-}"
    DECODE_BATCHES=${!batches_var:-$DECODE_BATCHES} SERVE_ARGS=${!args_var:-} CORRIDOR_BIN=$bin OUT="$out/$side" SKIP_LOGITS=1 SKIP_LATENCY=1 DEADLINE_S=${SIDE_DEADLINE_S:-210} \
        scripts/gpu/bench8b.sh > "$out/$side.log" 2>&1
    echo "status $?"
    for f in "$out/$side"/decode_[0-9]*.json "$out/$side"/prefill_[0-9]*.json; do
        case $f in *stats*) continue ;; esac
        [ -s "$f" ] && python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
def num(v, fmt):
    return fmt % v if isinstance(v, (int, float)) else "-"
p50 = lambda k: (d.get(k) or {}).get("p50")
print(sys.argv[1].split("/")[-1], "out tok/s", num(d.get("output_tokens_per_s"), "%.1f"), "in tok/s",
      num(d.get("input_tokens_per_s"), "%.1f"), "itl p50", num(p50("itl_ms"), "%.2f ms"),
      "ttft p50", num(p50("ttft_ms"), "%.1f ms"))' "$f"
    done
done
