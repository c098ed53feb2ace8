#!/usr/bin/env bash
# CPU decode benchmark on the default model (SmolLM2-135M-Instruct, GGUF Q4_1):
# tokens/s at batch 1 and the weight-streaming bandwidth that implies (every
# decode step reads every weight once, so bytes/s = tokens/s x weight bytes).
# Usage: scripts/bench_cpu.sh [TOKENS]
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-128}
cargo build --release -q -p corridor-cli
bin=target/release/corridor
model=$($bin pull)
bytes=$(stat -L -c %s "$model")
for run in 1 2 3; do
  $bin --log warn generate --model "$model" --prompt "Write a long story about a lighthouse keeper." \
    --chat --max-tokens "$n" --ignore-eos > /dev/null 2> /tmp/corridor-bench-cpu.$run
  tail -n 1 /tmp/corridor-bench-cpu.$run
done | tee /tmp/corridor-bench-cpu.all
python3 - "$bytes" <<'PY'
import re, sys, statistics
b = int(sys.argv[1])
rates = [float(m.group(1)) for m in re.finditer(r"decode ([0-9.]+) tok/s", open("/tmp/corridor-bench-cpu.all").read())]
med = statistics.median(rates)
print(f"decode median {med:.1f} tok/s over {len(rates)} runs; weights {b/2**20:.1f} MiB -> {med*b/1e9:.2f} GB/s streamed")
PY
