"""Responses that end when their client goes away or the drain runs out of time: a whole
response's work (`unless_disconnected`) and a server-sent event stream (`EventStream`)."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from moeserve.server.errors import APIError, internal_error, traceback_text
from moeserve.server.lifecycle import drain_error

log = logging.getLogger("moeserve.server")


async def unless_disconnected(request: Request, work: Awaitable[Any],
                               expired: asyncio.Event) -> Any:
    """Await `work`, unless the client disconnects or the drain runs out of time first: then
    cancel it (which aborts its sequences and frees their KV pages)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request.receive))
    drain = asyncio.ensure_future(expired.wait())
    done, _ = await asyncio.wait({task, watch, drain}, return_when=asyncio.FIRST_COMPLETED)
    watch.cancel()
    drain.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    if drain in done:
        raise drain_error()
    raise APIError(499, "the client closed the connection", None, "client_closed")


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream(Response):
    """A text/event-stream response that stops (and closes its generator, which aborts the
    request's sequences) as soon as the client disconnects, even while no event is due; when
    the drain runs out of time (`expired`), it ends with an error event and [DONE]."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None],
                 request_id: str, expired: asyncio.Event) -> None:
        super().__init__(status_code=200, media_type="text/event-stream")
        self.events, self.on_close, self.request_id = events, on_close, request_id
        self.expired = expired

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = [False]

        async def pump() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
            started[0] = True
            try:
                async for chunk in self.events:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except OSError:  # the client went away
                raise
            except Exception as exc:  # the headers are out: the error goes as an event
                err = internal_error(log, self.request_id, "the stream failed",
                                     traceback_text(exc))
                event = b"data: " + json.dumps(err.body()).encode() + b"\n\ndata: [DONE]\n\n"
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        task = asyncio.ensure_future(pump())
        watch = asyncio.ensure_future(_disconnected(receive))
        drain = asyncio.ensure_future(self.expired.wait())
        try:
            await asyncio.wait({task, watch, drain}, return_when=asyncio.FIRST_COMPLETED)
            if drain.done() and not task.done() and not watch.done():
                task.cancel()  # ends the generator, which aborts the request's sequences
                await asyncio.gather(task, return_exceptions=True)
                await self._end_with(send, started[0], drain_error())
        finally:
            for t in (task, watch, drain):
                t.cancel()
            done = await asyncio.gather(task, watch, drain, return_exceptions=True)
            await self.events.aclose()  # type: ignore[attr-defined]
            self.on_close()  # for a stream whose generator never started
        if isinstance(done[0], Exception) and not isinstance(done[0], OSError):
            log.error("a stream failed", exc_info=done[0])  # OSError: the client went away

    @staticmethod
    async def _end_with(send: Send, started: bool, err: APIError) -> None:
        """End the stream with `err` as an event, then [DONE]."""
        if not started:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8")]})
        event = b"data: " + json.dumps(err.body()).encode() + b"\n\ndata: [DONE]\n\n"
        await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
