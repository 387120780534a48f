r"""`python -m benchmarks tune-moe --fp8`: the tiles of the fp8 MoE kernels (fused_moe_fp8.py,
decode_moe_fp8.py) for 128 x 128 scale blocks, into the fp8_w8a8_128x128 tables.

The search of tune_moe.py, narrowed to what the fp8 kernels take: BLOCK_K dividing the scale
group (64 or 128), gate_up's BLOCK_N whole groups (128 or 256; the GEMV's also 16..64), no
PAIRED; up to BLOCK_M 32 also with "SWAP" (the weight the dot's M side); at BLOCK_M 64 and
128 also the warp-specialised kernels ("WS": fp8_ws.py's,
fp8_ws128.py's); per token count each BLOCK_M's gate_up and down candidates timed alone
(tune_moe.do_bench: CUDA-graph replays, L2 flushed), HALF_TAIL kept where 1% faster, from
ATOMIC_SUM_MIN_TOKENS the down's ATOMIC_SUM against its top-k sum pass, the BLOCK_M whose
gate_up and down as the runner will run them (the top-k sum included) time fastest, and up to
DECODE_MAX_TOKENS the GEMV path against the aligned one as CUDA-graph replays of the whole
experts on quantized rows, as the decode step hands them over (best of 3). With --ep N the
rows are routed as an expert-parallel rank's, as tune_moe.py routes them. The table's "note"
names the sizes it tuned (tuned_note), those of earlier runs included.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from moeserve.kernels.moe.configs import FP8_WS_BLOCK, rows_per_expert
from benchmarks.tune_moe import (ATOMIC_SUM_MIN_TOKENS, DECODE_MAX_TOKENS, DEVICE, a_or_b,
                                 best_in_graph, best_of, block_ms, graph_us, routed,
                                 with_half_tail)

BLOCK = (128, 128)
GROUP = BLOCK[1]


def candidates(block_m: int, gemm: str) -> list[dict[str, int]]:
    """GEMM tiles by the fp8 rules whose fp32 accumulators fit 128 registers a thread, up to
    BLOCK_M 32 also those of a scale group a K step with SWAP, and at BLOCK_M 64 and 128 the
    warp-specialised kernels (their fixed tiles, a K step and the stages of a ring)."""
    bns = (128, 256) if gemm == "gate_up" else (32, 64, 128, 256)
    accs = 2 if gemm == "gate_up" else 1
    tmas = [{"TMA": 0}] if block_m <= 32 else [{"TMA": 0}, {"TMA": 1}]
    group_m = 1 if block_m <= 32 else 8
    tiles = [{"BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m, "num_warps": w,
              "num_stages": s, **tma}
             for bn, bk, w, s in itertools.product(bns, (64, 128), (4, 8), (3, 4))
             for tma in tmas if accs * block_m * bn <= 128 * 32 * w]
    if block_m <= 32:  # the weight's rows the dot's M side: Hopper's wgmma on few rows
        tiles += [{**t, "SWAP": 1} for t in tiles if t["BLOCK_K"] == GROUP]
    if block_m in (64, 128):  # fp8_ws.py's, fp8_ws128.py's (a scale group a stage)
        steps = ((64, 6), (128, 3), (128, 4)) if block_m == 64 else ((128, 3), (128, 4))
        tiles += [{"BLOCK_N": FP8_WS_BLOCK[1], "BLOCK_K": bk, "GROUP_M": 1, "num_warps": 4,
                   "num_stages": s, "WS": 1} for bk, s in steps]
    return tiles


def gemv_candidates(gemm: str, top_k: int) -> list[dict[str, int]]:
    """Decode tiles by the fp8 rules (a K step whole groups; the products reduced a step)
    whose weight tiles take 8..64 fp8 values a thread, and the MMA kernel's tiles."""
    if gemm == "gate_up":
        space = itertools.product((4, 8, 16, 32), (GROUP, 2 * GROUP, 4 * GROUP), (4, 8))
        elems = lambda bn, bk: 2 * bn * bk  # noqa: E731
    else:
        tk = 1 << (top_k - 1).bit_length()
        space = itertools.product((1, 2, 4, 8, 16), (GROUP, 2 * GROUP, 4 * GROUP), (4, 8))
        elems = lambda bn, bk: tk * bn * bk  # noqa: E731
    tiles = [{"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w} for bn, bk, w in space
             if 8 * 32 * w <= elems(bn, bk) <= 64 * 32 * w]
    # the MMA kernels: a group a step, the weight's rows the M side
    tiles += [{"BLOCK_N": bn, "BLOCK_K": GROUP, "num_warps": w, "num_stages": st, "MMA": 1}
              for bn, w, st in itertools.product((64, 128), (4, 8), (4, 6))]
    return tiles


def make_weights(e: int, h: int, i: int) -> tuple[torch.Tensor, ...]:
    from moeserve.kernels.fp8 import reference as R

    w13 = R.quantize_blocks(torch.randn(e, 2 * i, h, device=DEVICE) * h ** -0.5, BLOCK)
    w2 = R.quantize_blocks(torch.randn(e, h, i, device=DEVICE) * i ** -0.5, BLOCK)
    return (*w13, *w2)


def _half_tail(name: str, fn, timed: tuple[float, dict], block_m: int) -> tuple[float, dict]:
    """with_half_tail, but for the fp8 WS kernels, which have no half tiles."""
    return timed if timed[1].get("WS") else with_half_tail(name, fn, timed, block_m)


def tune_size(n: int, k: int, w: tuple[torch.Tensor, ...], ep: int = 1) -> dict:
    from moeserve.kernels.fp8.gemm import quantize_groups
    from moeserve.kernels.moe import fused_moe_fp8 as F8
    from moeserve.kernels.moe.align import align_triton
    from moeserve.kernels.moe.fused_moe import topk_sum

    w13, w13_s, w2, w2_s = w
    e, h = w13.shape[0], w13.shape[2]
    x, ids, weights = routed(n, k, e, h, ep)
    xq, xs = quantize_groups(x, GROUP)
    mine = max(1, int((ids >= 0).sum()))  # this rank's pairs (all of them without EP)
    best = None

    def summed(hq: torch.Tensor, hs: torch.Tensor, blocks, y: torch.Tensor):
        """down and the top-k sum: in the down's tiles (ATOMIC_SUM) or a pass after it."""
        def run(c: dict) -> torch.Tensor:
            if c.get("ATOMIC_SUM"):
                out = torch.zeros(n, h, device=DEVICE, dtype=torch.bfloat16)
                return F8.down(hq, hs, w2, w2_s, blocks, weights, out, k, c, BLOCK, True)
            F8.down(hq, hs, w2, w2_s, blocks, weights, y, 1, c, BLOCK, False)
            return topk_sum(y, ids, 0, e)
        return run

    per_expert = rows_per_expert(mine, 1, e)  # of this rank's pairs
    # BLOCK_M 64 at every size past the decode path's: where the bf16 rule takes 128 alone
    # (the fp8 gate_up's two accumulators at 128 rows fit only [128, 128] tiles with 8 warps),
    # and where few rows share an expert, since fp8_ws.py's kernels stream the weights faster
    # than the Triton kernels' smaller blocks while the tensor cores idle (memory-bound)
    wide = {64} if n > DECODE_MAX_TOKENS else set()
    for bm in sorted(set(block_ms(per_expert)) | wide):
        blocks = align_triton(ids, 0, e, bm)
        up_fn = lambda c: F8.gate_up(xq, xs, w13, w13_s, blocks, k, "silu", c, BLOCK)  # noqa: E731
        t_up, up = _half_tail("gate_up", up_fn, best_of("gate_up", up_fn,
                                                        candidates(bm, "gate_up")), bm)
        hq, hs = up_fn(up)
        y = torch.empty(n * k, h, device=DEVICE, dtype=torch.bfloat16)  # a row a pair slot
        down_fn = lambda c: F8.down(hq, hs, w2, w2_s, blocks, weights, y, 1, c, BLOCK,  # noqa
                                    False)
        t_down, dn = _half_tail("down", down_fn, best_of("down", down_fn,
                                                         candidates(bm, "down")), bm)
        if n >= ATOMIC_SUM_MIN_TOKENS:  # the down and the top-k sum, as the runner runs them
            t_down, dn = a_or_b("down + top-k sum", summed(hq, hs, blocks, y), dn,
                                {**dn, "ATOMIC_SUM": 1})
        print(f"  N={n} BLOCK_M={bm}: gate_up {t_up * 1e3:.1f} us {up}, "
              f"down {t_down * 1e3:.1f} us {dn}", flush=True)
        if best is None or t_up + t_down < best[0]:
            best = (t_up + t_down, {"BLOCK_M": bm, "gate_up": up, "down": dn})
    cfg = best[1]
    if n <= DECODE_MAX_TOKENS:
        cfg = with_decode(n, k, w, cfg, ep)
    return cfg


def with_decode(n: int, k: int, w: tuple[torch.Tensor, ...], cfg: dict, ep: int = 1) -> dict:
    """cfg plus the best GEMV tiles when the GEMV path times faster as a graph replay."""
    from moeserve.kernels.fp8.gemm import quantize_groups
    from moeserve.kernels.moe.decode_moe_fp8 import decode_down_fp8, decode_gate_up_fp8
    from moeserve.kernels.moe.fused_moe_fp8 import fused_experts_fp8

    w13, w13_s, w2, w2_s = w
    e, h = w13.shape[0], w13.shape[2]
    calls = [(x, ids, wt.view(n, k)) for x, ids, wt in (routed(n, k, e, h, ep)
                                                        for _ in range(4))]
    # gate_up on the rows quantized, as the decode step hands them over (by the router's
    # launch, or the all-to-all)
    quantized = [(quantize_groups(x, GROUP), i, wt) for x, i, wt in calls]
    t_up, up = best_in_graph("decode gate_up", lambda c: [
        lambda xq=xq, i=i: decode_gate_up_fp8(xq[0], xq[1], w13, w13_s, i.view(-1), k, 0,
                                              "silu", BLOCK, c)
        for xq, i, _ in quantized], gemv_candidates("gate_up", k))
    hs = [decode_gate_up_fp8(xq[0], xq[1], w13, w13_s, i.view(-1), k, 0, "silu", BLOCK,
                             up).clone() for xq, i, _ in quantized]
    t_down, dn = best_in_graph("decode down", lambda c: [
        lambda hb=hb, i=i, wt=wt: decode_down_fp8(hb, w2, w2_s, i.view(-1), wt.view(-1), n, k,
                                                  0, BLOCK, c, torch.bfloat16)
        for hb, (_, i, wt) in zip(hs, calls)], gemv_candidates("down", k))
    decode = {**cfg, "decode": {"gate_up": up, "down": dn}}
    # the whole paths as the decode step runs them, alternating, best of 3 (one graph of each
    # swung between runs by more than the paths differ)
    runs = [{name: graph_us([lambda xq=xq, i=i, wt=wt, c=c: fused_experts_fp8(
        xq[0], xq[1], w13, w13_s, w2, w2_s, i, wt, 0, "silu", BLOCK, c, torch.bfloat16)
        for xq, i, wt in quantized]) for name, c in (("aligned", cfg), ("gemv", decode))}
        for _ in range(3)]
    whole = {name: min(r[name] for r in runs) for name in ("aligned", "gemv")}
    print(f"  N={n} GEMV: gate_up {t_up:.1f} us {up}, down {t_down:.1f} us {dn}; whole path "
          f"(graph, quantized rows, best of 3) aligned {whole['aligned']:.1f} us, GEMV "
          f"{whole['gemv']:.1f} us", flush=True)
    return decode if whole["gemv"] < whole["aligned"] else cfg


_TUNED_AT = re.compile(r"tune-moe --fp8 on .+? at ([0-9, and]+) tokens")
_DEFAULTS = "(configs.fp8_default_config)."


def tuned_note(device: str, sizes: set[int], previous: str = "") -> str:
    """A table's note: the token counts the tuner measured (tuned_sizes reads them back), then
    the remarks the previous note made after its own such sentence (why an entry was kept)."""
    listed = [str(n) for n in sorted(sizes)]
    said = listed[0] if len(listed) == 1 else ", ".join(listed[:-1]) + " and " + listed[-1]
    kept = previous.split(_DEFAULTS, 1)[1] if _DEFAULTS in previous else ""
    return (f"Tuned by python -m benchmarks tune-moe --fp8 on {device} at {said} tokens; "
            f"the other entries are the fp8 defaults {_DEFAULTS}{kept}")


def tuned_sizes(note: str) -> set[int]:
    """The token counts a tuned_note names (none for another note)."""
    m = _TUNED_AT.search(note)
    return {int(v) for v in re.findall(r"\d+", m.group(1))} if m else set()


def run(args: Any, shapes: list[tuple[int, int, int, int]]) -> int:
    from moeserve.kernels.moe.configs import (CONFIG_DIR, config_file_name, table_dtype,
                                              validate)

    harness.require_gpu()
    out = Path(args.out or CONFIG_DIR)
    device = torch.cuda.get_device_name()
    deadline = time.monotonic() + args.time_budget
    os.makedirs(out, exist_ok=True)
    weights: dict = {}
    for n in args.tokens:
        for e, h, i, k in shapes:
            path = out / config_file_name(e, h, i, table_dtype(torch.bfloat16, BLOCK), device)
            if time.monotonic() > deadline:
                print(f"E={e} H={h} I={i} N={n}: out of --time-budget", flush=True)
                continue
            print(f"fp8 E={e} H={h} I={i} K={k} N={n} on {device} -> {path.name}", flush=True)
            if (e, h, i) not in weights:
                weights = {(e, h, i): make_weights(e, h, i)}
            table = json.loads(path.read_text()) if path.is_file() else {}
            table[str(n)] = validate(tune_size(n, k, weights[(e, h, i)], args.ep), "the tuner",
                                     GROUP)
            entries = sorted(((key, v) for key, v in table.items() if key != "note"),
                             key=lambda t: int(t[0]))
            previous = table.get("note", "")
            note = tuned_note(device, tuned_sizes(previous) | {n}, previous)
            path.write_text(json.dumps({"note": note, **dict(entries)}, indent=1) + "\n")
    return 0
