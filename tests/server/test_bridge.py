"""The bridge between the engine's output thread and the event loop: every sequence's outputs
arrive through its on_output callback, with no thread per sequence; a run that ends early aborts
what is unfinished, and an engine that stops reaches every waiting sequence."""

from __future__ import annotations

import asyncio
import queue
import random
import threading

import pytest

from moeserve.runtime.request import TokenOutput
from moeserve.runtime.sampling import Finish, SamplingParams
from moeserve.server.bridge import EngineClient

pytestmark = pytest.mark.timeout(60)


class _ThreadedEngine:
    """Calls every request's callback from one output thread, as Engine._deliver does: each
    request gets `tokens` random tokens, one per output, the requests interleaved."""

    closed = False

    def __init__(self, tokens: int) -> None:
        self.tokens, self.rng = tokens, random.Random()
        self.callbacks: dict[str, object] = {}
        self.sent: dict[str, list[int]] = {}
        self.aborted: list[str] = []
        self.lock = threading.Lock()

    def kv_stats(self) -> dict[str, int]:
        return {}

    def submit(self, ids, params, stream=True, grammar=None, on_output=None):
        assert on_output is not None
        with self.lock:
            rid = f"rid-{len(self.callbacks)}"
            self.callbacks[rid], self.sent[rid] = on_output, []
        return rid, queue.SimpleQueue()

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)

    def serve(self, rids: list[str]) -> None:
        for step in range(self.tokens):
            for rid in rids:
                tok = self.rng.randrange(1000)
                self.sent[rid].append(tok)
                last = step == self.tokens - 1
                self.callbacks[rid](TokenOutput(rid, [tok], Finish("length")
                                                if last else None))

    def die(self, rids: list[str], why: str) -> None:
        for rid in rids:  # as Engine._fail_all: the error, on the thread that stops it
            self.callbacks[rid](TokenOutput(rid, [], None, error=why))


def test_outputs_come_through_callbacks_without_a_thread_per_sequence():
    n = 32
    engine = _ThreadedEngine(tokens=20)
    client = EngineClient(engine, 64)  # type: ignore[arg-type]

    async def main():
        got: dict[int, list[int]] = {i: [] for i in range(n)}
        threads = threading.active_count()
        agen = client.run([[1, 2, 3]] * n, [SamplingParams()] * n, client.reserve(n), "cmpl-t")
        first = asyncio.ensure_future(agen.__anext__())
        await asyncio.sleep(0)  # the generator submits every sequence before it first waits
        t = threading.Thread(target=engine.serve, args=([f"rid-{i}" for i in range(n)],))
        t.start()
        i, out = await first
        got[i] += out.token_ids
        async for i, out in agen:
            assert threading.active_count() <= threads + 1  # the engine's output thread only
            got[i] += out.token_ids
        t.join(30)
        return got

    got = asyncio.run(main())
    assert got == {i: engine.sent[f"rid-{i}"] for i in range(n)}
    assert all(len(toks) == 20 for toks in got.values())
    assert engine.aborted == [] and client.in_flight == 0


def test_a_run_that_ends_early_aborts_the_unfinished_and_drops_their_outputs():
    engine = _ThreadedEngine(tokens=50)
    client = EngineClient(engine, 8)  # type: ignore[arg-type]

    async def main():
        agen = client.run([[1]] * 4, [SamplingParams()] * 4, client.reserve(4), "cmpl-t")
        t = threading.Thread(target=engine.serve, args=([f"rid-{i}" for i in range(4)],))
        first = asyncio.ensure_future(agen.__anext__())
        await asyncio.sleep(0)  # the generator submits all four before it first waits
        t.start()
        await first
        await agen.aclose()
        t.join(30)  # the rest of the outputs come after run ended: dropped, no error
        await asyncio.sleep(0.05)

    asyncio.run(main())
    assert sorted(engine.aborted) == [f"rid-{i}" for i in range(4)]
    assert client.in_flight == 0


def test_an_engine_that_stops_reaches_every_waiting_sequence():
    engine = _ThreadedEngine(tokens=1)
    client = EngineClient(engine, 8)  # type: ignore[arg-type]

    async def main():
        outs = []
        agen = client.run([[1]] * 3, [SamplingParams()] * 3, client.reserve(3), "cmpl-t")
        first = asyncio.ensure_future(agen.__anext__())
        await asyncio.sleep(0.01)
        # from another thread, as the output thread does, and from the loop's own thread,
        # as a shutdown called on the loop does
        t = threading.Thread(target=engine.die, args=(["rid-0", "rid-1"], "rank 0 died"))
        t.start()
        t.join()
        engine.die(["rid-2"], "rank 0 died")
        outs.append(await first)
        outs += [o async for o in agen]
        return outs

    outs = asyncio.run(main())
    assert sorted(i for i, _ in outs) == [0, 1, 2]
    assert all(o.error and o.error.startswith("rank 0 died") for _, o in outs)
    assert engine.aborted == [] and client.in_flight == 0
