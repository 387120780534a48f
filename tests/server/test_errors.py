"""What a client learns of a failure: one line and a request id, never a traceback or a path;
the server log has the rest under that id."""

from __future__ import annotations

import asyncio
import logging
import queue

from moeserve.runtime.request import TokenOutput
from moeserve.runtime.sampling import SamplingParams
from moeserve.server.bridge import EngineClient
from moeserve.server.errors import internal_error, public_line

RANK_FAILURE = (
    "rank 0 failed: IndexError: index -1 is out of bounds for dimension 1 with size 512\n"
    "Traceback (most recent call last):\n"
    '  File "/work/main/src/moeserve/runtime/worker.py", line 214, in run_rank\n'
    "    serve_loop(worker, inbox, outbox, parent_pid)\n"
    "IndexError: index -1 is out of bounds for dimension 1 with size 512\n")


def clean(text: str) -> None:
    assert "Traceback" not in text and "/src/" not in text and "worker.py" not in text, text


def test_public_line():
    assert public_line(RANK_FAILURE) == ("rank 0 failed: IndexError: index -1 is out of bounds "
                                         "for dimension 1 with size 512")
    line = public_line("OSError: [Errno 2] No such file: '/home/me/models/x/config.json'")
    assert line == "OSError: [Errno 2] No such file: '<path>'"
    assert public_line("") == "internal error"
    assert len(public_line("x" * 10_000)) == 200


def test_internal_error_logs_what_the_client_does_not_see(caplog):
    log = logging.getLogger("moeserve.test")
    with caplog.at_level(logging.ERROR, logger="moeserve.test"):
        err = internal_error(log, "req-123", "internal error", RANK_FAILURE)
    assert err.status == 500 and "req-123" in err.message
    clean(str(err.body()))
    assert "req-123" in caplog.text and 'worker.py", line 214' in caplog.text


class _FailingEngine:
    """Every sequence ends at once with the error a dead rank leaves."""

    closed = False

    def __init__(self) -> None:
        self.n = 0

    def kv_stats(self) -> dict[str, int]:
        return {}

    def submit(self, ids, params, stream=True, grammar=None, on_output=None):
        assert grammar is None and on_output is not None
        self.n += 1
        on_output(TokenOutput(f"rid-{self.n}", [], None, error=RANK_FAILURE))
        return f"rid-{self.n}", queue.SimpleQueue()

    def abort(self, rid: str) -> None:
        pass


def test_stream_errors_are_one_line_with_the_request_id(caplog):
    client = EngineClient(_FailingEngine(), 8)  # type: ignore[arg-type]

    async def run(request_id: str) -> list[TokenOutput]:
        seats = client.reserve(2)
        return [out async for _, out in client.run([[1, 2], [3]], [SamplingParams()] * 2,
                                                   seats, request_id)]

    with caplog.at_level(logging.ERROR, logger="moeserve.server"):
        first = asyncio.run(run("cmpl-a"))
        second = asyncio.run(run("cmpl-b"))
    for outs, rid in ((first, "cmpl-a"), (second, "cmpl-b")):
        assert len(outs) == 2
        for out in outs:
            assert out.error is not None and out.error.startswith("rank 0 failed: IndexError")
            assert rid in out.error
            clean(out.error)
    # the traceback is logged once, under the first request that saw it
    assert caplog.text.count("Traceback") == 1 and "cmpl-a" in caplog.text
    assert "cmpl-b failed as request cmpl-a did" in caplog.text
    assert client.in_flight == 0
