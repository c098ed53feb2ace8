#!/usr/bin/env python3
"""Summarize an `ncu --csv --page raw --metrics gpu__time_duration.sum` table (scripts/gpu/ncu_decode.sh).

    python3 scripts/gpu/ncu_summary.py TABLE.csv [N]

Prints per kernel name the total time, the calls and the mean (µs), largest total first, then the
first N kernels in launch order with their grids.
"""
import collections
import csv
import sys


def main():
    rows = [r for r in csv.reader(open(sys.argv[1], errors="replace")) if len(r) > 5]
    if not rows:
        sys.exit("no kernel rows in " + sys.argv[1])
    head = rows[0]
    name, grid, dur = head.index("Kernel Name"), head.index("Grid Size"), head.index("gpu__time_duration.sum")
    unit = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(rows[1][dur], 1e-3)
    by_name = collections.defaultdict(list)
    order = []
    for r in rows[2:]:
        try:
            us = float(r[dur].replace(",", "")) * unit
        except ValueError:
            continue
        by_name[r[name]].append(us)
        order.append((r[name], us, r[grid]))
    for k, v in sorted(by_name.items(), key=lambda kv: -sum(kv[1])):
        print(f"{sum(v):10.1f} us {len(v):5d} calls {sum(v) / len(v):8.2f} us/call  {k[:90]}")
    print(f"total {sum(t for _, t, _ in order):.1f} us over {len(order)} kernels")
    for k, us, g in order[: int(sys.argv[2]) if len(sys.argv) > 2 else 0]:
        print(f"  {k[:44]:44s} {us:8.2f} us  grid {g}")


main()
