#!/usr/bin/env python3
"""A foreign process that grows into a GPU's memory on a schedule, for relief soaks.

Usage:
    python3 scripts/gpu/intruder.py --seconds 300 --period 30 --steps 8 --step-gib 1 --hold 10

Every PERIOD seconds it takes STEPS blocks of STEP_GIB GiB one per second (torch, device
memory that it really touches), holds them HOLD seconds, frees them and returns them to the
driver (empty_cache), until SECONDS have passed. A block the driver refuses is skipped and
logged: the intruder takes what it can, the way a co-tenant would. Each line it prints is
"t_s action held_gib".
"""

import argparse
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=300)
    ap.add_argument("--period", type=float, default=30)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--step-gib", type=float, default=1)
    ap.add_argument("--hold", type=float, default=10)
    a = ap.parse_args()
    torch.cuda.init()
    start = time.monotonic()
    now = lambda: time.monotonic() - start
    block = int(a.step_gib * (1 << 30))
    cycle = 0
    while now() + a.steps + a.hold < a.seconds:
        t0 = now()
        held = []
        for _ in range(a.steps):
            try:
                x = torch.empty(block, dtype=torch.uint8, device="cuda")
                x.fill_(1)
                held.append(x)
                print(f"{now():.1f} took {len(held) * a.step_gib:.0f}", flush=True)
            except torch.OutOfMemoryError:
                print(f"{now():.1f} refused {len(held) * a.step_gib:.0f}", flush=True)
            torch.cuda.synchronize()
            time.sleep(1)
        time.sleep(a.hold)
        held.clear()
        torch.cuda.empty_cache()
        print(f"{now():.1f} freed 0 (cycle {cycle})", flush=True)
        cycle += 1
        time.sleep(max(0.0, t0 + a.period - now()))


if __name__ == "__main__":
    main()
