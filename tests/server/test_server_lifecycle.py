"""`moeserve serve` under a queue limit, at SIGTERM and SIGINT, when its drain runs out of
time, when its engine dies, and when a rank stalls (the watchdog).

These need servers of their own (a limit of 2 sequences; a server that the test stops).
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
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


def _wait_for_health(server: ServerProcess, status: int, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        got, _, body = http(server, "GET", "/health", timeout=5)
        if got == status:
            return body
        assert time.monotonic() < deadline, f"/health still answers {got}: {body}"
        time.sleep(0.05)


def _drains(server: ServerProcess, stop, n_tokens: int = 200) -> None:
    """Start two streams, call `stop()`, and check the drain: /health and new requests answer
    503 while the streams run to their end; then the server exits 0."""
    streams = [SSEClient(server, "/v1/completions", stream_body(n_tokens)) for _ in range(2)]
    for s in streams:
        assert s.status == 200 and s.next_event() is not None
    stop()
    body = _wait_for_health(server, 503, 10)
    assert body["status"] == "draining", body
    status, headers, err = http(server, "POST", "/v1/completions",
                                {"model": MODEL, "prompt": "late", "max_tokens": 2})
    assert status == 503 and err["error"]["code"] == "draining", err
    assert int(headers["retry-after"]) >= 1
    assert server.proc.poll() is None, "the server exited before its requests finished"
    for s in streams:
        events = s.events()
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["usage"]["completion_tokens"] == n_tokens
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert server.proc.wait(timeout=60) == 0, server.log()
    assert "drained and stopped" in server.log()


def test_sigterm_drains_requests_in_flight(server):
    _drains(server, lambda: server.proc.send_signal(signal.SIGTERM))


def test_sigint_drains_like_sigterm(tmp_path):
    proc = ServerProcess(tmp_path / "server.log")
    try:
        # Ctrl-C in a terminal signals the whole process group, the rank processes too
        _drains(proc, lambda: os.killpg(proc.proc.pid, signal.SIGINT))
        assert "KeyboardInterrupt" not in proc.log(), proc.log()
    finally:
        if proc.proc.poll() is None:
            proc.kill()


def test_drain_timeout_ends_open_requests_with_an_error(tmp_path):
    proc = ServerProcess(tmp_path / "server.log", "--drain-timeout", "1")
    try:
        s = SSEClient(proc, "/v1/completions", stream_body(1500))
        assert s.status == 200 and s.next_event() is not None
        plain: dict = {}
        t = threading.Thread(target=lambda: plain.update(r=http(
            proc, "POST", "/v1/completions", {"model": MODEL, "prompt": "never done",
                                              "max_tokens": 1500, "ignore_eos": True})))
        t.start()
        time.sleep(0.5)  # the plain request is in
        proc.proc.send_signal(signal.SIGTERM)
        events = s.events()
        assert events[-1] == "[DONE]", events[-3:]
        err = json.loads(events[-2])["error"]
        assert err["code"] == "draining" and "--drain-timeout" in err["message"], err
        t.join(timeout=30)
        status, _, body = plain["r"]
        assert status == 503 and body["error"]["code"] == "draining", body
        assert proc.proc.wait(timeout=60) == 0, proc.log()
    finally:
        if proc.proc.poll() is None:
            proc.kill()


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out += [int(x) for x in text]
    return out


def _rank_pids(proc: ServerProcess) -> list[int]:
    workers = [c for c in _children(proc.proc.pid)
               if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    m = re.search(r"rank processes \(pids, by rank\): \[([\d, ]+)\]", proc.log())
    assert m is not None, proc.log()
    logged = [int(x) for x in m.group(1).split(",")]
    assert sorted(logged) == sorted(workers), (logged, workers)
    return logged


def test_stalled_rank_fails_every_client_and_the_server_exits(tmp_path):
    watchdog = 3.0
    proc = ServerProcess(tmp_path / "server.log", "--watchdog-timeout", str(watchdog))
    (rank,) = _rank_pids(proc)
    try:
        streams = [SSEClient(proc, "/v1/completions", stream_body(1500)) for _ in range(2)]
        for s in streams:
            assert s.status == 200 and s.next_event() is not None
        plain: dict = {}
        t = threading.Thread(target=lambda: plain.update(r=http(
            proc, "POST", "/v1/completions", {"model": MODEL, "prompt": "stuck",
                                              "max_tokens": 1500, "ignore_eos": True})))
        t.start()
        time.sleep(0.3)
        os.kill(rank, signal.SIGSTOP)
        stopped = time.monotonic()
        health = _wait_for_health(proc, 503, watchdog + 5)
        assert health["status"] == "engine failed" and "stalled" in health["error"], health
        for s in streams:
            events = s.events()
            assert events[-1] == "[DONE]"
            message = json.loads(events[-2])["error"]["message"]
            assert "stalled" in message and "--watchdog-timeout" in message, message
        t.join(timeout=watchdog + 5)
        assert time.monotonic() - stopped < watchdog + 5
        status, _, body = plain["r"]
        assert status >= 500 and "stalled" in body["error"]["message"], body
        assert proc.proc.wait(timeout=60) == 1, proc.log()
        assert "the engine failed" in proc.log()
    finally:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(rank, sig)
            except ProcessLookupError:
                pass
        if proc.proc.poll() is None:
            proc.kill()


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
