"""Where a rank's step time goes: host phases of every iteration, and the device kernels of a
window of forwards (torch.profiler), written per rank when the loop ends.

Off unless the environment names a folder (the worker processes inherit it):

    MOESERVE_PROFILE_DIR=/tmp/prof       # rank{r}_steps.json: each phase's count and times
                                         # (mean, p50, p90, p99, max) per kind of iteration
                                         # (decode, prefill, idle)
    MOESERVE_PROFILE_KERNELS=200:50      # forwards 200..249 under torch.profiler:
                                         # rank{r}_kernels.txt, device time per kernel per
                                         # forward, exclusive and span (exclusive_times;
                                         # host time per op on a CPU); these forwards are
                                         # left out of the phases
    MOESERVE_PROFILE_STACKS=1            # the loop thread's Python stack sampled every 1 ms:
                                         # rank{r}_stacks.txt, per phase its most common
                                         # stacks (runtime/host_stacks.py)
    MOESERVE_PROFILE_TRACE=1             # with a kernel window: also its timeline,
                                         # rank{r}_trace.json.gz (Chrome trace format:
                                         # chrome://tracing or ui.perfetto.dev)

or, with the folder set, Engine.profile_kernels(count, skip) at any time: every rank profiles
the same window, `count` forwards after the next `skip` (tools take a window of a pass that
they do not time: the profiler slows the forwards in it, and reading its events out stalls
the rank, and with it every other rank, for a while).

An iteration's kind is "decode" when every rank decodes or idles (a graph replay where the
batch fits a bucket), "prefill" when some rank prefills, "none" when no rank has tokens. With
the overlap schedule a step's device time hides behind the next iteration's host work, so the
host waits only in `collect.wait`: a loop whose time is mostly there is bound by the device,
one whose waits are near zero by the host.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator, Optional

from moeserve.runtime.host_stacks import HostStacks

DIR_ENV = "MOESERVE_PROFILE_DIR"
KERNELS_ENV = "MOESERVE_PROFILE_KERNELS"
STACKS_ENV = "MOESERVE_PROFILE_STACKS"
TRACE_ENV = "MOESERVE_PROFILE_TRACE"


class StepProfile:
    """Host phase timings of one rank's loop (`phase`), per kind of iteration (`end`)."""

    def __init__(self, rank: int, folder: Path, kernels: Optional[tuple[int, int]] = None,
                 stacks_ms: Optional[float] = None) -> None:
        self.rank, self.folder, self.kernels = rank, folder, kernels
        self.stacks = None if stacks_ms is None else HostStacks(stacks_ms)
        self.times: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        self.current: dict[str, float] = defaultdict(float)
        self.started = time.perf_counter()
        self.forwards = 0  # iterations with tokens on some rank so far
        self.torch_profiler: Any = None
        self.window_steps = 0
        self.window_kinds: dict[str, int] = defaultdict(int)  # the window's forwards by kind
        self.on_device = False  # the window times device kernels (else host ops, on a CPU)

    @staticmethod
    def from_env(rank: int) -> Optional["StepProfile"]:
        folder = os.environ.get(DIR_ENV)
        if not folder:
            return None
        window = None
        spec = os.environ.get(KERNELS_ENV)
        if spec:
            try:
                start, count = (int(v) for v in spec.split(":"))
            except ValueError:
                raise ValueError(f"{KERNELS_ENV}={spec!r}: expected START:COUNT (forwards), "
                                 "e.g. 200:50") from None
            window = (start, count)
        stacks = os.environ.get(STACKS_ENV)
        try:
            stacks_ms = None if not stacks else float(stacks)
        except ValueError:
            raise ValueError(f"{STACKS_ENV}={stacks!r}: expected the sampling interval in "
                             "milliseconds, e.g. 1") from None
        Path(folder).mkdir(parents=True, exist_ok=True)
        return StepProfile(rank, Path(folder), window, stacks_ms)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        if self.stacks is not None:
            self.stacks.enter(name)
        try:
            yield
        finally:
            self.current[name] += time.perf_counter() - t0
            if self.stacks is not None:
                self.stacks.leave()

    def start_window(self, count: int, skip: int = 0) -> None:
        """Profile the `count` forwards that follow the next `skip` (a window already
        running goes on as it was)."""
        if self.torch_profiler is None and count > 0:
            self.kernels = (self.forwards + max(0, skip), count)

    def end(self, kind: str) -> None:
        """Close one iteration of the loop: its phases and its wall time under `kind`."""
        if self.torch_profiler is None:  # (the profiled forwards run slower: not counted)
            bucket = self.times[kind]
            for name, seconds in self.current.items():
                bucket[name].append(seconds)
            bucket["iteration"].append(time.perf_counter() - self.started)
        else:
            self.window_kinds[kind] += 1
        self.current.clear()
        if kind != "none":
            self._kernel_window()
            self.forwards += 1
        self.started = time.perf_counter()  # the profiler's start and report not counted

    def _kernel_window(self) -> None:
        if self.kernels is None:
            return
        start, count = self.kernels
        if self.forwards == start:
            import torch

            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.on_device = len(acts) > 1
            self.window_steps = 0
            self.window_kinds.clear()
            self.torch_profiler = torch.profiler.profile(activities=acts)
            self.torch_profiler.__enter__()
        elif self.torch_profiler is not None:
            self.window_steps += 1
            if self.forwards == start + count:
                self._write_kernels()

    def _write_kernels(self) -> None:
        prof, self.torch_profiler = self.torch_profiler, None
        prof.__exit__(None, None, None)
        if os.environ.get(TRACE_ENV, "0") not in ("", "0"):  # (torch gzips a .gz path)
            prof.export_chrome_trace(str(self.folder / f"rank{self.rank}_trace.json.gz"))
        steps = max(1, self.window_steps)
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.window_kinds.items()))
        head = f"rank {self.rank}: {steps} forwards ({kinds}); "
        if self.on_device:
            lines = kernel_table(exclusive_times(kernel_spans(prof.events())), steps, head)
        else:
            rows = sorted(((e.self_cpu_time_total / steps, e.count / steps, e.key)
                           for e in prof.key_averages() if e.self_cpu_time_total > 0),
                          reverse=True)
            lines = [head + f"host (no GPU) time per forward {sum(r[0] for r in rows):.1f} us "
                     "(self times summed)", f"{'us/forward':>11} {'calls/forward':>13}  name"]
            lines += [f"{us:11.1f} {calls:13.1f}  {name[:120]}" for us, calls, name in rows[:60]]
        (self.folder / f"rank{self.rank}_kernels.txt").write_text("\n".join(lines) + "\n")

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for kind, phases in self.times.items():
            n = len(phases["iteration"])
            out[kind] = {"iterations": n, "phases": {
                name: {"count": len(v), "mean_us": 1e6 * sum(v) / n,
                       "p50_us": 1e6 * statistics.median(v), "p90_us": 1e6 * _pct(v, 90),
                       "p99_us": 1e6 * _pct(v, 99), "max_us": 1e6 * max(v)}
                for name, v in sorted(phases.items())}}
        return out

    def write(self) -> None:
        if self.stacks is not None:  # (first: the writing below is not the loop's)
            self.stacks.stop()
            (self.folder / f"rank{self.rank}_stacks.txt").write_text(
                "\n".join(self.stacks.report(self.rank)) + "\n")
        if self.torch_profiler is not None:
            self._write_kernels()
        path = self.folder / f"rank{self.rank}_steps.json"
        path.write_text(json.dumps(self.summary(), indent=1))


