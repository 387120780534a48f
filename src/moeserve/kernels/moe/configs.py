"""Tile configs of the fused MoE kernels: tuned JSON shipped in kernels/moe/configs/, else defaults.

One file per (E_local, H, I_local, dtype, device name), written by `python -m benchmarks tune-moe`:

    E=128,H=2048,I=768,dtype=bfloat16,device=NVIDIA_H200.json
    {"1": {"BLOCK_M": 16, "gate_up": {...}, "down": {...}}, "16": {...}, ...}

keyed by token count (rows reaching the runner). A step of N rows takes the entry whose key is
nearest to N on a log scale; a shape or device with no file takes `default_config(...)`,
whose large tiles on a Hopper device (compute capability 9.x) are those the shipped H100 and
H200 tables share.
BLOCK_M is shared by both GEMMs (it is the alignment of the grouped rows); each GEMM has its
own BLOCK_N, BLOCK_K, GROUP_M, num_warps and num_stages, and optionally "TMA": 1 (its weight
tiles through a TMA descriptor on sm90+; pointer loads elsewhere), "HALF_TAIL": 1 (a block
of at most BLOCK_M / 2 rows computes a half tile; BLOCK_M >= 32, with WS >= 128) and, for
gate_up with TMA, "PAIRED": 1 (BLOCK_N rows of each half of w13 in one TMA tile and one MMA
of twice the width, in place of two MMAs) and, for down, "WS": 1 (the warp-specialised Gluon
kernel of down_ws.py on sm90, BLOCK_M >= 64; the Triton kernel elsewhere) and "ATOMIC_SUM": 1
(down adds each pair's row into its token's row of the output with atomics, in place of the
top-k sum pass: fused_moe.down_summed; the tuner tries it from 1024 tokens, so that decode
steps keep bits that do not vary between runs). An entry with a "decode"
key ({"gate_up": {BLOCK_N, BLOCK_K, num_warps}, "down": {...}}) runs that size through the
GEMV kernels of decode_moe.py instead of align + grouped GEMMs; its gate_up may set
"PREFETCH": 1 (each K step loads the next chunk's tiles first); a num_stages in a bf16
decode entry changes nothing there (decode_moe._opts).
FP8 weights (block-scaled W8A8, fused_moe_fp8.py) have tables of their own, keyed by
`fp8_w8a8_{bn}x{bk}` in place of the dtype (table_dtype), and defaults of their own
(fp8_default_config): BLOCK_K divides the scale group bk (one scale a K step) and gate_up's
BLOCK_N is a multiple of it (its epilogue quantizes whole groups); no "PAIRED"; "WS" in
gate_up or down (the warp-specialised kernels on sm90: fp8_ws.py's at BLOCK_M 64, BLOCK_K 64
or 128, fp8_ws128.py's at BLOCK_M 128, BLOCK_K 128; BLOCK_N 128, a scale group of 128, no
HALF_TAIL; the Triton kernel elsewhere); "SWAP" in gate_up or down (the Triton kernels with
the weight's rows the dot's M side and the block's rows its N side, so that blocks of 16 or
32 rows take Hopper's wgmma, whose M side is 64 a warpgroup). Their
"decode" entries run decode_moe_fp8.py's kernels, which quantize whole groups a K step: BLOCK_K
a power-of-two multiple of the group (down's: the group), BLOCK_N a power of two; no
PREFETCH. Their decode gate_up and down may set "MMA": 1 with a num_stages: the kernels whose
weight tiles are the fp8 dot's M side (BLOCK_N a power of two from 16; 64 and up run as
Hopper's wgmma), a group a K step (BLOCK_K the group, at least
kernels/fp8/tiles.MIN_GPU_BLOCK_K), on operands quantized before them: gate_up's rows, and
down's h (fp8_tiles.quantize_act's launch).
A table may carry a "note" (a string, ignored).
The folder is an argument (`config_dir`, CONFIG_DIR by default), so that a test reads tables
of its own without changing this module. Pure Python: no triton import.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any, Optional

from moeserve.kernels.fp8.tiles import MIN_GPU_BLOCK_K

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
BLOCK_MS = (16, 32, 64, 128)  # the BLOCK_M a config may take (the plan's workspaces assume it)
MIN_TILE_M = 16  # the fewest rows of an MMA tile (tl.dot)
GEMM_KEYS = ("BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
DECODE_KEYS = ("BLOCK_N", "BLOCK_K", "num_warps")


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def device_key(device_name: str) -> str:
    return "".join(c if c.isalnum() or c in "-." else "_" for c in device_name)


def table_dtype(dtype: Any, quant_block: Optional[tuple[int, int]] = None) -> str:
    """The tables' dtype key: the weights' dtype, or fp8_w8a8_{bn}x{bk} for block-scaled fp8."""
    if quant_block is None:
        return dtype_name(dtype)
    return f"fp8_w8a8_{quant_block[0]}x{quant_block[1]}"


def fp8_group(dtype_key: str) -> Optional[int]:
    """The scale group (bk) of an fp8 table's dtype key; None for other keys."""
    if not dtype_key.startswith("fp8_w8a8_"):
        return None
    return int(dtype_key.rsplit("x", 1)[1])


