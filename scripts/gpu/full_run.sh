#!/usr/bin/env bash
# One device call that reruns everything the CUDA issue is judged on, into
# /tmp/res, then packs it as $OUT/results.tgz (a device call returns at most
# eight files): kernel checks, tiny checkpoints GPU vs CPU, `corridor serve`
# on the GPU vs the CPU, then the Llama-3-8B-shaped benchmark (bench8b.sh).
set -uo pipefail
cd "$(dirname "$0")/../.."
res=/tmp/res; mkdir -p "$res"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export CORRIDOR_CACHE_DIR=${CORRIDOR_CACHE_DIR:-/tmp/corridor-cache}
{
    echo "== kernels vs CPU"; ./.gpu/cuda_check 2>&1 | tail -n 60
    echo "== tiny checkpoints GPU vs CPU"; ./.gpu/corridor-gpu-check tests/fixtures/tiny 2>&1
    echo "== corridor serve on the GPU vs the CPU"
    OUT=$res python3 scripts/gpu/serve_check.py ./.gpu/corridor tests/fixtures/tiny/llama-f32 tests/fixtures/tiny/qwen3 \
        tests/fixtures/tiny/llama-q.gguf tests/fixtures/tiny/qwen2-f16.gguf tests/fixtures/tiny/mistral 2>&1
} > "$res/checks.log" 2>&1
grep -E "comparisons|checkpoints failed|^[0-9]+ failures|^FAIL" "$res/checks.log"
OUT=$res DEADLINE_S=${DEADLINE_S:-420} bash scripts/gpu/bench8b.sh > "$res/bench8b.log" 2>&1
out=${OUT:-/tmp}
cp "$res/summary.md" "$res/checks.log" "$out/" 2>/dev/null
tar czf "$out/results.tgz" -C "$res" --exclude='*.f32' .
grep -H "engine steps" "$res"/decode_*.txt "$res"/latency_*.txt
grep -E "peer|RESULT" "$res/logits.log"
