"""The one timing harness every benchmark uses: the device's ceilings, the timers, what a run
records about itself, and the RESULTS.md writer.

Ceilings (measured in the same run as the numbers they bound):
  copy  a 1 GiB device-to-device copy, read + write counted: the bandwidth floor's divisor
  bf16  an 8192^3 bf16 matmul: the FLOP floor's divisor
  peer  a 256 MiB copy from GPU 0 to GPU 1, counted once: the link floor's divisor
Timers: CUDA events around each call, after warm-up, the median; CUDA-graph replays for work
that serving runs in a graph.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "RESULTS.md"
L2_FLUSH_BYTES = 256 << 20  # more than any current GPU's L2
# environment switches that change what a multi-GPU run measures: recorded with its command
RECORDED_ENV = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS",
                "CUDA_VISIBLE_DEVICES")


# --- timers -----------------------------------------------------------------------------------

_flush_buf: Optional[torch.Tensor] = None


def _flush_l2() -> None:
    global _flush_buf
    if _flush_buf is None:
        _flush_buf = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    _flush_buf.zero_()


def time_us(fn: Callable[[], object], reps: int = 20, warmup: int = 3,
            flush_l2: bool = False) -> float:
    """Median µs of `reps` calls of fn(), each between two CUDA events, after `warmup` calls.
    flush_l2: overwrite 256 MiB before each call (outside the events), so that fn reads its
    operands from HBM as a step that touched other weights in between would."""
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        if flush_l2:
            _flush_l2()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def capture(fn: Callable[[], object]) -> Callable[[], None]:
    """A CUDA graph of fn(), warmed up on a side stream first; returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def graph_us(fn: Callable[[], object], calls: int = 1, reps: int = 20) -> float:
    """µs per call of a graph of fn(), which makes `calls` calls (back to back in the graph,
    so launch gaps count as they do in the engine's graphs)."""
    return time_us(capture(fn), reps=reps) / calls


def graphs_us(groups: Sequence[Callable[[], object]], calls: int, reps: int = 60) -> float:
    """µs per call over several graphs replayed in turn (each group makes `calls` calls), so
    that operands spread over more than L2 holds come from HBM: the median of the replays."""
    replays = [capture(g) for g in groups]
    for r in replays:
        r()
    reps = max(reps, 3 * len(replays))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        replays[i % len(replays)]()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3 / calls


def kernel_us(fn: Callable[[], object], calls: int = 3) -> list[tuple[str, float]]:
    """Device µs per call of each kernel fn() launches (eagerly) under torch.profiler, largest
    first: where a measured time goes."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0:
            totals[ev.name[:60]] = totals.get(ev.name[:60], 0.0) + ev.device_time / calls
    return sorted(totals.items(), key=lambda t: -t[1])


# --- ceilings ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Ceilings:
    copy_GBps: float
    bf16_TFLOPs: float
    peer_GBps: Optional[float] = None
    fp8_TFLOPs: Optional[float] = None

    def line(self) -> str:
        peer = ("" if self.peer_GBps is None else
                f", peer copy {self.peer_GBps:.0f} GB/s (256 MiB, GPU 0 to GPU 1)")
        fp8 = ("" if self.fp8_TFLOPs is None else
               f", FP8 GEMM 8192^3 (torch._scaled_mm, per-tensor scales) "
               f"{self.fp8_TFLOPs:.0f} TFLOP/s")
        return (f"Ceilings measured in the same run: copy {self.copy_GBps:.0f} GB/s (1 GiB, read "
                f"+ write), bf16 GEMM 8192^3 {self.bf16_TFLOPs:.0f} TFLOP/s{fp8}{peer}.")

    def floor_us(self, nbytes: float = 0.0, flops: float = 0.0) -> float:
        """max(bytes / copy bandwidth, FLOPs / bf16 rate), µs."""
        return max(nbytes / self.copy_GBps / 1e3, flops / self.bf16_TFLOPs / 1e6)

    def fp8_floor_us(self, nbytes: float = 0.0, flops: float = 0.0) -> float:
        """max(bytes / copy bandwidth, FLOPs / FP8 rate), µs (measure_ceilings(fp8=True))."""
        assert self.fp8_TFLOPs is not None, "measure_ceilings(fp8=True) measures the FP8 rate"
        return max(nbytes / self.copy_GBps / 1e3, flops / self.fp8_TFLOPs / 1e6)


def copy_GBps() -> float:
    """1 GiB copied device to device, read + write counted (its 2 GiB are freed on return)."""
    src = torch.randn(2 ** 29, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * 2 ** 30 / time_us(lambda: dst.copy_(src), reps=30) / 1e3


def bf16_TFLOPs() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192 ** 3 / time_us(lambda: a @ b, reps=30) / 1e6


def fp8_gemm_us(shapes: Sequence[tuple[int, int, int]], reps: int = 30) -> float:
    """µs of torch._scaled_mm over each (M, N, K) in turn: float8_e4m3fn [M, K] x [K, N]
    (per-tensor scales, bf16 out), the second column-major as cuBLAS's FP8 GEMM takes it."""
    one = torch.ones((), device="cuda")
    pairs = [(torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn),
              torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn).t())
             for m, n, k in shapes]
    return time_us(lambda: [torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
                            for a, b in pairs], reps=reps)


