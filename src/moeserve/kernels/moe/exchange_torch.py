"""The one-sided all-to-all's slot tables and sums in torch (exchange.py has the layout and
the Triton kernels): the CPU's path, and the reference the tests hold the kernels to."""

from __future__ import annotations

from typing import Optional

import torch


def route_slots(ids_MK: torch.Tensor, slots_MP: torch.Tensor, sources_PR: torch.Tensor,
                experts_per_rank: int) -> None:
    """As exchange.route_slots: slots in row order per destination, -1 where none."""
    m = ids_MK.shape[0]
    p, r = sources_PR.shape
    valid = ids_MK >= 0
    dest_MK = torch.where(valid, ids_MK.long() // experts_per_rank, p)
    goes_MP = torch.zeros(m, p + 1, dtype=torch.bool, device=ids_MK.device)
    goes_MP = goes_MP.scatter_(1, dest_MK, True)[:, :p]  # column p collects the -1 ids
    slot_MP = goes_MP.long().cumsum(dim=0) - 1
    slots_MP.copy_(torch.where(goes_MP, slot_MP, -1))
    flat = torch.where(goes_MP, torch.arange(p, device=ids_MK.device) * r + slot_MP, p * r)
    sources = torch.full((p * r + 1,), -1, dtype=torch.long, device=ids_MK.device)
    rows = torch.arange(m, device=ids_MK.device)[:, None].expand(m, p)
    sources.scatter_(0, flat.reshape(-1), rows.reshape(-1))
    sources_PR.copy_(sources[: p * r].view(p, r))


def window_offsets(p: int, r: int, h: int, k: int, elem_bytes: int, groups: int = 0
                   ) -> tuple[int, int, int]:
    """Where the scales, the ids and the weights start in a recv window laid out for P x R
    slots: x [P R, H] of elem_bytes each, then (fp8 rows) float32 scales [P R, groups], then
    int32 ids [P R, K], then float32 weights [P R, K]."""
    scales_at = p * r * h * elem_bytes
    ids_at = scales_at + p * r * groups * 4
    return scales_at, ids_at, ids_at + p * r * k * 4


def rows_for(x_MH: torch.Tensor, ids_MK: torch.Tensor, weights_MK: torch.Tensor,
             sources_PR: torch.Tensor, experts_per_rank: int,
             x_scale_MG: Optional[torch.Tensor] = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """What exchange.push_rows stores into each destination p: [P, R, H] rows (zeros in empty
    slots), [P, R, K] ids masked to p's experts (-1 in empty slots), [P, R, K] weights, and
    with fp8 rows their [P, R, G] scales (None without)."""
    p, r = sources_PR.shape
    m = x_MH.shape[0]
    filled = sources_PR >= 0
    src = torch.where(filled, sources_PR.long(), m)  # row m: the empty slot's row
    scales = (None if x_scale_MG is None else
              torch.cat([x_scale_MG.float(), x_scale_MG.new_zeros(1, x_scale_MG.shape[1],
                                                                  dtype=torch.float32)])[src])
    if x_MH.element_size() == 1:  # fp8 rows: moved as their bytes
        x_MH = x_MH.view(torch.uint8)
    x = torch.cat([x_MH, x_MH.new_zeros(1, x_MH.shape[1])])[src]
    ids = torch.cat([ids_MK.to(torch.int32), ids_MK.new_full((1, ids_MK.shape[1]), -1,
                                                              dtype=torch.int32)])[src]
    weights = torch.cat([weights_MK.float(), weights_MK.new_zeros(1, weights_MK.shape[1],
                                                                  dtype=torch.float32)])[src]
    owner = torch.arange(p, device=ids.device)[:, None, None]
    own = (ids >= 0) & (ids // experts_per_rank == owner)
    return x, torch.where(own, ids, -1), weights, scales


def sum_back(back_NH: torch.Tensor, y_NH: torch.Tensor, slots_MP: torch.Tensor,
             out_MH: torch.Tensor, rank: int) -> None:
    """As exchange.sum_back: each row's results summed in fp32 in rank order, this rank's own
    from y_NH."""
    m, p = slots_MP.shape
    r = back_NH.shape[0] // max(p, 1)
    acc = torch.zeros(out_MH.shape, dtype=torch.float32, device=out_MH.device)
    for q in range(p):
        s = slots_MP[:, q].long()
        got = (y_NH if q == rank else back_NH)[(q * r + s).clamp(min=0)].float()
        acc += torch.where((s >= 0)[:, None], got, 0.0)
    out_MH.copy_(acc)
