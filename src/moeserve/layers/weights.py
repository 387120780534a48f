"""Reading this rank's part of a checkpoint tensor for the MoE and MLP blocks.

`src` is a full torch.Tensor or a safetensors slice (`safe_open(...).get_slice(name)`): both
support `src[a:b]`, `src[:, a:b]` and `src[:]`, and a slice reads only the indexed bytes, so a
rank never materialises another rank's shard.
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


def empty_param(*shape: int, dtype: torch.dtype) -> torch.nn.Parameter:
    """An uninitialised weight on the current default device (meta under `torch.device`)."""
    return torch.nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
