"""`moeserve serve` under a queue limit, at SIGTERM, and when its engine dies.

These need servers of their own (a limit of 2 sequences; a server that the test stops).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from server_proc import MODEL, SSEClient, ServerProcess, http, wait_for_metrics

pytestmark = pytest.mark.timeout(300)


def stream_body(max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": "drain me", "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(tmp_path_factory.mktemp("lifecycle") / "server.log",
                         "--max-queued-requests", "2", "--disable-radix-cache")
    yield proc
    if proc.proc.poll() is None:
        proc.terminate()


def test_queue_limit_answers_503(server):
    streams = [SSEClient(server, "/v1/completions", stream_body(1500)) for _ in range(2)]
    for s in streams:
        assert s.status == 200 and s.next_event() is not None
    status, headers, err = http(server, "POST", "/v1/completions",
                                {"model": MODEL, "prompt": "one more", "max_tokens": 2})
    assert status == 503, err
    assert int(headers["retry-after"]) >= 1
    assert err["error"]["code"] == "queue_full" and err["error"]["type"]
    # more sequences than the limit can ever hold is the client's mistake, not a busy server
    status, _, err = http(server, "POST", "/v1/completions",
                          {"model": MODEL, "prompt": "x", "max_tokens": 2, "n": 3})
    assert status == 400 and err["error"]["param"] == "n"
    assert http(server, "GET", "/health")[0] == 200
    for s in streams:
        s.drop()
    # without a prefix cache, every slot is free again
    wait_for_metrics(server, lambda m: m["moeserve_num_requests_in_flight"] == 0
                     and m["moeserve_kv_used_slots"] == 0
                     and m["moeserve_kv_request_slots"] == 0, 60,
                     "the dropped streams were not aborted")
    status, _, r = http(server, "POST", "/v1/completions",
                        {"model": MODEL, "prompt": "room now", "max_tokens": 2})
    assert status == 200 and r["choices"][0]["text"] is not None


def _refused(server: ServerProcess) -> bool:
    try:
        with socket.create_connection((server.host, server.port), timeout=2):
            return False
    except OSError:
        return True


def test_sigterm_drains_requests_in_flight(server):
    n_tokens = 200
    streams = [SSEClient(server, "/v1/completions", stream_body(n_tokens)) for _ in range(2)]
    for s in streams:
        assert s.status == 200 and s.next_event() is not None
    server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while not _refused(server):  # no new connections once draining
        assert time.monotonic() < deadline, "the server still accepts connections"
        time.sleep(0.1)
    assert server.proc.poll() is None, "the server exited before its requests finished"
    for s in streams:
        events = s.events()
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["usage"]["completion_tokens"] == n_tokens
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert server.terminate(timeout=60) == 0, server.log()
    assert "drained and stopped" in server.log()


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out += [int(x) for x in text]
    return out


def test_engine_death_fails_requests_and_exits(tmp_path):
    proc = ServerProcess(tmp_path / "server.log")
    try:
        s = SSEClient(proc, "/v1/completions", stream_body(1500))
        assert s.status == 200 and s.next_event() is not None
        workers = [c for c in _children(proc.proc.pid)
                   if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
        assert workers, "no engine worker process found"
        for w in workers:
            os.kill(w, signal.SIGKILL)
        events = s.events()
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])
        message = err["error"]["message"]
        assert "rank 0" in message and "request id cmpl-" in message, message
        assert "Traceback" not in message and "/src/" not in message, message
        assert proc.proc.wait(timeout=60) == 1, proc.log()
        assert "the engine failed" in proc.log()
    finally:
        if proc.proc.poll() is None:
            proc.kill()
