#!/usr/bin/env python3
"""The decode-at-batch table of one run: corridor's step (ITL p50 through its server, from a
bench8b.sh directory's summary.md decode rows, which also give each batch's floor) against
llama.cpp's (`llama-batched-bench` on the same weights: step = batch / S_TG), per batch.

Usage: decode_vs_llamacpp.py CORRIDOR_DIR LLAMA_BATCHED_BENCH_LOG
"""

import re
import sys


def corridor_rows(summary):
    """batch -> (ITL p50 ms, floor ms) from summary.md's decode table."""
    rows = {}
    section = False
    for line in open(summary, errors="replace"):
        if line.startswith("## "):
            section = line.startswith("## Decode")
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not section or len(cells) < 10 or not cells[0].isdigit():
            continue
        try:
            rows[int(cells[0])] = (float(cells[3]), float(cells[7]))
        except ValueError:
            pass
    return rows


def llamacpp_rows(log):
    """batch -> step ms from llama-batched-bench's table (PP, TG, B, N_KV, T_PP, S_PP, T_TG, S_TG, ...);
    none when the log is missing (llama.cpp not run)."""
    rows = {}
    try:
        lines = open(log, errors="replace").readlines()
    except OSError:
        return rows
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 8 or not re.fullmatch(r"\d+", cells[2] or ""):
            continue
        try:
            b, s_tg = int(cells[2]), float(cells[7])
        except ValueError:
            continue
        if s_tg > 0:
            rows[b] = b / s_tg * 1e3
    return rows


def main():
    ours = corridor_rows(sys.argv[1] + "/summary.md")
    theirs = llamacpp_rows(sys.argv[2])
    print("| batch | floor ms | llama.cpp ms | corridor ms | corridor / floor | speed against llama.cpp |")
    print("|---:|---:|---:|---:|---:|---:|")
    for b in sorted(set(ours) | set(theirs)):
        step, floor = ours.get(b, (None, None))
        peer = theirs.get(b)
        cell = lambda v, f: "-" if v is None else format(v, f)
        frac = None if step is None else 100 * floor / step
        ratio = None if step is None or peer is None else peer / step
        print(f"| {b} | {cell(floor, '.2f')} | {cell(peer, '.2f')} | {cell(step, '.2f')} | "
              f"{cell(frac, '.0f')}% | {cell(ratio, '.2f')} |")


if __name__ == "__main__":
    main()
