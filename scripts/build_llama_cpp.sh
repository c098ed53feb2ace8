#!/usr/bin/env bash
# Builds llama.cpp's CPU tools (llama-quantize, llama-bench) from the llama-cpp-python sdist that
# scripts/fetch_test_assets.sh downloads, into target/llama.cpp/. Run by hand, not in CI: it is used
# to make the K-quant fixtures (scripts/make_quant_fixtures.py) and for the CPU benchmark
# (BENCHMARKS.md). Needs gcc and `pip install cmake ninja`.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
sdist="${SDIST:-$root/target/test-assets/downloads/llama_cpp_python-0.3.36.tar.gz}"
work="$root/target/llama.cpp"
if [ ! -f "$sdist" ]; then
  echo "missing $sdist: run scripts/fetch_test_assets.sh first (or set SDIST)" >&2
  exit 1
fi
mkdir -p "$work"
if [ ! -d "$work/src/vendor/llama.cpp" ]; then
  rm -rf "$work/src"
  mkdir -p "$work/src"
  tar xzf "$sdist" -C "$work/src" --strip-components=1
fi
cmake -S "$work/src/vendor/llama.cpp" -B "$work/build" -G Ninja \
  -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF
cmake --build "$work/build" -j "${JOBS:-2}" --target llama-quantize llama-bench
echo "built: $work/build/bin/llama-quantize $work/build/bin/llama-bench"
