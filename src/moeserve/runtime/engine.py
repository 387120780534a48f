"""`moeserve.Engine`: requests in, tokens out, on one rank or many.

The engine process tokenizes, hands requests to rank 0 of the workers (one process per rank; a
single rank runs in a thread of the engine's own process), and routes their outputs back to the
callers. A rank that dies ends every request with an error naming the rank, within seconds;
a rank that stops making progress (stopped, hung in a collective or on its device) does the same
after --watchdog-timeout seconds without a finished step while requests are pending.
Rank processes are spawned, and spawn imports the caller's main script again in each of them:
a script must create its Engine under `if __name__ == "__main__":`, and one that does not
fails to start within seconds with that fix.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import queue
import sys
import threading
import time
import uuid
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
import torch.multiprocessing as mp

from moeserve.config import EngineConfig
from moeserve.config.hub import resolve_model
from moeserve.config.spec import load_model_spec
from moeserve.parallel.net import free_port
from moeserve.plan.capacity import CapacityPlan, build_plan
from moeserve.parallel.devices import runtime_config
from moeserve.runtime.grammar import GrammarSpec
from moeserve.runtime.compile_cache import cached_kernels, use_compile_cache
from moeserve.runtime.output import RequestState
from moeserve.runtime.request import RequestInput, TokenOutput
from moeserve.runtime.sampling import SamplingParams
from moeserve.runtime.startup import phase_line, summary_line
from moeserve.runtime.step_profile import DIR_ENV
from moeserve.runtime.worker import Message, RankWorker, rank_main, serve_loop

log = logging.getLogger(__name__)

ParamsLike = Union[SamplingParams, dict, None]
START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0  # shutdown waits this long for the ranks to finish, then kills them
SPAWN_REIMPORT_EXIT = 3  # a rank process that found an Engine created while it imports __main__
GUARD_HINT = ("the script creates its Engine at import time: every rank process imports the "
              "script again (multiprocessing's spawn runs it as __mp_main__) and would start "
              "ranks of its own. Put the code that creates the Engine under "
              "`if __name__ == \"__main__\":`")


class EngineError(RuntimeError):
    """The engine cannot start or cannot go on; the message says why and what to change."""


def _importing_main_in_new_process() -> bool:
    """True while multiprocessing bootstraps a spawned process: it imports the parent's main
    script, and an Engine created there would spawn ranks of its own (the check is
    multiprocessing's own, which it makes only when a Process starts)."""
    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


def refusals(cfg: EngineConfig) -> list[str]:
    """Flags the plan understands but the runtime does not run (yet): refused, not ignored."""
    out = []
    if cfg.speculative_num_draft_tokens is not None:
        out.append("--speculative-num-draft-tokens: the runtime has no speculative decoding; "
                   "the flag only shapes `moeserve plan`. Drop it to start an engine.")
    return out


def make_plan(cfg: EngineConfig) -> CapacityPlan:
    problems = refusals(cfg)
    plan = build_plan(cfg, load_model_spec(cfg.model))
    problems += [f"{e.message} Fix: {e.fix}." for e in plan.errors]
    if problems:
        raise EngineError("the engine cannot start:\n" + "\n".join(f"- {p}" for p in problems))
    return plan


class _FrozenHeap:
    """The objects of this process stay out of the garbage collector's full collections while
    an engine of it is ready (gc.freeze: torch's, the plan's, an in-process rank's model;
    each engine that becomes ready freezes what exists then). A full collection walks every
    object it tracks (about 100 ms with only torch imported), and the output thread allocates
    a few per token, so that at tens of thousands of tokens/s one came every second or so:
    a stall of every stream. Unfrozen when the last ready engine of the process shuts down."""

    lock = threading.Lock()
    holders: set[int] = set()

    @classmethod
    def hold(cls, engine: "Engine") -> None:
        with cls.lock:
            cls.holders.add(id(engine))
            gc.freeze()

    @classmethod
    def release(cls, engine: "Engine") -> None:
        with cls.lock:
            if id(engine) in cls.holders:
                cls.holders.discard(id(engine))
                if not cls.holders:
                    gc.unfreeze()


class Engine:
    """`Engine(model="preset:tiny", load_format="dummy", tp_size=2, ...)`: every EngineConfig
    field is a keyword. Use as a context manager, or call shutdown()."""

    def __init__(self, model: str = "preset:tiny", *, in_process: Optional[bool] = None,
                 wait: bool = True, **flags: Any) -> None:
        """in_process: run a single rank in a thread of this process (the default for
        tp_size 1) instead of a worker process of its own (what the server uses).
        wait=False (rank processes only): return once the ranks are spawned, while they load
        and warm up; `ready` says when they are, `wait_ready()` waits for them (the server
        answers /health meanwhile)."""
        if _importing_main_in_new_process():
            # a rank process importing an unguarded script: say so once, and end this process
            # before it builds anything; the engine that spawned it sees the exit code
            print(f"moeserve: error: {GUARD_HINT}", file=sys.stderr, flush=True)
            raise SystemExit(SPAWN_REIMPORT_EXIT)
        try:
            cfg = EngineConfig(model=resolve_model(model), **flags)
        except TypeError as exc:
            raise EngineError(f"{exc}; the engine takes the fields of EngineConfig "
                              "(`moeserve generate --help` lists them as flags)") from None
        if cfg.nnodes > 1 and cfg.node_rank != 0:
            raise EngineError("an Engine runs on node 0; other nodes run "
                              "`moeserve worker --node-rank K` (or any command with it)")
        self.cfg = runtime_config(cfg)
        self.plan = make_plan(self.cfg)
        # the ranks profile only when started with the folder (runtime/step_profile.py)
        self._profiling = bool(os.environ.get(DIR_ENV))
        self.spec = self.plan.spec
        from moeserve.runtime.tokenizer import checkpoint_eos_ids, load_tokenizer

        self.tokenizer = (None if self.cfg.skip_tokenizer_init
                          else load_tokenizer(self.cfg.model, self.spec))
        self.eos_token_ids = tuple(sorted(
            self.tokenizer.eos_token_ids if self.tokenizer is not None
            else checkpoint_eos_ids(self.cfg.model, self.spec.vocab_size)))
        self._pending: dict[str, RequestState] = {}
        self._stats: dict[int, dict[str, int]] = {}  # DP rank -> its latest figures
        self._load = [0] * self.cfg.attn_dp_size
        self._lock = threading.Lock()
        self._dead: Optional[str] = None
        self._closing = False
        self._procs: list[Any] = []
        self._thread: Optional[threading.Thread] = None
        self.torch_threads: dict[int, int] = {}  # rank -> torch threads it runs with
        self.rank_info: dict[int, dict[str, Any]] = {}  # rank -> what its ready message said
        self.startup: dict[int, dict[str, float]] = {}  # rank -> startup phase -> seconds
        self._ready = threading.Event()
        self._ready_lock = threading.Lock()
        self._t0 = time.monotonic()
        self.compile_cache = use_compile_cache(self.cfg)  # inherited by the ranks it spawns
        self._kernels_before = cached_kernels(self.compile_cache)
        # time.monotonic() of rank 0's latest finished iteration, written by rank 0 (shared
        # memory; CLOCK_MONOTONIC is one clock for every process of the machine)
        self._heartbeat: Any = multiprocessing.RawValue("d", time.monotonic())
        in_process = self.cfg.tp_size == 1 if in_process is None else in_process
        if in_process and not wait:
            raise EngineError("wait=False needs rank processes: pass in_process=False")
        self._start(in_process)
        if wait:
            self.wait_ready()

    @property
    def ready(self) -> bool:
        """Every rank has loaded, warmed up and captured its graphs."""
        return self._ready.is_set()

    def wait_ready(self) -> None:
        """Wait until every rank is ready (raises EngineError when one fails to start), then
        log the startup's summary and start routing outputs."""
        with self._ready_lock:
            if self._ready.is_set():
                return
            if self._procs:
                self._wait_ready(len(self._procs))
            log.info(summary_line(time.monotonic() - self._t0, self.startup,
                                  cached_kernels(self.compile_cache) - self._kernels_before,
                                  str(self.compile_cache)))
            self._router = threading.Thread(target=self._route, name="moeserve-router",
                                            daemon=True)
            self._router.start()
            _FrozenHeap.hold(self)
            self._ready.set()

    def _phase(self, rank: int, name: str, seconds: float, detail: str) -> None:
        self.startup.setdefault(rank, {})[name] = seconds
        if rank == 0:
            log.info(phase_line(rank, name, seconds, detail))

    # --- lifecycle ------------------------------------------------------------------------
    def _start(self, in_process: bool) -> None:
        if in_process:
            if self.cfg.tp_size != 1:
                raise EngineError(f"in_process=True runs one rank, but --tp-size is "
                                  f"{self.cfg.tp_size}")
            self._inbox: Any = queue.Queue()
            self._outbox: Any = queue.Queue()
            from moeserve.parallel.groups import single_process_state
            from moeserve.parallel.devices import rank_device

            device = rank_device(self.cfg, 0)
            if self.cfg.cpu_threads_per_rank is not None:  # this process is the caller's:
                torch.set_num_threads(self.cfg.cpu_threads_per_rank)  # only when asked
            state = single_process_state(self.plan.layout, device)
            worker = RankWorker(self.cfg, self.spec, self.plan, state, self.eos_token_ids,
                                report=lambda *a: self._phase(0, *a))
            self._thread = threading.Thread(target=self._run_in_thread, args=(worker,),
                                            name="moeserve-rank0", daemon=True)
            self._thread.start()
            self.torch_threads = {0: torch.get_num_threads()}
            return
        ctx = mp.get_context("spawn")
        self._inbox, self._outbox = ctx.Queue(), ctx.Queue()
        addr = self.cfg.dist_init_addr or f"127.0.0.1:{free_port()}"
        local = self.cfg.tp_size // self.cfg.nnodes
        for rank in range(local):
            p = ctx.Process(target=rank_main, name=f"moeserve-rank{rank}", daemon=True,
                            args=(rank, self.cfg, self.plan, f"tcp://{addr}",
                                  self._inbox if rank == 0 else None, self._outbox,
                                  self.eos_token_ids, self._heartbeat if rank == 0 else None))
            p.start()
            self._procs.append(p)

    def _wait_ready(self, local: int) -> None:
        """Wait for every local rank's "ready"; a rank that reports an error or dies first
        fails the start at once, with its reason."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(self.torch_threads) < local:
            try:
                msg = self._outbox.get(timeout=0.2)
            except queue.Empty:
                msg = None
            if msg and msg[0] == "ready":
                self.torch_threads[msg[1]] = msg[2]["torch_threads"]
                self.rank_info[msg[1]] = msg[2]
                continue
            if msg and msg[0] == "phase":
                self._phase(*msg[1:])
                continue
            if self._closing:
                self._fail_start("the engine was shut down while its ranks were starting")
            if msg and msg[0] == "error":
                self._fail_start(f"rank {msg[1]} failed to start: {msg[2]}")
            died = self._died()
            if died:
                try:  # a rank that raised has put its reason on the queue before it exited
                    msg = self._outbox.get(timeout=1.0)
                except queue.Empty:
                    msg = None
                if msg and msg[0] == "error":
                    self._fail_start(f"rank {msg[1]} failed to start: {msg[2]}")
                codes = [p.exitcode for p in self._procs]
                if SPAWN_REIMPORT_EXIT in codes:
                    self._fail_start(f"{died} before it was ready: {GUARD_HINT}")
                self._fail_start(f"{died} before it was ready (its stderr above says why; if "
                                 f"this script creates the Engine outside an `if __name__ == "
                                 f"\"__main__\":` guard, add one)")
            if time.monotonic() > deadline:
                self._fail_start(f"the ranks did not start within {START_TIMEOUT_S:.0f} s "
                                 f"({len(self.torch_threads)} of {local} ready)")
        self.torch_threads = dict(sorted(self.torch_threads.items()))

    def _fail_start(self, why: str) -> None:
        self._dead = why
        self._kill()
        raise EngineError(why)

    def _run_in_thread(self, worker: RankWorker) -> None:
        try:
            serve_loop(worker, self._inbox, self._outbox, heartbeat=self._heartbeat)
        except BaseException as exc:  # the one rank died: say why to every caller
            import traceback

            self._outbox.put(("error", 0, f"{type(exc).__name__}: {exc}\n"
                              f"{traceback.format_exc()}"))

    def shutdown(self) -> None:
        """Stop the ranks: they finish their step and exit, or are killed after
        STOP_TIMEOUT_S; never blocks longer (it also runs at interpreter exit)."""
        if self._closing:
            return
        self._closing = True
        if self._dead is None or self._thread is not None:
            # an in-process rank that the watchdog gave up on may still wake: let it end then
            self._inbox.put(Message("shutdown"))
        deadline = time.monotonic() + STOP_TIMEOUT_S
        if self._thread is not None:
            # a stalled thread cannot be killed; one that died has ended already
            self._thread.join(timeout=STOP_TIMEOUT_S if self._dead is None else 1.0)
            self._release_device_memory()
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill()
        if hasattr(self._inbox, "cancel_join_thread"):
            # a message no rank will read must not hold the interpreter's exit
            self._inbox.cancel_join_thread()
        self._fail_all("the engine was shut down")
        _FrozenHeap.release(self)

    def _release_device_memory(self) -> None:
        """An in-process rank's tensors die with its thread; hand the allocator's cached blocks
        back too, so that the next engine (or another process) on this GPU can have them."""
        _FrozenHeap.release(self)  # the rank's objects are the collector's again
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5.0)  # reap; a SIGKILLed process ends at once

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # interpreter teardown: nothing left to tell
            pass

    # --- routing of outputs ---------------------------------------------------------------
    def _route(self) -> None:
        while True:
            try:
                msg = self._outbox.get(timeout=0.5)
            except queue.Empty:
                msg = None
            except (EOFError, OSError):
                msg = ("error", -1, "the workers' output queue closed")
            if msg is not None and msg[0] == "stats":
                self._stats[msg[1]] = msg[2]
            elif msg is not None and msg[0] == "out":
                self._deliver(msg[1])
            elif msg is not None and msg[0] == "error" and not self._closing:
                # a rank that failed in a collective often only reports a peer's death:
                # give the dead peer a moment to be seen, and name it first
                time.sleep(0.5)
                died = self._died()
                why = f"rank {msg[1]} failed: {msg[2]}"
                self._stop_with(f"{died}; then {why}" if died else why)
                return
            died = self._died() or self._stalled()
            if died and not self._closing:
                self._stop_with(died)
                return
            if self._closing and (msg is None or msg[0] == "exit"):
                return

    def _deliver(self, outs: list[TokenOutput]) -> None:
        """One message's outputs to their requests, each with its text, on its queue or to its
        callback. A request ends with its last output, or here (a stop string matched, its
        output or its callback failed), and then the workers abort it. The one output thread
        does this for every token the engine serves: the lookups take no lock (a dict's get
        is atomic), only the end of a request does."""
        for out in outs:
            pend = self._pending.get(out.rid)
            if pend is None:
                continue  # ended here already (stop string), or shut down
            out, ended_here = pend.translate(out)  # a failure there ends only it
            ends = out.finish is not None or out.error is not None
            if ends:
                self._end(pend)
            try:
                pend.deliver(out)
            except Exception:
                log.exception("request %s: its output callback failed, so it ends", out.rid)
                if not ends:
                    self._end(pend)
                    ended_here = True
            if ended_here:
                self.abort(out.rid)

    def _end(self, pend: RequestState) -> None:
        with self._lock:
            self._pending.pop(pend.rid, None)
            self._load[pend.dp_rank] -= 1

    def _died(self) -> Optional[str]:
        """The first rank that died, one killed by a signal before one that exited with an
        error (which is most often a rank that lost its peer and reports it)."""
        dead = [(code > 0, rank, code) for rank, p in enumerate(self._procs)
                if (code := p.exitcode) is not None and code != 0]
        if not dead:
            return None
        _, rank, code = min(dead)
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        return f"rank {rank} died ({how})"

    def _stalled(self) -> Optional[str]:
        """Why the engine counts as stalled: requests are pending and rank 0 has finished no
        iteration for --watchdog-timeout seconds; else None."""
        limit = self.cfg.watchdog_timeout
        if limit <= 0 or not self._pending:
            return None
        idle = time.monotonic() - self._heartbeat.value
        if idle <= limit:
            return None
        return (f"the engine stalled: no step finished in {idle:.0f} s while "
                f"{len(self._pending)} requests were pending (--watchdog-timeout {limit:g}); "
                "a rank is stopped or hung, so the engine stops")

    @property
    def rank_pids(self) -> list[int]:
        """Process ids of this node's rank processes, by rank (empty for an in-process
        rank)."""
        return [p.pid for p in self._procs]

    def _stop_with(self, why: str) -> None:
        self._dead = why
        self._fail_all(why)
        self._kill()

    def _fail_all(self, why: str) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for rid, pend in pending.items():
            try:
                pend.deliver(TokenOutput(rid, [], None, error=why))
            except Exception:
                log.exception("request %s: its output callback failed", rid)

    @property
    def failure(self) -> Optional[str]:
        """Why the engine stopped on its own (a rank died), or None."""
        return None if self._closing else self._dead

    @property
    def closed(self) -> bool:
        """shutdown() was called, or a rank died."""
        return self._closing or self._dead is not None

    def kv_stats(self) -> dict[str, int]:
        """The workers' latest KV and queue figures, summed over DP ranks: used_slots,
        prefix_cached_slots, total_slots, running, waiting."""
        parts = list(self._stats.values())
        return {k: sum(p[k] for p in parts) for k in parts[0]} if parts else {}

    # --- requests -------------------------------------------------------------------------
    def _params(self, params: ParamsLike) -> SamplingParams:
        if params is None:
            return SamplingParams()
        if isinstance(params, SamplingParams):
            return params
        if isinstance(params, dict):
            try:
                return SamplingParams(**params)
            except TypeError as exc:
                raise ValueError(f"unknown sampling parameter: {exc}") from None
        raise TypeError(f"sampling params must be SamplingParams or dict, got {type(params)}")

    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer, and this engine runs with "
                             "--skip-tokenizer-init; give token ids")
        return self.tokenizer.encode(prompt)

    def submit(self, input_ids: Sequence[int], params: ParamsLike = None,
               stream: bool = False, grammar: Optional[GrammarSpec] = None,
               on_output: Optional[Callable[[TokenOutput], None]] = None
               ) -> tuple[str, "queue.SimpleQueue[TokenOutput]"]:
        """Queue one request; returns its id and the queue its outputs arrive on. With
        `grammar` (runtime/grammar.py) every output token follows it, and its end ends the
        request (finish reason "stop"); an invalid one raises GrammarError. With `on_output`,
        the engine's output thread calls on_output(output) instead (the queue stays empty;
        the error of an engine that stops comes on the thread that stops it): many requests
        are served without a thread waiting on each. It must return at once; one that raises
        ends its request (logged)."""
        rid, outputs, inp = self._request(input_ids, params, stream, grammar, on_output)
        self._inbox.put(Message("add", inp))
        return rid, outputs

    def _request(self, input_ids: Sequence[int], params: ParamsLike, stream: bool,
                 grammar: Optional[GrammarSpec] = None,
                 on_output: Optional[Callable[[TokenOutput], None]] = None
                 ) -> tuple[str, "queue.SimpleQueue[TokenOutput]", RequestInput]:
        """Check one request and register it; the caller queues the RequestInput."""
        self._check_running()
        if not self._ready.is_set():
            raise EngineError("the engine is still starting (Engine.ready is False); call "
                              "Engine.wait_ready() first")
        ids = [int(i) for i in input_ids]
        bad = [i for i in ids if not 0 <= i < self.spec.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary "
                             f"[0, {self.spec.vocab_size})")
        sp = self._params(params)
        if sp.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this engine runs with "
                             "--skip-tokenizer-init; use stop_token_ids")
        if grammar is not None:
            grammar.check()
        rid = uuid.uuid4().hex
        big = [t for t, _ in sp.logit_bias if t >= self.spec.vocab_size]
        if big:
            raise ValueError(f"logit_bias token ids {big[:5]} are outside the vocabulary "
                             f"[0, {self.spec.vocab_size})")
        detok = (self.tokenizer.detokenizer(ids, skip_special_tokens=sp.skip_special_tokens)
                 if self.tokenizer is not None else None)
        with self._lock:
            # again under the lock that _fail_all takes the pending requests with: one that
            # came after them would never end (nobody would call its callback)
            self._check_running()
            dp = min(range(len(self._load)), key=lambda d: self._load[d])
            self._load[dp] += 1
            pend = self._pending[rid] = RequestState(rid, sp, dp, detok, on_output)
        # stop strings are matched on the text here, so their tokens must come every step
        every_step = stream or bool(sp.stop)
        return rid, pend.outputs, RequestInput(rid, tuple(ids), sp, dp, every_step, grammar)

    def _check_running(self) -> None:
        if self._dead is not None:
            raise EngineError(f"the engine has stopped: {self._dead}")
        if self._closing:
            raise EngineError("the engine is shut down")

    def abort(self, rid: str) -> None:
        if self._dead is None and not self._closing:
            self._inbox.put(Message("abort", rid))

    def profile_kernels(self, count: int, skip: int = 0) -> None:
        """Every rank runs the `count` forwards after its next `skip` under torch.profiler
        and writes its kernel table (rank{r}_kernels.txt) into MOESERVE_PROFILE_DIR, which
        must be set when the engine starts (runtime/step_profile.py)."""
        if not self._profiling:
            raise EngineError(f"profile_kernels needs {DIR_ENV} (a folder) in the environment "
                              "the engine starts in")
        if count < 1 or skip < 0:
            raise ValueError(f"profile_kernels: count >= 1 and skip >= 0, got {count}, {skip}")
        self._check_running()
        self._inbox.put(Message("profile", (count, skip)))

    def _inputs(self, prompt: Any, input_ids: Any) -> tuple[list[list[int]], bool]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt or input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            prompts = [prompt] if single else list(prompt)
            return [self.encode(p) for p in prompts], single
        single = bool(input_ids) and isinstance(input_ids[0], int)
        return ([list(input_ids)] if single else [list(x) for x in input_ids]), single

    def generate(self, prompt: Union[str, Sequence[str], None] = None,
                 sampling_params: Union[ParamsLike, Sequence[ParamsLike]] = None,
                 input_ids: Union[Sequence[int], Sequence[Sequence[int]], None] = None,
                 ) -> Union[dict[str, Any], list[dict[str, Any]]]:
        """Generate for one prompt (returns a dict) or several (a list, in order, run
        concurrently). A result: text, token_ids, finish_reason, matched_stop, usage,
        logprobs and prompt_logprobs (when asked: those of prompt tokens 1..), error (None
        unless the request failed)."""
        batch, single = self._inputs(prompt, input_ids)
        params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                  else [sampling_params] * len(batch))
        if len(params) != len(batch):
            raise ValueError(f"{len(params)} sampling params for {len(batch)} prompts")
        parsed = [self._params(p) for p in params]  # validate all before submitting any
        reqs: list[tuple[str, Any, RequestInput]] = []
        try:
            for ids, p in zip(batch, parsed):
                reqs.append(self._request(ids, p, False))
        except Exception:  # none of the batch runs: forget those registered already
            with self._lock:
                for rid, _, inp in reqs:
                    self._pending.pop(rid, None)
                    self._load[inp.dp_rank] -= 1
            raise
        # one message: the workers take the whole list in one iteration, so how a batch is
        # scheduled does not depend on when its requests happen to arrive
        self._inbox.put(Message("add_many", [inp for _, _, inp in reqs]))
        results = [self._collect(rid, q) for rid, q, _ in reqs]
        return results[0] if single else results

    def stream(self, prompt: Optional[str] = None, sampling_params: ParamsLike = None,
               input_ids: Optional[Sequence[int]] = None,
               grammar: Optional[GrammarSpec] = None) -> Iterator[dict[str, Any]]:
        """Yield one dict per step with the new text and token ids; the last one has the
        finish reason and usage. `grammar`: as submit's."""
        (ids,), _ = self._inputs(prompt, input_ids)
        rid, q = self.submit(ids, sampling_params, stream=True, grammar=grammar)
        done, generated = False, 0
        try:
            while not done:
                out = self._next(q)
                done = out.finish is not None or out.error is not None
                generated += len(out.token_ids)
                yield _chunk(out, len(ids), generated)
        finally:
            if not done:
                self.abort(rid)

    def _next(self, q: "queue.SimpleQueue[TokenOutput]") -> TokenOutput:
        while True:
            try:
                return q.get(timeout=1.0)
            except queue.Empty:
                if self._dead is not None:
                    return TokenOutput("", [], None, error=self._dead)

    def _collect(self, rid: str, q: "queue.SimpleQueue[TokenOutput]") -> dict[str, Any]:
        tokens: list[int] = []
        text, logprobs, prompt_lps = [], [], []
        n_prompt = cached = 0
        while True:
            out = self._next(q)
            tokens += out.token_ids
            text.append(out.text)
            logprobs += out.logprobs
            prompt_lps += out.prompt_logprobs
            n_prompt, cached = out.prompt_tokens or n_prompt, out.cached_tokens or cached
            if out.finish is not None or out.error is not None:
                break
        finish = out.finish
        return {"text": "".join(text), "token_ids": tokens,
                "finish_reason": None if finish is None else finish.reason,
                "matched_stop": None if finish is None else finish.matched,
                "usage": {"prompt_tokens": n_prompt, "completion_tokens": len(tokens),
                          "cached_tokens": cached},
                "logprobs": logprobs or None, "prompt_logprobs": prompt_lps or None,
                "error": out.error}


def _chunk(out: TokenOutput, n_prompt: int, generated: int) -> dict[str, Any]:
    return {"text": out.text, "token_ids": out.token_ids, "logprobs": out.logprobs or None,
            "prompt_logprobs": out.prompt_logprobs or None,
            "finish_reason": None if out.finish is None else out.finish.reason,
            "matched_stop": None if out.finish is None else out.finish.matched,
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": generated,
                      "cached_tokens": out.cached_tokens}, "error": out.error}

