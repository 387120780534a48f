"""The server's guard: --api-key, JSON-only bodies, --max-request-bytes, --allowed-origins,
--request-read-timeout.

One server (tiny preset, CPU) with all these flags serves every test of this module. Raw
sockets send what an HTTP client library would not: a Content-Length with no body, a chunked
upload that does not stop, a body cut off halfway, headers or a body a byte at a time.
"""

from __future__ import annotations

import json
import select
import socket
import time

import openai
import pytest

from server_proc import MODEL, ServerProcess, http

pytestmark = pytest.mark.timeout(300)
KEY = "sk-test-5f0c2a"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 64 * 1024
ORIGIN = "https://app.example"
READ_TIMEOUT_S = 2.0
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "ignore_eos": True}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "ignore_eos": True}
ROUTES = [("GET", "/v1/models", None), ("GET", f"/v1/models/{MODEL}", None),
          ("GET", "/v1/plan", None), ("GET", "/metrics", None),
          ("POST", "/v1/completions", COMPLETION), ("POST", "/v1/chat/completions", CHAT)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(tmp_path_factory.mktemp("guard") / "server.log", "--api-key", KEY,
                         "--max-request-bytes", str(LIMIT),
                         "--allowed-origins", f"{ORIGIN},https://other.example",
                         "--request-read-timeout", str(READ_TIMEOUT_S))
    yield proc
    assert proc.terminate() == 0, proc.log()


def error_body(status: int, body, code: str) -> dict:
    """An OpenAI error body with `code`, with no traceback or source path in it."""
    assert isinstance(body, dict) and set(body) == {"error"}, (status, body)
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == code, body
    text = json.dumps(body)
    assert "Traceback" not in text and "/src/" not in text, text
    return body["error"]


def raw_request(server: ServerProcess, head: str, chunks=(), close_after=False) -> bytes:
    """Send `head` (the request line and headers) and `chunks` of body over a raw socket;
    the response (as far as it came), or b"" when `close_after` drops the connection."""
    sock = socket.create_connection((server.host, server.port), timeout=30)
    try:
        sock.sendall(head.encode() + b"\r\n\r\n")
        for chunk in chunks:
            if select.select([sock], [], [], 0.01)[0]:
                break  # the server answered before the body ended: read what it said
            try:
                sock.sendall(chunk)
            except OSError:
                break
        if close_after:
            return b""
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            got = sock.recv(65536)
            if not got:
                break
            data += got
        return data
    finally:
        sock.close()


def status_and_body(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def post_head(length: str = "", extra: str = "") -> str:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json{length}{extra}")


def assert_serving(server: ServerProcess) -> None:
    status, _, body = http(server, "POST", "/v1/completions", COMPLETION, headers=AUTH)
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body


# --- the API key --------------------------------------------------------------------------------

def test_every_route_but_health_needs_the_key(server):
    wrong = [{}, {"Authorization": "Bearer nope"}, {"Authorization": f"Bearer {KEY}x"},
             {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}]
    for method, path, body in ROUTES + [("GET", "/v1/nothing", None)]:
        for headers in wrong:
            status, got, err = http(server, method, path, body, headers=headers)
            assert status == 401, (method, path, headers, status, err)
            error_body(status, err, "invalid_api_key")
            assert got.get("www-authenticate") == "Bearer"
    for method, path, body in ROUTES:
        status, _, got = http(server, method, path, body, headers=AUTH)
        assert status == 200, (method, path, got)
    assert http(server, "GET", "/v1/nothing", headers=AUTH)[0] == 404
    assert http(server, "GET", "/health")[0] == 200
    assert http(server, "HEAD", "/health")[0] == 200


def test_the_openai_client_with_and_without_the_key(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0,
                       timeout=120) as client:
        assert [m.id for m in client.models.list().data] == [MODEL]
        r = client.completions.create(model=MODEL, prompt="hi", max_tokens=3,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
            stream=True, extra_body={"ignore_eos": True}))
        assert chunks[-1].choices[0].finish_reason == "length"
    with openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0,
                       timeout=120) as client:
        with pytest.raises(openai.AuthenticationError) as e:
            client.models.list()
        assert e.value.code == "invalid_api_key"


# --- bodies: JSON only, bounded ------------------------------------------------------------------

def test_post_bodies_only_as_json(server):
    raw = json.dumps(COMPLETION).encode()
    for media in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                  "application/jsonx", ""):
        status, _, err = http(server, "POST", "/v1/completions", raw=raw, headers={
            **AUTH, "Content-Type": media, "Origin": "https://evil.example"})
        assert status == 415, (media, err)
        error_body(status, err, "unsupported_media_type")
    for media in ("application/json; charset=utf-8", "Application/JSON"):
        status, _, body = http(server, "POST", "/v1/completions", raw=raw,
                               headers={**AUTH, "Content-Type": media})
        assert status == 200, (media, body)


def test_body_over_the_limit_by_content_length(server):
    # refused from the header alone: the body is never sent
    status, body = status_and_body(raw_request(server, post_head(
        f"\r\nContent-Length: {LIMIT + 1}")))
    assert status == 413
    assert str(LIMIT) in error_body(status, body, "request_too_large")["message"]
    assert_serving(server)


