"""Reading this rank's part of a checkpoint tensor: the one family of helpers every layer (and
the loader) uses to check, slice and copy checkpoint tensors into TP / EP shards.

`src` is a full torch.Tensor, a safetensors slice (`safe_open(...).get_slice(name)`) or an
`ExpertView` of a fused expert tensor: all support `src[a:b]`, `src[:, a:b]` and `src[:]`, and
the last two read only the indexed bytes, so a rank never materialises another rank's shard.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


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
         cols: tuple[int, int] | None = None) -> torch.Tensor:
    """src[rows[0]:rows[1], cols[0]:cols[1]] (a None range keeps the whole dim)."""
    if rows is None and cols is None:
        return src if isinstance(src, torch.Tensor) else src[:]
    r0, r1 = rows if rows is not None else (0, src_shape(src)[0])
    if cols is None:
        return src[r0:r1]
    return src[r0:r1, cols[0]:cols[1]]


def copy_into(dst: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(value.shape):
        raise WeightError(f"{name!r}: shard of shape {list(value.shape)} does not fit "
                          f"{list(dst.shape)}")
    with torch.no_grad():
        dst.copy_(value.to(device=dst.device, dtype=dst.dtype))


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
