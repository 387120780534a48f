r"""Tune the fused MoE kernels' tiles per (E_local, H, I_local, dtype, device, token count) and
write them as JSON into src/moeserve/kernels/moe/configs/ (moeserve.kernels.moe.configs reads
them).

    PYTHONPATH=src python -m benchmarks tune-moe [--models ...] [--shape E,H,I,K ...] \
        [--tokens 1 16 64 ...] [--ep N] [--out DIR] [--time-budget SECONDS] \
        [--half-tail-only | --atomic-sum-only | --retune {gate_up,down} | --fp8]

For each token count: uniform random routing (with --ep N, as a rank's experts see it under
expert parallelism: the token count is the rows the runner is given, each row's top-k drawn over
all N x E_local experts and those of other ranks -1, as the dispatchers hand them over: the
tables are keyed by the rows the runner looks its config up by), then for each BLOCK_M that
suits the mean rows per used expert, every gate_up candidate and every down candidate timed
alone (do_bench: a CUDA-graph replay, as the engine's graphs run them, with L2 flushed before
each, so weights come from HBM as in a real step); the BLOCK_M
whose best pair is fastest wins; at BLOCK_M >= 32 each GEMM's winner is timed again with
"HALF_TAIL" (half tiles for short last blocks) and keeps it when that is at least 1% faster
(alternating, best of 3). Last, from ATOMIC_SUM_MIN_TOKENS tokens, down and the top-k sum are
timed together against down adding its rows into the output with atomics ("ATOMIC_SUM", no
top-k sum pass), kept when at least 1% faster. --half-tail-only and --atomic-sum-only do one of
those steps alone on the entries already in --out; --retune GEMM re-tunes only that GEMM of
them, and keeps the shipped tiles unless the new winner is 1% faster against them,
alternating. Candidates are the same for every shape, so each compiles once per run. A size
that runs out of --time-budget keeps the defaults. On sm90, down's candidates include the
warp-specialised kernel ("WS").

Up to DECODE_MAX_TOKENS tokens the GEMV kernels of decode_moe.py are tuned too (each kernel
alone, as CUDA-graph replays of 4 calls with different routings), then both whole paths
(align + GEMMs + top-k sum, against the two GEMV launches) are timed as CUDA-graph replays of
4 calls with different routings, and the entry gets a "decode" key only when that path is
faster.

--fp8 tunes the block-scaled fp8 kernels instead (benchmarks/tune_moe_fp8.py).
"""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path
from typing import Any, Optional

import torch

from benchmarks import harness
from benchmarks.moe import MODELS, model_spec

HELP = "tune the fused MoE kernels' tiles into src/moeserve/kernels/moe/configs/"
DEVICE = "cuda"
TUNE_TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 8192)
# (BLOCK_N, BLOCK_K, num_warps, num_stages)
SMALL_M = [(32, 128, 4, 4), (64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 3)]
LARGE_M = [(64, 64, 4, 4), (64, 128, 8, 3), (128, 64, 8, 4), (128, 64, 8, 3), (256, 64, 8, 3)]
DECODE_MAX_TOKENS = 8
# ATOMIC_SUM is timed from this many tokens (prefill sizes): its adds land in a varying order,
# so a step's bits may differ between runs, and decode steps, which CUDA graphs replay up to
# --cuda-graph-max-bs (256) rows, keep the top-k pass that gives a graph eager's bits
ATOMIC_SUM_MIN_TOKENS = 1024
# (BLOCK_N, BLOCK_K, num_warps) of the GEMV kernels, gate_up's with and without PREFETCH; no
# num_stages: their loops' loads feed FMAs, and Triton compiles the same code at any stages
GEMV_UP = list(itertools.product((8, 16, 32), (128, 256, 512), (2, 4, 8)))
GEMV_DOWN = list(itertools.product((2, 4, 8, 16), (64, 128, 256, 512), (2, 4, 8)))
HUGE_M = [(64, 64, 8, 4), (128, 64, 8, 3), (128, 64, 8, 4), (256, 64, 8, 3), (256, 64, 8, 4),
          (128, 32, 8, 5), (64, 128, 8, 3), (256, 32, 8, 6)]


def sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def block_ms(rows_per_expert: float) -> list[int]:
    if rows_per_expert <= 8:
        return [16]
    if rows_per_expert <= 24:
        return [16, 32]
    if rows_per_expert <= 96:
        return [32, 64]
    return [64, 128] if rows_per_expert <= 384 else [128]  # configs.BLOCK_MS holds no 256


