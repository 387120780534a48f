"""The loop every rank runs in lockstep with the others.

One iteration:
  1. every rank applies the engine's messages (new requests, aborts, shutdown) that the
     iteration before shared;
  2. each rank's scheduler (one per DP rank, replicated on its attn_tp ranks, which therefore
     take the same decisions) picks the next forward;
  3. the ranks all-gather [tokens of this forward, has work, decodes or idles, messages rank 0
     has taken from the engine since]: when nobody has tokens there is no forward; otherwise
     every rank runs one, an idle one if it has no tokens (invariant 7), replaying a decode
     CUDA graph when every rank decodes or idles; when rank 0 has messages, it broadcasts
     them, and they apply at step 1 of the next iteration;
  4. each DP group's first rank puts its outputs and KV figures on the engine's queue.
So a step costs the ranks one collective (two when messages arrive), all on the CPU (gloo)
group; each is a point where every rank waits for the slowest.

Overlap schedule (the default; --disable-overlap-schedule turns it off): the forward of step
N is queued on the device before the tokens of step N-1 are read back and processed, so the
host schedules and launches while the device computes, and the device does not wait for the
host between steps. A step's tokens therefore reach the engine one iteration after its
launch; a request ended by a stop token has run one more row, whose token is dropped
(runtime/scheduler.py says how placeholders stand for the tokens in flight). A prefill step is
launched only after the tokens in flight are out: its launch is long on the host, and
waiting behind it would delay them by that much.
"""

from __future__ import annotations

import functools
import gc
import os
import queue
import signal
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from moeserve.config import EngineConfig
from moeserve.config.spec import ModelSpec, ModelSpecError
from moeserve.parallel.groups import ParallelState, init_parallel_state
from moeserve.batch.step import StepTooLarge, gather_ints, step_from_counts
from moeserve.plan.capacity import CapacityPlan
from moeserve.batch.forward_batch import ForwardMode
from moeserve.models.loader import WeightLoadError
from moeserve.runtime.grammar import GrammarBackend
from moeserve.runtime.compile_cache import TRITON_ENV, use_compile_cache
from moeserve.runtime.kv_manager import KVManager
from moeserve.runtime.model_runner import LaunchedStep, ModelRunner
from moeserve.runtime.request import TokenOutput
from moeserve.runtime.scheduler import Scheduler
from moeserve.runtime.step_profile import StepProfile, phase

# what a rank raises on input the user can fix: its message says what to change, a traceback
# would only bury it
USER_ERRORS = (WeightLoadError, ModelSpecError, FileNotFoundError, PermissionError)
IDLE_TICK_S = 0.02  # how long rank 0 waits for new requests when no rank has work


@dataclass(frozen=True)
class Message:
    kind: str  # "add" (payload RequestInput), "add_many" (a list of them), "abort" (payload
    # rid), "profile" (payload (count, skip): a kernel window, step_profile.py), "shutdown"
    payload: Any = None


