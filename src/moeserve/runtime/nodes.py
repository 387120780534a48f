"""Nodes other than 0 of a multi-node engine: they run their ranks and wait.

Node 0 runs the Engine (and its ranks 0 .. tp/nnodes - 1); node K runs ranks
K * tp/nnodes .. (K + 1) * tp/nnodes - 1, which join the same process group through
--dist-init-addr and take their requests from rank 0.
"""

from __future__ import annotations

import queue
import sys

import torch.multiprocessing as mp

from moeserve.config import EngineConfig
from moeserve.parallel.devices import runtime_config
from moeserve.runtime.engine import EngineError, make_plan
from moeserve.runtime.worker import rank_main
from moeserve.runtime.tokenizer import checkpoint_eos_ids


def run_follower_node(cfg: EngineConfig) -> int:
    if cfg.nnodes < 2 or cfg.node_rank == 0:
        raise EngineError("`moeserve worker` runs nodes 1.. of a multi-node engine: give "
                          "--nnodes N (N >= 2), --node-rank K (K >= 1) and --dist-init-addr")
    cfg = runtime_config(cfg)
    plan = make_plan(cfg)
    eos = tuple(sorted(checkpoint_eos_ids(cfg.model, plan.spec.vocab_size)))
    ctx = mp.get_context("spawn")
    outbox = ctx.Queue()
    local = cfg.tp_size // cfg.nnodes
    procs = []
    for i in range(local):
        rank = cfg.node_rank * local + i
        p = ctx.Process(target=rank_main, name=f"moeserve-rank{rank}", daemon=True,
                        args=(rank, cfg, plan, f"tcp://{cfg.dist_init_addr}", None, outbox,
                              eos))
        p.start()
        procs.append(p)
    code = 0
    while any(p.is_alive() for p in procs):
        try:
            msg = outbox.get(timeout=0.5)
        except queue.Empty:
            msg = None
        if msg and msg[0] == "error":
            print(f"moeserve worker: rank {msg[1]} failed: {msg[2]}", file=sys.stderr)
            code = 1
            for p in procs:
                if p.is_alive():
                    p.kill()
    for p in procs:
        p.join(timeout=5)
        code = code or (p.exitcode or 0)
    return code
