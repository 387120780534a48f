"""Reading this rank's part of a checkpoint tensor: the one family of helpers every layer (and
the loader) uses to check, slice and copy checkpoint tensors into TP / EP shards.

`src` is a full torch.Tensor, a safetensors slice (`safe_open(...).get_slice(name)`) or an
`ExpertView` of a fused expert tensor: all support `src[a:b]`, `src[:, a:b]` and `src[:]`, and
the last two read only the indexed bytes, so a rank never materialises another rank's shard.

FP8 (config/quant.py): a quantized checkpoint tensor comes as an `Fp8Source`, its fp8 weight
and its `weight_scale_inv` sliced together (`read` gives an `Fp8Shard`, refusing a range that
splits a scale block); a quantized parameter is a `QuantParam`, its fp8 weight and its scale
indexed together (rows of whole blocks). `copy_into` takes any pair: an fp8 shard into a
QuantParam as it is, a float tensor into a QuantParam quantized per block (--quantization fp8),
an fp8 shard into a float parameter dequantized (a layer that keeps the checkpoint's dtype).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from moeserve.kernels.fp8 import reference as fp8


class WeightError(ValueError):
    """A checkpoint tensor has an unexpected name or shape."""


def src_shape(src: Any) -> tuple[int, ...]:
    return tuple(src.get_shape()) if hasattr(src, "get_shape") else tuple(src.shape)


def expect_shape(name: str, src: Any, want: Sequence[int]) -> None:
    if src_shape(src) != tuple(want):
        raise WeightError(f"checkpoint tensor {name!r} has shape {list(src_shape(src))}, "
                          f"expected {list(want)}: the checkpoint does not match config.json")


def shard_range(rank: int, local: int) -> tuple[int, int]:
    """The [start, end) range of rank `rank` when each rank holds `local` entries of a dim."""
    return rank * local, (rank + 1) * local


def read(src: Any, rows: tuple[int, int] | None = None,
         cols: tuple[int, int] | None = None) -> Any:
    """src[rows[0]:rows[1], cols[0]:cols[1]] (a None range keeps the whole dim); an Fp8Shard
    from an Fp8Source."""
    if isinstance(src, Fp8Source):
        return src.read(rows, cols)
    if rows is None and cols is None:
        return src if isinstance(src, torch.Tensor) else src[:]
    r0, r1 = rows if rows is not None else (0, src_shape(src)[0])
    if cols is None:
        return src[r0:r1]
    return src[r0:r1, cols[0]:cols[1]]


def copy_into(dst: "torch.Tensor | QuantParam", value: "torch.Tensor | Fp8Shard",
              name: str) -> None:
    if tuple(dst.shape) != tuple(value.shape):
        raise WeightError(f"{name!r}: shard of shape {list(value.shape)} does not fit "
                          f"{list(dst.shape)}")
    if isinstance(dst, QuantParam):
        if isinstance(value, Fp8Shard):
            if value.block != dst.block:
                raise WeightError(f"{name!r}: checkpoint blocks {value.block} are not the "
                                  f"model's {dst.block}")
            q, scale = value.q, value.scale
        else:  # quantized at load, per block of this shard (whole blocks of the full tensor)
            q, scale = fp8.quantize_blocks(value.to(device=dst.weight.device), dst.block)
        if tuple(scale.shape) != tuple(dst.scale.shape):
            raise WeightError(f"{name!r}: scale of shape {list(scale.shape)} does not fit "
                              f"{list(dst.scale.shape)}")
        with torch.no_grad():
            dst.weight.copy_(q.to(device=dst.weight.device))
            dst.scale.copy_(scale.to(device=dst.scale.device, dtype=dst.scale.dtype))
        return
    if isinstance(value, Fp8Shard):  # a layer that keeps the checkpoint's dtype
        value = fp8.dequantize_blocks(value.q, value.scale, value.block)
    with torch.no_grad():
        dst.copy_(value.to(device=dst.device, dtype=dst.dtype))


# --- FP8 ----------------------------------------------------------------------------------

def _check_range(what: str, span: tuple[int, int], full: int, block: int, dim: str) -> None:
    start, end = span
    if start % block or (end % block and end != full):
        raise WeightError(
            f"{what}: the {dim} [{start}, {end}) of this rank's shard of {full} split a "
            f"{block}-wide fp8 scale block: every shard must start and end on a multiple of "
            f"{block}; choose a --tp-size / --ep-size that divides the {dim} into multiples of "
            f"{block}")


def check_shard_blocks(what: str, full: int, local: int, ranks: int, block: int) -> None:
    """A weight dim of `full` split over `ranks` ranks, `local` each, must keep whole scale
    blocks: the startup check of a layer with fp8 weights."""
    if ranks > 1 and local % block:
        raise WeightError(
            f"{what}: {full} split over {ranks} ranks is {local} per rank, which splits a "
            f"{block}-wide fp8 scale block; choose --tp-size / --ep-size so that {full} / ranks "
            f"is a multiple of {block}, or serve unquantized weights")


def check_segments(what: str, sizes: Sequence[int], block: int) -> None:
    """Outputs stacked in one fp8 weight (q, k, v; gate, up) share its scale rows: each but
    the last must fill whole blocks."""
    for i, size in enumerate(sizes[:-1]):
        if size % block:
            raise WeightError(
                f"{what}: part {i} of the stacked outputs {list(sizes)} has {size} rows per "
                f"rank, not a multiple of the {block}-row fp8 scale block, so the parts after "
                "it would share its blocks; serve unquantized weights or another --tp-size")


class Fp8Shard:
    """A rank's part of a quantized checkpoint tensor: q [rows, cols] fp8 and its scale
    [ceil(rows/bn), ceil(cols/bk)]."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]):
        self.q, self.scale, self.block = q, scale.float(), block
        self.shape = tuple(q.shape)