def candidates(block_m: int, gemm: str, full: bool) -> list[dict[str, int]]:
    from moeserve.kernels.moe.configs import GEMM_KEYS

    if full:
        space = list(itertools.product((32, 64, 128, 256), (64, 128, 256), (4, 8), (3, 4, 5)))
        group_ms = (1, 8)
    else:
        space = SMALL_M if block_m <= 32 else LARGE_M if block_m == 64 else HUGE_M
        group_ms = (1,) if block_m <= 32 else (8,)
    # gate_up keeps two [BLOCK_M, BLOCK_N] fp32 accumulators, down one: tiles that need more
    # than 128 accumulator registers a thread would spill, so they are left out
    accs = 2 if gemm == "gate_up" else 1
    # weights by pointer loads or by TMA (sm90+); gate_up by TMA also with both halves in one
    # MMA operand ("PAIRED")
    tmas = [{"TMA": 0}] if block_m <= 32 else [{"TMA": 0}, {"TMA": 1}]
    if gemm == "gate_up" and block_m > 32:
        tmas.append({"TMA": 1, "PAIRED": 1})
    if gemm == "down" and block_m >= 64 and sm90():  # the Gluon kernel (down_ws.py)
        tmas.append({"TMA": 1, "WS": 1})
    return [{**dict(zip(GEMM_KEYS, (bn, bk, gm, w, s))), **tma}
            for bn, bk, w, s in space for gm in group_ms for tma in tmas
            if accs * block_m * bn <= 128 * 32 * w]


def gemv_candidates(gemm: str, top_k: int) -> list[dict[str, int]]:
    """GEMV tiles whose fp32 accumulators take <= 64 registers a thread: gate_up keeps two
    [BLOCK_N, BLOCK_K], down one [top_k (pow2), BLOCK_N, BLOCK_K]."""
    from moeserve.kernels.moe.configs import DECODE_KEYS

    if gemm == "gate_up":
        space, elems = GEMV_UP, lambda bn, bk: 2 * bn * bk
    else:
        tk = 1 << (top_k - 1).bit_length()
        space, elems = GEMV_DOWN, lambda bn, bk: tk * bn * bk
    prefetch = ({}, {"PREFETCH": 1}) if gemm == "gate_up" else ({},)
    return [{**dict(zip(DECODE_KEYS, c)), **pf} for c in space for pf in prefetch
            if 16 * 32 * c[2] <= elems(c[0], c[1]) <= 64 * 32 * c[2]]


