"""Serving many users: concurrency, a client that hangs up mid-stream, metrics,
the API key, and a graceful shutdown that exits 0."""

from __future__ import annotations

import json
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

from conftest import MODEL, start_server


def test_health_and_metrics(server, client):
    assert requests.get(f"{server.url}/health", timeout=10).json() == {"status": "ok"}
    client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    text = requests.get(f"{server.url}/metrics", timeout=10).text
    for family in [
        "corridor_requests_running",
        "corridor_requests_waiting",
        "corridor_kv_pages",
        "corridor_prefix_cache_hit_rate",
        "corridor_prompt_tokens_total",
        "corridor_generation_tokens_total",
        "corridor_time_to_first_token_seconds",
        "corridor_inter_token_latency_seconds",
        "corridor_preemptions_total",
        "corridor_requests_aborted_total",
    ]:
        assert f"# TYPE {family} " in text, family
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    assert samples["corridor_generation_tokens_total"] >= 3
    assert samples["corridor_time_to_first_token_seconds_count"] >= 1


def test_32_concurrent_requests_all_complete(server):
    def one(i: int) -> int:
        c = server.client()
        if i % 2:
            r = c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"request {i}"}],
                max_tokens=8,
                temperature=0.8,
                seed=i,
                extra_body={"ignore_eos": True},
            )
            return r.usage.completion_tokens
        chunks = list(
            c.completions.create(
                model=MODEL, prompt=f"request {i}", max_tokens=8, stream=True, extra_body={"ignore_eos": True}
            )
        )
        assert chunks[-1].choices[0].finish_reason == "length"
        return 8

    with ThreadPoolExecutor(max_workers=32) as pool:
        assert list(pool.map(one, range(32))) == [8] * 32


def test_a_dropped_stream_does_not_wedge_the_server(server, client):
    before = server.wait_idle()["aborted"]
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "keep talking"}],
        "max_tokens": 200,
        "stream": True,
        "ignore_eos": True,
    }
    with requests.post(f"{server.url}/v1/chat/completions", json=body, stream=True, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        data = [line for line in (next(lines) for _ in range(8)) if line.startswith(b"data:")]
        assert data, "some chunks arrived"
    # The connection is closed: the engine aborts the request and frees its pages.
    after = server.wait_idle()
    assert after["aborted"] == before + 1, after
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "still there?"}], max_tokens=2)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_api_key_and_graceful_shutdown():
    key = "e2e-secret-key"
    s = start_server("--log", "debug", env={"CORRIDOR_API_KEY": key}, api_key=key)
    try:
        assert requests.get(f"{s.url}/health", timeout=10).status_code == 200
        for path in ["/v1/models", "/metrics", "/v1/engine/stats"]:
            r = requests.get(f"{s.url}{path}", timeout=10)
            assert r.status_code == 401, path
            assert r.json()["error"]["code"] == "invalid_api_key"
        r = requests.get(f"{s.url}/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=10)
        assert r.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{s.url}/v1", api_key="wrong", max_retries=0).models.list()
        client = s.client()
        assert [m.id for m in client.models.list().data] == [MODEL]

        # A stream is in flight when SIGINT arrives: it ends, and the process exits 0.
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "a long answer"}],
            "max_tokens": 200,
            "stream": True,
            "ignore_eos": True,
        }
        received: list[bytes] = []
        started = threading.Event()

        def read_stream():
            with requests.post(f"{s.url}/v1/chat/completions", json=body, headers=s.headers(), stream=True, timeout=60) as r:
                for line in r.iter_lines():
                    received.append(line)
                    if len(received) >= 4:
                        started.set()
            started.set()

        reader = threading.Thread(target=read_stream)
        reader.start()
        assert started.wait(60), "the stream started"
        code = s.stop(signal.SIGINT)
        reader.join(timeout=30)
        assert not reader.is_alive(), "the stream ended when the server shut down"
        assert code == 0, s.log()
        events = [json.loads(line[5:]) for line in received if line.startswith(b"data:") and line != b"data: [DONE]"]
        finishes = [c.get("finish_reason") for e in events for c in e.get("choices", [])]
        assert "stop" not in finishes, "an abort must not be reported as a stop"
        assert key not in s.log(), "the API key must never be logged"
    finally:
        s.stop(signal.SIGKILL)