def config_file_name(num_local: int, hidden: int, inter: int, dtype: Any,
                     device_name: str) -> str:
    return (f"E={num_local},H={hidden},I={inter},dtype={dtype_name(dtype)},"
            f"device={device_key(device_name)}.json")


def _gemm(block_n: int, block_k: int, group_m: int, warps: int, stages: int) -> dict[str, int]:
    return dict(zip(GEMM_KEYS, (block_n, block_k, group_m, warps, stages)))


def _gemv(block_n: int, block_k: int, warps: int) -> dict[str, int]:
    return dict(zip(DECODE_KEYS, (block_n, block_k, warps)))


def decode_suits(num_tokens: int, top_k: int, num_local: int) -> bool:
    """The GEMV path without a tuned table: one row (its ids are distinct, so no expert is
    read twice), or so few pairs that two rarely share an expert (about P / 2E of them do)."""
    return num_tokens == 1 or num_tokens * top_k * 8 <= num_local


def rows_per_expert(num_tokens: int, top_k: int, num_local: int) -> float:
    """The mean rows of a used expert, every pair counted as this rank's: what the defaults
    choose their tiles by."""
    pairs = max(1, num_tokens * top_k)
    return pairs / min(num_local, pairs)


def default_config(num_tokens: int, top_k: int, num_local: int,
                   hopper: bool = False) -> dict[str, Any]:
    """By the mean rows per used expert: small tiles that spread the weight stream over many
    programs when few rows share an expert (memory-bound), large MMA tiles when many do.
    hopper (a device of compute capability 9.x): from 48 rows an expert, the tiles that every
    shipped H100 and H200 table chose there: weights by TMA, w13's halves PAIRED, and from
    192 rows down's warp-specialised kernel ("WS")."""
    rows = rows_per_expert(num_tokens, top_k, num_local)
    if hopper and rows > 48:
        return _hopper_config(rows)
    if rows <= 16:
        cfg = {"BLOCK_M": 16, "gate_up": _gemm(64, 128, 1, 4, 4),
               "down": _gemm(64, 128, 1, 4, 4)}
        if decode_suits(num_tokens, top_k, num_local):
            cfg["decode"] = decode_default(num_tokens)
        return cfg
    if rows <= 48:
        return {"BLOCK_M": 32, "gate_up": _gemm(64, 128, 1, 4, 4),
                "down": _gemm(64, 128, 1, 4, 4)}
    if rows <= 192:
        return {"BLOCK_M": 64, "gate_up": _gemm(64, 64, 8, 4, 4),
                "down": _gemm(128, 64, 8, 4, 4)}
    return {"BLOCK_M": 128, "gate_up": _gemm(128, 64, 8, 8, 3),
            "down": _gemm(128, 64, 8, 8, 4)}