class RankWorker:
    def __init__(self, cfg: EngineConfig, spec: ModelSpec, plan: CapacityPlan,
                 state: ParallelState, eos_token_ids: tuple[int, ...] = (),
                 report: Optional[Callable[[str, float, str], None]] = None) -> None:
        """report(phase, seconds, detail): each startup phase as it ends
        (runtime/startup.py)."""
        self.cfg, self.plan, self.state = cfg, plan, state
        self.runner = ModelRunner(cfg, spec, plan, state, report=report)
        kv = KVManager(self.runner.kv_pool, self.runner.req_pool,
                       prefix_cache=not cfg.disable_radix_cache)
        assert plan.budget is not None
        self.scheduler = Scheduler(plan.budget, kv, eos_token_ids, functools.cache(
            lambda: GrammarBackend.for_model(cfg.model, spec, eos_token_ids)),
            mixed_chunk=cfg.enable_mixed_chunk)
        self.is_dp_leader = state.attn_tp.rank == 0
        self.overlap = not cfg.disable_overlap_schedule
        self.in_flight: Optional[LaunchedStep] = None  # launched, its tokens not processed
        self.profile = StepProfile.from_env(state.rank)  # None unless asked for
        self.kind = "none"  # of the last iteration: "decode", "prefill" or "none"
        self.shared: list[Message] = []  # rank 0's messages of the last exchange

    def iteration(self, msgs: list[Message],
                  publish: Optional[Callable[[list[TokenOutput]], None]] = None,
                  arriving: Sequence[Message] = ()) -> tuple[list[TokenOutput], bool, bool]:
        """Returns (outputs of this rank's scheduler, shutdown, whether any rank has work).
        `msgs` apply now; `arriving` (rank 0's, of several ranks) are shared with every rank at
        this iteration's exchange and wait in `self.shared` for the next. `publish`, where
        given, sends outputs on before a prefill's launch."""
        outs: list[TokenOutput] = []
        self.shared = []
        for m in msgs:
            if m.kind == "shutdown":
                return outs + self._collect(), True, False
            if m.kind in ("add", "add_many"):
                for inp in (m.payload if m.kind == "add_many" else [m.payload]):
                    if inp.dp_rank == self.state.dp_rank:
                        self.scheduler.add(inp)
            elif m.kind == "abort":
                out = self.scheduler.abort(m.payload)
                if out is not None:
                    outs.append(out)
            elif m.kind == "profile" and self.profile is not None:
                self.profile.start_window(*m.payload)
        if self.in_flight is not None and self.scheduler.needs_tokens():
            outs += self._collect()
        with phase(self.profile, "schedule"):
            batch = self.scheduler.schedule()
            outs += self.scheduler.drain_rejected()
        decode_or_idle = batch is None or batch.mode is ForwardMode.DECODE
        with phase(self.profile, "exchange"):
            counts, anyone_has_work, all_decode, news = self._exchange(
                batch.num_tokens if batch else 0, decode_or_idle, len(arriving))
        if news:
            with phase(self.profile, "share"):
                self.shared = _broadcast(list(arriving), self.state)
            anyone_has_work = True  # the next iteration applies them: no idle wait before it
        self.kind = "none" if not any(counts) else "decode" if all_decode else "prefill"
        if any(counts):
            try:
                step = step_from_counts(counts, self.state.layout, self.state.rank, self.plan)
            except StepTooLarge as exc:  # every rank raises together; the groups stay usable
                outs += self._collect()
                if batch is not None:
                    outs += self.scheduler.fail(batch, str(exc))
                return outs, False, anyone_has_work
            if self.overlap and not all_decode:
                # a prefill somewhere: its host launch is long (eager, and it waits for the
                # device at times): the tokens of the step before go out first, not after it
                outs += self._collect()
                if publish is not None:
                    with phase(self.profile, "publish"):
                        publish(outs)
                    outs = []
            with phase(self.profile, "launch.forward"):
                forwarded = self.runner.launch_forward(batch, step, all_decode)
            if batch is not None and any(r.matcher is not None for r in batch.reqs):
                # the grammars' masks need the tokens of the step before: they are read back
                # and processed while the device runs this forward, then the masks filled
                outs += self._collect()
            with phase(self.profile, "launch.sampling"):
                launched = (None if forwarded is None
                            else self.runner.launch_sampling(*forwarded))
            outs += self._collect()  # the step before this one (done on the device by now)
            self.in_flight = launched
        if not self.overlap or not any(counts):
            outs += self._collect()
        return outs, False, anyone_has_work or self.in_flight is not None

    def _collect(self) -> list[TokenOutput]:
        """Wait for the step in flight, if any, and process its tokens."""
        launched, self.in_flight = self.in_flight, None
        if launched is None:
            return []
        with phase(self.profile, "collect.wait"):
            result = self.runner.collect(launched)
        with phase(self.profile, "collect.process"):
            return self.scheduler.process(launched.batch, result.token_ids, result.logprobs,
                                          result.prompt_logprobs, result.failed)

    def stats(self) -> dict[str, int]:
        """KV and queue figures of this DP rank (for /metrics and tests)."""
        kv, sched = self.scheduler.kv, self.scheduler
        return {"used_slots": kv.used_slots,
                "prefix_cached_slots": kv.radix.cached_tokens if kv.radix else 0,
                "total_slots": kv.kv_pool.num_slots - kv.page_size,
                "running": len(sched.running) + (sched.chunked is not None),
                "waiting": len(sched.waiting), "retracted": sched.num_retracted}

    def _exchange(self, num_tokens: int, decode_or_idle: bool, arriving: int
                  ) -> tuple[list[int], bool, bool, int]:
        """(tokens of every rank, whether any rank has work, whether every rank decodes or
        idles, messages to share): the same on every rank, so all take the same graph/eager
        decision and all join the messages' broadcast or none does."""
        # a batch in flight is work too: its requests are in no queue until processed
        mine = [num_tokens, int(self.scheduler.has_work or num_tokens > 0), int(decode_or_idle),
                arriving]
        out = gather_ints(mine, self.state)
        return ([o[0] for o in out], any(o[1] for o in out), all(o[2] for o in out),
                sum(o[3] for o in out))


