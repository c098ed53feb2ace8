"""Phase flips through the real server: a flipping group on sim cards of 32/20/20 GiB
(`--phase-flip manual`), flipped by `POST /v1/admin/layout` while chat completions stream.
Every completion gets the tokens it gets without flips; the admin endpoint is behind the API
key and answers bad input with the OpenAI error object; the serving layout and the flip
counters show in /v1/memory, `corridor memory` and /metrics."""

from __future__ import annotations

import re
import subprocess
import threading

import requests

from conftest import BIN, MODEL, start_server

KEY = "flip-key"
PROMPTS = [f"Tell me about flips number {i} and their layouts." for i in range(12)]


def complete(server, prompt: str) -> tuple[str, str]:
    r = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=16,
        temperature=0,
        # Every answer runs its 16 tokens, so the comparison with flips covers
        # them all: the random model's end-of-turn token can win a greedy step.
        extra_body={"ignore_eos": True},
    )
    return r.choices[0].message.content, r.choices[0].finish_reason


def run_all(server) -> list[tuple[str, str]]:
    out: list = [None] * len(PROMPTS)

    def worker(k: int):
        for i in range(k, len(PROMPTS), 4):
            out[i] = complete(server, PROMPTS[i])

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_flips_by_hand_carry_streaming_requests_and_show_everywhere():
    s = start_server(
        "--devices", "sim:32GiB,20GiB,20GiB", "--phase-flip", "manual",
        "--max-running-requests", "8", "--max-batched-tokens", "64",
        env={"CORRIDOR_API_KEY": KEY}, api_key=KEY,
    )
    try:
        admin = f"{s.url}/v1/admin/layout"
        assert requests.get(admin, timeout=10).status_code == 401, "the admin endpoint needs the key"
        layout = requests.get(admin, headers=s.headers(), timeout=10).json()
        assert layout["serving"] == "tp" and layout["phase_flip"] == "manual", layout

        bad = requests.post(admin, headers=s.headers(), json={"layout": "dp"}, timeout=10)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "layout", bad.text
        missing = requests.post(admin, headers=s.headers(), json={}, timeout=10)
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "layout", missing.text
        same = requests.post(admin, headers=s.headers(), json={"layout": "tp"}, timeout=10)
        assert same.status_code == 409 and same.json()["error"]["code"] == "conflict", same.text

        plain = run_all(s)
        assert all(reason == "length" for _, reason in plain), plain

        flips: list[dict] = []
        done = threading.Event()

        def flipper():
            to = "pp"
            while not done.is_set() or len(flips) < 4:
                r = requests.post(admin, headers=s.headers(), json={"layout": to}, timeout=60)
                assert r.status_code == 200, r.text
                flips.append(r.json())
                to = "tp" if to == "pp" else "pp"

        t = threading.Thread(target=flipper)
        t.start()
        flipped = run_all(s)
        done.set()
        t.join()
        assert flipped == plain, "the same answers with flips in between"
        assert all(f["committed"] for f in flips), flips
        assert any(f["requests"] > 0 and f["bytes_moved"] > 0 for f in flips), "a flip carried running requests"

        serving = flips[-1]["to"]
        memory = requests.get(f"{s.url}/v1/memory", headers=s.headers(), timeout=10).json()
        assert memory["layout"]["serving"] == serving, memory["layout"]
        assert memory["layout"]["flips"]["to_pp"] + memory["layout"]["flips"]["to_tp"] == len(flips)
        for card in memory["cards"]:
            assert card["breaches"] == 0, card

        table = subprocess.run(
            [str(BIN), "memory", "--url", s.url], capture_output=True, text=True, timeout=60,
            env={"CORRIDOR_API_KEY": KEY, "PATH": "/usr/bin:/bin"},
        )
        assert table.returncode == 0, table.stderr
        assert f"layout: serving in {serving}" in table.stdout, table.stdout

        metrics = requests.get(f"{s.url}/metrics", headers=s.headers(), timeout=10).text
        to_pp = int(re.search(r'corridor_phase_flips_total\{to="pp"\} (\d+)', metrics).group(1))
        to_tp = int(re.search(r'corridor_phase_flips_total\{to="tp"\} (\d+)', metrics).group(1))
        assert to_pp + to_tp == len(flips) and to_pp >= 2, metrics
        count = int(re.search(r"corridor_phase_flip_duration_seconds_count (\d+)", metrics).group(1))
        assert count == len(flips)
        assert f'corridor_layout_serving{{layout="{serving}"}} 1' in metrics
    finally:
        assert s.stop() == 0, s.log()