def test_body_over_the_limit_while_it_streams_in(server):
    chunk = b"x" * 8192
    chunks = [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * (2 * LIMIT // len(chunk))
    status, body = status_and_body(raw_request(
        server, post_head(extra="\r\nTransfer-Encoding: chunked"), chunks))
    assert status == 413
    error_body(status, body, "request_too_large")
    assert_serving(server)


def test_body_under_the_limit_is_read(server):
    prompt = "z" * (LIMIT - 200)  # longer than the context: a 400 after tokenizing, not 413
    status, _, err = http(server, "POST", "/v1/completions", {**COMPLETION, "prompt": prompt},
                          headers=AUTH)
    assert status == 400
    error_body(status, err, "context_length_exceeded")


def test_a_client_that_sends_half_its_body_and_leaves(server):
    before = server.log()
    body = json.dumps(COMPLETION).encode()
    raw_request(server, post_head(f"\r\nContent-Length: {len(body)}"),
                [body[:len(body) // 2]], close_after=True)
    chunked = b"%x\r\n%s\r\n" % (8, body[:8])
    raw_request(server, post_head(extra="\r\nTransfer-Encoding: chunked"), [chunked],
                close_after=True)
    time.sleep(1.0)
    assert_serving(server)
    after = server.log()[len(before):]
    assert "Traceback" not in after and "ERROR" not in after, after


# --- slow clients ------------------------------------------------------------------------------

def read_until_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """What the server sent until it closed the connection, and the seconds that took."""
    start, data = time.monotonic(), b""
    sock.settimeout(limit_s)
    while True:
        try:
            got = sock.recv(65536)
        except ConnectionResetError:
            got = b""
        if not got:
            return data, time.monotonic() - start
        data += got


def test_a_body_that_does_not_arrive_gets_408(server):
    sock = socket.create_connection((server.host, server.port), timeout=30)
    try:
        sock.sendall(post_head("\r\nContent-Length: 100").encode() + b"\r\n\r\n" + b"{" * 10)
        data, took = read_until_closed(sock, READ_TIMEOUT_S + 3)
    finally:
        sock.close()
    assert took < READ_TIMEOUT_S + 3, took
    status, body = status_and_body(data)
    assert status == 408, data
    assert "--request-read-timeout" in error_body(status, body, "request_timeout")["message"]
    assert_serving(server)


def test_a_body_sent_a_byte_at_a_time_gets_408(server):
    sock = socket.create_connection((server.host, server.port), timeout=30)
    start = time.monotonic()
    try:
        sock.sendall(post_head("\r\nContent-Length: 1000").encode() + b"\r\n\r\n")
        while not select.select([sock], [], [], 0.2)[0] and time.monotonic() - start < 10:
            sock.sendall(b" ")
        data, _ = read_until_closed(sock, READ_TIMEOUT_S + 3)
    finally:
        sock.close()
    assert time.monotonic() - start < READ_TIMEOUT_S + 3
    assert status_and_body(data)[0] == 408, data
    assert_serving(server)


def test_headers_that_do_not_arrive_close_the_connection(server):
    # a connection that sends nothing, and one that sends its headers a byte at a time: no
    # response can be framed before the request line is in, so the server closes them
    for trickle in (b"", post_head().encode()):
        sock = socket.create_connection((server.host, server.port), timeout=30)
        start, data = time.monotonic(), b""
        try:
            for byte in trickle:
                if select.select([sock], [], [], 0.2)[0]:
                    break
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    break
            data, _ = read_until_closed(sock, READ_TIMEOUT_S + 3)
        finally:
            sock.close()
        took = time.monotonic() - start
        assert data == b"" and took < READ_TIMEOUT_S + 3, (trickle[:20], data, took)
    assert_serving(server)


def test_a_body_left_unread_is_not_waited_for(server):
    # a 404 answers before the body is read; the rest, sent a byte at a time, is not awaited
    sock = socket.create_connection((server.host, server.port), timeout=30)
    start, data = time.monotonic(), b""
    try:
        sock.sendall(post_head("\r\nContent-Length: 1000").replace(
            "/v1/completions", "/v1/nothing").encode() + b"\r\n\r\n")
        while time.monotonic() - start < READ_TIMEOUT_S + 3:
            if select.select([sock], [], [], 0.2)[0]:
                got = sock.recv(65536)
                if not got:
                    break
                data += got
            try:
                sock.sendall(b" ")
            except OSError:
                break
    finally:
        sock.close()
    assert time.monotonic() - start < READ_TIMEOUT_S + 3
    assert data.startswith(b"HTTP/1.1 404"), data
    assert_serving(server)


# --- CORS ---------------------------------------------------------------------------------------

def test_cors_for_the_allowed_origins_only(server):
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    status, headers, _ = http(server, "OPTIONS", "/v1/completions",
                              headers={"Origin": ORIGIN, **preflight})
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in headers["access-control-allow-headers"].lower()
    status, headers, _ = http(server, "OPTIONS", "/v1/completions",
                              headers={"Origin": "https://evil.example", **preflight})
    assert "access-control-allow-origin" not in headers
    _, headers, _ = http(server, "GET", "/v1/models", headers={**AUTH, "Origin": ORIGIN})
    assert headers["access-control-allow-origin"] == ORIGIN
    _, headers, _ = http(server, "GET", "/v1/models",
                         headers={**AUTH, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in headers
