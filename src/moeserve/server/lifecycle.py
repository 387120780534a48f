"""The server's life around its engine: waiting for it to start, watching it fail, and the
drain that a signal starts (server/app.py wires them into the app's lifespan)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Callable, Optional

from moeserve.runtime.engine import Engine
from moeserve.server.bridge import EngineClient
from moeserve.server.errors import APIError

log = logging.getLogger("moeserve.server")
ENGINE_WATCH_S = 1.0
DRAIN_POLL_S = 0.1
DRAIN_GRACE_S = 5.0  # after the drain: for the last responses and error events to go out
FAILED_LINGER_S = 1.0  # a failed engine's /health 503 stays visible this long before the exit


@dataclasses.dataclass
class ServerState:
    draining: bool = False  # set by a signal handler; the drain task acts on it
    engine_failed: Optional[str] = None
    # set when --drain-timeout runs out: the requests still open end with an error
    drain_expired: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


async def wait_for_engine(engine: Engine) -> None:
    """Let an engine that was created with wait=False finish starting (its ranks load, warm up
    and capture while the server answers /health with 503)."""
    if engine.ready:
        return
    try:
        await asyncio.to_thread(engine.wait_ready)
    except Exception as exc:  # EngineError: the engine is failed; the watch task acts on it
        log.error("the engine failed to start: %s", exc)


async def watch_engine(client: EngineClient, state: ServerState,
                        on_death: Optional[Callable[[str], None]]) -> None:
    while client.alive:
        await asyncio.sleep(ENGINE_WATCH_S)
    if client.failure is None:  # shut down, not failed
        return
    state.engine_failed = client.failure
    log.error("the engine failed, the server stops: %s", state.engine_failed)
    # the engine has failed every request; their responses go out, and a health probe sees
    # the 503, before the server stops
    await asyncio.sleep(FAILED_LINGER_S)
    await until_idle(client, DRAIN_GRACE_S)
    if on_death is not None:
        on_death(state.engine_failed)


async def until_idle(client: EngineClient, timeout: float) -> None:
    """Wait until no sequence is in flight, or `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while client.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(DRAIN_POLL_S)


async def drain_when_asked(client: EngineClient, state: ServerState, drain_timeout: float,
                            on_drained: Optional[Callable[[], None]]) -> None:
    """Once a signal sets `state.draining`: let the requests in flight finish, for at most
    drain_timeout seconds; then end those left with an error, and stop the server. Polling
    keeps the signal handler trivial (it runs between any two bytecodes of the loop)."""
    while not state.draining:
        await asyncio.sleep(DRAIN_POLL_S)
    log.info("draining: %d sequences in flight, for at most %g s", client.in_flight,
             drain_timeout)
    await until_idle(client, drain_timeout)
    if client.in_flight:
        log.warning("--drain-timeout %g s ran out: %d sequences end with an error",
                    drain_timeout, client.in_flight)
        state.drain_expired.set()
        await until_idle(client, DRAIN_GRACE_S)
    if on_drained is not None:
        on_drained()


def drain_error() -> APIError:
    return APIError(503, "the server shut down before the request finished (--drain-timeout "
                    "ran out); retry it", None, "draining", headers={"Retry-After": "1"})