Span = tuple[Any, float, float, str]  # (stream, start us, end us, name) of a device kernel


def kernel_spans(events: Any) -> list[Span]:
    """The device kernels (and copies) among torch.profiler's events, each with its stream."""
    import torch

    return [((getattr(ev, "device_index", 0), getattr(ev, "device_resource_id", 0)),
             float(ev.time_range.start), float(ev.time_range.end), ev.name)
            for ev in events
            if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0]


def exclusive_times(spans: list[Span]) -> dict[str, list[float]]:
    """Per name: [exclusive us, span us, count] summed over its kernels. A kernel's exclusive
    time is the part of its span that no kernel started before it on its stream still covers.
    Under PDL a kernel is placed while the one before it runs and waits at its gate, so its
    span holds the other's tail: the spans summed exceed the device's busy time, the
    exclusive times sum to it (the union of the spans, stream by stream)."""
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    streams: dict[Any, list[Span]] = defaultdict(list)
    for span in spans:
        streams[span[0]].append(span)
    for kernels in streams.values():
        covered = float("-inf")  # the end of the latest span so far
        for _, start, end, name in sorted(kernels, key=lambda k: (k[1], k[2])):
            row = out[name]
            row[0] += max(0.0, end - max(start, covered))
            row[1] += end - start
            row[2] += 1
            covered = max(covered, end)
    return dict(out)


def kernel_table(times: dict[str, list[float]], steps: int, head: str,
                 top: int = 60) -> list[str]:
    """The report of exclusive_times over `steps` forwards, most exclusive time first."""
    busy = sum(t[0] for t in times.values()) / steps
    spans = sum(t[1] for t in times.values()) / steps
    lines = [head + f"device busy time per forward {busy:.1f} us (the kernels' exclusive "
             f"times; their spans summed: {spans:.1f} us)",
             f"{'excl us/fwd':>11} {'span us/fwd':>11} {'calls/forward':>13}  name"]
    rows = sorted(times.items(), key=lambda kv: -kv[1][0])[:top]
    lines += [f"{t[0] / steps:11.1f} {t[1] / steps:11.1f} {t[2] / steps:13.1f}  {name[:120]}"
              for name, t in rows]
    return lines


def _pct(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank): a step that is slow one time in ten shows at p90,
    where the median and the mean hide it."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


NO_PHASE = contextlib.nullcontext()


def phase(profile: Optional[StepProfile], name: str) -> Any:
    """profile.phase(name), or a shared no-op context when profiling is off."""
    return NO_PHASE if profile is None else profile.phase(name)
