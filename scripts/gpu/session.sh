#!/usr/bin/env bash
# One GPU session's checks, in two steps so each call carries under the
# device transfer limit (binaries built on the development machine into .gpu/):
#   scripts/gpu/session.sh checks   # card + chokepoint check, kernel checks, tiny checkpoints GPU vs CPU
#   scripts/gpu/session.sh quant    # kernel checks, tiny checkpoints, then the block-format matmuls
#                                   # timed at 1 to 256 rows (cuda_check --bench-quant)
#   scripts/gpu/session.sh moeq8    # kernel checks and the tiny K-quant checkpoints (the Q4_K_M
#                                   # qwen3moe on the routed integer GEMVs), then a 30B-A3B expert
#                                   # layer of bf16 and Q4_K/Q6_K experts timed (--bench-moe)
#   scripts/gpu/session.sh gguf     # the GGUF files against llama.cpp in one plan of calls on one warm
#                                   # machine: in the background gguf_bench.sh prep (llama.cpp built
#                                   # with CUDA, the 8B checkpoint, its f16 GGUF, Q4_K_M / Q8_0 / Q4_0)
#                                   # then bench of every file once the card is free; in the
#                                   # foreground the checks, a decode layer's integer GEMVs
#                                   # (--bench-q8-layer) and the block-format matmuls of
#                                   # .gpu/cuda_check-base against .gpu/cuda_check (--bench-quant-short)
#   scripts/gpu/session.sh ab       # a same-run A/B of serve flags at batch 1 on one warm machine: in
#                                   # the background gguf_bench.sh prep (the 8B checkpoint, its f16 GGUF,
#                                   # the AB_FILES quantized; llama.cpp's CPU quantizer only), then
#                                   # binary_ab.sh (SIDES, X_ARGS, DECODE_BATCHES from the environment) on
#                                   # each AB_FILES file and the bf16 checkpoint (BF16_SIDES), the op table of any side
#                                   # run with --cuda-profile, and with TRACE=1 the per-step trace of a
#                                   # concurrency-128 latency run (step_trace.py); in the foreground the
#                                   # checks, a decode layer's integer GEMVs by .gpu/cuda_check-base and
#                                   # .gpu/cuda_check, one decode row's attention (--bench-attention), and
#                                   # with NCU_KERNEL=REGEX that GEMV by Nsight Compute
#   scripts/gpu/session.sh wait S   # the next calls: follow that plan for up to S seconds
#   scripts/gpu/session.sh itl      # every kernel against the CPU while the 8B checkpoint is written,
#                                   # then the concurrency-128 latency run once per serve-flag set of
#                                   # ITL_ARGS (sets separated by '|', "" = the defaults), one server each
#   scripts/gpu/session.sh steps    # where a served bf16 8B decode step goes: the device sampler
#                                   # alone (cuda_check --bench-sample), then bench8b.sh decode at
#                                   # STEP_BATCHES (default 1 8 32 128) with the engine's phases per
#                                   # step (step_phases.py), then at PROFILE_BATCH (default 32) with
#                                   # --cuda-profile 100 (the op table); SERVE_ARGS reach both servers
#   scripts/gpu/session.sh decode   # the decode-at-batch benchmark in one plan of calls on one warm
#                                   # machine: in the background gguf_bench.sh prep (llama.cpp built
#                                   # with CUDA, the 8B checkpoint, its f16 GGUF), then on the card:
#                                   # llama-batched-bench on the f16 file at 1, 8, 32 and 128, corridor
#                                   # serving the bf16 checkpoint at the same batches (NEW_BATCHES) and the latency run
#                                   # at concurrency 128 (bench8b.sh), .gpu/corridor-base at
#                                   # BASE_BATCHES (default 32 128) when carried, and the table
#                                   # (decode_vs_llamacpp.py); in the foreground every kernel against the
#                                   # CPU and the tiny checkpoints (SKIP_CHECKS=1: not), LCPP=0 without
#                                   # llama.cpp. NEW_ARGS / BASE_ARGS: serve flags of each run, BASE_BIN:
#                                   # the base run's binary (.gpu/corridor-base). Then `session.sh wait S`.
#   scripts/gpu/session.sh profile  # batch-1 decode steps as the card runs them (nsys_decode.sh: every
#                                   # kernel of the replayed graphs, overlaps and idle time) on a 4-layer
#                                   # Qwen3-30B-A3B-shaped checkpoint and the Llama-3-8B-shaped one, then
#                                   # bench8b.sh decode at 1 8 32 128 and the latency run at concurrency
#                                   # 128 (SERVE_ARGS reach the server: an A/B of a serve flag)
#   scripts/gpu/session.sh paris    # SmolLM2 "Paris" on the GPU, by the model and through `corridor serve`;
#                                   # first call: `cp .gpu-a/part /tmp/smol_a` (carry .gpu-a), second: this
#                                   # (carry .gpu-b and .gpu-c = corridor + corridor-gpu-check)
#   scripts/gpu/session.sh serve    # kernel checks, tiny checkpoints, then `corridor serve` on the GPU vs the
#                                   # CPU (scripts/gpu/serve_check.py) while the 8B checkpoint is written
#   scripts/gpu/bench8b.sh          # then, on the same warm machine: the Llama-3-8B-shaped benchmark
#   scripts/gpu/session.sh hybrid   # kernel checks, the tiny checkpoints, kernel timings, then the served
#                                   # Qwen3.5-27B-shaped benchmark (bench_qwen35.sh), its 51 GB checkpoint
#                                   # written while the checks run; one device call (about 9 minutes)
#   scripts/gpu/session.sh moe      # kernel checks, the tiny checkpoints (scan and chunked delta rule),
#                                   # then the served Qwen3-30B-A3B-shaped benchmark with a profiled
#                                   # batch-1 decode (bench_moe.sh), its 61 GB checkpoint in /dev/shm,
#                                   # and the decode kernels by Nsight Compute (ncu_decode.sh, 4 layers)
# Logs go to $OUT (or /tmp) as they run.
set -uo pipefail
cd "$(dirname "$0")/../.."
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export CORRIDOR_CACHE_DIR=${CORRIDOR_CACHE_DIR:-/tmp/corridor-cache}
out=${OUT:-/tmp}
# Every kernel against the CPU, then the tiny K-quant and other checkpoints GPU against CPU.
quant_checks() {
    echo "== [${SECONDS}s] kernels vs CPU"; timeout 300 ./.gpu/cuda_check > "$out/cuda_check.log" 2>&1
    echo "exit $?"; grep -E "FAIL" "$out/cuda_check.log" | head -n 25; tail -n 1 "$out/cuda_check.log"
    echo "== [${SECONDS}s] tiny checkpoints GPU vs CPU"
    timeout 150 ./.gpu/corridor-gpu-check tests/fixtures/tiny/kquant > "$out/e2e_kquant.log" 2>&1; echo "exit $?"
    grep -E "FAIL" "$out/e2e_kquant.log" | head -n 10; tail -n 1 "$out/e2e_kquant.log"
    timeout 150 ./.gpu/corridor-gpu-check tests/fixtures/tiny > "$out/e2e.log" 2>&1; echo "exit $?"
    grep -E "FAIL" "$out/e2e.log" | head -n 10; tail -n 1 "$out/e2e.log"
    # FOLD=1: the tiny checkpoints again with batch-1 norms folded into the GEMVs.
    if [ -n "${FOLD:-}" ]; then
        timeout 150 ./.gpu/corridor-gpu-check tests/fixtures/tiny --fold-norm > "$out/e2e_fold.log" 2>&1
        echo "folded norms: exit $?"; grep -E "FAIL" "$out/e2e_fold.log" | head -n 10; tail -n 1 "$out/e2e_fold.log"
    fi
}
# The Q4_K layer's integer GEMV launches and the K-quant matrices alone, the register and the
# pipelined one-row kernels in each run.
pipe_benches() {
    echo "== [${SECONDS}s] q8 layer"
    timeout 150 ./.gpu/cuda_check --bench-q8-layer > "$out/q8_layer.log" 2>&1; echo "exit $?"
    grep -E "rows 1:" "$out/q8_layer.log"
    echo "== [${SECONDS}s] K-quant matrices alone"
    timeout 200 ./.gpu/cuda_check --bench-quant-short > "$out/quant_short.log" 2>&1; echo "exit $?"
    grep -E "rows 1:" "$out/quant_short.log" | sed -e 's/ | gemv .*//' -e 's/ | mmq .*//'
}
case "${1:-checks}" in
  checks)
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$out/nvidia-smi.txt"
    echo "== card and chokepoint"; scripts/gpu/card_check.sh 2>&1 | tee "$out/card_check.log"
    echo "== kernels vs CPU"; ./.gpu/cuda_check 2>&1 | tail -n 40 | tee "$out/cuda_check.log"
    echo "== tiny checkpoints GPU vs CPU"; ./.gpu/corridor-gpu-check tests/fixtures/tiny 2>&1 | tee "$out/e2e.log"
    ;;
  serve)
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$out/nvidia-smi.txt"
    python3 scripts/gpu/make_llama8b.py /tmp/llama8b --tokenizer-dir .gpu/llama3-tokenizer > "$out/make_llama8b.log" 2>&1 &
    maker=$!
    echo "== kernels vs CPU"; ./.gpu/cuda_check 2>&1 | tail -n 40 | tee "$out/cuda_check.log"
    echo "== tiny checkpoints GPU vs CPU"; ./.gpu/corridor-gpu-check tests/fixtures/tiny 2>&1 | tee "$out/e2e.log"
    echo "== corridor serve on the GPU vs the CPU"
    python3 scripts/gpu/serve_check.py ./.gpu/corridor tests/fixtures/tiny/llama-f32 tests/fixtures/tiny/qwen3 \
        tests/fixtures/tiny/llama-q.gguf tests/fixtures/tiny/qwen2-f16.gguf tests/fixtures/tiny/mistral \
        tests/fixtures/tiny/qwen3-moe tests/fixtures/tiny/qwen3-moe-f16.gguf 2>&1 \
        | tee "$out/serve_check.log"
    wait "$maker"; echo "8B checkpoint: exit $?"; tail -n 3 "$out/make_llama8b.log"
    ;;
  hybrid)
    SECONDS=0
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$out/nvidia-smi.txt"
    python3 scripts/gpu/make_qwen35_27b.py /tmp/qwen35_27b --tokenizer-dir .gpu/llama3-tokenizer --vocab 128256 \
        > "$out/make_qwen35.log" 2>&1 &
    maker=$!
    echo "== [${SECONDS}s] kernels vs CPU"; timeout 240 ./.gpu/cuda_check > "$out/cuda_check.log" 2>&1
    echo "exit $?"; grep -E "FAIL|passed|failed" "$out/cuda_check.log" | tail -n 25
    echo "== [${SECONDS}s] tiny checkpoints GPU vs CPU"
    timeout 180 ./.gpu/corridor-gpu-check tests/fixtures/tiny > "$out/e2e.log" 2>&1; echo "exit $?"
    grep -E "FAIL|qwen3_5" "$out/e2e.log" | head -n 30; tail -n 2 "$out/e2e.log"
    wait "$maker"; echo "== [${SECONDS}s] 27B checkpoint: exit $?"; tail -n 2 "$out/make_qwen35.log"
    # Timed with the card otherwise idle (the maker is done).
    echo "== [${SECONDS}s] kernel timings"; timeout 200 ./.gpu/cuda_check --bench-only > "$out/cuda_bench.log" 2>&1
    echo "exit $?"; grep -iE "delta|linear|attention|attn|moe|q4_k|q6_k|dp4a|mmvq" "$out/cuda_bench.log" | head -n 60
    echo "== [${SECONDS}s] served Qwen3.5-27B shape"
    SKIP_MAKE=1 SKIP_LOGITS=1 DEADLINE_S=$((570 - SECONDS)) OUT="$out/qwen35" scripts/gpu/bench_qwen35.sh \
        > "$out/bench_qwen35.out" 2>&1
    echo "exit $?"; cat "$out/qwen35/summary.md" 2>/dev/null; grep -E "FAILED|skipped" "$out/bench_qwen35.out"
    ;;
  moe)
    SECONDS=0
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$out/nvidia-smi.txt"
    tok=.gpu/qwen3-tokenizer; [ -d "$tok" ] || tok=.gpu/llama3-tokenizer
    python3 scripts/gpu/make_qwen3moe.py /dev/shm/qwen3moe --tokenizer-dir "$tok" --vocab tokenizer > "$out/make_qwen3moe.log" 2>&1 &
    maker=$!
    # SKIP_CHECKS=1: the checks ran in an earlier call of this plan, on the same binaries.
    [ -z "${SKIP_CHECKS:-}" ] && { echo "== [${SECONDS}s] kernels vs CPU"; timeout 240 ./.gpu/cuda_check > "$out/cuda_check.log" 2>&1
    echo "exit $?"; grep -E "FAIL|comparisons" "$out/cuda_check.log" | tail -n 25; tail -n 1 "$out/cuda_check.log"; }
    [ -z "${SKIP_CHECKS:-}" ] && for mode in scan chunked; do
        echo "== [${SECONDS}s] tiny checkpoints GPU vs CPU, delta rule: $mode"
        flag=; [ $mode = chunked ] && flag=--delta-chunked
        timeout 150 ./.gpu/corridor-gpu-check tests/fixtures/tiny $flag > "$out/e2e_$mode.log" 2>&1; echo "exit $?"
        grep -E "FAIL" "$out/e2e_$mode.log" | head -n 10; tail -n 1 "$out/e2e_$mode.log"
    done
    wait "$maker"; echo "== [${SECONDS}s] MoE checkpoint: exit $?"; tail -n 2 "$out/make_qwen3moe.log"
    echo "== [${SECONDS}s] served Qwen3-30B-A3B shape"
    SKIP_MAKE=1 MODEL_DIR=/dev/shm/qwen3moe TOKENIZER_DIR="$tok" PROFILE=${PROFILE-64} BENCH_TIMEOUT_S=120 OUT="$out/moe" \
        scripts/gpu/bench_moe.sh > "$out/bench_moe.out" 2>&1
    echo "exit $?"; cat "$out/moe/summary.md" 2>/dev/null; cat "$out/moe/profile.log" 2>/dev/null
    grep -E "FAILED" "$out/bench_moe.out"
    # The kernels of batch-1 decode steps by Nsight Compute, on a 4-layer checkpoint of the same shape.
    [ -n "${SKIP_NCU:-}" ] && exit 0
    echo "== [${SECONDS}s] decode kernels by ncu (4 layers)"
    python3 scripts/gpu/make_qwen3moe.py /dev/shm/moe4 --tokenizer-dir "$tok" --layers 4 --vocab tokenizer > /dev/null 2>&1
    OUT="$out" SHOW=16 timeout 150 scripts/gpu/ncu_decode.sh /dev/shm/moe4
    ;;
  quant)
    # The block-format matmuls: every kernel against the CPU, the tiny K-quant and other
    # checkpoints GPU against CPU, then every path of the block-format matmuls timed at 1 to 256
    # rows (`cuda_check --bench-quant`: what `matmul` picks, the integer GEMV, mmq, widening).
    SECONDS=0
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$out/nvidia-smi.txt"
    quant_checks
    echo "== [${SECONDS}s] block-format matmuls"
    timeout 300 ./.gpu/cuda_check --bench-quant > "$out/bench_quant.log" 2>&1; echo "exit $?"
    sed -e 's/ | /\n    /g' "$out/bench_quant.log" | grep -vE "gemv|q8-gemv" | head -n 400
    ;;
  moeq8)
    # Block-format experts: every kernel against the CPU (the routed integer GEMVs of
    # kernels/moe_q8.cu and the grouped GEMM's word-wise decoders among them), the tiny K-quant
    # checkpoints GPU against CPU (the Q4_K_M qwen3moe with --cuda-moe-q8 on), then a
    # 30B-A3B expert layer of bf16 and of Q4_K/Q6_K experts on both decode paths (--bench-moe).
    # Timeouts sum to 550 s, one call (the checks took about 190 s on an H100).
    SECONDS=0
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$out/nvidia-smi.txt"
    echo "== [${SECONDS}s] kernels vs CPU"; timeout 260 ./.gpu/cuda_check > "$out/cuda_check.log" 2>&1
    echo "exit $?"; grep -E "FAIL" "$out/cuda_check.log" | head -n 25; tail -n 1 "$out/cuda_check.log"
    grep -E "moe_ffn (Q4_K|Q6_K|Q8_0)" "$out/cuda_check.log" | head -n 40
    echo "== [${SECONDS}s] tiny K-quant checkpoints GPU vs CPU"
    timeout 120 ./.gpu/corridor-gpu-check tests/fixtures/tiny/kquant > "$out/e2e_kquant.log" 2>&1; echo "exit $?"
    grep -E "FAIL|qwen3moe" "$out/e2e_kquant.log" | head -n 10; tail -n 1 "$out/e2e_kquant.log"
    echo "== [${SECONDS}s] the expert layer, bf16 and Q4_K/Q6_K"
    timeout 170 ./.gpu/cuda_check --bench-moe 2>&1 | tail -n 12
    ;;
  gguf)
    SECONDS=0
    g=/tmp/gguf-plan; mkdir -p "$g"; rm -f "$g/card_free"
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$out/nvidia-smi.txt" "$g/nvidia-smi.txt"
    setsid nohup bash -c "OUT=$g SKIP_KQUANT=1 QUANTS='${QUANTS:-Q4_K_M Q8_0 Q4_0}' scripts/gpu/gguf_bench.sh prep > $g/prep.log 2>&1;
        while [ ! -f $g/card_free ]; do sleep 2; done;
        OUT=$g scripts/gpu/gguf_bench.sh bench ${FILES:-Q4_K_M Q8_0 Q4_0 f16} > $g/bench.log 2>&1; touch $g/done" \
        < /dev/null > /dev/null 2>&1 &
    quant_checks
    echo "== [${SECONDS}s] a decode layer's integer GEMVs, separate and fused launches"
    timeout 150 ./.gpu/cuda_check --bench-q8-layer > "$out/bench_q8_layer.log" 2>&1; echo "exit $?"
    grep -E "^q8 layer" "$out/bench_q8_layer.log"
    for b in cuda_check-base cuda_check; do
        echo "== [${SECONDS}s] block-format matmuls: $b"
        timeout 200 "./.gpu/$b" --bench-quant-short > "$out/bench_quant_$b.log" 2>&1; echo "exit $?"
        grep -oE "^quant [^:]*|mmq [0-9.]+ ms" "$out/bench_quant_$b.log" | paste -d' ' - - | grep -E "rows (8|32|64|128):"
    done
    touch "$g/card_free"
    bash "$0" wait $(( ${LIMIT_S:-540} - SECONDS ))
    ;;
  profile)
    SECONDS=0
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$out/nvidia-smi.txt"
    tok=.gpu/qwen3-tokenizer; [ -d "$tok" ] || tok=.gpu/llama3-tokenizer
    # Both checkpoints are made on the card, so before anything is timed.
    [ -d /tmp/llama8b ] || python3 scripts/gpu/make_llama8b.py /tmp/llama8b --tokenizer-dir .gpu/llama3-tokenizer \
        > "$out/make_llama8b.log" 2>&1
    echo "== [${SECONDS}s] 8B checkpoint: exit $?"; tail -n 1 "$out/make_llama8b.log" 2>/dev/null
    [ -d /dev/shm/moe4 ] || python3 scripts/gpu/make_qwen3moe.py /dev/shm/moe4 --tokenizer-dir "$tok" --layers 4 \
        --vocab tokenizer > "$out/make_moe4.log" 2>&1
    echo "== [${SECONDS}s] 4-layer MoE checkpoint: exit $?"
    for m in moe4:/dev/shm/moe4 8b:/tmp/llama8b; do
        echo "== [${SECONDS}s] batch-1 decode by nsys: ${m%%:*}"
        OUT="$out" TAG="nsys_${m%%:*}" timeout 240 scripts/gpu/nsys_decode.sh "${m#*:}"
    done
    echo "== [${SECONDS}s] served 8B: decode and latency at concurrency 128 ${SERVE_ARGS:-}"
    SKIP_MAKE=1 SKIP_LOGITS=1 SKIP_PREFILL=1 DECODE_BATCHES="${DECODE_BATCHES:-1 8 32 128}" LATENCY_CONC=128 \
        DEADLINE_S=$(( ${LIMIT_S:-570} - SECONDS )) OUT="$out/b8" scripts/gpu/bench8b.sh > "$out/bench8b.out" 2>&1
    echo "exit $?"; cat "$out/b8/summary.md" 2>/dev/null; grep -E "FAILED|skipped" "$out/bench8b.out"
    ;;
  steps)
    SECONDS=0
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$out/nvidia-smi.txt"
    [ -d /tmp/llama8b ] || python3 scripts/gpu/make_llama8b.py /tmp/llama8b --tokenizer-dir .gpu/llama3-tokenizer \
        > "$out/make_llama8b.log" 2>&1 &
    maker=$!
    echo "== [${SECONDS}s] the device sampler alone"
    timeout 120 ./.gpu/cuda_check --bench-sample 2>&1 | grep -E "^(sample_rows|read_rows)|rror"
    wait "$maker"; echo "== [${SECONDS}s] 8B checkpoint: exit $?"
    echo "== [${SECONDS}s] served: decode at ${STEP_BATCHES:-1 8 32 128} ${SERVE_ARGS:-}"
    SERVE_ARGS="--log info,corridor::step=trace --log-format json ${SERVE_ARGS:-}" SKIP_MAKE=1 SKIP_LOGITS=1 \
        SKIP_PREFILL=1 SKIP_LATENCY=1 DECODE_BATCHES="${STEP_BATCHES:-1 8 32 128}" DEADLINE_S=$(( ${LIMIT_S:-560} - SECONDS - 90 )) \
        OUT="$out/steps" scripts/gpu/bench8b.sh > "$out/steps.out" 2>&1
    echo "exit $?"; grep -E "^\| [0-9]+ " "$out/steps/summary.md"; grep -h "engine steps" "$out"/steps/decode_*.txt
    python3 scripts/gpu/step_trace.py "$out/steps/serve.log" | grep "rows:"
    echo "== [${SECONDS}s] served with --cuda-profile 100 at batch ${PROFILE_BATCH:-32}"
    SERVE_ARGS="--cuda-profile 100 ${SERVE_ARGS:-}" SKIP_MAKE=1 SKIP_LOGITS=1 SKIP_PREFILL=1 SKIP_LATENCY=1 \
        DECODE_BATCHES="${PROFILE_BATCH:-32}" DEADLINE_S=$(( ${LIMIT_S:-560} - SECONDS )) \
        OUT="$out/prof" scripts/gpu/bench8b.sh > "$out/prof.out" 2>&1
    echo "exit $?"; grep -A40 'CUDA op profile' "$out/prof/serve.log" | tail -n 41
    ;;
  decode)
    SECONDS=0
    g=/tmp/gguf-plan; mkdir -p "$g"; rm -f "$g/card_free" "$g/done"
    echo "${NEW_ARGS:-}" > "$g/new_args"
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$out/nvidia-smi.txt" "$g/nvidia-smi.txt"
    # LCPP=0: no llama.cpp (its CUDA build takes minutes): the checkpoint and corridor only.
    prep="OUT=$g SKIP_KQUANT=1 QUANTS=none scripts/gpu/gguf_bench.sh prep"
    [ "${LCPP:-1}" = 0 ] && prep="python3 scripts/gpu/make_llama8b.py /tmp/llama8b --tokenizer-dir .gpu/llama3-tokenizer"
    setsid nohup bash -c "$prep > $g/prep.log 2>&1;
        while [ ! -f $g/card_free ]; do sleep 2; done;
        [ -x /tmp/llama.cpp/build/bin/llama-batched-bench ] && /tmp/llama.cpp/build/bin/llama-batched-bench -m /tmp/gguf/llama8b-f16.gguf -npp 512 -ntg 256 -npl 1,8,32,128 \
            -c 131072 -fa on -ngl 999 > $g/lcpp_f16.log 2>&1;
        SERVE_ARGS=\"\$(cat $g/new_args)\" SKIP_MAKE=1 SKIP_LOGITS=1 SKIP_PREFILL=1 DECODE_BATCHES='${NEW_BATCHES:-1 8 32 128}' \
            LATENCY_CONC=128 DEADLINE_S=300 OUT=$g/new scripts/gpu/bench8b.sh > $g/new.log 2>&1;
        python3 scripts/gpu/decode_vs_llamacpp.py $g/new $g/lcpp_f16.log > $g/table.txt 2>&1;
        grep -E '^\| 128 ' $g/new/summary.md | tail -n 1 >> $g/table.txt;
        if [ -x ${BASE_BIN:-.gpu/corridor-base} ]; then
            CORRIDOR_BIN=${BASE_BIN:-.gpu/corridor-base} SERVE_ARGS='${BASE_ARGS:-}' SKIP_MAKE=1 SKIP_LOGITS=1 SKIP_PREFILL=1 SKIP_LATENCY=1 \
                DECODE_BATCHES='${BASE_BATCHES:-32 128}' DEADLINE_S=200 OUT=$g/base scripts/gpu/bench8b.sh > $g/base.log 2>&1;
            grep -E '^\| [0-9]+ ' $g/base/summary.md | head -n 4 > $g/base_table.txt;
        fi;
        touch $g/done" < /dev/null > /dev/null 2>&1 &
    [ -z "${SKIP_CHECKS:-}" ] && quant_checks
    # A flag of NEW_ARGS whose kernels failed their checks is left out of the new run.
    if grep -qE "^FAIL folded norm" "$out/cuda_check.log" 2>/dev/null || grep -q FAIL "$out/e2e_fold.log" 2>/dev/null; then
        sed -i 's/--cuda-fold-norm on//' "$g/new_args"; echo "folded norms failed a check: the new run goes without them"
    fi
    if grep -qE "^FAIL sample_rows.*slices" "$out/cuda_check.log" 2>/dev/null; then
        sed -i 's/--cuda-sample-slices on//' "$g/new_args"; echo "the sampler's slices failed a check: the new run goes without them"
    fi
    echo "new run's serve flags: '$(cat "$g/new_args")'"
    # PIPE_BENCH=1: the one-row integer GEMV benches, while llama.cpp builds.
    [ -n "${PIPE_BENCH:-}" ] && pipe_benches
    # BENCH_SAMPLE=1: the device sampler alone, one block a row against slices, while llama.cpp builds.
    if [ -n "${BENCH_SAMPLE:-}" ]; then
        echo "== [${SECONDS}s] the device sampler alone"
        timeout 60 ./.gpu/cuda_check --bench-sample > "$out/bench_sample.log" 2>&1; echo "exit $?"
        grep -E "^(sample_rows|read_rows)" "$out/bench_sample.log"
    fi
    # BENCH_ATTN=1: decode attention alone and at batch (its KV read rate), while llama.cpp builds.
    if [ -n "${BENCH_ATTN:-}" ]; then
        echo "== [${SECONDS}s] decode attention alone"
        timeout 120 ./.gpu/cuda_check --bench-attention > "$out/bench_attention.log" 2>&1; echo "exit $?"
        grep -E "decode attention" "$out/bench_attention.log" | tail -n 16
    fi
    touch "$g/card_free"
    bash "$0" wait $(( ${LIMIT_S:-570} - SECONDS ))
    ;;
  pipe)
    # The pipelined one-row integer GEMVs (--cuda-mmvq-pipe) against the register kernels: the
    # checks (cuda_check compares both with the CPU and with each other), then the benches.
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/nvidia-smi.txt"
    [ -z "${SKIP_CHECKS:-}" ] && quant_checks
    pipe_benches
    ;;
  ab)
    SECONDS=0
    g=/tmp/gguf-plan; mkdir -p "$g"; rm -f "$g/card_free" "$g/done"
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$out/nvidia-smi.txt" "$g/nvidia-smi.txt"
    # AB_FILES=none: the bf16 checkpoint only (no llama.cpp, no GGUF files to make).
    files=${AB_FILES:-Q4_K_M}; [ "$files" = none ] && files=
    make="OUT=$g SKIP_KQUANT=1 LCPP_CUDA=0 QUANTS='$files' scripts/gpu/gguf_bench.sh prep"
    [ -z "$files" ] && make="python3 scripts/gpu/make_llama8b.py /tmp/llama8b --tokenizer-dir .gpu/llama3-tokenizer"
    setsid nohup bash -c "$make > $g/prep.log 2>&1;
        while [ ! -f $g/card_free ]; do sleep 2; done;
        for m in $files bf16; do
            dir=/tmp/gguf/llama8b-\$m.gguf; [ \$m = bf16 ] && dir=/tmp/llama8b
            sides=\$SIDES; [ \$m = bf16 ] && sides=\${BF16_SIDES:-\$SIDES}
            SIDES=\$sides MODEL_DIR=\$dir SKIP_MAKE=1 SKIP_PREFILL=1 SKIP_TINY=1 OUT=$g/ab_\$m scripts/gpu/binary_ab.sh > $g/ab_\$m.log 2>&1
            for d in $g/ab_\$m/*/; do
                grep -q 'CUDA op profile' \$d/serve.log 2>/dev/null || continue
                grep -A40 'CUDA op profile' \$d/serve.log | tail -n 41 > $g/ab_\${m}_\$(basename \$d)_profile.txt
            done
            for d in $g/ab_\$m/*/; do
                grep -q 'corridor::step' \$d/serve.log 2>/dev/null || continue
                python3 scripts/gpu/step_trace.py \$d/serve.log | grep 'rows:' > $g/ab_\${m}_\$(basename \$d)_steps.txt
                grep -h 'engine steps' \$d/decode_*.txt >> $g/ab_\${m}_\$(basename \$d)_steps.txt
            done
        done;
        if [ -n '${TRACE:-}' ]; then
            SERVE_ARGS='--log info,corridor::step=trace --log-format json' CORRIDOR_BIN=\${B:-.gpu/corridor} SKIP_MAKE=1 \
                SKIP_LOGITS=1 SKIP_PREFILL=1 SKIP_DECODE=1 LATENCY_CONC=128 OUT=$g/trace scripts/gpu/bench8b.sh > $g/trace.log 2>&1
            python3 scripts/gpu/step_trace.py $g/trace/serve.log 64 > $g/step_trace.txt 2>&1
            cp $g/trace/summary.md $g/trace_summary.txt 2>/dev/null
        fi
        touch $g/done" < /dev/null > /dev/null 2>&1 &
    # SKIP_CHECKS=1: the kernel checks ran in an earlier call on the same kernels; the tiny
    # checkpoints still go through this call's binaries.
    # KERNEL_CHECKS=1 with it: every kernel against the CPU too (cuda_check), not the K-quant files.
    if [ -z "${SKIP_CHECKS:-}" ]; then quant_checks; else
        if [ -n "${KERNEL_CHECKS:-}" ]; then
            echo "== [${SECONDS}s] kernels vs CPU"; timeout 300 ./.gpu/cuda_check > "$out/cuda_check.log" 2>&1
            echo "exit $?"; grep -E "FAIL" "$out/cuda_check.log" | head -n 25; tail -n 1 "$out/cuda_check.log"
        fi
        timeout 150 ./.gpu/corridor-gpu-check tests/fixtures/tiny > "$out/e2e.log" 2>&1; echo "tiny checkpoints: exit $?"
        grep -E "FAIL" "$out/e2e.log" | head -n 10; tail -n 1 "$out/e2e.log"
    fi
    # PIPE_BENCH=1: the one-row integer GEMV benches, while the GGUF is made.
    [ -n "${PIPE_BENCH:-}" ] && pipe_benches
    # A decode layer's integer GEMVs by the binary before and after (when .gpu/cuda_check-base is there).
    if [ -x .gpu/cuda_check-base ]; then
        for b in ${Q8_LAYER_RUNS:-cuda_check-base cuda_check}; do
            echo "== [${SECONDS}s] a decode layer's integer GEMVs: $b"
            timeout 150 "./.gpu/$b" --bench-q8-layer > "$out/bench_q8_layer_$b.log" 2>&1; echo "exit $?"
            grep -E "^q8 layer" "$out/bench_q8_layer_$b.log"
        done
    fi
    echo "== [${SECONDS}s] one decode row's attention: splits merged in the launch and by a combine pass"
    timeout 90 ./.gpu/cuda_check --bench-attention 2>&1 | grep -E "^decode attention" | sed -e 's/ | /\n    /g'
    echo "== [${SECONDS}s] the device sampler alone"
    timeout 60 ./.gpu/cuda_check --bench-sample 2>&1 | grep -E "^(sample_rows|read_rows)"
    echo "== [${SECONDS}s] GEMMs of new row counts: the host's planning"
    timeout 60 ./.gpu/cuda_check --bench-gemm-plans 2>&1 | grep -E "^gemm plans"
    # NCU_KERNEL=REGEX: that integer GEMV by Nsight Compute (ncu_mmvq.sh) while the files are made.
    if [ -n "${NCU_KERNEL:-}" ]; then echo "== [${SECONDS}s] $NCU_KERNEL by ncu"; OUT="$out" timeout 200 scripts/gpu/ncu_mmvq.sh "$NCU_KERNEL"; fi
    touch "$g/card_free"
    bash "$0" wait $(( ${LIMIT_S:-540} - SECONDS ))
    ;;
  itl)
    SECONDS=0
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$out/nvidia-smi.txt"
    python3 scripts/gpu/make_llama8b.py /tmp/llama8b --tokenizer-dir .gpu/llama3-tokenizer > "$out/make_llama8b.log" 2>&1 &
    maker=$!
    echo "== [${SECONDS}s] kernels vs CPU"; timeout 260 ./.gpu/cuda_check > "$out/cuda_check.log" 2>&1
    echo "exit $?"; grep -E "FAIL" "$out/cuda_check.log" | head -n 25; tail -n 1 "$out/cuda_check.log"
    grep -E "moe_ffn .* (64|300) rows" "$out/cuda_check.log" | head -n 20
    wait "$maker"; echo "== [${SECONDS}s] 8B checkpoint: exit $?"
    IFS='|' read -r -a sets <<< "${ITL_ARGS:-}"
    i=0
    for args in "${sets[@]}"; do
        i=$((i + 1))
        echo "== [${SECONDS}s] concurrency 128: serve flags '${args}'"
        SERVE_ARGS="$args" SKIP_MAKE=1 SKIP_LOGITS=1 SKIP_PREFILL=1 SKIP_DECODE=1 LATENCY_CONC=128 \
            DEADLINE_S=$(( ${LIMIT_S:-570} - SECONDS )) OUT="$out/itl_$i" scripts/gpu/bench8b.sh > "$out/itl_$i.out" 2>&1
        echo "exit $?"; grep -E "^\| 128 " "$out/itl_$i/summary.md"
    done
    ;;
  wait)
    g=/tmp/gguf-plan
    end=$(( SECONDS + ${2:-500} ))
    while [ ! -f "$g/done" ] && [ "$SECONDS" -lt "$end" ]; do sleep 5; done
    echo "== [$(date +%T)] plan: $( [ -f "$g/done" ] && echo done || echo running)"
    tail -n 4 "$g/prep.log" 2>/dev/null; grep -E "^===|status|^\|" "$g/bench.log" 2>/dev/null | tail -n 40
    for f in "$g"/ab_*.log; do [ -f "$f" ] && { echo "--- $f"; grep -vE "^\s*$" "$f" | tail -n 12; }; done
    for f in "$g"/ab_*_steps.txt; do [ -f "$f" ] && { echo "--- $f"; cat "$f"; }; done
    for f in "$g/lcpp_f16.log" "$g/new/summary.md"; do [ -f "$f" ] && { echo "--- $f"; grep -E "^\|" "$f" | head -n 30; }; done
    for f in "$g/table.txt" "$g/base_table.txt"; do [ -f "$f" ] && { echo "--- $f"; cat "$f"; }; done
    for d in new base; do [ -d "$g/$d" ] && mkdir -p "$out/plan/$d" && cp "$g/$d"/*.md "$g/$d"/*.json "$out/plan/$d/" 2>/dev/null; done
    cat "$g"/ab_*_profile.txt "$g/step_trace.txt" "$g/trace_summary.txt" 2>/dev/null | head -n 150
    mkdir -p "$out/plan"; cp -r "$g"/*.log "$g"/*.txt "$out/plan/" 2>/dev/null
    for d in "$g"/corridor_*/; do [ -d "$d" ] && mkdir -p "$out/plan/$(basename "$d")" && cp "$d"/*.md "$d"/*.json "$out/plan/$(basename "$d")/" 2>/dev/null; done
    true
    ;;
  paris)
    # The GGUF travels in two halves (.gpu-a, then .gpu-b in a second call while the machine is
    # warm, with the binaries in a small .gpu-c so each call stays under the transfer limit).
    [ -f /tmp/smollm2.gguf ] || cat /tmp/smol_a .gpu-b/part > /tmp/smollm2.gguf
    bin=.gpu-c; [ -x "$bin/corridor" ] || bin=.gpu
    sha256sum /tmp/smollm2.gguf | tee "$out/paris.log"
    "./$bin/corridor-gpu-check" /tmp/smollm2.gguf 2>&1 | tee -a "$out/paris.log"
    # The same question through `corridor serve --devices cuda:0` and the chat API.
    "./$bin/corridor" serve --model /tmp/smollm2.gguf --devices cuda:0 --port 8500 > "$out/paris_serve.log" 2>&1 &
    pid=$!
    for _ in $(seq 120); do curl -sf localhost:8500/health >/dev/null && break; sleep 0.5; done
    curl -s localhost:8500/v1/chat/completions -H 'Content-Type: application/json' \
        -d '{"model":"smollm2","messages":[{"role":"user","content":"What is the capital of France?"}],"temperature":0,"max_tokens":20}' \
        | tee -a "$out/paris.log"; echo
    kill -INT $pid; wait $pid
    ;;
esac
