"""The new user's first minute: `corridor serve` with no `--model` serves the
default model (SmolLM2-135M-Instruct, fetched by `corridor pull`), and the
official client gets a sensible answer to a simple question."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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
