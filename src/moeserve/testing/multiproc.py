"""Run a function on N gloo ranks in spawned processes, with a timeout (tests and tools).

`run_ranks(fn, world_size, *args)` calls `fn(rank, world_size, *args)` in every rank after
initialising a gloo process group on a free loopback port (backend="nccl": NCCL, rank r on GPU
r), and returns the ranks' return values
in rank order. A rank that raises makes run_ranks raise with that rank's traceback; a rank that
hangs past `timeout` seconds fails the call instead of blocking the caller.
"""

from __future__ import annotations

import os
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch.multiprocessing as mp

from moeserve.parallel.net import free_port


class RankFailure(RuntimeError):
    pass


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue: Any,
            backend: str = "gloo") -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if backend == "nccl":  # one GPU per rank
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=120))
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:  # report every failure to the parent, whatever it is
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 180.0,
              backend: str = "gloo") -> list[Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, backend),
                         daemon=True) for r in range(world_size)]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        for _ in range(world_size):
            try:
                rank, ok, value = queue.get(timeout=timeout)
            except Exception as exc:  # queue.Empty: some rank hung
                missing = sorted(set(range(world_size)) - set(results) - set(errors))
                raise RankFailure(f"ranks {missing} did not finish within {timeout}s "
                                  f"(errors so far: {errors})") from exc
            (results if ok else errors)[rank] = value
            if errors:
                break
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if errors:
        rank = min(errors)
        raise RankFailure(f"rank {rank} failed:\n{errors[rank]}")
    return [results[r] for r in range(world_size)]