def serve_loop(worker: RankWorker, inbox: Optional[Any], outbox: Optional[Any],
               parent_pid: Optional[int] = None, heartbeat: Optional[Any] = None) -> None:
    """Run iterations until a shutdown message. Rank 0 holds the engine's inbox; every DP
    group's first rank puts on its outbox (other ranks may pass it, and put nothing); with
    `parent_pid`, rank 0 also shuts down when the engine's process is gone (killed).
    `heartbeat` (a shared double) gets time.monotonic() after every iteration: the engine's
    watchdog reads it. An idle rank 0 iterates every IDLE_TICK_S, so only a stuck step (a
    stopped or hung peer, a device that never finishes) leaves it old; writing it is a store
    to shared memory, with no lock and no device sync."""
    state = worker.state
    multi = state.world.size > 1
    has_work = False
    last_stats: list[Optional[dict[str, int]]] = [None]
    reports = outbox is not None and worker.is_dp_leader

    def publish(outs: list[TokenOutput]) -> None:
        """This DP group's outputs and KV figures (when they changed) to the engine."""
        if not reports:
            return
        stats = worker.stats()
        if stats != last_stats[0]:
            outbox.put(("stats", state.dp_rank, stats))  # before the outputs it explains
            last_stats[0] = stats
        if outs:
            outbox.put(("out", outs))

    pending: list[Message] = []  # shared at the last exchange: applied this iteration
    while True:
        arriving: list[Message] = []
        if inbox is not None:
            with phase(worker.profile, "drain"):
                arriving = _drain(inbox, block=not has_work and not pending)
            if parent_pid is not None and os.getppid() != parent_pid:
                arriving.append(Message("shutdown"))  # orphaned: the engine died without a word
        if multi:  # rank 0's messages reach every rank at this iteration's exchange
            outs, stop, has_work = worker.iteration(pending, publish, arriving)
            pending = worker.shared
        else:
            outs, stop, has_work = worker.iteration(arriving, publish)
        with phase(worker.profile, "publish"):
            publish(outs)
        if heartbeat is not None:
            heartbeat.value = time.monotonic()
        if worker.profile is not None:
            worker.profile.end(worker.kind)
            if stop:
                worker.profile.write()
        if stop:
            return


def _broadcast(msgs: list[Message], state: ParallelState) -> list[Message]:
    """Rank 0's messages on every rank (every rank calls this when the exchange counted
    some)."""
    box = [msgs]
    dist.broadcast_object_list(box, src=0, group=state.cpu)
    return box[0]


def _drain(inbox: Any, block: bool) -> list[Message]:
    msgs: list[Message] = []
    try:
        msgs.append(inbox.get(timeout=IDLE_TICK_S) if block else inbox.get_nowait())
        while True:
            msgs.append(inbox.get_nowait())
    except queue.Empty:
        pass
    return msgs


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, which containers and taskset
    narrow), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform (macOS)
        return os.cpu_count() or 1


def torch_threads_for_rank(cfg: EngineConfig, device_type: str,
                           cores: Optional[int] = None) -> Optional[int]:
    """Torch threads for one rank process: --cpu-threads-per-rank when given; on a CPU the
    node's cores shared evenly by its ranks (torch's default gives every rank all of them,
    and ranks in lockstep then wait on each other's oversubscribed threads); None (torch's
    default) on a GPU, where the host threads only launch kernels."""
    if cfg.cpu_threads_per_rank is not None:
        return cfg.cpu_threads_per_rank
    if device_type != "cpu":
        return None
    ranks_here = max(1, cfg.tp_size // max(1, cfg.nnodes))
    return max(1, (available_cores() if cores is None else cores) // ranks_here)


def rank_main(rank: int, cfg: EngineConfig, plan: CapacityPlan, init_method: str,
              inbox: Optional[Any], outbox: Any, eos_token_ids: tuple[int, ...],
              heartbeat: Optional[Any] = None) -> None:
    """Entry point of a worker process: join the process group, build the rank, serve."""
    # Ctrl-C reaches the terminal's whole process group: only the engine's process decides
    # what it means (the server drains); a rank that raised KeyboardInterrupt mid-step would
    # fail every request in flight
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent_pid = os.getppid()
    try:
        from moeserve.parallel.devices import rank_device

        cache = use_compile_cache(cfg)  # before anything compiles
        device = rank_device(cfg, rank)
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        threads = torch_threads_for_rank(cfg, device.type)
        if threads is not None:
            torch.set_num_threads(threads)
        if cfg.tp_size > 1:
            dist.init_process_group(backend, init_method=init_method, rank=rank,
                                    world_size=cfg.tp_size, timeout=timedelta(seconds=600))
        state = init_parallel_state(plan.layout, device)
        worker = RankWorker(cfg, plan.spec, plan, state, eos_token_ids,
                            report=lambda name, s, detail: outbox.put(
                                ("phase", rank, name, s, detail)))
        # what startup made (the model, the plan's buffers, the graphs) lives as long as the
        # rank: out of the full collections, which would walk it at every one of them
        gc.collect()
        gc.freeze()
        outbox.put(("ready", rank, {"torch_threads": torch.get_num_threads(),
                                    "compile_cache": str(cache),
                                    "triton_cache_dir": os.environ.get(TRITON_ENV)}))
        serve_loop(worker, inbox if rank == 0 else None, outbox,
                   parent_pid, heartbeat if rank == 0 else None)
        outbox.put(("exit", rank))
    except BaseException as exc:  # report why this rank stops, then stop
        why = f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, USER_ERRORS):  # ours to debug: where it happened
            why += f"\n{traceback.format_exc()}"
        try:
            outbox.put(("error", rank, why))
        finally:
            raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
