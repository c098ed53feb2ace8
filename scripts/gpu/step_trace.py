#!/usr/bin/env python3
"""The engine's steps as the server traced them, decode-only against mixed.

`corridor serve --log info,corridor::step=trace --log-format json` writes one line per step with
its shape (prefill_rows, decode_rows) and where its time went (schedule_ms, forward_ms, sample_ms,
and between_ms, the time from the step before it). This prints, for steps with no prompt rows and
for steps with some, their count and the median and 90th percentile of each part, then a least-
squares fit of the mixed steps' forward time as a + b * prefill_rows + c * decode_rows: `a` is what a
mixed step costs beyond its rows, against the decode-only steps' median forward time. Then, for each decode row count with at least 50
decode-only steps, the median of each part (a log that holds runs at several batch sizes).

Usage: step_trace.py SERVE_LOG [SKIP_FIRST_STEPS]
"""

import json
import sys


def rows(path):
    for line in open(path, errors="replace"):
        if "corridor::step" not in line:
            continue
        try:
            o = json.loads(line)
        except ValueError:
            continue
        f = o.get("fields", o)
        if "forward_ms" in f:
            yield f


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def fit(samples):
    """Least squares of y = a + b x1 + c x2 by the normal equations."""
    n = len(samples)
    if n < 4:
        return None
    s = [[0.0] * 3 for _ in range(3)]
    t = [0.0] * 3
    for x1, x2, y in samples:
        v = (1.0, float(x1), float(x2))
        for i in range(3):
            t[i] += v[i] * y
            for j in range(3):
                s[i][j] += v[i] * v[j]
    # Gaussian elimination with partial pivoting.
    m = [s[i] + [t[i]] for i in range(3)]
    for c in range(3):
        p = max(range(c, 3), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-12:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(3):
            if r != c:
                k = m[r][c] / m[c][c]
                m[r] = [a - k * b for a, b in zip(m[r], m[c])]
    return [m[i][3] / m[i][i] for i in range(3)]


def main():
    path = sys.argv[1]
    skip = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    steps = list(rows(path))[skip:]
    if not steps:
        print(f"{path}: no traced steps")
        return
    for name, sel in (("decode-only", lambda s: s["prefill_rows"] == 0), ("mixed", lambda s: s["prefill_rows"] > 0)):
        part = [s for s in steps if sel(s)]
        if not part:
            print(f"{name}: none")
            continue
        cols = ["between_ms", "schedule_ms", "forward_ms", "sample_ms"]
        desc = ", ".join(f"{c[:-3]} {pct([s[c] for s in part], 0.5):.2f}/{pct([s[c] for s in part], 0.9):.2f}" for c in cols)
        pr = [s["prefill_rows"] for s in part]
        dr = [s["decode_rows"] for s in part]
        print(f"{name}: {len(part)} steps, prompt rows p50 {pct(pr, 0.5)}, decode rows p50 {pct(dr, 0.5)}; "
              f"ms p50/p90: {desc}")
    # Decode-only steps by their row count (a log of runs at several batch sizes), where a count
    # has at least 50 steps: the host's part of a step is between + schedule + sample.
    counts = {}
    for s in steps:
        if s["prefill_rows"] == 0:
            counts.setdefault(s["decode_rows"], []).append(s)
    for n in sorted(counts):
        part = counts[n]
        if len(part) < 50:
            continue
        cols = ["between_ms", "schedule_ms", "forward_ms", "sample_ms"]
        desc = ", ".join(f"{c[:-3]} {pct([s[c] for s in part], 0.5):.3f}" for c in cols)
        print(f"decode-only, {n} rows: {len(part)} steps; ms p50: {desc}")
    mixed = [(s["prefill_rows"], s["decode_rows"], s["forward_ms"]) for s in steps if s["prefill_rows"] > 0]
    f = fit(mixed)
    if f:
        print(f"mixed forward ms = {f[0]:.2f} + {f[1] * 1e3:.1f} us x prompt rows + {f[2] * 1e3:.1f} us x decode rows")


if __name__ == "__main__":
    main()
