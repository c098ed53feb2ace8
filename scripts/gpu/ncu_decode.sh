#!/usr/bin/env bash
# Kernel durations of decode steps as Nsight Compute measures them (each kernel run alone, the
# card's own clocks): the op table `--cuda-profile` prints times each op from the host with a
# launch of its own, while this one times the kernels of the captured steps themselves
# (`--graph-profiling node`), so fixed costs and bytes can be told apart per kernel.
#
#   scripts/gpu/ncu_decode.sh MODEL_DIR [corridor generate flags...]
#
# Runs `corridor generate` (a 501-token prompt, 60 tokens) under ncu, skips the first SKIP kernels
# (boot, prefill; default 1500), records COUNT (default 400), and prints per kernel name the total,
# the calls and the mean, then the first kernels in launch order (one decode step, by its grid).
# Mind what SKIP passes: the boot runs warm-up steps (three prefill-sized, then one of every decode
# batch size from 1 up, `SingleRank::warm_up`), a few hundred kernels each on a 32-layer model, so
# 1500 suits a few-layer checkpoint only; check the first kernels' grids (rows) before reading it.
# Needs ncu (/usr/local/cuda-13.0/bin/ncu on the GPU machine). Output in $OUT (default /tmp):
# ncu_decode.csv (raw), ncu_decode.txt (the summary).
set -uo pipefail
source "$(dirname "$0")/ncu_env.sh"
BIN=${CORRIDOR_BIN:-.gpu/corridor}
model=$1
shift
prompt=$(python3 -c "print('hello world ' * 250)")
"$NCU" --graph-profiling node --clock-control none --metrics gpu__time_duration.sum \
    --launch-skip "${SKIP:-1500}" --launch-count "${COUNT:-400}" --csv --page raw \
    "$BIN" generate --model "$model" --devices cuda:0 --context-length 4096 --max-tokens 60 --ignore-eos \
    --prompt "$prompt" "$@" > "$out/ncu_decode.csv" 2> "$out/ncu_decode.err"
echo "ncu exit $?"; tail -n 2 "$out/ncu_decode.err"
python3 scripts/gpu/ncu_summary.py "$out/ncu_decode.csv" "${SHOW:-70}" | tee "$out/ncu_decode.txt"
