"""What a request must show before the app sees it: the API key, a JSON body, a bounded size.

An ASGI middleware in front of the routes. /health (GET and HEAD) stays open, so that a
supervisor or a load balancer needs no key. The key is compared in constant time. A POST whose
Content-Type is not application/json is refused with 415: a web page can send a `text/plain`
body to any host without a CORS preflight, never an `application/json` one. The body limit is
checked on Content-Length before a byte is read, and again while the body is read (a chunked
upload), so that a larger body is never held in memory. The body must arrive within
--request-read-timeout seconds of the headers (408 otherwise), so that a client that sends it a
byte at a time cannot hold a connection and a handler forever; connection.py bounds the headers.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from typing import Any, Optional

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from moeserve.server.errors import APIError

OPEN_PATHS = ("/health",)
BODY_METHODS = ("POST", "PUT", "PATCH")
DEFAULT_MAX_REQUEST_BYTES = 32 * 1024 * 1024
DEFAULT_REQUEST_READ_TIMEOUT_S = 30.0


class RequestGuard:
    def __init__(self, app: ASGIApp, api_key: Optional[str] = None,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 read_timeout: float = DEFAULT_REQUEST_READ_TIMEOUT_S) -> None:
        if api_key is not None and not api_key:
            raise ValueError("--api-key is empty; give a key or leave the flag out")
        if max_request_bytes < 1:
            raise ValueError(f"--max-request-bytes must be at least 1, got {max_request_bytes}")
        if not read_timeout > 0:
            raise ValueError(f"--request-read-timeout must be more than 0 seconds, "
                             f"got {read_timeout:g}")
        self.app, self.max_bytes, self.read_timeout = app, max_request_bytes, read_timeout
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        refusal = self._refusal(scope["method"], headers)
        if refusal is not None:
            await refusal.response()(scope, receive, send)
            return
        await self.app(scope, self._limited(receive), send)

    def _refusal(self, method: str, headers: dict[bytes, bytes]) -> Optional[APIError]:
        if self.expected is not None and not hmac.compare_digest(
                headers.get(b"authorization", b""), self.expected):
            return APIError(401, "a missing or wrong API key: send the header "
                            "'Authorization: Bearer <key>' with the server's --api-key", None,
                            "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if method not in BODY_METHODS:
            return None
        media = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
        if media != b"application/json":
            shown = media.decode("latin-1") or "none"
            return APIError(415, f"the body must be JSON sent as 'Content-Type: "
                            f"application/json' (got {shown})", None,
                            "unsupported_media_type")
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return APIError(400, "Content-Length is not a number", None, "invalid_value")
            if int(length) > self.max_bytes:
                return self._too_large()
        return None

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than the server's limit of "
                        f"{self.max_bytes} bytes (--max-request-bytes)", None,
                        "request_too_large", headers={"Connection": "close"})

    def _limited(self, receive: Receive) -> Receive:
        seen, body_done = 0, False
        deadline = time.monotonic() + self.read_timeout

        async def receive_limited() -> Message:
            nonlocal seen, body_done
            if body_done:  # what comes now is only the disconnect, whenever it comes
                return await receive()
            try:
                msg = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0))
            except asyncio.TimeoutError:
                raise APIError(408, f"the request body did not arrive within "
                               f"{self.read_timeout:g} s (--request-read-timeout)", None,
                               "request_timeout", headers={"Connection": "close"}) from None
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise self._too_large()
                body_done = not msg.get("more_body", False)
            else:
                body_done = True
            return msg

        return receive_limited


def _headers(scope: Scope) -> dict[bytes, Any]:
    return {k.lower(): v for k, v in scope.get("headers", [])}
