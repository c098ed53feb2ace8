#!/usr/bin/env python3
"""The last CUDA op profile table of each batch size in a server log (CORRIDOR_CUDA_PROFILE runs).

    op_tables.py SERVE.log
"""
import re
import sys

tables, cur = {}, None
for line in open(sys.argv[1], errors="replace"):
    m = re.search(r"CUDA op profile over \d+ steps \(last step (\d+) rows\)", line)
    if m:
        cur = [line.rstrip()]
        tables[m.group(1)] = cur
    elif cur is not None and line.startswith("  "):
        cur.append(line.rstrip())
    else:
        cur = None
for t in tables.values():
    print("\n".join(t))
