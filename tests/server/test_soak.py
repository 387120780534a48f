"""A soak: mixed traffic from 8 concurrent clients against one real server for minutes.

Slow, so it runs only with MOESERVE_SOAK=1 (MOESERVE_SOAK_SECONDS, default 180, sets its
length). Every request must succeed, except the streams that a client drops on purpose; the
resident memory of the server and its ranks at the end must stay within 1.5x of what it was
after a warm-up, so that nothing a request leaves behind (KV pages, stream state, detokenizers,
logprob buffers) piles up.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from pathlib import Path

import pytest

from server_proc import MODEL, ServerProcess, SSEClient, http

SECONDS = float(os.environ.get("MOESERVE_SOAK_SECONDS", "180"))
WARMUP_S = 20.0
CLIENTS = 8
RSS_GROWTH = 1.5
pytestmark = [pytest.mark.slow, pytest.mark.timeout(SECONDS + 300),
              pytest.mark.skipif(os.environ.get("MOESERVE_SOAK") != "1",
                                 reason="a soak of minutes: set MOESERVE_SOAK=1 to run it")]
PROMPTS = ["hello", "the quick brown fox", "1, 2, 3,", "once upon a time there was",
           "x" * 200, "é漢字 🙂"]


def rss_kib(root: int) -> int:
    """VmRSS of `root` and every process below it (the ranks and their helpers)."""
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
        total += next((int(line.split()[1]) for line in status.splitlines()
                       if line.startswith("VmRSS:")), 0)
    return total


def request_body(rng: random.Random, chat: bool, stream: bool) -> dict:
    body = {"model": MODEL, "max_tokens": rng.randint(1, 24), "stream": stream,
            "temperature": rng.choice([0.0, 0.7, 1.0]), "ignore_eos": rng.random() < 0.5}
    prompt = rng.choice(PROMPTS)
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if rng.random() < 0.3:
        body["stop"] = [rng.choice(["a", "e ", "\n", "the"])]
    if rng.random() < 0.3:
        body.update({"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2})
    if not stream and rng.random() < 0.3:
        body["n"] = 2
    return body


class Client(threading.Thread):
    def __init__(self, server: ServerProcess, seed: int, stop_at: float) -> None:
        super().__init__(daemon=True)
        self.server, self.rng, self.stop_at = server, random.Random(seed), stop_at
        self.counts: dict[str, int] = {}
        self.errors: list[str] = []

    def run(self) -> None:
        while time.monotonic() < self.stop_at and len(self.errors) < 5:
            try:
                self.one()
            except Exception as exc:  # a failure is counted, the soak goes on
                self.errors.append(f"{type(exc).__name__}: {exc}")

    def one(self) -> None:
        chat, stream = self.rng.random() < 0.5, self.rng.random() < 0.5
        drop = stream and self.rng.random() < 0.2
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body = request_body(self.rng, chat, stream)
        kind = f"{'chat' if chat else 'completion'}{'-stream' if stream else ''}" \
               f"{'-dropped' if drop else ''}"
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if not stream:
            status, _, out = http(self.server, "POST", path, body)
            if status != 200 or len(out.get("choices", [])) != body.get("n", 1):
                self.errors.append(f"{kind} {body}: {status} {out}")
            return
        if drop:
            body["max_tokens"], body["ignore_eos"] = 64, True
        sse = SSEClient(self.server, path, body)
        if sse.status != 200:
            self.errors.append(f"{kind} {body}: {sse.status} {sse.resp.read()!r}")
            return
        if drop:
            sse.next_event()
            sse.drop()
            return
        events = sse.events()
        sse.conn.close()
        bad = [e for e in events[:-1] if "error" in json.loads(e)]
        if not events or events[-1] != "[DONE]" or bad:
            self.errors.append(f"{kind} {body}: {events[-3:]}")


def test_soak_mixed_traffic_no_errors_flat_memory(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path / "server.log")
    try:
        start = time.monotonic()
        clients = [Client(server, seed, start + SECONDS) for seed in range(CLIENTS)]
        for c in clients:
            c.start()
        time.sleep(min(WARMUP_S, SECONDS / 2))
        warm = rss_kib(server.proc.pid)
        for c in clients:
            c.join(timeout=SECONDS + 120)
        end = rss_kib(server.proc.pid)
        counts: dict[str, int] = {}
        for c in clients:
            for k, v in c.counts.items():
                counts[k] = counts.get(k, 0) + v
        errors = [e for c in clients for e in c.errors]
        print(f"soak {SECONDS:g} s, {CLIENTS} clients: {sum(counts.values())} requests "
              f"{dict(sorted(counts.items()))}; RSS after warm-up {warm / 1024:.0f} MiB, "
              f"at the end {end / 1024:.0f} MiB ({end / warm:.2f}x)")
        assert not any(c.is_alive() for c in clients), "a client hung"
        assert not errors, errors[:5]
        assert status_ok(server)
        assert end <= RSS_GROWTH * warm, (warm, end)
    finally:
        assert server.terminate() == 0, server.log()[-3000:]


def status_ok(server: ServerProcess) -> bool:
    status, _, _ = http(server, "GET", "/health")
    return status == 200
