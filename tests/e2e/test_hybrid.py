"""The real `corridor serve` on the tiny qwen3_5 hybrid (gated delta-net layers beside full
attention): concurrent greedy completions, prefilled in chunks beside each other's decodes, each
give the text a request alone gets (crates/server/tests/hybrid_serving.rs checks that text against
transformers), the boot log says prefix caching is off for it, and /v1/memory books the recurrent
state apart from KV."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import requests

from conftest import MODEL, ROOT, start_server

HYBRID = ROOT / "tests" / "fixtures" / "tiny" / "qwen3_5"


def reference() -> tuple[str, int]:
    """The prompt, and how many of transformers' greedy steps come before a near tie."""
    r = json.loads((HYBRID / "reference.json").read_text())
    ids, margins = r["greedy"]["ids"], r["greedy"]["margins"]
    n = next((i for i, m in enumerate(margins) if m < 1e-3 or ids[i] == 2), len(ids))
    assert n >= 4
    return r["prompt_text"], n


def test_the_hybrid_serves_transformers_greedy_tokens_and_books_its_state():
    prompt, n = reference()
    s = start_server("--max-running-requests", "4", "--max-batched-tokens", "8", model=HYBRID)
    try:
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": n,
            "temperature": 0,
            "repetition_penalty": 1.0,
        }

        def complete(_: int) -> dict:
            r = requests.post(f"{s.url}/v1/completions", json=body, headers=s.headers(), timeout=60)
            assert r.status_code == 200, r.text
            return r.json()

        alone = complete(0)["choices"][0]["text"]
        # Four at once, prefilled in chunks of eight rows beside each other's decodes.
        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(complete, range(4)))
        assert [o["choices"][0]["text"] for o in outs] == [alone] * 4
        assert all(o["usage"]["completion_tokens"] == n for o in outs)

        memory = requests.get(f"{s.url}/v1/memory", headers=s.headers(), timeout=10).json()
        books = memory["cards"][0]["books"]
        assert books["state"] > 0, books
        assert books["kv_committed"] > 0, books
        s.wait_idle()
        assert "prefix caching is off" in s.log()
    finally:
        assert s.stop() == 0, s.log()
