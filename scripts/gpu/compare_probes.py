#!/usr/bin/env python3
"""Compare layout_probe.py outputs of a layout against one GPU.

    compare_probes.py ONE.json OTHER.json [--tol NATS]

For each prompt: how many greedy tokens agree, and the largest difference of the log-probability
of any token both top-5 lists hold, over the positions whose prefixes are still equal (the first
parting position included: its prefix is equal). Exit 0 when every difference is within --tol.
"""
import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("one")
    ap.add_argument("other")
    ap.add_argument("--tol", type=float, default=0.25)
    a = ap.parse_args()
    one, other = json.load(open(a.one)), json.load(open(a.other))
    worst, agree_total, total = 0.0, 0, 0
    for i, (x, y) in enumerate(zip(one, other)):
        n = min(len(x["tokens"]), len(y["tokens"]))
        agree = next((p for p in range(n) if x["tokens"][p] != y["tokens"][p]), n)
        diff = 0.0
        for p in range(min(agree + 1, n)):
            tx, ty = x["top"][p], y["top"][p]
            common = set(tx) & set(ty)
            if common:
                diff = max(diff, max(abs(tx[t] - ty[t]) for t in common))
        gap = ""
        if agree < n:
            ranked = sorted(x["top"][agree].values(), reverse=True)
            gap = f", one GPU's top-2 gap there {ranked[0] - ranked[1]:.3f}" if len(ranked) > 1 else ""
        print(f"prompt {i} ({x['prompt_len']} ids): {agree}/{n} greedy tokens equal, "
              f"max |d logprob| {diff:.4f}{gap}")
        worst, agree_total, total = max(worst, diff), agree_total + agree, total + n
    verdict = "PASS" if worst <= a.tol else "FAIL"
    print(f"{verdict}: {agree_total}/{total} greedy tokens equal, max |d logprob| {worst:.4f} (tolerance {a.tol})")
    sys.exit(0 if worst <= a.tol else 1)


if __name__ == "__main__":
    main()
