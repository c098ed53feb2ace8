#!/usr/bin/env python3
"""Summarize an Nsight Systems kernel trace of decode steps (`nsys stats --report
cuda_gpu_trace --format csv`, from nsys_decode.sh).

Usage: nsys_summary.py TRACE.csv [STEPS]

A step ends with its `sample_rows` kernel. Over the last STEPS whole steps: the
step period (from one sampling kernel's start to the next's), the card's busy
time per step (the union of its kernels' and copies' intervals) and idle time,
the idle time between the step's last kernel and the next step's first (the
host's share: waiting for the token, forming and uploading the next step,
launching it), and per kernel name the calls per step, mean duration, total per
step and the mean time from the end of the kernel before it to its own start
(negative: it overlapped the one ahead, as programmatic dependent launch lets
it).
"""

import csv
import sys
from collections import OrderedDict


def column(header, *keys):
    for i, h in enumerate(header):
        if all(k.lower() in h.lower() for k in keys):
            return i
    raise SystemExit(f"no column with {keys} in {header}")


def main():
    path = sys.argv[1]
    want = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    # nsys may print a line or two before the header.
    h = next(i for i, r in enumerate(rows) if any("Start" in c for c in r) and any("Name" in c for c in r))
    header, body = rows[h], rows[h + 1 :]
    i_start, i_dur, i_name = column(header, "Start"), column(header, "Duration"), column(header, "Name")
    ops = []
    for r in body:
        if len(r) <= max(i_start, i_dur, i_name) or not r[i_start].strip():
            continue
        start, dur = float(r[i_start]), float(r[i_dur])
        ops.append((start, start + dur, r[i_name]))
    ops.sort()
    ends = [i for i, op in enumerate(ops) if op[2].startswith("sample_rows")]
    if len(ends) < 3:
        print(f"{len(ops)} operations, {len(ends)} sampling kernels: too few steps to summarize")
        return
    ends = ends[-(want + 1) :]
    steps = len(ends) - 1
    t0, t1 = ops[ends[0]][0], ops[ends[-1]][0]
    window = [op for op in ops if t0 <= op[0] < t1]
    # Busy: the union of intervals (clipped to the window).
    busy, cur_s, cur_e = 0.0, None, None
    for s, e, _ in window:
        e = min(e, t1)
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    period = (t1 - t0) / steps
    # Between steps: from the end of each sampling kernel (and anything that ends after it
    # before the next kernel starts) to the next kernel's start.
    between = 0.0
    for k in ends[:-1]:
        end = ops[k][1]
        j = k + 1
        while j < len(ops) and ops[j][0] < end:
            end = max(end, ops[j][1])
            j += 1
        if j < len(ops):
            between += max(0.0, ops[j][0] - end)
    us = lambda ns: ns / 1e3
    print(f"{steps} steps: period {us(period):.1f} us, busy {us(busy / steps):.1f} us, "
          f"idle {us(period - busy / steps):.1f} us a step, of which {us(between / steps):.1f} us "
          f"between a step's sampling and the next step's first operation")
    stats = OrderedDict()
    prev_end = None
    for s, e, name in window:
        key = name.split("(")[0][:60]
        st = stats.setdefault(key, [0, 0.0, 0.0])
        st[0] += 1
        st[1] += e - s
        if prev_end is not None:
            st[2] += s - prev_end
        prev_end = e if prev_end is None else max(prev_end, e)
    print(f"{'kernel':60} {'per step':>8} {'mean us':>8} {'us/step':>8} {'gap us':>8}")
    for key, (n, total, gap) in sorted(stats.items(), key=lambda kv: -kv[1][1]):
        print(f"{key:60} {n / steps:8.2f} {us(total / n):8.2f} {us(total / steps):8.1f} {us(gap / n):8.2f}")


if __name__ == "__main__":
    main()