def fp8_TFLOPs() -> float:
    """The FP8 GEMM rate: fp8_gemm_us of 8192^3."""
    return 2 * 8192 ** 3 / fp8_gemm_us([(8192, 8192, 8192)]) / 1e6


def peer_copy_GBps(src: int = 0, dst: int = 1, nbytes: int = 256 << 20) -> Optional[float]:
    """GB/s of a copy from GPU src to GPU dst over their link (bytes counted once); None when
    the two cannot reach each other's memory. The copy runs on src's stream, which the
    events bracket."""
    if not torch.cuda.can_device_access_peer(src, dst):
        return None
    a = torch.randn(nbytes // 2, device=f"cuda:{src}", dtype=torch.bfloat16)
    b = torch.empty(nbytes // 2, device=f"cuda:{dst}", dtype=torch.bfloat16)
    with torch.cuda.device(src):
        us = time_us(lambda: b.copy_(a), reps=30)
    torch.cuda.synchronize(dst)
    return nbytes / us / 1e3


def measure_ceilings(peer: bool = False, fp8: bool = False) -> Ceilings:
    """The ceilings of GPU 0 (and its link to GPU 1 with peer, the FP8 GEMM rate with fp8);
    their buffers are handed back to the device afterwards, for the engines a run starts
    next."""
    found = Ceilings(copy_GBps(), bf16_TFLOPs(),
                     peer_copy_GBps() if peer and torch.cuda.device_count() > 1 else None,
                     fp8_TFLOPs() if fp8 else None)
    torch.cuda.empty_cache()
    return found


# --- what a run records -----------------------------------------------------------------------

def commit() -> str:
    """$COMMIT when set (a copied tree, whose git, if any, need not be the tree's); else HEAD's
    short hash, '+changes' when src/ differs from it."""
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "src"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("COMMIT", "?")


def versions(extra: Sequence[str] = ()) -> dict[str, str]:
    found = {"torch": torch.__version__, "cuda": str(torch.version.cuda)}
    for name in ("triton", *extra):
        try:
            found[name] = __import__(name).__version__
        except ImportError:
            pass
    return found


@dataclass
class RunInfo:
    device: str
    date: str
    commit: str
    command: str
    versions: dict[str, str] = field(default_factory=dict)

    @classmethod
    def collect(cls, subcommand: str, argv: Sequence[str], gpus: int = 1,
                extra_versions: Sequence[str] = ()) -> "RunInfo":
        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        env = "".join(f"{k}={os.environ[k]} " for k in RECORDED_ENV if k in os.environ)
        return cls(device=name if gpus == 1 else f"{gpus}x {name}",
                   date=datetime.date.today().isoformat(), commit=commit(),
                   command=f"{env}PYTHONPATH=src python -m benchmarks {subcommand} "
                           + shlex.join(argv),
                   versions=versions(extra_versions))

    def header(self) -> list[str]:
        v = self.versions
        names = [f"torch {v['torch']} (CUDA {v['cuda']})"]
        names += [f"{k} {v[k]}" for k in v if k not in ("torch", "cuda")]
        return [f"Device: {self.device}; {self.date}; {', '.join(names)}; commit {self.commit}.",
                f"Command: `{self.command}`"]


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A markdown table; cells already formatted."""
    def line(cells: Sequence[Any]) -> str:
        return "|" + "|".join(f" {c} " if str(c) else " " for c in cells) + "|"

    return [line(header), "|" + "---|" * len(header), *(line(r) for r in rows)]


def section(title: str, method: str, info: RunInfo, ceilings: Optional[Ceilings],
            body: Sequence[str]) -> str:
    """A RESULTS.md section: its title, the method note, the run's header, the tables."""
    lines = [f"## {title}", "", method.strip(), "", *info.header()]
    if ceilings is not None:
        lines.append(ceilings.line())
    return "\n".join([*lines, "", *body]).rstrip() + "\n"


# --- writing results --------------------------------------------------------------------------

def write_section(results: Path, text: str) -> None:
    """Put `text` (starting '## Title') into results in place of the section of that title
    (everything up to the next '## ' heading), or at the end when there is none."""
    title = text.splitlines()[0]
    if not title.startswith("## "):
        raise ValueError(f"a section starts with '## TITLE', not {title!r}")
    old = results.read_text() if results.exists() else "# Benchmark results\n"
    match = re.search(rf"^{re.escape(title)}[ \t]*\n", old, re.M)
    if match is None:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        nxt = re.search(r"^## ", old[match.end():], re.M)
        end = match.end() + nxt.start() if nxt else len(old)
        tail = old[end:]
        new = old[:match.start()] + text + ("\n" + tail if tail else "")
    results.write_text(new)


def save(out: Path, name: str, data: Any, text: str, results: Optional[str]) -> None:
    """<out>/<name>.json (every number the run took) and <out>/<name>.md (its section); the
    section also into `results` when given."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1, default=_jsonable))
    (out / f"{name}.md").write_text(text)
    print(text, flush=True)
    if results:
        write_section(Path(results), text)


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def add_output_arguments(p: Any) -> None:
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"),
                   help="folder for NAME.json (the numbers) and NAME.md (the section)")
    p.add_argument("--results", default=None, metavar="RESULTS.md",
                   help=f"also write the section into this file (e.g. {RESULTS.relative_to(REPO)})")


def run_part(out: Path, name: str, measure: Callable[[], Any]) -> int:
    """One part of a benchmark in this process (the parent starts one process a part, so that
    no two models share the GPU's memory): its results as out/NAME.json."""
    require_gpu()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(measure(), indent=1))
    return 0


def require_gpu(gpus: int = 1) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < gpus:
        sys.exit(f"this benchmark needs {gpus} CUDA GPU(s); found "
                 f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}")


def run_ranks(rank_main: Callable, nprocs: int, args: tuple, limit_s: float,
              out: Path, name: str) -> dict[int, Any]:
    """rank_main(rank, nprocs, port, *args) in nprocs spawned processes, each writing
    out/{name}_rank{r}.json; their JSON by rank. A rank that fails raises here; ranks that
    have not finished after limit_s seconds are killed."""
    import time

    import torch.multiprocessing as mp

    from moeserve.parallel.net import free_port

    ctx = mp.start_processes(rank_main, nprocs=nprocs, start_method="spawn",
                             args=(nprocs, free_port(), *args), join=False)
    deadline = time.monotonic() + limit_s
    while not ctx.join(timeout=5):  # raises when a rank failed
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            raise SystemExit(f"the ranks did not finish in {limit_s:.0f} s")
    return {r: json.loads((out / f"{name}_rank{r}.json").read_text()) for r in range(nprocs)}
