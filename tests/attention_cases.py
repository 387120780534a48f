"""The phases the attention backend tests run over one KV pool: prompts, the chunks after them
(a cached prefix), then decode steps, every request of a step batched together."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from moeserve.batch.forward_batch import ForwardBatch, ForwardMode, prepare_batch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def compare_phases(lens: Sequence[int], split: Sequence[int], req_rows: Sequence[int], rows,
                   pool, seqs: Sequence[Sequence[torch.Tensor]],
                   attend: Callable[[ForwardBatch, list[torch.Tensor]],
                                    tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """Request i runs its first split[i] tokens, then up to 3 before its end (after that
    prefix), then three decode steps. attend(fb, parts) -> (got, want) for a step, parts[k]
    being the step's rows of every seqs[i][k] (seqs[i]: request i's per-token inputs, whole
    length lens[i]). Returns the relative error of each step."""
    errors = []

    def step(mode: ForwardMode, starts: list[int], ends: list[int]) -> None:
        new = [list(range(e - s)) for s, e in zip(starts, ends)]
        fb = prepare_batch(mode, new, starts, req_rows, rows, pool)
        parts = [torch.cat([seq[k][s:e] for seq, s, e in zip(seqs, starts, ends)])
                 for k in range(len(seqs[0]))]
        got, want = attend(fb, parts)
        assert torch.isfinite(got).all()
        errors.append(rel_err(got, want))

    step(ForwardMode.EXTEND, [0] * len(lens), list(split))
    step(ForwardMode.EXTEND, list(split), [s - 3 for s in lens])
    for back in (3, 2, 1):
        step(ForwardMode.DECODE, [s - back for s in lens], [s - back + 1 for s in lens])
    return errors


def replay_decode_graph(rows, pool, bucket: int, q: torch.Tensor,
                        forward: Callable[[ForwardBatch], torch.Tensor], lens: Sequence[int]
                        ) -> tuple[torch.Tensor, ForwardBatch]:
    """forward(fb) captured in a CUDA graph for a decode bucket of padded rows (the dummy
    request row, the dummy slot, length 1), then replayed twice (q redrawn each time) with its
    first len(lens) rows made requests of those lengths. Returns (the graph's output, a plain
    ForwardBatch of the real rows, to compute what they should be)."""
    from moeserve.batch.kv_cache import DUMMY_REQ_ROW, DUMMY_SLOT

    i64 = dict(dtype=torch.int64, device=q.device)
    loc = torch.full((bucket,), DUMMY_SLOT, **i64)
    req = torch.full((bucket,), DUMMY_REQ_ROW, **i64)
    seq = torch.ones(bucket, **i64)
    fb = ForwardBatch(ForwardMode.DECODE, torch.zeros(bucket, **i64), seq - 1, loc, req, seq,
                      seq - 1, torch.ones(bucket, **i64), rows.table, pool,
                      return_all_logits=True)
    out = forward(fb)  # warm-up: compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward(fb)

    real = []
    for length in lens:
        row = rows.alloc()
        rows.write(row, 0, pool.alloc(length))
        real.append(row)
    new_slots = torch.tensor([int(rows.table[row, length - 1]) for row, length in
                              zip(real, lens)], **i64)
    k = len(lens)
    req[:k], seq[:k], loc[:k] = torch.tensor(real, **i64), torch.tensor(lens, **i64), new_slots
    for _ in range(2):  # twice: the replay reads the inputs anew each time
        q.normal_()
        graph.replay()
    torch.cuda.synchronize()
    plain = ForwardBatch.from_requests(ForwardMode.DECODE, [[0]] * k, [x - 1 for x in lens],
                                       real, new_slots, rows.table, pool)
    return out, plain
