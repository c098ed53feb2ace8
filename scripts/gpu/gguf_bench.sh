#!/usr/bin/env bash
# The GGUF files people download, on the H200: corridor against llama.cpp on the same files of the
# same random Llama-3-8B-shaped weights, in one plan of two or three calls on one warm machine.
# Carried in .gpu/: corridor (release, CUDA), corridor-gpu-check (crates/gpu-check, release, --features cuda),
# llama3-tokenizer/, llama.cpp.tar.gz (vendor/llama.cpp of the llama-cpp-python 0.3.36 sdist,
# without models/, docs/ and the other backends).
#
#   OUT=DIR scripts/gpu/gguf_bench.sh prep          # build llama.cpp (CUDA, sm_90), make the
#                                                   # checkpoint, convert to f16 GGUF, quantize,
#                                                   # check the tiny K-quant files GPU vs CPU
#   OUT=DIR scripts/gpu/gguf_bench.sh bench Q8_0 Q4_K_M ...   # per file: llama-batched-bench, then
#                                                   # corridor serve + corridor bench (bench8b.sh)
#                                                   # for each NAME=BINARY of CORRIDORS (default
#                                                   # new=.gpu/corridor), at CORRIDOR_BATCHES
#                                                   # (default BATCHES)
#
# Files live in /tmp/gguf (llama8b-f16.gguf, llama8b-Q8_0.gguf, ...), kept between calls while the
# machine stays warm. Q8_0 and Q4_0 are quantized --pure (one type throughout); Q4_K_M is the mixed
# file llama-quantize writes by default (Q4_K and Q6_K, Q6_K output), as downloaded files are.
set -uo pipefail
cd "$(dirname "$0")/../.."
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
out=${OUT:-/tmp/gguf-out}
mkdir -p "$out" /tmp/gguf
SECONDS=0
header() { echo; echo "=== [${SECONDS}s] $*"; }
LCP=/tmp/llama.cpp
BUILD=$LCP/build
MODEL_DIR=/tmp/llama8b
BATCHES=${BATCHES:-1 32 128}

prep() {
    # LCPP_CUDA=0 builds only the CPU quantizer (a minute), for a plan that reuses llama.cpp's
    # decode numbers of an earlier run on the same files; the default builds llama-batched-bench
    # with CUDA too (several minutes, in the background).
    header "untar llama.cpp and build it in the background (CUDA ${LCPP_CUDA:-1}, sm_90)"
    if [ ! -x "$BUILD/bin/llama-quantize" ]; then
        # The sources as carried, or unpacked once by a `gunzip .gpu/*.gz` meant for the binaries.
        if [ -f .gpu/llama.cpp.tar.gz ]; then tar xzf .gpu/llama.cpp.tar.gz -C /tmp; else tar xf .gpu/llama.cpp.tar -C /tmp; fi
        local cuda=ON targets="llama-batched-bench llama-quantize"
        [ "${LCPP_CUDA:-1}" = 0 ] && cuda=OFF targets=llama-quantize
        ( cmake -S "$LCP" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=$cuda \
              -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
              -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF \
            && cmake --build "$BUILD" -j 14 --target $targets ) > "$out/llama_build.log" 2>&1 &
        build_pid=$!
    fi
    if [ -z "${SKIP_KQUANT:-}" ]; then
        header "tiny K-quant files: CUDA against the CPU (corridor-gpu-check)"
        timeout 120 .gpu/corridor-gpu-check tests/fixtures/tiny/kquant 2>&1 | tee "$out/kquant_gpu.log"
    fi
    header "checkpoint"
    python3 scripts/gpu/make_llama8b.py "$MODEL_DIR" --tokenizer-dir .gpu/llama3-tokenizer 2>&1 | tail -n 3
    header "convert to an f16 GGUF"
    if [ ! -s /tmp/gguf/llama8b-f16.gguf ]; then
        PYTHONPATH=$LCP/gguf-py timeout 400 python3 "$LCP/convert_hf_to_gguf.py" "$MODEL_DIR" --outtype f16 \
            --outfile /tmp/gguf/llama8b-f16.gguf 2>&1 | tail -n 5
    fi
    ls -la /tmp/gguf
    if [ -n "${build_pid:-}" ]; then
        header "waiting for the llama.cpp build"
        wait "$build_pid"; echo "build status $?"; tail -n 3 "$out/llama_build.log"
    fi
    # QUANTS=none: the f16 file only.
    local quants=${QUANTS:-Q8_0 Q4_0 Q4_K_M}
    [ "$quants" = none ] && quants=
    for q in $quants; do
        [ -s "/tmp/gguf/llama8b-$q.gguf" ] && continue
        pure=--pure; [ "$q" = Q4_K_M ] && pure=
        header "quantize $q $pure"
        timeout 200 "$BUILD/bin/llama-quantize" $pure /tmp/gguf/llama8b-f16.gguf "/tmp/gguf/llama8b-$q.gguf" "$q" \
            > "$out/quantize_$q.log" 2>&1; echo "status $?"; tail -n 2 "$out/quantize_$q.log"
    done
    ls -la /tmp/gguf
}

bench_file() {
    local q=$1 f=/tmp/gguf/llama8b-$1.gguf
    [ -s "$f" ] || { echo "missing $f"; return; }
    if [ -x "$BUILD/bin/llama-batched-bench" ]; then
        header "$q: llama-batched-bench (512 prompt, 256 generated, batches ${BATCHES// /,})"
        timeout 240 "$BUILD/bin/llama-batched-bench" -m "$f" -npp 512 -ntg 256 -npl "${BATCHES// /,}" \
            -c 131072 -fa on -ngl 999 > "$out/lcpp_$q.log" 2>&1
        echo "status $?"; grep -E "^\|" "$out/lcpp_$q.log" | tail -n 6
    else
        header "$q: llama-batched-bench not built (LCPP_CUDA=0): llama.cpp not run"
    fi
    # CORRIDORS: "NAME=BINARY ..." serves each binary in turn on the same file (a same-run A/B);
    # the default is the one build in .gpu/.
    local side name bin
    for side in ${CORRIDORS:-new=.gpu/corridor}; do
        name=${side%%=*} bin=${side#*=}
        header "$q: corridor serve + corridor bench ($name: $bin)"
        mkdir -p "$out/corridor_${q}_$name"
        OUT="$out/corridor_${q}_$name" MODEL_DIR="$f" CORRIDOR_BIN="$bin" SKIP_MAKE=1 SKIP_LOGITS=1 SKIP_PREFILL=1 \
            SKIP_LATENCY=1 DECODE_BATCHES="${CORRIDOR_BATCHES:-$BATCHES}" DEADLINE_S=${FILE_DEADLINE_S:-240} \
            scripts/gpu/bench8b.sh > "$out/corridor_${q}_$name.log" 2>&1
        echo "status $?"
        grep -E "^\| (batch|[0-9]+ \|)" "$out/corridor_${q}_$name/summary.md" 2>/dev/null | head -n 8
    done
}

case "${1:-}" in
    prep) prep ;;
    bench) shift; for q in "$@"; do bench_file "$q"; done ;;
    *) echo "usage: $0 prep | bench FILE_TYPE..." >&2; exit 2 ;;
esac
header "done"
