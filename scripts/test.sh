#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what the tests need,
# fetches the real test assets (the default model and real tokenizers), then
# runs the Rust tests and the end-to-end tests against the real server.
set -euo pipefail
cd "$(dirname "$0")/.."
export CORRIDOR_REQUIRE_ASSETS=1
export CARGO_TERM_COLOR=never

echo "== python packages for the end-to-end tests (in a virtual environment, not the system Python)"
venv="$PWD/target/venv"
if [ ! -x "$venv/bin/python3" ]; then
    python3 -m venv "$venv" || {
        echo "python3 -m venv failed: install the venv module (e.g. apt-get install python3-venv)" >&2
        exit 1
    }
fi
# Every later python3 and pip (pytest, corridor pull, the asset fetch, the kernel check) is the venv's.
export VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH"
python3 -m pip install --quiet --disable-pip-version-check openai pytest requests nvidia-cuda-nvrtc

echo "== build (dev profile)"
cargo build --workspace --all-targets
export CORRIDOR_BIN="${CARGO_TARGET_DIR:-$PWD/target}/debug/corridor"

echo "== test assets: the default model and real tokenizers"
"$CORRIDOR_BIN" pull
scripts/fetch_test_assets.sh

echo "== rust tests"
cargo test --workspace

echo "== end-to-end tests against the real server"
python3 -m pytest -q tests/e2e

echo "== the CUDA kernels compile (NVRTC from its wheel, no GPU needed)"
python3 scripts/check_kernels.py

echo "== the CUDA build compiles (backend, card, server and cli; its checks run on a GPU machine)"
cargo check --workspace --features cuda --all-targets

echo "== the CUDA backend's host-side rules (kernel choice, launch shapes, the card's books; no GPU needed)"
cargo test -p corridor-backend --features cuda --lib cuda::
