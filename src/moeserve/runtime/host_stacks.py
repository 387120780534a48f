"""Where a rank's host time goes inside each loop phase: a sampler of the loop thread's Python
stack, for runtime/step_profile.py (MOESERVE_PROFILE_STACKS=MS beside MOESERVE_PROFILE_DIR).

Every MS milliseconds a daemon thread takes the loop thread's stack and counts it under the
phase that is open then (schedule, exchange, launch.forward, collect.wait, ...), keyed by its
innermost frames; `report()` lists, per phase, its samples and its most common stacks. A phase
whose samples end in a blocking call (a kernel launch whose queue is full, a stream
synchronize, a collective) waits there; one whose samples spread over Python frames computes.

A sample is taken when the sampler gets the interpreter's lock: at the loop thread's blocking
calls, and in stretches of pure Python at the switch interval, which the sampler lowers to MS
while it runs (and restores when stopped). The counts are attributions, not times; the
sampling itself costs the loop a little of both.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter, defaultdict
from pathlib import PurePath
from types import FrameType
from typing import Optional

BETWEEN = "(between phases)"


# torch.nn.Module's call wrappers: a frame of each between every two modules, naming neither
SKIPPED = frozenset({"_call_impl", "_wrapped_call_impl"})


def stack_key(frame: Optional[FrameType], depth: int) -> str:
    """The innermost `depth` frames of a stack (Module call wrappers left out), innermost
    first: 'file.py:line function'."""
    parts = []
    while frame is not None and len(parts) < depth:
        code = frame.f_code
        if code.co_name not in SKIPPED:
            parts.append(f"{PurePath(code.co_filename).name}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return " < ".join(parts)


class HostStacks:
    """Samples the stack of the thread that opens the loop's phases (`enter` / `leave`)."""

    def __init__(self, interval_ms: float, depth: int = 10) -> None:
        if not interval_ms > 0:
            raise ValueError(f"a stack sampling interval of {interval_ms} ms: give one > 0")
        self.interval, self.depth = interval_ms / 1000, depth
        self.counts: dict[str, Counter[str]] = defaultdict(Counter)
        self.thread_id: Optional[int] = None
        self.open: list[str] = []
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch, self.interval))
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._run, name="moeserve-host-stacks",
                                         daemon=True)
        self._sampler.start()

    def enter(self, name: str) -> None:
        self.thread_id = threading.get_ident()
        self.open.append(name)

    def leave(self) -> None:
        if self.open:
            self.open.pop()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if self.thread_id is None:
                continue
            frame = sys._current_frames().get(self.thread_id)
            if frame is None:
                continue
            phase = self.open[-1] if self.open else BETWEEN
            self.counts[phase][stack_key(frame, self.depth)] += 1

    def stop(self) -> None:
        self._stop.set()
        self._sampler.join(timeout=1.0)
        sys.setswitchinterval(self._switch)

    def report(self, rank: int, top: int = 8) -> list[str]:
        total = sum(sum(c.values()) for c in self.counts.values())
        lines = [f"rank {rank}: {total} samples of the loop thread's stack, one each "
                 f"{1000 * self.interval:g} ms at most, by the phase open then (innermost "
                 "frame first)"]
        for phase, stacks in sorted(self.counts.items(), key=lambda kv: -sum(kv[1].values())):
            n = sum(stacks.values())
            lines += ["", f"{phase}: {n} samples"]
            lines += [f"  {100 * k / n:5.1f}%  {key}" for key, k in stacks.most_common(top)]
        return lines
