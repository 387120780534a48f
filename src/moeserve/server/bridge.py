"""The asyncio face of an Engine: submit sequences, await their outputs, abort on cancel.

Each sequence is submitted with an `on_output` callback, which the engine's output thread calls
per output: it schedules the output onto the event loop (`call_soon_threadsafe`), into one
asyncio queue shared by the sequences of an HTTP request (its n choices, its prompts). No thread
waits on a sequence, and outputs reach the client as soon as the engine produces them. An engine
that stops hands its error to every pending callback, on whichever thread stops it (the output
thread, or shutdown's caller, which may be the loop itself: call_soon_threadsafe serves both).

The generator `EngineClient.run` owns the sequences it submitted: however it ends (finished,
the client went away, the server drains) its `finally` aborts what is unfinished, which frees
their KV pages in the workers, and gives their places in the queue back.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Optional, Sequence

from moeserve.runtime.engine import Engine, EngineError
from moeserve.runtime.grammar import GrammarSpec
from moeserve.runtime.request import TokenOutput
from moeserve.runtime.sampling import SamplingParams
from moeserve.server.errors import APIError, public_line, public_message
from moeserve.server.metrics import ServerMetrics

RETRY_AFTER_S = 1
LOGGED_ERRORS = 64  # distinct failures remembered, so that one rank's death is logged once
log = logging.getLogger("moeserve.server")


class Seats:
    """Places in the server's queue, taken when a request is accepted (so that the check and
    the taking happen with no await between them) and given back exactly once."""

    def __init__(self, client: "EngineClient", count: int) -> None:
        self.client, self.count = client, count
        client.in_flight += count

    def release(self) -> None:
        if self.count:
            self.client.in_flight -= self.count
            self.count = 0


@dataclass
class _Seq:
    rid: str
    submitted: float
    last_token: Optional[float] = None
    done: bool = False


class EngineClient:
    def __init__(self, engine: Engine, max_in_flight: int) -> None:
        self.engine = engine
        self.max_in_flight = max_in_flight
        self.in_flight = 0  # sequences submitted and not finished; touched on the loop only
        self.metrics = ServerMetrics(engine.kv_stats, lambda: self.in_flight)
        # failure text -> the request id it was logged under
        self._logged: collections.OrderedDict[str, str] = collections.OrderedDict()

    @property
    def alive(self) -> bool:
        return not self.engine.closed

    @property
    def failure(self) -> Optional[str]:
        """Why the engine stopped working, if it did (not when it was shut down)."""
        return self.engine.failure

    def reserve(self, num_seqs: int) -> Seats:
        """Take places for `num_seqs` sequences, or raise 503 (busy) / 400 (never fits)."""
        if num_seqs > self.max_in_flight:
            raise APIError(400, f"the request asks for {num_seqs} sequences (prompts x n) and "
                           f"the server runs at most {self.max_in_flight} at once "
                           "(--max-queued-requests); ask for fewer", "n", "too_many_sequences")
        if self.in_flight + num_seqs > self.max_in_flight:
            raise APIError(503, f"the server is at its limit of {self.max_in_flight} sequences "
                           f"in flight ({self.in_flight} now); retry later", None,
                           "queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
        return Seats(self, num_seqs)

    async def run(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
                  seats: Seats, request_id: str, grammar: Optional[GrammarSpec] = None
                  ) -> AsyncIterator[tuple[int, TokenOutput]]:
        """Submit one sequence per (prompt, params), each following `grammar` when given
        (checked by the caller), and yield (index, output) as outputs come,
        until every sequence has finished (an output with a finish or an error). The seats
        (from reserve) are given back when it ends. An output's error is one line for the
        client, with `request_id`; the server log has the rest under that id."""
        assert seats.count == len(prompts)
        sink = _Sink(asyncio.get_running_loop())
        seqs: list[_Seq] = []
        try:
            for i, (ids, p) in enumerate(zip(prompts, params)):
                try:
                    rid, _ = self.engine.submit(ids, p, stream=True, grammar=grammar,
                                                on_output=functools.partial(sink.put, i))
                except EngineError as exc:
                    raise APIError(503, f"the engine is not running: {public_line(str(exc))} "
                                   f"(request id {request_id})", None, "engine_unavailable",
                                   headers={"Retry-After": str(RETRY_AFTER_S)}) from None
                seqs.append(_Seq(rid, time.monotonic()))
                self.metrics.prompt_tokens.inc(len(ids))
            left = len(seqs)
            while left:
                i, out = await sink.queue.get()
                self._observe(seqs[i], out)
                if seqs[i].done:
                    left -= 1
                if out.error is not None and not out.invalid_request:
                    out = dataclasses.replace(out, error=self._public(out.error, request_id))
                yield i, out
        finally:
            sink.open = False
            for s in seqs:
                if not s.done:
                    self.engine.abort(s.rid)
                    self.metrics.finished.labels("abort").inc()
            seats.release()

    def _public(self, error: str, request_id: str) -> str:
        """`error` for the client; logged in full the first time it is seen (the death of a
        rank fails every request with the same text)."""
        first = self._logged.get(error)
        if first is None:
            self._logged[error] = request_id
            if len(self._logged) > LOGGED_ERRORS:
                self._logged.popitem(last=False)
            log.error("request %s failed:\n%s", request_id, error.rstrip())
        else:
            log.error("request %s failed as request %s did (logged above)", request_id, first)
        return public_message(error, request_id)

    def _observe(self, seq: _Seq, out: TokenOutput) -> None:
        m, now = self.metrics, time.monotonic()
        k = len(out.token_ids)
        if k:
            m.generation_tokens.inc(k)
            if seq.last_token is None:
                m.ttft.observe(now - seq.submitted)
            else:  # tokens that arrive together share the gap since the last one
                for _ in range(k):
                    m.itl.observe((now - seq.last_token) / k)
            seq.last_token = now
        if out.finish is not None or out.error is not None:
            seq.done = True
            reason = "error" if out.error is not None else out.finish.reason
            m.finished.labels(reason).inc()
            m.e2e.observe(now - seq.submitted)
            m.cached_tokens.inc(out.cached_tokens)


class _Sink:
    """Where the outputs of one HTTP request's sequences meet on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[tuple[int, TokenOutput]] = asyncio.Queue()
        self.open = True  # False once run has ended: its aborted sequences' last outputs go nowhere

    def put(self, index: int, out: TokenOutput) -> None:
        """Sequence `index`'s on_output: called on the engine's output thread (or on the thread
        that stops the engine), so it only schedules the put on the loop."""
        if not self.open:
            return
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, out))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass
