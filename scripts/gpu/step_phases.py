#!/usr/bin/env python3
"""Where the engine's steps spent their time between two snapshots of
`GET /v1/engine/stats`: steps run, tokens generated, and the mean
milliseconds per step of each phase (schedule, forward, sample).

Usage: step_phases.py BEFORE.json AFTER.json
"""

import json
import sys


def main():
    try:
        a, b = (json.load(open(p)) for p in sys.argv[1:3])
    except (OSError, ValueError, IndexError) as e:
        print(f"engine steps: no snapshot ({e})")
        return
    steps = b.get("steps", 0) - a.get("steps", 0)
    gen = b.get("generated_tokens", 0) - a.get("generated_tokens", 0)
    if steps <= 0:
        print("engine steps: none in this run")
        return
    pa, pb = a.get("step_seconds", {}), b.get("step_seconds", {})
    parts = []
    for phase in ("schedule", "forward", "sample"):
        ms = (pb.get(phase, 0.0) - pa.get(phase, 0.0)) * 1e3 / steps
        parts.append(f"{phase} {ms:.3f}")
    print(f"engine steps: {steps} steps, {gen} tokens ({gen / steps:.1f} per step); ms per step: " + ", ".join(parts))


if __name__ == "__main__":
    main()