class Fp8Source:
    """A quantized checkpoint tensor [N, K] (float8_e4m3fn) and its weight_scale_inv
    [ceil(N/bn), ceil(K/bk)], each a tensor, safetensors slice or ExpertView."""

    def __init__(self, weight: Any, scale: Any, block: tuple[int, int], name: str = "weight"):
        self.weight, self.scale, self.block, self.name = weight, scale, block, name
        n, k = src_shape(weight)
        want = (-(-n // block[0]), -(-k // block[1]))
        if src_shape(scale) != want:
            raise WeightError(f"{name}_scale_inv has shape {list(src_shape(scale))}, but a "
                              f"{n} x {k} weight in {block[0]}x{block[1]} blocks has "
                              f"{list(want)} scales")

    def get_shape(self) -> list[int]:
        return list(src_shape(self.weight))

    def read(self, rows: tuple[int, int] | None, cols: tuple[int, int] | None) -> Fp8Shard:
        n, k = src_shape(self.weight)
        (bn, bk), rows, cols = self.block, rows or (0, n), cols or (0, k)
        _check_range(self.name, rows, n, bn, "rows")
        _check_range(self.name, cols, k, bk, "columns")
        q = read(self.weight, rows, cols)
        if q.dtype != fp8.FP8:
            raise WeightError(f"{self.name} is {q.dtype}, but it has a weight_scale_inv: a "
                              "quantized weight is float8_e4m3fn")
        scale = read(self.scale, (rows[0] // bn, -(-rows[1] // bn)),
                     (cols[0] // bk, -(-cols[1] // bk)))
        return Fp8Shard(q, scale, self.block)


class DequantizedSource:
    """An Fp8Source read as floats (for a layer that keeps the checkpoint's dtype): a slice
    reads the whole scale blocks it touches, dequantizes them and keeps the slice, so any
    shard boundary works."""

    def __init__(self, src: Fp8Source):
        self.src = src

    def get_shape(self) -> list[int]:
        return self.src.get_shape()

    def __getitem__(self, idx: Any) -> torch.Tensor:
        idx = idx if isinstance(idx, tuple) else (idx,)
        idx = idx + (slice(None),) * (2 - len(idx))
        (bn, bk), shape = self.src.block, self.get_shape()
        spans = [sl.indices(n)[:2] for sl, n in zip(idx, shape)]
        outer = [(a // b * b, min(n, -(-e // b) * b)) for (a, e), b, n in
                 zip(spans, (bn, bk), shape)]
        shard = self.src.read(*outer)
        full = fp8.dequantize_blocks(shard.q, shard.scale, shard.block)
        (r0, r1), (c0, c1) = ((a - o, e - o) for (a, e), (o, _) in zip(spans, outer))
        return full[r0:r1, c0:c1]


def as_float(src: Any) -> Any:
    """`src` for a destination in a float dtype: an Fp8Source is dequantized as it is read."""
    return DequantizedSource(src) if isinstance(src, Fp8Source) else src


class QuantParam:
    """A quantized parameter: its fp8 weight [..., N, K] and float32 scale [..., ceil(N/bn),
    ceil(K/bk)], indexed together: an int picks a leading entry (an expert), a slice picks
    rows that start on a block boundary."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]):
        self.weight, self.scale, self.block = weight, scale, block

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def __getitem__(self, idx: Any) -> "QuantParam":
        if isinstance(idx, int):
            return QuantParam(self.weight[idx], self.scale[idx], self.block)
        start, stop, step = idx.indices(self.weight.shape[-2])
        bn = self.block[0]
        assert step == 1 and start % bn == 0, f"rows {start}:{stop} split a {bn}-row block"
        return QuantParam(self.weight[start:stop], self.scale[start // bn: -(-stop // bn)],
                          self.block)


def quant_param(weight: torch.nn.Parameter, scale: Optional[torch.nn.Parameter],
                block: Optional[tuple[int, int]]) -> "torch.Tensor | QuantParam":
    """The destination of a weight: the QuantParam of an fp8 weight, else the tensor."""
    return weight if scale is None else QuantParam(weight, scale, block)


def scale_param(*shape: int, block: tuple[int, int]) -> torch.nn.Parameter:
    """The float32 block scales of a weight of `shape` [..., N, K]."""
    *lead, n, k = shape
    return empty_param(*lead, -(-n // block[0]), -(-k // block[1]), dtype=torch.float32)


def load_gated_mlp(proj: str, name: str, src: Any, w13: torch.Tensor, w2: torch.Tensor, *,
                   intermediate: int, rank: int) -> bool:
    """Load `proj` ("gate_proj", "up_proj" or "down_proj", full [I, H] / [H, I] tensors) into
    rank `rank`'s shard of a gated MLP: w13 [2 I_local, H] (gate rows, then up rows) and
    w2 [H, I_local]. False for another name, for the caller to reject with its own list."""
    hidden, i_local = w2.shape
    rows = shard_range(rank, i_local)
    if proj in ("gate_proj", "up_proj"):
        expect_shape(name, src, (intermediate, hidden))
        half = slice(0, i_local) if proj == "gate_proj" else slice(i_local, None)
        copy_into(w13[half], read(src, rows=rows), name)
    elif proj == "down_proj":
        expect_shape(name, src, (hidden, intermediate))
        copy_into(w2, read(src, cols=rows), name)
    else:
        return False
    return True


class ExpertView:
    """Expert `e` of a fused [E, R, C] tensor, rows [row0, row0 + rows): sliceable like a
    safetensors slice (`v[a:b]`, `v[:, a:b]`, `v[:]`), reading only the requested part."""

    def __init__(self, fused: Any, e: int, row0: int, rows: int, cols: int):
        self.fused, self.e, self.row0, self.shape = fused, e, row0, (rows, cols)

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, idx: Any) -> torch.Tensor:
        idx = idx if isinstance(idx, tuple) else (idx,)
        idx = idx + (slice(None),) * (2 - len(idx))
        (r0, r1, rs), (c0, c1, cs) = (i.indices(n) for i, n in zip(idx, self.shape))
        assert rs == 1 and cs == 1, "expert views support contiguous slices only"
        return self.fused[self.e, self.row0 + r0:self.row0 + r1, c0:c1]


def empty_param(*shape: int, dtype: torch.dtype) -> torch.nn.Parameter:
    """An uninitialised weight on the current default device (meta under `torch.device`)."""
    return torch.nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
