"""`corridor memory` on the host: the identity
total = foreign + residue + books + free closes, and the books never claim
memory the process does not hold (KV committed is KV resident)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from conftest import BIN, start_server
from test_new_user import DEFAULT_MODEL

MIB = 1 << 20


def test_the_cpu_identity_closes_and_kv_is_resident():
    if not DEFAULT_MODEL.exists():
        if os.environ.get("CORRIDOR_REQUIRE_ASSETS"):
            pytest.fail(f"{DEFAULT_MODEL} is missing: run `corridor pull`")
        pytest.skip(f"{DEFAULT_MODEL} is missing: run `corridor pull`")
    # A KV pool large enough that untouched pages would show: 512 MiB.
    s = start_server("--kv-cache-mib", "512", model=None)
    try:
        # Read right after start-up, before any request has touched the KV
        # pages or the weights: what the books count must be resident already.
        out = subprocess.run(
            [str(BIN), "memory", "--url", s.url, "--json"], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        card = json.loads(out.stdout)["cards"][0]
        books = card["books"]
        assert card["kind"].lower() == "cpu", card
        assert books["kv_committed"] >= 400 * MIB, books
        # The books hold no more than the process: committed KV pages are resident.
        assert card["residue_bytes"] >= -4 * MIB, card
        # Everything on the host is accounted for, within a few MiB of pages
        # that came and went between the readings.
        assert abs(card["drift_bytes"]) <= 8 * MIB, card
        table = subprocess.run(
            [str(BIN), "memory", "--url", s.url], capture_output=True, text=True, timeout=60
        ).stdout
        assert "residue" in table and "Columns (sizes in MiB" in table, table
        assert s.stop() == 0
    finally:
        s.stop()


def test_memory_help_explains_the_columns():
    out = subprocess.run([str(BIN), "memory", "--help"], capture_output=True, text=True, timeout=30).stdout
    for column in ["total", "free", "floor", "foreign", "residue", "drift"]:
        assert f"\n  {column} " in out, out
