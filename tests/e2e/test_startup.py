"""Start-up and the log, as the user sees them: a busy port fails before the
model loads, CORS headers follow `--cors-origin`, and every request leaves one
log line with its method, path, status, tokens and latency, in text or JSON."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time

import requests

from conftest import BIN, MODEL, TINY, start_server


def test_a_busy_port_fails_at_once_before_the_model_loads():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        started = time.monotonic()
        done = subprocess.run(
            [str(BIN), "serve", "--port", str(port), "--model", str(TINY)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        elapsed = time.monotonic() - started
    assert done.returncode != 0
    err = done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in err, err
    assert "choose another --port" in err, err
    # The checkpoint was never opened: the address is checked first.
    assert "opened checkpoint" not in err, err
    assert elapsed < 30, elapsed


def test_cors_headers_follow_the_flag():
    s = start_server("--cors-origin", "http://app.example")
    try:
        pre = requests.options(
            f"{s.url}/v1/chat/completions",
            headers={
                "Origin": "http://app.example",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type",
            },
            timeout=10,
        )
        assert pre.status_code == 200, pre.text
        assert pre.headers.get("access-control-allow-origin") == "http://app.example", pre.headers
        assert "POST" in pre.headers.get("access-control-allow-methods", "") or pre.headers.get(
            "access-control-allow-methods"
        ) == "*", pre.headers
        r = requests.get(f"{s.url}/v1/models", headers={"Origin": "http://app.example"}, timeout=10)
        assert r.headers.get("access-control-allow-origin") == "http://app.example", r.headers
        other = requests.get(f"{s.url}/v1/models", headers={"Origin": "http://evil.example"}, timeout=10)
        assert "access-control-allow-origin" not in other.headers, other.headers
    finally:
        s.stop()


def test_no_cors_headers_without_the_flag(server):
    r = requests.get(f"{server.url}/v1/models", headers={"Origin": "http://app.example"}, timeout=10)
    assert "access-control-allow-origin" not in r.headers, r.headers


def _chat(s, **extra) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **extra}
    r = requests.post(f"{s.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _wait_for(s, pattern: str) -> list[str]:
    deadline = time.monotonic() + 10
    while True:
        lines = [line for line in s.log().splitlines() if re.search(pattern, line)]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def test_one_text_log_line_per_request():
    s = start_server()
    try:
        usage = _chat(s)["usage"]
        # A stream's line is written when the stream ends, with its tokens.
        with requests.post(
            f"{s.url}/v1/completions",
            json={"model": MODEL, "prompt": "a b", "max_tokens": 3, "stream": True},
            stream=True,
            timeout=120,
        ) as r:
            assert r.status_code == 200
            for _ in r.iter_lines():
                pass
        bad = requests.post(f"{s.url}/v1/chat/completions", json={"model": MODEL}, timeout=10)
        assert bad.status_code == 400
        chat = _wait_for(s, r"request method=POST path=/v1/chat/completions status=200")
        assert len(chat) == 1, s.log()
        m = re.search(
            r"prompt_tokens=(\d+) completion_tokens=(\d+) latency_ms=(\d+\.\d)", chat[0]
        )
        assert m, chat[0]
        assert int(m.group(1)) == usage["prompt_tokens"] and int(m.group(2)) == usage["completion_tokens"]
        streamed = _wait_for(s, r"request method=POST path=/v1/completions status=200")
        assert len(streamed) == 1 and "completion_tokens=3" in streamed[0], s.log()
        assert len(_wait_for(s, r"request method=POST path=/v1/chat/completions status=400")) == 1, s.log()
    finally:
        s.stop()


def test_json_log_format():
    s = start_server("--log-format", "json")
    try:
        usage = _chat(s)["usage"]
        lines = _wait_for(s, r'"path":"/v1/chat/completions"')
        assert len(lines) == 1, s.log()
        event = json.loads(lines[0])
        assert event["message"] == "request" and event["method"] == "POST" and event["status"] == 200, event
        assert event["completion_tokens"] == usage["completion_tokens"], event
        assert float(event["latency_ms"]) > 0, event
        # Every line the server writes is JSON, the start-up lines included.
        for line in s.log().splitlines():
            json.loads(line)
    finally:
        s.stop()
