"""Start the real `corridor serve` on the tiny fixture model for the end-to-end tests.

The binary is `target/debug/corridor` (override with CORRIDOR_BIN). One server is
shared by the session; tests that need their own (an API key, a shutdown) start
one with `start_server`. After every test that used the shared server, the
page pool is checked: free + cached + in_use + withheld == capacity, and no
page is in use once the engine is idle.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import requests

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("CORRIDOR_BIN", ROOT / "target" / "debug" / "corridor"))
TINY = ROOT / "tests" / "fixtures" / "tiny" / "llama-f32"
MODEL = "tiny"
# The tiny fixture's trained context.
CONTEXT = 256
BOOT_TIMEOUT_S = 120
STOP_TIMEOUT_S = 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    process: subprocess.Popen
    port: int
    log_path: Path
    api_key: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=self.api_key or "unused", max_retries=0, timeout=120, **kwargs
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def stats(self) -> dict:
        r = requests.get(f"{self.url}/v1/engine/stats", headers=self.headers(), timeout=10)
        r.raise_for_status()
        return r.json()

    def wait_idle(self) -> dict:
        """The engine publishes its counts after each loop turn, a moment after a
        response completes, so wait (bounded) for it to settle."""
        deadline = time.monotonic() + 30
        while True:
            s = self.stats()
            p = s["pages"]
            assert p["free"] + p["cached"] + p["in_use"] + p["withheld"] == p["capacity"], s
            if p["in_use"] == 0 and s["running"] == 0 and s["waiting"] == 0:
                return s
            assert time.monotonic() < deadline, f"the engine did not become idle: {s}"
            time.sleep(0.02)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"the server did not stop within {STOP_TIMEOUT_S}s:\n{self.log()}")


def start_server(*extra: str, model: Path | None = TINY, env: dict | None = None, api_key: str | None = None) -> Server:
    if not BIN.exists():
        pytest.fail(f"{BIN} is missing: run `cargo build` first (or set CORRIDOR_BIN)")
    port = free_port()
    args = [str(BIN), "serve", "--port", str(port)]
    if model is not None:
        args += ["--model", str(model), "--served-model-name", MODEL]
    args += list(extra)
    log = tempfile.NamedTemporaryFile(prefix="corridor-e2e-", suffix=".log", delete=False)
    process = subprocess.Popen(
        args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, cwd=ROOT
    )
    server = Server(process=process, port=port, log_path=Path(log.name), api_key=api_key)
    deadline = time.monotonic() + BOOT_TIMEOUT_S
    while True:
        if process.poll() is not None:
            pytest.fail(f"the server exited with {process.returncode} while booting:\n{server.log()}")
        try:
            if requests.get(f"{server.url}/health", timeout=2).status_code == 200:
                return server
        except requests.ConnectionError:
            pass
        if time.monotonic() > deadline:
            server.stop(signal.SIGKILL)
            pytest.fail(f"the server did not answer /health within {BOOT_TIMEOUT_S}s:\n{server.log()}")
        time.sleep(0.1)


@pytest.fixture(scope="session")
def server():
    # Small limits so that prefill is chunked and requests queue.
    s = start_server("--max-running-requests", "16", "--max-batched-tokens", "64")
    yield s
    code = s.stop()
    assert code == 0, f"the server exited with {code} on SIGTERM:\n{s.log()}"


@pytest.fixture
def client(server):
    return server.client()


@pytest.fixture(autouse=True)
def page_pool_invariant(request):
    """After every test on the shared server: the pool accounts for every page
    and the idle engine holds none."""
    yield
    if "server" in request.fixturenames:
        s = request.getfixturevalue("server")
        if s.process.poll() is None:
            s.wait_idle()
