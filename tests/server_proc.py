"""A real `moeserve serve` in a subprocess, for the server tests, and raw HTTP helpers.

The server binds port 0 and prints the address it got, so there is no port race. It runs in
its own session: teardown sends SIGTERM (a drain), and if that does not end it, kills its
process group (the server and the engine worker it spawned).
"""

from __future__ import annotations

import http.client as httpclient
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Optional

TINY = ["--model", "preset:tiny", "--load-format", "dummy", "--device", "cpu",
        "--max-total-tokens", "4096"]
MODEL = "preset:tiny"
START_TIMEOUT_S = 180.0
URL_LINE = re.compile(r"moeserve: serving .* on (http://[\w.\[\]:]+)")


class ServerProcess:
    def __init__(self, log_path: Path, *flags: str, wait_ready: bool = True) -> None:
        """Start the server; with wait_ready, return once /health answers 200 (the server
        listens while its engine starts, answering 503)."""
        self.log_path = log_path
        self._log = open(log_path, "w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moeserve.cli", "serve", *TINY, "--host", "127.0.0.1",
             "--port", "0", *flags],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.url = self._wait_for_url()
        self.host, port = self.url.removeprefix("http://").rsplit(":", 1)
        self.port = int(port)
        if wait_ready:
            self.wait_ready()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if http(self, "GET", "/health", timeout=5)[0] == 200:
                    return
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.log()}")
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"the engine was not ready in {START_TIMEOUT_S}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_for_url(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            m = URL_LINE.search(self.log())
            if m:
                return m.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.log()}")
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"the server did not start in {START_TIMEOUT_S}s:\n{self.log()}")

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait for the exit code (killing the group if it does not come)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        finally:
            self._log.close()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)


def http(server: ServerProcess, method: str, path: str, body: Any = None,
         raw: Optional[bytes] = None, timeout: float = 60.0,
         headers: Optional[dict[str, str]] = None) -> tuple[int, dict[str, str], Any]:
    """(status, headers with lower-case names, parsed JSON or text) of one request; `headers`
    add to (or replace) Content-Type: application/json."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(server.url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, headers, payload = resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as err:
        status, headers, payload = err.code, err.headers, err.read()
    headers = {k.lower(): v for k, v in headers.items()}
    text = payload.decode("utf-8", errors="replace")
    try:
        return status, headers, json.loads(text)
    except json.JSONDecodeError:
        return status, headers, text


def metrics(server: ServerProcess) -> dict[str, float]:
    """The /metrics samples, as {'name{labels}': value}."""
    status, _, text = http(server, "GET", "/metrics")
    assert status == 200, text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def wait_for_metrics(server: ServerProcess, cond: Callable[[dict[str, float]], bool],
                     timeout: float, what: str) -> dict[str, float]:
    """Poll /metrics until `cond` holds (the engine's figures lag its work by a step)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if cond(m):
            return m
        if time.monotonic() > deadline:
            shown = {k: v for k, v in m.items() if "kv" in k or "num" in k}
            raise AssertionError(f"{what} within {timeout}s; metrics: {shown}")
        time.sleep(0.2)


class SSEClient:
    """A streaming request over a raw connection: read events one by one, or drop it."""

    def __init__(self, server: ServerProcess, path: str, body: dict[str, Any],
                 timeout: float = 120.0) -> None:
        self.conn = httpclient.HTTPConnection(server.host, server.port, timeout=timeout)
        self.conn.request("POST", path, json.dumps(body),
                          {"Content-Type": "application/json"})
        self.resp = self.conn.getresponse()
        self.status = self.resp.status

    def next_event(self) -> Optional[str]:
        """The data of the next event; None at the end of the stream."""
        while True:
            line = self.resp.readline()
            if not line:
                return None
            line = line.decode().rstrip("\r\n")
            if line.startswith("data: "):
                return line[len("data: "):]

    def events(self) -> list[str]:
        out = []
        while (e := self.next_event()) is not None:
            out.append(e)
        return out

    def drop(self) -> None:
        """Disconnect mid-stream, as a client that goes away."""
        sock = self.conn.sock
        if sock is not None:
            sock.shutdown(2)  # SHUT_RDWR: the server sees the connection close now
        self.conn.close()
