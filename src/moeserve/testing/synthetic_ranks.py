"""An Engine whose rank is a stand-in without a model: the engine's output path (the router's
queue, detokenization, the per-request queues, the clients) measured and tested alone.

    with SyntheticEngine(skip_tokenizer_init=False, batch=256) as engine:
        run_bench(engine, prompts, output_len=64, max_concurrency=1024)

The stand-in is one spawned process, as a rank of `moeserve bench` is: it reads the engine's
inbox as rank 0 does and puts ("out", [TokenOutput, ...]) on the engine's outbox, one output a
running request per step, in messages of at most `batch` outputs (a DP group's share of a
step); the k-th output token of a request is its prompt's token k mod the prompt's length, so a
client knows what it should receive. `step_s` paces the steps (0: as fast as it can; a step
then holds only the requests that arrived since the last, so its messages are small).
"""

from __future__ import annotations

import gc
import os
import queue
import time
from typing import Any, Sequence

import torch.multiprocessing as mp

from moeserve.runtime.engine import Engine
from moeserve.runtime.request import RequestInput, TokenOutput
from moeserve.runtime.sampling import Finish
from moeserve.runtime.worker import Message

FLAGS = dict(load_format="dummy", device="cpu", context_length=2048, max_total_tokens=1 << 20,
             max_running_requests=4096)


def expected_tokens(prompt: Sequence[int], n: int) -> list[int]:
    """The output tokens the stand-in gives a request with this prompt."""
    return [prompt[k % len(prompt)] for k in range(n)]


class SyntheticEngine(Engine):
    """Engine on preset:tiny (its byte-level tokenizer unless skip_tokenizer_init) whose one
    rank is `synthetic_rank` in a process of its own; other keywords go to Engine."""

    def __init__(self, model: str = "preset:tiny", *, batch: int = 1024, step_s: float = 0.0,
                 **flags: Any) -> None:
        self._synthetic = (batch, step_s)
        super().__init__(model, in_process=False, **{**FLAGS, **flags})

    def _start(self, in_process: bool) -> None:
        ctx = mp.get_context("spawn")
        self._inbox, self._outbox = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=synthetic_rank, name="moeserve-synthetic-rank", daemon=True,
                        args=(self._inbox, self._outbox, self._heartbeat, *self._synthetic))
        p.start()
        self._procs.append(p)


def synthetic_rank(inbox: Any, outbox: Any, heartbeat: Any, batch: int, step_s: float) -> None:
    """Rank 0's protocol without a model: ready, then steps until a shutdown message."""
    gc.freeze()  # its imports stay out of full collections: a stall here is not the engine's
    parent = os.getppid()
    outbox.put(("ready", 0, {"torch_threads": 1}))
    running: dict[str, tuple[RequestInput, int]] = {}  # rid -> (its input, tokens sent)
    while True:
        msgs: list[Message] = []
        try:
            msgs.append(inbox.get(timeout=0.02) if not running else inbox.get_nowait())
            while True:
                msgs.append(inbox.get_nowait())
        except queue.Empty:
            pass
        heartbeat.value = time.monotonic()
        for m in msgs:
            if m.kind == "shutdown":
                outbox.put(("exit", 0))
                return
            if m.kind in ("add", "add_many"):
                for inp in (m.payload if m.kind == "add_many" else [m.payload]):
                    running[inp.rid] = (inp, 0)
            elif m.kind == "abort":
                running.pop(m.payload, None)
        if os.getppid() != parent:
            return
        if not running:
            continue
        start = time.monotonic()
        outs = []
        for rid, (inp, sent) in list(running.items()):
            last = sent + 1 >= inp.params.max_new_tokens
            outs.append(TokenOutput(rid, [inp.input_ids[sent % len(inp.input_ids)]],
                                    Finish("length") if last else None,
                                    prompt_tokens=len(inp.input_ids)))
            if last:
                del running[rid]
            else:
                running[rid] = (inp, sent + 1)
        for i in range(0, len(outs), batch):
            outbox.put(("out", outs[i:i + batch]))
        if step_s:
            time.sleep(max(0.0, step_s - (time.monotonic() - start)))
