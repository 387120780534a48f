"""uvicorn's HTTP/1.1 protocol (h11) with a bound on the time to send a request's headers.

uvicorn bounds an idle keep-alive connection (timeout_keep_alive) and the size of the headers
(h11's limit on an incomplete event), but not the time the headers take: a client that sends
them a byte at a time (slowloris) holds its connection forever. Here, whenever no request is
being handled (the connection has just opened, or the last response has ended), the next
request's headers must be complete within --request-read-timeout seconds, or the connection is
closed: no response can be framed before the request line has come, and the rest of a body
that a handler answered without reading is not waited for. The body of a request being
handled is bounded by the same timeout in guard.py, from the headers' end.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

from uvicorn.protocols.http.h11_impl import H11Protocol


def timed_h11_protocol(header_timeout: float) -> type[H11Protocol]:
    """The protocol class to give uvicorn.Config(http=...)."""
    if not header_timeout > 0:
        raise ValueError(f"--request-read-timeout must be more than 0 seconds, "
                         f"got {header_timeout:g}")

    class TimedH11Protocol(H11Protocol):
        header_timer: Optional[asyncio.TimerHandle] = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_timer()

        def handle_events(self) -> None:
            super().handle_events()
            if self._handling():  # a request's headers are in; guard.py times its body
                self._cancel_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self._handling():  # else a pipelined request has started already
                self._arm_header_timer()

        def connection_lost(self, exc: Optional[Exception]) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def _handling(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self.header_timer = self.loop.call_later(header_timeout, self._headers_too_slow)

        def _cancel_header_timer(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def _headers_too_slow(self) -> None:
            self.header_timer = None
            if not self._handling() and not self.transport.is_closing():
                self.logger.debug("closing a connection whose request headers did not come "
                                  "within %g s (--request-read-timeout)", header_timeout)
                self.transport.close()

    return TimedH11Protocol
