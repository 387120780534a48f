"""`moeserve serve` listens while its engine starts: /health answers 503 "starting" (then 200,
never 503 again), every other route 503 with Retry-After; the log has one line per startup
phase and a summary."""

from __future__ import annotations

import time

import pytest

from server_proc import ServerProcess, http

pytestmark = pytest.mark.timeout(300)


def test_health_is_503_while_starting_then_200(tmp_path):
    proc = ServerProcess(tmp_path / "server.log", "--compile-cache-dir", str(tmp_path / "cc"),
                         wait_ready=False)
    try:
        seen: list[tuple[int, str]] = []
        other: list[tuple[int, dict, object]] = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            status, headers, body = http(proc, "GET", "/health", timeout=10)
            seen.append((status, body.get("status")))
            if status == 200:
                break
            assert headers.get("retry-after") == "5"
            if not other:
                other.append(http(proc, "GET", "/v1/models", timeout=10))
                other.append(http(proc, "POST", "/v1/completions", timeout=10, body={
                    "model": "preset:tiny", "prompt": "hi", "max_tokens": 2}))
            time.sleep(0.05)
        assert seen[0] == (503, "starting"), seen[:3]
        assert seen[-1] == (200, "ok")
        assert {s for s in seen[:-1]} == {(503, "starting")}
        for status, headers, body in other:
            assert status == 503 and headers.get("retry-after") == "5", (status, body)
            assert body["error"]["code"] == "starting", body
        # ready: every route serves, and /health stays 200
        assert http(proc, "GET", "/v1/models")[0] == 200
        status, _, body = http(proc, "POST", "/v1/completions", body={
            "model": "preset:tiny", "prompt": "hi", "max_tokens": 2})
        assert status == 200 and body["usage"]["completion_tokens"] == 2
        assert http(proc, "GET", "/health")[0] == 200
        log = proc.log()
        for phase in ("weights", "plan buffers", "warm-up compile", "graph capture"):
            assert log.count(f"startup: {phase} ") == 1, log
        assert log.count("startup: ready in") == 1
        assert f"compile cache {tmp_path / 'cc'}" in log
        assert (tmp_path / "cc" / "triton").is_dir()
    finally:
        assert proc.terminate() == 0