def decode_default(num_tokens: int) -> dict[str, Any]:
    """The GEMV tiles most shipped bf16 tables chose (kernels/moe/configs/): gate_up 16 x 128
    with 8 warps (10 of the 12 tables with a one-row entry); down at one row 2 x 128 with 4
    warps (7 of 12; 2 columns in 8, 4 in the rest: its grid is hidden / BLOCK_N programs,
    about a thousand, where 16 columns leave a one-row step a program or less per SM), at
    more rows 16 x 128."""
    down = _gemv(2, 128, 4) if num_tokens == 1 else _gemv(16, 128, 8)
    return {"gate_up": _gemv(16, 128, 8), "down": down}


def fp8_default_config(num_tokens: int, top_k: int, num_local: int, group: int,
                       hopper: bool = False, hidden: int = 0,
                       inter: int = 0) -> dict[str, Any]:
    """The fp8 kernels' tiles: the bf16 defaults' BLOCK_M and warps (no TMA, pairing or warp
    specialisation), BLOCK_K the largest power of two up to 128 that divides the group, the
    GEMM gate_up's BLOCK_N rounded up to whole groups, the GEMV's 16 (a divisor of the group)
    where it can; from 64 rows an expert BLOCK_M 64; the GEMVs' BLOCK_K at most 64, so that a
    program's [BLOCK_N, BLOCK_K] accumulators stay in registers. hopper (compute capability
    9.x), with 128 x 128 blocks and widths `hidden` and `inter` that the warp-specialised
    kernels take: those kernels past FP8_WS_MIN_ROWS rows an expert (fp8_ws_default). Not
    tuned: `python -m benchmarks tune-moe --fp8` writes tables that replace them."""
    rows = rows_per_expert(num_tokens, top_k, num_local)
    if hopper and rows > FP8_WS_MIN_ROWS and group == FP8_WS_GROUP \
            and hidden % FP8_WS_GROUP == 0 and inter % FP8_WS_GROUP == 0 and hidden:
        return fp8_ws_default(rows, hidden)
    base = default_config(num_tokens, top_k, num_local)
    block_k = math.gcd(group, 128)

    def gemm(cfg: dict[str, int], whole: bool) -> dict[str, int]:
        out = {k: cfg[k] for k in GEMM_KEYS}
        out["BLOCK_K"] = block_k
        if whole:
            out["BLOCK_N"] = -(-cfg["BLOCK_N"] // group) * group
        return out

    if base["BLOCK_M"] >= 64:
        # gate_up's two accumulators fit [64, 256] tiles with 8 warps; at 128 rows only
        # [128, 128] ones, which time about 2x slower on H200 at 2048 and 8192 tokens
        base = {"BLOCK_M": 64, "gate_up": _gemm(256, 128, 8, 8, 3),
                "down": _gemm(128, 128, 8, 4, 3)}
    cfg: dict[str, Any] = {"BLOCK_M": base["BLOCK_M"], "gate_up": gemm(base["gate_up"], True),
                           "down": gemm(base["down"], False)}
    if "decode" in base:  # the MMA kernels (their defaults say where they measured faster)
        cfg["decode"] = {"gate_up": fp8_decode_gate_up(group), "down": fp8_decode_down(group)}
    return cfg


def fp8_decode_gate_up(group: int) -> dict[str, int]:
    """The MMA kernel with 64 weight rows a program, 4 warps and 6 stages where the group is a
    GPU dot's K (H100, one row, cold experts: Qwen3-30B-A3B's gate_up 11.8 us against the
    CUDA-core kernel's 13.5 at its tuned tiles, DeepSeek-V2-Lite's 14.8 against 17.3); else
    the CUDA-core kernel's 8 x 2 groups."""
    if group >= MIN_GPU_BLOCK_K:
        return {**_gemv(64, group, 4), "num_stages": 6, "MMA": 1}
    return _gemv(8, 2 * group, 4)


def fp8_decode_down(group: int) -> dict[str, int]:
    """The MMA kernel with 128 weight rows a program, 8 warps and 4 stages where the group is
    a GPU dot's K (H200, cold experts, its quantizer launch included, against the CUDA-core
    kernel's 8 x 1 group: Qwen3-30B-A3B at 1, 2 and 8 rows 8.6, 10.9 and 27.8 us against 9.3,
    19.3 and 72.6; DeepSeek-V2-Lite 10.3, 13.3 and 34.2 against 21.0, 41.2 and 158.7; at one
    row 64 weight rows and 4 warps took 7.7 and 9.3); else the CUDA-core kernel's 8 x 1
    group."""
    if group >= MIN_GPU_BLOCK_K:
        return {**_gemv(128, group, 8), "num_stages": 4, "MMA": 1}
    return _gemv(8, group, 8)


def _hopper_config(rows: float) -> dict[str, Any]:
    tma, paired = {"TMA": 1}, {"TMA": 1, "PAIRED": 1}
    if rows <= 192:
        return {"BLOCK_M": 64, "gate_up": {**_gemm(64, 64, 8, 4, 4), **paired},
                "down": {**_gemm(128, 64, 8, 8, 3), **tma}}
    return {"BLOCK_M": 128, "gate_up": {**_gemm(128, 64, 8, 8, 4), **paired},
            "down": {**_gemm(256, 64, 8, 8, 3), **tma, "WS": 1}}


@functools.lru_cache(maxsize=None)
def load_tuned(num_local: int, hidden: int, inter: int, dtype: str, device_name: str,
               config_dir: Path = CONFIG_DIR) -> Optional[dict[int, dict[str, Any]]]:
    path = config_dir / config_file_name(num_local, hidden, inter, dtype, device_name)
    if not path.is_file():
        return None
    table = json.loads(path.read_text())
    group = fp8_group(dtype)
    return {int(k): validate(v, str(path), group) for k, v in table.items() if k != "note"}


def fp8_tile_problems(cfg: dict[str, Any], group: int, whole_groups: bool,
                      decode: bool = False) -> list[str]:
    """What breaks the fp8 rules in one kernel's tiles: BLOCK_K must divide the scale group
    (one scale a K step), or (decode: the decode kernels, which quantize whole groups a step)
    be a power-of-two multiple of it, with BLOCK_N a power of two; a tile that quantizes its
    output (whole_groups) holds whole groups (BLOCK_N a multiple of the group); no PAIRED or
    decode PREFETCH; WS (fp8_ws.py) with its fixed tiles."""
    bad = []
    n, k = cfg["BLOCK_N"], cfg["BLOCK_K"]
    if cfg.get("MMA"):  # the MMA decode kernels: a group a step, the dot's M side
        if k != group:
            bad.append(f"BLOCK_K {k} is not the scale group {group} (MMA takes a group a step)")
        if n < 16 or n & (n - 1):
            bad.append(f"BLOCK_N {n} is not a power of two from 16 (MMA)")
        if "num_stages" not in cfg:
            bad.append("sets MMA without num_stages")
    elif decode:
        groups = k // group if k % group == 0 else 0
        if groups < 1 or groups & (groups - 1):
            bad.append(f"BLOCK_K {k} is not a power-of-two multiple of the scale group {group}")
        if n < 1 or n & (n - 1):
            bad.append(f"BLOCK_N {n} is not a power of two")
    elif group % k:
        bad.append(f"BLOCK_K {k} does not divide the scale group {group}")
    if whole_groups and n % group:
        bad.append(f"BLOCK_N {n} is not a multiple of the scale group {group}")
    if cfg.get("PAIRED"):
        bad.append("sets PAIRED, which has no fp8 kernel")
    if cfg.get("WS"):
        bad += ws_tile_problems(cfg, group, decode)
    if cfg.get("SWAP") and (decode or cfg.get("WS") or cfg.get("MMA")):
        bad.append("sets SWAP, which only the Triton grouped GEMMs take")
    if decode and cfg.get("PREFETCH"):
        bad.append("sets PREFETCH, which has no fp8 kernel")
    return bad


FP8_WS_BLOCK = (64, 128)  # (BLOCK_M, BLOCK_N) of fp8_ws.py's kernels
FP8_WS_GROUP = 128  # the scale blocks they take, 128 x 128
FP8_WS_BLOCK_MS = (64, 128)  # BLOCK_M 128: fp8_ws128.py's, BLOCK_K 128
# rows an expert past which the fp8 defaults take the warp-specialised kernels on Hopper, and
# past which their 128-row blocks (fp8_ws_default says where these come from)
FP8_WS_MIN_ROWS, FP8_WS128_MIN_ROWS = 24, 128


def fp8_ws_default(rows: float, hidden: int) -> dict[str, Any]:
    """The warp-specialised kernels' entry for `rows` rows an expert: 64-row blocks, from
    FP8_WS128_MIN_ROWS 128-row ones where the hidden size is a multiple of 256 (fp8_ws128's
    down tiles). What the tuned H200 tables chose: Qwen3-30B-A3B (E 128, H 2048, I 768) and
    DeepSeek-V2-Lite (E 64, H 2048, I 1408) take them from 32 and 24 rows an expert, and
    DeepSeek-V3's experts on one of 8 EP ranks (E 32, H 7168, I 2048; gate_up + down, graph
    replays) from 32 (398 against 572 us with the Triton kernels' 32-row blocks; at 8 rows
    an expert 391 against 369 with 16-row ones); 128-row blocks from 128 rows an expert
    (DeepSeek-V3: 734 against 745 us with 64-row blocks, at 256 rows 1072 against 1195),
    192 and 256 (the H 2048 tables). Stages and K steps: the tables' most frequent; no
    ATOMIC_SUM (a decode step's bits stay the same run to run)."""
    block_m = 128 if rows > FP8_WS128_MIN_ROWS and hidden % 256 == 0 else 64
    ws = {"BLOCK_N": FP8_WS_BLOCK[1], "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "WS": 1}
    return {"BLOCK_M": block_m, "gate_up": {**ws, "num_stages": 4},
            "down": {**ws, "num_stages": 3 if block_m == 64 else 4}}


def ws_tile_problems(cfg: dict[str, Any], group: int, decode: bool) -> list[str]:
    """What keeps an fp8 GEMM config with "WS" from the warp-specialised kernels' fixed tiles
    (BLOCK_M: validate_fp8)."""
    if decode:
        return ["sets WS, which only the grouped GEMMs take"]
    bad = [] if group == FP8_WS_GROUP else [
        f"sets WS with scale group {group} (WS: {FP8_WS_GROUP})"]
    if cfg["BLOCK_N"] != FP8_WS_BLOCK[1]:
        bad.append(f"sets WS with BLOCK_N {cfg['BLOCK_N']} (WS: {FP8_WS_BLOCK[1]})")
    if cfg["BLOCK_K"] not in (64, 128):
        bad.append(f"sets WS with BLOCK_K {cfg['BLOCK_K']} (WS: 64 or 128)")
    if cfg.get("HALF_TAIL"):
        bad.append("sets WS with HALF_TAIL, which the fp8 WS kernels lack")
    return bad


def validate_fp8(cfg: dict[str, Any], where: str, group: int) -> None:
    """The fp8 kernels' constraints (fp8_tiles.check_tiles checks them again at launch)."""
    kernels = [("gate_up", cfg["gate_up"], True, False), ("down", cfg["down"], False, False)]
    kernels += [(f"decode.{g}", cfg["decode"][g], False, True) for g in cfg.get("decode", ())]
    bad = [f"{name}.{p}" if p[0].isupper() else f"{name} {p}"
           for name, c, whole, decode in kernels
           for p in fp8_tile_problems(c, group, whole, decode)]
    bad += [f"{name} sets MMA, which only the decode kernels take"
            for name, c, _, _ in kernels if c.get("MMA") and not name.startswith("decode.")]
    ws = [name for name, c, _, _ in kernels[:2] if c.get("WS")]
    if ws and cfg["BLOCK_M"] not in FP8_WS_BLOCK_MS:
        bad.append(f"a GEMM sets WS with BLOCK_M {cfg['BLOCK_M']} (WS: 64 or 128)")
    if cfg["BLOCK_M"] == 128:  # fp8_ws128.py: a scale group a stage
        bad += [f"{name} sets WS with BLOCK_K {cfg[name]['BLOCK_K']} at BLOCK_M 128 (WS: 128)"
                for name in ws if cfg[name]["BLOCK_K"] != 128]
    if bad:
        raise ValueError(f"fp8 MoE tile config in {where}: {'; '.join(bad)}; re-run "
                         "python -m benchmarks tune-moe --fp8")


def validate(cfg: dict[str, Any], where: str, group: Optional[int] = None) -> dict[str, Any]:
    """group: the scale group of an fp8 table (None: a bf16 one)."""
    missing = [k for k in ("BLOCK_M", "gate_up", "down") if k not in cfg]
    missing += [f"{g}.{k}" for g in ("gate_up", "down") if g in cfg
                for k in GEMM_KEYS if k not in cfg[g]]
    if "decode" in cfg:
        missing += [f"decode.{g}.{k}" for g in ("gate_up", "down")
                    for k in DECODE_KEYS if k not in cfg["decode"].get(g, {})]
    if missing:
        raise ValueError(f"MoE tile config in {where} lacks {', '.join(missing)}; "
                         "re-run python -m benchmarks tune-moe")
    if cfg["BLOCK_M"] not in BLOCK_MS:
        raise ValueError(f"MoE tile config in {where} has BLOCK_M {cfg['BLOCK_M']}, not one of "
                         f"{BLOCK_MS} (the plan sizes the runner's workspace for those); "
                         "re-run python -m benchmarks tune-moe")
    half = [g for g in ("gate_up", "down") if cfg[g].get("HALF_TAIL")]
    if half and cfg["BLOCK_M"] < 2 * MIN_TILE_M:
        raise ValueError(f"MoE tile config in {where} sets HALF_TAIL for {', '.join(half)} with "
                         f"BLOCK_M {cfg['BLOCK_M']}: a half tile needs BLOCK_M >= "
                         f"{2 * MIN_TILE_M}; drop HALF_TAIL or re-run "
                         "python -m benchmarks tune-moe")
    if cfg["down"].get("PAIRED") or (cfg["gate_up"].get("PAIRED")
                                     and not cfg["gate_up"].get("TMA")):
        raise ValueError(f"MoE tile config in {where} sets PAIRED where it has no meaning: "
                         "only gate_up with TMA pairs the two halves of w13; drop it or "
                         "re-run python -m benchmarks tune-moe")
    if group is None and (cfg["gate_up"].get("WS") or (cfg["down"].get("WS")
                                                        and cfg["BLOCK_M"] < 64)):
        raise ValueError(f"MoE tile config in {where} sets WS where it cannot run: the "
                         "warp-specialised kernel is down's, with BLOCK_M >= 64 (a wgmma "
                         "tile of 64 rows a warpgroup); drop it or re-run "
                         "python -m benchmarks tune-moe")
    if group is None and any(cfg[g].get("SWAP") for g in ("gate_up", "down")):
        raise ValueError(f"MoE tile config in {where} sets SWAP in a bf16 table: only the fp8 "
                         "grouped GEMMs put the weight on the dot's M side; drop it or re-run "
                         "python -m benchmarks tune-moe")
    if cfg["gate_up"].get("ATOMIC_SUM"):
        raise ValueError(f"MoE tile config in {where} sets ATOMIC_SUM for gate_up: only down "
                         "sums the top-k; drop it or re-run python -m benchmarks tune-moe")
    elsewhere = [g for g in ("gate_up", "down") if cfg[g].get("PREFETCH")]
    elsewhere += ["decode.down"] if cfg.get("decode", {}).get("down", {}).get("PREFETCH") else []
    if elsewhere:
        raise ValueError(f"MoE tile config in {where} sets PREFETCH for {', '.join(elsewhere)}: "
                         "only the decode gate_up GEMV takes it; drop it or re-run "
                         "python -m benchmarks tune-moe")
    if group is not None:
        validate_fp8(cfg, where, group)
    elif any(c.get("MMA") for c in cfg.get("decode", {}).values()):
        raise ValueError(f"MoE tile config in {where} sets MMA for a decode kernel of a "
                         "bf16 table: only fp8's have that kernel; drop it or re-run "
                         "python -m benchmarks tune-moe")
    return cfg


def max_blocks(num_pairs: int, block_m: int, num_local: int) -> int:
    """Blocks of block_m rows that the pairs of one step can fill at most: each expert's last
    block may be partly empty."""
    if num_pairs == 0:
        return 0
    return min(num_pairs, -(-num_pairs // block_m) + num_local)


# pairs a program of align's large path counts and scatters; a round of its one program
ALIGN_CHUNK = 1024
ROUTE_BLOCK = 1024  # rows (and slots) of a route_slots program (kernels/moe/exchange.py)


def route_blocks(rows: int) -> int:
    """The blocks of ROUTE_BLOCK rows that route_slots counts for `rows` rows (its counts'
    width, the plan's a2a.route_counts)."""
    return -(-rows // ROUTE_BLOCK)


def align_scratch_len(num_pairs: int, num_local: int) -> int:
    """int32 words align.py takes: counts per (padded) expert, and each chunk of ALIGN_CHUNK
    pairs' start within every expert's segment (the one-program path uses the first E_PAD
    words, its cursors)."""
    e_pad = max(16, 1 << max(num_local - 1, 0).bit_length())
    return (1 + -(-num_pairs // ALIGN_CHUNK)) * e_pad


def padded_rows(num_pairs: int, num_local: int) -> int:
    """The most grouped rows (blocks x BLOCK_M) a step of num_pairs pairs takes, any BLOCK_M."""
    return max(max_blocks(num_pairs, m, num_local) * m for m in BLOCK_MS)


def nearest(table: dict[int, dict[str, Any]], num_tokens: int) -> dict[str, Any]:
    target = math.log2(max(num_tokens, 1))
    return table[min(table, key=lambda k: (abs(math.log2(max(k, 1)) - target), k))]


def get_config(num_tokens: int, top_k: int, num_local: int, hidden: int, inter: int,
               dtype: Any, device_name: str, capability: Optional[tuple[int, int]] = None,
               config_dir: Path = CONFIG_DIR,
               quant_block: Optional[tuple[int, int]] = None) -> dict[str, Any]:
    """The tuned entry for this shape and device, else the defaults (for the device's compute
    capability when given); quant_block: fp8 weights with these scale blocks."""
    table = load_tuned(num_local, hidden, inter, table_dtype(dtype, quant_block), device_name,
                       config_dir)
    if table:
        return nearest(table, num_tokens)
    hopper = capability is not None and capability[0] == 9
    if quant_block is not None:
        return fp8_default_config(num_tokens, top_k, num_local, quant_block[1], hopper, hidden,
                                  inter)
    return default_config(num_tokens, top_k, num_local, hopper=hopper)


def tiles_source(num_local: int, hidden: int, inter: int, dtype: Any,
                 device_name: Optional[str], quant_block: Optional[tuple[int, int]] = None,
                 config_dir: Path = CONFIG_DIR) -> str:
    """Where a runner's tiles come from, for `moeserve plan`: the tuned table of this shape
    and device, or the defaults (naming the table that `tune-moe` would write)."""
    dtype_key = table_dtype(dtype, quant_block)
    if device_name is None:
        return (f"the tuned table of E={num_local},H={hidden},I={inter},dtype={dtype_key} for "
                "the GPU it runs on, else defaults (no GPU here)")
    name = config_file_name(num_local, hidden, inter, dtype_key, device_name)
    if load_tuned(num_local, hidden, inter, dtype_key, device_name, config_dir):
        return f"tuned ({name})"  # (get_config's test: a table with entries)
    return (f"defaults: no tuned table {name} (`python -m benchmarks tune-moe"
            f"{' --fp8' if quant_block else ''}` writes it)")


def _last_rows(table: dict[int, dict[str, Any]], max_rows: int, takes: Any) -> int:
    """The most rows (at most max_rows) whose nearest entry `takes` holds for, 0 for none
    (nearest is monotone in rows)."""
    if takes(nearest(table, max_rows)):
        return max_rows
    below = [k for k in sorted(table) if k < max_rows and takes(table[k])]
    if not below:
        return 0
    # the last row count whose nearest entry is that key
    lo, hi = below[-1], max_rows
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if nearest(table, mid) is table[below[-1]] else (lo, mid)
    return lo


def rows_writing_pairs(max_rows: int, num_local: int, hidden: int, inter: int, dtype: Any,
                       device_name: Optional[str], config_dir: Path = CONFIG_DIR,
                       quant_block: Optional[tuple[int, int]] = None) -> int:
    """The most rows (at most max_rows) of a step whose config writes every pair's row to a
    [P, H] buffer (the plan's moe.runner.down): a step whose tuned entry has down sum the
    top-k (ATOMIC_SUM) writes none. max_rows where the device (None: unknown) has no table."""
    table = load_tuned(num_local, hidden, inter, table_dtype(dtype, quant_block),
                       device_name or "", config_dir)
    if not table:
        return max_rows
    return _last_rows(table, max_rows, lambda c: not c["down"].get("ATOMIC_SUM"))


def gemv_rows(max_rows: int, top_k: int, num_local: int, hidden: int, inter: int, dtype: Any,
              device_name: Optional[str], config_dir: Path = CONFIG_DIR,
              quant_block: Optional[tuple[int, int]] = None) -> int:
    """The most rows (at most max_rows) of a step that takes the GEMV path (an entry with
    "decode"): by the device's table, else (None: unknown device) by the defaults."""
    table = load_tuned(num_local, hidden, inter, table_dtype(dtype, quant_block),
                       device_name or "", config_dir)
    if table:
        return _last_rows(table, max_rows, lambda c: "decode" in c)
    return min(max_rows, max(1, num_local // (8 * top_k)))  # decode_suits' largest


def warm_up_sizes(max_tokens: int, top_k: int, num_local: int, hidden: int, inter: int,
                  dtype: Any, device_name: str, capability: Optional[tuple[int, int]] = None,
                  config_dir: Path = CONFIG_DIR,
                  quant_block: Optional[tuple[int, int]] = None) -> list[int]:
    """One token count per distinct config that a step of 1..max_tokens rows can take (the
    smallest among the tuned sizes, the powers of two and max_tokens): running the kernels
    once at each compiles every config before the first request needs it."""
    table = load_tuned(num_local, hidden, inter, table_dtype(dtype, quant_block), device_name,
                       config_dir) or {}
    sizes = {1 << b for b in range(max_tokens.bit_length())} | set(table) | {max_tokens}
    first: dict[str, int] = {}
    for n in sorted(s for s in sizes if 1 <= s <= max_tokens):
        cfg = get_config(n, top_k, num_local, hidden, inter, dtype, device_name, capability,
                         config_dir, quant_block)
        first.setdefault(json.dumps(cfg, sort_keys=True), n)
    return sorted(first.values())