def make_weights(e: int, h: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = torch.randn(e, 2 * i, h, device=DEVICE, dtype=torch.bfloat16) * h ** -0.5
    w2 = torch.randn(e, h, i, device=DEVICE, dtype=torch.bfloat16) * i ** -0.5
    return w13, w2


def do_bench(fn) -> float:
    """ms: the median of 25 replays of a CUDA graph of fn after 5, L2 flushed before each. A
    graph, because the engine runs these kernels in its decode and prefill graphs: timed
    eagerly, a kernel whose launch costs the host more than the device runs it (the
    warp-specialised ones: TMA descriptors, Gluon's argument binding) would be charged its
    host time."""
    return harness.time_us(harness.capture(fn), reps=25, warmup=5, flush_l2=True) / 1e3


def best_of(name: str, fn, cfgs: list[dict]) -> tuple[float, dict]:
    timed = []
    for cfg in cfgs:
        try:
            timed.append((do_bench(lambda: fn(cfg)), cfg))
        except Exception as err:  # out of shared memory or registers: not a candidate
            print(f"  skip {name} {cfg}: {type(err).__name__}", flush=True)
    for kind in sorted({bool(c.get("TMA")) for _, c in timed}):
        t = min(t for t, c in timed if bool(c.get("TMA")) == kind)
        print(f"    {name} best with weights by {'TMA' if kind else 'pointers'}: "
              f"{t * 1e3:.1f} us", flush=True)
    return min(timed, key=lambda t: t[0])


def routed(n: int, k: int, e: int, h: int, ep: int = 1) -> tuple[torch.Tensor, ...]:
    """x, uniform random top-k ids and weights for n rows; with ep > 1 the ids are drawn over
    ep x e experts and those past this rank's e are -1 (an expert-parallel rank's rows)."""
    x = torch.randn(n, h, device=DEVICE, dtype=torch.bfloat16)
    ids = torch.rand(n, e * ep, device=DEVICE).topk(k, dim=1).indices.to(torch.int32)
    ids = torch.where(ids < e, ids, -1)
    return x, ids, torch.rand(n * k, device=DEVICE)


def gemm_fns(x, ids, weights, w13, w2, k: int, bm: int, up: Optional[dict] = None):
    """(gate_up(cfg), down(cfg), summed(cfg)) timed callables on bm-row blocks; down's input
    is gate_up's output under `up` (or a first candidate's); summed is down with the top-k
    sum as fused_experts runs them (the pass after it, or in its tiles under ATOMIC_SUM)."""
    from moeserve.kernels.moe.align import align_triton
    from moeserve.kernels.moe.fused_moe import down, down_summed, gate_up, topk_sum

    e = w13.shape[0]
    blocks = align_triton(ids, 0, e, bm)
    up_fn = lambda c: gate_up(x, w13, blocks, k, "silu", c)
    h_buf = up_fn(up or candidates(bm, "gate_up", False)[0])
    down_fn = lambda c: down(h_buf, w2, blocks, weights, ids.numel(), c)

    def summed(c: dict) -> torch.Tensor:
        if c.get("ATOMIC_SUM"):
            return down_summed(h_buf, w2, blocks, weights, ids.shape[0], k, c)
        return topk_sum(down_fn(c), ids, 0, e)
    return up_fn, down_fn, summed


def with_half_tail(name: str, fn, timed: tuple[float, dict], block_m: int
                   ) -> tuple[float, dict]:
    """(time, cfg) of `timed` with "HALF_TAIL": 1 when that times at least 1% faster
    (BLOCK_M >= 32)."""
    t, cfg = timed
    if block_m < (128 if cfg.get("WS") else 32):  # half tiles of 64 rows a warpgroup in WS
        return t, cfg
    base = {c: v for c, v in cfg.items() if c != "HALF_TAIL"}
    return a_or_b(f"{name} BLOCK_M={block_m}", fn, base, {**base, "HALF_TAIL": 1})


def a_or_b(name: str, fn, a: dict, b: dict) -> tuple[float, dict]:
    """(time, cfg) of b when it times at least 1% faster than a (alternating, best of 3),
    else of a."""
    runs = [(do_bench(lambda: fn(a)), do_bench(lambda: fn(b))) for _ in range(3)]
    t0, t1 = min(r[0] for r in runs), min(r[1] for r in runs)
    print(f"    {name}: {t0 * 1e3:.1f} us {a}, {t1 * 1e3:.1f} us {b} ({t0 / t1:.3f}x)",
          flush=True)
    return (t1, b) if t1 < 0.99 * t0 else (t0, a)


def tune_size(n: int, k: int, w13: torch.Tensor, w2: torch.Tensor, full: bool,
              ep: int = 1) -> dict:
    e, h = w13.shape[0], w13.shape[2]
    x, ids, weights = routed(n, k, e, h, ep)
    pairs = max(1, n * k // ep)  # this rank's, on the mean
    best = None
    for bm in block_ms(pairs / min(e, pairs)):
        up_fn = gemm_fns(x, ids, weights, w13, w2, k, bm)[0]
        best_up = best_of("gate_up", up_fn, candidates(bm, "gate_up", full))
        t_up, up = with_half_tail("gate_up", up_fn, best_up, bm)
        down_fn = gemm_fns(x, ids, weights, w13, w2, k, bm, up)[1]
        best_down = best_of("down", down_fn, candidates(bm, "down", full))
        t_down, dn = with_half_tail("down", down_fn, best_down, bm)
        print(f"  N={n} BLOCK_M={bm}: gate_up {t_up * 1e3:.1f} us {up}, down "
              f"{t_down * 1e3:.1f} us {dn}", flush=True)
        if best is None or t_up + t_down < best[0]:
            best = (t_up + t_down, {"BLOCK_M": bm, "gate_up": up, "down": dn})
    if n <= DECODE_MAX_TOKENS * ep:
        return with_decode(n, k, w13, w2, best[1], ep)
    return with_atomic_sum(n, k, w13, w2, best[1], (x, ids, weights))


def recheck_half_tail(n: int, k: int, w13: torch.Tensor, w2: torch.Tensor, cfg: dict,
                      ep: int = 1) -> dict:
    """A tuned entry with each GEMM's HALF_TAIL re-decided by timing (GEMV entries as they
    are)."""
    if "decode" in cfg or cfg["BLOCK_M"] < 32:
        return cfg
    e, h = w13.shape[0], w13.shape[2]
    x, ids, weights = routed(n, k, e, h, ep)
    bm = cfg["BLOCK_M"]
    up_fn, down_fn, _ = gemm_fns(x, ids, weights, w13, w2, k, bm, cfg["gate_up"])
    _, up = with_half_tail("gate_up", up_fn, (0.0, cfg["gate_up"]), bm)
    _, dn = with_half_tail("down", down_fn, (0.0, cfg["down"]), bm)
    return {**cfg, "gate_up": up, "down": dn}


def with_atomic_sum(n: int, k: int, w13: torch.Tensor, w2: torch.Tensor, cfg: dict,
                    routing: Optional[tuple] = None, ep: int = 1) -> dict:
    """A tuned entry with down's ATOMIC_SUM re-decided: down and the top-k sum timed together
    (alternating, best of 3), the atomics kept when at least 1% faster (GEMV entries and
    sizes below ATOMIC_SUM_MIN_TOKENS as they are)."""
    if "decode" in cfg or n < ATOMIC_SUM_MIN_TOKENS:
        return cfg
    x, ids, weights = routing or routed(n, k, w13.shape[0], w13.shape[2], ep)
    fn = gemm_fns(x, ids, weights, w13, w2, k, cfg["BLOCK_M"], cfg["gate_up"])[2]
    base = {c: v for c, v in cfg["down"].items() if c != "ATOMIC_SUM"}
    _, dn = a_or_b(f"down + top-k sum N={n}", fn, base, {**base, "ATOMIC_SUM": 1})
    return {**cfg, "down": dn}


def retune(gemm: str, n: int, k: int, w13: torch.Tensor, w2: torch.Tensor, cfg: dict,
           ep: int = 1) -> dict:
    """A tuned entry whose `gemm` is replaced by the best candidate (HALF_TAIL re-decided)
    when that times at least 1% faster than the shipped one, alternating (GEMV entries and
    BLOCK_M < 32 as they are)."""
    if "decode" in cfg or cfg["BLOCK_M"] < 32:
        return cfg
    e, h = w13.shape[0], w13.shape[2]
    x, ids, weights = routed(n, k, e, h, ep)
    bm = cfg["BLOCK_M"]
    fn = gemm_fns(x, ids, weights, w13, w2, k, bm, cfg["gate_up"])[gemm == "down"]
    best = with_half_tail(gemm, fn, best_of(gemm, fn, candidates(bm, gemm, False)), bm)
    # (down timed alone: its ATOMIC_SUM, a choice about the pass after it, carries over)
    shipped = {c: v for c, v in cfg[gemm].items() if c != "ATOMIC_SUM"}
    kept = a_or_b(f"{gemm} N={n}", fn, shipped, best[1])[1]
    return {**cfg, gemm: {**kept, **({"ATOMIC_SUM": 1} if cfg[gemm].get("ATOMIC_SUM") else {})}}


def graph_us(fns: list) -> float:
    """Per call, as a CUDA-graph replay of the calls (as the engine replays decode steps)."""
    return harness.graph_us(lambda: [f() for f in fns], calls=len(fns))


def best_in_graph(name: str, make, cfgs: list[dict]) -> tuple[float, dict]:
    timed = []
    for cfg in cfgs:
        try:
            timed.append((graph_us(make(cfg)), cfg))
        except Exception as err:  # out of shared memory or registers: not a candidate
            print(f"  skip {name} {cfg}: {type(err).__name__}", flush=True)
    return min(timed, key=lambda t: t[0])


def with_decode(n: int, k: int, w13, w2, cfg: dict, ep: int = 1) -> dict:
    """cfg plus the best GEMV tiles when the GEMV path beats cfg's whole path. Every time is a
    CUDA-graph replay of 4 calls with different routings (no weights left in L2)."""
    from moeserve.kernels.moe.decode_moe import decode_down, decode_gate_up
    from moeserve.kernels.moe.fused_moe import fused_experts

    e, h = w13.shape[0], w13.shape[2]
    calls = [(x, ids, w.view(n, k)) for x, ids, w in (routed(n, k, e, h, ep) for _ in range(4))]
    t_up, up = best_in_graph("decode gate_up", lambda c: [
        lambda x=x, i=i: decode_gate_up(x, w13, i.view(-1), k, 0, "silu", c)
        for x, i, _ in calls], gemv_candidates("gate_up", k))
    hs = [decode_gate_up(x, w13, i.view(-1), k, 0, "silu", up) for x, i, _ in calls]
    t_down, dn = best_in_graph("decode down", lambda c: [
        lambda hb=hb, i=i, w=w: decode_down(hb, w2, i.view(-1), w.view(-1), n, k, 0, c)
        for hb, (_, i, w) in zip(hs, calls)], gemv_candidates("down", k))
    decode = {**cfg, "decode": {"gate_up": up, "down": dn}}
    whole = {name: graph_us([lambda x=x, i=i, w=w, c=c: fused_experts(x, w13, w2, i, w, 0,
                                                                     "silu", c)
                             for x, i, w in calls])
             for name, c in (("aligned", cfg), ("gemv", decode))}
    print(f"  N={n} GEMV: gate_up {t_up:.1f} us {up}, down {t_down:.1f} us {dn}; "
          f"whole path (graph) aligned {whole['aligned']:.1f} us, GEMV {whole['gemv']:.1f} us",
          flush=True)
    return decode if whole["gemv"] < whole["aligned"] else cfg


def add_arguments(ap: Any) -> None:
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=MODELS)
    ap.add_argument("--shape", nargs="*", default=[], help="E,H,I,K (E and I per rank)")
    ap.add_argument("--ep", type=int, default=1,
                    help="expert-parallel size: --models' experts split N ways, every shape's "
                         "rows routed as one rank's under it (see above)")
    ap.add_argument("--tokens", nargs="+", type=int, default=list(TUNE_TOKENS))
    ap.add_argument("--full", action="store_true", help="sweep the whole space (slow)")
    ap.add_argument("--out", default=None,
                    help="the tables' folder (default: src/moeserve/kernels/moe/configs/)")
    ap.add_argument("--time-budget", type=float, default=float("inf"))
    ap.add_argument("--half-tail-only", action="store_true",
                    help="only re-decide HALF_TAIL on the entries already in --out")
    ap.add_argument("--atomic-sum-only", action="store_true",
                    help="only re-decide down's ATOMIC_SUM on the entries already in --out")
    ap.add_argument("--fp8", action="store_true",
                    help="tune the block-scaled fp8 kernels (128 x 128 scale blocks) into the "
                         "fp8_w8a8_128x128 tables (benchmarks/tune_moe_fp8.py)")
    ap.add_argument("--retune", choices=("gate_up", "down"), default=None,
                    help="only re-tune this GEMM of the entries already in --out, keeping "
                         "the shipped tiles unless the new ones time 1%% faster")


def run(args: Any, argv: list[str]) -> int:
    from moeserve.kernels.moe.configs import CONFIG_DIR, config_file_name

    harness.require_gpu()
    out = Path(args.out or CONFIG_DIR)
    shapes = []
    for name in args.models:
        spec = model_spec(name)
        shapes.append((spec.num_experts // args.ep, spec.hidden_size,
                       spec.moe_intermediate_size, spec.top_k))
    shapes += [tuple(int(v) for v in s.split(",")) for s in args.shape]
    if args.fp8:
        if args.half_tail_only or args.atomic_sum_only or args.retune or args.full:
            raise SystemExit("--fp8 tunes whole entries: without --half-tail-only, "
                             "--atomic-sum-only, --retune or --full")
        from benchmarks import tune_moe_fp8

        return tune_moe_fp8.run(args, shapes)
    device = torch.cuda.get_device_name()
    deadline = time.monotonic() + args.time_budget
    os.makedirs(out, exist_ok=True)
    weights: dict = {}
    # sizes outermost: a run cut short by --time-budget has tuned every shape's small sizes
    for n in args.tokens:
        for e, h, i, k in shapes:
            path = out / config_file_name(e, h, i, torch.bfloat16, device)
            if time.monotonic() > deadline:
                print(f"E={e} H={h} I={i} N={n}: out of --time-budget, left to the defaults",
                      flush=True)
                continue
            print(f"E={e} H={h} I={i} K={k} N={n} on {device} -> {path.name}", flush=True)
            if (e, h, i) not in weights:
                weights = {(e, h, i): make_weights(e, h, i)}  # one shape's weights at a time
            w13, w2 = weights[(e, h, i)]
            table = json.loads(path.read_text()) if path.is_file() else {}
            if args.half_tail_only or args.atomic_sum_only or args.retune:
                if str(n) not in table:
                    print(f"  no entry for N={n} to re-check", flush=True)
                    continue
                if args.half_tail_only:
                    table[str(n)] = recheck_half_tail(n, k, w13, w2, table[str(n)], args.ep)
                elif args.atomic_sum_only:
                    table[str(n)] = with_atomic_sum(n, k, w13, w2, table[str(n)], ep=args.ep)
                else:
                    table[str(n)] = retune(args.retune, n, k, w13, w2, table[str(n)], args.ep)
            else:
                table[str(n)] = tune_size(n, k, w13, w2, args.full, args.ep)
            path.write_text(json.dumps(dict(sorted(table.items(), key=lambda t: int(t[0]))),
                                       indent=1) + "\n")
    return 0
