"""Rank function of test_collectives (importable by spawned ranks)."""

from __future__ import annotations

import torch

from moeserve.parallel import collectives as C
from moeserve.parallel.groups import Axis


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
