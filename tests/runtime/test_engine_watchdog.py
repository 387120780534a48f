"""The engine's watchdog: a rank that stops making progress fails every pending request after
--watchdog-timeout seconds, and the engine stops (one rank in a process of its own, SIGSTOPped).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from moeserve.runtime.engine import Engine, EngineError

pytestmark = pytest.mark.timeout(180)
FLAGS = dict(load_format="dummy", device="cpu", max_total_tokens=4096, context_length=2048)
WATCHDOG_S = 2.0


def test_stopped_rank_fails_pending_requests_after_the_timeout():
    engine = Engine("preset:tiny", in_process=False, watchdog_timeout=WATCHDOG_S, **FLAGS)
    (pid,) = engine.rank_pids
    try:
        # an idle engine is not stalled: rank 0 keeps iterating
        time.sleep(WATCHDOG_S + 1)
        assert engine.failure is None
        long = dict(max_new_tokens=1500, temperature=0.0, ignore_eos=True)
        stream = engine.stream("stall me", long)
        assert next(stream)["error"] is None
        results: dict[str, dict] = {}
        blocked = threading.Thread(target=lambda: results.update(r=engine.generate("me too",
                                                                                    long)))
        blocked.start()
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        chunk = next(c for c in stream if c["error"] is not None or c["finish_reason"])
        blocked.join(timeout=WATCHDOG_S + 10)
        waited = time.monotonic() - stopped
        assert WATCHDOG_S - 0.5 < waited < WATCHDOG_S + 5, waited
        for err in (chunk["error"], results["r"]["error"]):
            assert err is not None and "stalled" in err and "--watchdog-timeout" in err, err
        assert engine.closed and "stalled" in engine.failure
        with pytest.raises(EngineError, match="stalled"):
            engine.generate("after", long)
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        engine.shutdown()
    for proc in engine._procs:  # a SIGKILL lands asynchronously: reap before asking
        proc.join(timeout=10)
    # another thread may have reaped a rank first, and then is_alive() cannot tell: ask the OS
    assert all(not p.is_alive() or not os.path.exists(f"/proc/{p.pid}") for p in engine._procs)


def test_zero_timeout_turns_the_watchdog_off():
    with Engine("preset:tiny", in_process=False, watchdog_timeout=0, **FLAGS) as engine:
        (pid,) = engine.rank_pids
        stream = engine.stream("pause me", dict(max_new_tokens=400, ignore_eos=True))
        assert next(stream)["error"] is None
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(3)
            assert engine.failure is None
        finally:
            os.kill(pid, signal.SIGCONT)
        chunks = list(stream)
        assert chunks[-1]["finish_reason"] == "length" and chunks[-1]["error"] is None
