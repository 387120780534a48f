"""Rank function of test_collectives (importable by spawned ranks)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from moeserve.parallel import collectives as C
from moeserve.parallel.groups import Axis
from moeserve.parallel.symm_comm import SymmetricCollectives


def run_collectives(rank: int, world: int, size_lists: list[list[int]]) -> list[dict]:
    axis = Axis(torch.distributed.group.WORLD, rank, world, tuple(range(world)))
    out = []
    for case, sizes in enumerate(size_lists):
        def block(r: int, what: int) -> torch.Tensor:
            g = torch.Generator().manual_seed(1000 * case + 10 * r + what)
            return torch.randn(sizes[r], 3, 2, generator=g, dtype=torch.float64)

        gathered = C.all_gather_uneven(block(rank, 0), sizes, axis)
        want = torch.cat([block(r, 0) for r in range(world)])
        # every rank contributes a full [sum, ...] tensor; rank r keeps the sum of block r
        contrib = torch.cat([block(r, 1 + rank) for r in range(world)])
        scattered = C.reduce_scatter_uneven(contrib, sizes, axis)
        want_rs = sum(block(rank, 1 + src) for src in range(world))
        out.append(dict(case=case, gather_ok=torch.equal(gathered, want),
                        gather_shape=tuple(gathered.shape),
                        rs_err=(scattered - want_rs).abs().max().item() if sizes[rank] else 0.0,
                        rs_shape=tuple(scattered.shape)))
    # fixed-capacity all-to-all: block p of rank r carries (r, p) in every slot
    cap = 3
    send = torch.empty(world, cap, 4, dtype=torch.uint8)
    for p in range(world):
        send[p] = 10 * rank + p
    recv = torch.zeros_like(send)
    C.all_to_all_fixed(recv, send, axis)
    out.append(dict(case="a2a", a2a_ok=all(bool((recv[p] == 10 * p + rank).all())
                                            for p in range(world))))
    x = torch.full((2, 2), float(rank + 1))
    out.append(dict(case="all_reduce", value=C.all_reduce(x, axis)[0, 0].item()))
    return out


@dataclass(frozen=True)
class SpyCollectives(SymmetricCollectives):
    """A window of `window_bytes` on a CPU axis: records each collective it is handed (what the
    rule chose) and does it on gloo, into the output the caller gives."""

    calls: list

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(("all_reduce", x.numel() * x.element_size()))
        torch.distributed.all_reduce(x, group=self.axis.group)
        return x

    def all_reduce_add_rms_norm(self, y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The all-reduce, then RMSNorm.add_forward's torch arithmetic."""
        self.calls.append(("all_reduce_add_rms_norm", y.numel() * y.element_size()))
        torch.distributed.all_reduce(y, group=self.axis.group)
        total = x + y
        t32 = total.float()
        normed = (t32 * torch.rsqrt(t32.pow(2).mean(-1, keepdim=True) + eps)).to(total.dtype)
        return weight * normed, total

    def all_gather(self, x_R: torch.Tensor, sizes: list[int], out_N: torch.Tensor) -> None:
        self.calls.append(("all_gather", out_N.numel() * out_N.element_size()))
        out_N.copy_(C.all_gather_uneven(x_R, sizes, self.axis))

    def reduce_scatter(self, y_N: torch.Tensor, sizes: list[int],
                       out_R: torch.Tensor) -> None:
        self.calls.append(("reduce_scatter", y_N.numel() * y_N.element_size()))
        out_R.copy_(C.reduce_scatter_uneven(y_N, sizes, self.axis))


def run_choice(rank: int, world: int, window_bytes: int, rows: list[int]) -> list[dict]:
    """Each collective at `rows` rows of 8 fp32 (32 bytes a row) in total, with and without the
    spy: which path took it, and whether both give the same result."""
    axis = Axis(torch.distributed.group.WORLD, rank, world, tuple(range(world)))
    window = SimpleNamespace(local=torch.empty(window_bytes, dtype=torch.uint8))
    spy = SpyCollectives(window, axis, [])
    out = []
    for n in rows:
        sizes = [n // world + (r < n % world) for r in range(world)]
        g = torch.Generator().manual_seed(n * 10 + rank)
        x = torch.randn(sizes[rank], 8, generator=g)
        y = torch.randn(n, 8, generator=g)
        buffer = torch.empty(n * 32 + 64, dtype=torch.uint8)  # a plan's gather buffer
        got = {"all_gather": C.all_gather_uneven(x, sizes, axis, buffer, spy),
               "reduce_scatter": C.reduce_scatter_uneven(y, sizes, axis, spy),
               "all_reduce": C.all_reduce(y.clone(), axis, spy)}
        want = {"all_gather": C.all_gather_uneven(x, sizes, axis),
                "reduce_scatter": C.reduce_scatter_uneven(y, sizes, axis),
                "all_reduce": C.all_reduce(y.clone(), axis)}
        out.append(dict(rows=n, calls=list(spy.calls),
                        equal={k: torch.equal(got[k], want[k]) for k in got},
                        gathered_into_buffer=got["all_gather"].data_ptr() == buffer.data_ptr()))
        spy.calls.clear()
    return out
