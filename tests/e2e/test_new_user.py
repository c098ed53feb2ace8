"""The new user's first minute: `corridor serve` with no `--model` serves the
default model (SmolLM2-135M-Instruct, fetched by `corridor pull`), and the
official client gets a sensible answer to a simple question."""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from conftest import start_server

CACHE = Path(os.environ.get("CORRIDOR_CACHE_DIR", Path.home() / ".cache" / "corridor"))
DEFAULT_MODEL = CACHE / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_default_model_knows_the_capital_of_france():
    if not DEFAULT_MODEL.exists():
        if os.environ.get("CORRIDOR_REQUIRE_ASSETS"):
            pytest.fail(f"{DEFAULT_MODEL} is missing: run `corridor pull`")
        pytest.skip(f"{DEFAULT_MODEL} is missing: run `corridor pull`")
    s = start_server(model=None)
    try:
        client = s.client()
        model = client.models.list().data[0].id
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            temperature=0,
        )
        assert "Paris" in r.choices[0].message.content, r.choices[0].message.content
        assert r.usage.completion_tokens <= 24
        assert s.stop() == 0
    finally:
        s.stop()


def readme_first_request() -> dict:
    """The body of the README's first curl command, read from the README itself
    so the test cannot drift from what a new user copies."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    match = re.search(r"curl [^\n]*localhost:8000(/v1/chat/completions)[^\n]*\n\s*-d '([^']*)'", readme)
    assert match, "the README has no curl request to /v1/chat/completions"
    return json.loads(match.group(2))


def test_readme_request_answers_and_stops_with_the_default_sampling():
    """The README's request leaves out temperature and max_tokens, so what a new
    user sees is the server's default sampling: every reply must end by itself,
    briefly, and name the capital."""
    if not DEFAULT_MODEL.exists():
        if os.environ.get("CORRIDOR_REQUIRE_ASSETS"):
            pytest.fail(f"{DEFAULT_MODEL} is missing: run `corridor pull`")
        pytest.skip(f"{DEFAULT_MODEL} is missing: run `corridor pull`")
    body = readme_first_request()
    assert "temperature" not in body and "max_tokens" not in body, body
    s = start_server(model=None)
    try:
        def ask(seed: int) -> dict:
            r = requests.post(f"{s.url}/v1/chat/completions", json={**body, "seed": seed}, timeout=600)
            assert r.status_code == 200, r.text
            return r.json()

        # Sent together: the engine batches them, which keeps the test short.
        with ThreadPoolExecutor(max_workers=20) as pool:
            replies = list(pool.map(ask, range(20)))
        texts = [r["choices"][0]["message"]["content"] for r in replies]
        for seed, r in enumerate(replies):
            choice = r["choices"][0]
            assert choice["finish_reason"] == "stop", (seed, choice)
            assert r["usage"]["completion_tokens"] <= 64, (seed, r["usage"], choice)
        paris = sum("Paris" in t for t in texts)
        assert paris >= 18, texts
        assert s.stop() == 0
    finally:
        s.stop()
