"""Startup phases and their times: each rank times its phases (StartupClock) and reports each
as it ends; the engine logs one line per phase (rank 0's, as they come) and a summary once
every rank is ready (the slowest rank of each phase, and what the compile cache gained)."""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator, Mapping, Optional

PHASES = ("weights", "plan buffers", "warm-up compile", "graph capture")


class StartupClock:
    def __init__(self, report: Optional[Callable[[str, float, str], None]] = None) -> None:
        """report(phase, seconds, detail) is called as each phase ends."""
        self.report = report
        self.seconds: dict[str, float] = {}
        self.details: dict[str, str] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[dict[str, str]]:
        """Time the block; it may set note["detail"] to say what the phase did."""
        if name not in PHASES:
            raise ValueError(f"unknown startup phase {name!r}; the phases are {PHASES}")
        note: dict[str, str] = {}
        t0 = time.perf_counter()
        yield note
        self.seconds[name] = time.perf_counter() - t0
        self.details[name] = note.get("detail", "")
        if self.report is not None:
            self.report(name, self.seconds[name], self.details[name])


def phase_line(rank: int, name: str, seconds: float, detail: str = "") -> str:
    return f"startup: {name} {seconds:.1f} s (rank {rank})" + (f": {detail}" if detail else "")


def summary_line(total_s: float, by_rank: Mapping[int, Mapping[str, float]],
                 new_kernels: Optional[int] = None, cache: str = "") -> str:
    """One line: the whole start and each phase at its slowest rank."""
    parts = []
    for name in PHASES:
        times = [t[name] for t in by_rank.values() if name in t]
        if times:
            parts.append(f"{name} {max(times):.1f} s")
    line = (f"startup: ready in {total_s:.1f} s ({', '.join(parts)}; slowest of "
            f"{len(by_rank)} rank{'s' if len(by_rank) != 1 else ''})")
    if new_kernels is not None:
        line += f"; compile cache {cache}: {new_kernels} kernels compiled in this start"
    return line
